"""A private network namespace for the whole run, removed on every exit path.

Running every peer, backend and load generator inside one fresh namespace gives the same
loopback, the same sysctls and an empty iptables ruleset on any Linux box, and keeps the
kernel-DNAT peer's rule away from the host. The bench re-executes itself inside the namespace
(``ip netns exec``) so that its own readiness checks and /proc/net reads see the same sockets;
the outer process only creates the namespace, waits and deletes it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Sequence

# Enough ephemeral ports and TIME_WAIT reuse for the connection-rate runs; the same for all
# peers because every peer runs in this namespace.
SYSCTLS = {
    "net.ipv4.ip_local_port_range": "1024 65000",
    "net.ipv4.tcp_tw_reuse": "1",
    "net.core.somaxconn": "4096",
}


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def create(name: str) -> None:
    _ip("netns", "add", name)
    try:
        _ip("-n", name, "link", "set", "lo", "up")
        for key, value in SYSCTLS.items():
            subprocess.run(
                ["ip", "netns", "exec", name, "sysctl", "-q", "-w", f"{key}={value}"],
                check=True,
                capture_output=True,
                timeout=10,
            )
    except BaseException:
        delete(name)
        raise


def delete(name: str) -> None:
    """Kill what still runs in the namespace (only our children live there), then remove it."""
    with contextlib.suppress(subprocess.SubprocessError, OSError):
        out = subprocess.run(
            ["ip", "netns", "pids", name], capture_output=True, text=True, timeout=10
        ).stdout
        for pid in (int(p) for p in out.split()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.SubprocessError, OSError):
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)


def run_inside(name: str, argv: Sequence[str]) -> int:
    """Run ``python -m bench argv`` inside the namespace; always delete it afterwards."""
    create(name)
    child: subprocess.Popen[bytes] | None = None
    try:
        child = subprocess.Popen(
            ["ip", "netns", "exec", name, sys.executable, "-m", "bench", *argv]
        )
        return child.wait()
    except KeyboardInterrupt:
        # From a terminal the child got the same SIGINT and is cleaning up its processes; when
        # only this process was told to stop (SIGTERM), pass it on.
        if child is not None:
            for sig, wait_s in ((None, 10.0), (signal.SIGTERM, 20.0), (signal.SIGKILL, 5.0)):
                if sig is not None:
                    child.send_signal(sig)
                try:
                    child.wait(timeout=wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        return 130
    finally:
        delete(name)
