"""A big balancer's endpoints sent as changes (``ChangeEndpoints``, ``Balancer.change``): the
same choice as the whole set gives, whatever the policies, hints and readiness."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest

from tests.dataplane.test_balancer import FakeClock
from uproxy.dataplane.balancer import _ALL_READY, _FALLBACK, _FOR_NODE, _FOR_ZONE, Balancer
from uproxy.dataplane.messages import (
    CHANGES_FROM,
    ENDPOINTS_PER_PACKET,
    ChangeEndpoints,
    CommitEndpoints,
    SetEndpoints,
    Step,
    endpoint_changes,
    endpoint_steps,
)
from uproxy.dataplane.settings import DataplaneSettings
from uproxy.model import (
    Endpoint,
    IPFamily,
    LbAlgorithm,
    Protocol,
    ServicePort,
    ServicePortName,
    Traffic,
)

NAME = ServicePortName("ns", "big", "p", Protocol.TCP)
NODE = "node-0"
SETTINGS = DataplaneSettings(node_name=NODE, eject_after=1)


def endpoint(rng: random.Random, i: int, *, hints: str) -> Endpoint:
    """``hints``: which kinds of topology hints it carries ("zone", "node", "zone node")."""
    ready = rng.random() < 0.8
    return Endpoint(
        f"10.{i >> 8 & 255}.{i & 255}.1",
        8080,
        node_name=f"node-{rng.randrange(6)}",
        ready=ready,
        serving=ready or rng.random() < 0.5,
        terminating=not ready and rng.random() < 0.7,
        zone_hints=(f"z{rng.randrange(2)}",) if "zone" in hints else (),
        node_hints=(f"node-{rng.randrange(3)}",) if "node" in hints else (),
    )


def mutated(rng: random.Random, eps: list[Endpoint], fresh: int, hints: str) -> list[Endpoint]:
    """A few endpoints go, come, turn (not) ready, move to another node or change hints."""
    out = list(eps)
    for _ in range(rng.randrange(1, 6)):
        roll = rng.random()
        if roll < 0.3 and out:
            out.pop(rng.randrange(len(out)))
        elif roll < 0.55:
            out.append(endpoint(rng, fresh + rng.randrange(1 << 15), hints=hints))
        elif out:
            at = rng.randrange(len(out))
            if roll < 0.65:
                ready = not out[at].ready
                out[at] = dataclasses.replace(out[at], ready=ready, serving=ready)
            elif roll < 0.75 and hints:
                # One endpoint without a hint turns them off for the whole port, until it
                # has one again (or goes).
                bare = next((ep for ep in out if not ep.zone_hints and not ep.node_hints), None)
                if bare is None:
                    out[at] = dataclasses.replace(out[at], zone_hints=(), node_hints=())
                else:
                    out[out.index(bare)] = rehinted(rng, bare, hints)
            elif roll < 0.85 and hints:
                # Hinted elsewhere: the last one hinted for this node (zone) turns them off.
                old = out[at]
                if old.zone_hints or old.node_hints:
                    out[at] = rehinted(rng, old, hints)
            else:
                out[at] = dataclasses.replace(out[at], node_name=f"node-{rng.randrange(6)}")
    unique = {(ep.ip, ep.port): ep for ep in out}  # as the tracker merges them
    return sorted(unique.values())


def rehinted(rng: random.Random, ep: Endpoint, hints: str) -> Endpoint:
    return dataclasses.replace(
        ep,
        zone_hints=(f"z{rng.randrange(2)}",) if "zone" in hints else (),
        node_hints=(f"node-{rng.randrange(3)}",) if "node" in hints else (),
    )


def state(b: Balancer) -> tuple[object, ...]:
    """What a balancer chooses from: each class's endpoints, the local IPs, the failures."""
    cluster, external = b.endpoints(Traffic.CLUSTER), b.endpoints(Traffic.EXTERNAL)
    assert len(set(cluster)) == len(cluster) and len(set(external)) == len(external)
    failing = b._failing or {}
    return (set(cluster), set(external), b.local_ready_ips, set(failing))


def consistent(b: Balancer) -> None:
    """Each pool's order, index and position agree; a round of picks (when nothing else
    steers them) visits each endpoint of the pool once."""
    for traffic, pool in ((Traffic.CLUSTER, b._cluster), (Traffic.EXTERNAL, b._external)):
        order = pool.order
        assert 0 <= pool.position < max(len(order), 1)
        if isinstance(pool.members, dict):
            assert pool.members == {ep: at for at, ep in enumerate(order)}
        else:
            assert set(pool.members) == set(order)
        if order and not b.affinity and b._failing is None:
            got = Counter(b.pick("9.9.9.9", traffic) for _ in range(len(order)))
            assert got == dict.fromkeys(order, 1)
    index = b._index
    if index is not None and index.pools is not None:
        # A pool kept for each choice that has endpoints, exactly those it takes, each one
        # a pool that follows changes.
        every = list(index.by_address.values())
        for choice in range(4):
            taken = {ep for ep in every if _takes(index.node, index.zone, choice, ep)}
            kept = index.pools.get(choice)
            assert (set(kept.order) if kept is not None else set()) == taken, choice
            if kept is not None:
                assert kept.members == {ep: at for at, ep in enumerate(kept.order)}


def _takes(node: str, zone: str | None, choice: int, ep: Endpoint) -> bool:
    """Whether the cluster-wide pool of ``choice`` holds ``ep`` (``model.categorize``'s
    rules, one choice at a time)."""
    if not ep.ready:
        return choice == _FALLBACK and ep.serving and ep.terminating
    if choice == _FOR_NODE:
        return node in ep.node_hints
    if choice == _FOR_ZONE:
        return zone is not None and zone in ep.zone_hints
    return choice == _ALL_READY


@pytest.mark.parametrize("seed", range(32))
def test_changes_applied_in_place_choose_as_the_whole_set_does(seed: int) -> None:
    """Random walks of changes over 80-300 endpoints, with every combination of traffic
    policies and zone, hints on some walks: after each step the balancer fed changes holds
    the same endpoints for each traffic class, local IPs and failures as one fed the whole
    set, and a round of picks visits each of its endpoints once."""
    rng = random.Random(seed)
    hints = ("", "zone", "node", "zone node")[seed % 4]
    port = ServicePort(
        name=NAME,
        port=80,
        internal_policy_local=seed % 3 == 1,
        external_policy_local=seed % 2 == 1,
        affinity_timeout_s=60 if seed % 5 == 0 else None,
    )
    zone = "z0" if seed % 5 else None
    eps = sorted(
        {
            e.address: e for e in (endpoint(rng, i, hints=hints) for i in range(80 + seed * 9))
        }.values()
    )
    whole = Balancer(NAME, settings=SETTINGS, rng=random.Random(1))
    changed = Balancer(NAME, settings=SETTINGS, rng=random.Random(2))
    whole.update(port, eps, zone)
    changed.update(port, eps, zone)
    sent = in_force = 0
    for step in range(60):
        client = f"10.9.9.{step}"
        ep = whole.pick(client, Traffic.CLUSTER)
        if ep is not None and step % 3 == 0:  # a failure to forget when its endpoint goes
            whole.dial_failed(client, ep)
            changed.dial_failed(client, ep)
        changed.pick(client, Traffic.EXTERNAL)  # an affinity entry to drop when it goes
        new = mutated(rng, eps, 1 << 16, hints)
        changes = endpoint_changes(tuple(eps), tuple(new))
        whole.update(port, new, zone)
        if changes is None:
            changed.update(port, new, zone)
        else:
            sent += 1
            changed.change(*changes)
        eps = new
        assert state(changed) == state(whole), step
        ready = {ep for ep in eps if ep.ready}
        in_force += bool(ready) and set(whole.endpoints(Traffic.CLUSTER)) < ready
        consistent(changed)
        everywhere = {ep.address for ep in eps} | {("10.255.0.1", 8080)}
        for traffic in Traffic:
            served = {ep.address for ep in whole.endpoints(traffic)}
            assert {a for a in everywhere if a in changed.addresses(traffic)} == served
        if port.affinity_timeout_s is not None:
            live = set(changed.endpoints(Traffic.CLUSTER)) | set(
                changed.endpoints(Traffic.EXTERNAL)
            )
            assert all(ep in live for ep, _ in (changed._affinity or {}).values())
    assert sent >= 50  # the walks are made of changes, not of whole sets
    if not port.internal_policy_local and ("node" in hints or ("zone" in hints and zone)):
        assert 0 < in_force < 60  # hints turned on and off along the walk


def big(n: int, start: int = 0) -> list[Endpoint]:
    return [
        Endpoint(f"10.1.{i >> 8 & 255}.{i & 255}", 80, node_name=f"n{i}")
        for i in range(start, start + n)
    ]


def test_a_change_is_what_came_changed_and_the_addresses_that_went() -> None:
    old = big(100)
    new = old[1:] + big(2, 500)
    new[5] = dataclasses.replace(new[5], ready=False)
    changes = endpoint_changes(tuple(old), tuple(new))
    assert changes is not None
    added, removed = changes
    assert set(added) == {new[5], *big(2, 500)}
    assert removed == (old[0].address,)
    assert endpoint_changes(tuple(old), tuple(old)) == ((), ())


def test_small_balancers_big_changes_and_doubled_addresses_go_whole() -> None:
    small = big(CHANGES_FROM - 1)
    assert endpoint_changes(tuple(small), tuple(small[1:])) is None
    many = big(400)
    assert endpoint_changes(tuple(many), tuple(many[:300])) is not None  # a quarter
    assert endpoint_changes(tuple(many), tuple(many[:299])) is None
    assert endpoint_changes(tuple(many), tuple(many[:300] + big(1, 900))) is None
    assert endpoint_changes(tuple(many), tuple(many[100:] + big(100, 900))) is None
    doubled = [*many[:399], dataclasses.replace(many[0], node_name="elsewhere")]
    assert endpoint_changes(tuple(many), tuple(doubled)) is None
    # An address twice in the new set: one that stays (the same object, or an equal copy),
    # or a new one.
    assert endpoint_changes(tuple(many), (*many, many[7])) is None
    assert endpoint_changes(tuple(many), (*many, dataclasses.replace(many[7]))) is None
    fresh = big(1, 900)[0]
    assert endpoint_changes(tuple(many), (*many, fresh, fresh)) is None
    # Equal copies are no change, the same objects or not.
    assert endpoint_changes(tuple(many), tuple(dataclasses.replace(e) for e in many)) == ((), ())
    huge = big(8000)
    assert endpoint_changes(tuple(huge), tuple(huge[:-ENDPOINTS_PER_PACKET])) is not None
    assert endpoint_changes(tuple(huge), tuple(huge[: -ENDPOINTS_PER_PACKET - 1])) is None


def test_a_change_keeps_the_round_robin_order_of_the_endpoints_that_stay() -> None:
    """Connections keep going round the pool: the endpoints that stayed keep their order
    (one that came takes a random place, the one it displaced goes to the end), and a
    position past the end after a removal starts the round again."""
    b = Balancer(NAME, settings=SETTINGS, rng=random.Random(3))
    port = ServicePort(name=NAME, port=80)
    eps = big(200)
    b.update(port, eps)
    before = list(b.endpoints(Traffic.CLUSTER))
    b.change(big(1, 900), (eps[7].address,))
    after = list(b.endpoints(Traffic.CLUSTER))
    assert set(after) == (set(eps) - {eps[7]}) | set(big(1, 900))
    # Two of those that stayed changed places at most: the last one took the removed one's
    # place, and the one the new endpoint displaced went to the end.
    moved = [ep for at, ep in enumerate(before) if ep != eps[7] and after[at] != ep]
    assert len(moved) <= 2 and after[-1] in before
    for _ in range(len(after) - 1):
        b.pick("c", Traffic.CLUSTER)
    last = b.endpoints(Traffic.CLUSTER)[-1]
    b.change((), (last.address,))  # the position was on the last one, which went
    assert b.pick("c", Traffic.CLUSTER) == b.endpoints(Traffic.CLUSTER)[0]


def test_a_change_that_takes_the_last_ready_endpoint_falls_back_to_the_terminating() -> None:
    b = Balancer(NAME, settings=SETTINGS, rng=random.Random(4))
    port = ServicePort(name=NAME, port=80)
    draining = [
        dataclasses.replace(ep, ready=False, serving=True, terminating=True) for ep in big(100)
    ]
    ready = big(1, 900)[0]
    b.update(port, [*draining, ready])
    assert b.endpoints(Traffic.CLUSTER) == [ready] or b.endpoints(Traffic.CLUSTER) == (ready,)
    b.change((), (ready.address,))
    assert set(b.endpoints(Traffic.CLUSTER)) == set(draining)
    b.change((ready,), ())
    assert list(b.endpoints(Traffic.CLUSTER)) == [ready]


def test_a_change_updates_the_local_endpoints_and_the_local_policy() -> None:
    """kube-proxy's health check counts this node's ready endpoints: a change of them (or
    of an endpoint moving here) shows at once; a Local pool holds only those."""
    b = Balancer(NAME, settings=SETTINGS, rng=random.Random(5))
    port = ServicePort(name=NAME, port=80, internal_policy_local=True)
    eps = big(100)
    b.update(port, eps)
    assert b.local_ready_ips == frozenset() and not b.endpoints(Traffic.CLUSTER)
    here = dataclasses.replace(eps[3], node_name=NODE)
    b.change((here,), ())
    assert b.local_ready_ips == {here.ip}
    assert list(b.endpoints(Traffic.CLUSTER)) == [here]
    b.change((dataclasses.replace(here, ready=False, serving=False),), ())
    assert b.local_ready_ips == frozenset() and not b.endpoints(Traffic.CLUSTER)


def test_a_change_calls_the_watchers_only_when_something_changed() -> None:
    b = Balancer(NAME, settings=SETTINGS, rng=random.Random(6))
    calls: list[int] = []
    b.watch(lambda: calls.append(1))
    eps = big(100)
    b.update(ServicePort(name=NAME, port=80), eps)
    assert calls == [1]
    b.change((eps[0],), ("10.99.99.99", 80))  # type: ignore[arg-type]
    b.change((eps[0],), (("10.99.99.99", 80),))  # nothing new, nothing there to remove
    assert calls == [1]
    b.change((), (eps[0].address,))
    assert calls == [1, 1]
    # Endpoints that only come take none out of a pool: nothing to check...
    b.change(tuple(big(3, 500)), ())
    assert calls == [1, 1]
    # ... unless they are this node's (a Local pool computed again) or turn the choice.
    b.change((dataclasses.replace(big(1, 700)[0], node_name=NODE),), ())
    assert calls == [1, 1, 1]
    hinted = Balancer(NAME, settings=SETTINGS, rng=random.Random(6))
    hinted.update(ServicePort(name=NAME, port=80), [*big(99), *big(1, 200)])
    hinted.watch(lambda: calls.append(2))
    elsewhere = [dataclasses.replace(ep, node_hints=("node-9",)) for ep in big(99)]
    hinted.change(tuple(elsewhere), (big(1, 200)[0].address,))  # every one hinted elsewhere
    assert calls[3:] == [2]
    mine = dataclasses.replace(big(1, 900)[0], node_hints=(NODE,))
    hinted.change((mine,), ())  # hints on: the pool is this one alone, the others leave it
    assert calls[3:] == [2, 2] and list(hinted.endpoints(Traffic.CLUSTER)) == [mine]


def test_a_change_forgets_the_affinity_and_the_failures_of_the_endpoints_gone() -> None:
    clock = FakeClock()
    settings = dataclasses.replace(SETTINGS, default_algorithm=LbAlgorithm.ROUND_ROBIN)
    b = Balancer(NAME, settings=settings, clock=clock, rng=random.Random(7))
    b.update(ServicePort(name=NAME, port=80, affinity_timeout_s=60), big(100))
    pinned = b.pick("1.1.1.1", Traffic.CLUSTER)
    other = b.pick("2.2.2.2", Traffic.CLUSTER)
    assert pinned is not None and other is not None and pinned != other
    b.dial_failed("3.3.3.3", other)  # out for a second
    assert b._failing is not None and other in b._failing
    b.change((), (pinned.address, other.address))
    assert b.affinity_entries == 0
    assert not b._failing
    assert b.pick("1.1.1.1", Traffic.CLUSTER) not in (pinned, other, None)


def test_a_change_that_turns_hints_on_forgets_the_affinity_to_endpoints_left_out() -> None:
    """Every ready endpoint hinted for other nodes; one that comes hinted for this node turns
    the hints on, and the pool is that one alone: a client pinned elsewhere moves."""
    b = Balancer(NAME, settings=SETTINGS, rng=random.Random(8))
    elsewhere = [dataclasses.replace(ep, node_hints=("node-9",)) for ep in big(100)]
    b.update(ServicePort(name=NAME, port=80, affinity_timeout_s=60), elsewhere)
    pinned = b.pick("1.1.1.1", Traffic.CLUSTER)
    assert pinned in elsewhere and b.affinity_entries == 1
    mine = dataclasses.replace(big(1, 900)[0], node_hints=(NODE,))
    b.change((mine,), ())
    assert list(b.endpoints(Traffic.CLUSTER)) == [mine]
    assert b.affinity_entries == 0
    assert b.pick("1.1.1.1", Traffic.CLUSTER) == mine


@pytest.mark.parametrize("how", ["change", "update"])
def test_clients_stay_with_an_endpoint_whose_hints_or_conditions_changed(how: str) -> None:
    """The EndpointSlice controller hints every endpoint for the zone (no endpoint moved, the
    pool the same addresses), then a rollout marks them all terminating (still the pool: no
    ready one is left). Affinity and a failing endpoint's ejection are the address's: they
    were dropped with the old ``Endpoint`` objects, and four clients in six moved pods."""
    clock = FakeClock()
    b = Balancer(NAME, settings=SETTINGS, clock=clock, rng=random.Random(10))
    port = ServicePort(name=NAME, port=80, affinity_timeout_s=600)
    eps = big(6)
    b.update(port, eps)
    failing = eps[0]
    b.dial_failed("10.9.1.1", failing)  # left out for a while: nobody is pinned to it
    assert b._failing is not None and failing in b._failing
    clients = [f"10.9.0.{i}" for i in range(12)]
    pinned = {c: b.pick(c, Traffic.CLUSTER) for c in clients}
    assert failing not in pinned.values() and len(set(pinned.values())) == 5
    for edit in (
        {"zone": "z0", "zone_hints": ("z0",)},
        {"ready": False, "serving": True, "terminating": True},
    ):
        now = [dataclasses.replace(ep, **edit) for ep in eps]
        if how == "change":
            b.change(tuple(now), ())
        else:
            b.update(port, now, "z0")
        assert set(b.endpoints(Traffic.CLUSTER)) == set(now)
        got = {c: b.pick(c, Traffic.CLUSTER) for c in clients}
        assert {c: ep.address for c, ep in got.items() if ep} == {
            c: ep.address for c, ep in pinned.items() if ep
        }
        assert b._failing is not None
        assert [ep.address for ep in b._failing] == [failing.address]
        eps = now


def test_a_change_that_turns_the_choice_takes_the_pool_kept_for_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Zone hints on 3,000 endpoints: one endpoint that comes without hints turns them off
    for the port, and it going turns them back on; the last ready one going leaves the
    terminating ones. Each time the new pool is one kept and followed all along, nothing
    is computed over the endpoints (the whole-set path, ``categorize``, would fail here)."""
    b = Balancer(NAME, settings=SETTINGS, rng=random.Random(9))
    zones = ("z0", "z1", "z2")
    hinted = [dataclasses.replace(ep, zone_hints=(zones[i % 3],)) for i, ep in enumerate(big(3000))]
    port = ServicePort(name=NAME, port=80)
    b.update(port, hinted[:250], "z0")
    for at in range(250, 3000, 250):
        b.change(hinted[at : at + 250], ())
    mine = {ep for ep in hinted if "z0" in ep.zone_hints}
    assert set(b.endpoints(Traffic.CLUSTER)) == mine
    zone_pool = b._cluster

    def no_whole_set(*args: object, **kwargs: object) -> tuple[Endpoint, ...]:
        raise AssertionError("a pool computed over every endpoint")

    monkeypatch.setattr("uproxy.dataplane.balancer.categorize", no_whole_set)
    bare = big(1, 5000)[0]
    b.change((bare,), ())
    assert set(b.endpoints(Traffic.CLUSTER)) == {*hinted, bare}
    all_ready = b._cluster
    b.change((), (bare.address,))
    assert b._cluster is zone_pool and set(b.endpoints(Traffic.CLUSTER)) == mine
    assert b._index is not None and b._index.pools is not None
    assert b._index.pools[_FOR_ZONE] is zone_pool and b._index.pools[_ALL_READY] is all_ready
    consistent(b)
    # Every ready endpoint going in steps, a draining copy of each coming: the last step
    # leaves the terminating ones, followed since the first came.
    draining = [dataclasses.replace(ep, ready=False, terminating=True) for ep in hinted]
    for at in range(0, 3000, 250):
        b.change(draining[at : at + 250], ())
        consistent(b)
    assert set(b.endpoints(Traffic.CLUSTER)) == set(draining)
    assert set(b._index.pools) == {_FALLBACK}  # only the fallback has endpoints
    # Let go of (a forgotten port), it hands over the pools kept for other choices too.
    b.change(hinted[:250], ())
    kept = [b._index.pools[c] for c in (_FOR_ZONE, _ALL_READY, _FALLBACK)]
    held = {id(c) for c in b.let_go()}
    assert all(id(pool.order) in held and id(pool.members) in held for pool in kept)


def apply(b: Balancer, message: Step) -> None:
    """As a worker applies what it is sent (to a balancer serving: nothing staged)."""
    assert not isinstance(message, CommitEndpoints) and not message.staged
    if isinstance(message, SetEndpoints):
        b.update(message.port, message.endpoints, message.zone)
    else:
        b.change(message.added, message.removed)


@pytest.mark.parametrize("seed", range(6))
def test_a_big_balancers_set_goes_in_steps_that_end_where_the_whole_set_does(seed: int) -> None:
    """A balancer of more than ENDPOINTS_PER_PACKET endpoints, new or changed by more than a
    change carries: steps of at most that many endpoints, after which it chooses as one fed
    the whole set; meanwhile it picks only endpoints of the old or the new set, and no step
    takes its size a step's worth past theirs."""
    rng = random.Random(seed)
    hints = ("", "zone", "node")[seed % 3]
    port = ServicePort(name=NAME, port=80, external_policy_local=seed % 2 == 1)
    zone = "z0"
    old = [endpoint(rng, i, hints=hints) for i in range(3 * ENDPOINTS_PER_PACKET + seed * 37)]
    new = [
        endpoint(rng, i + (1 << 15) * (i % 3 == seed % 3), hints=hints) for i in range(len(old))
    ][: len(old) - seed * 50]
    whole = Balancer(NAME, settings=SETTINGS, rng=random.Random(1))
    stepped = Balancer(NAME, settings=SETTINGS, rng=random.Random(2))
    first = SetEndpoints(NAME, IPFamily.V4, port, tuple(old), zone)
    steps = endpoint_steps(first, None)
    assert steps is not None and type(steps[0]) is SetEndpoints
    assert len(steps) == -(-len(old) // ENDPOINTS_PER_PACKET)
    for message in steps:
        assert _step_size(message) <= ENDPOINTS_PER_PACKET
        apply(stepped, message)
        consistent(stepped)
    whole.update(port, old, zone)
    assert state(stepped) == state(whole)
    second = SetEndpoints(NAME, IPFamily.V4, port, tuple(new), zone)
    steps = endpoint_steps(second, first)
    assert steps is not None and all(type(m) is ChangeEndpoints for m in steps)
    assert len(steps) > 1  # more than a step, and more than a change carries
    assert endpoint_changes(tuple(old), tuple(new)) is None
    either = set(old) | set(new)
    for message in steps:
        assert _step_size(message) <= ENDPOINTS_PER_PACKET
        apply(stepped, message)
        consistent(stepped)
        assert set(stepped.endpoints(Traffic.CLUSTER)) <= either
        low, high = sorted((len(old), len(new)))
        assert low - ENDPOINTS_PER_PACKET < len(stepped._every()) < high + ENDPOINTS_PER_PACKET
    whole.update(port, new, zone)
    assert state(stepped) == state(whole)
    assert endpoint_steps(second, second) == []  # nothing changed


def _step_size(message: Step) -> int:
    if isinstance(message, SetEndpoints):
        return len(message.endpoints)
    if isinstance(message, ChangeEndpoints):
        return len(message.added) + len(message.removed)
    return 0


def test_small_sets_a_changed_port_and_doubled_addresses_go_in_one_message() -> None:
    port = ServicePort(name=NAME, port=80)
    many = tuple(big(ENDPOINTS_PER_PACKET + 1))
    small = SetEndpoints(NAME, IPFamily.V4, port, many[:ENDPOINTS_PER_PACKET])
    assert endpoint_steps(small, None) is None
    assert endpoint_steps(SetEndpoints(NAME, IPFamily.V4, port, ()), small) is None
    bigger = SetEndpoints(NAME, IPFamily.V4, port, many)
    assert endpoint_steps(bigger, None) is not None
    assert endpoint_steps(bigger, small) is not None
    # The port or the zone changed: a small set goes whole, a big one in steps built aside.
    other_port = dataclasses.replace(small, port=ServicePort(name=NAME, port=81))
    assert endpoint_steps(small, other_port) is None
    for previous in (other_port, dataclasses.replace(small, zone="z1")):
        steps = endpoint_steps(bigger, previous)
        assert steps is not None and len(steps) == 3
        assert steps[0] == dataclasses.replace(
            bigger, endpoints=many[:ENDPOINTS_PER_PACKET], staged=True
        )
        assert steps[1:] == [
            ChangeEndpoints(NAME, IPFamily.V4, many[ENDPOINTS_PER_PACKET:], (), staged=True),
            CommitEndpoints(NAME, IPFamily.V4),
        ]
    # An address twice: a balancer fed the whole set keeps both, a change could not.
    doubled = SetEndpoints(NAME, IPFamily.V4, port, (*many, dataclasses.replace(many[3])))
    assert endpoint_steps(doubled, None) is None
    assert endpoint_steps(doubled, bigger) is None
    # One endpoint replaced: one step.
    replaced = SetEndpoints(NAME, IPFamily.V4, port, (*many[1:], big(1, 9000)[0]))
    steps = endpoint_steps(replaced, bigger)
    assert steps == [ChangeEndpoints(NAME, IPFamily.V4, (big(1, 9000)[0],), (many[0].address,))]


@pytest.mark.parametrize("seed", range(6))
def test_a_big_balancers_new_spec_is_built_aside_and_taken_as_the_whole_set_would_be(
    seed: int,
) -> None:
    """A big balancer whose port spec or zone changed: the steps build a balancer aside
    while the serving one picks as before, and the commit makes it choose as one fed the
    whole new set with the new spec; it keeps its watchers, forgets the failures and the
    affinity of endpoints gone, and keeps counting the connections still open."""
    rng = random.Random(seed)
    hints = ("", "zone", "node")[seed % 3]
    algorithm = (LbAlgorithm.ROUND_ROBIN, LbAlgorithm.LEAST_CONNECTIONS)[seed % 2]
    settings = dataclasses.replace(SETTINGS, default_algorithm=algorithm)
    # Affinity on, then off (seeds 0-1); on and on (2-3); off, then on (4-5).
    old_port = ServicePort(name=NAME, port=80, affinity_timeout_s=60 if seed < 4 else None)
    new_port = ServicePort(
        name=NAME,
        port=80,
        affinity_timeout_s=None if seed < 2 else 60,
        external_policy_local=seed % 2 == 0,
    )
    old = [endpoint(rng, i, hints=hints) for i in range(3 * ENDPOINTS_PER_PACKET + seed * 37)]
    serving = Balancer(NAME, settings=settings, rng=random.Random(3))
    serving.update(old_port, old, "z0")
    calls: list[int] = []
    serving.watch(lambda: calls.append(1))
    held = serving.pick("1.1.1.1", Traffic.CLUSTER)  # an open connection (least-connections)
    assert held is not None
    failed = serving.pick("2.2.2.2", Traffic.CLUSTER)
    assert failed is not None
    serving.dial_failed("2.2.2.2", failed)
    new = mutated(rng, old, fresh=1 << 16, hints=hints)
    if seed % 2 == 0:  # both endpoints go
        new = [ep for ep in new if ep.address not in (held.address, failed.address)]
    before = state(serving)
    load = dict(serving._load) if serving._load is not None else None
    previous = SetEndpoints(NAME, IPFamily.V4, old_port, tuple(old), "z0")
    message = SetEndpoints(NAME, IPFamily.V4, new_port, tuple(new), "z1")
    steps = endpoint_steps(message, previous)
    assert steps is not None and isinstance(steps[-1], CommitEndpoints)
    aside = Balancer(NAME, settings=settings, rng=random.Random(4))
    for step in steps[:-1]:
        assert not isinstance(step, CommitEndpoints) and step.staged
        assert _step_size(step) <= ENDPOINTS_PER_PACKET
        if isinstance(step, SetEndpoints):
            aside.update(step.port, step.endpoints, step.zone)
        else:
            aside.change(step.added, step.removed)
        assert state(serving) == before and not calls  # it serves as it was meanwhile
    serving.adopt(aside)
    assert calls == [1]
    whole = Balancer(NAME, settings=settings, rng=random.Random(5))
    whole.update(new_port, new, "z1")
    failing = {failed} & set(new)  # a failure of an endpoint gone is forgotten
    assert state(serving)[:3] == state(whole)[:3] and state(serving)[3] == failing
    assert serving.affinity == (new_port.affinity_timeout_s is not None)
    assert all(ep in set(new) for ep, _ in (serving._affinity or {}).values())
    if serving.affinity and old_port.affinity_timeout_s is not None:  # on, and still on
        assert ("1.1.1.1" in serving._affinity) == (held in new)  # type: ignore[operator]
    assert serving._load == load  # the connections still open, released when they end
    if load is not None:
        assert load.get(held.address) == 1
        serving.release(held)
        assert held.address not in (serving._load or {})
    consistent(whole)
    change = endpoint_changes(tuple(new), tuple(new[1:]))  # and it follows changes in place
    assert change is not None
    serving.change(*change)
    whole.update(new_port, new[1:], "z1")
    assert state(serving)[:3] == state(whole)[:3]
