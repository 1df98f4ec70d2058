"""What uproxy sets on its node at start, as kube-proxy does: the connection tracking table
and timeouts (kube-proxy's ``conntrack`` settings) and its own OOM score (``oomScoreAdj``). A
node that runs uproxy instead of kube-proxy no longer has kube-proxy to do it.

Every connection to a service is tracked twice here, once as the client's connection to the
proxy port (the portal rules' REDIRECT/DNAT) and once as uproxy's own to the endpoint, so a
busy node needs the table kube-proxy would size for it: ``nf_conntrack_max`` at least
``maxPerCore`` x CPUs, and never below ``min`` (kube-proxy's ``getConntrackMax``), with a hash
table a quarter of that. TCP connections idle longer than the established timeout lose their
entry (and their NAT); kube-proxy keeps them 24 h, half-closed ones 1 h.

As kube-proxy does, values are only ever raised: a node whose administrator set a larger
table or longer timeouts keeps them. That also makes it safe to run twice: a privileged init
container (``uproxy --init-only``) raises them, and uproxy itself, without the privilege to
write ``/proc/sys``, then finds nothing left to change. ``tcpBeLiberal`` turns
``nf_conntrack_tcp_be_liberal`` on (never off); the UDP timeouts are raised when set.

``nf_conntrack_max`` and the hash size belong to the node's first network namespace: from any
other they cannot be written (the file is read-only there, and the hash size refuses).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

from uproxy.log import kv
from uproxy.settings import Settings

log = logging.getLogger("uproxy.nodesetup")

NETFILTER = "net/netfilter"
HASHSIZE = "module/nf_conntrack/parameters/hashsize"


@dataclass(frozen=True, slots=True)
class Wanted:
    """What ``tune`` raises: 0 leaves a value alone."""

    max: int = 0
    tcp_established_s: int = 0
    tcp_close_wait_s: int = 0
    tcp_be_liberal: bool = False
    udp_s: int = 0
    udp_stream_s: int = 0

    @classmethod
    def from_settings(cls, s: Settings, cpus: int | None = None) -> Wanted:
        return cls(
            max=table_size(s.conntrack_max_per_core, s.conntrack_min, cpus or os.cpu_count() or 1),
            tcp_established_s=int(s.conntrack_tcp_timeout_established),
            tcp_close_wait_s=int(s.conntrack_tcp_timeout_close_wait),
            tcp_be_liberal=s.conntrack_tcp_be_liberal,
            udp_s=int(s.conntrack_udp_timeout),
            udp_stream_s=int(s.conntrack_udp_timeout_stream),
        )


def table_size(per_core: int, minimum: int, cpus: int) -> int:
    """kube-proxy's size: ``per_core`` x CPUs, at least ``minimum``; 0 (leave it) when
    ``per_core`` is 0."""
    if per_core <= 0:
        return 0
    return max(per_core * cpus, minimum)


def tune(wanted: Wanted, *, proc_sys: str = "/proc/sys", sys: str = "/sys") -> list[str]:
    """Raise what is lower than ``wanted``; each change is logged. Returns one line per value
    that could not be raised (nothing is retried: the next start tries again)."""
    netfilter = Path(proc_sys, NETFILTER)
    problems: list[str] = []
    raises = (
        ("nf_conntrack_max", wanted.max),
        ("nf_conntrack_tcp_timeout_established", wanted.tcp_established_s),
        ("nf_conntrack_tcp_timeout_close_wait", wanted.tcp_close_wait_s),
        ("nf_conntrack_tcp_be_liberal", 1 if wanted.tcp_be_liberal else 0),
        ("nf_conntrack_udp_timeout", wanted.udp_s),
        ("nf_conntrack_udp_timeout_stream", wanted.udp_stream_s),
    )
    for name, value in raises:
        problem = _raise(netfilter / name, f"{NETFILTER}/{name}", value)
        if problem:
            problems.append(problem)
    if wanted.max:
        # kube-proxy's hash table: a quarter of the table, checked even when the table was
        # large enough already.
        problem = _raise(Path(sys, HASHSIZE), HASHSIZE, wanted.max // 4)
        if problem:
            problems.append(problem)
    return problems


def _raise(path: Path, name: str, value: int) -> str | None:
    if value <= 0:
        return None
    try:
        current = int(path.read_text().split()[0])
    except FileNotFoundError:
        return f"{name}: missing (is the nf_conntrack module loaded?)"
    except (OSError, ValueError, IndexError) as e:
        return f"{name}: cannot read it: {_reason(e)}"
    if current >= value:
        return None
    try:
        path.write_text(f"{value}\n")
    except OSError as e:
        return f"{name}: cannot raise it from {current} to {value}: {_reason(e)}"
    log.info("Raised conntrack setting", extra=kv(setting=name, value=value, was=current))
    return None


def _reason(e: Exception) -> str:
    return (e.strerror or str(e)) if isinstance(e, OSError) else str(e)


def set_oom_score_adj(value: int, *, path: str = "/proc/self/oom_score_adj") -> str | None:
    """Make this process (and the workers it starts later, which inherit it) the last the
    kernel kills when the node runs out of memory: kube-proxy takes -999. Lowering the score
    needs CAP_SYS_RESOURCE; the reason is returned when it cannot be set."""
    try:
        with open(path) as f:
            current = int(f.read())
        if current == value:
            return None
        with open(path, "w") as f:
            f.write(f"{value}\n")
    except (OSError, ValueError) as e:
        hint = " (lowering it needs CAP_SYS_RESOURCE)" if isinstance(e, PermissionError) else ""
        return f"{_reason(e)}{hint}"
    log.debug("Set the OOM score adjustment", extra=kv(value=value, was=current))
    return None


# An abstract Unix socket's name lives in its network namespace: one uproxy per node
# namespace holds it, and it goes with the process however that ends (no stale lock file).
NAMESPACE_LOCK = "\0uproxy-node-proxy"


def claim_network_namespace(name: str = NAMESPACE_LOCK) -> socket.socket:
    """Hold this network namespace for this process's rules and ports, or raise
    ``NamespaceTaken`` naming the uproxy that holds it.

    Two uproxies with rules in one namespace (a second DaemonSet, a manual start beside the
    pod) rewrote each other's rules for ever: with nftables both reloaded the table every
    second, with the iptables chains the portals flipped between the two's proxy ports
    every sync period, and the one stopped last left rules leading to ports nobody held.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(name)
        sock.listen(1)
        return sock
    except OSError as e:
        sock.close()
        if e.errno != errno.EADDRINUSE:
            raise
    raise NamespaceTaken(*_holder(name))


class NamespaceTaken(Exception):
    def __init__(
        self, pid: int | None, drain_s: float | None = None, uid: int | None = None
    ) -> None:
        self.pid = pid
        self.drain_s = drain_s  # the holder's drain timeout, as it answered
        self.uid = uid  # set when the holder runs as another user: no uproxy of this one's
        if uid is not None:
            who = f"a process of uid {uid}" + (f" (pid {pid} in its PID namespace)" if pid else "")
            super().__init__(
                f"{who}, not a uproxy of this user, holds uproxy's claim on this network "
                f"namespace (abstract Unix socket @{NAMESPACE_LOCK[1:]}); stop it"
            )
            return
        who = f"another uproxy (pid {pid} in its PID namespace)" if pid else "another uproxy"
        super().__init__(
            f"{who} already proxies for this network namespace; run one uproxy per node "
            "(--rules none, laptop mode, can run several)"
        )


def _holder(name: str) -> tuple[int | None, float | None, int | None]:
    """The pid of the process listening on ``name`` (its peer credentials), the drain
    timeout it answers with (``answer_claim``), each None when it does not say, and its uid
    when that is not this process's.

    An abstract name is anybody's to bind in the namespace: a process of another user that
    took it is no uproxy of this one's, and what it answers is not believed. Nor is a drain
    that is no length of time: answered ``inf``, a start waited for ever, serving nothing."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    pid: int | None = None
    try:
        sock.settimeout(1.0)
        sock.connect(name)
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _gid = struct.unpack("3i", creds)
        pid = pid or None
        if uid != os.geteuid():
            return pid, None, uid
        drain = float(sock.recv(64).decode("ascii").split()[0])
        return pid, drain if math.isfinite(drain) and drain >= 0 else None, None
    except (OSError, ValueError, IndexError, UnicodeDecodeError):
        return pid, None, None
    finally:
        sock.close()


def answer_claim(held: socket.socket, drain_s: float) -> None:
    """Answer another start that asks who holds the namespace: this process's drain
    timeout, so that a successor with a shorter one waits out this one's drain."""
    with contextlib.suppress(OSError):
        conn = held.accept()[0]
        with conn:
            conn.setblocking(False)
            conn.send(f"{drain_s:g}\n".encode("ascii"))
