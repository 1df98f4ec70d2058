"""Many pairs at once, each with its own mix of sizes, pacing and half-closes, over both paths.

The other relay tests each hold one pattern still. Here 48 pairs run side by side, each
drawn from a seed: how much each side sends (nothing, a few bytes, up to 12 MiB), in what
pieces, with what pauses, how fast each side reads (slow and late readers fill the relay's
socket buffers: its sends fall short, the copy path holds bytes back and the splice path
mutes its source; four pairs of each run make sure of it), and which side half-closes
first. A low splice threshold and small pipes make directions switch between copying and
splicing. The test checks that each of those paths was taken. Every byte is checked both ways
(length and sha256), every pair must finish, and a pair that stops moving fails the test
with what each of its sides holds and waits for (``relay_state``).
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
HEADER = struct.Struct("!QQ")  # the pair's seed, then how many bytes the client sends
SMALL_BUFFER = 48 * KIB  # the test's sockets' receive buffers: the relay's sends fall short
# Bulk directions splice early and in small pipes; a read of the copy path is 32 KiB.
MIXED = DataplaneSettings(high_water=32 * KIB, splice_threshold=64 * KIB, splice_pipe_size=64 * KIB)
COPY = DataplaneSettings(high_water=32 * KIB, splice_threshold=None)


@dataclass(frozen=True)
class Plan:
    """What one side of one pair does: the bytes it sends, in which pieces and with which
    pauses, and how it reads (piece size, pause after a read)."""

    size: int
    pieces: tuple[int, ...]
    write_pause_s: float
    read_size: int
    read_pause_s: float
    # A reader that starts late lets the buffers on the way fill up; None: it starts once
    # the relay's sends have fallen short (``Seen.fell_short``, at most 5 s).
    read_after_s: float | None

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
        if seed % 100 < 8:
            # Four pairs of each run (two each way) send 10 MiB to a reader that waits
            # until the relay's sends fall short: whatever the draw, they do in every run.
            sender = dataclasses.replace(client, size=10 * MIB, pieces=(MIB,) * 10)
            reader = dataclasses.replace(endpoint, read_after_s=None)
            client, endpoint = (reader, sender) if seed // 2 % 2 else (sender, reader)
        return Pair(seed, client, endpoint, rng.random() < 0.5)


def small_buffers(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SMALL_BUFFER)


async def send(writer: asyncio.StreamWriter, plan: Plan, data: bytes) -> None:
    at = 0
    for piece in plan.pieces:
        writer.write(data[at : at + piece])
        at += piece
        await writer.drain()
        if plan.write_pause_s:
            await asyncio.sleep(plan.write_pause_s)


async def read_all(
    reader: asyncio.StreamReader, plan: Plan, size: int, seen: Seen
) -> tuple[int, str]:
    """Reads the peer's ``size`` bytes to EOF in ``plan``'s pieces, pausing at most about
    50 times (a slow reader, in bounded time): (length, sha256)."""
    digest = hashlib.sha256()
    total = reads = 0
    every = max(1, size // plan.read_size // 50)
    if plan.read_after_s is None:
        with contextlib.suppress(TimeoutError):  # the test's checks say if it never did
            await asyncio.wait_for(seen.fell_short.wait(), 5)
    else:
        await asyncio.sleep(plan.read_after_s)
    while chunk := await reader.read(plan.read_size):
        digest.update(chunk)
        total += len(chunk)
        reads += 1
        if plan.read_pause_s and reads % every == 0:
            await asyncio.sleep(plan.read_pause_s)
    return total, digest.hexdigest()


def expected(data: bytes) -> tuple[int, str]:
    return len(data), hashlib.sha256(data).hexdigest()


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


@pytest.fixture
async def endpoint(seen: Seen) -> AsyncIterator[tuple[Endpoint, dict[int, tuple[int, str]]]]:
    """An endpoint that plays each pair's endpoint plan: what it read, by seed."""
    received: dict[int, tuple[int, str]] = {}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        small_buffers(writer.get_extra_info("socket"))
        seed, _ = HEADER.unpack(await reader.readexactly(HEADER.size))
        pair = Pair.draw(seed)
        plan = pair.endpoint
        reply = plan.stream(seed + 1)

        async def reply_then_fin() -> None:
            await send(writer, plan, reply)
            writer.write_eof()

        replying = asyncio.create_task(reply_then_fin())
        received[seed] = await read_all(reader, plan, pair.client.size, seen)
        await replying
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, limit=64 * KIB)
    port = server.sockets[0].getsockname()[1]
    yield Endpoint("127.0.0.1", port, node_name="node-a", ready=True), received
    server.close()
    await server.wait_closed()


async def run_pair(port: int, pair: Pair, seen: Seen) -> tuple[int, str]:
    """The client's side of ``pair``: what it read of the endpoint's reply."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=64 * KIB)
    small_buffers(writer.get_extra_info("socket"))
    data = pair.client.stream(pair.seed)
    try:
        writer.write(HEADER.pack(pair.seed, len(data)))
        if pair.client_closes_first:
            await send(writer, pair.client, data)
            writer.write_eof()
            return await read_all(reader, pair.client, pair.endpoint.size, seen)
        reading = asyncio.create_task(read_all(reader, pair.client, pair.endpoint.size, seen))
        await send(writer, pair.client, data)
        writer.write_eof()
        return await reading
    finally:
        writer.close()


@pytest.mark.parametrize("settings", [MIXED, COPY], ids=["splice", "copy"])
@pytest.mark.parametrize("base", [1000, 2000])
async def test_48_mixed_pairs_at_once_every_byte_both_ways(
    tcp_listener: ListenerFactory,
    endpoint: tuple[Endpoint, dict[int, tuple[int, str]]],
    settings: DataplaneSettings,
    base: int,
    seen: Seen,
) -> None:
    ep, received = endpoint
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
    # A client is done once it has the whole reply; its own bytes may still be on their way.
    await wait_until(lambda: len(received) == PAIRS, timeout=30, what="the endpoint read all")
    for pair, run in zip(pairs, runs, strict=True):
        reply = pair.endpoint.stream(pair.seed + 1)
        assert run.result() == expected(reply), f"reply of pair {pair.seed}"
        assert received[pair.seed] == expected(pair.client.stream(pair.seed)), f"pair {pair.seed}"
    await wait_until(lambda: listener.active == 0, what="every pair closed")
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
