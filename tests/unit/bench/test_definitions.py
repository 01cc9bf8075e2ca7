"""The measurement definitions of docs/measurement.md, held against streams whose true values are known.

Two kinds of ground truth:

- the scripted vLLM-style server (``k3pipe/testing/scripted_openai.py``, in this process): it stamps
  every chunk with ``perf_counter`` as it hands it to the transport, so the true TTFT, E2E, TPOT and
  ITL of each request follow from its stamps and the scripted token counts; the client's figures must
  match them within the delivery slack of a loaded 2-core machine;
- hand-written SSE streams through ``httpx.MockTransport``, for the shapes the scripted server does
  not produce (tool calls, keep-alive comments, chunks without new tokens).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path

import httpx
import numpy as np
import pytest

from k3pipe.bench import Prompt, RequestRecord, WorkloadResult, run_workload, summarize
from k3pipe.bench.shards import run_sharded
from k3pipe.bench.summary import WorkloadSummary, records_frame, retokenize, timing_note
from k3pipe.schema.specs import SLOSpec, WorkloadSpec
from k3pipe.testing.scripted_openai import Received, Script, ScriptedOpenAI

pytestmark = pytest.mark.serial

# Delivery slack per figure (seconds): the scripted delays are 10x larger than this.
SLACK_S = 0.03


def workload(**overrides: object) -> WorkloadSpec:
    fields: dict[str, object] = {"name": "w", "input_tokens": 3, "output_tokens": 8, "num_requests": 1}
    fields.update(overrides)
    return WorkloadSpec.model_validate(fields)


_PROCESSES = [1]
"""Client processes of :func:`run` (the ``client_processes`` fixture sets it)."""


# two client processes (~1 s each to spawn on 2 cores): tests/integration/bench/test_definitions.py
@pytest.fixture(autouse=True, params=[1], ids=["1-process"])
def client_processes(request: pytest.FixtureRequest) -> int:
    """Every definition holds for a workload sent by one client process and by two (sharded: its
    streams split between them, k3pipe/bench/shards.py)."""
    _PROCESSES[0] = request.param
    return int(request.param)


def run(base_url: str, spec: WorkloadSpec, *, continuous_usage: bool = True) -> WorkloadResult:
    prompts = [Prompt(text=f"prompt {i}", tokens=2) for i in range(spec.warmup_requests + spec.num_requests)]

    async def go() -> WorkloadResult:
        return await run_sharded(
            base_url, "scripted", None, spec, prompts, _PROCESSES[0], continuous_usage=continuous_usage
        )

    return asyncio.run(go())


def token_stamps(req: Received) -> list[float]:
    return [t for kind, t in req.sent if kind in ("reasoning", "content")]


def test_ttft_tpot_e2e_with_a_multi_token_first_chunk(server: ScriptedOpenAI) -> None:
    """First chunk of 3 tokens at 150 ms, then 1-token chunks 40 ms apart, 200 ms of tail before usage.

    True values: TTFT = first token chunk sent - send; E2E = last token chunk sent - send (not the
    [DONE] 200 ms later); TPOT = (E2E - TTFT) / (N - k1) = 40 ms with k1 = 3, where N - 1 would
    give 40 * 5 / 7 = 28.6 ms.
    """
    server.script = Script(
        first_token_delay_s=0.15, inter_token_s=0.04, first_chunk_tokens=3, tail_delay_s=0.2
    )
    result = run(server.base_url, workload(output_tokens=8))
    (record,) = result.records
    assert record.ok, record.error
    assert record.chunk_tokens == [3, 1, 1, 1, 1, 1]
    stamps = token_stamps(server.requests[0])
    true_ttft = stamps[0] - record.t_send
    true_e2e = stamps[-1] - record.t_send
    true_tpot = (stamps[-1] - stamps[0]) / (8 - 3)
    s = summarize(result)
    assert s.ttft_ms is not None
    assert s.e2e_ms is not None
    assert s.tpot_ms is not None
    assert s.ttft_ms.mean / 1000 == pytest.approx(true_ttft, abs=SLACK_S)
    assert s.e2e_ms.mean / 1000 == pytest.approx(true_e2e, abs=SLACK_S)
    assert s.tpot_ms.mean / 1000 == pytest.approx(true_tpot, abs=SLACK_S / 5)
    assert s.tpot_ms.mean == pytest.approx(40.0, abs=10.0)
    # the stream itself ended after the tail: E2E is not the stream's end
    assert (record.t_end - record.t_send) - s.e2e_ms.mean / 1000 >= 0.2 - 0.005
    assert not s.tpot_k1_assumed


def test_per_token_itl_from_continuous_usage(server: ScriptedOpenAI) -> None:
    """Chunks of 4 tokens every 80 ms: per-token ITL 20 ms (each gap over its 4 tokens, counted 4
    times), per-chunk ITL 80 ms; TPOT 20 ms."""
    server.script = Script(tokens_per_chunk=4, inter_token_s=0.08)
    s = summarize(run(server.base_url, workload(output_tokens=16)))
    assert s.itl_basis == "per_token"
    assert s.itl_ms is not None
    assert s.chunk_itl_ms is not None
    assert s.tpot_ms is not None
    assert s.itl_ms.count == 12  # the 12 tokens after the first chunk
    assert s.chunk_itl_ms.count == 3
    assert s.itl_ms.mean == pytest.approx(20.0, abs=SLACK_S * 1000 / 4)
    assert s.chunk_itl_ms.mean == pytest.approx(80.0, abs=SLACK_S * 1000)
    assert s.tpot_ms.mean == pytest.approx(20.0, abs=SLACK_S * 1000 / 4)
    assert s.metrics()["itl_per_token"] == 1.0


def test_without_per_chunk_counts_itl_is_per_chunk_and_labelled(server: ScriptedOpenAI) -> None:
    server.script = Script(tokens_per_chunk=4, inter_token_s=0.08)
    result = run(server.base_url, workload(output_tokens=16), continuous_usage=False)
    assert server.requests[0].body["stream_options"] == {"include_usage": True}
    s = summarize(result)
    assert s.itl_basis == "per_chunk"
    assert s.itl_ms == s.chunk_itl_ms
    assert s.itl_ms is not None
    assert s.itl_ms.count == 3
    assert s.tpot_k1_assumed
    assert s.metrics()["itl_per_token"] == 0.0


def test_mixed_bases_are_labelled(server: ScriptedOpenAI) -> None:
    # the server honours continuous usage for even requests only
    server.script = lambda req: Script(continuous_usage=req.index % 2 == 0)
    s = summarize(run(server.base_url, workload(num_requests=4, output_tokens=4)))
    assert s.itl_basis == "mixed"


def test_reasoning_then_content(server: ScriptedOpenAI) -> None:
    """TTFT is the first reasoning delta; content TTFT the first content, five chunks later."""
    server.script = Script(first_token_delay_s=0.1, inter_token_s=0.05, reasoning_tokens=5)
    result = run(server.base_url, workload(output_tokens=8))
    (record,) = result.records
    req = server.requests[0]
    s = summarize(result)
    assert s.ttft_ms is not None
    assert s.content_ttft_ms is not None
    assert s.ttft_ms.mean / 1000 == pytest.approx(req.first_sent("reasoning") - record.t_send, abs=SLACK_S)
    assert s.content_ttft_ms.mean / 1000 == pytest.approx(
        req.first_sent("content") - record.t_send, abs=SLACK_S
    )
    assert s.content_ttft_ms.mean - s.ttft_ms.mean == pytest.approx(250.0, abs=SLACK_S * 1000)


def test_goodput_and_attainment_against_slos(server: ScriptedOpenAI) -> None:
    """Requests 0-3 answer in 50 ms, 4-5 in 400 ms: a 200 ms TTFT objective is met by 4 of 6."""
    server.script = lambda req: Script(first_token_delay_s=0.05 if req.index < 4 else 0.4)
    result = run(server.base_url, workload(num_requests=6, output_tokens=2))
    s = summarize(result, SLOSpec(ttft_ms=200.0))
    assert s.slo_met == 4
    assert s.slo_attainment_pct == pytest.approx(100 * 4 / 6)
    assert s.goodput_rps == pytest.approx(4 / s.duration_s)
    assert s.slo_attainment_by_objective_pct == {"ttft_ms": pytest.approx(100 * 4 / 6)}
    m = s.metrics()
    assert m["goodput_rps"] == pytest.approx(4 / s.duration_s)
    assert m["slo_ttft_ms_attainment_pct"] == pytest.approx(100 * 4 / 6)
    assert summarize(result).goodput_rps is None  # no objectives, no goodput


# --- the same definitions on hand-built records (exact arithmetic) ---

T0 = 500.0


def record(
    chunks: list[float], tokens: list[int] | None, out: int | None, *, ok: bool = True, index: int = 0
) -> RequestRecord:
    return RequestRecord(
        index=index,
        warmup=False,
        prompt_tokens=10,
        max_tokens=64,
        usage_output_tokens=out,
        t_scheduled=T0,
        t_send=T0,
        t_first_delta=T0 + chunks[0] if chunks else None,
        t_first_content=T0 + chunks[0] if chunks else None,
        chunk_times=[T0 + c for c in chunks],
        chunk_tokens=tokens,
        t_end=T0 + (chunks[-1] if chunks else 1.0) + 0.5,
        status_code=200,
        error=None if ok else "HTTP 500 from x: boom",
    )


def result_of(*records: RequestRecord) -> WorkloadResult:
    return WorkloadResult(
        workload="w", records=list(records), t_start=T0, t_end=T0 + 10.0, started_at_unix_s=0
    )


def test_a_chunk_with_text_but_no_new_token_passes_its_gap_on() -> None:
    """Chunks at 0.1 (2 tokens), 0.3 (0 tokens: text the detokenizer held back), 0.5 (2 tokens):
    the 0.4 s from the first to the third chunk is spread over its 2 tokens."""
    s = summarize(result_of(record([0.1, 0.3, 0.5], [2, 0, 2], 4)))
    assert s.itl_ms is not None
    assert s.itl_ms.count == 2
    assert s.itl_ms.mean == pytest.approx(200.0)
    assert s.tpot_ms is not None
    assert s.tpot_ms.mean == pytest.approx(200.0)


def test_everything_in_the_first_chunk_has_no_tpot_and_meets_a_tpot_slo() -> None:
    r = record([0.1], [5], 5)
    s = summarize(result_of(r), SLOSpec(tpot_ms=1.0, e2e_ms=150.0))
    assert s.tpot_ms is None
    assert s.slo_met == 1  # nothing after the first chunk to be slow; E2E 100 ms within 150


def test_failed_requests_count_as_missing_the_slo() -> None:
    good = record([0.05, 0.1], [1, 1], 2)
    failed = record([], None, None, ok=False, index=1)
    s = summarize(result_of(good, failed), SLOSpec(ttft_ms=100.0))
    assert (s.slo_met, s.slo_attainment_pct) == (1, 50.0)


def test_each_objective_is_reported_apart() -> None:
    fast_start_slow_end = record([0.05, 1.0], [1, 1], 2)  # TTFT 50, TPOT 950, E2E 1000
    slow_start = record([0.5, 0.55], [1, 1], 2, index=1)  # TTFT 500, TPOT 50, E2E 550
    s = summarize(result_of(fast_start_slow_end, slow_start), SLOSpec(ttft_ms=100, tpot_ms=100, e2e_ms=800))
    assert s.slo_met == 0
    assert s.slo_attainment_by_objective_pct == {"ttft_ms": 50.0, "tpot_ms": 50.0, "e2e_ms": 50.0}


# --- shapes only hand-written streams produce ---


def mock_run(lines: list[str], spec: WorkloadSpec | None = None) -> RequestRecord:
    raw = "\n".join(lines).encode()

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=raw)

    async def go() -> WorkloadResult:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await run_workload(
                client, "http://engine.test/v1", "m", None, spec or workload(), [Prompt(text="p", tokens=1)]
            )

    (rec,) = asyncio.run(go()).records
    return rec


def data(delta: dict[str, object], usage: int | None = None) -> str:
    import json

    chunk: dict[str, object] = {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
    if usage is not None:
        chunk["usage"] = {"prompt_tokens": 5, "completion_tokens": usage, "total_tokens": 5 + usage}
    return "data: " + json.dumps(chunk) + "\n"


def test_tool_call_deltas_are_tokens_and_keep_alives_usage_and_done_are_not() -> None:
    tool = {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f"}}]}
    rec = mock_run(
        [
            ": keep-alive",
            data({"role": "assistant", "content": ""}, usage=0),
            'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":0,"total_tokens":5}}\n',
            data(tool, usage=2),
            data({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}, usage=3),
            'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3,"total_tokens":8}}\n',
            "data: [DONE]\n",
        ]
    )
    assert rec.ok, rec.error
    assert len(rec.chunk_times) == 2  # the two tool-call chunks only
    assert rec.t_first_content is None  # no content at all: content TTFT undefined
    assert rec.chunk_tokens == [2, 1]
    assert rec.usage_output_tokens == 3


def test_without_usage_the_text_is_kept_and_retokenized() -> None:
    rec = mock_run(
        [
            data({"role": "assistant", "content": ""}),
            data({"reasoning": "think", "reasoning_content": "think"}),  # mirrored: counted once
            data({"content": " hello world"}),
            "data: [DONE]\n",
        ]
    )
    assert rec.usage_output_tokens is None
    assert rec.output_text == "think hello world"
    result = retokenize(result_of(rec), lambda text: len(text.split()))
    s = summarize(result)
    assert s.output_tokens_total == 3
    assert s.output_tokens_retokenized
    assert not s.output_tokens_from_chunks
    # with usage the text is not kept (it would only cost memory)
    with_usage = mock_run([data({"content": "a"}, usage=1), "data: [DONE]\n"])
    assert with_usage.output_text is None


def test_zero_tokens_is_a_failure_even_with_status_200() -> None:
    rec = mock_run(
        [
            data({"role": "assistant", "content": ""}, usage=0),
            'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":0,"total_tokens":5}}\n',
            "data: [DONE]\n",
        ]
    )
    assert rec.status_code == 200
    assert rec.error is not None
    assert "zero output tokens" in rec.error


def test_percentiles_are_numpy_linear() -> None:
    values = [float(v) for v in range(1, 12)] + [100.0]
    recs = [record([0.0 + v / 1000], [1], 1, index=i) for i, v in enumerate(values)]
    s = summarize(result_of(*recs))
    assert s.ttft_ms is not None
    expected: Callable[[float], float] = lambda q: float(np.percentile(values, q, method="linear"))  # noqa: E731
    assert s.ttft_ms.p50 == pytest.approx(expected(50))
    assert s.ttft_ms.p99 == pytest.approx(expected(99))
    assert s.ttft_ms.p90 == pytest.approx(10.9)  # rank 0.9 * 11 = 9.9: between 10 and 11


def test_a_token_sent_without_text_after_the_last_chunk_is_not_in_tpot() -> None:
    """vLLM ends a naturally stopped stream with an empty-content finish chunk whose usage counts the
    EOS token: three visible tokens 100 ms apart and usage 4. TPOT over the visible tokens is
    (300 - 100) / (3 - 1) = 100 ms, like the per-token ITL; N = 4 would give 66.7 ms."""
    rec = mock_run(
        [
            data({"role": "assistant", "content": ""}, usage=0),
            data({"content": "a"}, usage=1),
            data({"content": " b"}, usage=2),
            data({"content": " c"}, usage=3),
            'data: {"choices":[{"index":0,"delta":{"content":""},"finish_reason":"stop"}],'
            '"usage":{"prompt_tokens":5,"completion_tokens":4,"total_tokens":9}}\n',
            "data: [DONE]\n",
        ]
    )
    assert rec.ok, rec.error
    assert rec.chunk_tokens == [1, 1, 1]
    assert rec.usage_output_tokens == 4
    timed = rec.model_copy(
        update={"t_send": T0, "t_first_delta": T0 + 0.1, "chunk_times": [T0 + 0.1, T0 + 0.2, T0 + 0.3]}
    )
    s = summarize(result_of(timed))
    assert s.output_tokens_total == 4  # usage stays the count of output tokens
    assert s.tpot_ms is not None
    assert s.tpot_ms.mean == pytest.approx(100.0)
    assert s.itl_ms is not None
    assert s.itl_ms.mean == pytest.approx(100.0)


def test_one_visible_chunk_without_counts_has_no_tpot() -> None:
    s = summarize(result_of(record([0.1], None, 5)))
    assert s.tpot_ms is None  # no time after the only chunk: not 0 ms


# --- bursty delivery: a finding, not a speed ---


def test_a_stream_delivered_in_bursts_is_flagged_not_timed(server: ScriptedOpenAI) -> None:
    """Tokens made 10 ms apart but written 8 chunks at a time: of each request's 31 tokens after the
    first, 28 came in the same read as the token before (4 writes of 8, less each write's first
    chunk). The client's ITL p50 is then 0: it times delivery, and the summary says so."""
    server.script = Script(inter_token_s=0.01, burst_chunks=8)
    result = run(server.base_url, workload(output_tokens=32, num_requests=3, concurrency=3))
    s = summarize(result)
    assert s.completed == 3
    assert s.bursty_requests == 3
    assert s.bursty_requests_pct == pytest.approx(100.0)
    assert s.coalesced_tokens_pct == pytest.approx(100.0 * 28 / 31)
    assert s.client_timing_bursty
    assert s.itl_ms is not None
    assert s.itl_ms.p50 == 0.0  # what a user would have read as a speed
    metrics = s.metrics()
    assert metrics["client_timing_bursty"] == 1.0
    assert metrics["bursty_requests_pct"] == pytest.approx(100.0)
    frame = records_frame(result)
    assert frame["coalesced_tokens"].tolist() == [28, 28, 28]
    # the server's own stamps were 10 ms apart: the engine's ITL is the figure to read
    note = timing_note({**metrics, "engine_itl_ms_p50": 10.2})
    assert note is not None
    assert "bursty delivery: 100% of requests" in note
    assert "the engine's ITL p50 is 10.20 ms" in note
    without_engine = timing_note(metrics)
    assert without_engine is not None
    assert "no decode speed was measured" in without_engine


def test_a_stream_written_token_by_token_is_not_bursty(server: ScriptedOpenAI) -> None:
    server.script = Script(inter_token_s=0.01)
    s = summarize(run(server.base_url, workload(output_tokens=16, num_requests=2, concurrency=2)))
    assert s.bursty_requests == 0
    assert s.coalesced_tokens_pct == pytest.approx(0.0)
    assert not s.client_timing_bursty
    assert timing_note(s.metrics()) is None
    assert s.itl_ms is not None
    assert s.itl_ms.p50 == pytest.approx(10.0, abs=SLACK_S * 1000)


def test_bursty_thresholds() -> None:
    """A request is bursty at half its tokens after the first coalesced; a workload at 10% bursty
    requests or 25% coalesced tokens. A multi-token chunk from the server is not coalescing."""
    clean = [0.1, 0.2, 0.3, 0.4, 0.5]  # 4 tokens after the first, none coalesced
    half = [0.1, 0.2, 0.2, 0.3, 0.3]  # 2 of 4 coalesced: bursty
    below = [0.1, 0.2, 0.2, 0.3, 0.4]  # 1 of 4: not bursty

    def of(*chunks: list[float]) -> WorkloadSummary:
        return summarize(result_of(*(record(c, [1] * len(c), len(c), index=i) for i, c in enumerate(chunks))))

    one_in_ten = of(half, *[clean] * 9)
    assert one_in_ten.bursty_requests == 1
    assert one_in_ten.bursty_requests_pct == pytest.approx(10.0)
    assert one_in_ten.coalesced_tokens_pct == pytest.approx(5.0)
    assert one_in_ten.client_timing_bursty
    one_in_twenty = of(half, *[clean] * 19)
    assert one_in_twenty.bursty_requests_pct == pytest.approx(5.0)
    assert not one_in_twenty.client_timing_bursty
    # no request bursty, but a quarter of all timed tokens coalesced
    spread = of(below, below, below, below)
    assert spread.bursty_requests == 0
    assert spread.coalesced_tokens_pct == pytest.approx(25.0)
    assert spread.client_timing_bursty
    # 4-token chunks 80 ms apart (speculative decoding, or a server's own batching) are timed per token
    multi = summarize(result_of(record([0.1, 0.18, 0.26], [4, 4, 4], 12)))
    assert multi.coalesced_tokens_pct == pytest.approx(0.0)
    assert not multi.client_timing_bursty
    # nothing after the first chunk: nothing to call bursty
    single = summarize(result_of(record([0.1], [5], 5)))
    assert single.coalesced_tokens_pct is None
    assert single.bursty_requests_pct is None
    assert not single.client_timing_bursty


# --- a real SGLang's streams (0.5.16 on the H200, 2026-12-02: docs/gpu.md, "SGLang for real") ---

SGLANG_FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "engines" / "sglang"


@pytest.mark.parametrize(
    ("capture", "api", "chunks"),
    [
        ("real-0.5.16-chat.sse", "chat", [1] * 8),
        # its third text chunk came after two tokens (usage 2 -> 4): one token's text was held back
        ("real-0.5.16-completions.sse", "completions", [1, 1, 2, 1, 1]),
    ],
)
def test_a_real_sglang_stream_is_read_token_by_token(capture: str, api: str, chunks: list[int]) -> None:
    """The role chunk (chat) carries no token, every token chunk its running usage, the finish in a
    chunk of its own (chat) or on the last token (completions), then the usage chunk: per-chunk
    token counts from the running usage, the output from usage, the finish reason kept."""
    lines = (SGLANG_FIXTURES / capture).read_text().splitlines()
    rec = mock_run(lines, workload(api=api, output_tokens=sum(chunks)))
    assert rec.error is None
    assert rec.usage_output_tokens == sum(chunks)
    assert rec.chunk_tokens == chunks
    assert len(rec.chunk_times) == len(chunks)
    assert rec.finish_reason == "length"
    assert rec.saw_done


# --- the warm-up: waves until the rate is steady (docs/measurement.md, "Warm-up") ---

# A scripted request takes about 0.06 + 7 x 0.03 = 0.27 s times its wave's factor (8 tokens): wave
# rates are known up to the client's overhead, a few ms of each wave's span.
_WAVE = 4


def _paced(factor: Callable[[int], float]) -> Callable[[Received], Script]:
    """A server whose request n (arrival order) takes ``factor(n // 4)`` times the base time."""

    def script(req: Received) -> Script:
        f = factor(req.index // _WAVE)
        return Script(first_token_delay_s=0.06 * f, inter_token_s=0.03 * f)

    return script


def _steady(**overrides: object) -> WorkloadSpec:
    fields: dict[str, object] = {
        "warmup": "steady",
        "concurrency": _WAVE,
        "num_requests": 4,
        "output_tokens": 8,
        "warmup_tolerance_pct": 15.0,
    }
    return workload(**{**fields, **overrides})


def _expected_changes(factors: list[float]) -> list[float | None]:
    """Wave k's rate change when its requests take factors[k] times the base time."""
    return [None] + [100.0 * (before / f - 1.0) for before, f in pairwise(factors)]


_SERVED_SLACK = 12.0
"""How far the client's wave-on-wave change may stray from the one the server served (percentage
points). The server's own spans (first request received to last token sent) are the truth: on a loaded
2-core machine its sleeps overshoot the script (a scripted +60% was served as +35%), which the client
must see, not correct. What is left is the client's fixed cost per wave on both ends (its send before
the server's receive, its read after the last chunk), a few ms beside waves of 0.27-0.43 s."""


def _served_changes(server: ScriptedOpenAI, blocks: list[list[RequestRecord]]) -> list[float | None]:
    """Each wave's rate change as the server served it, from its own stamps."""
    by_prompt = {req.body["messages"][0]["content"]: req for req in server.requests}
    spans = []
    for block in blocks:
        served = [by_prompt[f"prompt {r.index}"] for r in block]
        spans.append(max(token_stamps(q)[-1] for q in served) - min(q.t_received for q in served))
    # the same tokens per wave, so rate_after / rate_before = span_before / span_after
    return [None] + [100.0 * (before / after - 1.0) for before, after in pairwise(spans)]


def _check_waves(result: WorkloadResult, server: ScriptedOpenAI, factors: list[float]) -> None:
    """The warm-up went out in waves of 4, one at a time, and each wave's change is the one served."""
    report = result.warmup
    assert report is not None
    warm = sorted((r for r in result.records if r.warmup), key=lambda r: r.t_send)
    blocks = [warm[k : k + _WAVE] for k in range(0, len(warm), _WAVE)]
    for before, block in pairwise(blocks):
        assert min(r.t_send for r in block) >= max(r.t_end for r in before)  # one wave in flight at a time
    assert [r.index for r in warm] == sorted(r.index for r in warm)  # the first prompts, in order
    assert all(r.ok for r in warm)
    assert [w.requests for w in report.waves] == [_WAVE] * len(factors)
    assert [w.output_tokens for w in report.waves] == [_WAVE * 8] * len(factors)
    served = _served_changes(server, blocks)
    for k, (wave, truth, real) in enumerate(
        zip(report.waves, _expected_changes(factors), served, strict=True)
    ):
        if truth is None:
            assert wave.change_pct is None
            continue
        assert wave.change_pct is not None
        assert real is not None
        if k == 1:
            # the first wave also carries the first requests' own costs on both sides (10-80 ms,
            # more in a fresh process): against it only agreement or the direction is certain
            if truth == 0:
                assert abs(wave.change_pct) <= 15.0
            else:
                assert wave.change_pct * truth > 0
                assert abs(wave.change_pct) > 15.0
            continue
        if truth != 0:
            assert real * truth > 0  # the server did slow down or speed up as scripted
        assert wave.change_pct == pytest.approx(real, abs=_SERVED_SLACK)

    # nothing of the warm-up was in flight when the measured phase opened
    assert max(r.t_end for r in warm) <= result.t_start
    assert len(server.requests) == len(warm) + 4


def test_a_steady_warmup_stops_once_the_rate_has_settled(server: ScriptedOpenAI) -> None:
    """The server speeds up over its first 12 requests (waves at 4x, 2.5x, 1.6x the base time: rate
    +60%, +56%, +60% wave on wave) and holds from request 12 on. Waves 4 and 5 are the first two to
    agree (0% against a 15% tolerance): the warm-up stops after 5 waves, 20 of at most 48 requests,
    neither before the rate settled nor at the maximum."""
    factors = [4.0, 2.5, 1.6, 1.0, 1.0]
    server.script = _paced(lambda wave: factors[wave] if wave < 3 else 1.0)
    result = run(server.base_url, _steady(warmup_requests=48))
    _check_waves(result, server, factors)
    report = result.warmup
    assert report is not None
    assert (report.mode, report.requests_planned, report.requests_sent) == ("steady", 48, 20)
    assert report.steady is True
    measured = [r for r in result.records if not r.warmup]
    assert [r.index for r in measured] == [48, 49, 50, 51]  # prompts 20-47 were not needed
    assert {req.body["messages"][0]["content"] for req in server.requests[20:]} == {
        f"prompt {i}" for i in range(48, 52)
    }
    m = summarize(result).metrics()
    assert (m["warmup_requests"], m["warmup_waves"], m["warmup_steady"]) == (20, 5, 1.0)
    assert abs(m["warmup_last_change_pct"]) <= 15.0
    assert m["warmup_last_wave_tps"] == pytest.approx(report.waves[-1].output_tps)


def test_a_warmup_that_never_settles_stops_at_the_most_and_says_so(server: ScriptedOpenAI) -> None:
    """Waves alternate between 1x and 1.6x the base time (+-37..60% wave on wave): no two agree, so
    the warm-up sends its most, 22 // 4 = 5 whole waves (20 requests; prompts 20 and 21 unused), and
    is recorded not steady."""
    factors = [1.0, 1.6, 1.0, 1.6, 1.0]
    server.script = _paced(lambda wave: 1.6 if wave % 2 else 1.0)
    result = run(server.base_url, _steady(warmup_requests=22))
    _check_waves(result, server, factors)
    report = result.warmup
    assert report is not None
    assert report.requests_sent == 20
    assert report.steady is False
    assert [r.index for r in result.records if not r.warmup] == [22, 23, 24, 25]
    m = summarize(result).metrics()
    assert m["warmup_steady"] == 0.0
    assert m["warmup_last_change_pct"] == report.waves[-1].change_pct  # the last wave's
    assert m["warmup_last_change_pct"] > 15.0  # faster again (+60% as scripted), past the tolerance


def test_an_engine_steady_from_the_start_takes_two_waves(server: ScriptedOpenAI) -> None:
    server.script = _paced(lambda wave: 1.0)
    result = run(server.base_url, _steady(warmup_requests=40, load="constant", rate_rps=40.0))
    _check_waves(result, server, [1.0, 1.0])
    report = result.warmup
    assert report is not None
    assert (report.requests_sent, report.steady) == (8, True)
    # the warm-up ran at concurrency whatever the load; the schedule started after it
    measured = [r for r in result.records if not r.warmup]
    assert min(r.t_scheduled for r in measured) >= max(r.t_end for r in result.records if r.warmup)
    assert result.opening_wave is None  # a schedule opens with no burst to speak of


def test_a_fixed_warmup_is_judged_by_the_same_waves(server: ScriptedOpenAI) -> None:
    """warmup 'fixed' (the default) sends all its 12 requests as before, a slot taking the next as
    its last ends; its waves are read from the records: the server slows down by 1.6x from request
    8 on, so the last wave's rate is ~37% lower and the warm-up is recorded not steady."""
    server.script = _paced(lambda wave: 1.6 if wave >= 2 else 1.0)
    spec = workload(warmup_requests=12, concurrency=_WAVE, num_requests=4, output_tokens=8)
    result = run(server.base_url, spec)
    report = result.warmup
    assert report is not None
    assert (report.mode, report.requests_sent, len(report.waves)) == ("fixed", 12, 3)
    assert report.waves[1].change_pct == pytest.approx(0.0, abs=10.0)
    assert report.waves[2].change_pct == pytest.approx(100.0 * (1 / 1.6 - 1), abs=10.0)
    assert report.steady is False
    assert len(server.requests) == 16


# --- the opening wave of the measured phase ---


def test_the_opening_wave_ttft_is_stated_beside_the_rest(server: ScriptedOpenAI) -> None:
    """Load concurrency 4, no warm-up: the server answers its first 4 requests (the measured phase's
    opening wave, sent at once) after 240 ms, the 8 after them after 80 ms. The first-wave TTFT p50,
    the rest's and their ratio match the server's own stamps; TTFT p50 over all stays as defined."""
    server.script = lambda req: Script(first_token_delay_s=0.24 if req.index < 4 else 0.08)
    result = run(server.base_url, workload(concurrency=4, num_requests=12, output_tokens=2))
    assert result.opening_wave == 4
    records = sorted(result.records, key=lambda r: r.t_send)
    by_prompt = {req.body["messages"][0]["content"]: req for req in server.requests}
    true_ttft = [(by_prompt[f"prompt {r.index}"].first_sent("content") - r.t_send) * 1000 for r in records]
    first, rest = float(np.median(true_ttft[:4])), float(np.median(true_ttft[4:]))
    s = summarize(result)
    assert s.ttft_ms_p50_first_wave == pytest.approx(first, abs=SLACK_S * 1000)
    assert s.ttft_ms_p50_after_first_wave == pytest.approx(rest, abs=SLACK_S * 1000)
    assert s.ttft_ms_p50_first_wave == pytest.approx(240.0, abs=SLACK_S * 1000)
    assert s.ttft_ms_p50_after_first_wave == pytest.approx(80.0, abs=SLACK_S * 1000)
    assert s.first_wave_ttft_ratio == pytest.approx(s.ttft_ms_p50_first_wave / s.ttft_ms_p50_after_first_wave)
    assert s.first_wave_ttft_ratio == pytest.approx(3.0, rel=0.3)
    assert s.ttft_ms is not None
    assert s.ttft_ms.p50 == pytest.approx(float(np.median(true_ttft)), abs=SLACK_S * 1000)
    m = s.metrics()
    assert m["first_wave_ttft_ratio"] == s.first_wave_ttft_ratio
