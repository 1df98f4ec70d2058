"""What the table reports: each figure, where it comes from, its unit and which way is better.

Proxy CPU figures cover the proxy's whole process tree (``bench.proctree``); the split by
process (control and workers, master and workers) is in the per-process table of the report.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Metric:
    key: str
    workload: str  # the run it is read from
    field: str  # the key in that run's figures
    title: str
    unit: str
    higher_is_better: bool
    scale: float = 1.0
    compared: bool = True  # False: the machine's, not the peer's: no ratios between peers


# The hypervisor's share of a run: what a run's tails and speed are read with on a VM.
STEAL_TITLE = "CPU time the host took from this VM (steal, all CPUs)"

METRICS = [
    Metric("tcp1_gbps", "tcp1", "gbps", "TCP throughput, 1 stream", "Gb/s", True),
    Metric("tcp4_gbps", "tcp4", "gbps", "TCP throughput, 4 streams", "Gb/s", True),
    Metric(
        "cpu_s_per_gb", "tcp1", "cpu_s_per_gb", "Proxy CPU per GB (1 stream)", "CPU-s/GB", False
    ),
    Metric("conn_rate", "conn", "rate", "New connection per request", "req/s", True),
    Metric("conn_p50", "conn", "p50_ms", "New connection latency p50", "ms", False),
    Metric("conn_p99", "conn", "p99_ms", "New connection latency p99", "ms", False),
    Metric("cpu_us_per_conn", "conn", "cpu_us_per_conn", "Proxy CPU per connection", "µs", False),
    Metric(
        "kernel_us_per_conn",
        "conn",
        "kernel_us_per_conn",
        "Proxy kernel CPU per connection (system calls)",
        "µs",
        False,
    ),
    Metric(
        "machine_us_per_conn",
        "conn",
        "machine_us_per_conn",
        "All CPUs per connection (load, backend, proxy, kernel)",
        "µs",
        False,
    ),
    Metric(
        "conn_core", "conn", "proxy_core_pct", "Proxy CPU busy, connection run", "% of a CPU", False
    ),
    Metric(
        "conn_runq",
        "conn",
        "runq_ms_per_s",
        "Proxy runnable but waiting for a CPU, connection run",
        "ms/s",
        False,
    ),
    Metric("ka_p50", "keepalive", "p50_ms", "Keep-alive latency p50 (paced)", "ms", False),
    Metric("ka_p99", "keepalive", "p99_ms", "Keep-alive latency p99 (paced)", "ms", False),
    Metric("ka_rate", "keepalive", "rate", "Keep-alive offered rate achieved", "req/s", True),
    Metric(
        "tcp1_steal",
        "tcp1",
        "steal_ms_per_s",
        f"{STEAL_TITLE}, 1 stream run",
        "ms/s",
        False,
        compared=False,
    ),
    Metric(
        "ka_steal",
        "keepalive",
        "steal_ms_per_s",
        f"{STEAL_TITLE}, keep-alive run",
        "ms/s",
        False,
        compared=False,
    ),
    Metric("udp_rate", "udp", "rate", "UDP request/response", "req/s", True),
    Metric("udp_p99", "udp", "p99_ms", "UDP latency p99", "ms", False),
    Metric("peak_rss_mb", "peak", "rss_mb", "Proxy peak RSS", "MiB", False),
]

BY_KEY = {m.key: m for m in METRICS}
# Read beside the others, left out of the wide overview table.
NOT_IN_OVERVIEW = ("ka_rate", "tcp1_steal", "ka_steal", "conn_runq", "machine_us_per_conn")
