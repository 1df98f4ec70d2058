"""A checksum echo server and client for traffic tests inside namespaces.

``serve``: accepts TCP connections, reads until EOF, answers ``<length> <sha256>``. It prints
``ready`` once listening, so a test can wait for it without sleeping. ``send``: connects, sends
``size`` seeded random bytes, half-closes, and prints the server's answer with what was sent.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import socket
import sys


def serve(host: str, port: int, count: int) -> None:
    with socket.create_server((host, port), reuse_port=False) as srv:
        srv.settimeout(60)
        print("ready", flush=True)
        for _ in range(count):
            conn, _peer = srv.accept()
            with conn:
                conn.settimeout(20)
                digest = hashlib.sha256()
                length = 0
                while chunk := conn.recv(65536):
                    digest.update(chunk)
                    length += len(chunk)
                conn.sendall(f"{length} {digest.hexdigest()}".encode())


def send(host: str, port: int, size: int, seed: int) -> None:
    payload = random.Random(seed).randbytes(size)
    with socket.create_connection((host, port), timeout=10) as conn:
        conn.sendall(payload)
        conn.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := conn.recv(4096):
            answer += chunk
    length, digest = answer.decode().split()
    json.dump(
        {
            "sent_len": size,
            "sent_sha256": hashlib.sha256(payload).hexdigest(),
            "echo_len": int(length),
            "echo_sha256": digest,
        },
        sys.stdout,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["serve", "send"])
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--count", type=int, default=1)
    parser.add_argument("--size", type=int, default=1 << 20)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    if args.mode == "serve":
        serve(args.host, args.port, args.count)
    else:
        send(args.host, args.port, args.size, args.seed)


if __name__ == "__main__":
    main()
