"""The bench's rounds: every peer once a round, the order rotated, the rounds' runs added up.

A full bench run measures its peers in turn, round after round, so that a slow stretch of the
machine falls on every peer alike; a peer's figures are then the medians over the rounds.
"""

from __future__ import annotations

from typing import Any

from bench import cli, dataplane


def test_every_peer_runs_once_a_round_and_no_peer_always_first() -> None:
    parts = cli._peer_parts(["a", "b", "c"], 3)
    assert parts == [
        "peer:a#1", "peer:b#1", "peer:c#1",
        "peer:b#2", "peer:c#2", "peer:a#2",
        "peer:c#3", "peer:a#3", "peer:b#3",
    ]  # fmt: skip
    assert [cli._peer_part(p) for p in parts[:2]] == [("a", 1), ("b", 1)]


def _round(rate: float, p99_us: float, notes: list[str] | None = None) -> dict[str, Any]:
    return {
        "label": "a",
        "runs": {"conn": [{"rate": rate}], "peak": [{"rss_mb": rate / 100}]},
        "notes": list(notes or []),
        "wakeup": {"idle": {"p99_us": p99_us}},
    }


def test_the_rounds_runs_add_up_and_the_median_wakeup_is_shown() -> None:
    placeholder: dict[str, Any] = {"label": "a", "skipped": "did not run", "notes": []}
    entry = dataplane.merge_round(placeholder, _round(100.0, 300.0, ["udp: not supported"]))
    entry = dataplane.merge_round(entry, _round(200.0, 100.0, ["udp: not supported"]))
    entry = dataplane.merge_round(entry, _round(300.0, 200.0))
    assert "skipped" not in entry
    assert [r["rate"] for r in entry["runs"]["conn"]] == [100.0, 200.0, 300.0]
    assert len(entry["runs"]["peak"]) == 3
    assert entry["notes"] == ["udp: not supported"]
    assert entry["wakeup"] == {"idle": {"p99_us": 200.0}}
    assert len(entry["wakeups"]) == 3


def test_a_round_that_failed_first_stays_a_note_once_another_is_measured() -> None:
    placeholder: dict[str, Any] = {
        "label": "a",
        "skipped": "failed: boom",
        "notes": ["round 1: failed: boom"],
    }
    entry = dataplane.merge_round(placeholder, _round(100.0, 300.0))
    assert "skipped" not in entry
    assert entry["notes"] == ["round 1: failed: boom"]
    assert [r["rate"] for r in entry["runs"]["conn"]] == [100.0]
