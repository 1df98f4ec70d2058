"""Forgetting stale UDP conntrack entries when a UDP service port goes away or moves.

UDP has no connection teardown: after a portal changes, conntrack keeps translating a client's
"flow" to the old proxy port until the entry times out, and the client's datagrams vanish.
kube-proxy deletes those entries with the conntrack tool; so does uproxy. Exit code 1 with
"0 flow entries have been deleted" means there was nothing to forget, which is fine.
"""

from __future__ import annotations

import ipaddress
import logging

from uproxy.rules import command
from uproxy.rules.base import RulesError

log = logging.getLogger("uproxy.rules.conntrack")

_NOTHING = "0 flow entries"


async def _delete(args: list[str]) -> int:
    done = await command.run(["conntrack", "-D", *args], check=False)
    if done.returncode == 0:
        return _deleted_count(done.stderr)
    if done.returncode == 1 and _NOTHING in done.stderr:
        return 0
    raise RulesError(f"conntrack failed: {done.message}")


def _deleted_count(stderr: str) -> int:
    for line in stderr.splitlines():
        if "flow entries have been deleted" in line:
            head = line.split()[-6] if len(line.split()) >= 6 else ""
            if head.isdigit():
                return int(head)
    return 0


def _family(ip: str) -> list[str]:
    return ["-f", "ipv6"] if ipaddress.ip_address(ip).version == 6 else []


async def clear_udp(ip: str, port: int) -> None:
    """Delete UDP conntrack entries whose original destination is ``ip:port``."""
    count = await _delete([*_family(ip), "-p", "udp", "--orig-dst", ip, "--dport", str(port)])
    log.debug("Cleared UDP conntrack", extra={"kv": {"ip": ip, "port": port, "count": count}})


async def clear_udp_node_port(port: int, *, ipv6: bool = False) -> None:
    """Delete UDP conntrack entries to ``port`` on any address (a node port)."""
    family = ["-f", "ipv6"] if ipv6 else []
    count = await _delete([*family, "-p", "udp", "--dport", str(port)])
    log.debug("Cleared UDP conntrack", extra={"kv": {"port": port, "count": count}})
