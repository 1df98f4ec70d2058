"""Keeping the cyclic garbage collector off the relaying loop's back.

The collector's full pass visits every tracked object: at 10,000 services that is 258-343 ms
per pass once running, and during a cold start, when the heap grows from nothing to 200 MB,
its growth trigger fired again and again (passes of 90-390 ms measured, one relay stall
each). Nearly everything the control plane allocates in bulk (a listing's state, a big
sync's listeners and balancers) lives as long as its service, so the collector gains nothing
by scanning it.

``bulk()`` wraps such work: the collector is off inside it (nested or interleaved bulks
share one switch), and at the end everything allocated so far is frozen (``gc.freeze``,
O(1)): moved to a generation the collector never scans. Later passes then see only what
was allocated since, mostly per-connection objects, and stay in the milliseconds. The price:
cyclic garbage that exists at a freeze is never reclaimed. The control plane's objects are
acyclic by design (the data plane breaks its cycles by hand, see ``dataplane/relay.py``), so
this is small and bounded by the number of bulk operations.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

# Below this many objects handled, bulk work is not worth the bookkeeping.
BULK_MIN = 1000

_depth = 0


@contextmanager
def bulk(items: int) -> Iterator[None]:
    """Collector off while ``items`` long-lived objects are made; frozen afterwards."""
    if items < BULK_MIN:
        yield
        return
    pause()
    try:
        yield
    finally:
        resume()


def pause() -> None:
    """Collector off (for bulk work whose size is not known up front); pair with resume()."""
    global _depth
    if _depth == 0:
        gc.disable()
    _depth += 1


def resume() -> None:
    """End of a bulk: freeze what it made; the collector is back on once no bulk is left."""
    global _depth
    _depth -= 1
    gc.freeze()
    if _depth == 0:
        gc.enable()
