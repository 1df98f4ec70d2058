"""A helper process the bench runs to completion is stopped with time to clean up.

``subprocess.run`` SIGKILLs its child alone on a timeout or an interrupt: ``bench.rules_sync``
then never deleted its namespace, and its inner run was orphaned. ``procs.run_to_end`` gives
the child's whole process group SIGTERM and a grace period first.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

import pytest

from bench.procs import run_to_end

CHILD = """
import pathlib, signal, subprocess, sys, time
grandchild = subprocess.Popen(["sleep", "60"])
pathlib.Path(sys.argv[2]).write_text(str(grandchild.pid))
def cleanup(*args):
    pathlib.Path(sys.argv[1]).write_text("cleaned up")
    sys.exit(0)
signal.signal(signal.SIGTERM, cleanup)
time.sleep(60)
"""


def _gone(pid: int) -> bool:
    """No such process, or only its zombie (its parent exited; init reaps it)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return True
        if stat[stat.rindex(")") + 2] == "Z":
            return True
        time.sleep(0.05)
    return False


def _started(pid_file: Path) -> int:
    deadline = time.monotonic() + 10
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "the child did not start"
        time.sleep(0.02)
    return int(pid_file.read_text())


def test_a_timeout_lets_the_child_clean_up_and_stops_what_it_started(tmp_path: Path) -> None:
    marker, pid_file = tmp_path / "marker", tmp_path / "pid"
    with pytest.raises(subprocess.TimeoutExpired):
        run_to_end([sys.executable, "-c", CHILD, str(marker), str(pid_file)], timeout_s=1.5)
    assert marker.read_text() == "cleaned up"
    assert _gone(_started(pid_file))


def test_an_interrupt_lets_the_child_clean_up_and_is_raised_again(tmp_path: Path) -> None:
    marker, pid_file = tmp_path / "marker", tmp_path / "pid"

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 1.5)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_to_end([sys.executable, "-c", CHILD, str(marker), str(pid_file)], timeout_s=30)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert marker.read_text() == "cleaned up"
    assert _gone(_started(pid_file))


def test_a_helper_that_ends_gives_its_output() -> None:
    done = run_to_end([sys.executable, "-c", "print('table')"], timeout_s=30)
    assert (done.returncode, done.stdout) == (0, "table\n")
