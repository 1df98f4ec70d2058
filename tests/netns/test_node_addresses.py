"""The node's addresses and primary address as a namespace's own kernel tells them
(``uproxy.nodeip`` over rtnetlink): the default route's source address, the interface it
leaves by, the lowest metric, a multipath route, another table, and the fallback.

The node namespace of the topology has, by interface index: ``pod0`` 10.200.1.1,
``backend0`` 10.200.2.1, ``eth0`` 10.200.3.1 (its default route: via ``outside``). So the
first global address is never the one its default route names, and a reader that took the
first address instead of following the route fails here.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.netns.conftest import DUAL_STACK
from tests.netns.topology import (
    NODE_BACKEND_SIDE,
    NODE_IP,
    NODE_IP6,
    NODE_POD_SIDE,
    OUTSIDE_IP,
    REPO,
    Topology,
    add_ip6,
    sh,
)

pytestmark = pytest.mark.root

BACKEND_IP = "10.200.2.2"

READ = """
import json, sys
from uproxy import nodeip
from uproxy.model import IPFamily
preferred = tuple(sys.argv[1:])
print(json.dumps({
    f.label: {
        "primary": nodeip.primary_address(f, preferred),
        "global": nodeip.local_addresses(f),
        "all": nodeip.local_addresses(f, global_only=False),
        "now": sorted(nodeip.addresses_now(f) or ()),
    }
    for f in IPFamily
}))
"""


def read(topo: Topology, *preferred: str) -> dict[str, Any]:
    """What uproxy reads of the node namespace's addresses, by family label."""
    out = sh(
        *topo.exec_argv(topo.node, "env", f"PYTHONPATH={REPO}", "python3", "-c", READ),
        *preferred,
    )
    found: dict[str, Any] = json.loads(out)
    return found


def route(topo: Topology, *args: str) -> None:
    sh("ip", "-n", topo.node, "route", *args)


def test_the_primary_address_follows_the_default_route(topo: Topology) -> None:
    v4 = read(topo)["IPv4"]
    assert v4["global"] == [NODE_POD_SIDE, NODE_BACKEND_SIDE, NODE_IP]
    assert v4["all"] == ["127.0.0.1", *v4["global"]]
    assert v4["now"] == sorted(v4["all"])
    assert v4["primary"] == NODE_IP  # eth0's, where the default route leaves

    # The route's own source address wins over its interface's.
    route(topo, "replace", "default", "via", OUTSIDE_IP, "dev", "eth0", "src", NODE_BACKEND_SIDE)
    assert read(topo)["IPv4"]["primary"] == NODE_BACKEND_SIDE

    # Of two default routes, the kernel's choice: the lower metric.
    route(topo, "del", "default")
    route(topo, "add", "default", "via", OUTSIDE_IP, "dev", "eth0", "metric", "200")
    route(topo, "add", "default", "via", BACKEND_IP, "dev", "backend0", "metric", "100")
    assert read(topo)["IPv4"]["primary"] == NODE_BACKEND_SIDE

    # A multipath default route: its first hop's interface.
    route(topo, "del", "default", "metric", "100")
    route(topo, "del", "default", "metric", "200")
    hops = ["nexthop", "via", BACKEND_IP, "dev", "backend0", "nexthop", "via", OUTSIDE_IP]
    route(topo, "add", "default", *hops, "dev", "eth0")
    assert read(topo)["IPv4"]["primary"] == NODE_BACKEND_SIDE

    # The Node's own addresses come first, when they are this host's.
    assert read(topo, "10.9.9.9", NODE_IP)["IPv4"]["primary"] == NODE_IP


def test_without_a_default_route_in_the_main_table_the_first_global_address(
    topo: Topology,
) -> None:
    route(topo, "del", "default")
    route(topo, "add", "default", "via", OUTSIDE_IP, "dev", "eth0", "table", "100")
    v4 = read(topo)["IPv4"]
    assert v4["primary"] == NODE_POD_SIDE
    sh("ip", "-n", topo.node, "addr", "flush", "scope", "global")
    v4 = read(topo)["IPv4"]
    assert (v4["primary"], v4["global"], v4["all"]) == (None, [], ["127.0.0.1"])


@pytest.mark.parametrize("topo", [DUAL_STACK], indirect=True)
def test_ipv6_global_addresses_only_and_its_own_default_route(topo: Topology) -> None:
    # The kernel's own link-local addresses may still be in duplicate address detection
    # (not usable, not listed): one that is usable at once.
    add_ip6(topo.node, "eth0", "fe80::99")
    v6 = read(topo)["IPv6"]
    assert NODE_IP6 in v6["global"]
    assert "fe80::99" in v6["all"] and "fe80::99" not in v6["global"]
    assert "::1" in v6["all"] and "::1" not in v6["global"]
    assert v6["global"][0] != NODE_IP6  # the route, not the order, names it
    assert v6["primary"] == NODE_IP6
    assert read(topo)["IPv4"]["primary"] == NODE_IP
