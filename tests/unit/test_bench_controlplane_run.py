"""``python -m bench.controlplane run``: its exit status says whether every session ran, and
its working directory (services files and logs, megabytes at 10,000 services) is kept only
when a session failed, where its logs tell why."""

from __future__ import annotations

import os
import signal
import tempfile
from pathlib import Path
from typing import Any

import pytest

from bench import controlplane, cp_report


@pytest.fixture
def run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """``run`` with the sessions replaced by ``outcome``; its exit status and the working
    directories left under the temporary directory."""
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(signal, "signal", lambda *a: None)
    monkeypatch.setattr(controlplane, "run_uproxy_as_shipped", lambda: None)
    monkeypatch.setattr(cp_report, "markdown", lambda cp: "table")
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))

    def go(outcome: dict[str, Any]) -> tuple[int, list[Path]]:
        def sessions(plan: Any, *, workdir: Path, **kw: Any) -> dict[str, Any]:
            (workdir / "session-1.log").write_text("uproxy's log")
            return outcome

        monkeypatch.setattr(controlplane, "run_at_scale", sessions)
        rc = controlplane.main(["run", "--quick", "--out", str(tmp_path / "cp.json")])
        return rc, list(temp.glob("uproxy-bench-cp-*"))

    return go


def test_a_run_whose_sessions_all_ran_exits_0_and_leaves_nothing(run: Any) -> None:
    rc, left = run({"sizes": {}, "notes": []})
    assert rc == 0
    assert left == []


def test_a_failed_session_exits_non_zero_and_keeps_its_logs(
    run: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, left = run({"sizes": {}, "notes": ["failed: RuntimeError"], "failed": True})
    assert rc == 1
    assert len(left) == 1 and (left[0] / "session-1.log").exists()
    assert f"child logs kept in {left[0]}" in capsys.readouterr().err
