"""A reference relay for the bulk figures: splice(2) in blocking threads, nothing else.

``python -m bench.splice_relay LISTEN_PORT:TARGET_PORT ...`` accepts on 127.0.0.1 and, per
connection, dials 127.0.0.1:TARGET_PORT and moves each direction in a thread of its own with
blocking ``splice`` through a 1 MiB pipe, then ``shutdown(SHUT_WR)`` at EOF. No event loop,
no copy to user space, no readiness events: the thread sleeps in the kernel until bytes come.

It is not a proxy anyone should run (two threads per connection); it is what a userspace
relay costs at the least on this machine: two TCP connections through loopback where kernel
DNAT has one. Its TCP 1-stream figure beside uproxy's and kernel DNAT's says how much of
uproxy's gap to kernel DNAT a relay in user space cannot close.
"""

from __future__ import annotations

import fcntl
import os
import socket
import sys
import threading

PIPE_SIZE = 1 << 20


def _pump(src: socket.socket, dst: socket.socket) -> None:
    r, w = os.pipe()
    try:
        size = fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
        while True:
            n = os.splice(src.fileno(), w, size, flags=os.SPLICE_F_MOVE)
            if n == 0:
                break
            while n:
                n -= os.splice(r, dst.fileno(), n, flags=os.SPLICE_F_MOVE)
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        # A reset on either side: end both directions; the pair's thread closes them.
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
    finally:
        os.close(r)
        os.close(w)


def _pair(client: socket.socket, target: int) -> None:
    try:
        upstream = socket.create_connection(("127.0.0.1", target))
    except OSError:
        client.close()
        return
    for s in (client, upstream):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    there = threading.Thread(target=_pump, args=(client, upstream), daemon=True)
    there.start()
    _pump(upstream, client)
    there.join()
    client.close()
    upstream.close()


def _serve(listener: socket.socket, target: int) -> None:
    while True:
        client, _ = listener.accept()
        threading.Thread(target=_pair, args=(client, target), daemon=True).start()


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m bench.splice_relay LISTEN_PORT:TARGET_PORT ...", file=sys.stderr)
        return 2
    threads = []
    for spec in argv:
        listen, _, target = spec.partition(":")
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", int(listen)))
        listener.listen(4096)
        t = threading.Thread(target=_serve, args=(listener, int(target)), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
