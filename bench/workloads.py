"""The workloads, each one bounded run of a load generator returning raw figures.

- bulk TCP: iperf3, 1 and 4 streams (the receiver's byte count);
- new connection per request: wrk with ``Connection: close`` against the nginx backend;
- keep-alive latency at a fixed moderate rate: wrk paced by its Lua ``delay()`` hook (each of
  a few connections waits a fixed time between requests, so the offered rate does not depend
  on the peer, and latency is timed from the request's write);
- new connections at a fixed offered rate (``paced``): ``Connection: close`` with ``delay()``
  handing out request times from one schedule, so every peer gets the same number of
  connections per second however fast it could go. The proxy's CPU per connection depends on
  the rate (at a lower rate each wake-up handles fewer events), so costs are compared at an
  equal rate. wrk connects as soon as the previous response is in and waits before the
  request, so the schedule paces the requests and, one response later, the connections; a
  peer that cannot keep up slips (at most 20 ms is caught up), and its achieved rate shows it;
- UDP request/response: ``bench.udp load``.

wrk's own ``done()`` hook prints the figures as JSON, so no text scraping of its report.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.procs import CpuSet, run_pinned

Figures = dict[str, float]

WRK_DONE = """
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'BENCHJSON {"requests": %d, "duration_us": %d, "connect_errors": %d, "read_errors": %d, '
    .. '"write_errors": %d, "status_errors": %d, "timeouts": %d, "p50_us": %d, '
    .. '"p90_us": %d, "p99_us": %d, "p999_us": %d, "max_us": %d}\\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency:percentile(99.9), latency.max))
end
"""

WRK_ERRORS = ("connect_errors", "read_errors", "write_errors", "status_errors", "timeouts")

CONNECTION_CLOSE = 'wrk.headers["Connection"] = "close"\n'

# One schedule for every connection of the (single) wrk thread: each delay() call takes the
# next slot, 1/RATE after the previous one. wrk's delay is in whole milliseconds, hence the
# rounding; the clock is CLOCK_MONOTONIC through LuaJIT's ffi (wrk's Lua has no finer clock).
PACED = """
local ffi = require("ffi")
ffi.cdef[[
typedef struct { long tv_sec; long tv_nsec; } bench_timespec;
int clock_gettime(int clk, bench_timespec *ts);
]]
local ts = ffi.new("bench_timespec")
local function now_ms()
  ffi.C.clock_gettime(1, ts)
  return tonumber(ts.tv_sec) * 1000 + tonumber(ts.tv_nsec) / 1e6
end
local interval = 1000 / RATE
local slot = nil
function delay()
  local t = now_ms()
  if slot == nil then slot = t end
  slot = math.max(slot + interval, t - 20)
  local d = slot - t
  if d <= 0 then return 0 end
  return math.floor(d + 0.5)
end
"""


@dataclass(frozen=True, slots=True)
class Durations:
    """Seconds per measured run, per workload (iperf3 takes whole seconds)."""

    tcp: int
    http: float
    udp: float
    conn_connections: int = 16
    ka_connections: int = 4
    ka_delay_ms: int = 1
    # The connection run at a fixed offered rate: one every peer sustains at every scale
    # (kernel DNAT in a 10,000-rule iptables-nft chain tops out at 3,000-3,700/s here).
    paced_rate: int = 2000
    paced_connections: int = 32


class WorkloadError(RuntimeError):
    pass


def write_scripts(workdir: Path, d: Durations) -> dict[str, Path]:
    scripts = {
        "conn": CONNECTION_CLOSE + WRK_DONE,
        "keepalive": f"function delay() return {d.ka_delay_ms} end\n" + WRK_DONE,
        "paced": PACED.replace("RATE", str(d.paced_rate)) + CONNECTION_CLOSE + WRK_DONE,
    }
    out = {}
    for name, text in scripts.items():
        path = workdir / f"wrk-{name}.lua"
        path.write_text(text)
        out[name] = path
    return out


def iperf(
    port: int, *, streams: int, seconds: int, core: CpuSet, host: str = "127.0.0.1"
) -> Figures:
    argv = ["iperf3", "-c", host, "-p", str(port), "-t", str(seconds), "-P", str(streams)]
    argv += ["-J", "--connect-timeout", "3000"]
    res = run_pinned(argv, core=core, timeout_s=seconds + 20)
    try:
        data: dict[str, Any] = json.loads(res.stdout)
    except json.JSONDecodeError as e:
        raise WorkloadError(f"iperf3 gave no JSON: {res.stderr.strip()[:200]}") from e
    if "error" in data:
        raise WorkloadError(f"iperf3: {data['error']}")
    recv = data["end"]["sum_received"]
    return {
        "gbps": float(recv["bits_per_second"]) / 1e9,
        "bytes": float(recv["bytes"]),
        "seconds": float(recv["seconds"]),
    }


def wrk(
    port: int,
    *,
    script: Path,
    connections: int,
    seconds: float,
    core: CpuSet,
    host: str = "127.0.0.1",
) -> Figures:
    argv = ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--timeout", "2s"]
    argv += ["-s", str(script), f"http://{host}:{port}/"]
    res = run_pinned(argv, core=core, timeout_s=seconds + 20)
    for line in res.stdout.splitlines():
        if line.startswith("BENCHJSON "):
            raw = json.loads(line.removeprefix("BENCHJSON "))
            secs = raw["duration_us"] / 1e6
            errors = sum(raw[k] for k in WRK_ERRORS)
            kinds = {f"wrk_{k}": float(raw[k]) for k in WRK_ERRORS if raw[k]}
            return kinds | {
                "requests": float(raw["requests"]),
                "rate": raw["requests"] / secs if secs > 0 else 0.0,
                "errors": float(errors),
                "p50_ms": raw["p50_us"] / 1e3,
                "p90_ms": raw["p90_us"] / 1e3,
                "p99_ms": raw["p99_us"] / 1e3,
                "p999_ms": raw["p999_us"] / 1e3,
                "max_ms": raw["max_us"] / 1e3,
            }
    raise WorkloadError(f"wrk gave no result: {(res.stderr or res.stdout).strip()[:200]}")


def udp(port: int, *, seconds: float, core: CpuSet) -> Figures:
    argv = [sys.executable, "-m", "bench.udp", "load", "--port", str(port)]
    argv += ["--seconds", str(seconds), "--sockets", "16"]
    res = run_pinned(argv, core=core, timeout_s=seconds + 20)
    try:
        raw: dict[str, float] = json.loads(res.stdout)
    except json.JSONDecodeError as e:
        raise WorkloadError(f"udp load gave no JSON: {res.stderr.strip()[:200]}") from e
    if not raw["replies"]:
        # Nothing came back: no latency or rate was measured, whatever the figures would say.
        raise WorkloadError(
            f"no UDP reply in {raw['seconds']:.1f} s (lost {raw['lost']:.0f}, bad {raw['bad']:.0f})"
        )
    return {
        "rate": raw["rate"],
        "seconds": raw["seconds"],
        "errors": raw["bad"],
        "lost": raw["lost"],
        "p50_ms": raw["p50_us"] / 1e3,
        "p99_ms": raw["p99_us"] / 1e3,
    }
