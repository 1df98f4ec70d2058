"""Fixtures for data-plane tests: uvloop, backends on loopback, listeners, bounded waits."""

from __future__ import annotations

import _socket
import asyncio
import dataclasses
import fcntl
import hashlib
import os
import select
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
import uvloop

from uproxy.dataplane import fdreserve, relay
from uproxy.dataplane.balancer import Balancer
from uproxy.dataplane.settings import DataplaneSettings
from uproxy.dataplane.tcp import TcpListener
from uproxy.dataplane.udp import UdpListener
from uproxy.model import Endpoint, LbAlgorithm, Protocol, ServicePort, ServicePortName, Traffic

TCP_NAME = ServicePortName("default", "web", "http", Protocol.TCP)
UDP_NAME = ServicePortName("default", "dns", "dns", Protocol.UDP)
NODE = "node-a"


def pytest_asyncio_loop_factories(config: Any, item: Any) -> Mapping[str, Callable[[], Any]]:
    # Every data-plane test runs on uvloop (what uproxy runs on) and on asyncio's own loop
    # (its fallback): they order timers, I/O and callbacks differently, and the relay must
    # be right on both. UPROXY_TEST_LOOP=uvloop or =asyncio picks one.
    loops: dict[str, Callable[[], Any]] = {
        "uvloop": uvloop.new_event_loop,
        "asyncio": asyncio.new_event_loop,
    }
    only = os.environ.get("UPROXY_TEST_LOOP")
    return {only: loops[only]} if only in loops else loops


@pytest.fixture(autouse=True)
async def loop_errors() -> AsyncIterator[list[dict[str, Any]]]:
    """Fail a test whose loop reported an error (e.g. "Fatal error on transport")."""
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    yield errors
    loop.set_exception_handler(previous)
    assert not errors, [e.get("message") for e in errors]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def wait_until(
    predicate: Callable[[], bool], *, timeout: float = 5.0, what: str = "condition"
) -> None:
    """Poll ``predicate`` every 10 ms; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


def relay_state(listener: TcpListener) -> str:
    """What each of ``listener``'s pairs holds and waits for, for a test that saw a relay
    stop moving: each side's flags, what its socket has queued each way, and the events the
    epoll set watches on it (from /proc: ``events`` is the mask, EPOLLET included)."""
    watched: dict[int, str] = {}
    epfd = listener.poller.fileno()
    with open(f"/proc/self/fdinfo/{epfd}") as info:
        for line in info:
            if line.startswith("tfd:"):
                parts = line.split()
                watched[int(parts[1])] = parts[3]
    pending = bool(select.select([epfd], [], [], 0)[0])
    lines = [f"epoll fd {epfd}: events pending={pending}"]
    for conn in list(listener._conns):
        for name, side in (("client", conn), ("endpoint", conn.peer or conn.dialing)):
            if side is None:
                lines.append(f"  {name}: none")
                continue
            pipe = side.pipe
            queued = ""
            if side.sock is not None:
                unread = _unread(side.sock)
                queued = f"unread={unread} unsent={relay._unsent(side.sock)}"
            lines.append(
                f"  {name} fd={side.fd} watched={watched.get(side.fd)} readable={side.readable}"
                f" rdhup={side.rdhup} eof={side.eof} done={side.done}"
                f" out={None if side.out is None else len(side.out)}"
                f" pipe={None if pipe is None else (pipe.held, pipe.muted, pipe.small_wakes)}"
                f" writes_watched={side.writes_watched} until_splice={side.until_splice}"
                f" {queued}"
            )
    return "\n".join(lines)


def digest(data: bytes) -> tuple[int, str]:
    return len(data), hashlib.sha256(data).hexdigest()


class _Echo(asyncio.Protocol):
    """Echoes everything; on EOF sends its own EOF. Optionally greets with its id first."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.backend.accepted += 1
        self.backend.open += 1
        self.backend.transports.add(transport)  # type: ignore[arg-type]
        if self.backend.greet:
            transport.write(self.backend.ident + b"\n")  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)

    def eof_received(self) -> bool:
        return False  # close: flushes what was echoed, then sends our FIN

    def connection_lost(self, exc: Exception | None) -> None:
        self.backend.open -= 1
        if self.transport is not None:
            self.backend.transports.discard(self.transport)


@dataclass
class Backend:
    ident: bytes
    host: str = "127.0.0.1"
    greet: bool = False
    port: int = 0
    accepted: int = 0
    open: int = 0
    server: asyncio.AbstractServer | None = field(default=None, repr=False)
    transports: set[asyncio.Transport] = field(default_factory=set, repr=False)

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(self.host, self.port, node_name=NODE)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(
            lambda: _Echo(self), self.host, self.port, backlog=1024
        )
        self.port = self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            for t in list(self.transports):
                t.abort()
            await self.server.wait_closed()


BackendFactory = Callable[..., Awaitable[Backend]]


@pytest.fixture
async def backends() -> AsyncIterator[BackendFactory]:
    started: list[Backend] = []

    async def make(ident: str, *, host: str = "127.0.0.1", greet: bool = False) -> Backend:
        b = Backend(ident.encode(), host=host, greet=greet)
        await b.start()
        started.append(b)
        return b

    yield make
    for b in started:
        await b.stop()


def make_balancer(
    name: ServicePortName,
    endpoints: list[Endpoint],
    *,
    settings: DataplaneSettings,
    algorithm: LbAlgorithm = LbAlgorithm.ROUND_ROBIN,
    affinity_s: int | None = None,
    clock: Callable[[], float] = time.monotonic,
    seed: int = 7,
) -> Balancer:
    import random

    b = Balancer(
        name,
        settings=dataclasses.replace(settings, node_name=NODE, default_algorithm=algorithm),
        clock=clock,
        rng=random.Random(seed),
    )
    b.update(ServicePort(name=name, port=80, affinity_timeout_s=affinity_s), endpoints)
    return b


ListenerFactory = Callable[..., Awaitable[TcpListener]]
UdpListenerFactory = Callable[..., Awaitable[UdpListener]]


@pytest.fixture
async def tcp_listener() -> AsyncIterator[ListenerFactory]:
    opened: list[TcpListener] = []

    async def make(
        balancer: Balancer,
        *,
        settings: DataplaneSettings | None = None,
        host: str = "127.0.0.1",
        traffic: Traffic = Traffic.CLUSTER,
    ) -> TcpListener:
        listener = await TcpListener.open(
            name=balancer.name,
            balancer=balancer,
            traffic=traffic,
            host=host,
            port=0,
            settings=settings or DataplaneSettings(),
        )
        opened.append(listener)
        return listener

    yield make
    for listener in opened:
        await listener.shutdown(1.0)
    # Every connection, whatever way it ended (relayed, dial failed, client gone while
    # dialing, aborted at shutdown), gave back its place in the fd reserve: a leak here
    # would make accepting pause for good once enough had leaked.
    await wait_until(lambda: fdreserve.FD_RESERVE.undialed == 0, what="fd reserve released")


@pytest.fixture
async def udp_listener() -> AsyncIterator[UdpListenerFactory]:
    opened: list[UdpListener] = []

    async def make(
        balancer: Balancer, *, settings: DataplaneSettings | None = None, host: str = "127.0.0.1"
    ) -> UdpListener:
        listener = await UdpListener.open(
            name=balancer.name,
            balancer=balancer,
            traffic=Traffic.CLUSTER,
            host=host,
            port=0,
            settings=settings or DataplaneSettings(),
        )
        opened.append(listener)
        return listener

    yield make
    for listener in opened:
        await listener.shutdown(1.0)


def _unread(sock: _socket.socket) -> int:
    """Bytes waiting in ``sock``'s receive queue (FIONREAD; 0 when that cannot be read)."""
    try:
        raw = fcntl.ioctl(sock.fileno(), 0x541B, b"\0\0\0\0")
    except OSError:
        return 0
    value: int = struct.unpack("i", raw)[0]
    return value
