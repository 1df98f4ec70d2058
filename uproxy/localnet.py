"""This node's network as the rules see it: its IP families, where NodePorts answer, and which
traffic is a pod's.

All follow kube-proxy's flags and mean what they mean there.

The IP families a node serves (``stacks_at_start``): every family the node has an address of
(its primary address of the family is where the node's own traffic is DNATed; never loopback)
and the rules backend can program, each listening on any address of it, IPv4 first. An
unspecified ``--bind-address`` (``0.0.0.0``, ``::``) changes only which family comes first,
as kube-proxy reads it as the primary family and proxies both (kubeadm writes
``bindAddress: 0.0.0.0``); a specific one limits uproxy to that address and its family. Laptop
mode listens on 127.0.0.1 and, when the machine has it, ::1 (or on ``--bind-address`` alone).
A service port is proxied in the families of its ClusterIPs among those (see
``ServicePort.families``).

``--nodeport-addresses`` narrows NodePorts to the node's addresses in some CIDRs, or to its
primary address of each family (``primary``, which cannot be mixed with CIDRs). Each family
counts its own CIDRs; when none is of a family, every address of it answers, as in kube-proxy
(so a dual-stack list limits each family by its own CIDRs), and a CIDR of every address
(``/0``, ``::/0``) means every address of its family too. The rules match the CIDRs
themselves, so the kernel decides per packet and an address added later is covered; the
sockets that hold the node ports and the health-check servers must bind addresses, and those
are the node's addresses in the CIDRs when uproxy starts. When none matches, NodePorts answer
nowhere in that family (kube-proxy's behaviour too) and uproxy says so at start.

``--detect-local-mode`` says how a packet from one of the cluster's pods is recognised:
ClusterCIDR (its source is in ``--cluster-cidr``; without one, pods are not told apart, as
kube-proxy does), NodeCIDR (its source is in this Node's ``spec.podCIDRs``, which can only be
read from the API server and may change: the rules follow them), BridgeInterface (it came in on
``--pod-bridge-interface``), InterfaceNamePrefix (it came in on an interface whose name starts
with ``--pod-interface-name-prefix``). Such traffic, like the node's own, reaches every
endpoint of an ``externalTrafficPolicy: Local`` service through its external addresses.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from uproxy.log import kv
from uproxy.model import IPFamily, NodeInfo, ip_family
from uproxy.nodeip import is_unspecified, local_addresses, primary_address
from uproxy.rules.base import NO_LOCAL_TRAFFIC, LocalTraffic, Stack
from uproxy.rules.portals import collapse
from uproxy.settings import PRIMARY, Settings

log = logging.getLogger("uproxy.localnet")

ANY_IPV4 = "0.0.0.0"
ANY = {IPFamily.V4: ANY_IPV4, IPFamily.V6: "::"}
LOOPBACK = {IPFamily.V4: "127.0.0.1", IPFamily.V6: "::1"}


# ----- the families served -----------------------------------------------------------------


def stacks_at_start(
    settings: Settings, *, rules_support: Callable[[IPFamily], str | None] = lambda f: None
) -> tuple[Stack, ...]:
    """The IP families this node serves, the primary first; ValueError when none can be.

    ``rules_support`` says why the rules backend cannot program a family (None: it can): a
    host without ``ip6tables-restore`` serves IPv4 only, and says so; a host where it can
    program none of the families with an address fails, naming the missing program.
    """
    bind = settings.bind_address
    if settings.laptop:
        if bind:
            return (Stack(ip_family(bind), "", bind),)
        families = [f for f in IPFamily if f is IPFamily.V4 or has_loopback6()]
        return tuple(Stack(f, "", LOOPBACK[f]) for f in families)
    if bind and not is_unspecified(bind):
        if ipaddress.ip_address(bind).is_loopback:
            raise ValueError(
                f"--bind-address {bind} is a loopback address: the host portal rules send the "
                "node's own service traffic to the proxy ports on this address, which must be "
                "one the node routes; set it to the node's address, or use --rules none"
            )
        why = rules_support(ip_family(bind))
        if why is not None:
            raise ValueError(
                f"--rules {settings.rules_backend} cannot program rules here: {why}; "
                "install it, or choose another --rules"
            )
        return _serving((Stack(ip_family(bind), bind, bind),))
    wanted = list(IPFamily)
    if bind:  # an unspecified one: its family first (kube-proxy's primary family), both served
        wanted.sort(key=lambda f: f is not ip_family(bind))
    out: list[Stack] = []
    unsupported: dict[IPFamily, str] = {}
    for family in wanted:
        host = primary_address(family)
        if host is None:
            continue
        why = rules_support(family)
        if why is not None:
            unsupported[family] = why
            continue
        out.append(Stack(family, host, ANY[family]))
    if not out and unsupported:  # one line: the error says it all
        reasons = "; ".join(dict.fromkeys(unsupported.values()))
        raise ValueError(
            f"--rules {settings.rules_backend} cannot program rules here: {reasons}; "
            "install it, or choose another --rules"
        )
    for family, why in unsupported.items():
        log.warning(
            "Not serving an IP family: the rules backend cannot program it here",
            extra=kv(family=family.label, rules=settings.rules_backend, reason=why),
        )
    if not out:
        raise ValueError(
            "cannot find this node's IPv4 or IPv6 address for the host portal rules; "
            "set --bind-address to it"
        )
    return _serving(tuple(out))


def _serving(stacks: tuple[Stack, ...]) -> tuple[Stack, ...]:
    log.info(
        "Serving IP families",
        extra=kv(
            families=",".join(s.family.label for s in stacks),
            node=",".join(s.host_ip for s in stacks),
        ),
    )
    return stacks


def has_loopback6() -> bool:
    """Whether ::1 can be bound here (IPv6 can be disabled in the kernel or on lo)."""
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


# ----- --nodeport-addresses ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NodePortAddresses:
    """Where NodePorts answer: the CIDRs the rules match, the addresses sockets bind."""

    cidrs: tuple[str, ...]  # per family, merged; a family with none: every address of it
    bind: tuple[str, ...]  # what node-port reservations and health-check servers bind

    @property
    def everywhere(self) -> bool:
        return not self.cidrs


EVERYWHERE = NodePortAddresses((), (ANY_IPV4,))


def nodeport_addresses(
    setting: Sequence[str],
    *,
    primary_ip: Callable[[IPFamily], str | None],
    local_ips: Callable[[IPFamily], Sequence[str]],
    families: Sequence[IPFamily] = (IPFamily.V4,),
) -> NodePortAddresses:
    """What ``--nodeport-addresses`` means on this node, in each family it serves;
    ValueError for ``primary`` when the node has no primary address of a family."""
    cidrs: list[str] = []
    bind: list[str] = []
    for family in families:
        nets = _family_networks(setting, family, primary_ip)
        if nets is None:
            bind.append(ANY[family])  # every address of this family
            continue
        cidrs.extend(str(n) for n in nets)
        bind.extend(
            ip for ip in local_ips(family) if any(ipaddress.ip_address(ip) in n for n in nets)
        )
    return NodePortAddresses(tuple(cidrs), tuple(bind))


def _family_networks(
    setting: Sequence[str], family: IPFamily, primary_ip: Callable[[IPFamily], str | None]
) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network] | None:
    """One family's CIDRs of the setting, merged; None for every address of the family."""
    if tuple(setting) == (PRIMARY,):
        ip = primary_ip(family)
        if ip is None:
            raise ValueError(
                f"--nodeport-addresses primary: cannot find this node's primary {family.label} "
                "address; set --bind-address to it, or give CIDRs"
            )
        return [ipaddress.ip_network(ip)]
    nets = collapse(setting, family.value)
    if not nets or any(n.prefixlen == 0 for n in nets):
        return None
    return nets


def nodeport_addresses_at_start(
    settings: Settings, stacks: Sequence[Stack] = ()
) -> NodePortAddresses:
    """``--nodeport-addresses`` on this node now, for the families it serves (``stacks``;
    the primary address of each is its host address); ValueError for ``primary`` without one."""
    if settings.laptop:
        return EVERYWHERE
    hosts = {s.family: s.host_ip for s in stacks}
    found = nodeport_addresses(
        settings.nodeport_addresses,
        primary_ip=hosts.get,
        local_ips=lambda f: local_addresses(f, global_only=False),
        families=list(hosts) or [IPFamily.V4],
    )
    for family in hosts:
        cidrs = [c for c in found.cidrs if ip_family(c) is family]
        if cidrs and not any(ip_family(ip) is family for ip in found.bind):
            log.warning(
                "No address of this node is in --nodeport-addresses: NodePorts answer nowhere",
                extra=kv(family=family.label, cidrs=",".join(cidrs)),
            )
    return found


def local_traffic_at_start(settings: Settings) -> LocalTraffic:
    """How the rules tell pods apart when uproxy starts (NodeCIDR: not yet, the Node is not
    read yet); ValueError when the bridge does not exist."""
    if settings.laptop:
        return NO_LOCAL_TRAFFIC
    if settings.detect_local_mode == "BridgeInterface":
        check_interface(settings.pod_bridge_interface)
    local = local_traffic(settings, None)
    _report(settings.detect_local_mode, local)
    return local


def local_traffic_of(
    settings: Settings, node: NodeInfo | None, current: LocalTraffic
) -> LocalTraffic:
    """NodeCIDR: the pods' CIDRs are this Node's spec.podCIDRs, known (and changed) only
    through the API server; ``current`` in every other mode."""
    if settings.detect_local_mode != "NodeCIDR" or settings.laptop:
        return current
    local = local_traffic(settings, node)
    if local != current:
        _report("NodeCIDR", local)
    return local


def _report(mode: str, local: LocalTraffic) -> None:
    log.info("Telling traffic from pods apart", extra=kv(mode=mode, pods=local.describe()))


def local_traffic(settings: Settings, node: NodeInfo | None) -> LocalTraffic:
    """How the rules tell pods apart under ``settings`` (NodeCIDR: from ``node``)."""
    mode = settings.detect_local_mode
    if mode == "NodeCIDR":
        return LocalTraffic(cidrs=node.pod_cidrs if node is not None else ())
    if mode == "BridgeInterface":
        return LocalTraffic(interface=settings.pod_bridge_interface)
    if mode == "InterfaceNamePrefix":
        return LocalTraffic(interface=settings.pod_interface_name_prefix, prefix=True)
    return LocalTraffic(cidrs=settings.cluster_cidr)


def check_interface(name: str) -> None:
    """ValueError unless this node has an interface called ``name`` (a typo would otherwise
    silently tell no pod apart)."""
    try:
        socket.if_nametoindex(name)
    except OSError:
        raise ValueError(
            f"--pod-bridge-interface {name}: no such interface on this node; "
            "name the bridge the pods are on, or use another --detect-local-mode"
        ) from None
