"""The ``iptables-restore`` backend: uproxy's chains replaced atomically, table by table.

Why restore and not one ``iptables`` call per rule: a sync of 10,000 portal rules takes about
0.1 s (legacy) / 0.3 s (nft) this way, against minutes rule by rule. The input names only
uproxy's chains (``--noflush``), and declaring a chain flushes it, so each table's share is
replaced in a single commit and nobody else's rules are touched. Jumps from the built-in chains
are read (``-S`` on the four built-in chains) and added in the same commit when missing, so a
sync also repairs a flushed table; jumps into uproxy's chains that the configuration no longer
has (an earlier ``--nodeport-addresses``) are deleted in that commit. In nft mode a big
rewrite is several commits, none of which holds a CPU for long, and still atomic for every
packet (``payload.rewrite_commits``).

A small change is an edit, not a rewrite: when nobody else committed since uproxy's last
commit (the watch below says so), its chains hold exactly what that commit left, so the sync
deletes and inserts only the rules that changed, at the positions a rewrite would give them
(``payload.edit_payload``): the chains end up the same text either way, in one commit per
table (iptables-nft: more when many rules change, each service's edits in one of them). A
service added or removed at 10,000 services is then a handful of lines for
``iptables-restore`` instead of 20,000 (in a 10,000-rule chain: 0.08-0.10 s for
iptables-nft-restore against 0.26 s, 0.03-0.04 s against 0.06 s for legacy). If somebody
else committed in between after all (the generation moved by more than uproxy's commits), the
next check asks for a rewrite, which puts every rule back where it belongs.

nft or legacy: chosen the way kube-proxy's image does it (iptables-wrappers' DetectMode), so
uproxy writes to the same variant as the kubelet; ``mode`` overrides it.

Each IP family the node serves has its own rules, written with its own program:
``iptables-{nft,legacy}-restore`` for IPv4, ``ip6tables-{nft,legacy}-restore`` for IPv6 (the
same variant for both). A sync restores only the families whose rules changed, unless
somebody else committed (then every family is read, and rewritten where it differs); one
change detector
covers both families (the nf_tables generation is per namespace; the legacy shape reads
both ``ip_tables`` and ``ip6_tables``). A restore input holds two tables, nat and filter, and
each ``COMMIT`` is a transaction of its own: uproxy's restore moves the generation by two.

Reading rules costs processes, so a change detector (``watch``: the nf_tables generation, or
the shape of the legacy tables) decides when to read: ``check`` reads the four built-in
chains only when somebody committed something since uproxy last looked, a sync skips that
read when nothing changed since uproxy's own last commit, and a sync of the very rules that
commit installed, with nothing changed since, does nothing at all. After somebody else's
commit, a sync reads each family whole (one ``*-save``): chains that still hold exactly what
uproxy installed are edited, or left alone, instead of rewritten; only chains that differ are
rewritten. At least once an hour a sync reads everything so, for what the watch cannot see.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from uproxy.log import V2, kv
from uproxy.model import IPFamily
from uproxy.rules import command
from uproxy.rules.base import (
    NO_LOCAL_TRAFFIC,
    LeftoverPorts,
    Leftovers,
    LocalTraffic,
    Portal,
    RulesError,
    Stack,
    keep_leftovers,
    no_leftover_ports,
)
from uproxy.rules.payload import edit_payload, rewrite_commits
from uproxy.rules.portals import (
    ANY_IPV4,
    JUMP_CHAINS,
    STAGING_CHAINS,
    TABLES,
    JumpRule,
    PortalRule,
    RuleBuilder,
    RuleSet,
    check_host_ip,
    split_by_family,
    stacks,
)
from uproxy.rules.previous import PortalKey, Previous, from_save_lines
from uproxy.rules.saved import (
    OTHERS_SERVICE_CHAINS,
    SavedTable,
    cleanup_payload,
    foreign_rules,
    holds,
    jump_target,
    matches,
    missing_jumps,
    parse_save,
    stale_jumps,
    warn_overtaken,
)
from uproxy.rules.watch import (
    FULL_SYNC_PERIOD_S,
    LEGACY_TABLE_NAMES,
    LEGACY_TABLE_NAMES6,
    Token,
    Watch,
    legacy_table_names,
    nft_tables,
    watch_for,
)

log = logging.getLogger("uproxy.rules.restore")

MODES = ("nft", "legacy")
FAMILIES = (IPFamily.V4, IPFamily.V6)  # what cleanup removes
_HINTS = ("KUBE-IPTABLES-HINT", "KUBE-KUBELET-CANARY")
LOCK_WAIT_S = 5
_PROGRAMS = {IPFamily.V4: "iptables", IPFamily.V6: "ip6tables"}
# A sync edits uproxy's chains rule by rule while it changes at most one rule in
# EDIT_SHARE[mode] (and at least MIN_EDITS), else it rewrites them. Legacy, in a chain of
# 10,000 rules: 1, 20 and 200 deletions and insertions take 0.03-0.05 s against 0.06 s for
# the rewrite. nft, at 10,000 services (20,000 rules), edits spread over commits
# (EDIT_COMMIT_COST) against the rewrite beside the live chains (rewrite_commits), each
# holding a CPU for 32-48 ms at most: 600 edits took 0.96 s against 1.21 s, 1,000 took 1.30 s
# against 1.10 s, 1,600 took 1.75 s against 1.08 s.
EDIT_SHARE = {"legacy": 8, "nft": 24}
MIN_EDITS = 64
# Rules per commit in an nft-mode rewrite of chains no traffic can see yet (a first start, a
# flushed table; ``rewrite_commits``). 20,000 portal rules into empty chains, a process
# sleeping 0.5 ms at a time on the same CPU: one commit held it for 0.30 s; commits of 2,000
# rules for 36-37 ms each, of 1,000 for 17-20, of 500 for 11-12, of 250 for 8-9 ms, all in
# 0.39-0.45 s (most of a commit is the kernel taking each rule's expressions by type name).
# Legacy mode stays one commit: its kernel replaces the whole table per commit (20,000
# rules: 32-34 ms held in one commit, 50-53 ms and four times the work in commits of 2,000).
REWRITE_CHUNK = 500
# The same for this process's first write of its chains, which a cold start waits for:
# commits of 500 made that 0.1-0.2 s slower (10,000 services from the API double, one CPU:
# synced after 2.20-2.30 s against 2.08-2.09 in commits of 2,000), while no relay of this
# process is serving yet.
FIRST_CHUNK = 2000
# The same for the staged twins of live chains. There the commit that deletes the old chains
# (20,000 rules) holds a CPU 22-24 ms, and as long in two commits (the second waits for the
# kernel to free the first one's rules), so smaller fills gain nothing: 2,000 services moved
# at 10,000, commits of 1,000 held 21-22 ms in 0.90-0.98 s, of 500 22-26 ms in 1.00-1.33 s,
# of 2,000 33-35 ms in 0.90-0.94 s.
STAGED_CHUNK = 1000
# The weight of an nft-mode edit commit (``edit_payload``'s ``commit_cost``): an edit weighs
# the length of its chain, which the kernel walks to find the rule it names. 625 services
# changed at 10,000 (2,500 edits in two chains of 10,000 rules): in one commit a process
# sleeping 0.5 ms at a time on the same CPU overslept by 174-195 ms, in 13 commits of this
# weight by 35-37 ms (as a FIRST_CHUNK commit), in 9 by 43-44 ms. Each commit costs
# iptables-nft-restore a new read of the table, preemptible but not cheap: the sync took
# 2.6-2.7 s against 0.5 s in one commit (1.8-1.9 s in 9).
EDIT_COMMIT_COST = 2_000_000


def program(family: IPFamily, mode: str, suffix: str = "") -> str:
    """``iptables-nft``, ``ip6tables-legacy-restore``...: the binary for a family and mode."""
    return f"{_PROGRAMS[family]}-{mode}{suffix}"


def _has_hint(save_output: str) -> bool:
    return any(f":{hint} " in save_output for hint in _HINTS)


async def detect_mode() -> str:
    """nft when the kubelet's hint chain is in nft mangle; legacy when it is in legacy; else nft.

    The legacy probe saves *all* tables: ``-t mangle`` would create the legacy mangle table.
    IPv4 first, then IPv6 (where the IPv4 programs found no hint: a node whose kubelet
    manages IPv6 alone), as kube-proxy's image reads them; both families follow the variant
    found.
    """
    legacy_ipv4: str | None = None
    for mode, args in (("nft", ("-t", "mangle")), ("legacy", ())):
        for family in FAMILIES:
            save = program(family, mode, "-save")
            if not shutil.which(save):
                continue
            done = await command.run([save, *args], check=False)
            if done.returncode != 0:
                continue
            if _has_hint(done.stdout):
                return mode
            if mode == "legacy" and family is IPFamily.V4:
                legacy_ipv4 = done.stdout
    if legacy_ipv4 is not None:
        _warn_rules_in_legacy(legacy_ipv4)
    return "nft"


def _warn_rules_in_legacy(save_output: str) -> None:
    """One line when nft is chosen for want of a hint while the legacy tables hold other
    programs' rules: a firewall there (ufw, Docker on a legacy host) filters the connections
    uproxy's portals redirect too, and its default drop is not undone by uproxy's accepts in
    the other variant."""
    count = foreign_rules(parse_save(save_output))
    if count:
        log.warning(
            "No kubelet hint chain says which iptables variant this node uses: writing nft, "
            "as kube-proxy's image does, while the legacy tables hold other programs' rules; "
            "if they are this node's firewall, set uproxy.iptablesMode: legacy",
            extra=kv(legacy_rules=count),
        )


def supports(family: IPFamily) -> bool:
    """Whether this host has the restore programs for ``family`` (in either variant)."""
    return any(shutil.which(program(family, mode, "-restore")) for mode in MODES)


async def save(mode: str, family: IPFamily = IPFamily.V4) -> str:
    """Every table of ``mode`` in one family (does not create legacy tables)."""
    return (await command.run([program(family, mode, "-save")])).stdout


async def builtin_rules(mode: str, family: IPFamily = IPFamily.V4) -> dict[str, SavedTable]:
    """The rules of the built-in chains uproxy jumps from, as ``-A`` lines.

    ``-S CHAIN`` reads one chain: ~2 ms with nft at any number of services, where a full
    ``iptables-nft-save`` of 20,000 rules takes 0.7 s.
    """
    tables: dict[str, SavedTable] = {}
    for table, chain in JUMP_CHAINS:
        lines = await chain_rules(mode, family, table, chain)
        tables.setdefault(table, SavedTable(table)).chains[chain] = lines or []
    return tables


async def chain_rules(
    mode: str, family: IPFamily, table: str, chain: str, *, missing_ok: bool = False
) -> list[str] | None:
    """One chain's ``-A`` lines (``-S CHAIN``); None for a chain that is not there when
    ``missing_ok`` (else RulesError)."""
    argv = [program(family, mode), "-w", str(LOCK_WAIT_S), "-t", table, "-S", chain]
    done = await command.run(argv, check=not missing_ok)
    if done.returncode != 0:
        return None
    return [line for line in done.stdout.splitlines() if line.startswith("-A ")]


async def read_previous(mode: str, families: Iterable[IPFamily]) -> dict[PortalKey, int]:
    """The proxy ports the last run's container portal and node-port chains lead to (see
    ``previous``): two ``-S`` reads per family whose tables may hold them."""
    out: dict[PortalKey, int] = {}
    for family in families:
        if may_hold_ours(mode, family) is False:
            continue
        lines: list[str] = []
        for chain in ("KUBE-PORTALS-CONTAINER", "KUBE-NODEPORT-CONTAINER"):
            lines += await chain_rules(mode, family, "nat", chain, missing_ok=True) or []
        out.update(await asyncio.to_thread(from_save_lines, lines))
    return out


async def restore(mode: str, payload: str, family: IPFamily = IPFamily.V4) -> None:
    argv = [program(family, mode, "-restore"), "--noflush", "-w", str(LOCK_WAIT_S)]
    await command.write(argv, stdin=payload)


# The tables uproxy writes its chains and jumps into.
_OUR_TABLES = frozenset({"nat", "filter"})
_NFPROTO = {IPFamily.V4: 2, IPFamily.V6: 10}  # nf_tables' family numbers: ip, ip6
_LEGACY_NAMES = {IPFamily.V4: LEGACY_TABLE_NAMES, IPFamily.V6: LEGACY_TABLE_NAMES6}


def may_hold_ours(mode: str, family: IPFamily) -> bool | None:
    """Whether the kernel has a nat or filter table of this variant and family, without its
    programs: legacy from /proc, nft over netlink. None: it cannot tell."""
    return _has_table(mode, family, _OUR_TABLES)


def _has_table(mode: str, family: IPFamily, names: frozenset[str]) -> bool | None:
    """Whether the kernel has one of the tables ``names`` in this variant and family, asked
    without its programs; None: it cannot tell."""
    if mode == "legacy":
        legacy = legacy_table_names(_LEGACY_NAMES[family])
        return None if legacy is None else bool(legacy & names)
    tables = nft_tables()
    if tables is None:
        return None
    return any(f == _NFPROTO[family] and name in names for f, name in tables)


async def others_service_jumps(mode: str, family: IPFamily) -> list[str]:
    """The nat built-in chains (``nat/CHAIN``) of this variant and family that jump into
    another proxy's service chains (``OTHERS_SERVICE_CHAINS``). Read only where the nat table
    exists: asking its program about a missing one creates it (a legacy table for good), and
    the table registered last runs first among those of one priority."""
    if _has_table(mode, family, frozenset({"nat"})) is False:
        return []
    found: list[str] = []
    for table, chain in JUMP_CHAINS:
        if table != "nat":
            continue
        lines = await chain_rules(mode, family, table, chain, missing_ok=True) or []
        if any(jump_target(line) in OTHERS_SERVICE_CHAINS for line in lines):
            found.append(f"{table}/{chain}")
    return found


async def cleanup_mode(mode: str, family: IPFamily = IPFamily.V4) -> bool:
    """Remove uproxy's jumps and chains from one variant of one family; False when nothing
    was installed. Without the family's programs that is False when the kernel has no table
    they could be in, else RulesError naming the missing program."""
    save_program = program(family, mode, "-save")
    if not shutil.which(save_program):
        if may_hold_ours(mode, family):
            tables = "legacy" if mode == "legacy" else "nft"
            raise RulesError(
                f"{save_program} not found: cannot remove uproxy's rules from the {tables} "
                f"{family.label} nat and filter tables; install the iptables package"
            )
        return False
    parsed = parse_save(await save(mode, family))
    payload = cleanup_payload(parsed, delete_emptied_builtins=mode == "nft")
    if payload is None:
        return False
    await restore(mode, payload, family)
    log.info("Removed iptables rules", extra={"kv": {"mode": mode, "family": family.label}})
    return True


class _Family:
    """One family's rules: how they are built and what uproxy's last restore installed."""

    def __init__(self, stack: Stack, builder: RuleBuilder) -> None:
        self.stack = stack
        self.builder = builder
        self.installed: RuleSet | None = None
        # Staged chains a live rewrite that stopped halfway left, as the last read saw them.
        self.leftovers: list[str] = []


class RestoreBackend:
    """Programs the portal rules with ``ip{,6}tables-{nft,legacy}-restore``."""

    name = "iptables-restore"

    def __init__(
        self,
        *,
        host_ip: str | Sequence[str],
        mode: str = "auto",
        listen_ip: str | Sequence[str] = ANY_IPV4,
        dial_mark: int = 0,
        nodeport_cidrs: Collection[str] = (),
        proxy_ports: tuple[int, int] | None = None,
        local: LocalTraffic = NO_LOCAL_TRAFFIC,
        watch_factory: Callable[[str], Watch] | None = None,
        clock: Callable[[], float] = time.monotonic,
        leftovers: Leftovers = keep_leftovers,
        leftover_ports: LeftoverPorts = no_leftover_ports,
    ) -> None:
        if mode not in ("auto", *MODES):
            raise RulesError(f"unknown iptables mode {mode!r}: use auto, nft or legacy")
        self._options: dict[str, Any] = {
            "dial_mark": dial_mark,
            "nodeport_cidrs": tuple(nodeport_cidrs),
            "proxy_ports": proxy_ports,
        }
        self._families = {
            stack.family: _Family(stack, _builder(stack, self._options, local))
            for stack in _stacks(host_ip, listen_ip)
        }
        self.local = local
        first = next(iter(self._families.values())).stack
        self.host_ip = first.host_ip
        self.listen_ip = first.listen_ip
        self._requested_mode = mode
        self._leftovers = leftovers
        self._leftover_ports = leftover_ports
        self._swept = False  # other backends' rules removed (after the first sync)
        self._mode: str | None = None if mode == "auto" else mode
        self._lock = asyncio.Lock()
        versions = [f.value for f in self._families]
        self._watch_factory = watch_factory or (lambda m: watch_for(m, versions))
        self._watch: Watch | None = None
        self._committed: Token | None = None  # the watch's token right after our last restore
        self._clock = clock
        self._last_full = float("-inf")
        self.restores = 0
        self.commits = 0  # transactions those restores committed (COMMIT lines)
        self.edits = 0  # rules deleted or inserted one by one (not in rewrites)
        self._repair = False  # edits may have gone astray: rewrite at the next sync
        self.reads = 0  # reads of one family's built-in chains (each is four processes)
        # The built-in chains' jumps as ``prepare`` read them, and the watch's token then.
        self._early_jumps: tuple[Token, dict[IPFamily, dict[str, SavedTable]]] | None = None
        self.previous_ports: Previous = {}  # what the last run's chains led to (``prepare``)

    @property
    def families(self) -> tuple[IPFamily, ...]:
        return tuple(self._families)

    async def mode(self) -> str:
        """The variant in use (detected once, on first use)."""
        if self._mode is None:
            self._mode = await detect_mode()
            log.info("Using iptables mode", extra={"kv": {"mode": self._mode}})
        return self._mode

    def set_local_traffic(self, local: LocalTraffic) -> None:
        if local != self.local:
            for fam in self._families.values():
                fam.builder = _builder(fam.stack, self._options, local)
            self.local = local

    def set_host_ip(self, family: IPFamily, host_ip: str) -> None:
        fam = self._families.get(family)
        if fam is None or fam.stack.host_ip == host_ip:
            return
        check_host_ip(host_ip)
        stack = replace(fam.stack, host_ip=host_ip)
        fam.builder = _builder(stack, self._options, self.local)
        fam.stack = stack
        self.host_ip = next(iter(self._families.values())).stack.host_ip

    async def _read_jumps(self, mode: str, family: IPFamily) -> dict[str, SavedTable]:
        self.reads += 1
        return await builtin_rules(mode, family)

    def watch(self, mode: str) -> Watch:
        if self._watch is None:
            self._watch = self._watch_factory(mode)
        return self._watch

    def _build(self, portals: Collection[Portal]) -> dict[IPFamily, RuleSet]:
        split = split_by_family(portals, self._families)
        return {f: fam.builder.build(split[f]) for f, fam in self._families.items()}

    async def prepare(self) -> None:
        """Detect the iptables variant (two ``*-save`` runs when the kubelet left no hint in
        nft) and read the built-in chains' jumps while the sources list, rather than after
        the first sync's listeners, and the ports of what other backends left (removed after
        the first sync, ``Leftovers``).
        At 10,000 services the rules then follow the listeners
        by 0.60-0.68 s instead of 0.63-1.06 s (two alternating control-plane runs of three
        starts each). The jumps read here serve the first sync when nobody has committed
        since (the watch says): four processes less on the way to the first rules."""
        async with self._lock:
            try:
                mode = await self.mode()
                watch = self.watch(mode)
                token = watch.read()
                if token is not None:
                    jumps = {f: await self._read_jumps(mode, f) for f in self._families}
                    self._early_jumps = (token, jumps)
                previous = await read_previous(mode, self._families)
                others = [m for m in MODES if m != mode]
                await self._leftover_ports(
                    previous, nft_tables=True, iptables_modes=others, families=self._families
                )
                self.previous_ports = previous
            except (RulesError, OSError) as exc:
                log.log(V2, "Probing iptables failed; the first sync retries", extra=kv(err=exc))

    def _take_early_jumps(self, now: Token | None) -> dict[IPFamily, dict[str, SavedTable]]:
        """The jumps ``prepare`` read, if nothing was committed since (then, once only)."""
        early, self._early_jumps = self._early_jumps, None
        if early is None or now is None or early[0] != now:
            return {}
        return early[1]

    async def sync(self, portals: Collection[Portal]) -> None:
        async with self._lock:
            try:
                # Off the loop: the first build of 20,000 rules is ~0.13 s of Python (a thread
                # takes the GIL from the loop for at most the 5 ms switch interval at a time).
                rulesets = await asyncio.to_thread(self._build, portals)
            except ValueError as exc:
                raise RulesError(str(exc)) from None
            mode = await self.mode()
            watch = self.watch(mode)
            full = self._clock() - self._last_full >= FULL_SYNC_PERIOD_S
            changed = [f for f, r in rulesets.items() if r != self._families[f].installed]
            untouched = self._untouched(watch)
            if not full and not changed and untouched:
                return  # exactly what our last restore left, and nobody committed since
            jumps: dict[IPFamily, tuple[list[JumpRule], list[str]]] = {}
            if not (full or self._repair) and untouched:
                # Nobody committed since our last commit: the chains hold what it left.
                before = self._committed
                jumps = {f: ([], []) for f in changed}
                editable = {f: frozenset(TABLES) for f in changed}
            else:
                before = watch.read()
                jumps, editable = await self._look(mode, rulesets, before)
                if before is None or watch.read() != before:
                    editable = {}  # somebody may have committed while we read: rewrite
                else:
                    self._report_foreign_changes(editable)
                for family, tables in editable.items():
                    if family not in changed and tables == frozenset(TABLES):
                        del jumps[family]  # exactly in place already: nothing to write
            rewrote = await self._restore(
                mode, {f: rulesets[f] for f in jumps}, jumps, before, editable=editable
            )
            if not self._swept:  # this run's first rules are in (``Leftovers``)
                self._swept = True
                others = [m for m in MODES if m != mode]
                await self._leftovers(nft_tables=True, iptables_modes=others)
            if rewrote or self._committed is not None:
                self._repair = False  # rewritten, or edits on chains known to be ours
            if full:
                self._last_full = self._clock()

    def _report_foreign_changes(self, editable: Mapping[IPFamily, frozenset[str]]) -> None:
        """One line per sync that found uproxy's chains (or their jumps) not as it left them."""
        changed = [
            f"{family.label} {table}"
            for family, fam in self._families.items()
            if fam.installed is not None and family in editable
            for table in TABLES
            if table not in editable[family]
        ]
        if changed:
            log.info(
                "Rules changed by someone else, rewriting them",
                extra=kv(tables=",".join(changed)),
            )

    async def _look(
        self, mode: str, rulesets: dict[IPFamily, RuleSet], token: Token | None
    ) -> tuple[dict[IPFamily, tuple[list[JumpRule], list[str]]], dict[IPFamily, frozenset[str]]]:
        """After somebody else's commit (or for the hourly full sync): each family's missing
        and stale jumps, and the tables whose chains (and jumps) still hold exactly what
        uproxy last installed, so that a change there can be edited in and no change needs
        no commit; the other tables are rewritten.

        A family with rules installed is read whole (one ``*-save``: 0.2 s at 20,000 rules,
        none of it holding a CPU) rather than rewritten (0.4 s, and a commit that held a CPU
        for 0.3 s in nft mode). Nodes where other programs commit rules (a CNI plugin, a
        firewall) would otherwise rewrite uproxy's chains at every sync after theirs.
        """
        early = self._take_early_jumps(token)
        jumps: dict[IPFamily, tuple[list[JumpRule], list[str]]] = {}
        editable: dict[IPFamily, frozenset[str]] = {}
        for family, ruleset in rulesets.items():
            installed = self._families[family].installed
            builtin = early.get(family)
            ours: list[str] = []  # tables whose chains read back exactly as installed
            if builtin is None and installed is not None:
                self.reads += 1
                text = await save(mode, family)
                lines = self._families[family].builder.lines
                saved, ours = await asyncio.to_thread(_read_back, text, installed, lines)
                builtin = saved
                self._families[family].leftovers = [
                    chain for t in saved.values() for chain in t.chains if chain in STAGING_CHAINS
                ]
            elif builtin is None:
                builtin = await self._read_jumps(mode, family)
            missing = missing_jumps(builtin, ruleset)
            warn_overtaken(builtin, ruleset, mode=mode, family=family.label)
            jumps[family] = (missing, stale_jumps(builtin, ruleset))
            # Edits never touch the jumps: a table missing one, or with a stale one, is rewritten.
            editable[family] = frozenset(
                table
                for table in ours
                if not any(j.table == table for j in missing)
                and not stale_jumps({table: builtin.get(table, SavedTable(table))}, ruleset)
            )
        return jumps, editable

    def _payload(
        self,
        family: IPFamily,
        mode: str,
        ruleset: RuleSet,
        jumps: tuple[list[JumpRule], list[str]],
        editable: frozenset[str],
    ) -> tuple[str, int, int | None]:
        """The restore input for one family, its number of commits, and the number of rules
        it edits one by one (None: it rewrites all of uproxy's chains). ``editable``: the
        tables whose chains hold exactly what uproxy installed. Run on a thread."""
        fam = self._families[family]
        parts: list[str] = []
        commits = 0
        edited: int | None = None
        rewrite = [t for t in TABLES if t not in editable]
        if editable and fam.installed is not None:
            edits = edit_payload(
                fam.installed,
                ruleset,
                lines=fam.builder.lines,
                delete_by_spec=mode == "legacy",
                max_edits=max(MIN_EDITS, len(ruleset.rules) // EDIT_SHARE[mode]),
                commit_cost=EDIT_COMMIT_COST if mode == "nft" else None,
                tables=editable,
            )
            if edits is None:
                rewrite = list(TABLES)
            else:
                parts.append(edits.payload)
                commits, edited = edits.commits, edits.count
        missing, stale = jumps
        chunk = staged = None  # legacy: one commit
        if mode == "nft":
            chunk = FIRST_CHUNK if fam.installed is None else REWRITE_CHUNK
            staged = STAGED_CHUNK
        for table in rewrite:
            for commit in rewrite_commits(
                ruleset,
                table,
                missing_jumps=missing,
                stale_jumps=stale,
                lines=fam.builder.lines,
                chunk=chunk,
                staged_chunk=staged,
                leftovers=fam.leftovers,
            ):
                parts.append(commit)
                commits += 1
        return "".join(parts), commits, edited

    def _untouched(self, watch: Watch) -> bool:
        return self._committed is not None and watch.read() == self._committed

    async def _restore(
        self,
        mode: str,
        rulesets: dict[IPFamily, RuleSet],
        jumps: dict[IPFamily, tuple[list[JumpRule], list[str]]],
        before: Token | None,
        *,
        editable: Mapping[IPFamily, frozenset[str]],
    ) -> bool:
        """Restore each family's rules; whether every family's chains were rewritten."""
        watch = self.watch(mode)
        self._committed = None  # unknown until the commits are through
        commits = 0
        rewrote = True
        for family, ruleset in rulesets.items():
            payload, count, edited = await asyncio.to_thread(
                self._payload,
                family,
                mode,
                ruleset,
                jumps[family],
                editable.get(family, frozenset()),
            )
            try:
                if payload:
                    self.restores += 1
                    await restore(mode, payload, family)
            except RulesError:
                watch.forget()  # the next sync reads the jumps and rewrites
                raise
            self._families[family].installed = ruleset
            if edited is None:
                self._families[family].leftovers = []  # the rewrite deleted them
            self.commits += count
            commits += count  # each COMMIT line is a transaction: one generation step
            if edited is not None:
                self.edits += edited
                rewrote = False
            _log_jumps(mode, family, *jumps[family])
        self._committed = watch.mark_after_commit(before, commits=commits)
        if self._committed is None and not rewrote:
            # Somebody else committed between our last look and our edits: positions may
            # have moved under them. Rewrite at the next sync, which the check asks for.
            self._repair = True
        return rewrote

    async def check(self) -> bool:
        """Whether the jumps into uproxy's chains are all in place, in every family.

        Free unless somebody committed a change since uproxy last looked (see ``watch``);
        then four short built-in chains per family are read. That notices what actually
        happens to nodes: a flushed table, a firewall reload, deleted chains (a chain cannot
        be deleted while a jump refers to it). A rule deleted by hand from inside uproxy's
        chains is not looked for here: the watch saw a change, so the next sync reads the
        chains whole and rewrites them if they differ. ``verify`` compares everything.
        """
        async with self._lock:
            installed = {f: fam.installed for f, fam in self._families.items() if fam.installed}
            if not installed:
                return True
            if self._repair:
                return False
            mode = await self.mode()
            watch = self.watch(mode)
            if not watch.changed():
                return True
            token = watch.read()
            for family, ruleset in installed.items():
                builtin = await self._read_jumps(mode, family)
                if missing_jumps(builtin, ruleset) or stale_jumps(builtin, ruleset):
                    return False
            watch.mark(token)
            return True

    async def verify(self) -> bool:
        """Full comparison of the installed chains with the last sync (reads every table)."""
        async with self._lock:
            mode = await self.mode()
            for family, fam in self._families.items():
                if fam.installed is None:
                    continue
                if not matches(parse_save(await save(mode, family)), fam.installed):
                    return False
            return True

    async def cleanup(self) -> None:
        async with self._lock:
            for mode in MODES:
                for family in FAMILIES:
                    await cleanup_mode(mode, family)
            for fam in self._families.values():
                fam.installed = None
            self._committed = None
            if self._watch is not None:
                self._watch.forget()

    async def close(self) -> None:
        return None


def _read_back(
    text: str, installed: RuleSet, lines: Mapping[PortalRule, str]
) -> tuple[dict[str, SavedTable], list[str]]:
    """``iptables-save`` output parsed, and the tables in which uproxy's chains hold exactly
    ``installed`` (20,000 rules: tens of milliseconds, so on a thread)."""
    tables = parse_save(text)
    return tables, [t for t in TABLES if holds(tables, installed, lines, t)]


def _log_jumps(mode: str, family: IPFamily, missing: list[JumpRule], stale: list[str]) -> None:
    where = {"mode": mode, "family": family.label}
    if missing:
        log.info(
            "Installed jumps into uproxy chains", extra={"kv": {**where, "count": len(missing)}}
        )
    if stale:
        log.info(
            "Removed jumps of another configuration", extra={"kv": {**where, "count": len(stale)}}
        )


def _stacks(host_ip: str | Sequence[str], listen_ip: str | Sequence[str]) -> list[Stack]:
    try:
        return stacks(host_ip, listen_ip)
    except ValueError as exc:
        raise RulesError(str(exc)) from None


def _builder(stack: Stack, options: dict[str, Any], local: LocalTraffic) -> RuleBuilder:
    try:
        return RuleBuilder(host_ip=stack.host_ip, listen_ip=stack.listen_ip, **options, local=local)
    except ValueError as exc:
        raise RulesError(str(exc)) from None
