"""A progress line per step on stderr: where the run is, how long it has taken, what is left.

Plain lines rather than a redrawn bar, so the same output reads well in a terminal and in a CI
log. The estimate scales the planned step durations by how far reality has drifted from them.
"""

from __future__ import annotations

import sys
import time


def _mmss(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 60:02d}:{seconds % 60:02d}"


class Progress:
    def __init__(self, *, planned_s: float, start_wall: float | None = None) -> None:
        self.planned_s = max(planned_s, 1.0)
        self.done_planned_s = 0.0
        # Wall-clock, so that the parts of a run in other processes share one clock.
        self.start_wall = time.time() if start_wall is None else start_wall

    def elapsed(self) -> float:
        return time.time() - self.start_wall

    def advance(self, planned_s: float) -> None:
        self.done_planned_s += planned_s

    def say(self, text: str) -> None:
        elapsed = self.elapsed()
        frac = min(self.done_planned_s / self.planned_s, 1.0)
        if frac > 0.02:
            eta = f"eta {_mmss(elapsed / frac - elapsed)}"
        else:
            eta = f"eta ~{_mmss(self.planned_s)}"
        print(f"[{frac * 100:3.0f}% {_mmss(elapsed)} {eta}] {text}", file=sys.stderr, flush=True)
