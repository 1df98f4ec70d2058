"""Backend servers for the end-to-end tests: each one names itself and checksums what it got.

One process serves every listener given on the command line (``NAME=IP:PORT:KIND``), so a
test starts all the backends of a namespace at once and waits for one ``ready`` line:

- ``http``: answers any request with ``{"name", "len", "sha256"}`` of the request body, and
  ``to``, the address the connection reached (one server bound to a wildcard answers for every
  address routed to its namespace), and closes the connection, so every ``curl`` is a new
  connection through the proxy.
- ``sum``: reads a raw TCP stream until EOF and answers ``NAME LEN SHA256``; the reply's exact
  size is known, which the byte counters need.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import json

_MAX_HEADER = 64 * 1024


async def _http(name: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
        if len(head) > _MAX_HEADER:
            return
        length = 0
        for line in head.decode("latin-1").split("\r\n")[1:]:
            key, _, value = line.partition(":")
            if key.strip().lower() == "content-length":
                length = int(value.strip())
        body = await reader.readexactly(length) if length else b""
        answer = json.dumps(
            {
                "name": name,
                "len": len(body),
                "sha256": hashlib.sha256(body).hexdigest(),
                "to": writer.get_extra_info("sockname")[0],
            }
        ).encode()
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
            + f"Content-Length: {len(answer) + 1}\r\n\r\n".encode()
            + answer
            + b"\n"
        )
        await writer.drain()
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError):
        pass
    finally:
        writer.close()


async def _sum(name: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        digest = hashlib.sha256()
        length = 0
        while chunk := await reader.read(65536):
            digest.update(chunk)
            length += len(chunk)
        writer.write(f"{name} {length} {digest.hexdigest()}".encode())
        await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


async def main(specs: list[str]) -> None:
    servers = []
    for spec in specs:
        name, _, where = spec.partition("=")
        ip, port, kind = where.rsplit(":", 2)  # an IPv6 address has colons of its own
        handler = functools.partial(_http if kind == "http" else _sum, name)
        servers.append(await asyncio.start_server(handler, ip, int(port), reuse_address=True))
    print("ready", flush=True)
    # Runs until the test terminates the process.
    await asyncio.gather(*(server.serve_forever() for server in servers))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("listeners", nargs="+", help="NAME=IP:PORT:http|sum (IPv6 bare)")
    asyncio.run(main(parser.parse_args().listeners))
