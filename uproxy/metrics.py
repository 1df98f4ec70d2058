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
  objects whose label sets are ``Tally`` objects: a plain number the data path adds to
  (prometheus_client's ``inc()`` takes a lock: 6 % of the proxy's CPU at ~7 increments
  per relayed connection). A scrape formats one line per label set from its values and
  its number (``ScrapeFamily.text``), in chunks that the metrics server interleaves with
  the relays (``uproxy.metrics_server``). The data path runs on the event loop thread
  only, so nothing here is locked.

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
from abc import ABC, abstractmethod
from bisect import bisect_left
from collections.abc import (
    Callable,
    Collection,
    Iterable,
    Iterator,
    Mapping,
    MutableSequence,
    Sequence,
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
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from uproxy import __version__
from uproxy.dataplane.counters import CountersFull, Labels, SlotReader, SlotWriter
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
_DIAL_BUCKETS = (
    0.0002,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.0,
    4.0,
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


# --- the data plane's families, written by uproxy (see the module docstring) ---

# Series per chunk of ``ScrapeFamily.text``: the unit of work between two looks at the clock
# in the metrics server. 512 series take ~0.12 ms to render (0.24 us each).
SERIES_PER_CHUNK = 512

Sparse = bool | Mapping[str, Collection[str]]
# (service, protocol) -> the label sets of one family that a proxied service port always has
PortSeries = Callable[[str, str], tuple[Labels, ...]]


class Tally:
    """One label set's number, which the data path adds to (the family renders its text)."""

    __slots__ = ("escaped", "sparse", "value")

    def __init__(self, *, sparse: bool = False, escaped: tuple[str, ...] | None = None) -> None:
        self.value: float = 0
        self.sparse = sparse  # written only once non-zero
        # The label values as the text format writes them, when one needs escaping (a
        # quote, backslash or newline); None, as always for Kubernetes names: as they are.
        self.escaped = escaped


class SharedTally:
    """A worker's label set: its ``value`` lives in a shared-memory slot (see ``share``).

    The property costs ~130 ns more per update than a plain attribute: about 1 us per
    relayed connection (six or seven updates), well under 1 % of its cost.
    """

    __slots__ = ("_slot", "_values")

    def __init__(self, values: MutableSequence[float], slot: int) -> None:
        self._values = values
        self._slot = slot

    @property
    def slot(self) -> int:
        return self._slot

    @property
    def value(self) -> float:
        return float(self._values[self._slot])

    @value.setter
    def value(self, amount: float) -> None:
        self._values[self._slot] = amount


AnyTally = Tally | SharedTally

# In a data-plane worker: where label sets get their slots (``share``). None: in process.
_shared: SlotWriter | None = None


def share(writer: SlotWriter) -> None:
    """Count this process's data plane in shared memory, for the control process to add up.

    Called by a worker before anything binds a label set; from then on ``labels()`` hands
    out ``SharedTally`` objects, and the dial histogram keeps its buckets in slots too.
    """
    global _shared
    _shared = writer
    DIAL_DURATION.share(writer)


def _escape_label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _series_template(name: str, labelnames: tuple[str, ...]) -> str:
    """``template % (*label_values, value)`` is one series' line of the text format (``%``
    formats a line in half the time ``str.format`` takes)."""
    pairs = ",".join(f'{k}="%s"' for k in labelnames)
    return f"{name}{{{pairs}}} %r\n" if labelnames else f"{name} %r\n"


def _header(name: str, documentation: str, kind: str) -> str:
    help_text = documentation.replace("\\", "\\\\").replace("\n", "\\n")
    return f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n"


class ScrapeFamily(ABC):
    """A metric family of the data plane, rendered by ``text()`` rather than prometheus_client."""

    name: str
    documentation: str

    @abstractmethod
    def text(self) -> Iterator[str]:
        """The family in the text format 0.0.4: HELP and TYPE, then its series, in chunks of
        at most ``SERIES_PER_CHUNK`` series (the caller may let the loop run between two)."""

    @abstractmethod
    def describe(self) -> list[Metric]:
        """Name, type and help, as prometheus_client describes a family (for the docs)."""


class LabelledFamily(ScrapeFamily):
    """A family of label sets, each a ``Tally`` bound once by ``labels()``."""

    kind = "untyped"

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: tuple[str, ...],
        *,
        sparse: Sparse = False,
        per_port: PortSeries | None = None,
    ) -> None:
        """``per_port(service, protocol)``: the label sets of this family that a proxied
        service port always has (``PROXIED``), written at zero while nothing is bound."""
        self.name = name
        self.documentation = documentation
        self.labelnames = labelnames
        self.sparse = sparse
        self.per_port = per_port
        self._header = _header(name, documentation, self.kind)
        # Series lines are formatted at each scrape rather than kept as text: a prefix per
        # label set was 6.7 MiB of the control process at 10,000 service ports, and
        # formatting 40,000 lines costs ~10 ms more per scrape, in the metrics server's slices.
        self._template = _series_template(name, labelnames)
        self._tallies: dict[tuple[str, ...], AnyTally] = {}
        # Label sets by service: forgetting a deleted service costs its own series, not a
        # walk over every series (10,000 services deleted at once were 10,000 such walks).
        # A tuple per service, not a set: a service has one to four label sets in a family,
        # and a set is 216 bytes however small (the index was 6.8 MiB in a worker at 10,000
        # services, 2.0 MiB with tuples).
        self._service_at = labelnames.index("service") if "service" in labelnames else None
        self._by_service: dict[str, tuple[tuple[str, ...], ...]] = {}

    def labels(self, *values: str) -> AnyTally:
        """The tally of one label set: created at zero on first use, then the same one
        (shared by every listener of that label set, and kept, like a prometheus child, so a
        closed listener's totals stay in the family)."""
        tally = self._tallies.get(values)
        if tally is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {values}")
            tally = self._tallies[values] = self._bind(values)
            self._indexed(values)
        return tally

    def _indexed(self, values: tuple[str, ...]) -> None:
        if self._service_at is not None:
            service = values[self._service_at]
            same = self._by_service.get(service, ())
            if values not in same:
                self._by_service[service] = (*same, values)

    def _drop(self, values: tuple[str, ...]) -> AnyTally | None:
        tally = self._tallies.pop(values, None)
        if tally is not None and self._service_at is not None:
            service = values[self._service_at]
            rest = tuple(v for v in self._by_service.get(service, ()) if v != values)
            if rest:
                self._by_service[service] = rest
            else:
                self._by_service.pop(service, None)
        return tally

    def _bind(self, values: tuple[str, ...]) -> AnyTally:
        if _shared is not None:
            try:
                return SharedTally(_shared.values, _shared.new_slot(self.name, values))
            except CountersFull:
                pass  # counted in this process only: /metrics misses it, nothing breaks
        return self._new_tally(values)

    def forget(self, label: str, value: str) -> None:
        """Drop every label set whose ``label`` is ``value`` (a deleted service's series).

        Listeners still draining keep adding to the tallies they hold; nobody reads them.
        """
        if label not in self.labelnames:
            return
        if label == "service":
            doomed = list(self._by_service.get(value, ()))
        else:
            at = self.labelnames.index(label)
            doomed = [v for v in self._tallies if v[at] == value]
        for values in doomed:
            tally = self._drop(values)
            if isinstance(tally, SharedTally) and _shared is not None:
                _shared.forget_slot(tally.slot)

    def keep_only(self, wanted: Collection[tuple[str, ...]]) -> None:
        """The control process: drop the label sets no worker reports any more."""
        for values in [v for v in self._tallies if v not in wanted]:
            self._drop(values)

    def local(self, values: tuple[str, ...]) -> Tally:
        """The control process's own tally of a label set (where worker totals are summed);
        ``values`` becomes its key (the workers' directory tuple: no copy per series).

        Not indexed by service: every add-up ends with ``keep_only``, which drops what the
        workers forgot, so ``forget`` has nothing to do here (the index was 2 MiB of the
        control process at 10,000 service ports).
        """
        tally = self._tallies.get(values)
        if not isinstance(tally, Tally):
            tally = self._tallies[values] = self._new_tally(values)
        return tally

    def _new_tally(self, values: tuple[str, ...]) -> Tally:
        escaped = tuple(_escape_label_value(v) for v in values)
        return Tally(sparse=self._is_sparse(values), escaped=escaped if escaped != values else None)

    def _is_sparse(self, values: tuple[str, ...]) -> bool:
        if isinstance(self.sparse, bool):
            return self.sparse
        named = dict(zip(self.labelnames, values, strict=True))
        return any(named[label] in sparse for label, sparse in self.sparse.items())

    def series(self) -> list[tuple[tuple[str, ...], AnyTally]]:
        """Every label set bound so far with its tally (a copy)."""
        return list(self._tallies.items())

    def text(self) -> Iterator[str]:
        yield self._header
        # A snapshot of the label sets (one copy of the dict, made in C; a table that size
        # is a single allocation, returned whole), as listeners bind label sets while the
        # scrape yields the loop: one bound meanwhile is written by the next scrape (and at
        # zero by this one, if its port is proxied); one dropped meanwhile is skipped.
        bound = self._tallies.copy()
        keys = list(bound)
        tallies, template = self._tallies, self._template
        for start in range(0, len(keys), SERIES_PER_CHUNK):
            out: list[str] = []
            add = out.append
            for values in keys[start : start + SERIES_PER_CHUNK]:
                t = tallies.get(values)
                if type(t) is Tally and (t.value or not t.sparse):
                    add(template % ((t.escaped or values) + (t.value,)))
            yield "".join(out)
        if self.per_port is not None:
            yield from self._unbound_text(self.per_port, bound)

    def _unbound_text(
        self, per_port: PortSeries, bound: Mapping[Labels, AnyTally]
    ) -> Iterator[str]:
        """The proxied ports' series that nothing has bound yet, at zero."""
        ports = PROXIED.snapshot()
        template = self._template
        for start in range(0, len(ports), SERIES_PER_CHUNK):
            out: list[str] = []
            add = out.append
            for service, protocol, escaped in ports[start : start + SERIES_PER_CHUNK]:
                for values in per_port(service, protocol):
                    if values not in bound:
                        if escaped is not None:
                            values = (escaped, *values[1:])
                        add(template % (*values, 0))
            yield "".join(out)


class ScrapeCounter(LabelledFamily):
    """A labelled counter read at scrape time (see ``Tally``); ``name`` ends in ``_total``."""

    kind = "counter"

    def describe(self) -> list[Metric]:
        return [CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)]


class ScrapeGauge(LabelledFamily):
    """A labelled gauge read at scrape time (see ``Tally``)."""

    kind = "gauge"

    def describe(self) -> list[Metric]:
        return [GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)]


class ScrapeHistogram(ScrapeFamily):
    """An unlabelled histogram whose ``observe`` is a bisect and two additions."""

    def __init__(self, name: str, documentation: str, *, buckets: tuple[float, ...]) -> None:
        self.name = name
        self.documentation = documentation
        self.bounds = tuple(sorted(buckets))
        # The counts (the last one is +Inf), then the sum, from ``_base`` on: a list in
        # process, consecutive slots of shared memory in a worker (``share``).
        self._store: MutableSequence[float] = [0.0] * (len(self.bounds) + 2)
        self._base = 0
        self._header = _header(name, documentation, "histogram")
        self._bucket_prefixes = [
            f'{name}_bucket{{le="{_float_text(b)}"}} ' for b in (*self.bounds, float("inf"))
        ]

    @property
    def counts(self) -> list[float]:
        return [self._store[self._base + i] for i in range(len(self.bounds) + 1)]

    @property
    def sum(self) -> float:
        return self._store[self._base + len(self.bounds) + 1]

    def share(self, writer: SlotWriter) -> None:
        """Keep the buckets and the sum in consecutive slots ("0".."N" and "sum")."""
        self._base = writer.new_slot(self.name, ("0",))
        for i in range(1, len(self.bounds) + 1):
            writer.new_slot(self.name, (str(i),))
        writer.new_slot(self.name, ("sum",))
        self._store = writer.values

    def set_totals(self, store: Sequence[float]) -> None:
        """The control process: the sum of every worker's buckets and sum."""
        self._store = list(store)
        self._base = 0

    def observe(self, amount: float) -> None:
        store, base = self._store, self._base
        store[base + bisect_left(self.bounds, amount)] += 1
        store[base + len(self.bounds) + 1] += amount

    def describe(self) -> list[Metric]:
        return [HistogramMetricFamily(self.name, self.documentation)]

    def text(self) -> Iterator[str]:
        lines = [self._header]
        cumulative = 0
        for prefix, n in zip(self._bucket_prefixes, self.counts, strict=True):
            cumulative += int(n)
            lines.append(f"{prefix}{cumulative}\n")
        lines.append(f"{self.name}_count {cumulative}\n{self.name}_sum {self.sum!r}\n")
        yield "".join(lines)


def _float_text(bound: float) -> str:
    # prometheus_client's spelling of bucket bounds ("0.001", "1.0", "+Inf").
    if bound == float("inf"):
        return "+Inf"
    return repr(float(bound))


# --- data plane ---
# Failures: written from their first event on (see "Sparse label sets" above).
_FAILED_RESULTS = {"result": ("no_endpoints", "dial_failed")}


class ProxiedPorts:
    """The service ports the control process proxies, by ``service`` label, with their
    protocol: their always-written series are in every scrape, at zero until bound (see
    "Always written, but not bound until used" above). The service label comes first in
    every family that has one."""

    __slots__ = ("_ports",)

    def __init__(self) -> None:
        # service -> (protocol, the service label as the text format writes it, or None)
        self._ports: dict[str, tuple[str, str | None]] = {}

    def __len__(self) -> int:
        return len(self._ports)

    def add(self, service: str, protocol: str) -> None:
        escaped = _escape_label_value(service)
        self._ports[service] = (protocol, escaped if escaped != service else None)

    def discard(self, service: str) -> None:
        self._ports.pop(service, None)

    def snapshot(self) -> list[tuple[str, str, str | None]]:
        """(service, protocol, escaped service or None) of every proxied port, now."""
        return [(service, proto, escaped) for service, (proto, escaped) in self._ports.items()]


PROXIED = ProxiedPorts()

CONNECTIONS = ScrapeCounter(
    "uproxy_connections_total",
    "Connections (TCP) and flows (UDP) accepted, by outcome",
    ("service", "protocol", "result"),
    sparse=_FAILED_RESULTS,
    per_port=lambda service, protocol: ((service, protocol, "ok"),),
)
OPEN_CONNECTIONS = ScrapeGauge(
    "uproxy_open_connections",
    "Connections (TCP) currently relayed",
    ("service", "protocol"),
    per_port=lambda service, protocol: ((service, protocol),) if protocol == "TCP" else (),
)
BYTES = ScrapeCounter(
    "uproxy_bytes_total",
    "Bytes relayed; direction is to_endpoint or to_client",
    ("service", "direction"),
    per_port=lambda service, protocol: ((service, "to_endpoint"), (service, "to_client")),
)
DIAL_ATTEMPTS = ScrapeCounter(
    "uproxy_endpoint_dial_attempts_total",
    "Attempts to connect to an endpoint, by result",
    ("result",),
)
DIAL_DURATION = ScrapeHistogram(
    "uproxy_endpoint_dial_duration_seconds",
    "Time to connect to an endpoint (successful attempts)",
    buckets=_DIAL_BUCKETS,
)
UDP_FLOWS = ScrapeGauge(
    "uproxy_udp_flows",
    "UDP flows currently tracked",
    ("service",),
    per_port=lambda service, protocol: ((service,),) if protocol == "UDP" else (),
)
ACCEPT_PAUSED = ScrapeCounter(
    "uproxy_accept_paused_total",
    "Times accepting was paused, by reason (emfile, enfile, enobufs, enomem; fd_reserve: "
    "the free fds are held for dials in flight)",
    ("reason",),
)
NO_ENDPOINTS = ScrapeCounter(
    "uproxy_no_endpoints_total",
    "Connections or datagrams refused for lack of a usable endpoint",
    ("service", "traffic"),
    sparse=True,
)
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

# The families the metrics server writes itself, in this order, after prometheus_client's
# REGISTRY (which holds everything else above).
DATA_PLANE: tuple[ScrapeFamily, ...] = (
    CONNECTIONS,
    OPEN_CONNECTIONS,
    BYTES,
    DIAL_ATTEMPTS,
    DIAL_DURATION,
    UDP_FLOWS,
    NO_ENDPOINTS,
    ACCEPT_PAUSED,
)


def forget_service(service: str) -> None:
    """A service port was deleted: drop its series from every data-plane family.

    Label sets were kept across listener churn (a reopened listener counts on), but a
    deleted service's would pile up under churn: 4 to 7 series per service port, forever.
    """
    PROXIED.discard(service)
    for family in _BY_SERVICE:
        family.forget("service", service)


# The families with a service label (isinstance on an ABC, per family and deleted service,
# was a third of what forgetting a service cost a worker).
_BY_SERVICE = tuple(
    f for f in DATA_PLANE if isinstance(f, LabelledFamily) and "service" in f.labelnames
)


# Gauges say how things are now: a dead worker's open connections are gone, its counts stay.
GAUGES = (OPEN_CONNECTIONS, UDP_FLOWS)


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

    def retire(self, reader: SlotReader) -> None:
        """A worker is gone: keep its counters (its last state is in shared memory)."""
        reader.refresh()
        gauges = {g.name for g in GAUGES}
        for family, labels, value in reader.items():
            if family not in gauges:
                key = (family, labels)
                self._retired[key] = self._retired.get(key, 0.0) + value
                at = _service_label_at().get(family)
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
