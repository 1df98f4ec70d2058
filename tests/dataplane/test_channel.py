"""The control channel: a worker at its open-file limit, and a worker applying a bulk.

The kernel hands a received packet's sockets over one by one and closes those it cannot
install (EMFILE), flagging the packet MSG_CTRUNC. The messages are still whole: the worker
must keep them all and keep its channel, not take the packet for a broken stream and stop
(which dropped every connection it relayed), and take sockets again once it has fds to spare.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import pickle
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from uproxy.dataplane.messages import (
    APPLY_PART,
    APPLY_SLICE_S,
    APPLY_SLICE_STARTING_S,
    ENDPOINTS_PER_PACKET,
    MESSAGES_PER_PACKET,
    PACKET_BYTES,
    ChangeEndpoints,
    Channel,
    Configure,
    EndpointsAhead,
    Forget,
    Message,
    OpenListener,
    Part,
    SetEndpoints,
)
from uproxy.dataplane.poller import READ_EVENTS, io_waiting, poller_for
from uproxy.dataplane.settings import DataplaneSettings
from uproxy.dataplane.worker import Worker
from uproxy.model import Endpoint, IPFamily, Protocol, ServicePort, ServicePortName, Traffic

ROOT = Path(__file__).resolve().parents[2]
SOCKETS = MESSAGES_PER_PACKET - 1  # and the closing Forget: one packet
HEADROOM = 5  # fds the receiver can still open
AGAIN = 3  # sockets sent once it has fds to spare again

RECEIVER = """
import asyncio, json, os, resource, socket, sys
from uproxy.dataplane.messages import Channel, Forget, OpenListener

async def main() -> None:
    fd, headroom = int(sys.argv[1]), int(sys.argv[2])
    got = {"open": 0, "sockets": 0, "closed": False, "again": 0}
    first, second = asyncio.Event(), asyncio.Event()
    filler, held = [], []

    def on_message(message, sock):
        if isinstance(message, OpenListener):
            if first.is_set():
                got["again"] += sock is not None
            else:
                got["open"] += 1
                got["sockets"] += sock is not None
            if sock is not None:
                held.append(sock)
        if isinstance(message, Forget):
            (second if first.is_set() else first).set()

    def on_closed():
        got["closed"] = True
        first.set()
        second.set()

    channel = Channel(socket.socket(fileno=fd), on_message=on_message, on_closed=on_closed)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        while True:
            filler.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass
    for fd in filler[:headroom]:  # exactly this many fds left
        os.close(fd)
    del filler[:headroom]
    print("ready", flush=True)
    await asyncio.wait_for(first.wait(), 10)
    got["missed"] = channel.sockets_missed
    got["still_open"] = not channel.closed
    for fd in filler:  # fds to spare again
        os.close(fd)
    print("freed", flush=True)
    await asyncio.wait_for(second.wait(), 10)
    got["missed_after"] = channel.sockets_missed
    print(json.dumps(got), flush=True)

asyncio.run(main())
"""


async def test_a_packet_with_more_sockets_than_fds_left_keeps_the_channel() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        RECEIVER,
        str(theirs.fileno()),
        str(HEADROOM),
        pass_fds=(theirs.fileno(),),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    theirs.close()
    channel = Channel(ours, on_message=lambda m, s: None, on_closed=lambda: None)
    try:
        assert child.stdout is not None
        ready = await asyncio.wait_for(child.stdout.readline(), 10)
        assert ready.strip() == b"ready"
        send_listeners(channel, SOCKETS, prefix="svc")
        channel.send(Forget(ServicePortName("ns", "end", "p", Protocol.TCP), IPFamily.V4))
        freed = await asyncio.wait_for(child.stdout.readline(), 10)
        assert freed.strip() == b"freed"
        send_listeners(channel, AGAIN, prefix="again")
        channel.send(Forget(ServicePortName("ns", "end2", "p", Protocol.TCP), IPFamily.V4))
        out, err = await asyncio.wait_for(child.communicate(), 15)
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
        channel.close()
    got = json.loads(out.decode().strip().splitlines()[-1])
    log = err.decode()
    assert got["open"] == SOCKETS  # every message arrived
    assert got["sockets"] == HEADROOM  # as many sockets as it had fds for
    assert got["missed"] == SOCKETS - HEADROOM
    assert got["still_open"] and not got["closed"]
    assert "open-file limit" in log  # one clear line says why
    assert log.count("Channel lost sockets") == 1
    # With fds to spare again, sockets come with their messages again, and it says so.
    assert got["again"] == AGAIN and got["missed_after"] == 0
    assert log.count("Channel receives sockets again") == 1


def send_listeners(channel: Channel, count: int, *, prefix: str) -> None:
    """``count`` OpenListener messages, each with a listening socket of its own."""
    for i in range(count):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        name = ServicePortName("ns", f"{prefix}{i}", "p", Protocol.TCP)
        channel.send(OpenListener(name, Traffic.CLUSTER, IPFamily.V4), sock.detach())


# --- applying a long run of messages: the loop's other work runs in between -----------------

SLOW_S = 0.0002  # what applying one message costs here: a few of them fill a slice


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _forget(i: int) -> Forget:
    return Forget(ServicePortName("ns", f"svc{i}", "p", Protocol.TCP), IPFamily.V4)


async def test_a_packet_of_slow_messages_is_applied_in_slices() -> None:
    """A worker applies a big sync while it relays: with the budget checked per packet, a
    packet of 50 new listeners held its relays 2-10 ms. Here, whatever else the loop has
    to do (a relay's event) runs after at most a few messages, not after the packet."""
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    applied: list[str] = []
    seen_by_others: list[int] = []
    reports: list[int] = []
    done = asyncio.Event()

    def on_message(message: object, sock: socket.socket | None) -> None:
        assert isinstance(message, Forget)
        applied.append(message.name.name)
        if len(applied) == 1:  # as if a relay's socket became readable now
            loop.call_soon(lambda: seen_by_others.append(len(applied)))
        _busy(SLOW_S)

    def on_applied(count: int) -> None:
        reports.append(count)
        if count == MESSAGES_PER_PACKET:
            done.set()

    sender = Channel(ours, on_message=lambda m, s: None, on_closed=lambda: None)
    receiver = Channel(theirs, on_message=on_message, on_closed=done.set, on_applied=on_applied)
    try:
        for i in range(MESSAGES_PER_PACKET):  # one packet
            sender.send(_forget(i))
        await asyncio.wait_for(done.wait(), 10)
    finally:
        sender.close()
        receiver.close()
    assert applied == [f"svc{i}" for i in range(MESSAGES_PER_PACKET)]  # all, in order
    slice_messages = int(APPLY_SLICE_S / SLOW_S) + 1
    assert seen_by_others and seen_by_others[0] <= slice_messages < MESSAGES_PER_PACKET
    # "Applied" once everything received is applied, not after every slice.
    assert reports == [MESSAGES_PER_PACKET]


async def test_a_big_change_is_applied_in_parts_one_a_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step of a big port's change (up to 250 endpoints and addresses) held a worker's
    relays for all of its endpoints: it is applied a part at a time, the loop's other work
    running between parts; together the parts are the change, each mixes removals and
    additions as the change does, and the message counts once as applied. The CPU is
    offered between messages, not between the parts of one (as inside a message)."""
    loop = asyncio.get_running_loop()
    spn = ServicePortName("ns", "big", "p", Protocol.TCP)
    added = tuple(Endpoint(f"10.1.{i >> 8}.{i & 255}", 80) for i in range(75))
    removed = tuple((f"10.2.{i >> 8}.{i & 255}", 80) for i in range(25))
    change = ChangeEndpoints(spn, IPFamily.V4, added, removed, staged=True)
    then = ChangeEndpoints(spn, IPFamily.V4, (), removed[:20])  # in the same packet
    assert ENDPOINTS_PER_PACKET >= 100 + 20
    parts: list[tuple[ChangeEndpoints, int]] = []
    passes = [0]
    yields: list[int] = []
    reports: list[int] = []
    done = asyncio.Event()
    monkeypatch.setattr(os, "sched_yield", lambda: yields.append(len(parts)))

    def tick() -> None:  # counts the loop's passes while the parts come
        passes[0] += 1
        if not done.is_set():
            loop.call_soon(tick)

    def on_message(message: Message, sock: socket.socket | None) -> None:
        assert isinstance(message, ChangeEndpoints)
        parts.append((message, passes[0]))
        _busy(APPLY_SLICE_S)  # a balancer's work for it: a slice's worth

    def on_applied(count: int) -> None:
        reports.append(count)
        done.set()

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sender = Channel(ours, on_message=lambda m, s: None, on_closed=lambda: None)
    receiver = Channel(theirs, on_message=on_message, on_closed=done.set, on_applied=on_applied)
    try:
        tick()
        sender.send(change)
        sender.send(then)
        await asyncio.wait_for(done.wait(), 10)
    finally:
        sender.close()
        receiver.close()
    first = -(-100 // APPLY_PART)
    assert len(parts) == first + 1
    ours_parts = [p for p, _ in parts[:first]]
    assert all(len(p.added) + len(p.removed) <= APPLY_PART for p in ours_parts)
    assert tuple(ep for p in ours_parts for ep in p.added) == added
    assert tuple(a for p in ours_parts for a in p.removed) == removed
    assert all(p.added and p.removed and p.staged and p.name == spn for p in ours_parts)
    assert parts[first][0] == then
    seen = [at for _, at in parts]
    assert seen == sorted(set(seen))  # each part in a pass of its own (a slice's worth each)
    assert yields == [first]  # once, before the second message
    assert reports == [2] and receiver.delivered == 2


async def test_a_pass_ends_at_the_first_message_applied_while_a_relay_has_input() -> None:
    """A slice of cheap messages (closed listeners, forgotten balancers) is many of them: a
    relay whose input arrived meanwhile waited for the whole slice, twice per request
    (request and response), in a 10,000-port swap. With ``busy`` the pass ends after the
    message at hand."""
    loop = asyncio.get_running_loop()
    applied: list[int] = []
    seen: list[int] = []
    done = asyncio.Event()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    relay, client = socket.socketpair()
    poller = poller_for(loop)

    class Relay:
        def event(self, mask: int) -> None:
            seen.append(len(applied))
            relay.recv(100)

    def on_message(message: object, sock: socket.socket | None) -> None:
        applied.append(1)
        if len(applied) == 3:
            client.send(b"request")  # a relay's input, while the bulk is applied
        if len(applied) == MESSAGES_PER_PACKET:
            done.set()

    poller.register(relay.fileno(), Relay(), READ_EVENTS)
    sender = Channel(ours, on_message=lambda m, s: None, on_closed=lambda: None)
    receiver = Channel(theirs, on_message=on_message, on_closed=done.set, busy=io_waiting(loop))
    try:
        for i in range(MESSAGES_PER_PACKET):  # one packet: a slice would apply most of it
            sender.send(_forget(i))
        await asyncio.wait_for(done.wait(), 10)
    finally:
        sender.close()
        receiver.close()
        poller.forget(relay.fileno())
        relay.close()
        client.close()
    assert seen == [3]  # the relay ran right after the message during which its input came


async def test_busy_is_not_asked_while_not_watched() -> None:
    """Until the proxy serves, a worker's passes do not ask ``busy`` after each message (a
    system call each, and nothing relays yet); from then on they do."""
    asked: list[int] = []
    applied = asyncio.Event()
    count = 0

    def on_message(message: object, sock: socket.socket | None) -> None:
        nonlocal count
        count += 1
        if count % MESSAGES_PER_PACKET == 0:
            applied.set()

    def busy() -> bool:
        asked.append(1)
        return False

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sender = Channel(ours, on_message=lambda m, s: None, on_closed=lambda: None)
    receiver = Channel(theirs, on_message=on_message, on_closed=lambda: None, busy=busy)
    receiver.slice_s = 1.0  # only busy() could end a pass early
    try:
        receiver.watch_busy = False
        for i in range(MESSAGES_PER_PACKET):
            sender.send(_forget(i))
        await asyncio.wait_for(applied.wait(), 10)
        assert asked == []
        applied.clear()
        receiver.watch_busy = True
        for i in range(MESSAGES_PER_PACKET):
            sender.send(_forget(i))
        await asyncio.wait_for(applied.wait(), 10)
        assert len(asked) >= MESSAGES_PER_PACKET
    finally:
        sender.close()
        receiver.close()


async def test_a_loop_that_stays_busy_still_gets_every_message_applied() -> None:
    """Input that nobody takes (a flood, a stuck socket) must not stop the data plane from
    following the control process: busy or not, the messages keep being applied."""
    applied: list[int] = []
    done = asyncio.Event()

    def on_message(message: object, sock: socket.socket | None) -> None:
        applied.append(1)
        if len(applied) == 2 * MESSAGES_PER_PACKET:
            done.set()

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sender = Channel(ours, on_message=lambda m, s: None, on_closed=lambda: None)
    receiver = Channel(theirs, on_message=on_message, on_closed=done.set, busy=lambda: True)
    try:
        for i in range(2 * MESSAGES_PER_PACKET):
            sender.send(_forget(i))
        await asyncio.wait_for(done.wait(), 10)
    finally:
        sender.close()
        receiver.close()
    assert len(applied) == 2 * MESSAGES_PER_PACKET


async def _apply(
    count: int, cost_s: float, monkeypatch: pytest.MonkeyPatch, slice_s: float = APPLY_SLICE_S
) -> list[int]:
    """Send ``count`` messages that each cost ``cost_s`` to apply, the receiver applying them
    in passes of ``slice_s``; at each CPU yield of the receiver, how many were applied."""
    applied: list[int] = []
    yields: list[int] = []
    done = asyncio.Event()
    monkeypatch.setattr(os, "sched_yield", lambda: yields.append(len(applied)))

    def on_message(message: object, sock: socket.socket | None) -> None:
        applied.append(1)
        _busy(cost_s)
        if len(applied) == count:
            done.set()

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sender = Channel(ours, on_message=lambda m, s: None, on_closed=lambda: None)
    receiver = Channel(theirs, on_message=on_message, on_closed=done.set)
    receiver.slice_s = slice_s
    try:
        for i in range(count):
            sender.send(_forget(i))
        await asyncio.wait_for(done.wait(), 10)
    finally:
        sender.close()
        receiver.close()
    assert len(applied) == count
    return yields


async def test_a_worker_busy_with_a_bulk_yields_the_cpu_between_slices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """To the scheduler a worker applying 10,000 ports is one task that never sleeps: it ran
    out its time slice (2-4.5 ms) while a woken client or backend waited on its CPU. Each
    pass that continues a bulk first yields the CPU; a change that fits one pass never does."""
    yields = await _apply(MESSAGES_PER_PACKET * 2, SLOW_S, monkeypatch)
    slice_messages = int(APPLY_SLICE_S / SLOW_S) + 1
    assert len(yields) >= 2 * MESSAGES_PER_PACKET // slice_messages - 2, yields
    assert yields == sorted(set(yields)) and yields[0] > 0  # between slices, never twice
    # A change that fits one pass: five cheap messages, in a pass long enough for them even
    # on a slow or busy machine (the first pass also decodes the packet; 0.05 ms was not).
    assert await _apply(5, 0, monkeypatch, slice_s=0.05) == []


async def test_a_worker_applies_long_passes_until_the_proxy_serves() -> None:
    """While the proxy starts nothing relays, and short passes only handed the CPU to the
    control process and back: a worker applies its first state in passes of
    ``APPLY_SLICE_STARTING_S``, and in short ones from the ``Configure`` that says the proxy
    serves (or from the start, for a worker that replaces one)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    worker = Worker(channel_fd=-1, index=0)
    worker.channel = channel = Channel(
        theirs, on_message=worker._on_message, on_closed=lambda: None
    )
    settings = DataplaneSettings(node_name="node")
    try:
        assert APPLY_SLICE_STARTING_S > APPLY_SLICE_S
        worker._on_message(Configure(settings), None)
        assert channel.slice_s == APPLY_SLICE_STARTING_S
        # Nor does a pass look for a relay's input after each message (a system call each).
        watched = [channel.watch_busy]
        worker._on_message(Configure(settings, serving=True), None)
        assert channel.slice_s == APPLY_SLICE_S
        watched.append(channel.watch_busy)
        assert watched == [False, True]
        assert worker.config == Configure(settings, serving=True)
    finally:
        channel.close()
        ours.close()


async def test_sockets_not_yet_applied_are_closed_with_the_channel() -> None:
    """Listening sockets that arrived but wait for their turn belong to the channel: a
    channel closed mid-bulk (its worker stops) closes them, it does not leak them."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    got: list[socket.socket | None] = []
    closed = asyncio.Event()
    receiver: Channel | None = None

    def on_message(message: object, sock: socket.socket | None) -> None:
        got.append(sock)
        assert receiver is not None
        receiver.close()  # the rest of the packet stays unapplied
        closed.set()

    sender = Channel(ours, on_message=lambda m, s: None, on_closed=lambda: None)
    before = len(os.listdir("/proc/self/fd"))
    receiver = Channel(theirs, on_message=on_message, on_closed=closed.set)
    ports = []
    for i in range(SOCKETS):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        ports.append(sock.getsockname()[1])
        name = ServicePortName("ns", f"svc{i}", "p", Protocol.TCP)
        sender.send(OpenListener(name, Traffic.CLUSTER, IPFamily.V4), sock.detach())
    try:
        await asyncio.wait_for(closed.wait(), 10)
    finally:
        sender.close()
    assert len(got) == 1 and got[0] is not None
    got[0].close()
    # Every other socket is closed: the ports are free again, and no fd is left over.
    assert len(os.listdir("/proc/self/fd")) <= before - 1  # the receiver's own end is gone
    for port in ports:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port))


async def test_lent_sockets_reach_their_own_listeners_though_one_closed_before_it_went_out() -> (
    None
):
    """A lent socket is copied as its packet goes out (``Channel.lend``), and one closed by
    then goes without a copy. The other end gives a packet's sockets to its OpenListeners in
    order: one that came without its socket must not leave the next one's socket to it (a
    worker would serve a port on another service's socket)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    got: list[tuple[OpenListener, socket.socket | None]] = []
    done = asyncio.Event()

    def on_message(message: Message, sock: socket.socket | None) -> None:
        assert isinstance(message, OpenListener)
        got.append((message, sock))
        if len(got) == 4:
            done.set()

    sender = Channel(ours, on_message=lambda m, s: None, on_closed=lambda: None)
    receiver = Channel(theirs, on_message=on_message, on_closed=done.set)
    lent = []
    before = len(os.listdir("/proc/self/fd"))
    for i in range(4):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        lent.append(sock)
        name = ServicePortName("ns", f"svc{i}", "p", Protocol.TCP)
        sender.lend(OpenListener(name, Traffic.CLUSTER, IPFamily.V4), sock)
    ports = [sock.getsockname()[1] for sock in lent]
    lent[1].close()  # its listener closed before the channel sent anything
    try:
        await asyncio.wait_for(done.wait(), 10)
    finally:
        sender.close()
        receiver.close()
    assert [m.name.name for m, _ in got] == ["svc0", "svc1", "svc2", "svc3"]
    assert got[1][1] is None
    for i in (0, 2, 3):
        copy = got[i][1]
        assert copy is not None and copy.getsockname()[1] == ports[i], i
        copy.close()
    for i in (0, 2, 3):  # the lender's own sockets are still its own
        assert lent[i].fileno() >= 0
        lent[i].close()
    assert len(os.listdir("/proc/self/fd")) <= before - 2  # no copy left over, pair gone


def _big(name: str, endpoints: int) -> SetEndpoints:
    """A service port's endpoints, each on a node of its own (a DaemonSet's): ~43 pickled
    bytes an endpoint."""
    spn = ServicePortName("ns", name, "p", Protocol.TCP)
    eps = tuple(
        Endpoint(f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}", 8080, node_name=f"node-{i:05d}")
        for i in range(endpoints)
    )
    return SetEndpoints(spn, IPFamily.V4, ServicePort(spn, 80, ("10.96.0.1",)), eps)


async def _exchange(
    messages: list[tuple[Message, int | None]], *, send_buffer: int | None = None
) -> list[tuple[Message, socket.socket | None]]:
    """Send ``messages`` (with the fd of a socket to hand over, or None) from one channel to
    another over a fresh pair; what the other end handed over, in order. ``send_buffer``:
    the sender's SO_SNDBUF (a datagram larger than it cannot be sent)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    if send_buffer is not None:
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    got: list[tuple[Message, socket.socket | None]] = []
    done = asyncio.Event()
    lost: list[str] = []

    def on_message(message: Message, sock: socket.socket | None) -> None:
        got.append((message, sock))
        if len(got) == len(messages):
            done.set()

    def on_closed() -> None:
        lost.append("closed")
        done.set()

    sender = Channel(ours, on_message=lambda m, s: None, on_closed=on_closed)
    receiver = Channel(theirs, on_message=on_message, on_closed=on_closed)
    try:
        for message, fd in messages:
            sender.send(message, fd)
        await asyncio.wait_for(done.wait(), 30)
    finally:
        sender.close()
        receiver.close()
    assert not lost, f"the channel was lost after {len(got)} of {len(messages)} messages"
    return got


async def test_a_message_bigger_than_a_packet_goes_in_parts_and_arrives_whole() -> None:
    """One service port of 30,000 endpoints (1.3 MB, where a datagram must fit the sender's
    send buffer: 212,992 bytes by default) used to fail the send (EMSGSIZE): the channel was
    lost, its worker exited, and each replacement met the same message. It goes in pieces of
    endpoints now, each of them in parts under this small send buffer, between whole packets
    that keep their order and their sockets; the receiver hands it over whole, once."""
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    port = listening.getsockname()[1]
    name = ServicePortName("ns", "after", "p", Protocol.TCP)
    big = _big("big", 30_000)
    sent: list[tuple[Message, int | None]] = [
        (_big("small", 3), None),
        (big, None),
        (OpenListener(name, Traffic.CLUSTER, IPFamily.V4), listening.detach()),
        (_forget(1), None),
    ]
    # A small send buffer (the kernel doubles it): packets must fit it, parts too.
    got = await _exchange(sent, send_buffer=16_384)
    assert [m for m, _ in got] == [m for m, _ in sent]
    assert got[1][0] == big and len(big.endpoints) == 30_000
    sock = got[2][1]
    assert sock is not None
    with sock:
        assert sock.getsockname() == ("127.0.0.1", port)  # the very socket, still listening
        assert [s for _, s in got if s is not sock] == [None] * 3


async def test_a_packet_of_many_medium_messages_goes_in_parts() -> None:
    """40 service ports of 800 endpoints (34 kB each): a packet of MESSAGES_PER_PACKET of them
    is 690 kB, more than a datagram holds; every message arrives, in order."""
    sent: list[tuple[Message, int | None]] = [(_big(f"svc{i}", 800), None) for i in range(40)]
    got = await _exchange(sent)
    assert [m for m, _ in got] == [m for m, _ in sent]


def _keep(into: list[Message], message: Message, sock: socket.socket | None) -> None:
    into.append(message)


async def test_parts_out_of_order_lose_the_channel_and_close_their_sockets() -> None:
    """The receiver takes parts only in a row, without sockets before the last: anything
    else is a broken channel (one line, the channel closed, every socket it brought closed)."""
    for packets in (
        [Part(b"x" * 10, last=False), [_forget(1)]],  # a whole packet inside a message's parts
        [Part(b"x" * 10, last=False)],  # a part before the last, with a socket
    ):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        closed = asyncio.Event()
        got: list[Message] = []
        before = len(os.listdir("/proc/self/fd"))
        receiver = Channel(theirs, on_message=functools.partial(_keep, got), on_closed=closed.set)
        with socket.socket() as passed:
            for packet in packets:
                data = pickle.dumps(packet, protocol=pickle.HIGHEST_PROTOCOL)
                socket.send_fds(ours, [data], [passed.fileno()] if len(packets) == 1 else [])
        try:
            await asyncio.wait_for(closed.wait(), 10)
        finally:
            receiver.close()
            ours.close()
        assert receiver.closed and got == []
        assert len(os.listdir("/proc/self/fd")) <= before - 1, packets  # its end, no copy left


async def test_a_big_service_ports_endpoints_go_a_bounded_number_to_a_packet() -> None:
    """A worker decodes a packet whole, between two slices of its relays: no packet holds
    more than ENDPOINTS_PER_PACKET endpoints (0.65 ms to decode), however many one service
    port has. Read off the wire: pieces ahead, then the SetEndpoints with the last ones,
    which put together are the endpoints sent, in order."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    theirs.setblocking(False)
    sender = Channel(ours, on_message=lambda m, s: None, on_closed=lambda: None)
    big = _big("big", 5 * ENDPOINTS_PER_PACKET + 123)
    small = [_big(f"small{i}", ENDPOINTS_PER_PACKET * 4 // 5) for i in range(4)]
    for message in (small[0], big, *small[1:]):
        sender.send(message)
    packets: list[list[Any]] = []
    deadline = time.monotonic() + 10
    try:
        while sum(len(p) for p in packets) < 5 + 5:  # 5 pieces ahead, 5 SetEndpoints
            assert time.monotonic() < deadline, packets
            await asyncio.sleep(0.01)
            while True:
                try:
                    packets.append(pickle.loads(theirs.recv(PACKET_BYTES)))
                except BlockingIOError:
                    break
    finally:
        sender.close()
        theirs.close()
    sizes = [sum(len(m.endpoints) for m in p) for p in packets]
    assert max(sizes) <= ENDPOINTS_PER_PACKET, sizes
    flat = [m for p in packets for m in p]
    assert flat[0] == small[0] and flat[-3:] == small[1:]
    pieces = flat[1:-3]
    assert [type(m) for m in pieces] == [EndpointsAhead] * 5 + [SetEndpoints]
    assert tuple(e for m in pieces for e in m.endpoints) == big.endpoints
    assert pieces[-1].port == big.port
