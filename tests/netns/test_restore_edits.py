"""The iptables-restore backend edits small changes in place, in real iptables (nft and
legacy): the chains must read back exactly as a rewrite leaves them."""

from __future__ import annotations

from typing import Any

import pytest

from tests.netns.driver import many_portals
from tests.netns.helpers import BACKENDS, install_foreign, run_ops, save, sync_op
from tests.netns.test_rules import PORTALS, WEB, assert_installed
from tests.netns.topology import Topology
from uproxy.model import Protocol, ServicePortName
from uproxy.rules.base import Portal, PortalKind
from uproxy.rules.portals import build_rules
from uproxy.rules.restore import FIRST_CHUNK, REWRITE_CHUNK, STAGED_CHUNK
from uproxy.rules.saved import strip_save

RESTORE = [p for p in BACKENDS if p.values[0] == "iptables-restore"]

pytestmark = [pytest.mark.root, pytest.mark.parametrize(("backend", "mode"), RESTORE)]


def test_small_changes_are_edited_in_place(topo: Topology, backend: str, mode: str) -> None:
    # 1,000 services, then one added in the middle of the chains, then it and another one
    # removed, then that one back on another proxy port. Each sync edits those rules only and
    # the chains read back as exactly the text a rewrite gives, others' rules untouched.
    install_foreign(topo, mode)
    before = save(topo, mode)
    mid = ServicePortName("scale", "svc-500a", "http", Protocol.TCP)
    added = Portal(mid, PortalKind.CLUSTER_IP, "10.97.99.1", 80, 40500)
    moved = [Portal(WEB, PortalKind.CLUSTER_IP, "10.96.0.10", 80, 40099), *PORTALS[1:]]
    steps = [PORTALS, [*PORTALS, added], PORTALS[1:], moved]
    ops: list[dict[str, Any]] = []
    for portals in steps:
        ops += [{**sync_op(portals), "many": 1000}, {"op": "attr", "name": "edits"}]
        ops += [{"op": "attr", "name": "restores"}, {"op": "verify"}]
    results = run_ops(topo, backend, mode, ops)
    # Rules edited so far: none (the first sync writes everything), then the added portal's
    # two (container and host), then those two and the ClusterIP's two, then two again; and
    # each time the direct drops of the proxy ports that came or went (a rule replaced is a
    # deletion and an insertion): 2, then 4 (two groups), then 2.
    assert results[1::4] == [0, 2 + 2, 6 + 4, 8 + 6]
    assert results[2::4] == [1, 2, 3, 4]  # one restore per sync
    assert results[3::4] == [True] * len(steps)
    assert_installed(before, save(topo, mode), [*many_portals(1000), *moved], topo.node_ip)


@pytest.mark.parametrize("checked", [False, True], ids=["", "after-a-check"])
def test_a_rule_deleted_by_someone_else_is_rewritten(
    topo: Topology, backend: str, mode: str, checked: bool
) -> None:
    # Somebody deletes one of uproxy's rules: its positions are no longer uproxy's, so the next
    # change is a rewrite, not an edit (which would delete the wrong rules). Also with the
    # rules check in between (it runs every second): the jumps are all in place, so it
    # passes, but uproxy's chains are still not what its last commit left.
    install_foreign(topo, mode)
    before = save(topo, mode)
    delete = {
        "op": "shell",
        "argv": [f"iptables-{mode}", "-w", "-t", "nat", "-D", "KUBE-PORTALS-CONTAINER", "1"],
    }
    check = [{"op": "check"}] if checked else []
    ops = [sync_op(PORTALS), delete, *check, sync_op(PORTALS[1:])]
    ops += [{"op": "attr", "name": "edits"}, {"op": "verify"}]
    results = run_ops(topo, backend, mode, ops)
    # The nat table rewritten; the filter table, as uproxy left it, edited: the direct drop
    # holding the ClusterIP's proxy port (nothing else leads to it) replaced by one without.
    assert results[-2:] == [2, True]
    assert not checked or results[2] is True
    assert_installed(before, save(topo, mode), PORTALS[1:], topo.node_ip)


def test_many_edits_go_in_several_commits_in_nft_mode(
    topo: Topology, backend: str, mode: str
) -> None:
    # 5,000 services, then 100 of them on other proxy ports: 400 rules deleted and
    # inserted in chains of 5,000. The kernel walks the chain for each edit without giving
    # up the CPU, so nft mode spreads them over several commits (each service's in one);
    # legacy mode keeps one. The chains read back exactly, and the commit count is right:
    # the next sync finds nothing to do.
    install_foreign(topo, mode)
    before = save(topo, mode)
    counters = [{"op": "attr", "name": n} for n in ("commits", "edits", "restores")]
    ops: list[dict[str, Any]] = [{**sync_op(PORTALS), "many": 5000}, *counters]
    for _ in range(2):
        ops += [{**sync_op(PORTALS), "many": 5000, "moved": 100}, *counters, {"op": "verify"}]
    results = run_ops(topo, backend, mode, ops)
    after = (1, 5, 10)  # where each sync's counters start
    commits, edits, restores = ([results[i + k] for i in after] for k in range(3))
    assert results[8] is True and results[13] is True
    # 400 in the nat chains, 572 in the direct drops (286 groups of proxy ports replaced:
    # 100 ports gone from a run of consecutive ones, 100 come, every 50th, from 40,000 on).
    assert edits[1] - edits[0] == 400 + 572 and edits[2] == edits[1]
    assert (restores[1] - restores[0], restores[2] - restores[1]) == (1, 0)
    # nft: 99 services a commit (4 edits in chains of 5,000 and a few rules weigh just over
    # 20,000), so 2 commits, and one for the filter table's direct drops.
    assert commits[1] - commits[0] == (3 if mode == "nft" else 2)
    assert commits[2] == commits[1]
    assert_installed(before, save(topo, mode), [*many_portals(5000, 100), *PORTALS], topo.node_ip)


def test_after_a_foreign_commit_chains_that_read_back_as_ours_are_edited(
    topo: Topology, backend: str, mode: str
) -> None:
    # Somebody else commits (a rule in a chain of theirs, as a CNI plugin would) between two
    # syncs. uproxy reads its chains back, finds every rule of every kind exactly as it left
    # them (iptables-save prints what uproxy wrote), and edits the change in: no rewrite.
    # Then nothing changes but somebody commits again: read, nothing written at all.
    install_foreign(topo, mode)
    before = save(topo, mode)
    foreign = {"op": "shell", "argv": [f"iptables-{mode}", "-w", "-A", "FORWARD", "-j", "ACCEPT"]}
    counters = [{"op": "attr", "name": "edits"}, {"op": "attr", "name": "restores"}]
    ops: list[dict[str, Any]] = [{**sync_op(PORTALS), "many": 1000}, foreign]
    ops += [{**sync_op(PORTALS[1:]), "many": 1000}, *counters, {"op": "verify"}, foreign]
    ops += [{**sync_op(PORTALS[1:]), "many": 1000}, *counters, {"op": "verify"}]
    results = run_ops(topo, backend, mode, ops)
    # The ClusterIP's two rules deleted, and the direct drop of its proxy port replaced by
    # one without it (a deletion and an insertion): one restore.
    assert results[3:6] == [2 + 2, 2, True]
    assert results[8:11] == [2 + 2, 2, True]  # nothing written
    after = save(topo, mode)
    assert after.count("-A FORWARD -j ACCEPT") == 2
    assert_installed(
        before,
        after.replace("-A FORWARD -j ACCEPT\n", ""),
        [*many_portals(1000), *PORTALS[1:]],
        topo.node_ip,
    )


def test_jumps_flushed_with_the_chains_intact_are_put_back(
    topo: Topology, backend: str, mode: str
) -> None:
    # Somebody flushes the built-in chains (a firewall reload) but not uproxy's: the chains
    # read back as uproxy's, yet the jumps into them are gone. The sync puts them back, with
    # no change of its own and with one.
    install_foreign(topo, mode)
    flushes = [
        [f"iptables-{mode}", "-w", "-t", table, "-F", chain]
        for table, chain in (("nat", "PREROUTING"), ("nat", "OUTPUT"), ("filter", "INPUT"))
    ]
    for argv in flushes:  # so that later flushes take only uproxy's jumps
        topo.run(topo.node, *argv)
    before = save(topo, mode)
    flush = [{"op": "shell", "argv": argv} for argv in flushes]
    ops: list[dict[str, Any]] = [{**sync_op(PORTALS), "many": 1000}, *flush]
    ops += [{**sync_op(PORTALS), "many": 1000}, {"op": "verify"}, *flush]
    ops += [{**sync_op(PORTALS[1:]), "many": 1000}, {"op": "verify"}]
    results = run_ops(topo, backend, mode, ops)
    assert [results[5], results[10]] == [True, True]
    after = save(topo, mode)
    assert_installed(before, after, [*many_portals(1000), *PORTALS[1:]], topo.node_ip)


def nat_rewrite(portals: list[Portal], topo: Topology, mode: str) -> tuple[int, int, int]:
    """The commits a rewrite of nat takes (legacy: one): into chains nothing reaches, the
    backend's first (the rules in ``FIRST_CHUNK``s, the jumps in the last) and any later one
    (in ``REWRITE_CHUNK``s); beside live chains (the rules in ``STAGED_CHUNK``s, then one to
    turn the jumps, one to rename, one to delete)."""
    rules = len(build_rules(portals, host_ip=topo.node_ip).rules_in("nat"))
    if mode != "nft":
        return 1, 1, 1
    first, later, staged = (-(-rules // n) for n in (FIRST_CHUNK, REWRITE_CHUNK, STAGED_CHUNK))
    return first, later, staged + 3


def test_a_flushed_nat_table_is_rewritten_and_filter_left_alone(
    topo: Topology, backend: str, mode: str
) -> None:
    # Somebody flushes the nat table: uproxy reads its rules back, finds filter exactly as
    # it left it (jumps included), and rewrites nat alone: about 1,000 rules, in commits of
    # REWRITE_CHUNK (nft) or one (legacy).
    install_foreign(topo, mode)
    flush_nat = [f"iptables-{mode}", "-w", "-t", "nat", "-F"]
    topo.run(topo.node, *flush_nat)  # so that the flush below takes only uproxy's rules
    before = save(topo, mode)
    flush = {"op": "shell", "argv": flush_nat}
    sync = {**sync_op(PORTALS), "many": 500}
    commits = {"op": "attr", "name": "commits"}
    results = run_ops(topo, backend, mode, [sync, commits, flush, sync, commits, {"op": "verify"}])
    _, fill, _ = nat_rewrite([*many_portals(500), *PORTALS], topo, mode)
    assert results[4] - results[1] == fill and results[5] is True
    assert_installed(before, save(topo, mode), [*many_portals(500), *PORTALS], topo.node_ip)


# What a live rewrite that stopped halfway leaves: a chain that was being filled, with a
# jump already turned to it, and an old chain not yet deleted.
_LEFTOVERS = """\
*nat
:KUBE-PORTALS-HOST-NEW - [0:0]
-A KUBE-PORTALS-HOST-NEW -j RETURN
-I OUTPUT 1 -j KUBE-PORTALS-HOST-NEW
:KUBE-PORTALS-CONTAINER-OLD - [0:0]
-A KUBE-PORTALS-CONTAINER-OLD -j RETURN
COMMIT
"""


def test_what_a_stopped_live_rewrite_left_is_removed(
    topo: Topology, backend: str, mode: str
) -> None:
    # Left behind with uproxy's chains in place, it goes at the next rewrite (the stale jump
    # makes it one commit); an old chain left alone goes at the next live rewrite (in nft
    # mode: chains of its own swapped in); and --cleanup removes them too.
    install_foreign(topo, mode)
    before = save(topo, mode)
    leave = {"op": "shell", "argv": [f"iptables-{mode}-restore", "--noflush", "-w"]}
    leave["stdin"] = _LEFTOVERS
    old = _LEFTOVERS.split(":KUBE-PORTALS-CONTAINER-OLD", 1)[1]
    leave_old = {**leave, "stdin": "*nat\n:KUBE-PORTALS-CONTAINER-OLD" + old}
    big = {**sync_op(PORTALS), "many": 2000}
    ops: list[dict[str, Any]] = [big, leave, {**big, "moved": 1000}, {"op": "verify"}]
    ops += [leave_old, big, {"op": "verify"}, {"op": "attr", "name": "edits"}]
    results = run_ops(topo, backend, mode, ops)
    # Rewrites of the nat chains; the filter table, as uproxy left it, has the direct drops
    # of the 1,000 proxy ports moved back edited in (a short chain).
    assert results[3] is True and results[6] is True and results[7] == 311
    assert_installed(before, save(topo, mode), [*many_portals(2000), *PORTALS], topo.node_ip)
    run_ops(topo, backend, mode, [leave, {"op": "cleanup"}])
    assert strip_save(save(topo, mode)) == strip_save(before)


# The jump uproxy puts first in nat PREROUTING, as another instance would have left it.
_CONTAINER_JUMP = """\
*nat
:KUBE-PORTALS-CONTAINER - [0:0]
-I PREROUTING 1 -m comment --comment "handle ClusterIPs; NOTE: this must be before the \
NodePort rules" -j KUBE-PORTALS-CONTAINER
COMMIT
"""


def test_jumps_read_before_the_first_sync_serve_it_unless_someone_committed(
    topo: Topology, backend: str, mode: str
) -> None:
    # prepare() reads the built-in chains while the sources list. The first sync uses that
    # read when nothing was committed since; otherwise it reads again. Here somebody puts
    # uproxy's jump into PREROUTING in between: with the early read, the sync would add a
    # second copy, and the jumps would not be exactly one each.
    install_foreign(topo, mode)
    before = save(topo, mode)
    quiet = [{"op": "prepare"}, sync_op(PORTALS), {"op": "attr", "name": "reads"}]
    assert run_ops(topo, backend, mode, [*quiet, {"op": "verify"}])[2:] == [1, True]
    run_ops(topo, backend, mode, [{"op": "cleanup"}])
    assert strip_save(save(topo, mode)) == strip_save(before)
    argv = [f"iptables-{mode}-restore", "--noflush", "-w"]
    meddled: list[dict[str, Any]] = [{"op": "prepare"}]
    meddled.append({"op": "shell", "argv": argv, "stdin": _CONTAINER_JUMP})
    meddled += [sync_op(PORTALS), {"op": "attr", "name": "reads"}, {"op": "verify"}]
    assert run_ops(topo, backend, mode, meddled)[3:] == [2, True]
    installed = save(topo, mode)
    assert installed.count("-j KUBE-PORTALS-CONTAINER") == 1, installed
    assert_installed(before, installed, PORTALS, topo.node_ip)


def test_unreachable_chains_are_filled_in_several_commits(
    topo: Topology, backend: str, mode: str
) -> None:
    # 5,000 services: over 10,000 nat rules. While no jump leads into uproxy's chains (the
    # first sync, or after somebody removed uproxy's rules) nft mode fills them in commits of
    # at most REWRITE_CHUNK rules, the jumps in the last; with the jumps in place it fills new
    # chains so and swaps them in. Legacy mode always writes a table in one commit. Either way the rules
    # read back exactly, and the commit count is right: the sync after each finds nothing to
    # do (a count off by one would make it rewrite everything again).
    install_foreign(topo, mode)
    before = save(topo, mode)
    nat = f"iptables-{mode}"
    delete_one = {"op": "shell", "argv": [nat, "-w", "-t", "nat", "-D", "KUBE-PORTALS-HOST", "1"]}
    sync = {**sync_op(PORTALS), "many": 5000}
    counters = [{"op": "attr", "name": "commits"}, {"op": "attr", "name": "restores"}]
    ops: list[dict[str, Any]] = []
    read: list[int] = []  # where the counters' answers are
    for meddle in ([], [{"op": "cleanup_all"}], [delete_one]):
        for step in ([*meddle, sync], [sync]):  # a rewrite, then a sync with nothing to do
            ops += step
            read.append(len(ops))
            ops += [*counters, {"op": "verify"}]
    results = run_ops(topo, backend, mode, ops)
    commits = [results[i] for i in read]
    restores = [results[i + 1] for i in read]
    assert [results[i + 2] for i in read] == [True] * 6
    assert restores == [1, 1, 2, 2, 3, 3]  # one restore per rewrite, none when idle
    assert commits[1] == commits[0] and commits[3] == commits[2] and commits[5] == commits[4]
    first, fill, staged = nat_rewrite([*many_portals(5000), *PORTALS], topo, mode)
    assert fill > first > 1 or mode == "legacy"  # 10,000 and a few rules
    assert commits[0] == first + 1  # and filter's
    assert commits[2] - commits[1] == fill + 1  # the backend's second fill of empty chains
    # A rule deleted from nat, the jumps in place: nft mode fills chains of its own and
    # swaps them in, legacy writes one commit; filter read back as uproxy left it is not
    # written at all.
    assert commits[4] - commits[3] == staged
    assert_installed(before, save(topo, mode), [*many_portals(5000), *PORTALS], topo.node_ip)
