"""Random walks of services through uproxy on a node, checked by traffic from a pod, the node
and outside (iptables-restore and nftables rules).

A seed draws steps that change the services file uproxy follows: services added and
deleted, their endpoints redrawn among three backends (none at all now and then), their port
changed, their type moved between ClusterIP, NodePort and LoadBalancer, externalIPs added
and removed. After each step every service must be reachable on every one of its addresses
from where a user would reach it (ClusterIP from a pod and from the node; node port,
externalIP and LoadBalancer IP from outside, the node port from a pod too), answered by one
of its endpoints with the body's length and sha256 (curl), in two rounds in a row; a
service without endpoints is refused at once; the addresses of a deleted service are no
longer answered. What fails names the curl error and the client port of each transfer, and
ends with uproxy's last log lines and what the node's kernel holds for the service range
(rules and conntrack entries).
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
import subprocess
from dataclasses import dataclass
from typing import Any

import pytest

from tests.e2e.cluster import Cluster
from tests.e2e.conftest import StartProc, StartUproxy
from tests.e2e.harness import (
    ServicesFile,
    connect_times_out,
    curl_status,
    slice_endpoint,
    url,
    wait_until_ok,
)
from tests.e2e.manifests import backend_argv, web_service, web_slice
from tests.netns.helpers import nft, save

STEPS = 10
RULES = [pytest.param("auto", id="restore"), pytest.param("nftables", id="nftables")]

pytestmark = [pytest.mark.root]


@dataclass
class Svc:
    number: int
    port: int
    endpoints: tuple[int, ...]  # backends web-1..web-3 by number
    kind: str = "ClusterIP"
    external: bool = False

    @property
    def cluster_ip(self) -> str:
        return f"10.96.1.{self.number}"

    @property
    def node_port(self) -> int:
        return 30100 + self.number

    @property
    def external_ip(self) -> str:  # in the range outside routes to the node
        return f"203.0.113.{100 + self.number}"

    @property
    def lb_ip(self) -> str:
        return f"203.0.113.{150 + self.number}"

    def objects(self, net: Cluster) -> list[dict[str, Any]]:
        name = f"walk-{self.number}"
        spec: dict[str, Any] = {"type": self.kind}
        if self.external:
            spec["externalIPs"] = [self.external_ip]
        svc = web_service(name, cluster_ip=self.cluster_ip, **spec)
        svc["spec"]["ports"][0]["port"] = self.port
        if self.kind != "ClusterIP":
            svc["spec"]["ports"][0]["nodePort"] = self.node_port
        if self.kind == "LoadBalancer":
            svc["status"] = {"loadBalancer": {"ingress": [{"ip": self.lb_ip}]}}
        eps = [slice_endpoint(net.backend_ips[i - 1]) for i in self.endpoints]
        return [svc, web_slice(f"{name}-1", name, eps)]

    def paths(self, net: Cluster) -> list[tuple[str, str]]:
        """(namespace, URL): every address of the service, from where a user reaches it."""
        topo = net.topo
        out = [
            (topo.pod, url(self.cluster_ip, self.port)),
            (topo.node, url(self.cluster_ip, self.port)),
        ]
        if self.kind != "ClusterIP":
            out += [
                (topo.outside, url(topo.node_ip, self.node_port)),
                (topo.pod, url(topo.node_ip, self.node_port)),
            ]
        if self.external:
            out.append((topo.outside, url(self.external_ip, self.port)))
        if self.kind == "LoadBalancer":
            out.append((topo.outside, url(self.lb_ip, self.port)))
        return out


def answered(net: Cluster, ns: str, where: str, count: int) -> list[str]:
    """The names of the backends that answered ``count`` POSTs (a new connection each), each
    answer checked for the body's length and sha256; a transfer that failed is named by
    curl's error and the client port it used."""
    body = b"walk"
    argv = ["curl", "-sS", "--fail", "--max-time", "3", "-H", "Expect:", "--data-binary", "walk"]
    argv += ["-w", " port=%{local_port}\n", *([where] * count)]
    done = subprocess.run(net.topo.exec_argv(ns, *argv), capture_output=True, text=True, timeout=60)
    names = []
    for line in done.stdout.splitlines():
        if line.startswith("{"):  # an answer; each transfer then prints its " port=N"
            got = json.loads(line)
            assert (got["len"], got["sha256"]) == (len(body), hashlib.sha256(body).hexdigest())
            names.append(got["name"])
    assert len(names) == count, (ns, where, done.stdout, done.stderr)
    return names


def serves(net: Cluster, services: dict[int, Svc]) -> None:
    """Every address of every service answers as the file says (raises when one does not)."""
    for svc in services.values():
        names = {f"web-{i}" for i in svc.endpoints}
        for k, (ns, where) in enumerate(svc.paths(net)):
            if not svc.endpoints:
                assert curl_status(net.topo, ns, where) == 7, (ns, where)  # refused
                continue
            # The first path (a pod to the ClusterIP) until every endpoint answered: each of
            # the two workers goes round the endpoints, and one of them takes 3 of 6.
            count = 6 if k == 0 else 2
            got = set(answered(net, ns, where, count))
            assert got == names if k == 0 else got <= names, (ns, where, got)


def twice(net: Cluster, services: dict[int, Svc]) -> None:
    """``serves``, and at once again: a state reached must hold, not flap."""
    serves(net, services)
    serves(net, services)


def unanswered(net: Cluster, paths: list[tuple[str, str]]) -> None:
    """A deleted service's addresses: refused, or no answer at all (no rule steers them)."""
    for ns, where in paths:
        if curl_status(net.topo, ns, where) != 7:
            assert connect_times_out(net.topo, ns, where), (ns, where)


def kernel_state(net: Cluster, rules: str) -> str:
    """What the node's kernel holds for the service range when a step fails: the rules that
    name it and the connections tracked to it (for a failure seen once, to be read later)."""
    ruleset = (
        nft(net.topo, "list", "ruleset")
        if rules == "nftables"
        else save(net.topo, "nft") + save(net.topo, "legacy")  # where the rules went
    )
    marks = ("10.96.", "reject", "REJECT", "elements")  # portals, refusals, nft set contents
    portals = [r.strip() for r in ruleset.splitlines() if any(m in r for m in marks)]
    tracked = subprocess.run(
        net.topo.exec_argv(net.topo.node, "conntrack", "-L", "-d", "10.96.0.0/16"),
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout.splitlines()
    return f"rules naming 10.96.* {portals}; conntrack to 10.96.* {tracked}"


@pytest.mark.parametrize("seed", [1])
@pytest.mark.parametrize("rules", RULES)
def test_every_step_answers_on_every_address(
    net: Cluster,
    services: ServicesFile,
    start_proc: StartProc,
    start_uproxy: StartUproxy,
    rules: str,
    seed: int,
) -> None:
    rng = random.Random(seed)
    start_proc(net.topo.backend, backend_argv(net), ready_line=True)

    def draw_endpoints() -> tuple[int, ...]:
        return tuple(sorted(rng.sample([1, 2, 3], rng.choice([0, 1, 2, 3, 3]))))

    walk: dict[int, Svc] = {}
    count = 0

    def add() -> str:
        nonlocal count
        count += 1
        kind = rng.choice(["ClusterIP", "NodePort", "LoadBalancer"])
        walk[count] = Svc(count, rng.choice([80, 8081]), draw_endpoints(), kind)
        walk[count].external = rng.random() < 0.3
        return f"added walk-{count}"

    def write() -> None:
        services.objects.clear()
        for svc in walk.values():
            services.put(*svc.objects(net))
        services.write()

    for _ in range(3):
        add()
    write()
    proxy = start_uproxy(rules)
    proxy.wait_synced()
    done = ["start"]
    for step in range(STEPS + 1):
        gone: list[tuple[str, str]] = []
        if step:
            roll = rng.random()
            svc = walk[rng.choice(sorted(walk))]
            if roll < 0.2 or len(walk) < 2:
                done.append(add())
            elif roll < 0.35:
                gone = svc.paths(net)
                del walk[svc.number]
                done.append(f"deleted walk-{svc.number}")
            elif roll < 0.6:
                svc.endpoints = draw_endpoints()
                done.append(f"endpoints of walk-{svc.number}: {svc.endpoints}")
            elif roll < 0.75:
                svc.port = 8081 if svc.port == 80 else 80
                done.append(f"port of walk-{svc.number}: {svc.port}")
            elif roll < 0.9:
                svc.kind = rng.choice(["ClusterIP", "NodePort", "LoadBalancer"])
                done.append(f"type of walk-{svc.number}: {svc.kind}")
            else:
                svc.external = not svc.external
                done.append(f"externalIP of walk-{svc.number}: {svc.external}")
            write()
        where = f"seed {seed}, step {step} after {done[-3:]}"
        try:
            wait_until_ok(functools.partial(twice, net, walk), timeout=15, message=where)
        except pytest.fail.Exception:
            try:
                twice(net, walk)  # to say what is wrong
            except AssertionError as exc:
                said = proxy.proc.stderr_lines[-25:]
                raise AssertionError(
                    f"{where}: {exc}; uproxy said {said}; {kernel_state(net, rules)}"
                ) from exc
            raise
        wait_until_ok(functools.partial(unanswered, net, gone), timeout=15, message=where)
