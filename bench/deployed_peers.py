"""The deployed path's peers: every way a node steers a pod's connection to a ClusterIP.

Each peer is set up in the node namespace of a fresh topology (``bench.topology``) for one
number of services, and is then reached the same way, from the pod, at the same ClusterIP:

- kernel DNAT in one linear chain, as kube-proxy's iptables mode lays it out: a jump from nat
  PREROUTING to ``KUBE-SERVICES``, one ``-d CLUSTER-IP -p tcp --dport PORT -j DNAT`` rule per
  service (kube-proxy goes on through KUBE-SVC-/KUBE-SEP- chains; with one endpoint per
  service that is the same match work for a new connection and one DNAT). Written with
  ``iptables-nft-restore`` (the reference of every ratio) and ``iptables-legacy-restore``.
- kernel DNAT through an nft map, as kube-proxy's nftables mode does: one rule, ``dnat ip to
  ip daddr . tcp dport map @services``, whatever the number of services.
- uproxy with ``--rules iptables-restore`` (nft and legacy) and ``--rules nftables``: the
  process a node runs, from a ``--services`` file of the same Services and EndpointSlices.
- HAProxy (TCP mode, one thread, pinned where uproxy is) behind the nft map, which DNATs the
  measured services to it: what any userspace proxy on this path costs (two more socket hops
  and two wake-ups of a process per request), the floor for uproxy's latency ratios.

The measured service sorts last wherever order matters: the last rule of the linear chain,
and for uproxy's iptables portals (sorted by namespace/name/port) the name ``zz-target``. Every
HTTP service points at the same nginx; one more service (``zz-bulk``, just before the target)
points at iperf3.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from bench.backends import BackendPorts
from bench.peers import HAPROXY_CFG
from bench.procs import Cores, ProcessGroup
from bench.topology import NODE_POD_SIDE_IP

NAMESPACE = "bench"
HTTP_PORT = 80
PROXY_PORT_RANGE = "20000-39999"  # room for 10,000s of listeners, apart from uproxy's dials
METRICS_URL = "http://127.0.0.1:10249/metrics"


@dataclass(frozen=True, slots=True)
class Service:
    name: str
    ip: str
    port: int
    target_port: int


@dataclass(frozen=True, slots=True)
class ServiceSet:
    """``count`` HTTP services (fillers, then the target last) plus the iperf3 service."""

    count: int
    backend_ip: str
    backend: BackendPorts

    @property
    def target(self) -> Service:
        return Service("zz-target", "10.96.255.10", HTTP_PORT, self.backend.http)

    @property
    def bulk(self) -> Service:
        return Service("zz-bulk", "10.96.255.20", self.backend.iperf, self.backend.iperf)

    def in_rule_order(self) -> Iterator[Service]:
        for i in range(self.count - 1):
            ip = f"10.96.{i // 250}.{i % 250 + 1}"
            yield Service(f"svc-{i:05d}", ip, HTTP_PORT, self.backend.http)
        yield self.bulk
        yield self.target

    def yaml(self) -> str:
        """The Services and EndpointSlices a ``--services`` file holds (what kubectl accepts)."""
        docs = []
        for s in self.in_rule_order():
            docs.append(
                f"""apiVersion: v1
kind: Service
metadata: {{name: {s.name}, namespace: {NAMESPACE}}}
spec:
  type: ClusterIP
  clusterIP: {s.ip}
  clusterIPs: [{s.ip}]
  ports: [{{name: p, port: {s.port}, protocol: TCP, targetPort: {s.target_port}}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: {s.name}-1
  namespace: {NAMESPACE}
  labels: {{kubernetes.io/service-name: {s.name}}}
addressType: IPv4
ports: [{{name: p, port: {s.target_port}, protocol: TCP}}]
endpoints:
  - addresses: ["{self.backend_ip}"]
    conditions: {{ready: true}}
"""
            )
        return "---\n".join(docs)

    def iptables_chain(self) -> str:
        """``iptables-restore --noflush`` input: one linear chain of DNAT rules."""
        lines = ["*nat", ":KUBE-SERVICES - [0:0]", "-A PREROUTING -j KUBE-SERVICES"]
        for s in self.in_rule_order():
            lines.append(
                f"-A KUBE-SERVICES -d {s.ip}/32 -p tcp -m comment --comment "
                f'"{NAMESPACE}/{s.name}:p cluster IP" -m tcp --dport {s.port} '
                f"-j DNAT --to-destination {self.backend_ip}:{s.target_port}"
            )
        lines.append("COMMIT")
        return "\n".join(lines) + "\n"

    def nft_map(self, to: Mapping[str, tuple[str, int]] | None = None) -> str:
        """``nft -f`` input: one DNAT rule looking the destination up in a map; ``to``: the
        services (by name) sent to another address and port than their endpoint."""
        to = to or {}

        def dest(s: Service) -> str:
            ip, port = to.get(s.name, (self.backend_ip, s.target_port))
            return f"{ip} . {port}"

        elements = ",\n".join(f"      {s.ip} . {s.port} : {dest(s)}" for s in self.in_rule_order())
        return f"""table ip bench-services {{
  map services {{
    type ipv4_addr . inet_service : ipv4_addr . inet_service
    elements = {{
{elements}
    }}
  }}
  chain prerouting {{
    type nat hook prerouting priority dstnat; policy accept;
    dnat ip to ip daddr . tcp dport map @services
  }}
}}
"""


@dataclass(frozen=True, slots=True)
class NodeEnv:
    """What a peer needs to set itself up (it is called inside the node namespace)."""

    procs: ProcessGroup
    cores: Cores
    workdir: Path
    services: ServiceSet


class StartFailed(RuntimeError):
    """The peer's process exited while starting (for a peer that may be skipped for it)."""


class NodePeer:
    name = ""
    label = ""
    is_uproxy = False
    # uproxy --rules nftables is being built: until it exists, a failed start is a skip.
    skip_when_start_fails = False
    # Measured at the smallest number of services only: what the peer shows does not depend
    # on the number of services (busy polling), and each scale costs a setup per round.
    smallest_scale_only = False

    def unavailable(self) -> str | None:
        return None

    def start(self, env: NodeEnv) -> list[subprocess.Popen[bytes]]:
        """Install the peer's rules / start its process; the processes to account."""
        raise NotImplementedError


def _load(argv: list[str], payload: str, what: str) -> None:
    done = subprocess.run(argv, input=payload, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"{what}: {done.stderr.strip()[:300]}")


class KernelChain(NodePeer):
    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.name = f"kernel-chain-{mode}"
        self.label = f"kernel DNAT, linear chain (iptables-{mode})"

    def unavailable(self) -> str | None:
        if shutil.which(f"iptables-{self.mode}-restore") is None:
            return f"iptables-{self.mode}-restore is not installed (Debian package: iptables)"
        return None

    def start(self, env: NodeEnv) -> list[subprocess.Popen[bytes]]:
        argv = [f"iptables-{self.mode}-restore", "--noflush", "-w", "5"]
        _load(argv, env.services.iptables_chain(), f"iptables-{self.mode}-restore")
        return []


class KernelMap(NodePeer):
    name = "kernel-map-nft"
    label = "kernel DNAT, nft map"

    def unavailable(self) -> str | None:
        if shutil.which("nft") is None:
            return "nft is not installed (Debian package: nftables)"
        return None

    def start(self, env: NodeEnv) -> list[subprocess.Popen[bytes]]:
        _load(["nft", "-f", "-"], env.services.nft_map(), "nft -f")
        return []


HAPROXY_PORTS = (19080, 19081)  # on the node, outside uproxy's proxy-port range


# What the busy-polling peers poll for: uproxy's window after each event (HAProxy's
# "busy-polling" has none: it never sleeps). Longer than the gaps of the keep-alive run, whose
# connections each wait 1 ms between requests: with a window of 1 ms, one that ended just
# before the next request put a wake-up back into some (p99 0.088-0.416 ms over 3 rounds,
# max 0.6-0.7, against 0.078-0.086 and 0.14-0.32 with 5 ms in a rig of the same path).
BUSY_POLL = "5ms"


class HaproxyNode(NodePeer):
    def __init__(self, *, busy_polling: bool = False) -> None:
        self.busy_polling = busy_polling
        self.smallest_scale_only = busy_polling
        self.name = "haproxy-map-busypoll" if busy_polling else "haproxy-map"
        self.label = "HAProxy (TCP mode" + (", busy-polling" if busy_polling else "")
        self.label += ") behind an nft map"

    def unavailable(self) -> str | None:
        for tool, package in (("haproxy", "haproxy"), ("nft", "nftables")):
            if shutil.which(tool) is None:
                return f"{tool} is not installed (Debian package: {package})"
        return None

    def start(self, env: NodeEnv) -> list[subprocess.Popen[bytes]]:
        svc = env.services
        http, iperf = HAPROXY_PORTS
        cfg = env.workdir / "haproxy-node.cfg"
        text = HAPROXY_CFG.format(
            threads=1,
            cpu_map="",
            listen=NODE_POD_SIDE_IP,
            http=http,
            iperf=iperf,
            backend=svc.backend_ip,
            b_http=svc.target.target_port,
            b_iperf=svc.bulk.target_port,
        )
        if self.busy_polling:
            text = text.replace("global\n", "global\n    busy-polling\n", 1)
        cfg.write_text(text)
        proc = env.procs.start(
            ["haproxy", "-db", "-f", str(cfg)], core=env.cores.proxy, name=self.name
        )
        to = {svc.target.name: (NODE_POD_SIDE_IP, http), svc.bulk.name: (NODE_POD_SIDE_IP, iperf)}
        _load(["nft", "-f", "-"], svc.nft_map(to), "nft -f")
        return [proc]


class UproxyNode(NodePeer):
    is_uproxy = True

    def __init__(self, rules: str, mode: str | None = None, *, busy_poll: bool = False) -> None:
        self.rules = rules
        self.mode = mode
        self.busy_poll = busy_poll
        self.smallest_scale_only = busy_poll
        self.name = f"uproxy-iptables-{mode}" if rules == "iptables-restore" else f"uproxy-{rules}"
        self.label = f"uproxy --rules {rules}" + (f" ({mode})" if mode else "")
        if busy_poll:
            self.name += "-busypoll"
            self.label += f" --busy-poll {BUSY_POLL}"
        self.skip_when_start_fails = rules == "nftables"

    def unavailable(self) -> str | None:
        probe = subprocess.run(
            [sys.executable, "-c", "import uproxy.run"], capture_output=True, text=True, timeout=30
        )
        if probe.returncode != 0:
            last = (probe.stderr.strip().splitlines() or ["?"])[-1]
            return f"uproxy does not import: {last}"
        need = f"iptables-{self.mode}-restore" if self.mode else "nft"
        if shutil.which(need) is None:
            return f"{need} is not installed"
        return None

    def argv(self, services: Path) -> list[str]:
        argv = [sys.executable, "-m", "uproxy.cli", "--services", str(services)]
        argv += ["--rules", self.rules, "--proxy-port-range", PROXY_PORT_RANGE]
        argv += ["--hostname-override", "bench-node"]
        if self.mode:
            argv += ["--iptables-mode", self.mode]
        if self.busy_poll:
            argv += ["--busy-poll", BUSY_POLL]
        return argv

    def start(self, env: NodeEnv) -> list[subprocess.Popen[bytes]]:
        path = env.workdir / f"services-{env.services.count}.yaml"
        if not path.exists():
            path.write_text(env.services.yaml())
        proc = env.procs.start(self.argv(path), core=env.cores.proxy, name=self.name)
        return [proc]


def all_peers() -> list[NodePeer]:
    """The reference (kernel DNAT in a linear iptables-nft chain) first."""
    return [
        KernelChain("nft"),
        KernelChain("legacy"),
        KernelMap(),
        UproxyNode("iptables-restore", "nft"),
        UproxyNode("iptables-restore", "legacy"),
        UproxyNode("nftables"),
        HaproxyNode(),
        UproxyNode("nftables", busy_poll=True),
        HaproxyNode(busy_polling=True),
    ]


REFERENCE = "kernel-chain-nft"
