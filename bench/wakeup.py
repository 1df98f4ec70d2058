"""How long this machine takes to wake a process blocked on a CPU that went idle.

A proxy on its own CPU is woken there for each request on an idle connection and again for the
endpoint's answer; kernel DNAT does the whole path on the CPU the packet arrived on and wakes
no other. Where an idle CPU is slow to wake (a virtual machine whose idle vCPUs halt, and
whose host has to run them again), every proxy's keep-alive latency carries that cost twice,
whatever the proxy does, and ratios to kernel DNAT move with the machine. This probe measures
it, so that a run's figures can be read with it: a process blocked on a pipe on the proxy's
CPU, woken once a millisecond by a write from the load CPU (the writer spins between writes,
so only the sleeping side can be idle), timed from the write to the read's return. Then the
same with that CPU kept busy by a SCHED_IDLE spinner, which gives way at once to any woken
task: what the wake costs when the CPU need not wake.

    python -m bench.wakeup [--sleeper 0] [--waker 1] [--wakes 1000]   (prints JSON)
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import time
from typing import Any

from bench.procs import run_to_end

WAKES = 1000
GAP_S = 0.001
TIMEOUT_S = 30.0


def _one(sleeper: int, waker: int, wakes: int) -> list[int]:
    """Nanoseconds from each write to the sleeper's read (the sleeper is a forked child)."""
    r, w = os.pipe()
    back_r, back_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the sleeper: read, note the delay, and send them all back at the end
        try:
            os.sched_setaffinity(0, {sleeper})
            os.close(w)
            out = bytearray()
            for _ in range(wakes):
                sent = struct.unpack("q", os.read(r, 8))[0]
                out += struct.pack("q", time.monotonic_ns() - sent)
            with os.fdopen(back_w, "wb") as f:
                f.write(out)
        finally:
            os._exit(0)
    os.close(r)
    os.close(back_w)
    os.sched_setaffinity(0, {waker})
    time.sleep(0.05)  # the child is on its CPU and blocked
    for _ in range(wakes):
        until = time.monotonic() + GAP_S
        while time.monotonic() < until:  # spin: only the sleeper's CPU may go idle
            pass
        os.write(w, struct.pack("q", time.monotonic_ns()))
    with os.fdopen(back_r, "rb") as f:
        data = f.read()
    os.close(w)
    os.waitpid(pid, 0)
    return [v for (v,) in struct.iter_unpack("q", data)]


def _quantiles(ns: list[int]) -> dict[str, float]:
    s = sorted(ns)
    if not s:
        return {}

    def q(p: float) -> float:
        return s[min(len(s) - 1, int(p * len(s)))] / 1000

    return {"p50_us": q(0.5), "p90_us": q(0.9), "p99_us": q(0.99), "max_us": s[-1] / 1000}


def measure(sleeper: int, waker: int, wakes: int = WAKES) -> dict[str, Any]:
    """The delays with the sleeper's CPU idle between wakes, then kept busy."""
    idle = _quantiles(_one(sleeper, waker, wakes))
    spinner = subprocess.Popen(
        ["taskset", "-c", str(sleeper), "chrt", "-i", "0", "sh", "-c", "while :; do :; done"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(0.05)
        busy = _quantiles(_one(sleeper, waker, wakes)) if spinner.poll() is None else {}
    finally:
        spinner.kill()
        spinner.wait()
    driver = "?"
    try:
        with open("/sys/devices/system/cpu/cpuidle/current_driver") as f:
            driver = f.read().strip()
    except OSError:
        pass
    return {
        "sleeper_cpu": sleeper,
        "waker_cpu": waker,
        "wakes": wakes,
        "idle": idle,
        "busy": busy,
        "cpuidle_driver": driver,
    }


def probe(sleeper: int, waker: int) -> dict[str, Any]:
    """``measure`` in a child process of its own (it forks; bounded in time); {"error": ...}
    when it cannot run (one CPU, no taskset)."""
    if sleeper == waker:
        return {"error": "one CPU: nothing to wake on another"}
    argv = [sys.executable, "-m", "bench.wakeup", "--sleeper", str(sleeper)]
    argv += ["--waker", str(waker)]
    try:
        # On an interrupt its spinner goes with it (its process group).
        done = run_to_end(argv, timeout_s=TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as e:
        return {"error": str(e)}
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["?"])[-1]}
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def describe(w: dict[str, Any] | None) -> str:
    """One sentence for a report (empty for a run from before the probe)."""
    if not w:
        return ""
    if "error" in w:
        return f"Waking an idle CPU: not measured ({w['error']})."
    idle, busy = w.get("idle", {}), w.get("busy", {})
    text = (
        f"Waking a process blocked on the proxy's CPU (CPU {w['sleeper_cpu']}) from CPU "
        f"{w['waker_cpu']}: p50 {idle.get('p50_us', 0):.0f} us, p99 "
        f"{idle.get('p99_us', 0):.0f} us with that CPU idle between wakes"
    )
    if busy:
        text += f", p99 {busy.get('p99_us', 0):.0f} us with it kept busy"
    return (
        text + f" (cpuidle driver {w.get('cpuidle_driver', '?')}; `python -m bench.wakeup`). "
        "A proxy hop pays an idle CPU's wake-up up to twice per keep-alive request; kernel "
        "DNAT pays none."
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.wakeup",
        description="How long this machine takes to wake a process blocked on an idle CPU",
    )
    p.add_argument("--sleeper", type=int, default=0)
    p.add_argument("--waker", type=int, default=1)
    p.add_argument("--wakes", type=int, default=WAKES)
    args = p.parse_args(argv)
    print(json.dumps(measure(args.sleeper, args.waker, args.wakes)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
