"""kubernetes_asyncio's packages imported with their ``__init__`` deferred (uproxy.sources.kubeclient).

The test process imports kubernetes_asyncio whole before uproxy (the API-server double and the
fixtures use it), so the deferral is only ever seen in a fresh interpreter: each test runs one.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from collections.abc import Awaitable, Callable
from pathlib import Path

from tests.apiserver import ApiServerDouble
from tests.conftest import wait_for
from tests.k8s.helpers import Backends, Client, endpoint_slice, free_port, service

SVC, EPS = "Service", "EndpointSlice"


def _python(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_uproxy_imports_no_model_and_the_rest_of_the_library_still_loads_on_demand() -> None:
    out = _python(
        """
        import sys
        from uproxy.sources import kube, kubeclient
        loaded = [m for m in sys.modules if m.startswith("kubernetes_asyncio")]
        print(kubeclient.deferred, len(loaded))
        print(any(".models." in m for m in loaded), any(".apps_v1_api" in m for m in loaded))
        # Anything else of the library, asked for later, is there as packaged.
        import kubernetes_asyncio
        from kubernetes_asyncio import client, watch
        from kubernetes_asyncio.client import AppsV1Api, V1Service
        pod = client.V1Pod(metadata=client.V1ObjectMeta(name="p"))
        print(pod.metadata.name, V1Service.__name__, AppsV1Api.__name__)
        print(kubernetes_asyncio.__version__ == kubernetes_asyncio.client.__version__)
        print(watch.Watch.__name__, client.ApiClient is kube.ApiClient)
        print(kubernetes_asyncio.client.models.V1Node.__name__)
        """
    )
    lines = out.splitlines()
    deferred, count = lines[0].split()
    assert deferred == "True"
    assert int(count) < 100  # of about 850 as packaged
    assert lines[1] == "False False"
    assert lines[2:] == ["p V1Service AppsV1Api", "True", "Watch True", "V1Node"]


def test_nothing_is_deferred_when_the_library_was_imported_first() -> None:
    out = _python(
        """
        import sys
        import kubernetes_asyncio
        from uproxy.sources import kubeclient
        from kubernetes_asyncio.client import CoreV1Api
        print(kubeclient.deferred, kubeclient.CoreV1Api is CoreV1Api)
        print("kubernetes_asyncio.client.models.v1_pod" in sys.modules)
        """
    )
    assert out.splitlines() == ["False True", "True"]


async def test_uproxy_with_deferred_packages_relays_a_service_from_the_api_server(
    tmp_path: Path,
) -> None:
    """The command as run on a laptop against a cluster, where the packages are deferred (the
    first test shows it happens on import): it lists, watches and relays real bytes."""
    backends = Backends(free_port())
    await backends.add("127.0.0.2")
    async with ApiServerDouble() as api:
        port = free_port()
        api.create(SVC, service("web", port=port))
        api.create(
            EPS, endpoint_slice("web-1", service_name="web", ips=["127.0.0.2"], port=backends.port)
        )
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        argv = [
            sys.executable, "-m", "uproxy.cli", "--kubeconfig", str(kubeconfig),
            "--rules", "none", "--hostname-override", "node-a",
            "--healthz-bind-address", "", "--metrics-bind-address", "",
        ]  # fmt: skip
        proc = await asyncio.create_subprocess_exec(*argv, stderr=asyncio.subprocess.PIPE)
        try:
            await wait_for(_served_by(port, "127.0.0.2"), timeout=20, message="127.0.0.2")
            # A change after the start still arrives (the watch runs on the deferred client).
            api.update(
                EPS,
                endpoint_slice("web-1", service_name="web", ips=["127.0.0.3"], port=backends.port),
            )
            await backends.add("127.0.0.3")
            await wait_for(_served_by(port, "127.0.0.3"), timeout=10, message="127.0.0.3")
        finally:
            proc.terminate()
            _, err = await asyncio.wait_for(proc.communicate(), 15)
            await backends.close()
        assert b"Traceback" not in err, err.decode()


def _served_by(port: int, backend: str) -> Callable[[], Awaitable[bool]]:
    """Whether a connection through uproxy's port reaches ``backend`` and carries 256 KiB
    both ways intact (``Client.round_trip`` checks length and sha256)."""

    async def check() -> bool:
        try:
            c = await Client.connect(port, timeout=2)
        except (OSError, TimeoutError):
            return False  # not serving yet
        try:
            if c.backend != backend:
                return False
            await c.round_trip(256 * 1024, timeout=10)
            return True
        finally:
            await c.close()

    return check
