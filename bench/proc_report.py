"""The per-process table: what each proxy's processes and threads cost, role by role.

Every CPU and memory figure of a proxy covers its whole process tree (``bench.proctree``);
this table shows how that total splits: uproxy's control process against its data-plane
workers, nginx's master against its workers, HAProxy's threads, and the children reaped
during a run. Figures are the medians of the connection runs (per connection) and the
memory read after the peer's last run.
"""

from __future__ import annotations

import statistics
from typing import Any


def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [float(r[key]) for r in runs if key in r]
    return statistics.median(values) if values else None


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _row(entry: dict[str, Any]) -> str | None:
    conn = entry.get("runs", {}).get("conn", [])
    peak = (entry.get("runs", {}).get("peak") or [{}])[0]
    if not conn or "cpu_s" not in conn[0]:
        return None
    main, children = (entry.get("roles") or ["process", "children"])[:2]
    procs = _median(conn, "processes")
    threads = _median(conn, "threads")
    busy = _median(conn, "main_threads_busy")
    total = _median(conn, "cpu_us_per_conn")
    kernel = _median(conn, "kernel_us_per_conn")
    share = None if not total or kernel is None else 100.0 * kernel / total
    cpus = entry.get("proxy_cpus", 1)
    cells = [
        entry["label"],
        str(cpus),
        f"{_f(procs, 0)} ({_f(threads, 0)} threads)",
        _f(total),
        f"{main} {_f(_median(conn, 'main_us_per_conn'))}",
        f"{children} {_f(_median(conn, 'workers_us_per_conn'))}",
        _f(_median(conn, "other_us_per_conn")),
        _f(share, 0),
        _f(busy, 0),
        f"{main} {_f(peak.get('main_hwm_mb'))}",
        f"{children} {_f(peak.get('workers_hwm_mb'))}",
        _f(peak.get("rss_mb")),
        _f(peak.get("pss_mb")),
        _f(_median(conn, "runq_ms_per_s")),
    ]
    return "| " + " | ".join(cells) + " |"


def markdown(peers: dict[str, Any]) -> list[str]:
    rows = [r for e in peers.values() if not e.get("skipped") for r in [_row(e)] if r]
    if not rows:
        return []
    return [
        "## Per-process accounting (connection run, medians)",
        "",
        "CPU per connection of the proxy's whole process tree and of each role: the root "
        "process (uproxy's control process, nginx's master, HAProxy), the processes under it "
        "(uproxy's and nginx's workers), and *other*: children reaped during the run. "
        "*Threads that worked*: the root's threads with at least a tenth of its CPU. Peak RSS "
        "is VmHWM per role after the last run; their sum (the headline figure) counts shared "
        "pages once per process, Pss splits them. *Waiting*: time the tree's threads were "
        "runnable but had no CPU, per second of the run: other work on the proxy's CPUs (at "
        "equal cores the load generators and backends share them by design).",
        "",
        "| peer | CPUs | processes | CPU µs/conn | root | under it | other | kernel % "
        "| threads that worked | peak RSS MiB, root | under it | RSS sum | Pss MiB "
        "| waiting ms/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]
