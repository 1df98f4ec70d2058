"""The syncer: work in proportion to the change, endpoints outside the rate limit, retries.

Listeners are fakes that record what was opened and closed; the rules backend records every
portal set it is given. What matters here is which service ports a sync touches and what it
asks of the backend, not sockets (tests/k8s and tests/e2e move real bytes).
"""

from __future__ import annotations

import asyncio
import errno
from collections.abc import Collection
from typing import Any

import pytest
from prometheus_client import REGISTRY

from tests.factories import endpoint, endpoint_slice, service
from uproxy.dataplane.settings import DataplaneSettings
from uproxy.model import LbAlgorithm, Protocol, ServicePortName, Traffic
from uproxy.rules.base import LocalTraffic, Portal, RulesError
from uproxy.syncer import Syncer, SyncerOptions
from uproxy.tracker import Kind, Tracker


class FakeListener:
    def __init__(self, port: int) -> None:
        self.host = "0.0.0.0"
        self.port = port
        self.closed = False

    def close(self) -> None:
        self.closed = True

    async def shutdown(self, timeout: float) -> None:
        self.closed = True

    @property
    def active(self) -> int:
        return 0


class Factory:
    def __init__(self) -> None:
        self.opened: list[ServicePortName] = []
        self.refuse: set[ServicePortName] = set()

    async def __call__(self, *, name: ServicePortName, port: int, **_: Any) -> FakeListener:
        if name in self.refuse:
            raise OSError(errno.EADDRINUSE, "Address already in use")
        self.opened.append(name)
        return FakeListener(port)


class RecordingRules:
    name = "recording"

    def __init__(self) -> None:
        self.syncs: list[frozenset[Portal]] = []

    async def sync(self, portals: Collection[Portal]) -> None:
        self.syncs.append(frozenset(portals))

    def set_local_traffic(self, local: LocalTraffic) -> None:
        return None

    async def check(self) -> bool:
        return True

    async def cleanup(self) -> None:
        return None

    async def close(self) -> None:
        return None


def spn(name: str) -> ServicePortName:
    return ServicePortName("default", name, "http", Protocol.TCP)


def make(n: int) -> tuple[Tracker, Syncer, Factory, RecordingRules]:
    tracker = Tracker()
    tracker.replace(
        Kind.SERVICE, [service(f"s{i}", cluster_ip=f"10.96.{i // 250}.{i % 250}") for i in range(n)]
    )
    tracker.replace(
        Kind.ENDPOINT_SLICE,
        [endpoint_slice(f"s{i}-1", f"s{i}", endpoints=[endpoint("10.1.0.1")]) for i in range(n)],
    )
    factory, rules = Factory(), RecordingRules()
    syncer = Syncer(
        tracker=tracker,
        rules=rules,
        listener_factory=factory,
        options=SyncerOptions(
            listen_host="0.0.0.0",
            node_name="node-a",
            laptop=False,
            port_range=range(40000, 60000),
            default_algorithm=LbAlgorithm.ROUND_ROBIN,
            dataplane=DataplaneSettings(),
            full_sync_period_s=3600,
        ),
    )
    return tracker, syncer, factory, rules


def eps(syncer: Syncer, name: str) -> list[str]:
    return [e.ip for e in syncer.ports[spn(name)].balancer.endpoints(Traffic.CLUSTER)]


async def test_a_change_touches_only_its_service_port() -> None:
    tracker, syncer, factory, rules = make(2000)
    await syncer.sync()
    assert len(factory.opened) == 2000 and len(rules.syncs) == 1
    assert len(rules.syncs[0]) == 2000  # one portal per ClusterIP
    # A new service: one listener opened, the rules get the grown set once.
    tracker.upsert(Kind.SERVICE, service("new", cluster_ip="10.97.0.1"))
    await syncer.sync()
    assert factory.opened[2000:] == [spn("new")] and syncer.last_changed == 1
    assert len(rules.syncs) == 2 and len(rules.syncs[1]) == 2001
    # Nothing changed: no listener, no rules call (the backend's periodic call is hourly here).
    await syncer.sync()
    assert len(factory.opened) == 2001 and len(rules.syncs) == 2 and syncer.last_changed == 0
    # A deleted service: its listener closes and its portals leave the set.
    lst = syncer.ports[spn("s5")].cluster
    tracker.delete(Kind.SERVICE, service("s5"))
    await syncer.sync()
    assert isinstance(lst, FakeListener) and lst.closed and spn("s5") not in syncer.ports
    assert len(rules.syncs[2]) == 2000


async def test_endpoint_changes_reach_balancers_without_a_sync() -> None:
    tracker, syncer, factory, rules = make(10)
    assert syncer.apply_endpoints() == frozenset()  # before the first sync: nothing taken
    await syncer.sync()
    tracker.upsert(
        Kind.ENDPOINT_SLICE, endpoint_slice("s3-1", "s3", endpoints=[endpoint("10.1.0.9")])
    )
    assert syncer.apply_endpoints() == {spn("s3")}
    assert eps(syncer, "s3") == ["10.1.0.9"]
    assert len(rules.syncs) == 1 and len(factory.opened) == 10  # no listener, no rules
    await syncer.sync()
    assert syncer.last_changed == 0  # the fast road took it: the sync has nothing left


async def test_a_long_sync_gives_the_loop_turns() -> None:
    _, syncer, _, _ = make(5000)
    turns = 0
    done = False

    def probe() -> None:
        nonlocal turns
        if not done:
            turns += 1
            asyncio.get_running_loop().call_soon(probe)

    asyncio.get_running_loop().call_soon(probe)
    await syncer.sync()
    done = True
    assert len(syncer.ports) == 5000
    assert turns > 1  # callbacks ran while the 5,000 ports were being set up


async def test_a_listener_that_could_not_open_is_retried_by_the_next_sync() -> None:
    _, syncer, factory, rules = make(3)
    factory.refuse.add(spn("s1"))
    await syncer.sync()
    assert syncer.ports[spn("s1")].cluster is None
    assert {p.service for p in rules.syncs[-1]} == {spn("s0"), spn("s2")}
    factory.refuse.clear()
    await syncer.sync()  # nothing changed in the tracker: the retry alone brings it up
    assert syncer.ports[spn("s1")].cluster is not None
    assert spn("s1") in {p.service for p in rules.syncs[-1]}


def gauge(name: str, **labels: str) -> float:
    value = REGISTRY.get_sample_value(name, labels)
    return value if value is not None else 0.0


async def test_kube_proxy_sync_metrics_follow_what_the_syncs_do() -> None:
    tracker, syncer, _, _ = make(0)
    no_local = "kubeproxy_sync_proxy_rules_no_local_endpoints_total"
    full = "kubeproxy_sync_full_proxy_rules_duration_seconds_count"
    partial = "kubeproxy_sync_partial_proxy_rules_duration_seconds_count"
    before = {k: gauge(k) for k in (full, partial)}
    tracker.upsert(Kind.SERVICE, service("local", internalTrafficPolicy="Local"))
    remote = [endpoint("10.1.0.1", nodeName="node-b")]
    tracker.upsert(Kind.ENDPOINT_SLICE, endpoint_slice("local-1", "local", endpoints=remote))
    await syncer.sync()  # the first sync is a full one
    assert gauge(full) == before[full] + 1
    assert gauge(no_local, traffic_policy="internal") == 1  # endpoints, none on this node
    mine = [*remote, endpoint("10.1.0.2", nodeName="node-a")]
    tracker.upsert(Kind.ENDPOINT_SLICE, endpoint_slice("local-1", "local", endpoints=mine))
    syncer.apply_endpoints()
    assert gauge(no_local, traffic_policy="internal") == 0
    tracker.upsert(Kind.SERVICE, service("other"))
    await syncer.sync()
    assert gauge(partial) == before[partial] + 1 and gauge(full) == before[full] + 1


async def test_a_failed_restore_is_counted() -> None:
    _, syncer, _, rules = make(1)
    failures = "kubeproxy_sync_proxy_rules_iptables_restore_failures_total"
    before = gauge(failures)

    async def fail(portals: Collection[Portal]) -> None:
        raise RulesError("iptables-restore: line 3 failed")

    rules.name = "iptables-restore"
    rules.sync = fail  # type: ignore[method-assign]
    with pytest.raises(RulesError):
        await syncer.sync()
    assert gauge(failures) == before + 1
