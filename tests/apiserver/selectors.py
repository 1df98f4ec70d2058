"""Kubernetes label and field selectors, as the API-server double evaluates them.

Label selectors support the whole grammar (``k``, ``!k``, ``k=v``, ``k==v``, ``k!=v``,
``k in (a,b)``, ``k notin (a,b)``); field selectors support ``metadata.name`` and
``metadata.namespace``, which is all the three resources uproxy follows need.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

_SET_RE = re.compile(
    r"^\s*(!?)\s*([^\s!=(),]+)\s*(?:(in|notin)\s*\(([^)]*)\)|(==|=|!=)\s*(\S*))?\s*$"
)


@dataclass(frozen=True, slots=True)
class Requirement:
    key: str
    op: str  # exists, !exists, in, notin, =, !=
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, Any]) -> bool:
        if self.op == "exists":
            return self.key in labels
        if self.op == "!exists":
            return self.key not in labels
        value = labels.get(self.key)
        if self.op in ("in", "="):
            return value in self.values
        return value not in self.values  # notin, !=


def _split_selector(text: str) -> list[str]:
    """Split on commas outside parentheses (``a in (x,y),b`` has two requirements)."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p for p in parts if p.strip()]


def parse_label_selector(text: str) -> list[Requirement]:
    reqs = []
    for part in _split_selector(text):
        m = _SET_RE.match(part)
        if m is None:
            raise ValueError(f"unable to parse requirement: {part!r}")
        neg, key, set_op, set_values, op, value = m.groups()
        if neg and (set_op or op):
            raise ValueError(f"unable to parse requirement: {part!r}")
        if set_op:
            values = frozenset(v.strip() for v in set_values.split(",") if v.strip())
            reqs.append(Requirement(key, set_op, values))
        elif op:
            reqs.append(Requirement(key, "!=" if op == "!=" else "=", frozenset([value])))
        else:
            reqs.append(Requirement(key, "!exists" if neg else "exists"))
    return reqs


def parse_field_selector(text: str) -> list[tuple[str, bool, str]]:
    """(field path, equal?, value) for each ``metadata.name=x`` / ``metadata.namespace!=y``."""
    out = []
    for part in _split_selector(text):
        m = re.match(r"^\s*([\w.]+)\s*(==|=|!=)\s*(\S*)\s*$", part)
        if m is None or m.group(1) not in ("metadata.name", "metadata.namespace"):
            raise ValueError(f"field label not supported: {part!r}")
        out.append((m.group(1), m.group(2) != "!=", m.group(3)))
    return out


@dataclass(frozen=True, slots=True)
class Filter:
    labels: list[Requirement] = field(default_factory=list)
    fields: list[tuple[str, bool, str]] = field(default_factory=list)
    namespace: str | None = None

    def matches(self, obj: Mapping[str, Any]) -> bool:
        meta = obj.get("metadata") or {}
        ns = meta.get("namespace", "")
        if self.namespace is not None and ns != self.namespace:
            return False
        raw_labels = meta.get("labels")
        labels: Mapping[str, Any] = raw_labels if isinstance(raw_labels, Mapping) else {}
        if not all(r.matches(labels) for r in self.labels):
            return False
        for path, equal, value in self.fields:
            actual = meta.get("name") if path == "metadata.name" else ns
            if (actual == value) != equal:
                return False
        return True
