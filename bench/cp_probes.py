"""What a control-plane run observes, each read where a node's user would read it.

- Listeners: LISTEN sockets in /proc/net/tcp of the node's namespace, as a client sees them.
- Portal rules: what the kernel holds, read with the tools an operator would use
  (``iptables-nft``/``iptables-nft-save`` for the iptables-restore backend, ``nft list
  ruleset`` for the nftables backend), never uproxy's own idea of what it installed.
- Reachability: a TCP connection to a ClusterIP from the node itself, through the host portal
  (nat OUTPUT), answered by a backend that names itself; so "the change took effect" means a
  client got through to the new endpoint, not that some table changed.
- Memory: VmRSS (now) and VmHWM (peak) from /proc/PID/status.
- /metrics: one GET, as a Prometheus scrape without compression (curl's default) would do.

Every loop here is bounded in attempts and in time.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.procs import listening_ports, tree

# uproxy's own HTTP ports (healthz, metrics): not proxy listeners.
UPROXY_HTTP_PORTS = frozenset({10249, 10256})
PORTAL_CHAINS = ("KUBE-PORTALS-CONTAINER", "KUBE-PORTALS-HOST")
_CLUSTER_IP = re.compile(r"\b10\.96\.\d{1,3}\.\d{1,3}\b")


def proxy_listeners(exclude: set[int]) -> int:
    """Listening TCP ports in this namespace, other than ``exclude`` and uproxy's HTTP ports."""
    return len(listening_ports("tcp") - exclude - UPROXY_HTTP_PORTS)


def _run(argv: Sequence[str]) -> str:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=30, check=False)
    return done.stdout if done.returncode == 0 else ""


class PortalRules:
    """How many of the benchmark's portals the kernel holds, for one rules backend.

    iptables-restore: rules in uproxy's two portal chains whose comment names a benchmark
    service (2 per service: from pods, from the node), read from nft-backed iptables (a fresh
    namespace has no kubelet hint chain, so uproxy picks nft). The jump from nat OUTPUT into
    KUBE-PORTALS-HOST is the cheap signal (one short built-in chain, a few ms at any size):
    uproxy's restore writes it and both chains in one nat-table transaction.
    nftables: distinct ClusterIPs of benchmark services anywhere in ``nft list ruleset``
    (1 per service, whatever the layout of uproxy's maps). The cheap signal is a table in
    ``nft -t list ruleset`` (terse: no elements, ~10 ms where the full listing of 10,000
    elements takes 0.3-1 s): uproxy is the only writer here and loads its table whole, elements
    included, in its first transaction.
    """

    def __init__(self, backend: str, services: int) -> None:
        self.backend = backend
        self.expected = 2 * services if backend == "iptables-restore" else services

    def cheap_signal(self) -> bool:
        if self.backend == "iptables-restore":
            out = _run(["iptables-nft", "-w", "5", "-t", "nat", "-S", "OUTPUT"])
            return "-j KUBE-PORTALS-HOST" in out
        return any(
            line.startswith("table ")
            for line in _run(["nft", "-t", "list", "ruleset"]).splitlines()
        )

    def count(self) -> int:
        if self.backend == "iptables-restore":
            out = _run(["iptables-nft-save", "-t", "nat"])
            heads = tuple(f"-A {chain} " for chain in PORTAL_CHAINS)
            lines = out.splitlines()
            return sum(1 for line in lines if line.startswith(heads) and "bench/" in line)
        return len(set(_CLUSTER_IP.findall(_run(["nft", "list", "ruleset"]))))


def wait_rules(
    rules: PortalRules, *, deadline: float, alive: Callable[[], bool]
) -> tuple[float, float]:
    """CLOCK_MONOTONIC time at which every portal was seen installed, and how long the read
    that saw it took (the time is at most that late).

    When the cheap signal was first seen, if the full count that follows it finds every
    portal (one transaction wrote both); otherwise the end of the first full count that did.
    """
    signal_at: float | None = None
    signal_took = 0.0
    counted = False
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError("uproxy exited while its rules were awaited")
        started = time.monotonic()
        if signal_at is None:
            if rules.cheap_signal():
                signal_at = time.monotonic()
                signal_took = signal_at - started
            else:
                time.sleep(0.02)
                continue
        started = time.monotonic()
        if rules.count() >= rules.expected:
            if not counted:
                return signal_at, signal_took
            now = time.monotonic()
            return now, now - started
        counted = True
        time.sleep(0.05)
    raise RuntimeError(f"the kernel did not hold {rules.expected} portal entries in time")


# --- memory --------------------------------------------------------------------------------


def status_mib(pid: int, field: str = "VmRSS") -> float:
    """A /proc/PID/status memory figure (VmRSS, VmHWM), MiB, summed over the process and its
    descendants running the same program: uproxy's rules tools (iptables-nft reading 20,000
    rules holds ~30 MB for a moment) are not uproxy's memory, nor is a child forked to run
    one that has not run it yet (the same program and command line as ``pid``, and, its pages
    shared, ``pid``'s whole RSS: it once read 288 MiB for 172)."""
    total = 0
    exe = _exe(pid)
    argv = _cmdline(pid)
    for p in tree(pid):
        if _exe(p) != exe or (p != pid and _cmdline(p) == argv):
            continue
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith(f"{field}:"):
                    total += int(line.split()[1])
    return total / 1024


def _exe(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return ""


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


# --- reachability --------------------------------------------------------------------------


def ask(ip: str, port: int, *, timeout_s: float = 1.0) -> str:
    """Connect, read the backend's name until EOF (at most 256 bytes); raises OSError."""
    with socket.create_connection((ip, port), timeout=timeout_s) as s:
        data = b""
        while len(data) < 256:
            chunk = s.recv(256)
            if not chunk:
                break
            data += chunk
    return data.decode(errors="replace").strip()


@dataclass(slots=True)
class Poll:
    """One bounded polling loop: when ``want`` first answered, and what else happened."""

    first_at: float | None = None  # CLOCK_MONOTONIC start of the first attempt answered right
    attempts: int = 0
    failed: int = 0  # attempts that got no answer at all (refused, reset, timed out)
    other: int = 0  # answers from neither backend asked about


def poll_answer(
    ip: str,
    port: int,
    want: str,
    *,
    accept: frozenset[str] = frozenset(),
    limit_s: float,
    max_attempts: int,
    pause_s: float = 0.005,
) -> Poll:
    """Connect again and again until ``want`` answers; ``accept`` are the other expected names.

    The start of each attempt is the time reported: the client asked then, and the answer
    that came shows which endpoint its connection reached.
    """
    poll = Poll()
    deadline = time.monotonic() + limit_s
    while poll.attempts < max_attempts and time.monotonic() < deadline:
        started = time.monotonic()
        poll.attempts += 1
        try:
            answer = ask(ip, port)
        except OSError:
            poll.failed += 1
        else:
            if answer == want:
                poll.first_at = started
                return poll
            if answer not in accept:
                poll.other += 1
        time.sleep(pause_s)
    return poll


# --- /metrics ------------------------------------------------------------------------------


def scrape(host: str, port: int, *, timeout_s: float = 30.0) -> tuple[bytes, float]:
    """One GET /metrics: (the body, seconds from connect to the last byte)."""
    started = time.monotonic()
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("GET", "/metrics")
        response = conn.getresponse()
        body = response.read()
        if response.status != 200:
            raise OSError(f"/metrics answered {response.status}")
    finally:
        conn.close()
    return body, time.monotonic() - started


def sample_values(text: str, names: Sequence[str]) -> dict[str, float]:
    """Values of unlabelled samples (``name value`` lines) in a Prometheus text page."""
    wanted = set(names)
    out: dict[str, float] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if name in wanted:
            with contextlib.suppress(ValueError):
                out[name] = float(rest.split()[0])
    return out


def scrape_loop(host: str, port: int, *, interval_s: float, count: int, out: Path) -> None:
    """Scrape every ``interval_s`` (start to start, as Prometheus does) until SIGTERM or
    ``count`` scrapes; one line per scrape in ``out``: seconds, bytes (0 on a failure)."""
    stop = False

    def _stop(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    with out.open("w") as f:
        for _ in range(count):
            if stop:
                break
            started = time.monotonic()
            try:
                body, seconds = scrape(host, port, timeout_s=max(interval_s * 10, 10.0))
                size = len(body)
            except OSError:
                size, seconds = 0, time.monotonic() - started
            f.write(f"{seconds:.4f} {size}\n")
            f.flush()
            time.sleep(max(0.0, started + interval_s - time.monotonic()))


def read_scrapes(path: Path) -> list[tuple[float, int]]:
    """The lines ``scrape_loop`` wrote; a line cut short by its stop is left out."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        with contextlib.suppress(ValueError):
            seconds, size = line.split()
            out.append((float(seconds), int(size)))
    return out


# --- the backends --------------------------------------------------------------------------


async def serve_names(listen: Sequence[tuple[str, int, str]]) -> None:
    """TCP servers that answer every connection with their own name and close it."""

    def handler(
        name: bytes,
    ) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(name)
            with contextlib.suppress(OSError):
                await writer.drain()
            writer.close()

        return answer

    servers = [
        await asyncio.start_server(handler(name.encode() + b"\n"), ip, port, backlog=1024)
        for ip, port, name in listen
    ]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for server in servers:
        server.close()
