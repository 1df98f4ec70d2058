"""Balancer rules without sockets: order, policies, affinity bookkeeping."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

from uproxy.dataplane.balancer import Balancer
from uproxy.dataplane.settings import DataplaneSettings
from uproxy.model import Endpoint, LbAlgorithm, Protocol, ServicePort, ServicePortName, Traffic

NAME = ServicePortName("ns", "svc", "p", Protocol.TCP)
EPS = [Endpoint(f"10.0.0.{i}", 80, node_name="a" if i < 2 else "b") for i in range(4)]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def balancer(**kw: object) -> Balancer:
    given = kw.pop("settings", DataplaneSettings())
    assert isinstance(given, DataplaneSettings)
    settings = dataclasses.replace(
        given,
        node_name="a",
        default_algorithm=kw.pop("algorithm", LbAlgorithm.ROUND_ROBIN),  # type: ignore[arg-type]
    )
    return Balancer(
        NAME,
        settings=settings,
        rng=random.Random(1),
        **kw,  # type: ignore[arg-type]
    )


def test_round_robin_is_exact_and_update_is_idempotent() -> None:
    b = balancer()
    port = ServicePort(name=NAME, port=80)
    b.update(port, EPS)
    order = b.endpoints(Traffic.CLUSTER)
    assert sorted(order) == sorted(EPS)
    picks = [b.pick("1.1.1.1", Traffic.CLUSTER) for _ in range(40)]
    assert Counter(picks) == {e: 10 for e in EPS}
    b.update(port, list(EPS))  # same content: order and position kept
    assert b.endpoints(Traffic.CLUSTER) == order
    assert b.pick("1.1.1.1", Traffic.CLUSTER) == order[0]


def test_order_is_reshuffled_on_change() -> None:
    b = balancer()
    port = ServicePort(name=NAME, port=80)
    many = [Endpoint(f"10.1.0.{i}", 80) for i in range(20)]
    b.update(port, many)
    first = b.endpoints(Traffic.CLUSTER)
    b.update(port, many[:-1])
    second = b.endpoints(Traffic.CLUSTER)
    assert set(second) == set(many[:-1])
    assert list(second) != [e for e in first if e in set(second)]


def test_exclude_skips_tried_endpoints() -> None:
    b = balancer()
    b.update(ServicePort(name=NAME, port=80), EPS[:3])
    start = b.pick("c", Traffic.CLUSTER)
    assert start is not None
    tried = [start]
    while (ep := b.pick("c", Traffic.CLUSTER, exclude=tried)) is not None:
        assert ep not in tried
        tried.append(ep)
    assert sorted(tried) == sorted(EPS[:3])


def test_local_policies_pick_per_traffic_class() -> None:
    b = balancer()
    b.update(ServicePort(name=NAME, port=80, node_port=30000, external_policy_local=True), EPS)
    assert set(b.endpoints(Traffic.EXTERNAL)) == set(EPS[:2])
    assert set(b.endpoints(Traffic.CLUSTER)) == set(EPS)
    assert b.local_ready_ips == {EPS[0].ip, EPS[1].ip}
    b.update(ServicePort(name=NAME, port=80, internal_policy_local=True), EPS[2:])
    assert b.pick("c", Traffic.CLUSTER) is None
    assert b.local_ready_ips == frozenset()


def test_terminating_fallback_and_no_endpoints() -> None:
    b = balancer()
    term = Endpoint("10.2.0.1", 80, ready=False, serving=True, terminating=True)
    b.update(ServicePort(name=NAME, port=80), [term])
    assert b.pick("c", Traffic.CLUSTER) == term
    b.update(ServicePort(name=NAME, port=80), [])
    assert b.pick("c", Traffic.CLUSTER) is None


def test_random_override_per_port() -> None:
    b = balancer()
    b.update(ServicePort(name=NAME, port=80, lb_algorithm=LbAlgorithm.RANDOM), EPS)
    counts = Counter(b.pick("c", Traffic.CLUSTER) for _ in range(4000))
    assert set(counts) == set(EPS)
    assert all(850 <= n <= 1150 for n in counts.values()), counts


def test_affinity_pins_expires_and_resets_on_dial_failure() -> None:
    clock = FakeClock()
    b = balancer(clock=clock)
    b.update(ServicePort(name=NAME, port=80, affinity_timeout_s=10), EPS)
    first = b.pick("c1", Traffic.CLUSTER)
    for _ in range(20):
        clock.now += 5  # each use restarts the timer
        assert b.pick("c1", Traffic.CLUSTER) == first
    clock.now += 10.5
    moved = b.pick("c1", Traffic.CLUSTER)
    assert moved is not None and moved != first
    assert first is not None
    b.dial_failed("c1", moved)
    assert b.affinity_entries == 0
    assert b.pick("c1", Traffic.CLUSTER) != moved


def test_affinity_purged_for_removed_endpoints_and_bounded() -> None:
    b = balancer(settings=DataplaneSettings(max_affinity_entries=50))
    port = ServicePort(name=NAME, port=80, affinity_timeout_s=100)
    b.update(port, EPS)
    for i in range(200):
        b.pick(f"10.9.{i // 250}.{i % 250}", Traffic.CLUSTER)
    assert b.affinity_entries == 50
    pinned = b.pick("10.9.0.199", Traffic.CLUSTER)  # the newest survived eviction
    assert pinned is not None
    b.update(port, [e for e in EPS if e != pinned])
    assert b.affinity_entries < 50
    assert b.pick("10.9.0.199", Traffic.CLUSTER) != pinned
