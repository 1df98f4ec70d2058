"""Workers sharing a listening socket share its connections: a worker ahead of the least
loaded one leaves the queue to the others (``dataplane.spread``).

The other workers are played by their slots in a real shared page; the listener is real, and
so are its connections. What is checked is what a user's pool of long-lived connections
relies on: a worker ahead of an idle one takes nothing more until it is no longer ahead, a
worker that is not ahead, or beside busy, dead or no other workers, takes everything, and
what nobody else takes is still served."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Iterator

import pytest

from tests.dataplane.conftest import (
    TCP_NAME,
    Backend,
    BackendFactory,
    ListenerFactory,
    make_balancer,
    wait_until,
)
from uproxy.dataplane import spread
from uproxy.dataplane.settings import DataplaneSettings
from uproxy.dataplane.tcp import TcpListener

S = DataplaneSettings(accept_batch=4)


@pytest.fixture
def page() -> Iterator[spread.Loads]:
    """A page of 2 workers' slots: this process is worker 0 while the test runs; the view
    returned is worker 1's, which the test writes as that worker would."""
    writer = spread.LoadsWriter(2)
    loads = spread.Loads(writer.fd, 2, 0)
    worker1 = spread.Loads(writer.fd, 2, 1)
    spread.LOADS = loads
    yield worker1
    spread.LOADS = None
    worker1.close()
    loads.close()
    writer.close()


def other(worker1: spread.Loads, held: int, *, took: float = 0.0) -> None:
    """What worker 1 holds and when it last took a connection (0: long ago, idle)."""
    worker1.values[1] = held
    worker1.took[1] = took


@contextlib.contextmanager
def connected(port: int, n: int) -> Iterator[list[socket.socket]]:
    """``n`` clients at once, closed afterwards: the kernel completes their handshakes, the
    proxy's accept queue holds them until it takes them."""
    clients = []
    try:
        for _ in range(n):
            c = socket.socket()
            clients.append(c)
            c.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                c.connect(("127.0.0.1", port))
        yield clients
    finally:
        for c in clients:
            c.close()


async def serving(
    backends: BackendFactory, tcp_listener: ListenerFactory, *, affinity_s: int | None = None
) -> tuple[Backend, TcpListener]:
    """A backend that greets with its name, and a listener for it."""
    b = await backends("b", greet=True)
    balancer = make_balancer(TCP_NAME, [b.endpoint], settings=S, affinity_s=affinity_s)
    return b, await tcp_listener(balancer, settings=S)


def held(listener: TcpListener) -> int:
    assert spread.LOADS is not None
    assert spread.LOADS.values[0] == listener.active  # the page says what the worker holds
    return listener.active


def test_the_limit_follows_the_least_loaded_idle_worker() -> None:
    writer = spread.LoadsWriter(3)
    views = [spread.Loads(writer.fd, 3, i) for i in range(3)]
    try:
        loads = views[0]
        now = spread.CLOCK()
        views[1].values[1], views[2].values[2] = 8, 40
        assert loads.limit(now) == 8 + 2 + 2  # ahead by 2, and a quarter more as they grow
        views[1].took[1] = now - spread.IDLE_S / 2  # took one a moment ago: busy
        assert loads.limit(now) == spread.GONE  # it competes for the queue as an equal
        views[1].took[1] = now - 2 * spread.IDLE_S
        assert loads.limit(now) == 8 + 2 + 2
        writer.gone(1)  # dead: its replacement is not waited for
        assert loads.limit(now) == 40 + 2 + 10
        writer.gone(2)
        assert loads.limit(now) == spread.GONE  # alone: never defers
        alone = spread.Loads(os.dup(writer.fd), 1, 0)
        assert alone.limit(now) == spread.GONE
        alone.close()
    finally:
        for view in views:
            view.close()
        writer.close()


async def test_a_worker_ahead_takes_nothing_more_until_it_is_no_longer_ahead(
    page: spread.Loads,
    backends: BackendFactory,
    tcp_listener: ListenerFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(spread, "DEFER_S", 60.0)  # only what the connections do ends it
    b, listener = await serving(backends, tcp_listener)
    other(page, 0)  # worker 1 is idle
    with connected(listener.port, 6) as clients:
        await wait_until(lambda: held(listener) == 2, what="2 taken")
        await asyncio.sleep(0.05)  # the other 4 stay queued for worker 1 (50 polls)
        assert held(listener) == 2
        clients[0].close()  # one of ours ends: 1 against 0, no longer ahead by 2
        await wait_until(lambda: held(listener) == 2 and b.accepted == 3, what="one more")
        other(page, 30)  # worker 1 took many meanwhile: 2 is far behind it
        clients[1].close()
        await wait_until(lambda: held(listener) == 4, what="the rest taken")
        assert b.accepted == 6


async def test_what_nobody_else_takes_is_taken_after_a_moment(
    page: spread.Loads,
    backends: BackendFactory,
    tcp_listener: ListenerFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Worker 1 looks idle but never takes anything (busy elsewhere, or stopped): after
    # ``DEFER_S`` the connections it left are served here.
    monkeypatch.setattr(spread, "DEFER_S", 0.02)
    _, listener = await serving(backends, tcp_listener)
    other(page, 0)
    with connected(listener.port, 12) as clients:
        await wait_until(lambda: held(listener) == 12, what="all taken")
        loop = asyncio.get_running_loop()
        for c in clients:  # every one relayed
            assert await asyncio.wait_for(loop.sock_recv(c, 2), 5) == b"b\n"


async def test_a_worker_beside_a_busy_one_takes_everything(
    page: spread.Loads,
    backends: BackendFactory,
    tcp_listener: ListenerFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Worker 1 holds nothing, but it is taking connections (under steady load they come and
    # go): the two race for the queue as equals, and nobody defers.
    monkeypatch.setattr(spread, "DEFER_S", 60.0)
    monkeypatch.setattr(spread, "IDLE_S", 60.0)
    _, listener = await serving(backends, tcp_listener)
    other(page, 0, took=spread.CLOCK())
    with connected(listener.port, 6):
        await wait_until(lambda: held(listener) == 6, what="all taken")


async def test_a_client_ip_affinity_port_never_defers(
    page: spread.Loads,
    backends: BackendFactory,
    tcp_listener: ListenerFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Its socket is this worker's own (the group steers each client address to one worker):
    # nobody else would take what it leaves.
    monkeypatch.setattr(spread, "DEFER_S", 60.0)
    _, listener = await serving(backends, tcp_listener, affinity_s=60)
    other(page, 0)
    with connected(listener.port, 6):
        await wait_until(lambda: held(listener) == 6, what="all taken")
    await wait_until(lambda: held(listener) == 0, what="all released")
