"""Endpoint selection for one service port: round-robin or random, with ClientIP affinity.

The syncer owns one ``Balancer`` per service port and calls ``update`` with the port and
its merged endpoints on every sync; listeners call ``pick`` for each new connection or UDP
flow. ``pick`` is on the connection-setup hot path, so the work happens in ``update``: the
cluster and external endpoint sets are computed there once (kube-proxy's categorisation,
``uproxy.model.categorize``), and ``pick`` is an index step or one dict lookup.

Round-robin order is shuffled whenever an endpoint set changes, so that all proxies in a
cluster do not start on the same endpoint after a rollout (the original userspace mode
did the same). ClientIP affinity follows the userspace mode too: an affinity hit does not
advance the round-robin position, the entry's timer restarts on every use, and a failed
dial forgets the client so the retry lands elsewhere.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence

from uproxy.dataplane.settings import DataplaneSettings
from uproxy.model import Endpoint, LbAlgorithm, ServicePort, ServicePortName, Traffic, categorize

# One generator for every balancer: a Random holds 2.5 KB of state and seeds itself from
# os.urandom, 25 MB and 4 % of the start-up profile at 10,000 service ports. The data plane
# runs on one thread, so sharing it is safe; tests pass their own seeded one.
_RNG = random.Random()


class _Pool:
    """The endpoints one traffic class may use, in round-robin order."""

    __slots__ = ("members", "order", "position")

    def __init__(self, order: tuple[Endpoint, ...]) -> None:
        self.order = order
        self.members = frozenset(order)
        self.position = 0


class Balancer:
    """Chooses an endpoint for a client; see the module docstring for the rules."""

    def __init__(
        self,
        name: ServicePortName,
        *,
        node_name: str,
        default_algorithm: LbAlgorithm,
        settings: DataplaneSettings,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.name = name
        self._node_name = node_name
        self._default_algorithm = default_algorithm
        self._settings = settings
        self._clock = clock
        self._rng = rng if rng is not None else _RNG
        self._algorithm = default_algorithm
        self._affinity_s: float | None = None
        empty = _Pool(())
        self._pools: dict[Traffic, _Pool] = {Traffic.CLUSTER: empty, Traffic.EXTERNAL: empty}
        self._local_ips: frozenset[str] = frozenset()
        # client IP -> (endpoint, last use); ordered by last use, oldest first.
        self._affinity: OrderedDict[str, tuple[Endpoint, float]] = OrderedDict()
        self._last: tuple[ServicePort, tuple[Endpoint, ...]] | None = None

    def update(self, port: ServicePort, endpoints: Sequence[Endpoint]) -> None:
        """Apply a service port and its endpoints; a no-op when nothing changed."""
        eps = tuple(endpoints)
        if self._last is not None and self._last == (port, eps):
            return
        self._last = (port, eps)
        self._algorithm = port.lb_algorithm or self._default_algorithm
        affinity = port.affinity_timeout_s
        self._affinity_s = float(affinity) if affinity is not None else None
        cluster = categorize(eps, local_only=port.internal_policy_local, node_name=self._node_name)
        external = (
            cluster
            if port.external_policy_local == port.internal_policy_local
            else categorize(eps, local_only=port.external_policy_local, node_name=self._node_name)
        )
        wanted = {Traffic.CLUSTER: cluster, Traffic.EXTERNAL: external}
        for traffic, selected in wanted.items():
            if frozenset(selected) != self._pools[traffic].members:
                order = list(dict.fromkeys(selected))
                self._rng.shuffle(order)
                self._pools[traffic] = _Pool(tuple(order))
        # kube-proxy's health check counts the ready endpoints on this node by address
        # (LocalReadyEndpoints): one pod serving two ports is one endpoint.
        self._local_ips = frozenset(e.ip for e in eps if e.ready and e.node_name == self._node_name)
        if self._affinity_s is None:
            self._affinity.clear()
        else:
            usable = self._pools[Traffic.CLUSTER].members | self._pools[Traffic.EXTERNAL].members
            stale = [ip for ip, (ep, _) in self._affinity.items() if ep not in usable]
            for ip in stale:
                del self._affinity[ip]

    def pick(
        self, client_ip: str, traffic: Traffic, *, exclude: Collection[Endpoint] = ()
    ) -> Endpoint | None:
        """The endpoint for this client, or None when no usable endpoint is left."""
        pool = self._pools[traffic]
        if not pool.order:
            return None
        timeout = self._affinity_s
        if timeout is not None:
            now = self._clock()
            entry = self._affinity.get(client_ip)
            if entry is not None:
                ep, last = entry
                if now - last < timeout and ep in pool.members and ep not in exclude:
                    self._affinity[client_ip] = (ep, now)
                    self._affinity.move_to_end(client_ip)
                    return ep
            chosen = self._choose(pool, exclude)
            if chosen is not None:
                self._remember(client_ip, chosen, now)
            return chosen
        return self._choose(pool, exclude)

    def _choose(self, pool: _Pool, exclude: Collection[Endpoint]) -> Endpoint | None:
        order = pool.order
        if self._algorithm is LbAlgorithm.RANDOM:
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

    def _remember(self, client_ip: str, ep: Endpoint, now: float) -> None:
        table = self._affinity
        table[client_ip] = (ep, now)
        table.move_to_end(client_ip)
        limit = self._settings.max_affinity_entries
        while len(table) > limit:
            table.popitem(last=False)

    def dial_failed(self, client_ip: str, endpoint: Endpoint) -> None:
        """Forget the client's affinity to an endpoint that could not be reached."""
        entry = self._affinity.get(client_ip)
        if entry is not None and entry[0] == endpoint:
            del self._affinity[client_ip]

    def endpoints(self, traffic: Traffic) -> tuple[Endpoint, ...]:
        """The usable endpoints for this traffic class, in round-robin order."""
        return self._pools[traffic].order

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
        return len(self._affinity)
