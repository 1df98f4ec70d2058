"""The "Control plane at scale" table and plot, from ``bench.controlplane``'s raw sessions.

One column per rules backend and service count, one row per figure, the goal beside each
row. Goals are what we read the figures against; nothing asserts them (speed is read here,
never enforced). Percentiles interpolate between the sorted samples: with 20 samples, p99
is close to the slowest one, which is the point of reporting it.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

Entry = dict[str, Any]  # one size of one backend: {"api": session, "file": session}

GOAL_API_S = 2.0
GOAL_FILE_S = 3.0
GOAL_RSS_MIB = 200
GOAL_CHANGE_P99_MS = 100
GOAL_ADD_P99_MS = 1100


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


def fmt_num(value: Any, digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _get(source: str, key: str, digits: int = 2) -> Callable[[Entry], str]:
    return lambda e: fmt_num(e.get(source, {}).get(key), digits)


def _started(source: str, key: str) -> Callable[[Entry], str]:
    """A cold-start figure: the median of the session's starts, and their range."""

    def cell(e: Entry) -> str:
        runs = e.get(source, {}).get(f"{key}_runs", [])
        median = _get(source, key)(e)
        return f"{median} ({min(runs):.2f}-{max(runs):.2f})" if len(runs) > 1 else median

    return cell


def _relist(e: Entry) -> str:
    s = e.get("api", {}).get("relist_s")
    if not s:
        return "-"
    rest = f" / {statistics.median(s[1:]):.2f}" if len(s) > 1 else ""
    return f"{s[0]:.2f}{rest}"


def _latency(kind: str) -> Callable[[Entry], str]:
    def cell(e: Entry) -> str:
        fig = e.get("api", {}).get("detail", {}).get(kind)
        if not fig:
            return "-"
        ms = fig["ms"]
        text = f"{fmt_num(percentile(ms, 50), 0)} / {fmt_num(percentile(ms, 99), 0)}"
        lost = fig["timeouts"]
        return f"{text} ({len(ms)} timed, {lost} timed out)" if lost else f"{text} ({len(ms)})"

    return cell


def _metrics(e: Entry) -> str:
    m = e.get("api", {}).get("detail", {}).get("metrics")
    return "-" if not m else f"{m['bytes'] / 1e6:.1f} MB in {m['s']:.2f} s"


def _scrapes(e: Entry) -> str:
    s = e.get("api", {}).get("detail", {}).get("scrapes")
    if not s or not s["s"]:
        return "-"
    return f"{s['count']} scrapes, median {statistics.median(s['s']):.2f} s, {s['failed']} failed"


def _bulk(e: Entry) -> str:
    b = e.get("api", {}).get("detail", {}).get("bulk_move")
    if not b:
        return "-"
    last = "not moved" if b["last_s"] is None else f"{b['last_s']:.2f} s"
    return f"{last}; CPU {b['control_cpu_s']:.2f} s control, {b['tree_cpu_s']:.2f} s in all"


def _own(histogram: str, what: str) -> Callable[[Entry], str]:
    """Mean of one of uproxy's histograms over the changes and additions, in ms."""

    def cell(e: Entry) -> str:
        m = e.get("api", {}).get("detail", {}).get("uproxy_metrics", {})
        total, count = m.get(f"{histogram}_sum"), m.get(f"{histogram}_count")
        return f"{total / count * 1000:,.0f} ({count:.0f} {what})" if total and count else "-"

    return cell


def _rows(plan: dict[str, Any]) -> list[tuple[str, str, Callable[[Entry], str]]]:
    settle, relists = plan.get("settle_s", 10), plan.get("relists", 10)
    rss = f"≤ {GOAL_RSS_MIB} MiB"
    return [
        ("cold start from the API double: synced (s)", f"≤ {GOAL_API_S:g} s at 10,000",
         _started("api", "synced_s")),
        ("— every listener open (s)", "", _started("api", "listeners_s")),
        ("— every portal in the kernel (s)", "", _started("api", "rules_s")),
        ("cold start from a services file: synced (s)", f"≤ {GOAL_FILE_S:g} s at 10,000",
         _started("file", "synced_s")),
        ("— every listener open (s)", "", _started("file", "listeners_s")),
        ("RSS at synced (MiB)", rss, _get("api", "rss_synced_mib", 0)),
        (f"RSS after {settle:g} s idle (MiB)", rss, _get("api", "rss_settled_mib", 0)),
        (f"RSS after {relists} relists (MiB)", rss, _get("api", "rss_relists_mib", 0)),
        ("RSS at the end, after the changes and additions (MiB)", rss,
         lambda e: _get("api", "rss_end_mib", 0)(e) if "detail" in e.get("api", {}) else "-"),
        ("peak RSS, API double (MiB)", "", _get("api", "peak_rss_mib", 0)),
        ("peak RSS, services file (MiB)", "", _get("file", "peak_rss_mib", 0)),
        ("relist after 410 Gone: the first / median of the others (s)", "", _relist),
        ("endpoint change, p50 / p99 (ms)", f"p99 ≤ {GOAL_CHANGE_P99_MS} ms",
         _latency("endpoint_change")),
        ("endpoint change, /metrics scraped every 1 s, p50 / p99 (ms)",
         f"p99 ≤ {GOAL_CHANGE_P99_MS} ms", _latency("endpoint_change_scraped")),
        ("— the scrapes meanwhile", "", _scrapes),
        ("service added, p50 / p99 (ms)", f"p99 ≤ {GOAL_ADD_P99_MS:,} ms",
         _latency("service_add")),
        ("every endpoint moved at once (one watch event each): the last answered; CPU", "",
         _bulk),
        ("one /metrics scrape", "", _metrics),
        ("uproxy's own figures meanwhile: mean sync (ms)", "",
         _own("kubeproxy_sync_proxy_rules_duration_seconds", "syncs")),
        ("— mean network programming latency (ms)", "",
         _own("kubeproxy_network_programming_duration_seconds", "changes")),
    ]  # fmt: skip


def markdown(cp: dict[str, Any]) -> str:
    scale = cp["scale"]
    columns: list[tuple[str, str, Entry]] = []
    for backend, entry in scale["backends"].items():
        for n, sizes in entry.get("sizes", {}).items():
            columns.append((backend, n, sizes))
    lines = [
        "## Control plane at scale (uproxy with real rules, in a network namespace)",
        "",
        "Single-port ClusterIP services, one endpoint each; one fresh node namespace per "
        "column and source; endpoint changes and additions at the largest size only. "
        "Definitions in `bench/controlplane.py`; the goals are read, not asserted.",
        "",
        "| figure | goal | " + " | ".join(f"{b} {int(n):,}" for b, n, _ in columns) + " |",
        "|---|---|" + "---|" * len(columns),
    ]
    for title, goal, cell in _rows(scale.get("plan", {})):
        lines.append(f"| {title} | {goal} | " + " | ".join(cell(e) for _, _, e in columns) + " |")
    lines.append("")
    notes = [f"{b}: {e['skipped']}" for b, e in scale["backends"].items() if e.get("skipped")]
    notes += scale.get("notes", []) + cp.get("notes", [])
    lines += [f"- {n}" for n in notes]
    if notes:
        lines.append("")
    return "\n".join(lines)


def plot(cp: dict[str, Any], out: Path, title: str) -> str | None:
    """control_plane.png: time to synced and RSS against service count, per backend; grey
    lines are the goals (at 10,000 services: 2 s from the API, 3 s from a file; 200 MiB)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    series = (
        (axes[0], "api", "synced_s", "API double"),
        (axes[0], "file", "synced_s", "services file"),
        (axes[1], "api", "rss_synced_mib", "at synced"),
        (axes[1], "api", "rss_relists_mib", "after relists"),
    )
    for backend, entry in cp["scale"]["backends"].items():
        for ax, source, key, label in series:
            points = [
                (int(n), sizes[source][key])
                for n, sizes in entry.get("sizes", {}).items()
                if key in sizes.get(source, {})
            ]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="o", label=f"{backend}, {label}")
    axes[0].axhline(GOAL_API_S, color="grey", linestyle="--", linewidth=0.8)
    axes[0].axhline(GOAL_FILE_S, color="grey", linestyle=":", linewidth=0.8)
    axes[1].axhline(GOAL_RSS_MIB, color="grey", linestyle="--", linewidth=0.8)
    for ax, label in ((axes[0], "time to synced (s)"), (axes[1], "RSS (MiB)")):
        ax.set_xlabel("service ports")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"uproxy control plane at scale — {title}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "control_plane.png", dpi=110)
    plt.close(fig)
    return "control_plane.png"
