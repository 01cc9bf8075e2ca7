"""How late k3pipe's trace replay sends (issue 49): the sender's lag, the send time minus the time the
request could have gone, at 10, 100 and 500 requests per second, against the exact server
(k3pipe/testing/exact_server.py: its own process, answering every stream on a fixed schedule, 20 ms
to the first token and 10 ms between tokens).

Each rate replays a trace of Poisson arrivals (seeded) for ``--seconds`` seconds, no sessions (open
loop: the lag is the client's alone), 32-token prompts and 8-token answers, through
``k3pipe.bench.client.replay_trace`` (the same transport and records as every workload). Printed: the
lag's p50, p99 and max, and the share of requests more than 10 ms late. The issue's bar: p99 at most
10 ms at 100 requests per second.

The peer (AIPerf 0.13 or guidellm 0.8 replaying the same trace, both on this machine's package
index) is not run yet: the next step of issue 49.

Run: ``.venv/bin/python benchmarks/trace_lag.py [--rates 10 100 500] [--seconds 10] [--json FILE]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

import k3pipe.testing
from k3pipe.bench.client import replay_trace
from k3pipe.prompts.datasets import Prompt
from k3pipe.schema.specs import WorkloadSpec
from k3pipe.schema.traces import Trace, TraceRequest

SERVER = Path(k3pipe.testing.__file__).with_name("exact_server.py")


def poisson_trace(rate: float, seconds: float, seed: int) -> Trace:
    rng = random.Random(seed)
    t, requests = 0.0, []
    while t < seconds:
        requests.append(TraceRequest(round(t, 6), 32, 8))
        t += rng.expovariate(rate)
    return Trace(tuple(requests), block_tokens=16, source=f"poisson rate={rate} seed={seed}")


def measure(base_url: str, rate: float, seconds: float) -> dict[str, Any]:
    trace = poisson_trace(rate, seconds, seed=int(rate))
    prompts = [Prompt(text=f"request {i} " + "word " * 30, tokens=32) for i in range(len(trace.requests))]
    workload = WorkloadSpec.model_validate(
        {"name": "lag", "input_tokens": 32, "output_tokens": 8, "concurrency": 1, "num_requests": 1}
    )
    outcome, records, _ = asyncio.run(replay_trace(base_url, "exact", None, workload, trace, prompts))
    lags = np.array([r.lag_s for r in outcome.records if r.lag_s is not None]) * 1000.0
    failed = sum(1 for r in records if r.error is not None)
    return {
        "rate_per_s": rate,
        "requests": len(trace.requests),
        "failed": failed,
        "lag_ms_p50": float(np.quantile(lags, 0.5)),
        "lag_ms_p99": float(np.quantile(lags, 0.99)),
        "lag_ms_max": float(lags.max()),
        "late_over_10ms_pct": float(100.0 * (lags > 10.0).mean()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[10.0, 100.0, 500.0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    server = subprocess.Popen(
        [sys.executable, str(SERVER), "--port", "0", "--model", "exact"],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert server.stdout is not None
        port = json.loads(server.stdout.readline())["port"]
        base_url = f"http://127.0.0.1:{port}/v1"
        rows = [measure(base_url, rate, args.seconds) for rate in args.rates]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=10)
    heads = ("rate/s", 7), ("requests", 8), ("failed", 6), ("lag p50 ms", 10), ("p99 ms", 7), ("max ms", 7)
    print(" ".join(f"{h:>{w}}" for h, w in heads), f"{'>10 ms':>7}")
    for r in rows:
        print(
            f"{r['rate_per_s']:>7g} {r['requests']:>8} {r['failed']:>6} {r['lag_ms_p50']:>10.2f} "
            f"{r['lag_ms_p99']:>7.2f} {r['lag_ms_max']:>7.2f} {r['late_over_10ms_pct']:>6.1f}%"
        )
    if args.json:
        args.json.write_text(json.dumps({"cpu_count": os.cpu_count(), "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
