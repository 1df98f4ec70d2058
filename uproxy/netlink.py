"""What every netlink reader of uproxy shares: the message and attribute headers, and walking
them with a bound at every step.

Replies come from the kernel, but a parser here must still never raise on what it does not
expect, nor loop on a length that does not move it forward: every reader answers "unknown"
(None) for anything malformed, and its caller treats unknown as the safe case. Users:
``uproxy.rules.watch`` (nf_tables' generation, tables and set elements), ``uproxy.nodeip``
(this host's addresses and default routes) and ``uproxy.rules.conntrack`` (UDP entries).
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable, Iterator
from typing import TypeVar

NLMSG_ERROR = 2
NLMSG_DONE = 3
NLM_F_REQUEST = 1
NLM_F_DUMP = 0x300
NLMSG = struct.Struct("=IHHII")  # len, type, flags, seq, pid (host order)
NLATTR = struct.Struct("=HH")  # len, type
NLA_TYPE_MASK = 0x3FFF
NLMSG_ERRNO = struct.Struct("=i")  # an NLMSG_ERROR's error, negative (0: an acknowledgement)
# NETLINK_NETFILTER, and the header of every nfnetlink message (linux/netfilter/nfnetlink.h).
NETLINK_NETFILTER = 12
NFGENMSG = struct.Struct("=BBH")  # family, version, res_id (big-endian, unused here)

_T = TypeVar("_T")


def align4(n: int) -> int:
    return (n + 3) & ~3


def message(msg_type: int, flags: int, seq: int, body: bytes) -> bytes:
    """One netlink message: its header, then ``body``."""
    return NLMSG.pack(NLMSG.size + len(body), msg_type, flags, seq, 0) + body


MALFORMED = -1  # the "type" ``messages`` gives a message whose length is out of bounds


def messages(data: bytes) -> Iterator[tuple[int, bytes]]:
    """Each message of ``data`` in order, as (type, payload after the header), until one whose
    length is out of bounds: that one comes as (``MALFORMED``, b"") and ends the walk.
    Trailing bytes too short for a header are ignored, as the kernel pads."""
    offset = 0
    while offset + NLMSG.size <= len(data):
        length, msg_type, _flags, _seq, _pid = NLMSG.unpack_from(data, offset)
        if length < NLMSG.size or offset + length > len(data):
            yield MALFORMED, b""
            return
        yield msg_type, data[offset + NLMSG.size : offset + length]
        offset += align4(length)


def _find(attrs: bytes, wanted: int) -> tuple[int, int] | None:
    """Where the first netlink attribute of type ``wanted`` starts, and its length; None
    when absent or when the attributes are malformed."""
    offset = 0
    while offset + NLATTR.size <= len(attrs):
        length, attr_type = NLATTR.unpack_from(attrs, offset)
        if length < NLATTR.size or offset + length > len(attrs):
            return None
        if attr_type & NLA_TYPE_MASK == wanted:
            return offset, length
        offset += align4(length)
    return None


def attribute(attrs: bytes, wanted: int) -> bytes | None:
    """The payload of the first netlink attribute of type ``wanted``; None when absent or
    when the attributes are malformed."""
    found = _find(attrs, wanted)
    if found is None:
        return None
    offset, length = found
    return attrs[offset + NLATTR.size : offset + length]


def raw_attribute(attrs: bytes, wanted: int) -> bytes | None:
    """The first attribute of type ``wanted`` whole (its header, payload and padding), to
    send back as the kernel gave it; None when absent or malformed."""
    found = _find(attrs, wanted)
    if found is None:
        return None
    offset, length = found
    raw = attrs[offset : offset + align4(length)]
    return raw + bytes(align4(length) - len(raw))  # the last one's padding may be cut off


def attr(attr_type: int, payload: bytes) -> bytes:
    """One netlink attribute, padded to its alignment."""
    length = NLATTR.size + len(payload)
    return NLATTR.pack(length, attr_type) + payload + bytes(align4(length) - length)


def dump(
    protocol: int, request: bytes, parse: Callable[[bytes], tuple[list[_T], bool] | None]
) -> list[_T] | None:
    """Send a dump ``request`` on a new netlink socket of ``protocol`` and gather what
    ``parse`` finds in each reply until it says the dump ended (its second value); None when
    the socket fails, a read waits more than a second, or ``parse`` says unknown."""
    try:
        with socket.socket(
            socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, protocol
        ) as sock:
            sock.settimeout(1.0)
            sock.send(request)
            out: list[_T] = []
            while True:
                parsed = parse(sock.recv(65536))
                if parsed is None:
                    return None
                found, done = parsed
                out.extend(found)
                if done:
                    return out
    except OSError:
        return None
