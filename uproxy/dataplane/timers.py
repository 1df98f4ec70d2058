"""Per-connection timers that all share one delay, served by a single loop timer.

Every TCP connection arms a dial deadline (per attempt). Each ``loop.call_later`` builds a
TimerHandle, inserts it into the loop's timer heap and removes it again on cancel: such
timers were 3.9 % of the proxy's CPU in the connection-rate profile. Timers with one fixed
delay expire in the order they were started, so a FIFO queue with one loop timer armed for
its head gives the same expiry times for the price of an append.

Cancelled entries drop the reference to their owner at once (nothing they point at is kept
alive) and are skipped when they reach the head. Should a long timer at the head hold back
many cancelled ones behind it, the queue is compacted once it has grown to twice what the
last compaction left (amortised O(1)), so its size stays proportional to the live timers.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from uproxy.dataplane.poller import per_loop

_COMPACT_MIN = 1024  # below this many entries, compacting is not worth a pass
# A loop timer may run up to a millisecond early (libuv counts whole milliseconds; asyncio
# allows its clock resolution): entries due within this slack fire with it, not after a spin.
_SLACK_S = 0.001

_T = TypeVar("_T")

# A started timer: the list ``[when, owner]``. ``timer.clear()`` cancels it (an empty entry
# is a cancelled one); the timers clear it too before it fires, so cancelling is idempotent
# and safe after it fired. A list, not an object of a class of ours: made by a list display
# and cancelled by a C method, a start and a cancel are no Python frame beyond ``start``
# (start + cancel 192-204 ns against 384-403 for a small class with a ``cancel`` method
# and a callback per timer, timeit on uvloop).
Timer = list[Any]


class FixedDelayTimers(Generic[_T]):
    """Timers of one ``delay`` and one action: ``start(owner)`` calls ``expire(owner)``
    ``delay`` seconds later, unless the returned ``Timer`` is cleared first.

    One action for all of them, rather than a callback per timer: a bound method made per
    start was an allocation per timer, and every timer of a set does the same thing.
    """

    __slots__ = ("_compact_at", "_handle", "_loop", "_queue", "delay", "expire")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, delay: float, expire: Callable[[_T], object]
    ) -> None:
        self._loop = loop
        self.delay = delay
        self.expire = expire
        self._queue: deque[Timer] = deque()
        self._handle: asyncio.TimerHandle | None = None
        self._compact_at = _COMPACT_MIN

    def __len__(self) -> int:
        """The timers started and neither fired nor cancelled (counted: for diagnostics)."""
        return sum(1 for timer in self._queue if timer)

    def start(self, owner: _T) -> Timer:
        """Call ``expire(owner)`` ``delay`` seconds from now unless the result is cleared."""
        timer: Timer = [self._loop.time() + self.delay, owner]
        queue = self._queue
        queue.append(timer)
        if self._handle is None:
            self._handle = self._loop.call_at(timer[0], self._fire)
        elif len(queue) > self._compact_at:
            # Cancelled entries wait for their turn at the head; once they outnumber the
            # live ones since the last pass, drop them all (a C-level pass: amortised O(1)).
            self._queue = queue = deque(filter(None, queue))
            self._compact_at = max(_COMPACT_MIN, 2 * len(queue))
        return timer

    def _fire(self) -> None:
        # self._handle stays set while callbacks run, so a timer they start does not arm a
        # second loop timer; it is re-armed for the new head below.
        queue = self._queue
        now = self._loop.time() + _SLACK_S
        expire = self.expire
        while queue:
            head = queue[0]
            if head and head[0] > now:
                break
            queue.popleft()
            if not head:
                continue
            owner = head[1]
            head.clear()
            try:
                expire(owner)
            except Exception as exc:  # one failing callback must not stop the others
                self._loop.call_exception_handler(
                    {"message": "Timer callback failed", "exception": exc}
                )
            queue = self._queue  # a callback may have started (and compacted) timers
        while queue and not queue[0]:
            queue.popleft()
        self._handle = self._loop.call_at(queue[0][0], self._fire) if queue else None

    def close(self) -> None:
        """Cancel every pending timer."""
        for timer in self._queue:
            timer.clear()
        self._queue.clear()
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


# One set of timers per loop, delay and action, shared by every listener: a FixedDelayTimers
# holds a deque (about 600 bytes even when empty), and five per listener were 30 MB at
# 10,000 service ports. Sharing changes nothing for a connection: expiry order is by start
# time whichever listener started it.
_SHARED: dict[asyncio.AbstractEventLoop, dict[tuple[float, Callable[..., object]], Any]] = {}


def shared_timers(
    loop: asyncio.AbstractEventLoop, delay: float, expire: Callable[[_T], object]
) -> FixedDelayTimers[_T]:
    """The ``FixedDelayTimers`` of ``delay`` seconds and ``expire`` on ``loop`` (created on
    first use)."""
    of_loop = per_loop(_SHARED, loop, lambda _: {})
    timers: FixedDelayTimers[_T] | None = of_loop.get((delay, expire))
    if timers is None:
        timers = of_loop[delay, expire] = FixedDelayTimers(loop, delay, expire)
    return timers
