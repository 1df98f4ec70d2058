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

from aiohttp import web
from prometheus_client import REGISTRY
from prometheus_client.aiohttp import make_aiohttp_handler

from uproxy.httpserver import HttpServer

PROXY_MODE = "userspace"

_TEXT_HEADERS = {
    "Content-Type": "text/plain; charset=utf-8",
    "X-Content-Type-Options": "nosniff",
}


class MetricsServer(HttpServer):
    """``/metrics``, ``/proxyMode`` and ``/healthz`` over HTTP."""

    def __init__(self, *, address: str, port: int) -> None:
        super().__init__(
            name="metrics",
            address=address,
            port=port,
            routes=[
                ("GET", "/metrics", make_aiohttp_handler(REGISTRY)),
                ("*", "/proxyMode", _proxy_mode),
                ("*", "/healthz", _healthz),
            ],
        )


async def _proxy_mode(request: web.Request) -> web.Response:
    return web.Response(body=PROXY_MODE.encode(), headers=_TEXT_HEADERS)


async def _healthz(request: web.Request) -> web.Response:
    return web.Response(body=b"ok", headers=_TEXT_HEADERS)
