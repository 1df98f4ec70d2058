"""The bench's command lines: a bad argument is one error line and exit status 2, found before
anything is measured (not a traceback after minutes, nor a run that quietly measures nothing
or overwrites the committed results)."""

from __future__ import annotations

import pytest

from bench import cli


@pytest.fixture(autouse=True)
def _never_measure(monkeypatch: pytest.MonkeyPatch) -> None:
    """A command line that got past its checks would start measuring: fail instead."""

    def measure(*args: object) -> int:
        raise AssertionError("the run started")

    monkeypatch.setattr(cli, "run_all", measure)
    monkeypatch.setattr(cli, "run_part", measure)
    monkeypatch.setattr(cli, "run_uproxy_as_shipped", lambda: None)
    monkeypatch.setattr(cli, "missing_tools", lambda: [])


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """``python -m bench argv``'s one error line (exit status 2)."""
    with pytest.raises(SystemExit) as exited:
        rc = cli.main(argv)
        raise SystemExit(rc)
    assert exited.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines, "no error line"
    return lines[-1]


@pytest.mark.parametrize(
    "argv",
    [
        ["--runs", "0"],
        ["--runs", "-1"],
        ["--runs", "two"],
        ["--disturb-services", "-5"],
        ["--disturb-services", "0"],
    ],
)
def test_counts_below_one_are_refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    line = _error(capsys, argv)
    assert line.startswith("python -m bench: error: argument " + argv[0])


def test_a_positive_count_is_taken() -> None:
    args = cli.parse(["--runs", "2", "--disturb-services", "100"])
    assert cli._plan(args).rounds == 2
    assert cli._disturb_plan(args).services == 100
