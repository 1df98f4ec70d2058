"""A bounded-frequency runner: run one function often enough, and never too often.

Requests coalesce: any number of ``request()`` calls while a run is pending or in progress
lead to one more run. Runs are spaced by a token bucket (``burst`` runs back to back, then
one per ``min_interval``) and happen at least every ``max_interval`` even without requests,
which is what repairs state someone else changed. The shape follows kube-proxy's
BoundedFrequencyRunner.

A run that raises is retried, and the loop itself never dies of it. Retries back off: after
``min_interval`` (1 s when 0), then twice as long after each failure in a row, up to
``max_interval`` (kube-proxy retries a failed restore after its sync period); a request
retries at once (changes still get their run), and a success starts over. A failure is
logged as an error when its message is new or when it comes after the whole backoff; a
request's early retry that fails the same way is logged at -v 2 only. Without permission
to program rules that was one error line a second, for ever.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from uproxy.log import V2, kv

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
        settle: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``settle``: seconds a request waits before its run, for the rest of a change that
        comes in pieces (a Service, then its EndpointSlice) to join it."""
        if min_interval < 0 or max_interval <= 0 or burst < 1:
            raise ValueError("min_interval >= 0, max_interval > 0 and burst >= 1 are required")
        self.name = name
        self._fn = fn
        self._min = min_interval
        self._max = max(max_interval, min_interval)
        self._burst = burst
        self._settle = settle
        self._clock = clock
        self._tokens = float(burst)
        self._refilled = clock()
        self._wakeup = asyncio.Event()
        self.runs = 0
        self.failures = 0
        self._retry_s = 0.0  # the wait after the last failure; 0 after a success
        self._early = False  # this run is a request's, before the backoff was out
        self._last_error = ""

    def request(self) -> None:
        """Ask for a run as soon as the rate limit allows; cheap and idempotent."""
        self._wakeup.set()

    async def loop(self) -> None:
        """Run until cancelled."""
        while True:
            if await self._requested(self._max) and self._settle:  # else a periodic run
                await asyncio.sleep(self._settle)
            await self._take_token()
            self._wakeup.clear()
            try:
                await self._fn()
                self.runs += 1
                self._retry_s = 0.0
                self._early = False
                self._last_error = ""
            except asyncio.CancelledError:
                raise
            except Exception as e:
                await self._failed(e)
                self._wakeup.set()

    async def _failed(self, e: Exception) -> None:
        """Log the failure (see the module docstring) and wait out its backoff, or until
        a request comes."""
        self.failures += 1
        message = str(e)
        early, self._early = self._early, False
        if not early:
            self._retry_s = (
                min(self._max, self._retry_s * 2) if self._retry_s else (self._min or 1.0)
            )
        loud = not early or message != self._last_error
        self._last_error = message
        log.log(
            logging.ERROR if loud else V2,
            "Sync failed, will retry",
            extra=kv(runner=self.name, err=message, retry_in_s=round(self._retry_s, 3)),
        )
        log.debug("Sync failure detail", exc_info=True)
        if await self._requested(self._retry_s):
            self._early = True  # a request: retry now, at the same backoff

    async def _requested(self, timeout: float) -> bool:
        """Wait for a request, at most ``timeout`` seconds; whether one came.

        ``asyncio.timeout``, not ``asyncio.wait_for``: on Python 3.11 a cancellation that
        met a request in the same turn of the loop was lost in ``wait_for``, which returned
        the request instead. The loop then went on to wait for the next one, and a stop
        that came as a change did (a stop cancels the loop) waited for it for ever.
        """
        try:
            async with asyncio.timeout(timeout):
                await self._wakeup.wait()
        except TimeoutError:
            return False
        return True

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
