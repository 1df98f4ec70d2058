"""Kernel details around the rules: nft/legacy detection, conntrack, a concurrent writer."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from tests.netns.conftest import DUAL_STACK
from tests.netns.driver import portal_to_json
from tests.netns.helpers import install_foreign, run_ops, save, sync_op
from tests.netns.test_rules import DNS, PORTALS
from tests.netns.topology import REPO, Topology
from uproxy.rules.base import Portal, PortalKind

pytestmark = pytest.mark.root

HINT = "*mangle\n:KUBE-IPTABLES-HINT - [0:0]\nCOMMIT\n"


@pytest.mark.parametrize(
    ("hint_in", "expected"),
    [
        (None, "nft"),
        ("iptables-nft", "nft"),
        ("iptables-legacy", "legacy"),
        # A kubelet that manages IPv6 alone writes its hint there only.
        ("ip6tables-legacy", "legacy"),
    ],
)
def test_mode_detection_follows_the_kubelet_hint(
    topo: Topology, hint_in: str | None, expected: str
) -> None:
    if hint_in is not None:
        topo.run(topo.node, f"{hint_in}-restore", "--noflush", stdin=HINT)
    assert run_ops(topo, "none", "auto", [{"op": "detect_mode"}]) == [expected]
    # Detection never creates legacy tables as a side effect.
    if hint_in is None:
        for names in ("/proc/net/ip_tables_names", "/proc/net/ip6_tables_names"):
            assert topo.run(topo.node, "sh", "-c", f"cat {names} 2>/dev/null").strip() == ""


NO_HINT = "No kubelet hint chain says which iptables variant this node uses"


@pytest.mark.parametrize("hint_in", [None, "nft"])
def test_nft_chosen_without_a_hint_names_the_rules_in_legacy(
    topo: Topology, hint_in: str | None
) -> None:
    """With no hint anywhere uproxy writes nft, as kube-proxy's image does; on a host whose
    firewall is in the legacy tables (ufw, Docker, before any kubelet ran) that firewall's
    default drop still took every connection the portals redirected, and uproxy said only
    which variant it used."""
    install_foreign(topo, "legacy")
    if hint_in is not None:
        topo.run(topo.node, f"iptables-{hint_in}-restore", "--noflush", stdin=HINT)
    mode, said = run_ops(topo, "none", "auto", [{"op": "detect_mode"}, {"op": "said"}])
    assert mode == "nft"
    warned = [line for line in said if NO_HINT in line]
    if hint_in is None:
        assert len(warned) == 1 and "legacy_rules=5" in warned[0], said
        assert "iptablesMode" in warned[0]
    else:
        assert not warned, said  # the kubelet's variant: nothing to warn about


def test_auto_backend_writes_where_the_hint_is(topo: Topology) -> None:
    topo.run(topo.node, "iptables-legacy-restore", "--noflush", stdin=HINT)
    run_ops(topo, "auto", "auto", [sync_op(PORTALS)])
    assert "KUBE-PORTALS-CONTAINER" in save(topo, "legacy")
    assert "KUBE-PORTALS-CONTAINER" not in save(topo, "nft")


def test_prepare_probes_the_variant_so_the_first_sync_does_not(topo: Topology) -> None:
    ops = [{"op": "prepare"}, {"op": "spawns"}, sync_op(PORTALS), {"op": "spawns"}]
    _, probed, _, synced = run_ops(topo, "auto", "auto", ops)
    # No hint anywhere: nft. Then the jumps of the four built-in chains, read meanwhile too.
    assert probed == [
        "iptables-nft-save",
        "ip6tables-nft-save",
        "iptables-legacy-save",
        "ip6tables-legacy-save",
        *["iptables-nft"] * 4,
    ]
    assert synced[len(probed) :] == ["iptables-nft-restore"]  # nothing committed in between
    assert "KUBE-PORTALS-CONTAINER" in save(topo, "nft")


def conntrack_count(topo: Topology, port: int, *, ipv6: bool = False) -> int:
    family = "ipv6" if ipv6 else "ipv4"
    done = subprocess.run(
        topo.exec_argv(
            topo.node, "conntrack", "-L", "-f", family, "-p", "udp", "--dport", str(port)
        ),
        capture_output=True,
        text=True,
        check=False,
    )
    return sum(1 for line in done.stdout.splitlines() if line.startswith("udp"))


def make_udp_flow(topo: Topology, ip: str, port: int) -> None:
    family = "AF_INET6" if ":" in ip else "AF_INET"
    code = (
        f"import socket; s = socket.socket(socket.{family}, socket.SOCK_DGRAM); "
        f"s.sendto(b'x', ('{ip}', {port}))"
    )
    topo.run(topo.pod, "python3", "-c", code)


@pytest.mark.parametrize("topo", [DUAL_STACK], indirect=True)
def test_forgetting_udp_entries_takes_those_of_the_batch_only(topo: Topology) -> None:
    run_ops(topo, "auto", "auto", [sync_op(PORTALS)])  # NAT rules switch conntrack on
    # and IPv6 conntrack too (a rule that asks for the state)
    topo.run(topo.node, "ip6tables", "-A", "FORWARD", "-m", "conntrack", "--ctstate", "NEW")
    make_udp_flow(topo, "10.96.0.53", 53)
    make_udp_flow(topo, "10.96.0.54", 53)
    make_udp_flow(topo, "10.96.0.53", 54)
    make_udp_flow(topo, topo.node_ip, 30053)
    make_udp_flow(topo, "fd00:96::53", 53)
    make_udp_flow(topo, "fd00:96::54", 53)
    assert conntrack_count(topo, 53) == 2 and conntrack_count(topo, 53, ipv6=True) == 2
    batch = [("10.96.0.53", 53, False), ("10.96.9.9", 53, False), ("fd00:96:0::53", 53, True)]
    forgot = run_ops(topo, "none", "auto", [{"op": "forget_udp", "targets": batch}] * 2)
    assert forgot == [2, 0]  # nothing left the second time: still fine
    assert conntrack_count(topo, 53) == 1 and conntrack_count(topo, 53, ipv6=True) == 1
    assert conntrack_count(topo, 54) == 1  # another port of the same address stays
    assert conntrack_count(topo, 30053) == 1
    node_port = [{"op": "forget_udp", "targets": [(None, 30053, False)]}]
    assert run_ops(topo, "none", "auto", node_port) == [1]
    assert conntrack_count(topo, 30053) == 0


@pytest.mark.parametrize("topo", [DUAL_STACK], indirect=True)
def test_the_syncer_forgets_a_batch_of_udp_addresses_without_a_process_each(
    topo: Topology,
) -> None:
    """A batch is one read of the table, and a delete for each entry found: a ``conntrack``
    process per address (each walking the whole table) took 40 s for 2,000 new services."""
    run_ops(topo, "auto", "auto", [sync_op(PORTALS)])
    topo.run(topo.node, "ip6tables", "-A", "FORWARD", "-m", "conntrack", "--ctstate", "NEW")
    for ip, port in [("10.96.0.53", 53), ("10.96.0.54", 53), ("10.96.0.53", 54)]:
        make_udp_flow(topo, ip, port)
    make_udp_flow(topo, topo.node_ip, 30053)
    make_udp_flow(topo, "fd00:96::53", 53)
    make_udp_flow(topo, "fd00:96::54", 53)
    batch = [
        Portal(DNS, PortalKind.CLUSTER_IP, "10.96.0.53", 53, 40003),
        Portal(DNS, PortalKind.CLUSTER_IP, "fd00:96::53", 53, 40003),
        Portal(DNS, PortalKind.NODE_PORT, None, 30053, 40003),
    ]
    ops: list[dict[str, Any]] = [
        {"op": "forget_portals", "portals": [portal_to_json(p) for p in batch], "many": 500},
        {"op": "spawns"},
    ]
    _, spawned = run_ops(topo, "none", "auto", ops)
    assert spawned == []
    assert conntrack_count(topo, 53) == 1 and conntrack_count(topo, 53, ipv6=True) == 1
    assert conntrack_count(topo, 54) == 1
    assert conntrack_count(topo, 30053) == 0


def test_python_iptables_survives_a_concurrent_writer(topo: Topology) -> None:
    # Another program rewrites the nat table while syncs run: EAGAIN is retried, the lock
    # is shared with the iptables binaries, and the end state is exact.
    loop = (
        "i=0; while [ $i -lt 300 ]; do "
        "iptables-legacy -w -t nat -A POSTROUTING -s 10.9.9.9/32 -j ACCEPT; "
        "iptables-legacy -w -t nat -D POSTROUTING -s 10.9.9.9/32 -j ACCEPT; "
        "i=$((i+1)); done"
    )
    writer = topo.popen(topo.node, ["sh", "-c", loop])
    try:
        ops = []
        for i in range(8):
            ops += [sync_op(PORTALS[: 2 + i % 4]), {"op": "verify"}]
        results = run_ops(topo, "iptables", "legacy", ops)
        assert results[1::2] == [True] * 8
    finally:
        writer.wait(timeout=120)
        for stream in (writer.stdout, writer.stderr):
            if stream is not None:
                stream.close()
    assert writer.returncode == 0


@pytest.mark.parametrize(
    ("backend", "mode"), [("auto", "nft"), ("auto", "legacy"), ("iptables", "")]
)
def test_without_cap_net_admin_the_error_is_one_clear_line(
    topo: Topology, backend: str, mode: str
) -> None:
    drop = ["setpriv", "--bounding-set=-net_admin,-net_raw", "--inh-caps=-net_admin,-net_raw"]
    script = {
        "backend": {"name": backend, "mode": mode or "auto", "host_ip": topo.node_ip},
        "ops": [sync_op(PORTALS)],
    }
    done = subprocess.run(
        topo.exec_argv(topo.node, *drop, sys.executable, "-m", "tests.netns.driver"),
        input=json.dumps(script),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    [result] = json.loads(done.stdout)
    assert "permission denied; run as root or with CAP_NET_ADMIN" in result["error"]
    assert result["error"].endswith("or use --rules none")
    assert "\n" not in result["error"]
