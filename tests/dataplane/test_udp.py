"""UDP relay through real sockets on loopback: flows, sizes, expiry, bounds, reply source."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import logging
import os
import random
import resource
import socket
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest

from tests.dataplane.conftest import (
    NODE,
    UDP_NAME,
    UdpListenerFactory,
    digest,
    make_balancer,
    open_fds,
    wait_until,
)
from uproxy import metrics
from uproxy.dataplane import udp as udp_module
from uproxy.dataplane.poller import read_poller_for
from uproxy.dataplane.release import CLOSE_CHUNK, release_for
from uproxy.dataplane.settings import DataplaneSettings
from uproxy.dataplane.udp import FlowPorts, UdpListener, reply_pktinfo
from uproxy.localnet import has_loopback6
from uproxy.model import Endpoint, LbAlgorithm, Protocol, ServicePort, ServicePortName, Traffic


class _UdpEcho(asyncio.DatagramProtocol):
    """Replies with its ident followed by the datagram."""

    def __init__(self, ident: bytes) -> None:
        self.ident = ident
        self.transport: asyncio.DatagramTransport | None = None
        self.received = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.received += 1
        if self.transport is not None:
            self.transport.sendto(self.ident + data, addr)


class _UdpSink:
    """Counts datagrams, draining its socket fully on every wake-up (keeps up with a burst)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.setblocking(False)
        self.received = 0
        self.loop = asyncio.get_running_loop()
        self.loop.add_reader(self.sock.fileno(), self._drain)

    def _drain(self) -> None:
        while True:
            try:
                self.sock.recv(70_000)
            except BlockingIOError:
                return
            self.received += 1

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint("127.0.0.1", self.sock.getsockname()[1], node_name=NODE)

    def close(self) -> None:
        if self.sock.fileno() >= 0:
            self.loop.remove_reader(self.sock.fileno())
            self.sock.close()


UdpBackendFactory = Callable[[str], Awaitable[tuple[Endpoint, _UdpEcho]]]


@pytest.fixture
async def udp_backends() -> AsyncIterator[UdpBackendFactory]:
    transports: list[asyncio.DatagramTransport] = []

    async def make(ident: str) -> tuple[Endpoint, _UdpEcho]:
        loop = asyncio.get_running_loop()
        transport, proto = await loop.create_datagram_endpoint(
            lambda: _UdpEcho(ident.encode()), local_addr=("127.0.0.1", 0)
        )
        transports.append(transport)
        port = transport.get_extra_info("sockname")[1]
        return Endpoint("127.0.0.1", port, node_name=NODE), proto

    yield make
    for t in transports:
        t.close()


def client_socket(*, connect_to: tuple[str, int] | None = None) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    s.setblocking(False)
    s.bind(("127.0.0.1", 0))
    if connect_to is not None:
        s.connect(connect_to)
    return s


async def exchange(sock: socket.socket, payload: bytes, to: tuple[str, int]) -> bytes:
    loop = asyncio.get_running_loop()
    sock.sendto(payload, to)
    deadline = loop.time() + 3
    while True:
        try:
            return sock.recv(70_000)
        except BlockingIOError:
            if loop.time() > deadline:
                raise AssertionError("no reply within 3 s") from None
            await asyncio.sleep(0.002)


async def test_request_response_and_flow_reuse(
    udp_backends: UdpBackendFactory, udp_listener: UdpListenerFactory
) -> None:
    (ep_a, _), (ep_b, _) = await udp_backends("a"), await udp_backends("b")
    listener = await udp_listener(
        make_balancer(UDP_NAME, [ep_a, ep_b], settings=DataplaneSettings(udp_timeout_s=5))
    )
    to = ("127.0.0.1", listener.port)
    with client_socket() as c1, client_socket() as c2:
        r1 = await exchange(c1, b"ping-1", to)
        r2 = await exchange(c2, b"ping-2", to)
        assert {r1[:1], r2[:1]} == {b"a", b"b"} and r1[1:] == b"ping-1" and r2[1:] == b"ping-2"
        for i in range(5):  # one flow per client: the same endpoint every time
            assert await exchange(c1, b"again%d" % i, to) == r1[:1] + b"again%d" % i
        assert listener.active == 2


async def test_a_60000_byte_datagram_arrives_whole(
    udp_backends: UdpBackendFactory, udp_listener: UdpListenerFactory
) -> None:
    ep, echo = await udp_backends("x")
    listener = await udp_listener(make_balancer(UDP_NAME, [ep], settings=DataplaneSettings()))
    payload = os.urandom(60_000)
    with client_socket() as c:
        c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
        reply = await exchange(c, payload, ("127.0.0.1", listener.port))
    assert digest(reply) == digest(b"x" + payload)
    assert echo.received == 1


async def _idling_out(
    udp_backends: UdpBackendFactory, udp_listener: UdpListenerFactory
) -> tuple[UdpListener, tuple[str, int]]:
    """A listener whose flows expire after 0.2 s idle, to an echo endpoint; its address."""
    ep, _ = await udp_backends("x")
    settings = DataplaneSettings(udp_timeout_s=0.2)
    listener = await udp_listener(
        make_balancer(UDP_NAME, [ep], settings=settings), settings=settings
    )
    return listener, ("127.0.0.1", listener.port)


async def test_flows_expire_after_the_idle_timeout(
    udp_backends: UdpBackendFactory, udp_listener: UdpListenerFactory
) -> None:
    listener, to = await _idling_out(udp_backends, udp_listener)
    fds = open_fds()
    with client_socket() as c:
        await exchange(c, b"1", to)
        assert listener.active == 1
        for _ in range(6):  # traffic every 0.1 s keeps the flow alive across timeouts
            await asyncio.sleep(0.1)
            await exchange(c, b"2", to)
            assert listener.active == 1
        started = time.monotonic()
        await wait_until(lambda: listener.active == 0, timeout=2, what="flow expiry")
        idle = time.monotonic() - started
    assert 0.1 <= idle <= 0.6, idle
    assert open_fds() <= fds  # the flow's socket was closed


async def test_interleaved_datagrams_of_two_listeners_arrive_intact_and_flows_leave_the_set(
    udp_backends: UdpBackendFactory, udp_listener: UdpListenerFactory
) -> None:
    """Every listener and flow of a loop reads into one buffer (the ReadPoller's): a slice
    forwarded after the buffer was reused would reach its endpoint or client corrupted.
    Sizes up to 9,000 bytes: 16 datagrams of up to 60 KB at once overflow the echo
    backend's default receive buffer (a drop on the way, not the proxy's doing)."""
    ep, echo = await udp_backends("e")
    settings = DataplaneSettings(udp_timeout_s=0.3)
    listeners = [
        await udp_listener(make_balancer(UDP_NAME, [ep], settings=settings), settings=settings)
        for _ in range(2)
    ]
    poller = read_poller_for(asyncio.get_running_loop())
    watched = len(poller)
    clients = [client_socket() for _ in range(16)]
    rounds = 10
    try:
        sent: dict[int, list[bytes]] = {i: [] for i in range(len(clients))}
        for r in range(rounds):
            for i, c in enumerate(clients):  # all in flight at once, of different sizes
                payload = os.urandom(1 + (r * 7919 + i * 104729) % 9_000)
                c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
                c.sendto(payload, ("127.0.0.1", listeners[i % 2].port))
                sent[i].append(payload)
            got: dict[int, bytes] = {}
            deadline = time.monotonic() + 5
            while len(got) < len(clients):
                for i, c in enumerate(clients):
                    if i not in got:
                        with contextlib.suppress(BlockingIOError):
                            got[i] = c.recv(70_000)
                assert time.monotonic() < deadline, f"round {r}: {len(got)} replies of 16"
                await asyncio.sleep(0.001)
            for i, reply in got.items():
                assert (len(reply), digest(reply)) == (
                    1 + len(sent[i][r]),
                    digest(b"e" + sent[i][r]),
                ), f"client {i}, round {r}"
        assert echo.received == rounds * len(clients)
        assert len(poller) == watched + len(clients)  # one entry per flow
    finally:
        for c in clients:
            c.close()
    await wait_until(lambda: len(poller) == watched, timeout=3, what="expired flows unwatched")
    assert all(lst.active == 0 for lst in listeners)


async def test_flow_table_is_bounded_under_10000_client_ports(
    udp_listener: UdpListenerFactory, request: pytest.FixtureRequest
) -> None:
    sink = _UdpSink()
    request.addfinalizer(sink.close)
    ep = sink.endpoint
    settings = DataplaneSettings(udp_max_flows=128, udp_timeout_s=30)
    listener = await udp_listener(
        make_balancer(UDP_NAME, [ep], settings=settings), settings=settings
    )
    to = ("127.0.0.1", listener.port)
    gauge = metrics.UDP_FLOWS.labels(str(UDP_NAME))
    fds = open_fds()
    flows_before = metrics.CONNECTIONS.labels(str(UDP_NAME), "UDP", "ok").value
    largest = 0
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    ports: set[int] = set()
    for i in range(10_000):
        assert loop.time() < deadline, "bounded loop ran out of time"
        with client_socket() as c:
            ports.add(c.getsockname()[1])
            c.sendto(b"%d" % i, to)
        if i % 32 == 31:
            await asyncio.sleep(0.001)  # let the listener and the backend drain their sockets
            largest = max(largest, listener.active)
            assert gauge.value <= 128
    flows = metrics.CONNECTIONS.labels(str(UDP_NAME), "UDP", "ok")
    await wait_until(lambda: flows.value - flows_before >= 9_500, what="flows created")
    await wait_until(lambda: sink.received >= 9_500, timeout=10, what="datagrams relayed")
    largest = max(largest, listener.active)
    assert len(ports) > 1_000  # many distinct client addresses really were used
    assert 64 <= largest <= 128
    assert open_fds() <= fds + 128


async def test_no_endpoint_drops_and_counts(udp_listener: UdpListenerFactory) -> None:
    counter = metrics.NO_ENDPOINTS.labels(str(UDP_NAME), Traffic.CLUSTER.value)
    before = counter.value
    listener = await udp_listener(make_balancer(UDP_NAME, [], settings=DataplaneSettings()))
    with client_socket() as c:
        for _ in range(3):
            c.sendto(b"lost", ("127.0.0.1", listener.port))
        await wait_until(lambda: counter.value == before + 3, what="drops counted")
        with pytest.raises(BlockingIOError):
            c.recv(100)
    assert listener.active == 0


@contextlib.contextmanager
def fd_table_full() -> Iterator[None]:
    """No new fd in this process until the block ends: soft limit lowered, free fds taken."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held: list[int] = []
    try:
        top = max(int(fd) for fd in os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (top + 1, hard))
        with contextlib.suppress(OSError):
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY))
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_a_flow_out_of_fds_drops_counts_logs_once_and_recovers(
    udp_backends: UdpBackendFactory,
    udp_listener: UdpListenerFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    ep, echo = await udp_backends("e")
    listener = await udp_listener(make_balancer(UDP_NAME, [ep], settings=DataplaneSettings()))
    failed = metrics.CONNECTIONS.labels(str(UDP_NAME), "UDP", "dial_failed")
    before = failed.value
    to = ("127.0.0.1", listener.port)
    clients = [client_socket() for _ in range(3)]
    try:
        with fd_table_full():
            for c in clients:  # three new clients: no socket for any of their flows
                c.sendto(b"lost", to)
            await wait_until(lambda: failed.value == before + 3, what="failed flows counted")
        assert listener.active == 0 and echo.received == 0
        lines = [r for r in caplog.records if "UDP flow not opened" in r.getMessage()]
        assert len(lines) == 1, [r.getMessage() for r in lines]  # one line per episode
        # fds are back: the same clients get flows and replies, nothing else was disturbed.
        for i, c in enumerate(clients):
            assert await exchange(c, b"back%d" % i, to) == b"eback%d" % i
        assert listener.active == 3
    finally:
        for c in clients:
            c.close()


@pytest.mark.parametrize("sent", ["whole", "as a change"])
async def test_flows_to_endpoints_that_stay_persist_and_those_to_removed_ones_move(
    udp_backends: UdpBackendFactory, udp_listener: UdpListenerFactory, sent: str
) -> None:
    # kube-proxy deletes the conntrack entries of removed UDP endpoints: a client that keeps
    # sending moves to a current endpoint instead of staying on a gone pod. The same when
    # the endpoints of a big port come as a change (``Balancer.change``): 100 more, not ready.
    (a, _), (b, _), (n, _) = (
        await udp_backends("a"),
        await udp_backends("b"),
        await udp_backends("n"),
    )
    idle = [Endpoint(f"127.0.9.{i}", 9, ready=False, serving=False) for i in range(100)]
    balancer = make_balancer(UDP_NAME, [a, b, *idle], settings=DataplaneSettings(udp_timeout_s=5))
    listener = await udp_listener(balancer)
    to = ("127.0.0.1", listener.port)
    with client_socket() as c1, client_socket() as c2:
        first = {(await exchange(c1, b"x", to))[:1], (await exchange(c2, b"x", to))[:1]}
        assert first == {b"a", b"b"}  # round robin: one client on each
        on_b = c1 if (await exchange(c1, b"y", to))[:1] == b"b" else c2
        on_a = c2 if on_b is c1 else c1
        if sent == "whole":  # a goes, n comes
            balancer.update(ServicePort(name=UDP_NAME, port=53), [b, n, *idle])
        else:
            balancer.change([n], [a.address])
        assert listener.active == 1  # a's flow went with it
        for i in range(3):
            assert (await exchange(on_b, b"z%d" % i, to))[:1] == b"b"  # still its flow
        assert (await exchange(on_a, b"w", to))[:1] in {b"b", b"n"}  # a current endpoint
        assert listener.active == 2


@pytest.mark.parametrize("sent", ["whole", "as a change"])
async def test_a_flow_to_a_terminating_endpoint_goes_on_while_it_serves(
    udp_backends: UdpBackendFactory, udp_listener: UdpListenerFactory, sent: str
) -> None:
    # kube-proxy keeps the conntrack entries of every serving endpoint: a pod that begins
    # terminating (ready false, serving true) finishes its clients' UDP sessions, and only
    # new clients go elsewhere. Its flows went at once, mid-session, to the other pod.
    (a, _), (b, _) = await udp_backends("a"), await udp_backends("b")
    balancer = make_balancer(UDP_NAME, [a, b], settings=DataplaneSettings(udp_timeout_s=5))
    listener = await udp_listener(balancer)
    to = ("127.0.0.1", listener.port)

    def conditions(ep: Endpoint, *, serving: bool) -> None:
        new = dataclasses.replace(ep, ready=False, serving=serving, terminating=True)
        if sent == "whole":
            others = [b] if ep is a else [a]
            balancer.update(ServicePort(name=UDP_NAME, port=53), [new, *others])
        else:
            balancer.change([new], [])

    with client_socket() as c1, client_socket() as c2:
        first = {(await exchange(c1, b"x", to))[:1], (await exchange(c2, b"x", to))[:1]}
        assert first == {b"a", b"b"}
        on_a = c1 if (await exchange(c1, b"y", to))[:1] == b"a" else c2
        conditions(a, serving=True)
        assert listener.active == 2
        for i in range(3):
            assert (await exchange(on_a, b"z%d" % i, to))[:1] == b"a"  # its session goes on
        with client_socket() as c3:
            assert (await exchange(c3, b"n", to))[:1] == b"b"  # a new client: a ready pod
        conditions(a, serving=False)
        assert (await exchange(on_a, b"w", to))[:1] == b"b"  # no longer serving: it moves


async def test_a_burst_of_new_clients_opens_flows_until_the_pass_ends_and_loses_none(
    udp_backends: UdpBackendFactory, udp_listener: UdpListenerFactory
) -> None:
    # Opening a flow costs a socket, a connect and a registration (about 8 us): 64 of them in
    # one call held every relay of the worker for 0.5 ms, and with the replies of the flows
    # opened before, passes of 1.2-2 ms. Once the poller's pass is over, the listener stops
    # opening flows; the rest wait in its socket for the next pass, and none is lost.
    ep, echo = await udp_backends("e")
    settings = DataplaneSettings()
    listener = await udp_listener(make_balancer(UDP_NAME, [ep], settings=settings))
    to = ("127.0.0.1", listener.port)
    poller = read_poller_for(asyncio.get_running_loop())
    clients = [client_socket() for _ in range(20)]
    try:
        for i, c in enumerate(clients[:10]):
            c.sendto(b"q%d" % i, to)
        poller.deadline = 0.0  # a pass that is over already: one flow, then the call returns
        listener.readable()
        assert listener.active == 1
        for i, c in enumerate(clients[10:], start=10):
            c.sendto(b"q%d" % i, to)
        poller.deadline = time.perf_counter() + 10  # a pass with time left: all that wait
        listener.readable()
        assert listener.active == 20
        replies = []
        for c in clients:
            await wait_until(functools.partial(_readable, c), what="a reply for every client")
            replies.append(c.recv(100))
        assert replies == [b"eq%d" % i for i in range(20)]
        assert echo.received == 20
    finally:
        for c in clients:
            c.close()


def _readable(sock: socket.socket) -> bool:
    try:
        return bool(sock.recv(100, socket.MSG_PEEK))
    except BlockingIOError:
        return False


async def test_flows_that_go_in_bulk_leave_the_table_at_once_and_their_sockets_later(
    udp_backends: UdpBackendFactory, udp_listener: UdpListenerFactory
) -> None:
    # Closing thousands of flow sockets in one pass held every relay of the loop for
    # milliseconds: the flows of a removed endpoint leave the table in the same pass (a
    # client's next datagram picks a current endpoint), their sockets a chunk a pass after.
    (a, _), (b, _) = await udp_backends("a"), await udp_backends("b")
    settings = DataplaneSettings(udp_timeout_s=30)
    balancer = make_balancer(UDP_NAME, [a, b], settings=settings)
    listener = await udp_listener(balancer, settings=settings)
    to = ("127.0.0.1", listener.port)
    clients = [client_socket() for _ in range(4 * CLOSE_CHUNK)]
    try:
        first = [(await exchange(c, b"x", to))[:1] for c in clients]
        assert first.count(b"a") == first.count(b"b") == 2 * CLOSE_CHUNK  # round robin
        release = release_for(asyncio.get_running_loop())
        fds = open_fds()
        balancer.update(ServicePort(name=UDP_NAME, port=53), [b])  # a goes
        assert listener.active == 2 * CLOSE_CHUNK  # a's flows are out of the table now
        assert release.closing == 2 * CLOSE_CHUNK  # their sockets not closed yet
        assert open_fds() == fds
        for c in clients:  # every client still answered, by b
            assert (await exchange(c, b"y", to)) == b"by"
            assert listener.active <= 4 * CLOSE_CHUNK
        await wait_until(lambda: release.closing == 0, what="the gone flows' sockets closed")
        assert listener.active == 4 * CLOSE_CHUNK
        assert open_fds() == fds  # as many new flows as closed ones
        # The listener's close: the same, and nothing stays open.
        listener.close()
        assert listener.active == 0
        await wait_until(lambda: release.closing == 0, what="every flow's socket closed")
        assert open_fds() == fds - 4 * CLOSE_CHUNK - 1  # the flows' and the listener's
    finally:
        for c in clients:
            c.close()


async def test_a_sweep_of_many_idle_flows_closes_their_sockets_over_later_passes(
    udp_backends: UdpBackendFactory, udp_listener: UdpListenerFactory
) -> None:
    listener, to = await _idling_out(udp_backends, udp_listener)
    release = release_for(asyncio.get_running_loop())
    fds = open_fds()
    clients = [client_socket() for _ in range(3 * CLOSE_CHUNK)]
    try:
        for c in clients:
            await exchange(c, b"x", to)
        closed = release.closed
        assert listener.active == len(clients)
        await wait_until(lambda: listener.active == 0, timeout=2, what="flow expiry")
        await wait_until(lambda: release.closing == 0, what="their sockets closed")
        assert release.closed - closed == len(clients)  # by the release, not in the sweep
    finally:
        for c in clients:
            c.close()
    assert open_fds() == fds


async def test_least_connections_counts_open_flows_until_they_expire(
    udp_backends: UdpBackendFactory, udp_listener: UdpListenerFactory
) -> None:
    (a, _), (b, _) = await udp_backends("a"), await udp_backends("b")
    settings = DataplaneSettings(udp_timeout_s=0.5)
    balancer = make_balancer(
        UDP_NAME, [a, b], settings=settings, algorithm=LbAlgorithm.LEAST_CONNECTIONS
    )
    listener = await udp_listener(balancer, settings=settings)
    to = ("127.0.0.1", listener.port)
    with client_socket() as c1, client_socket() as c2, client_socket() as c3:
        first = (await exchange(c1, b"1", to))[:1]
        second = (await exchange(c2, b"2", to))[:1]
        assert (await exchange(c3, b"3", to))[:1] == first  # 1 open each: in turn
        # c1's and c3's flows expire while c2 keeps its own alive: `first` has none open.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while listener.active > 1:
            assert loop.time() < deadline, "the idle flows never expired"
            assert await exchange(c2, b"k", to) == second + b"k"
            await asyncio.sleep(0.05)
        # In turn, `second` would be next; with fewest flows open, `first` is.
        with client_socket() as c4:
            reply = await exchange(c4, b"4" * 1000, to)
        assert digest(reply) == digest(first + b"4" * 1000)


async def test_wildcard_listener_replies_from_the_address_the_client_used(
    udp_backends: UdpBackendFactory, udp_listener: UdpListenerFactory
) -> None:
    """A connected client socket accepts only replies from the address it sent to.

    Both clients use the same address and port (the second reuses the first's port, as a
    new socket may): the second is a flow of its own, answered from its own target, while
    the first one's flow is still alive."""
    ep, _ = await udp_backends("w")
    listener = await udp_listener(
        make_balancer(UDP_NAME, [ep], settings=DataplaneSettings(udp_timeout_s=5)),
        host="0.0.0.0",
    )
    port = 0
    for target in ("127.0.0.2", "127.0.0.3"):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as c:
            c.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            c.setblocking(False)
            c.bind(("127.0.0.1", port))
            port = c.getsockname()[1]
            c.connect((target, listener.port))
            c.send(b"hi")
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 3
            while True:
                try:
                    data, source = c.recvfrom(100)
                    break
                except BlockingIOError:
                    assert loop.time() < deadline, f"no reply from {target}"
                    await asyncio.sleep(0.005)
            assert data == b"whi" and source == (target, listener.port)


@pytest.mark.root
@pytest.mark.parametrize(("receive_buffer", "all_arrive"), [(4 << 20, True), (0, False)])
async def test_a_burst_while_the_loop_is_busy_waits_in_the_receive_buffer(
    udp_backends: UdpBackendFactory,
    udp_listener: UdpListenerFactory,
    receive_buffer: int,
    all_arrive: bool,
) -> None:
    # 1,500 datagrams arrive while the loop does something else (here: this test, which does
    # not yield): the listening socket must hold them all. With the kernel's default buffer
    # (receive_buffer=0) most are dropped, which is what the setting is for. SO_RCVBUFFORCE
    # needs CAP_NET_ADMIN, hence root.
    ep, _echo = await udp_backends("x")
    settings = DataplaneSettings(udp_receive_buffer=receive_buffer, udp_timeout_s=10)
    balancer = make_balancer(UDP_NAME, [ep], settings=settings)
    listener = await udp_listener(balancer, settings=settings)
    counted = metrics.BYTES.labels(str(UDP_NAME), "to_endpoint")
    before = counted.value
    n, size = 1500, 1000
    with client_socket() as c:
        c.setblocking(True)
        for i in range(n):
            c.sendto(i.to_bytes(4, "big") * (size // 4), ("127.0.0.1", listener.port))
        last = -1.0
        for _ in range(100):  # until all are in, or nothing more comes for 0.2 s (max 5 s)
            now = counted.value - before
            if now == n * size or now == last:
                break
            last = now
            await asyncio.sleep(0.2)
    assert ((counted.value - before) == n * size) is all_arrive, counted.value - before


def test_ipv6_reply_pktinfo_keeps_the_address_and_lets_routing_choose() -> None:
    def in6(ip: str, ifindex: int) -> list[tuple[int, int, bytes]]:
        data = socket.inet_pton(socket.AF_INET6, ip) + struct.pack("=i", ifindex)
        return [(socket.IPPROTO_IPV6, socket.IPV6_PKTINFO, data)]

    # A global (or ULA) destination: the reply leaves from it, on the interface routing picks.
    ((_, _, data),) = reply_pktinfo(in6("fd00:200:3::1", 7))
    assert data == socket.inet_pton(socket.AF_INET6, "fd00:200:3::1") + bytes(4)
    # A link-local one means nothing off its link: its interface is kept.
    ((_, _, data),) = reply_pktinfo(in6("fe80::1", 7))
    assert data[16:] == struct.pack("=i", 7)
    assert reply_pktinfo([]) == []


@pytest.mark.skipif(not has_loopback6(), reason="this machine has no IPv6 loopback")
async def test_an_ipv6_wildcard_listener_replies_from_the_address_the_client_used(
    udp_listener: UdpListenerFactory,
) -> None:
    """IPV6_RECVPKTINFO on "::": the reply to a client of ::1 leaves from ::1 (a connected
    client socket takes replies from that address only)."""
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(
        lambda: _UdpEcho(b"6"), local_addr=("::1", 0)
    )
    try:
        ep = Endpoint("::1", transport.get_extra_info("sockname")[1], node_name=NODE)
        balancer = make_balancer(UDP_NAME, [ep], settings=DataplaneSettings(udp_timeout_s=5))
        listener = await udp_listener(balancer, host="::")
        with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as c:
            c.setblocking(False)
            c.connect(("::1", listener.port))
            assert await exchange(c, b"hi", ("::1", listener.port)) == b"6hi"
    finally:
        transport.close()


def _closed_udp_port() -> int:
    """A UDP port nothing listens on, so that a datagram to it draws ICMP port unreachable,
    and that stays so: it is below the ephemeral range, where the kernel never puts a socket
    bound to port 0 (a flow's socket, a client's), as it could a port it had just handed out
    and taken back."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    for port in random.Random().sample(range(low // 2, low), 100):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free UDP port below the ephemeral range")


@pytest.fixture
def asker() -> Iterator[Callable[..., Awaitable[bytes | None]]]:
    """``ask(to, payload, within_s=...)``: one datagram from a new client socket (a new flow);
    its reply, or None. Every client socket stays open until the test ends: a port closed
    could be handed to a later client, whose datagrams would then join the earlier flow."""
    held: list[socket.socket] = []

    async def ask(to: tuple[str, int], payload: bytes, *, within_s: float) -> bytes | None:
        loop = asyncio.get_running_loop()
        c = client_socket()
        held.append(c)
        c.sendto(payload, to)
        deadline = loop.time() + within_s
        while loop.time() < deadline:
            try:
                return c.recv(70_000)
            except BlockingIOError:
                await asyncio.sleep(0.002)
        return None

    yield ask
    for c in held:
        c.close()


async def test_an_endpoint_that_refuses_flows_is_left_out_and_a_reply_brings_it_back(
    udp_backends: UdpBackendFactory,
    udp_listener: UdpListenerFactory,
    asker: Callable[..., Awaitable[bytes | None]],
) -> None:
    (ep_a, _), (ep_b, _) = await udp_backends("a"), await udp_backends("b")
    dead = Endpoint("127.0.0.1", _closed_udp_port(), node_name=NODE)
    ejections = metrics.ENDPOINT_EJECTIONS.labels(str(UDP_NAME))
    before = ejections.value
    settings = DataplaneSettings(udp_timeout_s=5, eject_base_s=0.5)
    balancer = make_balancer(UDP_NAME, [ep_a, dead, ep_b], settings=settings)
    listener = await udp_listener(balancer)
    to = ("127.0.0.1", listener.port)

    # Round robin: every third new flow meets the closed port until its third refusal; the
    # refused datagram goes to another endpoint, and is answered.
    for _ in range(12):
        payload = os.urandom(1000)
        reply = await asker(to, payload, within_s=0.3)
        assert reply is not None and reply[1:] == payload and reply[:1] in (b"a", b"b")
        if ejections.value > before:
            break
    assert ejections.value == before + 1
    assert all(f.endpoint != dead for f in listener.flows.values())  # the refused flows went

    # Out: every new flow is answered while it lasts.
    loop = asyncio.get_running_loop()
    started = loop.time()
    for _ in range(20):
        payload = os.urandom(1000)
        reply = await asker(to, payload, within_s=1.0)
        assert reply is not None and reply[1:] == payload
        if loop.time() - started > 0.4:
            break  # (a slow machine: its time out is nearly over)

    # The port opens; once the endpoint is back, its first reply forgets its failures.
    revived, _ = await loop.create_datagram_endpoint(
        lambda: _UdpEcho(b"d"), local_addr=("127.0.0.1", dead.port)
    )
    try:
        deadline = loop.time() + 5
        while True:
            payload = os.urandom(100)
            reply = await asker(to, payload, within_s=1.0)
            assert reply is None or reply[1:] == payload
            if reply is not None and reply[:1] == b"d":
                break
            assert loop.time() < deadline, "the revived endpoint never answered"
    finally:
        revived.close()
    # Closed again: had its failures not been forgotten, its first refusal would put it out
    # at once (for twice as long); forgotten, it takes three again.
    for _ in range(3):
        assert await asker(to, b"after", within_s=0.3) in (b"aafter", b"bafter")
    assert ejections.value == before + 1


async def test_refusals_are_not_counted_against_an_endpoint_with_ejection_off(
    udp_backends: UdpBackendFactory,
    udp_listener: UdpListenerFactory,
    asker: Callable[..., Awaitable[bytes | None]],
) -> None:
    (ep_a, _) = await udp_backends("a")
    dead = Endpoint("127.0.0.1", _closed_udp_port(), node_name=NODE)
    settings = DataplaneSettings(udp_timeout_s=5, eject_after=0)
    listener = await udp_listener(make_balancer(UDP_NAME, [ep_a, dead], settings=settings))
    to = ("127.0.0.1", listener.port)
    ejections = metrics.ENDPOINT_EJECTIONS.labels(str(UDP_NAME))
    before = ejections.value
    replies = [await asker(to, b"x%d" % i, within_s=0.3) for i in range(8)]
    # Every other flow meets the closed port, for good, and its datagram goes on to "a".
    assert replies == [b"ax%d" % i for i in range(8)]
    assert ejections.value == before


async def test_a_refused_first_datagram_goes_to_another_endpoint(
    udp_backends: UdpBackendFactory,
    udp_listener: UdpListenerFactory,
    asker: Callable[..., Awaitable[bytes | None]],
) -> None:
    """An endpoint that answers ICMP port unreachable (gone, or not listening yet) lost the
    client's datagram: a resolver waited its whole timeout (5 s) before asking again. The
    first datagram of a flow, kept until the endpoint answers, goes to another endpoint, as
    a refused TCP dial is tried on another; a bigger one than is kept is lost, as before."""
    (ep_a, _) = await udp_backends("a")
    dead = Endpoint("127.0.0.1", _closed_udp_port(), node_name=NODE)
    settings = DataplaneSettings(udp_timeout_s=5, eject_after=0)  # "dead" stays in turn
    listener = await udp_listener(make_balancer(UDP_NAME, [dead, ep_a], settings=settings))
    to = ("127.0.0.1", listener.port)
    flows = metrics.CONNECTIONS.labels(str(UDP_NAME), "UDP", "ok")
    opened = flows.value
    for _ in range(4):
        payload = os.urandom(udp_module.FIRST_KEPT_MAX)
        reply = await asker(to, payload, within_s=2.0)
        assert reply is not None and len(reply) == len(payload) + 1
        assert hashlib.sha256(reply[1:]).digest() == hashlib.sha256(payload).digest()
    assert flows.value - opened == 4  # one flow each, counted once
    big = [
        await asker(to, os.urandom(udp_module.FIRST_KEPT_MAX + 1), within_s=0.3) for _ in range(2)
    ]
    assert sum(r is None for r in big) == 1  # the one that met "dead" is not kept


async def test_a_flow_whose_socket_cannot_connect_is_a_failed_dial_and_the_rest_serve(
    udp_backends: UdpBackendFactory,
    udp_listener: UdpListenerFactory,
    asker: Callable[..., Awaitable[bytes | None]],
) -> None:
    """The flow's socket is refused at connect (the kernel says EACCES for a broadcast
    address, without a packet sent; a route that went away says ENETUNREACH): the datagram
    is dropped as a lost one would be, counted as a failed dial against that endpoint, which
    after three is left out; no socket is kept, and other flows are answered throughout."""
    (ep_a, _) = await udp_backends("a")
    unreachable = Endpoint("255.255.255.255", 53, node_name=NODE)
    ejections = metrics.ENDPOINT_EJECTIONS.labels(str(UDP_NAME))
    ejected_before = ejections.value
    settings = DataplaneSettings(udp_timeout_s=5, eject_base_s=30)
    listener = await udp_listener(make_balancer(UDP_NAME, [ep_a, unreachable], settings=settings))
    failed = listener.stats.dial_failed
    failed_before = failed.value
    to = ("127.0.0.1", listener.port)
    replies = [await asker(to, b"q%d" % i, within_s=0.3) for i in range(12)]
    assert [r is None for r in replies[:6]] == [False, True] * 3  # round robin, until out
    assert all(r == b"aq%d" % i for i, r in enumerate(replies) if r is not None)
    assert replies[6:] == [b"aq%d" % i for i in range(6, 12)]  # out: every flow answered
    assert failed.value - failed_before == 3
    assert ejections.value == ejected_before + 1
    # Flows of the answered clients only (the earliest may have expired): none was kept for
    # a refused one, and none holds a socket to the unreachable endpoint.
    assert 0 < listener.active <= 9
    assert {flow.endpoint for flow in listener.flows.values()} == {ep_a}


class _SlowEcho(asyncio.DatagramProtocol):
    """Answers each datagram after ``delay_s`` (a DNS server asking its upstream); only
    those that start with ``only`` when that is given."""

    def __init__(self, delay_s: float, only: bytes = b"") -> None:
        self.delay_s = delay_s
        self.only = only
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        if data.startswith(self.only) and self.transport is not None:
            loop = asyncio.get_running_loop()
            loop.call_later(self.delay_s, self.transport.sendto, data, addr)


@contextlib.asynccontextmanager
async def slow_echo(delay_s: float, only: bytes = b"") -> AsyncIterator[Endpoint]:
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(
        lambda: _SlowEcho(delay_s, only), local_addr=("127.0.0.1", 0)
    )
    try:
        yield Endpoint("127.0.0.1", transport.get_extra_info("sockname")[1], node_name=NODE)
    finally:
        transport.close()


async def test_an_answer_slower_than_the_idle_timeout_reaches_its_own_client(
    udp_listener: UdpListenerFactory,
) -> None:
    """A flow waiting for its answer is kept (``REPLY_WAIT_S``): with kube-proxy's 250 ms
    idle timeout every answer slower than ~375 ms was lost with its flow, and one the
    endpoint sent after its flow closed could reach another client on the same port."""
    async with slow_echo(0.6) as ep:
        settings = DataplaneSettings(udp_timeout_s=0.25)
        listener = await udp_listener(
            make_balancer(UDP_NAME, [ep], settings=settings), settings=settings
        )
        to = ("127.0.0.1", listener.port)
        clients = [client_socket() for _ in range(40)]
        try:
            payloads = [b"client-%d-" % i + os.urandom(8) for i in range(len(clients))]
            for c, payload in zip(clients, payloads, strict=True):
                c.sendto(payload, to)
            got: dict[int, bytes] = {}
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 5
            while len(got) < len(clients) and loop.time() < deadline:
                await asyncio.sleep(0.02)
                for i, c in enumerate(clients):
                    with contextlib.suppress(BlockingIOError):
                        got[i] = c.recv(100)
            assert got == dict(enumerate(payloads))  # every one, each its own
        finally:
            for c in clients:
                c.close()


def test_flow_ports_are_a_workers_own_share_taken_in_turn() -> None:
    base = _free_udp_run(12)
    ports = range(base, base + 12)
    first = FlowPorts(0, 2, ports=ports, rng=random.Random(1))
    second = FlowPorts(1, 2, ports=ports, rng=random.Random(1))

    def bound(flow_ports: FlowPorts, held: list[socket.socket]) -> int:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        held.append(s)
        flow_ports.bind(s)
        port: int = s.getsockname()[1]
        return port

    held: list[socket.socket] = []
    try:
        taken = [bound(first, held) for _ in range(6)]
        assert sorted(taken) == list(ports[0::2])  # the whole share before any port again
        for s in held:
            s.close()
        held.clear()
        again = [bound(first, held) for _ in range(6)]
        assert again == taken  # in the same turn: a port comes back after the others
        others = {bound(second, held) for _ in range(6)}
        assert others == set(ports[1::2])  # never a port of the other worker's share
        # A port somebody holds is skipped.
        for s in held:
            s.close()
        held.clear()
        blocker = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        held.append(blocker)
        blocker.bind(("0.0.0.0", taken[0]))
        assert bound(first, held) == taken[1]
    finally:
        for s in held:
            s.close()


def _free_udp_run(n: int) -> int:
    """The first of ``n`` consecutive UDP ports free right now (above the ephemeral range)."""
    for base in range(61000, 65000, n):
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                socks.append(s)
                s.bind(("0.0.0.0", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError("no free run of UDP ports")


async def test_successive_flows_take_successive_ports_of_the_share(
    udp_backends: UdpBackendFactory,
    udp_listener: UdpListenerFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    base = _free_udp_run(8)
    share = FlowPorts(0, 1, ports=range(base, base + 8), rng=random.Random(3))
    monkeypatch.setattr(udp_module, "FLOW_PORTS", share)
    ep, _ = await udp_backends("x")
    listener = await udp_listener(make_balancer(UDP_NAME, [ep], settings=DataplaneSettings()))
    to = ("127.0.0.1", listener.port)
    seen = []
    for i in range(8):
        with client_socket() as c:
            await exchange(c, b"%d" % i, to)
            (flow,) = [f for f in listener.flows.values() if f.client == c.getsockname()]
            seen.append(flow.sock.getsockname()[1])
    assert sorted(seen) == list(range(base, base + 8))  # no port twice within the share


async def test_evictions_for_a_full_flow_table_are_counted_and_said_once(
    udp_listener: UdpListenerFactory,
    request: pytest.FixtureRequest,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="uproxy")
    caplog.clear()
    sink = _UdpSink()
    request.addfinalizer(sink.close)
    settings = DataplaneSettings(udp_max_flows=4, udp_timeout_s=30)
    name = ServicePortName("evict", "dns", "dns", Protocol.UDP)
    listener = await udp_listener(
        make_balancer(name, [sink.endpoint], settings=settings), settings=settings
    )
    to = ("127.0.0.1", listener.port)
    evictions = metrics.UDP_EVICTIONS.labels(str(name))
    before = evictions.value
    for i in range(10):
        with client_socket() as c:
            c.sendto(b"%d" % i, to)

        def relayed(n: int = i + 1) -> bool:
            return sink.received >= n

        await wait_until(relayed, what="datagram relayed")
    assert evictions.value - before == 6
    said = [r for r in caplog.records if "UDP flows evicted" in r.getMessage()]
    assert len(said) == 1


async def test_a_flow_that_gets_replies_is_evicted_after_those_that_get_nothing(
    udp_listener: UdpListenerFactory,
) -> None:
    async with slow_echo(0.05, only=b"answer me") as ep:
        settings = DataplaneSettings(udp_max_flows=3, udp_timeout_s=30)
        listener = await udp_listener(
            make_balancer(UDP_NAME, [ep], settings=settings), settings=settings
        )
        to = ("127.0.0.1", listener.port)
        with client_socket() as a, client_socket() as b, client_socket() as c:
            a.sendto(b"answer me", to)
            b.sendto(b"quiet", to)
            c.sendto(b"quiet", to)
            await wait_until(lambda: listener.active == 3, what="three flows")
            reply = b""
            deadline = time.monotonic() + 3
            while not reply and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
                with contextlib.suppress(BlockingIOError):
                    reply = a.recv(100)
            assert reply == b"answer me"  # a's flow is the most recently active now
            with client_socket() as d:
                d.sendto(b"quiet", to)
                await wait_until(
                    lambda: any(f.client == d.getsockname() for f in listener.flows.values()),
                    what="d's flow",
                )
            clients = {f.client for f in listener.flows.values()}
            assert a.getsockname() in clients and b.getsockname() not in clients
