"""How long an iptables-nft rules sync holds a CPU, as it is and written in one commit.

The kernel takes an nf_tables commit in one piece without giving the CPU away (on a kernel
without preemption), so whatever else runs on that CPU waits: a relay, a client, a backend.
This measures it the way a relay would feel it: a process on the same CPU as uproxy's
``iptables-nft-restore`` sleeps 0.5 ms at a time, and its worst oversleep while a sync runs
is the longest the CPU was held. Each case runs as uproxy does it and, beside it, with the
one-commit write the splits replace:

- **live rewrite**: a fifth of the services on other proxy ports, every jump in place:
  new chains filled beside the live ones and swapped in, or one commit;
- **edits**: one service in 60 on other proxy ports: edits spread over commits, or one;
- **after a foreign commit**: somebody commits a rule of theirs, then one service changes:
  uproxy's chains read back and the change edited in, or the chains rewritten in one commit;
- **idle**: no sync at all (the floor of the measure on this machine).

It runs the real backend in a throwaway network namespace, uproxy and the sleeper both on
CPU 0. Run as root from the repository root: ``python -m bench.holds [--services 10000]``.
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
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import Any

from bench import netns
from uproxy.model import Protocol, ServicePortName
from uproxy.rules import command, restore as restore_backend
from uproxy.rules.base import Portal, PortalKind

HOST_IP = "10.200.3.1"
CPU = "0"
INNER_TIMEOUT_S = 900
SLEEP_S = 0.0005

# The sleeper: sleeps SLEEP_S at a time until SIGUSR1, then prints its worst oversleep (ms).
_SLEEPER = f"""
import signal, sys, time
done = []
signal.signal(signal.SIGUSR1, lambda *a: done.append(1))
print("ready", flush=True)
worst = 0.0
while not done:
    t = time.monotonic()
    time.sleep({SLEEP_S})
    worst = max(worst, time.monotonic() - t - {SLEEP_S})
print(f"{{worst * 1000:.1f}}", flush=True)
"""


def portals(count: int, moved: int = 0) -> list[Portal]:
    """``count`` ClusterIP portals; every ``count // moved``-th of the first ones (``moved``
    in all) on another proxy port."""
    step = count // moved if moved else 0
    out = []
    for i in range(count):
        name = ServicePortName("bench", f"svc-{i}", "http", Protocol.TCP)
        ip = f"10.{96 + i // 65536}.{(i // 256) % 256}.{i % 256}"
        base = 40000 if step and i % step == 0 and i // step < moved else 20000
        out.append(Portal(name, PortalKind.CLUSTER_IP, ip, 80, base + i % 20000))
    return out


async def held(work: Callable[[], Awaitable[None]]) -> tuple[float, float]:
    """The worst oversleep (ms) of a sleeper on CPU 0 while ``work`` runs, and its wall time."""
    sleeper = await asyncio.create_subprocess_exec(
        "taskset", "-c", CPU, sys.executable, "-c", _SLEEPER, stdout=asyncio.subprocess.PIPE
    )
    assert sleeper.stdout is not None
    await sleeper.stdout.readline()  # ready
    await asyncio.sleep(0.2)
    start = time.perf_counter()
    await work()
    took = time.perf_counter() - start
    await asyncio.sleep(0.05)
    sleeper.send_signal(signal.SIGUSR1)
    out, _ = await asyncio.wait_for(sleeper.communicate(), timeout=10)
    return float(out.decode().strip()), took


async def case(services: int, name: str, split: bool) -> dict[str, Any]:
    """One case, from a fresh sync of ``services``; ``split``: as uproxy writes it."""
    backend = restore_backend.RestoreBackend(host_ip=HOST_IP, mode="nft", dial_mark=0x4000)
    saved = (restore_backend.REWRITE_CHUNK, restore_backend.EDIT_COMMIT_COST)
    module = vars(restore_backend)  # the one-commit cases swap some of its parts
    saved_holds = module["holds"]
    try:
        await backend.sync(portals(services))
        if not split:
            restore_backend.REWRITE_CHUNK = None  # type: ignore[assignment]
            restore_backend.EDIT_COMMIT_COST = None  # type: ignore[assignment]
        commits = backend.commits
        if name == "live rewrite":
            worst, took = await held(lambda: backend.sync(portals(services, services // 5)))
        elif name == "edits":
            worst, took = await held(lambda: backend.sync(portals(services, services // 60)))
        elif name == "after a foreign commit":
            if not split:  # what a sync did before reading back: rewrite
                module["holds"] = lambda *args: False
            await command.run(["iptables-nft", "-w", "-A", "FORWARD", "-j", "ACCEPT"])
            worst, took = await held(lambda: backend.sync(portals(services, 1)))
        else:
            worst, took = await held(lambda: asyncio.sleep(1.0))
        if not await backend.verify():
            raise RuntimeError(f"{name}: the rules do not match after the sync")
        return {"held_ms": worst, "sync_s": took, "commits": backend.commits - commits}
    finally:
        restore_backend.REWRITE_CHUNK, restore_backend.EDIT_COMMIT_COST = saved
        module["holds"] = saved_holds
        await backend.cleanup()
        await command.run(["iptables-nft", "-w", "-F", "FORWARD"], check=False)


CASES = ("live rewrite", "edits", "after a foreign commit", "idle")


async def inner(services: int, rounds: int) -> dict[str, Any]:
    out: dict[str, Any] = {name: {"split": [], "one": []} for name in CASES}
    for _ in range(rounds):
        for name in CASES:
            for split in (True, False) if name != "idle" else (True,):
                out[name]["split" if split else "one"].append(await case(services, name, split))
    return out


def outer(services: int, rounds: int, out: str | None) -> int:
    if os.geteuid() != 0:
        print("needs root (network namespaces, iptables)", file=sys.stderr)
        return 1
    ns = f"uproxy-holds-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        argv = ["ip", "netns", "exec", ns, "taskset", "-c", CPU, sys.executable, "-m"]
        argv += ["bench.holds", "--inner", "--services", str(services), "--rounds", str(rounds)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=INNER_TIMEOUT_S)
    finally:
        # The inner run and its commands first, on an interrupt: a namespace with a process
        # in it outlives its name.
        netns.delete(ns)
    if done.returncode != 0:
        print(f"failed: {done.stderr.strip()}", file=sys.stderr)
        return 1
    result = json.loads(done.stdout)
    if out:
        with open(out, "w") as f:
            json.dump({"services": services, "rounds": rounds, "cases": result}, f, indent=1)
    print(f"{services:,} services, {rounds} rounds; CPU held: a sleeper's worst oversleep")
    print("| case | as uproxy writes it | in one commit |")
    print("|---|---|---|")
    for name in CASES:
        cells = [name]
        for how in ("split", "one"):
            runs = result[name][how]
            if not runs:
                cells.append("-")
                continue
            held_ms = ", ".join(f"{r['held_ms']:.0f}" for r in runs)
            sync_s = ", ".join(f"{r['sync_s']:.2f}" for r in runs)
            cells.append(f"{held_ms} ms held; {sync_s} s, {runs[0]['commits']} commits")
        print("| " + " | ".join(cells) + " |")
    return 0


def main() -> int:
    # No docstring under PYTHONOPTIMIZE=2, which the bench sets for its children.
    parser = argparse.ArgumentParser(
        prog="python -m bench.holds", description=(__doc__ or "").partition("\n")[0]
    )
    parser.add_argument("--services", type=int, default=10000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", help="write the figures as JSON here")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not 60 <= args.services <= 20000 or not 1 <= args.rounds <= 5:
        parser.error("--services is 60 to 20,000 and --rounds 1 to 5")
    if args.inner:
        json.dump(asyncio.run(inner(args.services, args.rounds)), sys.stdout)
        return 0
    # SIGTERM unwinds like Ctrl-C: the namespace is deleted.
    signal.signal(signal.SIGTERM, _terminate)
    try:
        return outer(args.services, args.rounds, args.out)
    except KeyboardInterrupt:
        print("interrupted; namespace deleted", file=sys.stderr)
        return 130


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
