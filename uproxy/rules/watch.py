"""Knowing, for next to nothing, whether anyone changed the kernel's rules since uproxy looked.

The proxy asks its rules backend every second whether the rules are still in place, and the
syncer asks it to sync every 30 s even when no service changed. Answering by reading the rules
(three ``iptables -S`` processes) cost ~130 ms of CPU per second at 10,000 services, and the
forks pushed the keep-alive p99 of the proxied traffic to 50 ms. The kernel can say much more
cheaply that nothing changed at all:

- nf_tables (``iptables-nft`` and uproxy's own nft table) keeps one *generation id* per network
  namespace, bumped by every committed transaction, whoever commits it. One netlink request
  (NFT_MSG_GETGEN on a NETLINK_NETFILTER socket) reads it: ~12 µs.
  The generation covers every family: one read tells whether anything changed in uproxy's
  IPv4 or IPv6 rules (``iptables-nft`` and ``ip6tables-nft`` alike).
- legacy iptables has no generation, but ``getsockopt(IPT_SO_GET_INFO)`` describes a table in
  84 bytes: its hook entry points, underflows, rule count and blob size. Any rule added,
  removed or flushed changes them: ~9 µs per table. Python's ``socket.getsockopt`` cannot pass
  the table name in, so libc's getsockopt is called through ctypes. Only tables listed in
  ``/proc/net/ip_tables_names`` are asked about: asking creates a missing legacy table. The
  legacy IPv6 tables are separate: ``IP6T_SO_GET_INFO`` on an IPv6 socket (the same number
  and struct), for the tables in ``/proc/net/ip6_tables_names``.

A watch records a *token* with ``mark`` (right after uproxy's own commit, or after a real check
found everything in place); ``changed`` reads the token again and compares. Whatever cannot be
read (no permission, no such kernel support, an unexpected reply) reads as ``None``, which is
always "changed": the backend then does the real check, as it did before this existed.

What the cheap check cannot see, and what repairs it: a legacy rule rewritten in place with one
of the same size (``iptables -R``) leaves the table's shape unchanged; in nf_tables every change
bumps the generation, but uproxy's real check for its nft table lists it without set elements
(``nft -t``, with the stamp of uproxy's last commit) and asks for one sentinel element per map
(``elements_present``), so one service's element deleted by hand passes.
Backends therefore still do a full sync at least once an hour (kube-proxy's full-sync period),
which rewrites everything.

After its own commit uproxy marks the token only when it can tell nobody else committed in
between: with a generation, when it moved by exactly uproxy's commits; otherwise the mark is
dropped and the next check reads the rules once.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import socket
import struct
from collections.abc import Callable, Hashable, Sequence

from uproxy.netlink import (
    MALFORMED,
    NETLINK_NETFILTER,
    NFGENMSG,
    NLM_F_DUMP,
    NLM_F_REQUEST,
    NLMSG,
    NLMSG_DONE,
    NLMSG_ERRNO,
    NLMSG_ERROR,
    attr,
    attribute,
    dump,
    message,
    messages,
)

log = logging.getLogger("uproxy.rules.watch")

# nf_tables' messages on NETLINK_NETFILTER (linux/netfilter/nf_tables.h).
NFNL_SUBSYS_NFTABLES = 10
NFT_MSG_NEWTABLE = 0
NFT_MSG_GETTABLE = 1
NFTA_TABLE_NAME = 1
NFT_MSG_NEWGEN = 15
NFT_MSG_GETGEN = 16
NFTA_GEN_ID = 1
_GEN_MODULO = 1 << 32

# IPT_SO_GET_INFO (linux/netfilter_ipv4/ip_tables.h) and struct ipt_getinfo; IPv6 has the
# same number (IP6T_SO_GET_INFO) and layout (struct ip6t_getinfo) at the IPv6 level.
IPT_SO_GET_INFO = 64
_IPT_GETINFO = struct.Struct("=32sI5I5III")  # name, valid_hooks, hook_entry, underflow, n, size
LEGACY_TABLE_NAMES = "/proc/net/ip_tables_names"
LEGACY_TABLE_NAMES6 = "/proc/net/ip6_tables_names"
_GETINFO_SOCKET = {
    4: (socket.AF_INET, socket.IPPROTO_IP),
    6: (socket.AF_INET6, socket.IPPROTO_IPV6),
}

Token = Hashable

# Backends rewrite everything at least this often, whatever the watch says: it repairs what the
# cheap checks cannot see (kube-proxy's full-sync period).
FULL_SYNC_PERIOD_S = 3600.0


def getgen_request(seq: int) -> bytes:
    """The NFT_MSG_GETGEN request: nlmsghdr plus an nfgenmsg for AF_UNSPEC."""
    body = NFGENMSG.pack(socket.AF_UNSPEC, 0, 0)
    msg_type = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETGEN
    return message(msg_type, NLM_F_REQUEST, seq, body)


def parse_generation(data: bytes) -> int | None:
    """The NFTA_GEN_ID of an NFT_MSG_NEWGEN reply; None for an error or anything unexpected."""
    for msg_type, payload in messages(data):
        if msg_type == (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWGEN:
            return _gen_attribute(payload[NFGENMSG.size :])
        if msg_type in (NLMSG_ERROR, MALFORMED):
            return None
    return None


def _gen_attribute(attrs: bytes) -> int | None:
    raw = attribute(attrs, NFTA_GEN_ID)
    if raw is None or len(raw) != 4:
        return None
    value: int = struct.unpack(">I", raw)[0]
    return value


def _netfilter_socket() -> socket.socket:
    """A NETLINK_NETFILTER socket whose reads give up after a second."""
    sock = socket.socket(
        socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_NETFILTER
    )
    sock.settimeout(1.0)
    return sock


def read_generation(seq: int = 1) -> int | None:
    """The nf_tables ruleset generation of this network namespace, or None if unreadable."""
    try:
        with _netfilter_socket() as sock:
            sock.send(getgen_request(seq))
            return parse_generation(sock.recv(8192))
    except OSError:
        return None


def gettable_dump_request(seq: int) -> bytes:
    """NFT_MSG_GETTABLE as a dump of every table of every family."""
    body = NFGENMSG.pack(socket.AF_UNSPEC, 0, 0)
    msg_type = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETTABLE
    flags = NLM_F_REQUEST | NLM_F_DUMP
    return message(msg_type, flags, seq, body)


def parse_tables(data: bytes) -> tuple[list[tuple[int, str]], bool] | None:
    """The (nfproto family, name) of each NFT_MSG_NEWTABLE in ``data``, and whether the dump
    ended (NLMSG_DONE); None for an error reply or anything malformed."""
    found: list[tuple[int, str]] = []
    for msg_type, payload in messages(data):
        if msg_type == NLMSG_DONE:
            return found, True
        if msg_type in (NLMSG_ERROR, MALFORMED):
            return None
        if msg_type == (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWTABLE:
            name = _string_attribute(payload[NFGENMSG.size :], NFTA_TABLE_NAME)
            if not payload or name is None:
                return None
            found.append((payload[0], name))
    return found, False


def _string_attribute(attrs: bytes, wanted: int) -> str | None:
    raw = attribute(attrs, wanted)
    return None if raw is None else raw.split(b"\0", 1)[0].decode("ascii", "replace")


def nft_tables(seq: int = 1) -> frozenset[tuple[int, str]] | None:
    """Every nf_tables table of this network namespace as (NFPROTO family, name), read over
    netlink without the ``nft`` program; None when that cannot be read (no permission, no
    nf_tables). Families: 2 ip, 10 ip6, 1 inet (``socket.AF_INET``... values)."""
    found = dump(NETLINK_NETFILTER, gettable_dump_request(seq), parse_tables)
    return None if found is None else frozenset(found)


NFT_MSG_NEWSETELEM = 12
NFT_MSG_GETSETELEM = 13
NFTA_SET_ELEM_LIST_TABLE = 1
NFTA_SET_ELEM_LIST_SET = 2
NFTA_SET_ELEM_LIST_ELEMENTS = 3
NFTA_LIST_ELEM = 1
NFTA_SET_ELEM_KEY = 1
NFTA_DATA_VALUE = 1
NLA_F_NESTED = 0x8000


def getsetelem_request(seq: int, nfproto: int, table: str, name: str, key: bytes) -> bytes:
    """NFT_MSG_GETSETELEM for one element of one set or map, by its key (the key's bytes as
    the kernel holds them: each part of a concatenation padded to 4 bytes)."""
    element = attr(
        NFTA_LIST_ELEM | NLA_F_NESTED,
        attr(NFTA_SET_ELEM_KEY | NLA_F_NESTED, attr(NFTA_DATA_VALUE, key)),
    )
    attrs = (
        attr(NFTA_SET_ELEM_LIST_TABLE, table.encode("ascii") + b"\0")
        + attr(NFTA_SET_ELEM_LIST_SET, name.encode("ascii") + b"\0")
        + attr(NFTA_SET_ELEM_LIST_ELEMENTS | NLA_F_NESTED, element)
    )
    body = NFGENMSG.pack(nfproto, 0, 0) + attrs
    msg_type = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETSETELEM
    return message(msg_type, NLM_F_REQUEST, seq, body)


def parse_element_reply(data: bytes) -> bool | None:
    """True for an NFT_MSG_NEWSETELEM reply (the element is there), False for ENOENT (no such
    element, set or table), None for any other error or anything unexpected."""
    if len(data) < NLMSG.size:
        return None
    length, msg_type, _flags, _seq, _pid = NLMSG.unpack_from(data, 0)
    if length < NLMSG.size or length > len(data):
        return None
    if msg_type == (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWSETELEM:
        return True
    if msg_type == NLMSG_ERROR and length >= NLMSG.size + NLMSG_ERRNO.size:
        code: int = NLMSG_ERRNO.unpack_from(data, NLMSG.size)[0]
        return False if code == -errno.ENOENT else None
    return None


def elements_present(nfproto: int, table: str, wanted: Sequence[tuple[str, bytes]]) -> bool | None:
    """Whether every (set or map name, key) of ``wanted`` is in ``table`` of family
    ``nfproto``: one netlink request each, ~40 us in all for a few; None when it cannot be
    told (no permission, an unexpected reply), for the caller to ask ``nft`` instead."""
    try:
        with _netfilter_socket() as sock:
            for seq, (name, key) in enumerate(wanted, 1):
                sock.send(getsetelem_request(seq, nfproto, table, name, key))
                found = parse_element_reply(sock.recv(65536))
                if found is not True:
                    return found
    except OSError:
        return None
    return True


def parse_getinfo(raw: bytes) -> tuple[int, ...] | None:
    """The shape of a legacy table from ``struct ipt_getinfo`` (everything but the name)."""
    if len(raw) < _IPT_GETINFO.size:
        return None
    return tuple(_IPT_GETINFO.unpack_from(raw)[1:])


def legacy_table_names(path: str = LEGACY_TABLE_NAMES) -> frozenset[str] | None:
    """The legacy tables that exist; empty when the module is not loaded, None if unreadable."""
    try:
        with open(path, encoding="ascii") as fh:
            return frozenset(line.strip() for line in fh if line.strip())
    except FileNotFoundError:
        return frozenset()
    except OSError:
        return None


_libc: ctypes.CDLL | None = None


def _getsockopt() -> Callable[..., int]:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    fn: Callable[..., int] = _libc.getsockopt
    return fn


def read_getinfo(table: str, version: int = 4) -> bytes | None:
    """``IPT_SO_GET_INFO`` (``IP6T_SO_GET_INFO`` for version 6) for one legacy table (which
    must exist), or None if it fails."""
    name = table.encode("ascii")
    if len(name) >= 32:
        return None
    buf = ctypes.create_string_buffer(name, _IPT_GETINFO.size)
    size = ctypes.c_uint32(_IPT_GETINFO.size)
    family, level = _GETINFO_SOCKET[version]
    try:
        with socket.socket(family, socket.SOCK_RAW, socket.IPPROTO_RAW) as sock:
            ok = _getsockopt()(sock.fileno(), level, IPT_SO_GET_INFO, buf, ctypes.byref(size))
            err = ctypes.get_errno()
    except OSError:
        return None
    if ok != 0:
        log.debug("IPT_SO_GET_INFO failed", extra={"kv": {"table": table, "err": err}})
        return None
    return buf.raw[: size.value]


class Watch:
    """A change detector: ``changed()`` is True unless the token equals the marked one."""

    kind = "none"

    def __init__(self) -> None:
        self._marked: Token | None = None
        self._warned = False

    def read(self) -> Token | None:
        """The current token; None when it cannot be read (then everything is "changed")."""
        return None

    @property
    def marked(self) -> Token | None:
        """The token of the last state uproxy knows to be its own (None: none known)."""
        return self._marked

    def mark(self, token: Token | None) -> None:
        self._marked = token

    def forget(self) -> None:
        self._marked = None

    def changed(self) -> bool:
        if self._marked is None:
            return True
        now = self.read()
        if now is None:
            self._unreadable()
            return True
        return now != self._marked

    def mark_after_commit(self, before: Token | None, commits: int = 1) -> Token | None:
        """Mark the state uproxy's own ``commits`` just left (read before them: ``before``).

        Returns the token marked, or None when it could not tell that nobody else committed
        in between (then nothing is marked and the next check reads the rules).
        """
        self.mark(None)
        return None

    def _unreadable(self) -> None:
        if not self._warned:
            self._warned = True
            log.info(
                "Cannot watch the rules cheaply, reading them on every check",
                extra={"kv": {"watch": self.kind}},
            )


class GenerationWatch(Watch):
    """nf_tables: the ruleset generation id of the network namespace."""

    kind = "nf_tables generation"

    def __init__(self, reader: Callable[[], int | None] = read_generation) -> None:
        super().__init__()
        self._reader = reader

    def read(self) -> int | None:
        return self._reader()

    def mark_after_commit(self, before: Token | None, commits: int = 1) -> Token | None:
        after = self.read()
        if not isinstance(before, int) or after is None:
            self.forget()
            return None
        if (after - before) % _GEN_MODULO != commits:
            self.forget()  # somebody else committed too: look once
            return None
        self.mark(after)
        return after


class LegacyWatch(Watch):
    """legacy iptables: the shape of the tables uproxy writes (nat and filter), per IP
    version (``versions``: 4 for ip_tables, 6 for ip6_tables)."""

    kind = "legacy iptables table info"

    def __init__(
        self,
        tables: Sequence[str] = ("nat", "filter"),
        *,
        versions: Sequence[int] = (4,),
        names: Callable[[int], frozenset[str] | None] | None = None,
        info: Callable[[str, int], bytes | None] = read_getinfo,
    ) -> None:
        super().__init__()
        self.tables = tuple(tables)
        self.versions = tuple(versions)
        self._names = names or _table_names
        self._info = info

    def read(self) -> tuple[tuple[int, str, tuple[int, ...] | None], ...] | None:
        out: list[tuple[int, str, tuple[int, ...] | None]] = []
        for version in self.versions:
            existing = self._names(version)
            if existing is None:
                return None
            for table in self.tables:
                if table not in existing:
                    out.append((version, table, None))  # absent: never ask, asking creates it
                    continue
                raw = self._info(table, version)
                shape = parse_getinfo(raw) if raw is not None else None
                if shape is None:
                    return None
                out.append((version, table, shape))
        return tuple(out)

    def mark_after_commit(self, before: Token | None, commits: int = 1) -> Token | None:
        # No generation to count commits with: the shape right after uproxy's commit. A writer
        # squeezing in between is missed until the next full sync (see the module docstring).
        after = self.read()
        self.mark(after)
        return after


def _table_names(version: int) -> frozenset[str] | None:
    return legacy_table_names(LEGACY_TABLE_NAMES6 if version == 6 else LEGACY_TABLE_NAMES)


def watch_for(mode: str, versions: Sequence[int] = (4,)) -> Watch:
    """The watch for an iptables variant (``nft`` or ``legacy``) and the IP versions written."""
    return GenerationWatch() if mode == "nft" else LegacyWatch(versions=versions)
