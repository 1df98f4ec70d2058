"""Big structures let go of a slice at a time (``release.Release``): nothing is freed in the
call that hands them over, each later pass frees at most a slice's worth, and in the end
everything is freed, whatever the kind of container."""

from __future__ import annotations

import asyncio
import gc
import weakref

from tests.dataplane.conftest import wait_until
from uproxy.dataplane.release import CHUNK, SMALL, Release


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
