"""Random walks of a dual-stack cluster's portals through every kernel backend.

Each step changes a few services as a cluster does: added, removed, moved to other proxy
ports, renamed, their externalIPs, LoadBalancer IPs and source ranges redrawn, node ports
and ``externalTrafficPolicy: Local`` turned on or off, endpoints gone (anywhere, or on this
node only); now and then hundreds of services come or move at once. Services draw their
ports and addresses from small pools, so two of them sometimes claim the same externalIP or
LoadBalancer IP and port. At one step in five someone else damages uproxy's rules first
(a table deleted or flushed, a map or set emptied, a chain flushed, a rule or a jump
deleted), and the backend's check and sync must put them back. The backend syncs what changed
(rule edits, staged rewrites, nft element deltas), and after every step the kernel must hold
what a fresh load of the same portals gives:

* the iptables backends: exactly the rendered rule set (``build_rules``) of each family,
  beside someone else's rules, which stay as they were;
* nftables: the listing of both of uproxy's tables equals that of a full load of the same
  portals into another namespace, done afresh at every step.

A failure names the seed, the step and the changes that led to it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from tests.netns.conftest import DUAL_STACK
from tests.netns.driver import many_portals
from tests.netns.helpers import (
    ALL_BACKENDS,
    install_foreign,
    install_foreign6,
    nft_normalised,
    run_ops,
    save,
    save6,
    shell_op,
    sync_op,
)
from tests.netns.test_nftables import DELETE_FIRST_HOST_RULE
from tests.netns.test_rules import assert_installed
from tests.netns.topology import Topology
from uproxy.model import IPFamily, Protocol, ServicePortName, ip_family
from uproxy.rules.base import LocalTraffic, Portal, PortalKind

V4, V6 = IPFamily.V4, IPFamily.V6
STEPS = 30
NODEPORT_CIDRS = ("10.200.3.0/24", "fd00:200:3::/64")
PODS = ("10.200.1.0/24", "fd00:200:1::/64")
CONFIG: dict[str, Any] = {"nodeport_cidrs": NODEPORT_CIDRS, "local": {"cidrs": list(PODS)}}
# Small pools, so that services now and then claim the same address and port.
SERVICE_PORTS = (80, 53)
EXTERNAL_IPS = ("203.0.113.5", "203.0.113.6", "2001:db8::5")
LB_IPS = ("198.51.100.9", "198.51.100.10", "2001:db8::9")
SOURCE_RANGES = ("10.200.0.0/16", "192.0.2.7/32", "10.200.3.0/24", "fd00:200:3::/64")
# What a new service has, and how often.
FEATURES = (("externals", 0.4), ("lb", 0.4), ("ranges", 0.5), ("node-port", 0.4), ("local", 0.25))
# Services with these many portals come and go in bursts (``driver.many_portals``).
MANY = (0, 300, 300)


@dataclass
class Service:
    """One service port as the syncer turns it into portals (``Syncer._family_portals`` and
    ``_refusals_of``): a cluster listener per family, and with a Local policy an external
    listener of its own that traffic from the cluster short-circuits past."""

    name: ServicePortName
    number: int  # picks the ClusterIPs
    families: tuple[IPFamily, ...]
    port: int
    cluster_ports: dict[IPFamily, int]
    external_ports: dict[IPFamily, int]
    external_ips: tuple[str, ...] = ()
    lb_ips: tuple[str, ...] = ()
    source_ranges: tuple[str, ...] = ()
    node_port: int = 0
    local: bool = False
    refused: str = ""  # "": endpoints; "anywhere": none at all; "local": none on this node

    def cluster_ip(self, family: IPFamily) -> str:
        n = self.number
        return f"10.96.{n // 250}.{n % 250 + 1}" if family is V4 else f"fd00:96::{n:x}"

    def portals(self) -> list[Portal]:
        out: list[Portal] = []
        for fam in self.families:
            cluster = self.cluster_ports[fam]
            external = self.external_ports[fam] if self.local else cluster
            short = cluster if self.local else 0
            out.append(
                Portal(self.name, PortalKind.CLUSTER_IP, self.cluster_ip(fam), self.port, cluster)
            )
            for ip in self.external_ips:
                if ip_family(ip) is fam:
                    out.append(
                        Portal(self.name, PortalKind.EXTERNAL_IP, ip, self.port, external, short)
                    )
            ranges = tuple(r for r in self.source_ranges if ip_family(r) is fam)
            for ip in self.lb_ips:
                if ip_family(ip) is fam:
                    out.append(
                        Portal(
                            self.name, PortalKind.LB_INGRESS, ip, self.port, external, short, ranges
                        )
                    )
            if self.node_port:
                out.append(
                    Portal(
                        self.name,
                        PortalKind.NODE_PORT,
                        None,
                        self.node_port,
                        external,
                        short,
                        (),
                        fam,
                    )
                )
            if self.refused == "anywhere":
                for port in {cluster, external}:
                    out.append(Portal.refusing(self.name, port, fam, anywhere=False))
            elif self.refused == "local" and self.local:
                out.append(Portal.refusing(self.name, external, fam, anywhere=True))
        return out


@dataclass
class Cluster:
    rng: random.Random
    services: dict[ServicePortName, Service] = field(default_factory=dict)
    many: int = 0
    moved: int = 0
    _next_port: int = 40000
    _next_number: int = 0
    _node_ports: set[int] = field(default_factory=set)

    def proxy_port(self) -> int:
        self._next_port += 1
        return self._next_port

    def node_port(self) -> int:
        port = self.rng.choice([p for p in range(30000, 30100) if p not in self._node_ports])
        self._node_ports.add(port)
        return port

    def add(self) -> str:
        rng = self.rng
        self._next_number += 1
        number = self._next_number
        protocol = rng.choice([Protocol.TCP, Protocol.UDP])
        name = ServicePortName(
            rng.choice(["default", "team-a"]), f"svc-{number:03d}", "p", protocol
        )
        families = rng.choice([(V4,), (V4,), (V6,), (V4, V6)])
        svc = Service(
            name=name,
            number=number,
            families=families,
            port=rng.choice(SERVICE_PORTS),
            cluster_ports={f: self.proxy_port() for f in families},
            external_ports={f: self.proxy_port() for f in families},
        )
        self.services[name] = svc
        for what, share in FEATURES:
            if rng.random() < share:
                self.change(svc, what)
        return f"add {name}"

    def change(self, svc: Service, what: str = "") -> str:
        rng = self.rng
        what = what or rng.choice(
            ["move", "externals", "lb", "ranges", "node-port", "local", "refused", "rename"]
        )
        if what == "move":
            svc.cluster_ports = {f: self.proxy_port() for f in svc.families}
            if rng.random() < 0.5:
                svc.external_ports = {f: self.proxy_port() for f in svc.families}
        elif what == "externals":
            svc.external_ips = tuple(rng.sample(EXTERNAL_IPS, rng.randrange(3)))
        elif what == "lb":
            svc.lb_ips = tuple(rng.sample(LB_IPS, rng.randrange(3)))
        elif what == "ranges":
            svc.source_ranges = tuple(rng.sample(SOURCE_RANGES, rng.randrange(4)))
        elif what == "node-port":
            self._node_ports.discard(svc.node_port)
            svc.node_port = 0 if svc.node_port and rng.random() < 0.5 else self.node_port()
        elif what == "local":
            svc.local = not svc.local
        elif what == "refused":
            svc.refused = rng.choice(["", "", "anywhere", "local"])
            svc.local = svc.local or svc.refused == "local"  # only a Local policy has that
        else:  # a new port name: the same keys under other comments
            del self.services[svc.name]
            svc.name = replace(svc.name, port_name="q" if svc.name.port_name == "p" else "p")
            self.services[svc.name] = svc
        return f"{what} {svc.name}"

    def remove(self) -> str:
        name = self.rng.choice(sorted(self.services))
        svc = self.services.pop(name)
        self._node_ports.discard(svc.node_port)
        return f"remove {name}"

    def step(self) -> list[str]:
        rng = self.rng
        said: list[str] = []
        if rng.random() < 0.15:
            self.many = rng.choice(MANY)
            self.moved = rng.choice([0, 0, 40]) if self.many else 0
            said.append(f"many={self.many} moved={self.moved}")
        for _ in range(rng.randrange(1, 4)):
            roll = rng.random()
            if roll < 0.3 or len(self.services) < 4:
                said.append(self.add())
            elif roll < 0.45:
                said.append(self.remove())
            else:
                said.append(self.change(self.services[rng.choice(sorted(self.services))]))
        return said

    def portals(self) -> list[Portal]:
        return [p for svc in self.services.values() for p in svc.portals()]

    def sync(self) -> dict[str, Any]:
        return {**sync_op(self.portals()), "many": self.many, "moved": self.moved}

    def all_portals(self) -> list[Portal]:
        return [*self.portals(), *many_portals(self.many, self.moved)]


def walk(seed: int) -> tuple[list[list[str]], list[dict[str, Any]], list[list[Portal]]]:
    """The walk of one seed: what each step did, its sync, and the portals it leads to."""
    cluster = Cluster(random.Random(seed))
    for _ in range(12):
        cluster.add()
    said: list[list[str]] = [["12 services"]]
    syncs = [cluster.sync()]
    portals = [cluster.all_portals()]
    for _ in range(STEPS):
        said.append(cluster.step())
        syncs.append(cluster.sync())
        portals.append(cluster.all_portals())
    return said, syncs, portals


def nft_tables() -> dict[str, Any]:
    return shell_op("sh", "-c", "nft list table ip uproxy; nft list table ip6 uproxy")


# What someone else does to uproxy's rules now and then (a firewall reload, a hand-made fix):
# shell lines run in the node before a step's check and sync, which must put it all back.
NFT_DAMAGE = (
    "nft delete table ip uproxy",
    "nft flush table ip6 uproxy",
    "nft flush map ip uproxy cluster-ips",
    "nft flush set ip uproxy node-port-proxy-ports",
    DELETE_FIRST_HOST_RULE,
)


def iptables_damage(mode: str) -> tuple[str, ...]:
    v4, v6 = f"iptables-{mode}", f"ip6tables-{mode}"
    jump = (
        f"n=$({v4} -t nat -L PREROUTING -n --line-numbers | awk '/KUBE-PORTALS-CONTAINER/"
        f'{{print $1; exit}}\'); [ -z "$n" ] || {v4} -t nat -D PREROUTING $n'
    )
    return (
        f"{v4} -t nat -F KUBE-PORTALS-CONTAINER",
        f"{v6} -t nat -F KUBE-PORTALS-HOST",
        f"{v4} -t nat -D KUBE-PORTALS-HOST 1",
        f"{v4} -t filter -F KUBE-PORTALS-REJECT",
        f"{v6} -t nat -F KUBE-NODEPORT-CONTAINER",
        jump,
    )


def of_family(portals: list[Portal], family: IPFamily) -> list[Portal]:
    return [p for p in portals if p.family is family]


@pytest.mark.root
@pytest.mark.parametrize("topo", [DUAL_STACK], indirect=True)
@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize(("backend", "mode"), ALL_BACKENDS)
def test_every_step_holds_what_a_fresh_load_holds(
    topo: Topology, backend: str, mode: str, seed: int
) -> None:
    said, syncs, portals = walk(seed)
    if backend == "nftables":
        listings = [nft_tables()]
    else:
        install_foreign(topo, mode)
        install_foreign6(topo, mode)
        before = (save(topo, mode), save6(topo, mode))
        listings = [shell_op(f"iptables-{mode}-save"), shell_op(f"ip6tables-{mode}-save")]
    damage = NFT_DAMAGE if backend == "nftables" else iptables_damage(mode)
    rng = random.Random(seed)
    ops: list[dict[str, Any]] = []
    at: list[int] = []  # where each step's listings start among the results
    for step, sync in enumerate(syncs):
        if step and rng.random() < 0.2:
            line = rng.choice(damage)
            said[step].append(f"damage: {line}")
            # "|| true": what it deletes may not be there (no such rule at this step).
            ops += [shell_op("sh", "-c", f"{line} 2>/dev/null || true"), {"op": "check"}]
        ops.append(sync)
        at.append(len(ops))
        ops += listings
    ops += [{"op": "check"}, {"op": "verify"}]
    results = run_ops(topo, backend, mode, ops, **CONFIG)
    assert results[-2:] == [True, True], "the backend's own check and verify"
    assert sum("damage" in line for step in said for line in step) >= 3
    if backend == "nftables":
        # The same portals, loaded whole into another namespace at every step.
        fresh: list[dict[str, Any]] = []
        for sync in syncs:
            fresh += [{"op": "cleanup"}, sync, nft_tables()]
        loaded = run_ops(topo, backend, mode, fresh, ns=topo.outside, **CONFIG)
    local = LocalTraffic(cidrs=PODS)
    for step in range(len(syncs)):
        got = results[at[step] : at[step] + len(listings)]
        history = "; ".join(", ".join(s) for s in said[max(0, step - 2) : step + 1])
        where = f"seed {seed}, step {step} ({history})"
        if backend == "nftables":
            assert nft_normalised(got[0]) == nft_normalised(loaded[step * 3 + 2]), where
            continue
        for family, node_ip, text, old in (
            (V4, topo.node_ip, got[0], before[0]),
            (V6, topo.node_ip6, got[1], before[1]),
        ):
            try:
                assert_installed(
                    old,
                    text,
                    of_family(portals[step], family),
                    node_ip,
                    nodeport_cidrs=NODEPORT_CIDRS,
                    local=local,
                )
            except AssertionError as exc:
                raise AssertionError(f"{where}, IPv{family.value}: {exc}") from exc


def test_the_walk_reaches_what_it_is_for() -> None:
    # What the walks above go through, so that a change to the generator cannot quietly
    # stop exercising them: conflicts, every kind of portal, bursts and renames.
    kinds: set[PortalKind] = set()
    conflicts = bursts = renames = short = 0
    for seed in (1, 2):
        said, _, portals = walk(seed)
        for step in portals:
            kinds.update(p.kind for p in step)
            short += sum(p.short_circuit for p in step)
            keys = [(p.kind, p.ip, p.port, p.protocol) for p in step if p.ip is not None]
            conflicts += len(keys) - len(set(keys))
        bursts += sum(line.startswith("many=3") for step_said in said for line in step_said)
        renames += sum(line.startswith("rename") for step_said in said for line in step_said)
    assert kinds == set(PortalKind)
    assert min(conflicts, bursts, renames, short) > 0, (conflicts, bursts, renames, short)
