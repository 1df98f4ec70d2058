"""Child processes that must not outlive the control process (data-plane workers, the
python-iptables helper): the kernel signals them when it dies, however it dies."""

from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(sig: signal.Signals = signal.SIGTERM) -> None:
    """Ask the kernel for ``sig`` when the parent dies (the thread of it that started us,
    for uproxy's children the control process's main thread)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # the caller's other ways of noticing (a closed channel, a pipe) remain
