"""The domain model: what uproxy proxies, independent of where it was learned.

Every type here is immutable and hashable so that the tracker can diff states with
plain equality and the syncer can use them as dict keys. ``ServicePortName`` is the
one identity used everywhere: dict keys, metric labels and log fields.
"""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass, field

from uproxy.records import quick_init

DEFAULT_AFFINITY_TIMEOUT_S = 10800  # Kubernetes' default for ClientIP affinity (3 hours)


class Protocol(enum.StrEnum):
    TCP = "TCP"
    UDP = "UDP"


class Traffic(enum.StrEnum):
    """How a connection reached uproxy: the traffic policy that applies depends on it."""

    CLUSTER = "cluster"  # to a ClusterIP (internalTrafficPolicy)
    EXTERNAL = "external"  # to a NodePort, externalIP or LoadBalancer IP (externalTrafficPolicy)


class IPFamily(enum.IntEnum):
    """An IP family. Each family's service addresses reach that family's endpoints only, as
    kube-proxy's per-family proxiers do: a pod's IPv6 address is never behind an IPv4
    ClusterIP. uproxy keeps one identity per service port (``ServicePortName``) and per
    family its own listeners, balancer and rules."""

    V4 = 4
    V6 = 6

    @property
    def label(self) -> str:
        return f"IPv{self.value}"


_V4 = IPFamily.V4  # an enum member read from its class is a lookup each time
_V6 = IPFamily.V6


def ip_family(ip: str) -> IPFamily:
    """The family of a textual address (canonical or not); never raises."""
    return _V6 if ":" in ip else _V4


_ONLY_V4 = frozenset((_V4,))
_ONLY_V6 = frozenset((_V6,))


class LbAlgorithm(enum.StrEnum):
    ROUND_ROBIN = "round-robin"
    RANDOM = "random"
    LEAST_CONNECTIONS = "least-connections"


@quick_init
@dataclass(frozen=True, slots=True, order=True)
class ServicePortName:
    namespace: str
    name: str
    port_name: str
    protocol: Protocol

    def __str__(self) -> str:
        # kube-proxy's format: "ns/name:port", or "ns/name" for an unnamed port.
        if self.port_name:
            return f"{self.namespace}/{self.name}:{self.port_name}"
        return f"{self.namespace}/{self.name}"

    @property
    def service(self) -> tuple[str, str]:
        return (self.namespace, self.name)


# The order of ServicePortName, as a sort key: sorting 10,000 names with the generated
# ``__lt__`` (two tuples built per comparison) took 60 ms of a cold start, this 5 ms.
spn_order = operator.attrgetter("namespace", "name", "port_name", "protocol")
# An endpoint's address, the key of address order (the tracker merges slices in it).
address_of = operator.attrgetter("ip", "port")


@quick_init
@dataclass(frozen=True, slots=True)
class ServicePort:
    """One port of one Service, with everything the proxy and the rules need."""

    name: ServicePortName
    port: int
    cluster_ips: tuple[str, ...] = ()
    node_port: int = 0
    external_ips: tuple[str, ...] = ()
    lb_ingress_ips: tuple[str, ...] = ()
    # None: no session affinity; otherwise ClientIP affinity with this timeout.
    affinity_timeout_s: int | None = None
    external_policy_local: bool = False
    internal_policy_local: bool = False
    health_check_node_port: int = 0
    lb_source_ranges: tuple[str, ...] = ()
    # Per-service override of --lb-algorithm (annotation uproxy.io/lb-algorithm).
    lb_algorithm: LbAlgorithm | None = None

    @property
    def protocol(self) -> Protocol:
        return self.name.protocol

    @property
    def has_external(self) -> bool:
        """Whether any external traffic (NodePort, externalIP, LB ingress) reaches this port."""
        return bool(self.node_port or self.external_ips or self.lb_ingress_ips)

    @property
    def has_local_policy(self) -> bool:
        return self.internal_policy_local or self.external_policy_local

    def families(self) -> frozenset[IPFamily]:
        """The families of its ClusterIPs: those it is proxied in (kube-proxy ignores a
        service in a family it has no ClusterIP of, external addresses and node port too)."""
        ips = self.cluster_ips
        if len(ips) == 1:  # nearly every service: no generator, one set made once
            return _ONLY_V6 if ":" in ips[0] else _ONLY_V4
        return frozenset(ip_family(ip) for ip in ips)

    @property
    def needs_external_listener(self) -> bool:
        """Cluster and external endpoint sets can differ: external traffic gets its own port."""
        return self.has_external and self.external_policy_local != self.internal_policy_local


@quick_init
@dataclass(frozen=True, slots=True, order=True)
class Endpoint:
    ip: str
    port: int
    node_name: str | None = None
    zone: str | None = None
    ready: bool = True
    serving: bool = True
    terminating: bool = False
    # Topology hints the EndpointSlice controller set (``hints.forZones``, ``hints.forNodes``:
    # a service's trafficDistribution, or its topology-mode annotation): the zones and nodes
    # whose cluster traffic this endpoint should take. Empty: no hint. See ``categorize``.
    zone_hints: tuple[str, ...] = ()
    node_hints: tuple[str, ...] = ()

    def __hash__(self) -> int:
        # Its address alone (equal endpoints have equal addresses): the generated hash
        # hashed all nine fields, 0.4 us an endpoint, and a worker hashes a service port's
        # every endpoint a few times for each change of them (its pools are sets).
        return hash((self.ip, self.port))

    def __eq__(self, other: object) -> bool:
        # Field by field, the address first: the generated one built a tuple of all nine
        # fields of each side, 256 ns for equal endpoints (206 here) and 181 when the
        # addresses differ (94), and a change among 20,000 endpoints compares 40,000.
        if self is other:
            return True
        if not isinstance(other, Endpoint):
            return NotImplemented
        return (
            self.ip == other.ip
            and self.port == other.port
            and self.node_name == other.node_name
            and self.ready == other.ready
            and self.serving == other.serving
            and self.terminating == other.terminating
            and self.zone == other.zone
            and self.zone_hints == other.zone_hints
            and self.node_hints == other.node_hints
        )

    def __str__(self) -> str:
        if ":" in self.ip:
            return f"[{self.ip}]:{self.port}"
        return f"{self.ip}:{self.port}"

    @property
    def address(self) -> tuple[str, int]:
        return (self.ip, self.port)

    @property
    def family(self) -> IPFamily:
        return ip_family(self.ip)


# The cluster autoscaler taints a node with this key before deleting it (KEP-3836).
TO_BE_DELETED_TAINT = "ToBeDeletedByClusterAutoscaler"


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """What uproxy needs to know about the node it runs on."""

    name: str
    # Its IPs as kube-proxy reads them (``status.addresses``): the first InternalIP (else
    # ExternalIP), then the first of the other family, internal ones first.
    addresses: tuple[str, ...] = ()
    zone: str | None = None
    deleting: bool = False
    taints: tuple[str, ...] = field(default=())  # "key:effect"
    pod_cidrs: tuple[str, ...] = ()  # spec.podCIDRs: --detect-local-mode NodeCIDR

    @property
    def eligible(self) -> bool:
        """Should load balancers send traffic here: not being deleted, nor about to be."""
        if self.deleting:
            return False
        return not any(t.partition(":")[0] == TO_BE_DELETED_TAINT for t in self.taints)


@quick_init
@dataclass(frozen=True, slots=True)
class EndpointsDelta:
    """How a service port's endpoints came from ``base`` (the state's before): ``added`` are
    new, or replace the endpoint at their address; ``removed`` are addresses that went."""

    base: tuple[Endpoint, ...]
    added: tuple[Endpoint, ...]
    removed: tuple[tuple[str, int], ...]


@quick_init
@dataclass(frozen=True, slots=True)
class ServiceState:
    """A service port and its merged endpoints: one entry of the desired state."""

    port: ServicePort
    endpoints: tuple[Endpoint, ...] = ()
    # Set when the tracker followed one slice's change of a big port in place: the syncer
    # then need not compare the whole sets.
    delta: EndpointsDelta | None = field(default=None, compare=False, repr=False)


DesiredState = dict[ServicePortName, ServiceState]


def categorize(
    endpoints: tuple[Endpoint, ...] | list[Endpoint],
    *,
    local_only: bool,
    node_name: str,
    zone: str | None = None,
) -> tuple[Endpoint, ...]:
    """Pick the endpoints traffic may go to, as kube-proxy's CategorizeEndpoints does.

    Ready endpoints when there are any; otherwise the serving-and-terminating ones (so a
    rolling update with no ready pod left still drains to pods that still serve). With a
    Local policy only endpoints on this node qualify, and the fallback is applied to those
    alone: an empty result means "refuse", never "send elsewhere".

    Cluster traffic follows topology hints (``topology``): only the ready endpoints hinted
    for this node, or else for this node's ``zone``, when the hints say so. A Local policy
    ignores them, as does the terminating fallback (hints are only read from ready
    endpoints, and a hinted subset is never empty).
    """
    pool = [e for e in endpoints if e.node_name == node_name] if local_only else list(endpoints)
    ready = [e for e in pool if e.ready]
    if ready:
        if not local_only:
            return topology(ready, node_name, zone)
        return tuple(ready)
    return tuple(e for e in pool if e.serving and e.terminating)


def topology(ready: list[Endpoint], node_name: str, zone: str | None) -> tuple[Endpoint, ...]:
    """The ready endpoints cluster traffic from this node goes to, by their hints.

    As kube-proxy (``topologyModeFromHints``): when every ready endpoint has a node hint and
    one of them names this node, the endpoints hinted for this node (trafficDistribution
    PreferSameNode); otherwise, when every ready endpoint has a zone hint and one of them
    names this node's zone, the endpoints hinted for that zone (PreferSameZone, PreferClose,
    topology-mode Auto); otherwise all of them. So one endpoint without hints, a node with no
    zone label, or a zone (node) no endpoint is hinted for turns hints off for the service,
    and traffic is never refused because of them.
    """
    if not ready[0].zone_hints and not ready[0].node_hints:
        return tuple(ready)  # the usual case: no hints at all (one endpoint tells)
    if all(e.node_hints for e in ready):
        mine = tuple(e for e in ready if node_name in e.node_hints)
        if mine:
            return mine
    if zone and all(e.zone_hints for e in ready):
        mine = tuple(e for e in ready if zone in e.zone_hints)
        if mine:
            return mine
    return tuple(ready)
