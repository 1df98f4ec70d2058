"""The syncer: the one place that turns desired state into sockets, balancers and rules.

``sync()`` is idempotent and cheap when nothing changed. It opens a listener for each new
service port (a second one for external traffic when the traffic policies make the cluster
and external endpoint sets differ), updates balancers in place when only endpoints changed
(no listener churn, established connections untouched), closes listeners of service ports
that went away, and then hands the full portal set to the rules backend. Nothing is
programmed until every source has listed once: a partial view must never close a listener.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol as TypingProtocol

from uproxy import metrics
from uproxy.dataplane.balancer import Balancer
from uproxy.dataplane.settings import DataplaneSettings
from uproxy.dataplane.tcp import TcpListener
from uproxy.dataplane.udp import UdpListener
from uproxy.log import V2, kv
from uproxy.model import LbAlgorithm, Protocol, ServicePort, ServicePortName, ServiceState, Traffic
from uproxy.portrange import PortAllocator
from uproxy.rules.base import Portal, PortalKind, RulesBackend, RulesError
from uproxy.rules.nodeports import NodePortReservations
from uproxy.tracker import Tracker

log = logging.getLogger("uproxy.syncer")

# Most ports tried for one listener in one sync: keeps a sync bounded when a range is busy.
_MAX_BIND_TRIES = 64


class Listener(TypingProtocol):
    host: str
    port: int

    def close(self) -> None: ...

    async def shutdown(self, timeout: float) -> None: ...

    @property
    def active(self) -> int: ...


class ListenerFactory(TypingProtocol):
    def __call__(
        self,
        *,
        name: ServicePortName,
        balancer: Balancer,
        traffic: Traffic,
        host: str,
        port: int,
        settings: DataplaneSettings,
    ) -> Awaitable[Listener]: ...


def open_listener(
    *,
    name: ServicePortName,
    balancer: Balancer,
    traffic: Traffic,
    host: str,
    port: int,
    settings: DataplaneSettings,
) -> Awaitable[Listener]:
    cls: type[TcpListener] | type[UdpListener] = (
        TcpListener if name.protocol is Protocol.TCP else UdpListener
    )
    return cls.open(
        name=name, balancer=balancer, traffic=traffic, host=host, port=port, settings=settings
    )


@dataclass(slots=True)
class ProxiedPort:
    """The runtime state of one service port."""

    port: ServicePort
    balancer: Balancer
    cluster: Listener | None = None
    external: Listener | None = None  # only when external traffic needs its own endpoint set

    @property
    def external_port(self) -> int | None:
        lst = self.external or self.cluster
        return lst.port if lst else None


@dataclass(frozen=True, slots=True)
class TableRow:
    service: str
    protocol: str
    listen: str
    endpoints: str


@dataclass(slots=True, kw_only=True)
class SyncerOptions:
    listen_host: str
    node_name: str
    laptop: bool
    port_range: range | None
    default_algorithm: LbAlgorithm
    dataplane: DataplaneSettings
    full_sync_period_s: float = 30.0
    drain_timeout_s: float = 5.0
    # Real sockets holding every node port (node mode); None in laptop mode.
    nodeports: NodePortReservations | None = None
    on_table: Callable[[list[TableRow]], None] | None = None
    on_synced: Callable[[], None] | None = None
    extra_hooks: list[Callable[[dict[ServicePortName, ProxiedPort]], Awaitable[None]]] = field(
        default_factory=list
    )


class Syncer:
    def __init__(
        self,
        *,
        tracker: Tracker,
        rules: RulesBackend,
        options: SyncerOptions,
        listener_factory: ListenerFactory = open_listener,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tracker = tracker
        self.rules = rules
        self.options = options
        self._open = listener_factory
        self._clock = clock
        self.ports: dict[ServicePortName, ProxiedPort] = {}
        self._allocators = {
            Protocol.TCP: PortAllocator(options.port_range),
            Protocol.UDP: PortAllocator(options.port_range),
        }
        self._portals: frozenset[Portal] | None = None
        self._last_rules_sync = float("-inf")
        self._force_rules = False
        self._failed: dict[tuple[ServicePortName, Traffic], str] = {}
        self._table: list[TableRow] = []
        self._nodeport_errors: set[str] = set()
        self._skipped_ipv6: set[tuple[ServicePortName, str]] = set()
        self.syncs = 0

    def force_rules_sync(self) -> None:
        """The next sync rewrites the rules even if the portal set did not change."""
        self._force_rules = True

    async def sync(self) -> None:
        if not self.tracker.synced:
            log.log(V2, "Not syncing: waiting for the first full listing of every source")
            return
        started = time.perf_counter()
        changes = self.tracker.take_changes()
        desired = self.tracker.snapshot()
        for spn in [s for s in self.ports if s not in desired]:
            await self._remove(spn)
        for spn, state in desired.items():
            await self._ensure(spn, state)
        self._sync_nodeports()
        await self._sync_rules()
        for hook in self.options.extra_hooks:
            await hook(self.ports)
        self._emit_table()
        self.syncs += 1
        done = time.time()
        metrics.SYNC_DURATION.observe(time.perf_counter() - started)
        metrics.SYNC_LAST_TIMESTAMP.set(done)
        for t in changes.trigger_times:
            metrics.NETWORK_PROGRAMMING_DURATION.observe(max(0.0, done - t))
        if self.options.on_synced is not None:
            self.options.on_synced()

    async def close(self, *, drain: bool = True) -> None:
        """Close every listener; with ``drain``, give connections time to finish."""
        for pp in list(self.ports.values()):
            for lst in (pp.cluster, pp.external):
                if lst is not None:
                    lst.close()
        if drain:
            for pp in list(self.ports.values()):
                for lst in (pp.cluster, pp.external):
                    if lst is not None:
                        await lst.shutdown(self.options.drain_timeout_s)
        self.ports.clear()
        if self.options.nodeports is not None:
            self.options.nodeports.close()

    # ----- per service port -----

    async def _ensure(self, spn: ServicePortName, state: ServiceState) -> None:
        pp = self.ports.get(spn)
        if pp is None:
            balancer = Balancer(
                spn,
                node_name=self.options.node_name,
                default_algorithm=self.options.default_algorithm,
                settings=self.options.dataplane,
            )
            pp = self.ports[spn] = ProxiedPort(state.port, balancer)
            log.log(V2, "Adding service port", extra=kv(service=str(spn)))
        elif pp.port.port != state.port.port and self.options.laptop and pp.cluster is not None:
            # Laptop mode listens on the service's own port: follow it.
            self._close_listener(spn, pp.cluster)
            pp.cluster = None
        pp.port = state.port
        pp.balancer.update(state.port, state.endpoints)
        if pp.cluster is None:
            pp.cluster = await self._open_listener(spn, pp, Traffic.CLUSTER)
        if state.port.needs_external_listener:
            if pp.external is None:
                pp.external = await self._open_listener(spn, pp, Traffic.EXTERNAL)
        elif pp.external is not None:
            self._close_listener(spn, pp.external)
            pp.external = None

    async def _remove(self, spn: ServicePortName) -> None:
        pp = self.ports.pop(spn)
        for lst in (pp.cluster, pp.external):
            if lst is not None:
                self._close_listener(spn, lst)
        self._failed = {k: v for k, v in self._failed.items() if k[0] != spn}
        if spn.protocol is Protocol.UDP and not self.options.laptop:
            await _clear_conntrack(pp.port)
        log.log(V2, "Removed service port", extra=kv(service=str(spn)))

    def _close_listener(self, spn: ServicePortName, lst: Listener) -> None:
        log.info("Closing proxy port", extra=kv(service=str(spn), port=lst.port))
        lst.close()
        self._allocators[spn.protocol].release(lst.port)

    async def _open_listener(
        self, spn: ServicePortName, pp: ProxiedPort, traffic: Traffic
    ) -> Listener | None:
        alloc = self._allocators[spn.protocol]
        if self.options.laptop and traffic is Traffic.CLUSTER:
            candidates = [pp.port.port, 0]
        else:
            candidates = alloc.candidates()[:_MAX_BIND_TRIES]
        last: OSError | None = None
        for port in candidates:
            try:
                lst = await self._open(
                    name=spn,
                    balancer=pp.balancer,
                    traffic=traffic,
                    host=self.options.listen_host,
                    port=port,
                    settings=self.options.dataplane,
                )
            except OSError as e:
                last = e
                if e.errno in (errno.EADDRINUSE, errno.EACCES):
                    continue
                break
            alloc.taken(lst.port)
            self._failed.pop((spn, traffic), None)
            log.info(
                "Opening proxy port",
                extra=kv(service=str(spn), traffic=traffic.value, address=_hostport(lst)),
            )
            return lst
        reason = last.strerror if last and last.strerror else str(last or "no free port in range")
        if self._failed.get((spn, traffic)) != reason:
            log.error(
                "Cannot open proxy port, will retry",
                extra=kv(service=str(spn), traffic=traffic.value, reason=reason),
            )
        self._failed[(spn, traffic)] = reason
        return None

    # ----- rules -----

    def portals(self) -> frozenset[Portal]:
        """The portals the rules must hold: every IPv4 service address of every proxied port.

        The rules backends program IPv4 iptables. The IPv6 addresses of a dual-stack service
        would need ip6tables (and the proxy ports listen on IPv4): they are left out, with one
        line per address, and never reach a backend, where one of them would fail the whole
        commit for every service.
        """
        out: set[Portal] = set()
        skipped: set[tuple[ServicePortName, str]] = set()
        for spn, pp in self.ports.items():
            sp = pp.port
            ext = pp.external_port
            addresses: list[tuple[PortalKind, tuple[str, ...], int]] = []
            if pp.cluster is not None:
                addresses.append((PortalKind.CLUSTER_IP, sp.cluster_ips, pp.cluster.port))
            if ext is not None:
                addresses.append((PortalKind.EXTERNAL_IP, sp.external_ips, ext))
                addresses.append((PortalKind.LB_INGRESS, sp.lb_ingress_ips, ext))
            for kind, ips, proxy_port in addresses:
                for ip in ips:
                    if ":" in ip:
                        skipped.add((spn, ip))
                    else:
                        out.add(Portal(spn, kind, ip, sp.port, proxy_port))
            reserved = self.options.nodeports
            held = reserved is None or (spn.protocol, sp.node_port) in reserved
            if ext is not None and sp.node_port and held:
                out.add(Portal(spn, PortalKind.NODE_PORT, None, sp.node_port, ext))
        if not self.options.laptop:  # no rules on a laptop: service addresses are not used
            for spn, ip in sorted(skipped - self._skipped_ipv6, key=str):
                log.warning(
                    "IPv6 service address not proxied: uproxy programs IPv4 iptables only",
                    extra=kv(service=str(spn), ip=ip),
                )
        self._skipped_ipv6 = skipped
        return frozenset(out)

    def _sync_nodeports(self) -> None:
        """Hold every node port with a real socket; a taken port is one error line, once."""
        if self.options.nodeports is None:
            return
        desired = {
            (spn.protocol, pp.port.node_port): spn
            for spn, pp in self.ports.items()
            if pp.port.node_port
        }
        errors = {str(e) for e in self.options.nodeports.sync(desired)}
        for msg in sorted(errors - self._nodeport_errors):
            log.error("Cannot reserve node port, will retry", extra=kv(error=msg))
        self._nodeport_errors = errors

    async def _sync_rules(self) -> None:
        portals = self.portals()
        now = self._clock()
        stale = now - self._last_rules_sync >= self.options.full_sync_period_s
        if portals == self._portals and not self._force_rules and not stale:
            return
        try:
            await self.rules.sync(portals)
        except RulesError as e:
            self._portals = None
            raise RulesError(f"programming rules with {self.rules.name} failed: {e}") from e
        self._portals = portals
        self._force_rules = False
        self._last_rules_sync = now

    # ----- the laptop table -----

    def table(self) -> list[TableRow]:
        rows = []
        for spn in sorted(self.ports):
            pp = self.ports[spn]
            listens = [_hostport(lst) for lst in (pp.cluster, pp.external) if lst is not None]
            eps = sorted(pp.balancer.endpoints(Traffic.CLUSTER))
            rows.append(
                TableRow(
                    service=str(spn),
                    protocol=spn.protocol.value,
                    listen=", ".join(listens) or "(not listening)",
                    endpoints=", ".join(str(e) for e in eps) or "(none)",
                )
            )
        return rows

    def _emit_table(self) -> None:
        if self.options.on_table is None:
            return
        rows = self.table()
        if rows != self._table:
            self._table = rows
            self.options.on_table(rows)


def _hostport(lst: Listener) -> str:
    host = f"[{lst.host}]" if ":" in lst.host else lst.host
    return f"{host}:{lst.port}"


async def _clear_conntrack(sp: ServicePort) -> None:
    """Stale UDP conntrack entries would keep clients on a dead translation."""
    from uproxy.rules.conntrack import clear_udp, clear_udp_node_port

    for ip in (*sp.cluster_ips, *sp.external_ips, *sp.lb_ingress_ips):
        await clear_udp(ip, sp.port)
    if sp.node_port:
        await clear_udp_node_port(sp.node_port)
