"""A relayed TCP pair: the client's socket, the dial to an endpoint, and the bytes between.

The relay is two ``asyncio.Protocol`` objects with ``__slots__``; bytes go straight from
``data_received`` to the peer transport's ``write`` (uvloop tries the send inline), with no
task or future per chunk. Backpressure uses the transports' own write-buffer limits:
``pause_writing`` on one side pauses reading on the other, and a side paused that way is
peeked at now and then, so a reset on it is not missed.

Everything that needs the loop runs in one task per connection (wrap the accepted socket in
a transport, then dial with retries): the accept callback never waits for a dial. Dials use
numeric addresses only (uvloop resolves them without the resolver thread pool), and carry
the dial mark when there are portal rules to skip (``dial_marked``).

Connection-setup pass (py-spy profile of ``wrk -c16``, ``Connection: close``; A/B in one
session, proxy and load pinned to separate cores, medians of 6-8 interleaved runs; the
machine was shared, so figures move by +-10 % from run to run): together the changes
below took the proxy from ~200-240 to ~155-200 us of CPU per connection (about -18 %).

* Dial deadlines and the half-close linger are ``FixedDelayTimers`` (one loop timer per
  delay, a FIFO behind it) instead of ``asyncio.timeout``/``call_later``: start+cancel
  1.3 us against 3.4 us for uvloop's call_later+cancel; the ``asyncio.timeout`` context
  (7 % of the profile, with a getpid() per get_running_loop()) is gone.
* A closed pair leaves no reference cycle (``_Side``): six objects less per connection for
  the cyclic GC (1.4-2.8 % of the profile, 0 % after).
* Nothing is logged and no metric label is formatted per connection: label sets are bound
  once per listener (``Stats``), and counts are plain additions read at scrape time
  (``uproxy.metrics.Tally``; prometheus_client's locked ``inc()`` was 6 % of the profile).
* Tried and dropped: closing without ``write_eof()`` when the peer had already sent its FIN
  (one shutdown() less; no measurable difference, the FIN costs the same in close()).
"""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Self, cast

from uproxy import metrics
from uproxy.dataplane.fdreserve import FD_RESERVE, RESOURCE_ERRNOS, wake
from uproxy.dataplane.timers import Deadline, shared_timers
from uproxy.model import Endpoint, ServicePortName, Traffic

if TYPE_CHECKING:
    from uproxy.dataplane.tcp import TcpListener

_LINGER_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends a RST

_DIAL_OK = metrics.DIAL_ATTEMPTS.labels("ok")
_DIAL_FAILED = metrics.DIAL_ATTEMPTS.labels("failed")
_DIAL_DURATION = metrics.DIAL_DURATION


class Stats:
    """Metric tallies for one listener, bound once (``.labels()`` is a dict lookup)."""

    __slots__ = (
        "bytes_to_client",
        "bytes_to_endpoint",
        "dial_failed",
        "no_endpoints",
        "ok",
        "open",
        "refused",
    )

    def __init__(self, name: ServicePortName, traffic: Traffic) -> None:
        service = str(name)
        protocol = name.protocol.value
        self.ok = metrics.CONNECTIONS.labels(service, protocol, "ok")
        self.refused = metrics.CONNECTIONS.labels(service, protocol, "no_endpoints")
        self.dial_failed = metrics.CONNECTIONS.labels(service, protocol, "dial_failed")
        self.open = metrics.OPEN_CONNECTIONS.labels(service, protocol)
        self.bytes_to_endpoint = metrics.BYTES.labels(service, "to_endpoint")
        self.bytes_to_client = metrics.BYTES.labels(service, "to_client")
        self.no_endpoints = metrics.NO_ENDPOINTS.labels(service, traffic.value)


def reset_socket(sock: socket.socket) -> None:
    """Close ``sock`` so that the peer gets a RST rather than a FIN."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    except OSError:
        pass
    sock.close()


async def dial_marked(
    loop: asyncio.AbstractEventLoop,
    protocol_factory: Callable[[], asyncio.Protocol],
    ip: str,
    port: int,
    mark: int,
) -> None:
    """Connect to ``ip:port`` from a socket carrying ``mark`` (SO_MARK), then wrap it.

    The mark has to be on the socket before the SYN leaves (the NAT decision is taken on the
    first packet), and ``create_connection`` makes its own socket: so the socket and the
    non-blocking connect are ours, and the connected socket is handed to the loop. Raises
    OSError like ``create_connection`` (EMFILE included); a cancelled dial closes its socket.
    """
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, mark)
        sock.setblocking(False)
        err = sock.connect_ex((ip, port))
        if err == errno.EINPROGRESS:
            fd = sock.fileno()
            writable: asyncio.Future[None] = loop.create_future()
            loop.add_writer(fd, wake, writable)
            try:
                await writable
            finally:
                loop.remove_writer(fd)
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            raise OSError(err, os.strerror(err))
        await loop.create_connection(protocol_factory, sock=sock)
    except BaseException:
        sock.close()
        raise


_TCP_CLOSE = 7  # linux/tcp_states.h: where a reset leaves a socket


def _was_reset(transport: asyncio.Transport) -> bool:
    """Whether the peer reset this (paused, unread) socket: its TCP state is CLOSE."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    try:
        return bool(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] == _TCP_CLOSE)
    except OSError:
        return True


def _reset_transport(transport: asyncio.Transport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
        except OSError:
            pass
    transport.abort()


class _Side(asyncio.Protocol):
    """One socket of a relayed pair: what it reads is written to ``peer``.

    The pair's state lives on the client side (``Connection``); ``_pair()`` finds it. The
    client side answers itself rather than holding a reference to itself, and the two sides
    forget each other once both sockets are closed (``Connection.side_lost``): a relayed
    pair leaves no reference cycle, so it is freed by reference counting. With the cycles,
    every connection left six objects (the pair, its task, coroutine and context) for the
    cyclic GC: 2.8 % of the proxy's CPU in the connection-rate profile.
    """

    __slots__ = ("counter", "eof", "peer", "transport", "write_paused")

    def __init__(self, counter: metrics.AnyTally) -> None:
        self.counter = counter
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None
        self.eof = False
        self.write_paused = False

    def _self(self) -> Self:
        return self

    def _pair(self) -> Connection:
        raise NotImplementedError

    def data_received(self, data: bytes) -> None:
        self.counter.value += len(data)
        peer = self.peer
        if peer is not None and peer.transport is not None:
            peer.transport.write(data)
        else:
            self._pair().hold(data)

    def eof_received(self) -> bool:
        self.eof = True
        self._pair().side_eof(self)
        return True  # keep our write direction open: this is a half-close

    def pause_writing(self) -> None:
        # Our write buffer is above high_water: stop reading whoever fills it.
        self.write_paused = True
        peer = self.peer
        if peer is not None and peer.transport is not None:
            peer.transport.pause_reading()
            self._pair().watch_paused()

    def resume_writing(self) -> None:
        self.write_paused = False
        peer = self.peer
        if (
            peer is not None
            and peer.transport is not None
            and not peer.eof
            and not peer.transport.is_closing()
        ):
            peer.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self._pair().side_lost(self, exc)


class _EndpointSide(_Side):
    __slots__ = ("conn",)

    def __init__(self, conn: Connection, counter: metrics.AnyTally) -> None:
        super().__init__(counter)
        self.conn = conn

    def _pair(self) -> Connection:
        return self.conn

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not inherit from asyncio's classes: cast, do not isinstance.
        self.transport = cast(asyncio.Transport, transport)
        self.conn.linked(self)


class Connection(_Side):
    """The client side of a relayed pair, and the state of the pair."""

    __slots__ = (
        "client_ip",
        "closed",
        "deadline",
        "endpoint",
        "held",
        "held_bytes",
        "linger",
        "listener",
        "stall",
        "task",
        "timed_out",
        "undialed",
    )

    def __init__(self, listener: TcpListener, client_ip: str, endpoint: Endpoint) -> None:
        super().__init__(listener.stats.bytes_to_endpoint)
        self.listener = listener
        self.client_ip = client_ip
        self.endpoint = endpoint
        self.held: list[bytes] | None = []
        self.held_bytes = 0
        self.closed = False
        self.linger: Deadline | None = None
        self.stall: Deadline | None = None
        self.task: asyncio.Task[None] | None = None
        self.deadline: Deadline | None = None
        self.timed_out = False
        self.undialed = True
        FD_RESERVE.undialed += 1

    def _pair(self) -> Connection:
        return self

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        s = self.listener.settings
        self.transport = cast(asyncio.Transport, transport)
        self.transport.set_write_buffer_limits(s.high_water, s.low_water)

    def hold(self, data: bytes) -> None:
        """Keep what the client sends while the dial is in flight (bounded by high_water)."""
        held = self.held
        if held is None:  # the pair is gone; nothing will read this any more
            return
        held.append(data)
        self.held_bytes += len(data)
        if self.held_bytes > self.listener.settings.high_water and self.transport is not None:
            self.transport.pause_reading()

    def dialed(self) -> None:
        """The first dial is over (or will never happen): this pair no longer waits for an fd."""
        if self.undialed:
            self.undialed = False
            FD_RESERVE.undialed -= 1

    async def run(self, sock: socket.socket) -> None:
        try:
            await self._run(sock)
        finally:
            self.dialed()

    async def _run(self, sock: socket.socket) -> None:
        listener = self.listener
        loop = listener.loop
        try:
            await loop.connect_accepted_socket(self._self, sock)
        except OSError:
            reset_socket(sock)
            self.finish()
            return
        settings = listener.settings
        balancer = listener.balancer
        tried: list[Endpoint] = []
        ep: Endpoint | None = self.endpoint
        timeouts = settings.dial_timeouts_s
        mark = settings.dial_mark
        fd_deadline: float | None = None  # until when a dial may wait for a free fd
        attempt = 0
        while attempt < len(timeouts):
            if ep is None or self.closed:
                break
            timeout = timeouts[attempt]
            self.endpoint = ep
            side = _EndpointSide(self, listener.stats.bytes_to_client)
            started = loop.time()
            # A shared fixed-delay timer per attempt rather than ``asyncio.timeout``: the
            # context manager cost 7 % of the connection-rate profile (a Timeout object, two
            # get_running_loop() calls, each a getpid(), its reschedule/exit bookkeeping).
            self.deadline = listener.dial_timers[timeout].start(self._dial_timed_out)
            try:
                if mark:
                    await dial_marked(loop, side._self, ep.ip, ep.port, mark)
                else:
                    await loop.create_connection(side._self, ep.ip, ep.port)
            except asyncio.CancelledError:
                if not self.timed_out:  # cancelled from outside (client gone, shutdown)
                    self._cancel_deadline()
                    raise
                self.timed_out = False
                if self.task is not None:
                    self.task.uncancel()
                exc: OSError | None = None
            except OSError as error:
                self._cancel_deadline()
                exc = error
            else:
                _DIAL_OK.value += 1
                _DIAL_DURATION.observe(loop.time() - started)
                return
            if self.peer is not None:  # connected just as the timeout fired
                return
            _DIAL_FAILED.value += 1
            if exc is not None and exc.errno in RESOURCE_ERRNOS:
                # Out of fds: not the endpoint's fault, and another endpoint will not help.
                # Stop accepting (it would take the fds the dials wait for) and try the same
                # endpoint again once a pair has closed, for as long as the dials could take.
                listener.pause(RESOURCE_ERRNOS[exc.errno])
                if fd_deadline is None:
                    fd_deadline = loop.time() + sum(timeouts)
                if await FD_RESERVE.freed(loop, fd_deadline, settings.accept_backoff_s):
                    continue
                break
            attempt += 1
            balancer.dial_failed(self.client_ip, ep)
            tried.append(ep)
            ep = balancer.pick(self.client_ip, listener.traffic, exclude=tried)
            if ep is None:
                # Every endpoint was tried once: the next, longer attempt goes to any of
                # them again (a timeout under load is often not the endpoint's fault).
                ep = balancer.pick(self.client_ip, listener.traffic)
            continue
        if not self.closed:
            listener.stats.dial_failed.value += 1
            if self.transport is not None:
                _reset_transport(self.transport)

    def _dial_timed_out(self) -> None:
        # uvloop runs due timers before the callbacks queued by its last poll: a connect
        # that completed during that poll has its connection_made still waiting in the
        # ready queue. Decide behind it, so that a loop busier than the dial timeout does
        # not throw away connections that did complete in time.
        self.listener.loop.call_soon(self._dial_expired, self.deadline)

    def _dial_expired(self, deadline: Deadline | None) -> None:
        if deadline is not self.deadline:
            return  # linked or failed meanwhile (deadline cleared), or already a new attempt
        self.deadline = None
        if self.task is not None and not self.task.done():
            self.timed_out = True
            self.task.cancel()

    def _cancel_deadline(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def linked(self, side: _EndpointSide) -> None:
        """The dial succeeded: connect the two sides and flush what the client sent."""
        # Connected: a timeout firing before create_connection returns must not tear
        # down an established connection (a busy loop can take that long to resume us).
        self._cancel_deadline()
        transport = side.transport
        # timed_out: the deadline expired and the task's cancellation is on its way, yet the
        # connect completed (_dial_timed_out makes this rare, a loop may still order it so).
        # create_connection closes this transport when the cancellation arrives: link it now
        # and the client's bytes go into a closed socket. Give the connection up instead;
        # the next attempt still has everything the client sent.
        if self.closed or self.timed_out or transport is None or self.transport is None:
            if transport is not None:
                transport.close()
            return
        settings = self.listener.settings
        transport.set_write_buffer_limits(settings.high_water, settings.low_water)
        side.peer = self
        self.peer = side
        stats = self.listener.stats
        stats.ok.value += 1
        stats.open.value += 1
        held = self.held
        self.held = None
        if held:
            transport.write(b"".join(held) if len(held) > 1 else held[0])
        if self.held_bytes > settings.high_water and not side.write_paused and not self.eof:
            self.transport.resume_reading()
        if self.eof:
            self.side_eof(self)

    def side_eof(self, side: _Side) -> None:
        peer = side.peer
        if peer is None or peer.transport is None:
            return  # the client's EOF is passed on once the dial succeeds
        # Tried: when the peer has already sent its FIN, close() without write_eof() (close
        # sends the FIN too, one shutdown() syscall less). No difference measurable (6 runs,
        # c=16: 153.6 us/conn with, 158.5 without), so the plain half-close order stays.
        if peer.transport.can_write_eof():
            peer.transport.write_eof()
        if peer.eof:
            self.close_pair()
        elif self.linger is None:
            self.linger = self.listener.linger_timers.start(self.close_pair)

    def watch_paused(self) -> None:
        """One side's reading is paused: check it now and then for a reset.

        A paused socket is not read, so the loop never learns that its peer reset it: the
        pair, and the megabytes queued towards the other side, would stay until that other
        side drained them, possibly never. A peek at the TCP state (a getsockopt, no read)
        every ``paused_check_s`` finds the reset; a FIN is left alone (a half-close lets
        the queued bytes go on).
        """
        if self.stall is None and not self.closed:
            timers = shared_timers(self.listener.loop, self.listener.settings.paused_check_s)
            self.stall = timers.start(self._check_paused)

    def _check_paused(self) -> None:
        self.stall = None
        for side in (self, self.peer):
            # The side whose peer is write-paused is the one not being read.
            other = side.peer if side is not None else None
            if side is None or other is None or not other.write_paused:
                continue
            if side.transport is not None and _was_reset(side.transport):
                # Reset both: closing the other side gracefully would wait for its full
                # write buffer to drain, which is what cannot happen.
                for t in (side.transport, other.transport):
                    if t is not None:
                        _reset_transport(t)
                return
        if any(s is not None and s.write_paused for s in (self, self.peer)):
            self.watch_paused()

    def close_pair(self) -> None:
        for side in (self, self.peer):
            if side is not None and side.transport is not None:
                side.transport.close()

    def side_lost(self, side: _Side, exc: Exception | None) -> None:
        # uvloop raises on a write to a closed transport: make the peer see "no transport"
        # (its reads are then dropped) instead of checking is_closing() on every chunk.
        side.transport = None
        if side is not self and side is not self.peer:
            return  # a dial attempt that was given up on
        if self.closed:
            self._unlink()
            return
        other = side.peer if side is self else self
        if other is not None and other.transport is not None:
            if exc is not None:
                _reset_transport(other.transport)  # pass a reset on as a reset
            else:
                other.transport.close()
        if side is self and self.peer is None and self.task is not None:
            self.task.cancel()  # the client left while we were dialing
        self.finish()
        self._unlink()

    def _unlink(self) -> None:
        """Once both sockets are closed, drop the pair's links (see ``_Side``)."""
        peer = self.peer
        if self.transport is None and (peer is None or peer.transport is None):
            if peer is not None:
                peer.peer = None
            self.peer = None

    def finish(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.dialed()
        self.held = None
        if self.linger is not None:
            self.linger.cancel()
            self.linger = None
        if self.stall is not None:
            self.stall.cancel()
            self.stall = None
        self._cancel_deadline()
        if self.peer is not None:
            self.listener.stats.open.value -= 1
        self.listener.released(self)
        if FD_RESERVE.waiters:  # one attribute test per connection while nothing waits
            FD_RESERVE.released(self.listener.loop)
