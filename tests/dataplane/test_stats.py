"""A proxy port's tallies are bound at its first count, and they are the series the control
process writes at zero until then: the two lists must be the same, or a scrape would show a
series at zero that never moves, or lose one at the first connection."""

from __future__ import annotations

import subprocess
import sys

import pytest

from uproxy import metrics
from uproxy.dataplane.stats import Stats
from uproxy.model import Protocol, ServicePortName, Traffic


def _bound_of(service: str) -> set[tuple[str, tuple[str, ...]]]:
    return {
        (fam.name, values)
        for fam in metrics.DATA_PLANE
        if isinstance(fam, metrics.LabelledFamily)
        for values, _ in fam.series()
        if values[:1] == (service,)
    }


@pytest.mark.parametrize("protocol", list(Protocol))
def test_bind_binds_exactly_the_series_a_proxied_port_always_has(protocol: Protocol) -> None:
    name = ServicePortName("test", f"stats-{protocol.value.lower()}", "p", protocol)
    service = str(name)
    try:
        stats = Stats(name, Traffic.CLUSTER)
        assert not stats.bound and _bound_of(service) == set()  # opening binds nothing
        stats.bind()
        always = {
            (fam.name, values)
            for fam in metrics.DATA_PLANE
            if isinstance(fam, metrics.LabelledFamily) and fam.per_port is not None
            for values in fam.per_port(service, protocol.value)
        }
        assert len(always) == 4
        assert _bound_of(service) == always
        # The failure tallies come at their first event, and are sparse (not in ``always``).
        stats.refused.value += 1
        stats.no_endpoints.value += 1
        stats.dial_failed.value += 1
        assert _bound_of(service) - always == {
            ("uproxy_connections_total", (service, protocol.value, "no_endpoints")),
            ("uproxy_connections_total", (service, protocol.value, "dial_failed")),
            ("uproxy_no_endpoints_total", (service, "cluster")),
        }
    finally:
        metrics.forget_service(service)
    assert _bound_of(service) == set()


def test_a_worker_counts_without_loading_prometheus_client() -> None:
    # A worker's modules, as it imports them: the control process's metrics library (and the
    # HTTP modules it brings, 4 MiB of a worker) must stay out of every worker.
    code = (
        "import sys\n"
        "import uproxy.dataplane.worker, uproxy.dataplane.tcp, uproxy.dataplane.udp\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('prometheus_client', 'http')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
