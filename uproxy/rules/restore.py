"""The ``iptables-restore`` backend: uproxy's chains replaced atomically, one commit per table.

Why restore and not one ``iptables`` call per rule: a sync of 10,000 portal rules takes about
0.1 s (legacy) / 0.3 s (nft) this way, against minutes rule by rule. The input names only
uproxy's chains (``--noflush``), and declaring a chain flushes it, so each table's share is
replaced in a single commit and nobody else's rules are touched. Jumps from the built-in chains
are read (``-S`` on the four built-in chains) and added in the same commit when missing, so a
sync also repairs a flushed table; jumps into uproxy's chains that the configuration no longer
has (an earlier ``--nodeport-addresses``) are deleted in that commit.

nft or legacy: chosen the way kube-proxy's image does it (iptables-wrappers' DetectMode), so
uproxy writes to the same variant as the kubelet; ``mode`` overrides it.

Reading rules costs processes, so a change detector (``watch``: the nf_tables generation, or
the shape of the legacy tables) decides when to read: ``check`` reads the four built-in
chains only when somebody committed something since uproxy last looked, a sync skips that
read when nothing changed since uproxy's own last commit, and a sync of the very rules that
commit installed, with nothing changed since, does nothing at all. At least once an hour a
sync reads and rewrites regardless, for what the watch cannot see.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Callable, Collection
from typing import Any

from uproxy.rules import command
from uproxy.rules.base import NO_LOCAL_TRAFFIC, LocalTraffic, Portal, RulesError
from uproxy.rules.portals import (
    ANY_IPV4,
    JUMP_CHAINS,
    TABLES,
    JumpRule,
    RuleBuilder,
    RuleSet,
    restore_payload,
)
from uproxy.rules.saved import (
    SavedTable,
    cleanup_payload,
    matches,
    missing_jumps,
    parse_save,
    stale_jumps,
)
from uproxy.rules.watch import FULL_SYNC_PERIOD_S, Token, Watch, watch_for

log = logging.getLogger("uproxy.rules.restore")

MODES = ("nft", "legacy")
_HINTS = ("KUBE-IPTABLES-HINT", "KUBE-KUBELET-CANARY")
LOCK_WAIT_S = 5


def _has_hint(save_output: str) -> bool:
    return any(f":{hint} " in save_output for hint in _HINTS)


async def detect_mode() -> str:
    """nft when the kubelet's hint chain is in nft mangle; legacy when it is in legacy; else nft.

    The legacy probe saves *all* tables: ``-t mangle`` would create the legacy mangle table.
    """
    if shutil.which("iptables-nft-save"):
        done = await command.run(["iptables-nft-save", "-t", "mangle"], check=False)
        if done.returncode == 0 and _has_hint(done.stdout):
            return "nft"
    if shutil.which("iptables-legacy-save"):
        done = await command.run(["iptables-legacy-save"], check=False)
        if done.returncode == 0 and _has_hint(done.stdout):
            return "legacy"
    return "nft"


async def save(mode: str) -> str:
    """Every table of ``mode`` (does not create legacy tables)."""
    return (await command.run([f"iptables-{mode}-save"])).stdout


async def builtin_rules(mode: str) -> dict[str, SavedTable]:
    """The rules of the built-in chains uproxy jumps from, as ``-A`` lines.

    ``-S CHAIN`` reads one chain: ~2 ms with nft at any number of services, where a full
    ``iptables-nft-save`` of 20,000 rules takes 0.7 s.
    """
    tables: dict[str, SavedTable] = {}
    for table, chain in JUMP_CHAINS:
        argv = [f"iptables-{mode}", "-w", str(LOCK_WAIT_S), "-t", table, "-S", chain]
        out = (await command.run(argv)).stdout
        lines = [line for line in out.splitlines() if line.startswith("-A ")]
        tables.setdefault(table, SavedTable(table)).chains[chain] = lines
    return tables


async def restore(mode: str, payload: str) -> None:
    await command.run(
        [f"iptables-{mode}-restore", "--noflush", "-w", str(LOCK_WAIT_S)], stdin=payload
    )


async def cleanup_mode(mode: str) -> bool:
    """Remove uproxy's jumps and chains from one variant; False when nothing was installed."""
    if not shutil.which(f"iptables-{mode}-save"):
        return False
    payload = cleanup_payload(parse_save(await save(mode)), delete_emptied_builtins=mode == "nft")
    if payload is None:
        return False
    await restore(mode, payload)
    log.info("Removed iptables rules", extra={"kv": {"mode": mode}})
    return True


class RestoreBackend:
    """Programs the portal rules with ``iptables-{nft,legacy}-restore``."""

    name = "iptables-restore"

    def __init__(
        self,
        *,
        host_ip: str,
        mode: str = "auto",
        listen_ip: str = ANY_IPV4,
        dial_mark: int = 0,
        nodeport_cidrs: Collection[str] = (),
        local: LocalTraffic = NO_LOCAL_TRAFFIC,
        watch_factory: Callable[[str], Watch] = watch_for,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if mode not in ("auto", *MODES):
            raise RulesError(f"unknown iptables mode {mode!r}: use auto, nft or legacy")
        self._options = {
            "host_ip": host_ip,
            "listen_ip": listen_ip,
            "dial_mark": dial_mark,
            "nodeport_cidrs": tuple(nodeport_cidrs),
        }
        self._builder = _builder(self._options, local)
        self.local = local
        self.host_ip = host_ip
        self.listen_ip = listen_ip
        self._requested_mode = mode
        self._mode: str | None = None if mode == "auto" else mode
        self._lock = asyncio.Lock()
        self._installed: RuleSet | None = None
        self._watch_factory = watch_factory
        self._watch: Watch | None = None
        self._committed: Token | None = None  # the watch's token right after our last restore
        self._clock = clock
        self._last_full = float("-inf")
        self.restores = 0
        self.reads = 0  # reads of the built-in chains (each is four processes)

    async def mode(self) -> str:
        """The variant in use (detected once, on first use)."""
        if self._mode is None:
            self._mode = await detect_mode()
            log.info("Using iptables mode", extra={"kv": {"mode": self._mode}})
        return self._mode

    def set_local_traffic(self, local: LocalTraffic) -> None:
        if local != self.local:
            self._builder = _builder(self._options, local)
            self.local = local

    async def _read_jumps(self, mode: str) -> dict[str, SavedTable]:
        self.reads += 1
        return await builtin_rules(mode)

    def watch(self, mode: str) -> Watch:
        if self._watch is None:
            self._watch = self._watch_factory(mode)
        return self._watch

    async def sync(self, portals: Collection[Portal]) -> None:
        async with self._lock:
            try:
                # Off the loop: the first build of 20,000 rules is ~0.4 s of Python (a thread
                # takes the GIL from the loop for at most the 5 ms switch interval at a time).
                ruleset = await asyncio.to_thread(self._builder.build, portals)
            except ValueError as exc:
                raise RulesError(str(exc)) from None
            mode = await self.mode()
            watch = self.watch(mode)
            full = self._clock() - self._last_full >= FULL_SYNC_PERIOD_S
            if not full and ruleset == self._installed and self._untouched(watch):
                return  # exactly what our last restore left, and nobody committed since
            stale: list[str] = []
            if full or watch.changed():
                before = watch.read()
                builtin = await self._read_jumps(mode)
                missing = missing_jumps(builtin, ruleset)
                stale = stale_jumps(builtin, ruleset)
            else:  # the jumps are as our last commit or check left them
                before, missing = watch.marked, []
            await self._restore(mode, ruleset, missing, before, stale)
            if full:
                self._last_full = self._clock()

    def _payload(self, ruleset: RuleSet, missing: list[JumpRule], stale: list[str]) -> str:
        lines = self._builder.lines
        return "".join(
            restore_payload(ruleset, t, missing_jumps=missing, stale_jumps=stale, lines=lines)
            for t in TABLES
        )

    def _untouched(self, watch: Watch) -> bool:
        return self._committed is not None and watch.read() == self._committed

    async def _restore(
        self,
        mode: str,
        ruleset: RuleSet,
        missing: list[JumpRule],
        before: Token | None,
        stale: list[str],
    ) -> None:
        payload = await asyncio.to_thread(self._payload, ruleset, missing, stale)
        watch = self.watch(mode)
        self._committed = None  # unknown until the commit is through
        try:
            self.restores += 1
            await restore(mode, payload)
        except RulesError:
            watch.forget()
            raise
        self._committed = watch.mark_after_commit(before, commits=1)
        self._installed = ruleset
        if missing:
            log.info(
                "Installed jumps into uproxy chains",
                extra={"kv": {"mode": mode, "count": len(missing)}},
            )
        if stale:
            log.info(
                "Removed jumps of another configuration",
                extra={"kv": {"mode": mode, "count": len(stale)}},
            )

    async def check(self) -> bool:
        """Whether the jumps into uproxy's chains are all in place.

        Free unless somebody committed a change since uproxy last looked (see ``watch``);
        then four short built-in chains are read. That notices what actually happens to
        nodes: a flushed table, a firewall reload, deleted chains (a chain cannot be deleted
        while a jump refers to it). A rule deleted by hand from inside uproxy's chains is not
        looked for: the watch saw a change, so the next sync rewrites those chains whole.
        ``verify`` compares everything.
        """
        async with self._lock:
            if self._installed is None:
                return True
            mode = await self.mode()
            watch = self.watch(mode)
            if not watch.changed():
                return True
            token = watch.read()
            builtin = await self._read_jumps(mode)
            ok = not missing_jumps(builtin, self._installed)
            ok = ok and not stale_jumps(builtin, self._installed)
            if ok:
                watch.mark(token)
            return ok

    async def verify(self) -> bool:
        """Full comparison of the installed chains with the last sync (reads every table)."""
        async with self._lock:
            if self._installed is None:
                return True
            return matches(parse_save(await save(await self.mode())), self._installed)

    async def cleanup(self) -> None:
        async with self._lock:
            for mode in MODES:
                await cleanup_mode(mode)
            self._installed = None
            self._committed = None
            if self._watch is not None:
                self._watch.forget()

    async def close(self) -> None:
        return None


def _builder(options: dict[str, Any], local: LocalTraffic) -> RuleBuilder:
    try:
        return RuleBuilder(**options, local=local)
    except ValueError as exc:
        raise RulesError(str(exc)) from None
