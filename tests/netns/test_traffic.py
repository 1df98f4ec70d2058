"""Real bytes through the portal rules: pod, node and outside reach the proxy port."""

from __future__ import annotations

import json
import select
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tests.netns.helpers import ALL_BACKENDS, run_ops, sync_op
from tests.netns.topology import Topology
from uproxy.model import Protocol, ServicePortName
from uproxy.rules.base import Portal, PortalKind

WEB = ServicePortName("default", "web", "http", Protocol.TCP)
CLUSTER_IP = "10.96.0.10"
PROXY_PORT = 40001
NODE_PORT = 30080
PORTALS = [
    Portal(WEB, PortalKind.CLUSTER_IP, CLUSTER_IP, 80, PROXY_PORT),
    Portal(WEB, PortalKind.NODE_PORT, None, NODE_PORT, PROXY_PORT),
]


def wait_ready(proc: subprocess.Popen[str], timeout: float = 10.0) -> None:
    """Wait (bounded) for the server's ``ready`` line."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        readable, _, _ = select.select([proc.stdout], [], [], 0.1)
        if readable:
            line = proc.stdout.readline()
            assert line.strip() == "ready", line
            return
        if proc.poll() is not None:
            pytest.fail(f"echo server exited: {proc.stderr.read() if proc.stderr else ''}")
    pytest.fail("echo server did not become ready")


@contextmanager
def echo_server(topo: Topology, count: int) -> Iterator[subprocess.Popen[str]]:
    argv = topo.python_argv(topo.node, "tests.netns.echo")[4:]  # argv after "ip netns exec NS"
    args = ["serve", "--host", "0.0.0.0", "--port", str(PROXY_PORT), "--count", str(count)]
    proc = topo.popen(topo.node, [*argv, *args])
    try:
        wait_ready(proc)
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def send(topo: Topology, ns: str, host: str, port: int, seed: int) -> None:
    size = (1 << 20) + seed  # distinct sizes: a mixed-up reply cannot pass
    out = topo.run(
        ns,
        *topo.python_argv(ns, "tests.netns.echo")[4:],
        "send",
        "--host",
        host,
        "--port",
        str(port),
        "--size",
        str(size),
        "--seed",
        str(seed),
    )
    result = json.loads(out)
    assert result["echo_len"] == result["sent_len"] == size
    assert result["echo_sha256"] == result["sent_sha256"]


@pytest.mark.root
@pytest.mark.parametrize(("backend", "mode"), ALL_BACKENDS)
def test_portals_carry_traffic_to_the_proxy_port(topo: Topology, backend: str, mode: str) -> None:
    run_ops(topo, backend, mode, [sync_op(PORTALS)])
    with echo_server(topo, count=3) as server:
        send(topo, topo.pod, CLUSTER_IP, 80, seed=1)  # REDIRECT from a pod
        send(topo, topo.node, CLUSTER_IP, 80, seed=2)  # DNAT to node_ip from the node
        send(topo, topo.outside, topo.node_ip, NODE_PORT, seed=3)  # node port from outside
        server.wait(timeout=10)
        assert server.returncode == 0
