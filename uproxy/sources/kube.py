"""The Kubernetes source: follow Services, EndpointSlices and this Node live.

A DaemonSet lives for months against an API server that relists, compacts, restarts and drops
streams, so each resource is followed by one loop shaped like client-go's reflector:

    list (paged, one consistent snapshot) -> tracker.replace_async()  # replaces by difference
    watch from the list's resourceVersion, with bookmarks
      - every event and bookmark advances the remembered resourceVersion;
      - a clean end of stream (server timeout) -> watch again from it;
      - a dropped stream or refused connection -> capped backoff, watch again from it;
      - a stream silent past the inactivity timeout, or a watch not answered within 30 s
        -> watch again from it (a dead TCP peer would otherwise hang the read forever: the
        client sets no read timeout);
      - 410 Gone (history compacted) or 504 "Too large resource version" (the server is behind
        us: a restored etcd) -> relist.

Nothing else relists: every ``config_sync_period_s`` the tracker announces every service
again (``Tracker.resync``), as an informer's resync re-delivers from its cache, and the
syncer looks at each service port once more. A periodic LIST would be a consistent read of
every Service and EndpointSlice from etcd, from every node: at 10,000 services and 1,000
nodes every 15 min, two 10,000-object reads a second that kube-proxy never asks for.

State is never cleared on an error: while the API server is unreachable uproxy keeps serving
what it last knew, and a partial list (a paging continuation that expired) is thrown away and
restarted rather than applied. Only a complete listing replaces state, by difference, so an
unchanged service port never loses its listener.

Why not ``kubernetes_asyncio.watch.Watch``: it retries a 410 once from the same stale version
and then raises, reconnects silently on a clean end, and deserializes every event into a model
object that uproxy would turn straight back into a dict (the tracker takes the API's JSON
shape). Reading the stream of the unpatched client's own request (``_preload_content=False``)
and parsing each line with ``json.loads`` gives the dict directly. Measured on this machine
against the API-server double, 5,000 Service ADDED events read over TLS: ``Watch.stream``
1.7 s, plus 0.2 s to ``sanitize_for_serialization`` its models back to dicts; reading the
lines and ``json.loads`` 0.17 s, network included.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import functools
import json
import logging
import os
import random
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol as TypingProtocol

import aiohttp
import yaml

from uproxy import heap, metrics
from uproxy.log import V2, kv
from uproxy.objects import (
    HEADLESS_LABEL,
    SERVICE_PROXY_NAME_LABEL,
    InvalidObject,
    node_info,
    object_key,
)
from uproxy.sources.kubeclient import (
    ApiClient,
    ConfigException,
    Configuration,
    CoreV1Api,
    DiscoveryV1Api,
    load_incluster_config,
    load_kube_config,
)
from uproxy.tracker import Kind, Tracker

log = logging.getLogger("uproxy.sources.kube")

Obj = Mapping[str, Any]

IN_CLUSTER_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"
LIST_PAGE_SIZE = 500  # kube-apiserver's and client-go's default page size
LIST_TIMEOUT_S = 60.0  # per page
CONNECT_TIMEOUT_S = 10.0
TOKEN_FILE_PERIOD_S = 60.0  # a kubeconfig's tokenFile is read again at least this often
EXEC_CREDENTIAL_MARGIN_S = 60.0  # an exec plugin's token is replaced this long before expiry
WATCH_HEADERS_TIMEOUT_S = 30.0  # a watch's answer, before its stream (see ``_watch``)
WATCH_STEADY_S = 10.0  # a watch open this long counts as a success for the backoff
# A watch that ends within this long having delivered nothing failed, as client-go's reflector
# counts it ("very short watch"): something between here and the server (a proxy, a load
# balancer) closes streams at once, and reopening at once was ~650 requests a second.
WATCH_SHORT_S = 1.0
# The server ends each watch after a random 5-10 minutes (client-go's reflector does the
# same) so that watches of many nodes do not all reconnect at once after an outage.
WATCH_TIMEOUT_RANGE_S = (300.0, 600.0)
BACKOFF_INITIAL_S = 0.5
YIELD_EVERY = 200  # events handled between yields to the loop during a burst
# Events in one read of a watch stream that make a burst (``_Burst``): a stream that keeps
# up with its events brings one or a few per read.
BURST_EVENTS = 64
# One watch event's limit: etcd stores objects of up to 1.5 MiB by default.
MAX_EVENT_BYTES = 16 << 20


class KubeConfigError(ValueError):
    """No usable client configuration; the message says what was tried and what to pass."""


async def make_api_client(*, kubeconfig: str | None, master: str | None) -> ApiClient:
    """An API client configured as kube-proxy would be.

    ``--kubeconfig`` when given; otherwise in-cluster config inside a pod; otherwise
    ``$KUBECONFIG`` (one path, or several joined by ``:``, merged as kubectl merges them) or
    ``~/.kube/config``. ``--master`` overrides the server address of whichever was loaded
    (or is used alone, without credentials, when nothing else exists). A configuration that
    cannot be used is a KubeConfigError of one line.
    """
    cfg = Configuration()
    source = _config_source(kubeconfig=kubeconfig, master=master)
    try:
        if source == "in-cluster":
            _load_incluster_config(client_configuration=cfg)
        elif source is not None:
            docs = _read_kubeconfigs(source)
            user, where = _current_user(docs)
            try:
                loader = await load_kube_config(config_file=source, client_configuration=cfg)
            except (OSError, ConfigException) as exc:
                if "exec" not in user or not _from_exec_plugin(exc):
                    raise
                raise KubeConfigError(
                    f"Kubernetes configuration {source}: its exec plugin "
                    f"{_exec_command(user)}: {getattr(exc, 'strerror', None) or exc}"
                ) from None
            token_file = _token_file(user, where)
            if "exec" in user:
                cfg.refresh_api_key_hook = _ExecCredential(loader, _exec_command(user))
            elif token_file is not None:
                cfg.refresh_api_key_hook = _TokenFile(token_file)
    except KubeConfigError:
        raise  # already one line naming the file (``_read_kubeconfigs``)
    except ConfigException as exc:
        raise KubeConfigError(f"cannot load Kubernetes configuration {source}: {exc}") from None
    except OSError as exc:
        raise KubeConfigError(f"cannot read Kubernetes configuration {source}: {exc}") from None
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        # The library's own reading of a kubeconfig whose fields are of the wrong kind.
        raise KubeConfigError(
            f"cannot load Kubernetes configuration {source}: {_describe(exc)}"
        ) from None
    if master:
        cfg.host = _server_url(master, tls=bool(cfg.ssl_ca_cert or cfg.cert_file or source))
    proxy = getattr(cfg, "proxy", None)
    if isinstance(proxy, str) and proxy and not proxy.lower().startswith(("http://", "https://")):
        # The client's HTTP library speaks to HTTP proxies only; a SOCKS one failed every
        # request with "ClientProxyConnectionError", retried for ever.
        raise KubeConfigError(
            f"Kubernetes configuration {source}: proxy-url {proxy}: only http:// and "
            "https:// proxies are supported"
        )
    return ApiClient(configuration=cfg)


def _server_url(master: str, *, tls: bool) -> str:
    """``--master`` as a URL: ``host:port`` alone is https when TLS is configured (any
    kubeconfig or in-cluster config), else http, as client-go reads it; anything else that
    is not an http(s) URL is a KubeConfigError of one line (it used to be retried for ever
    as a request to a path named like the flag's value)."""
    text = master.strip()
    if "://" not in text:
        text = ("https://" if tls else "http://") + text
    url = urllib.parse.urlsplit(text)
    try:
        url.port  # noqa: B018 - a port that is not a number raises
        valid = url.scheme in ("http", "https") and bool(url.hostname) and " " not in text
    except ValueError:
        valid = False
    if not valid:
        raise KubeConfigError(f"--master {master!r}: not an API server URL like https://HOST:PORT")
    return text.rstrip("/")


_load_incluster_config: Callable[..., None] = load_incluster_config


def _read_kubeconfigs(source: str) -> list[tuple[str, Mapping[str, Any]]]:
    """Each kubeconfig file ``source`` names, parsed: one path, or several joined by ``:``
    (``$KUBECONFIG``), of which those that do not exist are skipped, as kubectl does, as
    long as one does. A file that cannot be read, or is not a YAML mapping, is a
    KubeConfigError of one line (the client library would fail on it with a traceback, or
    with a message about a missing key)."""
    paths = [os.path.expanduser(p) for p in source.split(os.pathsep) if p]
    docs: list[tuple[str, Mapping[str, Any]]] = []
    for path in paths:
        try:
            with open(path, "rb") as fh:
                raw = fh.read()
        except FileNotFoundError:
            if len(paths) > 1:
                continue
            raise KubeConfigError(
                f"cannot read Kubernetes configuration {path}: no such file"
            ) from None
        except OSError as exc:
            raise KubeConfigError(
                f"cannot read Kubernetes configuration {path}: {exc.strerror or exc}"
            ) from None
        try:
            doc = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" line {mark.line + 1}:" if mark is not None else ""
            raise KubeConfigError(
                f"Kubernetes configuration {path}:{where} not valid YAML"
            ) from None
        if not isinstance(doc, Mapping):
            raise KubeConfigError(
                f"Kubernetes configuration {path}: not a kubeconfig (expected a YAML mapping)"
            )
        docs.append((path, doc))
    if not docs:
        raise KubeConfigError(f"cannot read Kubernetes configuration {source}: no such file")
    return docs


def _named(entries: Any, key: str) -> Iterable[tuple[Any, Mapping[str, Any]]]:
    """(name, ``entry[key]``) of each well-formed entry of a kubeconfig list."""
    for entry in entries if isinstance(entries, list) else ():
        if isinstance(entry, Mapping):
            body = entry.get(key)
            yield entry.get("name"), body if isinstance(body, Mapping) else {}


def _current_user(docs: list[tuple[str, Mapping[str, Any]]]) -> tuple[Mapping[str, Any], str]:
    """The current context's user, and the file that holds it, merged as the client library
    merges the files: the first context and user of a name win, the last
    ``current-context`` wins."""
    current: Any = None
    contexts: dict[Any, Mapping[str, Any]] = {}
    users: dict[Any, tuple[str, Mapping[str, Any]]] = {}
    for path, doc in docs:
        if "current-context" in doc:
            current = doc["current-context"]
        for name, context in _named(doc.get("contexts"), "context"):
            contexts.setdefault(name, context)
        for name, user in _named(doc.get("users"), "user"):
            users.setdefault(name, (path, user))
    user_name = contexts.get(current, {}).get("user")
    where, user = users.get(user_name, ("", {}))
    return user, where


def _token_file(user: Mapping[str, Any], where: str) -> str | None:
    """The user's ``tokenFile``, if it has one; a relative path is relative to the file
    that named it (``where``)."""
    token_file = user.get("tokenFile")
    if not isinstance(token_file, str) or not token_file:
        return None
    return os.path.join(os.path.dirname(os.path.abspath(where)), token_file)


class _Credential:
    """A bearer token that the client asks for before each request (the configuration's
    ``refresh_api_key_hook``), read again when it is due, and at the next request after the
    API server refused it (``rejected``, on a 401), as client-go does."""

    def __init__(self) -> None:
        self.refused = False
        self.read_at = float("-inf")  # time.monotonic() of the last read

    def rejected(self, asked_at: float) -> None:
        """A request made at ``asked_at`` was refused; one made with a credential read since
        (requests in flight while it was read again) says nothing about the new one."""
        if asked_at >= self.read_at:
            self.refused = True


def credential_rejected(client: ApiClient, asked_at: float) -> None:
    """The API server answered 401 to a request made at ``asked_at`` (time.monotonic()):
    read the credential again before the next request."""
    hook: object = client.configuration.refresh_api_key_hook
    if isinstance(hook, _Credential):
        hook.rejected(asked_at)


class _TokenFile(_Credential):
    """A kubeconfig's ``tokenFile``, read again when it changes, and at least every minute.

    kubernetes_asyncio reads it once; a projected service-account token (kubeadm's
    kube-proxy kubeconfig names one) is rotated, and with the first token uproxy would get
    401s for ever while serving what it last knew. client-go caches the file for a minute.
    """

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self.mtime = -1.0

    def __call__(self, configuration: Configuration, *args: object) -> None:
        try:
            mtime = os.stat(self.path).st_mtime
        except OSError:
            return  # keep the token known until the file is back
        now = time.monotonic()
        fresh = mtime == self.mtime and now - self.read_at < TOKEN_FILE_PERIOD_S
        if fresh and not self.refused:
            return
        try:
            with open(self.path, encoding="utf-8") as fh:
                token = fh.read().strip()
        except OSError:
            return
        self.mtime, self.read_at, self.refused = mtime, now, False
        if token:
            configuration.api_key["BearerToken"] = f"Bearer {token}"


class _ExecCredential(_Credential):
    """A kubeconfig ``exec`` user (``aws eks get-token``, ``gke-gcloud-auth-plugin``,
    ``kubelogin``): the plugin is run again shortly before the token it gave expires, or
    after the API server refused it.

    kubernetes_asyncio runs the plugin once, when the kubeconfig is loaded; the tokens such
    plugins give last 15 minutes to an hour, after which uproxy got 401s for ever while
    serving what it last knew (with /healthz still 200). Token credentials only: a plugin
    that gives a client certificate is read once, as the client's TLS context is.
    """

    def __init__(self, loader: Any, command: str) -> None:
        super().__init__()
        self.loader = loader
        self.command = command
        self.lock = asyncio.Lock()

    def _due(self) -> bool:
        if self.refused:
            return True
        expiry = getattr(self.loader, "exec_plugin_expiry", None)
        if not isinstance(expiry, datetime.datetime):
            return False  # no expiry given: the token is good until it is refused
        left = expiry - datetime.datetime.now(datetime.UTC)
        return left.total_seconds() <= EXEC_CREDENTIAL_MARGIN_S

    async def __call__(self, configuration: Configuration, *args: object) -> None:
        if not self._due() and not self.lock.locked():
            return
        # One run of the plugin; the requests asked for meanwhile wait for its token.
        async with self.lock:
            if not self._due():
                return
            self.refused, self.read_at = False, time.monotonic()
            if hasattr(self.loader, "exec_plugin_expiry"):
                del self.loader.exec_plugin_expiry  # the library's own "still valid" check
            try:
                await self.loader.load_from_exec_plugin()
            except Exception as exc:  # the plugin's failure: the request goes on, and fails
                log.warning(
                    "Cannot refresh the kubeconfig's exec credential",
                    extra=kv(command=self.command, error=_describe(exc)),
                )
                return
            token = getattr(self.loader, "token", None)
            if isinstance(token, str) and token:
                configuration.api_key["BearerToken"] = token
            log.log(V2, "Refreshed the kubeconfig's exec credential")


def _from_exec_plugin(exc: BaseException) -> bool:
    """Whether the client's loading failed running the exec plugin: the plugin could not be
    started (OSError from the spawn; the kubeconfig itself was read before) or it failed."""
    return isinstance(exc, OSError) or str(exc).startswith("exec:")


def _exec_command(user: Mapping[str, Any]) -> str:
    spec = user.get("exec")
    return str(spec.get("command")) if isinstance(spec, Mapping) else "?"


def _config_source(*, kubeconfig: str | None, master: str | None) -> str | None:
    """A kubeconfig path, "in-cluster", or None (``--master`` alone)."""
    if kubeconfig:
        return kubeconfig
    if os.environ.get("KUBERNETES_SERVICE_HOST") and os.path.exists(IN_CLUSTER_TOKEN):
        return "in-cluster"
    env_kubeconfig = os.environ.get("KUBECONFIG")
    if env_kubeconfig:
        return env_kubeconfig
    default_kubeconfig = os.path.expanduser("~/.kube/config")
    if os.path.exists(default_kubeconfig):
        return default_kubeconfig
    if master:
        return None
    raise KubeConfigError(
        "no Kubernetes configuration: not in a pod, no $KUBECONFIG, no ~/.kube/config;"
        " pass --kubeconfig or --master, or use --services FILE"
    )


def service_label_selector(service_proxy_name: str | None) -> str:
    """kube-proxy's server-side selector, applied to Services and EndpointSlices alike.

    The EndpointSlice controller copies a service's labels onto its slices, so the same
    selector keeps the slices of services another proxy owns off the wire too.
    """
    if service_proxy_name:
        return f"{SERVICE_PROXY_NAME_LABEL}={service_proxy_name},!{HEADLESS_LABEL}"
    return f"!{SERVICE_PROXY_NAME_LABEL},!{HEADLESS_LABEL}"


class _Gone(Exception):
    """The resourceVersion we hold cannot be served; only a relist helps.

    410 Gone (compacted away, "Expired"), or 504 "Too large resource version": the API server
    is behind the version we hold (a restored etcd, a lagging new instance). Retrying the same
    version would fail forever; client-go's reflector relists on both.
    """

    def __init__(self, why: str = "expired") -> None:
        super().__init__(why)
        self.why = why


def _relist_reason(status: int, body: Mapping[str, Any]) -> str | None:
    """Why an error means "relist" (see ``_Gone``), or None for any other error."""
    if status == 410 or body.get("reason") == "Expired":
        return "expired"
    details = body.get("details")
    causes = details.get("causes") if isinstance(details, Mapping) else None
    for cause in causes if isinstance(causes, list) else ():
        if isinstance(cause, Mapping) and cause.get("reason") == "ResourceVersionTooLarge":
            return "too large resource version"
    message = body.get("message")
    if isinstance(message, str) and "too large resource version" in message.lower():
        return "too large resource version"
    return None


class _Silent(Exception):
    """The stream said nothing, not even a bookmark, for the inactivity timeout."""


class _ApiError(Exception):
    def __init__(self, status: int, reason: str, retry_after_s: float = 0.0) -> None:
        self.status = status
        self.reason = reason
        self.retry_after_s = retry_after_s  # what the server asked for (429, 503)
        super().__init__(f"{status} {reason}")


# The longest ``Retry-After`` taken as it is: a server that asks for more is asked again then.
RETRY_AFTER_MAX_S = 60.0


def _retry_after(headers: Mapping[str, str]) -> float:
    """A 429's or 503's ``Retry-After`` in seconds (0: none, or a date, which kube-apiserver
    never sends). API Priority and Fairness sends it to a client it throttles; client-go
    waits at least that long, so does uproxy, rather than its own shorter backoff."""
    try:
        return min(max(float(headers.get("Retry-After", "0")), 0.0), RETRY_AFTER_MAX_S)
    except ValueError:
        return 0.0


def _delay(backoff: _Backoff, exc: BaseException) -> float:
    delay = backoff.next_delay()
    if isinstance(exc, _ApiError):
        delay = max(delay, exc.retry_after_s)
    return delay


# Errors after which the loop backs off and retries; anything else is a bug, logged with a
# traceback by the supervisor and restarted.
_RETRYABLE = (_ApiError, aiohttp.ClientError, OSError, TimeoutError, ValueError)


@dataclass(slots=True)
class _Feed:
    """One followed resource: how to list it and where its objects go."""

    name: str
    list_fn: Callable[..., Awaitable[Any]]
    selector: dict[str, str]
    listing: Callable[[], Listing]
    on_event: Callable[[str, Obj], None]
    rv: str | None = None
    listed_once: bool = False


class Listing(TypingProtocol):
    """Where a listing's pages go (``uproxy.tracker.Listing``, or the Node's)."""

    async def add(self, objs: Iterable[Obj]) -> None: ...

    async def finish(self) -> None: ...

    def abandon(self) -> None: ...


class _NodeListing:
    """The Node feed lists one object: collect it, then hand it over."""

    def __init__(self, done: Callable[[list[Obj]], None]) -> None:
        self._done = done
        self._objs: list[Obj] = []

    async def add(self, objs: Iterable[Obj]) -> None:
        self._objs.extend(objs)

    async def finish(self) -> None:
        self._done(self._objs)

    def abandon(self) -> None:
        return None


class _Backoff:
    """Capped exponential backoff with jitter, reset by progress."""

    __slots__ = ("attempt", "cap_s")

    def __init__(self, cap_s: float) -> None:
        self.cap_s = cap_s
        self.attempt = 0

    def reset(self) -> None:
        self.attempt = 0

    def next_delay(self) -> float:
        delay = min(self.cap_s, BACKOFF_INITIAL_S * 2.0**self.attempt)
        self.attempt = min(self.attempt + 1, 30)
        return delay * random.uniform(0.8, 1.2)


class KubeSource:
    def __init__(
        self,
        *,
        tracker: Tracker,
        api_client: ApiClient,
        node_name: str,
        service_proxy_name: str | None,
        config_sync_period_s: float = 900.0,
        inactivity_timeout_s: float = 300.0,
        backoff_max_s: float = 30.0,
    ) -> None:
        self.tracker = tracker
        self.api_client = api_client
        host = urllib.parse.urlsplit(api_client.configuration.host).netloc
        self._answered = functools.partial(metrics.API_REQUESTS.labels, method="GET", host=host)
        self.node_name = node_name
        self.config_sync_period_s = config_sync_period_s
        self.inactivity_timeout_s = inactivity_timeout_s
        self.backoff_max_s = backoff_max_s
        self._node_missing_reported = False
        core = CoreV1Api(api_client)
        discovery = DiscoveryV1Api(api_client)
        selector = {"label_selector": service_label_selector(service_proxy_name)}
        self.feeds = [
            _Feed(
                Kind.SERVICE.value,
                core.list_service_for_all_namespaces,
                selector,
                lambda: tracker.listing(Kind.SERVICE),
                self._object_handler(Kind.SERVICE),
            ),
            _Feed(
                Kind.ENDPOINT_SLICE.value,
                discovery.list_endpoint_slice_for_all_namespaces,
                selector,
                lambda: tracker.listing(Kind.ENDPOINT_SLICE),
                self._object_handler(Kind.ENDPOINT_SLICE),
            ),
            _Feed(
                "Node",
                core.list_node,
                {"field_selector": f"metadata.name={node_name}"},
                lambda: _NodeListing(self._node_listed),
                self._node_event,
            ),
        ]

    async def run(self) -> None:
        """Follow every resource until cancelled; API errors are logged and retried."""
        async with asyncio.TaskGroup() as tg:
            for feed in self.feeds:
                tg.create_task(self._supervise(feed), name=f"kube-source-{feed.name}")
            tg.create_task(self._resync(), name="kube-source-resync")

    async def _resync(self) -> None:
        """Every ``config_sync_period_s``: every service announced again, from memory."""
        while True:
            await asyncio.sleep(self.config_sync_period_s)
            self.tracker.resync()

    # --- the loop ---

    async def _supervise(self, feed: _Feed) -> None:
        backoff = _Backoff(self.backoff_max_s)
        while True:
            try:
                await self._follow(feed)
            except Exception:
                log.exception("Watch loop failed; restarting it", extra=kv(resource=feed.name))
                await asyncio.sleep(backoff.next_delay())

    async def _follow(self, feed: _Feed) -> None:
        loop = asyncio.get_running_loop()
        backoff = _Backoff(self.backoff_max_s)
        # A watch of a fresh listing that the server expires at once, again and again (its
        # compaction outruns the listing), would relist in a tight loop: from the second in
        # a row, the relist waits (a backoff of its own). A 410 after a watch that had been
        # open a while is the normal course, and relists at once: counted as in a row, it
        # waited out the backoff an outage had grown (30 s, unlogged, measured).
        gone_in_a_row = 0
        gone_backoff = _Backoff(self.backoff_max_s)
        while True:
            asked_at = time.monotonic()
            fresh = feed.rv is None  # this watch starts from a listing made just now
            if feed.rv is None:
                try:
                    feed.rv = await self._list(feed)
                except _RETRYABLE as exc:
                    feed.rv = None
                    self._refused(exc, asked_at)
                    delay = _delay(backoff, exc)
                    log.warning(
                        "Listing failed; retrying",
                        extra=kv(resource=feed.name, error=_describe(exc), retry_s=round(delay, 2)),
                    )
                    await asyncio.sleep(delay)
                    continue
                backoff.reset()
            opened, asked_at = loop.time(), time.monotonic()
            try:
                progressed = await self._watch(feed)
            except _Gone as gone:
                feed.rv = None
                at_once = fresh and loop.time() - opened < WATCH_STEADY_S
                gone_in_a_row = gone_in_a_row + 1 if at_once else 0
                if not gone_in_a_row:
                    gone_backoff.reset()
                delay = gone_backoff.next_delay() if gone_in_a_row > 1 else 0.0
                log.info(
                    "Watch cannot resume; relisting",
                    extra=kv(resource=feed.name, why=gone.why, after_s=round(delay, 2)),
                )
                await asyncio.sleep(delay)
                continue
            except _Silent:
                log.warning(
                    "Watch stream silent; restarting it",
                    extra=kv(resource=feed.name, timeout_s=self.inactivity_timeout_s),
                )
                continue
            except _RETRYABLE as exc:
                self._refused(exc, asked_at)
                delay = _delay(backoff, exc)
                log.warning(
                    "Watch failed; retrying",
                    extra=kv(resource=feed.name, error=_describe(exc), retry_s=round(delay, 2)),
                )
                await asyncio.sleep(delay)
                continue
            if progressed:
                gone_in_a_row = 0
                gone_backoff.reset()
            elif (lasted := loop.time() - opened) < WATCH_SHORT_S:
                delay = backoff.next_delay()
                log.warning(
                    "Watch ended at once with nothing delivered; retrying",
                    extra=kv(
                        resource=feed.name, lasted_s=round(lasted, 3), retry_s=round(delay, 2)
                    ),
                )
                await asyncio.sleep(delay)
                continue
            # A watch that delivered, or stayed open a while (a quiet resource), worked: the
            # next failure starts the backoff over (client-go resets it likewise).
            if progressed or loop.time() - opened >= WATCH_STEADY_S:
                backoff.reset()

    def _refused(self, exc: BaseException, asked_at: float) -> None:
        if isinstance(exc, _ApiError) and exc.status == 401:
            credential_rejected(self.api_client, asked_at)

    async def _list(self, feed: _Feed) -> str:
        """A complete, consistent listing, handed to the tracker page by page (see
        ``Tracker.listing``); returns its version.

        The next page is requested as soon as a page's continuation token is known, and
        arrives while that page is applied (client-go's pager buffers pages ahead the same
        way): at 10,000 services a start otherwise left the API server and uproxy waiting
        on each other, one page at a time. Two pages at most are held at once.
        """
        listing = feed.listing()
        count = 0
        token: str | None = None
        ahead: asyncio.Task[Mapping[str, Any]] | None = None
        try:
            while True:
                fetch = ahead or self._fetch_page(feed, token)
                ahead = None
                try:
                    body = await fetch
                except _ApiError as exc:
                    if exc.status == 410 and token:
                        # The snapshot behind the continuation expired: start over. What was
                        # applied stays (true at its version); nothing is deleted until a
                        # listing completes.
                        log.info(
                            "List continuation expired; relisting", extra=kv(resource=feed.name)
                        )
                        listing.abandon()
                        listing, count, token = feed.listing(), 0, None
                        continue
                    raise
                page = body.get("items")
                meta = body.get("metadata")
                if not isinstance(page, list) or not isinstance(meta, Mapping):
                    raise ValueError(f"malformed {feed.name} list: no items or metadata")
                objs = [o for o in page if isinstance(o, Mapping)]
                del body, page  # one page of the API's objects alive at a time, and the next
                token = meta.get("continue") or None
                if token is not None:
                    ahead = self._fetch_page(feed, token)
                await listing.add(objs)
                count += len(objs)
                if token is None:
                    rv = meta.get("resourceVersion")
                    if not isinstance(rv, str) or not rv:
                        raise ValueError(f"malformed {feed.name} list: no resourceVersion")
                    break
            await listing.finish()
        finally:
            listing.abandon()
            if ahead is not None:  # the listing failed or was cancelled with a page asked for
                ahead.cancel()
        level = V2 if feed.listed_once else logging.INFO
        log.log(level, "Listed objects", extra=kv(resource=feed.name, count=count, rv=rv))
        feed.listed_once = True
        return rv

    def _fetch_page(self, feed: _Feed, token: str | None) -> asyncio.Task[Mapping[str, Any]]:
        kwargs: dict[str, Any] = dict(feed.selector, limit=LIST_PAGE_SIZE)
        if token:
            kwargs["_continue"] = token
        task = asyncio.ensure_future(self._get_json(feed, kwargs))
        # A page asked for ahead and then not awaited (the listing failed first) must not
        # log "exception was never retrieved".
        task.add_done_callback(_retrieve)
        return task

    async def _get_json(self, feed: _Feed, kwargs: dict[str, Any]) -> Mapping[str, Any]:
        timeout = aiohttp.ClientTimeout(total=LIST_TIMEOUT_S, sock_connect=CONNECT_TIMEOUT_S)
        try:
            resp = await feed.list_fn(**kwargs, _preload_content=False, _request_timeout=timeout)
        except (aiohttp.ClientError, OSError, TimeoutError):
            self._answered(code="<error>").inc()
            raise
        self._answered(code=str(resp.status)).inc()
        try:
            raw = await resp.read()
        finally:
            resp.release()
        if not 200 <= resp.status <= 299:
            raise _ApiError(resp.status, _status_message(raw), _retry_after(resp.headers))
        body = json.loads(raw)
        if not isinstance(body, Mapping):
            raise ValueError(f"malformed {feed.name} list: not an object")
        return body

    async def _watch(self, feed: _Feed) -> bool:
        """One watch request; returns whether it delivered anything. Raises _Gone on 410."""
        server_timeout = random.uniform(*WATCH_TIMEOUT_RANGE_S)
        timeout = aiohttp.ClientTimeout(
            total=None, connect=CONNECT_TIMEOUT_S, sock_connect=CONNECT_TIMEOUT_S
        )
        # Until the response's headers: a server (or a pooled connection to a dead peer, a
        # stuck load balancer) that never answers would hold this feed, its relists too.
        try:
            async with asyncio.timeout(WATCH_HEADERS_TIMEOUT_S):
                resp = await feed.list_fn(
                    **feed.selector,
                    watch=True,
                    resource_version=feed.rv,
                    allow_watch_bookmarks=True,
                    timeout_seconds=max(1, int(server_timeout)),
                    _preload_content=False,
                    _request_timeout=timeout,
                )
        except (aiohttp.ClientError, OSError, TimeoutError):
            self._answered(code="<error>").inc()
            raise
        self._answered(code=str(resp.status)).inc()
        progressed = False
        lines, burst = _Lines(), _Burst()
        try:
            if not 200 <= resp.status <= 299:
                raw = await resp.read()
                why = _relist_reason(resp.status, _status_body(raw))
                if why is not None:
                    raise _Gone(why)
                raise _ApiError(resp.status, _status_message(raw), _retry_after(resp.headers))
            handled = 0
            data = b""
            while True:
                if not data:
                    burst.end()  # caught up with the stream: whatever burst it was is over
                    try:
                        async with asyncio.timeout(self.inactivity_timeout_s):
                            data = await resp.content.readany()
                    except TimeoutError:
                        raise _Silent() from None
                    if not data:
                        return progressed  # the server's timeout: a clean end
                events = lines.feed(data)
                burst.read(len(events))
                for line in events:
                    if not line.strip():
                        continue
                    self._dispatch(feed, line)
                    progressed = True
                    handled += 1
                    if handled % YIELD_EVERY == 0:
                        await asyncio.sleep(0)
                data = resp.content.read_nowait()  # what arrived meanwhile, if anything
        finally:
            burst.end()
            resp.close()

    def _dispatch(self, feed: _Feed, line: bytes) -> None:
        event = json.loads(line)
        if not isinstance(event, Mapping):
            raise ValueError("watch event is not an object")
        kind = event.get("type")
        obj = event.get("object")
        if not isinstance(obj, Mapping):
            raise ValueError(f"watch event {kind!r} has no object")
        if kind == "ERROR":
            status = obj.get("code")
            code = status if isinstance(status, int) else 0
            why = _relist_reason(code, obj)
            if why is not None:
                raise _Gone(why)
            raise _ApiError(code, str(obj.get("message")))
        meta = obj.get("metadata")
        rv = meta.get("resourceVersion") if isinstance(meta, Mapping) else None
        if kind in ("ADDED", "MODIFIED", "DELETED"):
            feed.on_event(kind, obj)
        elif kind != "BOOKMARK":
            log.warning("Skipping unknown watch event", extra=kv(resource=feed.name, type=kind))
        # The version advances only after the event was handled, so a crash replays it.
        if isinstance(rv, str) and rv:
            feed.rv = rv

    # --- where objects go ---

    def _object_handler(self, kind: Kind) -> Callable[[str, Obj], None]:
        def handle(event: str, obj: Obj) -> None:
            try:
                if event == "DELETED":
                    self.tracker.delete(kind, obj)
                else:
                    self.tracker.upsert(kind, obj)
            except Exception as exc:  # one bad object must not stop the watch
                log.warning(
                    "Skipping object the tracker could not use",
                    extra=kv(kind=kind.value, object=object_key(obj), reason=_describe(exc)),
                )

        return handle

    def _node_listed(self, objs: list[Obj]) -> None:
        mine = [o for o in objs if _name(o) == self.node_name]
        if not mine:
            known = self.tracker.node
            if known is not None and not known.deleting:
                log.warning("This node was deleted", extra=kv(node=self.node_name))
                self.tracker.set_node(dataclasses.replace(known, deleting=True))
            elif known is None and not self._node_missing_reported:
                log.warning("This node is not in the API", extra=kv(node=self.node_name))
                self._node_missing_reported = True
            return
        self._set_node(mine[0])

    def _node_event(self, event: str, obj: Obj) -> None:
        if _name(obj) != self.node_name:
            return
        if event == "DELETED":
            log.warning("This node was deleted", extra=kv(node=self.node_name))
            self._set_node(obj, deleted=True)
        else:
            self._set_node(obj)

    def _set_node(self, obj: Obj, *, deleted: bool = False) -> None:
        """The node as the API has it. A deleted node keeps its last state, as being deleted:
        load balancers must not send it traffic (kube-proxy's /healthz judges the deleted
        object too), not go back to it because it is no longer there to say so."""
        try:
            info = node_info(obj)
        except InvalidObject as exc:
            log.warning(
                "Skipping invalid object",
                extra=kv(kind="Node", object=exc.key, field=exc.field, reason=exc.reason),
            )
            if deleted and self.tracker.node is not None:
                self.tracker.set_node(dataclasses.replace(self.tracker.node, deleting=True))
            return
        self.tracker.set_node(dataclasses.replace(info, deleting=True) if deleted else info)


class _Lines:
    """A watch stream's bytes, cut into its events: one JSON document per line."""

    __slots__ = ("_parts", "_size")

    def __init__(self) -> None:
        self._parts: list[bytes] = []  # the start of an event not ended yet
        self._size = 0

    def feed(self, data: bytes) -> list[bytes]:
        """The events that ``data`` ends (none while one event is still arriving)."""
        end = data.rfind(b"\n")
        if end < 0:
            self._parts.append(data)
            self._size += len(data)
            if self._size > MAX_EVENT_BYTES:
                raise ValueError(f"watch event over {MAX_EVENT_BYTES} bytes")
            return []
        head = data[:end]
        if self._parts:
            head = b"".join([*self._parts, head])
        rest = data[end + 1 :]
        self._parts, self._size = ([rest], len(rest)) if rest else ([], 0)
        return head.split(b"\n")


class _Burst:
    """The collector off while a watch delivers events faster than they are applied.

    A read that brings BURST_EVENTS or more events at once (the stream's buffer filled while
    the last ones were applied: a rollout, a namespace deleted, a node drained) pauses the
    collector until a read brings fewer or nothing is left to read; a burst of
    ``heap.BULK_MIN`` events or more is then frozen, as a listing is. Left on, the
    collector's full passes over the objects such a burst makes grew with it: 10,000 slices
    changed at once at 10,000 services cost passes of 69, 97 and 73 ms, about a quarter of
    the control process's CPU for the burst.
    """

    __slots__ = ("_events", "_paused")

    def __init__(self) -> None:
        self._paused = False
        self._events = 0

    def read(self, events: int) -> None:
        if events >= BURST_EVENTS:
            if not self._paused:
                heap.pause()
                self._paused = True
            self._events += events
        elif self._paused:
            self.end()

    def end(self) -> None:
        if self._paused:
            self._paused = False
            heap.resume(freeze=self._events >= heap.BULK_MIN)
            self._events = 0


def _retrieve(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()


def _name(obj: Obj) -> str | None:
    meta = obj.get("metadata")
    name = meta.get("name") if isinstance(meta, Mapping) else None
    return name if isinstance(name, str) else None


def _status_body(raw: bytes) -> Mapping[str, Any]:
    try:
        body = json.loads(raw)
    except ValueError:
        return {}
    return body if isinstance(body, Mapping) else {}


def _status_message(raw: bytes) -> str:
    try:
        body = json.loads(raw)
    except ValueError:
        # Not the API server's Status (a proxy's HTML page, say): on one line, for the log.
        return " ".join(raw[:1000].decode("utf-8", errors="replace").split())[:200]
    if isinstance(body, Mapping):
        return str(body.get("message") or body.get("reason") or "")
    return ""


def _describe(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
