"""Forgetting stale UDP conntrack entries when UDP service addresses come or go.

UDP has no connection teardown: after a portal changes, conntrack keeps translating a client's
"flow" to the old proxy port (or not at all) until the entry times out, and the client's
datagrams vanish. kube-proxy deletes those entries; so does uproxy.

It asks the kernel over ctnetlink (NETLINK_NETFILTER), as kube-proxy does: one dump of the
family's table for a whole batch of addresses, matched here, then one delete per matching
entry by its own tuple (a hash lookup). The ``conntrack`` tool took a process per address,
and each ``conntrack -D`` walks the whole table in the kernel (every bucket, and the entries
of every network namespace: ~10 ms with 262,144 buckets and an idle table, more under load):
2,000 new UDP services took 40 s to forget, longer the busier the node. The work runs on a
thread: the dump and the matching are synchronous, and the loop relays meanwhile.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import os
import socket
import struct
from collections.abc import Collection, Iterator
from dataclasses import dataclass

from uproxy.log import kv
from uproxy.netlink import (
    MALFORMED,
    NETLINK_NETFILTER,
    NFGENMSG,
    NLATTR,
    NLM_F_DUMP,
    NLM_F_REQUEST,
    NLMSG_DONE,
    NLMSG_ERRNO,
    NLMSG_ERROR,
    attribute,
    message,
    messages,
    raw_attribute,
)
from uproxy.rules.base import RulesError
from uproxy.rules.command import PRIVILEGE_FIX

log = logging.getLogger("uproxy.rules.conntrack")

# linux/netlink.h, linux/netfilter/nfnetlink.h, nfnetlink_conntrack.h.
NLM_F_ACK = 4
NFNL_SUBSYS_CTNETLINK = 1
IPCTNL_MSG_CT_NEW = 0
IPCTNL_MSG_CT_GET = 1
IPCTNL_MSG_CT_DELETE = 2
CTA_TUPLE_ORIG = 1
CTA_ID = 12
CTA_ZONE = 18
CTA_TUPLE_IP = 1
CTA_TUPLE_PROTO = 2
CTA_IP_V4_DST = 2
CTA_IP_V6_DST = 4
CTA_PROTO_NUM = 1
CTA_PROTO_DST_PORT = 3
_RECV = 1 << 16


@dataclass(frozen=True, slots=True)
class Target:
    """UDP entries whose original destination is ``ip``:``port`` (``ip`` None: any address
    of the family, a node port)."""

    ipv6: bool
    ip: str | None
    port: int


def udp_target(ip: str, port: int) -> Target:
    """The entries of a service address."""
    addr = ipaddress.ip_address(ip)
    return Target(addr.version == 6, addr.compressed, port)


def node_port_target(port: int, *, ipv6: bool = False) -> Target:
    """The entries of a node port, on any address of the family."""
    return Target(ipv6, None, port)


async def forget_udp(targets: Collection[Target]) -> int:
    """Delete the UDP conntrack entries of ``targets``; returns how many went. Raises
    RulesError when the table cannot be read (no privilege, no conntrack)."""
    if not targets:
        return 0
    count = await asyncio.to_thread(_forget, targets)
    log.debug("Cleared UDP conntrack", extra=kv(addresses=len(targets), count=count))
    return count


def _forget(targets: Collection[Target]) -> int:
    count = 0
    for ipv6 in (False, True):
        mine = [t for t in targets if t.ipv6 is ipv6]
        if not mine:
            continue
        family = socket.AF_INET6 if ipv6 else socket.AF_INET
        addresses = {(socket.inet_pton(family, t.ip), t.port) for t in mine if t.ip is not None}
        any_address = {t.port for t in mine if t.ip is None}
        try:
            with socket.socket(
                socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_NETFILTER
            ) as sock:
                sock.settimeout(5.0)
                stale = list(_dump_matching(sock, family, addresses, any_address))
                for request in stale:
                    count += _delete(sock, request)
        except OSError as exc:
            if exc.errno in (errno.EPERM, errno.EACCES):
                raise RulesError(f"conntrack: permission denied; {PRIVILEGE_FIX}") from None
            raise RulesError(f"conntrack: {exc.strerror or exc}") from None
    return count


def _dump_matching(
    sock: socket.socket, family: int, addresses: set[tuple[bytes, int]], any_address: set[int]
) -> Iterator[bytes]:
    """The delete requests of every UDP entry of ``family`` whose original destination is
    one of ``addresses`` (packed address, port) or whose port is one of ``any_address``.
    Raises OSError for an error the kernel answers with."""
    request_type = (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_GET
    body = NFGENMSG.pack(family, 0, 0)
    sock.send(message(request_type, NLM_F_REQUEST | NLM_F_DUMP, 1, body))
    entry_type = (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_NEW
    delete_type = (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_DELETE
    seq = 2
    while True:
        for msg_type, payload in messages(sock.recv(_RECV)):
            if msg_type == NLMSG_DONE:
                return
            if msg_type == NLMSG_ERROR:
                _raise_error(payload)
                continue
            if msg_type == MALFORMED:
                raise OSError(errno.EPROTO, "malformed conntrack dump")
            if msg_type != entry_type:
                continue
            attrs = payload[NFGENMSG.size :]
            orig = raw_attribute(attrs, CTA_TUPLE_ORIG)
            if orig is None or not _matches(orig[NLATTR.size :], family, addresses, any_address):
                continue
            # The entry's own tuple, zone and id: the kernel finds it by hash, and leaves
            # alone one made again since the dump (its id differs).
            rest = b"".join(
                raw
                for raw in (raw_attribute(attrs, CTA_ZONE), raw_attribute(attrs, CTA_ID))
                if raw is not None
            )
            yield message(delete_type, NLM_F_REQUEST | NLM_F_ACK, seq, body + orig + rest)
            seq += 1


def _matches(
    tuple_attrs: bytes, family: int, addresses: set[tuple[bytes, int]], any_address: set[int]
) -> bool:
    proto = attribute(tuple_attrs, CTA_TUPLE_PROTO)
    if proto is None or attribute(proto, CTA_PROTO_NUM) != bytes([socket.IPPROTO_UDP]):
        return False
    raw_port = attribute(proto, CTA_PROTO_DST_PORT)
    if raw_port is None or len(raw_port) != 2:
        return False
    port: int = struct.unpack(">H", raw_port)[0]
    if port in any_address:
        return True
    ip = attribute(tuple_attrs, CTA_TUPLE_IP)
    dst = (
        None
        if ip is None
        else attribute(ip, CTA_IP_V6_DST if family == socket.AF_INET6 else CTA_IP_V4_DST)
    )
    return dst is not None and (dst, port) in addresses


def _delete(sock: socket.socket, request: bytes) -> int:
    """Send one delete and read its answer: 1 when it went, 0 when it had gone already."""
    sock.send(request)
    for msg_type, payload in messages(sock.recv(_RECV)):
        if msg_type == NLMSG_ERROR:
            try:
                _raise_error(payload)
            except FileNotFoundError:  # timed out, or replaced, since the dump
                return 0
            return 1
    return 0


def _raise_error(payload: bytes) -> None:
    """An NLMSG_ERROR's error as OSError; an acknowledgement (error 0) returns."""
    if len(payload) < NLMSG_ERRNO.size:
        raise OSError(errno.EPROTO, "short netlink error")
    code = -NLMSG_ERRNO.unpack_from(payload)[0]
    if code:
        raise OSError(code, os.strerror(code))
