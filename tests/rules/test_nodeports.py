"""Node port reservations: a real socket holds each node port."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from uproxy.model import IPFamily, Protocol, ServicePortName
from uproxy.rules.nodeports import NodePortError, NodePortReservations

WEB = ServicePortName("default", "web", "http", Protocol.TCP)
DNS = ServicePortName("kube-system", "dns", "dns", Protocol.UDP)


@pytest.fixture
def reservations() -> Iterator[NodePortReservations]:
    held = NodePortReservations(bind_ips=("127.0.0.1",))
    yield held
    held.close()


def free_port(kind: socket.SocketKind) -> int:
    with socket.socket(socket.AF_INET, kind) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def test_reserved_tcp_port_cannot_be_taken(reservations: NodePortReservations) -> None:
    port = free_port(socket.SOCK_STREAM)
    reservations.reserve(WEB, Protocol.TCP, port)
    with socket.socket() as other, pytest.raises(OSError):
        other.bind(("127.0.0.1", port))
    reservations.release(Protocol.TCP, port)
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind(("127.0.0.1", port))


def test_taken_port_names_service_and_port(reservations: NodePortReservations) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen(1)
        port = squatter.getsockname()[1]
        with pytest.raises(NodePortError, match=rf"node port {port}/TCP .*default/web:http"):
            reservations.reserve(WEB, Protocol.TCP, port)
    assert (Protocol.TCP, port) not in reservations


def test_udp_port_taken(reservations: NodePortReservations) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as squatter:
        squatter.bind(("127.0.0.1", 0))
        port = squatter.getsockname()[1]
        with pytest.raises(NodePortError, match=rf"{port}/UDP .*kube-system/dns:dns"):
            reservations.reserve(DNS, Protocol.UDP, port)


def test_sync_by_difference_reports_failures(reservations: NodePortReservations) -> None:
    a = free_port(socket.SOCK_STREAM)
    b = free_port(socket.SOCK_DGRAM)
    v4 = IPFamily.V4
    assert reservations.sync({(Protocol.TCP, a, v4): WEB, (Protocol.UDP, b, v4): DNS}) == []
    assert len(reservations) == 2
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen(1)
        taken = squatter.getsockname()[1]
        failures = reservations.sync({(Protocol.TCP, a, v4): DNS, (Protocol.TCP, taken, v4): WEB})
    assert [str(f) for f in failures] == [
        f"node port {taken}/TCP for service default/web:http is not available: "
        "Address already in use"
    ]
    assert len(reservations) == 1
    assert reservations.owner(Protocol.TCP, a) == DNS  # same port, new owner: kept open
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as other:
        other.bind(("127.0.0.1", b))  # released by the sync


def test_each_address_is_held_and_the_others_stay_free() -> None:
    # --nodeport-addresses: only the node's addresses in its CIDRs hold the port.
    held = NodePortReservations(bind_ips=("127.0.0.2", "127.0.0.3"))
    port = free_port(socket.SOCK_STREAM)
    try:
        held.reserve(WEB, Protocol.TCP, port)
        for ip in ("127.0.0.2", "127.0.0.3"):
            with socket.socket() as other, pytest.raises(OSError):
                other.bind((ip, port))
        with socket.socket() as other:  # another address of the node: free for others
            other.bind(("127.0.0.4", port))
    finally:
        held.close()


def test_a_taken_address_releases_the_others_and_is_named() -> None:
    port = free_port(socket.SOCK_STREAM)
    held = NodePortReservations(bind_ips=("127.0.0.2", "127.0.0.3"))
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.3", port))
        squatter.listen(1)
        with pytest.raises(NodePortError, match=rf"node port {port}/TCP .* on 127\.0\.0\.3"):
            held.reserve(WEB, Protocol.TCP, port)
    assert (Protocol.TCP, port, IPFamily.V4) not in held
    with socket.socket() as other:  # the first address was let go again
        other.bind(("127.0.0.2", port))
    held.close()


def test_no_address_records_the_owner_without_a_socket() -> None:
    # No node address in --nodeport-addresses: the port is the service's, bound nowhere.
    held = NodePortReservations(bind_ips=())
    port = free_port(socket.SOCK_STREAM)
    held.reserve(WEB, Protocol.TCP, port)
    assert held.owner(Protocol.TCP, port) == WEB
    with socket.socket() as other:
        other.bind(("127.0.0.1", port))
    held.close()


def test_each_family_holds_its_own_addresses() -> None:
    # A dual-stack node: an IPv4-only service's node port stays free on IPv6, and the IPv6
    # reservation (V6ONLY) never takes the port on IPv4 addresses.
    held = NodePortReservations(bind_ips=("127.0.0.1", "::1"))
    port = free_port(socket.SOCK_STREAM)
    try:
        held.reserve(WEB, Protocol.TCP, port, IPFamily.V4)
        with socket.socket(socket.AF_INET6) as other:
            other.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            other.bind(("::1", port))  # free in IPv6
        held.reserve(WEB, Protocol.TCP, port, IPFamily.V6)
        assert held.owner(Protocol.TCP, port, IPFamily.V6) == WEB
        with socket.socket(socket.AF_INET6) as other, pytest.raises(OSError):
            other.bind(("::1", port))
        held.release(Protocol.TCP, port, IPFamily.V4)
        with socket.socket() as other:  # IPv4 let go; IPv6 still held
            other.bind(("127.0.0.1", port))
        assert held.owner(Protocol.TCP, port, IPFamily.V6) == WEB
    finally:
        held.close()


def test_a_taken_ipv6_port_names_the_family() -> None:
    held = NodePortReservations(bind_ips=("0.0.0.0", "::1"))
    with socket.socket(socket.AF_INET6) as squatter:
        squatter.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        squatter.bind(("::1", 0))
        squatter.listen(1)
        port = squatter.getsockname()[1]
        with pytest.raises(NodePortError, match=rf"^node port {port}/TCP \(IPv6\) for service"):
            held.reserve(WEB, Protocol.TCP, port, IPFamily.V6)
    held.close()
