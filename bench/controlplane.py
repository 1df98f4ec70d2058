"""Control plane: how long uproxy takes from start to serving N service ports, and its RSS.

The API server is ``uproxy.testing.apiserver.ApiServerDouble`` (the real wire format over TLS,
paged lists, watches), run in a child process on the load core and filled with N single-port
Services and their EndpointSlices before uproxy starts. uproxy runs in laptop mode
(``--rules none``): synced means N listening sockets on 127.0.0.1, counted from
/proc/net/tcp, which is what a client can observe. Time is measured from spawning the process,
so it includes interpreter start and imports, as an operator restarting a pod would see it.

    python -m bench.controlplane serve --services 1000 --kubeconfig /tmp/kc --ready FILE
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from pathlib import Path
from typing import Any

from bench.procs import Cores, ProcessGroup, peak_rss_bytes
from bench.progress import Progress

NODE = "bench-node"
PORT_BASE = 20000
NAMESPACE = "bench"


def _service(i: int) -> dict[str, Any]:
    ip = f"10.96.{i // 250}.{i % 250 + 1}"
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": f"svc-{i}", "namespace": NAMESPACE},
        "spec": {
            "type": "ClusterIP",
            "clusterIP": ip,
            "clusterIPs": [ip],
            "ports": [{"name": "p", "port": PORT_BASE + i, "protocol": "TCP", "targetPort": 8080}],
        },
    }


def _slice(i: int) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"svc-{i}-1",
            "namespace": NAMESPACE,
            "labels": {"kubernetes.io/service-name": f"svc-{i}"},
        },
        "addressType": "IPv4",
        "ports": [{"name": "p", "port": 8080, "protocol": "TCP"}],
        "endpoints": [
            {"addresses": ["127.0.0.1"], "conditions": {"ready": True}, "nodeName": NODE}
        ],
    }


async def serve(services: int, kubeconfig: Path, ready: Path) -> None:
    from uproxy.testing.apiserver import ApiServerDouble

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with ApiServerDouble() as api:
        api.create(
            "Node",
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": NODE, "labels": {}},
                "spec": {},
                "status": {"addresses": [{"type": "InternalIP", "address": "127.0.0.1"}]},
            },
        )
        for i in range(services):
            api.create("Service", _service(i))
            api.create("EndpointSlice", _slice(i))
        api.write_kubeconfig(kubeconfig)
        ready.write_text(api.url)  # noqa: ASYNC240 - a few bytes, once
        await stop.wait()


def _listening_count() -> int:
    count = 0
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                next(f)
                count += sum(1 for line in f if line.split(None, 4)[3] == "0A")
        except OSError:
            continue
    return count


def measure(
    services: int,
    *,
    procs: ProcessGroup,
    cores: Cores,
    workdir: Path,
    loop: str,
    timeout_s: float,
) -> dict[str, float]:
    kubeconfig = workdir / f"kubeconfig-{services}"
    ready = workdir / f"apiserver-{services}.ready"
    ready.unlink(missing_ok=True)
    api = procs.start(
        [
            sys.executable,
            "-m",
            "bench.controlplane",
            "serve",
            "--services",
            str(services),
            "--kubeconfig",
            str(kubeconfig),
            "--ready",
            str(ready),
        ],
        core=cores.load,
        name=f"apiserver-{services}",
    )
    proxy = None
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            if api.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"API server double did not start: {procs.log_tail(api)}")
            time.sleep(0.05)
        baseline = _listening_count()
        t0 = time.monotonic()
        proxy = procs.start(
            [
                sys.executable,
                "-m",
                "uproxy.cli",
                "--kubeconfig",
                str(kubeconfig),
                "--hostname-override",
                NODE,
                "--rules",
                "none",
                "--bind-address",
                "127.0.0.1",
                "--healthz-bind-address",
                "",
                "--metrics-bind-address",
                "",
                "--event-loop",
                loop,
            ],
            core=cores.proxy,
            name=f"uproxy-sync-{services}",
        )
        deadline = t0 + timeout_s
        while True:
            if _listening_count() - baseline >= services:
                synced = time.monotonic() - t0
                break
            if proxy.poll() is not None:
                raise RuntimeError(f"uproxy exited: {procs.log_tail(proxy)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"uproxy did not open {services} listeners in {timeout_s:.0f} s")
            time.sleep(0.05)
        return {"sync_s": synced, "rss_mb": peak_rss_bytes(proxy.pid) / (1 << 20)}
    finally:
        if proxy is not None:
            procs.stop(proxy, timeout_s=15)
        procs.stop(api)


def run(
    sizes: list[int],
    runs: int,
    *,
    procs: ProcessGroup,
    cores: Cores,
    workdir: Path,
    progress: Progress,
    planned_per_run_s: float,
) -> dict[str, Any]:
    out: dict[str, Any] = {"loop": "uvloop", "sizes": {}, "notes": []}
    for n in sizes:
        results = []
        for r in range(runs):
            try:
                res = measure(
                    n, procs=procs, cores=cores, workdir=workdir, loop="uvloop", timeout_s=120
                )
            except RuntimeError as e:
                out["notes"].append(f"{n} services: {e}")
                progress.say(f"control plane, {n} service ports: failed: {e}")
                break
            results.append(res)
            progress.advance(planned_per_run_s * n / max(sizes))
            progress.say(
                f"control plane, {n} service ports, run {r + 1}/{runs}: synced in "
                f"{res['sync_s']:.2f} s, peak RSS {res['rss_mb']:.0f} MiB"
            )
        out["sizes"][str(n)] = results
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.controlplane")
    p.add_argument("mode", choices=["serve"])
    p.add_argument("--services", type=int, required=True)
    p.add_argument("--kubeconfig", type=Path, required=True)
    p.add_argument("--ready", type=Path, required=True)
    a = p.parse_args(argv)
    asyncio.run(serve(a.services, a.kubeconfig, a.ready))
    return 0


if __name__ == "__main__":
    sys.exit(main())
