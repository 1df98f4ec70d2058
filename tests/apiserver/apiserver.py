"""An API-server double that speaks the real Kubernetes wire format, for tests and benchmarks.

No Kubernetes API server installs on a test machine, and a mocked client would test the
mock. This double serves the three resources uproxy follows over HTTPS with the JSON
shapes, query parameters and failure modes of kube-apiserver, so that uproxy's source runs
through the unpatched kubernetes-asyncio client exactly as in a cluster:

- one global resourceVersion shared by every kind, as etcd's revision is;
- list with ``limit``/``continue`` paging over a consistent snapshot;
- chunked watch from a resourceVersion (replayed from an event log), ``allowWatchBookmarks``,
  ``timeoutSeconds``, label and field selectors (an object that stops matching a selector is
  sent as DELETED, one that starts matching as ADDED, like the watch cache does);
- ``compact()`` makes every older version answer 410 Gone (as an ERROR event on a watch, as a
  410 Status on a list continuation); ``drop_watches()`` aborts every stream mid-chunk;
- bearer-token auth and TLS with a CA and a server certificate generated at start;
- ``restart()`` goes away (port closed, streams cut) and comes back on the same port with its
  state, which is what a control-plane upgrade looks like from a node.

Tests drive it with ``create``/``update``/``delete`` and observe it with request counters::

    async with ApiServerDouble() as api:
        api.create("Service", {"metadata": {"name": "web"}, "spec": {...}})
        kubeconfig = api.write_kubeconfig(tmp / "kubeconfig")  # server, CA file and token
        ...                      # run uproxy --kubeconfig kubeconfig
        api.compact(); api.drop_watches()               # force a 410 and a relist
        api.rewind(5); api.drop_watches()               # a restored etcd: 504 Too large
        await api.restart(down_for_s=10)                # an API server outage
        assert api.list_count("Service") == 2
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import json
import secrets
import shutil
import tempfile
import uuid
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web

from tests.apiserver.certs import write_certificates
from tests.apiserver.selectors import Filter, parse_field_selector, parse_label_selector

Obj = dict[str, Any]


@dataclass(frozen=True, slots=True)
class _Resource:
    kind: str
    api_version: str
    collection: str  # path of the all-namespaces collection
    namespaced_collection: str | None  # with {namespace}, or None for cluster-scoped kinds


_LIVENESS_CHECK_S = 0.25  # how often an idle watch checks that its client is still there
_EVENTS_PER_WRITE = 1000  # queued events sent in one write at most

_RESOURCES = {
    r.kind: r
    for r in (
        _Resource("Service", "v1", "/api/v1/services", "/api/v1/namespaces/{namespace}/services"),
        _Resource(
            "EndpointSlice",
            "discovery.k8s.io/v1",
            "/apis/discovery.k8s.io/v1/endpointslices",
            "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices",
        ),
        _Resource("Node", "v1", "/api/v1/nodes", None),
    )
}


@dataclass(frozen=True, slots=True)
class _Event:
    rv: int
    kind: str
    type: str  # ADDED, MODIFIED, DELETED
    obj: Obj
    old: Obj | None  # the previous version, to turn selector transitions into ADDED/DELETED


# --- the server ------------------------------------------------------------------------------


class _Watcher:
    __slots__ = ("bookmarks", "filter", "kind", "queue", "transport")

    def __init__(self, kind: str, flt: Filter, bookmarks: bool, transport: Any) -> None:
        self.kind = kind
        self.filter = flt
        self.bookmarks = bookmarks
        self.transport = transport
        # Items: an _Event, a _Bookmark, "drop" (abort the stream), "end" (close it cleanly),
        # "gone" (an ERROR 410 event, then the end) or bytes (written as they are).
        self.queue: asyncio.Queue[_Event | _Bookmark | str | bytes] = asyncio.Queue()


@dataclass(frozen=True, slots=True)
class _Bookmark:
    """A bookmark at the version when it was queued: every event before it is sent first.

    (Stamped at write time, a bookmark queued before an event could claim that event's
    version and a client resuming from it would never see the event.)
    """

    rv: int


def _status(code: int, reason: str, message: str) -> Obj:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _too_large(asked: int, current: int) -> Obj:
    """kube-apiserver's answer to a version newer than it has (storage.TooLargeResourceVersion)."""
    body = _status(504, "Timeout", f"Too large resource version: {asked}, current: {current}")
    body["details"] = {
        "causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}],
        "retryAfterSeconds": 1,
    }
    return body


def _json_response(body: Obj, status: int = 200) -> web.Response:
    return web.Response(
        body=json.dumps(body, separators=(",", ":")).encode(),
        status=status,
        content_type="application/json",
    )


def _key(kind: str, obj: Mapping[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata")
    if not isinstance(meta, Mapping) or not isinstance(meta.get("name"), str) or not meta["name"]:
        raise ValueError(f"{kind}: metadata.name must be a non-empty string")
    ns = meta.get("namespace")
    if _RESOURCES[kind].namespaced_collection is None:
        return ("", meta["name"])
    return (ns if isinstance(ns, str) and ns else "default", meta["name"])


class ApiServerDouble:
    """A kube-apiserver stand-in for Services, EndpointSlices and Nodes.

    ``tls=False`` serves plain HTTP (for benchmarks that want to leave TLS out of a figure).
    ``cert_tool``: "auto" uses the ``cryptography`` package when installed, else the
    ``openssl`` command. ``bookmark_interval_s`` sends bookmarks to every watch that asked
    for them periodically, as kube-apiserver does about once a minute; ``send_bookmarks()``
    sends them on demand.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        tls: bool = True,
        token: str | None = None,
        bookmark_interval_s: float | None = None,
        cert_tool: str = "auto",
    ) -> None:
        self.host = host
        self.tls = tls
        self.token = token if token is not None else secrets.token_urlsafe(24)
        self.bookmark_interval_s = bookmark_interval_s
        if cert_tool not in ("auto", "cryptography", "openssl"):
            raise ValueError(f"cert_tool must be auto, cryptography or openssl, not {cert_tool!r}")
        self.cert_tool = cert_tool
        self.port = 0
        self.requests: Counter[tuple[str, str]] = Counter()  # (verb, kind) -> count
        self.last_params: dict[tuple[str, str], dict[str, str]] = {}
        self.unauthorized = 0  # requests refused for a missing or wrong bearer token
        self._objects: dict[str, dict[tuple[str, str], Obj]] = {k: {} for k in _RESOURCES}
        self._log: list[_Event] = []
        self._rv = 1
        self._compacted_rv = 0
        self._continuations: dict[str, tuple[str, int, list[Obj]]] = {}
        self._watchers: set[_Watcher] = set()
        self._held: dict[str, asyncio.Event] = {}
        self._broken_lists: dict[str, list[tuple[int, bytes, dict[str, str]]]] = {}
        self._swallowing: set[str] = set()  # kinds whose new watches get no answer
        self._cutting: set[str] = set()  # kinds whose new watches end at once, empty
        self._swallowed: dict[str, int] = {}
        self._runner: web.AppRunner | None = None
        self._dir: Path | None = None

    # --- lifecycle ---

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    @property
    def ca_file(self) -> str:
        if self._dir is None:
            raise RuntimeError("the API server double has not been started")
        return str(self._dir / "ca.crt")

    @property
    def running(self) -> bool:
        return self._runner is not None

    async def start(self) -> None:
        """Serve; the first start picks a free port, later starts reuse it."""
        if self._runner is not None:
            return
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="uproxy-apiserver-"))
            if self.tls:
                await write_certificates(self._dir, self.host, tool=self.cert_tool)
        app = web.Application(middlewares=[self._auth])
        app.router.add_get("/version", self._version)
        for res in _RESOURCES.values():
            handler = self._collection_handler(res.kind)
            app.router.add_get(res.collection, handler)
            if res.namespaced_collection:
                app.router.add_get(res.namespaced_collection, handler)
        runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        ssl_context = None
        if self.tls:
            import ssl

            ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ssl_context.load_cert_chain(self._dir / "server.crt", self._dir / "server.key")
        site = web.TCPSite(
            runner, self.host, self.port, ssl_context=ssl_context, reuse_address=True
        )
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        if self.port == 0:
            self.port = int(runner.addresses[0][1])
        self._runner = runner

    async def go_down(self) -> None:
        """Stop serving (streams cut, port closed) but keep every object and version."""
        runner, self._runner = self._runner, None
        if runner is None:
            return
        self.drop_watches()
        await runner.cleanup()
        # A watch that came in while the port was closing (a client reconnecting at once),
        # still open after it: a server that is down sends nothing more.
        self.drop_watches()

    async def restart(self, *, down_for_s: float = 0.0) -> None:
        """Go away for ``down_for_s`` seconds, then come back on the same port with the state."""
        await self.go_down()
        if down_for_s > 0:
            await asyncio.sleep(down_for_s)
        await self.start()

    async def stop(self) -> None:
        await self.go_down()
        for ev in self._held.values():
            ev.set()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    async def __aenter__(self) -> ApiServerDouble:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def write_kubeconfig(self, path: str | Path) -> Path:
        cluster: dict[str, Any] = {"server": self.url}
        if self.tls:
            cluster["certificate-authority"] = self.ca_file
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "double", "cluster": cluster}],
            "users": [{"name": "uproxy", "user": {"token": self.token}}],
            "contexts": [{"name": "double", "context": {"cluster": "double", "user": "uproxy"}}],
            "current-context": "double",
        }
        out = Path(path)
        out.write_text(yaml.safe_dump(config))
        return out

    # --- driving it ---

    @property
    def resource_version(self) -> int:
        return self._rv

    def get(self, kind: str, namespace: str, name: str) -> Obj | None:
        obj = self._objects[str(kind)].get((namespace, name))
        return copy.deepcopy(obj) if obj is not None else None

    def objects(self, kind: str) -> list[Obj]:
        return [copy.deepcopy(o) for o in self._objects[str(kind)].values()]

    def create(self, kind: str, obj: Mapping[str, Any]) -> Obj:
        kind = str(kind)
        key = _key(kind, obj)
        if key in self._objects[kind]:
            raise ValueError(f"{kind} {key[0]}/{key[1]} already exists")
        new = self._stamp(kind, obj, key, previous=None)
        self._commit(kind, "ADDED", new, None)
        return copy.deepcopy(new)

    def update(self, kind: str, obj: Mapping[str, Any]) -> Obj:
        kind = str(kind)
        key = _key(kind, obj)
        old = self._objects[kind].get(key)
        if old is None:
            raise KeyError(f"{kind} {key[0]}/{key[1]} not found")
        new = self._stamp(kind, obj, key, previous=old)
        self._commit(kind, "MODIFIED", new, old)
        return copy.deepcopy(new)

    def apply(self, kind: str, obj: Mapping[str, Any]) -> Obj:
        """Create or update."""
        kind = str(kind)
        if _key(kind, obj) in self._objects[kind]:
            return self.update(kind, obj)
        return self.create(kind, obj)

    def delete(self, kind: str, obj: Mapping[str, Any]) -> None:
        kind = str(kind)
        key = _key(kind, obj)
        old = self._objects[kind].get(key)
        if old is None:
            raise KeyError(f"{kind} {key[0]}/{key[1]} not found")
        self._rv += 1
        gone = copy.deepcopy(old)
        gone["metadata"]["resourceVersion"] = str(self._rv)
        self._commit(kind, "DELETED", gone, old)

    def rewind(self, resource_version: int) -> None:
        """Come back at an older version, as an API server on a restored etcd does.

        The objects stay as they are, the history goes, and the global version moves back to
        ``resource_version``: a watch from any newer version now fails with kube-apiserver's
        504 "Too large resource version" (a client must relist), and the next changes reuse
        version numbers a client may have seen already.
        """
        if not 0 < resource_version <= self._rv:
            raise ValueError(f"rewind to {resource_version}: must be in 1..{self._rv}")
        self._rv = resource_version
        self._compacted_rv = min(self._compacted_rv, resource_version)
        self._log.clear()
        self._continuations.clear()

    def compact(self) -> None:
        """Forget history: every version older than now answers 410 Gone."""
        self._compacted_rv = self._rv
        self._log.clear()
        self._continuations.clear()

    def drop_watches(self) -> int:
        """Abort every open watch stream mid-chunk, as a dying connection or proxy would."""
        for w in self._watchers:
            w.queue.put_nowait("drop")
        return len(self._watchers)

    def expire_watches(self) -> int:
        """Send 410 Gone on every open stream, as kube-apiserver does to a watcher that fell
        too far behind its watch cache, then end the stream."""
        for w in self._watchers:
            w.queue.put_nowait("gone")
        return len(self._watchers)

    def end_watches(self) -> int:
        """End every open watch stream cleanly, as kube-apiserver does at timeoutSeconds."""
        for w in self._watchers:
            w.queue.put_nowait("end")
        return len(self._watchers)

    def send_raw(self, kind: str, data: bytes) -> int:
        """Write ``data`` as it is on every open watch stream of ``kind`` (after the events
        queued before it): what a broken server or a proxy in the way might send."""
        n = 0
        for w in self._watchers:
            if w.kind == str(kind):
                w.queue.put_nowait(data)
                n += 1
        return n

    def send_bookmarks(self) -> int:
        n = 0
        for w in self._watchers:
            if w.bookmarks:
                w.queue.put_nowait(_Bookmark(self._rv))
                n += 1
        return n

    def break_lists(
        self,
        kind: str,
        *bodies: bytes,
        status: int = 200,
        headers: dict[str, str] | None = None,
    ) -> None:
        """Answer the next lists of ``kind`` (one each) with these bodies, ``status`` and
        ``headers``: what a broken server, a proxy in the way, a refusal (RBAC's 403) or
        API Priority and Fairness (429 with ``Retry-After``) sends."""
        answers = ((status, b, dict(headers or {})) for b in bodies)
        self._broken_lists.setdefault(str(kind), []).extend(answers)

    def hold_lists(self, kind: str) -> None:
        """Make lists of ``kind`` wait until ``release_lists``."""
        self._held.setdefault(str(kind), asyncio.Event())

    def release_lists(self, kind: str) -> None:
        ev = self._held.pop(str(kind), None)
        if ev is not None:
            ev.set()

    def swallow_watches(self, kind: str) -> None:
        """Leave new watches of ``kind`` unanswered, no headers ever (a dead peer behind a
        pooled connection, a stuck load balancer), until ``answer_watches``."""
        self._swallowing.add(str(kind))

    def cut_watches(self, kind: str) -> None:
        """End new watches of ``kind`` at once with an empty 200, until ``answer_watches``:
        what a proxy or load balancer in the way that closes streams does."""
        self._cutting.add(str(kind))

    def answer_watches(self, kind: str) -> None:
        """Answer new watches of ``kind`` again (those swallowed stay unanswered)."""
        self._swallowing.discard(str(kind))
        self._cutting.discard(str(kind))

    def swallowed(self, kind: str) -> int:
        """Watches of ``kind`` left unanswered so far."""
        return self._swallowed.get(str(kind), 0)

    def open_watches(self, kind: str) -> int:
        return sum(1 for w in self._watchers if w.kind == str(kind))

    def list_count(self, kind: str) -> int:
        return self.requests[("list", str(kind))]

    def watch_count(self, kind: str) -> int:
        return self.requests[("watch", str(kind))]

    def _stamp(
        self, kind: str, obj: Mapping[str, Any], key: tuple[str, str], previous: Obj | None
    ) -> Obj:
        res = _RESOURCES[kind]
        new: Obj = copy.deepcopy(dict(obj))
        self._rv += 1
        meta = new["metadata"]
        if res.namespaced_collection is not None:
            meta["namespace"] = key[0]
        prev_meta = previous["metadata"] if previous is not None else {}
        meta["uid"] = prev_meta.get("uid") or str(uuid.uuid4())
        meta["creationTimestamp"] = prev_meta.get("creationTimestamp") or _now()
        meta["resourceVersion"] = str(self._rv)
        new["kind"] = res.kind
        new["apiVersion"] = res.api_version
        return new

    def _commit(self, kind: str, type_: str, new: Obj, old: Obj | None) -> None:
        key = _key(kind, new)
        if type_ == "DELETED":
            del self._objects[kind][key]
        else:
            self._objects[kind][key] = new
        event = _Event(self._rv, kind, type_, new, old)
        self._log.append(event)
        if self._runner is None:
            return  # down: a watch resumes from the log once back up
        for w in self._watchers:
            if w.kind == kind:
                w.queue.put_nowait(event)

    # --- HTTP ---

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            self.unauthorized += 1
            return _json_response(_status(401, "Unauthorized", "Unauthorized"), 401)
        response: web.StreamResponse = await handler(request)
        return response

    async def _version(self, request: web.Request) -> web.Response:
        return _json_response({"major": "1", "minor": "31", "gitVersion": "v1.31.0-double"})

    def _collection_handler(self, kind: str) -> Any:
        async def handler(request: web.Request) -> web.StreamResponse:
            return await self._collection(request, kind)

        return handler

    async def _collection(self, request: web.Request, kind: str) -> web.StreamResponse:
        q = request.query
        try:
            flt = Filter(
                labels=parse_label_selector(q.get("labelSelector", "")),
                fields=parse_field_selector(q.get("fieldSelector", "")),
                namespace=request.match_info.get("namespace"),
            )
        except ValueError as exc:
            return _json_response(_status(400, "BadRequest", str(exc)), 400)
        watch = q.get("watch", "").lower() in ("true", "1")
        verb = "watch" if watch else "list"
        self.requests[(verb, kind)] += 1
        self.last_params[(verb, kind)] = dict(q)
        if watch:
            return await self._watch(request, kind, flt)
        return await self._list(request, kind, flt)

    async def _list(self, request: web.Request, kind: str, flt: Filter) -> web.Response:
        held = self._held.get(kind)
        if held is not None:
            await held.wait()
        broken = self._broken_lists.get(kind)
        if broken:
            status, raw, headers = broken.pop(0)
            return web.Response(
                body=raw, status=status, headers=headers, content_type="application/json"
            )
        q = request.query
        res = _RESOURCES[kind]
        token = q.get("continue")
        if token:
            cont = self._continuations.pop(token, None)
            if cont is None or cont[0] != kind:
                msg = "The provided continue parameter is too old to display a consistent list"
                return _json_response(_status(410, "Expired", msg), 410)
            _, rv, items = cont
        else:
            rv = self._rv
            items = [o for o in self._objects[kind].values() if flt.matches(o)]
            items.sort(key=lambda o: _key(kind, o))
        limit = int(q.get("limit", "0") or 0)
        meta: Obj = {"resourceVersion": str(rv)}
        if limit > 0 and len(items) > limit:
            rest = items[limit:]
            items = items[:limit]
            new_token = secrets.token_urlsafe(16)
            self._continuations[new_token] = (kind, rv, rest)
            meta["continue"] = new_token
            meta["remainingItemCount"] = len(rest)
        # Items of a list carry no kind/apiVersion, as kube-apiserver sends them.
        body = {
            "kind": f"{res.kind}List",
            "apiVersion": res.api_version,
            "metadata": meta,
            "items": [_strip_type(o) for o in items],
        }
        return _json_response(body)

    async def _watch(self, request: web.Request, kind: str, flt: Filter) -> web.StreamResponse:
        if kind in self._swallowing:
            self._swallowed[kind] = self._swallowed.get(kind, 0) + 1
            await asyncio.Event().wait()  # until the client gives up (or the server stops)
        if kind in self._cutting:
            return web.Response(status=200, content_type="application/json")
        q = request.query
        res = _RESOURCES[kind]
        rv_text = q.get("resourceVersion", "")
        bookmarks = q.get("allowWatchBookmarks", "").lower() in ("true", "1")
        timeout_s = float(q.get("timeoutSeconds", "0") or 0)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        watcher = _Watcher(kind, flt, bookmarks, request.transport)
        backlog: list[_Event | Obj] = []
        gone = False
        if rv_text in ("", "0"):
            # No version: the current state as synthetic ADDED events, then changes.
            backlog = [o for o in self._objects[kind].values() if flt.matches(o)]
        else:
            try:
                since = int(rv_text)
            except ValueError:
                return _json_response(_status(400, "BadRequest", "invalid resourceVersion"), 400)
            if since > self._rv:
                # kube-apiserver waits ~3 s for its cache to reach a newer version, then says:
                return _json_response(_too_large(since, self._rv), 504)
            gone = since < self._compacted_rv
            backlog = [e for e in self._log if e.kind == kind and e.rv > since]
        # Register before any await so no event can slip between backlog and queue.
        self._watchers.add(watcher)
        try:
            await response.prepare(request)
            if gone:
                msg = f"too old resource version: {rv_text} ({self._compacted_rv})"
                await _write(response, {"type": "ERROR", "object": _status(410, "Expired", msg)})
                return response
            for item in backlog:
                if isinstance(item, _Event):
                    line = _event_line(item, flt)
                    if line is not None:
                        await _write(response, line)
                else:
                    await _write(response, {"type": "ADDED", "object": item})
            await self._stream(response, watcher, res, timeout_s)
        except ConnectionError:
            pass
        finally:
            self._watchers.discard(watcher)
        return response

    async def _stream(
        self, response: web.StreamResponse, w: _Watcher, res: _Resource, timeout_s: float
    ) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s if timeout_s > 0 else None
        interval = self.bookmark_interval_s if w.bookmarks else None
        next_bookmark = loop.time() + interval if interval else None
        held: _Event | _Bookmark | str | bytes | None = None  # taken, not sent yet
        while True:
            now = loop.time()
            if deadline is not None and now >= deadline:
                return  # a clean end of stream, as at timeoutSeconds
            if w.transport is None or w.transport.is_closing():
                return  # the client went away: do not count it as an open watch
            item: _Event | _Bookmark | str | bytes
            if held is not None:
                item, held = held, None
            elif interval and next_bookmark is not None and now >= next_bookmark:
                # Only with nothing queued: then every event up to now has been sent.
                next_bookmark = now + interval
                if not w.queue.empty():
                    continue
                item = _Bookmark(self._rv)
            else:
                wait = _LIVENESS_CHECK_S
                for t in (deadline, next_bookmark):
                    if t is not None:
                        wait = min(wait, t - now)
                try:
                    item = await asyncio.wait_for(w.queue.get(), max(0.0, wait))
                except TimeoutError:
                    continue
            if isinstance(item, bytes):
                await response.write(item)
                continue
            if item == "end":
                return
            if item == "gone":
                msg = f"too old resource version: watch expired at {self._rv}"
                await _write(response, {"type": "ERROR", "object": _status(410, "Expired", msg)})
                return
            if item == "drop":
                w.transport.abort()
                raise ConnectionResetError("watch dropped by the test")
            if isinstance(item, _Bookmark):
                if w.bookmarks:
                    meta = {"resourceVersion": str(item.rv)}
                    obj = {"kind": res.kind, "apiVersion": res.api_version, "metadata": meta}
                    await _write(response, {"type": "BOOKMARK", "object": obj})
                continue
            if isinstance(item, _Event):
                # Events queued together go out in one write, as a busy server's share
                # segments: a client that falls behind reads many at once.
                lines: list[bytes] = []
                while True:
                    line = _event_line(item, w.filter)
                    if line is not None:
                        lines.append(_encode(line))
                    if w.queue.empty() or len(lines) >= _EVENTS_PER_WRITE:
                        break
                    nxt = w.queue.get_nowait()
                    if not isinstance(nxt, _Event):
                        held = nxt
                        break
                    item = nxt
                if lines:
                    await response.write(b"".join(lines))


def _event_line(event: _Event, flt: Filter) -> Obj | None:
    new_match = flt.matches(event.obj)
    old_match = event.old is not None and flt.matches(event.old)
    if event.type == "ADDED":
        return {"type": "ADDED", "object": event.obj} if new_match else None
    if event.type == "DELETED":
        return {"type": "DELETED", "object": event.obj} if old_match else None
    if new_match and old_match:
        return {"type": "MODIFIED", "object": event.obj}
    if new_match:
        return {"type": "ADDED", "object": event.obj}
    if old_match:
        return {"type": "DELETED", "object": event.obj}
    return None


async def _write(response: web.StreamResponse, event: Obj) -> None:
    await response.write(_encode(event))


def _encode(event: Obj) -> bytes:
    return json.dumps(event, separators=(",", ":")).encode() + b"\n"


def _strip_type(obj: Obj) -> Obj:
    return {k: v for k, v in obj.items() if k not in ("kind", "apiVersion")}


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
