"""Source ranges, --nodeport-addresses and --detect-local-mode in real tables (every backend).

The rules for a LoadBalancer IP with source ranges, an ``externalTrafficPolicy: Local``
service's short-circuit for traffic from the cluster, and node ports narrowed to some node
addresses, installed by each backend exactly as rendered; jumps of an earlier configuration
removed at the next start; the pods' CIDRs changed in place (NodeCIDR); and cleanup leaving
the tables as they were.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.netns.helpers import (
    BACKENDS,
    DIAL_MARK,
    install_foreign,
    nft,
    nft_normalised,
    run_ops,
    save,
    sync_op,
)
from tests.netns.test_rules import DNS, WEB, assert_installed
from tests.netns.topology import REPO, Topology, sh
from uproxy.rules.base import LocalTraffic, Portal, PortalKind
from uproxy.rules.portals import NAT, build_rules
from uproxy.rules.saved import parse_save, strip_save

pytestmark = [pytest.mark.root]

LB = "198.51.100.9"
PORTALS = [
    Portal(WEB, PortalKind.CLUSTER_IP, "10.96.0.10", 80, 40001),
    Portal(WEB, PortalKind.EXTERNAL_IP, "203.0.113.5", 80, 40002, 40001),
    Portal(WEB, PortalKind.LB_INGRESS, LB, 80, 40002, 40001, ("10.200.0.0/16", "192.0.2.7/32")),
    Portal(WEB, PortalKind.NODE_PORT, None, 30080, 40002, 40001),
    Portal(DNS, PortalKind.CLUSTER_IP, "10.96.0.53", 53, 40003),
    Portal(DNS, PortalKind.LB_INGRESS, LB, 53, 40003, 0, ("10.200.3.0/24",)),
]
NODEPORT_CIDRS = ("10.200.3.0/24", "10.200.2.1/32")
PODS = {"cidrs": ["10.200.1.0/24"]}
CONFIG: dict[str, Any] = {"nodeport_cidrs": NODEPORT_CIDRS, "local": PODS}


@pytest.mark.parametrize(("backend", "mode"), BACKENDS)
def test_iptables_backends_install_exactly_the_rendered_rules(
    topo: Topology, backend: str, mode: str
) -> None:
    install_foreign(topo, mode)
    before = save(topo, mode)
    ops = [sync_op(PORTALS), sync_op(PORTALS), {"op": "check"}, {"op": "verify"}]
    assert run_ops(topo, backend, mode, ops, **CONFIG)[-2:] == [True, True]
    local = LocalTraffic(cidrs=tuple(PODS["cidrs"]))
    assert_installed(
        before, save(topo, mode), PORTALS, topo.node_ip, nodeport_cidrs=NODEPORT_CIDRS, local=local
    )


def nodeport_jumps(topo: Topology, mode: str) -> list[str]:
    nat = parse_save(save(topo, mode))[NAT].chains
    return [line for chain in ("PREROUTING", "OUTPUT") for line in nat[chain] if "NODEPORT" in line]


@pytest.mark.parametrize(("backend", "mode"), BACKENDS)
def test_jumps_of_an_earlier_nodeport_addresses_are_removed(
    topo: Topology, backend: str, mode: str
) -> None:
    # Three starts of uproxy (one process each): every address, two CIDRs, one CIDR.
    for cidrs in ((), NODEPORT_CIDRS, ("10.200.2.0/24",)):
        results = run_ops(
            topo, backend, mode, [sync_op(PORTALS), {"op": "verify"}], nodeport_cidrs=cidrs
        )
        assert results[-1] is True
        want = build_rules(PORTALS, host_ip=topo.node_ip, nodeport_cidrs=cidrs).jumps
        expected = [j.save_line() for j in want if j.dst_local]
        assert sorted(nodeport_jumps(topo, mode)) == sorted(expected), cidrs


@pytest.mark.parametrize(("backend", "mode"), BACKENDS)
def test_cleanup_removes_the_firewall_and_every_jump(
    topo: Topology, backend: str, mode: str
) -> None:
    install_foreign(topo, mode)
    before = strip_save(save(topo, mode))
    run_ops(topo, backend, mode, [sync_op(PORTALS)], **CONFIG)
    assert "KUBE-PORTALS-FIREWALL" in save(topo, mode)
    assert run_ops(topo, "none", mode, [{"op": "cleanup_all"}]) == [True]
    assert strip_save(save(topo, mode)) == before


@pytest.mark.parametrize(
    ("backend", "mode"), [*BACKENDS, pytest.param("nftables", "nft", id="nftables")]
)
def test_pod_detection_changes_in_place(topo: Topology, backend: str, mode: str) -> None:
    # NodeCIDR: the Node's podCIDRs arrive after start (or change): the next sync follows.
    node_cidr = {"op": "set_local_traffic", "local": {"cidrs": ["10.200.1.0/25"]}}
    ops = [sync_op(PORTALS), node_cidr, sync_op(PORTALS), {"op": "check"}, {"op": "verify"}]
    assert run_ops(topo, backend, mode, ops)[-2:] == [True, True]
    if backend == "nftables":
        text = nft(topo, "list", "chain", "ip", "uproxy", "portals-container")
    else:
        text = save(topo, mode)
    assert "10.200.1.0/25" in text


NFT_EXPECTED = """\
table ip uproxy {
map cluster-ips {
type ipv4_addr . inet_proto . inet_service : inet_service
elements = { 0.0.0.0 . tcp . 0 comment "uproxy sentinel (not a service)" : 0, 10.96.0.10 . tcp . 80 comment "default/web:http" : 40001, 10.96.0.53 . udp . 53 comment "kube-system/dns:dns" : 40003, 198.51.100.9 . tcp . 80 comment "default/web:http" : 40002, 198.51.100.9 . udp . 53 comment "kube-system/dns:dns" : 40003 }
}
map external-ips {
type ipv4_addr . inet_proto . inet_service : inet_service
elements = { 0.0.0.0 . tcp . 0 comment "uproxy sentinel (not a service)" : 0, 203.0.113.5 . tcp . 80 comment "default/web:http" : 40002 }
}
map node-ports {
type inet_proto . inet_service : inet_service
elements = { tcp . 0 comment "uproxy sentinel (not a service)" : 0, tcp . 30080 comment "default/web:http" : 40002 }
}
set node-port-proxy-ports {
type inet_proto . inet_service
elements = { tcp . 0 comment "uproxy sentinel (not a service)", tcp . 40001 comment "default/web:http", tcp . 40002 comment "default/web:http" }
}
set proxy-ports {
type inet_proto . inet_service
elements = { tcp . 0 comment "uproxy sentinel (not a service)", tcp . 40001 comment "default/web:http", tcp . 40002 comment "default/web:http", udp . 40003 comment "kube-system/dns:dns" }
}
map short-circuit-lb-ips {
type ipv4_addr . inet_proto . inet_service : inet_service
elements = { 0.0.0.0 . tcp . 0 comment "uproxy sentinel (not a service)" : 0, 198.51.100.9 . tcp . 80 comment "default/web:http" : 40001 }
}
map short-circuit-external-ips {
type ipv4_addr . inet_proto . inet_service : inet_service
elements = { 0.0.0.0 . tcp . 0 comment "uproxy sentinel (not a service)" : 0, 203.0.113.5 . tcp . 80 comment "default/web:http" : 40001 }
}
map short-circuit-node-ports {
type inet_proto . inet_service : inet_service
elements = { tcp . 0 comment "uproxy sentinel (not a service)" : 0, tcp . 30080 comment "default/web:http" : 40001 }
}
set firewalled-lb-ips {
type ipv4_addr . inet_proto . inet_service
elements = { 0.0.0.0 . tcp . 0 comment "uproxy sentinel (not a service)", 198.51.100.9 . tcp . 80 comment "default/web:http", 198.51.100.9 . udp . 53 comment "kube-system/dns:dns" }
}
set lb-source-ranges {
type ipv4_addr . inet_proto . inet_service . ipv4_addr
flags interval
elements = { 0.0.0.0 . tcp . 0 . 0.0.0.0 comment "uproxy sentinel (not a service)", 198.51.100.9 . tcp . 80 . 10.200.0.0/16 comment "default/web:http", 198.51.100.9 . tcp . 80 . 192.0.2.7 comment "default/web:http", 198.51.100.9 . udp . 53 . 10.200.3.0/24 comment "kube-system/dns:dns" }
}
set rejected-proxy-ports {
type inet_proto . inet_service
elements = { tcp . 0 comment "uproxy sentinel (not a service)" }
}
set dropped-proxy-ports {
type inet_proto . inet_service
elements = { tcp . 0 comment "uproxy sentinel (not a service)" }
}
chain portals-firewall {
type filter hook prerouting priority dstnat - 10; policy accept;
ct state new ip daddr . meta l4proto . th dport @firewalled-lb-ips ip daddr . meta l4proto . th dport . ip saddr != @lb-source-ranges drop
}
chain portals-container {
type nat hook prerouting priority dstnat - 1; policy accept;
ip saddr 10.200.1.0/24 meta l4proto { tcp, udp } redirect to :ip daddr . meta l4proto . th dport map @short-circuit-lb-ips
meta l4proto { tcp, udp } redirect to :ip daddr . meta l4proto . th dport map @cluster-ips
ip saddr 10.200.1.0/24 meta iifkind != "bridge" meta l4proto { tcp, udp } redirect to :ip daddr . meta l4proto . th dport map @short-circuit-external-ips
ip saddr 10.200.1.0/24 fib daddr type local meta l4proto { tcp, udp } redirect to :ip daddr . meta l4proto . th dport map @short-circuit-external-ips
meta iifkind != "bridge" meta l4proto { tcp, udp } redirect to :ip daddr . meta l4proto . th dport map @external-ips
fib daddr type local meta l4proto { tcp, udp } redirect to :ip daddr . meta l4proto . th dport map @external-ips
}
chain portals-host {
type nat hook output priority -101; policy accept;
meta mark & 0x00001000 == 0x00001000 return comment "uproxy dials to endpoints skip the portals"
meta l4proto { tcp, udp } dnat to 10.200.3.1:ip daddr . meta l4proto . th dport map @short-circuit-lb-ips
meta l4proto { tcp, udp } dnat to 10.200.3.1:ip daddr . meta l4proto . th dport map @cluster-ips
fib daddr type local meta l4proto { tcp, udp } dnat to 10.200.3.1:ip daddr . meta l4proto . th dport map @short-circuit-external-ips
fib daddr type local meta l4proto { tcp, udp } dnat to 10.200.3.1:ip daddr . meta l4proto . th dport map @external-ips
}
chain node-ports-container {
type nat hook prerouting priority dstnat + 1; policy accept;
ip daddr { 10.200.2.1, 10.200.3.0/24 } ip saddr 10.200.1.0/24 fib daddr type local meta l4proto { tcp, udp } redirect to :meta l4proto . th dport map @short-circuit-node-ports
ip daddr { 10.200.2.1, 10.200.3.0/24 } fib daddr type local meta l4proto { tcp, udp } redirect to :meta l4proto . th dport map @node-ports
}
chain node-ports-host {
type nat hook output priority -99; policy accept;
meta mark & 0x00001000 == 0x00001000 return comment "uproxy dials to endpoints skip the portals"
ip daddr { 10.200.2.1, 10.200.3.0/24 } fib daddr type local meta l4proto { tcp, udp } dnat to 10.200.3.1:meta l4proto . th dport map @short-circuit-node-ports
ip daddr { 10.200.2.1, 10.200.3.0/24 } fib daddr type local meta l4proto { tcp, udp } dnat to 10.200.3.1:meta l4proto . th dport map @node-ports
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
chain synced-by {
return comment "uproxy ID commit N"
}
}
"""


def nft_ops(topo: Topology, script: list[dict[str, Any]]) -> list[Any]:
    return run_ops(topo, "nftables", "nft", script, dial_mark=DIAL_MARK, **CONFIG)


def test_nft_table_is_exact_and_ranges_change_by_element(topo: Topology) -> None:
    results = nft_ops(topo, [sync_op(PORTALS), {"op": "verify"}])
    assert results[-1] is True
    assert nft_normalised(nft(topo, "list", "table", "ip", "uproxy")) == NFT_EXPECTED
    # New ranges: an element delta (no full load), and the table is as wanted.
    narrowed = [
        Portal(
            p.service, p.kind, p.ip, p.port, p.proxy_port, p.cluster_proxy_port, ("192.0.2.0/24",)
        )
        if p.source_ranges
        else p
        for p in PORTALS
    ]
    ops = [
        sync_op(PORTALS),
        sync_op(narrowed),
        {"op": "verify"},
        {"op": "attr", "name": "full_loads"},
    ]
    assert nft_ops(topo, ops)[-2:] == [True, 1]
    ranges = nft(topo, "list", "set", "ip", "uproxy", "lb-source-ranges")
    assert "192.0.2.0/24" in ranges and "10.200" not in ranges
    nft_ops(topo, [{"op": "cleanup"}])
    assert "uproxy" not in nft(topo, "list", "tables")


def test_primary_without_a_node_address_stops_with_one_line(tmp_path: Path) -> None:
    # A namespace with nothing but loopback: no default route, no global IPv4 address.
    name = f"up-{os.getpid() % 100000}-bare"
    sh("ip", "netns", "add", name)
    try:
        services = tmp_path / "services.yaml"
        services.write_text("")
        argv = ["--services", str(services), "--rules", "iptables-restore"]
        argv += ["--nodeport-addresses", "primary", "--healthz-bind-address", ""]
        done = subprocess.run(
            ["ip", "netns", "exec", name, sys.executable, "-m", "uproxy.cli", *argv],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
    assert done.returncode == 1, done.stderr
    # No address of either family: nothing can be served, and that is said first (with one
    # family found, "primary" would have named its address).
    assert done.stderr.strip().splitlines()[-1] == (
        "uproxy: error: cannot find this node's IPv4 or IPv6 address for the host portal "
        "rules; set --bind-address to it"
    )
    assert "Traceback" not in done.stderr
