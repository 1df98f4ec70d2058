"""A big balancer's new spec reaches a worker in steps built aside: the balancer its listeners
hold serves as it was until the commit, then chooses as the new spec says (the same object:
no listener has to be told)."""

from __future__ import annotations

import gc

from uproxy.dataplane.messages import (
    CommitEndpoints,
    Configure,
    Forget,
    SetEndpoints,
    endpoint_steps,
)
from uproxy.dataplane.settings import DataplaneSettings
from uproxy.dataplane.worker import Worker
from uproxy.model import Endpoint, IPFamily, Protocol, ServicePort, ServicePortName

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
        assert set(serving._endpoints) == set(old.endpoints)
    assert KEY in worker.staged
    worker._on_message(steps[-1], None)
    assert worker.balancers[KEY] is serving and not worker.staged
    assert serving.affinity and set(serving._endpoints) == set(new.endpoints)
    # A port forgotten while its new spec is being built: what was built aside goes too.
    back = endpoint_steps(old, new)
    assert back is not None
    for step in back[:2]:
        worker._on_message(step, None)
    assert KEY in worker.staged
    worker._on_message(Forget(NAME, IPFamily.V4), None)
    assert not worker.staged and KEY not in worker.balancers
