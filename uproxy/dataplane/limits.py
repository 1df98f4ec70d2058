"""Process limits the data plane depends on.

Each relayed TCP connection holds two fds and each UDP flow one; the usual soft limit of
1,024 fds would cap uproxy at ~500 connections. Raising the soft limit to the hard limit
needs no privilege, so it is done once at start. Exhaustion is still handled (listeners
pause accepting on EMFILE), this only moves the ceiling.
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger("uproxy.dataplane.limits")


def raise_nofile_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit and return the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft == hard:
        return soft if hard == resource.RLIM_INFINITY else hard
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:
        log.warning(
            "Could not raise the open-file limit",
            extra={"kv": {"soft": soft, "hard": hard, "error": str(exc)}},
        )
        return soft
    log.debug("Raised the open-file limit", extra={"kv": {"from": soft, "to": hard}})
    return hard
