"""A rules program missing from PATH, in a real node namespace: ``--cleanup`` fails naming it
when the kernel has tables it would have to read (and removes what it can), says nothing when
there cannot be anything, and a start with ``--rules`` it needs stops with one line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.netns.helpers import nft, run_ops, save, sync_op
from tests.netns.test_rules import PORTALS
from tests.netns.topology import REPO, Topology

pytestmark = [pytest.mark.root]

STANDARD_PATH = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")


def path_without(tmp_path: Path, *hidden: str) -> str:
    """A PATH directory with a link to every program on the standard PATH but ``hidden``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for directory in STANDARD_PATH:
        if not os.path.isdir(directory) or os.path.islink(directory):
            continue
        for name in os.listdir(directory):
            target = os.path.join(directory, name)
            link = bin_dir / name
            if name in hidden or link.exists() or not os.access(target, os.X_OK):
                continue
            link.symlink_to(target)
    for name in hidden:
        assert shutil.which(name, path=str(bin_dir)) is None
    return str(bin_dir)


def uproxy(topo: Topology, path: str, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PATH": path}
    return subprocess.run(
        topo.exec_argv(topo.node, "env", f"PATH={path}", sys.executable, "-m", "uproxy.cli", *argv),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env=env,
    )


def errors(done: subprocess.CompletedProcess[str]) -> list[str]:
    assert "Traceback" not in done.stderr, done.stderr
    return [line for line in done.stderr.splitlines() if line.startswith("uproxy: error:")]


def test_cleanup_without_nft_names_it_and_removes_the_rest(topo: Topology, tmp_path: Path) -> None:
    run_ops(topo, "nftables", "nft", [sync_op(PORTALS)])
    run_ops(topo, "iptables-restore", "legacy", [sync_op(PORTALS)], sweep=False)
    done = uproxy(topo, path_without(tmp_path, "nft"), "--cleanup")
    assert done.returncode == 1
    assert errors(done) == [
        "uproxy: error: cleanup failed: nft not found: cannot remove table ip uproxy; "
        "install the nftables package"
    ]
    assert "table ip uproxy" in nft(topo, "list", "tables")  # still there, as said
    assert "KUBE-PORTALS" not in save(topo, "legacy")  # what it could remove, it did
    done = uproxy(topo, path_without(tmp_path / "all"), "--cleanup")
    assert (done.returncode, errors(done)) == (0, [])
    assert "uproxy" not in nft(topo, "list", "tables")


@pytest.mark.parametrize("mode", ["legacy", "nft"])
def test_cleanup_without_the_save_program_names_it(
    topo: Topology, tmp_path: Path, mode: str
) -> None:
    run_ops(topo, "iptables-restore", mode, [sync_op(PORTALS)])
    hidden = (f"iptables-{mode}-save", f"ip6tables-{mode}-save")
    done = uproxy(topo, path_without(tmp_path, *hidden), "--cleanup")
    assert done.returncode == 1
    assert errors(done) == [
        f"uproxy: error: cleanup failed: iptables-{mode}-save not found: cannot remove "
        f"uproxy's rules from the {mode} IPv4 nat and filter tables; install the iptables package"
    ]
    assert "KUBE-PORTALS-HOST" in save(topo, mode)
    done = uproxy(topo, path_without(tmp_path / "all"), "--cleanup")
    assert (done.returncode, errors(done)) == (0, [])
    assert "KUBE-PORTALS" not in save(topo, mode)


def test_cleanup_without_any_rules_program_where_there_is_nothing_succeeds(
    topo: Topology, tmp_path: Path
) -> None:
    # A fresh node namespace: no nf_tables table and no legacy table, so nothing of uproxy's.
    programs = ["nft"] + [
        f"{tool}-{mode}-{suffix}"
        for tool in ("iptables", "ip6tables")
        for mode in ("nft", "legacy")
        for suffix in ("save", "restore")
    ]
    done = uproxy(topo, path_without(tmp_path, *programs), "--cleanup")
    assert (done.returncode, errors(done)) == (0, []), done.stderr
    assert "No rules to remove" in done.stderr


@pytest.mark.parametrize(
    ("rules", "hidden", "reason"),
    [
        ("nftables", ("nft",), "nft is not installed (the nftables package)"),
        (
            "iptables-restore",
            ("iptables-nft-restore", "iptables-legacy-restore", "ip6tables-nft-restore",
             "ip6tables-legacy-restore"),
            "neither iptables-nft-restore nor iptables-legacy-restore is installed "
            "(the iptables package)",
        ),
    ],
)  # fmt: skip
def test_a_start_without_the_rules_program_stops_with_one_line_naming_it(
    topo: Topology, tmp_path: Path, rules: str, hidden: tuple[str, ...], reason: str
) -> None:
    services = tmp_path / "services.yaml"
    services.write_text("")
    argv = ["--services", str(services), "--rules", rules, "--healthz-bind-address", ""]
    argv += ["--metrics-bind-address", ""]
    done = uproxy(topo, path_without(tmp_path, *hidden), *argv)
    assert done.returncode == 1, done.stderr
    assert errors(done) == [
        f"uproxy: error: --rules {rules} cannot program rules here: {reason}; "
        "install it, or choose another --rules"
    ]


@pytest.mark.parametrize("rules", ["iptables-restore", "nftables", "iptables"])
def test_a_start_without_net_admin_stops_with_one_line(
    topo: Topology, tmp_path: Path, rules: str
) -> None:
    # Every rules program needs CAP_NET_ADMIN: without it uproxy used to retry for ever.
    services = tmp_path / "services.yaml"
    services.write_text("")
    drop = ["setpriv", "--bounding-set", "-net_admin", "--inh-caps", "-net_admin"]
    argv = [*drop, sys.executable, "-m", "uproxy.cli", "--services", str(services)]
    argv += ["--rules", rules, "--healthz-bind-address", "", "--metrics-bind-address", ""]
    done = subprocess.run(
        topo.exec_argv(topo.node, *argv),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 1, done.stderr
    assert errors(done) == [
        f"uproxy: error: --rules {rules} needs CAP_NET_ADMIN, which this process lacks; run as "
        "root or with CAP_NET_ADMIN (and CAP_NET_RAW for legacy iptables), or use --rules none"
    ]
