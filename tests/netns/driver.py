"""Runs rules-backend operations inside a network namespace (``ip netns exec ... -m``).

Python 3.11 cannot enter a namespace itself, so tests send this module a JSON script on stdin
(a backend spec and a list of operations) and read one JSON result per operation from stdout.
A script runs in one process, so a backend keeps its memory (e.g. what it installed) across
the operations of one script, exactly as in the running proxy.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from typing import Any

from uproxy.model import IPFamily, Protocol, ServicePortName
from uproxy.rules import (
    LocalTraffic,
    RulesBackend,
    RulesError,
    cleanup_all,
    command,
    conntrack,
    make_backend,
)
from uproxy.rules.base import Portal, PortalKind, keep_leftovers
from uproxy.rules.restore import detect_mode


def portal_to_json(p: Portal) -> dict[str, Any]:
    s = p.service
    return {
        "service": [s.namespace, s.name, s.port_name, s.protocol.value],
        "kind": p.kind.value,
        "ip": p.ip,
        "port": p.port,
        "proxy_port": p.proxy_port,
        "cluster_proxy_port": p.cluster_proxy_port,
        "source_ranges": list(p.source_ranges),
        "node_family": p.node_family.value,
    }


def portal_from_json(d: dict[str, Any]) -> Portal:
    ns, name, port_name, proto = d["service"]
    return Portal(
        ServicePortName(ns, name, port_name, Protocol(proto)),
        PortalKind(d["kind"]),
        d["ip"],
        d["port"],
        d["proxy_port"],
        d.get("cluster_proxy_port", 0),
        tuple(d.get("source_ranges", ())),
        IPFamily(d.get("node_family", 4)),
    )


def many_portals(count: int, moved: int = 0) -> list[Portal]:
    """``count`` ClusterIP portals (10.97.0.0/16), for tests at scale without a huge script;
    ``moved`` of them, spread evenly, on other proxy ports."""
    step = count // moved if moved else 0
    return [
        Portal(
            ServicePortName("scale", f"svc-{i}", "http", Protocol.TCP),
            PortalKind.CLUSTER_IP,
            f"10.97.{i // 250}.{i % 250 + 1}",
            80,
            (40000 if step and i % step == 0 and i // step < moved else 20000) + i,
        )
        for i in range(count)
    ]


class SpawnCounter:
    """Counts every process the rules code starts (all of it goes through ``command.run``)."""

    def __init__(self) -> None:
        self.argvs: list[list[str]] = []
        self._run = command.run

    async def run(self, argv: Any, **kwargs: Any) -> command.Completed:
        self.argvs.append(list(argv))
        return await self._run(argv, **kwargs)


SPAWNS = SpawnCounter()
command.run = SPAWNS.run


class Said(logging.Handler):
    """Every log line of uproxy's (INFO and above), for the ``said`` operation."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        kv = getattr(record, "kv", {})
        self.lines.append(" ".join([record.getMessage(), *(f"{k}={v}" for k, v in kv.items())]))


SAID = Said()
logging.getLogger("uproxy").addHandler(SAID)
logging.getLogger("uproxy").setLevel(logging.INFO)


async def _op(backend: RulesBackend, op: dict[str, Any]) -> Any:
    kind = op["op"]
    if kind == "sync":
        portals = [portal_from_json(p) for p in op["portals"]]
        await backend.sync(portals + many_portals(op.get("many", 0), op.get("moved", 0)))
        return None
    if kind == "said":
        return SAID.lines
    if kind == "spawns":
        return [argv[0] for argv in SPAWNS.argvs]
    if kind == "attr":
        return getattr(backend, op["name"])
    if kind == "check":
        return await backend.check()
    if kind == "verify":
        verify = getattr(backend, "verify", None)
        return True if verify is None else await verify()
    if kind == "cleanup":
        await backend.cleanup()
        return None
    if kind == "cleanup_all":
        return await cleanup_all()
    if kind == "set_local_traffic":
        backend.set_local_traffic(LocalTraffic(**op["local"]))
        return None
    if kind == "detect_mode":
        return await detect_mode()
    if kind == "prepare":
        await backend.prepare()
        return None
    if kind == "forget_portals":
        from uproxy.syncer import _forget_unnated

        portals = [portal_from_json(p) for p in op["portals"]] + many_portals(op.get("many", 0))
        await _forget_unnated(portals, None)
        return None
    if kind == "forget_udp":
        targets = [
            conntrack.udp_target(ip, port)
            if ip is not None
            else conntrack.node_port_target(port, ipv6=ipv6)
            for ip, port, ipv6 in op["targets"]
        ]
        return await conntrack.forget_udp(targets)
    if kind == "shell":
        return (await SPAWNS._run(op["argv"], stdin=op.get("stdin"))).stdout
    raise ValueError(f"unknown op {kind}")


async def main() -> int:
    script = json.load(sys.stdin)
    spec = script["backend"]
    backend = make_backend(
        spec["name"],
        host_ip=spec["host_ip"],
        iptables_mode=spec["mode"],
        dial_mark=spec.get("dial_mark", 0),
        nodeport_cidrs=spec.get("nodeport_cidrs", ()),
        local=LocalTraffic(**spec.get("local", {})),
    )
    if not spec.get("sweep", True):
        # Another backend's rules left beside these on purpose (what a run before left).
        backend._leftovers = keep_leftovers  # type: ignore[attr-defined]
    results: list[Any] = []
    try:
        for op in script["ops"]:
            try:
                results.append({"ok": await _op(backend, op)})
            except RulesError as exc:
                results.append({"error": str(exc)})
                break
    finally:
        await backend.close()
    json.dump(results, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
