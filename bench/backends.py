"""The backends every peer forwards to: nginx (HTTP), iperf3 (bulk TCP), a UDP echo.

They run on the load CPUs (the load core, or both CPUs for a peer measured at equal cores),
started afresh for each peer and the same for all, so a difference between peers is the
proxy's and nothing else's. nginx also serves a 1 MiB random blob that
the preflight check fetches through each peer and compares by sha256.
"""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.procs import Cores, Placement, ProcessGroup, wait_listening

BLOB_SIZE = 1 << 20


@dataclass(frozen=True, slots=True)
class BackendPorts:
    http: int = 8080
    iperf: int = 5201
    udp: int = 9000


@dataclass(frozen=True, slots=True)
class Backends:
    ports: BackendPorts
    blob_sha256: str
    blob_size: int


NGINX_HTTP = """\
worker_processes 1;
daemon off;
master_process on;
user root;
pid {dir}/backend-nginx.pid;
error_log {dir}/backend-nginx.error.log warn;
worker_rlimit_nofile 65536;
events {{ worker_connections 16384; }}
http {{
    access_log off;
    keepalive_requests 100000000;
    keepalive_timeout 60s;
    client_body_temp_path {dir}/nginx-tmp;
    proxy_temp_path {dir}/nginx-tmp;
    fastcgi_temp_path {dir}/nginx-tmp;
    uwsgi_temp_path {dir}/nginx-tmp;
    scgi_temp_path {dir}/nginx-tmp;
    server {{
        listen {host}:{port} backlog=4096;
        location = /blob {{ alias {dir}/blob.bin; default_type application/octet-stream; }}
        location / {{ default_type text/plain; return 200 "ok\\n"; }}
    }}
}}
"""


def start(
    procs: ProcessGroup,
    cores: Cores | Placement,
    workdir: Path,
    ports: BackendPorts,
    *,
    host: str = "127.0.0.1",
) -> Backends:
    """nginx and iperf3 on ``host``; the UDP echo on 127.0.0.1."""
    blob = os.urandom(BLOB_SIZE)
    (workdir / "blob.bin").write_bytes(blob)
    (workdir / "nginx-tmp").mkdir(exist_ok=True)
    conf = workdir / "backend-nginx.conf"
    conf.write_text(NGINX_HTTP.format(dir=workdir, host=host, port=ports.http))
    nginx = procs.start(
        [
            "nginx",
            "-e",
            str(workdir / "backend-nginx.error.log"),
            "-c",
            str(conf),
            "-p",
            str(workdir),
        ],
        core=cores.load,
        name="backend-nginx",
    )
    iperf = procs.start(
        ["iperf3", "-s", "-B", host, "-p", str(ports.iperf)],
        core=cores.load,
        name="backend-iperf3",
    )
    echo = procs.start(
        [sys.executable, "-m", "bench.udp", "echo", "--port", str(ports.udp)],
        core=cores.load,
        name="backend-udp-echo",
    )
    if not wait_listening(
        tcp=[ports.http, ports.iperf], udp=[ports.udp], timeout_s=10, procs=[nginx, iperf, echo]
    ):
        tails = "; ".join(procs.log_tail(p) for p in (nginx, iperf, echo))
        raise RuntimeError(f"backends did not start: {tails}")
    return Backends(ports=ports, blob_sha256=hashlib.sha256(blob).hexdigest(), blob_size=BLOB_SIZE)


def missing_tools() -> list[str]:
    from shutil import which

    return [t for t in ("nginx", "iperf3", "wrk", "taskset") if which(t) is None]
