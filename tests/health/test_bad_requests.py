"""A request uproxy's HTTP servers cannot parse (any client that reaches a health-check node
port can send one): answered 400, and not an 11-line traceback on stderr outside uproxy's
log format per request, as Python's last resort printed aiohttp's report of it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

_SERVE_AND_ASK = textwrap.dedent(
    """
    import asyncio, socket, sys
    from aiohttp import web
    from uproxy.httpserver import HttpServer
    from uproxy.log import setup

    setup(verbosity=int(sys.argv[1]), fmt=sys.argv[2])

    async def ok(request):
        return web.Response(text="ok")

    async def boom(request):
        raise RuntimeError("a fault of the handler itself")

    async def main():
        server = HttpServer(
            name="test", address="127.0.0.1", port=0,
            routes=[("GET", "/healthz", ok), ("GET", "/boom", boom)],
        )
        await server.start()
        loop = asyncio.get_running_loop()
        for request in (
            b"GET /healthz HTTP/1.1\\r\\nHost: x\\r\\nBad Header\\r\\n\\r\\n",
            b"GET /healthz HTTP/1.1\\r\\nHost: x\\r\\nX: " + b"y" * 100_000 + b"\\r\\n\\r\\n",
            b"GET /boom HTTP/1.1\\r\\nHost: x\\r\\nConnection: close\\r\\n\\r\\n",
        ):
            with socket.socket() as s:
                s.setblocking(False)
                await loop.sock_connect(s, ("127.0.0.1", server.port))
                await loop.sock_sendall(s, request)
                reply = await asyncio.wait_for(loop.sock_recv(s, 200), 5)
                print(reply.split(b"\\r\\n")[0].decode(), flush=True)
        await server.close()

    asyncio.run(main())
    """
)


@pytest.mark.parametrize(("verbosity", "fmt"), [(0, "text"), (3, "text"), (0, "json")])
def test_a_malformed_request_is_a_400_and_one_quiet_line(verbosity: int, fmt: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _SERVE_AND_ASK, str(verbosity), fmt],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    statuses = done.stdout.split("\n")[:3]
    assert statuses[0].split()[1] == "400" and statuses[1].split()[1] in ("400", "431")
    assert statuses[2].split()[1] == "500"
    lines = done.stderr.splitlines()
    assert "Traceback" not in done.stderr
    bad = [line for line in lines if "Bad HTTP request" in line]
    assert len(bad) == (2 if verbosity >= 3 else 0), lines
    # A fault of uproxy's own handler is still said, in uproxy's format, at error.
    own = [line for line in lines if "Error handling request" in line]
    assert len(own) == 1, lines
    if fmt == "json":
        assert all(line.startswith("{") for line in lines), lines
    else:
        assert own[0].startswith("E") and "aiohttp" in own[0]
