"""A worker handed a new socket for a port it serves (ClientIP affinity turned on or off
regroups the port's SO_REUSEPORT group) serves what the old socket had queued before it
closes it: closing a listening socket resets every connection in its accept queue."""

from __future__ import annotations

import asyncio
import socket

from uproxy.dataplane.messages import Configure, OpenListener, SetEndpoints
from uproxy.dataplane.settings import DataplaneSettings
from uproxy.dataplane.sockets import bind_tcp
from uproxy.dataplane.worker import Worker
from uproxy.model import Endpoint, IPFamily, Protocol, ServicePort, ServicePortName, Traffic

NAME = ServicePortName("default", "web", "http", Protocol.TCP)
QUEUED = 8


async def test_a_replaced_socket_serves_the_connections_it_had_queued() -> None:
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
    proxy_port = old.getsockname()[1]
    open_message = OpenListener(NAME, Traffic.CLUSTER, IPFamily.V4)
    worker._on_message(open_message, old)
    clients: list[socket.socket] = []
    try:
        # The loop does not run meanwhile: the kernel completes these handshakes and queues
        # the connections on the old socket, the only one of the port so far.
        for _ in range(QUEUED):
            clients.append(socket.create_connection(("127.0.0.1", proxy_port), timeout=2))
        new = bind_tcp("127.0.0.1", proxy_port, backlog=64, reuseport=True)
        worker._on_message(open_message, new)  # the old socket is replaced, and closed
        answers = []
        for c in clients:
            reader, writer = await asyncio.open_connection(sock=c)
            try:
                answers.append(await asyncio.wait_for(reader.readline(), 5))
            except ConnectionError as exc:
                answers.append(repr(exc).encode())
            writer.close()
        assert answers == [b"backend\n"] * QUEUED
        # The port goes on serving on its new socket.
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy_port)
        assert await asyncio.wait_for(reader.readline(), 5) == b"backend\n"
        writer.close()
    finally:
        for c in clients:
            c.close()
        for listener in [*worker.listeners.values(), *worker.closing]:
            await listener.shutdown(1.0)
        backend.close()
        await backend.wait_closed()
