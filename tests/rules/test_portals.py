"""The portal rule set as exact text: what each kind of portal installs, in which chain."""

from __future__ import annotations

import random

import pytest

from uproxy.model import IPFamily, Protocol, ServicePortName
from uproxy.rules.base import LocalTraffic, Portal, PortalKind, Stack
from uproxy.rules.payload import restore_payload, rewrite_commits
from uproxy.rules.portals import (
    CHAINS,
    FILTER,
    NAT,
    RuleBuilder,
    RuleSet,
    Source,
    build_rules,
    direct_groups,
    insert_positions,
    make_jumps,
    mark_match,
    quote,
    split_by_family,
    stacks,
    within,
)

WEB = ServicePortName("default", "web", "http", Protocol.TCP)
DNS = ServicePortName("kube-system", "dns", "", Protocol.UDP)
# A service port without endpoints, and one with a Local policy and none on this node.
EMPTY = ServicePortName("default", "empty", "http", Protocol.TCP)
LOCAL = ServicePortName("default", "local", "dns", Protocol.UDP)
HOST_IP = "192.168.7.1"

PORTALS = [
    Portal(WEB, PortalKind.CLUSTER_IP, "10.96.0.10", 80, 40001),
    Portal(WEB, PortalKind.EXTERNAL_IP, "203.0.113.5", 80, 40002),
    Portal(WEB, PortalKind.LB_INGRESS, "198.51.100.9", 80, 40002),
    Portal(WEB, PortalKind.NODE_PORT, None, 30080, 40002),
    Portal(DNS, PortalKind.CLUSTER_IP, "10.96.0.53", 53, 40003),
]
# Proxy ports that turn new connections away: EMPTY's rejects, LOCAL's drops.
REFUSALS = [
    Portal.refusing(EMPTY, 40004, IPFamily.V4, anywhere=False),
    Portal.refusing(LOCAL, 40005, IPFamily.V4, anywhere=True),
]

EXPECTED_NAT = """\
*nat
:KUBE-PORTALS-CONTAINER - [0:0]
:KUBE-PORTALS-HOST - [0:0]
:KUBE-NODEPORT-CONTAINER - [0:0]
:KUBE-NODEPORT-HOST - [0:0]
-I PREROUTING 1 -m comment --comment "handle ClusterIPs; NOTE: this must be before the NodePort rules" -j KUBE-PORTALS-CONTAINER
-I OUTPUT 1 -m comment --comment "handle ClusterIPs; NOTE: this must be before the NodePort rules" -j KUBE-PORTALS-HOST
-A PREROUTING -m addrtype --dst-type LOCAL -m comment --comment "handle service NodePorts; NOTE: this must be the last rule in the chain" -j KUBE-NODEPORT-CONTAINER
-A OUTPUT -m addrtype --dst-type LOCAL -m comment --comment "handle service NodePorts; NOTE: this must be the last rule in the chain" -j KUBE-NODEPORT-HOST
-A KUBE-PORTALS-CONTAINER -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 40001
-A KUBE-PORTALS-CONTAINER -d 10.96.0.53/32 -p udp -m comment --comment "kube-system/dns" -m udp --dport 53 -j REDIRECT --to-ports 40003
-A KUBE-PORTALS-CONTAINER -d 203.0.113.5/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -m physdev ! --physdev-is-in -j REDIRECT --to-ports 40002
-A KUBE-PORTALS-CONTAINER -d 203.0.113.5/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -m addrtype --dst-type LOCAL -j REDIRECT --to-ports 40002
-A KUBE-PORTALS-CONTAINER -d 198.51.100.9/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 40002
-A KUBE-PORTALS-HOST -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DNAT --to-destination 192.168.7.1:40001
-A KUBE-PORTALS-HOST -d 10.96.0.53/32 -p udp -m comment --comment "kube-system/dns" -m udp --dport 53 -j DNAT --to-destination 192.168.7.1:40003
-A KUBE-PORTALS-HOST -d 203.0.113.5/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -m addrtype --dst-type LOCAL -j DNAT --to-destination 192.168.7.1:40002
-A KUBE-PORTALS-HOST -d 198.51.100.9/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DNAT --to-destination 192.168.7.1:40002
-A KUBE-NODEPORT-CONTAINER -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -j REDIRECT --to-ports 40002
-A KUBE-NODEPORT-HOST -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -j DNAT --to-destination 192.168.7.1:40002
COMMIT
"""

EXPECTED_FILTER = """\
*filter
:KUBE-NODEPORT-NON-LOCAL - [0:0]
:KUBE-PORTALS-FIREWALL - [0:0]
:KUBE-PORTALS-REJECT - [0:0]
:KUBE-PORTALS-DIRECT - [0:0]
-I INPUT 1 -m conntrack --ctstate NEW -m conntrack ! --ctstate DNAT -m addrtype ! --src-type LOCAL -m comment --comment "drop new connections to proxy ports that no portal translated" -j KUBE-PORTALS-DIRECT
-I INPUT 2 -m conntrack --ctstate NEW -m comment --comment "drop LoadBalancer traffic from outside its loadBalancerSourceRanges" -j KUBE-PORTALS-FIREWALL
-I FORWARD 1 -m conntrack --ctstate NEW -m comment --comment "drop LoadBalancer traffic from outside its loadBalancerSourceRanges" -j KUBE-PORTALS-FIREWALL
-I INPUT 3 -m conntrack --ctstate NEW -m comment --comment "turn away new connections to proxy ports without endpoints" -j KUBE-PORTALS-REJECT
-I INPUT 4 -m comment --comment "Ensure that non-local NodePort traffic can flow" -j KUBE-NODEPORT-NON-LOCAL
-A KUBE-NODEPORT-NON-LOCAL -p tcp -m comment --comment "default/web:http" -m tcp --dport 40002 -m state --state NEW -m conntrack --ctstate DNAT -j ACCEPT
-A KUBE-PORTALS-DIRECT -p tcp -m comment --comment "proxy ports are reached through the portals only" -m multiport --dports 40001,40002 -j DROP
-A KUBE-PORTALS-DIRECT -p udp -m comment --comment "proxy ports are reached through the portals only" -m multiport --dports 40003 -j DROP
COMMIT
"""

REFUSAL_LINES = [
    '-A KUBE-PORTALS-REJECT -p tcp -m comment --comment "default/empty:http has no endpoints" -m tcp --dport 40004 -j REJECT --reject-with tcp-reset',
    '-A KUBE-PORTALS-REJECT -p udp -m comment --comment "default/local:dns has no local endpoints" -m udp --dport 40005 -j DROP',
]


def test_every_portal_kind_renders_exact_rules() -> None:
    ruleset = build_rules(PORTALS, host_ip=HOST_IP)
    jumps = ruleset.jumps
    assert restore_payload(ruleset, NAT, missing_jumps=jumps) == EXPECTED_NAT
    assert restore_payload(ruleset, FILTER, missing_jumps=jumps) == EXPECTED_FILTER


def test_proxy_ports_without_endpoints_are_rejected_or_dropped() -> None:
    # No usable endpoint at all: REJECT (an ICMP port unreachable, as kube-proxy's filter
    # rules); some, none of them for this traffic (Local): DROP. Only the filter table, and
    # no portal: the service addresses keep leading to the proxy port.
    ruleset = build_rules([*PORTALS, *REFUSALS], host_ip=HOST_IP)
    assert ruleset.save_lines(FILTER)["KUBE-PORTALS-REJECT"] == REFUSAL_LINES
    assert ruleset.save_lines(NAT) == build_rules(PORTALS, host_ip=HOST_IP).save_lines(NAT)
    # On one listen address, only that address's proxy ports.
    one = build_rules(REFUSALS, host_ip=HOST_IP, listen_ip="192.168.7.9")
    assert one.save_lines(FILTER)["KUBE-PORTALS-REJECT"] == [
        line.replace("-A KUBE-PORTALS-REJECT ", "-A KUBE-PORTALS-REJECT -d 192.168.7.9/32 ")
        for line in REFUSAL_LINES
    ]
    # TCP is refused with a RST (an ICMP error is rate-limited per client), UDP with ICMP's
    # port unreachable, ICMPv6's in IPv6.
    udp = ServicePortName("default", "empty", "dns", Protocol.UDP)
    v6 = [Portal.refusing(EMPTY, 40004, IPFamily.V6, anywhere=False)]
    v6.append(Portal.refusing(udp, 40006, IPFamily.V6, anywhere=False))
    assert build_rules(v6, host_ip="fd00::1").save_lines(FILTER)["KUBE-PORTALS-REJECT"] == [
        '-A KUBE-PORTALS-REJECT -p udp -m comment --comment "default/empty:dns has no endpoints" '
        "-m udp --dport 40006 -j REJECT --reject-with icmp6-port-unreachable",
        REFUSAL_LINES[0],
    ]


def test_unreachable_chains_are_filled_commit_by_commit_jumps_last() -> None:
    # Every jump of the table is missing: no packet enters the chains until the last commit,
    # so they are filled in commits of at most `chunk` rules, and the jumps come last.
    ruleset = build_rules(PORTALS, host_ip=HOST_IP)
    commits = rewrite_commits(ruleset, NAT, missing_jumps=ruleset.jumps, chunk=4)
    rule_lines = [line for line in EXPECTED_NAT.splitlines() if line.startswith("-A KUBE-")]
    jump_lines = [line for line in EXPECTED_NAT.splitlines() if " -j KUBE-" in line]
    assert len(rule_lines) == 11 and len(commits) == 3
    blocks = [c.splitlines() for c in commits]
    assert all(b[0] == "*nat" and b[-1] == "COMMIT" for b in blocks)
    assert [line for line in blocks[0] if line.startswith(":")] == [
        f":{chain} - [0:0]" for chain in CHAINS[NAT]
    ]
    assert [len([x for x in b if x.startswith("-A KUBE-")]) for b in blocks] == [4, 4, 3]
    assert [x for b in blocks for x in b if x.startswith("-A KUBE-")] == rule_lines
    assert [x for x in blocks[-1] if " -j KUBE-" in x] == jump_lines
    assert not any(" -j KUBE-" in x for b in blocks[:-1] for x in b)
    # The commits together install what the one-commit rewrite does.
    assert sorted(x for b in blocks for x in b if x not in ("*nat", "COMMIT")) == sorted(
        EXPECTED_NAT.splitlines()[1:-1]
    )
    # Staged chains a stopped live rewrite left (known from a read) go in the first commit.
    leftovers = ["KUBE-PORTALS-HOST-NEW", "KUBE-NODEPORT-NON-LOCAL-OLD"]
    first = rewrite_commits(
        ruleset, NAT, missing_jumps=ruleset.jumps, chunk=4, leftovers=leftovers
    )[0].splitlines()
    assert [x for x in first if "-NEW" in x or "-OLD" in x] == [
        ":KUBE-PORTALS-HOST-NEW - [0:0]",
        "-X KUBE-PORTALS-HOST-NEW",
    ]  # the filter table's leftover goes with filter


@pytest.mark.parametrize("reachable", ["one jump in place", "a stale jump"])
def test_partly_reachable_chains_are_rewritten_in_one_commit(reachable: str) -> None:
    # Some jumps lead into the chains and others do not (or a stale one does): they serve
    # traffic, and which of them exist is not known, so one commit.
    ruleset = build_rules(PORTALS, host_ip=HOST_IP)
    missing = list(ruleset.jumps_in(NAT))
    stale: list[str] = []
    if reachable == "one jump in place":
        missing = missing[1:]
    else:
        stale = [missing[0].save_line().replace("PREROUTING", "OUTPUT")]
    commits = rewrite_commits(ruleset, NAT, missing_jumps=missing, stale_jumps=stale, chunk=4)
    assert len(commits) == 1
    assert commits[0] == restore_payload(ruleset, NAT, missing_jumps=missing, stale_jumps=stale)


class Kernel:
    """Chains as iptables-nft-restore changes them, a rule as its matches and its target:
    a jump names its chain as the kernel holds it (the chain itself: a rename carries it)."""

    def __init__(self) -> None:
        self.chains: dict[str, list[list[str]]] = {"PREROUTING": [], "OUTPUT": []}

    def apply(self, commit: str) -> None:
        freed: set[str] = set()  # names renamed away in this commit
        for line in commit.splitlines():
            if line.startswith("*") or line == "COMMIT":
                freed.clear()
                continue
            op, chain, *rest = line.split(" ", 2)
            if op.startswith(":"):
                self.chains[op[1:]] = []
            elif op == "-X":
                assert not self.chains.pop(chain) and not self.jumps_to(chain), line
            elif op == "-F":
                self.chains[chain] = []
            elif op == "-E":
                # The kernel refuses a taken name, and one freed in the same commit.
                assert rest[0] not in self.chains and rest[0] not in freed, line
                self.chains[rest[0]] = self.chains.pop(chain)
                freed.add(chain)
                for rules in self.chains.values():
                    for rule in rules:
                        rule[1:] = [rest[0] if t == chain else t for t in rule[1:]]
            elif op == "-A":
                self.chains[chain].append(rest[0].rsplit(" -j ", 1))
            elif op == "-I":
                position, spec = rest[0].split(" ", 1)
                self.chains[chain].insert(int(position) - 1, spec.rsplit(" -j ", 1))
            else:
                assert op == "-D", line
                self.chains[chain].remove(rest[0].rsplit(" -j ", 1))

    def jumps_to(self, chain: str) -> list[str]:
        return [r[0] for rules in self.chains.values() for r in rules if r[1:] == [chain]]

    def reached(self) -> list[list[str]]:
        """What packets meet in each chain a built-in chain jumps to, as text."""
        return [
            [" -j ".join(r) for r in self.chains[r[1]]]
            for builtin in ("PREROUTING", "OUTPUT")
            for r in self.chains[builtin]
            if r[1] in self.chains
        ]


def installed(ruleset: RuleSet) -> Kernel:
    """A kernel with ``ruleset``'s nat chains, and somebody else's jump among uproxy's."""
    kernel = Kernel()
    kernel.apply(restore_payload(ruleset, NAT, missing_jumps=ruleset.jumps_in(NAT)))
    kernel.chains["PREROUTING"].insert(1, ["-p tcp", "OTHER"])
    kernel.chains["OTHER"] = [["-p tcp", "ACCEPT"]]
    return kernel


def test_live_chains_are_rewritten_in_chains_of_their_own_then_swapped_in() -> None:
    # Every jump in place: the chains serve traffic. The new rules fill chains of their own,
    # a commit at a time; after every commit each jump leads to all the old rules or all the
    # new ones, and at the end the chains hold exactly what a rewrite gives, under their own
    # names, every jump where it stood.
    old = build_rules(PORTALS[:3], host_ip=HOST_IP)
    new = build_rules(PORTALS[1:], host_ip=HOST_IP)
    kernel, final = installed(old), installed(new)
    before, after = kernel.reached(), final.reached()
    assert before != after
    commits = rewrite_commits(new, NAT, chunk=3)
    rules = len(new.rules_in(NAT))
    assert len(commits) == -(-rules // 3) + 3  # fill, turn the jumps, rename, clean up
    for commit in commits:
        kernel.apply(commit)
        assert kernel.reached() in (before, after), commit
    assert kernel.chains == final.chains
    # A live rewrite that stopped before its clean-up commit is no obstacle to the next.
    kernel.apply("".join(commits[:-1]))
    leftover = Kernel()
    leftover.chains = {c: [list(r) for r in rules] for c, rules in kernel.chains.items()}
    for commit in rewrite_commits(old, NAT, chunk=3):
        leftover.apply(commit)
    assert leftover.chains == installed(old).chains


def test_live_and_unreachable_chains_fill_in_their_own_commit_sizes() -> None:
    new = build_rules(PORTALS[1:], host_ip=HOST_IP)
    rules = len(new.rules_in(NAT))
    live = rewrite_commits(new, NAT, chunk=2, staged_chunk=4)  # every jump in place
    assert len(live) == -(-rules // 4) + 3
    fresh = rewrite_commits(new, NAT, missing_jumps=new.jumps_in(NAT), chunk=2, staged_chunk=4)
    assert len(fresh) == -(-rules // 2)  # the jumps come in the last of them


def test_installed_jumps_are_not_repeated() -> None:
    ruleset = build_rules(PORTALS, host_ip=HOST_IP)
    payload = restore_payload(ruleset, NAT)
    assert "-I PREROUTING" not in payload
    assert "-A OUTPUT" not in payload
    assert payload.count("\n-A KUBE-") == 11


def test_order_is_independent_of_input_order_and_duplicates() -> None:
    forward = build_rules(PORTALS, host_ip=HOST_IP)
    backward = build_rules([*reversed(PORTALS), PORTALS[0]], host_ip=HOST_IP)
    assert forward == backward


@pytest.mark.parametrize("kind", [PortalKind.EXTERNAL_IP, PortalKind.LB_INGRESS])
def test_another_services_external_address_never_comes_before_a_cluster_ip(
    kind: PortalKind,
) -> None:
    """A tenant's Service in namespace "a0" with externalIPs naming the ClusterIP and port of
    a Service in "t9" took t9's traffic, from pods and from the node: its rules came first
    in both portal chains, as its name sorted first."""
    victim = ServicePortName("t9", "db", "pg", Protocol.TCP)
    tenant = ServicePortName("a0", "evil", "pg", Protocol.TCP)
    ruleset = build_rules(
        [
            Portal(victim, PortalKind.CLUSTER_IP, "10.96.0.20", 5432, 40001),
            Portal(tenant, PortalKind.CLUSTER_IP, "10.96.0.21", 5432, 40002),
            Portal(tenant, kind, "10.96.0.20", 5432, 40002),
        ],
        host_ip=HOST_IP,
    )
    for chain in ("KUBE-PORTALS-CONTAINER", "KUBE-PORTALS-HOST"):
        first = next(r for r in ruleset.rules if r.chain == chain and r.dst == "10.96.0.20/32")
        assert first.comment == str(victim), chain


def test_listen_address_uses_dnat_from_containers() -> None:
    ruleset = build_rules(PORTALS[:1], host_ip=HOST_IP, listen_ip="192.168.7.2")
    lines = [r.save_line() for r in ruleset.rules]
    assert lines == [
        '-A KUBE-PORTALS-CONTAINER -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http"'
        " -m tcp --dport 80 -j DNAT --to-destination 192.168.7.2:40001",
        '-A KUBE-PORTALS-HOST -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http"'
        " -m tcp --dport 80 -j DNAT --to-destination 192.168.7.2:40001",
        # Straight to the proxy port: only on the listen address, the one it is bound to.
        "-A KUBE-PORTALS-DIRECT -d 192.168.7.2/32 -p tcp -m comment --comment "
        '"proxy ports are reached through the portals only" -m multiport --dports 40001 -j DROP',
    ]


@pytest.mark.parametrize("bad", ["127.0.0.1", "0.0.0.0"])
def test_host_ip_must_be_routable(bad: str) -> None:
    # DNAT to 127.0.0.1 needs route_localnet (CVE-2020-8558); never allowed.
    with pytest.raises(ValueError, match="routable"):
        build_rules(PORTALS, host_ip=bad)


def test_empty_set_still_declares_every_chain() -> None:
    ruleset = build_rules([], host_ip=HOST_IP)
    payload = restore_payload(ruleset, NAT)
    for chain in CHAINS[NAT]:
        assert f":{chain} - [0:0]\n" in payload
    assert "-A " not in payload


def test_ipv6_portal_renders_v6_forms() -> None:
    portal = Portal(WEB, PortalKind.CLUSTER_IP, "fd00::a", 80, 40001)
    ruleset = build_rules([portal], host_ip="fd00::1")
    assert ruleset.rules[0].dst == "fd00::a/128"
    assert ruleset.rules[1].to_destination == "[fd00::1]:40001"


@pytest.mark.parametrize(
    ("value", "expected"),
    [("plain_-9", "plain_-9"), ("ns/a:b", '"ns/a:b"'), ('a"b', '"a\\"b"'), ("", '""')],
)
def test_quote_matches_iptables_save(value: str, expected: str) -> None:
    assert quote(value) == expected


def test_dial_mark_returns_first_in_both_host_chains() -> None:
    ruleset = build_rules(PORTALS, host_ip=HOST_IP, dial_mark=0x1000)
    nat = ruleset.save_lines(NAT)
    mark = '-m mark --mark 0x1000/0x1000 -m comment --comment "uproxy dials to endpoints skip the portals" -j RETURN'
    assert nat["KUBE-PORTALS-HOST"][0] == f"-A KUBE-PORTALS-HOST {mark}"
    assert nat["KUBE-NODEPORT-HOST"][0] == f"-A KUBE-NODEPORT-HOST {mark}"
    assert sum(mark in line for chain in nat.values() for line in chain) == 2
    assert len(nat["KUBE-PORTALS-HOST"]) == 5 and len(nat["KUBE-NODEPORT-HOST"]) == 2
    # Nothing else moves, and with no mark there is no such rule.
    unmarked = build_rules(PORTALS, host_ip=HOST_IP).save_lines(NAT)
    assert nat["KUBE-PORTALS-HOST"][1:] == unmarked["KUBE-PORTALS-HOST"]
    assert "mark" not in restore_payload(build_rules(PORTALS, host_ip=HOST_IP), NAT)


@pytest.mark.parametrize(
    ("mark", "text"), [(0x4000, "0x4000/0x4000"), (0x3, "0x3/0x3"), (0xFFFFFFFF, "0xffffffff")]
)
def test_mark_match_is_canonical(mark: int, text: str) -> None:
    assert mark_match(mark) == text


# ----- source ranges, --nodeport-addresses, traffic from the cluster -----------------------

LB = "198.51.100.9"
C = '-p tcp -m comment --comment "default/web:http" -m tcp --dport'


def lines(ruleset: RuleSet, chain: str) -> list[str]:
    return [r.save_line().removeprefix(f"-A {chain} ") for r in ruleset.rules_in_chain(chain)]


def test_source_ranges_redirect_only_allowed_sources_and_drop_the_rest() -> None:
    portal = Portal(WEB, PortalKind.LB_INGRESS, LB, 80, 40002, 0, ("10.1.0.0/16", "192.0.2.7/32"))
    ruleset = build_rules([portal], host_ip=HOST_IP)
    assert lines(ruleset, "KUBE-PORTALS-CONTAINER") == [
        f"-s 10.1.0.0/16 -d {LB}/32 {C} 80 -j REDIRECT --to-ports 40002",
        f"-s 192.0.2.7/32 -d {LB}/32 {C} 80 -j REDIRECT --to-ports 40002",
    ]
    # The node itself is always let in (its host portal ignores the source).
    assert lines(ruleset, "KUBE-PORTALS-HOST") == [
        f"-d {LB}/32 {C} 80 -j DNAT --to-destination {HOST_IP}:40002"
    ]
    assert lines(ruleset, "KUBE-PORTALS-FIREWALL") == [f"-d {LB}/32 {C} 80 -j DROP"]
    assert {(j.chain, j.ct_new) for j in ruleset.jumps if j.target == "KUBE-PORTALS-FIREWALL"} == {
        ("INPUT", True),
        ("FORWARD", True),
    }


@pytest.mark.parametrize(
    ("ranges", "expected"),
    [
        pytest.param(("0.0.0.0/0",), [None], id="everyone"),
        pytest.param(("10.1.0.0/16", "10.1.2.0/24", "10.0.0.0/16"), ["10.0.0.0/15"], id="merged"),
        pytest.param(("fd00::/8",), [None], id="ipv6-only"),
    ],
)
def test_source_ranges_are_merged_and_everyone_means_no_firewall(
    ranges: tuple[str, ...], expected: list[str | None]
) -> None:
    ruleset = build_rules(
        [Portal(WEB, PortalKind.LB_INGRESS, LB, 80, 40002, 0, ranges)], host_ip=HOST_IP
    )
    assert [r.src for r in ruleset.rules_in_chain("KUBE-PORTALS-CONTAINER")] == expected
    assert bool(ruleset.rules_in_chain("KUBE-PORTALS-FIREWALL")) == (expected != [None])


def test_nodeport_addresses_become_one_jump_per_cidr() -> None:
    ruleset = build_rules(PORTALS, host_ip=HOST_IP, nodeport_cidrs=("10.0.0.0/8", "192.168.7.1/32"))
    jumps = [j.save_line() for j in ruleset.jumps if j.target == "KUBE-NODEPORT-CONTAINER"]
    comment = '-m comment --comment "handle service NodePorts; NOTE: this must be the last rule in the chain"'
    assert jumps == [
        f"-A PREROUTING -d 10.0.0.0/8 -m addrtype --dst-type LOCAL {comment} -j KUBE-NODEPORT-CONTAINER",
        f"-A PREROUTING -d 192.168.7.1/32 -m addrtype --dst-type LOCAL {comment} -j KUBE-NODEPORT-CONTAINER",
    ]
    assert [j.dst for j in ruleset.jumps if j.target == "KUBE-NODEPORT-HOST"] == [
        "10.0.0.0/8",
        "192.168.7.1/32",
    ]
    # The node-port rules themselves do not change: the jumps choose the addresses.
    assert ruleset.rules == build_rules(PORTALS, host_ip=HOST_IP).rules


def test_the_direct_drop_jump_matches_the_proxy_port_range_only() -> None:
    """Known, the range proxy ports are taken from narrows the jump, one per protocol: a new
    connection to the node's own services (ssh, the kubelet) walked the whole chain, ~830
    rules at 10,000 services, 18 % of their connection rate."""
    jumps = make_jumps(proxy_ports=(32768, 60999))
    direct = [j.save_line() for j in jumps if j.target == "KUBE-PORTALS-DIRECT"]
    rest = (
        "-m conntrack --ctstate NEW -m conntrack ! --ctstate DNAT -m addrtype ! --src-type LOCAL "
        '-m comment --comment "drop new connections to proxy ports that no portal translated" '
        "-j KUBE-PORTALS-DIRECT"
    )
    assert direct == [
        f"-A INPUT -p tcp -m tcp --dport 32768:60999 {rest}",
        f"-A INPUT -p udp -m udp --dport 32768:60999 {rest}",
    ]
    unknown = [j.save_line() for j in make_jumps() if j.target == "KUBE-PORTALS-DIRECT"]
    assert unknown == [f"-A INPUT {rest}"]
    # First in INPUT, before the other jumps, either way.
    assert [j.target for j in jumps if j.chain == "INPUT"][:2] == ["KUBE-PORTALS-DIRECT"] * 2


SPLIT = [
    Portal(WEB, PortalKind.EXTERNAL_IP, "203.0.113.5", 80, 40002, 40001),
    Portal(WEB, PortalKind.LB_INGRESS, LB, 80, 40002, 40001, ("10.0.0.0/8", "192.0.2.0/24")),
    Portal(WEB, PortalKind.NODE_PORT, None, 30080, 40002, 40001),
]


def test_local_policy_without_detection_short_circuits_the_node_only() -> None:
    ruleset = build_rules(SPLIT, host_ip=HOST_IP)
    to = f"-j DNAT --to-destination {HOST_IP}:40001"
    assert lines(ruleset, "KUBE-PORTALS-HOST") == [
        f"-d 203.0.113.5/32 {C} 80 -m addrtype --dst-type LOCAL {to}",
        f"-d {LB}/32 {C} 80 {to}",
    ]
    assert lines(ruleset, "KUBE-NODEPORT-HOST") == [f"{C} 30080 {to}"]
    # From containers everything goes to the external port, as without the policy.
    container = lines(ruleset, "KUBE-PORTALS-CONTAINER") + lines(ruleset, "KUBE-NODEPORT-CONTAINER")
    assert all(line.endswith("--to-ports 40002") for line in container)
    # Both proxy ports are accepted behind a default-deny INPUT.
    assert [r.dport for r in ruleset.rules_in_chain("KUBE-NODEPORT-NON-LOCAL")] == [40002, 40001]


def test_cluster_cidr_sends_pods_to_the_cluster_port_first() -> None:
    local = LocalTraffic(cidrs=("10.244.0.0/16", "fd00:244::/48"))
    ruleset = build_rules(SPLIT, host_ip=HOST_IP, local=local)
    cluster, external = "-j REDIRECT --to-ports 40001", "-j REDIRECT --to-ports 40002"
    ext = "-d 203.0.113.5/32"
    assert lines(ruleset, "KUBE-PORTALS-CONTAINER") == [
        f"-s 10.244.0.0/16 {ext} {C} 80 -m physdev ! --physdev-is-in {cluster}",
        f"-s 10.244.0.0/16 {ext} {C} 80 -m addrtype --dst-type LOCAL {cluster}",
        f"{ext} {C} 80 -m physdev ! --physdev-is-in {external}",
        f"{ext} {C} 80 -m addrtype --dst-type LOCAL {external}",
        # Pods within each source range: 10.244.0.0/16 is inside 10.0.0.0/8, outside the other.
        f"-s 10.244.0.0/16 -d {LB}/32 {C} 80 {cluster}",
        f"-s 10.0.0.0/8 -d {LB}/32 {C} 80 {external}",
        f"-s 192.0.2.0/24 -d {LB}/32 {C} 80 {external}",
    ]
    assert lines(ruleset, "KUBE-NODEPORT-CONTAINER") == [
        f"-s 10.244.0.0/16 {C} 30080 {cluster}",
        f"{C} 30080 {external}",
    ]


@pytest.mark.parametrize(
    ("local", "match"),
    [
        (LocalTraffic(interface="cbr0"), "-i cbr0"),
        (LocalTraffic(interface="veth", prefix=True), "-i veth+"),
    ],
)
def test_interface_modes_match_the_input_interface(local: LocalTraffic, match: str) -> None:
    ruleset = build_rules(SPLIT[1:], host_ip=HOST_IP, local=local)
    assert lines(ruleset, "KUBE-PORTALS-CONTAINER")[0] == (
        f"-s 10.0.0.0/8 -d {LB}/32 {match} {C} 80 -j REDIRECT --to-ports 40001"
    )
    assert lines(ruleset, "KUBE-NODEPORT-CONTAINER")[0] == (
        f"{match} {C} 30080 -j REDIRECT --to-ports 40001"
    )


def test_pods_are_not_matched_for_portals_without_a_cluster_port() -> None:
    local = LocalTraffic(cidrs=("10.244.0.0/16",))
    assert build_rules(PORTALS, host_ip=HOST_IP, local=local) == build_rules(
        PORTALS, host_ip=HOST_IP
    )


@pytest.mark.parametrize(
    ("allowed", "pods", "expected"),
    [
        ("10.0.0.0/8", "10.244.0.0/16", ["10.244.0.0/16"]),
        ("10.244.1.0/24", "10.244.0.0/16", ["10.244.1.0/24"]),
        ("192.0.2.0/24", "10.244.0.0/16", []),
        ("192.0.2.0/24", None, ["192.0.2.0/24"]),
        (None, "10.244.0.0/16", ["10.244.0.0/16"]),
    ],
)
def test_pods_within_a_range_is_the_smaller_cidr(
    allowed: str | None, pods: str | None, expected: list[str]
) -> None:
    source = Source(pods, None if pods else "cbr0")
    assert [s.src for s in within(allowed, [source])] == expected


def test_stale_jumps_are_deleted_in_the_same_commit() -> None:
    ruleset = build_rules(PORTALS, host_ip=HOST_IP, nodeport_cidrs=("10.0.0.0/8",))
    old = build_rules(PORTALS, host_ip=HOST_IP).jumps
    stale = [j.save_line() for j in old if j.dst_local]  # the node-port jumps without -d
    payload = restore_payload(ruleset, NAT, stale_jumps=stale)
    assert "-D PREROUTING -m addrtype --dst-type LOCAL" in payload
    assert "-D OUTPUT -m addrtype --dst-type LOCAL" in payload
    assert "-D " not in restore_payload(ruleset, FILTER, stale_jumps=stale)


def test_jumps_inserted_together_keep_their_order() -> None:
    ruleset = build_rules(PORTALS, host_ip=HOST_IP)
    inputs = [j for j in ruleset.jumps if j.chain == "INPUT"]
    assert [p for _, p in insert_positions(ruleset.jumps, ruleset.jumps) if _.chain == "INPUT"] == [
        1,
        2,
        3,
        4,
    ]
    # Only the last missing: it goes on top (the others are somewhere in the chain already).
    assert insert_positions(ruleset.jumps, inputs[3:]) == [(inputs[3], 1)]
    assert insert_positions(ruleset.jumps, inputs[2:]) == [(inputs[2], 1), (inputs[3], 2)]
    # The direct drop is the first jump: installed alone (an upgrade), it still is.
    assert inputs[0].target == "KUBE-PORTALS-DIRECT"
    assert insert_positions(ruleset.jumps, inputs[:1]) == [(inputs[0], 1)]


def test_cidrs_of_every_address_narrow_nothing() -> None:
    # iptables-save leaves "-d 0.0.0.0/0" out: such a jump would never compare as installed.
    everywhere = build_rules(PORTALS, host_ip=HOST_IP, nodeport_cidrs=("0.0.0.0/0", "10.0.0.0/8"))
    assert everywhere.jumps == build_rules(PORTALS, host_ip=HOST_IP).jumps
    every_pod = build_rules(SPLIT, host_ip=HOST_IP, local=LocalTraffic(cidrs=("0.0.0.0/0",)))
    first = every_pod.rules_in_chain("KUBE-NODEPORT-CONTAINER")[0]
    assert (first.src, first.to_ports) == (None, "40001")


# ----- IPv6 (ip6tables) ------------------------------------------------------------------------

HOST6 = "fd00:200:3::1"
SIX = [
    Portal(WEB, PortalKind.CLUSTER_IP, "fd00:96::10", 80, 40011),
    Portal(WEB, PortalKind.EXTERNAL_IP, "2001:db8::5", 80, 40012, 40011),
    Portal(WEB, PortalKind.LB_INGRESS, "2001:db8::9", 80, 40012, 40011, ("2001:db8:1::/48",)),
    Portal(WEB, PortalKind.NODE_PORT, None, 30080, 40012, 40011, (), IPFamily.V6),
]


def test_ipv6_rules_are_the_same_rules_with_ipv6_cidrs_only() -> None:
    # Dual-stack settings: each family's rules take the CIDRs of their own family alone.
    local = LocalTraffic(cidrs=("10.244.0.0/16", "fd00:244::/48"))
    ruleset = build_rules(
        SIX,
        host_ip=HOST6,
        dial_mark=0x1000,
        local=local,
        nodeport_cidrs=("10.0.0.0/8", "fd00:200:3::/64"),
    )
    cluster, external = "-j REDIRECT --to-ports 40011", "-j REDIRECT --to-ports 40012"
    to = f"-j DNAT --to-destination [{HOST6}]"
    pods, ext, lb = "-s fd00:244::/48", "-d 2001:db8::5/128", "-d 2001:db8::9/128"
    assert lines(ruleset, "KUBE-PORTALS-CONTAINER") == [
        f"-d fd00:96::10/128 {C} 80 {cluster}",
        f"{pods} {ext} {C} 80 -m physdev ! --physdev-is-in {cluster}",
        f"{pods} {ext} {C} 80 -m addrtype --dst-type LOCAL {cluster}",
        f"{ext} {C} 80 -m physdev ! --physdev-is-in {external}",
        f"{ext} {C} 80 -m addrtype --dst-type LOCAL {external}",
        f"-s 2001:db8:1::/48 {lb} {C} 80 {external}",  # pods are not in the source range
    ]
    assert lines(ruleset, "KUBE-PORTALS-HOST")[1:] == [
        f"-d fd00:96::10/128 {C} 80 {to}:40011",
        f"{ext} {C} 80 -m addrtype --dst-type LOCAL {to}:40011",
        f"{lb} {C} 80 {to}:40011",
    ]
    assert lines(ruleset, "KUBE-NODEPORT-CONTAINER") == [
        f"{pods} {C} 30080 {cluster}",
        f"{C} 30080 {external}",
    ]
    assert lines(ruleset, "KUBE-NODEPORT-HOST")[1:] == [f"{C} 30080 {to}:40011"]
    assert lines(ruleset, "KUBE-PORTALS-FIREWALL") == [f"{lb} {C} 80 -j DROP"]
    assert [j.dst for j in ruleset.jumps if j.target == "KUBE-NODEPORT-HOST"] == ["fd00:200:3::/64"]


def test_a_portal_of_the_other_family_is_refused() -> None:
    with pytest.raises(ValueError, match="is IPv4, these rules are IPv6"):
        build_rules(PORTALS[:1], host_ip=HOST6)
    with pytest.raises(ValueError, match="is IPv6, these rules are IPv4"):
        build_rules(SIX[3:], host_ip=HOST_IP)  # an IPv6 node port


def test_stacks_pair_each_host_address_with_a_listen_address_of_its_family() -> None:
    assert stacks(HOST_IP) == [Stack(IPFamily.V4, HOST_IP, "0.0.0.0")]
    assert stacks([HOST_IP, HOST6], "0.0.0.0") == [
        Stack(IPFamily.V4, HOST_IP, "0.0.0.0"),
        Stack(IPFamily.V6, HOST6, "::"),
    ]
    assert stacks(HOST6, HOST6) == [Stack(IPFamily.V6, HOST6, HOST6)]
    with pytest.raises(ValueError, match="two host addresses of IPv4"):
        stacks([HOST_IP, "10.0.0.1"])
    with pytest.raises(ValueError, match="not ::1"):
        stacks("::1")  # never loopback: DNAT to ::1 would not work (and 127/8 needs route_localnet)


def test_portals_split_by_family() -> None:
    split = split_by_family([*PORTALS, *SIX], [IPFamily.V4, IPFamily.V6])
    assert split[IPFamily.V4] == frozenset(PORTALS)
    assert split[IPFamily.V6] == frozenset(SIX)
    given = frozenset(PORTALS)
    assert split_by_family(given, [IPFamily.V4])[IPFamily.V4] is given  # one family: no copy


# ----- KUBE-PORTALS-DIRECT ----------------------------------------------------------------------

DIRECT_COMMENT = '-m comment --comment "proxy ports are reached through the portals only"'


def test_direct_connections_to_every_proxy_port_are_dropped() -> None:
    # Every proxy port a portal leads to (a Local policy's cluster port too), per protocol;
    # a refusal adds none. Only new connections no portal translated, not from the node.
    ruleset = build_rules([*SPLIT, *PORTALS, *REFUSALS], host_ip=HOST_IP)
    assert ruleset.save_lines(FILTER)["KUBE-PORTALS-DIRECT"] == [
        f"-A KUBE-PORTALS-DIRECT -p tcp {DIRECT_COMMENT} -m multiport --dports 40001,40002 -j DROP",
        f"-A KUBE-PORTALS-DIRECT -p udp {DIRECT_COMMENT} -m multiport --dports 40003 -j DROP",
    ]
    direct = [j for j in ruleset.jumps if j.target == "KUBE-PORTALS-DIRECT"]
    assert [j.save_line() for j in direct] == [
        "-A INPUT -m conntrack --ctstate NEW -m conntrack ! --ctstate DNAT "
        "-m addrtype ! --src-type LOCAL -m comment --comment "
        '"drop new connections to proxy ports that no portal translated" -j KUBE-PORTALS-DIRECT'
    ]
    # The node-port accept takes translated connections only, never a direct one.
    assert ruleset.save_lines(FILTER)["KUBE-NODEPORT-NON-LOCAL"][0].endswith(
        "-m state --state NEW -m conntrack --ctstate DNAT -j ACCEPT"
    )
    assert build_rules(REFUSALS, host_ip=HOST_IP).save_lines(FILTER)["KUBE-PORTALS-DIRECT"] == []
    # IPv6: the same chain in ip6tables.
    six = build_rules(SIX, host_ip=HOST6).save_lines(FILTER)["KUBE-PORTALS-DIRECT"]
    assert six == [
        f"-A KUBE-PORTALS-DIRECT -p tcp {DIRECT_COMMENT} -m multiport --dports 40011,40012 -j DROP"
    ]


def test_direct_drops_hold_fifteen_ports_at_most() -> None:
    # 10,000 proxy ports of one protocol, spread over the kernel's ephemeral range: ~820
    # rules, in port order, each port once (consecutive ports: fewer).
    spn = ServicePortName("ns", "many", "p", Protocol.TCP)
    ports = random.Random(7).sample(range(32768, 61000), 10_000)
    portals = [
        Portal(spn, PortalKind.CLUSTER_IP, f"10.96.{i // 250}.{i % 250 + 1}", 80, p)
        for i, p in enumerate(ports)
    ]
    rules = build_rules(portals, host_ip=HOST_IP).rules_in_chain("KUBE-PORTALS-DIRECT")
    groups = [[int(p) for p in (r.dports or "").split(",")] for r in rules]
    assert 667 <= len(rules) <= 850
    assert all(1 <= len(g) <= 15 for g in groups)
    assert [p for g in groups for p in g] == sorted(ports)
    assert 667 <= len(direct_groups(range(40000, 50000))) <= 720


def test_groups_are_the_ports_own_and_mostly_stay() -> None:
    # A pure function of the ports (a restart builds the same rules), whose groups mostly
    # survive a port coming or going: a new service edits a few rules, not every one after it.
    rng = random.Random(3)
    ports = set(rng.sample(range(32768, 61000), 3000))
    groups = direct_groups(ports)
    assert direct_groups(sorted(ports, reverse=True)) == groups
    free = sorted(set(range(32768, 61000)) - ports)
    changed = []
    for _ in range(100):
        port = rng.choice(free)
        changed.append(len(set(direct_groups(ports | {port})) - set(groups)))
        port = rng.choice(sorted(ports))
        changed.append(len(set(direct_groups(ports - {port})) - set(groups)))
    assert sum(changed) / len(changed) <= 4 and max(changed) <= 32
    assert direct_groups([]) == []
    assert direct_groups([5, 3, 4]) == [(3, 4, 5)]


def test_a_new_service_edits_a_few_direct_drops() -> None:
    spn = ServicePortName("ns", "many", "p", Protocol.TCP)
    ports = random.Random(3).sample(range(30000, 40000), 3000)
    portals = [
        Portal(spn, PortalKind.CLUSTER_IP, f"10.96.{i // 250}.{i % 250 + 1}", 80, p)
        for i, p in enumerate(ports)
    ]
    builder = RuleBuilder(host_ip=HOST_IP)
    before = builder.build(portals)
    added = Portal(spn, PortalKind.CLUSTER_IP, "10.97.0.1", 80, 45000)
    after = builder.build([*portals[1:], added])
    old = before.rules_in_chain("KUBE-PORTALS-DIRECT")
    new = after.rules_in_chain("KUBE-PORTALS-DIRECT")
    kept = {id(r) for r in old} & {id(r) for r in new}  # the edits tell rules by identity
    assert len(old) - len(kept) <= 8 and len(new) - len(kept) <= 8
    assert new[-1].dports is not None and new[-1].dports.endswith(",45000")
    # The very rules a new builder (a restart) makes.
    assert RuleBuilder(host_ip=HOST_IP).build([*portals[1:], added]) == after
