"""A worker keeps the cyclic collector off its relays during a bulk change.

Applying a 10,000-port sync made the collector's full passes run over every new listener,
100-200 ms each, and each one stalled all of the worker's relays. A long run of channel
messages is now a bulk: the collector waits until the channel is quiet, then what the run
made is frozen. A short change (one endpoint update) leaves the collector alone.
"""

from __future__ import annotations

import asyncio
import gc
import socket
import time
from collections.abc import Callable, Iterator

import pytest

from uproxy import heap
from uproxy.dataplane.messages import ChangeEndpoints, Configure, SetEndpoints
from uproxy.dataplane.settings import DataplaneSettings
from uproxy.dataplane.worker import BURST_IDLE_S, BURST_WEIGHT, Worker
from uproxy.model import Endpoint, IPFamily, Protocol, ServicePort, ServicePortName, Traffic


@pytest.fixture(autouse=True)
def collector_restored() -> Iterator[None]:
    yield
    gc.unfreeze()
    gc.enable()


def _update(i: int) -> SetEndpoints:
    name = ServicePortName("ns", f"svc{i}", "p", Protocol.TCP)
    port = ServicePort(name, 80, cluster_ips=(f"10.96.{i // 250}.{i % 250 + 1}",))
    return SetEndpoints(name, IPFamily.V4, port, (Endpoint("10.0.0.1", 8080),))


def _worker() -> Worker:
    w = Worker(channel_fd=-1, index=0)
    w._on_message(Configure(DataplaneSettings(node_name="node", drain_timeout_s=1.0)), None)
    return w


async def _until(condition: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        await asyncio.sleep(0.02)
    return False


async def test_a_long_run_of_messages_holds_the_collector_then_freezes_it() -> None:
    w = _worker()
    frozen = gc.get_freeze_count()
    for i in range(BURST_WEIGHT + 50):
        w._on_message(_update(i), None)
    assert len(w.balancers) == BURST_WEIGHT + 50
    assert not gc.isenabled()  # no full pass in the middle of the bulk
    assert await _until(gc.isenabled, timeout=10 * BURST_IDLE_S)
    assert gc.get_freeze_count() > frozen  # what the bulk made is out of the collector's way


async def test_a_worker_freezes_what_its_start_made() -> None:
    """Its modules, classes and functions (about 21,000 objects) would otherwise be visited by
    every full pass of the collector: 4.5-5.5 ms each, every relay waiting, in a worker with
    a few services (no bulk to freeze them) and UDP clients coming and going by the
    thousand."""
    ours, theirs = socket.socketpair()
    gc.unfreeze()
    w = Worker(channel_fd=ours.detach(), index=0)
    run = asyncio.create_task(w.run())
    try:
        assert await _until(lambda: gc.get_freeze_count() > 0)  # before it says it is ready
        theirs.setblocking(False)
        assert await _until(lambda: _has_input(theirs))  # the Ready message
    finally:
        theirs.close()  # the channel closes: the worker stops
        assert await asyncio.wait_for(run, timeout=5) == 0


def _has_input(sock: socket.socket) -> bool:
    try:
        return bool(sock.recv(1, socket.MSG_PEEK))
    except BlockingIOError:
        return False


async def test_a_short_change_leaves_the_collector_alone() -> None:
    w = _worker()
    frozen = gc.get_freeze_count()
    for i in range(10):
        w._on_message(_update(i), None)
        assert gc.isenabled()
    await asyncio.sleep(3 * BURST_IDLE_S)
    assert gc.isenabled()
    assert gc.get_freeze_count() == frozen
    assert heap._depth == 0


async def test_a_big_ports_endpoints_in_a_few_messages_hold_the_collector_too() -> None:
    """Its endpoints come in steps (``endpoint_steps``), a few messages for thousands of
    objects: each endpoint weighs as a message."""
    w = _worker()
    first = _update(0)
    eps = tuple(Endpoint(f"10.1.{i // 250}.{i % 250 + 1}", 8080) for i in range(BURST_WEIGHT))
    w._on_message(first, None)
    w._on_message(ChangeEndpoints(first.name, IPFamily.V4, eps[:10], ()), None)
    assert gc.isenabled()
    w._on_message(ChangeEndpoints(first.name, IPFamily.V4, eps[10:], ()), None)
    assert not gc.isenabled()
    assert len(w.balancers[(first.name, IPFamily.V4)].endpoints(Traffic.CLUSTER)) == 201
    assert await _until(gc.isenabled, timeout=10 * BURST_IDLE_S)
