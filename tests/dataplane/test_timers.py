"""FixedDelayTimers: one loop timer serving many same-delay timers, in order, cancellable."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from tests.dataplane.conftest import wait_until
from uproxy.dataplane.timers import FixedDelayTimers


async def test_fires_in_start_order_after_the_delay_and_skips_cancelled() -> None:
    loop = asyncio.get_running_loop()
    timers = FixedDelayTimers(loop, 0.05)
    fired: list[tuple[int, float]] = []
    started = loop.time()

    def record(i: int) -> Callable[[], None]:
        return lambda: fired.append((i, loop.time()))

    handles = [timers.start(record(i)) for i in range(10)]
    for i in (1, 4, 9):
        handles[i].cancel()
    handles[4].cancel()  # twice is harmless
    assert len(timers) == 7
    await wait_until(lambda: len(fired) == 7, timeout=2, what="timers fired")
    assert [i for i, _ in fired] == [0, 2, 3, 5, 6, 7, 8]
    assert all(at - started >= 0.05 - 0.002 for _, at in fired)
    assert len(timers) == 0
    handles[0].cancel()  # after firing: a no-op
    assert len(timers) == 0


async def test_a_timer_started_by_a_callback_fires_once_too() -> None:
    loop = asyncio.get_running_loop()
    timers = FixedDelayTimers(loop, 0.02)
    fired: list[str] = []

    def first() -> None:
        fired.append("first")
        timers.start(lambda: fired.append("second"))

    timers.start(first)
    await wait_until(lambda: fired == ["first", "second"], timeout=2, what="chained timer")
    assert len(timers) == 0


async def test_a_failing_callback_is_reported_and_the_rest_still_fire() -> None:
    loop = asyncio.get_running_loop()
    timers = FixedDelayTimers(loop, 0.01)
    errors: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    fired: list[int] = []

    def boom() -> None:
        raise RuntimeError("boom")

    timers.start(boom)
    timers.start(lambda: fired.append(1))
    try:
        await wait_until(lambda: fired == [1], timeout=2, what="second timer")
    finally:
        loop.set_exception_handler(None)
    assert len(errors) == 1 and isinstance(errors[0]["exception"], RuntimeError)


async def test_cancelled_entries_behind_a_long_lived_one_are_compacted() -> None:
    loop = asyncio.get_running_loop()
    timers = FixedDelayTimers(loop, 60.0)
    keeper = timers.start(lambda: None)  # holds the head for a minute
    for _ in range(20_000):
        timers.start(lambda: None).cancel()
    assert len(timers) == 1
    assert len(timers._queue) <= 2 * 1024 + 2  # bounded by the live count, not the history
    keeper.cancel()
    timers.close()
    assert len(timers) == 0 and timers._handle is None
