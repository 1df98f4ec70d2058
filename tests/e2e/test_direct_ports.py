"""Proxy ports are reached through the portals only, end to end in every rules backend.

Every proxy port listens on every address (REDIRECT rewrites the destination to the incoming
interface's address), so without a rule a client could connect to ``NODE_IP:PROXY_PORT``
itself and be served past every check the portals make. Here the web service is a
LoadBalancer whose source ranges let in ``outside`` only, with a NodePort and an externalIP,
and ``internal`` is a ClusterIP-only service. From ``outside``, ``node-b`` (outside the
ranges) and a pod, connecting straight to the node's address on a proxy port gets no answer
at all, while the ClusterIP (from a pod and the node), the LoadBalancer IP (from the allowed
source) and the NodePort carry real bytes. The node's own processes may still dial a proxy
port. A default-deny INPUT policy keeps NodePort traffic flowing (``KUBE-NODEPORT-NON-LOCAL``
accepts it) and no longer lets direct connections in.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.cluster import Cluster
from tests.e2e.conftest import DUAL_STACK, StartProc, StartUproxy
from tests.e2e.harness import ServicesFile, connect_times_out, curl, slice_endpoint, url
from tests.e2e.manifests import (
    LB_IP,
    WEB_IP6,
    WEB_NODE_PORT,
    backend_argv,
    dual_web,
    lb_web,
    web_service,
    web_slice,
)

pytestmark = [pytest.mark.root]

PORT_RANGE = ["--proxy-port-range", "40000-40019"]
WEB = "default/web:http"
INTERNAL = "default/internal:http"
INTERNAL_IP = "10.96.0.40"


def answered(net: Cluster, ns: str, url: str, tmp: Path) -> set[str]:
    """The backends that answered two POSTs (each answer's length and sha256 checked)."""
    return {a.name for a in curl(net.topo, ns, url, body=b"through a portal", tmp=tmp, count=2)}


def start(
    net: Cluster,
    services: ServicesFile,
    start_proc: StartProc,
    start_uproxy: StartUproxy,
    rules: str,
) -> tuple[int, int]:
    """The web LoadBalancer (source range: ``outside``) and the ClusterIP-only service
    running; their proxy ports."""
    topo = net.topo
    topo.run(topo.node, "ip", "addr", "add", f"{LB_IP}/32", "dev", "lo")
    objs = lb_web(net)
    objs[0]["spec"]["loadBalancerSourceRanges"] = [f"{topo.outside_ip}/32"]
    eps = [slice_endpoint(ip) for ip in net.backend_ips[:2]]
    objs += [web_service("internal", cluster_ip=INTERNAL_IP), web_slice("i-1", "internal", eps)]
    start_proc(topo.backend, backend_argv(net), ready_line=True)
    services.put(*objs)
    services.write()
    proxy = start_uproxy(rules, extra=PORT_RANGE)
    proxy.wait_synced()
    ports = proxy.proxy_ports()
    return ports[(WEB, "cluster")], ports[(INTERNAL, "cluster")]


BACKENDS = [
    pytest.param("auto", "nft", id="restore"),
    pytest.param("iptables", "legacy", id="python-iptables"),
    pytest.param("nftables", None, id="nftables"),
]


@pytest.mark.parametrize(("rules", "mode"), BACKENDS)
def test_proxy_ports_answer_through_the_portals_only(
    net: Cluster,
    services: ServicesFile,
    start_proc: StartProc,
    start_uproxy: StartUproxy,
    tmp_path: Path,
    rules: str,
    mode: str | None,
) -> None:
    topo = net.topo
    web, internal = start(net, services, start_proc, start_uproxy, rules)
    backends = {"web-1", "web-2"}
    # Through the portals: real bytes.
    assert answered(net, topo.pod, f"http://{INTERNAL_IP}/", tmp_path) <= backends
    assert answered(net, topo.node, f"http://{INTERNAL_IP}/", tmp_path) <= backends
    assert answered(net, topo.outside, f"http://{LB_IP}/", tmp_path) <= backends
    assert answered(net, topo.outside, f"http://{topo.node_ip}:{WEB_NODE_PORT}/", tmp_path) <= (
        backends
    )
    # Straight to the proxy ports on the node's address: no answer at all, whoever asks.
    for port in (web, internal):
        direct = f"http://{topo.node_ip}:{port}/"
        assert connect_times_out(topo, topo.outside, direct), direct  # allowed by the ranges
        assert connect_times_out(topo, net.node_b, direct), direct  # outside them
        assert connect_times_out(topo, topo.pod, direct), direct
    # On the address node-b reaches the node by (the LoadBalancer IP is local here) too.
    assert connect_times_out(topo, net.node_b, f"http://{LB_IP}:{web}/")
    # node-b, outside the ranges, is still kept off the LoadBalancer IP itself.
    assert connect_times_out(topo, net.node_b, f"http://{LB_IP}/")
    # The node's own processes may dial a proxy port.
    assert answered(net, topo.node, f"http://{topo.node_ip}:{internal}/", tmp_path) <= backends
    # The portals still work after all that (nothing was cached against them).
    assert answered(net, topo.outside, f"http://{LB_IP}/", tmp_path) <= backends


DEFAULT_DENY = [
    ["-P", "INPUT", "DROP"],
    ["-A", "INPUT", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"],
    ["-A", "INPUT", "-i", "lo", "-j", "ACCEPT"],
]


@pytest.mark.parametrize(
    ("rules", "mode"),
    [
        pytest.param("auto", "nft", id="restore"),
        pytest.param("iptables", "legacy", id="python-iptables"),
    ],
)
def test_default_deny_lets_in_node_ports_not_their_proxy_ports(
    net: Cluster,
    services: ServicesFile,
    start_proc: StartProc,
    start_uproxy: StartUproxy,
    tmp_path: Path,
    rules: str,
    mode: str,
) -> None:
    # KUBE-NODEPORT-NON-LOCAL accepts node-port traffic behind a default-deny INPUT policy;
    # it accepted a connection straight to the node port's proxy port as well.
    topo = net.topo
    for args in DEFAULT_DENY:
        topo.run(topo.node, f"iptables-{mode}", *args)
    web, _ = start(net, services, start_proc, start_uproxy, rules)
    node_port = f"http://{topo.node_ip}:{WEB_NODE_PORT}/"
    assert answered(net, topo.outside, node_port, tmp_path) <= {"web-1", "web-2"}
    assert connect_times_out(topo, topo.outside, f"http://{topo.node_ip}:{web}/")
    assert connect_times_out(topo, net.node_b, f"http://{topo.node_ip}:{web}/")
    assert answered(net, net.node_b, node_port, tmp_path) <= {"web-1", "web-2"}


@pytest.mark.parametrize("net", [DUAL_STACK], indirect=True)
@pytest.mark.parametrize("rules", ["auto", "nftables"], ids=["restore", "nftables"])
def test_an_ipv6_proxy_port_answers_through_the_portals_only(
    net: Cluster,
    services: ServicesFile,
    start_proc: StartProc,
    start_uproxy: StartUproxy,
    tmp_path: Path,
    rules: str,
) -> None:
    """The same in the IPv6 family (ip6tables, the ip6 table): its proxy port answers a pod
    through the IPv6 ClusterIP and the node itself, never a client straight to it."""
    topo = net.topo
    start_proc(topo.backend, backend_argv(net), ready_line=True)
    services.put(*dual_web(net))
    services.write()
    proxy = start_uproxy(rules, extra=PORT_RANGE)
    proxy.wait_synced()
    port = proxy.proxy_ports(ipv6=True)[(WEB, "cluster")]
    backends6 = {"web6-1", "web6-2"}
    assert answered(net, topo.pod, url(WEB_IP6), tmp_path) <= backends6
    direct = url(topo.node_ip6, port)
    assert connect_times_out(topo, topo.outside, direct), direct
    assert connect_times_out(topo, topo.pod, direct), direct
    assert answered(net, topo.node, direct, tmp_path) <= backends6
