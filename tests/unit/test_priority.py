"""``uproxy.priority`` on this kernel, and what it reports where the kernel cannot do as much.

These change this process's own scheduling values; the suite's ``_same_priority_after``
fixture puts them back after each test.
"""

from __future__ import annotations

import os

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


def test_step_0_changes_nothing() -> None:
    before = _values()
    assert priority.lower_control(0) is None
    assert _values() == before
