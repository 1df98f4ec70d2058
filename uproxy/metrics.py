"""Every metric uproxy exports, defined in one place.

Control-plane metrics keep kube-proxy's names and meaning so existing dashboards work;
data-plane metrics are ``uproxy_*``. Labels are service ports, protocols and outcomes,
never client or endpoint addresses (unbounded cardinality). The data path binds its
label children once per listener (``.labels(...)`` is a dict lookup plus a lock) and
counts per read, never per byte.
"""

from __future__ import annotations

import platform

from prometheus_client import Counter, Gauge, Histogram, Info

from uproxy import __version__

# Buckets as kube-proxy's: exponential from 1 ms.
_SYNC_BUCKETS = tuple(0.001 * 2**i for i in range(15))
_PROGRAMMING_BUCKETS = tuple(
    [0.25 * i for i in range(1, 20)]
    + [5.0 * i for i in range(1, 60)]
    + [300.0 * i for i in range(1, 13)]
)
_DIAL_BUCKETS = (
    0.0002,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.0,
    4.0,
)

# --- control plane (kube-proxy's names) ---
SYNC_DURATION = Histogram(
    "kubeproxy_sync_proxy_rules_duration_seconds",
    "SyncProxyRules latency in seconds",
    buckets=_SYNC_BUCKETS,
)
SYNC_LAST_TIMESTAMP = Gauge(
    "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
    "The last time proxy rules were successfully synced",
)
SYNC_LAST_QUEUED_TIMESTAMP = Gauge(
    "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
    "The last time a sync of proxy rules was queued",
)
NETWORK_PROGRAMMING_DURATION = Histogram(
    "kubeproxy_network_programming_duration_seconds",
    "In Cluster Network Programming Latency in seconds",
    buckets=_PROGRAMMING_BUCKETS,
)
SERVICE_CHANGES_TOTAL = Counter(
    "kubeproxy_sync_proxy_rules_service_changes_total",
    "Cumulative proxy rules Service changes",
)
SERVICE_CHANGES_PENDING = Gauge(
    "kubeproxy_sync_proxy_rules_service_changes_pending",
    "Pending proxy rules Service changes",
)
ENDPOINT_CHANGES_TOTAL = Counter(
    "kubeproxy_sync_proxy_rules_endpoint_changes_total",
    "Cumulative proxy rules Endpoint changes",
)
ENDPOINT_CHANGES_PENDING = Gauge(
    "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
    "Pending proxy rules Endpoint changes",
)
HEALTHZ_TOTAL = Counter(
    "kubeproxy_proxy_healthz_total", "Cumulative proxy healthz HTTP status", ["code"]
)
LIVEZ_TOTAL = Counter("kubeproxy_proxy_livez_total", "Cumulative proxy livez HTTP status", ["code"])

# --- data plane ---
CONNECTIONS = Counter(
    "uproxy_connections_total",
    "Connections (TCP) and flows (UDP) accepted, by outcome",
    ["service", "protocol", "result"],
)
OPEN_CONNECTIONS = Gauge(
    "uproxy_open_connections",
    "Connections (TCP) currently relayed",
    ["service", "protocol"],
)
BYTES = Counter(
    "uproxy_bytes_total",
    "Bytes relayed; direction is to_endpoint or to_client",
    ["service", "direction"],
)
DIAL_ATTEMPTS = Counter(
    "uproxy_endpoint_dial_attempts_total",
    "Attempts to connect to an endpoint, by result",
    ["result"],
)
DIAL_DURATION = Histogram(
    "uproxy_endpoint_dial_duration_seconds",
    "Time to connect to an endpoint (successful attempts)",
    buckets=_DIAL_BUCKETS,
)
UDP_FLOWS = Gauge("uproxy_udp_flows", "UDP flows currently tracked", ["service"])
ACCEPT_PAUSED = Counter(
    "uproxy_accept_paused_total",
    "Times accepting was paused, by reason (emfile, enfile, enobufs)",
    ["reason"],
)
NO_ENDPOINTS = Counter(
    "uproxy_no_endpoints_total",
    "Connections or datagrams refused for lack of a usable endpoint",
    ["service", "traffic"],
)
BUILD_INFO = Info("uproxy_build", "uproxy build information")
BUILD_INFO.info({"version": __version__, "python": platform.python_version()})
