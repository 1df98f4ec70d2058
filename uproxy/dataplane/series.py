"""The data plane's metric families: what a worker counts, and how a scrape writes it.

``uproxy.metrics`` says why there are two kinds of metric and why these are not
prometheus_client's. They live in a module of their own so that a data-plane worker, which
only counts, never loads prometheus_client: 4 MiB of a worker's memory and a third of its
imports. The control process reads and renders them (``uproxy.metrics`` imports them from
here); a family describes itself with prometheus_client's types for the docs only.
"""

from __future__ import annotations

import ctypes
import mmap
from abc import ABC, abstractmethod
from bisect import bisect_left
from collections.abc import Callable, Collection, Iterator, Mapping, MutableSequence, Sequence
from typing import TYPE_CHECKING

from uproxy.dataplane.counters import CountersFull, Labels, SlotWriter

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

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


class SharedTally(ctypes.c_double):
    """A worker's label set: its ``value`` is a float64 slot of shared memory (see ``share``).

    A ctypes double laid over the slot (``from_buffer``), so reading and writing ``value``
    are C-level descriptors, not Python frames: ``value += 1`` takes 70 ns against 154 ns
    for a property over a memoryview (timeit), and a relayed connection makes six or seven
    updates. An instance is ~490 bytes against ~90 (it holds a view of the mapping), paid
    only for the label sets of ports that have counted something (``Stats``).
    """

    __slots__ = ("slot",)
    slot: int

    @classmethod
    def at(cls, buffer: mmap.mmap, slot: int) -> SharedTally:
        tally = cls.from_buffer(buffer, slot * 8)
        tally.slot = slot
        return tally

    def __del__(self) -> None:
        # Its label set forgotten (a deleted service) and nothing left counting into it:
        # the slot may name another label set now (``SlotWriter.release``).
        if _shared is not None:
            _shared.release(self.slot)


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
    writer.live = _live_bindings


def _live_bindings() -> Iterator[tuple[int, str, tuple[str, ...]]]:
    """Every label set this worker has bound and not forgotten, with its slot: what a
    rewrite of the directory keeps (``SlotWriter.compact``)."""
    yield from DIAL_DURATION.bindings()
    for family in DATA_PLANE:
        if isinstance(family, LabelledFamily):
            for values, tally in family.series():
                if isinstance(tally, SharedTally):
                    yield tally.slot, family.name, values


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
                return SharedTally.at(_shared.buffer, _shared.new_slot(self.name, values))
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
        from prometheus_client.metrics_core import CounterMetricFamily

        return [CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)]


class ScrapeGauge(LabelledFamily):
    """A labelled gauge read at scrape time (see ``Tally``)."""

    kind = "gauge"

    def describe(self) -> list[Metric]:
        from prometheus_client.metrics_core import GaugeMetricFamily

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

    def bindings(self) -> Iterator[tuple[int, str, tuple[str, ...]]]:
        """Its slots with their label sets, once ``share``d (see ``_live_bindings``)."""
        if _shared is not None and self._store is _shared.values:
            count = len(self.bounds) + 1
            yield from ((self._base + i, self.name, (str(i),)) for i in range(count))
            yield self._base + count, self.name, ("sum",)

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
        from prometheus_client.metrics_core import HistogramMetricFamily

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


# --- the families ---
# Failures: written from their first event on (see "Sparse label sets" in uproxy.metrics).
_FAILED_RESULTS = {"result": ("no_endpoints", "dial_failed")}


class ProxiedPorts:
    """The service ports the control process proxies, by ``service`` label, with their
    protocol: their always-written series are in every scrape, at zero until bound (see
    "Always written, but not bound until used" in ``uproxy.metrics``). The service label
    comes first in every family that has one."""

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
UDP_EVICTIONS = ScrapeCounter(
    "uproxy_udp_flow_evictions_total",
    "UDP flows dropped before their idle timeout to make room for a new one: the service "
    "port's flow table was full (--udp-max-flows, per worker)",
    ("service",),
    sparse=True,
)
ACCEPT_PAUSED = ScrapeCounter(
    "uproxy_accept_paused_total",
    "Times accepting was paused, by reason (emfile, enfile, enobufs, enomem; fd_reserve: "
    "the free fds are held for dials in flight)",
    ("reason",),
)
NO_ENDPOINTS = ScrapeCounter(
    "uproxy_no_endpoints_total",
    "Connections reset or datagrams dropped for lack of a usable endpoint (on a node the "
    "rules refuse those before they reach uproxy, once a rules sync has caught up)",
    ("service", "traffic"),
    sparse=True,
)
ENDPOINT_EJECTIONS = ScrapeCounter(
    "uproxy_endpoint_ejections_total",
    "Times an endpoint was left out of the choice after failed dials (--endpoint-eject-after)",
    ("service",),
    sparse=True,
)
CONNECTION_ERRORS = ScrapeCounter(
    "uproxy_connection_errors_total",
    "Relayed TCP connections ended by an error on one side, the other side then reset: side "
    "is client or endpoint; error is reset (the peer reset it), timeout (keep-alive probes or "
    "retransmissions went unanswered: the peer is gone), unreachable or other",
    ("service", "side", "error"),
    sparse=True,
)

# The families the metrics server writes itself, in this order, after prometheus_client's
# REGISTRY (which holds the control plane's, ``uproxy.metrics``).
DATA_PLANE: tuple[ScrapeFamily, ...] = (
    CONNECTIONS,
    OPEN_CONNECTIONS,
    BYTES,
    DIAL_ATTEMPTS,
    DIAL_DURATION,
    UDP_FLOWS,
    UDP_EVICTIONS,
    NO_ENDPOINTS,
    ENDPOINT_EJECTIONS,
    CONNECTION_ERRORS,
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
