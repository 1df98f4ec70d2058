"""TCP proxy ports: accept, pick an endpoint, hand the connection to a relayed pair.

A relayed connection costs 93-100 us of proxy CPU (accepted, dialed, relayed, closed; ``wrk``
with ``Connection: close``, proxy pinned to one core) on the AMD host of the first
measurements, and 43-44 us of which 12 in user space on the Intel host of 2026-12-02
(HAProxy: 34-35 us, 4.5 in user space, in the same run): see ``relay`` for how, and for the
system calls it takes.

* Accept is our own: a non-blocking listening socket in the loop's ``ReadPoller``, a
  level-triggered epoll set (see there why not ``loop.add_reader``).
  ``create_server`` in asyncio and uvloop handles EMFILE internally (asyncio logs a
  traceback and retries after 1 s; libuv accepts and drops the surplus), so it could not be
  counted or paced. One readiness callback accepts up to ``accept_batch`` connections, with
  ``socket._accept()`` (``socket.accept()`` converts enums per call, visible in profiles),
  and stops once the poller's pass is over (``READ_PASS_S``, 0.2 ms: about 8 connections
  accepted and dialed). During a flood (``wrk -c128 -H "Connection: close"``, one worker
  saturated) every call took a batch of 64 while the relays waited. Paced keep-alive
  requests beside it, 9 alternating pairs: p50 1.8-3.0 and p99 4.0-5.5 ms, against
  1.10-1.19 and 1.9-2.9 with the bound; the flood's connections/s 27,800-32,900 against
  27,300-31,900 (1 % fewer on average, within the noise). A bound of 0.5 ms read as no
  bound.
  A connection's sockets (the accepted one and the dial) are ``_socket.socket``, the C type
  that ``socket.socket`` subclasses in Python: its ``__init__`` and ``close`` are two Python
  frames each, and nothing else of the subclass is used here (create and close: 3.0-4.5 us
  against 2.3-3.0, timeit, three rounds).
* The endpoint is picked in the accept callback (a synchronous index step). With no
  endpoint the accepted socket is closed with SO_LINGER 0 at once: the client sees a RST,
  and no pair is ever made for it.
* Near the fd limit, accepting pauses (``fdreserve``) rather than taking the fds the dials
  in flight need.
* On a socket every worker accepts on, a worker ahead of an idle one in connections held
  leaves the queue to it for a moment (``spread``)."""

from __future__ import annotations

import _socket
import asyncio
import contextlib
import logging
import os
import socket
import sys
from collections.abc import Iterable
from typing import Protocol, Self

from uproxy.dataplane import series, spread
from uproxy.dataplane.balancer import Balancer
from uproxy.dataplane.fdreserve import FD_RESERVE, RESOURCE_ERRNOS
from uproxy.dataplane.poller import PASS_CLOCK, per_loop, poller_for, read_poller_for
from uproxy.dataplane.relay import Connection, reset_socket
from uproxy.dataplane.settings import DataplaneSettings
from uproxy.dataplane.sockets import bind_tcp
from uproxy.dataplane.stats import Stats
from uproxy.dataplane.timers import FixedDelayTimers, shared_timers
from uproxy.dataplane.udp import UdpListener
from uproxy.model import ServicePortName, Traffic

log = logging.getLogger("uproxy.dataplane.tcp")

# The share of a drain (at most 1 s) left to the connections a listener took last.
DRAIN_LAST_CALL = 0.2

DialTimers = dict[float, FixedDelayTimers[Connection]]

# Every reason accepting pauses for, bound at zero: a dashboard's
# ``rate(uproxy_accept_paused_total[5m])`` reads 0, not "no data", on a node that never ran out.
_ACCEPT_PAUSED = {
    reason: series.ACCEPT_PAUSED.labels(reason)
    for reason in (*RESOURCE_ERRNOS.values(), "fd_reserve")
}

# The dial timers of each loop and schedule (``settings.dial_timeouts_s``), one dict shared
# by every listener with that schedule: a dict of four per listener was 2 MB at 10,000 ports.
_DIAL_TIMERS: dict[asyncio.AbstractEventLoop, dict[tuple[float, ...], DialTimers]] = {}


class _Retiring:
    """Watches a retiring listener's socket in its place: notes every wake-up, and closes
    the listener once a whole ``idle_s`` passed without one."""

    __slots__ = ("idle_s", "listener", "woken")

    def __init__(self, listener: TcpListener, idle_s: float) -> None:
        self.listener = listener
        self.idle_s = idle_s
        self.woken = False
        listener.loop.call_later(idle_s, self._check)

    def readable(self) -> None:
        self.woken = True
        # Its own socket, or one the others are leaving: nobody else to defer to.
        self.listener._accept(self.listener.settings.accept_batch, defer=False)

    def _check(self) -> None:
        listener = self.listener
        if listener.socket is None:
            return  # closed meanwhile (a stop)
        if self.woken:
            self.woken = False
            listener.loop.call_later(self.idle_s, self._check)
            return
        if listener._paused is None:  # until the queue is empty
            listener._accept(listener.settings.listen_backlog, defer=False, whole=True)
        listener.close()


class _Draining:
    """Watches a draining listener's socket in its place: accepts without deferring to
    another worker, which may have closed its copy already (``TcpListener.shutdown``)."""

    __slots__ = ("listener",)

    def __init__(self, listener: TcpListener) -> None:
        self.listener = listener

    def readable(self) -> None:
        self.listener._accept(self.listener.settings.accept_batch, defer=False)


def _dial_timers(loop: asyncio.AbstractEventLoop, timeouts: tuple[float, ...]) -> DialTimers:
    schedules = per_loop(_DIAL_TIMERS, loop, lambda _: {})
    timers = schedules.get(timeouts)
    if timers is None:
        timers = schedules[timeouts] = {
            t: shared_timers(loop, t, Connection.dial_expired) for t in timeouts
        }
    return timers


class TcpListener:
    """One TCP proxy port of one service port and traffic class.

    A worker holds thousands, nearly all idle, so an idle one is kept small: slots, and
    nothing of its own that could be shared (the dial timers, the address string). In a
    worker at 10,000 ports (tracemalloc) the instance, its connection set, its dict of dial
    timers and its address went from 700 bytes to 220, besides its ``Stats`` and its
    entry in the ``ReadPoller`` (60 bytes, against 640 for a reader of the loop's own).
    """

    __slots__ = (
        "_acceptor",
        "_address",
        "_conns",
        "_defer_until",
        "_drained",
        "_family",
        "_loads",
        "_paused",
        "_sock",
        "_starved",
        "_watcher",
        "balancer",
        "dial_timers",
        "loop",
        "name",
        "poller",
        "settings",
        "stats",
        "traffic",
    )

    def __init__(
        self,
        *,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        name: ServicePortName,
        balancer: Balancer,
        traffic: Traffic,
        settings: DataplaneSettings,
    ) -> None:
        self.loop = loop
        self.name = name
        self.balancer = balancer
        self.traffic = traffic
        self.settings = settings
        self.stats = Stats(name, traffic)
        # Asked of the socket when first wanted: a worker handed 10,000 sockets bound by the
        # control process (which knows their addresses) never asks.
        self._address: tuple[str, int] | None = None
        # The connections accepted and not yet released, as the keys of a dict: an empty
        # dict is 64 bytes, an empty set 216 (its first table is inline).
        self._conns: dict[Connection, None] = {}
        self.dial_timers = _dial_timers(loop, settings.dial_timeouts_s)
        self._sock: socket.socket | None = sock
        self._family = sock.family  # read once: socket.family converts to an enum per read
        self._acceptor = read_poller_for(loop)
        # What the acceptor calls in place of this listener (None: the listener itself).
        # Never ``self``: a listener that refers to itself outlives its close until a full
        # collection, and one frozen with a bulk change (``uproxy.heap``) never goes.
        self._watcher: _Retiring | _Draining | None = None
        # The relays' epoll set (an fd: made now, not at an fd-starved accept), and its read
        # buffer made big enough for this port's reads.
        self.poller = poller_for(loop)
        self.poller.reserve(settings.high_water)
        self._paused: asyncio.TimerHandle | None = None  # out of fds, or deferring
        self._defer_until = 0.0
        # Every worker's connections held, when this one shares sockets with others.
        self._loads = spread.LOADS
        self._starved = False  # paused for lack of fds and not accepted since
        # Created by shutdown() only: an Event per listener was 6 MB at 10,000 ports.
        self._drained: asyncio.Future[None] | None = None

    @classmethod
    async def open(
        cls,
        *,
        name: ServicePortName,
        balancer: Balancer,
        traffic: Traffic,
        host: str,
        port: int,
        settings: DataplaneSettings,
    ) -> Self:
        """Bind and start accepting; port 0 lets the OS choose. Raises OSError."""
        FD_RESERVE.refresh_limit()
        sock = bind_tcp(
            host, port, backlog=settings.listen_backlog, keepalive=settings.tcp_keepalive_s
        )
        return cls.serve(sock, name=name, balancer=balancer, traffic=traffic, settings=settings)

    @classmethod
    def serve(
        cls,
        sock: socket.socket,
        *,
        name: ServicePortName,
        balancer: Balancer,
        traffic: Traffic,
        settings: DataplaneSettings,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> Self:
        """Start accepting on a listening socket bound elsewhere (a worker's share of a
        group, see ``sockets``); the listener owns it from now on.

        ``loop``: the running loop, when the caller has it (asking for it reads the process
        id, a system call: 10,000 of them when a worker is handed 10,000 ports). The fd
        limit the reserve works with is the caller's to read (``FD_RESERVE.refresh_limit``),
        once, not once per port."""
        if loop is None:
            loop = asyncio.get_running_loop()
        sock.setblocking(False)
        self = cls(
            loop=loop,
            sock=sock,
            name=name,
            balancer=balancer,
            traffic=traffic,
            settings=settings,
        )
        self._acceptor.watch(sock.fileno(), self)
        return self

    @property
    def draining(self) -> bool:
        """A stop is under way and this port still accepts (``drain``)."""
        return self._sock is not None and isinstance(self._watcher, _Draining)

    @property
    def busy(self) -> bool:
        """Whether a connection it took is still open."""
        return bool(self._conns)

    async def until_idle(self, deadline: float) -> None:
        """Wait until no connection is open (``released``) or ``deadline`` (loop time)."""
        if not self._conns:
            return
        self._drained = drained = self.loop.create_future()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout_at(deadline):
                await drained

    @property
    def address(self) -> tuple[str, int]:
        """The bound address and port (``("", 0)`` if closed before anyone asked)."""
        if self._address is None:
            if self._sock is None:
                return ("", 0)
            host, port = self._sock.getsockname()[:2]
            # Interned: a handful of addresses, for thousands of ports.
            self._address = (sys.intern(host), port)
        return self._address

    @property
    def host(self) -> str:
        return self.address[0]

    @property
    def port(self) -> int:
        return self.address[1]

    @property
    def socket(self) -> socket.socket | None:
        """The listening socket (None once closed)."""
        return self._sock

    @property
    def active(self) -> int:
        """Connections accepted and not yet closed (dialing or relaying)."""
        return len(self._conns)

    def readable(self) -> None:  # the ReadPoller's call: connections are waiting
        self._accept(self.settings.accept_batch)

    def _accept(self, batch: int, *, defer: bool = True, whole: bool = False) -> None:
        """Up to ``batch`` connections, until the acceptor's pass is over unless ``whole``
        (a retiring socket's last call, which takes what is queued before it closes)."""
        lsock = self._sock
        if lsock is None:
            return
        balancer = self.balancer
        traffic = self.traffic
        family = self._family
        fds = FD_RESERVE
        stats = self.stats
        loads = self._loads
        acceptor = self._acceptor
        # The connections this worker may hold before it leaves the queue to the others: on
        # a socket they all accept on (ClientIP affinity gives each worker a socket of its
        # own, see ``uproxy.workers``).
        limit = spread.GONE
        if loads is not None:
            held = loads.values
            me = loads.index
            now = spread.CLOCK()
            took = loads.took
            if defer and not balancer.affinity:
                limit = loads.limit(now)
                if held[me] >= limit:
                    self._defer(now)
                    return
        for _ in range(batch):
            try:
                # _accept() skips socket.accept()'s enum conversions (measurable per conn).
                fd, addr = lsock._accept()  # type: ignore[attr-defined]
            except BlockingIOError:
                return
            except OSError as exc:
                reason = RESOURCE_ERRNOS.get(exc.errno or 0)
                if reason is not None:
                    self.pause(reason)
                    return
                continue  # ECONNABORTED and the like: that client is gone already
            sock = _socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP, fd)
            if not stats.bound:  # at the first connection (a shared socket wakes every worker)
                stats.bind()
            ep = balancer.pick(addr[0], traffic)
            if ep is None:
                reset_socket(sock)
                stats.refused.value += 1
                stats.no_endpoints.value += 1
                continue
            conn = Connection(self, addr[0], ep)
            self._conns[conn] = None
            if loads is not None:
                held[me] += 1
                took[me] = now
            conn.start(sock)
            if fds.undialed >= fds.limit - 2 - fd:  # ``fds.full_after(fd)``, inline
                self.pause("fd_reserve")
                return
            if self._starved:  # the first one since a pause with room for its dial
                self._starved = False
                log.info("Accepting resumed", extra={"kv": {"service": str(self.name)}})
            if loads is not None and held[me] >= limit:
                return  # ahead now: the next wake defers, if anything is left
            if not whole and PASS_CLOCK() >= acceptor.deadline:
                return  # the pass is over (``READ_PASS_S``): the rest wait in the backlog

    def pause(self, reason: str) -> None:
        """Stop accepting for ``accept_backoff_s`` (out of fds or other resources)."""
        if self._paused is not None or self._sock is None:
            return
        self._acceptor.unwatch(self._sock.fileno())
        _ACCEPT_PAUSED[reason].value += 1
        if self._starved:
            # Still out of fds after the backoff: counted, but one log line per episode.
            self._paused = self.loop.call_later(self.settings.accept_backoff_s, self._resume)
            return
        self._starved = True
        log.warning(
            "Accepting paused: out of resources",
            extra={
                "kv": {
                    "service": str(self.name),
                    "port": self.port,
                    "reason": reason,
                    "open": len(self._conns),
                    "retry_s": self.settings.accept_backoff_s,
                }
            },
        )
        self._paused = self.loop.call_later(self.settings.accept_backoff_s, self._resume)

    def _resume(self) -> None:
        self._paused = None
        sock = self._sock
        if sock is None:
            return
        if not _room_for_a_pair(sock):
            # Still no fd for a connection and its dial: one accepted now would wait out its
            # dial budget and be reset (once every backoff, a client lost each time). Those
            # queued wait in the backlog for a pair to close; counted, not said again.
            _ACCEPT_PAUSED["fd_reserve"].value += 1
            self._paused = self.loop.call_later(self.settings.accept_backoff_s, self._resume)
            return
        self._acceptor.watch(sock.fileno(), self._watcher or self)
        self._accept(self.settings.accept_batch, defer=self._watcher is None)

    def _defer(self, now: float) -> None:
        """Ahead of an idle worker: leave the queue to the others (``spread``)."""
        if self._sock is None or self._loads is None:
            return
        self._acceptor.unwatch(self._sock.fileno())
        self._loads.took[self._loads.index] = 0.0  # not taking: the others do not wait for it
        self._defer_until = now + spread.DEFER_S
        self._paused = self.loop.call_later(spread.POLL_S, self._look)
        self._loads.deferring.append(self)

    def undefer(self) -> None:
        """No longer ahead, or the others are busy: accept again, as before."""
        paused = self._paused
        if paused is None or self._sock is None:
            return
        paused.cancel()
        self._paused = None
        self._acceptor.watch(self._sock.fileno(), self._watcher or self)

    def _look(self) -> None:
        """Deferring: go on, come back, or (after ``spread.DEFER_S``) take what nobody
        took meanwhile, however loaded."""
        self._paused = None
        loads = self._loads
        if self._sock is None or loads is None:
            return
        if loads.ahead():
            if spread.CLOCK() < self._defer_until:
                self._paused = self.loop.call_later(spread.POLL_S, self._look)
                return
            taking = True
        else:
            taking = False
        if self in loads.deferring:
            loads.deferring.remove(self)
        self._acceptor.watch(self._sock.fileno(), self._watcher or self)
        if taking:
            self._accept(spread.TAKEN_AFTER, defer=False)

    def released(self, conn: Connection) -> None:
        self._conns.pop(conn, None)
        loads = self._loads
        if loads is not None:
            loads.values[loads.index] -= 1
            if loads.deferring:
                loads.released()
        drained = self._drained
        if not self._conns and drained is not None and not drained.done():
            drained.set_result(None)

    def retire(self, idle_s: float) -> None:
        """This socket is leaving the port's group (ClientIP affinity turned on or off): the
        group sends it nothing new, but handshakes under way when it stopped choosing it
        still complete here. Go on accepting until none has come for ``idle_s``, then serve
        what is queued and close. Closing a listening socket resets the connections in its
        accept queue: clients the kernel had already accepted for this port."""
        sock = self._sock
        if sock is None:
            return
        watch = self._watcher = _Retiring(self, idle_s)
        if self._paused is None:
            self._acceptor.unwatch(sock.fileno())
            self._acceptor.watch(sock.fileno(), watch)

    def close(self) -> None:
        """Stop accepting; established connections carry on."""
        sock = self._sock
        if sock is None:
            return
        self._sock = None
        if self._paused is not None:
            self._paused.cancel()
            self._paused = None
            if self._loads is not None and self in self._loads.deferring:
                self._loads.deferring.remove(self)
        else:
            self._acceptor.unwatch(sock.fileno())
        self._watcher = None  # a _Retiring or _Draining refers back to this listener
        sock.close()

    async def shutdown(self, timeout: float) -> int:
        """Drain this port alone (see ``drain``); returns how many connections were reset."""
        return await drain([self], timeout)

    def keep_accepting(self) -> None:
        """A stop began: accept (without deferring to another worker, which may have closed
        its copy already) until ``stop_accepting``."""
        sock = self._sock
        if sock is not None and self._watcher is None:
            self._watcher = _Draining(self)
            if self._paused is None:
                self._acceptor.unwatch(sock.fileno())
                self._acceptor.watch(sock.fileno(), self._watcher)

    def stop_accepting(self) -> None:
        """Close, having taken what the queue holds: closing a listening socket resets the
        handshakes in its queue."""
        if self._sock is not None and self._paused is None:
            self._accept(self.settings.listen_backlog, defer=False, whole=True)
        self.close()

    async def finish(self, deadline: float) -> int:
        """Let its connections finish until ``deadline`` (loop time), then reset the rest
        (a RST says the rest is lost, a FIN would not); returns how many were reset."""
        await self.until_idle(deadline)
        tasks = []
        left = list(self._conns)
        for conn in left:
            if conn.task is not None and not conn.task.done():
                conn.task.cancel()
                tasks.append(conn.task)
            conn.reset()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        return len(left)


def _room_for_a_pair(sock: socket.socket) -> bool:
    """Whether an accept now would leave an fd for its dial: no dial waits for an fd, and
    the lowest free fd (probed with a dup: fds are allocated lowest first) is not the last
    one below the limit."""
    if FD_RESERVE.waiters:
        return False
    try:
        probe = os.dup(sock.fileno())
    except OSError:
        return False
    os.close(probe)
    return probe <= FD_RESERVE.limit - 2


class Drainable(Protocol):
    """What a stop drains: a listener of either protocol (or the control process's handle)."""

    def close(self) -> None: ...

    async def shutdown(self, timeout: float) -> int: ...


async def drain(listeners: Iterable[Drainable], timeout: float) -> int:
    """Stop one process's listeners under one deadline; returns the connections reset.

    Every TCP port goes on accepting while any connection of this process is open: the
    portal rules still lead here, and a node's pods have no other way to a service, so a
    port that closed first (or as soon as it alone had nothing open) refused new
    connections for the whole drain (up to ``--drain-timeout``) on a node with one
    long-lived connection to any service. They close together at the first moment none is
    open (what their queues hold then is taken and served first), or ``DRAIN_LAST_CALL`` of
    the timeout before the deadline (at most 1 s): what they accepted last gets that long to
    finish, so that steady short requests are not cut at the deadline, only long ones. UDP
    ports have no connections to wait for and serve until the TCP ones are done, so that a
    service's datagrams (DNS) are not dropped for the drain's length.
    """
    listeners = list(listeners)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last_call = deadline - min(timeout * DRAIN_LAST_CALL, 1.0)
    streams = [lst for lst in listeners if isinstance(lst, TcpListener)]
    datagrams = [lst for lst in listeners if isinstance(lst, UdpListener)]
    others = [lst for lst in listeners if not isinstance(lst, (TcpListener, UdpListener))]
    elsewhere = [asyncio.ensure_future(lst.shutdown(timeout)) for lst in others]
    for lst in streams:
        lst.keep_accepting()
    while loop.time() < last_call:
        busy = [lst for lst in streams if lst.busy]
        if not busy:
            break
        await asyncio.gather(*(lst.until_idle(last_call) for lst in busy))
    for lst in streams:
        lst.stop_accepting()
    reset = sum(await asyncio.gather(*(lst.finish(deadline) for lst in streams)))
    for datagram in datagrams:
        datagram.close()
    return reset + sum(await asyncio.gather(*elsewhere))
