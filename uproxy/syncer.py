"""The syncer: the one place that turns desired state into sockets, balancers and rules.

``sync()`` is idempotent and does work in proportion to what changed. For each service port
the tracker names it opens a listener when the port is new (a second one for external
traffic when the traffic policies make the cluster and external endpoint sets differ),
updates its balancer in place (no listener churn, established connections untouched), or
closes its listeners when it went away; then it hands the portal set to the rules backend
if that changed. Nothing is programmed until every source has listed once: a partial view
must never close a listener. Long syncs (10,000 new ports at start) give the event loop back
every few milliseconds, so relays never wait behind them for long.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol as TypingProtocol

from uproxy import heap, metrics
from uproxy.dataplane.balancer import Balancer
from uproxy.dataplane.settings import DataplaneSettings
from uproxy.dataplane.tcp import TcpListener
from uproxy.dataplane.udp import UdpListener
from uproxy.log import V2, kv
from uproxy.model import (
    Endpoint,
    LbAlgorithm,
    Protocol,
    ServicePort,
    ServicePortName,
    ServiceState,
    Traffic,
    categorize,
)
from uproxy.portrange import PortAllocator
from uproxy.rules.base import Portal, PortalKind, RulesBackend, RulesError
from uproxy.rules.nodeports import NodePortError, NodePortReservations
from uproxy.timeslice import TimeSlice
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


class DataplaneLink(TypingProtocol):
    """Where balancer changes go besides the syncer's own balancers: the worker processes.

    The syncer keeps one ``Balancer`` per service port either way (the table, the health
    checks and the in-process listeners read it); with workers, each change is also sent.
    """

    def set_endpoints(
        self, name: ServicePortName, port: ServicePort, endpoints: tuple[Endpoint, ...]
    ) -> None: ...

    def forget(self, name: ServicePortName) -> None: ...


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


REMOVED = "(removed)"  # the listen column of a table row whose service port went away

Hook = Callable[
    [Mapping[ServicePortName, "ProxiedPort"], Collection[ServicePortName]], Awaitable[None]
]


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
    # Laptop mode: the rows of the service table that changed (all of them at first).
    on_table: Callable[[list[TableRow]], None] | None = None
    on_synced: Callable[[], None] | None = None
    extra_hooks: list[Hook] = field(default_factory=list)
    # Data-plane workers (None: the listeners run in this process).
    link: DataplaneLink | None = None


class Syncer:
    """Applies the tracker's changes: listeners and balancers, node ports, rules, hooks.

    Work per sync is proportional to what changed: the tracker names the service ports to
    look at again, each one's portals are kept with it, and the rules backend gets the full
    portal set (kept up to date incrementally) only when it changed, or periodically.
    Endpoint-only changes take a faster road (``apply_endpoints``) outside the rules' rate
    limit: they touch balancers only.
    """

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
        self._portals: dict[ServicePortName, frozenset[Portal]] = {}
        self._all_portals: set[Portal] = set()
        self._rules_dirty = True
        self._last_rules_sync = float("-inf")
        self._force_rules = False
        self._failed: dict[tuple[ServicePortName, Traffic], str] = {}
        self._retry: set[ServicePortName] = set()  # a listener or node port to try again
        self._rows: dict[ServicePortName, TableRow] = {}
        self._nodeport_errors: dict[ServicePortName, str] = {}
        self._skipped_ipv6: set[tuple[ServicePortName, str]] = set()
        self.syncs = 0
        self.last_changed = 0  # service ports the last sync looked at
        self._no_local_internal: set[ServicePortName] = set()
        self._no_local_external: set[ServicePortName] = set()

    def force_rules_sync(self) -> None:
        """The next sync rewrites the rules even if the portal set did not change."""
        self._force_rules = True

    async def sync(self) -> None:
        if not self.tracker.synced:
            log.log(V2, "Not syncing: waiting for the first full listing of every source")
            return
        started = time.perf_counter()
        changes = self.tracker.take_changes()
        todo = changes.ports | self._retry
        self._retry = set()
        opened = closed = 0
        ts = TimeSlice()
        with heap.bulk(len(todo)):
            for spn in sorted(todo):
                state = self.tracker.state(spn)
                if state is None:
                    if spn in self.ports:
                        closed += await self._remove(spn)
                else:
                    opened += await self._ensure(spn, state)
                await ts.tick()
        if opened or closed:
            log.info("Proxy ports changed", extra=kv(opened=opened, closed=closed))
        full = await self._sync_rules() or self.syncs == 0
        for hook in self.options.extra_hooks:
            await hook(self.ports, todo)
        self._emit_table(todo)
        self.syncs += 1
        self.last_changed = len(todo)
        done = time.time()
        took = time.perf_counter() - started
        metrics.SYNC_DURATION.observe(took)
        (metrics.SYNC_FULL_DURATION if full else metrics.SYNC_PARTIAL_DURATION).observe(took)
        metrics.SYNC_LAST_TIMESTAMP.set(done)
        _observe_programming(changes.trigger_times, done)
        if self.options.on_synced is not None:
            self.options.on_synced()

    def apply_endpoints(self) -> frozenset[ServicePortName]:
        """Hand endpoint-only changes to the balancers now; returns the ports touched.

        Nothing here waits: a balancer update is a few tuple operations, so an endpoint
        change reaches new connections within one pass of the loop, whatever the rules'
        rate limit. Before the first sync nothing is taken: that sync takes everything.
        """
        if self.syncs == 0:
            return frozenset()
        changes = self.tracker.take_endpoint_changes()
        touched = set()
        for spn in changes.ports:
            pp = self.ports.get(spn)
            state = self.tracker.state(spn)
            if pp is not None and state is not None:
                pp.port = state.port
                self._update_balancer(spn, pp, state)
                touched.add(spn)
        self._emit_table(touched)
        _observe_programming(changes.trigger_times, time.time())
        return frozenset(touched)

    async def close(self, *, drain: bool = True) -> None:
        """Close every listener; with ``drain``, give connections time to finish."""
        listeners = [lst for pp in self.ports.values() for lst in (pp.cluster, pp.external) if lst]
        for lst in listeners:
            lst.close()
        if drain:  # all at once: one drain deadline for the whole proxy, not one per port
            timeout = self.options.drain_timeout_s
            await asyncio.gather(*(lst.shutdown(timeout) for lst in listeners))
        self.ports.clear()
        if self.options.nodeports is not None:
            self.options.nodeports.close()

    # ----- per service port -----

    async def _ensure(self, spn: ServicePortName, state: ServiceState) -> int:
        """Make one service port's listeners, balancer and node port match ``state``."""
        opened = 0
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
        else:
            if pp.port.port != state.port.port and self.options.laptop and pp.cluster:
                # Laptop mode listens on the service's own port: follow it.
                self._close_listener(spn, pp.cluster)
                pp.cluster = None
            if pp.port.node_port != state.port.node_port:
                self._release_nodeport(spn, pp.port)
        pp.port = state.port
        self._update_balancer(spn, pp, state)
        if pp.cluster is None:
            pp.cluster = await self._open_listener(spn, pp, Traffic.CLUSTER)
            opened += pp.cluster is not None
        if state.port.needs_external_listener:
            if pp.external is None:
                pp.external = await self._open_listener(spn, pp, Traffic.EXTERNAL)
                opened += pp.external is not None
        elif pp.external is not None:
            self._close_listener(spn, pp.external)
            pp.external = None
        self._reserve_nodeport(spn, pp.port)
        self._set_portals(spn, self._portals_of(spn, pp))
        if pp.cluster is None or (state.port.needs_external_listener and pp.external is None):
            self._retry.add(spn)
        return opened

    def _update_balancer(self, spn: ServicePortName, pp: ProxiedPort, state: ServiceState) -> None:
        pp.balancer.update(state.port, state.endpoints)
        if self.options.link is not None:
            self.options.link.set_endpoints(spn, state.port, state.endpoints)
        self._note_no_local(spn, pp, state)

    def _note_no_local(
        self, spn: ServicePortName, pp: ProxiedPort | None, state: ServiceState | None
    ) -> None:
        """kube-proxy's no-local-endpoints gauge: Local policy, endpoints, none of them here."""
        internal = external = False
        if pp is not None and state is not None:
            port = state.port
            if port.internal_policy_local or port.external_policy_local:
                usable = categorize(state.endpoints, local_only=False, node_name="")
                if usable:
                    internal = port.internal_policy_local and not pp.balancer.endpoints(
                        Traffic.CLUSTER
                    )
                    external = (
                        port.external_policy_local
                        and port.has_external
                        and not pp.balancer.endpoints(Traffic.EXTERNAL)
                    )
        for policy, flag, flagged in (
            ("internal", internal, self._no_local_internal),
            ("external", external, self._no_local_external),
        ):
            before = len(flagged)
            if flag:
                flagged.add(spn)
            else:
                flagged.discard(spn)
            if len(flagged) != before:
                metrics.NO_LOCAL_ENDPOINTS.labels(policy).set(len(flagged))

    async def _remove(self, spn: ServicePortName) -> int:
        pp = self.ports.pop(spn)
        closed = 0
        for lst in (pp.cluster, pp.external):
            if lst is not None:
                self._close_listener(spn, lst)
                closed += 1
        self._failed = {k: v for k, v in self._failed.items() if k[0] != spn}
        self._release_nodeport(spn, pp.port)
        self._set_portals(spn, frozenset())
        if self.options.link is not None:
            self.options.link.forget(spn)
        self._note_no_local(spn, None, None)
        if spn.protocol is Protocol.UDP and not self.options.laptop:
            await _clear_conntrack(pp.port)
        log.log(V2, "Removed service port", extra=kv(service=str(spn)))
        return closed

    def _close_listener(self, spn: ServicePortName, lst: Listener) -> None:
        log.log(V2, "Closing proxy port", extra=kv(service=str(spn), port=lst.port))
        lst.close()
        self._allocators[spn.protocol].release(lst.port)

    async def _open_listener(
        self, spn: ServicePortName, pp: ProxiedPort, traffic: Traffic
    ) -> Listener | None:
        alloc = self._allocators[spn.protocol]
        if self.options.laptop and traffic is Traffic.CLUSTER:
            # The service's own port, unless another of our listeners has it: with workers
            # every listener is a SO_REUSEPORT group, and a second group bound to the same
            # port would silently join the first rather than fail.
            own = () if pp.port.port in alloc.in_use else (pp.port.port,)
            candidates: Iterable[int] = (*own, 0)
        else:
            candidates = alloc.candidates(_MAX_BIND_TRIES)
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
            log.log(
                V2,
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

    # ----- node ports -----

    def _reserve_nodeport(self, spn: ServicePortName, sp: ServicePort) -> None:
        """Hold the node port with a real socket; a taken port is one error line, once."""
        reserved = self.options.nodeports
        if reserved is None or not sp.node_port:
            return
        try:
            reserved.reserve(spn, spn.protocol, sp.node_port)
        except NodePortError as e:
            if self._nodeport_errors.get(spn) != str(e):
                log.error("Cannot reserve node port, will retry", extra=kv(error=str(e)))
            self._nodeport_errors[spn] = str(e)
            self._retry.add(spn)
            return
        self._nodeport_errors.pop(spn, None)

    def _release_nodeport(self, spn: ServicePortName, sp: ServicePort) -> None:
        reserved = self.options.nodeports
        self._nodeport_errors.pop(spn, None)
        if reserved is not None and reserved.owner(spn.protocol, sp.node_port) == spn:
            reserved.release(spn.protocol, sp.node_port)

    # ----- rules -----

    def portals(self) -> frozenset[Portal]:
        """The portals the rules must hold: every IPv4 service address of every proxied port."""
        return frozenset(self._all_portals)

    def _set_portals(self, spn: ServicePortName, portals: frozenset[Portal]) -> None:
        old = self._portals.get(spn, frozenset())
        if old == portals:
            return
        self._all_portals.difference_update(old)
        self._all_portals.update(portals)
        if portals:
            self._portals[spn] = portals
        else:
            self._portals.pop(spn, None)
        self._rules_dirty = True

    def _portals_of(self, spn: ServicePortName, pp: ProxiedPort) -> frozenset[Portal]:
        """One service port's portals (IPv4 only: the rules backends program IPv4).

        The IPv6 addresses of a dual-stack service would need ip6 rules (and the proxy ports
        listen on IPv4): they are left out, with one line per address, and never reach a
        backend, where one of them would fail the whole commit for every service.

        With ``externalTrafficPolicy: Local`` and a listener of its own for external traffic,
        the external portals also carry the cluster listener's port: traffic from the cluster
        (the node itself, and pods as ``--detect-local-mode`` tells them) goes there, to every
        endpoint, as kube-proxy short-circuits it. LoadBalancer IPs carry the service's IPv4
        ``loadBalancerSourceRanges`` (kube-proxy filters them by family too).
        """
        if self.options.laptop:
            return frozenset()  # no rules on a laptop: service addresses are not used
        sp = pp.port
        ext = pp.external_port
        short = 0
        if sp.external_policy_local and pp.external is not None and pp.cluster is not None:
            short = pp.cluster.port
        ranges = tuple(r for r in sp.lb_source_ranges if ":" not in r)
        out: set[Portal] = set()
        addresses: list[tuple[PortalKind, tuple[str, ...], int, int, tuple[str, ...]]] = []
        if pp.cluster is not None:
            addresses.append((PortalKind.CLUSTER_IP, sp.cluster_ips, pp.cluster.port, 0, ()))
        if ext is not None:
            addresses.append((PortalKind.EXTERNAL_IP, sp.external_ips, ext, short, ()))
            addresses.append((PortalKind.LB_INGRESS, sp.lb_ingress_ips, ext, short, ranges))
        for kind, ips, proxy_port, cluster_port, allowed in addresses:
            for ip in ips:
                if ":" not in ip:
                    out.add(Portal(spn, kind, ip, sp.port, proxy_port, cluster_port, allowed))
                elif (spn, ip) not in self._skipped_ipv6:
                    self._skipped_ipv6.add((spn, ip))
                    log.warning(
                        "IPv6 service address not proxied: the rules backends program IPv4 only",
                        extra=kv(service=str(spn), ip=ip),
                    )
        reserved = self.options.nodeports
        held = reserved is None or reserved.owner(spn.protocol, sp.node_port) == spn
        if ext is not None and sp.node_port and held:
            out.add(Portal(spn, PortalKind.NODE_PORT, None, sp.node_port, ext, short))
        return frozenset(out)

    async def _sync_rules(self) -> bool:
        """Hand the portal set to the backend when it changed, or every full-sync period.

        The periodic call lets a backend repair what its cheap check cannot see; a backend
        makes it cheap when nothing changed. Returns whether this was a full resync (forced
        or periodic), as kube-proxy's full/partial sync metrics count them.
        """
        now = self._clock()
        stale = now - self._last_rules_sync >= self.options.full_sync_period_s
        full = self._force_rules or stale
        if not (self._rules_dirty or full):
            return False
        portals = frozenset(self._all_portals)
        try:
            await self.rules.sync(portals)
        except RulesError as e:
            self._rules_dirty = True
            if self.rules.name == "iptables-restore":
                metrics.IPTABLES_RESTORE_FAILURES.inc()
            elif self.rules.name == "nftables":
                metrics.NFTABLES_SYNC_FAILURES.inc()
            raise RulesError(f"programming rules with {self.rules.name} failed: {e}") from e
        self._rules_dirty = self._force_rules = False
        self._last_rules_sync = now
        return full

    # ----- the laptop table -----

    def table(self) -> list[TableRow]:
        """Every service port's row, sorted."""
        return [self._row(spn, self.ports[spn]) for spn in sorted(self.ports)]

    def _row(self, spn: ServicePortName, pp: ProxiedPort) -> TableRow:
        listens = [_hostport(lst) for lst in (pp.cluster, pp.external) if lst is not None]
        eps = sorted(pp.balancer.endpoints(Traffic.CLUSTER))
        return TableRow(
            service=str(spn),
            protocol=spn.protocol.value,
            listen=", ".join(listens) or "(not listening)",
            endpoints=", ".join(str(e) for e in eps) or "(none)",
        )

    def _emit_table(self, changed: Collection[ServicePortName]) -> None:
        """Laptop mode: print the rows that changed (every row at first)."""
        if self.options.on_table is None:
            return
        rows: list[TableRow] = []
        for spn in sorted(changed):
            pp = self.ports.get(spn)
            if pp is None:
                if self._rows.pop(spn, None) is not None:
                    rows.append(TableRow(str(spn), spn.protocol.value, REMOVED, ""))
                continue
            row = self._row(spn, pp)
            if self._rows.get(spn) != row:
                self._rows[spn] = row
                rows.append(row)
        if rows or self.syncs == 0:
            self.options.on_table(rows)


def _observe_programming(trigger_times: Iterable[float], done: float) -> None:
    for t in trigger_times:
        metrics.NETWORK_PROGRAMMING_DURATION.observe(max(0.0, done - t))


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
