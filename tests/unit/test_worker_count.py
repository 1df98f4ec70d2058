"""How many data-plane workers uproxy starts when ``--workers`` is not given: the CPUs this
process may use, by its affinity mask and its cgroup's CPU quota (a DaemonSet's CPU limit);
one in laptop mode."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from uproxy import workers


@pytest.mark.parametrize(
    ("content", "cpus"),
    [
        ("max 100000\n", None),  # no limit
        ("100000 100000\n", 1),
        ("150000 100000\n", 2),  # a limit of 1.5 CPUs: the half CPU is worth a worker
        ("50000 100000\n", 1),
        ("400000 100000\n", 4),
        ("800000 200000\n", 4),  # another period, the same quota
        ("", None),  # unreadable: as if unlimited
        ("max\n", None),
        ("lots 100000\n", None),
        ("100000 0\n", None),
    ],
)
def test_the_cgroup_v2_quota_in_cpus_rounded_up(
    tmp_path: Path, content: str, cpus: int | None
) -> None:
    (tmp_path / "cpu.max").write_text(content)
    assert workers._cgroup_cpus(str(tmp_path)) == cpus


@pytest.mark.parametrize("controller", ["cpu", "cpu,cpuacct"])
@pytest.mark.parametrize(
    ("quota", "period", "cpus"),
    [("-1", "100000", None), ("150000", "100000", 2), ("200000", "100000", 2), ("x", "1", None)],
)
def test_the_cgroup_v1_quota_when_there_is_no_v2_file(
    tmp_path: Path, controller: str, quota: str, period: str, cpus: int | None
) -> None:
    """Nodes still on cgroup v1: the CFS quota over its period, as the container sees it."""
    v1 = tmp_path / controller
    v1.mkdir()
    (v1 / "cpu.cfs_quota_us").write_text(quota + "\n")
    (v1 / "cpu.cfs_period_us").write_text(period + "\n")
    assert workers._cgroup_cpus(str(tmp_path)) == cpus


def test_no_cgroup_file_is_no_limit(tmp_path: Path) -> None:
    assert workers._cgroup_cpus(str(tmp_path)) is None


def test_this_machine_s_cgroup_reads_as_a_number_or_no_limit() -> None:
    cpus = workers._cgroup_cpus()
    assert cpus is None or cpus >= 1


@pytest.mark.parametrize(
    ("affinity", "quota", "count"),
    [
        ({0, 1, 2, 3}, None, 4),
        ({0, 1, 2, 3}, 2, 2),  # the limit is lower than the mask
        ({2}, 8, 1),  # the mask is lower than the limit
        ({0, 1}, 2, 2),
    ],
)
def test_the_default_is_the_smaller_of_the_mask_and_the_quota(
    monkeypatch: pytest.MonkeyPatch, affinity: set[int], quota: int | None, count: int
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: affinity)
    monkeypatch.setattr(workers, "_cgroup_cpus", lambda: quota)
    assert workers.default_worker_count(laptop=False) == count
    assert workers.default_worker_count(laptop=True) == 1


def test_a_process_pinned_to_one_cpu_starts_one_worker() -> None:
    """The real mask of a real process, as ``taskset`` (or a CPU manager) leaves it."""
    cpus = sorted(os.sched_getaffinity(0))
    code = "from uproxy.workers import default_worker_count as d; print(d(laptop=False))"
    done = subprocess.run(
        ["taskset", "-c", str(cpus[0]), sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert done.stdout.strip() == "1"
