"""The rules-backend protocol: what the syncer asks of whatever steers traffic into uproxy.

A backend owns only its own chains. ``sync`` receives the *full* desired set of portals
every time (never a delta) and must make the kernel match it atomically and idempotently,
re-creating base chains and jumps that someone removed. ``cleanup`` removes everything
uproxy ever installed with that backend and is safe to run when nothing is installed.
"""

from __future__ import annotations

import enum
from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol as TypingProtocol

from uproxy.model import Protocol, ServicePortName


class PortalKind(enum.StrEnum):
    CLUSTER_IP = "cluster-ip"
    EXTERNAL_IP = "external-ip"
    LB_INGRESS = "lb-ingress"
    NODE_PORT = "node-port"


@dataclass(frozen=True, slots=True, order=True)
class Portal:
    """One service address that must land on one uproxy proxy port."""

    service: ServicePortName
    kind: PortalKind
    ip: str | None  # None for a NodePort: every local address (or --nodeport-addresses)
    port: int  # the service port, or the node port
    proxy_port: int  # where uproxy listens for this traffic

    @property
    def protocol(self) -> Protocol:
        return self.service.protocol


class RulesError(Exception):
    """The backend could not program the kernel; the message says why and what to do."""


class RulesBackend(TypingProtocol):
    name: str

    async def sync(self, portals: Collection[Portal]) -> None:
        """Make the installed rules exactly ``portals``; raise RulesError on failure."""

    async def check(self) -> bool:
        """Cheap check that the installed rules are still in place (False: resync now)."""

    async def cleanup(self) -> None:
        """Remove every chain, rule and jump this backend installs; idempotent."""

    async def close(self) -> None:
        """Release resources (threads, locks); leaves the rules in place."""
