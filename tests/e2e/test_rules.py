"""Issue 4: the rules uproxy installs, how they repair and how they go (both backends).

The expected rules are written out here by hand from the documented chain layout, with the
proxy ports uproxy reported opening (``--proxy-port-range`` keeps them in a small range), and
compared with ``iptables-save`` of the node: exactly these chains, exactly these rules.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import wait_for_sync
from tests.e2e.cluster import Cluster
from tests.e2e.conftest import DUAL_STACK, StartProc, StartUproxy
from tests.e2e.harness import (
    ServicesFile,
    curl,
    curl_status,
    dig,
    slice_endpoint,
    wait_until_ok,
)
from tests.e2e.manifests import (
    DNS_ANSWER,
    DNS_IP,
    DNS_NAME,
    EXTERNAL_IP,
    LB_IP,
    WEB_IP,
    WEB_NODE_PORT,
    WEB_PORT,
    backend_argv,
    dns,
    dnsmasq_argv,
    lb_web,
    web_service,
    web_slice,
)
from tests.e2e.saved import Tables, save
from tests.factories import endpoint_slice, service
from tests.netns.helpers import STAMP_MASKED, nft, nft_normalised
from uproxy.rules.nftables import Store

pytestmark = [pytest.mark.root]

Obj = dict[str, Any]

# (--rules, the iptables variant it writes to)
RULES = [
    pytest.param("auto", "nft", id="restore"),
    pytest.param("iptables", "legacy", id="python-iptables"),
]
PORT_RANGE = "40000-40019"
REFUSED = 7  # curl: could not connect (an ICMP port unreachable, or a RST to the SYN)
WEB_IP6 = "fd00:10:96::10"
EXTERNAL_IP6 = "2001:db8::10"

PORTALS_JUMP = (
    '-m comment --comment "handle ClusterIPs; NOTE: this must be before the NodePort rules" '
    "-j {chain}"
)
NODEPORTS_JUMP = (
    "-m addrtype --dst-type LOCAL -m comment --comment "
    '"handle service NodePorts; NOTE: this must be the last rule in the chain" -j {chain}'
)
NON_LOCAL_JUMP = '-m comment --comment "Ensure that non-local NodePort traffic can flow" -j {chain}'
FIREWALL_JUMP = (
    "-m conntrack --ctstate NEW -m comment --comment "
    '"drop LoadBalancer traffic from outside its loadBalancerSourceRanges" -j KUBE-PORTALS-FIREWALL'
)
# One per protocol, for the proxy port range only (--proxy-port-range here).
DIRECT_JUMP = (
    "-p {proto} -m {proto} --dport 40000:40019 "
    "-m conntrack --ctstate NEW -m conntrack ! --ctstate DNAT -m addrtype ! --src-type LOCAL "
    '-m comment --comment "drop new connections to proxy ports that no portal translated" '
    "-j KUBE-PORTALS-DIRECT"
)
REJECT_JUMP = (
    "-m conntrack --ctstate NEW -m comment --comment "
    '"turn away new connections to proxy ports without endpoints" -j KUBE-PORTALS-REJECT'
)


def refused(service: str, port: int, *, proto: str = "tcp", family: int = 4) -> str:
    """The filter rule rejecting new connections to ``service``'s proxy ``port``: it has no
    usable endpoint (of that family). TCP with a RST, UDP with an ICMP port unreachable."""
    icmp = "icmp6-port-unreachable" if family == 6 else "icmp-port-unreachable"
    return (
        f'-p {proto} -m comment --comment "{service} has no endpoints" -m {proto} --dport {port} '
        f"-j REJECT --reject-with {'tcp-reset' if proto == 'tcp' else icmp}"
    )


def dropped(service: str, port: int, *, proto: str = "tcp") -> str:
    """The filter rule dropping them: endpoints, none for this port's traffic (Local)."""
    return (
        f'-p {proto} -m comment --comment "{service} has no local endpoints" -m {proto} '
        f"--dport {port} -j DROP"
    )


def direct(proto: str, *ports: int) -> str:
    """The filter rule dropping new connections straight to these proxy ports (no portal
    translated them): one per protocol here, with few ports."""
    return (
        f'-p {proto} -m comment --comment "proxy ports are reached through the portals only" '
        f"-m multiport --dports {','.join(map(str, sorted(ports)))} -j DROP"
    )


# First in both host chains: uproxy's own dials (--dial-mark, 0x1000 by default) leave at once.
MARK_RETURN = (
    '-m mark --mark 0x1000/0x1000 -m comment --comment "uproxy dials to endpoints skip the portals" '
    "-j RETURN"
)


def expected_tables(
    node_ip: str,
    *,
    web: int | None,
    dns_port: int | None,
    family: int = 4,
    refusals: tuple[str, ...] = (),
) -> Tables:
    """What the node's nat and filter tables of one family must hold (and nothing else).

    IPv6 (``family=6``, ip6tables): the web service's IPv6 ClusterIP and externalIP, and its
    node port on the node's IPv6 addresses; its LoadBalancer IP and the DNS service are IPv4
    only, so they have no IPv6 rules. ``refusals``: the proxy ports without endpoints
    (``refused``, ``dropped``).
    """
    v6 = family == 6
    cidr = "128" if v6 else "32"
    to = f"[{node_ip}]" if v6 else node_ip
    web_ip, external_ip = (WEB_IP6, EXTERNAL_IP6) if v6 else (WEB_IP, EXTERNAL_IP)
    container: list[str] = []
    host: list[str] = [MARK_RETURN]
    np_container: list[str] = []
    np_host: list[str] = [MARK_RETURN]
    non_local: list[str] = []
    drops: list[str] = []
    if dns_port is not None and not v6:
        m = f'-d {DNS_IP}/32 -p udp -m comment --comment "default/dns:dns" -m udp --dport 53'
        container.append(f"{m} -j REDIRECT --to-ports {dns_port}")
        host.append(f"{m} -j DNAT --to-destination {node_ip}:{dns_port}")
        drops.append(direct("udp", dns_port))
    if web is not None:
        c = '-p tcp -m comment --comment "default/web:http" -m tcp'
        redirect = f"-j REDIRECT --to-ports {web}"
        dnat = f"-j DNAT --to-destination {to}:{web}"
        container += [
            f"-d {web_ip}/{cidr} {c} --dport 80 {redirect}",
            f"-d {external_ip}/{cidr} {c} --dport 80 -m physdev ! --physdev-is-in {redirect}",
            f"-d {external_ip}/{cidr} {c} --dport 80 -m addrtype --dst-type LOCAL {redirect}",
        ]
        host += [
            f"-d {web_ip}/{cidr} {c} --dport 80 {dnat}",
            f"-d {external_ip}/{cidr} {c} --dport 80 -m addrtype --dst-type LOCAL {dnat}",
        ]
        if not v6:
            container.append(f"-d {LB_IP}/32 {c} --dport 80 {redirect}")
            host.append(f"-d {LB_IP}/32 {c} --dport 80 {dnat}")
        np_container.append(f"{c} --dport {WEB_NODE_PORT} {redirect}")
        np_host.append(f"{c} --dport {WEB_NODE_PORT} {dnat}")
        non_local.append(
            f"{c} --dport {web} -m state --state NEW -m conntrack --ctstate DNAT -j ACCEPT"
        )
        drops.insert(0, direct("tcp", web))
    policy = ["policy ACCEPT"]
    return {
        "nat": {
            "PREROUTING": [
                *policy,
                PORTALS_JUMP.format(chain="KUBE-PORTALS-CONTAINER"),
                NODEPORTS_JUMP.format(chain="KUBE-NODEPORT-CONTAINER"),
            ],
            "INPUT": policy,
            "OUTPUT": [
                *policy,
                PORTALS_JUMP.format(chain="KUBE-PORTALS-HOST"),
                NODEPORTS_JUMP.format(chain="KUBE-NODEPORT-HOST"),
            ],
            "POSTROUTING": policy,
            "KUBE-PORTALS-CONTAINER": container,
            "KUBE-PORTALS-HOST": host,
            "KUBE-NODEPORT-CONTAINER": np_container,
            "KUBE-NODEPORT-HOST": np_host,
        },
        "filter": {
            "INPUT": [
                *policy,
                DIRECT_JUMP.format(proto="tcp"),
                DIRECT_JUMP.format(proto="udp"),
                FIREWALL_JUMP,
                REJECT_JUMP,
                NON_LOCAL_JUMP.format(chain="KUBE-NODEPORT-NON-LOCAL"),
            ],
            "FORWARD": [*policy, FIREWALL_JUMP],
            "OUTPUT": policy,
            "KUBE-NODEPORT-NON-LOCAL": non_local,
            "KUBE-PORTALS-FIREWALL": [],
            "KUBE-PORTALS-REJECT": list(refusals),
            "KUBE-PORTALS-DIRECT": drops,
        },
    }


def comparable(tables: Tables) -> Tables:
    """Rule order matters in built-in chains (portals first, node ports last) and for the
    dial-mark RETURN (first); uproxy's other rules do not overlap, so their order is compared
    as a sorted list."""
    out: Tables = {}
    for name in ("nat", "filter"):
        out[name] = {}
        for chain, rules in tables.get(name, {}).items():
            if not chain.startswith("KUBE-"):
                out[name][chain] = rules
                continue
            head = rules[:1] if rules[:1] == [MARK_RETURN] else []
            out[name][chain] = head + sorted(rules[len(head) :])
    return out


def conntrack_udp(net: Cluster) -> str:
    return net.topo.run(net.topo.node, "conntrack", "-L", "-p", "udp")


def dual_stack_web(net: Cluster) -> list[Obj]:
    """``lb_web`` with an IPv6 ClusterIP and externalIP too (its LoadBalancer IP is IPv4)."""
    web_objs = lb_web(net)
    web_spec = web_objs[0]["spec"]
    web_spec["clusterIPs"] = [WEB_IP, WEB_IP6]
    web_spec["ipFamilies"] = ["IPv4", "IPv6"]
    web_spec["ipFamilyPolicy"] = "PreferDualStack"
    web_spec["externalIPs"].append(EXTERNAL_IP6)
    return web_objs


@pytest.mark.parametrize("net", [DUAL_STACK], indirect=True)
@pytest.mark.parametrize(("rules", "mode"), RULES)
def test_rules_are_exact_and_go_with_their_service(
    net: Cluster,
    services: ServicesFile,
    start_proc: StartProc,
    start_uproxy: StartUproxy,
    tmp_path: Path,
    rules: str,
    mode: str,
) -> None:
    topo = net.topo
    start_proc(topo.backend, backend_argv(net), ready_line=True)
    start_proc(topo.backend, dnsmasq_argv(topo.backend_ip))
    # A dual-stack node: iptables and ip6tables, each with its family's addresses only.
    services.put(*dual_stack_web(net), *dns(net))
    services.write()
    proxy = start_uproxy(rules, extra=["--proxy-port-range", PORT_RANGE])
    proxy.wait_synced()

    ports, ports6 = proxy.proxy_ports(), proxy.proxy_ports(ipv6=True)
    web, dns_port = ports[("default/web:http", "cluster")], ports[("default/dns:dns", "cluster")]
    web6 = ports6[("default/web:http", "cluster")]
    assert {40000 <= p <= 40019 for p in (web, dns_port, web6)} == {True}
    assert len(ports) == 2 and len(ports6) == 1, (ports, ports6)  # Cluster policies: one each
    want = expected_tables(topo.node_ip, web=web, dns_port=dns_port)
    assert comparable(save(topo, topo.node, mode)) == comparable(want)
    # The web service has IPv4 endpoints only: its IPv6 proxy port turns new connections
    # away (kube-proxy's behaviour: each family's addresses reach that family's endpoints,
    # and there are none).
    no_v6 = (refused("default/web:http", web6, family=6),)
    want6 = expected_tables(topo.node_ip6, web=web6, dns_port=dns_port, family=6, refusals=no_v6)
    assert comparable(save(topo, topo.node, mode, family=6)) == comparable(want6)

    # Traffic for both, so the UDP service leaves conntrack entries behind. The IPv6
    # ClusterIP refuses the connection (curl: "Failed to connect"), it does not accept it.
    curl(topo, topo.pod, f"http://{WEB_IP}/", body=b"x" * 1000, tmp=tmp_path)
    assert curl_status(topo, topo.pod, f"http://[{WEB_IP6}]/") == REFUSED
    wait_until_ok(lambda: dig(topo, topo.pod, DNS_IP, DNS_NAME) == DNS_ANSWER, message="dns")
    assert f"dst={DNS_IP}" in conntrack_udp(net)

    # The web service goes from the file: none of its rules remain (in either family), dns's
    # are untouched.
    started = time.time()
    services.remove("Service", "web")
    services.write()
    proxy.wait_change_synced(after=started)
    assert comparable(save(topo, topo.node, mode)) == comparable(
        expected_tables(topo.node_ip, web=None, dns_port=dns_port)
    )
    assert comparable(save(topo, topo.node, mode, family=6)) == comparable(
        expected_tables(topo.node_ip6, web=None, dns_port=None, family=6)
    )

    # The UDP service goes: its rules and its conntrack entries (to the ClusterIP) are gone.
    started = time.time()
    services.remove("Service", "dns")
    services.write()
    proxy.wait_change_synced(after=started)
    assert comparable(save(topo, topo.node, mode)) == comparable(
        expected_tables(topo.node_ip, web=None, dns_port=None)
    )
    assert f"dst={DNS_IP}" not in conntrack_udp(net)


@pytest.mark.parametrize(("rules", "mode"), RULES)
def test_flushed_nat_table_is_repaired_within_5s(
    net: Cluster,
    services: ServicesFile,
    start_proc: StartProc,
    start_uproxy: StartUproxy,
    tmp_path: Path,
    rules: str,
    mode: str,
) -> None:
    topo = net.topo
    start_proc(topo.backend, backend_argv(net), ready_line=True)
    services.put(*lb_web(net))
    services.write()
    proxy = start_uproxy(rules)
    proxy.wait_synced()
    url = f"http://{WEB_IP}/"
    curl(topo, topo.pod, url, body=b"before", tmp=tmp_path)

    def flush() -> float:
        """Another program flushes the nat table and deletes every non-built-in chain."""
        topo.run(topo.node, f"iptables-{mode}", "-t", "nat", "-F")
        topo.run(topo.node, f"iptables-{mode}", "-t", "nat", "-X")
        assert "KUBE-PORTALS-CONTAINER" not in save(topo, topo.node, mode)["nat"]
        return time.monotonic()

    def repaired() -> int:
        return sum("Rules missing" in line for line in proxy.proc.stderr_lines)

    def traffic_flows() -> object:
        return curl(topo, topo.pod, url, body=b"after", tmp=tmp_path, max_time=0.5)

    def chains_back() -> bool:
        return "KUBE-PORTALS-CONTAINER" in save(topo, topo.node, mode)["nat"]

    # First flush at any moment: uproxy notices and repairs.
    flush()
    wait_for_sync(chains_back, timeout=15.0, interval=0.01, message="the first repair")
    # The worst case: flushed again right after uproxy's periodic check repaired it.
    seen = repaired()
    assert seen >= 1
    flushed = flush()
    wait_until_ok(traffic_flows, timeout=5.0, message="traffic after a flush just after a check")
    assert time.monotonic() - flushed < 5.0
    assert repaired() == seen + 1
    assert proxy.proc.popen.poll() is None


# ----- --rules nftables ------------------------------------------------------------------------

NFT_CHAINS = """\
chain portals-firewall {
type filter hook prerouting priority dstnat - 10; policy accept;
ct state new ip daddr . meta l4proto . th dport @firewalled-lb-ips ip daddr . meta l4proto . th dport . ip saddr != @lb-source-ranges drop
}
chain portals-container {
type nat hook prerouting priority dstnat - 1; policy accept;
PODS_LB
meta l4proto { tcp, udp } redirect to :ip daddr . meta l4proto . th dport map @cluster-ips
PODS
meta iifkind != "bridge" meta l4proto { tcp, udp } redirect to :ip daddr . meta l4proto . th dport map @external-ips
fib daddr type local meta l4proto { tcp, udp } redirect to :ip daddr . meta l4proto . th dport map @external-ips
}
chain portals-host {
type nat hook output priority -101; policy accept;
meta mark & 0x00001000 == 0x00001000 return comment "uproxy dials to endpoints skip the portals"
meta l4proto { tcp, udp } dnat to NODE_IP:ip daddr . meta l4proto . th dport map @short-circuit-lb-ips
meta l4proto { tcp, udp } dnat to NODE_IP:ip daddr . meta l4proto . th dport map @cluster-ips
fib daddr type local meta l4proto { tcp, udp } dnat to NODE_IP:ip daddr . meta l4proto . th dport map @short-circuit-external-ips
fib daddr type local meta l4proto { tcp, udp } dnat to NODE_IP:ip daddr . meta l4proto . th dport map @external-ips
}
chain node-ports-container {
type nat hook prerouting priority dstnat + 1; policy accept;
NODE_PORT_PODS
NPfib daddr type local meta l4proto { tcp, udp } redirect to :meta l4proto . th dport map @node-ports
}
chain node-ports-host {
type nat hook output priority -99; policy accept;
meta mark & 0x00001000 == 0x00001000 return comment "uproxy dials to endpoints skip the portals"
NPfib daddr type local meta l4proto { tcp, udp } dnat to NODE_IP:meta l4proto . th dport map @short-circuit-node-ports
NPfib daddr type local meta l4proto { tcp, udp } dnat to NODE_IP:meta l4proto . th dport map @node-ports
}
chain node-ports-filter {
type filter hook input priority filter; policy accept;
ct state new ct status dnat meta l4proto . th dport @node-port-proxy-ports accept
}
chain no-endpoints {
type filter hook input priority filter - 1; policy accept;
ct state new meta l4proto . th dport @rejected-proxy-ports reject with tcp reset
ct state new meta l4proto . th dport @rejected-proxy-ports reject
ct state new meta l4proto . th dport @dropped-proxy-ports drop
}
chain proxy-ports-direct {
type filter hook input priority filter - 2; policy accept;
ct state new ct status & dnat != dnat fib saddr type != local meta l4proto . th dport @proxy-ports drop
}
"""
PODS_LB_RULE = "PODmeta l4proto { tcp, udp } redirect to :ip daddr . meta l4proto . th dport map @short-circuit-lb-ips"
PODS_RULES = """\
PODmeta iifkind != "bridge" meta l4proto { tcp, udp } redirect to :ip daddr . meta l4proto . th dport map @short-circuit-external-ips
PODfib daddr type local meta l4proto { tcp, udp } redirect to :ip daddr . meta l4proto . th dport map @short-circuit-external-ips"""
NODE_PORT_PODS_RULE = "NPPODfib daddr type local meta l4proto { tcp, udp } redirect to :meta l4proto . th dport map @short-circuit-node-ports"


def nft_chains(node_ip: str, *, pods: str = "", nodeports: str = "", family: int = 4) -> str:
    """The chains as ``nft list`` prints them; ``pods`` and ``nodeports`` are the matches of
    --detect-local-mode and --nodeport-addresses (each "" or ending in a space). The IPv6
    table (``family=6``) matches ``ip6`` addresses and DNATs to ``[node address]``."""
    text = NFT_CHAINS
    node = node_ip
    if family == 6:
        text = text.replace("ip daddr", "ip6 daddr").replace("ip saddr", "ip6 saddr")
        node = f"[{node_ip}]"
    text = text.replace("NODE_IP", node)
    pod_rule = NODE_PORT_PODS_RULE.replace("POD", pods)
    text = text.replace("NODE_PORT_PODS\n", pod_rule + "\n" if pods else "")
    text = text.replace("PODS_LB\n", PODS_LB_RULE.replace("POD", pods) + "\n" if pods else "")
    text = text.replace("PODS\n", PODS_RULES.replace("POD", pods) + "\n" if pods else "")
    return text.replace("NP", nodeports)


ADDR_MAP = "ipv4_addr . inet_proto . inet_service : inet_service"
PORT_MAP = "inet_proto . inet_service : inet_service"


def expected_nft(
    node_ip: str,
    *,
    web: int | None,
    dns_port: int | None,
    family: int = 4,
    rejected: tuple[str, ...] = (),
) -> str:
    """``nft list table ip uproxy`` of the node (``ip6`` with ``family=6``: the web
    service's IPv6 ClusterIP, externalIP and node port), normalised like ``nft_normalised``;
    ``rejected``: the elements of the proxy ports without endpoints."""
    v6 = family == 6
    cluster: list[str] = []
    external: list[str] = []
    node_ports: list[str] = []
    proxy_ports: list[str] = []
    all_ports: list[str] = []
    if dns_port is not None and not v6:
        cluster.append(f'{DNS_IP} . udp . 53 comment "default/dns:dns" : {dns_port}')
        all_ports.append(f'udp . {dns_port} comment "default/dns:dns"')
    if web is not None:
        c = 'comment "default/web:http"'
        cluster.append(f"{WEB_IP6 if v6 else WEB_IP} . tcp . 80 {c} : {web}")
        if not v6:
            cluster.append(f"{LB_IP} . tcp . 80 {c} : {web}")
        external.append(f"{EXTERNAL_IP6 if v6 else EXTERNAL_IP} . tcp . 80 {c} : {web}")
        node_ports.append(f"tcp . {WEB_NODE_PORT} {c} : {web}")
        proxy_ports.append(f"tcp . {web} {c}")
        all_ports.append(f"tcp . {web} {c}")
    elements = {
        "cluster-ips": cluster,
        "external-ips": external,
        "node-ports": node_ports,
        "node-port-proxy-ports": proxy_ports,
        "proxy-ports": all_ports,
        "rejected-proxy-ports": list(rejected),
    }
    return nft_listing(elements, nft_chains(node_ip, family=family), family=family)


STORES = (
    ("map", "cluster-ips", ADDR_MAP),
    ("map", "external-ips", ADDR_MAP),
    ("map", "node-ports", PORT_MAP),
    ("set", "node-port-proxy-ports", "inet_proto . inet_service"),
    ("set", "proxy-ports", "inet_proto . inet_service"),
    ("map", "short-circuit-lb-ips", ADDR_MAP),
    ("map", "short-circuit-external-ips", ADDR_MAP),
    ("map", "short-circuit-node-ports", PORT_MAP),
    ("set", "firewalled-lb-ips", "ipv4_addr . inet_proto . inet_service"),
    ("set", "lb-source-ranges", "ipv4_addr . inet_proto . inet_service . ipv4_addr"),
    ("set", "rejected-proxy-ports", "inet_proto . inet_service"),
    ("set", "dropped-proxy-ports", "inet_proto . inet_service"),
)


def nft_listing(elements: dict[str, list[str]], chains: str, *, family: int = 4) -> str:
    """A whole normalised table: every map and set (with ``elements``), then ``chains``."""
    out = [f"table {'ip6' if family == 6 else 'ip'} uproxy {{"]
    for kind, name, type_ in STORES:
        if family == 6:
            type_ = type_.replace("ipv4_addr", "ipv6_addr")
        out += [f"{kind} {name} {{", f"type {type_}"]
        if name == "lb-source-ranges":
            out.append("flags interval")
        sentinel = Store(kind, name, type_).sentinel().text()
        out.append("elements = { " + ", ".join([sentinel, *elements.get(name, [])]) + " }")
        out.append("}")
    out.append(chains.rstrip("\n"))
    out += ["chain synced-by {", STAMP_MASKED, "}", "}"]
    return nft_normalised("\n".join(out))


def nft_table(net: Cluster, family: int = 4) -> str:
    table = "ip6" if family == 6 else "ip"
    return nft_normalised(nft(net.topo, "list", "table", table, "uproxy"))


@pytest.mark.parametrize("net", [DUAL_STACK], indirect=True)
def test_nft_table_is_exact_and_goes_with_its_service(
    net: Cluster,
    services: ServicesFile,
    start_proc: StartProc,
    start_uproxy: StartUproxy,
    tmp_path: Path,
) -> None:
    topo = net.topo
    start_proc(topo.backend, backend_argv(net), ready_line=True)
    start_proc(topo.backend, dnsmasq_argv(topo.backend_ip))
    services.put(*dual_stack_web(net), *dns(net))  # the IPv6 addresses: table ip6 uproxy
    services.write()
    proxy = start_uproxy("nftables", extra=["--proxy-port-range", PORT_RANGE])
    proxy.wait_synced()

    ports, ports6 = proxy.proxy_ports(), proxy.proxy_ports(ipv6=True)
    web, dns_port = ports[("default/web:http", "cluster")], ports[("default/dns:dns", "cluster")]
    web6 = ports6[("default/web:http", "cluster")]
    assert nft_table(net) == expected_nft(topo.node_ip, web=web, dns_port=dns_port)
    no_v6 = (f'tcp . {web6} comment "default/web:http has no endpoints"',)
    assert nft_table(net, 6) == expected_nft(
        topo.node_ip6, web=web6, dns_port=None, family=6, rejected=no_v6
    )
    # Nothing in iptables, either variant, either family.
    for program in ("iptables-nft", "iptables-legacy", "ip6tables-nft", "ip6tables-legacy"):
        assert "KUBE-" not in topo.run(topo.node, f"{program}-save")
    curl(topo, topo.pod, f"http://{WEB_IP}/", body=b"x" * 1000, tmp=tmp_path)
    assert curl_status(topo, topo.pod, f"http://[{WEB_IP6}]/") == REFUSED  # no IPv6 endpoints
    wait_until_ok(lambda: dig(topo, topo.pod, DNS_IP, DNS_NAME) == DNS_ANSWER, message="dns")
    assert f"dst={DNS_IP}" in conntrack_udp(net)

    started = time.time()
    services.remove("Service", "web")
    services.write()
    proxy.wait_change_synced(after=started)
    assert nft_table(net) == expected_nft(topo.node_ip, web=None, dns_port=dns_port)
    assert nft_table(net, 6) == expected_nft(topo.node_ip6, web=None, dns_port=None, family=6)

    started = time.time()
    services.remove("Service", "dns")
    services.write()
    proxy.wait_change_synced(after=started)
    assert nft_table(net) == expected_nft(topo.node_ip, web=None, dns_port=None)
    assert f"dst={DNS_IP}" not in conntrack_udp(net)


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(["delete", "table", "ip", "uproxy"], id="deleted"),
        pytest.param(["flush", "table", "ip", "uproxy"], id="flushed"),
        pytest.param(["flush", "ruleset"], id="ruleset-flushed"),
    ],
)
def test_damaged_nft_table_is_repaired_within_5s(
    net: Cluster,
    services: ServicesFile,
    start_proc: StartProc,
    start_uproxy: StartUproxy,
    tmp_path: Path,
    damage: list[str],
) -> None:
    topo = net.topo
    start_proc(topo.backend, backend_argv(net), ready_line=True)
    services.put(*lb_web(net))
    services.write()
    proxy = start_uproxy("nftables")
    proxy.wait_synced()
    url = f"http://{WEB_IP}/"
    curl(topo, topo.pod, url, body=b"before", tmp=tmp_path)
    intact = nft_table(net)

    def repaired() -> int:
        return sum("Rules missing" in line for line in proxy.proc.stderr_lines)

    def traffic_flows() -> object:
        return curl(topo, topo.pod, url, body=b"after", tmp=tmp_path, max_time=0.5)

    for attempt in (1, 2):  # twice: the second right after the first repair
        nft(topo, *damage)
        damaged = time.monotonic()
        assert "redirect" not in nft(topo, "list", "ruleset")
        wait_until_ok(traffic_flows, timeout=5.0, message=f"traffic after damage {attempt}")
        assert time.monotonic() - damaged < 5.0
        wait_for_sync(lambda: nft_table(net) == intact, timeout=5.0, message="the whole table")
        assert repaired() >= attempt
    assert proxy.proc.popen.poll() is None


# ----- uproxy's own dials ---------------------------------------------------------------------

TRAP_ANSWER = "192.0.2.99"


def trapped(net: Cluster) -> list[Obj]:
    """``web`` and ``dns`` each with one endpoint on web-1's address, plus ``trap``: a service
    whose ClusterIP *is* that address, on the same ports, with its endpoint elsewhere.

    The node's own connections to web-1's address are caught by trap's host portal. So are
    uproxy's dials to web-1, unless they skip the portals: then web-3 (and the trap's DNS
    server) answers instead of web-1.
    """
    first, _, third = net.backend_ips
    web = web_service()
    web_eps = web_slice("web-1", "web", [slice_endpoint(first)])
    dns_svc, dns_eps = dns(net)  # its endpoint is the first backend address
    trap_ports = [
        {"name": "http", "port": WEB_PORT, "protocol": "TCP", "targetPort": WEB_PORT},
        {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 53},
    ]
    trap = service("trap", cluster_ip=first, ports=trap_ports)
    slice_ports = [
        {"name": p["name"], "port": p["port"], "protocol": p["protocol"]} for p in trap_ports
    ]
    trap_eps = endpoint_slice(
        "trap-1", "trap", endpoints=[slice_endpoint(third)], ports=slice_ports
    )
    return [web, web_eps, dns_svc, dns_eps, trap, trap_eps]


@pytest.mark.parametrize(
    ("rules", "extra"),
    [
        pytest.param("auto", [], id="restore-nft"),
        pytest.param("auto", ["--iptables-mode", "legacy"], id="restore-legacy"),
        pytest.param("iptables", [], id="python-iptables"),
        pytest.param("nftables", [], id="nftables"),
    ],
)
@pytest.mark.parametrize("dial_mark", ["0x1000", "0"], ids=["marked", "unmarked"])
def test_own_dials_never_walk_the_portals(
    net: Cluster,
    services: ServicesFile,
    start_proc: StartProc,
    start_uproxy: StartUproxy,
    tmp_path: Path,
    rules: str,
    extra: list[str],
    dial_mark: str,
) -> None:
    topo = net.topo
    first, _, third = net.backend_ips
    start_proc(topo.backend, backend_argv(net), ready_line=True)
    start_proc(topo.backend, dnsmasq_argv(first))
    start_proc(topo.backend, dnsmasq_argv(third, answer=TRAP_ANSWER))
    for ip, answer in ((first, DNS_ANSWER), (third, TRAP_ANSWER)):
        wait_until_ok(
            lambda ip=ip, answer=answer: dig(topo, topo.backend, ip, DNS_NAME) == answer,
            message=f"dnsmasq on {ip}",
        )
    services.put(*trapped(net))
    services.write()
    proxy = start_uproxy(rules, extra=[*extra, "--dial-mark", dial_mark])
    proxy.wait_synced()

    # The trap works: the node's own connections to web-1's address end up at web-3.
    own = curl(topo, topo.node, f"http://{first}:{WEB_PORT}/", body=b"own", tmp=tmp_path, count=2)
    assert {a.name for a in own} == {"web-3"}
    assert dig(topo, topo.node, first, DNS_NAME) == TRAP_ANSWER
    # uproxy's dials to web-1 (TCP) and to the DNS server (a UDP flow socket) from a pod's
    # request: with the mark they return before any portal and reach their endpoint; without
    # it they walk the host portals and fall into the trap.
    if dial_mark == "0":
        expected_name, expected_answer = "web-3", TRAP_ANSWER
    else:
        expected_name, expected_answer = "web-1", DNS_ANSWER
    proxied = curl(topo, topo.pod, f"http://{WEB_IP}/", body=b"dial", tmp=tmp_path, count=3)
    assert {a.name for a in proxied} == {expected_name}
    assert dig(topo, topo.pod, DNS_IP, DNS_NAME) == expected_answer
