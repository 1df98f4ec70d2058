"""Reading this host's addresses over netlink (``nodeip.addresses_now``): what the proxy asks
every second to know whether the address its host portals DNAT to is still the node's."""

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
    RTM_NEWADDR,
    addresses_now,
    getaddr_dump_request,
    parse_addresses,
)

# An RTM_NEWADDR of a dump, captured from the kernel: 127.0.0.1/8 on lo (index 1), scope host,
# IFA_F_PERMANENT, with its label, IFA_FLAGS and cache info.
LOOPBACK = bytes.fromhex(
    "4c0000001400020005000000586e0000020880fe01000000080001007f000001080002007f000001"
    "070003006c6f0000080008008000000014000600ffffffffffffffff1600000016000000"
)
DONE = netlink.message(netlink.NLMSG_DONE, 2, 5, struct.pack("=i", 0))


def newaddr(af: int, *attrs: tuple[int, bytes], flags: int = 0) -> bytes:
    body = struct.pack("=BBBBI", af, 24, flags, 0, 2)
    body += b"".join(netlink.attr(kind, value) for kind, value in attrs)
    return netlink.message(RTM_NEWADDR, 2, 5, body)


def v4(ip: str) -> bytes:
    return socket.inet_pton(socket.AF_INET, ip)


def v6(ip: str) -> bytes:
    return socket.inet_pton(socket.AF_INET6, ip)


def test_the_dump_request_bytes() -> None:
    # nlmsghdr: len 24, RTM_GETADDR, NLM_F_REQUEST | NLM_F_DUMP, seq 7; ifaddrmsg for AF_INET6.
    expected = struct.pack("=IHHII", 24, 22, 0x301, 7, 0) + struct.pack("=BBBBI", 10, 0, 0, 0, 0)
    assert getaddr_dump_request(IPFamily.V6, 7) == expected


def test_a_real_reply_and_the_end_of_the_dump() -> None:
    assert parse_addresses(LOOPBACK) == (["127.0.0.1"], False)
    assert parse_addresses(LOOPBACK + DONE) == (["127.0.0.1"], True)


def test_an_interfaces_own_address_not_its_peers() -> None:
    """On a point-to-point link IFA_ADDRESS is the peer: IFA_LOCAL is this host's."""
    ptp = newaddr(socket.AF_INET, (IFA_ADDRESS, v4("192.0.2.1")), (IFA_LOCAL, v4("192.0.2.2")))
    assert parse_addresses(ptp) == (["192.0.2.2"], False)
    only = newaddr(socket.AF_INET6, (IFA_ADDRESS, v6("2001:db8::1")))
    assert parse_addresses(only) == (["2001:db8::1"], False)


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
    assert parse_addresses(tentative + failed + cleared + DONE) == (["2001:db8::3"], True)


def test_what_is_not_an_address_dump_reads_as_unknown() -> None:
    error = netlink.message(netlink.NLMSG_ERROR, 0, 5, struct.pack("=i", -1) + bytes(16))
    assert parse_addresses(error) is None
    assert parse_addresses(newaddr(socket.AF_INET, (IFA_LOCAL, v6("::1")))) is None  # size
    assert parse_addresses(newaddr(socket.AF_INET)) is None  # no address at all
    assert parse_addresses(netlink.message(99, 0, 5, bytes(8))) is None
    assert parse_addresses(LOOPBACK[:-4]) is None  # the length says more than there is


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
        for ip in parsed[0] if parsed is not None else ():
            socket.inet_pton(socket.AF_INET6 if ":" in ip else socket.AF_INET, ip)

    feed_garbled(parse, replies, seed=11)
