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

A dual-stack cluster (``cluster(ipv6=True)``) has the same layout in ULA space beside it:
``fd00:200:N::/64`` for ``10.200.N.0/24``, backends ``fd00:200:2::2, ::3, ::4``, node-b
``fd00:200:4::1``, and ``2001:db8::/64`` (routed by outside to node-a) for IPv6 externalIPs and
LoadBalancer IPs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from tests.netns.topology import NODE_IP6, Topology, add_ip6, sh, topology

NODE_B_IP = "10.200.4.1"
OUTSIDE_B_SIDE = "10.200.4.2"
NODE_B_IP6 = "fd00:200:4::1"
OUTSIDE_B_SIDE6 = "fd00:200:4::2"
EXTRA_BACKEND_IPS = ("10.200.2.3", "10.200.2.4")
EXTRA_BACKEND_IPS6 = ("fd00:200:2::3", "fd00:200:2::4")
# Addresses outside routes to node-a: externalIPs and LoadBalancer ingress IPs live here.
PUBLIC_NET = "203.0.113.0/24"
PUBLIC_NET6 = "2001:db8::/64"


@dataclass
class Cluster:
    topo: Topology
    node_b: str

    @property
    def backend_ips(self) -> tuple[str, ...]:
        return (self.topo.backend_ip, *EXTRA_BACKEND_IPS)

    @property
    def backend_ips6(self) -> tuple[str, ...]:
        """The backends' IPv6 addresses, in the order of ``backend_ips`` (dual-stack only)."""
        return (self.topo.backend_ip6, *EXTRA_BACKEND_IPS6) if self.topo.ipv6 else ()


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
    if topo.ipv6:
        add_ip6(ns, "eth0", NODE_B_IP6)
        add_ip6(topo.outside, "eth1", OUTSIDE_B_SIDE6)
        sh("ip", "-n", ns, "-6", "route", "add", "default", "via", OUTSIDE_B_SIDE6)
        topo.run(topo.outside, "sysctl", "-qw", "net.ipv6.conf.all.forwarding=1")
    return ns


@contextmanager
def cluster(*, ipv6: bool = False) -> Iterator[Cluster]:
    with topology(ipv6=ipv6) as topo:
        for ip in EXTRA_BACKEND_IPS:
            sh("ip", "-n", topo.backend, "addr", "add", f"{ip}/24", "dev", "eth0")
        sh("ip", "-n", topo.outside, "route", "add", PUBLIC_NET, "via", topo.node_ip)
        if ipv6:
            for ip in EXTRA_BACKEND_IPS6:
                add_ip6(topo.backend, "eth0", ip)
            sh("ip", "-n", topo.outside, "-6", "route", "add", PUBLIC_NET6, "via", NODE_IP6)
        node_b = _add_node_b(topo)
        yield Cluster(topo, node_b)
