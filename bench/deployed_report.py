"""What the deployed-path part reports: medians over rounds, ratios, the markdown and a plot.

Every figure is the median over the rounds (each round a fresh setup of the peer) with its
min-max, and carries two ratios: to kernel DNAT in a linear iptables-nft chain at the same
number of services (kube-proxy's iptables mode, the layout most nodes run), and for the
connection figures, to the same peer at the smallest number of services (what 10,000
services cost). A ratio is always this value divided by the reference's; the arrow says which
way is better. Goals are shown beside the figures they are read from, never asserted.

CPU per connection is given twice: from the closed-loop run (as fast as the path goes) and
from the run at one offered rate for every peer and scale. The proxy's cost per connection
grows as the rate falls (fewer connections per wake-up, more system calls and loop turns per
connection), and a 10,000-rule chain lowers the rate in the kernel before the proxy sees a
packet, so the closed-loop figure mixes the rate in; the CPU-per-connection goals are read
from the equal-rate run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import wakeup
from bench.deployed_peers import BUSY_POLL
from bench.metrics import STEAL_TITLE
from bench.stats import ratio, summarise


@dataclass(frozen=True, slots=True)
class Figure:
    key: str
    workload: str  # "" for a figure of the setup itself
    field: str
    title: str
    unit: str
    higher_is_better: bool
    scale_ratio: bool = False  # also compared with the smallest number of services
    reference_key: str = ""  # the kernel figure it is compared with, when not its own key
    compared: bool = True  # False: a diagnostic, no ratio to the kernel


FIGURES = [
    Figure("conn_rate", "conn", "rate", "New connections/s", "conn/s", True, True),
    Figure("conn_p99", "conn", "p99_ms", "Connection latency p99", "ms", False),
    Figure("ka_p99", "keepalive", "p99_ms", "Keep-alive latency p99 (paced)", "ms", False),
    Figure("tcp1_gbps", "tcp1", "gbps", "TCP 1 stream", "Gb/s", True),
    Figure(
        "cpu_us_per_conn", "conn", "cpu_us_per_conn", "Proxy CPU per connection", "µs", False, True
    ),
    Figure("user_us_per_conn", "conn", "user_us_per_conn", "  of which user", "µs", False, True),
    Figure(
        "kernel_us_per_conn", "conn", "kernel_us_per_conn", "  of which system", "µs", False, True
    ),
    Figure(
        "machine_us_per_conn",
        "conn",
        "machine_us_per_conn",
        "All CPUs per connection",
        "µs",
        False,
        True,
    ),
    Figure("conn_core", "conn", "proxy_core_pct", "Proxy core busy (connections)", "%", False),
    Figure(
        "paced_rate",
        "conn_paced",
        "rate",
        "New connections/s achieved at the equal offered rate",
        "conn/s",
        True,
        compared=False,
    ),
    Figure(
        "paced_cpu_us_per_conn",
        "conn_paced",
        "cpu_us_per_conn",
        "Proxy CPU per connection, equal rate",
        "µs",
        False,
        True,
    ),
    Figure(
        "paced_user_us_per_conn",
        "conn_paced",
        "user_us_per_conn",
        "  of which user (equal rate)",
        "µs",
        False,
        True,
    ),
    Figure(
        "paced_kernel_us_per_conn",
        "conn_paced",
        "kernel_us_per_conn",
        "  of which system (equal rate)",
        "µs",
        False,
        True,
    ),
    Figure(
        "paced_machine_us_per_conn",
        "conn_paced",
        "machine_us_per_conn",
        "All CPUs per connection, equal rate",
        "µs",
        False,
        True,
    ),
    Figure(
        "ka_children_pct",
        "keepalive",
        "children_cpu_pct",
        "Proxy's child commands (rules check) during keep-alive",
        "% of a core",
        False,
        compared=False,
    ),
    Figure(
        "ka_runq",
        "keepalive",
        "runq_ms_per_s",
        "Proxy relaying, runnable but waiting for a CPU, keep-alive run",
        "ms/s",
        False,
        compared=False,
    ),
    Figure(
        "ka_steal",
        "keepalive",
        "steal_ms_per_s",
        f"{STEAL_TITLE}, keep-alive run",
        "ms/s",
        False,
        compared=False,
    ),
    Figure(
        "ka_scrape_p99",
        "ka_scrape",
        "p99_ms",
        "Keep-alive p99 while /metrics is scraped every 1 s",
        "ms",
        False,
        reference_key="ka_p99",
    ),
    Figure(
        "ka_long_p99",
        "ka_long",
        "p99_ms",
        "Keep-alive p99 over a long run (--long-keepalive)",
        "ms",
        False,
        reference_key="ka_p99",
    ),
    Figure(
        "ka_long_p999",
        "ka_long",
        "p999_ms",
        "Keep-alive p99.9 over the long run",
        "ms",
        False,
        reference_key="ka_p99",
        compared=False,
    ),
    Figure(
        "ka_long_children_pct",
        "ka_long",
        "children_cpu_pct",
        "Proxy's child commands during the long run",
        "% of a core",
        False,
        compared=False,
    ),
    Figure("scrape_median_s", "scrape", "median_s", "/metrics scrape time, median", "s", False),
    Figure("scrape_max_s", "scrape", "max_s", "/metrics scrape time, max", "s", False),
    Figure("scrape_mb", "scrape", "bytes", "/metrics size", "bytes", False),
    Figure(
        "tcp1_cpu_per_gb", "tcp1", "cpu_s_per_gb", "Proxy CPU per GB (1 stream)", "CPU-s/GB", False
    ),
    Figure("ready_s", "", "ready_s", "Serving after start", "s", False, compared=False),
    Figure("stop_s", "", "stop_s", "Stopped after SIGTERM", "s", False, compared=False),
]
BY_KEY = {f.key: f for f in FIGURES}


def _value(result: dict[str, Any], f: Figure) -> float | None:
    source = result.get(f.workload, {}) if f.workload else result
    value = source.get(f.field) if isinstance(source, dict) else None
    return float(value) if isinstance(value, int | float) else None


def summary(data: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """peer -> scale -> figure -> {median, min, max, n, spread_pct, vs_reference, vs_smallest}."""
    reference = data["meta"]["reference"]
    scales = [str(n) for n in data["meta"]["scales"]]
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for peer, by_scale in data["runs"].items():
        out[peer] = {}
        for scale in scales:
            out[peer][scale] = {}
            for f in FIGURES:
                values = [v for r in by_scale.get(scale, []) if (v := _value(r, f)) is not None]
                s = summarise(values)
                if s is not None:
                    out[peer][scale][f.key] = s.as_dict()
    for by_scale in out.values():
        for scale, figures in by_scale.items():
            for key, d in figures.items():
                f = BY_KEY[key]
                ref = out.get(reference, {}).get(scale, {}).get(f.reference_key or key)
                if f.compared:
                    d["vs_reference"] = ratio(d["median"], ref["median"] if ref else None)
                small = by_scale.get(scales[0], {}).get(key)
                if f.scale_ratio and scale != scales[0]:
                    d["vs_smallest"] = ratio(d["median"], small["median"] if small else None)
    return out


def paced_rate(data: dict[str, Any]) -> int | None:
    """The offered rate of the equal-rate connection run (None: a run from before it)."""
    rate = data.get("meta", {}).get("paced_rate")
    return int(rate) if rate else None


# Achieved below this share of the offered rate: the peer did not sustain it.
SUSTAINED = 0.95


def short_of_rate(data: dict[str, Any]) -> list[str]:
    """Setups that did not sustain the equal offered rate (their figure is at a lower rate)."""
    offered = paced_rate(data)
    if not offered:
        return []
    peers = data["peers"]
    return [
        f"{peers[p]['label']} at {int(scale):,} services, round {r.get('round', '?')}: "
        f"{r['conn_paced']['rate']:,.0f} conn/s"
        for p, by_scale in data["runs"].items()
        for scale, runs in by_scale.items()
        for r in runs
        if isinstance(r.get("conn_paced"), dict)
        and r["conn_paced"].get("rate", 0) < SUSTAINED * offered
    ]


def paced_setups(data: dict[str, Any]) -> int:
    """How many setups ran the equal-rate connection run."""
    return sum(
        isinstance(r.get("conn_paced"), dict)
        for by_scale in data["runs"].values()
        for runs in by_scale.values()
        for r in runs
    )


def failed(data: dict[str, Any]) -> bool:
    return "error" in data or any(e.get("failed") for e in data.get("peers", {}).values())


def _fmt(value: float | None, unit: str = "") -> str:
    if value is None:
        return "-"
    if unit == "bytes":
        return f"{value / 1e6:.1f} MB" if value >= 1e6 else f"{value / 1e3:.0f} kB"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}" if abs(value) >= 1 else f"{value:.3g}"


def _x(r: float | None) -> str:
    return "" if r is None else f" ({r:.2f}x)"


def _arrow(f: Figure) -> str:
    return "↑" if f.higher_is_better else "↓"


def markdown(data: dict[str, Any] | None) -> list[str]:
    """The "Deployed path" section of RESULTS.md."""
    if not data:
        return []
    lines = ["## Deployed path: pod → ClusterIP → node → backend", ""]
    if "skipped" in data or "error" in data:
        what = data.get("skipped") or f"failed: {data.get('error')}"
        return [*lines, f"Not run: {what}.", ""]
    meta, peers = data["meta"], data["peers"]
    summ = summary(data)
    scales = [str(n) for n in meta["scales"]]
    small, large = scales[0], scales[-1]
    ref_label = peers.get(meta["reference"], {}).get("label", meta["reference"])
    lines += [
        "A pod namespace connects to a ClusterIP routed through a node namespace, where the peer "
        "steers it to a backend namespace (nginx, iperf3). uproxy runs as a node runs it "
        f"(`--services FILE --rules …`, rules check every second, /metrics on) on CPU "
        f"{meta['cores']['proxy']}; the load, the backends and the kernel's NAT work run on CPU "
        f"{meta['cores']['load']}. N services = N HTTP services, the measured one last in rule "
        f"order, plus one iperf3 service. {meta['rounds']} round(s), every peer set up afresh in "
        f"fresh namespaces each round; {meta['durations']}. Medians over rounds; (x) is the "
        f"ratio to {ref_label} at the same number of services. Total time "
        f"{meta.get('elapsed_s', 0):.0f} s.",
        "",
    ]
    if woke := wakeup.describe(meta.get("wakeup")):
        lines += [woke, ""]
    offered = paced_rate(data)
    cols = ["conn_rate", "conn_p99", "ka_p99", "ka_runq", "tcp1_gbps", "cpu_us_per_conn"]
    cols += ["machine_us_per_conn"]
    cols += ["paced_cpu_us_per_conn", "paced_machine_us_per_conn"] if offered else []
    cols += ["ready_s"]
    head = " | ".join(_head(BY_KEY[k], offered) for k in cols)
    lines += [f"| peer | services | {head} |", "|---|---|" + "---|" * len(cols)]
    order = [p for p in peers if not peers[p].get("skipped")]
    for scale in scales:  # peers side by side at each scale: the ratios compare those rows
        for p in order:
            figs = summ.get(p, {}).get(scale, {})
            if not figs:
                if scale in peers[p].get("failed", {}):
                    lines.append(f"| {peers[p]['label']} | {int(scale):,} | failed (below) |")
                continue
            cells = []
            for k in cols:
                d = figs.get(k)
                if d is None:
                    cells.append("-")
                elif k in ("cpu_us_per_conn", "paced_cpu_us_per_conn"):
                    pre = "paced_" if k.startswith("paced_") else ""
                    user = figs.get(f"{pre}user_us_per_conn", {}).get("median")
                    system = figs.get(f"{pre}kernel_us_per_conn", {}).get("median")
                    cell = f"{_fmt(d['median'])} ({_fmt(user)} user + {_fmt(system)} sys)"
                    achieved = figs.get("paced_rate", {}).get("median")
                    if pre and offered and achieved and achieved < SUSTAINED * offered:
                        cell += f", only {achieved:,.0f} conn/s"
                    cells.append(cell)
                else:
                    cells.append(_fmt(d["median"], BY_KEY[k].unit) + _x(d.get("vs_reference")))
            lines.append(f"| {peers[p]['label']} | {int(scale):,} | " + " | ".join(cells) + " |")
    lines.append("")
    if offered:
        short = short_of_rate(data)
        if short:
            verdict = "not sustained by: " + "; ".join(short) + "."
        elif paced_setups(data):
            verdict = f"every setup measured sustained it (≥ {SUSTAINED:.0%})."
        else:
            verdict = "no setup was measured at it."
        lines += [
            f"Equal rate: new connections offered at {offered:,} conn/s to every peer at every "
            f"number of services; {verdict}",
            "",
        ]
    if large != small:  # one number of services: nothing to compare it with
        lines += _scale_table(summ, peers, order, small, large, offered)
    lines += _large_table(summ, peers, order, large)
    lines += _goals(summ, small, large, offered)
    lines += _spread_table(summ, peers, order, scales, offered)
    errors = [
        f"- {peers[p]['label']} at {int(scale):,} services, round {r.get('round', '?')}: "
        f"{w} run had {r[w]['errors']:.0f} wrk errors in {r[w]['requests']:.0f} requests"
        for p in order
        for scale in scales
        for r in data["runs"].get(p, {}).get(scale, [])
        for w in ("conn", "conn_paced", "keepalive", "ka_scrape", "ka_long")
        if isinstance(r.get(w), dict) and r[w].get("errors")
    ]
    if errors:
        lines += ["Errors seen by the load generator:", "", *errors, ""]
    skipped = {p: e["skipped"] for p, e in peers.items() if e.get("skipped")}
    failures = [(p, s, why) for p, e in peers.items() for s, why in e.get("failed", {}).items()]
    if skipped or failures:
        lines += ["Not measured:", ""]
        lines += [f"- {peers[p]['label']}: skipped: {_one_line(why)}" for p, why in skipped.items()]
        lines += [
            f"- {peers[p]['label']} at {int(s):,} services: failed: {_one_line(why)}"
            for p, s, why in failures
        ]
        lines.append("")
    return lines


def _head(f: Figure, offered: int | None, *, unit: bool = True) -> str:
    title = f.title.strip()
    if offered and f.workload == "conn_paced":
        title = title.replace("equal rate", f"at {offered:,} conn/s")
    return f"{title} ({f.unit}) {_arrow(f)}" if unit else f"{title} {_arrow(f)}"


def _one_line(text: str) -> str:
    return " ".join(text.replace("|", "/").split())[:300]


def _scale_table(
    summ: dict[str, Any],
    peers: dict[str, Any],
    order: list[str],
    small: str,
    large: str,
    offered: int | None = None,
) -> list[str]:
    keys = ["conn_rate", "cpu_us_per_conn", "user_us_per_conn", "kernel_us_per_conn"]
    keys.append("machine_us_per_conn")
    if offered:
        keys += ["paced_cpu_us_per_conn", "paced_user_us_per_conn", "paced_kernel_us_per_conn"]
        keys.append("paced_machine_us_per_conn")
    lines = [
        f"### {int(large):,} services against {int(small):,} (same peer)",
        "",
        "| peer | " + " | ".join(_head(BY_KEY[k], offered, unit=False) for k in keys) + " |",
        "|---|" + "---|" * len(keys),
    ]
    for p in order:
        figs = summ.get(p, {}).get(large, {})
        cells = [_ratio_only(figs.get(k, {}).get("vs_smallest")) for k in keys]
        lines.append(f"| {peers[p]['label']} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def _ratio_only(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def _large_table(
    summ: dict[str, Any], peers: dict[str, Any], order: list[str], large: str
) -> list[str]:
    rows = [p for p in order if peers[p].get("uproxy") and summ.get(p, {}).get(large)]
    if not rows:
        return []
    keys = ["ka_p99", "ka_children_pct", "ka_scrape_p99", "scrape_median_s", "scrape_max_s"]
    keys += ["scrape_mb", "stop_s"]
    if any("ka_long_p99" in summ[p][large] for p in rows):
        keys += ["ka_long_p99", "ka_long_p999", "ka_long_children_pct"]
    lines = [
        f"### uproxy at {int(large):,} services: keep-alive latency with its rules check "
        "(every 1 s) and with /metrics scraped every 1 s",
        "",
        "| peer | " + " | ".join(f"{BY_KEY[k].title} ({BY_KEY[k].unit})" for k in keys) + " |",
        "|---|" + "---|" * len(keys),
    ]
    for p in rows:
        figs = summ[p][large]
        cells = []
        for k in keys:
            d = figs.get(k)
            if d is None:
                cells.append("-")
                continue
            cells.append(_fmt(d["median"], BY_KEY[k].unit) + _x(d.get("vs_reference")))
        lines.append(f"| {peers[p]['label']} | " + " | ".join(cells) + " |")
    return [*lines, ""]


# (peer, figure, which ratio, at the largest scale?, what it says, the goal). The CPU-per-
# connection goals are read at the equal offered rate (the closed-loop ratio beside them).
GOALS = [
    ("uproxy-nftables", "conn_rate", "vs_smallest", True, "new connections/s", "≥ 0.9x"),
    ("uproxy-nftables", "paced_cpu_us_per_conn", "vs_smallest", True, "proxy CPU/conn", "≤ 1.1x"),
    (
        "uproxy-iptables-nft",
        "paced_cpu_us_per_conn",
        "vs_smallest",
        True,
        "proxy CPU/conn",
        "≤ 1.3x",
    ),
    (
        "uproxy-iptables-legacy",
        "paced_cpu_us_per_conn",
        "vs_smallest",
        True,
        "proxy CPU/conn",
        "≤ 1.3x",
    ),
    ("uproxy-nftables", "ka_p99", "vs_reference", False, "keep-alive p99", "≤ 1.5x"),
    ("uproxy-nftables", "ka_p99", "vs_reference", True, "keep-alive p99", "≤ 1.5x"),
    (
        "uproxy-nftables-busypoll",
        "ka_p99",
        "vs_reference",
        False,
        f"keep-alive p99 (--busy-poll {BUSY_POLL})",
        "≤ 1.5x",
    ),
    ("uproxy-iptables-nft", "ka_p99", "vs_reference", False, "keep-alive p99", "≤ 1.5x"),
    ("uproxy-iptables-nft", "ka_p99", "vs_reference", True, "keep-alive p99", "≤ 1.5x"),
]


def _goals(summ: dict[str, Any], small: str, large: str, offered: int | None = None) -> list[str]:
    lines = ["### Goals, read from the figures above (not asserted)", ""]
    if offered:
        lines += [
            f"Proxy CPU/conn goals are read at an equal offered rate of {offered:,} conn/s; "
            "the closed-loop figure mixes in the rate.",
            "",
        ]
    lines += ["| peer | figure | compared with | goal | measured |", "|---|---|---|---|---|"]
    for peer, key, which, at_large, what, goal in GOALS:
        if small == large and (at_large or which == "vs_smallest"):
            continue  # one number of services: the same row again, or a scale against itself
        scale = large if at_large else small
        figs = summ.get(peer, {}).get(scale, {})
        closed = ""
        if key.startswith("paced_"):
            if offered:
                what = f"{what} at {offered:,} conn/s,"
                closed = key.removeprefix("paced_")
            else:  # a run from before the equal-rate run: the closed-loop figure
                key = key.removeprefix("paced_")
        d = figs.get(key, {})
        against = (
            f"itself at {int(small):,}" if which == "vs_smallest" else "kernel DNAT, linear chain"
        )
        measured = _ratio_only(d.get(which))
        if closed:
            measured += f" (closed loop {_ratio_only(figs.get(closed, {}).get(which))})"
        lines.append(
            f"| {peer} | {what} at {int(scale):,} service{'' if scale == '1' else 's'} | "
            f"{against} | {goal} | {measured} |"
        )
    return [*lines, ""]


def _spread_table(
    summ: dict[str, Any],
    peers: dict[str, Any],
    order: list[str],
    scales: list[str],
    offered: int | None = None,
) -> list[str]:
    keys = ["conn_rate", "ka_p99", "ka_steal", "cpu_us_per_conn"]
    keys += ["paced_rate", "paced_cpu_us_per_conn"] if offered else []
    lines = [
        "### Spread between rounds (min - max)",
        "",
        "| peer | services | "
        + " | ".join(_head(BY_KEY[k], offered).removesuffix(f" {_arrow(BY_KEY[k])}") for k in keys)
        + " |",
        "|---|---|" + "---|" * len(keys),
    ]
    for p in order:
        for scale in scales:
            figs = summ.get(p, {}).get(scale, {})
            if not figs:
                continue
            cells = []
            for k in keys:
                d = figs.get(k)
                cells.append(
                    "-" if d is None else f"{_fmt(d['min'])} - {_fmt(d['max'])} (n={d['n']})"
                )
            lines.append(f"| {peers[p]['label']} | {int(scale):,} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def plot(data: dict[str, Any] | None, out: Path) -> list[str]:
    """deployed.png: connection rate, CPU per connection and keep-alive p99 per peer and scale."""
    if not data or "runs" not in data:
        return []
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    summ = summary(data)
    peers = data["peers"]
    order = [p for p in peers if not peers[p].get("skipped") and any(summ.get(p, {}).values())]
    if not order:
        return []
    scales = [str(n) for n in data["meta"]["scales"]]
    panels = ["conn_rate", "machine_us_per_conn", "cpu_us_per_conn", "ka_p99"]
    panels += ["paced_machine_us_per_conn", "paced_cpu_us_per_conn"]
    fig, axes = plt.subplots(2, 3, figsize=(17, 9))
    offered = paced_rate(data)
    width = 0.8 / len(scales)
    for ax, key in zip(axes.flat, panels, strict=True):
        f = BY_KEY[key]
        for j, scale in enumerate(scales):
            xs, ys, lo, hi = [], [], [], []
            for i, p in enumerate(order):
                d = summ[p].get(scale, {}).get(key)
                if d is None:
                    continue
                xs.append(i + (j - (len(scales) - 1) / 2) * width)
                ys.append(d["median"])
                lo.append(d["median"] - d["min"])
                hi.append(d["max"] - d["median"])
            ax.bar(xs, ys, width=width, yerr=[lo, hi], capsize=3, label=f"{int(scale):,} svc")
        ax.set_xticks(range(len(order)))
        ax.set_xticklabels([peers[p]["label"] for p in order], rotation=35, ha="right", fontsize=7)
        ax.set_title(_head(f, offered), fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Deployed path: pod → ClusterIP → node → backend", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "deployed.png", dpi=110)
    plt.close(fig)
    return ["deployed.png"]
