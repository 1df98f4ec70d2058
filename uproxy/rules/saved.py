"""Reading ``iptables-save`` output: what is installed, per table and chain.

The backends compare installed rules with the desired ones as text, so this parser keeps each
``-A`` line verbatim (counters, which only appear with ``-c``, are never requested).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from uproxy.log import kv
from uproxy.rules.portals import (
    ALL_CHAINS,
    CHAINS,
    STAGING_CHAINS,
    TABLES,
    JumpRule,
    PortalRule,
    RuleSet,
)

# uproxy's chains and those a live rewrite uses for a moment (a crash may leave them).
_OURS = ALL_CHAINS | STAGING_CHAINS

BUILTIN_CHAINS = frozenset({"PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"})


@dataclass(slots=True)
class SavedTable:
    name: str
    chains: dict[str, list[str]] = field(default_factory=dict)  # chain -> its "-A" lines
    policies: dict[str, str] = field(default_factory=dict)  # built-in chain -> its policy


def parse_save(text: str) -> dict[str, SavedTable]:
    """Parse ``iptables-save`` output into tables of chains of rule lines."""
    tables: dict[str, SavedTable] = {}
    current: SavedTable | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("*"):
            current = tables.setdefault(line[1:], SavedTable(line[1:]))
        elif current is None or line == "COMMIT":
            continue
        elif line.startswith(":"):
            name, _, rest = line[1:].partition(" ")
            current.chains.setdefault(name, [])
            if rest.split(" ", 1)[0] not in ("", "-"):
                current.policies[name] = rest.split(" ", 1)[0]
        elif line.startswith("-A "):
            chain = line.split(" ", 2)[1]
            current.chains.setdefault(chain, []).append(line)
    return tables


def jump_target(line: str) -> str | None:
    """The chain a rule line jumps to (``-j NAME``), if any."""
    parts = line.split()
    for i, part in enumerate(parts[:-1]):
        if part in ("-j", "-g"):
            return parts[i + 1]
    return None


def strip_save(text: str) -> str:
    """``iptables-save`` output without comments and counters, for byte comparison."""
    out: list[str] = []
    for raw in text.splitlines():
        if raw.startswith("#"):
            continue
        if raw.startswith(":") and raw.endswith("]"):
            raw = raw[: raw.rindex("[")].rstrip()
        out.append(raw)
    return "\n".join(out) + "\n"


# Another proxy's jump into its service chains: kube-proxy's iptables (and ipvs) mode sends
# every ClusterIP to ``KUBE-SERVICES`` from nat PREROUTING and OUTPUT. A packet that meets that
# jump before uproxy's portal jump goes to the endpoints kube-proxy knows, so uproxy's ``first``
# jumps must stand above it. A kube-proxy that starts after uproxy (a node's reboot while both
# DaemonSets exist, during a move from one to the other) inserts its jump at the top; it only
# checks that its jump exists, so moving uproxy's back above it does not start a fight.
OTHERS_SERVICE_CHAINS = frozenset({"KUBE-SERVICES"})

log = logging.getLogger("uproxy.rules")


def overtaken_jumps(tables: Mapping[str, SavedTable], ruleset: RuleSet) -> list[JumpRule]:
    """uproxy's installed ``first`` jumps that stand below another proxy's service jump."""
    out: list[JumpRule] = []
    for jump in ruleset.jumps:
        table = tables.get(jump.table)
        if not jump.first or table is None:
            continue
        lines = table.chains.get(jump.chain, [])
        line = jump.save_line()
        if line in lines and any(
            jump_target(other) in OTHERS_SERVICE_CHAINS for other in lines[: lines.index(line)]
        ):
            out.append(jump)
    return out


def warn_overtaken(tables: Mapping[str, SavedTable], ruleset: RuleSet, **where: Any) -> None:
    """One line when another proxy's service jump stands above uproxy's portal jumps (the
    sync that follows moves them back to the top)."""
    overtaken = overtaken_jumps(tables, ruleset)
    if overtaken:
        log.warning(
            "Another proxy's service rules stand before uproxy's portals; moving uproxy's "
            "jumps above them (remove the other proxy's rules: kube-proxy --cleanup)",
            extra=kv(**where, chains=",".join(sorted({f"{j.table}/{j.chain}" for j in overtaken}))),
        )


def missing_jumps(tables: dict[str, SavedTable], ruleset: RuleSet) -> list[JumpRule]:
    """The jumps from built-in chains that are not installed, or not where they belong
    (``overtaken_jumps``, which ``stale_jumps`` deletes in the same commit)."""
    missing: list[JumpRule] = []
    for jump in ruleset.jumps:
        table = tables.get(jump.table)
        if table is None or jump.save_line() not in table.chains.get(jump.chain, []):
            missing.append(jump)
    return missing + overtaken_jumps(tables, ruleset)


def stale_jumps(tables: dict[str, SavedTable], ruleset: RuleSet) -> list[str]:
    """Jumps into uproxy's chains that ``ruleset`` does not have (``-A`` lines).

    They are left by another configuration: node-port jumps of an earlier
    ``--nodeport-addresses`` would keep node ports open on addresses no longer meant to; or
    by a live rewrite that stopped halfway (jumps into ``CHAIN-NEW``). Jumps another proxy's
    jump stands above (``overtaken_jumps``) are listed too: deleted, and inserted again first.
    """
    wanted = {j.save_line() for j in ruleset.jumps}
    return [
        line
        for table in tables.values()
        for chain, lines in table.chains.items()
        if chain not in _OURS
        for line in lines
        if jump_target(line) in _OURS and line not in wanted
    ] + [jump.save_line() for jump in overtaken_jumps(tables, ruleset)]


def holds(
    tables: dict[str, SavedTable],
    ruleset: RuleSet,
    lines: Mapping[PortalRule, str],
    table: str | None = None,
) -> bool:
    """Whether uproxy's chains (in ``table``, or all) hold exactly ``ruleset``'s rules, as
    text and in its order (the jumps into them aside); ``lines`` has the text of some rules
    (the builder's)."""
    have = _our_chains(tables, ruleset, table)
    if have is None:
        return False
    wanted = ruleset.by_chain()
    for chain, saved in have.items():
        rules = wanted.get(chain, [])
        if len(saved) != len(rules):
            return False
        for line, rule in zip(saved, rules, strict=True):
            if line != (lines.get(rule) or rule.save_line()):
                return False
    return True


def matches(tables: dict[str, SavedTable], ruleset: RuleSet) -> bool:
    """Whether every chain, jump and rule of ``ruleset`` is installed, and nothing else of ours.

    Rule *counts* per chain are compared (not the text): cheap, and enough to notice a flush,
    a deleted chain or a lost table; the next sync rewrites the text anyway.
    """
    if missing_jumps(tables, ruleset) or stale_jumps(tables, ruleset):
        return False
    have = _our_chains(tables, ruleset)
    counts = ruleset.count_by_chain()
    return have is not None and all(len(lines) == counts[c] for c, lines in have.items())


def _our_chains(
    tables: dict[str, SavedTable], ruleset: RuleSet, only: str | None = None
) -> dict[str, list[str]] | None:
    """The installed lines of each of ``ruleset``'s chains (in table ``only``, or all);
    None when one is missing."""
    out: dict[str, list[str]] = {}
    for table_name, chains in ruleset.chains.items():
        if only is not None and table_name != only:
            continue
        table = tables.get(table_name)
        if table is None:
            return None
        for chain in chains:
            lines = table.chains.get(chain)
            if lines is None:
                return None
            out[chain] = lines
    return out


def foreign_rules(tables: Mapping[str, SavedTable]) -> int:
    """How many rules of ``tables`` are somebody else's: neither in uproxy's chains nor
    jumps into them."""
    return sum(
        1
        for table in tables.values()
        for chain, lines in table.chains.items()
        if chain not in _OURS
        for line in lines
        if jump_target(line) not in _OURS
    )


def cleanup_payload(
    tables: dict[str, SavedTable], *, delete_emptied_builtins: bool = False
) -> str | None:
    """``iptables-restore --noflush`` input deleting every jump to, and every one of, our chains.

    None when nothing of uproxy's is installed. ``delete_emptied_builtins`` (iptables-nft): a
    built-in chain left empty with policy ACCEPT by removing our jumps is deleted too. nf_tables
    creates a base chain when its first rule is added, so uproxy's jump from ``FORWARD`` may
    have created it; left behind it changes nothing, but ``nft list ruleset`` would not be
    what it was. An empty ACCEPT base chain filters nothing, whoever made it.
    """
    blocks: list[str] = []
    for name in TABLES:
        table = tables.get(name)
        if table is None:
            continue
        ours = [c for c in CHAINS[name] if c in table.chains]
        ours += [c for c in table.chains if c in STAGING_CHAINS]
        deletes = [
            "-D " + line[3:]
            for chain, lines in table.chains.items()
            if chain not in _OURS
            for line in lines
            if jump_target(line) in _OURS
        ]
        if not ours and not deletes:
            continue
        lines = [f"*{name}", *deletes]
        lines.extend(f":{chain} - [0:0]" for chain in ours)
        lines.extend(f"-X {chain}" for chain in ours)
        if delete_emptied_builtins:
            lines.extend(f"-X {chain}" for chain in _emptied(table))
        lines.append("COMMIT")
        blocks.append("\n".join(lines) + "\n")
    return "".join(blocks) or None


def _emptied(table: SavedTable) -> list[str]:
    """Built-in chains that hold uproxy's jumps and nothing else, with policy ACCEPT."""
    return [
        chain
        for chain, lines in table.chains.items()
        if chain in BUILTIN_CHAINS
        and lines
        and all(jump_target(line) in _OURS for line in lines)
        and table.policies.get(chain) == "ACCEPT"
    ]
