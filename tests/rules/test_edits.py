"""Rule-by-rule edits of uproxy's chains: applied to the chains as iptables-restore applies
them, they must leave exactly the text a rewrite installs (order included)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from uproxy.model import Protocol, ServicePortName
from uproxy.rules.base import LocalTraffic, Portal, PortalKind
from uproxy.rules.payload import edit_payload
from uproxy.rules.portals import ALL_CHAINS, CHAINS, TABLES, RuleBuilder, RuleSet

HOST_IP = "192.168.7.1"
PODS = LocalTraffic(cidrs=("10.244.0.0/16",))


def pool(count: int) -> list[Portal]:
    """Portals of every kind, some short-circuited (Local policy) and some with ranges."""
    out: list[Portal] = []
    for i in range(count):
        spn = ServicePortName("ns", f"svc-{i:03d}", "p", (Protocol.TCP, Protocol.UDP)[i % 2])
        base = 20000 + 10 * i
        short = base + 1 if i % 3 == 0 else 0
        out.append(Portal(spn, PortalKind.CLUSTER_IP, f"10.96.{i // 200}.{i % 200 + 1}", 80, base))
        if i % 4 == 0:
            out.append(Portal(spn, PortalKind.NODE_PORT, None, 30000 + i, base + 2, short))
        if i % 5 == 0:
            out.append(
                Portal(spn, PortalKind.EXTERNAL_IP, f"203.0.113.{i % 250}", 80, base + 2, short)
            )
        if i % 7 == 0:
            ranges = ("192.0.2.0/24", "10.244.3.0/24") if i % 2 else ()
            out.append(
                Portal(
                    spn, PortalKind.LB_INGRESS, f"198.51.{i % 250}.9", 80, base + 2, short, ranges
                )
            )
    return out


def chains_of(ruleset: RuleSet, lines: dict[str, list[str]] | None = None) -> dict[str, list[str]]:
    """uproxy's chains as ``-A`` lines (the jumps live in built-in chains: left out)."""
    out: dict[str, list[str]] = {c: [] for c in ALL_CHAINS}
    for table in TABLES:
        for chain, have in ruleset.save_lines(table).items():
            if chain in ALL_CHAINS:
                out[chain] = list(have)
    return out


def apply(chains: dict[str, list[str]], payload: str) -> int:
    """What iptables-restore --noflush does with an edit payload; the number of commits.

    Positions are 1-based; ``-I`` may name one past the end; a rule deleted by its text must
    be there (iptables-restore fails otherwise)."""
    commits = 0
    for line in payload.splitlines():
        if line == "COMMIT":
            commits += 1
        elif line.startswith(":"):
            raise AssertionError(f"an edit declares (flushes) a chain: {line}")
        elif line.startswith("-D "):
            chain, rest = line[3:].split(" ", 1)
            if rest.isdigit():
                assert 1 <= int(rest) <= len(chains[chain]), line
                del chains[chain][int(rest) - 1]
            else:
                chains[chain].remove(f"-A {chain} {rest}")
        elif line.startswith("-I "):
            chain, position, rest = line[3:].split(" ", 2)
            assert 1 <= int(position) <= len(chains[chain]) + 1, line
            chains[chain].insert(int(position) - 1, f"-A {chain} {rest}")
        else:
            assert line.startswith("*"), line
    return commits


@pytest.mark.parametrize("by_spec", [False, True], ids=["by-position", "by-spec"])
def test_random_changes_edit_to_the_rewrite_text(by_spec: bool) -> None:
    rng = random.Random(7)
    everything = pool(120)
    builder = RuleBuilder(host_ip=HOST_IP, dial_mark=0x1000, local=PODS)
    current = set(rng.sample(everything, 60))
    installed = builder.build(current)
    chains = chains_of(installed)
    edited = 0
    for _ in range(150):
        step = rng.randrange(4)
        if step == 0:  # a portal goes
            current.discard(rng.choice(sorted(current)))
        elif step == 1:  # one comes
            current.add(rng.choice(everything))
        elif step == 2:  # a proxy port moves (the portal is replaced)
            old = rng.choice(sorted(current))
            current.discard(old)
            current.add(replace(old, proxy_port=old.proxy_port + 5))
        else:  # a cluster port moves: the pods' twin rules change, the others stay
            old = rng.choice(sorted(current))
            current.discard(old)
            moved = old.cluster_proxy_port + 7 if old.cluster_proxy_port else 0
            current.add(replace(old, cluster_proxy_port=moved))
        new = builder.build(current)
        edits = edit_payload(
            installed, new, lines=builder.lines, delete_by_spec=by_spec, max_edits=64
        )
        assert edits is not None  # small changes always edit
        assert apply(chains, edits.payload) == edits.commits
        assert chains == chains_of(new)
        installed = new
        edited += edits.count
    assert edited > 150


def test_edits_touch_only_what_changed() -> None:
    builder = RuleBuilder(host_ip=HOST_IP, dial_mark=0x1000)
    portals = [p for p in pool(200) if p.kind is PortalKind.CLUSTER_IP]
    old = builder.build(portals)
    added = Portal(
        ServicePortName("ns", "svc-050a", "p", Protocol.TCP),
        PortalKind.CLUSTER_IP,
        "10.99.0.1",
        80,
        29999,
    )
    new = builder.build([*portals[1:], added])
    edits = edit_payload(old, new, lines=builder.lines, delete_by_spec=False, max_edits=64)
    assert edits is not None
    # svc-000 leaves both nat portal chains (after the host chain's dial-mark RETURN) and
    # svc-050a comes in after svc-050, in sorted order: four rules. In the filter table the
    # group of direct drops that held svc-000's proxy port loses it, and the last group
    # takes svc-050a's: two rules replaced where they stand (the last TCP one is the ninth),
    # the other sixteen kept.
    direct = new.rules_in_chain("KUBE-PORTALS-DIRECT")
    assert len(direct) == len(old.rules_in_chain("KUBE-PORTALS-DIRECT")) == 18
    assert direct[0].dports is not None and direct[0].dports.startswith("20020,")
    assert direct[8].dports is not None and direct[8].dports.endswith(",29999")
    assert edits.payload.splitlines() == [
        "*nat",
        "-D KUBE-PORTALS-CONTAINER 1",
        "-I KUBE-PORTALS-CONTAINER 51 "
        + builder.lines[new.rules[50]][len("-A KUBE-PORTALS-CONTAINER ") :],
        "-D KUBE-PORTALS-HOST 2",
        "-I KUBE-PORTALS-HOST 52 " + builder.lines[new.rules[251]][len("-A KUBE-PORTALS-HOST ") :],
        "COMMIT",
        "*filter",
        "-D KUBE-PORTALS-DIRECT 9",
        "-D KUBE-PORTALS-DIRECT 1",
        "-I KUBE-PORTALS-DIRECT 1 " + builder.lines[direct[0]][len("-A KUBE-PORTALS-DIRECT ") :],
        "-I KUBE-PORTALS-DIRECT 9 " + builder.lines[direct[8]][len("-A KUBE-PORTALS-DIRECT ") :],
        "COMMIT",
    ]
    assert (edits.commits, edits.count) == (2, 8)
    assert "10.99.0.1/32" in edits.payload


def test_rewrites_instead_when_edits_cannot_say_it() -> None:
    builder = RuleBuilder(host_ip=HOST_IP, dial_mark=0x1000)
    portals = pool(100)
    old = builder.build(portals)
    # Too many changes: a rewrite costs the same and reads nothing.
    assert (
        edit_payload(
            old,
            builder.build(portals[:10]),
            lines=builder.lines,
            delete_by_spec=False,
            max_edits=64,
        )
        is None
    )
    # Other jumps (another --nodeport-addresses): rewrite, so the jumps are read and fixed.
    other = RuleBuilder(host_ip=HOST_IP, dial_mark=0x1000, nodeport_cidrs=("192.168.7.0/24",))
    assert (
        edit_payload(
            old, other.build(portals), lines=other.lines, delete_by_spec=False, max_edits=10_000
        )
        is None
    )
    # Two rules both keep, in the other order: a rewrite (edits keep every kept rule in place).
    a, b = old.rules[:2]
    swapped = RuleSet(jumps=old.jumps, rules=(b, a, *old.rules[2:]))
    assert (
        edit_payload(old, swapped, lines=builder.lines, delete_by_spec=False, max_edits=64) is None
    )
    # Nothing changed: an empty edit, no table touched.
    same = edit_payload(old, old, lines=builder.lines, delete_by_spec=False, max_edits=64)
    assert same is not None and (same.payload, same.commits, same.count) == ("", 0, 0)


def by_comment(
    chains: dict[str, list[str]], comments: dict[str, str]
) -> dict[tuple[str, str], list[str]]:
    """The rules of each service port (by its comment) in each table, in chain order."""
    out: dict[tuple[str, str], list[str]] = {}
    for table in TABLES:
        for chain in CHAINS[table]:
            for line in chains[chain]:
                out.setdefault((table, comments[line]), []).append(line)
    return out


@pytest.mark.parametrize("budget", [1, 250, 1_000])
def test_edits_in_several_commits_never_leave_a_service_half_changed(budget: int) -> None:
    rng = random.Random(budget)
    everything = pool(160)
    builder = RuleBuilder(host_ip=HOST_IP, dial_mark=0x1000, local=PODS)
    current = set(rng.sample(everything, 100))
    old = builder.build(current)
    for _ in range(30):
        step = rng.randrange(3)
        if step == 0:
            current.discard(rng.choice(sorted(current)))
        elif step == 1:
            current.add(rng.choice(everything))
        else:  # moved proxy ports: the same service port, other rules
            moved = rng.choice(sorted(current))
            current.discard(moved)
            current.add(replace(moved, proxy_port=moved.proxy_port + 3))
    new = builder.build(current)
    edits = edit_payload(
        old,
        new,
        lines=builder.lines,
        delete_by_spec=False,
        max_edits=10_000,
        commit_cost=budget,
    )
    assert edits is not None
    one = edit_payload(old, new, lines=builder.lines, delete_by_spec=False, max_edits=10_000)
    assert one is not None and edits.count == one.count and one.commits <= 2
    comments = {r.save_line(): r.comment for r in (*old.rules, *new.rules)}
    was, will = by_comment(chains_of(old), comments), by_comment(chains_of(new), comments)
    chains = chains_of(old)
    pieces = edits.payload.split("COMMIT\n")[:-1]
    assert len(pieces) == edits.commits > (one.commits if budget < 1_000 else 0)
    for piece in pieces:
        apply(chains, piece + "COMMIT\n")
        now = by_comment(chains, comments)
        for comment in set(was) | set(will):
            # in each table, a service port has all its old rules or all its new ones
            assert now.get(comment, []) in (was.get(comment, []), will.get(comment, [])), comment
    assert chains == chains_of(new)
