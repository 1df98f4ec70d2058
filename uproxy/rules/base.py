"""The rules-backend protocol: what the syncer asks of whatever steers traffic into uproxy.

A backend owns only its own chains. ``sync`` receives the *full* desired set of portals
every time (never a delta) and must make the kernel match it atomically and idempotently,
re-creating base chains and jumps that someone removed. ``cleanup`` removes everything
uproxy ever installed with that backend and is safe to run when nothing is installed.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Protocol as TypingProtocol

from uproxy.model import IPFamily, Protocol, ServicePortName, ip_family
from uproxy.records import quick_init
from uproxy.rules.previous import PortalKey


class PortalKind(enum.StrEnum):
    CLUSTER_IP = "cluster-ip"
    EXTERNAL_IP = "external-ip"
    LB_INGRESS = "lb-ingress"
    NODE_PORT = "node-port"
    # Not a service address but a proxy port whose traffic has no endpoint to go to: new
    # connections to it are rejected (the service port has no usable endpoint at all: the
    # client is refused at once) or dropped (it has some, none of them for this traffic: a
    # Local policy without an endpoint on this node), as kube-proxy filters such services.
    NO_ENDPOINTS = "no-endpoints"
    NO_LOCAL_ENDPOINTS = "no-local-endpoints"


REFUSALS = frozenset({PortalKind.NO_ENDPOINTS, PortalKind.NO_LOCAL_ENDPOINTS})


@quick_init
@dataclass(frozen=True, slots=True, order=True)
class Portal:
    """One service address that must land on one uproxy proxy port.

    ``cluster_proxy_port`` is set on the external portals (externalIP, LoadBalancer IP, node
    port) of an ``externalTrafficPolicy: Local`` service whose external traffic has its own
    listener: traffic that comes from the cluster (a pod, as ``--detect-local-mode`` tells
    them, or the node itself) goes there, to every endpoint, as kube-proxy short-circuits it;
    only traffic from outside goes to ``proxy_port`` and the node's local endpoints.
    ``source_ranges`` (LoadBalancer IPs only) are the allowed clients; others are dropped.
    A refusal (``NO_ENDPOINTS``, ``NO_LOCAL_ENDPOINTS``) has no address: ``port`` and
    ``proxy_port`` are the proxy port that turns new connections away (``refusal``).

    A portal belongs to one IP family, and so do its rules (``iptables`` or ``ip6tables``,
    ``table ip`` or ``table ip6``) and its proxy ports: the family of its address, or for a
    node port (no address) ``node_family``, the family of the node addresses it answers on.
    """

    service: ServicePortName
    kind: PortalKind
    ip: str | None  # None for a NodePort: the node's addresses (--nodeport-addresses)
    port: int  # the service port, or the node port
    proxy_port: int  # where uproxy listens for this traffic
    cluster_proxy_port: int = 0  # where traffic from the cluster goes instead; 0: proxy_port
    source_ranges: tuple[str, ...] = ()  # CIDRs allowed to reach a LoadBalancer IP; (): all
    node_family: IPFamily = IPFamily.V4  # a node port's family (others: their address's)

    @property
    def protocol(self) -> Protocol:
        return self.service.protocol

    @property
    def family(self) -> IPFamily:
        return self.node_family if self.ip is None else ip_family(self.ip)

    @property
    def refusal(self) -> bool:
        """Whether this turns the proxy port's new connections away (see ``PortalKind``)."""
        return self.kind in REFUSALS

    @staticmethod
    def refusing(
        service: ServicePortName, proxy_port: int, family: IPFamily, *, anywhere: bool
    ) -> Portal:
        """The refusal of ``proxy_port``: rejected when the service port has no usable
        endpoint ``anywhere``, else dropped (none for this proxy port's traffic)."""
        kind = PortalKind.NO_LOCAL_ENDPOINTS if anywhere else PortalKind.NO_ENDPOINTS
        return Portal(service, kind, None, proxy_port, proxy_port, 0, (), family)

    @property
    def short_circuit(self) -> bool:
        """Whether traffic from the cluster goes to another proxy port than outside traffic."""
        return self.cluster_proxy_port not in (0, self.proxy_port)

    @property
    def from_cluster_port(self) -> int:
        """The proxy port for traffic from the cluster (pods and the node)."""
        return self.cluster_proxy_port if self.short_circuit else self.proxy_port


@dataclass(frozen=True, slots=True)
class LocalTraffic:
    """How the rules tell traffic from this cluster's pods (kube-proxy's --detect-local-mode).

    ``cidrs``: pods are sources in these CIDRs (ClusterCIDR, NodeCIDR); ``interface``: pods
    are packets that came in on this interface (BridgeInterface), or on any interface whose
    name starts with it when ``prefix`` (InterfaceNamePrefix). Neither: pods are not told
    apart, and only the node's own traffic counts as coming from the cluster.
    """

    cidrs: tuple[str, ...] = ()
    interface: str = ""
    prefix: bool = False

    @property
    def enabled(self) -> bool:
        return bool(self.cidrs or self.interface)

    def describe(self) -> str:
        if self.cidrs:
            return "sources " + ",".join(self.cidrs)
        if self.interface:
            return f"interfaces {self.interface}*" if self.prefix else f"interface {self.interface}"
        return "none"


NO_LOCAL_TRAFFIC = LocalTraffic()


@dataclass(frozen=True, slots=True)
class Stack:
    """One IP family the rules serve: where the node's own traffic to a service address is
    DNATed (``host_ip``: a node address of the family, never loopback, which would need
    route_localnet, CVE-2020-8558), and where that family's proxy ports listen
    (``listen_ip``; an unspecified address: traffic from elsewhere is REDIRECTed)."""

    family: IPFamily
    host_ip: str
    listen_ip: str


class RulesError(Exception):
    """The backend could not program the kernel; the message says why and what to do."""


class Leftovers(TypingProtocol):
    """Removes what other rules backends left on the host (``leftovers.remove_leftovers``):
    uproxy's nft tables when ``nft_tables``, its chains and jumps in the given iptables
    variants. A backend calls it for everything but its own rules once its own first rules
    are in, not before: between the two a service's packets met no rules at all, and a SYN
    that did got a conntrack entry without NAT that its retransmissions kept (the client hung
    for the kernel's SYN retries). Until then the new run's listeners are on the ports those
    rules lead to (``LeftoverPorts``). ``make_backend`` hands it in, so the backends never
    import one another for it."""

    async def __call__(self, *, nft_tables: bool, iptables_modes: Iterable[str]) -> bool: ...


class LeftoverPorts(TypingProtocol):
    """Adds to ``into`` the proxy ports that other backends' rules left on the host lead to
    (``previous``), for the keys not there yet (``leftovers.leftover_ports``). After a switch
    of ``--rules`` those rules steer traffic until the new run's first sync is in; on these
    ports they reach the right service, and no other service is given one of them."""

    async def __call__(
        self,
        into: dict[PortalKey, int],
        *,
        nft_tables: bool,
        iptables_modes: Iterable[str],
        families: Iterable[IPFamily],
    ) -> None: ...


async def keep_leftovers(*, nft_tables: bool, iptables_modes: Iterable[str]) -> bool:
    """The ``Leftovers`` of a backend built on its own (tests): other backends' rules stay."""
    return False


async def no_leftover_ports(
    into: dict[PortalKey, int],
    *,
    nft_tables: bool,
    iptables_modes: Iterable[str],
    families: Iterable[IPFamily],
) -> None:
    """The ``LeftoverPorts`` of a backend built on its own (tests): none."""


class RulesBackend(TypingProtocol):
    name: str

    async def prepare(self) -> None:
        """Probe what the first sync needs from the host and nothing from the services (the
        tools' variant, say), while the sources list; never raises: ``sync`` reports."""

    async def sync(self, portals: Collection[Portal]) -> None:
        """Make the installed rules exactly ``portals``; raise RulesError on failure."""

    def set_local_traffic(self, local: LocalTraffic) -> None:
        """Tell pods apart this way from the next sync on (the Node's podCIDRs can change)."""

    def set_host_ip(self, family: IPFamily, host_ip: str) -> None:
        """DNAT the node's own traffic of ``family`` to ``host_ip`` from the next sync on (the
        address found at start went away); ValueError unless it can be a DNAT target."""

    async def check(self) -> bool:
        """Cheap check that the installed rules are still in place (False: resync now)."""

    async def cleanup(self) -> None:
        """Remove every chain, rule and jump this backend installs; idempotent."""

    async def close(self) -> None:
        """Release resources (threads, locks); leaves the rules in place."""
