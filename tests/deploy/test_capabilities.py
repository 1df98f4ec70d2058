"""The DaemonSet's capabilities are enough, and needed: uproxy run with exactly the
``securityContext`` of the shipped manifest (those capabilities, no privilege escalation)
reads and rewrites both iptables variants; without NET_RAW the legacy variant is refused.

Each case runs in a throwaway network namespace (``unshare --net``), so the host's rules are
never touched and nothing is left behind when the shell exits.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys

import pytest

from uproxy.model import Protocol, ServicePortName
from uproxy.rules.base import Portal, PortalKind
from uproxy.rules.portals import build_rules

from .manifests import DEPLOY, REPO, container, find, load

pytestmark = pytest.mark.root

BUILTIN = {"PREROUTING", "INPUT", "OUTPUT", "POSTROUTING", "FORWARD"}


def _daemonset_capabilities() -> list[str]:
    sc = container(find(load(DEPLOY / "uproxy.yaml"), "DaemonSet", "uproxy"))["securityContext"]
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert sc["allowPrivilegeEscalation"] is False
    return [c.lower() for c in sc["capabilities"]["add"]]


def _installed_rules() -> str:
    """iptables-restore input with uproxy's chains and jumps for one ClusterIP portal."""
    spn = ServicePortName("default", "web", "http", Protocol.TCP)
    rules = build_rules(
        [Portal(spn, PortalKind.CLUSTER_IP, "10.96.0.10", 80, 40000)], host_ip="10.0.0.1"
    )
    lines = [line for chain in rules.save_lines("nat").values() for line in chain]
    chains = {w.split()[0] for line in lines for w in line.split("-j ")[1:]} | {
        line.split()[1] for line in lines
    }
    declared = [f":{c} - [0:0]" for c in sorted(chains - BUILTIN) if c.startswith("KUBE-")]
    return "\n".join(["*nat", *declared, *lines, "COMMIT", ""])


def _run_in_netns(capabilities: list[str]) -> tuple[subprocess.CompletedProcess[str], str]:
    payload = _installed_rules()
    bounding = ",".join(["-all", *(f"+{c}" for c in capabilities)])
    uproxy = [sys.executable, "-m", "uproxy.cli", "--cleanup"]
    script = f"""
set -e
ip link set lo up
printf '%s' {shlex.quote(payload)} | iptables-nft-restore --noflush
printf '%s' {shlex.quote(payload)} | iptables-legacy-restore --noflush
echo "before nft=$(iptables-nft-save -t nat | grep -c KUBE-PORTALS) \
legacy=$(iptables-legacy-save -t nat | grep -c KUBE-PORTALS)"
rc=0
setpriv --no-new-privs --bounding-set {bounding} -- {shlex.join(uproxy)} || rc=$?
echo "rc=$rc nft=$(iptables-nft-save -t nat | grep -c KUBE- || true) \
legacy=$(iptables-legacy-save -t nat | grep -c KUBE- || true)"
"""
    done = subprocess.run(
        ["unshare", "--net", "--", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    return done, done.stdout.strip().splitlines()[-1]


def _tools_missing() -> list[str]:
    need = ("unshare", "setpriv", "iptables-nft-restore", "iptables-legacy-restore")
    return [t for t in need if shutil.which(t) is None]


def test_daemonset_capabilities_manage_both_iptables_variants() -> None:
    assert not _tools_missing(), f"missing tools: {_tools_missing()}"
    caps = _daemonset_capabilities()
    assert caps == ["net_admin", "net_raw", "sys_nice", "sys_resource", "net_bind_service"]
    done, result = _run_in_netns(caps)
    assert "before nft=6 legacy=6" in done.stdout, done.stdout
    assert result == "rc=0 nft=0 legacy=0", done.stdout + done.stderr


def test_without_net_raw_legacy_iptables_is_refused() -> None:
    assert not _tools_missing(), f"missing tools: {_tools_missing()}"
    done, result = _run_in_netns(["net_admin"])
    assert result.startswith("rc=1 "), done.stdout + done.stderr
    assert "legacy=0" not in result  # the legacy rules could not be removed
    errors = [line for line in done.stderr.splitlines() if line.startswith("uproxy: error:")]
    assert len(errors) == 1 and "iptables-legacy" in errors[0] and "permission denied" in errors[0]


def _bind_low_port(capabilities: list[str]) -> subprocess.CompletedProcess[str]:
    """Hold TCP port 80 as uproxy holds a node port, with only ``capabilities``."""
    bounding = ",".join(["-all", *(f"+{c}" for c in capabilities)])
    hold = "import socket; s = socket.socket(); s.bind(('0.0.0.0', 80)); s.listen(); print('held')"
    script = f"setpriv --no-new-privs --bounding-set {bounding} -- {sys.executable} -c {shlex.quote(hold)}"
    return subprocess.run(
        ["unshare", "--net", "--", "sh", "-c", script], capture_output=True, text=True, timeout=60
    )


def test_daemonset_capabilities_hold_node_ports_below_1024() -> None:
    """Some clusters give node ports (and so health-check node ports) below 1024: without
    NET_BIND_SERVICE every such port failed with "Permission denied" on every node."""
    assert not _tools_missing(), f"missing tools: {_tools_missing()}"
    held = _bind_low_port(_daemonset_capabilities())
    assert held.stdout.strip() == "held", held.stderr
    refused = _bind_low_port([c for c in _daemonset_capabilities() if c != "net_bind_service"])
    assert "Permission denied" in refused.stderr, refused.stdout + refused.stderr
