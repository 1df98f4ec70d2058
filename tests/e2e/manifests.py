"""The services the end-to-end tests proxy, and the backends behind them.

Backends name themselves (``web-1``…), so a test can tell which endpoint answered; their
addresses and ports are fixed, the EndpointSlices point at them.
"""

from __future__ import annotations

from typing import Any

from tests.e2e.cluster import Cluster
from tests.e2e.harness import slice_endpoint
from tests.factories import endpoint_slice, service

Obj = dict[str, Any]

WEB_IP = "10.96.0.10"
DNS_IP = "10.96.0.53"
SUM_IP = "10.96.0.20"
EXTERNAL_IP = "203.0.113.10"
LB_IP = "203.0.113.20"
WEB_NODE_PORT = 30080
WEB_PORT = 8080  # every http backend
SUM_PORT = 9000  # every sum backend
DNS_NAME = "www.svc.test"
DNS_ANSWER = "192.0.2.53"


def backend_argv(net: Cluster) -> list[str]:
    """The servers module serving ``web-N`` (http) and ``sum-N`` on every backend address;
    on a dual-stack cluster also ``web6-N`` and ``sum6-N`` on the same backends' IPv6
    addresses (so an answer tells which family's endpoint served it)."""
    import sys

    specs = []
    for i, ip in enumerate(net.backend_ips, start=1):
        specs += [f"web-{i}={ip}:{WEB_PORT}:http", f"sum-{i}={ip}:{SUM_PORT}:sum"]
    for i, ip in enumerate(net.backend_ips6, start=1):
        specs += [f"web6-{i}={ip}:{WEB_PORT}:http", f"sum6-{i}={ip}:{SUM_PORT}:sum"]
    return [sys.executable, "-m", "tests.e2e.servers", *specs]


def dnsmasq_argv(ip: str, *, answer: str = DNS_ANSWER) -> list[str]:
    return [
        "dnsmasq",
        "--no-daemon",
        "--conf-file=/dev/null",
        "--pid-file=",
        "--user=root",
        "--port=53",
        f"--listen-address={ip}",
        "--bind-interfaces",
        "--no-resolv",
        "--no-hosts",
        f"--address=/svc.test/{answer}",
    ]


def web_service(name: str = "web", *, cluster_ip: str = WEB_IP, **spec: Any) -> Obj:
    return service(
        name,
        cluster_ip=cluster_ip,
        ports=[{"name": "http", "port": 80, "protocol": "TCP", "targetPort": WEB_PORT}],
        **spec,
    )


def web_slice(name: str, service_name: str, endpoints: list[Obj]) -> Obj:
    return endpoint_slice(
        name,
        service_name,
        endpoints=endpoints,
        ports=[{"name": "http", "port": WEB_PORT, "protocol": "TCP"}],
    )


def lb_web(net: Cluster) -> list[Obj]:
    """A LoadBalancer service with a NodePort, an externalIP and an ingress IP; two endpoints."""
    svc = web_service(type="LoadBalancer", externalIPs=[EXTERNAL_IP])
    svc["spec"]["ports"][0]["nodePort"] = WEB_NODE_PORT
    svc["status"] = {"loadBalancer": {"ingress": [{"ip": LB_IP}]}}
    eps = [slice_endpoint(ip) for ip in net.backend_ips[:2]]
    return [svc, web_slice("web-1", "web", eps)]


def dns(net: Cluster) -> list[Obj]:
    svc = service(
        "dns",
        cluster_ip=DNS_IP,
        ports=[{"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 53}],
    )
    eps = endpoint_slice(
        "dns-1",
        "dns",
        endpoints=[slice_endpoint(net.topo.backend_ip)],
        ports=[{"name": "dns", "port": 53, "protocol": "UDP"}],
    )
    return [svc, eps]


def sum_service(net: Cluster, *, endpoints: int = 1) -> list[Obj]:
    svc = service(
        "sum",
        cluster_ip=SUM_IP,
        ports=[{"name": "raw", "port": 9000, "protocol": "TCP", "targetPort": SUM_PORT}],
    )
    eps = endpoint_slice(
        "sum-1",
        "sum",
        endpoints=[slice_endpoint(ip) for ip in net.backend_ips[:endpoints]],
        ports=[{"name": "raw", "port": SUM_PORT, "protocol": "TCP"}],
    )
    return [svc, eps]


DNS_NODE_PORT = 30053


def lb_dns(net: Cluster) -> list[Obj]:
    """The DNS service as a LoadBalancer: UDP on a node port, the externalIP and the ingress IP
    (the same addresses as ``lb_web``, another protocol and port)."""
    svc, eps = dns(net)
    svc["spec"].update(type="LoadBalancer", externalIPs=[EXTERNAL_IP])
    svc["spec"]["ports"][0]["nodePort"] = DNS_NODE_PORT
    svc["status"] = {"loadBalancer": {"ingress": [{"ip": LB_IP}]}}
    return [svc, eps]


# ----- dual-stack ------------------------------------------------------------------------------

WEB_IP6 = "fd00:10:96::10"
DNS_IP6 = "fd00:10:96::53"
WEB6_ONLY_IP = "fd00:10:96::11"
EXTERNAL_IP6 = "2001:db8::10"
LB_IP6 = "2001:db8::20"
DNS_ANSWER6 = "192.0.2.66"  # what the DNS server on the backend's IPv6 address answers
WEB6_NODE_PORT = 30081


def dual(svc: Obj, v4: str, v6: str) -> Obj:
    """Make ``svc`` dual-stack, IPv4 first (the cluster's primary family)."""
    spec = svc["spec"]
    spec.update(
        clusterIP=v4, clusterIPs=[v4, v6], ipFamilies=["IPv4", "IPv6"],
        ipFamilyPolicy="RequireDualStack",
    )  # fmt: skip
    return svc


def dual_web(net: Cluster) -> list[Obj]:
    """``lb_web`` in both families: ClusterIPs, externalIPs and ingress IPs of each, one node
    port; its IPv4 slice lists web-1 and web-2, its IPv6 slice web6-1 and web6-2."""
    svc, v4_slice = lb_web(net)
    dual(svc, WEB_IP, WEB_IP6)["spec"]["externalIPs"] = [EXTERNAL_IP, EXTERNAL_IP6]
    svc["status"] = {"loadBalancer": {"ingress": [{"ip": LB_IP}, {"ip": LB_IP6}]}}
    eps = [slice_endpoint(ip) for ip in net.backend_ips6[:2]]
    v6_slice = web_slice("web-v6", "web", eps)
    v6_slice["addressType"] = "IPv6"
    return [svc, v4_slice, v6_slice]


def dual_dns(net: Cluster) -> list[Obj]:
    """``lb_dns`` in both families: the IPv6 ClusterIP and node port reach the DNS server on
    the backend's IPv6 address (it answers ``DNS_ANSWER6``)."""
    svc, v4_slice = lb_dns(net)
    dual(svc, DNS_IP, DNS_IP6)
    svc["status"] = {"loadBalancer": {"ingress": [{"ip": LB_IP}, {"ip": LB_IP6}]}}
    v6_slice = endpoint_slice(
        "dns-v6",
        "dns",
        endpoints=[slice_endpoint(net.topo.backend_ip6)],
        ports=[{"name": "dns", "port": 53, "protocol": "UDP"}],
        address_type="IPv6",
    )
    return [svc, v4_slice, v6_slice]


def web6_only(net: Cluster) -> list[Obj]:
    """An IPv6-only service (its ClusterIP, node port and endpoint all IPv6): web6-3."""
    svc = web_service("web6", cluster_ip=WEB6_ONLY_IP, type="NodePort")
    svc["spec"].update(clusterIPs=[WEB6_ONLY_IP], ipFamilies=["IPv6"])
    svc["spec"]["ports"][0]["nodePort"] = WEB6_NODE_PORT
    eps = web_slice("web6-1", "web6", [slice_endpoint(net.backend_ips6[2])])
    eps["addressType"] = "IPv6"
    return [svc, eps]
