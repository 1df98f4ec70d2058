"""Issue 5: ``/metrics`` of the running uproxy parses, and its data-plane counters are exact.

The counters must move by exactly what the test sent: connections, bytes to the endpoint
(the payloads) and bytes to the client (the backends' fixed-format answers), per service.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import pytest

from tests.conftest import wait_for_sync
from tests.e2e.cluster import Cluster
from tests.e2e.conftest import StartProc, StartUproxy
from tests.e2e.harness import ServicesFile, Uproxy, curl, echo_send
from tests.e2e.manifests import SUM_IP, WEB_IP, backend_argv, lb_web, sum_service

pytestmark = [pytest.mark.root]

SUM = "default/sum:raw"
WEB = "default/web:http"


def counters(proxy: Uproxy, service: str) -> tuple[float, float, float]:
    """(ok connections, bytes to endpoint, bytes to client) of one service port."""
    samples = proxy.metrics()
    return (
        samples.get(
            (
                "uproxy_connections_total",
                (("protocol", "TCP"), ("result", "ok"), ("service", service)),
            ),
            0.0,
        ),
        samples.get(
            ("uproxy_bytes_total", (("direction", "to_endpoint"), ("service", service))), 0.0
        ),
        samples.get(
            ("uproxy_bytes_total", (("direction", "to_client"), ("service", service))), 0.0
        ),
    )


def test_connection_and_byte_counters_are_exact(
    net: Cluster,
    services: ServicesFile,
    start_proc: StartProc,
    start_uproxy: StartUproxy,
    tmp_path: Path,
) -> None:
    topo = net.topo
    start_proc(topo.backend, backend_argv(net), ready_line=True)
    services.put(*sum_service(net), *lb_web(net))
    services.write()
    proxy = start_uproxy("auto")
    proxy.wait_synced()
    sum_before, web_before = counters(proxy, SUM), counters(proxy, WEB)

    sizes = [1, 1000, 65536, 1 << 20, 3 * (1 << 20) + 7]
    sent = 0
    answered = 0
    for seed, size in enumerate(sizes):
        assert echo_send(topo, topo.pod, SUM_IP, 9000, size=size, seed=seed) == "sum-1"
        digest = hashlib.sha256(random.Random(seed).randbytes(size)).hexdigest()
        sent += size
        answered += len(f"sum-1 {size} {digest}")
    curl(topo, topo.pod, f"http://{WEB_IP}/", body=b"web", tmp=tmp_path, count=3)

    want = (sum_before[0] + len(sizes), sum_before[1] + sent, sum_before[2] + answered)
    # Counters are bumped as the relay finishes: wait (bounded) until they stop short of it.
    wait_for_sync(
        lambda: counters(proxy, SUM) >= want, timeout=5, interval=0.1, message="sum counters"
    )
    assert counters(proxy, SUM) == want
    assert counters(proxy, WEB)[0] == web_before[0] + 3
