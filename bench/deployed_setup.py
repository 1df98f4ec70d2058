"""One setup of the deployed path: fresh namespaces, backends, one peer, its checks, its runs.

A setup is everything between creating the pod/node/backend namespaces and deleting them: the
backends start in the backend namespace, the peer in the node namespace, and the bench waits
for the peer by bounded polling (a TCP connect and a request through the ClusterIP; for uproxy
also /metrics' ``kubeproxy_sync_proxy_rules_last_timestamp_seconds`` > 0), fetches a 1 MiB
blob through the ClusterIP and compares its sha256, and only then runs the workloads from the
pod namespace (new connections as fast as they go, then at a fixed offered rate, then
keep-alive). Each run is accounted from /proc: the proxy's user and system CPU (its reaped
child commands included), the time its relaying processes waited for their CPU (uproxy's
workers, not its control process: see ``procs.runqueue_wait_s``), and the whole machine's
CPU, which is where a kernel peer's cost shows.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from bench import topology, workloads as wl
from bench.backends import BackendPorts, Backends, start as start_backends
from bench.dataplane import derive_core_busy
from bench.deployed_peers import METRICS_URL, NodeEnv, NodePeer, Service, ServiceSet
from bench.procs import (
    Cores,
    ProcessGroup,
    cpu_split,
    host_steal_s,
    machine_busy_s,
    reaped_children_s,
    runqueue_wait_s,
)
from bench.progress import Progress
from bench.topology import Topology, entered

PREFIX = "ubd"  # namespace names: ubd<pid>-<setup>-{pod,node,be}


@dataclass(frozen=True, slots=True)
class Plan:
    """What a run measures: numbers of services, rounds, warm-up, run lengths."""

    scales: tuple[int, ...]
    rounds: int
    warmup: bool
    durations: wl.Durations
    # A keep-alive run this long for uproxy at the largest scale (0: none). Long enough (> 30 s,
    # the default --iptables-sync-period) it covers a periodic full rules sync, which 3 s runs
    # meet only now and then.
    long_keepalive_s: float = 0.0


WARMUP_S = 1.0
# Bounded waits for a peer to serve: uproxy reads and programs N services first (7-10 s at
# 10,000 from a file on 2 busy cores, about 20 s before the start-up work now under way).
READY_BASE_S = 30.0
READY_PER_SERVICE_S = 0.015
POLL_S = 0.05
PROBE_S = 0.1


def accounted(run: Callable[[], wl.Figures], pids: list[int]) -> wl.Figures:
    """Run a workload; add the proxy's user/system CPU, its children's, the machine's, and
    the time the host took the machine's CPUs away (steal)."""
    before = [cpu_split(p) for p in pids]
    children_before = sum(reaped_children_s(p) for p in pids)
    waited_before = sum(runqueue_wait_s(p, relaying=True) for p in pids)
    machine_before, steal_before = machine_busy_s(), host_steal_s()
    start = time.monotonic()
    figures = run()
    figures["wall_s"] = time.monotonic() - start
    figures["machine_cpu_s"] = machine_busy_s() - machine_before
    figures["steal_ms_per_s"] = (host_steal_s() - steal_before) * 1000 / figures["wall_s"]
    if pids:
        after = [cpu_split(p) for p in pids]
        figures["cpu_user_s"] = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
        figures["cpu_system_s"] = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
        figures["cpu_s"] = figures["cpu_user_s"] + figures["cpu_system_s"]
        children = sum(reaped_children_s(p) for p in pids) - children_before
        figures["children_cpu_pct"] = 100.0 * children / figures["wall_s"]
        waited = sum(runqueue_wait_s(p, relaying=True) for p in pids) - waited_before
        figures["runq_ms_per_s"] = waited * 1e3 / figures["wall_s"]
        derive_core_busy(figures)
    return figures


def per_connection(figures: wl.Figures) -> None:
    n = figures.get("requests") or 0.0
    if not n:
        return
    figures["machine_us_per_conn"] = figures["machine_cpu_s"] * 1e6 / n
    if "cpu_s" in figures:
        figures["cpu_us_per_conn"] = figures["cpu_s"] * 1e6 / n
        figures["user_us_per_conn"] = figures["cpu_user_s"] * 1e6 / n
        figures["kernel_us_per_conn"] = figures["cpu_system_s"] * 1e6 / n


class PeerSkipped(RuntimeError):
    """The peer cannot run here (a backend not built yet): a note, not a failure."""


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def fetch(url: str, *, timeout: float) -> bytes:
    with _NO_PROXY.open(url, timeout=timeout) as resp:
        body: bytes = resp.read()
        return body


def _sync_timestamp() -> float:
    text = fetch(METRICS_URL, timeout=30).decode(errors="replace")
    for line in text.splitlines():
        if line.startswith("kubeproxy_sync_proxy_rules_last_timestamp_seconds "):
            return float(line.split()[1])
    return 0.0


@dataclass(slots=True)
class Setup:
    """One peer at one number of services, in its own namespaces, while it is measured."""

    topo: Topology
    procs: ProcessGroup
    workdir: Path
    cores: Cores
    services: ServiceSet
    backends: Backends | None = None
    peer_procs: list[subprocess.Popen[bytes]] | None = None

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.peer_procs or []]

    def url(self, svc: Service, path: str = "/") -> str:
        return f"http://{svc.ip}:{svc.port}{path}"


def wait_ready(s: Setup, peer: NodePeer, started: float, timeout_s: float) -> float:
    """Seconds from starting the peer to its first answer through the ClusterIP.

    Each probe is a TCP connect with a short timeout, then one HTTP request. The node
    answers a ClusterIP it does not steer yet with an ICMP error, but those are rate-limited
    (about one a second): most early probes see silence, and a probe waiting out a long
    timeout would add up to that timeout to the figure.
    """
    deadline = started + timeout_s
    last = "no attempt"
    while True:
        dead = [p for p in s.peer_procs or [] if p.poll() is not None]
        if dead:
            why = s.procs.log_tail(dead[0], lines=1) or f"exit code {dead[0].returncode}"
            if peer.skip_when_start_fails:
                raise PeerSkipped(f"`{peer.label}` failed at start: {why}")
            raise RuntimeError(f"exited while starting: {why}")
        answered = time.monotonic()
        try:
            with entered(s.topo.pod):
                target = s.services.target
                socket.create_connection((target.ip, target.port), timeout=PROBE_S).close()
                fetch(s.url(target), timeout=5.0)
            break
        except OSError as e:
            last = str(e) or type(e).__name__
        if time.monotonic() > deadline:
            raise RuntimeError(f"not serving the ClusterIP after {timeout_s:.0f} s ({last})")
        time.sleep(POLL_S)
    ready = answered - started
    if peer.is_uproxy:
        while True:
            try:
                with entered(s.topo.node):
                    if _sync_timestamp() > 0:
                        break
            except OSError as e:
                last = f"/metrics: {e}"
            if time.monotonic() > deadline:
                raise RuntimeError(f"no rules sync in /metrics after {timeout_s:.0f} s ({last})")
            time.sleep(POLL_S)
    return ready


def check_bytes(s: Setup) -> None:
    """A 1 MiB blob through the ClusterIP must hash as it does on the backend."""
    if s.backends is None:
        raise RuntimeError("backends not started")
    expected = s.backends.blob_sha256
    try:
        with entered(s.topo.pod):
            body = fetch(s.url(s.services.target, "/blob"), timeout=10)
    except OSError as e:
        raise RuntimeError(f"HTTP through the ClusterIP failed: {e}") from None
    if hashlib.sha256(body).hexdigest() != expected:
        raise RuntimeError(f"HTTP body through the ClusterIP is wrong ({len(body)} bytes)")


def scraped(s: Setup, run: Callable[[], wl.Figures], seconds: float) -> tuple[wl.Figures, Any]:
    """``run`` while /metrics is scraped every second from the node namespace."""
    out = s.workdir / "scrape.json"
    argv = [sys.executable, "-m", "bench.scrape", "--url", METRICS_URL]
    argv += ["--seconds", str(seconds), "--out", str(out)]
    with entered(s.topo.node):
        scraper = s.procs.start(argv, core=s.cores.load, name="scrape")
    try:
        figures = accounted(run, s.pids)
        with contextlib.suppress(subprocess.TimeoutExpired):
            scraper.wait(timeout=30)
    finally:
        s.procs.stop(scraper)
    try:
        scrape: dict[str, Any] = json.loads(out.read_text())
    except (OSError, json.JSONDecodeError):
        scrape = {"count": 0, "ok": 0, "seconds": [], "bytes": 0.0}
    times = sorted(scrape["seconds"])
    if times:
        scrape["median_s"] = times[len(times) // 2]
        scrape["max_s"] = times[-1]
    return figures, scrape


def measure(
    s: Setup, peer: NodePeer, plan: Plan, scale: int, scripts: dict[str, Path]
) -> dict[str, Any]:
    """Every workload against one set-up peer, from the pod namespace."""
    d = plan.durations
    target, bulk, load = s.services.target, s.services.bulk, s.cores.load

    def http(script: str, connections: int, seconds: float) -> Callable[[], wl.Figures]:
        def run() -> wl.Figures:
            with entered(s.topo.pod):
                return wl.wrk(
                    target.port,
                    script=scripts[script],
                    connections=connections,
                    seconds=seconds,
                    core=load,
                    host=target.ip,
                )

        return run

    def tcp1() -> wl.Figures:
        with entered(s.topo.pod):
            return wl.iperf(bulk.port, streams=1, seconds=d.tcp, core=load, host=bulk.ip)

    conn = http("conn", d.conn_connections, d.http)
    paced = http("paced", d.paced_connections, d.http)
    keepalive = http("keepalive", d.ka_connections, d.http)
    result: dict[str, Any] = {}
    if plan.warmup:
        http("conn", d.conn_connections, WARMUP_S)()
    result["conn"] = accounted(conn, s.pids)
    per_connection(result["conn"])
    result["conn_paced"] = accounted(paced, s.pids)
    result["conn_paced"]["offered_rate"] = float(d.paced_rate)
    per_connection(result["conn_paced"])
    result["keepalive"] = accounted(keepalive, s.pids)
    if scale == min(plan.scales):
        f = accounted(tcp1, s.pids)
        if "cpu_s" in f and f.get("bytes"):
            f["cpu_s_per_gb"] = f["cpu_s"] / (f["bytes"] / 1e9)
        result["tcp1"] = f
    if peer.is_uproxy and scale == max(plan.scales):
        result["ka_scrape"], result["scrape"] = scraped(s, keepalive, d.http)
        if plan.long_keepalive_s:
            long_run = http("keepalive", d.ka_connections, plan.long_keepalive_s)
            result["ka_long"] = accounted(long_run, s.pids)
    return result


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Cleanup runs to its end; a Ctrl-C or SIGTERM meanwhile stops the run right after."""
    got: list[int] = []

    def note(signum: int, frame: FrameType | None) -> None:
        got.append(signum)

    old = {sig: signal.signal(sig, note) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        if got:
            raise KeyboardInterrupt


@dataclass(slots=True)
class Run:
    """What every setup of one run shares (its scratch directory holds the services files)."""

    plan: Plan
    cores: Cores
    workdir: Path
    scripts: dict[str, Path]
    progress: Progress
    seq: int = 0


def run_setup(run: Run, peer: NodePeer, scale: int) -> dict[str, Any]:
    """Fresh namespaces and backends, the peer set up and checked, every workload; torn down."""
    run.seq += 1
    workdir = run.workdir / f"{run.seq:03d}-{peer.name}-{scale}"
    workdir.mkdir()
    ports = BackendPorts()
    topo = Topology.create(f"{PREFIX}{os.getpid()}-{run.seq}")
    s = Setup(
        topo=topo,
        procs=ProcessGroup(logdir=workdir),
        workdir=workdir,
        cores=run.cores,
        services=ServiceSet(scale, topology.BACKEND_IP, ports),
    )
    try:
        with entered(topo.backend):
            s.backends = start_backends(
                s.procs, run.cores, workdir, ports, host=topology.BACKEND_IP
            )
        started = time.monotonic()
        with entered(topo.node):
            s.peer_procs = peer.start(NodeEnv(s.procs, run.cores, run.workdir, s.services))
        timeout = READY_BASE_S + READY_PER_SERVICE_S * scale
        result: dict[str, Any] = {"ready_s": wait_ready(s, peer, started, timeout)}
        check_bytes(s)
        result.update(measure(s, peer, run.plan, scale, run.scripts))
        if s.peer_procs:
            t0 = time.monotonic()
            for proc in s.peer_procs:
                s.procs.stop(proc, timeout_s=30)
            result["stop_s"] = time.monotonic() - t0
        return result
    finally:
        with signals_deferred():
            s.procs.stop_all()
            topo.delete()
