"""Choosing the event loop: uvloop when wanted and installed, asyncio otherwise."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from uproxy.settings import SettingsError


def run_loop(main: Callable[[], Coroutine[Any, Any, int]], event_loop: str = "auto") -> int:
    """Run ``main`` to completion on the chosen loop and return its exit code."""
    if event_loop in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            if event_loop == "uvloop":
                raise SettingsError("--event-loop uvloop: uvloop is not installed") from None
        else:
            result: int = uvloop.run(main())
            return result
    return asyncio.run(main())
