"""A worker that serves services coming and going for months: what a deleted service port
leaves behind must go with it, by reference counting alone. A worker freezes what a bulk
change made (``uproxy.heap``), and frozen objects are never collected: a listener in a
reference cycle stayed for good (1.2 KB a port created and deleted, measured, growing
without bound on a cluster whose services churn)."""

from __future__ import annotations

import asyncio
import gc
import socket
from collections.abc import Iterator

import pytest

from uproxy.dataplane.messages import (
    CloseListener,
    Configure,
    Forget,
    OpenListener,
    SetEndpoints,
)
from uproxy.dataplane.settings import DataplaneSettings
from uproxy.dataplane.sockets import bind_tcp, bind_udp
from uproxy.dataplane.worker import Worker
from uproxy.model import Endpoint, IPFamily, Protocol, ServicePort, ServicePortName, Traffic


@pytest.fixture
def no_collector() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


async def _udp_echo() -> tuple[asyncio.DatagramTransport, int]:
    class Echo(asyncio.DatagramProtocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport

        def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
            self.transport.sendto(data, addr)  # type: ignore[attr-defined]

    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(Echo, local_addr=("127.0.0.1", 0))
    return transport, transport.get_extra_info("sockname")[1]


@pytest.mark.parametrize("protocol", [Protocol.TCP, Protocol.UDP])
async def test_a_deleted_service_port_leaves_no_cycle_behind(
    protocol: Protocol, no_collector: None
) -> None:
    loop = asyncio.get_running_loop()
    payload = b"x" * 1000
    if protocol is Protocol.TCP:

        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(await reader.readexactly(len(payload)))
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(echo, "127.0.0.1", 0)
        backend_port = server.sockets[0].getsockname()[1]
    else:
        udp, backend_port = await _udp_echo()
    worker = Worker(channel_fd=-1, index=0)
    worker._on_message(Configure(DataplaneSettings(node_name="node")), None)
    names = [ServicePortName("churn", f"svc-{i}", "p", protocol) for i in range(5)]
    for name in names:
        port = ServicePort(name, 80, cluster_ips=("10.96.0.10",))
        endpoints = (Endpoint("127.0.0.1", backend_port),)
        worker._on_message(SetEndpoints(name, IPFamily.V4, port, endpoints), None)
        if protocol is Protocol.TCP:
            sock = bind_tcp("127.0.0.1", 0, backlog=16, reuseport=True)
        else:
            sock = bind_udp("127.0.0.1", 0, receive_buffer=1 << 20)
        proxy_port = sock.getsockname()[1]
        worker._on_message(OpenListener(name, Traffic.CLUSTER, IPFamily.V4), sock)
        # One real exchange through each, so the port has counted and relayed something.
        kind = socket.SOCK_STREAM if protocol is Protocol.TCP else socket.SOCK_DGRAM
        with socket.socket(socket.AF_INET, kind) as client:
            client.setblocking(False)
            await loop.sock_connect(client, ("127.0.0.1", proxy_port))
            await loop.sock_sendall(client, payload)
            got = b""
            while len(got) < len(payload):
                got += await asyncio.wait_for(loop.sock_recv(client, 65536), 5)
            assert got == payload
    for name in names:
        worker._on_message(CloseListener(name, Traffic.CLUSTER, IPFamily.V4), None)
        worker._on_message(Forget(name, IPFamily.V4), None)
    for listener in worker.closing:
        await listener.shutdown(2.0)
    worker.closing.clear()
    if protocol is Protocol.TCP:
        server.close()
        await server.wait_closed()
    else:
        udp.close()
    await asyncio.sleep(0)
    gc.set_debug(gc.DEBUG_SAVEALL)
    gc.collect()
    left = {type(o).__name__ for o in gc.garbage if type(o).__module__.startswith("uproxy")}
    assert not left, f"in reference cycles after their port went: {sorted(left)}"
