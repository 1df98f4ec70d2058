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

At the end of the last bulk the C allocator is asked to give its free memory back to the
kernel (glibc's ``malloc_trim``, where there is one). A listing or a big sync frees most
of what it allocated on the way (pages of JSON, parsed documents, temporary lists), but
freed chunks between live ones stay resident until trimmed: at 10,000 services the control
process kept 5-9 MiB that way. A trim took ~1 ms there; it runs once per bulk, not per
object.
"""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager

# Below this many objects handled, bulk work is not worth the bookkeeping.
BULK_MIN = 1000

_depth = 0


def _find_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(None)  # the symbols already loaded: libc's among them
    except OSError:
        return None
    trim = getattr(libc, "malloc_trim", None)  # glibc only (musl has none)
    if trim is None:
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim  # type: ignore[no-any-return]


_malloc_trim = _find_trim()


def trim() -> None:
    """Return the C allocator's free memory to the kernel (a no-op without glibc)."""
    if _malloc_trim is not None:
        _malloc_trim(0)


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


def freeze() -> None:
    """Everything allocated so far lives as long as the process: out of the collector's sight.

    For the end of a process's start. A worker's modules, classes and functions are about
    21,000 tracked objects, and until a bulk change froze them (if one ever came), each full
    pass visited them all: 4.5-5.5 ms while its relays waited, in a worker with two services
    and UDP clients coming and going by the thousand (``python -m bench.udp_flows``).
    """
    gc.freeze()


def pause() -> None:
    """Collector off (for bulk work whose size is not known up front); pair with resume()."""
    global _depth
    if _depth == 0:
        gc.disable()
    _depth += 1


def resume(*, freeze: bool = True) -> None:
    """End of a bulk: freeze what it made; the collector is back on once no bulk is left.

    ``freeze=False`` ends a pause whose work turned out small (a reload that changed one
    document): what it made stays in the collector's sight, cyclic garbage included.
    """
    global _depth
    _depth -= 1
    if freeze:
        gc.freeze()
    if _depth == 0:
        gc.enable()
        if freeze:
            trim()
