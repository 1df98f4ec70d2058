"""Fixtures of the end-to-end tests: the cluster, the backends, uproxy processes, the file."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import root_available
from tests.e2e.cluster import Cluster, cluster
from tests.e2e.harness import Proc, ServicesFile, Uproxy

StartUproxy = Callable[..., Uproxy]
StartProc = Callable[..., Proc]


DUAL_STACK = "dual-stack"  # ``@pytest.mark.parametrize("net", [DUAL_STACK], indirect=True)``


@pytest.fixture
def net(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """The cluster's namespaces; dual-stack (IPv6 in ULA space too) when parametrized so."""
    if root_available() is not None:
        pytest.fail(f"e2e fixture used without root: {root_available()}")
    with cluster(ipv6=getattr(request, "param", None) == DUAL_STACK) as created:
        yield created


@pytest.fixture
def services(tmp_path: Path) -> ServicesFile:
    f = ServicesFile(tmp_path / "services.yaml")
    f.write()
    return f


@pytest.fixture
def start_proc(net: Cluster) -> Iterator[StartProc]:
    """Start a helper process (backend servers, dnsmasq, a port holder); stopped at the end."""
    procs: list[Proc] = []

    def start(ns: str, argv: list[str], *, ready_line: bool = False) -> Proc:
        proc = Proc(net.topo, ns, argv)
        procs.append(proc)
        if ready_line:
            proc.wait_ready_line()
        return proc

    yield start
    for proc in reversed(procs):
        proc.stop()


@pytest.fixture
def start_uproxy(net: Cluster, services: ServicesFile) -> Iterator[StartUproxy]:
    """Start uproxy in a node namespace (node-a by default); always stopped at the end."""
    running: list[Uproxy] = []

    def start(rules: str, *, ns: str | None = None, **options: Any) -> Uproxy:
        proxy = Uproxy(
            net.topo, ns or net.topo.node, services=services.path, rules=rules, **options
        )
        running.append(proxy)
        return proxy

    yield start
    problems = []
    for proxy in reversed(running):
        code = proxy.stop()
        crashed = [line for line in proxy.proc.stderr_lines if "Traceback" in line]
        if code != 0 or crashed:
            problems.append(f"uproxy in {proxy.ns} exited {code}: {proxy.proc.stderr_lines}")
    if problems:
        pytest.fail("\n".join(problems))
