"""How a burst of new connections spreads over uproxy's workers when it finds them idle.

A client's pool (a database's, gRPC's) opens its connections at once, or one after another,
and keeps them: whichever worker takes each one relays it for as long as it lives. The
workers share one listening socket per TCP proxy port, and every one of them is woken for a
new connection; the first one up takes what is queued (``uproxy.dataplane.spread`` says how
the others get their share).

``python -m bench.burst_spread`` (no root needed; under a minute): a uproxy of this tree
(``--services FILE --rules none --workers 2``, unpinned) in front of an echo server, both
CPUs to share with this load. Each burst opens ``N`` connections, either all at once
(non-blocking connects in a row) or one after another (each echoes a message before the
next opens), waits until the workers have taken them all, reads which worker holds each
(``ss -p``), closes them and lets the workers idle for ``--idle`` seconds.

Figures per burst size and pattern: the busier worker's share of each burst (median and
worst), and the bursts that went all to one worker.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.big_service import (
    ECHO,
    ECHO_PORT,
    MESSAGE,
    TARGET_PORT,
    _children,
    _connect,
    _service,
    _slice,
    write_services,
)
from bench.cmdline import positive_int, positive_ints

PATTERNS = ("at once", "one after another")
TAKEN_TIMEOUT_S = 5.0
SETTLE_S = 0.05  # far longer than the workers take to share a burst (``spread.DEFER_S``)


def owners(port: int) -> collections.Counter[int]:
    """The established connections to ``port`` that a process holds, by its pid (a
    connection still in the accept queue has none)."""
    out = subprocess.run(
        ["ss", "-tnpH", "state", "established", "sport", f"= :{port}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return collections.Counter(int(pid) for pid in re.findall(r"pid=(\d+)", out))


def burst(n: int, pattern: str) -> collections.Counter[int]:
    """``n`` connections to the proxy port, kept until every one is taken; how many each
    process (a worker) took."""
    clients: list[socket.socket] = []
    try:
        for _ in range(n):
            if pattern == "at once":
                c = socket.socket()
                clients.append(c)
                c.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    c.connect(("127.0.0.1", TARGET_PORT))
            else:
                c = socket.create_connection(("127.0.0.1", TARGET_PORT), timeout=5)
                clients.append(c)
                c.sendall(MESSAGE)
                got = 0
                while got < len(MESSAGE):
                    got += len(c.recv(len(MESSAGE)))
        # Not a look before the workers are done: ``ss`` is a process, and one started at
        # once would compete with them for the CPUs.
        time.sleep(SETTLE_S)
        deadline = time.monotonic() + TAKEN_TIMEOUT_S
        while sum((held := owners(TARGET_PORT)).values()) < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the workers took {sum(held.values())} of {n}")
            time.sleep(0.01)
        return held
    finally:
        for c in clients:
            c.close()


def measure(sizes: list[int], bursts: int, idle_s: float, workdir: Path) -> list[dict[str, Any]]:
    live = workdir / "services.yaml"
    write_services(
        live,
        [
            _service("target", "10.96.0.1", TARGET_PORT, ECHO_PORT),
            _slice("target", 0, ["127.0.0.1"], ECHO_PORT),
        ],
    )
    log = workdir / "uproxy.log"
    argv = [sys.executable, "-m", "uproxy.cli", "--services", str(live), "--rules", "none"]
    argv += ["--workers", "2", "--event-loop", "uvloop"]
    argv += ["--healthz-bind-address", "", "--metrics-bind-address", ""]
    started: list[subprocess.Popen[Any]] = []
    rows = []
    try:
        started.append(subprocess.Popen([sys.executable, "-c", ECHO]))
        with log.open("w") as err:
            proxy = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err)
        started.append(proxy)
        _connect(proxy, log).close()
        workers = set(_children(proxy.pid))
        for pattern in PATTERNS:
            for n in sizes:
                splits = []
                for _ in range(bursts):
                    time.sleep(idle_s)
                    held = burst(n, pattern)
                    if not set(held) <= workers:
                        raise RuntimeError(f"connections held by others than the workers: {held}")
                    splits.append(sorted([*held.values(), 0, 0], reverse=True)[:2])
                shares = sorted(s[0] / n for s in splits)
                rows.append(
                    {
                        "pattern": pattern,
                        "connections": n,
                        "splits": splits,
                        "busier_median": shares[(len(shares) - 1) // 2],
                        "busier_worst": shares[-1],
                        "all_on_one": sum(s[1] == 0 for s in splits),
                    }
                )
                print(
                    f"{pattern}, {n}: {' '.join('/'.join(map(str, s)) for s in splits)}", flush=True
                )
    finally:
        for proc in reversed(started):
            proc.terminate()
            proc.wait(30)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.burst_spread", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--sizes", type=positive_ints, default="4,8,16,32,64", help="connections per burst"
    )
    parser.add_argument(
        "--bursts", type=positive_int, default=8, help="bursts per size and pattern"
    )
    parser.add_argument("--idle", type=float, default=0.3, help="seconds between bursts")
    args = parser.parse_args(argv)
    sizes: list[int] = args.sizes
    with tempfile.TemporaryDirectory(prefix="uproxy-spread-") as tmp:
        rows = measure(sizes, args.bursts, args.idle, Path(tmp))
    print("\n| pattern | connections | busier worker's share, median | worst | all on one worker |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['pattern']} | {r['connections']} | {100 * r['busier_median']:.0f} % | "
            f"{100 * r['busier_worst']:.0f} % | {r['all_on_one']} of {len(r['splits'])} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
