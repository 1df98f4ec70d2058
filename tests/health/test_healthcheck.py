"""Health-check node ports: status, exact body and headers, lifecycle, ports in use."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import resource
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest

from uproxy.health import ProxyHealth
from uproxy.healthcheck import HealthCheckServers, HealthCheckSpec
from uproxy.localnet import has_loopback6
from uproxy.log import V3
from uproxy.workers import CONTROL_FD_RESERVE

from .helpers import FakeClock, assert_same_bytes, free_port, out_of_fds, refused, wait_until

KEY = ("shop", "web")


def expected_body(namespace: str, name: str, count: int, healthy: bool) -> bytes:
    # The exact bytes a load balancer sees: kube-proxy's document, tab-indented, no newline
    # at the end (service_health.go prints a dedented, trimmed template).
    lines = [
        "{",
        '\t"service": {',
        f'\t\t"namespace": "{namespace}",',
        f'\t\t"name": "{name}"',
        "\t},",
        f'\t"localEndpoints": {count},',
        f'\t"serviceProxyHealthy": {"true" if healthy else "false"}',
        "}",
    ]
    return "\n".join(lines).encode()


@pytest.fixture
def health(clock: FakeClock) -> ProxyHealth:
    return ProxyHealth(sync_period_s=30.0, clock=clock, ages=clock)


@pytest.fixture
async def servers(health: ProxyHealth) -> AsyncIterator[HealthCheckServers]:
    hcs = HealthCheckServers(addresses=["127.0.0.1"], proxy_health=health)
    yield hcs
    await hcs.close()


async def check(
    http: aiohttp.ClientSession,
    port: int,
    *,
    path: str = "/",
    method: str = "GET",
    host: str = "127.0.0.1",
) -> tuple[int, bytes, int]:
    """One request; checks the fixed headers; returns status, body and the weight header."""
    async with http.request(method, f"http://{host}:{port}{path}") as resp:
        body = await resp.read()
        assert resp.headers["Content-Type"] == "application/json"
        assert resp.headers["X-Content-Type-Options"] == "nosniff"
        assert int(resp.headers["Content-Length"]) == len(body)
        assert resp.headers["Server"] == "uproxy"  # no interpreter or library versions
        return resp.status, body, int(resp.headers["X-Load-Balancing-Endpoint-Weight"])


async def test_503_without_local_endpoints_then_200(
    http: aiohttp.ClientSession, servers: HealthCheckServers, unused_port: int
) -> None:
    await servers.sync({KEY: HealthCheckSpec("shop", "web", unused_port)})
    assert servers.ports == {KEY: unused_port}
    assert servers.failures == {}

    status, body, weight = await check(http, unused_port)
    assert (status, weight) == (503, 0)
    assert_same_bytes(body, expected_body("shop", "web", 0, True))

    servers.set_local_endpoints({KEY: 2})
    status, body, weight = await check(http, unused_port)
    assert (status, weight) == (200, 2)
    assert_same_bytes(body, expected_body("shop", "web", 2, True))
    assert json.loads(body)["localEndpoints"] == 2

    servers.set_local_endpoints({})  # a service missing from the counts has none
    status, body, weight = await check(http, unused_port)
    assert (status, weight) == (503, 0)
    assert_same_bytes(body, expected_body("shop", "web", 0, True))


async def test_a_stopping_proxy_answers_503_with_local_endpoints(
    http: aiohttp.ClientSession,
    servers: HealthCheckServers,
    health: ProxyHealth,
    unused_port: int,
) -> None:
    await servers.sync({KEY: HealthCheckSpec("shop", "web", unused_port)})
    servers.set_local_endpoints({KEY: 2})
    assert (await check(http, unused_port))[0] == 200
    health.set_stopping()  # draining: the load balancer must take this node out now
    status, body, _ = await check(http, unused_port)
    assert status == 503
    assert_same_bytes(body, expected_body("shop", "web", 2, False))


async def test_any_path_and_method_answers(
    http: aiohttp.ClientSession, servers: HealthCheckServers, unused_port: int
) -> None:
    await servers.sync({KEY: HealthCheckSpec("shop", "web", unused_port)})
    servers.set_local_endpoints({KEY: 1})
    want = expected_body("shop", "web", 1, True)
    for path, method in [
        ("/", "GET"),
        ("/healthz", "GET"),
        ("/a/b/c?x=1", "GET"),
        ("/", "POST"),
    ]:
        status, body, weight = await check(http, unused_port, path=path, method=method)
        assert (status, weight) == (200, 1), (path, method)
        assert_same_bytes(body, want)


async def test_unhealthy_proxy_fails_despite_endpoints(
    http: aiohttp.ClientSession,
    servers: HealthCheckServers,
    health: ProxyHealth,
    clock: FakeClock,
    unused_port: int,
) -> None:
    await servers.sync({KEY: HealthCheckSpec("shop", "web", unused_port)})
    servers.set_local_endpoints({KEY: 3})
    health.queued()
    clock.advance(61)
    status, body, weight = await check(http, unused_port)
    assert (status, weight) == (503, 3)
    assert_same_bytes(body, expected_body("shop", "web", 3, False))
    health.started()
    health.updated()
    assert (await check(http, unused_port))[0] == 200


async def test_a_node_being_drained_still_reports_its_endpoints(
    http: aiohttp.ClientSession,
    servers: HealthCheckServers,
    health: ProxyHealth,
    unused_port: int,
) -> None:
    # kube-proxy's serviceProxyHealthy is the proxy's own health: the Node's state is for
    # /healthz, and a load balancer that asks per service keeps its answer about endpoints.
    await servers.sync({KEY: HealthCheckSpec("shop", "web", unused_port)})
    servers.set_local_endpoints({KEY: 1})
    health.set_node_eligible(False)
    status, body, _ = await check(http, unused_port)
    assert status == 200
    assert_same_bytes(body, expected_body("shop", "web", 1, True))


async def test_port_closes_when_service_goes(
    http: aiohttp.ClientSession, servers: HealthCheckServers
) -> None:
    port_a, port_b = free_port(), free_port()
    other = ("shop", "cart")
    await servers.sync(
        {
            KEY: HealthCheckSpec("shop", "web", port_a),
            other: HealthCheckSpec("shop", "cart", port_b),
        }
    )
    assert servers.ports == {KEY: port_a, other: port_b}
    status, body, _ = await check(http, port_b)
    assert status == 503
    assert_same_bytes(body, expected_body("shop", "cart", 0, True))

    await servers.sync({KEY: HealthCheckSpec("shop", "web", port_a)})
    assert servers.ports == {KEY: port_a}
    assert await refused("127.0.0.1", port_b)
    assert (await check(http, port_a))[0] == 503

    await servers.sync({})
    assert servers.ports == {}
    assert await refused("127.0.0.1", port_a)


async def test_port_change_moves_the_server(
    http: aiohttp.ClientSession, servers: HealthCheckServers
) -> None:
    old, new = free_port(), free_port()
    await servers.sync({KEY: HealthCheckSpec("shop", "web", old)})
    await servers.sync({KEY: HealthCheckSpec("shop", "web", new)})
    assert servers.ports == {KEY: new}
    assert await refused("127.0.0.1", old)
    status, body, _ = await check(http, new)
    assert status == 503
    assert_same_bytes(body, expected_body("shop", "web", 0, True))


async def test_unchanged_service_keeps_its_socket(servers: HealthCheckServers) -> None:
    port = free_port()
    await servers.sync({KEY: HealthCheckSpec("shop", "web", port)})
    servers.set_local_endpoints({KEY: 1})
    # A connection accepted before the next sync must still be served after it: a server
    # that was closed and reopened would have dropped it.
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        await servers.sync(
            {
                KEY: HealthCheckSpec("shop", "web", port),
                ("shop", "cart"): HealthCheckSpec("shop", "cart", free_port()),
            }
        )
        writer.write(b"GET /x HTTP/1.1\r\nHost: node\r\nConnection: close\r\n\r\n")
        await writer.drain()
        response = await asyncio.wait_for(reader.read(), 5.0)
    finally:
        writer.close()
        await writer.wait_closed()
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    assert_same_bytes(body, expected_body("shop", "web", 1, True))


async def test_listens_on_each_given_address(
    http: aiohttp.ClientSession, health: ProxyHealth
) -> None:
    port = free_port()
    hcs = HealthCheckServers(addresses=["127.0.0.1", "127.0.0.2"], proxy_health=health)
    try:
        await hcs.sync({KEY: HealthCheckSpec("shop", "web", port)})
        for host in ("127.0.0.1", "127.0.0.2"):
            status, body, _ = await check(http, port, host=host)
            assert status == 503
            assert_same_bytes(body, expected_body("shop", "web", 0, True))
        assert await refused("127.0.0.3", port)  # not a node port address
    finally:
        await hcs.close()
    for host in ("127.0.0.1", "127.0.0.2"):
        assert await refused(host, port)


async def test_port_in_use_is_retried_on_next_sync(
    http: aiohttp.ClientSession,
    servers: HealthCheckServers,
    unused_port: int,
    listening_blocker: Callable[[str, int], socket.socket],
    uproxy_logs: list[logging.LogRecord],
) -> None:
    blocker = listening_blocker("127.0.0.1", unused_port)
    other_port = free_port()
    desired = {
        KEY: HealthCheckSpec("shop", "web", unused_port),
        ("shop", "cart"): HealthCheckSpec("shop", "cart", other_port),
    }
    await servers.sync(desired)  # must not raise
    assert servers.failures == {KEY: unused_port}
    assert servers.ports == {("shop", "cart"): other_port}  # one bad port spoils nothing else
    errors = [r for r in uproxy_logs if r.levelno == logging.ERROR]
    assert len(errors) == 1
    kv = errors[0].kv  # type: ignore[attr-defined]
    assert kv["service"] == "shop/web"
    assert kv["port"] == unused_port
    assert "in use" in kv["err"]

    blocker.close()
    await servers.sync(desired)
    assert servers.ports == {KEY: unused_port, ("shop", "cart"): other_port}
    assert servers.failures == {}
    assert (await check(http, unused_port))[0] == 503


async def test_port_in_use_is_retried_in_background(
    http: aiohttp.ClientSession,
    servers: HealthCheckServers,
    unused_port: int,
    listening_blocker: Callable[[str, int], socket.socket],
    uproxy_logs: list[logging.LogRecord],
) -> None:
    blocker = listening_blocker("127.0.0.1", unused_port)
    await servers.sync({KEY: HealthCheckSpec("shop", "web", unused_port)})
    assert servers.failures == {KEY: unused_port}

    def retries() -> int:
        return sum(1 for r in uproxy_logs if r.levelno == V3 and "will retry" in r.getMessage())

    # The default retry interval, without any further sync: "within a few seconds".
    await wait_until(lambda: retries() >= 1, timeout=5.0)
    assert sum(1 for r in uproxy_logs if r.levelno == logging.ERROR) == 1  # reported once

    blocker.close()
    await wait_until(lambda: servers.ports == {KEY: unused_port}, timeout=5.0)
    assert servers.failures == {}
    servers.set_local_endpoints({KEY: 2})
    status, body, weight = await check(http, unused_port)
    assert (status, weight) == (200, 2)
    assert_same_bytes(body, expected_body("shop", "web", 2, True))
    opened = [r for r in uproxy_logs if r.levelno == logging.INFO and "Opened" in r.getMessage()]
    assert len(opened) == 1


async def test_dropping_a_failed_service_stops_retrying(
    servers: HealthCheckServers,
    unused_port: int,
    listening_blocker: Callable[[str, int], socket.socket],
) -> None:
    blocker = listening_blocker("127.0.0.1", unused_port)
    await servers.sync({KEY: HealthCheckSpec("shop", "web", unused_port)})
    assert servers.failures == {KEY: unused_port}
    await servers.sync({})
    assert servers.failures == {}
    blocker.close()
    assert servers.ports == {}
    assert await refused("127.0.0.1", unused_port)


async def test_close_releases_every_port(health: ProxyHealth) -> None:
    hcs = HealthCheckServers(addresses=["127.0.0.1"], proxy_health=health)
    ports = [free_port() for _ in range(3)]
    await hcs.sync(
        {("ns", f"s{i}"): HealthCheckSpec("ns", f"s{i}", p) for i, p in enumerate(ports)}
    )
    assert sorted(hcs.ports.values()) == sorted(ports)
    await hcs.close()
    assert hcs.ports == {}
    for p in ports:
        assert await refused("127.0.0.1", p)
    await hcs.sync({("ns", "late"): HealthCheckSpec("ns", "late", ports[0])})  # no-op once closed
    assert await refused("127.0.0.1", ports[0])


async def test_invalid_port_is_a_failure_not_a_crash(servers: HealthCheckServers) -> None:
    await servers.sync({KEY: HealthCheckSpec("shop", "web", 70000)})
    assert servers.failures == {KEY: 70000}
    assert servers.ports == {}


async def test_a_server_that_gets_no_socket_is_a_failure_and_retried(
    http: aiohttp.ClientSession,
    health: ProxyHealth,
    unused_port: int,
    uproxy_logs: list[logging.LogRecord],
) -> None:
    """Out of fds, a server came up listening nowhere (the event loop skips a socket it
    cannot create), was logged as opened and never tried again: the load balancer found the
    port refused for as long as the service lived. It is a failure now, retried."""
    hcs = HealthCheckServers(addresses=["127.0.0.1"], proxy_health=health, retry_interval_s=0.05)
    other = (("shop", "cart"), HealthCheckSpec("shop", "cart", free_port()))
    try:
        await hcs.sync(dict([other]))  # what a first server needs is loaded, as in a proxy
        with out_of_fds():
            await hcs.sync(dict([other, (KEY, HealthCheckSpec("shop", "web", unused_port))]))
        assert hcs.failures == {KEY: unused_port}
        errors = [r for r in uproxy_logs if r.levelno == logging.ERROR]
        said = errors[0].kv["err"]  # type: ignore[attr-defined]
        assert "cannot listen on 127.0.0.1: Too many open files" in said
        await wait_until(lambda: KEY in hcs.ports, timeout=5.0)
        assert (await check(http, unused_port))[0] == 503
    finally:
        await hcs.close()


async def test_servers_failing_alike_for_want_of_fds_are_two_lines(
    health: ProxyHealth, uproxy_logs: list[logging.LogRecord]
) -> None:
    """Near the fd limit, 5,067 services each got an error line of its own at start, all
    saying the same: the first is said, the rest counted in one line."""
    hcs = HealthCheckServers(addresses=["127.0.0.1"], proxy_health=health, retry_interval_s=60)
    first = (("shop", "first"), HealthCheckSpec("shop", "first", free_port()))
    try:
        await hcs.sync(dict([first]))  # what a first server needs is loaded, as in a proxy
        wanted = dict([first])
        wanted.update(
            {("shop", f"s{i}"): HealthCheckSpec("shop", f"s{i}", free_port()) for i in range(5)}
        )
        with out_of_fds():
            await hcs.sync(wanted)
        assert len(hcs.failures) == 5
        errors = [r.getMessage() for r in uproxy_logs if r.levelno == logging.ERROR]
        assert errors == [
            "Failed to start healthcheck, will retry",
            "More healthchecks failed to start for the same reason, will retry",
        ]
        summary = [r for r in uproxy_logs if r.levelno == logging.ERROR][1]
        assert summary.kv == {"services": 4, "err": "Too many open files"}  # type: ignore[attr-defined]
    finally:
        await hcs.close()


async def test_opening_many_servers_gives_the_loop_back(servers: HealthCheckServers) -> None:
    """The loop that opens the servers answers them, /healthz and the workers: bound here,
    with nothing to wait for, 10,000 servers held it for over a second in one stretch, and
    each retry of 5,000 that failed for a quarter of one, every 2 s. It gets turns now."""
    with contextlib.ExitStack() as held:  # 2,000 ports, none twice
        probes = [held.enter_context(socket.socket()) for _ in range(2000)]
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        ports = [probe.getsockname()[1] for probe in probes]
    loop = asyncio.get_running_loop()
    turns: list[float] = []

    def turn() -> None:
        turns.append(loop.time())
        handle[0] = loop.call_soon(turn)

    handle = [loop.call_soon(turn)]
    turns.append(loop.time())
    try:
        await servers.sync(
            {("shop", f"s{i}"): HealthCheckSpec("shop", f"s{i}", p) for i, p in enumerate(ports)}
        )
        turns.append(loop.time())
    finally:
        handle[0].cancel()
    assert len(servers.ports) > len(ports) // 2  # a port another program took meanwhile fails
    took, during = turns[-1] - turns[0], len(turns) - 2
    assert during >= took / 0.05, (during, took)  # a turn every 50 ms at least, on average


async def test_servers_leave_the_control_process_its_reserve_of_fds(
    http: aiohttp.ClientSession, health: ProxyHealth, uproxy_logs: list[logging.LogRecord]
) -> None:
    """Thousands of services with a health-check node port each took every fd the proxy
    ports leave the control process: no rules program could run, every sync failed before
    it could close anything, /livez reset its probes. The servers keep off that reserve
    too; those that do not fit are retried, and open once fds are free."""
    hcs = HealthCheckServers(addresses=["127.0.0.1"], proxy_health=health, retry_interval_s=0.05)
    specs = {("shop", f"s{i}"): HealthCheckSpec("shop", f"s{i}", free_port()) for i in range(8)}
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = len(os.listdir("/proc/self/fd")) - 1
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + CONTROL_FD_RESERVE + 3, hard))
        try:
            await hcs.sync(specs)
            assert hcs.failures, "the servers took fds kept for uproxy's own work"
            assert len(hcs.ports) + len(hcs.failures) == len(specs)
            said = [r.kv["err"] for r in uproxy_logs if r.levelno == logging.ERROR]  # type: ignore[attr-defined]
            assert "are kept for uproxy" in said[0]
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        await wait_until(lambda: not hcs.failures, timeout=5.0)
        for spec in specs.values():
            assert (await check(http, spec.port))[0] == 503
    finally:
        await hcs.close()


@pytest.mark.skipif(not has_loopback6(), reason="this machine has no IPv6 loopback")
async def test_each_family_answers_with_its_own_count(
    http: aiohttp.ClientSession, health: ProxyHealth, unused_port: int
) -> None:
    """kube-proxy's IPv4 and IPv6 proxiers each answer a dual-stack service's health check with
    their own family's local endpoints; a check over IPv6 gets the IPv6 count."""
    hcs = HealthCheckServers(addresses=["127.0.0.1", "::1"], proxy_health=health)
    try:
        await hcs.sync({KEY: HealthCheckSpec("shop", "web", unused_port)})
        hcs.set_local_endpoints({KEY: 2}, ipv6={KEY: 0})
        assert (await check(http, unused_port))[::2] == (200, 2)
        status, body, weight = await check(http, unused_port, host="[::1]")
        assert (status, weight) == (503, 0)
        assert_same_bytes(body, expected_body("shop", "web", 0, True))
        hcs.set_local_endpoints({KEY: 1})  # no IPv6 counts given: the same for both
        assert (await check(http, unused_port, host="[::1]"))[::2] == (200, 1)
    finally:
        await hcs.close()


async def test_servers_close_together_whatever_clients_that_do_not_read_hold(
    servers: HealthCheckServers,
) -> None:
    """A client that pipelines requests and never reads its answers held each server's
    close for 2 s, one server after another (12 s of a stop with five of them, past a pod's
    grace period with fifteen): they close together now, each waiting a moment at most."""
    keys = [("shop", f"web-{i}") for i in range(3)]
    ports = [free_port() for _ in keys]
    await servers.sync(
        {k: HealthCheckSpec(k[0], k[1], p) for k, p in zip(keys, ports, strict=True)}
    )
    done = threading.Event()

    def pipeline_without_reading(port: int) -> None:
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.settimeout(0.5)
            requests = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 1000
            deadline = time.monotonic() + 5
            with contextlib.suppress(TimeoutError):
                while time.monotonic() < deadline and not done.is_set():
                    s.sendall(requests)  # until the server stops reading: answers pile up
            done.wait(15)

    threads = [threading.Thread(target=pipeline_without_reading, args=(p,)) for p in ports]
    for t in threads:
        t.start()
    try:
        await asyncio.sleep(2)  # the servers are stuck writing answers nobody reads
        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.wait_for(servers.close(), 20)
        took = loop.time() - started
        assert took < len(keys), took  # was 2 s per server, one after another
        for port in ports:
            assert await refused("127.0.0.1", port)
    finally:
        done.set()
        for t in threads:
            t.join(20)
