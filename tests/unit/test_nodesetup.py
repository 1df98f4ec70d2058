"""kube-proxy's node settings, against a /proc/sys and /sys tree of files: what is raised,
what is left alone (never lowered), and the hash size that follows the table. The real
files, in a network namespace, are in tests/e2e/test_node_setup.py."""

from __future__ import annotations

import asyncio
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from uproxy import run as uproxy_run
from uproxy.nodesetup import (
    HASHSIZE,
    NETFILTER,
    NamespaceTaken,
    Wanted,
    answer_claim,
    claim_network_namespace,
    set_oom_score_adj,
    table_size,
    tune,
)
from uproxy.settings import Settings

NODE = {
    "nf_conntrack_max": 65536,
    "nf_conntrack_tcp_timeout_established": 432000,
    "nf_conntrack_tcp_timeout_close_wait": 60,
    "nf_conntrack_tcp_be_liberal": 0,
    "nf_conntrack_udp_timeout": 30,
    "nf_conntrack_udp_timeout_stream": 120,
}


@pytest.fixture
def node(tmp_path: Path) -> Path:
    netfilter = tmp_path / "proc" / NETFILTER
    netfilter.mkdir(parents=True)
    for name, value in NODE.items():
        (netfilter / name).write_text(f"{value}\n")
    hashsize = tmp_path / "sys" / HASHSIZE
    hashsize.parent.mkdir(parents=True)
    hashsize.write_text("16384\n")
    return tmp_path


def values(root: Path) -> dict[str, int]:
    out = {p.name: int(p.read_text()) for p in (root / "proc" / NETFILTER).iterdir()}
    out["hashsize"] = int((root / "sys" / HASHSIZE).read_text())
    return out


def run(root: Path, wanted: Wanted) -> list[str]:
    return tune(wanted, proc_sys=str(root / "proc"), sys=str(root / "sys"))


@pytest.mark.parametrize(
    ("per_core", "minimum", "cpus", "size"),
    [(32768, 131072, 2, 131072), (32768, 131072, 8, 262144), (0, 131072, 8, 0), (10, 0, 3, 30)],
)
def test_the_table_is_sized_per_cpu_with_a_floor(
    per_core: int, minimum: int, cpus: int, size: int
) -> None:
    assert table_size(per_core, minimum, cpus) == size


def test_kube_proxys_defaults_raise_what_is_lower_and_leave_the_rest(node: Path) -> None:
    wanted = Wanted.from_settings(Settings(), cpus=8)
    assert wanted == Wanted(max=262144, tcp_established_s=86400, tcp_close_wait_s=3600)
    assert run(node, wanted) == []
    assert values(node) == {
        **NODE,  # the established timeout was longer already: kept
        "nf_conntrack_max": 262144,
        "nf_conntrack_tcp_timeout_close_wait": 3600,
        "hashsize": 65536,  # a quarter of the table
    }
    before = values(node)
    assert run(node, wanted) == []  # a second run (uproxy after its init container): nothing
    assert values(node) == before


def test_nothing_is_ever_lowered(node: Path) -> None:
    wanted = Wanted(max=1000, tcp_established_s=60, tcp_close_wait_s=10, udp_s=5, udp_stream_s=5)
    assert run(node, wanted) == []
    assert values(node) == {**NODE, "hashsize": 16384}


def test_the_hash_follows_the_wanted_table_even_when_the_table_is_large_enough(
    node: Path,
) -> None:
    (node / "proc" / NETFILTER / "nf_conntrack_max").write_text("1000000\n")
    assert run(node, Wanted(max=131072)) == []
    assert values(node)["nf_conntrack_max"] == 1000000
    assert values(node)["hashsize"] == 32768


def test_liberal_tcp_and_udp_timeouts_are_set_when_asked(node: Path) -> None:
    settings = Settings(
        conntrack_max_per_core=0,
        conntrack_tcp_timeout_established=0,
        conntrack_tcp_timeout_close_wait=0,
        conntrack_tcp_be_liberal=True,
        conntrack_udp_timeout=45,
        conntrack_udp_timeout_stream=180,
    )
    assert run(node, Wanted.from_settings(settings)) == []
    assert values(node) == {
        **NODE,
        "nf_conntrack_tcp_be_liberal": 1,
        "nf_conntrack_udp_timeout": 45,
        "nf_conntrack_udp_timeout_stream": 180,
        "hashsize": 16384,  # no table size asked for: the hash is left alone too
    }


def test_a_node_without_conntrack_says_so_and_the_rest_is_still_raised(node: Path) -> None:
    (node / "proc" / NETFILTER / "nf_conntrack_max").unlink()
    problems = run(node, Wanted(max=131072, tcp_close_wait_s=3600))
    assert problems == [
        "net/netfilter/nf_conntrack_max: missing (is the nf_conntrack module loaded?)"
    ]
    assert values(node)["nf_conntrack_tcp_timeout_close_wait"] == 3600


def test_the_oom_score_is_set_and_a_refusal_is_returned(tmp_path: Path) -> None:
    score = tmp_path / "oom_score_adj"
    score.write_text("0\n")
    assert set_oom_score_adj(-999, path=str(score)) is None
    assert score.read_text() == "-999\n"
    assert set_oom_score_adj(-999, path=str(tmp_path / "missing")) == "No such file or directory"


def test_one_holder_of_a_network_namespace_and_who_it_is() -> None:
    name = f"\0uproxy-test-{os.getpid()}-{time.monotonic_ns()}"
    held = claim_network_namespace(name)
    try:
        with pytest.raises(NamespaceTaken) as taken:
            claim_network_namespace(name)
        assert taken.value.pid == os.getpid()
        assert f"another uproxy (pid {os.getpid()} in its PID namespace)" in str(taken.value)
    finally:
        held.close()
    claim_network_namespace(name).close()  # released with its holder


async def test_a_start_waits_out_the_drain_its_predecessor_said(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A restart that shortened --drain-timeout gave up on a predecessor still draining
    within its own: the holder answers with its drain timeout, and that is waited for."""
    monkeypatch.setattr(uproxy_run, "CLAIM_GRACE_S", 0.1)
    name = f"\0uproxy-test-{os.getpid()}-{time.monotonic_ns()}"
    first = claim_network_namespace(name)  # a predecessor with --drain-timeout 1.5s

    def predecessor() -> None:  # its own process in life: answers, lets go after 0.8 s
        with first:
            until = time.monotonic() + 0.8
            while (left := until - time.monotonic()) > 0:
                if select.select([first], [], [], left)[0]:
                    answer_claim(first, 1.5)

    thread = threading.Thread(target=predecessor)
    thread.start()
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        second = await uproxy_run.claim_node(Settings(drain_timeout=0.1), name)  # own: 0.2 s
        loop.remove_reader(second.fileno())  # it answers the next start; not one here
        second.close()
    finally:
        thread.join()
    assert loop.time() - started >= 0.7  # it waited until the first let go


async def test_a_holder_answering_no_length_of_time_is_waited_for_boundedly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A holder that answered ``inf`` (anybody may bind the abstract name) was waited for
    for ever: the start said it waited ``wait_s=inf`` and never served. Its answer is not
    believed, and the start gives up after its own drain, naming the holder."""
    monkeypatch.setattr(uproxy_run, "CLAIM_GRACE_S", 0.1)
    name = f"\0uproxy-test-{os.getpid()}-{time.monotonic_ns()}"
    holder = claim_network_namespace(name)
    stop = threading.Event()

    def answer_inf() -> None:
        while not stop.is_set():
            if select.select([holder], [], [], 0.05)[0]:
                conn = holder.accept()[0]
                with conn:
                    conn.send(b"inf\n")

    thread = threading.Thread(target=answer_inf)
    thread.start()
    try:
        with pytest.raises(NamespaceTaken) as taken:
            await asyncio.wait_for(uproxy_run.claim_node(Settings(drain_timeout=0.1), name), 5)
    finally:
        stop.set()
        thread.join()
        holder.close()
    assert taken.value.pid == os.getpid()
    assert taken.value.drain_s is None


@pytest.mark.root  # a holder of another uid
def test_a_holder_of_another_user_is_not_taken_for_a_uproxy() -> None:
    """An unprivileged process on the node that bound the abstract name before uproxy was
    reported as "another uproxy", and how long it said it drains was waited for."""
    name = f"\0uproxy-test-{os.getpid()}-{time.monotonic_ns()}"
    script = (
        "import socket, sys\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
        f"s.bind({name!r}); s.listen(1)\n"
        "print('ready', flush=True)\n"
        "s.settimeout(10)\n"
        "c = s.accept()[0]; c.send(b'1e9\\n'); c.close()\n"
        "sys.stdin.read()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script],
        user=65534,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        with pytest.raises(NamespaceTaken) as taken:
            claim_network_namespace(name)
    finally:
        child.communicate(timeout=10)
    assert taken.value.pid == child.pid
    assert taken.value.uid == 65534
    assert taken.value.drain_s is None
    assert "a process of uid 65534" in str(taken.value)
    assert "another uproxy" not in str(taken.value)
