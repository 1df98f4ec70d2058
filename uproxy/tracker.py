"""The change tracker: Kubernetes objects in, desired proxy state out.

Sources push whole objects (upserts, deletes, or a full listing to replace by difference);
the tracker converts them once, drops no-op updates, merges the EndpointSlices of each
service, and tells the syncer that something changed. The syncer pulls ``snapshot()``,
which is rebuilt only for the services that changed since the last pull, so a watch event
costs work proportional to the object, not to the cluster.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from uproxy import metrics
from uproxy.log import V2, kv
from uproxy.model import (
    DesiredState,
    Endpoint,
    NodeInfo,
    ServicePort,
    ServicePortName,
    ServiceState,
)
from uproxy.objects import (
    SERVICE_PROXY_NAME_LABEL,
    EndpointSliceInfo,
    InvalidObject,
    endpoint_slice,
    object_key,
    service_ports,
)

log = logging.getLogger("uproxy.tracker")

ServiceKey = tuple[str, str]
Obj = Mapping[str, Any]


class Kind(enum.StrEnum):
    SERVICE = "Service"
    ENDPOINT_SLICE = "EndpointSlice"


@dataclass(frozen=True, slots=True)
class Changes:
    """What changed since the last ``take_changes()``: for metrics and logs."""

    services: int
    endpoints: int
    # Wall-clock times (epoch seconds) of the slice changes that triggered this sync.
    trigger_times: tuple[float, ...]


class Tracker:
    def __init__(
        self,
        *,
        service_proxy_name: str | None = None,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.service_proxy_name = service_proxy_name
        self.on_change = on_change
        self.node: NodeInfo | None = None
        self._services: dict[ServiceKey, dict[ServicePortName, ServicePort]] = {}
        self._slices: dict[ServiceKey, EndpointSliceInfo] = {}  # keyed by (ns, slice name)
        self._slices_of: dict[ServiceKey, set[ServiceKey]] = {}  # service -> its slice keys
        self._listed: set[Kind] = set()
        self._invalid: dict[tuple[Kind, str], str] = {}
        self._dirty: set[ServiceKey] = set()
        self._state: DesiredState = {}
        self._by_service: dict[ServiceKey, list[ServicePortName]] = {}
        self._service_changes = 0
        self._endpoint_changes = 0
        self._trigger_times: list[float] = []

    # ----- what sources call -----

    @property
    def synced(self) -> bool:
        """Both Services and EndpointSlices have been listed at least once."""
        return {Kind.SERVICE, Kind.ENDPOINT_SLICE} <= self._listed

    def upsert(self, kind: Kind, obj: Obj) -> None:
        if self._apply(kind, _key(obj), obj):
            self._notify()

    def delete(self, kind: Kind, obj: Obj) -> None:
        if self._apply(kind, _key(obj), None):
            self._notify()

    def replace(self, kind: Kind, objs: Iterable[Obj]) -> None:
        """A full listing of ``kind``: apply the difference and mark the kind listed."""
        incoming = {_key(o): o for o in objs}
        known = self._services if kind is Kind.SERVICE else self._slices
        changed = False
        for key in list(known):
            if key not in incoming:
                changed |= self._apply(kind, key, None)
        for key, obj in incoming.items():
            changed |= self._apply(kind, key, obj)
        first = kind not in self._listed
        self._listed.add(kind)
        if changed or first:
            self._notify()

    def set_node(self, node: NodeInfo | None) -> None:
        if node != self.node:
            self.node = node
            self._notify()

    # ----- what the syncer calls -----

    def snapshot(self) -> DesiredState:
        """The desired state; rebuilt only for services changed since the last call."""
        for skey in self._dirty:
            for old in self._by_service.pop(skey, ()):
                self._state.pop(old, None)
            ports = self._services.get(skey)
            if not ports:
                continue
            slices = [self._slices[k] for k in sorted(self._slices_of.get(skey, ()))]
            names = []
            for spn, sp in ports.items():
                self._state[spn] = ServiceState(sp, _merge(slices, spn))
                names.append(spn)
            self._by_service[skey] = names
        self._dirty.clear()
        return self._state

    def take_changes(self) -> Changes:
        out = Changes(self._service_changes, self._endpoint_changes, tuple(self._trigger_times))
        self._service_changes = self._endpoint_changes = 0
        self._trigger_times.clear()
        metrics.SERVICE_CHANGES_PENDING.set(0)
        metrics.ENDPOINT_CHANGES_PENDING.set(0)
        return out

    # ----- internals -----

    def _notify(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def _apply(self, kind: Kind, key: ServiceKey, obj: Obj | None) -> bool:
        if kind is Kind.SERVICE:
            return self._apply_service(key, obj)
        return self._apply_slice(key, obj)

    def _apply_service(self, key: ServiceKey, obj: Obj | None) -> bool:
        ports: dict[ServicePortName, ServicePort] = {}
        if obj is not None and self._wanted(obj):
            try:
                ports = service_ports(obj)
                self._invalid.pop((Kind.SERVICE, _fmt(key)), None)
            except InvalidObject as e:
                self._report_invalid(Kind.SERVICE, e)
        if ports == self._services.get(key, {}):
            return False
        if ports:
            self._services[key] = ports
        else:
            self._services.pop(key, None)
        self._dirty.add(key)
        self._service_changes += 1
        metrics.SERVICE_CHANGES_TOTAL.inc()
        metrics.SERVICE_CHANGES_PENDING.set(self._service_changes)
        return True

    def _apply_slice(self, key: ServiceKey, obj: Obj | None) -> bool:
        info: EndpointSliceInfo | None = None
        if obj is not None:
            try:
                info = endpoint_slice(obj)
                self._invalid.pop((Kind.ENDPOINT_SLICE, _fmt(key)), None)
            except InvalidObject as e:
                self._report_invalid(Kind.ENDPOINT_SLICE, e)
        old = self._slices.get(key)
        if _same_slice(old, info):
            return False
        if old is not None:
            owner = (old.namespace, old.service)
            self._slices_of.get(owner, set()).discard(key)
            self._dirty.add(owner)
            del self._slices[key]
        if info is not None:
            owner = (info.namespace, info.service)
            self._slices[key] = info
            self._slices_of.setdefault(owner, set()).add(key)
            self._dirty.add(owner)
            if info.trigger_time:
                t = _parse_time(info.trigger_time)
                if t is not None:
                    self._trigger_times.append(t)
        self._endpoint_changes += 1
        metrics.ENDPOINT_CHANGES_TOTAL.inc()
        metrics.ENDPOINT_CHANGES_PENDING.set(self._endpoint_changes)
        return True

    def _wanted(self, obj: Obj) -> bool:
        """kube-proxy's service-proxy-name filter: run beside another proxy, take only ours."""
        meta = obj.get("metadata")
        labels = meta.get("labels") if isinstance(meta, Mapping) else None
        value = labels.get(SERVICE_PROXY_NAME_LABEL) if isinstance(labels, Mapping) else None
        if self.service_proxy_name is None:
            return value is None
        return bool(value == self.service_proxy_name)

    def _report_invalid(self, kind: Kind, err: InvalidObject) -> None:
        # One line per object and reason, not one per resync of the same broken object.
        marker = (kind, err.key)
        if self._invalid.get(marker) == str(err):
            return
        self._invalid[marker] = str(err)
        log.warning(
            "Skipping invalid object",
            extra=kv(kind=kind.value, object=err.key, field=err.field, reason=err.reason),
        )

    def describe(self) -> str:
        return f"{len(self._services)} services, {len(self._slices)} endpoint slices"


def _key(obj: Obj) -> ServiceKey:
    ns, _, name = object_key(obj).partition("/")
    return (ns, name)


def _fmt(key: ServiceKey) -> str:
    return f"{key[0]}/{key[1]}"


def _same_slice(a: EndpointSliceInfo | None, b: EndpointSliceInfo | None) -> bool:
    if a is None or b is None:
        return a is b
    # The trigger time annotation changes with every update; it is not part of the state.
    return (a.service, a.ports, a.endpoints) == (b.service, b.ports, b.endpoints)


def _merge(slices: list[EndpointSliceInfo], spn: ServicePortName) -> tuple[Endpoint, ...]:
    """The union of the service port's endpoints over all slices, one per address.

    A dual-stack service has IPv4 and IPv6 slices listing the same pods twice; uproxy serves
    its IPv4 addresses (the rules are IPv4), so its IPv4 endpoints are the set: counting
    both would double every pod in the local-endpoint counts of the health-check node ports.
    A service with IPv6 endpoints only keeps them.
    """
    merged: dict[tuple[str, int], Endpoint] = {}
    for s in slices:
        for ep in s.endpoints_for(spn.port_name, spn.protocol):
            prev = merged.get(ep.address)
            # The same address in two slices (mid-migration): a ready copy wins.
            if prev is None or (ep.ready and not prev.ready):
                merged[ep.address] = ep
    endpoints: Collection[Endpoint] = merged.values()
    if any(":" in ep.ip for ep in endpoints) and any(":" not in ep.ip for ep in endpoints):
        endpoints = [ep for ep in endpoints if ":" not in ep.ip]
    return tuple(sorted(endpoints))


def _parse_time(text: str) -> float | None:
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        log.log(V2, "Unparsable trigger time", extra=kv(value=text))
        return None
