"""The ``nftables`` backend: uproxy's own nft table, with maps keyed by (address, protocol, port).

Why a table of its own and maps: in an iptables chain every new connection walks the portal
rules one by one, so its cost grows with the number of services (at 10,000 services a legacy
chain kept 0.65x of the connection rate, an nft chain 0.31x). One lookup in an nft map costs
the same at any size (8,968 vs 8,935 conn/s from 1 to 10,000 services). The table is programmed
with ``nft -f -``, one transaction per sync, and touches nothing outside uproxy's tables.

One table per IP family the node serves: ``table ip uproxy`` for IPv4 and its twin ``table ip6
uproxy`` for IPv6, which differs only in the ``Family`` parameters (address types, ``ip6
daddr``, DNAT to ``[node address]:port``). Both are written in one transaction per sync, so
one generation step covers both and a sync is still one ``nft`` process.

The IPv4 table (the IPv6 one has ``ipv6_addr`` and ``ip6 daddr/saddr`` where this has IPv4)::

    table ip uproxy {
      map cluster-ips   ipv4_addr . inet_proto . inet_service : inet_service
                        (ClusterIPs and LoadBalancer ingress IPs -> proxy port)
      map external-ips  the same type (externalIPs -> the external proxy port)
      map node-ports    inet_proto . inet_service : inet_service (node port -> proxy port)
      set node-port-proxy-ports  inet_proto . inet_service (the proxy ports of node ports)
      set proxy-ports   inet_proto . inet_service (every proxy port a portal leads to)
      map short-circuit-lb-ips, short-circuit-external-ips, short-circuit-node-ports
                        the same types as above: where traffic from the cluster goes instead,
                        for externalTrafficPolicy: Local (the cluster proxy port)
      set firewalled-lb-ips  ipv4_addr . inet_proto . inet_service (LB IPs with source ranges)
      set lb-source-ranges   ipv4_addr . inet_proto . inet_service . ipv4_addr, flags interval
                        (each LB IP and port with each of its allowed source CIDRs)
      set rejected-proxy-ports, dropped-proxy-ports  inet_proto . inet_service (proxy ports
                        without endpoints: no usable endpoint at all, none for a Local policy)
      chain portals-firewall      filter prerouting, priority dstnat - 10 (-110)
      chain portals-container     nat prerouting, priority dstnat - 1 (-101)
      chain portals-host          nat output, priority -101; uproxy's dials return first
      chain node-ports-container  nat prerouting, priority dstnat + 1 (-99)
      chain node-ports-host       nat output, priority -99; uproxy's dials return first
      chain node-ports-filter     filter input, priority filter
      chain no-endpoints          filter input, priority filter - 1
      chain proxy-ports-direct    filter input, priority filter - 2
      chain synced-by             no hook: its rule's comment stamps uproxy's last commit
    }

The rules mean what the iptables portals mean (see ``portals``): traffic from pods and other
hosts is REDIRECTed to the proxy port (DNATed to the listen address when uproxy listens on one
address only), the node's own traffic is DNATed to ``host_ip:proxy_port`` (never 127.0.0.1),
node ports apply to local destinations only, and externalIPs get kube-proxy's three rules.

- **Priorities.** The iptables backends insert the portal jumps first into PREROUTING and
  OUTPUT and append the node-port jumps last; both iptables variants hook their nat chains at
  -100. Here the portals run at -101, before anybody's nat rules at the usual priority, and the
  node ports at -99, after them. The first nat chain that translates a new connection decides
  it (later nat chains are skipped for it), so this is the same order, and it does not depend
  on which table was loaded first (equal priorities run in registration order, which a full
  sync, deleting and re-adding the table, would change).
- **ClusterIPs before externalIPs.** Both portal chains look the ``cluster-ips`` map (which
  holds the LoadBalancer IPs too, after their short-circuit map) up before either
  externalIPs map: an address that is a ClusterIP and also another service's externalIP
  (with the port) is the ClusterIP's. The pods' short-circuit maps all came first in
  ``portals-container``, and a Service with a Local policy and externalIPs naming another's
  ClusterIP took that service's traffic from pods.
- **Bridged traffic.** iptables' ``-m physdev ! --physdev-is-in`` cannot be written in an ``ip``
  table (``meta ibrname`` is "Operation not supported" there). ``meta iifkind != "bridge"``
  is used instead: under br_netfilter, which Kubernetes nodes load, the IPv4 hooks see the
  bridge itself as the input device of a packet that came in through a bridge port, so both
  rules exclude the same packets. Without br_netfilter iptables' match is true for every packet
  (no bridge information), while this one still excludes traffic from a bridge: pods on a
  bridge then reach an externalIP only when it is a local address (the second rule).
- **Source ranges.** ``portals-firewall`` drops new connections to a LoadBalancer IP and port
  of ``firewalled-lb-ips`` whose (address, port, source) is not in ``lb-source-ranges``, before
  any NAT and in prerouting only: pods and other hosts are checked, the node itself (output)
  never is. A ``drop`` is final in nftables, whichever table says it. One lookup in an
  interval set of concatenations, whatever the number of services and ranges. New
  connections only, as the iptables backends jump to ``KUBE-PORTALS-FIREWALL``: a change of
  the ranges turns new clients away and leaves established connections be.
- **Traffic from the cluster** (``externalTrafficPolicy: Local``). The ``short-circuit-*``
  maps hold the cluster proxy port of such a service's externalIPs, LoadBalancer IPs and node
  ports. The host chains look them up before the usual maps, so the node's own traffic always
  reaches every endpoint; the container chains do so only for traffic from pods, as
  ``--detect-local-mode`` tells them (``ip saddr CIDR``, ``iifname BRIDGE``,
  ``iifname "PREFIX*"``), and not at all without it.
- **Proxy ports without endpoints.** ``no-endpoints`` rejects new connections to the proxy
  ports of ``rejected-proxy-ports`` (TCP with a RST, UDP with an ICMP port unreachable) and
  drops those to ``dropped-proxy-ports``, as kube-proxy's ``no-endpoint-services`` and its
  Local policies' drops do (see ``portals``: the iptables backends' ``KUBE-PORTALS-REJECT``).
- **Node-port addresses.** With ``--nodeport-addresses`` the node-port rules also match
  ``ip daddr`` in its CIDRs (besides being local), evaluated per packet.
- **Direct connections.** Every proxy port listens on every address (REDIRECT rewrites the
  destination to the incoming interface's address), so without a rule a client could connect
  to ``NODE_IP:PROXY_PORT`` itself and be served past every check the portals make (source
  ranges, ``--nodeport-addresses``, a Local policy's scope, a ClusterIP reached from outside).
  ``proxy-ports-direct`` drops new connections to the ports of ``proxy-ports`` that no portal
  translated (``ct status & dnat != dnat``: REDIRECT and DNAT both set it) and that do not come
  from one of the node's own addresses (``fib saddr type != local``), as kube-proxy's own modes
  expose no such port. The node's processes may still dial a proxy port directly.
- **The filter accept.** ``node-ports-filter`` accepts new connections to the proxy ports of
  node ports that a portal translated (``ct status dnat``), like ``KUBE-NODEPORT-NON-LOCAL``:
  never a direct connection. But in nft an ``accept`` only ends its own chain: a drop in
  another table's input chain (an nft firewall, or iptables' INPUT) still drops the packet,
  whereas iptables' rule, first in iptables' own INPUT, wins over the rules after it. Behind
  a default-deny nft firewall, accept there the new connections to the proxy port range that
  conntrack marks as translated (``ct status dnat``); direct ones are dropped here anyway.

Syncs are incremental: the backend remembers the elements it installed and a sync emits only
``delete element`` / ``add element`` for what changed (a changed value or comment is a delete
and an add in the same transaction); nothing at all when nothing changed, so the syncer's
periodic sync is free. The whole table is loaded (``add table``, ``delete table`` and the full
table in one transaction, so it is replaced atomically) on the first sync, after a failed
transaction (an incremental failure is retried at once as a full load), after a check found
damage, and at least once an hour (kube-proxy's full-sync period). ``check`` costs a generation
read (see ``watch``) unless somebody committed a change; then it lists the table without its
elements (``nft -t``: a tenth of the full listing at 10,000 services) and compares chains, rule
counts, maps and the *stamp*: chain ``synced-by``, which nothing jumps to, holds one ``return``
rule whose comment names uproxy's last commit (a random instance id and a commit number), and
every transaction of uproxy's rewrites it. A table another uproxy loaded, or one restored from a
file saved before uproxy's last commit, has elements uproxy did not write, and another stamp:
the check fails and the next sync loads the table whole. Two uproxy processes in one network
namespace therefore keep reloading each other's table (logged once per stranger's stamp).
The rules themselves are compared too: the first quiet check after a full load (nobody has
committed since) lists the table once and keeps a digest of its rules, so a rule replaced in
place (``nft replace rule``) is damage at the next check. A map or set flushed by hand (``nft
flush map``) is seen by its *sentinel*: every load writes one element into each store (address
0, TCP, port 0: a key no packet has, commented as uproxy's) that no sync touches, and the check
asks the kernel for each one over netlink (NFT_MSG_GETSETELEM, ~40 us for all of them; ``nft get
element`` where netlink cannot answer). What the check does not see is one service's element
deleted by hand: the hourly full load repairs that.

Elements carry ``ns/name:port`` comments (nft allows 128 characters; longer ones are cut). Two
portals wanting the same key (two services claiming one externalIP and port) cannot both be in
a map: the first in portal order wins, as the first matching iptables rule would, and the
conflict is logged.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import secrets
import shutil
import socket
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from uproxy.model import IPFamily
from uproxy.records import quick_init
from uproxy.rules import command
from uproxy.rules.base import (
    NO_LOCAL_TRAFFIC,
    LeftoverPorts,
    Leftovers,
    LocalTraffic,
    Portal,
    PortalKind,
    RulesError,
    Stack,
    keep_leftovers,
    no_leftover_ports,
)
from uproxy.rules.portals import (
    ANY_IPV4,
    DIAL_MARK_COMMENT,
    check_host_ip,
    collapse,
    narrowing,
    portal_key,
    source_ranges,
    split_by_family,
    stacks,
)
from uproxy.rules.previous import PortalKey, Previous
from uproxy.rules.restore import MODES, cleanup_mode
from uproxy.rules.watch import (
    FULL_SYNC_PERIOD_S,
    GenerationWatch,
    Token,
    Watch,
    elements_present,
    nft_tables,
)

log = logging.getLogger("uproxy.rules.nftables")

TABLE = "uproxy"
STAMP_CHAIN = "synced-by"  # its one rule's comment names the last commit (see ``_intact``)
COMMENT_MAX = 128  # nft refuses longer comments
_ELEMENTS_PER_STATEMENT = 1000

CLUSTER_IPS = "cluster-ips"
EXTERNAL_IPS = "external-ips"
NODE_PORTS = "node-ports"
NODE_PORT_PROXY_PORTS = "node-port-proxy-ports"
PROXY_PORTS = "proxy-ports"
SHORT_CIRCUIT_LB_IPS = "short-circuit-lb-ips"
SHORT_CIRCUIT_EXTERNAL_IPS = "short-circuit-external-ips"
SHORT_CIRCUIT_NODE_PORTS = "short-circuit-node-ports"
FIREWALLED_LB_IPS = "firewalled-lb-ips"
LB_SOURCE_RANGES = "lb-source-ranges"
REJECTED_PROXY_PORTS = "rejected-proxy-ports"
DROPPED_PROXY_PORTS = "dropped-proxy-ports"
STORE_NAMES = (
    CLUSTER_IPS,
    EXTERNAL_IPS,
    NODE_PORTS,
    NODE_PORT_PROXY_PORTS,
    PROXY_PORTS,
    SHORT_CIRCUIT_LB_IPS,
    SHORT_CIRCUIT_EXTERNAL_IPS,
    SHORT_CIRCUIT_NODE_PORTS,
    FIREWALLED_LB_IPS,
    LB_SOURCE_RANGES,
    REJECTED_PROXY_PORTS,
    DROPPED_PROXY_PORTS,
)

FIREWALL_PRIORITY = -110  # before any NAT (dstnat - 10, as kube-proxy's firewall)
PORTALS_PRIORITY = -101  # before nat chains at the usual dstnat priority (-100)
NODE_PORTS_PRIORITY = -99  # after them
FILTER_PRIORITY = 0
DIRECT_PRIORITY = FILTER_PRIORITY - 2  # before no-endpoints: a direct connection gets no RST
DIRECT_CHAIN = "proxy-ports-direct"


@dataclass(frozen=True, slots=True)
class Family:
    """What differs between ``table ip uproxy`` and its ``ip6`` twin."""

    table: str  # nft family: "ip" | "ip6"
    addr_type: str  # "ipv4_addr" | "ipv6_addr"
    daddr: str  # "ip daddr" | "ip6 daddr"
    af: int  # socket family of the addresses
    saddr: str  # "ip saddr" | "ip6 saddr"
    version: int  # 4 | 6

    def address(self, ip: str) -> str:
        """``ip`` as nft prints it; ValueError when it is not an address of this family."""
        try:
            return socket.inet_ntop(self.af, socket.inet_pton(self.af, ip))
        except (OSError, ValueError):
            raise ValueError(
                f"{ip!r} is not an {self.table} address for table {self.table} {TABLE}"
            ) from None

    def nat_to(self, ip: str) -> str:
        """The address part of ``dnat to ADDR:PORT`` (IPv6 in brackets)."""
        text = self.address(ip)
        return f"[{text}]:" if self.af == socket.AF_INET6 else f"{text}:"

    def networks(self, cidrs: Iterable[str]) -> list[str]:
        """The CIDRs of this family, merged and sorted, as nft prints them (a host bare);
        nothing when they cover every address."""
        return [network_text(n) for n in narrowing(cidrs, self.version)]

    def match(self, selector: str, cidrs: Iterable[str]) -> str:
        """``ip saddr 10.0.0.0/8 `` (or a set of them); "" when no CIDR is of this family."""
        nets = self.networks(cidrs)
        if not nets:
            return ""
        value = nets[0] if len(nets) == 1 else "{ " + ", ".join(nets) + " }"
        return f"{selector} {value} "


def network_text(net: ipaddress.IPv4Network | ipaddress.IPv6Network) -> str:
    """A network as nft prints it: a host as a bare address."""
    return str(net.network_address) if net.prefixlen == net.max_prefixlen else str(net)


IPV4 = Family("ip", "ipv4_addr", "ip daddr", socket.AF_INET, "ip saddr", 4)
IPV6 = Family("ip6", "ipv6_addr", "ip6 daddr", socket.AF_INET6, "ip6 saddr", 6)
FAMILIES = (IPV4, IPV6)  # what cleanup removes
FAMILY_OF = {IPFamily.V4: IPV4, IPFamily.V6: IPV6}

Key = tuple[str | int, ...]


@quick_init
@dataclass(frozen=True, slots=True)
class Element:
    """One element of a map (with a value) or of a set (without)."""

    key: Key
    value: int | None
    comment: str

    def key_text(self) -> str:
        return " . ".join(str(part) for part in self.key)

    def text(self) -> str:
        out = f'{self.key_text()} comment "{self.comment}"'
        return out if self.value is None else f"{out} : {self.value}"


Elements = dict[str, dict[Key, Element]]  # map or set name -> key -> element


def element_comment(text: str) -> str:
    """``text`` as an nft comment: printable ASCII without quotes, at most 128 characters."""
    clean = "".join(ch if " " <= ch <= "~" and ch not in '"\\' else "_" for ch in text)
    return clean[:COMMENT_MAX]


@dataclass(frozen=True, slots=True)
class Store:
    """A map or a set declared in the table."""

    kind: str  # "map" | "set"
    name: str
    type: str
    flags: str = ""  # "interval" for sets of ranges

    def sentinel(self) -> Element:
        """The element every load writes into this store and no sync touches: address 0,
        TCP, port 0, a key no packet has. A flushed store has lost it (``_intact``)."""
        parts = self.type.split(" : ")[0].split(" . ")
        key = tuple(_SENTINEL_PARTS[part][0] for part in parts)
        return Element(key, 0 if self.kind == "map" else None, SENTINEL_COMMENT)

    def sentinel_key(self) -> bytes:
        """The sentinel's key as the kernel holds it (each part padded to 4 bytes)."""
        parts = self.type.split(" : ")[0].split(" . ")
        return b"".join(_SENTINEL_PARTS[part][1] for part in parts)


SENTINEL_COMMENT = "uproxy sentinel (not a service)"
_SENTINEL_PARTS: dict[str, tuple[str | int, bytes]] = {
    "ipv4_addr": ("0.0.0.0", bytes(4)),
    "ipv6_addr": ("::", bytes(16)),
    "inet_proto": ("tcp", bytes([socket.IPPROTO_TCP, 0, 0, 0])),
    "inet_service": (0, bytes(4)),
}


@dataclass(frozen=True, slots=True)
class Chain:
    name: str
    type: str
    hook: str
    priority: int
    rules: tuple[str, ...]

    def header(self) -> str:
        return f"type {self.type} hook {self.hook} priority {self.priority}; policy accept;"


@dataclass(frozen=True, slots=True)
class Skeleton:
    """What ``nft -t list table`` shows: maps and sets by name, chains with their rule count."""

    stores: frozenset[tuple[str, str]]  # (kind, name)
    chains: frozenset[tuple[str, str, str, int, int]]  # (name, type, hook, priority, rules)


class Layout:
    """The fixed part of the table: maps, sets and chains (rules) for one configuration."""

    def __init__(
        self,
        family: Family = IPV4,
        *,
        host_ip: str,
        listen_ip: str = ANY_IPV4,
        dial_mark: int = 0,
        nodeport_cidrs: Collection[str] = (),
        local: LocalTraffic = NO_LOCAL_TRAFFIC,
    ) -> None:
        check_host_ip(host_ip)
        self.family = family
        addr = f"{family.addr_type} . inet_proto . inet_service"
        port = "inet_proto . inet_service"
        self.stores = (
            Store("map", CLUSTER_IPS, f"{addr} : inet_service"),
            Store("map", EXTERNAL_IPS, f"{addr} : inet_service"),
            Store("map", NODE_PORTS, f"{port} : inet_service"),
            Store("set", NODE_PORT_PROXY_PORTS, port),
            Store("set", PROXY_PORTS, port),
            Store("map", SHORT_CIRCUIT_LB_IPS, f"{addr} : inet_service"),
            Store("map", SHORT_CIRCUIT_EXTERNAL_IPS, f"{addr} : inet_service"),
            Store("map", SHORT_CIRCUIT_NODE_PORTS, f"{port} : inet_service"),
            Store("set", FIREWALLED_LB_IPS, addr),
            Store("set", LB_SOURCE_RANGES, f"{addr} . {family.addr_type}", "interval"),
            Store("set", REJECTED_PROXY_PORTS, port),
            Store("set", DROPPED_PROXY_PORTS, port),
        )
        any_address = _is_unspecified(listen_ip)
        container = "redirect to :" if any_address else f"dnat to {family.nat_to(listen_ip)}"
        host = f"dnat to {family.nat_to(host_ip if any_address else listen_ip)}"
        matches = _Matches(
            nodeports=family.match(family.daddr, nodeport_cidrs),
            pods=_pods(family, local),
            listen="" if any_address else f"{family.daddr} {family.address(listen_ip)} ",
        )
        self.chains = _chains(family, container, host, dial_mark, matches)

    def skeleton(self) -> Skeleton:
        return Skeleton(
            frozenset((s.kind, s.name) for s in self.stores),
            frozenset((c.name, c.type, c.hook, c.priority, len(c.rules)) for c in self.chains),
        )


def _is_unspecified(ip: str) -> bool:
    """Whether uproxy listens on every address (0.0.0.0 or ::, whatever the table's family)."""
    return ipaddress.ip_address(ip).is_unspecified


@dataclass(frozen=True, slots=True)
class _Matches:
    """Configuration-dependent matches, each "" or ending in a space."""

    nodeports: str  # the destinations node ports answer on (--nodeport-addresses)
    pods: str  # traffic from pods (--detect-local-mode); "": not told apart
    listen: str = ""  # the proxy ports' address, when uproxy listens on one address only


def _pods(family: Family, local: LocalTraffic) -> str:
    if local.interface:
        return f'iifname "{local.interface}{"*" if local.prefix else ""}" '
    if any(n.prefixlen == 0 for n in collapse(local.cidrs, family.version)):
        return f"meta nfproto ipv{family.version} "  # every source is a pod: always true
    return family.match(family.saddr, local.cidrs)


def _pod_rules(
    to: str, by_address: str, by_port: str, m: _Matches
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The container rules sending pods to the short-circuit maps first (portals, node ports);
    none when pods are not told apart. ``to`` is the protocols and the translation."""
    if not m.pods:
        return (), ()
    local = "fib daddr type local"
    portals = (
        f"{m.pods}{to}{by_address} @{SHORT_CIRCUIT_LB_IPS}",
        f'{m.pods}meta iifkind != "bridge" {to}{by_address} @{SHORT_CIRCUIT_EXTERNAL_IPS}',
        f"{m.pods}{local} {to}{by_address} @{SHORT_CIRCUIT_EXTERNAL_IPS}",
    )
    node_ports = (f"{m.nodeports}{m.pods}{local} {to}{by_port} @{SHORT_CIRCUIT_NODE_PORTS}",)
    return portals, node_ports


def _chains(
    family: Family, container: str, host: str, dial_mark: int, m: _Matches
) -> tuple[Chain, ...]:
    """The eight chains; ``container``/``host`` are the translation up to the port map."""
    l4 = "meta l4proto { tcp, udp }"
    local = "fib daddr type local"
    key = f"{family.daddr} . meta l4proto . th dport"
    by_address = f"{key} map"
    by_port = "meta l4proto . th dport map"
    mark_return: tuple[str, ...] = ()
    if dial_mark:
        mark_return = (
            f'meta mark & {dial_mark:#x} == {dial_mark:#x} return comment "{DIAL_MARK_COMMENT}"',
        )
    pods, pod_node_ports = _pod_rules(f"{l4} {container}", by_address, by_port, m)
    nat, prerouting, output, np = "nat", "prerouting", "output", m.nodeports
    return (
        Chain("portals-firewall", "filter", prerouting, FIREWALL_PRIORITY, (
            f"ct state new {key} @{FIREWALLED_LB_IPS} "
            f"{key} . {family.saddr} != @{LB_SOURCE_RANGES} drop",
        )),
        Chain("portals-container", nat, prerouting, PORTALS_PRIORITY, (
            *pods[:1],  # LB IPs, which are in cluster-ips too
            f"{l4} {container}{by_address} @{CLUSTER_IPS}",
            *pods[1:],
            f'meta iifkind != "bridge" {l4} {container}{by_address} @{EXTERNAL_IPS}',
            f"{local} {l4} {container}{by_address} @{EXTERNAL_IPS}",
        )),
        Chain("portals-host", nat, output, PORTALS_PRIORITY, (
            *mark_return,
            f"{l4} {host}{by_address} @{SHORT_CIRCUIT_LB_IPS}",
            f"{l4} {host}{by_address} @{CLUSTER_IPS}",
            f"{local} {l4} {host}{by_address} @{SHORT_CIRCUIT_EXTERNAL_IPS}",
            f"{local} {l4} {host}{by_address} @{EXTERNAL_IPS}",
        )),
        Chain("node-ports-container", nat, prerouting, NODE_PORTS_PRIORITY, (
            *pod_node_ports,
            f"{np}{local} {l4} {container}{by_port} @{NODE_PORTS}",
        )),
        Chain("node-ports-host", nat, output, NODE_PORTS_PRIORITY, (
            *mark_return,
            f"{np}{local} {l4} {host}{by_port} @{SHORT_CIRCUIT_NODE_PORTS}",
            f"{np}{local} {l4} {host}{by_port} @{NODE_PORTS}",
        )),
        Chain("node-ports-filter", "filter", "input", FILTER_PRIORITY, (
            f"ct state new ct status dnat meta l4proto . th dport @{NODE_PORT_PROXY_PORTS} accept",
        )),
        Chain("no-endpoints", "filter", "input", FILTER_PRIORITY - 1, (
            f"ct state new {m.listen}meta l4proto . th dport @{REJECTED_PROXY_PORTS} "
            "meta l4proto tcp reject with tcp reset",
            f"ct state new {m.listen}meta l4proto . th dport @{REJECTED_PROXY_PORTS} reject",
            f"ct state new {m.listen}meta l4proto . th dport @{DROPPED_PROXY_PORTS} drop",
        )),
        Chain(DIRECT_CHAIN, "filter", "input", DIRECT_PRIORITY, (
            f"ct state new ct status & dnat != dnat fib saddr type != local "
            f"{m.listen}meta l4proto . th dport @{PROXY_PORTS} drop",
        )),
    )  # fmt: skip


# ----- elements -------------------------------------------------------------------------------


def portal_elements(portal: Portal, family: Family) -> tuple[tuple[str, Element], ...]:
    """The (map or set name, element) pairs one portal needs."""
    proto = portal.protocol.value.lower()
    if portal.refusal:
        reject = portal.kind is PortalKind.NO_ENDPOINTS
        what = "has no endpoints" if reject else "has no local endpoints"
        store = REJECTED_PROXY_PORTS if reject else DROPPED_PROXY_PORTS
        text = element_comment(f"{portal.service} {what}")
        return ((store, Element((proto, portal.proxy_port), None, text)),)
    comment = element_comment(str(portal.service))
    if portal.kind is PortalKind.NODE_PORT:
        return _node_port_elements(portal, proto, comment)
    if portal.ip is None:
        raise ValueError(f"portal of kind {portal.kind} for {portal.service} has no address")
    external = portal.kind is PortalKind.EXTERNAL_IP
    key = (family.address(portal.ip), proto, portal.port)
    out = [(EXTERNAL_IPS if external else CLUSTER_IPS, Element(key, portal.proxy_port, comment))]
    out += _proxy_port_elements(portal, proto, comment)
    if portal.short_circuit:
        name = SHORT_CIRCUIT_EXTERNAL_IPS if external else SHORT_CIRCUIT_LB_IPS
        out.append((name, Element(key, portal.cluster_proxy_port, comment)))
    allowed = source_ranges(portal, family.version) if portal.kind is PortalKind.LB_INGRESS else []
    if allowed:
        out.append((FIREWALLED_LB_IPS, Element(key, None, comment)))
        for net in allowed:
            out.append((LB_SOURCE_RANGES, Element((*key, network_text(net)), None, comment)))
    return tuple(out)


def _proxy_port_elements(portal: Portal, proto: str, comment: str) -> list[tuple[str, Element]]:
    """The ``proxy-ports`` elements of a portal: every proxy port it leads to, which nothing
    may reach but through a portal (``proxy-ports-direct``)."""
    ports = [portal.proxy_port]
    if portal.short_circuit:
        ports.append(portal.cluster_proxy_port)
    return [(PROXY_PORTS, Element((proto, port), None, comment)) for port in ports]


def _node_port_elements(
    portal: Portal, proto: str, comment: str
) -> tuple[tuple[str, Element], ...]:
    out = [
        (NODE_PORTS, Element((proto, portal.port), portal.proxy_port, comment)),
        (NODE_PORT_PROXY_PORTS, Element((proto, portal.proxy_port), None, comment)),
        *_proxy_port_elements(portal, proto, comment),
    ]
    if portal.short_circuit:
        cluster = portal.cluster_proxy_port
        out.append((SHORT_CIRCUIT_NODE_PORTS, Element((proto, portal.port), cluster, comment)))
        out.append((NODE_PORT_PROXY_PORTS, Element((proto, cluster), None, comment)))
    return tuple(out)


def empty_elements() -> Elements:
    return {name: {} for name in STORE_NAMES}


class ElementBuilder:
    """The elements for a portal set, remembering each portal's between syncs (as RuleBuilder).

    ``conflicts`` lists the keys two portals wanted with different values in the last build.
    """

    def __init__(self, family: Family = IPV4) -> None:
        self.family = family
        self._by_portal: dict[Portal, tuple[tuple[str, Element], ...]] = {}
        self._last: tuple[frozenset[Portal], Elements] | None = None
        self.conflicts: list[str] = []

    def build(self, portals: Collection[Portal]) -> Elements:
        """The elements for ``portals``; the same (unmodified) object for the same portals."""
        given = frozenset(portals)  # the syncer's frozenset itself: no copy
        if self._last is not None and self._last[0] == given:
            return self._last[1]  # the periodic sync: nothing to build or sort
        out = self._build(given)
        self._last = (given, out)
        return out

    def _build(self, portals: frozenset[Portal]) -> Elements:
        out = empty_elements()
        by_portal: dict[Portal, tuple[tuple[str, Element], ...]] = {}
        conflicts: list[str] = []
        for portal in sorted(portals, key=portal_key):
            pairs = self._by_portal.get(portal)
            if pairs is None:
                pairs = portal_elements(portal, self.family)
            by_portal[portal] = pairs
            for name, element in pairs:
                if name in _FIREWALL and not _owns(out, element):
                    continue  # another service has this LB IP and port: its ranges apply
                first = out[name].setdefault(element.key, element)
                if first.value != element.value:
                    conflicts.append(
                        f"{name} {element.key_text()}: {first.comment} -> {first.value}, "
                        f"not {element.comment} -> {element.value}"
                    )
        self._by_portal = by_portal
        self.conflicts = conflicts
        return out


_FIREWALL = frozenset({FIREWALLED_LB_IPS, LB_SOURCE_RANGES})


def _owns(out: Elements, element: Element) -> bool:
    """Whether the portal of a firewall element is the one that has its LB IP and port."""
    owner = out[CLUSTER_IPS].get(element.key[:3])
    return owner is not None and owner.comment == element.comment


def diff(have: Elements, want: Elements) -> tuple[dict[str, list[Element]], ...]:
    """(deletes, adds) per map or set turning ``have`` into ``want``; a changed element is in
    both (nft keeps the old value or comment when an existing key is added again)."""
    deletes: dict[str, list[Element]] = {}
    adds: dict[str, list[Element]] = {}
    for name in sorted(set(have) | set(want)):
        old, new = have.get(name, {}), want.get(name, {})
        if old == new:
            continue
        gone = [e for k, e in old.items() if new.get(k) != e]
        came = [e for k, e in new.items() if old.get(k) != e]
        if gone:
            deletes[name] = sorted(gone, key=lambda e: e.key)
        if came:
            adds[name] = sorted(came, key=lambda e: e.key)
    return deletes, adds


# ----- nft input --------------------------------------------------------------------------------


def _chunks(items: list[str]) -> Iterable[list[str]]:
    for i in range(0, len(items), _ELEMENTS_PER_STATEMENT):
        yield items[i : i + _ELEMENTS_PER_STATEMENT]


def render_delta(
    family: Family, deletes: Mapping[str, list[Element]], adds: Mapping[str, list[Element]]
) -> str:
    """One transaction: the deletes, then the adds; empty when there is nothing to do."""
    where = f"{family.table} {TABLE}"
    lines: list[str] = []
    for name, elements in deletes.items():
        for chunk in _chunks([e.key_text() for e in elements]):
            lines.append(f"delete element {where} {name} {{ {', '.join(chunk)} }}")
    for name, elements in adds.items():
        for chunk in _chunks([e.text() for e in elements]):
            lines.append(f"add element {where} {name} {{ {', '.join(chunk)} }}")
    return "".join(line + "\n" for line in lines)


def stamp_rule(stamp: str) -> str:
    """The one rule of the stamp chain: nothing jumps to it, its comment names the commit."""
    return f'return comment "{element_comment(stamp)}"'


def render_stamp(family: Family, stamp: str) -> str:
    """The lines replacing the stamp in an incremental transaction."""
    where = f"{family.table} {TABLE} {STAMP_CHAIN}"
    return f"flush chain {where}\nadd rule {where} {stamp_rule(stamp)}\n"


def render_table(layout: Layout, elements: Elements, *, stamp: str) -> str:
    """The table definition, ``table ip uproxy { ... }``, with every element and the stamp."""
    lines = [f"table {layout.family.table} {TABLE} {{"]
    for store in layout.stores:
        lines += [f"\t{store.kind} {store.name} {{", f"\t\ttype {store.type}"]
        if store.flags:
            lines.append(f"\t\tflags {store.flags}")
        members = sorted(elements.get(store.name, {}).values(), key=lambda e: e.key)
        body = ",\n\t\t\t".join(e.text() for e in [store.sentinel(), *members])
        lines.append(f"\t\telements = {{ {body} }}")
        lines.append("\t}")
    for chain in layout.chains:
        lines += [f"\tchain {chain.name} {{", f"\t\t{chain.header()}"]
        lines += [f"\t\t{rule}" for rule in chain.rules]
        lines.append("\t}")
    lines += [f"\tchain {STAMP_CHAIN} {{", f"\t\t{stamp_rule(stamp)}", "\t}", "}"]
    return "\n".join(lines) + "\n"


def render_full(layout: Layout, elements: Elements, *, stamp: str) -> str:
    """One transaction replacing the table whole: create it if missing, delete it, load it."""
    where = f"{layout.family.table} {TABLE}"
    return f"add table {where}\ndelete table {where}\n" + render_table(
        layout, elements, stamp=stamp
    )


# ----- nft output -------------------------------------------------------------------------------


def _objects(listing: str) -> list[dict[str, Any]]:
    try:
        doc = json.loads(listing)
        objects = doc["nftables"]
    except (ValueError, KeyError, TypeError):
        return []
    return [o for o in objects if isinstance(o, dict)]


def parse_skeleton(listing: str) -> Skeleton:
    """The skeleton of ``nft -j list table`` output (elements, if listed, are ignored)."""
    stores: set[tuple[str, str]] = set()
    chains: dict[str, tuple[str, str, int]] = {}
    counts: dict[str, int] = {}
    for obj in _objects(listing):
        for kind in ("map", "set"):
            if kind in obj:
                stores.add((kind, str(obj[kind].get("name"))))
        if "chain" in obj and obj["chain"].get("name") != STAMP_CHAIN:
            c = obj["chain"]
            chains[str(c.get("name"))] = (str(c.get("type")), str(c.get("hook")), c.get("prio"))
        if "rule" in obj and obj["rule"].get("chain") != STAMP_CHAIN:
            name = str(obj["rule"].get("chain"))
            counts[name] = counts.get(name, 0) + 1
    return Skeleton(
        frozenset(stores),
        frozenset((n, t, h, p, counts.get(n, 0)) for n, (t, h, p) in chains.items()),
    )


def rules_digest(listing: str) -> int:
    """A digest of every rule in a listing (chain, expressions, comment, in order), the
    stamp's excepted; handles left out: they change with every load."""
    rules = [o["rule"] for o in _objects(listing) if "rule" in o]
    return hash(
        tuple(
            (r.get("chain"), json.dumps(r.get("expr"), sort_keys=True), r.get("comment"))
            for r in rules
            if isinstance(r, dict) and r.get("chain") != STAMP_CHAIN
        )
    )


def parse_stamp(listing: str) -> str | None:
    """The comment of the stamp chain's one rule; None without that chain or that one rule."""
    rules = [o["rule"] for o in _objects(listing) if "rule" in o]
    found = [r for r in rules if isinstance(r, dict) and r.get("chain") == STAMP_CHAIN]
    if len(found) != 1 or found[0].get("expr") != [{"return": None}]:
        return None
    comment = found[0].get("comment")
    return comment if isinstance(comment, str) else None


def _element(item: Any, is_map: bool) -> Element:
    value = None
    if is_map:
        item, value = item
    comment = ""
    if isinstance(item, dict) and "elem" in item:
        comment = str(item["elem"].get("comment", ""))
        item = item["elem"]["val"]
    parts = item["concat"] if isinstance(item, dict) and "concat" in item else [item]
    return Element(tuple(_key_part(part) for part in parts), value, comment)


def _key_part(part: Any) -> str | int:
    """One component of an element's key as uproxy writes it (a prefix as ``addr/len``)."""
    if isinstance(part, dict) and "prefix" in part:
        prefix = part["prefix"]
        return f"{prefix.get('addr')}/{prefix.get('len')}"
    return part if isinstance(part, int) else str(part)


def parse_elements(listing: str) -> Elements:
    """Every map's and set's elements in ``nft -j list table`` output."""
    out: Elements = {}
    for obj in _objects(listing):
        for kind in ("map", "set"):
            if kind in obj:
                body = obj[kind]
                members = [_element(item, kind == "map") for item in body.get("elem", [])]
                out[str(body.get("name"))] = {
                    e.key: e for e in members if e.comment != SENTINEL_COMMENT
                }
    return out


# ----- the backend ------------------------------------------------------------------------------


async def table_families() -> set[str]:
    """The families in which a ``uproxy`` table exists. Without the ``nft`` program the
    kernel is asked over netlink: RulesError naming the program when a table is there."""
    if shutil.which("nft") is None:
        names = {f.version: f.table for f in FAMILIES}
        missing = sorted(
            f"{names[4 if nfproto == 2 else 6]} {TABLE}"
            for nfproto, name in nft_tables() or ()
            if name == TABLE and nfproto in (2, 10)
        )
        if missing:
            raise RulesError(
                f"nft not found: cannot remove table {', '.join(missing)}; "
                "install the nftables package"
            )
        return set()
    done = await command.run(["nft", "list", "tables"], check=False)
    if done.returncode != 0:
        return set()  # no nf_tables here: nothing of ours either
    found = set()
    for line in done.stdout.splitlines():
        words = line.split()
        if len(words) == 3 and words[0] == "table" and words[2] == TABLE:
            found.add(words[1])
    return found


async def cleanup_tables(families: Iterable[Family] = FAMILIES) -> bool:
    """Delete uproxy's nft tables; False when there were none."""
    present = await table_families()
    doomed = [f.table for f in families if f.table in present]
    if not doomed:
        return False
    await command.run(
        ["nft", "-f", "-"], stdin="".join(f"delete table {t} {TABLE}\n" for t in doomed)
    )
    log.info(
        "Removed nft tables", extra={"kv": {"tables": ",".join(f"{t} {TABLE}" for t in doomed)}}
    )
    return True


class _Table:
    """One family's table: its layout, how its elements are built, and what is installed."""

    def __init__(self, stack: Stack, options: dict[str, Any], local: LocalTraffic) -> None:
        self.stack = stack
        self.family = FAMILY_OF[stack.family]
        self.layout = _layout(self.family, stack, options, local)
        self.builder = ElementBuilder(self.family)
        self.installed: Elements | None = None  # None: not known to hold anything of ours
        # The digest of its rules as nft lists them after uproxy's last full load (None:
        # not read yet; ``learn_rules``): a rule replaced in place changes it.
        self.rules: int | None = None

    @property
    def where(self) -> str:
        return f"{self.family.table} {TABLE}"


class NftablesBackend:
    """Programs the portals into ``table ip uproxy`` (and ``table ip6 uproxy``) with
    ``nft -f -``, one transaction per sync for every family."""

    name = "nftables"

    def __init__(
        self,
        *,
        host_ip: str | Sequence[str],
        listen_ip: str | Sequence[str] = ANY_IPV4,
        dial_mark: int = 0,
        nodeport_cidrs: Collection[str] = (),
        local: LocalTraffic = NO_LOCAL_TRAFFIC,
        watch: Watch | None = None,
        clock: Callable[[], float] = time.monotonic,
        instance: str | None = None,
        leftovers: Leftovers = keep_leftovers,
        leftover_ports: LeftoverPorts = no_leftover_ports,
    ) -> None:
        self._options: dict[str, Any] = {
            "dial_mark": dial_mark,
            "nodeport_cidrs": tuple(nodeport_cidrs),
        }
        try:
            served = stacks(host_ip, listen_ip)
        except ValueError as exc:
            raise RulesError(str(exc)) from None
        self._tables = {s.family: _Table(s, self._options, local) for s in served}
        self.local = local
        self.host_ip = served[0].host_ip
        self.listen_ip = served[0].listen_ip
        self._watch = watch if watch is not None else GenerationWatch()
        self._clock = clock
        self._lock = asyncio.Lock()
        self._damaged = False  # the tables do not hold what was installed: load them whole
        self._reload = False  # the layout changed: the next sync loads the tables whole
        self._last_full = float("-inf")
        self._conflicts: frozenset[str] = frozenset()
        self.transactions = 0  # nft -f runs, failed ones included
        self.full_loads = 0
        # Every commit of ours writes a new stamp; a table holding another one was written by
        # somebody else since (another uproxy, a ruleset restored from a file).
        self._instance = instance if instance is not None else secrets.token_hex(4)
        self._stamp: str | None = None  # the last one committed
        self._foreign: str | None = None  # the last stranger's stamp reported
        self.previous_ports: Previous = {}  # what the last run's table led to (``prepare``)
        self._leftovers = leftovers
        self._leftover_ports = leftover_ports
        self._swept = False  # the iptables backends' rules removed (after the first load)

    @property
    def families(self) -> tuple[IPFamily, ...]:
        return tuple(self._tables)

    @property
    def layout(self) -> Layout:
        """The first family's layout (the only one on a single-stack node)."""
        return next(iter(self._tables.values())).layout

    def set_local_traffic(self, local: LocalTraffic) -> None:
        """New layouts (their pod rules change): the next sync loads the tables whole."""
        if local != self.local:
            for table in self._tables.values():
                table.layout = _layout(table.family, table.stack, self._options, local)
            self.local = local
            self._reload = True

    def set_host_ip(self, family: IPFamily, host_ip: str) -> None:
        """A new layout (its host rules DNAT there): the next sync loads the tables whole."""
        table = self._tables.get(family)
        if table is None or table.stack.host_ip == host_ip:
            return
        check_host_ip(host_ip)
        table.stack = replace(table.stack, host_ip=host_ip)
        table.layout = _layout(table.family, table.stack, self._options, self.local)
        self.host_ip = next(iter(self._tables.values())).stack.host_ip
        self._reload = True

    @property
    def _where(self) -> str:
        return ", ".join(t.where for t in self._tables.values())

    @property
    def _installed(self) -> bool:
        return all(t.installed is not None for t in self._tables.values())

    def _build(self, portals: Collection[Portal]) -> dict[IPFamily, Elements]:
        split = split_by_family(portals, self._tables)
        return {f: t.builder.build(split[f]) for f, t in self._tables.items()}

    async def prepare(self) -> None:
        """Read the proxy ports the last run's table leads to (``previous``), or the rules of
        another backend a run before left; nothing to probe: ``nft`` is the one tool, and a
        table is ours or not. What other backends left goes after the first load."""
        try:
            previous = await read_previous(self._tables)
            await self._leftover_ports(
                previous, nft_tables=False, iptables_modes=MODES, families=self._tables
            )
            self.previous_ports = previous
        except (RulesError, OSError, ValueError):
            self.previous_ports = {}

    async def sync(self, portals: Collection[Portal]) -> None:
        async with self._lock:
            try:
                # Off the loop: building 10,000 portals' elements is ~60 ms of Python.
                want = await asyncio.to_thread(self._build, portals)
            except ValueError as exc:
                raise RulesError(str(exc)) from None
            self._report_conflicts()
            if self._installed and not await self._full_due():
                text = "".join(
                    render_delta(t.family, *diff(t.installed or {}, want[f]))
                    for f, t in self._tables.items()
                )
                if not text:
                    return
                stamp = self._next_stamp()
                text += "".join(render_stamp(t.family, stamp) for t in self._tables.values())
                try:
                    await self._commit(text, before=self._watch.marked, stamp=stamp)
                except RulesError as exc:
                    log.info(
                        "Updating the nft tables failed, loading them whole",
                        extra={"kv": {"err": str(exc)}},
                    )
                else:
                    self._set_installed(want)
                    return
            await self._load(want)

    def _set_installed(self, want: Mapping[IPFamily, Elements] | None) -> None:
        for family, table in self._tables.items():
            table.installed = want[family] if want is not None else None

    async def _full_due(self) -> bool:
        if self._damaged or self._reload:
            return True
        if self._clock() - self._last_full >= FULL_SYNC_PERIOD_S:
            return True
        return self._watch.changed() and not await self._intact()

    def _next_stamp(self) -> str:
        return f"uproxy {self._instance} commit {self.transactions + 1}"

    def _render_full(self, want: Mapping[IPFamily, Elements], stamp: str) -> str:
        return "".join(render_full(t.layout, want[f], stamp=stamp) for f, t in self._tables.items())

    async def _load(self, want: Mapping[IPFamily, Elements]) -> None:
        try:
            stamp = self._next_stamp()
            text = await asyncio.to_thread(self._render_full, want, stamp)
            await self._commit(text, before=self._watch.read(), stamp=stamp)
        except RulesError as exc:
            self._set_installed(None)
            raise RulesError(f"cannot load table {self._where}: {exc}") from None
        if self._damaged:
            log.info("Reloaded the nft tables", extra={"kv": {"table": self._where}})
        for table in self._tables.values():
            table.rules = None  # learnt again at the next quiet check
        self._set_installed(want)
        self._damaged = self._reload = False
        self._last_full = self._clock()
        self.full_loads += 1
        if not self._swept:  # this run's first rules are in (``Leftovers``)
            self._swept = True
            await self._leftovers(nft_tables=False, iptables_modes=MODES)

    async def _commit(self, text: str, *, before: Token | None, stamp: str) -> None:
        self.transactions += 1
        try:
            await command.write(["nft", "-f", "-"], stdin=text)
        except RulesError:
            self._watch.forget()
            raise
        self._stamp = stamp
        self._watch.mark_after_commit(before, commits=1)

    async def _intact(self) -> bool:
        """The real check: chains, their rule counts, maps and sets, without elements, and the
        stamp of uproxy's last commit."""
        token = self._watch.read()
        ok = True
        for table in self._tables.values():
            done = await _list_terse(table)
            ok = ok and done.returncode == 0
            ok = ok and parse_skeleton(done.stdout) == table.layout.skeleton()
            ok = ok and self._stamp_holds(table, parse_stamp(done.stdout))
            ok = ok and (table.rules is None or rules_digest(done.stdout) == table.rules)
            ok = ok and await _sentinels_present(table)
        if ok:
            self._watch.mark(token)
        else:
            self._damaged = True
            self._watch.forget()
        return ok

    def _stamp_holds(self, table: _Table, found: str | None) -> bool:
        """Whether ``found`` is the last stamp uproxy committed; a stranger's is logged once."""
        if found == self._stamp:
            return True
        if found is not None and found != self._foreign:
            self._foreign = found
            log.warning(
                "The nft table was written by somebody else since uproxy's last commit "
                "(another uproxy, or a ruleset restored from a file): reloading it",
                extra={"kv": {"table": table.where, "found": found, "want": self._stamp}},
            )
        return False

    def _report_conflicts(self) -> None:
        conflicts = frozenset(c for t in self._tables.values() for c in t.builder.conflicts)
        for text in sorted(conflicts - self._conflicts):
            log.warning("Two portals want one map key, the first wins", extra={"kv": {"key": text}})
        self._conflicts = conflicts

    async def check(self) -> bool:
        """Whether the tables are still as last synced; no process unless someone committed."""
        async with self._lock:
            if not self._installed:
                return True
            if self._damaged:
                return False
            if not self._watch.changed():
                await self._learn_rules()
                return True
            return await self._intact()

    async def _learn_rules(self) -> None:
        """Once after each full load, while nobody has committed since: the rules as nft
        lists them (one ``nft -t`` per table), for ``_intact`` to compare. A rule replaced in
        place keeps the counts and the stamp: only its text tells."""
        if all(t.rules is not None for t in self._tables.values()):
            return
        token = self._watch.read()
        learnt: dict[IPFamily, int] = {}
        for family, table in self._tables.items():
            done = await _list_terse(table)
            if done.returncode != 0:
                return
            learnt[family] = rules_digest(done.stdout)
        if token is not None and self._watch.read() == token:  # nobody committed meanwhile
            for family, digest in learnt.items():
                self._tables[family].rules = digest

    async def verify(self) -> bool:
        """Full comparison with the last sync, elements included (lists the whole tables)."""
        async with self._lock:
            if not self._installed:
                return True
            for table in self._tables.values():
                argv = ["nft", "-j", "list", "table", table.family.table, TABLE]
                done = await command.run(argv, check=False)
                if done.returncode != 0:
                    return False
                if parse_skeleton(done.stdout) != table.layout.skeleton():
                    return False
                if parse_stamp(done.stdout) != self._stamp:
                    return False
                if parse_elements(done.stdout) != table.installed:
                    return False
                if not await _sentinels_present(table):
                    return False
            return True

    async def cleanup(self) -> None:
        """Remove uproxy's nft tables and whatever the iptables backends installed."""
        async with self._lock:
            await cleanup_tables()
            for mode in MODES:
                for family in IPFamily:
                    await cleanup_mode(mode, family)
            self._set_installed(None)
            self._damaged = False
            self._watch.forget()

    async def close(self) -> None:
        return None


async def _list_terse(table: _Table) -> command.Completed:
    """``nft -t -j list table``: chains, rules, maps and sets, without their elements."""
    argv = ["nft", "-t", "-j", "list", "table", table.family.table, TABLE]
    return await command.run(argv, check=False)


_NFPROTO = {4: 2, 6: 10}  # nf_tables' family numbers of ip and ip6


async def _sentinels_present(table: _Table) -> bool:
    """Whether every map and set of the table still holds its sentinel: a flushed one does
    not. Asked over netlink (one request per store, no process); ``nft get element`` when
    netlink cannot tell."""
    stores = table.layout.stores
    wanted = [(store.name, store.sentinel_key()) for store in stores]
    found = elements_present(_NFPROTO[table.family.version], TABLE, wanted)
    if found is not None:
        return found
    text = "".join(
        f"get element {table.where} {store.name} {{ {store.sentinel().key_text()} }}\n"
        for store in stores
    )
    done = await command.run(["nft", "-t", "-f", "-"], stdin=text, check=False)
    return done.returncode == 0


async def read_previous(families: Iterable[IPFamily]) -> dict[PortalKey, int]:
    """The proxy ports the last run's tables lead to (see ``previous``): one listing per
    family whose table exists."""
    tables = nft_tables()
    out: dict[PortalKey, int] = {}
    for family in map(FAMILY_OF.__getitem__, families):
        if tables is not None and (_NFPROTO[family.version], TABLE) not in tables:
            continue
        done = await command.run(["nft", "-j", "list", "table", family.table, TABLE], check=False)
        if done.returncode == 0:
            out.update(await asyncio.to_thread(_previous_of, done.stdout))
    return out


def _previous_of(listing: str) -> dict[PortalKey, int]:
    """The proxy port of each service address and node port in a listed table."""
    found = parse_elements(listing)
    out: dict[PortalKey, int] = {}
    for name in (CLUSTER_IPS, EXTERNAL_IPS):
        for element in found.get(name, {}).values():
            ip, proto, port = element.key
            if element.value is not None:
                out.setdefault((str(ip), str(proto), int(port)), element.value)
    for element in found.get(NODE_PORTS, {}).values():
        proto, port = element.key
        if element.value is not None:
            out.setdefault(("", str(proto), int(port)), element.value)
    return out


def _layout(family: Family, stack: Stack, options: dict[str, Any], local: LocalTraffic) -> Layout:
    try:
        return Layout(
            family, host_ip=stack.host_ip, listen_ip=stack.listen_ip, **options, local=local
        )
    except ValueError as exc:
        raise RulesError(str(exc)) from None
