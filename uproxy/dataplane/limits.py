"""Process limits the data plane depends on.

Each relayed TCP connection holds two fds and each UDP flow one; every proxy port holds a
listening socket in every worker, two while a relist swaps it for another, and the control
process holds every socket of every port's group (``uproxy.workers``): one per TCP port, one
per worker for a UDP or ClientIP-affinity port. The usual soft limit of 1,024 fds would cap
uproxy at ~500 connections, and a hard limit of 20,000 at fewer than 10,000 service ports.
At start uproxy raises its limit to ``WANTED`` (capped by ``fs.nr_open``) when it may raise
the hard limit (CAP_SYS_RESOURCE, as the DaemonSet runs it), else its soft limit to the hard
one, which needs no privilege. Workers inherit it.
Exhaustion is still handled (listeners pause accepting on EMFILE); this only moves the
ceiling.
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger("uproxy.dataplane.limits")

WANTED = 1 << 20


def _nr_open() -> int:
    try:
        with open("/proc/sys/fs/nr_open") as f:
            return int(f.read())
    except (OSError, ValueError):
        return WANTED


def raise_nofile_limit(wanted: int = WANTED) -> int:
    """Raise RLIMIT_NOFILE towards ``wanted`` as far as allowed; the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = min(wanted, _nr_open())
    if hard == resource.RLIM_INFINITY:
        hard = target
    if soft != resource.RLIM_INFINITY and soft >= target:
        return soft
    if hard < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, target))
        except (ValueError, OSError):
            pass  # no CAP_SYS_RESOURCE: up to the hard limit only
        else:
            log.debug("Raised the open-file limit", extra={"kv": {"from": soft, "to": target}})
            return target
    if soft >= hard:
        return soft
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
