"""The tracker: merging slices, diffing listings, filtering, and reporting bad objects."""

from __future__ import annotations

import asyncio
import copy
import logging
import random
from typing import Any

import pytest

from tests.factories import endpoint, endpoint_slice, service
from uproxy.model import Endpoint, Protocol, ServicePortName, categorize
from uproxy.tracker import Kind, Tracker, _merge

WEB = ServicePortName("default", "web", "http", Protocol.TCP)


def ips(t: Tracker, spn: ServicePortName = WEB) -> list[str]:
    return [e.ip for e in t.snapshot()[spn].endpoints]


def test_not_synced_until_both_kinds_listed() -> None:
    t = Tracker()
    t.replace(Kind.SERVICE, [service()])
    assert not t.synced
    t.replace(Kind.ENDPOINT_SLICE, [])
    assert t.synced


def test_union_of_three_slices_and_delete_one() -> None:
    calls: list[str] = []
    t = Tracker(on_change=lambda: calls.append("sync"), on_endpoints=lambda: calls.append("eps"))
    t.replace(Kind.SERVICE, [service()])
    slices = [endpoint_slice(f"web-{i}", endpoints=[endpoint(f"10.0.0.{i}")]) for i in (1, 2, 3)]
    t.replace(Kind.ENDPOINT_SLICE, slices)
    assert ips(t) == ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    t.delete(Kind.ENDPOINT_SLICE, slices[1])
    assert ips(t) == ["10.0.0.1", "10.0.0.3"]
    # Each first listing asks for a sync; a slice change afterwards takes the fast road.
    assert calls == ["sync", "sync", "eps"]


def test_dual_stack_slices_keep_both_families_once_per_address() -> None:
    t = Tracker()
    t.replace(Kind.SERVICE, [service(), service("v6only", cluster_ip="fd00::20")])
    pods = [("10.0.0.1", "fd00:1::1"), ("10.0.0.2", "fd00:1::2")]
    t.replace(
        Kind.ENDPOINT_SLICE,
        [
            endpoint_slice("web-v4", endpoints=[endpoint(v4) for v4, _ in pods]),
            endpoint_slice(
                "web-v6", endpoints=[endpoint(v6) for _, v6 in pods], address_type="IPv6"
            ),
            # The same IPv6 address again in another slice (mid-migration): listed once.
            endpoint_slice("web-v6b", endpoints=[endpoint("fd00:1::2")], address_type="IPv6"),
            endpoint_slice(
                "v6only-1", "v6only", endpoints=[endpoint("fd00:1::3")], address_type="IPv6"
            ),
        ],
    )
    # Each family's addresses once: the syncer gives each family's service addresses its own.
    assert ips(t) == ["10.0.0.1", "10.0.0.2", "fd00:1::1", "fd00:1::2"]
    assert ips(t, ServicePortName("default", "v6only", "http", Protocol.TCP)) == ["fd00:1::3"]
    # The IPv4 slice goes (the family is being removed): the IPv6 endpoints stay.
    t.delete(Kind.ENDPOINT_SLICE, endpoint_slice("web-v4", endpoints=[]))
    assert ips(t) == ["fd00:1::1", "fd00:1::2"]


def test_noop_updates_do_not_notify() -> None:
    calls: list[int] = []
    t = Tracker(on_change=lambda: calls.append(1), on_endpoints=lambda: calls.append(2))
    t.replace(Kind.SERVICE, [service()])
    t.replace(Kind.ENDPOINT_SLICE, [endpoint_slice("a", endpoints=[endpoint("10.0.0.1")])])
    before = len(calls)
    t.upsert(Kind.SERVICE, service())
    t.replace(Kind.ENDPOINT_SLICE, [endpoint_slice("a", endpoints=[endpoint("10.0.0.1")])])
    assert len(calls) == before
    changes = t.take_changes()
    assert (changes.services, changes.endpoints) == (1, 1)
    assert t.take_changes().services == 0


def test_resync_announces_every_service_port_once_listed() -> None:
    calls: list[int] = []
    t = Tracker(on_change=lambda: calls.append(1), on_endpoints=lambda: calls.append(2))
    t.resync()  # before the first listings: nothing to announce, nobody told
    assert calls == []
    db = service(
        "db", ports=[{"name": "pg", "port": 5432, "protocol": "TCP"}], cluster_ip="10.96.0.11"
    )
    t.replace(Kind.SERVICE, [service(), db])
    t.replace(Kind.ENDPOINT_SLICE, [endpoint_slice("a", endpoints=[endpoint("10.0.0.1")])])
    t.take_changes()
    calls.clear()
    t.upsert(Kind.ENDPOINT_SLICE, endpoint_slice("a", endpoints=[endpoint("10.0.0.2")]))
    t.resync()
    assert calls == [2, 1]
    # The endpoint change now rides with the service: the syncer's pass takes it.
    assert t.take_endpoint_changes().ports == frozenset()
    ports = t.take_changes().ports
    assert {str(p) for p in ports} == {"default/web:http", "default/db:pg"}
    assert ips(t) == ["10.0.0.2"]
    assert t.take_changes().ports == frozenset()


def test_replace_applies_the_difference() -> None:
    t = Tracker()
    t.replace(Kind.SERVICE, [service("a"), service("b")])
    t.replace(Kind.ENDPOINT_SLICE, [])
    assert {s.name for s in t.snapshot()} == {"a", "b"}
    t.replace(Kind.SERVICE, [service("b"), service("c")])
    assert {s.name for s in t.snapshot()} == {"b", "c"}


def test_same_address_in_two_slices_counts_once_and_ready_wins() -> None:
    t = Tracker()
    t.replace(Kind.SERVICE, [service()])
    t.replace(
        Kind.ENDPOINT_SLICE,
        [
            endpoint_slice("a", endpoints=[endpoint("10.0.0.1", ready=False)]),
            endpoint_slice("b", endpoints=[endpoint("10.0.0.1", ready=True)]),
        ],
    )
    (ep,) = t.snapshot()[WEB].endpoints
    assert ep.ready


def test_merged_endpoints_come_in_address_order_whatever_the_slices_order() -> None:
    """One order for one set of endpoints, however the slices split and list them: a slice
    that changes only by moving endpoints to another slice changes nothing."""
    t = Tracker()
    t.replace(Kind.SERVICE, [service()])
    addresses = [f"10.0.{i % 3}.{i}" for i in range(30)]
    backwards = [endpoint(a) for a in reversed(addresses)]
    t.replace(
        Kind.ENDPOINT_SLICE,
        [
            endpoint_slice("a", endpoints=backwards[::2]),
            endpoint_slice("b", endpoints=backwards[1::2]),
        ],
    )
    first = t.snapshot()[WEB].endpoints
    assert [ep.address for ep in first] == sorted((a, 8080) for a in addresses)
    t.replace(
        Kind.ENDPOINT_SLICE,
        [
            endpoint_slice("a", endpoints=backwards[:20]),
            endpoint_slice("b", endpoints=backwards[20:]),
        ],
    )
    assert t.snapshot()[WEB].endpoints == first


def test_ports_match_by_name_and_protocol() -> None:
    t = Tracker()
    t.replace(
        Kind.SERVICE,
        [
            service(
                ports=[
                    {"name": "dns", "port": 53, "protocol": "UDP"},
                    {"name": "dns-tcp", "port": 53},
                ]
            )
        ],
    )
    t.replace(
        Kind.ENDPOINT_SLICE,
        [
            endpoint_slice(
                "a",
                endpoints=[endpoint("10.0.0.1")],
                ports=[
                    {"name": "dns", "port": 5353, "protocol": "UDP"},
                    {"name": "dns-tcp", "port": 5354, "protocol": "TCP"},
                ],
            )
        ],
    )
    snap = t.snapshot()
    udp = snap[ServicePortName("default", "web", "dns", Protocol.UDP)]
    tcp = snap[ServicePortName("default", "web", "dns-tcp", Protocol.TCP)]
    assert [e.port for e in udp.endpoints] == [5353]
    assert [e.port for e in tcp.endpoints] == [5354]


@pytest.mark.parametrize(
    ("proxy_name", "labels", "wanted"),
    [
        (None, None, True),
        (None, {"service.kubernetes.io/service-proxy-name": "other"}, False),
        ("uproxy", {"service.kubernetes.io/service-proxy-name": "uproxy"}, True),
        ("uproxy", {"service.kubernetes.io/service-proxy-name": "other"}, False),
        ("uproxy", None, False),
    ],
)
def test_service_proxy_name_filter(
    proxy_name: str | None, labels: dict[str, str] | None, wanted: bool
) -> None:
    t = Tracker(service_proxy_name=proxy_name)
    t.replace(Kind.SERVICE, [service(labels=labels)])
    t.replace(Kind.ENDPOINT_SLICE, [])
    assert (WEB in t.snapshot()) is wanted


def test_invalid_update_keeps_the_last_good_state_and_logs_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An update uproxy cannot read used to remove the service: one bad edit (or a field an
    older API server let through) took it down on every node, though the log said "Skipping"."""
    t = Tracker()
    t.replace(Kind.SERVICE, [service(), service("good")])
    t.replace(Kind.ENDPOINT_SLICE, [endpoint_slice("web-1", endpoints=[endpoint("10.0.0.1")])])
    before = t.snapshot()[WEB]
    bad = service(ports=[{"name": "http", "port": 0}])
    caplog.set_level(logging.WARNING, logger="uproxy")
    caplog.clear()
    t.upsert(Kind.SERVICE, bad)
    t.upsert(Kind.SERVICE, bad)
    unlabelled = endpoint_slice("web-1", endpoints=[endpoint("10.0.0.2")])
    del unlabelled["metadata"]["labels"]
    t.upsert(Kind.ENDPOINT_SLICE, unlabelled)  # kube-proxy ignores such a slice update too
    assert t.snapshot()[WEB] == before
    assert ServicePortName("default", "good", "http", Protocol.TCP) in t.snapshot()
    said = "Skipping invalid object; keeping its last good state"
    lines = [r for r in caplog.records if r.getMessage() == said]
    assert [r.kv["field"] for r in lines] == [  # type: ignore[attr-defined]
        "spec.ports[0].port",
        "metadata.labels[kubernetes.io/service-name]",
    ]
    t.delete(Kind.SERVICE, bad)  # a deletion still removes it
    assert WEB not in t.snapshot()


def test_an_invalid_new_object_is_skipped(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="uproxy")
    caplog.clear()
    t = Tracker()
    t.replace(Kind.SERVICE, [service(ports=[{"name": "http", "port": 0}])])
    t.replace(Kind.ENDPOINT_SLICE, [])
    assert WEB not in t.snapshot()
    assert [r.getMessage() for r in caplog.records] == ["Skipping invalid object"]


def test_categorize_follows_kube_proxy() -> None:
    ready_local = Endpoint("10.0.0.1", 80, "me")
    ready_remote = Endpoint("10.0.0.2", 80, "other")
    term_local = Endpoint("10.0.0.3", 80, "me", ready=False, serving=True, terminating=True)
    not_serving = Endpoint("10.0.0.4", 80, "me", ready=False, serving=False, terminating=True)
    eps = (ready_local, ready_remote, term_local, not_serving)
    assert categorize(eps, local_only=False, node_name="me") == (ready_local, ready_remote)
    assert categorize(eps, local_only=True, node_name="me") == (ready_local,)
    assert categorize((ready_remote, term_local), local_only=True, node_name="me") == (term_local,)
    assert categorize((ready_remote,), local_only=True, node_name="me") == ()
    assert categorize((term_local, not_serving), local_only=False, node_name="x") == (term_local,)


def _listed(t: Tracker, services: list[str]) -> None:
    t.replace(Kind.SERVICE, [service(n) for n in services])
    t.replace(
        Kind.ENDPOINT_SLICE,
        [endpoint_slice(f"{n}-1", n, endpoints=[endpoint("10.0.0.1")]) for n in services],
    )


def _spn(name: str) -> ServicePortName:
    return ServicePortName("default", name, "http", Protocol.TCP)


def test_take_changes_names_only_the_ports_that_changed() -> None:
    t = Tracker()
    _listed(t, [f"s{i}" for i in range(100)])
    assert len(t.take_changes().ports) == 100  # the first take: everything
    assert t.take_changes().ports == frozenset()
    t.upsert(Kind.ENDPOINT_SLICE, endpoint_slice("s7-1", "s7", endpoints=[endpoint("10.0.0.2")]))
    t.delete(Kind.SERVICE, service("s9"))
    changes = t.take_changes()
    assert changes.ports == {_spn("s7"), _spn("s9")}
    assert t.state(_spn("s9")) is None  # gone: the consumer closes it
    state = t.state(_spn("s7"))
    assert state is not None and [e.ip for e in state.endpoints] == ["10.0.0.2"]


def test_endpoint_changes_go_alone_unless_the_service_also_changed() -> None:
    t = Tracker()
    _listed(t, ["a", "b"])
    t.take_changes()
    t.upsert(Kind.ENDPOINT_SLICE, endpoint_slice("a-1", "a", endpoints=[endpoint("10.0.0.2")]))
    t.upsert(Kind.ENDPOINT_SLICE, endpoint_slice("b-1", "b", endpoints=[endpoint("10.0.0.3")]))
    t.upsert(Kind.SERVICE, service("b", sessionAffinity="ClientIP"))
    fast = t.take_endpoint_changes()
    assert fast.ports == {_spn("a")}  # b waits: its Service changed too, the syncer takes both
    assert t.take_endpoint_changes().ports == frozenset()
    assert t.take_changes().ports == {_spn("b")}


def test_endpoint_only_changes_in_any_order_follow_both_takers() -> None:
    """Whatever the order of Service changes, slice changes and the two takes, the fast road
    hands over exactly the services whose slices changed and whose Service did not since the
    syncer last took, and the syncer gets the rest (the set is kept as changes come)."""
    import random

    rng = random.Random(7)
    names = [f"s{i}" for i in range(8)]
    t = Tracker()
    _listed(t, names)
    t.take_changes()
    services_changed: set[str] = set()
    slices_changed: set[str] = set()
    affinity = dict.fromkeys(names, "None")
    for step in range(2_000):
        name = rng.choice(names)
        action = rng.random()
        if action < 0.35:
            ip = f"10.0.{step // 250}.{step % 250 + 1}"
            t.upsert(
                Kind.ENDPOINT_SLICE, endpoint_slice(f"{name}-1", name, endpoints=[endpoint(ip)])
            )
            slices_changed.add(name)
        elif action < 0.55:
            new = rng.choice(["ClientIP", "None"])
            t.upsert(Kind.SERVICE, service(name, sessionAffinity=new))
            if new != affinity[name]:  # the same spec again is no change
                services_changed.add(name)
                affinity[name] = new
        elif action < 0.85:
            fast = {spn.name for spn in t.take_endpoint_changes().ports}
            want = slices_changed - services_changed
            assert fast == want, step
            slices_changed -= want
        else:
            taken = {spn.name for spn in t.take_changes().ports}
            assert (
                (slices_changed - services_changed) <= taken <= (slices_changed | services_changed)
            )
            services_changed.clear()
            slices_changed.clear()


def test_trigger_times_from_before_start_are_not_reported() -> None:
    t = Tracker(clock=lambda: 1_000_000_000.0)  # started at 2001-09-09T01:46:40Z
    _listed(t, ["a"])
    t.take_changes()
    old = endpoint_slice("a-1", "a", endpoints=[endpoint("10.0.0.2")])
    old["metadata"]["annotations"] = {
        "endpoints.kubernetes.io/last-change-trigger-time": "2001-09-09T01:00:00Z"
    }
    t.upsert(Kind.ENDPOINT_SLICE, old)
    assert t.take_endpoint_changes().trigger_times == ()
    new = endpoint_slice("a-1", "a", endpoints=[endpoint("10.0.0.3")])
    new["metadata"]["annotations"] = {
        "endpoints.kubernetes.io/last-change-trigger-time": "2001-09-09T02:00:00Z"
    }
    t.upsert(Kind.ENDPOINT_SLICE, new)
    assert t.take_endpoint_changes().trigger_times == (1_000_000_800.0,)


async def test_replace_async_gives_the_loop_turns_and_marks_listed_at_the_end() -> None:
    t = Tracker()
    seen: list[bool] = []

    def probe() -> None:
        seen.append(t.synced)
        if len(seen) < 1000:
            asyncio.get_running_loop().call_soon(probe)

    t.replace(Kind.ENDPOINT_SLICE, [])
    asyncio.get_running_loop().call_soon(probe)
    await t.replace_async(Kind.SERVICE, [service(f"s{i}") for i in range(20_000)])
    assert t.synced and len(t.snapshot()) == 20_000
    assert seen and not seen[0]  # the loop ran while the listing was applied, unsynced


def synced(t: Tracker) -> bool:
    return t.synced  # a call: mypy would keep an earlier assert's narrowing of the property


async def test_a_listing_applies_pages_and_deletes_only_when_complete() -> None:
    t = Tracker()
    t.replace(Kind.ENDPOINT_SLICE, [])
    first = t.listing(Kind.SERVICE)
    await first.add([service("a"), service("b")])
    assert not synced(t)  # half a first listing programs nothing
    await first.add([service("c")])
    await first.finish()
    assert synced(t) and {s.name for s in t.snapshot()} == {"a", "b", "c"}
    # A relist whose continuation expires after one page: applied, nothing deleted...
    broken = t.listing(Kind.SERVICE)
    await broken.add([service("b"), service("d")])
    broken.abandon()
    assert {s.name for s in t.snapshot()} == {"a", "b", "c", "d"}
    # ...until a listing completes: then what it did not contain goes.
    again = t.listing(Kind.SERVICE)
    await again.add([service("b")])
    await again.add([service("d")])
    await again.finish()
    assert {s.name for s in t.snapshot()} == {"b", "d"}


def test_a_big_ports_slice_changes_are_followed_in_place_as_the_merge_has_them() -> None:
    """A random walk of slice changes on a port of ~180 endpoints in 6 slices: endpoints
    going, coming, turning unready, a slice's port number moving, slices deleted and made
    again, the Service itself changing, and addresses that another slice also holds. After
    each, the state is what merging every slice gives; when the tracker followed the change
    in place, its delta leads from the state before to the one after."""
    rng = random.Random(11)
    t = Tracker()
    svc = service("big", cluster_ip="10.96.0.9")
    t.upsert(Kind.SERVICE, svc)
    big = ServicePortName("default", "big", "http", Protocol.TCP)
    fresh = iter(range(1000, 100_000))
    slices: dict[str, dict[str, Any]] = {}
    for k in range(6):
        eps = [endpoint(f"10.2.{k}.{i}", nodeName=f"n{i % 4}") for i in range(30)]
        slices[f"big-{k}"] = endpoint_slice(f"big-{k}", "big", endpoints=eps)
        t.upsert(Kind.ENDPOINT_SLICE, slices[f"big-{k}"])
    followed = whole = 0
    for step in range(400):
        before = t.state(big)
        assert before is not None
        name = rng.choice(sorted(slices))
        obj = copy.deepcopy(slices[name])
        keep = True  # the slice changed: upserted below
        eps = obj["endpoints"]
        roll = rng.random()
        if roll < 0.3 and eps:
            eps.pop(rng.randrange(len(eps)))
        elif roll < 0.6:
            n = next(fresh)
            eps.append(endpoint(f"10.3.{n >> 8 & 255}.{n & 255}", nodeName="n9"))
        elif roll < 0.72 and eps:
            ep = rng.choice(eps)
            ep["conditions"] = {"ready": not ep.get("conditions", {}).get("ready", True)}
        elif roll < 0.75:
            other = slices[rng.choice(sorted(slices))]["endpoints"]
            if other:  # an address another slice holds: the merge says whose copy wins
                eps.append({**copy.deepcopy(rng.choice(other)), "conditions": {"ready": False}})
        elif roll < 0.78:
            obj["ports"] = [{"name": "http", "port": rng.choice([8080, 8081]), "protocol": "TCP"}]
        elif roll < 0.81:
            t.delete(Kind.ENDPOINT_SLICE, slices.pop(name))
            keep = False
        elif roll < 0.84:
            svc = copy.deepcopy(svc)
            svc["metadata"]["labels"] = {"step": str(step)}
            t.upsert(Kind.SERVICE, svc)
            keep = False
        elif roll < 0.9:  # two changes before the state is read: another slice's, or the Service's
            n = next(fresh)
            eps.append(endpoint(f"10.3.{n >> 8 & 255}.{n & 255}"))
            if roll < 0.87:
                other_name = rng.choice(sorted(set(slices) - {name}))
                second = copy.deepcopy(slices[other_name])
                second["endpoints"] = second["endpoints"][1:]
                slices[other_name] = second
                t.upsert(Kind.ENDPOINT_SLICE, second)
            else:
                svc = copy.deepcopy(svc)
                svc["spec"]["ports"][0]["port"] = 80 + step  # the port's spec changes too
                t.upsert(Kind.SERVICE, svc)
        if keep:
            slices[name] = obj
            t.upsert(Kind.ENDPOINT_SLICE, obj)
        if len(slices) < 6:  # a deleted slice is made again, empty, later
            gone = sorted({f"big-{k}" for k in range(6)} - set(slices))[0]
            slices[gone] = endpoint_slice(gone, "big", endpoints=[])
        after = t.state(big)
        assert after is not None
        merged = _merge([t._slices[k] for k in sorted(t._slices_of[big.service])], big)
        assert after.endpoints == merged, step
        if big in t._holders:  # kept up to date, as counted afresh
            assert t._holders[big] == t._count_holders(big), step
        if after is before:
            continue  # a change to what a slice already said: nothing rebuilt
        if after.delta is None:
            whole += 1
            continue
        followed += 1
        assert after.delta.base is before.endpoints
        was = {ep.address: ep for ep in before.endpoints}
        assert set(after.delta.added) == {ep for ep in merged if was.get(ep.address) != ep}
        result = {ep.address: ep for ep in before.endpoints}
        for address in after.delta.removed:
            del result[address]
        result.update((ep.address, ep) for ep in after.delta.added)
        assert sorted(result.values(), key=lambda ep: ep.address) == list(merged), step
    assert followed > 150 and whole > 20  # both roads taken along the walk


def test_the_slices_of_a_service_it_does_not_have_keep_nothing_for_it() -> None:
    """A headless service's slices change and nobody reads its state: no change of them is
    kept (each would hold the slice it replaced)."""
    t = Tracker()
    for i in range(3):
        eps = [endpoint(f"10.0.0.{i}")]
        t.upsert(Kind.ENDPOINT_SLICE, endpoint_slice(f"headless-{i}", f"h{i}", endpoints=eps))
    assert not t._edits


def test_a_small_port_and_a_first_change_after_a_service_change_merge_whole() -> None:
    t = Tracker()
    t.upsert(Kind.SERVICE, service())
    t.upsert(Kind.ENDPOINT_SLICE, endpoint_slice("web-1", endpoints=[endpoint("10.0.0.1")]))
    assert t.state(WEB) is not None
    t.upsert(Kind.ENDPOINT_SLICE, endpoint_slice("web-1", endpoints=[endpoint("10.0.0.2")]))
    state = t.state(WEB)
    assert state is not None and state.delta is None  # below CHANGES_FROM endpoints
