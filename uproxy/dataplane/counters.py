"""A worker's data-plane numbers in shared memory, so the control process can add them up.

Each worker writes its counters and gauges into an array of float64 slots in a memfd that
the control process created and keeps mapped. Nothing is sent per event and nothing is lost
when a worker dies: whatever it counted up to its last instruction is in the array, which
the control process reads at every scrape and, when the worker is gone, folds into the
totals of the dead (``Retired``). /metrics then adds up every worker exactly, including
those that were replaced.

Which slot means what is written next to the values: a directory, an append-only log of
``slot, family, label values`` records in a second memfd. The worker appends a record
when it first binds a label set (once per listener and label set, never per event), and a
``slot`` record alone when it forgets one (its service was deleted), then publishes it by
advancing the header's record count (one aligned 8-byte store: the control
process never sees a half-written record). Only the worker writes; the control process only
reads, so nothing needs a lock.

Both memfds are sparse: the capacity (a million slots, 64 MiB of directory) costs address
space, and memory only for the pages written (about 8 bytes and 100 bytes per label set).
The directory has two halves: the log grows in the current one, and once that has grown
well past what is still bound (services deleted), the worker writes what is bound into the
other half and makes it current (``SlotWriter.compact``); a forgotten slot is handed out
again once nothing counts into it. A worker's counters are then the size of what it serves,
however many services came and went. That rewrite goes in steps of a couple of milliseconds
between the loop's other work: at 10,000 service ports it is 70,000 records, ~50 ms in one
go, which every relay of the worker would have waited out.

The directory's header counts rewrites twice over, as a sequence lock does: ``header // 2``
is the current half's epoch (its parity says which half), and the header is odd while the
other half is being rewritten, so a reader can tell when the half it read may have been
written under it.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import struct
import sys
import time
from collections.abc import Callable, Iterable, Iterator, MutableSequence
from dataclasses import dataclass
from typing import cast

SLOTS = 1 << 20  # label sets one worker can bind (70,000 at 10,000 service ports)
DIRECTORY_BYTES = 64 << 20
_EPOCH = struct.Struct("=Q")  # the directory's header: 2 x the current epoch, +1 mid-rewrite
_HALF_HEADER = struct.Struct("=QQ")  # a half's: records published, bytes used after it
_RECORD_LEN = struct.Struct("=I")
_SEP = "\x1f"
# A half is rewritten (``compact``) once it holds this many times the bytes of the label
# sets bound at the last rewrite (and at least COMPACT_MIN_BYTES): the pages a half ever
# used stay resident, so the directory stays within a few times what is live.
COMPACT_GROWTH = 4
COMPACT_MIN_BYTES = 256 << 10
# A rewrite under a running loop writes for this long at a time, then lets the loop run.
REWRITE_STEP_S = 0.002
_REWRITE_CLOCK_EVERY = 256  # records between two looks at the clock (~0.2 ms of writing)

Labels = tuple[str, ...]
# What a worker has bound and not forgotten: (slot, family, label values), for a rewrite.
# Iterated in steps with the loop running in between, so its iteration must survive label
# sets bound and forgotten meanwhile (``series._live_bindings`` copies each family's as it
# reaches it); whatever changes after the rewrite began is written again after it.
Live = Callable[[], Iterable[tuple[int, str, Labels]]]


@dataclass(frozen=True, slots=True)
class CounterFiles:
    """The two memfds of one worker: slot values and the directory that names them."""

    values_fd: int
    directory_fd: int

    @classmethod
    def create(cls, directory_bytes: int = DIRECTORY_BYTES) -> CounterFiles:
        made: list[int] = []
        try:  # out of fds (a worker's replacement, retried): none of them left open
            made.append(os.memfd_create("uproxy-counters"))
            made.append(os.memfd_create("uproxy-counter-names"))
            os.ftruncate(made[0], SLOTS * 8)
            os.ftruncate(made[1], directory_bytes)
        except OSError:
            for fd in made:
                os.close(fd)
            raise
        return cls(*made)

    def close(self) -> None:
        for fd in (self.values_fd, self.directory_fd):
            os.close(fd)


class CountersFull(Exception):
    """No slot or directory space left: the caller counts in process memory instead."""


class _Rewrite:
    """A rewrite of the directory into its other half, under way."""

    __slots__ = ("epoch", "pending", "records", "tail", "used")

    def __init__(self, epoch: int, live: Iterable[tuple[int, str, Labels]]) -> None:
        self.epoch = epoch  # the epoch the other half will have
        self.pending = iter(live)  # what was bound when it began, not yet written
        self.tail: list[bytes] = []  # the records appended since it began, in order
        self.records = 0
        self.used = 0


def _halves(fd: int) -> tuple[int, int]:
    """The directory's size and the size of each of its two halves."""
    size = os.fstat(fd).st_size
    return size, (size - _EPOCH.size) // 2


class SlotWriter:
    """The worker's side: hands out slots and names them in the directory.

    A service deleted and created again and again (a cluster whose namespaces come and go)
    must not grow the worker or the control process for good: a slot whose label set was
    forgotten is handed out again once nothing counts into it any more (``release``), and
    the directory, an append-only log, is rewritten with only what is bound (``compact``)
    into its other half once the current one has grown well past that. Before either, a
    worker grew by 2.9 KB and the control process by 1.2 KB per port created and deleted,
    and after ~150,000 of them new ports were counted nowhere.
    """

    def __init__(self, files: CounterFiles, live: Live | None = None) -> None:
        # float64 slots: ``buffer`` is the mapping (``series.SharedTally`` lays a ctypes
        # double over a slot of it), ``values`` a view that reads and writes them by index.
        self.buffer = mmap.mmap(files.values_fd, SLOTS * 8)
        size, self._half = _halves(files.directory_fd)
        self._directory = mmap.mmap(files.directory_fd, size)
        self.values = cast(MutableSequence[float], memoryview(self.buffer).cast("d"))
        self.live = live  # what a rewrite keeps (``series.share`` sets it)
        self._slots = 0  # slots ever handed out: the next new one
        self._free: list[int] = []  # forgotten, and nothing counts into them any more
        self._forgotten: set[int] = set()  # forgotten; something may still count into them
        self._epoch = 0
        self._records = 0
        self._used = 0
        self._room = self._half - _HALF_HEADER.size  # record bytes a half holds
        self._compact_at = COMPACT_MIN_BYTES  # the current half's size that starts a rewrite
        self._rewrite: _Rewrite | None = None
        self.compactions = 0

    def new_slot(self, family: str, labels: Labels) -> int:
        """A slot at zero for one label set of ``family``; CountersFull when out."""
        if self._free:
            slot = self._free.pop()
            self.values[slot] = 0.0  # before the record that names it is published
        elif self._slots < SLOTS:
            slot = self._slots
            self._slots += 1
        else:
            raise CountersFull(f"all {SLOTS} counter slots are in use")
        # Unit separators rather than JSON: 70,000 records at 10,000 service ports, where
        # json.dumps was 10 % of a worker's start. Names and label values never hold \x1f.
        try:
            self._append(_SEP.join((str(slot), family, *labels)))
        except CountersFull:
            self._free.append(slot)
            raise
        return slot

    def forget_slot(self, slot: int) -> None:
        """The label set is gone (its service was deleted): the control process stops
        reporting it. The slot is handed out again only once ``release``d: connections
        still draining may add to it meanwhile."""
        self._forgotten.add(slot)
        try:
            self._append(str(slot))
        except CountersFull:
            pass  # the series stays visible until the next rewrite; nothing is miscounted

    def release(self, slot: int) -> None:
        """Nothing counts into ``slot`` any more (its tally is gone): free, if forgotten."""
        if slot in self._forgotten:
            self._forgotten.discard(slot)
            self._free.append(slot)

    def _append(self, text: str) -> None:
        record = text.encode()
        size = _RECORD_LEN.size + len(record)
        if self._used + size > self._room:
            self.compact()  # the current half is full: the rewrite now, whole
            if self._used + size > self._room:
                raise CountersFull(f"{self._half} bytes of counter names are in use")
        elif self._used + size > self._compact_at and self._rewrite is None:
            self._begin_rewrite()
        self._used = self._put(self._epoch, self._used, record)
        self._records += 1
        self._publish(self._epoch, self._records, self._used)
        if self._rewrite is not None:
            self._rewrite.tail.append(record)  # the other half gets it too, at the end

    def _base(self, epoch: int) -> int:
        return _EPOCH.size + (epoch % 2) * self._half

    def _put(self, epoch: int, used: int, record: bytes) -> int:
        """Write ``record`` after the first ``used`` record bytes of ``epoch``'s half; the
        bytes used after it. CountersFull when the half has no room for it."""
        end = used + _RECORD_LEN.size + len(record)
        if end > self._room:
            raise CountersFull("the label sets bound do not fit half the directory")
        start = self._base(epoch) + _HALF_HEADER.size + used
        self._directory[start : start + _RECORD_LEN.size] = _RECORD_LEN.pack(len(record))
        self._directory[start + _RECORD_LEN.size : start + end - used] = record
        return end

    def _publish(self, epoch: int, records: int, used: int) -> None:
        # The reader trusts the records the count covers, written before it.
        at = self._base(epoch)
        self._directory[at : at + _HALF_HEADER.size] = _HALF_HEADER.pack(records, used)

    def _set_header(self, rewriting: bool) -> None:
        self._directory[: _EPOCH.size] = _EPOCH.pack(2 * self._epoch + rewriting)

    def _begin_rewrite(self) -> None:
        """Start a rewrite: in steps on the running loop (a worker), or whole without one."""
        if self.live is None:
            self._compact_at = self._room
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.compact()
            return
        loop.call_soon(self._step, self._rewriting())

    def _rewriting(self) -> _Rewrite:
        """The rewrite under way, or a new one (``live`` is set)."""
        if self._rewrite is None:
            assert self.live is not None
            self._rewrite = _Rewrite(self._epoch + 1, self.live())
            self._set_header(rewriting=True)
        return self._rewrite

    def _step(self, rewrite: _Rewrite) -> None:
        if rewrite is not self._rewrite:
            return  # finished (or given up) by ``compact`` meanwhile
        try:
            if not self._write_pending(rewrite, time.perf_counter() + REWRITE_STEP_S):
                asyncio.get_running_loop().call_soon(self._step, rewrite)
                return
            self._finish(rewrite)
        except CountersFull:
            self._give_up()

    def compact(self) -> None:
        """Write what is bound into the other half, then make that one current (one aligned
        8-byte store), now: a rewrite under way is finished. Without ``live``, or when what
        is live does not fit, nothing changes: the current half fills up, then new label
        sets are counted in process only."""
        if self.live is None:
            self._compact_at = self._room
            return
        rewrite = self._rewriting()
        try:
            self._write_pending(rewrite, None)
            self._finish(rewrite)
        except CountersFull:
            self._give_up()

    def _write_pending(self, rewrite: _Rewrite, deadline: float | None) -> bool:
        """Write what was bound when ``rewrite`` began, until ``deadline``: whether all is."""
        for written, (slot, family, labels) in enumerate(rewrite.pending, 1):
            record = _SEP.join((str(slot), family, *labels)).encode()
            rewrite.used = self._put(rewrite.epoch, rewrite.used, record)
            rewrite.records += 1
            if (
                deadline is not None
                and written % _REWRITE_CLOCK_EVERY == 0
                and time.perf_counter() >= deadline
            ):
                return False
        return True

    def _finish(self, rewrite: _Rewrite) -> None:
        for record in rewrite.tail:  # bound or forgotten since it began, in that order
            rewrite.used = self._put(rewrite.epoch, rewrite.used, record)
            rewrite.records += 1
        self._rewrite = None
        self._epoch, self._records, self._used = rewrite.epoch, rewrite.records, rewrite.used
        self._publish(self._epoch, self._records, self._used)
        self._set_header(rewriting=False)
        # Slots forgotten before the rewrite are in no record now; those still counted into
        # stay out of the free list until released.
        self._compact_at = max(COMPACT_MIN_BYTES, COMPACT_GROWTH * self._used)
        self.compactions += 1

    def _give_up(self) -> None:
        """What is bound does not fit half the directory: the current half stays, fills up,
        then new label sets are counted in process only."""
        self._rewrite = None
        self._set_header(rewriting=False)
        self._compact_at = self._room


class SlotReader:
    """The control process's side, one per worker: what its slots are and hold."""

    def __init__(self, files: CounterFiles) -> None:
        self._values_map = mmap.mmap(files.values_fd, SLOTS * 8, prot=mmap.PROT_READ)
        size, self._half = _halves(files.directory_fd)
        self._directory = mmap.mmap(files.directory_fd, size, prot=mmap.PROT_READ)
        self._view = memoryview(self._values_map).cast("d")
        self._values = cast(MutableSequence[float], self._view)
        # Per slot, its family (None: forgotten) and its label values. The control process
        # keeps 40,000 of them per worker at 10,000 service ports for as long as it runs:
        # interned strings (a service's name is in up to four label sets) and two lists
        # rather than a pair per slot; decoded afresh, they were 12 MiB of its heap.
        self._families: list[str | None] = []
        self._labels: list[Labels] = []
        # After a rewrite (``SlotWriter.compact``): the new half read into lists of their
        # own, served once caught up; the old ones serve meanwhile (a slot keeps its label
        # set across a rewrite, so they stay right for every slot they name).
        self._building: tuple[list[str | None], list[Labels]] | None = None
        self._epoch = 0
        self._records = 0
        self._offset = 0

    def refresh(self, limit: int | None = None) -> bool:
        """Learn the label sets bound (and forgotten) since the last call: at most ``limit``
        records of them; whether it caught up (a first read at 10,000 ports is 40,000)."""
        epoch = _EPOCH.unpack_from(self._directory, 0)[0] // 2
        if epoch != self._epoch:
            self._epoch, self._records, self._offset = epoch, 0, 0
            self._building = ([], [])
        base = _EPOCH.size + (epoch % 2) * self._half
        families, labels = self._building or (self._families, self._labels)
        total, end = _HALF_HEADER.unpack_from(self._directory, base)
        count = total if limit is None else min(total, self._records + limit)
        try:
            while self._records < count and self._offset < end:
                at = base + _HALF_HEADER.size + self._offset
                (length,) = _RECORD_LEN.unpack_from(self._directory, at)
                raw = self._directory[at + _RECORD_LEN.size : at + _RECORD_LEN.size + length]
                text, *rest = raw.decode().split(_SEP)
                slot = int(text)
                if slot >= len(families):  # a new slot (after a rewrite: any order)
                    families.extend([None] * (slot + 1 - len(families)))
                    labels.extend([()] * (slot + 1 - len(labels)))
                if rest:
                    family, *names = map(sys.intern, rest)
                    families[slot], labels[slot] = family, tuple(names)
                else:  # a forgotten label set: its labels go too (a service churned)
                    families[slot], labels[slot] = None, ()
                self._records += 1
                self._offset += _RECORD_LEN.size + length
        except (ValueError, IndexError, struct.error):
            if not self._overwritten(epoch):
                raise
            self._epoch = -1  # a half rewritten under this read: start over
            return False
        if self._overwritten(epoch):
            self._epoch = -1  # the half was being rewritten while read: start over
            return False
        caught_up: bool = self._records >= total or self._offset >= end
        if caught_up and self._building is not None:
            self._families, self._labels = self._building
            self._building = None
        return caught_up

    def _overwritten(self, epoch: int) -> bool:
        """Whether the half of ``epoch`` may have been written since it was current: a
        rewrite into it (to ``epoch + 2``) has begun."""
        return bool(_EPOCH.unpack_from(self._directory, 0)[0] >= 2 * epoch + 3)

    def items(self) -> Iterator[tuple[str, Labels, float]]:
        """Every named slot that is not forgotten: (family, label values, value)."""
        values, labels = self._values, self._labels
        for slot, family in enumerate(self._families):
            if family is not None:
                yield family, labels[slot], values[slot]

    def close(self) -> None:
        self._view.release()
        self._values_map.close()
        self._directory.close()
