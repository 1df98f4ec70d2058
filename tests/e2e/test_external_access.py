"""Issue 12: who reaches a service's external addresses, end to end in every rules backend.

- ``loadBalancerSourceRanges``: an allowed source is answered, other sources are dropped (the
  LoadBalancer IP is a local address here, as with an L2 load balancer, so a packet that got
  through would be refused at once: a client that gets no answer at all was dropped), and the
  node itself is always let in.
- ``--nodeport-addresses``: a NodePort answers on the node address in the CIDRs (or the
  primary one) and not on the node's other addresses, where nothing listens.
- ``externalTrafficPolicy: Local`` on a node without local endpoints: outside clients are
  refused, but a pod on the node (told apart by ``--detect-local-mode``) and the node itself
  reach the remote endpoints through the LoadBalancer IP, the externalIP and the NodePort.

Each test also compares the installed rules with the exact text written out here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import wait_for_sync
from tests.e2e.cluster import Cluster
from tests.e2e.conftest import StartProc, StartUproxy
from tests.e2e.harness import (
    ServicesFile,
    Uproxy,
    connect_times_out,
    curl,
    curl_status,
    slice_endpoint,
)
from tests.e2e.manifests import (
    EXTERNAL_IP,
    LB_IP,
    WEB_IP,
    WEB_NODE_PORT,
    backend_argv,
    lb_web,
    web_service,
    web_slice,
)
from tests.e2e.saved import Tables, save
from tests.e2e.test_rules import (
    MARK_RETURN,
    NODEPORTS_JUMP,
    comparable,
    direct,
    dropped,
    expected_tables,
    nft_chains,
    nft_listing,
    nft_table,
)

pytestmark = [pytest.mark.root]

BACKENDS = [
    pytest.param("auto", "nft", id="restore"),
    pytest.param("iptables", "legacy", id="python-iptables"),
    pytest.param("nftables", None, id="nftables"),
]
PORT_RANGE = ["--proxy-port-range", "40000-40019"]
REFUSED, TIMED_OUT = 7, 28  # curl: could not connect, no answer in time
WEB = "default/web:http"


def answered(net: Cluster, ns: str, url: str, tmp: Path, count: int = 2) -> set[str]:
    return {a.name for a in curl(net.topo, ns, url, body=b"hello", tmp=tmp, count=count)}


def installed(net: Cluster, mode: str | None) -> Tables | str:
    if mode is None:
        return nft_table(net)
    return comparable(save(net.topo, net.topo.node, mode))


def start_web(
    net: Cluster, services: ServicesFile, start_proc: StartProc, objs: list[dict[str, Any]]
) -> None:
    start_proc(net.topo.backend, backend_argv(net), ready_line=True)
    services.put(*objs)
    services.write()


def web_elements(web: int) -> dict[str, list[str]]:
    c = f'comment "{WEB}"'
    return {
        "cluster-ips": [f"{WEB_IP} . tcp . 80 {c} : {web}", f"{LB_IP} . tcp . 80 {c} : {web}"],
        "external-ips": [f"{EXTERNAL_IP} . tcp . 80 {c} : {web}"],
        "node-ports": [f"tcp . {WEB_NODE_PORT} {c} : {web}"],
        "node-port-proxy-ports": [f"tcp . {web} {c}"],
        "proxy-ports": [f"tcp . {web} {c}"],
    }


# ----- loadBalancerSourceRanges ---------------------------------------------------------------


def ranged_expectation(net: Cluster, web: int, mode: str | None) -> Tables | str:
    allowed = f"{net.topo.outside_ip}/32"
    if mode is None:
        elements = web_elements(web)
        elements["firewalled-lb-ips"] = [f'{LB_IP} . tcp . 80 comment "{WEB}"']
        elements["lb-source-ranges"] = [
            f'{LB_IP} . tcp . 80 . {net.topo.outside_ip} comment "{WEB}"'
        ]
        return nft_listing(elements, nft_chains(net.topo.node_ip))
    tables = expected_tables(net.topo.node_ip, web=web, dns_port=None)
    nat = tables["nat"]["KUBE-PORTALS-CONTAINER"]
    nat[:] = [f"-s {allowed} {r}" if r.startswith(f"-d {LB_IP}/32") else r for r in nat]
    drop = f'-d {LB_IP}/32 -p tcp -m comment --comment "{WEB}" -m tcp --dport 80 -j DROP'
    tables["filter"]["KUBE-PORTALS-FIREWALL"] = [drop]
    return comparable(tables)


@pytest.mark.parametrize(("rules", "mode"), BACKENDS)
def test_source_ranges_let_in_only_allowed_sources_and_the_node(
    net: Cluster,
    services: ServicesFile,
    start_proc: StartProc,
    start_uproxy: StartUproxy,
    tmp_path: Path,
    rules: str,
    mode: str | None,
) -> None:
    topo = net.topo
    topo.run(topo.node, "ip", "addr", "add", f"{LB_IP}/32", "dev", "lo")
    objs = lb_web(net)
    objs[0]["spec"]["loadBalancerSourceRanges"] = [f"{topo.outside_ip}/32"]
    start_web(net, services, start_proc, objs)
    proxy = start_uproxy(rules, extra=PORT_RANGE)
    proxy.wait_synced()
    web = proxy.proxy_ports()[(WEB, "cluster")]
    assert installed(net, mode) == ranged_expectation(net, web, mode)

    lb = f"http://{LB_IP}/"
    assert answered(net, topo.outside, lb, tmp_path) <= {"web-1", "web-2"}
    assert answered(net, topo.node, lb, tmp_path) <= {"web-1", "web-2"}
    # Another host and a pod are outside the range: no answer at all (not even a reset).
    assert curl_status(topo, net.node_b, lb) == TIMED_OUT
    assert curl_status(topo, topo.pod, lb) == TIMED_OUT
    # The ranges are the LoadBalancer IP's only: the NodePort answers the other host.
    node_port = f"http://{topo.node_ip}:{WEB_NODE_PORT}/"
    assert answered(net, net.node_b, node_port, tmp_path) <= {"web-1", "web-2"}
    # The source ranges go: everyone is let in again.
    objs[0]["spec"].pop("loadBalancerSourceRanges")
    services.put(*objs)
    services.write()
    wait_rules(proxy, net, mode, expected_tables_or_nft(net, web, mode))
    assert answered(net, net.node_b, lb, tmp_path) <= {"web-1", "web-2"}


def expected_tables_or_nft(net: Cluster, web: int, mode: str | None) -> Tables | str:
    if mode is None:
        return nft_listing(web_elements(web), nft_chains(net.topo.node_ip))
    return comparable(expected_tables(net.topo.node_ip, web=web, dns_port=None))


def wait_rules(proxy: Uproxy, net: Cluster, mode: str | None, want: Tables | str) -> None:
    wait_for_sync(lambda: installed(net, mode) == want, timeout=15, interval=0.1, message="rules")
    assert proxy.proc.popen.poll() is None


# ----- --nodeport-addresses -----------------------------------------------------------------------


@pytest.mark.parametrize(("rules", "mode"), BACKENDS)
@pytest.mark.parametrize("addresses", ["10.200.3.0/24", "primary"])
def test_nodeport_answers_only_on_the_addresses_given(
    net: Cluster,
    services: ServicesFile,
    start_proc: StartProc,
    start_uproxy: StartUproxy,
    tmp_path: Path,
    rules: str,
    mode: str | None,
    addresses: str,
) -> None:
    topo = net.topo
    start_web(net, services, start_proc, lb_web(net))
    proxy = start_uproxy(rules, extra=[*PORT_RANGE, "--nodeport-addresses", addresses])
    proxy.wait_synced()
    web = proxy.proxy_ports()[(WEB, "cluster")]
    cidr = "10.200.3.0/24" if addresses != "primary" else f"{topo.node_ip}/32"
    if mode is None:
        match = "ip daddr 10.200.3.0/24 " if addresses != "primary" else f"ip daddr {topo.node_ip} "
        want: Tables | str = nft_listing(
            web_elements(web), nft_chains(topo.node_ip, nodeports=match)
        )
    else:
        tables = expected_tables(topo.node_ip, web=web, dns_port=None)
        for chain, target in (
            ("PREROUTING", "KUBE-NODEPORT-CONTAINER"),
            ("OUTPUT", "KUBE-NODEPORT-HOST"),
        ):
            jumps = tables["nat"][chain]
            jumps[-1] = f"-d {cidr} " + NODEPORTS_JUMP.format(chain=target)
        want = comparable(tables)
    assert installed(net, mode) == want

    # The node's address on the outside link answers; its address on the pods' link does not:
    # no rule sends it to uproxy, and the socket holding the port is bound elsewhere.
    other = topo.run(topo.node, "ip", "-4", "-o", "addr", "show", "dev", "pod0").split()[3]
    other_ip = other.split("/")[0]
    for ns in (topo.outside, topo.node):
        url = f"http://{topo.node_ip}:{WEB_NODE_PORT}/"
        assert answered(net, ns, url, tmp_path) <= {"web-1", "web-2"}, ns
        assert curl_status(topo, ns, f"http://{other_ip}:{WEB_NODE_PORT}/") == REFUSED, ns
    held = topo.run(topo.node, "ss", "-Hltn", f"sport = :{WEB_NODE_PORT}").split()
    assert f"{topo.node_ip}:{WEB_NODE_PORT}" in held and f"0.0.0.0:{WEB_NODE_PORT}" not in held


# ----- externalTrafficPolicy: Local, no local endpoint -------------------------------------------

LOCAL_IP = "10.96.0.30"
LOCAL_NODE_PORT = 30090
LOCAL = "default/local:http"

DETECTION = {
    "cluster-cidr": (
        ["--cluster-cidr", "10.200.1.0/24"],
        ("-s 10.200.1.0/24 ", ""),
        "ip saddr 10.200.1.0/24 ",
    ),
    "prefix": (
        ["--detect-local-mode", "InterfaceNamePrefix", "--pod-interface-name-prefix", "pod"],
        ("", "-i pod+ "),
        'iifname "pod*" ',
    ),
    "bridge": (
        ["--detect-local-mode", "BridgeInterface", "--pod-bridge-interface", "pod0"],
        ("", "-i pod0 "),
        'iifname "pod0" ',
    ),
    "none": ([], None, ""),
}


def local_service(net: Cluster) -> list[dict[str, Any]]:
    svc = web_service(
        "local",
        cluster_ip=LOCAL_IP,
        type="LoadBalancer",
        externalIPs=[EXTERNAL_IP],
        externalTrafficPolicy="Local",
    )
    svc["spec"]["ports"][0]["nodePort"] = LOCAL_NODE_PORT
    svc["status"] = {"loadBalancer": {"ingress": [{"ip": LB_IP}]}}
    remote = [slice_endpoint(ip, node="node-c") for ip in net.backend_ips]
    return [svc, web_slice("local-1", "local", remote)]


def local_tables(node_ip: str, c_port: int, e_port: int, pods: tuple[str, str] | None) -> Tables:
    """The iptables rules of ``local_service``: ``pods`` is (source, interface) of the pods'
    match, each "" or ending in a space; None: pods are not told apart."""
    tables = expected_tables(node_ip, web=None, dns_port=None)
    nat, filt = tables["nat"], tables["filter"]
    c = f'-p tcp -m comment --comment "{LOCAL}" -m tcp'
    cluster, external = f"-j REDIRECT --to-ports {c_port}", f"-j REDIRECT --to-ports {e_port}"
    dnat = f"-j DNAT --to-destination {node_ip}:{c_port}"
    np, local = "-m physdev ! --physdev-is-in", "-m addrtype --dst-type LOCAL"
    ext, lb = f"-d {EXTERNAL_IP}/32", f"-d {LB_IP}/32"
    container = [f"-d {LOCAL_IP}/32 {c} --dport 80 {cluster}"]
    node_ports: list[str] = []
    if pods is not None:
        s, i = pods
        container += [
            f"{s}{ext} {i}{c} --dport 80 {np} {cluster}",
            f"{s}{ext} {i}{c} --dport 80 {local} {cluster}",
        ]
        node_ports.append(f"{s}{i}{c} --dport {LOCAL_NODE_PORT} {cluster}")
    container += [
        f"{ext} {c} --dport 80 {np} {external}",
        f"{ext} {c} --dport 80 {local} {external}",
    ]
    if pods is not None:
        container.append(f"{pods[0]}{lb} {pods[1]}{c} --dport 80 {cluster}")
    container.append(f"{lb} {c} --dport 80 {external}")
    nat["KUBE-PORTALS-CONTAINER"] = container
    nat["KUBE-PORTALS-HOST"] = [
        MARK_RETURN,
        f"-d {LOCAL_IP}/32 {c} --dport 80 {dnat}",
        f"{ext} {c} --dport 80 {local} {dnat}",
        f"{lb} {c} --dport 80 {dnat}",
    ]
    nat["KUBE-NODEPORT-CONTAINER"] = [*node_ports, f"{c} --dport {LOCAL_NODE_PORT} {external}"]
    nat["KUBE-NODEPORT-HOST"] = [MARK_RETURN, f"{c} --dport {LOCAL_NODE_PORT} {dnat}"]
    filt["KUBE-NODEPORT-NON-LOCAL"] = [
        f"{c} --dport {port} -m state --state NEW -m conntrack --ctstate DNAT -j ACCEPT"
        for port in (e_port, c_port)
    ]
    # Endpoints, none on this node: the external proxy port drops new connections.
    filt["KUBE-PORTALS-REJECT"] = [dropped(LOCAL, e_port)]
    filt["KUBE-PORTALS-DIRECT"] = [direct("tcp", c_port, e_port)]
    return tables


def local_nft(node_ip: str, c_port: int, e_port: int, pods: str) -> str:
    c = f'comment "{LOCAL}"'
    elements = {
        "cluster-ips": [
            f"{LOCAL_IP} . tcp . 80 {c} : {c_port}",
            f"{LB_IP} . tcp . 80 {c} : {e_port}",
        ],
        "external-ips": [f"{EXTERNAL_IP} . tcp . 80 {c} : {e_port}"],
        "node-ports": [f"tcp . {LOCAL_NODE_PORT} {c} : {e_port}"],
        "node-port-proxy-ports": [f"tcp . {c_port} {c}", f"tcp . {e_port} {c}"],
        "proxy-ports": [f"tcp . {c_port} {c}", f"tcp . {e_port} {c}"],
        "short-circuit-lb-ips": [f"{LB_IP} . tcp . 80 {c} : {c_port}"],
        "short-circuit-external-ips": [f"{EXTERNAL_IP} . tcp . 80 {c} : {c_port}"],
        "short-circuit-node-ports": [f"tcp . {LOCAL_NODE_PORT} {c} : {c_port}"],
        "dropped-proxy-ports": [f'tcp . {e_port} comment "{LOCAL} has no local endpoints"'],
    }
    return nft_listing(elements, nft_chains(node_ip, pods=pods))


@pytest.mark.parametrize(
    ("rules", "mode", "detection"),
    [
        pytest.param("auto", "nft", "cluster-cidr", id="restore-cluster-cidr"),
        pytest.param("iptables", "legacy", "cluster-cidr", id="python-iptables-cluster-cidr"),
        pytest.param("nftables", None, "cluster-cidr", id="nftables-cluster-cidr"),
        pytest.param("auto", "nft", "prefix", id="restore-prefix"),
        pytest.param("nftables", None, "bridge", id="nftables-bridge"),
        pytest.param("auto", "nft", "none", id="restore-no-detection"),
        pytest.param("nftables", None, "none", id="nftables-no-detection"),
    ],
)
def test_local_policy_serves_the_cluster_from_every_endpoint(
    net: Cluster,
    services: ServicesFile,
    start_proc: StartProc,
    start_uproxy: StartUproxy,
    tmp_path: Path,
    rules: str,
    mode: str | None,
    detection: str,
) -> None:
    topo = net.topo
    flags, iptables_pods, nft_pods = DETECTION[detection]
    start_web(net, services, start_proc, local_service(net))
    proxy = start_uproxy(rules, extra=[*PORT_RANGE, *flags])
    proxy.wait_synced()
    ports = proxy.proxy_ports()
    c_port, e_port = ports[(LOCAL, "cluster")], ports[(LOCAL, "external")]
    if mode is None:
        want: Tables | str = local_nft(topo.node_ip, c_port, e_port, nft_pods)
    else:
        want = comparable(local_tables(topo.node_ip, c_port, e_port, iptables_pods))
    assert installed(net, mode) == want

    remote = {"web-1", "web-2", "web-3"}
    external = [
        f"http://{LB_IP}/",
        f"http://{EXTERNAL_IP}/",
        f"http://{topo.node_ip}:{LOCAL_NODE_PORT}/",
    ]
    for url in external:  # from outside: only local endpoints, none here: dropped
        assert connect_times_out(topo, topo.outside, url), url
        assert connect_times_out(topo, net.node_b, url), url
    # The node itself always reaches every endpoint (its LB IP and NodePort).
    for url in (external[0], external[2]):
        assert answered(net, topo.node, url, tmp_path, count=3) <= remote, url
    for url in external:
        if detection == "none":  # a pod is not told from outside traffic
            assert connect_times_out(topo, topo.pod, url), url
        else:
            assert answered(net, topo.pod, url, tmp_path, count=3) <= remote, url
