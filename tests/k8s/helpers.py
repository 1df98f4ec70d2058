"""Builders for Service/EndpointSlice/Node objects in the API's JSON shape, and real backends.

Backends listen on distinct loopback addresses (127.0.0.0/8 is all local on Linux) and one
port, because the endpoints of an EndpointSlice share their port. Each backend first sends
its address and a newline, then echoes, so a test learns which endpoint served it and can
check every byte that came back.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
from collections.abc import Iterable
from typing import Any

from uproxy.objects import HEADLESS_LABEL, SERVICE_NAME_LABEL, SERVICE_PROXY_NAME_LABEL

Obj = dict[str, Any]


def service(
    name: str,
    *,
    namespace: str = "default",
    port: int = 80,
    ports: Iterable[Obj] | None = None,
    cluster_ip: str = "10.96.0.10",
    labels: dict[str, str] | None = None,
    affinity: bool = False,
    spec: Obj | None = None,
) -> Obj:
    body: Obj = {
        "type": "ClusterIP",
        "clusterIP": cluster_ip,
        "clusterIPs": [cluster_ip],
        "ports": list(ports)
        if ports is not None
        else [{"name": "http", "port": port, "protocol": "TCP", "targetPort": 8080}],
        "sessionAffinity": "ClientIP" if affinity else "None",
    }
    if affinity:
        body["sessionAffinityConfig"] = {"clientIP": {"timeoutSeconds": 600}}
    body.update(spec or {})
    meta: Obj = {"name": name, "namespace": namespace}
    if labels:
        meta["labels"] = dict(labels)
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": body}


def endpoint_slice(
    name: str,
    *,
    service_name: str,
    ips: Iterable[str],
    port: int,
    namespace: str = "default",
    port_name: str = "http",
    labels: dict[str, str] | None = None,
    node: str = "node-a",
) -> Obj:
    all_labels = {SERVICE_NAME_LABEL: service_name, **(labels or {})}
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": namespace, "labels": all_labels},
        "addressType": "IPv4",
        "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
        "endpoints": [
            {"addresses": [ip], "conditions": {"ready": True}, "nodeName": node} for ip in ips
        ],
    }


def node(name: str, *, zone: str = "zone-a", ip: str = "192.0.2.10") -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"topology.kubernetes.io/zone": zone}},
        "spec": {},
        "status": {"addresses": [{"type": "InternalIP", "address": ip}]},
    }


def proxy_name_labels(value: str) -> dict[str, str]:
    return {SERVICE_PROXY_NAME_LABEL: value}


def headless_labels() -> dict[str, str]:
    return {HEADLESS_LABEL: ""}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Backends:
    """Echo servers on 127.0.0.<n>:port that announce their address first."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.servers: dict[str, asyncio.Server] = {}
        self._writers: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[Any]] = set()

    async def add(self, ip: str) -> None:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            if task is not None:
                self._handlers.add(task)
            self._writers.add(writer)
            try:
                writer.write(ip.encode() + b"\n")
                while data := await reader.read(65536):
                    writer.write(data)
                    await writer.drain()
            except ConnectionError:
                pass
            finally:
                self._writers.discard(writer)
                writer.close()
                if task is not None:
                    self._handlers.discard(task)

        self.servers[ip] = await asyncio.start_server(handle, ip, self.port)

    async def close(self) -> None:
        for server in self.servers.values():
            server.close()
        for writer in list(self._writers):
            writer.close()
        handlers = list(self._handlers)
        if handlers:
            await asyncio.wait(handlers, timeout=5)
        for server in self.servers.values():
            await server.wait_closed()
        self.servers.clear()


class Client:
    """One connection through uproxy: learns the backend, then round-trips checked payloads."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, backend: str):
        self.reader = reader
        self.writer = writer
        self.backend = backend

    @classmethod
    async def connect(cls, port: int, *, host: str = "127.0.0.1", timeout: float = 3.0) -> Client:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port)
            line = await reader.readline()
        if not line.endswith(b"\n"):
            writer.close()
            raise ConnectionError(f"no greeting from a backend through port {port}: {line!r}")
        return cls(reader, writer, line.decode().strip())

    async def round_trip(self, size: int = 4096, *, timeout: float = 3.0) -> None:
        payload = os.urandom(size)
        self.writer.write(payload)
        async with asyncio.timeout(timeout):
            await self.writer.drain()
            got = await self.reader.readexactly(size)
        if len(got) != size or hashlib.sha256(got).digest() != hashlib.sha256(payload).digest():
            raise AssertionError(f"payload corrupted through {self.backend}")

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except ConnectionError:
            pass


async def backend_of(port: int) -> str:
    """Open a connection through uproxy, check one payload, return the backend that served."""
    c = await Client.connect(port)
    try:
        await c.round_trip()
        return c.backend
    finally:
        await c.close()
