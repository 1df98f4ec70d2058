"""EdgePoller: events reach the handler of the socket they belong to, and no batch is lost."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable

import pytest

from tests.dataplane.conftest import wait_until
from uproxy.dataplane import poller as poller_module
from uproxy.dataplane.poller import (
    READ_EVENTS,
    EdgePoller,
    ReadPoller,
    io_waiting,
    poller_for,
    read_poller_for,
)


class Recorder:
    def __init__(self, name: str, calls: list[str], then: Callable[[], None] | None = None):
        self.name = name
        self.calls = calls
        self.then = then

    def event(self, mask: int) -> None:
        self.calls.append(self.name)
        if self.then is not None:
            self.then()


async def test_an_event_of_a_closed_fd_never_reaches_the_socket_that_reuses_the_number() -> None:
    poller = EdgePoller(asyncio.get_running_loop())
    x, x_peer = socket.socketpair()
    y, y_peer = socket.socketpair()
    calls: list[str] = []
    reused: list[int] = []

    def close_y_and_reuse_its_fd() -> None:
        # What a relay may do within one batch: close a socket, then another opens one
        # that gets the same fd number (a dial), and registers it.
        fd = y.fileno()
        poller.forget(fd)
        y.close()
        a, b = socket.socketpair()
        if a.fileno() != fd:
            os.dup2(a.fileno(), fd)  # the new socket, at the old number
            a.close()
        else:
            a.detach()
        reused.extend([fd, b.detach()])
        poller.register(fd, Recorder("new", calls), READ_EVENTS)

    poller.register(x.fileno(), Recorder("x", calls, close_y_and_reuse_its_fd), READ_EVENTS)
    poller.register(y.fileno(), Recorder("y", calls), READ_EVENTS)
    try:
        x_peer.send(b"1")  # x is ready first, so its handler runs first in the batch
        y_peer.send(b"2")
        await wait_until(lambda: bool(calls), what="the batch")
        # y's event was in the same batch; its socket is gone, and the new one has no input.
        assert calls == ["x"]
        assert len(poller) == 2
    finally:
        poller.close()
        for s in (x, x_peer, y_peer):
            s.close()
        for fd in reused:
            os.close(fd)


async def test_a_failing_handler_is_reported_and_the_rest_of_the_batch_still_runs() -> None:
    loop = asyncio.get_running_loop()
    errors: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    poller = EdgePoller(loop)
    pairs = [socket.socketpair() for _ in range(3)]
    calls: list[str] = []

    def boom() -> None:
        raise RuntimeError("boom")

    try:
        for i, (s, _) in enumerate(pairs):
            poller.register(
                s.fileno(), Recorder(str(i), calls, boom if i == 0 else None), READ_EVENTS
            )
        for _, peer in pairs:
            peer.send(b"x")
        await wait_until(lambda: len(calls) == 3, what="every handler called")
        assert sorted(calls) == ["0", "1", "2"]
        assert [type(e.get("exception")) for e in errors] == [RuntimeError]
    finally:
        poller.close()
        for pair in pairs:
            for s in pair:
                s.close()


async def test_a_read_pass_ends_at_its_deadline_and_the_other_readers_come_next_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pass over the listening and datagram sockets stops once ``READ_PASS_S`` is over
    (relays wait meanwhile); the readers it did not reach are still ready, each called on a
    later pass, none lost and none twice."""
    monkeypatch.setattr(poller_module, "READ_PASS_S", 0.0005)
    loop = asyncio.get_running_loop()
    poller = ReadPoller(loop)
    pairs = [socket.socketpair() for _ in range(10)]
    passes: list[float] = []  # the deadline of the pass each reader was called in

    class Slow:
        def __init__(self, sock: socket.socket) -> None:
            self.sock = sock

        def readable(self) -> None:
            passes.append(poller.deadline)
            self.sock.recv(100)
            until = time.perf_counter() + 0.0002  # a reader's work, 0.2 ms
            while time.perf_counter() < until:
                pass

    try:
        for ours, peer in pairs:
            ours.setblocking(False)
            poller.watch(ours.fileno(), Slow(ours))
            peer.send(b"x")
        await wait_until(lambda: len(passes) >= 10, what="every reader called")
        await asyncio.sleep(0.01)  # (a reader called twice would show here)
        assert len(passes) == 10
        per_pass = [passes.count(d) for d in sorted(set(passes))]
        assert max(per_pass) <= 3, per_pass  # 0.5 ms of passes at 0.2 ms a reader
        assert len(per_pass) >= 4
    finally:
        poller.close()
        for pair in pairs:
            for s in pair:
                s.close()


async def test_io_waiting_sees_a_waiting_event_and_leaves_it_for_the_loop() -> None:
    """Work done in slices (a worker applying a bulk) asks whether a relay has input; the
    edge-triggered event must still reach the relay afterwards, or that relay would hang
    until its next byte."""
    loop = asyncio.get_running_loop()
    poller = poller_for(loop)
    ours, peer = socket.socketpair()
    calls: list[str] = []
    waiting = io_waiting(loop)
    try:
        poller.register(ours.fileno(), Recorder("relay", calls), READ_EVENTS)
        assert not waiting()
        peer.send(b"request")
        assert waiting() and waiting()  # asked twice: nothing taken
        await wait_until(lambda: calls == ["relay"], what="the relay's event")
        assert not waiting()  # the loop collected it; no new input since
    finally:
        poller.forget(ours.fileno())
        ours.close()
        peer.close()


async def test_io_waiting_sees_a_connection_waiting_on_a_listener() -> None:
    loop = asyncio.get_running_loop()
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    accepted: list[socket.socket] = []

    class Acceptor:
        def readable(self) -> None:
            accepted.append(listener.accept()[0])

    waiting = io_waiting(loop)
    read_poller_for(loop).watch(listener.fileno(), Acceptor())
    client = socket.create_connection(listener.getsockname()[:2])
    try:
        assert waiting()
        await wait_until(lambda: bool(accepted), what="the accept")
        assert not waiting()
    finally:
        read_poller_for(loop).unwatch(listener.fileno())
        for s in (listener, client, *accepted):
            s.close()
