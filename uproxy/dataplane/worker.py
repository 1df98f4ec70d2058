"""A data-plane worker process: accept, dial and relay, nothing else.

Started by the control process (``uproxy.workers``) as ``python -m uproxy.dataplane.worker``
with three inherited fds: its end of the channel and the two memfds of its counters (and,
beside other workers, the page where each says how many connections it holds: ``spread``). It
learns everything from the channel (``messages``): its settings, each service port's
endpoints (one ``Balancer`` per service port and IP family, the same class the in-process
data plane uses) and the listening sockets it serves: a socket that every worker accepts on,
or one socket of a SO_REUSEPORT group whose other sockets belong to the other workers (see
``uproxy.workers``). A socket sent for a listener it already serves replaces that one's
socket (see ``messages.OpenListener``). A listener uses the balancer of its own family: an
IPv6 proxy port never dials an IPv4 endpoint.

Signals: SIGTERM drains (listeners close at once, established connections get up to the
drain timeout, all listeners in parallel), then the worker exits. SIGUSR1 (a second stop
signal to the control process) resets every connection at once and exits: killed instead,
the kernel would close them with a FIN, and a client would read a reply cut short as whole.
The control process decides how the workers stop: a worker runs in a process group of its
own (in the control process's session), so Ctrl-C in a terminal, which signals the
foreground group, reaches only the control process, from the worker's first instant; SIGINT
is ignored too. When the control process goes away (the channel closes, or the parent-death
signal the kernel sends), the worker drains and exits too: it must not keep serving ports on
its own, nor hold them against the next control process.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
from typing import TYPE_CHECKING

from uproxy import heap
from uproxy.dataplane import busypoll, series, spread
from uproxy.dataplane.balancer import Balancer
from uproxy.dataplane.counters import CounterFiles, SlotWriter
from uproxy.dataplane.fdreserve import FD_RESERVE
from uproxy.dataplane.messages import (
    APPLY_SLICE_S,
    APPLY_SLICE_STARTING_S,
    RETIRE_IDLE_S,
    Applied,
    ChangeEndpoints,
    Channel,
    CloseListener,
    CommitEndpoints,
    Configure,
    Forget,
    Message,
    OpenListener,
    Ready,
    SetEndpoints,
)
from uproxy.dataplane.poller import io_waiting
from uproxy.dataplane.release import Release, release_for
from uproxy.lifeline import die_with_parent
from uproxy.log import V2, kv
from uproxy.model import IPFamily, ServicePortName, Traffic

if TYPE_CHECKING:  # imported at run time only after series.share() (they bind label sets)
    from uproxy.dataplane.tcp import TcpListener
    from uproxy.dataplane.udp import UdpListener

log = logging.getLogger("uproxy.dataplane.worker")

# A run of messages of this weight is a bulk change (a big sync, a replay to a new worker, a
# big service port's endpoints): the cyclic collector waits until the channel has been quiet
# for BURST_IDLE_S, then what the burst made is frozen (``uproxy.heap``). A message weighs 1,
# and each endpoint it brings 1 more. Left on, its full passes over 10,000 new listeners took
# 100-200 ms each, every relay of this worker stalled behind them; over a port's 20,000 new
# endpoints (80 messages) 4-9 ms, three times as the port came and went five times.
BURST_WEIGHT = 200
BURST_IDLE_S = 0.2


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m uproxy.dataplane.worker")
    p.add_argument("--channel", type=int, required=True)
    p.add_argument("--counters", type=int, nargs=2, required=True)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--of", type=int, default=1, help="the number of workers (their port shares)")
    p.add_argument(
        "--loads", type=int, nargs=2, metavar=("FD", "WORKERS"), help="see dataplane.spread"
    )
    p.add_argument("--event-loop", default="auto")
    p.add_argument("-v", type=int, default=0, dest="verbosity")
    p.add_argument("--logging-format", default="text")
    p.add_argument("--nice", type=int, help="the priority to take back (uproxy.priority)")
    p.add_argument("--cpu", type=int, help="the CPU to bind to (--worker-cpu-affinity)")
    args = p.parse_args(argv)
    from uproxy.log import setup

    setup(verbosity=args.verbosity, fmt=args.logging_format)
    if args.cpu is not None:
        _bind_to_cpu(args.cpu)
    if args.nice is not None:
        _take_back_priority(args.nice)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()  # when the control process dies, however it dies: SIGTERM
    # Before the data-plane modules bind their label sets: every tally lives in shared memory.
    series.share(SlotWriter(CounterFiles(*args.counters)))
    from uproxy.dataplane import udp  # after share(): its listeners bind label sets

    udp.FLOW_PORTS = udp.FlowPorts(args.index, args.of)  # this worker's share of flow ports
    if args.loads is not None:  # before any listener, which reads it when made
        fd, count = args.loads
        spread.LOADS = spread.Loads(fd, count, args.index)
    from uproxy.eventloop import run_loop

    return run_loop(lambda: Worker(args.channel, args.index).run(), args.event_loop)


def _bind_to_cpu(cpu: int) -> None:
    """Before any thread starts (a thread takes its creator's CPUs). A CPU this process may
    no longer use (its cpuset shrank since the control process looked) leaves the worker
    where the scheduler puts it: serving unbound beats not serving."""
    try:
        os.sched_setaffinity(0, {cpu})
    except OSError as exc:
        log.error("Cannot bind the worker to its CPU, it runs unbound", extra=kv(cpu=cpu, err=exc))


def _take_back_priority(nice: int) -> None:
    """The control process that started this one runs below the workers (and this process
    started as it runs): back to where the control process started."""
    from uproxy import priority

    try:
        priority.take_back(nice)
    except OSError as exc:
        log.error("Cannot take back the workers' priority", extra=kv(nice=nice, err=exc))


class Worker:
    def __init__(self, channel_fd: int, index: int) -> None:
        from uproxy.dataplane.tcp import TcpListener
        from uproxy.dataplane.udp import UdpListener

        self._tcp = TcpListener
        self._udp = UdpListener
        self._channel_fd = channel_fd
        self.index = index
        self.config: Configure | None = None
        self.balancers: dict[tuple[ServicePortName, IPFamily], Balancer] = {}
        # Balancers being built aside in steps (``staged``), until their CommitEndpoints.
        self.staged: dict[tuple[ServicePortName, IPFamily], Balancer] = {}
        self.listeners: dict[
            tuple[ServicePortName, Traffic, IPFamily], TcpListener | UdpListener
        ] = {}
        # Closed (no longer accepting) but maybe still relaying: a stop drains them too.
        self.closing: list[TcpListener | UdpListener] = []
        self._stop = asyncio.Event()
        self._aborting = False  # SIGUSR1: reset everything, no drain
        self._burst = 0  # the weight of the messages since the channel was last quiet
        self._burst_seen = 0  # ... as of the last quiet check
        self._bulk = False
        self._quiet_check: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.channel: Channel | None = None
        # What balancers let go of, freed in slices (made on the first use, on the loop).
        self.release: Release | None = None

    async def run(self) -> int:
        self._loop = loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._stop.set)
        loop.add_signal_handler(signal.SIGUSR1, self._abort)
        # The fd limit this process started with (the control process raised it before):
        # read once for every listener, not once per port.
        FD_RESERVE.refresh_limit()
        self.channel = channel = Channel(
            socket.socket(fileno=self._channel_fd),
            on_message=self._on_message,
            on_closed=self._stop.set,
            on_applied=lambda count: channel.send(Applied(count)),
            busy=io_waiting(loop),  # a relay's input ends an apply slice early
        )
        heap.freeze()  # what the start made (modules above all) lives as long as this process
        channel.send(Ready(os.getpid()))
        await self._stop.wait()
        channel.close()
        self._end_burst()
        await self._drain()
        return 0

    def _abort(self) -> None:
        self._aborting = True
        self._stop.set()

    async def _drain(self) -> None:
        timeout = self.config.settings.drain_timeout_s if self.config is not None else 1.0
        if self._aborting:
            timeout = 0.0  # every connection reset now
        listeners = [*self.listeners.values(), *self.closing]
        self.listeners.clear()
        self.closing.clear()
        from uproxy.dataplane.tcp import drain

        reset = await drain(listeners, timeout)
        if reset:
            log.warning(
                "Connections still open at the drain deadline were reset",
                extra=kv(worker=self.index, connections=reset, drain_timeout_s=timeout),
            )
        log.log(V2, "Worker drained", extra=kv(worker=self.index, listeners=len(listeners)))

    def _on_message(self, message: Message, sock: socket.socket | None) -> None:
        self._note_burst(message)
        try:
            self._apply(message, sock)
        except OSError as exc:
            # One listener that cannot start must not take the others down.
            log.error("Worker could not apply a change", extra=kv(worker=self.index, err=exc))
            if sock is not None:
                sock.close()

    def _note_burst(self, message: Message) -> None:
        kind = type(message)
        if kind is SetEndpoints:
            self._burst += 1 + len(message.endpoints)  # type: ignore[union-attr]
        elif kind is ChangeEndpoints:
            self._burst += 1 + len(message.added)  # type: ignore[union-attr]
        else:
            self._burst += 1
        if not self._bulk and self._burst >= BURST_WEIGHT:
            self._bulk = True
            heap.pause()
        if self._quiet_check is None:
            self._quiet_check = asyncio.get_running_loop().call_later(
                BURST_IDLE_S, self._check_quiet
            )

    def _check_quiet(self) -> None:
        self._quiet_check = None
        if self._burst != self._burst_seen:  # still coming
            self._burst_seen = self._burst
            self._quiet_check = asyncio.get_running_loop().call_later(
                BURST_IDLE_S, self._check_quiet
            )
            return
        self._end_burst()

    def _end_burst(self) -> None:
        if self._quiet_check is not None:
            self._quiet_check.cancel()
            self._quiet_check = None
        self._burst = self._burst_seen = 0
        if self._bulk:
            self._bulk = False
            heap.resume()

    def _apply(self, message: Message, sock: socket.socket | None) -> None:
        # By exact type: the messages are final dataclasses, and a chain of isinstance
        # checks ran up to six per message (40,000 messages in a 10,000-port swap).
        if type(message) is SetEndpoints:
            self._set_endpoints(message)
        elif type(message) is ChangeEndpoints:
            self._change_endpoints(message)
        elif type(message) is OpenListener:
            if sock is not None:
                self._open(message, sock)
        elif type(message) is CommitEndpoints:
            self._commit(message)
        elif type(message) is CloseListener:
            self._close(message)
        elif type(message) is Forget:
            self._forget(message)
        elif type(message) is Configure:
            self.config = message
            if self._loop is not None:
                busypoll.install(self._loop, message.settings.busy_poll_s)
            if self.channel is not None:
                self.channel.slice_s = APPLY_SLICE_S if message.serving else APPLY_SLICE_STARTING_S
                self.channel.watch_busy = message.serving

    def _close(self, message: CloseListener) -> None:
        key = (message.name, message.traffic, message.family)
        listener = self.listeners.pop(key, None)
        if listener is None:
            return
        listener.close()
        for old in self.closing:  # a socket of the port still retiring (see ``_open``) goes too
            sock = old.socket
            if sock is not None and (old.name, old.traffic, _family(sock)) == key:
                old.close()
        # Kept while they relay (a stop drains them) or still accept (retiring).
        self.closing = [lst for lst in self.closing if lst.active or lst.socket is not None]
        self.closing.append(listener)

    def _forget(self, message: Forget) -> None:
        for balancer in (
            self.balancers.pop((message.name, message.family), None),
            self.staged.pop((message.name, message.family), None),
        ):
            if balancer is not None:
                self._let_go(balancer.let_go())
        if not any((message.name, family) in self.balancers for family in IPFamily):
            # Gone in every family: its series go (the control process stops showing
            # them; connections still draining keep counting into slots nobody reads).
            series.forget_service(str(message.name))

    def _set_endpoints(self, message: SetEndpoints) -> None:
        settings = self._configured().settings
        key = (message.name, message.family)
        balancer = None if message.staged else self.balancers.get(key)
        if balancer is None:  # new, or a new spec built aside (always afresh)
            balancer = Balancer(message.name, settings=settings)
            if message.staged:
                replaced = self.staged.get(key)
                if replaced is not None:  # never: a commit or a Forget ends each build
                    self._let_go(replaced.let_go())
                self.staged[key] = balancer
            else:
                self.balancers[key] = balancer
        balancer.update(message.port, message.endpoints, message.zone)

    def _change_endpoints(self, message: ChangeEndpoints) -> None:
        key = (message.name, message.family)
        where = self.staged if message.staged else self.balancers
        balancer = where.get(key)
        if balancer is None:  # never: a change follows its balancer's SetEndpoints
            settings = self._configured().settings
            balancer = where[key] = Balancer(message.name, settings=settings)
        balancer.change(message.added, message.removed)

    def _commit(self, message: CommitEndpoints) -> None:
        key = (message.name, message.family)
        built = self.staged.pop(key, None)
        if built is None:  # never: a commit follows its staged SetEndpoints
            return
        serving = self.balancers.get(key)
        if serving is None:
            self.balancers[key] = built
        else:  # the listeners keep the balancer they have; it takes the new one's state
            self._let_go(serving.adopt(built))

    def _let_go(self, held: list[object]) -> None:
        """Free ``held`` a slice at a time between the loop's passes (``release``)."""
        release = self.release
        if release is None:
            release = self.release = release_for(asyncio.get_running_loop())
        release.later(held)

    def _open(self, message: OpenListener, sock: socket.socket) -> None:
        config = self._configured()
        balancer = self.balancers[(message.name, message.family)]
        # The balancer's name, not the message's: the same value, but when the two came in
        # different packets (a new worker is sent every balancer, then every listener) they
        # are two objects, and this one is kept anyway.
        name = balancer.name
        key = (name, message.traffic, message.family)
        old = self.listeners.pop(key, None)
        if old is not None:
            if message.old_leaves:
                old.retire(RETIRE_IDLE_S)  # what reaches it meanwhile is served, not reset
            else:
                old.close()  # this worker's copy: another worker serves the socket
            self.closing.append(old)
        serve = self._tcp.serve if sock.type == socket.SOCK_STREAM else self._udp.serve
        self.listeners[key] = serve(
            sock,
            name=name,
            balancer=balancer,
            traffic=message.traffic,
            settings=config.settings,
            loop=self._loop,
        )

    def _configured(self) -> Configure:
        if self.config is None:
            raise RuntimeError("the control process sent a change before Configure")
        return self.config


def _family(sock: socket.socket) -> IPFamily:
    return IPFamily.V6 if sock.family == socket.AF_INET6 else IPFamily.V4


if __name__ == "__main__":
    sys.exit(main())
