"""Small helpers shared by the health tests: a settable clock, ports, polling, byte checks."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import resource
import socket
import time
from collections.abc import Callable, Iterator


class FakeClock:
    """A wall clock that moves only when told to (seconds since the epoch)."""

    def __init__(self, start: float = 1_700_000_000.25) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def assert_same_bytes(got: bytes, want: bytes) -> None:
    assert len(got) == len(want), (got, want)
    assert hashlib.sha256(got).hexdigest() == hashlib.sha256(want).hexdigest(), (got, want)


async def wait_until(
    predicate: Callable[[], bool], *, timeout: float = 5.0, interval: float = 0.02
) -> None:
    """Poll ``predicate`` until it holds; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(interval)


async def refused(host: str, port: int) -> bool:
    """True when a TCP connect to host:port is refused (nothing listens)."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 2.0)
    except ConnectionRefusedError:
        return True
    writer.close()
    await writer.wait_closed()
    return False


@contextlib.contextmanager
def out_of_fds() -> Iterator[None]:
    """No fd left to this process: the soft limit at the fds in use, every lower one taken."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")), hard))
    taken: list[int] = []
    try:
        with contextlib.suppress(OSError):
            while True:
                taken.append(os.dup(0))
        yield
    finally:
        for fd in taken:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
