"""Issue 5: ``/healthz`` and ``/livez`` of a whole Proxy, in process (no root needed).

A rules backend whose sync blocks on an event stands in for a stuck kernel: with a 0.5 s
sync period a queued sync older than 1 s makes the proxy stale. The Node being deleted is
served by the API-server double, through the real Kubernetes client.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Collection
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from tests.apiserver import ApiServerDouble
from tests.conftest import wait_for
from tests.factories import service
from uproxy.model import IPFamily
from uproxy.proxy import Proxy
from uproxy.rules.base import LocalTraffic, Portal
from uproxy.settings import Settings


class BlockingRules:
    """A rules backend that programs nothing and, while ``gate`` is clear, never returns."""

    name = "blocking"

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.gate.set()
        self.blocked = asyncio.Event()

    async def prepare(self) -> None:

        return None

    async def sync(self, portals: Collection[Portal]) -> None:
        if not self.gate.is_set():
            self.blocked.set()
        await self.gate.wait()

    def set_local_traffic(self, local: LocalTraffic) -> None:
        return None

    def set_host_ip(self, family: IPFamily, host_ip: str) -> None:
        return None

    async def check(self) -> bool:
        return True

    async def cleanup(self) -> None:
        return None

    async def close(self) -> None:
        return None


async def get(port: int, path: str) -> tuple[int, dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{port}{path}") as response,
    ):
        return response.status, json.loads(await response.read())


async def status(port: int, path: str) -> int:
    return (await get(port, path))[0]


def settings(**overrides: Any) -> Settings:
    return Settings(
        hostname_override="node-a",
        rules="none",
        healthz_bind_address="127.0.0.1:0",
        metrics_bind_address="",
        iptables_sync_period=0.5,
        iptables_min_sync_period=0.05,
        **overrides,
    )


@pytest.fixture
async def proxies() -> AsyncIterator[list[Proxy]]:
    started: list[Proxy] = []
    yield started
    for proxy in started:
        await proxy.stop()


def write(path: Path, *names: str) -> None:
    docs = [service(n, cluster_ip=f"10.96.0.{i + 1}") for i, n in enumerate(names)]
    path.write_text(yaml.safe_dump_all(docs))


async def test_healthz_is_503_while_a_sync_is_stuck_and_200_after(
    tmp_path: Path, proxies: list[Proxy]
) -> None:
    services = tmp_path / "services.yaml"
    write(services, "web")
    rules = BlockingRules()
    proxy = Proxy(settings(services=str(services)), rules=rules)
    proxies.append(proxy)
    await proxy.start()
    await wait_for(proxy.synced.is_set, message="first sync")
    assert proxy.healthz is not None
    port = proxy.healthz.port
    code, body = await get(port, "/healthz")
    assert code == 200
    assert set(body) == {"lastUpdated", "currentTime", "nodeEligible"}

    rules.gate.clear()
    try:
        # The next sync (the periodic one: with no rules backend a new service changes no
        # portals) hangs in the rules backend; a change queued meanwhile waits behind it.
        await wait_for(rules.blocked.is_set, timeout=5, message="a sync to block")
        write(services, "web", "api")
        await wait_for(
            lambda: _is(port, "/healthz", 503), timeout=5, message="/healthz 503 while stuck"
        )
        assert await status(port, "/livez") == 503  # stale: the sync loop is not keeping up
        _code, body = await get(port, "/healthz")
        assert body["lastUpdated"] != body["currentTime"]
    finally:
        rules.gate.set()
    await wait_for(lambda: _is(port, "/healthz", 200), timeout=5, message="/healthz 200 again")
    assert await status(port, "/livez") == 200


async def _is(port: int, path: str, code: int) -> bool:
    return await status(port, path) == code


def node(name: str, *, deleting: bool = False, taint: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    spec: dict[str, Any] = {}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        meta["finalizers"] = ["example.com/hold"]
    if taint is not None:
        spec["taints"] = [{"key": taint, "value": "1700000000", "effect": "NoSchedule"}]
    return {"apiVersion": "v1", "kind": "Node", "metadata": meta, "spec": spec, "status": {}}


@pytest.mark.parametrize(
    "going",
    [
        pytest.param({"deleting": True}, id="deleted"),
        pytest.param({"taint": "ToBeDeletedByClusterAutoscaler"}, id="autoscaler-taint"),
    ],
)
async def test_healthz_is_503_and_livez_200_while_the_node_is_going(
    tmp_path: Path, going: dict[str, Any]
) -> None:
    async with ApiServerDouble() as api:
        api.create("Node", node("node-a", taint="example.com/other"))  # other taints: eligible
        api.create("Service", service("web"))
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        proxy = Proxy(settings(kubeconfig=str(kubeconfig)), rules=BlockingRules())
        try:
            await proxy.start()
            await wait_for(proxy.synced.is_set, timeout=10, message="first sync")
            assert proxy.healthz is not None
            port = proxy.healthz.port
            assert await status(port, "/healthz") == 200

            api.update("Node", node("node-a", **going))
            await wait_for(lambda: _is(port, "/healthz", 503), timeout=5, message="/healthz 503")
            _code, body = await get(port, "/healthz")
            assert body["nodeEligible"] is False
            assert await status(port, "/livez") == 200
        finally:
            await proxy.stop()  # before the API server goes away
