"""The listening sockets of proxy ports: one per listener, or a group of them, one per worker.

With data-plane workers, a proxy port is a group of sockets bound to the same address with
SO_REUSEPORT, by the control process (a port that is taken fails there, at once, in one
place), which hands them to the workers. A TCP port is usually one socket that every worker
accepts on (``workers.WorkerPool._bind`` says why); otherwise every worker accepts on a
socket of its own, and the kernel spreads new connections (and UDP datagrams) over the group
by a hash of the four-tuple: connections spread evenly and one UDP client (one address and
port) always lands in the same worker, i.e. in one flow. Being a group, a port can change
from the one to the other without closing: new sockets join it, the old ones leave.

ClientIP session affinity needs more: every connection of one client *address* must reach
the same worker, whose balancer remembers the client. For such service ports the group gets a
classic BPF program (SO_ATTACH_REUSEPORT_CBPF) that picks the socket by the client address
alone: ``saddr % N``. Measured here: 8 client addresses x 5 connections each, every address
always on the same one of 2 sockets. A group's program can be set and removed from any of its
sockets. Another program sends every new connection to the group's first socket
(``steer_to_first``): while other sockets leave the group, they get nothing new.

A program returns an index into the group, in the order its sockets joined. When a socket
leaves, the kernel moves the group's last socket into its place; when the index is past the
end, it falls back to its hash. The control process therefore holds every socket of a group
as long as the port is served (``workers``): a worker that dies leaves its socket in place,
and its connections queue there for its replacement instead of moving the others.
"""

from __future__ import annotations

import _socket
import ctypes
import socket
import struct

from uproxy.model import Protocol

SO_ATTACH_REUSEPORT_CBPF = 51  # asm-generic/socket.h; not in Python's socket module
SO_DETACH_REUSEPORT_BPF = 68
_SO_RCVBUFFORCE = 33

# cBPF opcodes (linux/filter.h) and the offset that addresses the network header.
_BPF_LD_W_ABS = 0x00 | 0x00 | 0x20
_BPF_ALU_MOD_K = 0x04 | 0x90 | 0x00
_BPF_RET_A = 0x06 | 0x10
_BPF_RET_K = 0x06 | 0x00
_SKF_NET_OFF = -0x100000
# Where the client address (its last 32 bits for IPv6) sits in the network header.
_SADDR_OFFSET = {socket.AF_INET: 12, socket.AF_INET6: 8 + 12}


def family_of(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def keep_alive(sock: _socket.socket, seconds: int) -> None:
    """TCP keep-alive probes after ``seconds`` of idleness, then every ``seconds`` (0: off).

    How many go unanswered before the kernel gives up is the node's
    net.ipv4.tcp_keepalive_probes; the socket then reports ETIMEDOUT."""
    if seconds <= 0:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, seconds)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, seconds)


def bind_tcp(
    host: str,
    port: int,
    *,
    backlog: int,
    reuseport: bool = False,
    lead: bool = False,
    keepalive: int = 0,
) -> socket.socket:
    """A non-blocking listening TCP socket; raises OSError (EADDRINUSE, EACCES...).

    ``reuseport``: the socket joins the port's SO_REUSEPORT group; with ``lead`` it starts
    one (see ``bind_group``). ``keepalive``: see ``keep_alive``; accepted sockets inherit it."""
    family = family_of(host)
    # Non-blocking from the start: no fcntl/ioctl afterwards (10,000 of them at a cold start).
    sock = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuseport and not lead:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        # A relay must not hold back small writes (Nagle). Accepted sockets inherit the
        # option from their listener: one system call here instead of one per connection.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Keep-alive too (the flag and both intervals): none of it costs a connection.
        keep_alive(sock, keepalive)
        sock.bind((host, port))
        if reuseport and lead:  # before listen(), which puts the socket in its group
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def bind_udp(
    host: str, port: int, *, receive_buffer: int, reuseport: bool = False, lead: bool = False
) -> socket.socket:
    """A non-blocking bound UDP socket with room for bursts; raises OSError.

    ``reuseport`` and ``lead``: as for ``bind_tcp``."""
    family = family_of(host)
    sock = socket.socket(family, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK)
    try:
        if reuseport and not lead:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
        if reuseport and lead:  # the next socket bound with SO_REUSEPORT joins this one
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        set_receive_buffer(sock, receive_buffer)
    except OSError:
        sock.close()
        raise
    return sock


def set_receive_buffer(sock: socket.socket, size: int) -> None:
    """Room for bursts: SO_RCVBUFFORCE (needs CAP_NET_ADMIN), else SO_RCVBUF (capped)."""
    if size <= 0:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, _SO_RCVBUFFORCE, size)
    except PermissionError:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)


def port_free(protocol: Protocol, host: str, port: int) -> bool:
    """Whether nobody holds ``host:port`` (a bind without SO_REUSEPORT, closed at once)."""
    try:
        if protocol is Protocol.TCP:
            probe = socket.socket(family_of(host), socket.SOCK_STREAM)
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as bind_tcp
        else:
            probe = socket.socket(family_of(host), socket.SOCK_DGRAM)
    except OSError:
        return False
    with probe:
        try:
            if probe.family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            probe.bind((host, port))
        except OSError:
            return False
    return True


def bind_group(
    protocol: Protocol,
    host: str,
    port: int,
    count: int,
    *,
    backlog: int,
    receive_buffer: int,
    steer_by_client: bool,
    keepalive: int = 0,
    join: bool = False,
) -> list[socket.socket]:
    """``count`` sockets on one address in a SO_REUSEPORT group, in the group's order.

    The first bind decides whether the port is free (OSError otherwise, nothing left open):
    it binds without SO_REUSEPORT and turns it on once bound, so a port that anybody holds
    fails, even one that another process of the same user holds in a SO_REUSEPORT group of
    its own (another uproxy), which a bind with SO_REUSEPORT would silently join, splitting
    the connections between the two. Later sockets join the group; with ``join`` the first
    one does too (the port is a group of uproxy's already). With ``steer_by_client`` the
    group picks sockets by client address (see the module docstring).
    """
    socks: list[socket.socket] = []
    try:
        for i in range(count):
            lead = i == 0 and not join
            if protocol is Protocol.TCP:
                sock = bind_tcp(
                    host, port, backlog=backlog, reuseport=True, lead=lead, keepalive=keepalive
                )
            else:
                sock = bind_udp(
                    host, port, receive_buffer=receive_buffer, reuseport=True, lead=lead
                )
            socks.append(sock)
            if not port:  # the rest join the port the kernel gave the first
                port = sock.getsockname()[1]
        if steer_by_client and count > 1:
            steer(socks[0], count)
    except OSError:
        for sock in socks:
            sock.close()
        raise
    return socks


def steer(sock: socket.socket, count: int) -> None:
    """Make ``sock``'s reuseport group choose its socket by client address: ``saddr % count``."""
    offset = (_SKF_NET_OFF + _SADDR_OFFSET[sock.family]) & 0xFFFFFFFF
    _attach(
        sock,
        [
            (_BPF_LD_W_ABS, 0, 0, offset),  # A = the client address (32 bits)
            (_BPF_ALU_MOD_K, 0, 0, count),  # A = A % count
            (_BPF_RET_A, 0, 0, 0),  # the index of the socket in the group
        ],
    )


def steer_to_first(sock: socket.socket) -> None:
    """Make ``sock``'s reuseport group give every new connection to its first socket."""
    _attach(sock, [(_BPF_RET_K, 0, 0, 0)])


def _attach(sock: socket.socket, program: list[tuple[int, int, int, int]]) -> None:
    code = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *ins) for ins in program))
    fprog = struct.pack("HL", len(program), ctypes.addressof(code))  # struct sock_fprog
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_REUSEPORT_CBPF, fprog)


def unsteer(sock: socket.socket) -> None:
    """Back to the kernel's four-tuple hash (no-op when no program is attached)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_DETACH_REUSEPORT_BPF, 0)
    except FileNotFoundError:
        pass  # ENOENT: nothing attached
