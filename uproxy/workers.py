"""The data-plane workers, seen from the control process: start, feed, watch, replace, stop.

``WorkerPool`` is what the syncer talks to when uproxy relays in worker processes
(``--workers N``): the syncer opens listeners and sets endpoints exactly as it does with the
in-process data plane, and the pool turns that into messages (``dataplane.messages``):

- A listener is bound here (a port that is taken fails here, at once, as it would in process)
  as a SO_REUSEPORT group: for TCP, one socket every worker accepts on (each gets a copy), so
  the next connection goes to whichever worker is free; with ClientIP affinity, and for UDP,
  one socket per worker, the group choosing by client address (``dataplane.sockets``), so a
  client always reaches the same worker. Turning affinity on or off regroups a TCP port's
  sockets on the same port without ever closing it, and without resetting a connection
  (``_steer_apart``, ``_gather``).
- This process holds every socket of every group as long as its port is served, as an
  nginx master holds its listening sockets: the workers get copies. A worker that dies
  leaves its sockets where they are in their groups, so no other client moves to another
  socket, and the connections that reach them meanwhile queue there for its replacement,
  which gets copies of the same sockets.
- Endpoint changes go to every worker as they come; each worker's balancer follows them.
  Balancers are per service port and IP family, listeners per service port, traffic class
  and family (the family of the address a listener is bound to).
- The pool remembers the state it sent, so a worker that dies is replaced and brought up to
  date: its death is logged and counted (``uproxy_worker_restarts_total``), the replacement
  gets every balancer and copies of the dead worker's sockets, typically within a few
  hundred ms. The other workers never notice (a TCP socket they all accept on is theirs
  meanwhile).
- Counters come back through shared memory (``dataplane.counters``): ``add_up`` before every
  scrape; a dead worker's counts are kept.
- The workers publish the connections each holds in one more page of shared memory, so that
  a burst on a socket they share spreads over them (``dataplane.spread``); this process
  marks a dead worker's slot there.
- Stopping drains all workers at once, under one deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import resource
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from uproxy import metrics, priority
from uproxy.dataplane.balancer import Balancer
from uproxy.dataplane.counters import CounterFiles, SlotReader
from uproxy.dataplane.messages import (
    Applied,
    ChangeEndpoints,
    Channel,
    CloseListener,
    ComputedChange,
    Configure,
    Forget,
    Message,
    OpenListener,
    Ping,
    Ready,
    SetEndpoints,
    endpoint_changes,
    endpoint_steps,
)
from uproxy.dataplane.settings import DataplaneSettings
from uproxy.dataplane.sockets import bind_group, steer, steer_to_first, unsteer
from uproxy.dataplane.spread import LoadsWriter
from uproxy.log import V2, kv
from uproxy.model import (
    Endpoint,
    IPFamily,
    Protocol,
    ServicePort,
    ServicePortName,
    Traffic,
    ip_family,
)
from uproxy.settings import Settings

log = logging.getLogger("uproxy.workers")

READY_TIMEOUT_S = 30.0  # a worker that does not answer by then is killed and replaced
# A worker that applies nothing of what it was sent for this long (a Ping a second keeps
# something pending) is stuck, in a loop or stopped: killed and replaced. Its apply slices
# are milliseconds long; a worker at work moves its count many times a second.
STUCK_S = 10.0
WATCHDOG_INTERVAL_S = 1.0
# File descriptors the control process keeps free of proxy ports (each port holds one or one
# per worker here) and health-check node ports (one per service and address): reading the
# services file, running rules programs, answering health checks and scrapes, starting a
# worker. Out of fds, it had wedged until restarted: the file that removed the services
# could not be read, and every rules sync failed.
CONTROL_FD_RESERVE = 100
_RESERVE_REASON = (
    f"Too many open files: the last {CONTROL_FD_RESERVE} are kept for uproxy's own work; "
    "raise the open-file limit (ulimit -n)"
)
ABORT_WAIT_S = 1.0  # a second stop signal: how long the workers get to reset and exit
RESTART_BACKOFF_S = (0.0, 0.1, 0.5, 1.0, 5.0)  # after 0, 1, 2... deaths in a row
CRASH_LOOP_WINDOW_S = 60.0  # a worker that lived longer than this starts the count afresh

# Connections a worker accepts per readiness callback on a socket that every worker accepts
# on (``_bind``), instead of ``accept_batch`` (64). Every worker is woken for a new
# connection there; with 64, the first one up took whatever was queued and the rest found
# nothing: one worker relayed a burst while the other idled. ``--workers 2`` on 2 CPUs shared
# with the load (``wrk -c16 -H "Connection: close"``, nginx behind), alternating 5 s runs:
# 9,580-10,240 connections/s and 1.08-1.10 context switches per connection at 64, 10,300-
# 10,360 at 8, 10,760-11,380 and 0.84-0.91 at 4, 10,040-11,400 at 1 and 2. One worker keeps
# 64: on its own socket it accepts everything anyway, and taking one connection per pass
# of its loop cost it 20-25 % (8,000-9,030 against 10,740-11,400). (With more than one
# worker a ClientIP port's sockets, one per worker, take 4 too.)
SHARED_ACCEPT_BATCH = 4

ListenerKey = tuple[ServicePortName, Traffic, IPFamily]
BalancerKey = tuple[ServicePortName, IPFamily]


def worker_argv(settings: Settings) -> list[str]:
    """The user's settings a worker takes on its command line (its ``main`` parses them)."""
    return settings.flags("event_loop", "verbosity", "logging_format")


def interpreter_flags() -> list[str]:
    """This interpreter's optimization (``-O``/``-OO``, or PYTHONOPTIMIZE) for a worker, so a
    worker started as a fresh interpreter runs as its control process does and reads the
    same compiled bytecode (the image runs both with docstrings stripped: see Dockerfile)."""
    return ["-" + "O" * sys.flags.optimize] if sys.flags.optimize else []


def _restart_backoff(deaths: int) -> float:
    """The wait before a worker's next start, after ``deaths`` in a row (or failed starts)."""
    return RESTART_BACKOFF_S[min(deaths, len(RESTART_BACKOFF_S) - 1)]


def _exited(pid: int) -> bool:
    """Whether the child ``pid`` has exited: a zombie, or gone (not reaped here: the loop's
    own watcher reaps it, when the control process goes on)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return True


def _fd_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def check_fd_reserve(sock: socket.socket) -> None:
    """OSError (EMFILE) when ``sock`` took one of the fds the control process keeps for its
    own work (``CONTROL_FD_RESERVE``): every socket it holds for long checks, proxy ports and
    health-check node ports alike. fds are handed out lowest first: every one below this
    socket's is in use."""
    if sock.fileno() >= _fd_limit() - CONTROL_FD_RESERVE:
        raise OSError(errno.EMFILE, _RESERVE_REASON)


def _own_process_group() -> None:
    """In the forked child, before its exec (see ``_spawn``)."""
    os.setpgid(0, 0)


def default_worker_count(*, laptop: bool) -> int:
    """The CPUs this process may use (affinity mask and cgroup quota); 1 in laptop mode."""
    if laptop:
        return 1
    cpus = len(os.sched_getaffinity(0))
    quota = _cgroup_cpus()
    return max(1, min(cpus, quota) if quota else cpus)


def worker_cpus(affinity: str) -> tuple[int, ...]:
    """The CPUs the workers are bound to, worker ``i`` to entry ``i`` modulo their number
    (``--worker-cpu-affinity``): with ``auto``, those this process may use now, in order;
    with ``none``, no binding (empty)."""
    return tuple(sorted(os.sched_getaffinity(0))) if affinity == "auto" else ()


def _cgroup_cpus(root: str = "/sys/fs/cgroup") -> int | None:
    """CPUs the CPU quota of this process's cgroup allows (rounded up: a limit of 1.5 CPUs is
    worth two workers), as a container sees its cgroup under ``root``: cgroup v2's
    ``cpu.max``, else cgroup v1's ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us`` (nodes
    still on v1). None when unlimited or unknown."""
    try:
        quota, period = _read(f"{root}/cpu.max").split()
    except (OSError, ValueError):
        for v1 in (f"{root}/cpu", f"{root}/cpu,cpuacct"):
            try:
                quota, period = _read(f"{v1}/cpu.cfs_quota_us"), _read(f"{v1}/cpu.cfs_period_us")
                break
            except OSError:
                continue
        else:
            return None
    try:
        cpus = -(-int(quota) // int(period))  # "max" (v2) is not a number; -1 (v1) is < 1
    except (ValueError, ZeroDivisionError):
        return None
    return cpus if cpus > 0 else None


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


@dataclass(slots=True)
class _Listener:
    protocol: Protocol
    host: str
    port: int
    steered: bool
    # The sockets of the port's group in the group's order, held as long as the port is
    # served (the workers get copies): one that every worker accepts on, or one per worker.
    socks: list[socket.socket] = field(default_factory=list)

    def socket_for(self, index: int) -> socket.socket:
        """What worker ``index`` accepts on."""
        return _socket_for(self.socks, index)

    def close(self) -> None:
        for sock in self.socks:
            sock.close()
        self.socks = []


@dataclass(slots=True)
class _Worker:
    index: int
    process: asyncio.subprocess.Process
    channel: Channel
    files: CounterFiles
    reader: SlotReader
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    started_at: float = field(default_factory=time.monotonic)
    buried: bool = False
    applied: int = 0  # of the messages sent on its channel (``Applied``)
    # The watchdog's view: the Applied count it last saw move, when, and whether it gave up.
    seen_applied: int = 0
    moved_at: float = field(default_factory=time.monotonic)
    hung: bool = False

    @property
    def pending(self) -> int:
        """Changes sent to this worker that it has not applied yet."""
        return self.channel.sent - self.applied


class RemoteListener:
    """The control process's handle on a listener its workers serve."""

    def __init__(self, pool: WorkerPool, key: ListenerKey, host: str, port: int) -> None:
        self._pool = pool
        self._key = key
        self.host = host
        self.port = port

    def close(self) -> None:
        self._pool.close_listener(self._key)

    async def shutdown(self, timeout: float) -> int:
        # The workers drain their connections when they stop (``WorkerPool.stop``).
        self.close()
        return 0

    @property
    def active(self) -> int:
        return 0  # counted by the workers (uproxy_open_connections)


class WorkerPool:
    def __init__(
        self,
        count: int,
        *,
        settings: DataplaneSettings,
        argv: list[str],
        control_nice: int = 0,
        cpus: tuple[int, ...] = (),
        on_missing: Callable[[int], None] | None = None,
    ) -> None:
        """``count`` workers, each configured with ``settings``; ``argv``: the flags a worker
        is started with (``worker_argv``), since it sets up logging and its event loop before
        it reads its channel; ``control_nice``: nice levels this (the control) process takes
        below its workers when they start (``uproxy.priority``; 0: one priority); ``cpus``:
        worker ``i`` binds itself to ``cpus[i % len(cpus)]``, and its replacements to the
        same CPU (``worker_cpus``; empty: no binding); ``on_missing(n)``: told how many
        workers are dead with no replacement started (one could not be: out of fds or
        memory), whenever that number changes."""
        if count < 1:
            raise ValueError("a worker pool needs at least one worker")
        self.count = count
        self._control_nice = control_nice
        self._cpus = cpus
        self._released = 0  # ``released`` blocks running
        self.lowered: priority.Lowered | None = None
        self._configure = Configure(
            replace(settings, accept_batch=min(settings.accept_batch, SHARED_ACCEPT_BATCH))
            if count > 1
            else settings
        )
        self._settings = settings
        self._argv_extra = argv
        self._workers: dict[int, _Worker] = {}
        # Every worker's connections held (``dataplane.spread``): made at ``start``, with
        # more than one worker.
        self._loads: LoadsWriter | None = None
        self._endpoints: dict[BalancerKey, SetEndpoints] = {}
        self._listeners: dict[ListenerKey, _Listener] = {}
        self._totals = metrics.WorkerTotals()
        self._supervisor: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._on_missing = on_missing
        self.missing: set[int] = set()  # dead workers whose replacement could not start
        self._stopping = False
        self.restarts = 0
        self._applied_waiters: list[tuple[list[tuple[_Worker, int]], Callable[[], None]]] = []
        metrics.DATAPLANE_PENDING.set_function(self.pending)

    @property
    def serving(self) -> bool:
        """Whether the workers were told that the proxy serves (see ``serve``)."""
        return self._configure.serving

    def serve(self) -> None:
        """The proxy serves (its first sync is done): every worker, and every replacement
        from now on, applies changes in short slices (``messages.APPLY_SLICE_S``) so that its
        relays and whoever else waits for its CPU run in between. Once; later calls do
        nothing."""
        if self._configure.serving:
            return
        self._configure = replace(self._configure, serving=True)
        for w in self._workers.values():
            w.channel.send(self._configure)

    def pending(self) -> int:
        """Changes sent to the workers that they have not applied yet (0: every worker has
        everything the control process has decided so far)."""
        return sum(w.pending for w in self._workers.values() if not w.buried)

    def when_applied(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once every live worker has applied what was sent to it so far
        (at once when nothing is pending). A worker that dies meanwhile is not waited for:
        its replacement is sent the whole state."""
        targets = [(w, w.channel.sent) for w in self._workers.values() if not w.buried]
        self._applied_waiters.append((targets, callback))
        self._check_applied()

    def _check_applied(self) -> None:
        waiting = []
        for targets, callback in self._applied_waiters:
            if all(w.buried or w.applied >= sent for w, sent in targets):
                callback()
            else:
                waiting.append((targets, callback))
        self._applied_waiters = waiting

    # ----- lifecycle -----

    async def start(self) -> None:
        """Lower this process's priority (``control_nice``) and start every worker; ``ready``
        waits until each has said it is ready. What the control process does in between (its
        first listing waits on the API server) overlaps the workers' own start-up."""
        self._lower_control()
        if self.count > 1 and self._loads is None:
            self._loads = LoadsWriter(self.count)
        for index in range(self.count):
            self._workers[index] = await self._spawn(index)

    async def ready(self) -> None:
        """Until every worker ``start`` spawned is ready (RuntimeError when one exits first or
        does not answer in time); then a worker that dies is replaced."""
        await self._wait_ready(list(self._workers.values()))
        self._supervisor = asyncio.create_task(self._supervise(), name="worker-supervisor")
        self._watchdog = asyncio.create_task(self._watch(), name="worker-watchdog")

    def _lower_control(self) -> None:
        if not self._control_nice:
            return
        self.lowered = low = priority.lower_control(self._control_nice)
        if low is None:
            log.warning(
                "Control process keeps the workers' priority: its scheduling policy is not "
                "the default one, or this kernel lets it change neither nice nor time slice"
            )
            return
        slice_ms = "default" if low.control_slice_ns is None else low.control_slice_ns / 1e6
        if low.control_nice == low.worker_nice:
            log.info(
                "Control process yields the CPU to the workers by its time slice only: a worker "
                "could not raise its priority back (CAP_SYS_NICE missing)",
                extra=kv(nice=low.worker_nice, slice_ms=slice_ms),
            )
        else:
            log.info(
                "Control process yields the CPU to the workers",
                extra=kv(nice=low.control_nice, slice_ms=slice_ms, worker_nice=low.worker_nice),
            )

    async def stop(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """Drain every worker at once (SIGTERM) under one deadline; SIGKILL what is left."""
        self._stopping = True
        self._close_held()
        for task in (self._watchdog, self._supervisor):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        workers = list(self._workers.values())
        for w in workers:
            _signal(w.process, signal.SIGTERM if drain else signal.SIGKILL)
        deadline = (timeout if timeout is not None else self._settings.drain_timeout_s) + 2.0
        waits = [asyncio.wait_for(w.process.wait(), deadline) for w in workers]
        results = await asyncio.gather(*waits, return_exceptions=True)
        for w, result in zip(workers, results, strict=True):
            if isinstance(result, BaseException):
                log.warning(
                    "Data-plane worker did not stop by the drain deadline; killing it",
                    extra=kv(worker=w.index, pid=w.process.pid, waited_s=deadline),
                )
                _signal(w.process, signal.SIGKILL)
                await w.process.wait()
            self._bury(w)
        self._workers.clear()
        if self._loads is not None:
            self._loads.close()
            self._loads = None

    def kill_now(self) -> None:
        """A second stop signal: no draining. Each worker resets its connections and exits
        (SIGUSR1), so clients see their connections cut, not ended (a FIN, as the kernel
        closes a killed process's sockets, passes a reply cut short for a whole one); one
        that has not exited within ``ABORT_WAIT_S`` is killed."""
        self._stopping = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        self._close_held()
        workers = [w for w in self._workers.values() if w.process.returncode is None]
        for w in workers:
            _signal(w.process, signal.SIGUSR1)
        deadline = time.monotonic() + ABORT_WAIT_S
        for w in workers:
            while not _exited(w.process.pid):
                if time.monotonic() >= deadline:
                    _signal(w.process, signal.SIGKILL)
                    break
                time.sleep(0.01)  # the control process exits right after: nothing else runs

    def _close_held(self) -> None:
        """Let go of every listening socket: once the workers close theirs (stopping), the
        ports refuse new connections instead of queueing them for nobody."""
        for listener in self._listeners.values():
            listener.close()

    # ----- what the syncer calls -----

    async def open_listener(
        self,
        *,
        name: ServicePortName,
        balancer: Balancer,
        traffic: Traffic,
        host: str,
        port: int,
        settings: DataplaneSettings,
    ) -> RemoteListener:
        """Bind the listener here (OSError when the port is taken, or no fd is left) and hand
        it to the workers: one socket all of them accept on, or one each (``_bind``)."""
        steered = balancer.affinity and self.count > 1
        family = ip_family(host)
        key = (name, traffic, family)
        listener = _Listener(name.protocol, host, port, steered)
        listener.socks = self._bind(listener, port)
        try:
            check_fd_reserve(listener.socks[-1])
        except OSError:
            listener.close()
            raise
        bound_host, listener.port = listener.socks[0].getsockname()[:2]
        bound_host = sys.intern(bound_host)  # one address for thousands of listeners
        try:
            copies = self._copies(listener.socks, list(self._workers))
        except OSError:
            listener.close()
            raise
        self._hand_out(key, copies)
        self._listeners[key] = listener
        return RemoteListener(self, key, bound_host, listener.port)

    def close_listener(self, key: ListenerKey) -> None:
        listener = self._listeners.pop(key, None)
        if listener is not None:
            listener.close()
            self._broadcast(CloseListener(*key))

    def set_endpoints(
        self,
        name: ServicePortName,
        family: IPFamily,
        port: ServicePort,
        endpoints: tuple[Endpoint, ...],
        zone: str | None = None,
        change: ComputedChange | None = None,
    ) -> None:
        message = SetEndpoints(name, family, port, endpoints, zone)
        key = (name, family)
        previous = self._endpoints.get(key)
        if previous == message:
            return
        affinity = port.affinity_timeout_s is not None
        self._endpoints[key] = message  # what a new worker is sent
        changes = None
        if previous is not None and previous.port == port and previous.zone == zone:
            if change is not None and change[0] is previous.endpoints:
                changes = change[1]  # the syncer's, from what was sent last
            else:
                changes = endpoint_changes(previous.endpoints, endpoints)
        if changes is not None:
            self._broadcast(ChangeEndpoints(name, family, *changes))
        else:
            steps = endpoint_steps(message, previous)  # a big balancer's, else None
            for step in steps if steps is not None else (message,):
                self._broadcast(step)
        if previous is not None and (previous.port.affinity_timeout_s is not None) != affinity:
            self._restear(key, affinity)

    def forget(self, name: ServicePortName, family: IPFamily) -> None:
        if self._endpoints.pop((name, family), None) is not None:
            self._broadcast(Forget(name, family))
        if not any((name, other) in self._endpoints for other in IPFamily):
            self._totals.forget_service(str(name))  # gone in every family

    # ----- metrics -----

    async def add_up(self) -> None:
        """Before a scrape: every data-plane series = live workers + the dead's counts."""
        await self._totals.add_up_sliced(
            lambda: [w.reader for w in self._workers.values() if not w.buried]
        )

    def readers(self) -> Iterator[SlotReader]:
        return (w.reader for w in self._workers.values())

    def held(self) -> list[int]:
        """The connections each worker says it holds (``dataplane.spread``; ``GONE`` for a
        dead one until its replacement starts); empty with one worker."""
        return [] if self._loads is None else self._loads.read()

    @property
    def pids(self) -> list[int]:
        return [w.process.pid for w in self._workers.values()]

    # ----- internals -----

    def _broadcast(self, message: Message) -> None:
        for w in self._workers.values():
            w.channel.send(message)

    def _bind(self, listener: _Listener, port: int) -> list[socket.socket]:
        """The sockets of a listener, in the workers' order, bound to ``port`` (0: any).

        A TCP port whose clients need not stick to one worker is one socket that every
        worker accepts on (each gets a copy): whichever worker is free takes the next
        connection. Measured with ``--workers 2`` on 2 CPUs shared with the load (``wrk -c16``,
        ``Connection: close``; 3 alternating bench runs each, ``--workers 1`` moving by 18 %
        between them): 12,678-13,093 new connections/s against 11,874-12,381 with a socket
        per worker, connection p99 2.2 against 2.9-3.0 ms, proxy CPU per connection 74-77
        against 76-80 us. With a socket each, a connection waits for its worker even while the
        other one idles. ClientIP affinity (``steered``) and UDP need a socket per worker, the
        group choosing by client (see ``dataplane.sockets``): one client's connections, or one
        client's datagrams, must always reach the same worker.
        """
        shared = listener.protocol is Protocol.TCP and not listener.steered and self.count > 1
        return bind_group(
            listener.protocol,
            listener.host,
            port,
            1 if shared else self.count,
            backlog=self._settings.listen_backlog,
            receive_buffer=self._settings.udp_receive_buffer,
            steer_by_client=listener.steered,
            keepalive=self._settings.tcp_keepalive_s,
        )

    def _copies(self, socks: list[socket.socket], indexes: list[int]) -> dict[int, int]:
        """A copy (a descriptor) of its socket of a group (``socks``, as ``_Listener.socks``)
        for each of the workers ``indexes``; OSError (out of fds) with none left open."""
        copies: dict[int, int] = {}
        try:
            for index in indexes:
                copies[index] = os.dup(_socket_for(socks, index).fileno())
        except OSError:
            for fd in copies.values():
                os.close(fd)
            raise
        return copies

    def _hand_out(
        self, key: ListenerKey, copies: dict[int, int], *, old_leaves: bool = False
    ) -> None:
        """Send each worker its copy (the channel closes it once sent)."""
        for index, fd in copies.items():
            self._workers[index].channel.send(OpenListener(*key, old_leaves), fd)

    def _restear(self, balancer: BalancerKey, affinity: bool) -> None:
        if self.count < 2:
            return
        for key, listener in self._listeners.items():
            name, _, family = key
            if (name, family) != balancer or listener.steered == affinity:
                continue
            try:
                if listener.protocol is Protocol.UDP:
                    # A socket per worker already: only the group's program changes.
                    if affinity:
                        steer(listener.socks[0], self.count)
                    else:
                        unsteer(listener.socks[0])
                elif affinity:
                    self._steer_apart(key, listener)
                else:
                    self._gather(key, listener)
            except OSError as exc:
                log.error(
                    "Cannot change how workers share a proxy port",
                    extra=kv(service=str(key[0]), port=listener.port, affinity=affinity, err=exc),
                )
                continue
            listener.steered = affinity

    def _steer_apart(self, key: ListenerKey, listener: _Listener) -> None:
        """A TCP port every worker accepts on becomes a socket per worker, chosen by client
        address. The shared socket stays, as worker 0's; the others join the group after it,
        in the workers' order, and each worker but the first drops its copy of the shared
        one. Nothing closes, so nothing is reset. (Until they have, a worker but the first
        may still take a connection from the shared socket: affinity is only starting.)"""
        first = listener.socks[0]
        steer_to_first(first)  # the new sockets get nothing before they are handed out
        more = bind_group(
            listener.protocol,
            listener.host,
            listener.port,
            self.count - 1,
            backlog=self._settings.listen_backlog,
            receive_buffer=self._settings.udp_receive_buffer,
            steer_by_client=False,
            keepalive=self._settings.tcp_keepalive_s,
            join=True,
        )
        listener.socks = [first, *more]
        try:
            copies = self._copies(listener.socks, [i for i in self._workers if i != 0])
            steer(first, self.count)
        except OSError:
            for sock in more:
                sock.close()  # they got nothing: the group gives everything to the first
            listener.socks = [first]
            raise
        self._hand_out(key, copies)

    def _gather(self, key: ListenerKey, listener: _Listener) -> None:
        """A socket per worker becomes one socket every worker accepts on: the first (worker
        0's), to which the group now gives every new connection. The others leave the group
        once their workers have served the handshakes that were under way there
        (``messages.OpenListener``), so nothing is reset."""
        first = listener.socks[0]
        copies = self._copies([first], [i for i in self._workers if i != 0])
        try:
            steer_to_first(first)
        except OSError:
            for fd in copies.values():
                os.close(fd)
            raise
        self._hand_out(key, copies, old_leaves=True)
        for sock in listener.socks[1:]:
            sock.close()  # the workers hold the last copies until they retire them
        listener.socks = [first]

    @property
    def bound(self) -> bool:
        """Whether each worker is bound to a CPU (``--worker-cpu-affinity auto``)."""
        return bool(self._cpus)

    def cpu_of(self, index: int) -> int | None:
        """The CPU worker ``index`` is bound to; None when the workers are not bound."""
        return self._cpus[index % len(self._cpus)] if self._cpus else None

    @contextlib.contextmanager
    def released(self) -> Iterator[None]:
        """Bound workers may run on any of the pool's CPUs while the block runs, and are
        bound again after it (blocks may overlap: the last one to end binds them).

        For the rules programs (``rules.command.write``): the kernel takes an nft commit in
        one piece, without giving way to a waking task, and one of a rewrite's commits holds
        its CPU for about 10 ms. A worker bound to that CPU waited for each (``perf sched``:
        ``iptables-nft-restore`` on CPU 0 for 9-12 ms at a time, the worker bound there
        runnable for 7-11 ms), where an unbound one moves to the other CPU."""
        if not self._cpus:
            yield
            return
        self._released += 1
        if self._released == 1:
            self._set_affinity(released=True)
        try:
            yield
        finally:
            self._released -= 1
            if self._released == 0:
                self._set_affinity(released=False)

    def _set_affinity(self, *, released: bool) -> None:
        """Every live worker on all of the pool's CPUs, or back on its own (``cpu_of``)."""
        for w in self._workers.values():
            if w.buried:
                continue
            own = self.cpu_of(w.index)
            cpus = set(self._cpus) if released or own is None else {own}
            try:
                os.sched_setaffinity(w.process.pid, cpus)
            except OSError as exc:  # gone meanwhile (its replacement binds itself), or the
                # CPU left this cpuset: the worker runs as it can, the next write tries again
                log.debug("Cannot set a worker's CPUs", extra=kv(worker=w.index, err=exc))

    async def _spawn(self, index: int) -> _Worker:
        cpu = self.cpu_of(index)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        files = CounterFiles.create()
        loads = self._loads
        share = [] if loads is None else ["--loads", str(loads.fd), str(self.count)]
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                *interpreter_flags(),
                "-m",
                "uproxy.dataplane.worker",
                "--channel",
                str(theirs.fileno()),
                "--counters",
                str(files.values_fd),
                str(files.directory_fd),
                "--index",
                str(index),
                "--of",
                str(self.count),
                *self._argv_extra,
                *(["--nice", str(self.lowered.worker_nice)] if self.lowered else []),
                *(["--cpu", str(cpu)] if cpu is not None else []),
                *share,
                pass_fds=(
                    theirs.fileno(),
                    files.values_fd,
                    files.directory_fd,
                    *([] if loads is None else [loads.fd]),
                ),
                stdin=asyncio.subprocess.DEVNULL,
                # A process group of its own: Ctrl-C in a terminal signals the foreground
                # group, which reached workers still importing (a traceback each). Not a
                # session of its own: with the kernel's autogroups (one per session) that
                # would take the workers out of the control process's CPU group, and the
                # meaning of its nice level with them (nice orders tasks within a group).
                preexec_fn=_own_process_group,
            )
        except BaseException:
            ours.close()
            files.close()
            raise
        finally:
            theirs.close()
        if self.lowered is not None:
            priority.raise_started(process.pid, self.lowered)
        try:
            reader = SlotReader(files)
        except BaseException:
            # Started, but this process cannot read its counters (out of memory): it must not
            # live on untracked, holding its channel open and serving nothing, while the
            # next try starts another.
            _signal(process, signal.SIGKILL)
            await process.wait()
            ours.close()
            files.close()
            raise
        worker: _Worker | None = None

        def on_message(message: Message, sock: socket.socket | None) -> None:
            if worker is None:
                return
            if isinstance(message, Applied):
                worker.applied = message.count
                if self._applied_waiters:
                    self._check_applied()
            elif isinstance(message, Ready):
                worker.ready.set()

        channel = Channel(ours, on_message=on_message, on_closed=lambda: None)
        worker = _Worker(index, process, channel, files, reader)
        self._replay(worker)
        log.info(
            "Started data-plane worker",
            extra=kv(worker=index, pid=process.pid, **({} if cpu is None else {"cpu": cpu})),
        )
        return worker

    def _replay(self, w: _Worker) -> None:
        """Bring a (new) worker up to date: settings, every balancer, every listener."""
        w.channel.send(self._configure)
        for message in self._endpoints.values():
            w.channel.send(message)
        for key, listener in self._listeners.items():
            # Copied as they go out, not here: a copy of every socket at once could take
            # more fds than this process has (see ``Channel.lend``).
            w.channel.lend(OpenListener(*key), listener.socket_for(w.index))

    async def _wait_ready(self, workers: list[_Worker]) -> None:
        """Until each of ``workers`` said it is ready; RuntimeError when one exits first or
        does not answer within ``READY_TIMEOUT_S``."""
        results = await asyncio.gather(*map(_ready_or_exit, workers), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _supervise(self) -> None:
        """Replace every worker that dies, each in a task of its own: a replacement that
        cannot start (out of fds or memory) retries while the others' deaths are seen."""
        deaths_in_a_row: dict[int, int] = {}
        replacing: dict[asyncio.Future[Any], int] = {}
        try:
            while True:
                waits: dict[asyncio.Future[Any], _Worker] = {
                    asyncio.ensure_future(w.process.wait()): w
                    for index, w in self._workers.items()
                    if index not in replacing.values()
                }
                done, pending = await asyncio.wait(
                    [*waits, *replacing], return_when=asyncio.FIRST_COMPLETED
                )
                for task in pending:
                    if task in waits:
                        task.cancel()
                for task in done:
                    dead = waits.get(task)
                    if dead is not None:
                        job = asyncio.create_task(self._replace(dead, deaths_in_a_row))
                        replacing[job] = dead.index
                    else:
                        replacing.pop(task)  # its worker is waited for from the next pass
        finally:
            for task in replacing:
                task.cancel()
            await asyncio.gather(*replacing, return_exceptions=True)

    async def _watch(self) -> None:
        """Kill a worker that stopped applying what it is sent (``STUCK_S``): stuck in a
        loop, or stopped (SIGSTOP), it holds its share of the connections (a UDP flow's
        datagrams, a ClientIP client's connections, every connection with one worker) with
        nobody to serve them, and every listener sent to it keeps an fd open here. The
        supervisor then replaces it, as if it had died."""
        while True:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            now = time.monotonic()
            for w in list(self._workers.values()):
                if w.buried or w.hung or not w.ready.is_set():
                    continue
                if w.applied != w.seen_applied or not w.pending:
                    w.seen_applied, w.moved_at = w.applied, now
                elif now - w.moved_at >= STUCK_S:
                    w.hung = True
                    log.error(
                        "Data-plane worker stopped answering; killing it",
                        extra=kv(
                            worker=w.index, pid=w.process.pid, stuck_s=round(now - w.moved_at, 1)
                        ),
                    )
                    _signal(w.process, signal.SIGKILL)
                    continue
                w.channel.send(Ping())

    async def _replace(self, dead: _Worker, deaths: dict[int, int]) -> None:
        how = "stopped answering, killed" if dead.hung else _how(dead.process.returncode)
        log.error("Data-plane worker died, replacing it", extra=kv(worker=dead.index, how=how))
        metrics.WORKER_RESTARTS.inc()
        self.restarts += 1
        self._bury(dead)
        # Back off only when a worker keeps dying young (a crash loop), not after a long life.
        lived = time.monotonic() - dead.started_at
        n = 0 if lived > CRASH_LOOP_WINDOW_S else deaths.get(dead.index, 0)
        deaths[dead.index] = n + 1
        failures = 0
        while True:
            await asyncio.sleep(_restart_backoff(n + failures))
            try:
                worker = await self._spawn(dead.index)
                break
            except Exception as exc:  # whatever it is (EMFILE, ENOMEM), a later try may work
                failures += 1
                retry_s = _restart_backoff(n + failures)
                fields = kv(worker=dead.index, err=exc, retry_s=retry_s, attempts=failures)
                if failures == 1:
                    log.error("Cannot start a replacement worker, will retry", extra=fields)
                    self._missing(dead.index, True)
                else:
                    log.log(V2, "Cannot start a replacement worker, will retry", extra=fields)
        self._workers[dead.index] = worker
        if failures:
            self._missing(dead.index, False)
        try:
            await self._wait_ready([worker])
        except RuntimeError as exc:
            log.error("Replacement worker did not start", extra=kv(worker=dead.index, err=exc))
            _signal(worker.process, signal.SIGKILL)  # the supervisor sees it exit, tries again

    def _missing(self, index: int, missing: bool) -> None:
        before = len(self.missing)
        if missing:
            self.missing.add(index)
        else:
            self.missing.discard(index)
        if len(self.missing) != before and self._on_missing is not None:
            self._on_missing(len(self.missing))

    def _bury(self, w: _Worker) -> None:
        """A worker is gone: keep its counts, free its channel and shared memory. Once: a
        stop during a replacement's back-off finds the dead worker still in its slot."""
        if w.buried:
            return
        w.buried = True
        if self._loads is not None:  # the others stop leaving connections to it
            self._loads.gone(w.index)
        w.channel.close()
        if self._applied_waiters:
            self._check_applied()  # no longer waited for
        self._totals.retire(w.reader, serving={str(name) for name, _ in self._endpoints})
        w.reader.close()
        w.files.close()


async def _ready_or_exit(w: _Worker) -> None:
    """A worker that dies before it is ready (killed, out of memory) is seen at once, so its
    replacement comes within the restart backoff, not after the ready timeout."""
    ready = asyncio.ensure_future(w.ready.wait())
    exited = asyncio.ensure_future(w.process.wait())
    try:
        await asyncio.wait((ready, exited), timeout=READY_TIMEOUT_S, return_when="FIRST_COMPLETED")
    finally:
        ready.cancel()
        exited.cancel()
    if w.ready.is_set():
        return
    if w.process.returncode is None:
        raise RuntimeError(f"data-plane worker {w.index} did not start in {READY_TIMEOUT_S:g} s")
    raise RuntimeError(
        f"data-plane worker {w.index} exited before it was ready ({_how(w.process.returncode)})"
    )


def _how(code: int | None) -> str:
    return f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"


def _socket_for(socks: list[socket.socket], index: int) -> socket.socket:
    """Worker ``index``'s socket of a group: its own, or the one they all accept on."""
    return socks[index] if len(socks) > 1 else socks[0]


def _signal(process: asyncio.subprocess.Process, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(sig)
