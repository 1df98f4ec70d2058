"""What a proxy's process tree costs, read from /proc: CPU and memory, per role.

A proxy is not always one process. uproxy is a control process and its data-plane workers,
nginx a master and its workers, HAProxy one process with several threads, socat a process per
connection. A figure per proxy must cover all of it, and nothing else:

- **Which processes.** The tree is found from the parent pid in every ``/proc/PID/stat``, not
  from ``/proc/PID/task/TID/children``: that file exists only in kernels built with
  CONFIG_PROC_CHILDREN (without it a tree silently shrinks to its root, and a proxy's workers
  drop out of its figures), and the kernel documents it as unreliable while children come and
  go. Reading every process's stat takes a few milliseconds.
- **Threads.** utime and stime in ``/proc/PID/stat`` cover every thread of the process, the
  threads that ended included: HAProxy's threads need nothing more. The thread count is kept,
  and the root's CPU per thread, so a table can show how many threads did the work.
- **Processes that ended.** A child's CPU reaches its parent's ``cutime``/``cstime`` only once
  the parent has waited for it; until then the child (a zombie, if it has exited) still shows
  it in its own stat. So the sum, over the processes alive at one moment, of their own CPU and
  of what they reaped counts every process that ever ran in the tree exactly once, and the
  difference of two such sums is the tree's CPU in between: a worker's while it runs, a rules
  command's once it is reaped. (A process that daemonises hands its CPU to init and is lost;
  no peer does that.)
- **Waiting.** The time the tree's threads were runnable but waited for a CPU (the second
  field of each thread's ``schedstat``): near zero on a quiet machine; when it is not, other
  work shared the proxy's CPUs and its latency figures measure that too.
- **Roles.** The root (uproxy's control process, nginx's master, HAProxy, each socat) is
  *main*; the processes under it alive at both ends of a run are *workers* (uproxy's and
  nginx's); the rest is *other*: children reaped or started during the run (uproxy's rules
  commands, socat's per-connection children, a worker that died and was replaced).
- **Memory.** ``VmHWM`` (the peak resident set) and ``VmRSS`` per role. Summed over processes
  they count the pages the processes share (the interpreter, libraries, uproxy's counter
  memory) once per process; the tree's proportional set size (``Pss`` in ``smaps_rollup``,
  shared pages split between their users) is the honest total now, given beside them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")
PROC = Path("/proc")


@dataclass(frozen=True, slots=True)
class ProcCpu:
    """One process, from its stat: CPU in clock ticks, its own and what it reaped."""

    pid: int
    ppid: int
    start: int  # start time in ticks since boot: tells a reused pid apart
    user: int
    system: int
    reaped_user: int
    reaped_system: int
    threads: int

    @property
    def own(self) -> int:
        return self.user + self.system

    @property
    def reaped(self) -> int:
        return self.reaped_user + self.reaped_system


def _stat_fields(pid: int | str, task: str | None = None) -> list[str] | None:
    path = PROC / str(pid) / "stat" if task is None else PROC / str(pid) / "task" / task / "stat"
    try:
        text = path.read_text()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: the fields start after the last ")".
    return text[text.rindex(")") + 2 :].split()


def _parse(pid: int, f: list[str]) -> ProcCpu:
    # f[0] is field 3 (state); ppid=4, utime=14, stime=15, cutime=16, cstime=17,
    # num_threads=20, starttime=22 (proc(5)).
    return ProcCpu(
        pid=pid,
        ppid=int(f[1]),
        start=int(f[19]),
        user=int(f[11]),
        system=int(f[12]),
        reaped_user=int(f[13]),
        reaped_system=int(f[14]),
        threads=int(f[17]),
    )


def scan() -> dict[int, ProcCpu]:
    """Every process visible in /proc now."""
    out: dict[int, ProcCpu] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(entry.name)
        if fields is not None:
            out[int(entry.name)] = _parse(int(entry.name), fields)
    return out


def _descendants(procs: dict[int, ProcCpu], root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for p in procs.values():
        children.setdefault(p.ppid, []).append(p.pid)
    seen, todo = [], [root]
    while todo:
        pid = todo.pop()
        seen.append(pid)
        todo.extend(children.get(pid, ()))
    return seen


def tree(root: int) -> list[int]:
    """``root`` and every descendant alive now (``root`` first); [] when ``root`` is gone."""
    procs = scan()
    return _descendants(procs, root) if root in procs else []


@dataclass(frozen=True, slots=True)
class Sample:
    """One proxy tree at one moment."""

    root: int
    procs: dict[int, ProcCpu]
    root_threads: dict[int, int]  # thread id -> CPU ticks, the root's threads
    waited_ns: int  # time the tree's threads were runnable but not running (schedstat)

    @property
    def total(self) -> int:
        return sum(p.own + p.reaped for p in self.procs.values())


def _thread_ticks(pid: int) -> dict[int, int]:
    out: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for task in (PROC / str(pid) / "task").iterdir():
            fields = _stat_fields(pid, task.name)
            if fields is not None:
                out[int(task.name)] = int(fields[11]) + int(fields[12])
    return out


def _waited_ns(pids: Iterable[int]) -> int:
    """Run-queue wait of every thread of ``pids`` (schedstat's second field), in ns."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for task in (PROC / str(pid) / "task").iterdir():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    total += int((task / "schedstat").read_text().split()[1])
    return total


def sample(roots: Iterable[int]) -> list[Sample]:
    """Each root's tree now, from one scan of /proc."""
    everything = scan()
    out = []
    for root in roots:
        pids = _descendants(everything, root) if root in everything else []
        procs = {p: everything[p] for p in pids if p in everything}
        out.append(Sample(root, procs, _thread_ticks(root), _waited_ns(procs)))
    return out


@dataclass(slots=True)
class Cpu:
    """CPU seconds of proxy trees between two samples, split by kind and by role."""

    user_s: float = 0.0
    system_s: float = 0.0
    main_s: float = 0.0
    workers_s: float = 0.0
    other_s: float = 0.0
    processes: int = 0
    threads: int = 0
    waited_s: float = 0.0  # runnable but waiting for a CPU (threads alive at both ends)
    main_threads_s: list[float] = field(default_factory=list)
    # Roots gone by the second sample: their CPU since the first went with them (to whoever
    # reaped them), so their trees are left out rather than counted as negative time.
    vanished: list[int] = field(default_factory=list)

    @property
    def total_s(self) -> float:
        return self.user_s + self.system_s

    def figures(self) -> dict[str, float]:
        """The run's raw figures (``cpu_s``, the kernel part, each role, the tree's size)."""
        out = {
            "cpu_s": self.total_s,
            "cpu_user_s": self.user_s,
            "cpu_kernel_s": self.system_s,
            "cpu_main_s": self.main_s,
            "cpu_workers_s": self.workers_s,
            "cpu_other_s": self.other_s,
            "processes": float(self.processes),
            "threads": float(self.threads),
            "waited_s": self.waited_s,
        }
        busy = [t for t in self.main_threads_s if t >= 0.1 * max(self.main_s, 1e-9)]
        out["main_threads_busy"] = float(len(busy))
        return out


def _between_one(before: Sample, after: Sample, into: Cpu) -> None:
    def user_system(s: Sample) -> tuple[int, int]:
        u = sum(p.user + p.reaped_user for p in s.procs.values())
        k = sum(p.system + p.reaped_system for p in s.procs.values())
        return u, k

    (u0, k0), (u1, k1) = user_system(before), user_system(after)
    total = (after.total - before.total) / CLK_TCK
    main = workers = 0
    for pid, p in after.procs.items():
        old = before.procs.get(pid)
        if old is None or old.start != p.start:
            continue
        if pid == after.root:
            main += p.own - old.own
        else:
            workers += p.own - old.own
    into.user_s += (u1 - u0) / CLK_TCK
    into.system_s += (k1 - k0) / CLK_TCK
    into.main_s += main / CLK_TCK
    into.workers_s += workers / CLK_TCK
    into.other_s += total - (main + workers) / CLK_TCK
    into.waited_s += max(0, after.waited_ns - before.waited_ns) / 1e9
    into.processes += len(after.procs)
    into.threads += sum(p.threads for p in after.procs.values())
    for tid, ticks in after.root_threads.items():
        spent = (ticks - before.root_threads.get(tid, 0)) / CLK_TCK
        if spent > 0:
            into.main_threads_s.append(spent)


def between(before: list[Sample], after: list[Sample]) -> Cpu:
    """The CPU of every tree (matched by root) from ``before`` to ``after``; a tree whose root
    is gone by ``after`` is left out and named in ``vanished`` (its processes took their CPU
    with them: what remains would read as negative time)."""
    out = Cpu()
    by_root = {s.root: s for s in before}
    for a in after:
        b = by_root.get(a.root)
        if b is None:
            continue
        if b.procs and a.root not in a.procs:
            out.vanished.append(a.root)
            continue
        _between_one(b, a, out)
    out.main_threads_s.sort(reverse=True)
    return out


def _status_kb(pid: int, keys: tuple[str, ...]) -> dict[str, int]:
    out = dict.fromkeys(keys, 0)
    with contextlib.suppress(OSError):
        for line in (PROC / str(pid) / "status").read_text().splitlines():
            key = line.split(":", 1)[0]
            if key in out:
                out[key] = int(line.split()[1])
    return out


def _pss_kb(pid: int) -> int:
    with contextlib.suppress(OSError):
        for line in (PROC / str(pid) / "smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    return 0


def memory_mb(roots: Iterable[int]) -> dict[str, float]:
    """Peak and current resident sets (MiB) of the roots and of their workers, and the Pss
    of everything, now."""
    kb = {"main_hwm": 0, "main_rss": 0, "workers_hwm": 0, "workers_rss": 0, "pss": 0}
    workers = 0
    for s in sample(roots):
        for pid in s.procs:
            status = _status_kb(pid, ("VmHWM", "VmRSS"))
            role = "main" if pid == s.root else "workers"
            workers += role == "workers"
            kb[f"{role}_hwm"] += status["VmHWM"]
            kb[f"{role}_rss"] += status["VmRSS"]
            kb["pss"] += _pss_kb(pid)
    out = {f"{k}_mb": v / 1024 for k, v in kb.items()}
    out["rss_mb"] = out["main_hwm_mb"] + out["workers_hwm_mb"]  # as reported before: peak, summed
    out["worker_processes"] = float(workers)
    return out
