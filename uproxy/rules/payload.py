"""The ``iptables-restore --noflush`` input for uproxy's chains: a rewrite, or edits.

A rewrite declares each of uproxy's chains (which flushes it) and fills it again, and adds the
jumps that are missing from the built-in chains; edits delete and insert single rules where a
rewrite would put them, for a change of a few services (``restore`` says when each is used).
Both are text in the exact form ``iptables-save`` prints, so what is installed compares with
what is expected as text.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace

from uproxy.rules.portals import (
    CHAINS,
    PORTALS_DIRECT,
    STAGED_NEW,
    STAGED_OLD,
    STAGING_CHAINS,
    TABLES,
    JumpRule,
    PortalRule,
    RuleSet,
    insert_positions,
)


def restore_payload(
    ruleset: RuleSet,
    table: str,
    *,
    missing_jumps: Collection[JumpRule] = (),
    stale_jumps: Collection[str] = (),
    lines: Mapping[PortalRule, str] | None = None,
    leftovers: Collection[str] = (),
) -> str:
    """The ``iptables-restore --noflush`` input replacing uproxy's chains in ``table``.

    Declaring a chain (``:NAME - [0:0]``) creates it or flushes it, so the whole table's share
    of uproxy is replaced in one atomic commit; other chains are left alone. Jumps that are
    missing from built-in chains are added in the same commit, and ``stale_jumps`` (``-A``
    lines of jumps into uproxy's chains that this configuration no longer has, such as an old
    ``--nodeport-addresses``) are deleted, and so are the chains ``leftovers`` names that a
    live rewrite which stopped halfway left in this table (``rewrite_commits``).
    """
    out = _declare(ruleset, table)
    out.extend(f"-D {line[3:]}" for line in stale_jumps if _table_of_jump(line) == table)
    out.extend(_purge(table, leftovers))
    out.extend(_jump_lines(ruleset.jumps_in(table), missing_jumps))
    out.extend(_rule_lines(ruleset, table, lines))
    return _commit(out)


def rewrite_commits(
    ruleset: RuleSet,
    table: str,
    *,
    missing_jumps: Collection[JumpRule] = (),
    stale_jumps: Collection[str] = (),
    lines: Mapping[PortalRule, str] | None = None,
    chunk: int | None = None,
    leftovers: Collection[str] = (),
    staged_chunk: int | None = None,
) -> list[str]:
    """``restore_payload`` as commits: that one, or (with a ``chunk``) several of at most
    ``chunk`` rules each, when nothing can reach uproxy's chains in ``table`` before the
    rewrite is done, or of ``staged_chunk`` (default: ``chunk``) when every jump into them
    is in place.

    The kernel takes an nft commit in one piece, and 20,000 rules in one commit held a CPU
    for 0.3 s (``iptables-nft-restore``: a process sleeping 0.5 ms at a time on that CPU
    overslept by 295-320 ms; commits of 500 rules, 11-12 ms, and the restore took no
    longer, see ``restore.REWRITE_CHUNK``). While every jump into the table's chains is
    missing (a new node, a flushed table, a firewall reload) no packet enters them: the
    chains are filled commit by commit and the jumps come in the last one. While every
    jump is in place the chains serve traffic: the new rules go to chains of their own,
    which then take the place of the old ones (``_staged``). With some jumps in place and
    others not (or ``stale_jumps``), which chains exist is not known, and the rewrite stays
    one commit. ``leftovers``: staged chains known to be left over (a jump into one is in
    ``stale_jumps``, which names it too); a rewrite deletes them. Declaring and deleting all
    of them just in case cost 25 ms a rewrite.
    """
    missing = set(missing_jumps)
    jumps = ruleset.jumps_in(table)
    stale = [line for line in stale_jumps if _table_of_jump(line) == table]
    leftovers = {*leftovers, *(_target(line) for line in stale if _target(line) in STAGING_CHAINS)}
    unreachable = all(jump in missing for jump in jumps) and not stale
    live = bool(jumps) and not any(jump in missing for jump in jumps) and not stale
    if chunk is None or not (unreachable or live):
        payload = restore_payload(
            ruleset,
            table,
            missing_jumps=missing_jumps,
            stale_jumps=stale_jumps,
            lines=lines,
            leftovers=leftovers,
        )
        return [payload]
    rules = _rule_lines(ruleset, table, lines)
    if live:
        return _staged(ruleset, table, rules, staged_chunk or chunk)
    pieces = _chunks(rules, chunk)
    pieces[-1] = [*pieces[-1], *_jump_lines(jumps, missing_jumps)]
    return _filled(table, [*_declare(ruleset, table), *_purge(table, leftovers)], pieces)


def _staged(ruleset: RuleSet, table: str, rules: list[str], chunk: int) -> list[str]:
    """A rewrite of chains that serve traffic, in commits none of which holds a CPU long.

    The new rules fill ``CHAIN-NEW`` chains, which nothing reaches, ``chunk`` rules a
    commit. One commit then turns the jumps to them (new jumps where the old ones stood,
    the old ones deleted) and renames each live chain to ``CHAIN-OLD``; the next renames
    ``CHAIN-NEW`` to ``CHAIN`` (the kernel refuses a name freed in the same commit; jumps
    follow a chain through a rename, so traffic never notices); the last flushes and
    deletes the ``-OLD`` chains. Every packet meets either all the old rules or all the new.
    The first commit also deletes any ``-OLD`` chain a crash left behind, so that the
    renames cannot fail on it.
    """
    chains = ruleset.chains[table]
    staged = [f"-A {line[3:].replace(' ', STAGED_NEW + ' ', 1)}" for line in rules]
    first = [f"*{table}", *(f":{c}{STAGED_NEW} - [0:0]" for c in chains)]
    first += _purge(table, [c + STAGED_OLD for c in chains])
    jumps = ruleset.jumps_in(table)
    to_staged = [replace(jump, target=jump.target + STAGED_NEW) for jump in jumps]
    turn = [f"*{table}", *_jump_lines(to_staged, to_staged)]
    turn += [f"-D {jump.chain} {jump.spec()}" for jump in jumps]
    turn += [f"-E {c} {c}{STAGED_OLD}" for c in chains]
    return [
        *_filled(table, first, _chunks(staged, chunk)),
        _commit(turn),
        _commit([f"*{table}", *(f"-E {c}{STAGED_NEW} {c}" for c in chains)]),
        _commit(
            [f"*{table}", *(f"-F {c}{STAGED_OLD}" for c in chains)]
            + [f"-X {c}{STAGED_OLD}" for c in chains]
        ),
    ]


def _purge(table: str, names: Collection[str]) -> list[str]:
    """Lines deleting the chains of ``names`` that belong to ``table`` (staged chains a live
    rewrite left), declared first: that flushes one, or creates one that is not there, so
    that deleting it cannot fail."""
    ours = [n for n in names if _table_of_chain(n) == table]
    return [*(f":{name} - [0:0]" for name in ours), *(f"-X {name}" for name in ours)]


def _chunks(lines: list[str], chunk: int) -> list[list[str]]:
    return [lines[i : i + chunk] for i in range(0, len(lines), chunk)] or [[]]


def _filled(table: str, head: list[str], pieces: list[list[str]]) -> list[str]:
    """Commits of ``pieces``, the first one after ``head`` (which names the table)."""
    heads = [head] + [[f"*{table}"]] * (len(pieces) - 1)
    return [_commit([*h, *piece]) for h, piece in zip(heads, pieces, strict=True)]


def _declare(ruleset: RuleSet, table: str) -> list[str]:
    return [f"*{table}", *(f":{chain} - [0:0]" for chain in ruleset.chains[table])]


def _jump_lines(jumps: list[JumpRule], missing: Collection[JumpRule]) -> list[str]:
    """Lines adding the ``missing`` of ``jumps`` (one table's), each where it belongs."""
    out = []
    for jump, position in insert_positions(jumps, missing):
        where = f"-I {jump.chain} {position}" if jump.first else f"-A {jump.chain}"
        out.append(f"{where} {jump.spec()}")
    return out


def _rule_lines(ruleset: RuleSet, table: str, lines: Mapping[PortalRule, str] | None) -> list[str]:
    if lines is None:
        return [rule.save_line() for rule in ruleset.rules_in(table)]
    return [lines[rule] for rule in ruleset.rules_in(table)]


def _commit(lines: list[str]) -> str:
    return "\n".join([*lines, "COMMIT"]) + "\n"


@dataclass(frozen=True, slots=True)
class Edits:
    """``iptables-restore --noflush`` input that turns uproxy's chains from one rule set into
    the next by deleting and inserting single rules: ``payload`` holds ``commits`` ``COMMIT``
    lines (one per table it touches, or more, see ``commit_cost``); ``count`` is the number
    of rules deleted and inserted."""

    payload: str
    commits: int
    count: int


_KEPT, _GONE, _CAME = 0, 1, 2


def edit_payload(
    old: RuleSet,
    new: RuleSet,
    *,
    lines: Mapping[PortalRule, str],
    delete_by_spec: bool,
    max_edits: int,
    commit_cost: int | None = None,
    tables: Collection[str] = TABLES,
) -> Edits | None:
    """The edits from ``old`` (what uproxy's chains hold, in their order) to ``new``; None
    when a rewrite is the way: the jumps or chains differ, more than ``max_edits`` rules
    would change, or a rule both keep stands in another order (never with portal-sorted
    sets, checked anyway). The direct drops (``KUBE-PORTALS-DIRECT``) do not count toward
    ``max_edits``: a port coming or going replaces a rule or two of that short chain (about
    a twelfth of the portal chains' length), as it does a rule or two of the portal chains,
    and they would otherwise turn half the changes a rewrite would pay off for into rewrites.

    Rules are told apart by identity: the builder hands back the very objects of the portals
    that did not change, so sets of ``id()`` compare 10,000 rules in a few milliseconds
    where hashing the dataclasses took several times that. A rule rebuilt equal (a new
    builder) is deleted and inserted again at its place: more edits, the same chains.

    Each chain keeps the order a rewrite would give it, so the kernel's rules are the same
    text either way: rules that go are deleted from the highest position down, so every
    position is still the one uproxy knows, and rules that come are inserted at their final
    positions, lowest first. ``delete_by_spec`` deletes by the rule's text instead of its
    position (legacy iptables: libiptc finds it at once, and a rule that is not where uproxy
    left it fails the restore rather than deleting another); iptables-nft compares a spec
    with every rule of the chain (4-5 ms per deletion in a chain of 10,000), so positions.
    ``lines`` are ``new``'s rules as text (the builder's).

    ``commit_cost`` splits a table's edits into several commits. The kernel finds the rule
    an nft edit names (by position: its handle) by walking the chain, under the commit
    mutex and without giving up the CPU, so an edit weighs the length of its chain and a
    commit holds at most ``commit_cost`` of that weight (one service port more, if that
    one alone weighs more). The edits of one service port (its comment) stay in one commit,
    so between commits every service has either its old rules or its new ones, never
    neither; positions are those of the chains as the commits before left them.

    Only ``tables`` are edited (the others are rewritten by the caller).
    """
    if old.jumps != new.jumps or old.chains != new.chains:
        return None
    before, after = old.by_chain(), new.by_chain()
    payload: list[str] = []
    commits = count = capped = 0
    for table in (t for t in TABLES if t in tables):
        merged: dict[str, list[tuple[PortalRule, int]]] = {}
        weights: dict[str, int] = {}  # per service port (comment), in chain order
        for chain in new.chains[table]:
            was, now = before.get(chain, []), after.get(chain, [])
            if len(was) == len(now) and all(a is b for a, b in zip(was, now, strict=True)):
                continue
            rules = _merge(was, now)
            if rules is None:
                return None
            weight = max(len(was), len(now))
            for rule, state in rules:
                if state != _KEPT:
                    count += 1
                    capped += chain != PORTALS_DIRECT
                    weights[rule.comment] = weights.get(rule.comment, 0) + weight
            merged[chain] = rules
        if capped > max_edits:
            return None
        for group in _groups(weights, commit_cost):
            body: list[str] = []
            for chain, rules in merged.items():
                body.extend(_edit_lines(chain, rules, group, lines, delete_by_spec))
            payload.append("\n".join([f"*{table}", *body, "COMMIT"]) + "\n")
            commits += 1
    return Edits("".join(payload), commits, count)


def _merge(was: list[PortalRule], now: list[PortalRule]) -> list[tuple[PortalRule, int]] | None:
    """One chain before and after, as one list: the rules both keep, in their common order,
    and between two of them the rules that go, then those that come; None when the rules
    both keep stand in another order."""
    was_ids = {id(r) for r in was}
    now_ids = {id(r) for r in now}
    kept = [r for r in was if id(r) in now_ids]
    if any(a is not b for a, b in zip(kept, (r for r in now if id(r) in was_ids), strict=True)):
        return None
    out: list[tuple[PortalRule, int]] = []
    i = j = 0
    for anchor in [*kept, None]:
        while i < len(was) and was[i] is not anchor:
            out.append((was[i], _GONE))
            i += 1
        while j < len(now) and now[j] is not anchor:
            out.append((now[j], _CAME))
            j += 1
        if anchor is not None:
            out.append((anchor, _KEPT))
            i += 1
            j += 1
    return out


def _groups(weights: dict[str, int], budget: int | None) -> list[dict[str, int]]:
    """The commits of a table's edits: for each, every edited service port (comment) with
    its commit counted from that one (negative: an earlier commit, 0: this one, positive: a
    later one), filled greedily in chain order up to ``budget`` weight each."""
    index: dict[str, int] = {}
    commit = used = 0
    for comment, weight in weights.items():
        if budget is not None and used and used + weight > budget:
            commit += 1
            used = 0
        index[comment] = commit
        used += weight
    if not index:
        return []
    return [{comment: c - at for comment, c in index.items()} for at in range(commit + 1)]


def _edit_lines(
    chain: str,
    rules: list[tuple[PortalRule, int]],
    group: dict[str, int],
    lines: Mapping[PortalRule, str],
    delete_by_spec: bool,
) -> list[str]:
    """One commit's lines for ``chain``: ``group`` maps each edited service port to its
    commit, counted from this one (negative: an earlier commit, 0: this one)."""

    def present(rule: PortalRule, state: int, after: bool) -> bool:
        if state == _KEPT:
            return True
        step = group[rule.comment]
        done = step < 0 or (after and step == 0)
        return done if state == _CAME else not done

    out: list[str] = []
    position = 0
    gone: list[tuple[int, PortalRule]] = []
    for rule, state in rules:
        if present(rule, state, after=False):
            position += 1
            if state == _GONE and group[rule.comment] == 0:
                gone.append((position, rule))
    for position, rule in reversed(gone):
        out.append(f"-D {rule.save_line()[3:]}" if delete_by_spec else f"-D {chain} {position}")
    prefix = len(chain) + 4  # "-A CHAIN "
    position = 0
    for rule, state in rules:
        if present(rule, state, after=True):
            position += 1
            if state == _CAME and group[rule.comment] == 0:
                out.append(f"-I {chain} {position} {lines[rule][prefix:]}")
    return out


def _table_of_jump(line: str) -> str:
    """The table of a jump line, by the uproxy chain it jumps to (or its staged twin)."""
    return _table_of_chain(_target(line))


def _target(line: str) -> str:
    return line.rsplit(" -j ", 1)[-1].split()[0]


def _table_of_chain(name: str) -> str:
    """The table of one of uproxy's chains or of its staged twin ("" for others)."""
    name = name.removesuffix(STAGED_NEW).removesuffix(STAGED_OLD)
    return next((t for t, chains in CHAINS.items() if name in chains), "")
