"""Issue 4: service traffic from a pod, the node and outside reaches the backends (every backend).

uproxy runs as a real process in the node namespace and follows a services file; real clients
(curl, dig) send real bytes, and every HTTP answer carries the length and sha256 of the body
the backend received.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.cluster import Cluster
from tests.e2e.conftest import StartProc, StartUproxy
from tests.e2e.harness import ServicesFile, curl, dig, wait_until_ok
from tests.e2e.manifests import (
    DNS_ANSWER,
    DNS_IP,
    DNS_NAME,
    DNS_NODE_PORT,
    EXTERNAL_IP,
    LB_IP,
    WEB_IP,
    WEB_NODE_PORT,
    backend_argv,
    dnsmasq_argv,
    lb_dns,
    lb_web,
)

RULES = [
    pytest.param("auto", id="restore"),
    pytest.param("iptables", id="python-iptables"),
    pytest.param("nftables", id="nftables"),
]

pytestmark = [pytest.mark.root]


@pytest.mark.parametrize("rules", RULES)
def test_pod_node_and_outside_reach_backends(
    net: Cluster,
    services: ServicesFile,
    start_proc: StartProc,
    start_uproxy: StartUproxy,
    tmp_path: Path,
    rules: str,
) -> None:
    topo = net.topo
    start_proc(topo.backend, backend_argv(net), ready_line=True)
    start_proc(topo.backend, dnsmasq_argv(topo.backend_ip))
    wait_until_ok(
        lambda: dig(topo, topo.backend, topo.backend_ip, DNS_NAME) == DNS_ANSWER,
        message="dnsmasq answering",
    )
    services.put(*lb_web(net), *lb_dns(net))
    services.write()
    proxy = start_uproxy(rules)
    proxy.wait_synced()

    body = bytes(range(256)) * 4096  # 1 MiB, every byte value
    web = f"http://{WEB_IP}/"
    # From a pod (PREROUTING, REDIRECT): round robin over both endpoints.
    names = {a.name for a in curl(topo, topo.pod, web, body=body, tmp=tmp_path, count=4)}
    assert names == {"web-1", "web-2"}
    # Round robin is per data-plane worker (one each per core, like nginx's workers): three
    # connections put two on one worker, which then uses both endpoints, however they spread.
    # From the node itself (OUTPUT, DNAT to the node address).
    assert {a.name for a in curl(topo, topo.node, web, body=body, tmp=tmp_path, count=3)} == {
        "web-1",
        "web-2",
    }
    # From outside: the node port on the node's address, the externalIP, the LB ingress IP.
    for url in (
        f"http://{topo.node_ip}:{WEB_NODE_PORT}/",
        f"http://{EXTERNAL_IP}/",
        f"http://{LB_IP}/",
    ):
        assert {
            a.name for a in curl(topo, topo.outside, url, body=body, tmp=tmp_path, count=3)
        } == {
            "web-1",
            "web-2",
        }, url
    # UDP through the ClusterIP, from a pod and from the node.
    assert dig(topo, topo.pod, DNS_IP, DNS_NAME) == DNS_ANSWER
    assert dig(topo, topo.node, DNS_IP, DNS_NAME) == DNS_ANSWER
    # Every other path, over TCP and UDP. Not the node to the externalIP: it is not a local
    # address, so the node routes it out, and it would come back with the node's own source.
    paths = [
        (topo.pod, topo.node_ip, WEB_NODE_PORT, DNS_NODE_PORT),
        (topo.pod, EXTERNAL_IP, 80, 53),
        (topo.pod, LB_IP, 80, 53),
        (topo.node, topo.node_ip, WEB_NODE_PORT, DNS_NODE_PORT),
        (topo.node, LB_IP, 80, 53),
        (topo.outside, topo.node_ip, WEB_NODE_PORT, DNS_NODE_PORT),
        (topo.outside, EXTERNAL_IP, 80, 53),
        (topo.outside, LB_IP, 80, 53),
    ]
    for ns, ip, tcp_port, udp_port in paths:
        where = f"{ns.rsplit('-', 1)[-1]} -> {ip}"
        answers = curl(topo, ns, f"http://{ip}:{tcp_port}/", body=b"path", tmp=tmp_path, count=3)
        assert {a.name for a in answers} == {"web-1", "web-2"}, where
        assert dig(topo, ns, ip, DNS_NAME, port=udp_port) == DNS_ANSWER, where
