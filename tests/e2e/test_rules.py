"""Issue 4: the rules uproxy installs, how they repair and how they go (both backends).

The expected rules are written out here by hand from the documented chain layout, with the
proxy ports uproxy reported opening (``--proxy-port-range`` keeps them in a small range), and
compared with ``iptables-save`` of the node: exactly these chains, exactly these rules.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.conftest import wait_for_sync
from tests.e2e.cluster import Cluster
from tests.e2e.conftest import StartProc, StartUproxy
from tests.e2e.harness import ServicesFile, curl, dig, wait_until_ok
from tests.e2e.manifests import (
    DNS_ANSWER,
    DNS_IP,
    DNS_NAME,
    EXTERNAL_IP,
    LB_IP,
    WEB_IP,
    WEB_NODE_PORT,
    backend_argv,
    dns,
    dnsmasq_argv,
    lb_web,
)
from tests.e2e.saved import Tables, save

pytestmark = [pytest.mark.root]

# (--rules, the iptables variant it writes to)
RULES = [
    pytest.param("auto", "nft", id="restore"),
    pytest.param("iptables", "legacy", id="python-iptables"),
]
PORT_RANGE = "40000-40019"
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


def expected_tables(node_ip: str, *, web: int | None, dns_port: int | None) -> Tables:
    """What the node's nat and filter tables must hold (and nothing else)."""
    container: list[str] = []
    host: list[str] = []
    np_container: list[str] = []
    np_host: list[str] = []
    non_local: list[str] = []
    if dns_port is not None:
        m = f'-d {DNS_IP}/32 -p udp -m comment --comment "default/dns:dns" -m udp --dport 53'
        container.append(f"{m} -j REDIRECT --to-ports {dns_port}")
        host.append(f"{m} -j DNAT --to-destination {node_ip}:{dns_port}")
    if web is not None:
        c = '-p tcp -m comment --comment "default/web:http" -m tcp'
        redirect = f"-j REDIRECT --to-ports {web}"
        dnat = f"-j DNAT --to-destination {node_ip}:{web}"
        container += [
            f"-d {WEB_IP}/32 {c} --dport 80 {redirect}",
            f"-d {EXTERNAL_IP}/32 {c} --dport 80 -m physdev ! --physdev-is-in {redirect}",
            f"-d {EXTERNAL_IP}/32 {c} --dport 80 -m addrtype --dst-type LOCAL {redirect}",
            f"-d {LB_IP}/32 {c} --dport 80 {redirect}",
        ]
        host += [
            f"-d {WEB_IP}/32 {c} --dport 80 {dnat}",
            f"-d {EXTERNAL_IP}/32 {c} --dport 80 -m addrtype --dst-type LOCAL {dnat}",
            f"-d {LB_IP}/32 {c} --dport 80 {dnat}",
        ]
        np_container.append(f"{c} --dport {WEB_NODE_PORT} {redirect}")
        np_host.append(f"{c} --dport {WEB_NODE_PORT} {dnat}")
        non_local.append(f"{c} --dport {web} -m state --state NEW -j ACCEPT")
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
            "INPUT": [*policy, NON_LOCAL_JUMP.format(chain="KUBE-NODEPORT-NON-LOCAL")],
            "FORWARD": policy,
            "OUTPUT": policy,
            "KUBE-NODEPORT-NON-LOCAL": non_local,
        },
    }


def comparable(tables: Tables) -> Tables:
    """Rule order matters in built-in chains (portals first, node ports last); uproxy's own
    chains hold non-overlapping rules, so their order is compared as a sorted list."""
    out: Tables = {}
    for name in ("nat", "filter"):
        out[name] = {
            chain: rules if chain.isupper() and not chain.startswith("KUBE-") else sorted(rules)
            for chain, rules in tables.get(name, {}).items()
        }
    return out


def conntrack_udp(net: Cluster) -> str:
    return net.topo.run(net.topo.node, "conntrack", "-L", "-p", "udp")


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
    web_objs = lb_web(net)
    # Dual-stack: the IPv6 addresses get no rules (IPv4 iptables), and must not break the
    # commit for every other rule either.
    web_spec = web_objs[0]["spec"]
    web_spec["clusterIPs"] = [WEB_IP, WEB_IP6]
    web_spec["ipFamilies"] = ["IPv4", "IPv6"]
    web_spec["ipFamilyPolicy"] = "PreferDualStack"
    web_spec["externalIPs"].append(EXTERNAL_IP6)
    services.put(*web_objs, *dns(net))
    services.write()
    proxy = start_uproxy(rules, extra=["--proxy-port-range", PORT_RANGE])
    proxy.wait_synced()

    ports = proxy.proxy_ports()
    web, dns_port = ports[("default/web:http", "cluster")], ports[("default/dns:dns", "cluster")]
    assert {40000 <= p <= 40019 for p in (web, dns_port)} == {True}
    assert len(ports) == 2, ports  # one listener each: both policies are Cluster
    want = expected_tables(topo.node_ip, web=web, dns_port=dns_port)
    assert comparable(save(topo, topo.node, mode)) == comparable(want)
    skipped = [line for line in proxy.proc.stderr_lines if "IPv6 service address" in line]
    assert len(skipped) == 2 and {WEB_IP6, EXTERNAL_IP6} == {
        ip for ip in (WEB_IP6, EXTERNAL_IP6) if any(ip in line for line in skipped)
    }, skipped

    # Traffic for both, so the UDP service leaves conntrack entries behind.
    curl(topo, topo.pod, f"http://{WEB_IP}/", body=b"x" * 1000, tmp=tmp_path)
    wait_until_ok(lambda: dig(topo, topo.pod, DNS_IP, DNS_NAME) == DNS_ANSWER, message="dns")
    assert f"dst={DNS_IP}" in conntrack_udp(net)

    # The web service goes from the file: none of its rules remain, dns's are untouched.
    started = time.time()
    services.remove("Service", "web")
    services.write()
    proxy.wait_synced(after=started)
    assert comparable(save(topo, topo.node, mode)) == comparable(
        expected_tables(topo.node_ip, web=None, dns_port=dns_port)
    )

    # The UDP service goes: its rules and its conntrack entries (to the ClusterIP) are gone.
    started = time.time()
    services.remove("Service", "dns")
    services.write()
    proxy.wait_synced(after=started)
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
