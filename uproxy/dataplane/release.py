"""Letting go of big structures a slice at a time, between the passes of a worker's loop.

Freeing is work too. When a big service port's balancer takes the state of the one built
aside for it (``Balancer.adopt``), the state it held goes: at 20,000 endpoints, the
endpoints themselves, their index by address and the pools' orders and members. Dropped
with one assignment, CPython frees all of it in one cascade of reference counts, 3.5-4.4 ms
measured (the commit itself took 0.03 ms once the old state was kept alive), and for that
long the worker's relays wait. A big balancer forgotten (its service deleted) is the same.

``Release.later`` takes the containers instead and empties them over the loop's next
passes: a chunk at a time, for at most ``slice_s`` a pass, and not past the chunk at hand
once a relay's input waits (``busy``, as the channel's apply slices do). A container is
emptied in place (a list from its end, a dict item by item); a tuple or a set is first
copied to a list (a pass of increments, ~0.1 ms at 20,000, after which freeing the tuple
frees no element). What a container holds is freed when its last holder lets go of it,
so the caller hands over every container that holds the elements (an endpoint sits in
the endpoints tuple, the index and a pool): the cost of each element then falls in
whichever chunk drops its last reference.

The containers must be the caller's to empty: nothing else may read them once handed over.

Closing is work too: ``close_later`` takes sockets and closes them a few at a time the same
way. A UDP listener's flows that go in bulk (a sweep of the idle ones, the flows of an
endpoint that went, the listener's own close) each hold a connected socket, and closing one
watched by an epoll set took 1.6-1.9 us (4,000 of them closed in a row), about 2.6 us a
flow with the rest of the drop: the 2,000 flows (of 4,000) of an endpoint that went took
5.9 ms in one pass, a sweep of 2,000 idle ones 5.2 ms, and a listener's full table
(``udp_max_flows``, 4,096) would take about 10. The flows leave the listener's table at
once (1.0 and 0.6 ms for those two); only their sockets wait. A socket that still gets
input meanwhile is reported again on each pass (the datagram sockets' set is
level-triggered) with no reader to call, and each pass then closes one chunk (``busy``).

One ``Release`` per loop (``release_for``), made on first use.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Protocol

from uproxy.dataplane.poller import io_waiting, per_loop

# Up to this many elements a container is dropped at once: smaller ones free in
# microseconds, and most service ports have a few endpoints.
SMALL = 256
# Elements freed between two looks at the clock (and at the relays' input).
CHUNK = 64
# Sockets closed between two looks at the clock: 20-40 us of closing.
CLOSE_CHUNK = 16
# The longest a pass goes on: the channel's apply slice (``messages.APPLY_SLICE_S``).
SLICE_S = 0.00005


class Closable(Protocol):
    def close(self) -> None: ...


class Release:
    """Empties what it is given over the passes of ``loop``; see the module docstring."""

    __slots__ = (
        "_busy",
        "_closing",
        "_handle",
        "_loop",
        "_pending",
        "closed",
        "freed",
        "passes",
        "slice_s",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        busy: Callable[[], bool] | None = None,
        slice_s: float = SLICE_S,
    ) -> None:
        self._loop = loop
        self._busy = busy
        self.slice_s = slice_s
        self._pending: deque[list[object] | dict[object, object]] = deque()
        self._closing: list[Closable] = []  # closed from the end
        self._handle: asyncio.Handle | None = None
        self.passes = 0  # for tests and debugging: passes that did something
        self.freed = 0  # ... the elements they let go of
        self.closed = 0  # ... and the sockets they closed

    @property
    def pending(self) -> int:
        """Elements still held, to be let go of."""
        return sum(len(c) for c in self._pending)

    @property
    def closing(self) -> int:
        """Sockets still open, to be closed."""
        return len(self._closing)

    def later(self, containers: Iterable[object]) -> None:
        """Let go of ``containers`` (lists, dicts, tuples, sets and frozensets; anything
        else, and those of up to ``SMALL`` elements, at once) over the next passes."""
        pending = self._pending
        for c in containers:
            if isinstance(c, (list, dict)):
                if len(c) > SMALL:
                    pending.append(c)
            elif isinstance(c, (tuple, frozenset, set)) and len(c) > SMALL:
                pending.append(list(c))
        self._schedule()

    def close_later(self, socks: Iterable[Closable]) -> None:
        """Close ``socks`` over the next passes (up to ``CLOSE_CHUNK`` of them at once).
        They must be nobody else's to use any more: watched by no poller that would call
        back on them, read and written by nothing."""
        closing = self._closing
        closing.extend(socks)
        if len(closing) <= CLOSE_CHUNK:
            self._close(len(closing))
        self._schedule()

    def close_now(self) -> None:
        """Close every socket waiting, and let go of every container (the loop is going)."""
        self._close(len(self._closing))
        self._pending.clear()

    def _schedule(self) -> None:
        if (self._pending or self._closing) and self._handle is None:
            self._handle = self._loop.call_soon(self._pass)

    def _close(self, n: int) -> None:
        closing = self._closing
        for sock in closing[-n:]:
            sock.close()
        del closing[-n:]
        self.closed += n

    def _pass(self) -> None:
        self._handle = None
        pending, closing, busy = self._pending, self._closing, self._busy
        deadline = time.perf_counter() + self.slice_s
        freed = 0
        while pending or closing:
            if closing:
                self._close(min(CLOSE_CHUNK, len(closing)))
            else:
                c = pending[0]
                n = min(CHUNK, len(c))
                if isinstance(c, dict):
                    for _ in range(n):
                        c.popitem()
                else:
                    del c[-n:]
                freed += n
                if not c:
                    pending.popleft()
            if time.perf_counter() >= deadline or (busy is not None and busy()):
                break
        self.passes += 1
        self.freed += freed
        self._schedule()


_RELEASES: dict[asyncio.AbstractEventLoop, Release] = {}


def release_for(loop: asyncio.AbstractEventLoop) -> Release:
    """The ``Release`` of ``loop``, made on first use, its passes cut short whenever one of
    the loop's relayed, listening or datagram sockets has an event waiting."""
    return per_loop(_RELEASES, loop, lambda lp: Release(lp, busy=io_waiting(lp)), Release.close_now)
