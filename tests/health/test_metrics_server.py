"""The metrics endpoint: /metrics parses and carries uproxy's series; /proxyMode; /healthz."""

from __future__ import annotations

import errno
import socket
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from uproxy import __version__, metrics
from uproxy.metrics_server import MetricsServer

from .helpers import assert_same_bytes, refused


@pytest.fixture
async def server() -> AsyncIterator[MetricsServer]:
    srv = MetricsServer(address="127.0.0.1", port=0)
    await srv.start()
    yield srv
    await srv.close()


async def test_metrics_parse_and_include_build_info(
    http: aiohttp.ClientSession, server: MetricsServer
) -> None:
    metrics.ACCEPT_PAUSED.labels(reason="emfile").inc()  # a labelled series to find below
    async with http.get(f"http://127.0.0.1:{server.port}/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    # An Info metric is exposed in the text format as a gauge named *_info.
    (sample,) = families["uproxy_build_info"].samples
    assert sample.labels["version"] == __version__
    assert sample.value == 1.0
    paused = families["uproxy_accept_paused"]
    assert any(
        s.labels.get("reason") == "emfile" and s.value >= 1.0
        for s in paused.samples
        if s.name == "uproxy_accept_paused_total"
    )
    assert "kubeproxy_sync_proxy_rules_duration_seconds" in families


async def test_proxy_mode_and_healthz(http: aiohttp.ClientSession, server: MetricsServer) -> None:
    for path, want in (("/proxyMode", b"userspace"), ("/healthz", b"ok")):
        async with http.get(f"http://127.0.0.1:{server.port}{path}") as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"] == "text/plain; charset=utf-8"
            assert_same_bytes(await resp.read(), want)
    async with http.get(f"http://127.0.0.1:{server.port}/nope") as resp:
        assert resp.status == 404


async def test_port_in_use_raises_eaddrinuse_and_leaves_nothing_open(
    unused_port: int, listening_blocker: Callable[[str, int], socket.socket]
) -> None:
    blocker = listening_blocker("127.0.0.1", unused_port)
    srv = MetricsServer(address="127.0.0.1", port=unused_port)
    with pytest.raises(OSError) as info:
        await srv.start()
    assert info.value.errno == errno.EADDRINUSE
    assert srv.port == 0
    blocker.close()
    assert await refused("127.0.0.1", unused_port)
    await srv.close()


async def test_address_not_on_this_host_raises_oserror(unused_port: int) -> None:
    # 192.0.2.0/24 is TEST-NET-1: never assigned to this machine.
    srv = MetricsServer(address="192.0.2.1", port=unused_port)
    with pytest.raises(OSError) as info:
        await srv.start()
    assert info.value.errno == errno.EADDRNOTAVAIL


async def test_unresolvable_address_raises_oserror(unused_port: int) -> None:
    srv = MetricsServer(address="not an address", port=unused_port)
    with pytest.raises(OSError) as info:
        await srv.start()
    assert info.value.errno is not None


async def test_close_releases_port() -> None:
    srv = MetricsServer(address="127.0.0.1", port=0)
    await srv.start()
    port = srv.port
    assert not await refused("127.0.0.1", port)
    await srv.close()
    assert await refused("127.0.0.1", port)
