"""The Kubernetes source against the API-server double, observed through the tracker.

Everything goes over TLS through the unpatched kubernetes-asyncio client. These tests pin the
watch loop's behaviour: list then watch, bookmarks remembered, relist on 410 Gone only,
re-watch (not relist) after a dropped or silent stream, periodic relist, filtering.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import gc
import json
import logging
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import cast

import pytest
import yaml
from kubernetes_asyncio.client import ApiClient

from tests.apiserver import ApiServerDouble
from tests.conftest import wait_for
from uproxy import heap
from uproxy.model import Protocol, ServicePortName
from uproxy.sources import kube
from uproxy.sources.kube import (
    MAX_EVENT_BYTES,
    KubeConfigError,
    KubeSource,
    Listing,
    Obj,
    _Lines,
    make_api_client,
    service_label_selector,
)
from uproxy.tracker import Kind, Tracker

from .conftest import NODE, SourceFactory
from .helpers import endpoint_slice, headless_labels, node, proxy_name_labels, service

SVC = "Service"
EPS = "EndpointSlice"


def spn(name: str, namespace: str = "default") -> ServicePortName:
    return ServicePortName(namespace, name, "http", Protocol.TCP)


def ips(tracker: Tracker, name: str) -> list[str]:
    state = tracker.snapshot().get(spn(name))
    return sorted(e.ip for e in state.endpoints) if state else []


def names(tracker: Tracker) -> set[str]:
    return {k.name for k in tracker.snapshot()}


async def test_lists_then_follows_changes(
    apiserver: ApiServerDouble, start_source: SourceFactory
) -> None:
    apiserver.create(SVC, service("web"))
    apiserver.create(EPS, endpoint_slice("web-1", service_name="web", ips=["10.1.0.1"], port=80))
    apiserver.create("Node", node(NODE, zone="zone-a"))
    tracker, _ = await start_source()
    await wait_for(lambda: tracker.synced and ips(tracker, "web") == ["10.1.0.1"], timeout=5)
    await wait_for(lambda: tracker.node is not None and tracker.node.zone == "zone-a")
    await wait_for(lambda: apiserver.open_watches(SVC) == 1 and apiserver.open_watches(EPS) == 1)

    # Watch: add, update and delete show up without another list.
    apiserver.create(SVC, service("api", cluster_ip="10.96.0.11"))
    apiserver.create(EPS, endpoint_slice("api-1", service_name="api", ips=["10.2.0.1"], port=80))
    apiserver.update(
        EPS, endpoint_slice("web-1", service_name="web", ips=["10.1.0.1", "10.1.0.2"], port=80)
    )
    await wait_for(lambda: ips(tracker, "api") == ["10.2.0.1"])
    await wait_for(lambda: ips(tracker, "web") == ["10.1.0.1", "10.1.0.2"])
    apiserver.delete(SVC, service("api"))
    await wait_for(lambda: names(tracker) == {"web"})
    draining = node(NODE, zone="zone-b", ip="192.0.2.20")
    draining["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    draining["spec"]["taints"] = [
        {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}
    ]
    apiserver.update("Node", draining)
    await wait_for(lambda: tracker.node is not None and tracker.node.zone == "zone-b")
    assert tracker.node is not None
    assert tracker.node.deleting and tracker.node.addresses == ("192.0.2.20",)
    assert tracker.node.taints == ("node.kubernetes.io/unschedulable:NoSchedule",)
    apiserver.update("Node", node(NODE, zone="zone-c"))  # back in service
    await wait_for(lambda: tracker.node is not None and tracker.node.eligible)
    apiserver.delete("Node", node(NODE, zone="zone-c"))
    # Deleted, it stays as being deleted: not eligible for load balancers' traffic.
    await wait_for(lambda: tracker.node is not None and not tracker.node.eligible)
    assert tracker.node is not None and tracker.node.deleting and tracker.node.zone == "zone-c"
    assert apiserver.list_count(SVC) == 1
    assert apiserver.list_count(EPS) == 1
    # The watch starts from the list's version and asks for bookmarks.
    params = apiserver.last_params[("watch", SVC)]
    assert params["allowWatchBookmarks"].lower() == "true"
    assert params["labelSelector"] == service_label_selector(None)
    assert apiserver.last_params[("watch", "Node")]["fieldSelector"] == f"metadata.name={NODE}"


async def test_a_node_it_cannot_read_is_one_warning_and_the_last_good_one_stays(
    apiserver: ApiServerDouble, start_source: SourceFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """This Node updated into something uproxy cannot read (a taint that is not an object):
    one warning naming the field, and the Node as last read stays (its zone, its IPs). A
    good update is taken again; deleted while unreadable, the last good one is marked as
    being deleted (not eligible for load balancers' traffic)."""
    apiserver.create("Node", node(NODE, zone="zone-a", ip="192.0.2.10"))
    tracker, _ = await start_source()
    await wait_for(lambda: tracker.node is not None and tracker.node.zone == "zone-a")
    bad = node(NODE, zone="zone-b", ip="192.0.2.20")
    bad["spec"]["taints"] = ["not-an-object"]
    caplog.clear()
    apiserver.update("Node", bad)
    await wait_for(
        lambda: any(r.getMessage() == "Skipping invalid object" for r in caplog.records),
        message="the warning",
    )
    skipped = [r for r in caplog.records if r.getMessage() == "Skipping invalid object"]
    assert len(skipped) == 1 and skipped[0].kv["field"] == "spec.taints[0]", skipped[0].kv  # type: ignore[attr-defined]
    assert tracker.node is not None
    assert (tracker.node.zone, tracker.node.addresses) == ("zone-a", ("192.0.2.10",))

    apiserver.update("Node", node(NODE, zone="zone-c", ip="192.0.2.10"))
    await wait_for(lambda: tracker.node is not None and tracker.node.zone == "zone-c")
    apiserver.update("Node", bad)
    apiserver.delete("Node", bad)
    await wait_for(lambda: tracker.node is not None and tracker.node.deleting, message="deleting")
    assert tracker.node.zone == "zone-c" and not tracker.node.eligible


async def test_nothing_is_synced_before_both_lists(
    apiserver: ApiServerDouble, start_source: SourceFactory
) -> None:
    apiserver.create(SVC, service("web"))
    apiserver.create(EPS, endpoint_slice("web-1", service_name="web", ips=["10.1.0.1"], port=80))
    apiserver.hold_lists(EPS)
    tracker, _ = await start_source()
    await wait_for(lambda: apiserver.list_count(SVC) == 1 and apiserver.list_count(EPS) == 1)
    await wait_for(lambda: apiserver.open_watches(SVC) == 1)
    assert not tracker.synced
    apiserver.release_lists(EPS)
    await wait_for(lambda: tracker.synced and ips(tracker, "web") == ["10.1.0.1"])


async def test_paged_list_is_applied_whole(
    apiserver: ApiServerDouble, start_source: SourceFactory
) -> None:
    for i in range(1234):
        apiserver.create(SVC, service(f"s{i:04}", cluster_ip=f"10.96.{i // 200}.{i % 200 + 1}"))
    tracker, _ = await start_source()
    await wait_for(lambda: apiserver.open_watches(SVC) == 1, timeout=10)
    assert len(names(tracker)) == 1234
    assert apiserver.list_count(SVC) == 3  # pages of 500
    assert apiserver.last_params[("list", SVC)]["limit"] == "500"


class _HeldPages:
    """Service listings whose first page is held in ``add`` until released: what the source
    asks the API server for meanwhile shows whether it reads ahead."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.holding = asyncio.Event()
        self.release = asyncio.Event()
        self._held_once = False
        real = Tracker.listing

        def listing(tracker: Tracker, kind: Kind) -> Listing:
            inner = real(tracker, kind)
            return self._wrap(inner) if kind is Kind.SERVICE else inner

        monkeypatch.setattr(Tracker, "listing", listing)

    def _wrap(self, inner: Listing) -> Listing:
        held = self

        class Held:
            async def add(self, objs: Iterable[Obj]) -> None:
                if not held._held_once:
                    held._held_once = True
                    held.holding.set()
                    await held.release.wait()
                await inner.add(objs)

            async def finish(self) -> None:
                await inner.finish()

            def abandon(self) -> None:
                inner.abandon()

        return cast(Listing, Held())


async def _first_page_held(
    apiserver: ApiServerDouble, start_source: SourceFactory, monkeypatch: pytest.MonkeyPatch
) -> tuple[Tracker, _HeldPages]:
    """1,234 services (3 pages); returns once page 1 is held and page 2 has been asked for."""
    pages = _HeldPages(monkeypatch)
    for i in range(1234):
        apiserver.create(SVC, service(f"s{i:04}", cluster_ip=f"10.96.{i // 200}.{i % 200 + 1}"))
    tracker, _ = await start_source()
    await asyncio.wait_for(pages.holding.wait(), timeout=10)
    await wait_for(lambda: apiserver.list_count(SVC) == 2, timeout=5)
    return tracker, pages


async def test_next_page_is_asked_for_while_a_page_is_applied(
    apiserver: ApiServerDouble, start_source: SourceFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Page 1 is being applied (held): page 2 is already asked for, page 3 not yet.
    tracker, pages = await _first_page_held(apiserver, start_source, monkeypatch)
    assert apiserver.list_count(SVC) == 2
    assert not tracker.synced
    pages.release.set()
    await wait_for(lambda: apiserver.open_watches(SVC) == 1, timeout=10)
    assert len(names(tracker)) == 1234
    assert apiserver.list_count(SVC) == 3


async def test_continuation_expired_while_reading_ahead_lists_again_whole(
    apiserver: ApiServerDouble, start_source: SourceFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    tracker, pages = await _first_page_held(apiserver, start_source, monkeypatch)
    # Page 2 came ahead; the snapshot behind page 3's continuation goes before it is asked.
    apiserver.delete(SVC, service("s0000"))
    apiserver.create(SVC, service("late", cluster_ip="10.97.0.1"))
    apiserver.compact()
    pages.release.set()
    await wait_for(lambda: apiserver.open_watches(SVC) == 1, timeout=10)
    want = {f"s{i:04}" for i in range(1, 1234)} | {"late"}
    assert names(tracker) == want
    # Pages 1-2, page 3's 410, then a whole listing of 3 pages.
    assert apiserver.list_count(SVC) == 6


async def test_relists_after_410_and_converges(
    apiserver: ApiServerDouble, start_source: SourceFactory
) -> None:
    for name in ("a", "b", "c"):
        apiserver.create(SVC, service(name))
        apiserver.create(
            EPS, endpoint_slice(f"{name}-1", service_name=name, ips=["10.1.0.1"], port=80)
        )
    tracker, _ = await start_source()
    await wait_for(lambda: tracker.synced and names(tracker) == {"a", "b", "c"})
    await wait_for(lambda: apiserver.open_watches(SVC) == 1 and apiserver.open_watches(EPS) == 1)
    lists_before = apiserver.list_count(SVC)

    # Changes the client will never see as events: the stream is cut, history compacted.
    apiserver.drop_watches()
    apiserver.delete(SVC, service("a"))
    apiserver.create(SVC, service("d"))
    apiserver.update(
        EPS, endpoint_slice("b-1", service_name="b", ips=["10.1.0.1", "10.1.0.9"], port=80)
    )
    apiserver.compact()
    await wait_for(lambda: names(tracker) == {"b", "c", "d"}, timeout=5)
    await wait_for(lambda: ips(tracker, "b") == ["10.1.0.1", "10.1.0.9"], timeout=5)
    assert apiserver.list_count(SVC) == lists_before + 1


async def test_server_back_at_an_older_version_is_relisted_not_retried(
    apiserver: ApiServerDouble, start_source: SourceFactory
) -> None:
    apiserver.create(SVC, service("a"))
    apiserver.create(EPS, endpoint_slice("a-1", service_name="a", ips=["10.1.0.1"], port=80))
    tracker, source = await start_source()
    # Every feed's watch open (the Node's too): a bookmark reaches only the watches open.
    await wait_for(
        lambda: tracker.synced and all(apiserver.open_watches(k) == 1 for k in (SVC, EPS, "Node"))
    )
    old_rv = apiserver.resource_version
    for i in range(20):  # the client's version moves well ahead of the backup's
        apiserver.create("Node", node(f"other-{i}"))
    apiserver.send_bookmarks()
    now = str(apiserver.resource_version)
    await wait_for(lambda: all(feed.rv == now for feed in source.feeds))
    lists_before = apiserver.list_count(EPS)
    # A restored etcd: back at an older version, and the endpoint moved meanwhile.
    apiserver.drop_watches()
    apiserver.rewind(old_rv)
    apiserver.update(EPS, endpoint_slice("a-1", service_name="a", ips=["10.1.0.2"], port=80))
    await wait_for(lambda: ips(tracker, "a") == ["10.1.0.2"], timeout=5)
    assert apiserver.list_count(EPS) == lists_before + 1  # relisted once, not retried forever


async def test_dropped_stream_rewatches_without_relist(
    apiserver: ApiServerDouble, start_source: SourceFactory
) -> None:
    apiserver.create(SVC, service("a"))
    tracker, _ = await start_source()
    await wait_for(lambda: apiserver.open_watches(SVC) == 1 and apiserver.open_watches(EPS) == 1)
    watches = apiserver.watch_count(SVC)
    apiserver.drop_watches()
    apiserver.create(SVC, service("b"))  # happens while no stream is open
    await wait_for(lambda: names(tracker) == {"a", "b"}, timeout=5)
    assert apiserver.watch_count(SVC) > watches
    assert apiserver.list_count(SVC) == 1


async def test_bookmark_advances_the_remembered_version(
    apiserver: ApiServerDouble, start_source: SourceFactory
) -> None:
    apiserver.create(SVC, service("a"))
    tracker, source = await start_source()
    await wait_for(lambda: apiserver.open_watches(SVC) == 1)
    # The global version moves on without a Service event (another node's Node object).
    for i in range(5):
        apiserver.create("Node", node(f"other-{i}"))
    listed_at = source.feeds[0].rv
    assert apiserver.send_bookmarks() >= 1
    await wait_for(lambda: source.feeds[0].rv == str(apiserver.resource_version))
    assert listed_at != source.feeds[0].rv
    # Compact at the bookmark: re-watching from it is still valid, so no relist.
    apiserver.compact()
    apiserver.drop_watches()
    await wait_for(lambda: apiserver.open_watches(SVC) == 1 and apiserver.watch_count(SVC) >= 2)
    apiserver.create(SVC, service("b"))
    await wait_for(lambda: names(tracker) == {"a", "b"})
    assert apiserver.list_count(SVC) == 1


async def test_a_watch_never_answered_is_given_up_and_retried(
    apiserver: ApiServerDouble,
    start_source: SourceFactory,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No headers ever (a dead peer behind a pooled connection): the feed used to hang there
    # for good, its relists too. Now the request is given up and made again.
    monkeypatch.setattr(kube, "WATCH_HEADERS_TIMEOUT_S", 0.3)
    apiserver.create(SVC, service("a"))
    tracker, _ = await start_source()
    await wait_for(lambda: tracker.synced and apiserver.open_watches(SVC) == 1)
    apiserver.swallow_watches(SVC)
    apiserver.drop_watches()
    await wait_for(lambda: apiserver.swallowed(SVC) >= 2, timeout=5)  # given up, asked again
    apiserver.answer_watches(SVC)
    apiserver.create(SVC, service("b"))
    await wait_for(lambda: names(tracker) == {"a", "b"}, timeout=5)
    failed = [r.kv for r in caplog.records if r.getMessage() == "Watch failed; retrying"]  # type: ignore[attr-defined]
    assert any(kv["resource"] == "Service" and "Timeout" in kv["error"] for kv in failed), failed


async def test_watches_that_end_at_once_with_nothing_are_retried_with_a_backoff(
    apiserver: ApiServerDouble,
    start_source: SourceFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Something in the way (a proxy, a load balancer) ends every watch at once with an
    empty 200: each one was opened again at once, ~650 requests a second per resource, with
    no line. client-go counts it a failure ("very short watch") and backs off; so does this."""
    apiserver.create(SVC, service("a"))
    tracker, _ = await start_source(backoff_max_s=0.4)
    await wait_for(lambda: tracker.synced and apiserver.open_watches(SVC) == 1)
    apiserver.cut_watches(SVC)
    watches = apiserver.watch_count(SVC)
    apiserver.end_watches()
    await wait_for(lambda: apiserver.watch_count(SVC) >= watches + 3, timeout=5)
    started = time.monotonic()
    counted = apiserver.watch_count(SVC)
    await wait_for(lambda: apiserver.watch_count(SVC) >= counted + 3, timeout=5)
    # Three more watches took at least two waits of the capped backoff's lower half.
    assert time.monotonic() - started >= 0.4
    said = [r for r in caplog.records if r.getMessage().startswith("Watch ended at once")]
    assert said and said[0].levelname == "WARNING"
    apiserver.answer_watches(SVC)
    apiserver.create(SVC, service("b"))
    await wait_for(lambda: names(tracker) == {"a", "b"}, timeout=5)
    assert apiserver.list_count(SVC) == 1  # re-watched from its version, never relisted


BAD_LINES = {
    "not JSON": (b"<html>502 Bad Gateway</html>\n", "JSONDecodeError"),
    "not an object": (b'["ADDED", {}]\n', "not an object"),
    "no object": (b'{"type": "MODIFIED"}\n', "has no object"),
    "an error": (
        b'{"type": "ERROR", "object": {"kind": "Status", "code": 500, '
        b'"message": "etcdserver: request timed out"}}\n',
        "etcdserver: request timed out",
    ),
}


@pytest.mark.parametrize("bad", sorted(BAD_LINES))
async def test_a_watch_line_it_cannot_use_is_one_warning_and_the_watch_resumes(
    apiserver: ApiServerDouble,
    start_source: SourceFactory,
    caplog: pytest.LogCaptureFixture,
    bad: str,
) -> None:
    """Whatever a broken server (or a proxy in the way) puts in a watch stream: one warning
    line without a traceback, the watch is opened again from the last version it had, and
    the change that came right behind the bad line is not lost (no relist needed)."""
    line, said = BAD_LINES[bad]
    apiserver.create(SVC, service("a"))
    tracker, _ = await start_source(backoff_max_s=0.2)
    await wait_for(lambda: tracker.synced and apiserver.open_watches(SVC) == 1)
    watches = apiserver.watch_count(SVC)
    caplog.clear()
    assert apiserver.send_raw(SVC, line) == 1
    apiserver.create(SVC, service("b"))  # its event follows the bad line on the stream
    await wait_for(lambda: names(tracker) == {"a", "b"}, timeout=5)
    failed = [r for r in caplog.records if r.getMessage() == "Watch failed; retrying"]
    assert len(failed) == 1, [r.getMessage() for r in caplog.records]
    assert said in failed[0].kv["error"], failed[0].kv  # type: ignore[attr-defined]
    assert failed[0].levelno == logging.WARNING and failed[0].exc_info is None
    assert apiserver.watch_count(SVC) == watches + 1  # watched again, from where it was
    assert apiserver.list_count(SVC) == 1  # never listed again


async def test_a_list_it_cannot_use_is_one_warning_and_listed_again(
    apiserver: ApiServerDouble, start_source: SourceFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """Lists answered 200 with what is not a list: each is one warning line without a
    traceback, then the listing is asked for again and the source syncs."""
    apiserver.create(SVC, service("a"))
    broken = {
        b"<html>502 Bad Gateway</html>": "JSONDecodeError",
        b'["not", "a", "list"]': "not an object",
        b'{"kind": "ServiceList", "metadata": {}}': "no items or metadata",
        b'{"kind": "ServiceList", "metadata": {}, "items": []}': "no resourceVersion",
    }
    apiserver.break_lists(SVC, *broken)
    tracker, _ = await start_source(backoff_max_s=0.2)
    await wait_for(lambda: tracker.synced and names(tracker) == {"a"}, timeout=10)
    failed = [r for r in caplog.records if r.getMessage() == "Listing failed; retrying"]
    assert len(failed) == len(broken), [r.getMessage() for r in caplog.records]
    for record, said in zip(failed, broken.values(), strict=True):
        assert said in record.kv["error"], record.kv  # type: ignore[attr-defined]
        assert record.exc_info is None
    assert apiserver.list_count(SVC) == len(broken) + 1


FORBIDDEN = (
    b'{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":'
    b'"services is forbidden: User \\"system:serviceaccount:kube-system:uproxy\\" cannot list '
    b'resource \\"services\\" in API group \\"\\" at the cluster scope","reason":"Forbidden",'
    b'"details":{"kind":"services"},"code":403}'
)
BAD_GATEWAY = (
    b"<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n"
    b"<center><h1>502 Bad Gateway</h1></center>\r\n</body>\r\n</html>\r\n"
)


async def test_a_list_refused_is_one_line_saying_why_and_listed_again(
    apiserver: ApiServerDouble, start_source: SourceFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """A list answered with an error: RBAC's 403 (the API server's Status, whose message
    names the user and the resource), a proxy's 502 page. Each is one warning line with the
    status and what the answer said (a page on one line), no traceback; listed again, the
    source syncs once the server answers."""
    apiserver.create(SVC, service("a"))
    apiserver.break_lists(SVC, FORBIDDEN, FORBIDDEN, status=403)
    apiserver.break_lists(SVC, BAD_GATEWAY, status=502)
    tracker, _ = await start_source(backoff_max_s=0.2)
    await wait_for(lambda: tracker.synced and names(tracker) == {"a"}, timeout=10)
    failed = [r for r in caplog.records if r.getMessage() == "Listing failed; retrying"]
    errors = [r.kv["error"] for r in failed]  # type: ignore[attr-defined]
    forbidden = (
        '403 services is forbidden: User "system:serviceaccount:kube-system:uproxy" cannot '
        'list resource "services" in API group "" at the cluster scope'
    )
    assert [e.split(": ", 1)[1] for e in errors] == [
        forbidden,
        forbidden,
        "502 <html> <head><title>502 Bad Gateway</title></head> <body> <center><h1>502 Bad "
        "Gateway</h1></center> </body> </html>",
    ], errors
    assert all(r.exc_info is None and r.levelno == logging.WARNING for r in failed)
    assert apiserver.list_count(SVC) == 4


async def test_a_watch_event_of_an_unknown_type_is_skipped_and_the_stream_goes_on(
    apiserver: ApiServerDouble, start_source: SourceFactory, caplog: pytest.LogCaptureFixture
) -> None:
    apiserver.create(SVC, service("a"))
    tracker, _ = await start_source()
    await wait_for(lambda: tracker.synced and apiserver.open_watches(SVC) == 1)
    watches = apiserver.watch_count(SVC)
    apiserver.send_raw(SVC, b'{"type": "PATCHED", "object": {"metadata": {}}}\n')
    apiserver.create(SVC, service("b"))
    await wait_for(lambda: names(tracker) == {"a", "b"}, timeout=5)
    skipped = [r for r in caplog.records if r.getMessage() == "Skipping unknown watch event"]
    assert [r.kv for r in skipped] == [{"resource": "Service", "type": "PATCHED"}]  # type: ignore[attr-defined]
    assert apiserver.watch_count(SVC) == watches  # the same stream carried on


def source_of(client: ApiClient, *, backoff_max_s: float) -> tuple[Tracker, KubeSource]:
    """A KubeSource of its own API client (the fixture's has the double's kubeconfig)."""
    tracker = Tracker()
    source = KubeSource(
        tracker=tracker,
        api_client=client,
        node_name=NODE,
        service_proxy_name=None,
        backoff_max_s=backoff_max_s,
    )
    return tracker, source


@contextlib.asynccontextmanager
async def following(client: ApiClient) -> AsyncIterator[Tracker]:
    """A source on ``client`` running (its backoff capped at 0.5 s) for the block's time;
    the client is closed after."""
    tracker, source = source_of(client, backoff_max_s=0.5)
    task = asyncio.create_task(source.run())
    try:
        yield tracker
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await client.close()


async def follows_a_rotated_token(
    apiserver: ApiServerDouble, client: ApiClient, token: Path
) -> None:
    """A source on ``client`` (whose kubeconfig names the ``token`` file) syncs service "a",
    then, with the token rotated in the API double and in the file and the watches dropped,
    sees service "b": the new token was read. The client is closed after."""
    async with following(client) as tracker:
        await wait_for(lambda: tracker.synced and names(tracker) == {"a"}, timeout=5)
        apiserver.token = "rotated-" + apiserver.token
        token.write_text(apiserver.token)
        apiserver.drop_watches()
        apiserver.create(SVC, service("b"))
        await wait_for(lambda: names(tracker) == {"a", "b"}, timeout=5)


async def test_a_rotated_token_file_is_read_again(
    apiserver: ApiServerDouble, tmp_path: Path
) -> None:
    # kubeadm's kube-proxy kubeconfig names the projected service-account token, which the
    # kubelet rotates: a token read once turned into 401s for ever.
    token = tmp_path / "token"
    token.write_text(apiserver.token)
    config = yaml.safe_load(apiserver.write_kubeconfig(tmp_path / "kubeconfig").read_text())
    config["users"][0]["user"] = {"tokenFile": "token"}  # relative to the kubeconfig
    (tmp_path / "kubeconfig").write_text(yaml.safe_dump(config))
    apiserver.create(SVC, service("a"))
    client = await make_api_client(kubeconfig=str(tmp_path / "kubeconfig"), master=None)
    await follows_a_rotated_token(apiserver, client, token)


async def test_kubeconfig_env_of_several_files_is_merged_and_its_token_file_followed(
    apiserver: ApiServerDouble, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """$KUBECONFIG as kubectl users set it: paths joined by ':', a missing one skipped. The
    context is in the first file, the cluster and the user (with a rotated tokenFile,
    relative to its own file's directory) in the last."""
    config = yaml.safe_load(apiserver.write_kubeconfig(tmp_path / "full").read_text())
    (tmp_path / "contexts").write_text(
        yaml.safe_dump({"contexts": config["contexts"], "current-context": "double"})
    )
    creds = tmp_path / "creds"
    creds.mkdir()
    token = creds / "token"
    token.write_text(apiserver.token)
    config["users"][0]["user"] = {"tokenFile": "token"}
    del config["contexts"], config["current-context"]
    (creds / "kubeconfig").write_text(yaml.safe_dump(config))
    joined = f"{tmp_path / 'contexts'}:{tmp_path / 'missing'}:{creds / 'kubeconfig'}"
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", joined)
    apiserver.create(SVC, service("a"))
    client = await make_api_client(kubeconfig=None, master=None)
    assert client.configuration.host == apiserver.url
    await follows_a_rotated_token(apiserver, client, token)


EXEC_PLUGIN = """
import datetime, json, sys
token_file, calls_file, lifetime = sys.argv[1], sys.argv[2], float(sys.argv[3])
with open(calls_file, "a") as calls:
    calls.write("called\\n")
status = {"token": open(token_file).read().strip()}
if lifetime:
    expiry = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=lifetime)
    status["expirationTimestamp"] = expiry.strftime("%Y-%m-%dT%H:%M:%SZ")
print(json.dumps({
    "apiVersion": "client.authentication.k8s.io/v1beta1",
    "kind": "ExecCredential",
    "status": status,
}))
"""


def exec_kubeconfig(apiserver: ApiServerDouble, tmp_path: Path, lifetime_s: float) -> Path:
    """A kubeconfig whose user is an ``exec`` plugin that gives the token in ``token`` (valid
    for ``lifetime_s``, or with no expiry when 0) and counts its runs in ``calls``."""
    (tmp_path / "token").write_text(apiserver.token)
    (tmp_path / "plugin.py").write_text(EXEC_PLUGIN)
    config = yaml.safe_load(apiserver.write_kubeconfig(tmp_path / "kubeconfig").read_text())
    config["users"][0]["user"] = {
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1beta1",
            "command": sys.executable,
            "args": [
                str(tmp_path / "plugin.py"),
                str(tmp_path / "token"),
                str(tmp_path / "calls"),
                str(lifetime_s),
            ],
        }
    }
    (tmp_path / "kubeconfig").write_text(yaml.safe_dump(config))
    return tmp_path / "kubeconfig"


def plugin_runs(tmp_path: Path) -> int:
    calls = tmp_path / "calls"
    return len(calls.read_text().splitlines()) if calls.exists() else 0


@pytest.mark.parametrize("lifetime_s", [0, 3600], ids=["no-expiry", "expiry-far-ahead"])
async def test_an_exec_credential_refused_by_the_api_server_is_asked_for_again(
    apiserver: ApiServerDouble, tmp_path: Path, lifetime_s: float
) -> None:
    """EKS, GKE and AKS kubeconfigs get their token from a plugin, and the token is rotated:
    the plugin used to run once, and uproxy then got 401s for ever while serving what it
    last knew. A 401 runs it again (before its token's expiry too), as client-go does."""
    kubeconfig = exec_kubeconfig(apiserver, tmp_path, lifetime_s)
    apiserver.create(SVC, service("a"))
    client = await make_api_client(kubeconfig=str(kubeconfig), master=None)
    assert plugin_runs(tmp_path) == 1
    await follows_a_rotated_token(apiserver, client, tmp_path / "token")
    assert apiserver.unauthorized >= 1  # the old token was tried, and refused
    assert plugin_runs(tmp_path) == 2  # once for the 401, not once per request


async def test_an_exec_credential_is_asked_for_again_before_it_expires(
    apiserver: ApiServerDouble, tmp_path: Path
) -> None:
    # A token that expires within the margin is replaced before the next request: no 401.
    kubeconfig = exec_kubeconfig(apiserver, tmp_path, kube.EXEC_CREDENTIAL_MARGIN_S + 3600)
    apiserver.create(SVC, service("a"))
    client = await make_api_client(kubeconfig=str(kubeconfig), master=None)
    async with following(client) as tracker:
        # The watches are open before the token is rotated: one asked for with the old
        # token and answered after the rotation would be a 401 of the test's own making.
        await wait_for(
            lambda: (
                tracker.synced
                and names(tracker) == {"a"}
                and all(apiserver.open_watches(k) == 1 for k in (SVC, EPS, "Node"))
            ),
            timeout=5,
        )
        runs = plugin_runs(tmp_path)
        assert runs == 1  # a token an hour from its expiry is not asked for again
        hook = cast(kube._ExecCredential, client.configuration.refresh_api_key_hook)
        hook.loader.exec_plugin_expiry -= datetime.timedelta(seconds=3600)  # an hour later
        apiserver.token = "rotated-" + apiserver.token
        (tmp_path / "token").write_text(apiserver.token)
        apiserver.drop_watches()
        apiserver.create(SVC, service("b"))
        await wait_for(lambda: names(tracker) == {"a", "b"}, timeout=5)
        assert apiserver.unauthorized == 0
        assert plugin_runs(tmp_path) == 2


async def test_an_exec_plugin_that_fails_is_one_warning_and_retried(
    apiserver: ApiServerDouble, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    kubeconfig = exec_kubeconfig(apiserver, tmp_path, 0)
    apiserver.create(SVC, service("a"))
    client = await make_api_client(kubeconfig=str(kubeconfig), master=None)
    caplog.set_level(logging.WARNING, logger="uproxy")
    caplog.clear()
    (tmp_path / "token").unlink()  # the plugin now fails
    apiserver.token = "rotated-" + apiserver.token
    async with following(client) as tracker:

        def refused() -> list[logging.LogRecord]:
            said = "Cannot refresh the kubeconfig's exec credential"
            return [r for r in caplog.records if r.getMessage() == said]

        await wait_for(lambda: len(refused()) >= 1, timeout=10)
        assert "exec: process returned 1" in refused()[0].kv["error"]  # type: ignore[attr-defined]
        (tmp_path / "token").write_text(apiserver.token)  # the plugin works again
        await wait_for(lambda: tracker.synced and names(tracker) == {"a"}, timeout=10)


@pytest.mark.parametrize(
    ("command", "said"),
    [
        ("/nonexistent/plugin", "its exec plugin /nonexistent/plugin: No such file or directory$"),
        ("/bin/false", "its exec plugin /bin/false: exec: process returned 1$"),
    ],
)
async def test_an_exec_plugin_that_cannot_run_at_start_is_named(
    apiserver: ApiServerDouble, tmp_path: Path, command: str, said: str
) -> None:
    # It used to say "cannot read Kubernetes configuration FILE: [Errno 2] ...", blaming
    # the kubeconfig, which is there.
    config = yaml.safe_load(exec_kubeconfig(apiserver, tmp_path, 0).read_text())
    config["users"][0]["user"]["exec"].update(command=command, args=[])
    (tmp_path / "kubeconfig").write_text(yaml.safe_dump(config))
    with pytest.raises(KubeConfigError, match=said):
        await make_api_client(kubeconfig=str(tmp_path / "kubeconfig"), master=None)


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (None, ": no such file$"),
        (b"clusters: [\n", ": line 2: not valid YAML$"),
        (b"", ": not a kubeconfig \\(expected a YAML mapping\\)$"),
        (b"- a list\n", ": not a kubeconfig"),
        (b"clusters: 5\ncurrent-context: c\n", "^cannot load Kubernetes configuration .*: \\w+"),
    ],
)
async def test_a_kubeconfig_that_cannot_be_used_is_one_line_naming_it(
    tmp_path: Path, content: bytes | None, said: str
) -> None:
    path = tmp_path / "kubeconfig"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(KubeConfigError, match=said) as err:
        await make_api_client(kubeconfig=str(path), master=None)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_uproxy_with_a_missing_kubeconfig_says_so_in_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "kubeconfig"
    argv = [sys.executable, "-m", "uproxy.cli", "--kubeconfig", str(missing), "--rules", "none"]
    argv += ["--healthz-bind-address", "", "--metrics-bind-address", ""]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == (
        f"uproxy: error: cannot configure the Kubernetes client: cannot read Kubernetes "
        f"configuration {missing}: no such file"
    )
    assert "Traceback" not in done.stderr and "Config not found" not in done.stderr


async def test_silent_stream_is_restarted(
    apiserver: ApiServerDouble, start_source: SourceFactory, caplog: pytest.LogCaptureFixture
) -> None:
    apiserver.create(SVC, service("a"))
    tracker, _ = await start_source(inactivity_timeout_s=0.3)
    await wait_for(lambda: tracker.synced)
    await wait_for(lambda: apiserver.watch_count(SVC) >= 3, timeout=5)
    assert apiserver.list_count(SVC) == 1
    assert any(r.getMessage() == "Watch stream silent; restarting it" for r in caplog.records)
    apiserver.create(SVC, service("b"))
    await wait_for(lambda: names(tracker) == {"a", "b"}, timeout=2)


async def test_periodic_resync_announces_every_service_without_listing(
    apiserver: ApiServerDouble, start_source: SourceFactory
) -> None:
    # An informer's resync, from memory: every service port is handed to the syncer again,
    # and the API server is asked for nothing (a LIST per node per period is an etcd read of
    # every object at cluster scale).
    apiserver.create(SVC, service("a"))
    apiserver.create(SVC, service("b"))
    tracker, _ = await start_source(config_sync_period_s=0.3)
    await wait_for(lambda: tracker.synced and names(tracker) == {"a", "b"})
    tracker.take_changes()
    await wait_for(lambda: len(tracker.take_changes().ports) == 2, timeout=5)
    await wait_for(lambda: len(tracker.take_changes().ports) == 2, timeout=5)  # and again
    assert apiserver.list_count(SVC) == apiserver.list_count(EPS) == 1
    apiserver.create(SVC, service("c"))  # the watch is what brings changes
    await wait_for(lambda: names(tracker) == {"a", "b", "c"}, timeout=5)
    assert apiserver.list_count(SVC) == 1


async def test_server_restart_keeps_state_then_converges(
    apiserver: ApiServerDouble, start_source: SourceFactory
) -> None:
    apiserver.create(SVC, service("a"))
    apiserver.create(EPS, endpoint_slice("a-1", service_name="a", ips=["10.1.0.1"], port=80))
    tracker, _ = await start_source()
    await wait_for(lambda: tracker.synced and ips(tracker, "a") == ["10.1.0.1"])
    await apiserver.go_down()
    apiserver.update(EPS, endpoint_slice("a-1", service_name="a", ips=["10.1.0.2"], port=80))
    apiserver.create(SVC, service("b"))
    # Down: the last state stays, whatever the retries see.
    await asyncio.sleep(1.0)  # the scenario: an outage lasting a second, not a synchronisation
    assert ips(tracker, "a") == ["10.1.0.1"] and names(tracker) == {"a"}
    await apiserver.start()
    await wait_for(lambda: names(tracker) == {"a", "b"}, timeout=5)
    await wait_for(lambda: ips(tracker, "a") == ["10.1.0.2"], timeout=5)


async def test_label_filters(apiserver: ApiServerDouble, start_source: SourceFactory) -> None:
    apiserver.create(SVC, service("plain"))
    apiserver.create(SVC, service("ours", labels=proxy_name_labels("uproxy")))
    apiserver.create(SVC, service("theirs", labels=proxy_name_labels("other")))
    apiserver.create(SVC, service("headless", labels=headless_labels()))
    apiserver.create(
        SVC, service("ours-headless", labels={**proxy_name_labels("uproxy"), **headless_labels()})
    )
    default, _ = await start_source()
    named, _ = await start_source(service_proxy_name="uproxy")
    await wait_for(lambda: default.synced and named.synced)
    assert names(default) == {"plain"}
    assert names(named) == {"ours"}
    selectors = {
        p["labelSelector"] for (verb, kind), p in apiserver.last_params.items() if kind == SVC
    }
    assert service_label_selector("uproxy") in selectors or service_label_selector(None) in (
        selectors
    )
    # Relabelling moves a service between proxies (the watch sends ADDED/DELETED).
    apiserver.update(SVC, service("plain", labels=proxy_name_labels("uproxy")))
    await wait_for(lambda: names(default) == set() and names(named) == {"ours", "plain"})


def test_service_label_selector_matches_kube_proxy() -> None:
    assert service_label_selector(None) == (
        "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless"
    )
    assert service_label_selector("uproxy") == (
        "service.kubernetes.io/service-proxy-name=uproxy,!service.kubernetes.io/headless"
    )


async def test_bad_token_is_retried_not_fatal(
    apiserver: ApiServerDouble, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    apiserver.create(SVC, service("a"))
    good_token = apiserver.token
    apiserver.token = "not-the-token"
    client = await make_api_client(
        kubeconfig=str(apiserver.write_kubeconfig(tmp_path / "kc")), master=None
    )
    apiserver.token = good_token
    tracker, source = source_of(client, backoff_max_s=0.2)
    task = asyncio.create_task(source.run())
    try:
        with caplog.at_level(logging.WARNING, logger="uproxy.sources.kube"):
            await wait_for(lambda: apiserver.unauthorized >= 6, timeout=5)
        assert not tracker.synced
        assert not task.done()
        assert apiserver.list_count(SVC) == 0
        assert any(
            r.getMessage() == "Listing failed; retrying" and "401" in str(r.__dict__.get("kv"))
            for r in caplog.records
        )
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await client.close()


async def test_make_api_client_master_overrides(tmp_path: Path, apiserver: ApiServerDouble) -> None:
    kc = apiserver.write_kubeconfig(tmp_path / "kc")
    client = await make_api_client(kubeconfig=str(kc), master="https://127.0.0.1:1")
    try:
        assert client.configuration.host == "https://127.0.0.1:1"
    finally:
        await client.close()


async def test_master_without_a_scheme_reaches_the_api_server(
    tmp_path: Path, apiserver: ApiServerDouble
) -> None:
    # host:port, as kube-proxy's --master takes it: https with a kubeconfig's TLS settings.
    # It used to be retried for ever as a request to "127.0.0.1:PORT/api/v1/...".
    apiserver.create(SVC, service("a"))
    kc = apiserver.write_kubeconfig(tmp_path / "kc")
    bare = apiserver.url.removeprefix("https://")
    client = await make_api_client(kubeconfig=str(kc), master=bare + "/")
    assert client.configuration.host == apiserver.url
    async with following(client) as tracker:
        await wait_for(lambda: tracker.synced and names(tracker) == {"a"}, timeout=5)


@pytest.mark.parametrize("master", ["not a url", "ftp://10.0.0.1", "https://", "10.0.0.1:port"])
async def test_a_master_that_is_no_url_is_one_line(
    tmp_path: Path, apiserver: ApiServerDouble, master: str
) -> None:
    kc = apiserver.write_kubeconfig(tmp_path / "kc")
    with pytest.raises(KubeConfigError, match=r"not an API server URL like https://HOST:PORT$"):
        await make_api_client(kubeconfig=str(kc), master=master)


async def test_api_requests_are_counted_by_code_as_client_go_counts_them(
    tmp_path: Path, apiserver: ApiServerDouble
) -> None:
    """A refused credential leaves /healthz at 200 (the last known state is served): the
    only sign outside the logs is client-go's request counter, by code."""
    from prometheus_client import REGISTRY

    apiserver.create(SVC, service("a"))
    client = await make_api_client(
        kubeconfig=str(apiserver.write_kubeconfig(tmp_path / "kc")), master=None
    )
    host = apiserver.url.removeprefix("https://")

    def requests(code: str) -> float:
        labels = {"code": code, "method": "GET", "host": host}
        return REGISTRY.get_sample_value("rest_client_requests_total", labels) or 0.0

    ok, refused = requests("200"), requests("401")
    async with following(client) as tracker:
        # Synced is the Services' and EndpointSlices' lists; the Node's may still be on its
        # way. Each feed's watch is opened once its list was answered (and counted).
        await wait_for(
            lambda: (
                tracker.synced and all(apiserver.open_watches(k) == 1 for k in (SVC, EPS, "Node"))
            ),
            timeout=5,
        )
        assert requests("200") >= ok + 3  # a list of each resource, at least
        apiserver.token = "rotated-" + apiserver.token  # uproxy's token is no longer taken
        apiserver.drop_watches()
        await wait_for(lambda: requests("401") >= refused + 3, timeout=10)


async def test_a_socks_proxy_in_the_kubeconfig_is_one_line(
    tmp_path: Path, apiserver: ApiServerDouble
) -> None:
    config = yaml.safe_load(apiserver.write_kubeconfig(tmp_path / "kc").read_text())
    config["clusters"][0]["cluster"]["proxy-url"] = "socks5://127.0.0.1:1080"
    (tmp_path / "kc").write_text(yaml.safe_dump(config))
    with pytest.raises(KubeConfigError, match=r"socks5://127.0.0.1:1080: only http:// and"):
        await make_api_client(kubeconfig=str(tmp_path / "kc"), master=None)


async def test_make_api_client_explains_missing_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(KubeConfigError, match="pass --kubeconfig or --master"):
        await make_api_client(kubeconfig=None, master=None)
    with pytest.raises(KubeConfigError, match="cannot"):
        await make_api_client(kubeconfig=str(tmp_path / "missing"), master=None)


async def test_kubeconfig_env_is_honoured(
    apiserver: ApiServerDouble, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kc = apiserver.write_kubeconfig(tmp_path / "kc")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(kc))
    client = await make_api_client(kubeconfig=None, master=None)
    try:
        assert client.configuration.host == apiserver.url
    finally:
        await client.close()


async def test_410_in_an_open_stream_relists(
    apiserver: ApiServerDouble, start_source: SourceFactory
) -> None:
    apiserver.create(SVC, service("a"))
    tracker, _ = await start_source()
    # Both watches open: a 410 reaches only the streams open (the Node's counts too, so the
    # number expired does not tell that the EndpointSlices' was one of them).
    await wait_for(
        lambda: tracker.synced and all(apiserver.open_watches(k) == 1 for k in (SVC, EPS))
    )
    apiserver.create(SVC, service("b"))
    await wait_for(lambda: names(tracker) == {"a", "b"})
    assert apiserver.expire_watches() >= 2
    await wait_for(lambda: apiserver.list_count(SVC) == 2 and apiserver.list_count(EPS) == 2)
    apiserver.delete(SVC, service("a"))
    await wait_for(lambda: names(tracker) == {"b"})


async def test_a_watch_burst_is_applied_with_the_collector_off_and_frozen(
    apiserver: ApiServerDouble, start_source: SourceFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Events that pile up in the stream are bulk work (``uproxy.heap``): the collector stays
    off while they are applied and their objects are frozen after; a lone event is not."""
    n = heap.BULK_MIN + 500
    for i in range(n):
        apiserver.create(
            EPS, endpoint_slice(f"s-{i}", service_name=f"s{i}", ips=["10.1.0.1"], port=80)
        )
    apiserver.create(SVC, service("s0"))
    apiserver.create(SVC, service(f"s{n - 1}", cluster_ip="10.96.0.11"))
    tracker, _ = await start_source()
    await wait_for(lambda: tracker.synced and apiserver.open_watches(EPS) == 1, timeout=10)
    await wait_for(lambda: gc.isenabled() and heap._depth == 0)
    seen: list[bool] = []  # the collector's state at each upsert of a slice
    upsert = tracker.upsert

    def spy(kind: Kind, obj: Obj) -> None:
        if kind is Kind.ENDPOINT_SLICE:
            seen.append(gc.isenabled())
        upsert(kind, obj)

    monkeypatch.setattr(tracker, "upsert", spy)
    freezes: list[bool] = []  # each end of a bulk: whether it froze what it made
    resume = heap.resume

    def resume_spy(*, freeze: bool = True) -> None:
        freezes.append(freeze)
        resume(freeze=freeze)

    monkeypatch.setattr(heap, "resume", resume_spy)
    for i in range(n):  # one go: the stream fills faster than the source reads it
        apiserver.update(
            EPS, endpoint_slice(f"s-{i}", service_name=f"s{i}", ips=["10.1.0.2"], port=80)
        )
    await wait_for(lambda: len(seen) == n, timeout=10)
    await wait_for(lambda: gc.isenabled() and heap._depth == 0)
    assert seen.count(False) >= 0.9 * n, f"collector on for {seen.count(True)} of {n} events"
    assert True in freezes  # the burst's objects were frozen
    assert ips(tracker, f"s{n - 1}") == ["10.1.0.2"]

    seen.clear()
    freezes.clear()
    apiserver.update(EPS, endpoint_slice("s-0", service_name="s0", ips=["10.1.0.3"], port=80))
    await wait_for(lambda: ips(tracker, "s0") == ["10.1.0.3"])
    assert seen == [True]  # one event is no burst
    assert freezes == []  # and no bulk


async def test_events_split_across_reads_and_a_large_one_arrive_whole(
    apiserver: ApiServerDouble, start_source: SourceFactory
) -> None:
    apiserver.create(SVC, service("web"))
    tracker, _ = await start_source()
    await wait_for(lambda: tracker.synced and apiserver.open_watches(EPS) == 1)
    many = [f"10.{i // 62500}.{i // 250 % 250}.{i % 250 + 1}" for i in range(1000)]
    big = endpoint_slice("web-1", service_name="web", ips=many, port=80)
    big["metadata"]["annotations"] = {"note": "x" * 1_000_000}  # ~1.1 MB on one line
    apiserver.create(EPS, big)
    await wait_for(lambda: len(ips(tracker, "web")) == 1000, timeout=10)


def test_watch_lines_are_cut_at_newlines_whatever_the_reads() -> None:
    lines = _Lines()
    assert lines.feed(b'{"a"') == []
    assert lines.feed(b": 1}\n{") == [b'{"a": 1}']
    assert lines.feed(b'"b": 2}\n{"c": 3}\n\n') == [b'{"b": 2}', b'{"c": 3}', b""]
    assert lines.feed(b"x" * 10) == []
    with pytest.raises(ValueError, match="over"):
        lines.feed(b"y" * MAX_EVENT_BYTES)


TOO_MANY = json.dumps(
    {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": "Too many requests, please try again later.",
        "reason": "TooManyRequests",
        "details": {"retryAfterSeconds": 3},
        "code": 429,
    }
).encode()


async def test_a_429_is_retried_no_sooner_than_its_retry_after(
    apiserver: ApiServerDouble, start_source: SourceFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """API Priority and Fairness throttles with 429 and Retry-After; client-go waits that
    long, and uproxy retried after its own backoff (0.5 s first), every node at once."""
    apiserver.create(SVC, service("a"))
    apiserver.break_lists(SVC, TOO_MANY, TOO_MANY, status=429, headers={"Retry-After": "3"})
    tracker, _ = await start_source(backoff_max_s=0.2)
    await wait_for(lambda: tracker.synced and names(tracker) == {"a"}, timeout=15)
    failed = [r for r in caplog.records if r.getMessage() == "Listing failed; retrying"]
    waits = [r.kv["retry_s"] for r in failed]  # type: ignore[attr-defined]
    assert len(waits) == 2 and all(w >= 3 for w in waits), waits


async def test_a_410_after_a_watch_that_ran_relists_at_once_whatever_came_before(
    apiserver: ApiServerDouble, start_source: SourceFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """A quiet watch expired (normal: a server compacts its history), then an outage: the
    410 of the first watch after it counted as the second of a relist that spins, and the
    relist waited out the backoff the outage had grown (up to 30 s, without a line, while
    services deleted meanwhile kept answering)."""
    caplog.set_level(1, logger="uproxy")
    apiserver.create(SVC, service("a"))
    tracker, _ = await start_source(backoff_max_s=4.0)
    await wait_for(lambda: tracker.synced and apiserver.open_watches(SVC) == 1)
    lists = apiserver.list_count(SVC)
    apiserver.expire_watches()  # relisted at once, the old way too
    await wait_for(lambda: apiserver.list_count(SVC) > lists and apiserver.open_watches(SVC) == 1)
    await apiserver.go_down()
    await asyncio.sleep(6)  # the outage: failed watches back off 0.5, 1, 2, 4 s
    apiserver.delete(SVC, service("a"))
    apiserver.compact()
    caplog.clear()
    await apiserver.start()
    await wait_for(lambda: names(tracker) == set(), timeout=20)
    said = [
        (r.getMessage(), r.created)
        for r in caplog.records
        if getattr(r, "kv", {}).get("resource") == "Service"
    ]
    gone = next(t for m, t in said if m == "Watch cannot resume; relisting")
    listed = next(t for m, t in said if m == "Listed objects" and t >= gone)
    assert listed - gone < 1.0, said  # not after the backoff (4 s)
