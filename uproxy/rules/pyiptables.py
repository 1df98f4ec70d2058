"""The ``iptables`` backend: python-iptables (libiptc) on the legacy tables.

For hosts that only have legacy iptables and small tables: it programs rules without the
iptables binaries (``check`` reads ``iptables-legacy-save``), but building a rule costs ~1 ms
of Python and it sees legacy tables only (nft rules are invisible to it and its rules show
only in ``iptables-legacy-save``).

python-iptables is synchronous and not thread-safe, so every call runs on ONE dedicated worker
thread, never on the event loop (building 1,000 rules on the loop stalled it for ~400 ms).
libiptc does not take the xtables lock, so each read-modify-commit holds ``/run/xtables.lock``
(``$XTABLES_LOCKFILE``) like the iptables binaries do; a commit after another writer changed
the table fails with EAGAIN, and is retried after re-reading the table. All changes to one
table are one batched commit (autocommit off): one commit per rule would cost minutes.

Syncs are incremental: the chains are edited from what the last sync installed to what is
wanted (a diff), with built ``iptc.Rule`` objects cached per rule, so one new service at
10,000 costs a few rules plus one table commit rather than 20,000 rebuilt rules. Whenever
that memory may be wrong (first sync, a failed commit, a failed ``check``, and at least once
an hour) the chains are rewritten whole.

Whether anything changed at all is read from the legacy tables' shape (``watch``): a sync of
the same portals with the tables as uproxy's own last commit left them does nothing (no 40 ms
table rewrite every periodic sync), and ``check`` runs ``iptables-legacy-save`` only when the
shape moved. The shape is taken still under the xtables lock, right after the commit.

IPv6 goes to the legacy ip6 tables (``iptc.Table6``, ``iptc.Rule6``; ``ip6tables-legacy-save``
shows them). One process can program one family only: libxtables up to 1.8.10 (Debian 12 has
1.8.9) registers an extension for the IP family that is current when its library is first
loaded, and the NAT targets (REDIRECT, DNAT) have one definition per family, so the second
family would never find them ("can't find target"), and loading them again aborts the
process. The first family the node serves therefore runs on the backend's worker thread, and
a second one in a child process of its own (started once, with ``spawn``: a fresh libxtables),
which runs the very same worker code.
"""

from __future__ import annotations

import asyncio
import difflib
import errno
import fcntl
import logging
import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from uproxy.lifeline import die_with_parent
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
from uproxy.rules.portals import (
    ALL_CHAINS,
    ANY_IPV4,
    CHAINS,
    TABLES,
    JumpRule,
    PortalRule,
    RuleBuilder,
    RuleSet,
    check_host_ip,
    insert_positions,
    mark_match,
    split_by_family,
    stacks,
)
from uproxy.rules.previous import Previous
from uproxy.rules.restore import program
from uproxy.rules.saved import OTHERS_SERVICE_CHAINS, matches, parse_save, warn_overtaken
from uproxy.rules.watch import FULL_SYNC_PERIOD_S, LegacyWatch, Token, Watch

log = logging.getLogger("uproxy.rules.pyiptables")

DEFAULT_LOCKFILE = "/run/xtables.lock"
LOCK_TIMEOUT_S = 10.0
COMMIT_ATTEMPTS = 5
_TABLE_NAMES = {IPFamily.V4: "/proc/net/ip_tables_names", IPFamily.V6: "/proc/net/ip6_tables_names"}


def lockfile_path() -> str:
    return os.environ.get("XTABLES_LOCKFILE") or DEFAULT_LOCKFILE


@contextmanager
def xtables_lock(*, timeout_s: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """Hold the xtables lock (blocking the calling worker thread, bounded)."""
    fd = os.open(lockfile_path(), os.O_CREAT | os.O_RDWR, 0o600)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RulesError(
                        f"another program holds {lockfile_path()} for more than {timeout_s:g}s"
                    ) from None
                time.sleep(0.01)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _import_iptc() -> Any:
    try:
        import iptc
    except ImportError as exc:
        raise RulesError(
            f"python-iptables cannot load ({exc}): use --rules iptables-restore or none"
        ) from None
    return iptc


def _translate(exc: Exception) -> RulesError:
    text = str(exc)
    if "Permission denied" in text or "must be root" in text or "not permitted" in text:
        return command.permission_error("python-iptables")
    return RulesError(f"python-iptables failed: {text}")


def _is_eagain(exc: Exception) -> bool:
    return "temporarily unavailable" in str(exc) or getattr(exc, "errno", None) == errno.EAGAIN


def _existing_tables(family: IPFamily) -> set[str]:
    try:
        with open(_TABLE_NAMES[family]) as fh:
            return {line.strip() for line in fh if line.strip()}
    except OSError:
        return set()


class _Worker:
    """Everything that touches libiptc for one family; runs only on the backend's single
    worker thread."""

    def __init__(self, family: IPFamily = IPFamily.V4) -> None:
        self.iptc = _import_iptc()
        self.family = family
        v6 = family is IPFamily.V6
        self.table_class: Any = self.iptc.Table6 if v6 else self.iptc.Table
        self.rule_class: Any = self.iptc.Rule6 if v6 else self.iptc.Rule
        self.cache: dict[PortalRule, tuple[Any, Any]] = {}
        # What the last successful sync left in each chain; None: unknown, rewrite whole.
        self.installed: dict[str, list[PortalRule]] | None = None

    def _entry(self, rule: PortalRule) -> tuple[Any, Any]:
        """The rule's raw libiptc entry (and its Rule), built and checked once per rule.

        python-iptables re-validates a Rule on every append (~0.5 ms: it re-parses its own
        saved text); handing libiptc the cached buffer skips that on every later sync.
        """
        cached = self.cache.get(rule)
        if cached is None:
            built = self._build(rule)
            built.final_check()
            cached = self.cache[rule] = (built.rule, built)
        return cached

    def _build(self, rule: PortalRule) -> Any:
        # Match.parse directly: attribute assignment does the same plus a dir() per call.
        r = self.rule_class()
        if rule.src is not None:
            r.src = rule.src
        if rule.dst is not None:
            r.dst = rule.dst
        if rule.in_interface is not None:
            r.in_interface = rule.in_interface
        if rule.protocol is not None:
            r.protocol = rule.protocol
        if rule.mark is not None:
            r.create_match("mark").parse("mark", mark_match(rule.mark))
        r.create_match("comment").parse("comment", rule.comment)
        if rule.protocol is not None and rule.dport is not None:
            r.create_match(rule.protocol).parse("dport", str(rule.dport))
        if rule.dports is not None:
            r.create_match("multiport").parse("dports", rule.dports)
        if rule.not_physdev_in:
            r.create_match("physdev").parse("physdev-is-in", "!")
        if rule.dst_local:
            r.create_match("addrtype").parse("dst-type", "LOCAL")
        if rule.state_new:
            r.create_match("state").parse("state", "NEW")
        if rule.dnat:
            r.create_match("conntrack").parse("ctstate", "DNAT")
        target = r.create_target(rule.target)
        if rule.to_ports is not None:
            target.parse("to-ports", rule.to_ports)
        if rule.to_destination is not None:
            target.parse("to-destination", rule.to_destination)
        if rule.reject_with is not None:
            target.parse("reject-with", rule.reject_with)
        return r

    def _jump(self, jump: JumpRule) -> Any:
        r = self.rule_class()
        if jump.dst is not None:
            r.dst = jump.dst
        if jump.protocol is not None:
            r.protocol = jump.protocol
            if jump.dports is not None:
                r.create_match(jump.protocol).dport = jump.dports
        if jump.ct_new:
            r.create_match("conntrack").ctstate = "NEW"
        if jump.not_dnat:
            r.create_match("conntrack").ctstate = "!DNAT"
        if jump.dst_local:
            r.create_match("addrtype").dst_type = "LOCAL"
        if jump.src_not_local:
            r.create_match("addrtype").src_type = "!LOCAL"
        r.create_match("comment").comment = jump.comment
        r.create_target(jump.target)
        return r

    def _scope_tables(self, names: set[str]) -> None:
        """Limit python-iptables' view to ``names``.

        To tell a jump to a chain from a target extension, python-iptables opens *every* table
        of the family, and opening a legacy table creates it (raw, mangle, security appear
        out of nowhere). Its per-class cache of "available" tables is the one knob: uproxy's
        chains and the jumps into them live only in nat and filter.
        """
        self.table_class.existing_table_names.update(
            {name: name in names for name in self.table_class.ALL}
        )

    def _table(self, name: str) -> Any:
        table = self.table_class(name)
        table.autocommit = False
        table.refresh()
        return table

    def _commit_with_retry(
        self, name: str, apply: Any, committed: Callable[[], None] | None = None
    ) -> None:
        """Apply and commit one table under the xtables lock; ``committed`` runs still under
        the lock, right after the commit (nobody who takes the lock can squeeze in)."""
        for attempt in range(1, COMMIT_ATTEMPTS + 1):
            try:
                with xtables_lock():
                    table = self._table(name)
                    apply(table)
                    table.commit()
                    if committed is not None:
                        committed()
                return
            except self.iptc.IPTCError as exc:
                if not _is_eagain(exc) or attempt == COMMIT_ATTEMPTS:
                    raise _translate(exc) from None
                log.debug("Table changed under us, retrying", extra={"kv": {"table": name}})

    def sync(self, ruleset: RuleSet, *, full: bool, watch: Watch | None = None) -> Token | None:
        """Make the chains ``ruleset``; returns the watch's token right after the last commit."""
        if full:
            self.installed = None
        self._scope_tables(set(TABLES))
        tokens: list[Token | None] = []

        def read_watch() -> None:
            if watch is not None:
                tokens.append(watch.mark_after_commit(None))

        try:
            for name in TABLES:
                last = read_watch if name == TABLES[-1] else None
                self._commit_with_retry(
                    name, lambda table, n=name: self._apply(table, n, ruleset), last
                )
        except BaseException:
            self.installed = None  # half-applied: the next sync rewrites everything
            raise
        self.installed = {chain: ruleset.rules_in_chain(chain) for chain in ALL_CHAINS}
        wanted = set(ruleset.rules)
        self.cache = {rule: r for rule, r in self.cache.items() if rule in wanted}
        return tokens[-1] if tokens else None

    def _apply(self, table: Any, name: str, ruleset: RuleSet) -> None:
        iptc = self.iptc
        for chain_name in CHAINS[name]:
            want = ruleset.rules_in_chain(chain_name)
            have = self.installed.get(chain_name) if self.installed is not None else None
            if not table.is_chain(chain_name):
                table.create_chain(chain_name)
                have = []
            chain = iptc.Chain(table, chain_name)
            if have is None:
                chain.flush()
                have = []
            self._edit(chain, have, want)
        jumps = ruleset.jumps_in(name)
        for chain_name in sorted({j.chain for j in jumps}):
            self._sync_jumps(
                iptc.Chain(table, chain_name), [j for j in jumps if j.chain == chain_name]
            )

    def _sync_jumps(self, chain: Any, jumps: list[JumpRule]) -> None:
        """Add the missing jumps of one built-in chain, and delete jumps into uproxy's chains
        that are not wanted (another configuration's, e.g. an old --nodeport-addresses) or
        not where they belong (below another proxy's service jump: inserted again first)."""
        built = {jump: self._jump(jump) for jump in jumps}
        present = []
        others_above = False
        for r in chain.rules:
            if r.target.name in OTHERS_SERVICE_CHAINS:
                others_above = True
            if r.target.name not in ALL_CHAINS:
                continue
            jump = next((j for j, b in built.items() if r == b), None)
            if jump is not None and not (jump.first and others_above):
                present.append(r)
            else:
                chain.delete_rule(r)
        missing = [j for j, b in built.items() if not any(b == r for r in present)]
        for jump, position in insert_positions(jumps, missing):
            if jump.first:
                chain.insert_rule(built[jump], position=position - 1)
            else:
                chain.append_rule(built[jump])

    def _edit(self, chain: Any, have: list[PortalRule], want: list[PortalRule]) -> None:
        """Turn the chain's rules from ``have`` into ``want`` with the fewest edits.

        Appending a rule costs ~0.5 ms of Python; rewriting 20,000 unchanged rules for one new
        service would cost 10 s, a diff costs the changed rules only. Edits run from the end of
        the chain backwards, so earlier positions stay valid.
        """
        if have == want:
            return
        table, name = chain.table, chain.name
        if not have:
            for rule in want:
                table.append_entry(name, self._entry(rule)[0])
            return
        matcher = difflib.SequenceMatcher(None, have, want, autojunk=False)
        for tag, i1, i2, j1, j2 in reversed(matcher.get_opcodes()):
            if tag == "equal":
                continue
            for rule in have[i1:i2]:
                entry, built = self._entry(rule)
                table.delete_entry(name, entry, built.mask)
            for offset, rule in enumerate(want[j1:j2]):
                table.insert_entry(name, self._entry(rule)[0], i1 + offset)

    def cleanup(self) -> bool:
        existing = _existing_tables(self.family)
        self._scope_tables(existing & set(TABLES))
        removed = False
        for name in TABLES:
            if name not in existing:
                continue  # opening a legacy table would create it
            with xtables_lock():
                table = self._table(name)
                changed = self._remove(table)
                if changed:
                    try:
                        table.commit()
                    except self.iptc.IPTCError as exc:
                        raise _translate(exc) from None
                removed = removed or changed
        self.cache = {}
        self.installed = None
        return removed

    def _remove(self, table: Any) -> bool:
        iptc = self.iptc
        changed = False
        for chain in table.chains:
            if chain.name in ALL_CHAINS:
                continue
            for r in chain.rules:
                if r.target.name in ALL_CHAINS:
                    chain.delete_rule(r)
                    changed = True
        for chain_name in CHAINS.get(table.name, ()):
            if table.is_chain(chain_name):
                iptc.Chain(table, chain_name).flush()
                table.delete_chain(chain_name)
                changed = True
        return changed


class IptcBackend:
    """Programs the portal rules with python-iptables on the legacy tables (ip and ip6)."""

    name = "iptables"

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
        watch: Watch | None = None,
        clock: Callable[[], float] = time.monotonic,
        leftovers: Leftovers = keep_leftovers,
        leftover_ports: LeftoverPorts = no_leftover_ports,
    ) -> None:
        del mode  # legacy tables only; accepted for a uniform constructor
        self._leftovers = leftovers
        self._leftover_ports = leftover_ports
        self._swept = False  # other backends' rules removed (after the first sync)
        self._options: dict[str, Any] = {
            "dial_mark": dial_mark,
            "nodeport_cidrs": tuple(nodeport_cidrs),
            "proxy_ports": proxy_ports,
        }
        try:
            self._stacks = {s.family: s for s in stacks(host_ip, listen_ip)}
        except ValueError as exc:
            raise RulesError(str(exc)) from None
        self._builders = {f: _builder(s, self._options, local) for f, s in self._stacks.items()}
        self.local = local
        self.previous_ports: Previous = {}  # what the last run's chains led to (``prepare``)
        first = next(iter(self._stacks.values()))
        self.host_ip = first.host_ip
        self.listen_ip = first.listen_ip
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="uproxy-iptc")
        self._child: Executor | None = None  # a second family's process
        self._workers: dict[IPFamily, _Worker] = {}
        self._lock = asyncio.Lock()
        self._installed: dict[IPFamily, RuleSet] = {}
        self._full = True  # rewrite whole chains on the next sync (first sync, failed check)
        versions = [f.value for f in self._stacks]
        self._watch = watch if watch is not None else LegacyWatch(versions=versions)
        self._committed: Token | None = None  # the watch's token right after our last commit
        self._clock = clock
        self._last_full = float("-inf")
        self.commits = 0
        self.saves = 0  # ip{,6}tables-legacy-save runs by check

    @property
    def families(self) -> tuple[IPFamily, ...]:
        return tuple(self._stacks)

    def set_local_traffic(self, local: LocalTraffic) -> None:
        if local != self.local:
            self._builders = {f: _builder(s, self._options, local) for f, s in self._stacks.items()}
            self.local = local

    def set_host_ip(self, family: IPFamily, host_ip: str) -> None:
        stack = self._stacks.get(family)
        if stack is None or stack.host_ip == host_ip:
            return
        check_host_ip(host_ip)
        self._stacks[family] = stack = replace(stack, host_ip=host_ip)
        self._builders[family] = _builder(stack, self._options, self.local)
        self.host_ip = next(iter(self._stacks.values())).host_ip

    async def _call(self, family: IPFamily, name: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``_Worker.name`` for ``family``: on the worker thread for the first family, in
        the child process for a second one (see the module docstring)."""
        loop = asyncio.get_running_loop()
        if family is next(iter(self._stacks)):
            with command.writing():  # both calls write (``sync``, ``cleanup``)
                return await loop.run_in_executor(
                    self._executor, self._in_thread, family, name, args, kwargs
                )
        if self._child is None:
            context = multiprocessing.get_context("spawn")
            self._child = ProcessPoolExecutor(1, context, _child_start, (family.value,))
        try:
            with command.writing():
                return await loop.run_in_executor(self._child, _child_call, name, args, kwargs)
        except BrokenProcessPool:
            self._child = None  # the next call starts a new one
            raise RulesError(
                f"the python-iptables process for {family.label} died; starting a new one"
            ) from None

    def _in_thread(
        self, family: IPFamily, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        worker = self._workers.get(family)
        if worker is None:
            worker = self._workers[family] = _Worker(family)
        return _run(worker, name, args, kwargs)

    def _build(self, portals: Collection[Portal]) -> dict[IPFamily, RuleSet]:
        split = split_by_family(portals, self._stacks)
        return {f: b.build(split[f]) for f, b in self._builders.items()}

    async def prepare(self) -> None:
        """Read the proxy ports the last run's chains lead to (``previous``; with the
        iptables programs when they are there), or those of the rules another backend left
        (removed after the first sync, ``Leftovers``)."""
        from uproxy.rules.restore import read_previous

        try:
            previous = await read_previous("legacy", self._stacks)
            await self._leftover_ports(
                previous, nft_tables=True, iptables_modes=["nft"], families=self._stacks
            )
            self.previous_ports = previous
        except (RulesError, OSError):
            self.previous_ports = {}

    async def sync(self, portals: Collection[Portal]) -> None:
        """Edit the chains by difference; nothing at all when neither the portals nor the
        tables changed since uproxy's last commit (see ``watch``)."""
        async with self._lock:
            try:
                rulesets = await asyncio.to_thread(self._build, portals)  # off the loop
            except ValueError as exc:
                raise RulesError(str(exc)) from None
            full = self._full or self._clock() - self._last_full >= FULL_SYNC_PERIOD_S
            changed = [f for f, r in rulesets.items() if r != self._installed.get(f)]
            if not full and not changed and self._untouched():
                return
            if not full and self._installed and self._watch.changed():
                full = not await self._inspect()  # edits need intact chains
            todo = list(rulesets) if full or not changed else changed
            await self._commit({f: rulesets[f] for f in todo}, full=full)
            self._full = False
            if not self._swept:  # this run's first rules are in (``Leftovers``)
                self._swept = True
                await self._leftovers(nft_tables=True, iptables_modes=["nft"])
            if full:
                self._last_full = self._clock()

    async def _commit(self, rulesets: dict[IPFamily, RuleSet], *, full: bool) -> None:
        """Each family's chains; the watch is read after the last family's commit."""
        self._committed = None
        self.commits += 1
        last = list(rulesets)[-1]
        try:
            for family, ruleset in rulesets.items():
                watch = self._watch if family is last else None
                token = await self._call(family, "sync", ruleset, full=full, watch=watch)
                self._installed[family] = ruleset
        except BaseException:
            self._watch.forget()
            raise
        self._watch.mark(token)  # a child process marked its own copy of the watch
        self._committed = token

    def _untouched(self) -> bool:
        return self._committed is not None and self._watch.read() == self._committed

    async def check(self) -> bool:
        """Whether jumps, chains and the number of rules in each chain are as last synced.

        Free while the legacy tables keep their shape since uproxy last looked (see
        ``watch``); otherwise complete (not just the jumps) because syncs here are
        incremental: a damaged chain must be found, and then the next sync rewrites it whole.
        A legacy save is cheap (~0.1 s at 20,000 rules).
        """
        async with self._lock:
            if not self._installed:
                return True
            if not self._watch.changed():
                return True
            return await self._inspect()

    async def _inspect(self) -> bool:
        """The real check: one legacy save per family; marks the watch when all is well."""
        token = self._watch.read()
        ok = True
        for family, installed in self._installed.items():
            self.saves += 1
            saved = await command.run([program(family, "legacy", "-save")])
            tables = parse_save(saved.stdout)
            warn_overtaken(tables, installed, mode="legacy", family=family.label)
            ok = ok and matches(tables, installed)
        if ok:
            self._watch.mark(token)
        else:
            self._full = True
        return ok

    async def verify(self) -> bool:
        """The real check, whatever the watch says."""
        async with self._lock:
            if not self._installed:
                return True
            return await self._inspect()

    async def cleanup(self) -> None:
        """Remove what this backend installs, in the families it serves (``--cleanup``
        removes every family's, with the restore programs)."""
        async with self._lock:
            for family in self._stacks:
                if await self._call(family, "cleanup"):
                    log.info(
                        "Removed iptables rules",
                        extra={"kv": {"mode": "legacy", "family": family.label}},
                    )
            self._installed = {}
            self._full = True
            self._committed = None
            self._watch.forget()

    async def close(self) -> None:
        async with self._lock:
            # A call its caller gave up on (a stop cancels the sync) goes on in the thread, up
            # to the xtables lock's wait: waited for off the loop, which relays meanwhile.
            await asyncio.to_thread(self._executor.shutdown, wait=True)
            if self._child is not None:
                await asyncio.to_thread(self._child.shutdown, wait=True)


def _run(worker: _Worker, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    try:
        return getattr(worker, name)(*args, **kwargs)
    except RulesError:
        raise
    except worker.iptc.IPTCError as exc:
        raise _translate(exc) from None


_child_worker: _Worker | None = None  # in a second family's child process


def _child_start(family: int) -> None:
    # The control process ends this one (it shuts the pool down after its last call); a
    # signal to the whole process group (Ctrl-C, systemd's stop) must not kill it while
    # the control process still needs it for its clean-up; and it must not outlive it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_parent(signal.SIGKILL)
    global _child_worker
    _child_worker = _Worker(IPFamily(family))


def _child_call(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if _child_worker is None:
        raise RulesError("python-iptables child process was not started")
    return _run(_child_worker, name, args, kwargs)


def _builder(stack: Stack, options: dict[str, Any], local: LocalTraffic) -> RuleBuilder:
    try:
        return RuleBuilder(host_ip=stack.host_ip, listen_ip=stack.listen_ip, **options, local=local)
    except ValueError as exc:
        raise RulesError(str(exc)) from None
