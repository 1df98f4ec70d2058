"""`uproxy demo`, run as a user would: a subprocess, real curl-like connections, Ctrl-C."""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys
import time
import urllib.request


def read_until(proc: subprocess.Popen[bytes], pattern: str, timeout: float) -> str:
    # Raw reads on the descriptor: a buffered readline() could hide lines from select().
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    sel = selectors.DefaultSelector()
    sel.register(fd, selectors.EVENT_READ)
    out = b""
    deadline = time.monotonic() + timeout
    while not re.search(pattern.encode(), out):
        left = deadline - time.monotonic()
        if left <= 0 or proc.poll() is not None:
            raise AssertionError(f"demo did not print {pattern!r}; output so far:\n{out.decode()}")
        if sel.select(left):
            out += os.read(fd, 65536)
    return out.decode()


def test_demo_serves_three_backends_and_stops_on_ctrl_c() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "uproxy.cli", "demo"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        bufsize=0,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        out = read_until(proc, r"Ctrl-C", timeout=20)
        url = re.search(r"curl -s (http://127\.0\.0\.1:\d+/)", out)
        assert url, out
        names = set()
        for _ in range(3):
            with urllib.request.urlopen(url.group(1), timeout=5) as resp:
                names.add(resp.read().decode().strip())
        assert names == {"backend-1", "backend-2", "backend-3"}
        udp = re.search(r"nc -u -w1 (127\.0\.0\.1) (\d+)", out)
        assert udp, out
        import socket

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(5)
            s.sendto(b"hello", (udp.group(1), int(udp.group(2))))
            data, _ = s.recvfrom(65536)
        assert re.fullmatch(rb"backend-\d: hello", data), data
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            rest, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0, err
    assert b"demo stopped" in rest
    assert b"Traceback" not in err
