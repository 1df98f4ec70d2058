"""The ConfigMap's configuration, loaded exactly as the DaemonSet passes it to uproxy."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from uproxy.cli import parse_settings
from uproxy.settings import SettingsError

from .manifests import DEPLOY, INSTALLS, REPO, find, invocation, load

NODE = "node-a.example"


@pytest.mark.parametrize(("file", "name"), INSTALLS.items())
def test_configmap_gives_the_expected_settings(
    file: str, name: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    docs = load(DEPLOY / file)
    inv = invocation(docs, find(docs, "DaemonSet", name), root=tmp_path, env={"NODE_NAME": NODE})
    assert inv.argv[0] == "uproxy"
    caplog.set_level(logging.DEBUG, logger="uproxy")
    s, _ = parse_settings(inv.argv[1:])

    beside = file == "beside-kube-proxy.yaml"
    assert s.node_name == NODE  # $(NODE_NAME) reached --hostname-override
    assert s.service_proxy_name == ("uproxy" if beside else None)
    assert s.healthz_bind_address == ("0.0.0.0:10356" if beside else "0.0.0.0:10256")
    assert s.metrics_bind_address == ("127.0.0.1:10349" if beside else "127.0.0.1:10249")
    assert s.rules_backend == "auto" and s.iptables_mode == "auto"
    assert s.bind_address is None and not s.laptop  # every family the node has
    assert s.services is None and s.kubeconfig is None  # in-cluster API access
    assert s.udp_timeout == 0.25 and s.udp_max_flows == 4096
    assert s.iptables_sync_period == 30.0 and s.iptables_min_sync_period == 1.0
    assert s.config_sync_period == 900.0
    assert s.nodeport_addresses == ()
    assert s.lb_algorithm == "round-robin" and s.cleanup_on_exit is False
    assert s.verbosity == 0 and s.logging_format == "text"
    assert s.oom_score_adj == -999
    if beside:  # kube-proxy on the node owns its conntrack settings
        assert s.conntrack_max_per_core == 0
        assert s.conntrack_tcp_timeout_established == s.conntrack_tcp_timeout_close_wait == 0
    else:
        assert (s.conntrack_max_per_core, s.conntrack_min) == (32768, 131072)
        assert s.conntrack_tcp_timeout_established == 86400.0
        assert s.conntrack_tcp_timeout_close_wait == 3600.0
    # Every field in the shipped file is one uproxy reads: no warning about unknown fields.
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_explicit_flags_win_over_the_configmap(tmp_path: Path) -> None:
    docs = load(DEPLOY / "uproxy.yaml")
    inv = invocation(docs, find(docs, "DaemonSet", "uproxy"), root=tmp_path, env={})
    s, _ = parse_settings([*inv.argv[1:], "--udp-timeout=2s", "--healthz-bind-address="])
    assert s.udp_timeout == 2.0 and s.healthz_bind_address == ""
    assert s.hostname_override == "$(NODE_NAME)"  # unexpanded: no such variable given


def _configmap_config() -> dict[str, Any]:
    cm = find(load(DEPLOY / "uproxy.yaml"), "ConfigMap", "uproxy")
    doc: dict[str, Any] = yaml.safe_load(cm["data"]["config.yaml"])
    return doc


@pytest.mark.parametrize(
    ("path", "value", "needle"),
    [
        (["udpIdleTimeout"], True, "udpIdleTimeout: expected a duration"),
        (["iptables", "syncPeriod"], "soon", "iptables.syncPeriod: not a duration"),
        (["uproxy", "udpMaxFlows"], "many", "uproxy.udpMaxFlows:"),
        (["uproxy", "cleanupOnExit"], "yes please", "uproxy.cleanupOnExit: expected true or false"),
        (["nodePortAddresses"], "10.0.0.0/33", "nodePortAddresses:"),
        (["healthzBindAddress"], 10256, "healthzBindAddress: expected a string"),
    ],
)
def test_a_wrong_type_fails_with_one_clear_line(
    path: list[str], value: object, needle: str, tmp_path: Path
) -> None:
    doc = _configmap_config()
    node: Any = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(doc))

    with pytest.raises(SettingsError, match=needle):
        parse_settings([f"--config={config}"])

    done = subprocess.run(
        [sys.executable, "-m", "uproxy.cli", f"--config={config}", "--hostname-override=n"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"uproxy: error: {config}: ") and needle in lines[0]


def test_an_unknown_field_warns_and_loads(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    doc = _configmap_config()
    doc["udpIdleTimout"] = "1s"
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(doc))
    caplog.set_level(logging.WARNING, logger="uproxy")
    s, _ = parse_settings([f"--config={config}"])
    assert s.udp_timeout == 0.25
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warnings] == ["Unknown configuration field"]
    assert warnings[0].kv["field"] == "udpIdleTimout"  # type: ignore[attr-defined]


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_the_unknown_field_warning_is_one_line_in_the_configured_format(
    tmp_path: Path, fmt: str
) -> None:
    # Read before logging is set up (the file decides the format): held, then logged as set.
    doc = _configmap_config()
    doc["udpIdleTimout"] = "1s"
    doc["logging"] = {"format": fmt}
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(doc))
    argv = [sys.executable, "-m", "uproxy.cli", f"--config={config}"]
    argv += [f"--write-config-to={tmp_path / 'out.yaml'}"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 0, done.stderr
    (line,) = done.stderr.splitlines()
    if fmt == "json":
        said = json.loads(line)
        assert (said["level"], said["msg"]) == ("warning", "Unknown configuration field")
        assert (said["file"], said["field"]) == (str(config), "udpIdleTimout")
    else:
        assert line.startswith("W") and '"Unknown configuration field"' in line
        assert f'file="{config}" field="udpIdleTimout"' in line


def test_linux_fields_of_newer_kube_proxy_configurations_mean_the_same(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    doc = _configmap_config()
    del doc["conntrack"], doc["oomScoreAdj"]  # the older spelling of the same fields
    doc["linux"] = {
        "conntrack": {"maxPerCore": 0, "tcpCloseWaitTimeout": "2h", "tcpBeLiberal": True},
        "oomScoreAdj": -500,
        "masqueradeAll": False,
    }
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(doc))
    caplog.set_level(logging.WARNING, logger="uproxy")
    s, _ = parse_settings([f"--config={config}"])
    assert s.conntrack_max_per_core == 0
    assert s.conntrack_tcp_timeout_close_wait == 7200.0
    assert s.conntrack_tcp_be_liberal is True
    assert s.oom_score_adj == -500
    assert [r.getMessage() for r in caplog.records] == []  # masqueradeAll: known, ignored


def _settings_values(s: Any) -> dict[str, Any]:
    from uproxy.settings import setting_fields

    return {f.name: getattr(s, f.name) for f in setting_fields()}


def test_a_written_configuration_loads_back_to_the_same_settings(tmp_path: Path) -> None:
    from uproxy.cli import main

    services = tmp_path / "services.yaml"
    services.write_text("")
    written = tmp_path / "written.yaml"
    flags = [
        f"--services={services}",
        "--hostname-override=node-7",
        "--udp-timeout=1.5s",
        "--iptables-min-sync-period=250ms",
        "--conntrack-tcp-timeout-close-wait=0.0005s",  # kept exactly, not rounded to 0ms
        "--conntrack-min=5",
        "--conntrack-tcp-be-liberal",
        "--nodeport-addresses=10.0.0.0/8,fd00::/64",
        "--cluster-cidr=10.244.0.0/16",
        "--dial-mark=0x20",
        "--workers=3",
        "--rules=nftables",
        "--oom-score-adj=-500",
        "-v=3",
    ]
    assert main([*flags, f"--write-config-to={written}"]) == 0
    expected, _ = parse_settings(flags)
    loaded, _ = parse_settings([f"--config={written}"])
    assert _settings_values(loaded) == _settings_values(expected)
    assert _settings_values(loaded) != _settings_values(parse_settings([])[0])


def test_the_shipped_configuration_written_out_loads_back_the_same(tmp_path: Path) -> None:
    from uproxy.cli import main

    shipped = tmp_path / "shipped.yaml"
    shipped.write_text(yaml.safe_dump(_configmap_config()))
    written = tmp_path / "written.yaml"
    assert main([f"--config={shipped}", f"--write-config-to={written}"]) == 0
    assert _settings_values(parse_settings([f"--config={written}"])[0]) == _settings_values(
        parse_settings([f"--config={shipped}"])[0]
    )


def test_a_configuration_that_cannot_be_written_is_one_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "uproxy.cli", "--write-config-to=/nonexistent/dir/c.yaml"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "uproxy: error: --write-config-to /nonexistent/dir/c.yaml: No such file or directory"
    ]
