"""The Node as the whole proxy follows it on a node (against the API-server double).

--detect-local-mode NodeCIDR: the pods' CIDRs are the Node's spec.podCIDRs, read through the
API server when the Node is listed and followed when they change (the rules are told, and a
rules sync follows). The Node's IPs: when they change, uproxy stops to be started again with
them, as kube-proxy does."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Collection
from pathlib import Path
from typing import Any

import pytest

from tests.apiserver import ApiServerDouble
from tests.conftest import wait_for
from tests.k8s.conftest import NODE
from tests.k8s.helpers import node
from uproxy.model import IPFamily
from uproxy.proxy import Proxy
from uproxy.rules.base import LocalTraffic, Portal
from uproxy.settings import Settings


class RecordingRules:
    """A rules backend that programs nothing and remembers what it was told, in order."""

    name = "recording"

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []

    async def prepare(self) -> None:

        return None

    async def sync(self, portals: Collection[Portal]) -> None:
        self.events.append(("sync", len(portals)))

    def set_local_traffic(self, local: LocalTraffic) -> None:
        self.events.append(("local", local))

    def set_host_ip(self, family: IPFamily, host_ip: str) -> None:
        self.events.append(("host", (family, host_ip)))

    async def check(self) -> bool:
        return True

    async def cleanup(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def told(self, local: LocalTraffic) -> bool:
        """The last pod detection is ``local``, and a rules sync came after it."""
        changes = [i for i, (kind, _) in enumerate(self.events) if kind == "local"]
        if not changes or self.events[changes[-1]] != ("local", local):
            return False
        return any(kind == "sync" for kind, _ in self.events[changes[-1] :])


def with_pod_cidrs(*cidrs: str) -> dict[str, Any]:
    obj = node(NODE)
    obj["spec"] = {"podCIDR": cidrs[0], "podCIDRs": list(cidrs)} if cidrs else {}
    return obj


@pytest.fixture
async def proxy_with(kubeconfig: Path) -> AsyncIterator[Any]:
    started: list[Proxy] = []

    async def start(rules: RecordingRules) -> Proxy:
        settings = Settings(
            kubeconfig=str(kubeconfig),
            hostname_override=NODE,
            rules="iptables-restore",  # node mode; the backend itself is the recorder
            detect_local_mode="NodeCIDR",
            workers=0,
            dial_mark=0,
            healthz_bind_address="",
            metrics_bind_address="",
            iptables_min_sync_period=0.05,
        )
        proxy = Proxy(settings, rules=rules)
        started.append(proxy)
        await proxy.start()
        return proxy

    yield start
    for proxy in started:
        await proxy.stop()


async def test_node_cidr_follows_the_nodes_pod_cidrs(
    apiserver: ApiServerDouble, proxy_with: Any
) -> None:
    apiserver.create("Node", with_pod_cidrs("10.244.1.0/24", "fd00:244:1::/64"))
    rules = RecordingRules()
    proxy = await proxy_with(rules)
    first = LocalTraffic(cidrs=("10.244.1.0/24", "fd00:244:1::/64"))
    await wait_for(lambda: rules.told(first), timeout=10, message="the Node's podCIDRs")

    apiserver.update("Node", with_pod_cidrs("10.244.7.0/24"))
    moved = LocalTraffic(cidrs=("10.244.7.0/24",))
    await wait_for(lambda: rules.told(moved), timeout=10, message="the new podCIDRs")

    # A Node without podCIDRs: pods are no longer told apart (only the node itself is).
    apiserver.update("Node", with_pod_cidrs())
    await wait_for(lambda: rules.told(LocalTraffic()), timeout=10, message="no podCIDRs")
    assert proxy.local_traffic == LocalTraffic()


async def test_a_change_of_the_nodes_ips_stops_uproxy_to_start_again(
    apiserver: ApiServerDouble, proxy_with: Any
) -> None:
    apiserver.create("Node", node(NODE, ip="192.0.2.10"))
    proxy = await proxy_with(RecordingRules())
    await wait_for(lambda: proxy.tracker.node is not None, message="the Node listed")
    apiserver.update("Node", node(NODE, zone="zone-b", ip="192.0.2.10"))  # not its IPs
    await wait_for(lambda: proxy.tracker.node is not None and proxy.tracker.node.zone == "zone-b")
    moved = node(NODE, zone="zone-b", ip="192.0.2.10")
    moved["status"]["addresses"].append({"type": "ExternalIP", "address": "203.0.113.10"})
    # An ExternalIP beside an InternalIP of the same family: not one of its IPs (had it
    # counted, the stop below would name it).
    apiserver.update("Node", moved)
    apiserver.update("Node", node(NODE, zone="zone-b", ip="192.0.2.99"))
    await asyncio.wait_for(proxy.wait(), 10)  # what run() waits for before it stops
    assert proxy.failure == (
        "this node's IPs changed from 192.0.2.10 to 192.0.2.99: start uproxy again"
    )
