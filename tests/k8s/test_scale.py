"""Scale: 5,000 services (1 port, 3 endpoints each) listed from the double until synced.

Prints the time to a synced state and the memory the proxy added (RSS of this process
after minus before: the double lives in the same process and is populated beforehand).
The bounds asserted are generous ceilings that catch a quadratic regression, not targets.
"""

from __future__ import annotations

import gc
import time

import pytest

from tests.apiserver import ApiServerDouble
from tests.conftest import wait_for

from .conftest import ProxyFactory, SourceFactory
from .helpers import endpoint_slice, service

N = 5000


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def populate(apiserver: ApiServerDouble) -> None:
    for i in range(N):
        name = f"svc-{i:05}"
        apiserver.create("Service", service(name, cluster_ip=f"10.96.{i // 250}.{i % 250 + 1}"))
        base = f"10.{1 + i // 20000}.{(i // 80) % 250}.{(i % 80) * 3 + 1}"
        prefix, last = base.rsplit(".", 1)
        ips = [f"{prefix}.{int(last) + k}" for k in range(3)]
        apiserver.create(
            "EndpointSlice", endpoint_slice(f"{name}-abcde", service_name=name, ips=ips, port=8080)
        )


@pytest.mark.slow
async def test_5000_services_source_and_tracker(
    apiserver: ApiServerDouble, start_source: SourceFactory
) -> None:
    populate(apiserver)
    gc.collect()
    before = rss_mib()
    started = time.monotonic()
    tracker, _ = await start_source()
    await wait_for(lambda: tracker.synced, timeout=60)
    state = tracker.snapshot()
    elapsed = time.monotonic() - started
    assert len(state) == N
    assert all(len(s.endpoints) == 3 for s in state.values())
    grown = rss_mib() - before
    print(f"\nsource+tracker: {N} services synced in {elapsed:.2f}s, RSS +{grown:.0f} MiB")
    assert elapsed < 30


@pytest.mark.slow
async def test_5000_services_whole_proxy(
    apiserver: ApiServerDouble, start_proxy: ProxyFactory
) -> None:
    populate(apiserver)
    gc.collect()
    before = rss_mib()
    started = time.monotonic()
    proxy = await start_proxy()
    await wait_for(lambda: proxy.synced.is_set(), timeout=120, interval=0.05)
    elapsed = time.monotonic() - started
    assert proxy.syncer is not None
    ports = proxy.syncer.ports
    assert len(ports) == N
    assert all(pp.cluster is not None for pp in ports.values())
    grown = rss_mib() - before
    print(
        f"\nwhole proxy: {N} services with listeners synced in {elapsed:.2f}s, "
        f"RSS +{grown:.0f} MiB (process {rss_mib():.0f} MiB)"
    )
    assert elapsed < 60
