"""The bounded-frequency runner: coalescing, rate limits, periodic runs, surviving errors."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging

import pytest

from tests.conftest import wait_for
from uproxy.log import V2
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


async def test_failures_back_off_to_max_interval_and_a_success_starts_over() -> None:
    attempts: list[float] = []
    failing = True

    async def fn() -> None:
        attempts.append(asyncio.get_running_loop().time())
        if failing:
            raise RuntimeError("permission denied")

    r = BoundedFrequencyRunner("t", fn, min_interval=0.05, max_interval=0.1, burst=5)
    task = asyncio.create_task(r.loop())
    try:
        r.request()
        await wait_for(lambda: len(attempts) >= 5, timeout=5, message="five attempts")
        gaps = [b - a for a, b in itertools.pairwise(attempts)]
        # 0.05, then doubled and capped at max_interval (a shorter wait never happens).
        assert gaps[0] >= 0.049 and all(g >= 0.099 for g in gaps[1:4]), gaps
        assert gaps[3] < 0.2, gaps  # not doubled past max_interval
        failing = False
        await wait_for(lambda: r.runs == 1, timeout=5, message="a success")
        failing = True
        before = len(attempts)
        r.request()
        await wait_for(lambda: len(attempts) >= before + 2, timeout=5, message="fails again")
        assert attempts[before + 1] - attempts[before] < 0.099  # the backoff started over
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_a_request_retries_at_once_and_its_repeated_error_is_not_logged_as_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    attempts: list[float] = []

    async def fn() -> None:
        attempts.append(asyncio.get_running_loop().time())
        raise RuntimeError("permission denied")

    r = BoundedFrequencyRunner("t", fn, min_interval=0.01, max_interval=60, burst=5)
    task = asyncio.create_task(r.loop())
    caplog.set_level(logging.DEBUG, logger="uproxy.runner")
    try:
        r.request()
        # 0.01, 0.02, 0.04, 0.08 s: four scheduled retries, each an error line.
        await wait_for(lambda: len(attempts) == 5, timeout=5, message="five attempts")
        await asyncio.sleep(0)
        r.request()  # in the middle of a 0.16 s backoff: retried at once
        await wait_for(lambda: len(attempts) == 6, timeout=5, message="the request's retry")
        assert attempts[5] - attempts[4] < 0.16
        await wait_for(lambda: r.failures == 6, timeout=5, message="its failure")
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    failed = [rec for rec in caplog.records if rec.getMessage() == "Sync failed, will retry"]
    assert [rec.levelno for rec in failed] == [logging.ERROR] * 5 + [V2]


@pytest.mark.parametrize("turns", range(4))
async def test_a_stop_that_meets_a_request_ends_the_loop(turns: int) -> None:
    """A stop cancels the loop; a request just before it (a change, as the stop signal
    came) must not swallow that cancellation. asyncio.wait_for on Python 3.11 returned the
    request instead when its wait had ended in the same turn, and the loop went on to wait
    for the next one: uproxy's stop waited for it for ever."""
    runs: list[int] = []

    async def fn() -> None:
        runs.append(1)

    runner = BoundedFrequencyRunner("t", fn, min_interval=0, max_interval=3600)
    task = asyncio.create_task(runner.loop())
    for _ in range(3):
        await asyncio.sleep(0)  # waiting for a request
    runner.request()
    for _ in range(turns):
        await asyncio.sleep(0)  # the request's wait ends in one of these
    task.cancel()
    await asyncio.wait([task], timeout=2)
    assert task.cancelled()


async def test_a_change_that_comes_in_pieces_is_one_run() -> None:
    """A Service, then its EndpointSlice a moment later: with ``settle``, the run waits for
    the second piece and takes one token of the rate limit, not two."""
    runs: list[int] = []

    async def fn() -> None:
        runs.append(1)

    runner = BoundedFrequencyRunner("t", fn, min_interval=60, max_interval=3600, settle=0.2)
    task = asyncio.create_task(runner.loop())
    try:
        await asyncio.sleep(0)
        runner.request()
        await asyncio.sleep(0.05)
        assert runs == []  # settling
        runner.request()
        await wait_for(lambda: runs == [1], timeout=5, message="one run")
        await asyncio.sleep(0.3)
        assert runs == [1]
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
