"""The pipe a relayed direction moves its bytes through once it is a bulk transfer.

splice(2) moves bytes from a socket into a pipe and from the pipe into the other socket
by reference to the kernel's pages: Python never sees them, and nothing is copied to user
space and back. It needs a pipe per direction (two fds and a pipe buffer), opened once
the direction has moved ``DataplaneSettings.splice_threshold`` bytes: most connections
(requests and their replies) end before that and never pay for one.

Pipe size (``splice_pipe_size``, 1 MiB): fewer, larger splices. Proxy CPU per GB through
``iperf3``, medians of 5 interleaved runs on a shared machine: 0.25 s with the default
64 KiB pipe, 0.23 with 256 KiB, 0.20 with 1 MiB. The kernel counts each open pipe's size
against its owner's ``fs.pipe-user-pages-soft`` (64 MiB by default); past it a process
without CAP_SYS_RESOURCE or CAP_SYS_ADMIN cannot grow a pipe (it keeps 64 KiB) and then
gets 2-page pipes, which this module refuses (the direction copies). The DaemonSet runs as
uid 0 with NET_ADMIN and NET_RAW only: every root process's pipes on the node count.

Wake-ups: while the pipe holds bytes the destination has not taken, the source's input
events are off (EPOLLIN removed from its interest; RDHUP and errors still come): every
segment that arrived meanwhile woke the loop for nothing, half to two thirds of the wakes of
a bulk transfer held up by its reader (about 3,800 wakes per GB through ``iperf3``; perf
stat, strace and counters in the relay). Proxy CPU per GB, 1 stream, pinned, interleaved
runs: 0.237 -> 0.227 s (lower in every pair) and 0.281 -> 0.259 s (medians of 5) in two
sessions; throughput within the noise. A low-water mark on the source
(SO_RCVLOWAT) cut more (0.276 -> 0.224 with it) but holds the tail of a burst that no FIN
follows until a timer drops the mark: 1-2 ms more for the last bytes of a response on a
kept-alive connection, which a relay must not add.

fds: a pipe is a luxury, the sockets are the service. Near the fd limit the fds go to
accepting and dialing: a pipe is kept only while, after it, every dial in flight still
has an fd and a quarter of the fd table is still free (fds are allocated lowest-first, so
the pipe's higher fd bounds what is left, as in ``fdreserve``). Otherwise, and when
``pipe2`` itself fails (EMFILE, ENFILE), the direction stays on the copy path for good.
"""

from __future__ import annotations

import fcntl
import os

from uproxy.dataplane.fdreserve import FD_RESERVE

SPLICE_FLAGS = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK
# A new pipe's size (16 pages). Past fs.pipe-user-pages-soft, an unprivileged user's new
# pipes get 2 pages: that would take more splices per byte than copying, so copy instead.
_MIN_PIPE_SIZE = 16 * 4096


class Pipe:
    """A non-blocking pipe, how many bytes wait in it for the destination socket, and whether
    the source's input events are off meanwhile."""

    __slots__ = ("held", "muted", "r", "size", "small_wakes", "w")

    def __init__(self, r: int, w: int, size: int) -> None:
        self.r = r
        self.w = w
        self.size = size  # bytes asked per splice from the source socket
        self.held = 0
        self.muted = False  # the source's input events are off while ``held``
        self.small_wakes = 0  # wake-ups in a row that brought little (``relay``)

    def close(self) -> None:
        os.close(self.r)
        os.close(self.w)


def open_pipe(size: int) -> Pipe | None:
    """A pipe of ``size`` bytes for one direction, or None when fds or pipe pages are short."""
    try:
        r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    free_after = FD_RESERVE.limit - 1 - w
    if free_after >= FD_RESERVE.undialed + FD_RESERVE.limit // 4:
        try:
            got = fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, size)
        except OSError:  # EPERM: over pipe-max-size, or the user's pipe pages (see above)
            got = fcntl.fcntl(w, fcntl.F_GETPIPE_SZ)
        if got >= _MIN_PIPE_SIZE:
            return Pipe(r, w, got)
    os.close(r)
    os.close(w)
    return None
