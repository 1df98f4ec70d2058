"""The nftables backend in a real namespace: the exact table, incremental transactions seen by
``nft monitor``, repair after a deleted or flushed table, cleanup, and idle checks at scale."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from tests.conftest import wait_for_sync
from tests.netns.helpers import (
    DIAL_MARK,
    STAMP,
    STAMP_MASKED,
    install_foreign,
    nft,
    nft_normalised,
    run_ops,
    shell_op,
    sync_op,
)
from tests.netns.test_rules import DNS, PORTALS, REFUSALS, WEB
from tests.netns.topology import Topology
from uproxy.rules.base import Portal, PortalKind

pytestmark = [pytest.mark.root]

# Someone else's nft table: it must survive everything uproxy does.
FOREIGN_NFT = """\
table inet other {
	set allowed { type inet_service; elements = { 22, 443 } }
	chain input {
		type filter hook input priority 10; policy accept;
		tcp dport @allowed accept
	}
}
"""

EXPECTED = """\
table ip uproxy {
map cluster-ips {
type ipv4_addr . inet_proto . inet_service : inet_service
elements = { 0.0.0.0 . tcp . 0 comment "uproxy sentinel (not a service)" : 0, 10.96.0.10 . tcp . 80 comment "default/web:http" : 40001, 10.96.0.53 . udp . 53 comment "kube-system/dns:dns" : 40003, 198.51.100.9 . tcp . 80 comment "default/web:http" : 40002 }
}
map external-ips {
type ipv4_addr . inet_proto . inet_service : inet_service
elements = { 0.0.0.0 . tcp . 0 comment "uproxy sentinel (not a service)" : 0, 203.0.113.5 . tcp . 80 comment "default/web:http" : 40002 }
}
map node-ports {
type inet_proto . inet_service : inet_service
elements = { tcp . 0 comment "uproxy sentinel (not a service)" : 0, tcp . 30080 comment "default/web:http" : 40002, udp . 30053 comment "kube-system/dns:dns" : 40003 }
}
set node-port-proxy-ports {
type inet_proto . inet_service
elements = { tcp . 0 comment "uproxy sentinel (not a service)", tcp . 40002 comment "default/web:http", udp . 40003 comment "kube-system/dns:dns" }
}
set proxy-ports {
type inet_proto . inet_service
elements = { tcp . 0 comment "uproxy sentinel (not a service)", tcp . 40001 comment "default/web:http", tcp . 40002 comment "default/web:http", udp . 40003 comment "kube-system/dns:dns" }
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
type filter hook prerouting priority dstnat - 10; policy accept;
ct state new ip daddr . meta l4proto . th dport @firewalled-lb-ips ip daddr . meta l4proto . th dport . ip saddr != @lb-source-ranges drop
}
chain portals-container {
type nat hook prerouting priority dstnat - 1; policy accept;
meta l4proto { tcp, udp } redirect to :ip daddr . meta l4proto . th dport map @cluster-ips
meta iifkind != "bridge" meta l4proto { tcp, udp } redirect to :ip daddr . meta l4proto . th dport map @external-ips
fib daddr type local meta l4proto { tcp, udp } redirect to :ip daddr . meta l4proto . th dport map @external-ips
}
chain portals-host {
type nat hook output priority -101; policy accept;
meta mark & 0x00001000 == 0x00001000 return comment "uproxy dials to endpoints skip the portals"
meta l4proto { tcp, udp } dnat to 10.200.3.1:ip daddr . meta l4proto . th dport map @short-circuit-lb-ips
meta l4proto { tcp, udp } dnat to 10.200.3.1:ip daddr . meta l4proto . th dport map @cluster-ips
fib daddr type local meta l4proto { tcp, udp } dnat to 10.200.3.1:ip daddr . meta l4proto . th dport map @short-circuit-external-ips
fib daddr type local meta l4proto { tcp, udp } dnat to 10.200.3.1:ip daddr . meta l4proto . th dport map @external-ips
}
chain node-ports-container {
type nat hook prerouting priority dstnat + 1; policy accept;
fib daddr type local meta l4proto { tcp, udp } redirect to :meta l4proto . th dport map @node-ports
}
chain node-ports-host {
type nat hook output priority -99; policy accept;
meta mark & 0x00001000 == 0x00001000 return comment "uproxy dials to endpoints skip the portals"
fib daddr type local meta l4proto { tcp, udp } dnat to 10.200.3.1:meta l4proto . th dport map @short-circuit-node-ports
fib daddr type local meta l4proto { tcp, udp } dnat to 10.200.3.1:meta l4proto . th dport map @node-ports
}
chain node-ports-filter {
type filter hook input priority filter; policy accept;
ct state new ct status dnat meta l4proto . th dport @node-port-proxy-ports accept
}
chain no-endpoints {
type filter hook input priority filter - 1; policy accept;
ct state new meta l4proto . th dport @rejected-proxy-ports reject with tcp reset
ct state new meta l4proto . th dport @rejected-proxy-ports reject
ct state new meta l4proto . th dport @dropped-proxy-ports drop
}
chain proxy-ports-direct {
type filter hook input priority filter - 2; policy accept;
ct state new ct status & dnat != dnat fib saddr type != local meta l4proto . th dport @proxy-ports drop
}
chain synced-by {
return comment "uproxy ID commit N"
}
}
"""


def ops(topo: Topology, script: list[dict[str, Any]]) -> list[Any]:
    return run_ops(topo, "nftables", "nft", script)


def listing(topo: Topology) -> str:
    return nft_normalised(nft(topo, "list", "table", "ip", "uproxy"))


def install_foreign_nft(topo: Topology) -> None:
    topo.run(topo.node, "nft", "-f", "-", stdin=FOREIGN_NFT)
    install_foreign(topo, "nft")  # and iptables-nft rules: nat and filter tables of their own


def test_proxy_ports_without_endpoints_are_elements_of_their_sets(topo: Topology) -> None:
    # In the kernel's own words; out again, element by element, when they have endpoints.
    refused = EXPECTED.replace(
        'set rejected-proxy-ports {\ntype inet_proto . inet_service\nelements = { tcp . 0 comment "uproxy sentinel (not a service)" }',
        'set rejected-proxy-ports {\ntype inet_proto . inet_service\nelements = { tcp . 0 comment "uproxy sentinel (not a service)", tcp . 40004 comment "default/empty:http has no endpoints" }',
    ).replace(
        'set dropped-proxy-ports {\ntype inet_proto . inet_service\nelements = { tcp . 0 comment "uproxy sentinel (not a service)" }',
        'set dropped-proxy-ports {\ntype inet_proto . inet_service\nelements = { tcp . 0 comment "uproxy sentinel (not a service)", udp . 40005 comment "default/local:dns has no local endpoints" }',
    )
    assert refused != EXPECTED
    results = ops(topo, [sync_op(PORTALS + REFUSALS), {"op": "verify"}])
    assert results[-1] is True
    assert listing(topo) == refused
    # A new run loads the table whole, then deletes the two elements alone.
    script = [sync_op(PORTALS + REFUSALS), sync_op(PORTALS), {"op": "attr", "name": "full_loads"}]
    assert ops(topo, [*script, {"op": "verify"}])[-2:] == [1, True]
    assert listing(topo) == EXPECTED


def test_sync_installs_exactly_the_table(topo: Topology) -> None:
    install_foreign_nft(topo)
    others = nft(topo, "list", "table", "inet", "other")
    nat = nft(topo, "list", "table", "ip", "nat")
    results = ops(topo, [sync_op(PORTALS), sync_op(PORTALS), {"op": "check"}, {"op": "verify"}])
    assert results[-2:] == [True, True]
    assert listing(topo) == EXPECTED
    assert nft(topo, "list", "table", "inet", "other") == others
    assert nft(topo, "list", "table", "ip", "nat") == nat
    tables = nft(topo, "list", "tables").split("\n")
    assert "table ip uproxy" in tables and "table ip6 uproxy" not in tables


class Monitor:
    """``nft monitor`` in the node: every committed change, as nft prints it."""

    def __init__(self, topo: Topology) -> None:
        self.topo = topo
        self.proc = subprocess.Popen(
            topo.exec_argv(topo.node, "nft", "monitor"),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._probes = 0

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def probe(self) -> None:
        """Commit markers until the monitor prints one (it may not listen yet): bounded."""

        def seen() -> bool:
            self._probes += 1
            name = f"probe{self._probes}"
            self.topo.run(self.topo.node, "nft", f"add table ip {name}; delete table ip {name}")
            return f"add table ip {name}" in self.lines

        wait_for_sync(seen, timeout=10, interval=0.05, message="nft monitor output")

    def transactions(self) -> list[list[str]]:
        """uproxy's committed transactions: its lines, split at the generation markers."""
        out: list[list[str]] = []
        current: list[str] = []
        for line in self.lines:
            if line.startswith("# new generation"):
                if current:
                    out.append(current)
                current = []
            elif " ip uproxy " in line or line.endswith(" ip uproxy"):
                current.append(line)
        if current:
            out.append(current)
        return out

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)
        self._reader.join(timeout=5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@contextmanager
def monitor(topo: Topology) -> Iterator[Monitor]:
    mon = Monitor(topo)
    try:
        mon.probe()
        yield mon
        mon.probe()  # everything before it has been printed
    finally:
        mon.stop()


def test_updates_touch_only_the_changed_elements(topo: Topology) -> None:
    moved = Portal(DNS, PortalKind.CLUSTER_IP, "10.96.0.53", 53, 40007)
    added = Portal(WEB, PortalKind.CLUSTER_IP, "10.96.0.11", 8080, 40001)
    changed = [p for p in PORTALS if p.kind is not PortalKind.NODE_PORT and p.service == WEB]
    changed += [moved, added]
    script = [sync_op(PORTALS), sync_op(changed), sync_op(changed), {"op": "verify"}]
    script.append({"op": "spawns"})
    with monitor(topo) as mon:
        results = ops(topo, script)
    assert results[3] is True
    assert results[4] == ["nft", "nft", "nft"]  # full load, one update, verify; not the no-op
    full, update = mon.transactions()  # and nothing for the third sync
    assert full[:3] == ["add table ip uproxy", "delete table ip uproxy", "add table ip uproxy"]
    adds = [line for line in full if line.startswith("add element")]
    assert sum("uproxy sentinel" not in line for line in adds) == 11  # and the sentinels
    masked = (re.sub(r"handle [0-9]+$", "handle H", STAMP.sub(STAMP_MASKED, x)) for x in update)
    assert sorted(masked) == sorted(
        [
            "delete rule ip uproxy synced-by handle H",  # the stamp's flush, as monitor says it
            f"add rule ip uproxy synced-by {STAMP_MASKED}",
            'delete element ip uproxy cluster-ips { 10.96.0.53 . udp . 53 comment "kube-system/dns:dns" : 40003 }',
            'delete element ip uproxy node-ports { tcp . 30080 comment "default/web:http" : 40002 }',
            'delete element ip uproxy node-ports { udp . 30053 comment "kube-system/dns:dns" : 40003 }',
            'delete element ip uproxy node-port-proxy-ports { tcp . 40002 comment "default/web:http" }',
            'delete element ip uproxy node-port-proxy-ports { udp . 40003 comment "kube-system/dns:dns" }',
            'add element ip uproxy cluster-ips { 10.96.0.11 . tcp . 8080 comment "default/web:http" : 40001 }',
            'add element ip uproxy cluster-ips { 10.96.0.53 . udp . 53 comment "kube-system/dns:dns" : 40007 }',
            'delete element ip uproxy proxy-ports { udp . 40003 comment "kube-system/dns:dns" }',
            'add element ip uproxy proxy-ports { udp . 40007 comment "kube-system/dns:dns" }',
        ]
    )


DELETE_FIRST_HOST_RULE = (
    "h=$(nft -a list chain ip uproxy portals-host | sed -n 's/.*return.*# handle //p'); "
    "nft delete rule ip uproxy portals-host handle $h"
)


def test_deleted_or_flushed_table_is_noticed_and_repaired(topo: Topology) -> None:
    script = [sync_op(PORTALS), {"op": "check"}]
    script += [shell_op("nft", "delete", "table", "ip", "uproxy"), {"op": "check"}]
    script += [sync_op(PORTALS), {"op": "check"}, {"op": "verify"}]
    script += [shell_op("nft", "flush", "table", "ip", "uproxy"), {"op": "check"}]
    script += [sync_op(PORTALS), {"op": "check"}, {"op": "verify"}]
    # A rule deleted from one chain (by handle: the first rule of portals-host).
    script += [shell_op("sh", "-c", DELETE_FIRST_HOST_RULE), {"op": "check"}]
    script += [sync_op(PORTALS), {"op": "verify"}]
    results = ops(topo, script)
    assert results[1] is True
    assert results[3] is False  # deleted
    assert results[5:7] == [True, True]
    assert results[8] is False  # flushed
    assert results[10:12] == [True, True]
    assert results[13] is False  # one rule gone
    assert results[15] is True
    assert listing(topo) == EXPECTED


def test_a_rule_replaced_in_place_is_noticed_and_repaired(topo: Topology) -> None:
    # The same counts and stamp, another rule: every ClusterIP from pods accepted unNATed.
    replace = (
        "h=$(nft -a list chain ip uproxy portals-container | sed -n 's/.*cluster-ips.*# handle //p');"
        " nft replace rule ip uproxy portals-container handle $h counter accept"
    )
    script = [sync_op(PORTALS), {"op": "check"}, {"op": "check"}]
    script += [{"op": "shell", "argv": ["sh", "-c", replace]}, {"op": "check"}]
    script += [sync_op(PORTALS), {"op": "check"}, {"op": "verify"}]
    results = ops(topo, script)
    assert results[1:3] == [True, True]
    assert results[4] is False  # noticed at the next check
    assert results[6:8] == [True, True]
    assert listing(topo) == EXPECTED


@pytest.mark.parametrize("store", ["cluster-ips", "lb-source-ranges", "node-port-proxy-ports"])
def test_a_flushed_map_or_set_is_noticed_and_repaired(topo: Topology, store: str) -> None:
    # The chains, their rules and the stamp stay; only the store's elements go, the sentinel
    # with them. The check asks the kernel over netlink: no nft process beyond the listing.
    kind = "set" if store in ("lb-source-ranges", "node-port-proxy-ports") else "map"
    script = [sync_op(PORTALS), {"op": "check"}, {"op": "spawns"}]
    script += [{"op": "shell", "argv": ["nft", "flush", kind, "ip", "uproxy", store]}]
    script += [{"op": "check"}, {"op": "spawns"}, {"op": "verify"}]
    script += [sync_op(PORTALS), {"op": "check"}, {"op": "verify"}]
    results = ops(topo, script)
    assert results[1] is True
    assert results[4] is False  # noticed
    assert results[5] == [*results[2], "nft"]  # the terse listing only
    assert results[6] is False
    assert results[8:10] == [True, True]  # the next sync loaded the table whole
    assert listing(topo) == EXPECTED


def test_a_table_somebody_else_wrote_is_noticed_and_reloaded(topo: Topology) -> None:
    # Another uproxy in the node loads its own services into the table and stops without
    # cleaning up; later the node's ruleset is restored from a file saved before uproxy's last
    # commit. Both leave the table's structure intact: only the stamp tells them apart.
    spec = {"name": "nftables", "mode": "nft", "host_ip": [topo.node_ip], "dial_mark": DIAL_MARK}
    other = json.dumps({"backend": spec, "ops": [sync_op(PORTALS[:1])]})
    saved = "/run/uproxy-test-saved-ruleset.nft"
    fewer = [p for p in PORTALS if p.service != DNS]
    script = [sync_op(PORTALS), {"op": "check"}]
    script += [shell_op(sys.executable, "-m", "tests.netns.driver", stdin=other)]
    script += [{"op": "check"}, {"op": "verify"}, sync_op(PORTALS), {"op": "verify"}]
    script += [shell_op("sh", "-c", f"nft list table ip uproxy > {saved}")]
    script += [sync_op(fewer), {"op": "check"}]
    script += [shell_op("sh", "-c", f"(echo 'delete table ip uproxy'; cat {saved}) | nft -f -")]
    script += [{"op": "check"}, sync_op(fewer), {"op": "check"}, {"op": "verify"}]
    script += [shell_op("rm", "-f", saved)]
    results = ops(topo, script)
    assert results[1] is True
    assert results[3:5] == [False, False]  # the other uproxy's elements: noticed
    assert results[6] is True  # reloaded by the next sync
    assert results[9] is True
    assert results[11] is False  # the saved ruleset still has the DNS service
    assert results[13:15] == [True, True]
    assert "kube-system/dns" not in nft(topo, "list", "table", "ip", "uproxy")


def test_cleanup_restores_the_ruleset_exactly(topo: Topology) -> None:
    install_foreign_nft(topo)
    before = nft(topo, "-s", "list", "ruleset")
    ops(topo, [sync_op(PORTALS), {"op": "cleanup"}])
    assert nft(topo, "-s", "list", "ruleset") == before
    assert ops(topo, [{"op": "cleanup"}, {"op": "cleanup_all"}]) == [None, False]
    # --cleanup (from a process that never synced) removes a table left behind.
    ops(topo, [sync_op(PORTALS)])
    assert "table ip uproxy" in nft(topo, "list", "tables")
    assert run_ops(topo, "none", "auto", [{"op": "cleanup_all"}]) == [True]
    assert nft(topo, "-s", "list", "ruleset") == before


def test_idle_checks_spawn_nothing_at_10000_services(topo: Topology) -> None:
    many = {"op": "sync", "portals": [], "many": 10_000}
    script: list[dict[str, Any]] = [many, {"op": "spawns"}]
    script += [{"op": "check"}] * 5 + [many] * 3 + [{"op": "spawns"}]
    # Somebody else commits: the next check looks once, then it is free again.
    script += [{"op": "shell", "argv": ["nft", "add", "table", "inet", "somebody"]}]
    script += [{"op": "check"}, {"op": "check"}, many, {"op": "spawns"}, {"op": "verify"}]
    results = ops(topo, script)
    assert results[1] == ["nft"]
    assert results[2:7] == [True] * 5
    # Five checks and three periodic syncs: one process, the first quiet check's look at
    # the rules as loaded (to tell a rule replaced in place later), and then none.
    assert results[10] == ["nft", "nft"]
    assert results[12:14] == [True, True]
    assert results[15] == ["nft", "nft", "nft"]  # the one look after the foreign commit
    assert results[16] is True
    assert "elements" in nft(topo, "list", "map", "ip", "uproxy", "cluster-ips")
