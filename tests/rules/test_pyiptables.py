"""python-iptables backend plumbing: one worker thread, the xtables lock, EAGAIN retries."""

from __future__ import annotations

import asyncio
import fcntl
import os
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from uproxy.model import Protocol, ServicePortName
from uproxy.rules import pyiptables
from uproxy.rules.base import Portal, PortalKind, RulesError
from uproxy.rules.pyiptables import IptcBackend, _Worker, xtables_lock

PORTAL = Portal(
    ServicePortName("a", "b", "c", Protocol.TCP), PortalKind.CLUSTER_IP, "10.96.0.1", 80, 4000
)


@pytest.fixture
def lockfile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "xtables.lock"
    monkeypatch.setenv("XTABLES_LOCKFILE", str(path))
    return path


class FakeIPTCError(Exception):
    pass


class RecordingWorker:
    """Stands in for the libiptc worker: records the thread of every call."""

    threads: list[str] = []

    def __init__(self, family: Any = None) -> None:
        self.iptc = SimpleNamespace(IPTCError=FakeIPTCError)

    def sync(self, ruleset: Any, *, full: bool, watch: Any = None) -> None:
        self.threads.append(threading.current_thread().name)

    def cleanup(self) -> bool:
        self.threads.append(threading.current_thread().name)
        return False


async def test_every_call_runs_on_one_worker_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    RecordingWorker.threads = []
    monkeypatch.setattr(pyiptables, "_Worker", RecordingWorker)
    backend = IptcBackend(host_ip="10.0.0.1")
    for _ in range(3):
        await backend.sync([PORTAL])
    await backend.cleanup()
    await backend.close()
    assert len(RecordingWorker.threads) == 4  # three syncs and a cleanup (its one family)
    assert len(set(RecordingWorker.threads)) == 1
    assert RecordingWorker.threads[0].startswith("uproxy-iptc")
    assert threading.current_thread().name not in RecordingWorker.threads


class BlockedWorker(RecordingWorker):
    """A sync that waits, as one waiting for the xtables lock does."""

    release = threading.Event()
    entered = threading.Event()

    def sync(self, ruleset: Any, *, full: bool, watch: Any = None) -> None:
        self.entered.set()
        self.release.wait(10)


async def test_close_waits_for_a_cancelled_call_off_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stop cancels the sync whose call still runs in the thread (waiting up to 10 s for
    the xtables lock): closing waited for it on the loop, which relayed nothing meanwhile."""
    BlockedWorker.release.clear()
    BlockedWorker.entered.clear()
    monkeypatch.setattr(pyiptables, "_Worker", BlockedWorker)
    backend = IptcBackend(host_ip="10.0.0.1")
    sync = asyncio.ensure_future(backend.sync([PORTAL]))
    await asyncio.to_thread(BlockedWorker.entered.wait, 5)
    sync.cancel()
    closing = asyncio.ensure_future(backend.close())
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.sleep(0.05)  # the loop turns while the call goes on
        assert loop.time() - started < 1.0
        assert not closing.done()
    finally:
        BlockedWorker.release.set()
        await asyncio.wait_for(closing, 5)
    with pytest.raises(asyncio.CancelledError):
        await sync


def test_lock_is_exclusive_and_bounded(lockfile: Path) -> None:
    fd = os.open(lockfile, os.O_CREAT | os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with (
            pytest.raises(RulesError, match=r"holds .*xtables.lock for more than 0.2s"),
            xtables_lock(timeout_s=0.2),
        ):
            pass
    finally:
        os.close(fd)
    with xtables_lock(timeout_s=0.2):
        other = os.open(lockfile, os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(other)


class FlakyTable:
    def __init__(self, failures: list[str]) -> None:
        self.failures = failures
        self.commits = 0
        self.refreshes = 0

    def commit(self) -> None:
        self.commits += 1
        if self.failures:
            raise FakeIPTCError(self.failures.pop(0))


def flaky_worker(table: FlakyTable) -> _Worker:
    worker = object.__new__(_Worker)
    worker.iptc = SimpleNamespace(IPTCError=FakeIPTCError)

    def reread(name: str) -> FlakyTable:
        table.refreshes += 1
        return table

    worker._table = reread  # type: ignore[method-assign]
    return worker


def test_eagain_rereads_and_retries(lockfile: Path) -> None:
    table = FlakyTable(["can't commit: Resource temporarily unavailable"] * 2)
    applied: list[FlakyTable] = []
    flaky_worker(table)._commit_with_retry("nat", applied.append)
    assert table.commits == 3
    assert table.refreshes == 3  # each attempt starts from a fresh read of the table
    assert len(applied) == 3


def test_eagain_retries_are_bounded(lockfile: Path) -> None:
    table = FlakyTable(["Resource temporarily unavailable"] * 10)
    with pytest.raises(RulesError, match="temporarily unavailable"):
        flaky_worker(table)._commit_with_retry("nat", lambda t: None)
    assert table.commits == pyiptables.COMMIT_ATTEMPTS


def test_other_errors_are_not_retried(lockfile: Path) -> None:
    table = FlakyTable(["can't commit: Permission denied (you must be root)"])
    with pytest.raises(RulesError, match="permission denied; run as root"):
        flaky_worker(table)._commit_with_retry("nat", lambda t: None)
    assert table.commits == 1
