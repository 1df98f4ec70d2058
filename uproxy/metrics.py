"""Every metric uproxy exports, defined in one place, and the writer of the data plane's.

Control-plane metrics keep kube-proxy's names and meaning so existing dashboards work;
data-plane metrics are ``uproxy_*``. Labels are service ports, protocols and outcomes,
never client or endpoint addresses (unbounded cardinality).

Two kinds of metric, because their sizes differ by four orders of magnitude:

* The control plane's (``kubeproxy_*``, the accept pauses, the build info, and the client
  library's ``process_*``/``python_*``) are a few dozen series that move a few times per
  sync: prometheus_client's Counter/Gauge/Histogram on its default ``REGISTRY``, rendered by
  ``generate_latest``.
* The data plane's are per service port: up to seven label sets per listener, 70,000
  series at 10,000 services, moved on every relayed read. They are ``ScrapeFamily``
  objects (defined in ``uproxy.dataplane.series``, so that a worker counts into them
  without loading prometheus_client) whose label sets are ``Tally`` objects: a plain
  number the data path adds to (prometheus_client's ``inc()`` takes a lock: 6 % of the
  proxy's CPU at ~7 increments per relayed connection). A scrape formats one line per
  label set from its values and its number (``ScrapeFamily.text``), in chunks that the
  metrics server interleaves with the relays (``uproxy.metrics_server``). The data path
  runs on the event loop thread only, so nothing here is locked.

Measured at 10,000 listeners (40,000 series written): one scrape took prometheus_client
0.9-1.4 s of CPU in one block; this writer renders the same families in ~25 ms (0.6 us per
series), 512 series (~0.3 ms) at a time. Lines are not kept as text between scrapes: a
``name{labels} `` prefix per label set, built when it was bound, rendered in 9.7 ms but
held 6.7 MiB in the control process at 10,000 service ports, for as long as it ran.

What a scrape contains, and why:

* No ``_created`` series. prometheus_client writes one per counter series and histogram
  (the text format has no place for it, so it is a separate gauge family); kube-proxy's Go
  client writes none, and for the data plane they doubled the output (130,000 lines instead
  of 70,000) with timestamps nobody queried. ``disable_created_metrics()`` drops them from
  the control plane too, so the exposition is uniform.
* Sparse label sets. A label set that counts failures (``sparse=`` below: connections
  refused or failed to dial, ``uproxy_no_endpoints_total``) is written once it is non-zero,
  i.e. from its first event on; it is then never removed. Almost always zero, they are 3 of
  the 7 series per TCP listener: written at zero, a scrape at 10,000 listeners had 70,000
  series instead of 40,000, 6.4 MB instead of 3.6 MB, and cost 22 ms of CPU instead of 15
  ms; and each of those 30,000 series would be kept by Prometheus, per node. The price:
  ``rate()``/``increase()`` need two samples, so they miss the event that creates a series
  (docs/metrics.md says how to alert on the first one). Gauges (open connections, UDP flows)
  and successes are always written.
* Always written, but not bound until used. A proxied service port's always-written series
  (its successes, its bytes both ways, its open connections or UDP flows) are in every
  scrape from the moment the control process proxies it (``PROXIED``): at zero, written by
  the family itself, until the data plane binds the label set at the port's first
  connection or datagram (``uproxy.dataplane.stats``). Binding them when a listener opened
  was half of what a worker did per new port (a shared-memory slot and a directory record
  per label set: ~10 of ~23 us per port, and ~7 of ~15 us to forget them again), for
  series that stay zero on most of 10,000 ports.
"""

from __future__ import annotations

import asyncio
import functools
import os
import platform
import resource
import time
from collections.abc import (
    Callable,
    Container,
    Iterable,
    Iterator,
)
from pathlib import Path

from prometheus_client import (
    PROCESS_COLLECTOR,
    REGISTRY,
    Counter,
    Gauge,
    Histogram,
    Info,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from uproxy import __version__
from uproxy.dataplane.counters import Labels, SlotReader

# The data plane's families (see the module docstring), defined where a worker can have
# them without prometheus_client; named here too, as every other metric is.
from uproxy.dataplane.series import (
    ACCEPT_PAUSED as ACCEPT_PAUSED,
    BYTES as BYTES,
    CONNECTION_ERRORS as CONNECTION_ERRORS,
    CONNECTIONS as CONNECTIONS,
    DATA_PLANE as DATA_PLANE,
    DIAL_ATTEMPTS as DIAL_ATTEMPTS,
    DIAL_DURATION as DIAL_DURATION,
    ENDPOINT_EJECTIONS as ENDPOINT_EJECTIONS,
    GAUGES as GAUGES,
    NO_ENDPOINTS as NO_ENDPOINTS,
    OPEN_CONNECTIONS as OPEN_CONNECTIONS,
    PROXIED as PROXIED,
    SERIES_PER_CHUNK as SERIES_PER_CHUNK,
    UDP_EVICTIONS as UDP_EVICTIONS,
    UDP_FLOWS as UDP_FLOWS,
    AnyTally as AnyTally,
    LabelledFamily as LabelledFamily,
    ScrapeCounter as ScrapeCounter,
    ScrapeFamily as ScrapeFamily,
    ScrapeGauge as ScrapeGauge,
    ScrapeHistogram as ScrapeHistogram,
    Tally as Tally,
    forget_service as forget_service,
    share as share,
)
from uproxy.timeslice import TimeSlice

# For prometheus_client's metrics; ours never write them (see above). The library's function is
# unannotated, hence the ignore.
disable_created_metrics()  # type: ignore[no-untyped-call]

# Buckets as kube-proxy's: exponential from 1 ms.
_SYNC_BUCKETS = tuple(0.001 * 2**i for i in range(15))
_PROGRAMMING_BUCKETS = tuple(
    [0.25 * i for i in range(1, 20)]
    + [5.0 * i for i in range(1, 60)]
    + [300.0 * i for i in range(1, 13)]
)

# --- control plane (kube-proxy's names) ---
SYNC_DURATION = Histogram(
    "kubeproxy_sync_proxy_rules_duration_seconds",
    "SyncProxyRules latency in seconds",
    buckets=_SYNC_BUCKETS,
)
SYNC_FULL_DURATION = Histogram(
    "kubeproxy_sync_full_proxy_rules_duration_seconds",
    "SyncProxyRules latency in seconds for full resyncs",
    buckets=_SYNC_BUCKETS,
)
SYNC_PARTIAL_DURATION = Histogram(
    "kubeproxy_sync_partial_proxy_rules_duration_seconds",
    "SyncProxyRules latency in seconds for partial resyncs",
    buckets=_SYNC_BUCKETS,
)
NO_LOCAL_ENDPOINTS = Gauge(
    "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
    "Number of services with a Local traffic policy and no endpoints",
    ["traffic_policy"],
)
IPTABLES_RESTORE_FAILURES = Counter(
    "kubeproxy_sync_proxy_rules_iptables_restore_failures_total",
    "Cumulative proxy iptables restore failures",
)
NFTABLES_SYNC_FAILURES = Counter(
    "kubeproxy_sync_proxy_rules_nftables_sync_failures_total",
    "Cumulative proxy nftables sync failures",
)
SYNC_LAST_TIMESTAMP = Gauge(
    "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
    "The last time proxy rules were successfully synced",
)
SYNC_LAST_QUEUED_TIMESTAMP = Gauge(
    "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
    "The last time a sync of proxy rules was queued",
)
NETWORK_PROGRAMMING_DURATION = Histogram(
    "kubeproxy_network_programming_duration_seconds",
    "In Cluster Network Programming Latency in seconds",
    buckets=_PROGRAMMING_BUCKETS,
)
SERVICE_CHANGES_TOTAL = Counter(
    "kubeproxy_sync_proxy_rules_service_changes_total",
    "Cumulative proxy rules Service changes",
)
SERVICE_CHANGES_PENDING = Gauge(
    "kubeproxy_sync_proxy_rules_service_changes_pending",
    "Pending proxy rules Service changes",
)
ENDPOINT_CHANGES_TOTAL = Counter(
    "kubeproxy_sync_proxy_rules_endpoint_changes_total",
    "Cumulative proxy rules Endpoint changes",
)
ENDPOINT_CHANGES_PENDING = Gauge(
    "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
    "Pending proxy rules Endpoint changes",
)
HEALTHZ_TOTAL = Counter(
    "kubeproxy_proxy_healthz_total", "Cumulative proxy healthz HTTP status", ["code"]
)
LIVEZ_TOTAL = Counter("kubeproxy_proxy_livez_total", "Cumulative proxy livez HTTP status", ["code"])
# client-go's own counter, which kube-proxy serves: a credential the API server refuses (401),
# or RBAC that does not allow the lists and watches (403), shows here, where /healthz stays
# 200 while the last known state is served.
API_REQUESTS = Counter(
    "rest_client_requests",
    "Number of HTTP requests to the Kubernetes API server, partitioned by status code, "
    "method, and host ('<error>': no answer)",
    ["code", "method", "host"],
)


# --- the process (prometheus_client's process_* metrics, with a cheap fd count) ---
#
# prometheus_client's ProcessCollector counts open fds by listing /proc/self/fd: ~0.8 us per
# fd, 10 ms at 12,000 fds (10,000 listeners), on the loop, every scrape; in a thread it held
# the GIL against the loop instead. Since Linux 6.2 the size of that directory is the count
# (~0.05 ms at any count). Same names, help and meaning as the library's; nothing off Linux.


class ProcessCollector(Collector):
    """``process_*``: memory, CPU, start time, open and maximum fds of this process."""

    def __init__(self, proc: Path = Path("/proc")) -> None:
        self._proc = proc
        self._page = resource.getpagesize()
        self._start = self._start_time()

    def _start_time(self) -> float | None:
        try:
            stat = (self._proc / "self" / "stat").read_text()
            boot = (self._proc / "stat").read_text()
        except OSError:
            return None  # no procfs
        started_ticks = int(stat.rpartition(")")[2].split()[19])  # field 22, starttime
        btime = next(int(ln.split()[1]) for ln in boot.splitlines() if ln.startswith("btime "))
        return btime + started_ticks / os.sysconf("SC_CLK_TCK")

    def open_fds(self) -> int:
        fd_dir = self._proc / "self" / "fd"
        return os.stat(fd_dir).st_size or len(os.listdir(fd_dir))  # 0 before Linux 6.2

    def collect(self) -> Iterator[Metric]:
        if self._start is None:
            return
        pages = (self._proc / "self" / "statm").read_text().split()
        yield from (
            GaugeMetricFamily(
                "process_virtual_memory_bytes",
                "Virtual memory size in bytes.",
                value=int(pages[0]) * self._page,
            ),
            GaugeMetricFamily(
                "process_resident_memory_bytes",
                "Resident memory size in bytes.",
                value=int(pages[1]) * self._page,
            ),
            GaugeMetricFamily(
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds.",
                value=self._start,
            ),
            CounterMetricFamily(
                "process_cpu_seconds",
                "Total user and system CPU time spent in seconds.",
                value=time.process_time(),
            ),
            GaugeMetricFamily(
                "process_open_fds", "Number of open file descriptors.", value=self.open_fds()
            ),
            GaugeMetricFamily(
                "process_max_fds",
                "Maximum number of open file descriptors.",
                value=resource.getrlimit(resource.RLIMIT_NOFILE)[0],
            ),
        )


PROCESS = ProcessCollector()
REGISTRY.unregister(PROCESS_COLLECTOR)
REGISTRY.register(PROCESS)


DATAPLANE_PENDING = Gauge(
    "uproxy_dataplane_pending_changes",
    "Changes the control process sent to the data-plane workers that they have not applied "
    "yet (listeners, endpoints); 0 when every worker is up to date",
)
WORKER_RESTARTS = Counter(
    "uproxy_worker_restarts_total",
    "Data-plane worker processes that died and were replaced",
)
BUILD_INFO = Info("uproxy_build", "uproxy build information")
BUILD_INFO.info({"version": __version__, "python": platform.python_version()})


# The longest stretch of adding up before the control process's loop runs again.
ADD_UP_SLICE_S = 0.002
_CHECK_EVERY = 512  # items between two looks at the clock
_RECORDS_PER_REFRESH = 512  # directory records learnt between two looks at the clock (~1 ms)


class WorkerTotals:
    """The control process's view of the workers' numbers: live ones plus the dead's.

    ``add_up`` sets every data-plane series to the sum over the live workers' slots and the
    counters of workers that died (``retire``), so a scrape neither loses nor counts twice
    what any worker, replaced or not, counted. Gauges count the live workers only.

    Before a scrape the control process adds up in slices (``add_up_sliced``): at 10,000
    service ports a worker reports 40,000 series, and adding them up in one go held the loop
    77 ms per scrape (283 ms for the first, which learns every label set), so an endpoint
    change waited behind it (p99 82-103 ms with a scrape every second, 7-9 ms without). A
    worker that dies between two slices moves its counts to the dead's: the pass starts over
    from the live workers then, without touching the dead one's closed shared memory, so no
    scrape counts it twice or not at all. One pass at a time (a lock): concurrent scrapes
    wait for it, then add up again.
    """

    def __init__(self) -> None:
        self._retired: dict[tuple[str, tuple[str, ...]], float] = {}
        self._retired_by_service: dict[str, set[tuple[str, tuple[str, ...]]]] = {}
        self._generation = 0  # moves at every retire: a sliced pass that sees it starts over
        self._lock = asyncio.Lock()

    def retire(self, reader: SlotReader, serving: Container[str] | None = None) -> None:
        """A worker is gone: keep its counters (its last state is in shared memory).

        ``serving``: the service ports the control process still proxies. A worker that
        died before it applied a deletion still names the deleted port's label sets, whose
        ``forget_service`` has run already: kept, they stayed in every scrape until a
        restart, and a port created again under that name went on from their counts.
        """
        reader.refresh()
        gauges = {g.name for g in GAUGES}
        service_at = _service_label_at()
        for family, labels, value in reader.items():
            if family in gauges:
                continue
            at = service_at.get(family)
            if at is not None and serving is not None and labels[at] not in serving:
                continue  # deleted before this worker learnt it
            key = (family, labels)
            self._retired[key] = self._retired.get(key, 0.0) + value
            if at is not None:
                self._retired_by_service.setdefault(labels[at], set()).add(key)
        self._generation += 1

    def add_up(self, readers: Iterable[SlotReader]) -> None:
        """Add up in one go (tests and tools; a scrape uses ``add_up_sliced``)."""
        for _ in self._steps(list(readers), TimeSlice(float("inf"), check_every=_CHECK_EVERY)):
            pass

    async def add_up_sliced(
        self, readers: Callable[[], Iterable[SlotReader]], budget_s: float = ADD_UP_SLICE_S
    ) -> None:
        """Add up the workers ``readers()`` names, letting the loop run every ``budget_s``."""
        async with self._lock:
            while True:
                generation = self._generation
                slices = TimeSlice(budget_s, check_every=_CHECK_EVERY)
                for _ in self._steps(list(readers()), slices):
                    await asyncio.sleep(0)
                    if self._generation != generation:
                        break  # a worker was retired meanwhile: start over
                else:
                    return

    def _steps(self, readers: list[SlotReader], slices: TimeSlice) -> Iterator[None]:
        """One pass; yields whenever ``slices`` says its budget is spent.

        Keyed by family, then by the readers' own label tuples: a pass makes no object per
        series that outlives it (the control process keeps the workers' 40,000 series at
        10,000 service ports; per-series tuples made at every scrape fragmented its heap).
        """
        totals: dict[str, dict[Labels, float]] = {}
        for (family, labels), value in self._retired.items():
            totals.setdefault(family, {})[labels] = value
        for reader in readers:
            while not reader.refresh(_RECORDS_PER_REFRESH):
                if slices.due(_RECORDS_PER_REFRESH):
                    yield
            for family, labels, value in reader.items():
                of_family = totals.get(family)
                if of_family is None:
                    of_family = totals[family] = {}
                of_family[labels] = of_family.get(labels, 0.0) + value
                if slices.due():
                    yield
        dial = [0.0] * (len(DIAL_DURATION.bounds) + 2)
        for labels, value in totals.get(DIAL_DURATION.name, {}).items():
            dial[-1 if labels == ("sum",) else int(labels[0])] = value
        DIAL_DURATION.set_totals(dial)
        for target in DATA_PLANE:
            if not isinstance(target, LabelledFamily):
                continue
            of_family = totals.get(target.name, {})
            for labels, value in of_family.items():
                target.local(labels).value = value
                if slices.due():
                    yield
            target.keep_only(of_family)  # a deleted service's series go with it

    def forget_service(self, service: str) -> None:
        """A service port was deleted: the counts of the dead for it go too."""
        for key in self._retired_by_service.pop(service, ()):
            self._retired.pop(key, None)


@functools.cache
def _service_label_at() -> dict[str, int]:
    """Where each data-plane family keeps the service label."""
    return {
        f.name: f.labelnames.index("service")
        for f in DATA_PLANE
        if isinstance(f, LabelledFamily) and "service" in f.labelnames
    }


def exposition(
    registry: Collector = REGISTRY, families: Iterable[ScrapeFamily] = DATA_PLANE
) -> str:
    """The whole /metrics body at once, as the metrics server streams it in slices: for tests
    and tools. Not for the event loop at scale (it holds the loop for the whole scrape)."""
    return generate_latest(registry).decode() + "".join(t for f in families for t in f.text())
