"""The nftables backend without a kernel: exact nft text, element diffs, and when it spawns nft."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.rules.test_portals import DNS, HOST_IP, PORTALS, REFUSALS, WEB
from uproxy.model import IPFamily, Protocol, ServicePortName
from uproxy.rules import NftablesBackend, RulesError, command, make_backend, nftables
from uproxy.rules.base import LocalTraffic, Portal, PortalKind
from uproxy.rules.nftables import (
    CLUSTER_IPS,
    DROPPED_PROXY_PORTS,
    EXTERNAL_IPS,
    FIREWALLED_LB_IPS,
    IPV4 as V4,
    IPV6,
    LB_SOURCE_RANGES,
    NODE_PORT_PROXY_PORTS,
    NODE_PORTS,
    PROXY_PORTS,
    REJECTED_PROXY_PORTS,
    SENTINEL_COMMENT,
    SHORT_CIRCUIT_EXTERNAL_IPS,
    SHORT_CIRCUIT_LB_IPS,
    SHORT_CIRCUIT_NODE_PORTS,
    Element,
    ElementBuilder,
    Layout,
    diff,
    element_comment,
    parse_elements,
    parse_skeleton,
    render_delta,
    render_full,
    render_table,
)
from uproxy.rules.watch import FULL_SYNC_PERIOD_S, Watch

MARK = 0x1000

EXPECTED_FULL = """\
add table ip uproxy
delete table ip uproxy
table ip uproxy {
	map cluster-ips {
		type ipv4_addr . inet_proto . inet_service : inet_service
		elements = { 0.0.0.0 . tcp . 0 comment "uproxy sentinel (not a service)" : 0,
			10.96.0.10 . tcp . 80 comment "default/web:http" : 40001,
			10.96.0.53 . udp . 53 comment "kube-system/dns" : 40003,
			198.51.100.9 . tcp . 80 comment "default/web:http" : 40002 }
	}
	map external-ips {
		type ipv4_addr . inet_proto . inet_service : inet_service
		elements = { 0.0.0.0 . tcp . 0 comment "uproxy sentinel (not a service)" : 0,
			203.0.113.5 . tcp . 80 comment "default/web:http" : 40002 }
	}
	map node-ports {
		type inet_proto . inet_service : inet_service
		elements = { tcp . 0 comment "uproxy sentinel (not a service)" : 0,
			tcp . 30080 comment "default/web:http" : 40002 }
	}
	set node-port-proxy-ports {
		type inet_proto . inet_service
		elements = { tcp . 0 comment "uproxy sentinel (not a service)",
			tcp . 40002 comment "default/web:http" }
	}
	set proxy-ports {
		type inet_proto . inet_service
		elements = { tcp . 0 comment "uproxy sentinel (not a service)",
			tcp . 40001 comment "default/web:http",
			tcp . 40002 comment "default/web:http",
			udp . 40003 comment "kube-system/dns" }
	}
	map short-circuit-lb-ips {
		type ipv4_addr . inet_proto . inet_service : inet_service
		elements = { 0.0.0.0 . tcp . 0 comment "uproxy sentinel (not a service)" : 0 }
	}
	map short-circuit-external-ips {
		type ipv4_addr . inet_proto . inet_service : inet_service
		elements = { 0.0.0.0 . tcp . 0 comment "uproxy sentinel (not a service)" : 0 }
	}
	map short-circuit-node-ports {
		type inet_proto . inet_service : inet_service
		elements = { tcp . 0 comment "uproxy sentinel (not a service)" : 0 }
	}
	set firewalled-lb-ips {
		type ipv4_addr . inet_proto . inet_service
		elements = { 0.0.0.0 . tcp . 0 comment "uproxy sentinel (not a service)" }
	}
	set lb-source-ranges {
		type ipv4_addr . inet_proto . inet_service . ipv4_addr
		flags interval
		elements = { 0.0.0.0 . tcp . 0 . 0.0.0.0 comment "uproxy sentinel (not a service)" }
	}
	set rejected-proxy-ports {
		type inet_proto . inet_service
		elements = { tcp . 0 comment "uproxy sentinel (not a service)" }
	}
	set dropped-proxy-ports {
		type inet_proto . inet_service
		elements = { tcp . 0 comment "uproxy sentinel (not a service)" }
	}
	chain portals-firewall {
		type filter hook prerouting priority -110; policy accept;
		ct state new ip daddr . meta l4proto . th dport @firewalled-lb-ips ip daddr . meta l4proto . th dport . ip saddr != @lb-source-ranges drop
	}
	chain portals-container {
		type nat hook prerouting priority -101; policy accept;
		meta l4proto { tcp, udp } redirect to :ip daddr . meta l4proto . th dport map @cluster-ips
		meta iifkind != "bridge" meta l4proto { tcp, udp } redirect to :ip daddr . meta l4proto . th dport map @external-ips
		fib daddr type local meta l4proto { tcp, udp } redirect to :ip daddr . meta l4proto . th dport map @external-ips
	}
	chain portals-host {
		type nat hook output priority -101; policy accept;
		meta mark & 0x1000 == 0x1000 return comment "uproxy dials to endpoints skip the portals"
		meta l4proto { tcp, udp } dnat to 192.168.7.1:ip daddr . meta l4proto . th dport map @short-circuit-lb-ips
		meta l4proto { tcp, udp } dnat to 192.168.7.1:ip daddr . meta l4proto . th dport map @cluster-ips
		fib daddr type local meta l4proto { tcp, udp } dnat to 192.168.7.1:ip daddr . meta l4proto . th dport map @short-circuit-external-ips
		fib daddr type local meta l4proto { tcp, udp } dnat to 192.168.7.1:ip daddr . meta l4proto . th dport map @external-ips
	}
	chain node-ports-container {
		type nat hook prerouting priority -99; policy accept;
		fib daddr type local meta l4proto { tcp, udp } redirect to :meta l4proto . th dport map @node-ports
	}
	chain node-ports-host {
		type nat hook output priority -99; policy accept;
		meta mark & 0x1000 == 0x1000 return comment "uproxy dials to endpoints skip the portals"
		fib daddr type local meta l4proto { tcp, udp } dnat to 192.168.7.1:meta l4proto . th dport map @short-circuit-node-ports
		fib daddr type local meta l4proto { tcp, udp } dnat to 192.168.7.1:meta l4proto . th dport map @node-ports
	}
	chain node-ports-filter {
		type filter hook input priority 0; policy accept;
		ct state new ct status dnat meta l4proto . th dport @node-port-proxy-ports accept
	}
	chain no-endpoints {
		type filter hook input priority -1; policy accept;
		ct state new meta l4proto . th dport @rejected-proxy-ports meta l4proto tcp reject with tcp reset
		ct state new meta l4proto . th dport @rejected-proxy-ports reject
		ct state new meta l4proto . th dport @dropped-proxy-ports drop
	}
	chain proxy-ports-direct {
		type filter hook input priority -2; policy accept;
		ct state new ct status & dnat != dnat fib saddr type != local meta l4proto . th dport @proxy-ports drop
	}
	chain synced-by {
		return comment "uproxy test commit 1"
	}
}
"""


STAMP = "uproxy test commit 1"


def full(commit: int) -> str:
    """EXPECTED_FULL as the backend's ``commit``-th transaction writes it."""
    return EXPECTED_FULL.replace(STAMP, f"uproxy test commit {commit}")


def stamped(delta: str, commit: int, table: str = "ip") -> str:
    """An incremental transaction: ``delta`` and the new stamp."""
    where = f"{table} uproxy synced-by"
    rule = f'return comment "uproxy test commit {commit}"'
    return f"{delta}flush chain {where}\nadd rule {where} {rule}\n"


def elements(portals: list[Portal]) -> dict[str, dict[Any, Element]]:
    return ElementBuilder().build(portals)


def test_every_portal_kind_renders_exact_nft() -> None:
    layout = Layout(host_ip=HOST_IP, dial_mark=MARK)
    assert render_full(layout, elements(PORTALS), stamp=STAMP) == EXPECTED_FULL


def test_order_and_duplicates_do_not_change_the_text() -> None:
    layout = Layout(host_ip=HOST_IP, dial_mark=MARK)
    shuffled = [*reversed(PORTALS), PORTALS[0]]
    assert render_full(layout, elements(shuffled), stamp=STAMP) == EXPECTED_FULL


def test_listen_address_dnats_from_containers_too() -> None:
    layout = Layout(host_ip=HOST_IP, listen_ip="192.168.7.2")
    text = render_table(layout, elements(PORTALS), stamp=STAMP)
    assert "redirect" not in text
    assert text.count("dnat to 192.168.7.2:") == 10  # 4 container + 6 host rules
    assert HOST_IP not in text  # the host's traffic goes to the listen address as well


def test_without_dial_mark_no_return_rule() -> None:
    text = render_table(Layout(host_ip=HOST_IP), elements(PORTALS), stamp=STAMP)
    assert "meta mark" not in text
    assert text.count("return") == 1  # the stamp's rule only


def test_empty_table_declares_everything_with_only_sentinels() -> None:
    layout = Layout(host_ip=HOST_IP)
    text = render_table(layout, elements([]), stamp=STAMP)
    assert text.count("elements = {") == text.count(SENTINEL_COMMENT) == len(layout.stores)
    for name in (CLUSTER_IPS, EXTERNAL_IPS, NODE_PORTS, NODE_PORT_PROXY_PORTS):
        assert f" {name} {{\n" in text


@pytest.mark.parametrize("family", [V4, IPV6])
def test_sentinels_are_keys_no_packet_has(family: nftables.Family) -> None:
    host = "192.168.7.1" if family is V4 else "fd00::1"
    for store in Layout(family, host_ip=host).stores:
        sentinel = store.sentinel()
        width = 16 if family is IPV6 else 4
        addresses = store.type.count("_addr")
        assert sentinel.key[-1] in (0, "0.0.0.0", "::") and "tcp" in sentinel.key
        assert (sentinel.value is None) == (store.kind == "set")
        # The kernel's layout: each part of the key padded to 4 bytes; only TCP's 6 is set.
        assert len(store.sentinel_key()) == addresses * width + 4 + 4
        assert store.sentinel_key().count(0) == len(store.sentinel_key()) - 1


def test_sentinels_are_not_elements_of_any_service() -> None:
    # What a listing holds besides the sentinels is what uproxy installed: verify() and the
    # last run's ports (``previous``) never see them.
    layout = Layout(host_ip=HOST_IP)
    objects: list[dict[str, Any]] = []
    for store in layout.stores:
        sentinel = store.sentinel()
        key = {"concat": list(sentinel.key)}
        item = {"elem": {"val": key, "comment": sentinel.comment}}
        body = {"name": store.name, "elem": [[item, 0] if store.kind == "map" else item]}
        objects.append({store.kind: body})
    assert parse_elements(json.dumps({"nftables": objects})) == elements([])


def test_ipv6_twin_is_a_parameter() -> None:
    layout = Layout(IPV6, host_ip="fd00::1", dial_mark=MARK)
    portal = Portal(WEB, PortalKind.CLUSTER_IP, "fd00:0:0::a", 80, 40001)
    text = render_full(layout, ElementBuilder(IPV6).build([portal]), stamp=STAMP)
    assert text.startswith("add table ip6 uproxy\ndelete table ip6 uproxy\ntable ip6 uproxy {")
    assert "type ipv6_addr . inet_proto . inet_service : inet_service" in text
    assert "fd00::a . tcp . 80" in text
    assert "dnat to [fd00::1]:ip6 daddr . meta l4proto . th dport map @cluster-ips" in text
    with pytest.raises(ValueError, match="not an ip6 address"):
        ElementBuilder(IPV6).build([PORTALS[0]])


@pytest.mark.parametrize("bad", ["127.0.0.1", "0.0.0.0"])
def test_host_ip_must_be_routable(bad: str) -> None:
    with pytest.raises(RulesError, match="routable"):
        NftablesBackend(host_ip=bad)


def test_factory_builds_it() -> None:
    backend = make_backend("nftables", host_ip="10.0.0.1", dial_mark=MARK)
    assert isinstance(backend, NftablesBackend)
    assert backend.name == "nftables"


def test_comments_are_safe_and_fit() -> None:
    assert element_comment("ns/name:port") == "ns/name:port"
    assert element_comment('a"b\\c\u00e9') == "a_b_c_"
    assert len(element_comment("n" * 63 + "/" + "s" * 63 + ":" + "p" * 15)) == 128


def test_proxy_ports_without_endpoints_are_set_elements() -> None:
    # A proxy port with no usable endpoint is in the set whose rule rejects, one with none
    # for its traffic (a Local policy) in the set whose rule drops; the maps are untouched.
    built = elements([*PORTALS, *REFUSALS])
    assert built[REJECTED_PROXY_PORTS] == {
        ("tcp", 40004): Element(("tcp", 40004), None, "default/empty:http has no endpoints")
    }
    assert built[DROPPED_PROXY_PORTS] == {
        ("udp", 40005): Element(("udp", 40005), None, "default/local:dns has no local endpoints")
    }
    without = elements(PORTALS)
    assert {
        k: v for k, v in built.items() if k not in (REJECTED_PROXY_PORTS, DROPPED_PROXY_PORTS)
    } == {k: v for k, v in without.items() if k not in (REJECTED_PROXY_PORTS, DROPPED_PROXY_PORTS)}
    # Only new connections, and on one listen address only that address's.
    rules = {c.name: c.rules for c in Layout(host_ip=HOST_IP, listen_ip="192.168.7.9").chains}
    listen = "ct state new ip daddr 192.168.7.9 meta l4proto . th dport"
    assert rules["no-endpoints"] == (
        f"{listen} @rejected-proxy-ports meta l4proto tcp reject with tcp reset",
        f"{listen} @rejected-proxy-ports reject",
        f"{listen} @dropped-proxy-ports drop",
    )


def test_conflicting_keys_keep_the_first_portal() -> None:
    other = ServicePortName("default", "zz-other", "http", Protocol.TCP)
    first = Portal(WEB, PortalKind.EXTERNAL_IP, "203.0.113.5", 80, 40002)
    second = Portal(other, PortalKind.EXTERNAL_IP, "203.0.113.5", 80, 40009)
    builder = ElementBuilder()
    built = builder.build([second, first])
    assert [e.value for e in built[EXTERNAL_IPS].values()] == [40002]
    assert builder.conflicts == [
        "external-ips 203.0.113.5 . tcp . 80: default/web:http -> 40002, "
        "not default/zz-other:http -> 40009"
    ]


def test_diff_touches_only_what_changed() -> None:
    before = elements(PORTALS)
    moved = Portal(DNS, PortalKind.CLUSTER_IP, "10.96.0.53", 53, 40007)  # new proxy port
    added = Portal(WEB, PortalKind.CLUSTER_IP, "10.96.0.11", 8080, 40001)
    after = elements([*PORTALS[:3], moved, added])
    deletes, adds = diff(before, after)
    assert render_delta(V4, deletes, adds) == (
        "delete element ip uproxy cluster-ips { 10.96.0.53 . udp . 53 }\n"
        "delete element ip uproxy node-port-proxy-ports { tcp . 40002 }\n"
        "delete element ip uproxy node-ports { tcp . 30080 }\n"
        "delete element ip uproxy proxy-ports { udp . 40003 }\n"
        'add element ip uproxy cluster-ips { 10.96.0.11 . tcp . 8080 comment "default/web:http"'
        ' : 40001, 10.96.0.53 . udp . 53 comment "kube-system/dns" : 40007 }\n'
        'add element ip uproxy proxy-ports { udp . 40007 comment "kube-system/dns" }\n'
    )
    assert diff(after, after) == ({}, {})
    assert render_delta(V4, {}, {}) == ""


def test_changed_comment_is_replaced() -> None:
    # nft keeps the old comment when an existing key is added again: delete and add.
    renamed = ServicePortName("default", "web", "web", Protocol.TCP)
    before = elements(PORTALS[:1])
    after = elements([Portal(renamed, PortalKind.CLUSTER_IP, "10.96.0.10", 80, 40001)])
    deletes, adds = diff(before, after)
    assert [e.key for e in deletes[CLUSTER_IPS]] == [("10.96.0.10", "tcp", 80)]
    assert [e.comment for e in adds[CLUSTER_IPS]] == ["default/web:web"]


def test_big_deltas_are_split_into_statements() -> None:
    many = [
        Portal(WEB, PortalKind.CLUSTER_IP, f"10.97.{i // 250}.{i % 250 + 1}", 80, 20000 + i)
        for i in range(2500)
    ]
    text = render_delta(V4, *diff(elements([]), elements(many)))
    assert text.count("add element ip uproxy cluster-ips {") == 3
    assert text.count(" : 2") == 2500


# What nft 1.0.6 prints for `nft -j list table ip uproxy` (one element with no comment).
LISTING = json.dumps(
    {
        "nftables": [
            {"metainfo": {"version": "1.0.6", "json_schema_version": 1}},
            {"table": {"family": "ip", "name": "uproxy", "handle": 2}},
            {
                "map": {
                    "family": "ip",
                    "name": "cluster-ips",
                    "table": "uproxy",
                    "type": ["ipv4_addr", "inet_proto", "inet_service"],
                    "handle": 4,
                    "map": "inet_service",
                    "elem": [
                        [{"concat": ["10.96.0.11", "udp", 53]}, 40003],
                        [
                            {
                                "elem": {
                                    "val": {"concat": ["10.96.0.10", "tcp", 80]},
                                    "comment": "default/web:http",
                                }
                            },
                            40001,
                        ],
                    ],
                }
            },
            {
                "set": {
                    "family": "ip",
                    "name": "node-port-proxy-ports",
                    "table": "uproxy",
                    "type": ["inet_proto", "inet_service"],
                    "handle": 7,
                    "elem": [{"elem": {"val": {"concat": ["tcp", 40002]}, "comment": "a/b:c"}}],
                }
            },
            {
                "chain": {
                    "family": "ip",
                    "table": "uproxy",
                    "name": "portals-host",
                    "handle": 2,
                    "type": "nat",
                    "hook": "output",
                    "prio": -101,
                    "policy": "accept",
                }
            },
            {"rule": {"family": "ip", "table": "uproxy", "chain": "portals-host", "expr": []}},
            {"rule": {"family": "ip", "table": "uproxy", "chain": "portals-host", "expr": []}},
        ]
    }
)


def test_parse_listing() -> None:
    skeleton = parse_skeleton(LISTING)
    assert skeleton.stores == {("map", "cluster-ips"), ("set", "node-port-proxy-ports")}
    assert skeleton.chains == {("portals-host", "nat", "output", -101, 2)}
    found = parse_elements(LISTING)
    assert found[CLUSTER_IPS] == {
        ("10.96.0.11", "udp", 53): Element(("10.96.0.11", "udp", 53), 40003, ""),
        ("10.96.0.10", "tcp", 80): Element(("10.96.0.10", "tcp", 80), 40001, "default/web:http"),
    }
    assert found[NODE_PORT_PROXY_PORTS] == {("tcp", 40002): Element(("tcp", 40002), None, "a/b:c")}
    assert parse_skeleton("not json").chains == frozenset()


def test_layout_skeleton_matches_its_own_listing_shape() -> None:
    layout = Layout(host_ip=HOST_IP, dial_mark=MARK)
    counts = {c.name: len(c.rules) for c in layout.chains}
    assert counts == {
        "portals-firewall": 1,
        "portals-container": 3,
        "portals-host": 5,
        "node-ports-container": 1,
        "node-ports-host": 3,
        "node-ports-filter": 1,
        "no-endpoints": 3,
        "proxy-ports-direct": 1,
    }
    assert len(layout.skeleton().stores) == 12


# ----- the backend, with nft replaced by a recorder ------------------------------------------


@dataclass
class FakeNft:
    """Stands in for ``command.run``: records argv and stdin, fails on demand."""

    calls: list[tuple[list[str], str | None]] = field(default_factory=list)
    fail: list[str] = field(default_factory=list)  # messages for the next nft -f runs
    listing: str = ""
    # What netlink says of the sentinels (None: it cannot tell), and what it was asked.
    sentinels: bool | None = True
    asked: list[tuple[int, str, list[tuple[str, bytes]]]] = field(default_factory=list)
    get_fails: bool = False  # ``nft get element`` exits 1 (a sentinel is gone)

    def elements_present(
        self, nfproto: int, table: str, wanted: list[tuple[str, bytes]]
    ) -> bool | None:
        self.asked.append((nfproto, table, list(wanted)))
        return self.sentinels

    async def run(self, argv: Any, *, stdin: str | None = None, **kwargs: Any) -> command.Completed:
        self.calls.append((list(argv), stdin))
        if argv[:2] == ["nft", "-f"] and self.fail:
            raise RulesError(f"nft failed: {self.fail.pop(0)}")
        if argv[:3] == ["nft", "-t", "-f"] and self.get_fails:
            return command.Completed(tuple(argv), 1, "", "Error: No such file or directory")
        return command.Completed(tuple(argv), 0, self.listing, "")

    def loads(self) -> list[str]:
        return [stdin or "" for argv, stdin in self.calls if argv[:2] == ["nft", "-f"]]


class FakeGen(Watch):
    """A generation that moves when told to, and by one with every commit of ours."""

    def __init__(self) -> None:
        super().__init__()
        self.gen = 7

    def read(self) -> int:
        return self.gen

    def mark_after_commit(self, before: Any, commits: int = 1) -> Any:
        self.gen += commits
        if before != self.gen - commits:
            self.forget()
            return None
        self.mark(self.gen)
        return self.gen


@dataclass
class Clock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def nft(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeNft]:
    fake = FakeNft()
    monkeypatch.setattr(command, "run", fake.run)
    monkeypatch.setattr(nftables, "elements_present", fake.elements_present)
    yield fake


def backend(gen: FakeGen, clock: Clock) -> NftablesBackend:
    return NftablesBackend(host_ip=HOST_IP, dial_mark=MARK, watch=gen, clock=clock, instance="test")


def intact_listing(commit: int) -> str:
    layout = Layout(host_ip=HOST_IP, dial_mark=MARK)
    objs: list[dict[str, Any]] = [
        {"map": {"name": s.name}} for s in layout.stores if s.kind == "map"
    ]
    objs += [{"set": {"name": s.name}} for s in layout.stores if s.kind == "set"]
    for c in layout.chains:
        objs.append({"chain": {"name": c.name, "type": c.type, "hook": c.hook, "prio": c.priority}})
        objs += [{"rule": {"chain": c.name}} for _ in c.rules]
    objs.append({"chain": {"name": "synced-by"}})
    stamp = f"uproxy test commit {commit}"
    objs.append({"rule": {"chain": "synced-by", "comment": stamp, "expr": [{"return": None}]}})
    return json.dumps({"nftables": objs})


async def test_first_sync_is_full_then_only_changes_then_nothing(nft: FakeNft) -> None:
    gen, clock = FakeGen(), Clock()
    b = backend(gen, clock)
    await b.sync(PORTALS)
    assert nft.loads() == [EXPECTED_FULL]
    nft.listing = intact_listing(1)
    for _ in range(3):  # the syncer's periodic sync: nothing changed, nothing spawned...
        await b.sync(PORTALS)
        assert await b.check() is True
    # ... but the first quiet check's look at the rules as loaded (``_learn_rules``).
    assert len(nft.calls) == 2 and nft.calls[1][0][:3] == ["nft", "-t", "-j"]
    await b.sync(PORTALS[:-1])
    delta = (
        "delete element ip uproxy cluster-ips { 10.96.0.53 . udp . 53 }\n"
        "delete element ip uproxy proxy-ports { udp . 40003 }\n"
    )
    assert nft.loads()[1:] == [stamped(delta, 2)]
    assert len(nft.calls) == 3 and b.full_loads == 1


async def test_failed_update_is_retried_whole_at_once(nft: FakeNft) -> None:
    gen, clock = FakeGen(), Clock()
    b = backend(gen, clock)
    await b.sync(PORTALS[:1])
    nft.fail = ["Error: Could not process rule: No such file or directory"]
    await b.sync(PORTALS)
    loads = nft.loads()
    assert loads[1].startswith("add element ip uproxy")
    assert loads[2] == full(3)
    assert b.full_loads == 2


async def test_failed_full_load_is_one_rules_error_and_next_sync_is_full(nft: FakeNft) -> None:
    b = backend(FakeGen(), Clock())
    await b.sync(PORTALS[:1])
    nft.fail = ["first", "second: out of memory"]
    with pytest.raises(RulesError, match=r"^cannot load table ip uproxy: nft failed: second"):
        await b.sync(PORTALS)
    await b.sync(PORTALS)
    assert nft.loads()[-1] == full(4)


async def test_check_lists_the_table_only_after_a_foreign_commit(nft: FakeNft) -> None:
    gen, clock = FakeGen(), Clock()
    b = backend(gen, clock)
    await b.sync(PORTALS)
    nft.listing = intact_listing(1)
    assert await b.check() is True  # quiet: the rules as loaded are read once
    assert await b.check() is True  # and then nothing
    assert len(nft.calls) == 2
    gen.gen += 1  # somebody committed something
    assert await b.check() is True
    assert nft.calls[-1][0] == ["nft", "-t", "-j", "list", "table", "ip", "uproxy"]
    assert await b.check() is True  # marked: free again
    assert len(nft.calls) == 3
    assert len(nft.asked) == 1  # the sentinels, asked with the listing


async def test_a_flushed_map_is_damage(nft: FakeNft) -> None:
    # ``nft flush map``: chains, counts, stamp and rules as loaded; only the sentinel is gone.
    gen, clock = FakeGen(), Clock()
    b = backend(gen, clock)
    await b.sync(PORTALS)
    nft.listing = intact_listing(1)
    assert await b.check() is True
    gen.gen += 1
    nft.sentinels = False
    assert await b.check() is False
    ((nfproto, table, wanted),) = nft.asked
    layout = Layout(host_ip=HOST_IP, dial_mark=MARK)
    assert (nfproto, table) == (2, "uproxy")
    assert wanted == [(st.name, st.sentinel_key()) for st in layout.stores]
    nft.sentinels = True
    await b.sync(PORTALS)  # the damage makes the next sync a full load
    assert nft.loads()[-1] == full(2)


@pytest.mark.parametrize("gone", [False, True])
async def test_sentinels_asked_of_nft_when_netlink_cannot_tell(nft: FakeNft, gone: bool) -> None:
    gen, clock = FakeGen(), Clock()
    b = backend(gen, clock)
    await b.sync(PORTALS)
    nft.listing = intact_listing(1)
    nft.sentinels, nft.get_fails = None, gone
    gen.gen += 1
    assert await b.check() is not gone
    argv, stdin = nft.calls[-1]
    assert argv == ["nft", "-t", "-f", "-"]
    assert stdin is not None
    assert stdin.splitlines()[0] == "get element ip uproxy cluster-ips { 0.0.0.0 . tcp . 0 }"
    assert len(stdin.splitlines()) == 12  # one sentinel per map or set


async def test_a_rule_replaced_in_place_is_damage(nft: FakeNft) -> None:
    # Same chains, same counts, same stamp: only the rule's text says it is another rule.
    gen, clock = FakeGen(), Clock()
    b = backend(gen, clock)
    await b.sync(PORTALS)
    nft.listing = intact_listing(1)
    assert await b.check() is True  # learns the rules as loaded
    gen.gen += 1
    replaced = json.loads(nft.listing)
    for obj in replaced["nftables"]:
        if obj.get("rule", {}).get("chain") == "portals-container":
            obj["rule"]["expr"] = [{"accept": None}]
            break
    nft.listing = json.dumps(replaced)
    assert await b.check() is False
    await b.sync(PORTALS)
    assert nft.loads()[-1] == full(2)


async def test_damage_found_by_check_makes_the_next_sync_full(nft: FakeNft) -> None:
    gen, clock = FakeGen(), Clock()
    b = backend(gen, clock)
    await b.sync(PORTALS)
    gen.gen += 1
    nft.listing = intact_listing(1).replace('"rule": {"chain": "portals-host"}', '"x": {}', 1)
    assert await b.check() is False
    assert await b.check() is False  # still damaged until a sync
    await b.sync(PORTALS)
    assert nft.loads()[-1] == full(2)
    assert await b.check() is True


async def test_sync_notices_damage_without_a_check(nft: FakeNft) -> None:
    gen, clock = FakeGen(), Clock()
    b = backend(gen, clock)
    await b.sync(PORTALS)
    gen.gen += 1
    nft.listing = "{}"  # the table is gone
    await b.sync(PORTALS)
    assert nft.loads()[-1] == full(2)


async def test_full_load_at_least_hourly(nft: FakeNft) -> None:
    gen, clock = FakeGen(), Clock()
    b = backend(gen, clock)
    await b.sync(PORTALS)
    clock.now += FULL_SYNC_PERIOD_S - 1
    await b.sync(PORTALS)
    assert b.full_loads == 1
    clock.now += 1
    await b.sync(PORTALS)
    assert b.full_loads == 2 and nft.loads()[-1] == full(2)


async def test_invalid_portal_is_rules_error(nft: FakeNft) -> None:
    b = backend(FakeGen(), Clock())
    with pytest.raises(RulesError, match="has no address"):
        await b.sync([Portal(WEB, PortalKind.CLUSTER_IP, None, 80, 4000)])
    assert nft.calls == []


async def test_cleanup_deletes_only_uproxys_tables(
    nft: FakeNft, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/sbin/{name}")
    nft.listing = "table ip uproxy\ntable inet other\ntable ip6 uproxy\ntable ip uproxy-x\n"
    assert await nftables.cleanup_tables() is True
    assert nft.loads() == ["delete table ip uproxy\ndelete table ip6 uproxy\n"]
    nft.listing = "table inet other\n"
    assert await nftables.cleanup_tables() is False
    assert len(nft.loads()) == 1


async def test_cleanup_without_nft_installed_looks_over_netlink(
    nft: FakeNft, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(nftables, "nft_tables", lambda: frozenset({(1, "other")}))
    assert await nftables.cleanup_tables() is False
    assert nft.calls == []
    # Without nft, a table of uproxy's that the kernel has (netlink says) is an error.
    monkeypatch.setattr(nftables, "nft_tables", lambda: frozenset({(10, "uproxy"), (2, "x")}))
    with pytest.raises(RulesError, match=r"^nft not found: cannot remove table ip6 uproxy;"):
        await nftables.cleanup_tables()
    assert nft.calls == []


# ----- source ranges, --nodeport-addresses, traffic from the cluster -----------------------

SPLIT = [
    Portal(WEB, PortalKind.EXTERNAL_IP, "203.0.113.5", 80, 40002, 40001),
    Portal(WEB, PortalKind.LB_INGRESS, "198.51.100.9", 80, 40002, 40001, ("10.0.0.0/8",)),
    Portal(WEB, PortalKind.NODE_PORT, None, 30080, 40002, 40001),
]


def test_local_policy_and_source_ranges_fill_their_maps_and_sets() -> None:
    found = elements(SPLIT)
    c = "default/web:http"
    lb, ext = ("198.51.100.9", "tcp", 80), ("203.0.113.5", "tcp", 80)
    assert found[CLUSTER_IPS] == {lb: Element(lb, 40002, c)}
    assert found[EXTERNAL_IPS] == {ext: Element(ext, 40002, c)}
    assert found[SHORT_CIRCUIT_LB_IPS] == {lb: Element(lb, 40001, c)}
    assert found[SHORT_CIRCUIT_EXTERNAL_IPS] == {ext: Element(ext, 40001, c)}
    assert found[SHORT_CIRCUIT_NODE_PORTS] == {("tcp", 30080): Element(("tcp", 30080), 40001, c)}
    assert set(found[NODE_PORT_PROXY_PORTS]) == {("tcp", 40001), ("tcp", 40002)}
    assert found[FIREWALLED_LB_IPS] == {lb: Element(lb, None, c)}
    assert list(found[LB_SOURCE_RANGES]) == [(*lb, "10.0.0.0/8")]
    text = render_delta(V4, {}, {LB_SOURCE_RANGES: list(found[LB_SOURCE_RANGES].values())})
    assert text == (
        "add element ip uproxy lb-source-ranges "
        '{ 198.51.100.9 . tcp . 80 . 10.0.0.0/8 comment "default/web:http" }\n'
    )


def test_proxy_ports_hold_every_port_a_portal_leads_to() -> None:
    # Cluster, external and node-port proxy ports, a Local policy's cluster port included;
    # a refusal adds none (its port is one a portal leads to anyway).
    other = ServicePortName("default", "other", "http", Protocol.TCP)
    alone = Portal(other, PortalKind.LB_INGRESS, "198.51.100.10", 80, 40011, 0, ("10.0.0.0/8",))
    found = elements([*SPLIT, *REFUSALS, alone])
    assert found[PROXY_PORTS] == {
        ("tcp", 40001): Element(("tcp", 40001), None, "default/web:http"),
        ("tcp", 40002): Element(("tcp", 40002), None, "default/web:http"),
        ("tcp", 40011): Element(("tcp", 40011), None, "default/other:http"),
    }
    assert set(elements(PORTALS)[PROXY_PORTS]) == {("tcp", 40001), ("tcp", 40002), ("udp", 40003)}


@pytest.mark.parametrize(
    ("family", "host", "listen", "daddr"),
    [
        (V4, HOST_IP, "0.0.0.0", ""),
        (V4, HOST_IP, "192.168.7.9", "ip daddr 192.168.7.9 "),
        (IPV6, "fd00::1", "::", ""),
        (IPV6, "fd00::1", "fd00::9", "ip6 daddr fd00::9 "),
    ],
)
def test_direct_connections_to_proxy_ports_are_dropped(
    family: nftables.Family, host: str, listen: str, daddr: str
) -> None:
    # New connections no portal translated, from anywhere but the node itself; only
    # translated ones are accepted for node ports; source ranges check new connections only.
    chains = {c.name: c for c in Layout(family, host_ip=host, listen_ip=listen).chains}
    direct = chains["proxy-ports-direct"]
    assert (direct.type, direct.hook, direct.priority) == ("filter", "input", -2)
    assert direct.priority < chains["no-endpoints"].priority  # dropped, not reset
    assert direct.rules == (
        "ct state new ct status & dnat != dnat fib saddr type != local "
        f"{daddr}meta l4proto . th dport @proxy-ports drop",
    )
    assert chains["node-ports-filter"].rules == (
        "ct state new ct status dnat meta l4proto . th dport @node-port-proxy-ports accept",
    )
    saddr = family.saddr
    key = f"{family.daddr} . meta l4proto . th dport"
    assert chains["portals-firewall"].rules == (
        f"ct state new {key} @firewalled-lb-ips {key} . {saddr} != @lb-source-ranges drop",
    )


def test_source_ranges_of_hosts_are_bare_and_everyone_is_no_firewall() -> None:
    hosts = Portal(WEB, PortalKind.LB_INGRESS, "198.51.100.9", 80, 40002, 0, ("192.0.2.7/32",))
    assert list(elements([hosts])[LB_SOURCE_RANGES]) == [("198.51.100.9", "tcp", 80, "192.0.2.7")]
    everyone = Portal(WEB, PortalKind.LB_INGRESS, "198.51.100.9", 80, 40002, 0, ("0.0.0.0/0",))
    assert elements([everyone])[FIREWALLED_LB_IPS] == {}


def test_firewall_of_a_contested_lb_ip_is_its_owners() -> None:
    other = ServicePortName("default", "other", "http", Protocol.TCP)
    first = Portal(other, PortalKind.LB_INGRESS, "198.51.100.9", 80, 40005)  # no ranges
    second = Portal(WEB, PortalKind.LB_INGRESS, "198.51.100.9", 80, 40002, 0, ("10.0.0.0/8",))
    found = elements([first, second])
    assert found[CLUSTER_IPS][("198.51.100.9", "tcp", 80)].value == 40005
    assert found[FIREWALLED_LB_IPS] == {} and found[LB_SOURCE_RANGES] == {}


@pytest.mark.parametrize(
    ("local", "match"),
    [
        (LocalTraffic(cidrs=("10.244.0.0/16", "fd00::/48")), "ip saddr 10.244.0.0/16 "),
        (LocalTraffic(cidrs=("10.244.0.0/16", "10.245.0.0/16")), "ip saddr 10.244.0.0/15 "),
        (
            LocalTraffic(cidrs=("10.244.0.0/16", "10.250.0.0/16")),
            "ip saddr { 10.244.0.0/16, 10.250.0.0/16 } ",
        ),
        (LocalTraffic(interface="cbr0"), 'iifname "cbr0" '),
        (LocalTraffic(interface="veth", prefix=True), 'iifname "veth*" '),
    ],
)
def test_pods_go_to_the_short_circuit_maps_first(local: LocalTraffic, match: str) -> None:
    layout = Layout(host_ip=HOST_IP, local=local, nodeport_cidrs=("192.168.7.1/32",))
    rules = {c.name: c.rules for c in layout.chains}
    to = "redirect to :ip daddr . meta l4proto . th dport map"
    # The externalIPs' after the ClusterIPs: an address that is a ClusterIP and another
    # service's externalIP is the ClusterIP's (LoadBalancer IPs are in cluster-ips too).
    assert rules["portals-container"][:5] == (
        f"{match}meta l4proto {{ tcp, udp }} {to} @short-circuit-lb-ips",
        f"meta l4proto {{ tcp, udp }} {to} @cluster-ips",
        f'{match}meta iifkind != "bridge" meta l4proto {{ tcp, udp }} {to} @short-circuit-external-ips',
        f"{match}fib daddr type local meta l4proto {{ tcp, udp }} {to} @short-circuit-external-ips",
        f'meta iifkind != "bridge" meta l4proto {{ tcp, udp }} {to} @external-ips',
    )
    assert rules["node-ports-container"] == (
        f"ip daddr 192.168.7.1 {match}fib daddr type local meta l4proto {{ tcp, udp }} "
        "redirect to :meta l4proto . th dport map @short-circuit-node-ports",
        "ip daddr 192.168.7.1 fib daddr type local meta l4proto { tcp, udp } "
        "redirect to :meta l4proto . th dport map @node-ports",
    )


def test_without_detection_pods_are_not_short_circuited() -> None:
    for local in (LocalTraffic(), LocalTraffic(cidrs=("fd00::/48",))):
        rules = {c.name: c.rules for c in Layout(host_ip=HOST_IP, local=local).chains}
        assert not any("short-circuit" in r for r in rules["portals-container"])
        assert not any("short-circuit" in r for r in rules["node-ports-container"])
        assert any("short-circuit" in r for r in rules["portals-host"])


@pytest.mark.parametrize(
    ("cidrs", "match"),
    [
        ((), ""),
        (("10.0.0.0/8", "192.168.0.0/16"), "ip daddr { 10.0.0.0/8, 192.168.0.0/16 } "),
        (("fd00::/64",), ""),  # no IPv4 CIDR: every IPv4 address, as kube-proxy
    ],
)
def test_nodeport_addresses_narrow_the_node_port_rules(cidrs: tuple[str, ...], match: str) -> None:
    layout = Layout(host_ip=HOST_IP, nodeport_cidrs=cidrs)
    rules = [r for c in layout.chains if c.name.startswith("node-ports-") for r in c.rules]
    nat = [r for r in rules if "fib daddr" in r]
    assert len(nat) == 3 and all(r.startswith(f"{match}fib daddr type local") for r in nat)


def test_listing_with_prefixes_parses_to_the_keys_uproxy_writes() -> None:
    listing = json.dumps(
        {
            "nftables": [
                {
                    "set": {
                        "name": LB_SOURCE_RANGES,
                        "elem": [
                            {
                                "elem": {
                                    "val": {
                                        "concat": [
                                            "198.51.100.9",
                                            "tcp",
                                            80,
                                            {"prefix": {"addr": "10.0.0.0", "len": 8}},
                                        ]
                                    },
                                    "comment": "a/b:c",
                                }
                            },
                            {
                                "elem": {
                                    "val": {"concat": ["198.51.100.9", "tcp", 80, "192.0.2.7"]},
                                    "comment": "a/b:c",
                                }
                            },
                        ],
                    }
                }
            ]
        }
    )
    assert set(parse_elements(listing)[LB_SOURCE_RANGES]) == {
        ("198.51.100.9", "tcp", 80, "10.0.0.0/8"),
        ("198.51.100.9", "tcp", 80, "192.0.2.7"),
    }


async def test_new_pod_detection_reloads_the_table_whole(nft: FakeNft) -> None:
    b = backend(FakeGen(), Clock())
    await b.sync(SPLIT)
    await b.sync(SPLIT)
    assert len(nft.loads()) == 1
    b.set_local_traffic(LocalTraffic(cidrs=("10.244.0.0/16",)))
    assert await b.check() is True  # not damage: nothing to report
    await b.sync(SPLIT)
    assert len(nft.loads()) == 2 and "ip saddr 10.244.0.0/16" in nft.loads()[1]
    assert b.full_loads == 2
    b.set_local_traffic(LocalTraffic(cidrs=("10.244.0.0/16",)))  # the same: nothing
    await b.sync(SPLIT)
    assert len(nft.loads()) == 2


async def test_both_families_in_one_transaction_and_deltas_per_table(nft: FakeNft) -> None:
    from tests.rules.test_portals import HOST6, SIX

    gen, clock = FakeGen(), Clock()
    b = NftablesBackend(
        host_ip=[HOST_IP, HOST6], dial_mark=MARK, watch=gen, clock=clock, instance="test"
    )
    await b.sync([*PORTALS, *SIX])
    (load,) = nft.loads()  # one nft process, one generation step for both tables
    assert load.startswith(EXPECTED_FULL)
    assert "\nadd table ip6 uproxy\ndelete table ip6 uproxy\ntable ip6 uproxy {" in load
    assert "dnat to [fd00:200:3::1]:ip6 daddr . meta l4proto . th dport map" in load
    assert "fd00:96::10 . tcp . 80" in load and "tcp . 30080" in load.split("ip6 uproxy {")[1]
    await b.sync([*PORTALS, *SIX])
    assert len(nft.calls) == 1  # nothing changed: nothing run
    await b.sync([*PORTALS, *SIX[1:]])
    delta = "delete element ip6 uproxy cluster-ips { fd00:96::10 . tcp . 80 }\n"
    assert nft.loads()[1:] == [stamped(delta, 2) + stamped("", 2, "ip6")]
    assert b.families == (IPFamily.V4, IPFamily.V6)


async def test_a_strangers_stamp_is_damage_logged_once(
    nft: FakeNft, caplog: pytest.LogCaptureFixture
) -> None:
    # Another uproxy (or a restored file) wrote the table: same structure, other stamp.
    gen, clock = FakeGen(), Clock()
    b = backend(gen, clock)
    await b.sync(PORTALS)
    gen.gen += 1
    nft.listing = intact_listing(1).replace("uproxy test commit 1", "uproxy 0badf00d commit 9")
    with caplog.at_level("WARNING", logger="uproxy.rules.nftables"):
        assert await b.check() is False
        await b.sync(PORTALS)
        assert nft.loads()[-1] == full(2)
        gen.gen += 1
        assert await b.check() is False  # the listing still shows the stranger
    warned = [r for r in caplog.records if "written by somebody else" in r.getMessage()]
    assert len(warned) == 1 and warned[0].kv["found"] == "uproxy 0badf00d commit 9"  # type: ignore[attr-defined]
    nft.listing = intact_listing(1)  # uproxy's own older stamp: a ruleset restored from a file
    gen.gen += 1
    await b.sync(PORTALS)
    assert nft.loads()[-1] == full(3)


def test_stamp_is_read_from_its_chain_only() -> None:
    listing = intact_listing(4)
    assert nftables.parse_stamp(listing) == "uproxy test commit 4"
    assert parse_skeleton(listing) == Layout(host_ip=HOST_IP, dial_mark=MARK).skeleton()
    doubled = json.loads(listing)
    doubled["nftables"].append(doubled["nftables"][-1])
    assert nftables.parse_stamp(json.dumps(doubled)) is None
    assert nftables.parse_stamp("{}") is None
