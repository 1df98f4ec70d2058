"""The change detectors on canned kernel replies, and how the backends use them to stay idle."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.garble import feed_garbled
from tests.rules.test_portals import HOST_IP, PORTALS
from uproxy.model import IPFamily
from uproxy.rules import RestoreBackend, RulesError, command
from uproxy.rules.portals import TABLES, RuleSet
from uproxy.rules.watch import (
    FULL_SYNC_PERIOD_S,
    GenerationWatch,
    LegacyWatch,
    Watch,
    getgen_request,
    getsetelem_request,
    gettable_dump_request,
    parse_element_reply,
    parse_generation,
    parse_getinfo,
    parse_tables,
    read_generation,
)

# An NFT_MSG_NEWGEN reply captured from the kernel: generation 3, pid 0x3781, name "python3".
NEWGEN = bytes.fromhex(
    "300000000f0a0000010000008137000000000003"
    "08000100000000030800020000003781"
    "0c000300707974686f6e3300"
)


def test_getgen_request_bytes() -> None:
    # nlmsghdr: len 20, type NFNL_SUBSYS_NFTABLES << 8 | NFT_MSG_GETGEN, NLM_F_REQUEST, seq 9.
    assert getgen_request(9) == struct.pack("=IHHII", 20, 0x0A10, 1, 9, 0) + bytes(4)


def test_generation_from_a_real_reply() -> None:
    assert parse_generation(NEWGEN) == 3
    bumped = NEWGEN[:24] + struct.pack(">I", 0xFFFFFFFF) + NEWGEN[28:]
    assert parse_generation(bumped) == 0xFFFFFFFF


def nlmsg(msg_type: int, body: bytes) -> bytes:
    return struct.pack("=IHHII", 16 + len(body), msg_type, 0, 1, 0) + body


@pytest.mark.parametrize(
    "reply",
    [
        b"",
        NEWGEN[:20],  # cut short
        nlmsg(2, struct.pack("=i", -1) + bytes(16)),  # NLMSG_ERROR: EPERM
        nlmsg(0x0A0F, bytes(4) + struct.pack("=HH", 8, 2) + bytes(4)),  # no NFTA_GEN_ID
        nlmsg(0x0A0F, bytes(4) + struct.pack("=HH", 6, 1) + bytes(2)),  # wrong attribute size
        struct.pack("=IHHII", 9999, 0x0A0F, 0, 1, 0),  # length beyond the data
    ],
)
def test_unexpected_replies_read_as_unknown(reply: bytes) -> None:
    assert parse_generation(reply) is None


def table_msg(family: int, name: bytes) -> bytes:
    """An NFT_MSG_NEWTABLE as the kernel dumps it: nfgenmsg, NFTA_TABLE_NAME, NFTA_TABLE_FLAGS."""
    raw = name + b"\0"
    attr = struct.pack("=HH", 4 + len(raw), 1) + raw + bytes(-len(raw) % 4)
    flags = struct.pack("=HH", 8, 2) + bytes(4)
    return nlmsg(0x0A00, struct.pack("=BBH", family, 0, 0) + attr + flags)


def test_tables_from_a_dump_in_parts() -> None:
    first = table_msg(1, b"other") + table_msg(2, b"uproxy")
    assert parse_tables(first) == ([(1, "other"), (2, "uproxy")], False)
    assert parse_tables(table_msg(10, b"nat") + nlmsg(3, bytes(4))) == ([(10, "nat")], True)
    assert parse_tables(nlmsg(2, struct.pack("=i", -1) + bytes(16))) is None  # EPERM
    assert parse_tables(table_msg(2, b"uproxy")[:-9]) is None  # cut short
    assert gettable_dump_request(5) == struct.pack("=IHHII", 20, 0x0A01, 0x301, 5, 0) + bytes(4)


def test_getsetelem_request_bytes() -> None:
    key = bytes(4) + b"\x06\0\0\0" + bytes(4)  # 0.0.0.0 . tcp . 0, each part padded to 4
    msg = getsetelem_request(3, 2, "uproxy", "node-ports", key)
    length, msg_type, flags, seq, _pid = struct.unpack_from("=IHHII", msg)
    assert (length, msg_type, flags, seq) == (len(msg), 0x0A0D, 1, 3)  # NFT_MSG_GETSETELEM
    assert msg[16:20] == struct.pack("=BBH", 2, 0, 0)  # NFPROTO_IPV4
    table = struct.pack("=HH", 11, 1) + b"uproxy\0" + bytes(1)
    name = struct.pack("=HH", 15, 2) + b"node-ports\0" + bytes(1)
    value = struct.pack("=HH", 16, 1) + key  # NFTA_DATA_VALUE
    elem = struct.pack("=HH", 24, 0x8001) + struct.pack("=HH", 20, 0x8001) + value
    elements = struct.pack("=HH", 28, 0x8003) + elem  # NFTA_SET_ELEM_LIST_ELEMENTS, nested
    assert msg[20:] == table + name + elements
    assert len(msg) % 4 == 0


def test_element_replies() -> None:
    assert parse_element_reply(nlmsg(0x0A0C, bytes(4))) is True  # NFT_MSG_NEWSETELEM
    assert parse_element_reply(nlmsg(2, struct.pack("=i", -2) + bytes(16))) is False  # ENOENT
    assert parse_element_reply(nlmsg(2, struct.pack("=i", -1) + bytes(16))) is None  # EPERM
    assert parse_element_reply(b"") is None
    assert parse_element_reply(nlmsg(0x0A0C, bytes(4))[:10]) is None


def test_reading_the_generation_never_raises() -> None:
    gen = read_generation()
    assert gen is None or isinstance(gen, int)


# struct ipt_getinfo of a legacy nat table with 5 rules (captured).
GETINFO = struct.pack(
    "=32sI5I5III", b"nat", 27, 0, 152, 0xFFFFFFFF, 304, 456, 0, 152, 0xFFFFFFFF, 304, 456, 5, 784
)


def test_getinfo_shape() -> None:
    shape = parse_getinfo(GETINFO)
    assert shape == (27, 0, 152, 0xFFFFFFFF, 304, 456, 0, 152, 0xFFFFFFFF, 304, 456, 5, 784)
    assert parse_getinfo(GETINFO[:40]) is None


def test_unreadable_is_always_changed() -> None:
    watch = Watch()
    watch.mark("anything")
    assert watch.changed() is True
    watch.forget()
    assert watch.changed() is True


def test_generation_watch_marks_only_its_own_commit() -> None:
    reads = iter([6, 6, 8, 8, 10])
    watch = GenerationWatch(lambda: next(reads))
    assert watch.changed() is True  # nothing marked yet (and nothing read)
    assert watch.mark_after_commit(5) == 6  # 5 before our commit, 6 after: ours alone
    assert watch.changed() is False  # reads 6
    assert watch.changed() is True  # reads 8: somebody committed
    assert watch.mark_after_commit(8) is None  # still 8: our commit did not show
    assert watch.marked is None
    assert watch.mark_after_commit(8) is None  # 10: somebody else committed as well
    assert watch.changed() is True


def test_generation_wraps() -> None:
    watch = GenerationWatch(lambda: 0)
    assert watch.mark_after_commit(0xFFFFFFFF) == 0


def test_generation_watch_unreadable() -> None:
    watch = GenerationWatch(lambda: None)
    assert watch.mark_after_commit(3) is None
    watch.mark(3)
    assert watch.changed() is True


@dataclass
class FakeLegacy:
    names: frozenset[str] | None = frozenset({"nat"})
    names6: frozenset[str] | None = frozenset()
    infos: dict[str, bytes | None] = field(default_factory=lambda: {"nat": GETINFO})
    asked: list[str] = field(default_factory=list)

    def info(self, table: str, version: int) -> bytes | None:
        self.asked.append(table if version == 4 else f"{table}6")
        return self.infos[table if version == 4 else f"{table}6"]


def legacy(fake: FakeLegacy, versions: tuple[int, ...] = (4,)) -> LegacyWatch:
    return LegacyWatch(
        names=lambda v: fake.names if v == 4 else fake.names6, info=fake.info, versions=versions
    )


def test_legacy_watch_never_asks_about_a_missing_table() -> None:
    # Asking creates a legacy table: filter is not listed, so it must not be asked about.
    fake = FakeLegacy()
    watch = legacy(fake)
    token = watch.read()
    assert token == ((4, "nat", parse_getinfo(GETINFO)), (4, "filter", None))
    assert fake.asked == ["nat"]


def test_legacy_watch_reads_the_ip6_tables_too() -> None:
    fake = FakeLegacy(names6=frozenset({"filter"}))
    fake.infos["filter6"] = GETINFO
    watch = legacy(fake, versions=(4, 6))
    watch.mark_after_commit(None)
    assert fake.asked == ["nat", "filter6"]  # ip6 nat does not exist: never asked
    assert watch.changed() is False
    fake.infos["filter6"] = GETINFO[:-8] + struct.pack("=II", 6, 936)  # an ip6tables rule
    assert watch.changed() is True


def test_legacy_watch_sees_a_changed_shape() -> None:
    fake = FakeLegacy()
    watch = legacy(fake)
    watch.mark_after_commit(None)
    assert watch.changed() is False
    fake.infos["nat"] = GETINFO[:-8] + struct.pack("=II", 6, 936)  # one more rule
    assert watch.changed() is True
    fake.infos["nat"] = GETINFO
    fake.names = frozenset({"nat", "filter"})  # a table appeared
    fake.infos["filter"] = GETINFO
    assert watch.changed() is True


@pytest.mark.parametrize("broken", ["names", "info"])
def test_legacy_watch_unreadable(broken: str) -> None:
    fake = FakeLegacy()
    watch = legacy(fake)
    watch.mark_after_commit(None)
    if broken == "names":
        fake.names = None
    else:
        fake.infos["nat"] = None
    assert watch.changed() is True


# ----- the restore backend, with iptables replaced by a recorder ---------------------------


@dataclass
class FakeIptables:
    calls: list[list[str]] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)  # what each restore was given
    fail_restores: int = 0  # this many restores fail from now on
    saved: str = ""  # what iptables-save prints

    async def run(self, argv: Any, *, stdin: str | None = None, **kwargs: Any) -> command.Completed:
        self.calls.append(list(argv))
        if str(argv[0]).endswith("-restore"):
            self.inputs.append(stdin or "")
            if self.fail_restores:
                self.fail_restores -= 1
                raise RulesError("iptables-nft-restore failed: line 2 failed")
        out = self.saved if str(argv[0]).endswith("-save") else ""
        return command.Completed(tuple(argv), 0, out, "")

    def programs(self) -> list[str]:
        return [argv[0] for argv in self.calls]


class Gen(Watch):
    def __init__(self) -> None:
        super().__init__()
        self.gen = 1

    def read(self) -> int:
        return self.gen

    def mark_after_commit(self, before: Any, commits: int = 1) -> Any:
        self.gen += commits
        if before != self.gen - commits:
            self.forget()
            return None
        self.mark(self.gen)
        return self.gen


@pytest.fixture
def iptables(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeIptables]:
    fake = FakeIptables()
    monkeypatch.setattr(command, "run", fake.run)
    yield fake


async def test_restore_backend_stays_idle_while_nothing_changes(iptables: FakeIptables) -> None:
    gen = Gen()
    now = [0.0]
    backend = RestoreBackend(
        host_ip=HOST_IP, mode="nft", watch_factory=lambda mode: gen, clock=lambda: now[0]
    )
    await backend.sync(PORTALS)
    reads = ["iptables-nft"] * 4  # nat PREROUTING and OUTPUT, filter INPUT and FORWARD
    first = len(reads) + 1
    assert iptables.programs() == [*reads, "iptables-nft-restore"]
    for _ in range(3):  # periodic syncs and checks: not one process
        await backend.sync(PORTALS)
        assert await backend.check() is True
    assert len(iptables.calls) == first
    # A new portal: restored without reading the jumps (nothing else committed).
    await backend.sync(PORTALS[:-1])
    assert iptables.programs()[first:] == ["iptables-nft-restore"]
    # Somebody commits: the check reads the jumps (the fake has none: missing), then the
    # sync reads everything (the fake: nothing of ours) and restores.
    gen.gen += 1
    assert await backend.check() is False
    await backend.sync(PORTALS[:-1])
    whole = ["iptables-nft-save", "iptables-nft-restore"]
    assert iptables.programs()[first + 1 :] == [*reads, *whole]
    # Once an hour everything is read, and rewritten where it differs.
    now[0] += FULL_SYNC_PERIOD_S
    await backend.sync(PORTALS[:-1])
    assert iptables.programs()[first + 3 + len(reads) :] == whole
    assert backend.restores == 4


async def test_dual_stack_restores_only_the_family_that_changed(iptables: FakeIptables) -> None:
    from tests.rules.test_portals import HOST6, SIX

    gen = Gen()
    backend = RestoreBackend(host_ip=[HOST_IP, HOST6], mode="nft", watch_factory=lambda m: gen)
    await backend.sync([*PORTALS, *SIX])
    reads = ["iptables-nft"] * 4 + ["ip6tables-nft"] * 4  # every family's jumps at first
    assert iptables.programs() == [*reads, "iptables-nft-restore", "ip6tables-nft-restore"]
    first = len(iptables.calls)
    # Both restores counted as our own commits: nothing to read or write now.
    await backend.sync([*PORTALS, *SIX])
    assert await backend.check() is True
    assert len(iptables.calls) == first
    # An IPv6 portal goes: only ip6tables-nft-restore runs.
    await backend.sync([*PORTALS, *SIX[:-1]])
    assert iptables.programs()[first:] == ["ip6tables-nft-restore"]
    assert await backend.check() is True  # one generation step, ours


def declares_chains(payload: str) -> bool:
    """Whether a restore input rewrites uproxy's chains (declaring a chain flushes it)."""
    return any(line.startswith(":KUBE-") for line in payload.splitlines())


async def test_small_changes_are_edits_foreign_commits_rewrite(iptables: FakeIptables) -> None:
    gen = Gen()
    backend = RestoreBackend(host_ip=HOST_IP, mode="nft", watch_factory=lambda m: gen)
    await backend.sync(PORTALS)
    assert declares_chains(iptables.inputs[-1])
    # The DNS portal goes: its two rules are deleted where they stand, nothing is read.
    calls = len(iptables.calls)
    await backend.sync(PORTALS[:-1])
    assert iptables.programs()[calls:] == ["iptables-nft-restore"]
    # And its proxy port's group of direct drops (UDP's only one) in the filter table.
    assert iptables.inputs[-1] == (
        "*nat\n-D KUBE-PORTALS-CONTAINER 2\n-D KUBE-PORTALS-HOST 2\nCOMMIT\n"
        "*filter\n-D KUBE-PORTALS-DIRECT 2\nCOMMIT\n"
    )
    assert backend.edits == 3
    assert await backend.check() is True  # one commit, ours: nothing to look at
    # Somebody else commits: the chains may not be as we left them; read, they are not
    # (the fake prints nothing of ours), so a rewrite.
    gen.gen += 1
    await backend.sync(PORTALS)
    assert declares_chains(iptables.inputs[-1])
    assert backend.edits == 3


def ours(backend: RestoreBackend) -> RuleSet:
    """The IPv4 rules the backend last installed."""
    ruleset = backend._families[IPFamily.V4].installed
    assert ruleset is not None
    return ruleset


def saved(ruleset: RuleSet) -> str:
    """What iptables-save prints for ``ruleset`` alone (and a rule of somebody else's)."""
    out = ["*nat", ":OTHER - [0:0]", "-A OTHER -j RETURN"]
    for table in TABLES:
        out += [] if table == "nat" else [f"*{table}"]
        for chain, lines in ruleset.save_lines(table).items():
            out += [f":{chain} - [0:0]", *lines]
        out.append("COMMIT")
    return "\n".join(out) + "\n"


async def test_after_a_foreign_commit_chains_read_as_ours_are_edited(
    iptables: FakeIptables,
) -> None:
    gen = Gen()
    now = [0.0]
    backend = RestoreBackend(
        host_ip=HOST_IP, mode="nft", watch_factory=lambda m: gen, clock=lambda: now[0]
    )
    await backend.sync(PORTALS)
    installed = ours(backend)
    iptables.saved = saved(installed)
    # Somebody else commits; uproxy's chains still read exactly as it left them. With no
    # change of its own, the sync reads them and writes nothing, and is idle after that.
    gen.gen += 1
    calls = len(iptables.calls)
    await backend.sync(PORTALS)
    assert iptables.programs()[calls:] == ["iptables-nft-save"]
    await backend.sync(PORTALS)
    assert len(iptables.calls) == calls + 1
    # Again, with a portal gone: edited in, not rewritten.
    gen.gen += 1
    await backend.sync(PORTALS[:-1])
    assert iptables.programs()[calls + 1 :] == ["iptables-nft-save", "iptables-nft-restore"]
    assert not declares_chains(iptables.inputs[-1]) and backend.edits == 3
    # A rule of uproxy's deleted by somebody else (and the hourly sync): a rewrite.
    iptables.saved = saved(ours(backend)).replace(installed.rules[0].save_line() + "\n", "")
    now[0] += FULL_SYNC_PERIOD_S
    await backend.sync(PORTALS[:-1])
    assert declares_chains(iptables.inputs[-1]) and backend.restores == 3


async def test_edits_that_may_have_gone_astray_are_rewritten(iptables: FakeIptables) -> None:
    gen = Gen()
    backend = RestoreBackend(host_ip=HOST_IP, mode="nft", watch_factory=lambda m: gen)
    await backend.sync(PORTALS)
    # Somebody commits between our last look and our edit (positions may have moved): the
    # generation moves by one more than our commit.
    own = gen.mark_after_commit

    def and_another(before: Any, commits: int = 1) -> Any:
        gen.gen += 1
        return own(before, commits)

    gen.mark_after_commit = and_another  # type: ignore[method-assign]
    await backend.sync(PORTALS[:-1])
    assert not declares_chains(iptables.inputs[-1])
    gen.mark_after_commit = own  # type: ignore[method-assign]
    calls = len(iptables.calls)
    assert await backend.check() is False  # without reading: a rewrite is due
    assert len(iptables.calls) == calls
    await backend.sync(PORTALS[:-1])  # the same portals, rewritten
    assert declares_chains(iptables.inputs[-1])
    assert await backend.check() is True
    # An edit the kernel refuses (a rule not where we left it): the syncer's retry rewrites.
    iptables.fail_restores = 1
    with pytest.raises(RulesError):
        await backend.sync(PORTALS)
    assert not declares_chains(iptables.inputs[-1])
    await backend.sync(PORTALS)
    assert declares_chains(iptables.inputs[-1])
    assert await backend.check() is True


def test_replies_cut_or_garbled_anywhere_never_raise() -> None:
    """Whatever comes back on the netlink socket (cut short, bytes changed or inserted, a
    length of zero), each parser answers or says unknown (None): it never raises, and never
    loops on a message that does not move it forward (20,000 seeded mutations of real
    replies)."""
    replies = [
        NEWGEN,
        table_msg(1, b"other") + table_msg(2, b"uproxy") + nlmsg(3, bytes(4)),
        nlmsg(0x0A0C, bytes(40)),  # NFT_MSG_NEWSETELEM
        nlmsg(2, struct.pack("=i", -2) + bytes(16)),  # NLMSG_ERROR: ENOENT
    ]

    def parse(data: bytes) -> None:
        for parser in (parse_generation, parse_tables, parse_element_reply, parse_getinfo):
            parser(data)

    feed_garbled(parse, replies, seed=7)
