"""Reading the last run's proxy ports from its rules (``rules.previous``)."""

from __future__ import annotations

from tests.rules.test_portals import HOST_IP, PORTALS
from uproxy.rules.portals import NAT, build_rules
from uproxy.rules.previous import by_protocol, from_save_lines


def test_every_address_and_node_port_leads_to_its_proxy_port() -> None:
    chains = build_rules(PORTALS, host_ip=HOST_IP, dial_mark=0x1000).save_lines(NAT)
    found = from_save_lines(line for lines in chains.values() for line in lines)
    assert found == {
        ("10.96.0.10", "tcp", 80): 40001,
        ("203.0.113.5", "tcp", 80): 40002,
        ("198.51.100.9", "tcp", 80): 40002,
        ("10.96.0.53", "udp", 53): 40003,
        ("", "tcp", 30080): 40002,
    }
    assert by_protocol(found) == {"tcp": {40001, 40002}, "udp": {40003}}


def test_rules_for_pods_only_and_other_lines_are_not_read() -> None:
    lines = [
        "-A KUBE-PORTALS-CONTAINER -s 10.1.0.0/16 -d 198.51.100.9/32 -p tcp -m tcp --dport 80 "
        "-j REDIRECT --to-ports 40001",  # a Local policy's pods: to the cluster port
        "-A KUBE-PORTALS-CONTAINER -d 198.51.100.9/32 -p tcp -m tcp --dport 80 "
        "-j REDIRECT --to-ports 40002",
        "-A KUBE-PORTALS-HOST -d 10.96.0.10/32 -p tcp -m tcp --dport 80 "
        "-j DNAT --to-destination 192.168.7.1:40009",
        "-A KUBE-PORTALS-CONTAINER -d 10.96.0.11/32 -p tcp -m tcp --dport 81 "
        "-j DNAT --to-destination 192.168.7.2:40007",  # a listen address: DNAT
    ]
    assert from_save_lines(lines) == {
        ("198.51.100.9", "tcp", 80): 40002,
        ("10.96.0.11", "tcp", 81): 40007,
    }
