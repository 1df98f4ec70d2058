"""Running every workload against every peer: warm-up, N measured runs, CPU accounting.

One peer at a time is started, checked (a 1 MiB blob through it must hash right, a UDP datagram
must come back unchanged), measured on every workload and stopped. Each measured run records the
proxy's CPU seconds (its whole process tree, on the proxy core) next to the load generator's
figures; peak RSS is read once, after the peer's last run.
"""

from __future__ import annotations

import hashlib
import os
import socket
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import workloads as wl
from bench.backends import Backends
from bench.peers import Context, Peer, PeerPorts, Running, ports_for
from bench.procs import cpu_split, peak_rss_bytes
from bench.progress import Progress


@dataclass(frozen=True, slots=True)
class Plan:
    runs: int
    warmup: bool
    durations: wl.Durations


@dataclass(frozen=True, slots=True)
class Workload:
    key: str
    title: str
    needs_udp: bool
    seconds: Callable[[wl.Durations], float]
    run: Callable[[PeerPorts, Plan, dict[str, Path], int], wl.Figures]


def _tcp(streams: int) -> Callable[[PeerPorts, Plan, dict[str, Path], int], wl.Figures]:
    def run(p: PeerPorts, plan: Plan, scripts: dict[str, Path], core: int) -> wl.Figures:
        return wl.iperf(p.iperf, streams=streams, seconds=plan.durations.tcp, core=core)

    return run


def _conn(p: PeerPorts, plan: Plan, scripts: dict[str, Path], core: int) -> wl.Figures:
    d = plan.durations
    return wl.wrk(
        p.http, script=scripts["conn"], connections=d.conn_connections, seconds=d.http, core=core
    )


def _keepalive(p: PeerPorts, plan: Plan, scripts: dict[str, Path], core: int) -> wl.Figures:
    d = plan.durations
    return wl.wrk(
        p.http, script=scripts["keepalive"], connections=d.ka_connections, seconds=d.http, core=core
    )


def _udp(p: PeerPorts, plan: Plan, scripts: dict[str, Path], core: int) -> wl.Figures:
    return wl.udp(p.udp, seconds=plan.durations.udp, core=core)


WORKLOADS = [
    Workload("tcp1", "iperf3, 1 stream", False, lambda d: d.tcp, _tcp(1)),
    Workload("tcp4", "iperf3, 4 streams", False, lambda d: d.tcp, _tcp(4)),
    Workload("conn", "wrk, Connection: close", False, lambda d: d.http, _conn),
    Workload("keepalive", "wrk paced keep-alive", False, lambda d: d.http, _keepalive),
    Workload("udp", "UDP request/response", True, lambda d: d.udp, _udp),
]

STEP_OVERHEAD_S = 0.4


def planned_seconds(plan: Plan, peers: int) -> float:
    per_peer = sum(
        (w.seconds(plan.durations) + STEP_OVERHEAD_S) * (plan.runs + (1 if plan.warmup else 0))
        for w in WORKLOADS
    )
    return (per_peer + 1.0) * peers


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


def _derive(key: str, figures: wl.Figures, cpu: tuple[float, float] | None) -> None:
    """Figures from the proxy's (user, system) CPU seconds over the run."""
    if cpu is None:
        return
    user, system = cpu
    total = user + system
    figures["cpu_s"] = total
    figures["cpu_kernel_s"] = system
    if key == "tcp1" and figures.get("bytes"):
        figures["cpu_s_per_gb"] = total / (figures["bytes"] / 1e9)
    if key == "conn" and figures.get("requests"):
        figures["cpu_us_per_conn"] = total * 1e6 / figures["requests"]
        figures["kernel_us_per_conn"] = system * 1e6 / figures["requests"]
    derive_core_busy(figures)


def derive_core_busy(figures: wl.Figures) -> None:
    """How busy the proxy's core was: below 100% the proxy is not what limits the run."""
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
) -> dict[str, Any]:
    """Every workload against one peer; the peer's entry of the raw JSON."""
    entry: dict[str, Any] = {"label": peer.label, "runs": {}, "notes": []}
    per_workload = [
        (w.seconds(plan.durations) + STEP_OVERHEAD_S) * (plan.runs + (1 if plan.warmup else 0))
        for w in WORKLOADS
    ]
    running = peer.start(ctx, ports_for(index))
    try:
        problem = preflight(running, backends)
        if problem:
            raise RuntimeError(problem)
        progress.say(f"{peer.name}: started, bytes verified")
        for w, planned in zip(WORKLOADS, per_workload, strict=True):
            if w.needs_udp and not running.udp:
                entry["notes"].append(f"{w.key}: not supported by this peer")
                progress.advance(planned)
                continue
            runs: list[wl.Figures] = []
            total = plan.runs + (1 if plan.warmup else 0)
            for i in range(total):
                warm = plan.warmup and i == 0
                before = [cpu_split(pid) for pid in running.pids]
                try:
                    figures = w.run(running.ports, plan, scripts, ctx.cores.load)
                except (wl.WorkloadError, OSError) as e:
                    entry["notes"].append(f"{w.key}: {e}")
                    progress.say(f"{peer.name}: {w.key} failed: {e}")
                    break
                after = [cpu_split(pid) for pid in running.pids]
                cpu = (
                    (
                        sum(a[0] for a in after) - sum(b[0] for b in before),
                        sum(a[1] for a in after) - sum(b[1] for b in before),
                    )
                    if running.pids
                    else None
                )
                _derive(w.key, figures, cpu)
                progress.advance(planned / total)
                label = "warm-up" if warm else f"run {i + (0 if plan.warmup else 1)}/{plan.runs}"
                progress.say(f"{peer.name}: {w.title}, {label}: {_headline(w.key, figures)}")
                if not warm:
                    runs.append(figures)
            entry["runs"][w.key] = runs
        if running.pids:
            rss = sum(peak_rss_bytes(pid) for pid in running.pids)
            entry["runs"]["peak"] = [{"rss_mb": rss / (1 << 20)}]
    finally:
        peer.stop(ctx, running)
    return entry


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
    return text
