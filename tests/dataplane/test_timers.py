"""FixedDelayTimers: one loop timer serving many same-delay timers, in order, cancellable."""

from __future__ import annotations

import asyncio

from tests.dataplane.conftest import wait_until
from uproxy.dataplane.timers import FixedDelayTimers


async def test_fires_in_start_order_after_the_delay_and_skips_cancelled() -> None:
    loop = asyncio.get_running_loop()
    fired: list[tuple[int, float]] = []
    timers: FixedDelayTimers[int] = FixedDelayTimers(
        loop, 0.05, lambda i: fired.append((i, loop.time()))
    )
    started = loop.time()

    handles = [timers.start(i) for i in range(10)]
    for i in (1, 4, 9):
        handles[i].clear()
    handles[4].clear()  # twice is harmless
    assert len(timers) == 7
    await wait_until(lambda: len(fired) == 7, timeout=2, what="timers fired")
    assert [i for i, _ in fired] == [0, 2, 3, 5, 6, 7, 8]
    assert all(at - started >= 0.05 - 0.002 for _, at in fired)
    assert len(timers) == 0
    handles[0].clear()  # after firing: a no-op
    assert len(timers) == 0


async def test_a_timer_started_by_a_callback_fires_once_too() -> None:
    loop = asyncio.get_running_loop()
    fired: list[str] = []

    def expire(what: str) -> None:
        fired.append(what)
        if what == "first":
            timers.start("second")

    timers = FixedDelayTimers(loop, 0.02, expire)
    timers.start("first")
    await wait_until(lambda: fired == ["first", "second"], timeout=2, what="chained timer")
    assert len(timers) == 0


async def test_a_failing_callback_is_reported_and_the_rest_still_fire() -> None:
    loop = asyncio.get_running_loop()
    errors: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    fired: list[int] = []

    def expire(i: int) -> None:
        if i == 0:
            raise RuntimeError("boom")
        fired.append(i)

    timers = FixedDelayTimers(loop, 0.01, expire)
    timers.start(0)
    timers.start(1)
    try:
        await wait_until(lambda: fired == [1], timeout=2, what="second timer")
    finally:
        loop.set_exception_handler(None)
    assert len(errors) == 1 and isinstance(errors[0]["exception"], RuntimeError)


async def test_cancelled_entries_behind_a_long_lived_one_are_compacted() -> None:
    loop = asyncio.get_running_loop()
    timers: FixedDelayTimers[object] = FixedDelayTimers(loop, 60.0, lambda _: None)
    keeper = timers.start(None)  # holds the head for a minute
    for _ in range(20_000):
        timers.start(None).clear()
    assert len(timers) == 1
    assert len(timers._queue) <= 1024 + 1  # bounded by the live count, not the history
    # With many live ones, the bound follows them: twice what is live, whatever the history.
    live = [timers.start(None) for _ in range(5_000)]
    for _ in range(50_000):
        timers.start(None).clear()
    assert len(timers) == 5_001
    assert len(timers._queue) <= 2 * 5_002 + 1
    keeper.clear()
    for timer in live:
        timer.clear()
    timers.close()
    assert len(timers) == 0 and timers._handle is None
