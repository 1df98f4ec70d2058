"""The node's address changes under a running uproxy (a DHCP lease renewed with another
address): the node's own traffic to a ClusterIP is DNATed to the node's address and the proxy
port, so the host portals must follow the new address, or that traffic goes nowhere.

The node's primary address (``10.200.3.1`` on ``eth0``, the default route's interface) is
swapped for ``10.200.3.9`` at once: the new one is added beside it and the old one deleted
with ``promote_secondaries`` on, as a lease renewal with another address looks to the node.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.cluster import Cluster
from tests.e2e.conftest import DUAL_STACK, StartProc, StartUproxy
from tests.e2e.harness import ServicesFile, Uproxy, curl, curl_status, url, wait_until_ok
from tests.e2e.manifests import WEB_IP, WEB_IP6, WEB_NODE_PORT, backend_argv, dual_web, lb_web
from tests.netns.helpers import nft
from tests.netns.topology import NODE_IP, NODE_IP6, Topology, add_ip6

pytestmark = [pytest.mark.root]

NEW_NODE_IP = "10.200.3.9"
NEW_NODE_IP6 = "fd00:200:3::9"
OLD = re.compile(rf"\b{re.escape(NODE_IP)}\b")
OLD6 = re.compile(rf"{re.escape(NODE_IP6)}(?![0-9a-f:])")


def move_node_address(topo: Topology) -> None:
    topo.run(topo.node, "sysctl", "-qw", "net.ipv4.conf.eth0.promote_secondaries=1")
    topo.run(topo.node, "ip", "addr", "add", f"{NEW_NODE_IP}/24", "dev", "eth0")
    topo.run(topo.node, "ip", "addr", "del", f"{NODE_IP}/24", "dev", "eth0")
    routes = topo.run(topo.node, "ip", "route", "show", "default")
    assert "via" in routes, f"the default route went with the address: {routes!r}"


def move_node_address6(topo: Topology) -> None:
    """IPv6 has no primary and secondary addresses: the new one is added, the old deleted."""
    add_ip6(topo.node, "eth0", NEW_NODE_IP6)
    topo.run(topo.node, "ip", "-6", "addr", "del", f"{NODE_IP6}/64", "dev", "eth0")


def installed(topo: Topology, rules: str, family: int = 4) -> str:
    """The host portal rules as installed: uproxy's nft table, or the nat table."""
    if rules == "nftables":
        return nft(topo, "list", "table", "ip" if family == 4 else "ip6", "uproxy")
    mode = "legacy" if rules == "iptables" else "nft"
    out = topo.run(topo.node, f"{'ip' if family == 4 else 'ip6'}tables-{mode}-save")
    return "\n".join(line for line in out.splitlines() if "KUBE-PORTALS-HOST" in line)


Serving = Callable[[str, list[dict[str, Any]]], Uproxy]


@pytest.fixture
def serving(
    net: Cluster, services: ServicesFile, start_proc: StartProc, start_uproxy: StartUproxy
) -> Serving:
    """Start the backends and uproxy (``--rules`` as given) serving these manifests."""

    def start(rules: str, manifests: list[dict[str, Any]]) -> Uproxy:
        start_proc(net.topo.backend, backend_argv(net), ready_line=True)
        services.put(*manifests)
        services.write()
        proxy = start_uproxy(rules)
        proxy.wait_synced()
        return proxy

    return start


def answered_again(topo: Topology, target: str, body: bytes, tmp: Path) -> None:
    wait_until_ok(
        lambda: curl(topo, topo.node, target, body=body, tmp=tmp, max_time=2),
        timeout=10,
        message=f"the node's own traffic to {target} after its address changed",
    )


def said_changed(proxy: Uproxy) -> list[str]:
    return [line for line in proxy.proc.stderr_lines if "This node's address changed" in line]


@pytest.mark.parametrize(
    "rules",
    ["nftables", "auto", "iptables"],
    ids=["nftables", "restore", "python-iptables"],
)
def test_the_nodes_own_traffic_follows_its_new_address(
    net: Cluster, serving: Serving, rules: str, tmp_path: Path
) -> None:
    topo = net.topo
    proxy = serving(rules, lb_web(net))
    body = b"node" * 300
    curl(topo, topo.node, url(WEB_IP), body=body, tmp=tmp_path, count=2)
    assert OLD.search(installed(topo, rules)), "the host portals do not DNAT to the node's address"

    move_node_address(topo)

    answered_again(topo, url(WEB_IP), body, tmp_path)
    rules_now = installed(topo, rules)
    assert NEW_NODE_IP in rules_now
    assert not OLD.search(rules_now), rules_now
    # Pods never went through the host portals: still served.
    curl(topo, topo.pod, url(WEB_IP), body=body, tmp=tmp_path, count=2)
    said = said_changed(proxy)
    assert len(said) == 1, proxy.proc.stderr_lines
    assert NODE_IP in said[0] and NEW_NODE_IP in said[0], said


@pytest.mark.parametrize("net", [DUAL_STACK], indirect=True)
@pytest.mark.parametrize("rules", ["nftables", "auto"], ids=["nftables", "restore"])
def test_on_a_dual_stack_node_each_family_follows_its_own_address(
    net: Cluster, serving: Serving, rules: str, tmp_path: Path
) -> None:
    topo = net.topo
    proxy = serving(rules, dual_web(net))
    body = b"six" * 300
    curl(topo, topo.node, url(WEB_IP6), body=body, tmp=tmp_path)
    assert OLD6.search(installed(topo, rules, 6))

    move_node_address6(topo)

    answered_again(topo, url(WEB_IP6), body, tmp_path)
    rules6 = installed(topo, rules, 6)
    assert NEW_NODE_IP6 in rules6 and not OLD6.search(rules6), rules6
    # The IPv4 family kept its address and its rules.
    assert OLD.search(installed(topo, rules, 4))
    curl(topo, topo.node, url(WEB_IP), body=body, tmp=tmp_path)
    said = said_changed(proxy)
    assert len(said) == 1 and "IPv6" in said[0] and NEW_NODE_IP6 in said[0], said


def test_with_nodeports_on_the_primary_address_uproxy_stops_to_start_again(
    net: Cluster, services: ServicesFile, start_proc: StartProc, tmp_path: Path
) -> None:
    """``--nodeport-addresses primary``: the NodePort rules and sockets are the old address's
    too, so uproxy stops with status 1 and one line, for its supervisor to start it again
    (as for a change of its Node's IPs); started again, it serves on the new address."""
    topo = net.topo
    start_proc(topo.backend, backend_argv(net), ready_line=True)
    services.put(*lb_web(net))
    services.write()
    extra = ["--nodeport-addresses", "primary"]
    first = Uproxy(topo, topo.node, services=services.path, rules="nftables", extra=extra)
    second: Uproxy | None = None
    try:
        first.wait_synced()
        move_node_address(topo)
        code = first.proc.popen.wait(timeout=15)
        lines = first.proc.stderr_lines
        assert code == 1, lines
        assert any("stopping, to start again with it" in line for line in lines), lines
        assert f"changed from {NODE_IP} to {NEW_NODE_IP}" in lines[-1], lines
        assert not [line for line in lines if "Traceback" in line], lines
        second = Uproxy(topo, topo.node, services=services.path, rules="nftables", extra=extra)
        second.wait_synced()
        curl(topo, topo.node, f"http://{WEB_IP}/", body=b"again", tmp=tmp_path)
        assert curl_status(topo, topo.outside, f"http://{NEW_NODE_IP}:{WEB_NODE_PORT}/") == 0
    finally:
        first.stop()
        if second is not None:
            assert second.stop() == 0
