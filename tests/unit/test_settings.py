"""Flags, the configuration file and their precedence; bad values fail with one clear line."""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
import tempfile
from dataclasses import fields
from pathlib import Path

import pytest

from uproxy.cli import parse_settings
from uproxy.configfile import API_VERSION, KIND
from uproxy.dataplane.settings import DataplaneSettings
from uproxy.model import LbAlgorithm
from uproxy.portrange import PortAllocator, ephemeral_ports, parse_port_range
from uproxy.settings import Settings, SettingsError, parse_duration
from uproxy.workers import worker_argv


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("250ms", 0.25), ("30s", 30), ("15m", 900), ("1h30m", 5400), ("0", 0), ("1.5s", 1.5)],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["30", "s", "1x", "5m3", "-1s"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


def test_port_ranges() -> None:
    assert parse_port_range("") is None
    assert parse_port_range("0-0") is None
    assert parse_port_range("30000-30002") == range(30000, 30003)
    assert parse_port_range("30000+2") == range(30000, 30003)
    # One port, and 0 for none, as kube-proxy's net.PortRange reads them.
    assert parse_port_range("30000") == range(30000, 30001)
    assert parse_port_range("0") is None
    for bad in ("5-1", "0-10", "70000-70001", "70000"):
        with pytest.raises(ValueError, match="ports must satisfy"):
            parse_port_range(bad)
    # Python's "invalid literal for int() with base 10" said nothing of what is expected.
    for bad in ("abc", "30000+abc", "a-b", "-5", "1-", "+3"):
        with pytest.raises(ValueError, match="expected BEGIN-END, BEGIN\\+OFFSET or one port"):
            parse_port_range(bad)


def test_port_allocator_skips_ports_in_use_and_takes_released_ones_back() -> None:
    alloc = PortAllocator(range(100, 103))
    first = next(alloc.candidates(1))
    alloc.taken(first)
    assert sorted(alloc.candidates(10)) == sorted({100, 101, 102} - {first})
    alloc.release(first)
    assert sorted(alloc.candidates(10)) == [100, 101, 102]
    assert len(list(alloc.candidates(2))) == 2


def test_port_allocator_walks_a_permutation_in_linear_time() -> None:
    # 10,000 listeners from a 28,000-port range: every port handed out once, no rescans.
    alloc = PortAllocator(range(30000, 58000))
    given = []
    for _ in range(10_000):
        port = next(alloc.candidates(1))
        alloc.taken(port)
        given.append(port)
    assert len(set(given)) == 10_000 and all(30000 <= p < 58000 for p in given)
    assert given != sorted(given)  # random order: a restart does not reuse the same ports


def test_port_allocator_offers_every_port_once_per_lap_in_a_random_order() -> None:
    # A list (reserved ports taken out) of a size with many divisors: whatever stride and
    # start are drawn, one lap offers each port exactly once; seeds differ in their order.
    ports = [p for p in range(1000, 1361) if p % 7]  # 309 ports
    orders = set()
    for seed in range(20):
        alloc = PortAllocator(ports, rng=random.Random(seed))
        lap = list(alloc.candidates(len(ports)))
        assert sorted(lap) == ports
        orders.add(tuple(lap))
    assert len(orders) == 20


def test_without_a_range_the_ephemeral_ports_minus_reserved_ones(tmp_path: Path) -> None:
    rng = tmp_path / "range"
    rng.write_text("40000\t40009\n")
    reserved = tmp_path / "reserved"
    reserved.write_text("40001,40003-40005\n")
    assert ephemeral_ports(str(rng), str(reserved)) == [40000, 40002, 40006, 40007, 40008, 40009]
    assert len(ephemeral_ports(str(tmp_path / "missing"), str(reserved))) > 20000


def test_flags_parse() -> None:
    s, _ = parse_settings(
        [
            "--udp-timeout",
            "1s",
            "--lb-algorithm",
            "random",
            "--rules",
            "none",
            "--nodeport-addresses",
            "10.0.0.0/8,192.168.0.0/16",
            "-v",
            "4",
        ]
    )
    assert s.udp_timeout == 1.0 and s.lb_algorithm == "random" and s.laptop
    assert s.nodeport_addresses == ("10.0.0.0/8", "192.168.0.0/16")
    assert s.verbosity == 4 and s.bind_address is None


# DataplaneSettings fields that share a name with a Settings field but are computed at start
# (Proxy._dial_mark: --dial-mark once it is known to work, 0 in laptop mode), not carried.
COMPUTED_AT_START = {"dial_mark"}


def test_dataplane_settings_name_settings_that_exist() -> None:
    settings_fields = {f.name for f in fields(Settings)}
    for f in fields(DataplaneSettings):
        name = f.metadata.get("setting")
        if name is not None:  # a field of Settings, or a property derived from them
            assert name in settings_fields or isinstance(getattr(Settings, name), property), f
        else:  # the same name without ``setting(...)`` would be a default nobody can change
            assert f.name not in settings_fields or f.name in COMPUTED_AT_START, f


def test_dataplane_settings_carry_every_data_plane_setting_from_the_flags() -> None:
    # One flag per data-plane setting, none at its default: a new setting(...) field that is
    # not changed here fails below, and so does one that from_settings does not carry.
    s, _ = parse_settings(
        [
            "--hostname-override=node-x",
            "--lb-algorithm=random",
            "--udp-timeout=5s",
            "--udp-max-flows=17",
            "--udp-receive-buffer=12345",
            "--endpoint-eject-after=5",
            "--tcp-keepalive=2500ms",
            "--dial-mark=0x2000",
            "--busy-poll=750us",
            "--drain-timeout=2s",
        ]
    )
    dp = DataplaneSettings.from_settings(s, dial_mark=0x40)
    default = DataplaneSettings()
    assert dp.node_name == "node-x" and dp.default_algorithm is LbAlgorithm.RANDOM
    assert (dp.udp_timeout_s, dp.udp_max_flows, dp.udp_receive_buffer) == (5.0, 17, 12345)
    assert dp.eject_after == 5
    assert dp.busy_poll_s == pytest.approx(0.00075)
    assert dp.tcp_keepalive_s == 3  # whole seconds, rounded up, as the kernel takes them
    for f in fields(DataplaneSettings):
        if "setting" in f.metadata:
            carried = getattr(dp, f.name)
            assert carried == getattr(s, f.metadata["setting"]), f.name
            assert carried != getattr(default, f.name), f"{f.name}: still its default"
    # What is computed at start is given, never taken from the unchecked setting.
    assert dp.dial_mark == 0x40 and DataplaneSettings.from_settings(s).dial_mark == 0
    assert dp.dial_timeouts_s == default.dial_timeouts_s  # tunables keep their defaults


def test_settings_as_flags_parse_back_and_start_a_worker() -> None:
    s = Settings(udp_timeout=0.5, verbosity=3, logging_format="json", event_loop="asyncio")
    names = ("udp_timeout", "verbosity", "logging_format", "event_loop")
    back, _ = parse_settings(s.flags(*names))
    assert all(getattr(back, n) == getattr(s, n) for n in names)
    assert worker_argv(s) == ["--event-loop", "asyncio", "-v", "3", "--logging-format", "json"]
    with pytest.raises(ValueError, match="nodeport_addresses"):
        s.flags("nodeport_addresses")


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--udp-timeout", "soon"], "--udp-timeout"),
        (["--lb-algorithm", "fastest"], "--lb-algorithm"),
        (["--bind-address", "localhost"], "--bind-address"),
        (["--proxy-port-range", "9-1"], "--proxy-port-range"),
        (["--healthz-bind-address", "nope"], "--healthz-bind-address"),
        (["--services", "/does/not/exist.yaml"], "--services"),
        (["--control-nice", "20"], "--control-nice: must be 0 to 19"),
        (["--control-nice", "-1"], "--control-nice: must be 0 to 19"),
        (["--udp-max-flows", "x"], "--udp-max-flows: expected an integer, got 'x'$"),
        (["--workers", "1.5"], "--workers: expected an integer, got '1.5'$"),
        (["--tcp-keepalive", "10h"], "--tcp-keepalive: must be 0 \\(off\\) or up to 32767s"),
        # 0 would announce every service again in a loop that never sleeps
        (["--config-sync-period", "0"], "--config-sync-period: must be positive"),
        (["--dial-mark", "0x1g"], "--dial-mark: expected a mark like 0x1000, got '0x1g'$"),
        (["--dial-mark", "0x100000000"], "--dial-mark: a mark is a 32-bit value"),
        (["--udp-receive-buffer", "-1"], "--udp-receive-buffer: must be 0 or more bytes"),
        (["--endpoint-eject-after", "-1"], "--endpoint-eject-after: must be 0 or more"),
        (["--udp-max-flows", "0"], "--udp-max-flows: must be at least 1"),
        (["--udp-timeout", "0s"], "--udp-timeout: must be positive"),
        (["--iptables-sync-period", "0s"], "--iptables-sync-period: must be positive"),
        (
            ["--iptables-sync-period", "30s", "--iptables-min-sync-period", "1m"],
            "--iptables-min-sync-period: longer than --iptables-sync-period",
        ),
        (["--conntrack-min", "-1"], "--conntrack-min: must be 0 or more"),
        (["--oom-score-adj", "1001"], "--oom-score-adj: must be -1000 to 1000"),
        (["--metrics-bind-address", "127.0.0.1:70000"], "--metrics-bind-address: port out of"),
        (
            ["--healthz-bind-address", "1.2.3.4:abc"],
            "--healthz-bind-address: expected HOST:PORT with a port number, got '1.2.3.4:abc'$",
        ),
        (["--nodeport-addresses", "10.0.0.0/33"], "--nodeport-addresses: not a CIDR"),
        (["--nodeport-addresses", ","], "--nodeport-addresses: an empty entry"),
        (["--workers", "300"], "--workers: must be 0 to 256, got 300"),
        # a window in microseconds given without its unit would poll for ever
        (["--busy-poll", "2s"], "--busy-poll: must be 0 \\(off\\) up to 1s"),
        (["--busy-poll", "50"], "--busy-poll"),
        # a value that starts with "-" is the flag's value, not an unknown flag
        (["--drain-timeout", "-1s"], "--drain-timeout: not a duration like .*'-1s'$"),
        (["--udp-timeout", "-5s"], "--udp-timeout: not a duration like .*'-5s'$"),
        (["--services", "/"], "--services: a directory, not a file: /$"),
        # /healthz and /metrics on one port: the second would retry its bind for ever
        (
            ["--healthz-bind-address", "0.0.0.0:10256", "--metrics-bind-address", "[::1]:10256"],
            "--metrics-bind-address: \\[::1\\]:10256 takes the port of --healthz-bind-address",
        ),
        (
            ["--healthz-bind-address", "127.0.0.1:9", "--metrics-bind-address", "127.0.0.1:9"],
            "--metrics-bind-address",
        ),
    ],
)
def test_bad_flags(argv: list[str], needle: str) -> None:
    with pytest.raises(SettingsError, match=needle):
        parse_settings(argv)


def test_an_api_server_given_with_a_services_file_is_said_to_be_unused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    services = tmp_path / "s.yaml"
    services.write_text("")
    caplog.set_level(logging.WARNING, logger="uproxy")
    parse_settings(["--services", str(services), "--kubeconfig", "/etc/kubeconfig"])
    said = [(r.getMessage(), r.__dict__["kv"]) for r in caplog.records]
    assert said == [
        (
            "Services come from the --services file: the API server is not used",
            {"ignored": "--kubeconfig"},
        )
    ]
    caplog.clear()
    parse_settings(["--services", str(services)])
    assert not caplog.records


def test_healthz_and_metrics_may_share_a_port_number_on_other_addresses() -> None:
    s, _ = parse_settings(
        ["--healthz-bind-address", "10.0.0.1:10256", "--metrics-bind-address", "127.0.0.1:10256"]
    )
    assert s.metrics_bind_address == "127.0.0.1:10256"


CONFIG = """
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: userspace
bindAddress: 0.0.0.0
healthzBindAddress: 0.0.0.0:10256
metricsBindAddress: 127.0.0.1:10249
portRange: 30000-30100
udpIdleTimeout: 500ms
iptables:
  syncPeriod: 20s
  minSyncPeriod: 2s
  masqueradeAll: false
nodePortAddresses: ["10.0.0.0/8"]
hostnameOverride: node-a
clientConnection:
  kubeconfig: /etc/kubeconfig
configSyncPeriod: 10m
logging:
  verbosity: 2
  format: json
conntrack:
  maxPerCore: 32768
uproxy:
  rules: iptables
  lbAlgorithm: random
  udpMaxFlows: 100
"""


def test_config_file_and_flag_precedence(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(CONFIG + "bogusField: 1\n")
    s, _ = parse_settings(["--config", str(cfg), "--udp-timeout", "2s"])
    assert s.udp_timeout == 2.0  # the flag wins
    assert s.iptables_sync_period == 20 and s.iptables_min_sync_period == 2
    assert s.proxy_port_range == "30000-30100" and s.hostname_override == "node-a"
    assert s.kubeconfig == "/etc/kubeconfig" and s.config_sync_period == 600
    assert s.rules == "iptables" and s.lb_algorithm == "random" and s.udp_max_flows == 100
    assert s.verbosity == 2 and s.logging_format == "json"
    assert s.nodeport_addresses == ("10.0.0.0/8",)
    assert any(getattr(r, "kv", {}).get("field") == "bogusField" for r in caplog.records)


@pytest.mark.parametrize(
    ("patch", "needle"),
    [
        ("udpIdleTimeout: [1]", "udpIdleTimeout"),
        ("iptables:\n  syncPeriod: true", "iptables.syncPeriod"),
        ("uproxy:\n  udpMaxFlows: many", "uproxy.udpMaxFlows"),
        ("mode: ipvs", "mode"),
        # A value checked after loading names its field in the file, not the flag.
        ("configSyncPeriod: -5", r"c\.yaml: configSyncPeriod: must be positive$"),
        ("iptables:\n  minSyncPeriod: -1", r"c\.yaml: iptables\.minSyncPeriod: must be 0 or more$"),
        ("uproxy:\n  workers: -3", r"c\.yaml: uproxy\.workers: must be 0 to \d+, got -3$"),
        ("portRange: 100-50", r"c\.yaml: portRange: .*'100-50'$"),
        ("uproxy:\n  services: nowhere.yaml", r"c\.yaml: uproxy\.services: no such file"),
        # A block of fields that is not a mapping is the wrong type, not an unknown field.
        ("conntrack: 5", r"c\.yaml: conntrack: expected a mapping, got 5$"),
        ("uproxy: [1, 2]", r"c\.yaml: uproxy: expected a mapping, got \[1, 2\]$"),
        ("linux:\n  conntrack: x", r"c\.yaml: linux\.conntrack: expected a mapping"),
        ("kind: Pod", "KubeProxyConfiguration"),
        # A mapping where a field is: the wrong type, not a block of unknown fields.
        ("configSyncPeriod: {a: 1}", r"c\.yaml: configSyncPeriod: not a duration"),
        ("uproxy:\n  workers: {n: 2}", r"c\.yaml: uproxy\.workers: expected an integer"),
        # A key given twice: kube-proxy's strict decoding refuses it; the last one was kept.
        ("udpIdleTimeout: 1s\nudpIdleTimeout: 2s", r"line 4: .*'udpIdleTimeout' appears twice$"),
        ("uproxy:\n  workers: 1\n  workers: 2", r"line 5: .*'workers' appears twice$"),
        # White space alone is not "unset" (Go compares with ""): kube-proxy refuses it.
        ('hostnameOverride: "   "', r"c\.yaml: hostnameOverride: only white space$"),
    ],
)
def test_config_wrong_type_fails_with_one_line(tmp_path: Path, patch: str, needle: str) -> None:
    base = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"
    if patch.startswith("kind:"):
        base = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\n"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(base + patch + "\n")
    with pytest.raises(SettingsError, match=needle) as err:
        parse_settings(["--config", str(cfg)])
    assert "\n" not in str(err.value)


# kube-proxy's ConfigMap as kubeadm writes it: every field present, most at their zero value.
KUBEADM_CONFIG = """
apiVersion: kubeproxy.config.k8s.io/v1alpha1
bindAddress: 0.0.0.0
bindAddressHardFail: false
clientConnection:
  acceptContentTypes: ""
  burst: 0
  contentType: ""
  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf
  qps: 0
clusterCIDR: 10.244.0.0/16,fd00:10:244::/56
configSyncPeriod: 0s
conntrack:
  maxPerCore: null
  min: null
  tcpBeLiberal: false
  tcpCloseWaitTimeout: null
  tcpEstablishedTimeout: null
  udpStreamTimeout: 0s
  udpTimeout: 0s
detectLocal:
  bridgeInterface: ""
  interfaceNamePrefix: ""
detectLocalMode: ""
enableProfiling: false
healthzBindAddress: ""
hostnameOverride: ""
iptables:
  localhostNodePorts: null
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 0s
  syncPeriod: 0s
ipvs:
  excludeCIDRs: null
  minSyncPeriod: 0s
  scheduler: ""
  strictARP: false
  syncPeriod: 0s
  tcpFinTimeout: 0s
  tcpTimeout: 0s
  udpTimeout: 0s
kind: KubeProxyConfiguration
logging:
  flushFrequency: 0
  options:
    json:
      infoBufferSize: "0"
    text:
      infoBufferSize: "0"
  verbosity: 0
metricsBindAddress: ""
mode: ""
nftables:
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 0s
  syncPeriod: 0s
nodePortAddresses: null
oomScoreAdj: null
portRange: ""
showHiddenMetricsForVersion: ""
udpIdleTimeout: 0s
winkernel:
  enableDSR: false
  forwardHealthCheckVip: false
  networkName: ""
  rootHnsEndpointName: ""
  sourceVip: ""
windowsRunAsService: false
"""


def config_file(tmp_path: Path, body: str, *, name: str = "c.yaml") -> Path:
    """A KubeProxyConfiguration file of ``body`` after its apiVersion and kind."""
    path = tmp_path / name
    path.write_text(f"apiVersion: {API_VERSION}\nkind: {KIND}\n{body}")
    return path


def test_kubeadm_config_loads_with_the_defaults_for_its_zero_values(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A zero value is "not set", as kube-proxy's defaulting reads it: this file used to be
    refused ("detectLocalMode: must be one of ..."), and once edited to load, it turned
    /healthz and /metrics off and synced rules with no minimum period."""
    caplog.set_level(logging.WARNING, logger="uproxy")
    caplog.clear()
    cfg = tmp_path / "config.conf"
    cfg.write_text(KUBEADM_CONFIG)
    s, _ = parse_settings(["--config", str(cfg), "--rules", "iptables-restore"])
    assert s.healthz_bind_address == "0.0.0.0:10256"
    assert s.metrics_bind_address == "127.0.0.1:10249"
    assert s.iptables_sync_period == 30 and s.iptables_min_sync_period == 1
    assert s.config_sync_period == 900 and s.udp_timeout == 0.25
    assert s.detect_local_mode == "ClusterCIDR"
    assert s.cluster_cidr == ("10.244.0.0/16", "fd00:10:244::/56")
    assert s.kubeconfig == "/var/lib/kube-proxy/kubeconfig.conf"
    assert s.conntrack_max_per_core == 32768 and s.oom_score_adj == -999
    assert not caplog.records, [r.getMessage() for r in caplog.records]


def test_a_zero_where_zero_means_something_is_kept(tmp_path: Path) -> None:
    # conntrack.maxPerCore: 0 is kube-proxy's "leave the limit alone", not the default.
    cfg = config_file(tmp_path, "conntrack:\n  maxPerCore: 0\noomScoreAdj: 0\n", name="c.yaml")
    s, _ = parse_settings(["--config", str(cfg)])
    assert s.conntrack_max_per_core == 0 and s.oom_score_adj == 0


@pytest.mark.parametrize(
    ("argv", "healthz", "metrics"),
    [
        (["--healthz-bind-address", "0.0.0.0"], "0.0.0.0:10256", "127.0.0.1:10249"),
        (
            ["--healthz-bind-address", "::", "--metrics-bind-address", "::1"],
            "[::]:10256",
            "[::1]:10249",
        ),
        (["--metrics-bind-address", "[::1]"], "0.0.0.0:10256", "[::1]:10249"),
        (["--healthz-bind-address", "127.0.0.1:9000"], "127.0.0.1:9000", "127.0.0.1:10249"),
    ],
)
def test_an_address_without_a_port_gets_the_default_port(
    argv: list[str], healthz: str, metrics: str
) -> None:
    s, _ = parse_settings(["--rules", "iptables-restore", *argv])
    assert (s.healthz_bind_address, s.metrics_bind_address) == (healthz, metrics)


def test_write_config_gives_cluster_cidr_as_kube_proxy_spells_it(tmp_path: Path) -> None:
    out = tmp_path / "out.yaml"
    cli = [sys.executable, "-m", "uproxy.cli", "--rules", "none"]
    cidrs = "10.244.0.0/16,fd00::/56"
    done = subprocess.run(
        [*cli, "--cluster-cidr", cidrs, "--write-config-to", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert f"clusterCIDR: {cidrs}" in out.read_text()  # a string field, not a list
    s, _ = parse_settings(["--config", str(out)])
    assert s.cluster_cidr == ("10.244.0.0/16", "fd00::/56")


@pytest.mark.parametrize(
    ("arg", "said"),
    [
        # Read as --version (exit 0 with a version line) or as --conntrack-max-per-core.
        ("--conntrack-max=100", "unrecognized arguments: --conntrack-max=100"),
        ("--hostname=node-a", "unrecognized arguments: --hostname=node-a"),
        ("--clust=10.0.0.0/8", "unrecognized arguments: --clust=10.0.0.0/8"),
    ],
)
def test_no_flag_is_taken_by_a_prefix(arg: str, said: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "uproxy.cli", "--rules", "none", arg],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and said in done.stderr, done.stdout + done.stderr


@pytest.mark.parametrize("argv", [["--v=3"], ["--v", "3"], ["-v", "3"], ["-v=3"]])
def test_verbosity_in_klog_spellings(argv: list[str]) -> None:
    s, _ = parse_settings(argv)
    assert s.verbosity == 3


def test_node_name_is_trimmed_and_lower_case() -> None:
    # As kube-proxy's GetHostname: Node objects' names are lower case.
    s, _ = parse_settings(["--hostname-override", " Node-A.Example "])
    assert s.node_name == "node-a.example"
    with pytest.raises(SettingsError, match="--hostname-override: only white space"):
        parse_settings(["--hostname-override", "  "])


def test_json_log_lines_carry_klog_verbosity() -> None:
    from uproxy.log import V2, V3, V4, JsonFormatter

    def v(level: int) -> int:
        record = logging.LogRecord("uproxy.x", level, __file__, 1, "m", None, None)
        return int(json.loads(JsonFormatter().format(record))["v"])

    assert [v(lvl) for lvl in (logging.WARNING, logging.INFO, V2, V3, V4)] == [0, 0, 2, 3, 4]


def test_a_flag_over_a_config_value_is_named_as_the_flag(tmp_path: Path) -> None:
    cfg = config_file(tmp_path, "uproxy:\n  workers: 2\n", name="c.yaml")
    with pytest.raises(SettingsError, match=r"^invalid --workers: must be 0 to \d+, got -1$"):
        parse_settings(["--config", str(cfg), "--workers=-1"])


def test_an_empty_block_is_no_value(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Every field of the block commented out: YAML reads null; nothing to warn about.
    cfg = config_file(tmp_path, "uproxy:\n  # workers: 2\nconntrack: {}\n", name="c.yaml")
    caplog.set_level(logging.DEBUG, logger="uproxy")
    s, _ = parse_settings(["--config", str(cfg)])
    assert s.workers == Settings().workers
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b"mode: userspace: again\n", ": line 3: not valid YAML: mapping values are not allowed"),
        (b"---\nmode: userspace\n", ": line 3: not valid YAML: a second document \\(the file"),
        (b"hostnameOverride: \xff\xfe\n", ": not UTF-8 text$"),
        (None, ": Is a directory$"),  # a path that cannot be read as a file
        (b"uproxy:\n  dialMark: true\n", "uproxy.dialMark"),
    ],
)
def test_a_config_file_that_cannot_be_used_fails_with_one_line(
    tmp_path: Path, content: bytes | None, needle: str
) -> None:
    cfg = tmp_path / "config.yaml"
    if content is None:
        cfg.mkdir()
    else:
        head = b"apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"
        cfg.write_bytes(head + content)
    with pytest.raises(SettingsError, match=needle) as err:
        parse_settings(["--config", str(cfg)])
    assert "\n" not in str(err.value)


def test_cli_error_is_one_line_and_exit_2() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "uproxy.cli", "--udp-timeout", "soon"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert "--udp-timeout" in proc.stderr and "Traceback" not in proc.stderr


def test_version_and_help() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "uproxy.cli", "--version"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0 and out.stdout.startswith("uproxy ")
    helptext = subprocess.run(
        [sys.executable, "-m", "uproxy.cli", "--help"], capture_output=True, text=True, timeout=30
    )
    assert "--services" in helptext.stdout and "win over --config" in " ".join(
        helptext.stdout.split()
    )


def test_rules_programmed_by_default_as_root_are_announced(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Only when --rules was not given (root's default) and they would outlive the process.
    from uproxy.proxy import announce_rules

    caplog.set_level(logging.INFO, logger="uproxy.proxy")
    for quiet in (Settings(rules="auto"), Settings(rules="", cleanup_on_exit=True)):
        announce_rules(quiet)
    assert not caplog.records
    announce_rules(Settings(rules=""))
    [record] = caplog.records
    assert "until 'uproxy --cleanup'" in record.getMessage()


def test_laptop_health_listens_on_loopback_unless_told(tmp_path: Path) -> None:
    assert parse_settings(["--rules", "none"])[0].healthz_bind_address == "127.0.0.1:10256"
    assert parse_settings(["--rules", "auto"])[0].healthz_bind_address == "0.0.0.0:10256"
    told = ["--rules", "none", "--healthz-bind-address", "0.0.0.0:10256"]
    assert parse_settings(told)[0].healthz_bind_address == "0.0.0.0:10256"
    config = config_file(
        tmp_path, "healthzBindAddress: 0.0.0.0:10356\nuproxy:\n  rules: none\n", name="config.yaml"
    )
    assert parse_settings([f"--config={config}"])[0].healthz_bind_address == "0.0.0.0:10356"


def test_write_config_keeps_a_zero_that_means_off(tmp_path: Path) -> None:
    """``healthzBindAddress: ""`` reads as the default (kube-proxy's defaulting), so a file
    written with /healthz and /metrics off and no minimum sync period loaded back with all
    three on: the file lists them in uproxy.zeroValues and loads to the same settings."""
    out = tmp_path / "out.yaml"
    off = ["--healthz-bind-address=", "--metrics-bind-address=", "--iptables-min-sync-period=0s"]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "uproxy.cli",
            "--rules",
            "none",
            *off,
            "--write-config-to",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    s, _ = parse_settings(["--config", str(out)])
    assert (s.healthz_bind_address, s.metrics_bind_address) == ("", "")
    assert s.iptables_min_sync_period == 0
    # Without the list the same zeros are kube-proxy's "not set", as kubeadm writes them.
    out.write_text(out.read_text().replace("zeroValues", "zeroValuesNot"))
    s, _ = parse_settings(["--config", str(out)])
    assert s.healthz_bind_address and s.metrics_bind_address
    assert s.iptables_min_sync_period == 1


def test_zero_values_names_only_fields_whose_zero_is_unset(tmp_path: Path) -> None:
    cfg = config_file(tmp_path, "uproxy:\n  zeroValues: [oomScoreAdj]\n", name="c.yaml")
    with pytest.raises(SettingsError, match=r"uproxy.zeroValues: 'oomScoreAdj' is not one of"):
        parse_settings(["--config", str(cfg)])


@pytest.mark.root  # to run as another user
def test_a_configuration_written_by_a_user_who_is_not_root_means_what_it_does_for_root() -> None:
    """Without --rules, a user who is not root runs a laptop proxy (/healthz on loopback);
    a configuration that user writes is for a node. It said 127.0.0.1:10256, and a node
    that loaded it failed its kubelet probes on the pod IP."""
    with tempfile.TemporaryDirectory() as scratch:
        os.chmod(scratch, 0o777)
        out = Path(scratch) / "written.yaml"
        assert "healthzBindAddress: 0.0.0.0:10256\n" in _written_as_nobody(out)
        # An explicit --rules none is a laptop configuration wherever it is written.
        assert "healthzBindAddress: 127.0.0.1:10256\n" in _written_as_nobody(out, "--rules=none")


def _written_as_nobody(out: Path, *flags: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "uproxy.cli", *flags, f"--write-config-to={out}"],
        capture_output=True,
        text=True,
        timeout=60,
        user=65534,
        group=65534,
        extra_groups=[],
    )
    assert done.returncode == 0, done.stderr
    return out.read_text()


@pytest.mark.parametrize(
    ("argv", "on"),
    [
        (["--cleanup-on-exit"], True),
        (["--cleanup-on-exit=true"], True),
        (["--cleanup-on-exit=True"], True),
        (["--cleanup-on-exit=1"], True),
        (["--cleanup-on-exit=false"], False),
        (["--cleanup-on-exit=F"], False),
        (["--cleanup-on-exit=0"], False),
    ],
)
def test_switches_take_kube_proxys_spellings_and_turn_off_what_the_file_turns_on(
    tmp_path: Path, argv: list[str], on: bool
) -> None:
    """kube-proxy's flags take --flag, --flag=true and --flag=false: a DaemonSet that says
    --bind-address-hard-fail=true failed with "ignored explicit argument", and nothing on
    the command line could turn off a file's cleanupOnExit: true."""
    config = config_file(tmp_path, "uproxy:\n  cleanupOnExit: true\n")
    assert parse_settings([f"--config={config}", *argv])[0].cleanup_on_exit is on
    assert parse_settings(["--bind-address-hard-fail=true"])[0].bind_address_hard_fail


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--cleanup-on-exit=yes"], "invalid --cleanup-on-exit: expected true or false, got 'yes'"),
        (["--cleanup-on-exit", "false"], "unrecognized arguments: false (see uproxy --help)"),
        (
            ["--cleanup=maybe"],
            "argument --cleanup: expected true or false, got 'maybe' (see uproxy --help)",
        ),
    ],
)
def test_a_switch_with_a_value_it_cannot_take_is_one_line(argv: list[str], said: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "uproxy.cli", *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"uproxy: error: {said}"]


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
def test_a_duration_that_is_not_a_number_is_refused_with_one_line(
    tmp_path: Path, value: str
) -> None:
    """NaN passed every range check (it compares false with anything): a UDP flow timeout of
    .nan started, and flows would never have expired."""
    config = config_file(tmp_path, f"udpIdleTimeout: {value}\n")
    with pytest.raises(SettingsError, match=r"udpIdleTimeout: expected a duration"):
        parse_settings([f"--config={config}"])


@pytest.mark.parametrize("flag", ["50us", "0.0005s", "1ns", "370ns", "123.456789s", "1h30m"])
def test_a_written_duration_reads_back_as_the_same(tmp_path: Path, flag: str) -> None:
    """``--udp-timeout 50us`` was written as ``4.9999999999999996e-05s``, which no duration
    parser reads: the written file failed to load."""
    out = tmp_path / "out.yaml"
    expected = parse_settings([f"--udp-timeout={flag}"])[0].udp_timeout
    from uproxy.cli import main

    assert main([f"--udp-timeout={flag}", f"--write-config-to={out}"]) == 0
    assert parse_settings([f"--config={out}"])[0].udp_timeout == expected
