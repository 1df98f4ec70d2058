"""The deployed path's three network namespaces: a pod, the node it runs on, a backend.

A node never runs uproxy with ``--rules none``. A pod connects to a ClusterIP; the node's nat
PREROUTING steers the packet (kernel DNAT, or a portal rule into uproxy's proxy port); the
endpoint lives behind another interface. Three namespaces joined by two veth pairs give that
path on one machine::

    pod 10.244.0.2 ──veth── 10.244.0.1  node  10.245.0.1 ──veth── 10.245.0.2 backend

The pod's default route goes via the node, so a ClusterIP (10.96.0.0/16) reaches the node's
PREROUTING. No namespace has a route or an address for the service range: only a DNAT or
REDIRECT rule answers it, so a peer that does not steer fails the byte check instead of
reaching something else. The backend's default route goes back via the node, so replies cross
the node and conntrack undoes the translation there, as on a real node.

The bench runs its own code in these namespaces by entering them (``setns(2)`` on its one
thread) around a block: children started and sockets opened inside inherit the namespace, and
the same code that starts pinned processes, waits for listening sockets (``/proc/net`` shows
the current namespace) and fetches over HTTP works unchanged in any of the three. Every
namespace is deleted by ``Topology.delete`` (what still runs in it is killed first), and the
caller does that on every exit path.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

from bench import netns

CLONE_NEWNET = 0x40000000
POD_IP = "10.244.0.2"
NODE_POD_SIDE_IP = "10.244.0.1"
NODE_BACKEND_SIDE_IP = "10.245.0.1"
BACKEND_IP = "10.245.0.2"
SERVICE_CIDR = "10.96.0.0/16"


def _setns(fd: int) -> None:
    native = getattr(os, "setns", None)  # Python 3.12+
    if native is not None:
        native(fd, CLONE_NEWNET)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


@contextlib.contextmanager
def entered(name: str) -> Iterator[None]:
    """Run the block in network namespace ``name``; back to the previous one afterwards."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        target = os.open(f"/run/netns/{name}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            _setns(target)
        finally:
            os.close(target)
        try:
            yield
        finally:
            _setns(home)
    finally:
        os.close(home)


def _run(*argv: str) -> None:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=10, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()[:200]}")


@dataclass(frozen=True, slots=True)
class Topology:
    pod: str
    node: str
    backend: str

    @property
    def names(self) -> tuple[str, str, str]:
        return (self.pod, self.node, self.backend)

    @classmethod
    def create(cls, prefix: str) -> Topology:
        """Three fresh namespaces wired as in the module docstring (deleted again on error)."""
        topo = cls(pod=f"{prefix}-pod", node=f"{prefix}-node", backend=f"{prefix}-be")
        try:
            for name in topo.names:
                _run("ip", "netns", "add", name)
                _run("ip", "-n", name, "link", "set", "lo", "up")
                sysctls = dict(netns.SYSCTLS)
                if name == topo.node:
                    sysctls["net.ipv4.ip_forward"] = "1"
                for key, value in sysctls.items():
                    _run("ip", "netns", "exec", name, "sysctl", "-q", "-w", f"{key}={value}")
            for peer, node_if, node_ip, peer_ip in (
                (topo.pod, "to-pod", NODE_POD_SIDE_IP, POD_IP),
                (topo.backend, "to-backend", NODE_BACKEND_SIDE_IP, BACKEND_IP),
            ):
                n = topo.node
                _run("ip", "-n", n, "link", "add", node_if, "type", "veth", "peer", "name", "eth0")
                _run("ip", "-n", n, "link", "set", "eth0", "netns", peer)
                _run("ip", "-n", n, "addr", "add", f"{node_ip}/24", "dev", node_if)
                _run("ip", "-n", n, "link", "set", node_if, "up")
                _run("ip", "-n", peer, "addr", "add", f"{peer_ip}/24", "dev", "eth0")
                _run("ip", "-n", peer, "link", "set", "eth0", "up")
                _run("ip", "-n", peer, "route", "add", "default", "via", node_ip)
        except BaseException:
            topo.delete()
            raise
        return topo

    def delete(self) -> None:
        """Kill what still runs in the namespaces, then remove them (veths go with them)."""
        for name in self.names:
            netns.delete(name)

    def exists(self) -> list[str]:
        out = subprocess.run(
            ["ip", "netns", "list"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
        present = {line.split()[0] for line in out.splitlines() if line.strip()}
        return [n for n in self.names if n in present]
