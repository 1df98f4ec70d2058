"""A bounded-frequency runner: run one function often enough, and never too often.

Requests coalesce: any number of ``request()`` calls while a run is pending or in progress
lead to one more run. Runs are spaced by a token bucket (``burst`` runs back to back, then
one per ``min_interval``) and happen at least every ``max_interval`` even without requests,
which is what repairs state someone else changed. A run that raises is logged and retried
after ``min_interval``; the loop itself never dies of it. The shape follows kube-proxy's
BoundedFrequencyRunner.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from uproxy.log import kv

log = logging.getLogger("uproxy.runner")


class BoundedFrequencyRunner:
    def __init__(
        self,
        name: str,
        fn: Callable[[], Awaitable[None]],
        *,
        min_interval: float,
        max_interval: float,
        burst: int = 2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if min_interval < 0 or max_interval <= 0 or burst < 1:
            raise ValueError("min_interval >= 0, max_interval > 0 and burst >= 1 are required")
        self.name = name
        self._fn = fn
        self._min = min_interval
        self._max = max(max_interval, min_interval)
        self._burst = burst
        self._clock = clock
        self._tokens = float(burst)
        self._refilled = clock()
        self._wakeup = asyncio.Event()
        self.runs = 0
        self.failures = 0

    def request(self) -> None:
        """Ask for a run as soon as the rate limit allows; cheap and idempotent."""
        self._wakeup.set()

    async def loop(self) -> None:
        """Run until cancelled."""
        while True:
            try:
                await asyncio.wait_for(self._wakeup.wait(), timeout=self._max)
            except TimeoutError:
                pass  # max_interval elapsed: a periodic run
            await self._take_token()
            self._wakeup.clear()
            try:
                await self._fn()
                self.runs += 1
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.failures += 1
                log.error("Sync failed, will retry", extra=kv(runner=self.name, err=e))
                log.debug("Sync failure detail", exc_info=True)
                await asyncio.sleep(self._min or 1.0)
                self._wakeup.set()

    async def _take_token(self) -> None:
        if self._min == 0:
            return
        now = self._clock()
        self._tokens = min(self._burst, self._tokens + (now - self._refilled) / self._min)
        self._refilled = now
        if self._tokens < 1:
            await asyncio.sleep((1 - self._tokens) * self._min)
            now = self._clock()
            self._tokens = min(self._burst, self._tokens + (now - self._refilled) / self._min)
            self._refilled = now
        self._tokens -= 1
