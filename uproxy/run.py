"""Running the proxy process until a signal: start, print the laptop table, stop cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
from collections.abc import Awaitable, Callable

from uproxy import heap
from uproxy.log import kv
from uproxy.proxy import Proxy, StartupError, install_signal_handlers
from uproxy.settings import Settings
from uproxy.syncer import TableRow

log = logging.getLogger("uproxy.run")


def set_up_node(settings: Settings) -> None:
    """kube-proxy's node settings (``nodesetup``), by the process that proxies for the node:
    its OOM score first, which the workers it starts inherit; then the conntrack table and
    timeouts. What cannot be set is said in one line each, and uproxy serves on."""
    from uproxy.nodesetup import Wanted, set_oom_score_adj, tune

    problem = set_oom_score_adj(settings.oom_score_adj)
    if problem:
        log.warning(
            "Cannot set the OOM score adjustment",
            extra=kv(value=settings.oom_score_adj, err=problem),
        )
    problems = tune(Wanted.from_settings(settings))
    if problems:
        log.warning(
            "Cannot tune conntrack as configured: run 'uproxy --init-only' where /proc/sys is "
            "writable (a privileged init container), or change the conntrack settings",
            extra=kv(problems="; ".join(problems)),
        )


# How long past its drain a uproxy that still holds the namespace is waited for.
CLAIM_GRACE_S = 5.0


async def claim_node(
    settings: Settings, name: str | None = None, *, wait: bool = True
) -> socket.socket:
    """This network namespace, for this process's rules and ports (``nodesetup``). One
    uproxy that still holds it may be draining (a restart that overlaps its predecessor's
    stop): it is waited for, up to its drain (or this one's, if longer) and a few seconds,
    then that is an error. Without ``wait``, ``NamespaceTaken`` at once."""
    from uproxy.nodesetup import (
        NAMESPACE_LOCK,
        NamespaceTaken,
        answer_claim,
        claim_network_namespace,
    )

    loop = asyncio.get_running_loop()
    give_up = loop.time() + settings.drain_timeout + CLAIM_GRACE_S
    said = False
    while True:
        try:
            held = claim_network_namespace(name or NAMESPACE_LOCK)
        except NamespaceTaken as e:
            if not wait:
                raise
            if e.drain_s is not None and not said:
                give_up = max(give_up, loop.time() + e.drain_s + CLAIM_GRACE_S)
            if loop.time() >= give_up:
                raise
            if not said:
                wait_s = round(give_up - loop.time(), 1)
                if e.uid is None:
                    log.warning(
                        "Another uproxy proxies for this network namespace; waiting for it to exit",
                        extra=kv(pid=e.pid or "?", wait_s=wait_s),
                    )
                else:
                    log.warning(
                        "A process of another user holds uproxy's claim on this network "
                        "namespace; waiting for it to exit",
                        extra=kv(pid=e.pid or "?", uid=e.uid, wait_s=wait_s),
                    )
                said = True
            await asyncio.sleep(0.1)
            continue
        # Another start asks who holds it (its peer credentials) and how long it may drain:
        # answered at once, so that asking never fills the queue.
        held.setblocking(False)
        loop.add_reader(held.fileno(), answer_claim, held, settings.drain_timeout)
        return held


def format_table(rows: list[TableRow]) -> str:
    header = TableRow("SERVICE", "PROTOCOL", "LISTEN", "ENDPOINTS")
    allrows = [header, *rows]
    widths = [
        max(len(getattr(r, col)) for r in allrows) for col in ("service", "protocol", "listen")
    ]
    lines = []
    for r in allrows:
        lines.append(
            f"{r.service:<{widths[0]}}  {r.protocol:<{widths[1]}}  {r.listen:<{widths[2]}}  "
            f"{r.endpoints}"
        )
    return "\n".join(lines)


_table_out = True  # False once stdout is gone


def print_table(rows: list[TableRow]) -> None:
    """The laptop table on stdout. A stdout that is gone (a closed pipe: ``uproxy | head``)
    ends the table with one line and never fails the sync that printed it."""
    global _table_out
    if not _table_out:
        return
    try:
        print(format_table(rows) if rows else "(no services)", flush=True)
        print(flush=True)
    except OSError as e:
        _table_out = False
        log.warning("Cannot print the service table any more", extra=kv(err=e))
        # What is left in the buffer would fail again at exit: stdout goes nowhere now.
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)


async def run_proxy(settings: Settings) -> int:
    held: list[socket.socket] = []  # the namespace, for the process's life
    gate: Callable[[], Awaitable[None]] | None = None
    if not settings.laptop:
        from uproxy.nodesetup import NamespaceTaken

        try:
            held.append(await claim_node(settings, wait=False))
        except NamespaceTaken:
            # A predecessor still drains (a rollout's restart): this one starts its workers
            # and lists the services meanwhile, and only its ports, rules and HTTP servers
            # wait for the namespace. Waited for first, the whole start (1.75 s measured)
            # came after the predecessor's exit, every service port refused until then.
            async def gate() -> None:
                try:
                    held.append(await claim_node(settings))
                except Exception as e:
                    raise StartupError(str(e)) from None

        except Exception as e:
            print(f"uproxy: error: {e}", file=sys.stderr)
            return 1
        set_up_node(settings)  # the OOM score first, which the workers inherit
    try:
        proxy = Proxy(settings, on_table=print_table if settings.laptop else None)
    except StartupError as e:
        print(f"uproxy: error: {e}", file=sys.stderr)
        return 1
    # Handled from here on: a stop signal while uproxy starts (a rollout, a node draining)
    # stops it the same way, with its line, instead of the default action killing it.
    install_signal_handlers(proxy.on_signal)
    starting = asyncio.ensure_future(proxy.start(gate))
    stopped = asyncio.ensure_future(proxy.wait())
    try:
        await asyncio.wait((starting, stopped), return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if not starting.done():  # stopped before it had started
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError, StartupError):
            await starting
        await proxy.stop()
        return _exit(proxy)
    try:
        starting.result()
    except StartupError as e:
        print(f"uproxy: error: {e}", file=sys.stderr)
        await proxy.stop()
        return 1
    # Start-up objects (modules, settings, clients) live for the whole process: the end of
    # the start's bulk (begun in main()) moves them out of the collector's sight so
    # per-connection collections stay cheap. The collector comes back on only once no other
    # bulk runs: the first listings usually do, and turned on under them, its full passes
    # over their pages took 16-35 ms each at 10,000 services. No collection first: it cost
    # 40-120 ms of the start for ~2,500 objects of import-time garbage, which stay.
    heap.resume()
    await proxy.wait()
    await proxy.stop()
    return _exit(proxy)


def _exit(proxy: Proxy) -> int:
    if proxy.failure:
        print(f"uproxy: error: {proxy.failure}", file=sys.stderr)
        return 1
    return 0
