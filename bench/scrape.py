"""Scrape a /metrics endpoint on a fixed interval, as Prometheus would, and time each scrape.

The deployed-path part runs this in the node namespace during a latency run: a node's
kube-proxy is scraped all the time, and rendering metrics for 10,000 service ports is CPU on
the node's cores beside the relays. Each scrape is one ``curl`` (what an operator would type),
without ``Accept-Encoding: gzip``: Prometheus asks for gzip and gets a body several times
smaller for a little more CPU in uproxy; the plain body is what this measures. A scrape
starts on the interval's tick; like Prometheus, a scrape that overruns its interval delays
the next one rather than overlapping it. Bounded in count and in time per scrape; the result
is JSON.

    python -m bench.scrape --url http://127.0.0.1:10249/metrics --seconds 3 --out FILE
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MAX_TIME_S = 10.0


def scrape(url: str, *, seconds: float, interval: float) -> dict[str, Any]:
    count = max(1, math.ceil(seconds / interval))
    start = time.monotonic()
    scrapes: list[dict[str, float]] = []
    for i in range(count):
        tick = start + i * interval
        now = time.monotonic()
        if now < tick:
            time.sleep(tick - now)
        t0 = time.monotonic()
        argv = ["curl", "-s", "-o", "/dev/null", "--max-time", str(MAX_TIME_S)]
        argv += ["-w", "%{http_code} %{size_download}", url]
        try:
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=MAX_TIME_S + 5, check=False
            )
            code, size = ([*done.stdout.split(), "0", "0"])[:2]
        except subprocess.TimeoutExpired:
            code, size = "0", "0"
        scrapes.append({"s": time.monotonic() - t0, "status": float(code), "bytes": float(size)})
    ok = [s for s in scrapes if s["status"] == 200]
    return {
        "count": len(scrapes),
        "ok": len(ok),
        "seconds": [s["s"] for s in scrapes],
        "bytes": max((s["bytes"] for s in ok), default=0.0),
    }


def main() -> int:
    # No docstring under PYTHONOPTIMIZE=2, which the bench sets for its children.
    p = argparse.ArgumentParser(
        prog="python -m bench.scrape", description=(__doc__ or "").partition("\n")[0]
    )
    p.add_argument("--url", required=True)
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--interval", type=float, default=1.0)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    result = scrape(args.url, seconds=args.seconds, interval=args.interval)
    args.out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
