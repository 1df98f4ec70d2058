"""Listening-socket groups: the kernel's spread over a SO_REUSEPORT group, and steering by
client address for ClientIP affinity. Real sockets on loopback (127.0.0.0/8 gives clients
distinct addresses without any setup)."""

from __future__ import annotations

import errno
import os
import socket
from collections import Counter

import pytest

from uproxy.dataplane.sockets import bind_group, steer, unsteer
from uproxy.model import Protocol


def accepted_by(group: list[socket.socket], client: str, port: int) -> int:
    """Connect from ``client``; the index of the group socket that got the connection."""
    c = socket.socket()
    try:
        c.bind((client, 0))
        c.connect(("127.0.0.1", port))
        for index, sock in enumerate(group):
            try:
                conn, _ = sock.accept()
            except BlockingIOError:
                continue
            conn.close()
            return index
        raise AssertionError("no socket of the group accepted the connection")
    finally:
        c.close()


def tcp_group(count: int, *, steer_by_client: bool = False) -> list[socket.socket]:
    return bind_group(
        Protocol.TCP,
        "127.0.0.1",
        0,
        count,
        backlog=128,
        receive_buffer=0,
        steer_by_client=steer_by_client,
    )


def test_connections_spread_over_the_group() -> None:
    group = tcp_group(2)
    try:
        port = group[0].getsockname()[1]
        assert all(s.getsockname()[1] == port for s in group)
        counts = Counter(accepted_by(group, "127.0.0.1", port) for _ in range(400))
        assert set(counts) == {0, 1}
        assert all(0.35 <= n / 400 <= 0.65 for n in counts.values()), counts
    finally:
        for s in group:
            s.close()


def test_steering_keeps_each_client_address_on_one_socket_and_can_be_undone() -> None:
    group = tcp_group(2, steer_by_client=True)
    try:
        port = group[0].getsockname()[1]
        clients = [f"127.0.0.{i}" for i in range(1, 9)]
        seen = {c: {accepted_by(group, c, port) for _ in range(6)} for c in clients}
        assert all(len(s) == 1 for s in seen.values()), seen  # one socket per address
        assert {next(iter(s)) for s in seen.values()} == {0, 1}  # and both in use
        unsteer(group[1])  # any socket of the group may switch it
        spread = {accepted_by(group, "127.0.0.1", port) for _ in range(60)}
        assert spread == {0, 1}
        steer(group[1], 2)
        assert {accepted_by(group, "127.0.0.1", port) for _ in range(20)} == seen["127.0.0.1"]
    finally:
        for s in group:
            s.close()


def test_one_udp_client_always_reaches_the_same_socket() -> None:
    group = bind_group(
        Protocol.UDP, "127.0.0.1", 0, 2, backlog=0, receive_buffer=0, steer_by_client=False
    )
    clients = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(16)]
    try:
        port = group[0].getsockname()[1]
        where: dict[int, set[int]] = {}
        for i, c in enumerate(clients):
            for _ in range(5):
                c.sendto(b"x", ("127.0.0.1", port))
                for index, sock in enumerate(group):
                    try:
                        sock.recvfrom(16)
                    except BlockingIOError:
                        continue
                    where.setdefault(i, set()).add(index)
        assert len(where) == 16 and all(len(s) == 1 for s in where.values()), where
    finally:
        for s in (*group, *clients):
            s.close()


def test_a_taken_port_fails_whole_and_leaves_nothing_open() -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    fds = len(os.listdir("/proc/self/fd"))
    try:
        with pytest.raises(OSError) as err:
            bind_group(
                Protocol.TCP,
                "127.0.0.1",
                holder.getsockname()[1],
                2,
                backlog=16,
                receive_buffer=0,
                steer_by_client=False,
            )
        assert err.value.errno == errno.EADDRINUSE
        assert len(os.listdir("/proc/self/fd")) == fds
    finally:
        holder.close()


@pytest.mark.parametrize("protocol", [Protocol.TCP, Protocol.UDP])
def test_a_port_another_group_holds_fails_instead_of_joining_it(protocol: Protocol) -> None:
    # Another process of the same user (another uproxy) holds the port in a SO_REUSEPORT
    # group: binding with SO_REUSEPORT would join it and split its traffic with ours.
    def group(port: int, *, join: bool = False) -> list[socket.socket]:
        return bind_group(
            protocol, "127.0.0.1", port, 2, backlog=16, receive_buffer=0,
            steer_by_client=False, join=join,
        )  # fmt: skip

    theirs = group(0)
    port = theirs[0].getsockname()[1]
    fds = len(os.listdir("/proc/self/fd"))
    try:
        with pytest.raises(OSError) as err:
            group(port)
        assert err.value.errno == errno.EADDRINUSE
        assert len(os.listdir("/proc/self/fd")) == fds
        more = group(port, join=True)  # joining a group of one's own is what join says
        for s in more:
            s.close()
    finally:
        for s in theirs:
            s.close()


def test_udp_group_spreads_datagrams_from_its_first_socket_on() -> None:
    group = bind_group(
        Protocol.UDP, "127.0.0.1", 0, 2, backlog=0, receive_buffer=0, steer_by_client=False
    )
    port = group[0].getsockname()[1]
    counts: Counter[int] = Counter()
    try:
        for _ in range(200):  # each from a new source port: the group's hash picks a socket
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as c:
                c.sendto(b"x", ("127.0.0.1", port))
                for index, sock in enumerate(group):
                    try:
                        sock.recv(8)
                    except BlockingIOError:
                        continue
                    counts[index] += 1
        assert sum(counts.values()) == 200
        assert all(0.3 <= counts[i] / 200 <= 0.7 for i in (0, 1)), counts
    finally:
        for s in group:
            s.close()
