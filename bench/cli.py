"""``python -m bench``: run every peer through every workload and write the results.

As root, each part of the run (one peer, the control-plane runs, the profile) happens in its
own fresh network namespace: every peer starts from the same kernel state (no TIME_WAIT
sockets or conntrack entries left by the previous peer, conntrack loaded only where the
kernel-DNAT rule needs it). The bench re-executes itself inside each namespace, which is
created here and removed on every exit path, Ctrl-C included. Without root everything runs on
the host's loopback and the kernel-DNAT peer is skipped with a note. ``--quick`` runs each
installed peer once, briefly, and still writes every output: CI uses it as a smoke test.
A full run measures the peers in rounds (``bench.dataplane``): each round starts every peer in
turn, each in a fresh namespace, so a slow stretch of the machine falls on all of them.
The peers come in two placements (``bench/peers.py``): pinned (the proxy on one core) and
equal cores (everything on both). As root, one more part per rules backend measures uproxy's
keep-alive latency while its control process does a big sync and repairs flushed rules
(``bench/disturb.py``), in its own namespace too. The control-plane part builds its own
namespaces instead (a node and a backend namespace per session, see
``bench/controlplane.py``), so it runs outside any namespace of this module's.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any

from bench import (
    controlplane,
    dataplane,
    deployed,
    deployed_report,
    disturb,
    netns,
    report,
    wakeup,
    workloads as wl,
)
from bench.backends import BackendPorts, missing_tools, start as start_backends
from bench.cmdline import positive_int
from bench.peers import Context, Peer, Uproxy, all_peers
from bench.procs import Cores, Placement, ProcessGroup, run_to_end, run_uproxy_as_shipped
from bench.progress import Progress

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
FULL = dataplane.Plan(
    rounds=3, durations=wl.Durations(tcp=3, http=3, udp=3), warmup=dataplane.WARMUP
)
QUICK = dataplane.Plan(rounds=1, durations=wl.Durations(tcp=1, http=1, udp=0.5))
FULL_SIZES = [1000, 5000, 10000]
QUICK_SIZES = [100, 500]
RULES_SYNC_SIZES = {False: "100,1000,10000", True: "100,1000"}
RULES_SYNC_PLANNED_S = {False: 40.0, True: 5.0}
PROFILE_S = 6


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="uproxy side by side with no proxy, kernel DNAT, HAProxy, nginx stream, "
        "socat and a bare splice(2) relay, pinned and at equal cores: throughput, connection "
        "rate, latency, UDP, CPU, RSS, latency during uproxy's control work and control-plane "
        "sync.",
    )
    p.add_argument("--quick", action="store_true", help="one brief run per peer (~5 minutes)")
    p.add_argument(
        "--out",
        type=Path,
        help=f"output directory (default: {DEFAULT_OUT}, or its quick/ subdirectory with --quick)",
    )
    p.add_argument(
        "--peers",
        help="comma-separated peer names to run (default: all); the name 'disturb' selects "
        "the keep-alive runs during uproxy's control work",
    )
    p.add_argument(
        "--runs",
        type=positive_int,
        help="rounds: measured runs per workload, each peer started afresh for each, the peers "
        "in turn (default: 3, quick: 1)",
    )
    p.add_argument("--no-control-plane", action="store_true", help="skip the sync-time runs")
    p.add_argument("--no-profile", action="store_true", help="skip the py-spy profile")
    p.add_argument("--no-rules-sync", action="store_true", help="skip python -m bench.rules_sync")
    p.add_argument(
        "--no-disturb",
        action="store_true",
        help="skip uproxy's keep-alive latency during a big sync and a rules repair (as root)",
    )
    p.add_argument(
        "--disturb-services",
        type=positive_int,
        help=f"services for that part (default: {disturb.FULL.services:,}; quick: "
        f"{disturb.QUICK.services:,})",
    )
    p.add_argument(
        "--no-deployed",
        action="store_true",
        help="skip the deployed path (pod -> ClusterIP -> node; python -m bench.deployed)",
    )
    p.add_argument("--keep-logs", action="store_true", help="keep the child processes' logs")
    p.add_argument("--no-netns", action="store_true", help="run on the host's loopback")
    p.add_argument(
        "--render",
        type=Path,
        metavar="RESULTS_JSON",
        help="only rewrite RESULTS.md and the plots from a results.json (into --out or its dir)",
    )
    # Internal: one part of the run, inside its namespace.
    p.add_argument("--inside", help=argparse.SUPPRESS)
    p.add_argument("--part", help=argparse.SUPPRESS)
    p.add_argument("--part-out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--progress", help=argparse.SUPPRESS)
    p.add_argument("--cores", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _plan(args: argparse.Namespace) -> dataplane.Plan:
    plan = QUICK if args.quick else FULL
    if args.runs:
        plan = dataclasses.replace(plan, rounds=args.runs)
    return plan


def _sizes(args: argparse.Namespace) -> list[int]:
    return [] if args.no_control_plane else (QUICK_SIZES if args.quick else FULL_SIZES)


def _cp_runs(args: argparse.Namespace) -> int:
    return 1 if args.quick else 3


def _cp_planned_run_s(args: argparse.Namespace) -> float:
    return 1.5 if args.quick else 5.0


def _cp_at_scale(args: argparse.Namespace) -> controlplane.ScalePlan | None:
    """As root: the control plane at scale, in namespaces it builds itself, with rules."""
    if os.geteuid() != 0 or args.no_netns:
        return None
    return controlplane.scale_plan(_sizes(args), quick=args.quick)


def _part_planned_s(args: argparse.Namespace, part: str) -> float:
    if part == "control-plane":
        at_scale = _cp_at_scale(args)
        if at_scale is not None:
            return controlplane.planned_seconds(at_scale)
        return _cp_planned_run_s(args) * _cp_runs(args) * len(_sizes(args)) + 1.0
    if part == "profile":
        return PROFILE_S + 4.0
    if part.startswith("disturb:"):
        return disturb.planned_seconds(_disturb_plan(args))
    return dataplane.round_seconds(_plan(args))


def _disturb_plan(args: argparse.Namespace) -> disturb.Plan:
    plan = disturb.QUICK if args.quick else disturb.FULL
    plan = dataclasses.replace(plan, connections=_plan(args).durations.ka_connections)
    if args.disturb_services:
        plan = dataclasses.replace(plan, services=args.disturb_services)
    if args.runs:  # a generation of filler services per big sync (``disturb.filler_ip``)
        plan = dataclasses.replace(plan, rounds=min(args.runs, disturb.MAX_GENERATION - 1))
    return plan


DISTURB = "disturb"  # the --peers name of the keep-alive runs during control work


def _wanted_peers(args: argparse.Namespace) -> set[str] | None:
    """The names ``--peers`` gives (None: every peer)."""
    if args.peers is None:
        return None
    return {name.strip() for name in args.peers.split(",") if name.strip()}


def _unknown_peers(args: argparse.Namespace) -> str | None:
    """What is wrong with ``--peers``, or None: an unknown name would otherwise be dropped
    without a word, and a list of nothing but unknown names would write an empty report."""
    wanted = _wanted_peers(args)
    if wanted is None:
        return None
    known = [p.name for p in all_peers()] + [DISTURB]
    unknown = sorted(wanted - set(known))
    if unknown:
        return f"unknown peers: {', '.join(unknown)} (choose from: {', '.join(known)})"
    if not wanted:
        return f"--peers names no peer (choose from: {', '.join(known)})"
    return None


def _out_dir(args: argparse.Namespace) -> Path:
    if args.render:
        return Path(args.out or args.render.parent)
    return Path(args.out or (DEFAULT_OUT / "quick" if args.quick else DEFAULT_OUT))


def _unwritable(out: Path) -> str | None:
    """Why the results cannot go into ``out``, or None; created here when missing, so a bad
    ``--out`` is known before anything is measured, not when the report is written."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"--out {out}: cannot create it: {e.strerror or e}"
    if not os.access(out, os.W_OK | os.X_OK):
        return f"--out {out}: not writable"
    return None


def main(argv: list[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    args = parse(args_list)
    if args.render:
        return render(args.render, _out_dir(args))
    if not args.part:
        problem = _unknown_peers(args) or _unwritable(_out_dir(args))
        if problem:
            print(f"bench: error: {problem}", file=sys.stderr)
            return 2
    missing = missing_tools()
    if missing:
        print(
            f"bench: error: missing tools: {', '.join(missing)} (Debian packages: nginx-light, "
            "iperf3, wrk, util-linux)",
            file=sys.stderr,
        )
        return 2
    run_uproxy_as_shipped()
    if args.part:
        return run_part(args)
    try:
        return run_all(args, args_list)
    except KeyboardInterrupt:
        return 130


def render(source: Path, out: Path) -> int:
    """Rebuild the summary, table and plots from raw runs (after changing what is reported)."""
    results, problem = _results_file(source)
    problem = problem or _unwritable(out)
    if problem:
        print(f"bench: error: {problem}", file=sys.stderr)
        return 2
    for entry in results["peers"].values():
        for runs in entry.get("runs", {}).values():
            for figures in runs:
                dataplane.derive_core_busy(figures)
    results["summary"] = report.summary_table(
        {p: e for p, e in results["peers"].items() if not e.get("skipped")}
    )
    if "runs" in results.get("deployed", {}):
        results["deployed"]["summary"] = deployed_report.summary(results["deployed"])
    for path in report.write(results, out):
        print(path)
    return 0


def _results_file(source: Path) -> tuple[dict[str, Any], str | None]:
    """A results.json's content, or why it is not one."""
    try:
        results = json.loads(source.read_text())
    except OSError as e:
        return {}, f"--render {source}: cannot read it: {e.strerror or e}"
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return {}, f"--render {source}: not JSON: {e}"
    if not isinstance(results, dict) or not isinstance(results.get("peers"), dict):
        return {}, f"--render {source}: not a results.json of python -m bench (no peers)"
    if not isinstance(results.get("meta"), dict):
        return {}, f"--render {source}: not a results.json of python -m bench (no meta)"
    return results, None


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def run_all(args: argparse.Namespace, args_list: list[str]) -> int:
    """The outer process: one part after another, then the report."""
    signal.signal(signal.SIGTERM, _terminate)
    use_netns = not args.no_netns and os.geteuid() == 0
    plan = _plan(args)
    out = _out_dir(args)
    cores = Cores.pick()
    peers = all_peers()
    wanted = _wanted_peers(args)
    if wanted is not None:
        peers = [p for p in peers if p.name in wanted]
    probe_ctx = Context(
        procs=ProcessGroup(logdir=Path(tempfile.gettempdir())),
        cores=cores,
        workdir=Path(tempfile.gettempdir()),
        backend=BackendPorts(),
        in_netns=use_netns,
    )
    uproxy_missing = Uproxy("uvloop").unavailable(probe_ctx)
    parts: list[str] = []
    results: dict[str, Any] = {
        "meta": {
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "quick": args.quick,
            "netns": use_netns,
            "cores": {"proxy": cores.proxy, "load": cores.load},
            "placements": {
                "pinned": Placement.pinned(cores).describe(),
                "shared": Placement.shared(cores).describe(),
            },
            "plan": {
                "rounds": plan.rounds,
                "warmup": (
                    f"iperf3 {plan.warmup.tcp} s, wrk {plan.warmup.http:g} s, UDP "
                    f"{plan.warmup.udp:g} s"
                    if plan.warmup
                    else None
                ),
                "durations": _durations_text(plan.durations),
            },
            "machine": report.machine(),
            "uproxy_revision": _revision(),
        },
        "peers": {},
    }
    active: list[str] = []
    for peer in peers:
        why = peer.unavailable(probe_ctx)
        placement = peer.placement(cores).name
        results["peers"][peer.name] = {
            "label": peer.label,
            "placement": placement,
            "skipped": why or "did not run",
            "notes": [],
        }
        if not why:
            active.append(peer.name)
    parts += _peer_parts(active, plan.rounds)
    parts += _disturb_parts(args, results, use_netns, uproxy_missing)
    if _sizes(args):
        if uproxy_missing:
            results["control_plane"] = {"sizes": {}, "notes": [f"skipped: {uproxy_missing}"]}
        else:
            parts.append("control-plane")
    if not (args.quick or args.no_profile or uproxy_missing):
        parts.append("profile")
    rules_sync = use_netns and not args.no_rules_sync and RULES_SYNC.exists()
    results["meta"]["load_average_start"] = _loadavg()
    results["meta"]["wakeup"] = wakeup.probe(cores.proxy, cores.load)
    planned = sum(_part_planned_s(args, p) for p in parts)
    planned += RULES_SYNC_PLANNED_S[args.quick] if rules_sync else 0.0
    run_deployed = os.geteuid() == 0 and not args.no_deployed
    deployed_plan = deployed.plan_for(quick=args.quick, rounds=args.runs)
    planned += deployed.planned_seconds(deployed_plan) if run_deployed else 0.0
    progress = Progress(planned_s=planned)
    if results["meta"]["load_average_start"][0] > BUSY_LOADAVG:
        progress.say(
            f"warning: the machine is busy (load average {results['meta']['load_average_start']}"
            "): figures will be noisy; rerun on a quiet machine to compare small differences"
        )
    for peer in peers:
        why = results["peers"][peer.name]["skipped"]
        if why != "did not run":
            progress.say(f"{peer.name}: skipped: {why}")
    failed = False
    with tempfile.TemporaryDirectory(prefix="uproxy-bench-parts-") as tmp:
        for i, part in enumerate(parts):
            part_out = Path(tmp) / f"part-{i}.json"
            child_args = [
                *args_list,
                "--part",
                part,
                "--part-out",
                str(part_out),
                "--progress",
                f"{progress.done_planned_s},{planned},{progress.start_wall}",
                "--cores",
                f"{cores.proxy},{cores.load}",
            ]
            # The control plane builds its own namespaces (one set per session).
            if use_netns and part != "control-plane":
                name = f"ubench-{os.getpid()}-{i}"
                rc = netns.run_inside(name, [*child_args, "--inside", name])
            else:
                rc = run_part(parse(child_args))
            if rc == 130:
                progress.say("interrupted")
                return 130
            progress.advance(_part_planned_s(args, part))
            try:
                data: dict[str, Any] = json.loads(part_out.read_text())
            except (OSError, json.JSONDecodeError):
                data = {"error": f"exited with {rc} before writing its results"}
            failed |= _merge(results, part, data, progress)
    if rules_sync:
        results["rules_sync"] = _rules_sync(args.quick, progress)
    if run_deployed:
        results["deployed"] = deployed.run_from_bench(
            quick=args.quick, rounds=args.runs, keep_logs=args.keep_logs, progress=progress
        )
        progress.advance(deployed.planned_seconds(deployed_plan))
        failed |= deployed_report.failed(results["deployed"])
    elif not args.no_deployed:
        results["deployed"] = {"skipped": "needs root (network namespaces, iptables, nft)"}
    results["meta"]["elapsed_s"] = progress.elapsed()
    results["meta"]["load_average_end"] = _loadavg()
    results["summary"] = report.summary_table(
        {p: e for p, e in results["peers"].items() if not e.get("skipped")}
    )
    paths = report.write(results, out)
    progress.say("wrote " + ", ".join(str(p) for p in paths))
    return 1 if failed else 0


BUSY_LOADAVG = 0.7


def _peer_parts(names: list[str], rounds: int) -> list[str]:
    """Every peer once a round, the order rotated between rounds (as the deployed part's), so
    no peer always runs first or right after the same one."""
    parts = []
    for round_no in range(1, rounds + 1):
        shift = (round_no - 1) % max(1, len(names))
        parts += [f"peer:{name}#{round_no}" for name in names[shift:] + names[:shift]]
    return parts


def _peer_part(part: str) -> tuple[str, int]:
    """``peer:NAME#ROUND`` -> (NAME, ROUND)."""
    name, _, round_no = part.removeprefix("peer:").partition("#")
    return name, int(round_no or 1)


def _disturb_parts(
    args: argparse.Namespace, results: dict[str, Any], use_netns: bool, uproxy_missing: str | None
) -> list[str]:
    """One part per rules backend; why there are none, in the results, when there are none."""
    wanted = _wanted_peers(args)
    if args.no_disturb or (wanted is not None and DISTURB not in wanted):
        return []
    plan = _disturb_plan(args)
    results["disturb"] = {"services": plan.services, "workers": disturb.WORKERS, "backends": {}}
    why = uproxy_missing
    if not use_netns:
        why = "needs root and network namespaces (real rules in a namespace of its own)"
    elif shutil.which("nft") is None or shutil.which("iptables-nft") is None:
        why = "needs nft and iptables-nft (Debian packages: nftables, iptables)"
    if why:
        results["disturb"]["skipped"] = why
        return []
    return [f"disturb:{variant}" for variant in disturb.VARIANTS]


def _revision() -> str:
    """The checkout measured, ``-dirty`` when it has uncommitted changes."""
    try:
        done = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=Path(__file__).resolve().parent.parent,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return "?"
    return done.stdout.strip() or "?"


def _loadavg() -> list[float]:
    """1, 5 and 15 minute load averages: a busy machine makes every figure noisy."""
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except (OSError, ValueError):
        return [0.0, 0.0, 0.0]


RULES_SYNC = Path(__file__).resolve().parent / "rules_sync.py"


def _rules_sync(quick: bool, progress: Progress) -> dict[str, Any]:
    """The rules backends' sync time: ``python -m bench.rules_sync``, its table kept as is."""
    progress.say("rules sync: python -m bench.rules_sync")
    try:
        # Stopped, when interrupted, with time to delete the namespace it made.
        done = run_to_end(
            [sys.executable, "-m", "bench.rules_sync", "--sizes", RULES_SYNC_SIZES[quick]],
            timeout_s=600,
            grace_s=20,
        )
    except subprocess.TimeoutExpired:
        return {"error": "timed out after 600 s"}
    progress.advance(RULES_SYNC_PLANNED_S[quick])
    if done.returncode != 0:
        progress.say(f"rules sync: failed: {done.stderr.strip()[-300:]}")
        return {"error": done.stderr.strip()[-300:]}
    progress.say("rules sync: done")
    return {"sizes": RULES_SYNC_SIZES[quick], "markdown": done.stdout.strip()}


def _merge(results: dict[str, Any], part: str, data: dict[str, Any], progress: Progress) -> bool:
    """Fold one part's output into the results; True when the part failed."""
    error = data.get("error")
    if part.startswith("peer:"):
        name, round_no = _peer_part(part)
        before = results["peers"][name]
        if error:
            before.setdefault("notes", []).append(f"round {round_no}: failed: {error}")
            if "runs" not in before:
                before["skipped"] = f"failed: {error}"
            progress.say(f"{name}: FAILED in round {round_no}: {error}")
            return True
        # A workload that failed (its note says so) fails the run; the others' figures stand.
        failures = data["entry"].pop("failed", [])
        results["peers"][name] = dataplane.merge_round(before, data["entry"])
        return bool(failures)
    if part.startswith("disturb:"):
        rules = part.removeprefix("disturb:")
        entry = data.get("disturb") or {"error": error or "no result"}
        if error:
            entry["error"] = error
            progress.say(f"disturb {rules}: FAILED: {error}")
        results["disturb"]["backends"][rules] = entry
        return bool(error)
    if part == "control-plane":
        results["control_plane"] = data.get("control_plane") or {
            "sizes": {},
            "notes": [f"failed: {error}"],
        }
        return bool(error) or bool(results["control_plane"].get("failed"))
    results["profile"] = data.get("profile")
    return False


def run_part(args: argparse.Namespace) -> int:
    """One part of the run, in this process (inside its namespace when there is one)."""
    signal.signal(signal.SIGTERM, _terminate)
    proxy_core, load_core = (int(c) for c in args.cores.split(","))
    cores = Cores(proxy=proxy_core, load=load_core)
    part: str = args.part
    placement = _placement(part, cores)
    # The orchestrator's own polling belongs with the load, off a pinned proxy's core (restored
    # afterwards: without a namespace the parts run in the outer process).
    affinity = os.sched_getaffinity(0)
    load = placement.load
    os.sched_setaffinity(0, {load} if isinstance(load, int) else set(load))
    done, planned, start = (float(x) for x in args.progress.split(","))
    progress = Progress(planned_s=planned, start_wall=start)
    progress.advance(done)
    workdir = Path(tempfile.mkdtemp(prefix="uproxy-bench-"))
    procs = ProcessGroup(logdir=workdir)
    ctx = Context(
        procs=procs,
        cores=cores,
        workdir=workdir,
        backend=BackendPorts(),
        in_netns=args.inside is not None,
        placement=placement,
    )
    result: dict[str, Any] = {}
    try:
        if part == "control-plane":
            result["control_plane"] = controlplane.run(
                _sizes(args),
                _cp_runs(args),
                procs=procs,
                cores=cores,
                workdir=workdir,
                progress=progress,
                planned_per_run_s=_cp_planned_run_s(args),
                at_scale=_cp_at_scale(args),
            )
        else:
            result.update(_run_with_backends(args, ctx, progress))
    except KeyboardInterrupt:
        progress.say("interrupted: stopping every process")
        return 130
    except (RuntimeError, OSError) as e:
        result["error"] = str(e)
    finally:
        procs.stop_all()
        os.sched_setaffinity(0, affinity)
        if args.keep_logs or "error" in result:
            progress.say(f"{part}: child logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    args.part_out.write_text(json.dumps(result))
    return 0


def _placement(part: str, cores: Cores) -> Placement:
    if part.startswith("peer:"):
        return _peer(_peer_part(part)[0]).placement(cores)
    if part.startswith("disturb:"):
        return Placement.shared(cores)
    return Placement.pinned(cores)


def _run_with_backends(
    args: argparse.Namespace, ctx: Context, progress: Progress
) -> dict[str, Any]:
    """A part that needs the backends: one peer, the disturbance part or the profile."""
    plan = _plan(args)
    backends = start_backends(ctx.procs, ctx.where, ctx.workdir, ctx.backend)
    scripts = wl.write_scripts(ctx.workdir, plan.durations)
    part: str = args.part
    if part == "profile":
        from bench.profiling import profile_conn_rate

        out: Path = args.out or DEFAULT_OUT
        out.mkdir(parents=True, exist_ok=True)
        return {
            "profile": profile_conn_rate(
                ctx, backends, scripts, out_dir=out, seconds=PROFILE_S, progress=progress
            )
        }
    where = "fresh namespace" if args.inside else "host loopback"
    if part.startswith("disturb:"):
        rules = part.removeprefix("disturb:")
        progress.say(f"disturb {rules}: {where}, backends up, {ctx.where.describe()}")
        entry = disturb.run(rules, ctx, backends, _disturb_plan(args), scripts, progress)
        return {"disturb": entry}
    name, round_no = _peer_part(part)
    peer = _peer(name)
    index = [p.name for p in all_peers()].index(name)
    progress.say(f"{name}, round {round_no}: {where}, backends up, {ctx.where.describe()}")
    # The machine's wake-ups just before this round of the peer's: an idle CPU's wake-up time
    # moves on a virtual machine (39 us at the start of one run, 298 us twenty minutes
    # later); latency and 2-CPU figures move with it.
    woke = None if args.quick else wakeup.probe(ctx.cores.proxy, ctx.cores.load)
    entry = dataplane.run_peer(index, peer, ctx, backends, plan, scripts, progress, round_no)
    if woke is not None:
        entry["wakeup"] = woke
    return {"entry": entry}


def _peer(name: str) -> Peer:
    for p in all_peers():
        if p.name == name:
            return p
    raise RuntimeError(f"unknown peer {name!r}")


def _durations_text(d: wl.Durations) -> str:
    return (
        f"iperf3 {d.tcp} s, wrk {d.http:g} s ({d.conn_connections} connections with "
        f"Connection: close; {d.ka_connections} keep-alive connections paced at "
        f"{d.ka_delay_ms} ms between requests), UDP {d.udp:g} s (16 sockets)"
    )
