"""Holding every node port open with a real socket, so no other program can take it.

The portal rules REDIRECT node-port traffic before it reaches any socket, so without a
reservation another program could bind the same port and silently lose all its traffic (or,
worse, receive it when the rules are flushed). As kube-proxy did, uproxy binds each node port
itself; a TCP reservation also listens so that ``ss -ltn`` shows who owns the port. A port that
is already taken is reported with the service and the port, and the sync goes on.

With ``--nodeport-addresses`` node ports answer on some of the node's addresses only, so the
reservation binds each of those addresses rather than 0.0.0.0: the port stays free for other
programs on the other addresses, and a client reaching one of those finds nothing listening
(a reservation listening on 0.0.0.0 would complete its handshake and then never answer).
When no address of the node is in those CIDRs, ownership is still recorded, with no socket.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from uproxy.model import Protocol, ServicePortName

log = logging.getLogger("uproxy.rules.nodeports")


class NodePortError(Exception):
    """A node port could not be reserved; the message names the service and the port."""


@dataclass(slots=True)
class _Reservation:
    owner: ServicePortName
    socks: list[socket.socket]


Key = tuple[Protocol, int]


class NodePortReservations:
    """Bound sockets per (protocol, node port): one per address in ``bind_ips``."""

    def __init__(self, *, bind_ips: Sequence[str] = ("0.0.0.0",)) -> None:
        self.bind_ips = tuple(bind_ips)
        self._held: dict[Key, _Reservation] = {}

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, key: object) -> bool:
        return key in self._held

    def owner(self, protocol: Protocol, port: int) -> ServicePortName | None:
        held = self._held.get((protocol, port))
        return held.owner if held is not None else None

    def _open(self, protocol: Protocol, port: int) -> list[socket.socket]:
        """One socket per address, or none at all (OSError naming the address)."""
        socks: list[socket.socket] = []
        try:
            for ip in self.bind_ips:
                socks.append(_bind(ip, protocol, port))
        except OSError as exc:
            for sock in socks:
                sock.close()
            where = f" on {self.bind_ips[len(socks)]}" if len(self.bind_ips) > 1 else ""
            raise OSError(exc.errno, f"{exc.strerror or exc}{where}") from None
        return socks

    def reserve(self, service: ServicePortName, protocol: Protocol, port: int) -> None:
        """Hold ``port`` for ``service``; idempotent; NodePortError when it is taken."""
        key = (protocol, port)
        held = self._held.get(key)
        if held is not None:
            if held.owner != service:
                log.info(
                    "Node port changes owner",
                    extra={"kv": {"port": port, "from": str(held.owner), "to": str(service)}},
                )
                held.owner = service
            return
        try:
            socks = self._open(protocol, port)
        except OSError as exc:
            raise NodePortError(
                f"node port {port}/{protocol.value} for service {service} is not available: "
                f"{exc.strerror or exc}"
            ) from None
        self._held[key] = _Reservation(service, socks)
        log.debug(
            "Reserved node port",
            extra={"kv": {"service": str(service), "port": port, "protocol": protocol.value}},
        )

    def release(self, protocol: Protocol, port: int) -> None:
        """Close the reservation for ``port`` (no-op when not held)."""
        held = self._held.pop((protocol, port), None)
        if held is not None:
            for sock in held.socks:
                sock.close()

    def sync(self, desired: Mapping[Key, ServicePortName]) -> list[NodePortError]:
        """Reserve and release by difference; returns the ports that could not be reserved."""
        for key in [k for k in self._held if k not in desired]:
            self.release(*key)
        failures: list[NodePortError] = []
        for (protocol, port), service in sorted(desired.items()):
            try:
                self.reserve(service, protocol, port)
            except NodePortError as exc:
                failures.append(exc)
        return failures

    def close(self) -> None:
        for key in list(self._held):
            self.release(*key)


def _bind(ip: str, protocol: Protocol, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    kind = socket.SOCK_STREAM if protocol is Protocol.TCP else socket.SOCK_DGRAM
    sock = socket.socket(family, kind)
    try:
        if protocol is Protocol.TCP:
            # Lets us re-take a port with TIME_WAIT leftovers; still fails on a live listener.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((ip, port))
        if protocol is Protocol.TCP:
            sock.listen(1)
    except OSError:
        sock.close()
        raise
    return sock
