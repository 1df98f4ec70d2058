"""Per-connection timers that all share one delay, served by a single loop timer.

Every TCP connection arms a dial deadline (per attempt) and, once one side has sent its
FIN, a half-close linger. Each ``loop.call_later`` builds a TimerHandle, inserts it into the
loop's timer heap and removes it again on cancel: the two timers were 3.9 % of the proxy's
CPU in the connection-rate profile. Timers with one fixed delay expire in the order they
were started, so a FIFO queue with one loop timer armed for its head gives the same
expiry times for the price of an append.

Cancelled entries drop the reference to their callback at once (nothing they point at is
kept alive) and are skipped when they reach the head. Should a long timer at the head hold
back many cancelled ones behind it, the queue is compacted once it is more than twice the
live entries (amortised O(1)), so its size stays proportional to the live timers.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

_COMPACT_MIN = 1024  # below this many entries, compacting is not worth a pass
# A loop timer may run up to a millisecond early (libuv counts whole milliseconds; asyncio
# allows its clock resolution): entries due within this slack fire with it, not after a spin.
_SLACK_S = 0.001


class Deadline:
    """One started timer; ``cancel()`` is idempotent and safe after it fired."""

    __slots__ = ("callback", "owner", "when")

    def __init__(
        self, owner: FixedDelayTimers, when: float, callback: Callable[[], object]
    ) -> None:
        self.owner = owner
        self.when = when
        self.callback: Callable[[], object] | None = callback

    def cancel(self) -> None:
        if self.callback is not None:
            self.callback = None
            self.owner.live -= 1


class FixedDelayTimers:
    """Starts timers of ``delay`` seconds on ``loop``; see the module docstring."""

    __slots__ = ("_handle", "_loop", "_queue", "delay", "live")

    def __init__(self, loop: asyncio.AbstractEventLoop, delay: float) -> None:
        self._loop = loop
        self.delay = delay
        self._queue: deque[Deadline] = deque()
        self._handle: asyncio.TimerHandle | None = None
        self.live = 0

    def __len__(self) -> int:
        return self.live

    def start(self, callback: Callable[[], object]) -> Deadline:
        """Call ``callback`` ``delay`` seconds from now unless the result is cancelled."""
        queue = self._queue
        while queue and queue[0].callback is None:
            queue.popleft()
        deadline = Deadline(self, self._loop.time() + self.delay, callback)
        queue.append(deadline)
        self.live += 1
        if self._handle is None:
            self._handle = self._loop.call_at(deadline.when, self._fire)
        elif len(queue) > _COMPACT_MIN and len(queue) > 2 * self.live:
            self._queue = deque(d for d in queue if d.callback is not None)
        return deadline

    def _fire(self) -> None:
        # self._handle stays set while callbacks run, so a timer they start does not arm a
        # second loop timer; it is re-armed for the new head below.
        queue = self._queue
        now = self._loop.time() + _SLACK_S
        while queue:
            head = queue[0]
            callback = head.callback
            if callback is not None and head.when > now:
                break
            queue.popleft()
            if callback is None:
                continue
            head.callback = None
            self.live -= 1
            try:
                callback()
            except Exception as exc:  # one failing callback must not stop the others
                self._loop.call_exception_handler(
                    {"message": "Timer callback failed", "exception": exc}
                )
            queue = self._queue  # a callback may have started (and compacted) timers
        while queue and queue[0].callback is None:
            queue.popleft()
        self._handle = self._loop.call_at(queue[0].when, self._fire) if queue else None

    def close(self) -> None:
        """Cancel every pending timer."""
        for deadline in self._queue:
            deadline.cancel()
        self._queue.clear()
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


# One set of timers per loop and delay, shared by every listener: a FixedDelayTimers holds a
# deque (about 600 bytes even when empty), and five per listener were 30 MB at 10,000
# service ports. Sharing changes nothing for a connection: expiry order is by start time
# whichever listener started it.
_SHARED: dict[asyncio.AbstractEventLoop, dict[float, FixedDelayTimers]] = {}


def shared_timers(loop: asyncio.AbstractEventLoop, delay: float) -> FixedDelayTimers:
    """The ``FixedDelayTimers`` of ``delay`` seconds on ``loop`` (created on first use)."""
    per_loop = _SHARED.get(loop)
    if per_loop is None:
        for closed in [other for other in _SHARED if other.is_closed()]:
            del _SHARED[closed]  # loops come and go in tests; a process has one
        per_loop = _SHARED[loop] = {}
    timers = per_loop.get(delay)
    if timers is None:
        timers = per_loop[delay] = FixedDelayTimers(loop, delay)
    return timers
