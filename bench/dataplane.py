"""Running every workload against every peer, in rounds: warm-up, a measured run, CPU accounting.

The peers are measured in rounds (``Plan.rounds``), each round taking every peer in turn, so
that the machine's drift (its speed moves by a fifth and more over minutes on a virtual
machine) reaches every peer alike instead of the peers that happen to run in a slow stretch.
In each round a peer is started afresh, checked (a 1 MiB blob through it must hash right, a
UDP datagram must come back unchanged), warmed up briefly on every workload, measured once on
each and stopped; its figures are the medians over the rounds. A round whose proxy exits
before its runs are over is a failed round, none of its figures kept (whatever a load
generator read after that measured no proxy); a workload that fails with the proxy alive
is noted and fails the run, the other workloads' figures kept. Each measured run records the
proxy's CPU seconds next to the load generator's figures: its whole process tree (uproxy's
control process and workers, nginx's master and workers, HAProxy's threads), split by role as
``bench.proctree`` explains, and the whole machine's (``/proc/stat``: load generator, backend,
proxy and the kernel's softirq work, and anything else that ran). Memory is read once, after
each round's last run: peak RSS summed over the tree (the headline figure, as before), per
role, and the tree's Pss.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import proctree, workloads as wl
from bench.backends import Backends
from bench.peers import Context, Peer, PeerPorts, Running, ports_for
from bench.procs import CpuSet, host_steal_s, machine_busy_s
from bench.progress import Progress


@dataclass(frozen=True, slots=True)
class Plan:
    """``rounds``: how often each peer is started and measured (once per workload a round),
    the peers in turn; ``warmup``: each workload once, unmeasured, for these durations before
    a round's measured runs (None: none)."""

    rounds: int
    durations: wl.Durations
    warmup: wl.Durations | None = None


# Long enough for a fresh peer's first connections, caches and allocations.
WARMUP = wl.Durations(tcp=1, http=1, udp=1)


@dataclass(frozen=True, slots=True)
class Workload:
    key: str
    title: str
    needs_udp: bool
    seconds: Callable[[wl.Durations], float]
    run: Callable[[PeerPorts, wl.Durations, dict[str, Path], CpuSet], wl.Figures]


def _tcp(streams: int) -> Callable[[PeerPorts, wl.Durations, dict[str, Path], CpuSet], wl.Figures]:
    def run(p: PeerPorts, d: wl.Durations, scripts: dict[str, Path], core: CpuSet) -> wl.Figures:
        return wl.iperf(p.iperf, streams=streams, seconds=d.tcp, core=core)

    return run


def _conn(p: PeerPorts, d: wl.Durations, scripts: dict[str, Path], core: CpuSet) -> wl.Figures:
    return wl.wrk(
        p.http, script=scripts["conn"], connections=d.conn_connections, seconds=d.http, core=core
    )


def _keepalive(p: PeerPorts, d: wl.Durations, scripts: dict[str, Path], core: CpuSet) -> wl.Figures:
    return wl.wrk(
        p.http, script=scripts["keepalive"], connections=d.ka_connections, seconds=d.http, core=core
    )


def _udp(p: PeerPorts, d: wl.Durations, scripts: dict[str, Path], core: CpuSet) -> wl.Figures:
    return wl.udp(p.udp, seconds=d.udp, core=core)


WORKLOADS = [
    Workload("tcp1", "iperf3, 1 stream", False, lambda d: d.tcp, _tcp(1)),
    Workload("tcp4", "iperf3, 4 streams", False, lambda d: d.tcp, _tcp(4)),
    Workload("conn", "wrk, Connection: close", False, lambda d: d.http, _conn),
    Workload("keepalive", "wrk paced keep-alive", False, lambda d: d.http, _keepalive),
    Workload("udp", "UDP request/response", True, lambda d: d.udp, _udp),
]

STEP_OVERHEAD_S = 0.4


def round_seconds(plan: Plan) -> float:
    """What one peer's round should take (the progress line's estimate)."""
    return sum(_workload_seconds(plan, w) for w in WORKLOADS) + 1.0


def _steps(plan: Plan) -> list[tuple[wl.Durations, bool]]:
    """A workload's runs in a round: (durations, measured)."""
    warm = [(plan.warmup, False)] if plan.warmup is not None else []
    return [*warm, (plan.durations, True)]


def _workload_seconds(plan: Plan, w: Workload) -> float:
    return sum(w.seconds(d) + STEP_OVERHEAD_S for d, _ in _steps(plan))


def preflight(running: Running, backends: Backends) -> str | None:
    """None when bytes go through the peer intact, else what went wrong."""
    url = f"http://127.0.0.1:{running.ports.http}/blob"
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            body = resp.read()
    except OSError as e:
        return f"HTTP through the peer failed: {e}"
    if len(body) != backends.blob_size or hashlib.sha256(body).hexdigest() != backends.blob_sha256:
        return f"HTTP body through the peer is wrong ({len(body)} bytes)"
    if not running.udp:
        return None
    payload = os.urandom(1200)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(1.0)
        s.connect(("127.0.0.1", running.ports.udp))
        for _ in range(3):
            s.send(payload)
            try:
                reply = s.recv(65536)
            except (TimeoutError, ConnectionRefusedError):
                continue
            if hashlib.sha256(reply).digest() == hashlib.sha256(payload).digest():
                return None
            return f"UDP reply through the peer is wrong ({len(reply)} bytes)"
    return "no UDP reply through the peer"


def _derive(key: str, figures: wl.Figures, cpu: proctree.Cpu | None) -> None:
    """Figures from the proxy tree's CPU over the run: totals, per GB, per connection (all of
    it, its kernel part, and each role's)."""
    if cpu is None:
        return
    figures.update(cpu.figures())
    if figures.get("wall_s"):
        figures["runq_ms_per_s"] = cpu.waited_s * 1e3 / figures["wall_s"]
    total = cpu.total_s
    if key == "tcp1" and figures.get("bytes"):
        figures["cpu_s_per_gb"] = total / (figures["bytes"] / 1e9)
    if key == "conn" and figures.get("requests"):
        n = figures["requests"]
        figures["cpu_us_per_conn"] = total * 1e6 / n
        figures["kernel_us_per_conn"] = cpu.system_s * 1e6 / n
        for role in ("main", "workers", "other"):
            figures[f"{role}_us_per_conn"] = figures[f"cpu_{role}_s"] * 1e6 / n
    derive_core_busy(figures)


def derive_core_busy(figures: wl.Figures) -> None:
    """How busy the proxy was, in % of one CPU: pinned, below 100 % the proxy is not what
    limits the run; at equal cores it can reach 200 %."""
    if "cpu_s" not in figures:
        return
    if figures.get("seconds"):
        seconds = figures["seconds"]
    elif figures.get("rate"):
        seconds = figures.get("requests", 0.0) / figures["rate"]
    else:
        return
    if seconds > 0:
        figures["proxy_core_pct"] = 100.0 * figures["cpu_s"] / seconds


def run_peer(
    index: int,
    peer: Peer,
    ctx: Context,
    backends: Backends,
    plan: Plan,
    scripts: dict[str, Path],
    progress: Progress,
    round_no: int = 1,
) -> dict[str, Any]:
    """One round of every workload against one peer: the peer's entry of the raw JSON, with
    that round's runs (``merge_round`` adds up the rounds)."""
    where = ctx.where
    entry: dict[str, Any] = {
        "label": peer.label,
        "placement": where.name,
        "proxy_cpus": where.proxy_cpus,
        "roles": list(peer.roles),
        "runs": {},
        "notes": [],
    }
    running = peer.start(ctx, ports_for(index))
    try:
        problem = preflight(running, backends)
        if problem:
            raise RuntimeError(problem)
        progress.say(f"{peer.name}: started, bytes verified")
        alive = _alive_check(peer, running, ctx)
        for w in WORKLOADS:
            if w.needs_udp and not running.udp:
                entry["notes"].append(f"{w.key}: not supported by this peer")
                progress.advance(_workload_seconds(plan, w))
                continue
            entry["runs"][w.key] = _round(
                peer, w, running, plan, scripts, where.load, progress, entry, round_no, alive
            )
        if running.pids:
            entry["runs"]["peak"] = [proctree.memory_mb(running.pids)]
            alive("the memory reading")
    finally:
        peer.stop(ctx, running)
    return entry


class ProxyExited(RuntimeError):
    """The peer's proxy exited during its round: the round failed, none of it is a figure."""


def _alive_check(peer: Peer, running: Running, ctx: Context) -> Callable[[str], None]:
    """A check, after each run, that every process the peer started still runs: raises
    ``ProxyExited`` naming the run (``during``), with the exit status and the log's end."""

    def check(during: str) -> None:
        for proc in running.procs:
            if proc.poll() is not None:
                tail = ctx.procs.log_tail(proc)
                raise ProxyExited(
                    f"{peer.name} exited with {proc.returncode} during {during}"
                    + (f": {tail}" if tail else "")
                )

    return check


def merge_round(before: dict[str, Any], entry: dict[str, Any]) -> dict[str, Any]:
    """A peer's entry over its rounds so far (``before``; without runs before its first
    measured round) with one more round's (``run_peer``'s, with the wake-up
    probe taken before it): runs appended, and notes not already there; of the probes, the
    one with the median idle p99 is the entry's ``wakeup``."""
    woke = entry.pop("wakeup", None)
    if "runs" not in before:
        merged = entry
        merged["notes"] = [*before.get("notes", []), *entry["notes"]]
        merged["wakeups"] = []
    else:
        merged = before
        for key, runs in entry["runs"].items():
            merged["runs"].setdefault(key, []).extend(runs)
        merged["notes"] += [n for n in entry["notes"] if n not in merged["notes"]]
    if woke is not None:
        merged["wakeups"].append(woke)
        measured = [w for w in merged["wakeups"] if "error" not in w]
        measured.sort(key=lambda w: w.get("idle", {}).get("p99_us", 0.0))
        merged["wakeup"] = measured[(len(measured) - 1) // 2] if measured else woke
    return merged


def _round(
    peer: Peer,
    w: Workload,
    running: Running,
    plan: Plan,
    scripts: dict[str, Path],
    load: CpuSet,
    progress: Progress,
    entry: dict[str, Any],
    round_no: int,
    alive: Callable[[str], None],
) -> list[wl.Figures]:
    """One workload's warm-up and measured run in this round, each with the proxy tree's CPU;
    a failed run ends the workload for the round with a note and goes into the entry's
    ``failed`` (the other workloads still run); a proxy that exited ends the round
    (``ProxyExited``)."""
    runs: list[wl.Figures] = []
    for durations, measured in _steps(plan):
        label = f"round {round_no}/{plan.rounds}" if measured else "warm-up"
        before = proctree.sample(running.pids)
        machine_before, steal_before = machine_busy_s(), host_steal_s()
        started = time.monotonic()
        try:
            figures = w.run(running.ports, durations, scripts, load)
        except (wl.WorkloadError, OSError) as e:
            alive(f"{w.title}, {label}")
            failure = f"{w.key}, round {round_no}: failed: {e}"
            entry["notes"].append(failure)
            entry.setdefault("failed", []).append(failure)
            progress.say(f"{peer.name}: {w.key} FAILED: {e}")
            break
        alive(f"{w.title}, {label}")
        figures["wall_s"] = time.monotonic() - started
        figures["machine_cpu_s"] = machine_busy_s() - machine_before
        figures["steal_ms_per_s"] = (host_steal_s() - steal_before) * 1000 / figures["wall_s"]
        if w.key == "conn" and figures.get("requests"):
            figures["machine_us_per_conn"] = figures["machine_cpu_s"] * 1e6 / figures["requests"]
        cpu = proctree.between(before, proctree.sample(running.pids)) if running.pids else None
        if cpu is not None and cpu.vanished:
            raise ProxyExited(f"{peer.name}'s processes vanished during {w.title}, {label}")
        _derive(w.key, figures, cpu)
        progress.advance(w.seconds(durations) + STEP_OVERHEAD_S)
        progress.say(f"{peer.name}: {w.title}, {label}: {_headline(w.key, figures)}")
        if measured:
            runs.append(figures)
    return runs


def _headline(key: str, f: wl.Figures) -> str:
    if key.startswith("tcp"):
        text = f"{f['gbps']:.2f} Gb/s"
    elif key == "udp":
        text = f"{f['rate']:,.0f} req/s, p99 {f['p99_ms']:.3f} ms, lost {f['lost']:.0f}"
    else:
        text = f"{f['rate']:,.0f} req/s, p50 {f['p50_ms']:.3f} ms, p99 {f['p99_ms']:.3f} ms"
    if f.get("errors"):
        text += f", errors {f['errors']:.0f}"
    if "cpu_s" in f:
        text += f", proxy CPU {f['cpu_s']:.2f} s"
        if f.get("cpu_workers_s"):
            text += f" ({f['cpu_main_s']:.2f} main + {f['cpu_workers_s']:.2f} workers)"
    return text
