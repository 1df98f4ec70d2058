"""Issue 12: dual-stack. Each family's service addresses reach that family's endpoints, in
every rules backend; IPv6 works as IPv4 does, from a pod, the node and outside, over TCP and
UDP.

The cluster is dual-stack (ULA addresses beside the IPv4 ones, see ``tests.e2e.cluster``).
Backends answer with their name, ``web-N`` on IPv4 and ``web6-N`` on IPv6, and the DNS server
on the backend's IPv6 address answers differently from the one on its IPv4 address: every
answer says which family's endpoint served it. ``dig`` discards an answer that does not come
from the address it asked, so every IPv6 UDP answer through a REDIRECT also shows that the
reply left from the address the datagram was delivered to (IPV6_PKTINFO).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.cluster import Cluster
from tests.e2e.conftest import DUAL_STACK, StartProc, StartUproxy
from tests.e2e.harness import (
    ServicesFile,
    curl,
    curl_raw,
    curl_status,
    dig,
    slice_endpoint,
    url,
    wait_until_ok,
)
from tests.e2e.manifests import (
    DNS_ANSWER,
    DNS_ANSWER6,
    DNS_IP,
    DNS_IP6,
    DNS_NAME,
    DNS_NODE_PORT,
    EXTERNAL_IP6,
    LB_IP6,
    WEB6_NODE_PORT,
    WEB6_ONLY_IP,
    WEB_IP,
    WEB_IP6,
    WEB_NODE_PORT,
    backend_argv,
    dnsmasq_argv,
    dual,
    dual_dns,
    dual_web,
    web6_only,
    web_service,
    web_slice,
)
from tests.netns.helpers import nft

pytestmark = [pytest.mark.root, pytest.mark.parametrize("net", [DUAL_STACK], indirect=True)]

# (--rules and options, the iptables variant written; None: nftables)
RULES = [
    pytest.param(["auto"], "nft", id="restore"),
    pytest.param(["iptables"], "legacy", id="python-iptables"),
    pytest.param(["nftables"], None, id="nftables"),
]
WEB = {"web-1", "web-2"}
WEB6 = {"web6-1", "web6-2"}
HC_PORT = 32000
HC4_PORT = 32001


def local_policy(net: Cluster) -> list[dict[str, object]]:
    """A dual-stack ``externalTrafficPolicy: Local`` service with a health-check node port:
    two local endpoints in its IPv4 slice, one in its IPv6 slice."""
    svc = web_service("hc", cluster_ip="10.96.0.12", type="LoadBalancer")
    dual(svc, "10.96.0.12", "fd00:10:96::12")["spec"].update(
        externalTrafficPolicy="Local", healthCheckNodePort=HC_PORT
    )
    svc["spec"]["ports"][0]["nodePort"] = 30082
    v4 = web_slice("hc-v4", "hc", [slice_endpoint(ip) for ip in net.backend_ips[:2]])
    v6 = web_slice("hc-v6", "hc", [slice_endpoint(net.backend_ips6[0])])
    v6["addressType"] = "IPv6"
    return [svc, v4, v6]


def local_policy_v4_only(net: Cluster) -> list[dict[str, object]]:
    """An IPv4-only ``externalTrafficPolicy: Local`` service with a health-check node port
    and two local endpoints: a load balancer may check it over either family."""
    svc = web_service("hc4", cluster_ip="10.96.0.13", type="LoadBalancer")
    svc["spec"].update(externalTrafficPolicy="Local", healthCheckNodePort=HC4_PORT)
    svc["spec"]["ports"][0]["nodePort"] = 30083
    return [svc, web_slice("hc4-v4", "hc4", [slice_endpoint(ip) for ip in net.backend_ips[:2]])]


def start_backends(net: Cluster, start_proc: StartProc) -> None:
    topo = net.topo
    start_proc(topo.backend, backend_argv(net), ready_line=True)
    start_proc(topo.backend, dnsmasq_argv(topo.backend_ip))
    start_proc(topo.backend, dnsmasq_argv(topo.backend_ip6, answer=DNS_ANSWER6))
    for ip, answer in ((topo.backend_ip, DNS_ANSWER), (topo.backend_ip6, DNS_ANSWER6)):
        wait_until_ok(
            lambda ip=ip, answer=answer: dig(topo, topo.backend, ip, DNS_NAME) == answer,
            message=f"dnsmasq on {ip}",
        )


def names(net: Cluster, ns: str, target: str, tmp: Path, count: int = 4) -> set[str]:
    return {a.name for a in curl(net.topo, ns, target, body=b"family", tmp=tmp, count=count)}


def rules_text(net: Cluster, mode: str | None, family: int) -> str:
    """What the node's rules of one family say (iptables-save, or uproxy's nft table)."""
    topo = net.topo
    if mode is None:
        return nft(topo, "list", "table", "ip" if family == 4 else "ip6", "uproxy")
    return topo.run(topo.node, f"{'ip' if family == 4 else 'ip6'}tables-{mode}-save")


@pytest.mark.parametrize(
    ("rules", "mode"),
    [
        *RULES,
        # An unspecified --bind-address is kube-proxy's primary family: both are served.
        pytest.param(["auto", "--bind-address", "0.0.0.0"], "nft", id="restore-bind-0.0.0.0"),
        pytest.param(["nftables", "--bind-address", "::"], None, id="nftables-bind-::"),
    ],
)
def test_dual_stack_service_in_both_families_and_an_ipv6_only_one(
    net: Cluster,
    services: ServicesFile,
    start_proc: StartProc,
    start_uproxy: StartUproxy,
    tmp_path: Path,
    rules: list[str],
    mode: str | None,
) -> None:
    topo = net.topo
    start_backends(net, start_proc)
    services.put(*dual_web(net), *dual_dns(net), *web6_only(net), *local_policy(net))
    services.put(*local_policy_v4_only(net))
    services.write()
    proxy = start_uproxy(rules[0], extra=rules[1:])
    proxy.wait_synced()
    served = [line for line in proxy.proc.stderr_lines if "Serving IP families" in line]
    order = "IPv6,IPv4" if "::" in rules else "IPv4,IPv6"  # the primary family first
    assert served and f'families="{order}"' in served[0], served
    # Listeners per family: the dual-stack services in both, the IPv6-only one in IPv6.
    v4, v6 = proxy.proxy_ports(), proxy.proxy_ports(ipv6=True)
    dual_stack = {"default/web:http", "default/dns:dns", "default/hc:http"}
    assert {s for s, _ in v4} == {*dual_stack, "default/hc4:http"}
    assert set(v6) == {p for p in v4 if p[0] in dual_stack} | {("default/web6:http", "cluster")}

    # From a pod: each ClusterIP reaches its own family's endpoints, round robin over both.
    assert names(net, topo.pod, url(WEB_IP), tmp_path) == WEB
    assert names(net, topo.pod, url(WEB_IP6), tmp_path) == WEB6
    # From the node itself: DNAT to the node's own address of each family.
    assert names(net, topo.node, url(WEB_IP), tmp_path, 3) == WEB
    assert names(net, topo.node, url(WEB_IP6), tmp_path, 3) == WEB6
    # From outside: the node port on the node's address of each family, and the IPv6
    # externalIP and LoadBalancer IP.
    assert names(net, topo.outside, url(topo.node_ip, WEB_NODE_PORT), tmp_path, 3) == WEB
    for target in (url(topo.node_ip6, WEB_NODE_PORT), url(EXTERNAL_IP6), url(LB_IP6)):
        assert names(net, topo.outside, target, tmp_path, 3) == WEB6, target
    # UDP over each family: the IPv6 ClusterIP reaches the IPv6 DNS server only.
    for ns in (topo.pod, topo.node):
        assert dig(topo, ns, DNS_IP, DNS_NAME) == DNS_ANSWER
        assert dig(topo, ns, DNS_IP6, DNS_NAME) == DNS_ANSWER6
    assert dig(topo, topo.outside, topo.node_ip6, DNS_NAME, port=DNS_NODE_PORT) == DNS_ANSWER6
    assert dig(topo, topo.outside, LB_IP6, DNS_NAME) == DNS_ANSWER6

    # The IPv6-only service: reached over IPv6, its rules in the IPv6 family only.
    assert names(net, topo.pod, url(WEB6_ONLY_IP), tmp_path, 2) == {"web6-3"}
    assert names(net, topo.outside, url(topo.node_ip6, WEB6_NODE_PORT), tmp_path, 2) == {"web6-3"}
    assert "default/web6:http" in rules_text(net, mode, 6)
    assert "default/web6:http" not in rules_text(net, mode, 4)
    # Its node port is not open on IPv4 (kube-proxy ignores a service in a family it has no
    # ClusterIP of), and nothing else of the IPv4 family answers it either.
    assert curl_status(topo, topo.outside, url(topo.node_ip, WEB6_NODE_PORT)) != 0
    assert not [line for line in proxy.proc.stderr_lines if "not proxied" in line]

    # The health-check node port counts each family's local endpoints, as kube-proxy's
    # per-family proxiers do: a check over IPv6 sees the one IPv6 endpoint.
    for ip, count in ((topo.node_ip, 2), (topo.node_ip6, 1)):
        status, _, body = curl_raw(topo, topo.outside, url(ip, HC_PORT))
        assert status == 200 and f'"localEndpoints": {count},' in body, (ip, body)
    # A single-stack service's count answers checks over either family, as kube-proxy's one
    # listener for both families does: over IPv6 it used to be 503, "localEndpoints": 0.
    for ip in (topo.node_ip, topo.node_ip6):
        status, _, body = curl_raw(topo, topo.outside, url(ip, HC4_PORT))
        assert status == 200 and '"localEndpoints": 2,' in body, (ip, body)


@pytest.mark.parametrize(("rules", "mode"), RULES)
def test_ipv6_only_node(
    net: Cluster,
    services: ServicesFile,
    start_proc: StartProc,
    start_uproxy: StartUproxy,
    tmp_path: Path,
    rules: list[str],
    mode: str | None,
) -> None:
    """``--bind-address`` the node's IPv6 address: uproxy serves IPv6 alone, on that address,
    as it serves IPv4 alone on an IPv4 node; a dual-stack service is proxied on its IPv6
    addresses."""
    topo = net.topo
    start_backends(net, start_proc)
    services.put(*dual_web(net), *dual_dns(net), *web6_only(net))
    services.write()
    proxy = start_uproxy(rules[0], extra=[*rules[1:], "--bind-address", topo.node_ip6])
    proxy.wait_synced()

    assert names(net, topo.pod, url(WEB_IP6), tmp_path) == WEB6
    assert names(net, topo.node, url(WEB6_ONLY_IP), tmp_path, 2) == {"web6-3"}
    assert names(net, topo.outside, url(topo.node_ip6, WEB_NODE_PORT), tmp_path, 3) == WEB6
    assert dig(topo, topo.pod, DNS_IP6, DNS_NAME) == DNS_ANSWER6
    # Nothing in the IPv4 family: no rules, the IPv4 ClusterIP goes nowhere.
    if mode is None:
        assert "table ip uproxy" not in nft(topo, "list", "tables")
    else:
        assert "KUBE-PORTALS" not in topo.run(topo.node, f"iptables-{mode}-save")
    assert curl_status(topo, topo.pod, url(WEB_IP)) != 0
    served = [line for line in proxy.proc.stderr_lines if "Serving IP families" in line]
    assert served and 'families="IPv6"' in served[0], served
