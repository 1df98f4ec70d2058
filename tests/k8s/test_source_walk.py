"""Random walks of an API server's Services and EndpointSlices, through every disruption the
double can make, checked against a fresh listing.

A seed draws steps of a few changes each (services and slices created, changed and deleted;
slices with no endpoints or with ports the service does not name), each followed by one of
what a long-lived watch meets: nothing, a bookmark, a stream dropped mid-chunk, a stream
ended at its timeout, a 410 Gone in the stream, history compacted under a dropped stream, a
server restarted (at once, or after a moment down), a server back at an older version (a
restored etcd). Now and then, and at the end, the tracker fed by the real source must reach
exactly the state a tracker given a fresh listing of the same objects holds.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from tests.apiserver import ApiServerDouble
from tests.conftest import wait_for
from tests.k8s.conftest import SourceFactory
from tests.k8s.helpers import endpoint_slice, service
from uproxy.sources.kube import KubeSource
from uproxy.tracker import Kind, Tracker

SVC, EPS = "Service", "EndpointSlice"
STEPS = 25
SERVICES = [f"s{i}" for i in range(6)]
DISRUPTIONS = (
    "none",
    "bookmark",
    "drop",
    "end",
    "gone",
    "compact",
    "restart",
    "rewind",
)


def normal(tracker: Tracker) -> dict[Any, Any]:
    """The tracker's desired state, endpoints in a fixed order."""
    return {
        spn: (state.port, sorted(state.endpoints, key=repr))
        for spn, state in tracker.snapshot().items()
    }


def listed(apiserver: ApiServerDouble) -> dict[Any, Any]:
    """What a tracker given a fresh listing holds."""
    fresh = Tracker()
    fresh.replace(Kind.SERVICE, apiserver.objects(SVC))
    fresh.replace(Kind.ENDPOINT_SLICE, apiserver.objects(EPS))
    return normal(fresh)


def draw_service(rng: random.Random, name: str) -> dict[str, Any]:
    ports = [
        {"name": "http", "port": 80, "protocol": "TCP"},
        {"name": "dns", "port": 53, "protocol": "UDP"},
    ]
    return service(
        name,
        ports=rng.sample(ports, rng.randint(1, 2)),
        cluster_ip=f"10.96.0.{SERVICES.index(name) + 1}",
        affinity=rng.random() < 0.3,
    )


def draw_slice(rng: random.Random, name: str, service_name: str) -> dict[str, Any]:
    ips = [f"10.1.{SERVICES.index(service_name)}.{i}" for i in range(1, 5)]
    return endpoint_slice(
        name,
        service_name=service_name,
        ips=rng.sample(ips, rng.randint(0, 3)),
        port=rng.choice([8080, 8081]),
        port_name=rng.choice(["http", "http", "dns", "other"]),
    )


def change(rng: random.Random, apiserver: ApiServerDouble) -> str:
    """One change to the API server's objects, said in a few words."""
    name = rng.choice(SERVICES)
    if rng.random() < 0.4:
        if apiserver.get(SVC, "default", name) is not None and rng.random() < 0.3:
            apiserver.delete(SVC, service(name))
            return f"deleted {name}"
        apiserver.apply(SVC, draw_service(rng, name))
        return f"applied {name}"
    slice_name = f"{name}-{rng.randint(1, 2)}"
    if apiserver.get(EPS, "default", slice_name) is not None and rng.random() < 0.3:
        apiserver.delete(EPS, draw_slice(rng, slice_name, name))
        return f"deleted {slice_name}"
    apiserver.apply(EPS, draw_slice(rng, slice_name, name))
    return f"applied {slice_name}"


async def disrupt(
    rng: random.Random, apiserver: ApiServerDouble, source: KubeSource, versions: list[int]
) -> str:
    what = rng.choice(DISRUPTIONS)
    if what == "bookmark":
        apiserver.send_bookmarks()
    elif what == "drop":
        apiserver.drop_watches()
    elif what == "end":
        apiserver.end_watches()
    elif what == "gone":
        apiserver.expire_watches()
    elif what == "compact":
        apiserver.drop_watches()
        apiserver.compact()
    elif what == "restart":
        down = rng.choice([0.0, 0.3])
        await apiserver.restart(down_for_s=down)
        what += f" ({down} s down)"
    elif what == "rewind":
        await rewind(rng, apiserver, source, versions)
    versions.append(apiserver.resource_version)
    return what


async def rewind(
    rng: random.Random, apiserver: ApiServerDouble, source: KubeSource, versions: list[int]
) -> None:
    """Back at an older version, as an API server on a restored etcd is, once the source has
    seen everything (a bookmark brings every feed to the current version), and nothing more
    changes until the source has relisted: the double keeps its objects and forgets its
    history, so a client whose version the reused numbers pass before it looks again would
    miss what happened in between, as any client would (hence etcd's restore can bump the
    revision and mark it compacted)."""
    now = apiserver.resource_version
    older = [v for v in versions if v < now]
    if not older:
        return

    def caught_up() -> bool:
        if all(f.rv == str(now) for f in source.feeds if f.name in (SVC, EPS)):
            return True
        apiserver.send_bookmarks()  # to the watches open by now (a dropped one reopens)
        return False

    await wait_for(caught_up, timeout=10, message="the source at the current version")
    lists = [apiserver.list_count(kind) for kind in (SVC, EPS)]
    apiserver.drop_watches()
    apiserver.rewind(rng.choice(older))
    await wait_for(
        lambda: all(apiserver.list_count(k) > n for k, n in zip((SVC, EPS), lists, strict=True)),
        timeout=10,
        message="a relist after the rewind",
    )


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
async def test_the_tracker_reaches_a_fresh_listing_through_any_disruption(
    apiserver: ApiServerDouble, start_source: SourceFactory, seed: int
) -> None:
    rng = random.Random(seed)
    for _ in range(8):
        change(rng, apiserver)
    tracker, source = await start_source(backoff_max_s=0.2)
    await wait_for(lambda: tracker.synced and normal(tracker) == listed(apiserver), timeout=10)
    versions = [apiserver.resource_version]
    done: list[str] = []
    waits = 0
    for step in range(STEPS):
        done += [change(rng, apiserver) for _ in range(rng.randint(1, 3))]
        done.append(await disrupt(rng, apiserver, source, versions))
        if rng.random() < 0.5 or step == STEPS - 1:
            waits += 1
            await wait_for(
                lambda: normal(tracker) == listed(apiserver),
                timeout=10,
                message=f"seed {seed}, step {step}: a fresh listing's state after {done[-6:]}",
            )
    assert waits >= 8 and len(listed(apiserver)) >= 3  # the walk checked something
