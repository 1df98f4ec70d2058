"""The bench's command lines: a bad argument is one error line and exit status 2, found before
anything is measured (not a traceback after minutes, nor a run that quietly measures nothing
or overwrites the committed results)."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest

from bench import big_service, cli, cmdline, deployed


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


def _usage_error(capsys: pytest.CaptureFixture[str], main: Any, argv: list[str]) -> str:
    """A command's argparse error: exit status 2, the last line ``...: error: ...``."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert ": error: argument " in line
    return line


@pytest.mark.parametrize(
    ("module", "argv"),
    [
        ("controlplane", ["run", "--sizes", "abc"]),
        ("controlplane", ["run", "--sizes", "1000,"]),
        ("controlplane", ["run", "--sizes", "10k"]),
        ("controlplane", ["run", "--sizes", "0"]),
        ("controlplane", ["run", "--starts", "0"]),
        ("big_service", ["--endpoints", "abc"]),
        ("big_service", ["--runs", "0"]),
        ("big_service", ["--seconds", "0"]),
        ("udp_flows", ["--burst", "x"]),
        ("udp_flows", ["--runs", "0"]),
        ("burst_spread", ["--sizes", "x"]),
        ("burst_spread", ["--bursts", "0"]),
        ("deployed", ["--scales", "abc"]),
        ("deployed", ["--rounds", "0"]),
    ],
)
def test_a_bad_number_is_one_usage_error(
    capsys: pytest.CaptureFixture[str], module: str, argv: list[str]
) -> None:
    main = importlib.import_module(f"bench.{module}").main
    line = _usage_error(capsys, main, argv)
    assert argv[-1] in line or repr(argv[-1]) in line


def test_counts_are_read_as_lists() -> None:
    assert cmdline.positive_ints("100,5000") == [100, 5000]
    assert deployed.plan_for(quick=False, scales=[10000, 1]).scales == (1, 10000)


def test_render_of_a_missing_file_is_one_error_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    line = _error(capsys, ["--render", str(tmp_path / "MISSING.json")])
    assert (
        line
        == f"bench: error: --render {tmp_path / 'MISSING.json'}: cannot read it: No such file or directory"
    )


@pytest.mark.parametrize("text", ["{}", "[]", "not json", '{"peers": {}}'])
def test_render_of_what_is_not_a_results_file_is_one_error_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, text: str
) -> None:
    source = tmp_path / "results.json"
    source.write_text(text)
    line = _error(capsys, ["--render", str(source)])
    assert line.startswith(f"bench: error: --render {source}: not ")
    assert not (tmp_path / "RESULTS.md").exists()


@pytest.mark.parametrize("module", ["big_service", "udp_flows", "burst_spread"])
def test_usage_names_the_command_as_it_is_run(
    capsys: pytest.CaptureFixture[str], module: str
) -> None:
    with pytest.raises(SystemExit):
        importlib.import_module(f"bench.{module}").main(["--no-such-option"])
    assert capsys.readouterr().err.startswith(f"usage: python -m bench.{module} ")


def test_of_two_runs_the_table_shows_the_worse() -> None:
    better, worse = {"p999_ms": 1.0}, {"p999_ms": 3.0}
    assert big_service.middle([better, worse], "p999_ms") is worse
    assert big_service.middle([worse, better], "p999_ms") is worse
    assert big_service.middle([better, {"p999_ms": 2.0}, worse], "p999_ms")["p999_ms"] == 2.0
