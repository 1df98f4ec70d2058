"""Shared-memory counters: what a worker counts is read by the control process, exactly, and
stays counted after the worker is gone. The worker side runs in a real child process."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from uproxy import metrics
from uproxy.dataplane import counters
from uproxy.dataplane.counters import CounterFiles, SlotReader, SlotWriter

_WORKER = textwrap.dedent(
    """
    import sys
    from uproxy import metrics
    from uproxy.dataplane.counters import CounterFiles, SlotWriter
    metrics.share(SlotWriter(CounterFiles(int(sys.argv[1]), int(sys.argv[2]))))
    svc = "ns/web:http"
    metrics.BYTES.labels(svc, "to_endpoint").value += 1000
    metrics.BYTES.labels(svc, "to_endpoint").value += 234
    metrics.CONNECTIONS.labels(svc, "TCP", "ok").value += 3
    metrics.OPEN_CONNECTIONS.labels(svc, "TCP").value += 2
    metrics.ACCEPT_PAUSED.labels("emfile").value += 1
    metrics.DIAL_DURATION.observe(0.003)
    metrics.DIAL_DURATION.observe(0.3)
    """
)


@pytest.fixture(autouse=True)
def control_side_families() -> Iterator[None]:
    """These tests add up as the control process does, which rebinds and prunes the
    families' label sets; the in-process data plane of other tests holds the ones bound
    before (module-level tallies included). Put them back afterwards."""
    families = [f for f in metrics.DATA_PLANE if isinstance(f, metrics.LabelledFamily)]
    saved = [dict(f._tallies) for f in families]
    dial = (metrics.DIAL_DURATION._store, metrics.DIAL_DURATION._base)
    yield
    for family, tallies in zip(families, saved, strict=True):
        family._tallies = tallies
    metrics.DIAL_DURATION._store, metrics.DIAL_DURATION._base = dial


def run_worker(files: CounterFiles) -> None:
    fds = (files.values_fd, files.directory_fd)
    subprocess.run(
        [sys.executable, "-c", _WORKER, *map(str, fds)],
        check=True,
        pass_fds=fds,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
        timeout=60,
    )


def totals(name: str) -> dict[tuple[str, ...], float]:
    family = next(f for f in metrics.DATA_PLANE if f.name == name)
    assert isinstance(family, metrics.LabelledFamily)
    return {labels: t.value for labels, t in family.series() if t.value}


def test_counter_files_that_cannot_all_be_made_leave_no_fd_open(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker's replacement is retried while the control process is out of fds; the
    first memfd of each try that got only one stayed open for good, one more fd short each
    time."""
    made = os.memfd_create

    def second_fails(name: str, flags: int = os.MFD_CLOEXEC) -> int:
        if name == "uproxy-counter-names":
            raise OSError(24, "Too many open files")
        return made(name, flags)

    monkeypatch.setattr(os, "memfd_create", second_fails)
    before = sorted(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError, match="Too many open files"):
        CounterFiles.create()
    assert sorted(os.listdir("/proc/self/fd")) == before


def test_the_control_process_adds_up_live_and_dead_workers_exactly() -> None:
    a, b = CounterFiles.create(), CounterFiles.create()
    try:
        run_worker(a)  # both have counted and exited: their numbers are in shared memory
        run_worker(b)
        readers = [SlotReader(a), SlotReader(b)]
        sums = metrics.WorkerTotals()
        sums.add_up(readers)
        svc = ("ns/web:http",)
        assert totals("uproxy_bytes_total")[(*svc, "to_endpoint")] == 2 * 1234
        assert totals("uproxy_connections_total")[(*svc, "TCP", "ok")] == 6
        assert totals("uproxy_open_connections")[(*svc, "TCP")] == 4
        assert totals("uproxy_accept_paused_total")[("emfile",)] == 2
        assert sum(metrics.DIAL_DURATION.counts) == 4
        assert abs(metrics.DIAL_DURATION.sum - 2 * 0.303) < 1e-9
        # Worker a is replaced: its counts stay, its gauges go, nothing counts twice.
        sums.retire(readers[0])
        sums.add_up(readers[1:])
        assert totals("uproxy_bytes_total")[(*svc, "to_endpoint")] == 2 * 1234
        assert totals("uproxy_open_connections")[(*svc, "TCP")] == 2
        assert sum(metrics.DIAL_DURATION.counts) == 4
        for reader in readers:
            reader.close()
    finally:
        a.close()
        b.close()


def test_a_reader_learns_label_sets_bound_after_it_started() -> None:
    files = CounterFiles.create()
    try:
        writer, reader = SlotWriter(files), SlotReader(files)
        first = writer.new_slot("uproxy_bytes_total", ("a", "to_client"))
        writer.values[first] += 5
        reader.refresh()
        assert list(reader.items()) == [("uproxy_bytes_total", ("a", "to_client"), 5.0)]
        second = writer.new_slot("uproxy_bytes_total", ("b", "to_client"))
        writer.values[second] += 7
        writer.values[first] += 1
        reader.refresh()
        assert [v for *_, v in reader.items()] == [6.0, 7.0]
        reader.close()
    finally:
        files.close()


_FORGETTING_WORKER = textwrap.dedent(
    """
    import sys
    from uproxy import metrics
    from uproxy.dataplane.counters import CounterFiles, SlotWriter
    metrics.share(SlotWriter(CounterFiles(int(sys.argv[1]), int(sys.argv[2]))))
    for svc in ("ns/gone:http", "ns/stays:http"):
        metrics.BYTES.labels(svc, "to_endpoint").value += 100
        metrics.CONNECTIONS.labels(svc, "TCP", "ok").value += 1
    held = metrics.BYTES.labels("ns/gone:http", "to_endpoint")  # a draining connection's
    metrics.forget_service("ns/gone:http")
    held.value += 50  # still counted by whoever holds it; reported by nobody
    """
)


def test_a_deleted_services_series_go_and_the_others_stay() -> None:
    files = CounterFiles.create()
    try:
        fds = (files.values_fd, files.directory_fd)
        subprocess.run(
            [sys.executable, "-c", _FORGETTING_WORKER, *map(str, fds)],
            check=True,
            pass_fds=fds,
            env={**os.environ, "PYTHONPATH": os.getcwd()},
            timeout=60,
        )
        reader = SlotReader(files)
        reader.refresh()
        services = {labels[0] for _, labels, _ in reader.items() if labels}
        assert services >= {"ns/stays:http"} and "ns/gone:http" not in services
        sums = metrics.WorkerTotals()
        metrics.BYTES.local(("ns/gone:http", "to_endpoint")).value = 100  # from an earlier scrape
        sums.add_up([reader])
        assert ("ns/gone:http", "to_endpoint") not in totals("uproxy_bytes_total")
        assert totals("uproxy_bytes_total")[("ns/stays:http", "to_endpoint")] == 100
        sums.retire(reader)  # the worker goes: the forgotten series is not kept either
        sums.add_up([])
        assert ("ns/gone:http", "to_endpoint") not in totals("uproxy_bytes_total")
        assert totals("uproxy_bytes_total")[("ns/stays:http", "to_endpoint")] == 100
        reader.close()
    finally:
        files.close()


async def test_a_sliced_add_up_lets_the_loop_run_and_counts_a_worker_that_dies_meanwhile_once() -> (
    None
):
    # Two workers with 3,000 series each; the first dies (its counts move to the dead's and
    # its shared memory is closed) while a scrape is adding up: the pass starts over and
    # every series is counted once, 1 (the dead) + 2 (the live one).
    a, b = CounterFiles.create(), CounterFiles.create()
    try:
        for files, value in ((a, 1.0), (b, 2.0)):
            writer = SlotWriter(files)
            for i in range(3000):
                writer.values[writer.new_slot("uproxy_bytes_total", (f"ns/s{i}:p", "in"))] = value
        dying, staying = SlotReader(a), SlotReader(b)
        live = [dying, staying]
        sums = metrics.WorkerTotals()
        turns = 0

        async def the_rest_of_the_loop() -> None:
            nonlocal turns
            while True:
                await asyncio.sleep(0)
                turns += 1
                if turns == 3:
                    sums.retire(dying)
                    live.remove(dying)
                    dying.close()

        other = asyncio.create_task(the_rest_of_the_loop())
        await sums.add_up_sliced(lambda: list(live), budget_s=0.0)
        other.cancel()
        assert turns > 3  # the loop ran between slices, and after the death too
        got = totals("uproxy_bytes_total")
        assert {got[(f"ns/s{i}:p", "in")] for i in range(3000)} == {3.0}
        staying.close()
    finally:
        a.close()
        b.close()


_CHURNING_WORKER = textwrap.dedent(
    """
    import sys
    from uproxy import metrics
    from uproxy.dataplane.counters import CounterFiles, SlotWriter
    writer = SlotWriter(CounterFiles(int(sys.argv[1]), int(sys.argv[2])))
    metrics.share(writer)
    metrics.BYTES.labels("ns/stays:http", "to_endpoint").value += 7
    for i in range(int(sys.argv[3])):  # a service created, used and deleted, again and again
        svc = f"ns/churn-{i}:http"
        metrics.BYTES.labels(svc, "to_endpoint").value += 1000
        held = metrics.CONNECTIONS.labels(svc, "TCP", "ok")  # a connection still draining
        held.value += 1
        metrics.forget_service(svc)
        held.value += 1  # counted into a slot nobody reports, and not handed out meanwhile
        del held
    metrics.BYTES.labels("ns/stays:http", "to_endpoint").value += 1
    metrics.CONNECTIONS.labels("ns/late:http", "TCP", "ok").value += 5
    print(writer.compactions, max(writer._free, default=0), flush=True)
    """
)


def test_a_churning_worker_stays_within_a_few_slots_and_is_added_up_exactly() -> None:
    """A service created and deleted 20,000 times: its slots are handed out again once
    nothing counts into them, and the directory is rewritten with what is live, so a
    worker's counters stay the size of what it serves (before, every port created took new
    slots and directory records for good, and past ~150,000 new ports counted nowhere)."""
    files = CounterFiles.create(directory_bytes=1 << 20)  # 512 KiB a half: many rewrites
    try:
        fds = (files.values_fd, files.directory_fd)
        done = subprocess.run(
            [sys.executable, "-c", _CHURNING_WORKER, *map(str, fds), "20000"],
            check=True,
            pass_fds=fds,
            env={**os.environ, "PYTHONPATH": os.getcwd()},
            capture_output=True,
            text=True,
            timeout=120,
        )
        compactions, highest_slot = map(int, done.stdout.split())
        assert compactions >= 3
        assert highest_slot < 40  # the same few slots, over and over
        reader = SlotReader(files)
        assert reader.refresh()
        seen = {(family, labels): value for family, labels, value in reader.items()}
        assert seen[("uproxy_bytes_total", ("ns/stays:http", "to_endpoint"))] == 8
        assert seen[("uproxy_connections_total", ("ns/late:http", "TCP", "ok"))] == 5
        assert not [labels for _, labels in seen if "churn" in labels[0]]
        reader.close()
    finally:
        files.close()


def test_a_reader_follows_a_rewrite_of_the_directory_and_keeps_serving_meanwhile() -> None:
    files = CounterFiles.create(directory_bytes=1 << 16)
    bound: dict[int, tuple[str, tuple[str, ...]]] = {}
    try:
        writer = SlotWriter(files, live=lambda: ((s, f, v) for s, (f, v) in bound.items()))
        reader = SlotReader(files)
        kept = writer.new_slot("uproxy_bytes_total", ("ns/kept:p", "in"))
        bound[kept] = ("uproxy_bytes_total", ("ns/kept:p", "in"))
        writer.values[kept] = 3
        reader.refresh()
        for i in range(2000):  # far more records than a half holds: rewritten many times
            slot = writer.new_slot("uproxy_bytes_total", (f"ns/s{i}:p", "in"))
            writer.values[slot] = 1
            writer.forget_slot(slot)
            writer.release(slot)
            if i % 500 == 0:
                # Between two rewrites the reader serves what it knew (one label set that
                # stayed, with its value), then learns the rest.
                assert ("ns/kept:p", "in") in [labels for _, labels, _ in reader.items()]
                assert reader.refresh()
        assert writer.compactions >= 2
        assert reader.refresh()
        assert list(reader.items()) == [("uproxy_bytes_total", ("ns/kept:p", "in"), 3.0)]
        reader.close()
    finally:
        files.close()


async def test_a_rewrite_under_a_running_loop_goes_in_steps_and_keeps_what_changed_meanwhile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker's rewrite of the directory writes a few hundred records, lets the loop run,
    and goes on (at 10,000 service ports it is 70,000 records, ~50 ms in one go, which every
    relay of the worker waited out). What is bound and forgotten between its steps is right
    once it is done, and a reader keeps serving the old half meanwhile."""
    monkeypatch.setattr(counters, "REWRITE_STEP_S", 0.0)  # a step per clock look: countable
    files = CounterFiles.create(directory_bytes=16 << 20)
    bound: dict[int, tuple[str, tuple[str, ...]]] = {}
    try:
        writer = SlotWriter(files, live=lambda: [(s, f, v) for s, (f, v) in bound.items()])
        reader = SlotReader(files)

        def bind(name: str, value: float) -> int:
            slot = writer.new_slot("uproxy_bytes_total", (name, "in"))
            bound[slot] = ("uproxy_bytes_total", (name, "in"))
            writer.values[slot] = value
            return slot

        def forget(slot: int) -> None:
            del bound[slot]
            writer.forget_slot(slot)
            writer.release(slot)

        # Past the first rewrite's threshold (256 KiB of records) with the loop running: it
        # begins, and nothing of it is done before the loop runs.
        slots = [bind(f"ns/s{i:05}:p", i) for i in range(8000)]
        assert writer.compactions == 0
        assert reader.refresh()
        steps = 0
        while writer.compactions == 0 and steps < 1000:
            await asyncio.sleep(0)
            steps += 1
            # Between two steps: a new label set, one forgotten, and a slot reused.
            bind(f"ns/new{steps}:p", 0.5)
            forget(slots[steps * 7])
            bind(f"ns/reused{steps}:p", 0.25)
            assert reader.refresh()  # the old half, with everything up to now
            assert len(list(reader.items())) == len(bound)
        assert writer.compactions == 1
        assert steps > 10
        assert reader.refresh()
        expected = {
            ("uproxy_bytes_total", labels, writer.values[s]) for s, (_, labels) in bound.items()
        }
        assert set(reader.items()) == expected
        assert len(list(reader.items())) == len(bound)
        reader.close()
    finally:
        files.close()
