"""A restart over the last run's rules, in real namespaces: each service gets back the proxy
port its rules lead to, so until the new rules are in an old rule reaches its own service
(or a closed port), never another one. Chosen afresh, about half the ports would be one an
old rule sends another service's traffic to."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.cluster import Cluster
from tests.e2e.conftest import StartProc, StartUproxy
from tests.e2e.harness import ServicesFile, curl, slice_endpoint
from tests.e2e.manifests import WEB_IP, backend_argv, lb_web, web_service, web_slice
from tests.netns.helpers import nft, save

pytestmark = [pytest.mark.root]

COUNT = 60  # services beside the web one, each on its own ClusterIP


def many(net: Cluster) -> list[Any]:
    out: list[Any] = []
    for i in range(COUNT):
        name = f"svc-{i}"
        out.append(web_service(name, cluster_ip=f"10.96.1.{i + 1}"))
        out.append(web_slice(f"{name}-1", name, [slice_endpoint(net.topo.backend_ip)]))
    return out


def ports_by_address(net: Cluster, rules: str) -> dict[str, int]:
    """ClusterIP -> the proxy port the installed rules lead to (ClusterIPs only: the two
    backends keep other addresses apart differently)."""
    if rules == "nftables":
        doc = json.loads(nft(net.topo, "-j", "list", "map", "ip", "uproxy", "cluster-ips"))
        out = {}
        for obj in doc["nftables"]:
            for item in obj.get("map", {}).get("elem", []):
                key, value = item
                key = key["elem"]["val"] if "elem" in key else key
                out[key["concat"][0]] = value
        return {ip: port for ip, port in out.items() if ip.startswith("10.96.")}
    found = re.findall(
        r"-A KUBE-PORTALS-CONTAINER -d (\S+)/32 .* --to-ports (\d+)", save(net.topo, "nft")
    )
    return {ip: int(port) for ip, port in found if ip.startswith("10.96.")}


@pytest.mark.parametrize(
    ("rules", "then"),
    [("nftables", "nftables"), ("auto", "auto"), ("auto", "nftables"), ("nftables", "auto")],
    ids=["nftables", "restore", "restore-to-nftables", "nftables-to-restore"],
)
def test_a_restart_gives_every_service_the_port_its_rules_lead_to(
    net: Cluster,
    services: ServicesFile,
    start_proc: StartProc,
    start_uproxy: StartUproxy,
    rules: str,
    then: str,
    tmp_path: Path,
) -> None:
    """Also when the rules backend changed: the last run's rules, another backend's, stay
    in place until the new run's are in (removed before, a SYN in between got a conntrack
    entry without NAT and hung on it), so the new run opens its listeners where they lead."""
    topo = net.topo
    start_proc(topo.backend, backend_argv(net), ready_line=True)
    services.put(*lb_web(net), *many(net))
    services.write()
    first = start_uproxy(rules)
    first.wait_synced()
    before = ports_by_address(net, rules)
    assert len(before) >= COUNT + 1
    assert first.stop() == 0  # SIGTERM: its rules stay (no --cleanup-on-exit)
    second = start_uproxy(then)
    second.wait_synced(after=time.time() - 60)
    assert ports_by_address(net, then) == before
    said = "\n".join(second.proc.stderr_lines)
    assert "Reusing the last run's proxy ports while its rules are still in place" in said
    if then != rules:  # the other backend's rules went once the new ones were in
        assert said.index("Removed the rules another") > said.index("Proxy ports changed")
        if rules == "nftables":
            assert "uproxy" not in nft(topo, "list", "tables")
        else:
            assert "KUBE-PORTALS" not in save(topo, "nft")
    # And it serves: the web service's ClusterIP from a pod.
    answers = curl(topo, topo.pod, f"http://{WEB_IP}/", body=b"x" * 1000, tmp=tmp_path, count=4)
    assert {a.name for a in answers} == {
        "web-1",
        "web-2",
    }
