"""Keep-alive latency through uproxy while its control process does its heaviest work.

uproxy's control process follows the services, syncs listeners and programs the rules; its
data-plane workers accept, dial and relay. Being separate processes, the control process's
biggest jobs should not reach the connections the workers relay. This part measures that,
with the paced keep-alive wrk run of every peer (``bench.workloads``), as root, once per rules
backend (``iptables-restore`` in nft mode, ``nftables``), each in a fresh namespace:

- **The namespace.** Loopback, a node address (10.255.0.1/32 on lo: uproxy DNATs the node's own
  traffic to node-IP:proxy-port) and the service range routed locally (``local 10.96.0.0/12
  dev lo``), so a ClusterIP without a portal refuses at once. Ephemeral ports 40000-65000,
  proxy ports 15000-39999 (room for both sets of listeners during a swap). A table of the
  bench's own stands for the rest of a real node's rules: nat chains on the four hooks and
  one rule matching on conntrack state. Without other users, the kernel unregisters its NAT
  hooks when uproxy's nat chains go (``nft delete table``) and stops tracking connections when
  uproxy's DNAT/REDIRECT rules go (``iptables -t nat -F``, ``nft flush table``): established
  connections through a ClusterIP are then reset at once, whatever the proxy does (measured
  here with a plain nft DNAT rule and no proxy at all). uproxy's own full loads replace its
  table in one transaction and keep them.
- **The proxy.** The backends as for every peer; uproxy with ``--services FILE --rules R
  --workers 2`` on both CPUs (the ``shared`` placement, as the ``-2cpu`` peers), the file
  holding N filler services and the measured one, ``zz-target`` (10.100.255.10:80, nginx).
  Ready means the target answers through its ClusterIP and all N + 1 proxy ports listen; then
  a 1 MiB blob through the ClusterIP must hash right.
- **Undisturbed.** One keep-alive run, as the peers' (uproxy's own undisturbed p99).
- **HAProxy beside it.** The same keep-alive run through HAProxy ``nbthread 2`` (with
  ``cpu-map`` when the workers are bound), started in the same namespace on the same CPUs
  and run in every round right after uproxy's undisturbed run: the reference the goals read
  the disturbed runs against. HAProxy's figure from the peers' part ran minutes away, and
  a virtual machine's keep-alive tail moves between minutes (HAProxy ``nbthread 2`` read
  0.593 ms in one full run and 0.722 in the next).
- **Big sync.** A keep-alive run meant to cover it (2 x uproxy's start-up time + 3 s, 4-40 s):
  0.5 s in, the services file is replaced (atomically) by one with N *other*
  services (the target unchanged), so uproxy closes N listeners, opens N and rewrites its
  rules. Timed from the replace until the last new service answers through its ClusterIP, the
  first old one refuses, and uproxy's log (``--logging-format json``) has counted N proxy
  ports opened and N closed. The table gives the share of the run the sync covered: the p99
  of a run is diluted by its undisturbed part.
- **Big sync, workers saturated.** The same swap again (to a third set of N services), during
  a 20 s run of new connections (``Connection: close``) as fast as wrk makes them instead of
  the paced keep-alive run: the workers are then busy all the time, and the control process,
  lowered below them, has to get its share from them. Its latency figures are those of a
  connection run, not comparable to the keep-alive rows; what it shows is how long the sync
  takes and that nothing fails.
- **Rules repair.** A keep-alive run during which the rules are flushed (``iptables -t nat
  -F``, or ``nft delete table ip uproxy``), then flushed again 1 s after each repair (a new
  connection through the ClusterIP answers again; uproxy checks its rules every second).
  Timed: each repair.

wrk's keep-alive connections are open before each disturbance and stay open through it (the
conntrack entry keeps their translation), so the figures are the relay's, not the portal's; a
connection that broke would show as a wrk error. Each run records the CPU of uproxy's tree
by role (control, workers, reaped commands such as ``iptables-restore``).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import proctree, workloads as wl
from bench.backends import Backends
from bench.peers import Context, Haproxy, PeerPorts, Running
from bench.procs import listening_ports
from bench.progress import Progress

BACKENDS = ("iptables-restore", "nftables")
# Each backend as a node runs it, then with every worker bound to a CPU of its own
# (``--worker-cpu-affinity auto``): a variant is the backend's name, with BOUND after it.
BOUND = " bound"
VARIANTS = (*BACKENDS, *(rules + BOUND for rules in BACKENDS))
WORKERS = 2
NODE_IP = "10.255.0.1"
TARGET_IP = "10.100.255.10"
PORT = 80
PROXY_PORTS = (15000, 39999)
METRICS_URL = "http://127.0.0.1:10249/metrics"
READY_BASE_S = 30.0
READY_PER_SERVICE_S = 0.015
PROBE_TIMEOUT_S = 0.5
SATURATE_CONNECTIONS = 16  # as the peers' connection run (``workloads.Durations``)
# The reference HAProxy's ports: below the proxy ports and the ephemeral ones.
REFERENCE_PORTS = PeerPorts(http=14080, iperf=14201, udp=14900)
POLL_S = 0.05
# The rest of a node's rules: they keep the kernel's NAT hooks and conntrack registered.
NODE_RULES = """table ip bench-node {
  chain pre { type nat hook prerouting priority 100; }
  chain out { type nat hook output priority 100; }
  chain in { type nat hook input priority 100; }
  chain post { type nat hook postrouting priority 100; }
  chain tracked { type filter hook input priority 0; ct state invalid counter; }
}
"""


@dataclass(frozen=True, slots=True)
class Plan:
    services: int  # filler services (the measured one comes on top)
    undisturbed_s: float
    repair_s: float  # length of the rules-repair run
    sync_min_s: float = 4.0
    sync_max_s: float = 40.0
    # The saturated swap's run: long enough to see the sync end while the load lasts.
    saturated_s: float = 20.0
    connections: int = 4  # as the peers' keep-alive run (``workloads.Durations``)
    # Rounds of the three keep-alive runs (undisturbed, big sync, repair): their tails move
    # by 2x between runs of the same code on a shared 2-CPU host, so one run reads as little.
    rounds: int = 3


FULL = Plan(services=10000, undisturbed_s=3, repair_s=10)
QUICK = Plan(services=1000, undisturbed_s=1, repair_s=3, sync_min_s=3.0, saturated_s=5.0, rounds=1)
ROUND_RUNS = ("undisturbed", "big_sync", "repair")
# The HAProxy run beside them, also once a round (``beside``).
ROUND_KEYS = (*ROUND_RUNS, "reference")


def planned_seconds(plan: Plan) -> float:
    """Per variant: start-up, the rounds of runs (HAProxy's beside), the saturated run,
    stopping (for the progress estimate)."""
    start = 1.0 + plan.services * 0.0008
    sync = min(max(2.0 * start + 3.0, plan.sync_min_s), plan.sync_max_s)
    rounds = plan.rounds * (2 * plan.undisturbed_s + sync + plan.repair_s + 3)  # HAProxy too
    return start + 5 + rounds + plan.saturated_s + start


def service_yaml(name: str, ip: str, target: int) -> str:
    return f"""apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: bench}}
spec:
  type: ClusterIP
  clusterIP: {ip}
  clusterIPs: [{ip}]
  ports: [{{name: p, port: {PORT}, protocol: TCP, targetPort: {target}}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: {name}-1
  namespace: bench
  labels: {{kubernetes.io/service-name: {name}}}
addressType: IPv4
ports: [{{name: p, port: {target}, protocol: TCP}}]
endpoints:
  - addresses: ["127.0.0.1"]
    conditions: {{ready: true}}
"""


MAX_GENERATION = 7  # the last /15 of the service range, 10.96.0.0/12


def filler_ip(generation: int, i: int) -> str:
    """Generation g in 10.(96 + 2g).0.0/15: generation 0 in 10.96.0.0/15, 1 in 10.98.0.0/15,
    2 in 10.100.0.0/15 (below the target's 10.100.255.10), and so on up to 7: never the
    same address, always in the service range the namespace routes locally."""
    if not 0 <= generation <= MAX_GENERATION:
        raise ValueError(f"no room for generation {generation} of filler services")
    return f"10.{96 + 2 * generation + i // 62500}.{i // 250 % 250}.{i % 250 + 1}"


def services_file(generation: int, count: int, target: int) -> str:
    """``count`` fillers of one generation, then the measured service (the same in both), all
    of them pointing at the HTTP backend's port ``target`` on 127.0.0.1."""
    docs = [
        service_yaml(f"g{generation}-{i:05d}", filler_ip(generation, i), target)
        for i in range(count)
    ]
    docs.append(service_yaml("zz-target", TARGET_IP, target))
    return "---\n".join(docs)


def prepare_namespace() -> None:
    """Inside this part's fresh namespace: node address, service route, ports, node rules."""
    for argv in (
        ["ip", "addr", "add", f"{NODE_IP}/32", "dev", "lo"],
        ["ip", "route", "add", "local", "10.96.0.0/12", "dev", "lo"],
        ["sysctl", "-q", "-w", "net.ipv4.ip_local_port_range=40000 65000"],
    ):
        _check(argv)
    _check(["nft", "-f", "-"], stdin=NODE_RULES)


def _check(argv: list[str], *, stdin: str | None = None) -> None:
    done = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()[:200]}")


def answers(ip: str, *, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """A new connection to ip:80 gets an HTTP answer (a refusal or silence is False)."""
    try:
        with socket.create_connection((ip, PORT), timeout=timeout) as s:
            s.sendall(b"GET / HTTP/1.0\r\n\r\n")
            return s.recv(16).startswith(b"HTTP/1.")
    except OSError:
        return False


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def scrape(names: tuple[str, ...]) -> dict[str, float]:
    """A few unlabelled series from uproxy's /metrics (0.0 for those not found)."""
    out = dict.fromkeys(names, 0.0)
    with _NO_PROXY.open(METRICS_URL, timeout=30) as resp:
        for raw in resp:
            line = raw.decode(errors="replace")
            name, _, value = line.partition(" ")
            if name in out:
                out[name] = float(value)
    return out


FULL_SYNCS = "kubeproxy_sync_full_proxy_rules_duration_seconds_count"
SYNCS = "kubeproxy_sync_proxy_rules_duration_seconds_count"
RESTARTS = "uproxy_worker_restarts_total"


def ports_changed(log: Path, *, since: float, count: int) -> float | None:
    """When uproxy's log says it had opened and closed ``count`` proxy ports since ``since``
    (its "Proxy ports changed" lines, one per sync), or None."""
    opened = closed = 0
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("msg") != "Proxy ports changed" or record.get("ts", 0.0) < since:
            continue
        opened += int(record.get("opened", 0))
        closed += int(record.get("closed", 0))
        if opened >= count and closed >= count:
            return float(record["ts"])
    return None


def proxy_listeners() -> int:
    low, high = PROXY_PORTS
    return sum(1 for p in listening_ports("tcp") if low <= p <= high)


@dataclass(slots=True)
class Session:
    """One uproxy with one rules backend, while it is measured."""

    ctx: Context
    backends: Backends
    scripts: dict[str, Path]
    plan: Plan
    rules: str
    services: Path
    bound: bool = False
    proc: subprocess.Popen[bytes] | None = None

    @property
    def pids(self) -> list[int]:
        return [self.proc.pid] if self.proc is not None else []

    @property
    def variant(self) -> str:
        """Its name among ``VARIANTS``."""
        return self.rules + (BOUND if self.bound else "")

    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", "uproxy.cli", "--services", str(self.services)]
        argv += ["--rules", self.rules, "--workers", str(WORKERS), "--event-loop", "uvloop"]
        argv += ["--proxy-port-range", f"{PROXY_PORTS[0]}-{PROXY_PORTS[1]}"]
        argv += ["--hostname-override", "bench-node", "--logging-format", "json"]
        argv += ["--worker-cpu-affinity", "auto"] if self.bound else []
        return argv + (["--iptables-mode", "nft"] if self.rules == "iptables-restore" else [])

    def log(self) -> Path:
        if self.proc is None:
            raise RuntimeError("uproxy is not running")
        return self.ctx.procs.log_path(self.proc)

    def flush_rules(self) -> None:
        if self.rules == "nftables":
            _check(["nft", "delete", "table", "ip", "uproxy"])
        else:
            _check(["iptables-nft", "-w", "5", "-t", "nat", "-F"])

    def load(self, seconds: float, *, saturate: bool = False) -> Callable[[], wl.Figures]:
        """The peers' paced keep-alive wrk run, to the measured service's ClusterIP; with
        ``saturate``, their unpaced connection run instead."""
        if saturate:
            script, connections = "conn", SATURATE_CONNECTIONS
        else:
            script, connections = "keepalive", self.plan.connections

        def run() -> wl.Figures:
            return wl.wrk(
                PORT,
                script=self.scripts[script],
                connections=connections,
                seconds=seconds,
                core=self.ctx.where.load,
                host=TARGET_IP,
            )

        return run

    def accounted(self, run: Callable[[], wl.Figures]) -> wl.Figures:
        """``run`` with the CPU of uproxy's tree by role over it."""
        before = proctree.sample(self.pids)
        start = time.monotonic()
        figures = run()
        figures["wall_s"] = time.monotonic() - start
        figures.update(proctree.between(before, proctree.sample(self.pids)).figures())
        return figures


def start(s: Session, progress: Progress) -> dict[str, Any]:
    """uproxy up with N + 1 services, ready and carrying bytes right; its start-up figures."""
    started = time.monotonic()
    s.proc = s.ctx.procs.start(
        s.argv(), core=s.ctx.where.proxy, name="uproxy-" + s.variant.replace(" ", "-")
    )
    want = s.plan.services + 1
    deadline = started + READY_BASE_S + READY_PER_SERVICE_S * want
    while not answers(TARGET_IP):
        _alive_or_raise(s, deadline, "the target does not answer through its ClusterIP")
        time.sleep(POLL_S)
    serving = time.monotonic() - started
    while proxy_listeners() < want:
        _alive_or_raise(s, deadline, f"{proxy_listeners()} of {want} proxy ports listen")
        time.sleep(0.2)
    check_bytes(s)
    out = {"serving_s": serving, "listening_s": time.monotonic() - started}
    out.update(proctree.memory_mb(s.pids))
    progress.say(
        f"disturb {s.variant}: {want:,} services, serving after "
        f"{serving:.1f} s, all listening after {out['listening_s']:.1f} s, bytes verified"
    )
    return out


def _alive_or_raise(s: Session, deadline: float, what: str) -> None:
    if s.proc is not None and s.proc.poll() is not None:
        raise RuntimeError(f"uproxy exited while starting: {s.ctx.procs.log_tail(s.proc)}")
    if time.monotonic() > deadline:
        raise RuntimeError(f"not ready in time: {what}")


def check_bytes(s: Session) -> None:
    url = f"http://{TARGET_IP}:{PORT}/blob"
    with _NO_PROXY.open(url, timeout=10) as resp:
        body = resp.read()
    if hashlib.sha256(body).hexdigest() != s.backends.blob_sha256:
        raise RuntimeError(f"HTTP body through the ClusterIP is wrong ({len(body)} bytes)")


def big_sync(
    s: Session, start_s: float, *, generation: int = 1, saturate: bool = False
) -> wl.Figures:
    """Replace every filler service (generation - 1) by ``generation``'s while a keep-alive
    run (``saturate``: a connection run as fast as it goes) goes on; time the sync."""
    n = s.plan.services
    if saturate:
        seconds = s.plan.saturated_s
    else:
        seconds = min(max(2.0 * start_s + 3.0, s.plan.sync_min_s), s.plan.sync_max_s)
    fresh = s.services.with_suffix(".next")
    fresh.write_text(services_file(generation, n, s.backends.ports.http))
    old_ip, new_ip = filler_ip(generation - 1, 0), filler_ip(generation, n - 1)
    syncs_before = scrape((SYNCS,))[SYNCS]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(s.accounted, s.load(seconds, saturate=saturate))
        time.sleep(0.5)
        os.replace(fresh, s.services)
        replaced_wall, replaced = time.time(), time.monotonic()
        # Past the end of the run too (bounded): a sync that outlasts it is still timed.
        new_at = old_gone_at = None
        deadline = replaced + s.plan.sync_max_s
        while (new_at is None or old_gone_at is None) and time.monotonic() < deadline:
            if new_at is None and answers(new_ip):
                new_at = time.monotonic() - replaced
            if old_gone_at is None and not answers(old_ip):
                old_gone_at = time.monotonic() - replaced
            time.sleep(POLL_S)
        figures = running.result()
    figures["run_s"] = seconds
    figures["new_reachable_s"] = -1.0 if new_at is None else new_at
    figures["old_refused_s"] = -1.0 if old_gone_at is None else old_gone_at
    listeners_at = ports_changed(s.log(), since=replaced_wall, count=n)
    figures["listeners_done_s"] = -1.0 if listeners_at is None else listeners_at - replaced_wall
    done = (figures["new_reachable_s"], figures["old_refused_s"], figures["listeners_done_s"])
    figures["sync_done_s"] = -1.0 if min(done) < 0 else max(done)
    figures["syncs"] = scrape((SYNCS,))[SYNCS] - syncs_before
    figures["listeners_after"] = float(proxy_listeners())
    # The sync starts 0.5 s into the run; one not done by the deadline covered all the rest.
    done_s = figures["sync_done_s"] if figures["sync_done_s"] >= 0 else seconds
    figures["covered_pct"] = 100.0 * min(done_s, seconds - 0.5) / seconds
    return figures


def rules_repairs(s: Session) -> wl.Figures:
    """Flush uproxy's rules, wait for the repair, again and again, during a keep-alive run."""
    repairs: list[float] = []
    full_before = scrape((FULL_SYNCS,))[FULL_SYNCS]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(s.accounted, s.load(s.plan.repair_s))
        time.sleep(0.5)
        end = time.monotonic() + s.plan.repair_s - 1.5
        while time.monotonic() < end and not running.done():
            s.flush_rules()
            flushed = time.monotonic()
            while not answers(TARGET_IP) and not running.done():
                time.sleep(0.02)
            if answers(TARGET_IP):
                repairs.append(time.monotonic() - flushed)
            time.sleep(1.0)
        figures = running.result()
    figures["repairs"] = float(len(repairs))
    figures["repair_median_s"] = sorted(repairs)[len(repairs) // 2] if repairs else -1.0
    figures["repair_max_s"] = max(repairs) if repairs else -1.0
    figures["full_syncs"] = scrape((FULL_SYNCS,))[FULL_SYNCS] - full_before
    figures["covered_pct"] = 100.0 * min(1.0, sum(repairs) / s.plan.repair_s)
    return figures


def run(
    variant: str,
    ctx: Context,
    backends: Backends,
    plan: Plan,
    scripts: dict[str, Path],
    progress: Progress,
) -> dict[str, Any]:
    """One of ``VARIANTS``: start, the rounds of three runs, the saturated run, stop. Its
    entry of the raw JSON: each run's figures by round (``rounds``), and under the run's own
    key the round whose p99 is the median."""
    rules, bound = variant.removesuffix(BOUND), variant.endswith(BOUND)
    prepare_namespace()
    path = ctx.workdir / f"services-{rules}.yaml"
    path.write_text(services_file(0, plan.services, backends.ports.http))
    s = Session(ctx, backends, scripts, plan, rules, path, bound)
    entry: dict[str, Any] = {
        "rules": rules,
        "bound": bound,
        "services": plan.services,
        "workers": WORKERS,
    }
    rounds: dict[str, list[wl.Figures]] = {key: [] for key in ROUND_KEYS}
    entry["rounds"] = rounds
    haproxy = Haproxy(threads=WORKERS, bound=bound)
    entry["reference_peer"] = haproxy.name
    reference: Running | None = None
    try:
        entry["start"] = start(s, progress)
        reference = haproxy.start(ctx, REFERENCE_PORTS)
        listening_s = entry["start"]["listening_s"]
        for i in range(plan.rounds):
            tag = f"disturb {variant}" + (
                f", round {i + 1}/{plan.rounds}" if plan.rounds > 1 else ""
            )
            rounds["undisturbed"].append(s.accounted(s.load(plan.undisturbed_s)))
            progress.say(f"{tag}: undisturbed: {_line(rounds['undisturbed'][-1])}")
            rounds["reference"].append(beside(ctx, plan, scripts))
            progress.say(f"{tag}: {haproxy.name} beside: {_line(rounds['reference'][-1])}")
            rounds["big_sync"].append(big_sync(s, listening_s, generation=i + 1))
            progress.say(f"{tag}: big sync: {_sync_line(rounds['big_sync'][-1])}")
            rounds["repair"].append(rules_repairs(s))
            progress.say(f"{tag}: rules repair: {_repair_line(rounds['repair'][-1])}")
            for key in ROUND_KEYS:
                entry[key] = median_round(rounds[key])
        saturated = big_sync(s, listening_s, generation=plan.rounds + 1, saturate=True)
        entry["big_sync_saturated"] = saturated
        progress.say(f"disturb {variant}: big sync, workers saturated: {_sync_line(saturated)}")
        entry["end"] = proctree.memory_mb(s.pids)
        entry["end"]["worker_restarts"] = scrape((RESTARTS,))[RESTARTS]
    finally:
        if reference is not None:
            haproxy.stop(ctx, reference)
        if s.proc is not None:
            ctx.procs.stop(s.proc, timeout_s=30)
    return entry


def beside(ctx: Context, plan: Plan, scripts: dict[str, Path]) -> wl.Figures:
    """The undisturbed keep-alive run through the reference HAProxy (``REFERENCE_PORTS``)."""
    return wl.wrk(
        REFERENCE_PORTS.http,
        script=scripts["keepalive"],
        connections=plan.connections,
        seconds=plan.undisturbed_s,
        core=ctx.where.load,
    )


def median_round(runs: list[wl.Figures]) -> wl.Figures:
    """The run whose p99 is the median of ``runs`` (the lower middle one of an even count)."""
    ordered = sorted(runs, key=lambda f: f["p99_ms"])
    return ordered[(len(ordered) - 1) // 2]


def _line(f: wl.Figures) -> str:
    text = f"p50 {f['p50_ms']:.3f} ms, p99 {f['p99_ms']:.3f} ms, max {f['max_ms']:.1f} ms"
    text += f", {f['rate']:,.0f} req/s"
    if f.get("errors"):
        text += f", errors {f['errors']:.0f}"
    if "cpu_main_s" not in f:
        return text
    return text + f"; CPU control {f['cpu_main_s']:.2f} s, workers {f['cpu_workers_s']:.2f} s"


def _sync_line(f: wl.Figures) -> str:
    return (
        f"{_line(f)}; new services answer after {f['new_reachable_s']:.1f} s, old refused after "
        f"{f['old_refused_s']:.1f} s, ports swapped after {f['listeners_done_s']:.1f} s "
        f"({f['covered_pct']:.0f} % of the {f['run_s']:.0f} s run)"
    )


def _repair_line(f: wl.Figures) -> str:
    return (
        f"{_line(f)}; {f['repairs']:.0f} repairs, median {f['repair_median_s']:.2f} s, "
        f"max {f['repair_max_s']:.2f} s"
    )
