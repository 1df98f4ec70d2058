"""``uproxy.priority`` on this kernel, and what it reports where the kernel cannot do as much.

These change this process's own scheduling values; the suite's ``_same_priority_after``
fixture puts them back after each test.
"""

from __future__ import annotations

import itertools
import os
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from uproxy import priority


def _values() -> set[tuple[int, int | None]]:
    return {
        (os.getpriority(os.PRIO_PROCESS, int(t)), priority.slice_of(int(t)))
        for t in os.listdir("/proc/self/task")
    }


@pytest.mark.root  # raising the priority back needs CAP_SYS_NICE
def test_every_thread_goes_down_and_a_worker_comes_back() -> None:
    base = priority.current()
    default = priority.slice_of(0)
    low = priority.lower_control(5)
    assert low == priority.Lowered(base, min(19, base + 5), priority.CONTROL_SLICE_NS)
    assert _values() == {(min(19, base + 5), priority.CONTROL_SLICE_NS)}
    priority.take_back(base)
    assert _values() == {(base, default)}


@pytest.mark.root  # raising the priority back needs CAP_SYS_NICE
def test_a_kernel_that_ignores_the_slice_is_reported_as_such(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before Linux 6.12 sched_setattr takes the slice of a fair task and drops it, and
    sched_getattr reports 0: the log must not claim a slice the kernel does not keep."""
    monkeypatch.setattr(priority, "slice_of", lambda tid: 0)
    base = priority.current()
    low = priority.lower_control(5)
    assert low is not None and low.control_slice_ns is None
    assert low.control_nice == min(19, base + 5) and low.worker_nice == base


def test_nothing_changes_when_neither_nice_nor_slice_can(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(priority, "slice_of", lambda tid: 0)
    monkeypatch.setattr(priority, "can_raise_back", lambda step: False)
    before = _values()
    assert priority.lower_control(5) is None
    assert {nice for nice, _ in _values()} == {nice for nice, _ in before}


def test_the_nice_probe_returns_once_its_thread_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without CAP_SYS_NICE the probe's thread cannot come back up, and until the kernel has
    removed it (a moment after ``join``) it is a task ``set_process`` cannot set: uproxy
    failed to start with EPERM, 7 times in 10 under load. The probe waits for it, boundedly.
    """
    tasks = tmp_path / "task"
    tasks.mkdir()
    lingering = tasks / "424242"
    lingering.touch()
    monkeypatch.setattr(threading, "get_native_id", lambda: 424242)
    timer = threading.Timer(0.2, lingering.unlink)
    timer.start()
    try:
        priority.can_raise_back(1, tasks=str(tasks))
        assert not lingering.exists()  # it returned after the thread was gone, not before
    finally:
        timer.cancel()
        timer.join()
    # A task that never goes does not hold the start for longer than the bound.
    lingering.touch()
    monkeypatch.setattr(priority, "PROBE_EXIT_WAIT_S", 0.05)
    priority.can_raise_back(1, tasks=str(tasks))
    assert lingering.exists()


def test_step_0_changes_nothing() -> None:
    before = _values()
    assert priority.lower_control(0) is None
    assert _values() == before


def test_only_a_lowered_process_gives_way_and_at_most_once_per_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    yields: list[float] = []
    now = [1000.0]
    # The module's view of both (give_way uses nothing else from them).
    monkeypatch.setattr(priority, "os", SimpleNamespace(sched_yield=lambda: yields.append(now[0])))
    monkeypatch.setattr(priority, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr(priority, "_gave_way", 0.0)
    monkeypatch.setattr(priority, "_giving_way", False)
    priority.give_way()
    assert yields == []  # not lowered: never

    monkeypatch.setattr(priority, "_giving_way", True)
    monkeypatch.setattr(priority, "_interval", priority.GIVE_WAY_STARTING_S)
    for interval in (priority.GIVE_WAY_STARTING_S, priority.GIVE_WAY_S):
        yields.clear()
        for _ in range(41):  # 10 intervals of bulk work, offered every quarter interval
            priority.give_way()
            now[0] += interval / 4
        assert len(yields) == 11
        assert all(b - a >= interval - 1e-12 for a, b in itertools.pairwise(yields))
        priority.serving()  # the first sync is done: offers come sooner


def test_a_yield_that_comes_back_late_pauses_yields_ten_times_as_long(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # On a CPU saturated by others each yield forfeits the rest of the slice: the control
    # process's came back after ~370 ms. Yielding on would starve the bulk work it is in.
    now = [1000.0]
    took = [0.0]
    yields: list[float] = []

    def sched_yield() -> None:
        yields.append(now[0])
        now[0] += took[0]

    monkeypatch.setattr(priority, "os", SimpleNamespace(sched_yield=sched_yield))
    monkeypatch.setattr(priority, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr(priority, "_yield_paused_until", 0.0)

    def offer_for(seconds: float) -> tuple[int, int]:
        """(offers, yields) over ``seconds`` of work that offers every 0.1 ms."""
        offers, before, end = 0, len(yields), now[0] + seconds
        while now[0] < end:
            priority.offer_cpu(now[0])
            offers += 1
            now[0] += 0.0001
        return offers, len(yields) - before

    took[0] = 0.00001  # a worker had the CPU for 10 us: every offer yields
    offers, yielded = offer_for(0.01)
    assert yielded == offers > 50
    took[0] = 0.37
    assert offer_for(0.01)[1] == 1  # the first one came back after 0.37 s
    took[0] = 0.00001
    assert offer_for(3.69)[1] == 0  # for ten times as long: none
    now[0] += 0.01
    offers, yielded = offer_for(0.01)
    assert yielded == offers > 50  # then every offer again


@pytest.mark.root  # raising the priority back needs CAP_SYS_NICE
def test_lowering_turns_giving_way_on_and_taking_back_turns_it_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(priority, "_giving_way", False)
    base = priority.current()
    assert priority.lower_control(5) is not None
    assert priority._giving_way
    priority.take_back(base)
    assert not priority._giving_way


def test_time_sliced_work_offers_the_cpu_as_it_goes(monkeypatch: pytest.MonkeyPatch) -> None:
    from uproxy import timeslice

    offers: list[None] = []
    monkeypatch.setattr(priority, "give_way", lambda now=None: offers.append(None))
    ts = timeslice.TimeSlice(budget_s=60.0, check_every=4)
    for _ in range(40):
        assert not ts.due()
    assert len(offers) == 10
