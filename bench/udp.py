"""UDP request/response: an echo backend and a bounded load generator, the same for every peer.

No packaged tool measures a UDP request/response rate through a proxy, so both ends are small
and plain: blocking ``recvfrom``/``sendto`` for the echo, and for the load several connected
sockets with one request in flight each, driven by epoll. Every reply is compared with what was
sent (sequence number and payload), so a proxy that truncates, mixes up clients or drops packets
shows up as ``bad``/``lost`` rather than as speed. The run is bounded in time and count.

    python -m bench.udp echo --port 9000
    python -m bench.udp load --port 19900 --seconds 4 --sockets 16
"""

from __future__ import annotations

import argparse
import hashlib
import json
import select
import socket
import struct
import sys
import time

PAYLOAD_SIZE = 64
RESEND_AFTER_S = 0.2
MAX_REQUESTS = 5_000_000


def echo(host: str, port: int) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    sock.bind((host, port))
    buf = bytearray(65536)
    view = memoryview(buf)
    while True:
        n, addr = sock.recvfrom_into(buf)
        sock.sendto(view[:n], addr)


def _payload(sock_id: int, seq: int) -> bytes:
    head = struct.pack("!II", sock_id, seq)
    return head + hashlib.sha256(head).digest() + b"x" * (PAYLOAD_SIZE - 40)


def load(host: str, port: int, *, seconds: float, sockets: int) -> dict[str, float]:
    socks = []
    ep = select.epoll()
    try:
        for _ in range(sockets):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.setblocking(False)
            s.connect((host, port))
            socks.append(s)
            ep.register(s.fileno(), select.EPOLLIN)
        by_fd = {s.fileno(): i for i, s in enumerate(socks)}
        seq = [0] * sockets
        sent_at = [0.0] * sockets
        expect = [b""] * sockets
        latencies: list[float] = []
        replies = lost = bad = 0
        start = time.perf_counter()
        end = start + seconds
        for i, s in enumerate(socks):
            expect[i] = _payload(i, 0)
            sent_at[i] = time.perf_counter()
            s.send(expect[i])
        now = start
        while now < end and replies < MAX_REQUESTS:
            events = ep.poll(0.05)
            now = time.perf_counter()
            for fd, _ in events:
                i = by_fd[fd]
                s = socks[i]
                while True:
                    try:
                        data = s.recv(65536)
                    except BlockingIOError:
                        break
                    except ConnectionRefusedError:
                        bad += 1
                        break
                    if data != expect[i]:
                        # A late reply to a request already counted lost is not an error.
                        if len(data) != PAYLOAD_SIZE or data[:4] != expect[i][:4]:
                            bad += 1
                        continue
                    replies += 1
                    latencies.append(now - sent_at[i])
                    seq[i] += 1
                    expect[i] = _payload(i, seq[i])
                    sent_at[i] = now
                    s.send(expect[i])
            for i, s in enumerate(socks):
                if now - sent_at[i] > RESEND_AFTER_S:
                    lost += 1
                    seq[i] += 1
                    expect[i] = _payload(i, seq[i])
                    sent_at[i] = now
                    s.send(expect[i])
        elapsed = time.perf_counter() - start
    finally:
        ep.close()
        for s in socks:
            s.close()
    latencies.sort()

    def pct(p: float) -> float:
        return latencies[min(len(latencies) - 1, int(p * len(latencies)))] if latencies else 0.0

    return {
        "replies": replies,
        "seconds": elapsed,
        "rate": replies / elapsed if elapsed > 0 else 0.0,
        "lost": lost,
        "bad": bad,
        "p50_us": pct(0.50) * 1e6,
        "p99_us": pct(0.99) * 1e6,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.udp")
    p.add_argument("mode", choices=["echo", "load"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--sockets", type=int, default=16)
    a = p.parse_args(argv)
    if a.mode == "echo":
        try:
            echo(a.host, a.port)
        except KeyboardInterrupt:
            return 0
        return 0
    result = load(a.host, a.port, seconds=min(a.seconds, 120.0), sockets=a.sockets)
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
