"""A TCP listener in its own process, so tests can measure its RSS and starve its fds.

Usage: python -m tests.dataplane.proxy_child --backend HOST:PORT [--nofile N] [--extra-fds N]
Prints ``PORT <n> NOFILE <n>`` once listening. Each line on stdin is answered with one JSON
line: ``stats`` (active connections, accept pauses, VmRSS in KiB, failed dials), ``hog`` (open files until
the fd table is full; how many), ``unhog N`` (close N of those). EOF on stdin shuts the
listener down and exits. ``--extra-fds`` opens that many files first, to move where the fd
limit falls.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import sys

import uvloop

from uproxy import metrics
from uproxy.dataplane.balancer import Balancer
from uproxy.dataplane.limits import raise_nofile_limit
from uproxy.dataplane.settings import DataplaneSettings
from uproxy.dataplane.tcp import TcpListener
from uproxy.model import Endpoint, Protocol, ServicePort, ServicePortName, Traffic


def rss_kib() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:  # out of fds, in the EMFILE test
        pass
    return -1


def accept_pauses() -> float:
    return sum(tally.value for _, tally in metrics.ACCEPT_PAUSED.series())


def hog(held: list[int]) -> None:
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass


async def main(backend: str, nofile: int | None, extra_fds: int) -> None:
    if nofile is not None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    limit = raise_nofile_limit()
    extra = [os.open(os.devnull, os.O_RDONLY) for _ in range(extra_fds)]
    host, port = backend.rsplit(":", 1)
    name = ServicePortName("default", "child", "", Protocol.TCP)
    settings = DataplaneSettings()
    balancer = Balancer(name, settings=settings)
    balancer.update(ServicePort(name=name, port=80), [Endpoint(host, int(port))])
    listener = await TcpListener.open(
        name=name,
        balancer=balancer,
        traffic=Traffic.CLUSTER,
        host="127.0.0.1",
        port=0,
        settings=settings,
    )
    print(f"PORT {listener.port} NOFILE {limit}", flush=True)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    hogged: list[int] = []
    while line := await reader.readline():
        cmd, *args = line.split()
        if cmd == b"stats":
            stats = {
                "active": listener.active,
                "paused": accept_pauses(),
                "rss_kib": rss_kib(),
                "dials_failed": metrics.DIAL_ATTEMPTS.labels("failed").value,
            }
            print(json.dumps(stats), flush=True)
        elif cmd == b"hog":
            hog(hogged)
            print(json.dumps({"hogged": len(hogged)}), flush=True)
        elif cmd == b"unhog":
            for _ in range(min(int(args[0]), len(hogged))):
                os.close(hogged.pop())
            print(json.dumps({"hogged": len(hogged)}), flush=True)
    await listener.shutdown(1.0)
    for fd in extra + hogged:
        os.close(fd)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", required=True)
    parser.add_argument("--nofile", type=int)
    parser.add_argument("--extra-fds", type=int, default=0)
    parser.add_argument("--profile", help="write a cProfile of the run to this file")
    args = parser.parse_args()
    if args.profile:
        import cProfile

        cProfile.run("uvloop.run(main(args.backend, args.nofile, args.extra_fds))", args.profile)
    else:
        uvloop.run(main(args.backend, args.nofile, args.extra_fds))
