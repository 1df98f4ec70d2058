"""The syncer: the one place that turns desired state into sockets, balancers and rules.

``sync()`` is idempotent and does work in proportion to what changed. For each service port
the tracker names it opens a listener when the port is new (a second one for external
traffic when the traffic policies make the cluster and external endpoint sets differ),
updates its balancer in place (no listener churn, established connections untouched), or
closes its listeners when it went away; then it hands the portal set to the rules backend
if that changed. Nothing is programmed until every source has listed once: a partial view
must never close a listener. Long syncs (10,000 new ports at start) give the event loop back
every few milliseconds, so relays never wait behind them for long.

Dual-stack: a service port is proxied in each IP family of its ClusterIPs that this node
serves, and each family has its own listeners (on that family's listen address, with proxy
ports from its own range), its own balancer (that family's endpoints only: an IPv4 ClusterIP
never reaches a pod's IPv6 address), its own node-port reservation and its own portals. The
service port stays one ``ServicePortName`` (metrics, logs, the laptop table).
"""

from __future__ import annotations

import asyncio
import errno
import heapq
import itertools
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol as TypingProtocol

from uproxy import heap, metrics
from uproxy.dataplane.balancer import Balancer
from uproxy.dataplane.messages import (
    ComputedChange,
    EndpointChange,
    SetEndpoints,
    change_limit,
    endpoint_changes,
)
from uproxy.dataplane.settings import DataplaneSettings
from uproxy.dataplane.sockets import port_free
from uproxy.dataplane.tcp import TcpListener, drain as drain_listeners
from uproxy.dataplane.udp import UdpListener
from uproxy.log import V2, kv
from uproxy.model import (
    Endpoint,
    IPFamily,
    Protocol,
    ServicePort,
    ServicePortName,
    ServiceState,
    Traffic,
    ip_family,
    spn_order,
)
from uproxy.portrange import PortAllocator
from uproxy.rules.base import Portal, PortalKind, RulesBackend, RulesError
from uproxy.rules.nodeports import NodePortError, NodePortReservations
from uproxy.rules.previous import by_protocol
from uproxy.settings import Settings
from uproxy.timeslice import TimeSlice
from uproxy.tracker import Tracker

log = logging.getLogger("uproxy.syncer")

# Most ports tried for one listener in one sync: keeps a sync bounded when a range is busy.
_MAX_BIND_TRIES = 64
# What failed (a listener, a node port, a laptop listener off its service's port) is tried
# again after this, then twice as long after each sync it still fails, up to the sync period.
RETRY_FIRST_S = 1.0
# ... or this soon when the port a laptop listener wants was closed by the same sync (a
# service renamed, two swapping ports): the workers' copies of it close a moment later.
RETRY_SOON_S = 0.1


class Listener(TypingProtocol):
    @property
    def host(self) -> str: ...

    @property
    def port(self) -> int: ...

    def close(self) -> None: ...

    async def shutdown(self, timeout: float) -> int:
        """Close; let connections finish for up to ``timeout`` seconds; how many were
        still open then and were reset."""
        ...

    @property
    def active(self) -> int: ...


class DataplaneLink(TypingProtocol):
    """Where balancer changes go besides the syncer's own balancers: the worker processes.

    The syncer keeps one ``Balancer`` per service port and family either way (the table, the
    health checks and the in-process listeners read it); with workers, each change is also
    sent.
    """

    def set_endpoints(
        self,
        name: ServicePortName,
        family: IPFamily,
        port: ServicePort,
        endpoints: tuple[Endpoint, ...],
        zone: str | None = None,
        change: ComputedChange | None = None,
    ) -> None:
        """``change``: (the endpoints it was computed from, ``endpoint_changes``' answer), as
        the syncer computed it for its own balancer; used when that is what was last sent."""

    def forget(self, name: ServicePortName, family: IPFamily) -> None: ...

    def when_applied(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once every worker has applied what was sent so far."""


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
class FamilyPort:
    """One IP family of one service port: its balancer (the family's endpoints) and listeners."""

    family: IPFamily
    balancer: Balancer
    cluster: Listener | None = None
    external: Listener | None = None  # only when external traffic needs its own endpoint set
    # What the balancer (and the workers) were last given: the next change is computed
    # against it once, for both.
    given: SetEndpoints | None = None

    @property
    def external_port(self) -> int | None:
        lst = self.external or self.cluster
        return lst.port if lst else None

    @property
    def listeners(self) -> list[Listener]:
        return [lst for lst in (self.cluster, self.external) if lst is not None]


@dataclass(slots=True)
class ProxiedPort:
    """The runtime state of one service port: its spec, and per IP family it is proxied in
    (at least one; the primary first) a ``FamilyPort``."""

    port: ServicePort
    families: dict[IPFamily, FamilyPort] = field(default_factory=dict)

    @property
    def primary(self) -> FamilyPort:
        return next(iter(self.families.values()))

    @property
    def balancer(self) -> Balancer:
        """The primary family's balancer (the only one on a single-stack node)."""
        return self.primary.balancer

    @property
    def cluster(self) -> Listener | None:
        """The primary family's cluster listener."""
        return self.primary.cluster

    @property
    def external(self) -> Listener | None:
        return self.primary.external

    @property
    def listeners(self) -> list[Listener]:
        return [lst for fp in self.families.values() for lst in fp.listeners]


@dataclass(frozen=True, slots=True)
class TableRow:
    service: str
    protocol: str
    listen: str
    endpoints: str


REMOVED = "(removed)"  # the listen column of a table row whose service port went away
TABLE_ENDPOINTS = 10  # endpoints a table row names; "... N more" tells the rest

Hook = Callable[
    [Mapping[ServicePortName, "ProxiedPort"], Collection[ServicePortName]], Awaitable[None]
]


@dataclass(slots=True, kw_only=True)
class SyncerOptions:
    """What the syncer is given: the user's settings and the data plane's view of them (read
    there, never copied here), and what is computed at start or wired to other parts."""

    # Laptop mode (``laptop``), the proxy port range (``port_range``), the longest time
    # between full rules syncs (``iptables_sync_period``).
    settings: Settings
    # What every balancer and listener gets: node name, default algorithm, drain timeout...
    dataplane: DataplaneSettings
    # Where proxy ports listen, one address per IP family this node serves (the primary
    # first): "0.0.0.0" and "::", the --bind-address, or the laptop's loopback addresses.
    listen_hosts: tuple[str, ...]
    # Real sockets holding every node port (node mode); None in laptop mode.
    nodeports: NodePortReservations | None = None
    # Laptop mode: the rows of the service table that changed (all of them at first).
    on_table: Callable[[list[TableRow]], None] | None = None
    on_synced: Callable[[], None] | None = None
    extra_hooks: list[Hook] = field(default_factory=list)
    # Data-plane workers (None: the listeners run in this process).
    link: DataplaneLink | None = None
    # Delete stale UDP conntrack entries (the conntrack tool) as portals come and go: on a
    # node with kernel rules; never in laptop mode or for a syncer under test.
    clear_conntrack: bool = False


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
        self.laptop = options.settings.laptop  # read once: a property, asked per port
        self._open = listener_factory
        self._clock = clock
        self.ports: dict[ServicePortName, ProxiedPort] = {}
        # Where each family's proxy ports listen, the primary family first.
        self.hosts: dict[IPFamily, str] = {ip_family(h): h for h in options.listen_hosts}
        # Proxy ports per protocol and family: 0.0.0.0:P and [::]:P are different sockets.
        # Each made when its first port is wanted (``_allocator``).
        self._allocators: dict[tuple[Protocol, IPFamily], PortAllocator] = {}
        # The node ports (and health-check node ports) services claim, per protocol: never
        # chosen as proxy ports, and a proxy port that one comes to need moves (``_claim``).
        # A node's own traffic to a node port and outside clients reach the proxy ports
        # bound on every address directly, so a proxy port on another service's node port
        # would serve that node port with the wrong service.
        self._avoid: dict[Protocol, set[int]] = {p: set() for p in Protocol}
        self._claims: dict[ServicePortName, tuple[tuple[Protocol, int], ...]] = {}
        self._claimed: dict[tuple[Protocol, int], int] = {}  # how many services claim each
        # Each port's portals as a tuple (one to a few; a frozenset is 216 bytes however
        # small, 2.1 MiB at 10,000 ports); their union, the rules' input, is _all_portals.
        self._portals: dict[ServicePortName, tuple[Portal, ...]] = {}
        # Each port's refusals (its proxy ports without endpoints), kept apart from its
        # portals: endpoint changes move them (``apply_endpoints``), never the portals.
        self._refusals: dict[ServicePortName, tuple[Portal, ...]] = {}
        self._all_portals: set[Portal] = set()
        self._rules_dirty = True
        self._last_rules_sync = float("-inf")
        self._force_rules = False
        self._failed: dict[tuple[ServicePortName, Traffic, IPFamily], str] = {}
        self._retry: set[ServicePortName] = set()  # a listener or node port to try again
        # Each of those ports' backoff: 1 s after its first failure, twice as long after each
        # sync it failed again, up to the sync period. Per port: one port that never binds
        # (a laptop service on port 80) kept a new one waiting 30 s for a port free in 3.
        self._retry_delays: dict[ServicePortName, float] = {}
        self._retry_delay = 0.0  # the soonest of them; 0: nothing failed at the last sync
        # Laptop ports this sync closed; a listener wanting one of them retries soon.
        self._freed: set[tuple[Protocol, int]] = set()
        self._retry_soon = False
        # Listeners opened and closed so far (a sync's "Proxy ports changed" line: its share).
        self._opened = self._closed = 0
        # UDP portals whose conntrack entries go once the next rules write is in: new ones
        # (entries made before their rule) and removed ones (entries leading to a proxy port
        # just closed); and the task forgetting them (``_forget_unnated``).
        self._udp_added: set[Portal] = set()
        self._forgetting: asyncio.Task[None] | None = None
        # The last run's proxy ports (``rules.previous``): by service address, and those
        # held out of this run's choice until the first rules sync is in.
        self._last_run: Mapping[tuple[str, str, int], int] = {}
        self._last_runs_busy = 0  # of those, still bound by another process at this start
        self._held_back: set[tuple[Protocol, IPFamily, int]] = set()
        self._rows: dict[ServicePortName, TableRow] = {}
        self._nodeport_errors: dict[tuple[ServicePortName, IPFamily], str] = {}
        self._unserved: set[ServicePortName] = set()  # reported: no family of ours
        self.syncs = 0
        self.last_changed = 0  # service ports the last sync looked at
        self._no_local_internal: set[ServicePortName] = set()
        self._no_local_external: set[ServicePortName] = set()
        for policy in ("internal", "external"):  # both series from the start, as kube-proxy
            metrics.NO_LOCAL_ENDPOINTS.labels(policy).set(0)
        # This node's zone label as the balancers were last given it (topology hints); a
        # change reaches them with the next sync (``_rezoned``).
        self._zone: str | None = None

    def force_rules_sync(self) -> None:
        """The next sync rewrites the rules even if the portal set did not change."""
        self._force_rules = True

    @property
    def rules_pending(self) -> bool:
        """Whether the rules wait for a sync (a proxy port gained or lost its endpoints)."""
        return self._rules_dirty

    async def sync(self) -> None:
        if not self.tracker.synced:
            log.log(V2, "Not syncing: waiting for the first full listing of every source")
            return
        started = time.perf_counter()
        if self.syncs == 0:
            self._hold_last_runs_ports()
        changes = self.tracker.take_changes()
        todo = changes.ports | self._retry | self._rezoned()
        self._retry = set()
        opened, closed = self._opened, self._closed
        ts = TimeSlice()
        with heap.bulk(len(todo)):
            keep: list[ServicePortName] = []
            # Removals first: their listeners close before new ones open, so a sync that
            # replaces many services never holds both sets of sockets.
            for spn in sorted(todo, key=spn_order):
                state = self.tracker.state(spn)
                if state is None:
                    self._unserved.discard(spn)
                families = self._families_of(spn, state.port) if state is not None else ()
                if state is not None and families:
                    keep.append(spn)
                elif spn in self.ports:
                    await self._remove(spn)
                else:
                    await self._claim(spn, None)  # claimed below by a sync it changed during
                await ts.tick()
            # Then what moves: a port one of them frees (a laptop listener's service port, a
            # node port) is free before another one of this sync claims it.
            for spn in keep:
                pp, state = self.ports.get(spn), self.tracker.state(spn)
                if pp is not None and state is not None:
                    self._follow(spn, pp, state.port)
                    pp.port = state.port
            # And every node port this sync claims is claimed before any listener opens:
            # otherwise one of them went, as a proxy port, to a service that sorts before
            # its claimant (where the proxy ports' range overlaps the node ports), and was
            # moved off it again in the same sync (``_evict``): at a start, where every
            # node port is new, 45-50 listeners opened for nothing at 10,000 services.
            for spn in keep:
                state = self.tracker.state(spn)
                if state is not None:
                    await self._claim(spn, state.port)
                await ts.tick()
            for spn in keep:
                # Each port's state as it is now, never as it was when the sync began: the
                # loop turns (``ts.tick``) let endpoint changes in, which ``apply_endpoints``
                # hands to the balancers at once (or skips, for a port not made yet). An
                # older state must not be written over them.
                state = self.tracker.state(spn)
                families = self._families_of(spn, state.port) if state is not None else ()
                if state is not None and families:  # else changed again: the next sync
                    await self._ensure(spn, state, families)
                await ts.tick()
        opened, closed = self._opened - opened, self._closed - closed
        if opened or closed:
            log.info("Proxy ports changed", extra=kv(opened=opened, closed=closed))
        full = await self._sync_rules() or self.syncs == 0
        self._release_last_runs_ports()  # the rules lead to this run's ports now
        for hook in self.options.extra_hooks:
            await hook(self.ports, todo)
        self._emit_table(todo)
        self._retry_delay = self._next_retry_delay()
        self._freed.clear()
        self._retry_soon = False
        self.syncs += 1
        self.last_changed = len(todo)
        done = time.time()
        took = time.perf_counter() - started
        metrics.SYNC_DURATION.observe(took)
        (metrics.SYNC_FULL_DURATION if full else metrics.SYNC_PARTIAL_DURATION).observe(took)
        metrics.SYNC_LAST_TIMESTAMP.set(done)
        self._observe_programming(changes.trigger_times)
        if self.options.on_synced is not None:
            self.options.on_synced()

    def _next_retry_delay(self) -> float:
        period = self.options.settings.iptables_sync_period
        last = self._retry_delays
        self._retry_delays = {
            spn: min(max(2 * last.get(spn, 0.0), RETRY_FIRST_S), period) for spn in self._retry
        }
        if not self._retry:
            return 0.0
        if self._retry_soon:
            return RETRY_SOON_S
        return min(self._retry_delays.values())

    def retry_after(self) -> float | None:
        """How soon a sync should retry what the last one could not do; None: nothing failed.

        Without it a port taken by someone else (an old uproxy still holding a node port, a
        program on a laptop service's port) waited for the periodic sync."""
        return self._retry_delay or None

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
                for fp in pp.families.values():
                    self._update_balancer(spn, fp, state)
                self._note_no_local(spn, pp, state)
                self._set_refusals(spn, pp, state)
                touched.add(spn)
        self._emit_table(touched)
        self._observe_programming(changes.trigger_times)
        return frozenset(touched)

    def _rezoned(self) -> set[ServicePortName]:
        """When this node's zone label changed (or arrived with the Node), the service ports
        whose endpoints carry zone hints, to choose their endpoints again."""
        node = self.tracker.node
        zone = node.zone if node is not None else None
        if zone == self._zone:
            return set()
        self._zone = zone
        hinted = set()
        for spn in self.ports:
            state = self.tracker.state(spn)
            if state is not None and any(e.zone_hints for e in state.endpoints):
                hinted.add(spn)
        return hinted

    def _observe_programming(self, trigger_times: tuple[float, ...]) -> None:
        """kube-proxy's network programming latency: from each change's trigger time (set by
        the EndpointSlice controller) until the data plane has it, i.e. until every worker
        has applied it (in-process listeners have it now)."""
        if not trigger_times:
            return
        link = self.options.link
        if link is None:
            _programmed_now(trigger_times)
        else:
            link.when_applied(lambda: _programmed_now(trigger_times))

    async def close(self, *, drain: bool = True) -> None:
        """Close every listener; with ``drain``, give connections time to finish."""
        if self._forgetting is not None:
            self._forgetting.cancel()
        listeners = [lst for pp in self.ports.values() for lst in pp.listeners]
        if not drain:
            for lst in listeners:
                lst.close()
        else:  # all at once: one drain deadline for the whole proxy, not one per port
            timeout = self.options.dataplane.drain_timeout_s
            reset = await drain_listeners(listeners, timeout)
            if reset:  # with workers, they relay and say it (``dataplane.worker``)
                log.warning(
                    "Connections still open at the drain deadline were reset",
                    extra=kv(connections=reset, drain_timeout_s=timeout),
                )
        for spn in self.ports:
            metrics.PROXIED.discard(str(spn))
        self.ports.clear()
        if self.options.nodeports is not None:
            self.options.nodeports.close()

    # ----- per service port -----

    def _families_of(self, spn: ServicePortName, sp: ServicePort) -> tuple[IPFamily, ...]:
        """The families this node proxies the port in: those of its ClusterIPs that it serves
        (a service without a ClusterIP, possible in a services file: the primary family)."""
        own = sp.families()
        if not own:
            return tuple(self.hosts)[:1]
        families = tuple(f for f in self.hosts if f in own)
        if not families and spn not in self._unserved:
            self._unserved.add(spn)
            log.warning(
                "Service port not proxied: this node serves no IP family of its ClusterIPs",
                extra=kv(
                    service=str(spn),
                    cluster_ips=",".join(sp.cluster_ips),
                    families=",".join(f.label for f in self.hosts),
                ),
            )
        elif families:
            self._unserved.discard(spn)
        return families

    async def _ensure(
        self, spn: ServicePortName, state: ServiceState, families: tuple[IPFamily, ...]
    ) -> None:
        """Make one service port's families (listeners, balancers, node ports) match."""
        pp = self.ports.get(spn)
        if pp is None:
            pp = self.ports[spn] = ProxiedPort(state.port)
            metrics.PROXIED.add(str(spn), spn.protocol.value)  # its series, at zero so far
            if log.isEnabledFor(V2):  # not even the arguments at 10,000 ports otherwise
                log.log(V2, "Adding service port", extra=kv(service=str(spn)))
        else:
            self._follow(spn, pp, state.port)
        for family in [f for f in pp.families if f not in families]:
            self._drop_family(spn, pp, family)
        pp.port = state.port
        await self._claim(spn, state.port)
        for family in families:
            fp = pp.families.get(family)
            if fp is None:
                fp = pp.families[family] = FamilyPort(family, self._balancer(spn))
            await self._ensure_family(spn, pp, fp, state)
        self._note_no_local(spn, pp, state)
        self._reserve_nodeport(spn, pp)
        self._set_portals(spn, self._portals_of(spn, pp))
        fresh = self.tracker.state(spn)
        if fresh is not None and fresh is not state:
            # Its endpoints changed while a listener opened: the balancers get the newest.
            for fp in pp.families.values():
                self._update_balancer(spn, fp, fresh)
            state = fresh
        self._set_refusals(spn, pp, state)
        needs_external = state.port.needs_external_listener
        for fp in pp.families.values():
            if fp.cluster is None or (needs_external and fp.external is None):
                self._retry.add(spn)
            elif self.laptop and fp.cluster.port != pp.port.port:
                self._retry.add(spn)  # off its service's port: move when that is free

    def _balancer(self, spn: ServicePortName) -> Balancer:
        return Balancer(spn, settings=self.options.dataplane)

    def _follow(self, spn: ServicePortName, pp: ProxiedPort, new: ServicePort) -> None:
        """What a changed spec moves: laptop listeners on the service's port, the node port."""
        if pp.port.port != new.port and self.laptop:
            # Laptop mode listens on the service's own port: follow it.
            for fp in pp.families.values():
                if fp.cluster is not None:
                    self._close_listener(spn, fp, fp.cluster)
                    fp.cluster = None
        if pp.port.node_port != new.node_port:
            self._release_nodeport(spn, pp.port, pp.families)

    def _drop_family(self, spn: ServicePortName, pp: ProxiedPort, family: IPFamily) -> None:
        """The service lost its ClusterIP of this family: its listeners and node port go."""
        fp = pp.families.pop(family)
        for lst in fp.listeners:
            self._close_listener(spn, fp, lst)
        self._release_nodeport(spn, pp.port, (family,))
        self._failed = {k: v for k, v in self._failed.items() if (k[0], k[2]) != (spn, family)}
        if self.options.link is not None:
            self.options.link.forget(spn, family)

    async def _ensure_family(
        self, spn: ServicePortName, pp: ProxiedPort, fp: FamilyPort, state: ServiceState
    ) -> None:
        self._update_balancer(spn, fp, state)
        if fp.cluster is None:
            fp.cluster = await self._open_listener(spn, pp, fp, Traffic.CLUSTER)
        elif self.laptop and fp.cluster.port != pp.port.port:
            await self._move_home(spn, pp, fp)
        if state.port.needs_external_listener:
            if fp.external is None:
                fp.external = await self._open_listener(spn, pp, fp, Traffic.EXTERNAL)
        elif fp.external is not None:
            self._close_listener(spn, fp, fp.external)
            fp.external = None

    def _update_balancer(self, spn: ServicePortName, fp: FamilyPort, state: ServiceState) -> None:
        """Give the balancer (and the workers) the family's endpoints: a big port's change
        of a few as that change (``endpoint_changes``), applied in place."""
        given, zone = fp.given, self._zone
        same = given is not None and given.port == state.port and given.zone == zone
        delta = state.delta
        change: EndpointChange | None = None
        if (
            delta is not None
            and given is not None
            and given.endpoints is delta.base
            and _all_of_family(delta.added, fp.family)
        ):
            # The tracker followed one slice's change from what this family was given last,
            # all of which was of this family: nothing to filter or compare.
            endpoints = state.endpoints
            limit = change_limit(len(delta.base), len(endpoints))
            if same and limit is not None and len(delta.added) + len(delta.removed) <= limit:
                change = (delta.added, delta.removed)
        else:
            endpoints = _of_family(state.endpoints, fp.family)
            if same and given is not None:
                change = endpoint_changes(given.endpoints, endpoints)
        fp.given = SetEndpoints(spn, fp.family, state.port, endpoints, zone)
        if change is None:
            fp.balancer.update(state.port, endpoints, zone)
        else:
            fp.balancer.change(*change)
        if self.options.link is not None:
            base = given.endpoints if given is not None else None
            self.options.link.set_endpoints(
                spn, fp.family, state.port, endpoints, zone, change=(base, change)
            )

    def _note_no_local(
        self, spn: ServicePortName, pp: ProxiedPort | None, state: ServiceState | None
    ) -> None:
        """kube-proxy's no-local-endpoints gauge: Local policy, endpoints, none of them here
        (in any family the port is proxied in)."""
        internal = external = False
        if pp is not None and state is not None:
            port = state.port
            for fp in pp.families.values() if port.has_local_policy else ():
                cluster = fp.balancer.endpoints(Traffic.CLUSTER)
                outside = fp.balancer.endpoints(Traffic.EXTERNAL)
                no_internal = port.internal_policy_local and not cluster
                no_external = port.external_policy_local and port.has_external and not outside
                # The balancers first: the endpoints anywhere are looked at (a pass over a
                # big port's) only when this node has none for a Local policy.
                if (no_internal or no_external) and _usable(state.endpoints, fp.family):
                    internal |= no_internal
                    external |= no_external
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

    async def _remove(self, spn: ServicePortName) -> None:
        pp = self.ports.pop(spn)
        await self._claim(spn, None)
        for fp in pp.families.values():
            for lst in fp.listeners:
                self._close_listener(spn, fp, lst)
            if self.options.link is not None:
                self.options.link.forget(spn, fp.family)
        for traffic in Traffic:
            for family in IPFamily:
                self._failed.pop((spn, traffic, family), None)
        self._release_nodeport(spn, pp.port, pp.families)
        gone = self._portals.get(spn, ())
        self._set_portals(spn, frozenset())
        if spn.protocol is Protocol.UDP and self.options.clear_conntrack:
            # Off the sync, once the rules no longer have them (as kube-proxy clears after
            # its rules): one ``conntrack`` per address here held the sync, and with it
            # every other change's rules, 61 s for 2,000 UDP services removed at once.
            self._udp_added.update(gone)
        self._set_refusals(spn, None, None)
        self._note_no_local(spn, None, None)
        metrics.forget_service(str(spn))  # its series go (workers forget theirs on Forget)
        if log.isEnabledFor(V2):
            log.log(V2, "Removed service port", extra=kv(service=str(spn)))

    async def _claim(self, spn: ServicePortName, sp: ServicePort | None) -> None:
        """Note the node ports ``sp`` claims (None: none any more). A proxy port of ours on
        one it newly claims moves elsewhere now, its rules with it: until then the node port
        could not be held for ``spn``, and reached the other service."""
        claims: tuple[tuple[Protocol, int], ...] = ()
        if sp is not None and not self.laptop:
            if sp.node_port:
                claims += ((spn.protocol, sp.node_port),)
            if sp.health_check_node_port:
                claims += ((Protocol.TCP, sp.health_check_node_port),)
        old = self._claims.get(spn, ())
        if claims == old:
            return
        for key in old:
            n = self._claimed[key] - 1
            if n:
                self._claimed[key] = n
            else:
                del self._claimed[key]
                self._avoid[key[0]].discard(key[1])
        if claims:
            self._claims[spn] = claims
        else:
            self._claims.pop(spn, None)
        for key in claims:
            self._claimed[key] = self._claimed.get(key, 0) + 1
            self._avoid[key[0]].add(key[1])
            if key not in old:
                await self._evict(key, spn)

    async def _evict(self, key: tuple[Protocol, int], claimant: ServicePortName) -> None:
        """Move our proxy ports off a port ``claimant`` claims as a node port. Rare (only
        where the proxy ports' range overlaps the node ports'), so the holder is looked for
        by a pass over the ports."""
        protocol, port = key
        if not any(
            port in alloc.in_use for (p, _), alloc in self._allocators.items() if p is protocol
        ):
            return
        for holder, pp in list(self.ports.items()):
            if holder.protocol is not protocol:
                continue
            for fp in pp.families.values():
                for traffic, lst in (
                    (Traffic.CLUSTER, fp.cluster),
                    (Traffic.EXTERNAL, fp.external),
                ):
                    if lst is None or lst.port != port:
                        continue
                    log.warning(
                        "Moving a proxy port off another service's node port",
                        extra=kv(service=str(holder), port=port, node_port_of=str(claimant)),
                    )
                    self._close_listener(holder, fp, lst)
                    moved = await self._open_listener(holder, pp, fp, traffic)
                    if traffic is Traffic.CLUSTER:
                        fp.cluster = moved
                    else:
                        fp.external = moved
                    if moved is None:
                        self._retry.add(holder)
                    self._set_portals(holder, self._portals_of(holder, pp))
                    self._set_refusals(holder, pp, self.tracker.state(holder))

    def _allocator(self, protocol: Protocol, family: IPFamily) -> PortAllocator:
        alloc = self._allocators.get((protocol, family))
        if alloc is None:
            alloc = PortAllocator(self.options.settings.port_range, avoid=self._avoid[protocol])
            self._allocators[(protocol, family)] = alloc
        return alloc

    async def _move_home(self, spn: ServicePortName, pp: ProxiedPort, fp: FamilyPort) -> None:
        """A laptop listener that opened elsewhere because its service's port was taken
        moves there once that port is free. (Listeners are known by service, traffic and
        family, so the old one closes first; its connections go as at a port change.)"""
        alloc = self._allocator(spn.protocol, fp.family)
        want, old = pp.port.port, fp.cluster
        host = self.hosts[fp.family]
        if old is None or want in alloc.in_use:
            return  # still ours elsewhere: the next retry looks again
        if not port_free(spn.protocol, host, want):
            if (spn.protocol, want) in self._freed:
                # Let go by this sync (another service's listener); the workers' copies
                # close a moment later: look again soon, not after the backoff.
                self._retry_soon = True
            return  # still taken: the next retry looks again
        self._close_listener(spn, fp, old)
        fp.cluster = await self._open_listener(spn, pp, fp, Traffic.CLUSTER)
        if fp.cluster is not None:
            log.info(
                "Proxy port moved to the service's port",
                extra=kv(service=str(spn), address=_hostport(fp.cluster), was=old.port),
            )

    def _close_listener(self, spn: ServicePortName, fp: FamilyPort, lst: Listener) -> None:
        if log.isEnabledFor(V2):
            log.log(V2, "Closing proxy port", extra=kv(service=str(spn), port=lst.port))
        lst.close()
        self._closed += 1
        self._allocators[(spn.protocol, fp.family)].release(lst.port)  # it gave the port
        self._freed.add((spn.protocol, lst.port))

    async def _open_listener(
        self, spn: ServicePortName, pp: ProxiedPort, fp: FamilyPort, traffic: Traffic
    ) -> Listener | None:
        alloc = self._allocator(spn.protocol, fp.family)
        before: int | None = None  # the port the last run's rules lead to, if any
        if self.laptop and traffic is Traffic.CLUSTER:
            # The service's own port, unless another of our listeners has it (that bind
            # would fail: a group's first socket binds without SO_REUSEPORT). Otherwise a
            # port of uproxy's own choosing, as on a node: binding port 0 makes the kernel
            # search for a free port, which grows with every port already bound.
            own = () if pp.port.port in alloc.in_use else (pp.port.port,)
            if (spn.protocol, pp.port.port) in self._freed:
                # Closed by this sync: with workers, theirs close a moment later. The next
                # try comes soon (``_next_retry_delay``), not a second later.
                self._retry_soon = True
            candidates: Iterable[int] = itertools.chain(own, alloc.candidates(_MAX_BIND_TRIES))
        else:
            before = self._last_runs_port(spn, pp, fp, traffic)
            if before in alloc.avoid:
                before = None  # a node port now: the last run's rules lead elsewhere soon
            candidates = itertools.chain(
                () if before is None else (before,), alloc.candidates(_MAX_BIND_TRIES)
            )
        key = (spn, traffic, fp.family)
        last: OSError | None = None
        for port in candidates:
            try:
                lst = await self._open(
                    name=spn,
                    balancer=fp.balancer,
                    traffic=traffic,
                    host=self.hosts[fp.family],
                    port=port,
                    settings=self.options.dataplane,
                )
            except OSError as e:
                last = e
                if port == before and e.errno == errno.EADDRINUSE:
                    self._last_runs_busy += 1  # its workers draining, or an outgoing connection's
                    before = None  # once: the allocator may offer the port again
                if e.errno in (errno.EADDRINUSE, errno.EACCES):
                    continue
                break
            alloc.taken(lst.port)
            self._opened += 1
            self._failed.pop(key, None)
            if log.isEnabledFor(V2):
                log.log(
                    V2,
                    "Opening proxy port",
                    # The address tells the family: "0.0.0.0:40001" or "[::]:40001".
                    extra=kv(service=str(spn), traffic=traffic.value, address=_hostport(lst)),
                )
            return lst
        reason = last.strerror if last and last.strerror else str(last or "no free port in range")
        if self._failed.get(key) != reason:
            log.error(
                "Cannot open proxy port, will retry",
                extra=kv(
                    service=str(spn), traffic=traffic.value, family=fp.family.label, reason=reason
                ),
            )
        self._failed[key] = reason
        return None

    # ----- the last run's proxy ports -----

    def _hold_last_runs_ports(self) -> None:
        """Before the first sync opens anything: the ports the last run's rules lead to are
        kept out of the choice, each for the listener of its own service address (see
        ``rules.previous``): until this run's rules are in, an old rule reaches the right
        service or a closed port, never another service."""
        self._last_run = getattr(self.rules, "previous_ports", None) or {}
        for proto, ports in by_protocol(self._last_run).items():
            protocol = Protocol(proto.upper())
            for family in self.hosts:
                alloc = self._allocator(protocol, family)
                for port in ports:
                    if port not in alloc.in_use:
                        alloc.taken(port)
                        self._held_back.add((protocol, family, port))
        if self._held_back:
            log.info(
                "Reusing the last run's proxy ports while its rules are still in place",
                extra=kv(addresses=len(self._last_run)),
            )

    def _last_runs_port(
        self, spn: ServicePortName, pp: ProxiedPort, fp: FamilyPort, traffic: Traffic
    ) -> int | None:
        """The port the last run's rules send this listener's traffic to, if held back."""
        if not self._held_back:
            return None
        proto, sp, family = spn.protocol.value.lower(), pp.port, fp.family
        keys: list[tuple[str, str, int]] = []
        if traffic is Traffic.CLUSTER:
            keys = [(ip, proto, sp.port) for ip in sp.cluster_ips if ip_family(ip) is family]
        else:
            ips = (*sp.external_ips, *sp.lb_ingress_ips)
            keys = [(ip, proto, sp.port) for ip in ips if ip_family(ip) is family]
            if sp.node_port:
                keys.append(("", proto, sp.node_port))
        for key in keys:
            port = self._last_run.get(key)
            if port is not None and (spn.protocol, family, port) in self._held_back:
                self._held_back.discard((spn.protocol, family, port))
                self._allocator(spn.protocol, family).release(port)
                return port
        return None

    def _release_last_runs_ports(self) -> None:
        if self._last_runs_busy:
            log.info(
                "Some of the last run's proxy ports are taken (its workers draining, or a "
                "connection given one as its local port): "
                "those services have new ones, and the rules lead there now",
                extra=kv(held=self._last_runs_busy),
            )
            self._last_runs_busy = 0
        for protocol, family, port in self._held_back:
            self._allocator(protocol, family).release(port)
        self._held_back.clear()
        self._last_run = {}

    # ----- node ports -----

    def _reserve_nodeport(self, spn: ServicePortName, pp: ProxiedPort) -> None:
        """Hold the node port in each family with real sockets; a taken port is one error
        line, once."""
        reserved = self.options.nodeports
        sp = pp.port
        if reserved is None or not sp.node_port:
            return
        for family in pp.families:
            try:
                reserved.reserve(spn, spn.protocol, sp.node_port, family)
            except NodePortError as e:
                if (spn.protocol, sp.node_port) in self._freed:
                    # Our own proxy port until this sync moved it (``_evict``); with workers
                    # their copies of its socket close a moment later.
                    self._retry_soon = True
                elif self._nodeport_errors.get((spn, family)) != str(e):
                    log.error("Cannot reserve node port, will retry", extra=kv(error=str(e)))
                self._nodeport_errors[(spn, family)] = str(e)
                self._retry.add(spn)
                continue
            self._nodeport_errors.pop((spn, family), None)

    def _release_nodeport(
        self, spn: ServicePortName, sp: ServicePort, families: Iterable[IPFamily]
    ) -> None:
        reserved = self.options.nodeports
        for family in list(families):
            self._nodeport_errors.pop((spn, family), None)
            if reserved is not None and reserved.owner(spn.protocol, sp.node_port, family) == spn:
                reserved.release(spn.protocol, sp.node_port, family)

    # ----- rules -----

    def portals(self) -> frozenset[Portal]:
        """The portals the rules must hold: every service address of every proxied port."""
        return frozenset(self._all_portals)

    def _set_portals(self, spn: ServicePortName, portals: frozenset[Portal]) -> None:
        old = self._portals.get(spn, ())
        if len(old) == len(portals) and portals.issuperset(old):
            return
        self._all_portals.difference_update(old)
        self._all_portals.update(portals)
        if portals:
            self._portals[spn] = tuple(portals)
        else:
            self._portals.pop(spn, None)
        self._rules_dirty = True
        if spn.protocol is Protocol.UDP and self.options.clear_conntrack:
            self._udp_added.difference_update(old)
            self._udp_added.update(portals.difference(old))

    def _set_refusals(
        self, spn: ServicePortName, pp: ProxiedPort | None, state: ServiceState | None
    ) -> None:
        new = self._refusals_of(spn, pp, state) if pp is not None and state is not None else ()
        old = self._refusals.get(spn, ())
        if new == old:
            return
        self._all_portals.difference_update(old)
        self._all_portals.update(new)
        if new:
            self._refusals[spn] = new
        else:
            self._refusals.pop(spn, None)
        self._rules_dirty = True
        if spn.protocol is Protocol.UDP and self.options.clear_conntrack:
            # A UDP client that keeps its socket (a resolver's forwarder) has a conntrack
            # entry, and the REJECT rule sees new flows only: its datagrams went on reaching
            # the proxy port, to be dropped there, where kube-proxy's deletion of the dead
            # endpoints' entries lets its REJECT answer. Its entries go once the rule is in.
            def rejected(refusals: tuple[Portal, ...]) -> set[IPFamily]:
                return {p.family for p in refusals if p.kind is PortalKind.NO_ENDPOINTS}

            families = rejected(new) - rejected(old)
            if families:
                self._udp_added.update(
                    p for p in self._portals.get(spn, ()) if p.family in families
                )

    def _refusals_of(
        self, spn: ServicePortName, pp: ProxiedPort, state: ServiceState
    ) -> tuple[Portal, ...]:
        """The proxy ports of one service port whose traffic has no endpoint to go to.

        As kube-proxy filters a service's traffic: rejected when the port has no usable
        endpoint at all (of that family), dropped when it has some but none for this
        listener's traffic (a Local policy without an endpoint on this node). The balancers
        already hold what each traffic class may use; the usable endpoints anywhere are
        looked at only for a listener that has none (the rare case).
        """
        if self.laptop:
            return ()  # no rules: a port without endpoints accepts and resets
        out: list[Portal] = []
        for fp in pp.families.values():
            anywhere: bool | None = None
            for lst, traffic in ((fp.cluster, Traffic.CLUSTER), (fp.external, Traffic.EXTERNAL)):
                if lst is None or fp.balancer.endpoints(traffic):
                    continue
                if anywhere is None:
                    anywhere = _usable(state.endpoints, fp.family)
                out.append(Portal.refusing(spn, lst.port, fp.family, anywhere=anywhere))
        return tuple(out)

    def _portals_of(self, spn: ServicePortName, pp: ProxiedPort) -> frozenset[Portal]:
        """One service port's portals, in each family it is proxied in.

        Each family's service addresses (ClusterIPs, externalIPs, LoadBalancer IPs) lead to
        that family's proxy ports, and the node port is one portal per family (the node's
        addresses of that family); addresses of a family the port is not proxied in are left
        out, as kube-proxy's per-family proxiers ignore them. LoadBalancer IPs carry the
        ``loadBalancerSourceRanges`` of their family (kube-proxy filters them by family too).

        With ``externalTrafficPolicy: Local`` and a listener of its own for external traffic,
        the external portals also carry the cluster listener's port: traffic from the cluster
        (the node itself, and pods as ``--detect-local-mode`` tells them) goes there, to every
        endpoint, as kube-proxy short-circuits it.
        """
        if self.laptop:
            return frozenset()  # no rules on a laptop: service addresses are not used
        out: list[Portal] = []
        for fp in pp.families.values():
            self._family_portals(spn, pp.port, fp, out)
        return frozenset(out)

    def _family_portals(
        self, spn: ServicePortName, sp: ServicePort, fp: FamilyPort, out: list[Portal]
    ) -> None:
        # Once per service port at every sync that touches it (10,000 at a cold start): the
        # usual port, a ClusterIP and nothing external, takes the first branch alone.
        family = fp.family
        if fp.cluster is not None:
            for ip in sp.cluster_ips:
                if ip_family(ip) is family:
                    out.append(
                        Portal(spn, PortalKind.CLUSTER_IP, ip, sp.port, fp.cluster.port, 0, ())
                    )
        ext = fp.external_port
        if ext is None:
            return
        short = 0
        if sp.external_policy_local and fp.external is not None and fp.cluster is not None:
            short = fp.cluster.port
        ranges = tuple(r for r in sp.lb_source_ranges if ip_family(r) is family)
        for kind, ips, allowed in (
            (PortalKind.EXTERNAL_IP, sp.external_ips, ()),
            (PortalKind.LB_INGRESS, sp.lb_ingress_ips, ranges),
        ):
            for ip in ips:
                if ip_family(ip) is family:
                    out.append(Portal(spn, kind, ip, sp.port, ext, short, allowed))
        reserved = self.options.nodeports
        if sp.node_port and (
            reserved is None or reserved.owner(spn.protocol, sp.node_port, family) == spn
        ):
            out.append(
                Portal(spn, PortalKind.NODE_PORT, None, sp.node_port, ext, short, (), family)
            )

    async def _sync_rules(self) -> bool:
        """Hand the portal set to the backend when it changed, or every full-sync period.

        The periodic call lets a backend repair what its cheap check cannot see; a backend
        makes it cheap when nothing changed. Returns whether this was a full resync (forced
        or periodic), as kube-proxy's full/partial sync metrics count them.
        """
        now = self._clock()
        stale = now - self._last_rules_sync >= self.options.settings.iptables_sync_period
        full = self._force_rules or stale
        if not (self._rules_dirty or full):
            return False
        portals = frozenset(self._all_portals)
        # Cleared before the write, not after it: endpoints that come while it is in flight
        # (a new service's slice, mostly, right behind the Service) change the portals again,
        # and must leave the rules pending for the next sync.
        forced, self._rules_dirty, self._force_rules = self._force_rules, False, False
        try:
            await self.rules.sync(portals)
        except BaseException as e:  # whatever stopped it (a stop's cancel too): not written
            self._rules_dirty = True
            self._force_rules = self._force_rules or forced
            if not isinstance(e, RulesError):
                raise
            if self.rules.name == "iptables-restore":
                metrics.IPTABLES_RESTORE_FAILURES.inc()
            elif self.rules.name == "nftables":
                metrics.NFTABLES_SYNC_FAILURES.inc()
            raise RulesError(f"programming rules with {self.rules.name} failed: {e}") from e
        self._last_rules_sync = now
        if self._udp_added:
            added, self._udp_added = self._udp_added, set()
            self._forgetting = asyncio.create_task(
                _forget_unnated(added, self._forgetting), name="udp-conntrack"
            )
        return full

    # ----- the laptop table -----

    def table(self) -> list[TableRow]:
        """Every service port's row, sorted."""
        return [self._row(spn, self.ports[spn]) for spn in sorted(self.ports, key=spn_order)]

    def _row(self, spn: ServicePortName, pp: ProxiedPort) -> TableRow:
        listens = [_hostport(lst) for lst in pp.listeners]
        pools = [fp.balancer.endpoints(Traffic.CLUSTER) for fp in pp.families.values()]
        count = sum(len(pool) for pool in pools)
        # The first few in address order: a row is read by a person, and a port of 20,000
        # endpoints took 130 ms to sort and print at each change of one of them.
        first = heapq.nsmallest(TABLE_ENDPOINTS, itertools.chain(*pools), key=_numeric_order)
        shown = ", ".join(str(e) for e in first) or self._none_here(spn, pp)
        if count > len(first):
            shown += f", ... {count - len(first):,} more"
        return TableRow(
            service=str(spn),
            protocol=spn.protocol.value,
            listen=", ".join(listens) or "(not listening)",
            endpoints=shown,
        )

    def _none_here(self, spn: ServicePortName, pp: ProxiedPort) -> str:
        """The endpoints cell of a row without any: why, when the service has endpoints only
        of a family this port is not proxied in (IPv4 ones behind ``--bind-address ::1``,
        say), which it never uses; else "(none)"."""
        state = self.tracker.state(spn)
        others: dict[str, int] = {}
        for ep in state.endpoints if state is not None else ():
            family = ip_family(ep.ip)
            if family not in pp.families:
                others[family.label] = others.get(family.label, 0) + 1
        if not others:
            return "(none)"
        listed = ", ".join(f"{n} {label}" for label, n in sorted(others.items()))
        here = "/".join(f.label for f in pp.families)
        return f"(none of {here}; {listed} not used here)"

    def _emit_table(self, changed: Collection[ServicePortName]) -> None:
        """Laptop mode: print the rows that changed (every row at first)."""
        if self.options.on_table is None:
            return
        rows: list[TableRow] = []
        for spn in sorted(changed, key=spn_order):
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


def _usable(endpoints: tuple[Endpoint, ...], family: IPFamily) -> bool:
    """Whether traffic of this family has an endpoint anywhere (``categorize`` without a
    Local policy is not empty: one ready, else one serving and terminating), found by the
    first that is."""
    v6 = family is IPFamily.V6
    return any(ep.ready and (":" in ep.ip) is v6 for ep in endpoints) or any(
        ep.serving and ep.terminating and (":" in ep.ip) is v6 for ep in endpoints
    )


def _all_of_family(endpoints: tuple[Endpoint, ...], family: IPFamily) -> bool:
    v6 = family is IPFamily.V6
    return all((":" in ep.ip) is v6 for ep in endpoints)


def _of_family(endpoints: tuple[Endpoint, ...], family: IPFamily) -> tuple[Endpoint, ...]:
    """The endpoints a family's service addresses may reach: that family's only (the test
    of ``ip_family``, inline: this runs over a big port's every endpoint at each change)."""
    v6 = family is IPFamily.V6
    out = tuple([ep for ep in endpoints if (":" in ep.ip) is v6])
    return endpoints if len(out) == len(endpoints) else out


def _programmed_now(trigger_times: Iterable[float]) -> None:
    done = time.time()
    for t in trigger_times:
        metrics.NETWORK_PROGRAMMING_DURATION.observe(max(0.0, done - t))


def _numeric_order(endpoint: Endpoint) -> tuple[bool, bytes, int]:
    """An endpoint's place in a table row: by address as a number (10.1.0.9 before
    10.1.0.10, IPv4 before IPv6), not as text."""
    v6 = ":" in endpoint.ip
    return (
        v6,
        socket.inet_pton(socket.AF_INET6 if v6 else socket.AF_INET, endpoint.ip),
        endpoint.port,
    )


def _hostport(lst: Listener) -> str:
    host = f"[{lst.host}]" if ":" in lst.host else lst.host
    return f"{host}:{lst.port}"


async def _forget_unnated(portals: Collection[Portal], before: asyncio.Task[None] | None) -> None:
    """Delete the UDP conntrack entries to portals that just reached the rules, or just
    left them.

    A UDP client that sent to a service address before its rule existed (a service added, an
    address given to it, uproxy restarted onto new proxy ports) has a conntrack entry without
    the translation, or with the old one, and keeps it while it keeps sending: its datagrams
    never reach the proxy port. kube-proxy deletes such entries for services that became
    active, and those of services removed. Off the sync, the whole batch at once (one read
    of the table, ``forget_udp``); after the previous batch.
    """
    from uproxy.rules.conntrack import forget_udp, node_port_target, udp_target

    if before is not None:
        # Waited for, not awaited: however that batch ended is no reason to skip this one,
        # but this task's own cancellation (a stop) ends it, and the batches before it.
        # Awaited inside a suppress, the stop's cancel was taken for that batch's end, and
        # every conntrack ran anyway.
        try:
            await asyncio.wait([before])
        except asyncio.CancelledError:
            before.cancel()
            raise
        if not before.cancelled():
            before.exception()  # retrieved: that batch said what failed
    targets = set()
    for portal in portals:
        if portal.kind is PortalKind.NODE_PORT:
            targets.add(node_port_target(portal.port, ipv6=portal.node_family is IPFamily.V6))
        elif portal.ip is not None:
            targets.add(udp_target(portal.ip, portal.port))
    try:
        await forget_udp(targets)
    except RulesError as exc:
        log.warning(
            "Cannot forget the UDP conntrack entries of service addresses",
            extra=kv(addresses=len(targets), err=exc),
        )
