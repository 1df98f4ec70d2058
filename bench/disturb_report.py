"""The table of ``bench.disturb``: keep-alive latency through uproxy during its control work.

Each rules backend gets four rows (undisturbed, big sync, rules repair, and a big sync
while the workers are saturated). The first three run in rounds: their p99 is the median
round's, with the rounds' range, and the row's other figures are that round's. Each p99 is
beside uproxy's own undisturbed p99, HAProxy's keep-alive p99 measured beside it (``nbthread
2``, with ``cpu-map`` for bound workers: in the same namespace, in every round, the median
round's; what the goals are read against), and
HAProxy's plain keep-alive p99 from the peers of the same run (``haproxy-2cpu``, both CPUs
as here, ``haproxy-bound-2cpu``, its threads bound with ``cpu-map``, and pinned ``haproxy``;
none for the saturated run, a connection run), with the CPU each of uproxy's roles spent
during the run and what the disturbance did. A backend's rows come twice: with the workers
as a node runs them, then bound to a CPU each (``--worker-cpu-affinity auto``, "bound").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

RUNS = (
    ("undisturbed", "undisturbed"),
    ("big_sync", "big sync"),
    ("repair", "rules repair"),
    ("big_sync_saturated", "big sync, workers saturated (a connection run, not keep-alive)"),
)
# Runs whose latency is not a keep-alive run's: no ratio to the keep-alive p99s.
NOT_KEEPALIVE = frozenset({"big_sync_saturated"})


def _haproxy_p99(summary: dict[str, Any], peer: str) -> float | None:
    value = summary.get(peer, {}).get("ka_p99", {}).get("median")
    return None if value is None else float(value)


def _x(value: float, ref: float | None) -> str:
    return "-" if not ref else f"{value / ref:.2f}x"


def _what(key: str, f: dict[str, Any], services: int) -> str:
    def s(v: float) -> str:
        return "not seen" if v < 0 else f"{v:.1f} s"

    if key.startswith("big_sync"):
        return (
            f"{services:,} services replaced by {services:,} others: new ones answer after "
            f"{s(f['new_reachable_s'])}, old ones refused after {s(f['old_refused_s'])}, "
            f"ports swapped after {s(f['listeners_done_s'])}; the sync covered "
            f"{f['covered_pct']:.0f} % of the run"
        )
    if key == "repair":
        return (
            f"rules flushed {f['repairs']:.0f} times, repaired after {f['repair_median_s']:.2f} s "
            f"(median), {f['repair_max_s']:.2f} s (max); {f['covered_pct']:.0f} % of the run "
            "without rules"
        )
    return ""


def _p99(key: str, f: dict[str, Any], entry: dict[str, Any]) -> str:
    """The p99 in bold; with its rounds' range when there were several."""
    return f"**{f['p99_ms']:.3f}**{_rounds_range(key, entry)}"


def _rounds_range(key: str, entry: dict[str, Any]) -> str:
    """`` (min-max)`` of a run's p99 over its rounds; empty for a single round."""
    p99s = [r["p99_ms"] for r in entry.get("rounds", {}).get(key, [])]
    return f" ({min(p99s):.3f}-{max(p99s):.3f})" if len(p99s) > 1 else ""


def _rows(rules: str, entry: dict[str, Any], summary: dict[str, Any]) -> list[str]:
    base = entry.get("undisturbed", {}).get("p99_ms")
    beside = entry.get("reference", {}).get("p99_ms")
    h2, h1 = _haproxy_p99(summary, "haproxy-2cpu"), _haproxy_p99(summary, "haproxy")
    h2b = _haproxy_p99(summary, "haproxy-bound-2cpu")
    rows = []
    for key, title in RUNS:
        f = entry.get(key)
        if not f:
            continue
        cells = [
            rules,
            title,
            f"{f.get('wall_s', 0):.0f}",
            f"{f['p50_ms']:.3f}",
            _p99(key, f, entry),
            f"{f['p999_ms']:.2f}",
            f"{f['max_ms']:.1f}",
            f"{f['errors']:.0f}",
            *(
                ["-"] * 5
                if key in NOT_KEEPALIVE
                else [
                    _x(f["p99_ms"], base),
                    _x(f["p99_ms"], beside),
                    _x(f["p99_ms"], h2),
                    _x(f["p99_ms"], h2b),
                    _x(f["p99_ms"], h1),
                ]
            ),
            f"{f.get('cpu_main_s', 0):.2f}",
            f"{f.get('cpu_workers_s', 0):.2f}",
            f"{f.get('cpu_other_s', 0):.2f}",
            _what(key, f, entry.get("services", 0)),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def _start_line(rules: str, entry: dict[str, Any]) -> str:
    st, end = entry.get("start", {}), entry.get("end", {})
    if not st:
        return f"- {rules}: {entry.get('error', 'no result')}"
    return (
        f"- {rules}: {entry['services'] + 1:,} services served {st['serving_s']:.1f} s after "
        f"start (all listening {st['listening_s']:.1f} s); RSS control "
        f"{st['main_rss_mb']:.0f} MiB, workers {st['workers_rss_mb']:.0f} MiB (Pss of the "
        f"tree {st['pss_mb']:.0f} MiB) after start, control {end.get('main_rss_mb', 0):.0f} MiB, "
        f"workers {end.get('workers_rss_mb', 0):.0f} MiB after the runs; worker restarts: "
        f"{end.get('worker_restarts', 0):.0f}{_reference(entry)}"
    )


def _reference(entry: dict[str, Any]) -> str:
    """The HAProxy measured beside: its keep-alive p99, the median round's, and the range."""
    f = entry.get("reference")
    if not f:
        return ""
    return (
        f"; {entry.get('reference_peer', 'HAProxy')} beside it: keep-alive p99 "
        f"{f['p99_ms']:.3f} ms{_rounds_range('reference', entry)}"
    )


def _rounds_note(disturb: dict[str, Any]) -> str:
    counts = {
        len(e.get("rounds", {}).get("big_sync", [])) for e in disturb.get("backends", {}).values()
    }
    n = max(counts, default=0)
    if n <= 1:
        return ""
    return (
        f"The first three runs of each backend ran {n} times: the p99 shown is the median "
        "round's, with the rounds' range, and the row's other figures are that round's."
    )


def markdown(disturb: dict[str, Any] | None, summary: dict[str, Any]) -> list[str]:
    if not disturb:
        return []
    head = [
        "## Keep-alive latency during control work (uproxy, `--workers 2`, 2 CPUs)",
        "",
    ]
    if disturb.get("skipped"):
        return [*head, f"Skipped: {disturb['skipped']}.", ""]
    lines = [
        *head,
        "The paced keep-alive run through a ClusterIP while uproxy's control process replaces "
        f"{disturb['services']:,} services by {disturb['services']:,} others (a big sync), and "
        "while its rules are flushed and repaired (see `bench/disturb.py`). Ratios: this p99 "
        "over uproxy's undisturbed p99; over HAProxy `nbthread 2` measured beside it (in the "
        "same namespace and rounds, with `cpu-map` where the workers are bound: the goals' "
        "reference); and over HAProxy's plain keep-alive p99 from the peers of this run "
        "(`nbthread 2` on 2 CPUs, the same with its threads bound by `cpu-map`, and 1 thread "
        "pinned). Each backend runs twice: with the workers as a node runs them, then with "
        'each bound to a CPU of its own (`--worker-cpu-affinity auto`, "bound"). '
        "A run's p99 is diluted by its "
        "undisturbed part: read it with the share the disturbance covered. "
        f"{_rounds_note(disturb)}",
        "",
        "| rules | run | s | p50 ms | p99 ms | p99.9 ms | max ms | errors | x undisturbed "
        "| x HAProxy beside | x HAProxy 2 CPUs | x HAProxy 2 CPUs, cpu-map | x HAProxy pinned "
        "| CPU s control | workers | reaped | what happened |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rules, entry in disturb.get("backends", {}).items():
        lines += _rows(rules, entry, summary)
    lines.append("")
    lines += [_start_line(r, e) for r, e in disturb.get("backends", {}).items()]
    lines.append("")
    return lines


def plot(
    disturb: dict[str, Any] | None, summary: dict[str, Any], out: Path, date: str
) -> list[str]:
    """``disturb.png``: p99 and max per run and rules backend; HAProxy's p99 as lines, the
    one measured beside each backend across its bars."""
    if not disturb:
        return []
    backends = {r: e for r, e in disturb.get("backends", {}).items() if "undisturbed" in e}
    if not backends:
        return []
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    fig, ax = plt.subplots(figsize=(8, 4.2))
    width = 0.8 / len(RUNS)
    for j, (key, title) in enumerate(RUNS):
        xs = [i + (j - (len(RUNS) - 1) / 2) * width for i in range(len(backends))]
        p99 = [e.get(key, {}).get("p99_ms", 0.0) for e in backends.values()]
        top = [e.get(key, {}).get("max_ms", 0.0) for e in backends.values()]
        ax.bar(xs, p99, width=width, label=f"{title}: p99 (tick: max)")
        ax.scatter(xs, top, marker="_", s=200, color="black")
    beside = [
        (i, e["reference"]["p99_ms"]) for i, e in enumerate(backends.values()) if "reference" in e
    ]
    if beside:
        # Across the backend's bars: the reference its rows are read against.
        ax.hlines(
            [p for _, p in beside],
            [i - 0.45 for i, _ in beside],
            [i + 0.45 for i, _ in beside],
            colors="black",
            linewidths=2,
            label="HAProxy beside: keep-alive p99",
        )
    for peer, style in (("haproxy-2cpu", "--"), ("haproxy-bound-2cpu", "-."), ("haproxy", ":")):
        ref = _haproxy_p99(summary, peer)
        if ref:
            ax.axhline(ref, linestyle=style, color="grey", label=f"{peer}: keep-alive p99")
    ax.set_yscale("log")
    ax.set_xticks(range(len(backends)))
    ax.set_xticklabels([f"--rules {r}" for r in backends], fontsize=8)
    ax.set_ylabel("ms (lower is better, log scale)")
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    fig.suptitle(
        f"uproxy keep-alive latency during control work, {disturb['services']:,} services "
        f"(--workers 2, 2 CPUs) — {date}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(out / "disturb.png", dpi=110)
    plt.close(fig)
    return ["disturb.png"]
