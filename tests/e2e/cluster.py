"""The test cluster: the shared four-namespace node plus a second node and more backends.

::

    pod ── node-a ──────────────── outside ──── node-b
             │      (10.200.3.0/24)   (10.200.4.0/24)
          backend (10.200.2.2, .3, .4)

``node-b`` is a second Kubernetes node running its own uproxy (``--hostname-override
node-b``) from the same services file: a Local traffic policy can then be checked on a node
with local endpoints and on one without, at the same time. It reaches the backends through
``outside`` and ``node-a`` (the backends' default route), as pods on another node would be
reached over the cluster network. Every namespace is removed with the topology.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from tests.netns.topology import Topology, sh, topology

NODE_B_IP = "10.200.4.1"
OUTSIDE_B_SIDE = "10.200.4.2"
EXTRA_BACKEND_IPS = ("10.200.2.3", "10.200.2.4")
# Addresses outside routes to node-a: externalIPs and LoadBalancer ingress IPs live here.
PUBLIC_NET = "203.0.113.0/24"


@dataclass
class Cluster:
    topo: Topology
    node_b: str

    @property
    def backend_ips(self) -> tuple[str, ...]:
        return (self.topo.backend_ip, *EXTRA_BACKEND_IPS)


def _add_node_b(topo: Topology) -> str:
    ns = f"up-{topo.suffix}-nodeb"
    sh("ip", "netns", "add", ns)
    topo.created.append(ns)  # removed by topo.close() with the others
    sh("ip", "-n", ns, "link", "set", "lo", "up")
    sh(
        "ip",
        "-n",
        ns,
        "link",
        "add",
        "eth0",
        "type",
        "veth",
        "peer",
        "name",
        "eth1",
        "netns",
        topo.outside,
    )
    sh("ip", "-n", ns, "addr", "add", f"{NODE_B_IP}/24", "dev", "eth0")
    sh("ip", "-n", topo.outside, "addr", "add", f"{OUTSIDE_B_SIDE}/24", "dev", "eth1")
    sh("ip", "-n", ns, "link", "set", "eth0", "up")
    sh("ip", "-n", topo.outside, "link", "set", "eth1", "up")
    sh("ip", "-n", ns, "route", "add", "default", "via", OUTSIDE_B_SIDE)
    topo.run(topo.outside, "sysctl", "-qw", "net.ipv4.ip_forward=1")
    return ns


@contextmanager
def cluster() -> Iterator[Cluster]:
    with topology() as topo:
        for ip in EXTRA_BACKEND_IPS:
            sh("ip", "-n", topo.backend, "addr", "add", f"{ip}/24", "dev", "eth0")
        sh("ip", "-n", topo.outside, "route", "add", PUBLIC_NET, "via", topo.node_ip)
        node_b = _add_node_b(topo)
        yield Cluster(topo, node_b)
