"""/healthz and /livez: staleness of queued syncs, node eligibility, body format, counters."""

from __future__ import annotations

import asyncio
import datetime
import errno
import json
import socket
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest
from prometheus_client import REGISTRY

from uproxy import httpserver
from uproxy.health import HealthzServer, ProxyHealth, rfc3339

from .helpers import FakeClock, assert_same_bytes, out_of_fds, refused

SYNC_PERIOD_S = 30.0


def counter(name: str, code: str) -> float:
    return REGISTRY.get_sample_value(name, {"code": code}) or 0.0


@pytest.fixture
def health(clock: FakeClock) -> ProxyHealth:
    return ProxyHealth(sync_period_s=SYNC_PERIOD_S, clock=clock, ages=clock)


@pytest.fixture
async def server(health: ProxyHealth) -> AsyncIterator[HealthzServer]:
    srv = HealthzServer(proxy_health=health, address="127.0.0.1", port=0)
    await srv.start()
    yield srv
    await srv.close()


async def get(http: aiohttp.ClientSession, srv: HealthzServer, path: str) -> tuple[int, bytes]:
    async with http.get(f"http://127.0.0.1:{srv.port}{path}") as resp:
        body = await resp.read()
        assert resp.headers["Content-Type"] == "application/json"
        assert resp.headers["X-Content-Type-Options"] == "nosniff"
        assert int(resp.headers["Content-Length"]) == len(body)
        assert resp.headers["Server"] == "uproxy"  # no interpreter or library versions
        return resp.status, body


def test_rfc3339_is_utc_with_fraction() -> None:
    assert rfc3339(0.0) == "1970-01-01T00:00:00Z"
    assert rfc3339(1_700_000_000.25) == "2023-11-14T22:13:20.25Z"
    parsed = datetime.datetime.fromisoformat(rfc3339(1_700_000_000.5))
    assert parsed.timestamp() == 1_700_000_000.5
    assert parsed.utcoffset() == datetime.timedelta(0)


def test_stale_only_after_two_sync_periods(health: ProxyHealth, clock: FakeClock) -> None:
    assert health.healthy() and health.live()  # nothing queued yet: a starting proxy is healthy
    health.queued()
    clock.advance(2 * SYNC_PERIOD_S - 0.001)
    assert health.healthy() and health.live()
    clock.advance(0.001)
    assert not health.healthy() and not health.live()
    health.started()
    health.updated()
    assert health.healthy() and health.live()


def test_oldest_queued_sync_counts(health: ProxyHealth, clock: FakeClock) -> None:
    health.queued()
    clock.advance(SYNC_PERIOD_S)
    health.queued()  # must not move the oldest pending time forward
    clock.advance(SYNC_PERIOD_S)
    assert not health.live()


def test_updated_clears_queue_then_new_queue_starts_fresh(
    health: ProxyHealth, clock: FakeClock
) -> None:
    health.queued()
    clock.advance(SYNC_PERIOD_S)
    health.started()
    health.updated()
    clock.advance(10 * SYNC_PERIOD_S)  # long quiet time without changes is healthy
    assert health.live()
    health.queued()
    clock.advance(2 * SYNC_PERIOD_S - 1)
    assert health.live()


def test_request_made_during_a_sync_waits_for_the_next_one(
    health: ProxyHealth, clock: FakeClock
) -> None:
    """A sync answers what was queued before it started, not what arrived meanwhile."""
    health.queued()
    health.started()
    clock.advance(SYNC_PERIOD_S)
    health.queued()  # a change the running sync did not take
    health.updated()
    health.started()  # the next sync takes it, and hangs
    clock.advance(2 * SYNC_PERIOD_S - 0.001)
    assert health.live()
    clock.advance(0.001)
    assert not health.live()


def test_failed_sync_keeps_its_oldest_request(health: ProxyHealth, clock: FakeClock) -> None:
    """A sync that raised never calls updated(): the retry must not restart the clock."""
    health.queued()
    health.started()  # fails
    clock.advance(SYNC_PERIOD_S)
    health.queued()
    health.started()  # the retry, which hangs
    clock.advance(SYNC_PERIOD_S)
    assert not health.live()
    health.updated()
    assert health.live()


def test_a_wall_clock_step_forward_does_not_age_a_queued_sync(clock: FakeClock) -> None:
    """An NTP correction or a resumed VM moves the wall clock by minutes or hours at once:
    counted as time a queued sync waited, /livez said 503 (a restart by the kubelet) and
    /healthz took the node out of its load balancers, with every sync on time."""
    health = ProxyHealth(sync_period_s=SYNC_PERIOD_S, clock=clock)
    health.queued()
    clock.advance(3600.0)
    assert health.live() and health.healthy()
    ok, body = health.report(include_node=False)
    assert ok and body["currentTime"] == rfc3339(clock.now)  # the answers keep the wall clock


def test_a_wall_clock_step_back_does_not_hide_a_hung_sync(clock: FakeClock) -> None:
    ages = FakeClock(0.0)
    health = ProxyHealth(sync_period_s=SYNC_PERIOD_S, clock=clock, ages=ages)
    health.queued()
    health.started()  # and hangs
    clock.advance(-3600.0)
    ages.advance(2 * SYNC_PERIOD_S)
    assert not health.live()


def test_node_eligibility_affects_healthz_only(health: ProxyHealth) -> None:
    health.set_node_eligible(False)
    assert not health.healthy()
    assert health.live()
    health.set_node_eligible(True)
    assert health.healthy()


def test_rejects_non_positive_sync_period() -> None:
    with pytest.raises(ValueError, match="sync_period_s"):
        ProxyHealth(sync_period_s=0)


async def test_healthy_before_first_sync(
    http: aiohttp.ClientSession, server: HealthzServer, clock: FakeClock
) -> None:
    now = rfc3339(clock.now)
    status, body = await get(http, server, "/healthz")
    assert status == 200
    want = json.dumps({"lastUpdated": now, "currentTime": now, "nodeEligible": True})
    assert_same_bytes(body, want.encode())
    status, body = await get(http, server, "/livez")
    assert status == 200
    assert json.loads(body) == {"lastUpdated": now, "currentTime": now}


async def test_healthz_turns_503_when_stale_and_back(
    http: aiohttp.ClientSession, server: HealthzServer, health: ProxyHealth, clock: FakeClock
) -> None:
    health.updated()
    synced_at = rfc3339(clock.now)
    clock.advance(5)
    health.queued()
    clock.advance(2 * SYNC_PERIOD_S - 0.5)
    assert (await get(http, server, "/healthz"))[0] == 200

    clock.advance(1)
    status, body = await get(http, server, "/healthz")
    assert status == 503
    doc = json.loads(body)
    # Unhealthy: lastUpdated is the real time of the last finished sync.
    assert doc == {
        "lastUpdated": synced_at,
        "currentTime": rfc3339(clock.now),
        "nodeEligible": True,
    }
    status, body = await get(http, server, "/livez")
    assert status == 503
    assert json.loads(body)["lastUpdated"] == synced_at

    health.started()
    health.updated()
    status, body = await get(http, server, "/healthz")
    assert status == 200
    assert json.loads(body)["lastUpdated"] == rfc3339(clock.now)
    assert (await get(http, server, "/livez"))[0] == 200


async def test_stale_before_any_sync_reports_zero_time(
    http: aiohttp.ClientSession, server: HealthzServer, health: ProxyHealth, clock: FakeClock
) -> None:
    health.queued()
    clock.advance(3 * SYNC_PERIOD_S)
    status, body = await get(http, server, "/livez")
    assert status == 503
    assert json.loads(body)["lastUpdated"] == "0001-01-01T00:00:00Z"


async def test_ineligible_node_fails_healthz_not_livez(
    http: aiohttp.ClientSession, server: HealthzServer, health: ProxyHealth
) -> None:
    health.set_node_eligible(False)
    status, body = await get(http, server, "/healthz")
    assert status == 503
    assert json.loads(body)["nodeEligible"] is False
    status, body = await get(http, server, "/livez")
    assert status == 200
    assert "nodeEligible" not in json.loads(body)
    health.set_node_eligible(True)
    assert (await get(http, server, "/healthz"))[0] == 200


async def test_a_stopping_proxy_fails_healthz_not_livez(
    http: aiohttp.ClientSession, server: HealthzServer, health: ProxyHealth
) -> None:
    # While uproxy drains, load balancers must stop sending; the kubelet must not restart it.
    assert health.serving()
    health.set_stopping()
    assert (await get(http, server, "/healthz"))[0] == 503
    assert (await get(http, server, "/livez"))[0] == 200
    assert not health.healthy() and not health.serving() and health.live()


async def test_counters_move_by_requests_per_code(
    http: aiohttp.ClientSession, server: HealthzServer, health: ProxyHealth, clock: FakeClock
) -> None:
    names = ("kubeproxy_proxy_healthz_total", "kubeproxy_proxy_livez_total")
    before = {(n, c): counter(n, c) for n in names for c in ("200", "503")}

    for _ in range(3):
        await get(http, server, "/healthz")
    for _ in range(2):
        await get(http, server, "/livez")
    health.set_node_eligible(False)
    for _ in range(4):
        await get(http, server, "/healthz")  # 503: node ineligible
    await get(http, server, "/livez")  # 200: node ignored
    health.queued()
    clock.advance(2 * SYNC_PERIOD_S)
    for _ in range(5):
        await get(http, server, "/livez")  # 503: stale

    delta = {key: counter(*key) - value for key, value in before.items()}
    assert delta == {
        ("kubeproxy_proxy_healthz_total", "200"): 3,
        ("kubeproxy_proxy_healthz_total", "503"): 4,
        ("kubeproxy_proxy_livez_total", "200"): 3,
        ("kubeproxy_proxy_livez_total", "503"): 5,
    }


async def test_other_paths_are_404(http: aiohttp.ClientSession, server: HealthzServer) -> None:
    before = counter("kubeproxy_proxy_healthz_total", "200")
    async with http.get(f"http://127.0.0.1:{server.port}/healthz/extra") as resp:
        assert resp.status == 404
        assert resp.headers["Server"] == "uproxy"
    assert counter("kubeproxy_proxy_healthz_total", "200") == before


async def test_close_releases_port(health: ProxyHealth) -> None:
    srv = HealthzServer(proxy_health=health, address="127.0.0.1", port=0)
    assert srv.port == 0
    await srv.start()
    port = srv.port
    assert port > 0
    assert not await refused("127.0.0.1", port)
    await srv.close()
    assert srv.port == 0
    assert await refused("127.0.0.1", port)


async def test_bind_failure_raises_oserror_with_errno(
    health: ProxyHealth,
    unused_port: int,
    listening_blocker: Callable[[str, int], socket.socket],
) -> None:
    listening_blocker("127.0.0.1", unused_port)
    srv = HealthzServer(proxy_health=health, address="127.0.0.1", port=unused_port)
    with pytest.raises(OSError) as info:
        await srv.start()
    assert info.value.errno == errno.EADDRINUSE
    assert srv.port == 0
    await srv.close()


async def test_a_server_that_gets_no_socket_raises(health: ProxyHealth) -> None:
    """Out of fds, the server came up listening nowhere (the event loop skips a socket it
    cannot create) and said it listened, so nothing retried it: it is an OSError now."""
    srv = HealthzServer(proxy_health=health, address="127.0.0.1", port=0)
    with out_of_fds(), pytest.raises(OSError) as info:
        await srv.start()
    assert info.value.errno == errno.EMFILE
    assert srv.port == 0
    await srv.start()  # with fds again
    assert srv.port > 0
    await srv.close()


async def test_an_idle_connection_is_closed(
    health: ProxyHealth, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An idle keep-alive connection held one of the control process's fds for an hour."""
    monkeypatch.setattr(httpserver, "KEEPALIVE_S", 0.3)
    srv = HealthzServer(proxy_health=health, address="127.0.0.1", port=0)
    await srv.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
        writer.write(b"GET /livez HTTP/1.1\r\nHost: node\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        assert await asyncio.wait_for(reader.read(), timeout=5.0) == b""  # closed by the server
        writer.close()
    finally:
        await srv.close()
