"""The control process runs below its workers (``uproxy.priority``), read from the kernel.

uproxy runs as a process of its own, with 2 workers and ``--control-nice 7``, under the
capabilities of the shipped DaemonSet (``setpriv`` bounds them, as the container runtime does).
Every thread's scheduling values come from ``/proc/PID/task/TID/sched``: ``prio`` (120 + nice)
and ``se.slice`` (the time slice the thread asked for, in ns).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import wait_for
from tests.deploy.manifests import DEPLOY, REPO, container, find, load
from tests.factories import one_service_file
from tests.integration.procs import children
from uproxy import priority

pytestmark = pytest.mark.root

STEP = 7


def _daemonset_capabilities() -> list[str]:
    sc = container(find(load(DEPLOY / "uproxy.yaml"), "DaemonSet", "uproxy"))["securityContext"]
    return [c.lower() for c in sc["capabilities"]["add"]]


def _sched(pid: int) -> dict[int, tuple[int, int]]:
    """Thread id -> (nice, slice in ns) for every thread of ``pid``."""
    out = {}
    for name in os.listdir(f"/proc/{pid}/task"):
        fields = {}
        try:
            with open(f"/proc/{pid}/task/{name}/sched") as f:
                for line in f:
                    key, _, value = line.partition(":")
                    fields[key.strip()] = value.strip()
        except FileNotFoundError:
            continue  # a thread that ended
        out[int(name)] = (int(fields["prio"]) - 120, int(fields["se.slice"]))
    return out


def _default_slice() -> int:
    """The kernel's default time slice: what a thread gets when it asks for none."""
    got: list[int] = []

    def probe() -> None:
        priority.set_thread(0, priority.current(), 0)
        with open("/proc/thread-self/sched") as f:
            got.extend(int(line.split(":")[1]) for line in f if line.startswith("se.slice"))

    t = threading.Thread(target=probe)
    t.start()
    t.join()
    return got[0]


@pytest.fixture
def services(tmp_path: Path) -> Path:
    return one_service_file(tmp_path / "services.yaml", "127.0.0.41", 8080)


class Running:
    def __init__(self, services: Path, log: Path, *, capabilities: list[str], step: int) -> None:
        bounding = ",".join(["-all", *(f"+{c}" for c in capabilities)])
        argv = [
            *("setpriv", "--no-new-privs", "--bounding-set", bounding, "--"),
            *(sys.executable, "-m", "uproxy.cli", "--services", str(services)),
            *("--rules", "none", "--workers", "2", "--control-nice", str(step)),
            *("--healthz-bind-address", "", "--metrics-bind-address", ""),
        ]
        self.log = log
        with log.open("w") as out:
            self.process = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=out)
        self.pid = self.process.pid

    def workers(self) -> list[int]:
        found = children(self.pid)
        assert self.process.poll() is None, self.log.read_text()
        return found

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


Start = Callable[..., Running]


@pytest.fixture
def run(services: Path, tmp_path: Path) -> Iterator[Start]:
    started: list[Running] = []

    def start(*, capabilities: list[str], step: int = STEP) -> Running:
        r = Running(
            services, tmp_path / f"uproxy-{len(started)}.log", capabilities=capabilities, step=step
        )
        started.append(r)
        return r

    yield start
    for r in started:
        r.stop()


async def _two_workers(r: Running) -> list[int]:
    """The workers, once both are ready (the first sync opens the proxy port after that)."""
    await wait_for(lambda: "Proxy ports changed" in r.log.read_text(), timeout=15)
    assert len(r.workers()) == 2
    return r.workers()


def _at(pid: int, nice: int, slice_ns: int) -> bool:
    return set(_sched(pid).values()) == {(nice, slice_ns)}


async def _settle(pid: int, nice: int, slice_ns: int) -> None:
    """A worker starts as its control process runs, then sets itself (before its loop)."""
    await wait_for(lambda: _at(pid, nice, slice_ns), timeout=10, message=f"{pid} settled")


def _assert_threads(pid: int, nice: int, slice_ns: int) -> None:
    threads = _sched(pid)
    assert threads, pid
    assert set(threads.values()) == {(nice, slice_ns)}, threads


async def test_with_the_daemonsets_capabilities_the_control_process_runs_below_its_workers(
    run: Start,
) -> None:
    assert shutil.which("setpriv"), "setpriv (util-linux) is needed"
    caps = _daemonset_capabilities()
    assert "sys_nice" in caps
    base, default = priority.current(), _default_slice()
    r = run(capabilities=caps)
    workers = await _two_workers(r)
    for w in workers:
        await _settle(w, base, default)
    _assert_threads(r.pid, base + STEP, priority.CONTROL_SLICE_NS)
    assert "Control process yields the CPU to the workers" in r.log.read_text()

    # A replacement worker is started by the lowered control process: it takes back the
    # workers' priority too.
    os.kill(workers[0], signal.SIGKILL)
    # One look at the children per poll: between two looks the killed worker (a zombie
    # until reaped, still a child) can leave before its replacement arrives.
    seen: list[set[int]] = [set()]

    def replaced() -> bool:
        seen[0] = set(r.workers())
        return len(seen[0]) == 2 and workers[0] not in seen[0]

    await wait_for(replaced, timeout=10, message="the killed worker replaced")
    (replacement,) = seen[0] - set(workers)
    await _settle(replacement, base, default)
    _assert_threads(r.pid, base + STEP, priority.CONTROL_SLICE_NS)


async def test_without_cap_sys_nice_only_the_time_slice_changes(run: Start) -> None:
    caps = [c for c in _daemonset_capabilities() if c != "sys_nice"]
    base, default = priority.current(), _default_slice()
    r = run(capabilities=caps)
    workers = await _two_workers(r)
    for w in workers:
        await _settle(w, base, default)
    _assert_threads(r.pid, base, priority.CONTROL_SLICE_NS)
    assert "CAP_SYS_NICE missing" in r.log.read_text()


async def test_control_nice_0_keeps_one_priority(run: Start) -> None:
    base, default = priority.current(), _default_slice()
    r = run(capabilities=_daemonset_capabilities(), step=0)
    workers = await _two_workers(r)
    for pid in (r.pid, *workers):
        _assert_threads(pid, base, default)
    assert "yields the CPU" not in r.log.read_text()


async def test_a_worker_starts_at_the_workers_priority_not_the_controls(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Before it has run a line of its own: its interpreter and imports must not run at the
    # control's priority (under full load a replacement then took 1.3-1.5 s to be ready).
    # The worker here is a program that never sets itself, so only the control process can
    # have raised it.
    from uproxy.dataplane.settings import DataplaneSettings
    from uproxy.workers import WorkerPool

    stand_in = tmp_path / "worker"
    stand_in.write_text("#!/bin/sh\nexec sleep 30\n")
    stand_in.chmod(0o755)
    monkeypatch.setattr("uproxy.workers.sys.executable", str(stand_in))
    base, default = priority.current(), _default_slice()
    pool = WorkerPool(1, settings=DataplaneSettings(), argv=[], control_nice=STEP)
    pool._lower_control()
    assert pool.lowered is not None and pool.lowered.worker_nice == base
    _assert_threads(os.getpid(), base + STEP, priority.CONTROL_SLICE_NS)
    worker = await pool._spawn(0)
    try:
        _assert_threads(worker.process.pid, base, default)
    finally:
        worker.process.kill()
        await worker.process.wait()
        worker.channel.close()
        worker.files.close()
