"""Many pairs at once, each with its own mix of sizes, pacing, half-closes and resets, over
both paths.

The other relay tests each hold one pattern still. Here 48 pairs run side by side, each
drawn from a seed: how much each side sends (nothing, a few bytes, up to 12 MiB), in what
pieces, with what pauses, how fast each side reads (slow and late readers fill the relay's
socket buffers: its sends fall short, the copy path holds bytes back and the splice path
mutes its source; four pairs of each run make sure of it), which side half-closes first,
and, in one pair of five, which side resets the pair after how much of its stream. A low
splice threshold and small pipes make directions switch between copying and splicing; the
test checks that each of those paths was taken. A pair that was not reset must carry every
byte both ways (length and sha256); across a reset, the other side must be told (a reset,
never a clean end) and must have read only the start of the stream. Every pair must finish,
and a pair that stops moving fails the test with what each of its sides holds and waits for
(``relay_state``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import random
import socket
import struct
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pytest

from tests.dataplane.conftest import (
    TCP_NAME,
    ListenerFactory,
    make_balancer,
    open_fds,
    relay_state,
    wait_until,
)
from uproxy.dataplane import relay, splice
from uproxy.dataplane.settings import DataplaneSettings
from uproxy.model import Endpoint

KIB = 1024
MIB = KIB * KIB
PAIRS = 48
RST = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends a RST
HEADER = struct.Struct("!Q")  # the pair's seed: the endpoint draws the same plans from it
SMALL_BUFFER = 48 * KIB  # the test's sockets' receive buffers: the relay's sends fall short
# Bulk directions splice early and in small pipes; a read of the copy path is 32 KiB.
MIXED = DataplaneSettings(high_water=32 * KIB, splice_threshold=64 * KIB, splice_pipe_size=64 * KIB)
COPY = DataplaneSettings(high_water=32 * KIB, splice_threshold=None)


@dataclass(frozen=True)
class Plan:
    """What one side of one pair does: the bytes it sends, in which pieces and with which
    pauses, how it reads (piece size, pause after a read), and whether it resets the pair
    after some of its bytes (``abort_after``)."""

    size: int
    pieces: tuple[int, ...]
    write_pause_s: float
    read_size: int
    read_pause_s: float
    # A reader that starts late lets the buffers on the way fill up; None: it starts once
    # the relay's sends have fallen short (``Seen.fell_short``, at most 5 s).
    read_after_s: float | None
    abort_after: int | None = None  # bytes of its stream, then a RST instead of the rest

    @staticmethod
    def draw(rng: random.Random) -> Plan:
        kind = rng.random()
        if kind < 0.15:
            size = 0
        elif kind < 0.45:
            size = rng.randrange(1, 16 * KIB)
        elif kind < 0.75:
            size = rng.randrange(16 * KIB, 512 * KIB)
        elif kind < 0.92:
            size = rng.randrange(512 * KIB, 4 * MIB)
        else:  # more than the socket buffers on the way hold
            size = rng.randrange(8 * MIB, 12 * MIB)
        pieces: list[int] = []
        left = size
        while left:
            piece = min(left, rng.choice((1, 100, 1460, 16 * KIB, 64 * KIB, 256 * KIB, MIB)))
            pieces.append(piece)
            left -= piece
        return Plan(
            size=size,
            pieces=tuple(pieces),
            write_pause_s=rng.choice((0.0, 0.0, 0.0005, 0.002)),
            read_size=rng.choice((512, 4 * KIB, 64 * KIB, MIB)),
            read_pause_s=rng.choice((0.0, 0.0, 0.001, 0.004)),
            read_after_s=rng.choice((0.0, 0.0, 0.05, 0.2)),
        )

    def stream(self, seed: int) -> bytes:
        return random.Random(seed).randbytes(self.size)


@dataclass(frozen=True)
class Pair:
    seed: int
    client: Plan
    endpoint: Plan
    client_closes_first: bool  # its FIN before it reads the reply, or after

    @staticmethod
    def draw(seed: int) -> Pair:
        rng = random.Random(seed)
        client, endpoint = Plan.draw(rng), Plan.draw(rng)
        closes_first = rng.random() < 0.5
        if seed % 100 < 8:
            # Four pairs of each run (two each way) send 10 MiB to a reader that waits
            # until the relay's sends fall short: whatever the draw, they do in every run.
            sender = dataclasses.replace(client, size=10 * MIB, pieces=(MIB,) * 10)
            reader = dataclasses.replace(endpoint, read_after_s=None)
            client, endpoint = (reader, sender) if seed // 2 % 2 else (sender, reader)
        elif rng.random() < 0.2:
            # One pair in five resets mid-stream, from either side, after some of its bytes
            # (none at all, or all of them but the FIN).
            if rng.random() < 0.5:
                client = dataclasses.replace(client, abort_after=rng.randrange(client.size + 1))
            else:
                endpoint = dataclasses.replace(
                    endpoint, abort_after=rng.randrange(endpoint.size + 1)
                )
        return Pair(seed, client, endpoint, closes_first)


class Aborted(Exception):
    """This side reset the pair, as its plan said."""


# What the other side of a reset may see on its next read or write: the reset itself, a
# write into a socket it closed, a shutdown of a socket no longer connected (ENOTCONN), or
# (uvloop) a write refused by a transport already closed. Caught for every pair: one that
# was not reset then fails on what it read.
PEER_GONE = (OSError, RuntimeError)


def small_buffers(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SMALL_BUFFER)


async def send(writer: asyncio.StreamWriter, plan: Plan, data: bytes) -> None:
    """Sends ``data`` as ``plan`` says, then a FIN; or, with ``abort_after``, that much of it
    and a RST (raises ``Aborted``). A reset from the peer propagates (``PEER_GONE``)."""
    limit = plan.size if plan.abort_after is None else plan.abort_after
    at = 0
    for piece in plan.pieces:
        piece = min(piece, limit - at)
        if piece <= 0:
            break
        writer.write(data[at : at + piece])
        at += piece
        await writer.drain()
        if plan.write_pause_s:
            await asyncio.sleep(plan.write_pause_s)
    if plan.abort_after is not None:
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, RST)
        writer.transport.abort()
        raise Aborted
    writer.write_eof()


@dataclass(frozen=True)
class Read:
    """What one side read of its peer's stream: how much, its sha256, and how it ended
    (``error``: None for a clean EOF, else the exception's name)."""

    size: int
    sha256: str
    error: str | None = None


def complete(data: bytes) -> Read:
    return Read(len(data), hashlib.sha256(data).hexdigest())


async def read_all(reader: asyncio.StreamReader, plan: Plan, size: int, seen: Seen) -> Read:
    """Reads the peer's ``size`` bytes to EOF (or a reset) in ``plan``'s pieces, pausing at
    most about 50 times (a slow reader, in bounded time)."""
    digest = hashlib.sha256()
    total = reads = 0
    every = max(1, size // plan.read_size // 50)
    if plan.read_after_s is None:
        with contextlib.suppress(TimeoutError):  # the test's checks say if it never did
            await asyncio.wait_for(seen.fell_short.wait(), 5)
    else:
        await asyncio.sleep(plan.read_after_s)
    try:
        while chunk := await reader.read(plan.read_size):
            digest.update(chunk)
            total += len(chunk)
            reads += 1
            if plan.read_pause_s and reads % every == 0:
                await asyncio.sleep(plan.read_pause_s)
    except PEER_GONE as exc:
        return Read(total, digest.hexdigest(), type(exc).__name__)
    return Read(total, digest.hexdigest())


async def play(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    plan: Plan,
    data: bytes,
    peer_size: int,
    closes_first: bool,
    seen: Seen,
) -> Read | None:
    """One side of a pair: send ``data`` and read the peer's stream, one after the other
    (``closes_first``) or at once. What it read; None when this side reset the pair."""
    reading = None if closes_first else asyncio.create_task(read_all(reader, plan, peer_size, seen))
    try:
        await send(writer, plan, data)
    except Aborted:
        if reading is not None:
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)
        return None
    except PEER_GONE:
        pass  # the peer reset the pair: the read ends with it too
    got = await (reading if reading is not None else read_all(reader, plan, peer_size, seen))
    writer.close()
    return got


@dataclass
class Seen:
    """What the relay did on the way: sends that fell short (the rest held back), flushes of
    what was held once the reader made room, pipes opened, sources muted and unmuted, and
    directions that went back to copying."""

    tally: Counter[str] = dataclasses.field(default_factory=Counter)
    fell_short: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> Seen:
    out = Seen()

    def counted(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            result = real(*args)
            if name != "pipe" or result is not None:
                out.tally[name] += 1
            if name == "fell short":
                out.fell_short.set()
            return result

        return call

    monkeypatch.setattr(splice, "open_pipe", counted("pipe", splice.open_pipe))
    for side in (relay.Connection, relay._EndpointSide):
        monkeypatch.setattr(side, "watch_writes", counted("fell short", side.watch_writes))
        monkeypatch.setattr(side, "flush", counted("flushed", side.flush))
        monkeypatch.setattr(side, "_mute", counted("mute", side._mute))
        monkeypatch.setattr(side, "_stop_splice", counted("back to copying", side._stop_splice))
    return out


@dataclass
class Endpoints:
    """What the endpoint read of each pair's client stream, by seed (None: it reset the
    pair itself), and its connections still being served."""

    received: dict[int, Read | None] = dataclasses.field(default_factory=dict)
    serving: set[asyncio.Task[None]] = dataclasses.field(default_factory=set)


@pytest.fixture
async def endpoint(seen: Seen) -> AsyncIterator[tuple[Endpoint, Endpoints]]:
    """An endpoint that plays each pair's endpoint plan."""
    out = Endpoints()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        out.serving.add(task)
        try:
            try:
                small_buffers(writer.get_extra_info("socket"))
                (seed,) = HEADER.unpack(await reader.readexactly(HEADER.size))
            except (asyncio.IncompleteReadError, *PEER_GONE):
                writer.close()  # a client that reset before its header arrived
                return
            pair = Pair.draw(seed)
            plan = pair.endpoint
            out.received[seed] = await play(
                reader, writer, plan, plan.stream(seed + 1), pair.client.size, False, seen
            )
        finally:
            out.serving.discard(task)

    server = await asyncio.start_server(handle, "127.0.0.1", 0, limit=64 * KIB)
    port = server.sockets[0].getsockname()[1]
    yield Endpoint("127.0.0.1", port, node_name="node-a", ready=True), out
    server.close()
    await server.wait_closed()


async def run_pair(port: int, pair: Pair, seen: Seen) -> Read | None:
    """The client's side of ``pair``: what it read of the endpoint's reply (None: it reset
    the pair)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=64 * KIB)
    small_buffers(writer.get_extra_info("socket"))
    plan = pair.client
    writer.write(HEADER.pack(pair.seed))
    return await play(
        reader,
        writer,
        plan,
        plan.stream(pair.seed),
        pair.endpoint.size,
        pair.client_closes_first,
        seen,
    )


def check_reset(pair: int, what: str, got: Read | None, stream: bytes, sent: int) -> None:
    """The side that did not reset the pair: it was told (never a clean EOF), and what it
    read was the start of the other side's stream, no more than that side sent."""
    assert got is not None and got.error is not None, f"pair {pair}: {what} not reset: {got}"
    assert got.size <= sent, f"pair {pair}: {what} read {got.size} bytes of {sent} sent"
    assert got.sha256 == hashlib.sha256(stream[: got.size]).hexdigest(), f"pair {pair}: {what}"


@pytest.mark.parametrize("settings", [MIXED, COPY], ids=["splice", "copy"])
@pytest.mark.parametrize("base", [1000, 2000])
async def test_48_mixed_pairs_at_once_every_byte_both_ways(
    tcp_listener: ListenerFactory,
    endpoint: tuple[Endpoint, Endpoints],
    settings: DataplaneSettings,
    base: int,
    seen: Seen,
) -> None:
    ep, served = endpoint
    listener = await tcp_listener(
        make_balancer(TCP_NAME, [ep], settings=settings), settings=settings
    )
    pairs = [Pair.draw(base + i * 2) for i in range(PAIRS)]
    fds = open_fds()
    runs = [asyncio.create_task(run_pair(listener.port, pair, seen)) for pair in pairs]
    _, pending = await asyncio.wait(runs, timeout=30)
    if pending:
        state = relay_state(listener)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        pytest.fail(f"{len(pending)} of {PAIRS} pairs stopped moving (seeds from {base}):\n{state}")
    # A client is done once it has read the whole reply; its own bytes may still be on
    # their way, and a reset may still be reaching the endpoint.
    await wait_until(lambda: listener.active == 0, what="every pair closed")
    await wait_until(lambda: not served.serving, timeout=10, what="the endpoint done")
    resets = 0
    for pair, run in zip(pairs, runs, strict=True):
        up, down = pair.client.stream(pair.seed), pair.endpoint.stream(pair.seed + 1)
        got_down, got_up = run.result(), served.received.get(pair.seed)
        if pair.client.abort_after is not None:
            resets += 1
            assert got_down is None
            if pair.seed in served.received:  # else the reset came before the header
                check_reset(pair.seed, "endpoint", got_up, up, pair.client.abort_after)
        elif pair.endpoint.abort_after is not None:
            resets += 1
            assert got_up is None, f"pair {pair.seed}"
            check_reset(pair.seed, "client", got_down, down, pair.endpoint.abort_after)
        else:
            assert got_down == complete(down), f"reply of pair {pair.seed}"
            assert got_up == complete(up), f"pair {pair.seed}"
    assert resets > 0
    await wait_until(lambda: open_fds() <= fds, what="sockets and pipes closed")
    # The paths under test were taken: sends that fell short and what they held back sent
    # once the reader made room; with splicing on, pipes, muted sources, and directions
    # that went back to copying.
    tally = seen.tally
    assert min(tally["fell short"], tally["flushed"]) > 0, tally
    if settings.splice_threshold is None:
        assert tally["pipe"] == 0, tally
    else:
        assert min(tally["pipe"], tally["mute"], tally["back to copying"]) > 0, tally
