"""``bench.deployed``: its tools checked before anything is set up, and a report that says
only what was measured (one number of services has nothing to be compared with)."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest

from bench import deployed, deployed_report


def _data(scales: list[int], runs: dict[str, dict[str, list[Any]]], failed: bool) -> Any:
    peers = {
        "uproxy-nftables": {
            "label": "uproxy (nftables)",
            "uproxy": True,
            "skipped": None,
            "failed": {str(scales[0]): "wrk gave no result"} if failed else {},
        },
        "kernel-linear": {"label": "kernel DNAT", "uproxy": False, "skipped": None, "failed": {}},
    }
    return {
        "meta": {
            "scales": scales,
            "rounds": 1,
            "durations": "wrk 1 s",
            "paced_rate": 2000,
            "cores": {"proxy": 0, "load": 1},
            "reference": "kernel-linear",
        },
        "peers": peers,
        "runs": {p: {str(n): list(runs.get(p, {}).get(str(n), [])) for n in scales} for p in peers},
    }


def _setup(rate: float) -> dict[str, Any]:
    conn = {"rate": rate * 2, "p99_ms": 1.0, "cpu_us_per_conn": 30.0}
    return {
        "ready_s": 1.0,
        "conn": conn,
        "conn_paced": {**conn, "rate": rate, "offered_rate": 2000.0},
        "keepalive": {"p99_ms": 0.5},
        "round": 1,
    }


def test_with_nothing_measured_at_the_equal_rate_no_setup_is_said_to_sustain_it() -> None:
    text = "\n".join(deployed_report.markdown(_data([1], {}, failed=True)))
    assert "sustained it" not in text
    assert "no setup was measured at it" in text


def test_setups_that_sustained_the_equal_rate_are_said_to() -> None:
    runs = {"kernel-linear": {"1": [_setup(1990.0)]}}
    text = "\n".join(deployed_report.markdown(_data([1], runs, failed=False)))
    assert "every setup measured sustained it" in text


def test_one_number_of_services_is_not_compared_with_itself() -> None:
    runs = {"uproxy-nftables": {"1": [_setup(2000.0)]}, "kernel-linear": {"1": [_setup(2000.0)]}}
    lines = deployed_report.markdown(_data([1], runs, failed=False))
    assert not any(line.startswith("### 1 services against 1") for line in lines)
    goals = [line for line in lines if line.startswith("| uproxy-")]
    assert goals and len(goals) == len(set(goals))
    assert not any("itself at" in line for line in goals)


def test_two_numbers_of_services_keep_every_goal() -> None:
    runs = {"uproxy-nftables": {"1": [_setup(2000.0)], "1000": [_setup(2000.0)]}}
    lines = deployed_report.markdown(_data([1, 1000], runs, failed=False))
    assert "### 1,000 services against 1 (same peer)" in lines
    goals = [line for line in lines if line.startswith("| uproxy-")]
    assert len(goals) == len(deployed_report.GOALS)


def test_a_missing_tool_stops_the_run_before_any_setup(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def measure(*args: object, **kw: object) -> Any:
        raise AssertionError("the run started")

    monkeypatch.setattr(deployed, "run", measure)
    monkeypatch.setattr(deployed, "run_uproxy_as_shipped", lambda: None)
    monkeypatch.setattr(deployed, "missing_tools", lambda: ["wrk"], raising=False)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(os, "sched_setaffinity", lambda *a: None)
    monkeypatch.setattr(signal, "signal", lambda *a: None)
    monkeypatch.setattr(deployed, "delete_leftovers", lambda pid: None)
    assert deployed.main(["--quick"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "bench.deployed: missing tools: wrk (Debian packages: nginx-light, iperf3, wrk, util-linux)"
    ]
