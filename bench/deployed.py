"""The deployed path: a pod connects to a ClusterIP, the node steers it, a backend answers.

The rest of bench/ reaches uproxy on its proxy port with ``--rules none``; a node never runs
that way. Here uproxy runs as a node runs it (``--services FILE --rules BACKEND``: portal rules
in nat PREROUTING, the rules check every second, /metrics), between a pod namespace and a
backend namespace (``bench.topology``), beside the kernel-DNAT layouts kube-proxy installs
(``bench.deployed_peers``), at 1 service and at 10,000 with the measured service last in rule
order.

Method: in each round, for each number of services, for each peer (rotated between rounds), a
fresh topology is made (no TIME_WAIT sockets or conntrack entries from the previous peer), the
backends start in it, the peer is set up in the node namespace and waited for by bounded
polling (a request through the ClusterIP answers; for uproxy also /metrics'
``kubeproxy_sync_proxy_rules_last_timestamp_seconds`` > 0), a 1 MiB blob is fetched through
the ClusterIP and compared by sha256, and then:

- new connections (wrk, ``Connection: close``): rate, p99, proxy CPU per connection split in
  user and system time (its process tree, reaped rules-check children included), and the whole
  machine's CPU per connection (``/proc/stat``), which is what a kernel peer's cost shows in;
- new connections again at a fixed offered rate (``Durations.paced_rate``, the paced wrk of
  ``bench.workloads``), the same figures and the achieved rate: the proxy's CPU per connection
  grows as the rate falls (each wake-up handles fewer connections), so the closed-loop figure
  of a peer that the kernel slows down (a 10,000-rule chain) mixes the rate in; the equal-rate
  figure is the one the CPU-per-connection goals are read from;
- keep-alive latency at a paced moderate rate (the paced wrk of ``bench.workloads``);
- TCP 1 stream (iperf3) at the smallest number of services;
- for uproxy at the largest number of services, the keep-alive run again while /metrics is
  scraped every second (``bench.scrape`` in the node namespace).

Peers are interleaved (rounds) so that drift on the machine hits every peer alike; a peer whose
path fails the byte check is reported as failed, not measured. Every load run is bounded in
time, every child stopped by its process group, every namespace deleted on every exit path
(Ctrl-C and SIGTERM included; after a SIGKILL, ``python -m bench`` deletes what its child
left). This module is the run (plans, rounds, entry points); ``bench.deployed_setup`` is one
setup, ``bench.deployed_report`` the table.

    sudo python -m bench.deployed [--quick] [--scales 1,10000] [--rounds 3] [--peers a,b]
                                  [--json FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import Any

from bench import deployed_report, wakeup, workloads as wl
from bench.backends import missing_tools
from bench.cmdline import positive_int, positive_ints
from bench.deployed_peers import REFERENCE, NodePeer, all_peers
from bench.deployed_setup import PREFIX, WARMUP_S, PeerSkipped, Plan, Run, run_setup
from bench.procs import Cores, run_uproxy_as_shipped
from bench.progress import Progress

FULL = Plan(scales=(1, 10000), rounds=3, warmup=True, durations=wl.Durations(3, 3, 0))
QUICK = Plan(scales=(1, 1000), rounds=1, warmup=False, durations=wl.Durations(1, 1, 0))
# Planning only (the progress line's estimate).
SETUP_S = 1.5
UPROXY_READY_S_PER_SERVICE = 0.001
STEP_OVERHEAD_S = 0.3


def planned_seconds(plan: Plan, peers: list[NodePeer] | None = None) -> float:
    """What the part should take (for the progress line), every peer by default."""
    total = 0.0
    for scale in plan.scales:
        for peer in all_peers() if peers is None else peers:
            if _measured_at(plan, peer, scale):
                total += _planned_setup_s(plan, peer, scale)
    return total * plan.rounds


def _measured_at(plan: Plan, peer: NodePeer, scale: int) -> bool:
    return not peer.smallest_scale_only or scale == min(plan.scales)


def _planned_setup_s(plan: Plan, peer: NodePeer, scale: int) -> float:
    d = plan.durations
    runs = 3 + (1 if plan.warmup else 0)
    seconds = SETUP_S + runs * (d.http + STEP_OVERHEAD_S)
    if scale == min(plan.scales):
        seconds += d.tcp + STEP_OVERHEAD_S
    if peer.is_uproxy:
        seconds += scale * UPROXY_READY_S_PER_SERVICE
        if scale == max(plan.scales):
            seconds += d.http + plan.long_keepalive_s + 2 * STEP_OVERHEAD_S
    return seconds


def run(
    plan: Plan, peers: list[NodePeer], *, cores: Cores, progress: Progress, keep_logs: bool
) -> dict[str, Any]:
    """Every round, scale and peer; the part's raw JSON (with its summary)."""
    data: dict[str, Any] = {
        "meta": {
            "scales": list(plan.scales),
            "rounds": plan.rounds,
            "warmup": plan.warmup,
            "durations": durations_text(plan),
            "paced_rate": plan.durations.paced_rate,
            "long_keepalive_s": plan.long_keepalive_s,
            "cores": {"proxy": cores.proxy, "load": cores.load},
            "reference": REFERENCE,
            "wakeup": wakeup.probe(cores.proxy, cores.load),
        },
        "peers": {},
        "runs": {},
    }
    active: list[NodePeer] = []
    for peer in peers:
        why = peer.unavailable()
        data["peers"][peer.name] = {
            "label": peer.label,
            "uproxy": peer.is_uproxy,
            "skipped": why,
            "failed": {},
        }
        data["runs"][peer.name] = {str(n): [] for n in plan.scales}
        if why:
            progress.say(f"deployed: {peer.name}: skipped: {why}")
        else:
            active.append(peer)
    workdir = Path(tempfile.mkdtemp(prefix="uproxy-bench-deployed-"))
    keep = False
    start = time.monotonic()
    try:
        r = Run(plan, cores, workdir, wl.write_scripts(workdir, plan.durations), progress)
        for round_no in range(plan.rounds):
            shift = round_no % max(1, len(active))
            order = active[shift:] + active[:shift]
            for scale in plan.scales:
                for peer in order:
                    if _measured_at(plan, peer, scale):
                        keep |= _one(r, data, peer, scale, round_no)
    finally:
        data["meta"]["elapsed_s"] = time.monotonic() - start
        if keep or keep_logs:
            progress.say(f"deployed: child logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    data["summary"] = deployed_report.summary(data)
    return data


def _one(r: Run, data: dict[str, Any], peer: NodePeer, scale: int, round_no: int) -> bool:
    """One setup of one peer; True when it failed (its logs are worth keeping)."""
    entry = data["peers"][peer.name]
    planned = _planned_setup_s(r.plan, peer, scale)
    where = f"deployed: {peer.name} @ {scale:,} service(s), round {round_no + 1}/{r.plan.rounds}"
    if entry["skipped"] or str(scale) in entry["failed"]:
        r.progress.advance(planned)
        return False
    failed = False
    try:
        result = run_setup(r, peer, scale)
    except PeerSkipped as e:
        entry["skipped"] = str(e)
        r.progress.say(f"{where}: skipped: {e}")
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        entry["failed"][str(scale)] = str(e)
        r.progress.say(f"{where}: FAILED: {e}")
        failed = True
    else:
        result["round"] = round_no + 1
        data["runs"][peer.name][str(scale)].append(result)
        r.progress.say(f"{where}: {headline(result)}")
    r.progress.advance(planned)
    return failed


def headline(result: dict[str, Any]) -> str:
    c, k = result["conn"], result["keepalive"]
    text = f"ready {result['ready_s']:.1f} s; {c['rate']:,.0f} conn/s, p99 {c['p99_ms']:.2f} ms"
    if "cpu_us_per_conn" in c:
        text += (
            f", proxy {c['cpu_us_per_conn']:.0f} µs/conn ({c['user_us_per_conn']:.0f} user + "
            f"{c['kernel_us_per_conn']:.0f} sys)"
        )
    text += f", all CPUs {c.get('machine_us_per_conn', 0):.0f} µs/conn"
    p = result.get("conn_paced")
    if p:
        text += f"; at {p['offered_rate']:,.0f} conn/s offered: {p['rate']:,.0f} conn/s"
        if "cpu_us_per_conn" in p:
            text += f", proxy {p['cpu_us_per_conn']:.0f} µs/conn"
        text += f", all CPUs {p.get('machine_us_per_conn', 0):.0f} µs/conn"
    text += f"; keep-alive p99 {k['p99_ms']:.2f} ms"
    if "runq_ms_per_s" in k:
        text += f" (relaying processes waited for a CPU {k['runq_ms_per_s']:.0f} ms/s)"
    if "tcp1" in result:
        text += f"; 1 stream {result['tcp1']['gbps']:.2f} Gb/s"
    if "ka_scrape" in result:
        sc = result["scrape"]
        text += (
            f"; scraped: keep-alive p99 {result['ka_scrape']['p99_ms']:.2f} ms "
            f"({sc.get('ok', 0)}/{sc.get('count', 0)} scrapes, "
            f"median {sc.get('median_s', 0):.2f} s)"
        )
    if "ka_long" in result:
        kl = result["ka_long"]
        text += (
            f"; long keep-alive run: p99 {kl['p99_ms']:.2f} ms, p99.9 {kl['p999_ms']:.2f} ms, "
            f"child commands {kl.get('children_cpu_pct', 0):.1f}% of a core"
        )
    errors = c.get("errors", 0) + k.get("errors", 0) + (p or {}).get("errors", 0)
    if errors:
        text += f"; wrk errors {errors:.0f}"
    return text


def durations_text(plan: Plan) -> str:
    d = plan.durations
    warm = f"a {WARMUP_S:g} s warm-up, " if plan.warmup else ""
    return (
        f"{warm}wrk {d.http:g} s ({d.conn_connections} connections with Connection: close as "
        f"fast as they go; the same paced at {d.paced_rate:,} conn/s offered over "
        f"{d.paced_connections} connections; {d.ka_connections} keep-alive connections paced "
        f"at {d.ka_delay_ms} ms), iperf3 {d.tcp} s"
    )


# --- entry points ---------------------------------------------------------------------------


def leftovers(pid: int) -> list[str]:
    """Namespaces a run with this pid made and did not delete (after a SIGKILL)."""
    out = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, timeout=10, check=False
    ).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if n.startswith(f"{PREFIX}{pid}-")]


def delete_leftovers(pid: int) -> None:
    from bench import netns

    for name in leftovers(pid):
        netns.delete(name)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.deployed",
        description="uproxy on the deployed path (pod -> ClusterIP -> node -> backend) beside "
        "kernel DNAT (linear chain, nft map), at 1 and 10,000 services. Needs root.",
    )
    p.add_argument("--quick", action="store_true", help="1 and 1,000 services, one round, 1 s")
    p.add_argument(
        "--scales",
        type=positive_ints,
        help="comma-separated numbers of services (default: 1,10000)",
    )
    p.add_argument(
        "--rounds", type=positive_int, help="setups per peer and scale (default: 3, quick: 1)"
    )
    p.add_argument("--peers", help="comma-separated peer names (default: all)")
    p.add_argument(
        "--long-keepalive",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="also a keep-alive run this long for uproxy at the largest scale (35 covers one "
        "periodic full rules sync)",
    )
    p.add_argument("--json", type=Path, help="write the raw runs and summary here")
    p.add_argument("--keep-logs", action="store_true", help="keep the child processes' logs")
    p.add_argument("--list", action="store_true", help="list the peers and exit")
    p.add_argument("--progress", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def plan_for(
    *,
    quick: bool,
    scales: list[int] | None = None,
    rounds: int | None = None,
    long_keepalive_s: float = 0.0,
) -> Plan:
    plan = QUICK if quick else FULL
    if scales:
        plan = dataclasses.replace(plan, scales=tuple(sorted(set(scales))))
    if rounds:
        plan = dataclasses.replace(plan, rounds=rounds)
    return dataclasses.replace(plan, long_keepalive_s=long_keepalive_s)


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse(list(sys.argv[1:] if argv is None else argv))
    peers = all_peers()
    if args.list:
        for peer in peers:
            print(f"{peer.name}: {peer.label}")
        return 0
    if args.peers:
        wanted = set(args.peers.split(","))
        unknown = wanted - {p.name for p in peers}
        if unknown:
            print(
                f"bench.deployed: unknown peers: {', '.join(sorted(unknown))} (see --list)",
                file=sys.stderr,
            )
            return 2
        peers = [p for p in peers if p.name in wanted]
    if os.geteuid() != 0:
        print("bench.deployed: needs root (network namespaces, iptables)", file=sys.stderr)
        return 2
    # Checked here, not by each setup: without wrk every peer would fail, one after another.
    missing = missing_tools()
    if missing:
        print(
            f"bench.deployed: missing tools: {', '.join(missing)} (Debian packages: "
            "nginx-light, iperf3, wrk, util-linux)",
            file=sys.stderr,
        )
        return 2
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGHUP, _terminate)
    run_uproxy_as_shipped()
    plan = plan_for(
        quick=args.quick,
        scales=args.scales,
        rounds=args.rounds,
        long_keepalive_s=args.long_keepalive,
    )
    cores = Cores.pick()
    os.sched_setaffinity(0, {cores.load})
    if args.progress:
        done, planned, start = (float(x) for x in args.progress.split(","))
        progress = Progress(planned_s=planned, start_wall=start)
        progress.advance(done)
    else:
        progress = Progress(planned_s=planned_seconds(plan, peers))
    try:
        data = run(plan, peers, cores=cores, progress=progress, keep_logs=args.keep_logs)
    except KeyboardInterrupt:
        progress.say("deployed: interrupted; every namespace deleted")
        return 130
    finally:
        delete_leftovers(os.getpid())
    if args.json:
        args.json.write_text(json.dumps(data, indent=1) + "\n")
    if not args.progress:
        print("\n".join(deployed_report.markdown(data)))
    return 1 if deployed_report.failed(data) else 0


def run_from_bench(*, quick: bool, rounds: int | None, keep_logs: bool, progress: Progress) -> Any:
    """``python -m bench`` runs the part as a child (its own process, its own namespaces)."""
    with tempfile.TemporaryDirectory(prefix="uproxy-bench-deployed-json-") as tmp:
        out = Path(tmp) / "deployed.json"
        argv = [sys.executable, "-m", "bench.deployed", "--json", str(out)]
        argv += [
            "--progress",
            f"{progress.done_planned_s},{progress.planned_s},{progress.start_wall}",
        ]
        argv += ["--quick"] if quick else []
        argv += ["--rounds", str(rounds)] if rounds else []
        argv += ["--keep-logs"] if keep_logs else []
        bound_s = 3 * planned_seconds(plan_for(quick=quick, rounds=rounds)) + 600
        child = subprocess.Popen(argv)
        try:
            rc = child.wait(timeout=bound_s)
        except KeyboardInterrupt:
            _stop_child(child)
            raise
        except subprocess.TimeoutExpired:
            _stop_child(child, first=signal.SIGTERM)
            return {"error": f"did not finish in {bound_s:.0f} s"}
        finally:
            delete_leftovers(child.pid)
        if rc == 130:
            raise KeyboardInterrupt
        try:
            return json.loads(out.read_text())
        except (OSError, json.JSONDecodeError):
            return {"error": f"exited with {rc} before writing its results"}


def _stop_child(child: subprocess.Popen[bytes], first: signal.Signals | None = None) -> None:
    """From a terminal the child got the same SIGINT and is cleaning up: give it time."""
    for sig, wait_s in ((first, 5.0), (signal.SIGTERM, 30.0), (signal.SIGKILL, 5.0)):
        if sig is not None:
            child.send_signal(sig)
        try:
            child.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


if __name__ == "__main__":
    sys.exit(main())
