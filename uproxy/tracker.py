"""The change tracker: Kubernetes objects in, desired proxy state out.

Sources push whole objects (upserts, deletes, or a full listing to replace by difference);
the tracker converts them once, drops no-op updates, merges the EndpointSlices of each
service, and says which service ports changed. Consumers take those ports (``take_changes``,
``take_endpoint_changes``) and read their state (``state``); a service's state is rebuilt
only when it changed, so a watch event costs work proportional to the object, not to the
cluster, and so does the sync that follows it.

A service port with thousands of endpoints (a DaemonSet's, on a big cluster) has them in many
slices, and one slice changes at a time. Merging all of them again for each change (5 ms at
20,000) is what its state then costs; instead, such a port follows the change of one slice
in place (``_follow_edit``): the endpoints of that slice leave or enter the merged tuple at
their place in address order, and the state says what changed (``ServiceState.delta``), so
the syncer does not compare the whole sets either. An address another slice also holds (a
slice being replaced by another) makes it merge whole, as do a Service's own changes and
several slice changes taken at once.
"""

from __future__ import annotations

import bisect
import contextlib
import enum
import itertools
import logging
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast

from uproxy import heap, metrics
from uproxy.dataplane.messages import CHANGES_FROM
from uproxy.log import V2, kv
from uproxy.model import (
    DesiredState,
    Endpoint,
    EndpointsDelta,
    NodeInfo,
    ServicePort,
    ServicePortName,
    ServiceState,
    address_of,
)
from uproxy.objects import (
    SERVICE_PROXY_NAME_LABEL,
    EndpointSliceInfo,
    InvalidObject,
    endpoint_slice,
    object_key,
    service_ports,
)
from uproxy.records import quick_init
from uproxy.timeslice import TimeSlice

log = logging.getLogger("uproxy.tracker")

ServiceKey = tuple[str, str]
Obj = Mapping[str, Any]
Address = tuple[str, int]
Edit = tuple[EndpointSliceInfo | None, EndpointSliceInfo | None]  # a slice before, after


@quick_init
@dataclass(frozen=True, slots=True)
class Converted:
    """An object with what its source already converted it to (``service_ports`` or
    ``endpoint_slice``): the tracker uses that instead of converting it again.

    The file source converts every object of a file to validate it before the tracker sees
    any of it; converting each again here made the tracker's share of a 10,000-service
    first load 0.30 CPU-s instead of 0.06.
    """

    obj: Obj
    value: dict[ServicePortName, ServicePort] | EndpointSliceInfo | None


Incoming = Obj | Converted  # what sources hand over


class Kind(enum.StrEnum):
    SERVICE = "Service"
    ENDPOINT_SLICE = "EndpointSlice"


@dataclass(frozen=True, slots=True)
class Changes:
    """What changed since the last take: the service ports to look at again, and why."""

    # Service ports whose state may differ: added, changed or gone (``state()`` is None).
    ports: frozenset[ServicePortName]
    services: int  # Service changes applied (for metrics and logs)
    endpoints: int  # EndpointSlice changes applied
    # Wall-clock times (epoch seconds) of the slice changes behind these ports, from the
    # EndpointSlice controller's trigger-time annotation; times before the tracker existed
    # are dropped (a first listing would otherwise report hours of "programming latency").
    trigger_times: tuple[float, ...]


class Tracker:
    """The desired state, and which service ports changed since each consumer last looked.

    Two consumers take changes. The syncer takes everything (``take_changes``) at the rules'
    rate limit. Endpoint-only changes, which kube-proxy's userspace mode handed to its load
    balancer at once, are also offered on their own (``take_endpoint_changes``) so the data
    plane can follow them within milliseconds; a service whose Service object also changed
    waits for the syncer, which handles both together.
    """

    def __init__(
        self,
        *,
        service_proxy_name: str | None = None,
        on_change: Callable[[], None] | None = None,
        on_endpoints: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.service_proxy_name = service_proxy_name
        self.on_change = on_change  # a Service (or the Node) changed, or a first listing
        self.on_endpoints = on_endpoints  # an EndpointSlice changed
        self.node: NodeInfo | None = None
        self._started = clock()
        self._services: dict[ServiceKey, dict[ServicePortName, ServicePort]] = {}
        self._slices: dict[ServiceKey, EndpointSliceInfo] = {}  # keyed by (ns, slice name)
        # service -> its slice keys, as a tuple: a service has one or a few slices, and a set
        # is 216 bytes however small (2.1 MiB at 10,000 services).
        self._slices_of: dict[ServiceKey, tuple[ServiceKey, ...]] = {}
        self._listed: set[Kind] = set()
        self._invalid: dict[tuple[Kind, str], str] = {}
        self._state: DesiredState = {}
        self._batching = 0  # open ``batch()`` blocks
        self._batched: set[Kind] = set()  # kinds changed inside them, not yet announced
        self._by_service: dict[ServiceKey, tuple[ServicePortName, ...]] = {}
        self._stale: set[ServiceKey] = set()  # state to rebuild before it is read
        # Since a stale service's last rebuild: the one change of its slices it may follow
        # in place, or (``_whole``) more than that, a change of its Service, a slice that
        # moved between services: see ``_rebuild``.
        self._edits: dict[ServiceKey, Edit] = {}
        self._whole: set[ServiceKey] = set()
        # For a big port that followed a slice's change: how many of its slices hold each
        # address (counted once, kept up to date by the changes it follows).
        self._holders: dict[ServicePortName, dict[Address, int]] = {}
        self._pending_services: set[ServiceKey] = set()  # not yet taken by the syncer
        self._pending_endpoints: set[ServiceKey] = set()  # not yet taken by anyone
        # Those of them whose Service is not pending: what take_endpoint_changes hands over,
        # kept as changes come (computed from both sets at each call, it walked 10,000 keys
        # per endpoint event while a 10,000-service swap was pending).
        self._endpoints_only: set[ServiceKey] = set()
        self._dropped: set[ServicePortName] = set()  # ports gone since the syncer took
        self._triggers: dict[ServiceKey, list[float]] = {}
        self._service_changes = 0
        self._endpoint_changes = 0
        self._unreported = {Kind.SERVICE: 0, Kind.ENDPOINT_SLICE: 0}  # see _report

    # ----- what sources call -----

    @property
    def synced(self) -> bool:
        """Both Services and EndpointSlices have been listed at least once."""
        return {Kind.SERVICE, Kind.ENDPOINT_SLICE} <= self._listed

    def upsert(self, kind: Kind, obj: Incoming) -> bool:
        """Take ``obj`` as it now is; whether that changed anything."""
        if self._apply(kind, _key(obj), obj):
            self._changed(kind)
            return True
        return False

    def delete(self, kind: Kind, obj: Obj) -> None:
        if self._apply(kind, _key(obj), None):
            self._changed(kind)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Upserts and deletes inside are reported and announced once, at the end.

        A source that applies one change of many objects (a services file reload) uses it,
        so the change reaches the syncer whole: announced object by object, a reload that
        replaced 10,000 services started a sync after the first ~2,800 deletes, and a second
        one for the rest (two rules programs instead of one).
        """
        self._batching += 1
        try:
            yield
        finally:
            self._batching -= 1
            if not self._batching and self._batched:
                kinds, self._batched = self._batched, set()
                self._report()
                for kind in Kind:
                    if kind in kinds:
                        self._notify(kind)

    def _changed(self, kind: Kind) -> None:
        if self._batching:
            self._batched.add(kind)
            return
        self._report()
        self._notify(kind)

    def replace(self, kind: Kind, objs: Iterable[Incoming]) -> None:
        """A full listing of ``kind``: apply the difference and mark the kind listed."""
        changed = False
        for key, obj in self._listing_diff(kind, objs):
            changed |= self._apply(kind, key, obj)
        self._report()
        self._listed_now(kind, changed)

    async def replace_async(self, kind: Kind, objs: Iterable[Incoming]) -> None:
        """``replace`` that gives the loop back every few milliseconds (10,000s of objects)."""
        listing = self.listing(kind)
        try:
            await listing.add(list(objs))
        finally:
            await listing.finish()

    def listing(self, kind: Kind) -> Listing:
        """A full listing of ``kind`` applied page by page, as a paged list arrives.

        Until the kind's first listing is complete the tracker is not synced, so nothing is
        programmed from half of it; a relist applied page by page is seen as a burst of
        single changes, each of them true at the list's version. Only one page of the API's
        objects is held at a time (at 10,000 services, holding the whole listing beside the
        state it replaces was 40 MB more at every relist).
        """
        return Listing(self, kind)

    def resync(self) -> None:
        """Announce every service again, as an informer's periodic resync re-delivers what it
        holds: the syncer looks at each service port once more, and repairs whatever does
        not match (a listener, a balancer, a portal). What matches costs a comparison: the
        balancers, the workers and the rules backend are told of differences only. Nothing
        is read or parsed again; before the first listings it does nothing."""
        if not self.synced or not self._services:
            return
        self._pending_services.update(self._services)
        self._endpoints_only.difference_update(self._services)
        self._pending_gauges()
        if self.on_change is not None:
            self.on_change()

    def set_node(self, node: NodeInfo | None) -> None:
        if node != self.node:
            self.node = node
            if self.on_change is not None:
                self.on_change()

    # ----- what consumers call -----

    def snapshot(self) -> DesiredState:
        """The whole desired state (rebuilt where stale); taking changes is separate."""
        self._rebuild(self._stale)
        return self._state

    def state(self, spn: ServicePortName) -> ServiceState | None:
        """The current desired state of one service port; None when it does not exist."""
        key = spn.service
        if key in self._stale:
            self._rebuild((key,))
        return self._state.get(spn)

    def take_changes(self) -> Changes:
        """Every service port changed since the last call (Service or endpoint changes)."""
        keys = self._pending_services | self._pending_endpoints
        self._pending_services.clear()
        self._pending_endpoints.clear()
        self._endpoints_only.clear()
        ports = self._ports_of(keys) | self._dropped
        self._dropped = set()
        out = Changes(
            frozenset(ports), self._service_changes, self._endpoint_changes, self._take(keys)
        )
        self._service_changes = self._endpoint_changes = 0
        self._pending_gauges()
        return out

    def take_endpoint_changes(self) -> Changes:
        """Service ports whose endpoints changed and whose Service did not (since taken)."""
        keys = self._endpoints_only
        self._endpoints_only = set()
        self._pending_endpoints -= keys
        self._pending_gauges()
        return Changes(frozenset(self._ports_of(keys)), 0, len(keys), self._take(keys))

    # ----- internals -----

    def _known(self, kind: Kind) -> Collection[ServiceKey]:
        return self._services if kind is Kind.SERVICE else self._slices

    def _listing_diff(
        self, kind: Kind, objs: Iterable[Incoming]
    ) -> list[tuple[ServiceKey, Incoming | None]]:
        incoming = {_key(o): o for o in objs}
        known = self._services if kind is Kind.SERVICE else self._slices
        gone: list[tuple[ServiceKey, Incoming | None]] = [
            (k, None) for k in known if k not in incoming
        ]
        return gone + list(incoming.items())

    def _listed_now(self, kind: Kind, changed: bool) -> None:
        first = kind not in self._listed
        self._listed.add(kind)
        if first and self.on_change is not None:
            self.on_change()  # the syncer may be waiting for this listing
        elif changed:
            self._notify(kind)

    def _notify(self, kind: Kind) -> None:
        callback = self.on_change if kind is Kind.SERVICE else self.on_endpoints
        if callback is not None:
            callback()

    def _mark(self, key: ServiceKey, *, service: bool, edit: Edit | None = None) -> None:
        self._stale.add(key)
        first = key not in self._whole and key not in self._edits
        if edit is not None and first and key in self._services:
            self._edits[key] = edit  # the one change since its rebuild: it may be followed
        else:
            self._edits.pop(key, None)
            self._whole.add(key)
        if service:
            self._pending_services.add(key)
            self._endpoints_only.discard(key)
        else:
            self._pending_endpoints.add(key)
            if key not in self._pending_services:
                self._endpoints_only.add(key)

    def _ports_of(self, keys: Iterable[ServiceKey]) -> set[ServicePortName]:
        """The ports these services have (those they lost are in ``_dropped``)."""
        out: set[ServicePortName] = set()
        for key in keys:
            out.update(self._services.get(key, ()))
        return out

    def _rebuild(self, keys: Iterable[ServiceKey]) -> None:
        for key in [k for k in keys if k in self._stale]:
            self._stale.discard(key)
            one = self._edits.pop(key, None)
            if key in self._whole:
                one = None
                self._whole.discard(key)
            old = self._by_service.pop(key, ())
            before = {spn: self._state.pop(spn) for spn in old if spn in self._state}
            ports = self._services.get(key) or {}
            for spn in old:
                if spn not in ports:
                    self._holders.pop(spn, None)
            if not ports:
                continue
            slices: list[EndpointSliceInfo] | None = None
            for spn, sp in ports.items():
                prev = before.get(spn)
                state = None
                if one is not None and prev is not None:  # (a Service's change is whole)
                    state = self._follow_edit(spn, prev, *one)
                if state is None:
                    if slices is None:
                        slices = [self._slices[k] for k in sorted(self._slices_of.get(key, ()))]
                    self._holders.pop(spn, None)
                    state = ServiceState(sp, _merge(slices, spn))
                self._state[spn] = state
            self._by_service[key] = tuple(ports)

    def _follow_edit(
        self,
        spn: ServicePortName,
        prev: ServiceState,
        old: EndpointSliceInfo | None,
        new: EndpointSliceInfo | None,
    ) -> ServiceState | None:
        """``prev`` with one slice's change (``old`` -> ``new``) applied in place, or None
        when the whole merge must decide: small ports, an address another slice holds too,
        an address twice in the slice."""
        eps = prev.endpoints
        if len(eps) < CHANGES_FROM:
            return None
        name, protocol = spn.port_name, spn.protocol
        was = old.endpoints_for(name, protocol) if old is not None else ()
        now = new.endpoints_for(name, protocol) if new is not None else ()
        gone = {(e.ip, e.port): e for e in was}
        came = {(e.ip, e.port): e for e in now}
        if len(gone) != len(was) or len(came) != len(now):
            return None
        holders = self._holders.get(spn)
        if holders is None:  # counted over the slices as they are now: after the change
            holders = self._holders[spn] = self._count_holders(spn)
        else:
            for address in gone:
                left = holders[address] - 1
                if left:
                    holders[address] = left
                else:
                    del holders[address]
            for address in came:
                holders[address] = holders.get(address, 0) + 1
        removed = [a for a in gone if a not in came]
        added = [ep for a, ep in came.items() if gone.get(a) is not ep and gone.get(a) != ep]
        touched = itertools.chain(removed, ((ep.ip, ep.port) for ep in added))
        if any(holders.get(a, 0) > (a in came) for a in touched):
            self._holders.pop(spn, None)  # another slice holds it: whose copy wins is the merge's
            return None
        out = list(eps)
        for address in removed:
            at = bisect.bisect_left(out, address, key=address_of)
            if at == len(out) or address_of(out[at]) != address:
                self._holders.pop(spn, None)
                return None
            del out[at]
        for ep in added:
            address = (ep.ip, ep.port)
            at = bisect.bisect_left(out, address, key=address_of)
            if at < len(out) and address_of(out[at]) == address:
                out[at] = ep
            else:
                out.insert(at, ep)
        merged = tuple(out) if removed or added else eps
        return ServiceState(prev.port, merged, EndpointsDelta(eps, tuple(added), tuple(removed)))

    def _count_holders(self, spn: ServicePortName) -> dict[Address, int]:
        counts: dict[Address, int] = {}
        for k in self._slices_of.get(spn.service, ()):
            for e in self._slices[k].endpoints_for(spn.port_name, spn.protocol):
                address = (e.ip, e.port)
                counts[address] = counts.get(address, 0) + 1
        return counts

    def _take(self, keys: Iterable[ServiceKey]) -> tuple[float, ...]:
        out: list[float] = []
        for key in keys:
            out.extend(self._triggers.pop(key, ()))
        return tuple(out)

    def _report(self) -> None:
        """Count the changes applied since the last report (once per event or listing page:
        two metric updates per object were 14 ms of a 10,000-service listing)."""
        for kind, total in (
            (Kind.SERVICE, metrics.SERVICE_CHANGES_TOTAL),
            (Kind.ENDPOINT_SLICE, metrics.ENDPOINT_CHANGES_TOTAL),
        ):
            if self._unreported[kind]:
                total.inc(self._unreported[kind])
                self._unreported[kind] = 0
        self._pending_gauges()

    def _pending_gauges(self) -> None:
        metrics.SERVICE_CHANGES_PENDING.set(len(self._pending_services))
        metrics.ENDPOINT_CHANGES_PENDING.set(len(self._pending_endpoints))

    def _apply(self, kind: Kind, key: ServiceKey, obj: Incoming | None) -> bool:
        if kind is Kind.SERVICE:
            return self._apply_service(key, obj)
        return self._apply_slice(key, obj)

    def _apply_service(self, key: ServiceKey, obj: Incoming | None) -> bool:
        ports: dict[ServicePortName, ServicePort] = {}
        raw = obj.obj if isinstance(obj, Converted) else obj
        if raw is not None and self._wanted(raw):
            try:
                if isinstance(obj, Converted):
                    ports = cast(dict[ServicePortName, ServicePort], obj.value)
                else:
                    ports = service_ports(raw)
            except InvalidObject as e:
                self._report_invalid(Kind.SERVICE, e, kept=key in self._services)
                return False
        if self._invalid:  # good, deleted or not ours: what was said of it is over
            self._invalid.pop((Kind.SERVICE, _fmt(key)), None)
        old = self._services.get(key, {})
        if ports == old:
            return False
        self._dropped.update(spn for spn in old if spn not in ports)
        if ports:
            self._services[key] = ports
        else:
            self._services.pop(key, None)
        self._mark(key, service=True)
        self._service_changes += 1
        self._unreported[Kind.SERVICE] += 1
        return True

    def _apply_slice(self, key: ServiceKey, obj: Incoming | None) -> bool:
        info: EndpointSliceInfo | None = None
        if obj is not None:
            try:
                if isinstance(obj, Converted):
                    info = cast(EndpointSliceInfo | None, obj.value)
                else:
                    info = endpoint_slice(obj)
            except InvalidObject as e:
                self._report_invalid(Kind.ENDPOINT_SLICE, e, kept=key in self._slices)
                return False
        if self._invalid:
            self._invalid.pop((Kind.ENDPOINT_SLICE, _fmt(key)), None)
        old = self._slices.get(key)
        if _same_slice(old, info):
            return False
        # One service's slice changed (or came, or went): an edit its state may follow in
        # place; a slice that moved to another service changes both wholly.
        same = (
            old is None
            or info is None
            or (old.namespace, old.service)
            == (
                info.namespace,
                info.service,
            )
        )
        if old is not None:
            owner = (old.namespace, old.service)
            rest = tuple(k for k in self._slices_of.get(owner, ()) if k != key)
            if rest:
                self._slices_of[owner] = rest
            else:
                self._slices_of.pop(owner, None)  # a deleted service leaves no empty entry
            if info is None or not same:
                self._mark(owner, service=False, edit=(old, None) if same else None)
            del self._slices[key]
        if info is not None:
            owner = (info.namespace, info.service)
            self._slices[key] = info
            self._slices_of[owner] = (*self._slices_of.get(owner, ()), key)
            self._mark(owner, service=False, edit=(old, info) if same else None)
            t = _parse_time(info.trigger_time) if info.trigger_time else None
            if t is not None and t >= self._started:
                self._triggers.setdefault(owner, []).append(t)
        self._endpoint_changes += 1
        self._unreported[Kind.ENDPOINT_SLICE] += 1
        return True

    def _wanted(self, obj: Obj) -> bool:
        """kube-proxy's service-proxy-name filter: run beside another proxy, take only ours."""
        meta = obj.get("metadata")
        labels = meta.get("labels") if isinstance(meta, Mapping) else None
        value = labels.get(SERVICE_PROXY_NAME_LABEL) if isinstance(labels, Mapping) else None
        if self.service_proxy_name is None:
            return value is None
        return bool(value == self.service_proxy_name)

    def _report_invalid(self, kind: Kind, err: InvalidObject, *, kept: bool) -> None:
        """An object uproxy cannot use. One that was good before keeps its last good state
        (as a services file does, and as kube-proxy ignores a slice update it cannot read):
        a change the API server let through but uproxy cannot read must not take a serving
        service down. One line per object and reason, not one per relist of it."""
        marker = (kind, err.key)
        if self._invalid.get(marker) == str(err):
            return
        self._invalid[marker] = str(err)
        log.warning(
            "Skipping invalid object; keeping its last good state"
            if kept
            else "Skipping invalid object",
            extra=kv(kind=kind.value, object=err.key, field=err.field, reason=err.reason),
        )

    def describe(self) -> str:
        return f"{len(self._services)} services, {len(self._slices)} endpoint slices"


class Listing:
    """One full listing of a kind, page by page (``Tracker.listing``).

    ``add`` each page (it yields to the loop every few milliseconds), then ``finish``: keys
    the listing did not contain are deleted and the kind counts as listed. ``abandon`` when
    the listing cannot complete (an expired continuation: a fresh listing starts): what was
    applied stays (each object was true at the list's version), nothing is deleted. The
    cyclic collector is off for the whole listing (``heap``).
    """

    def __init__(self, tracker: Tracker, kind: Kind) -> None:
        self._tracker = tracker
        self._kind = kind
        self._seen: set[ServiceKey] = set()
        self._changed = False
        self._slice = TimeSlice()
        self._done = False
        heap.pause()

    async def add(self, objs: Iterable[Incoming]) -> None:
        tracker, kind = self._tracker, self._kind
        for obj in objs:
            key = _key(obj)
            self._seen.add(key)
            self._changed |= tracker._apply(kind, key, obj)
            await self._slice.tick()
        tracker._report()

    async def finish(self) -> None:
        tracker, kind = self._tracker, self._kind
        try:
            for key in [k for k in tracker._known(kind) if k not in self._seen]:
                self._changed |= tracker._apply(kind, key, None)
                await self._slice.tick()
            tracker._report()
            tracker._listed_now(kind, self._changed)
        finally:
            self.abandon()

    def abandon(self) -> None:
        if not self._done:
            self._done = True
            heap.resume()


def _key(obj: Incoming) -> ServiceKey:
    if isinstance(obj, Converted):
        obj = obj.obj
    meta = obj.get("metadata")
    if type(meta) is dict:  # every well-formed object: no text to build and split
        ns, name = meta.get("namespace"), meta.get("name")
        if type(name) is str and name and (ns is None or type(ns) is str):
            return (ns or "default", name)
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

    Both families are kept: a dual-stack service has IPv4 and IPv6 slices listing the same
    pods twice, and each family's service addresses go to that family's endpoints only (the
    syncer splits them). Counting pods, as the health-check node ports do, is per family.
    """
    if len(slices) == 1:
        only = slices[0].endpoints_for(spn.port_name, spn.protocol)
        if len(only) < 2:  # one endpoint (or none): nothing to merge or sort
            return only
    merged: dict[tuple[str, int], Endpoint] = {}
    for s in slices:
        for ep in s.endpoints_for(spn.port_name, spn.protocol):
            address = (ep.ip, ep.port)
            prev = merged.get(address)
            # The same address in two slices (mid-migration): a ready copy wins.
            if prev is None or (ep.ready and not prev.ready):
                merged[address] = ep
    # In address order, sorting the addresses (unique: tuples compared in C) rather than the
    # endpoints (the generated comparison, in Python): 13-17 ms at 20,000 endpoints in 200
    # slices, where it took 58-65.
    return tuple([merged[address] for address in sorted(merged)])


def _parse_time(text: str) -> float | None:
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        log.log(V2, "Unparsable trigger time", extra=kv(value=text))
        return None
