"""Shared test fixtures: root/namespace gating, uvloop, and bounded waiting."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Iterator

import pytest

REQUIRE_ROOT = os.environ.get("UPROXY_REQUIRE_ROOT_TESTS") == "1"


def root_available() -> str | None:
    """None when root tests can run here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, iptables)"
    if not os.path.exists("/usr/sbin/ip") and not os.path.exists("/sbin/ip"):
        return "needs iproute2 (ip netns)"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = root_available()
    if reason is None:
        return
    for item in items:
        if item.get_closest_marker("root") is None:
            continue
        if REQUIRE_ROOT:
            # CI promises these tests run: a missing capability is a failure, not a skip.
            item.add_marker(pytest.mark.usefixtures("_fail_root_required"))
        else:
            item.add_marker(
                pytest.mark.skip(
                    reason=f"{reason}; set UPROXY_REQUIRE_ROOT_TESTS=1 to fail instead"
                )
            )


@pytest.fixture
def _fail_root_required() -> None:
    pytest.fail(f"UPROXY_REQUIRE_ROOT_TESTS=1 but {root_available()}")


@pytest.fixture(autouse=True)
def _same_priority_after() -> Iterator[None]:
    """A test that runs uproxy's control process in this one lowers this process's priority
    (``uproxy.priority``); the tests after it start from where the suite started (nice value
    and the kernel's default time slice), and with the module's state as it was: a process
    left "giving way" yields the CPU in every later channel flush, which a test counting
    yields sees."""
    from uproxy import priority

    before = priority.current()
    state = (
        priority._giving_way,
        priority._interval,
        priority._gave_way,
        priority._yield_paused_until,
    )
    yield
    priority.set_process(before)
    (
        priority._giving_way,
        priority._interval,
        priority._gave_way,
        priority._yield_paused_until,
    ) = state


_HOST_SETTINGS = (
    *(
        f"/proc/sys/net/netfilter/nf_conntrack_{name}"
        for name in (
            "max",
            "tcp_timeout_established",
            "tcp_timeout_close_wait",
            "tcp_be_liberal",
            "udp_timeout",
            "udp_timeout_stream",
        )
    ),
    "/sys/module/nf_conntrack/parameters/hashsize",
    "/proc/self/oom_score_adj",
)


def _host_settings() -> dict[str, str]:
    out = {}
    for path in _HOST_SETTINGS:
        try:
            with open(path) as f:
                out[path] = f.read()
        except OSError:
            pass
    return out


@pytest.fixture(autouse=True)
def _host_settings_untouched() -> Iterator[None]:
    """uproxy sets node settings (``uproxy.nodesetup``) only as the node's proxy process;
    tests do that inside namespaces they make. A test that changed this host's (or this
    process's) fails, and the values are put back."""
    before = _host_settings()
    yield
    after = _host_settings()
    if after != before:
        for path, value in before.items():
            if after.get(path) != value:
                with open(path, "w") as f:
                    f.write(value)
        changed = {p: (before[p].strip(), after.get(p, "").strip()) for p in before}
        pytest.fail(
            f"the test changed host settings: { {p: v for p, v in changed.items() if v[0] != v[1]} }"
        )


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Every async test runs on uvloop, the loop uproxy ships with."""
    import uvloop

    return {"uvloop": uvloop.new_event_loop}


async def wait_for(
    predicate: Callable[[], bool | Awaitable[bool]],
    *,
    timeout: float = 5.0,
    interval: float = 0.02,
    message: str = "condition",
) -> None:
    """Poll ``predicate`` until true; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {message}")
        await asyncio.sleep(interval)


def wait_for_sync(
    predicate: Callable[[], bool],
    *,
    timeout: float = 5.0,
    interval: float = 0.02,
    message: str = "condition",
) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {message}")
        time.sleep(interval)
