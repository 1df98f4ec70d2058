"""One control-plane session: uproxy with a real rules backend, inside the node's namespace.

A session runs inside the node namespace (``python -m bench.controlplane session``, started
with ``ip netns exec`` by ``bench.controlplane``, which builds and always deletes the
namespaces). Everything it measures is then local: /proc/net/tcp is the node's, the
iptables/nft tools read the node's rules, clients connect to ClusterIPs through the node's
host portal, and /metrics is on the node's 127.0.0.1. The session starts the API double and
uproxy, measures, and stops both on every exit path; the namespace's deletion is the backstop.

What one session measures, in this order (see ``bench.controlplane`` for the definitions):

1. cold start: spawn to every listener open, and to every portal in the kernel; ``starts``
   times (stopped, and the rules removed with ``uproxy --cleanup``, between them), each
   figure the median of the starts;
2. memory (API source): RSS at synced, after ``settle_s`` idle, after ``relists`` forced relists;
3. detail (the largest size only): one /metrics scrape; endpoint changes, without and then with
   a scrape every second; services added; then every endpoint moved at once (a watch burst
   of one event per service), timed and its CPU read. Each write lands after a random pause (a fixed
   seed), so that it meets uproxy's periodic work (rules check every second, rate-limited
   syncs) at a random phase, as a write in a cluster would.
"""

from __future__ import annotations

import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from subprocess import Popen
from typing import Any

from bench import proctree
from bench.cp_cluster import (
    ADDED_PORT_BASE,
    BACKENDS,
    NODE,
    NODE_IP,
    PORT_BASE,
    TARGET_PORT,
    Control,
    added_ip,
    cluster_ip,
)
from bench.cp_probes import (
    PortalRules,
    ask,
    poll_answer,
    proxy_listeners,
    read_scrapes,
    sample_values,
    scrape,
    status_mib,
    wait_rules,
)
from bench.cp_report import fmt_num
from bench.procs import Cores, ProcessGroup, cpu_split, listening_ports
from bench.proctree import CLK_TCK
from bench.progress import Progress

METRICS = ("127.0.0.1", 10249)
OLD, NEW = "backend-a", "backend-b"
POLL_LIMIT_S = 10.0  # one endpoint change or one added service: give up after this long
POLL_MAX_ATTEMPTS = 5000
BULK_LIMIT_S = 60  # every endpoint moved at once: give up after this long
BULK_SAMPLES = 20
BULK_QUIET_S = 0.5
SYNC_SAMPLES = tuple(
    f"{name}_{part}"
    for name in (
        "kubeproxy_sync_proxy_rules_duration_seconds",
        "kubeproxy_network_programming_duration_seconds",
    )
    for part in ("sum", "count")
)


@dataclass(frozen=True, slots=True)
class SessionPlan:
    services: int
    backend: str  # uproxy's --rules
    source: str  # "api" (the API double) or "file" (--services FILE)
    detail: bool
    changes: int
    relists: int
    settle_s: float
    cold_timeout_s: float
    starts: int = 1


def run_session(
    plan: SessionPlan,
    *,
    workdir: Path,
    cores: Cores,
    services_file: Path | None,
    progress: Progress,
) -> dict[str, Any]:
    procs = ProcessGroup(logdir=workdir)
    try:
        return _session(plan, procs, workdir, cores, services_file, progress)
    finally:
        procs.stop_all()


def _session(
    plan: SessionPlan,
    procs: ProcessGroup,
    workdir: Path,
    cores: Cores,
    services_file: Path | None,
    progress: Progress,
) -> dict[str, Any]:
    _wait_backends()
    control: Control | None = None
    if plan.source == "api":
        kubeconfig, control = _start_double(plan, procs, workdir, cores)
        source_args = ["--kubeconfig", str(kubeconfig), "--hostname-override", NODE]
    else:
        if services_file is None:
            raise RuntimeError("a file session needs --services-file")
        source_args = ["--services", str(services_file)]
    result: dict[str, Any] = {}
    starts: list[dict[str, Any]] = []
    for _ in range(plan.starts - 1):
        earlier: dict[str, Any] = {}
        proxy = _cold_start(plan, procs, cores, source_args, earlier)
        if proxy is None:
            return earlier
        starts.append(earlier)
        procs.stop(proxy, timeout_s=30)
        _remove_rules()
    proxy = _cold_start(plan, procs, cores, source_args, result)
    if proxy is None:
        return result
    starts.append(dict(result))
    for key in ("listeners_s", "rules_s", "synced_s"):
        result[f"{key}_runs"] = [s[key] for s in starts]
        result[key] = statistics.median(result[f"{key}_runs"])
    progress.say(
        f"control plane, {plan.backend}, {plan.services:,} services from the "
        f"{'API double' if control else 'file'}: synced in {result['synced_s']:.2f} s "
        f"(listeners {result['listeners_s']:.2f} s), RSS {result['rss_synced_mib']:.0f} MiB"
        + (
            f"; median of {len(starts)} starts: {_runs(result['synced_s_runs'])}"
            if len(starts) > 1
            else ""
        )
    )
    if control is not None:
        _memory(plan, proxy, control, result, progress)
        if plan.detail:
            result["detail"] = _detail(plan, procs, proxy.pid, cores, control, workdir, progress)
    result["rss_end_mib"] = status_mib(proxy.pid)
    result["peak_rss_mib"] = status_mib(proxy.pid, "VmHWM")
    if proxy.poll() is not None:
        raise RuntimeError(f"uproxy exited during the session: {procs.log_tail(proxy)}")
    return result


def _wait_backends() -> None:
    deadline = time.monotonic() + 15
    while True:
        try:
            if all(ask(ip, TARGET_PORT) == name for name, ip in BACKENDS.items()):
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("the backends did not answer within 15 s")
        time.sleep(0.05)


def _start_double(
    plan: SessionPlan, procs: ProcessGroup, workdir: Path, cores: Cores
) -> tuple[Path, Control]:
    kubeconfig, ready, sock = (workdir / n for n in ("kubeconfig", "apiserver.ready", "ctl.sock"))
    argv = [sys.executable, "-m", "bench.controlplane", "serve", "--services", str(plan.services)]
    argv += ["--kubeconfig", str(kubeconfig), "--ready", str(ready)]
    argv += ["--address", BACKENDS[OLD], "--node-ip", NODE_IP, "--control", str(sock)]
    api = procs.start(argv, core=cores.load, name=f"apiserver-{plan.services}")
    deadline = time.monotonic() + 180
    while not ready.exists():
        if api.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"API server double did not start: {procs.log_tail(api)}")
        time.sleep(0.05)
    return kubeconfig, Control(sock)


# --- 1. cold start -------------------------------------------------------------------------


def _cold_start(
    plan: SessionPlan,
    procs: ProcessGroup,
    cores: Cores,
    source_args: list[str],
    result: dict[str, Any],
) -> Popen[bytes] | None:
    """Spawn uproxy and wait until synced; None (and ``exited`` in result) if it quit."""
    baseline = listening_ports("tcp")
    rules = PortalRules(plan.backend, plan.services)
    argv = [sys.executable, "-m", "uproxy.cli", *source_args, "--rules", plan.backend]
    t0 = time.monotonic()
    proxy = procs.start(argv, core=cores.proxy, name=f"uproxy-{plan.source}-{plan.services}")
    deadline = t0 + plan.cold_timeout_s

    def alive() -> bool:
        return proxy.poll() is None

    try:
        listeners_at = _wait_listeners(plan.services, baseline, deadline, alive)
        rules_at, rules_read_s = wait_rules(rules, deadline=deadline, alive=alive)
    except RuntimeError as e:
        if proxy.poll() is not None:
            result.update(exited=proxy.returncode, log=procs.log_tail(proxy, lines=3))
            return None
        raise RuntimeError(f"{e} ({plan.cold_timeout_s:.0f} s)") from None
    result["rss_synced_mib"] = status_mib(proxy.pid)
    result["listeners_s"] = listeners_at - t0
    result["rules_s"] = rules_at - t0
    result["rules_read_s"] = rules_read_s
    result["synced_s"] = max(listeners_at, rules_at) - t0
    result["listeners"] = proxy_listeners(baseline)
    result["portal_entries"] = rules.count()
    result["portal_entries_expected"] = rules.expected
    result["baseline_ports"] = sorted(baseline)
    return proxy


def _runs(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values) + " s"


def _remove_rules() -> None:
    """What a start left in the kernel goes, so the next start programs everything."""
    done = subprocess.run(
        [sys.executable, "-m", "uproxy.cli", "--cleanup"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0:
        raise RuntimeError(f"uproxy --cleanup failed: {done.stderr.strip()[-300:]}")


def _wait_listeners(
    services: int, baseline: set[int], deadline: float, alive: Callable[[], bool]
) -> float:
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError("uproxy exited before opening its listeners")
        if proxy_listeners(baseline) >= services:
            return time.monotonic()
        time.sleep(0.05)
    raise RuntimeError(f"uproxy did not open {services} listeners in time")


# --- 2. memory -----------------------------------------------------------------------------


def _memory(
    plan: SessionPlan,
    proxy: Popen[bytes],
    control: Control,
    result: dict[str, Any],
    progress: Progress,
) -> None:
    time.sleep(plan.settle_s)
    result["rss_settled_mib"] = status_mib(proxy.pid)
    relists: list[float] = []
    for _ in range(plan.relists):
        reply = control.call({"op": "relist", "timeout_s": 120}, timeout_s=130)
        if not reply["ok"]:
            raise RuntimeError("uproxy did not list and watch again within 120 s of a 410")
        if not reply["relisted"]:
            result.setdefault("problems", []).append("watched again after a 410 without a list")
        relists.append(reply["s"])
    time.sleep(1.0)
    result["relist_s"] = relists
    result["rss_relists_mib"] = status_mib(proxy.pid)
    baseline = set(result["baseline_ports"])
    result["listeners_after_relists"] = proxy_listeners(baseline)
    if result["listeners_after_relists"] != result["listeners"]:
        result.setdefault("problems", []).append(
            f"{result['listeners']} listeners before {plan.relists} relists, "
            f"{result['listeners_after_relists']} after"
        )
    progress.say(
        f"control plane, {plan.backend}, {plan.services:,} services: RSS settled "
        f"{result['rss_settled_mib']:.0f} MiB, after {plan.relists} relists "
        f"{result['rss_relists_mib']:.0f} MiB"
    )


# --- 3-5. detail at the largest size ---------------------------------------------------------


def _detail(
    plan: SessionPlan,
    procs: ProcessGroup,
    proxy_pid: int,
    cores: Cores,
    control: Control,
    workdir: Path,
    progress: Progress,
) -> dict[str, Any]:
    rng = random.Random(plan.services)
    body, seconds = scrape(*METRICS)
    out: dict[str, Any] = {"services": plan.services, "metrics": {"bytes": len(body), "s": seconds}}
    before = sample_values(body.decode(), SYNC_SAMPLES)
    n, c = plan.services, plan.changes
    out["endpoint_change"] = _changes(control, [j * n // c for j in range(c)], rng)
    progress.say(_said("endpoint change", out["endpoint_change"]))
    scrapes = workdir / "scrapes.txt"
    argv = [sys.executable, "-m", "bench.controlplane", "scrape", "--out", str(scrapes)]
    scraper = procs.start(argv, core=cores.load, name="scraper")
    try:
        indices = [j * n // c + max(1, n // (2 * c)) for j in range(c)]
        out["endpoint_change_scraped"] = _changes(control, indices, rng)
    finally:
        procs.stop(scraper)
    done = read_scrapes(scrapes)
    failed = sum(1 for _, size in done if not size)
    out["scrapes"] = {"count": len(done), "s": [s for s, _ in done], "failed": failed}
    progress.say(_said("endpoint change, /metrics every 1 s", out["endpoint_change_scraped"]))
    out["service_add"] = _additions(control, c, rng)
    progress.say(_said("service added", out["service_add"]))
    out["bulk_move"] = bulk = _bulk_move(control, proxy_pid, n)
    progress.say(
        f"control plane, every endpoint moved at once ({n:,} watch events): the last service "
        f"answered from {NEW} after {fmt_num(bulk['last_s'])} s, the control process's CPU "
        f"{fmt_num(bulk['control_cpu_s'])} s, all of uproxy's {fmt_num(bulk['tree_cpu_s'])} s"
    )
    # uproxy's own account of its work meanwhile, to read the figures with.
    after = sample_values(scrape(*METRICS)[0].decode(), SYNC_SAMPLES)
    out["uproxy_metrics"] = {k: after[k] - before.get(k, 0.0) for k in after}
    return out


def _said(what: str, figures: dict[str, Any]) -> str:
    ms = sorted(figures["ms"])
    text = "no answer" if not ms else f"median {ms[len(ms) // 2]:.0f} ms, max {ms[-1]:.0f} ms"
    return f"control plane, {what}: {len(ms)} timed, {text}, {figures['timeouts']} timed out"


def _changes(control: Control, indices: list[int], rng: random.Random) -> dict[str, Any]:
    """Move each service's endpoint from backend-a to backend-b; time to the first client
    connection answered by backend-b. Every connection must be answered by one of the two."""
    ms: list[float] = []
    out: dict[str, Any] = {"ms": ms, "timeouts": 0, "failed": 0, "other": 0, "problems": []}
    for k in indices:
        time.sleep(rng.uniform(0.2, 1.2))
        ip, port = cluster_ip(k), PORT_BASE + k
        try:
            before = ask(ip, port)
        except OSError as e:
            before = f"no answer ({e})"
        if before != OLD:
            out["problems"].append(f"svc-{k} answered {before!r} before its change, not {OLD}")
        t = control.call({"op": "move", "service": f"svc-{k}", "address": BACKENDS[NEW]})["t"]
        poll = poll_answer(
            ip,
            port,
            NEW,
            accept=frozenset({OLD}),
            limit_s=POLL_LIMIT_S,
            max_attempts=POLL_MAX_ATTEMPTS,
        )
        out["failed"] += poll.failed
        out["other"] += poll.other
        if poll.first_at is None:
            out["timeouts"] += 1
        else:
            ms.append((poll.first_at - t) * 1000)
    if out["failed"] or out["other"]:
        out["problems"].append(
            f"{out['failed']} client connections got no answer and {out['other']} an answer "
            f"from neither backend while endpoints moved (each should reach one of them)"
        )
    return out


def _bulk_move(control: Control, proxy_pid: int, services: int) -> dict[str, Any]:
    """Every service's endpoint moves to backend-b in one go (one watch event per slice).

    Timed to the first answer from backend-b through the last service written (the watch
    delivers in order); then a spread of BULK_SAMPLES services must answer from backend-b
    too, and uproxy's CPU is read once its control process has been idle for BULK_QUIET_S.
    """
    out: dict[str, Any] = {"events": services, "problems": []}
    cpu0, own0 = cpu_split(proxy_pid), _own_cpu(proxy_pid)
    reply = control.call(
        {"op": "move_all", "address": BACKENDS[NEW], "services": services}, timeout_s=60
    )
    t, out["written_s"] = reply["t"], reply["written_s"]
    last = services - 1
    poll = poll_answer(
        cluster_ip(last),
        PORT_BASE + last,
        NEW,
        accept=frozenset({OLD}),
        limit_s=BULK_LIMIT_S,
        max_attempts=BULK_LIMIT_S * 200,
    )
    out["last_s"] = None if poll.first_at is None else poll.first_at - t
    if poll.failed or poll.other:
        out["problems"].append(
            f"{poll.failed} connections unanswered, {poll.other} answered by neither backend"
        )
    stale = []
    for k in (j * services // BULK_SAMPLES for j in range(BULK_SAMPLES)):
        try:
            answer = ask(cluster_ip(k), PORT_BASE + k)
        except OSError as e:
            answer = f"no answer ({e})"
        if answer != NEW:
            stale.append(f"svc-{k}: {answer!r}")
    if stale:
        out["problems"].append(f"after the last moved, not moved yet: {', '.join(stale[:5])}")
    deadline, prev = time.monotonic() + BULK_LIMIT_S, _own_cpu(proxy_pid)
    while time.monotonic() < deadline:
        time.sleep(BULK_QUIET_S)
        now = _own_cpu(proxy_pid)
        if now - prev < BULK_QUIET_S * 0.05:  # under 5 % of a CPU: done
            break
        prev = now
    cpu1 = cpu_split(proxy_pid)
    out["control_cpu_s"] = _own_cpu(proxy_pid) - own0
    out["tree_cpu_s"] = sum(cpu1) - sum(cpu0)
    return out


def _own_cpu(pid: int) -> float:
    """User and system CPU seconds of one process (not its children)."""
    (s,) = proctree.sample([pid])
    p = s.procs[pid]
    return (p.user + p.system) / CLK_TCK


def _additions(control: Control, count: int, rng: random.Random) -> dict[str, Any]:
    """Add a service and its slice; time to the first client answered through its ClusterIP.
    Refusals before that are expected (no portal yet), answers from elsewhere are not."""
    ms: list[float] = []
    out: dict[str, Any] = {"ms": ms, "timeouts": 0, "attempts": 0, "other": 0}
    for j in range(count):
        time.sleep(rng.uniform(0.2, 1.2))
        ip, port = added_ip(j), ADDED_PORT_BASE + j
        request = {"op": "add", "name": f"add-{j}", "ip": ip, "port": port}
        t = control.call({**request, "address": BACKENDS[OLD]})["t"]
        poll = poll_answer(ip, port, OLD, limit_s=POLL_LIMIT_S, max_attempts=POLL_MAX_ATTEMPTS)
        out["attempts"] += poll.attempts
        out["other"] += poll.other
        if poll.first_at is None:
            out["timeouts"] += 1
        else:
            ms.append((poll.first_at - t) * 1000)
    return out
