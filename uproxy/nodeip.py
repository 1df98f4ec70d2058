"""Finding this node's addresses, per IP family, for the host-side DNAT portal rules.

Traffic from the node itself to a service address is DNATed to node-IP:proxy-port, never to
127.0.0.1 or ::1 (that would need route_localnet, CVE-2020-8558, and has no IPv6 equivalent).
Each family the node serves needs its own: the source address of that family's default route,
else its first global address (for IPv6: global scope, so ULA counts and link-local does
not). Read from the routing table, without sending anything.

That address can go (a DHCP lease renewed with another one, an interface moved): the proxy
asks every second whether it is still this host's (``addresses_now``: one netlink dump of the
family's addresses, no process), and takes the family's new primary address when it is not.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import struct
import subprocess

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

# rtnetlink's address messages (linux/rtnetlink.h, linux/if_addr.h).
RTM_NEWADDR = 20
RTM_GETADDR = 22
IFA_ADDRESS = 1
IFA_LOCAL = 2
IFA_FLAGS = 8
IFA_F_DADFAILED = 0x08
IFA_F_TENTATIVE = 0x40
_IFADDRMSG = struct.Struct("=BBBBI")  # family, prefixlen, flags, scope, index
_AF = {IPFamily.V4: socket.AF_INET, IPFamily.V6: socket.AF_INET6}
_ADDRESS_BYTES = {socket.AF_INET: 4, socket.AF_INET6: 16}


def _ip_json(*args: str) -> list[dict[str, object]]:
    try:
        out = subprocess.run(
            ["ip", "-j", *args], capture_output=True, text=True, timeout=5, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    data = json.loads(out or "[]")
    return data if isinstance(data, list) else []


def _addresses(*args: str, global_only: bool) -> list[str]:
    out = []
    for link in _ip_json(*args):
        infos = link.get("addr_info")
        for info in infos if isinstance(infos, list) else []:
            if not isinstance(info, dict) or (global_only and info.get("scope") != "global"):
                continue
            if info.get("tentative") or info.get("dadfailed"):
                continue  # not usable (yet): IPv6 duplicate address detection
            out.append(str(info.get("local")))
    return out


def local_addresses(family: IPFamily, *, global_only: bool = True) -> list[str]:
    """This host's addresses of one family (global scope only, by default)."""
    return _addresses(f"-{family.value}", "addr", "show", global_only=global_only)


def local_ipv4_addresses(*, global_only: bool = True) -> list[str]:
    """This host's IPv4 addresses (global scope only, by default)."""
    return local_addresses(IPFamily.V4, global_only=global_only)


def primary_address(family: IPFamily, preferred: tuple[str, ...] = ()) -> str | None:
    """The node IP of one family: the first of ``preferred`` (the Node's addresses) present
    locally, else the default route's source address, else the first global address."""
    flag = f"-{family.value}"
    local = local_addresses(family)
    for ip in preferred:
        if ip in local:
            return ip
    for route in _ip_json(flag, "route", "show", "default"):
        src = route.get("prefsrc")
        if isinstance(src, str):
            return src
        dev = route.get("dev")
        if isinstance(dev, str):
            found = _addresses(flag, "addr", "show", "dev", dev, global_only=True)
            if found:
                return found[0]
    return local[0] if local else None


def primary_ipv4(preferred: tuple[str, ...] = ()) -> str | None:
    """The node's primary IPv4 address (see ``primary_address``)."""
    return primary_address(IPFamily.V4, preferred)


def is_unspecified(ip: str) -> bool:
    return ipaddress.ip_address(ip).is_unspecified


def getaddr_dump_request(family: IPFamily, seq: int) -> bytes:
    """RTM_GETADDR as a dump of every address of one family."""
    body = _IFADDRMSG.pack(_AF[family], 0, 0, 0, 0)
    return message(RTM_GETADDR, NLM_F_REQUEST | NLM_F_DUMP, seq, body)


def parse_addresses(data: bytes) -> tuple[list[str], bool] | None:
    """The usable addresses of each RTM_NEWADDR in ``data`` (an IPv6 address still in, or
    failed, duplicate address detection is not), and whether the dump ended (NLMSG_DONE); None
    for an error reply or anything malformed."""
    found: list[str] = []
    for msg_type, payload in messages(data):
        if msg_type == NLMSG_DONE:
            return found, True
        if msg_type != RTM_NEWADDR:
            return None  # NLMSG_ERROR, MALFORMED, or not what was asked for
        if len(payload) < _IFADDRMSG.size:
            return None
        af, _prefix, flags, _scope, _index = _IFADDRMSG.unpack_from(payload)
        attrs = payload[_IFADDRMSG.size :]
        wide = attribute(attrs, IFA_FLAGS)  # the flags beyond the header's 8 bits
        if wide is not None and len(wide) == 4:
            flags = struct.unpack("=I", wide)[0]
        # IFA_LOCAL is an IPv4 interface's own address (IFA_ADDRESS is the peer's on a
        # point-to-point link); IPv6 gives IFA_ADDRESS only.
        raw = attribute(attrs, IFA_LOCAL)
        if raw is None:
            raw = attribute(attrs, IFA_ADDRESS)
        if raw is None or af not in _ADDRESS_BYTES or len(raw) != _ADDRESS_BYTES[af]:
            return None
        if not flags & (IFA_F_TENTATIVE | IFA_F_DADFAILED):
            found.append(socket.inet_ntop(af, raw))
    return found, False


def addresses_now(family: IPFamily, seq: int = 1) -> frozenset[str] | None:
    """Every usable address of one family on this host (any scope), read over netlink in a
    few tens of microseconds; None when it cannot be read (the caller keeps what it has)."""
    found = dump(socket.NETLINK_ROUTE, getaddr_dump_request(family, seq), parse_addresses)
    return None if found is None else frozenset(found)
