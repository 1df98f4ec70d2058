"""Both kernel backends, in a real namespace: exact rules, removal, self-healing, cleanup."""

from __future__ import annotations

from typing import Any

import pytest

from tests.netns.helpers import BACKENDS, DIAL_MARK, install_foreign, run_ops, save, sync_op
from tests.netns.topology import Topology
from uproxy.model import IPFamily, Protocol, ServicePortName
from uproxy.rules.base import Portal, PortalKind
from uproxy.rules.portals import ALL_CHAINS, FILTER, NAT, TABLES, build_rules
from uproxy.rules.saved import BUILTIN_CHAINS, parse_save, strip_save

WEB = ServicePortName("default", "web", "http", Protocol.TCP)
DNS = ServicePortName("kube-system", "dns", "dns", Protocol.UDP)
PORTALS = [
    Portal(WEB, PortalKind.CLUSTER_IP, "10.96.0.10", 80, 40001),
    Portal(WEB, PortalKind.EXTERNAL_IP, "203.0.113.5", 80, 40002),
    Portal(WEB, PortalKind.LB_INGRESS, "198.51.100.9", 80, 40002),
    Portal(WEB, PortalKind.NODE_PORT, None, 30080, 40002),
    Portal(DNS, PortalKind.CLUSTER_IP, "10.96.0.53", 53, 40003),
    Portal(DNS, PortalKind.NODE_PORT, None, 30053, 40003),
]
# Proxy ports without endpoints: one rejects, one drops (a Local policy, none on the node).
REFUSALS = [
    Portal.refusing(
        ServicePortName("default", "empty", "http", Protocol.TCP),
        40004,
        IPFamily.V4,
        anywhere=False,
    ),
    Portal.refusing(
        ServicePortName("default", "local", "dns", Protocol.UDP), 40005, IPFamily.V4, anywhere=True
    ),
]

pytestmark = [pytest.mark.root, pytest.mark.parametrize(("backend", "mode"), BACKENDS)]


def assert_installed(
    before: str, after: str, portals: list[Portal], node_ip: str, **config: Any
) -> None:
    """``after`` is ``before`` plus exactly uproxy's chains, rules and jumps (``config``:
    build_rules' nodeport_cidrs and local)."""
    ruleset = build_rules(portals, host_ip=node_ip, dial_mark=DIAL_MARK, **config)
    old, new = parse_save(before), parse_save(after)
    for table in TABLES:
        expected = ruleset.save_lines(table)
        have = new[table].chains
        assert set(have) == set(old[table].chains) | set(expected), table
        for chain, lines in have.items():
            if chain in ALL_CHAINS:
                assert lines == expected[chain], chain
            elif chain in BUILTIN_CHAINS:
                jumps = ruleset.jumps_in(table)
                first = [j.save_line() for j in jumps if j.chain == chain and j.first]
                last = [j.save_line() for j in jumps if j.chain == chain and not j.first]
                assert lines == first + old[table].chains[chain] + last, chain
            else:
                assert lines == old[table].chains[chain], chain


def test_sync_installs_exactly_the_rule_set(topo: Topology, backend: str, mode: str) -> None:
    install_foreign(topo, mode)
    before = save(topo, mode)
    ops = [sync_op(PORTALS), sync_op(PORTALS), {"op": "check"}, {"op": "verify"}]
    assert run_ops(topo, backend, mode, ops)[-2:] == [True, True]
    assert_installed(before, save(topo, mode), PORTALS, topo.node_ip)


def test_refusals_install_as_written_and_leave_with_their_endpoints(
    topo: Topology, backend: str, mode: str
) -> None:
    # The REJECT and DROP rules as the kernel's own iptables-save prints them (the same text
    # kube-proxy's filter rules have), in and out as proxy ports gain and lose endpoints.
    install_foreign(topo, mode)
    before = save(topo, mode)
    steps = [PORTALS + REFUSALS, PORTALS + REFUSALS[1:], PORTALS + REFUSALS]
    ops = [op for portals in steps for op in (sync_op(portals), {"op": "verify"})]
    assert run_ops(topo, backend, mode, ops)[1::2] == [True] * len(steps)
    assert_installed(before, save(topo, mode), PORTALS + REFUSALS, topo.node_ip)


def test_changes_land_in_order(topo: Topology, backend: str, mode: str) -> None:
    # Edits in the middle of chains (python-iptables edits in place, restore rewrites).
    install_foreign(topo, mode)
    before = save(topo, mode)
    mid = ServicePortName("default", "mid", "http", Protocol.TCP)
    added = [
        Portal(mid, PortalKind.CLUSTER_IP, "10.96.0.20", 8080, 40010),
        Portal(mid, PortalKind.NODE_PORT, None, 30090, 40010),
    ]
    steps = [PORTALS, PORTALS + added, [p for p in PORTALS if p.kind != PortalKind.NODE_PORT]]
    steps.append(added + PORTALS[2:])
    ops = []
    for portals in steps:
        ops += [sync_op(portals), {"op": "verify"}]
    assert run_ops(topo, backend, mode, ops)[1::2] == [True] * len(steps)
    assert_installed(before, save(topo, mode), steps[-1], topo.node_ip)


def test_removed_portal_leaves_no_rule(topo: Topology, backend: str, mode: str) -> None:
    install_foreign(topo, mode)
    before = save(topo, mode)
    remaining = [p for p in PORTALS if p.service == DNS]
    results = run_ops(topo, backend, mode, [sync_op(PORTALS), sync_op(remaining), {"op": "check"}])
    assert results[-1] is True
    after = save(topo, mode)
    assert str(WEB) not in after
    assert after.count(f'"{DNS}"') == 5  # container + host portal, 3 node-port rules
    assert_installed(before, after, remaining, topo.node_ip)


def test_flushed_table_is_noticed_and_repaired(topo: Topology, backend: str, mode: str) -> None:
    flush = {"op": "shell", "argv": [f"iptables-{mode}", "-w", "-t", "nat", "-F"]}
    ops = [sync_op(PORTALS), {"op": "check"}, flush, {"op": "check"}]
    ops += [sync_op(PORTALS), {"op": "check"}, {"op": "verify"}]
    results = run_ops(topo, backend, mode, ops)
    assert results[1] is True
    assert results[3] is False
    assert results[5:] == [True, True]
    ruleset = build_rules(PORTALS, host_ip=topo.node_ip, dial_mark=DIAL_MARK)
    tables = parse_save(save(topo, mode))
    for table in (NAT, FILTER):
        for chain, lines in ruleset.save_lines(table).items():
            if chain in ALL_CHAINS:
                assert tables[table].chains[chain] == lines
            else:
                assert [ln for ln in tables[table].chains[chain] if ln in lines] == lines


def test_cleanup_restores_the_previous_state(topo: Topology, backend: str, mode: str) -> None:
    install_foreign(topo, mode)
    before = strip_save(save(topo, mode))
    run_ops(topo, backend, mode, [sync_op(PORTALS), {"op": "cleanup"}])
    assert strip_save(save(topo, mode)) == before
    # Nothing left: a second cleanup, and --cleanup, succeed and change nothing.
    results = run_ops(topo, backend, mode, [{"op": "cleanup"}, {"op": "cleanup_all"}])
    assert results == [None, False]
    assert strip_save(save(topo, mode)) == before


def test_cleanup_all_removes_a_sync(topo: Topology, backend: str, mode: str) -> None:
    install_foreign(topo, mode)
    before = strip_save(save(topo, mode))
    run_ops(topo, backend, mode, [sync_op(PORTALS)])
    assert "KUBE-PORTALS-HOST" in save(topo, mode)
    assert run_ops(topo, "none", mode, [{"op": "cleanup_all"}]) == [True]
    assert strip_save(save(topo, mode)) == before


def test_cleanup_with_nothing_installed(topo: Topology, backend: str, mode: str) -> None:
    before = strip_save(save(topo, mode))
    assert run_ops(topo, backend, mode, [{"op": "cleanup"}, {"op": "cleanup_all"}]) == [
        None,
        False,
    ]
    assert strip_save(save(topo, mode)) == before


def test_damaged_chain_is_found_and_rewritten(topo: Topology, backend: str, mode: str) -> None:
    flush = {
        "op": "shell",
        "argv": [f"iptables-{mode}", "-w", "-t", "nat", "-F", "KUBE-PORTALS-HOST"],
    }
    ops = [sync_op(PORTALS), flush, {"op": "check"}, {"op": "verify"}, sync_op(PORTALS)]
    ops += [{"op": "verify"}, {"op": "said"}]
    results = run_ops(topo, backend, mode, ops)
    assert results[3] is False
    assert results[5] is True
    if backend == "iptables-restore":
        # The jumps are in place, so its check passes (python-iptables compares every rule);
        # the next sync reads the rules back, and says what it found.
        assert results[2] is True
        rewrote = [line for line in results[6] if line.startswith("Rules changed by someone")]
        assert rewrote == ["Rules changed by someone else, rewriting them tables=IPv4 nat"]
    lines = parse_save(save(topo, mode))[NAT].chains["KUBE-PORTALS-HOST"]
    assert len(lines) == 5  # the dial-mark RETURN and four portals
    assert lines[0].endswith("-j RETURN")


def test_idle_checks_and_syncs_spawn_nothing(topo: Topology, backend: str, mode: str) -> None:
    # The watch (nf_tables generation, legacy table shapes) keeps the periodic check and the
    # syncer's periodic sync free while nobody changes anything.
    many: dict[str, Any] = {"op": "sync", "portals": [], "many": 1000}
    changed: dict[str, Any] = {"op": "sync", "portals": [], "many": 1001}
    counter = "commits" if backend == "iptables" else "restores"
    state: list[dict[str, Any]] = [{"op": "spawns"}, {"op": "attr", "name": counter}]
    # 0-5: warm up (the first iptables-nft-restore may bump the generation twice: uproxy then
    # looks once before it trusts its own mark).
    script = [many, {"op": "check"}, many, {"op": "check"}, *state]
    script += [{"op": "check"}, many] * 3 + state  # 6-13: idle
    script += [changed, *state]  # 14-16: one more service
    if mode == "nft":
        foreign = ["nft", "add", "table", "inet", "somebody"]
    else:
        foreign = ["iptables-legacy", "-w", "-t", "nat", "-A", "POSTROUTING", "-j", "ACCEPT"]
    script += [{"op": "shell", "argv": foreign}, {"op": "check"}, {"op": "check"}, *state]
    results = run_ops(topo, backend, mode, script)
    spawns, commits = results[4], results[5]
    assert results[6:12:2] == [True] * 3
    assert (results[12], results[13]) == (spawns, commits)  # idle: nothing at all
    # A change is one commit, without reading the built-in chains first.
    own = [] if backend == "iptables" else [f"iptables-{mode}-restore"]
    assert (results[15], results[16]) == (spawns + own, commits + 1)
    # Somebody else committed: the next check looks once, the one after is free again.
    assert results[18:20] == [True, True]
    look = ["iptables-legacy-save"] if backend == "iptables" else [f"iptables-{mode}"] * 4
    assert (results[20], results[21]) == (spawns + own + look, commits + 1)
