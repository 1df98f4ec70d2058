"""Fixtures for the Kubernetes-source tests: the API-server double, a kubeconfig for it, the
source itself (against a bare tracker) and the whole proxy in laptop mode (real listeners on
loopback, no kernel rules, so nothing here needs root).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from kubernetes_asyncio.client import ApiClient

from tests.apiserver import ApiServerDouble
from uproxy.sources.kube import KubeSource, make_api_client
from uproxy.tracker import Tracker

if TYPE_CHECKING:
    from uproxy.proxy import Proxy

NODE = "node-a"


@pytest.fixture
async def apiserver() -> AsyncIterator[ApiServerDouble]:
    server = ApiServerDouble()
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
def kubeconfig(apiserver: ApiServerDouble, tmp_path: Path) -> Path:
    return apiserver.write_kubeconfig(tmp_path / "kubeconfig")


@pytest.fixture
async def api_client(kubeconfig: Path) -> AsyncIterator[ApiClient]:
    client = await make_api_client(kubeconfig=str(kubeconfig), master=None)
    try:
        yield client
    finally:
        await client.close()


SourceFactory = Callable[..., Awaitable[tuple[Tracker, KubeSource]]]


@pytest.fixture
async def start_source(api_client: ApiClient) -> AsyncIterator[SourceFactory]:
    """Start a KubeSource feeding a fresh Tracker; options go to KubeSource."""
    tasks: list[asyncio.Task[None]] = []

    async def start(
        *, service_proxy_name: str | None = None, **options: Any
    ) -> tuple[Tracker, KubeSource]:
        tracker = Tracker(service_proxy_name=service_proxy_name)
        source = KubeSource(
            tracker=tracker,
            api_client=api_client,
            node_name=NODE,
            service_proxy_name=service_proxy_name,
            **{"backoff_max_s": 1.0, **options},
        )
        tasks.append(asyncio.create_task(source.run(), name="kube-source-under-test"))
        return tracker, source

    yield start
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task


ProxyFactory = Callable[..., Awaitable["Proxy"]]


@pytest.fixture
async def start_proxy(kubeconfig: Path) -> AsyncIterator[ProxyFactory]:
    """The whole proxy against the double, in laptop mode (rules: none) on 127.0.0.1."""
    # Imported here so that the source's own tests run while the proxy is being built.
    from uproxy.proxy import Proxy
    from uproxy.settings import Settings

    proxies: list[Proxy] = []

    async def start(**overrides: Any) -> Proxy:
        defaults: dict[str, Any] = {
            "kubeconfig": str(kubeconfig),
            "hostname_override": NODE,
            "rules": "none",
            "healthz_bind_address": "",
            "metrics_bind_address": "",
            "iptables_min_sync_period": 0.05,
        }
        settings = Settings(**{**defaults, **overrides})
        proxy = Proxy(settings)
        proxies.append(proxy)
        await proxy.start()
        return proxy

    yield start
    for proxy in proxies:
        await proxy.stop()
