"""The aiohttp server behind /healthz, /livez and /metrics, with uproxy's conventions.

No access log, a quick shutdown, and clean bind errors: a bind
failure raises OSError with its errno intact and leaves nothing open, so the caller can turn
it into one line naming the flag and the address.

An unspecified address (``0.0.0.0`` or ``::``) listens in both IP families, as kube-proxy's
Go listener on ``0.0.0.0:10256`` does: on a node whose primary address is IPv6 the kubelet
probes ``/livez`` and load balancers ask ``/healthz`` over IPv6. (With port 0 each family
would get a port of its own, so there it stays one socket of the address's family.)
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence

from aiohttp import web

from uproxy.log import V3, kv

log = logging.getLogger("uproxy.httpserver")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Route = tuple[str, str, Handler]  # (method or "*", path, handler)

# How long a closing server waits for requests in flight. Its answers take microseconds; what
# waits is a client that does not read them, and each one added 2 s to the close of each
# server, one after another (12 s of a stop with five of them). kube-proxy closes at once.
SHUTDOWN_TIMEOUT_S = 0.25


class HttpServer:
    def __init__(self, *, name: str, address: str, port: int, routes: Sequence[Route]) -> None:
        self.name = name
        self._address = address
        self._port = port
        self._routes = tuple(routes)
        self._runner: web.AppRunner | None = None

    @property
    def port(self) -> int:
        """The bound port (the real one when constructed with 0); 0 before start."""
        if self._runner is None or not self._runner.addresses:
            return 0
        return int(self._runner.addresses[0][1])

    async def start(self) -> None:
        if self._runner is not None:
            return
        app = web.Application()
        for method, path, handler in self._routes:
            app.router.add_route(method, path, handler)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
        await runner.setup()
        host: str | None = self._address or None
        if self._port and host in (None, "0.0.0.0", "::"):  # not a host name: bind says
            host = None  # every family the host has: 0.0.0.0 and ::
        try:
            await web.TCPSite(runner, host, self._port).start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        log.log(V3, "Starting HTTP server", extra=kv(server=self.name, address=self._address))

    async def close(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
