"""Endpoint selection for one service port: round-robin, random or least-connections, with
ClientIP affinity.

The syncer owns one ``Balancer`` per service port and calls ``update`` with the port and
its merged endpoints on every sync; listeners call ``pick`` for each new connection or UDP
flow. ``pick`` is on the connection-setup hot path, so the work happens in ``update``: the
cluster and external endpoint sets are computed there once (kube-proxy's categorisation,
``uproxy.model.categorize``), and ``pick`` is an index step or one dict lookup. A worker's
balancer of many endpoints is also sent changes as changes (``change``: those that came or
changed, the addresses of those gone), which it applies in place.

Round-robin order is shuffled whenever an endpoint set changes, so that all proxies in a
cluster do not start on the same endpoint after a rollout (the original userspace mode
did the same); a change applied in place puts each endpoint that came at a random place
instead, which keeps the order a uniform shuffle. ClientIP affinity follows the userspace
mode too: an affinity hit does not advance the round-robin position, the entry's timer
restarts on every use, and a failed dial forgets the client so the retry lands elsewhere.

An endpoint whose dials keep failing is left out of the choice for a while (passive
ejection, ``DataplaneSettings.eject_after``): after that many failures in a row, for one
second, then twice as long each time its first dial back fails too, up to 30 s; a dial that
succeeds, or the endpoint leaving the EndpointSlices, forgets it all (UDP has no dial: a flow
the endpoint refuses is a failure, its first reply a success; ``uproxy.dataplane.udp``). Out
means not picked while another endpoint can be: when every endpoint a connection could use
is out, or has been tried, ejection is ignored (a dial that may fail beats a refusal that
will). Each worker learns on its own, from its own dials. ``pick`` pays for this only while some
endpoint of the port has failed.

Least-connections (IPVS's ``lc``, HAProxy's ``leastconn``) sends a new connection, or a new
UDP flow, to the endpoint with the fewest open in this worker, equal ones in round-robin
order, so that long-lived connections (databases, gRPC, websockets) do not pile up on the
endpoints that happened to get them. An open connection counts from the moment it is picked
(a burst of connections that all arrive before any dial completes spreads too) until it ends
or its dial fails; callers ``release`` what ``pick`` counted (``counting`` says whether it
did). Each worker counts its own connections, as each learns its own failures: with several
workers the choice is least-connections per worker. Connections opened before a switch to
least-connections are not counted. Only a least-connections port keeps counts, and its
``pick`` looks at each endpoint of the pool (as IPVS's ``lc`` does); the others keep no counts.
"""

from __future__ import annotations

import logging
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Container, Iterable, Mapping, Sequence

from uproxy.dataplane import series
from uproxy.dataplane.settings import DataplaneSettings
from uproxy.log import V2, kv
from uproxy.model import Endpoint, LbAlgorithm, ServicePort, ServicePortName, Traffic, categorize

log = logging.getLogger("uproxy.dataplane.balancer")

# One generator for every balancer: a Random holds 2.5 KB of state and seeds itself from
# os.urandom, 25 MB and 4 % of the start-up profile at 10,000 service ports. The data plane
# runs on one thread, so sharing it is safe; tests pass their own seeded one.
_RNG = random.Random()
# Enum members as module globals: ``Traffic.EXTERNAL`` is ~60 ns per access on Python 3.11
# (the enum's class attribute path), a global ~8; ``pick`` runs for every connection.
_EXTERNAL = Traffic.EXTERNAL
_RANDOM = LbAlgorithm.RANDOM

# Up to this many endpoints a pool tests membership on its order (a tuple) rather than a
# frozenset: a frozenset is 216 bytes however small (2 MB at 10,000 one-endpoint ports),
# and a scan of a few endpoints that usually stops at the same object (identity is tested
# before equality) is faster than hashing an Endpoint.
_SCAN_MEMBERS = 8
_NO_IPS: frozenset[str] = frozenset()  # shared: an empty frozenset is 216 bytes too
_NO_ENDPOINTS: frozenset[Endpoint] = frozenset()


def _addresses(endpoints: Iterable[Endpoint]) -> dict[tuple[str, int], Endpoint]:
    return {(ep.ip, ep.port): ep for ep in endpoints}


def _by_address(
    failing: Mapping[Endpoint, _Failing], current: Mapping[tuple[str, int], Endpoint]
) -> dict[Endpoint, _Failing]:
    """The failing endpoints still there, each as it is now (its conditions or hints may have
    changed: its failures are its address's)."""
    out: dict[Endpoint, _Failing] = {}
    for ep, state in failing.items():
        now = current.get((ep.ip, ep.port))
        if now is not None:
            out[now] = state
    return out


class _Pool:
    """The endpoints one traffic class may use, in round-robin order.

    ``members`` is only for membership tests (``in``): the order itself for a small pool,
    a frozenset beyond ``_SCAN_MEMBERS``. A pool that follows changes of the endpoints in
    place (``Balancer.change``, ``thawed``) has a list for its order and a dict of each
    member's index in it.
    """

    __slots__ = ("members", "order", "position")

    def __init__(self, order: tuple[Endpoint, ...], members: frozenset[Endpoint]) -> None:
        """``members``: the set of ``order``."""
        self.order: Sequence[Endpoint] = order
        self.members: Collection[Endpoint] = order if len(order) <= _SCAN_MEMBERS else members
        self.position = 0

    def holds_exactly(self, selected: frozenset[Endpoint]) -> bool:
        """Whether ``selected`` is this pool's set of endpoints."""
        if not self.order or not selected:  # a new balancer's first update, mostly
            return not self.order and not selected
        members = self.members  # a frozenset, a dict, or the order itself for a small pool
        if isinstance(members, frozenset):
            return selected == members
        if isinstance(members, dict):
            return selected == members.keys()
        return selected == frozenset(members)

    def thawed(self) -> _Pool:
        """This pool as one that follows changes in place (``add``, ``discard``): itself if
        it is one already, else a copy in the same order (linear, once)."""
        if isinstance(self.members, dict):
            return self
        pool = _Pool((), _NO_ENDPOINTS)
        order = list(self.order)
        pool.order = order
        pool.members = {ep: at for at, ep in enumerate(order)}
        pool.position = self.position
        return pool

    def add(self, ep: Endpoint, rng: random.Random) -> None:
        """Put ``ep`` (not a member) at a random place: the one there moves to the end, so an
        order that was a uniform shuffle stays one (Fisher-Yates, "inside-out")."""
        order, members = self.order, self.members
        assert isinstance(order, list) and isinstance(members, dict)  # thawed
        n = len(order)
        at = rng.randrange(n + 1)
        if at < n:
            moved = order[at]
            order.append(moved)
            members[moved] = n
            order[at] = ep
        else:
            order.append(ep)
        members[ep] = at

    def discard(self, ep: Endpoint) -> None:
        """Take ``ep`` out if it is a member: the last one takes its place."""
        order, members = self.order, self.members
        assert isinstance(order, list) and isinstance(members, dict)  # thawed
        at = members.pop(ep, None)
        if at is None:
            return
        last = order.pop()
        if at < len(order):
            order[at] = last
            members[last] = at
        if self.position >= len(order):
            self.position = 0


# Every balancer's pools until its first endpoint; never picked from.
_EMPTY = _Pool((), _NO_ENDPOINTS)


# What a cluster-wide pool holds (``model.categorize`` and ``model.topology``), told apart by
# ``_Index.choice``: the ready endpoints hinted for this node, those hinted for its zone, all
# the ready ones, or (none ready) the terminating ones.
_FOR_NODE, _FOR_ZONE, _ALL_READY, _FALLBACK = range(4)


class _Index:
    """A balancer's endpoints by address, kept once they change as changes (``Balancer.change``):
    all of them, those on this node, and counts of the ready ones by their topology hints, from
    which the choice of a cluster-wide pool follows without a pass over them.

    ``pools``: while some traffic class picks cluster-wide, a pool for each choice that has
    endpoints (``_join``), all of them following each change, so that a change that turns
    the choice (the last endpoint without hints gone or one come, the last ready endpoint
    gone) takes the other pool as it is. Computed whole there, a pool took 7-16 ms at 20,000
    endpoints with zone hints; a hints toggle by the EndpointSlice controller comes in steps
    (``messages.endpoint_steps``), one of which turns the choice. The price: a port on
    topology hints keeps its ready endpoints in two pools, those of its zone and all of them.
    """

    __slots__ = (
        "by_address",
        "for_node",
        "for_zone",
        "local",
        "node",
        "node_hinted",
        "pools",
        "ready",
        "zone",
        "zone_hinted",
    )

    def __init__(self, endpoints: Sequence[Endpoint], node: str, zone: str | None) -> None:
        self.node, self.zone = node, zone
        # One pass: 2.4-3.9 ms at 20,000 endpoints without hints, where three comprehensions
        # took 5.6-6.3.
        by_address: dict[tuple[str, int], Endpoint] = {}
        local: dict[tuple[str, int], Endpoint] = {}
        ready = 0
        hinted: list[Endpoint] = []
        for ep in endpoints:
            address = (ep.ip, ep.port)
            by_address[address] = ep
            if ep.node_name == node:
                local[address] = ep
            if ep.ready:
                ready += 1
                if ep.node_hints or ep.zone_hints:
                    hinted.append(ep)
        self.by_address, self.local, self.ready = by_address, local, ready
        self.node_hinted = self.zone_hinted = self.for_node = self.for_zone = 0
        for ep in hinted:
            self.count_hints(ep, 1)
        self.pools: dict[int, _Pool] | None = None  # see ``keep_pools``

    def count(self, ep: Endpoint, step: int) -> None:
        """Count ``ep`` in (``step`` 1) or out (-1)."""
        if ep.ready:
            self.ready += step
            if ep.node_hints or ep.zone_hints:
                self.count_hints(ep, step)

    def count_hints(self, ep: Endpoint, step: int) -> None:
        if ep.node_hints:
            self.node_hinted += step
            if self.node in ep.node_hints:
                self.for_node += step
        if ep.zone_hints:
            self.zone_hinted += step
            if self.zone and self.zone in ep.zone_hints:
                self.for_zone += step

    def choice(self) -> int:
        """What the cluster-wide pool holds: hints count only when every ready endpoint has
        one of the kind and one names this node (zone), as ``model.topology`` reads them."""
        if not self.ready:
            return _FALLBACK
        if self.node_hinted == self.ready and self.for_node:
            return _FOR_NODE
        if self.zone and self.zone_hinted == self.ready and self.for_zone:
            return _FOR_ZONE
        return _ALL_READY

    def keep_pools(self, endpoints: Sequence[Endpoint], current: _Pool, rng: random.Random) -> None:
        """Start ``pools`` (once, linear): ``current``, the cluster-wide pool computed for
        ``endpoints`` as they are, for the choice they make, and one for each other choice
        that has endpoints."""
        choice = self.choice()
        self.pools = {}
        if current.order:
            self.pools[choice] = current.thawed()
        for ep in endpoints:
            self._join(ep, rng, skip=choice)

    def follow(self, gone: list[Endpoint], new: list[Endpoint], rng: random.Random) -> None:
        """Apply a change to every pool: ``gone`` leave, ``new`` join those that take them
        (a pool with none left goes)."""
        pools = self.pools
        assert pools is not None
        for ep in gone:
            for pool in pools.values():
                pool.discard(ep)
        for ep in new:
            self._join(ep, rng)
        if gone:
            for choice in [c for c, pool in pools.items() if not pool.order]:
                del pools[choice]

    def _join(self, ep: Endpoint, rng: random.Random, skip: int | None = None) -> None:
        """Put ``ep`` in the pool of each choice that takes it (but ``skip``): every ready
        endpoint in all-ready's, those hinted for this node (zone) in its, the terminating
        ones still serving in the fallback's."""
        if ep.ready:
            choices = [_ALL_READY]
            if self.node in ep.node_hints:
                choices.append(_FOR_NODE)
            if self.zone in ep.zone_hints:  # never None: hints are names
                choices.append(_FOR_ZONE)
        elif ep.serving and ep.terminating:
            choices = [_FALLBACK]
        else:
            return
        pools = self.pools
        assert pools is not None
        for choice in choices:
            if choice != skip:
                pool = pools.get(choice)
                if pool is None:
                    pool = pools[choice] = _EMPTY.thawed()
                pool.add(ep, rng)


class _PoolAddresses:
    """Whether a pool holds the endpoint at an address, through the balancer's index."""

    __slots__ = ("_by_address", "_members")

    def __init__(
        self, by_address: dict[tuple[str, int], Endpoint], members: dict[Endpoint, int]
    ) -> None:
        self._by_address = by_address
        self._members = members

    def __contains__(self, address: object) -> bool:
        ep = self._by_address.get(address)  # type: ignore[call-overload]
        return ep is not None and ep in self._members


class _ServingAddresses:
    """Whether an endpoint at an address is in the EndpointSlices and serving, through the
    balancer's endpoints by address."""

    __slots__ = ("_by_address",)

    def __init__(self, by_address: Mapping[tuple[str, int], Endpoint]) -> None:
        self._by_address = by_address

    def __contains__(self, address: object) -> bool:
        ep = self._by_address.get(address)  # type: ignore[call-overload]
        return ep is not None and ep.serving


class _Failing:
    """An endpoint's failed dials: how many in a row since it was last out (or ever), until
    when it is out (a ``clock`` time), how many times in a row it has been out."""

    __slots__ = ("ejections", "failures", "until")

    def __init__(self) -> None:
        self.failures = 0
        self.until = 0.0
        self.ejections = 0


class Balancer:
    """Chooses an endpoint for a client; see the module docstring for the rules.

    A worker keeps one per service port and family, most of them idle, so its state is
    kept small: slots; one pool for both traffic classes while they select alike (the same
    traffic policies: then there is no external listener, and nothing picks from the
    external pool on its own); shared empties; the affinity table only while affinity is
    on; of the service port, only what selection depends on. In a worker at 10,000
    one-endpoint TCP ports (tracemalloc) a balancer went from 1,470 bytes to 240, besides
    its endpoints, and the ServicePort it no longer keeps (about 250 bytes).
    """

    __slots__ = (
        "_affinity",
        "_affinity_s",
        "_algorithm",
        "_clock",
        "_cluster",
        "_endpoints",
        "_external",
        "_external_local",
        "_failing",
        "_index",
        "_internal_local",
        "_load",
        "_local_ips",
        "_rng",
        "_settings",
        "_watchers",
        "_zone",
        "counting",
        "name",
    )

    def __init__(
        self,
        name: ServicePortName,
        *,
        settings: DataplaneSettings,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.name = name
        self._settings = settings  # the node's name and the default algorithm among them
        self._clock = clock
        self._rng = rng if rng is not None else _RNG
        # What ``update`` computes from, as it would be for no endpoints and a default port:
        # an update that changes none of it changes nothing (see ``_unchanged``).
        self._algorithm = settings.default_algorithm
        self._affinity_s: float | None = None
        self._internal_local = False
        self._external_local = False
        self._zone: str | None = None
        # Every endpoint, as last given whole; None once changes apply in place (the index
        # holds them: ``_every``). A tuple rebuilt on each change was linear in them: at
        # 20,000, 0.1-0.2 ms a change, and a big change comes in parts (``APPLY_PART``).
        self._endpoints: tuple[Endpoint, ...] | None = ()
        self._cluster = self._external = _EMPTY
        self._local_ips = _NO_IPS
        self._index: _Index | None = None  # built by the first ``change``, until an ``update``
        # client IP -> (endpoint, last use); ordered by last use, oldest first. None while
        # affinity is off: an empty OrderedDict is 128 bytes.
        self._affinity: OrderedDict[str, tuple[Endpoint, float]] | None = None
        # Endpoints whose last dials failed; None while none has (see the module docstring).
        self._failing: dict[Endpoint, _Failing] | None = None
        # Called after every update that changed something: UDP listeners drop their flows
        # to endpoints that went or stopped serving (``UdpListener``). A tuple: most
        # balancers have none.
        self._watchers: tuple[Callable[[], None], ...] = ()
        # Least-connections only: the connections (UDP flows) open per endpoint address (IP
        # and port: on a laptop, endpoints differ by port alone), only those above zero; None
        # for the other algorithms.
        self._load: dict[tuple[str, int], int] | None = (
            {} if self._algorithm is LbAlgorithm.LEAST_CONNECTIONS else None
        )
        # Whether ``pick`` counts the connections it hands out (least-connections): the
        # caller then ``release``s the endpoint when the connection is over. An attribute,
        # not a property: it is read for every connection.
        self.counting = self._load is not None

    def update(
        self, port: ServicePort, endpoints: Sequence[Endpoint], zone: str | None = None
    ) -> None:
        """Apply a service port and its endpoints; a no-op when nothing changed. ``zone``:
        this node's (its ``topology.kubernetes.io/zone`` label), for topology hints."""
        eps = tuple(endpoints)
        algorithm = port.lb_algorithm or self._settings.default_algorithm
        affinity = port.affinity_timeout_s
        affinity_s = float(affinity) if affinity is not None else None
        internal_local = port.internal_policy_local
        external_local = port.external_policy_local
        if self._unchanged(algorithm, affinity_s, internal_local, external_local, eps, zone):
            return
        if algorithm is not self._algorithm:
            self._load = {} if algorithm is LbAlgorithm.LEAST_CONNECTIONS else None
            self.counting = self._load is not None
        self._algorithm = algorithm
        self._affinity_s = affinity_s
        self._internal_local = internal_local
        self._external_local = external_local
        self._endpoints = eps
        self._zone = zone
        self._index = None
        node = self._settings.node_name
        cluster = categorize(eps, local_only=internal_local, node_name=node, zone=zone)
        members = frozenset(cluster)
        if not self._cluster.holds_exactly(members):
            self._cluster = self._new_pool(cluster, members)
        if external_local == internal_local:
            self._external = self._cluster
        else:
            external = categorize(eps, local_only=external_local, node_name=node, zone=zone)
            members = frozenset(external)
            if self._external is self._cluster or not self._external.holds_exactly(members):
                self._external = self._new_pool(external, members)
        # kube-proxy's health check counts the ready endpoints on this node by address
        # (LocalReadyEndpoints): one pod serving two ports is one endpoint.
        self._local_ips = frozenset(e.ip for e in eps if e.ready and e.node_name == node) or _NO_IPS
        if self._failing is not None:
            self._failing = _by_address(self._failing, _addresses(eps)) or None
        self._affinity_then_watchers()

    def adopt(self, other: Balancer) -> list[object]:
        """Choose from now on as ``other`` does: its port, zone, endpoints and pools, taken
        whole (``other``, built aside in steps, is not used again; see
        ``messages.endpoint_steps``). The effect is ``update``'s with the same port, endpoints
        and zone, the round-robin order aside, at the cost of what this balancer keeps (its
        failing endpoints and its affinity table), not of the endpoints. What it keeps of its
        own: its watchers, and the connections counted per endpoint while the algorithm stays
        least-connections (each is released here when it ends).

        Returns the containers of the state it held (``_held``), for the caller to let go of
        a slice at a time (``release.Release``): freed here, 20,000 endpoints took 3.5-4.4 ms.
        """
        held = self._held()
        if other._algorithm is not self._algorithm:
            self._load = {} if other._algorithm is LbAlgorithm.LEAST_CONNECTIONS else None
            self.counting = self._load is not None
        self._algorithm = other._algorithm
        self._affinity_s = other._affinity_s
        self._internal_local = other._internal_local
        self._external_local = other._external_local
        self._endpoints = other._endpoints
        self._zone = other._zone
        self._index = other._index
        self._cluster = other._cluster
        self._external = other._external
        self._local_ips = other._local_ips
        if self._failing is not None:
            self._failing = _by_address(self._failing, self._addresses()) or None
        self._affinity_then_watchers()
        return held

    def let_go(self) -> list[object]:
        """Leave this balancer with no endpoints, as one forgotten (its port gone: a
        connection of a closed listener that dials again finds none), and return the
        containers of what it held, as ``adopt`` does."""
        held = self._held()
        if self._failing is not None:
            held.append(self._failing)
            self._failing = None
        if self._affinity:
            held.append(self._affinity)
            self._affinity = OrderedDict()
        self._endpoints = ()
        self._index = None
        self._cluster = self._external = _EMPTY
        self._local_ips = _NO_IPS
        return held

    def _held(self) -> list[object]:
        """The containers of this balancer's endpoints: the endpoints, their index, each
        pool's order and members (the pools kept for other choices too). None is shared
        with another balancer."""
        held: list[object] = [self._endpoints or (), self._local_ips]
        pools = {id(pool): pool for pool in (self._cluster, self._external)}
        index = self._index
        if index is not None:
            held += (index.by_address, index.local)
            pools.update((id(pool), pool) for pool in (index.pools or {}).values())
        for pool in pools.values():
            held.append(pool.order)
            if pool.members is not pool.order:
                held.append(pool.members)
        return held

    def _affinity_then_watchers(self) -> None:
        """After a new spec or set (``update``, ``adopt``): an affinity table while affinity is
        on (its clients of endpoints gone forgotten), then the watchers told."""
        if self._affinity_s is None:
            self._affinity = None
        elif self._affinity is None:
            self._affinity = OrderedDict()
        else:
            self._forget_stale_affinity(self._affinity, self._addresses)
        for watcher in self._watchers:
            watcher()

    def change(self, added: Sequence[Endpoint], removed: Collection[tuple[str, int]]) -> None:
        """Apply a change of the endpoints, sent as one: ``added`` are new, or replace the
        endpoint at their address; ``removed`` are the addresses of those gone.

        The effect is ``update``'s with the whole new set (the port and zone unchanged), the
        round-robin order aside: the pools follow the change in place (an endpoint that came
        takes a random place in the order, one that went leaves it), so its cost follows the
        change rather than the number of endpoints, also when the cluster-wide choice turns
        (topology hints on or off, the terminating fallback: ``_Index.pools``). Computed
        whole as ``update`` does, still: a Local pool, from this node's endpoints alone.
        """
        node = self._settings.node_name
        index = self._index
        if index is None:
            every = self._every()
            index = self._index = _Index(every, node, self._zone)
            if not (self._internal_local and self._external_local):
                wide = self._external if self._internal_local else self._cluster
                index.keep_pools(every, wide, self._rng)
        by_address, local = index.by_address, index.local
        choice_before = index.choice()
        gone: list[Endpoint] = []
        new: list[Endpoint] = []
        for address in removed:
            old = by_address.pop(address, None)
            if old is not None:
                gone.append(old)
        for ep in added:
            address = (ep.ip, ep.port)
            old = by_address.get(address)
            if old is not None:
                if old == ep:
                    continue
                gone.append(old)
            by_address[address] = ep
            new.append(ep)
        if not gone and not new:
            return
        touched_local = False
        for ep in gone:
            index.count(ep, -1)
            if ep.node_name == node:
                touched_local = True
                local.pop((ep.ip, ep.port), None)
        for ep in new:
            index.count(ep, 1)
            if ep.node_name == node:
                touched_local = True
                local[(ep.ip, ep.port)] = ep
        self._endpoints = None
        choice = index.choice()
        pools = index.pools
        if pools is None:  # both traffic classes pick from this node's endpoints alone
            wide = _EMPTY
        else:
            index.follow(gone, new, self._rng)
            wide = pools.get(choice, _EMPTY)
        if self._internal_local:
            cluster = self._local_pool(self._cluster) if touched_local else self._cluster
        else:
            cluster = wide
        if self._external_local == self._internal_local:
            self._external = cluster
        elif self._external_local:
            if touched_local:
                self._external = self._local_pool(self._external)
        else:
            self._external = wide
        self._cluster = cluster
        if touched_local:
            self._local_ips = frozenset(ep.ip for ep in local.values() if ep.ready) or _NO_IPS
        if self._failing is not None:
            failing = self._failing
            for ep in gone:
                state = failing.pop(ep, None)
                now = by_address.get((ep.ip, ep.port))
                if state is not None and now is not None:
                    failing[now] = state  # the same endpoint, its conditions or hints changed
            if not failing:
                self._failing = None
        if gone or choice != choice_before or touched_local:
            # An endpoint may have left a pool (endpoints that only came take none out,
            # unless they turn the choice or change this node's): a UDP listener's check
            # of its flows is linear in them, and a big change comes in parts.
            if self._affinity:
                self._forget_stale_affinity(self._affinity, lambda: by_address)
            for watcher in self._watchers:
                watcher()

    def _local_pool(self, pool: _Pool) -> _Pool:
        """The pool of a Local traffic class after a change of this node's endpoints
        (``pool`` itself when its set did not change)."""
        assert self._index is not None
        mine = tuple(self._index.local.values())
        selected = categorize(mine, local_only=True, node_name=self._settings.node_name)
        members = frozenset(selected)
        return pool if pool.holds_exactly(members) else self._new_pool(selected, members)

    def _forget_stale_affinity(
        self,
        table: OrderedDict[str, tuple[Endpoint, float]],
        addresses: Callable[[], Mapping[tuple[str, int], Endpoint]],
    ) -> None:
        """Drop the clients whose endpoint neither pool holds any more. A client stays with
        an endpoint whose conditions or topology hints changed (a new ``Endpoint``, unequal,
        at the same address) while a pool holds it: affinity is to the address, as
        kube-proxy's is, and a hint the EndpointSlice controller added to every endpoint
        moved most clients of the service to other pods."""
        in_cluster, in_external = self._cluster.members, self._external.members
        stale = [
            ip for ip, (ep, _) in table.items() if ep not in in_cluster and ep not in in_external
        ]
        if not stale:
            return
        current = addresses()  # made once, and only when some client's endpoint changed
        for ip in stale:
            ep, used = table[ip]
            now = current.get((ep.ip, ep.port))
            if now is not None and (now in in_cluster or now in in_external):
                table[ip] = (now, used)
            else:
                del table[ip]

    def _addresses(self) -> Mapping[tuple[str, int], Endpoint]:
        """Every endpoint by its address."""
        index = self._index
        return index.by_address if index is not None else _addresses(self._every())

    def watch(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` after each update that changed the endpoints or their choice
        (after a change applied in place: one that may have taken an endpoint out of a
        pool)."""
        self._watchers = (*self._watchers, callback)

    def unwatch(self, callback: Callable[[], None]) -> None:
        self._watchers = tuple(w for w in self._watchers if w != callback)

    def _every(self) -> tuple[Endpoint, ...]:
        """Every endpoint (linear once changes apply in place, then kept until the next)."""
        every = self._endpoints
        if every is None:
            assert self._index is not None
            every = self._endpoints = tuple(self._index.by_address.values())
        return every

    def _unchanged(
        self,
        algorithm: LbAlgorithm,
        affinity_s: float | None,
        internal_local: bool,
        external_local: bool,
        eps: tuple[Endpoint, ...],
        zone: str | None,
    ) -> bool:
        # Compared field by field rather than keeping the last ServicePort: the rest of the
        # port (addresses, node port...) does not change the choice, and a kept ServicePort
        # was about 250 bytes per balancer.
        return (
            algorithm is self._algorithm
            and affinity_s == self._affinity_s
            and internal_local == self._internal_local
            and external_local == self._external_local
            and eps == self._every()
            and zone == self._zone
        )

    def _new_pool(self, selected: Collection[Endpoint], members: frozenset[Endpoint]) -> _Pool:
        """A pool of ``selected`` (``members``: their set) in an order of its own."""
        if not selected:
            return _EMPTY
        if len(selected) == 1:  # nothing to drop or shuffle (most service ports)
            shuffled = tuple(selected)
        else:
            order = list(selected if len(members) == len(selected) else dict.fromkeys(selected))
            self._rng.shuffle(order)
            shuffled = tuple(order)
        # When the shuffle leaves the endpoints as given (always, for one endpoint), the
        # pool shares the tuple ``_endpoints`` keeps rather than holding a copy.
        return _Pool(self._endpoints if shuffled == self._endpoints else shuffled, members)

    def pick(
        self, client_ip: str, traffic: Traffic, *, exclude: Collection[Endpoint] = ()
    ) -> Endpoint | None:
        """The endpoint for this client, or None when no usable endpoint is left; counted
        as one more open on it while ``counting``, until ``release``."""
        pool = self._external if traffic is _EXTERNAL else self._cluster
        order = pool.order
        if not order:
            return None
        if (
            not exclude
            and self._failing is None
            and self._affinity_s is None
            and self._load is None
        ):
            # Round-robin or random, no affinity, no endpoint out: the next one (the
            # common case, a third of the general path's cost).
            if self._algorithm is _RANDOM:
                return order[self._rng.randrange(len(order))]
            at = pool.position
            pool.position = (at + 1) % len(order)
            return order[at]
        if self._failing is not None:
            exclude = self._with_ejected(self._failing, pool, exclude)
        timeout = self._affinity_s
        table = self._affinity
        if timeout is not None and table is not None:  # set together, by update()
            now = self._clock()
            entry = table.get(client_ip)
            chosen: Endpoint | None
            if entry is not None and (
                now - entry[1] < timeout and entry[0] in pool.members and entry[0] not in exclude
            ):
                chosen = entry[0]
                table[client_ip] = (chosen, now)
                table.move_to_end(client_ip)
            else:
                chosen = self._choose(pool, exclude)
                if chosen is not None:
                    self._remember(table, client_ip, chosen, now)
        else:
            chosen = self._choose(pool, exclude)
        load = self._load
        if load is not None and chosen is not None:
            key = (chosen.ip, chosen.port)
            load[key] = load.get(key, 0) + 1
        return chosen

    def release(self, endpoint: Endpoint) -> None:
        """A connection (UDP flow) that ``pick`` counted to ``endpoint`` is over, or its
        dial failed."""
        load = self._load
        if load is None:
            return  # switched away from least-connections since the pick
        key = (endpoint.ip, endpoint.port)
        n = load.get(key, 0)
        if n > 1:
            load[key] = n - 1
        elif n:
            del load[key]

    def _with_ejected(
        self, failing: dict[Endpoint, _Failing], pool: _Pool, exclude: Collection[Endpoint]
    ) -> Collection[Endpoint]:
        """``exclude`` and the pool's endpoints that are out now; ``exclude`` alone when that
        would leave nothing to pick."""
        now = self._clock()
        members = pool.members
        out = {ep for ep, f in failing.items() if f.until > now and ep in members}
        if not out:
            return exclude
        out.update(ep for ep in exclude if ep in members)
        return exclude if len(out) >= len(pool.order) else out

    def _choose(self, pool: _Pool, exclude: Collection[Endpoint]) -> Endpoint | None:
        order = pool.order
        if self._load is not None:
            return self._least(pool, self._load, exclude)
        if self._algorithm is _RANDOM:
            if not exclude:
                return order[self._rng.randrange(len(order))]
            left = [e for e in order if e not in exclude]
            return left[self._rng.randrange(len(left))] if left else None
        n = len(order)
        for step in range(n):
            ep = order[(pool.position + step) % n]
            if ep not in exclude:
                pool.position = (pool.position + step + 1) % n
                return ep
        return None

    def _least(
        self, pool: _Pool, load: dict[tuple[str, int], int], exclude: Collection[Endpoint]
    ) -> Endpoint | None:
        """The endpoint with the fewest open connections, the first in round-robin order
        from the pool's position among equals (the position then moves past it).

        The scan stops at the first endpoint with none open: under short connections that
        is the first one looked at, so only a pool whose every endpoint is busy (long-lived
        connections, which arrive seldom) is scanned whole."""
        order = pool.order
        n = len(order)
        best: Endpoint | None = None
        best_open = best_at = 0
        for step in range(n):
            at = (pool.position + step) % n
            ep = order[at]
            if ep in exclude:
                continue
            open_now = load.get((ep.ip, ep.port), 0)
            if best is None or open_now < best_open:
                best, best_open, best_at = ep, open_now, at
                if not open_now:
                    break  # none can have fewer
        if best is not None:
            pool.position = (best_at + 1) % n
        return best

    def _remember(
        self,
        table: OrderedDict[str, tuple[Endpoint, float]],
        client_ip: str,
        ep: Endpoint,
        now: float,
    ) -> None:
        table[client_ip] = (ep, now)
        table.move_to_end(client_ip)
        limit = self._settings.max_affinity_entries
        while len(table) > limit:
            table.popitem(last=False)

    def dial_failed(self, client_ip: str, endpoint: Endpoint) -> None:
        """A dial to ``endpoint`` failed: the client's affinity to it goes, and the endpoint
        is left out for a while once it has failed ``eject_after`` times in a row."""
        table = self._affinity
        if table is not None:
            entry = table.get(client_ip)
            if entry is not None and entry[0] == endpoint:
                del table[client_ip]
        if self._settings.eject_after > 0:
            self._failed(endpoint)

    def dial_ok(self, endpoint: Endpoint) -> None:
        """A dial to ``endpoint`` succeeded: its failures are forgotten (and it is back)."""
        failing = self._failing
        if failing is None:
            return
        f = failing.pop(endpoint, None)
        if f is None:
            return
        if not failing:
            self._failing = None
        if f.ejections:
            log.log(
                V2,
                "Endpoint back: a dial to it succeeded",
                extra=kv(service=str(self.name), endpoint=str(endpoint)),
            )

    def _failed(self, endpoint: Endpoint) -> None:
        if endpoint not in self._cluster.members and endpoint not in self._external.members:
            return  # gone from the slices since this dial began
        failing = self._failing
        if failing is None:
            failing = self._failing = {}
        f = failing.get(endpoint)
        if f is None:
            f = failing[endpoint] = _Failing()
        now = self._clock()
        if f.until > now:
            return  # out already: a dial that began before
        f.failures += 1
        settings = self._settings
        # Back from being out, its first failure puts it out again, for twice as long.
        if f.failures < settings.eject_after and not f.ejections:
            return
        f.failures = 0
        f.ejections += 1
        out_s = min(settings.eject_base_s * 2.0 ** min(f.ejections - 1, 16), settings.eject_max_s)
        f.until = now + out_s
        level = logging.INFO if f.ejections == 1 else V2
        if not self._another_in(failing, endpoint, now):
            # Out, but the choice takes it anyway while nothing else is left to take
            # (``_with_ejected``): not counted as left out, and not said to be.
            log.log(
                level,
                "Endpoint failing dials, still used: every other endpoint is out too",
                extra=kv(service=str(self.name), endpoint=str(endpoint)),
            )
            return
        series.ENDPOINT_EJECTIONS.labels(str(self.name)).value += 1
        log.log(
            level,
            "Endpoint left out after failed dials",
            extra=kv(service=str(self.name), endpoint=str(endpoint), for_s=out_s),
        )

    def _another_in(
        self, failing: dict[Endpoint, _Failing], endpoint: Endpoint, now: float
    ) -> bool:
        """Whether a pool that holds ``endpoint`` has another endpoint that is not out."""
        for pool in (self._cluster, self._external):
            if endpoint in pool.members:
                for ep in pool.order:
                    if ep != endpoint and not ((f := failing.get(ep)) and f.until > now):
                        return True
        return False

    def addresses(self, traffic: Traffic) -> Container[tuple[str, int]]:
        """The addresses of the endpoints this traffic class may use, for ``in`` tests: a
        view of the balancer's index once its changes come as changes (each test a lookup),
        else a set built here, linear in the endpoints."""
        pool = self._external if traffic is _EXTERNAL else self._cluster
        if self._index is not None and isinstance(pool.members, dict):
            return _PoolAddresses(self._index.by_address, pool.members)
        return {(ep.ip, ep.port) for ep in pool.order}

    def serving(self) -> Container[tuple[str, int]]:
        """The addresses of the endpoints still serving (ready, or terminating and still
        serving), whichever traffic class may pick them, for ``in`` tests: a UDP flow to
        one of them goes on, as kube-proxy keeps the conntrack entries of every serving
        endpoint ("changes to the service should not affect existing flows": not traffic
        policies, topology, or termination)."""
        return _ServingAddresses(self._addresses())

    def endpoints(self, traffic: Traffic) -> Sequence[Endpoint]:
        """The usable endpoints for this traffic class, in round-robin order."""
        return (self._external if traffic is _EXTERNAL else self._cluster).order

    @property
    def local_ready_ips(self) -> frozenset[str]:
        """Addresses of the ready endpoints on this node (health-check node ports count them)."""
        return self._local_ips

    @property
    def affinity(self) -> bool:
        """ClientIP session affinity is on for this service port."""
        return self._affinity_s is not None

    @property
    def affinity_entries(self) -> int:
        return len(self._affinity) if self._affinity is not None else 0
