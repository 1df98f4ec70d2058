"""Finding this node's primary IPv4 address, for the host-side DNAT portal rules.

Traffic from the node itself to a ClusterIP is DNATed to node-IP:proxy-port, never to
127.0.0.1 (that would need route_localnet, CVE-2020-8558). The address is read from the
routing table (the source address of the default route, else the first global address),
without sending anything.
"""

from __future__ import annotations

import ipaddress
import json
import subprocess


def _ip_json(*args: str) -> list[dict[str, object]]:
    try:
        out = subprocess.run(
            ["ip", "-j", *args], capture_output=True, text=True, timeout=5, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    data = json.loads(out or "[]")
    return data if isinstance(data, list) else []


def local_ipv4_addresses(*, global_only: bool = True) -> list[str]:
    """This host's IPv4 addresses (global scope only, by default)."""
    out = []
    for link in _ip_json("-4", "addr", "show"):
        infos = link.get("addr_info")
        for info in infos if isinstance(infos, list) else []:
            if isinstance(info, dict) and (not global_only or info.get("scope") == "global"):
                out.append(str(info.get("local")))
    return out


def primary_ipv4(preferred: tuple[str, ...] = ()) -> str | None:
    """The node IP: the first IPv4 of ``preferred`` (the Node's addresses) present locally,
    else the default route's source address, else the first global IPv4 address."""
    local = local_ipv4_addresses()
    for ip in preferred:
        if ip in local:
            return ip
    for route in _ip_json("-4", "route", "show", "default"):
        src = route.get("prefsrc")
        if isinstance(src, str):
            return src
        dev = route.get("dev")
        if isinstance(dev, str):
            for link in _ip_json("-4", "addr", "show", "dev", dev):
                infos = link.get("addr_info")
                for info in infos if isinstance(infos, list) else []:
                    if isinstance(info, dict) and info.get("scope") == "global":
                        return str(info.get("local"))
    return local[0] if local else None


def is_unspecified(ip: str) -> bool:
    return ipaddress.ip_address(ip).is_unspecified
