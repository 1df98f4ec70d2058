"""CPU priority between the two roles: the control process yields the CPU to the workers.

The control process's bulk work (a sync of 10,000 services, a rules rewrite and the
``iptables-restore``/``nft`` it runs) shares the node's CPUs with the workers that relay, the
clients and the backends. At one priority the scheduler lets that work finish its time slice
(1.4-4 ms measured) while a woken relay, client or backend waits behind it on that CPU. Two
settings of the scheduler fix that, each per thread:

- **Nice.** The control process runs ``step`` nice levels below the workers: under full load
  it gets about a tenth of what a worker gets at nice 10 (never nothing), the workers the rest.
- **Slice.** The control process asks for a long time slice (``sched_setattr``'s
  ``sched_runtime``, honoured since Linux 6.12). The fair scheduler (EEVDF) gives a task that
  asks for more time a later deadline, and lets a woken task whose slice is shorter preempt
  it at once, so every other task (a worker, a client, a backend) takes the CPU from the
  control process as soon as it wakes, instead of at the end of the control's slice.

- **Giving way.** A worker applying a burst of changes (a sync of 10,000 ports) gives up
  the CPU between slices of it (``sched_yield``, see ``dataplane.messages``), and stays
  runnable: no wake-up comes when its next packet arrives. When the scheduler hands that CPU
  to the control process, a runnable worker gets it back only at the next tick (4 ms at
  HZ=250): ``perf sched`` during a 10,000-service swap showed workers waiting 3.8-5.1 ms
  behind the control process that way, 34 ms in all over 3 s. So the control process's bulk
  work calls ``give_way`` as it goes (``TimeSlice``, the services file's parse, the channel
  to the workers), which yields the CPU at most once per ``GIVE_WAY_S`` (0.1 ms; 0.5 ms
  until the first sync is done, when nothing relays yet): a no-op when nobody waits; a
  waiting worker gets the CPU back within about that long, not at the next tick. In the
  same swap the workers' waits behind the control process came to 4 ms in all, and the
  keep-alive p99 went from 0.84-1.03 / 0.71-1.64 ms to 0.55-0.88 / 0.68-0.86 ms
  (iptables-restore / nftables; 6 runs as before against 7 giving way, 5 of them every
  0.2 ms and 2 every 0.5 ms, alternating). A process that did not lower itself never gives
  way. Where the CPU is saturated by others, a yield costs far more than it gives, and a
  yield that comes back late pauses them (``offer_cpu``).

A new thread or process starts with its creator's values. So the control process sets every
thread it has (later threads, and every command it runs, inherit them), and a worker, forked
from it, sets itself back to the nice value the control process started with and the
kernel's default slice. Going back up in nice needs CAP_SYS_NICE (or RLIMIT_NICE): without it
the nice value stays, since workers stuck at the control's lower priority would lose to every
other process on the node; the slice needs no privilege.
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct
import threading
import time
from dataclasses import dataclass

TASKS = "/proc/self/task"
# The longest ``can_raise_back`` waits for its probe thread to be gone (it takes well under
# a millisecond but for a CPU that is not free).
PROBE_EXIT_WAIT_S = 1.0
# The slice the control process asks for; the kernel clamps it to 0.1-100 ms.
CONTROL_SLICE_NS = 20_000_000
# sched_setattr(2) has no wrapper in Python or glibc: the system call, by number.
_SCHED_SETATTR, _SCHED_GETATTR = {"x86_64": (314, 315), "aarch64": (274, 275)}.get(
    platform.machine(), (None, None)
)
_FAIR_POLICIES = (os.SCHED_OTHER, os.SCHED_BATCH)
_libc: ctypes.CDLL | None = None
# The most CPU time the lowered control process's bulk work takes between two offers of the
# CPU (``give_way``) once the data plane serves (``serving``): a worker that gave up its CPU
# between slices of a 10,000-port swap waits about that long for it when the control process
# has it. Keep-alive p99 through the swap, 3 alternating pairs of runs (nftables /
# iptables-restore): 0.36-0.53 / 0.38-0.51 ms every 0.1 ms, 0.50-0.60 / 0.49-1.07 every 0.5.
GIVE_WAY_S = 0.0001
# ... until then: nothing relays yet, and each offer is taken by a worker receiving the
# listeners (a pair of context switches): offers every 0.1 ms made a cold start of 10,000
# services 0.05-0.15 s slower, every 0.2 ms up to 0.1 s.
GIVE_WAY_STARTING_S = 0.0005
# A yield that comes back later than this found the CPU taken by others, not by a worker
# that wanted a moment of it: after it, no yield for ``YIELD_PAUSE_FACTOR`` times as long as
# it took. On the kernels measured here (6.18) a task that yields forfeits the rest of its
# slice in virtual time (its vruntime moves to its deadline), charged at its weight: with
# two busy nice-0 tasks on its CPU, a yield by the control process (nice 10, a 20 ms slice)
# came back after 348-376 ms and one by a worker (nice 0) after 3.8 ms, against 1-2 us on
# an idle CPU. Yielding every 0.1-0.5 ms, bulk work on a saturated CPU got 0.3-2 % of the
# CPU its weight is worth: 5,000 services, listed in 0.7 s when idle, were not synced after
# 120 s. With the pause, late yields cost at most a tenth of the time.
YIELD_LATE_S = 0.002
YIELD_PAUSE_FACTOR = 10
_giving_way = False  # set once this process lowered itself
_interval = GIVE_WAY_STARTING_S
_gave_way = 0.0
_yield_paused_until = 0.0


def offer_cpu(now: float) -> None:
    """``sched_yield``, unless a recent yield came back late (``YIELD_LATE_S``): then
    nothing until ``YIELD_PAUSE_FACTOR`` times as long as that yield took has passed.
    ``now``: ``time.perf_counter()``, just read."""
    global _yield_paused_until
    if now < _yield_paused_until:
        return
    os.sched_yield()
    took = time.perf_counter() - now
    if took > YIELD_LATE_S:
        _yield_paused_until = now + took * (1 + YIELD_PAUSE_FACTOR)


def give_way(now: float | None = None) -> None:
    """In the lowered control process, during bulk work: let a runnable worker (or anyone
    else waiting for this CPU) have it, at most once per ``GIVE_WAY_S`` (while starting:
    ``GIVE_WAY_STARTING_S``); otherwise nothing.
    ``now``: ``time.perf_counter()`` when the caller has just read it."""
    global _gave_way
    if not _giving_way:
        return
    if now is None:
        now = time.perf_counter()
    if now - _gave_way >= _interval:
        _gave_way = now
        offer_cpu(now)


def serving() -> None:
    """The data plane serves (the first sync is done): offer the CPU every ``GIVE_WAY_S``."""
    global _interval
    _interval = GIVE_WAY_S


@dataclass(frozen=True, slots=True)
class Lowered:
    """What the control process did to itself; workers take back ``worker_nice``."""

    worker_nice: int
    control_nice: int
    control_slice_ns: int | None  # None: the kernel's default (sched_setattr unsupported)


def current() -> int:
    """The calling thread's nice value."""
    return os.getpriority(os.PRIO_PROCESS, 0)


def set_thread(tid: int, nice: int, slice_ns: int = 0) -> bool:
    """Thread ``tid`` (0: the caller) to ``nice`` and a time slice of ``slice_ns`` (0: the
    kernel's default). False when only the nice value could be set (no sched_setattr here)."""
    if _sched_setattr(tid, nice, slice_ns):
        return True
    os.setpriority(os.PRIO_PROCESS, tid, nice)
    return False


def set_process(nice: int, slice_ns: int = 0, *, tasks: str = TASKS) -> bool:
    """Every thread of this process (threads that end meanwhile are skipped), as
    ``set_thread``; False when a slice could not be set."""
    slices = True
    for name in os.listdir(tasks):
        try:
            slices = set_thread(int(name), nice, slice_ns) and slices
        except ProcessLookupError:
            pass
    return slices


def can_raise_back(step: int, *, tasks: str = TASKS) -> bool:
    """Whether a thread that went ``step`` nice levels down may come back up (what a worker
    does): tried for real, on a short-lived thread of its own.

    When the answer is no, that thread cannot come back up either, and until the kernel has
    removed it, it is one of this process's tasks that ``set_process`` cannot set: the
    thread's ``join`` returns a moment before the thread is gone (under load, long enough
    for a start to fail on it with EPERM). So this returns once it has left ``tasks``.
    """
    answer: list[bool] = []
    tid: list[int] = []

    def probe() -> None:
        tid.append(threading.get_native_id())
        base = current()
        try:
            os.setpriority(os.PRIO_PROCESS, 0, base + step)
            os.setpriority(os.PRIO_PROCESS, 0, base)
        except PermissionError:
            answer.append(False)
        else:
            answer.append(True)

    t = threading.Thread(target=probe, name="nice-probe")
    t.start()
    t.join()
    gone_by = time.monotonic() + PROBE_EXIT_WAIT_S
    while tid and os.path.exists(f"{tasks}/{tid[0]}") and time.monotonic() < gone_by:
        time.sleep(0.001)
    return answer == [True]


def lower_control(step: int) -> Lowered | None:
    """Lower this (the control) process: ``step`` nice levels (capped at 19) when workers
    started from it can come back up, and a long time slice. None when nothing changed:
    ``step`` 0, a scheduling policy other than the fair ones (an operator's choice, kept), or
    neither setting possible."""
    if step <= 0 or os.sched_getscheduler(0) not in _FAIR_POLICIES:
        return None
    base = current()
    target = min(19, base + step)
    if target != base and not can_raise_back(target - base):
        target = base
    # A kernel before 6.12 takes the slice and ignores it: read back what it keeps.
    slices = set_process(target, CONTROL_SLICE_NS) and slice_of(0) == CONTROL_SLICE_NS
    if target == base and not slices:
        return None
    global _giving_way
    _giving_way = True
    return Lowered(base, target, CONTROL_SLICE_NS if slices else None)


def take_back(nice: int) -> None:
    """In a worker started by a lowered control process: the control's starting nice value
    and the kernel's default slice, for every thread; it no longer gives way."""
    global _giving_way
    _giving_way = False
    set_process(nice, 0)


def raise_started(pid: int, lowered: Lowered) -> None:
    """A worker the lowered control process has just started: its one thread straight to the
    workers' nice value and the kernel's default slice, so that its interpreter does not
    start and import at the control's priority. Under full load that is about a tenth of a
    CPU: a replacement then took 1.3-1.5 s to be ready, against 0.15 s on an idle machine
    (two busy loops on two CPUs). The worker still sets every thread of its own as it starts
    (``take_back``); a worker already gone, or one this process may not raise, is left to
    that."""
    try:
        set_thread(pid, lowered.worker_nice, 0)
    except OSError:
        pass


def slice_of(tid: int) -> int | None:
    """Thread ``tid``'s (0: the caller's) time slice in ns as the kernel reports it: since
    Linux 6.12 the slice it runs with (asked for, or the default); before, 0. None when this
    kernel or machine cannot say."""
    if _SCHED_GETATTR is None:
        return None
    buf = ctypes.create_string_buffer(48)
    if _c().syscall(_SCHED_GETATTR, tid, buf, 48, 0) != 0:
        return None
    runtime: int = struct.unpack_from("Q", buf, 24)[0]
    return runtime


def _c() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def _sched_setattr(tid: int, nice: int, slice_ns: int) -> bool:
    """sched_setattr(2) for a fair-policy thread, keeping its policy; False when this kernel
    or machine has no such call (or ignores nothing but rejects the attributes)."""
    if _SCHED_SETATTR is None:
        return False
    # struct sched_attr, first version (48 bytes): size, policy, flags, nice, priority,
    # runtime, deadline, period. SCHED_FLAG_KEEP_POLICY (0x08): only nice and runtime change.
    attr = struct.pack("IIQiIQQQ", 48, 0, 0x08, nice, 0, slice_ns, 0, 0)
    buf = ctypes.create_string_buffer(attr, len(attr))
    if _c().syscall(_SCHED_SETATTR, tid, buf, 0) == 0:
        return True
    err = ctypes.get_errno()
    if err == 3:  # ESRCH
        raise ProcessLookupError(err, os.strerror(err))
    if err in (1, 13):  # EPERM, EACCES: a nice value below what we may take
        raise PermissionError(err, os.strerror(err))
    return False  # ENOSYS, EINVAL (E2BIG): fall back to setpriority
