"""The metrics endpoint (``--metrics-bind-address``, 127.0.0.1:10249 by default).

The same paths as kube-proxy's metrics server, so scrape configs and probes carry over:
``/metrics`` (the prometheus-client default registry, rendered by its aiohttp handler on
the event loop — no exporter thread), ``/proxyMode`` (which proxy mode runs here) and
``/healthz`` (a plain "ok": the process answers HTTP; proxy health lives on the healthz
address).

A bind failure raises ``OSError`` with its errno so the caller can print one line naming
the cause (address in use, not an address of this host, no permission).
"""

from __future__ import annotations

import logging

from aiohttp import web
from prometheus_client import REGISTRY
from prometheus_client.aiohttp import make_aiohttp_handler

from uproxy.log import V3

log = logging.getLogger("uproxy.metrics_server")

PROXY_MODE = "userspace"

_TEXT_HEADERS = {
    "Content-Type": "text/plain; charset=utf-8",
    "X-Content-Type-Options": "nosniff",
}


class MetricsServer:
    """``/metrics``, ``/proxyMode`` and ``/healthz`` over HTTP (aiohttp, no access log)."""

    def __init__(self, *, address: str, port: int) -> None:
        self._address = address
        self._port = port
        self._runner: web.AppRunner | None = None

    @property
    def port(self) -> int:
        """The bound port (the real one when constructed with 0); 0 before start."""
        if self._runner is None or not self._runner.addresses:
            return 0
        return int(self._runner.addresses[0][1])

    async def start(self) -> None:
        """Bind and serve. A bind failure raises OSError with its errno, nothing left open."""
        if self._runner is not None:
            return
        app = web.Application()
        app.router.add_get("/metrics", make_aiohttp_handler(REGISTRY))
        app.router.add_route("*", "/proxyMode", _proxy_mode)
        app.router.add_route("*", "/healthz", _healthz)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        try:
            await web.TCPSite(runner, self._address or None, self._port).start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        log.log(V3, "Starting metrics HTTP server", extra={"kv": {"address": self._address}})

    async def close(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()


async def _proxy_mode(request: web.Request) -> web.Response:
    return web.Response(body=PROXY_MODE.encode(), headers=_TEXT_HEADERS)


async def _healthz(request: web.Request) -> web.Response:
    return web.Response(body=b"ok", headers=_TEXT_HEADERS)
