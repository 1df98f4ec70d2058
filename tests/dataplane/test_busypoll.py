"""Busy polling: after an event a loop goes round without sleeping for its window, then sleeps
until the next event; what it relays meanwhile arrives whole."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from tests.dataplane.conftest import (
    TCP_NAME,
    BackendFactory,
    ListenerFactory,
    digest,
    make_balancer,
    wait_until,
)
from tests.dataplane.test_tcp import relay
from uproxy.dataplane import busypoll
from uproxy.dataplane.poller import READ_EVENTS, poller_for, read_poller_for
from uproxy.dataplane.settings import DataplaneSettings


def polling(busy: busypoll.BusyPoll) -> bool:
    return busy.polling  # read anew each time (an assert on the attribute narrows it)


class Reader:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.got: list[bytes] = []

    def readable(self) -> None:
        self.got.append(self.sock.recv(64))


class Handler(Reader):
    def event(self, mask: int) -> None:
        self.readable()


@pytest.mark.parametrize("where", ["listening", "relayed"])
async def test_after_an_event_the_loop_polls_for_its_window_then_sleeps(where: str) -> None:
    """An event in either set starts the window: a listening socket's (a new connection, a
    datagram) or a relayed socket's (the next request on a kept-alive connection)."""
    loop = asyncio.get_running_loop()
    busy = busypoll.install(loop, 0.2)
    assert busy is not None
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    reader = Handler(ours)
    if where == "listening":
        read_poller_for(loop).watch(ours.fileno(), reader)
    else:
        poller_for(loop).register(ours.fileno(), reader, READ_EVENTS)
    try:
        await asyncio.sleep(0.1)
        assert not busy.polling and busy.passes == 0  # no event yet: the loop sleeps
        theirs.send(b"one")
        await wait_until(lambda: reader.got == [b"one"], what="the first event")
        assert polling(busy)
        await wait_until(lambda: not polling(busy), timeout=3, what="the window's end")
        # Went round many times without sleeping meanwhile: a pass is a few microseconds,
        # so even a loaded machine makes hundreds in 0.2 s; a loop that slept made none.
        went = busy.passes
        assert went > 100
        await asyncio.sleep(0.2)
        assert busy.passes == went  # and sleeps once the window is over
        theirs.send(b"two")  # the next event starts a new window
        await wait_until(lambda: reader.got == [b"one", b"two"], what="the second event")
        assert polling(busy)
        await wait_until(lambda: not polling(busy), timeout=3, what="the second window's end")
        assert busy.passes > went
    finally:
        if where == "listening":
            read_poller_for(loop).unwatch(ours.fileno())
        else:
            poller_for(loop).forget(ours.fileno())
        ours.close()
        theirs.close()


async def test_no_window_installs_nothing_and_a_later_one_changes_the_window() -> None:
    loop = asyncio.get_running_loop()
    assert busypoll.install(loop, 0) is None
    busy = busypoll.install(loop, 0.5)
    assert busy is not None and busy.window_s == 0.5
    assert busypoll.install(loop, 0) is busy and busy.window_s == 0
    busy.kick()
    assert not busy.polling  # a window of 0 never polls


async def test_a_relay_on_a_polling_loop_moves_every_byte_both_ways(
    backends: BackendFactory, tcp_listener: ListenerFactory
) -> None:
    busypoll.install(asyncio.get_running_loop(), 0.05)
    b = await backends("echo")
    settings = DataplaneSettings(busy_poll_s=0.05)
    listener = await tcp_listener(make_balancer(TCP_NAME, [b.endpoint], settings=settings))
    payloads = [os.urandom(n) for n in (1, 4096, 3 << 20, 16 << 20)]
    results = await asyncio.wait_for(
        asyncio.gather(*(relay(listener.port, p) for p in payloads)), 60
    )
    for sent, got in zip(payloads, results, strict=True):
        assert digest(got) == digest(sent)
    await wait_until(lambda: listener.active == 0, what="pairs closed")
