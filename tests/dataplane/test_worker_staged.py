"""A big balancer's new spec reaches a worker in steps built aside: the balancer its listeners
hold serves as it was until the commit, then chooses as the new spec says (the same object:
no listener has to be told)."""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator

import pytest

from tests.dataplane.conftest import wait_until
from uproxy.dataplane.balancer import Balancer
from uproxy.dataplane.messages import (
    CommitEndpoints,
    Configure,
    Forget,
    SetEndpoints,
    Step,
    endpoint_steps,
)
from uproxy.dataplane.settings import DataplaneSettings
from uproxy.dataplane.worker import Worker
from uproxy.model import Endpoint, IPFamily, Protocol, ServicePort, ServicePortName, Traffic

NAME = ServicePortName("ns", "big", "p", Protocol.TCP)
KEY = (NAME, IPFamily.V4)


def endpoints(first: int, count: int) -> tuple[Endpoint, ...]:
    return tuple(
        Endpoint(f"127.1.{i // 250}.{i % 250 + 1}", 9) for i in range(first, first + count)
    )


@pytest.fixture
async def worker() -> AsyncIterator[Worker]:
    made = Worker(channel_fd=-1, index=0)
    made._on_message(Configure(DataplaneSettings(node_name="node")), None)
    yield made
    made._end_burst()  # the steps made a bulk: the collector back on, as a quiet channel does
    gc.unfreeze()


def _affinity_turned_on(
    worker: Worker, count: int, shift: int
) -> tuple[Balancer, SetEndpoints, SetEndpoints, list[Step]]:
    """A port of ``count`` endpoints served without affinity, and the steps to affinity on
    with the endpoints ``shift`` further: the serving balancer, the old set, the new one."""
    old = SetEndpoints(NAME, IPFamily.V4, ServicePort(NAME, 80), endpoints(0, count))
    sticky = ServicePort(NAME, 80, affinity_timeout_s=60)
    new = SetEndpoints(NAME, IPFamily.V4, sticky, endpoints(shift, count))
    worker._on_message(old, None)
    steps = endpoint_steps(new, old)
    assert steps is not None and type(steps[-1]) is CommitEndpoints
    return worker.balancers[KEY], old, new, steps


async def test_the_serving_balancer_keeps_its_spec_until_the_commit_then_the_new(
    worker: Worker,
) -> None:
    serving, old, new, steps = _affinity_turned_on(worker, 600, 100)
    for step in steps[:-1]:
        worker._on_message(step, None)
        assert worker.balancers[KEY] is serving and not serving.affinity
        assert set(serving._every()) == set(old.endpoints)
    assert KEY in worker.staged
    worker._on_message(steps[-1], None)
    assert worker.balancers[KEY] is serving and not worker.staged
    assert serving.affinity and set(serving._every()) == set(new.endpoints)
    # A port forgotten while its new spec is being built: what was built aside goes too.
    back = endpoint_steps(old, new)
    assert back is not None
    for step in back[:2]:
        worker._on_message(step, None)
    assert KEY in worker.staged
    worker._on_message(Forget(NAME, IPFamily.V4), None)
    assert not worker.staged and KEY not in worker.balancers


async def test_what_a_big_port_held_is_freed_after_its_commit_and_its_forget(
    worker: Worker,
) -> None:
    serving, _, new, steps = _affinity_turned_on(worker, 1000, 500)
    for step in steps:
        worker._on_message(step, None)
    # The commit handed the old state over instead of freeing it: the endpoints, the pool's
    # order and its members, 1,000 each (the old set came whole: no index).
    release = worker.release
    assert release is not None and release.pending == 3000
    chosen = {serving.pick(f"10.0.0.{n}", Traffic.CLUSTER) for n in range(200)}
    assert chosen <= set(new.endpoints)
    await wait_until(lambda: release.pending == 0, what="the old state freed")
    assert release.freed >= 3000
    assert {serving.pick(f"10.0.1.{n}", Traffic.CLUSTER) for n in range(200)} <= set(new.endpoints)
    # Forgotten: the balancer a closed listener may still hold picks nothing, and what it
    # held goes the same way.
    worker._on_message(Forget(NAME, IPFamily.V4), None)
    assert serving.pick("10.0.2.1", Traffic.CLUSTER) is None
    # Built in steps, it holds its endpoints in an index by address (and none on this node)
    # and its pool, not in a tuple of them too; and the affinity table of the 400 clients
    # that picked.
    assert release.pending == 3000 + 400
    await wait_until(lambda: release.pending == 0, what="the forgotten state freed")
