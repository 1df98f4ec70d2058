"""The proxy process: wires sources, tracker, syncer, rules, health and metrics together.

Start-up order matters: settings are checked, the rules backend is built (failing with one
line if it cannot work), the HTTP endpoints are bound (a port in use is tried again in the
background, or with ``--bind-address-hard-fail`` is a start-up error), then sources start
feeding the tracker and the sync runner starts; the syncer programs nothing until every
source has listed once. Every long-running task is named and supervised: one that ends
unexpectedly is logged and stops the process with an error, rather than leaving a proxy
that silently stopped following its cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Collection, Coroutine, Mapping
from dataclasses import replace
from typing import Any

from uproxy import localnet, metrics, nodeip, priority
from uproxy.dataplane import busypoll
from uproxy.dataplane.limits import raise_nofile_limit
from uproxy.dataplane.settings import DataplaneSettings
from uproxy.health import HealthzServer, ProxyHealth
from uproxy.healthcheck import HealthCheckServers, HealthCheckSpec
from uproxy.httpserver import HttpServer
from uproxy.log import V2, V3, kv
from uproxy.metrics_server import MetricsServer
from uproxy.model import IPFamily, ServicePortName
from uproxy.portrange import ephemeral_ports
from uproxy.rules import command
from uproxy.rules.base import RulesBackend, RulesError
from uproxy.rules.nodeports import NodePortReservations
from uproxy.runner import BoundedFrequencyRunner
from uproxy.settings import PRIMARY, Settings, format_duration, parse_hostport
from uproxy.sources.file import FileSource
from uproxy.syncer import ProxiedPort, Syncer, SyncerOptions, TableRow, open_listener
from uproxy.tracker import Tracker
from uproxy.workers import WorkerPool, default_worker_count, worker_argv, worker_cpus

log = logging.getLogger("uproxy.proxy")

LocalIps = Mapping[IPFamily, frozenset[str]]  # per family: the ready local endpoints' addresses

EXIT_BY_SIGNAL = 128  # a second stop signal exits with 128 + its number, as a shell reports it

# The cheap "are our rules still there" check: a netlink or getsockopt read of the ruleset's
# generation (about 10 us) that reads the rules themselves only when someone else committed.
# Often enough that traffic is back within a few seconds of someone flushing the tables.
RULES_CHECK_INTERVAL_S = 1.0

# How long a sync waits after the request that wakes it, for the rest of the change to come:
# a new Service's EndpointSlice comes right behind it. Each run takes a token of the rate
# limit (--iptables-min-sync-period), so a run for the Service alone made its endpoints wait
# up to that period for the next one: 10,000 services from the API double, 20 services
# added, p50 / p99 to the first answer 544 / 1,055 ms without the wait, nftables.
SYNC_SETTLE_S = 0.01

# How long a stop waits for its tasks (sources, syncs, checks) to end once cancelled; a task
# still running then is named in an error line and left behind, and the stop goes on.
TASKS_END_S = 5.0

# /healthz or /metrics could not listen (the port is still held by the proxy this one
# replaces, say): serve without it and try again this often, as kube-proxy does.
HTTP_RETRY_S = 5.0


def _why(e: OSError) -> str:
    """A bind error's reason alone (asyncio puts the address into its strerror)."""
    return os.strerror(e.errno) if e.errno else str(e)


class StartupError(Exception):
    """A problem the user can fix; the message is one line naming the cause and the fix."""


def announce_rules(s: Settings) -> None:
    """Say so when uproxy programs rules because it runs as root and ``--rules`` was not
    given: somebody trying it out as root gets kernel rules that outlive the process."""
    if s.rules or s.cleanup_on_exit:
        return
    log.info(
        "Programming kernel rules: running as root without --rules; they stay after exit "
        "until 'uproxy --cleanup' (--rules none: laptop mode, no rules)",
        extra=kv(rules=s.rules_backend),
    )


class Proxy:
    def __init__(
        self,
        settings: Settings,
        *,
        rules: RulesBackend | None = None,
        on_table: Callable[[list[TableRow]], None] | None = None,
    ) -> None:
        """Build every part (StartupError when the settings cannot work); ``start`` runs them."""
        s = self.settings = settings
        self.health = ProxyHealth(sync_period_s=s.iptables_sync_period)
        self.tracker = Tracker(
            service_proxy_name=s.service_proxy_name,
            on_change=self._queue_sync,
            on_endpoints=self._endpoints_changed,
        )
        try:  # the IP families served, --nodeport-addresses and --detect-local-mode, here
            self.stacks = localnet.stacks_at_start(
                s, rules_support=lambda f: None if rules is not None else _rules_support(s, f)
            )
            self.nodeport_addresses = localnet.nodeport_addresses_at_start(s, self.stacks)
            self.local_traffic = localnet.local_traffic_at_start(s)
        except ValueError as e:
            raise StartupError(str(e)) from None
        self.rules: RulesBackend = rules or self._make_rules()
        self.dataplane = DataplaneSettings.from_settings(s, dial_mark=self._dial_mark())
        count = s.workers if s.workers is not None else default_worker_count(laptop=s.laptop)
        self.workers: WorkerPool | None = (
            WorkerPool(
                count,
                settings=self.dataplane,
                argv=worker_argv(s),
                control_nice=s.control_nice,
                cpus=worker_cpus(s.worker_cpu_affinity),
                on_missing=self.health.set_missing_workers,
            )
            if count > 0
            else None
        )
        self.healthchecks = HealthCheckServers(
            addresses=self._nodeport_addresses(), proxy_health=self.health
        )
        self.syncer = Syncer(
            tracker=self.tracker,
            rules=self.rules,
            listener_factory=self.workers.open_listener if self.workers else open_listener,
            options=SyncerOptions(
                settings=s,
                dataplane=self.dataplane,
                listen_hosts=tuple(stack.listen_ip for stack in self.stacks),
                nodeports=None
                if s.laptop
                else NodePortReservations(bind_ips=self.nodeport_addresses.bind),
                on_table=on_table,
                on_synced=self._synced,
                extra_hooks=[self._sync_healthchecks],
                link=self.workers,
                clear_conntrack=not s.laptop,
            ),
        )
        self.runner = BoundedFrequencyRunner(
            "sync-proxy-rules",
            self._sync,
            min_interval=s.iptables_min_sync_period,
            max_interval=s.iptables_sync_period,
            settle=SYNC_SETTLE_S,
        )
        self.healthz = self._healthz_server()
        self.metrics_server = self._metrics_server()
        self.file_source = FileSource(path=s.services, tracker=self.tracker) if s.services else None
        self._endpoints_queued = False
        self._retry_timer: asyncio.TimerHandle | None = None  # a sync to retry what failed
        # Health-check node ports: per service, the ports that ask for one and, per family,
        # the addresses of their ready local endpoints.
        self._hc_ports: dict[tuple[str, str], dict[ServicePortName, tuple[int, LocalIps]]] = {}
        self._hc_specs: dict[tuple[str, str], HealthCheckSpec] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._finite: set[asyncio.Task[None]] = set()  # tasks that may end (``_spawn``)
        self._stopped = asyncio.Event()
        self.failure: str | None = None
        self._node_ips: tuple[str, ...] | None = None  # this Node's, as first seen (API)
        self._no_host_ip: set[str] = set()  # host addresses gone, with no other one (said)
        self.synced = asyncio.Event()
        self._prepare: asyncio.Task[None] | None = None
        self._node_taken = True  # False while a predecessor holds the node (``start``)

    # ----- lifecycle -----

    async def start(self, gate: Callable[[], Awaitable[None]] | None = None) -> None:
        """Start every part. ``gate``: awaited before anything that touches the node (ports,
        rules, the HTTP servers), once the workers run and the services are listed: a
        predecessor that still drains holds the node until it exits."""
        limit = raise_nofile_limit()
        log.log(V2, "File descriptor limit", extra=kv(nofile=limit))
        self._node_taken = gate is None
        if gate is None:
            await self._start_http()
        window = self.dataplane.busy_poll_s
        if window > 0:
            workers = self.workers.count if self.workers is not None else 0
            log.info(
                "The relaying loops poll for a while after each event instead of sleeping: "
                "up to a CPU each while traffic comes",
                extra=kv(busy_poll=format_duration(window), workers=workers),
            )
        if self.workers is not None and self.workers.bound:
            # A rules write runs in the kernel, on one CPU, in commits that do not give way to
            # a waking task (a whole table, or thousands of rules, each): the bound worker
            # there would wait each one out. While a write runs, the workers may move.
            command.guard_writes(self.workers.released)
        if self.workers is None:  # this loop relays
            busypoll.install(asyncio.get_running_loop(), window)
        else:
            try:
                await self.workers.start()
            except OSError as e:
                # Mostly the exec of a worker, whose error names no file (uvloop's spawn).
                raise StartupError(
                    f"cannot start the data-plane workers ({sys.executable} -m "
                    f"uproxy.dataplane.worker): {e.strerror or e}"
                ) from None
        # While the sources list (the first sync takes the backend's lock after it).
        if gate is None:
            self._prepare = asyncio.create_task(self.rules.prepare(), name="rules-prepare")
        # The workers import their modules meanwhile: a start no longer waits for them and
        # then for the API server, one after the other.
        await self._start_sources()
        if self.workers is not None:
            try:
                await self.workers.ready()
            except RuntimeError as e:
                raise StartupError(f"cannot start the data-plane workers: {e}") from None
        if gate is not None:
            log.info("Ready to take over the node once the uproxy before this one exits")
            await gate()
            self._node_taken = True
            # The predecessor's rules as it left them (the ports they lead to are taken back).
            self._prepare = asyncio.create_task(self.rules.prepare(), name="rules-prepare")
            await self._start_http()
        self._spawn("sync-runner", self.runner.loop())
        if not self.settings.laptop:
            self._spawn("rules-check", self._check_rules())
        if self.settings.config_file is not None:
            self._spawn("config-watch", self._watch_config(self.settings.config_file))
        self._queue_sync()

    async def wait(self) -> None:
        """Until stop() or a supervised task failed."""
        await self._stopped.wait()

    def request_stop(self) -> None:
        self._stopped.set()

    def on_signal(self, signum: int = signal.SIGTERM) -> None:
        """SIGTERM/SIGINT: the first drains and stops; a second one exits at once (143 for
        SIGTERM, 130 for SIGINT, as a shell reports a process the signal ended)."""
        if not self._stopped.is_set():
            log.info(
                "Stopping: draining connections (a second signal exits at once)",
                extra=kv(drain_timeout_s=self.settings.drain_timeout),
            )
            self._stopped.set()
            return
        log.warning("Second stop signal: exiting now")
        if self.workers is not None:
            self.workers.kill_now()
        os._exit(EXIT_BY_SIGNAL + signum)

    async def stop(self) -> None:
        # First of all, while everything drains: /healthz and the health-check node ports
        # say 503, so load balancers stop sending new connections here.
        self.health.set_stopping()
        self._stopped.set()
        if self._retry_timer is not None:
            self._retry_timer.cancel()
        if self._prepare is not None:
            self._prepare.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._prepare
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            # Bounded: a task that outlived its cancellation must not keep the stop from
            # draining the relays (nor make the second signal the only way out).
            ended, stuck = await asyncio.wait(self._tasks, timeout=TASKS_END_S)
            for task in ended:
                if not task.cancelled():
                    task.exception()  # retrieved: a failure while stopping is not news
            for task in stuck:
                log.error("A task did not end when cancelled", extra=kv(task=task.get_name()))
        self._tasks.clear()
        self._finite.clear()
        if self.workers is not None:
            # The workers drain their listeners (accepting while connections are open, see
            # ``TcpListener.shutdown``); closing them from here first would refuse new
            # connections for the whole drain.
            await self.workers.stop(drain=True)
            await self.syncer.close(drain=False)
        else:
            await self.syncer.close(drain=True)
        servers = [s for s in (self.healthz, self.metrics_server) if s is not None]
        await asyncio.gather(self.healthchecks.close(), *(s.close() for s in servers))
        # A normal shutdown only: one for a changed --config (or a failure) is a restart, and
        # removing the rules then would cut every service until the next start.
        # Never a node this process did not take: stopped while its predecessor drained, the
        # rules are the predecessor's, and its successor's to take over.
        if self.settings.cleanup_on_exit and self.failure is None and self._node_taken:
            try:
                await self.rules.cleanup()
            except RulesError as exc:
                log.error("Cannot remove the rules on exit", extra=kv(err=exc))
        await self.rules.close()
        if self.workers is not None:
            command.unguard_writes(self.workers.released)

    # ----- pieces -----

    def _make_rules(self) -> RulesBackend:
        from uproxy.rules import make_backend

        s = self.settings
        if s.laptop:
            return make_backend("none", host_ip=())
        missing = command.missing_permission(s.rules_backend)
        if missing is not None:
            raise StartupError(missing)
        announce_rules(s)
        try:
            return make_backend(
                s.rules_backend,
                host_ip=[stack.host_ip for stack in self.stacks],
                iptables_mode=s.iptables_mode,
                listen_ip=[stack.listen_ip for stack in self.stacks],
                dial_mark=self._dial_mark(),
                nodeport_cidrs=self.nodeport_addresses.cidrs,
                local=self.local_traffic,
                proxy_ports=_proxy_port_bounds(s),
            )
        except RulesError as e:
            raise StartupError(str(e)) from None

    def _dial_mark(self) -> int:
        """The mark for dials (0 without rules); checked once here, not per connection."""
        mark = self.settings.dial_mark
        if self.settings.laptop or not mark:
            return 0
        probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, mark)
        except OSError as e:
            raise StartupError(
                f"cannot set --dial-mark {mark:#x} on sockets: {e.strerror or e}; "
                "run with CAP_NET_ADMIN, or pass --dial-mark 0"
            ) from None
        finally:
            probe.close()
        return mark

    def _nodeport_addresses(self) -> list[str]:
        """Where health-check node ports listen: as NodePorts, or the laptop's addresses."""
        if self.settings.laptop:
            return [stack.listen_ip for stack in self.stacks]
        return list(self.nodeport_addresses.bind)

    def _follow_node_cidrs(self) -> None:
        """NodeCIDR: the pods' CIDRs are this Node's spec.podCIDRs, known (and changed) only
        through the API server; the next rules sync follows them."""
        local = localnet.local_traffic_of(self.settings, self.tracker.node, self.local_traffic)
        if local != self.local_traffic:
            self.local_traffic = local
            self.rules.set_local_traffic(local)
            self.syncer.force_rules_sync()

    def _follow_node_ips(self) -> None:
        """This Node's IPs changed: stop (draining), to be started again with them, as
        kube-proxy does. The address the host portals DNAT to is found when uproxy starts;
        a node that got another one would keep sending its own service traffic to the old
        one. The exit status says why (``failure``)."""
        node = self.tracker.node
        if node is None or not node.addresses or self.settings.laptop:
            return
        if self._node_ips is None:
            self._node_ips = node.addresses
            return
        if node.addresses == self._node_ips or self.failure is not None:
            return
        was, now = ",".join(self._node_ips), ",".join(node.addresses)
        log.warning(
            "This node's IPs changed: stopping, to start again with them",
            extra=kv(node=node.name, was=was, now=now),
        )
        self.failure = f"this node's IPs changed from {was} to {now}: start uproxy again"
        self._stopped.set()

    def _healthz_server(self) -> HealthzServer | None:
        addr = parse_hostport(self.settings.healthz_bind_address)
        if addr is None:
            return None
        return HealthzServer(proxy_health=self.health, address=addr[0], port=addr[1])

    def _metrics_server(self) -> MetricsServer | None:
        addr = parse_hostport(self.settings.metrics_bind_address)
        if addr is None:
            return None
        add_up = self.workers.add_up if self.workers is not None else None
        return MetricsServer(address=addr[0], port=addr[1], before_scrape=add_up)

    async def _start_http(self) -> None:
        s = self.settings
        for flag, value, server in (
            ("--healthz-bind-address", s.healthz_bind_address, self.healthz),
            ("--metrics-bind-address", s.metrics_bind_address, self.metrics_server),
        ):
            if server is None:
                continue
            try:
                await server.start()
            except OSError as e:
                why = _why(e)
                if s.bind_address_hard_fail:
                    raise StartupError(
                        f"cannot listen on {flag} {value}: {why}; "
                        f"free the port or pass another address (empty disables)"
                    ) from None
                log.error(
                    "Cannot listen, serving without it and retrying",
                    extra=kv(flag=flag, address=value, err=why, every=f"{HTTP_RETRY_S:g}s"),
                )
                self._spawn(f"listen {flag}", self._retry_http(server, flag, e.errno), ends=True)

    async def _retry_http(self, server: HttpServer, flag: str, last: int | None) -> None:
        """Try to bind ``server`` again every ``HTTP_RETRY_S`` until it listens; a new
        reason is logged once more, the same one only at -v 3."""
        while True:
            await asyncio.sleep(HTTP_RETRY_S)
            try:
                await server.start()
            except OSError as e:
                level = V3 if e.errno == last else logging.ERROR
                last = e.errno
                log.log(level, "Cannot listen, retrying", extra=kv(flag=flag, err=_why(e)))
                continue
            log.info("Listening now", extra=kv(flag=flag, port=server.port))
            return

    async def _start_sources(self) -> None:
        s = self.settings
        if self.file_source is not None:
            from uproxy.sources.file import ServicesFileError

            try:
                await self.file_source.load_initial()
            except ServicesFileError as e:
                raise StartupError(f"cannot use --services file: {e}") from None
            except OSError as e:
                raise StartupError(
                    f"cannot use --services file {s.services}: {e.strerror or e}"
                ) from None
            self._spawn("file-source", self.file_source.run())
            return
        from uproxy.sources.kube import KubeConfigError, KubeSource, make_api_client

        try:
            client = await make_api_client(kubeconfig=s.kubeconfig, master=s.master)
        except KubeConfigError as e:  # says which file, what is wrong, or what to pass
            raise StartupError(f"cannot configure the Kubernetes client: {e}") from None
        except Exception as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise StartupError(
                f"cannot configure the Kubernetes client: {first}; pass --kubeconfig or "
                "--master, or --services FILE to run without a cluster"
            ) from None
        source = KubeSource(
            tracker=self.tracker,
            api_client=client,
            node_name=s.node_name,
            service_proxy_name=s.service_proxy_name,
            config_sync_period_s=s.config_sync_period,
        )
        self._spawn("kube-source", source.run(), cleanup=client.close)

    def _spawn(
        self,
        name: str,
        coro: Coroutine[Any, Any, None],
        cleanup: Callable[[], Coroutine[Any, Any, Any]] | None = None,
        *,
        ends: bool = False,
    ) -> None:
        """Run ``coro`` as a named task; its end stops the proxy with an error, unless
        ``ends`` (it is expected to finish) and it returned normally."""

        async def supervised() -> None:
            try:
                await coro
            finally:
                if cleanup is not None:
                    await cleanup()

        task = asyncio.create_task(supervised(), name=name)
        task.add_done_callback(self._task_done)
        self._tasks.append(task)
        if ends:
            self._finite.add(task)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or self._stopped.is_set():
            return
        err = task.exception()
        if err is None and task in self._finite:
            self._finite.discard(task)
            self._tasks.remove(task)
            return
        self.failure = f"task {task.get_name()} ended unexpectedly: {err or 'returned'}"
        log.error("Supervised task ended, stopping", extra=kv(task=task.get_name(), err=err))
        self._stopped.set()

    async def _watch_config(self, path: str) -> None:
        """The --config file changed: stop (draining), so that uproxy is started again with
        it, as kube-proxy does; the exit status says why (``failure``)."""
        from uproxy.configfile import watch_config

        await watch_config(path, self.settings.config_digest)
        log.warning(
            "Configuration file changed: stopping, to start again with it", extra=kv(file=path)
        )
        self.failure = f"the content of --config {path} changed: start uproxy again to use it"
        self._stopped.set()

    # ----- callbacks -----

    def _queue_sync(self) -> None:
        node = self.tracker.node
        self.health.set_node_eligible(node is None or node.eligible)
        self._follow_node_cidrs()
        self._follow_node_ips()
        # Before every source has listed, a sync does nothing: requesting one would only
        # spend the rate limiter's burst and delay the first real sync by a min period.
        if not self.tracker.synced:
            return
        self.health.queued()
        metrics.SYNC_LAST_QUEUED_TIMESTAMP.set(time.time())
        self.runner.request()

    def _endpoints_changed(self) -> None:
        """An EndpointSlice changed: hand it to the balancers on the next loop pass.

        Coalesced (a burst of watch events is applied once) and outside the rules' rate
        limit, as kube-proxy's userspace mode did: endpoints need no rules.
        """
        if self._endpoints_queued or self.syncer.syncs == 0:
            return  # before the first sync, that sync takes every change
        self._endpoints_queued = True
        asyncio.get_running_loop().call_soon(self._apply_endpoints)

    def _apply_endpoints(self) -> None:
        self._endpoints_queued = False
        touched = self.syncer.apply_endpoints()
        if touched and self._note_healthchecks(self.syncer.ports, touched):
            self._queue_sync()  # a spec moved: the next sync opens or closes its server
        elif touched and self.syncer.rules_pending:
            self._queue_sync()  # a proxy port gained or lost its endpoints: rules to write

    async def _sync(self) -> None:
        prepare = self._prepare
        if prepare is not None and not prepare.done():
            # The first sync opens listeners on the ports the last run's rules lead to,
            # which the backend reads meanwhile (``rules.previous``).
            with contextlib.suppress(Exception):
                await asyncio.shield(prepare)
        # No await between these two: the sync takes exactly the changes queued so far.
        self.health.started()
        await self.syncer.sync()
        delay = self.syncer.retry_after()
        if self._retry_timer is not None:
            self._retry_timer.cancel()
        self._retry_timer = None
        if delay is not None and not self._stopped.is_set():
            self._retry_timer = asyncio.get_running_loop().call_later(delay, self._queue_sync)

    def _synced(self) -> None:
        self.health.updated()
        self.synced.set()
        priority.serving()  # relays to protect from now on: the control gives way sooner
        if self.workers is not None:
            self.workers.serve()  # ... and the workers apply changes in shorter slices

    async def _sync_healthchecks(
        self, ports: Mapping[ServicePortName, ProxiedPort], changed: Collection[ServicePortName]
    ) -> None:
        if self._note_healthchecks(ports, changed):
            await self.healthchecks.sync(self._hc_specs)

    def _note_healthchecks(
        self, ports: Mapping[ServicePortName, ProxiedPort], changed: Collection[ServicePortName]
    ) -> bool:
        """Update the health-check specs and counts of the services of ``changed`` ports.

        Returns whether a spec changed (a server to open or close); counts are handed over
        at once. Work is proportional to the change.
        """
        keys = set()
        for spn in changed:
            key = spn.service
            entries = self._hc_ports.get(key, {})
            pp = ports.get(spn)
            hc = pp.port.health_check_node_port if pp is not None else 0
            if pp is not None and hc:
                ips = {f: fp.balancer.local_ready_ips for f, fp in pp.families.items()}
                entries[spn] = (hc, ips)
                self._hc_ports[key] = entries
                keys.add(key)
            elif entries.pop(spn, None) is not None:
                keys.add(key)
        specs_changed = False
        for key in keys:
            entries = self._hc_ports.get(key, {})
            spec = None
            if entries:
                port = next(iter(entries.values()))[0]
                spec = HealthCheckSpec(namespace=key[0], name=key[1], port=port)
            else:
                self._hc_ports.pop(key, None)
            if self._hc_specs.get(key) != spec:
                specs_changed = True
                if spec is None:
                    del self._hc_specs[key]
                else:
                    self._hc_specs[key] = spec
        if keys:
            self._hand_counts()
        return specs_changed

    def _hand_counts(self) -> None:
        """kube-proxy's count: a service's ready local endpoints by address, over all its
        ports (a pod serving :80 and :443 is one endpoint). A dual-stack service's families
        count apart (its IPv4 and IPv6 proxiers each count their own; a check over IPv6 sees
        the IPv6 count); a single-stack service's count answers checks over either family,
        as kube-proxy's one listener for both does (an IPv4 service checked over IPv6 got
        503 and lost its load balancer's traffic)."""
        counts: dict[IPFamily, dict[tuple[str, str], int]] = {f: {} for f in IPFamily}
        for key, entries in self._hc_ports.items():
            families = {f for _, by_family in entries.values() for f in by_family}
            for family in IPFamily:
                counted = family if len(families) != 1 else next(iter(families))
                ips = [by_family.get(counted, frozenset()) for _, by_family in entries.values()]
                counts[family][key] = len(frozenset().union(*ips))
        self.healthchecks.set_local_endpoints(counts[IPFamily.V4], ipv6=counts[IPFamily.V6])

    async def _follow_host_ips(self) -> None:
        """Each family's host address (where the node's own traffic to a service is DNATed:
        its primary address when uproxy started) is still this host's; one that went away (a
        DHCP lease renewed with another address) is replaced by the family's primary address
        now, from the next sync on. The check is one netlink read per family.

        An address from ``--bind-address`` stays: the operator chose it. With
        ``--nodeport-addresses primary`` the NodePorts answer on the old address too, and the
        sockets that hold them are bound to it: uproxy stops instead, to be started again
        with the new one, as for a change of its Node's IPs (``_follow_node_ips``).
        """
        if self.rules.name == "none":
            return
        for stack in self.stacks:
            if stack.host_ip == stack.listen_ip:  # --bind-address
                continue
            now = nodeip.addresses_now(stack.family)
            if now is None or stack.host_ip in now:
                continue
            new = await asyncio.to_thread(nodeip.primary_address, stack.family)
            if new is None or new not in now:
                if stack.host_ip not in self._no_host_ip:
                    self._no_host_ip.add(stack.host_ip)
                    log.warning(
                        "This node's address is gone and it has no other: its own traffic to "
                        "services fails until it has one",
                        extra=kv(family=stack.family.label, was=stack.host_ip),
                    )
                continue
            if tuple(self.settings.nodeport_addresses) == (PRIMARY,):
                log.warning(
                    "This node's address changed: stopping, to start again with it "
                    "(--nodeport-addresses primary)",
                    extra=kv(family=stack.family.label, was=stack.host_ip, now=new),
                )
                self.failure = (
                    f"this node's {stack.family.label} address changed from {stack.host_ip} "
                    f"to {new} and --nodeport-addresses is primary: start uproxy again"
                )
                self._stopped.set()
                return
            self.rules.set_host_ip(stack.family, new)
            self.stacks = tuple(
                replace(s, host_ip=new) if s.family is stack.family else s for s in self.stacks
            )
            self._no_host_ip.discard(stack.host_ip)
            log.warning(
                "This node's address changed: its own traffic to services goes to the new one",
                extra=kv(family=stack.family.label, was=stack.host_ip, now=new),
            )
            self.syncer.force_rules_sync()
            self._queue_sync()

    async def _check_rules(self) -> None:
        failing: str | None = None  # the check's own error, said once until it changes
        while True:
            await asyncio.sleep(RULES_CHECK_INTERVAL_S)
            if self.rules is None or self.syncer is None or not self.tracker.synced:
                continue
            try:
                await self._follow_host_ips()
            except Exception as e:  # the rules check below must go on
                log.error("Checking this node's addresses failed", extra=kv(err=e))
            if self._stopped.is_set():
                return
            try:
                ok = await self.rules.check()
            except Exception as e:
                # The check could not look (out of fds, a program that crashed): that says
                # nothing about the rules, and a resync forced every second would override
                # the syncs' own back-off. The periodic sync goes on.
                level = logging.ERROR if str(e) != failing else V2
                log.log(level, "Rules check failed", extra=kv(err=e))
                failing = str(e)
                continue
            if failing is not None:
                log.info("Rules check works again")
                failing = None
            if not ok:
                log.info("Rules missing or changed by someone else, resyncing")
                self.syncer.force_rules_sync()
                self._queue_sync()


def _proxy_port_bounds(s: Settings) -> tuple[int, int]:
    """The lowest and highest port proxy ports are taken from (``portrange``)."""
    ports = s.port_range if s.port_range is not None else ephemeral_ports()
    return min(ports), max(ports)


def install_signal_handlers(stop: Callable[[int], None]) -> None:
    """``stop(signum)`` on SIGINT and SIGTERM."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop, sig)


def _rules_support(settings: Settings, family: IPFamily) -> str | None:
    """Why ``--rules`` cannot program ``family`` on this host (None: it can). iptables-restore
    needs the family's restore program, nftables the ``nft`` program; python-iptables brings
    its library."""
    backend = settings.rules_backend
    if backend == "nftables":
        return None if shutil.which("nft") else "nft is not installed (the nftables package)"
    if backend not in ("auto", "iptables-restore"):
        return None
    from uproxy.rules.restore import MODES, program, supports

    if supports(family):
        return None
    names = " nor ".join(program(family, mode, "-restore") for mode in MODES)
    return f"neither {names} is installed (the iptables package)"


def running_as_root() -> bool:
    return os.geteuid() == 0
