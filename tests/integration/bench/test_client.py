"""The streaming client against the scripted vLLM-style server (ground truth for every stamp).

Async code runs under ``asyncio.run`` inside plain tests. The server stamps each chunk with
``perf_counter`` just before handing it to the transport, in this same process, so "the client
stamped X after the server sent it and before the next one was sent" is an exact check, and the
scripted delays give the expected sizes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import AsyncIterator, Callable

import httpx
import numpy as np
import pytest
from pydantic import SecretStr, ValidationError

from k3pipe.bench import Prompt, RequestRecord, WorkloadResult, records_frame, run_workload, summarize
from k3pipe.bench.client import schedule_offsets
from k3pipe.core.errors import BenchmarkError
from k3pipe.schema.specs import WorkloadSpec
from k3pipe.testing.scripted_openai import Received, Script, ScriptedOpenAI

pytestmark = pytest.mark.serial

# Slack for "arrived soon after it was sent" on a loaded 2-core machine.
ARRIVAL_S = 0.1


def workload(**overrides: object) -> WorkloadSpec:
    fields: dict[str, object] = {"name": "w", "input_tokens": 3, "output_tokens": 8, "num_requests": 1}
    fields.update(overrides)
    return WorkloadSpec.model_validate(fields)


def prompts(n: int) -> list[Prompt]:
    return [Prompt(text=f"prompt number {i}", tokens=3) for i in range(n)]


def run(
    base_url: str,
    spec: WorkloadSpec,
    api_key: SecretStr | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    n_prompts: int | None = None,
) -> WorkloadResult:
    n = n_prompts if n_prompts is not None else spec.warmup_requests + spec.num_requests

    async def go() -> WorkloadResult:
        return await run_workload(None, base_url, "scripted", api_key, spec, prompts(n), on_progress)

    return asyncio.run(go())


def only(result: WorkloadResult) -> RequestRecord:
    (record,) = result.records
    return record


# --- requests as sent ---


def test_chat_request_body_and_headers(server: ScriptedOpenAI) -> None:
    record = only(run(server.base_url, workload(output_tokens=5)))
    assert record.ok, record.error
    (req,) = server.requests
    assert req.path == "/v1/chat/completions"
    assert req.body == {
        "model": "scripted",
        "messages": [{"role": "user", "content": "prompt number 0"}],
        "max_tokens": 5,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "ignore_eos": True,
    }
    assert "authorization" not in req.headers  # no key, no header


def test_ignore_eos_false_is_not_sent(server: ScriptedOpenAI) -> None:
    run(server.base_url, workload(ignore_eos=False))
    assert "ignore_eos" not in server.requests[0].body


def test_key_goes_in_the_bearer_header_only(server: ScriptedOpenAI) -> None:
    right = "sk-right-key"  # a made-up key for the scripted server
    server.api_key = right
    record = only(run(server.base_url, workload(), api_key=SecretStr(right)))
    assert record.ok, record.error
    assert server.requests[0].headers["authorization"] == "Bearer sk-right-key"


@pytest.mark.parametrize("null_usage", [False, True])
def test_completions_api(server: ScriptedOpenAI, null_usage: bool) -> None:
    # "usage": null on token chunks is what older vLLM sent when continuous usage was off
    server.script = Script(usage_null_in_chunks=null_usage, continuous_usage=not null_usage)
    result = run(server.base_url, workload(api="completions", output_tokens=6))
    record = only(result)
    assert record.ok, record.error
    (req,) = server.requests
    assert req.path == "/v1/completions"
    assert req.body["prompt"] == "prompt number 0"
    assert "messages" not in req.body
    assert req.body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert len(record.chunk_times) == 6
    assert record.chunk_tokens == (None if null_usage else [1] * 6)
    assert record.usage_output_tokens == 6
    assert record.t_first_content == record.t_first_delta == record.chunk_times[0]
    assert record.finish_reason == "length"
    assert record.saw_done


# --- what counts as the first token ---


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content", "both"])
def test_ttft_counts_reasoning_deltas(server: ScriptedOpenAI, field: str) -> None:
    server.script = Script(
        first_token_delay_s=0.2,
        inter_token_s=0.05,
        reasoning_tokens=4,
        reasoning_field=field,  # type: ignore[arg-type]
    )
    record = only(run(server.base_url, workload(output_tokens=8)))
    assert record.ok, record.error
    req = server.requests[0]
    first_reasoning, first_content = req.first_sent("reasoning"), req.first_sent("content")
    assert record.t_first_delta is not None
    assert record.t_first_content is not None
    # stamped on the first reasoning chunk: after it was sent, before any content existed
    assert first_reasoning <= record.t_first_delta < first_content
    assert first_content <= record.t_first_content < first_content + ARRIVAL_S
    ttft = record.t_first_delta - record.t_send
    content_ttft = record.t_first_content - record.t_send
    assert 0.2 - 0.005 <= ttft < 0.2 + ARRIVAL_S
    # four reasoning chunks 50 ms apart come before the first content
    assert content_ttft - ttft == pytest.approx(4 * 0.05, abs=0.04)
    assert len(record.chunk_times) == 8
    assert record.usage_output_tokens == 8


def test_role_only_and_empty_chunks_are_not_tokens(server: ScriptedOpenAI) -> None:
    server.script = Script(first_token_delay_s=0.25, empty_content_chunk=True, empty_choices_chunks=2)
    record = only(run(server.base_url, workload(output_tokens=3)))
    assert record.ok, record.error
    req = server.requests[0]
    first_content = req.first_sent("content")
    assert record.t_first_delta is not None
    assert first_content <= record.t_first_delta < first_content + ARRIVAL_S
    assert record.t_first_delta - record.t_send >= 0.25 - 0.005
    assert record.t_first_content == record.t_first_delta
    assert len(record.chunk_times) == 3  # role, empty-content and choices:[] chunks not among them


def test_chunks_are_stamped_on_arrival(server: ScriptedOpenAI) -> None:
    server.script = Script(inter_token_s=0.03)
    record = only(run(server.base_url, workload(output_tokens=6)))
    sent = [t for kind, t in server.requests[0].sent if kind == "content"]
    assert len(sent) == len(record.chunk_times) == 6
    for s, arrived in zip(sent, record.chunk_times, strict=True):
        assert s <= arrived < s + ARRIVAL_S
    assert record.t_end >= server.requests[0].first_sent("done")


def test_multi_token_chunks_count_tokens_from_usage(server: ScriptedOpenAI) -> None:
    server.script = Script(tokens_per_chunk=4, inter_token_s=0.02)
    result = run(server.base_url, workload(output_tokens=16))
    record = only(result)
    assert len(record.chunk_times) == 4
    assert record.usage_output_tokens == 16
    assert record.chunk_tokens == [4, 4, 4, 4]  # from the running usage of continuous_usage_stats
    summary = summarize(result)
    assert summary.output_tokens_total == 16
    assert not summary.output_tokens_from_chunks
    assert summary.tpot_ms is not None
    assert summary.ttft_ms is not None
    assert summary.e2e_ms is not None
    # N - k1: the 4 tokens of the first chunk arrived at TTFT
    assert summary.tpot_ms.mean == pytest.approx((summary.e2e_ms.mean - summary.ttft_ms.mean) / 12)
    assert not summary.tpot_k1_assumed


def test_multi_token_chunks_without_continuous_usage_assume_one_token_first(
    server: ScriptedOpenAI,
) -> None:
    server.script = Script(tokens_per_chunk=4, inter_token_s=0.02, continuous_usage=False)
    result = run(server.base_url, workload(output_tokens=16))
    record = only(result)
    assert record.usage_output_tokens == 16
    assert record.chunk_tokens is None
    summary = summarize(result)
    # 4 chunks of 4 tokens: the first chunk's tokens are not known, so there is no tpot_ms, and
    # the k1 = 1 figure is kept under its own name: (e2e - ttft) / 15, below the true / 12
    assert summary.tpot_ms is None
    assert summary.tpot_lower_bound_ms is not None
    assert summary.ttft_ms is not None
    assert summary.e2e_ms is not None
    span = summary.e2e_ms.mean - summary.ttft_ms.mean
    assert summary.tpot_lower_bound_ms.mean == pytest.approx(span / 15)
    assert summary.tpot_lower_bound_ms.mean < span / 12
    assert "tpot_ms_p50" not in summary.metrics()
    assert summary.tpot_k1_assumed
    assert summary.itl_basis == "per_chunk"


def test_usage_absent_falls_back_to_chunks_and_is_flagged(server: ScriptedOpenAI) -> None:
    server.script = Script(usage=False)
    result = run(server.base_url, workload(output_tokens=7))
    record = only(result)
    assert record.ok, record.error
    assert record.usage_output_tokens is None
    assert record.usage_prompt_tokens is None
    summary = summarize(result)
    assert summary.output_tokens_total == 7
    assert summary.output_tokens_from_chunks
    assert summary.metrics()["output_tokens_from_chunks"] == 1.0


def test_usage_is_recorded(server: ScriptedOpenAI) -> None:
    record = only(run(server.base_url, workload(output_tokens=4)))
    assert record.usage_output_tokens == 4
    assert record.usage_prompt_tokens == 3 + 10  # the scripted server's "chat template"
    assert record.prompt_tokens == 3


# --- failures are records ---


def test_zero_output_tokens_is_a_failure(server: ScriptedOpenAI) -> None:
    server.script = Script(output_tokens=0)
    record = only(run(server.base_url, workload()))
    assert record.status_code == 200
    assert record.error is not None
    assert "zero output tokens" in record.error
    assert not record.chunk_times
    assert record.t_first_delta is None


def test_a_stream_with_no_choices_is_a_failure(server: ScriptedOpenAI) -> None:
    server.script = Script(output_tokens=0, empty_choices_chunks=3, usage=False)
    record = only(run(server.base_url, workload()))
    assert record.error is not None
    assert "zero output tokens" in record.error


def test_401_is_a_record_not_an_exception(server: ScriptedOpenAI) -> None:
    server.api_key = "sk-right"
    result = run(server.base_url, workload(num_requests=3, concurrency=2), api_key=SecretStr("sk-wrong"))
    assert len(result.records) == 3
    for record in result.records:
        assert record.status_code == 401
        assert record.error is not None
        assert "HTTP 401" in record.error
        assert "Unauthorized" in record.error
    summary = summarize(result)
    assert (summary.completed, summary.failed) == (0, 3)
    assert summary.ttft_ms is None


def test_500_body_is_kept_truncated(server: ScriptedOpenAI) -> None:
    server.script = Script(status=500, error_body="x" * 5000)
    record = only(run(server.base_url, workload()))
    assert record.status_code == 500
    assert record.error is not None
    assert record.error.startswith("HTTP 500")
    assert "xxxx" in record.error
    assert len(record.error) < 700


def test_error_object_in_the_stream(server: ScriptedOpenAI) -> None:
    server.script = Script(stream_error_after=2)
    record = only(run(server.base_url, workload(output_tokens=6)))
    assert record.status_code == 200
    assert record.error is not None
    assert "scripted error in stream" in record.error
    assert len(record.chunk_times) == 2


def test_missing_done_is_not_an_error(server: ScriptedOpenAI) -> None:
    server.script = Script(send_done=False)
    record = only(run(server.base_url, workload(output_tokens=3)))
    assert record.ok, record.error
    assert not record.saw_done


def test_timeout_is_a_record(server: ScriptedOpenAI) -> None:
    server.script = Script(first_token_delay_s=2.0)
    record = only(run(server.base_url, workload(request_timeout_s=0.3)))
    assert record.error is not None
    assert "timed out after 0.3 s" in record.error
    assert record.t_end - record.t_send == pytest.approx(0.3, abs=ARRIVAL_S)


def test_connection_refused_is_a_record() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        port = sock.getsockname()[1]
        result = run(f"http://127.0.0.1:{port}/v1", workload(num_requests=2))
    assert [r.status_code for r in result.records] == [None, None]
    assert all(r.error is not None and "ConnectError" in r.error for r in result.records)


def test_one_failure_does_not_lose_the_others(server: ScriptedOpenAI) -> None:
    def script(req: Received) -> Script:
        return Script(status=500) if req.body["messages"][0]["content"] == "prompt number 2" else Script()

    server.script = script
    result = run(server.base_url, workload(num_requests=5, concurrency=2))
    assert [r.index for r in result.records] == [0, 1, 2, 3, 4]
    assert [r.ok for r in result.records] == [True, True, False, True, True]


@pytest.mark.parametrize("base_url", ["http://[::1/v1", "127.0.0.1:8000/v1", "http:///v1"])
def test_invalid_base_url(base_url: str) -> None:
    with pytest.raises(BenchmarkError, match="not a valid URL"):
        run(base_url, workload())


def test_not_enough_prompts() -> None:
    with pytest.raises(BenchmarkError, match="needs 5 prompts"):
        run("http://127.0.0.1:9/v1", workload(num_requests=3, warmup_requests=2), n_prompts=4)


# --- concurrency and warm-up ---


@pytest.mark.parametrize("concurrency", [1, 3])
def test_concurrency_is_respected_and_reached(server: ScriptedOpenAI, concurrency: int) -> None:
    server.script = Script(first_token_delay_s=0.1, inter_token_s=0.01)
    result = run(server.base_url, workload(num_requests=7, concurrency=concurrency, output_tokens=4))
    assert all(r.ok for r in result.records)
    assert server.max_in_flight == concurrency
    # the client's own view: never more than `concurrency` requests between send and end
    events = sorted([(r.t_send, 1) for r in result.records] + [(r.t_end, -1) for r in result.records])
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    assert peak == concurrency
    # fixed concurrency: a request is due when its slot frees, so it is never late
    assert all(r.t_scheduled == r.t_send for r in result.records)
    assert not result.stopped_by_duration
    assert result.requests_planned == 7
    summary = summarize(result)
    assert summary.send_lag_ms is not None
    assert summary.send_lag_ms.p99 == 0.0
    assert summary.ttft_from_scheduled_ms == summary.ttft_ms


def test_warmup_runs_first_and_is_excluded(server: ScriptedOpenAI) -> None:
    seen: list[tuple[int, int]] = []
    spec = workload(num_requests=3, warmup_requests=2, concurrency=2, output_tokens=4)
    result = run(server.base_url, spec, on_progress=lambda done, total: seen.append((done, total)))
    assert [r.warmup for r in result.records] == [True, True, False, False, False]
    assert [r.index for r in result.records] == [0, 1, 2, 3, 4]
    assert len(server.requests) == 5
    # warm-up used the first prompts, and every warm-up request ended before the window opened
    assert {req.body["messages"][0]["content"] for req in server.requests[:2]} == {
        "prompt number 0",
        "prompt number 1",
    }
    assert max(r.t_end for r in result.records if r.warmup) <= result.t_start
    assert result.t_start == min(r.t_send for r in result.records if not r.warmup)
    assert result.t_end == max(r.t_end for r in result.records if not r.warmup)
    summary = summarize(result)
    assert (summary.requests, summary.completed, summary.warmup_requests) == (3, 3, 2)
    assert summary.output_tokens_total == 3 * 4
    assert seen == [(i, 5) for i in range(1, 6)]


def test_failed_warmup_is_not_counted(server: ScriptedOpenAI) -> None:
    server.script = lambda req: Script(status=500) if req.index == 0 else Script()
    result = run(server.base_url, workload(num_requests=2, warmup_requests=1))
    summary = summarize(result)
    assert not result.records[0].ok
    assert result.records[0].warmup
    assert (summary.completed, summary.failed) == (2, 0)


# --- the key never leaks ---


def test_key_never_appears_in_records_errors_or_logs(
    server: ScriptedOpenAI, caplog: pytest.LogCaptureFixture
) -> None:
    key = "sk-very-secret-0123456789"
    other = "something-else"  # a made-up key the client does not send
    server.api_key = other
    server.script = Script(echo_auth_in_error=True)  # a gateway that echoes the header back
    caplog.set_level(logging.DEBUG)
    result = run(server.base_url, workload(num_requests=2), api_key=SecretStr(key))
    assert server.requests[0].headers["authorization"] == f"Bearer {key}"
    assert all(r.error is not None and "***" in r.error for r in result.records)
    assert key not in repr(result)
    assert key not in str(result)
    assert key not in result.model_dump_json()
    assert key not in records_frame(result).to_json()
    assert key not in json.dumps(summarize(result).model_dump())
    assert key not in caplog.text
    assert "failed" in caplog.text  # the warning about the failed requests was logged, scrubbed


def test_a_key_straddling_the_error_cut_is_scrubbed_whole() -> None:
    """An error page that echoes the key around character 500, where error texts are cut."""
    key = "sk-" + "A1b2C3d4" * 5

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(502, text="x" * 470 + " " + request.headers["authorization"] + " tail")

    async def go() -> WorkloadResult:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await run_workload(
                client, "http://engine.test/v1", "m", SecretStr(key), workload(), prompts(1)
            )

    (record,) = asyncio.run(go()).records
    assert record.error is not None
    assert "Bearer ***" in record.error
    assert key[:12] not in record.error


# --- SSE parsing details, through an in-process transport ---


def _mock_run(handler: Callable[[httpx.Request], httpx.Response], spec: WorkloadSpec) -> WorkloadResult:
    async def go() -> WorkloadResult:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await run_workload(client, "http://engine.test/v1", "m", None, spec, prompts(1))

    return asyncio.run(go())


def test_sse_lines_split_across_reads_crlf_and_comments() -> None:
    chunk = '{"choices":[{"index":0,"delta":{"content":"%s"},"finish_reason":null}]}'
    lines = [
        ": keep-alive comment",
        'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}',
        "",
        "data:" + chunk % "a",  # no space after the colon is valid SSE
        "",
        "event: message",
        "data: " + chunk % "b\\nc",
        "",
        'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}',
        "",
        "data: [DONE]",
        "",
        "data: " + chunk % "after done: never read",
    ]
    raw = "\r\n".join(lines).encode()

    async def pieces() -> AsyncIterator[bytes]:
        for i in range(0, len(raw), 7):  # 7-byte reads split lines, keywords and JSON
            yield raw[i : i + 7]

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=pieces())

    record = only(_mock_run(handler, workload()))
    assert record.ok, record.error
    assert len(record.chunk_times) == 2
    assert record.usage_output_tokens == 2
    assert record.usage_prompt_tokens == 3
    assert record.saw_done


def test_a_json_answer_instead_of_a_stream_is_a_failure() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"choices": [{"message": {"content": "hi"}}]})

    record = only(_mock_run(handler, workload()))
    assert record.error is not None
    assert "not an SSE stream" in record.error


def test_malformed_data_is_a_failure() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b"data: {not json\n\ndata: [DONE]\n\n")

    record = only(_mock_run(handler, workload()))
    assert record.error is not None
    assert "malformed SSE data" in record.error


def test_unexpected_exception_is_a_record() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise ValueError("transport surprise")

    result = _mock_run(handler, workload())
    assert only(result).error == "unexpected ValueError: transport surprise"


# --- load patterns: constant rate, Poisson arrivals, duration bound ---


def _peak_in_flight(records: list[RequestRecord]) -> int:
    events = sorted([(r.t_send, 1) for r in records] + [(r.t_end, -1) for r in records])
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


def _measured(result: WorkloadResult) -> list[RequestRecord]:
    return [r for r in result.records if not r.warmup]


def test_constant_rate_sends_on_schedule(server: ScriptedOpenAI) -> None:
    rate, n = 10.0, 10
    spec = workload(load="constant", rate_rps=rate, num_requests=n, concurrency=n, output_tokens=2)
    result = run(server.base_url, spec)
    records = _measured(result)
    assert all(r.ok for r in records), [r.error for r in records]
    scheduled = np.array([r.t_scheduled for r in records])
    assert np.diff(scheduled) == pytest.approx(np.full(n - 1, 1 / rate))
    arrivals = sorted(req.t_received for req in server.requests)
    # nothing reaches the server before it is due ...
    assert all(a >= s for a, s in zip(arrivals, scheduled, strict=True))
    # ... and the arrivals are spread out at the rate, not sent in a burst
    spacing = (arrivals[-1] - arrivals[0]) / (n - 1)
    assert spacing == pytest.approx(1 / rate, rel=0.2)
    assert min(np.diff(arrivals)) > 0.2 / rate
    summary = summarize(result)
    assert summary.send_lag_ms is not None
    assert summary.send_lag_ms.p50 < 50.0


def test_poisson_schedule_is_seeded() -> None:
    def spec(seed: int, n: int = 2000) -> WorkloadSpec:
        return workload(load="poisson", rate_rps=4.0, num_requests=n, seed=seed)

    offsets = schedule_offsets(spec(1))
    assert offsets[0] == 0.0
    assert schedule_offsets(spec(1)) == pytest.approx(offsets, abs=0)
    assert not np.allclose(schedule_offsets(spec(2)), offsets)
    gaps = np.diff(offsets)
    assert (gaps > 0).all()
    assert gaps.mean() == pytest.approx(0.25, rel=0.1)  # mean gap 1/rate
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.15)  # exponential: CV 1, not constant
    expected = np.concatenate(([0.0], np.cumsum(np.random.default_rng(1).exponential(0.25, 1999))))
    assert offsets == pytest.approx(expected, abs=0)
    assert schedule_offsets(workload(load="constant", rate_rps=4.0, num_requests=3)) == pytest.approx(
        [0.0, 0.25, 0.5]
    )
    with pytest.raises(ValueError, match="no send schedule"):
        schedule_offsets(workload())


def test_poisson_run_follows_its_seeded_schedule() -> None:
    def relative(seed: int) -> tuple[list[float], list[float]]:
        spec = workload(
            load="poisson", rate_rps=40.0, num_requests=6, concurrency=6, seed=seed, output_tokens=2
        )
        with ScriptedOpenAI() as scripted:
            result = run(scripted.base_url, spec)
            arrivals = sorted(req.t_received for req in scripted.requests)
        records = _measured(result)
        assert all(r.ok for r in records), [r.error for r in records]
        first = records[0].t_scheduled
        assert all(a >= r.t_scheduled for a, r in zip(arrivals, records, strict=True))
        return [r.t_scheduled - first for r in records], [r.t_send - r.t_scheduled for r in records]

    same_a, lag_a = relative(7)
    same_b, _ = relative(7)
    other, _ = relative(8)
    assert same_a == pytest.approx(same_b, abs=1e-9)
    assert same_a == pytest.approx(
        list(schedule_offsets(workload(load="poisson", rate_rps=40.0, num_requests=6, seed=7))), abs=1e-9
    )
    assert other != pytest.approx(same_a, abs=1e-3)
    assert min(lag_a) >= 0.0


def test_rate_beyond_the_cap_respects_it_and_shows_lag(server: ScriptedOpenAI) -> None:
    # 8 requests due within 0.14 s, but each takes >= 0.2 s and only 2 may be in flight
    server.script = Script(first_token_delay_s=0.2)
    spec = workload(load="constant", rate_rps=50.0, num_requests=8, concurrency=2, output_tokens=2)
    result = run(server.base_url, spec)
    records = _measured(result)
    assert all(r.ok for r in records), [r.error for r in records]
    assert server.max_in_flight == 2
    assert _peak_in_flight(records) == 2
    lags = [r.t_send - r.t_scheduled for r in records]
    # the last pair waited for three rounds of >= 0.2 s: sent >= 0.6 s after the first was due
    assert lags[-1] >= 0.6 - 0.14
    assert lags[-1] > lags[1] + 0.2  # the lag grows as the client falls behind
    summary = summarize(result)
    assert summary.send_lag_ms is not None
    assert summary.ttft_ms is not None
    assert summary.ttft_from_scheduled_ms is not None
    assert summary.e2e_from_scheduled_ms is not None
    assert summary.e2e_ms is not None
    assert summary.send_lag_ms.p90 > 300.0
    assert summary.ttft_from_scheduled_ms.mean > summary.ttft_ms.mean + 200.0
    assert summary.e2e_from_scheduled_ms.p99 > summary.e2e_ms.p99
    # the window and throughput are still sends to ends
    assert summary.duration_s == pytest.approx(result.t_end - result.t_start)
    assert result.t_start == min(r.t_send for r in records)


@pytest.mark.parametrize("load", ["concurrency", "constant"])
def test_duration_bound_stops_sending(server: ScriptedOpenAI, load: str) -> None:
    # every request takes >= 0.1 s; a 0.5 s bound leaves room for a handful of the 60 planned
    server.script = Script(first_token_delay_s=0.1)
    rate = {"rate_rps": 20.0} if load == "constant" else {}
    spec = workload(load=load, num_requests=60, duration_s=0.5, output_tokens=2, **rate)
    result = run(server.base_url, spec)
    records = _measured(result)
    assert all(r.ok for r in records), [r.error for r in records]
    assert result.stopped_by_duration
    assert result.requests_planned == 60
    assert len(server.requests) == len(records)
    # concurrency 1 and >= 0.1 s each: at most 5 started in 0.5 s; constant 20 rps: at most 10 due
    assert 1 <= len(records) <= (5 if load == "concurrency" else 10)
    assert max(r.t_scheduled for r in records) - result.t_start < 0.5
    summary = summarize(result)
    assert summary.requests == len(records)
    assert summary.stopped_by_duration
    assert summary.metrics()["stopped_by_duration"] == 1.0
    assert [r.index for r in result.records] == list(range(len(records)))


def test_duration_bound_that_does_not_run_out(server: ScriptedOpenAI) -> None:
    spec = workload(load="constant", rate_rps=50.0, num_requests=3, concurrency=3, duration_s=60.0)
    result = run(server.base_url, spec)
    assert len(_measured(result)) == 3
    assert not result.stopped_by_duration


def test_warmup_is_excluded_under_a_rate(server: ScriptedOpenAI) -> None:
    server.script = Script(first_token_delay_s=0.05)
    spec = workload(
        load="poisson", rate_rps=20.0, num_requests=3, warmup_requests=2, concurrency=2, output_tokens=4
    )
    result = run(server.base_url, spec)
    assert [r.warmup for r in result.records] == [True, True, False, False, False]
    warm, measured = result.records[:2], result.records[2:]
    # warm-up ran first at the workload's concurrency (both at once), due when sent
    assert all(r.t_scheduled == r.t_send for r in warm)
    assert max(r.t_send for r in warm) < min(r.t_end for r in warm)
    assert max(r.t_end for r in warm) <= result.t_start
    # the schedule starts with the measured requests, not with the warm-up
    assert min(r.t_scheduled for r in measured) >= max(r.t_end for r in warm)
    first = measured[0].t_scheduled
    offsets = schedule_offsets(spec)
    assert [r.t_scheduled - first for r in measured] == pytest.approx(list(offsets), abs=1e-9)
    summary = summarize(result)
    assert (summary.requests, summary.completed, summary.warmup_requests) == (3, 3, 2)
    assert summary.send_lag_ms is not None
    assert summary.send_lag_ms.count == 3
    assert summary.output_tokens_total == 3 * 4


@pytest.mark.parametrize("load", ["constant", "poisson"])
def test_a_rate_load_needs_rate_rps(load: str) -> None:
    with pytest.raises(ValidationError, match="rate_rps"):
        workload(load=load)


def test_rate_rps_without_a_rate_load_is_refused() -> None:
    with pytest.raises(ValidationError, match="rate_rps"):
        workload(rate_rps=5.0)


@pytest.mark.parametrize("field", ["rate_rps", "duration_s"])
def test_rate_and_duration_must_be_positive(field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        workload(load="constant", **{"rate_rps": 1.0, field: 0})


def test_load_defaults_keep_fixed_concurrency() -> None:
    spec = workload()
    assert (spec.load, spec.rate_rps, spec.duration_s) == ("concurrency", None, None)
