"""Bulk TCP over splice(2): integrity and half-close each way, resets, backpressure, fds."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import os
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from tests.dataplane.conftest import (
    NODE,
    TCP_NAME,
    BackendFactory,
    ListenerFactory,
    digest,
    make_balancer,
    open_fds,
    relay_state,
    wait_until,
)
from tests.dataplane.test_tcp import _ReplyThenReset, read_to_the_end, relay as echo_relay
from tests.dataplane.test_tcp_limits import ChildFactory, proxy_child  # noqa: F401
from uproxy import metrics
from uproxy.dataplane import fdreserve, relay, splice
from uproxy.dataplane.settings import DataplaneSettings
from uproxy.model import Endpoint

SPLICE = DataplaneSettings(splice_threshold=64 * 1024)
COPY = DataplaneSettings(splice_threshold=None)
MIB = 1 << 20
RST = struct.pack("ii", 1, 0)


@pytest.fixture
def pipes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the pipes the relay opens during the test."""
    opened: list[int] = []
    real = splice.open_pipe

    def counting(size: int) -> splice.Pipe | None:
        pipe = real(size)
        if pipe is not None:
            opened.append(pipe.size)
        return pipe

    monkeypatch.setattr(splice, "open_pipe", counting)
    return opened


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@pytest.fixture
async def server() -> AsyncIterator[Callable[[Handler], Awaitable[Endpoint]]]:
    """Starts stream servers on loopback; closed at the end of the test."""
    servers: list[asyncio.Server] = []

    async def start(handle: Handler) -> Endpoint:
        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        servers.append(srv)
        return Endpoint("127.0.0.1", srv.sockets[0].getsockname()[1], node_name=NODE)

    yield start
    for srv in servers:
        srv.close()
        await srv.wait_closed()


def errors_of(side: str) -> metrics.AnyTally:
    """The count of TCP_NAME's connections ended by a reset from ``side``."""
    return metrics.CONNECTION_ERRORS.labels(str(TCP_NAME), side, "reset")


async def read_digest(reader: asyncio.StreamReader) -> tuple[int, str]:
    """Reads until EOF: the length and sha256 of what came."""
    h, n = hashlib.sha256(), 0
    while data := await reader.read(MIB):
        h.update(data)
        n += len(data)
    return n, h.hexdigest()


async def write_all(writer: asyncio.StreamWriter, payload: bytes) -> None:
    view = memoryview(payload)
    for i in range(0, len(view), MIB):
        writer.write(view[i : i + MIB])
        await writer.drain()


@pytest.mark.parametrize("first_fin", ["client", "endpoint"])
async def test_64_mib_each_way_over_splice_with_a_half_close_first_from_either_side(
    tcp_listener: ListenerFactory,
    server: Callable[[Handler], Awaitable[Endpoint]],
    pipes: list[int],
    first_fin: str,
) -> None:
    """Each direction is spliced; the first FIN is passed on alone, and the other
    direction still moves its 64 MiB whole after it."""
    up, down = os.urandom(64 * MIB), os.urandom(64 * MIB)
    got_up: list[tuple[int, str]] = []

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        if first_fin == "client":  # read to the client's FIN, then answer
            got_up.append(await read_digest(r))
            await write_all(w, down)
        else:  # answer and send our FIN first, then read the client's bytes
            await write_all(w, down)
            w.write_eof()
            got_up.append(await read_digest(r))
        w.close()

    ep = await server(handle)
    listener = await tcp_listener(make_balancer(TCP_NAME, [ep], settings=SPLICE), settings=SPLICE)
    to_endpoint = metrics.BYTES.labels(str(TCP_NAME), "to_endpoint")
    to_client = metrics.BYTES.labels(str(TCP_NAME), "to_client")
    before = (to_endpoint.value, to_client.value)
    reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
    if first_fin == "client":
        await write_all(writer, up)
        writer.write_eof()
        got_down = await asyncio.wait_for(read_digest(reader), 60)
    else:
        got_down = await asyncio.wait_for(read_digest(reader), 60)  # up to the endpoint's FIN
        await write_all(writer, up)  # the other direction is still open
        writer.write_eof()
    await wait_until(lambda: len(got_up) == 1, timeout=60, what="the endpoint read to EOF")
    writer.close()
    assert got_up == [digest(up)]
    assert got_down == digest(down)
    assert len(pipes) == 2  # one per direction
    await wait_until(lambda: listener.active == 0, what="pair closed")
    assert (to_endpoint.value - before[0], to_client.value - before[1]) == (64 * MIB, 64 * MIB)


SMALL_SNDBUF = 4096  # the kernel doubles it: about 8 KiB a socket may hold unsent


async def read_slowly(reader: asyncio.StreamReader) -> tuple[int, str]:
    """Reads until EOF in small pieces, pausing now and then: the length and sha256."""
    h, n, reads = hashlib.sha256(), 0, 0
    while data := await reader.read(16 * 1024):
        h.update(data)
        n += len(data)
        reads += 1
        if reads % 64 == 0:
            await asyncio.sleep(0.002)
    return n, h.hexdigest()


@pytest.mark.parametrize("settings", [SPLICE, COPY], ids=["splice", "copy"])
async def test_what_is_held_back_leaves_over_several_flushes_whole_both_ways(
    tcp_listener: ListenerFactory,
    server: Callable[[Handler], Awaitable[Endpoint]],
    monkeypatch: pytest.MonkeyPatch,
    settings: DataplaneSettings,
) -> None:
    """The relay's own sockets hold only a few KiB unsent (SO_SNDBUF: the client's side
    inherits it from the listening socket, the endpoint's is set as it is dialed), so a
    read the peer's socket does not take whole is held back (the copy path's bytes, the
    splice path's pipe) and flushed in many writes, each falling short again as the slow
    reader makes room. 2 MiB each way at once, then a FIN from each side: every byte
    arrives, in order."""
    up, down = os.urandom(2 * MIB), os.urandom(2 * MIB)
    short: dict[str, int] = {"to the client": 0, "to the endpoint": 0}

    def counting(real: Callable[[relay._Side], None], toward: str) -> Callable[[relay._Side], None]:
        def flush(side: relay._Side) -> None:
            real(side)
            if side.out is not None or (side.pipe is not None and side.pipe.held):
                short[toward] += 1  # room for part of it only: the rest waits again

        return flush

    # An endpoint side holds what goes to the client, the client side what goes to the
    # endpoint.
    monkeypatch.setattr(
        relay._EndpointSide, "flush", counting(relay._EndpointSide.flush, "to the client")
    )
    monkeypatch.setattr(
        relay.Connection, "flush", counting(relay.Connection.flush, "to the endpoint")
    )
    dialed = relay._EndpointSide.__init__

    def small_buffer(
        side: relay._EndpointSide, conn: relay.Connection, sock: socket.socket
    ) -> None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SMALL_SNDBUF)
        dialed(side, conn, sock)

    monkeypatch.setattr(relay._EndpointSide, "__init__", small_buffer)
    got_up: list[tuple[int, str]] = []

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        reading = asyncio.create_task(read_slowly(r))
        await write_all(w, down)
        w.write_eof()
        got_up.append(await reading)
        w.close()

    ep = await server(handle)
    listener = await tcp_listener(
        make_balancer(TCP_NAME, [ep], settings=settings), settings=settings
    )
    assert listener.socket is not None
    listener.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SMALL_SNDBUF)
    reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
    reading = asyncio.create_task(read_slowly(reader))
    await write_all(writer, up)
    writer.write_eof()
    got_down = await asyncio.wait_for(reading, 60)
    await wait_until(lambda: len(got_up) == 1, timeout=60, what="the endpoint read to EOF")
    writer.close()
    assert got_down == digest(down)
    assert got_up == [digest(up)]
    assert min(short.values()) > 0, short  # the paths under test were taken, each way
    await wait_until(lambda: listener.active == 0, what="pair closed")


@pytest.mark.parametrize(("size", "spliced"), [(512 * 1024, False), (2 * MIB, True)])
async def test_a_pair_below_the_threshold_never_opens_a_pipe(
    backends: BackendFactory,
    tcp_listener: ListenerFactory,
    pipes: list[int],
    size: int,
    spliced: bool,
) -> None:
    settings = DataplaneSettings(splice_threshold=MIB)
    b = await backends("echo")
    listener = await tcp_listener(
        make_balancer(TCP_NAME, [b.endpoint], settings=settings), settings=settings
    )
    payload = os.urandom(size)
    got = await asyncio.wait_for(echo_relay(listener.port, payload), 30)
    assert digest(got) == digest(payload)
    assert len(pipes) == (2 if spliced else 0)


@pytest.mark.parametrize("settings", [SPLICE, COPY], ids=["splice", "copy"])
async def test_an_endpoint_reset_mid_transfer_reaches_the_client_as_a_reset(
    tcp_listener: ListenerFactory,
    server: Callable[[Handler], Awaitable[Endpoint]],
    settings: DataplaneSettings,
) -> None:
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.readexactly(MIB)  # well past the threshold: this direction is spliced
        sock = w.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, RST)
        w.transport.abort()

    ep = await server(handle)
    listener = await tcp_listener(
        make_balancer(TCP_NAME, [ep], settings=settings), settings=settings
    )
    errors = {side: errors_of(side) for side in ("endpoint", "client")}
    before = {side: tally.value for side, tally in errors.items()}
    fds = open_fds()
    reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
    outcome = ""
    try:
        block = os.urandom(MIB)
        for _ in range(64):  # more than the buffers on the way hold: the reset must surface
            writer.write(block)
            await asyncio.wait_for(writer.drain(), 10)
        outcome = "eof" if await asyncio.wait_for(reader.read(), 10) == b"" else "data"
    except ConnectionResetError:
        outcome = "reset"
    except RuntimeError:
        # uvloop: the reset closed the transport between a drain and the next write, which
        # then refuses; the stream was told why.
        lost = reader.exception()
        outcome = "reset" if isinstance(lost, ConnectionResetError) else f"closed: {lost!r}"
    except TimeoutError:
        outcome = f"stalled:\n{relay_state(listener)}"
    finally:
        writer.close()
    assert outcome == "reset"
    await wait_until(lambda: listener.active == 0, what="pair closed")
    await wait_until(lambda: open_fds() <= fds, what="sockets and pipes closed")
    # Counted once, as the endpoint's reset.
    assert {side: tally.value - before[side] for side, tally in errors.items()} == {
        "endpoint": 1,
        "client": 0,
    }


@pytest.mark.parametrize("settings", [SPLICE, COPY], ids=["splice", "copy"])
async def test_a_client_reset_mid_transfer_reaches_the_endpoint_as_a_reset(
    tcp_listener: ListenerFactory,
    server: Callable[[Handler], Awaitable[Endpoint]],
    settings: DataplaneSettings,
) -> None:
    outcome: list[str] = []

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        block = os.urandom(MIB)
        try:
            for _ in range(1024):
                w.write(block)
                await w.drain()
            outcome.append("never stopped")
        except ConnectionResetError:
            outcome.append("reset")
        except BrokenPipeError:
            outcome.append("pipe")
        w.close()

    ep = await server(handle)
    listener = await tcp_listener(
        make_balancer(TCP_NAME, [ep], settings=settings), settings=settings
    )
    errors = {side: errors_of(side) for side in ("endpoint", "client")}
    before = {side: tally.value for side, tally in errors.items()}
    loop = asyncio.get_running_loop()
    client = socket.socket()
    client.setblocking(False)
    await loop.sock_connect(client, ("127.0.0.1", listener.port))
    got = 0
    while got < 4 * MIB:  # the endpoint -> client direction is spliced by now
        got += len(await loop.sock_recv(client, MIB))
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, RST)
    client.close()
    await wait_until(lambda: bool(outcome), timeout=10, what="the endpoint told")
    assert outcome == ["reset"]
    await wait_until(lambda: listener.active == 0, what="pair closed")
    assert {side: tally.value - before[side] for side, tally in errors.items()} == {
        "endpoint": 0,
        "client": 1,
    }


async def test_a_reader_that_reads_nothing_stalls_a_spliced_sender(
    tcp_listener: ListenerFactory,
    server: Callable[[Handler], Awaitable[Endpoint]],
    pipes: list[int],
) -> None:
    """Backpressure on the splice path: the pipe and the socket buffers fill, the sender
    stops; nothing grows without bound, and the stream is intact once read."""
    total = 256 * MIB
    block = os.urandom(MIB)
    sent = 0

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        nonlocal sent
        for _ in range(total // MIB):
            w.write(block)
            await w.drain()
            sent += MIB
        w.close()

    ep = await server(handle)
    listener = await tcp_listener(make_balancer(TCP_NAME, [ep], settings=SPLICE), settings=SPLICE)
    loop = asyncio.get_running_loop()
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    client.setblocking(False)
    await loop.sock_connect(client, ("127.0.0.1", listener.port))
    try:
        deadline = loop.time() + 20
        last, still_since = -1, loop.time()
        while loop.time() - still_since < 0.5:  # until the sender has made no progress for 0.5 s
            assert loop.time() < deadline, "the sender never stalled"
            await asyncio.sleep(0.05)
            if sent != last:
                last, still_since = sent, loop.time()
        assert sent < 64 * MIB, f"{sent} bytes absorbed for a reader that reads none"
        assert len(pipes) == 1
        h, got = hashlib.sha256(), 0
        while data := await asyncio.wait_for(loop.sock_recv(client, MIB), 10):
            h.update(data)
            got += len(data)
        assert (got, h.hexdigest()) == (total, hashlib.sha256(block * (total // MIB)).hexdigest())
    finally:
        client.close()


async def test_shutdown_aborts_spliced_pairs_and_closes_their_pipes(
    tcp_listener: ListenerFactory,
    server: Callable[[Handler], Awaitable[Endpoint]],
    pipes: list[int],
) -> None:
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while True:
                w.write(await r.readexactly(64 * 1024))
                await w.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            w.close()

    ep = await server(handle)
    listener = await tcp_listener(make_balancer(TCP_NAME, [ep], settings=SPLICE), settings=SPLICE)
    fds = open_fds()
    reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
    payload = os.urandom(MIB)
    writer.write(payload)
    assert await asyncio.wait_for(reader.readexactly(MIB), 10) == payload  # both ways spliced
    assert len(pipes) == 2
    await listener.shutdown(0.1)  # the client never leaves: reset after the timeout
    assert listener.active == 0
    with pytest.raises(ConnectionResetError):  # a reset: a FIN would say nothing was lost
        await asyncio.wait_for(reader.read(), 5)
    writer.close()
    await wait_until(lambda: open_fds() <= fds + 2, what="pipes closed")  # +2: our client


def _pipe_fds(pid: int) -> list[int]:
    out = []
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{name}").startswith("pipe:"):
                out.append(int(name))
        except OSError:
            pass
    return out


async def test_near_the_fd_limit_pipes_leave_fds_for_new_connections(
    backends: BackendFactory,
    proxy_child: ChildFactory,  # noqa: F811 (the fixture, imported above)
) -> None:
    """Held bulk pairs would take every fd with their pipes; the relay stops opening pipes
    while a quarter of the fd table is left, so a new connection is still served, and the
    pairs without a pipe copy instead. Also: a pipe2() failing with EMFILE is no error."""
    b = await backends("echo")
    child = await proxy_child(b.port, nofile=64)
    held: list[asyncio.StreamWriter] = []
    try:
        baseline = set(_pipe_fds(child.proc.pid))  # its stdin and stdout
        for _ in range(10):  # 10 pairs x (2 sockets + 2 pipes x 2 fds) > 64
            payload = os.urandom(512 * 1024)  # past the default threshold, each way
            reader, writer = await asyncio.open_connection("127.0.0.1", child.port)
            held.append(writer)
            writer.write(payload)
            assert await asyncio.wait_for(reader.readexactly(len(payload)), 10) == payload
        spliced = set(_pipe_fds(child.proc.pid)) - baseline
        assert spliced, "no pair was spliced"
        assert max(spliced) < child.nofile - child.nofile // 4
        payload = os.urandom(100_000)  # a new connection, while all of those are open
        assert digest(await asyncio.wait_for(_echo(child.port, payload), 10)) == digest(payload)
        # Now with no fd free at all: a pair that passes the threshold copies instead.
        reader, writer = await asyncio.open_connection("127.0.0.1", child.port)
        held.append(writer)
        writer.write(b"x")
        assert await asyncio.wait_for(reader.readexactly(1), 10) == b"x"  # linked
        assert (await child.ask("hog"))["hogged"] > 0
        payload = os.urandom(2 * MIB)
        writer.write(payload)
        assert await asyncio.wait_for(reader.readexactly(len(payload)), 10) == payload
        assert set(_pipe_fds(child.proc.pid)) - baseline == spliced
        await child.ask("unhog 1000")
    finally:
        for writer in held:
            writer.close()


async def _echo(port: int, payload: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(payload)
    writer.write_eof()
    try:
        return await reader.read()
    finally:
        writer.close()


def test_a_pipe_smaller_than_a_default_one_is_not_used() -> None:
    """Past fs.pipe-user-pages-soft a new pipe has 2 pages: copying beats splicing that."""
    fds = open_fds()
    assert splice.open_pipe(4096) is None
    pipe = splice.open_pipe(MIB)
    assert pipe is not None and pipe.size == MIB
    pipe.close()
    assert open_fds() == fds


def test_no_pipe_from_the_last_quarter_of_the_fd_table(monkeypatch: pytest.MonkeyPatch) -> None:
    r, w = os.pipe()  # where the next pipe's fds fall
    os.close(r)
    os.close(w)
    fds = open_fds()
    monkeypatch.setattr(fdreserve.FD_RESERVE, "limit", w + 2)
    assert splice.open_pipe(MIB) is None
    assert open_fds() == fds
    monkeypatch.setattr(fdreserve.FD_RESERVE, "limit", 8 * (w + 2))
    pipe = splice.open_pipe(MIB)
    assert pipe is not None
    pipe.close()


@pytest.mark.parametrize("settings", [SPLICE, COPY], ids=["splice", "copy"])
async def test_a_reset_on_a_side_not_being_read_frees_the_pair_at_once(
    tcp_listener: ListenerFactory, settings: DataplaneSettings
) -> None:
    """The endpoint reads nothing, so the client's side is not read either; its reset is
    an event all the same (no periodic check): the pair goes, the endpoint gets a RST."""
    held: list[socket.socket] = []
    sink = socket.socket()
    sink.bind(("127.0.0.1", 0))
    sink.listen(1)
    sink.setblocking(False)
    loop = asyncio.get_running_loop()
    loop.add_reader(sink.fileno(), lambda: held.append(sink.accept()[0]))
    ep = Endpoint("127.0.0.1", sink.getsockname()[1], NODE)
    listener = await tcp_listener(
        make_balancer(TCP_NAME, [ep], settings=settings), settings=settings
    )
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
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, RST)
        client.close()
        await wait_until(lambda: listener.active == 0, what="the pair let go after the reset")
        held[0].setblocking(False)
        with pytest.raises(ConnectionResetError):
            while held[0].recv(1 << 20):  # what was queued, then the reset
                pass
    finally:
        loop.remove_reader(sink.fileno())
        sink.close()
        for s in held:
            s.close()
        if client.fileno() >= 0:
            client.close()


async def test_a_spliced_source_is_not_read_while_its_pipe_is_held(
    tcp_listener: ListenerFactory,
    server: Callable[[Handler], Awaitable[Endpoint]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While the endpoint takes nothing, the spliced direction's pipe holds bytes and the
    client's input events are off (no wake per arriving segment); once the endpoint reads,
    they are on again and every byte arrives: the bulk, then a tail that no FIN follows,
    the reply whole, and the half-close after that."""
    mutes: list[bool] = []
    real = relay.Connection._mute  # the client's side: the spliced source here

    def recording(side: relay.Connection, pipe: splice.Pipe, muted: bool) -> None:
        mutes.append(muted)
        real(side, pipe, muted)

    monkeypatch.setattr(relay.Connection, "_mute", recording)
    bulk, tail, reply = os.urandom(8 * MIB), os.urandom(1000), os.urandom(3 * MIB)
    go = asyncio.Event()
    got_up: list[tuple[int, str]] = []

    received = [0]  # of the bulk, by the endpoint so far

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await go.wait()  # nothing is read until the relay has muted the client
        head = b""
        while len(head) < len(bulk):
            chunk = await r.read(len(bulk) - len(head))
            if not chunk:
                raise ConnectionError(f"EOF after {len(head)} bytes of the bulk")
            head += chunk
            received[0] = len(head)
        w.write(b"k")  # the client sends the tail only now: it arrives alone
        head += await r.readexactly(len(tail))
        await write_all(w, reply)
        rest = await read_digest(r)  # then the client's FIN
        got_up.append((len(head) + rest[0], hashlib.sha256(head).hexdigest()))
        w.close()

    ep = await server(handle)
    listener = await tcp_listener(make_balancer(TCP_NAME, [ep], settings=SPLICE), settings=SPLICE)
    reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
    step = "the bulk sent"

    async def within(what: str, waiting: Awaitable[bytes | None]) -> bytes | None:
        # A stall says where the bytes stopped, and what the relay held and watched then
        # (this test once stopped before the "k", in one run of hundreds, not seen since).
        nonlocal step
        step = what
        return await asyncio.wait_for(waiting, 10)

    try:
        sending = asyncio.ensure_future(write_all(writer, bulk))
        await wait_until(lambda: True in mutes, timeout=10, what="the client's input muted")
        go.set()
        await within("the bulk sent", sending)
        assert await within("the endpoint's k after the bulk", reader.readexactly(1)) == b"k"
        writer.write(tail)  # the connection stays open: no FIN comes after the tail
        got = await within("the reply", reader.readexactly(len(reply)))
        assert got is not None and digest(got) == digest(reply)
        writer.write_eof()
        assert await within("the endpoint's FIN", reader.read()) == b""
    except TimeoutError:
        pytest.fail(
            f"stalled waiting for {step} (mutes {mutes}, the endpoint read {received[0]} "
            f"bytes of the bulk):\n{relay_state(listener)}"
        )
    finally:
        writer.close()
    await wait_until(lambda: len(got_up) == 1, timeout=10, what="the endpoint read to EOF")
    assert got_up == [digest(bulk + tail)]
    assert mutes[:2] == [True, False]  # muted while held, on again once flushed
    await wait_until(lambda: listener.active == 0, what="pair closed")


async def _ping_pong(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, count: int, size: int
) -> None:
    """``count`` messages of ``size`` bytes, each echoed back whole before the next."""
    for _ in range(count):
        message = os.urandom(size)
        writer.write(message)
        assert await asyncio.wait_for(reader.readexactly(size), 5) == message


async def test_small_messages_on_a_long_keep_alive_connection_never_open_a_pipe(
    backends: BackendFactory, tcp_listener: ListenerFactory, pipes: list[int]
) -> None:
    """3,000 request/response pairs of 100 bytes: 300 KB each way, past the 64 KiB
    threshold, in reads far below a bulk transfer's: copied, never spliced."""
    b = await backends("echo")
    listener = await tcp_listener(
        make_balancer(TCP_NAME, [b.endpoint], settings=SPLICE), settings=SPLICE
    )
    to_endpoint = metrics.BYTES.labels(str(TCP_NAME), "to_endpoint")
    before = to_endpoint.value
    reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
    try:
        await _ping_pong(reader, writer, 3000, 100)
    finally:
        writer.close()
    assert to_endpoint.value - before == 300_000
    assert pipes == []


async def test_a_spliced_direction_copies_again_once_its_bulk_is_over(
    backends: BackendFactory, tcp_listener: ListenerFactory, pipes: list[int]
) -> None:
    """A bulk transfer each way opens both pipes; the small messages after it close them
    (the connection stays open); the next bulk transfer opens new ones."""
    b = await backends("echo")
    listener = await tcp_listener(
        make_balancer(TCP_NAME, [b.endpoint], settings=SPLICE), settings=SPLICE
    )
    own = len(_pipe_fds(os.getpid()))  # the loop's own (its self-pipe)
    reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
    try:
        for round_ in (1, 2):
            bulk = os.urandom(4 * MIB)
            writer.write(bulk)
            got = await asyncio.wait_for(reader.readexactly(len(bulk)), 10)
            assert digest(got) == digest(bulk)
            assert len(pipes) == 2 * round_  # both directions spliced
            assert len(_pipe_fds(os.getpid())) == own + 4
            await _ping_pong(reader, writer, 20, 100)
            await wait_until(lambda: len(_pipe_fds(os.getpid())) == own, what="pipes closed")
            assert listener.active == 1  # the pair goes on
    finally:
        writer.close()


async def test_what_a_spliced_direction_holds_when_its_endpoint_resets_reaches_the_client(
    tcp_listener: ListenerFactory, pipes: list[int]
) -> None:
    """An endpoint sends 4 MiB and resets while its client has read nothing yet: a direct
    client reads the 4 MiB, then the reset. Spliced, the pair was reset at once, the pipe's
    bytes and the client socket's queue with it (113,152 of 5,000,000 bytes in the repro)."""
    server = _ReplyThenReset(4 << 20, abort=True)
    loop = asyncio.get_running_loop()
    endpoint = Endpoint("127.0.0.1", server.port, NODE)
    listener = await tcp_listener(make_balancer(TCP_NAME, [endpoint], settings=SPLICE))
    try:
        client = socket.socket()
        client.setblocking(False)
        with client:
            await loop.sock_connect(client, ("127.0.0.1", listener.port))
            await loop.sock_sendall(client, b"GET")
            await wait_until(functools.partial(server.reset_past, 0), what="the reset")
            assert pipes, "the reply was not spliced"
            got, reset = await read_to_the_end(client, 20)
            assert (len(got), digest(got)) == (len(server.payload), digest(server.payload))
            assert reset, "the end was not a reset"
    finally:
        server.close()
