"""Benchmarking: workload prompts (random, shared-prefix, ShareGPT, documents), the streaming
client, and pure summaries.

Typical use::

    tokenizer = load_tokenizer(model_dir)
    prompt_set = build_prompts(
        workload.dataset, tokenizer, n, workload.input_tokens, workload.seed, home, repeat=k
    )
    tracker.log_dataset(run_id, prompt_set)        # name, digest, source, profile
    result = await run_workload(None, base_url, model, api_key, workload, prompt_set.prompts)
    summary = summarize(result)          # summary.metrics() -> flat dict for MLflow
    frame = records_frame(result)        # one row per request, for parquet

The measurement rules each module follows are in its docstring; docs/measurement.md gathers them.
"""

from k3pipe.bench.client import WorkloadResult, run_workload
from k3pipe.bench.request_records import RequestRecord
from k3pipe.bench.summary import (
    LatencyStats,
    ThroughputCheck,
    WorkloadSummary,
    check_throughput,
    records_frame,
    summarize,
)
from k3pipe.prompts.corpora import PromptSet, build_prompts
from k3pipe.prompts.datasets import Prompt, load_tokenizer, random_prompts, shared_prefix_prompts

__all__ = [
    "LatencyStats",
    "Prompt",
    "PromptSet",
    "RequestRecord",
    "ThroughputCheck",
    "WorkloadResult",
    "WorkloadSummary",
    "build_prompts",
    "check_throughput",
    "load_tokenizer",
    "random_prompts",
    "records_frame",
    "run_workload",
    "shared_prefix_prompts",
    "summarize",
]
