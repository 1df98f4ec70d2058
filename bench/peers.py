"""The peers: every way of getting a byte from the load generator to a backend that we compare.

Each peer forwards three ports (HTTP, iperf3, UDP echo) to the backends. A peer whose program
is not installed reports why and is skipped; the README names the Debian packages.

Two placements (``bench.procs.Placement``), two sets of peers:

- **pinned**: the proxy alone on one core, load generators and backends on the other. One
  thread or process of work per proxy (HAProxy ``nbthread 1``, one nginx worker, uproxy's
  control process and its one worker sharing the core). ``direct`` and ``kernel-dnat`` have
  no process: the kernel's DNAT work is done in the sending and receiving threads' context,
  on the load core.
- **shared** (equal cores, names ending in ``-2cpu``): the proxy may use both CPUs and so may
  the load generators and backends, as on a node where nothing is set aside. Each proxy runs
  as it would to use two CPUs: HAProxy ``nbthread 2``, nginx with two workers, uproxy with
  ``--workers 1`` and ``--workers 2``, and each of the last two again with every worker or
  thread bound to a CPU of its own (uproxy ``--worker-cpu-affinity auto``, HAProxy
  ``cpu-map``); HAProxy ``nbthread 1`` beside uproxy's one worker, and kernel DNAT, for
  reference.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from bench.backends import BackendPorts
from bench.procs import Cores, CpuSet, Placement, ProcessGroup, wait_listening

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
    placement: Placement | None = None  # None: pinned on ``cores``

    @property
    def where(self) -> Placement:
        return self.placement or Placement.pinned(self.cores)


class Peer:
    name = ""
    label = ""
    udp = True
    shared = False  # measured at equal cores (both CPUs for everything), else pinned
    # What the root of its process tree and the processes under it are called in the tables.
    roles = ("process", "children")

    def placement(self, cores: Cores) -> Placement:
        return Placement.shared(cores) if self.shared else Placement.pinned(cores)

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

    def __init__(self, *, shared: bool = False) -> None:
        self.shared = shared
        self.name = "kernel-dnat-2cpu" if shared else "kernel-dnat"
        self.label = "kernel DNAT (2 CPUs)" if shared else "kernel DNAT (iptables)"

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
    """uproxy in laptop mode (``--rules none``): a control process and its data-plane workers
    (one unless ``workers`` says otherwise: the default with ``--rules none``)."""

    roles = ("control", "workers")

    def __init__(
        self, loop: str, *, workers: int | None = None, shared: bool = False, bound: bool = False
    ) -> None:
        self.loop = loop
        self.workers = workers
        self.shared = shared
        self.bound = bound  # --worker-cpu-affinity auto
        if workers is None:
            self.name = f"uproxy-{loop}"
            self.label = f"uproxy ({loop})"
        else:
            self.name = f"uproxy-w{workers}" + ("-bound" if bound else "")
            self.name += "-2cpu" if shared else ""
            self.label = f"uproxy --workers {workers}" + (", bound" if bound else "")
            self.label += " (2 CPUs)" if shared else ""

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
            uproxy_argv(services=services, loop=self.loop, workers=self.workers, bound=self.bound),
            core=ctx.where.proxy,
            name=self.name,
        )
        return self._wait(ctx, Running(ports=ports, procs=[proc]))


def uproxy_argv(
    *, services: Path, loop: str, workers: int | None = None, bound: bool = False
) -> list[str]:
    extra = [] if workers is None else ["--workers", str(workers)]
    extra += ["--worker-cpu-affinity", "auto"] if bound else []
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
        *extra,
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
    nbthread {threads}
{cpu_map}    maxconn 8000
defaults
    mode tcp
    timeout connect 5s
    timeout client 60s
    timeout server 60s
frontend http
    bind {listen}:{http}
    default_backend http
backend http
    server s1 {backend}:{b_http}
frontend iperf
    bind {listen}:{iperf}
    default_backend iperf
backend iperf
    server s1 {backend}:{b_iperf}
"""


class Haproxy(Peer):
    """HAProxy in TCP mode, default buffers (no splice: as people deploy it); one thread pinned,
    ``nbthread 2`` at equal cores; ``bound``: each thread bound to one of the proxy's CPUs
    (``cpu-map``). ``shared`` with one thread: ``nbthread 1`` free to use both CPUs, the
    reference for one uproxy worker at equal cores (and for the keep-alive figures: see
    bench/README.md, "Reading the equal-cores keep-alive figures")."""

    udp = False

    def __init__(self, *, threads: int = 1, bound: bool = False, shared: bool = False) -> None:
        self.threads = threads
        self.shared = shared or threads > 1
        self.bound = bound
        one = "-t1" if self.shared and threads == 1 else ""
        self.name = "haproxy" + ("-bound" if bound else "") + one + ("-2cpu" if self.shared else "")
        self.label = (
            f"HAProxy, nbthread {threads}" + (", cpu-map" if bound else "") + " (2 CPUs)"
            if self.shared
            else "HAProxy (TCP mode)"
        )

    def unavailable(self, ctx: Context) -> str | None:
        if shutil.which("haproxy") is None:
            return "haproxy is not installed (Debian package: haproxy)"
        return None

    def start(self, ctx: Context, ports: PeerPorts) -> Running:
        cfg = ctx.workdir / "haproxy.cfg"
        b = ctx.backend
        cfg.write_text(
            HAPROXY_CFG.format(
                threads=self.threads,
                cpu_map=_cpu_map(self.threads, ctx.where.proxy) if self.bound else "",
                listen="127.0.0.1",
                backend="127.0.0.1",
                http=ports.http,
                iperf=ports.iperf,
                b_http=b.http,
                b_iperf=b.iperf,
            )
        )
        proc = ctx.procs.start(
            ["haproxy", "-db", "-f", str(cfg)], core=ctx.where.proxy, name=self.name
        )
        return self._wait(ctx, Running(ports=ports, procs=[proc], udp=False))


def _cpu_map(threads: int, cpus: CpuSet) -> str:
    """HAProxy's ``cpu-map`` line binding thread i to the i-th of ``cpus`` (in turn)."""
    listed = [cpus] if isinstance(cpus, int) else sorted(cpus)
    each = " ".join(str(listed[i % len(listed)]) for i in range(threads))
    return f"    cpu-map auto:1/1-{threads} {each}\n"


NGINX_STREAM = """\
load_module {module};
worker_processes {workers};
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
    """nginx's stream module, one worker pinned, two at equal cores; UDP with one response per
    request."""

    roles = ("master", "workers")

    def __init__(self, *, workers: int = 1) -> None:
        self.workers = workers
        self.shared = workers > 1
        self.name = "nginx-stream-2cpu" if self.shared else "nginx-stream"
        self.label = f"nginx stream, {workers} workers (2 CPUs)" if self.shared else "nginx stream"

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
                workers=self.workers,
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
            core=ctx.where.proxy,
            name=self.name,
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
                ctx.procs.start(["socat", listen, to], core=ctx.where.proxy, name=name)
            )
        return self._wait(ctx, running)


class SpliceRelay(Peer):
    """``bench.splice_relay``: blocking splice(2) in a thread per direction, for reference (the
    least a relay in user space costs here); TCP only."""

    name = "splice-relay"
    label = "splice(2) relay, reference"
    udp = False

    def start(self, ctx: Context, ports: PeerPorts) -> Running:
        b = ctx.backend
        argv = [
            sys.executable,
            "-m",
            "bench.splice_relay",
            f"{ports.http}:{b.http}",
            f"{ports.iperf}:{b.iperf}",
        ]
        proc = ctx.procs.start(argv, core=ctx.where.proxy, name=self.name)
        return self._wait(ctx, Running(ports=ports, procs=[proc], udp=False))


def all_peers() -> list[Peer]:
    """In run order: the pinned peers, then the equal-cores ones. Each runs in a namespace of
    its own; kernel DNAT still goes last in each set (its nat rule turns on conntrack, which no
    other peer should pay for when they share a namespace, as without root)."""
    return [
        Direct(),
        Uproxy("uvloop"),
        Uproxy("asyncio"),
        Haproxy(),
        NginxStream(),
        Socat(),
        SpliceRelay(),
        KernelDnat(),
        Uproxy("uvloop", workers=1, shared=True),
        Uproxy("uvloop", workers=2, shared=True),
        Haproxy(threads=1, shared=True),
        Haproxy(threads=2),
        Uproxy("uvloop", workers=2, shared=True, bound=True),
        Haproxy(threads=2, bound=True),
        NginxStream(workers=2),
        KernelDnat(shared=True),
    ]


def ports_for(index: int) -> PeerPorts:
    base = 10000 + 1000 * index
    return PeerPorts(http=base + 80, iperf=base + 201, udp=base + 900)


def is_root() -> bool:
    return os.geteuid() == 0
