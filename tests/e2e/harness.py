"""Running the real uproxy, its backends and its clients inside the test namespaces.

Everything here is a real process (``ip netns exec``): uproxy from ``python -m uproxy.cli``,
backends from :mod:`tests.e2e.servers`, dnsmasq, and the clients a user would run (curl,
dig, the checksum echo client). Waiting is always a bounded poll: uproxy's own
``kubeproxy_sync_proxy_rules_last_timestamp_seconds`` says when a sync that saw a file
change has finished, and its log says which proxy port each service got.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import wait_for_sync
from tests.netns.topology import REPO, Topology

Obj = dict[str, Any]

_OPENING = re.compile(
    r'"Opening proxy port" service="(?P<service>[^"]+)" traffic="(?P<traffic>\w+)" '
    r'address="(?P<host>[^"]*):(?P<port>\d+)"'
)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


class Proc:
    """A process inside a namespace whose stderr is collected line by line (never blocks)."""

    def __init__(self, topo: Topology, ns: str, argv: Sequence[str]) -> None:
        self.argv = list(argv)
        self.popen = subprocess.Popen(
            topo.exec_argv(ns, *argv),
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
        )
        self._lines: list[str] = []
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        stream = self.popen.stderr
        if stream is None:
            return
        for line in stream:
            with self._lock:
                self._lines.append(line.rstrip("\n"))

    @property
    def stderr_lines(self) -> list[str]:
        with self._lock:
            return list(self._lines)

    def wait_ready_line(self, timeout: float = 10.0) -> None:
        """Wait (bounded) for the ``ready`` line a test server prints on stdout."""
        out = self.popen.stdout
        if out is None:
            raise RuntimeError("no stdout")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            readable, _, _ = select.select([out], [], [], 0.1)
            if readable:
                line = out.readline()
                if line.strip() != "ready":
                    pytest.fail(f"{self.argv[:3]} printed {line!r}: {self.stderr_lines}")
                return
            if self.popen.poll() is not None:
                pytest.fail(f"{self.argv[:3]} exited early: {self.stderr_lines}")
        pytest.fail(f"{self.argv[:3]} did not become ready")

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout``; returns the exit code."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=10)
        self._reader.join(timeout=5)
        for stream in (self.popen.stdout, self.popen.stderr):
            if stream is not None:
                stream.close()
        return self.popen.returncode


# --- manifests -------------------------------------------------------------------------------


class ServicesFile:
    """The ``--services`` file: replaced atomically so uproxy never reads half a write."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.objects: dict[str, Obj] = {}

    def put(self, *objs: Obj) -> None:
        for obj in objs:
            self.objects[f"{obj['kind']}/{obj['metadata']['name']}"] = obj

    def remove(self, kind: str, name: str) -> None:
        del self.objects[f"{kind}/{name}"]

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump_all(list(self.objects.values()), sort_keys=False))
        os.replace(tmp, self.path)


def slice_endpoint(
    ip: str,
    *,
    node: str | None = "node-a",
    ready: bool = True,
    serving: bool | None = None,
    terminating: bool = False,
) -> Obj:
    conditions: Obj = {"ready": ready, "terminating": terminating}
    if serving is not None:
        conditions["serving"] = serving
    ep: Obj = {"addresses": [ip], "conditions": conditions}
    if node is not None:
        ep["nodeName"] = node
    return ep


# --- uproxy itself ---------------------------------------------------------------------------


class Uproxy:
    """``python -m uproxy.cli`` in a node namespace, with a file source."""

    def __init__(
        self,
        topo: Topology,
        ns: str,
        *,
        services: Path,
        rules: str,
        hostname: str = "node-a",
        extra: Iterable[str] = (),
    ) -> None:
        self.topo = topo
        self.ns = ns
        argv = [
            sys.executable,
            "-m",
            "uproxy.cli",
            "--services",
            str(services),
            "--rules",
            rules,
            "--hostname-override",
            hostname,
            "--healthz-bind-address",
            "0.0.0.0:10256",
            "--metrics-bind-address",
            "127.0.0.1:10249",
            "--iptables-min-sync-period",
            "100ms",
            "-v",
            "2",  # the per-port "Opening proxy port" lines say which proxy port each got
            *extra,
        ]
        self.proc = Proc(topo, ns, argv)

    def stop(self) -> int:
        return self.proc.stop()

    def curl_local(self, path: str, port: int = 10249) -> str:
        return self.topo.run(
            self.ns, "curl", "-sS", "--max-time", "5", f"http://127.0.0.1:{port}{path}"
        )

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of ``/metrics``, parsed by prometheus_client's own text parser."""
        out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for family in text_string_to_metric_families(self.curl_local("/metrics")):
            for sample in family.samples:
                out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return out

    def last_sync(self) -> float:
        """When uproxy's last sync ended, once its workers have applied everything it sent
        them (0 before that: traffic would still meet the previous state)."""
        if self.proc.popen.poll() is not None:
            pytest.fail(f"uproxy exited ({self.proc.popen.returncode}): {self.proc.stderr_lines}")
        try:
            samples = self.metrics()
        except RuntimeError:
            return 0.0  # not listening yet
        if samples.get(("uproxy_dataplane_pending_changes", ()), 0.0):
            return 0.0
        return samples.get(("kubeproxy_sync_proxy_rules_last_timestamp_seconds", ()), 0.0)

    def endpoint_changes(self) -> tuple[float, float]:
        """kube-proxy's endpoint-change counters: (total applied, pending); pending also
        counts what the workers have not applied yet."""
        samples = self.metrics()
        return (
            samples.get(("kubeproxy_sync_proxy_rules_endpoint_changes_total", ()), 0.0),
            samples.get(("kubeproxy_sync_proxy_rules_endpoint_changes_pending", ()), 0.0)
            + samples.get(("uproxy_dataplane_pending_changes", ()), 0.0),
        )

    def wait_endpoints_applied(self, *, total_before: float, timeout: float = 15.0) -> None:
        """Until endpoint changes counted after ``total_before`` reached the data plane.

        Endpoint-only changes skip the rules sync (they go to the balancers at once), so
        the sync timestamp does not move for them; the pending count drops to 0 instead.
        """

        def applied() -> bool:
            total, pending = self.endpoint_changes()
            return total > total_before and pending == 0

        wait_for_sync(applied, timeout=timeout, interval=0.1, message="endpoint changes applied")

    def wait_synced(self, *, after: float = 0.0, timeout: float = 15.0) -> None:
        """Until a sync that started after wall-clock time ``after`` has finished."""
        wait_for_sync(
            lambda: self.last_sync() > after,
            timeout=timeout,
            interval=0.1,
            message=f"a uproxy sync after {after}",
        )

    def wait_change_synced(self, *, after: float, timeout: float = 15.0) -> None:
        """Until a change made after wall-clock time ``after`` (a services file written then)
        has been queued for a sync, and a sync has ended since. ``wait_synced(after=...)``
        alone can be met by a sync queued before the change (a change of endpoints the rate
        limit held back) that ends before the file is read again."""

        def synced() -> bool:
            queued = self.metrics().get(
                ("kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds", ()), 0.0
            )
            return queued > after and self.last_sync() > queued

        wait_for_sync(synced, timeout=timeout, interval=0.1, message=f"a change after {after}")

    def proxy_ports(self, *, ipv6: bool = False) -> dict[tuple[str, str], int]:
        """(service port name, traffic) -> the proxy port uproxy logged opening last, of the
        IPv4 listeners (of the IPv6 ones with ``ipv6``)."""
        out: dict[tuple[str, str], int] = {}
        for line in self.proc.stderr_lines:
            m = _OPENING.search(line)
            if m and m["host"].startswith("[") == ipv6:
                out[(m["service"], m["traffic"])] = int(m["port"])
        return out


# --- clients ---------------------------------------------------------------------------------


def url(ip: str, port: int | None = None) -> str:
    """``http://IP[:PORT]/``, an IPv6 address in brackets."""
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}/" if port is not None else f"http://{host}/"


@dataclass(frozen=True)
class Answer:
    name: str
    length: int
    sha256: str
    to: str = ""  # the backend address the connection reached


def run_bytes(
    topo: Topology, ns: str, *argv: str, stdin: bytes = b"", timeout: float = 60
) -> bytes:
    done = subprocess.run(
        topo.exec_argv(ns, *argv), input=stdin, capture_output=True, timeout=timeout
    )
    if done.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed ({done.returncode}): {done.stderr.decode().strip()}")
    return done.stdout


def curl(
    topo: Topology,
    ns: str,
    url: str,
    *,
    body: bytes,
    tmp: Path,
    count: int = 1,
    max_time: float = 10.0,
) -> list[Answer]:
    """``count`` POSTs of ``body`` with one curl (a new connection each: the server closes);
    every answer must carry the exact length and sha256 of what was sent."""
    data = tmp / f"body-{hashlib.sha256(body).hexdigest()[:12]}"
    data.write_bytes(body)
    argv = ["curl", "-sS", "--fail", "--max-time", str(max_time), "-H", "Expect:"]
    argv += ["--data-binary", f"@{data}", *([url] * count)]
    out = run_bytes(topo, ns, *argv).decode()
    answers = [
        Answer(d["name"], d["len"], d["sha256"], d["to"]) for d in map(json.loads, out.splitlines())
    ]
    expected = hashlib.sha256(body).hexdigest()
    assert len(answers) == count
    for a in answers:
        assert (a.length, a.sha256) == (len(body), expected)
    return answers


def curl_status(topo: Topology, ns: str, url: str) -> int:
    """curl's exit code: 0 answered, 7 refused, 28 timed out."""
    done = subprocess.run(
        topo.exec_argv(ns, "curl", "-sS", "--max-time", "3", "-o", "/dev/null", url),
        capture_output=True,
        text=True,
        timeout=30,
    )
    return done.returncode


def connect_times_out(topo: Topology, ns: str, url: str, seconds: float = 0.5) -> bool:
    """Whether connecting to ``url`` gets no answer within ``seconds`` (its SYN dropped),
    rather than a refusal, a reset or a reply."""
    done = subprocess.run(
        topo.exec_argv(
            ns, "curl", "-sS", "--connect-timeout", str(seconds), "-o", "/dev/null", url
        ),
        capture_output=True,
        text=True,
        timeout=30,
    )
    return done.returncode == 28  # curl: operation timed out


def curl_raw(topo: Topology, ns: str, url: str) -> tuple[int, Mapping[str, str], str]:
    """Status, headers (lower-case names) and body of a GET, from ``curl -i``."""
    out = run_bytes(topo, ns, "curl", "-sS", "-i", "--max-time", "5", url).decode()
    head, _, body = out.partition("\r\n\r\n")
    lines = head.split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    return status, headers, body


def dig(topo: Topology, ns: str, server: str, name: str, *, port: int = 53) -> str:
    out = topo.run(
        ns,
        "dig",
        f"@{server}",
        "-p",
        str(port),
        name,
        "+short",
        "+tries=1",
        "+time=2",
        timeout=20,
    )
    return out.strip()


def echo_send(topo: Topology, ns: str, host: str, port: int, *, size: int, seed: int) -> str:
    """Send ``size`` seeded bytes to a ``sum`` backend; check its answer; return its name."""
    payload = _payload(size, seed)
    out = run_bytes(
        topo,
        ns,
        "socat",
        "-t",
        "5",
        "-T",
        "10",
        "-",
        f"TCP:{host}:{port},connect-timeout=5",
        stdin=payload,
    )
    name, length, digest = out.decode().split()
    assert int(length) == size
    assert digest == hashlib.sha256(payload).hexdigest()
    return name


def _payload(size: int, seed: int) -> bytes:
    import random

    return random.Random(seed).randbytes(size)


def wait_until_ok(probe: Any, *, timeout: float = 10.0, message: str) -> None:
    """Poll ``probe()`` (which raises or returns False while not ready) until it succeeds."""

    def attempt() -> bool:
        try:
            return probe() is not False
        except (RuntimeError, AssertionError, ValueError, KeyError, subprocess.SubprocessError):
            return False

    wait_for_sync(attempt, timeout=timeout, interval=0.1, message=message)
