"""Finding this node's addresses, per IP family, for the host-side DNAT portal rules.

Traffic from the node itself to a service address is DNATed to node-IP:proxy-port, never to
127.0.0.1 or ::1 (that would need route_localnet, CVE-2020-8558, and has no IPv6 equivalent).
Each family the node serves needs its own: the source address of that family's default route,
else its first global address (for IPv6: global scope, so ULA counts and link-local does
not). Read from the routing table, without sending anything.
"""

from __future__ import annotations

import ipaddress
import json
import subprocess

from uproxy.model import IPFamily


def _ip_json(*args: str) -> list[dict[str, object]]:
    try:
        out = subprocess.run(
            ["ip", "-j", *args], capture_output=True, text=True, timeout=5, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    data = json.loads(out or "[]")
    return data if isinstance(data, list) else []


def _addresses(*args: str, global_only: bool) -> list[str]:
    out = []
    for link in _ip_json(*args):
        infos = link.get("addr_info")
        for info in infos if isinstance(infos, list) else []:
            if not isinstance(info, dict) or (global_only and info.get("scope") != "global"):
                continue
            if info.get("tentative") or info.get("dadfailed"):
                continue  # not usable (yet): IPv6 duplicate address detection
            out.append(str(info.get("local")))
    return out


def local_addresses(family: IPFamily, *, global_only: bool = True) -> list[str]:
    """This host's addresses of one family (global scope only, by default)."""
    return _addresses(f"-{family.value}", "addr", "show", global_only=global_only)


def local_ipv4_addresses(*, global_only: bool = True) -> list[str]:
    """This host's IPv4 addresses (global scope only, by default)."""
    return local_addresses(IPFamily.V4, global_only=global_only)


def primary_address(family: IPFamily, preferred: tuple[str, ...] = ()) -> str | None:
    """The node IP of one family: the first of ``preferred`` (the Node's addresses) present
    locally, else the default route's source address, else the first global address."""
    flag = f"-{family.value}"
    local = local_addresses(family)
    for ip in preferred:
        if ip in local:
            return ip
    for route in _ip_json(flag, "route", "show", "default"):
        src = route.get("prefsrc")
        if isinstance(src, str):
            return src
        dev = route.get("dev")
        if isinstance(dev, str):
            found = _addresses(flag, "addr", "show", "dev", dev, global_only=True)
            if found:
                return found[0]
    return local[0] if local else None


def primary_ipv4(preferred: tuple[str, ...] = ()) -> str | None:
    """The node's primary IPv4 address (see ``primary_address``)."""
    return primary_address(IPFamily.V4, preferred)


def is_unspecified(ip: str) -> bool:
    return ipaddress.ip_address(ip).is_unspecified
