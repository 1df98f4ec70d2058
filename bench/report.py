"""Turning the raw runs into what people read: JSON, a markdown table, PNG plots.

Every figure is the median of the measured runs, shown with its min-max and with its ratio to
the kernel-DNAT peer (the physical limit for any proxy) and to HAProxy (what people would pick
instead), each *of the same placement*: a pinned peer against pinned kernel DNAT and HAProxy
``nbthread 1``, an equal-cores peer against kernel DNAT on 2 CPUs and HAProxy ``nbthread 2``.
A ratio is always this peer's value divided by the reference's, whichever way is better for
that figure; the table says which. The goals (``bench.goals``), the per-process accounting
(``bench.proc_report``) and the latency during control work (``bench.disturb_report``) have
tables of their own.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench import cp_report, deployed_report, disturb_report, goals, proc_report, wakeup
from bench.metrics import BY_KEY, METRICS, NOT_IN_OVERVIEW, Metric
from bench.stats import Summary, ratio, summarise

KERNEL = "kernel-dnat"
HAPROXY = "haproxy"
# The references of each placement's ratios.
REFERENCES = {
    "pinned": {"vs_kernel": KERNEL, "vs_haproxy": HAPROXY},
    "shared": {"vs_kernel": "kernel-dnat-2cpu", "vs_haproxy": "haproxy-2cpu"},
}
PLACEMENT_TITLES = {
    "pinned": "Pinned: the proxy on one core, load and backends on the other",
    "shared": "Equal cores: proxy, load and backends sharing both CPUs",
}


def placement(entry: dict[str, Any]) -> str:
    """A peer's placement (results written before there were two say nothing: pinned)."""
    return str(entry.get("placement", "pinned"))


def is_uproxy(name: str) -> bool:
    return name.startswith("uproxy-")


def _python_build() -> str:
    """Which interpreter uproxy ran on: its executable, and whether libpython is a shared
    library. The build moves a connection's user time (see bench/README.md, "Fairness"):
    a distribution's python3 is built with profile-guided and link-time optimization, a
    Python built from source without them (pyenv's default) is not."""
    executable = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    try:  # what this process mapped (a distribution's sysconfig may describe another build)
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return executable
    return f"{executable}, {'libpython shared' if '/libpython3' in maps else 'static'}"


def machine() -> dict[str, Any]:
    def first(cmd: list[str]) -> str:
        if shutil.which(cmd[0]) is None:
            return "not installed"
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False)
        except (OSError, subprocess.SubprocessError):
            return "?"
        text = (res.stdout or res.stderr).strip().splitlines()
        return text[0] if text else "?"

    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    os_name = "?"
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                os_name = line.split("=", 1)[1].strip('"')
    except OSError:
        pass
    mem_gib = 0.0
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem_gib = kb / (1 << 20)
    except (OSError, ValueError, IndexError):
        pass
    # New namespaces start with the host's choice; it moves a stream through a proxy on
    # loopback (bbr's pacing reorders a proxied flow across the two CPUs, which then
    # retransmits spuriously; one connection on one CPU, kernel DNAT's, does not).
    try:
        congestion = Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    except OSError:
        congestion = "?"
    try:
        import uvloop

        uvloop_version = str(getattr(uvloop, "__version__", "?"))
    except ImportError:
        uvloop_version = "not installed"
    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "memory_gib": round(mem_gib, 1),
        "os": os_name,
        "kernel": platform.release(),
        "tcp_congestion_control": congestion,
        "python": platform.python_version(),
        "python_build": _python_build(),
        "uvloop": uvloop_version,
        "haproxy": first(["haproxy", "-v"]),
        "nginx": first(["nginx", "-v"]),
        "socat": " ".join(first(["socat", "-V"]).split()[:4]) if shutil.which("socat") else "no",
        "iperf3": first(["iperf3", "--version"]),
        "wrk": first(["wrk", "-v"]),
        "iptables": first(["iptables", "--version"]),
    }


def summary_table(peers: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """peer -> metric key -> {median, min, max, n, spread_pct, vs_kernel, vs_haproxy}, the
    ratios against the references of the peer's own placement."""
    medians: dict[str, dict[str, Summary]] = {}
    for name, entry in peers.items():
        medians[name] = {}
        for m in METRICS:
            runs = entry.get("runs", {}).get(m.workload, [])
            s = summarise([float(r[m.field]) for r in runs if m.field in r])
            if s is not None:
                medians[name][m.key] = s
    out: dict[str, dict[str, Any]] = {}
    for name, by_metric in medians.items():
        out[name] = {}
        for key, s in by_metric.items():
            d: dict[str, Any] = s.as_dict()
            for label, ref in REFERENCES[placement(peers[name])].items():
                ref_s = medians.get(ref, {}).get(key)
                compared = BY_KEY[key].compared
                d[label] = ratio(s.median, ref_s.median if ref_s and compared else None)
            out[name][key] = d
    return out


def _fmt(value: float | None, unit: str = "") -> str:
    if value is None:
        return "-"
    if unit in ("req/s",):
        return f"{value:,.0f}"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}" if abs(value) < 1 else f"{value:.2f}"


def _ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def markdown(results: dict[str, Any]) -> str:
    peers = results["peers"]
    summary = results["summary"]
    order = [p for p in peers if not peers[p].get("skipped")]
    labels = {p: e["label"] for p, e in peers.items()}
    lines = _header(results)
    lines += goals.markdown(summary, labels)
    for where, title in PLACEMENT_TITLES.items():
        lines += _overview(results, [p for p in order if placement(peers[p]) == where], title)
    lines += _uproxy_table(results, [p for p in order if is_uproxy(p)])
    lines += proc_report.markdown(peers)
    lines += disturb_report.markdown(results.get("disturb"), summary)
    lines += _every_figure(results, order)
    lines += _control_plane(results.get("control_plane"))
    rs = results.get("rules_sync")
    if rs:
        lines += ["## Rules sync (`python -m bench.rules_sync`, per rules backend)", ""]
        lines += [rs["markdown"] if "markdown" in rs else f"Failed: {rs.get('error')}", ""]
    lines += deployed_report.markdown(results.get("deployed"))
    lines += _profile(results.get("profile"))
    notes = [(p, n) for p in order for n in peers[p].get("notes", [])]
    if notes:
        lines += ["## Notes from the run", ""]
        lines += [f"- {p}: {n}" for p, n in notes]
        lines.append("")
    lines += ["## Plots", ""]
    lines += [f"![{name}]({name})" for name in results.get("plots", [])]
    lines.append("")
    return "\n".join(lines)


def _header(results: dict[str, Any]) -> list[str]:
    meta = results["meta"]
    mach = meta["machine"]
    peers = results["peers"]
    where = meta.get("placements") or {
        "pinned": f"proxy on CPU {meta['cores']['proxy']}, load generators and backends on "
        f"CPU {meta['cores']['load']}"
    }
    lines = [
        f"# uproxy benchmark — {meta['date']}{' (quick smoke run)' if meta['quick'] else ''}",
        "",
        f"Machine: {mach['cpu']}, {mach['cpus']} CPUs, {mach['memory_gib']} GiB; {mach['os']}, "
        f"kernel {mach['kernel']} (TCP congestion control "
        f"{mach.get('tcp_congestion_control', 'not recorded')}); Python {mach['python']} "
        f"({mach.get('python_build', 'build not recorded')}), uvloop {mach['uvloop']}.",
        f"Tools: {mach['haproxy']}; {mach['nginx']}; {mach['socat']}; {mach['iperf3']}; "
        f"{mach['wrk']}; {mach['iptables']}.",
        f"uproxy revision: {meta.get('uproxy_revision', '?')}.",
        "",
        "Method: "
        + "; ".join(f"{name}: {text}" for name, text in where.items())
        + f". {_plan_text(meta['plan'])}. Ratios are this peer's median divided by kernel "
        "DNAT's / HAProxy's of the same placement (for ↑ figures higher is better, for ↓ "
        "lower is better). See bench/README.md.",
        f"Total time: {meta.get('elapsed_s', 0):.0f} s. Load average (1, 5, 15 min) at the "
        f"start: {_loads(meta.get('load_average_start'))}, at the end: "
        f"{_loads(meta.get('load_average_end'))} (anything else running on the machine "
        "shows up as spread).",
        "",
    ]
    if woke := wakeup.describe(meta.get("wakeup")):
        lines += [woke, ""]
    skipped = {p: e["skipped"] for p, e in peers.items() if e.get("skipped")}
    if skipped:
        lines += ["Skipped or failed peers:", ""]
        lines += [f"- {p}: {why}" for p, why in skipped.items()]
        lines.append("")
    return lines


def _plan_text(plan: dict[str, Any]) -> str:
    """How the peers were run; a results.json from before rounds says runs."""
    if "rounds" not in plan:
        warm = "a warm-up run" if plan["warmup"] else "no warm-up"
        return (
            f"{plan['runs']} measured run(s) of {plan['durations']} after {warm}; figures "
            "are medians with min-max"
        )
    warm = f"warmed up ({plan['warmup']}), " if plan["warmup"] else ""
    return (
        f"{plan['rounds']} round(s), the peers in turn: in each, every peer started afresh, "
        f"{warm}then measured once ({plan['durations']}); figures are medians over the "
        "rounds with min-max"
    )


def _overview(results: dict[str, Any], rows: list[str], title: str) -> list[str]:
    """One row per peer of one placement, medians only."""
    if not rows:
        return []
    peers, summary = results["peers"], results["summary"]
    overview = [m for m in METRICS if m.key not in NOT_IN_OVERVIEW]
    woke = any("wakeup" in peers[p] for p in rows)
    lines = [f"## Overview (medians). {title}", ""]
    head = "| peer | " + " | ".join(f"{m.title} ({m.unit}) {_arrow(m)}" for m in overview)
    lines.append(head + (" | idle CPU woken, p99 before its runs (us)" if woke else "") + " |")
    lines.append("|---|" + "---|" * (len(overview) + int(woke)))
    for p in rows:
        cells = [_fmt(summary.get(p, {}).get(m.key, {}).get("median"), m.unit) for m in overview]
        if woke:
            cells.append(_woken_p99(peers[p].get("wakeup")))
        lines.append(f"| {peers[p]['label']} | " + " | ".join(cells) + " |")
    if woke:
        lines += [
            "",
            "The last column: `bench.wakeup` run just before the peer's runs (a process blocked "
            "on the proxy's CPU, woken from the load CPU). Where it moves between peers, their "
            "latency and 2-CPU figures moved with the machine.",
        ]
    return [*lines, ""]


def _woken_p99(w: dict[str, Any] | None) -> str:
    if not w or "error" in w:
        return "-"
    return f"{w.get('idle', {}).get('p99_us', 0):.0f}"


def _uproxy_table(results: dict[str, Any], up: list[str]) -> list[str]:
    """uproxy against the references of its placement, every figure."""
    if not up:
        return []
    peers, summary = results["peers"], results["summary"]
    lines = ["## uproxy against kernel DNAT and HAProxy (of the same placement)", ""]
    head = "| figure | " + " | ".join(f"{peers[p]['label']} | x kernel | x HAProxy" for p in up)
    lines.append(head + " |")
    lines.append("|---|" + "---|---|---|" * len(up))
    for m in METRICS:
        if not m.compared:
            continue
        cells = []
        for p in up:
            d = summary.get(p, {}).get(m.key, {})
            cells += [
                _fmt(d.get("median"), m.unit),
                _ratio(d.get("vs_kernel")),
                _ratio(d.get("vs_haproxy")),
            ]
        lines.append(f"| {m.title} ({m.unit}) {_arrow(m)} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def _every_figure(results: dict[str, Any], order: list[str]) -> list[str]:
    """One detailed table per figure, both placements."""
    peers, summary = results["peers"], results["summary"]
    lines = ["## Every figure", ""]
    for m in METRICS:
        rows = [p for p in order if m.key in summary.get(p, {})]
        if not rows:
            continue
        lines += [f"### {m.title} ({m.unit}) {_arrow(m)}", ""]
        lines.append("| peer | CPUs | median | min - max | spread | x kernel DNAT | x HAProxy |")
        lines.append("|---|---|---|---|---|---|---|")
        for p in rows:
            d = summary[p][m.key]
            cpus = "2 (shared)" if placement(peers[p]) == "shared" else "1 (pinned)"
            lines.append(
                f"| {peers[p]['label']} | {cpus} | {_fmt(d['median'], m.unit)} | "
                f"{_fmt(d['min'], m.unit)} - {_fmt(d['max'], m.unit)} | "
                f"{d['spread_pct']:.0f}% | {_ratio(d['vs_kernel'])} | {_ratio(d['vs_haproxy'])} |"
            )
        lines.append("")
    return lines


def _control_plane(cp: dict[str, Any] | None) -> list[str]:
    if cp and "scale" in cp:
        return [cp_report.markdown(cp), ""]
    if not cp:
        return []
    lines = [
        "## Control plane (uproxy, uvloop, against the API-server double)",
        "",
        "| service ports | time to synced (s) | min - max | peak RSS (MiB) |",
        "|---|---|---|---|",
    ]
    for n, runs in cp["sizes"].items():
        t = summarise([r["sync_s"] for r in runs])
        rss = summarise([r["rss_mb"] for r in runs])
        if t is None or rss is None:
            lines.append(f"| {n} | failed | | |")
            continue
        lines.append(
            f"| {int(n):,} | {t.median:.2f} | {t.low:.2f} - {t.high:.2f} | {rss.median:.0f} |"
        )
    lines.append("")
    lines += [f"- {n}" for n in cp.get("notes", [])]
    return lines


def _profile(prof: dict[str, Any] | None) -> list[str]:
    title = "## Profile: uproxy (uvloop) on the connection-rate run"
    if not prof:
        return []
    if "skipped" in prof:
        return [title, "", f"Skipped: {prof['skipped']}.", ""]
    kind = "native and Python frames" if prof.get("native") else "Python frames only"
    lines = [
        title,
        "",
        f"py-spy, {prof['samples']} samples of {prof.get('process', 'the proxy')}, {kind}; raw "
        f"stacks in `{prof['raw']}` (flamegraph.pl or speedscope read them). The profiled run "
        "is separate from the measured ones (sampling pauses the proxy).",
        "",
        "| where the time goes | % of samples |",
        "|---|---|",
    ]
    lines += [f"| {r['frame']} | {r['pct']:.1f} |" for r in prof.get("categories", [])]
    lines += ["", "| self % | frame (top of stack) |", "|---|---|"]
    lines += [f"| {r['pct']:.1f} | `{r['frame']}` |" for r in prof["self"][:15]]
    lines += ["", "| inclusive % | uproxy function (anywhere on the stack) |", "|---|---|"]
    lines += [f"| {r['pct']:.1f} | `{r['frame']}` |" for r in prof.get("uproxy", [])[:12]]
    lines.append("")
    return lines


def _loads(values: list[float] | None) -> str:
    return ", ".join(f"{v:.2f}" for v in values) if values else "?"


def _arrow(m: Metric) -> str:
    return "↑" if m.higher_is_better else "↓"


def write(results: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    results["plots"] = plots(results, out)
    paths = [out / "results.json", out / "RESULTS.md"]
    paths[0].write_text(json.dumps(results, indent=1, sort_keys=False) + "\n")
    paths[1].write_text(markdown(results))
    return paths + [out / p for p in results["plots"]]


def _mark_placements(ax: Any, placements: list[str]) -> None:
    """A dashed line where the pinned peers end and the equal-cores ones begin."""
    for i in range(1, len(placements)):
        if placements[i] != placements[i - 1]:
            ax.axvline(i - 0.5, color="grey", linestyle="--", linewidth=1)
            ax.text(i - 0.4, ax.get_ylim()[1] * 0.97, "2 CPUs →", fontsize=7, va="top")


def plots(results: dict[str, Any], out: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    peers = results["peers"]
    summary = results["summary"]
    order = [p for p in peers if not peers[p].get("skipped")]
    written: list[str] = []
    groups = [
        ("throughput.png", "Bulk TCP (iperf3)", [["tcp1_gbps", "tcp4_gbps"]]),
        (
            "connections.png",
            "New connection per request (wrk, Connection: close)",
            [["conn_rate"], ["conn_p50", "conn_p99"]],
        ),
        (
            "keepalive.png",
            "Keep-alive latency at a fixed moderate rate (wrk paced)",
            [["ka_p50", "ka_p99"]],
        ),
        ("udp.png", "UDP request/response", [["udp_rate"], ["udp_p99"]]),
        ("cost.png", "Proxy cost", [["cpu_s_per_gb"], ["cpu_us_per_conn"], ["peak_rss_mb"]]),
    ]
    from bench.metrics import BY_KEY

    for fname, title, panels in groups:
        fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.2), squeeze=False)
        for ax, keys in zip(axes[0], panels, strict=True):
            rows = [p for p in order if any(k in summary.get(p, {}) for k in keys)]
            width = 0.8 / len(keys)
            for j, key in enumerate(keys):
                m = BY_KEY[key]
                xs, ys, lo, hi = [], [], [], []
                for i, p in enumerate(rows):
                    d = summary[p].get(key)
                    if d is None:
                        continue
                    xs.append(i + (j - (len(keys) - 1) / 2) * width)
                    ys.append(d["median"])
                    lo.append(d["median"] - d["min"])
                    hi.append(d["max"] - d["median"])
                bars = ax.bar(xs, ys, width=width, yerr=[lo, hi], capsize=3, label=m.title)
                for bar, p in zip(bars, [p for p in rows if key in summary[p]], strict=True):
                    if is_uproxy(p):
                        bar.set_edgecolor("black")
                        bar.set_linewidth(1.5)
            m0 = BY_KEY[keys[0]]
            ax.set_xticks(range(len(rows)))
            ax.set_xticklabels(
                [peers[p]["label"] for p in rows], rotation=30, ha="right", fontsize=8
            )
            ax.set_ylabel(f"{m0.unit} ({'higher' if m0.higher_is_better else 'lower'} is better)")
            ax.set_title(
                m0.title if len(keys) == 1 else ", ".join(BY_KEY[k].title for k in keys), fontsize=9
            )
            if len(keys) > 1:
                ax.legend(fontsize=7)
            _mark_placements(ax, [placement(peers[p]) for p in rows])
            ax.grid(axis="y", alpha=0.3)
        fig.suptitle(f"{title} — {results['meta']['date']}", fontsize=10)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
        written.append(fname)
    cp = results.get("control_plane")
    if cp and "scale" in cp:
        written += [p for p in [cp_report.plot(cp, out, results["meta"]["date"])] if p]
    elif cp and any(cp["sizes"].values()):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        sizes = [int(n) for n, runs in cp["sizes"].items() if runs]
        for ax, key, label in (
            (axes[0], "sync_s", "time to synced (s)"),
            (axes[1], "rss_mb", "peak RSS (MiB)"),
        ):
            meds, los, his = [], [], []
            for n in sizes:
                s = summarise([r[key] for r in cp["sizes"][str(n)]])
                if s is None:
                    continue
                meds.append(s.median)
                los.append(s.median - s.low)
                his.append(s.high - s.median)
            ax.errorbar(sizes, meds, yerr=[los, his], marker="o", capsize=3)
            ax.set_xlabel("service ports")
            ax.set_ylabel(label)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
        fig.suptitle(
            f"uproxy control plane against the API-server double — {results['meta']['date']}",
            fontsize=10,
        )
        fig.tight_layout()
        fig.savefig(out / "control_plane.png", dpi=110)
        plt.close(fig)
        written.append("control_plane.png")
    written += deployed_report.plot(results.get("deployed"), out)
    written += disturb_report.plot(results.get("disturb"), summary, out, results["meta"]["date"])
    return written
