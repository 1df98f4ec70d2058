"""Rules backends: how traffic to service addresses is steered into uproxy's proxy ports.

``make_backend`` maps the ``--rules`` flag to a backend; ``cleanup_all`` is ``uproxy
--cleanup``: it removes whatever any backend ever installed, uproxy's nft tables (``ip`` and
``ip6``) and its chains in either iptables variant of either family (``iptables`` and
``ip6tables``), and nothing else.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

from uproxy.rules.base import (
    NO_LOCAL_TRAFFIC,
    LocalTraffic,
    Portal,
    PortalKind,
    RulesBackend,
    RulesError,
    Stack,
)
from uproxy.rules.none import NoRules

if TYPE_CHECKING:
    from uproxy.rules.nftables import NftablesBackend
    from uproxy.rules.pyiptables import IptcBackend
    from uproxy.rules.restore import RestoreBackend

# A backend's module is imported when it is chosen: every process that reads
# ``uproxy.rules.base`` runs this package first, and python-iptables' backend alone pulls in
# multiprocessing and a process pool.
_LAZY = {
    "IptcBackend": "uproxy.rules.pyiptables",
    "NftablesBackend": "uproxy.rules.nftables",
    "RestoreBackend": "uproxy.rules.restore",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "BACKEND_NAMES",
    "IptcBackend",
    "LocalTraffic",
    "NftablesBackend",
    "NoRules",
    "Portal",
    "PortalKind",
    "RestoreBackend",
    "RulesBackend",
    "RulesError",
    "Stack",
    "cleanup_all",
    "make_backend",
]

log = logging.getLogger("uproxy.rules")

BACKEND_NAMES = ("auto", "iptables-restore", "nftables", "iptables", "none")


def make_backend(
    name: str,
    *,
    host_ip: str | Sequence[str],
    iptables_mode: str = "auto",
    listen_ip: str | Sequence[str] = "0.0.0.0",
    dial_mark: int = 0,
    nodeport_cidrs: Collection[str] = (),
    local: LocalTraffic = NO_LOCAL_TRAFFIC,
    proxy_ports: tuple[int, int] | None = None,
) -> RulesBackend:
    """The backend for ``--rules NAME``; RulesError naming the choices for an unknown one.

    ``host_ip`` is the node address the node's own traffic is DNATed to, one per IP family
    the rules serve (a single address: one family); ``listen_ip`` where each family's proxy
    ports listen (a family not named: any address of it, so REDIRECT).

    ``dial_mark`` is the packet mark on uproxy's own dials (``--dial-mark``): the host portal
    chains return on it first thing. 0: no such rule. ``nodeport_cidrs`` limit node ports to
    local addresses in them (``--nodeport-addresses``; empty: every local address);
    ``local`` tells traffic from pods apart (``--detect-local-mode``); ``proxy_ports`` is
    the range proxy ports are taken from (the iptables backends' direct-drop jump matches
    only it).
    """
    from uproxy.rules.leftovers import leftover_ports, remove_leftovers

    if name in ("auto", "iptables-restore", "iptables"):
        cls: type[IptcBackend | RestoreBackend]
        if name == "iptables":
            cls = importlib.import_module("uproxy.rules.pyiptables").IptcBackend
        else:
            cls = importlib.import_module("uproxy.rules.restore").RestoreBackend
        return cls(
            host_ip=host_ip,
            mode=iptables_mode,
            listen_ip=listen_ip,
            dial_mark=dial_mark,
            nodeport_cidrs=nodeport_cidrs,
            proxy_ports=proxy_ports,
            local=local,
            leftovers=remove_leftovers,
            leftover_ports=leftover_ports,
        )
    if name == "nftables":
        from uproxy.rules.nftables import NftablesBackend

        return NftablesBackend(
            host_ip=host_ip,
            listen_ip=listen_ip,
            dial_mark=dial_mark,
            nodeport_cidrs=nodeport_cidrs,
            local=local,
            leftovers=remove_leftovers,
            leftover_ports=leftover_ports,
        )
    if name == "none":
        return NoRules(leftover_ports=leftover_ports)
    raise RulesError(f"unknown rules backend {name!r}: use one of {', '.join(BACKEND_NAMES)}")


async def cleanup_all() -> bool:
    """Remove uproxy's nft tables and every uproxy jump, rule and chain from nft and legacy
    iptables and ip6tables.

    The python-iptables backend writes the legacy tables, so the legacy pass removes its rules
    too. Returns whether anything was removed; succeeds when nothing is installed. What
    could not be removed (a program missing where the kernel has tables it would read, no
    permission) is one RulesError for all, raised after everything else was removed.
    """
    from uproxy.rules import command
    from uproxy.rules.nftables import cleanup_tables
    from uproxy.rules.restore import FAMILIES, MODES, cleanup_mode

    if command.has_net_admin() is False:
        raise RulesError(f"this process lacks CAP_NET_ADMIN; {command.PRIVILEGE_FIX}")
    removed = False
    problems: list[str] = []
    denied: list[str] = []  # programs refused: one line for all of them, and one hint
    steps = [cleanup_tables] + [
        functools.partial(cleanup_mode, mode, family) for mode in MODES for family in FAMILIES
    ]
    for step in steps:  # each on its own: one that fails leaves the others to do theirs
        try:
            removed = await step() or removed
        except command.PermissionDenied as exc:
            denied.append(exc.program)
        except RulesError as exc:
            problems.append(str(exc))
    if denied:
        problems.append(f"{', '.join(denied)}: permission denied; {command.PRIVILEGE_FIX}")
    if problems:
        raise RulesError("; ".join(problems))
    if not removed:
        log.info("No rules to remove")
    return removed
