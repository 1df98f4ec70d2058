"""Resource bounds, measured on a listener running in its own process."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from tests.dataplane.conftest import BackendFactory, digest, wait_until

ROOT = Path(__file__).resolve().parents[2]


class Child:
    def __init__(self, proc: asyncio.subprocess.Process, port: int, nofile: int) -> None:
        self.proc = proc
        self.port = port
        self.nofile = nofile

    async def stats(self) -> dict[str, Any]:
        return await self.ask("stats")

    async def ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command.encode() + b"\n")
        await self.proc.stdin.drain()
        line = await asyncio.wait_for(self.proc.stdout.readline(), 5)
        assert line, "the proxy process died"
        result: dict[str, Any] = json.loads(line)
        return result


ChildFactory = Callable[..., Awaitable[Child]]


@pytest.fixture
async def proxy_child() -> AsyncIterator[ChildFactory]:
    procs: list[asyncio.subprocess.Process] = []

    async def start(backend_port: int, *, nofile: int | None = None, extra_fds: int = 0) -> Child:
        args = [sys.executable, "-m", "tests.dataplane.proxy_child"]
        args += ["--backend", f"127.0.0.1:{backend_port}", "--extra-fds", str(extra_fds)]
        if nofile is not None:
            args += ["--nofile", str(nofile)]
        proc = await asyncio.create_subprocess_exec(
            *args,
            cwd=ROOT,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        procs.append(proc)
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 10)).split()
        assert line[:1] == [b"PORT"], line
        return Child(proc, int(line[1]), int(line[3]))

    yield start
    for proc in procs:
        if proc.returncode is None:
            assert proc.stdin is not None
            proc.stdin.close()
            try:
                await asyncio.wait_for(proc.wait(), 5)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def test_slow_reader_does_not_make_the_proxy_buffer_without_bound(
    proxy_child: ChildFactory,
) -> None:
    total = 256 << 20
    block = os.urandom(1 << 20)
    sent = 0

    async def source(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        nonlocal sent
        for _ in range(total // len(block)):
            w.write(block)
            await w.drain()
            sent += len(block)
        w.close()

    server = await asyncio.start_server(source, "127.0.0.1", 0)
    try:
        child = await proxy_child(server.sockets[0].getsockname()[1])
        base_rss = (await child.stats())["rss_kib"]
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        client.connect(("127.0.0.1", child.port))
        client.setblocking(False)
        # The client reads nothing: wait until the source is stalled (no progress for 0.5 s).
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        last, still_since, peak = -1, loop.time(), base_rss
        while loop.time() - still_since < 0.5:
            assert loop.time() < deadline, "the source never stalled"
            await asyncio.sleep(0.05)
            peak = max(peak, (await child.stats())["rss_kib"])
            if sent != last:
                last, still_since = sent, loop.time()
        assert sent < 64 << 20, f"the proxy absorbed {sent} bytes for a reader that reads none"
        assert peak - base_rss < 16 * 1024, f"proxy RSS grew {peak - base_rss} KiB"
        # Now read everything: the stream is intact after being throttled.
        h = hashlib.sha256()
        got = 0
        deadline = loop.time() + 60
        while True:
            assert loop.time() < deadline, "reading 256 MiB took too long"
            try:
                data = client.recv(1 << 20)
            except BlockingIOError:
                await asyncio.sleep(0.001)
                continue
            if not data:
                break
            h.update(data)
            got += len(data)
            if got % (16 << 20) < len(data):
                peak = max(peak, (await child.stats())["rss_kib"])
        client.close()
        expected = hashlib.sha256(block * (total // len(block))).hexdigest()
        assert (got, h.hexdigest()) == (total, expected)
        assert peak - base_rss < 16 * 1024, f"proxy RSS grew {peak - base_rss} KiB"
    finally:
        server.close()
        await server.wait_closed()


async def echo_each(
    clients: list[socket.socket], *, want: int, deadline_s: float
) -> dict[str, int]:
    """Send a distinct payload on every client; count the echoes that come back whole.

    Stops once ``want`` echoes are back (or at the deadline): clients still in the listen
    backlog get nothing back. A client whose connection was reset counts as ``reset``.
    """
    payloads = [os.urandom(1000) for _ in clients]
    got = [bytearray() for _ in clients]
    counts = {"ok": 0, "corrupt": 0, "reset": 0}
    open_ = set(range(len(clients)))
    for i, (s, p) in enumerate(zip(clients, payloads, strict=True)):
        try:
            s.send(p)  # 1000 bytes fit in any socket buffer: never blocks
        except ConnectionError:
            counts["reset"] += 1
            open_.discard(i)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + deadline_s
    while open_ and counts["ok"] + counts["corrupt"] < want and loop.time() < deadline:
        for i in list(open_):
            try:
                data = clients[i].recv(4096)
            except BlockingIOError:
                continue
            except ConnectionError:
                counts["reset"] += 1
                open_.discard(i)
                continue
            got[i] += data
            if not data or len(got[i]) >= len(payloads[i]):
                counts["ok" if bytes(got[i]) == payloads[i] else "corrupt"] += 1
                open_.discard(i)
        await asyncio.sleep(0.02)
    return counts


# Where the limit falls against the fds a pair takes (two) matters: both parities.
@pytest.mark.parametrize("extra_fds", [0, 1])
async def test_emfile_pauses_accepting_and_serves_again(
    backends: BackendFactory, proxy_child: ChildFactory, extra_fds: int
) -> None:
    b = await backends("echo")
    child = await proxy_child(b.port, nofile=48, extra_fds=extra_fds)
    assert child.nofile == 48
    clients: list[socket.socket] = []
    # The whole burst arrives while the proxy is stopped, so it finds all 60 in its listen
    # backlog at once: the worst case for the fds (the kernel completes the handshakes).
    os.kill(child.proc.pid, signal.SIGSTOP)
    try:
        for _ in range(60):  # each relayed pair needs 2 fds: far more than 48 allows
            s = socket.create_connection(("127.0.0.1", child.port), timeout=5)
            s.setblocking(False)
            clients.append(s)
        os.kill(child.proc.pid, signal.SIGCONT)
        stats: dict[str, Any] = {}

        async def paused() -> bool:
            nonlocal stats
            stats = await child.stats()
            return bool(stats["paused"] >= 1)

        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while not await paused():
            assert loop.time() < deadline, f"accepting never paused: {stats}"
            await asyncio.sleep(0.05)
        assert 0 < stats["active"] <= 48  # fds, not clients, bound what is accepted
        assert child.proc.returncode is None
        # What was accepted at the limit is relayed, not reset: accepting stopped while
        # there were still fds for the dials (a burst that takes every fd gets nothing).
        echoed = await echo_each(clients, want=stats["active"], deadline_s=5)
        assert echoed["corrupt"] == 0, echoed
        assert echoed["reset"] == 0, (echoed, stats)
        assert echoed["ok"] >= 1, (echoed, stats)
    finally:
        os.kill(child.proc.pid, signal.SIGCONT)
        for s in clients:
            s.close()
    await wait_until(lambda: b.open == 0, timeout=10, what="backend connections closed")
    deadline = asyncio.get_running_loop().time() + 10
    while (await child.stats())["active"] != 0:
        assert asyncio.get_running_loop().time() < deadline, "pairs never closed"
        await asyncio.sleep(0.05)
    stats = await child.stats()
    # Paused and retried every 0.1 s, not spinning: a handful of pauses over a few seconds.
    assert 1 <= stats["paused"] < 100, stats
    # Serving again: a fresh connection is relayed end to end. Connections the clients
    # closed while they sat in the backlog are still being accepted and dialed, so a few
    # attempts may meet the last EMFILE and be reset; a bounded number of retries.
    payload = os.urandom(100_000)
    outcomes: list[str] = []
    for _ in range(50):
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", child.port)
            writer.write(payload)
            writer.write_eof()
            got = await asyncio.wait_for(reader.read(), 5)
            writer.close()
            outcomes.append("ok" if got == payload else f"short:{len(got)}")
        except ConnectionError as exc:
            outcomes.append(type(exc).__name__)
        if outcomes[-1] == "ok":
            break
        await asyncio.sleep(0.1)
    assert outcomes[-1] == "ok", outcomes
    assert child.proc.returncode is None


async def receive(sock: socket.socket, n: int, deadline_s: float) -> bytes:
    """Up to ``n`` bytes from a non-blocking client, by the deadline or its EOF.

    Raises ConnectionError if the proxy reset the connection.
    """
    got = bytearray()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + deadline_s
    while len(got) < n and loop.time() < deadline:
        try:
            data = sock.recv(65536)
        except BlockingIOError:
            await asyncio.sleep(0.02)
            continue
        if not data:
            break
        got += data
    return bytes(got)


async def starve(child: Child, holder: socket.socket | None) -> socket.socket:
    """Fill the proxy's fd table but one fd, then connect a client.

    The proxy (accepting: nothing paused it) accepts the client into that last fd and has
    none left to dial with: the case the accept-side reserve cannot foresee (the fds went
    to something else since the last accept).
    """
    assert (await child.ask("hog"))["hogged"] > 0
    await child.ask("unhog 1")
    client = socket.create_connection(("127.0.0.1", child.port), timeout=5)
    client.setblocking(False)
    want_active = 2 if holder is not None else 1
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while (await child.stats())["active"] != want_active:
        assert loop.time() < deadline, "the client was never accepted"
        await asyncio.sleep(0.02)
    return client


async def test_a_dial_out_of_fds_waits_for_a_pair_to_close(
    backends: BackendFactory, proxy_child: ChildFactory
) -> None:
    b = await backends("echo")
    child = await proxy_child(b.port, nofile=48)
    holder = socket.create_connection(("127.0.0.1", child.port), timeout=5)
    holder.setblocking(False)
    first = os.urandom(1000)
    holder.send(first)
    assert await receive(holder, len(first), 5) == first
    client = await starve(child, holder)
    try:
        payload = os.urandom(50_000)
        client.sendall(payload)  # fits the socket buffers: the proxy holds it while dialing
        # Accepted, and its dial met EMFILE: held and waiting, neither relayed nor reset.
        assert await receive(client, len(payload), 0.5) == b""
        assert (await child.stats())["active"] == 2
        holder.close()  # its pair closes and frees two fds: the waiting dial goes ahead
        got = await receive(client, len(payload), 5)
        assert digest(got) == digest(payload)
        # No endpoint failed: a dial without an fd is no attempt (it was counted as one).
        assert (await child.stats())["dials_failed"] == 0
    finally:
        client.close()
        holder.close()
        await child.ask("unhog 1000")


async def test_a_dial_that_never_gets_an_fd_is_reset_within_the_dial_budget(
    backends: BackendFactory, proxy_child: ChildFactory
) -> None:
    b = await backends("echo")
    child = await proxy_child(b.port, nofile=48)
    client = await starve(child, None)
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        outcome = ""
        while not outcome:
            assert loop.time() - started < 15, "the waiting dial never gave up"
            try:
                data = client.recv(1)
            except BlockingIOError:
                await asyncio.sleep(0.05)
                continue
            except ConnectionResetError:
                outcome = "reset"
                continue
            outcome = f"data:{data!r}"
        # Given up after the dial budget (0.25 + 0.5 + 1 + 2 s), with a reset: the client
        # learns at once that nothing will come, instead of hanging on a silent connection.
        assert outcome == "reset"
        assert loop.time() - started >= 3.0
        assert (await child.stats())["active"] == 0
    finally:
        client.close()
        await child.ask("unhog 1000")


@pytest.mark.parametrize("extra_fds", [0, 1])
async def test_out_of_fds_a_queued_client_waits_in_the_backlog_and_is_not_reset(
    backends: BackendFactory, proxy_child: ChildFactory, extra_fds: int
) -> None:
    """Pairs that stay open hold every fd. A client that comes then used to be accepted
    into the last fd at every retry of the paused accept, had no fd to dial with, waited out
    the dial budget and was reset: one client lost every few seconds for as long as the
    limit lasted. It now waits in the backlog until a pair closes, and is served."""
    b = await backends("echo")
    child = await proxy_child(b.port, nofile=48, extra_fds=extra_fds)
    holders: list[socket.socket] = []
    try:
        while (await child.stats())["paused"] == 0:  # fill the fd table with open pairs
            assert len(holders) < 40, "accepting never paused"
            s = socket.create_connection(("127.0.0.1", child.port), timeout=5)
            s.setblocking(False)
            holders.append(s)
            s.send(b"x")
            assert await receive(s, 1, 5) == b"x"
        late = socket.create_connection(("127.0.0.1", child.port), timeout=5)
        late.setblocking(False)
        payload = os.urandom(1000)
        late.send(payload)
        # Longer than the dial budget (3.75 s): neither reset nor answered, it waits.
        loop = asyncio.get_running_loop()
        until = loop.time() + 5
        while loop.time() < until:
            with pytest.raises(BlockingIOError):
                late.recv(1)  # a reset would raise ConnectionResetError here
            await asyncio.sleep(0.1)
        holders.pop().close()  # a pair closes: two fds
        got = await receive(late, len(payload), 5)
        assert digest(got) == digest(payload)
        assert (await child.stats())["dials_failed"] == 0
        late.close()
    finally:
        for s in holders:
            s.close()
