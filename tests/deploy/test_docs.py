"""The references are generated from the code and fail when they drift; the hand-written pages
use flags, configuration and rules that exist."""

from __future__ import annotations

import logging
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from uproxy import docgen
from uproxy.cli import build_parser
from uproxy.configfile import KIND, apply_config
from uproxy.model import Protocol, ServicePortName
from uproxy.rules.base import Portal, PortalKind
from uproxy.rules.portals import build_rules
from uproxy.settings import Settings, setting_fields

from .manifests import DEPLOY, INSTALLS, REPO, container, find, load

DOCS = REPO / "docs"
PAGES = sorted(DOCS.glob("*.md"))


def test_generated_references_match_the_code() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "uproxy.docgen", "--check"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_check_fails_when_a_page_drifts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for name in docgen.pages():
        shutil.copy(DOCS / name, tmp_path / name)
    assert docgen.main(["--check", "--docs-dir", str(tmp_path)]) == 0
    page = tmp_path / "configuration.md"
    page.write_text(page.read_text().replace("| `30s` |", "| `31s` |"))
    assert docgen.main(["--check", "--docs-dir", str(tmp_path)]) == 1
    out = capsys.readouterr()
    assert "-| `--iptables-sync-period`" in out.out and "stale" in out.err
    assert docgen.main(["--docs-dir", str(tmp_path)]) == 0  # regenerate
    assert page.read_text() == (DOCS / "configuration.md").read_text()


def test_check_fails_when_the_code_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    real = docgen.configuration_md
    monkeypatch.setattr(docgen, "configuration_md", lambda: real().replace("15m", "16m"))
    assert docgen.check(DOCS)


def test_configuration_reference_lists_every_flag_and_field() -> None:
    text = (DOCS / "configuration.md").read_text()
    for f in setting_fields():
        flag = f"| `{f.metadata['flag']}`"
        row = next(line for line in text.splitlines() if line.startswith(flag))
        if f.metadata["config"]:
            assert f"`{f.metadata['config']}`" in row
        assert f.metadata["help"] in row
    for action in build_parser()._actions:
        for option in action.option_strings:
            assert f"`{option}`" in text, option
    assert "uproxy demo" in text


def test_metrics_reference_lists_every_metric() -> None:
    from prometheus_client import REGISTRY

    from uproxy import metrics

    text = (DOCS / "metrics.md").read_text()
    names = {m.name for m in REGISTRY.collect() if m.name.startswith(("uproxy_", "kubeproxy_"))}
    names |= {family.name for family in metrics.DATA_PLANE}  # served beside the registry
    assert any(n.startswith("uproxy_") for n in names) and names
    for name in names:
        assert f"`{name}" in text, name


def test_example_configuration_loads_to_the_defaults(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="uproxy")
    loaded = apply_config(yaml.safe_load(docgen.example_config()), Settings())
    assert loaded == Settings()
    assert not caplog.records


def _code_blocks(text: str) -> list[str]:
    return re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_configuration_examples_load_without_warnings(
    page: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="uproxy")
    for block in _code_blocks(page.read_text()):
        if f"kind: {KIND}" in block:
            apply_config(yaml.safe_load(block), Settings())
    assert not caplog.records


def _uproxy_commands(page: Path) -> list[list[str]]:
    """Command lines in the page's code blocks that run uproxy."""
    commands = []
    for block in _code_blocks(page.read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line.split("#")[0]) if "uproxy" in line else []
            if words and (words[0] == "uproxy" or words[0].endswith("/uproxy")):
                commands.append(words)
    return commands


def test_the_docs_show_uproxy_commands() -> None:
    assert sum(len(_uproxy_commands(p)) for p in PAGES) >= 5


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_uproxy_commands_in_the_docs_use_real_flags(page: Path) -> None:
    options = {o for a in build_parser()._actions for o in a.option_strings}
    for words in _uproxy_commands(page):
        for word in words[1:]:
            if word.startswith("-"):
                assert word.partition("=")[0] in options, f"{page.name}: {shlex.join(words)}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page: Path) -> None:
    for target in re.findall(r"\]\(([^)#\s]+)\)", page.read_text()):
        if "://" in target:
            continue
        assert (page.parent / target).exists(), f"{page.name}: {target}"


def test_troubleshooting_shows_the_rules_uproxy_writes() -> None:
    """The example iptables-save lines are exactly what uproxy installs for that portal."""
    spn = ServicePortName("default", "my-svc", "http", Protocol.TCP)
    portal = Portal(spn, PortalKind.CLUSTER_IP, "10.96.12.34", 80, 41234)
    rules = build_rules([portal], host_ip="192.0.2.7", dial_mark=Settings().dial_mark)
    real = {line for lines in rules.save_lines("nat").values() for line in lines}
    text = (DOCS / "troubleshooting.md").read_text()
    shown = [line for line in text.splitlines() if line.startswith("-A ")]
    assert len(shown) == 5
    for line in shown:
        assert line in real, line


def test_install_page_states_what_the_manifests_say() -> None:
    text = (DOCS / "install.md").read_text()
    for file, name in INSTALLS.items():
        docs = load(DEPLOY / file)
        c = container(find(docs, "DaemonSet", name))
        for section in ("requests", "limits"):
            memory = c["resources"][section]["memory"].replace("Mi", " MiB")
            assert memory in text, (file, section, memory)
        assert f"requests {c['resources']['requests']['cpu']} CPU" in text
        config = yaml.safe_load(find(docs, "ConfigMap", name)["data"]["config.yaml"])
        for field in ("healthzBindAddress", "metricsBindAddress"):
            port = config[field].rpartition(":")[2]
            assert f":{port}`" in text, (file, field)
        assert f"deploy/{file}" in text and f"daemonset/{name}" in text
