"""The syncer: work in proportion to the change, endpoints outside the rate limit, retries.

Listeners are fakes that record what was opened and closed; the rules backend records every
portal set it is given. What matters here is which service ports a sync touches and what it
asks of the backend, not sockets (tests/k8s and tests/e2e move real bytes).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import random
import socket
import subprocess
import sys
from collections.abc import Callable, Collection
from typing import Any

import pytest
from prometheus_client import REGISTRY

from tests.factories import endpoint, endpoint_slice, service
from uproxy import syncer as syncer_module
from uproxy.dataplane.settings import DataplaneSettings
from uproxy.model import (
    Endpoint,
    IPFamily,
    NodeInfo,
    Protocol,
    ServicePort,
    ServicePortName,
    Traffic,
)
from uproxy.portrange import PortAllocator
from uproxy.rules.base import LocalTraffic, Portal, PortalKind, RulesError
from uproxy.rules.nodeports import NodePortReservations
from uproxy.settings import Settings
from uproxy.syncer import RETRY_FIRST_S, RETRY_SOON_S, Syncer, SyncerOptions, TableRow
from uproxy.tracker import Kind, Tracker


class FakeListener:
    def __init__(self, port: int, host: str = "0.0.0.0") -> None:
        self.host = host
        self.port = port
        self.closed = False

    def close(self) -> None:
        self.closed = True

    async def shutdown(self, timeout: float) -> int:
        self.closed = True
        return 0

    @property
    def active(self) -> int:
        return 0


class Factory:
    def __init__(self) -> None:
        self.opened: list[ServicePortName] = []
        self.refuse: set[ServicePortName] = set()
        self.taken: set[int] = set()  # ports somebody else still holds

    async def __call__(
        self, *, name: ServicePortName, port: int, host: str = "0.0.0.0", **_: Any
    ) -> FakeListener:
        if name in self.refuse or port in self.taken:
            raise OSError(errno.EADDRINUSE, "Address already in use")
        self.opened.append(name)
        return FakeListener(port, host)


class RecordingRules:
    name = "recording"

    def __init__(self) -> None:
        self.syncs: list[frozenset[Portal]] = []
        self.previous_ports: dict[tuple[str, str, int], int] = {}

    async def prepare(self) -> None:

        return None

    async def sync(self, portals: Collection[Portal]) -> None:
        self.syncs.append(frozenset(portals))

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
            settings=Settings(
                rules="iptables-restore", proxy_port_range="40000-59999", iptables_sync_period=3600
            ),
            dataplane=DataplaneSettings(node_name="node-a"),
            listen_hosts=("0.0.0.0",),
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
    # A new service: one listener opened, the rules get the grown set once: its ClusterIP,
    # and its proxy port refusing new connections until it has an endpoint.
    tracker.upsert(Kind.SERVICE, service("new", cluster_ip="10.97.0.1"))
    await syncer.sync()
    assert factory.opened[2000:] == [spn("new")] and syncer.last_changed == 1
    assert len(rules.syncs) == 2 and len(rules.syncs[1]) == 2002
    assert [p.kind for p in rules.syncs[1] if p.refusal] == [PortalKind.NO_ENDPOINTS]
    # Nothing changed: no listener, no rules call (the backend's periodic call is hourly here).
    await syncer.sync()
    assert len(factory.opened) == 2001 and len(rules.syncs) == 2 and syncer.last_changed == 0
    # A deleted service: its listener closes and its portals leave the set.
    lst = syncer.ports[spn("s5")].cluster
    tracker.delete(Kind.SERVICE, service("s5"))
    await syncer.sync()
    assert isinstance(lst, FakeListener) and lst.closed and spn("s5") not in syncer.ports
    assert len(rules.syncs[2]) == 2001  # 1,999 ClusterIPs, and "new" still refusing


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


def refusals(rules: RecordingRules) -> set[Portal]:
    return {p for p in rules.syncs[-1] if p.refusal}


def pending(syncer: Syncer) -> bool:
    """Whether the rules wait for a sync (a call: it changes between two reads)."""
    return syncer.rules_pending


class SlowRules(RecordingRules):
    """A backend whose writes wait for ``done``: a write in flight, as ``nft -f -`` is."""

    def __init__(self) -> None:
        super().__init__()
        self.started = asyncio.Event()
        self.done = asyncio.Event()

    async def sync(self, portals: Collection[Portal]) -> None:
        self.started.set()
        await self.done.wait()
        await super().sync(portals)


async def test_endpoints_that_come_while_the_rules_are_written_reach_the_next_write() -> None:
    """A new service's first sync writes its proxy port refusing (no endpoint yet); its
    EndpointSlice arrives while that write is in flight. The write must not clear what the
    endpoints made pending: the next sync lifts the refusal. (The flag was cleared after the
    write, and with the nftables backend a new service refused its clients until some other
    change or the periodic sync.)"""
    tracker, syncer, _, _ = make(2)
    slow = SlowRules()
    syncer.rules = slow
    slow.done.set()
    await syncer.sync()
    slow.done.clear()
    slow.started.clear()
    tracker.upsert(Kind.SERVICE, service("new", cluster_ip="10.97.0.1"))
    first = asyncio.create_task(syncer.sync())
    await asyncio.wait_for(slow.started.wait(), 5)
    tracker.upsert(
        Kind.ENDPOINT_SLICE, endpoint_slice("new-1", "new", endpoints=[endpoint("10.1.0.7")])
    )
    assert syncer.apply_endpoints() == {spn("new")} and pending(syncer)
    slow.done.set()
    await first
    assert {p.service for p in refusals(slow)} == {spn("new")}  # written before it came
    assert pending(syncer)  # what came during the write is still to be written
    await syncer.sync()
    assert refusals(slow) == set() and not pending(syncer)


async def test_a_proxy_port_without_endpoints_refuses_until_it_has_one() -> None:
    tracker, syncer, _, rules = make(3)
    await syncer.sync()
    assert refusals(rules) == set() and not pending(syncer)
    lst = syncer.ports[spn("s1")].cluster
    assert lst is not None
    # Its last endpoint gone: the balancer at once, the rules at the next (rate-limited) sync.
    tracker.upsert(Kind.ENDPOINT_SLICE, endpoint_slice("s1-1", "s1", endpoints=[]))
    assert syncer.apply_endpoints() == {spn("s1")} and pending(syncer)
    await syncer.sync()
    assert refusals(rules) == {Portal.refusing(spn("s1"), lst.port, IPFamily.V4, anywhere=False)}
    assert not pending(syncer)
    # A pod that is terminating and no longer serving is no endpoint either: nothing to write.
    gone = endpoint("10.1.0.2", ready=False, serving=False, terminating=True)
    tracker.upsert(Kind.ENDPOINT_SLICE, endpoint_slice("s1-1", "s1", endpoints=[gone]))
    syncer.apply_endpoints()
    assert not pending(syncer)
    # One that still serves while it terminates is (kube-proxy's fallback): refused no more.
    serving = endpoint("10.1.0.2", ready=False, serving=True, terminating=True)
    tracker.upsert(Kind.ENDPOINT_SLICE, endpoint_slice("s1-1", "s1", endpoints=[serving]))
    syncer.apply_endpoints()
    assert pending(syncer)
    await syncer.sync()
    assert refusals(rules) == set()
    # Endpoints that come and go while some remain touch no rule.
    more = [serving, endpoint("10.1.0.3")]
    tracker.upsert(Kind.ENDPOINT_SLICE, endpoint_slice("s1-1", "s1", endpoints=more))
    syncer.apply_endpoints()
    assert not pending(syncer)
    # A service port that goes away takes its refusal with it.
    tracker.upsert(Kind.ENDPOINT_SLICE, endpoint_slice("s2-1", "s2", endpoints=[]))
    syncer.apply_endpoints()
    await syncer.sync()
    assert {p.service for p in refusals(rules)} == {spn("s2")}
    tracker.delete(Kind.SERVICE, service("s2"))
    await syncer.sync()
    assert refusals(rules) == set()


async def test_a_local_policy_without_a_local_endpoint_drops_outside_traffic() -> None:
    # Endpoints, none on this node (node-a): the external listener of the Local policy has
    # nothing, and its traffic is dropped, as kube-proxy's; cluster traffic still flows.
    tracker, syncer, _, rules = make(0)
    spec: dict[str, Any] = {"type": "NodePort", "externalTrafficPolicy": "Local"}
    ports = [{"name": "http", "port": 80, "protocol": "TCP", "nodePort": 30080}]
    tracker.upsert(Kind.SERVICE, service("lb", cluster_ip="10.96.0.50", ports=ports, **spec))
    elsewhere = [endpoint("10.1.0.5", nodeName="node-b")]
    tracker.upsert(Kind.ENDPOINT_SLICE, endpoint_slice("lb-1", "lb", endpoints=elsewhere))
    await syncer.sync()
    pp = syncer.ports[spn("lb")]
    assert pp.external is not None and pp.cluster is not None
    assert refusals(rules) == {
        Portal.refusing(spn("lb"), pp.external.port, IPFamily.V4, anywhere=True)
    }
    assert refusals(rules).pop().kind is PortalKind.NO_LOCAL_ENDPOINTS
    # No endpoint anywhere: both listeners reject.
    tracker.upsert(Kind.ENDPOINT_SLICE, endpoint_slice("lb-1", "lb", endpoints=[]))
    syncer.apply_endpoints()
    await syncer.sync()
    assert {(p.proxy_port, p.kind) for p in refusals(rules)} == {
        (pp.cluster.port, PortalKind.NO_ENDPOINTS),
        (pp.external.port, PortalKind.NO_ENDPOINTS),
    }


async def test_what_counts_as_an_endpoint_anywhere_is_the_familys_and_categorizes() -> None:
    """A Local policy's refusals and its no-local gauge look at the endpoints anywhere of the
    listener's family, as ``categorize`` takes them: ready ones, else those that serve while
    they terminate; one that serves without terminating (and is not ready) is none."""
    v6_only = [endpoint("fd00:1::2", nodeName="node-b")]
    tracker, syncer, rules, _, _ = make_dual(
        services=[dual_service(externalTrafficPolicy="Local")],
        slices=[endpoint_slice("web-v6", "web", endpoints=v6_only, address_type="IPv6")],
    )
    await syncer.sync()
    kinds = {(p.family, p.kind) for p in refusals(rules)}
    assert kinds == {(V4, PortalKind.NO_ENDPOINTS), (V6, PortalKind.NO_LOCAL_ENDPOINTS)}
    no_local = "kubeproxy_sync_proxy_rules_no_local_endpoints_total"
    assert gauge(no_local, traffic_policy="external") == 1
    for conditions, usable in (
        ({"ready": False, "serving": True, "terminating": False}, False),
        ({"ready": False, "serving": True, "terminating": True}, True),
    ):
        eps = [endpoint("fd00:1::2", nodeName="node-b", **conditions)]
        tracker.upsert(
            Kind.ENDPOINT_SLICE,
            endpoint_slice("web-v6", "web", endpoints=eps, address_type="IPv6"),
        )
        syncer.apply_endpoints()
        await syncer.sync()
        v6_kinds = {p.kind for p in refusals(rules) if p.family is V6}
        expected = PortalKind.NO_LOCAL_ENDPOINTS if usable else PortalKind.NO_ENDPOINTS
        assert expected in v6_kinds, conditions
        assert gauge(no_local, traffic_policy="external") == usable, conditions


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


async def sync_with_a_change_midway(syncer: Syncer, change: Callable[[], None]) -> None:
    """Run a sync; at its first turn of the loop make ``change``, and hand the endpoint
    changes over as the proxy does (``Proxy._apply_endpoints``, on the next loop pass)."""
    loop = asyncio.get_running_loop()

    def midway() -> None:
        change()
        loop.call_soon(syncer.apply_endpoints)

    loop.call_soon(midway)
    await syncer.sync()


@pytest.mark.parametrize("first", [True, False], ids=["ports-being-made", "ports-changing"])
async def test_an_endpoint_change_during_a_long_sync_is_not_lost_or_undone(first: bool) -> None:
    tracker, syncer, _, _ = make(3000)
    if not first:
        await syncer.sync()
        # Every Service changes (a new port number): the next sync goes through all 3,000.
        tracker.replace(
            Kind.SERVICE,
            [
                service(
                    f"s{i}",
                    cluster_ip=f"10.96.{i // 250}.{i % 250}",
                    ports=[{"name": "http", "port": 8080, "protocol": "TCP"}],
                )
                for i in range(3000)
            ],
        )
    moved = [
        endpoint_slice(f"s{i}-1", f"s{i}", endpoints=[endpoint("10.1.0.7")]) for i in (0, 2999)
    ]

    def move() -> None:
        for s in moved:
            tracker.upsert(Kind.ENDPOINT_SLICE, s)

    await sync_with_a_change_midway(syncer, move)
    assert syncer.last_changed == 3000
    assert eps(syncer, "s0") == eps(syncer, "s2999") == ["10.1.0.7"]
    await syncer.sync()  # and nothing left behind for the next sync to put back
    assert eps(syncer, "s0") == eps(syncer, "s2999") == ["10.1.0.7"]


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


async def test_what_failed_asks_for_a_retry_backing_off_to_the_sync_period() -> None:
    _, syncer, factory, _ = make(2)
    factory.refuse.add(spn("s1"))
    delays = []
    for _ in range(14):
        await syncer.sync()
        delays.append(syncer.retry_after())
    assert delays[:6] == [RETRY_FIRST_S * 2**i for i in range(6)]
    assert delays[-1] == 3600  # the sync period bounds it
    factory.refuse.clear()
    await syncer.sync()
    assert syncer.retry_after() is None and syncer.ports[spn("s1")].cluster is not None


def laptop_syncer(tracker: Tracker, factory: Factory | None = None) -> Syncer:
    """A laptop syncer (--rules none, listeners on 127.0.0.1) over ``tracker``."""
    return Syncer(
        tracker=tracker,
        rules=RecordingRules(),
        listener_factory=factory or Factory(),
        options=SyncerOptions(
            settings=Settings(rules="none", proxy_port_range="40000-40100"),
            dataplane=DataplaneSettings(node_name="node-a"),
            listen_hosts=("127.0.0.1",),
        ),
    )


async def test_a_laptop_port_freed_and_claimed_in_one_sync_is_retried_soon(
    unused_tcp_port: int,
) -> None:
    # A service renamed: the old name's listener closes and the new one wants its port. With
    # workers the port stays held a moment (their copies close later): retry soon.
    tracker = Tracker()
    port = [{"name": "http", "port": unused_tcp_port, "protocol": "TCP"}]
    tracker.replace(Kind.SERVICE, [service("old", ports=port)])
    tracker.replace(Kind.ENDPOINT_SLICE, [])
    factory = Factory()
    syncer = laptop_syncer(tracker, factory)
    await syncer.sync()
    tracker.replace(Kind.SERVICE, [service("new", ports=port)])
    factory.taken.add(unused_tcp_port)  # the workers have not closed theirs yet
    await syncer.sync()
    new = syncer.ports[spn("new")].cluster
    assert new is not None and new.port != unused_tcp_port
    assert syncer.retry_after() == RETRY_SOON_S
    factory.taken.clear()
    await syncer.sync()  # the retry: home
    new = syncer.ports[spn("new")].cluster
    assert new is not None and new.port == unused_tcp_port and syncer.retry_after() is None


async def test_a_listener_waiting_for_its_port_moves_soon_when_a_sync_frees_it(
    unused_tcp_port: int,
) -> None:
    # Two services on one laptop port: "dup" opened elsewhere and has backed off (its next
    # look is seconds away). "a" goes: the port it frees is still held a moment by the
    # workers' copies of its socket, so "dup" looks again soon, not after its backoff.
    tracker = Tracker()
    port = [{"name": "http", "port": unused_tcp_port, "protocol": "TCP"}]
    tracker.replace(Kind.SERVICE, [service("a", ports=port), service("dup", ports=port)])
    tracker.replace(Kind.ENDPOINT_SLICE, [])
    syncer = laptop_syncer(tracker)
    for _ in range(4):
        await syncer.sync()
    dup = syncer.ports[spn("dup")].cluster
    assert dup is not None and dup.port != unused_tcp_port
    assert syncer.retry_after() == 8 * RETRY_FIRST_S  # backed off: 1, 2, 4, 8 s
    tracker.replace(Kind.SERVICE, [service("dup", ports=port)])
    with socket.socket() as held:  # a worker's copy of "a"'s socket, not closed yet
        held.bind(("127.0.0.1", unused_tcp_port))
        held.listen()
        await syncer.sync()
    assert spn("a") not in syncer.ports
    assert syncer.retry_after() == RETRY_SOON_S
    await syncer.sync()  # the retry: home
    dup = syncer.ports[spn("dup")].cluster
    assert dup is not None and dup.port == unused_tcp_port and syncer.retry_after() is None


async def test_the_ports_changed_line_counts_every_listener_opened_and_closed(
    unused_tcp_port_factory: Callable[[], int], caplog: pytest.LogCaptureFixture
) -> None:
    # A laptop service's port changes: its listener closes and one opens on the new port.
    first, second = unused_tcp_port_factory(), unused_tcp_port_factory()
    tracker = Tracker()
    tracker.replace(
        Kind.SERVICE, [service("a", ports=[{"name": "http", "port": first, "protocol": "TCP"}])]
    )
    tracker.replace(Kind.ENDPOINT_SLICE, [])
    syncer = laptop_syncer(tracker)
    caplog.set_level(logging.INFO, logger="uproxy.syncer")

    def said() -> list[dict[str, Any]]:
        lines = [r for r in caplog.records if r.getMessage() == "Proxy ports changed"]
        caplog.clear()
        return [r.__dict__["kv"] for r in lines]

    await syncer.sync()
    assert said() == [{"opened": 1, "closed": 0}]
    tracker.replace(
        Kind.SERVICE, [service("a", ports=[{"name": "http", "port": second, "protocol": "TCP"}])]
    )
    await syncer.sync()
    assert said() == [{"opened": 1, "closed": 1}]
    tracker.replace(Kind.SERVICE, [])
    await syncer.sync()
    assert said() == [{"opened": 0, "closed": 1}]


def node_syncer(tracker: Tracker, rules: RecordingRules, port_range: str) -> Syncer:
    """A node's syncer (iptables-restore, listening on 0.0.0.0); ``rules.previous_ports``
    stands for the last run's rules."""
    return Syncer(
        tracker=tracker,
        rules=rules,
        listener_factory=Factory(),
        options=SyncerOptions(
            settings=Settings(rules="iptables-restore", proxy_port_range=port_range),
            dataplane=DataplaneSettings(node_name="node-a"),
            listen_hosts=("0.0.0.0",),
        ),
    )


def claiming_service(name: str, node_port: int, *, health: int = 0) -> dict[str, Any]:
    extra: dict[str, Any] = {"type": "NodePort"}
    if health:
        extra.update(type="LoadBalancer", externalTrafficPolicy="Local", healthCheckNodePort=health)
    return service(
        name,
        cluster_ip=f"10.96.1.{node_port % 250}",
        ports=[{"name": "http", "port": 80, "protocol": "TCP", "nodePort": node_port}],
        **extra,
    )


async def test_node_ports_are_never_chosen_as_proxy_ports() -> None:
    # A proxy port range that overlaps the node ports (a custom node-port range): a proxy
    # port there answers the node port for the wrong service, directly, rules or not.
    tracker, rules = Tracker(), RecordingRules()
    tracker.replace(
        Kind.SERVICE,
        [
            claiming_service("np", 40000),
            claiming_service("lb", 40001, health=40002),
            service("s1", cluster_ip="10.96.0.1"),
        ],
    )
    tracker.replace(Kind.ENDPOINT_SLICE, [])
    syncer = node_syncer(tracker, rules, "40000-40005")
    await syncer.sync()
    ports = {lst.port for pp in syncer.ports.values() for lst in pp.listeners}
    assert len(ports) == 3 and not ports & {40000, 40001, 40002}, ports


class _InOrder(random.Random):
    """An allocator's random source that walks its ports in order, from the first."""

    def randrange(self, start: int, stop: int | None = None, step: int = 1) -> int:
        return 0 if stop is None else start


async def test_a_sync_hands_out_no_proxy_port_that_a_node_port_of_the_same_sync_claims(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Where the proxy ports' range overlaps the node ports (a node whose
    ip_local_port_range was widened, say to 1024-65000), a start handed a service that sorts
    before a NodePort service that service's node port as its proxy port, and the same sync
    moved it at once: a listener opened for nothing and a warning per port, 45-50 of them
    at every start of a 10,000-service node with 350 node ports."""
    monkeypatch.setattr(
        syncer_module, "PortAllocator", functools.partial(PortAllocator, rng=_InOrder())
    )
    tracker, rules = Tracker(), RecordingRules()
    tracker.replace(
        Kind.SERVICE,
        [
            service("a0", cluster_ip="10.96.0.1"),
            service("a1", cluster_ip="10.96.0.2"),
            claiming_service("np", 40000),
        ],
    )
    tracker.replace(Kind.ENDPOINT_SLICE, [])
    syncer = node_syncer(tracker, rules, "40000-40005")
    caplog.set_level(logging.INFO, logger="uproxy.syncer")
    await syncer.sync()
    ports = {name: syncer.ports[spn(name)].cluster for name in ("a0", "a1", "np")}
    assert all(lst is not None and lst.port != 40000 for lst in ports.values()), ports
    said = [(r.getMessage(), r.__dict__.get("kv")) for r in caplog.records]
    assert ("Proxy ports changed", {"opened": 3, "closed": 0}) in said, said
    assert not [m for m, _ in said if m.startswith("Moving a proxy port")], said


async def test_a_proxy_port_a_new_node_port_claims_moves_with_its_rules(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tracker, rules = Tracker(), RecordingRules()
    tracker.replace(Kind.SERVICE, [service("s1", cluster_ip="10.96.0.1")])
    tracker.replace(Kind.ENDPOINT_SLICE, [])
    syncer = node_syncer(tracker, rules, "40000-40002")
    await syncer.sync()
    held = syncer.ports[spn("s1")].cluster
    assert held is not None
    taken = held.port
    caplog.set_level(logging.WARNING, logger="uproxy")
    caplog.clear()
    tracker.upsert(Kind.SERVICE, claiming_service("np", taken))
    await syncer.sync()
    moved = syncer.ports[spn("s1")].cluster
    assert moved is not None and moved.port != taken
    assert syncer.ports[spn("np")].cluster.port not in (taken, moved.port)  # type: ignore[union-attr]
    # s1's rules follow its new proxy port in the same sync
    s1_portals = {p.proxy_port for p in rules.syncs[-1] if p.service == spn("s1")}
    assert s1_portals == {moved.port}
    said = [(r.getMessage(), r.__dict__["kv"]) for r in caplog.records]
    assert said == [
        (
            "Moving a proxy port off another service's node port",
            {"service": str(spn("s1")), "port": taken, "node_port_of": str(spn("np"))},
        )
    ]
    tracker.delete(Kind.SERVICE, claiming_service("np", taken))  # claimed no more
    tracker.upsert(Kind.SERVICE, service("s2", cluster_ip="10.96.0.2"))
    await syncer.sync()
    s2 = syncer.ports[spn("s2")].cluster
    assert s2 is not None and s2.port == taken  # the only port left: free to choose again


async def test_a_start_takes_the_last_runs_ports_back_and_leaves_the_others_alone() -> None:
    # The last run's rules still lead 10.96.0.0:80 to 40050, and 10.96.9.9:80 (a service gone
    # since) to 40051: s0 gets 40050 back; nobody gets 40051 until the new rules are in.
    tracker = Tracker()
    tracker.replace(Kind.SERVICE, [service(f"s{i}", cluster_ip=f"10.96.0.{i}") for i in range(3)])
    tracker.replace(Kind.ENDPOINT_SLICE, [])
    rules = RecordingRules()
    rules.previous_ports = {("10.96.0.0", "tcp", 80): 40050, ("10.96.9.9", "tcp", 80): 40051}
    syncer = node_syncer(tracker, rules, "40050-40053")
    await syncer.sync()
    got = {name: syncer.ports[spn(name)].cluster for name in ("s0", "s1", "s2")}
    assert all(lst is not None for lst in got.values())
    ports = {name: lst.port for name, lst in got.items() if lst is not None}
    assert ports["s0"] == 40050
    assert {ports["s1"], ports["s2"]} == {40052, 40053}  # 40051 held back
    tracker.upsert(Kind.SERVICE, service("s3", cluster_ip="10.96.0.3"))
    await syncer.sync()  # the rules are this run's now: 40051 is free to take
    s3 = syncer.ports[spn("s3")].cluster
    assert s3 is not None and s3.port == 40051


async def test_a_last_runs_port_still_held_is_said_and_another_one_taken(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The last run's workers still drain and hold its ports (its control process was
    killed): the start said only "Reusing the last run's proxy ports", and opened others."""
    tracker = Tracker()
    tracker.replace(Kind.SERVICE, [service(f"s{i}", cluster_ip=f"10.96.0.{i}") for i in range(2)])
    tracker.replace(Kind.ENDPOINT_SLICE, [])
    rules = RecordingRules()
    rules.previous_ports = {("10.96.0.0", "tcp", 80): 40050, ("10.96.0.1", "tcp", 80): 40051}
    syncer = node_syncer(tracker, rules, "40050-40053")
    factory = syncer._open
    assert isinstance(factory, Factory)
    factory.taken.add(40050)
    caplog.set_level(logging.INFO, logger="uproxy.syncer")
    await syncer.sync()
    ports = {name: syncer.ports[spn(name)].cluster for name in ("s0", "s1")}
    assert ports["s1"] is not None and ports["s1"].port == 40051  # its own, free
    assert ports["s0"] is not None and ports["s0"].port in (40052, 40053)
    said = {r.getMessage(): getattr(r, "kv", None) for r in caplog.records}
    held = "Some of the last run's proxy ports are taken (its workers draining, or a connection given one as its local port): "
    assert said[held + "those services have new ones, and the rules lead there now"] == {"held": 1}


@pytest.mark.parametrize("via", ["node port", "externalIP", "LoadBalancer IP"])
async def test_a_start_gives_an_external_listener_its_last_port_back(via: str) -> None:
    # A Local policy: external traffic has a listener of its own, which the last run's node
    # port, externalIP or LoadBalancer IP rules lead to; it gets that port back as the
    # cluster listener gets its own.
    port = [{"name": "http", "port": 80, "protocol": "TCP", "nodePort": 30080}]
    svc = service(
        "lb",
        cluster_ip="10.96.0.5",
        type="LoadBalancer",
        ports=port,
        externalIPs=["192.0.2.7"],
        externalTrafficPolicy="Local",
    )
    svc["status"] = {"loadBalancer": {"ingress": [{"ip": "198.51.100.7"}]}}
    tracker = Tracker()
    tracker.replace(Kind.SERVICE, [svc])
    tracker.replace(Kind.ENDPOINT_SLICE, [])
    external_key = {
        "node port": ("", "tcp", 30080),
        "externalIP": ("192.0.2.7", "tcp", 80),
        "LoadBalancer IP": ("198.51.100.7", "tcp", 80),
    }[via]
    rules = RecordingRules()
    rules.previous_ports = {("10.96.0.5", "tcp", 80): 40060, external_key: 40061}
    syncer = node_syncer(tracker, rules, "40060-40069")
    await syncer.sync()
    pp = syncer.ports[spn("lb")]
    assert pp.cluster is not None and pp.external is not None
    assert (pp.cluster.port, pp.external.port) == (40060, 40061)


def node_port_service(name: str, node_port: int) -> dict[str, Any]:
    ports = [{"name": "http", "port": 80, "protocol": "TCP", "nodePort": node_port}]
    return service(
        name, type="NodePort", ports=ports, cluster_ip="10.96.0.1" if name == "a" else "10.96.0.2"
    )


async def test_a_node_port_somebody_holds_is_retried_soon_and_then_served(
    unused_tcp_port_factory: Any,
) -> None:
    # An old uproxy pod still holds the node port: no portal for it, a retry in a second
    # (not at the sync period), and the port is reserved and served once it is free.
    port = unused_tcp_port_factory()
    holder = socket.socket()
    holder.bind(("127.0.0.1", port))
    holder.listen(1)
    tracker = Tracker()
    tracker.replace(Kind.SERVICE, [node_port_service("a", port)])
    tracker.replace(Kind.ENDPOINT_SLICE, [])
    held = NodePortReservations(bind_ips=("127.0.0.1",))
    syncer = Syncer(
        tracker=tracker,
        rules=RecordingRules(),
        listener_factory=Factory(),
        options=SyncerOptions(
            settings=Settings(rules="iptables-restore", proxy_port_range="40000-59999"),
            dataplane=DataplaneSettings(node_name="node-a"),
            listen_hosts=("0.0.0.0",),
            nodeports=held,
        ),
    )

    def node_ports() -> set[int]:
        return {p.port for p in syncer.portals() if p.kind is PortalKind.NODE_PORT}

    try:
        await syncer.sync()
        assert node_ports() == set() and held.owner(Protocol.TCP, port) is None
        assert syncer.retry_after() == RETRY_FIRST_S
        holder.close()
        await syncer.sync()  # nothing changed in the tracker: the retry alone reserves it
        assert held.owner(Protocol.TCP, port) == spn("a") and node_ports() == {port}
        assert syncer.retry_after() is None
    finally:
        holder.close()
        held.close()


def free_run(n: int) -> int:
    """The first of ``n`` consecutive TCP ports free on every address right now."""
    for base in range(45000, 60000, n):
        with contextlib.ExitStack() as stack:
            try:
                for port in range(base, base + n):
                    s = stack.enter_context(socket.socket())
                    s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return base
    raise AssertionError("no run of free ports")


async def test_a_node_port_on_our_own_proxy_port_is_held_in_the_same_sync() -> None:
    # Real listeners and node-port sockets: the proxy port a new service claims as its node
    # port moves, and the node port is held (and its portal made) by that very sync.
    base = free_run(3)
    tracker = Tracker()
    tracker.replace(Kind.SERVICE, [service("s1", cluster_ip="10.96.0.3")])
    tracker.replace(Kind.ENDPOINT_SLICE, [])
    held = NodePortReservations(bind_ips=("127.0.0.1",))
    syncer = Syncer(
        tracker=tracker,
        rules=RecordingRules(),
        options=SyncerOptions(
            settings=Settings(rules="iptables-restore", proxy_port_range=f"{base}-{base + 2}"),
            dataplane=DataplaneSettings(node_name="node-a"),
            listen_hosts=("0.0.0.0",),
            nodeports=held,
        ),
    )
    try:
        await syncer.sync()
        first = syncer.ports[spn("s1")].cluster
        assert first is not None
        taken = first.port
        tracker.upsert(Kind.SERVICE, node_port_service("a", taken))
        await syncer.sync()
        moved = syncer.ports[spn("s1")].cluster
        assert moved is not None and moved.port != taken
        assert held.owner(Protocol.TCP, taken) == spn("a")
        assert {p.port for p in syncer.portals() if p.kind is PortalKind.NODE_PORT} == {taken}
        assert syncer.retry_after() is None
    finally:
        await syncer.close(drain=False)
        held.close()


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


def test_no_local_endpoints_series_exist_from_the_start() -> None:
    # kube-proxy sets both series on every sync: a dashboard sees 0, not a missing series.
    code = (
        "from prometheus_client import REGISTRY\n"
        "from tests.unit.test_syncer import make\n"
        "make(0)\n"
        "for p in ('internal', 'external'):\n"
        "    print(REGISTRY.get_sample_value("
        "'kubeproxy_sync_proxy_rules_no_local_endpoints_total', {'traffic_policy': p}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.split() == ["0.0", "0.0"]


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


# ----- dual-stack ------------------------------------------------------------------------------

V4, V6 = IPFamily.V4, IPFamily.V6


class RecordingLink:
    """Stands in for the worker pool: what each (service port, family) balancer was given."""

    def __init__(self) -> None:
        self.endpoints: dict[tuple[ServicePortName, IPFamily], tuple[Endpoint, ...]] = {}
        self.zones: dict[tuple[ServicePortName, IPFamily], str | None] = {}
        self.forgotten: list[tuple[ServicePortName, IPFamily]] = []
        self.changes: dict[tuple[ServicePortName, IPFamily], Any] = {}  # the last of each

    def set_endpoints(
        self,
        name: ServicePortName,
        family: IPFamily,
        port: ServicePort,
        endpoints: Any,
        zone: str | None = None,
        change: Any = None,
    ) -> None:
        self.endpoints[(name, family)] = tuple(endpoints)
        self.zones[(name, family)] = zone
        self.changes[(name, family)] = change

    def forget(self, name: ServicePortName, family: IPFamily) -> None:
        self.forgotten.append((name, family))
        self.endpoints.pop((name, family), None)

    def when_applied(self, callback: Callable[[], None]) -> None:
        callback()  # nothing in flight here


def dual_service(name: str = "web", **spec: Any) -> dict[str, Any]:
    svc = service(name, cluster_ip="10.96.0.10", type="LoadBalancer", **spec)
    svc["spec"].update(
        clusterIPs=["10.96.0.10", "fd00:96::10"],
        externalIPs=["203.0.113.5", "2001:db8::5"],
        loadBalancerSourceRanges=["192.0.2.0/24", "2001:db8:1::/48"],
    )
    svc["spec"]["ports"][0]["nodePort"] = 30080
    svc["status"] = {"loadBalancer": {"ingress": [{"ip": "198.51.100.9"}, {"ip": "2001:db8::9"}]}}
    return svc


def dual_slices(name: str = "web") -> list[dict[str, Any]]:
    v4 = [endpoint("10.1.0.1", nodeName="node-a"), endpoint("10.1.0.2", nodeName="node-b")]
    v6 = [endpoint("fd00:1::1", nodeName="node-a"), endpoint("fd00:1::2", nodeName="node-b")]
    return [
        endpoint_slice(f"{name}-v4", name, endpoints=v4),
        endpoint_slice(f"{name}-v6", name, endpoints=v6, address_type="IPv6"),
    ]


def make_dual(
    hosts: tuple[str, ...] = ("0.0.0.0", "::"),
    *,
    laptop: bool = False,
    services: Collection[dict[str, Any]] = (),
    slices: Collection[dict[str, Any]] = (),
    port_range: str = "40000-40099",
) -> tuple[Tracker, Syncer, RecordingRules, RecordingLink, list[TableRow]]:
    """A syncer of a node serving ``hosts``' families, its tracker listed with ``services``
    and ``slices``."""
    tracker, rules, link = Tracker(), RecordingRules(), RecordingLink()
    rows: list[TableRow] = []
    tracker.replace(Kind.SERVICE, list(services))
    tracker.replace(Kind.ENDPOINT_SLICE, list(slices))
    syncer = Syncer(
        tracker=tracker,
        rules=rules,
        listener_factory=Factory(),
        options=SyncerOptions(
            settings=Settings(
                rules="none" if laptop else "iptables-restore", proxy_port_range=port_range
            ),
            dataplane=DataplaneSettings(node_name="node-a"),
            listen_hosts=hosts,
            link=link,
            on_table=rows.extend,
        ),
    )
    return tracker, syncer, rules, link, rows


def big_slices(first: int, v6: bool = False) -> list[dict[str, Any]]:
    """Two slices of 100 endpoints each (one family), addresses from ``first`` on."""
    out = []
    for k in range(2):
        ips = [
            f"fd00:1::{first + 100 * k + i:x}" if v6 else f"10.1.{k}.{first + i}"
            for i in range(100)
        ]
        eps = [endpoint(ip, nodeName=f"node-{i % 3}") for i, ip in enumerate(ips)]
        kind = "IPv6" if v6 else "IPv4"
        out.append(endpoint_slice(f"web-{kind}-{k}", "web", endpoints=eps, address_type=kind))
    return out


async def test_a_big_ports_change_is_computed_once_and_followed_in_place() -> None:
    """A change of one of a big port's endpoints reaches the syncer's own balancer as that
    change: the endpoints that stay keep their round-robin places (a whole set would be
    shuffled anew). The workers are given the same change, with what it was computed from:
    what they were sent last. The other family, unchanged, changes nothing."""
    tracker, syncer, _, link, _ = make_dual(
        services=[dual_service()], slices=[*big_slices(1), *big_slices(1, v6=True)]
    )
    await syncer.sync()
    fp = syncer.ports[spn("web")].families[V4]
    before = list(fp.balancer.endpoints(Traffic.CLUSTER))
    v6 = syncer.ports[spn("web")].families[V6].balancer
    v6_order = list(v6.endpoints(Traffic.CLUSTER))
    sent = link.endpoints[(spn("web"), V4)]
    moved = big_slices(1)[0]
    moved["endpoints"][7] = endpoint("10.1.9.9", nodeName="node-a")
    tracker.upsert(Kind.ENDPOINT_SLICE, moved)
    assert syncer.apply_endpoints() == {spn("web")}
    after = list(fp.balancer.endpoints(Traffic.CLUSTER))
    assert {ep.ip for ep in after} == {ep.ip for ep in before} - {"10.1.0.8"} | {"10.1.9.9"}
    assert sum(a is b for a, b in zip(before, after, strict=True)) >= len(before) - 3
    base, change = link.changes[(spn("web"), V4)]
    assert base == sent and change is not None
    added, removed = change
    assert [ep.ip for ep in added] == ["10.1.9.9"] and removed == (("10.1.0.8", 8080),)
    assert not any(":" in ep.ip for ep in link.endpoints[(spn("web"), V4)])
    assert all(a is b for a, b in zip(v6_order, v6.endpoints(Traffic.CLUSTER), strict=True))


async def test_a_big_ports_change_the_tracker_followed_is_not_compared_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a single-stack port the tracker's delta is the change: the syncer neither filters
    nor compares the endpoints (``endpoint_changes`` is not called), its balancer follows
    it in place, and the workers get it with what it was computed from."""
    import uproxy.syncer as syncer_module

    tracker, syncer, _, link, _ = make_dual(
        ("0.0.0.0",), services=[service("web", cluster_ip="10.96.0.10")], slices=big_slices(1)
    )
    await syncer.sync()
    fp = syncer.ports[spn("web")].families[V4]
    before = list(fp.balancer.endpoints(Traffic.CLUSTER))
    sent = link.endpoints[(spn("web"), V4)]
    compared: list[int] = []
    monkeypatch.setattr(syncer_module, "endpoint_changes", lambda *a: compared.append(1))
    moved = big_slices(1)[1]
    moved["endpoints"][7] = endpoint("10.1.9.9", nodeName="node-a")
    tracker.upsert(Kind.ENDPOINT_SLICE, moved)
    assert syncer.apply_endpoints() == {spn("web")}
    assert compared == []
    after = list(fp.balancer.endpoints(Traffic.CLUSTER))
    assert {ep.ip for ep in after} == {ep.ip for ep in before} - {"10.1.1.8"} | {"10.1.9.9"}
    assert sum(a is b for a, b in zip(before, after, strict=True)) >= len(before) - 3
    base, change = link.changes[(spn("web"), V4)]
    assert base == sent and change is not None
    assert [ep.ip for ep in change[0]] == ["10.1.9.9"] and change[1] == (("10.1.1.8", 8080),)
    # An IPv6 slice comes (this node serves IPv4 only): filtered out, as a whole set is.
    v6 = endpoint_slice("web-v6", "web", endpoints=[endpoint("fd00:1::9")], address_type="IPv6")
    tracker.upsert(Kind.ENDPOINT_SLICE, v6)
    syncer.apply_endpoints()
    assert compared == [1]
    assert not any(":" in ep.ip for ep in fp.balancer.endpoints(Traffic.CLUSTER))
    assert not any(":" in ep.ip for ep in link.endpoints[(spn("web"), V4)])
    tracker.delete(Kind.ENDPOINT_SLICE, v6)
    syncer.apply_endpoints()
    compared.clear()
    # Two changes the tracker followed, the first read by someone else: the second's delta
    # is not from what the balancer has, so the sets are compared.
    first = big_slices(1)[0]
    first["endpoints"][3] = endpoint("10.1.9.3")
    tracker.upsert(Kind.ENDPOINT_SLICE, first)
    assert tracker.state(spn("web")) is not None
    second = big_slices(1)[0]
    second["endpoints"][3:5] = [endpoint("10.1.9.3"), endpoint("10.1.9.4")]
    tracker.upsert(Kind.ENDPOINT_SLICE, second)
    syncer.apply_endpoints()
    assert compared == [1]
    ips = {ep.ip for ep in fp.balancer.endpoints(Traffic.CLUSTER)}
    assert {"10.1.9.3", "10.1.9.4"} <= ips and not {"10.1.0.4", "10.1.0.5"} & ips
    compared.clear()
    # A change of more than a quarter of them goes whole, delta or not.
    wide = big_slices(1)[0]
    wide["endpoints"] = wide["endpoints"][:40]
    tracker.upsert(Kind.ENDPOINT_SLICE, wide)
    syncer.apply_endpoints()
    assert link.changes[(spn("web"), V4)][1] is None and compared == []
    assert len(fp.balancer.endpoints(Traffic.CLUSTER)) == 140


def family_eps(syncer: Syncer, family: IPFamily, name: str = "web") -> list[str]:
    fp = syncer.ports[spn(name)].families[family]
    return sorted(e.ip for e in fp.balancer.endpoints(Traffic.CLUSTER))


async def test_each_family_has_its_listener_balancer_and_portals() -> None:
    tracker, syncer, rules, link, _ = make_dual()
    tracker.upsert(Kind.SERVICE, dual_service())
    for s in dual_slices():
        tracker.upsert(Kind.ENDPOINT_SLICE, s)
    await syncer.sync()
    pp = syncer.ports[spn("web")]
    assert list(pp.families) == [V4, V6]  # the primary family first
    v4, v6 = pp.families[V4], pp.families[V6]
    assert v4.cluster is not None and v4.cluster.host == "0.0.0.0"
    assert v6.cluster is not None and v6.cluster.host == "::"
    # Each family's balancer holds that family's endpoints only; so do the workers'.
    assert family_eps(syncer, V4) == ["10.1.0.1", "10.1.0.2"]
    assert family_eps(syncer, V6) == ["fd00:1::1", "fd00:1::2"]
    assert [e.ip for e in link.endpoints[(spn("web"), V6)]] == ["fd00:1::1", "fd00:1::2"]
    # Every address leads to its own family's proxy port, and the node port is one portal
    # per family; LoadBalancer IPs carry their family's source ranges.
    by_address = {(p.kind, p.ip, p.node_family): p for p in rules.syncs[-1]}
    port = {V4: v4.cluster.port, V6: v6.cluster.port}
    for kind, ip in (
        (PortalKind.CLUSTER_IP, "10.96.0.10"),
        (PortalKind.CLUSTER_IP, "fd00:96::10"),
        (PortalKind.EXTERNAL_IP, "2001:db8::5"),
        (PortalKind.LB_INGRESS, "2001:db8::9"),
    ):
        portal = by_address[(kind, ip, V4)]
        assert portal.proxy_port == port[portal.family], portal
    assert by_address[(PortalKind.LB_INGRESS, "2001:db8::9", V4)].source_ranges == (
        "2001:db8:1::/48",
    )
    assert by_address[(PortalKind.LB_INGRESS, "198.51.100.9", V4)].source_ranges == (
        "192.0.2.0/24",
    )
    node_ports = {p.node_family: p.proxy_port for p in rules.syncs[-1] if p.ip is None}
    assert node_ports == port
    # An endpoint change goes to the right family's balancer.
    v6_only = endpoint_slice("web-v6", endpoints=[endpoint("fd00:1::7")], address_type="IPv6")
    tracker.upsert(Kind.ENDPOINT_SLICE, v6_only)
    assert syncer.apply_endpoints() == {spn("web")}
    assert family_eps(syncer, V6) == ["fd00:1::7"]
    assert family_eps(syncer, V4) == ["10.1.0.1", "10.1.0.2"]


async def test_a_service_is_proxied_in_the_families_of_its_cluster_ips() -> None:
    tracker, syncer, rules, link, _ = make_dual()
    v6_only = service("six", cluster_ip="fd00:96::6")
    tracker.upsert(Kind.SERVICE, v6_only)
    tracker.upsert(Kind.SERVICE, dual_service())
    for s in dual_slices():
        tracker.upsert(Kind.ENDPOINT_SLICE, s)
    await syncer.sync()
    assert list(syncer.ports[spn("six")].families) == [V6]
    # The service loses its IPv6 ClusterIP: its IPv6 listener, balancer and portals go.
    v6_listener = syncer.ports[spn("web")].families[V6].cluster
    tracker.upsert(Kind.SERVICE, service("web", cluster_ip="10.96.0.10"))
    await syncer.sync()
    assert list(syncer.ports[spn("web")].families) == [V4]
    assert isinstance(v6_listener, FakeListener) and v6_listener.closed
    assert (spn("web"), V6) in link.forgotten
    assert {p.family for p in rules.syncs[-1] if p.service == spn("web")} == {V4}


async def test_a_family_the_node_does_not_serve_is_left_out_with_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tracker, syncer, rules, _, _ = make_dual(("0.0.0.0",))  # an IPv4-only node
    tracker.upsert(Kind.SERVICE, dual_service())
    tracker.upsert(Kind.SERVICE, service("six", cluster_ip="fd00:96::6"))
    for s in dual_slices():
        tracker.upsert(Kind.ENDPOINT_SLICE, s)
    await syncer.sync()
    assert list(syncer.ports[spn("web")].families) == [V4]
    assert family_eps(syncer, V4) == ["10.1.0.1", "10.1.0.2"]  # never an IPv6 endpoint
    assert {p.family for p in rules.syncs[-1]} == {V4}
    assert spn("six") not in syncer.ports
    tracker.upsert(Kind.SERVICE, service("six", cluster_ip="fd00:96::6", labels={"a": "b"}))
    await syncer.sync()
    lines = [r for r in caplog.records if "not proxied" in r.getMessage()]
    assert len(lines) == 1 and "default/six" in str(lines[0].kv)  # type: ignore[attr-defined]


async def test_laptop_listens_on_both_loopbacks() -> None:
    tracker, syncer, rules, _, rows = make_dual(("127.0.0.1", "::1"), laptop=True)
    tracker.upsert(Kind.SERVICE, dual_service())
    for s in dual_slices():
        tracker.upsert(Kind.ENDPOINT_SLICE, s)
    await syncer.sync()
    assert rows[-1].listen == "127.0.0.1:80, [::1]:80"  # the service's own port in each
    assert rows[-1].endpoints == "10.1.0.1:8080, 10.1.0.2:8080, [fd00:1::1]:8080, [fd00:1::2]:8080"
    assert rules.syncs[-1] == frozenset()


async def test_a_laptop_row_names_the_first_endpoints_and_counts_the_rest() -> None:
    """A row is read by a person: the first ten endpoints in address order, then how many
    more (at 20,000 endpoints, sorting and printing them all cost 130 ms a change)."""
    ips = [f"10.1.0.{i}" for i in range(30, 5, -1)]  # 25, the smallest last
    _, syncer, _, _, rows = make_dual(
        ("127.0.0.1",),
        laptop=True,
        services=[service("web", cluster_ip="10.96.0.10")],
        slices=[endpoint_slice("web-1", "web", endpoints=[endpoint(ip) for ip in ips])],
    )
    await syncer.sync()
    first = ", ".join(f"10.1.0.{i}:8080" for i in range(6, 16))  # 9 before 10: as numbers
    assert rows[-1].endpoints == first + ", ... 15 more"


async def test_a_new_zone_label_reaches_the_balancers_of_hinted_ports_only() -> None:
    tracker, syncer, _, link, _ = make_dual(("0.0.0.0",))
    zoned = [
        endpoint(f"10.1.0.{i}", hints={"forZones": [{"name": zone}]})
        for i, zone in ((1, "za"), (2, "zb"))
    ]
    tracker.upsert(Kind.SERVICE, service("hinted", cluster_ip="10.96.0.11"))
    tracker.upsert(Kind.ENDPOINT_SLICE, endpoint_slice("hinted-1", "hinted", endpoints=zoned))
    tracker.upsert(Kind.SERVICE, service("plain", cluster_ip="10.96.0.12"))
    plain = [endpoint("10.1.0.3"), endpoint("10.1.0.4")]
    tracker.upsert(Kind.ENDPOINT_SLICE, endpoint_slice("plain-1", "plain", endpoints=plain))
    tracker.set_node(NodeInfo("node-a", zone="za"))
    await syncer.sync()
    assert eps(syncer, "hinted") == ["10.1.0.1"]
    assert link.zones[(spn("hinted"), V4)] == "za"  # the workers choose alike
    assert sorted(eps(syncer, "plain")) == ["10.1.0.3", "10.1.0.4"]

    # The node is relabelled: the next sync re-chooses the hinted port, and only it.
    tracker.set_node(NodeInfo("node-a", zone="zb"))
    link.zones.clear()
    await syncer.sync()
    assert eps(syncer, "hinted") == ["10.1.0.2"]
    assert link.zones == {(spn("hinted"), V4): "zb"}
    assert syncer.last_changed == 1

    # The label goes: hints are ignored, every endpoint takes traffic again.
    tracker.set_node(NodeInfo("node-a"))
    await syncer.sync()
    assert sorted(eps(syncer, "hinted")) == ["10.1.0.1", "10.1.0.2"]
    assert link.zones[(spn("hinted"), V4)] is None


async def test_a_forced_rules_write_that_fails_stays_forced() -> None:
    """kube-proxy's full and partial sync metrics: the retry of a forced write that failed
    is still a full one."""
    _, syncer, _, rules = make(2)
    await syncer.sync()
    failing = True

    async def write(portals: Collection[Portal]) -> None:
        if failing:
            raise RulesError("nft: Could not process rule: Device or resource busy")
        rules.syncs.append(frozenset(portals))

    rules.sync = write  # type: ignore[method-assign]
    syncer.force_rules_sync()
    with pytest.raises(RulesError):
        await syncer._sync_rules()
    failing = False
    assert await syncer._sync_rules() is True  # full
    assert await syncer._sync_rules() is False  # nothing left to write


async def test_a_rules_write_that_did_not_end_leaves_the_rules_pending() -> None:
    """Whatever stopped a write (an unexpected error, a cancel), the rules are still to
    be written."""
    tracker, syncer, _, rules = make(2)
    await syncer.sync()

    async def broken(portals: Collection[Portal]) -> None:
        raise OSError("the backend broke")

    rules.sync = broken  # type: ignore[method-assign]
    tracker.upsert(Kind.ENDPOINT_SLICE, endpoint_slice("s1-1", "s1", endpoints=[]))
    syncer.apply_endpoints()
    assert pending(syncer)
    with pytest.raises(OSError):
        await syncer.sync()
    assert pending(syncer)


async def test_a_laptop_row_says_why_a_port_has_no_endpoints_of_its_family() -> None:
    # `--bind-address ::1` with a service of IPv4 endpoints: the listener never reaches them
    # (each family its own endpoints), and the row says so instead of a bare "(none)".
    slices = [
        endpoint_slice("web-1", "web", endpoints=[endpoint("10.1.0.1"), endpoint("10.1.0.2")])
    ]
    _, syncer, _, _, rows = make_dual(
        ("::1",), laptop=True, services=[service("web", cluster_ip="")], slices=slices
    )
    await syncer.sync()
    (row,) = rows
    assert row.endpoints == "(none of IPv6; 2 IPv4 not used here)"
    _, syncer, _, _, rows = make_dual(("127.0.0.1",), laptop=True, services=[service("web")])
    await syncer.sync()
    assert [r.endpoints for r in rows] == ["(none)"]


async def test_each_port_backs_off_on_its_own() -> None:
    """One port that never opens (a laptop service on port 80, without root) had backed the
    one shared delay off to the sync period, and a port that failed later waited that long
    too, for a port free a moment later."""
    tracker, syncer, factory, _ = make(2)
    factory.refuse.add(spn("s0"))
    for _ in range(8):
        await syncer.sync()
    assert syncer.retry_after() == 128 * RETRY_FIRST_S  # s0 alone, backed off
    factory.refuse.add(spn("late"))
    services = [service(f"s{i}", cluster_ip=f"10.96.0.{i}") for i in range(2)]
    tracker.replace(Kind.SERVICE, [*services, service("late", cluster_ip="10.96.0.9")])
    await syncer.sync()
    assert syncer.ports[spn("late")].cluster is None
    assert syncer.retry_after() == RETRY_FIRST_S  # late's first failure: 1 s
    await syncer.sync()
    assert syncer.retry_after() == 2 * RETRY_FIRST_S
    factory.refuse.discard(spn("late"))
    await syncer.sync()
    assert syncer.ports[spn("late")].cluster is not None
    assert syncer.retry_after() == 1024 * RETRY_FIRST_S  # s0 alone again, still backing off


async def test_a_cancelled_conntrack_clean_up_stops_even_behind_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stop cancels the clean-up of new UDP portals' conntrack entries. One that waited for
    the batch before it took the cancel for that batch's end and went on to run a conntrack
    process for every portal of its own, after the stop."""
    from uproxy.rules import conntrack
    from uproxy.syncer import _forget_unnated

    cleared: list[conntrack.Target] = []

    async def forget_udp(targets: Collection[conntrack.Target]) -> int:
        cleared.extend(targets)
        return len(targets)

    monkeypatch.setattr(conntrack, "forget_udp", forget_udp)
    spn = ServicePortName("default", "dns", "dns", Protocol.UDP)
    portal = Portal(spn, PortalKind.CLUSTER_IP, "10.96.0.10", 53, 40000)
    before = asyncio.ensure_future(asyncio.sleep(60))  # the batch before, still running
    task = asyncio.ensure_future(_forget_unnated([portal], before))
    await asyncio.sleep(0)
    task.cancel()
    try:
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)
        assert cleared == []
        await asyncio.sleep(0)
        assert before.cancelled()  # the batches before it end with it
    finally:
        before.cancel()
        await asyncio.gather(before, return_exceptions=True)


def udp_service(name: str, ip: str) -> dict[str, Any]:
    return service(name, cluster_ip=ip, ports=[{"name": "dns", "port": 53, "protocol": "UDP"}])


def udp_slice(name: str) -> dict[str, Any]:
    ports = [{"name": "dns", "port": 53, "protocol": "UDP"}]
    return endpoint_slice(f"{name}-1", name, endpoints=[endpoint("10.1.0.1")], ports=ports)


async def test_removed_udp_services_are_forgotten_in_conntrack_after_the_rules_not_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Removing UDP services deletes their conntrack entries once the rules no longer lead to
    them, off the sync: one ``conntrack`` per address inside the sync held the rules of the
    whole change (a service added beside 2,000 removed ones waited 61 s for its rule). One
    batch per rules write, the new service's address in it."""
    from uproxy.rules import conntrack

    cleared: list[str] = []
    gate = asyncio.Event()

    async def forget_udp(targets: Collection[conntrack.Target]) -> int:
        await gate.wait()  # as slow as a big conntrack table can be
        cleared.extend(t.ip for t in targets if t.ip is not None)
        return 0

    monkeypatch.setattr(conntrack, "forget_udp", forget_udp)
    tracker, syncer, _, rules = make(0)
    syncer.options.clear_conntrack = True
    olds = [udp_service(f"old{i}", f"10.96.1.{i}") for i in range(3)]
    tracker.replace(Kind.SERVICE, olds)
    tracker.replace(Kind.ENDPOINT_SLICE, [udp_slice(f"old{i}") for i in range(3)])
    await syncer.sync()
    gate.set()  # the new services' own entries
    await asyncio.sleep(0)
    assert syncer._forgetting is not None
    await syncer._forgetting
    cleared.clear()
    gate.clear()
    tracker.replace(Kind.SERVICE, [udp_service("new", "10.96.2.1")])
    tracker.replace(Kind.ENDPOINT_SLICE, [udp_slice("new")])
    async with asyncio.timeout(5):
        await syncer.sync()  # did not wait for a single deletion
    assert {p.ip for p in rules.syncs[-1]} == {"10.96.2.1"}
    assert cleared == []
    gate.set()
    await syncer._forgetting
    assert sorted(cleared) == ["10.96.1.0", "10.96.1.1", "10.96.1.2", "10.96.2.1"]
