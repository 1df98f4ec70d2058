"""What the control process and a data-plane worker say to each other, and the channel.

The control process owns everything that is not relaying (sources, tracker, syncer, rules,
health, metrics); a worker only accepts, dials and relays. Between them is one narrow
channel per worker, carrying the data-plane state as changes, in order:

    control -> worker   Configure       first: settings and how to choose endpoints; again
                                        once the proxy serves (its first sync is done)
                        SetEndpoints    a service port's spec and one family's endpoints (the
                                        balancer of that port and family), and this
                                        node's zone for the endpoints' topology hints
                        ChangeEndpoints a change of a big balancer's endpoints: those that
                                        came or changed, the addresses of those gone
                        CommitEndpoints serve a balancer built aside (``staged`` steps)
                        OpenListener    + its listening socket (SCM_RIGHTS): start serving it,
                                        instead of the one it served (a regrouped port)
                        CloseListener   stop accepting; established connections carry on
                        Forget          a service port (in one family) is gone: drop its balancer
    worker -> control   Ready           the worker runs
                        Applied         how many messages it has applied so far: whenever it
                                        has applied all it has received (the control
                                        process's ``uproxy_dataplane_pending_changes``)

Dual-stack: a service port has a balancer per IP family (each family's service addresses go
to that family's endpoints only) and listeners per family, so a worker keys its balancers by
(service port, family) and its listeners by (service port, traffic, family); a listener of
one family picks from the balancer of the same family.

A worker never parses Kubernetes objects, runs a subprocess or touches rules: everything it
knows arrives here. Counters go the other way through shared memory (``counters``), and a
worker is stopped by signals (SIGTERM drains, SIGKILL stops).

The channel is a SOCK_SEQPACKET socket pair: message boundaries are kept and listening
sockets ride along as ancillary data. Messages are batched (a sync of 10,000 new ports is
20,000 messages in 1,000 packets) and pickled: both ends are this same program, and a packet
never comes from anywhere else (the pair is created by the control process before the
worker starts).

A service port can have thousands of endpoints (a DaemonSet's pods on a big cluster): its
SetEndpoints is ~43 bytes an endpoint when each is on a node of its own, 215 kB at 5,000. A
datagram holds at most ``PACKET_BYTES`` (one larger than the socket's send buffer cannot be
sent at all: EMSGSIZE), and a worker decodes a packet whole, between two slices of its
relays (2.6 ms per 1,000 new endpoints). So the channel sends such a SetEndpoints as its first
endpoints in ``EndpointsAhead`` pieces, then the SetEndpoints with the rest, at most
``ENDPOINTS_PER_PACKET`` endpoints to a packet, and the receiving channel joins them before it
hands the SetEndpoints over. A packet still larger than a datagram (endpoints with long hint
lists) goes in ``Part``s, put together before any of its messages is read.

Such a port's endpoints mostly change a few at a time (a pod replaced, one turning ready), and
a worker's balancer took time linear in all of them for each SetEndpoints (4 ms at 5,000 and
20 ms at 20,000, one endpoint replaced). So from ``CHANGES_FROM`` endpoints on, a change that
keeps the port and zone goes as a ``ChangeEndpoints``, which the balancer applies in place
(``Balancer.change``) at a cost that follows the change. A bigger change of such a port, and
a new port of more than a packet's endpoints, go as steps of at most a packet's endpoints
(``endpoint_steps``): a worker applies each between two passes of its relays, where a whole
set held them 35 ms at 20,000 endpoints. A change of such a port's spec or of the node's zone
goes in steps too, to a balancer the worker builds aside (``staged``) while the one serving
goes on as it was; a ``CommitEndpoints`` puts the new one in its place, which costs what
the old one keeps (its failing endpoints, its affinity table), not its endpoints.
"""

from __future__ import annotations

import asyncio
import copyreg
import dataclasses
import errno
import logging
import operator
import os
import pickle
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from uproxy import priority
from uproxy.dataplane.settings import DataplaneSettings
from uproxy.model import (
    Endpoint,
    IPFamily,
    Protocol,
    ServicePort,
    ServicePortName,
    Traffic,
)
from uproxy.records import quick_init

log = logging.getLogger("uproxy.dataplane.messages")

# A packet: at most this many messages, and at most SCM_MAX_FD (253) sockets. A worker
# decodes a packet whole, between two messages of its slices: 50 endpoint updates took
# 0.15 ms, 20 take 0.06.
MESSAGES_PER_PACKET = 20
# Seconds of message handling before the receiving loop's other work (in a worker: the
# relays) runs again; the clock is read after every message (see ``Channel._pump``). Two or
# three new or closed listeners. Keep-alive p99 through a 10,000-port swap, 3 alternating
# runs (iptables-restore / nftables): 0.5 ms slices 2.03-2.13 / 1.69-2.24 ms, 0.25 ms
# 1.37-1.84 / 1.23-1.44 ms, 0.125 ms 0.88-1.12 / 0.84-2.24 ms; the workers' CPU and the
# swap's length did not change. A worker also ends a pass as soon as a relay has input
# (``busy``): a slice of cheap messages (closed listeners, forgotten balancers) held that
# input for the whole slice, on the way in and again on the way out. Then, 6 alternating
# pairs: 0.05 ms slices in packets of 20 read 0.29-0.52 / 0.31-0.44 ms (medians 0.35 /
# 0.35), 0.125 ms in packets of 50 read 0.41-0.77 / 0.37-0.51 ms (0.51 / 0.44), lower in 11
# of 12; each change alone did not stand out from the noise in 3 pairs. The price: a cold
# start of 10,000 services from a file 0.05 s slower on one CPU (2.77-2.84 s against
# 2.74-2.76), none seen from the API double (2.09-2.15 against 2.17-2.19).
APPLY_SLICE_S = 0.00005
# ... until the proxy serves (the control process's first sync is done): nothing relays yet,
# and whoever waits for this CPU is mostly the control process, busy with the same start, to
# which every short pass handed the CPU and back (``sched_yield``). A cold start of 10,000
# services from the API double, nftables, one CPU, 4 alternating pairs of 3 starts: medians
# 1.96-2.10 s against 2.05-2.18 with 0.05 ms slices throughout; from a services file the
# same (2.74-2.85 against 2.78-2.84).
APPLY_SLICE_STARTING_S = 0.0005
# A ChangeEndpoints of more endpoints than this is applied in parts of this many, one part
# a pass like a message of its own (``Channel._pump``): a step of 250 (``endpoint_steps``)
# held a worker's relays 1-1.7 ms, with topology hints 2-4 ms (every pool it follows takes
# each endpoint), where decoding its packet took 0.3-0.5 ms. A part is a change of its own
# (added and removed are disjoint), so between parts a balancer holds endpoints that the old
# set or the new one has, as between steps.
APPLY_PART = 64
# The most bytes a packet holds, whole or a part of a message too big for one (``Part``), and
# the receiver's buffer for one. A unix datagram must fit the sender's send buffer
# (net.core.wmem_default, 212,992 bytes unless changed); a message is ~100 bytes, a
# SetEndpoints ~43 bytes per endpoint.
PACKET_BYTES = 1 << 16
_PART_ENVELOPE = 512  # a Part's pickle around its bytes: its class and two opcodes
# Endpoints in one packet (SetEndpoints, EndpointsAhead and ChangeEndpoints together), and
# in one step of a big balancer's endpoints (``endpoint_steps``): a worker decodes a packet
# whole, 1.2-2.6 us an endpoint (0.3-0.65 ms for 250), then applies its messages one at a
# time (a big change in parts, ``APPLY_PART``) between passes of its relays.
# ``bench.big_service --change third`` (a third of 20,000 endpoints replaced each second,
# round trips every 1 ms, 2 runs each): p99.9 1.7-1.9 ms and at most 3.4-5.3 ms in steps of
# 250, 3.4-4.0 and 5.8-11.7 ms in steps of 500 in packets of 1,000, 6.5-11 and 17-24 ms for
# the whole set at once. With parts, 125 against 250, 6 alternating pairs of runs (hints,
# third, appear, affinity): p99.9 0.79-1.06 ms against 0.84-1.33, lower in 5 of them.
ENDPOINTS_PER_PACKET = 125
# A balancer of at least this many endpoints (before or after) is sent a change of them
# as a ChangeEndpoints when it touches at most a quarter of them (and fits a packet): below
# that, a whole SetEndpoints costs a worker under 0.1 ms.
CHANGES_FROM = 64


@dataclass(frozen=True, slots=True)
class Configure:
    settings: DataplaneSettings
    serving: bool = False  # the proxy serves: changes are applied in short slices


@quick_init
@dataclass(frozen=True, slots=True)
class SetEndpoints:
    name: ServicePortName
    family: IPFamily  # the balancer's: ``endpoints`` are all of this family
    port: ServicePort
    endpoints: tuple[Endpoint, ...]
    zone: str | None = None  # this node's, for topology hints (``model.topology``)
    # A new balancer built aside, to serve from the CommitEndpoints that follows; the one
    # serving goes on as it is meanwhile (a big balancer's new spec: ``endpoint_steps``).
    staged: bool = False


@quick_init
@dataclass(frozen=True, slots=True)
class ChangeEndpoints:
    """A balancer's endpoints changed, its port and zone did not: ``added`` are new or
    replace the endpoint at their address, ``removed`` are the addresses of those gone."""

    name: ServicePortName
    family: IPFamily
    added: tuple[Endpoint, ...]
    removed: tuple[tuple[str, int], ...]
    staged: bool = False  # a change of the balancer being built aside


@quick_init
@dataclass(frozen=True, slots=True)
class CommitEndpoints:
    """Serve the balancer built aside (``staged``) from now on, in place of the one serving
    (see ``Balancer.adopt``)."""

    name: ServicePortName
    family: IPFamily


# A change of a balancer's endpoints: those that came or changed, the addresses of those gone.
EndpointChange = tuple[tuple[Endpoint, ...], tuple[tuple[str, int], ...]]
# A change as its sender computed it: (the endpoints it was computed from, the change or None
# for a whole set).
ComputedChange = tuple[tuple[Endpoint, ...] | None, EndpointChange | None]


def change_limit(old: int, new: int) -> int | None:
    """How many endpoints (added and removed together) a change between sets of ``old``
    and ``new`` endpoints may carry, or None: small balancers take whole sets."""
    if max(old, new) < CHANGES_FROM:
        return None
    return min(max(old, new) // 4, ENDPOINTS_PER_PACKET)


def endpoint_changes(old: tuple[Endpoint, ...], new: tuple[Endpoint, ...]) -> EndpointChange | None:
    """What ``new`` adds to ``old`` (new or changed endpoints) and the addresses it removes,
    or None when a whole SetEndpoints is the better message: small balancers, changes of
    more than a quarter of the endpoints or more than a packet holds, an address twice.

    Linear in the endpoints, but an endpoint that did not change is mostly the same object
    in both (the tracker keeps each slice's), told apart by identity without a Python call.
    """
    limit = change_limit(len(old), len(new))
    return None if limit is None else _changes(old, new, limit)


def all_endpoint_changes(
    old: tuple[Endpoint, ...], new: tuple[Endpoint, ...]
) -> EndpointChange | None:
    """``endpoint_changes`` of any size (for ``endpoint_steps``); None for an address twice."""
    return _changes(old, new, len(old) + len(new))


def _changes(
    old: tuple[Endpoint, ...], new: tuple[Endpoint, ...], limit: int
) -> EndpointChange | None:
    before = {(ep.ip, ep.port): ep for ep in old}
    if len(before) != len(old):
        return None  # an address twice: each balancer keeps both, a change could not say so
    known = before.copy()  # ``before`` loses what ``new`` still has: what is left is gone
    pop = before.pop
    added: list[Endpoint] = []
    for ep in new:
        address = (ep.ip, ep.port)
        was = pop(address, None)
        if was is not ep and was != ep:  # new, or changed
            if was is None and address in known:
                return None  # an address twice in ``new``
            added.append(ep)
            if len(added) > limit:
                return None
    if len(added) + len(before) > limit:
        return None
    if len({(ep.ip, ep.port) for ep in added}) != len(added):
        return None  # a new address twice
    return tuple(added), tuple(before)


Step = SetEndpoints | ChangeEndpoints | CommitEndpoints


def endpoint_steps(message: SetEndpoints, previous: SetEndpoints | None) -> list[Step] | None:
    """``message``, a balancer's endpoints, as steps of at most ENDPOINTS_PER_PACKET endpoints
    (added and removed together), or None when one message is the answer: a set that small,
    an address twice.

    ``previous``: what the balancer was given last (None: it is new). A new balancer gets a
    SetEndpoints of the first endpoints, then ChangeEndpoints adding the rest; a known one
    ChangeEndpoints, each taking an even share of the removals and additions, so that no
    step leaves it much smaller (or bigger) than both. A worker applies each between two
    passes of its relays, where a whole set held them for as long as it took: 35 ms at
    20,000 endpoints. Meanwhile a picked endpoint is one the old or the new set has. A known
    balancer whose port or zone changed gets a new balancer's steps, ``staged``: the worker
    builds it aside while the old one serves as it was, and a CommitEndpoints swaps them.
    """
    endpoints = message.endpoints
    if previous is None or previous.port != message.port or previous.zone != message.zone:
        staged = previous is not None
        if len(endpoints) <= ENDPOINTS_PER_PACKET:
            return None
        if len({(ep.ip, ep.port) for ep in endpoints}) != len(endpoints):
            return None  # an address twice: only a whole set keeps both
        first = dataclasses.replace(
            message, endpoints=endpoints[:ENDPOINTS_PER_PACKET], staged=staged
        )
        rest = endpoints[ENDPOINTS_PER_PACKET:]
        steps: list[Step] = [first]
        for at in range(0, len(rest), ENDPOINTS_PER_PACKET):
            added = rest[at : at + ENDPOINTS_PER_PACKET]
            steps.append(ChangeEndpoints(message.name, message.family, added, (), staged))
        if staged:
            steps.append(CommitEndpoints(message.name, message.family))
        return steps
    if max(len(previous.endpoints), len(endpoints)) <= ENDPOINTS_PER_PACKET:
        return None
    change = all_endpoint_changes(previous.endpoints, endpoints)
    if change is None:
        return None
    added, removed = change
    count = -(-(len(added) + len(removed)) // ENDPOINTS_PER_PACKET)  # 0: no change
    return [
        ChangeEndpoints(
            message.name,
            message.family,
            added[len(added) * i // count : len(added) * (i + 1) // count],
            removed[len(removed) * i // count : len(removed) * (i + 1) // count],
        )
        for i in range(count)
    ]


@quick_init
@dataclass(frozen=True, slots=True)
class OpenListener:
    """Serve the socket that comes with this message (one per OpenListener, in order).

    A worker that serves the listener already (ClientIP affinity turned on or off regroups a
    TCP port, see ``workers``) serves the new socket instead of the old one. ``old_leaves``:
    the old socket is leaving the port's group and gets no new connections, so the worker
    goes on accepting the handshakes still under way there until none has come for
    ``RETIRE_IDLE_S``, then closes it (closing a listening socket resets what it has
    queued). Otherwise another worker goes on serving the old socket: this one drops its
    copy at once."""

    name: ServicePortName
    traffic: Traffic
    family: IPFamily  # of the socket (its type follows from the protocol) and its balancer
    old_leaves: bool = False


# How long a socket that left its group's choice must have been idle before its worker
# closes it: a handshake under way when the group stopped choosing it completes within a
# round trip, or after a lost SYN-ACK is sent again (1 s, then 3 s).
RETIRE_IDLE_S = 2.0


@quick_init
@dataclass(frozen=True, slots=True)
class CloseListener:
    name: ServicePortName
    traffic: Traffic
    family: IPFamily


@quick_init
@dataclass(frozen=True, slots=True)
class Forget:
    name: ServicePortName
    family: IPFamily


@quick_init
@dataclass(frozen=True, slots=True)
class EndpointsAhead:
    """The first endpoints of this balancer's next SetEndpoints, which has too many for one
    packet (``ENDPOINTS_PER_PACKET``). Not a message: the channel that receives it joins
    the pieces to that SetEndpoints, in order, before it hands it over."""

    name: ServicePortName
    family: IPFamily
    endpoints: tuple[Endpoint, ...]


@quick_init
@dataclass(frozen=True, slots=True)
class Part:
    """A piece of a packet too big for one datagram: the pieces follow each other with
    nothing in between, and the last one (which carries the packet's sockets) completes it.
    Not a message: the channel puts the pieces together before it hands anything over."""

    data: bytes
    last: bool


@dataclass(frozen=True, slots=True)
class Ready:
    pid: int


@dataclass(frozen=True, slots=True)
class Applied:
    count: int  # messages received and applied since the worker started


@dataclass(frozen=True, slots=True)
class Ping:
    """Nothing to do: the control process's watchdog sends one a second, and a worker whose
    Applied count stops moving with messages pending is stuck (``workers``)."""


Message = (
    Configure
    | SetEndpoints
    | ChangeEndpoints
    | CommitEndpoints
    | OpenListener
    | CloseListener
    | Forget
    | Ready
    | Applied
    | Ping
)
_Sent = Message | EndpointsAhead  # what a packet holds


def _endpoint_count(message: _Sent) -> int:
    kind = type(message)
    if kind is SetEndpoints or kind is EndpointsAhead:
        return len(message.endpoints)  # type: ignore[union-attr]
    if kind is ChangeEndpoints:
        return len(message.added) + len(message.removed)  # type: ignore[union-attr]
    return 0


def _fast_pickling(*classes: type) -> None:
    """Pickle frozen, slotted dataclasses by their fields in order, without ``fields()``.

    The dataclasses' own pickling looks their fields up for every object: a fifth of a
    worker's start at 10,000 service ports went there. A reducer per class that reads the
    fields with one ``attrgetter`` call builds the same object on the other side.
    """
    for cls in classes:
        copyreg.pickle(cls, _reducer(cls))


def _reducer(cls: type) -> Callable[[Any], tuple[type, tuple[Any, ...]]]:
    names = [f.name for f in dataclasses.fields(cls)]
    getter = operator.attrgetter(*names)
    if len(names) == 1:
        return lambda obj: (cls, (getter(obj),))
    return lambda obj: (cls, getter(obj))


_fast_pickling(
    ServicePortName,
    ServicePort,
    Endpoint,
    Configure,
    SetEndpoints,
    ChangeEndpoints,
    CommitEndpoints,
    OpenListener,
    CloseListener,
    Forget,
    EndpointsAhead,
    Part,
    Ready,
    Applied,
)


def _first_part(message: ChangeEndpoints) -> tuple[ChangeEndpoints, ChangeEndpoints]:
    """``APPLY_PART`` endpoints of ``message``, removals and additions in the proportion it
    has them, and the rest of it."""
    added, removed = message.added, message.removed
    cut = len(removed) * APPLY_PART // (len(added) + len(removed))
    take = APPLY_PART - cut
    name, family, staged = message.name, message.family, message.staged
    return (
        ChangeEndpoints(name, family, added[:take], removed[:cut], staged),
        ChangeEndpoints(name, family, added[take:], removed[cut:], staged),
    )


class ChannelClosed(Exception):
    """The other end is gone."""


class Channel:
    """One end of the socket pair: batched, ordered sends; received messages to a callback.

    Sends never block the loop: what the socket cannot take now waits in a queue, flushed
    when it is writable again. Each message is handed over in order; a listening socket sent
    with an OpenListener is closed on this side once it is on its way.
    """

    def __init__(
        self,
        sock: socket.socket,
        *,
        on_message: Callable[[Message, socket.socket | None], None],
        on_closed: Callable[[], None],
        on_applied: Callable[[int], None] | None = None,
        busy: Callable[[], bool] | None = None,
    ) -> None:
        """``on_applied(count)``: once every message received so far is handed over (after a
        pass that handed any), how many it has handed over in all (``on_message`` applies
        each before it returns). ``busy()``: whether the loop has other work waiting (in a
        worker: a relay's input); a pass of ``_pump`` then ends after the message at hand."""
        sock.setblocking(False)
        self._sock = sock
        self._on_message = on_message
        self._on_closed = on_closed
        self._loop = asyncio.get_running_loop()
        # With the descriptor of the socket it hands over, which the channel owns until sent,
        # or the socket a copy of which it hands over (``lend``).
        self._pending: deque[tuple[_Sent, int | socket.socket | None]] = deque()
        # Encoded packets not sent yet, with the descriptors they carry.
        self._outbox: deque[tuple[bytes, list[int]]] = deque()
        # What the send buffer takes in one datagram, at most PACKET_BYTES (what the other
        # end reads at once).
        self._packet_bytes = min(
            PACKET_BYTES, sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) - _PART_ENVELOPE
        )
        # The parts received so far of a packet that came in parts.
        self._parts: list[bytes] = []
        # Received, not yet handed over (with the fd of its socket, or -1); see ``_pump``.
        self._inbox: deque[tuple[_Sent, int]] = deque()
        # Endpoints received ahead of their SetEndpoints, by balancer (see EndpointsAhead).
        self._ahead: dict[tuple[ServicePortName, IPFamily], list[Endpoint]] = {}
        self._resume: asyncio.Handle | None = None
        self._busy = busy
        self._deferred = False  # the last pass applied nothing: ``busy`` when it began
        self._parting = False  # the last message handed over was a part (``APPLY_PART``)
        self._flush_soon = False
        self._writing = False
        self.closed = False
        self.sockets_missed = 0  # OpenListener sockets the kernel could not hand over
        self.sockets_not_lent = 0  # lent sockets sent without their copy (no fd for one)
        self.sent = 0  # messages queued for the other end, ever
        self.delivered = 0  # messages received and handed to on_message, ever
        self._on_applied = on_applied
        # How long one pass of ``_pump`` may apply messages (a worker sets it, ``Configure``).
        self.slice_s = APPLY_SLICE_S
        # Whether a pass ends early at ``busy()`` (a worker clears it until the proxy serves:
        # nothing relays yet, and the check is a system call after each message, 30,000 at
        # a start of 10,000 services).
        self.watch_busy = True
        self._loop.add_reader(sock.fileno(), self._readable)

    def send(self, message: Message, fd: int | None = None) -> None:
        """Queue a message, and the descriptor of a socket to hand over with it (the channel
        owns it from here and closes it once sent); sent on the next pass of the loop, in
        order. A raw descriptor, not a socket object: the control process sends one per
        listener, and ``socket.dup`` took 4.5 us per copy (a socket object, its family and
        type read back through enum conversions) where ``os.dup`` takes 1."""
        if self.closed:
            if fd is not None:
                os.close(fd)
            return
        if type(message) is SetEndpoints and len(message.endpoints) > ENDPOINTS_PER_PACKET:
            eps = message.endpoints
            rest = len(eps) - ENDPOINTS_PER_PACKET  # the SetEndpoints keeps the last ones
            for start in range(0, rest, ENDPOINTS_PER_PACKET):
                ahead = eps[start : min(start + ENDPOINTS_PER_PACKET, rest)]
                self._pending.append((EndpointsAhead(message.name, message.family, ahead), None))
            message = dataclasses.replace(message, endpoints=eps[rest:])
        self._pending.append((message, fd))
        self.sent += 1
        if not self._flush_soon and not self._writing:
            self._flush_soon = True
            self._loop.call_soon(self._flush)

    def lend(self, message: OpenListener, sock: socket.socket) -> None:
        """Queue an OpenListener with a copy of ``sock``, made only as its packet goes out.

        A new worker is sent every listener at once (``WorkerPool._replay``): copies made
        up front held one more fd each here until the worker had read them, and at 10,000
        proxy ports the control process ran out of fds (a limit of 20,000) and the
        replacement went without 1,786 of its sockets. Made as their packet goes out, the
        copies in hand are a packet's worth at most. A socket closed by then (its listener
        closed, a CloseListener follows) goes without a copy, as one that no fd is left for
        (``sockets_not_lent``): the worker skips an OpenListener that brings no socket."""
        if self.closed:
            return
        self._pending.append((message, sock))
        self.sent += 1
        if not self._flush_soon and not self._writing:
            self._flush_soon = True
            self._loop.call_soon(self._flush)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._loop.remove_reader(self._sock.fileno())
        if self._writing:
            self._loop.remove_writer(self._sock.fileno())
        for _, fd in self._pending:
            if type(fd) is int:  # a lent socket stays its lender's
                os.close(fd)
        self._pending.clear()
        for _, fds in self._outbox:
            for fd in fds:
                os.close(fd)
        self._outbox.clear()
        self._parts.clear()
        self._ahead.clear()
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        for _, unread in self._inbox:
            if unread >= 0:
                socket.close(unread)
        self._inbox.clear()
        self._sock.close()

    def _flush(self) -> None:
        self._flush_soon = False
        outbox = self._outbox
        while not self.closed:
            if not outbox:
                if not self._pending:
                    break
                priority.give_way()  # the sender is the control process: pickling 10,000s
                self._encode()
            data, fds = outbox[0]
            try:
                if fds:
                    socket.send_fds(self._sock, [data], fds)
                else:
                    self._sock.send(data)
            except BlockingIOError:
                if not self._writing:
                    self._writing = True
                    self._loop.add_writer(self._sock.fileno(), self._writable)
                return
            except OSError as exc:
                self._lost(exc)
                return
            outbox.popleft()
            for fd in fds:
                os.close(fd)  # the other end has its own copy now
        if self._writing:
            self._writing = False
            self._loop.remove_writer(self._sock.fileno())

    def _writable(self) -> None:
        self._flush()

    def _encode(self) -> None:
        """The next packet of pending messages (at most MESSAGES_PER_PACKET, and at most
        ENDPOINTS_PER_PACKET endpoints unless one message has more) into the outbox: whole
        when it fits ``_packet_bytes``, else in parts."""
        pending = self._pending
        first = pending.popleft()
        copied = self._copied(first)
        batch = [copied or self._not_copied(first)]
        endpoints = _endpoint_count(first[0])
        while copied is not None and pending and len(batch) < MESSAGES_PER_PACKET:
            endpoints += _endpoint_count(pending[0][0])
            if endpoints > ENDPOINTS_PER_PACKET:
                break
            item = self._copied(pending[0])
            if item is None:
                break  # first in the next packet, once this one's copies are closed
            pending.popleft()
            batch.append(item)
        data = pickle.dumps([m for m, _ in batch], protocol=pickle.HIGHEST_PROTOCOL)
        fds = [fd for _, fd in batch if fd is not None]
        if len(data) <= self._packet_bytes:
            self._outbox.append((data, fds))
            return
        step = self._packet_bytes - _PART_ENVELOPE
        for start in range(0, len(data), step):
            last = start + step >= len(data)
            part = pickle.dumps(Part(data[start : start + step], last), pickle.HIGHEST_PROTOCOL)
            self._outbox.append((part, fds if last else []))  # the sockets with the last part

    def _copied(
        self, item: tuple[_Sent, int | socket.socket | None]
    ) -> tuple[_Sent, int | None] | None:
        """``item`` with a copy of its lent socket (``lend``) in its place; None when no copy
        can be made now (no fd left, or the socket is closed)."""
        message, fd = item
        if not isinstance(fd, socket.socket):
            return message, fd
        try:
            return message, os.dup(fd.fileno())
        except OSError:
            return None

    def _not_copied(self, item: tuple[_Sent, int | socket.socket | None]) -> tuple[_Sent, None]:
        """A lent socket's message without its copy, in a packet of its own: the other end
        gives a packet's sockets to its OpenListeners in order, so one without its socket may
        not travel with another's."""
        message, sock = item
        if isinstance(sock, socket.socket) and sock.fileno() >= 0:  # open: no fd for a copy
            if not self.sockets_not_lent:
                log.error(
                    "Channel cannot copy a listening socket for the other end: the open-file "
                    "limit is reached (ulimit -n)",
                    extra={"kv": {"message": type(message).__name__}},
                )
            self.sockets_not_lent += 1
        return message, None

    def _readable(self) -> None:
        if self._resume is None:  # else a pump is due, and it reads once the inbox is empty
            self._pump()

    def _pump(self) -> None:
        """Apply received messages, one at a time, for at most ``slice_s`` and not past
        the message at hand once ``busy()``; what is left waits in the inbox for the next
        pass of the loop. Every other pass applies at least one message, busy or not.

        The clock is read after each message, not each packet: a packet of 50 new listeners
        took a worker 2-10 ms, and with the budget checked per packet a 10,000-port sync
        held its relays that long, again and again (keep-alive p99 10 ms through the sync).

        A pass that continues one cut short first yields the CPU (``sched_yield``): the
        scheduler sees a worker busy with a 10,000-port sync as one task that never sleeps
        and lets it run out its time slice while a woken client, backend or other worker
        waits on that CPU (2-4.5 ms, ``perf sched``); the yield lets them run first, and
        costs nothing when nobody waits. On a CPU saturated by others it costs a tick
        each time, so a yield that comes back late pauses them (``priority.offer_cpu``).
        """
        busy = self._busy if self.watch_busy else None
        if self._resume is not None:
            if not self._parting:  # between parts of one message: as if inside it
                priority.offer_cpu(time.perf_counter())
            if busy is not None and not self._deferred and busy():
                # The loop runs this pass before it collects the waiting input: wait one
                # more pass (once: a pass after that applies at least one message).
                self._deferred = True
                self._resume = self._loop.call_soon(self._pump)
                return
        self._resume = None
        self._deferred = False
        before = self.delivered
        deadline = time.perf_counter() + self.slice_s
        inbox = self._inbox
        try:
            while not self.closed:
                if not inbox and not self._receive():
                    break
                message = inbox[0][0]
                if (
                    type(message) is ChangeEndpoints
                    and len(message.added) + len(message.removed) > APPLY_PART
                ):
                    part, rest = _first_part(message)
                    inbox[0] = (rest, -1)
                    self._parting = True
                    self._on_message(part, None)  # counted as delivered with its last part
                else:
                    self._parting = False
                    self._deliver(*inbox.popleft())
                if time.perf_counter() >= deadline or (busy is not None and busy()):
                    break
        finally:
            if inbox and not self.closed:
                self._resume = self._loop.call_soon(self._pump)
            elif self._on_applied is not None and self.delivered != before:
                self._on_applied(self.delivered)

    def _receive(self) -> bool:
        """One packet's messages into the inbox (a packet in parts once its last part is
        in); False when there is none yet (or the channel is lost)."""
        while True:
            try:
                data, fds, flags, _ = socket.recv_fds(self._sock, PACKET_BYTES, 253)
            except BlockingIOError:
                return False
            except OSError as exc:
                self._lost(exc)
                return False
            if not data:
                self._lost(None)
                return False
            broken = None
            if flags & socket.MSG_TRUNC:
                broken = "channel packet truncated"
            else:
                packet = pickle.loads(data)
                if isinstance(packet, Part):
                    self._parts.append(packet.data)
                    if not packet.last:
                        if not fds:
                            continue
                        broken = "channel packet part with sockets"
                    else:
                        packet = pickle.loads(b"".join(self._parts))
                        self._parts.clear()
                elif self._parts:
                    broken = "channel packet inside another one's parts"
            if broken is not None:
                for fd in fds:
                    socket.close(fd)
                self._lost(OSError(errno.EPROTO, broken))
                return False
            break
        messages: list[_Sent] = packet
        if flags & socket.MSG_CTRUNC:
            # The kernel could not give us every socket (this process is at its open-file
            # limit) and closed the rest. The messages still hold: the listeners that came
            # without their socket are served by the other workers.
            self._sockets_lost(messages, fds)
        elif self.sockets_missed:
            log.warning(
                "Channel receives sockets again",
                extra={"kv": {"missed": self.sockets_missed}},
            )
            self.sockets_missed = 0
        sockets = iter(fds)
        for message in messages:
            fd = next(sockets, -1) if isinstance(message, OpenListener) else -1
            self._inbox.append((message, fd))
        return True

    def _sockets_lost(self, messages: list[_Sent], fds: list[int]) -> None:
        missed = sum(isinstance(m, OpenListener) for m in messages) - len(fds)
        if not self.sockets_missed:
            log.error(
                "Channel lost sockets: the open-file limit is reached (ulimit -n)",
                extra={"kv": {"received": len(fds), "lost": missed}},
            )
        self.sockets_missed += missed

    def _deliver(self, message: _Sent, fd: int) -> None:
        """Hand one message (and its socket: -1 when it has none, or it did not make it, see
        ``_sockets_lost``) to ``on_message``; endpoints sent ahead wait for their message."""
        if isinstance(message, EndpointsAhead):
            self._ahead.setdefault((message.name, message.family), []).extend(message.endpoints)
            return
        if type(message) is SetEndpoints and self._ahead:
            ahead = self._ahead.pop((message.name, message.family), None)
            if ahead is not None:
                ahead.extend(message.endpoints)
                message = dataclasses.replace(message, endpoints=tuple(ahead))
        sock = None
        if fd >= 0 and isinstance(message, OpenListener):
            # Family, type and protocol given: no getsockopt/getsockname to guess them.
            kind = (
                socket.SOCK_STREAM if message.name.protocol is Protocol.TCP else socket.SOCK_DGRAM
            )
            family = socket.AF_INET6 if message.family is IPFamily.V6 else socket.AF_INET
            sock = socket.socket(family, kind, 0, fileno=fd)
        self.delivered += 1
        self._on_message(message, sock)

    def _lost(self, exc: BaseException | None) -> None:
        if exc is not None and not self.closed:
            log.debug("Channel lost", extra={"kv": {"err": str(exc)}})
        self.close()
        self._on_closed()
