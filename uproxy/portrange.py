"""Proxy port ranges in kube-proxy's syntax, and choosing a free port from one.

``--proxy-port-range`` is ``begin-end`` or ``begin+offset`` (inclusive, as kube-proxy's
``net.PortRange``); empty or ``0-0`` means "let the kernel pick". Ports are handed out
round-robin from a random start so that a restart does not hit the same ports in the same
order as the previous process's lingering sockets.
"""

from __future__ import annotations

import random


def parse_port_range(text: str) -> range | None:
    """The range, or None for 'the kernel picks'. Raises ValueError."""
    text = text.strip()
    if not text:
        return None
    if "+" in text:
        base, _, offset = text.partition("+")
        begin, end = int(base), int(base) + int(offset)
    elif "-" in text:
        a, _, b = text.partition("-")
        begin, end = int(a), int(b)
    else:
        raise ValueError(f"expected BEGIN-END or BEGIN+OFFSET, got {text!r}")
    if begin == 0 and end == 0:
        return None
    if not 1 <= begin <= end <= 65535:
        raise ValueError(f"ports must satisfy 1 <= begin <= end <= 65535, got {text!r}")
    return range(begin, end + 1)


class PortAllocator:
    """Candidate ports for a new proxy port; the caller binds and reports what it got."""

    def __init__(self, ports: range | None, *, rng: random.Random | None = None) -> None:
        self._ports = ports
        self._next = (rng or random.Random()).randrange(len(ports)) if ports else 0
        self.in_use: set[int] = set()

    def candidates(self) -> list[int]:
        """Ports to try in order; [0] when the kernel picks."""
        if self._ports is None:
            return [0]
        n = len(self._ports)
        out = []
        for i in range(n):
            p = self._ports[(self._next + i) % n]
            if p not in self.in_use:
                out.append(p)
        return out

    def taken(self, port: int) -> None:
        self.in_use.add(port)
        if self._ports is not None and port in self._ports:
            self._next = (self._ports.index(port) + 1) % len(self._ports)

    def release(self, port: int) -> None:
        self.in_use.discard(port)
