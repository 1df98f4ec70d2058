"""Small real backends for end-to-end tests: each says its name, then echoes (TCP), or answers
each datagram with its name before it (UDP)."""

from __future__ import annotations

import asyncio
import socket
import time


class _NamedEcho(asyncio.Protocol):
    def __init__(self, name: bytes) -> None:
        self.name = name
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.transport.write(self.name + b"\n")  # type: ignore[union-attr]

    def data_received(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)


class NamedDatagramEcho(asyncio.DatagramProtocol):
    """A UDP backend: answers each datagram with its name, a colon and the datagram."""

    def __init__(self, name: bytes) -> None:
        self.prefix = name + b":"
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        if self.transport is not None:
            self.transport.sendto(self.prefix + data, addr)


async def next_datagram(sock: socket.socket, wait_s: float) -> bytes | None:
    """The next datagram on non-blocking ``sock`` within ``wait_s``, or None; polled, since
    the backends it may come from run on this very loop."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            return sock.recv(2048)
        except BlockingIOError:
            await asyncio.sleep(0.005)
    return None


class NamedBackend:
    """A TCP server on ``host:port`` that greets with its name and echoes what it receives."""

    def __init__(self, name: str, host: str, port: int = 0) -> None:
        self.name = name
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None

    async def start(self) -> NamedBackend:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _NamedEcho(self.name.encode()), self.host, self.port
        )
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


async def greet(host: str, port: int, timeout: float = 3.0) -> str:
    """Connect, read the backend's name, close."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    try:
        line = await asyncio.wait_for(reader.readline(), timeout)
        return line.decode().strip()
    finally:
        writer.close()
