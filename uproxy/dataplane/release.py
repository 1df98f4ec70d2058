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
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Iterable

# Up to this many elements a container is dropped at once: smaller ones free in
# microseconds, and most service ports have a few endpoints.
SMALL = 256
# Elements freed between two looks at the clock (and at the relays' input).
CHUNK = 64
# The longest a pass goes on: the channel's apply slice (``messages.APPLY_SLICE_S``).
SLICE_S = 0.00005


class Release:
    """Empties what it is given over the passes of ``loop``; see the module docstring."""

    __slots__ = ("_busy", "_handle", "_loop", "_pending", "freed", "passes", "slice_s")

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
        self._handle: asyncio.Handle | None = None
        self.passes = 0  # for tests and debugging: passes that freed something
        self.freed = 0  # ... and the elements they let go of

    @property
    def pending(self) -> int:
        """Elements still held, to be let go of."""
        return sum(len(c) for c in self._pending)

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
        if pending and self._handle is None:
            self._handle = self._loop.call_soon(self._pass)

    def _pass(self) -> None:
        self._handle = None
        pending, busy = self._pending, self._busy
        deadline = time.perf_counter() + self.slice_s
        freed = 0
        while pending:
            c = pending[0]
            if isinstance(c, dict):
                n = min(CHUNK, len(c))
                for _ in range(n):
                    c.popitem()
            else:
                n = min(CHUNK, len(c))
                del c[-n:]
            freed += n
            if not c:
                pending.popleft()
            if time.perf_counter() >= deadline or (busy is not None and busy()):
                break
        self.passes += 1
        self.freed += freed
        if pending:
            self._handle = self._loop.call_soon(self._pass)
