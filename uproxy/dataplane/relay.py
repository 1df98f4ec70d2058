"""A relayed TCP pair: the client's socket, the dial to an endpoint, and the bytes between.

The relay works on raw non-blocking sockets registered once, edge-triggered, in the loop's
``EdgePoller`` (see there why not the loop's own ``add_reader``), not on asyncio transports.
Bytes are read with ``recv_into`` into one buffer per loop and written on at once with
``send``; what the other socket does not take is copied aside and that side is no longer
read until it is written (bounded memory: one read per direction, ``high_water``). EOF is
passed on with ``shutdown(SHUT_WR)``, a reset with a RST. A half-closed pair stays open for
as long as its other direction goes on (a server may think for minutes after a request's
FIN), as in kube-proxy's userspace mode: a peer gone without a word is found by the
keep-alive probes, which run in either half-closed state. (A 60 s bound on an idle
half-closed pair ended a slow server's reply with a clean FIN, taken for a complete one.)
There is no task or future per connection: the dial (retries, deadlines, the dial mark) is a
chain of callbacks, and a task exists only while a dial waits for a free fd.

Why not transports (measured here, A/B interleaved in one session, medians; nginx behind the
proxy, ``wrk -c16 -H "Connection: close"``, proxy pinned to one core, load on the other; the
machine was shared, so figures move by about +-10 % between runs):

* System calls per proxied connection (``strace -f -c``, 2,000 sequential connections):
  37.0 through uvloop's transports, 48.0 with the dial mark (connect_accepted_socket and
  create_connection(sock=) probe each socket with getsockname x3, getpeername x2, FIONBIO,
  SO_ERROR and re-register it with epoll), against 23.0 and 24.1 here: accept, the wrap's
  getsockname, TCP_NODELAY (since then inherited from the listener: one less), one epoll
  registration per socket, socket/[SO_MARK]/connect, 3 reads, 2 writes, one shutdown,
  2 closes, and the polls.
* Proxy CPU per connection: 129 us (128-131) through transports, 140 (137-143) with the
  mark; 94 (91-100) and 93 (91-100) here, 6 runs each. User time went from 41 to 21 us,
  system time from 96 to 83 us. A relay on raw sockets driven by the loop's
  ``add_reader``/``add_writer`` made 45 system calls and cost 126 us (5 runs).
* What makes the count low: no EAGAIN read where a short read already says the queue is
  empty, and no read for an EOF whose FIN the event announced (EPOLLRDHUP); the accepted
  socket stays blocking and is read with MSG_DONTWAIT (no FIONBIO); a connect is complete
  when its socket reports "writable" without an error (no SO_ERROR); the last direction to
  finish closes both sockets without a shutdown first (close sends that FIN).
* A FIN that came with the last bytes leaves with them: once a direction's FIN is in, what
  is left of it is sent with MSG_MORE, and the shutdown (or close) that follows in the same
  pass puts the FIN on that segment (as HAProxy does). An HTTP server's reply to
  ``Connection: close`` is then one segment to the client, not two; on loopback each
  segment the proxy sends is processed to the end (the peer's receive, its ACK, its
  wake-up) on the proxy's own CPU. ``wrk -c16`` with ``Connection: close``, proxy pinned,
  4 alternating rounds of 4 s: 58.1 -> 51.7 us per connection (system time 41.1 -> 33.9),
  16,775 -> 18,622 connections/s. (Saving the handshake's ACK as well, with TCP_QUICKACK
  off for the dial, cost more than it saved once quick ACKs were turned back on after the
  first bytes; left on, it delays the first reply of a backend that writes it in two
  pieces under Nagle by a delayed ACK, 40 ms.)
* Client bytes that arrive while the dial is in flight stay in the kernel's socket buffer,
  read once the pair is linked: nothing to hold, and every retry still has them all.
* Kept from the transport relay's setup pass (py-spy profiles): dial deadlines are
  ``FixedDelayTimers`` (start+cancel 1.3 us against 3.4 us for call_later; since
  then 0.2 us, see there), a closed pair leaves no reference cycle (``_Side``), and
  nothing is logged or formatted per connection (metric tallies are bound once per
  listener, ``Stats``).

Bulk transfers: once a direction has moved ``splice_threshold`` bytes in reads of at least
16 KiB it switches to splice(2) through a pipe of its own (``splice``); the pipe is the
direction's buffer and is closed as soon as the direction is over, or once a wake-up brings
less than 16 KiB four times in a row (the bulk is over: small messages go back to the copy
path, two system calls each where splicing takes three). ``iperf3`` through the proxy, 1
stream (proxy CPU per GB moved, medians of 5): 0.39 through transports, 0.39 on the copy
path here, 0.20-0.23 spliced (1 MiB pipes; 0.25 with the default 64 KiB pipe, 0.23 with
256 KiB). Throughput was bound by the other core (iperf3 and the kernel's loopback work),
not by the proxy, and the machine was shared: 12-16 Gb/s spliced or not, against 23-24
Gb/s for kernel DNAT.
Since then a spliced source's input events are off while its pipe is held (``splice``):
0.237 -> 0.227 and 0.281 -> 0.259 s/GB in two sessions (pinned, interleaved, medians).
Threshold: proxy CPU per ``Connection: close`` download (copy / spliced from the first
byte): 16 KiB 107 / 130 us (a pipe costs ~12 us: pipe2, F_SETPIPE_SZ, FIONBIO, 2 closes),
64 KiB 142 / 139, 128 KiB 191 / 163, 512 KiB 421 / 280, 1 MiB 693 / 509, 4 MiB 2432 / 968.
Splicing pays from about 64 KiB; thresholds of 64, 128 and 256 KiB were within the noise
of each other at 64-512 KiB, and 128 KiB opens no pipe for the many replies below it.
"""

from __future__ import annotations

import _socket
import asyncio
import contextlib
import errno
import fcntl
import os
import socket
import struct
import time
import types
from typing import Protocol

from uproxy.dataplane import series, splice
from uproxy.dataplane.balancer import Balancer
from uproxy.dataplane.fdreserve import FD_RESERVE, RESOURCE_ERRNOS
from uproxy.dataplane.poller import (
    ALL_EVENTS,
    ERR,
    HUP,
    IN,
    OUT,
    RDHUP,
    READ_EVENTS,
    EdgePoller,
)
from uproxy.dataplane.settings import DataplaneSettings
from uproxy.dataplane.sockets import keep_alive
from uproxy.dataplane.splice import SPLICE_FLAGS, Pipe
from uproxy.dataplane.stats import Stats
from uproxy.dataplane.timers import FixedDelayTimers, Timer
from uproxy.model import Endpoint, Traffic

_LINGER_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends a RST
_NOWAIT = socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL  # the accepted socket stays blocking
# A direction whose FIN has arrived sends what is left with MSG_MORE: our shutdown (or
# close) follows in the same pass, and the kernel puts the FIN on the last data segment
# instead of sending it alone (see the module docstring).
_LAST = _NOWAIT | socket.MSG_MORE
_LAST_SPLICE = SPLICE_FLAGS | os.SPLICE_F_MORE
# Read once per dial as module globals rather than attributes of ``socket``.
_AF_INET, _AF_INET6 = socket.AF_INET, socket.AF_INET6
_STREAM_NONBLOCK = socket.SOCK_STREAM | socket.SOCK_NONBLOCK
_IPPROTO_TCP, _TCP_NODELAY = socket.IPPROTO_TCP, socket.TCP_NODELAY
_TCP_ESTABLISHED = 1  # linux/tcp_states.h
# How a relayed socket's error reads in uproxy_connection_errors_total: the peer reset it
# (a RST; EPIPE is a write after one), nothing answered (keep-alive probes or retransmissions
# gave up: the peer is gone), or ICMP said the way is gone.
_ERROR_NAMES = {
    errno.ECONNRESET: "reset",
    errno.EPIPE: "reset",
    errno.ETIMEDOUT: "timeout",
    errno.EHOSTUNREACH: "unreachable",
    errno.ENETUNREACH: "unreachable",
    errno.EHOSTDOWN: "unreachable",
}
_NEVER = 1 << 62  # bytes to go before splicing, when it is off or was tried
# What a side that was reset still held is passed on before the reset (``deliver_then_reset``):
# at most this much (a receive queue's worth), while the reader takes some of it at least
# every this long, checked this often.
_SALVAGE_MAX = 8 << 20
_FLUSH_BEFORE_RESET_S = 1.0
_FLUSH_POLL_S = 0.005
_SIOCOUTQ = 0x5411  # TIOCOUTQ: bytes in a TCP socket's send queue, unsent or unacknowledged


def _unsent(sock: _socket.socket) -> int:
    """Bytes ``sock`` has not had acknowledged yet (0 when that cannot be read)."""
    try:
        raw = fcntl.ioctl(sock.fileno(), _SIOCOUTQ, b"\0\0\0\0")
    except OSError:
        return 0
    value: int = struct.unpack("i", raw)[0]
    return value


# A read (or a wake-up's first splice) of at least this much is a bulk transfer's: only
# those count toward ``splice_threshold``, and a spliced direction whose wake-up brings
# less goes back to copying. Small messages on a long keep-alive connection cost three
# splices each (in, out, and the EAGAIN that ends the wake-up: a short splice does not
# prove the queue empty, as a short read does) against a read and a write.
# On one kept-alive connection (``wrk -c1``, nginx behind, proxy on its own CPU, 11
# alternating 3 s runs), 7 % less proxy CPU per request (median 67.7 against 72.5 us) and
# 8 system calls per request instead of about 10.5; bulk (``iperf3``) CPU per GB unchanged.
_BULK_READ = 16 * 1024
# Wake-ups in a row whose first splice brings less than that before a direction copies
# again: one would do for small messages, but a bulk transfer that its reader keeps up with
# can bring a segment or two at a wake-up now and then, and each return to splicing costs
# a pipe and another threshold's worth of copying.
_SMALL_WAKES = 4
_INPUT = IN | RDHUP | HUP

_DIAL_OK = series.DIAL_ATTEMPTS.labels("ok")
_DIAL_FAILED = series.DIAL_ATTEMPTS.labels("failed")
_DIAL_DURATION = series.DIAL_DURATION
# The dial's duration is timed with this clock, not the loop's: uvloop's ``loop.time()`` is
# libuv's loop time, in whole milliseconds, and most dials (a loopback or same-node one takes
# 50-200 us) would read 0 or 1 ms in a histogram whose buckets start at 0.2 ms.
_CLOCK = time.perf_counter


class Origin(Protocol):
    """What a connection needs of the listener that accepted it (``tcp.TcpListener``)."""

    loop: asyncio.AbstractEventLoop
    poller: EdgePoller  # the loop's, its buffer at least ``settings.high_water``
    settings: DataplaneSettings
    stats: Stats
    balancer: Balancer
    traffic: Traffic
    # By dial timeout (``settings.dial_timeouts_s``); they call ``Connection.dial_expired``.
    dial_timers: dict[float, FixedDelayTimers[Connection]]

    def pause(self, reason: str) -> None:
        """Stop accepting for a while (no fd left for a dial)."""

    def released(self, conn: Connection) -> None:
        """``conn`` is closed: it is no longer the listener's."""


def reset_socket(sock: _socket.socket) -> None:
    """Close ``sock`` so that the peer gets a RST rather than a FIN."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    except OSError:
        pass
    sock.close()


def _own_copy(func: types.FunctionType) -> types.FunctionType:
    """``func`` with a code object of its own (see ``_Side``): same behaviour, own caches."""
    copy = types.FunctionType(
        func.__code__.replace(),
        func.__globals__,
        func.__name__,
        func.__defaults__,
        func.__closure__,
    )
    copy.__kwdefaults__ = func.__kwdefaults__
    copy.__qualname__ = func.__qualname__
    copy.__doc__ = func.__doc__
    copy.__annotations__ = func.__annotations__
    return copy


class _Side:
    """One socket of a relayed pair, and the direction that reads it: this side to ``peer``.

    Its socket is in the loop's ``EdgePoller``: an event says once that there is input (or
    room), so what was not used is remembered in ``readable`` and acted on later. Reading
    stops while ``out`` (copy path) or the pipe (splice path) holds bytes the peer has not
    taken; the peer's "writable" event flushes them and reading goes on. The kernel's
    socket buffers do the rest of the buffering, so a slow reader throttles its sender.

    The pair's state lives on the client side (``Connection``); ``_pair()`` finds it. The
    two sides forget each other when the pair finishes: a relayed pair leaves no reference
    cycle, so it is freed by reference counting (with cycles, every connection left six
    objects for the cyclic GC: 2.8 % of the proxy's CPU in the connection-rate profile).

    Each subclass runs its own copy of the methods defined here (``__init_subclass__``):
    CPython 3.11 and later specialize attribute reads and writes in caches that belong to
    the code object, for one type at a time, and a method shared by both sides (whose
    ``peer`` is the other type) sees the two in turn and misses them. With a copy of the
    code per subclass each is monomorphic: 106.8k -> 93.1k user-space instructions per
    relayed connection (callgrind, ``wrk`` with ``Connection: close``).
    """

    __slots__ = (
        "chunk",
        "counter",
        "done",
        "eof",
        "fd",
        "out",
        "peer",
        "pipe",
        "poller",
        "rdhup",
        "readable",
        "sock",
        "until_splice",
        "writes_watched",
    )

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        for name, attr in vars(_Side).items():
            if isinstance(attr, types.FunctionType) and name not in vars(cls):
                setattr(cls, name, _own_copy(attr))

    def _setup(self, poller: EdgePoller, counter: series.AnyTally, chunk: int) -> None:
        """What both sides start with (each subclass's ``__init__`` calls it first)."""
        self.poller = poller
        self.counter = counter
        self.chunk = chunk  # bytes per read (settings.high_water)
        self.sock: _socket.socket | None = None
        self.fd = -1
        self.peer: _Side | None = None
        self.readable = False  # input (data or FIN) may be waiting: the edge was seen
        self.rdhup = False  # the peer's FIN has arrived (after the data now queued)
        self.eof = False  # this direction has read everything
        self.done = False  # ... and passed it all on, FIN included
        self.out: memoryview | None = None  # read, not yet taken by the peer's socket
        self.pipe: Pipe | None = None
        self.until_splice = _NEVER
        self.writes_watched = False

    def _pair(self) -> Connection:
        raise NotImplementedError

    def _unlinked_event(self, mask: int) -> None:
        raise NotImplementedError

    def failed(self, side: _Side, err: int | None) -> None:
        """``side``'s socket failed with ``err`` (an errno; None: ask the socket): count it
        in ``uproxy_connection_errors_total``, then reset the pair (both sides)."""
        conn = self._pair()
        if err is None and side.sock is not None:
            try:
                err = side.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            except OSError as exc:
                err = exc.errno
        series.CONNECTION_ERRORS.labels(
            conn.listener.stats.service,
            "client" if side is conn else "endpoint",
            _ERROR_NAMES.get(err or 0, "other"),
        ).value += 1
        if err == errno.ECONNRESET and conn.deliver_then_reset(side):
            return
        conn.reset()

    def event(self, mask: int) -> None:
        peer = self.peer
        if peer is None:
            self._unlinked_event(mask)
            return
        if mask & ERR:
            self.failed(self, None)  # pass a reset on as a reset, even on a side not read
            return
        if mask & _INPUT and not self.eof:
            self.readable = True
            if mask & (RDHUP | HUP):
                self.rdhup = True
            if self.out is None and (self.pipe is None or not self.pipe.held):
                self.pump()
                if self.sock is None:
                    return
        if mask & OUT and (peer.out is not None or (peer.pipe is not None and peer.pipe.held)):
            peer.flush()

    def pump(self) -> None:
        """Copy from this socket to the peer's until one of them says EAGAIN, or EOF."""
        if self.pipe is not None:
            self.pump_spliced()
            return
        peer = self.peer
        sock = self.sock
        if peer is None or peer.sock is None or sock is None:
            return
        dst = peer.sock
        view = self.poller.buffer
        chunk = self.chunk
        flags = _LAST if self.rdhup else _NOWAIT  # the FIN is in: all that is left, then ours
        while True:
            if self.until_splice <= 0 and self._start_splice():
                self.pump_spliced()
                return
            try:
                n = sock.recv_into(view, chunk, _NOWAIT)
            except BlockingIOError:
                self.readable = False
                return
            except OSError as exc:
                self.failed(self, exc.errno)
                return
            if n == 0:
                break
            self.counter.value += n
            if n >= _BULK_READ:
                self.until_splice -= n
            try:
                sent = dst.send(view[:n], flags)
            except BlockingIOError:
                sent = 0
            except OSError as exc:
                self.failed(peer, exc.errno)
                return
            if sent < n:
                self.out = memoryview(bytes(view[sent:n]))
                peer.watch_writes()
                return
            if n < chunk:
                # A short read emptied the receive queue: more input will be a new edge. If
                # the FIN had arrived by the event, it came after all of that: EOF, without
                # a read to be told so (nginx's "pending eof").
                if not self.rdhup:
                    self.readable = False
                    return
                break
        # EOF, and all that was read has been sent (what the peer did not take returned
        # above): ``_end`` written out, a frame less at each of a connection's two EOFs.
        self.eof = True
        self.readable = False
        self._pass_fin()

    def pump_spliced(self) -> None:
        """Move from this socket to the peer's through the pipe until EAGAIN, or EOF."""
        pipe = self.pipe
        peer = self.peer
        if pipe is None or peer is None:
            return
        src, dst = self.fd, peer.fd
        out_flags = _LAST_SPLICE if self.rdhup else SPLICE_FLAGS
        first = True
        while True:
            try:
                n = os.splice(src, pipe.w, pipe.size, flags=SPLICE_FLAGS)
            except BlockingIOError:
                self.readable = False
                return
            except OSError as exc:
                self.failed(self, exc.errno)
                return
            if n == 0:
                self._end()
                return
            self.counter.value += n
            try:
                sent = os.splice(pipe.r, dst, n, flags=out_flags)
            except BlockingIOError:
                sent = 0
            except OSError as exc:
                self.failed(peer, exc.errno)
                return
            if sent < n:
                pipe.held = n - sent
                peer.watch_writes()
                self._mute(pipe, True)
                return
            if first:
                first = False
                if n >= _BULK_READ:
                    pipe.small_wakes = 0
                elif pipe.small_wakes < _SMALL_WAKES - 1:
                    pipe.small_wakes += 1
                else:
                    # The bulk is over (wake-ups bring little, and the pipe is empty): back
                    # to copying, until bulk reads add up to the threshold again.
                    self._stop_splice(pipe)
                    self.pump()
                    return

    def _stop_splice(self, pipe: Pipe) -> None:
        pipe.close()
        self.pipe = None
        threshold = self._pair().listener.settings.splice_threshold
        self.until_splice = _NEVER if threshold is None else threshold

    def _mute(self, pipe: Pipe, muted: bool) -> None:
        """Turn this socket's input events off while the pipe holds bytes, back on after.

        While the peer cannot take what the pipe holds, this side is not read; yet every
        segment that arrives meanwhile would wake the loop for nothing (most wakes of a
        bulk transfer held up by its reader). A FIN (RDHUP) and a reset are still reported.
        What arrived is read once the pipe is flushed (``readable`` is set here, so no
        event is needed for it).
        """
        if pipe.muted == muted or self.sock is None:
            return
        pipe.muted = muted
        events = ALL_EVENTS if self.writes_watched else READ_EVENTS
        if muted:
            events &= ~IN
            self.readable = True
        try:
            self.poller.modify(self.fd, events)
        except OSError:
            self._pair().reset()

    def _start_splice(self) -> bool:
        """Switch this direction to splice (once): False if no pipe could be had."""
        self.until_splice = _NEVER
        peer = self.peer
        if peer is None or peer.sock is None or self.sock is None:
            return False
        conn = self._pair()
        pipe = splice.open_pipe(conn.listener.settings.splice_pipe_size)
        if pipe is None:
            return False
        try:
            # splice(2) honours only the file's O_NONBLOCK on a socket. The accepted socket
            # was left blocking (the relay reads it with MSG_DONTWAIT): one ioctl, here.
            for sock in (self.sock, peer.sock):
                if sock.getblocking():
                    sock.setblocking(False)
        except OSError:
            pipe.close()
            return False
        self.pipe = pipe
        return True

    def watch_writes(self) -> None:
        """The peer filled this socket: ask for its "writable" event (added once, kept)."""
        if not self.writes_watched and self.sock is not None:
            self.writes_watched = True
            try:
                if self.pipe is not None and self.pipe.muted:
                    self.poller.modify(self.fd, ALL_EVENTS & ~IN)
                else:
                    self.poller.watch_writes(self.fd)
            except OSError:
                self._pair().reset()

    def flush(self) -> None:
        """This socket's peer has room: write what waits for it, then read on."""
        peer = self.peer
        if peer is None or peer.sock is None:
            return
        pipe = self.pipe
        try:
            if pipe is not None and pipe.held:
                flags = _LAST_SPLICE if self.rdhup else SPLICE_FLAGS
                pipe.held -= os.splice(pipe.r, peer.fd, pipe.held, flags=flags)
                if pipe.held:
                    return
                self._mute(pipe, False)
            elif self.out is not None:
                sent = peer.sock.send(self.out, _LAST if self.rdhup else _NOWAIT)
                if sent < len(self.out):
                    self.out = self.out[sent:]
                    return
                self.out = None
            else:
                return
        except BlockingIOError:
            return
        except OSError as exc:
            self.failed(peer, exc.errno)
            return
        # Nothing is held once the EOF is in (a direction reads its EOF only after all it
        # read has been written): what follows a flush is more reading, never the FIN.
        if self.readable:
            self.pump()

    def _end(self) -> None:
        """EOF from this spliced socket (its pipe is empty): pass the FIN on."""
        self.eof = True
        self.readable = False
        self._pass_fin()

    def _pass_fin(self) -> None:
        self.done = True
        if self.pipe is not None:
            self.pipe.close()  # this direction is over: give its fds back now
            self.pipe = None
        peer = self.peer
        conn = self._pair()
        if peer is None or peer.sock is None:
            return
        if peer.done:
            # Both directions are over: close() sends the last FIN, with no shutdown()
            # first (the receive queues are empty, so close does not turn into a RST).
            conn.finish()
            return
        try:
            peer.sock.shutdown(socket.SHUT_WR)
        except OSError as exc:
            self.failed(peer, exc.errno)
            return

    def flush_or_reset(self, before: int = -1) -> None:
        """After ``Connection.deliver_then_reset`` (on the side that was reset): write what
        it held to the other socket; once that socket has sent everything (its send queue
        is empty), or at the deadline, reset the pair. Polled every few ms: this is rare."""
        conn = self._pair()
        other = self.peer
        if conn.closed:
            return
        if other is None or other.sock is None:
            conn.reset()
            return
        out = self.out
        if out is not None:
            try:
                sent = other.sock.send(out, _NOWAIT)
            except BlockingIOError:
                sent = 0
            except OSError:
                conn.reset()
                return
            self.out = out[sent:] if sent < len(out) else None
        loop = asyncio.get_running_loop()
        left = _unsent(other.sock) + (len(self.out) if self.out is not None else 0)
        now = loop.time()
        if left == 0 or now >= conn.flushing:
            conn.reset()
            return
        if 0 <= left < before:
            conn.flushing = now + _FLUSH_BEFORE_RESET_S  # it moves: the reader gets its time
        loop.call_later(_FLUSH_POLL_S, self.flush_or_reset, left)

    def close(self, *, reset: bool = False) -> None:
        """Close this socket: with a FIN, or with a RST (``reset``)."""
        sock = self.sock
        if sock is None:
            return
        self.sock = None
        self.poller.forget(self.fd)
        if reset:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
            except OSError:
                pass
        sock.close()
        if self.pipe is not None:
            self.pipe.close()
            self.pipe = None


class _EndpointSide(_Side):
    __slots__ = ("conn",)

    def __init__(self, conn: Connection, sock: _socket.socket) -> None:
        self._setup(conn.poller, conn.listener.stats.bytes_to_client, conn.chunk)
        self.conn = conn
        self.sock = sock
        self.fd = sock.fileno()
        self.writes_watched = True  # registered with ALL_EVENTS: a connect completes so
        threshold = conn.listener.settings.splice_threshold
        self.until_splice = _NEVER if threshold is None else threshold

    def _pair(self) -> Connection:
        return self.conn

    def _unlinked_event(self, mask: int) -> None:
        conn = self.conn
        if conn.dialing is not self:
            return
        if mask & (ERR | HUP):
            conn.dial_failed(None)
        elif mask & OUT:
            conn.link(self, mask)


class Connection(_Side):
    """The client side of a relayed pair, the dial to an endpoint, and the pair's state."""

    __slots__ = (
        "attempt",
        "client_ip",
        "closed",
        "deadline",
        "dialing",
        "endpoint",
        "fd_deadline",
        "flushing",
        "held",
        "linked",
        "listener",
        "started",
        "task",
        "tried",
        "undialed",
    )

    def __init__(self, listener: Origin, client_ip: str, endpoint: Endpoint) -> None:
        settings = listener.settings
        self._setup(listener.poller, listener.stats.bytes_to_endpoint, settings.high_water)
        threshold = settings.splice_threshold
        self.until_splice = _NEVER if threshold is None else threshold
        self.listener = listener
        self.client_ip = client_ip
        self.endpoint = endpoint
        # The balancer counted ``endpoint`` (least-connections): released when it is done.
        self.held = listener.balancer.counting
        self.closed = False
        self.linked = False
        self.dialing: _EndpointSide | None = None
        self.deadline: Timer | None = None
        self.task: asyncio.Task[None] | None = None  # only while a dial waits for an fd
        self.attempt = 0
        self.tried: list[Endpoint] | None = None
        self.fd_deadline: float | None = None  # until when a dial may wait for a free fd
        self.started = 0.0
        self.undialed = True
        self.flushing = 0.0  # while handing over the last bytes before a reset: until when
        FD_RESERVE.undialed += 1

    def _pair(self) -> Connection:
        return self

    def start(self, sock: _socket.socket) -> None:
        """Take the accepted socket and dial; the pair runs on events from here on."""
        self.sock = sock
        self.fd = fd = sock.fileno()
        try:
            # TCP_NODELAY comes from the listening socket (``sockets.bind_tcp``).
            # Watched from the start: a client that resets while we dial is seen at once.
            self.poller.register(fd, self, READ_EVENTS)
        except OSError:
            self.sock = None
            reset_socket(sock)
            self.finish()
            return
        self.dial()

    def _unlinked_event(self, mask: int) -> None:
        # The client, while we dial. Its bytes wait in its socket until the pair is linked;
        # a FIN is a half-close (the reply is still wanted), a reset ends it all.
        if mask & ERR:
            self.finish()
            return
        if mask & _INPUT:
            self.readable = True
            if mask & (RDHUP | HUP):
                self.rdhup = True

    def dial(self) -> None:
        """Start a non-blocking connect to ``endpoint``, under the attempt's deadline."""
        listener = self.listener
        settings = listener.settings
        if self.attempt >= len(settings.dial_timeouts_s):
            self._give_up()
            return
        ep = self.endpoint
        self.started = _CLOCK()
        try:
            sock = _socket.socket(_AF_INET6 if ":" in ep.ip else _AF_INET, _STREAM_NONBLOCK)
        except OSError as exc:
            self.dial_failed(exc.errno)
            return
        try:
            if settings.dial_mark:
                # Before connect: the NAT decision is taken on the first packet (the SYN).
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, settings.dial_mark)
            sock.setsockopt(_IPPROTO_TCP, _TCP_NODELAY, 1)
            err = sock.connect_ex((ep.ip, ep.port))
            if err and err != errno.EINPROGRESS:
                raise OSError(err, os.strerror(err))
            side = _EndpointSide(self, sock)
            self.poller.register(side.fd, side, ALL_EVENTS)
        except OSError as exc:
            sock.close()
            self.dial_failed(exc.errno)
            return
        self.dialing = side
        timeout = settings.dial_timeouts_s[self.attempt]
        self.deadline = listener.dial_timers[timeout].start(self)

    def dial_expired(self) -> None:
        """The attempt's deadline passed (the dial timers' action)."""
        self.deadline = None
        if self.linked:
            self._keep_alive_endpoint()
            return
        side = self.dialing
        if side is None or side.sock is None:
            return
        # uvloop runs due timers before the I/O of its last poll is handled: a connect that
        # completed in time may not have reached us yet. Its TCP state says; keep it then,
        # so a loop busier than the dial timeout does not throw away good connections.
        try:
            state = side.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
        except OSError:
            state = 0
        if state == _TCP_ESTABLISHED:
            self.link(side, OUT)
        else:
            self.dial_failed(None)

    def _cancel_deadline(self) -> None:
        if self.deadline is not None:
            self.deadline.clear()
            self.deadline = None

    def dial_failed(self, err: int | None) -> None:
        """One attempt failed (``err``: its errno when known): retry, wait for fds, or give up."""
        self._cancel_deadline()
        side = self.dialing
        if side is not None:
            self.dialing = None
            side.close()
        if err is not None and err in RESOURCE_ERRNOS:
            # No socket for it (out of fds): no attempt reached the endpoint, none is counted.
            if not self.closed:
                self._wait_for_fd(RESOURCE_ERRNOS[err])
            return
        _DIAL_FAILED.value += 1
        if self.closed:
            return
        listener = self.listener
        balancer = listener.balancer
        ep = self.endpoint
        self.attempt += 1
        balancer.dial_failed(self.client_ip, ep)
        if self.held:
            self.held = False
            balancer.release(ep)
        if self.tried is None:
            self.tried = []
        self.tried.append(ep)
        if self.attempt >= len(listener.settings.dial_timeouts_s):
            self._give_up()
            return
        nxt = balancer.pick(self.client_ip, listener.traffic, exclude=self.tried)
        if nxt is None:
            # Every endpoint was tried once: the next, longer attempt goes to any of them
            # again (a timeout under load is often not the endpoint's fault).
            nxt = balancer.pick(self.client_ip, listener.traffic)
        if nxt is None:
            self._give_up()
            return
        self.endpoint = nxt
        self.held = balancer.counting
        self.dial()

    def _give_up(self) -> None:
        self.listener.stats.dial_failed.value += 1
        self.reset()

    def _wait_for_fd(self, reason: str) -> None:
        # Out of fds: not the endpoint's fault, and another endpoint will not help. Stop
        # accepting (it would take the fds the dials wait for) and try the same endpoint
        # again once a pair has closed, for as long as the dials could take.
        listener = self.listener
        listener.pause(reason)
        if self.fd_deadline is None:
            self.fd_deadline = listener.loop.time() + sum(listener.settings.dial_timeouts_s)
        self.task = listener.loop.create_task(self._redial_when_freed(self.fd_deadline))

    async def _redial_when_freed(self, deadline: float) -> None:
        listener = self.listener
        freed = await FD_RESERVE.freed(listener.loop, deadline, listener.settings.accept_backoff_s)
        self.task = None
        if self.closed:
            return
        if freed:
            self.dial()
        else:
            self._give_up()

    def link(self, side: _EndpointSide, mask: int) -> None:
        """The dial succeeded: join the two sides and move what is waiting on either."""
        keepalive = self.listener.settings.tcp_keepalive_s
        if not keepalive:
            self._cancel_deadline()
        # Else the dial's deadline stays armed, and when it fires on a pair still open the
        # endpoint side gets keep-alive probes (``_keep_alive_endpoint``); a pair that ends
        # first cancels it in ``finish``, as it would have here. (Linked by the deadline
        # itself, the pair is already that old: see below.)
        self.dialing = None
        if self.undialed:  # the first dial is over: this pair no longer waits for an fd
            self.undialed = False
            FD_RESERVE.undialed -= 1
        side.peer = self
        self.peer = side
        self.linked = True
        listener = self.listener
        stats = listener.stats
        stats.ok.value += 1
        stats.live.value += 1
        _DIAL_OK.value += 1
        _DIAL_DURATION.observe(_CLOCK() - self.started)
        listener.balancer.dial_ok(self.endpoint)
        if mask & _INPUT:
            side.readable = True
            side.rdhup = bool(mask & (RDHUP | HUP))
        if self.readable:
            self.pump()
        if side.readable and not self.closed:
            side.pump()
        if keepalive and self.deadline is None and not self.closed:
            self._keep_alive_endpoint()

    def _keep_alive_endpoint(self) -> None:
        """Keep-alive probes on the endpoint's socket, as the client's has from its listener.

        Only once the pair has outlived its dial's deadline (0.25 s for a first dial): a
        short connection never pays the three system calls (2.4 us, a few per cent of a
        connection's CPU), and a long one is probed after at most that much more idleness.
        """
        peer = self.peer
        seconds = self.listener.settings.tcp_keepalive_s
        if peer is None or peer.sock is None or not seconds:
            return
        with contextlib.suppress(OSError):  # the socket died meanwhile: its event says so
            keep_alive(peer.sock, seconds)

    def deliver_then_reset(self, dead: _Side) -> bool:
        """``dead`` was reset by its peer: pass on what it still holds, then the reset.

        A reset says nothing of the bytes before it: its socket still holds what arrived
        first (a server that replies and closes with the request unread resets, and its
        client, reached directly, reads the whole reply before the reset). Those bytes are
        read now and written to the other socket, whose reset waits until they have left it
        (while its reader takes some every second): a RST at once would throw away both.
        Returns False when that cannot be done (the caller resets the pair at once).
        """
        other = self.peer if dead is self else self
        if other is None or other.sock is None or dead.sock is None or self.flushing:
            return False
        held = bytearray()
        if dead.out is not None:
            held += dead.out
        pipe = dead.pipe
        if pipe is not None and pipe.held:
            # Spliced bytes wait in the pipe (a direction holds them there or in ``out``,
            # never both): read back, they go first. Reset at once, a slow reader lost the
            # pipe's megabyte and its socket's queue, which a direct connection delivers.
            try:
                while pipe.held:
                    chunk = os.read(pipe.r, pipe.held)
                    if not chunk:
                        break
                    held += chunk
                    pipe.held -= len(chunk)
            except OSError:
                return False
        view = dead.poller.buffer
        while len(held) < _SALVAGE_MAX:
            try:
                n = dead.sock.recv_into(view, len(view), _NOWAIT)
            except OSError:
                break  # the reset itself, once the queue is empty (or nothing queued)
            if n == 0:
                break
            dead.counter.value += n
            held += view[:n]
        dead.close()  # no RST to send back: its peer reset it
        dead.out = memoryview(bytes(held)) if held else None
        # From here the timer below writes and watches: the other socket's events (input
        # for a side that is gone, room) would only start the usual relaying again.
        other.poller.forget(other.fd)
        self.flushing = asyncio.get_running_loop().time() + _FLUSH_BEFORE_RESET_S
        dead.flush_or_reset()
        return True

    def reset(self) -> None:
        """Close both sockets with a RST and finish: one side reset, or a dial gave up."""
        for side in (self, self.peer, self.dialing):
            if side is not None:
                side.close(reset=True)
        self.finish()

    def finish(self) -> None:
        """Release everything the pair holds (idempotent); a socket still open is closed
        with a FIN (``reset`` closes them with a RST first)."""
        # Written out rather than looped over tuples: this runs for every connection.
        if self.closed:
            return
        self.closed = True
        if self.undialed:
            self.undialed = False
            FD_RESERVE.undialed -= 1
        if self.deadline is not None:
            self.deadline.clear()
            self.deadline = None
        task = self.task
        if task is not None and not task.done():
            task.cancel()
        if self.sock is not None:
            self.close()
        peer = self.peer
        if peer is not None:
            if peer.sock is not None:
                peer.close()
            peer.peer = None  # no cycle left behind (see _Side)
            self.peer = None
        dialing = self.dialing
        if dialing is not None:
            if dialing.sock is not None:
                dialing.close()
            self.dialing = None
        listener = self.listener
        if self.linked:
            listener.stats.live.value -= 1
        if self.held:
            self.held = False
            listener.balancer.release(self.endpoint)
        listener.released(self)
        if FD_RESERVE.waiters:  # one attribute test per connection while nothing waits
            FD_RESERVE.released(listener.loop)
