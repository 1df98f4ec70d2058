"""A service port with thousands of endpoints (say, a DaemonSet's pods across a big cluster):
its endpoints reach every data-plane worker whole, and traffic flows through them.

One service port's endpoints go to each worker as one message (about 43 bytes an endpoint on
a node of its own): 6,000 endpoints are 258 kB, more than a datagram of the channel may hold
(the channel sends them in pieces, ``uproxy.dataplane.messages``). The backend
namespace answers for two whole /16s (local routes on its loopback, one server bound to the
wildcard), so 6,000 endpoints are 6,000 addresses that answer, and each answer says which one
the connection reached.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.e2e.cluster import Cluster
from tests.e2e.conftest import StartProc, StartUproxy
from tests.e2e.harness import ServicesFile, curl, slice_endpoint
from tests.e2e.manifests import WEB_IP, WEB_PORT, web_service, web_slice
from tests.netns.topology import sh

pytestmark = [pytest.mark.root]

ENDPOINTS = 6_000
PER_SLICE = 100  # the EndpointSlice controller's default
NETS = "10.78.0.0/15"  # 10.78.0.0/16, then 10.79.0.0/16


def big_slices(
    prefix: str, ready: Callable[[int], bool] = lambda i: True, skip: int = -1
) -> list[dict[str, object]]:
    """ENDPOINTS endpoints in ``prefix``.0.0/16, each on a node of its own (a DaemonSet's),
    PER_SLICE to a slice (the same slice names whatever the prefix: a later call replaces
    every endpoint); the ``i``-th ready if ``ready(i)``, the ``skip``-th left out."""
    eps = [
        slice_endpoint(
            f"{prefix}.{i // 250}.{i % 250 + 1}",
            node=f"node-{i:05d}",
            ready=ready(i),
            serving=ready(i),
        )
        for i in range(ENDPOINTS)
        if i != skip
    ]
    return [
        web_slice(f"big-{n}", "big", eps[n * PER_SLICE : (n + 1) * PER_SLICE])
        for n in range(ENDPOINTS // PER_SLICE)
    ]


def test_a_service_of_6000_endpoints_reaches_every_worker_whole_and_serves(
    net: Cluster,
    services: ServicesFile,
    start_proc: StartProc,
    start_uproxy: StartUproxy,
    tmp_path: Path,
) -> None:
    topo = net.topo
    for half in ("10.78.0.0/16", "10.79.0.0/16"):
        sh("ip", "-n", topo.backend, "route", "add", "local", half, "dev", "lo")
    sh("ip", "-n", topo.node, "route", "add", NETS, "via", topo.backend_ip)
    server = [sys.executable, "-m", "tests.e2e.servers", f"big=0.0.0.0:{WEB_PORT}:http"]
    start_proc(topo.backend, server, ready_line=True)
    services.put(web_service("big"), *big_slices("10.78"))
    services.write()
    proxy = start_uproxy("nftables", extra=["--workers", "2"])
    proxy.wait_synced(timeout=60)

    web = f"http://{WEB_IP}/"
    answers = curl(topo, topo.pod, web, body=b"x" * 1000, tmp=tmp_path, count=12)
    reached = {a.to for a in answers}
    assert {a.name for a in answers} == {"big"}
    assert all(ip.startswith("10.78.") for ip in reached), reached
    # Round robin in each of the two workers: a new endpoint for each of its connections.
    assert len(reached) >= 6, reached

    # Every endpoint replaced at once: the next set is as big, and it is the one served.
    # One of them is ready: every connection reaches it.
    total_before, _ = proxy.endpoint_changes()
    services.put(*big_slices("10.79", ready=lambda i: i == 0))
    services.write()
    proxy.wait_endpoints_applied(total_before=total_before, timeout=60)
    answers = curl(topo, topo.pod, web, body=b"y" * 1000, tmp=tmp_path, count=12)
    assert {a.to for a in answers} == {"10.79.0.1"}

    # A change of three endpoints among 6,000 goes to the workers as a change: the ready
    # one turns not ready, another turns ready, a third goes. Traffic follows it.
    total_before, _ = proxy.endpoint_changes()
    services.put(*big_slices("10.79", ready=lambda i: i == 1, skip=2))
    services.write()
    proxy.wait_endpoints_applied(total_before=total_before, timeout=60)
    answers = curl(topo, topo.pod, web, body=b"z" * 1000, tmp=tmp_path, count=12)
    assert {a.to for a in answers} == {"10.79.0.2"}

    died = [line for line in proxy.proc.stderr_lines if "worker died" in line]
    assert not died, died
