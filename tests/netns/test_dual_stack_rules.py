"""Every rules backend on a dual-stack node, in a real namespace: both families' exact rules,
repairs noticed through the change detector in either family, idle checks that cost nothing,
and a cleanup that leaves ``iptables-save``, ``ip6tables-save`` and the nft ruleset as they were.

The change detector covers IPv6 too: the nf_tables generation is one per namespace, whatever
the family; the legacy ip6 tables are read with IP6T_SO_GET_INFO.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.netns.conftest import DUAL_STACK
from tests.netns.helpers import (
    ALL_BACKENDS,
    install_foreign,
    install_foreign6,
    nft,
    run_ops,
    save,
    save6,
    sync_op,
)
from tests.netns.test_rules import assert_installed
from tests.netns.topology import Topology
from uproxy.model import IPFamily, Protocol, ServicePortName
from uproxy.rules.base import Portal, PortalKind
from uproxy.rules.saved import strip_save

WEB = ServicePortName("default", "web", "http", Protocol.TCP)
DNS = ServicePortName("kube-system", "dns", "dns", Protocol.UDP)
V4 = [
    Portal(WEB, PortalKind.CLUSTER_IP, "10.96.0.10", 80, 40001),
    Portal(WEB, PortalKind.NODE_PORT, None, 30080, 40001),
    Portal(DNS, PortalKind.CLUSTER_IP, "10.96.0.53", 53, 40003),
]
V6 = [
    Portal(WEB, PortalKind.CLUSTER_IP, "fd00:96::10", 80, 40001),
    Portal(WEB, PortalKind.EXTERNAL_IP, "2001:db8::5", 80, 40001),
    Portal(WEB, PortalKind.LB_INGRESS, "2001:db8::9", 80, 40001, 0, ("fd00:200:3::/64",)),
    Portal(WEB, PortalKind.NODE_PORT, None, 30080, 40001, 0, (), IPFamily.V6),
    Portal(DNS, PortalKind.CLUSTER_IP, "fd00:96::53", 53, 40004),
]

pytestmark = [
    pytest.mark.root,
    pytest.mark.parametrize("topo", [DUAL_STACK], indirect=True),
    pytest.mark.parametrize(("backend", "mode"), ALL_BACKENDS),
]


def snapshot(topo: Topology, mode: str) -> tuple[str, str, str]:
    # Stateless (-s): the counters of the rules move with the namespace's own IPv6 packets
    # (neighbour discovery), which made the comparison fail now and then.
    ruleset = nft(topo, "-s", "list", "ruleset")
    return strip_save(save(topo, mode)), strip_save(save6(topo, mode)), ruleset


def test_both_families_exact_and_cleanup_leaves_nothing(
    topo: Topology, backend: str, mode: str
) -> None:
    install_foreign(topo, mode)
    install_foreign6(topo, mode)
    before = snapshot(topo, mode)
    ops = [sync_op(V4 + V6), sync_op(V4 + V6), {"op": "check"}, {"op": "verify"}]
    assert run_ops(topo, backend, mode, ops)[-2:] == [True, True]
    if backend == "nftables":
        six = nft(topo, "list", "table", "ip6", "uproxy")
        assert "fd00:96::10 . tcp . 80" in six and "10.96.0.10" not in six
        assert "fd00:96::10" not in nft(topo, "list", "table", "ip", "uproxy")
    else:
        assert_installed(before[0], save(topo, mode), V4, topo.node_ip)
        assert_installed(before[1], save6(topo, mode), V6, topo.node_ip6)
    # --cleanup: every family's rules and tables gone, someone else's untouched.
    assert run_ops(topo, "none", mode, [{"op": "cleanup_all"}]) == [True]
    assert snapshot(topo, mode) == before


def test_a_flushed_ipv6_table_is_noticed_and_repaired(
    topo: Topology, backend: str, mode: str
) -> None:
    if backend == "nftables":
        damage = ["nft", "delete", "table", "ip6", "uproxy"]
    else:
        damage = [f"ip6tables-{mode}", "-w", "-t", "nat", "-F"]
    ops: list[dict[str, Any]] = [sync_op(V4 + V6), {"op": "check"}, {"op": "check"}]
    ops += [{"op": "shell", "argv": damage}, {"op": "check"}]
    ops += [sync_op(V4 + V6), {"op": "check"}, {"op": "verify"}]
    results = run_ops(topo, backend, mode, ops)
    assert results[1:3] == [True, True]
    assert results[4] is False  # the IPv6 damage is seen
    assert results[6:] == [True, True]
    if backend != "nftables":
        assert "fd00:96::10/128" in save6(topo, mode)


def test_an_ipv6_change_touches_ipv6_only_and_idle_costs_nothing(
    topo: Topology, backend: str, mode: str
) -> None:
    state: list[dict[str, Any]] = [{"op": "spawns"}, {"op": "check"}, {"op": "spawns"}]
    script = [sync_op(V4 + V6), {"op": "check"}, sync_op(V4 + V6), *state]
    script += [sync_op(V4 + V6[:-1]), *state]
    results = run_ops(topo, backend, mode, script)
    warm, idle = results[3], results[5]
    assert results[4] is True and idle == warm  # an idle check and sync: no process
    changed, after = results[6 + 1], results[6 + 3]
    added = changed[len(idle) :]
    if backend == "iptables-restore":
        assert added == [f"ip6tables-{mode}-restore"]
    elif backend == "nftables":
        assert added == ["nft"]  # one transaction, the ip6 table's element only
    else:
        assert added == []  # libiptc in this process and its child
    assert results[6 + 2] is True and after == changed
