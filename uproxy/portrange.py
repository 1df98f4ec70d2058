"""Proxy port ranges in kube-proxy's syntax, and choosing the proxy port for each listener.

``--proxy-port-range`` is ``begin-end`` or ``begin+offset`` (inclusive, as kube-proxy's
``net.PortRange``); empty or ``0-0`` means "no range of its own".

uproxy picks every proxy port itself, walking its range in a random order, instead of
binding port 0: the kernel's search for a free port scans the range from a random point on
each bind, and with thousands of listeners it slows down quadratically (measured: the first
5,000 of 10,000 listeners in 2.5 s, the last 2,000 in 16 s). Here a bind is an O(1) lookup
and a port that is busy (another program holds it) costs one failed bind. Without a range
of its own uproxy uses the kernel's ephemeral range (``ip_local_port_range``, where port 0
would have landed) minus ``ip_local_reserved_ports``; the kernel then keeps its own
outgoing connections off those ports, as it does for any bound port.
"""

from __future__ import annotations

import array
import math
import random
from collections.abc import Iterator

EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
RESERVED_PORTS_FILE = "/proc/sys/net/ipv4/ip_local_reserved_ports"
_DEFAULT_EPHEMERAL = range(32768, 61000)  # Linux's default ip_local_port_range


def parse_port_range(text: str) -> range | None:
    """The range, or None for 'no range of its own'. Raises ValueError.

    As kube-proxy's ``net.PortRange``: ``begin-end``, ``begin+offset``, or one port (``0``:
    no range, as ``0-0``)."""
    text = text.strip()
    if not text:
        return None
    if "+" in text:
        base, _, offset = text.partition("+")
        begin, end = _port_number(base, text), _port_number(base, text) + _port_number(offset, text)
    elif "-" in text:
        a, _, b = text.partition("-")
        begin, end = _port_number(a, text), _port_number(b, text)
    else:
        begin = end = _port_number(text, text)
    if begin == 0 and end == 0:
        return None
    if not 1 <= begin <= end <= 65535:
        raise ValueError(f"ports must satisfy 1 <= begin <= end <= 65535, got {text!r}")
    return range(begin, end + 1)


def _port_number(part: str, text: str) -> int:
    if not part.strip().isdigit():
        raise ValueError(f"expected BEGIN-END, BEGIN+OFFSET or one port, got {text!r}")
    return int(part)


def ephemeral_ports(
    range_file: str = EPHEMERAL_RANGE_FILE, reserved_file: str = RESERVED_PORTS_FILE
) -> range | list[int]:
    """The kernel's ephemeral ports, without the reserved ones (the defaults if unreadable):
    the range itself when none of it is reserved."""
    try:
        with open(range_file) as f:
            low, high = (int(x) for x in f.read().split())
        ports = range(low, high + 1)
    except (OSError, ValueError):
        ports = _DEFAULT_EPHEMERAL
    reserved = _reserved(reserved_file)
    if not any(p in ports for p in reserved):
        return ports
    return [p for p in ports if p not in reserved]


def _reserved(path: str) -> set[int]:
    """``ip_local_reserved_ports``: "8080,9000-9010" (empty when none)."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return set()
    out: set[int] = set()
    for part in filter(None, text.split(",")):
        a, _, b = part.partition("-")
        try:
            out.update(range(int(a), int(b or a) + 1))
        except ValueError:
            continue
    return out


class PortAllocator:
    """Proposes proxy ports in a random order; the caller binds and reports what it got.

    ``candidates`` walks the ports in a random order from where the last walk stopped,
    skipping ports in use, so choosing a port costs O(1) on average however many are taken.
    A restarted process starts at another random point, away from the previous process's
    lingering sockets.

    The order is an affine walk over the ports' indices, ``start + k * stride (mod n)`` with
    ``stride`` prime to ``n`` (every index once per lap), both drawn at random: nothing to
    build or hold. A shuffled copy of the kernel's 28,232 ephemeral ports took 8.5 ms (two
    bytes a port, 56 KiB) for each allocator, at every start.
    """

    def __init__(
        self,
        ports: range | list[int] | None,
        *,
        rng: random.Random | None = None,
        avoid: set[int] | None = None,
    ) -> None:
        chosen = ports if ports is not None else ephemeral_ports()
        # A range indexes itself; a list (reserved ports taken out) as two bytes a port.
        self._ports: range | array.array[int] = (
            chosen if isinstance(chosen, range) else array.array("H", chosen)
        )
        n = len(self._ports)
        rng = rng or random.Random()
        stride = 1
        if n > 2:
            stride = rng.randrange(1, n)
            while math.gcd(stride, n) != 1:
                stride = rng.randrange(1, n)
        self._stride = stride
        self._next = rng.randrange(n) if n else 0
        self.in_use: set[int] = set()
        # Ports never to propose though free now (other services' node ports): the caller's
        # set, shared by the allocators of one protocol and kept up to date by it.
        self.avoid: set[int] = avoid if avoid is not None else set()

    def candidates(self, limit: int) -> Iterator[int]:
        """Up to ``limit`` free ports to try, in order."""
        ports = self._ports
        n = len(ports)
        given = 0
        for _ in range(n):
            if given >= limit:
                return
            port = ports[self._next]
            self._next = (self._next + self._stride) % n
            if port not in self.in_use and port not in self.avoid:
                given += 1
                yield port

    def taken(self, port: int) -> None:
        self.in_use.add(port)

    def release(self, port: int) -> None:
        self.in_use.discard(port)
