"""The --config file is watched, as kube-proxy watches its own: when its content changes,
uproxy stops (draining) with a line saying why, so that the kubelet starts it again with the
new file. A ConfigMap volume updates by swapping its ``..data`` link to a new directory;
that is what these tests do, with real uproxy processes."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.factories import one_service_file
from tests.integration.procs import children
from uproxy.configfile import load_config, watch_config
from uproxy.settings import Settings

CONFIG = """apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
udpIdleTimeout: {timeout}
"""


class ConfigMapVolume:
    """A directory laid out as the kubelet lays out a ConfigMap volume: ``config.conf`` is a
    link to ``..data/config.conf``, and ``..data`` a link to the current version's directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.versions = 0
        self.path = root / "config.conf"

    def publish(self, text: str) -> None:
        self.versions += 1
        version = self.root / f"..v{self.versions}"
        version.mkdir()
        (version / "config.conf").write_text(text)
        tmp = self.root / "..data_tmp"
        tmp.symlink_to(version.name)
        os.replace(tmp, self.root / "..data")  # atomic, as the kubelet swaps it
        if not self.path.is_symlink():
            self.path.symlink_to("..data/config.conf")


async def test_watch_returns_on_new_content_only(tmp_path: Path) -> None:
    volume = ConfigMapVolume(tmp_path)
    volume.publish(CONFIG.format(timeout="1s"))
    settings = load_config(str(volume.path), Settings())
    assert settings.udp_timeout == 1.0  # a field uproxy reads, not one it would warn about
    watch = asyncio.create_task(
        watch_config(str(volume.path), settings.config_digest, interval_s=0.01)
    )
    try:
        # The same content in a new version (a ConfigMap edit of another key): no change.
        volume.publish(CONFIG.format(timeout="1s"))
        # Gone for a while (read fails): not a new configuration either.
        (tmp_path / f"..v{volume.versions}" / "config.conf").unlink()
        done, _ = await asyncio.wait({watch}, timeout=0.3)
        assert not done
        volume.publish(CONFIG.format(timeout="2s"))
        await asyncio.wait_for(watch, 5)
    finally:
        watch.cancel()


def test_uproxy_stops_when_its_config_file_changes(tmp_path: Path) -> None:
    volume = ConfigMapVolume(tmp_path / "config")
    volume.root.mkdir()
    volume.publish(CONFIG.format(timeout="1s"))
    one_service_file(tmp_path / "services.yaml", "127.0.0.1", 9)
    argv = [sys.executable, "-m", "uproxy.cli", "--config", str(volume.path)]
    argv += ["--services", str(tmp_path / "services.yaml"), "--rules", "none", "--workers", "1"]
    argv += ["--healthz-bind-address", "", "--metrics-bind-address", ""]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while not children(proc.pid):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no worker within 20 s"
            time.sleep(0.05)
        worker = children(proc.pid)[0]
        volume.publish(CONFIG.format(timeout="1s"))  # same content: keeps running
        still = time.monotonic() + 1.5  # more than one poll of the file
        while time.monotonic() < still:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        volume.publish(CONFIG.format(timeout="3s"))
        _, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, err
    assert '"Configuration file changed: stopping, to start again with it"' in err
    assert err.rstrip().endswith(
        f"uproxy: error: the content of --config {volume.path} changed: start uproxy again "
        "to use it"
    ), err
    deadline = time.monotonic() + 5
    while Path(f"/proc/{worker}").exists():  # its worker went with it
        assert time.monotonic() < deadline, "the worker outlived uproxy"
        time.sleep(0.05)
