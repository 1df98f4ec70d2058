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
however many services came and went.
"""

from __future__ import annotations

import mmap
import os
import struct
import sys
from collections.abc import Callable, Iterable, Iterator, MutableSequence
from dataclasses import dataclass
from typing import cast

SLOTS = 1 << 20  # label sets one worker can bind (70,000 at 10,000 service ports)
DIRECTORY_BYTES = 64 << 20
_EPOCH = struct.Struct("=Q")  # the directory's header: which half is current (its parity)
_HALF_HEADER = struct.Struct("=QQ")  # a half's: records published, bytes used after it
_RECORD_LEN = struct.Struct("=I")
_SEP = "\x1f"
# A half is rewritten (``compact``) once it holds this many times the bytes of the label
# sets bound at the last rewrite (and at least COMPACT_MIN_BYTES): the pages a half ever
# used stay resident, so the directory stays within a few times what is live.
COMPACT_GROWTH = 4
COMPACT_MIN_BYTES = 256 << 10

Labels = tuple[str, ...]
# What a worker has bound and not forgotten: (slot, family, label values), for a rewrite.
Live = Callable[[], Iterable[tuple[int, str, Labels]]]


@dataclass(frozen=True, slots=True)
class CounterFiles:
    """The two memfds of one worker: slot values and the directory that names them."""

    values_fd: int
    directory_fd: int

    @classmethod
    def create(cls, directory_bytes: int = DIRECTORY_BYTES) -> CounterFiles:
        values = os.memfd_create("uproxy-counters")
        directory = os.memfd_create("uproxy-counter-names")
        os.ftruncate(values, SLOTS * 8)
        os.ftruncate(directory, directory_bytes)
        return cls(values, directory)

    def close(self) -> None:
        for fd in (self.values_fd, self.directory_fd):
            os.close(fd)


class CountersFull(Exception):
    """No slot or directory space left: the caller counts in process memory instead."""


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
        self._compact_at = COMPACT_MIN_BYTES  # the current half's size that starts a rewrite
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
        if self._used + size > min(self._half - _HALF_HEADER.size, self._compact_at):
            self.compact()
            if self._used + size > self._half - _HALF_HEADER.size:
                raise CountersFull(f"{self._half} bytes of counter names are in use")
        self._write(self._epoch, record)
        self._publish(self._epoch)

    def _base(self, epoch: int) -> int:
        return _EPOCH.size + (epoch % 2) * self._half

    def _write(self, epoch: int, record: bytes) -> None:
        start = self._base(epoch) + _HALF_HEADER.size + self._used
        end = start + _RECORD_LEN.size + len(record)
        self._directory[start : start + _RECORD_LEN.size] = _RECORD_LEN.pack(len(record))
        self._directory[start + _RECORD_LEN.size : end] = record
        self._used += _RECORD_LEN.size + len(record)
        self._records += 1

    def _publish(self, epoch: int) -> None:
        # The reader trusts the records the count covers, written before it.
        at = self._base(epoch)
        self._directory[at : at + _HALF_HEADER.size] = _HALF_HEADER.pack(self._records, self._used)

    def compact(self) -> None:
        """Write what is bound into the other half, then make that one current (one aligned
        8-byte store). Without ``live``, or when what is live does not fit, nothing changes:
        the current half fills up, then new label sets are counted in process only."""
        if self.live is None:
            self._compact_at = self._half
            return
        live = [_SEP.join((str(slot), family, *labels)) for slot, family, labels in self.live()]
        epoch, records, used = self._epoch, self._records, self._used
        self._epoch, self._records, self._used = epoch + 1, 0, 0
        try:
            for text in live:
                record = text.encode()
                if self._used + _RECORD_LEN.size + len(record) > self._half - _HALF_HEADER.size:
                    raise CountersFull("the label sets bound do not fit half the directory")
                self._write(self._epoch, record)
        except CountersFull:
            self._epoch, self._records, self._used = epoch, records, used
            self._compact_at = self._half
            return
        self._publish(self._epoch)
        self._directory[: _EPOCH.size] = _EPOCH.pack(self._epoch)
        # Slots forgotten before the rewrite are in no record now; those still counted into
        # stay out of the free list until released.
        self._compact_at = max(COMPACT_MIN_BYTES, COMPACT_GROWTH * self._used)
        self.compactions += 1


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
        (epoch,) = _EPOCH.unpack_from(self._directory, 0)
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
            # A half rewritten under this read (two rewrites since it began): start over.
            if _EPOCH.unpack_from(self._directory, 0)[0] == epoch:
                raise
            self._epoch = -1
            return False
        if _EPOCH.unpack_from(self._directory, 0)[0] - epoch >= 2:
            self._epoch = -1  # the half was rewritten again while being read: start over
            return False
        caught_up: bool = self._records >= total or self._offset >= end
        if caught_up and self._building is not None:
            self._families, self._labels = self._building
            self._building = None
        return caught_up

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
