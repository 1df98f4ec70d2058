"""Keep-alive round trips through uproxy while a service port with many endpoints changes.

A DaemonSet's service on a big cluster has an endpoint per node, thousands of them, and they
change a few at a time (a node drained, a pod restarted). Each change reaches every data-plane
worker, whose relays wait while it applies it: this measures what a relayed connection sees.

``python -m bench.big_service`` (no root needed; about two minutes): for each endpoint count, a
uproxy of this tree (``--services FILE --rules none --workers 1``, pinned to the second CPU)
with two services: ``target``, whose one endpoint is an echo server on 127.0.0.1, and ``big``,
with N endpoints (on loopback addresses nobody dials). One client connection sends 64 bytes to
``target`` every millisecond and times each echo; meanwhile, once a second, ``big`` changes
(the services file, generated beforehand, is swapped in): by default one endpoint is replaced
(``--change one``); ``--change third`` replaces a third of them at once (a rollout, or a
zone's nodes going: more than a worker takes as a change of a few), and ``--change appear``
takes ``big`` away and brings it back in turn (a new port with all its endpoints); ``--change
affinity`` turns ClientIP affinity on and off on ``big`` (its spec changes: a worker builds the
new balancer aside, in steps, then swaps it in); ``--change hints`` gives all of ``big``'s
endpoints topology hints and takes them away in turn (as the EndpointSlice controller does
when a Service's trafficDistribution is set or its hints no longer fit). The client and the
echo server run on the first CPU. The first count (100 endpoints) is the baseline: a change
of it costs a worker next to nothing, so its tail is that of the file reloads alone
(the control process parses the whole file each time, on the worker's CPU, below it).

Laptop mode, not the deployed path: what is measured is the worker's loop, which is the same
behind the portal rules. Figures: p50 / p99 / p99.9 / max of the round trips, how many took
over 2 and 5 ms, each count's p99.9 as a ratio of the baseline's, and the CPU time the control
process and the worker took per change over the measured window (``/proc``; the control
process's includes reading the file, the worker's its relaying of the round trips).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from bench.cmdline import positive_float, positive_int, positive_ints

ECHO_PORT = 18999
TARGET_PORT = 18080  # laptop mode: the proxy port is the service port on 127.0.0.1
BIG_PORT = 18081
PER_SLICE = 100
MESSAGE = b"y" * 64
INTERVAL_S = 0.001
CHANGE_EVERY_S = 1.0
READY_TIMEOUT_S = 90.0
NODE = "bench-node"  # uproxy's node name (the hints of ``--change hints`` name it)
ECHO = f"""
import asyncio, uvloop
class Echo(asyncio.Protocol):
    def connection_made(self, transport): self.transport = transport
    def data_received(self, data): self.transport.write(data)
async def main():
    await asyncio.get_running_loop().create_server(Echo, "127.0.0.1", {ECHO_PORT})
    await asyncio.Event().wait()
uvloop.run(main())
"""


def _service(name: str, ip: str, port: int, target: int, *, sticky: bool = False) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "type": "ClusterIP",
        "clusterIP": ip,
        "ports": [{"name": "p", "port": port, "protocol": "TCP", "targetPort": target}],
    }
    if sticky:
        spec["sessionAffinity"] = "ClientIP"
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": "bench"},
        "spec": spec,
    }


def _slice(
    name: str, index: int, addresses: list[str], port: int, hinted: bool = False
) -> dict[str, Any]:
    endpoints: list[dict[str, Any]] = [
        {"addresses": [a], "conditions": {"ready": True}, "nodeName": f"node-{a}"}
        for a in addresses
    ]
    if hinted:  # a third of them hinted for this node (PreferSameNode), the rest elsewhere
        for i, ep in enumerate(endpoints):
            ep["hints"] = {"forNodes": [{"name": NODE if i % 3 == 0 else f"node-{i}"}]}
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{name}-{index}",
            "namespace": "bench",
            "labels": {"kubernetes.io/service-name": name},
        },
        "addressType": "IPv4",
        "ports": [{"name": "p", "port": port, "protocol": "TCP"}],
        "endpoints": endpoints,
    }


CHANGES = ("one", "third", "appear", "affinity", "hints")


def services_file(path: Path, endpoints: int, generation: int, change: str = "one") -> None:
    """``target`` and ``big`` as generation g of ``change`` has them: "one" replaces big's
    endpoint g by a new address; "third" gives the third of big's endpoints i with i = g
    (mod 3) addresses of generation g, the others keep their last generation's; "appear"
    leaves big out of odd generations; "affinity" turns ClientIP affinity on for big in odd
    generations (its spec changes, its endpoints do not); "hints" gives every endpoint of big
    a topology hint for a node in odd generations, a third of them for this one (each
    endpoint changes: the worker gets steps, one of which turns the hints on or off)."""
    addresses = [f"127.2.{i // 250}.{i % 250 + 1}" for i in range(endpoints)]
    if generation and change == "one":
        addresses[generation % endpoints] = f"127.3.{generation // 250}.{generation % 250 + 1}"
    elif generation and change == "third":
        for third in range(3):
            last = generation - (generation - third) % 3  # the last generation of this third
            for i in range(third, endpoints, 3) if last >= 1 else ():
                addresses[i] = f"127.{3 + last % 200}.{i // 250}.{i % 250 + 1}"
    docs = [
        _service("target", "10.96.0.1", TARGET_PORT, ECHO_PORT),
        _slice("target", 0, ["127.0.0.1"], ECHO_PORT),
    ]
    if change == "appear" and generation % 2:
        endpoints = 0
    else:
        sticky = change == "affinity" and generation % 2 == 1
        docs.append(_service("big", "10.96.0.2", BIG_PORT, 9, sticky=sticky))
    for start in range(0, endpoints, PER_SLICE):
        hinted = change == "hints" and generation % 2 == 1
        chunk = addresses[start : start + PER_SLICE]
        docs.append(_slice("big", start // PER_SLICE, chunk, 9, hinted))
    write_services(path, docs)


def write_services(path: Path, docs: list[dict[str, Any]]) -> None:
    """``docs`` as a services file at ``path``, swapped in whole (uproxy never reads half)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.dump_all(docs, Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper)))
    os.replace(tmp, path)


def _connect(proxy: subprocess.Popen[bytes], log: Path) -> socket.socket:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        try:
            conn = socket.create_connection(("127.0.0.1", TARGET_PORT), timeout=2)
            conn.sendall(MESSAGE)
            got = b""
            while len(got) < len(MESSAGE):
                got += conn.recv(len(MESSAGE))
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return conn
        except OSError:
            if proxy.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"uproxy did not serve: {log.read_text()[-2000:]}") from None
            time.sleep(0.2)


def _cpu_s(pid: int) -> float:
    """User and system time of one process so far (seconds)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(c) for c in text.split()]


def round_trips(conn: socket.socket, seconds: float) -> list[float]:
    """``MESSAGE`` echoed through ``conn`` every ``INTERVAL_S`` for ``seconds``: each round
    trip's time (seconds)."""
    took: list[float] = []
    end = time.monotonic() + seconds
    due = time.monotonic()
    while (now := time.monotonic()) < end:
        if now < due:
            time.sleep(due - now)
        due += INTERVAL_S
        sent_at = time.perf_counter()
        conn.sendall(MESSAGE)
        got = 0
        while got < len(MESSAGE):
            chunk = conn.recv(len(MESSAGE))
            if not chunk:
                raise RuntimeError("the connection closed")
            got += len(chunk)
        took.append(time.perf_counter() - sent_at)
    return took


def middle(rows: list[dict[str, float]], key: str) -> dict[str, float]:
    """The row of the median ``key``; of an even count the higher of the two middle ones,
    the worse for a latency or a cost. The default is two runs: the lower one would always
    show the better run, which flatters whichever setting is the noisier."""
    return sorted(rows, key=lambda r: r[key])[len(rows) // 2]


MIDDLE_NOTE = (
    "Each row is the run of median p99.9 (of an even number of runs, the worse of the middle two)."
)


def summary(took: list[float]) -> dict[str, float]:
    """Round trips' count, p50 / p99 / p99.9 / max (ms), and how many took over 2 and 5 ms."""
    took = sorted(took)

    def q(p: float) -> float:
        return 1e3 * took[min(len(took) - 1, int(p * len(took)))]

    return {
        "requests": len(took),
        "p50_ms": q(0.5),
        "p99_ms": q(0.99),
        "p999_ms": q(0.999),
        "max_ms": 1e3 * took[-1],
        "over_2ms": sum(t > 0.002 for t in took),
        "over_5ms": sum(t > 0.005 for t in took),
    }


def tail_text(f: dict[str, float]) -> str:
    """``summary``'s figures as one run's line says them."""
    return (
        f"p50 {f['p50_ms']:.3f} p99 {f['p99_ms']:.3f} p99.9 {f['p999_ms']:.3f} max "
        f"{f['max_ms']:.1f} ms; {f['over_2ms']:.0f} over 2 ms, {f['over_5ms']:.0f} over 5 ms"
    )


def tail_cells(f: dict[str, float]) -> str:
    """``summary``'s tail as table cells: p99, p99.9, max and round trips over 2 ms."""
    return f"{f['p99_ms']:.3f} | {f['p999_ms']:.3f} | {f['max_ms']:.1f} | {f['over_2ms']:.0f}"


def on_first_cpu() -> bool:
    """Pin this process (the probe) to CPU 0; False, said on stderr, with fewer than 2 CPUs."""
    if (os.cpu_count() or 0) < 2:
        print("needs 2 CPUs", file=sys.stderr)
        return False
    os.sched_setaffinity(0, {0})
    return True


def interleaved(
    sizes: list[int],
    runs: int,
    prefix: str,
    one: Callable[[int, Path], dict[str, float]],
    line: Callable[[int, dict[str, float]], str],
) -> list[dict[str, float]]:
    """``one(size, workdir)`` for every size, ``runs`` times over, each in a directory of its
    own, printing ``line`` of each run's figures as it ends."""
    results: list[dict[str, float]] = []
    for run in range(runs):
        for n in sizes:
            with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
                figures = one(n, Path(tmp))
            figures["run"] = run + 1
            results.append(figures)
            print(f"run {run + 1}, {line(n, figures)}", flush=True)
    return results


def measure(endpoints: int, seconds: float, workdir: Path, change: str = "one") -> dict[str, float]:
    """One run: round trips for ``seconds`` while ``big`` changes once a second."""
    live = workdir / "services.yaml"
    services_file(live, endpoints, 0, change)
    changes = int(seconds / CHANGE_EVERY_S)
    for g in range(1, changes + 1):
        services_file(workdir / f"gen-{g}.yaml", endpoints, g, change)
    log = workdir / "uproxy.log"
    argv = [sys.executable, "-m", "uproxy.cli", "--services", str(live), "--rules", "none"]
    argv += ["--workers", "1", "--event-loop", "uvloop", "--hostname-override", NODE]
    argv += ["--healthz-bind-address", "", "--metrics-bind-address", ""]
    started: list[subprocess.Popen[bytes]] = []
    try:
        started.append(subprocess.Popen(["taskset", "-c", "0", sys.executable, "-c", ECHO]))
        with log.open("w") as err:
            proxy = subprocess.Popen(
                ["taskset", "-c", "1", *argv], stdout=subprocess.DEVNULL, stderr=err
            )
        started.append(proxy)
        conn = _connect(proxy, log)
        time.sleep(2.0)  # settled: the start's work is over
        workers = _children(proxy.pid)
        cpu_before = [_cpu_s(proxy.pid), sum(_cpu_s(w) for w in workers)]
        stop = threading.Event()
        swapped: list[int] = []

        def churn() -> None:
            while len(swapped) < changes and not stop.wait(CHANGE_EVERY_S):
                g = len(swapped) + 1
                os.replace(workdir / f"gen-{g}.yaml", live)
                swapped.append(g)

        mover = threading.Thread(target=churn)
        mover.start()
        try:
            took = round_trips(conn, seconds)
            mover.join()
            time.sleep(0.5)  # the last change applied
            cpu_after = [_cpu_s(proxy.pid), sum(_cpu_s(w) for w in workers)]
        finally:
            stop.set()
            mover.join()
            conn.close()
    finally:
        for proc in reversed(started):
            proc.terminate()
            proc.wait(30)
    return {
        "endpoints": endpoints,
        **summary(took),
        "changes": len(swapped),
        "control_ms_per_change": 1e3 * (cpu_after[0] - cpu_before[0]) / max(1, len(swapped)),
        "worker_ms_per_change": 1e3 * (cpu_after[1] - cpu_before[1]) / max(1, len(swapped)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.big_service", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--endpoints",
        type=positive_ints,
        default="100,5000,20000",
        help="counts, baseline first",
    )
    parser.add_argument("--seconds", type=positive_float, default=15.0)
    parser.add_argument("--runs", type=positive_int, default=2, help="runs per count, interleaved")
    parser.add_argument("--change", choices=CHANGES, default="one", help="what each change is")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args(argv)
    if not on_first_cpu():
        return 2
    counts: list[int] = args.endpoints
    results = interleaved(
        counts,
        args.runs,
        "uproxy-big-",
        lambda n, workdir: measure(n, args.seconds, workdir, args.change),
        lambda n, f: (
            f"{n:,} endpoints: {tail_text(f)} ({f['changes']:.0f} changes); CPU per change: "
            f"control {f['control_ms_per_change']:.0f} ms, worker "
            f"{f['worker_ms_per_change']:.0f} ms"
        ),
    )
    base_p999 = middle([r for r in results if r["endpoints"] == counts[0]], "p999_ms")["p999_ms"]
    print(f"\n{MIDDLE_NOTE} CPU per change: the median likewise.")
    print(
        "\n| endpoints | p99 ms | p99.9 ms | max ms | over 2 ms | p99.9 vs baseline "
        "| CPU per change: control / worker ms (median) |"
    )
    print("|---|---|---|---|---|---|---|")
    for n in counts:
        rows = [r for r in results if r["endpoints"] == n]
        mid = middle(rows, "p999_ms")
        control = middle(rows, "control_ms_per_change")["control_ms_per_change"]
        worker = middle(rows, "worker_ms_per_change")["worker_ms_per_change"]
        print(
            f"| {n:,} | {tail_cells(mid)} | {mid['p999_ms'] / base_p999:.2f}x | "
            f"{control:.0f} / {worker:.0f} |"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
