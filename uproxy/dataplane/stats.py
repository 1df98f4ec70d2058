"""A proxy port's metric tallies, bound at its first connection or datagram.

A worker holds thousands of proxy ports and most of them are idle. Binding a label set in a
worker takes a shared-memory slot and a directory record (``counters``), and forgetting it
again a record more: done for four label sets when each listener opened, that was about
half of a worker's work per new port (10 of 23 us, and 7 of 15 us to forget it), during a
10,000-port sync that shares the worker's loop with its relays. So a port's tallies are bound
when it first has something to count; until then the control process writes its series at
zero (``series.PROXIED``), so a scrape shows the same series either way.

The label sets are those ``series`` lists as a port's ``per_port`` series (successes, bytes
both ways, open connections or UDP flows), plus the failure tallies, bound at their first
event (they are sparse: never written at zero).
"""

from __future__ import annotations

from uproxy.dataplane import series
from uproxy.model import ServicePortName, Traffic


class Stats:
    """Metric tallies for one listener; ``bind()`` before the first count.

    ``.labels()`` returns the label set's one tally, so the listeners of one service port
    (cluster and external traffic, each IP family) count into the same series.
    """

    __slots__ = (
        "_dial_failed",
        "_evicted",
        "_no_endpoints",
        "_refused",
        "bound",
        "bytes_to_client",
        "bytes_to_endpoint",
        "live",
        "ok",
        "protocol",
        "service",
        "traffic",
    )

    ok: series.AnyTally  # connections or flows accepted and dialed
    live: series.AnyTally  # open connections (TCP) or flows (UDP) now
    bytes_to_endpoint: series.AnyTally
    bytes_to_client: series.AnyTally

    def __init__(self, name: ServicePortName, traffic: Traffic) -> None:
        self.service = str(name)
        self.protocol = name.protocol.value
        self.traffic = traffic.value
        self.bound = False
        self._refused: series.AnyTally | None = None
        self._dial_failed: series.AnyTally | None = None
        self._no_endpoints: series.AnyTally | None = None
        self._evicted: series.AnyTally | None = None

    def bind(self) -> None:
        service, protocol = self.service, self.protocol
        self.ok = series.CONNECTIONS.labels(service, protocol, "ok")
        self.live = (
            series.UDP_FLOWS.labels(service)
            if protocol == "UDP"
            else series.OPEN_CONNECTIONS.labels(service, protocol)
        )
        self.bytes_to_endpoint = series.BYTES.labels(service, "to_endpoint")
        self.bytes_to_client = series.BYTES.labels(service, "to_client")
        self.bound = True

    @property
    def refused(self) -> series.AnyTally:
        """No endpoint to pick: the connection or datagram was refused."""
        if self._refused is None:
            self._refused = series.CONNECTIONS.labels(self.service, self.protocol, "no_endpoints")
        return self._refused

    @property
    def dial_failed(self) -> series.AnyTally:
        if self._dial_failed is None:
            self._dial_failed = series.CONNECTIONS.labels(
                self.service, self.protocol, "dial_failed"
            )
        return self._dial_failed

    @property
    def evicted(self) -> series.AnyTally:
        """A UDP flow dropped to make room for a new one (``--udp-max-flows``)."""
        if self._evicted is None:
            self._evicted = series.UDP_EVICTIONS.labels(self.service)
        return self._evicted

    @property
    def no_endpoints(self) -> series.AnyTally:
        if self._no_endpoints is None:
            self._no_endpoints = series.NO_ENDPOINTS.labels(self.service, self.traffic)
        return self._no_endpoints
