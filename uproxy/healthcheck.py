"""Health-check node ports: tell external load balancers which nodes hold local endpoints.

A Service with ``externalTrafficPolicy: Local`` only delivers external traffic to pods on
the node that received it, so the cloud load balancer must skip nodes without any. It
asks ``spec.healthCheckNodePort`` on every node; this module answers, as kube-proxy's
``service_health.go`` does: 200 when this node has local endpoints and the proxy is
healthy, else 503, with a JSON body naming the service and the count, and the count again
in ``X-Load-Balancing-Endpoint-Weight`` for load balancers that weight by it.

Counts are per IP family, as in kube-proxy, whose IPv4 and IPv6 proxiers each run a health
server that knows its own family's endpoints only (each bound to sockets of its family): a
check that arrives over IPv4 counts the service's local IPv4 endpoints, one over IPv6 its
IPv6 ones. A dual-stack pod is one endpoint either way.

Servers are opened and closed by difference, so an unchanged service keeps its socket (and
its clients' keep-alive connections) across syncs. A port that cannot be bound (usually
another process holds it) is never fatal: it is logged once with the service and port,
and retried on every sync and by a small background task every few seconds until it
opens or the service goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from aiohttp import web

from uproxy.dataplane.fdreserve import RESOURCE_ERRNOS
from uproxy.health import ProxyHealth
from uproxy.httpserver import KEEPALIVE_S, SERVER, SHUTDOWN_TIMEOUT_S, listen_all
from uproxy.log import V2, V3
from uproxy.timeslice import TimeSlice
from uproxy.workers import check_fd_reserve

log = logging.getLogger("uproxy.healthcheck")

ServiceKey = tuple[str, str]  # (namespace, name)
_Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]

_DEFAULT_RETRY_INTERVAL_S = 2.0
_SHUTDOWN_TIMEOUT_S = SHUTDOWN_TIMEOUT_S  # see there; the servers close together


@dataclass(frozen=True, slots=True)
class HealthCheckSpec:
    namespace: str
    name: str
    port: int


class _Instance:
    """One service's open server: one aiohttp runner with a site per node address."""

    __slots__ = ("runner", "spec")

    def __init__(self, spec: HealthCheckSpec, runner: web.ServerRunner) -> None:
        self.spec = spec
        self.runner = runner


def health_check_body(namespace: str, name: str, count: int, healthy: bool) -> bytes:
    """kube-proxy's answer, byte for byte: an indented document, tabs, no final newline."""
    return (
        "{\n"
        '\t"service": {\n'
        f'\t\t"namespace": {json.dumps(namespace)},\n'
        f'\t\t"name": {json.dumps(name)}\n'
        "\t},\n"
        f'\t"localEndpoints": {count},\n'
        f'\t"serviceProxyHealthy": {"true" if healthy else "false"}\n'
        "}"
    ).encode()


class HealthCheckServers:
    """The set of health-check node port servers, kept equal to the desired set."""

    def __init__(
        self,
        *,
        addresses: Sequence[str],
        proxy_health: ProxyHealth,
        retry_interval_s: float = _DEFAULT_RETRY_INTERVAL_S,
    ) -> None:
        # kube-proxy listens on 0.0.0.0 unless --nodeport-addresses narrows it; when none of
        # the node's addresses is in those CIDRs, nowhere (the caller passes no address).
        self._addresses = tuple(addresses)
        self._health = proxy_health
        self._retry_interval_s = retry_interval_s
        self._desired: dict[ServiceKey, HealthCheckSpec] = {}
        self._open: dict[ServiceKey, _Instance] = {}
        self._counts: Mapping[ServiceKey, int] = {}
        self._counts6: Mapping[ServiceKey, int] = {}
        # The last bind error reported per service, so a retry loop logs it only once.
        self._reported: dict[ServiceKey, tuple[int, int | None]] = {}
        # Out of fds (or memory), one pass over thousands of services failed each for the
        # same reason, in thousands of error lines: the first is said, the rest counted.
        self._short: dict[int, int] | None = None  # errno -> services, during a pass
        self._lock = asyncio.Lock()
        self._retry_task: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def ports(self) -> dict[ServiceKey, int]:
        """Services whose server is open, and its port."""
        return {key: inst.spec.port for key, inst in self._open.items()}

    @property
    def failures(self) -> dict[ServiceKey, int]:
        """Services wanted but not open (their port could not be bound), and the port."""
        return {k: s.port for k, s in self._desired.items() if k not in self._open}

    async def sync(self, services: Mapping[ServiceKey, HealthCheckSpec]) -> None:
        """Make the open servers match ``services``; retry any that failed before."""
        if self._closed:
            return
        async with self._lock:
            self._desired = dict(services)
            changed = [k for k, inst in self._open.items() if services.get(k) != inst.spec]
            await asyncio.gather(*map(self._close_one, changed))
            for key in [k for k in self._reported if k not in services]:
                del self._reported[key]
            await self._open_missing()
        self._ensure_retry_task()

    def set_local_endpoints(
        self, counts: Mapping[ServiceKey, int], *, ipv6: Mapping[ServiceKey, int] | None = None
    ) -> None:
        """Local endpoint counts per service, as checks over IPv4 see them, and as checks
        over IPv6 do (``ipv6``; None: the same); services not listed have none."""
        self._counts = dict(counts)
        self._counts6 = dict(ipv6) if ipv6 is not None else self._counts

    async def close(self) -> None:
        self._closed = True
        task, self._retry_task = self._retry_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        async with self._lock:
            await asyncio.gather(*map(self._close_one, list(self._open)))
            self._desired.clear()
            self._reported.clear()

    # --- opening and closing ---

    async def _open_missing(self) -> None:
        # Binding here does not wait on anything: thousands of servers (or of retries) held
        # the loop that answers them, /healthz and the workers for a second in one stretch.
        ts = TimeSlice()
        self._short = {}
        try:
            for key, spec in list(self._desired.items()):
                if key not in self._open:
                    await self._open_one(key, spec)
                    await ts.tick()
        finally:
            short, self._short = self._short, None
        for code, more in short.items():
            if more:
                log.error(
                    "More healthchecks failed to start for the same reason, will retry",
                    extra={"kv": {"services": more, "err": os.strerror(code)}},
                )

    async def _open_one(self, key: ServiceKey, spec: HealthCheckSpec) -> None:
        service = f"{spec.namespace}/{spec.name}"
        if not 0 < spec.port < 65536:
            # Validation should have refused it; never let it reach bind() (OverflowError).
            self._report_failure(key, spec, OSError(errno.EINVAL, "invalid port"))
            return
        try:
            # Thousands of services with their own port must not take the fds the rules
            # programs and /livez need: out of them, every sync failed and nothing closed one.
            socks = listen_all(self._addresses, spec.port, check=check_fd_reserve)
        except OSError as err:
            self._report_failure(key, spec, err)
            return
        server = web.Server(self._make_handler(key), access_log=None, keepalive_timeout=KEEPALIVE_S)
        runner = web.ServerRunner(server, shutdown_timeout=_SHUTDOWN_TIMEOUT_S)
        try:
            await runner.setup()
            for sock in socks:
                await web.SockSite(runner, sock).start()
        except BaseException as exc:
            await runner.cleanup()
            for sock in socks:  # those no site took yet
                sock.close()
            if not isinstance(exc, OSError):
                raise
            self._report_failure(key, spec, exc)
            return
        self._open[key] = _Instance(spec, runner)
        if self._reported.pop(key, None) is not None:
            log.info("Opened healthcheck", extra={"kv": {"service": service, "port": spec.port}})
        else:
            log.log(V2, "Opened healthcheck", extra={"kv": {"service": service, "port": spec.port}})

    def _report_failure(self, key: ServiceKey, spec: HealthCheckSpec, err: OSError) -> None:
        fields = {"service": f"{spec.namespace}/{spec.name}", "port": spec.port, "err": str(err)}
        signature = (spec.port, err.errno)
        if self._reported.get(key) == signature:
            log.log(V3, "Failed to start healthcheck, will retry", extra={"kv": fields})
            return
        self._reported[key] = signature
        # Out of a resource, every server of a pass fails alike (a port taken is each
        # service's own).
        if self._short is not None and err.errno in RESOURCE_ERRNOS:
            if err.errno in self._short:  # said for another service in this pass
                self._short[err.errno] += 1
                log.log(V3, "Failed to start healthcheck, will retry", extra={"kv": fields})
                return
            self._short[err.errno] = 0
        log.error("Failed to start healthcheck, will retry", extra={"kv": fields})

    async def _close_one(self, key: ServiceKey) -> None:
        inst = self._open.pop(key)
        log.log(
            V2,
            "Closing healthcheck",
            extra={"kv": {"service": f"{key[0]}/{key[1]}", "port": inst.spec.port}},
        )
        await inst.runner.cleanup()

    # --- background retry of ports that could not be bound ---

    def _ensure_retry_task(self) -> None:
        if self._closed or not self.failures:
            return
        if self._retry_task is None or self._retry_task.done():
            self._retry_task = asyncio.create_task(
                self._retry_loop(), name="uproxy-healthcheck-retry"
            )

    async def _retry_loop(self) -> None:
        while not self._closed and self.failures:
            await asyncio.sleep(self._retry_interval_s)
            # close() cancels this task before it takes the lock, so no closed check here.
            async with self._lock:
                await self._open_missing()

    # --- serving ---

    def _make_handler(self, key: ServiceKey) -> _Handler:
        namespace, name = key

        async def handle(request: web.BaseRequest) -> web.StreamResponse:
            count = (self._counts6 if _over_ipv6(request) else self._counts).get(key, 0)
            # The proxy's own health: a node being drained still answers for its endpoints
            # here (kube-proxy's IsHealthy ignores the Node); /healthz reports the node.
            proxy_healthy = self._health.serving()
            body = health_check_body(namespace, name, count, proxy_healthy)
            return web.Response(
                status=200 if count > 0 and proxy_healthy else 503,
                body=body,
                headers={
                    "Content-Type": "application/json",
                    "Server": SERVER,
                    "X-Content-Type-Options": "nosniff",
                    "X-Load-Balancing-Endpoint-Weight": str(count),
                },
            )

        return handle


def _over_ipv6(request: web.BaseRequest) -> bool:
    """Whether the check arrived on an IPv6 socket (its local address has four fields)."""
    transport = request.transport
    local = transport.get_extra_info("sockname") if transport is not None else None
    return isinstance(local, tuple) and len(local) == 4
