"""What other rules backends left: removed once a backend's first rules are in, as
kube-proxy removes the rules of its other proxy modes when it starts.

Switching ``--rules`` (or ``--iptables-mode``) between runs would otherwise leave the last
run's portals in place, pointing at proxy ports nobody listens on any more: uproxy's nft
table runs before the iptables nat chains (priority -101), so after a switch from nftables
to iptables-restore its stale maps would still catch every ClusterIP first; the other way
round, services gone since the switch would still be redirected by the old chains. Only
uproxy's own tables, chains and jumps are touched, exactly as ``--cleanup`` removes them.

Not before the first sync: from the removal to the new rules no rule would steer a service
address, and a SYN sent then got a conntrack entry without NAT that its retransmissions kept
(measured on a switch: a client hung for the kernel's SYN retries). Until they go, those
rules lead to the ports the new run opened its listeners on: ``leftover_ports`` reads them at
start, as a backend reads its own last run's (``previous``).

The backends do not import this module: ``make_backend`` hands ``remove_leftovers`` and
``leftover_ports`` to each one it builds (``base.Leftovers``, ``base.LeftoverPorts``), and
only this module imports the backends' removal and reading steps: the imports between them
run one way.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from uproxy.log import V2, kv
from uproxy.model import IPFamily
from uproxy.rules.base import RulesError
from uproxy.rules.previous import PortalKey

log = logging.getLogger("uproxy.rules")


async def remove_leftovers(*, nft_tables: bool, iptables_modes: Iterable[str]) -> bool:
    """Remove uproxy's nft tables (``nft_tables``) and its chains and jumps in the given
    iptables variants, both families. A failure is one warning (the start goes on: the
    leftovers only matter where they exist). Whether anything was removed."""
    from uproxy.rules.nftables import TABLE, cleanup_tables
    from uproxy.rules.restore import FAMILIES, cleanup_mode, may_hold_ours
    from uproxy.rules.watch import nft_tables as kernel_tables

    iptables_modes = tuple(iptables_modes)
    if nft_tables:  # an iptables backend
        _warn_kube_proxy_nftables(kernel_tables())
        await _warn_kube_proxy_iptables(iptables_modes)
    removed = False
    steps: list[tuple[str, str, IPFamily | None]] = [("nftables", "", None)] if nft_tables else []
    steps += [("iptables", mode, family) for mode in iptables_modes for family in FAMILIES]
    for kind, mode, family in steps:
        # Asked of the kernel first (netlink, /proc): usually nothing is there to read, and
        # a start then runs no program for it.
        if family is None:
            tables = kernel_tables()
            if tables is not None and not any(name == TABLE for _, name in tables):
                continue
        elif may_hold_ours(mode, family) is False:
            continue
        try:
            done = await (cleanup_tables() if family is None else cleanup_mode(mode, family))
        except RulesError as exc:
            log.warning(
                "Cannot look for rules another rules backend left",
                extra=kv(rules=kind, mode=mode, err=exc),
            )
            continue
        if done:
            removed = True
            log.info(
                "Removed the rules another rules backend left (a run with other --rules "
                "or --iptables-mode)",
                extra=kv(rules=kind, mode=mode, family=family.label if family else ""),
            )
    return removed


async def leftover_ports(
    into: dict[PortalKey, int],
    *,
    nft_tables: bool,
    iptables_modes: Iterable[str],
    families: Iterable[IPFamily],
) -> None:
    """Add the proxy ports other backends' rules lead to (``base.LeftoverPorts``): those of
    uproxy's nft tables (``nft_tables``) and of its chains in the given iptables variants.
    What cannot be read is left out (logged at -v 2): the start goes on."""
    from uproxy.rules.nftables import read_previous as nft_previous
    from uproxy.rules.restore import read_previous as chains_previous

    families = tuple(families)
    found: dict[PortalKey, int] = {}
    try:
        if nft_tables:
            found.update(await nft_previous(families))
        for mode in iptables_modes:
            found.update(await chains_previous(mode, families))
    except (RulesError, OSError, ValueError) as exc:
        log.log(V2, "Cannot read the rules another rules backend left", extra=kv(err=exc))
    for key, port in found.items():
        into.setdefault(key, port)


# kube-proxy's nftables mode hooks its table in at ``dstnat`` (-100), the priority of the
# iptables nat chains, and the kernel orders hooks of one priority as they were registered:
# which proxy gets a ClusterIP's packets first is not up to uproxy. (uproxy's own nft table
# runs at -101, before kube-proxy's.)
_KUBE_PROXY_TABLE = "kube-proxy"


def _warn_kube_proxy_nftables(tables: frozenset[tuple[int, str]] | None) -> None:
    if tables and any(name == _KUBE_PROXY_TABLE for _, name in tables):
        log.warning(
            "kube-proxy's nftables rules are in place; with iptables rules ClusterIP traffic "
            "may reach them before uproxy's portals (same priority): use --rules nftables, "
            "whose table runs first, or remove them (kube-proxy --cleanup)",
        )


async def _warn_kube_proxy_iptables(modes: Iterable[str]) -> None:
    """One line per variant and family (of ``modes``, those uproxy does not write) where
    kube-proxy's iptables mode left its service jumps. Both variants hook their nat chains in
    at -100 and the table registered last runs first: uproxy's jumps, first in its own
    variant, may come after kube-proxy's in the other."""
    from uproxy.rules.restore import FAMILIES, others_service_jumps

    for mode in modes:
        for family in FAMILIES:
            try:
                chains = await others_service_jumps(mode, family)
            except RulesError:
                continue  # a program missing or refused: the removal below says so
            if chains:
                log.warning(
                    "kube-proxy's iptables rules are in place in the other iptables variant; "
                    "ClusterIP traffic may reach them before uproxy's portals (same priority): "
                    "remove them (kube-proxy --cleanup, in that variant), or use --rules "
                    "nftables, whose table runs first",
                    extra=kv(mode=mode, family=family.label, chains=",".join(chains)),
                )
