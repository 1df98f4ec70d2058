"""Busy polling (``--busy-poll``): after each I/O event, a data-plane loop keeps polling its
sockets for a while instead of going to sleep at once.

Why: a relayed request wakes the proxy's CPU twice (the request, then the endpoint's answer),
and on some machines a CPU that went idle takes long to wake. Measured on a 2-vCPU KVM guest
whose idle vCPUs halt (cpuidle driver "none"): a pipe write from one CPU, once a millisecond,
woke a reader blocked on the other, idle, CPU within 150-300 us at p99 (8 runs; their medians
12-146 us), against 11-13 us when that CPU was kept busy. Through a ClusterIP there
(``bench.deployed``, 3 rounds), the keep-alive p99 of uproxy and of HAProxy alike read
0.82-1.01 ms against kernel DNAT's 0.07-0.08 (kernel DNAT wakes no other CPU); with a 5 ms
window uproxy read 0.082-0.101 ms, HAProxy's "busy-polling" 0.079-0.092, each for a whole
CPU while requests came every 0.3 ms. HAProxy polls for ever; here the loop polls only
within the window after the last event, so a worker with nothing to relay sleeps as before.
A window shorter than the gaps between requests ends just before some of them: with 1 ms,
where each connection waited 1 ms between requests, the p99 read 0.088-0.416 ms.

How: each pass over a set's events (``poller.LoopEpoll.follow_with``) notes the time and, if
the loop is not polling already, queues a callback that queues itself again while the window
lasts. While a callback is queued the loop's own poll does not wait (its timeout is 0), so the
loop goes round, each round one ``epoll_wait`` that returns at once, and events are handled
as soon as they arrive. When the window ends with no event the callback is not queued again
and the loop sleeps in its poll until the next event.

The cost is a CPU per polling worker while traffic comes more often than the window, and less
CPU for what shares it (the control process, below the workers, gets less of a CPU a worker
polls on). So it is off unless asked for, for nodes that give the proxy CPUs of its own.
"""

from __future__ import annotations

import asyncio
import time

from uproxy.dataplane.poller import poller_for, read_poller_for


class BusyPoll:
    """Keeps ``loop`` polling for ``window_s`` after the last event it is told of (``kick``)."""

    __slots__ = ("_last", "_loop", "passes", "polling", "window_s")

    def __init__(self, loop: asyncio.AbstractEventLoop, window_s: float) -> None:
        self._loop = loop
        self.window_s = window_s
        self._last = 0.0
        self.polling = False
        self.passes = 0  # rounds the loop went without sleeping (for tests and debugging)

    def kick(self) -> None:
        """An event was handled: poll for the window from now."""
        self._last = time.monotonic()
        if not self.polling and self.window_s > 0:
            self.polling = True
            self._loop.call_soon(self._poll)

    def _poll(self) -> None:
        if time.monotonic() - self._last < self.window_s:
            self.passes += 1
            self._loop.call_soon(self._poll)
        else:
            self.polling = False


_INSTALLED: dict[asyncio.AbstractEventLoop, BusyPoll] = {}


def install(loop: asyncio.AbstractEventLoop, window_s: float) -> BusyPoll | None:
    """Busy-poll ``loop``'s relayed, listening and datagram sockets with ``window_s`` (0:
    never; a later call changes the window). None when there is nothing to poll for."""
    busy = _INSTALLED.get(loop)
    if busy is not None:
        busy.window_s = window_s
        return busy
    if window_s <= 0:
        return None
    for closed in [other for other in _INSTALLED if other.is_closed()]:
        del _INSTALLED[closed]
    busy = _INSTALLED[loop] = BusyPoll(loop, window_s)
    poller_for(loop).follow_with(busy.kick)
    read_poller_for(loop).follow_with(busy.kick)
    return busy
