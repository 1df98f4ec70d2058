"""Conversion of Services and EndpointSlices, and the reasons malformed ones are refused."""

from __future__ import annotations

import copy
import logging
import random
from collections.abc import Iterator
from typing import Any

import pytest

from tests.factories import endpoint, endpoint_slice, service
from uproxy.model import Endpoint, LbAlgorithm, Protocol, ServicePortName
from uproxy.objects import (
    InvalidObject,
    endpoint_slice as convert_slice,
    node_info,
    service_ports,
)


def test_service_ports_carry_every_field() -> None:
    obj = service(
        "web",
        "shop",
        ports=[
            {"name": "http", "port": 80, "protocol": "TCP", "nodePort": 30080},
            {"name": "dns", "port": 53, "protocol": "UDP", "nodePort": 30053},
        ],
        type="LoadBalancer",
        clusterIPs=["10.96.0.10"],
        externalIPs=["192.0.2.7"],
        sessionAffinity="ClientIP",
        sessionAffinityConfig={"clientIP": {"timeoutSeconds": 60}},
        externalTrafficPolicy="Local",
        healthCheckNodePort=32000,
        loadBalancerSourceRanges=["198.51.100.0/24"],
        annotations={"uproxy.io/lb-algorithm": "random"},
    )
    ingress = [
        {"ip": "203.0.113.9"},
        {"hostname": "lb"},
        {"ip": "203.0.113.10", "ipMode": "VIP"},
        {"ip": "203.0.113.11", "ipMode": "Proxy"},  # the load balancer's, not the node's
    ]
    obj["status"] = {"loadBalancer": {"ingress": ingress}}
    ports = service_ports(obj)
    http = ports[ServicePortName("shop", "web", "http", Protocol.TCP)]
    assert str(http.name) == "shop/web:http"
    assert http.port == 80 and http.node_port == 30080
    assert http.cluster_ips == ("10.96.0.10",)
    assert http.external_ips == ("192.0.2.7",)
    assert http.lb_ingress_ips == ("203.0.113.9", "203.0.113.10")
    assert http.affinity_timeout_s == 60
    assert http.external_policy_local and not http.internal_policy_local
    assert http.health_check_node_port == 32000
    assert http.lb_source_ranges == ("198.51.100.0/24",)
    assert http.lb_algorithm is LbAlgorithm.RANDOM
    assert http.needs_external_listener
    dns = ports[ServicePortName("shop", "web", "dns", Protocol.UDP)]
    assert dns.protocol is Protocol.UDP and dns.node_port == 30053


def test_defaults_and_unnamed_single_port() -> None:
    ports = service_ports(service(ports=[{"port": 80}], sessionAffinity="ClientIP"))
    (sp,) = ports.values()
    assert str(sp.name) == "default/web"
    assert sp.protocol is Protocol.TCP
    assert sp.affinity_timeout_s == 10800
    assert sp.node_port == 0 and not sp.needs_external_listener


@pytest.mark.parametrize(
    "obj",
    [
        service(cluster_ip="None"),
        service(labels={"service.kubernetes.io/headless": ""}),
        service(type="ExternalName", externalName="example.invalid", cluster_ip=None),
    ],
    ids=["clusterIP-None", "headless-label", "ExternalName"],
)
def test_services_not_proxied_by_design(obj: dict[str, Any]) -> None:
    assert service_ports(obj) == {}


def test_sctp_ports_are_left_out() -> None:
    ports = service_ports(
        service(ports=[{"name": "a", "port": 1, "protocol": "SCTP"}, {"name": "b", "port": 2}])
    )
    assert [p.name.port_name for p in ports.values()] == ["b"]
    # Only SCTP ports: a valid service with nothing to proxy, not a malformed one.
    assert service_ports(service(ports=[{"name": "a", "port": 1, "protocol": "SCTP"}])) == {}


def test_legacy_zero_padded_ipv4_addresses_are_read_as_decimal() -> None:
    # Objects written before the API server validated addresses strictly can keep them;
    # kube-proxy reads them as decimal, never octal (0010 is still refused: four digits).
    obj = service(cluster_ip="010.096.000.001", externalIPs=["192.168.001.010"])
    obj["spec"]["type"] = "LoadBalancer"
    obj["status"] = {"loadBalancer": {"ingress": [{"ip": "203.000.113.009"}]}}
    (sp,) = service_ports(obj).values()
    assert sp.cluster_ips == ("10.96.0.1",)
    assert sp.external_ips == ("192.168.1.10",)
    assert sp.lb_ingress_ips == ("203.0.113.9",)
    info = convert_slice(endpoint_slice("web-1", endpoints=[endpoint("10.244.001.007")]))
    assert info is not None
    assert [e.ip for e in info.endpoints_for("http", Protocol.TCP)] == ["10.244.1.7"]
    for bad in (
        "10.96.0.0010",
        "10.96.0.256",
        "10.96.0",
        "10.96.0.1.2",
        "10.96.0.+1",
        "10.96.0.\u0661",
    ):
        with pytest.raises(InvalidObject):
            service_ports(service(cluster_ip=bad))


BAD_SERVICES: list[tuple[str, dict[str, Any], str]] = [
    ("no-ports", service(ports=[]), "spec.ports"),
    ("port-zero", service(ports=[{"name": "a", "port": 0}]), "spec.ports[0].port"),
    ("port-too-big", service(ports=[{"name": "a", "port": 70000}]), "spec.ports[0].port"),
    ("port-string", service(ports=[{"name": "a", "port": "80"}]), "spec.ports[0].port"),
    ("bad-protocol", service(ports=[{"name": "a", "port": 1, "protocol": "ICMP"}]), "protocol"),
    ("dup-names", service(ports=[{"name": "a", "port": 1}, {"name": "a", "port": 2}]), "name"),
    ("unnamed-multi", service(ports=[{"port": 1}, {"name": "b", "port": 2}]), "name"),
    ("bad-cluster-ip", service(cluster_ip="10.96.0.300"), "spec.clusterIPs"),
    ("bad-external-ip", service(externalIPs=["nope"]), "spec.externalIPs[0]"),
    # A zone index passed Python's parser, then failed every rules sync of the node.
    ("zoned-cluster-ip", service(cluster_ip="fd00:96::82%eth0"), "spec.clusterIPs"),
    ("zoned-external-ip", service(externalIPs=["fd00:ee::100%1"]), "spec.externalIPs[0]"),
    (
        "zoned-lb-ip",
        {
            **service(type="LoadBalancer"),
            "status": {"loadBalancer": {"ingress": [{"ip": "fd::1%lo"}]}},
        },
        "status.loadBalancer.ingress[0].ip",
    ),
    (
        "zoned-source-range",
        service(loadBalancerSourceRanges=["fd00:e::2%eth0/128"]),
        "loadBalancerSourceRanges[0]",
    ),
    ("mapped-cluster-ip", service(cluster_ip="::ffff:10.96.0.83"), "spec.clusterIPs"),
    (
        "bad-node-port",
        service(ports=[{"name": "a", "port": 1, "nodePort": -1}], type="NodePort"),
        "nodePort",
    ),
    ("bad-affinity", service(sessionAffinity="Cookie"), "spec.sessionAffinity"),
    (
        "bad-affinity-timeout",
        service(
            sessionAffinity="ClientIP", sessionAffinityConfig={"clientIP": {"timeoutSeconds": 0}}
        ),
        "timeoutSeconds",
    ),
    ("bad-policy", service(externalTrafficPolicy="Nearby"), "spec.externalTrafficPolicy"),
    ("bad-type", service(type="Magic"), "spec.type"),
    (
        "bad-source-range",
        service(loadBalancerSourceRanges=["10.0.0.0/33"]),
        "loadBalancerSourceRanges",
    ),
    ("ports-not-list", service(ports={"a": 1}), "spec.ports"),  # type: ignore[arg-type]
    (
        "no-name",
        {"apiVersion": "v1", "kind": "Service", "metadata": {}, "spec": {}},
        "metadata.name",
    ),
    (
        "spec-not-object",
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"}, "spec": 3},
        "spec",
    ),
    # Names the API server refuses: each became an iptables comment, a metric label and a
    # laptop table row as it was.
    ("newline-in-name", service("web\n-A KUBE-PORTALS-HOST -j DROP"), "metadata.name"),
    ("separator-in-name", service("we\x1fb"), "metadata.name"),
    ("upper-case-name", service("Web"), "metadata.name"),
    ("digit-first-name", service("1web"), "metadata.name"),
    ("name-too-long", service("w" * 64), "metadata.name"),
    ("escape-in-namespace", service(namespace="shop\x1b[2J"), "metadata.namespace"),
    ("dot-in-namespace", service(namespace="shop.dev"), "metadata.namespace"),
    ("quote-in-port-name", service(ports=[{"name": 'http"', "port": 80}]), "spec.ports[0].name"),
    ("space-in-port-name", service(ports=[{"name": "h p", "port": 80}]), "spec.ports[0].name"),
]


@pytest.mark.parametrize(("case", "obj", "field"), BAD_SERVICES, ids=[c[0] for c in BAD_SERVICES])
def test_malformed_services_name_the_field(case: str, obj: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidObject) as err:
        service_ports(obj)
    assert field in err.value.field, (case, str(err.value))
    assert str(err.value).startswith("Service ")


def test_names_are_held_to_the_api_servers_rules() -> None:
    """A service's namespace, name and port names are its identity in iptables comments,
    metric labels, log fields and the laptop table. From a services file (or anything but
    the API server) a newline in one failed every rules sync of the node (iptables-restore
    read the comment as two lines), and a unit separator made every scrape of /metrics a
    500. Refused as the API server refuses them, in one printable line."""
    hostile = service("web\n-A INPUT -j ACCEPT\x1b[2J", "shop\x1f")
    with pytest.raises(InvalidObject) as err:
        service_ports(hostile)
    message = str(err.value)
    assert message.isascii() and message.isprintable(), message
    with pytest.raises(InvalidObject) as err:
        service_ports(service("w" * 10_000))
    assert len(str(err.value)) < 600
    # What the API server accepts, at its limits, still converts.
    ports = [{"name": "1-a", "port": 80}, {"name": "h" * 63, "port": 81}]
    converted = service_ports(service("w" + "-0" * 31, "0" * 63, ports=ports))
    assert sorted(spn.port_name for spn in converted) == ["1-a", "h" * 63]
    assert {spn.namespace for spn in converted} == {"0" * 63}


def test_an_unknown_algorithm_annotation_falls_back_and_is_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An annotation is not checked by the API server: a typo in it made the whole Service
    invalid, and a serving one was taken down by the edit."""
    caplog.set_level(logging.WARNING, logger="uproxy")
    caplog.clear()
    # What was said is remembered process-wide: a value no other test uses.
    obj = service(annotations={"uproxy.io/lb-algorithm": "round_robin"})
    for _ in range(3):
        (port,) = service_ports(obj).values()
        assert port.lb_algorithm is None  # --lb-algorithm
    said = "Ignoring an unknown load-balancing algorithm; using --lb-algorithm"
    assert [r.getMessage() for r in caplog.records] == [said]
    assert "got 'round_robin'" in caplog.records[0].kv["reason"]  # type: ignore[attr-defined]


def test_source_ranges_with_leading_zeros_read_as_kube_proxy_reads_them() -> None:
    # Older API servers let 010.0.0.0/8 through; kube-proxy reads it as decimal.
    obj = service(loadBalancerSourceRanges=["010.000.0.0/8", " 192.168.001.0/24 "])
    (port,) = service_ports(obj).values()
    assert port.lb_source_ranges == ("10.0.0.0/8", "192.168.1.0/24")


def test_slice_conditions_node_and_zone_are_kept() -> None:
    info = convert_slice(
        endpoint_slice(
            "web-abc",
            endpoints=[
                endpoint("10.0.0.1", nodeName="n1", zone="z1"),
                endpoint("10.0.0.2", ready=False, serving=True, terminating=True),
                endpoint("10.0.0.3", ready=False),
                endpoint("10.0.0.4", ready=False, serving=False),
                # No serving: serving, as kube-proxy reads it, so a terminating fallback.
                endpoint("10.0.0.5", ready=False, terminating=True),
            ],
        )
    )
    assert info is not None and info.service == "web"
    eps = info.endpoints_for("http", Protocol.TCP)
    assert eps == (
        Endpoint("10.0.0.1", 8080, "n1", "z1", True, True, False),
        Endpoint("10.0.0.2", 8080, None, None, False, True, True),
        Endpoint("10.0.0.3", 8080, None, None, False, True, False),
        Endpoint("10.0.0.4", 8080, None, None, False, False, False),
        Endpoint("10.0.0.5", 8080, None, None, False, True, True),
    )
    assert info.endpoints_for("http", Protocol.TCP) is eps  # made once
    assert info.endpoints_for("http", Protocol.UDP) == ()
    assert info.endpoints_for("other", Protocol.TCP) == ()


def test_an_endpoint_is_its_first_address() -> None:
    """An endpoint's addresses are one pod's: as in kube-proxy the first is used alone, so a
    pod with two addresses is not picked twice as often (nor counted twice as local)."""
    info = convert_slice(
        endpoint_slice(
            "web-abc",
            endpoints=[
                {"addresses": ["10.0.0.1", "10.0.0.2"], "nodeName": "n1"},
                {"addresses": ["10.0.0.3"]},
            ],
        )
    )
    assert info is not None
    assert [e.ip for e in info.endpoints_for("http", Protocol.TCP)] == ["10.0.0.1", "10.0.0.3"]


def test_slice_topology_hints_are_kept() -> None:
    hints = {"forZones": [{"name": "z1"}, {"name": "z2"}], "forNodes": [{"name": "n1"}]}
    info = convert_slice(
        endpoint_slice(
            "web-abc",
            endpoints=[
                {"addresses": ["10.0.0.1"], "zone": "z1", "hints": hints},
                endpoint("10.0.0.3", hints={"forZones": [{"name": "z3"}]}),
                endpoint("10.0.0.4", hints={}),
            ],
        )
    )
    assert info is not None
    eps = info.endpoints_for("http", Protocol.TCP)
    assert [(e.ip, e.zone_hints, e.node_hints) for e in eps] == [
        ("10.0.0.1", ("z1", "z2"), ("n1",)),
        ("10.0.0.3", ("z3",), ()),
        ("10.0.0.4", (), ()),
    ]
    assert eps[0].port == 8080


def test_a_slice_port_without_a_number_is_skipped_alone(caplog: pytest.LogCaptureFixture) -> None:
    # The API allows it; kube-proxy ignores that port and keeps the others.
    ports: list[dict[str, Any]] = [
        {"name": "http", "port": 8080, "protocol": "TCP"},
        {"name": "metrics", "protocol": "TCP"},
        {"name": "zero", "port": 0, "protocol": "TCP"},
    ]
    obj = endpoint_slice("x", endpoints=[endpoint("10.1.0.1")], ports=ports)
    with caplog.at_level("WARNING", logger="uproxy.objects"):
        info = convert_slice(obj)
        convert_slice(obj)  # parsed again (an event, a relist): said once
    assert info is not None and [(p.name, p.port) for p in info.ports] == [("http", 8080)]
    said = [r.getMessage() for r in caplog.records]
    assert said == ["Ignoring an EndpointSlice port without a port number"] * 2  # two ports
    with pytest.raises(InvalidObject, match=r"ports\[0\]\.port"):
        convert_slice(endpoint_slice("x", endpoints=[], ports=[{"name": "a", "port": "80"}]))


def test_fqdn_slices_are_ignored() -> None:
    obj = endpoint_slice("x", endpoints=[{"addresses": ["a.example"]}], address_type="FQDN")
    assert convert_slice(obj) is None


BAD_SLICES: list[tuple[str, dict[str, Any], str]] = [
    (
        "no-service-label",
        {**endpoint_slice("x", endpoints=[]), "metadata": {"name": "x"}},
        "service-name",
    ),
    ("bad-address-type", endpoint_slice("x", endpoints=[], address_type="IPv5"), "addressType"),
    ("no-addresses", endpoint_slice("x", endpoints=[{"addresses": []}]), "endpoints[0].addresses"),
    (
        "bad-ip",
        endpoint_slice("x", endpoints=[endpoint("10.0.0.999")]),
        "endpoints[0].addresses[0]",
    ),
    ("family-mismatch", endpoint_slice("x", endpoints=[endpoint("fd00::1")]), "addresses[0]"),
    (
        "zoned-address",
        endpoint_slice("x", endpoints=[endpoint("fe80::1%eth0")], address_type="IPv6"),
        "endpoints[0].addresses[0]",
    ),
    (
        "mapped-address",
        endpoint_slice("x", endpoints=[endpoint("::ffff:10.0.2.10")], address_type="IPv6"),
        "endpoints[0].addresses[0]",
    ),
    (
        "second-address-bad",
        endpoint_slice("x", endpoints=[{"addresses": ["10.0.0.1", "fd00::1"]}]),
        "endpoints[0].addresses[1]",
    ),
    (
        "port-negative",
        endpoint_slice("x", endpoints=[], ports=[{"name": "a", "port": -1}]),
        "ports[0].port",
    ),
    (
        "dup-port",
        endpoint_slice(
            "x", endpoints=[], ports=[{"name": "a", "port": 1}, {"name": "a", "port": 2}]
        ),
        "ports[1].name",
    ),
    ("ready-string", endpoint_slice("x", endpoints=[endpoint("10.0.0.1", ready="yes")]), "ready"),
    (
        "hints-not-object",
        endpoint_slice("x", endpoints=[endpoint("10.0.0.1", hints=["z1"])]),
        "endpoints[0].hints",
    ),
    (
        "zone-hints-not-list",
        endpoint_slice("x", endpoints=[endpoint("10.0.0.1", hints={"forZones": "z1"})]),
        "endpoints[0].hints.forZones",
    ),
    (
        "zone-hint-not-object",
        endpoint_slice("x", endpoints=[endpoint("10.0.0.1", hints={"forZones": ["z1"]})]),
        "endpoints[0].hints.forZones[0]",
    ),
    (
        "node-hint-no-name",
        endpoint_slice(
            "x",
            endpoints=[endpoint("10.0.0.1"), endpoint("10.0.0.2", hints={"forNodes": [{}]})],
        ),
        "endpoints[1].hints.forNodes[0].name",
    ),
    (
        "zone-hint-name-number",
        endpoint_slice("x", endpoints=[endpoint("10.0.0.1", hints={"forZones": [{"name": 1}]})]),
        "endpoints[0].hints.forZones[0].name",
    ),
]


@pytest.mark.parametrize(("case", "obj", "field"), BAD_SLICES, ids=[c[0] for c in BAD_SLICES])
def test_malformed_slices_name_the_field(case: str, obj: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidObject) as err:
        convert_slice(obj)
    assert field in err.value.field, (case, str(err.value))


def _full_objects() -> list[dict[str, Any]]:
    """A Service, an EndpointSlice and a Node with every field the conversions read."""
    svc = service(ports=[{"name": "http", "port": 80, "protocol": "TCP", "nodePort": 30080}])
    svc["metadata"]["annotations"] = {"uproxy.io/lb-algorithm": "random"}
    svc["spec"].update(
        type="LoadBalancer",
        clusterIPs=["10.96.0.10"],
        ipFamilies=["IPv4"],
        externalIPs=["192.0.2.1"],
        loadBalancerSourceRanges=["10.0.0.0/8"],
        sessionAffinity="ClientIP",
        sessionAffinityConfig={"clientIP": {"timeoutSeconds": 60}},
        externalTrafficPolicy="Local",
        internalTrafficPolicy="Cluster",
        healthCheckNodePort=30999,
    )
    svc["status"] = {"loadBalancer": {"ingress": [{"ip": "198.51.100.1"}]}}
    eps = endpoint_slice(
        "web-1",
        endpoints=[
            endpoint("10.1.0.1", ready=True, serving=True, terminating=False, nodeName="n",
                     zone="a", hints={"forZones": [{"name": "a"}], "forNodes": [{"name": "n"}]}),
            endpoint("10.1.0.2", ready=False),
        ],
    )  # fmt: skip
    node = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": "n", "labels": {"topology.kubernetes.io/zone": "a"}},
        "spec": {"podCIDR": "10.244.1.0/24", "podCIDRs": ["10.244.1.0/24"]},
    }
    return [svc, eps, node]


def _places(obj: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if path:
        yield path
    items = (
        obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    )
    for key, value in items:
        yield from _places(value, (*path, key))


def test_any_field_of_the_wrong_kind_is_an_invalid_object_never_a_crash() -> None:
    """5,000 seeded objects, each a full one with one or two fields replaced (by a null, a
    boolean, numbers out of range, strings, lists, objects) or removed: a conversion either
    works or raises InvalidObject (one line naming the field); never another exception."""
    rng = random.Random(5)
    wrong: list[Any] = [None, True, 0, -1, 70000, 2**40, 1.5, "", "x", "10.0.0.1", "::1"]
    wrong += [[], [None], [1], {}, {"a": 1}, "TCP", "UDP", "SCTP", "Local", "ClientIP"]
    converts = [service_ports, convert_slice, node_info]
    invalid = 0
    for _ in range(5000):
        which = rng.randrange(3)
        obj = copy.deepcopy(_full_objects()[which])
        places = list(_places(obj))
        for _ in range(rng.randrange(1, 3)):
            path = rng.choice(places)
            parent = obj
            try:
                for key in path[:-1]:
                    parent = parent[key]
                if isinstance(parent, dict) and rng.random() < 0.2:
                    del parent[path[-1]]
                else:
                    parent[path[-1]] = copy.deepcopy(rng.choice(wrong))
            except (KeyError, IndexError, TypeError):
                continue  # the place went with an earlier change
        try:
            converts[which](obj)
        except InvalidObject as exc:
            assert "\n" not in str(exc)
            invalid += 1
    assert invalid > 1000  # the changes did reach fields that are checked


@pytest.mark.parametrize(
    ("addresses", "ips"),
    [
        ([("InternalIP", "10.0.0.1"), ("InternalIP", "fd00::1")], ("10.0.0.1", "fd00::1")),
        ([("ExternalIP", "203.0.113.1"), ("InternalIP", "10.0.0.1")], ("10.0.0.1",)),
        ([("ExternalIP", "203.0.113.1")], ("203.0.113.1",)),
        ([("InternalIP", "fd00::1"), ("ExternalIP", "203.0.113.1")], ("fd00::1", "203.0.113.1")),
        ([("InternalIP", "10.0.0.1"), ("InternalIP", "10.0.0.2")], ("10.0.0.1",)),
        ([("Hostname", "node-a")], ()),
    ],
)
def test_a_nodes_ips_are_read_as_kube_proxy_reads_them(
    addresses: list[tuple[str, str]], ips: tuple[str, ...]
) -> None:
    """The first InternalIP (else ExternalIP), then the first of the other family."""
    obj = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": "node-a"},
        "status": {"addresses": [{"type": t, "address": a} for t, a in addresses]},
    }
    assert node_info(obj).addresses == ips
