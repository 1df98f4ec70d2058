"""The control channel when a worker is at its open-file limit.

The kernel hands a received packet's sockets over one by one and closes those it cannot
install (EMFILE), flagging the packet MSG_CTRUNC. The messages are still whole: the worker
must keep them all and keep its channel, not take the packet for a broken stream and stop
(which dropped every connection it relayed).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
from pathlib import Path

from uproxy.dataplane.messages import Channel, Forget, OpenListener
from uproxy.model import IPFamily, Protocol, ServicePortName, Traffic

ROOT = Path(__file__).resolve().parents[2]
SOCKETS = 20
HEADROOM = 5  # fds the receiver can still open

RECEIVER = """
import asyncio, json, os, resource, socket, sys
from uproxy.dataplane.messages import Channel, Forget, OpenListener

async def main() -> None:
    fd, headroom = int(sys.argv[1]), int(sys.argv[2])
    got = {"open": 0, "sockets": 0, "closed": False}
    done = asyncio.Event()

    def on_message(message, sock):
        if isinstance(message, OpenListener):
            got["open"] += 1
            got["sockets"] += sock is not None
        if isinstance(message, Forget):
            done.set()

    def on_closed():
        got["closed"] = True
        done.set()

    channel = Channel(socket.socket(fileno=fd), on_message=on_message, on_closed=on_closed)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    filler = []
    try:
        while True:
            filler.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass
    for fd in filler[:headroom]:  # exactly this many fds left
        os.close(fd)
    print("ready", flush=True)
    await asyncio.wait_for(done.wait(), 10)
    got["missed"] = channel.sockets_missed
    got["still_open"] = not channel.closed
    print(json.dumps(got), flush=True)

asyncio.run(main())
"""


async def test_a_packet_with_more_sockets_than_fds_left_keeps_the_channel() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        RECEIVER,
        str(theirs.fileno()),
        str(HEADROOM),
        pass_fds=(theirs.fileno(),),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    theirs.close()
    channel = Channel(ours, on_message=lambda m, s: None, on_closed=lambda: None)
    try:
        assert child.stdout is not None
        ready = await asyncio.wait_for(child.stdout.readline(), 10)
        assert ready.strip() == b"ready"
        for i in range(SOCKETS):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sock.listen(1)
            name = ServicePortName("ns", f"svc{i}", "p", Protocol.TCP)
            channel.send(OpenListener(name, Traffic.CLUSTER, IPFamily.V4), sock)
        channel.send(Forget(ServicePortName("ns", "end", "p", Protocol.TCP), IPFamily.V4))
        out, err = await asyncio.wait_for(child.communicate(), 15)
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
        channel.close()
    got = json.loads(out.decode().strip().splitlines()[-1])
    log = err.decode()
    assert got["open"] == SOCKETS  # every message arrived
    assert got["sockets"] == HEADROOM  # as many sockets as it had fds for
    assert got["missed"] == SOCKETS - HEADROOM
    assert got["still_open"] and not got["closed"]
    assert "open-file limit" in log  # one clear line says why
    assert log.count("Channel lost sockets") == 1
