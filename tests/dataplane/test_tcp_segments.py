"""What the relay puts on the wire, read off loopback with a packet socket (root).

A FIN passed on after the last bytes rides on the segment that carries them, when both came
in together: one segment where sending the FIN after the data took two (each one more
packet through the kernel on the proxy's CPU, and one more wake-up of the peer).
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
from dataclasses import dataclass

import pytest

from tests.dataplane.conftest import NODE, TCP_NAME, ListenerFactory, digest, make_balancer
from uproxy.dataplane.settings import DataplaneSettings
from uproxy.model import Endpoint

pytestmark = pytest.mark.root

_ETH_P_ALL = 0x0003
_PACKET_OUTGOING = 4  # a looped-back packet is seen twice: as sent, and as received
_FIN = 0x01


@dataclass(frozen=True, slots=True)
class Segment:
    src: int
    dst: int
    flags: int
    payload: int


class LoopbackCapture:
    """Every TCP/IPv4 segment sent on ``lo`` from its creation on (the test reads them after
    the exchange: a looped-back segment is in the capture by the time the send returns)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(_ETH_P_ALL))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self.sock.bind(("lo", 0))
        self.sock.setblocking(False)

    def segments(self, ports: set[int]) -> list[Segment]:
        out: list[Segment] = []
        while True:
            try:
                frame, addr = self.sock.recvfrom(70_000)
            except BlockingIOError:
                return out
            if addr[2] != _PACKET_OUTGOING or len(frame) < 14 + 20 or frame[14] >> 4 != 4:
                continue
            ip = frame[14:]
            ihl = (ip[0] & 0x0F) * 4
            if ip[9] != socket.IPPROTO_TCP:
                continue
            total = struct.unpack_from("!H", ip, 2)[0]
            src, dst = struct.unpack_from("!HH", ip, ihl)
            if src not in ports and dst not in ports:
                continue
            doff = (ip[ihl + 12] >> 4) * 4
            out.append(Segment(src, dst, ip[ihl + 13], total - ihl - doff))

    def close(self) -> None:
        self.sock.close()


def fins(segments: list[Segment], src: int, dst: int) -> list[int]:
    """The payload lengths of the FIN segments sent from port ``src`` to port ``dst``."""
    return [s.payload for s in segments if s.src == src and s.dst == dst and s.flags & _FIN]


async def read_to_eof(sock: socket.socket) -> bytes:
    loop = asyncio.get_running_loop()
    got = bytearray()
    while chunk := await loop.sock_recv(sock, 65536):
        got += chunk
    return bytes(got)


def send_with_fin(sock: socket.socket, data: bytes) -> None:
    """``data`` and the FIN in one segment (MSG_MORE holds the data for the shutdown)."""
    assert sock.send(data, socket.MSG_MORE) == len(data)
    sock.shutdown(socket.SHUT_WR)


@pytest.mark.parametrize("client_half_closes", [False, True], ids=["server-closes", "client"])
async def test_a_fin_that_came_with_the_last_bytes_leaves_with_them(
    tcp_listener: ListenerFactory, client_half_closes: bool
) -> None:
    """server-closes: an HTTP server's reply and FIN (``Connection: close``) reach the client
    in one segment. client: a request sent with its FIN reaches the endpoint in one segment,
    and the reply and its FIN the client in one (the pair is then closed, not shut down)."""
    loop = asyncio.get_running_loop()
    request, reply = os.urandom(1000), os.urandom(3000)  # each well within loopback's MSS
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    backend_port = server.getsockname()[1]
    ep = Endpoint("127.0.0.1", backend_port, node_name=NODE)
    listener = await tcp_listener(make_balancer(TCP_NAME, [ep], settings=DataplaneSettings()))
    capture = LoopbackCapture()
    client = socket.socket()
    client.setblocking(False)
    try:
        await loop.sock_connect(client, ("127.0.0.1", listener.port))
        client_port = client.getsockname()[1]
        conn, _ = await asyncio.wait_for(loop.sock_accept(server), 5)
        conn.setblocking(False)
        dial_port = conn.getpeername()[1]
        if client_half_closes:
            send_with_fin(client, request)
            got_request = await asyncio.wait_for(read_to_eof(conn), 5)
        else:
            await loop.sock_sendall(client, request)
            got_request = b""
            while len(got_request) < len(request):
                got_request += await asyncio.wait_for(loop.sock_recv(conn, 65536), 5)
        send_with_fin(conn, reply)
        got_reply = await asyncio.wait_for(read_to_eof(client), 5)
        assert digest(got_request) == digest(request)
        assert digest(got_reply) == digest(reply)
        client.close()
        assert await asyncio.wait_for(read_to_eof(conn), 5) == b""  # the pair is over
        segments = capture.segments({listener.port, backend_port, client_port, dial_port})
    finally:
        capture.close()
        client.close()
        server.close()
    assert fins(segments, listener.port, client_port) == [len(reply)], segments
    if client_half_closes:
        assert fins(segments, dial_port, backend_port) == [len(request)], segments
    else:
        # The client's FIN came alone (after the reply): passed on alone.
        assert fins(segments, dial_port, backend_port) == [0], segments
