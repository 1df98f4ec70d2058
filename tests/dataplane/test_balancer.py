"""Balancer rules without sockets: order, policies, affinity bookkeeping."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest

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


def hinted(
    ip: str, zones: tuple[str, ...] = (), nodes: tuple[str, ...] = (), **kw: object
) -> Endpoint:
    return Endpoint(ip, 80, zone_hints=zones, node_hints=nodes, **kw)  # type: ignore[arg-type]


A1, A2 = hinted("10.3.0.1", ("za",), ("a",)), hinted("10.3.0.2", ("za",), ("x",))
B1 = hinted("10.3.0.3", ("zb",), ("y",))
A4, A5 = hinted("10.3.0.4", ("za", "zb")), hinted("10.3.0.5", ("za",))
TOPOLOGY = [
    # (case, endpoints, zone, expected cluster pool)
    ("same node first", [A1, A2, B1], "za", {A1}),
    ("same zone when no node hint names this node", [A2, B1], "zb", {B1}),
    ("an endpoint hinted for two zones", [A4, A2, B1], "zb", {A4, B1}),
    ("node hints on some only: zones decide", [A1, A5, B1], "za", {A1, A5}),
    ("no endpoint for this zone: all", [A2, B1], "zc", {A2, B1}),
    ("node without a zone label: all", [A2, B1], None, {A2, B1}),
    ("one endpoint without hints: all", [A2, B1, Endpoint("10.3.0.6", 80)], "za", None),
    (
        "hints of endpoints that are not ready do not count",
        [A2, B1, Endpoint("10.3.0.7", 80, ready=False)],
        "za",
        {A2},
    ),
    (
        "no ready endpoint: terminating ones, hints ignored",
        [hinted("10.3.0.8", ("zb",), ready=False, serving=True, terminating=True)],
        "za",
        None,
    ),
]


@pytest.mark.parametrize(("case", "eps", "zone", "want"), TOPOLOGY, ids=[c[0] for c in TOPOLOGY])
def test_topology_hints_choose_cluster_endpoints(
    case: str, eps: list[Endpoint], zone: str | None, want: set[Endpoint] | None
) -> None:
    b = balancer()
    b.update(ServicePort(name=NAME, port=80, node_port=30000), eps, zone)
    expected = want if want is not None else set(eps)  # None: every endpoint given
    assert set(b.endpoints(Traffic.CLUSTER)) == expected, case
    assert set(b.endpoints(Traffic.EXTERNAL)) == expected, case  # Cluster policy: the same
    picks = {b.pick(f"10.9.0.{i}", Traffic.CLUSTER) for i in range(12)}
    assert picks == expected, case


def test_topology_follows_the_zone_and_local_policies_ignore_it() -> None:
    b = balancer()
    port = ServicePort(name=NAME, port=80)
    eps = [A2, B1]
    b.update(port, eps, "za")
    assert set(b.endpoints(Traffic.CLUSTER)) == {A2}
    b.update(port, eps, "zb")  # the node was relabelled: same endpoints, other zone
    assert set(b.endpoints(Traffic.CLUSTER)) == {B1}
    # externalTrafficPolicy Local: this node's endpoints (A1, on node "a"), whatever the
    # hints say; cluster traffic still follows them.
    local = ServicePort(name=NAME, port=80, node_port=30000, external_policy_local=True)
    on_a = dataclasses.replace(A2, node_name="a")
    b.update(local, [on_a, B1], "zb")
    assert set(b.endpoints(Traffic.EXTERNAL)) == {on_a}
    assert set(b.endpoints(Traffic.CLUSTER)) == {B1}


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


# ----- least-connections -----

LEAST = LbAlgorithm.LEAST_CONNECTIONS


def test_least_connections_takes_the_endpoint_with_fewest_open_and_equals_in_turn() -> None:
    b = balancer(algorithm=LEAST)
    assert b.counting
    b.update(ServicePort(name=NAME, port=80), EPS[:3])
    order = b.endpoints(Traffic.CLUSTER)
    # Nothing ends: each endpoint gets one before any gets a second, in round-robin order.
    held = [b.pick("c", Traffic.CLUSTER) for _ in range(6)]
    assert held == [*order, *order]
    # Two connections of one endpoint end: the next two go there, whatever the turn.
    busy, freed = order[2], order[0]
    b.release(freed)
    b.release(freed)
    assert [b.pick("c", Traffic.CLUSTER) for _ in range(2)] == [freed, freed]
    # All level again (2 each): back to turns, from after the last one chosen.
    assert b.pick("c", Traffic.CLUSTER) == order[1]
    assert b.pick("c", Traffic.CLUSTER) == busy


def test_least_connections_counts_by_address_across_updates_and_skips_excluded() -> None:
    b = balancer(algorithm=LEAST)
    port = ServicePort(name=NAME, port=80)
    a, c = Endpoint("10.0.0.1", 80), Endpoint("10.0.0.2", 80)
    b.update(port, [a, c])
    for _ in range(4):
        b.pick("x", Traffic.CLUSTER)  # 2 open each
    b.release(a)
    # The same pods with other conditions are new Endpoint objects: the counts hold.
    a2, c2 = (dataclasses.replace(e, zone="z1") for e in (a, c))
    b.update(port, [a2, c2])
    assert b.pick("x", Traffic.CLUSTER) == a2
    # An excluded endpoint (a dial to it just failed) is not taken, however idle.
    b.release(a2)
    b.release(a2)
    assert b.pick("x", Traffic.CLUSTER, exclude=[a2]) == c2
    # Releasing more than was counted never goes below nothing.
    for _ in range(5):
        b.release(c2)
    assert b.pick("x", Traffic.CLUSTER) == a2


def test_least_connections_counts_affinity_hits_and_only_while_it_is_the_algorithm() -> None:
    clock = FakeClock()
    b = balancer(clock=clock)
    rr = ServicePort(name=NAME, port=80, affinity_timeout_s=100)
    b.update(rr, EPS[:2])
    counting = [b.counting]  # round-robin counts nothing
    lc = dataclasses.replace(rr, lb_algorithm=LEAST)
    b.update(lc, EPS[:2])
    counting.append(b.counting)
    assert counting == [False, True]
    pinned = b.pick("10.9.0.1", Traffic.CLUSTER)
    for _ in range(3):
        assert b.pick("10.9.0.1", Traffic.CLUSTER) == pinned  # 4 open to it
    other = b.pick("10.9.0.2", Traffic.CLUSTER)
    assert other != pinned
    assert b.pick("10.9.0.3", Traffic.CLUSTER) == other  # 1 < 4
    assert other is not None
    b.update(rr, EPS[:2])
    assert not b.counting
    b.release(other)  # a connection counted before the switch ends: nothing to count down
    # Back to least-connections: counting starts afresh (what is still open is not
    # counted), so two new clients get one endpoint each, not both the one with fewer.
    b.update(lc, EPS[:2])
    fresh = {b.pick("10.9.0.4", Traffic.CLUSTER), b.pick("10.9.0.5", Traffic.CLUSTER)}
    assert fresh == set(EPS[:2])


# ----- passive ejection -----


def picks(b: Balancer, n: int = 40, client: str = "c") -> Counter[Endpoint | None]:
    return Counter(b.pick(client, Traffic.CLUSTER) for _ in range(n))


def test_an_endpoint_failing_in_a_row_is_left_out_then_back_and_out_for_longer() -> None:
    from uproxy.dataplane import series

    clock = FakeClock()
    b = balancer(clock=clock)
    b.update(ServicePort(name=NAME, port=80), EPS)
    dead, live = EPS[1], [e for e in EPS if e != EPS[1]]
    ejections = series.ENDPOINT_EJECTIONS.labels(str(NAME))
    before = ejections.value
    b.dial_failed("c", dead)
    b.dial_failed("c", dead)
    assert picks(b)[dead] == 10  # two failures: still in the round
    b.dial_failed("c", dead)
    assert set(picks(b)) == set(live)  # the third: out
    assert ejections.value == before + 1
    clock.now += 0.9
    assert dead not in picks(b)
    clock.now += 0.2  # 1 s later: back, in its place in the round
    assert picks(b)[dead] == 10
    b.dial_failed("c", dead)  # its first dial back fails too: out again, for 2 s
    assert ejections.value == before + 2
    clock.now += 1.9
    assert dead not in picks(b)
    clock.now += 0.2
    assert dead in picks(b)
    b.dial_ok(dead)  # a dial that works forgets it all: three failures again to go out
    b.dial_failed("c", dead)
    b.dial_failed("c", dead)
    assert picks(b)[dead] == 10
    assert ejections.value == before + 2


def test_time_out_doubles_up_to_its_longest() -> None:
    clock = FakeClock()
    b = balancer(clock=clock, settings=DataplaneSettings(eject_after=1, eject_max_s=5.0))
    b.update(ServicePort(name=NAME, port=80), EPS)
    dead = EPS[0]
    outs = []
    for _ in range(5):
        b.dial_failed("c", dead)
        out_since = clock.now
        while dead not in picks(b, 4):
            clock.now += 0.25
        outs.append(clock.now - out_since)
    assert outs == [1.0, 2.0, 4.0, 5.0, 5.0]


def test_ejection_never_leaves_a_connection_without_an_endpoint(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from uproxy.dataplane import series

    ejections = series.ENDPOINT_EJECTIONS.labels(str(NAME))
    before = ejections.value
    caplog.set_level(1, logger="uproxy")  # the second time an endpoint goes out: at -v 2
    clock = FakeClock()
    b = balancer(clock=clock, settings=DataplaneSettings(eject_after=1))
    b.update(ServicePort(name=NAME, port=80), EPS[:1])
    b.dial_failed("c", EPS[0])
    assert b.pick("c", Traffic.CLUSTER) == EPS[0]  # the only one: tried anyway
    # ... and neither counted nor said to be left out
    assert ejections.value == before
    clock.now += 1.1  # its time out is over
    b.update(ServicePort(name=NAME, port=80), EPS[:2])
    b.dial_failed("c", EPS[1])
    assert ejections.value == before + 1  # left out: the other one is in
    b.dial_failed("c", EPS[0])  # both out: both still picked, in turn
    assert set(picks(b, 4)) == set(EPS[:2])
    assert ejections.value == before + 1
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "Endpoint failing dials, still used: every other endpoint is out too",
        "Endpoint left out after failed dials",
        "Endpoint failing dials, still used: every other endpoint is out too",
    ]
    # One out, the other tried already by this connection: the one out is its retry.
    b.update(ServicePort(name=NAME, port=80), EPS[:3])
    assert b.pick("c", Traffic.CLUSTER, exclude=EPS[:2]) == EPS[2]
    assert b.pick("c", Traffic.CLUSTER, exclude=[EPS[2]]) in EPS[:2]


def test_a_client_pinned_to_an_endpoint_that_goes_out_moves() -> None:
    clock = FakeClock()
    b = balancer(clock=clock)
    b.update(ServicePort(name=NAME, port=80, affinity_timeout_s=100), EPS)
    pinned = b.pick("c1", Traffic.CLUSTER)
    assert pinned is not None and b.pick("c1", Traffic.CLUSTER) == pinned
    for _ in range(3):  # other clients' dials fail
        b.dial_failed("c2", pinned)
    moved = b.pick("c1", Traffic.CLUSTER)
    assert moved not in (None, pinned)
    assert {b.pick("c1", Traffic.CLUSTER) for _ in range(10)} == {moved}  # pinned anew


def test_an_endpoint_leaving_the_slices_forgets_its_failures() -> None:
    b = balancer()
    port = ServicePort(name=NAME, port=80)
    b.update(port, EPS)
    for _ in range(3):
        b.dial_failed("c", EPS[3])
    assert EPS[3] not in picks(b)
    b.update(port, EPS[:3])
    b.update(port, EPS)  # the same pod back (a new one at that address, as often)
    assert picks(b)[EPS[3]] == 10
    b.dial_failed("c", EPS[3])  # a dial begun before it left counts nothing now
    b.update(port, EPS[:3])
    b.dial_failed("c", EPS[3])
    b.update(port, EPS)
    assert picks(b)[EPS[3]] == 10


def test_eject_after_zero_never_leaves_one_out() -> None:
    b = balancer(settings=DataplaneSettings(eject_after=0))
    b.update(ServicePort(name=NAME, port=80), EPS)
    for _ in range(50):
        b.dial_failed("c", EPS[0])
    assert picks(b)[EPS[0]] == 10
