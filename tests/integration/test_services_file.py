"""A services file of many services: an edit to one document reaches the data plane alone."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import wait_for
from tests.factories import endpoint, endpoint_slice, service
from tests.integration.backends import NamedBackend, greet
from uproxy.model import Protocol, ServicePortName
from uproxy.proxy import Proxy
from uproxy.settings import Settings

N = 40


def spn(i: int) -> ServicePortName:
    return ServicePortName("default", f"svc-{i}", "http", Protocol.TCP)


def documents(backends: dict[int, NamedBackend], default: NamedBackend) -> list[dict[str, Any]]:
    docs = []
    for i in range(N):
        b = backends.get(i, default)
        docs.append(service(f"svc-{i}", ports=[{"name": "http", "port": 1, "protocol": "TCP"}]))
        docs.append(
            endpoint_slice(
                f"svc-{i}-1",
                f"svc-{i}",
                endpoints=[endpoint(b.host)],
                ports=[{"name": "http", "port": b.port, "protocol": "TCP"}],
            )
        )
    return docs


def save(path: Path, docs: list[dict[str, Any]]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump_all(docs))
    os.replace(tmp, path)  # as editors save: a new inode, so the next poll sees it


@pytest.fixture
async def backends() -> AsyncIterator[list[NamedBackend]]:
    started = [await NamedBackend(f"b{i}", f"127.0.0.{30 + i}").start() for i in (1, 2)]
    yield started
    for b in started:
        await b.close()


async def test_one_edited_service_moves_and_the_others_stay(
    tmp_path: Path, backends: list[NamedBackend]
) -> None:
    b1, b2 = backends
    path = tmp_path / "services.yaml"
    save(path, documents({}, b1))
    proxy = Proxy(
        Settings(
            services=str(path),
            rules="none",
            healthz_bind_address="",
            metrics_bind_address="",
            iptables_min_sync_period=0.05,
        )
    )
    try:
        await proxy.start()
        await asyncio.wait_for(proxy.synced.wait(), 10)
        assert proxy.syncer is not None and proxy.file_source is not None
        listeners = {i: proxy.syncer.ports[spn(i)].cluster for i in range(N)}
        port = {i: lst.port for i, lst in listeners.items() if lst is not None}
        assert len(port) == N and await greet("127.0.0.1", port[7]) == "b1"
        parsed = proxy.file_source.documents_parsed

        save(path, documents({7: b2}, b1))

        async def moved() -> bool:
            return await greet("127.0.0.1", port[7]) == "b2"

        await wait_for(moved, timeout=5, message="svc-7 on its new endpoint")
        assert proxy.file_source.documents_parsed == parsed + 1
        assert {i: proxy.syncer.ports[spn(i)].cluster for i in range(N)} == listeners
        assert await greet("127.0.0.1", port[8]) == "b1"
    finally:
        await proxy.stop()
