"""Laptop mode end to end: a services file, real listeners on loopback, live reloads."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import os
import socket
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import wait_for
from tests.factories import endpoint, endpoint_slice, service
from tests.integration.backends import NamedBackend, NamedDatagramEcho, greet, next_datagram
from uproxy import syncer as syncer_module
from uproxy.dataplane import sockets
from uproxy.dataplane.tcp import TcpListener
from uproxy.model import Protocol, ServicePortName
from uproxy.proxy import Proxy
from uproxy.rules import NoRules, RulesError
from uproxy.settings import Settings

WEB = ServicePortName("default", "web", "http", Protocol.TCP)
DNS = ServicePortName("default", "dns", "dns", Protocol.UDP)


def write_services(path: Path, backends: list[NamedBackend], *, svc_port: int = 0) -> None:
    # All backends share one port number per slice, so each gets its own loopback IP.
    docs = [service(ports=[{"name": "http", "port": svc_port or 1, "protocol": "TCP"}])]
    for i, b in enumerate(backends):
        docs.append(
            endpoint_slice(
                f"web-{i}",
                endpoints=[endpoint(b.host)],
                ports=[{"name": "http", "port": b.port, "protocol": "TCP"}],
            )
        )
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump_all(docs))
    os.replace(tmp, path)  # atomic, as editors save


@pytest.fixture
async def backends() -> AsyncIterator[list[NamedBackend]]:
    started = [await NamedBackend(f"b{i}", f"127.0.0.{20 + i}").start() for i in range(1, 5)]
    yield started
    for b in started:
        await b.close()


@pytest.fixture
async def proxy_for(tmp_path: Path) -> AsyncIterator[Proxy]:
    path = tmp_path / "services.yaml"
    settings = Settings(
        services=str(path),
        rules="none",
        healthz_bind_address="",
        metrics_bind_address="",
        iptables_min_sync_period=0.05,
    )
    proxy = Proxy(settings)
    yield proxy
    await proxy.stop()


async def test_reload_moves_new_connections_and_keeps_established_ones(
    tmp_path: Path, backends: list[NamedBackend], proxy_for: Proxy, caplog: pytest.LogCaptureFixture
) -> None:
    path = Path(proxy_for.settings.services or "")
    write_services(path, backends[:2])
    await proxy_for.start()
    await asyncio.wait_for(proxy_for.synced.wait(), 5)
    assert proxy_for.syncer is not None
    listener = proxy_for.syncer.ports[WEB].cluster
    assert listener is not None
    port = listener.port
    names = {await greet("127.0.0.1", port) for _ in range(4)}
    assert names == {"b1", "b2"}

    # An established connection, mid-stream, while the file changes.
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    first = (await reader.readline()).decode().strip()
    assert first in {"b1", "b2"}

    write_services(path, backends[2:])
    loop = asyncio.get_running_loop()
    changed_at = loop.time()

    async def moved() -> bool:
        return await greet("127.0.0.1", port) in {"b3", "b4"}

    await wait_for(moved, timeout=2.0, message="new connections on the new endpoints")
    assert loop.time() - changed_at < 2.0
    assert {await greet("127.0.0.1", port) for _ in range(4)} == {"b3", "b4"}
    # Same listener, no churn; the old connection still relays, every byte checked.
    assert proxy_for.syncer.ports[WEB].cluster is listener
    payload = os.urandom(1 << 20)
    writer.write(payload)
    await writer.drain()
    echoed = await asyncio.wait_for(reader.readexactly(len(payload)), 10)
    assert hashlib.sha256(echoed).digest() == hashlib.sha256(payload).digest()
    writer.close()

    # A broken edit: one line naming the field, the last good state keeps serving.
    with caplog.at_level(logging.ERROR, logger="uproxy"):
        path.write_text(path.read_text().replace("port: 1\n", "port: 0\n", 1))
        await wait_for(
            lambda: any(r.levelno == logging.ERROR for r in caplog.records),
            timeout=3,
            message="the error line",
        )
        await asyncio.sleep(0.6)  # a further poll must not log again
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "spec.ports[0].port" in str(errors[0].kv)  # type: ignore[attr-defined]
    assert await greet("127.0.0.1", port) in {"b3", "b4"}


async def test_laptop_listens_on_the_service_port_when_free(
    tmp_path: Path, backends: list[NamedBackend], proxy_for: Proxy, unused_tcp_port: int
) -> None:
    path = Path(proxy_for.settings.services or "")
    write_services(path, backends[:1], svc_port=unused_tcp_port)
    await proxy_for.start()
    await asyncio.wait_for(proxy_for.synced.wait(), 5)
    assert proxy_for.syncer is not None
    lst = proxy_for.syncer.ports[WEB].cluster
    assert lst is not None and lst.port == unused_tcp_port and lst.host == "127.0.0.1"
    assert await greet("127.0.0.1", unused_tcp_port) == "b1"
    rows = proxy_for.syncer.table()
    assert rows[0].service == "default/web:http" and str(unused_tcp_port) in rows[0].listen


@pytest.mark.parametrize("reuse_port", [False, True], ids=["plain", "reuseport-group"])
async def test_service_port_taken_falls_back_to_an_os_port(
    tmp_path: Path, backends: list[NamedBackend], proxy_for: Proxy, reuse_port: bool
) -> None:
    # A SO_REUSEPORT holder (another uproxy) too: joining its group would split the traffic.
    blocker = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0, reuse_port=reuse_port)
    taken = blocker.sockets[0].getsockname()[1]
    try:
        path = Path(proxy_for.settings.services or "")
        write_services(path, backends[:1], svc_port=taken)
        await proxy_for.start()
        await asyncio.wait_for(proxy_for.synced.wait(), 5)
        assert proxy_for.syncer is not None
        lst = proxy_for.syncer.ports[WEB].cluster
        assert lst is not None and lst.port != taken
        assert await greet("127.0.0.1", lst.port) == "b1"
    finally:
        blocker.close()
    await blocker.wait_closed()
    # Freed: the listener moves to the service's port at a retry, not at the periodic sync.
    syncer = proxy_for.syncer
    assert syncer is not None and syncer.options.settings.iptables_sync_period >= 30
    await wait_for(
        lambda: (c := syncer.ports[WEB].cluster) is not None and c.port == taken, timeout=5
    )
    assert await greet("127.0.0.1", taken) == "b1"


async def test_a_udp_service_port_still_held_at_a_retry_stays_elsewhere_then_moves_home(
    tmp_path: Path, proxy_for: Proxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The service's UDP port is held by another program through the first retry: the
    listener stays on its own port (and serves); freed, the listener moves home."""
    checks: list[bool] = []

    def counted(protocol: Protocol, host: str, port: int) -> bool:
        checks.append(free := sockets.port_free(protocol, host, port))
        return free

    monkeypatch.setattr(syncer_module, "port_free", counted)
    loop = asyncio.get_running_loop()
    echo, _ = await loop.create_datagram_endpoint(
        functools.partial(NamedDatagramEcho, b"u1"), local_addr=("127.0.0.1", 0)
    )
    holder = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    holder.bind(("127.0.0.1", 0))
    held = holder.getsockname()[1]
    client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    client.setblocking(False)
    try:
        docs = [
            service("dns", ports=[{"name": "dns", "port": held, "protocol": "UDP"}]),
            endpoint_slice(
                "dns-0",
                "dns",
                endpoints=[endpoint("127.0.0.1")],
                ports=[
                    {"name": "dns", "port": echo.get_extra_info("sockname")[1], "protocol": "UDP"}
                ],
            ),
        ]
        path = Path(proxy_for.settings.services or "")
        path.write_text(yaml.safe_dump_all(docs))
        await proxy_for.start()
        await asyncio.wait_for(proxy_for.synced.wait(), 5)
        syncer = proxy_for.syncer
        elsewhere = syncer.ports[DNS].cluster
        assert elsewhere is not None and elsewhere.port != held
        await wait_for(lambda: len(checks) >= 1, timeout=5, message="a retry")
        assert checks == [False]  # still held: it stays
        assert syncer.ports[DNS].cluster is elsewhere
        client.sendto(b"q1", ("127.0.0.1", elsewhere.port))
        assert await next_datagram(client, 5) == b"u1:q1"
        holder.close()
        await wait_for(
            lambda: (c := syncer.ports[DNS].cluster) is not None and c.port == held,
            timeout=10,
            message="the listener on the service's port",
        )
        assert checks[-1] is True
        client.sendto(b"q2", ("127.0.0.1", held))
        assert await next_datagram(client, 5) == b"u1:q2"
    finally:
        holder.close()
        client.close()
        echo.close()


def two_services(path: Path, ports: dict[str, int], backends: list[NamedBackend]) -> None:
    """Services ``a`` and ``b`` on the given ports, one backend each."""
    docs = []
    for (name, port), b in zip(sorted(ports.items()), backends, strict=False):
        docs.append(service(name, ports=[{"name": "http", "port": port, "protocol": "TCP"}]))
        docs.append(
            endpoint_slice(
                f"{name}-0",
                name,
                endpoints=[endpoint(b.host)],
                ports=[{"name": "http", "port": b.port, "protocol": "TCP"}],
            )
        )
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump_all(docs))
    os.replace(tmp, path)


async def test_one_save_that_swaps_two_services_ports_ends_on_both(
    tmp_path: Path, backends: list[NamedBackend], proxy_for: Proxy, unused_tcp_port_factory: Any
) -> None:
    p, q = unused_tcp_port_factory(), unused_tcp_port_factory()
    path = Path(proxy_for.settings.services or "")
    two_services(path, {"a": p, "b": q}, backends)
    await proxy_for.start()
    await asyncio.wait_for(proxy_for.synced.wait(), 5)
    assert (await greet("127.0.0.1", p), await greet("127.0.0.1", q)) == ("b1", "b2")
    two_services(path, {"a": q, "b": p}, backends)  # a takes b's port, b takes a's
    syncer = proxy_for.syncer
    assert syncer is not None
    a = ServicePortName("default", "a", "http", Protocol.TCP)
    b = ServicePortName("default", "b", "http", Protocol.TCP)

    def home() -> bool:
        la, lb = syncer.ports[a].cluster, syncer.ports[b].cluster
        return la is not None and lb is not None and (la.port, lb.port) == (q, p)

    await wait_for(home, timeout=5)
    assert (await greet("127.0.0.1", q), await greet("127.0.0.1", p)) == ("b1", "b2")


class CleanupRecorder(NoRules):
    """A rules backend that records its clean-ups (and can fail them)."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.cleanups = 0
        self.fail = fail

    async def cleanup(self) -> None:
        self.cleanups += 1
        if self.fail:
            raise RulesError("iptables-nft-save: permission denied")


async def synced_with_cleanup_on_exit(tmp_path: Path, rules: CleanupRecorder) -> Proxy:
    """A proxy of no services with ``--cleanup-on-exit`` and ``rules``, started and synced."""
    path = tmp_path / "services.yaml"
    path.write_text("")
    settings = Settings(
        services=str(path), rules="none", cleanup_on_exit=True, workers=0,
        healthz_bind_address="", metrics_bind_address="",
    )  # fmt: skip
    proxy = Proxy(settings, rules=rules)
    await proxy.start()
    await asyncio.wait_for(proxy.synced.wait(), 5)
    return proxy


@pytest.mark.parametrize("why", [None, "the content of --config f changed"])
async def test_cleanup_on_exit_is_for_a_normal_stop_only(tmp_path: Path, why: str | None) -> None:
    # A stop for a changed --config (or a failure) is a restart: the rules must stay.
    rules = CleanupRecorder()
    proxy = await synced_with_cleanup_on_exit(tmp_path, rules)
    proxy.failure = why
    await proxy.stop()
    assert rules.cleanups == (1 if why is None else 0)


async def test_a_failing_cleanup_on_exit_is_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    proxy = await synced_with_cleanup_on_exit(tmp_path, CleanupRecorder(fail=True))
    with caplog.at_level(logging.ERROR, logger="uproxy"):
        await proxy.stop()  # does not raise
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert said == ["Cannot remove the rules on exit"]


async def test_a_task_that_outlives_its_cancellation_does_not_hold_the_stop(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stop cancels every task and waits for them a bounded time: one that goes on (as
    the sync loop did when Python 3.11's wait_for lost a cancellation) is named in one
    error line, and the stop goes on to drain and return."""
    from uproxy import proxy as proxy_module

    monkeypatch.setattr(proxy_module, "TASKS_END_S", 0.3)
    proxy = await synced_with_cleanup_on_exit(tmp_path, CleanupRecorder())
    released = asyncio.Event()

    async def stubborn() -> None:
        while not released.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await released.wait()

    proxy._spawn("stubborn", stubborn())
    await asyncio.sleep(0)
    with caplog.at_level(logging.ERROR, logger="uproxy"):
        await asyncio.wait_for(proxy.stop(), 10)
    said = [(r.getMessage(), r.kv) for r in caplog.records if r.levelno >= logging.ERROR]  # type: ignore[attr-defined]
    assert said == [("A task did not end when cancelled", {"task": "stubborn"})]
    released.set()


async def test_healthz_says_503_while_uproxy_drains(
    tmp_path: Path, backends: list[NamedBackend], unused_tcp_port_factory: Any
) -> None:
    # A held connection keeps the drain going; meanwhile load balancers must be told.
    path = tmp_path / "services.yaml"
    healthz = unused_tcp_port_factory()
    write_services(path, backends[:1], svc_port=unused_tcp_port_factory())
    settings = Settings(
        services=str(path), rules="none", healthz_bind_address=f"127.0.0.1:{healthz}",
        metrics_bind_address="",
    )  # fmt: skip
    proxy = Proxy(settings)
    await proxy.start()
    await asyncio.wait_for(proxy.synced.wait(), 5)
    assert proxy.syncer is not None
    lst = proxy.syncer.ports[WEB].cluster
    assert lst is not None
    _, writer = await asyncio.open_connection("127.0.0.1", lst.port)  # held open

    async def status() -> int:
        reader, w = await asyncio.open_connection("127.0.0.1", healthz)
        w.write(b"GET /healthz HTTP/1.0\r\n\r\n")
        line = await reader.readline()
        w.close()
        return int(line.split()[1])

    assert await status() == 200
    stopping = asyncio.create_task(proxy.stop())
    try:
        seen: list[int] = []

        async def told() -> bool:
            with contextlib.suppress(OSError):
                seen.append(await status())
            return bool(seen) and seen[-1] == 503

        await wait_for(told, timeout=2)
        assert not stopping.done()  # still draining the held connection
    finally:
        writer.close()
        await stopping


@pytest.mark.parametrize("what", ["a directory", "not YAML"])
def test_a_services_file_that_cannot_be_read_at_start_is_one_line(
    tmp_path: Path, what: str
) -> None:
    path = tmp_path / "services.yaml"
    if what == "a directory":  # told apart with the flags, before anything starts
        path.mkdir()
        said, status = f"--services: a directory, not a file: {path}", 2
    else:
        path.write_text("kind: Service\n  spec: [\n")
        said = f"cannot use --services file: {path}: line 2 column 7: not valid YAML"
        status = 1
    argv = [sys.executable, "-m", "uproxy.cli", "--services", str(path), "--rules", "none"]
    argv += ["--healthz-bind-address", "", "--metrics-bind-address", ""]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == status
    last = done.stderr.splitlines()[-1]
    assert last.startswith(f"uproxy: error: {said}"), done.stderr
    assert "Traceback" not in done.stderr


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def test_a_closed_stdout_ends_the_table_and_not_the_syncs(
    tmp_path: Path, backends: list[NamedBackend]
) -> None:
    # `uproxy ... | head -1`: the table's reader is gone after the first lines. Each later
    # table would fail its sync (EPIPE) halfway; instead the table stops with one line and
    # every change still applies.
    path = tmp_path / "services.yaml"
    first, second = free_tcp_port(), free_tcp_port()
    write_services(path, backends[:1], svc_port=first)
    err = tmp_path / "stderr.log"
    argv = [sys.executable, "-m", "uproxy.cli", "--services", str(path), "--rules", "none"]
    argv += ["--healthz-bind-address", "", "--metrics-bind-address", ""]
    argv += ["--iptables-min-sync-period", "50ms"]
    read_end, write_end = os.pipe()
    with err.open("wb") as err_file:
        proc = await asyncio.create_subprocess_exec(*argv, stdout=write_end, stderr=err_file)
    os.close(write_end)
    try:
        with os.fdopen(read_end, "rb") as table:
            assert table.readline().startswith(b"SERVICE")  # the first table, then gone
        assert await greet("127.0.0.1", first) == "b1"
        for n, port in enumerate((second, first)):
            write_services(path, backends[n : n + 1], svc_port=port)
            want = f"b{n + 1}"

            async def moved(port: int = port, want: str = want) -> bool:
                with contextlib.suppress(OSError, asyncio.TimeoutError):
                    return await greet("127.0.0.1", port, timeout=0.5) == want
                return False

            await wait_for(moved, timeout=10, message=f"port {port} serving {want}")
        proc.terminate()
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    said = err.read_text()
    assert said.count("Cannot print the service table any more") == 1, said
    assert "Sync failed" not in said and "Traceback" not in said and "Exception" not in said


async def test_a_drain_serves_new_connections_and_datagrams_then_resets_what_is_left(
    tmp_path: Path,
    backends: list[NamedBackend],
    unused_tcp_port_factory: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # In-process relaying (--workers 0). The rules still lead to the proxy ports while it
    # drains, and a node's pods have no other way: a held connection must not make every
    # new one refused (or a service's datagrams dropped) for the drain's length. What is
    # still open at the deadline is reset and counted.
    loop = asyncio.get_running_loop()
    echo, _ = await loop.create_datagram_endpoint(
        functools.partial(NamedDatagramEcho, b"u1"), local_addr=("127.0.0.1", 0)
    )
    web_port, dns_port = unused_tcp_port_factory(), unused_tcp_port_factory()
    b = backends[0]
    docs = [
        service("web", ports=[{"name": "http", "port": web_port, "protocol": "TCP"}]),
        endpoint_slice(
            "web-0",
            "web",
            endpoints=[endpoint(b.host)],
            ports=[{"name": "http", "port": b.port, "protocol": "TCP"}],
        ),
        service("dns", ports=[{"name": "dns", "port": dns_port, "protocol": "UDP"}]),
        endpoint_slice(
            "dns-0",
            "dns",
            endpoints=[endpoint("127.0.0.1")],
            ports=[{"name": "dns", "port": echo.get_extra_info("sockname")[1], "protocol": "UDP"}],
        ),
    ]
    path = tmp_path / "services.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    settings = Settings(
        services=str(path), rules="none", workers=0, drain_timeout=1.5,
        healthz_bind_address="", metrics_bind_address="",
    )  # fmt: skip
    proxy = Proxy(settings)
    client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    client.setblocking(False)
    writers: list[asyncio.StreamWriter] = []
    try:
        await proxy.start()
        await asyncio.wait_for(proxy.synced.wait(), 5)
        reader, writer = await asyncio.open_connection("127.0.0.1", web_port)
        writers.append(writer)
        assert await asyncio.wait_for(reader.readline(), 3) == b"b1\n"  # relaying, held open
        caplog.set_level(logging.WARNING, logger="uproxy")
        lst = proxy.syncer.ports[WEB].cluster
        assert isinstance(lst, TcpListener)
        stopping = asyncio.create_task(proxy.stop())
        await wait_for(lambda: lst.draining, timeout=5)
        assert not stopping.done()
        # A new connection while it drains: accepted and relayed, both ways.
        late_reader, late_writer = await asyncio.open_connection("127.0.0.1", web_port)
        writers.append(late_writer)
        assert await asyncio.wait_for(late_reader.readline(), 3) == b"b1\n"
        late_writer.write(b"still served\n")
        assert await asyncio.wait_for(late_reader.readline(), 3) == b"still served\n"
        client.sendto(b"q", ("127.0.0.1", dns_port))  # and the UDP service answers
        assert await next_datagram(client, 3) == b"u1:q"
        await asyncio.wait_for(stopping, 5)
        for r in (reader, late_reader):  # past the deadline: a reset, not a clean end
            with pytest.raises(ConnectionResetError):
                await asyncio.wait_for(r.read(16), 3)
    finally:
        for w in writers:
            w.close()
        client.close()
        echo.close()
        await proxy.stop()
    said = [r for r in caplog.records if "at the drain deadline" in r.getMessage()]
    assert [r.__dict__["kv"] for r in said] == [{"connections": 2, "drain_timeout_s": 1.5}]


async def draining_setup(
    tmp_path: Path, backend: NamedBackend, port: int, drain_timeout: float
) -> tuple[Proxy, asyncio.StreamReader, asyncio.StreamWriter]:
    """An in-process proxy (--workers 0) of one web service on ``port``, and a connection
    through it that is relaying and held open (to keep a stop's drain going)."""
    path = tmp_path / "services.yaml"
    write_services(path, [backend], svc_port=port)
    settings = Settings(
        services=str(path), rules="none", workers=0, drain_timeout=drain_timeout,
        healthz_bind_address="", metrics_bind_address="",
    )  # fmt: skip
    proxy = Proxy(settings)
    await proxy.start()
    await asyncio.wait_for(proxy.synced.wait(), 5)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    assert await asyncio.wait_for(reader.readline(), 3) == backend.name.encode() + b"\n"
    return proxy, reader, writer


async def test_a_drain_ends_at_the_first_moment_no_connection_is_open(
    tmp_path: Path, backends: list[NamedBackend], unused_tcp_port: int
) -> None:
    proxy, _, writer = await draining_setup(tmp_path, backends[0], unused_tcp_port, 30)
    lst = proxy.syncer.ports[WEB].cluster
    assert isinstance(lst, TcpListener)
    stopping = asyncio.create_task(proxy.stop())
    await wait_for(lambda: lst.draining, timeout=5)
    assert not stopping.done()  # draining the held connection
    writer.close()  # its end ends the drain, long before the 30 s deadline
    await asyncio.wait_for(stopping, 5)
    with pytest.raises(OSError):  # and the port is closed
        await asyncio.wait_for(asyncio.open_connection("127.0.0.1", unused_tcp_port), 3)


@pytest.mark.parametrize("workers", [0, 2], ids=["in-process", "2-workers"])
async def test_a_connection_held_on_one_service_keeps_every_service_accepting(
    tmp_path: Path,
    backends: list[NamedBackend],
    unused_tcp_port_factory: Any,
    workers: int,
) -> None:
    """A node's one long-lived connection (a database, a watch) kept only its own port
    accepting through a stop: every other service's port closed at once, and its new
    connections were refused for the whole drain."""
    web_port, api_port = unused_tcp_port_factory(), unused_tcp_port_factory()
    path = tmp_path / "services.yaml"
    two_services(path, {"api": api_port, "web": web_port}, backends)  # api: b1, web: b2
    settings = Settings(
        services=str(path), rules="none", workers=workers, drain_timeout=3.0,
        healthz_bind_address="", metrics_bind_address="",
    )  # fmt: skip
    proxy = Proxy(settings)
    try:
        await proxy.start()
        await asyncio.wait_for(proxy.synced.wait(), 5)
        assert await greet("127.0.0.1", api_port, timeout=3) == "b1"
        reader, writer = await asyncio.open_connection("127.0.0.1", web_port)
        assert await asyncio.wait_for(reader.readline(), 3) == b"b2\n"  # held open
        stopping = asyncio.create_task(proxy.stop())
        for _ in range(20):  # paced over the 3 s drain's first 2.4 s (before its last call)
            await asyncio.sleep(0.1)
            assert await greet("127.0.0.1", api_port, timeout=1) == "b1"
        assert not stopping.done()
        writer.close()  # the held connection ends: the drain with it
        await asyncio.wait_for(stopping, 5)
    finally:
        await proxy.stop()


async def test_short_connections_during_a_drain_are_served_or_refused_never_cut(
    tmp_path: Path, backends: list[NamedBackend], unused_tcp_port: int
) -> None:
    # A held connection keeps the drain to its deadline while short ones come back to back:
    # the port takes them until shortly before the deadline and then closes, so each one
    # is served whole or refused, and only the held one is reset.
    proxy, _, held_writer = await draining_setup(tmp_path, backends[0], unused_tcp_port, 1.0)
    stopping = asyncio.create_task(proxy.stop())
    outcomes: Counter[str] = Counter()
    try:
        for _ in range(20_000):  # bounded; ends with the stop (about 1 s)
            if stopping.done():
                break
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", unused_tcp_port)
            except ConnectionRefusedError:
                outcomes["refused"] += 1
                await asyncio.sleep(0.001)
                continue
            try:
                writer.write(b"ping\n")
                got = await asyncio.wait_for(reader.read(64), 3)
                got += await asyncio.wait_for(reader.read(64), 0.5) if len(got) < 8 else b""
                outcomes["served" if got == b"b1\nping\n" else f"cut: {got!r}"] += 1
            except (TimeoutError, ConnectionResetError) as e:
                outcomes[f"cut: {type(e).__name__}"] += 1
            finally:
                writer.close()
        await asyncio.wait_for(stopping, 5)
    finally:
        held_writer.close()
    cut = {k: v for k, v in outcomes.items() if k.startswith("cut")}
    assert not cut, outcomes
    assert outcomes["served"] > 10, outcomes  # served well into the drain
