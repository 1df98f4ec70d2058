"""Control plane: what a node running uproxy sees at 1,000 / 5,000 / 10,000 service ports.

As root, uproxy runs as on a node: in a network namespace of its own (built here and deleted
on every exit path), with a real rules backend (``--rules iptables-restore``, and
``--rules nftables``; a backend uproxy refuses to start with is skipped with a note), its
health and metrics endpoints on, reading N single-port services (``bench.cp_cluster``) from the
API-server double (TLS, paged lists, chunked watches) or from a services file. Each session
gets fresh namespaces (no rules, sockets or conntrack entries left by the last one)::

    node namespace  (uproxy, the API double, the measuring session; 10.244.1.1)
        │  veth          10.96.0.0/12 is routed to the backend namespace, where it is local
    backend namespace   backend-a 10.244.1.2:8080, backend-b 10.244.1.3:8080 (answer their name)

Definitions (time is CLOCK_MONOTONIC from spawning uproxy, so interpreter start and imports
count, as on a pod restart; or from the API double's commit of a write):

- **Synced** = listeners AND rules, whichever comes last. Listeners: the node namespace's
  /proc/net/tcp holds N listening ports besides those open before uproxy started (the API
  double's) and uproxy's healthz/metrics ports. Rules, iptables-restore: nat KUBE-PORTALS-
  CONTAINER and KUBE-PORTALS-HOST hold the 2N rules of the N services (``iptables-nft-save -t
  nat``; timed when the jump from nat OUTPUT, written in the same transaction, first showed);
  nftables: ``nft list ruleset`` names all N ClusterIPs (timed when uproxy's table, loaded
  whole in one transaction, first showed in ``nft -t list ruleset``). When the first full
  count after that signal falls short, the time is the end of the first count that did not.
- **RSS**: VmRSS of uproxy when synced, after ``settle_s`` idle, and after ``relists`` forced
  relists (each: every watch expired with 410 Gone, done when uproxy has listed and watched
  Services, EndpointSlices and its Node again; back to back, so every relist after the first
  includes uproxy's back-off on 410s in a row); also the peak (VmHWM).
- **Endpoint change** (largest size only): the double moves one service's endpoint from
  backend-a to backend-b; timed from that write to the start of the first client connection
  (node → ClusterIP → host portal → uproxy) answered by backend-b; a client reconnects every
  5 ms, each try bounded. Then again while /metrics is scraped every second. Every connection
  during a change must be answered by one backend or the other: anything else is reported.
- **Service added**: the double creates a Service and its EndpointSlice; timed to the start
  of the first connection to its ClusterIP answered by the backend (before its portal exists a
  connection is refused at once: the service range is local to the backend namespace).
- **/metrics**: one scrape's bytes and seconds, on the node's 127.0.0.1:10249; and uproxy's
  own account of the changes and additions (its sync and network-programming histograms, read
  before and after: the double's slices carry the trigger-time annotation), to read ours with.

Without root (or with ``--no-netns``), only the laptop-mode cold start runs: ``--rules
none``, synced when N listeners are open on 127.0.0.1.

    sudo .venv/bin/python -m bench.controlplane run [--quick] [--sizes 1000,10000]
        [--backends nftables] [--changes N] [--relists N] [--settle S] [--out FILE]
    python -m bench.controlplane serve|session|backend|scrape ...   (the run's own children)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import FrameType
from typing import Any

from bench import netns
from bench.cmdline import positive_int, positive_ints
from bench.cp_cluster import BACKENDS, NODE, NODE_IP, SERVICE_CIDR, TARGET_PORT
from bench.procs import Cores, ProcessGroup, peak_rss_bytes, run_uproxy_as_shipped
from bench.progress import Progress

BACKENDS_UNDER_TEST = ("iptables-restore", "nftables")


@dataclass(frozen=True, slots=True)
class ScalePlan:
    sizes: tuple[int, ...]
    changes: int  # endpoint changes (each way) and services added, at the largest size
    relists: int
    settle_s: float
    backends: tuple[str, ...] = BACKENDS_UNDER_TEST
    # Cold starts per session, reported as their median: one start at 10,000 services moved
    # by 20 % between two runs on this 2-vCPU VM. Rules are removed before each.
    starts: int = 3


FULL = ScalePlan(sizes=(1000, 5000, 10000), changes=20, relists=10, settle_s=10.0)
QUICK = ScalePlan(sizes=(100, 500), changes=5, relists=3, settle_s=2.0, starts=1)


def scale_plan(sizes: list[int], *, quick: bool) -> ScalePlan:
    return replace(QUICK if quick else FULL, sizes=tuple(sizes))


def _session_planned_s(plan: ScalePlan, services: int, source: str) -> float:
    """A rough estimate of one session, for the progress line (measured on 2 cores)."""
    restarts = (plan.starts - 1) * (2.0 + services / 3000)
    if source == "file":
        return restarts + 2.0 + services / 450  # PyYAML dominates
    total = restarts + 5.0 + services / 1000 + plan.settle_s
    total += plan.relists * (0.6 + services / 20000)
    return total + (3 * plan.changes + 2 if services == max(plan.sizes) else 0)


def planned_seconds(plan: ScalePlan) -> float:
    sessions = [(n, source) for n in plan.sizes for source in ("api", "file")]
    return len(plan.backends) * sum(_session_planned_s(plan, n, s) for n, s in sessions)


# --- at scale: namespaces and sessions --------------------------------------------------------


def run_at_scale(
    plan: ScalePlan, *, procs: ProcessGroup, cores: Cores, workdir: Path, progress: Progress
) -> dict[str, Any]:
    from bench.cp_cluster import write_services_file

    out: dict[str, Any] = {"sizes": {}, "notes": []}
    scale: dict[str, Any] = {"plan": asdict(plan), "backends": {}, "notes": []}
    out["scale"] = scale
    files: dict[int, Path] = {}
    for n in plan.sizes:
        files[n] = workdir / f"services-{n}.yaml"
        write_services_file(files[n], n, BACKENDS["backend-a"])
    for backend in plan.backends:
        entry: dict[str, Any] = {"sizes": {}}
        scale["backends"][backend] = entry
        for n in plan.sizes:
            sizes = entry["sizes"][str(n)] = {}
            for source in ("api", "file"):
                res = _session(plan, backend, n, source, procs, cores, workdir, files[n], progress)
                progress.advance(_session_planned_s(plan, n, source))
                if "exited" in res and n == plan.sizes[0] and source == "api":
                    entry["skipped"] = f"uproxy did not start with --rules {backend}: {res['log']}"
                    progress.say(f"control plane, {backend}: skipped: {entry['skipped']}")
                    break
                sizes[source] = res
                if _note(scale["notes"], f"{backend}, {n:,} services, {source}", res, progress):
                    out["failed"] = True
            if "skipped" in entry:
                entry["sizes"] = {}
                break
    return out


def _note(notes: list[str], where: str, res: dict[str, Any], progress: Progress) -> bool:
    """A failed session (True), or wrong behaviour seen in one, goes into the notes."""
    failed = "error" in res or "exited" in res
    if failed:
        why = res.get("error") or f"uproxy exited with {res['exited']}: {res.get('log')}"
        notes.append(f"{where}: failed: {why}")
        progress.say(f"control plane, {where}: failed: {why}")
    for problem in res.get("problems", []):
        notes.append(f"{where}: {problem}")
    for kind in ("endpoint_change", "endpoint_change_scraped", "service_add", "bulk_move"):
        for problem in res.get("detail", {}).get(kind, {}).get("problems", []):
            notes.append(f"{where}, {kind}: {problem}")
    return failed


def _session(
    plan: ScalePlan,
    backend: str,
    services: int,
    source: str,
    procs: ProcessGroup,
    cores: Cores,
    workdir: Path,
    services_file: Path,
    progress: Progress,
) -> dict[str, Any]:
    """One session in fresh namespaces, deleted whatever happens; its result or its error."""
    tag = f"{os.getpid()}-{len(list(workdir.glob('session-*')))}"
    sessdir = workdir / f"session-{tag}-{backend}-{services}-{source}"
    sessdir.mkdir()
    node_ns, backend_ns = f"ucp-{tag}-node", f"ucp-{tag}-be"
    child: subprocess.Popen[bytes] | None = None
    backends: subprocess.Popen[bytes] | None = None
    try:
        _build(node_ns, backend_ns)
        backends = procs.start(_in(backend_ns, "backend"), core=cores.load, name=f"backends-{tag}")
        argv = _in(node_ns, "session", "--services", str(services), "--backend", backend)
        argv += ["--source", source, "--services-file", str(services_file)]
        argv += _session_args(plan, services, cores, sessdir, progress)
        # Its own session (stopped by process group), its progress lines on our stderr.
        child = subprocess.Popen(["taskset", "-c", str(cores.load), *argv], start_new_session=True)
        try:
            child.wait(timeout=_session_timeout_s(plan, services))
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {_session_timeout_s(plan, services):.0f} s"}
        if not (sessdir / "result.json").exists():
            return {"error": f"the session exited with {child.returncode} and no result"}
        result: dict[str, Any] = json.loads((sessdir / "result.json").read_text())
        return result
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        for proc in (child, backends):
            if proc is not None:
                procs.stop(proc, timeout_s=30)
        netns.delete(node_ns)
        netns.delete(backend_ns)


def _session_args(
    plan: ScalePlan, services: int, cores: Cores, sessdir: Path, progress: Progress
) -> list[str]:
    argv = ["--workdir", str(sessdir), "--cores", f"{cores.proxy},{cores.load}"]
    argv += ["--plan", json.dumps(asdict(plan)), "--out", str(sessdir / "result.json")]
    argv += ["--progress", f"{progress.done_planned_s},{progress.planned_s},{progress.start_wall}"]
    return [*argv, "--detail"] if services == max(plan.sizes) else argv


def _session_timeout_s(plan: ScalePlan, services: int) -> float:
    """Generous: every bounded step of a session at its longest, plus start-up."""
    cold = 180.0 + services / 50
    return cold + plan.settle_s + plan.relists * 130 + 3 * plan.changes * 12 + 120


def _in(ns: str, *args: str) -> list[str]:
    return ["ip", "netns", "exec", ns, sys.executable, "-m", "bench.controlplane", *args]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def _build(node_ns: str, backend_ns: str) -> None:
    """The two namespaces and the veth between them (see the module docstring)."""
    netns.create(node_ns)
    netns.create(backend_ns)
    veth = ["link", "add", "eth0", "type", "veth", "peer", "name", "eth0", "netns", backend_ns]
    _ip("-n", node_ns, *veth)
    _ip("-n", node_ns, "addr", "add", f"{NODE_IP}/24", "dev", "eth0")
    for ip in BACKENDS.values():
        _ip("-n", backend_ns, "addr", "add", f"{ip}/24", "dev", "eth0")
    for ns in (node_ns, backend_ns):
        _ip("-n", ns, "link", "set", "eth0", "up")
    _ip("-n", backend_ns, "route", "add", "local", SERVICE_CIDR, "dev", "lo")
    _ip("-n", node_ns, "route", "add", SERVICE_CIDR, "via", BACKENDS["backend-a"])


# --- without namespaces: laptop mode ----------------------------------------------------------


def _listening_count(pid: int) -> int:
    """Listening TCP sockets that ``pid`` holds: on a shared host's loopback, other programs
    open and close listeners of their own meanwhile, so a difference of totals would drift."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    except OSError:
        return 0
    count = 0
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                next(f)
                for line in f:
                    fields = line.split(None, 10)
                    if fields[3] == "0A" and fields[9] in inodes:
                        count += 1
        except OSError:
            continue
    return count


def measure(
    services: int,
    *,
    procs: ProcessGroup,
    cores: Cores,
    workdir: Path,
    loop: str,
    timeout_s: float,
) -> dict[str, float]:
    """Laptop mode (``--rules none``): spawn to N listeners on 127.0.0.1, and peak RSS."""
    kubeconfig = workdir / f"kubeconfig-{services}"
    ready = workdir / f"apiserver-{services}.ready"
    ready.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "bench.controlplane", "serve", "--services", str(services)]
    argv += ["--kubeconfig", str(kubeconfig), "--ready", str(ready), "--address", "127.0.0.1"]
    api = procs.start(argv, core=cores.load, name=f"apiserver-{services}")
    proxy = None
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            if api.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"API server double did not start: {procs.log_tail(api)}")
            time.sleep(0.05)
        t0 = time.monotonic()
        proxy = procs.start(
            [
                *(sys.executable, "-m", "uproxy.cli", "--kubeconfig", str(kubeconfig)),
                *("--hostname-override", NODE, "--rules", "none", "--bind-address", "127.0.0.1"),
                *("--healthz-bind-address", "", "--metrics-bind-address", ""),
                *("--event-loop", loop),
            ],
            core=cores.proxy,
            name=f"uproxy-sync-{services}",
        )
        deadline = t0 + timeout_s
        while True:
            if _listening_count(proxy.pid) >= services:
                synced = time.monotonic() - t0
                break
            if proxy.poll() is not None:
                raise RuntimeError(f"uproxy exited: {procs.log_tail(proxy)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"uproxy did not open {services} listeners in {timeout_s:.0f} s")
            time.sleep(0.05)
        return {"sync_s": synced, "rss_mb": peak_rss_bytes(proxy.pid) / (1 << 20)}
    finally:
        if proxy is not None:
            procs.stop(proxy, timeout_s=15)
        procs.stop(api)


def run(
    sizes: list[int],
    runs: int,
    *,
    procs: ProcessGroup,
    cores: Cores,
    workdir: Path,
    progress: Progress,
    planned_per_run_s: float,
    at_scale: ScalePlan | None = None,
) -> dict[str, Any]:
    """At scale with namespaces and rules when ``at_scale`` is given, else laptop mode."""
    if at_scale is not None:
        return run_at_scale(at_scale, procs=procs, cores=cores, workdir=workdir, progress=progress)
    out: dict[str, Any] = {"loop": "uvloop", "sizes": {}, "notes": []}
    for n in sizes:
        results = []
        for r in range(runs):
            try:
                res = measure(
                    n, procs=procs, cores=cores, workdir=workdir, loop="uvloop", timeout_s=120
                )
            except RuntimeError as e:
                out["notes"].append(f"{n} services: {e}")
                progress.say(f"control plane, {n} service ports: failed: {e}")
                break
            results.append(res)
            progress.advance(planned_per_run_s * n / max(sizes))
            progress.say(
                f"control plane, {n} service ports, run {r + 1}/{runs}: synced in "
                f"{res['sync_s']:.2f} s, peak RSS {res['rss_mb']:.0f} MiB"
            )
        out["sizes"][str(n)] = results
    return out


# --- the command line ---------------------------------------------------------------------------


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _backend_names(text: str) -> tuple[str, ...]:
    """``--backends``: only those whose portals ``cp_probes.PortalRules`` can count (another
    name would only time out, minutes later, waiting for portals it cannot see)."""
    names = tuple(name for name in text.split(",") if name)
    unknown = [name for name in names if name not in BACKENDS_UNDER_TEST]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"{','.join(unknown) or repr(text)}: choose from {', '.join(BACKENDS_UNDER_TEST)}"
        )
    return names


def _main_run(a: argparse.Namespace) -> int:
    """``run``: the at-scale figures on their own, with the table ``python -m bench`` shows."""
    from bench import cp_report

    if os.geteuid() != 0:
        print("bench.controlplane run: needs root (network namespaces, rules)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _terminate)
    plan = scale_plan(list(QUICK.sizes if a.quick else FULL.sizes), quick=a.quick)
    if a.sizes:
        plan = replace(plan, sizes=tuple(a.sizes))
    if a.backends:
        plan = replace(plan, backends=a.backends)
    for field in ("changes", "relists", "settle_s", "starts"):
        if getattr(a, field) is not None:
            plan = replace(plan, **{field: getattr(a, field)})
    progress = Progress(planned_s=planned_seconds(plan))
    workdir = Path(tempfile.mkdtemp(prefix="uproxy-bench-cp-"))
    procs = ProcessGroup(logdir=workdir)
    try:
        cp = run_at_scale(plan, procs=procs, cores=Cores.pick(), workdir=workdir, progress=progress)
    except KeyboardInterrupt:
        shutil.rmtree(workdir, ignore_errors=True)
        return 130
    finally:
        procs.stop_all()
    cp["elapsed_s"] = progress.elapsed()
    a.out.write_text(json.dumps({"control_plane": cp}, indent=1) + "\n")
    print(cp_report.markdown(cp))
    # The sessions' logs (uproxy's, the API double's) are what tells why one failed; a run
    # that went well leaves nothing behind (10,000 services' files and logs are megabytes).
    if cp.get("failed"):
        progress.say(f"wrote {a.out}; a session failed: child logs kept in {workdir}")
        return 1
    shutil.rmtree(workdir, ignore_errors=True)
    progress.say(f"wrote {a.out}")
    return 0


def _main_session(a: argparse.Namespace) -> int:
    from bench.cp_session import SessionPlan, run_session

    signal.signal(signal.SIGTERM, _terminate)
    scale = json.loads(a.plan)
    plan = SessionPlan(
        services=a.services,
        backend=a.backend,
        source=a.source,
        detail=a.detail,
        changes=scale["changes"],
        relists=scale["relists"],
        settle_s=scale["settle_s"],
        cold_timeout_s=180.0 + a.services / 50,
        starts=scale.get("starts", 1),
    )
    proxy_core, load_core = (int(c) for c in a.cores.split(","))
    done, planned, start = (float(x) for x in a.progress.split(","))
    progress = Progress(planned_s=planned, start_wall=start)
    progress.advance(done)
    try:
        result = run_session(
            plan,
            workdir=a.workdir,
            cores=Cores(proxy=proxy_core, load=load_core),
            services_file=a.services_file,
            progress=progress,
        )
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # the run goes on with the next session; the trace is on stderr
        traceback.print_exc()
        result = {"error": f"{type(e).__name__}: {e}"}
    a.out.write_text(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.controlplane")
    sub = p.add_subparsers(dest="mode", required=True)
    run_p = sub.add_parser("run", help="the at-scale figures alone (root)")
    run_p.add_argument("--quick", action="store_true")
    run_p.add_argument("--sizes", type=positive_ints, help="comma-separated service counts")
    run_p.add_argument(
        "--backends",
        type=_backend_names,
        help=f"comma-separated, of {', '.join(BACKENDS_UNDER_TEST)} (default: both)",
    )
    run_p.add_argument("--changes", type=int, help="endpoint changes and additions (20)")
    run_p.add_argument("--relists", type=int, help="forced relists (10)")
    run_p.add_argument("--settle", dest="settle_s", type=float, help="idle seconds (10)")
    run_p.add_argument("--starts", type=positive_int, help="cold starts per session, median (3)")
    run_p.add_argument("--out", type=Path, default=Path("controlplane.json"))
    serve_p = sub.add_parser("serve", help="the API double with N services (a child)")
    serve_p.add_argument("--services", type=int, required=True)
    serve_p.add_argument("--kubeconfig", type=Path, required=True)
    serve_p.add_argument("--ready", type=Path, required=True)
    serve_p.add_argument("--address", default="127.0.0.1", help="every service's endpoint")
    serve_p.add_argument("--node-ip", default="127.0.0.1", help="the Node's InternalIP")
    serve_p.add_argument("--control", type=Path, help="unix socket for writes during a run")
    session_p = sub.add_parser("session", help="one session in the node namespace (a child)")
    for flag, kind in (("--services", int), ("--workdir", Path), ("--out", Path)):
        session_p.add_argument(flag, type=kind, required=True)
    for flag in ("--backend", "--source", "--cores", "--plan", "--progress"):
        session_p.add_argument(flag, required=True)
    session_p.add_argument("--services-file", type=Path)
    session_p.add_argument("--detail", action="store_true")
    sub.add_parser("backend", help="backend-a and backend-b (a child, in their namespace)")
    scrape_p = sub.add_parser("scrape", help="GET /metrics every second (a child)")
    scrape_p.add_argument("--out", type=Path, required=True)
    scrape_p.add_argument("--count", type=int, default=900)
    a = p.parse_args(argv)
    return _dispatch(a)


def _dispatch(a: argparse.Namespace) -> int:
    if a.mode == "run":
        run_uproxy_as_shipped()
        return _main_run(a)
    if a.mode == "session":
        return _main_session(a)
    if a.mode == "serve":
        from bench.cp_cluster import serve

        asyncio.run(
            serve(
                a.services,
                kubeconfig=a.kubeconfig,
                ready=a.ready,
                address=a.address,
                node_ip=a.node_ip,
                control=a.control,
            )
        )
    elif a.mode == "backend":
        from bench.cp_probes import serve_names

        asyncio.run(serve_names([(ip, TARGET_PORT, name) for name, ip in BACKENDS.items()]))
    else:
        from bench.cp_probes import scrape_loop

        scrape_loop("127.0.0.1", 10249, interval_s=1.0, count=a.count, out=a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
