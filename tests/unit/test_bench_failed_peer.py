"""A peer whose proxy dies, or whose workload fails, is a failed peer, not a set of figures.

``python -m bench`` exits non-zero when a peer failed (CI reads it as the smoke test's
verdict), and RESULTS.md must not show what a load generator read after the proxy was gone
(no CPU below zero, no 0 req/s, no 0 MiB) as a measurement.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import cli, dataplane, proctree, workloads as wl
from bench.backends import BackendPorts
from bench.peers import Context, Peer, PeerPorts, Running
from bench.procs import Cores, ProcessGroup
from bench.progress import Progress

PLAN = dataplane.Plan(rounds=1, durations=wl.Durations(tcp=1, http=1, udp=1))


def _ctx(tmp_path: Path) -> Context:
    return Context(
        procs=ProcessGroup(logdir=tmp_path),
        cores=Cores(proxy=0, load=0),
        workdir=tmp_path,
        backend=BackendPorts(),
        in_netns=False,
    )


def _proc(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code])


def _workload(run: Any) -> dataplane.Workload:
    return dataplane.Workload("conn", "wrk, Connection: close", False, lambda d: d.http, run)


def _round(peer: Peer, running: Running, ctx: Context, w: dataplane.Workload) -> Any:
    entry: dict[str, Any] = {"runs": {}, "notes": []}
    alive = dataplane._alive_check(peer, running, ctx)
    runs = dataplane._round(peer, w, running, PLAN, {}, 0, Progress(planned_s=1.0), entry, 1, alive)
    return runs, entry


class _Peer(Peer):
    name = "fake"


def test_a_proxy_that_exited_during_a_run_fails_the_round(tmp_path: Path) -> None:
    proxy = _proc("pass")
    proxy.wait()
    running = Running(ports=PeerPorts(1, 2, 3), procs=[proxy])
    figures = {"rate": 0.0, "requests": 0.0, "p50_ms": 0.0, "p99_ms": 0.0}
    with pytest.raises(dataplane.ProxyExited, match="fake exited with 0 during wrk"):
        _round(_Peer(), running, _ctx(tmp_path), _workload(lambda *a: dict(figures)))


def test_a_proxy_that_exited_is_the_failure_even_when_the_load_generator_failed_first(
    tmp_path: Path,
) -> None:
    proxy = _proc("import sys; sys.exit(3)")
    proxy.wait()
    running = Running(ports=PeerPorts(1, 2, 3), procs=[proxy])

    def refused(*args: Any) -> wl.Figures:
        raise wl.WorkloadError("wrk gave no result")

    with pytest.raises(dataplane.ProxyExited, match="exited with 3"):
        _round(_Peer(), running, _ctx(tmp_path), _workload(refused))


def test_a_failed_workload_with_the_proxy_alive_is_noted_and_marked_failed(
    tmp_path: Path,
) -> None:
    proxy = _proc("import time; time.sleep(30)")
    try:
        running = Running(ports=PeerPorts(1, 2, 3), procs=[proxy])

        def refused(*args: Any) -> wl.Figures:
            raise wl.WorkloadError("wrk gave no result")

        runs, entry = _round(_Peer(), running, _ctx(tmp_path), _workload(refused))
    finally:
        proxy.kill()
        proxy.wait()
    assert runs == []
    assert entry["failed"] == ["conn, round 1: failed: wrk gave no result"]
    assert entry["notes"] == entry["failed"]


def _sample(root: int, procs: dict[int, proctree.ProcCpu]) -> proctree.Sample:
    return proctree.Sample(root, procs, {}, 0)


def _proc_cpu(pid: int, ppid: int, ticks: int) -> proctree.ProcCpu:
    return proctree.ProcCpu(pid, ppid, 1, ticks, 0, 0, 0, 1)


def test_a_tree_that_vanished_is_left_out_not_counted_negative() -> None:
    before = [_sample(10, {10: _proc_cpu(10, 1, 500), 11: _proc_cpu(11, 10, 900)})]
    after = [_sample(10, {})]
    cpu = proctree.between(before, after)
    assert cpu.vanished == [10]
    assert cpu.total_s == 0.0


def test_a_live_tree_still_counts() -> None:
    before = [_sample(10, {10: _proc_cpu(10, 1, 500)})]
    after = [_sample(10, {10: _proc_cpu(10, 1, 500 + proctree.CLK_TCK)})]
    cpu = proctree.between(before, after)
    assert cpu.vanished == []
    assert cpu.total_s == pytest.approx(1.0)


def _results() -> dict[str, Any]:
    return {"peers": {"p": {"label": "p", "skipped": "did not run", "notes": []}}}


def test_a_round_with_a_failed_workload_fails_the_run_and_keeps_the_others() -> None:
    results = _results()
    entry = {
        "label": "p",
        "runs": {"tcp1": [{"gbps": 1.0}], "udp": []},
        "notes": ["udp, round 1: failed: no UDP reply"],
        "failed": ["udp, round 1: failed: no UDP reply"],
    }
    failed = cli._merge(results, "peer:p#1", {"entry": entry}, Progress(planned_s=1.0))
    assert failed
    merged = results["peers"]["p"]
    assert "failed" not in merged and "skipped" not in merged
    assert merged["runs"]["tcp1"] == [{"gbps": 1.0}]
    assert merged["notes"] == ["udp, round 1: failed: no UDP reply"]


def test_a_round_whose_proxy_exited_is_a_failed_peer() -> None:
    results = _results()
    data = {"error": "uproxy-uvloop exited with -9 during iperf3, 1 stream, round 1/1"}
    assert cli._merge(results, "peer:p#1", data, Progress(planned_s=1.0))
    assert results["peers"]["p"]["skipped"].startswith("failed: uproxy-uvloop exited")


def test_a_clean_round_does_not_fail_the_run() -> None:
    results = _results()
    entry = {"label": "p", "runs": {"tcp1": [{"gbps": 1.0}]}, "notes": []}
    assert not cli._merge(results, "peer:p#1", {"entry": entry}, Progress(planned_s=1.0))


def test_udp_load_with_no_reply_at_all_is_a_failed_workload(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = '{"replies": 0, "seconds": 1.0, "rate": 0.0, "lost": 32, "bad": 48, "p50_us": 0, "p99_us": 0}'

    def run_pinned(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(argv, 0, out, "")

    monkeypatch.setattr(wl, "run_pinned", run_pinned)
    with pytest.raises(wl.WorkloadError, match="no UDP reply"):
        wl.udp(1, seconds=1.0, core=0)
