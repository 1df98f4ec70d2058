"""Reading ``iptables-save`` output as structure: table -> chain -> rules, counters stripped."""

from __future__ import annotations

import re

from tests.netns.topology import Topology

Tables = dict[str, dict[str, list[str]]]

_COUNTERS = re.compile(r"\s*\[\d+:\d+\]$")


def parse_save(text: str) -> Tables:
    """``{"nat": {"PREROUTING": ["-m ... -j X", ...], "KUBE-...": [...]}}``.

    Built-in chains carry their policy as a first pseudo-rule ``policy ACCEPT``, so a changed
    policy shows up too. Comments, ``COMMIT`` and packet counters are dropped.
    """
    tables: Tables = {}
    table: dict[str, list[str]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#") or line == "COMMIT":
            continue
        if line.startswith("*"):
            table = tables.setdefault(line[1:], {})
        elif line.startswith(":"):
            name, policy = _COUNTERS.sub("", line[1:]).split(" ", 1)
            table[name] = [] if policy == "-" else [f"policy {policy}"]
        elif line.startswith("-A "):
            _, chain, spec = line.split(" ", 2)
            table[chain].append(spec)
        else:
            raise ValueError(f"unexpected iptables-save line {line!r}")
    return tables


def save(topo: Topology, ns: str, mode: str, *, family: int = 4) -> Tables:
    """``iptables-{mode}-save`` (``ip6tables-`` for ``family=6``), parsed."""
    return parse_save(topo.run(ns, f"{'ip6' if family == 6 else 'ip'}tables-{mode}-save"))


def normalized(text: str) -> str:
    """The save text without comments and counters, for exact before/after comparisons."""
    lines = []
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        lines.append(_COUNTERS.sub("", line) if line.startswith(":") else line)
    return "\n".join(lines)
