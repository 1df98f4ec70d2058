"""How many connections each worker holds, so that workers sharing a socket share its load.

A TCP proxy port that every worker accepts on (``uproxy.workers``) wakes all of them for a
new connection, and the first one awake takes what is queued, up to a batch per wake. Under
steady load that spreads connections evenly; a burst that arrives while the workers idle
mostly did not: the first worker drained the queue before the other's idle CPU had woken
(100-300 us on a VM). ``--workers 2`` on loopback, N connects at once, 8 bursts each: of 4
connections all went to one worker in 4 bursts, of 8 in 5, of 16 in 4. A client's pool of
long-lived connections (a database's, gRPC's) then loads one worker while the other idles.

So each worker publishes, in a page all of them map (a memfd the control process creates),
the TCP connections it holds (accepted and not yet released) and when it last took one. A
worker ahead of the least loaded one by 2 connections (and a quarter more as they grow),
while that one has taken none for ``IDLE_S`` (it is slower to wake, or its CPU is idle),
leaves a shared socket's queue to the others: they were woken by the same connections and
take them once their CPUs are up. It looks again at every release of its own and every
``POLL_S``, and comes back once it is no longer ahead or the other takes connections again
(then the two take turns as equals). Still ahead of an idle worker after ``DEFER_S`` (that
one is stopped, or stuck), it takes what is queued, up to ``TAKEN_AFTER``, however loaded.
Under steady load every worker takes connections all the time, so nobody defers: deferring
whenever ahead cost 2 % of the connections/s and 1 us of CPU per connection (``wrk -c16``,
``Connection: close``, 2 CPUs, 5 alternating runs each) for nothing a steady load needs. A
dead worker's slot reads ``GONE`` (set by the control process) until its replacement starts,
so nobody waits for it.

HAProxy and Envoy balance their threads the same way, by connections held, but hand an
accepted connection to the least loaded thread in memory; between processes that is a
descriptor sent over a socket, three system calls, where leaving it queued costs none.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import MutableSequence
from typing import Protocol, cast

GONE = 1 << 62  # a dead worker's count: never the least loaded
# A worker that has taken no connection for this long is taken for idle. Under load every
# worker takes connections all the time (30,000 a second is one every 70 us per worker).
IDLE_S = 0.0005
# How often a deferring worker looks again (a pool of long-lived connections releases
# nothing): uvloop's timers count whole milliseconds.
POLL_S = 0.001
# How long a worker ahead of an idle one leaves a queue to it at most: a few times what an
# idle vCPU takes to wake (p99 150-300 us on the VMs measured).
DEFER_S = 0.002
# What a worker takes when it comes back after ``DEFER_S`` (a lone worker's batch per pass,
# ``DataplaneSettings.accept_batch``): a worker that stopped taking caps the others at this
# many per ``DEFER_S``, not at the 4 per pass of workers that share a socket.
TAKEN_AFTER = 64
_SLOT = 8
CLOCK = time.monotonic  # one clock for every process


class Deferring(Protocol):
    def undefer(self) -> None: ...


class Loads:
    """A view of every worker's slots; this worker writes its own (``index``), reads all:
    ``values`` the connections each holds, ``took`` when each last took one."""

    __slots__ = ("_map", "_only", "_others", "deferring", "index", "took", "values")

    def __init__(self, fd: int, count: int, index: int) -> None:
        self._map = mmap.mmap(fd, 2 * count * _SLOT)
        view = memoryview(self._map)
        self.values = cast(MutableSequence[int], view[: count * _SLOT].cast("q"))
        self.took = cast(MutableSequence[float], view[count * _SLOT :].cast("d"))
        self.index = index
        self._others = tuple(i for i in range(count) if i != index)
        self._only = self._others[0] if len(self._others) == 1 else None  # the usual pair
        self.values[index] = 0
        # The listeners leaving their queue to the others now.
        self.deferring: list[Deferring] = []

    def limit(self, now: float) -> int:
        """The connections this worker may hold before it defers to the least loaded other
        worker: ``GONE`` (never) when that one is busy (it took one within ``IDLE_S``) or there
        is none. The lead allowed: 2 connections, and a quarter more as they grow."""
        values = self.values
        at = self._only
        if at is not None:
            least = values[at]
        else:
            least = GONE
            at = -1
            for i in self._others:
                v = values[i]
                if v < least:
                    least, at = v, i
        if least >= GONE or now - self.took[at] < IDLE_S:
            return GONE
        return least + 2 + (least >> 2)

    def ahead(self) -> bool:
        """Whether a deferring listener should go on deferring."""
        return self.values[self.index] >= self.limit(CLOCK())

    def released(self) -> None:
        """One of this worker's connections ended (the caller took it off the count): the
        listeners that defer come back once it is no longer ahead (``undefer``)."""
        if not self.ahead():
            deferring, self.deferring = self.deferring, []
            for listener in deferring:
                listener.undefer()

    def close(self) -> None:
        cast(memoryview, self.values).release()
        cast(memoryview, self.took).release()
        self._map.close()


class LoadsWriter:
    """The control process's hold on the page: it marks dead workers."""

    def __init__(self, count: int) -> None:
        self.fd = os.memfd_create("uproxy-loads")  # at zero; passed on to every worker
        os.ftruncate(self.fd, 2 * count * _SLOT)
        self._map = mmap.mmap(self.fd, 2 * count * _SLOT)
        self._values = cast(MutableSequence[int], memoryview(self._map)[: count * _SLOT].cast("q"))

    def gone(self, index: int) -> None:
        self._values[index] = GONE

    def read(self) -> list[int]:
        return list(self._values)

    def close(self) -> None:
        cast(memoryview, self._values).release()
        self._map.close()
        os.close(self.fd)


# This worker's view, set by its ``main`` when it shares sockets with other workers; None
# in process and with one worker.
LOADS: Loads | None = None
