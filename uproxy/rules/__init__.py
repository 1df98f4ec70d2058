"""Rules backends: how traffic to service addresses is steered into uproxy's proxy ports.

``make_backend`` maps the ``--rules`` flag to a backend; ``cleanup_all`` is ``uproxy
--cleanup``: it removes whatever any backend ever installed, in either iptables variant.
"""

from __future__ import annotations

import logging

from uproxy.rules.base import Portal, PortalKind, RulesBackend, RulesError
from uproxy.rules.none import NoRules
from uproxy.rules.portals import ANY_IPV4
from uproxy.rules.pyiptables import IptcBackend
from uproxy.rules.restore import MODES, RestoreBackend, cleanup_mode

__all__ = [
    "BACKEND_NAMES",
    "IptcBackend",
    "NoRules",
    "Portal",
    "PortalKind",
    "RestoreBackend",
    "RulesBackend",
    "RulesError",
    "cleanup_all",
    "make_backend",
]

log = logging.getLogger("uproxy.rules")

BACKEND_NAMES = ("auto", "iptables-restore", "iptables", "none")


def make_backend(
    name: str, *, host_ip: str, iptables_mode: str = "auto", listen_ip: str = ANY_IPV4
) -> RulesBackend:
    """The backend for ``--rules NAME``; RulesError naming the choices for an unknown one."""
    if name in ("auto", "iptables-restore"):
        return RestoreBackend(host_ip=host_ip, mode=iptables_mode, listen_ip=listen_ip)
    if name == "iptables":
        return IptcBackend(host_ip=host_ip, mode=iptables_mode, listen_ip=listen_ip)
    if name == "none":
        return NoRules()
    raise RulesError(f"unknown rules backend {name!r}: use one of {', '.join(BACKEND_NAMES)}")


async def cleanup_all() -> bool:
    """Remove every uproxy jump, rule and chain from nft and legacy tables.

    The python-iptables backend writes the legacy tables, so the legacy pass removes its rules
    too. Returns whether anything was removed; succeeds when nothing is installed.
    """
    removed = False
    for mode in MODES:
        removed = await cleanup_mode(mode) or removed
    if not removed:
        log.info("No iptables rules to remove")
    return removed
