"""A worker handed a new socket for a port it serves (ClientIP affinity turned on or off
regroups the port's SO_REUSEPORT group, see ``uproxy.workers``) never resets a connection
that reached the old socket: closing a listening socket resets every connection in its
accept queue.

Here the test plays the control process: it holds a copy of every socket of the group, and
the group's program decides which socket new connections reach.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from tests.conftest import wait_for
from uproxy.dataplane import worker as worker_module
from uproxy.dataplane.messages import CloseListener, Configure, OpenListener, SetEndpoints
from uproxy.dataplane.settings import DataplaneSettings
from uproxy.dataplane.sockets import bind_tcp, steer_to_first, unsteer
from uproxy.dataplane.worker import Worker
from uproxy.model import Endpoint, IPFamily, Protocol, ServicePort, ServicePortName, Traffic

NAME = ServicePortName("default", "web", "http", Protocol.TCP)
KEY = (NAME, Traffic.CLUSTER, IPFamily.V4)
QUEUED = 8


@dataclass
class Rig:
    worker: Worker
    port: int  # the proxy port
    old: socket.socket  # the group's first socket, as the control process holds it


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    async def greet(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"backend\n")
        await writer.drain()
        writer.close()

    backend = await asyncio.start_server(greet, "127.0.0.1", 0)
    backend_port = backend.sockets[0].getsockname()[1]
    worker = Worker(channel_fd=-1, index=0)
    worker._on_message(Configure(DataplaneSettings(node_name="node")), None)
    port = ServicePort(NAME, 80, cluster_ips=("10.96.0.10",))
    endpoints = (Endpoint("127.0.0.1", backend_port),)
    worker._on_message(SetEndpoints(NAME, IPFamily.V4, port, endpoints), None)
    old = bind_tcp("127.0.0.1", 0, backlog=64, reuseport=True)
    worker._on_message(OpenListener(*KEY), old.dup())
    try:
        yield Rig(worker, old.getsockname()[1], old)
    finally:
        old.close()
        for listener in [*worker.listeners.values(), *worker.closing]:
            await listener.shutdown(1.0)
        backend.close()
        await backend.wait_closed()


def accepting(listener: object) -> bool:
    return getattr(listener, "socket", None) is not None


def queue_connections(port: int) -> list[socket.socket]:
    """Connections the kernel completes and queues (the loop does not run meanwhile)."""
    return [socket.create_connection(("127.0.0.1", port), timeout=2) for _ in range(QUEUED)]


async def answers(clients: list[socket.socket], timeout: float = 5.0) -> list[bytes]:
    out = []
    for c in clients:
        reader, writer = await asyncio.open_connection(sock=c)
        try:
            out.append(await asyncio.wait_for(reader.readline(), timeout))
        except (ConnectionError, TimeoutError) as exc:
            out.append(repr(exc).encode())
        writer.close()
    return out


async def test_a_socket_leaving_the_group_serves_what_reaches_it_until_it_idles(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(worker_module, "RETIRE_IDLE_S", 0.3)
    queued = queue_connections(rig.port)
    new = bind_tcp("127.0.0.1", rig.port, backlog=64, reuseport=True)
    try:
        # Until the old socket leaves the group, connections may still reach it: here the
        # group's program sends them all there, as handshakes under way do in a real regroup.
        steer_to_first(rig.old)
        rig.worker._on_message(OpenListener(*KEY, old_leaves=True), new.dup())
        late = queue_connections(rig.port)
        assert await answers(queued + late) == [b"backend\n"] * (2 * QUEUED)
        (retiring,) = rig.worker.closing
        assert retiring.socket is not None  # it took connections within the idle time
        unsteer(rig.old)
        rig.old.close()  # the control process lets go; the worker's copy is the last
        await wait_for(lambda: retiring.socket is None, timeout=3, message="an idle close")
        # Only the new socket is left in the group, and it serves the port.
        assert await answers(queue_connections(rig.port)) == [b"backend\n"] * QUEUED
    finally:
        new.close()


async def test_a_socket_another_worker_serves_is_left_to_it_untouched(rig: Rig) -> None:
    # ClientIP affinity turned on: the socket every worker accepted on stays in the group as
    # worker 0's. Another worker drops its copy at once, without taking what is queued there:
    # those connections belong to worker 0 (here, to the test's own copy).
    queued = queue_connections(rig.port)
    new = bind_tcp("127.0.0.1", rig.port, backlog=64, reuseport=True)
    try:
        rig.worker._on_message(OpenListener(*KEY, old_leaves=False), new.dup())
        (dropped,) = rig.worker.closing
        assert dropped.socket is None
        rig.old.setblocking(True)
        rig.old.settimeout(2)
        for _ in queued:
            accepted, _addr = rig.old.accept()  # still queued there: neither reset nor taken
            accepted.sendall(b"worker 0\n")
            accepted.close()
        assert await answers(queued) == [b"worker 0\n"] * QUEUED
    finally:
        new.close()


async def test_closing_the_port_closes_a_socket_still_retiring(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A port closed (its service gone) while a socket of it is still served until idle: that
    # socket goes with it, rather than accepting for a port nobody serves any more.
    monkeypatch.setattr(worker_module, "RETIRE_IDLE_S", 60.0)
    new = bind_tcp("127.0.0.1", rig.port, backlog=64, reuseport=True)
    try:
        rig.worker._on_message(OpenListener(*KEY, old_leaves=True), new.dup())
        (retiring,) = rig.worker.closing
        assert accepting(retiring)
        rig.worker._on_message(CloseListener(*KEY), None)
        assert not accepting(retiring)
        assert rig.worker.listeners == {}
        assert not any(accepting(lst) for lst in rig.worker.closing)
    finally:
        new.close()
