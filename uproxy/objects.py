"""Conversion of Kubernetes objects (v1 Service, discovery.k8s.io/v1 EndpointSlice) to the model.

Both sources hand over objects in the API's JSON shape (camelCase dicts, exactly what the API
server sends and what a manifest file holds), so there is one conversion and one validation.
A malformed object raises ``InvalidObject`` naming the object, the field and the reason; an
object uproxy does not proxy by design (headless, ExternalName) converts to nothing.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from uproxy.log import kv
from uproxy.model import (
    DEFAULT_AFFINITY_TIMEOUT_S,
    Endpoint,
    LbAlgorithm,
    NodeInfo,
    Protocol,
    ServicePort,
    ServicePortName,
    ip_family,
)
from uproxy.records import quick_init

log = logging.getLogger("uproxy.objects")

LB_ALGORITHM_ANNOTATION = "uproxy.io/lb-algorithm"
HEADLESS_LABEL = "service.kubernetes.io/headless"
SERVICE_PROXY_NAME_LABEL = "service.kubernetes.io/service-proxy-name"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
TRIGGER_TIME_ANNOTATION = "endpoints.kubernetes.io/last-change-trigger-time"
ZONE_LABEL = "topology.kubernetes.io/zone"
MAX_AFFINITY_TIMEOUT_S = 86400
KEY_MAX = 320  # "namespace/name" of a valid object: 63 + 1 + 253 characters at most

Obj = Mapping[str, Any]


class InvalidObject(ValueError):
    """An object uproxy cannot use; the message names the object, the field and the reason."""

    def __init__(self, kind: str, key: str, field: str, reason: str) -> None:
        self.kind = kind
        self.key = key
        self.field = field
        self.reason = reason
        super().__init__(f"{kind} {key}: {field}: {reason}")


@quick_init
@dataclass(frozen=True, slots=True)
class SlicePort:
    name: str
    protocol: Protocol
    port: int


@quick_init
@dataclass(frozen=True, slots=True)
class EndpointSliceInfo:
    """The part of an EndpointSlice the tracker merges into its service's endpoints."""

    namespace: str
    name: str
    service: str
    ports: tuple[SlicePort, ...]
    # Endpoints without a port: the port comes from the matching SlicePort.
    endpoints: tuple[Endpoint, ...]
    trigger_time: str | None = None
    # ``endpoints_for``'s answers, made once: the tracker merges a service port's slices
    # again whenever one of them changes, and the same objects each time let everything
    # downstream compare unchanged endpoints by identity (a big port's other slices).
    _for_port: dict[tuple[str, Protocol], tuple[Endpoint, ...]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def endpoints_for(self, port_name: str, protocol: Protocol) -> tuple[Endpoint, ...]:
        """The endpoints with this port's number (every port of that name and protocol)."""
        key = (port_name, protocol)
        made = self._for_port.get(key)
        if made is None:
            made = self._for_port[key] = self._make_endpoints(port_name, protocol)
        return made

    def _make_endpoints(self, port_name: str, protocol: Protocol) -> tuple[Endpoint, ...]:
        out: list[Endpoint] = []
        for sp in self.ports:
            if sp.name == port_name and sp.protocol is protocol:
                port = sp.port
                out += [
                    Endpoint(
                        e.ip,
                        port,
                        e.node_name,
                        e.zone,
                        e.ready,
                        e.serving,
                        e.terminating,
                        e.zone_hints,
                        e.node_hints,
                    )
                    for e in self.endpoints
                ]
        return tuple(out)


def object_key(obj: Obj) -> str:
    meta = obj.get("metadata")
    if not isinstance(meta, Mapping):
        return "<no metadata>"
    key = f"{meta.get('namespace') or 'default'}/{meta.get('name') or '<no name>'}"
    # An invalid name is told in the message that refuses it: escaped, so that a newline or
    # a terminal escape in it reaches no log line or terminal as itself, and cut short.
    if not (key.isascii() and key.isprintable()):
        key = ascii(key)[1:-1]
    return key if len(key) <= KEY_MAX else f"{key[:KEY_MAX]}..."


@dataclass(frozen=True, slots=True)
class _NameRule:
    """One of the API server's rules for names (apimachinery's ``IsDNS1123Label`` and
    its kin), which uproxy applies too: names become iptables comments (a newline in one
    failed every rules sync of the node), metric labels and log fields, and reach the
    laptop table. A services file, or anything else that is not the API server, is held
    to what the API server would have accepted.

    The names that passed are remembered (namespaces and port names repeat in every
    object): a check costs a set lookup instead of a 0.3 us match, mostly."""

    words: str  # what a valid name is, for the refusal
    max_len: int
    match: Callable[[str], object]
    passed: set[str] = field(default_factory=set)

    def check(self, value: str) -> str | None:
        """Why ``value`` is not a valid name, or None."""
        if value in self.passed:
            return None
        if len(value) > self.max_len:
            return f"must be no more than {self.max_len} characters, got {len(value)}"
        if self.match(value) is None:
            return f"must be {self.words}, got {value!a}"
        if len(self.passed) >= 50_000:
            self.passed.clear()
        self.passed.add(value)
        return None


_LABEL = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS1123_LABEL = _NameRule(
    "a DNS-1123 label (lower-case letters, digits and '-', starting and ending with a "
    "letter or digit)",
    63,
    re.compile(_LABEL, re.ASCII).fullmatch,
)
DNS1035_LABEL = _NameRule(
    "a DNS-1035 label (lower-case letters, digits and '-', starting with a letter and "
    "ending with a letter or digit)",
    63,
    re.compile("[a-z]([-a-z0-9]*[a-z0-9])?", re.ASCII).fullmatch,
)


class _Checker:
    """Field access that fails with the object's name and the field's path.

    Strings and addresses come back interned: the tracker keeps them for as long as their
    objects live, and most repeat (every object's namespace, a node's name and address on
    each of its endpoints, a service's name in its slices). At 10,000 services the parsed
    state held 60,000 copies, 3.2 MiB.

    Every object of a listing passes through here (20,000 at 10,000 services), so the
    valid case costs as little as it can: exact types are tested first (JSON and YAML give
    plain dicts, lists, strings and ints), and a field's path is a template formatted only
    for the error (``"spec.ports[{}].port", i``), as is the object's name. Parsing the 20,000
    objects took 255 ms before, 2.3 times what it takes now.
    """

    __slots__ = ("kind", "obj")

    def __init__(self, kind: str, obj: Obj) -> None:
        self.kind = kind
        self.obj = obj

    def fail(self, field: str, reason: str, *at: object) -> InvalidObject:
        return InvalidObject(
            self.kind, object_key(self.obj), field.format(*at) if at else field, reason
        )

    def mapping(self, value: Any, field: str, *at: object, required: bool = False) -> Obj:
        if type(value) is dict:
            return value
        if value is None and not required:
            return {}
        if not isinstance(value, Mapping):
            raise self.fail(field, f"must be an object, got {_kind_of(value)}", *at)
        return value

    def seq(self, value: Any, field: str, *at: object) -> list[Any]:
        if type(value) is list:
            return value
        if value is None:
            return []
        raise self.fail(field, f"must be a list, got {_kind_of(value)}", *at)

    def string(self, value: Any, field: str, *at: object, default: str = "") -> str:
        if type(value) is str:
            return sys.intern(value)
        if value is None:
            return default
        if not isinstance(value, str):
            raise self.fail(field, f"must be a string, got {_kind_of(value)}", *at)
        return sys.intern(value)

    def name(self, value: str, rule: _NameRule, field: str, *at: object) -> str:
        """``value`` (a string already), refused unless it is a valid name under ``rule``."""
        reason = rule.check(value)
        if reason is not None:
            raise self.fail(field, reason, *at)
        return value

    def port(self, value: Any, field: str, *at: object, allow_zero: bool = False) -> int:
        if type(value) is int and 0 < value <= 65535:
            return value
        if value is None and allow_zero:
            return 0
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(field, f"must be an integer port, got {_kind_of(value)}", *at)
        low = 0 if allow_zero else 1
        if not low <= value <= 65535:
            raise self.fail(field, f"must be {low}-65535, got {value}", *at)
        return value

    def protocol(self, value: Any, field: str, *at: object) -> Protocol | None:
        """The protocol, or None for a valid protocol uproxy does not proxy (SCTP)."""
        text = self.string(value, field, *at, default="TCP")
        protocol = _PROTOCOLS.get(text)
        if protocol is None and text != "SCTP":
            raise self.fail(field, f"unknown protocol {text!r}", *at)
        return protocol

    def ip(self, value: Any, field: str, *at: object) -> str:
        text = self.string(value, field, *at)
        if ":" not in text:
            # IPv4 through the C parser: ipaddress was 4 % of a 10,000-service start.
            try:
                canonical = socket.inet_ntop(socket.AF_INET, socket.inet_pton(socket.AF_INET, text))
            except OSError:
                legacy = _legacy_ipv4(text)
                if legacy is None:
                    raise self.fail(field, f"not an IP address: {text!r}", *at) from None
                canonical = legacy
            return text if canonical == text else sys.intern(canonical)
        try:
            address = ipaddress.IPv6Address(text)
        except ValueError:
            raise self.fail(field, f"not an IP address: {text!r}", *at) from None
        refusal = _ipv6_refusal(address)
        if refusal is not None:
            raise self.fail(field, f"not an IP address: {text!r} ({refusal})", *at)
        return sys.intern(str(address))

    def boolean(self, value: Any, field: str, default: bool, *at: object) -> bool:
        if value is None:
            return default
        if value is True or value is False:
            return value
        raise self.fail(field, f"must be true or false, got {_kind_of(value)}", *at)


_PROTOCOLS = {p.value: p for p in Protocol}


def _legacy_ipv4(text: str) -> str | None:
    """An IPv4 address with leading zeros (``010.096.000.001``), in its canonical form
    (``10.96.0.1``), or None. The API server accepted those until it validated addresses
    strictly, and objects written then keep them; kube-proxy reads them as decimal
    (``ParseIPSloppy``), never as octal, and so does uproxy."""
    parts = text.split(".")
    if len(parts) != 4 or not all(p.isascii() and p.isdigit() and len(p) <= 3 for p in parts):
        return None
    octets = [int(p) for p in parts]
    if max(octets) > 255:
        return None
    return ".".join(map(str, octets))


def _kind_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, str):
        return f"string {value!r}"
    if isinstance(value, (int, float)):
        return f"number {value}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, Mapping):
        return "an object"
    return type(value).__name__


def _metadata(c: _Checker, obj: Obj, name_rule: _NameRule | None) -> tuple[str, str, Obj, Obj]:
    """The namespace, name, labels and annotations. A Service's namespace and name are its
    service ports' identity (``ServicePortName``), checked as the API server does; an
    EndpointSlice's name reaches no rule, metric or table (it is matched by its label), and
    is not."""
    meta = c.mapping(obj.get("metadata"), "metadata", required=True)
    name = c.string(meta.get("name"), "metadata.name")
    if not name:
        raise c.fail("metadata.name", "missing")
    if name_rule is not None:
        c.name(name, name_rule, "metadata.name")
    namespace = c.string(meta.get("namespace"), "metadata.namespace", default="default")
    namespace = c.name(namespace or "default", DNS1123_LABEL, "metadata.namespace")
    labels = c.mapping(meta.get("labels"), "metadata.labels")
    annotations = c.mapping(meta.get("annotations"), "metadata.annotations")
    return namespace, name, labels, annotations


def is_headless(obj: Obj) -> bool:
    meta = obj.get("metadata")
    labels = meta.get("labels") if isinstance(meta, Mapping) else None
    if isinstance(labels, Mapping) and HEADLESS_LABEL in labels:
        return True
    spec = obj.get("spec")
    return isinstance(spec, Mapping) and spec.get("clusterIP") == "None"


def service_ports(obj: Obj) -> dict[ServicePortName, ServicePort]:
    """The service ports of a v1 Service; empty for services uproxy does not proxy by design.

    Raises InvalidObject when the object is malformed. An SCTP port is left out (uproxy
    relays TCP and UDP only), and a service whose every port is SCTP has none: a valid
    object, which must not fail a services file dumped from a cluster that has one.
    """
    c = _Checker("Service", obj)
    namespace, name, _labels, annotations = _metadata(c, obj, DNS1035_LABEL)
    spec = c.mapping(obj.get("spec"), "spec", required=True)
    svc_type = c.string(spec.get("type"), "spec.type", default="ClusterIP")
    if svc_type == "ExternalName" or is_headless(obj):
        return {}
    if svc_type not in ("ClusterIP", "NodePort", "LoadBalancer"):
        raise c.fail("spec.type", f"unknown type {svc_type!r}")

    cluster_ips = _cluster_ips(c, spec)
    external_ips = tuple(
        c.ip(v, "spec.externalIPs[{}]", i)
        for i, v in enumerate(c.seq(spec.get("externalIPs"), "spec.externalIPs"))
    )
    status = c.mapping(obj.get("status"), "status")
    lb = c.mapping(status.get("loadBalancer"), "status.loadBalancer")
    lb_ips: list[str] = []
    for i, ing in enumerate(c.seq(lb.get("ingress"), "status.loadBalancer.ingress")):
        ing = c.mapping(ing, "status.loadBalancer.ingress[{}]", i, required=True)
        # ipMode Proxy: the load balancer proxies to the node ports itself, and traffic to
        # its IP must reach it, not be taken on the node (kube-proxy's IsVIPMode).
        mode = c.string(
            ing.get("ipMode"), "status.loadBalancer.ingress[{}].ipMode", i, default="VIP"
        )
        if ing.get("ip") is not None and mode == "VIP":
            lb_ips.append(c.ip(ing.get("ip"), "status.loadBalancer.ingress[{}].ip", i))
    source_ranges = tuple(
        _cidr(c, v, f"spec.loadBalancerSourceRanges[{i}]")
        for i, v in enumerate(
            c.seq(spec.get("loadBalancerSourceRanges"), "spec.loadBalancerSourceRanges")
        )
    )

    affinity_timeout = _affinity(c, spec)
    ext_policy = _policy(c, spec, "externalTrafficPolicy")
    int_policy = _policy(c, spec, "internalTrafficPolicy")
    hc_port = c.port(spec.get("healthCheckNodePort"), "spec.healthCheckNodePort", allow_zero=True)
    algorithm = _algorithm(c, annotations)

    ports = c.seq(spec.get("ports"), "spec.ports")
    if not ports:
        raise c.fail("spec.ports", "no ports")
    out: dict[ServicePortName, ServicePort] = {}
    seen: set[str] = set()
    for i, raw in enumerate(ports):
        p = c.mapping(raw, "spec.ports[{}]", i, required=True)
        port_name = c.string(p.get("name"), "spec.ports[{}].name", i)
        if port_name:
            c.name(port_name, DNS1123_LABEL, "spec.ports[{}].name", i)
        elif len(ports) > 1:
            raise c.fail(f"spec.ports[{i}].name", "required when a service has more than one port")
        if port_name in seen:
            raise c.fail(f"spec.ports[{i}].name", f"duplicate port name {port_name!r}")
        seen.add(port_name)
        protocol = c.protocol(p.get("protocol"), "spec.ports[{}].protocol", i)
        port = c.port(p.get("port"), "spec.ports[{}].port", i)
        node_port = c.port(p.get("nodePort"), "spec.ports[{}].nodePort", i, allow_zero=True)
        if protocol is None:
            continue
        spn = ServicePortName(namespace, name, port_name, protocol)
        out[spn] = ServicePort(
            name=spn,
            port=port,
            cluster_ips=cluster_ips,
            node_port=node_port if svc_type != "ClusterIP" else 0,
            external_ips=external_ips,
            lb_ingress_ips=tuple(lb_ips) if svc_type == "LoadBalancer" else (),
            affinity_timeout_s=affinity_timeout,
            external_policy_local=ext_policy == "Local",
            internal_policy_local=int_policy == "Local",
            health_check_node_port=hc_port if ext_policy == "Local" else 0,
            lb_source_ranges=source_ranges,
            lb_algorithm=algorithm,
        )
    return out


def _cluster_ips(c: _Checker, spec: Obj) -> tuple[str, ...]:
    ips = [
        c.string(v, "spec.clusterIPs[{}]", i)
        for i, v in enumerate(c.seq(spec.get("clusterIPs"), "spec.clusterIPs"))
    ]
    primary = c.string(spec.get("clusterIP"), "spec.clusterIP")
    if primary and primary not in ips:
        ips.insert(0, primary)
    return tuple(c.ip(v, "spec.clusterIPs") for v in ips if v)


def _policy(c: _Checker, spec: Obj, key: str) -> str:
    value = c.string(spec.get(key), "spec.{}", key, default="Cluster")
    if value not in ("Cluster", "Local", "Global"):  # "Global": the pre-1.22 name of Cluster
        raise c.fail("spec.{}", f"must be Cluster or Local, got {value!r}", key)
    return value


def _ipv6_refusal(address: ipaddress.IPv6Address) -> str | None:
    """Why an address Python reads as IPv6 is not one the API server takes: a zone index
    (``fe80::1%eth0``: no rule can match it, and one such address failed every rules sync
    on the node), or an IPv4-mapped address (``::ffff:10.0.0.1``, the IPv4 address twice)."""
    if address.scope_id is not None:
        return "a zone index is not allowed"
    if address.ipv4_mapped is not None:
        return f"IPv4-mapped; write {address.ipv4_mapped}"
    return None


def _cidr(c: _Checker, value: Any, field: str) -> str:
    text = c.string(value, field)
    address, slash, prefix = text.strip().partition("/")
    address = _legacy_ipv4(address) or address  # 010.0.0.0/8, as ParseCIDRSloppy reads it
    try:
        network = ipaddress.ip_network(address + slash + prefix, strict=False)
    except ValueError:
        raise c.fail(field, f"not a CIDR: {text!r}") from None
    if "%" in address:
        raise c.fail(field, f"not a CIDR: {text!r} (a zone index is not allowed)")
    return str(network)


def _affinity(c: _Checker, spec: Obj) -> int | None:
    affinity = c.string(spec.get("sessionAffinity"), "spec.sessionAffinity", default="None")
    if affinity == "None":
        return None
    if affinity != "ClientIP":
        raise c.fail("spec.sessionAffinity", f"must be None or ClientIP, got {affinity!r}")
    cfg = c.mapping(spec.get("sessionAffinityConfig"), "spec.sessionAffinityConfig")
    client = c.mapping(cfg.get("clientIP"), "spec.sessionAffinityConfig.clientIP")
    timeout = client.get("timeoutSeconds", DEFAULT_AFFINITY_TIMEOUT_S)
    field = "spec.sessionAffinityConfig.clientIP.timeoutSeconds"
    if isinstance(timeout, bool) or not isinstance(timeout, int):
        raise c.fail(field, f"must be an integer, got {_kind_of(timeout)}")
    if not 0 < timeout <= MAX_AFFINITY_TIMEOUT_S:
        raise c.fail(field, f"must be 1-{MAX_AFFINITY_TIMEOUT_S}, got {timeout}")
    return timeout


def _algorithm(c: _Checker, annotations: Obj) -> LbAlgorithm | None:
    """The annotation's algorithm; None (--lb-algorithm) when it is absent, or not one
    uproxy knows: an annotation is not checked by the API server, and a typo in it must not
    take the service down (it is warned about once)."""
    value = annotations.get(LB_ALGORITHM_ANNOTATION)
    if value is None:
        return None
    try:
        return LbAlgorithm(value)
    except ValueError:
        key = object_key(c.obj)
        if (key, str(value)) not in _ALGORITHM_REPORTED:
            if len(_ALGORITHM_REPORTED) >= 10_000:
                _ALGORITHM_REPORTED.clear()
            _ALGORITHM_REPORTED.add((key, str(value)))
            choices = ", ".join(a.value for a in LbAlgorithm)
            log.warning(
                "Ignoring an unknown load-balancing algorithm; using --lb-algorithm",
                extra=kv(
                    object=key,
                    field=f"metadata.annotations[{LB_ALGORITHM_ANNOTATION}]",
                    reason=f"must be one of {choices}, got {value!r}",
                ),
            )
        return None


_ALGORITHM_REPORTED: set[tuple[str, str]] = set()


def endpoint_slice(obj: Obj) -> EndpointSliceInfo | None:
    """The endpoints of a discovery.k8s.io/v1 EndpointSlice; None for FQDN slices."""
    c = _Checker("EndpointSlice", obj)
    namespace, name, labels, annotations = _metadata(c, obj, None)
    service = c.string(labels.get(SERVICE_NAME_LABEL), f"metadata.labels[{SERVICE_NAME_LABEL}]")
    if not service:
        raise c.fail(
            f"metadata.labels[{SERVICE_NAME_LABEL}]", "missing: the slice names no service"
        )
    address_type = c.string(obj.get("addressType"), "addressType")
    if address_type == "FQDN":
        return None
    if address_type not in ("IPv4", "IPv6"):
        raise c.fail("addressType", f"must be IPv4, IPv6 or FQDN, got {address_type!r}")
    version = 4 if address_type == "IPv4" else 6

    ports: list[SlicePort] = []
    seen: set[tuple[str, Protocol]] = set()
    for i, raw in enumerate(c.seq(obj.get("ports"), "ports")):
        p = c.mapping(raw, "ports[{}]", i, required=True)
        port_name = c.string(p.get("name"), "ports[{}].name", i)
        protocol = c.protocol(p.get("protocol"), "ports[{}].protocol", i)
        port = c.port(p.get("port"), "ports[{}].port", i, allow_zero=True)
        if protocol is None:
            continue
        if not port:
            # The API allows a port without a number; kube-proxy ignores that port alone
            # ("Ignoring invalid endpoint port"), and so does uproxy: the others still serve.
            _report_portless(namespace, name, i, port_name)
            continue
        if (port_name, protocol) in seen:
            raise c.fail(f"ports[{i}].name", f"duplicate port {port_name!r}/{protocol}")
        seen.add((port_name, protocol))
        ports.append(SlicePort(port_name, protocol, port))

    endpoints: list[Endpoint] = []
    for i, raw in enumerate(c.seq(obj.get("endpoints"), "endpoints")):
        endpoints.append(_slice_endpoint(c, raw, i, version))
    trigger = annotations.get(TRIGGER_TIME_ANNOTATION)
    return EndpointSliceInfo(
        namespace=namespace,
        name=name,
        service=service,
        ports=tuple(ports),
        endpoints=tuple(endpoints),
        trigger_time=trigger if isinstance(trigger, str) else None,
    )


_PORTLESS_REPORTED: set[tuple[str, str, int, str]] = set()


def _report_portless(namespace: str, name: str, index: int, port_name: str) -> None:
    """One warning per slice port without a number (slices are parsed again at every event
    and relist); the memory of what was said is bounded."""
    key = (namespace, name, index, port_name)
    if key in _PORTLESS_REPORTED:
        return
    if len(_PORTLESS_REPORTED) >= 10_000:
        _PORTLESS_REPORTED.clear()
    _PORTLESS_REPORTED.add(key)
    log.warning(
        "Ignoring an EndpointSlice port without a port number",
        extra=kv(object=f"{namespace}/{name}", field=f"ports[{index}].port", name=port_name),
    )


def _slice_endpoint(c: _Checker, raw: Any, i: int, version: int) -> Endpoint:
    ep = c.mapping(raw, "endpoints[{}]", i, required=True)
    addresses = c.seq(ep.get("addresses"), "endpoints[{}].addresses", i)
    if not addresses:
        raise c.fail("endpoints[{}].addresses", "no addresses", i)
    # An endpoint's addresses are one pod's, and interchangeable: as kube-proxy, only the
    # first is used, so that a pod is one endpoint to round-robin and to the health checks.
    # Every one is checked, as the API server does.
    ips = [c.ip(value, "endpoints[{}].addresses[{}]", i, j) for j, value in enumerate(addresses)]
    for j, ip in enumerate(ips):
        if (6 if ":" in ip else 4) != version:  # c.ip gave a valid, canonical address
            raise c.fail(
                "endpoints[{}].addresses[{}]", f"{ip} does not match addressType IPv{version}", i, j
            )
    cond = c.mapping(ep.get("conditions"), "endpoints[{}].conditions", i)
    # A nil ready means ready; a nil serving means serving, as kube-proxy reads it
    # (endpointslicecache.go), though the API's comment says "defer to ready": it decides
    # whether a terminating endpoint without the field is a fallback (the EndpointSlice
    # controller always sets it; other controllers may not).
    ready = c.boolean(cond.get("ready"), "endpoints[{}].conditions.ready", True, i)
    serving = c.boolean(cond.get("serving"), "endpoints[{}].conditions.serving", True, i)
    terminating = c.boolean(
        cond.get("terminating"), "endpoints[{}].conditions.terminating", False, i
    )
    node = c.string(ep.get("nodeName"), "endpoints[{}].nodeName", i) or None
    zone = c.string(ep.get("zone"), "endpoints[{}].zone", i) or None
    zone_hints: tuple[str, ...] = ()
    node_hints: tuple[str, ...] = ()
    if ep.get("hints") is not None:
        hints = c.mapping(ep.get("hints"), "endpoints[{}].hints", i)
        zone_hints = _hint_names(c, hints.get("forZones"), "forZones", i)
        node_hints = _hint_names(c, hints.get("forNodes"), "forNodes", i)
    return Endpoint(ips[0], 0, node, zone, ready, serving, terminating, zone_hints, node_hints)


def _hint_names(c: _Checker, value: Any, key: str, i: int) -> tuple[str, ...]:
    """The names of one endpoint's ``hints.forZones`` or ``hints.forNodes``."""
    names: list[str] = []
    for j, raw in enumerate(c.seq(value, f"endpoints[{{}}].hints.{key}", i)):
        hint = c.mapping(raw, f"endpoints[{{}}].hints.{key}[{{}}]", i, j, required=True)
        name = c.string(hint.get("name"), f"endpoints[{{}}].hints.{key}[{{}}].name", i, j)
        if not name:
            raise c.fail(f"endpoints[{{}}].hints.{key}[{{}}].name", "must not be empty", i, j)
        names.append(name)
    return tuple(names)


def node_info(obj: Obj) -> NodeInfo:
    c = _Checker("Node", obj)
    meta = c.mapping(obj.get("metadata"), "metadata", required=True)
    name = c.string(meta.get("name"), "metadata.name")
    labels = c.mapping(meta.get("labels"), "metadata.labels")
    status = c.mapping(obj.get("status"), "status")
    internal: list[str] = []
    external: list[str] = []
    for i, raw in enumerate(c.seq(status.get("addresses"), "status.addresses")):
        a = c.mapping(raw, "status.addresses[{}]", i, required=True)
        if a.get("type") in ("InternalIP", "ExternalIP"):
            ip = c.ip(a.get("address"), "status.addresses[{}].address", i)
            (internal if a.get("type") == "InternalIP" else external).append(ip)
    addresses = _host_ips(internal + external)
    spec = c.mapping(obj.get("spec"), "spec")
    taints = []
    for i, raw in enumerate(c.seq(spec.get("taints"), "spec.taints")):
        t = c.mapping(raw, "spec.taints[{}]", i, required=True)
        taints.append(f"{t.get('key')}:{t.get('effect')}")
    zone = labels.get(ZONE_LABEL)
    return NodeInfo(
        name=name,
        addresses=tuple(addresses),
        zone=zone if isinstance(zone, str) else None,
        deleting=meta.get("deletionTimestamp") is not None,
        taints=tuple(taints),
        pod_cidrs=_pod_cidrs(c, spec),
    )


def _host_ips(ips: list[str]) -> list[str]:
    """The node's IPs from its addresses, InternalIPs first: the first one, then the first
    of the other family, if any (kube-proxy's reading of a dual-stack node)."""
    if not ips:
        return []
    primary = ip_family(ips[0])
    other = next((ip for ip in ips if ip_family(ip) is not primary), None)
    return [ips[0]] if other is None else [ips[0], other]


def _pod_cidrs(c: _Checker, spec: Obj) -> tuple[str, ...]:
    """``spec.podCIDRs`` (``spec.podCIDR`` first when an older writer set only that)."""
    values = [
        (f"spec.podCIDRs[{i}]", v)
        for i, v in enumerate(c.seq(spec.get("podCIDRs"), "spec.podCIDRs"))
    ]
    if spec.get("podCIDR"):
        values.insert(0, ("spec.podCIDR", spec.get("podCIDR")))
    out: list[str] = []
    for path, value in values:
        cidr = _cidr(c, value, path)
        if cidr not in out:
            out.append(cidr)
    return tuple(out)
