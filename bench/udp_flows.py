"""Keep-alive round trips through uproxy while its UDP flows come and go by the thousand.

A userspace UDP proxy opens a flow (a connected socket to the endpoint) per client address
and port, and closes it once idle for ``--udp-timeout`` (250 ms). A resolver's queries each
leave from a new ephemeral port, so a node's DNS traffic through uproxy is thousands of
flows that open together and expire together; an endpoint that goes (a DNS pod rescheduled)
takes its share of them at once. Closing those sockets is the worker's work, on the loop
that relays everything else.

``python -m bench.udp_flows`` (no root needed; about a minute and a half): a uproxy of this tree
(``--services FILE --rules none --workers 1``, pinned to the second CPU) with two services:
``target`` (TCP), whose endpoint is an echo server, and ``dns`` (UDP), with two echo
endpoints. One client connection sends 64 bytes to ``target`` every millisecond and times
each echo (``big_service``'s probe); meanwhile, once a second, a burst of ``--burst``
queries reaches ``dns``, each from a socket of its own, and each is answered (the load and
its echo server below the probe on the first CPU, ``SCHED_IDLE``). With ``--change
endpoint`` every burst is followed, 100 ms later, by one of ``dns``'s two endpoints leaving
(the services file is swapped) and coming back at the next burst: its half of the flows goes
in the same pass. The clients and the echo servers run on the first CPU. The first burst
size (100) is the baseline.

Figures: p50 / p99 / p99.9 / max of the round trips and how many took over 2 and 5 ms, the
queries answered, and the worker's CPU per burst (``/proc``).
"""

from __future__ import annotations

import argparse
import json
import resource
import select
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.big_service import (
    ECHO,
    ECHO_PORT,
    MIDDLE_NOTE,
    TARGET_PORT,
    _children,
    _connect,
    _cpu_s,
    _service,
    _slice,
    interleaved,
    middle,
    on_first_cpu,
    round_trips,
    summary,
    tail_cells,
    tail_text,
    write_services,
)
from bench.cmdline import positive_float, positive_int, positive_ints

DNS_PORT = 18053  # laptop mode: the proxy port is the service port on 127.0.0.1
UDP_ECHO_PORTS = (18954, 18955)
BURST_EVERY_S = 1.0
CHANGE_AFTER_S = 0.1
ANSWER_WAIT_S = 0.5
UDP_ECHO = f"""
import socket, select
socks = []
for port in {UDP_ECHO_PORTS!r}:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    s.bind(("127.0.0.1", port))
    s.setblocking(False)
    socks.append(s)
ep = select.epoll()
for s in socks:
    ep.register(s.fileno(), select.EPOLLIN)
by_fd = {{s.fileno(): s for s in socks}}
while True:
    for fd, _ in ep.poll():
        s = by_fd[fd]
        while True:
            try:
                data, addr = s.recvfrom(2048)
            except BlockingIOError:
                break
            s.sendto(data, addr)
"""
CHANGES = ("none", "endpoint")
# The UDP load and its echo server share the first CPU with the probe and its TCP echo
# server, below them (SCHED_IDLE): the probe times the worker, not a queue on that CPU.
IDLE_CPU0 = ["taskset", "-c", "0", "chrt", "--idle", "0"]


def services_file(path: Path, both: bool) -> None:
    """``target``, and ``dns`` with both UDP endpoints or (``both`` false) the first alone."""
    dns = _service("dns", "10.96.0.10", DNS_PORT, UDP_ECHO_PORTS[0])
    dns["spec"]["ports"][0]["protocol"] = "UDP"
    docs: list[dict[str, Any]] = [
        _service("target", "10.96.0.1", TARGET_PORT, ECHO_PORT),
        _slice("target", 0, ["127.0.0.1"], ECHO_PORT),
        dns,
    ]
    for i, port in enumerate(UDP_ECHO_PORTS if both else UDP_ECHO_PORTS[:1]):
        endpoints = _slice("dns", i, ["127.0.0.1"], port)
        endpoints["ports"][0]["protocol"] = "UDP"
        docs.append(endpoints)
    write_services(path, docs)


def burst(count: int) -> int:
    """``count`` queries to ``dns``, each from a new socket; how many were answered."""
    socks = []
    try:
        for i in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK)
            socks.append(s)
            s.sendto(b"q%d" % i, ("127.0.0.1", DNS_PORT))
        waiting = {s.fileno(): s for s in socks}
        ep = select.epoll()
        try:
            for fd in waiting:
                ep.register(fd, select.EPOLLIN)
            deadline = time.monotonic() + ANSWER_WAIT_S
            while waiting and (left := deadline - time.monotonic()) > 0:
                for fd, _ in ep.poll(left):
                    ep.unregister(fd)
                    waiting.pop(fd).recv(2048)
        finally:
            ep.close()
        return count - len(waiting)
    finally:
        for s in socks:
            s.close()


def measure(queries: int, seconds: float, workdir: Path, change: str = "none") -> dict[str, float]:
    """One run: round trips for ``seconds`` while a burst of ``queries`` comes once a second."""
    live = workdir / "services.yaml"
    services_file(live, both=True)
    log = workdir / "uproxy.log"
    argv = [sys.executable, "-m", "uproxy.cli", "--services", str(live), "--rules", "none"]
    argv += ["--workers", "1", "--event-loop", "uvloop"]
    argv += ["--healthz-bind-address", "", "--metrics-bind-address", ""]
    started: list[subprocess.Popen[Any]] = []
    try:
        started.append(subprocess.Popen(["taskset", "-c", "0", sys.executable, "-c", ECHO]))
        started.append(subprocess.Popen([*IDLE_CPU0, sys.executable, "-c", UDP_ECHO]))
        with log.open("w") as err:
            proxy = subprocess.Popen(
                ["taskset", "-c", "1", *argv], stdout=subprocess.DEVNULL, stderr=err
            )
        started.append(proxy)
        conn = _connect(proxy, log)
        if burst(4) != 4:
            raise RuntimeError(f"dns did not answer: {log.read_text()[-2000:]}")
        time.sleep(2.0)  # settled: the start's work is over
        workers = _children(proxy.pid)
        cpu_before = sum(_cpu_s(w) for w in workers)
        # The load in a process of its own: in this one, its Python would hold the GIL
        # while the probe waits to time a round trip.
        load_argv = ["load", str(queries), str(seconds), change, str(live)]
        loader = subprocess.Popen(
            [*IDLE_CPU0, sys.executable, "-m", "bench.udp_flows", *load_argv],
            stdout=subprocess.PIPE,
            text=True,
        )
        started.append(loader)
        try:
            took = round_trips(conn, seconds)
        finally:
            conn.close()
        out, _ = loader.communicate(timeout=seconds + 30)
        answered = [int(n) for n in out.split()]
        cpu_after = sum(_cpu_s(w) for w in workers)
    finally:
        for proc in reversed(started):
            proc.terminate()
            proc.wait(30)
    return {
        "queries": queries,
        **summary(took),
        "bursts": len(answered),
        "answered": sum(answered) / max(1, len(answered) * queries),
        "worker_ms_per_burst": 1e3 * (cpu_after - cpu_before) / max(1, len(answered)),
    }


def load(queries: int, seconds: float, change: str, live: Path) -> None:
    """The load of one run: a burst a second for ``seconds``; prints each burst's answers."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # a burst's sockets
    end = time.monotonic() + seconds
    answered = []
    while time.monotonic() + BURST_EVERY_S < end:
        time.sleep(BURST_EVERY_S)
        if change == "endpoint":
            services_file(live, both=True)
        answered.append(burst(queries))
        if change == "endpoint":
            time.sleep(CHANGE_AFTER_S)
            services_file(live, both=False)
    print(*answered, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.udp_flows", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--burst", type=positive_ints, default="100,3000", help="queries per burst, baseline first"
    )
    parser.add_argument("--seconds", type=positive_float, default=15.0)
    parser.add_argument(
        "--runs", type=positive_int, default=2, help="runs per burst size, interleaved"
    )
    parser.add_argument("--change", choices=CHANGES, default="none", help="after each burst")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["load"]:
        load(int(argv[1]), float(argv[2]), argv[3], Path(argv[4]))
        return 0
    args = parser.parse_args(argv)
    if not on_first_cpu():
        return 2
    sizes: list[int] = args.burst
    results = interleaved(
        sizes,
        args.runs,
        "uproxy-udp-",
        lambda n, workdir: measure(n, args.seconds, workdir, args.change),
        lambda n, f: (
            f"bursts of {n:,}: {tail_text(f)} ({f['bursts']:.0f} bursts, "
            f"{100 * f['answered']:.1f} % answered); worker CPU per burst "
            f"{f['worker_ms_per_burst']:.0f} ms"
        ),
    )
    print(f"\n{MIDDLE_NOTE}")
    print("\n| queries per burst | p99 ms | p99.9 ms | max ms | over 2 ms | worker ms per burst |")
    print("|---|---|---|---|---|---|")
    for n in sizes:
        mid = middle([r for r in results if r["queries"] == n], "p999_ms")
        print(f"| {n:,} | {tail_cells(mid)} | {mid['worker_ms_per_burst']:.0f} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
