"""Shared pieces of the namespace tests: running the driver, reading iptables-save."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Collection
from typing import Any

import pytest

from tests.netns.driver import portal_to_json
from tests.netns.topology import REPO, Topology
from uproxy.rules.base import Portal

# (backend name, iptables variant it writes)
BACKENDS = [
    pytest.param("iptables-restore", "nft", id="restore-nft"),
    pytest.param("iptables-restore", "legacy", id="restore-legacy"),
    pytest.param("iptables", "legacy", id="python-iptables"),
]

NFTABLES = pytest.param("nftables", "nft", id="nftables")
# Every kernel backend: the iptables ones and uproxy's own nft table.
ALL_BACKENDS = [*BACKENDS, NFTABLES]

# Someone else's rules, present before uproxy starts: they must survive every operation.
FOREIGN = """\
*filter
:OTHER - [0:0]
-A INPUT -j OTHER
-A OTHER -p tcp -m tcp --dport 22 -j ACCEPT
COMMIT
*nat
:OTHER-NAT - [0:0]
-A PREROUTING -p tcp -m tcp --dport 2222 -j DNAT --to-destination 10.200.2.2:22
-A OUTPUT -j OTHER-NAT
-A POSTROUTING -s 10.200.0.0/16 -o eth0 -j MASQUERADE
COMMIT
"""


# The same in IPv6 (ip6tables), for dual-stack nodes.
FOREIGN6 = """\
*filter
:OTHER6 - [0:0]
-A INPUT -j OTHER6
-A OTHER6 -p tcp -m tcp --dport 22 -j ACCEPT
COMMIT
*nat
:OTHER6-NAT - [0:0]
-A PREROUTING -p tcp -m tcp --dport 2222 -j DNAT --to-destination [fd00:200:2::2]:22
-A OUTPUT -j OTHER6-NAT
-A OTHER6-NAT -p tcp -m tcp --dport 2222 -j DNAT --to-destination [fd00:200:2::2]:22
COMMIT
"""


def sync_op(portals: Collection[Portal]) -> dict[str, Any]:
    return {"op": "sync", "portals": [portal_to_json(p) for p in sorted(portals)]}


# The mark uproxy puts on its own dials by default (--dial-mark): the host chains return on it.
DIAL_MARK = 0x1000


def run_ops(
    topo: Topology,
    backend: str,
    mode: str,
    ops: list[dict[str, Any]],
    *,
    ns: str | None = None,
    dial_mark: int = DIAL_MARK,
    nodeport_cidrs: tuple[str, ...] = (),
    local: dict[str, Any] | None = None,
    host_ips: tuple[str, ...] | None = None,
    sweep: bool = True,
) -> list[Any]:
    """Run ``ops`` with one backend instance inside the node; fail on any error.

    ``nodeport_cidrs`` and ``local`` (LocalTraffic's fields) configure the backend as
    --nodeport-addresses and --detect-local-mode would; ``host_ips`` are the node addresses
    of the families it serves (default: the node's IPv4 address, and its IPv6 one on a
    dual-stack topology). ``sweep``: False leaves other backends' rules in place (a
    backend removes them after its first sync).
    """
    if host_ips is None:
        host_ips = (topo.node_ip, topo.node_ip6) if topo.ipv6 else (topo.node_ip,)
    spec = {
        "name": backend,
        "mode": mode,
        "host_ip": list(host_ips),
        "dial_mark": dial_mark,
        "nodeport_cidrs": list(nodeport_cidrs),
        "local": local or {},
        "sweep": sweep,
    }
    script = {"backend": spec, "ops": ops}
    done = subprocess.run(
        topo.python_argv(ns or topo.node, "tests.netns.driver"),
        input=json.dumps(script),
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    results: list[dict[str, Any]] = json.loads(done.stdout)
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, errors
    assert len(results) == len(ops)
    return [r["ok"] for r in results]


def save(topo: Topology, mode: str) -> str:
    return topo.run(topo.node, f"iptables-{mode}-save")


def save6(topo: Topology, mode: str) -> str:
    return topo.run(topo.node, f"ip6tables-{mode}-save")


def install_foreign(topo: Topology, mode: str) -> None:
    topo.run(topo.node, f"iptables-{mode}-restore", "--noflush", stdin=FOREIGN)


def install_foreign6(topo: Topology, mode: str) -> None:
    topo.run(topo.node, f"ip6tables-{mode}-restore", "--noflush", stdin=FOREIGN6)


def shell_op(*argv: str, stdin: str | None = None) -> dict[str, Any]:
    """The driver's operation that runs ``argv`` in the node (its stdout is the result)."""
    return {"op": "shell", "argv": list(argv), "stdin": stdin}


# The rule of chain synced-by names the process and commit that wrote the table.
STAMP = re.compile(r'return comment "uproxy [0-9a-f]+ commit [0-9]+"')
STAMP_MASKED = 'return comment "uproxy ID commit N"'


def nft_normalised(listing: str) -> str:
    """``nft list`` output without layout: stripped lines, no blank ones, and each
    ``elements = { ... }`` block on one line in sorted order (nft lists a hash in its own
    order), so two listings compare as text; the stamp's process and commit are masked."""
    out: list[str] = []
    pending: list[str] | None = None
    for raw in listing.splitlines():
        line = STAMP.sub(STAMP_MASKED, raw.strip())
        if not line:
            continue
        if pending is None and line.startswith("elements = {"):
            pending = [line[len("elements = {") :]]
        elif pending is not None:
            pending.append(line)
        else:
            out.append(line)
            continue
        if pending[-1].endswith("}"):
            body = " ".join(pending)[:-1]
            members = sorted(m.strip() for m in body.split(",") if m.strip())
            out.append("elements = { " + ", ".join(members) + " }")
            pending = None
    return "\n".join(out) + "\n"


def nft(topo: Topology, *args: str) -> str:
    return topo.run(topo.node, "nft", *args)
