"""UDP proxy ports: a flow per client address, each with its own socket to an endpoint.

The listener reads datagrams from one socket per service port (and traffic class). The
first datagram from a client address creates a flow: a socket connected to the endpoint
the balancer picked, so the endpoint's replies arrive on a socket that already identifies
the client. Replies leave through the listener socket, from the address the client sent
to: behind REDIRECT, conntrack only turns the reply's source back into the ClusterIP if it
comes from the address the request was delivered to. On a wildcard-bound socket that
address is part of the flow's key: one client address (say, a port reused by a new
client socket) sending to two of the node's addresses is two flows, each answering from
its own. The same holds for IPv6 (REDIRECT in
ip6tables or an ``ip6`` nft table delivers to an address of the incoming interface):
IPV6_RECVPKTINFO tells the destination, IPV6_PKTINFO sets the reply's source.

Why raw sockets in the loop's ``ReadPoller`` rather than ``DatagramProtocol``: to pick a
reply's source address on a wildcard-bound socket we need ``recvmsg``/``sendmsg`` with
IP_PKTINFO (IPV6_PKTINFO), which transports do not expose. The listener's socket and every
flow's are in that level-triggered epoll set: one ``epoll_ctl`` per flow, where a reader of
the loop's own cost eight system calls to add and remove (11,000-18,000 new flows/s became
19,000-21,000 on loopback). One readiness callback drains up to ``udp_batch`` datagrams into
the loop's one 64 KiB buffer and forwards each slice of it without a copy before it returns,
or fewer once a datagram that opened a flow ends the poller's pass (``READ_PASS_S``: a
burst of new clients waits in the socket, not in front of the worker's relays);
a specific bound address uses ``recvfrom_into``/``sendto`` (the kernel then answers from
that address by itself).

An endpoint that refuses a flow (ICMP port or host unreachable: the flow's socket reports
ECONNREFUSED, EHOSTUNREACH or ENETUNREACH) counts as a failed dial for passive ejection, as
a refused TCP connection does; its first reply on a flow counts as a dial that succeeded.
Connecting a UDP socket sends nothing, so neither can be told earlier. The flow goes, and
the client's next datagram picks an endpoint afresh.

Idle flows are found by a periodic sweep (every ``udp_timeout_s / 2``, only while flows
exist), not a timer per datagram: a datagram only stores ``loop.time()`` in its flow. A
flow whose client sent something the endpoint has not answered yet is kept at least
``REPLY_WAIT_S``: a DNS server that asks its upstream takes longer than the 250 ms idle
timeout (kube-proxy's), and its answer was lost with the flow (every answer slower than
~375 ms, measured). The flow table is a dict in order of last activity (a client's
datagram, or a batch of replies), so evicting "the least recently active" flow when the
table is full is ``next(iter(...))``; evictions are counted and said once a minute.

Each flow's socket is bound to a local port of this worker's own share of the ephemeral
range, taken in turn (``FlowPorts``), not left to the kernel. The kernel picks a random
free port, and picks a port again as soon as its flow closed: a reply the endpoint sent
late then reached the new flow that got that port for the same endpoint, and went to its
client, an answer to somebody else (12 of 3,000 clients, with replies after 600 ms). In
turn, a port comes back only after the whole share (at 1,000 new flows a second, 14 s
with two workers), and no worker takes a port another worker let go.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import random
import socket
import struct
from typing import Self

from uproxy.dataplane.balancer import Balancer
from uproxy.dataplane.poller import PASS_CLOCK, read_poller_for
from uproxy.dataplane.release import release_for
from uproxy.dataplane.settings import DataplaneSettings
from uproxy.dataplane.sockets import bind_udp
from uproxy.dataplane.stats import Stats
from uproxy.log import kv
from uproxy.model import Endpoint, ServicePortName, Traffic
from uproxy.portrange import ephemeral_ports

log = logging.getLogger("uproxy.dataplane.udp")

IP_PKTINFO = 8  # linux/in.h; not exported by Python's socket module
_ANC_SIZE = socket.CMSG_SPACE(32)  # room for in_pktinfo (12 B) or in6_pktinfo (20 B)
_WILDCARDS = ("0.0.0.0", "::", "")

# What a connected UDP socket reports when the endpoint's host answers with ICMP port or
# host unreachable: the endpoint is not there. (EMSGSIZE and the like say nothing of it.)
_REFUSED = frozenset((errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN))

# How long a flow waits for the endpoint's answer to its client's last datagram, at least
# (a slow DNS upstream); an answered flow goes after ``udp_timeout_s`` idle, as before.
REPLY_WAIT_S = 5.0
# Evictions for a full flow table are said at most this often per port (counted always).
EVICTION_LOG_S = 60.0
# Ports tried in turn for a flow before leaving the choice to the kernel (a crowded range).
FLOW_BIND_TRIES = 16
# A flow keeps a copy of its first datagram, up to this size, until the endpoint answers:
# refused (ICMP port or host unreachable, an endpoint gone or not listening yet), it goes to
# another endpoint at once, as a TCP dial is tried again, instead of being lost for the
# client's whole timeout (a resolver's 5 s). A query, a QUIC Initial or a handshake fits.
FIRST_KEPT_MAX = 2048
# Endpoints a first datagram is sent to after the first one refused it.
RESENDS = 2


class FlowPorts:
    """Local ports for flows' sockets: this worker's share of the ephemeral range (every
    ``count``-th port from the ``index``-th), each taken in turn from a random start."""

    def __init__(
        self,
        index: int = 0,
        count: int = 1,
        ports: range | list[int] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        chosen = ports if ports is not None else ephemeral_ports()
        self._ports = chosen[index::count]
        self._next = (rng or random.Random()).randrange(len(self._ports)) if self._ports else 0

    def bind(self, sock: socket.socket) -> None:
        """Bind ``sock`` to the next free port of the share; when ``FLOW_BIND_TRIES`` in a
        row are taken, leave it unbound (its connect then lets the kernel choose)."""
        ports = self._ports
        n = len(ports)
        host = "::" if sock.family == socket.AF_INET6 else "0.0.0.0"
        for _ in range(min(FLOW_BIND_TRIES, n)):
            port = ports[self._next]
            self._next = self._next + 1 if self._next + 1 < n else 0
            try:
                sock.bind((host, port))
                return
            except OSError as exc:
                if exc.errno not in (errno.EADDRINUSE, errno.EACCES):
                    raise


# This process's flow ports: a worker sets its share at start (``worker.main``).
FLOW_PORTS: FlowPorts | None = None


def flow_ports() -> FlowPorts:
    global FLOW_PORTS
    if FLOW_PORTS is None:
        FLOW_PORTS = FlowPorts()
    return FLOW_PORTS


# A flow's key: the client's address and port, and on a wildcard-bound listener the
# datagram's packet info as received (the address it was sent to, and the interface).
FlowKey = tuple[str, int] | tuple[str, int, bytes]
_Socket = socket.socket  # in ``UdpListener``, ``socket`` is its property


class UdpFlow:
    """One client address and its connected socket to the chosen endpoint."""

    __slots__ = (
        "answered",
        "client",
        "endpoint",
        "first",
        "held",
        "key",
        "last",
        "listener",
        "pktinfo",
        "replied",
        "sock",
        "tried",
    )

    def __init__(
        self,
        listener: UdpListener,
        key: FlowKey,
        endpoint: Endpoint,
        sock: socket.socket,
        pktinfo: list[tuple[int, int, bytes]] | None,
        now: float,
    ) -> None:
        self.listener = listener
        self.key = key
        self.client = (key[0], key[1])
        self.endpoint = endpoint
        self.sock = sock
        self.pktinfo = pktinfo
        self.last = now
        self.replied = float("-inf")  # the endpoint's last reply (``last``: any datagram)
        self.answered = False  # the endpoint has replied on this flow
        # The client's first datagram until the endpoint answers (``FIRST_KEPT_MAX``), and
        # the endpoints that refused it before this one (``UdpListener.flow_failed``).
        self.first: bytes | None = None
        self.tried: list[Endpoint] | None = None
        # The balancer counted ``endpoint`` (least-connections): released when the flow goes.
        self.held = listener.balancer.counting

    def readable(self) -> None:
        """Replies from the endpoint: to the client, from the address it sent to."""
        listener = self.listener
        lsock = listener.sock
        if lsock is None:
            return
        view = listener.poller.buffer
        sock = self.sock
        counter = listener.stats.bytes_to_client
        for i in range(listener.settings.udp_batch):
            try:
                n = sock.recv_into(view)
            except BlockingIOError:
                flows = listener.flows
                if i and flows.get(self.key) is self:
                    # Replies count as activity: the most recent flow, the last to evict.
                    del flows[self.key]
                    flows[self.key] = self
                return
            except OSError as exc:
                # ECONNREFUSED (ICMP port unreachable) and the like: forget the flow so the
                # client's next datagram picks an endpoint afresh.
                listener.flow_failed(self, exc)
                return
            if not self.answered:
                self.answered = True
                self.first = None
                listener.balancer.dial_ok(self.endpoint)
            self.last = self.replied = listener.loop.time()
            counter.value += n
            try:
                if self.pktinfo is None:
                    lsock.sendto(view[:n], self.client)
                else:
                    lsock.sendmsg([view[:n]], self.pktinfo, 0, self.client)
            except OSError:
                pass  # a full send buffer drops the reply, as the network would


def reply_pktinfo(ancdata: list[tuple[int, int, bytes]]) -> list[tuple[int, int, bytes]]:
    """Ancillary data that makes a reply leave from the request's destination address."""
    for level, kind, data in ancdata:
        if level == socket.IPPROTO_IP and kind == IP_PKTINFO and len(data) >= 12:
            # struct in_pktinfo {int ifindex; in_addr spec_dst; in_addr addr}: send from
            # addr (the request's destination) and let routing choose the interface.
            return [(level, kind, struct.pack("=i4s4s", 0, data[8:12], bytes(4)))]
        if level == socket.IPPROTO_IPV6 and kind == socket.IPV6_PKTINFO and len(data) >= 20:
            # struct in6_pktinfo {in6_addr addr; int ifindex}: send from addr; the interface
            # is routing's choice too, unless the address is link-local (only meaningful on
            # its own link).
            addr = data[:16]
            link_local = addr[0] == 0xFE and addr[1] & 0xC0 == 0x80
            return [(level, kind, addr + (data[16:20] if link_local else bytes(4)))]
    return []


class UdpListener:
    """One UDP proxy port of one service port and traffic class."""

    def __init__(
        self,
        *,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        name: ServicePortName,
        balancer: Balancer,
        traffic: Traffic,
        settings: DataplaneSettings,
        pktinfo_level: int | None,
        address: tuple[str, int],
    ) -> None:
        self.loop = loop
        self.sock: socket.socket | None = sock
        self.name = name
        self.balancer = balancer
        self.traffic = traffic
        self.settings = settings
        self.host, self.port = address
        self._family = sock.family
        self._pktinfo_level = pktinfo_level
        self.flows: dict[FlowKey, UdpFlow] = {}
        # The loop's set of readers (this socket and every flow's) and its datagram buffer.
        self.poller = read_poller_for(loop)
        self.poller.reserve(settings.udp_buffer)
        self._sweeper: asyncio.TimerHandle | None = None
        self.stats = Stats(name, traffic)  # bound at the first datagram
        self._flows_counted = 0  # this listener's share of the flows gauge
        self._starved = False  # a flow could not get a socket, and none has since
        self._evicted = 0  # flows evicted for a full table since the last line said so
        self._evictions_said = float("-inf")

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
        """Bind and start receiving; port 0 lets the OS choose. Raises OSError."""
        sock = bind_udp(host, port, receive_buffer=settings.udp_receive_buffer)
        try:
            return cls.serve(sock, name=name, balancer=balancer, traffic=traffic, settings=settings)
        except OSError:
            sock.close()
            raise

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
        """Start receiving on a socket bound elsewhere (a worker's share of a group, see
        ``sockets``); the listener owns it from now on. Raises OSError. ``loop``: the running
        loop, when the caller has it (see ``TcpListener.serve``)."""
        if loop is None:
            loop = asyncio.get_running_loop()
        sock.setblocking(False)
        pktinfo_level: int | None = None
        host, port = sock.getsockname()[:2]
        if host in _WILDCARDS:
            # Learn each datagram's destination address so the reply can leave from it.
            if sock.family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_RECVPKTINFO, 1)
                pktinfo_level = socket.IPPROTO_IPV6
            else:
                sock.setsockopt(socket.IPPROTO_IP, IP_PKTINFO, 1)
                pktinfo_level = socket.IPPROTO_IP
        self = cls(
            loop=loop,
            sock=sock,
            name=name,
            balancer=balancer,
            traffic=traffic,
            settings=settings,
            pktinfo_level=pktinfo_level,
            address=(host, port),
        )
        self.poller.watch(sock.fileno(), self)
        balancer.watch(self._endpoints_changed)
        return self

    def _endpoints_changed(self) -> None:
        """Drop the flows whose endpoint went from the EndpointSlices or stopped serving: the
        client's next datagram picks a current one, as kube-proxy deletes the conntrack
        entries of UDP endpoints that do not serve. Without it a client that keeps sending
        stays on a gone pod for good. A flow to an endpoint that still serves goes on, as
        kube-proxy's does, whatever this traffic class would pick now: a terminating pod
        finishes its sessions (QUIC, a game, a VPN), as a TCP connection to it does; they
        moved to another pod the moment it began terminating."""
        if not self.flows:
            return
        live = self.balancer.serving()
        gone = [f for f in self.flows.values() if (f.endpoint.ip, f.endpoint.port) not in live]
        if gone:
            self._drop_flows(gone)
            self._count_flows()

    @property
    def socket(self) -> socket.socket | None:
        """The bound socket (None once closed)."""
        return self.sock

    @property
    def active(self) -> int:
        """Live UDP flows."""
        return len(self.flows)

    def readable(self) -> None:
        """Datagrams from clients: each to its flow's endpoint (a new flow for a new client)."""
        sock = self.sock
        if sock is None:
            return
        poller = self.poller
        view = poller.buffer
        flows = self.flows
        pktinfo = self._pktinfo_level is not None
        stats = self.stats
        if not stats.bound:
            stats.bind()
        to_endpoint = stats.bytes_to_endpoint
        ancdata: list[tuple[int, int, bytes]] = []
        now = self.loop.time()
        for _ in range(self.settings.udp_batch):
            try:
                if pktinfo:
                    n, ancdata, _flags, addr = sock.recvmsg_into([view], _ANC_SIZE)
                else:
                    n, addr = sock.recvfrom_into(view)
            except BlockingIOError:
                break
            except OSError:
                continue
            # The socket asks for packet info alone: ancdata is that one message, if any.
            key: FlowKey = (addr[0], addr[1], ancdata[0][2]) if ancdata else (addr[0], addr[1])
            flow = flows.pop(key, None)
            opened = flow is None
            if flow is None:
                flow = self._new_flow(key, ancdata if pktinfo else None, now)
                if flow is None:
                    continue
                if n <= FIRST_KEPT_MAX:
                    flow.first = bytes(view[:n])  # until the endpoint answers
            flows[key] = flow  # re-insert: the dict stays in order of client activity
            flow.last = now
            to_endpoint.value += n
            try:
                flow.sock.send(view[:n])
            except BlockingIOError:
                pass  # dropped, as a full network queue would
            except OSError as exc:
                self.flow_failed(flow, exc)  # e.g. ECONNREFUSED from an earlier datagram
            if opened and PASS_CLOCK() >= poller.deadline:
                break  # the pass is over (``READ_PASS_S``): the rest wait in the socket
        self._count_flows()

    def _new_flow(
        self,
        key: FlowKey,
        ancdata: list[tuple[int, int, bytes]] | None,
        now: float,
    ) -> UdpFlow | None:
        client_ip = key[0]
        balancer = self.balancer
        ep = balancer.pick(client_ip, self.traffic)
        if ep is None:
            self.stats.refused.value += 1
            self.stats.no_endpoints.value += 1
            return None
        reply_anc = reply_pktinfo(ancdata) if ancdata is not None else None
        flow = self._open_flow(key, ep, reply_anc or None, now)
        if flow is None:
            balancer.release(ep)  # (a no-op unless the pick was counted)
        else:
            self.stats.ok.value += 1
        return flow

    def _open_flow(
        self,
        key: FlowKey,
        ep: Endpoint,
        reply_anc: list[tuple[int, int, bytes]] | None,
        now: float,
    ) -> UdpFlow | None:
        """A flow of ``key`` to ``ep``, its socket connected and watched, its replies sent
        with ``reply_anc``; None when that fails (counted, the datagram dropped)."""
        client_ip = key[0]
        flows = self.flows
        while len(flows) >= self.settings.udp_max_flows:
            self.drop_flow(next(iter(flows.values())))
            self._note_eviction(now)
        family = socket.AF_INET6 if ":" in ep.ip else socket.AF_INET
        try:
            # Non-blocking from the start: no ioctl(FIONBIO) per flow (a DNS query's flow).
            sock = socket.socket(family, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK)
        except OSError as exc:
            # Out of fds (or memory): drop this datagram, the client will retry. One line
            # per episode; the count goes on in uproxy_connections_total.
            self.stats.dial_failed.value += 1
            if not self._starved:
                self._starved = True
                log.warning(
                    "UDP flow not opened: out of resources",
                    extra=kv(
                        service=str(self.name), port=self.port, error=exc.strerror, flows=len(flows)
                    ),
                )
            return None
        if self._starved:
            self._starved = False
            log.info("UDP flows open again", extra=kv(service=str(self.name)))
        try:
            if self.settings.dial_mark:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, self.settings.dial_mark)
            (FLOW_PORTS or flow_ports()).bind(sock)
            sock.connect(ep.address)
        except OSError:
            sock.close()
            self.stats.dial_failed.value += 1
            self.balancer.dial_failed(client_ip, ep)
            return None
        flow = UdpFlow(self, key, ep, sock, reply_anc, now)
        try:
            self.poller.watch(sock.fileno(), flow)
        except OSError:  # ENOMEM, ENOSPC (fs.epoll.max_user_watches): as a failed dial
            sock.close()
            self.stats.dial_failed.value += 1
            return None
        if self._sweeper is None:
            self._sweeper = self.loop.call_later(self._sweep_interval(), self._sweep)
        return flow

    def _sweep_interval(self) -> float:
        return max(self.settings.udp_timeout_s / 2, 0.01)

    def _note_eviction(self, now: float) -> None:
        self.stats.evicted.value += 1
        self._evicted += 1
        if now - self._evictions_said >= EVICTION_LOG_S:
            log.warning(
                "UDP flows evicted: the flow table is full (--udp-max-flows)",
                extra=kv(
                    service=str(self.name),
                    port=self.port,
                    max_flows=self.settings.udp_max_flows,
                    evicted=self._evicted,
                ),
            )
            self._evictions_said = now
            self._evicted = 0

    def _sweep(self) -> None:
        self._sweeper = None
        now = self.loop.time()
        idle = now - self.settings.udp_timeout_s
        waiting = now - max(self.settings.udp_timeout_s, REPLY_WAIT_S)
        # Idle, and not waiting for an answer to the client's last datagram (sent after the
        # last reply) for less than REPLY_WAIT_S.
        self._drop_flows(
            [
                f
                for f in self.flows.values()
                if f.last <= idle and (f.replied >= f.last or f.last <= waiting)
            ]
        )
        self._count_flows()
        if self.flows and self.sock is not None:
            self._sweeper = self.loop.call_later(self._sweep_interval(), self._sweep)

    def _count_flows(self) -> None:
        """Add this listener's change to the service port's gauge: a UDP service port has a
        listener per traffic class and IP family, all counted in the one series."""
        n = len(self.flows)
        if n != self._flows_counted:
            self.stats.live.value += n - self._flows_counted
            self._flows_counted = n

    def flow_failed(self, flow: UdpFlow, exc: OSError) -> None:
        """The flow's socket reported an error: it goes; a refusal counts against its
        endpoint (passive ejection, and the client's affinity to it), and a first datagram
        the endpoint never answered goes to another one."""
        self.drop_flow(flow)
        if exc.errno in _REFUSED:
            self.balancer.dial_failed(flow.client[0], flow.endpoint)
            if flow.first is not None and not flow.answered and self.sock is not None:
                self._send_elsewhere(flow, flow.first)

    def _send_elsewhere(self, flow: UdpFlow, first: bytes) -> None:
        """The client's first datagram, which ``flow``'s endpoint refused, to an endpoint
        not tried yet, on a flow of the same client (up to ``RESENDS`` times)."""
        tried = [*(flow.tried or ()), flow.endpoint]
        if len(tried) > RESENDS:
            return
        balancer = self.balancer
        ep = balancer.pick(flow.client[0], self.traffic, exclude=tried)
        if ep is None:
            return  # every endpoint refused it: the client's retry picks afresh
        again = self._open_flow(flow.key, ep, flow.pktinfo, self.loop.time())
        if again is None:
            balancer.release(ep)
            return
        again.first, again.tried = first, tried
        self.flows[flow.key] = again
        self._count_flows()
        try:
            again.sock.send(first)
        except OSError:
            pass  # dropped, as a full network queue would

    def drop_flow(self, flow: UdpFlow) -> None:
        """``flow`` goes, and its socket is closed now."""
        self._forget_flow(flow).close()  # its only copy: closing it leaves the poller's set

    def _drop_flows(self, flows: list[UdpFlow]) -> None:
        """``flows`` go from the table now (a client's next datagram opens a new flow), their
        sockets are closed over the loop's next passes (``release``): closing thousands in
        one pass held every relay of the loop for milliseconds."""
        release_for(self.loop).close_later([self._forget_flow(f) for f in flows])

    def _forget_flow(self, flow: UdpFlow) -> _Socket:
        """Out of the table and the poller, its endpoint released; its socket, the caller's
        to close."""
        if self.flows.get(flow.key) is flow:
            del self.flows[flow.key]
        if flow.held:
            flow.held = False
            self.balancer.release(flow.endpoint)
        self.poller.forget(flow.sock.fileno())
        return flow.sock

    def retire(self, idle_s: float) -> None:
        """Replaced by another socket of this port: as ``close``. (A UDP port changes how
        it steers in place, without new sockets, so this is only for symmetry.)"""
        self.close()

    def close(self) -> None:
        """Stop receiving and drop every flow (replies could no longer reach clients)."""
        sock = self.sock
        if sock is None:
            return
        self.sock = None
        self.balancer.unwatch(self._endpoints_changed)
        self.poller.unwatch(sock.fileno())
        sock.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        self._drop_flows(list(self.flows.values()))
        self._count_flows()

    async def shutdown(self, timeout: float) -> int:
        """Close at once: UDP has no connections to drain (``timeout`` is for symmetry)."""
        self.close()
        return 0
