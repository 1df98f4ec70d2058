"""What the data plane is told: one frozen object the syncer hands to every listener and
balancer, and the control process sends to every worker (``messages.Configure``).

Most fields are tunables with no flag; every one names its unit and says why it has its
default, so that a benchmark tweaking buffer sizes knows what the number trades off. A field
that a user sets is declared with ``setting("name")``: the attribute of ``uproxy.settings.
Settings`` it is taken from, by ``from_settings``. That is the only place the two meet: a
new user-facing data-plane setting is a field of ``Settings`` (its flag, config path and
help) and a ``setting(...)`` field here, and nothing copies it by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from uproxy.model import LbAlgorithm

if TYPE_CHECKING:
    from uproxy.settings import Settings


def setting(name: str, default: Any) -> Any:
    """A field taken from ``Settings.<name>`` (a field or a derived property)."""
    return field(default=default, metadata={"setting": name})


@dataclass(frozen=True, slots=True, kw_only=True)
class DataplaneSettings:
    # This node's name (--hostname-override, else the host name): Local traffic policies
    # choose the endpoints on it.
    node_name: str = setting("node_name", "")
    # How a balancer chooses endpoints (--lb-algorithm; the service's annotation overrides).
    # (setting() returns a Field, as field() does: the default is not shared mutable state.)
    default_algorithm: LbAlgorithm = setting("algorithm", LbAlgorithm.ROUND_ROBIN)  # noqa: RUF009
    # Seconds without a datagram either way before a UDP flow is closed (--udp-timeout).
    # kube-proxy's userspace default: 250 ms, enough for DNS and short RPCs.
    udp_timeout_s: float = setting("udp_timeout", 0.25)
    # UDP flows per listener (--udp-max-flows); the least recently active one is evicted
    # first. Each flow holds one socket (an fd), so this bounds a listener's fds under a
    # flood of client ports.
    udp_max_flows: int = setting("udp_max_flows", 4096)
    # Failed dials in a row after which a balancer leaves an endpoint out of its choice
    # (--endpoint-eject-after; 0: never), for ``eject_base_s``, doubling each time it fails
    # again once back, up to ``eject_max_s``. Passive outlier ejection, as a production L4
    # proxy does it: the EndpointSlices say an endpoint is ready, but a pod that died, or a
    # node that went away, stays ready there for as long as its readiness probe or the
    # node's grace period takes (tens of seconds), and meanwhile every connection that
    # picked it paid a failed dial first (250 ms when its packets vanish). Three, so that
    # one dial timing out under load does not move traffic.
    eject_after: int = setting("endpoint_eject_after", 3)
    # The first time out, in seconds, and the longest (reached at the sixth ejection in a
    # row). Short at first: a refusal may be a restart that is over in a second.
    eject_base_s: float = 1.0
    eject_max_s: float = 30.0
    # Seconds allowed for each dial attempt; one attempt per entry, each to a different
    # endpoint. The original userspace proxy's schedule (250 ms doubling to 2 s).
    dial_timeouts_s: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0)
    # Seconds of idleness before TCP keep-alive probes, and between them (--tcp-keepalive,
    # whole seconds; 0: none), so that a peer gone without a word (a node powered off, a
    # link cut) does not hold its pair, and the other side's connection, forever. The
    # client side inherits it from the listening socket; the endpoint side gets it once its
    # pair has outlived the dial's deadline (``relay``), so short connections never pay for
    # it.
    tcp_keepalive_s: int = setting("tcp_keepalive_whole_s", 15)
    # Bytes read from one side of a TCP pair at a time (one recv), and so the most a pair
    # holds in user space per direction: what the other socket does not take at once is
    # kept, and that side is not read again until it is written. The kernel's socket
    # buffers do the rest of the buffering. 256 KiB: one read per 256 KiB of a bulk
    # transfer on the copy path.
    high_water: int = 256 * 1024
    # Bytes one direction of a TCP pair moves by copying, in reads of at least 16 KiB (a
    # bulk transfer's), before it switches to splice(2) through a pipe of its own
    # (zero-copy, two more fds); None: never. See ``dataplane/relay.py`` for the
    # measurements behind the default.
    splice_threshold: int | None = 128 * 1024
    # Bytes of that pipe (F_SETPIPE_SZ; the kernel rounds up to pages, caps at
    # /proc/sys/fs/pipe-max-size for unprivileged processes).
    splice_pipe_size: int = 1 << 20
    # ClientIP affinity entries per balancer (one per client IP); oldest evicted first.
    max_affinity_entries: int = 65536
    # listen() backlog of TCP proxy ports (the kernel caps it at net.core.somaxconn).
    # Large, because a burst of new connections must not see SYN drops while Python runs.
    listen_backlog: int = 4096
    # Connections accepted per readiness callback: amortises the callback over a burst,
    # small enough that one busy port cannot starve the others on the loop. Workers that
    # share a socket take fewer (``uproxy.workers.SHARED_ACCEPT_BATCH``).
    accept_batch: int = 64
    # Seconds accepting stays paused after EMFILE/ENFILE/ENOBUFS/ENOMEM. Short: fds come back
    # as soon as connections close; long enough that a full fd table does not spin the loop.
    accept_backoff_s: float = 0.1
    # Bytes of the UDP receive buffer: one datagram of up to 65,507 bytes (IPv4) or 65,527
    # (IPv6) always fits, so a datagram is never truncated.
    udp_buffer: int = 65536
    # Datagrams read per readiness callback (same trade-off as accept_batch).
    udp_batch: int = 64
    # Bytes of kernel receive buffer on each UDP proxy port (--udp-receive-buffer), set with
    # SO_RCVBUFFORCE when allowed (beyond net.core.rmem_max), else SO_RCVBUF (capped by it).
    # A burst arriving while the loop is busy waits here instead of being dropped: with the
    # default 208 KiB, about 1 % of a flood was lost at uproxy's own socket. It is a limit,
    # not an allocation: memory is taken only by datagrams actually queued. 0: the default.
    udp_receive_buffer: int = setting("udp_receive_buffer", 4 << 20)
    # Seconds a loop that relays keeps polling after the last event on its sockets, instead
    # of sleeping at once (--busy-poll; 0: never). See ``dataplane/busypoll.py``.
    busy_poll_s: float = setting("busy_poll", 0.0)
    # SO_MARK on every socket uproxy opens to an endpoint; 0: none. Computed at start, so
    # not a ``setting``: --dial-mark once the proxy has checked that it can set it. The
    # portal rules return at once on this mark, so a dial never walks the portal chains:
    # with 10,000 services in iptables chains that walk more than doubled the proxy's system
    # time per connection. Setting it costs a socket of our own per dial (about 20 us of
    # CPU against uvloop's create_connection), so laptop mode, which has no rules, leaves it 0.
    dial_mark: int = 0
    # Seconds connections get to finish when uproxy stops (every listener and worker at once,
    # under one deadline).
    drain_timeout_s: float = setting("drain_timeout", 5.0)

    @classmethod
    def from_settings(cls, settings: Settings, **computed: Any) -> DataplaneSettings:
        """The view of ``settings`` the data plane needs: every ``setting(...)`` field taken
        from it; ``computed`` gives the values known only at start (the dial mark, probed)."""
        carried = {
            f.name: getattr(settings, f.metadata["setting"])
            for f in fields(cls)
            if "setting" in f.metadata
        }
        return cls(**{**carried, **computed})
