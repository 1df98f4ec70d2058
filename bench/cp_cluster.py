"""The cluster the control-plane runs measure: N services, their slices, and an API server.

Every service is a single-port ClusterIP service with one EndpointSlice holding one ready
endpoint, so N services are N proxy ports, N listeners and 2N portal rules (one for traffic
from pods, one for traffic from the node). The same objects are served by
``tests.apiserver.ApiServerDouble`` (the real wire format: TLS, paged lists, chunked
watches) or written as a services file, so the two cold starts read the same cluster.

The double runs in its own process, on the load core, in the node's network namespace (where
uproxy reaches it on 127.0.0.1). Besides the Kubernetes API it listens on a unix socket for the
writes a run makes while uproxy is up: an endpoint moved to the other backend, every
service's endpoint moved at once, a service added, every watch expired (410 Gone) so that
uproxy relists. Each write is answered with the
CLOCK_MONOTONIC time at which the double committed it: that clock is the same in every process
on the machine, so a run is timed from the API write itself, not from its own request.
"""

from __future__ import annotations

import asyncio
import datetime
import gc
import json
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

NODE = "bench-node"
NAMESPACE = "bench"
PORT_BASE = 20000  # service i listens on PORT_BASE + i (its ClusterIP is its own anyway)
ADDED_PORT_BASE = 30000  # services added during a run
TARGET_PORT = 8080
KINDS = ("Service", "EndpointSlice", "Node")
TRIGGER_ANNOTATION = "endpoints.kubernetes.io/last-change-trigger-time"

# The network: the node and a backend namespace on one veth link. The backend holds two
# addresses, each answering with its own name, so a client sees which endpoint it reached.
# Service addresses are routed to the backend namespace, where they are local: a connection to
# a ClusterIP that has no portal yet is refused at once instead of hanging.
NODE_IP = "10.244.1.1"
BACKENDS = {"backend-a": "10.244.1.2", "backend-b": "10.244.1.3"}
SERVICE_CIDR = "10.96.0.0/12"

Obj = dict[str, Any]


def cluster_ip(i: int) -> str:
    """The ClusterIP of service i (10.96.0.0/16: up to 64,000 services)."""
    return f"10.96.{i // 250}.{i % 250 + 1}"


def added_ip(j: int) -> str:
    """The ClusterIP of the j-th service added during a run (10.97.0.0/16)."""
    return f"10.97.{j // 250}.{j % 250 + 1}"


def service(name: str, ip: str, port: int) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "type": "ClusterIP",
            "clusterIP": ip,
            "clusterIPs": [ip],
            "ports": [{"name": "p", "port": port, "protocol": "TCP", "targetPort": TARGET_PORT}],
        },
    }


def endpoint_slice(service_name: str, address: str, *, trigger: float | None = None) -> Obj:
    """The slice of a service; ``trigger`` (wall-clock seconds) becomes the controller's
    last-change-trigger-time annotation, from which uproxy reports its own programming delay."""
    meta: Obj = {
        "name": f"{service_name}-1",
        "namespace": NAMESPACE,
        "labels": {"kubernetes.io/service-name": service_name},
    }
    if trigger is not None:
        when = datetime.datetime.fromtimestamp(trigger, datetime.UTC)
        meta["annotations"] = {TRIGGER_ANNOTATION: when.isoformat().replace("+00:00", "Z")}
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": meta,
        "addressType": "IPv4",
        "ports": [{"name": "p", "port": TARGET_PORT, "protocol": "TCP"}],
        "endpoints": [{"addresses": [address], "conditions": {"ready": True}, "nodeName": NODE}],
    }


def node(address: str) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": NODE, "labels": {}},
        "spec": {},
        "status": {"addresses": [{"type": "InternalIP", "address": address}]},
    }


def objects(services: int, address: str) -> Iterator[tuple[str, Obj]]:
    """(kind, object) for every service of the cluster and its slice, in creation order."""
    for i in range(services):
        name = f"svc-{i}"
        yield "Service", service(name, cluster_ip(i), PORT_BASE + i)
        yield "EndpointSlice", endpoint_slice(name, address)


def write_services_file(path: Path, services: int, address: str) -> None:
    """The same cluster as a multi-document manifest file (what ``kubectl apply -f`` takes)."""
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    docs = (obj for _, obj in objects(services, address))
    with path.open("w") as f:
        yaml.dump_all(docs, f, Dumper=dumper, sort_keys=False)


# --- the API server process ------------------------------------------------------------------


async def serve(
    services: int,
    *,
    kubeconfig: Path,
    ready: Path,
    address: str,
    node_ip: str,
    control: Path | None,
) -> None:
    """Serve the cluster until SIGTERM; ``ready`` gets the URL once everything is in place.
    ``address`` is every service's endpoint, ``node_ip`` the Node's InternalIP."""
    from tests.apiserver import ApiServerDouble

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with ApiServerDouble() as api:
        api.create("Node", node(node_ip))
        for kind, obj in objects(services, address):
            api.create(kind, obj)
        api.write_kubeconfig(kubeconfig)
        # The cluster lives as long as the double: out of the collector's sight. Left in it,
        # the collector's passes over it fell in the first list requests uproxy made: at
        # 10,000 services the first EndpointSlice page took 94 ms of the double's CPU (20-22
        # ms frozen), and uproxy, which had nothing else to do, waited 0.15-0.18 s for its
        # first pages (0.05-0.08 s frozen). kube-apiserver serves lists from its watch cache
        # with no such pause.
        gc.collect()
        gc.freeze()
        server = None
        if control is not None:
            control.unlink(missing_ok=True)  # noqa: ASYNC240 - once, before serving
            server = await asyncio.start_unix_server(
                lambda r, w: _control_client(api, r, w), path=str(control)
            )
        ready.write_text(api.url)  # noqa: ASYNC240 - a few bytes, once
        await stop.wait()
        if server is not None:
            server.close()


async def _control_client(api: Any, reader: asyncio.StreamReader, writer: Any) -> None:
    try:
        line = await reader.readline()
        request = json.loads(line)
        reply = await _apply(api, request)
    except Exception as e:  # a bad request is answered, never kills the server
        reply = {"error": f"{type(e).__name__}: {e}"}
    writer.write(json.dumps(reply).encode() + b"\n")
    try:
        await writer.drain()
    finally:
        writer.close()


async def _apply(api: Any, request: Obj) -> Obj:
    op = request["op"]
    if op == "move":
        obj = endpoint_slice(request["service"], request["address"], trigger=time.time())
        t = time.monotonic()
        api.update("EndpointSlice", obj)
        return {"t": t}
    if op == "add":
        name = request["name"]
        t = time.monotonic()
        api.create("Service", service(name, request["ip"], int(request["port"])))
        slice_ = endpoint_slice(name, request["address"], trigger=time.time())
        api.create("EndpointSlice", slice_)
        return {"t": t}
    if op == "move_all":
        # Every service's endpoint at once, as a rollout of every backend or a node's
        # drain looks to a watcher: one MODIFIED event per slice, back to back.
        address, count = request["address"], int(request["services"])
        stamp = time.time()
        t = time.monotonic()
        for i in range(count):
            api.update("EndpointSlice", endpoint_slice(f"svc-{i}", address, trigger=stamp))
        return {"t": t, "written_s": time.monotonic() - t}
    if op == "relist":
        return await _relist(api, float(request.get("timeout_s", 120)))
    raise ValueError(f"unknown op {op!r}")


async def _relist(api: Any, timeout_s: float) -> Obj:
    """Expire every watch with 410 Gone; done when each expired kind was listed and watched
    again (uproxy lists before it watches, so a new watch means its list was applied)."""
    kinds = [k for k in KINDS if api.open_watches(k)]
    lists = {k: api.list_count(k) for k in kinds}
    watches = {k: api.watch_count(k) for k in kinds}
    t0 = time.monotonic()
    api.expire_watches()
    while time.monotonic() - t0 < timeout_s:
        if all(api.watch_count(k) > watches[k] for k in kinds):
            relisted = all(api.list_count(k) > lists[k] for k in kinds)
            return {"s": time.monotonic() - t0, "ok": True, "relisted": relisted}
        await asyncio.sleep(0.01)
    return {"s": timeout_s, "ok": False, "relisted": False}


class Control:
    """The run's side of the unix socket: one request, one JSON answer, bounded in time."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def call(self, request: Obj, *, timeout_s: float = 10.0) -> Obj:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout_s)
            s.connect(str(self.path))
            s.sendall(json.dumps(request).encode() + b"\n")
            data = b""
            while not data.endswith(b"\n") and len(data) < 65536:
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
        reply: Obj = json.loads(data)
        if "error" in reply:
            raise RuntimeError(f"API double refused {request['op']}: {reply['error']}")
        return reply
