"""A peer gone without a word (powered off, cut off) ends its relayed connection on both sides.

A pod holds an idle connection to a ClusterIP; then either the endpoint or the pod stops
answering, every packet to it dropped, so that neither a FIN nor a RST ever comes. uproxy's
TCP keep-alive probes (``--tcp-keepalive 1s``, two probes in the node's namespace) go
unanswered, the kernel gives the socket up, and uproxy resets the other side: the pod's
connection, or the endpoint's; ``uproxy_connection_errors_total`` says which side timed out. Without keep-alive both stay established for as long as
anyone waits (kube-proxy's userspace mode had Go's 15 s keep-alive on both sides).
"""

from __future__ import annotations

import select
import sys
import time

import pytest

from tests.conftest import wait_for_sync
from tests.e2e.cluster import Cluster
from tests.e2e.conftest import StartProc, StartUproxy
from tests.e2e.harness import Proc, ServicesFile
from tests.e2e.manifests import SUM_IP, SUM_PORT, backend_argv, sum_service

pytestmark = [pytest.mark.root]

# Connects, sends 1,000 bytes (the sum backend reads until EOF, so it stays silent), says
# "ready", then waits for the connection's end and names it.
CLIENT = """
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
s.sendall(bytes(1000))
s.settimeout(None)
print("ready", flush=True)
try:
    print("eof" if not s.recv(1) else "data", flush=True)
except OSError as e:
    print(type(e).__name__, flush=True)
"""

# Drops every TCP packet of the cut-off peer's connection, in its own namespace.
CUT = """
table inet cut {
    chain in {
        type filter hook input priority -300; policy accept;
        tcp %s 9000 drop
    }
}
"""


def next_line(proc: Proc, timeout: float) -> str:
    """The next stdout line of ``proc`` within ``timeout`` seconds ("" if none came)."""
    out = proc.popen.stdout
    assert out is not None
    readable, _, _ = select.select([out], [], [], timeout)
    return out.readline().strip() if readable else ""


def established_at_backend(net: Cluster) -> int:
    """Established connections to the sum backends' port, as the backend's kernel has them."""
    out = net.topo.run(
        net.topo.backend, "ss", "-Htn", "state", "established", f"( sport = :{SUM_PORT} )"
    )
    return len(out.splitlines())


@pytest.mark.parametrize("gone", ["endpoint", "client"])
def test_a_silent_peer_is_found_and_the_other_side_reset(
    net: Cluster,
    services: ServicesFile,
    start_proc: StartProc,
    start_uproxy: StartUproxy,
    gone: str,
) -> None:
    topo = net.topo
    start_proc(topo.backend, backend_argv(net), ready_line=True)
    services.put(*sum_service(net))
    services.write()
    # Two unanswered probes, a second apart, after a second of silence: about 3 s.
    topo.run(topo.node, "sysctl", "-qw", "net.ipv4.tcp_keepalive_probes=2")
    proxy = start_uproxy("auto", extra=["--tcp-keepalive", "1s"])
    proxy.wait_synced()

    client = start_proc(topo.pod, [sys.executable, "-c", CLIENT, SUM_IP, "9000"])
    assert next_line(client, 10) == "ready", client.stderr_lines
    wait_for_sync(
        lambda: established_at_backend(net) == 1, timeout=5, message="the endpoint's side"
    )
    if gone == "endpoint":
        # The endpoint's namespace drops what uproxy sends it: uproxy resets the pod.
        topo.run(topo.backend, "nft", "-f", "-", stdin=CUT % "dport")
        started = time.monotonic()
        assert next_line(client, 20) == "ConnectionResetError"
        # Not at once: the second unanswered probe goes out a probe interval after the
        # first (the reset is the probes', not anything else's).
        assert time.monotonic() - started >= 0.9
    else:
        # The pod's namespace drops what comes back from the ClusterIP: uproxy resets the
        # endpoint's side, which its kernel then forgets.
        topo.run(topo.pod, "nft", "-f", "-", stdin=CUT % "sport")
        started = time.monotonic()
        wait_for_sync(
            lambda: established_at_backend(net) == 0,
            timeout=20,
            message="the endpoint's side reset",
        )
        assert time.monotonic() - started >= 0.9
        assert next_line(client, 0) == ""  # the pod heard nothing: its packets are dropped
    # Counted as what it was: that side's probes went unanswered.
    errors = {
        labels: value
        for (name, labels), value in proxy.metrics().items()
        if name == "uproxy_connection_errors_total"
    }
    assert errors == {(("error", "timeout"), ("service", "default/sum:raw"), ("side", gone)): 1.0}
