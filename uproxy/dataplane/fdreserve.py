"""The process's file descriptors, shared by every TCP listener: keep the last ones for dials.

Every accepted connection needs a second fd for its endpoint. Near the fd limit, accepting
pauses while the free fds are still enough for the dials in flight: a burst accepted into
the last fds would otherwise make every dial fail with EMFILE, and be reset whole. A dial
that still meets EMFILE (fds taken elsewhere in the process) is not the endpoint's fault: it
waits for a pair to close and tries again, within the dial budget, instead of resetting its
client.
"""

from __future__ import annotations

import asyncio
import errno
import resource

# accept() errors that mean "out of a resource": pause accepting instead of spinning.
RESOURCE_ERRNOS = {
    errno.EMFILE: "emfile",
    errno.ENFILE: "enfile",
    errno.ENOBUFS: "enobufs",
    errno.ENOMEM: "enomem",
}


class _FdReserve:
    """Keeps accepting from taking the fds that accepted connections need for their dials.

    Every accepted connection needs a second fd for its endpoint. Without a reserve, a burst
    accepted near the fd limit takes every free fd, every dial then fails with EMFILE, and
    the whole burst is reset: nothing is served while the limit lasts. fds are allocated
    lowest-first, so when accept() returns fd N, every fd below N is in use and at most
    ``limit - 1 - N`` are free. Accepting goes on only while one more accept would still
    leave a free fd for every connection waiting to dial; otherwise it pauses (reason
    ``fd_reserve``) until connections close. One per process: all listeners share the fd
    table.

    The bound is an upper one (a pair that closed frees low fds, other parts of the process
    open files), so a dial can still meet EMFILE. It then waits in ``freed()`` for a pair to
    close and tries again, rather than resetting a client it has already accepted.
    """

    __slots__ = ("limit", "undialed", "waiters")

    def __init__(self) -> None:
        self.limit = 1 << 62
        self.undialed = 0  # connections accepted whose first dial has not finished
        self.waiters: list[asyncio.Future[None]] = []  # dials waiting for a free fd

    def refresh_limit(self) -> None:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self.limit = soft if soft != resource.RLIM_INFINITY and soft > 0 else 1 << 62

    def full_after(self, fd: int) -> bool:
        """True once accepting past ``fd`` could leave a waiting dial without an fd."""
        return self.undialed >= self.limit - 2 - fd

    async def freed(self, loop: asyncio.AbstractEventLoop, deadline: float, poll: float) -> bool:
        """Wait until a pair closes, or ``poll`` seconds (fds freed elsewhere wake nobody).

        False, at once, when ``deadline`` (loop time) has passed.
        """
        now = loop.time()
        if now >= deadline:
            return False
        waiter: asyncio.Future[None] = loop.create_future()
        self.waiters.append(waiter)
        timer = loop.call_later(min(poll, deadline - now), wake, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            if not waiter.done():
                self.waiters.remove(waiter)
        return True

    def released(self, loop: asyncio.AbstractEventLoop) -> None:
        """A pair closed: wake the dials waiting for fds (on the next pass, once it closed)."""
        waiters, self.waiters = self.waiters, []
        for waiter in waiters:
            loop.call_soon(wake, waiter)


def wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


FD_RESERVE = _FdReserve()
