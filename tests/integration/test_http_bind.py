"""/healthz and /metrics on a port that is still taken: serve without them and bind them
later (kube-proxy's default), or refuse to start (``--bind-address-hard-fail``)."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from tests.conftest import wait_for
from tests.integration.backends import NamedBackend, greet
from tests.integration.test_laptop import WEB, write_services
from uproxy import proxy as proxy_module
from uproxy.configfile import load_config
from uproxy.httpserver import HttpServer
from uproxy.localnet import has_loopback6
from uproxy.log import V3
from uproxy.proxy import Proxy, StartupError
from uproxy.settings import Settings


@pytest.fixture
def held() -> Iterator[list[socket.socket]]:
    """Two listening sockets on loopback, as a proxy being replaced would still hold."""
    socks = []
    for _ in range(2):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        socks.append(s)
    yield socks
    for s in socks:
        s.close()


@pytest.fixture
async def backend() -> AsyncIterator[NamedBackend]:
    b = await NamedBackend("b1", "127.0.0.21").start()
    yield b
    await b.close()


def _settings(tmp_path: Path, held: list[socket.socket], **extra: object) -> Settings:
    healthz, metrics = (f"127.0.0.1:{s.getsockname()[1]}" for s in held)
    return Settings(
        services=str(tmp_path / "services.yaml"),
        rules="none",
        healthz_bind_address=healthz,
        metrics_bind_address=metrics,
        iptables_min_sync_period=0.05,
        **extra,  # type: ignore[arg-type]
    )


async def _status(url: str) -> int | None:
    timeout = aiohttp.ClientTimeout(total=2)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url) as resp:
            await resp.read()
            return resp.status
    except (aiohttp.ClientError, TimeoutError):
        return None


async def test_a_taken_port_is_retried_while_the_proxy_serves(
    tmp_path: Path,
    held: list[socket.socket],
    backend: NamedBackend,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(proxy_module, "HTTP_RETRY_S", 0.1)
    settings = _settings(tmp_path, held)
    write_services(Path(settings.services or ""), [backend])
    proxy = Proxy(settings)
    caplog.set_level(V3, logger="uproxy")
    try:
        await proxy.start()
        await asyncio.wait_for(proxy.synced.wait(), 5)
        listener = proxy.syncer.ports[WEB].cluster
        assert listener is not None
        assert await greet("127.0.0.1", listener.port) == "b1"  # relays without them

        def retries() -> int:
            return sum(r.getMessage() == "Cannot listen, retrying" for r in caplog.records)

        await wait_for(lambda: retries() >= 4, message="retries of both servers")
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert sorted(r.kv["flag"] for r in errors) == [  # type: ignore[attr-defined]
            "--healthz-bind-address",
            "--metrics-bind-address",
        ]  # one line each: a retry that fails the same way is logged at -v 3 only
        assert all("Address already in use" in str(r.kv["err"]) for r in errors)  # type: ignore[attr-defined]

        healthz, metrics = (f"http://127.0.0.1:{s.getsockname()[1]}" for s in held)
        for s in held:
            s.close()

        async def both_answer() -> bool:
            return (await _status(f"{healthz}/healthz"), await _status(f"{metrics}/metrics")) == (
                200,
                200,
            )

        await wait_for(both_answer, timeout=5, message="/healthz and /metrics bound")
        listening = [r for r in caplog.records if r.getMessage() == "Listening now"]
        assert len(listening) == 2
        assert proxy.failure is None and not proxy._stopped.is_set()
        assert [r for r in caplog.records if r.levelno >= logging.ERROR] == errors
        assert await greet("127.0.0.1", listener.port) == "b1"
    finally:
        await proxy.stop()


async def test_bind_address_hard_fail_refuses_to_start(
    tmp_path: Path, held: list[socket.socket]
) -> None:
    settings = _settings(tmp_path, held, bind_address_hard_fail=True)
    Path(settings.services or "").write_text("")
    proxy = Proxy(settings)
    try:
        with pytest.raises(StartupError) as info:
            await proxy.start()
    finally:
        await proxy.stop()
    assert str(info.value) == (
        f"cannot listen on --healthz-bind-address {settings.healthz_bind_address}: "
        "Address already in use; free the port or pass another address (empty disables)"
    )


def test_bind_address_hard_fail_is_read_from_the_configuration(tmp_path: Path) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\n"
        "kind: KubeProxyConfiguration\n"
        "bindAddressHardFail: true\n"
    )
    assert load_config(str(cfg), Settings()).bind_address_hard_fail is True
    assert Settings().bind_address_hard_fail is False


def _free_port_both_families() -> int:
    """A port free in IPv4 and IPv6 (a dual-stack probe bound to it, then closed)."""
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        probe.bind(("::", 0))
        return int(probe.getsockname()[1])


async def test_an_unspecified_address_listens_in_both_families() -> None:
    # As kube-proxy's listener on 0.0.0.0:10256: the kubelet of a node whose primary
    # address is IPv6 probes /livez over IPv6.
    if not has_loopback6():
        pytest.skip("no IPv6 loopback address (::1) on this host")

    async def hello(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    for address, families in (("0.0.0.0", {"127.0.0.1", "::1"}), ("127.0.0.1", {"127.0.0.1"})):
        port = _free_port_both_families()
        server = HttpServer(name="t", address=address, port=port, routes=[("GET", "/", hello)])
        await server.start()
        try:
            answered = set()
            for host in ("127.0.0.1", "::1"):
                url = f"http://{'[' + host + ']' if ':' in host else host}:{port}/"
                if await _status(url) == 200:
                    answered.add(host)
            assert answered == families, address
        finally:
            await server.close()
