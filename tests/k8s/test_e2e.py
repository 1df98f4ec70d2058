"""The whole proxy following the API-server double: real listeners, real bytes, real backends.

uproxy runs in laptop mode (no kernel rules) so nothing here needs root; what is checked is
what the source makes the syncer do: which listeners exist, which endpoints their balancers
use, that bytes arrive intact, and that listeners of unchanged service ports are never
reopened whatever the API server does.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import pytest

from tests.apiserver import ApiServerDouble
from tests.conftest import wait_for
from uproxy.model import Protocol, ServicePortName, Traffic

from .conftest import NODE, ProxyFactory
from .helpers import (
    Backends,
    Client,
    backend_of,
    endpoint_slice,
    free_port,
    headless_labels,
    node,
    proxy_name_labels,
    service,
)

if TYPE_CHECKING:
    from uproxy.proxy import Proxy

SVC = "Service"
EPS = "EndpointSlice"
IPS = ["127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4"]


def spn(name: str) -> ServicePortName:
    return ServicePortName("default", name, "http", Protocol.TCP)


def ports(proxy: Proxy) -> dict[ServicePortName, Any]:
    return proxy.syncer.ports if proxy.syncer is not None else {}


def listener(proxy: Any, name: str) -> Any:
    pp = proxy.syncer.ports.get(spn(name)) if proxy.syncer is not None else None
    return pp.cluster if pp is not None else None


def endpoints(proxy: Any, name: str) -> list[tuple[str, int]]:
    pp = proxy.syncer.ports.get(spn(name)) if proxy.syncer is not None else None
    if pp is None:
        return []
    return sorted((e.ip, e.port) for e in pp.balancer.endpoints(Traffic.CLUSTER))


def has_endpoints(proxy: Any, name: str, want: list[tuple[str, int]]) -> bool:
    return endpoints(proxy, name) == want


@pytest.fixture
async def backends() -> AsyncIterator[Backends]:
    b = Backends(free_port())
    for ip in IPS:
        await b.add(ip)
    try:
        yield b
    finally:
        await b.close()


async def served_by(port: int, n: int) -> set[str]:
    return {await backend_of(port) for _ in range(n)}


async def test_changes_reach_listeners_and_balancers_within_1s(
    apiserver: ApiServerDouble, start_proxy: ProxyFactory, backends: Backends
) -> None:
    p = backends.port
    svc_port = free_port()
    apiserver.create(SVC, service("web", port=svc_port))
    for i, ip in enumerate(IPS[:3], start=1):
        apiserver.create(EPS, endpoint_slice(f"web-{i}", service_name="web", ips=[ip], port=p))
    proxy = await start_proxy()
    await wait_for(lambda: len(endpoints(proxy, "web")) == 3, timeout=5)
    lst = listener(proxy, "web")
    # Three slices, one service: the union of their endpoints, round-robin over all of them.
    assert await served_by(lst.port, 6) == set(IPS[:3])

    # Deleting one slice removes only its endpoints.
    apiserver.delete(EPS, endpoint_slice("web-2", service_name="web", ips=[], port=p))
    await wait_for(lambda: len(endpoints(proxy, "web")) == 2)
    assert await served_by(lst.port, 6) == {IPS[0], IPS[2]}

    # Endpoints change: a slice gains an address.
    apiserver.update(EPS, endpoint_slice("web-3", service_name="web", ips=IPS[2:4], port=p))
    await wait_for(lambda: len(endpoints(proxy, "web")) == 3)
    assert await served_by(lst.port, 6) == {IPS[0], IPS[2], IPS[3]}

    # Affinity on: one client sticks to one backend; off again: spread.
    apiserver.update(SVC, service("web", port=svc_port, affinity=True))
    await wait_for(lambda: ports(proxy)[spn("web")].port.affinity_timeout_s == 600)
    assert len(await served_by(lst.port, 6)) == 1
    apiserver.update(SVC, service("web", port=svc_port))
    await wait_for(lambda: ports(proxy)[spn("web")].port.affinity_timeout_s is None)
    assert len(await served_by(lst.port, 6)) == 3
    assert listener(proxy, "web") is lst  # none of that reopened the listener

    # The endpoint port changes: traffic follows to the new backends.
    other = Backends(free_port())
    await other.add("127.0.0.5")
    try:
        for i in (1, 3):
            apiserver.delete(EPS, endpoint_slice(f"web-{i}", service_name="web", ips=[], port=p))
        apiserver.create(
            EPS, endpoint_slice("web-9", service_name="web", ips=["127.0.0.5"], port=other.port)
        )
        await wait_for(lambda: endpoints(proxy, "web") == [("127.0.0.5", other.port)])
        assert await served_by(lst.port, 3) == {"127.0.0.5"}
    finally:
        await other.close()

    # The service port changes (laptop mode listens on it): a listener on the new port.
    new_port = free_port()
    apiserver.update(SVC, service("web", port=new_port))
    await wait_for(lambda: ports(proxy)[spn("web")].port.port == new_port)
    await wait_for(lambda: listener(proxy, "web") is not None)
    assert listener(proxy, "web").port == new_port

    # Delete: the listener goes away.
    apiserver.delete(SVC, service("web"))
    await wait_for(lambda: spn("web") not in ports(proxy))
    with pytest.raises(OSError):
        await Client.connect(new_port, timeout=1)


async def test_topology_hints_follow_the_nodes_zone(
    apiserver: ApiServerDouble, start_proxy: ProxyFactory, backends: Backends
) -> None:
    """trafficDistribution: PreferSameZone as the EndpointSlice controller writes it: each
    endpoint hinted for its zone. Cluster traffic stays in this node's zone, moves when the
    Node is relabelled, and spreads again when one endpoint comes without a hint."""
    svc_port = free_port()
    apiserver.create("Node", node(NODE, zone="zone-a"))
    apiserver.create(SVC, service("web", port=svc_port))
    zones = {IPS[0]: "zone-a", IPS[1]: "zone-b", IPS[2]: "zone-b"}
    eps = endpoint_slice("web-1", service_name="web", ips=list(zones), port=backends.port)
    for ep in eps["endpoints"]:
        ep["zone"] = zones[ep["addresses"][0]]
        ep["hints"] = {"forZones": [{"name": ep["zone"]}]}
    apiserver.create(EPS, eps)
    proxy = await start_proxy()
    assert proxy.workers is not None  # a worker process chooses, not only the syncer
    await wait_for(lambda: endpoints(proxy, "web") == [(IPS[0], backends.port)], timeout=5)
    port = listener(proxy, "web").port
    assert await served_by(port, 6) == {IPS[0]}

    apiserver.update("Node", node(NODE, zone="zone-b"))

    async def zone_b_serves() -> bool:
        return await served_by(port, 6) == {IPS[1], IPS[2]}

    await wait_for(zone_b_serves, timeout=5, message="zone-b's endpoints serving")

    # An endpoint without hints turns them off for the service: all four serve.
    eps["endpoints"].append({"addresses": [IPS[3]], "conditions": {"ready": True}})
    apiserver.update(EPS, eps)

    async def all_serve() -> bool:
        return await served_by(port, 12) == set(IPS)

    await wait_for(all_serve, timeout=5, message="every endpoint serving")


async def test_endpoint_changes_do_not_wait_for_the_rules_rate_limit(
    apiserver: ApiServerDouble, start_proxy: ProxyFactory, backends: Backends
) -> None:
    p = backends.port
    apiserver.create(SVC, service("web", port=free_port()))
    apiserver.create(EPS, endpoint_slice("web-1", service_name="web", ips=[IPS[0]], port=p))
    # A minute between rule syncs: only the fast road can move endpoints within the wait.
    proxy = await start_proxy(iptables_min_sync_period=60.0, iptables_sync_period=120.0)
    await wait_for(lambda: endpoints(proxy, "web") == [(IPS[0], p)], timeout=5)
    lst = listener(proxy, "web")
    assert proxy.syncer is not None
    syncs = proxy.syncer.syncs
    for ip in (IPS[1], IPS[2], IPS[0]):
        apiserver.update(EPS, endpoint_slice("web-1", service_name="web", ips=[ip], port=p))
        await wait_for(functools.partial(has_endpoints, proxy, "web", [(ip, p)]), timeout=5)
        assert await served_by(lst.port, 3) == {ip}
    assert proxy.syncer.syncs == syncs  # no rate-limited sync was needed for any of it


async def test_health_check_counts_each_local_ready_pod_once(
    apiserver: ApiServerDouble, start_proxy: ProxyFactory
) -> None:
    hc_port = free_port()
    ports = [
        {"name": "http", "port": free_port(), "protocol": "TCP", "nodePort": 31080},
        {"name": "https", "port": free_port(), "protocol": "TCP", "nodePort": 31443},
    ]
    spec = {
        "type": "LoadBalancer",
        "externalTrafficPolicy": "Local",
        "healthCheckNodePort": hc_port,
    }
    apiserver.create(SVC, service("web", ports=ports, spec=spec))
    # http on pods A and B, https on pods B and C (all on this node); one more pod on this
    # node is not ready and one ready pod is on another node: neither counts.
    http = endpoint_slice("web-http", service_name="web", ips=["10.1.0.1", "10.1.0.2"], port=8080)
    https = endpoint_slice(
        "web-https", service_name="web", ips=["10.1.0.2", "10.1.0.3"], port=8443, port_name="https"
    )
    https["endpoints"] += [
        {"addresses": ["10.1.0.4"], "conditions": {"ready": False}, "nodeName": "node-a"},
        {"addresses": ["10.1.0.5"], "conditions": {"ready": True}, "nodeName": "node-b"},
    ]
    apiserver.create(EPS, http)
    apiserver.create(EPS, https)
    await start_proxy()
    body: dict[str, Any] = {}

    async def answered() -> bool:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", hc_port)
        except OSError:
            return False
        writer.write(b"GET / HTTP/1.0\r\n\r\n")
        raw = await reader.read()
        writer.close()
        body.update(json.loads(raw.partition(b"\r\n\r\n")[2]))
        return raw.split(b" ", 2)[1] == b"200"

    await wait_for(answered, timeout=5)
    # By address over all the service's ports, as kube-proxy counts: A, B, C. (The most
    # endpoints of any one port would be 2.)
    assert body["localEndpoints"] == 3


async def _assert_steady(proxy: Any, lst: Any, conn: Client) -> None:
    assert listener(proxy, "steady") is lst
    await conn.round_trip()


async def test_410_and_dropped_streams_never_reopen_unchanged_listeners(
    apiserver: ApiServerDouble, start_proxy: ProxyFactory, backends: Backends
) -> None:
    p = backends.port
    apiserver.create(SVC, service("steady", port=free_port()))
    apiserver.create(EPS, endpoint_slice("steady-1", service_name="steady", ips=IPS[:2], port=p))
    apiserver.create(SVC, service("moving", port=free_port()))
    apiserver.create(EPS, endpoint_slice("moving-1", service_name="moving", ips=IPS[:1], port=p))
    proxy = await start_proxy()
    await wait_for(lambda: len(endpoints(proxy, "steady")) == 2, timeout=5)
    await wait_for(lambda: len(endpoints(proxy, "moving")) == 1, timeout=5)
    lst = listener(proxy, "steady")
    port = lst.port
    conn = await Client.connect(port)
    try:
        # 1. Every stream dropped mid-chunk, with changes the client cannot see as events.
        watches = apiserver.watch_count(EPS)
        apiserver.drop_watches()
        apiserver.update(
            EPS, endpoint_slice("moving-1", service_name="moving", ips=IPS[:2], port=p)
        )
        await _assert_steady(proxy, lst, conn)
        await wait_for(lambda: len(endpoints(proxy, "moving")) == 2, timeout=5)
        assert apiserver.watch_count(EPS) > watches
        await _assert_steady(proxy, lst, conn)

        # 2. History compacted while the streams are down: 410 Gone, relist, converge.
        lists = apiserver.list_count(SVC), apiserver.list_count(EPS)
        apiserver.drop_watches()
        apiserver.update(
            EPS, endpoint_slice("moving-1", service_name="moving", ips=IPS[:3], port=p)
        )
        apiserver.create(SVC, service("fresh", port=free_port()))
        apiserver.compact()
        await _assert_steady(proxy, lst, conn)
        await wait_for(lambda: apiserver.list_count(SVC) > lists[0], timeout=5)
        await wait_for(lambda: apiserver.list_count(EPS) > lists[1], timeout=5)
        await wait_for(lambda: len(endpoints(proxy, "moving")) == 3, timeout=5)
        await wait_for(lambda: listener(proxy, "fresh") is not None, timeout=5)
        await _assert_steady(proxy, lst, conn)
        assert lst.port == port
        assert endpoints(proxy, "steady") == [(ip, p) for ip in IPS[:2]]
        # New connections through the same listener still work.
        assert await backend_of(port) in IPS[:2]
    finally:
        await conn.close()


@pytest.mark.slow
async def test_api_server_gone_for_10s(
    apiserver: ApiServerDouble, start_proxy: ProxyFactory, backends: Backends
) -> None:
    p = backends.port
    apiserver.create(SVC, service("steady", port=free_port()))
    apiserver.create(EPS, endpoint_slice("steady-1", service_name="steady", ips=IPS[:2], port=p))
    proxy = await start_proxy()
    await wait_for(lambda: len(endpoints(proxy, "steady")) == 2, timeout=5)
    lst = listener(proxy, "steady")
    conn = await Client.connect(lst.port)
    outage = asyncio.create_task(apiserver.restart(down_for_s=10.0))
    try:
        await wait_for(lambda: not apiserver.running, timeout=2)
        # Changes made while uproxy cannot see them.
        apiserver.update(
            EPS, endpoint_slice("steady-1", service_name="steady", ips=IPS[:3], port=p)
        )
        apiserver.create(SVC, service("late", port=free_port()))
        # Meanwhile the last state keeps serving: the open connection and new ones.
        deadline = time.monotonic() + 30
        while not outage.done() and time.monotonic() < deadline:
            await _assert_steady(proxy, lst, conn)
            picked = await backend_of(lst.port)
            if apiserver.running:
                break  # back during those awaits: uproxy may have converged already
            assert picked in IPS[:2]
            assert len(endpoints(proxy, "steady")) == 2
            await asyncio.wait({outage}, timeout=0.5)
        await outage
        # Back: converge (within the capped reconnect backoff).
        await wait_for(lambda: len(endpoints(proxy, "steady")) == 3, timeout=40)
        await wait_for(lambda: listener(proxy, "late") is not None, timeout=5)
        await _assert_steady(proxy, lst, conn)
    finally:
        if not outage.done():
            outage.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await outage
        await conn.close()


async def test_api_server_back_at_an_older_version_is_served_within_5s(
    apiserver: ApiServerDouble, start_proxy: ProxyFactory, backends: Backends
) -> None:
    p = backends.port
    apiserver.create(SVC, service("steady", port=free_port()))
    apiserver.create(EPS, endpoint_slice("steady-1", service_name="steady", ips=IPS[:1], port=p))
    proxy = await start_proxy()
    await wait_for(lambda: endpoints(proxy, "steady") == [(IPS[0], p)], timeout=5)
    lst = listener(proxy, "steady")
    backup = apiserver.resource_version  # what a restored etcd will come back at
    # uproxy moves past the backup's version on both feeds (a service and its slice come
    # and go), as a cluster does between a backup and a restore.
    apiserver.create(SVC, service("filler", port=free_port(), cluster_ip="10.96.0.11"))
    apiserver.create(EPS, endpoint_slice("filler-1", service_name="filler", ips=IPS[:1], port=p))
    await wait_for(lambda: endpoints(proxy, "filler") == [(IPS[0], p)], timeout=5)
    apiserver.delete(EPS, endpoint_slice("filler-1", service_name="filler", ips=[], port=p))
    apiserver.delete(SVC, service("filler"))
    await wait_for(lambda: listener(proxy, "filler") is None, timeout=5)
    # The API server goes away and comes back restored: older versions, and a change made
    # meanwhile that carries a version uproxy has already seen.
    await apiserver.go_down()
    apiserver.rewind(backup)
    apiserver.update(EPS, endpoint_slice("steady-1", service_name="steady", ips=IPS[1:2], port=p))
    await apiserver.start()
    await wait_for(lambda: endpoints(proxy, "steady") == [(IPS[1], p)], timeout=5)

    async def served_by_the_new_endpoint() -> bool:
        # The control process's view moves first; its data-plane worker applies the change
        # from the channel a moment later: traffic is what is waited for.
        return await served_by(lst.port, 3) == {IPS[1]}

    await wait_for(served_by_the_new_endpoint, timeout=5, message="traffic to the new endpoint")
    assert listener(proxy, "steady") is lst  # a relist, by difference: nothing reopened


async def test_nothing_programmed_before_both_lists(
    apiserver: ApiServerDouble, start_proxy: ProxyFactory, backends: Backends
) -> None:
    svc_port = free_port()
    apiserver.create(SVC, service("web", port=svc_port))
    apiserver.create(
        EPS, endpoint_slice("web-1", service_name="web", ips=IPS[:1], port=backends.port)
    )
    apiserver.hold_lists(EPS)
    proxy = await start_proxy()
    await wait_for(lambda: apiserver.list_count(EPS) == 1 and apiserver.open_watches(SVC) == 1)
    assert proxy.tracker.snapshot()  # the services are known...
    # ...but nothing is programmed, and it stays so (bounded observation).
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        assert not ports(proxy) and not proxy.synced.is_set()
        await asyncio.sleep(0.05)
    with pytest.raises(OSError):
        await Client.connect(svc_port, timeout=1)
    apiserver.release_lists(EPS)
    await wait_for(lambda: len(endpoints(proxy, "web")) == 1, timeout=2)
    assert await backend_of(listener(proxy, "web").port) == IPS[0]


@pytest.mark.parametrize("proxy_name", [None, "uproxy"])
async def test_service_proxy_name_and_headless(
    apiserver: ApiServerDouble,
    start_proxy: ProxyFactory,
    backends: Backends,
    proxy_name: str | None,
) -> None:
    labels = {
        "plain": {},
        "ours": proxy_name_labels("uproxy"),
        "theirs": proxy_name_labels("other"),
        "headless": headless_labels(),
    }
    for name, lab in labels.items():
        apiserver.create(SVC, service(name, port=free_port(), labels=lab))
        # The EndpointSlice controller copies the service's labels onto its slices.
        apiserver.create(
            EPS,
            endpoint_slice(
                f"{name}-1", service_name=name, ips=IPS[:1], port=backends.port, labels=lab
            ),
        )
    proxy = await start_proxy(service_proxy_name=proxy_name)
    want = "plain" if proxy_name is None else "ours"
    await wait_for(lambda: proxy.synced.is_set() and len(endpoints(proxy, want)) == 1)
    assert {k.name for k in ports(proxy)} == {want}
    assert await backend_of(listener(proxy, want).port) == IPS[0]


MALFORMED_SERVICES: dict[str, dict[str, Any]] = {
    "port-string": {"ports": [{"name": "http", "port": "80"}]},
    "port-range": {"ports": [{"name": "http", "port": 70000}]},
    "protocol": {"ports": [{"name": "http", "port": 80, "protocol": "HTTP"}]},
    "cluster-ip": {"clusterIP": "not-an-ip", "clusterIPs": ["not-an-ip"]},
    "type": {"type": "Weird"},
    "affinity": {"sessionAffinity": "Sticky"},
    "affinity-timeout": {
        "sessionAffinity": "ClientIP",
        "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 0}},
    },
    "affinity-timeout-type": {
        "sessionAffinity": "ClientIP",
        "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": "10"}},
    },
    "traffic-policy": {"externalTrafficPolicy": "Nowhere"},
    "ports-not-list": {"ports": "80"},
    "unnamed-ports": {"ports": [{"port": 80}, {"port": 81}]},
    "duplicate-ports": {"ports": [{"name": "a", "port": 80}, {"name": "a", "port": 81}]},
    "no-ports": {"ports": []},
    "external-ip": {"externalIPs": ["999.1.1.1"]},
    "source-range": {"type": "LoadBalancer", "loadBalancerSourceRanges": ["nope"]},
    "node-port": {"type": "NodePort", "ports": [{"name": "http", "port": 80, "nodePort": -1}]},
    "health-port": {"externalTrafficPolicy": "Local", "healthCheckNodePort": "abc"},
}


def malformed_objects(backend_port: int) -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    for name, spec in MALFORMED_SERVICES.items():
        out.append((SVC, service(f"bad-{name}", spec=spec)))
    spec_not_object = service("bad-spec-not-object")
    spec_not_object["spec"] = "x"
    out.append((SVC, spec_not_object))
    labels_not_object = service("bad-labels")
    labels_not_object["metadata"]["labels"] = ["a"]
    out.append((SVC, labels_not_object))
    lb_ip = service("bad-lb-ingress", spec={"type": "LoadBalancer"})
    lb_ip["status"] = {"loadBalancer": {"ingress": [{"ip": "x"}]}}
    out.append((SVC, lb_ip))

    # Slices of the good service itself: its good slice must keep serving.
    def bad_slice(name: str, **changes: Any) -> dict[str, Any]:
        s = endpoint_slice(name, service_name="good", ips=IPS[:1], port=backend_port)
        s.update(changes)
        return s

    out.append((EPS, bad_slice("bad-address-type", addressType="MAC")))
    out.append((EPS, bad_slice("bad-family", endpoints=[{"addresses": ["::1"], "conditions": {}}])))
    out.append((EPS, bad_slice("bad-no-addresses", endpoints=[{"addresses": []}])))
    out.append(
        (
            EPS,
            bad_slice(
                "bad-ready", endpoints=[{"addresses": ["127.0.0.9"], "conditions": {"ready": 1}}]
            ),
        )
    )
    out.append((EPS, bad_slice("bad-slice-port", ports=[{"name": "http", "port": 65536}])))
    out.append((EPS, bad_slice("bad-endpoints-not-list", endpoints={"a": 1})))
    no_label = bad_slice("bad-no-service-label")
    no_label["metadata"]["labels"] = {}
    out.append((EPS, no_label))
    return out


async def test_an_update_uproxy_cannot_read_keeps_the_service_serving(
    apiserver: ApiServerDouble,
    start_proxy: ProxyFactory,
    backends: Backends,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A served Service or slice updated to something uproxy cannot read used to be removed
    (its proxy port closed, its rules gone on every node) while the log said "Skipping"."""
    good = service("web", port=free_port())
    apiserver.create(SVC, good)
    apiserver.create(
        EPS, endpoint_slice("web-1", service_name="web", ips=IPS[:2], port=backends.port)
    )
    caplog.set_level(logging.WARNING)
    proxy = await start_proxy()
    await wait_for(lambda: len(endpoints(proxy, "web")) == 2, timeout=5)
    port = listener(proxy, "web").port
    typo = copy.deepcopy(good)
    typo["metadata"]["annotations"] = {"uproxy.io/lb-algorithm": "roundrobin"}
    apiserver.update(SVC, typo)  # served, with --lb-algorithm
    broken = copy.deepcopy(good)
    broken["spec"]["loadBalancerSourceRanges"] = ["10.0.0.0/33"]
    apiserver.update(SVC, broken)
    unlabelled = endpoint_slice("web-1", service_name="web", ips=IPS[2:3], port=backends.port)
    unlabelled["metadata"]["labels"] = {}
    apiserver.update(EPS, unlabelled)

    def said(message: str) -> list[str]:
        return [r.__dict__["kv"]["object"] for r in caplog.records if r.getMessage() == message]

    await wait_for(
        lambda: len(said("Skipping invalid object; keeping its last good state")) == 2, timeout=5
    )
    assert said("Ignoring an unknown load-balancing algorithm; using --lb-algorithm") == [
        "default/web"
    ]
    assert listener(proxy, "web").port == port
    assert endpoints(proxy, "web") == [(ip, backends.port) for ip in IPS[:2]]
    assert await served_by(port, 4) == set(IPS[:2])
    apiserver.update(SVC, good)  # fixed: taken as usual
    apiserver.delete(SVC, good)  # and a deletion still removes it
    await wait_for(lambda: not any(k.name == "web" for k in ports(proxy)), timeout=5)


async def test_malformed_objects_are_skipped_one_line_each(
    apiserver: ApiServerDouble,
    start_proxy: ProxyFactory,
    backends: Backends,
    caplog: pytest.LogCaptureFixture,
) -> None:
    bad = malformed_objects(backends.port)
    assert len(bad) >= 20
    half = len(bad) // 2
    for kind, obj in bad[:half]:
        apiserver.create(kind, obj)
    apiserver.create(SVC, service("good", port=free_port()))
    apiserver.create(
        EPS, endpoint_slice("good-1", service_name="good", ips=IPS[:2], port=backends.port)
    )
    caplog.set_level(logging.WARNING)
    proxy = await start_proxy()
    await wait_for(lambda: len(endpoints(proxy, "good")) == 2, timeout=5)
    # The other half arrives through the watch, not the list.
    for kind, obj in bad[half:]:
        apiserver.create(kind, obj)
    expected = {f"default/{obj['metadata']['name']}" for _, obj in bad}

    def logged() -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in caplog.records:
            if r.getMessage() == "Skipping invalid object":
                key = r.__dict__["kv"]["object"]
                counts[key] = counts.get(key, 0) + 1
        return counts

    await wait_for(lambda: expected <= set(logged()), timeout=5)
    assert all(logged()[k] == 1 for k in expected), logged()
    assert {k.name for k in ports(proxy)} == {"good"}
    assert endpoints(proxy, "good") == [(ip, backends.port) for ip in IPS[:2]]
    assert await served_by(listener(proxy, "good").port, 4) == set(IPS[:2])
