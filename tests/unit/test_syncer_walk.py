"""Random walks of a dual-stack cluster through the syncer, checked against a fresh start.

The syncer works incrementally: the tracker names the service ports that changed, endpoint
changes take their own road (``apply_endpoints``) between syncs, each port keeps its portals
and refusals, and the rules get the union. Here services and EndpointSlices are added,
changed and deleted at random (families, ports, types, externalIPs, LoadBalancer IPs and
source ranges, traffic policies, affinity, algorithms, endpoints on this node or another,
ready, serving or terminating, slices that name other ports), with endpoint applications and
syncs in between. After every sync the syncer must stand where a syncer started afresh on
the same objects stands: the same listeners per family and traffic, the same endpoints in
every balancer and sent to the workers, the same portals given to the rules (proxy port
numbers aside: each port is named by the listener it belongs to), and no listener it still
uses closed.
"""

from __future__ import annotations

import random
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.factories import endpoint, endpoint_slice, service
from tests.unit.test_syncer import FakeListener, RecordingLink, RecordingRules, make_dual
from uproxy.model import IPFamily, Protocol, Traffic
from uproxy.rules.base import Portal
from uproxy.syncer import Syncer
from uproxy.tracker import Kind, Tracker

V4, V6 = IPFamily.V4, IPFamily.V6
NODE = "node-a"  # the node make_dual's syncer runs on
PORTS: tuple[dict[str, Any], ...] = (
    {"name": "http", "port": 80, "protocol": "TCP"},
    {"name": "dns", "port": 53, "protocol": "UDP"},
    {"name": "metrics", "port": 9090, "protocol": "TCP"},
)
EXTERNAL_IPS = ("203.0.113.5", "203.0.113.6", "2001:db8::5")
LB_IPS = ("198.51.100.9", "198.51.100.10", "2001:db8::9")
SOURCE_RANGES = ("192.0.2.0/24", "10.0.0.0/8", "2001:db8:1::/48")
STEPS = 150


@dataclass
class Objects:
    """The cluster's Services and EndpointSlices, as the API would list them now."""

    rng: random.Random
    services: dict[str, dict[str, Any]] = field(default_factory=dict)
    slices: dict[str, dict[str, Any]] = field(default_factory=dict)
    _count: int = 0
    _node_ports: int = 30000

    def draw_service(self, name: str, number: int) -> dict[str, Any]:
        rng = self.rng
        families = rng.choice([(V4,), (V4,), (V6,), (V4, V6), (V6, V4)])
        ips = [f"10.96.0.{number}" if f is V4 else f"fd00:96::{number:x}" for f in families]
        ports = [dict(p) for p in rng.sample(PORTS, rng.randint(1, 2))]
        kind = rng.choice(["ClusterIP", "ClusterIP", "NodePort", "LoadBalancer"])
        spec: dict[str, Any] = {"type": kind, "clusterIPs": ips}
        if rng.random() < 0.05:
            spec["clusterIPs"] = ["None"]  # headless: not proxied
        if kind != "ClusterIP":
            for port in ports:
                self._node_ports += 1
                port["nodePort"] = self._node_ports
            if rng.random() < 0.4:
                spec["externalTrafficPolicy"] = "Local"
        if rng.random() < 0.3:
            spec["externalIPs"] = rng.sample(EXTERNAL_IPS, rng.randint(1, 2))
        if rng.random() < 0.2:
            spec["internalTrafficPolicy"] = "Local"
        if rng.random() < 0.2:
            spec["sessionAffinity"] = "ClientIP"
            spec["sessionAffinityConfig"] = {"clientIP": {"timeoutSeconds": rng.choice([60, 600])}}
        if kind == "LoadBalancer" and rng.random() < 0.5:
            spec["loadBalancerSourceRanges"] = rng.sample(SOURCE_RANGES, rng.randint(1, 2))
        annotations = None
        if rng.random() < 0.15:
            algorithm = rng.choice(["random", "least-connections", "round-robin"])
            annotations = {"uproxy.io/lb-algorithm": algorithm}
        svc = service(
            name, cluster_ip=spec["clusterIPs"][0], ports=ports, annotations=annotations, **spec
        )
        if kind == "LoadBalancer":
            ingress = [{"ip": ip} for ip in rng.sample(LB_IPS, rng.randint(0, 2))]
            svc["status"] = {"loadBalancer": {"ingress": ingress}}
        return svc

    def draw_slice(self, name: str, service_name: str, number: int) -> dict[str, Any]:
        rng = self.rng
        family = rng.choice([V4, V4, V6])
        endpoints = []
        for k in range(rng.randint(0, 3)):
            ip = f"10.1.{number}.{k + 1}" if family is V4 else f"fd00:1::{number:x}:{k + 1}"
            fields: dict[str, Any] = {"nodeName": rng.choice([NODE, NODE, "node-b"])}
            roll = rng.random()
            if roll < 0.15:
                fields.update(ready=False, serving=True, terminating=True)
            elif roll < 0.25:
                fields.update(ready=False, serving=False, terminating=True)
            elif roll < 0.3:
                fields.update(ready=False)
            endpoints.append(endpoint(ip, **fields))
        ports = [
            {"name": p["name"], "port": 8000 + p["port"], "protocol": p["protocol"]}
            for p in rng.sample(PORTS, rng.randint(1, 3))
        ]
        address_type = "IPv4" if family is V4 else "IPv6"
        return endpoint_slice(
            name, service_name, endpoints=endpoints, ports=ports, address_type=address_type
        )

    def add_service(self) -> tuple[Kind, dict[str, Any]]:
        self._count += 1
        name = f"s{self._count}"
        self.services[name] = self.draw_service(name, self._count)
        return Kind.SERVICE, self.services[name]

    def new_slice(self) -> tuple[Kind, dict[str, Any]]:
        svc = self.rng.choice(sorted(self.services))
        name = f"{svc}-{self.rng.randint(1, 2)}"
        self.slices[name] = self.draw_slice(name, svc, int(svc[1:]))
        return Kind.ENDPOINT_SLICE, self.slices[name]

    def change(self) -> tuple[str, Kind, dict[str, Any]]:
        """One change: ("upsert" or "delete", its kind, the object)."""
        roll = self.rng.random()
        if roll < 0.15 or not self.services:
            return ("upsert", *self.add_service())
        if roll < 0.25:
            name = self.rng.choice(sorted(self.services))
            return "delete", Kind.SERVICE, self.services.pop(name)
        if roll < 0.45:
            name = self.rng.choice(sorted(self.services))
            self.services[name] = self.draw_service(name, int(name[1:]))
            return "upsert", Kind.SERVICE, self.services[name]
        if roll < 0.55 and self.slices:
            name = self.rng.choice(sorted(self.slices))
            return "delete", Kind.ENDPOINT_SLICE, self.slices.pop(name)
        return ("upsert", *self.new_slice())


def make(objects: Objects | None = None) -> tuple[Tracker, Syncer, RecordingRules, RecordingLink]:
    tracker, syncer, rules, link, _ = make_dual(
        services=objects.services.values() if objects else (),
        slices=objects.slices.values() if objects else (),
        port_range="40000-41999",
    )
    return tracker, syncer, rules, link


def state(syncer: Syncer, rules: RecordingRules, link: RecordingLink) -> dict[str, Any]:
    """What the syncer stands on, with every proxy port named by its listener."""
    names: dict[tuple[Protocol, IPFamily, int], Hashable] = {}
    ports: dict[Hashable, Any] = {}
    for spn, pp in syncer.ports.items():
        for family, fp in pp.families.items():
            for role, lst in (("cluster", fp.cluster), ("external", fp.external)):
                if lst is not None:
                    assert not (isinstance(lst, FakeListener) and lst.closed), (spn, role)
                    names[(spn.protocol, family, lst.port)] = (spn, family, role)
            b = fp.balancer
            ports[(spn, family)] = (
                pp.port,
                fp.cluster is not None,
                fp.external is not None,
                sorted(b.endpoints(Traffic.CLUSTER), key=repr),
                sorted(b.endpoints(Traffic.EXTERNAL), key=repr),
                b.local_ready_ips,
                b.affinity,
                b.counting,
            )

    def named(portal: Portal) -> tuple[Any, ...]:
        key = (portal.protocol, portal.family)
        cluster = portal.cluster_proxy_port
        return (
            portal.service,
            portal.kind,
            portal.ip,
            None if portal.refusal else portal.port,  # a refusal's port is its proxy port
            names[(*key, portal.proxy_port)],
            names[(*key, cluster)] if cluster else None,
            portal.source_ranges,
            portal.node_family,
        )

    given = rules.syncs[-1] if rules.syncs else frozenset()
    assert given == syncer.portals(), "the rules have the syncer's portals"
    sent = {key: sorted(eps, key=repr) for key, eps in link.endpoints.items()}
    return {
        "ports": ports,
        "portals": sorted(map(named, given), key=repr),
        "workers": sent,
    }


async def walk(seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    objects = Objects(rng)
    tracker, syncer, rules, link = make()
    await syncer.sync()
    done: list[str] = []
    tally = {"syncs": 0, "applied": 0, "ports": 0, "portals": 0}
    for step in range(STEPS):
        op, kind, obj = objects.change()
        done.append(f"{op} {kind.name.lower()} {obj['metadata']['name']}")
        if op == "upsert":
            tracker.upsert(kind, obj)
        else:
            tracker.delete(kind, obj)
        roll = rng.random()
        if roll < 0.4:
            tally["applied"] += len(syncer.apply_endpoints())
        if roll < 0.7:
            continue
        await syncer.sync()
        tally["syncs"] += 1
        _, fresh, fresh_rules, fresh_link = make(objects)
        await fresh.sync()
        want = state(fresh, fresh_rules, fresh_link)
        got = state(syncer, rules, link)
        tally["ports"] += len(want["ports"])
        tally["portals"] += len(want["portals"])
        for part in ("ports", "portals", "workers"):
            assert got[part] == want[part], f"seed {seed}, step {step}: {part} after {done[-4:]}"
    return tally


@pytest.mark.parametrize("seed", range(6))
async def test_every_sync_stands_where_a_fresh_start_stands(seed: int) -> None:
    tally = await walk(seed)
    # The walk did what it is for: many syncs, ports and portals, and endpoint changes
    # that took the fast road.
    assert tally["syncs"] >= 20 and tally["applied"] >= 10, tally
    assert tally["ports"] >= 100 and tally["portals"] >= 100, tally
