"""The data plane's goals, read from a run: uproxy's figure over a reference peer's, with the
ratio each goal asks for. Reported beside the figures, never asserted: speed is read from the
bench on a quiet machine, not tested.

Each goal names the peers it compares, so it is read at the placement it is about: the
connection rate at equal cores (``uproxy --workers 2`` and HAProxy ``nbthread 2``, both free
to use both CPUs), the cost per connection and per byte pinned (one core each, as before).
The rows after the goals are read beside them, for context, with no target; among them,
the TCP 1-stream figure of a bare splice(2) relay (``bench.splice_relay``): what a relay in
user space gets here at all, two TCP connections where kernel DNAT has one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bench.metrics import BY_KEY


@dataclass(frozen=True, slots=True)
class Goal:
    text: str
    peer: str
    metric: str
    reference: str | None  # None: ``threshold`` is an absolute value in the metric's unit
    threshold: float | None  # None: read for context, no target
    at_least: bool = True

    def target(self) -> str:
        if self.threshold is None:
            return "-"
        sign = "≥" if self.at_least else "≤"
        unit = "x" if self.reference else f" {BY_KEY[self.metric].unit}"
        return f"{sign} {self.threshold:g}{unit}"


GOALS = [
    Goal("New connections/s, 2 CPUs", "uproxy-w2-2cpu", "conn_rate", "haproxy-2cpu", 1.0),
    Goal(
        "Proxy CPU per connection, pinned",
        "uproxy-uvloop",
        "cpu_us_per_conn",
        "haproxy",
        1.2,
        False,
    ),
    Goal("Keep-alive p99, pinned", "uproxy-uvloop", "ka_p99", "haproxy", 1.5, False),
    Goal("TCP 1 stream, pinned", "uproxy-uvloop", "tcp1_gbps", "kernel-dnat", 0.95),
    Goal("Proxy CPU per GB, 1 stream, pinned", "uproxy-uvloop", "cpu_s_per_gb", None, 0.2, False),
]
CONTEXT = [
    # The least a relay in user space pays here (bench/splice_relay.py): how much of the gap
    # to kernel DNAT is the second TCP connection rather than uproxy.
    Goal("TCP 1 stream, pinned", "splice-relay", "tcp1_gbps", "kernel-dnat", None),
    Goal("TCP 1 stream, pinned", "uproxy-uvloop", "tcp1_gbps", "splice-relay", None),
    Goal("New connections/s, 2 CPUs", "uproxy-w1-2cpu", "conn_rate", "haproxy-2cpu", None),
    Goal("New connections/s, 2 CPUs", "uproxy-w2-2cpu", "conn_rate", "kernel-dnat-2cpu", None),
    Goal("New connections/s, 2 CPUs", "nginx-stream-2cpu", "conn_rate", "haproxy-2cpu", None),
    Goal(
        "Proxy CPU per connection, 2 CPUs",
        "uproxy-w2-2cpu",
        "cpu_us_per_conn",
        "haproxy-2cpu",
        None,
    ),
    Goal("Keep-alive p99, 2 CPUs", "uproxy-w2-2cpu", "ka_p99", "haproxy-2cpu", None),
    # One thread free to use both CPUs: at 2 CPUs the keep-alive figures follow where the
    # proxy's threads wake (bench/README.md), and nbthread 1 is the reference for one worker.
    Goal("Keep-alive p99, 2 CPUs", "uproxy-w2-2cpu", "ka_p99", "haproxy-t1-2cpu", None),
    Goal("Keep-alive p99, 2 CPUs", "uproxy-w1-2cpu", "ka_p99", "haproxy-t1-2cpu", None),
    Goal("New connections/s, 2 CPUs", "uproxy-w1-2cpu", "conn_rate", "haproxy-t1-2cpu", None),
    # Each worker or thread bound to a CPU of its own (--worker-cpu-affinity auto, cpu-map).
    Goal("Keep-alive p99, 2 CPUs", "uproxy-w2-bound-2cpu", "ka_p99", "haproxy-2cpu", None),
    Goal("Keep-alive p99, 2 CPUs", "uproxy-w2-bound-2cpu", "ka_p99", "haproxy-bound-2cpu", None),
    Goal("New connections/s, 2 CPUs", "uproxy-w2-bound-2cpu", "conn_rate", "haproxy-2cpu", None),
    Goal(
        "New connections/s, 2 CPUs", "uproxy-w2-bound-2cpu", "conn_rate", "haproxy-bound-2cpu", None
    ),
    Goal("TCP 1 stream, 2 CPUs", "uproxy-w2-2cpu", "tcp1_gbps", "kernel-dnat-2cpu", None),
    Goal(
        "Proxy CPU per GB, 1 stream, 2 CPUs", "uproxy-w2-2cpu", "cpu_s_per_gb", "haproxy-2cpu", None
    ),
]


def _median(summary: dict[str, Any], peer: str, metric: str) -> float | None:
    value = summary.get(peer, {}).get(metric, {}).get("median")
    return None if value is None else float(value)


def read(goal: Goal, summary: dict[str, Any]) -> dict[str, Any]:
    """The goal's figures in this run: value, reference, ratio, and whether it is met."""
    value = _median(summary, goal.peer, goal.metric)
    ref = _median(summary, goal.reference, goal.metric) if goal.reference else None
    ratio = value / ref if value is not None and ref else None
    measured = ratio if goal.reference else value
    met: bool | None = None
    if goal.threshold is not None and measured is not None:
        met = measured >= goal.threshold if goal.at_least else measured <= goal.threshold
    return {"value": value, "reference_value": ref, "ratio": ratio, "met": met}


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def markdown(summary: dict[str, Any], labels: dict[str, str]) -> list[str]:
    """The goals table (and the rows read beside it)."""
    lines = [
        "## Goals (read, not asserted)",
        "",
        "| figure | peer | value | reference | value | ratio | goal | met |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for goal in [*GOALS, *CONTEXT]:
        got = read(goal, summary)
        m = BY_KEY[goal.metric]
        met = {None: "-", True: "yes", False: "**no**"}[got["met"]]
        ratio = "-" if got["ratio"] is None else f"{got['ratio']:.2f}x"
        ref = labels.get(goal.reference, goal.reference) if goal.reference else "-"
        lines.append(
            f"| {goal.text} ({m.unit}) {'↑' if m.higher_is_better else '↓'} | "
            f"{labels.get(goal.peer, goal.peer)} | {_fmt(got['value'])} | {ref} | "
            f"{_fmt(got['reference_value'])} | {ratio} | {goal.target()} | {met} |"
        )
    lines += [
        "",
        "The rows without a goal are read beside the goals. A ratio is uproxy's median over the "
        "reference's; a `-` is a peer that did not run.",
        "",
    ]
    return lines
