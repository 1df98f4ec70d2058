"""The proxy ports the last run's rules point at, read before the first sync of a start.

A restart leaves the last run's portal rules in place until the first sync replaces them
(seconds at 10,000 services), and the new run opens its listeners first. On ports chosen
afresh, about half of them would be a port the old rules send *another* service's traffic
to: for those seconds clients reach the wrong service (measured: 4,884 of 9,849 ports at
10,000 services). So each backend reads, before the first sync, which proxy port each
service address and node port led to, and the syncer opens every listener on the port its
address had (``preferred``), and keeps the old ports that no service claims out of its
choice until the new rules are in (``unclaimed``): an old rule then either reaches the right
service or a closed port, never another service.

Keys are ``(address, protocol, port)`` of a service address (ClusterIP, externalIP,
LoadBalancer IP) and ``("", protocol, node port)`` of a node port; protocols in lower case.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

PortalKey = tuple[str, str, int]
Previous = Mapping[PortalKey, int]

NO_PREVIOUS: Previous = {}

_DEST = re.compile(r"(?:^| )-d (\S+?)(?:/(?:32|128))?(?: |$)")
_PROTO = re.compile(r" -p (tcp|udp) ")
_DPORT = re.compile(r" --dport (\d+)(?: |$)")
_TO = re.compile(r" (?:--to-ports (\d+)|--to-destination \S*:(\d+))(?: |$)")


def from_save_lines(lines: Iterable[str]) -> dict[PortalKey, int]:
    """From ``iptables-save`` lines of uproxy's container portal and node-port chains: the
    proxy port each destination was sent to. Rules that pick traffic by source (pods, for
    Local policies) lead to the cluster port: the rule for everyone else says the port."""
    out: dict[PortalKey, int] = {}
    for line in lines:
        if not line.startswith(("-A KUBE-PORTALS-CONTAINER ", "-A KUBE-NODEPORT-CONTAINER ")):
            continue
        if " -s " in line or " -i " in line:
            continue
        proto, dport, to = _PROTO.search(line), _DPORT.search(line), _TO.search(line)
        if proto is None or dport is None or to is None:
            continue
        dest = _DEST.search(line)
        address = dest.group(1) if dest is not None else ""
        if line.startswith("-A KUBE-NODEPORT-CONTAINER "):
            address = ""
        out.setdefault(
            (address, proto.group(1), int(dport.group(1))), int(to.group(1) or to.group(2))
        )
    return out


def by_protocol(previous: Previous) -> dict[str, set[int]]:
    """Every proxy port of ``previous``, by protocol."""
    out: dict[str, set[int]] = {}
    for (_, proto, _), port in previous.items():
        out.setdefault(proto, set()).add(port)
    return out
