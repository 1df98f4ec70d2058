"""The relay's sockets in one edge-triggered epoll set of its own, watched by the event loop
(and, at the end, the listening and datagram sockets in a level-triggered one).

Why not the loop's own ``add_reader``/``add_writer`` on each socket: uvloop turns each into
a libuv poll handle, and every change re-registers it. Traced here: ``add_reader`` on a new
fd costs five system calls (an epoll add and delete to probe the fd, ioctl(FIONBIO), a
delete, an add through io_uring), ``remove_reader`` three, and each switch between reading
and writing two more. A relay on raw sockets driven that way made 45 system calls per
proxied connection, against 37.5 through uvloop's transports and 22.9 with this set.

Here each socket is registered once, edge-triggered, for input, hang-up and (when needed)
output, and never modified again; closing the socket removes it from the set (the kernel
does that when the last reference to the file goes). The set's own fd is the only one the
loop watches: one ``add_reader`` per loop. When it is readable, one ``epoll_wait`` (with
no wait) collects the ready sockets and their event masks, and each socket's handler
runs. Edge-triggered means a handler hears about new input or new room once: it must read
(or write) until the kernel says EAGAIN, or until a short read shows the queue drained,
and remember the readiness it did not use (see ``relay._Side``).

An fd number can be reused within one batch of events (a handler closes a socket, another
opens one); the batch may still hold the old socket's event. ``forget`` marks the fd
stale for the rest of the batch, so that event never reaches the new socket's handler (to
a socket still connecting, a stray "writable" would look like a completed connect). This
relies on the relay's sockets having one fd each: a copy (dup, or a forked child that has
not exec'd yet) would keep a closed socket in the set. The relay never copies them, and
its sockets are close-on-exec.
"""

from __future__ import annotations

import asyncio
import select
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

IN = select.EPOLLIN
OUT = select.EPOLLOUT
RDHUP = select.EPOLLRDHUP
HUP = select.EPOLLHUP
ERR = select.EPOLLERR
_ET = select.EPOLLET
READ_EVENTS = IN | RDHUP | _ET  # an accepted socket: only input until a write falls short
ALL_EVENTS = IN | OUT | RDHUP | _ET  # a dialed socket: "writable" is how a connect completes

_MAX_EVENTS = 256  # per batch; more stay ready in the set, and the loop comes back for them

# A pass over the listening and datagram sockets (``ReadPoller``) takes no more readers once
# it has run this long, and a listener accepts no more connections and opens no more UDP
# flows in it: the rest stay ready in the level-triggered set (or queued in their sockets),
# and the relays' events, waiting in the other set, are taken in between. A burst of 3,000
# new UDP clients (``python -m bench.udp_flows``) made passes of 1.2-2 ms (64 new flows at
# about 8 us each and 100-190 replies at about 4 us), during which every relay of the
# worker waited; during a flood of new TCP connections each call accepted and dialed 64.
READ_PASS_S = 0.0002
_READ_BATCH = 64  # the readers one pass can reach in READ_PASS_S, and a few more
PASS_CLOCK = time.perf_counter  # the clock of ``ReadPoller.deadline``


class Handler(Protocol):
    def event(self, mask: int) -> None: ...


class Reader(Protocol):
    def readable(self) -> None: ...


class LoopEpoll:
    """An epoll set of its own whose fd is the one thing the loop watches for it: subclasses
    say how sockets are registered and what their readiness calls (``_ready``)."""

    __slots__ = ("_epoll", "_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._epoll = select.epoll()
        loop.add_reader(self._epoll.fileno(), self._ready)

    def fileno(self) -> int:
        return self._epoll.fileno()

    def follow_with(self, after: Callable[[], None]) -> None:
        """Call ``after`` after each pass over this set's events (``busypoll``)."""
        ready = self._ready

        def ready_then() -> None:
            ready()
            after()

        self._loop.add_reader(self._epoll.fileno(), ready_then)  # replaces the plain one

    def _ready(self) -> None:
        raise NotImplementedError

    def _forget_all(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        if not self._loop.is_closed():
            self._loop.remove_reader(self._epoll.fileno())
        self._epoll.close()
        self._forget_all()


_T = TypeVar("_T")


def per_loop(
    registry: dict[asyncio.AbstractEventLoop, _T],
    loop: asyncio.AbstractEventLoop,
    make: Callable[[asyncio.AbstractEventLoop], _T],
    drop: Callable[[_T], object] | None = None,
) -> _T:
    """``registry``'s object for ``loop``, made on first use; those of closed loops are
    dropped then (loops come and go in tests; a process has one)."""
    obj = registry.get(loop)
    if obj is None:
        for closed in [other for other in registry if other.is_closed()]:
            gone = registry.pop(closed)
            if drop is not None:
                drop(gone)
        obj = registry[loop] = make(loop)
    return obj


class EdgePoller(LoopEpoll):
    """One loop's epoll set of relayed sockets (see the module docstring)."""

    __slots__ = ("_handlers", "_stale", "buffer")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        # The read buffer of every relay on this loop: what a relay reads, it writes on
        # before it returns (the rest, if any, is copied out), so one buffer serves them all.
        self.buffer = memoryview(bytearray(0))
        self._handlers: dict[int, Handler] = {}
        self._stale: set[int] = set()
        super().__init__(loop)

    def __len__(self) -> int:
        return len(self._handlers)

    def reserve(self, size: int) -> None:
        """Make ``buffer`` at least ``size`` bytes."""
        if len(self.buffer) < size:
            self.buffer = memoryview(bytearray(size))

    def register(self, fd: int, handler: Handler, events: int) -> None:
        """Watch ``fd``; raises OSError (ENOMEM, ENOSPC: fs.epoll.max_user_watches)."""
        self._epoll.register(fd, events)
        self._handlers[fd] = handler

    def watch_writes(self, fd: int) -> None:
        """Add output to an fd registered with ``READ_EVENTS`` (once: it stays on)."""
        self._epoll.modify(fd, ALL_EVENTS)

    def modify(self, fd: int, events: int) -> None:
        """Watch a registered fd for ``events`` from now on (edge-triggered: an event that
        is already true is reported once more after the change)."""
        self._epoll.modify(fd, events)

    def forget(self, fd: int) -> None:
        """Stop calling ``fd``'s handler; the caller closes the fd, which leaves the set."""
        if self._handlers.pop(fd, None) is not None:
            self._stale.add(fd)

    def _ready(self) -> None:
        stale = self._stale
        stale.clear()  # closed before this poll: the events below are all current
        handlers = self._handlers
        for fd, mask in self._epoll.poll(0, _MAX_EVENTS):
            if fd in stale:
                continue
            handler = handlers.get(fd)
            if handler is None:
                continue
            try:
                handler.event(mask)
            except Exception as exc:  # the other sockets' edges in this batch must not be lost
                self._loop.call_exception_handler(
                    {"message": "Relay event handler failed", "exception": exc}
                )

    def _forget_all(self) -> None:
        self._handlers.clear()


_POLLERS: dict[asyncio.AbstractEventLoop, EdgePoller] = {}


def poller_for(loop: asyncio.AbstractEventLoop) -> EdgePoller:
    """The ``EdgePoller`` of ``loop``, created on first use.

    Like an event loop, a poller does not survive ``fork()`` (parent and child would share
    one epoll set): a worker process makes its loop, and with it its poller, after it starts.
    """
    return per_loop(_POLLERS, loop, EdgePoller, EdgePoller.close)


class ReadPoller(LoopEpoll):
    """One loop's listening and datagram sockets in a level-triggered epoll set.

    Why not ``loop.add_reader`` per socket: uvloop makes each one a libuv poll handle plus
    a callback handle, about 640 bytes (6.1 MiB in a worker at 10,000 TCP ports, its largest
    per-port item), added with five system calls and removed with three (see above): for a
    UDP flow, which gets a socket of its own, that was eight system calls per flow. Here a
    socket costs a dict entry and one ``epoll_ctl`` to add (closing it removes it); the loop
    watches the set's fd, and when it is readable one ``epoll_wait`` (no wait) says which
    sockets have something to read: one more system call per pass over the ready ones, as
    the relays' ``EdgePoller`` pays per batch of events.

    Level-triggered, unlike the relays' set: a reader whose batch (``accept_batch``,
    ``udp_batch``) did not empty its queue is reported again on the next pass, as with the
    loop's own readers, so one busy port does not starve the others and nothing has to
    remember a readiness. An fd unwatched and reused within one batch may get a stale call:
    its reader then finds nothing to read (EAGAIN) and returns.

    It also holds the loop's datagram buffer (``buffer``): a UDP listener or flow reads into
    it and sends what it read before it returns, so one buffer serves them all (two of 64 KiB
    per UDP listener before).
    """

    __slots__ = ("_readers", "buffer", "deadline")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._readers: dict[int, Reader] = {}
        self.buffer = memoryview(bytearray(0))
        # When the current pass ends (``READ_PASS_S``, on ``PASS_CLOCK``): a reader with
        # costly work per item (a listener accepting, or opening UDP flows) stops there too.
        # Outside a pass (a timer's call) it is in the past: one item, the rest next pass.
        self.deadline = 0.0
        super().__init__(loop)

    def __len__(self) -> int:
        return len(self._readers)

    def reserve(self, size: int) -> None:
        """Make ``buffer`` at least ``size`` bytes."""
        if len(self.buffer) < size:
            self.buffer = memoryview(bytearray(size))

    def watch(self, fd: int, reader: Reader) -> None:
        """Call ``reader.readable()`` while ``fd`` has something to read; raises OSError."""
        self._epoll.register(fd, select.EPOLLIN)
        self._readers[fd] = reader

    def unwatch(self, fd: int) -> None:
        """Stop watching ``fd`` (before it is closed, or while its reader is paused)."""
        if self._readers.pop(fd, None) is not None:
            self._epoll.unregister(fd)

    def forget(self, fd: int) -> None:
        """Stop calling ``fd``'s reader; the caller closes the fd, and closing its only copy
        takes it out of the set (one system call less per UDP flow than ``unwatch``)."""
        self._readers.pop(fd, None)

    def _ready(self) -> None:
        readers = self._readers
        clock = PASS_CLOCK
        self.deadline = deadline = clock() + READ_PASS_S
        for fd, _ in self._epoll.poll(0, _READ_BATCH):
            reader = readers.get(fd)
            if reader is None:
                continue  # unwatched by an earlier reader of this batch
            try:
                reader.readable()
            except Exception as exc:  # the other readers of this batch must still run
                self._loop.call_exception_handler(
                    {"message": "Read handler failed", "exception": exc}
                )
            if clock() >= deadline:
                return  # the others are reported again on the loop's next pass

    def _forget_all(self) -> None:
        self._readers.clear()


_READ_POLLERS: dict[asyncio.AbstractEventLoop, ReadPoller] = {}


def read_poller_for(loop: asyncio.AbstractEventLoop) -> ReadPoller:
    """The ``ReadPoller`` of ``loop``, created on first use (not across ``fork()``, as
    ``poller_for``)."""
    return per_loop(_READ_POLLERS, loop, ReadPoller, ReadPoller.close)


def io_waiting(loop: asyncio.AbstractEventLoop) -> Callable[[], bool]:
    """A check, for work that runs in slices, of whether any of ``loop``'s relayed, listening
    or datagram sockets has an event waiting (one ``poll`` with no wait, ~1 us).

    It asks the two sets' own fds, which read as readable while an event waits in them,
    edge-triggered ones included, and asking takes nothing: the events stay for the
    ``epoll_wait`` of the loop's next pass."""
    watch = select.poll()
    for fd in (poller_for(loop).fileno(), read_poller_for(loop).fileno()):
        watch.register(fd, select.POLLIN)
    poll = watch.poll
    return lambda: bool(poll(0))
