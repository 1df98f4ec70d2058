"""uproxy's portals beside kube-proxy's own rules on one node, as during a move from one to the
other: ClusterIP traffic must meet uproxy's jumps first, and where uproxy cannot make sure of
that it says so."""

from __future__ import annotations

import pytest

from tests.netns.helpers import BACKENDS, run_ops, save, shell_op, sync_op
from tests.netns.test_rules import PORTALS
from tests.netns.topology import Topology
from uproxy.rules.saved import jump_target, parse_save

pytestmark = [pytest.mark.root]

# What kube-proxy's iptables mode adds when it starts after uproxy: its jumps inserted first.
KUBE_PROXY = """*nat
:KUBE-SERVICES - [0:0]
-A KUBE-SERVICES -d 10.96.0.10/32 -p tcp -m tcp --dport 80 -j DNAT --to-destination 10.1.2.3:8080
-I PREROUTING 1 -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-I OUTPUT 1 -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
COMMIT
"""

KUBE_PROXY_NFT = """table ip kube-proxy {
    chain nat-prerouting { type nat hook prerouting priority dstnat; policy accept; }
}
"""

OVERTAKEN = "Another proxy's service rules stand before uproxy's portals"

# What kube-proxy's iptables mode leaves behind in the variant it ran with: its jumps, where
# they were, and a service chain that still sends a ClusterIP to the endpoints it knew.
KUBE_PROXY_LEFT = """*nat
:KUBE-SERVICES - [0:0]
-A KUBE-SERVICES -d 10.96.0.10/32 -p tcp -m tcp --dport 80 -j DNAT --to-destination 10.1.2.3:8080
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
COMMIT
"""
ELSEWHERE = "kube-proxy's iptables rules are in place in the other iptables variant"


def jumps(topo: Topology, mode: str, chain: str) -> list[str | None]:
    return [jump_target(line) for line in parse_save(save(topo, mode))["nat"].chains[chain]]


@pytest.mark.parametrize(("backend", "mode"), BACKENDS)
def test_portal_jumps_move_back_above_kube_proxys_service_jump(
    topo: Topology, backend: str, mode: str
) -> None:
    """A kube-proxy that starts after uproxy put its jump above uproxy's, and every ClusterIP
    went to the endpoints it knew: uproxy's check only asked whether its jumps existed."""
    restore = shell_op(f"iptables-{mode}-restore", "--noflush", stdin=KUBE_PROXY)
    results = run_ops(
        topo,
        backend,
        mode,
        [sync_op(PORTALS), restore, {"op": "check"}, sync_op(PORTALS), {"op": "said"}],
    )
    assert results[2] is False  # the check sees the jump overtaken
    assert jumps(topo, mode, "PREROUTING")[:2] == ["KUBE-PORTALS-CONTAINER", "KUBE-SERVICES"]
    assert jumps(topo, mode, "OUTPUT")[:2] == ["KUBE-PORTALS-HOST", "KUBE-SERVICES"]
    for chain in ("PREROUTING", "OUTPUT"):  # moved, not added twice
        assert len(jumps(topo, mode, chain)) == len(set(jumps(topo, mode, chain)))
    said = [line for line in results[4] if OVERTAKEN in line]
    assert len(said) == 1 and "nat/OUTPUT,nat/PREROUTING" in said[0], results[4]


@pytest.mark.parametrize(
    ("backend", "mode", "warned"),
    [("iptables-restore", "nft", True), ("iptables", "legacy", True), ("nftables", "nft", False)],
)
def test_kube_proxys_nftables_table_is_named_beside_iptables_portals(
    topo: Topology, backend: str, mode: str, warned: bool
) -> None:
    """kube-proxy's nftables mode hooks in at the iptables nat chains' priority: which one
    sees a ClusterIP's packets first is the kernel's registration order, not uproxy's to set."""
    table = shell_op("nft", "-f", "-", stdin=KUBE_PROXY_NFT)
    ops = [table, {"op": "prepare"}, sync_op(PORTALS), {"op": "said"}]
    results = run_ops(topo, backend, mode, ops)
    said = [line for line in results[3] if "kube-proxy's nftables rules are in place" in line]
    assert len(said) == (1 if warned else 0), results[3]


@pytest.mark.parametrize(
    ("backend", "mode", "other", "warned"),
    [
        ("iptables-restore", "nft", "legacy", True),
        ("iptables-restore", "legacy", "nft", True),
        ("iptables", "legacy", "nft", True),
        ("nftables", "nft", "legacy", False),
    ],
)
def test_kube_proxys_rules_in_the_other_iptables_variant_are_named(
    topo: Topology, backend: str, mode: str, other: str, warned: bool
) -> None:
    """Both variants hook their nat chains in at one priority, and the kernel runs the table
    registered last first: kube-proxy's rules left in the variant uproxy does not write took
    every ClusterIP they knew, and uproxy said nothing (its jumps stood first in its own
    variant). uproxy's nft table runs before both."""
    left = shell_op(f"iptables-{other}-restore", "--noflush", stdin=KUBE_PROXY_LEFT)
    results = run_ops(
        topo, backend, mode, [left, {"op": "prepare"}, sync_op(PORTALS), {"op": "said"}]
    )
    said = [line for line in results[3] if ELSEWHERE in line]
    assert len(said) == (1 if warned else 0), results[3]
    if warned:
        assert f"mode={other} " in said[0] and "nat/OUTPUT,nat/PREROUTING" in said[0], said
    assert "KUBE-SERVICES" in save(topo, other)  # named, not removed: not uproxy's


@pytest.mark.parametrize(("backend", "mode"), [("iptables-restore", "nft"), ("iptables", "legacy")])
def test_looking_in_the_other_iptables_variant_creates_no_table(
    topo: Topology, backend: str, mode: str
) -> None:
    """Asking a variant's program about a nat table it does not have creates that table (in
    legacy, for good), and a table registered later runs first."""
    other = "legacy" if mode == "nft" else "nft"
    results = run_ops(topo, backend, mode, [{"op": "prepare"}, sync_op(PORTALS), {"op": "said"}])
    assert not [line for line in results[2] if ELSEWHERE in line]
    if other == "legacy":
        assert "nat" not in topo.run(topo.node, "cat", "/proc/net/ip_tables_names").split()
    else:
        assert "table ip nat" not in topo.run(topo.node, "nft", "list", "tables")
