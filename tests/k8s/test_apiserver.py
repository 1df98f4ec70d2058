"""The API-server double itself, through the real kubernetes-asyncio client.

Tests and benchmarks trust the double to behave like kube-apiserver; these pin the parts they
rely on: paging, selectors, watch semantics, 410s, dropped streams, auth and TLS.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient

from tests.apiserver import ApiServerDouble
from tests.apiserver.selectors import parse_label_selector
from tests.conftest import wait_for

from .helpers import node, service

SVC = "Service"


@pytest.fixture
def core(api_client: ApiClient) -> client.CoreV1Api:
    return client.CoreV1Api(api_client)


async def list_json(core: client.CoreV1Api, **kwargs: Any) -> Any:
    resp: Any = await core.list_service_for_all_namespaces(_preload_content=False, **kwargs)
    try:
        return resp.status, json.loads(await resp.read())
    finally:
        resp.release()


async def events(resp: Any, n: int) -> list[dict[str, Any]]:
    out = []
    for _ in range(n):
        line = await resp.content.readline()
        assert line, "stream ended early"
        out.append(json.loads(line))
    return out


@pytest.fixture
async def watch_services(core: client.CoreV1Api) -> AsyncIterator[Any]:
    responses: list[Any] = []

    async def start(**kwargs: Any) -> Any:
        resp = await core.list_service_for_all_namespaces(
            watch=True, _preload_content=False, **kwargs
        )
        responses.append(resp)
        return resp

    yield start
    for resp in responses:
        resp.close()


async def test_paging_is_a_consistent_snapshot(
    apiserver: ApiServerDouble, core: client.CoreV1Api
) -> None:
    for i in range(7):
        apiserver.create(SVC, service(f"s{i}"))
    status, page1 = await list_json(core, limit=3)
    assert status == 200 and len(page1["items"]) == 3
    assert page1["metadata"]["remainingItemCount"] == 4
    apiserver.create(SVC, service("late"))  # after the snapshot: not in this listing
    _, page2 = await list_json(core, limit=3, _continue=page1["metadata"]["continue"])
    _, page3 = await list_json(core, limit=3, _continue=page2["metadata"]["continue"])
    got = [o["metadata"]["name"] for p in (page1, page2, page3) for o in p["items"]]
    assert got == [f"s{i}" for i in range(7)]
    assert "continue" not in page3["metadata"]
    assert page3["metadata"]["resourceVersion"] == page1["metadata"]["resourceVersion"]
    # List items carry no kind, as kube-apiserver sends them.
    assert "kind" not in page1["items"][0] and page1["kind"] == "ServiceList"


async def test_expired_continuation_is_410(
    apiserver: ApiServerDouble, core: client.CoreV1Api
) -> None:
    for i in range(4):
        apiserver.create(SVC, service(f"s{i}"))
    _, page1 = await list_json(core, limit=2)
    apiserver.compact()
    status, body = await list_json(core, limit=2, _continue=page1["metadata"]["continue"])
    assert status == 410 and body["reason"] == "Expired" and body["code"] == 410


async def test_selectors(apiserver: ApiServerDouble, core: client.CoreV1Api) -> None:
    apiserver.create(SVC, service("a", labels={"tier": "web"}))
    apiserver.create(SVC, service("b", labels={"tier": "db"}))
    apiserver.create(SVC, service("c", namespace="other"))
    for selector, want in (
        ("tier=web", {"a"}),
        ("tier!=web", {"b", "c"}),
        ("tier", {"a", "b"}),
        ("!tier", {"c"}),
        ("tier in (web, db)", {"a", "b"}),
        ("tier notin (web)", {"b", "c"}),
    ):
        _, body = await list_json(core, label_selector=selector)
        assert {o["metadata"]["name"] for o in body["items"]} == want, selector
    _, body = await list_json(core, field_selector="metadata.namespace=other")
    assert [o["metadata"]["name"] for o in body["items"]] == ["c"]
    apiserver.create("Node", node("n1"))
    apiserver.create("Node", node("n2"))
    resp: Any = await core.list_node(field_selector="metadata.name=n2", _preload_content=False)
    nodes = json.loads(await resp.read())
    resp.release()
    assert [o["metadata"]["name"] for o in nodes["items"]] == ["n2"]
    with pytest.raises(ValueError):
        parse_label_selector("a in (x")


async def test_watch_replays_filters_and_bookmarks(
    apiserver: ApiServerDouble, watch_services: Any
) -> None:
    apiserver.create(SVC, service("a", labels={"tier": "web"}))
    rv = apiserver.resource_version
    apiserver.create(SVC, service("b", labels={"tier": "web"}))
    resp = await watch_services(
        resource_version=str(rv), label_selector="tier=web", allow_watch_bookmarks=True
    )
    (added,) = await events(resp, 1)
    assert added["type"] == "ADDED" and added["object"]["metadata"]["name"] == "b"
    assert added["object"]["kind"] == "Service"
    # Leaving the selector is a DELETED, entering it an ADDED; other versions are not sent.
    apiserver.update(SVC, service("a", labels={"tier": "db"}))
    apiserver.create(SVC, service("x", labels={"tier": "db"}))
    apiserver.update(SVC, service("x", labels={"tier": "web"}))
    assert apiserver.send_bookmarks() == 1
    left, entered, bookmark = await events(resp, 3)
    assert (left["type"], left["object"]["metadata"]["name"]) == ("DELETED", "a")
    assert (entered["type"], entered["object"]["metadata"]["name"]) == ("ADDED", "x")
    assert bookmark["type"] == "BOOKMARK"
    assert bookmark["object"]["metadata"]["resourceVersion"] == str(apiserver.resource_version)


async def test_watch_from_compacted_version_is_410_event(
    apiserver: ApiServerDouble, watch_services: Any
) -> None:
    apiserver.create(SVC, service("a"))
    rv = apiserver.resource_version
    apiserver.create(SVC, service("b"))
    apiserver.compact()
    resp = await watch_services(resource_version=str(rv))
    (error,) = await events(resp, 1)
    assert error["type"] == "ERROR" and error["object"]["code"] == 410
    assert await resp.content.readline() == b""


async def test_watch_from_a_version_the_server_has_not_reached_is_504_too_large(
    apiserver: ApiServerDouble, watch_services: Any
) -> None:
    apiserver.create(SVC, service("a"))
    rv = apiserver.resource_version
    apiserver.create(SVC, service("b"))
    apiserver.rewind(rv)  # a restored etcd: the client has seen newer versions
    resp = await watch_services(resource_version=str(rv + 1))
    body = json.loads(await resp.read())
    assert resp.status == 504 and body["reason"] == "Timeout"
    assert body["details"]["causes"][0]["reason"] == "ResourceVersionTooLarge"
    assert body["message"].startswith("Too large resource version")


async def test_a_bookmark_never_claims_a_version_whose_event_is_not_sent_yet(
    apiserver: ApiServerDouble, watch_services: Any
) -> None:
    resp = await watch_services(resource_version="0", allow_watch_bookmarks=True)
    apiserver.send_bookmarks()
    apiserver.create(SVC, service("a"))  # queued behind the bookmark
    bookmark, added = await events(resp, 2)
    assert bookmark["type"] == "BOOKMARK" and added["type"] == "ADDED"
    version = int(bookmark["object"]["metadata"]["resourceVersion"])
    assert version < int(added["object"]["metadata"]["resourceVersion"])


async def test_dropped_watch_raises_payload_error(
    apiserver: ApiServerDouble, watch_services: Any
) -> None:
    apiserver.create(SVC, service("a"))
    resp = await watch_services(resource_version="0")
    (added,) = await events(resp, 1)
    assert added["object"]["metadata"]["name"] == "a"
    assert apiserver.drop_watches() == 1
    with pytest.raises(aiohttp.ClientPayloadError):
        await resp.content.readline()


async def test_timeout_seconds_ends_cleanly(
    apiserver: ApiServerDouble, watch_services: Any
) -> None:
    resp = await watch_services(resource_version=str(apiserver.resource_version), timeout_seconds=1)
    assert await resp.content.readline() == b""


@pytest.mark.parametrize("cert_tool", ["cryptography", "openssl"])
async def test_auth_and_tls(cert_tool: str) -> None:
    if cert_tool == "cryptography":
        pytest.importorskip("cryptography")
    async with ApiServerDouble(cert_tool=cert_tool) as apiserver:
        url = f"{apiserver.url}/api/v1/services"
        good = ssl.create_default_context(cafile=apiserver.ca_file)
        async with aiohttp.ClientSession() as session:
            async with session.get(url, ssl=good) as r:
                assert r.status == 401
            headers = {"Authorization": f"Bearer {apiserver.token}"}
            async with session.get(url, ssl=good, headers=headers) as r:
                assert r.status == 200
                assert (await r.json())["kind"] == "ServiceList"
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                async with session.get(url, ssl=ssl.create_default_context(), headers=headers):
                    pass
        ca_dir = Path(apiserver.ca_file).parent
    assert not ca_dir.exists()  # stop() removes the key material


async def test_restart_keeps_state_and_port(
    apiserver: ApiServerDouble, core: client.CoreV1Api
) -> None:
    apiserver.create(SVC, service("a"))
    port, rv = apiserver.port, apiserver.resource_version
    await apiserver.go_down()
    with pytest.raises(aiohttp.ClientConnectionError):
        await list_json(core)
    await apiserver.restart()
    status, body = await list_json(core)
    assert status == 200 and apiserver.port == port
    assert body["metadata"]["resourceVersion"] == str(rv)
    assert [o["metadata"]["name"] for o in body["items"]] == ["a"]


async def test_periodic_bookmarks_and_closed_watches_are_forgotten(
    apiserver: ApiServerDouble, watch_services: Any
) -> None:
    apiserver.bookmark_interval_s = 0.2
    apiserver.create(SVC, service("a"))
    rv = str(apiserver.resource_version)
    resp = await watch_services(resource_version=rv, allow_watch_bookmarks=True)
    (bookmark,) = await asyncio.wait_for(events(resp, 1), 3)
    assert bookmark["type"] == "BOOKMARK"
    assert bookmark["object"]["metadata"]["resourceVersion"] == rv
    assert apiserver.open_watches(SVC) == 1
    resp.close()
    await wait_for(lambda: apiserver.open_watches(SVC) == 0, timeout=3)
