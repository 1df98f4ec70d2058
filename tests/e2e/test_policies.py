"""Issue 5: traffic policies, terminating endpoints and health-check node ports, end to end.

Two nodes run uproxy from the same services file: ``node-a`` holds two endpoints of every
service (``web-1``, ``web-2``), ``node-c`` (not running here) holds ``web-3``, and ``node-b``
holds none. Backends answer with their own name, so every answer says where it was served.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.e2e.cluster import NODE_B_IP, Cluster
from tests.e2e.conftest import StartProc, StartUproxy
from tests.e2e.harness import (
    ServicesFile,
    connect_times_out,
    curl,
    curl_raw,
    curl_status,
    slice_endpoint,
)
from tests.e2e.manifests import backend_argv, web_service, web_slice

pytestmark = [pytest.mark.root]

LOCAL_IP = "10.96.0.30"
LOCAL_NODE_PORT = 30090
HC_PORT = 32000
CONNECTION_REFUSED = 7


def three_endpoints(net: Cluster) -> list[dict[str, object]]:
    ips = net.backend_ips
    return [
        slice_endpoint(ips[0], node="node-a"),
        slice_endpoint(ips[1], node="node-a"),
        slice_endpoint(ips[2], node="node-c"),
    ]


def external_local_service() -> dict[str, object]:
    svc = web_service(
        "local",
        cluster_ip=LOCAL_IP,
        type="NodePort",
        externalTrafficPolicy="Local",
        healthCheckNodePort=HC_PORT,
    )
    svc["spec"]["ports"][0]["nodePort"] = LOCAL_NODE_PORT
    return svc


def test_external_traffic_policy_local_on_two_nodes(
    net: Cluster,
    services: ServicesFile,
    start_proc: StartProc,
    start_uproxy: StartUproxy,
    tmp_path: Path,
) -> None:
    topo = net.topo
    start_proc(topo.backend, backend_argv(net), ready_line=True)
    services.put(external_local_service(), web_slice("local-1", "local", three_endpoints(net)))
    services.write()
    node_a = start_uproxy("auto")
    node_b = start_uproxy("auto", ns=net.node_b, hostname="node-b")
    node_a.wait_synced()
    node_b.wait_synced()

    # 100 NodePort requests to node-a: all served by its two local endpoints, never web-3.
    url_a = f"http://{topo.node_ip}:{LOCAL_NODE_PORT}/"
    answers = curl(topo, topo.outside, url_a, body=b"external", tmp=tmp_path, count=100)
    assert {a.name for a in answers} == {"web-1", "web-2"}

    # node-b has no local endpoint: its NodePort drops new connections, as kube-proxy's
    # does (the load balancer's health check says 503 and sends them elsewhere).
    assert connect_times_out(topo, topo.outside, f"http://{NODE_B_IP}:{LOCAL_NODE_PORT}/")

    # ClusterIP traffic from node-b itself still reaches every endpoint (internal policy:
    # Cluster), including web-3 on a third node.
    answers = curl(topo, net.node_b, f"http://{LOCAL_IP}/", body=b"cluster", tmp=tmp_path, count=12)
    assert {a.name for a in answers} == {"web-1", "web-2", "web-3"}


def test_internal_traffic_policy_local_keeps_cluster_traffic_on_the_node(
    net: Cluster,
    services: ServicesFile,
    start_proc: StartProc,
    start_uproxy: StartUproxy,
    tmp_path: Path,
) -> None:
    topo = net.topo
    start_proc(topo.backend, backend_argv(net), ready_line=True)
    svc = web_service("internal", cluster_ip="10.96.0.31", internalTrafficPolicy="Local")
    services.put(svc, web_slice("internal-1", "internal", three_endpoints(net)))
    services.write()
    proxy = start_uproxy("auto")
    proxy.wait_synced()
    for ns in (topo.pod, topo.node):
        answers = curl(topo, ns, "http://10.96.0.31/", body=b"internal", tmp=tmp_path, count=20)
        assert {a.name for a in answers} == {"web-1", "web-2"}, ns


def test_terminating_endpoints_serve_until_a_ready_one_exists(
    net: Cluster,
    services: ServicesFile,
    start_proc: StartProc,
    start_uproxy: StartUproxy,
    tmp_path: Path,
) -> None:
    topo = net.topo
    ips = net.backend_ips
    start_proc(topo.backend, backend_argv(net), ready_line=True)
    terminating = [
        slice_endpoint(ip, ready=False, serving=True, terminating=True) for ip in ips[:2]
    ]
    # Not serving any more: never used, even as a fallback.
    gone = slice_endpoint(ips[2], ready=False, serving=False, terminating=True)
    svc = web_service("term", cluster_ip="10.96.0.32")
    services.put(svc, web_slice("term-1", "term", [*terminating, gone]))
    services.write()
    proxy = start_uproxy("auto")
    proxy.wait_synced()
    url = "http://10.96.0.32/"
    answers = curl(topo, topo.pod, url, body=b"draining", tmp=tmp_path, count=12)
    assert {a.name for a in answers} == {"web-1", "web-2"}

    # A ready endpoint arrives (web-3 comes back ready): only it is used from now on.
    total, _ = proxy.endpoint_changes()
    services.put(web_slice("term-1", "term", [*terminating, slice_endpoint(ips[2])]))
    services.write()
    proxy.wait_endpoints_applied(total_before=total)
    answers = curl(topo, topo.pod, url, body=b"ready", tmp=tmp_path, count=12)
    assert {a.name for a in answers} == {"web-3"}


def hc_expect(topo_ns_ip: str, count: int, code: int) -> dict[str, object]:
    return {
        "status": code,
        "body": {
            "service": {"namespace": "default", "name": "local"},
            "localEndpoints": count,
            "serviceProxyHealthy": True,
        },
        "headers": {
            "content-type": "application/json",
            "x-content-type-options": "nosniff",
            "x-load-balancing-endpoint-weight": str(count),
        },
    }


def test_health_check_node_port_follows_local_endpoints(
    net: Cluster,
    services: ServicesFile,
    start_uproxy: StartUproxy,
) -> None:
    topo = net.topo
    url = f"http://{topo.node_ip}:{HC_PORT}/"

    def observed() -> dict[str, object]:
        status, headers, body = curl_raw(topo, topo.outside, url)
        picked = {k: headers.get(k) for k in ("content-type", "x-content-type-options")}
        picked["x-load-balancing-endpoint-weight"] = headers.get("x-load-balancing-endpoint-weight")
        return {"status": status, "body": json.loads(body), "headers": picked}

    services.put(external_local_service())  # no endpoints yet
    services.write()
    proxy = start_uproxy("auto")
    proxy.wait_synced()
    assert observed() == hc_expect(topo.node_ip, 0, 503)

    total, _ = proxy.endpoint_changes()
    services.put(web_slice("local-1", "local", three_endpoints(net)))
    services.write()
    proxy.wait_endpoints_applied(total_before=total)
    assert observed() == hc_expect(topo.node_ip, 2, 200)

    started = time.time()
    services.remove("Service", "local")
    services.write()
    proxy.wait_change_synced(after=started)
    assert curl_status(topo, topo.outside, url) == CONNECTION_REFUSED
