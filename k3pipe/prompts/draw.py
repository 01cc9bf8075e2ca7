"""A workload's prompts, drawn from its dataset before any engine starts (one set per repeat)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

from tokenizers import Tokenizer

from k3pipe.core.errors import BenchmarkError, SpecError
from k3pipe.prompts.corpora import PromptSet, build_prompts
from k3pipe.prompts.datasets import load_tokenizer
from k3pipe.schema.specs import WorkloadSpec

__all__ = ["prepare_prompts", "workload_prompts"]

Progress = Callable[[str], None]


def workload_prompts(
    workload: WorkloadSpec, tokenizer: Tokenizer, repeat: int, home: Path, progress: Progress | None = None
) -> PromptSet:
    """The prompts of repeat ``repeat`` of a workload (warm-up ones first), from its dataset.

    Raises:
        BenchmarkError: the dataset cannot give them; the message names the workload.
    """
    if not 0 <= repeat < workload.repeats:
        raise SpecError(
            f"workload {workload.name!r}: repeat {repeat} is outside 0..{workload.repeats - 1} (repeats)"
        )
    t0 = time.perf_counter()
    try:
        prompts = build_prompts(
            workload.dataset,
            tokenizer,
            workload.warmup_requests + workload.num_requests,
            workload.input_tokens,
            workload.seed,
            home,
            repeat=repeat,
        )
    except BenchmarkError as exc:
        where = f" (repeat {repeat + 1} of {workload.repeats})" if workload.repeats > 1 else ""
        raise BenchmarkError(f"workload {workload.name!r}{where}: {exc}") from exc
    if progress:
        progress(
            f"{workload.name}: {len(prompts.prompts)} prompts from {prompts.name} "
            f"(digest {prompts.digest}) in {time.perf_counter() - t0:.2f} s"
        )
    return prompts


def prepare_prompts(
    workloads: Sequence[WorkloadSpec], model_dir: Path, home: Path, progress: Progress | None = None
) -> dict[str, list[PromptSet]]:
    """Every workload's prompts, one set per repeat, before any engine starts: a dataset that cannot
    give them fails here, not after a cold start, and every arm gets the same prompts."""
    tokenizer = load_tokenizer(model_dir)
    return {
        w.name: [workload_prompts(w, tokenizer, k, home, progress) for k in range(w.repeats)]
        for w in workloads
    }
