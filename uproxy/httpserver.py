"""The aiohttp server behind /healthz, /livez and /metrics, with uproxy's conventions.

No access log, a quick shutdown, and clean bind errors: a bind
failure raises OSError with its errno intact and leaves nothing open, so the caller can turn
it into one line naming the flag and the address. Idle keep-alive connections are closed
after a minute, and answers name no interpreter or library version (``Server: uproxy``,
where kube-proxy's Go servers send none): health checks are often reachable from outside
the node.

An unspecified address (``0.0.0.0`` or ``::``) listens in both IP families, as kube-proxy's
Go listener on ``0.0.0.0:10256`` does: on a node whose primary address is IPv6 the kubelet
probes ``/livez`` and load balancers ask ``/healthz`` over IPv6. (With port 0 each family
would get a port of its own, so there it stays one socket of the address's family.)
"""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence

from aiohttp import hdrs, web

from uproxy.log import V3, kv

log = logging.getLogger("uproxy.httpserver")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Route = tuple[str, str, Handler]  # (method or "*", path, handler)

# How long a closing server waits for requests in flight. Its answers take microseconds; what
# waits is a client that does not read them, and each one added 2 s to the close of each
# server, one after another (12 s of a stop with five of them). kube-proxy closes at once.
SHUTDOWN_TIMEOUT_S = 0.25
# How long an idle keep-alive connection is kept. aiohttp's own is an hour: 300 idle
# connections to /healthz held 300 of the control process's fds for that long. A minute
# keeps a scraper's or a load balancer's connection between its requests.
KEEPALIVE_S = 60.0
SERVER = "uproxy"  # the Server header, in place of aiohttp's interpreter and library versions
BACKLOG = 128  # aiohttp's own


def listen_all(
    addresses: Sequence[str], port: int, *, check: Callable[[socket.socket], None] | None = None
) -> list[socket.socket]:
    """A listening socket on ``port`` at each address (IP literals); OSError (all closed
    again) when one cannot be had: the port is taken, or no fd is left. ``check`` may refuse
    a socket (OSError) before it is bound.

    Bound here rather than by ``loop.create_server``, which skips an address whose socket
    it cannot create (it takes that for an unsupported family): out of fds, a server came up
    listening nowhere, was reported open, and was never tried again.
    """
    socks: list[socket.socket] = []
    try:
        for address in addresses:
            try:
                socks.append(_listen(address, port, check))
            except OSError as e:  # which address, as kube-proxy's "listen tcp ADDRESS: ..."
                raise OSError(e.errno, f"cannot listen on {address}: {e.strerror or e}") from None
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


def _listen(
    address: str, port: int, check: Callable[[socket.socket], None] | None
) -> socket.socket:
    flags = socket.AI_NUMERICHOST | socket.AI_PASSIVE
    family, kind, proto, _, sockaddr = socket.getaddrinfo(
        address, port, type=socket.SOCK_STREAM, flags=flags
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        if check is not None:
            check(sock)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:  # "::" is IPv6 only: "0.0.0.0" has its own socket
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(sockaddr)
        sock.listen(BACKLOG)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


async def _name_server(request: web.Request, response: web.StreamResponse) -> None:
    response.headers[hdrs.SERVER] = SERVER


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
        socks = self._listen()
        app = web.Application()
        app.on_response_prepare.append(_name_server)
        for method, path, handler in self._routes:
            app.router.add_route(method, path, handler)
        runner = web.AppRunner(
            app, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S, keepalive_timeout=KEEPALIVE_S
        )
        try:
            await runner.setup()
            while socks:
                await web.SockSite(runner, socks[0]).start()
                socks.pop(0)
        except BaseException:
            await runner.cleanup()
            for sock in socks:  # those no site took
                sock.close()
            raise
        self._runner = runner
        log.log(V3, "Starting HTTP server", extra=kv(server=self.name, address=self._address))

    def _listen(self) -> list[socket.socket]:
        address = self._address or "0.0.0.0"
        if not self._port or address not in ("0.0.0.0", "::"):
            return listen_all([address], self._port)
        # Every family the host has: 0.0.0.0 and ::, the latter unless IPv6 is off.
        socks = listen_all(["0.0.0.0"], self._port)
        try:
            socks += listen_all(["::"], self._port)
        except OSError as e:
            if e.errno != errno.EAFNOSUPPORT:
                for sock in socks:
                    sock.close()
                raise
        return socks

    async def close(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
