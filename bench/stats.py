"""Medians, spreads and ratios: the arithmetic behind every figure in the table."""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Summary:
    median: float
    low: float
    high: float
    n: int

    @property
    def spread_pct(self) -> float:
        """(max - min) / median, in percent: how much the runs disagree."""
        if self.median == 0 or self.n < 2:
            return 0.0
        return (self.high - self.low) / abs(self.median) * 100.0

    def as_dict(self) -> dict[str, float]:
        return {
            "median": self.median,
            "min": self.low,
            "max": self.high,
            "n": self.n,
            "spread_pct": self.spread_pct,
        }


def summarise(values: list[float]) -> Summary | None:
    if not values:
        return None
    return Summary(statistics.median(values), min(values), max(values), len(values))


def ratio(value: float | None, reference: float | None) -> float | None:
    if value is None or reference is None or reference == 0:
        return None
    return value / reference
