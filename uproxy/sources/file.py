"""The file source: Services and EndpointSlices from a YAML file, reloaded when it changes.

The file holds standard manifests (what ``kubectl apply -f`` accepts): Service (v1) and
EndpointSlice (discovery.k8s.io/v1) documents, or ``List`` documents of them. A reload is
all or nothing: every document is validated before the tracker sees any of it, so a bad
edit leaves the last good state serving and logs one line naming the document and field.
The file is polled (stat every ``interval``) rather than watched with inotify: it works on
every filesystem, across editors' rename-on-save, and costs one stat call.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from uproxy.log import kv
from uproxy.objects import InvalidObject, endpoint_slice, object_key, service_ports
from uproxy.tracker import Kind, Tracker

log = logging.getLogger("uproxy.sources.file")

_API_VERSIONS = {Kind.SERVICE: ("v1",), Kind.ENDPOINT_SLICE: ("discovery.k8s.io/v1",)}


class ServicesFileError(ValueError):
    """The file cannot be used; the message names the document and the field."""


@dataclass(frozen=True, slots=True)
class Manifests:
    services: list[Mapping[str, Any]]
    slices: list[Mapping[str, Any]]


def load_manifests(path: str) -> tuple[Manifests, bytes]:
    """Read and validate the whole file; raises ServicesFileError (or OSError)."""
    with open(path, "rb") as f:
        raw = f.read()
    return parse_manifests(raw.decode("utf-8", errors="replace"), path), raw


def parse_manifests(text: str, path: str = "<services>") -> Manifests:
    try:
        docs = list(yaml.safe_load_all(text))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ServicesFileError(f"{path}:{where}: not valid YAML: {problem}") from None
    out = Manifests([], [])
    seen: set[tuple[Kind, str]] = set()
    for index, doc in enumerate(docs, start=1):
        if doc is None:
            continue
        items = doc.get("items") if isinstance(doc, Mapping) and doc.get("kind") == "List" else None
        for sub, obj in enumerate(items if isinstance(items, list) else [doc]):
            where = f"document {index}" + (f" item {sub + 1}" if items is not None else "")
            kind = _check_document(obj, f"{path}: {where}")
            key = (kind, object_key(obj))
            if key in seen:
                raise ServicesFileError(f"{path}: {where}: {kind.value} {key[1]} appears twice")
            seen.add(key)
            (out.services if kind is Kind.SERVICE else out.slices).append(obj)
    return out


def _check_document(obj: Any, where: str) -> Kind:
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
            service_ports(obj)
        else:
            endpoint_slice(obj)
    except InvalidObject as e:
        raise ServicesFileError(f"{where}: {e}") from None
    return kind


class FileSource:
    name = "file"

    def __init__(self, *, path: str, tracker: Tracker, interval_s: float = 0.5) -> None:
        self.path = path
        self.tracker = tracker
        self.interval_s = interval_s
        self._stamp: tuple[int, int, int] | None = None
        self._digest: bytes | None = None
        self._last_error: str | None = None
        self.reloads = 0

    def load_initial(self) -> None:
        """First load: a bad file is fatal here (there is no good state to keep)."""
        manifests, raw = load_manifests(self.path)
        self._stamp = self._stat()
        self._apply(manifests, raw)

    async def run(self) -> None:
        """Poll for changes until cancelled."""
        if self._digest is None:
            self.load_initial()
        while True:
            await asyncio.sleep(self.interval_s)
            self.poll()

    def poll(self) -> None:
        stamp = self._stat()
        if stamp is None or stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            manifests, raw = load_manifests(self.path)
        except (ServicesFileError, OSError) as e:
            msg = str(e)
            if msg != self._last_error:
                log.error(
                    "Ignoring services file change, keeping the last good state",
                    extra=kv(error=msg),
                )
                self._last_error = msg
            return
        self._apply(manifests, raw)

    def _apply(self, manifests: Manifests, raw: bytes) -> None:
        digest = hashlib.sha256(raw).digest()
        self._last_error = None
        if digest == self._digest:
            return
        self._digest = digest
        self.tracker.replace(Kind.SERVICE, manifests.services)
        self.tracker.replace(Kind.ENDPOINT_SLICE, manifests.slices)
        self.reloads += 1
        log.info(
            "Loaded services file",
            extra=kv(
                path=self.path, services=len(manifests.services), slices=len(manifests.slices)
            ),
        )

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)
