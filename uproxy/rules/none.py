"""The ``none`` backend: no kernel rules at all (laptop mode, or another steering layer)."""

from __future__ import annotations

from collections.abc import Collection

from uproxy.model import IPFamily
from uproxy.rules.base import LocalTraffic, Portal
from uproxy.rules.previous import NO_PREVIOUS, Previous


class NoRules:
    """Accepts every sync and installs nothing; remembers the last set for introspection."""

    name = "none"

    def __init__(self) -> None:
        self.portals: frozenset[Portal] = frozenset()
        self.previous_ports: Previous = NO_PREVIOUS  # no rules, so no last run's

    async def prepare(self) -> None:
        return None

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
