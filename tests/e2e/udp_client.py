"""A UDP client that keeps one source port and keeps sending, as a resolver or a game client
does: a DNS query every 50 ms until the first answer (printed on stdout as ``answered
SECONDS``, seconds since it started) or ``--for`` seconds (``gave up``).

With ``--until-refused`` its socket is connected (as a resolver's forwarder's is, so that
it reads ICMP errors) and it goes on after the first answer until one is refused (``refused
SECONDS``)."""

from __future__ import annotations

import argparse
import socket
import struct
import time


def query(name: str, ident: int) -> bytes:
    header = struct.pack(">HHHHHH", ident, 0x0100, 1, 0, 0, 0)  # recursion desired, 1 question
    labels = b"".join(bytes([len(p)]) + p.encode() for p in name.split("."))
    return header + labels + b"\0" + struct.pack(">HH", 1, 1)  # A, IN


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("server")
    parser.add_argument("name")
    parser.add_argument("--port", type=int, default=53)
    parser.add_argument("--for", dest="seconds", type=float, default=20.0)
    parser.add_argument("--until-refused", action="store_true")
    args = parser.parse_args()
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", 0))  # one source port for the whole run
    if args.until_refused:
        sock.connect((args.server, args.port))
    sock.settimeout(0.05)
    start = time.monotonic()
    ident = 0
    answered = False
    print("ready", flush=True)
    while time.monotonic() - start < args.seconds:
        ident = (ident + 1) & 0xFFFF
        try:
            sock.sendto(query(args.name, ident), (args.server, args.port))
            reply = sock.recv(2048)
        except TimeoutError:
            continue
        except ConnectionRefusedError:
            if answered:
                print(f"refused {time.monotonic() - start:.2f}", flush=True)
                return
            continue
        if len(reply) >= 12 and struct.unpack(">H", reply[:2])[0] == ident and not answered:
            answered = True
            print(f"answered {time.monotonic() - start:.2f}", flush=True)
            if not args.until_refused:
                return
    print("gave up", flush=True)


if __name__ == "__main__":
    main()
