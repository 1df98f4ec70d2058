"""A worker's data-plane numbers in shared memory, so the control process can add them up.

Each worker writes its counters and gauges into an array of float64 slots in a memfd that
the control process created and keeps mapped. Nothing is sent per event and nothing is lost
when a worker dies: whatever it counted up to its last instruction is in the array, which
the control process reads at every scrape and, when the worker is gone, folds into the
totals of the dead (``Retired``). /metrics then adds up every worker exactly, including
those that were replaced.

Which slot means what is written next to the values: a directory, an append-only log of
``slot, family, label values`` records in a second memfd. The worker appends a record
when it first binds a label set (once per listener and label set, never per event), then
publishes it by advancing the header's record count (one aligned 8-byte store: the control
process never sees a half-written record). Only the worker writes; the control process only
reads, so nothing needs a lock.

Both memfds are sparse: the capacity (a million slots, 64 MiB of directory) costs address
space, and memory only for the pages written (about 8 bytes and 100 bytes per label set).
"""

from __future__ import annotations

import mmap
import os
import struct
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
        self._values_map = mmap.mmap(files.values_fd, SLOTS * 8)
        self._directory = mmap.mmap(files.directory_fd, DIRECTORY_BYTES)
        # float64 slots; a memoryview reads and writes Python floats by index.
        self.values = cast(MutableSequence[float], memoryview(self._values_map).cast("d"))
        self._count = 0
        self._used = 0

    def new_slot(self, family: str, labels: Labels) -> int:
        """A fresh slot (at zero) for one label set of ``family``; CountersFull when out."""
        slot = self._count
        # Unit separators rather than JSON: 70,000 records at 10,000 service ports, where
        # json.dumps was 10 % of a worker's start. Names and label values never hold \x1f.
        record = _SEP.join((str(slot), family, *labels)).encode()
        start = _HEADER.size + self._used
        end = start + _RECORD_LEN.size + len(record)
        if slot >= SLOTS or end > DIRECTORY_BYTES:
            raise CountersFull(f"{SLOTS} slots, {DIRECTORY_BYTES} bytes of names")
        self._directory[start : start + _RECORD_LEN.size] = _RECORD_LEN.pack(len(record))
        self._directory[start + _RECORD_LEN.size : end] = record
        self._used = end - _HEADER.size
        self._count += 1
        # Publish: the reader trusts the records the count covers, written above.
        self._directory[: _HEADER.size] = _HEADER.pack(self._count, self._used)
        return slot


class SlotReader:
    """The control process's side, one per worker: what its slots are and hold."""

    def __init__(self, files: CounterFiles) -> None:
        self._values_map = mmap.mmap(files.values_fd, SLOTS * 8, prot=mmap.PROT_READ)
        self._directory = mmap.mmap(files.directory_fd, DIRECTORY_BYTES, prot=mmap.PROT_READ)
        self._view = memoryview(self._values_map).cast("d")
        self._values = cast(MutableSequence[float], self._view)
        self._names: list[tuple[str, Labels]] = []
        self._offset = 0

    def refresh(self) -> None:
        """Learn the label sets bound since the last call."""
        count, used = _HEADER.unpack_from(self._directory, 0)
        while len(self._names) < count and self._offset < used:
            at = _HEADER.size + self._offset
            (length,) = _RECORD_LEN.unpack_from(self._directory, at)
            raw = self._directory[at + _RECORD_LEN.size : at + _RECORD_LEN.size + length]
            slot, family, *labels = raw.decode().split(_SEP)
            if int(slot) != len(self._names):
                raise ValueError(f"counter directory out of order: slot {slot}")
            self._names.append((family, tuple(labels)))
            self._offset += _RECORD_LEN.size + length

    def items(self) -> Iterator[tuple[str, Labels, float]]:
        """Every named slot: (family, label values, value)."""
        values = self._values
        for slot, (family, labels) in enumerate(self._names):
            yield family, labels, values[slot]

    def close(self) -> None:
        self._view.release()
        self._values_map.close()
        self._directory.close()
