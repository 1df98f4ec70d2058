"""The metrics endpoint: /metrics parses and carries uproxy's series; /proxyMode; /healthz.

/metrics is written in slices between which the loop runs (uproxy.metrics_server): the tests
check what a scraper gets (exact values, whole families, one HELP/TYPE each, the kube-proxy
names), and, structurally, that the loop gets turns while a scrape renders and that scrapes
survive what happens during those turns (label sets bound, other scrapes, a client leaving).
They assert no timings.
"""

from __future__ import annotations

import asyncio
import errno
import gzip
import logging
import os
import socket
import struct
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import aiohttp
import pytest
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from uproxy import __version__, metrics, metrics_server
from uproxy.metrics_server import MetricsServer, accepts_gzip

from .helpers import assert_same_bytes, refused, wait_until

PROMETHEUS_ACCEPT = (  # what Prometheus 2.x sends; 3.x lists the same formats
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)
TEXT_0_0_4 = "text/plain; version=0.0.4; charset=utf-8"
# Enough series for several chunks of uproxy.metrics.ScrapeFamily.text.
MANY = 4 * metrics.SERIES_PER_CHUNK


@pytest.fixture
async def server() -> AsyncIterator[MetricsServer]:
    srv = MetricsServer(address="127.0.0.1", port=0)
    await srv.start()
    yield srv
    await srv.close()


@pytest.fixture
def family() -> metrics.ScrapeCounter:
    """A private data-plane family with MANY series, valued 1..MANY, and a sparse result."""
    fam = metrics.ScrapeCounter(
        "test_relayed_total", "Test series", ("service", "result"), sparse={"result": ("failed",)}
    )
    for i in range(MANY):
        fam.labels(f"ns/svc-{i}:http", "ok").value = i + 1
    return fam


@pytest.fixture
async def private_server(family: metrics.ScrapeCounter) -> AsyncIterator[MetricsServer]:
    """/metrics with ``family`` only (and an empty control-plane registry)."""
    srv = MetricsServer(
        address="127.0.0.1", port=0, registry=CollectorRegistry(), families=(family,)
    )
    await srv.start()
    yield srv
    await srv.close()


@pytest.fixture
def every_chunk_a_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop runs between every two chunks of a scrape, however fast the machine."""
    monkeypatch.setattr(metrics_server, "SLICE_S", 0.0)


async def scrape(http: aiohttp.ClientSession, srv: MetricsServer, **headers: str) -> str:
    async with http.get(f"http://127.0.0.1:{srv.port}/metrics", headers=headers) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"] == TEXT_0_0_4
        return await resp.text()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value, from prometheus_client's own parser."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def want_series(
    fam: metrics.LabelledFamily,
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """What a scrape must show of ``fam``: every label set, except sparse ones still at 0,
    and the proxied ports' series that nothing has bound, at 0."""
    bound = dict(fam.series())
    want = {
        (fam.name, tuple(sorted(zip(fam.labelnames, values, strict=True)))): float(t.value)
        for values, t in bound.items()
        if isinstance(t, metrics.Tally) and (t.value or not t.sparse)
    }
    per_port = fam.per_port
    if per_port is None:
        return want
    for service, protocol, _ in metrics.PROXIED.snapshot():
        for values in per_port(service, protocol):
            if values not in bound:
                want[(fam.name, tuple(sorted(zip(fam.labelnames, values, strict=True))))] = 0.0
    return want


def of_family(
    got: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {k: v for k, v in got.items() if k[0] == name}


async def test_metrics_parse_and_include_build_info(
    http: aiohttp.ClientSession, server: MetricsServer
) -> None:
    metrics.ACCEPT_PAUSED.labels("emfile").value += 1  # a labelled series to find below
    async with http.get(f"http://127.0.0.1:{server.port}/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"] == TEXT_0_0_4
        text = await resp.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    # An Info metric is exposed in the text format as a gauge named *_info.
    (sample,) = families["uproxy_build_info"].samples
    assert sample.labels["version"] == __version__
    assert sample.value == 1.0
    paused = families["uproxy_accept_paused"]
    assert any(
        s.labels.get("reason") == "emfile" and s.value >= 1.0
        for s in paused.samples
        if s.name == "uproxy_accept_paused_total"
    )
    assert "kubeproxy_sync_proxy_rules_duration_seconds" in families
    async with http.head(f"http://127.0.0.1:{server.port}/metrics") as resp:
        assert resp.status == 200 and resp.headers["Content-Type"] == TEXT_0_0_4
        assert await resp.read() == b""


async def test_proxy_mode_and_healthz(http: aiohttp.ClientSession, server: MetricsServer) -> None:
    for path, want in (("/proxyMode", b"userspace"), ("/healthz", b"ok")):
        async with http.get(f"http://127.0.0.1:{server.port}{path}") as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"] == "text/plain; charset=utf-8"
            assert_same_bytes(await resp.read(), want)
    async with http.get(f"http://127.0.0.1:{server.port}/nope") as resp:
        assert resp.status == 404


async def test_port_in_use_raises_eaddrinuse_and_leaves_nothing_open(
    unused_port: int, listening_blocker: Callable[[str, int], socket.socket]
) -> None:
    blocker = listening_blocker("127.0.0.1", unused_port)
    srv = MetricsServer(address="127.0.0.1", port=unused_port)
    with pytest.raises(OSError) as info:
        await srv.start()
    assert info.value.errno == errno.EADDRINUSE
    assert srv.port == 0
    blocker.close()
    assert await refused("127.0.0.1", unused_port)
    await srv.close()


async def test_address_not_on_this_host_raises_oserror(unused_port: int) -> None:
    # 192.0.2.0/24 is TEST-NET-1: never assigned to this machine.
    srv = MetricsServer(address="192.0.2.1", port=unused_port)
    with pytest.raises(OSError) as info:
        await srv.start()
    assert info.value.errno == errno.EADDRNOTAVAIL


async def test_unresolvable_address_raises_oserror(unused_port: int) -> None:
    srv = MetricsServer(address="not an address", port=unused_port)
    with pytest.raises(OSError) as info:
        await srv.start()
    assert info.value.errno is not None


async def test_close_releases_port() -> None:
    srv = MetricsServer(address="127.0.0.1", port=0)
    await srv.start()
    port = srv.port
    assert not await refused("127.0.0.1", port)
    await srv.close()
    assert await refused("127.0.0.1", port)


async def test_data_plane_series_equal_their_tallies(
    http: aiohttp.ClientSession, server: MetricsServer
) -> None:
    service = "test/exact:http"
    metrics.CONNECTIONS.labels(service, "TCP", "ok").value += 7
    metrics.CONNECTIONS.labels(service, "TCP", "no_endpoints").value += 2
    metrics.CONNECTIONS.labels(service, "TCP", "dial_failed")  # bound, never counted
    metrics.BYTES.labels(service, "to_endpoint").value += 12_345_678_901
    metrics.BYTES.labels(service, "to_client")  # bound, zero: written (not sparse)
    metrics.OPEN_CONNECTIONS.labels(service, "TCP").value = 3
    metrics.NO_ENDPOINTS.labels(service, "cluster")  # sparse and zero: absent
    metrics.NO_ENDPOINTS.labels(service, "external").value += 1
    metrics.DIAL_DURATION.observe(0.003)
    got = samples(await scrape(http, server))

    for fam in metrics.DATA_PLANE:
        if isinstance(fam, metrics.LabelledFamily):
            assert of_family(got, fam.name) == want_series(fam), fam.name
    conn = "uproxy_connections_total"
    assert got[(conn, (("protocol", "TCP"), ("result", "ok"), ("service", service)))] == 7
    assert got[(conn, (("protocol", "TCP"), ("result", "no_endpoints"), ("service", service)))] == 2
    assert (conn, (("protocol", "TCP"), ("result", "dial_failed"), ("service", service))) not in got
    assert got[("uproxy_bytes_total", (("direction", "to_endpoint"), ("service", service)))] == (
        12_345_678_901
    )
    assert got[("uproxy_bytes_total", (("direction", "to_client"), ("service", service)))] == 0
    dial = metrics.DIAL_DURATION
    assert got[(f"{dial.name}_count", ())] == sum(dial.counts)
    assert got[(f"{dial.name}_sum", ())] == dial.sum
    assert got[(f"{dial.name}_bucket", (("le", "+Inf"),))] == sum(dial.counts)
    assert got[(f"{dial.name}_bucket", (("le", "0.005"),))] == sum(dial.counts[:5])
    assert not [name for name, _ in got if name.endswith("_created")]


async def test_a_proxied_ports_series_are_written_at_zero_until_bound(
    http: aiohttp.ClientSession, server: MetricsServer
) -> None:
    """The data plane binds a port's label sets at its first connection or datagram; until
    then the scrape has them at zero all the same (``metrics.PROXIED``), then its counts,
    never both; a deleted service's go."""
    tcp, udp = "test/unbound:http", "test/unbound:dns"
    metrics.PROXIED.add(tcp, "TCP")
    metrics.PROXIED.add(udp, "UDP")
    try:
        got = samples(await scrape(http, server))
        of_tcp = {k: v for k, v in got.items() if ("service", tcp) in k[1]}
        assert of_tcp == {
            (
                "uproxy_connections_total",
                (("protocol", "TCP"), ("result", "ok"), ("service", tcp)),
            ): 0,
            ("uproxy_open_connections", (("protocol", "TCP"), ("service", tcp))): 0,
            ("uproxy_bytes_total", (("direction", "to_endpoint"), ("service", tcp))): 0,
            ("uproxy_bytes_total", (("direction", "to_client"), ("service", tcp))): 0,
        }
        of_udp = {k: v for k, v in got.items() if ("service", udp) in k[1]}
        assert of_udp == {
            (
                "uproxy_connections_total",
                (("protocol", "UDP"), ("result", "ok"), ("service", udp)),
            ): 0,
            ("uproxy_udp_flows", (("service", udp),)): 0,
            ("uproxy_bytes_total", (("direction", "to_endpoint"), ("service", udp))): 0,
            ("uproxy_bytes_total", (("direction", "to_client"), ("service", udp))): 0,
        }
        metrics.CONNECTIONS.labels(tcp, "TCP", "ok").value += 5  # the first connection
        text = await scrape(http, server)
        ok_lines = [line for line in text.splitlines() if tcp in line and 'result="ok"' in line]
        assert ok_lines == [
            f'uproxy_connections_total{{service="{tcp}",protocol="TCP",result="ok"}} 5'
        ]
        for fam in metrics.DATA_PLANE:
            if isinstance(fam, metrics.LabelledFamily):
                assert of_family(samples(text), fam.name) == want_series(fam), fam.name
    finally:
        metrics.forget_service(tcp)
        metrics.forget_service(udp)
    got = samples(await scrape(http, server))
    assert not [k for k in got if ("service", tcp) in k[1] or ("service", udp) in k[1]]


def family_of_lines(text: str) -> Iterator[tuple[str, str]]:
    """(kind, family) per line: kind is HELP, TYPE or a sample's name."""
    current = ""
    for line in text.splitlines():
        if line.startswith(("# HELP ", "# TYPE ")):
            current = line.split()[2]
            yield line.split()[1], current
        elif line:
            yield line.split("{")[0].split(" ")[0], current


def assert_contiguous(text: str) -> list[str]:
    """Each family once: HELP, TYPE, then all its samples together. Returns the families."""
    seen: list[str] = []
    for kind, fam in family_of_lines(text):
        if kind == "HELP":
            assert fam not in seen, f"{fam}: a second HELP"
            seen.append(fam)
        elif kind == "TYPE":
            assert seen[-1] == fam, f"{fam}: TYPE without its HELP just before"
        else:  # a sample: it belongs to the family whose header came last
            assert kind == fam or kind in {f"{fam}_bucket", f"{fam}_count", f"{fam}_sum"}
    names = [f.name for f in text_string_to_metric_families(text)]
    assert len(names) == len(set(names))
    return seen


async def test_families_are_contiguous_with_one_help_and_type(
    http: aiohttp.ClientSession, server: MetricsServer, private_server: MetricsServer
) -> None:
    metrics.CONNECTIONS.labels("test/contiguous:a", "TCP", "ok").value += 1
    metrics.BYTES.labels("test/contiguous:a", "to_client").value += 1
    families = assert_contiguous(await scrape(http, server))  # the real ones
    assert {f.name for f in metrics.DATA_PLANE} <= set(families)
    assert assert_contiguous(await scrape(http, private_server)) == ["test_relayed_total"]


async def test_control_plane_keeps_kube_proxy_names(
    http: aiohttp.ClientSession, server: MetricsServer
) -> None:
    families = {f.name: f for f in text_string_to_metric_families(await scrape(http, server))}
    want = {
        "kubeproxy_sync_proxy_rules_duration_seconds": "histogram",
        "kubeproxy_network_programming_duration_seconds": "histogram",
        "kubeproxy_sync_proxy_rules_last_timestamp_seconds": "gauge",
        "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds": "gauge",
        "kubeproxy_sync_proxy_rules_service_changes": "counter",  # ..._total
        "kubeproxy_sync_proxy_rules_service_changes_pending": "gauge",
        "kubeproxy_sync_proxy_rules_endpoint_changes": "counter",
        "kubeproxy_sync_proxy_rules_endpoint_changes_pending": "gauge",
        "kubeproxy_proxy_healthz": "counter",
        "kubeproxy_proxy_livez": "counter",
        "process_open_fds": "gauge",
        "process_max_fds": "gauge",
        "process_cpu_seconds": "counter",
        "process_resident_memory_bytes": "gauge",
        "process_start_time_seconds": "gauge",
    }
    assert {name: families[name].type for name in want} == want
    (changes,) = families["kubeproxy_sync_proxy_rules_service_changes"].samples
    assert changes.name == "kubeproxy_sync_proxy_rules_service_changes_total"
    assert changes.value == REGISTRY.get_sample_value(changes.name)
    assert not [f for f in families if f.endswith("_created")]


def test_open_fds_counts_this_process_fds() -> None:
    listed = len(os.listdir("/proc/self/fd"))  # includes the fd listdir itself opened
    assert metrics.PROCESS.open_fds() in (listed - 1, listed)
    extra = [socket.socket() for _ in range(50)]
    try:
        assert metrics.PROCESS.open_fds() in (listed + 49, listed + 50)
    finally:
        for s in extra:
            s.close()


def test_process_collector_matches_the_librarys() -> None:
    from prometheus_client import PROCESS_COLLECTOR  # the one uproxy.metrics replaced

    ours = {m.name: m for m in metrics.PROCESS.collect()}
    theirs = {m.name: m for m in PROCESS_COLLECTOR.collect()}
    assert {n: (m.type, m.documentation) for n, m in ours.items()} == {
        n: (m.type, m.documentation) for n, m in theirs.items()
    }
    value = {n: m.samples[0].value for n, m in ours.items()}
    assert {n: [s.name for s in m.samples] for n, m in ours.items()} == {
        n: [s.name for s in m.samples] for n, m in theirs.items()
    }
    for name, tolerance in [
        ("process_start_time_seconds", 0.02),  # clock ticks
        ("process_max_fds", 0),
        ("process_open_fds", 1),  # the library's listdir holds one more
        ("process_cpu_seconds", 0.05),  # the library's: 10 ms ticks
        ("process_virtual_memory_bytes", 1 << 20),
        ("process_resident_memory_bytes", 1 << 20),
    ]:
        assert abs(value[name] - theirs[name].samples[0].value) <= tolerance, name


def test_process_metrics_absent_without_procfs(tmp_path: Path) -> None:
    assert list(metrics.ProcessCollector(proc=tmp_path).collect()) == []


@pytest.mark.parametrize(
    "accept", [PROMETHEUS_ACCEPT, "application/openmetrics-text;version=1.0.0", "*/*"]
)
async def test_text_format_whatever_accept_prefers(
    http: aiohttp.ClientSession, server: MetricsServer, accept: str
) -> None:
    text = await scrape(http, server, Accept=accept)  # checks the Content-Type
    assert "# EOF" not in text
    assert "uproxy_connections_total" in {
        f.name + "_total" for f in text_string_to_metric_families(text)
    }


async def test_gzip_only_when_accepted(
    http: aiohttp.ClientSession, private_server: MetricsServer, family: metrics.ScrapeCounter
) -> None:
    url = f"http://127.0.0.1:{private_server.port}/metrics"
    bodies = {}
    for coding in ("gzip", "identity", "gzip;q=0"):
        async with http.get(url, headers={"Accept-Encoding": coding}, auto_decompress=False) as r:
            bodies[coding] = (r.headers.get("Content-Encoding"), await r.read())
    assert bodies["identity"][0] is None and bodies["gzip;q=0"][0] is None
    assert bodies["gzip"][0] == "gzip"
    plain = bodies["identity"][1]
    assert gzip.decompress(bodies["gzip"][1]) == plain == bodies["gzip;q=0"][1]
    assert len(bodies["gzip"][1]) < len(plain) // 4
    assert of_family(samples(plain.decode()), family.name) == want_series(family)


@pytest.mark.parametrize(
    ("header", "want"),
    [
        (["gzip"], True),
        (["deflate, gzip;q=1.0, *;q=0.5"], True),
        (["br", "GZIP ; q=0.001"], True),
        (["gzip;q=0"], False),
        (["gzip;q=0.000"], False),
        (["gzip;q=nonsense"], False),
        (["identity", "x-gzip2"], False),
        ([], False),
    ],
)
def test_accepts_gzip(header: list[str], want: bool) -> None:
    assert accepts_gzip(header) is want


async def scrape_turning(
    http: aiohttp.ClientSession, srv: MetricsServer, on_turn: Callable[[int], None]
) -> str:
    """Scrape while ``on_turn(n)`` runs on every turn of the loop (it reschedules itself
    with call_soon until the body is complete)."""
    loop = asyncio.get_running_loop()
    done = asyncio.ensure_future(scrape(http, srv))
    turns = 0

    def turn() -> None:
        nonlocal turns
        turns += 1
        on_turn(turns)
        if not done.done():
            loop.call_soon(turn)

    loop.call_soon(turn)
    return await done


def stamper(family: metrics.ScrapeCounter) -> tuple[Callable[[int], None], Callable[[str], int]]:
    """A turn callback that stamps the family's first and last series with the turn number,
    and a reader of (last stamp - first stamp) in a scrape. Rendered in one block, both
    series show the same stamp; rendered in slices, the last one (chunks later) a later one."""
    (first, _), *_, (last, _) = family.series()

    def stamp(turn: int) -> None:
        family.labels(*first).value = family.labels(*last).value = turn

    def turns_between(text: str) -> int:
        got = samples(text)
        key = [
            (family.name, tuple(sorted(zip(family.labelnames, v, strict=True))))
            for v in (first, last)
        ]
        assert got[key[0]] >= 1
        return int(got[key[1]] - got[key[0]])

    return stamp, turns_between


@pytest.mark.usefixtures("every_chunk_a_slice")
async def test_scrape_lets_the_loop_run_between_chunks(
    http: aiohttp.ClientSession, private_server: MetricsServer, family: metrics.ScrapeCounter
) -> None:
    stamp, turns_between = stamper(family)
    text = await scrape_turning(http, private_server, stamp)
    assert turns_between(text) >= 3  # a turn between each two of the family's 4+ chunks


@pytest.mark.usefixtures("every_chunk_a_slice")
async def test_label_sets_bound_mid_scrape(
    http: aiohttp.ClientSession, private_server: MetricsServer, family: metrics.ScrapeCounter
) -> None:
    before = want_series(family)
    stamp, turns_between = stamper(family)

    def bind(turn: int) -> None:  # a listener opening on every turn of the loop
        stamp(turn)
        family.labels(f"ns/new-{turn}:http", "ok").value = 1
        family.labels(f"ns/new-{turn}:http", "failed").value = 1

    text = await scrape_turning(http, private_server, bind)
    assert turns_between(text) >= 3  # label sets were bound while the family was rendered
    got = of_family(samples(text), family.name)
    stamped = {k for k in before if before[k] in (1, MANY)}  # the first and last series
    assert {k: v for k, v in got.items() if k in before and k not in stamped} == {
        k: v for k, v in before.items() if k not in stamped
    }  # what was there before, exactly
    assert set(before) <= set(got)
    assert set(got) <= set(want_series(family))  # and nothing but bound label sets
    later = await scrape(http, private_server)
    assert of_family(samples(later), family.name) == want_series(family)


@pytest.mark.usefixtures("every_chunk_a_slice")
async def test_slices_make_the_whole_exposition(
    http: aiohttp.ClientSession, private_server: MetricsServer, family: metrics.ScrapeCounter
) -> None:
    family.labels("ns/failing:http", "failed").value = 3
    want = metrics.exposition(CollectorRegistry(), (family,))
    assert await scrape(http, private_server) == want
    assert want.count("\n") == 2 + MANY + 1  # HELP, TYPE, the series


@pytest.mark.usefixtures("every_chunk_a_slice")
async def test_two_scrapes_at_once(
    http: aiohttp.ClientSession, private_server: MetricsServer, family: metrics.ScrapeCounter
) -> None:
    one, two = await asyncio.gather(scrape(http, private_server), scrape(http, private_server))
    assert one == two
    assert of_family(samples(one), family.name) == want_series(family)


@pytest.mark.usefixtures("every_chunk_a_slice")
async def test_client_leaving_mid_body(
    http: aiohttp.ClientSession,
    uproxy_logs: list[logging.LogRecord],
    caplog: pytest.LogCaptureFixture,
) -> None:
    big = metrics.ScrapeGauge("test_big", "Many series", ("service",))
    for i in range(40 * metrics.SERIES_PER_CHUNK):  # ~2 MB: more than the socket buffers
        big.labels(f"ns/{'x' * 60}-{i}:http").value = i
    srv = MetricsServer(address="127.0.0.1", port=0, registry=CollectorRegistry(), families=(big,))
    await srv.start()
    try:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(sock, ("127.0.0.1", srv.port))
        await loop.sock_sendall(sock, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await loop.sock_recv(sock, 1024)).startswith(b"HTTP/1.1 200")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # a reset, with most of the body unsent

        def left() -> bool:
            return any(r.getMessage() == "Metrics client left mid-scrape" for r in uproxy_logs)

        await wait_until(left)
        got = samples(await scrape(http, srv))
        assert len(got) == len(big.series())
    finally:
        await srv.close()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
