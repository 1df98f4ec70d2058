"""Proxy health: is uproxy keeping up with the cluster, and should this node take traffic?

Load balancers and the kubelet ask ``/healthz`` and ``/livez`` (``--healthz-bind-address``,
0.0.0.0:10256 by default). The answer follows kube-proxy's ``proxier_health.go`` so that
existing probes, cloud load balancer checks and dashboards keep working unchanged:

- A sync that was queued but has not finished within 2 x the sync period makes the proxy
  *stale*: its rules may no longer match the cluster. Only the oldest pending request
  counts, so a steady stream of changes that are processed in time never looks stale.
  A sync answers only the requests made before it started: one queued while a sync is
  running waits for the next, and is stale if that one hangs.
- Before the first sync nothing is queued, so a starting proxy is healthy; this is
  kube-proxy's behaviour and keeps a rolling restart from failing every node at once.
- ``/healthz`` is also 503 while this Node is being deleted (or tainted for deletion), so
  load balancers drain it; ``/livez`` ignores the node, so the kubelet does not restart a
  proxy that is merely on its way out.

A queued sync ages by the monotonic clock, as kube-proxy's Go times do: a step of the wall
clock (an NTP correction, a VM resumed) is no time a sync waited. The wall clock only gives
the times the answers report. Both are injected so tests can move time.
"""

from __future__ import annotations

import datetime
import json
import logging
import time
from collections.abc import Callable

from aiohttp import web

from uproxy import metrics
from uproxy.httpserver import HttpServer

log = logging.getLogger("uproxy.health")

# Go's zero time, which kube-proxy reports as lastUpdated before the first sync.
_ZERO_TIME = "0001-01-01T00:00:00Z"


def rfc3339(ts: float) -> str:
    """``2024-05-01T12:00:00.123456Z``: RFC 3339 in UTC, as Go marshals a time.Time to
    JSON (kube-proxy prints Go's own time.Time text here; tools read the keys, and RFC 3339
    is what any of them parses)."""
    moment = datetime.datetime.fromtimestamp(ts, tz=datetime.UTC)
    text = moment.strftime("%Y-%m-%dT%H:%M:%S.%f").rstrip("0").rstrip(".")
    return text + "Z"


class ProxyHealth:
    """The proxy's own health, fed by the syncer and read by the HTTP handlers.

    Every method is cheap and synchronous: the syncer calls ``queued``/``updated`` on each
    change and sync, and the HTTP handlers and health-check node ports read ``healthy``.
    """

    __slots__ = (
        "_ages",
        "_clock",
        "_last_updated",
        "_missing_workers",
        "_node_eligible",
        "_oldest_queued",
        "_oldest_taken",
        "_stopping",
        "_timeout_s",
    )

    def __init__(
        self,
        *,
        sync_period_s: float,
        clock: Callable[[], float] = time.time,
        ages: Callable[[], float] = time.monotonic,
    ) -> None:
        """``clock``: the wall clock the answers report (as ``time.time``); ``ages``: the
        clock queued syncs age by (as ``time.monotonic``)."""
        if sync_period_s <= 0:
            raise ValueError(f"sync_period_s must be positive, got {sync_period_s}")
        self._timeout_s = 2.0 * sync_period_s
        self._clock = clock
        self._ages = ages
        self._oldest_queued: float | None = None
        self._last_updated: float | None = None
        self._node_eligible = True
        # The oldest request the running sync (or a failed one before it) took.
        self._oldest_taken: float | None = None
        self._stopping = False
        self._missing_workers = 0

    @property
    def timeout_s(self) -> float:
        """How long a queued sync may wait before the proxy counts as stale."""
        return self._timeout_s

    @property
    def last_updated(self) -> float | None:
        """When the last sync finished (wall-clock seconds), or None before the first one."""
        return self._last_updated

    @property
    def node_eligible(self) -> bool:
        return self._node_eligible

    def queued(self) -> None:
        """A sync was queued; only the oldest one not yet done is remembered."""
        if self._oldest_queued is None:
            self._oldest_queued = self._ages()

    def started(self) -> None:
        """A sync is taking every change queued so far; later ones wait for the next sync.

        A sync that fails keeps what it took: the retry answers it, and until then the
        oldest request keeps counting.
        """
        if self._oldest_taken is None:
            self._oldest_taken = self._oldest_queued
        self._oldest_queued = None

    def updated(self) -> None:
        """A sync finished: every request made before it started is done."""
        self._oldest_taken = None
        self._last_updated = self._clock()

    def set_node_eligible(self, eligible: bool) -> None:
        """False while this Node is being deleted or is tainted for deletion."""
        if eligible != self._node_eligible:
            log.info("Node eligibility changed", extra={"kv": {"eligible": eligible}})
        self._node_eligible = eligible

    def set_stopping(self) -> None:
        """uproxy is stopping (draining): load balancers should send nothing new here."""
        self._stopping = True

    @property
    def stopping(self) -> bool:
        return self._stopping

    def set_missing_workers(self, count: int) -> None:
        """Data-plane workers that died and could not be started again (out of fds or
        memory). While one is missing, its share of the connections (a UDP flow's
        datagrams, a ClientIP client's connections) has nobody to serve it: load balancers
        should send nothing new here. /livez stays as it is: the control process works."""
        self._missing_workers = count

    def serving(self) -> bool:
        """Live, not stopping, and every data-plane worker running: what health-check node
        ports answer for the proxy."""
        return not self._stopping and not self._missing_workers and self.live()

    def _fresh(self, now: float) -> bool:
        # Taken before queued, so when both are set the taken one is the older.
        oldest = self._oldest_taken if self._oldest_taken is not None else self._oldest_queued
        return oldest is None or now - oldest < self._timeout_s

    def live(self) -> bool:
        """Not stale: no queued sync older than 2 x the sync period (the node is ignored)."""
        return self._fresh(self._ages())

    def healthy(self) -> bool:
        """Serving (see ``serving``) and this node is not being deleted."""
        return self._node_eligible and self.serving()

    def report(self, *, include_node: bool) -> tuple[bool, dict[str, object]]:
        """The verdict and the JSON body of ``/healthz`` (include_node) or ``/livez``.

        As in kube-proxy, a healthy answer reports ``lastUpdated`` as the current time
        (older clients read it as "the sync loop ran recently"); an unhealthy one reports
        the real time of the last finished sync.
        """
        now = self._clock()
        ok = self._fresh(self._ages())
        eligible = self._node_eligible
        if include_node:
            ok = ok and eligible and not self._stopping and not self._missing_workers
        if ok:
            last = rfc3339(now)
        elif self._last_updated is None:
            last = _ZERO_TIME
        else:
            last = rfc3339(self._last_updated)
        body: dict[str, object] = {"lastUpdated": last, "currentTime": rfc3339(now)}
        if include_node:
            body["nodeEligible"] = eligible
        return ok, body


_JSON_HEADERS = {"Content-Type": "application/json", "X-Content-Type-Options": "nosniff"}


class HealthzServer(HttpServer):
    """``/healthz`` and ``/livez`` over HTTP."""

    def __init__(self, *, proxy_health: ProxyHealth, address: str, port: int) -> None:
        self._health = proxy_health
        super().__init__(
            name="healthz",
            address=address,
            port=port,
            routes=[("*", "/healthz", self._healthz), ("*", "/livez", self._livez)],
        )

    async def _healthz(self, request: web.Request) -> web.Response:
        ok, body = self._health.report(include_node=True)
        metrics.HEALTHZ_TOTAL.labels(code="200" if ok else "503").inc()
        return _json_response(ok, body)

    async def _livez(self, request: web.Request) -> web.Response:
        ok, body = self._health.report(include_node=False)
        metrics.LIVEZ_TOTAL.labels(code="200" if ok else "503").inc()
        return _json_response(ok, body)


def _json_response(ok: bool, body: dict[str, object]) -> web.Response:
    return web.Response(
        status=200 if ok else 503,
        body=json.dumps(body).encode(),
        headers=_JSON_HEADERS,
    )
