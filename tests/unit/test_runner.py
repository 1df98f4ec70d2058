"""The bounded-frequency runner: coalescing, rate limits, periodic runs, surviving errors."""

from __future__ import annotations

import asyncio
import contextlib

from tests.conftest import wait_for
from uproxy.runner import BoundedFrequencyRunner


async def test_requests_coalesce_and_are_rate_limited() -> None:
    runs: list[float] = []
    gate = asyncio.Event()

    async def fn() -> None:
        runs.append(asyncio.get_running_loop().time())
        await gate.wait()

    r = BoundedFrequencyRunner("t", fn, min_interval=0.2, max_interval=60, burst=1)
    task = asyncio.create_task(r.loop())
    try:
        r.request()
        await wait_for(lambda: len(runs) == 1, message="first run")
        for _ in range(50):  # many requests while a run is in progress ...
            r.request()
        gate.set()
        await wait_for(lambda: len(runs) == 2, message="second run")  # ... make one more run
        assert runs[1] - runs[0] >= 0.19  # spaced by min_interval
        await asyncio.sleep(0.3)
        assert len(runs) == 2
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_periodic_run_without_requests() -> None:
    runs: list[int] = []

    async def fn() -> None:
        runs.append(1)

    r = BoundedFrequencyRunner("t", fn, min_interval=0, max_interval=0.05)
    task = asyncio.create_task(r.loop())
    try:
        await wait_for(lambda: len(runs) >= 3, timeout=2, message="periodic runs")
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_failure_is_retried_and_loop_survives() -> None:
    attempts: list[int] = []

    async def fn() -> None:
        attempts.append(1)
        if len(attempts) < 3:
            raise RuntimeError("kernel said no")

    r = BoundedFrequencyRunner("t", fn, min_interval=0.01, max_interval=60)
    task = asyncio.create_task(r.loop())
    try:
        r.request()
        await wait_for(lambda: r.runs == 1, timeout=3, message="a successful run after failures")
        assert r.failures == 2
        assert not task.done()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
