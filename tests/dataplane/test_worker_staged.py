"""A big balancer's new spec reaches a worker in steps built aside: the balancer its listeners
hold serves as it was until the commit, then chooses as the new spec says (the same object:
no listener has to be told)."""

from __future__ import annotations

import gc

from tests.dataplane.conftest import wait_until
from uproxy.dataplane.messages import (
    CommitEndpoints,
    Configure,
    Forget,
    SetEndpoints,
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


async def test_the_serving_balancer_keeps_its_spec_until_the_commit_then_the_new() -> None:
    worker = Worker(channel_fd=-1, index=0)
    try:
        _steps_then_commit(worker)
    finally:
        worker._end_burst()  # the steps made a bulk: the collector back on, as a quiet channel does
        gc.unfreeze()


def _steps_then_commit(worker: Worker) -> None:
    worker._on_message(Configure(DataplaneSettings(node_name="node")), None)
    plain = ServicePort(NAME, 80)
    sticky = ServicePort(NAME, 80, affinity_timeout_s=60)
    old = SetEndpoints(NAME, IPFamily.V4, plain, endpoints(0, 600))
    new = SetEndpoints(NAME, IPFamily.V4, sticky, endpoints(100, 600))
    worker._on_message(old, None)
    serving = worker.balancers[KEY]
    steps = endpoint_steps(new, old)
    assert steps is not None and type(steps[-1]) is CommitEndpoints
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


async def test_what_a_big_port_held_is_freed_after_its_commit_and_its_forget() -> None:
    worker = Worker(channel_fd=-1, index=0)
    try:
        await _freed_in_slices(worker)
    finally:
        worker._end_burst()
        gc.unfreeze()


async def _freed_in_slices(worker: Worker) -> None:
    worker._on_message(Configure(DataplaneSettings(node_name="node")), None)
    plain = ServicePort(NAME, 80)
    sticky = ServicePort(NAME, 80, affinity_timeout_s=60)
    old = SetEndpoints(NAME, IPFamily.V4, plain, endpoints(0, 1000))
    new = SetEndpoints(NAME, IPFamily.V4, sticky, endpoints(500, 1000))
    worker._on_message(old, None)
    serving = worker.balancers[KEY]
    steps = endpoint_steps(new, old)
    assert steps is not None
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
