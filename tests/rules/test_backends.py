"""Backend selection and the one-line errors a user sees without privileges or binaries."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from uproxy.model import Protocol, ServicePortName
from uproxy.rules import (
    BACKEND_NAMES,
    IptcBackend,
    NftablesBackend,
    NoRules,
    Portal,
    PortalKind,
    RestoreBackend,
    RulesError,
    command,
    make_backend,
)
from uproxy.settings import RULES_BACKENDS


def test_factory_names() -> None:
    assert isinstance(make_backend("auto", host_ip="10.0.0.1"), RestoreBackend)
    assert isinstance(make_backend("iptables-restore", host_ip="10.0.0.1"), RestoreBackend)
    assert isinstance(make_backend("iptables", host_ip="10.0.0.1"), IptcBackend)
    assert isinstance(make_backend("none", host_ip="10.0.0.1"), NoRules)
    assert isinstance(make_backend("nftables", host_ip="10.0.0.1"), NftablesBackend)
    assert BACKEND_NAMES == RULES_BACKENDS  # every --rules choice has a backend
    with pytest.raises(RulesError, match="unknown rules backend 'ipvs'"):
        make_backend("ipvs", host_ip="10.0.0.1")
    with pytest.raises(RulesError, match="unknown iptables mode"):
        make_backend("auto", host_ip="10.0.0.1", iptables_mode="xt")


async def test_missing_binary_is_one_clear_line() -> None:
    with pytest.raises(RulesError, match=r"^no-such-iptables not found: .*--rules none$"):
        await command.run(["no-such-iptables"])


async def test_failure_reports_first_line() -> None:
    with pytest.raises(RulesError, match="sh failed: boom"):
        await command.run(["sh", "-c", "echo boom >&2; echo more >&2; exit 3"])


# What iptables 1.8 prints when another program held the xtables lock past its ``-w`` wait.
LOCK_HELD = (
    "Can't lock /run/xtables.lock: Resource temporarily unavailable\n"
    "Another app is currently holding the xtables lock. Stopped waiting after 5s.\n"
)


async def test_a_lock_held_by_another_program_is_named_as_such() -> None:
    """The first line alone read as a kernel resource running out, not as a wait for another
    writer (a CNI plugin, the kubelet) that the next sync retries."""
    script = f"printf '%s' \"{LOCK_HELD}\" >&2; exit 4"
    with pytest.raises(RulesError) as raised:
        await command.run(["sh", "-c", script])
    assert str(raised.value) == (
        "sh failed: another program holds /run/xtables.lock (the xtables lock) for more than 5s"
    )


async def test_a_program_that_exits_before_reading_its_input_says_why() -> None:
    """The error was uvloop's "unable to perform operation on <WriteUnixTransport
    closed=True>; the handler is closed", the program's own line lost."""
    rules = "*filter\n" + "-A INPUT -j ACCEPT\n" * 100_000  # more than a pipe holds
    with pytest.raises(RulesError, match=r"^sh failed: Error: injected failure$"):
        await command.write(["sh", "-c", "echo 'Error: injected failure' >&2; exit 1"], stdin=rules)


async def test_a_program_killed_by_a_signal_is_named_by_it() -> None:
    with pytest.raises(RulesError, match=r"^sh failed: killed by SIGSEGV$"):
        await command.run(["sh", "-c", "kill -SEGV $$"])


async def test_permission_denied_says_how_to_fix() -> None:
    with pytest.raises(RulesError, match="permission denied; run as root or with CAP_NET_ADMIN"):
        await command.run(["sh", "-c", "echo 'Permission denied (you must be root)' >&2; exit 4"])


@pytest.mark.skipif(os.geteuid() == 0, reason="checks the unprivileged error path")
async def test_unprivileged_sync_fails_clearly() -> None:
    backend = RestoreBackend(host_ip="10.0.0.1", mode="nft")
    portal = Portal(
        ServicePortName("a", "b", "c", Protocol.TCP), PortalKind.CLUSTER_IP, "10.96.0.1", 80, 4000
    )
    with pytest.raises(RulesError, match="run as root or with CAP_NET_ADMIN"):
        await backend.sync([portal])


async def test_invalid_portal_is_rules_error() -> None:
    backend = RestoreBackend(host_ip="10.0.0.1", mode="nft")
    portal = Portal(
        ServicePortName("a", "b", "c", Protocol.TCP), PortalKind.CLUSTER_IP, None, 80, 4000
    )
    with pytest.raises(RulesError, match="has no address"):
        await backend.sync([portal])


async def test_a_program_that_hangs_is_killed_and_is_one_line(tmp_path: Path) -> None:
    """A rules program stuck (say, behind a lock another tool holds): given up at the
    deadline with one line, and killed, not left behind."""
    pid_file = tmp_path / "pid"
    script = f"echo $$ > {pid_file}; exec sleep 60"
    hung = command.run(["sh", "-c", script], stdin="*nat\nCOMMIT\n", timeout_s=0.3)
    with pytest.raises(RulesError, match=r"^sh did not finish within 0.3s$"):
        await asyncio.wait_for(hung, 10)  # not killed: it would wait out the sleep
    pid = int(pid_file.read_text())
    assert not Path(f"/proc/{pid}").exists()  # killed and reaped


async def test_a_program_whose_caller_is_cancelled_is_killed(tmp_path: Path) -> None:
    """A stop cancels the sync that runs a rules program: the program goes with it. Left
    running, a whole load of the nft table committed after the stop's cleanup
    (--cleanup-on-exit), and the node kept rules to ports nobody listened on."""
    pid_file = tmp_path / "pid"
    script = f"echo $$ > {pid_file}; exec sleep 60"
    task = asyncio.ensure_future(command.write(["sh", "-c", script], stdin="*nat\nCOMMIT\n"))
    for _ in range(500):
        if pid_file.exists() and pid_file.read_text().strip():
            break
        await asyncio.sleep(0.01)
    pid = int(pid_file.read_text())
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)
    assert not Path(f"/proc/{pid}").exists()  # killed and reaped before the caller goes on


async def test_a_cleanup_refused_everywhere_is_one_line_with_one_hint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each program refused (a sandbox that denies what CAP_NET_ADMIN would allow): named
    once each, the way to fix it said once, and no "--rules none", which does not clean."""
    from uproxy.model import IPFamily
    from uproxy.rules import cleanup_all, nftables, restore

    async def refused_tables() -> bool:
        raise command.permission_error("nft")

    async def refused_mode(mode: str, family: IPFamily = IPFamily.V4) -> bool:
        raise command.permission_error(
            f"ip{'6' if family is IPFamily.V6 else ''}tables-{mode}-save"
        )

    monkeypatch.setattr(command, "has_net_admin", lambda: True)
    monkeypatch.setattr(nftables, "cleanup_tables", refused_tables)
    monkeypatch.setattr(restore, "cleanup_mode", refused_mode)
    with pytest.raises(RulesError) as caught:
        await cleanup_all()
    said = str(caught.value)
    assert said == (
        "nft, iptables-nft-save, ip6tables-nft-save, iptables-legacy-save, "
        f"ip6tables-legacy-save: permission denied; {command.PRIVILEGE_FIX}"
    )


@pytest.mark.root
def test_cleanup_without_privileges_says_so_in_one_line(tmp_path: Path) -> None:
    """``uproxy --cleanup`` run without CAP_NET_ADMIN (root with every capability bounded
    away, as a container without them): exit status 1 and one line."""
    import subprocess
    import sys

    done = subprocess.run(
        ["setpriv", "--no-new-privs", "--bounding-set", "-all", "--",
         sys.executable, "-m", "uproxy.cli", "--cleanup"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines() == [
        f"uproxy: error: cleanup failed: this process lacks CAP_NET_ADMIN; {command.PRIVILEGE_FIX}"
    ], done.stderr
