"""The portal rule set as exact text: what each kind of portal installs, in which chain."""

from __future__ import annotations

import pytest

from uproxy.model import Protocol, ServicePortName
from uproxy.rules.base import Portal, PortalKind
from uproxy.rules.portals import (
    CHAINS,
    FILTER,
    NAT,
    build_rules,
    mark_match,
    quote,
    restore_payload,
)

WEB = ServicePortName("default", "web", "http", Protocol.TCP)
DNS = ServicePortName("kube-system", "dns", "", Protocol.UDP)
HOST_IP = "192.168.7.1"

PORTALS = [
    Portal(WEB, PortalKind.CLUSTER_IP, "10.96.0.10", 80, 40001),
    Portal(WEB, PortalKind.EXTERNAL_IP, "203.0.113.5", 80, 40002),
    Portal(WEB, PortalKind.LB_INGRESS, "198.51.100.9", 80, 40002),
    Portal(WEB, PortalKind.NODE_PORT, None, 30080, 40002),
    Portal(DNS, PortalKind.CLUSTER_IP, "10.96.0.53", 53, 40003),
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
-A KUBE-PORTALS-CONTAINER -d 203.0.113.5/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -m physdev ! --physdev-is-in -j REDIRECT --to-ports 40002
-A KUBE-PORTALS-CONTAINER -d 203.0.113.5/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -m addrtype --dst-type LOCAL -j REDIRECT --to-ports 40002
-A KUBE-PORTALS-CONTAINER -d 198.51.100.9/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 40002
-A KUBE-PORTALS-CONTAINER -d 10.96.0.53/32 -p udp -m comment --comment "kube-system/dns" -m udp --dport 53 -j REDIRECT --to-ports 40003
-A KUBE-PORTALS-HOST -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DNAT --to-destination 192.168.7.1:40001
-A KUBE-PORTALS-HOST -d 203.0.113.5/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -m addrtype --dst-type LOCAL -j DNAT --to-destination 192.168.7.1:40002
-A KUBE-PORTALS-HOST -d 198.51.100.9/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DNAT --to-destination 192.168.7.1:40002
-A KUBE-PORTALS-HOST -d 10.96.0.53/32 -p udp -m comment --comment "kube-system/dns" -m udp --dport 53 -j DNAT --to-destination 192.168.7.1:40003
-A KUBE-NODEPORT-CONTAINER -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -j REDIRECT --to-ports 40002
-A KUBE-NODEPORT-HOST -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -j DNAT --to-destination 192.168.7.1:40002
COMMIT
"""

EXPECTED_FILTER = """\
*filter
:KUBE-NODEPORT-NON-LOCAL - [0:0]
-I INPUT 1 -m comment --comment "Ensure that non-local NodePort traffic can flow" -j KUBE-NODEPORT-NON-LOCAL
-A KUBE-NODEPORT-NON-LOCAL -p tcp -m comment --comment "default/web:http" -m tcp --dport 40002 -m state --state NEW -j ACCEPT
COMMIT
"""


def test_every_portal_kind_renders_exact_rules() -> None:
    ruleset = build_rules(PORTALS, host_ip=HOST_IP)
    jumps = ruleset.jumps
    assert restore_payload(ruleset, NAT, missing_jumps=jumps) == EXPECTED_NAT
    assert restore_payload(ruleset, FILTER, missing_jumps=jumps) == EXPECTED_FILTER


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


def test_listen_address_uses_dnat_from_containers() -> None:
    ruleset = build_rules(PORTALS[:1], host_ip=HOST_IP, listen_ip="192.168.7.2")
    lines = [r.save_line() for r in ruleset.rules]
    assert lines == [
        '-A KUBE-PORTALS-CONTAINER -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http"'
        " -m tcp --dport 80 -j DNAT --to-destination 192.168.7.2:40001",
        '-A KUBE-PORTALS-HOST -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http"'
        " -m tcp --dport 80 -j DNAT --to-destination 192.168.7.2:40001",
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
