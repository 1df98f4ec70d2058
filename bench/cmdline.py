"""Argument types the bench's commands share: counts that must be positive, lists of them.

Given to ``argparse`` as ``type=``, so a bad value is one ``usage: ... error: ...`` line and
exit status 2 before anything starts, rather than a traceback minutes later or a run that
quietly measures nothing (``--runs 0`` or ``-1``).
"""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """A whole number above zero."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be 1 or more")
    return value


def positive_float(text: str) -> float:
    """A number above zero (seconds)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be above 0")
    return value


def positive_ints(text: str) -> list[int]:
    """Comma-separated whole numbers above zero (``1000,5000``), in the order given."""
    values = []
    for item in text.split(","):
        try:
            values.append(positive_int(item.strip()))
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    return values
