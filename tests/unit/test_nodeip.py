"""Reading this host's addresses and default routes over netlink: the node's primary address
at start (``nodeip.primary_address``), and what the proxy asks every second to know whether the
address its host portals DNAT to is still the node's (``nodeip.addresses_now``). The same
readers in a namespace's own kernel: ``tests/netns/test_node_addresses.py``."""

from __future__ import annotations

import socket
import struct

from tests.garble import feed_garbled
from uproxy import netlink
from uproxy.localnet import has_loopback6
from uproxy.model import IPFamily
from uproxy.nodeip import (
    IFA_ADDRESS,
    IFA_F_DADFAILED,
    IFA_F_TENTATIVE,
    IFA_FLAGS,
    IFA_LOCAL,
    RTA_MULTIPATH,
    RTA_OIF,
    RTA_PREFSRC,
    RTA_PRIORITY,
    RTA_TABLE,
    RTM_NEWADDR,
    RTM_NEWROUTE,
    DefaultRoute,
    HostAddress,
    addresses_now,
    default_routes,
    getaddr_dump_request,
    getroute_dump_request,
    parse_addresses,
    parse_default_routes,
)

# An RTM_NEWADDR of a dump, captured from the kernel: 127.0.0.1/8 on lo (index 1), scope host,
# IFA_F_PERMANENT, with its label, IFA_FLAGS and cache info.
LOOPBACK = bytes.fromhex(
    "4c0000001400020005000000586e0000020880fe01000000080001007f000001080002007f000001"
    "070003006c6f0000080008008000000014000600ffffffffffffffff1600000016000000"
)
# An RTM_NEWROUTE of a dump, captured from the kernel: "default via 192.0.2.1 dev eth0" (index 4)
# in the main table: RTA_TABLE 254, RTA_GATEWAY, RTA_OIF.
DEFAULT_VIA_ETH0 = bytes.fromhex(
    "3400000018000200050000000000000002000000fe0300010000000008000f00fe00000008000500c0000201"
    "0800040004000000"
)
DONE = netlink.message(netlink.NLMSG_DONE, 2, 5, struct.pack("=i", 0))


def newaddr(af: int, *attrs: tuple[int, bytes], flags: int = 0, scope: int = 0) -> bytes:
    body = struct.pack("=BBBBI", af, 24, flags, scope, 2)
    body += b"".join(netlink.attr(kind, value) for kind, value in attrs)
    return netlink.message(RTM_NEWADDR, 2, 5, body)


def newroute(
    *attrs: tuple[int, bytes], dst_len: int = 0, table: int = 254, kind: int = 1, af: int = 2
) -> bytes:
    """An RTM_NEWROUTE (rtmsg: family, dst_len, src_len, tos, table, protocol, scope, type,
    flags) with ``attrs``."""
    body = struct.pack("=BBBBBBBBI", af, dst_len, 0, 0, table, 3, 0, kind, 0)
    body += b"".join(netlink.attr(kind_, value) for kind_, value in attrs)
    return netlink.message(RTM_NEWROUTE, 2, 5, body)


def u32(value: int) -> bytes:
    return struct.pack("=I", value)


def v4(ip: str) -> bytes:
    return socket.inet_pton(socket.AF_INET, ip)


def v6(ip: str) -> bytes:
    return socket.inet_pton(socket.AF_INET6, ip)


def test_the_dump_request_bytes() -> None:
    # nlmsghdr: len 24, RTM_GETADDR, NLM_F_REQUEST | NLM_F_DUMP, seq 7; ifaddrmsg for AF_INET6.
    expected = struct.pack("=IHHII", 24, 22, 0x301, 7, 0) + struct.pack("=BBBBI", 10, 0, 0, 0, 0)
    assert getaddr_dump_request(IPFamily.V6, 7) == expected


def test_a_real_reply_and_the_end_of_the_dump() -> None:
    lo = HostAddress("127.0.0.1", ifindex=1, scope=254)  # scope host
    assert parse_addresses(LOOPBACK) == ([lo], False)
    assert parse_addresses(LOOPBACK + DONE) == ([lo], True)


def test_an_interfaces_own_address_not_its_peers() -> None:
    """On a point-to-point link IFA_ADDRESS is the peer: IFA_LOCAL is this host's."""
    ptp = newaddr(socket.AF_INET, (IFA_ADDRESS, v4("192.0.2.1")), (IFA_LOCAL, v4("192.0.2.2")))
    assert parse_addresses(ptp) == ([HostAddress("192.0.2.2", 2, 0)], False)
    only = newaddr(socket.AF_INET6, (IFA_ADDRESS, v6("fe80::1")), scope=253)
    assert parse_addresses(only) == ([HostAddress("fe80::1", 2, 253)], False)


def test_an_address_in_or_failed_duplicate_detection_is_not_usable() -> None:
    tentative = newaddr(socket.AF_INET6, (IFA_ADDRESS, v6("2001:db8::1")), flags=IFA_F_TENTATIVE)
    failed = newaddr(
        socket.AF_INET6,
        (IFA_ADDRESS, v6("2001:db8::2")),
        (IFA_FLAGS, struct.pack("=I", IFA_F_DADFAILED)),
    )
    # IFA_FLAGS, when present, is the whole of the flags (the header has only the low 8 bits).
    cleared = newaddr(
        socket.AF_INET6,
        (IFA_ADDRESS, v6("2001:db8::3")),
        (IFA_FLAGS, struct.pack("=I", 0)),
        flags=IFA_F_TENTATIVE,
    )
    parsed = parse_addresses(tentative + failed + cleared + DONE)
    assert parsed == ([HostAddress("2001:db8::3", 2, 0)], True)


def test_what_is_not_an_address_dump_reads_as_unknown() -> None:
    error = netlink.message(netlink.NLMSG_ERROR, 0, 5, struct.pack("=i", -1) + bytes(16))
    assert parse_addresses(error) is None
    assert parse_addresses(newaddr(socket.AF_INET, (IFA_LOCAL, v6("::1")))) is None  # size
    assert parse_addresses(newaddr(socket.AF_INET)) is None  # no address at all
    assert parse_addresses(netlink.message(99, 0, 5, bytes(8))) is None
    assert parse_addresses(LOOPBACK[:-4]) is None  # the length says more than there is


def test_the_route_dump_request_bytes() -> None:
    # nlmsghdr: len 28, RTM_GETROUTE, NLM_F_REQUEST | NLM_F_DUMP, seq 3; rtmsg for AF_INET.
    expected = struct.pack("=IHHII", 28, 26, 0x301, 3, 0) + struct.pack("=BBBBBBBBI", 2, *[0] * 8)
    assert getroute_dump_request(IPFamily.V4, 3) == expected


def test_a_real_default_route() -> None:
    assert parse_default_routes(DEFAULT_VIA_ETH0 + DONE) == ([DefaultRoute(0, None, 4)], True)


def test_only_the_main_tables_unicast_default_routes() -> None:
    wanted = newroute((RTA_OIF, u32(3)), (RTA_PRIORITY, u32(100)))
    others = [
        newroute((RTA_OIF, u32(5)), dst_len=24),  # a network, not the default
        newroute((RTA_OIF, u32(5)), table=255),  # the local table
        newroute((RTA_OIF, u32(5)), (RTA_TABLE, u32(1000)), table=252),  # table 1000
        newroute(kind=6),  # "unreachable default"
    ]
    parsed = parse_default_routes(b"".join(others) + wanted)
    assert parsed == ([DefaultRoute(100, None, 3)], False)
    # RTA_TABLE says the table when the header's byte cannot (above 255): main, here.
    main = newroute((RTA_OIF, u32(6)), (RTA_TABLE, u32(254)), table=252)
    assert parse_default_routes(main) == ([DefaultRoute(0, None, 6)], False)


def test_a_routes_source_address_and_a_multipath_routes_first_hop() -> None:
    with_src = newroute((RTA_PREFSRC, v4("192.0.2.7")), (RTA_OIF, u32(2)))
    assert parse_default_routes(with_src) == ([DefaultRoute(0, "192.0.2.7", 2)], False)
    v6_src = newroute((RTA_PREFSRC, v6("2001:db8::7")), af=socket.AF_INET6)
    assert parse_default_routes(v6_src) == ([DefaultRoute(0, "2001:db8::7", 0)], False)
    # rtnexthop: len, flags, hops, ifindex; then its own attributes (the gateway).
    hop = netlink.attr(5, v4("192.0.2.1"))
    hops = struct.pack("=HBBi", 8 + len(hop), 0, 0, 7) + hop
    hops += struct.pack("=HBBi", 8 + len(hop), 0, 0, 9) + hop
    multipath = newroute((RTA_MULTIPATH, hops))
    assert parse_default_routes(multipath) == ([DefaultRoute(0, None, 7)], False)


def test_what_is_not_a_route_dump_reads_as_unknown() -> None:
    error = netlink.message(netlink.NLMSG_ERROR, 0, 5, struct.pack("=i", -1) + bytes(16))
    assert parse_default_routes(error) is None
    assert parse_default_routes(newroute((RTA_PREFSRC, v6("::1")))) is None  # v6 source, v4
    assert parse_default_routes(netlink.message(RTM_NEWROUTE, 2, 5, bytes(8))) is None  # short
    assert parse_default_routes(DEFAULT_VIA_ETH0[:-4]) is None  # the length says more


def test_the_preferred_default_route_comes_first() -> None:
    """Sorted by metric, as the kernel chooses; read from this host's kernel."""
    for family in IPFamily:
        routes = default_routes(family)
        assert routes is not None
        assert [r.metric for r in routes] == sorted(r.metric for r in routes)


def test_the_hosts_loopback_addresses() -> None:
    assert "127.0.0.1" in (addresses_now(IPFamily.V4) or ())
    if has_loopback6():
        assert "::1" in (addresses_now(IPFamily.V6) or ())


def test_replies_cut_or_garbled_anywhere_never_raise() -> None:
    """Each of 20,000 seeded mutations of real and built replies parses or reads as unknown
    (None): never an exception, never a loop on a length that does not move forward; what
    parses is addresses."""
    replies = [
        LOOPBACK + DONE,
        newaddr(socket.AF_INET6, (IFA_ADDRESS, v6("2001:db8::1")), (IFA_FLAGS, bytes(4))),
        newaddr(socket.AF_INET, (IFA_ADDRESS, v4("192.0.2.1")), (IFA_LOCAL, v4("192.0.2.2"))),
    ]

    def parse(data: bytes) -> None:
        parsed = parse_addresses(data)
        for a in parsed[0] if parsed is not None else ():
            socket.inet_pton(socket.AF_INET6 if ":" in a.address else socket.AF_INET, a.address)

    feed_garbled(parse, replies, seed=11)


def test_route_replies_cut_or_garbled_anywhere_never_raise() -> None:
    """The same for the route reader: what parses is default routes with an address or none
    as their source and an interface index."""
    hop = struct.pack("=HBBi", 8, 0, 0, 7)
    replies = [
        DEFAULT_VIA_ETH0 + DONE,
        newroute((RTA_PREFSRC, v4("192.0.2.7")), (RTA_OIF, u32(2)), (RTA_PRIORITY, u32(5))),
        newroute((RTA_MULTIPATH, hop + hop), (RTA_TABLE, u32(254))),
        newroute((RTA_PREFSRC, v6("2001:db8::7")), af=socket.AF_INET6),
    ]

    def parse(data: bytes) -> None:
        parsed = parse_default_routes(data)
        for route in parsed[0] if parsed is not None else ():
            assert route.oif >= 0 and route.metric >= 0
            if route.prefsrc is not None:
                socket.inet_pton(
                    socket.AF_INET6 if ":" in route.prefsrc else socket.AF_INET, route.prefsrc
                )

    feed_garbled(parse, replies, seed=12)
