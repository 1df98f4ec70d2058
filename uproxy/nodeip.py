"""Finding this node's addresses, per IP family, for the host-side DNAT portal rules.

Traffic from the node itself to a service address is DNATed to node-IP:proxy-port, never to
127.0.0.1 or ::1 (that would need route_localnet, CVE-2020-8558, and has no IPv6 equivalent).
Each family the node serves needs its own: the source address of that family's default route,
else an address of the interface that route leaves by, else the first global address (for
IPv6: global scope, so ULA counts and link-local does not).

Everything here is read from the kernel over rtnetlink (``uproxy.netlink``): one dump of the
family's addresses, and one of its routes for the primary address. No process is spawned and
nothing is sent anywhere. That address can go (a DHCP lease renewed with another one, an
interface moved): the proxy asks every second whether it is still this host's
(``addresses_now``, a few tens of microseconds), and takes the family's new primary address
when it is not.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from typing import NamedTuple

from uproxy.model import IPFamily
from uproxy.netlink import (
    NLM_F_DUMP,
    NLM_F_REQUEST,
    NLMSG_DONE,
    attribute,
    dump,
    message,
    messages,
)

# rtnetlink's address and route messages (linux/rtnetlink.h, linux/if_addr.h).
RTM_NEWADDR = 20
RTM_GETADDR = 22
RTM_NEWROUTE = 24
RTM_GETROUTE = 26
IFA_ADDRESS = 1
IFA_LOCAL = 2
IFA_FLAGS = 8
IFA_F_DADFAILED = 0x08
IFA_F_TENTATIVE = 0x40
RTA_OIF = 4
RTA_PRIORITY = 6
RTA_PREFSRC = 7
RTA_MULTIPATH = 9
RTA_TABLE = 15
RT_TABLE_MAIN = 254
RTN_UNICAST = 1
RT_SCOPE_UNIVERSE = 0  # what ``ip`` calls "scope global"
_IFADDRMSG = struct.Struct("=BBBBI")  # family, prefixlen, flags, scope, index
# family, dst_len, src_len, tos, table, protocol, scope, type, flags
_RTMSG = struct.Struct("=BBBBBBBBI")
_RTNEXTHOP = struct.Struct("=HBBi")  # len, flags, hops, ifindex
_U32 = struct.Struct("=I")
_AF = {IPFamily.V4: socket.AF_INET, IPFamily.V6: socket.AF_INET6}
_ADDRESS_BYTES = {socket.AF_INET: 4, socket.AF_INET6: 16}


class HostAddress(NamedTuple):
    """One usable address of this host, as the kernel lists it."""

    address: str
    ifindex: int  # its interface's index
    scope: int  # RT_SCOPE_UNIVERSE (global), 253 link, 254 host...


class DefaultRoute(NamedTuple):
    """A default route of the main table."""

    metric: int
    prefsrc: str | None  # the source address it names (``src``), if any
    oif: int  # the interface it leaves by (a multipath route's first hop); 0: none


def getaddr_dump_request(family: IPFamily, seq: int) -> bytes:
    """RTM_GETADDR as a dump of every address of one family."""
    body = _IFADDRMSG.pack(_AF[family], 0, 0, 0, 0)
    return message(RTM_GETADDR, NLM_F_REQUEST | NLM_F_DUMP, seq, body)


def getroute_dump_request(family: IPFamily, seq: int) -> bytes:
    """RTM_GETROUTE as a dump of every route of one family (every table)."""
    body = _RTMSG.pack(_AF[family], 0, 0, 0, 0, 0, 0, 0, 0)
    return message(RTM_GETROUTE, NLM_F_REQUEST | NLM_F_DUMP, seq, body)


def parse_addresses(data: bytes) -> tuple[list[HostAddress], bool] | None:
    """The usable addresses of each RTM_NEWADDR in ``data`` (an IPv6 address still in, or
    failed, duplicate address detection is not), and whether the dump ended (NLMSG_DONE); None
    for an error reply or anything malformed."""
    found: list[HostAddress] = []
    for msg_type, payload in messages(data):
        if msg_type == NLMSG_DONE:
            return found, True
        if msg_type != RTM_NEWADDR:
            return None  # NLMSG_ERROR, MALFORMED, or not what was asked for
        if len(payload) < _IFADDRMSG.size:
            return None
        af, _prefix, flags, scope, index = _IFADDRMSG.unpack_from(payload)
        attrs = payload[_IFADDRMSG.size :]
        wide = attribute(attrs, IFA_FLAGS)  # the flags beyond the header's 8 bits
        if wide is not None and len(wide) == _U32.size:
            flags = _U32.unpack(wide)[0]
        # IFA_LOCAL is an IPv4 interface's own address (IFA_ADDRESS is the peer's on a
        # point-to-point link); IPv6 gives IFA_ADDRESS only.
        raw = attribute(attrs, IFA_LOCAL)
        if raw is None:
            raw = attribute(attrs, IFA_ADDRESS)
        if raw is None or af not in _ADDRESS_BYTES or len(raw) != _ADDRESS_BYTES[af]:
            return None
        if not flags & (IFA_F_TENTATIVE | IFA_F_DADFAILED):
            found.append(HostAddress(socket.inet_ntop(af, raw), index, scope))
    return found, False


def parse_default_routes(data: bytes) -> tuple[list[DefaultRoute], bool] | None:
    """The main table's unicast default routes among the RTM_NEWROUTEs in ``data``, and
    whether the dump ended; None for an error reply or anything malformed."""
    found: list[DefaultRoute] = []
    for msg_type, payload in messages(data):
        if msg_type == NLMSG_DONE:
            return found, True
        if msg_type != RTM_NEWROUTE or len(payload) < _RTMSG.size:
            return None
        af, dst_len, _src, _tos, table, _proto, _scope, kind, _flags = _RTMSG.unpack_from(payload)
        attrs = payload[_RTMSG.size :]
        full_table = _u32(attribute(attrs, RTA_TABLE))  # a table id above 255
        if full_table is not None:
            table = full_table
        if dst_len != 0 or table != RT_TABLE_MAIN or kind != RTN_UNICAST:
            continue
        if af not in _ADDRESS_BYTES:
            return None
        raw = attribute(attrs, RTA_PREFSRC)
        if raw is not None and len(raw) != _ADDRESS_BYTES[af]:
            return None
        oif = _u32(attribute(attrs, RTA_OIF))
        if oif is None:
            oif = _first_hop(attribute(attrs, RTA_MULTIPATH))
        found.append(
            DefaultRoute(
                metric=_u32(attribute(attrs, RTA_PRIORITY)) or 0,
                prefsrc=None if raw is None else socket.inet_ntop(af, raw),
                oif=oif or 0,
            )
        )
    return found, False


def _u32(raw: bytes | None) -> int | None:
    return _U32.unpack(raw)[0] if raw is not None and len(raw) == _U32.size else None


def _first_hop(hops: bytes | None) -> int | None:
    """The interface of a multipath route's first next hop (``rtnexthop``)."""
    if hops is None or len(hops) < _RTNEXTHOP.size:
        return None
    length, _flags, _hops, index = _RTNEXTHOP.unpack_from(hops)
    return index if length >= _RTNEXTHOP.size and index > 0 else None


def host_addresses(family: IPFamily, seq: int = 1) -> list[HostAddress] | None:
    """Every usable address of one family on this host, in the kernel's order (interfaces by
    index, an interface's primary address first); None when they cannot be read."""
    return dump(socket.NETLINK_ROUTE, getaddr_dump_request(family, seq), parse_addresses)


def default_routes(family: IPFamily, seq: int = 1) -> list[DefaultRoute] | None:
    """The main table's default routes of one family, the one the kernel prefers (the lowest
    metric) first; None when they cannot be read."""
    found = dump(socket.NETLINK_ROUTE, getroute_dump_request(family, seq), parse_default_routes)
    return None if found is None else sorted(found, key=lambda r: r.metric)


def addresses_now(family: IPFamily, seq: int = 1) -> frozenset[str] | None:
    """Every usable address of one family on this host (any scope); None when they cannot be
    read (the caller keeps what it has)."""
    found = host_addresses(family, seq)
    return None if found is None else frozenset(a.address for a in found)


def local_addresses(family: IPFamily, *, global_only: bool = True) -> list[str]:
    """This host's addresses of one family (global scope only, by default); none when they
    cannot be read."""
    return [
        a.address
        for a in host_addresses(family) or ()
        if not global_only or a.scope == RT_SCOPE_UNIVERSE
    ]


def primary_address(family: IPFamily, preferred: tuple[str, ...] = ()) -> str | None:
    """The node IP of one family: the first of ``preferred`` (the Node's addresses) present
    locally; else the preferred default route's source address, or the first global address
    of the interface it leaves by; else the first global address."""
    local = [a for a in host_addresses(family) or () if a.scope == RT_SCOPE_UNIVERSE]
    addresses = [a.address for a in local]
    for ip in preferred:
        if ip in addresses:
            return ip
    for route in default_routes(family) or ():
        if route.prefsrc is not None:
            return route.prefsrc
        for a in local:
            if a.ifindex == route.oif:
                return a.address
    return addresses[0] if addresses else None


def is_unspecified(ip: str) -> bool:
    return ipaddress.ip_address(ip).is_unspecified
