"""--busy-poll on the whole proxy: the loop that relays (a worker's, or the control process's
with --workers 0) polls after traffic and sleeps again when the window is over, and what it
relays arrives whole. Its effect on latency depends on the host (see ``bench.deployed``);
here the CPU the relaying process takes shows which way its loop waits."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from pathlib import Path

import pytest

from tests.integration.backends import NamedBackend
from tests.integration.procs import children
from tests.integration.test_workers import proxy_port, services_file, start_proxy

WINDOW_S = 0.8
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime


async def cpu_over(pid: int, seconds: float) -> float:
    """CPU seconds ``pid`` takes in the next ``seconds`` (this loop idles meanwhile)."""
    before = cpu_s(pid)
    await asyncio.sleep(seconds)
    return cpu_s(pid) - before


async def echoed(port: int, payload: bytes) -> bytes:
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
    try:
        await asyncio.wait_for(reader.readline(), 5)  # the backend's name
        writer.write(payload)
        await writer.drain()
        return await asyncio.wait_for(reader.readexactly(len(payload)), 30)
    finally:
        writer.close()


@pytest.mark.parametrize("workers", [1, 0])
async def test_the_relaying_loop_polls_after_traffic_sleeps_when_it_stops_and_loses_no_byte(
    tmp_path: Path, workers: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="uproxy.proxy")
    backend = await NamedBackend("b1", "127.0.0.31").start()
    path = tmp_path / "services.yaml"
    services_file(path, [backend])
    proxy = await start_proxy(path, workers=workers, busy_poll=WINDOW_S)
    try:
        said = [r for r in caplog.records if "poll for a while after each event" in r.getMessage()]
        assert [r.__dict__["kv"] for r in said] == [{"busy_poll": "800ms", "workers": workers}]
        relaying = children(os.getpid())[0] if workers else os.getpid()
        port = proxy_port(proxy)
        await asyncio.sleep(WINDOW_S)  # whatever the start brought, its window is over
        idle = await cpu_over(relaying, 0.5)
        payloads = [os.urandom(n) for n in (10, 1 << 20, 4 << 20)]
        results = await asyncio.gather(*(echoed(port, p) for p in payloads))
        for sent, got in zip(payloads, results, strict=True):
            assert hashlib.sha256(got).digest() == hashlib.sha256(sent).digest()
        polling = await cpu_over(relaying, 0.4)  # within the window of the last bytes
        await asyncio.sleep(WINDOW_S)
        after = await cpu_over(relaying, 0.5)
        # A loop that polls takes its CPU (all of it on a quiet machine); one that sleeps
        # takes close to nothing. Wide margins: only which way the loop waits is asserted.
        assert polling >= 0.1, (idle, polling, after)
        assert idle <= 0.05 and after <= 0.05, (idle, polling, after)
    finally:
        await proxy.stop()
        await backend.close()
