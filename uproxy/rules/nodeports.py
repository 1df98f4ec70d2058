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

Node ports are held per IP family: a service is proxied in the families of its ClusterIPs,
and its node port answers on the node's addresses of those families only (an IPv4-only
service's node port is free on the node's IPv6 addresses, as in kube-proxy). An IPv6 socket
is IPv6-only, so ``::`` never takes the port on IPv4 addresses too.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from uproxy.model import IPFamily, Protocol, ServicePortName, ip_family

log = logging.getLogger("uproxy.rules.nodeports")


class NodePortError(Exception):
    """A node port could not be reserved; the message names the service and the port."""


@dataclass(slots=True)
class _Reservation:
    owner: ServicePortName
    socks: list[socket.socket]


Key = tuple[Protocol, int, IPFamily]


class NodePortReservations:
    """Bound sockets per (protocol, node port, family): one per address of that family in
    ``bind_ips``."""

    def __init__(self, *, bind_ips: Sequence[str] = ("0.0.0.0",)) -> None:
        self.bind_ips = tuple(bind_ips)
        self._held: dict[Key, _Reservation] = {}

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, key: object) -> bool:
        return key in self._held

    def owner(
        self, protocol: Protocol, port: int, family: IPFamily = IPFamily.V4
    ) -> ServicePortName | None:
        held = self._held.get((protocol, port, family))
        return held.owner if held is not None else None

    def _open(self, protocol: Protocol, port: int, family: IPFamily) -> list[socket.socket]:
        """One socket per address of ``family``, or none at all (OSError naming the address)."""
        ips = [ip for ip in self.bind_ips if ip_family(ip) is family]
        socks: list[socket.socket] = []
        try:
            for ip in ips:
                socks.append(_bind(ip, protocol, port))
        except OSError as exc:
            for sock in socks:
                sock.close()
            where = f" on {ips[len(socks)]}" if len(ips) > 1 else ""
            raise OSError(exc.errno, f"{exc.strerror or exc}{where}") from None
        return socks

    def reserve(
        self,
        service: ServicePortName,
        protocol: Protocol,
        port: int,
        family: IPFamily = IPFamily.V4,
    ) -> None:
        """Hold ``port`` for ``service``; idempotent; NodePortError when it is taken."""
        key = (protocol, port, family)
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
            socks = self._open(protocol, port, family)
        except OSError as exc:
            which = f"{port}/{protocol.value}" + (" (IPv6)" if family is IPFamily.V6 else "")
            raise NodePortError(
                f"node port {which} for service {service} is not available: {exc.strerror or exc}"
            ) from None
        self._held[key] = _Reservation(service, socks)
        log.debug(
            "Reserved node port",
            extra={"kv": {"service": str(service), "port": port, "protocol": protocol.value}},
        )

    def release(self, protocol: Protocol, port: int, family: IPFamily = IPFamily.V4) -> None:
        """Close the reservation for ``port`` (no-op when not held)."""
        held = self._held.pop((protocol, port, family), None)
        if held is not None:
            for sock in held.socks:
                sock.close()

    def sync(self, desired: Mapping[Key, ServicePortName]) -> list[NodePortError]:
        """Reserve and release by difference; returns the ports that could not be reserved."""
        for key in [k for k in self._held if k not in desired]:
            self.release(*key)
        failures: list[NodePortError] = []
        for (protocol, port, family), service in sorted(desired.items()):
            try:
                self.reserve(service, protocol, port, family)
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
        if family == socket.AF_INET6:  # "::" must not take the port on IPv4 addresses too
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
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
