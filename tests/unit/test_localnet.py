"""Source ranges, --nodeport-addresses and --detect-local-mode, from flags to portals.

Settings and configuration fields as kube-proxy names them, what they mean on a node
(``uproxy.localnet``), the Node's podCIDRs, and the portals the syncer makes: an
``externalTrafficPolicy: Local`` service's external portals carry the cluster proxy port,
LoadBalancer IPs carry their IPv4 source ranges.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.factories import endpoint, endpoint_slice, service
from tests.unit.test_syncer import Factory, RecordingRules
from uproxy import localnet
from uproxy.cli import parse_settings
from uproxy.dataplane.settings import DataplaneSettings
from uproxy.localnet import (
    EVERYWHERE,
    NodePortAddresses,
    check_interface,
    has_loopback6,
    local_traffic,
    local_traffic_of,
    nodeport_addresses,
    stacks_at_start,
)
from uproxy.model import IPFamily, NodeInfo, Protocol, ServicePortName
from uproxy.objects import InvalidObject, node_info
from uproxy.rules.base import LocalTraffic, Portal, PortalKind, Stack
from uproxy.settings import Settings, SettingsError
from uproxy.syncer import Syncer, SyncerOptions
from uproxy.tracker import Kind, Tracker

# ----- settings -------------------------------------------------------------------------------


def test_flags_and_defaults() -> None:
    s, _ = parse_settings([])
    assert s.detect_local_mode == "ClusterCIDR" and s.cluster_cidr == ()
    assert s.nodeport_addresses == ()
    s, _ = parse_settings(
        [
            "--nodeport-addresses",
            "primary",
            "--detect-local-mode",
            "InterfaceNamePrefix",
            "--pod-interface-name-prefix",
            "veth",
            "--cluster-cidr",
            "10.244.0.1/16,fd00:244::/48",
        ]
    )
    assert s.nodeport_addresses == ("primary",)
    assert s.detect_local_mode == "InterfaceNamePrefix" and s.pod_interface_name_prefix == "veth"
    assert s.cluster_cidr == ("10.244.0.0/16", "fd00:244::/48")


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--nodeport-addresses", "primary,10.0.0.0/8"], "'primary' cannot be combined"),
        (["--nodeport-addresses", "10.0.0.0/33"], "not a CIDR: '10.0.0.0/33'"),
        (["--nodeport-addresses", "10.0.0.7"], r"not a CIDR: '10.0.0.7' \(one address is 10"),
        (["--nodeport-addresses", ","], "an empty entry in ','"),
        (["--nodeport-addresses", "10.0.0.0/8,,fd00::/8"], "an empty entry"),
        (["--cluster-cidr", "fd00::1"], r"\(one address is fd00::1/128\)"),
        (["--workers", "257"], "invalid --workers: must be 0 to 256, got 257"),
        (["--workers", "-1"], "invalid --workers: must be 0 to 256"),
        (["--cluster-cidr", "10.244.0.0/16,10.245.0.0/16"], "at most one CIDR per IP family"),
        (["--cluster-cidr", "pods"], "invalid --cluster-cidr"),
        (["--detect-local-mode", "PodCIDR"], "must be one of ClusterCIDR, NodeCIDR"),
        (["--detect-local-mode", "BridgeInterface"], "needs --pod-bridge-interface"),
        (["--detect-local-mode", "InterfaceNamePrefix"], "needs --pod-interface-name-prefix"),
        (
            ["--detect-local-mode", "BridgeInterface", "--pod-bridge-interface", "a/b"],
            "not an interface name",
        ),
    ],
)
def test_bad_values_are_one_line(argv: list[str], needle: str) -> None:
    with pytest.raises(SettingsError, match=needle) as err:
        parse_settings(argv)
    assert "\n" not in str(err.value)


def test_node_cidr_needs_the_api_server(tmp_path: Path) -> None:
    services = tmp_path / "s.yaml"
    services.write_text("")
    with pytest.raises(SettingsError, match=r"NodeCIDR reads this Node's spec\.podCIDRs"):
        parse_settings(["--services", str(services), "--detect-local-mode", "NodeCIDR"])


def test_configuration_fields_are_kube_proxys(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"
        "detectLocalMode: BridgeInterface\nclusterCIDR: 10.244.0.0/16\n"
        "detectLocal:\n  bridgeInterface: cbr0\n  interfaceNamePrefix: veth\n"
        "nodePortAddresses: [primary]\n"
    )
    s, _ = parse_settings(["--config", str(cfg)])
    assert (s.detect_local_mode, s.pod_bridge_interface) == ("BridgeInterface", "cbr0")
    assert s.pod_interface_name_prefix == "veth" and s.cluster_cidr == ("10.244.0.0/16",)
    assert s.nodeport_addresses == ("primary",)


def test_missing_bridge_stops_uproxy_with_one_line(tmp_path: Path) -> None:
    services = tmp_path / "s.yaml"
    services.write_text("")
    argv = ["--services", str(services), "--rules", "iptables-restore"]
    argv += ["--detect-local-mode", "BridgeInterface", "--pod-bridge-interface", "nosuch0"]
    argv += ["--healthz-bind-address", "", "--metrics-bind-address", ""]
    # This host's own conntrack settings and the test's OOM score stay as they are.
    argv += ["--conntrack-max-per-core=0", "--conntrack-tcp-timeout-established=0"]
    argv += ["--conntrack-tcp-timeout-close-wait=0", "--oom-score-adj=0"]
    proc = subprocess.run(
        [sys.executable, "-m", "uproxy.cli", *argv], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "uproxy: error: --pod-bridge-interface nosuch0: no such interface on this node; "
        "name the bridge the pods are on, or use another --detect-local-mode"
    )
    assert "Traceback" not in proc.stderr


# ----- what they mean on a node -----------------------------------------------------------------

LOCAL_IPS = ["127.0.0.1", "10.200.1.1", "10.200.3.1", "192.168.5.9"]


def npa(setting: tuple[str, ...], primary: str | None = "10.200.3.1") -> Any:
    return nodeport_addresses(setting, primary_ip=lambda f: primary, local_ips=lambda f: LOCAL_IPS)


def test_nodeport_addresses_on_a_node() -> None:
    assert npa(()) == EVERYWHERE and EVERYWHERE.bind == ("0.0.0.0",)
    found = npa(("10.200.0.0/16", "10.200.3.0/24", "fd00::/64"))
    assert found.cidrs == ("10.200.0.0/16",) and found.bind == ("10.200.1.1", "10.200.3.1")
    assert npa(("primary",)).cidrs == ("10.200.3.1/32",)
    assert npa(("primary",)).bind == ("10.200.3.1",)
    # kube-proxy: no CIDR of this family, or one of every address, means every address.
    assert npa(("fd00::/64",)) == EVERYWHERE
    assert npa(("0.0.0.0/0", "10.0.0.0/8")) == EVERYWHERE
    # Nothing of the node in the CIDRs: NodePorts answer nowhere (no socket to bind).
    nowhere = npa(("172.16.0.0/12",))
    assert nowhere.cidrs == ("172.16.0.0/12",) and nowhere.bind == ()


def test_primary_without_an_address_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="primary: cannot find this node's primary IPv4"):
        npa(("primary",), primary=None)


def test_local_traffic_per_mode() -> None:
    s = Settings(cluster_cidr=("10.244.0.0/16",))
    assert local_traffic(s, None) == LocalTraffic(cidrs=("10.244.0.0/16",))
    assert not local_traffic(Settings(), None).enabled  # ClusterCIDR without a CIDR
    s = Settings(detect_local_mode="BridgeInterface", pod_bridge_interface="cbr0")
    assert local_traffic(s, None) == LocalTraffic(interface="cbr0")
    s = Settings(detect_local_mode="InterfaceNamePrefix", pod_interface_name_prefix="veth")
    assert local_traffic(s, None) == LocalTraffic(interface="veth", prefix=True)


def test_node_cidr_follows_the_node() -> None:
    s = Settings(detect_local_mode="NodeCIDR")
    start = local_traffic(s, None)
    assert not start.enabled
    node = NodeInfo("node-a", pod_cidrs=("10.244.1.0/24",))
    assert local_traffic_of(s, node, start) == LocalTraffic(cidrs=("10.244.1.0/24",))
    # Other modes never change after start, whatever the Node says.
    other = Settings(cluster_cidr=("10.0.0.0/8",))
    assert local_traffic_of(other, node, start) is start


def test_check_interface() -> None:
    check_interface("lo")
    with pytest.raises(ValueError, match="no such interface"):
        check_interface("nosuch0")


def test_node_pod_cidrs_are_read() -> None:
    obj: dict[str, Any] = {
        "metadata": {"name": "node-a"},
        "spec": {"podCIDR": "10.244.1.0/24", "podCIDRs": ["10.244.1.0/24", "fd00:1::/64"]},
    }
    assert node_info(obj).pod_cidrs == ("10.244.1.0/24", "fd00:1::/64")
    assert node_info({"metadata": {"name": "n"}}).pod_cidrs == ()
    with pytest.raises(InvalidObject, match=r"spec.podCIDRs\[0\]"):
        node_info({"metadata": {"name": "n"}, "spec": {"podCIDRs": ["nope"]}})


# ----- the portals the syncer makes -------------------------------------------------------------

WEB = ServicePortName("default", "web", "http", Protocol.TCP)


async def portals_of(**spec: Any) -> frozenset[Portal]:
    svc = service(type="LoadBalancer", externalIPs=["203.0.113.5"], **spec)
    svc["spec"]["ports"][0]["nodePort"] = 30080
    svc["status"] = {"loadBalancer": {"ingress": [{"ip": "198.51.100.9"}]}}
    tracker = Tracker()
    tracker.replace(Kind.SERVICE, [svc])
    eps = [endpoint("10.1.0.1", nodeName="node-b")]
    tracker.replace(Kind.ENDPOINT_SLICE, [endpoint_slice("web-1", "web", endpoints=eps)])
    rules = RecordingRules()
    syncer = Syncer(
        tracker=tracker,
        rules=rules,
        listener_factory=Factory(),
        options=SyncerOptions(
            settings=Settings(rules="iptables-restore", proxy_port_range="40000-40099"),
            dataplane=DataplaneSettings(node_name="node-a"),
            listen_hosts=("0.0.0.0",),
        ),
    )
    await syncer.sync()
    return rules.syncs[-1]


def by_kind(portals: frozenset[Portal]) -> dict[PortalKind, Portal]:
    return {p.kind: p for p in portals}


async def test_local_policy_portals_carry_the_cluster_port() -> None:
    found = by_kind(await portals_of(externalTrafficPolicy="Local", healthCheckNodePort=32000))
    cluster = found[PortalKind.CLUSTER_IP]
    assert cluster.cluster_proxy_port == 0 and not cluster.short_circuit
    for kind in (PortalKind.EXTERNAL_IP, PortalKind.LB_INGRESS, PortalKind.NODE_PORT):
        assert found[kind].cluster_proxy_port == cluster.proxy_port, kind
        assert found[kind].proxy_port != cluster.proxy_port, kind
        assert found[kind].from_cluster_port == cluster.proxy_port


@pytest.mark.parametrize(
    "spec",
    [
        pytest.param({}, id="cluster"),
        # Internal Local, external Cluster: the external listener already reaches every endpoint.
        pytest.param({"internalTrafficPolicy": "Local"}, id="internal-local"),
    ],
)
async def test_other_policies_do_not_short_circuit(spec: dict[str, Any]) -> None:
    assert all(p.cluster_proxy_port == 0 for p in await portals_of(**spec))


async def test_source_ranges_go_to_lb_portals_of_their_family() -> None:
    ranges = ["10.0.0.0/8", "fd00::/8", "192.0.2.7/32"]
    found = by_kind(await portals_of(loadBalancerSourceRanges=ranges))
    assert found[PortalKind.LB_INGRESS].source_ranges == ("10.0.0.0/8", "192.0.2.7/32")
    others = (PortalKind.CLUSTER_IP, PortalKind.EXTERNAL_IP, PortalKind.NODE_PORT)
    assert all(found[k].source_ranges == () for k in others)


# ----- dual-stack ------------------------------------------------------------------------------

V4, V6 = IPFamily.V4, IPFamily.V6
LOCAL = {V4: ["10.200.1.1", "10.200.3.1"], V6: ["fd00:200:1::1", "fd00:200:3::1", "fe80::1"]}
PRIMARY_IPS = {V4: "10.200.3.1", V6: "fd00:200:3::1"}


def npa2(setting: tuple[str, ...], primaries: dict[IPFamily, str] = PRIMARY_IPS) -> Any:
    return nodeport_addresses(
        setting, primary_ip=primaries.get, local_ips=LOCAL.__getitem__, families=(V4, V6)
    )


def test_nodeport_addresses_count_per_family() -> None:
    assert npa2(()) == NodePortAddresses((), ("0.0.0.0", "::"))
    # An IPv4 CIDR only: IPv4 narrowed, IPv6 everywhere (kube-proxy: per family).
    assert npa2(("10.200.3.0/24",)) == NodePortAddresses(("10.200.3.0/24",), ("10.200.3.1", "::"))
    both = npa2(("10.200.3.0/24", "fd00:200:3::/64"))
    assert both.cidrs == ("10.200.3.0/24", "fd00:200:3::/64")
    assert both.bind == ("10.200.3.1", "fd00:200:3::1")
    primary = npa2(("primary",))
    assert primary.cidrs == ("10.200.3.1/32", "fd00:200:3::1/128")
    assert primary.bind == ("10.200.3.1", "fd00:200:3::1")
    with pytest.raises(ValueError, match="primary IPv6 address"):
        npa2(("primary",), {V4: "10.200.3.1"})


def test_families_served(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    addresses: dict[IPFamily, str] = dict(PRIMARY_IPS)
    monkeypatch.setattr(localnet, "primary_address", lambda f: addresses.get(f))
    caplog.set_level(logging.WARNING, logger="uproxy")
    node = Settings(rules="iptables-restore")
    assert stacks_at_start(node) == (
        Stack(V4, "10.200.3.1", "0.0.0.0"),
        Stack(V6, "fd00:200:3::1", "::"),
    )
    # The rules cannot program IPv6 here (no ip6tables-restore): IPv4 alone.
    no_ip6 = "neither ip6tables-nft-restore nor ip6tables-legacy-restore is installed"
    only4 = stacks_at_start(node, rules_support=lambda f: None if f is V4 else no_ip6)
    assert [s.family for s in only4] == [V4]
    said = "Not serving an IP family: the rules backend cannot program it here"
    assert [r.getMessage() for r in caplog.records if r.getMessage() == said] == [said]
    # Nothing it can program: the missing program is the error (once), not the address,
    # and the one line said (no warning per family before it).
    caplog.clear()
    missing = "nft is not installed (the nftables package)"
    with pytest.raises(ValueError) as err:
        stacks_at_start(Settings(rules="nftables"), rules_support=lambda f: missing)
    assert str(err.value) == (
        f"--rules nftables cannot program rules here: {missing}; "
        "install it, or choose another --rules"
    )
    assert not [r for r in caplog.records if r.getMessage() == said]
    with pytest.raises(ValueError, match="nft is not installed"):
        stacks_at_start(
            Settings(rules="nftables", bind_address="10.200.3.1"),
            rules_support=lambda f: "nft is not installed (the nftables package)",
        )
    # An unspecified --bind-address puts its family first and serves both, as kube-proxy
    # reads it (its primary family; kubeadm writes 0.0.0.0); nothing is left out.
    caplog.clear()
    assert stacks_at_start(Settings(rules="nftables", bind_address="::")) == (
        Stack(V6, "fd00:200:3::1", "::"),
        Stack(V4, "10.200.3.1", "0.0.0.0"),
    )
    assert stacks_at_start(Settings(rules="nftables", bind_address="0.0.0.0")) == (
        Stack(V4, "10.200.3.1", "0.0.0.0"),
        Stack(V6, "fd00:200:3::1", "::"),
    )
    assert not [r for r in caplog.records if r.getMessage().startswith("Not serving")]
    # A specific one: that address and its family alone.
    only = Settings(rules="nftables", bind_address="10.200.3.1")
    assert stacks_at_start(only) == (Stack(V4, "10.200.3.1", "10.200.3.1"),)
    # A loopback --bind-address cannot take the node's own traffic (its DNAT target).
    for loopback in ("127.0.0.1", "::1"):
        with pytest.raises(ValueError, match=f"--bind-address {loopback} is a loopback"):
            stacks_at_start(Settings(rules="nftables", bind_address=loopback))
    # An IPv6-only node.
    del addresses[V4]
    assert [s.family for s in stacks_at_start(node)] == [V6]
    addresses.clear()
    with pytest.raises(ValueError, match="cannot find this node's IPv4 or IPv6 address"):
        stacks_at_start(node)
    # Laptop mode: the loopback addresses, or --bind-address.
    laptop = stacks_at_start(Settings(rules="none"))
    assert laptop[0] == Stack(V4, "", "127.0.0.1")
    assert laptop[1:] == ((Stack(V6, "", "::1"),) if has_loopback6() else ())
    assert stacks_at_start(Settings(rules="none", bind_address="::1")) == (Stack(V6, "", "::1"),)
