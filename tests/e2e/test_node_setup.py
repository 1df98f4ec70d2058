"""kube-proxy's node settings on a real node namespace: ``uproxy --init-only`` raises the
conntrack timeouts there (and never lowers them), fails with one line where it may not write
(the table size belongs to the host's first namespace), and uproxy itself says in one line
what it could not set, takes its OOM score, and serves.

Every value read or written here is the node namespace's own (``ip netns exec``); the host's
are read before and after to show they never moved.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.cluster import Cluster
from tests.e2e.conftest import StartProc, StartUproxy
from tests.e2e.harness import ServicesFile, curl, slice_endpoint
from tests.e2e.manifests import WEB_IP, backend_argv, web_service, web_slice

pytestmark = [pytest.mark.root]

NETFILTER = "/proc/sys/net/netfilter/"
TIMEOUTS = (
    "nf_conntrack_tcp_timeout_established",
    "nf_conntrack_tcp_timeout_close_wait",
    "nf_conntrack_tcp_be_liberal",
    "nf_conntrack_udp_timeout",
    "nf_conntrack_udp_timeout_stream",
)
GLOBAL = (
    "/proc/sys/net/netfilter/nf_conntrack_max",
    "/sys/module/nf_conntrack/parameters/hashsize",
)


def node_values(net: Cluster) -> dict[str, int]:
    paths = [NETFILTER + name for name in TIMEOUTS]
    out = net.topo.run(net.topo.node, "cat", *paths).split()
    return dict(zip(TIMEOUTS, map(int, out), strict=True))


def host_values() -> dict[str, int]:
    return {p: int(Path(p).read_text()) for p in (*GLOBAL, *(NETFILTER + n for n in TIMEOUTS))}


def init_only(net: Cluster, *flags: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "uproxy.cli", "--init-only", *flags]
    proc = net.topo.popen(net.topo.node, argv)
    out, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def test_init_only_raises_the_node_namespaces_timeouts_and_never_lowers_them(
    net: Cluster,
) -> None:
    host = host_values()
    before = node_values(net)
    assert before["nf_conntrack_tcp_timeout_close_wait"] < 7200, before  # the kernel's 60 s
    flags = [
        "--conntrack-tcp-timeout-established=1h",  # the kernel's 5 days are longer: kept
        "--conntrack-tcp-timeout-close-wait=2h",
        "--conntrack-tcp-be-liberal",
        f"--conntrack-udp-timeout={before['nf_conntrack_udp_timeout'] + 15}s",
        f"--conntrack-udp-timeout-stream={before['nf_conntrack_udp_timeout_stream'] + 60}s",
    ]
    done = init_only(net, *flags)
    assert done.returncode == 0, done.stderr
    said = [line.split("setting=")[1].split()[0] for line in done.stderr.splitlines()]
    assert said == [  # one line for each value raised, as kube-proxy logs its own
        '"net/netfilter/nf_conntrack_tcp_timeout_close_wait"',
        '"net/netfilter/nf_conntrack_tcp_be_liberal"',
        '"net/netfilter/nf_conntrack_udp_timeout"',
        '"net/netfilter/nf_conntrack_udp_timeout_stream"',
    ]
    raised = {
        "nf_conntrack_tcp_timeout_established": before["nf_conntrack_tcp_timeout_established"],
        "nf_conntrack_tcp_timeout_close_wait": 7200,
        "nf_conntrack_tcp_be_liberal": 1,
        "nf_conntrack_udp_timeout": before["nf_conntrack_udp_timeout"] + 15,
        "nf_conntrack_udp_timeout_stream": before["nf_conntrack_udp_timeout_stream"] + 60,
    }
    assert node_values(net) == raised
    # Shorter values later change nothing: a node's longer settings are kept.
    done = init_only(net, "--conntrack-tcp-timeout-close-wait=30m")
    assert (done.returncode, done.stderr) == (0, "")
    assert node_values(net) == raised
    assert host_values() == host  # the host's namespace never moved


def test_init_only_that_may_not_raise_the_table_fails_with_one_line(net: Cluster) -> None:
    host = host_values()
    done = init_only(net, "--conntrack-min=100000000", "--conntrack-tcp-timeout-close-wait=2h")
    assert done.returncode == 1
    lines = [line for line in done.stderr.splitlines() if not line.startswith("I")]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("uproxy: error: cannot tune conntrack: ")
    assert "net/netfilter/nf_conntrack_max: cannot raise it from" in lines[0]
    assert "to 100000000: Permission denied" in lines[0]
    assert "hashsize: cannot raise it" in lines[0]
    # What it may write, it did.
    assert node_values(net)["nf_conntrack_tcp_timeout_close_wait"] == 7200
    assert host_values() == host


def test_uproxy_says_what_it_could_not_set_takes_its_oom_score_and_serves(
    net: Cluster,
    services: ServicesFile,
    start_proc: StartProc,
    start_uproxy: StartUproxy,
    tmp_path: Path,
) -> None:
    topo = net.topo
    host = host_values()
    start_proc(topo.backend, backend_argv(net), ready_line=True)
    services.put(
        web_service(),
        web_slice("web-a", "web", [slice_endpoint(ip) for ip in net.backend_ips]),
    )
    services.write()
    # Raising a score needs no privilege (lowering it would: CAP_SYS_RESOURCE).
    proxy = start_uproxy(
        "nftables",
        extra=[
            "--conntrack-min=100000000",
            "--conntrack-tcp-timeout-close-wait=2h",
            "--oom-score-adj=500",
            "--workers=2",
        ],
    )
    proxy.wait_synced()
    answers = curl(topo, topo.pod, f"http://{WEB_IP}/", body=b"x" * 100_000, tmp=tmp_path, count=4)
    assert {a.name for a in answers} <= {f"web-{i}" for i in range(1, len(net.backend_ips) + 1)}
    warned = [line for line in proxy.proc.stderr_lines if "Cannot tune conntrack" in line]
    assert len(warned) == 1 and warned[0].startswith("W"), proxy.proc.stderr_lines
    assert "nf_conntrack_max: cannot raise it" in warned[0]
    assert node_values(net)["nf_conntrack_tcp_timeout_close_wait"] == 7200
    control = proxy.proc.popen.pid
    workers = [int(p) for p in Path(f"/proc/{control}/task/{control}/children").read_text().split()]
    assert len(workers) == 2
    for pid in (control, *workers):
        assert Path(f"/proc/{pid}/oom_score_adj").read_text().strip() == "500", pid
    assert host_values() == host
