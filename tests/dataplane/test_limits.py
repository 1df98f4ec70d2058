"""raise_nofile_limit: the soft fd limit goes up to the hard one."""

from __future__ import annotations

import resource

from uproxy.dataplane.limits import raise_nofile_limit


def test_raises_soft_limit_to_hard() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowered = min(256, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowered, hard))
    try:
        assert raise_nofile_limit() == hard
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
        assert raise_nofile_limit() == hard  # idempotent
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
