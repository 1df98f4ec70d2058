"""How long a rules sync takes, per backend, at 100 / 1,000 / 10,000 service ports.

Each backend runs in its own throwaway network namespace (so the host's tables are never
touched): a full sync from nothing, a repeat of the same sync (the periodic resync), one
incremental change at the largest size (one service port added), and ``check()``. Every
service port has a ClusterIP, so it installs two rules (from containers, from the host).

Run as root from the repository root: ``python -m bench.rules_sync [--sizes 100,1000,10000]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from types import FrameType
from typing import Any

from bench import netns
from uproxy.model import Protocol, ServicePortName
from uproxy.rules import make_backend
from uproxy.rules.base import Portal, PortalKind

BACKENDS = [("iptables-restore", "nft"), ("iptables-restore", "legacy"), ("iptables", "legacy")]
HOST_IP = "10.200.3.1"
INNER_TIMEOUT_S = 600


def portals(count: int, *, offset: int = 0) -> list[Portal]:
    out = []
    for i in range(offset, offset + count):
        name = ServicePortName("bench", f"svc-{i}", "http", Protocol.TCP)
        ip = f"10.{96 + i // 65536}.{(i // 256) % 256}.{i % 256}"
        out.append(Portal(name, PortalKind.CLUSTER_IP, ip, 80, 20000 + i % 40000))
    return out


async def timed(coro: Any) -> float:
    start = time.perf_counter()
    await coro
    return time.perf_counter() - start


async def inner(backend_name: str, mode: str, sizes: list[int]) -> dict[str, Any]:
    backend = make_backend(backend_name, host_ip=HOST_IP, iptables_mode=mode)
    result: dict[str, Any] = {"sizes": {}}
    try:
        for size in sizes:
            await backend.cleanup()
            wanted = portals(size)
            full = await timed(backend.sync(wanted))
            resync = await timed(backend.sync(wanted))
            check_s = await timed(backend.check())
            result["sizes"][str(size)] = {"full": full, "resync": resync, "check": check_s}
        largest = portals(sizes[-1])
        result["incremental"] = await timed(backend.sync(largest + portals(1, offset=sizes[-1])))
        if not await backend.check():
            raise RuntimeError("rules do not match after the incremental sync")
        await backend.cleanup()
    finally:
        await backend.close()
    return result


def outer(sizes: list[int]) -> int:
    if os.geteuid() != 0:
        print("needs root (network namespaces, iptables)", file=sys.stderr)
        return 1
    rows: list[tuple[str, dict[str, Any]]] = []
    for backend_name, mode in BACKENDS:
        ns = f"uproxy-bench-{os.getpid()}"
        subprocess.run(["ip", "netns", "add", ns], check=True)
        try:
            argv = ["ip", "netns", "exec", ns, sys.executable, "-m", "bench.rules_sync"]
            argv += ["--inner", "--backend", backend_name, "--mode", mode]
            argv += ["--sizes", ",".join(map(str, sizes))]
            done = subprocess.run(
                argv,
                capture_output=True,
                text=True,
                timeout=INNER_TIMEOUT_S,
            )
        finally:
            # Whatever still runs in it (the inner run and its rules commands, on an
            # interrupt) is killed first: a namespace with a process in it outlives its name.
            netns.delete(ns)
        if done.returncode != 0:
            print(f"{backend_name}/{mode} failed: {done.stderr.strip()}", file=sys.stderr)
            return 1
        rows.append((f"{backend_name} ({mode})", json.loads(done.stdout)))
    largest = sizes[-1]
    header = ["backend", *(f"full {n:,}" for n in sizes), f"resync {largest:,}"]
    header += [f"+1 at {largest:,}", f"check {largest:,}"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for label, res in rows:
        cells = [label, *(f"{res['sizes'][str(n)]['full']:.3f} s" for n in sizes)]
        cells.append(f"{res['sizes'][str(largest)]['resync']:.3f} s")
        cells.append(f"{res['incremental']:.3f} s")
        cells.append(f"{res['sizes'][str(largest)]['check']:.3f} s")
        print("| " + " | ".join(cells) + " |")
    return 0


def main() -> int:
    # No docstring under PYTHONOPTIMIZE=2, which the bench sets for its children.
    parser = argparse.ArgumentParser(
        prog="python -m bench.rules_sync", description=(__doc__ or "").partition("\n")[0]
    )
    parser.add_argument("--sizes", default="100,1000,10000")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--backend", default="iptables-restore", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="nft", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = sorted(int(s) for s in args.sizes.split(","))
    if args.inner:
        json.dump(asyncio.run(inner(args.backend, args.mode, sizes)), sys.stdout)
        return 0
    # SIGTERM (python -m bench stopping this) unwinds like Ctrl-C: the namespace is deleted.
    signal.signal(signal.SIGTERM, _terminate)
    try:
        return outer(sizes)
    except KeyboardInterrupt:
        print("interrupted; namespace deleted", file=sys.stderr)
        return 130


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
