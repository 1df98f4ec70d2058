"""A throwaway node with pods around it, built from network namespaces and veth pairs.

::

    pod (10.200.1.2) ──veth── node (10.200.1.1 | 10.200.2.1 | 10.200.3.1) ──veth── outside
                                         │                                      (10.200.3.2)
                                       veth
                                         │
                                 backend (10.200.2.2)

``node`` plays the Kubernetes node (uproxy and its rules run there; its "primary" address is
``node_ip`` on the outside link, its default route goes to ``outside``); ``pod`` and
``backend`` route everything via the node, as pods on a bridge would.

With ``ipv6`` every link is dual-stack: the same layout in ULA space, ``fd00:200:N::/64`` beside
``10.200.N.0/24`` (``fd00:200:3::1`` is the node's IPv6 address), added without duplicate
address detection so they are usable at once. Names carry a per-run
suffix, so parallel runs never collide, and ``close`` removes every namespace (the veth pairs
go with them). Python 3.11 has no ``os.setns``: code runs inside with ``ip netns exec``.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_counter = itertools.count()

POD_IP = "10.200.1.2"
NODE_POD_SIDE = "10.200.1.1"
BACKEND_IP = "10.200.2.2"
NODE_BACKEND_SIDE = "10.200.2.1"
OUTSIDE_IP = "10.200.3.2"
NODE_IP = "10.200.3.1"
POD_IP6 = "fd00:200:1::2"
NODE_POD_SIDE6 = "fd00:200:1::1"
BACKEND_IP6 = "fd00:200:2::2"
NODE_BACKEND_SIDE6 = "fd00:200:2::1"
OUTSIDE_IP6 = "fd00:200:3::2"
NODE_IP6 = "fd00:200:3::1"
ULA_NET = "fd00:200::/48"  # every link's IPv6 network


def sh(*argv: str, stdin: str | None = None, timeout: float = 30.0) -> str:
    """Run a command, fail loudly with its stderr, return its stdout."""
    done = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


@dataclass
class Topology:
    suffix: str
    node: str = ""
    pod: str = ""
    backend: str = ""
    outside: str = ""
    node_ip: str = NODE_IP
    pod_ip: str = POD_IP
    backend_ip: str = BACKEND_IP
    outside_ip: str = OUTSIDE_IP
    ipv6: bool = False
    node_ip6: str = NODE_IP6
    pod_ip6: str = POD_IP6
    backend_ip6: str = BACKEND_IP6
    outside_ip6: str = OUTSIDE_IP6
    created: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.node = f"up-{self.suffix}-node"
        self.pod = f"up-{self.suffix}-pod"
        self.backend = f"up-{self.suffix}-backend"
        self.outside = f"up-{self.suffix}-outside"

    @property
    def namespaces(self) -> tuple[str, ...]:
        return (self.node, self.pod, self.backend, self.outside)

    def exec_argv(self, ns: str, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", ns, *argv]

    def run(self, ns: str, *argv: str, stdin: str | None = None, timeout: float = 30.0) -> str:
        return sh(*self.exec_argv(ns, *argv), stdin=stdin, timeout=timeout)

    def python_argv(self, ns: str, module: str, *args: str) -> list[str]:
        """argv running ``python -m module`` (from this repository) inside ``ns``."""
        return self.exec_argv(ns, sys.executable, "-m", module, *args)

    def popen(self, ns: str, argv: Sequence[str]) -> subprocess.Popen[str]:
        return subprocess.Popen(
            self.exec_argv(ns, *argv),
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )

    def _link(
        self, a: str, a_if: str, a_ip: str, b: str, b_if: str, b_ip: str, ip6: tuple[str, str]
    ) -> None:
        sh("ip", "-n", a, "link", "add", a_if, "type", "veth", "peer", "name", b_if, "netns", b)
        sh("ip", "-n", a, "addr", "add", f"{a_ip}/24", "dev", a_if)
        sh("ip", "-n", b, "addr", "add", f"{b_ip}/24", "dev", b_if)
        if self.ipv6:
            add_ip6(a, a_if, ip6[0])
            add_ip6(b, b_if, ip6[1])
        sh("ip", "-n", a, "link", "set", a_if, "up")
        sh("ip", "-n", b, "link", "set", b_if, "up")

    def create(self) -> None:
        for ns in self.namespaces:
            sh("ip", "netns", "add", ns)
            self.created.append(ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        node, pod, backend, outside = self.node, self.pod, self.backend, self.outside
        self._link(node, "pod0", NODE_POD_SIDE, pod, "eth0", self.pod_ip, (NODE_POD_SIDE6, POD_IP6))
        self._link(
            node,
            "backend0",
            NODE_BACKEND_SIDE,
            backend,
            "eth0",
            self.backend_ip,
            (NODE_BACKEND_SIDE6, BACKEND_IP6),
        )
        self._link(
            node, "eth0", self.node_ip, outside, "eth0", self.outside_ip, (NODE_IP6, OUTSIDE_IP6)
        )
        sh("ip", "-n", pod, "route", "add", "default", "via", NODE_POD_SIDE)
        sh("ip", "-n", backend, "route", "add", "default", "via", NODE_BACKEND_SIDE)
        sh("ip", "-n", outside, "route", "add", "10.200.0.0/16", "via", self.node_ip)
        sh("ip", "-n", node, "route", "add", "default", "via", self.outside_ip)
        self.run(node, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        if self.ipv6:
            sh("ip", "-n", pod, "-6", "route", "add", "default", "via", NODE_POD_SIDE6)
            sh("ip", "-n", backend, "-6", "route", "add", "default", "via", NODE_BACKEND_SIDE6)
            sh("ip", "-n", outside, "-6", "route", "add", ULA_NET, "via", NODE_IP6)
            sh("ip", "-n", node, "-6", "route", "add", "default", "via", OUTSIDE_IP6)
            self.run(node, "sysctl", "-qw", "net.ipv6.conf.all.forwarding=1")

    def close(self) -> None:
        for ns in reversed(self.created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        self.created.clear()


def add_ip6(ns: str, dev: str, ip: str, prefix: int = 64) -> None:
    """An IPv6 address usable at once (no duplicate address detection to wait for)."""
    sh("ip", "-n", ns, "-6", "addr", "add", f"{ip}/{prefix}", "dev", dev, "nodad")


@contextmanager
def topology(*, ipv6: bool = False) -> Iterator[Topology]:
    """Create the four namespaces (dual-stack with ``ipv6``); always remove them, even when
    creation fails half-way."""
    topo = Topology(suffix=f"{os.getpid() % 100000}-{next(_counter)}", ipv6=ipv6)
    try:
        topo.create()
        yield topo
    finally:
        topo.close()
