"""Big structures let go of a slice at a time (``release.Release``): nothing is freed in the
call that hands them over, each later pass frees at most a slice's worth, and in the end
everything is freed, whatever the kind of container. Sockets handed over are closed the
same way."""

from __future__ import annotations

import asyncio
import gc
import socket
import weakref

from tests.dataplane.conftest import wait_until
from uproxy.dataplane.poller import read_poller_for
from uproxy.dataplane.release import CHUNK, CLOSE_CHUNK, SMALL, Release, release_for


class Item:
    """An element whose freeing can be seen (a weak reference to it dies)."""

    __slots__ = ("__weakref__", "n")

    def __init__(self, n: int) -> None:
        self.n = n


def _items(count: int) -> list[Item]:
    return [Item(n) for n in range(count)]


async def test_every_kind_of_container_is_emptied_over_later_passes() -> None:
    gc.collect()
    release = Release(asyncio.get_running_loop(), slice_s=0.0)  # one chunk a pass
    listed, keyed, tupled, setted, small = (_items(n) for n in (1000, 700, 600, 500, 10))
    watched = [
        weakref.ref(item) for group in (listed, keyed, tupled, setted, small) for item in group
    ]
    as_dict = {item.n: item for item in keyed}
    held: list[object] = [listed, as_dict, tuple(tupled), frozenset(setted), small, "other"]
    del keyed, tupled, setted, small
    release.later(held)
    del held
    # Nothing freed yet but what is small: the list and dict handed over are the same objects.
    assert release.pending == 1000 + 700 + 600 + 500
    assert sum(ref() is not None for ref in watched) == 1000 + 700 + 600 + 500
    listed_ref = listed  # the caller's list is emptied in place
    del listed
    await wait_until(lambda: release.pending == 0, what="all freed")
    assert all(ref() is None for ref in watched)
    assert listed_ref == [] and as_dict == {}
    assert release.freed == 2800
    # One chunk a pass: a pass never freed more than CHUNK, so it took at least this many.
    assert release.passes >= sum(-(-n // CHUNK) for n in (1000, 700, 600, 500))


async def test_a_pass_stops_after_the_chunk_at_hand_when_a_relay_waits() -> None:
    loop = asyncio.get_running_loop()
    waited = Release(loop, busy=lambda: True, slice_s=1.0)
    idle = Release(loop, busy=lambda: False, slice_s=1.0)
    waited.later([_items(10 * CHUNK)])
    idle.later([_items(10 * CHUNK)])
    await wait_until(lambda: waited.pending == idle.pending == 0, what="all freed")
    assert waited.passes == 10  # a chunk a pass, despite the long slice
    assert idle.passes == 1


async def test_small_containers_go_at_once_and_take_no_pass() -> None:
    release = Release(asyncio.get_running_loop())
    item = _items(1)[0]
    ref = weakref.ref(item)
    small = [item] * SMALL
    release.later([small, tuple(small)])
    del item, small
    assert ref() is None and release.pending == 0
    await asyncio.sleep(0)
    assert release.passes == 0


def _udp_sockets(count: int) -> list[socket.socket]:
    return [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(count)]


async def test_sockets_are_closed_over_later_passes_a_chunk_at_a_time() -> None:
    release = Release(asyncio.get_running_loop(), slice_s=0.0)  # one chunk a pass
    socks = _udp_sockets(10 * CLOSE_CHUNK + 3)
    release.close_later(socks)
    assert release.closing == len(socks)
    assert all(s.fileno() >= 0 for s in socks)  # none closed in the call
    passes = 0
    while release.closing:
        await asyncio.sleep(0)
        passes += 1
        open_now = sum(s.fileno() >= 0 for s in socks)
        assert open_now == release.closing >= len(socks) - passes * CLOSE_CHUNK
        assert passes <= 20, "bounded"
    assert all(s.fileno() < 0 for s in socks) and release.closed == len(socks)
    assert release.passes == 11


async def test_a_few_sockets_are_closed_at_once_and_close_now_closes_the_rest() -> None:
    release = Release(asyncio.get_running_loop())
    few = _udp_sockets(CLOSE_CHUNK)
    release.close_later(few)
    assert all(s.fileno() < 0 for s in few) and release.closing == 0
    many = _udp_sockets(CLOSE_CHUNK + 1)
    release.close_later(many)
    release.later([_items(SMALL + 1)])
    assert release.closing == len(many) and release.pending == SMALL + 1
    release.close_now()  # the loop goes: nothing is left open
    assert all(s.fileno() < 0 for s in many)
    assert release.closing == 0 and release.pending == 0


async def test_each_loop_has_one_release_cut_short_by_waiting_input() -> None:
    loop = asyncio.get_running_loop()
    release = release_for(loop)
    assert release_for(loop) is release
    r, w = socket.socketpair()
    try:
        read_poller_for(loop).watch(r.fileno(), _Drain(r))
        socks = _udp_sockets(4 * CLOSE_CHUNK)
        release.slice_s = 1.0  # only waiting input ends a pass early
        w.send(b"x")
        release.close_later(socks)
        await asyncio.sleep(0)
        assert release.closing == 3 * CLOSE_CHUNK  # one chunk, then it saw the input
        await wait_until(lambda: release.closing == 0, what="all closed")
    finally:
        read_poller_for(loop).unwatch(r.fileno())
        r.close()
        w.close()


class _Drain:
    """A reader that leaves its input waiting (level-triggered: reported on every pass)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def readable(self) -> None:
        pass
