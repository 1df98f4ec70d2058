"""The collector's switch for bulk work (``uproxy.heap``): nested and interleaved bulks."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from uproxy import heap


@pytest.fixture(autouse=True)
def collector_restored() -> Iterator[None]:
    assert heap._depth == 0 and gc.isenabled()
    yield
    while heap._depth:
        heap.resume(freeze=False)
    gc.enable()


def test_the_collector_comes_back_only_when_the_last_bulk_ends() -> None:
    # The start of the proxy is one bulk and each first listing another; the start may end
    # first, and must not turn the collector on under the listings.
    heap.pause()  # the start
    heap.pause()  # a listing
    heap.resume()  # the start is done
    assert not gc.isenabled()
    heap.resume()  # the listing is done
    assert gc.isenabled() and heap._depth == 0


def test_a_bulk_freezes_what_it_made_and_a_small_one_does_not() -> None:
    before = gc.get_freeze_count()
    heap.pause()
    made = [[i] for i in range(5000)]
    heap.resume()
    assert gc.get_freeze_count() >= before + len(made)
    after = gc.get_freeze_count()
    heap.pause()
    more = [[i] for i in range(5000)]
    heap.resume(freeze=False)
    assert gc.get_freeze_count() <= after and len(more) == 5000


def test_bulk_below_the_threshold_leaves_the_collector_on() -> None:
    with heap.bulk(heap.BULK_MIN - 1):
        assert gc.isenabled()
    with heap.bulk(heap.BULK_MIN):
        assert not gc.isenabled()
    assert gc.isenabled()
