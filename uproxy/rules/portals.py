"""The portal rule set: which iptables rules steer each service address into uproxy.

This is a pure function of the desired portals, so both kernel backends (iptables-restore and
python-iptables) render the *same* structured rules and tests can compare exact text without
root. The rules follow kube-proxy's userspace mode, chain names and comments included, so
operators' habits carry over:

- nat ``KUBE-PORTALS-CONTAINER`` (jumped to first from PREROUTING): traffic from pods and other
  hosts to a ClusterIP / LoadBalancer IP / externalIP is REDIRECTed to the proxy port (or DNATed
  to the listen address when uproxy listens on one address only).
- nat ``KUBE-PORTALS-HOST`` (first in OUTPUT): traffic from the node itself is DNATed to
  ``host_ip:proxy_port``. Never 127.0.0.1: that needs ``route_localnet`` (CVE-2020-8558).
- nat ``KUBE-NODEPORT-CONTAINER`` / ``KUBE-NODEPORT-HOST`` (appended last, only for local
  destinations): node ports, after every portal so a portal always wins. With
  ``--nodeport-addresses`` each jump also matches one of its CIDRs (``-d CIDR``, one jump per
  CIDR, as kube-proxy writes one per node address), so the kernel decides per packet which
  local addresses answer: no rule has to follow the node's addresses.
- filter ``KUBE-NODEPORT-NON-LOCAL`` (from INPUT): accepts new connections to the proxy port of a
  node port behind default-deny firewalls. It matches the *proxy* port, as the packet has
  already been redirected when it reaches INPUT, and only connections a portal translated
  (``-m conntrack --ctstate DNAT``: REDIRECT sets it too), never one straight to the port.
- filter ``KUBE-PORTALS-DIRECT`` (first in INPUT, for new connections no portal translated,
  ``! --ctstate DNAT``, from anywhere but the node's own addresses, ``! --src-type LOCAL``):
  DROPs those to a proxy port. Every proxy port listens on every address (REDIRECT rewrites
  the destination to the incoming interface's address), so a client connecting to
  ``NODE_IP:PROXY_PORT`` itself would be served past every check the portals make: source
  ranges, ``--nodeport-addresses``, a Local policy's scope, a ClusterIP reached from outside.
  kube-proxy's own modes expose no such port. One rule per protocol and group of up to 15
  proxy ports (``-m multiport --dports``; ``direct_groups`` mostly keeps the groups when a
  port comes or goes, so a new service edits a few rules): 10,000 proxy ports are ~700-830
  rules. Portal traffic never enters the chain, nor (one jump per protocol, for the range
  proxy ports are taken from) a new connection to the node's own services below that range
  (ssh, the kubelet): a walk of it cost those 18 % of their connection rate at 10,000
  services.
- filter ``KUBE-PORTALS-FIREWALL`` (from INPUT and FORWARD, new connections only): enforces
  ``loadBalancerSourceRanges``, as kube-proxy's ``KUBE-PROXY-FIREWALL`` does (that name is
  kube-proxy's own, and both may run on one node). A LoadBalancer IP with source ranges is
  redirected in ``KUBE-PORTALS-CONTAINER`` only for sources in its ranges (``-s CIDR``, one rule
  per range); a redirected packet no longer has the LoadBalancer IP as its destination, so this
  chain drops exactly what was not let in. Not from OUTPUT: the node itself is always allowed
  (its host portal redirects regardless of source).
- filter ``KUBE-PORTALS-REJECT`` (from INPUT, new connections only): a proxy port whose traffic
  has no endpoint to go to turns new connections away, as kube-proxy's filter rules do a
  service's: ``REJECT`` when the service port has no usable endpoint at all (a TCP client is
  refused at once, by a RST: an ICMP error would be rate-limited per client, 6 and then one
  a second, and a client opening connections faster would wait out SYN retransmissions; a
  UDP client reads ECONNREFUSED from the ICMP port unreachable instead of waiting out a
  timeout), ``DROP`` when it has some but none for this traffic (a Local policy without an
  endpoint on this node). Every portal of the service (ClusterIP, externalIP,
  LoadBalancer IP, node port, from pods, other hosts and the node) leads to that proxy port,
  and conntrack turns the ICMP error back into one about the address the client used. Rules
  follow endpoints at the rules' pace (``--iptables-min-sync-period``), as kube-proxy's do;
  without rules (``--rules none``) a port without endpoints accepts and resets, as
  kube-proxy's userspace mode did.

externalIPs get kube-proxy's three rules: from containers when the packet did not come in over a
bridge port (``physdev ! --physdev-is-in``), from containers when the address is local, and
from the host when the address is local.

``externalTrafficPolicy: Local`` (a portal with a ``cluster_proxy_port``): traffic from outside
reaches only local endpoints, but traffic from the cluster reaches all of them, as kube-proxy
short-circuits it. The node's own traffic (the host chains) always goes to the cluster proxy
port; traffic from pods does when ``--detect-local-mode`` tells them apart: each container rule
of such a portal is preceded by a twin matching the pods (``-s CLUSTER_CIDR``, ``-i BRIDGE`` or
``-i PREFIX+``) that goes to the cluster proxy port. With source ranges, the twin matches pods
within each range (for CIDR modes the intersection of the two CIDRs, which is one of them or
nothing).

uproxy's own connections to endpoints carry a packet mark (``--dial-mark``). With a mark, the
first rule of both host chains RETURNs on it: a dial is itself a new connection from the node,
and without that rule every proxied connection would walk the host portal chain a second time
(with 10,000 services that more than doubled the proxy's system time per connection), and a
dial to an address that happens to be a portal would be sent back into uproxy.

Rules render in the exact canonical form ``iptables-save`` prints, so "installed == expected"
is a plain text comparison.

Each IP family has its own rule set, built from that family's portals: ``iptables`` for IPv4,
``ip6tables`` for IPv6 (the same chains, comments and matches; addresses as ``/128``, DNAT to
``[node address]:port``; REDIRECT works in ip6tables' nat PREROUTING too). The CIDRs of
``--nodeport-addresses``, ``--cluster-cidr`` and ``loadBalancerSourceRanges`` count in their
own family only: a family without node-port CIDRs answers on every address of that family,
as in kube-proxy.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import sys
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field, replace
from ipaddress import IPv4Network, IPv6Network

from uproxy.model import IPFamily, Protocol, ip_family
from uproxy.records import quick_init
from uproxy.rules.base import NO_LOCAL_TRAFFIC, LocalTraffic, Portal, PortalKind, Stack

NAT = "nat"
FILTER = "filter"

CONTAINER_PORTALS = "KUBE-PORTALS-CONTAINER"
HOST_PORTALS = "KUBE-PORTALS-HOST"
CONTAINER_NODEPORTS = "KUBE-NODEPORT-CONTAINER"
HOST_NODEPORTS = "KUBE-NODEPORT-HOST"
NON_LOCAL_NODEPORTS = "KUBE-NODEPORT-NON-LOCAL"
PORTALS_FIREWALL = "KUBE-PORTALS-FIREWALL"
PORTALS_REJECT = "KUBE-PORTALS-REJECT"
PORTALS_DIRECT = "KUBE-PORTALS-DIRECT"

# Every chain uproxy owns, per table, in a fixed order.
CHAINS: dict[str, tuple[str, ...]] = {
    NAT: (CONTAINER_PORTALS, HOST_PORTALS, CONTAINER_NODEPORTS, HOST_NODEPORTS),
    FILTER: (NON_LOCAL_NODEPORTS, PORTALS_FIREWALL, PORTALS_REJECT, PORTALS_DIRECT),
}
TABLES: tuple[str, ...] = (NAT, FILTER)
ALL_CHAINS: frozenset[str] = frozenset(c for chains in CHAINS.values() for c in chains)
# A live rewrite in iptables-nft mode fills CHAIN-NEW, then renames CHAIN to CHAIN-OLD and
# CHAIN-NEW to CHAIN, and deletes CHAIN-OLD (payload.rewrite_commits): names only seen meanwhile.
STAGED_NEW, STAGED_OLD = "-NEW", "-OLD"
STAGING_CHAINS: frozenset[str] = frozenset(
    c + suffix for c in ALL_CHAINS for suffix in (STAGED_NEW, STAGED_OLD)
)

_PORTALS_COMMENT = "handle ClusterIPs; NOTE: this must be before the NodePort rules"
_NODEPORTS_COMMENT = "handle service NodePorts; NOTE: this must be the last rule in the chain"
_NON_LOCAL_COMMENT = "Ensure that non-local NodePort traffic can flow"
_FIREWALL_COMMENT = "drop LoadBalancer traffic from outside its loadBalancerSourceRanges"
_REJECT_COMMENT = "turn away new connections to proxy ports without endpoints"
_DIRECT_COMMENT = "drop new connections to proxy ports that no portal translated"
DIRECT_RULE_COMMENT = "proxy ports are reached through the portals only"
# Proxy ports per DROP rule of KUBE-PORTALS-DIRECT: multiport takes 15 at most.
MULTIPORT_MAX = 15
# A TCP connection without endpoints is refused with a RST, not an ICMP error (rate-limited
# per client: the kernel's icmp_ratelimit, a burst of 6 and then one a second).
_TCP_RESET = "tcp-reset"
# No apostrophe: iptables-save would print it escaped, and the text is compared verbatim.
DIAL_MARK_COMMENT = "uproxy dials to endpoints skip the portals"

ANY_IPV4 = "0.0.0.0"
ANY_IPV6 = "::"
ANY = {IPFamily.V4: ANY_IPV4, IPFamily.V6: ANY_IPV6}


_PLAIN = re.compile(r"[-\w]+", re.ASCII).fullmatch  # letters, digits, "_" and "-"
_ESCAPES = str.maketrans({ch: "\\" + ch for ch in "\"\\'"})


def quote(value: str) -> str:
    """Quote a string as iptables-save does: bare when plain, else in escaped double quotes."""
    if _PLAIN(value):
        return value
    return f'"{value.translate(_ESCAPES)}"'


@dataclass(frozen=True, slots=True)
class JumpRule:
    """A rule in a built-in chain that sends packets into one of uproxy's chains."""

    table: str
    chain: str  # the built-in chain: PREROUTING, OUTPUT, INPUT or FORWARD
    target: str  # uproxy's chain
    comment: str
    dst_local: bool = False
    first: bool = True  # inserted at position 1 (else appended)
    dst: str | None = None  # a CIDR (node ports: one of --nodeport-addresses)
    ct_new: bool = False  # new connections only
    not_dnat: bool = False  # connections no portal translated (REDIRECT or DNAT) only
    src_not_local: bool = False  # from anywhere but the node's own addresses
    protocol: str | None = None  # with ``dports``: "tcp" | "udp"
    dports: str | None = None  # "LOW:HIGH": destination ports in that range only

    def spec(self) -> str:
        """The rule's arguments after ``-A CHAIN``, exactly as iptables-save prints them."""
        parts: list[str] = []
        if self.dst is not None:
            parts.append(f"-d {self.dst}")
        if self.protocol is not None:
            parts.append(f"-p {self.protocol}")
            if self.dports is not None:
                parts.append(f"-m {self.protocol} --dport {self.dports}")
        if self.ct_new:
            parts.append("-m conntrack --ctstate NEW")
        if self.not_dnat:
            parts.append("-m conntrack ! --ctstate DNAT")
        if self.dst_local:
            parts.append("-m addrtype --dst-type LOCAL")
        if self.src_not_local:
            parts.append("-m addrtype ! --src-type LOCAL")
        parts.append(f"-m comment --comment {quote(self.comment)}")
        parts.append(f"-j {self.target}")
        return " ".join(parts)

    def save_line(self) -> str:
        return f"-A {self.chain} {self.spec()}"


@quick_init
@dataclass(frozen=True, slots=True)
class PortalRule:
    """One rule in one of uproxy's chains, as data both backends can render."""

    table: str
    chain: str
    comment: str  # str(ServicePortName)
    protocol: str | None  # "tcp" | "udp"; None only for the dial-mark RETURN
    dport: int | None
    target: str  # "REDIRECT" | "DNAT" | "ACCEPT" | "RETURN" | "DROP"
    dst: str | None = None  # CIDR, e.g. "10.96.0.10/32"
    mark: int | None = None  # -m mark --mark MARK/MARK
    not_physdev_in: bool = False
    dst_local: bool = False
    state_new: bool = False
    to_ports: str | None = None  # REDIRECT --to-ports
    to_destination: str | None = None  # DNAT --to-destination
    src: str | None = None  # CIDR: a source range, or the pods' CIDR
    in_interface: str | None = None  # -i NAME, or NAME+ for a prefix
    reject_with: str | None = None  # REJECT --reject-with TYPE
    dports: str | None = None  # -m multiport --dports P1,P2,... (instead of one dport)
    dnat: bool = False  # -m conntrack --ctstate DNAT: connections a portal translated

    def spec(self) -> str:
        """The rule's arguments after ``-A CHAIN``, exactly as iptables-save prints them."""
        parts: list[str] = []
        if self.src is not None:
            parts.append(f"-s {self.src}")
        if self.dst is not None:
            parts.append(f"-d {self.dst}")
        if self.in_interface is not None:
            parts.append(f"-i {self.in_interface}")
        if self.protocol is not None:
            parts.append(f"-p {self.protocol}")
        if self.mark is not None:
            parts.append(f"-m mark --mark {mark_match(self.mark)}")
        parts.append(f"-m comment --comment {quote(self.comment)}")
        if self.protocol is not None and self.dport is not None:
            parts.append(f"-m {self.protocol} --dport {self.dport}")
        if self.dports is not None:
            parts.append(f"-m multiport --dports {self.dports}")
        if self.not_physdev_in:
            parts.append("-m physdev ! --physdev-is-in")
        if self.dst_local:
            parts.append("-m addrtype --dst-type LOCAL")
        if self.state_new:
            parts.append("-m state --state NEW")
        if self.dnat:
            parts.append("-m conntrack --ctstate DNAT")
        parts.append(f"-j {self.target}")
        if self.to_ports is not None:
            parts.append(f"--to-ports {self.to_ports}")
        if self.to_destination is not None:
            parts.append(f"--to-destination {self.to_destination}")
        if self.reject_with is not None:
            parts.append(f"--reject-with {self.reject_with}")
        return " ".join(parts)

    def save_line(self) -> str:
        return f"-A {self.chain} {self.spec()}"


def mark_match(mark: int) -> str:
    """``--mark`` argument matching every packet whose mark has all of ``mark``'s bits set,
    as iptables-save prints it (a full mask is left out)."""
    return f"{mark:#x}" if mark == 0xFFFFFFFF else f"{mark:#x}/{mark:#x}"


def dial_mark_rules(mark: int) -> tuple[PortalRule, ...]:
    """The first rule of each host chain: uproxy's own dials leave at once (none for 0)."""
    if not mark:
        return ()
    return tuple(
        PortalRule(NAT, chain, DIAL_MARK_COMMENT, None, None, "RETURN", mark=mark)
        for chain in (HOST_PORTALS, HOST_NODEPORTS)
    )


def make_jumps(
    nodeport_cidrs: Collection[str] = (), proxy_ports: tuple[int, int] | None = None
) -> tuple[JumpRule, ...]:
    """The jumps into uproxy's chains, in the order they stand in each built-in chain; the
    node-port jumps once per CIDR (none given: one jump for every local address).
    ``proxy_ports``: the range uproxy takes its proxy ports from (``--proxy-port-range``, or
    the kernel's ephemeral ports), when known: the jump to ``KUBE-PORTALS-DIRECT`` is then
    one per protocol for that range only, so that a new connection to the node's own
    services (ssh, the kubelet, below the ephemeral range) never walks the chain. Measured
    at 10,000 services (iptables-nft): 5,924 new connections/s to a node's own port with
    the walk, 7,197 without it."""
    cidrs: tuple[str | None, ...] = tuple(nodeport_cidrs) or (None,)
    direct: tuple[tuple[str | None, str | None], ...] = ((None, None),)
    if proxy_ports is not None:
        dports = f"{proxy_ports[0]}:{proxy_ports[1]}"
        direct = (("tcp", dports), ("udp", dports))
    return (
        JumpRule(NAT, "PREROUTING", CONTAINER_PORTALS, _PORTALS_COMMENT),
        JumpRule(NAT, "OUTPUT", HOST_PORTALS, _PORTALS_COMMENT),
        *(
            JumpRule(NAT, chain, target, _NODEPORTS_COMMENT, True, first=False, dst=cidr)
            for chain, target in (("PREROUTING", CONTAINER_NODEPORTS), ("OUTPUT", HOST_NODEPORTS))
            for cidr in cidrs
        ),
        # First in INPUT: before anybody's accept (a default-deny firewall's "allow the proxy
        # port range", say), a connection straight to a proxy port is dropped.
        *(
            JumpRule(
                FILTER,
                "INPUT",
                PORTALS_DIRECT,
                _DIRECT_COMMENT,
                ct_new=True,
                not_dnat=True,
                src_not_local=True,
                protocol=protocol,
                dports=dports,
            )
            for protocol, dports in direct
        ),
        *(
            JumpRule(FILTER, chain, PORTALS_FIREWALL, _FIREWALL_COMMENT, ct_new=True)
            for chain in ("INPUT", "FORWARD")
        ),
        # Before the node-port accept: an accept there would let a refused port's traffic in.
        JumpRule(FILTER, "INPUT", PORTALS_REJECT, _REJECT_COMMENT, ct_new=True),
        JumpRule(FILTER, "INPUT", NON_LOCAL_NODEPORTS, _NON_LOCAL_COMMENT),
    )


JUMPS: tuple[JumpRule, ...] = make_jumps()
# The built-in chains uproxy jumps from, whatever the configuration.
JUMP_CHAINS: tuple[tuple[str, str], ...] = tuple(sorted({(j.table, j.chain) for j in JUMPS}))


@dataclass(frozen=True, slots=True)
class RuleSet:
    """The complete desired state of uproxy's chains: jumps plus rules, in install order."""

    jumps: tuple[JumpRule, ...]
    rules: tuple[PortalRule, ...]
    chains: dict[str, tuple[str, ...]] = field(default_factory=lambda: dict(CHAINS))

    def rules_in(self, table: str) -> list[PortalRule]:
        return [r for r in self.rules if r.table == table]

    def rules_in_chain(self, chain: str) -> list[PortalRule]:
        return [r for r in self.rules if r.chain == chain]

    def jumps_in(self, table: str) -> list[JumpRule]:
        return [j for j in self.jumps if j.table == table]

    def by_chain(self) -> dict[str, list[PortalRule]]:
        """The rules of each chain that has any, in install order (one pass over them all)."""
        out: dict[str, list[PortalRule]] = {}
        for rule in self.rules:
            out.setdefault(rule.chain, []).append(rule)
        return out

    def count_by_chain(self) -> dict[str, int]:
        counts = {c: 0 for c in ALL_CHAINS}
        for rule in self.rules:
            counts[rule.chain] += 1
        return counts

    def save_lines(self, table: str) -> dict[str, list[str]]:
        """Expected ``iptables-save`` lines per chain of ``table`` (uproxy's lines only).

        Built-in chains map to the jump lines only; other rules in them are not uproxy's.
        """
        out: dict[str, list[str]] = {c: [] for c in self.chains[table]}
        for jump in self.jumps_in(table):
            out.setdefault(jump.chain, []).append(jump.save_line())
        for rule in self.rules_in(table):
            out[rule.chain].append(rule.save_line())
        return out


def _canonical(ip: str) -> tuple[str, int]:
    """The address as iptables prints it, and its family (C parsing: 10,000s per sync)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        return socket.inet_ntop(family, socket.inet_pton(family, ip)), family
    except OSError:
        raise ValueError(f"invalid IP address {ip!r}") from None


def _cidr(ip: str) -> str:
    text, family = _canonical(ip)
    return f"{text}/128" if family == socket.AF_INET6 else f"{text}/32"


def collapse(
    cidrs: Iterable[str], version: int = 4
) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """The CIDRs of one IP version, merged where they overlap or touch, in address order."""
    nets = [ipaddress.ip_network(c, strict=False) for c in cidrs]
    if version == 4:
        return list(ipaddress.collapse_addresses(n for n in nets if isinstance(n, IPv4Network)))
    return list(ipaddress.collapse_addresses(n for n in nets if isinstance(n, IPv6Network)))


def source_ranges(
    portal: Portal, version: int = 4
) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """A LoadBalancer portal's allowed sources of one IP version, merged; empty when it lets
    everyone in (no ranges, or ranges covering every address)."""
    return narrowing(portal.source_ranges, version) if portal.source_ranges else []


def narrowing(
    cidrs: Iterable[str], version: int = 4
) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """``collapse``, but nothing when the CIDRs cover every address (a ``/0`` narrows nothing,
    and iptables-save would leave ``-d 0.0.0.0/0`` out of the rule's text)."""
    nets = collapse(cidrs, version)
    return [] if any(n.prefixlen == 0 for n in nets) else nets


def _host_port_prefix(ip: str) -> str:
    """``ip`` as the start of a ``--to-destination`` address, before the port."""
    text, family = _canonical(ip)
    return f"[{text}]:" if family == socket.AF_INET6 else f"{text}:"


def _is_any(ip: str) -> bool:
    return ipaddress.ip_address(ip).is_unspecified


def check_host_ip(host_ip: str) -> None:
    """ValueError unless ``host_ip`` can be a DNAT target for the node's own traffic."""
    if _is_any(host_ip) or ipaddress.ip_address(host_ip).is_loopback:
        raise ValueError(f"host_ip must be a routable node address, not {host_ip}")


def stacks(host_ip: str | Sequence[str], listen_ip: str | Sequence[str] = ANY_IPV4) -> list[Stack]:
    """The families the rules serve: one per host address (at most one per family), each
    with the listen address of its family (none given: any address of it)."""
    hosts = [host_ip] if isinstance(host_ip, str) else list(host_ip)
    listens = [listen_ip] if isinstance(listen_ip, str) else list(listen_ip)
    out: list[Stack] = []
    for host in hosts:
        family = ip_family(host)
        if any(s.family is family for s in out):
            raise ValueError(f"two host addresses of {family.label}: {', '.join(hosts)}")
        check_host_ip(host)
        listen = next((ip for ip in listens if ip_family(ip) is family), ANY[family])
        out.append(Stack(family, host, listen))
    if not out:
        raise ValueError("no host address: the rules serve no IP family")
    return out


@dataclass(frozen=True, slots=True)
class _Target:
    target: str
    to_ports: str | None = None
    to_destination: str | None = None


@dataclass(frozen=True, slots=True)
class Source:
    """Where a packet comes from: a source CIDR, an input interface, both, or anything."""

    src: str | None = None
    in_interface: str | None = None


ANYWHERE = Source()


def split_by_family(
    portals: Collection[Portal], families: Collection[IPFamily]
) -> dict[IPFamily, Collection[Portal]]:
    """The portals of each family the rules serve.

    With one family the collection itself is handed on (no copy: a builder recognises the
    syncer's unchanged set), and a portal of the other family fails in that family's build.
    """
    if len(families) == 1:
        return {next(iter(families)): portals}
    out: dict[IPFamily, set[Portal]] = {f: set() for f in IPFamily}
    for portal in portals:
        out[portal.family].add(portal)
    return {f: frozenset(out[f]) for f in families}


def pod_sources(local: LocalTraffic, version: int = 4) -> tuple[Source, ...]:
    """The matches for traffic from pods (``--detect-local-mode``); none when not told apart.

    One per CIDR of this IP version; an interface prefix as iptables writes it (``veth+``).
    """
    if local.interface:
        return (Source(in_interface=local.interface + ("+" if local.prefix else "")),)
    nets = collapse(local.cidrs, version)
    if any(n.prefixlen == 0 for n in nets):
        return (ANYWHERE,)  # every source is a pod
    return tuple(Source(src=str(net)) for net in nets)


def within(allowed: str | None, pods: Iterable[Source]) -> list[Source]:
    """The pod matches restricted to sources in ``allowed`` (None: anywhere).

    Two CIDRs intersect in the smaller one or not at all, so this stays one match each.
    """
    if allowed is None:
        return list(pods)
    out: list[Source] = []
    for pod in pods:
        if pod.src is None or _inside(allowed, pod.src):
            out.append(Source(allowed, pod.in_interface))
        elif _inside(pod.src, allowed):
            out.append(pod)
    return out


def _inside(inner: str, outer: str) -> bool:
    a, b = ipaddress.ip_network(inner), ipaddress.ip_network(outer)
    if isinstance(a, IPv4Network) and isinstance(b, IPv4Network):
        return a.subnet_of(b)
    if isinstance(a, IPv6Network) and isinstance(b, IPv6Network):
        return a.subnet_of(b)
    return False


class _Match:
    """What every rule of one portal matches: computed once per portal, not once per rule
    (a first build of 10,000 ClusterIP portals spent a third of its time on it).

    Interned: a portal's two or three rules share their comment and address, and every
    rule its protocol (1.3 of the 13.2 MiB a build of 10,000 ClusterIP portals holds).
    """

    __slots__ = ("comment", "dport", "dst", "protocol")

    def __init__(self, portal: Portal) -> None:
        self.comment = sys.intern(str(portal.service))
        self.protocol = sys.intern(portal.protocol.value.lower())
        self.dport = portal.port
        self.dst = sys.intern(_cidr(portal.ip)) if portal.ip is not None else None

    def rule(
        self,
        chain: str,
        target: _Target,
        *,
        source: Source = ANYWHERE,
        dst_local: bool = False,
        not_physdev_in: bool = False,
    ) -> PortalRule:
        return PortalRule(
            table=NAT,
            chain=chain,
            comment=self.comment,
            protocol=self.protocol,
            dport=self.dport,
            target=target.target,
            dst=self.dst,
            not_physdev_in=not_physdev_in,
            dst_local=dst_local,
            to_ports=target.to_ports,
            to_destination=target.to_destination,
            src=source.src,
            in_interface=source.in_interface,
        )


@dataclass(frozen=True, slots=True)
class _Targets:
    """Where portal traffic goes, computed once per build (not once per portal)."""

    redirect: bool  # from containers: REDIRECT (proxy bound to any address) or DNAT
    container_host: str  # DNAT address from containers when not redirecting: "ADDR:"
    host: str  # DNAT address from the node itself: "ADDR:" ("[ADDR]:" for IPv6)
    pods: tuple[Source, ...] = ()  # how traffic from pods is told apart (none: it is not)
    listen: str | None = None  # the listen address as a CIDR, when it is one address
    unreachable: str = "icmp-port-unreachable"  # REJECT's ICMP error (ICMPv6's for IPv6)

    def from_container(self, proxy_port: int) -> _Target:
        # REDIRECT reaches a proxy bound to any address on the incoming interface's primary
        # address, so replies (UDP included) leave from it.
        if self.redirect:
            return _Target("REDIRECT", to_ports=str(proxy_port))
        return _Target("DNAT", to_destination=f"{self.container_host}{proxy_port}")

    def from_host(self, proxy_port: int) -> _Target:
        # REDIRECT from OUTPUT would go to 127.0.0.1, so DNAT to the node address.
        return _Target("DNAT", to_destination=f"{self.host}{proxy_port}")

    def pods_of(self, portal: Portal) -> tuple[Source, ...]:
        """The pod matches that short-circuit this portal (none unless it has a cluster port)."""
        return self.pods if portal.short_circuit else ()


def _accept(portal: Portal, proxy_port: int) -> PortalRule:
    return PortalRule(
        table=FILTER,
        chain=NON_LOCAL_NODEPORTS,
        comment=str(portal.service),
        protocol=portal.protocol.value.lower(),
        dport=proxy_port,
        target="ACCEPT",
        state_new=True,
        dnat=True,
    )


def _node_port_rules(portal: Portal, t: _Targets) -> Iterable[PortalRule]:
    m = _Match(portal)
    to_cluster = t.from_container(portal.from_cluster_port)
    for pods in t.pods_of(portal):
        yield m.rule(CONTAINER_NODEPORTS, to_cluster, source=pods)
    yield m.rule(CONTAINER_NODEPORTS, t.from_container(portal.proxy_port))
    yield m.rule(HOST_NODEPORTS, t.from_host(portal.from_cluster_port))
    yield _accept(portal, portal.proxy_port)
    if portal.short_circuit:
        yield _accept(portal, portal.cluster_proxy_port)


def _external_ip_rules(portal: Portal, t: _Targets) -> Iterable[PortalRule]:
    m = _Match(portal)
    to_cluster = t.from_container(portal.from_cluster_port)
    to_external = t.from_container(portal.proxy_port)
    for pods in t.pods_of(portal):
        yield m.rule(CONTAINER_PORTALS, to_cluster, source=pods, not_physdev_in=True)
        yield m.rule(CONTAINER_PORTALS, to_cluster, source=pods, dst_local=True)
    yield m.rule(CONTAINER_PORTALS, to_external, not_physdev_in=True)
    yield m.rule(CONTAINER_PORTALS, to_external, dst_local=True)
    yield m.rule(HOST_PORTALS, t.from_host(portal.from_cluster_port), dst_local=True)


def _address_rules(portal: Portal, t: _Targets) -> Iterable[PortalRule]:
    """ClusterIP and LoadBalancer ingress IP (the latter with source ranges, maybe)."""
    m = _Match(portal)
    to_external = t.from_container(portal.proxy_port)
    if not portal.source_ranges and not portal.short_circuit:  # nearly every portal
        yield m.rule(CONTAINER_PORTALS, to_external)
        yield m.rule(HOST_PORTALS, t.from_host(portal.proxy_port))
        return
    to_cluster = t.from_container(portal.from_cluster_port)
    ranges = tuple(str(net) for net in source_ranges(portal, portal.family.value))
    allowed: tuple[str | None, ...] = ranges or (None,)
    for cidr in allowed:
        for pods in within(cidr, t.pods_of(portal)):
            yield m.rule(CONTAINER_PORTALS, to_cluster, source=pods)
        yield m.rule(CONTAINER_PORTALS, to_external, source=Source(cidr))
    yield m.rule(HOST_PORTALS, t.from_host(portal.from_cluster_port))
    if ranges:
        yield replace(m.rule(PORTALS_FIREWALL, _Target("DROP")), table=FILTER)


def _refusal_rules(portal: Portal, t: _Targets) -> Iterable[PortalRule]:
    """A proxy port without endpoints: its new connections are rejected, or dropped."""
    reject = portal.kind is PortalKind.NO_ENDPOINTS
    what = "has no endpoints" if reject else "has no local endpoints"
    yield PortalRule(
        table=FILTER,
        chain=PORTALS_REJECT,
        comment=f"{portal.service} {what}",
        protocol=portal.protocol.value.lower(),
        dport=portal.proxy_port,
        target="REJECT" if reject else "DROP",
        dst=t.listen,
        reject_with=(_TCP_RESET if portal.protocol is Protocol.TCP else t.unreachable)
        if reject
        else None,
    )


def proxy_ports_of(portal: Portal) -> tuple[int, ...]:
    """The proxy ports a portal leads to (none for a refusal: its port is one a portal of
    the same service leads to)."""
    if portal.refusal:
        return ()
    if portal.short_circuit:
        return (portal.proxy_port, portal.cluster_proxy_port)
    return (portal.proxy_port,)


def direct_groups(
    ports: Collection[int], limit: int = MULTIPORT_MAX, least: int = 10, spread: int = 4
) -> list[tuple[int, ...]]:
    """``ports`` in ascending groups of at most ``limit`` (one DROP rule each), a pure
    function of the ports whose groups mostly survive a port coming or going: a group ends
    at ``limit`` ports, or before a port that is a *cut* (a hash of the port alone, one port
    in ``spread``) once it holds ``least``. A change moves the cuts after it only until the
    next cut both lists take, a few groups on (10,000 random proxy ports: ~830 groups, 2.5
    rules replaced per port added or removed on average, rarely 15-20 in a stretch of
    forced cuts; 10,000 consecutive ports: ~710 groups)."""
    out: list[tuple[int, ...]] = []
    group: list[int] = []
    for port in sorted(ports):
        if len(group) >= limit or (len(group) >= least and _cut(port, spread)):
            out.append(tuple(group))
            group = []
        group.append(port)
    if group:
        out.append(tuple(group))
    return out


def _cut(port: int, spread: int) -> bool:
    """Whether a group may end before ``port``: a multiplicative hash of the port alone."""
    return (((port * 0x9E3779B1) & 0xFFFFFFFF) >> 16) % spread == 0


def _rules_for(portal: Portal, targets: _Targets) -> Iterable[PortalRule]:
    if portal.refusal:
        return _refusal_rules(portal, targets)
    if portal.kind is PortalKind.NODE_PORT:
        return _node_port_rules(portal, targets)
    if portal.kind is PortalKind.EXTERNAL_IP:
        return _external_ip_rules(portal, targets)
    return _address_rules(portal, targets)


PortalKey = tuple[str, str, str, str, str, str, int, int, int, tuple[str, ...], int]


def portal_key(p: Portal) -> PortalKey:
    # Same order as Portal's own ordering, but on plain tuples: 5x faster at 10,000 portals.
    s = p.service
    return (
        s.namespace,
        s.name,
        s.port_name,
        s.protocol,
        p.kind,
        p.ip or "",
        p.port,
        p.proxy_port,
        p.cluster_proxy_port,
        p.source_ranges,
        p.node_family,
    )


class RuleBuilder:
    """Builds one IP family's rule sets (the family of ``host_ip``), remembering each portal's
    rules (and their text) between syncs.

    A sync at 10,000 service ports mostly repeats the last one; rebuilding 20,000 rules costs
    0.12-0.14 s of Python (with the portal's shared matches made once, ``_Match``: it was
    0.17-0.19 s), looking them up ~20 ms. The memory is pruned to the current portals.
    """

    def __init__(
        self,
        *,
        host_ip: str,
        listen_ip: str = ANY_IPV4,
        dial_mark: int = 0,
        nodeport_cidrs: Collection[str] = (),
        local: LocalTraffic = NO_LOCAL_TRAFFIC,
        proxy_ports: tuple[int, int] | None = None,
    ) -> None:
        check_host_ip(host_ip)
        self.family = ip_family(host_ip)
        redirect = _is_any(listen_ip)
        if not redirect and ip_family(listen_ip) is not self.family:
            raise ValueError(f"listen address {listen_ip} is not of the family of {host_ip}")
        host = host_ip if redirect else listen_ip
        version = self.family.value
        self._targets = _Targets(
            redirect,
            _host_port_prefix(listen_ip) if not redirect else "",
            _host_port_prefix(host),
            pod_sources(local, version),
            None if redirect else _cidr(listen_ip),
            "icmp6-port-unreachable" if self.family is IPFamily.V6 else "icmp-port-unreachable",
        )
        self._mark_rules = dial_mark_rules(dial_mark)
        cidrs = tuple(str(n) for n in narrowing(nodeport_cidrs, version))
        self.jumps = make_jumps(cidrs, proxy_ports)
        self._by_portal: dict[Portal, tuple[PortalRule, ...]] = {}
        self._last: tuple[frozenset[Portal], RuleSet] | None = None
        self.lines: dict[PortalRule, str] = {}
        # The DROP rule of each group, the same object while the group stays: the edits
        # tell rules apart by identity (``payload.edit_payload``).
        self._direct_rules_of: dict[tuple[str, tuple[int, ...]], PortalRule] = {}

    def build(self, portals: Collection[Portal]) -> RuleSet:
        """The exact rule set for ``portals`` (sorted, duplicates dropped); the very same
        object again for the same portals (the syncer's periodic sync), at no cost."""
        given = frozenset(portals)  # the syncer's frozenset itself: no copy
        if self._last is not None and self._last[0] == given:
            return self._last[1]
        ruleset = self._build(given)
        self._last = (given, ruleset)
        return ruleset

    def _build(self, portals: frozenset[Portal]) -> RuleSet:
        by_portal: dict[Portal, tuple[PortalRule, ...]] = {}
        seen: set[PortalRule] = set(self._mark_rules)
        ordered: list[PortalRule] = list(self._mark_rules)  # first in their chains
        for portal in cluster_ips_first(sorted(portals, key=portal_key)):
            rules = self._by_portal.get(portal)
            if rules is None:
                self._check(portal)
                rules = tuple(_rules_for(portal, self._targets))
            by_portal[portal] = rules
            for rule in rules:
                if rule not in seen:
                    seen.add(rule)
                    ordered.append(rule)
        ordered += self._direct_rules(portals)
        self._by_portal = by_portal
        self.lines = {rule: self.lines.get(rule) or rule.save_line() for rule in ordered}
        # Stable per chain: group by chain in the fixed chain order, keeping portal order within.
        ordered.sort(key=lambda r: _CHAIN_ORDER[r.chain])
        return RuleSet(jumps=self.jumps, rules=tuple(ordered))

    def _direct_rules(self, portals: Collection[Portal]) -> list[PortalRule]:
        """``KUBE-PORTALS-DIRECT``: a DROP per group of proxy ports (``direct_groups``) and
        protocol, for the new connections no portal translated (the jump matches those)."""
        ports: dict[str, set[int]] = {}
        for portal in portals:
            found = proxy_ports_of(portal)
            if found:
                ports.setdefault(portal.protocol.value.lower(), set()).update(found)
        known, self._direct_rules_of = self._direct_rules_of, {}
        for protocol in sorted(ports):
            for group in direct_groups(ports[protocol]):
                rule = known.get((protocol, group))
                if rule is None:
                    rule = PortalRule(
                        table=FILTER,
                        chain=PORTALS_DIRECT,
                        comment=DIRECT_RULE_COMMENT,
                        protocol=protocol,
                        dport=None,
                        target="DROP",
                        dst=self._targets.listen,
                        dports=",".join(map(str, group)),
                    )
                self._direct_rules_of[(protocol, group)] = rule
        return list(self._direct_rules_of.values())

    def _check(self, portal: Portal) -> None:
        if portal.kind is not PortalKind.NODE_PORT and portal.ip is None and not portal.refusal:
            raise ValueError(f"portal of kind {portal.kind} for {portal.service} has no address")
        if portal.family is not self.family:
            raise ValueError(
                f"portal {portal.ip or portal.port} of {portal.service} is {portal.family.label}, "
                f"these rules are {self.family.label}"
            )


_CHAIN_ORDER = {c: i for i, c in enumerate(c for t in TABLES for c in CHAINS[t])}


def cluster_ips_first(portals: list[Portal]) -> list[Portal]:
    """``portals`` with the ClusterIP portals first, each part in its order.

    A rule of the portal chains takes a packet whichever service it is for, the first that
    matches: a Service whose externalIPs named another's ClusterIP and port took that
    service's traffic, from pods and from the node, whenever its name sorted first (a
    tenant picks its namespace's name). The nftables tables look ClusterIPs up first, and
    so do these chains."""
    first = [p for p in portals if p.kind is PortalKind.CLUSTER_IP]
    if len(first) == len(portals):
        return portals
    return first + [p for p in portals if p.kind is not PortalKind.CLUSTER_IP]


def build_rules(
    portals: Collection[Portal],
    *,
    host_ip: str,
    listen_ip: str = ANY_IPV4,
    dial_mark: int = 0,
    nodeport_cidrs: Collection[str] = (),
    local: LocalTraffic = NO_LOCAL_TRAFFIC,
) -> RuleSet:
    """Turn the desired portals into the exact rule set (sorted, duplicates dropped).

    ``host_ip`` is the node address host-originated traffic is DNATed to; ``listen_ip`` is
    where the proxy sockets are bound (any address: REDIRECT from containers); ``dial_mark``
    is the mark on uproxy's own dials (0: no RETURN rule); ``nodeport_cidrs`` limit node ports
    to local addresses in them; ``local`` tells traffic from pods apart.
    """
    return RuleBuilder(
        host_ip=host_ip,
        listen_ip=listen_ip,
        dial_mark=dial_mark,
        nodeport_cidrs=nodeport_cidrs,
        local=local,
    ).build(portals)


def insert_positions(
    jumps: Iterable[JumpRule], missing: Collection[JumpRule]
) -> list[tuple[JumpRule, int]]:
    """The missing jumps with the 1-based position each ``first`` one is inserted at, so that
    jumps inserted together stand in their listed order at the top of their chain."""
    out: list[tuple[JumpRule, int]] = []
    inserted: dict[str, int] = {}
    for jump in jumps:
        if jump not in missing:
            continue
        position = inserted.get(jump.chain, 0) + 1
        if jump.first:
            inserted[jump.chain] = position
        out.append((jump, position))
    return out
