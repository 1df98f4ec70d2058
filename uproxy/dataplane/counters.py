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
"""

from __future__ import annotations

import mmap
import os
import struct
import sys
from collections.abc import Iterator, MutableSequence
from dataclasses import dataclass
from typing import cast

SLOTS = 1 << 20  # label sets one worker can bind (70,000 at 10,000 service ports)
DIRECTORY_BYTES = 64 << 20
_HEADER = struct.Struct("=QQ")  # records published, bytes used after the header
_RECORD_LEN = struct.Struct("=I")
_SEP = "\x1f"

Labels = tuple[str, ...]


@dataclass(frozen=True, slots=True)
class CounterFiles:
    """The two memfds of one worker: slot values and the directory that names them."""

    values_fd: int
    directory_fd: int

    @classmethod
    def create(cls) -> CounterFiles:
        values = os.memfd_create("uproxy-counters")
        directory = os.memfd_create("uproxy-counter-names")
        os.ftruncate(values, SLOTS * 8)
        os.ftruncate(directory, DIRECTORY_BYTES)
        return cls(values, directory)

    def close(self) -> None:
        for fd in (self.values_fd, self.directory_fd):
            os.close(fd)


class CountersFull(Exception):
    """No slot or directory space left: the caller counts in process memory instead."""


class SlotWriter:
    """The worker's side: hands out slots and names them in the directory."""

    def __init__(self, files: CounterFiles) -> None:
        # float64 slots: ``buffer`` is the mapping (``series.SharedTally`` lays a ctypes
        # double over a slot of it), ``values`` a view that reads and writes them by index.
        self.buffer = mmap.mmap(files.values_fd, SLOTS * 8)
        self._directory = mmap.mmap(files.directory_fd, DIRECTORY_BYTES)
        self.values = cast(MutableSequence[float], memoryview(self.buffer).cast("d"))
        self._slots = 0  # slots handed out
        self._records = 0
        self._used = 0

    def new_slot(self, family: str, labels: Labels) -> int:
        """A fresh slot (at zero) for one label set of ``family``; CountersFull when out."""
        slot = self._slots
        if slot >= SLOTS:
            raise CountersFull(f"all {SLOTS} counter slots are in use")
        # Unit separators rather than JSON: 70,000 records at 10,000 service ports, where
        # json.dumps was 10 % of a worker's start. Names and label values never hold \x1f.
        self._append(_SEP.join((str(slot), family, *labels)))
        self._slots += 1
        return slot

    def forget_slot(self, slot: int) -> None:
        """The label set is gone (its service was deleted): the control process stops
        reporting it. The slot is not handed out again: connections that are still draining
        may add to it."""
        try:
            self._append(str(slot))
        except CountersFull:
            pass  # the series stays visible; nothing is miscounted

    def _append(self, text: str) -> None:
        record = text.encode()
        start = _HEADER.size + self._used
        end = start + _RECORD_LEN.size + len(record)
        if end > DIRECTORY_BYTES:
            raise CountersFull(f"{DIRECTORY_BYTES} bytes of counter names are in use")
        self._directory[start : start + _RECORD_LEN.size] = _RECORD_LEN.pack(len(record))
        self._directory[start + _RECORD_LEN.size : end] = record
        self._used = end - _HEADER.size
        self._records += 1
        # Publish: the reader trusts the records the count covers, written above.
        self._directory[: _HEADER.size] = _HEADER.pack(self._records, self._used)


class SlotReader:
    """The control process's side, one per worker: what its slots are and hold."""

    def __init__(self, files: CounterFiles) -> None:
        self._values_map = mmap.mmap(files.values_fd, SLOTS * 8, prot=mmap.PROT_READ)
        self._directory = mmap.mmap(files.directory_fd, DIRECTORY_BYTES, prot=mmap.PROT_READ)
        self._view = memoryview(self._values_map).cast("d")
        self._values = cast(MutableSequence[float], self._view)
        # Per slot, its family (None: forgotten) and its label values. The control process
        # keeps 40,000 of them per worker at 10,000 service ports for as long as it runs:
        # interned strings (a service's name is in up to four label sets) and two lists
        # rather than a pair per slot; decoded afresh, they were 12 MiB of its heap.
        self._families: list[str | None] = []
        self._labels: list[Labels] = []
        self._records = 0
        self._offset = 0

    def refresh(self, limit: int | None = None) -> bool:
        """Learn the label sets bound (and forgotten) since the last call: at most ``limit``
        records of them; whether it caught up (a first read at 10,000 ports is 40,000)."""
        count, used = _HEADER.unpack_from(self._directory, 0)
        if limit is not None:
            count = min(count, self._records + limit)
        while self._records < count and self._offset < used:
            at = _HEADER.size + self._offset
            (length,) = _RECORD_LEN.unpack_from(self._directory, at)
            raw = self._directory[at + _RECORD_LEN.size : at + _RECORD_LEN.size + length]
            text, *rest = raw.decode().split(_SEP)
            slot = int(text)
            if not rest:  # a forgotten label set: its labels go too (a service churned)
                self._families[slot] = None
                self._labels[slot] = ()
            elif slot == len(self._families):
                family, *labels = map(sys.intern, rest)
                self._families.append(family)
                self._labels.append(tuple(labels))
            else:
                raise ValueError(f"counter directory out of order: slot {slot}")
            self._records += 1
            self._offset += _RECORD_LEN.size + length
        total, end = _HEADER.unpack_from(self._directory, 0)
        caught_up: bool = self._records >= total or self._offset >= end
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
