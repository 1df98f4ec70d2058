"""Starting the processes of a benchmark on chosen CPUs, measuring them, and always stopping them.

Fairness rests on every peer getting the same CPUs. A *placement* says which: ``pinned`` gives
the proxy one core and the load generators and backends the other; ``shared`` lets the
proxy, the load generators and the backends all use both (equal cores: a proxy with threads or
worker processes can use them, and so can the kernel's work for a peer without a process).
Each child starts in its own session, so stopping it reaches whatever it forked (nginx workers,
uproxy's data-plane workers, socat children) by process group id, and nothing else on the
machine. Resource figures come from /proc, summed over the process tree (``bench.proctree``
says how a tree of live processes is accounted).
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import proctree
from bench.proctree import (
    CLK_TCK,
    tree as tree,  # re-exported: the control-plane probes read it here
)

# One CPU, or a set of them (``taskset -c 0,1``).
CpuSet = int | tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Cores:
    """Which core runs the proxy and which runs everything else."""

    proxy: int
    load: int

    @classmethod
    def pick(cls) -> Cores:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) >= 2:
            return cls(proxy=cpus[0], load=cpus[1])
        return cls(proxy=cpus[0], load=cpus[0])


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a peer's processes run: ``pinned`` (the proxy alone on one CPU, everything else on
    the other) or ``shared`` (the proxy, the load generators and the backends on both)."""

    name: str
    proxy: CpuSet
    load: CpuSet

    @classmethod
    def pinned(cls, cores: Cores) -> Placement:
        return cls("pinned", cores.proxy, cores.load)

    @classmethod
    def shared(cls, cores: Cores) -> Placement:
        cpus = tuple(sorted({cores.proxy, cores.load}))
        return cls("shared", cpus, cpus)

    @property
    def proxy_cpus(self) -> int:
        return 1 if isinstance(self.proxy, int) else len(self.proxy)

    def describe(self) -> str:
        if self.name == "pinned":
            return f"proxy on CPU {self.proxy}, load and backends on CPU {self.load}"
        return f"proxy, load and backends sharing CPUs {_cpu_list(self.proxy)}"


# uproxy's entry points: importing them loads every module a uproxy process runs.
_UPROXY_MODULES = (
    "uproxy.cli",
    "uproxy.proxy",
    "uproxy.sources.kube",
    "uproxy.sources.file",
    "uproxy.rules.nftables",
    "uproxy.rules.restore",
    "uproxy.rules.pyiptables",
    "uproxy.dataplane.worker",
)


def run_uproxy_as_shipped() -> None:
    """Run uproxy as the image ships it: optimized (``PYTHONOPTIMIZE=2``, docstrings and
    asserts stripped, set for every child of this run) from bytecode compiled beforehand.

    The image compiles its bytecode at build time, at that optimization level. Here an
    editable install never compiles uproxy, and under ``PYTHONDONTWRITEBYTECODE`` (set in the
    image and on CI machines) nothing is written at run time: every uproxy process would
    compile its modules again at each start (~0.05 s of CPU per process in the start-up
    figures), and without the optimization the control process holds 16 MiB of docstrings
    more at 10,000 services than the image's does. So the modules uproxy's processes load
    (uproxy's and its libraries') are compiled here, once, at level 2; those that cannot be
    written (a read-only interpreter) are compiled in memory at each start, as before.
    """
    import compileall
    import importlib

    for name in _UPROXY_MODULES:
        importlib.import_module(name)
    for module in list(sys.modules.values()):
        source = getattr(module, "__file__", None)
        if source and source.endswith(".py"):
            compileall.compile_file(source, quiet=2, optimize=2)
    os.environ["PYTHONOPTIMIZE"] = "2"


def _cpu_list(cpus: CpuSet) -> str:
    return str(cpus) if isinstance(cpus, int) else ",".join(str(c) for c in cpus)


def _on_cpus(argv: Sequence[str], cpus: CpuSet | None) -> list[str]:
    """``argv`` under ``taskset`` when CPUs are given (children inherit the mask)."""
    if cpus is None:
        return list(argv)
    return ["taskset", "-c", _cpu_list(cpus), *argv]


def _raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


class ProcessGroup:
    """Every child process of a benchmark, stopped together on exit."""

    def __init__(self, *, logdir: Path) -> None:
        self.logdir = logdir
        self._procs: list[subprocess.Popen[bytes]] = []
        self._logs: dict[int, Path] = {}
        self._count = 0

    def start(
        self,
        argv: Sequence[str],
        *,
        core: CpuSet | None,
        name: str,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` on ``core`` (one CPU or several) in its own session; output goes to a
        log file."""
        self._count += 1
        log = self.logdir / f"{self._count:03d}-{name}.log"
        cmd = _on_cpus(argv, core)
        with log.open("wb") as out:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_raise_nofile,
                env=env,
            )
        self._procs.append(proc)
        self._logs[proc.pid] = log
        return proc

    def log_path(self, proc: subprocess.Popen[bytes]) -> Path:
        return self._logs[proc.pid]

    def log_tail(self, proc: subprocess.Popen[bytes], *, lines: int = 5) -> str:
        try:
            text = self._logs[proc.pid].read_text(errors="replace")
        except (KeyError, OSError):
            return ""
        return " | ".join(text.strip().splitlines()[-lines:])

    def stop(self, proc: subprocess.Popen[bytes], *, timeout_s: float = 5.0) -> None:
        """SIGTERM the child's process group, SIGKILL it if it lingers."""
        stop_session(proc, timeout_s=timeout_s)

    def stop_all(self) -> None:
        for proc in reversed(self._procs):
            self.stop(proc)
        self._procs.clear()


def stop_session(proc: subprocess.Popen[Any], *, timeout_s: float) -> None:
    """SIGTERM the process group of ``proc`` (started in a session of its own), give it
    ``timeout_s`` to clean up, then SIGKILL the group: what it forked too."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=timeout_s)
    # Children that outlived their leader (a forked socat) share the group id.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def run_to_end(
    argv: Sequence[str], *, timeout_s: float, grace_s: float = 5.0
) -> subprocess.CompletedProcess[str]:
    """Run a helper to completion in a session of its own, its output captured, bounded in time.

    ``subprocess.run`` answers a timeout or an interrupt (Ctrl-C, or SIGTERM raised as
    KeyboardInterrupt here) by SIGKILLing the child alone: its own cleanup never runs (a
    namespace it made stays) and whatever it started is orphaned. Here the child's whole group
    gets SIGTERM and ``grace_s`` to clean up first, then SIGKILL; the interrupt is raised
    again, a timeout as ``subprocess.TimeoutExpired``.
    """
    child = subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    with child:
        try:
            out, err = child.communicate(timeout=timeout_s)
        except BaseException:
            stop_session(child, timeout_s=grace_s)
            raise
    return subprocess.CompletedProcess(child.args, child.returncode, out, err)


def run_pinned(
    argv: Sequence[str], *, core: CpuSet | None, timeout_s: float
) -> subprocess.CompletedProcess[str]:
    """Run a load generator to completion on ``core`` (one CPU or several), bounded in time."""
    return subprocess.run(
        _on_cpus(argv, core),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
        preexec_fn=_raise_nofile,
    )


# --- /proc accounting --------------------------------------------------------------------


def cpu_split(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of the tree now: every live process's own and what each has
    reaped (``bench.proctree``). Differences of two readings are the tree's CPU in between.

    System time is the kernel working for the proxy: its system calls, and on loopback the
    TCP delivery each write() does inline.
    """
    (s,) = proctree.sample([pid])
    user = sum(p.user + p.reaped_user for p in s.procs.values())
    system = sum(p.system + p.reaped_system for p in s.procs.values())
    return user / CLK_TCK, system / CLK_TCK


def peak_rss_bytes(pid: int) -> int:
    """Sum of VmHWM over the tree alive now."""
    return int(proctree.memory_mb([pid])["rss_mb"] * (1 << 20))


def machine_busy_s() -> float:
    """CPU seconds every CPU has spent not idle (user, system, irq, softirq, steal)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / CLK_TCK


def host_steal_s() -> float:
    """CPU seconds the host has taken from every CPU of this machine (a VM's steal time):
    runnable vCPUs the hypervisor did not run. Whatever ran on such a CPU stalled meanwhile,
    proxy and peers alike; a run with more of it reads slower and with longer tails."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    return int(fields[7]) / CLK_TCK


def reaped_children_s(pid: int) -> float:
    """CPU seconds of the children ``pid`` has reaped: uproxy's rules-check commands."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[16 - 3]) + int(fields[17 - 3])) / CLK_TCK


def runqueue_wait_s(pid: int, *, relaying: bool = False) -> float:
    """Seconds the process tree's threads were runnable but waiting for a CPU (schedstat).

    Near zero on a quiet machine. When other work shares the proxy's core, the proxy's
    latency figures measure that contention rather than the proxy. ``relaying``: only the
    processes that relay, i.e. uproxy's data-plane workers when the tree has them (its
    control process runs below them by design, nice 10, and waits behind them while they
    relay: not a wait any connection sees), else the whole tree.
    """
    pids = tree(pid)
    if relaying:
        workers = [p for p in pids if _is_uproxy_worker(p)]
        pids = workers or pids
    total = 0
    for p in pids:
        try:
            tasks = list(Path(f"/proc/{p}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            with contextlib.suppress(OSError, ValueError, IndexError):
                total += int((task / "schedstat").read_text().split()[1])
    return total / 1e9


def _is_uproxy_worker(pid: int) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"uproxy.dataplane.worker" in argv


# --- waiting for sockets -------------------------------------------------------------------


def listening_ports(proto: str) -> set[int]:
    """Local ports with a listening TCP socket or a bound UDP socket, in this namespace."""
    ports: set[int] = set()
    for family in ("", "6"):
        try:
            lines = Path(f"/proc/net/{proto}{family}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            local, state = parts[1], parts[3]
            if proto == "tcp" and state != "0A":
                continue
            ports.add(int(local.rsplit(":", 1)[1], 16))
    return ports


def wait_listening(
    *,
    tcp: Sequence[int] = (),
    udp: Sequence[int] = (),
    timeout_s: float,
    procs: Sequence[subprocess.Popen[bytes]] = (),
) -> bool:
    """Poll until every port is open; False on timeout or as soon as one of ``procs`` died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            return False
        if set(tcp) <= listening_ports("tcp") and set(udp) <= listening_ports("udp"):
            return True
        time.sleep(0.02)
    return False
