"""UDP clients that keep their source port and keep sending, through real rules in namespaces:
one that sent to a service address before the service existed reaches it once it does.

Its first datagrams found no rule, so conntrack holds their flow untranslated, and the flow
lives while the client keeps sending: without uproxy forgetting that entry once the rule is
in place (kube-proxy does it for services that became active), the client never gets through.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.e2e.cluster import Cluster
from tests.e2e.conftest import StartProc, StartUproxy
from tests.e2e.harness import ServicesFile, dig, wait_until_ok
from tests.e2e.manifests import DNS_ANSWER, DNS_IP, DNS_NAME, dns, dnsmasq_argv, lb_web

pytestmark = [pytest.mark.root]


def udp_flows(net: Cluster) -> int:
    """The node's conntrack entries for UDP to the DNS service address."""
    done = subprocess.run(
        net.topo.exec_argv(net.topo.node, "conntrack", "-L", "-p", "udp", "--orig-dst", DNS_IP),
        capture_output=True,
        text=True,
        check=False,
        timeout=10,
    )
    return sum(1 for line in done.stdout.splitlines() if line.startswith("udp"))


def start_dnsmasq(net: Cluster, start_proc: StartProc) -> None:
    topo = net.topo
    start_proc(topo.backend, dnsmasq_argv(topo.backend_ip))
    wait_until_ok(
        lambda: dig(topo, topo.backend, topo.backend_ip, DNS_NAME) == DNS_ANSWER,
        message="dnsmasq answering",
    )


@pytest.mark.parametrize("rules", ["auto", "nftables"], ids=["restore", "nftables"])
def test_a_udp_client_sending_before_the_service_existed_gets_through(
    net: Cluster,
    services: ServicesFile,
    start_proc: StartProc,
    start_uproxy: StartUproxy,
    rules: str,
) -> None:
    topo = net.topo
    start_dnsmasq(net, start_proc)
    services.put(*lb_web(net))
    services.write()
    proxy = start_uproxy(rules)
    proxy.wait_synced()
    argv = [sys.executable, "-m", "tests.e2e.udp_client", DNS_IP, DNS_NAME, "--for", "20"]
    client = start_proc(topo.pod, argv, ready_line=True)
    # The client's flow is in the node's conntrack table, untranslated (no rule yet).
    wait_until_ok(lambda: udp_flows(net) > 0, message="the client's flow in conntrack")
    assert client.popen.poll() is None  # no answer without the service
    added = time.time()
    services.put(*dns(net))
    services.write()
    proxy.wait_synced(after=added)
    out = client.popen.stdout
    assert out is not None
    line = out.readline().strip()  # bounded: the client gives up after 20 s
    assert line.startswith("answered"), f"{line!r}; uproxy said: {proxy.proc.stderr_lines[-5:]}"


@pytest.mark.parametrize("rules", ["auto", "nftables"], ids=["restore", "nftables"])
def test_a_udp_client_keeping_its_socket_is_refused_once_the_endpoints_are_gone(
    net: Cluster,
    services: ServicesFile,
    start_proc: StartProc,
    start_uproxy: StartUproxy,
    rules: str,
) -> None:
    """A resolver's forwarder keeps one connected socket: its conntrack entry outlived the
    endpoints, and since the REJECT rule sees new flows only, its queries went on to the
    proxy port and were dropped there until it gave up on its own. kube-proxy deletes the
    entries of endpoints that went, so that its REJECT answers; uproxy deletes the service
    address's entries once its REJECT rule is in."""
    topo = net.topo
    start_dnsmasq(net, start_proc)
    svc, endpoints = dns(net)
    services.put(svc, endpoints)
    services.write()
    proxy = start_uproxy(rules)
    proxy.wait_synced()
    argv = [sys.executable, "-m", "tests.e2e.udp_client", DNS_IP, DNS_NAME, "--for", "20"]
    client = start_proc(topo.pod, [*argv, "--until-refused"], ready_line=True)
    out = client.popen.stdout
    assert out is not None
    line = out.readline().strip()  # bounded: the client gives up after 20 s
    assert line.startswith("answered"), line
    removed = time.time()
    services.remove("EndpointSlice", endpoints["metadata"]["name"])
    services.write()
    proxy.wait_synced(after=removed)
    line = out.readline().strip()
    assert line.startswith("refused"), f"{line!r}; uproxy said: {proxy.proc.stderr_lines[-5:]}"
