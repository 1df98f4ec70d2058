"""raise_nofile_limit: up to the hard limit without privilege, past it with CAP_SYS_RESOURCE.

Each case runs in a child process started under a low limit (``prlimit``), so the test
process keeps its own.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CAP_SYS_RESOURCE = 24


def _has_sys_resource() -> bool:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> CAP_SYS_RESOURCE & 1)
    return False


# Some sandboxes run root without it; there the hard limit cannot go up, for uproxy either.
needs_sys_resource = pytest.mark.skipif(
    not _has_sys_resource(), reason="raising the hard limit needs CAP_SYS_RESOURCE"
)

CHILD = """
import resource
from uproxy.dataplane.limits import raise_nofile_limit
got = raise_nofile_limit(50000)
again = raise_nofile_limit(50000)
print(got, again, *resource.getrlimit(resource.RLIMIT_NOFILE))
"""


def _run(soft: int, hard: int, *, drop_privilege: bool) -> list[int]:
    def limit() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    # Without CAP_SYS_RESOURCE, as a container that is not given it.
    drop = ["setpriv", "--bounding-set", "-sys_resource", "--"] if drop_privilege else []
    out = subprocess.run(
        [*drop, sys.executable, "-c", CHILD],
        preexec_fn=limit,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    return [int(x) for x in out.stdout.split()]


def test_soft_limit_goes_up_to_the_hard_one_without_privilege() -> None:
    got = _run(256, 4096, drop_privilege=_has_sys_resource())
    assert got == [4096, 4096, 4096, 4096]


@needs_sys_resource
def test_hard_limit_goes_up_with_privilege() -> None:
    assert _run(256, 4096, drop_privilege=False) == [50000, 50000, 50000, 50000]


@needs_sys_resource
def test_a_higher_limit_is_kept() -> None:
    assert _run(60000, 60000, drop_privilege=False) == [60000, 60000, 60000, 60000]
