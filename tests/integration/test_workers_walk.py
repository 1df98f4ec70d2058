"""Random walks of a services file through the whole proxy with 2 workers, checked by traffic.

A seed draws a sequence of edits to the services file the proxy reads: TCP and UDP services
added and deleted, their endpoints redrawn among four backends (none at all, now and then),
ClientIP affinity and the balancing algorithm turned on and off; at some steps a worker is
killed instead. After each step, once the control process has the file's state and both
workers have applied it, every service is tried with real traffic:

* TCP: a service with endpoints greets only with their names, all of them over 24
  connections under round-robin, one of them per client address under affinity, and echoes
  64 KiB whole (sha256); a service without endpoints never greets; a deleted service's port
  refuses;
* UDP: every datagram (up to 1,400 bytes) comes back whole from an endpoint of the service,
  all of one client socket's from one endpoint (a flow), all of one client address's under
  affinity; a service without endpoints answers nothing.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import os
import random
import signal
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import wait_for
from tests.factories import endpoint, endpoint_slice, service
from tests.integration.backends import NamedBackend, NamedDatagramEcho, greet, next_datagram
from uproxy.model import IPFamily, LbAlgorithm, Protocol, ServicePortName, Traffic
from uproxy.proxy import Proxy
from uproxy.settings import Settings
from uproxy.workers import WorkerPool

STEPS = 14
ALGORITHMS = ("round-robin", "random", "least-connections")
CLIENTS = ("127.0.0.5", "127.0.0.6")  # client addresses, for affinity


@dataclass
class Svc:
    protocol: str  # "TCP" or "UDP"
    port: int  # the service's port: the proxy listens on it (laptop mode) when it is free
    backends: tuple[str, ...]  # names, among the four
    affinity: bool = False
    algorithm: str = "round-robin"


def free_port(protocol: str) -> int:
    """A port nobody holds now: each service gets its own, so that no listener moves to a
    port another service gave up (laptop mode's proxy ports follow the services' ports)."""
    kind = socket.SOCK_STREAM if protocol == "TCP" else socket.SOCK_DGRAM
    with socket.socket(socket.AF_INET, kind) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Backend:
    """One endpoint address with a TCP greeter and a UDP echo on it."""

    tcp: NamedBackend
    udp: asyncio.DatagramTransport

    @property
    def host(self) -> str:
        return self.tcp.host

    def port(self, protocol: str) -> int:
        port: int = self.tcp.port if protocol == "TCP" else self.udp.get_extra_info("sockname")[1]
        return port


def write(path: Path, services: dict[str, Svc], backends: dict[str, Backend]) -> None:
    docs: list[dict[str, Any]] = []
    for name, svc in sorted(services.items()):
        spec: dict[str, Any] = {}
        if svc.affinity:
            spec["sessionAffinity"] = "ClientIP"
        docs.append(
            service(
                name,
                ports=[{"name": "p", "port": svc.port, "protocol": svc.protocol}],
                annotations={"uproxy.io/lb-algorithm": svc.algorithm},
                **spec,
            )
        )
        # One slice per endpoint, as a rollout leaves them now and then.
        for b in svc.backends:
            docs.append(
                endpoint_slice(
                    f"{name}-{b}",
                    name,
                    endpoints=[endpoint(backends[b].host)],
                    ports=[
                        {
                            "name": "p",
                            "port": backends[b].port(svc.protocol),
                            "protocol": svc.protocol,
                        }
                    ],
                )
            )
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump_all(docs))
    tmp.rename(path)  # the source never reads half a file


def spn(name: str, svc: Svc) -> ServicePortName:
    return ServicePortName("default", name, "p", Protocol(svc.protocol))


def applied(proxy: Proxy, services: dict[str, Svc], backends: dict[str, Backend]) -> bool:
    """The control process holds the file's state, and both workers have applied it."""
    pool = proxy.workers
    if pool is None or pool.pending() or len(pool.pids) != 2:
        return False
    if not all(w.ready.is_set() for w in pool._workers.values()):
        return False
    if set(proxy.syncer.ports) != {spn(n, svc) for n, svc in services.items()}:
        return False
    for name, svc in services.items():
        pp = proxy.syncer.ports[spn(name, svc)]
        have = sorted(e.ip for e in pp.balancer.endpoints(Traffic.CLUSTER))
        if have != sorted(backends[b].host for b in svc.backends) or pp.cluster is None:
            return False
        if (pp.port.affinity_timeout_s is not None) != svc.affinity:
            return False
        if pp.port.lb_algorithm != LbAlgorithm(svc.algorithm):
            return False
        listener = pool._listeners.get((spn(name, svc), Traffic.CLUSTER, IPFamily.V4))
        if listener is None or listener.steered != svc.affinity:
            return False
    return True


def replaced(pool: WorkerPool, victim: int) -> bool:
    return victim not in pool.pids and len(pool.pids) == 2


async def greet_from(client: str, port: int) -> str | None:
    """The greeting through the proxy, from ``client``; None when the proxy turns it away."""
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", port, local_addr=(client, 0)), 3
        )
    except ConnectionError:  # refused, or reset as soon as accepted (no endpoint)
        return None
    try:
        line = await asyncio.wait_for(reader.readline(), 3)
        return line.decode().strip() or None
    except (ConnectionError, OSError):
        return None
    finally:
        writer.close()


async def echo(port: int, size: int = 64 * 1024) -> bool:
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 3)
    try:
        await asyncio.wait_for(reader.readline(), 3)  # the greeting
        data = os.urandom(size)
        writer.write(data)
        writer.write_eof()
        got = await asyncio.wait_for(reader.read(-1), 10)
        return len(got) == size and hashlib.sha256(got).digest() == hashlib.sha256(data).digest()
    finally:
        writer.close()


async def check_udp(port: int, svc: Svc, said: str) -> None:
    for client in CLIENTS:
        answered: list[bytes] = []
        for _ in range(2):  # two sockets of one address: two flows
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                sock.setblocking(False)
                sock.bind((client, 0))
                flow: set[bytes] = set()
                for size in (1, 200, 1400):
                    data = os.urandom(size)
                    sock.sendto(data, ("127.0.0.1", port))
                    got = await next_datagram(sock, 3.0 if svc.backends else 0.3)
                    if not svc.backends:
                        assert got is None, (said, got)
                        return
                    assert got is not None, (said, client, "no reply")
                    name, _, body = got.partition(b":")
                    assert body == data, (said, client, len(body), size)
                    flow.add(name)
                assert len(flow) == 1, (said, client, flow)  # one socket, one flow
                answered += flow
        assert {n.decode() for n in answered} <= set(svc.backends), (said, client, answered)
        if svc.affinity:
            assert len(set(answered)) == 1, (said, client, answered)


async def check(proxy: Proxy, services: dict[str, Svc], gone: dict[str, int], where: str) -> None:
    taken = {pp.cluster.port for pp in proxy.syncer.ports.values() if pp.cluster is not None}
    for name, svc in sorted(services.items()):
        pp = proxy.syncer.ports[spn(name, svc)]
        assert pp.cluster is not None
        port = pp.cluster.port
        said = f"{where}: {name} {svc}"
        if svc.protocol == "UDP":
            await check_udp(port, svc, said)
            continue
        if not svc.backends:
            assert await greet_from(CLIENTS[0], port) is None, said
            continue
        for client in CLIENTS:
            names = [await greet_from(client, port) for _ in range(24)]
            assert set(names) <= set(svc.backends), (said, client, names)
            if svc.affinity:
                assert len(set(names)) == 1, (said, client, names)
            elif svc.algorithm == "round-robin":
                # Each worker goes round its own ring; one of the two took 12 or more.
                assert set(names) == set(svc.backends), (said, client, names)
        assert await echo(port), said
    for port in gone.values():
        if port not in taken:
            with pytest.raises(ConnectionRefusedError):
                await greet("127.0.0.1", port)


@pytest.fixture
async def backends() -> AsyncIterator[dict[str, Backend]]:
    loop = asyncio.get_running_loop()
    started: dict[str, Backend] = {}
    for i in range(4):
        name, host = f"b{i}", f"127.0.0.{40 + i}"
        udp, _ = await loop.create_datagram_endpoint(
            functools.partial(NamedDatagramEcho, name.encode()), local_addr=(host, 0)
        )
        started[name] = Backend(await NamedBackend(name, host).start(), udp)
    yield started
    for b in started.values():
        await b.tcp.close()
        b.udp.close()


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_every_step_serves_what_the_file_says(
    tmp_path: Path, backends: dict[str, Backend], seed: int
) -> None:
    rng = random.Random(seed)
    names = sorted(backends)
    path = tmp_path / "services.yaml"

    def draw() -> Svc:
        chosen = tuple(sorted(rng.sample(names, rng.choice([0, 1, 2, 3, 4, 4]))))
        protocol = rng.choice(["TCP", "TCP", "UDP"])
        affinity = rng.random() < 0.3
        return Svc(protocol, free_port(protocol), chosen, affinity, rng.choice(ALGORITHMS))

    services = {f"s{i}": draw() for i in range(3)}
    count = len(services)
    write(path, services, backends)
    settings = Settings(
        services=str(path),
        rules="none",
        workers=2,
        healthz_bind_address="",
        metrics_bind_address="",
        iptables_min_sync_period=0.05,
    )
    proxy = Proxy(settings)
    await proxy.start()
    done: list[str] = ["start"]
    try:
        for step in range(STEPS + 1):
            where = f"seed {seed}, step {step} after {done[-3:]}"
            await wait_for(lambda: applied(proxy, services, backends), timeout=15, message=where)
            gone: dict[str, int] = {}
            if step:
                roll = rng.random()
                pool = proxy.workers
                if roll < 0.1 and pool is not None:
                    victim = rng.choice(pool.pids)
                    os.kill(victim, signal.SIGKILL)
                    done.append(f"killed worker {victim}")
                    await wait_for(functools.partial(replaced, pool, victim), timeout=5)
                    where = f"seed {seed}, step {step} after {done[-3:]}"
                    await wait_for(
                        lambda: applied(proxy, services, backends), timeout=15, message=where
                    )
                else:
                    name = rng.choice(sorted(services))
                    if roll < 0.3 or len(services) < 2:
                        count += 1
                        services[f"s{count}"] = draw()
                        done.append(f"added s{count}")
                    elif roll < 0.45:
                        pp = proxy.syncer.ports[spn(name, services[name])]
                        assert pp.cluster is not None
                        if services[name].protocol == "TCP":
                            gone[name] = pp.cluster.port
                        del services[name]
                        done.append(f"deleted {name}")
                    elif roll < 0.7:
                        services[name].backends = draw().backends
                        done.append(f"endpoints of {name}")
                    elif roll < 0.85:
                        services[name].affinity = not services[name].affinity
                        done.append(f"affinity of {name}")
                    else:
                        services[name].algorithm = rng.choice(ALGORITHMS)
                        done.append(f"algorithm of {name}")
                    write(path, services, backends)
                    started = time.monotonic()
                    where = f"seed {seed}, step {step} after {done[-3:]}"
                    await wait_for(
                        lambda: applied(proxy, services, backends), timeout=15, message=where
                    )
                    done[-1] += f" ({time.monotonic() - started:.1f} s)"
            await check(proxy, services, gone, f"seed {seed}, step {step} after {done[-3:]}")
    finally:
        await proxy.stop()
