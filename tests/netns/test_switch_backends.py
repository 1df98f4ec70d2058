"""A start with other ``--rules`` (or another ``--iptables-mode``) than the last run's removes
that run's rules first, in a real namespace: stale portals would steer service traffic to
proxy ports nobody listens on (uproxy's nft table runs before the iptables nat chains)."""

from __future__ import annotations

import dataclasses

import pytest

from tests.netns.helpers import install_foreign, nft, run_ops, save, sync_op
from tests.netns.test_rules import PORTALS
from tests.netns.topology import Topology
from uproxy.rules.saved import strip_save

pytestmark = [pytest.mark.root]

SWITCHES = [
    pytest.param(("iptables-restore", "nft"), ("nftables", "nft"), id="restore-nft-to-nftables"),
    pytest.param(("nftables", "nft"), ("iptables-restore", "legacy"), id="nftables-to-legacy"),
    pytest.param(("iptables-restore", "legacy"), ("iptables-restore", "nft"), id="legacy-to-nft"),
    pytest.param(("iptables", "legacy"), ("nftables", "nft"), id="python-iptables-to-nftables"),
    pytest.param(("nftables", "nft"), ("iptables", "legacy"), id="nftables-to-python-iptables"),
]


def ours(topo: Topology) -> dict[str, bool]:
    """Where uproxy's rules are: its nft table, its chains in either iptables variant."""
    return {
        "nftables": "table ip uproxy" in nft(topo, "list", "tables"),
        "nft": "KUBE-PORTALS-CONTAINER" in save(topo, "nft"),
        "legacy": "KUBE-PORTALS-CONTAINER" in save(topo, "legacy"),
    }


@pytest.mark.parametrize(("before", "after"), SWITCHES)
def test_a_start_removes_what_the_last_runs_backend_left(
    topo: Topology, before: tuple[str, str], after: tuple[str, str]
) -> None:
    for mode in ("nft", "legacy"):
        install_foreign(topo, mode)  # somebody else's rules in both variants: they stay
    others = {mode: strip_save(save(topo, mode)) for mode in ("nft", "legacy")}
    run_ops(topo, *before, [sync_op(PORTALS)])
    left = "nftables" if before[0] == "nftables" else before[1]
    assert ours(topo)[left]
    moved = [dataclasses.replace(p, proxy_port=p.proxy_port + 100) for p in PORTALS]
    # Until this run's rules are in, the last run's stay: with none at all, a SYN got a
    # conntrack entry without NAT and its retransmissions hung on it (no reset).
    run_ops(topo, *after, [{"op": "prepare"}])
    assert ours(topo)[left]
    run_ops(topo, *after, [{"op": "prepare"}, sync_op(moved), {"op": "verify"}])
    now = "nftables" if after[0] == "nftables" else after[1]
    assert ours(topo) == {kind: kind == now for kind in ("nftables", "nft", "legacy")}
    for mode in ("nft", "legacy"):
        if mode != now:  # the variant uproxy left holds exactly the others' rules again
            assert strip_save(save(topo, mode)) == others[mode]


@pytest.mark.parametrize("before", [("iptables-restore", "nft"), ("nftables", "nft")])
def test_rules_none_names_the_rules_a_run_with_rules_left(
    topo: Topology, before: tuple[str, str]
) -> None:
    """``--rules none`` touches no rules, and a node's earlier rules kept steering its
    services to proxy ports nobody listened on, without a word."""
    quiet = run_ops(topo, "none", "nft", [{"op": "prepare"}, {"op": "said"}])[1]
    assert not [line for line in quiet if "Rules of an earlier run" in line]
    run_ops(topo, *before, [sync_op(PORTALS)])
    said = run_ops(topo, "none", "nft", [{"op": "prepare"}, {"op": "said"}])[1]
    warned = [line for line in said if "Rules of an earlier run with --rules are in place" in line]
    assert len(warned) == 1 and "uproxy --cleanup" in warned[0], said
    assert ours(topo)["nftables" if before[0] == "nftables" else "nft"]  # left in place
