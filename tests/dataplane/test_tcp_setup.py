"""Connection setup and teardown: dial deadlines, half-close from the endpoint, exact metrics."""

from __future__ import annotations

import _socket
import asyncio
import contextlib
import errno
import gc
import os
import socket
import struct
import time
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.dataplane.conftest import (
    NODE,
    TCP_NAME,
    BackendFactory,
    ListenerFactory,
    digest,
    make_balancer,
    wait_until,
)
from uproxy import metrics
from uproxy.dataplane import poller, relay, sockets
from uproxy.dataplane.settings import DataplaneSettings
from uproxy.model import Endpoint

FAST = DataplaneSettings(dial_timeouts_s=(0.2, 0.4))


@contextlib.contextmanager
def blackhole() -> Iterator[Endpoint]:
    """A port whose SYNs go unanswered: a listener with a full accept queue (backlog 0)."""
    server = socket.socket()
    fillers: list[socket.socket] = []
    try:
        server.bind(("127.0.0.1", 0))
        server.listen(0)
        addr = server.getsockname()
        for _ in range(2):  # the queue holds backlog + 1; the next SYN is dropped
            c = socket.socket()
            c.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                c.connect(addr)
            fillers.append(c)
        yield Endpoint("127.0.0.1", addr[1], node_name=NODE)
    finally:
        for c in fillers:
            c.close()
        server.close()


async def echo_through(port: int, payload: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(payload)
        writer.write_eof()
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
        await writer.wait_closed()


def scrape(service: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """This service's samples, as /metrics shows them."""
    text = metrics.exposition()
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("service") == service:
                out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


async def test_a_silent_endpoint_times_out_and_the_dial_moves_on(
    backends: BackendFactory, tcp_listener: ListenerFactory
) -> None:
    good = await backends("echo")
    failed, ok = metrics.DIAL_ATTEMPTS.labels("failed"), metrics.DIAL_ATTEMPTS.labels("ok")
    failed_before, ok_before = failed.value, ok.value
    dial_count_before = sum(metrics.DIAL_DURATION.counts)
    with blackhole() as silent:
        listener = await tcp_listener(
            make_balancer(TCP_NAME, [silent, good.endpoint], settings=FAST), settings=FAST
        )
        loop = asyncio.get_running_loop()
        slow = 0
        for _ in range(4):  # round-robin: whichever comes first, two dials meet the silent one
            payload = os.urandom(256 << 10)
            started = loop.time()
            got = await asyncio.wait_for(echo_through(listener.port, payload), 5)
            assert digest(got) == digest(payload)
            if loop.time() - started >= 0.19:  # waited out the first attempt's 0.2 s
                slow += 1
        await wait_until(lambda: listener.active == 0, what="pairs closed")
    assert slow >= 1
    assert failed.value - failed_before == slow
    assert ok.value - ok_before == 4
    assert sum(metrics.DIAL_DURATION.counts) - dial_count_before == 4
    assert good.accepted == 4


async def test_dial_durations_are_timed_finer_than_the_loops_millisecond_clock(
    backends: BackendFactory, tcp_listener: ListenerFactory
) -> None:
    """uvloop's ``loop.time()`` counts whole milliseconds: dials timed with it would add up to
    a whole number of milliseconds, and a loopback dial (well under 1 ms) would read 0."""
    b = await backends("echo")
    listener = await tcp_listener(make_balancer(TCP_NAME, [b.endpoint], settings=FAST))
    dial = metrics.DIAL_DURATION
    count_before, sum_before = sum(dial.counts), dial.sum
    for _ in range(40):
        payload = os.urandom(4096)
        got = await asyncio.wait_for(echo_through(listener.port, payload), 5)
        assert digest(got) == digest(payload)
    await wait_until(lambda: listener.active == 0, what="pairs closed")
    assert sum(dial.counts) - count_before == 40
    timed_ms = (dial.sum - sum_before) * 1000
    assert timed_ms > 0
    assert abs(timed_ms - round(timed_ms)) > 1e-6, f"{timed_ms} ms: a whole number of ms"


async def test_a_dial_that_completes_as_its_deadline_fires_loses_nothing(
    backends: BackendFactory, tcp_listener: ListenerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loop held up right after a dial started (other connections, a big sync) finds the
    dial's deadline due before it has polled for the finished connect.

    uvloop runs due timers before it polls: here each first dial is followed by 5 ms of the
    loop doing something else, so its 1 ms deadline fires first, with the connect long done
    (a loopback handshake). Its TCP state says so: the dial must stand (no failed attempt, no
    second dial) and the client's bytes arrive whole. (asyncio's loop handles the poll's
    events before the timers that fell due meanwhile: there the connect is seen first.)
    """
    b = await backends("echo")
    settings = DataplaneSettings(dial_timeouts_s=(0.001, 5.0))
    listener = await tcp_listener(
        make_balancer(TCP_NAME, [b.endpoint], settings=settings), settings=settings
    )
    dial = relay.Connection.dial
    held: list[relay.Connection] = []

    def dial_then_hold_the_loop(conn: relay.Connection) -> None:
        dial(conn)
        if conn.attempt == 0:
            held.append(conn)
            time.sleep(0.005)  # before the loop's next poll

    monkeypatch.setattr(relay.Connection, "dial", dial_then_hold_the_loop)
    failed = metrics.DIAL_ATTEMPTS.labels("failed")
    failed_before = failed.value
    for _ in range(5):
        payload = os.urandom(64 << 10)
        got = await asyncio.wait_for(echo_through(listener.port, payload), 10)
        assert digest(got) == digest(payload)
    await wait_until(lambda: listener.active == 0, what="pairs closed")
    assert len(held) == 5
    assert failed.value == failed_before  # every first dial stood
    assert b.accepted == 5  # and none was made twice


async def test_an_epoll_set_that_refuses_a_socket_fails_that_connection_alone(
    backends: BackendFactory, tcp_listener: ListenerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The relay's epoll set cannot take a socket (ENOSPC: fs.epoll.max_user_watches reached;
    or ENOMEM). The accepted client's: that client is reset and nothing of it is kept. The
    dialed endpoint's: a failed dial, and the next attempt serves the client whole. Either
    way the next connection is served."""
    b = await backends("echo")
    listener = await tcp_listener(
        make_balancer(TCP_NAME, [b.endpoint], settings=FAST), settings=FAST
    )
    register = poller.EdgePoller.register
    refuse: list[type] = []  # the next registrations to refuse, by the kind of handler

    def maybe_refuse(self: poller.EdgePoller, fd: int, handler: object, events: int) -> None:
        if refuse and type(handler) is refuse[0]:
            refuse.pop(0)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        register(self, fd, handler, events)  # type: ignore[arg-type]

    monkeypatch.setattr(poller.EdgePoller, "register", maybe_refuse)
    failed = metrics.DIAL_ATTEMPTS.labels("failed")
    failed_before, accepted_before = failed.value, b.accepted

    refuse.append(relay.Connection)
    # A reset, whenever the client sees it (as it connects, or as it reads): b"" would be a
    # FIN, and the client would take what it read for a whole reply.
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(echo_through(listener.port, b"lost"), 5)
    assert not refuse
    payload = os.urandom(256 << 10)
    assert digest(await echo_through(listener.port, payload)) == digest(payload)

    refuse.append(relay._EndpointSide)
    payload = os.urandom(256 << 10)
    assert digest(await echo_through(listener.port, payload)) == digest(payload)
    assert not refuse
    assert failed.value - failed_before == 1
    await wait_until(lambda: listener.active == 0, what="pairs closed")
    # The reset client was never dialed for: the served two, and the refused dial (its
    # loopback handshake was done before its socket was refused, and it was closed).
    assert b.accepted - accepted_before == 3
    await wait_until(lambda: b.open == 0, what="the endpoint's connections closed")


def keepalive_of(sock: _socket.socket) -> tuple[int, int, int]:
    """SO_KEEPALIVE, TCP_KEEPIDLE and TCP_KEEPINTVL of ``sock``, as the kernel has them."""
    return (
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
    )


@pytest.mark.parametrize("seconds", [7, 0])
async def test_keepalive_probes_both_sides_of_a_pair_that_lives(
    backends: BackendFactory, tcp_listener: ListenerFactory, seconds: int
) -> None:
    """The client side has keep-alive from its listening socket at once; the endpoint side
    gets it when the dial's deadline fires on a pair still open; with 0, neither has it."""
    b = await backends("echo")
    settings = DataplaneSettings(dial_timeouts_s=(1.0,), tcp_keepalive_s=seconds)
    listener = await tcp_listener(
        make_balancer(TCP_NAME, [b.endpoint], settings=settings), settings=settings
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
    try:
        writer.write(b"ping")
        assert await asyncio.wait_for(reader.readexactly(4), 5) == b"ping"
        conn = next(iter(listener._conns))
        assert conn.sock is not None and conn.peer is not None and conn.peer.sock is not None
        client_side, endpoint_side = conn.sock, conn.peer.sock
        if seconds:
            assert keepalive_of(client_side) == (1, seconds, seconds)
            # Linked well within its 1 s deadline: not yet on the endpoint side.
            assert keepalive_of(endpoint_side)[0] == 0
            await wait_until(
                lambda: keepalive_of(endpoint_side) == (1, seconds, seconds),
                timeout=3,
                what="keep-alive on the endpoint side",
            )
        else:
            await wait_until(lambda: conn.deadline is None, timeout=3, what="the deadline")
            assert keepalive_of(client_side)[0] == keepalive_of(endpoint_side)[0] == 0
        # Still relaying, and nothing left armed once the pair is closed.
        writer.write(b"pong")
        assert await asyncio.wait_for(reader.readexactly(4), 5) == b"pong"
    finally:
        writer.close()
        await writer.wait_closed()
    await wait_until(lambda: listener.active == 0, what="pair closed")
    assert len(listener.dial_timers[1.0]) == 0


async def test_a_pair_that_ends_young_never_sets_keepalive_on_its_endpoint_side(
    backends: BackendFactory, tcp_listener: ListenerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Short connections pay nothing for keep-alive: the deadline is cancelled with them."""
    b = await backends("echo")
    calls: list[int] = []

    def counting(sock: _socket.socket, seconds: int) -> None:
        calls.append(seconds)
        sockets.keep_alive(sock, seconds)

    monkeypatch.setattr(relay, "keep_alive", counting)
    settings = DataplaneSettings(dial_timeouts_s=(5.0,), tcp_keepalive_s=7)
    listener = await tcp_listener(
        make_balancer(TCP_NAME, [b.endpoint], settings=settings), settings=settings
    )
    for _ in range(20):
        payload = os.urandom(1000)
        got = await asyncio.wait_for(echo_through(listener.port, payload), 5)
        assert digest(got) == digest(payload)
    await wait_until(lambda: listener.active == 0, what="pairs closed")
    assert len(listener.dial_timers[5.0]) == 0  # every deadline went with its pair
    assert calls == []


async def test_a_client_leaving_during_a_dial_frees_everything(
    tcp_listener: ListenerFactory,
) -> None:
    failed = metrics.DIAL_ATTEMPTS.labels("failed")
    conns_failed = metrics.CONNECTIONS.labels(str(TCP_NAME), "TCP", "dial_failed")
    settings = DataplaneSettings(dial_timeouts_s=(5.0,))
    with blackhole() as silent:
        listener = await tcp_listener(
            make_balancer(TCP_NAME, [silent], settings=settings), settings=settings
        )
        before = (failed.value, conns_failed.value)
        client = socket.create_connection(("127.0.0.1", listener.port), timeout=2)
        try:
            client.sendall(b"bytes nobody will read")
            await wait_until(lambda: listener.active == 1, what="dial in flight")
            # A FIN would be a half-close (the reply is still wanted): leave with a RST.
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        finally:
            client.close()
        await wait_until(lambda: listener.active == 0, timeout=2, what="dial abandoned")
        assert (failed.value, conns_failed.value) == before
        assert len(listener.dial_timers[5.0]) == 0  # its deadline was cancelled


async def test_endpoint_closes_first_and_the_client_can_still_send(
    tcp_listener: ListenerFactory,
) -> None:
    """HTTP ``Connection: close`` order: the endpoint's FIN first, then the client's."""
    reply = os.urandom(100_000)
    request = os.urandom(300_000)
    received = bytearray()
    done = asyncio.Event()

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(reply)
        w.write_eof()  # our FIN first; keep reading
        received.extend(await r.read())
        done.set()
        w.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        ep = Endpoint("127.0.0.1", server.sockets[0].getsockname()[1], node_name=NODE)
        listener = await tcp_listener(make_balancer(TCP_NAME, [ep], settings=FAST), settings=FAST)
        reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
        got = await asyncio.wait_for(reader.read(), 5)  # up to the endpoint's FIN
        assert digest(got) == digest(reply)
        writer.write(request)  # the other direction is still open
        writer.write_eof()
        await asyncio.wait_for(done.wait(), 5)
        assert digest(bytes(received)) == digest(request)
        await wait_until(lambda: listener.active == 0, what="pair closed")
        writer.close()
        await writer.wait_closed()
    finally:
        server.close()
        await server.wait_closed()


async def test_metrics_page_counts_exactly_and_keeps_closed_listeners_totals(
    backends: BackendFactory, tcp_listener: ListenerFactory
) -> None:
    b = await backends("echo")
    service = str(TCP_NAME)
    ok_key = (
        "uproxy_connections_total",
        (("protocol", "TCP"), ("result", "ok"), ("service", service)),
    )
    up_key = ("uproxy_bytes_total", (("direction", "to_endpoint"), ("service", service)))
    down_key = ("uproxy_bytes_total", (("direction", "to_client"), ("service", service)))
    open_key = ("uproxy_open_connections", (("protocol", "TCP"), ("service", service)))
    before = scrape(service)
    listener = await tcp_listener(make_balancer(TCP_NAME, [b.endpoint], settings=FAST))
    sizes = [1, 1000, 70_000, 1 << 20, 5]
    for n in sizes:
        payload = os.urandom(n)
        assert digest(await echo_through(listener.port, payload)) == digest(payload)
    await wait_until(lambda: listener.active == 0, what="pairs closed")
    listener.close()
    after = scrape(service)
    assert after[ok_key] - before.get(ok_key, 0.0) == len(sizes)
    assert after[up_key] - before.get(up_key, 0.0) == sum(sizes)
    assert after[down_key] - before.get(down_key, 0.0) == sum(sizes)
    assert after[open_key] == before.get(open_key, 0.0)


async def test_relayed_pairs_are_freed_without_the_cyclic_gc(
    backends: BackendFactory, tcp_listener: ListenerFactory
) -> None:
    b = await backends("echo")
    listener = await tcp_listener(make_balancer(TCP_NAME, [b.endpoint], settings=FAST))
    payload = os.urandom(10_000)
    assert digest(await echo_through(listener.port, payload)) == digest(payload)  # warm-up
    await wait_until(lambda: listener.active == 0, what="warm-up pair closed")
    gc.collect()
    gc.disable()
    try:
        for _ in range(20):
            assert digest(await echo_through(listener.port, payload)) == digest(payload)
        await wait_until(lambda: listener.active == 0, what="pairs closed")
        await asyncio.sleep(0.05)  # not a sync point: only lets the last callbacks run
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        cyclic = [o for o in gc.garbage if isinstance(o, (relay.Connection, relay._EndpointSide))]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert cyclic == []


def test_each_side_class_runs_its_own_copy_of_the_shared_methods() -> None:
    """The client and endpoint sides share their methods' source but not their code
    objects (CPython's attribute caches are per code object and per type: see
    ``relay._Side``); a copy behaves as the original, keyword defaults included."""
    shared = [n for n, f in vars(relay._Side).items() if callable(f) and not n.startswith("__")]
    assert {"event", "pump", "flush", "close", "_pass_fin"} <= set(shared)
    for name in shared:
        if name in ("_pair", "_unlinked_event"):  # each side overrides these
            continue
        client = getattr(relay.Connection, name).__code__
        endpoint = getattr(relay._EndpointSide, name).__code__
        original = getattr(relay._Side, name).__code__
        assert client is not endpoint and client is not original, name
        assert client.co_code == endpoint.co_code == original.co_code, name
    assert relay.Connection.close.__kwdefaults__ == {"reset": False}
