"""Giving the event loop back during long control work.

The loop that runs the control plane also answers the health-check node ports and /healthz,
serves /metrics and passes every change on to the data-plane workers (it relayed every byte
too before the workers took that over), so bulk work (applying a listing of 10,000 Services,
binding 10,000 proxy ports) must not hold it for long. ``TimeSlice`` lets a loop over many
items pause at its budget: ``await ts.tick()`` after each item costs one counter test, reads
the clock every ``check_every`` items, and yields to the loop (one ``asyncio.sleep(0)``:
every ready callback runs) once ``budget_s`` has passed since the last yield.

The default budget, 10 ms, keeps a health check's or a worker's wait behind control work
well below the ~50 ms anyone would notice, while adding one loop pass per 10 ms of work (a
few us).

Every clock read (every ``check_every`` items) also offers the CPU to a waiting worker
(``priority.give_way``): the loop's slice is for the loop's other work, the offer is for the
other processes on this CPU.
"""

from __future__ import annotations

import asyncio
import time

from uproxy import priority

DEFAULT_BUDGET_S = 0.01


class TimeSlice:
    __slots__ = ("_budget", "_check_every", "_count", "_since", "yields")

    def __init__(self, budget_s: float = DEFAULT_BUDGET_S, *, check_every: int = 4) -> None:
        self._budget = budget_s
        self._check_every = check_every
        self._count = 0
        self._since = time.perf_counter()
        self.yields = 0

    async def tick(self) -> None:
        """One item done: yield to the loop when the budget is spent."""
        if self.due():
            await asyncio.sleep(0)
            self._since = time.perf_counter()

    def due(self, items: int = 1) -> bool:
        """``items`` done, where the caller cannot await (a generator that its consumer
        drives): whether the budget is spent, so the caller lets the loop run now."""
        self._count += items
        if self._count < self._check_every:
            return False
        self._count = 0
        now = time.perf_counter()
        priority.give_way(now)
        if now - self._since < self._budget:
            return False
        self.yields += 1
        self._since = time.perf_counter()
        return True
