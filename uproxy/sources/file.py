"""The file source: Services and EndpointSlices from a YAML (or JSON) file, reloaded when it
changes.

The file holds standard manifests (what ``kubectl apply -f`` accepts): Service (v1) and
EndpointSlice (discovery.k8s.io/v1) documents, or ``List`` documents of them. A reload is
all or nothing: every document is validated before the tracker sees any of it, so a bad
edit leaves the last good state serving and logs one line naming the document and field.
The file is polled (stat every ``interval``) rather than watched with inotify: it works on
every filesystem, across editors' rename-on-save, and costs one stat call.

JSON, as ``kubectl get services,endpointslices -A -o json`` writes it (one ``List``), is
YAML too, but libyaml takes 5.6 s for such a file of 10,000 services (10.8 MB, indented) where
the json module takes 0.22 s: a text that starts with ``{`` is read as JSON first, and as
YAML when it is not JSON (a flow-style YAML document, a broken file: YAML's messages then
name the line).

A benchmark's file is large (10,000 services: 20,000 documents, 5.4 MB), and the loop that
reads it also serves health checks and feeds the workers (and relayed every byte when this
was measured, before the workers). Measured on 2 cores (CPU time, medians), parsing it takes
14 s with PyYAML's pure-Python loader and 1.9 s with libyaml's; hence three decisions:

- **libyaml when PyYAML has it**, under a constructor that builds the plain documents
  manifests are made of directly (1.2 s); never a loader that builds arbitrary objects.
  Syntax errors still read as the pure-Python loader's (see ``_yaml_message``).
- **Off the loop**: reading, parsing and validating run on a worker thread; only the
  tracker's share runs on the loop, in slices of 10 ms. Validating converts each object as
  the tracker would, and the tracker takes those conversions (``Converted``): its share of
  a first load of 10,000 services went 0.30 -> 0.06 CPU-s, the start 2.9 -> 2.55 s. The
  thread does not make the parse free for the loop: it holds the GIL but for the
  interpreter's switch interval (5 ms by default; process-wide, left alone here), so the
  loop waits up to that long, plus the longest single C call, each time it wakes during a
  parse. And the objects a first load builds trigger 2-3 collections of the oldest
  generation, each holding the GIL for its whole pass (50-380 ms here).
- **Only what changed**: the text is split into documents at their ``---`` lines, each
  document's digest is remembered with the keys of its objects, and a reload parses only
  the documents whose text is new, then hands the tracker the difference (upserts of the
  new documents' objects, deletes of the keys that are gone). One edited document in 10,000
  services costs ~40 ms of the worker thread (reading, hashing and splitting 5.4 MB) and
  one upsert on the loop. Anything the split cannot be sure about, and every error, goes to
  the whole-file parse, whose messages name the exact line, column and document number.
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import itertools
import json
import logging
import operator
import os
import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import yaml
from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode
from yaml.resolver import BaseResolver, Resolver

from uproxy import heap, priority
from uproxy.log import kv
from uproxy.model import ServicePort, ServicePortName
from uproxy.objects import (
    EndpointSliceInfo,
    InvalidObject,
    endpoint_slice,
    object_key,
    service_ports,
)
from uproxy.timeslice import TimeSlice
from uproxy.tracker import Converted, Kind, Tracker

log = logging.getLogger("uproxy.sources.file")

_API_VERSIONS = {Kind.SERVICE: ("v1",), Kind.ENDPOINT_SLICE: ("discovery.k8s.io/v1",)}

Obj = Mapping[str, Any]
Key = tuple[Kind, str]  # (kind, "namespace/name")


class ServicesFileError(ValueError):
    """The file cannot be used; the message names the document and the field."""


@dataclass(frozen=True, slots=True)
class Manifests:
    services: list[Obj]
    slices: list[Obj]


# ----- the YAML loader -----

_TAG = "tag:yaml.org,2002:"
_SCALAR_TAGS = frozenset(
    _TAG + t for t in ("str", "int", "float", "bool", "null", "timestamp", "binary")
)


class _NotPlain(Exception):
    """A node outside the plain subset: the document is built the standard way."""


class _PlainFirst(SafeConstructor, Resolver):
    """SafeConstructor's result, built faster for documents of plain maps, lists and scalars.

    SafeConstructor builds each node through a generator and per-node bookkeeping that only
    anchors and recursive structures need. Documents whose nodes are all untagged maps,
    lists and the safe scalar types are built directly here; on anything else (an alias, a
    merge key, another tag) the document is built again by SafeConstructor, so results and
    errors are its own. A plain scalar's type depends only on its text: it is resolved once
    per distinct text. CPU time for the 20,000 documents (median of 5): libyaml's
    CSafeLoader 1.88 s; building directly 1.31 s; with the types remembered 1.20 s.
    """

    _types: dict[str, str]

    def resolve(self, kind: type[Node], value: Any, implicit: Any) -> str:
        # Called for every node (690,000 in the 10,000-service file); with no path resolvers
        # registered (PyYAML's own default) the answer is Resolver's, without its calls.
        # ``implicit`` is (plain, quoted) for a scalar, one bool for a collection.
        if self.yaml_path_resolvers:
            resolved: str = super().resolve(kind, value, implicit)  # type: ignore[no-untyped-call]
            return resolved
        if kind is ScalarNode:
            if not implicit[0]:
                return BaseResolver.DEFAULT_SCALAR_TAG
            tag = self._types.get(value)
            if tag is None:
                tag = self._types[value] = super().resolve(kind, value, implicit)  # type: ignore[no-untyped-call]
            return tag
        if kind is MappingNode:
            return BaseResolver.DEFAULT_MAPPING_TAG
        return BaseResolver.DEFAULT_SEQUENCE_TAG

    def construct_document(self, node: Node) -> Any:
        priority.give_way()  # the parse runs on a thread of the lowered control process
        try:
            return self._plain(node, set())
        except _NotPlain:
            return super().construct_document(node)

    def _plain(self, node: Node, seen: set[int]) -> Any:
        tag = node.tag
        if type(node) is ScalarNode:
            if tag == BaseResolver.DEFAULT_SCALAR_TAG:
                return node.value
            if tag in _SCALAR_TAGS:
                return self.yaml_constructors[tag](self, node)
            raise _NotPlain
        if id(node) in seen:  # an alias: the standard way shares the object
            raise _NotPlain
        seen.add(id(node))
        if type(node) is MappingNode and tag == _TAG + "map":
            out = {}
            for k, v in node.value:
                if type(k) is not ScalarNode:
                    raise _NotPlain
                out[self._plain(k, seen)] = self._plain(v, seen)
            return out
        if type(node) is SequenceNode and tag == _TAG + "seq":
            return [self._plain(child, seen) for child in node.value]
        raise _NotPlain


class _PythonLoader(_PlainFirst, yaml.SafeLoader):
    def __init__(self, stream: str) -> None:
        yaml.SafeLoader.__init__(self, stream)
        self._types = {}


_Loader = type[_PythonLoader] | type[yaml.CSafeLoader]
_LOADER: _Loader = _PythonLoader
if yaml.__with_libyaml__:  # PyYAML's wheels carry libyaml; a source build may not

    class _LibyamlLoader(_PlainFirst, yaml.CSafeLoader):
        def __init__(self, stream: str) -> None:
            yaml.CSafeLoader.__init__(self, stream)
            self._types = {}

        if not Resolver.yaml_path_resolvers:
            # libyaml calls these around every node; they only serve path resolvers, and
            # none are registered. C functions that take the same arguments and do nothing
            # skip two Python calls per node: with ``resolve`` above, 1.11 -> 0.97 CPU-s
            # for the 10,000-service file.
            descend_resolver = operator.is_  # type: ignore[assignment]  # (parent, index)
            ascend_resolver = tuple  # type: ignore[assignment]  # () -> ()

    _LOADER = _LibyamlLoader


# A text that may be JSON: an object first (after a byte-order mark and white space).
_JSON_START = re.compile("\ufeff?[ \t\r\n]*{")


def _load_all(text: str, loader: _Loader | None = None) -> list[Any]:
    if loader is None and _JSON_START.match(text):
        try:
            # json takes the white space; only a byte-order mark is cut (a copy, then only).
            return [json.loads(text[1:] if text[0] == "\ufeff" else text)]
        except (ValueError, RecursionError):
            pass  # YAML in flow style, or a broken file: YAML's loader, and its messages
    return list(yaml.load_all(text, Loader=loader or _LOADER))


# ----- the whole file -----


def parse_manifests(text: str, path: str = "<services>") -> Manifests:
    """Parse and validate the whole text; raises ServicesFileError."""
    return _validate(_load_whole(text, path), path)


def _load_whole(text: str, path: str) -> list[Any]:
    try:
        return _load_all(text)
    except yaml.YAMLError as e:
        raise ServicesFileError(_yaml_message(text, e, path)) from None
    except RecursionError:
        raise ServicesFileError(f"{path}: not valid YAML: nested too deeply") from None


def _validate(docs: list[Any], path: str) -> Manifests:
    out = Manifests([], [])
    for kind, checked in _checked(docs, path):
        (out.services if kind is Kind.SERVICE else out.slices).append(checked.obj)
    return out


def _checked(docs: list[Any], path: str) -> list[tuple[Kind, Converted]]:
    """Every object of the documents, checked and converted; raises ServicesFileError."""
    out: list[tuple[Kind, Converted]] = []
    seen: set[Key] = set()
    for index, doc in enumerate(docs, start=1):
        for where, kind, checked in _objects(doc, f"{path}: document {index}"):
            key = (kind, object_key(checked.obj))
            if key in seen:
                raise ServicesFileError(f"{where}: {kind.value} {key[1]} appears twice")
            seen.add(key)
            out.append((kind, checked))
    return out


def _objects(doc: Any, where: str) -> Iterator[tuple[str, Kind, Converted]]:
    """A document's objects (a List's items), each checked and converted (what the tracker
    takes as it is); ``where`` names the document."""
    if doc is None:
        return
    items = doc.get("items") if isinstance(doc, Mapping) and doc.get("kind") == "List" else None
    for sub, obj in enumerate(items if isinstance(items, list) else [doc]):
        at = where + (f" item {sub + 1}" if items is not None else "")
        kind, value = _check_document(obj, at)
        yield at, kind, Converted(obj, value)


def _check_document(
    obj: Any, where: str
) -> tuple[Kind, dict[ServicePortName, ServicePort] | EndpointSliceInfo | None]:
    if not isinstance(obj, Mapping):
        raise ServicesFileError(f"{where}: expected a Kubernetes object (a mapping)")
    kind_name = obj.get("kind")
    try:
        kind = Kind(str(kind_name))
    except ValueError:
        raise ServicesFileError(
            f"{where}: kind: expected Service or EndpointSlice, got {kind_name!r}"
        ) from None
    api = obj.get("apiVersion")
    if api not in _API_VERSIONS[kind]:
        raise ServicesFileError(
            f"{where}: apiVersion: {kind.value} needs {_API_VERSIONS[kind][0]}, got {api!r}"
        )
    try:
        if kind is Kind.SERVICE:
            return kind, service_ports(obj)
        return kind, endpoint_slice(obj)
    except InvalidObject as e:
        raise ServicesFileError(f"{where}: {e}") from None


def _yaml_message(text: str, err: yaml.YAMLError, path: str) -> str:
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    line, column = (mark.line, mark.column) if mark is not None else (None, 0)
    if line is not None and _LOADER is not _PythonLoader:
        # libyaml words some problems less helpfully ("found character that cannot start any
        # token": which one? a tab): the pure-Python loader's words for the same document.
        line, column, problem = _python_words(text, line) or (line, column, problem)
    where = f" line {line + 1} column {column + 1}" if line is not None else ""
    return f"{path}:{where}: not valid YAML: {problem}"


def _python_words(text: str, line: int) -> tuple[int, int, str] | None:
    """The pure-Python loader's error in the document holding ``line`` (and the one before,
    whose unclosed bracket shows only at the next ``---``), as whole-file line and column."""
    pieces = split_documents(text)
    if pieces is None:
        return None
    starts = [0]
    for piece in pieces[:-1]:
        starts.append(starts[-1] + piece.count("\n"))
    at = max(bisect.bisect_right(starts, line) - 1, 0)
    first = max(at - 1, 0)
    try:
        _load_all("".join(pieces[first : at + 1]), _PythonLoader)
    except yaml.MarkedYAMLError as e:
        if e.problem_mark is not None and e.problem:
            return e.problem_mark.line + starts[first], e.problem_mark.column, e.problem
    except (yaml.YAMLError, RecursionError):
        pass
    return None


# ----- document by document -----

# A line that begins with "---" and then a blank or its end starts a document, wherever it
# is: PyYAML and libyaml read it as a document start, or fail (inside a quoted scalar or a
# flow collection). It cannot continue a block scalar (their content is indented at least one
# column) and it ends a plain one. Anchors, aliases and tag handles do not cross documents.
# So each piece of text from one such line to the next parses alone exactly as in the file.
# (Searched from the newline before it: with "^" and MULTILINE the search takes 30-100 ms on
# 5.4 MB instead of 16.)
_MARKER = r"---(?=[ \t\r\n]|\Z)"
_DOCUMENT_START = re.compile("\n" + _MARKER)
_STARTS_WITH_DOCUMENT = re.compile(_MARKER)


def _doubtful(text: str) -> bool:
    """Directives (%YAML, %TAG) sit before the "---" of the document they apply to; YAML also
    breaks lines at a lone CR, NEL, LS and PS, where the search above does not look. Such a
    file is parsed whole. (Plain ``in`` and ``count``: 7 ms on 5.4 MB, a regular expression
    with the same alternatives 170 ms.)"""
    return (
        text.startswith("%")
        or "\n%" in text
        or ("\r" in text and text.count("\r") != text.count("\r\n"))
        or any(c in text for c in "\x85\u2028\u2029")
    )


def split_documents(text: str) -> list[str] | None:
    """The text cut at each document start (a first piece before any ``---`` may hold no
    document), or None when the file must be parsed whole. Joined, the pieces are ``text``."""
    if _doubtful(text):
        return None
    cuts = [0, *(m.start() + 1 for m in _DOCUMENT_START.finditer(text)), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(cuts)]


def _parse_pieces(pieces: list[str]) -> list[list[Any]] | None:
    """Each piece's documents (none or one), or None if a piece did not hold exactly that.

    The pieces after the first are parsed as one stream (a loader per document costs ~30 µs:
    0.6 s more for 20,000): only the file's last piece may lack a final newline, and it is
    last here too.
    """
    out: list[list[Any]] = []
    rest = pieces
    if pieces and not _STARTS_WITH_DOCUMENT.match(pieces[0]):
        head = _load_all(pieces[0])
        if len(head) > 1:
            return None
        out.append(head)
        rest = pieces[1:]
    if any(not p.endswith("\n") for p in rest[:-1]):
        return None
    docs = _load_all("".join(rest))
    if len(docs) != len(rest):
        return None
    out.extend([doc] for doc in docs)
    return out


@dataclass(frozen=True, slots=True)
class _Kept:
    """What one load leaves for the next: each document's digest with its objects' keys.

    Not the objects themselves: 20,000 parsed documents hold 52 MB, and an object that leaves
    the file is deleted from the tracker by its key. Not the documents' text either: a
    16-byte digest stands for it (the 20,000 texts of a 10,000-service file held 6.1 MiB).
    """

    digest: bytes
    pieces: Mapping[bytes, tuple[Key, ...]]  # by piece digest; empty after a whole-file parse
    keys: frozenset[Key]


@dataclass(frozen=True, slots=True)
class _Read:
    pieces: dict[bytes, tuple[Key, ...]]
    objects: list[tuple[Kind, Converted]]  # what was parsed: the new documents' objects
    keys: frozenset[Key]  # every object in the file
    parsed: int  # YAML documents parsed


@dataclass(frozen=True, slots=True)
class _Change:
    kept: _Kept
    upserts: list[tuple[Kind, Converted]]  # on a first load, every object
    deletes: list[Key]
    parsed: int


def _load(path: str, kept: _Kept | None) -> _Change | None:
    """Read the file and work out the change; None when its content is the same.

    Runs on a worker thread: it reads ``kept`` and returns new state, it changes nothing.
    """
    with open(path, "rb") as f:
        raw = f.read()
    digest = hashlib.sha256(raw).digest()
    if kept is not None and digest == kept.digest:
        return None
    text = raw.decode("utf-8", errors="replace")
    read = _by_document(text, kept.pieces if kept is not None else {})
    if read is None:
        read = _whole(text, path)
    gone = sorted(kept.keys - read.keys) if kept is not None else []
    return _Change(_Kept(digest, read.pieces, read.keys), read.objects, gone, read.parsed)


def _whole(text: str, path: str) -> _Read:
    docs = _load_whole(text, path)
    objects = _checked(docs, path)
    objects.sort(key=lambda pair: pair[0] is not Kind.SERVICE)  # services first, as listed
    keys = frozenset((k, object_key(c.obj)) for k, c in objects)
    return _Read({}, objects, keys, len(docs))


def _piece_digest(piece: str) -> bytes:
    return hashlib.blake2b(piece.encode(), digest_size=16).digest()


def _by_document(text: str, known: Mapping[bytes, tuple[Key, ...]]) -> _Read | None:
    """Parse only the documents whose text is not in ``known`` (by digest).

    None on any doubt or error: the whole-file parse then decides, and names the error.
    """
    pieces = split_documents(text)
    if pieces is None:
        return None
    digests = [_piece_digest(p) for p in pieces]
    entries = {d: known.get(d) for d in digests}  # None: a new text
    fresh = {d: p for d, p in zip(digests, pieces, strict=True) if entries[d] is None}
    try:
        parsed = _parse_pieces(list(fresh.values()))
        if parsed is None:
            return None
        found = [[(k, o) for doc in docs for _, k, o in _objects(doc, "")] for docs in parsed]
    except (yaml.YAMLError, ServicesFileError, RecursionError):
        return None
    for d, objs in zip(fresh, found, strict=True):
        entries[d] = tuple((k, object_key(c.obj)) for k, c in objs)
    every = [key for d in digests for key in entries[d] or ()]
    keys = frozenset(every)
    if len(keys) != len(every):
        return None  # a duplicate: the whole-file parse names its document
    objects = [obj for objs in found for obj in objs]
    kept = {p: entry for p, entry in entries.items() if entry is not None}
    return _Read(kept, objects, keys, sum(len(docs) for docs in parsed))


def _tombstone(key: Key) -> Obj:
    """An object that left the file, as ``Tracker.delete`` needs it: kind and name."""
    kind, ns_name = key
    namespace, _, name = ns_name.partition("/")
    return {
        "apiVersion": _API_VERSIONS[kind][0],
        "kind": kind.value,
        "metadata": {"namespace": namespace, "name": name},
    }


# An emptied services file is applied (every service removed) once it stays empty this long.
EMPTY_SETTLE_S = 2.0


class FileSource:
    name = "file"

    def __init__(self, *, path: str, tracker: Tracker, interval_s: float = 0.5) -> None:
        self.path = path
        self.tracker = tracker
        self.interval_s = interval_s
        self._stamp: tuple[int, int, int] | None = None
        self._kept: _Kept | None = None
        self._last_error: str | None = None
        self._settling: tuple[int, int, int] | None = None  # a change seen, not yet read
        self._empty_since: float | None = None  # when an emptied file was first seen so
        self._empty_stamp: tuple[int, int, int] | None = None
        self.reloads = 0
        self.documents_parsed = 0  # YAML documents parsed since start, for tests and logs

    async def load_initial(self) -> None:
        """First load: a bad file is fatal here (there is no good state to keep)."""
        stamp = self._stat()
        change = await asyncio.to_thread(_load, self.path, None)
        self._stamp = stamp
        if change is not None:
            await self._apply(change)

    async def run(self) -> None:
        """Poll for changes until cancelled."""
        if self._kept is None:
            await self.load_initial()
        while True:
            await asyncio.sleep(self.interval_s)
            await self.poll()

    async def poll(self) -> None:
        stamp = self._stat()
        if stamp is None:
            if self._stamp is not None:  # gone (deleted, renamed away): said once
                self._stamp = None
                self._failed(f"{self.path}: no such file (deleted or renamed)")
            return
        if stamp == self._stamp:
            return
        if self._being_written(stamp):
            return  # written to less than a poll ago: read it once the writes have stopped
        if stamp[1] == 0 and self._kept is not None and self._kept.keys:
            # Emptied: an editor that truncates the file before it writes it, more often
            # than a wish to remove every service. Applied once it has stayed empty a while.
            loop = asyncio.get_running_loop()
            if self._empty_since is None or self._empty_stamp != stamp:
                self._empty_since, self._empty_stamp = loop.time(), stamp
                return
            if loop.time() - self._empty_since < EMPTY_SETTLE_S:
                return
            log.warning(
                "Services file empty for a while: removing every service",
                extra=kv(
                    path=self.path,
                    services=sum(1 for kind, _ in self._kept.keys if kind is Kind.SERVICE),
                ),
            )
        self._empty_since = None
        self._stamp = stamp
        # A reload of a big file makes hundreds of thousands of objects on the parse thread
        # (YAML nodes, documents, their conversions), and the collector's full passes over
        # them hold the GIL, and so the loop: four passes of 26-125 ms while the parse of
        # 10,000 services ran. Off for the reload (a swap of those 10,000 services: 2.9-3.3
        # CPU-s of the control process before, 2.3-2.4 after); what a big change made is
        # frozen once the tracker has it, as a listing's is (``heap``); a small change's is
        # left to the collector.
        heap.pause()
        big = False
        try:
            change = await self._read()
            if change is not None:
                big = len(change.upserts) + len(change.deletes) >= heap.BULK_MIN
                await self._apply(change)
        finally:
            heap.resume(freeze=big)

    async def _read(self) -> _Change | None:
        """The change the file's new content makes; None when there is none or it is bad
        (logged once per distinct error: the last good state keeps serving)."""
        try:
            change = await asyncio.to_thread(_load, self.path, self._kept)
        except ServicesFileError as e:
            self._failed(str(e))
            return None
        except OSError as e:
            # Not the content: this read failed (out of fds, a permission flipped), and the
            # same file is read again at the next poll. Remembered as read, the edit was
            # lost until the next one.
            self._failed(f"{self.path}: {e.strerror or e}")
            self._stamp = None
            return None
        if self._last_error is not None and change is None:
            # Edited back (or restored) to what is served: nothing to load, but say so.
            log.info("Services file is good again: as served", extra=kv(path=self.path))
        self._last_error = None
        return change

    def _failed(self, msg: str) -> None:
        """One line per distinct error; the last good state keeps serving."""
        if msg != self._last_error:
            log.error(
                "Ignoring services file change, keeping the last good state", extra=kv(error=msg)
            )
            self._last_error = msg

    async def _apply(self, change: _Change) -> None:
        self.documents_parsed += change.parsed
        changed = len(change.upserts)
        if self._kept is None:
            for kind in (Kind.SERVICE, Kind.ENDPOINT_SLICE):
                objs = [obj for k, obj in change.upserts if k is kind]
                await self.tracker.replace_async(kind, objs)
        else:
            # One change for the syncer, announced once all of it is in (``batch``): the
            # sync that takes it closes the old proxy ports before it opens the new ones,
            # so replacing every service does not need twice the listeners.
            ts = TimeSlice()
            changed = 0  # a changed document's objects that changed (a List's items, one by one)
            with self.tracker.batch():
                for key in change.deletes:
                    self.tracker.delete(key[0], _tombstone(key))
                    await ts.tick()
                for kind, obj in change.upserts:
                    changed += self.tracker.upsert(kind, obj)
                    await ts.tick()
        self._kept = change.kept  # once the tracker has all of it
        self.reloads += 1
        services = sum(1 for kind, _ in change.kept.keys if kind is Kind.SERVICE)
        log.info(
            "Loaded services file",
            extra=kv(
                path=self.path,
                services=services,
                slices=len(change.kept.keys) - services,
                parsed=change.parsed,
                changed=changed,
                removed=len(change.deletes),
            ),
        )

    def _being_written(self, stamp: tuple[int, int, int]) -> bool:
        """Whether the file may still be being written in place (``cmd > file``, a copy):
        changed within the last poll interval and not yet seen so. A part of a file that
        ends between two documents parses, and would remove every service after the cut.
        An editor's or ``kubectl``'s rename-into-place is a whole file at once, but it
        looks the same; it waits one poll too (0.5 s)."""
        age_ns = time.time_ns() - stamp[0]
        if not 0 <= age_ns < self.interval_s * 1e9:
            self._settling = None
            return False  # old enough (or from the future: a clock step, a copied mtime)
        if self._settling == stamp:
            return False  # the same as a poll ago: the writes have stopped
        self._settling = stamp
        return True

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)
