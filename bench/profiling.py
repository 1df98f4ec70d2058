"""Where uproxy's time goes on the connection-rate run: py-spy samples, summarised.

The process sampled is the one that relays: uproxy's data-plane worker (the control process
only follows the services file meanwhile).

py-spy attaches to the running proxy from outside (no code change, no restart) and samples its
stacks with native frames, so time in uvloop's C code and in system calls is named rather than
charged to the Python line that called it. Native sampling pauses the proxy for each sample, so
the profiled run's own rate is lower than the measured one (it is reported apart).
Without permission for that, Python-only non-blocking sampling is the fallback. The collapsed
stacks are kept raw next to a summary: time by kind (system calls, garbage collector, the rest),
the frames most often on top of the stack (self) and uproxy's functions anywhere in it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.backends import Backends
from bench.peers import Context, Uproxy, ports_for
from bench.proctree import tree
from bench.progress import Progress

_LINE = re.compile(r":\d+\)$")
PROFILE_PORTS_INDEX = 12  # after the peers' port blocks
# Frames on every stack (interpreter start, the loop's run) say nothing about the cost.
BASE_FRAME_SHARE = 0.97


def _frame(name: str) -> str:
    """``handle (uproxy/dataplane/tcp.py:120)`` -> ``handle (uproxy/dataplane/tcp.py)``."""
    name = _LINE.sub(")", name.strip())
    return re.sub(r"\(/.*?/(site-packages|lib/python3\.\d+)/", "(", name)


def _category(leaf: str) -> str:
    if "(libc.so" in leaf:
        return "system calls (kernel work: TCP on loopback, epoll)"
    if "gc_collect" in leaf:
        return "Python's cyclic garbage collector"
    return "user space: Python, uvloop, libuv"


def summarise(raw: Path, *, top: int = 20) -> dict[str, Any]:
    self_counts: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    cats: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count_s = line.rpartition(" ")
        if not stack or not count_s.isdigit():
            continue
        count = int(count_s)
        # The first frame is the thread's name ("process 123:..."), not code.
        frames = [f for f in (_frame(f) for f in stack.split(";")) if "(" in f]
        if not frames:
            continue
        total += count
        self_counts[frames[-1]] += count
        cats[_category(frames[-1])] += count
        for f in set(frames):
            incl[f] += count

    def rows(c: Counter[str], keep: Callable[[str, int], bool]) -> list[dict[str, Any]]:
        out = []
        for f, n in c.most_common():
            if keep(f, n):
                out.append({"frame": f, "samples": n, "pct": 100.0 * n / total if total else 0.0})
            if len(out) >= top:
                break
        return out

    def is_cost(f: str, n: int) -> bool:
        return n < BASE_FRAME_SHARE * total

    return {
        "samples": total,
        "categories": rows(cats, lambda f, n: True),
        "self": rows(self_counts, lambda f, n: True),
        "inclusive": rows(incl, is_cost),
        "uproxy": rows(incl, lambda f, n: "uproxy/" in f and is_cost(f, n)),
    }


def _record(pyspy: str, pid: int, raw: Path, seconds: int, *, native: bool) -> str | None:
    """Record ``seconds`` of stacks; None on success, else py-spy's complaint."""
    argv = [pyspy, "record", "--pid", str(pid), "--duration", str(seconds), "--format", "raw"]
    argv += ["--output", str(raw)]
    # Native frames (uvloop's C, libc's system calls) need the process paused per sample.
    argv += ["--native", "--rate", "100"] if native else ["--nonblocking", "--rate", "200"]
    rec = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 30, check=False)
    if rec.returncode != 0 or not raw.exists():
        return rec.stderr.strip()[-200:] or f"exit {rec.returncode}"
    return None


def find_pyspy() -> str | None:
    """py-spy on PATH, or beside this interpreter (a venv's bin/ is often not on PATH)."""
    found = shutil.which("py-spy")
    if found is None:
        beside = Path(sys.executable).parent / "py-spy"
        found = str(beside) if os.access(beside, os.X_OK) else None
    return found


def _relaying_process(root: int) -> tuple[int, str]:
    """The process that relays: uproxy's data-plane worker (the peer runs one), else the root
    (``--workers 0`` relays in the control process)."""
    below = tree(root)[1:]
    if below:
        return below[0], "uproxy's data-plane worker"
    return root, "uproxy"


def profile_conn_rate(
    ctx: Context,
    backends: Backends,
    scripts: dict[str, Path],
    *,
    out_dir: Path,
    seconds: int,
    progress: Progress,
) -> dict[str, Any]:
    pyspy = find_pyspy()
    if pyspy is None:
        progress.say("profile: py-spy is not installed (pip install py-spy); skipped")
        return {"skipped": "py-spy is not installed (pip install py-spy)"}
    peer = Uproxy("uvloop")
    running = peer.start(ctx, ports_for(PROFILE_PORTS_INDEX))
    raw = out_dir / "profile-connrate.collapsed.txt"
    try:
        load = subprocess.Popen(
            [
                "taskset",
                "-c",
                str(ctx.cores.load),
                "wrk",
                "-t1",
                "-c16",
                f"-d{2 * seconds + 4}s",
                "-s",
                str(scripts["conn"]),
                f"http://127.0.0.1:{running.ports.http}/",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        try:
            pid, process = _relaying_process(running.pids[0])
            native = True
            problem = _record(pyspy, pid, raw, seconds, native=True)
            if problem:
                progress.say(f"profile: native stacks failed ({problem}); Python stacks only")
                native = False
                problem = _record(pyspy, pid, raw, seconds, native=False)
            load.send_signal(signal.SIGINT)  # wrk stops and reports on SIGINT
            out, _ = load.communicate(timeout=30)
        finally:
            if load.poll() is None:
                load.kill()
                load.wait()
        if problem:
            progress.say(f"profile: py-spy failed: {problem}")
            return {"skipped": f"py-spy failed: {problem}"}
    finally:
        peer.stop(ctx, running)
    summary = summarise(raw)
    for line in out.splitlines():
        if line.startswith("BENCHJSON "):
            summary["wrk"] = line.removeprefix("BENCHJSON ")
    summary["raw"] = raw.name
    summary["native"] = native
    summary["process"] = process
    progress.say(f"profile: {summary['samples']} samples written to {raw.name}")
    return summary
