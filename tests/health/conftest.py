"""Fixtures for the health and metrics endpoint tests: free ports, an HTTP client, a clock.

Everything here talks real HTTP over loopback; nothing needs root.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncIterator, Callable, Iterator

import aiohttp
import pytest

from .helpers import FakeClock, free_port


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def unused_port() -> int:
    return free_port()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    # No connection reuse: each request sees the server's current state and sockets.
    timeout = aiohttp.ClientTimeout(total=5)
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        yield session


@pytest.fixture
def listening_blocker() -> Iterator[Callable[[str, int], socket.socket]]:
    """Hold a port with a plain listening socket, as another process would."""
    held: list[socket.socket] = []

    def hold(host: str, port: int) -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        s.listen(8)
        held.append(s)
        return s

    yield hold
    for s in held:
        s.close()


@pytest.fixture
def uproxy_logs() -> Iterator[list[logging.LogRecord]]:
    """Records from the ``uproxy`` loggers at every level (even if propagation is off)."""
    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Collect(level=1)
    logger = logging.getLogger("uproxy")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(1)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(old_level)
