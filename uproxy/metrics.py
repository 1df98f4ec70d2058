"""Every metric uproxy exports, defined in one place.

Control-plane metrics keep kube-proxy's names and meaning so existing dashboards work;
data-plane metrics are ``uproxy_*``. Labels are service ports, protocols and outcomes,
never client or endpoint addresses (unbounded cardinality). The data path binds its
label sets once per listener and counts per read, never per byte, into plain numbers that
become metric families only when /metrics is scraped (see ``Tally``).
"""

from __future__ import annotations

import platform
import time
from bisect import bisect_left
from collections.abc import Iterator

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, Info
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from uproxy import __version__

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


# --- scrape-time families for the data path ---
#
# prometheus_client's Counter takes a lock on every inc(): at ~7 increments per relayed TCP
# connection that was 6 % of the proxy's CPU in the connection-rate profile. The data path
# runs on the event loop thread only, so its counts are plain numbers on ``Tally`` objects
# (one per label set, shared by every listener of that label set, kept for the life of the
# process like a prometheus child, so a closed listener's totals stay in the family) and
# are turned into metric families when /metrics is scraped (served on the same loop).
# Names, types, label sets and meaning are those of the Counter/Gauge/Histogram they replace.


class Tally:
    """One label set's value; the data path adds to ``value`` directly."""

    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value: float = 0
        self.created = time.time()


class _ScrapeFamily(Collector):
    kind = "untyped"

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = labelnames
        self._tallies: dict[tuple[str, ...], Tally] = {}

    def labels(self, *values: str) -> Tally:
        """The tally of one label set (created at zero on first use, then reused)."""
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {values}")
        tally = self._tallies.get(values)
        if tally is None:
            tally = self._tallies[values] = Tally()
        return tally

    def _family(self) -> Metric:
        raise NotImplementedError

    def describe(self) -> list[Metric]:
        return [self._family()]

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        for values, tally in list(self._tallies.items()):
            self._add(family, list(values), tally)
        yield family

    def _add(self, family: Metric, values: list[str], tally: Tally) -> None:
        raise NotImplementedError


class ScrapeCounter(_ScrapeFamily):
    """A labelled counter read at scrape time (see ``Tally``)."""

    def _family(self) -> Metric:
        return CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def _add(self, family: Metric, values: list[str], tally: Tally) -> None:
        if isinstance(family, CounterMetricFamily):
            family.add_metric(values, tally.value, created=tally.created)


class ScrapeGauge(_ScrapeFamily):
    """A labelled gauge read at scrape time (see ``Tally``)."""

    def _family(self) -> Metric:
        return GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def _add(self, family: Metric, values: list[str], tally: Tally) -> None:
        if isinstance(family, GaugeMetricFamily):
            family.add_metric(values, tally.value)


class ScrapeHistogram(Collector):
    """An unlabelled histogram whose ``observe`` is a bisect and two additions."""

    def __init__(self, name: str, documentation: str, *, buckets: tuple[float, ...]) -> None:
        self.name = name
        self.documentation = documentation
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        self.counts[bisect_left(self.bounds, amount)] += 1
        self.sum += amount

    def describe(self) -> list[Metric]:
        return [HistogramMetricFamily(self.name, self.documentation)]

    def collect(self) -> Iterator[Metric]:
        cumulative = 0
        buckets: list[tuple[str, float]] = []
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            cumulative += n
            buckets.append((_float_text(bound), cumulative))
        family = HistogramMetricFamily(self.name, self.documentation)
        family.add_metric([], buckets, self.sum)
        family.samples.append(Sample(self.name + "_created", {}, self.created))
        yield family


def _float_text(bound: float) -> str:
    # prometheus_client's spelling of bucket bounds ("0.001", "1.0", "+Inf").
    if bound == float("inf"):
        return "+Inf"
    return repr(float(bound))


# --- data plane ---
CONNECTIONS = ScrapeCounter(
    "uproxy_connections_total",
    "Connections (TCP) and flows (UDP) accepted, by outcome",
    ("service", "protocol", "result"),
)
OPEN_CONNECTIONS = ScrapeGauge(
    "uproxy_open_connections",
    "Connections (TCP) currently relayed",
    ("service", "protocol"),
)
BYTES = ScrapeCounter(
    "uproxy_bytes_total",
    "Bytes relayed; direction is to_endpoint or to_client",
    ("service", "direction"),
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
UDP_FLOWS = ScrapeGauge("uproxy_udp_flows", "UDP flows currently tracked", ("service",))
ACCEPT_PAUSED = Counter(
    "uproxy_accept_paused_total",
    "Times accepting was paused, by reason (emfile, enfile, enobufs, enomem; fd_reserve: "
    "the free fds are held for dials in flight)",
    ["reason"],
)
NO_ENDPOINTS = ScrapeCounter(
    "uproxy_no_endpoints_total",
    "Connections or datagrams refused for lack of a usable endpoint",
    ("service", "traffic"),
)
for _family in (
    CONNECTIONS,
    OPEN_CONNECTIONS,
    BYTES,
    DIAL_ATTEMPTS,
    DIAL_DURATION,
    UDP_FLOWS,
    NO_ENDPOINTS,
):
    REGISTRY.register(_family)
BUILD_INFO = Info("uproxy_build", "uproxy build information")
BUILD_INFO.info({"version": __version__, "python": platform.python_version()})
