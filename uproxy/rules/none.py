"""The ``none`` backend: no kernel rules at all (laptop mode, or another steering layer)."""

from __future__ import annotations

import logging
from collections.abc import Collection

from uproxy.log import kv
from uproxy.model import IPFamily
from uproxy.rules import command
from uproxy.rules.base import LeftoverPorts, LocalTraffic, Portal, no_leftover_ports
from uproxy.rules.previous import NO_PREVIOUS, PortalKey, Previous

log = logging.getLogger("uproxy.rules")


class NoRules:
    """Accepts every sync and installs nothing; remembers the last set for introspection."""

    name = "none"

    def __init__(self, leftover_ports: LeftoverPorts = no_leftover_ports) -> None:
        self.portals: frozenset[Portal] = frozenset()
        self.previous_ports: Previous = NO_PREVIOUS  # no rules, so no last run's
        self._leftover_ports = leftover_ports

    async def prepare(self) -> None:
        """Say so when an earlier run's rules are in place (a node run, then ``--rules
        none``): they steer service addresses to proxy ports this run may never open, or
        give to other services. Left alone (``none`` touches no rules); read only with the
        privilege to, so a laptop start spawns nothing."""
        if not command.has_net_admin():
            return
        found: dict[PortalKey, int] = {}
        families = (IPFamily.V4, IPFamily.V6)
        modes = ("nft", "legacy")
        await self._leftover_ports(found, nft_tables=True, iptables_modes=modes, families=families)
        if found:
            log.warning(
                "Rules of an earlier run with --rules are in place and steer service "
                "addresses to its proxy ports; --rules none leaves them: uproxy --cleanup "
                "removes them",
                extra=kv(addresses=len(found)),
            )

    async def sync(self, portals: Collection[Portal]) -> None:
        self.portals = frozenset(portals)

    def set_local_traffic(self, local: LocalTraffic) -> None:
        return None

    def set_host_ip(self, family: IPFamily, host_ip: str) -> None:
        return None

    async def check(self) -> bool:
        return True

    async def cleanup(self) -> None:
        self.portals = frozenset()

    async def close(self) -> None:
        return None
