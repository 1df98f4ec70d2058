"""TCP relay through real sockets on loopback: balancing, integrity, half-close, failures."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import functools
import logging
import os
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Iterator

import pytest

from tests.dataplane.conftest import (
    NODE,
    TCP_NAME,
    Backend,
    BackendFactory,
    ListenerFactory,
    digest,
    make_balancer,
    open_fds,
    wait_until,
)
from uproxy import metrics
from uproxy.dataplane.poller import read_poller_for
from uproxy.dataplane.settings import DataplaneSettings
from uproxy.model import Endpoint, LbAlgorithm, ServicePort, Traffic

S = DataplaneSettings()


async def ident_via(port: int, *, local: str = "127.0.0.1") -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(local, 0))
    try:
        return (await asyncio.wait_for(reader.readline(), 5)).strip()
    finally:
        writer.close()
        await writer.wait_closed()


async def test_round_robin_splits_300_connections_exactly(
    backends: BackendFactory, tcp_listener: ListenerFactory
) -> None:
    bs = [await backends(f"b{i}", greet=True) for i in range(3)]
    listener = await tcp_listener(make_balancer(TCP_NAME, [b.endpoint for b in bs], settings=S))
    seen = Counter([await ident_via(listener.port) for _ in range(300)])
    assert seen == {b"b0": 100, b"b1": 100, b"b2": 100}


async def test_random_is_within_15_percent_of_even(
    backends: BackendFactory, tcp_listener: ListenerFactory
) -> None:
    bs = [await backends(f"b{i}", greet=True) for i in range(3)]
    balancer = make_balancer(
        TCP_NAME, [b.endpoint for b in bs], settings=S, algorithm=LbAlgorithm.RANDOM
    )
    listener = await tcp_listener(balancer)
    seen = Counter([await ident_via(listener.port) for _ in range(300)])
    assert set(seen) == {b"b0", b"b1", b"b2"}
    assert all(85 <= n <= 115 for n in seen.values()), seen


LEAST = LbAlgorithm.LEAST_CONNECTIONS
Held = dict[bytes, list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


async def hold_one(port: int, held: Held) -> bytes:
    """A connection through ``port`` kept open in ``held``; the backend's ident."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    ident = (await asyncio.wait_for(reader.readline(), 5)).strip()
    held.setdefault(ident, []).append((reader, writer))
    return ident


async def close_all(held: Held) -> None:
    for pairs in held.values():
        for _, writer in pairs:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


async def test_least_connections_sends_new_connections_where_fewest_are_open(
    backends: BackendFactory, tcp_listener: ListenerFactory
) -> None:
    bs = [await backends(f"b{i}", greet=True) for i in range(3)]
    balancer = make_balancer(TCP_NAME, [b.endpoint for b in bs], settings=S, algorithm=LEAST)
    listener = await tcp_listener(balancer)
    held: Held = {}
    try:
        for _ in range(6):
            await hold_one(listener.port, held)
        assert {k: len(v) for k, v in held.items()} == {b"b0": 2, b"b1": 2, b"b2": 2}
        # Both connections to b1 end, from the client's side: the relay sees them through.
        for _, writer in held.pop(b"b1"):
            writer.close()
        await wait_until(lambda: listener.active == 4, what="b1's pairs closed")
        # Round-robin would go on in turn; least-connections fills b1 up first.
        assert [await hold_one(listener.port, held) for _ in range(2)] == [b"b1", b"b1"]
        # Bytes through one of the new ones, both ways.
        reader, writer = held[b"b1"][0]
        payload = os.urandom(1 << 20)
        writer.write(payload)
        echoed = await asyncio.wait_for(reader.readexactly(len(payload)), 10)
        assert digest(echoed) == digest(payload)
    finally:
        await close_all(held)


async def test_least_connections_forgets_a_failed_dial_at_once(
    backends: BackendFactory, tcp_listener: ListenerFactory
) -> None:
    live = await backends("live", greet=True)
    dead = refused_endpoint()
    never_out = dataclasses.replace(S, eject_after=0)
    balancer = make_balancer(TCP_NAME, [dead, live.endpoint], settings=never_out, algorithm=LEAST)
    listener = await tcp_listener(balancer, settings=never_out)
    held: Held = {}
    revived = Backend(b"revived", greet=True, port=dead.port)
    try:
        # Every dial to the dead one is refused and retried on the live one, where all stay.
        for _ in range(3):
            assert await hold_one(listener.port, held) == b"live"
        await revived.start()
        # The refused dials left nothing counted: 0 open against 3, so all three go there.
        assert [await hold_one(listener.port, held) for _ in range(3)] == [b"revived"] * 3
    finally:
        await close_all(held)
        await revived.stop()


async def test_client_ip_affinity_pins_then_moves_after_expiry(
    backends: BackendFactory, tcp_listener: ListenerFactory
) -> None:
    now = [500.0]
    bs = [await backends(f"b{i}", greet=True) for i in range(3)]
    balancer = make_balancer(
        TCP_NAME, [b.endpoint for b in bs], settings=S, affinity_s=30, clock=lambda: now[0]
    )
    listener = await tcp_listener(balancer)
    first = await ident_via(listener.port, local="127.0.0.11")
    other = await ident_via(listener.port, local="127.0.0.12")
    assert other != first  # a different client IP is balanced normally
    for _ in range(10):
        now[0] += 20  # within the timeout of the previous use
        assert await ident_via(listener.port, local="127.0.0.11") == first
    now[0] += 31
    assert await ident_via(listener.port, local="127.0.0.11") != first


async def relay(port: int, payload: bytes, *, chunk: int = 256 * 1024) -> bytes:
    """Send ``payload`` through the proxy to an echo backend, half-close, read all back."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)

    async def send() -> None:
        view = memoryview(payload)
        for i in range(0, len(view), chunk):
            writer.write(view[i : i + chunk])
            await writer.drain()
        writer.write_eof()

    sender = asyncio.create_task(send())
    received = bytearray()
    while data := await reader.read(1 << 20):
        received += data
    await sender
    writer.close()
    await writer.wait_closed()
    return bytes(received)


async def test_64_mib_each_way_through_one_connection(
    backends: BackendFactory, tcp_listener: ListenerFactory
) -> None:
    b = await backends("echo")
    listener = await tcp_listener(make_balancer(TCP_NAME, [b.endpoint], settings=S))
    to_endpoint = metrics.BYTES.labels(str(TCP_NAME), "to_endpoint")
    to_client = metrics.BYTES.labels(str(TCP_NAME), "to_client")
    opened = metrics.OPEN_CONNECTIONS.labels(str(TCP_NAME), "TCP")
    before = (to_endpoint.value, to_client.value, opened.value)
    payload = os.urandom(64 << 20)
    got = await asyncio.wait_for(relay(listener.port, payload), 60)
    assert digest(got) == digest(payload)
    await wait_until(lambda: listener.active == 0, what="pair closed")
    after = (to_endpoint.value, to_client.value, opened.value)
    assert (after[0] - before[0], after[1] - before[1], after[2]) == (64 << 20, 64 << 20, before[2])


async def test_200_concurrent_connections_of_1_mib_and_no_fd_growth(
    backends: BackendFactory, tcp_listener: ListenerFactory
) -> None:
    b = await backends("echo")
    listener = await tcp_listener(make_balancer(TCP_NAME, [b.endpoint], settings=S))
    await relay(listener.port, b"warm-up")  # lazily created loop fds are not a leak
    await wait_until(lambda: listener.active == 0, what="warm-up closed")
    before = open_fds()
    payloads = [os.urandom(1 << 20) for _ in range(200)]
    results = await asyncio.wait_for(
        asyncio.gather(*(relay(listener.port, p) for p in payloads)), 120
    )
    for sent, got in zip(payloads, results, strict=True):
        assert digest(got) == digest(sent)
    await wait_until(lambda: listener.active == 0 and b.open == 0, what="all pairs closed")
    await wait_until(lambda: open_fds() <= before, what=f"fds back to {before}")


async def test_half_close_client_still_gets_the_full_reply(tcp_listener: ListenerFactory) -> None:
    """The backend reads until EOF, then answers: only works if the FIN is passed on alone."""
    reply = os.urandom(3 << 20)
    got_request = asyncio.Event()
    request = bytearray()

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        request.extend(await r.read())  # until the client's FIN
        got_request.set()
        w.write(reply)
        await w.drain()
        w.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        port = server.sockets[0].getsockname()[1]
        ep = Endpoint("127.0.0.1", port, node_name=NODE)
        listener = await tcp_listener(make_balancer(TCP_NAME, [ep], settings=S))
        sent = os.urandom(100_000)
        got = await asyncio.wait_for(relay(listener.port, sent), 10)
        assert digest(bytes(request)) == digest(sent)
        assert digest(got) == digest(reply)
    finally:
        server.close()
        await server.wait_closed()


def refused_endpoint() -> Endpoint:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # bound and closed, not listening: connecting is refused
    return Endpoint("127.0.0.1", port, node_name=NODE)


async def test_one_refusing_endpoint_out_of_three_all_connections_succeed(
    backends: BackendFactory, tcp_listener: ListenerFactory
) -> None:
    bs = [await backends(f"b{i}", greet=True) for i in range(2)]
    eps = [bs[0].endpoint, refused_endpoint(), bs[1].endpoint]
    failed = metrics.DIAL_ATTEMPTS.labels("failed")
    failed_before = failed.value
    never_out = dataclasses.replace(S, eject_after=0)  # every third connection meets it
    listener = await tcp_listener(make_balancer(TCP_NAME, eps, settings=never_out))
    seen = Counter([await ident_via(listener.port) for _ in range(100)])
    assert sum(seen.values()) == 100 and set(seen) == {b"b0", b"b1"}
    assert failed.value - failed_before >= 30  # the refusing one was really tried


async def test_a_refusing_endpoint_is_left_out_after_three_failed_dials(
    backends: BackendFactory, tcp_listener: ListenerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="uproxy.dataplane.balancer")
    bs = [await backends(f"b{i}", greet=True) for i in range(2)]
    dead = refused_endpoint()
    failed = metrics.DIAL_ATTEMPTS.labels("failed")
    ejections = metrics.ENDPOINT_EJECTIONS.labels(str(TCP_NAME))
    failed_before, ejections_before = failed.value, ejections.value
    # Out for 0.5 s at first, so the test sees it come back (1 s by default).
    settings = dataclasses.replace(S, eject_base_s=0.5)
    listener = await tcp_listener(
        make_balancer(TCP_NAME, [bs[0].endpoint, dead, bs[1].endpoint], settings=settings)
    )
    loop = asyncio.get_running_loop()
    started = loop.time()
    seen = Counter([await ident_via(listener.port) for _ in range(60)])
    assert sum(seen.values()) == 60 and set(seen) == {b"b0", b"b1"}
    if loop.time() - started < 0.5:  # (a slow machine may have let it back in meanwhile)
        assert failed.value - failed_before == 3  # then never picked again
        assert ejections.value == ejections_before + 1
    lines = [r for r in caplog.records if "Endpoint left out" in r.getMessage()]
    assert lines and f"127.0.0.1:{dead.port}" in lines[0].kv["endpoint"]  # type: ignore[attr-defined]
    # Back after its time: its first dial fails, and it is out again at once, for longer.
    await asyncio.sleep(0.6)
    was, started = failed.value, loop.time()
    seen = Counter([await ident_via(listener.port) for _ in range(30)])
    assert sum(seen.values()) == 30 and set(seen) == {b"b0", b"b1"}
    if loop.time() - started < 1.0:
        assert failed.value - was == 1
    assert ejections.value >= ejections_before + 2


async def test_no_endpoints_resets_the_client_within_a_second(
    tcp_listener: ListenerFactory,
) -> None:
    counter = metrics.NO_ENDPOINTS.labels(str(TCP_NAME), Traffic.CLUSTER.value)
    before = counter.value
    listener = await tcp_listener(make_balancer(TCP_NAME, [], settings=S))
    loop = asyncio.get_running_loop()
    started = loop.time()
    outcome = "answered"
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
        try:
            writer.write(b"hello")
            data = await asyncio.wait_for(reader.read(100), 1.0)
            outcome = "closed" if data == b"" else "answered"
        finally:
            writer.close()
    except (ConnectionResetError, ConnectionRefusedError):
        outcome = "reset"
    assert outcome in ("reset", "closed")
    assert loop.time() - started < 1.0
    assert counter.value == before + 1


async def test_all_dials_failing_resets_the_client(tcp_listener: ListenerFactory) -> None:
    listener = await tcp_listener(
        make_balancer(TCP_NAME, [refused_endpoint(), refused_endpoint()], settings=S)
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
    try:
        writer.write(b"early bytes")
        try:
            assert await asyncio.wait_for(reader.read(100), 2.0) == b""
        except ConnectionResetError:
            pass
    finally:
        writer.close()
    await wait_until(lambda: listener.active == 0, what="failed pair released")


async def test_existing_connections_survive_endpoint_updates(
    backends: BackendFactory, tcp_listener: ListenerFactory
) -> None:
    old, new = await backends("old", greet=True), await backends("new", greet=True)
    balancer = make_balancer(TCP_NAME, [old.endpoint], settings=S)
    listener = await tcp_listener(balancer)
    reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
    assert (await reader.readline()).strip() == b"old"
    balancer.update(ServicePort(name=TCP_NAME, port=80), [new.endpoint])
    assert await ident_via(listener.port) == b"new"  # new connections go to the new set
    payload = os.urandom(1 << 20)
    writer.write(payload)
    writer.write_eof()
    got = await asyncio.wait_for(reader.read(), 10)  # the old pair still relays
    assert digest(got) == digest(payload)
    writer.close()
    await writer.wait_closed()


async def test_data_sent_before_the_dial_completes_is_forwarded(
    backends: BackendFactory, tcp_listener: ListenerFactory
) -> None:
    """The first endpoint refuses, so the client's bytes wait for the second dial."""
    b = await backends("echo")
    balancer = make_balancer(TCP_NAME, [refused_endpoint(), b.endpoint], settings=S)
    listener = await tcp_listener(balancer)
    for _ in range(4):  # whichever endpoint comes first, some dials are retried
        payload = os.urandom(1 << 20)  # more than high_water: reading the client pauses
        got = await asyncio.wait_for(relay(listener.port, payload), 10)
        assert digest(got) == digest(payload)


async def test_both_sides_use_tcp_nodelay(
    backends: BackendFactory, tcp_listener: ListenerFactory
) -> None:
    b = await backends("echo")
    listener = await tcp_listener(make_balancer(TCP_NAME, [b.endpoint], settings=S))
    reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
    writer.write(b"x")
    assert await reader.readexactly(1) == b"x"
    (conn,) = listener._conns
    for side in (conn, conn.peer):
        assert side is not None and side.sock is not None
        assert side.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    writer.close()
    await writer.wait_closed()


async def test_a_half_closed_pair_waits_for_a_server_that_thinks(
    tcp_listener: ListenerFactory,
) -> None:
    """The client sends its request and its FIN; the server answers after a long silence.
    A bound on idle half-closed pairs (60 s) used to cut such a reply with a clean FIN, which
    the client took for a complete, empty one; as in kube-proxy's userspace mode the pair
    now waits (a peer that is gone is found by the keep-alive probes)."""
    reply = os.urandom(256 * 1024)

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        assert await r.read() == b"request"  # up to its FIN
        await asyncio.sleep(1.5)  # thinking, silent, the pair half-closed
        w.write(reply)
        await w.drain()
        w.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        ep = Endpoint("127.0.0.1", server.sockets[0].getsockname()[1], node_name=NODE)
        listener = await tcp_listener(make_balancer(TCP_NAME, [ep], settings=S))
        reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
        writer.write(b"request")
        writer.write_eof()
        got = await asyncio.wait_for(reader.read(), 10)  # up to the server's FIN
        assert digest(got) == digest(reply)
        await wait_until(lambda: listener.active == 0, what="pair closed")
        writer.close()
    finally:
        server.close()
        await server.wait_closed()


async def test_a_reset_on_a_paused_side_frees_the_pair(tcp_listener: ListenerFactory) -> None:
    # The endpoint accepts and never reads: the pair fills up and the client side is no
    # longer read. Its reset must still free the pair (sockets, pipes) and reach the endpoint.
    held: list[socket.socket] = []
    sink = socket.socket()
    sink.bind(("127.0.0.1", 0))
    sink.listen(1)
    sink.setblocking(False)
    loop = asyncio.get_running_loop()
    loop.add_reader(sink.fileno(), lambda: held.append(sink.accept()[0]))
    settings = DataplaneSettings(high_water=64 * 1024)
    endpoint = Endpoint("127.0.0.1", sink.getsockname()[1], NODE)
    listener = await tcp_listener(make_balancer(TCP_NAME, [endpoint], settings=settings))
    baseline = open_fds()
    client = socket.socket()
    client.setblocking(False)
    try:
        await loop.sock_connect(client, ("127.0.0.1", listener.port))
        await wait_until(lambda: len(held) == 1 and listener.active == 1, what="pair linked")
        block = os.urandom(1 << 16)
        stalled_since, deadline = loop.time(), loop.time() + 20
        while loop.time() - stalled_since < 0.3:  # until the client cannot send any more
            assert loop.time() < deadline, "the pair never filled up"
            try:
                client.send(block)
                stalled_since = loop.time()
            except BlockingIOError:
                await asyncio.sleep(0.02)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        client.close()  # a reset
        await wait_until(lambda: listener.active == 0, what="the pair let go after the reset")
        # The endpoint's side was reset too: its socket reports the reset (or EOF) at once.
        held[0].setblocking(False)
        await wait_until(lambda: _gone(held[0]), what="the endpoint told")
        # Every fd the pair took is back: only the endpoint's own socket (this test's) is new.
        await wait_until(lambda: open_fds() == baseline + len(held), what="fds at baseline")
    finally:
        loop.remove_reader(sink.fileno())
        sink.close()
        for s in held:
            s.close()
        if client.fileno() >= 0:
            client.close()


def _gone(sock: socket.socket) -> bool:
    """Whether the peer has reset or closed ``sock`` (reading through what was queued)."""
    try:
        while sock.recv(1 << 20):
            pass
        return True
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


class _ReplyThenReset:
    """An endpoint that answers each connection with ``size`` bytes and then resets it: at
    once after an abortive close once the bytes are acknowledged (``abort``), or as a
    server does that replies and closes with the request unread (the kernel resets)."""

    def __init__(self, size: int, *, abort: bool) -> None:
        self.payload = os.urandom(size)
        self.abort = abort
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        # A thread blocked in accept() holds the fd number it will return: short waits, so
        # that ``close`` ends the thread rather than leave one behind.
        self.sock.settimeout(0.05)
        self.port = self.sock.getsockname()[1]
        self.resets = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            with conn:
                if not self.abort:
                    time.sleep(0.05)  # the request has arrived, unread
                conn.sendall(self.payload)
                deadline = time.monotonic() + 5
                while _outq(conn) and time.monotonic() < deadline:  # all of it acknowledged
                    time.sleep(0.001)
                if self.abort:
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.resets += 1

    def reset_past(self, count: int) -> bool:
        return self.resets > count

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.sock.close()


async def read_to_the_end(client: socket.socket, within_s: float) -> tuple[bytes, bool]:
    """What ``client`` reads until its stream ends (bounded), and whether it ended in a reset."""
    loop = asyncio.get_running_loop()
    got = bytearray()
    deadline = loop.time() + within_s
    while loop.time() < deadline:
        try:
            chunk = await asyncio.wait_for(loop.sock_recv(client, 1 << 20), 5)
        except ConnectionResetError:
            return bytes(got), True
        if not chunk:
            break
        got += chunk
    return bytes(got), False


def _outq(sock: socket.socket) -> int:
    raw = fcntl.ioctl(sock.fileno(), 0x5411, b"\0\0\0\0")  # SIOCOUTQ
    value: int = struct.unpack("i", raw)[0]
    return value


@pytest.mark.parametrize(
    ("size", "abort"),
    [(1000, False), (200_000, True), (4 << 20, True)],
    ids=["reply-then-close-unread", "200k-then-rst", "4m-then-rst"],
)
async def test_bytes_before_a_reset_reach_the_client_and_then_the_reset(
    tcp_listener: ListenerFactory, size: int, abort: bool
) -> None:
    # Reached directly, the client reads every byte the endpoint sent before its reset, then
    # the reset. A proxy that resets its client at once throws those bytes away.
    server = _ReplyThenReset(size, abort=abort)
    loop = asyncio.get_running_loop()
    endpoint = Endpoint("127.0.0.1", server.port, NODE)
    listener = await tcp_listener(make_balancer(TCP_NAME, [endpoint], settings=DataplaneSettings()))
    try:
        for attempt in range(10 if size < 1 << 20 else 3):
            client = socket.socket()
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
            client.setblocking(False)
            with client:
                await loop.sock_connect(client, ("127.0.0.1", listener.port))
                await loop.sock_sendall(client, b"x" * 5000)  # a request the server never reads
                await wait_until(functools.partial(server.reset_past, attempt), what="reset")
                got, reset = await read_to_the_end(client, 10)
                assert digest(bytes(got)) == digest(server.payload), f"attempt {attempt}"
                assert reset, "the end was not a reset"
        await wait_until(lambda: listener.active == 0, what="pairs closed")
    finally:
        server.close()


async def test_a_half_closed_pair_still_moving_bytes_is_not_cut(
    tcp_listener: ListenerFactory,
) -> None:
    # The client sends its request and its FIN, then reads a long reply slowly, for over a
    # second: cut, the download would end with a clean FIN, taken for whole.
    payload = os.urandom(4 << 20)

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.read()  # the request, up to its FIN
        w.write(payload)
        await w.drain()
        w.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        ep = Endpoint("127.0.0.1", server.sockets[0].getsockname()[1], node_name=NODE)
        listener = await tcp_listener(make_balancer(TCP_NAME, [ep], settings=S))
        loop = asyncio.get_running_loop()
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 * 1024)
        client.setblocking(False)
        with client:
            await loop.sock_connect(client, ("127.0.0.1", listener.port))
            await loop.sock_sendall(client, b"GET")
            client.shutdown(socket.SHUT_WR)
            got = bytearray()
            started = loop.time()
            while loop.time() - started < 20:  # 32 KiB every 10 ms: over a second, 5x the bound
                chunk = await asyncio.wait_for(loop.sock_recv(client, 32 * 1024), 5)
                if not chunk:
                    break
                got += chunk
                await asyncio.sleep(0.01)
            assert loop.time() - started > 1.0
        assert digest(bytes(got)) == digest(payload)
    finally:
        server.close()
        await server.wait_closed()


@contextlib.contextmanager
def _queued_clients(port: int, count: int) -> Iterator[list[socket.socket]]:
    """Connections the kernel completed and queued on the listener, not yet accepted."""
    clients = [socket.create_connection(("127.0.0.1", port), timeout=2) for _ in range(count)]
    try:
        yield clients
    finally:
        for c in clients:
            c.close()


async def _each_gets_its_own_bytes_back(clients: list[socket.socket]) -> None:
    """Each client sends 100 KiB of its own and reads it back whole (length and sha256)."""
    loop = asyncio.get_running_loop()

    def exchange(i: int, c: socket.socket) -> tuple[int, str]:
        c.sendall(bytes([i]) * 100_000)
        c.shutdown(socket.SHUT_WR)
        got = b""
        while chunk := c.recv(65536):
            got += chunk
        return digest(got)

    got = await asyncio.gather(
        *(loop.run_in_executor(None, exchange, i, c) for i, c in enumerate(clients))
    )
    assert got == [digest(bytes([i]) * 100_000) for i in range(len(clients))]


async def test_a_flood_of_connections_is_accepted_until_the_pass_ends_and_none_is_lost(
    backends: BackendFactory, tcp_listener: ListenerFactory
) -> None:
    # A call took up to 64 connections (an accept and a dial each) while every relay of the
    # worker waited: during a flood, requests on established connections waited for whole
    # batches. Once the poller's pass is over the listener stops; the rest stay queued.
    b = await backends("b")
    listener = await tcp_listener(make_balancer(TCP_NAME, [b.endpoint], settings=S))
    acceptor = read_poller_for(asyncio.get_running_loop())
    with _queued_clients(listener.port, 10) as clients:
        acceptor.deadline = 0.0  # a pass that is over already: one connection, then return
        listener.readable()
        assert listener.active == 1
        acceptor.deadline = time.perf_counter() + 10  # a pass with time left: all 9 others
        listener.readable()
        assert listener.active == 10
        await _each_gets_its_own_bytes_back(clients)


async def test_a_retiring_socket_serves_everything_queued_when_it_closes(
    backends: BackendFactory, tcp_listener: ListenerFactory
) -> None:
    # Its last call takes the whole queue, whatever the pass's deadline: closing a listening
    # socket resets every connection still queued on it.
    b = await backends("b")
    listener = await tcp_listener(make_balancer(TCP_NAME, [b.endpoint], settings=S))
    sock = listener.socket
    assert sock is not None
    listener.retire(0.1)
    listener._acceptor.unwatch(sock.fileno())  # what arrives now is there for the last call
    with _queued_clients(listener.port, 6) as clients:
        read_poller_for(asyncio.get_running_loop()).deadline = 0.0
        await wait_until(lambda: listener.socket is None, what="the retiring socket closed")
        assert listener.active == 6
        await _each_gets_its_own_bytes_back(clients)
