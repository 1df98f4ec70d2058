"""Issues 4 and 12: ``uproxy --cleanup`` restores the tables, and a taken node port is one
clear error.

Someone else's rules are installed before uproxy starts (in the iptables variant uproxy writes,
for IPv4 and IPv6, and a table of their own in nft), so "restored" means: theirs still there,
uproxy's gone, and ``iptables-nft-save``, ``iptables-legacy-save``, their ``ip6tables-``
counterparts and ``nft -s list ruleset`` print exactly what they printed before (counters left
out: the traffic moved them). The node is dual-stack, with a dual-stack and an IPv6-only
service, so uproxy has written both families.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.cluster import Cluster
from tests.e2e.conftest import DUAL_STACK, StartProc, StartUproxy
from tests.e2e.harness import ServicesFile, Uproxy, curl, slice_endpoint, url, wait_until_ok
from tests.e2e.manifests import (
    WEB6_ONLY_IP,
    WEB_IP,
    WEB_NODE_PORT,
    backend_argv,
    dual_web,
    lb_web,
    web6_only,
    web_service,
    web_slice,
)
from tests.e2e.saved import normalized
from tests.netns.helpers import FOREIGN, FOREIGN6

pytestmark = [pytest.mark.root]

MODES = ("nft", "legacy")
PROGRAMS = tuple(f"{p}tables-{m}" for p in ("ip", "ip6") for m in MODES)


FOREIGN_NFT = """\
table inet other {
	set allowed { type inet_service; elements = { 22, 443 } }
	chain input {
		type filter hook input priority 10; policy accept;
		tcp dport @allowed counter accept
	}
}
"""


def saves(net: Cluster) -> dict[str, str]:
    out = {p: normalized(net.topo.run(net.topo.node, f"{p}-save")) for p in PROGRAMS}
    out["ruleset"] = net.topo.run(net.topo.node, "nft", "-s", "list", "ruleset")
    return out


@pytest.mark.parametrize("net", [DUAL_STACK], indirect=True)
@pytest.mark.parametrize(
    ("rules", "mode"),
    [
        pytest.param(["--rules", "auto"], "nft", id="restore-nft"),
        pytest.param(
            ["--rules", "auto", "--iptables-mode", "legacy"], "legacy", id="restore-legacy"
        ),
        pytest.param(["--rules", "iptables"], "legacy", id="python-iptables"),
        pytest.param(["--rules", "nftables"], "nft", id="nftables"),
    ],
)
def test_cleanup_restores_iptables_save_exactly(
    net: Cluster,
    services: ServicesFile,
    start_proc: StartProc,
    start_uproxy: StartUproxy,
    tmp_path: Path,
    rules: list[str],
    mode: str,
) -> None:
    topo = net.topo
    topo.run(topo.node, f"iptables-{mode}-restore", "--noflush", stdin=FOREIGN)
    topo.run(topo.node, f"ip6tables-{mode}-restore", "--noflush", stdin=FOREIGN6)
    topo.run(topo.node, "nft", "-f", "-", stdin=FOREIGN_NFT)
    before = saves(net)
    assert "OTHER-NAT" in before[f"iptables-{mode}"]
    assert "OTHER6-NAT" in before[f"ip6tables-{mode}"]
    assert "table inet other" in before["ruleset"]

    start_proc(topo.backend, backend_argv(net), ready_line=True)
    services.put(*dual_web(net), *web6_only(net))
    services.write()
    proxy = start_uproxy(rules[1], extra=rules[2:])
    proxy.wait_synced()
    curl(topo, topo.pod, url(WEB_IP), body=b"installed", tmp=tmp_path)
    curl(topo, topo.pod, url(WEB6_ONLY_IP), body=b"installed", tmp=tmp_path)
    during = saves(net)
    if rules[1] == "nftables":
        assert "table ip uproxy" in during["ruleset"]
        assert "table ip6 uproxy" in during["ruleset"]
        assert "KUBE-PORTALS" not in during["ruleset"]
    else:
        assert "KUBE-PORTALS-CONTAINER" in during[f"iptables-{mode}"]
        assert "default/web6:http" in during[f"ip6tables-{mode}"]
        assert "table ip uproxy" not in during["ruleset"]
    # Someone else's rules are untouched.
    assert "-A OUTPUT -j OTHER-NAT" in during[f"iptables-{mode}"]
    assert "-A OUTPUT -j OTHER6-NAT" in during[f"ip6tables-{mode}"]
    assert proxy.stop() == 0

    # Exit status 0 is checked by run(); afterwards the tables are exactly as before.
    topo.run(topo.node, sys.executable, "-m", "uproxy.cli", "--cleanup")
    assert saves(net) == before


def test_taken_node_port_is_one_error_line_and_others_keep_working(
    net: Cluster,
    services: ServicesFile,
    start_proc: StartProc,
    start_uproxy: StartUproxy,
    tmp_path: Path,
) -> None:
    topo = net.topo
    taken_port = 30081
    holder = (
        "import socket, time\n"
        f"s = socket.create_server(('0.0.0.0', {taken_port}))\n"
        "print('ready', flush=True)\n"
        "time.sleep(300)\n"
    )
    start_proc(topo.node, [sys.executable, "-c", holder], ready_line=True)
    start_proc(topo.backend, backend_argv(net), ready_line=True)
    taken = web_service("taken", cluster_ip="10.96.0.11", type="NodePort")
    taken["spec"]["ports"][0]["nodePort"] = taken_port
    taken_eps = web_slice("taken-1", "taken", [slice_endpoint(net.backend_ips[2])])
    services.put(*lb_web(net), taken, taken_eps)
    services.write()
    proxy = start_uproxy("auto")
    proxy.wait_synced()
    # A few more syncs (a file change each): the error must still be reported only once.
    for i in range(3):
        started = time.time()
        services.put(web_service(f"filler-{i}", cluster_ip=f"10.96.1.{i + 1}"))
        services.write()
        proxy.wait_synced(after=started)

    errors = [line for line in proxy.proc.stderr_lines if str(taken_port) in line]
    assert len(errors) == 1, proxy.proc.stderr_lines
    assert errors[0].startswith("E"), errors[0]
    assert "default/taken" in errors[0]
    assert f"node port {taken_port}/TCP" in errors[0]

    # The other service works on every path; the taken service's ClusterIP works too.
    curl(topo, topo.pod, f"http://{WEB_IP}/", body=b"cluster", tmp=tmp_path)
    curl(topo, topo.outside, f"http://{topo.node_ip}:{WEB_NODE_PORT}/", body=b"np", tmp=tmp_path)
    answers = curl(topo, topo.pod, "http://10.96.0.11/", body=b"taken", tmp=tmp_path)
    assert [a.name for a in answers] == ["web-3"]
    assert proxy.proc.popen.poll() is None


def test_a_second_uproxy_in_one_namespace_waits_for_the_first_or_is_one_error(
    net: Cluster,
    services: ServicesFile,
    start_uproxy: StartUproxy,
) -> None:
    """Two uproxies with rules in one node namespace rewrote each other's rules for ever
    (with nftables both reloaded the table every second) and said so only as "changed by
    somebody else". A second one now waits for the first to exit (a restart overlapping the
    stop of its predecessor), then starts; one that outlives the wait is one error line."""
    services.put(*lb_web(net))
    services.write()
    first = start_uproxy("nftables")
    first.wait_synced()
    topo = net.topo
    second = Uproxy(
        topo, topo.node, services=services.path, rules="nftables", extra=["--drain-timeout", "0s"]
    )
    try:
        second.proc.popen.wait(timeout=20)  # bounded: it waits 5 s past its 0 s drain
    finally:
        code = second.stop()
    said = second.proc.stderr_lines
    errors = [line for line in said if line.startswith("uproxy: error:")]
    assert code == 1 and len(errors) == 1, said
    assert f"another uproxy (pid {first.proc.popen.pid} " in errors[0], errors
    assert "already proxies for this network namespace" in errors[0]
    assert sum("waiting for it to exit" in line for line in said) == 1, said
    assert "Syncing" not in "\n".join(said) and first.proc.popen.poll() is None

    third = start_uproxy("nftables")  # waits up to its 5 s drain and 5 s more
    wait_until_ok(
        lambda: "waiting for it to exit" in "\n".join(third.proc.stderr_lines),
        message="the third uproxy waiting for the first",
    )
    started = time.time()
    assert first.stop() == 0
    third.wait_synced(after=started)


def test_a_successor_gets_ready_while_its_predecessor_drains(
    net: Cluster,
    services: ServicesFile,
    start_proc: StartProc,
    start_uproxy: StartUproxy,
    tmp_path: Path,
) -> None:
    """A rollout's restart: the new uproxy starts while the old one drains. It waited for
    the old one's exit before doing anything, so its whole start (1.75 s measured) came
    after it, every service refused meanwhile; it now starts its workers and lists the
    services while the old one drains, and only takes the node (ports, rules, HTTP) after."""
    topo = net.topo
    start_proc(topo.backend, backend_argv(net), ready_line=True)
    services.put(*lb_web(net))
    services.write()
    first = start_uproxy("nftables", extra=["--drain-timeout", "4s"])
    first.wait_synced()
    # An idle connection through the ClusterIP keeps the old one draining to its deadline.
    hold = (
        "import socket, sys, time\n"
        f"s = socket.create_connection(('{WEB_IP}', 80), timeout=5)\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    start_proc(topo.pod, [sys.executable, "-c", hold], ready_line=True)
    first.proc.popen.send_signal(signal.SIGTERM)
    second = start_uproxy("nftables")
    ready = "Ready to take over the node once the uproxy before this one exits"
    wait_until_ok(
        lambda: ready in "\n".join(second.proc.stderr_lines),
        timeout=15,
        message="the successor ready before its predecessor exits",
    )
    assert first.proc.popen.poll() is None, "the predecessor had exited already"
    said = "\n".join(second.proc.stderr_lines)
    assert "Started data-plane worker" in said and "Opening proxy port" not in said
    started = time.time()
    assert first.proc.popen.wait(timeout=15) == 0
    second.wait_synced(after=started)
    answers = curl(topo, topo.pod, f"http://{WEB_IP}/", body=b"x" * 100, tmp=tmp_path, count=3)
    assert {a.name for a in answers} <= {"web-1", "web-2"}
