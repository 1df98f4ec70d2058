"""The metrics endpoint (``--metrics-bind-address``, 127.0.0.1:10249 by default).

The same paths as kube-proxy's metrics server, so scrape configs and probes carry over:
``/metrics``, ``/proxyMode`` (which proxy mode runs here) and ``/healthz`` (a plain "ok": the
process answers HTTP; proxy health lives on the healthz address).

/metrics is served from the control process's event loop, which also answers the health-check
node ports and /healthz and carries watch events to the workers, so a scrape must never hold
the loop for long. (It was written when that loop also relayed every byte, before the data
plane moved to worker processes.) prometheus_client's aiohttp handler rendered the whole
exposition in one synchronous block: at 10,000 service ports, 12-13 MB (130,000 lines) in
1-2 s, during which every relay stalled (a connection waited 1.9 s behind one scrape). Here:

* The data plane's families (``uproxy.metrics.DATA_PLANE``, all but a few hundred bytes of
  the body) are written by their own ``text()`` (prefixes built once per label set, see
  ``uproxy.metrics``), and streamed: after ``SLICE_S`` of work the handler writes what it
  has and lets the loop run (``asyncio.sleep(0)``) before the next slice, so relays run
  between slices. Each family is iterated over a snapshot of its label sets: listeners that
  open mid-scrape appear in the next one.
* The control plane's registry (prometheus_client's, a few dozen series) is rendered by
  ``generate_latest`` in one go (~1 ms). Its ``process_open_fds`` used to list /proc/self/fd:
  10 ms at 12,000 fds (10,000 listeners), so uproxy.metrics has its own process collector.
* Format: the text format 0.0.4 (``text/plain; version=0.0.4``) whatever ``Accept`` says.
  Prometheus lists it in every Accept header it sends (2.x and 3.x) and so takes it, and
  kube-proxy's Go handler falls back to it the same way. OpenMetrics, which the old handler
  chose when asked, is not served: a scraper gains nothing from it here (no exemplars, no
  created timestamps), and one format means one writer to keep right.
* gzip when the client accepts it (Prometheus always does), at level 1, compressed chunk by
  chunk inside the slice budget: a body 7.5x smaller for ~10 ms more CPU (below).
* A client that goes away mid-body ends its scrape at the next write; concurrent scrapes each
  have their own snapshots and compressor.

Measured: one scrape at 10,000 TCP listeners' label sets (70,000 bound, values set, 1 % of
the failure series non-zero), 12,000 open fds, uvloop, the client in another process; the
old handler and this one in alternate child processes, 5 rounds x 3 scrapes, medians (two
runs), on 2 cores shared with other work (load ~3.5). "Stall" is the longest round trip of
a datagram that a third process sent every 1 ms to an echo on the loop: on this busy
machine the idle loop already showed 1-10 ms, so below ~10 ms it is mostly noise; "slice"
is the longest stretch of scrape work between two turns of the loop (loop-thread CPU).

    request                CPU           stall             slice    body
    old, plain             911-925 ms    1,095-1,158 ms    -        13.3 MB
    old, Prometheus'       1,437-1,445 ms 1,669-1,723 ms    -        0.9 MB (OpenMetrics, gzip 6)
    new, plain             14-15 ms      3.8-5.8 ms        2.6 ms   3.6 MB
    new, Prometheus'       24-25 ms      3.3 ms            2.3 ms   0.5 MB (gzip 1)
    new, zeros written     21-22 ms      6.1-6.3 ms        2.8 ms   6.4 MB (no sparse series)
    new, library's fds     25-26 ms      15-27 ms          2.6 ms   3.6 MB (lists /proc/self/fd)

A bind failure raises ``OSError`` with its errno so the caller can print one line naming
the cause (address in use, not an address of this host, no permission).
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence

from aiohttp import hdrs, web
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.registry import Collector

from uproxy import heap
from uproxy.httpserver import HttpServer
from uproxy.log import V3, kv
from uproxy.metrics import DATA_PLANE, ScrapeFamily

log = logging.getLogger("uproxy.metrics_server")

PROXY_MODE = "userspace"

# Work done between two turns of the loop during a scrape (render, encode, compress); one
# chunk (uproxy.metrics.SERIES_PER_CHUNK series, ~0.12 ms) may overshoot it. At 10,000
# listeners a scrape is then ~8 slices, each a write and a loop turn (~0.05 ms): a smaller
# budget buys a lower worst-case delay for more turns.
SLICE_S = 0.002

# At 10,000 listeners (3.6 MB): level 1 compressed in 12 ms to 0.48 MB, level 6 (zlib's
# default) in 36 ms to 0.41 MB.
GZIP_LEVEL = 1

_TEXT_HEADERS = {
    "Content-Type": "text/plain; charset=utf-8",
    "X-Content-Type-Options": "nosniff",
}


class MetricsServer(HttpServer):
    """``/metrics``, ``/proxyMode`` and ``/healthz`` over HTTP.

    ``registry`` and ``families`` are what /metrics serves (prometheus_client's default
    registry and uproxy's data-plane families unless a test gives its own).
    """

    def __init__(
        self,
        *,
        address: str,
        port: int,
        registry: Collector = REGISTRY,
        families: Sequence[ScrapeFamily] = DATA_PLANE,
        before_scrape: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._registry = registry
        self._families = tuple(families)
        # With data-plane workers: adds up their shared-memory counters into ``families``.
        self._before_scrape = before_scrape
        super().__init__(
            name="metrics",
            address=address,
            port=port,
            routes=[
                ("GET", "/metrics", self._metrics),
                ("HEAD", "/metrics", _metrics_head),
                ("*", "/proxyMode", _proxy_mode),
                ("*", "/healthz", _healthz),
            ],
        )

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        body = _Body(gzip=accepts_gzip(request.headers.getall(hdrs.ACCEPT_ENCODING, [])))
        if self._before_scrape is not None:
            await self._before_scrape()
        control = generate_latest(self._registry)  # ~1 ms: a few dozen series
        response = web.StreamResponse(headers=body.headers())
        await response.prepare(request)
        try:
            await response.write(body.feed(control))
            for piece in _slices(self._families, body):
                await response.write(piece)
                await asyncio.sleep(0)  # the relays' turn
            await response.write_eof(body.finish())
        except ConnectionError:  # the client went away; aiohttp closes the connection
            log.log(V3, "Metrics client left mid-scrape", extra=kv(remote=request.remote))
        # A scrape at 10,000 service ports frees megabytes of text and totals between
        # chunks that stay: without a trim, the control process kept ~4 MiB more after its
        # first scrape. About 1 ms, once per scrape.
        heap.trim()
        return response


def _slices(families: Iterable[ScrapeFamily], body: _Body) -> Iterator[bytes]:
    """The families' text, encoded, cut after every ``SLICE_S`` of work."""
    parts: list[bytes] = []
    started = time.perf_counter()
    for family in families:
        for text in family.text():
            parts.append(body.feed(text.encode()))
            if time.perf_counter() - started >= SLICE_S:
                yield b"".join(parts)
                parts = []
                started = time.perf_counter()  # the caller's write and the loop's turn excluded
    yield b"".join(parts)


class _Body:
    """The body's content coding: identity, or gzip when the client accepts it."""

    __slots__ = ("_gzip",)

    def __init__(self, *, gzip: bool) -> None:
        self._gzip = (
            zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, 16 + zlib.MAX_WBITS) if gzip else None
        )

    def headers(self) -> dict[str, str]:
        headers: dict[str, str] = {
            hdrs.CONTENT_TYPE: CONTENT_TYPE_PLAIN_0_0_4,
            hdrs.VARY: hdrs.ACCEPT_ENCODING,
        }
        if self._gzip is not None:
            headers[hdrs.CONTENT_ENCODING] = "gzip"
        return headers

    def feed(self, data: bytes) -> bytes:
        return data if self._gzip is None else self._gzip.compress(data)

    def finish(self) -> bytes:
        return b"" if self._gzip is None else self._gzip.flush()


def accepts_gzip(accept_encoding: Iterable[str]) -> bool:
    """Whether ``Accept-Encoding`` values name gzip with a non-zero quality."""
    for item in ",".join(accept_encoding).split(","):
        coding, *params = item.split(";")
        if coding.strip().lower() != "gzip":
            continue
        for param in params:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    return float(value) > 0
                except ValueError:
                    return False
        return True
    return False


async def _metrics_head(request: web.Request) -> web.Response:
    """A HEAD (an availability check) is answered without rendering a scrape."""
    return web.Response(headers={hdrs.CONTENT_TYPE: CONTENT_TYPE_PLAIN_0_0_4})


async def _proxy_mode(request: web.Request) -> web.Response:
    return web.Response(body=PROXY_MODE.encode(), headers=_TEXT_HEADERS)


async def _healthz(request: web.Request) -> web.Response:
    return web.Response(body=b"ok", headers=_TEXT_HEADERS)
