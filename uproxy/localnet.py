"""This node's network as the rules see it: where NodePorts answer, and which traffic is a pod's.

Both follow kube-proxy's flags and mean what they mean there.

``--nodeport-addresses`` narrows NodePorts to the node's addresses in some CIDRs, or to its
primary address (``primary``, which cannot be mixed with CIDRs). Only CIDRs of the rules' IP
family count; when none is of that family, every address of it answers, as in kube-proxy (so a
dual-stack list limits each family by its own CIDRs), and a CIDR of every address (``/0``)
means every address too. The rules match the CIDRs themselves, so the kernel decides per
packet and an address added later is covered; the sockets that hold the node ports and the
health-check servers must bind addresses, and those are the node's addresses in the CIDRs when
uproxy starts. When none matches, NodePorts answer nowhere (kube-proxy's behaviour too) and
uproxy says so at start.

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
from uproxy.model import NodeInfo
from uproxy.nodeip import is_unspecified, local_ipv4_addresses, primary_ipv4
from uproxy.rules.base import NO_LOCAL_TRAFFIC, LocalTraffic
from uproxy.settings import PRIMARY, Settings

log = logging.getLogger("uproxy.localnet")

ANY_IPV4 = "0.0.0.0"


@dataclass(frozen=True, slots=True)
class NodePortAddresses:
    """Where NodePorts answer: the CIDRs the rules match, the addresses sockets bind."""

    cidrs: tuple[str, ...]  # IPv4 CIDRs; (): every local address
    bind: tuple[str, ...]  # what node-port reservations and health-check servers bind

    @property
    def everywhere(self) -> bool:
        return not self.cidrs


EVERYWHERE = NodePortAddresses((), (ANY_IPV4,))


def nodeport_addresses(
    setting: Sequence[str],
    *,
    primary_ip: Callable[[], str | None],
    local_ips: Callable[[], Sequence[str]],
) -> NodePortAddresses:
    """What ``--nodeport-addresses`` means on this node (IPv4); ValueError for ``primary``
    when the node has no primary IPv4 address."""
    if not setting:
        return EVERYWHERE
    if tuple(setting) == (PRIMARY,):
        ip = primary_ip()
        if ip is None:
            raise ValueError(
                "--nodeport-addresses primary: cannot find this node's primary IPv4 address; "
                "set --bind-address to it, or give CIDRs"
            )
        nets = [ipaddress.IPv4Network(f"{ip}/32")]
    else:
        nets = [
            n for n in map(ipaddress.ip_network, setting) if isinstance(n, ipaddress.IPv4Network)
        ]
    if not nets or any(n.prefixlen == 0 for n in nets):
        return EVERYWHERE
    merged = list(ipaddress.collapse_addresses(nets))
    bind = tuple(ip for ip in local_ips() if any(ipaddress.IPv4Address(ip) in n for n in merged))
    return NodePortAddresses(tuple(str(n) for n in merged), bind)


def nodeport_addresses_at_start(settings: Settings) -> NodePortAddresses:
    """``--nodeport-addresses`` on this node now; ValueError for ``primary`` without one."""
    if settings.laptop:
        return EVERYWHERE
    listen = settings.listen_host

    def primary() -> str | None:
        return listen if not is_unspecified(listen) else primary_ipv4()

    found = nodeport_addresses(
        settings.nodeport_addresses,
        primary_ip=primary,
        local_ips=lambda: local_ipv4_addresses(global_only=False),
    )
    if not found.everywhere and not found.bind:
        log.warning(
            "No address of this node is in --nodeport-addresses: NodePorts answer nowhere",
            extra=kv(cidrs=",".join(found.cidrs)),
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
