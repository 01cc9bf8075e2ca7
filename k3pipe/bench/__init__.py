"""Benchmarking: exact-length random prompts, the streaming client, and pure summaries.

Typical use::

    prompts = random_prompts(load_tokenizer(model_dir), n, workload.input_tokens, workload.seed)
    result = await run_workload(client, base_url, model, api_key, workload, prompts)
    summary = summarize(result)          # summary.metrics() -> flat dict for MLflow
    frame = records_frame(result)        # one row per request, for parquet

The measurement rules each module follows are in its docstring.
"""

from k3pipe.bench.client import RequestRecord, WorkloadResult, run_workload
from k3pipe.bench.datasets import Prompt, load_tokenizer, random_prompts
from k3pipe.bench.summary import (
    LatencyStats,
    ThroughputCheck,
    WorkloadSummary,
    check_throughput,
    records_frame,
    summarize,
)

__all__ = [
    "LatencyStats",
    "Prompt",
    "RequestRecord",
    "ThroughputCheck",
    "WorkloadResult",
    "WorkloadSummary",
    "check_throughput",
    "load_tokenizer",
    "random_prompts",
    "records_frame",
    "run_workload",
    "summarize",
]
