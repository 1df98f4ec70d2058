"""The bench's command lines: a bad argument is one error line and exit status 2, found before
anything is measured (not a traceback after minutes, nor a run that quietly measures nothing
or overwrites the committed results)."""

from __future__ import annotations

from pathlib import Path

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


def test_unknown_peers_are_named_with_the_valid_ones(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    line = _error(capsys, ["--peers", "nosuch,haproxy,other", "--out", str(tmp_path)])
    assert line.startswith("bench: error: unknown peers: nosuch, other (choose from: direct, ")
    assert "uproxy-uvloop" in line and line.endswith(", disturb)")


def test_only_unknown_peers_write_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    _error(capsys, ["--peers", "nosuch", "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out" / "RESULTS.md").exists()


@pytest.mark.parametrize("peers", ["disturb", "uproxy-uvloop", "uproxy-w2-2cpu,haproxy-2cpu"])
def test_every_documented_peer_name_is_taken(peers: str) -> None:
    assert cli._unknown_peers(cli.parse(["--peers", peers])) is None


def test_disturb_alone_runs_no_peer_but_the_disturbance() -> None:
    args = cli.parse(["--peers", "disturb"])
    assert cli._wanted_peers(args) == {"disturb"}


def test_an_out_that_cannot_be_a_directory_is_refused_before_measuring(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    line = _error(capsys, ["--quick", "--out", str(blocker / "results")])
    assert line.startswith(f"bench: error: --out {blocker / 'results'}: cannot create it")


def test_a_missing_out_is_created_at_start(tmp_path: Path) -> None:
    out = tmp_path / "a" / "b"
    with pytest.raises(AssertionError, match="the run started"):
        cli.main(["--quick", "--out", str(out)])
    assert out.is_dir()
