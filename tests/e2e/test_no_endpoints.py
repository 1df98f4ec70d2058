"""A service port without endpoints, on a node: new connections are refused, as kube-proxy's are.

kube-proxy's iptables and nftables modes REJECT a service with no usable endpoint (an ICMP port
unreachable): a TCP client's connect fails at once, and a UDP client reads ECONNREFUSED instead
of waiting out its timeout (a resolver then asks its next server). uproxy's rules do the same
for the proxy port the service's addresses lead to, and take it back once an endpoint exists;
TCP is refused with a RST rather than an ICMP error, which the kernel rate-limits per client.
Real clients (curl, and a UDP socket as a resolver uses one) from a pod, the node and outside.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.cluster import Cluster
from tests.e2e.conftest import StartProc, StartUproxy
from tests.e2e.harness import ServicesFile, curl, curl_status, dig, wait_until_ok
from tests.e2e.manifests import (
    DNS_ANSWER,
    DNS_IP,
    DNS_NAME,
    LB_IP,
    WEB_IP,
    WEB_NODE_PORT,
    backend_argv,
    dnsmasq_argv,
    lb_dns,
    lb_web,
)
from tests.netns.topology import Topology

pytestmark = [pytest.mark.root]

RULES = [
    pytest.param("auto", id="restore"),
    pytest.param("iptables", id="python-iptables"),
    pytest.param("nftables", id="nftables"),
]
REFUSED = 7  # curl: could not connect

# One datagram on a connected socket, as a resolver sends its query: what came back within 2 s.
UDP_PROBE = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.connect((sys.argv[1], int(sys.argv[2])))
s.settimeout(2)
s.send(b"\\x12\\x34\\x01\\x00\\x00\\x01\\x00\\x00\\x00\\x00\\x00\\x00\\x00\\x00\\x01\\x00\\x01")
try:
    s.recv(2048)
    print("answered")
except ConnectionRefusedError:
    print("refused")
except TimeoutError:
    print("no answer")
"""


# Connections one after another, as a client retrying in a loop opens them: how many were
# refused within 0.5 s each (an ICMP error, rate-limited per client, would leave most waiting).
TCP_BURST = """
import socket, sys
refused = 0
for _ in range(int(sys.argv[3])):
    s = socket.socket()
    s.settimeout(0.5)
    try:
        s.connect((sys.argv[1], int(sys.argv[2])))
    except ConnectionRefusedError:
        refused += 1
    except OSError:
        pass
    s.close()
print(refused)
"""


def refused_in_a_burst(topo: Topology, ns: str, ip: str, port: int, count: int) -> int:
    argv = topo.exec_argv(ns, sys.executable, "-c", TCP_BURST, ip, str(port), str(count))
    return int(subprocess.run(argv, capture_output=True, text=True, timeout=60).stdout)


def udp_probe(topo: Topology, ns: str, ip: str, port: int) -> str:
    argv = topo.exec_argv(ns, sys.executable, "-c", UDP_PROBE, ip, str(port))
    return subprocess.run(argv, capture_output=True, text=True, timeout=20).stdout.strip()


def refused_at_once(topo: Topology, ns: str, url: str) -> bool:
    started = time.monotonic()
    return curl_status(topo, ns, url) == REFUSED and time.monotonic() - started < 1.0


@pytest.mark.parametrize("rules", RULES)
def test_a_service_port_without_endpoints_refuses_until_it_has_one(
    net: Cluster,
    services: ServicesFile,
    start_proc: StartProc,
    start_uproxy: StartUproxy,
    tmp_path: Path,
    rules: str,
) -> None:
    topo = net.topo
    start_proc(topo.backend, backend_argv(net), ready_line=True)
    start_proc(topo.backend, dnsmasq_argv(topo.backend_ip))
    web, web_endpoints = lb_web(net)
    dns, dns_endpoints = lb_dns(net)
    services.put(web, dns)  # no endpoints yet
    services.write()
    proxy = start_uproxy(rules)
    proxy.wait_synced()

    # Every way in is refused at once: a pod and the node to the ClusterIP, outside to the
    # node port and the LoadBalancer IP (not accepted, then reset: never connected).
    urls = [
        (topo.pod, f"http://{WEB_IP}/"),
        (topo.node, f"http://{WEB_IP}/"),
        (topo.outside, f"http://{topo.node_ip}:{WEB_NODE_PORT}/"),
        (topo.outside, f"http://{LB_IP}/"),
    ]
    for ns, url in urls:
        assert refused_at_once(topo, ns, url), (ns, url)
    # Every one of many connections in a row: TCP is refused with a RST, which the kernel does
    # not rate-limit as it does ICMP errors (6 at once, then one a second per client).
    assert refused_in_a_burst(topo, topo.pod, WEB_IP, 80, 30) == 30
    # UDP: the conntrack entry of the redirected datagram turns the ICMP error back into one
    # about the ClusterIP, so the client's connected socket reads ECONNREFUSED.
    assert udp_probe(topo, topo.pod, DNS_IP, 53) == "refused"
    assert udp_probe(topo, topo.node, DNS_IP, 53) == "refused"

    # Endpoints come: the refusals go with the next rules sync (within the min sync period).
    services.put(web_endpoints, dns_endpoints)
    services.write()
    body = b"endpoints at last" * 1000
    wait_until_ok(
        lambda: curl(topo, topo.pod, f"http://{WEB_IP}/", body=body, tmp=tmp_path, max_time=2),
        timeout=5.0,
        message="the ClusterIP answering once it has endpoints",
    )
    for ns, url in urls:
        assert {a.name for a in curl(topo, ns, url, body=body, tmp=tmp_path, count=2)} <= {
            "web-1",
            "web-2",
        }, (ns, url)
    wait_until_ok(
        lambda: dig(topo, topo.pod, DNS_IP, DNS_NAME) == DNS_ANSWER,
        timeout=5.0,
        message="the DNS ClusterIP answering",
    )

    # And gone again: refused again, at the next sync.
    started = time.time()
    services.remove("EndpointSlice", web_endpoints["metadata"]["name"])
    services.remove("EndpointSlice", dns_endpoints["metadata"]["name"])
    services.write()
    wait_until_ok(
        lambda: refused_at_once(topo, topo.pod, f"http://{WEB_IP}/"),
        timeout=5.0,
        message="refused once the endpoints are gone",
    )
    # TCP is refused by the proxy port itself as soon as its balancer has no endpoint; a
    # datagram is refused by the rules only, which the next sync writes: waited for, or the
    # probe can reach the proxy port before them and be dropped there ("no answer").
    proxy.wait_change_synced(after=started)
    assert udp_probe(topo, topo.pod, DNS_IP, 53) == "refused"
    assert proxy.proc.popen.poll() is None
