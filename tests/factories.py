"""Kubernetes objects in the API's JSON shape, for tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


def service(
    name: str = "web",
    namespace: str = "default",
    *,
    ports: list[dict[str, Any]] | None = None,
    cluster_ip: str | None = "10.96.0.10",
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    **spec: Any,
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace}
    if labels:
        meta["labels"] = labels
    if annotations:
        meta["annotations"] = annotations
    body: dict[str, Any] = {
        "ports": ports if ports is not None else [{"name": "http", "port": 80, "protocol": "TCP"}]
    }
    if cluster_ip is not None:
        body["clusterIP"] = cluster_ip
    body.update(spec)
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": body}


def endpoint(ip: str, **fields: Any) -> dict[str, Any]:
    ep: dict[str, Any] = {"addresses": [ip]}
    conditions = {k: fields.pop(k) for k in ("ready", "serving", "terminating") if k in fields}
    if conditions:
        ep["conditions"] = conditions
    ep.update(fields)
    return ep


def endpoint_slice(
    name: str,
    service_name: str = "web",
    namespace: str = "default",
    *,
    endpoints: list[dict[str, Any]],
    ports: list[dict[str, Any]] | None = None,
    address_type: str = "IPv4",
) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"kubernetes.io/service-name": service_name},
        },
        "addressType": address_type,
        "ports": ports
        if ports is not None
        else [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": endpoints,
    }


def one_service_file(path: Path, ip: str, port: int) -> Path:
    """A services file of one TCP service ("default/web:http") with one endpoint."""
    docs = [
        service(ports=[{"name": "http", "port": 1, "protocol": "TCP"}]),
        endpoint_slice(
            "web-1",
            endpoints=[endpoint(ip)],
            ports=[{"name": "http", "port": port, "protocol": "TCP"}],
        ),
    ]
    path.write_text(yaml.safe_dump_all(docs))
    return path
