"""The same servers on uvloop, the loop uproxy runs on in production.

uvloop reports bind errors and socket addresses through its own code, so the errno the
caller prints and the port it logs are checked there too.
"""

from __future__ import annotations

import asyncio
import errno
import json
import socket

import aiohttp
import pytest

from uproxy.health import HealthzServer, ProxyHealth
from uproxy.healthcheck import HealthCheckServers, HealthCheckSpec
from uproxy.metrics_server import MetricsServer

from .helpers import free_port, refused

uvloop = pytest.importorskip("uvloop")


async def _scenario() -> None:
    health = ProxyHealth(sync_period_s=30.0)
    hc_port = free_port()
    hcs = HealthCheckServers(addresses=["127.0.0.1"], proxy_health=health)
    healthz = HealthzServer(proxy_health=health, address="127.0.0.1", port=0)
    metrics = MetricsServer(address="127.0.0.1", port=0)
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=5), connector=connector
    ) as http:
        try:
            await healthz.start()
            await metrics.start()
            await hcs.sync({("ns", "svc"): HealthCheckSpec("ns", "svc", hc_port)})
            hcs.set_local_endpoints({("ns", "svc"): 4})
            async with http.get(f"http://127.0.0.1:{hc_port}/") as resp:
                assert resp.status == 200
                assert json.loads(await resp.read())["localEndpoints"] == 4
            async with http.get(f"http://127.0.0.1:{healthz.port}/healthz") as resp:
                assert resp.status == 200
            async with http.get(f"http://127.0.0.1:{metrics.port}/proxyMode") as resp:
                assert await resp.read() == b"userspace"

            clash = MetricsServer(address="127.0.0.1", port=healthz.port)
            with pytest.raises(OSError) as info:
                await clash.start()
            assert info.value.errno == errno.EADDRINUSE
        finally:
            await hcs.close()
            await healthz.close()
            await metrics.close()
    assert await refused("127.0.0.1", hc_port)


def test_servers_on_uvloop() -> None:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_scenario())


def test_port_in_use_retried_on_uvloop() -> None:
    async def scenario() -> None:
        port = free_port()
        with socket.socket() as blocker:
            blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            blocker.bind(("127.0.0.1", port))
            blocker.listen(1)
            hcs = HealthCheckServers(
                addresses=["127.0.0.1"], proxy_health=ProxyHealth(sync_period_s=1.0)
            )
            await hcs.sync({("ns", "svc"): HealthCheckSpec("ns", "svc", port)})
            assert hcs.failures == {("ns", "svc"): port}
        await hcs.sync({("ns", "svc"): HealthCheckSpec("ns", "svc", port)})
        assert hcs.ports == {("ns", "svc"): port}
        await hcs.close()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(scenario())
