"""A workload's prompts, drawn from its dataset before any engine starts (one set per repeat)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

from tokenizers import Tokenizer

from k3pipe.core.errors import BenchmarkError, SpecError
from k3pipe.prompts.chat_template import TemplateCost, template_cost
from k3pipe.prompts.corpora import PromptSet, build_prompts
from k3pipe.prompts.corpus_tools import _digest, _profile
from k3pipe.prompts.datasets import load_tokenizer
from k3pipe.prompts.trace_prompts import replay_prompts
from k3pipe.schema.specs import WorkloadSpec

__all__ = ["prepare_prompts", "workload_prompts"]

Progress = Callable[[str], None]


def workload_prompts(
    workload: WorkloadSpec,
    tokenizer: Tokenizer,
    repeat: int,
    home: Path,
    progress: Progress | None = None,
    model_dir: Path | None = None,
) -> PromptSet:
    """The prompts of repeat ``repeat`` of a workload (warm-up ones first), from its dataset; a trace's
    (:func:`trace_prompt_set`) less what ``model_dir``'s chat template adds, under the chat API.

    Raises:
        BenchmarkError: the dataset cannot give them; the message names the workload.
    """
    if not 0 <= repeat < workload.repeats:
        raise SpecError(
            f"workload {workload.name!r}: repeat {repeat} is outside 0..{workload.repeats - 1} (repeats)"
        )
    t0 = time.perf_counter()
    try:
        if workload.trace is not None:
            prompts = trace_prompt_set(workload, tokenizer, repeat, model_dir)
        else:
            prompts = build_prompts(
                workload.dataset,
                tokenizer,
                workload.warmup_requests + workload.num_requests,
                workload.input_tokens,
                workload.seed,
                home,
                repeat=repeat,
            )
    except (BenchmarkError, SpecError) as exc:
        where = f" (repeat {repeat + 1} of {workload.repeats})" if workload.repeats > 1 else ""
        raise BenchmarkError(f"workload {workload.name!r}{where}: {exc}") from exc
    if progress:
        progress(
            f"{workload.name}: {len(prompts.prompts)} prompts from {prompts.name} "
            f"(digest {prompts.digest}) in {time.perf_counter() - t0:.2f} s"
        )
    return prompts


def trace_prompt_set(
    workload: WorkloadSpec, tokenizer: Tokenizer, repeat: int, model_dir: Path | None
) -> PromptSet:
    """Repeat ``repeat`` of a trace workload's prompts (seed ``seed + repeat``: each repeat's texts
    its own, so no repeat is answered from another's cache): :func:`replay_prompts` with the chat
    template's cost when the workload uses the chat API (none without ``model_dir``). Its profile
    holds the trace's digest and the template's cost."""
    assert workload.trace is not None
    trace = workload.loaded_trace()
    cost = (
        template_cost(model_dir, tokenizer)
        if workload.api == "chat" and model_dir is not None
        else TemplateCost(0, 0, "none")
    )
    at = workload.seed + repeat
    thread = workload.trace.thread_answers
    prompts = replay_prompts(
        trace, tokenizer, at, template_first=cost.first, template_turn=cost.turn, thread=thread
    )
    extra = {
        "trace": workload.trace.path,
        "trace_digest": trace.digest,
        "trace_requests": len(trace.requests),
        "template_first_tokens": cost.first,
        "template_turn_tokens": cost.turn,
        "template": cost.template,
        "threaded": thread,
    }
    name = f"trace:{Path(workload.trace.path).name}-{trace.digest}-s{at}"
    return PromptSet(
        name=name,
        digest=_digest(prompts),
        source=str(workload.trace.file()),
        source_type="local",
        profile=_profile("trace", prompts, at, repeat, extra),
        prompts=prompts,
    )


def prepare_prompts(
    workloads: Sequence[WorkloadSpec], model_dir: Path, home: Path, progress: Progress | None = None
) -> dict[str, list[PromptSet]]:
    """Every workload's prompts, one set per repeat, before any engine starts: a dataset that cannot
    give them fails here, not after a cold start, and every arm gets the same prompts."""
    tokenizer = load_tokenizer(model_dir)
    return {
        w.name: [workload_prompts(w, tokenizer, k, home, progress, model_dir) for k in range(w.repeats)]
        for w in workloads
    }
