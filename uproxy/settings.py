"""uproxy's settings: one table that the flags, the configuration file and the docs all read.

Each field of ``Settings`` carries its flag, its path in a KubeProxyConfiguration file and its
help text, so the command line, ``--config`` and the generated configuration reference
cannot drift apart. It is also the one place the other parts read settings from: the data
plane gets its view built from it (``DataplaneSettings.from_settings``), the syncer reads it
directly, and a worker process is started with its flags (``Settings.flags``). Values are
parsed and checked here; a bad value raises ``SettingsError`` with one line naming the
setting, the value and what is expected.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import socket
from dataclasses import Field, dataclass, field, fields
from typing import Any

from uproxy.model import LbAlgorithm


class SettingsError(ValueError):
    """A bad flag or configuration value; the message is the whole explanation."""


def opt(
    default: Any,
    *,
    flag: str | None,
    config: str | None,
    help: str,
    kind: str = "str",
    choices: tuple[str, ...] = (),
) -> Any:
    return field(
        default=default,
        metadata={"flag": flag, "config": config, "help": help, "kind": kind, "choices": choices},
    )


# The kernel's limit for TCP_KEEPIDLE and TCP_KEEPINTVL (MAX_TCP_KEEPIDLE, in seconds).
MAX_TCP_KEEPALIVE_S = 32767
# The longest --busy-poll window: one that long already polls whenever any traffic came in
# the last second (and a bare number read as microseconds would be a mistake to catch).
MAX_BUSY_POLL_S = 1.0
RULES_BACKENDS = ("auto", "iptables-restore", "nftables", "iptables", "none")
LOCAL_MODES = ("ClusterCIDR", "NodeCIDR", "BridgeInterface", "InterfaceNamePrefix")
PRIMARY = "primary"  # --nodeport-addresses: the node's primary address


@dataclass(slots=True, kw_only=True)
class Settings:
    # --- sources ---
    services: str | None = opt(
        None,
        flag="--services",
        config="uproxy.services",
        help="Read Services and EndpointSlices from this multi-document YAML (or JSON) file "
        "(reloaded on change) instead of the Kubernetes API",
    )
    kubeconfig: str | None = opt(
        None,
        flag="--kubeconfig",
        config="clientConnection.kubeconfig",
        help="Path to a kubeconfig file; default: in-cluster config inside a pod, else "
        "$KUBECONFIG (paths joined by ':' are merged, as kubectl merges them), else "
        "~/.kube/config",
    )
    master: str | None = opt(
        None,
        flag="--master",
        config=None,
        help="The address of the Kubernetes API server (overrides the kubeconfig)",
    )
    hostname_override: str = opt(
        "",
        flag="--hostname-override",
        config="hostnameOverride",
        help="The name of this node (for Local traffic policies); default: the host name",
    )
    service_proxy_name: str | None = opt(
        None,
        flag="--service-proxy-name",
        config="uproxy.serviceProxyName",
        help="Proxy only services labelled service.kubernetes.io/service-proxy-name=NAME; "
        "without it, only services without that label",
    )
    config_sync_period: float = opt(
        900.0,
        flag="--config-sync-period",
        config="configSyncPeriod",
        kind="duration",
        help="How often every service is looked at again from what uproxy holds (an "
        "informer's resync: no request to the API server)",
    )
    # --- data plane ---
    bind_address: str | None = opt(
        None,
        flag="--bind-address",
        config="bindAddress",
        kind="ip",
        help="The address proxy ports listen on, which limits uproxy to it and its IP family; "
        "default: 0.0.0.0 and :: (each family the node has an address of), or 127.0.0.1 and "
        "::1 with --rules none. On a node, 0.0.0.0 or :: (kubeadm writes 0.0.0.0) only puts "
        "its family first, as kube-proxy reads it as the primary family: both are served; "
        "with --rules none every address is one address, and its family the one served",
    )
    proxy_port_range: str = opt(
        "",
        flag="--proxy-port-range",
        config="portRange",
        help="Range of host ports for proxy ports, 'begin-end' or 'begin+offset'; "
        "empty: random ports",
    )
    udp_timeout: float = opt(
        0.25,
        flag="--udp-timeout",
        config="udpIdleTimeout",
        kind="duration",
        help="How long an idle UDP flow is kept; one still waiting for the endpoint's answer "
        "to its client's last datagram is kept at least 5 s",
    )
    tcp_keepalive: float = opt(
        15.0,
        flag="--tcp-keepalive",
        config="uproxy.tcpKeepAlive",
        kind="duration",
        help="Idle time after which TCP keep-alive probes go out on both sides of a relayed "
        "connection, and the time between probes (whole seconds, rounded up); a peer that "
        "answers none of the node's net.ipv4.tcp_keepalive_probes (9) is taken as gone and "
        "the connection is reset on the other side. kube-proxy's userspace mode had Go's 15 s; "
        "0 sends no probes",
    )
    udp_max_flows: int = opt(
        4096,
        flag="--udp-max-flows",
        config="uproxy.udpMaxFlows",
        kind="int",
        help="Most UDP flows per service port in each data-plane worker (each holds an fd "
        "for its endpoint side); the oldest is evicted first",
    )
    endpoint_eject_after: int = opt(
        3,
        flag="--endpoint-eject-after",
        config="uproxy.endpointEjectAfter",
        kind="int",
        help="Failed dials in a row, as each data-plane worker counts its own (for UDP: flows "
        "the endpoint refused with ICMP port or host unreachable), after which an endpoint is "
        "left out of that worker's choice for a while (1 s, "
        "doubling up to 30 s while it keeps failing; never when every endpoint would be out), "
        "until a dial to it succeeds (a UDP flow: its first reply) or it leaves the "
        "EndpointSlices; 0 never leaves one out",
    )
    udp_receive_buffer: int = opt(
        4 << 20,
        flag="--udp-receive-buffer",
        config="uproxy.udpReceiveBuffer",
        kind="int",
        help="Bytes of kernel receive buffer per UDP proxy port, so bursts wait instead of "
        "being dropped (beyond net.core.rmem_max with CAP_NET_ADMIN); 0 keeps the default",
    )
    drain_timeout: float = opt(
        5.0,
        flag="--drain-timeout",
        config="uproxy.drainTimeout",
        kind="duration",
        help="How long TCP connections get to finish when uproxy stops (SIGTERM, SIGINT, a "
        "changed --config or node IP), for every listener and worker at once; the proxy ports "
        "take new connections meanwhile (the rules still lead there) until none is open or a "
        "fifth of it (at most 1 s) is left, and those still open at the deadline are reset and "
        "counted in one line. Keep "
        "it below the pod's terminationGracePeriodSeconds (30 s in the manifests); a second "
        "signal stops at once",
    )
    busy_poll: float = opt(
        0.0,
        flag="--busy-poll",
        config="uproxy.busyPoll",
        kind="duration",
        help="How long a data-plane worker keeps polling its sockets after the last one had "
        "an event, instead of sleeping at once (e.g. 5ms, at most 1s; 0: never). For nodes "
        "whose idle CPUs wake slowly (virtual machines whose idle vCPUs halt): it takes the "
        "wake-ups out of a relayed request's latency, at the cost of up to a CPU per worker "
        "while traffic comes more often than this; longer than the usual gap between "
        "requests, or the wake-up stays in some of them",
    )
    workers: int | None = opt(
        None,
        flag="--workers",
        config="uproxy.workers",
        kind="int",
        help="Data-plane worker processes that accept, dial and relay (the control process "
        "does everything else), at most 256; 0 relays in the control process; default: the "
        "CPUs this process may use (affinity mask and cgroup quota), 1 with --rules none",
    )
    worker_cpu_affinity: str = opt(
        "none",
        flag="--worker-cpu-affinity",
        config="uproxy.workerCpuAffinity",
        choices=("none", "auto"),
        help="auto binds each data-plane worker to one CPU, in turn over the CPUs this process "
        "may use at start (as nginx's worker_cpu_affinity auto or HAProxy's cpu-map); none "
        "lets the scheduler move them. Bound, a worker's relaying stays on its CPU instead of "
        "waking another, idle one, which costs most where idle CPUs wake slowly (virtual "
        "machines whose idle vCPUs halt); but a bound worker cannot leave a CPU that others "
        "keep busy, so bind only where uproxy has those CPUs mostly to itself (while uproxy "
        "writes rules, whose commits hold a CPU in the kernel, the workers may leave theirs); "
        "ignored with --workers 0",
    )
    control_nice: int = opt(
        10,
        flag="--control-nice",
        config="uproxy.controlNice",
        kind="int",
        help="Nice levels the control process (and the commands it runs, such as "
        "iptables-restore) takes below the workers, with a long time slice, so that its bulk "
        "work yields the CPU to relaying; the nice levels need CAP_SYS_NICE for the workers "
        "to take back the starting priority (without it only the time slice changes); 0 "
        "keeps one priority; ignored with --workers 0",
    )
    lb_algorithm: str = opt(
        LbAlgorithm.ROUND_ROBIN.value,
        flag="--lb-algorithm",
        config="uproxy.lbAlgorithm",
        choices=tuple(a.value for a in LbAlgorithm),
        help="How endpoints are chosen: in turn, at random, or the one with the fewest "
        "connections (UDP: flows) open in this worker, equal ones in turn; the annotation "
        "uproxy.io/lb-algorithm overrides it per service",
    )
    # --- rules ---
    rules: str = opt(
        "",
        flag="--rules",
        config="uproxy.rules",
        choices=RULES_BACKENDS,
        help="How service traffic is steered into uproxy: auto (iptables-restore), "
        "nftables (uproxy's own nft tables, maps: constant cost per packet at any number of "
        "services), iptables (python-iptables, legacy tables), none (laptop mode); "
        "default: auto as root, else none",
    )
    iptables_mode: str = opt(
        "auto",
        flag="--iptables-mode",
        config="uproxy.iptablesMode",
        choices=("auto", "nft", "legacy"),
        help="iptables flavour for --rules auto: detect it as kube-proxy does, or force one",
    )
    iptables_sync_period: float = opt(
        30.0,
        flag="--iptables-sync-period",
        config="iptables.syncPeriod",
        kind="duration",
        help="The longest time between full syncs (repairs rules someone flushed)",
    )
    iptables_min_sync_period: float = opt(
        1.0,
        flag="--iptables-min-sync-period",
        config="iptables.minSyncPeriod",
        kind="duration",
        help="The shortest time between syncs when changes arrive",
    )
    dial_mark: int = opt(
        0x1000,
        flag="--dial-mark",
        config="uproxy.dialMark",
        kind="mark",
        help="Packet mark (SO_MARK) on uproxy's own connections to endpoints, so the portal "
        "rules let them pass at once; pick a bit no other component uses; 0 disables",
    )
    nodeport_addresses: tuple[str, ...] = opt(
        (),
        flag="--nodeport-addresses",
        config="nodePortAddresses",
        kind="cidrs",
        help="CIDRs of the node addresses NodePorts answer on (their rules, the sockets "
        "holding the ports, and the health-check node ports), or 'primary': the node's "
        "primary address of each IP family; default: every address",
    )
    detect_local_mode: str = opt(
        "ClusterCIDR",
        flag="--detect-local-mode",
        config="detectLocalMode",
        choices=LOCAL_MODES,
        help="How traffic from this cluster's pods is told apart, so that it reaches every "
        "endpoint of an externalTrafficPolicy: Local service through its externalIPs, "
        "LoadBalancer IPs and node ports, as the node's own traffic always does: sources in "
        "--cluster-cidr (nothing without it), sources in this Node's spec.podCIDRs, packets "
        "from --pod-bridge-interface, or from interfaces named --pod-interface-name-prefix*",
    )
    cluster_cidr: tuple[str, ...] = opt(
        (),
        flag="--cluster-cidr",
        config="clusterCIDR",
        kind="cidrs",
        help="The pods' CIDR, one per IP family, for --detect-local-mode ClusterCIDR",
    )
    pod_bridge_interface: str = opt(
        "",
        flag="--pod-bridge-interface",
        config="detectLocal.bridgeInterface",
        help="The bridge the pods are on, for --detect-local-mode BridgeInterface",
    )
    pod_interface_name_prefix: str = opt(
        "",
        flag="--pod-interface-name-prefix",
        config="detectLocal.interfaceNamePrefix",
        help="The name prefix of the pods' interfaces on the node (veth, cali...), for "
        "--detect-local-mode InterfaceNamePrefix",
    )
    cleanup_on_exit: bool = opt(
        False,
        flag="--cleanup-on-exit",
        config="uproxy.cleanupOnExit",
        kind="bool",
        help="Remove the rules on a normal shutdown, SIGTERM or SIGINT (by default they stay, "
        "as kube-proxy's do; they stay too when uproxy stops for a changed --config)",
    )
    # --- the node (not in laptop mode) ---
    conntrack_max_per_core: int = opt(
        32768,
        flag="--conntrack-max-per-core",
        config="conntrack.maxPerCore",
        kind="int",
        help="Raise nf_conntrack_max to this many entries per CPU (at least "
        "--conntrack-min), as kube-proxy does; 0 leaves the table alone",
    )
    conntrack_min: int = opt(
        131072,
        flag="--conntrack-min",
        config="conntrack.min",
        kind="int",
        help="The smallest nf_conntrack_max --conntrack-max-per-core raises it to",
    )
    conntrack_tcp_timeout_established: float = opt(
        86400.0,
        flag="--conntrack-tcp-timeout-established",
        config="conntrack.tcpEstablishedTimeout",
        kind="duration",
        help="Raise conntrack's timeout for idle established TCP connections to this; 0 leaves it",
    )
    conntrack_tcp_timeout_close_wait: float = opt(
        3600.0,
        flag="--conntrack-tcp-timeout-close-wait",
        config="conntrack.tcpCloseWaitTimeout",
        kind="duration",
        help="Raise conntrack's timeout for TCP connections in CLOSE_WAIT to this; 0 leaves it",
    )
    conntrack_tcp_be_liberal: bool = opt(
        False,
        flag="--conntrack-tcp-be-liberal",
        config="conntrack.tcpBeLiberal",
        kind="bool",
        help="Turn on nf_conntrack_tcp_be_liberal: out-of-window TCP packets stay tracked "
        "instead of being marked invalid",
    )
    conntrack_udp_timeout: float = opt(
        0.0,
        flag="--conntrack-udp-timeout",
        config="conntrack.udpTimeout",
        kind="duration",
        help="Raise conntrack's timeout for UDP flows that saw one direction only; 0 leaves it",
    )
    conntrack_udp_timeout_stream: float = opt(
        0.0,
        flag="--conntrack-udp-timeout-stream",
        config="conntrack.udpStreamTimeout",
        kind="duration",
        help="Raise conntrack's timeout for UDP flows with replies; 0 leaves it",
    )
    oom_score_adj: int = opt(
        -999,
        flag="--oom-score-adj",
        config="oomScoreAdj",
        kind="int",
        help="The OOM score adjustment of uproxy and its workers, -1000 to 1000 (lowering it "
        "needs CAP_SYS_RESOURCE)",
    )
    # --- health and metrics ---
    healthz_bind_address: str = opt(
        "0.0.0.0:10256",
        flag="--healthz-bind-address",
        config="healthzBindAddress",
        kind="hostport",
        help="Address of /healthz and /livez (127.0.0.1:10256 by default with --rules "
        "none); an unspecified host (0.0.0.0 or ::) listens in both IP families, as "
        "kube-proxy's does; empty disables",
    )
    metrics_bind_address: str = opt(
        "127.0.0.1:10249",
        flag="--metrics-bind-address",
        config="metricsBindAddress",
        kind="hostport",
        help="Address of /metrics (0.0.0.0 or :: as the host: both IP families); empty disables",
    )
    bind_address_hard_fail: bool = opt(
        False,
        flag="--bind-address-hard-fail",
        config="bindAddressHardFail",
        kind="bool",
        help="Exit when /healthz or /metrics cannot listen (by default uproxy serves "
        "without them and tries again every 5 s, as kube-proxy does)",
    )
    event_loop: str = opt(
        "auto",
        flag="--event-loop",
        config="uproxy.eventLoop",
        choices=("auto", "uvloop", "asyncio"),
        help="Event loop implementation: auto uses uvloop when installed",
    )
    # --- logging ---
    verbosity: int = opt(
        0, flag="-v", config="logging.verbosity", kind="int", help="Log verbosity (2, 3, 4)"
    )
    logging_format: str = opt(
        "text",
        flag="--logging-format",
        config="logging.format",
        choices=("text", "json"),
        help="Log format on stderr",
    )
    # The --config file these settings were read from, and the SHA-256 of the text read:
    # uproxy stops when that file's content changes (``configfile.watch_config``).
    config_file: str | None = None
    config_digest: bytes = b""

    # ----- derived values -----

    @property
    def rules_backend(self) -> str:
        if self.rules:
            return self.rules
        return "auto" if os.geteuid() == 0 else "none"

    @property
    def laptop(self) -> bool:
        """No kernel rules: listen on the service's own port on loopback when free."""
        return self.rules_backend == "none"

    @property
    def node_name(self) -> str:
        """This node's name, as kube-proxy takes it: trimmed and in lower case."""
        return (self.hostname_override.strip() or socket.gethostname().strip()).lower()

    @property
    def tcp_keepalive_whole_s(self) -> int:
        """--tcp-keepalive as the kernel takes it: whole seconds, rounded up; 0: off."""
        return math.ceil(self.tcp_keepalive)

    @property
    def algorithm(self) -> LbAlgorithm:
        return LbAlgorithm(self.lb_algorithm)

    @property
    def port_range(self) -> range | None:
        """--proxy-port-range parsed (``validate`` has checked it); None: no range of its own."""
        from uproxy.portrange import parse_port_range

        return parse_port_range(self.proxy_port_range)

    def flags(self, *names: str) -> list[str]:
        """These settings (scalar ones: no lists, no on/off flags) as command-line flags, to
        start another process with: ``flags("verbosity")`` -> ``["-v", "2"]``."""
        table = {f.name: f for f in fields(self)}
        out: list[str] = []
        for name in names:
            f, value = table[name], getattr(self, name)
            if f.metadata["kind"] in ("bool", "cidrs") or value is None:
                raise ValueError(f"{name} has no single-value flag")
            text = format_duration(value) if f.metadata["kind"] == "duration" else str(value)
            out += [f.metadata["flag"], text]
        return out


def setting_fields() -> list[Any]:
    return [f for f in fields(Settings) if f.metadata.get("flag") or f.metadata.get("config")]


_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """A Go duration ('250ms', '30s', '1h30m') in seconds."""
    text = text.strip()
    if text in ("0", ""):
        return 0.0
    pos, total = 0, 0.0
    for m in _DURATION_RE.finditer(text):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    if pos != len(text) or pos == 0:
        raise ValueError(f"not a duration like 250ms, 30s or 1h30m: {text!r}")
    return total


def default_text(f: Field[Any]) -> str | None:
    """A setting's default as the docs and ``--help`` show it; None: unset."""
    value: Any = f.default
    kind = f.metadata["kind"]
    if value is None:
        return None
    if kind == "duration":
        return format_duration(value)
    if kind == "bool":
        return str(value).lower()
    if kind == "cidrs":
        return ",".join(value) or "[]"
    if kind == "mark":
        return f"{value:#x}"
    return str(value) if value != "" else '""'


def format_duration(seconds: float) -> str:
    if seconds and seconds < 1:
        return f"{round(seconds * 1000)}ms"
    if seconds % 3600 == 0 and seconds:
        return f"{int(seconds // 3600)}h"
    if seconds % 60 == 0 and seconds:
        return f"{int(seconds // 60)}m"
    return f"{seconds:g}s"


def parse_hostport(text: str) -> tuple[str, int] | None:
    """'0.0.0.0:10256' -> ('0.0.0.0', 10256); '' -> None (disabled)."""
    text = text.strip()
    if not text:
        return None
    host, sep, port = text.rpartition(":")
    if not sep:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    host = host.strip("[]") or "0.0.0.0"
    ipaddress.ip_address(host)
    if not port.isdigit():
        raise ValueError(f"expected HOST:PORT with a port number, got {text!r}")
    p = int(port)
    if not 0 <= p <= 65535:
        raise ValueError(f"port out of range in {text!r}")
    return host, p


def _with_port(text: str, default: str) -> str:
    """A bare host gets the default's port, as kube-proxy appends it: '0.0.0.0' and '::'
    are '0.0.0.0:10256' and '[::]:10256' for /healthz."""
    host = text.strip()
    try:
        ip = ipaddress.ip_address(host.strip("[]") if host.startswith("[") else host)
    except ValueError:
        return text
    port = default.rpartition(":")[2]
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def _parse_mark(value: Any) -> int:
    """A packet mark: an integer, or a string in decimal or 0x hex (iptables' spelling)."""
    if isinstance(value, bool):
        raise ValueError(f"expected a mark like 0x1000, got {value!r}")
    if isinstance(value, int):
        mark = value
    elif isinstance(value, str):
        try:
            mark = int(value.strip(), 0)
        except ValueError:
            raise ValueError(f"expected a mark like 0x1000, got {value!r}") from None
    else:
        raise ValueError(f"expected a mark like 0x1000, got {value!r}")
    if not 0 <= mark <= 0xFFFFFFFF:
        raise ValueError(f"a mark is a 32-bit value, got {value!r}")
    return mark


MAX_WORKERS = 256  # worker processes; each holds a copy of every listening socket


def _parse_cidrs(value: Any, *, primary: bool) -> tuple[str, ...]:
    """A list of CIDRs (a comma-separated string, or a list); ``primary`` alone if allowed."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list):
        raise ValueError(f"expected a list of CIDRs, got {value!r}")
    texts = [str(c).strip() for c in items]
    if texts in ([], [""]):
        return ()  # "" or []: none
    if not all(texts):
        raise ValueError(f"an empty entry in {value!r}")
    if primary and PRIMARY in texts:
        if texts != [PRIMARY]:
            raise ValueError(f"'{PRIMARY}' cannot be combined with CIDRs, got {value!r}")
        return (PRIMARY,)
    out: list[str] = []
    for text in texts:
        try:
            net = ipaddress.ip_network(text, strict=False)
        except ValueError:
            raise ValueError(f"not a CIDR: {text!r}") from None
        if "/" not in text:  # kube-proxy wants the prefix length, even for one address
            raise ValueError(f"not a CIDR: {text!r} (one address is {text}/{net.max_prefixlen})")
        out.append(str(net))
    return tuple(out)


_BOOL_WORDS = {
    **dict.fromkeys(("1", "t", "T", "TRUE", "true", "True"), True),
    **dict.fromkeys(("0", "f", "F", "FALSE", "false", "False"), False),
}


def parse_bool(value: Any) -> bool:
    """A flag's true or false, spelt as Go's strconv.ParseBool (kube-proxy's flags) takes it."""
    out = _BOOL_WORDS.get(value) if isinstance(value, str) else None
    if out is None:
        raise ValueError(f"expected true or false, got {value!r}")
    return out


def convert(f: Any, value: Any) -> Any:
    """Parse one raw value (a flag's string, or a config file's YAML value) for field ``f``."""
    kind = f.metadata["kind"]
    name = f.metadata["flag"] or f.metadata["config"]
    try:
        out: Any
        if kind == "duration":
            if isinstance(value, bool):
                raise ValueError("expected a duration like 250ms, 30s or 15m")
            out = float(value) if isinstance(value, (int, float)) else parse_duration(str(value))
            if not math.isfinite(out):  # .nan passed every range check (NaN compares false)
                raise ValueError(f"expected a duration like 250ms, 30s or 15m, got {value!r}")
        elif kind == "int":
            try:
                if isinstance(value, bool) or not isinstance(value, (int, str)):
                    raise TypeError
                out = int(value)
            except (TypeError, ValueError):
                raise ValueError(f"expected an integer, got {value!r}") from None
        elif kind == "bool":
            out = value if isinstance(value, bool) else parse_bool(value)
        elif kind == "mark":
            out = _parse_mark(value)
        elif kind == "cidrs":
            out = _parse_cidrs(value, primary=f.name == "nodeport_addresses")
        else:
            if not isinstance(value, str):
                raise ValueError(f"expected a string, got {value!r}")
            out = value
            if kind == "ip" and value:
                ipaddress.ip_address(value)
            if kind == "hostport":
                out = _with_port(value, f.default)
                parse_hostport(out)
        choices = f.metadata["choices"]
        if choices and out not in choices and not (f.name == "rules" and out == ""):
            raise ValueError(f"must be one of {', '.join(choices)}, got {out!r}")
        return out
    except ValueError as e:
        raise SettingsError(f"invalid {name}: {e}") from None


def validate(s: Settings) -> None:
    """Cross-field checks; raises SettingsError."""
    from uproxy.portrange import parse_port_range

    try:
        parse_port_range(s.proxy_port_range)
    except ValueError as e:
        raise SettingsError(f"invalid --proxy-port-range: {e}") from None
    if s.workers is not None and not 0 <= s.workers <= MAX_WORKERS:
        raise SettingsError(f"invalid --workers: must be 0 to {MAX_WORKERS}, got {s.workers}")
    if not 0 <= s.control_nice <= 19:
        raise SettingsError("invalid --control-nice: must be 0 to 19")
    if not 0 <= s.busy_poll <= MAX_BUSY_POLL_S:
        raise SettingsError("invalid --busy-poll: must be 0 (off) up to 1s")
    if s.udp_receive_buffer < 0:
        raise SettingsError("invalid --udp-receive-buffer: must be 0 or more bytes")
    if s.endpoint_eject_after < 0:
        raise SettingsError("invalid --endpoint-eject-after: must be 0 or more")
    if s.udp_max_flows < 1:
        raise SettingsError("invalid --udp-max-flows: must be at least 1")
    if s.udp_timeout <= 0:
        raise SettingsError("invalid --udp-timeout: must be positive")
    if s.drain_timeout < 0:
        raise SettingsError("invalid --drain-timeout: must be 0 or more")
    if not 0 <= s.tcp_keepalive <= MAX_TCP_KEEPALIVE_S:
        raise SettingsError(
            f"invalid --tcp-keepalive: must be 0 (off) or up to {MAX_TCP_KEEPALIVE_S}s"
        )
    if s.config_sync_period <= 0:
        raise SettingsError("invalid --config-sync-period: must be positive")
    if s.iptables_sync_period <= 0:
        raise SettingsError("invalid --iptables-sync-period: must be positive")
    if s.iptables_min_sync_period < 0:
        raise SettingsError("invalid --iptables-min-sync-period: must be 0 or more")
    if s.iptables_min_sync_period > s.iptables_sync_period:
        raise SettingsError(
            "invalid --iptables-min-sync-period: longer than --iptables-sync-period"
        )
    for flag, value in (
        ("--conntrack-max-per-core", s.conntrack_max_per_core),
        ("--conntrack-min", s.conntrack_min),
        ("--conntrack-tcp-timeout-established", s.conntrack_tcp_timeout_established),
        ("--conntrack-tcp-timeout-close-wait", s.conntrack_tcp_timeout_close_wait),
        ("--conntrack-udp-timeout", s.conntrack_udp_timeout),
        ("--conntrack-udp-timeout-stream", s.conntrack_udp_timeout_stream),
    ):
        if value < 0:
            raise SettingsError(f"invalid {flag}: must be 0 or more")
    if s.hostname_override and not s.hostname_override.strip():
        raise SettingsError("invalid --hostname-override: only white space")
    if not -1000 <= s.oom_score_adj <= 1000:
        raise SettingsError("invalid --oom-score-adj: must be -1000 to 1000")
    if s.services and not os.path.exists(s.services):
        raise SettingsError(f"--services: no such file: {s.services}")
    if s.services and os.path.isdir(s.services):
        raise SettingsError(f"--services: a directory, not a file: {s.services}")
    _validate_http_addresses(s)
    _validate_detect_local(s)


def _validate_http_addresses(s: Settings) -> None:
    """/healthz and /metrics cannot share a port: the second would never bind."""
    healthz = parse_hostport(s.healthz_bind_address)
    metrics = parse_hostport(s.metrics_bind_address)
    if healthz is None or metrics is None or healthz[1] != metrics[1] or not healthz[1]:
        return
    hosts = {healthz[0], metrics[0]}
    if len(hosts) == 1 or hosts & {"0.0.0.0", "::"}:
        raise SettingsError(
            f"invalid --metrics-bind-address: {s.metrics_bind_address} takes the port of "
            f"--healthz-bind-address {s.healthz_bind_address}"
        )


def _validate_detect_local(s: Settings) -> None:
    """kube-proxy's rules for --detect-local-mode and the settings each mode reads."""
    versions = [ipaddress.ip_network(c).version for c in s.cluster_cidr]
    if len(versions) != len(set(versions)):
        given = ",".join(s.cluster_cidr)
        raise SettingsError(f"invalid --cluster-cidr: at most one CIDR per IP family, got {given}")
    mode = s.detect_local_mode
    for wanted, flag, value in (
        ("BridgeInterface", "--pod-bridge-interface", s.pod_bridge_interface),
        ("InterfaceNamePrefix", "--pod-interface-name-prefix", s.pod_interface_name_prefix),
    ):
        if mode != wanted:
            continue
        if not value:
            raise SettingsError(f"--detect-local-mode {mode} needs {flag}")
        if len(value) > 15 or any(ch in value for ch in "/: \t\n"):
            raise SettingsError(f"invalid {flag}: not an interface name: {value!r}")
    if mode == "NodeCIDR" and s.services:
        raise SettingsError(
            "--detect-local-mode NodeCIDR reads this Node's spec.podCIDRs from the API server: "
            "not available with --services; use ClusterCIDR with --cluster-cidr"
        )
