"""The peers: every way of getting a byte from the load generator to a backend that we compare.

Each peer forwards three ports (HTTP, iperf3, UDP echo) to the shared backends. A peer whose
program is not installed reports why and is skipped; the README names the Debian packages.
Proxies run on the proxy core; ``direct`` and ``kernel-dnat`` have no process (the kernel's work
for DNAT is done in the sending and receiving threads' context, on the load core).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from bench.backends import BackendPorts
from bench.procs import Cores, ProcessGroup, wait_listening

NGINX_STREAM_MODULE = Path("/usr/lib/nginx/modules/ngx_stream_module.so")


@dataclass(frozen=True, slots=True)
class PeerPorts:
    http: int
    iperf: int
    udp: int


@dataclass(slots=True)
class Running:
    """A started peer: where to send load, and which processes to account."""

    ports: PeerPorts
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    udp: bool = True
    cleanup: list[list[str]] = field(default_factory=list)  # commands undoing kernel state

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]


@dataclass(frozen=True, slots=True)
class Context:
    procs: ProcessGroup
    cores: Cores
    workdir: Path
    backend: BackendPorts
    in_netns: bool


class Peer:
    name = ""
    label = ""
    udp = True

    def unavailable(self, ctx: Context) -> str | None:
        """Why this peer cannot run here, or None."""
        return None

    def start(self, ctx: Context, ports: PeerPorts) -> Running:
        raise NotImplementedError

    def stop(self, ctx: Context, running: Running) -> None:
        for proc in running.procs:
            ctx.procs.stop(proc)
        for cmd in running.cleanup:
            subprocess.run(cmd, capture_output=True, timeout=10, check=False)

    def _wait(self, ctx: Context, running: Running) -> Running:
        udp = [running.ports.udp] if running.udp else []
        ok = wait_listening(
            tcp=[running.ports.http, running.ports.iperf],
            udp=udp,
            timeout_s=20.0,
            procs=running.procs,
        )
        dead = [p for p in running.procs if p.poll() is not None]
        if not ok or dead:
            tails = "; ".join(ctx.procs.log_tail(p) for p in running.procs)
            self.stop(ctx, running)
            raise RuntimeError(f"{self.name} did not start listening: {tails}")
        return running


class Direct(Peer):
    name = "direct"
    label = "direct (no proxy)"

    def start(self, ctx: Context, ports: PeerPorts) -> Running:
        b = ctx.backend
        return Running(ports=PeerPorts(http=b.http, iperf=b.iperf, udp=b.udp))


class KernelDnat(Peer):
    """One iptables DNAT rule per port in the namespace's nat OUTPUT chain: the iptables-mode
    data path (conntrack + NAT, no copy to user space)."""

    name = "kernel-dnat"
    label = "kernel DNAT (iptables)"

    def unavailable(self, ctx: Context) -> str | None:
        if not ctx.in_netns:
            return "needs root (a private network namespace for the iptables rule)"
        if shutil.which("iptables") is None:
            return "iptables is not installed (Debian package: iptables)"
        return None

    def start(self, ctx: Context, ports: PeerPorts) -> Running:
        b = ctx.backend
        running = Running(ports=ports)
        for proto, dport, to in (
            ("tcp", ports.http, b.http),
            ("tcp", ports.iperf, b.iperf),
            ("udp", ports.udp, b.udp),
        ):
            rule = ["-d", "127.0.0.1/32", "-p", proto, "--dport", str(dport), "-j", "DNAT"]
            rule += ["--to-destination", f"127.0.0.1:{to}"]
            subprocess.run(
                ["iptables", "-w", "5", "-t", "nat", "-A", "OUTPUT", *rule],
                check=True,
                capture_output=True,
                timeout=10,
            )
            running.cleanup.append(["iptables", "-w", "5", "-t", "nat", "-D", "OUTPUT", *rule])
        return running


class Uproxy(Peer):
    def __init__(self, loop: str) -> None:
        self.loop = loop
        self.name = f"uproxy-{loop}"
        self.label = f"uproxy ({loop})"

    def unavailable(self, ctx: Context) -> str | None:
        probe = subprocess.run(
            [sys.executable, "-c", "import uproxy.run"], capture_output=True, text=True, timeout=30
        )
        if probe.returncode != 0:
            last = (probe.stderr.strip().splitlines() or ["?"])[-1]
            return f"uproxy does not import: {last}"
        if self.loop == "uvloop":
            try:
                import uvloop  # noqa: F401
            except ImportError:
                return "uvloop is not installed (pip install uvloop)"
        return None

    def start(self, ctx: Context, ports: PeerPorts) -> Running:
        services = ctx.workdir / f"{self.name}-services.yaml"
        services.write_text(services_yaml(ports, ctx.backend))
        proc = ctx.procs.start(
            uproxy_argv(services=services, loop=self.loop),
            core=ctx.cores.proxy,
            name=self.name,
        )
        return self._wait(ctx, Running(ports=ports, procs=[proc]))


def uproxy_argv(*, services: Path, loop: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "uproxy.cli",
        "--services",
        str(services),
        "--rules",
        "none",
        "--bind-address",
        "127.0.0.1",
        "--healthz-bind-address",
        "",
        "--metrics-bind-address",
        "",
        "--event-loop",
        loop,
    ]


def services_yaml(ports: PeerPorts, backend: BackendPorts) -> str:
    docs = []
    for name, proto, port, target in (
        ("http", "TCP", ports.http, backend.http),
        ("iperf", "TCP", ports.iperf, backend.iperf),
        ("echo", "UDP", ports.udp, backend.udp),
    ):
        docs.append(
            f"""apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: bench}}
spec:
  ports: [{{name: p, port: {port}, protocol: {proto}}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: {name}-1
  namespace: bench
  labels: {{kubernetes.io/service-name: {name}}}
addressType: IPv4
ports: [{{name: p, port: {target}, protocol: {proto}}}]
endpoints:
  - addresses: ["127.0.0.1"]
    conditions: {{ready: true}}
"""
        )
    return "---\n".join(docs)


HAPROXY_CFG = """\
global
    nbthread 1
    maxconn 8000
defaults
    mode tcp
    timeout connect 5s
    timeout client 60s
    timeout server 60s
frontend http
    bind 127.0.0.1:{http}
    default_backend http
backend http
    server s1 127.0.0.1:{b_http}
frontend iperf
    bind 127.0.0.1:{iperf}
    default_backend iperf
backend iperf
    server s1 127.0.0.1:{b_iperf}
"""


class Haproxy(Peer):
    """HAProxy in TCP mode, one thread, default buffers (no splice: as people deploy it)."""

    name = "haproxy"
    label = "HAProxy (TCP mode)"
    udp = False

    def unavailable(self, ctx: Context) -> str | None:
        if shutil.which("haproxy") is None:
            return "haproxy is not installed (Debian package: haproxy)"
        return None

    def start(self, ctx: Context, ports: PeerPorts) -> Running:
        cfg = ctx.workdir / "haproxy.cfg"
        b = ctx.backend
        cfg.write_text(
            HAPROXY_CFG.format(http=ports.http, iperf=ports.iperf, b_http=b.http, b_iperf=b.iperf)
        )
        proc = ctx.procs.start(
            ["haproxy", "-db", "-f", str(cfg)], core=ctx.cores.proxy, name="haproxy"
        )
        return self._wait(ctx, Running(ports=ports, procs=[proc], udp=False))


NGINX_STREAM = """\
load_module {module};
worker_processes 1;
daemon off;
master_process on;
user root;
pid {dir}/stream-nginx.pid;
error_log {dir}/stream-nginx.error.log warn;
worker_rlimit_nofile 65536;
events {{ worker_connections 16384; }}
stream {{
    server {{ listen 127.0.0.1:{http} backlog=4096; proxy_pass 127.0.0.1:{b_http}; }}
    server {{ listen 127.0.0.1:{iperf}; proxy_pass 127.0.0.1:{b_iperf}; }}
    server {{
        listen 127.0.0.1:{udp} udp;
        proxy_pass 127.0.0.1:{b_udp};
        proxy_responses 1;
        proxy_timeout 10s;
    }}
}}
"""


class NginxStream(Peer):
    """nginx's stream module, one worker; UDP with one response per request."""

    name = "nginx-stream"
    label = "nginx stream"

    def unavailable(self, ctx: Context) -> str | None:
        if shutil.which("nginx") is None:
            return "nginx is not installed (Debian package: nginx-light or nginx)"
        if not NGINX_STREAM_MODULE.exists():
            return "the nginx stream module is missing (Debian package: libnginx-mod-stream)"
        return None

    def start(self, ctx: Context, ports: PeerPorts) -> Running:
        conf = ctx.workdir / "stream-nginx.conf"
        b = ctx.backend
        conf.write_text(
            NGINX_STREAM.format(
                module=NGINX_STREAM_MODULE,
                dir=ctx.workdir,
                http=ports.http,
                iperf=ports.iperf,
                udp=ports.udp,
                b_http=b.http,
                b_iperf=b.iperf,
                b_udp=b.udp,
            )
        )
        err = ctx.workdir / "stream-nginx.error.log"
        proc = ctx.procs.start(
            ["nginx", "-e", str(err), "-c", str(conf), "-p", str(ctx.workdir)],
            core=ctx.cores.proxy,
            name="nginx-stream",
        )
        return self._wait(ctx, Running(ports=ports, procs=[proc]))


class Socat(Peer):
    """socat, one process per port, forking a child per TCP connection / UDP client."""

    name = "socat"
    label = "socat (fork)"

    def unavailable(self, ctx: Context) -> str | None:
        if shutil.which("socat") is None:
            return "socat is not installed (Debian package: socat)"
        return None

    def start(self, ctx: Context, ports: PeerPorts) -> Running:
        b = ctx.backend
        running = Running(ports=ports)
        for listen, to, name in (
            (
                f"TCP4-LISTEN:{ports.http},bind=127.0.0.1,fork,reuseaddr,backlog=4096",
                f"TCP4:127.0.0.1:{b.http}",
                "socat-http",
            ),
            (
                f"TCP4-LISTEN:{ports.iperf},bind=127.0.0.1,fork,reuseaddr",
                f"TCP4:127.0.0.1:{b.iperf}",
                "socat-iperf",
            ),
            (
                f"UDP4-LISTEN:{ports.udp},bind=127.0.0.1,fork,reuseaddr",
                f"UDP4:127.0.0.1:{b.udp}",
                "socat-udp",
            ),
        ):
            running.procs.append(
                ctx.procs.start(["socat", listen, to], core=ctx.cores.proxy, name=name)
            )
        return self._wait(ctx, running)


def all_peers() -> list[Peer]:
    """In run order. Kernel DNAT goes last: its nat rule turns on conntrack in the namespace,
    which no other peer should pay for."""
    return [
        Direct(),
        Uproxy("uvloop"),
        Uproxy("asyncio"),
        Haproxy(),
        NginxStream(),
        Socat(),
        KernelDnat(),
    ]


def ports_for(index: int) -> PeerPorts:
    base = 10000 + 1000 * index
    return PeerPorts(http=base + 80, iperf=base + 201, udp=base + 900)


def is_root() -> bool:
    return os.geteuid() == 0
