"""``uproxy demo``: uproxy end to end on one machine, with no cluster and no root.

Three small backends (HTTP answering with their own name, and a UDP echo that prefixes its
name) listen on 127.0.0.11-13; the bundled service file points a web service and an echo
service at them; uproxy proxies it in laptop mode and prints the commands to try.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from importlib import resources

from aiohttp import web

from uproxy.eventloop import run_loop
from uproxy.log import setup as setup_logging
from uproxy.model import Protocol
from uproxy.proxy import Proxy, StartupError, install_signal_handlers
from uproxy.run import print_table
from uproxy.settings import Settings

BACKENDS = ("127.0.0.11", "127.0.0.12", "127.0.0.13")
HTTP_PORT = 8080
UDP_PORT = 9053


def demo_file() -> str:
    return str(resources.files("uproxy") / "examples" / "demo.yaml")


class _Echo(asyncio.DatagramProtocol):
    def __init__(self, name: str) -> None:
        self.name = name.encode()
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        if self.transport is not None:
            self.transport.sendto(self.name + b": " + data, addr)


class Backends:
    """The demo's backends; ``close()`` stops them all."""

    def __init__(self) -> None:
        self._runners: list[web.AppRunner] = []
        self._udp: list[asyncio.DatagramTransport] = []

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        for i, ip in enumerate(BACKENDS, start=1):
            name = f"backend-{i}"

            async def hello(request: web.Request, name: str = name) -> web.Response:
                return web.Response(text=f"{name}\n")

            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", hello)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            self._runners.append(runner)
            await web.TCPSite(runner, ip, HTTP_PORT).start()
            transport, _ = await loop.create_datagram_endpoint(
                lambda name=name: _Echo(name),  # type: ignore[misc]
                local_addr=(ip, UDP_PORT),
            )
            self._udp.append(transport)

    async def close(self) -> None:
        for t in self._udp:
            t.close()
        for r in self._runners:
            await r.cleanup()


def demo_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="uproxy demo",
        description="uproxy end to end on one machine, with no cluster and no root: three "
        "small backends on 127.0.0.11-13 (HTTP, and a UDP echo), a web and an echo service "
        "proxied to them in laptop mode, and the commands to try. Ctrl-C stops it.",
    )
    parser.add_argument("-v", type=int, default=0, dest="verbosity", help="log verbosity")
    ns = parser.parse_args(list(argv))
    setup_logging(verbosity=ns.verbosity)
    try:
        return run_loop(_demo)
    except KeyboardInterrupt:
        return 0


async def _demo() -> int:
    backends = Backends()
    try:
        await backends.start()
    except OSError as e:
        await backends.close()
        print(
            f"uproxy demo: error: cannot start the demo backends on 127.0.0.11-13 "
            f"ports {HTTP_PORT}/{UDP_PORT}: {e.strerror or e}",
            file=sys.stderr,
        )
        return 1
    settings = Settings(
        services=demo_file(),
        rules="none",
        bind_address="127.0.0.1",
        healthz_bind_address="",
        metrics_bind_address="127.0.0.1:0",
    )
    proxy = Proxy(settings, on_table=print_table)
    try:
        await proxy.start()
        install_signal_handlers(proxy.on_signal)
        await asyncio.wait_for(proxy.synced.wait(), timeout=10)
        _print_instructions(proxy)
        await proxy.wait()
    except StartupError as e:
        print(f"uproxy demo: error: {e}", file=sys.stderr)
        return 1
    finally:
        await proxy.stop()
        await backends.close()
    print("demo stopped", flush=True)
    return 0


def _print_instructions(proxy: Proxy) -> None:
    lines = ["Try it:"]
    # TCP first (curl), then UDP (nc), as the README shows them.
    for spn, pp in sorted(proxy.syncer.ports.items(), key=lambda i: (i[0].protocol.value, i[0])):
        if pp.cluster is None:
            continue
        addr = f"{pp.cluster.host} {pp.cluster.port}"
        if spn.protocol is Protocol.TCP:
            url = f"http://{pp.cluster.host}:{pp.cluster.port}/"
            lines.append(f"  curl -s {url}        # {spn}: a different backend each time")
        else:
            lines.append(f"  echo hello | nc -u -w1 {addr}   # {spn}: a UDP echo")
    if proxy.metrics_server is not None:
        lines.append(
            f"  curl -s http://127.0.0.1:{proxy.metrics_server.port}/metrics | grep uproxy_"
        )
    lines.append("Ctrl-C stops the demo.")
    print("\n".join(lines), flush=True)
