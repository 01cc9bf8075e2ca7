"""A trace replayed over the wire (k3pipe.bench.client.replay_trace) against the scripted OpenAI
server (k3pipe/testing/scripted_openai.py, the real chat-completions stream format): every request
sent with its own prompt and max_tokens, a session's turn never before its previous answer ended,
requests on their own at their plan however slow the answers, and a failed turn ending its session
while the others go on. What is asserted is order and causality, not milliseconds (this runs beside
other tests); the lag's figures are the benchmark's."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from k3pipe.bench.client import replay_trace
from k3pipe.core.errors import BenchmarkError
from k3pipe.prompts.trace_prompts import replay_prompts, trace_prompts
from k3pipe.schema.specs import WorkloadSpec
from k3pipe.schema.traces import Trace, TraceRequest
from k3pipe.testing.scripted_openai import Received, Script, ScriptedOpenAI


def _trace() -> Trace:
    rows = [  # (t, session, output tokens); sessions a and b of three turns, two requests on their own
        (0.00, "a", 6), (0.05, None, 3), (0.10, "b", 4), (0.15, "a", 5), (0.20, "b", 2),
        (0.30, None, 3), (0.35, "a", 4), (0.40, "b", 3),
    ]  # fmt: skip
    turns: dict[str, int] = {}
    ids: dict[str, list[int]] = {}
    requests = []
    for n, (t, session, out) in enumerate(rows):
        turn = None
        chain = [1000 + n]
        if session is not None:
            turn = turns[session] = turns.get(session, 0) + 1
            chain = ids[session] = [*ids.get(session, []), 100 * turn + ord(session)]
        requests.append(TraceRequest(t, 16 * len(chain), out, tuple(chain), session, turn))
    return Trace(tuple(requests), block_tokens=16)


WORKLOAD = WorkloadSpec.model_validate(
    {"name": "trace", "input_tokens": 16, "output_tokens": 8, "concurrency": 8, "num_requests": 8}
)


def test_a_trace_goes_over_the_wire_in_its_order_and_time(byte_level_tokenizer: Tokenizer) -> None:
    trace = _trace()
    prompts = trace_prompts(trace, byte_level_tokenizer, 1)
    with ScriptedOpenAI(Script(first_token_delay_s=0.2, inter_token_s=0.01), model="m") as server:
        outcome, records, _ = asyncio.run(replay_trace(server.base_url, "m", None, WORKLOAD, trace, prompts))
        bodies = [r.body for r in server.requests]
    assert [r.index for r in records] == list(range(8))
    assert all(r.error is None for r in records), [r.error for r in records]
    # each request's own max_tokens, and its own prompt
    assert [r.max_tokens for r in records] == [r.output_tokens for r in trace.requests]
    assert [r.usage_output_tokens for r in records] == [r.output_tokens for r in trace.requests]
    sent = {b["messages"][0]["content"]: b["max_tokens"] for b in bodies}
    assert sent == {p.text: r.output_tokens for p, r in zip(prompts, trace.requests, strict=True)}
    by = {r.index: r for r in outcome.records}
    for i, request in enumerate(trace.requests):
        later = [
            j for j in range(i + 1, 8) if request.session and trace.requests[j].session == request.session
        ]
        if later:  # the session's next turn went after this answer had ended
            nxt = by[later[0]]
            assert nxt.sent_s is not None
            assert by[i].done_s is not None
            assert nxt.sent_s >= by[i].done_s
            assert nxt.ready_s == pytest.approx(max(nxt.planned_s, by[i].done_s))
    # the answers take 0.2 s and more: a session's turn waited, the requests on their own did not
    assert by[3].session_wait_s is not None
    assert by[3].session_wait_s > 0
    assert by[1].session_wait_s == 0
    assert by[5].session_wait_s == 0
    assert all(r.t_scheduled <= r.t_send for r in records)


def test_a_failed_turn_ends_its_session_over_the_wire(byte_level_tokenizer: Tokenizer) -> None:
    trace = _trace()
    prompts = trace_prompts(trace, byte_level_tokenizer, 1)
    first_of_b = prompts[2].text

    def script(received: Received) -> Script:
        failing = received.body["messages"][0]["content"] == first_of_b
        return Script(status=500) if failing else Script(inter_token_s=0.005)

    with ScriptedOpenAI(script, model="m") as server:
        outcome, records, _ = asyncio.run(replay_trace(server.base_url, "m", None, WORKLOAD, trace, prompts))
    assert [r.index for r in outcome.skipped] == [4, 7]  # b's turns 2 and 3
    assert {r.skipped for r in outcome.skipped} == {"turn 1 failed"}
    assert [r.index for r in records] == [0, 1, 2, 3, 5, 6]
    assert records[2].error is not None
    assert "HTTP 500" in records[2].error
    assert all(r.error is None for r in records if r.index != 2)


def test_a_replay_needs_a_prompt_per_request(byte_level_tokenizer: Tokenizer) -> None:
    trace = _trace()
    prompts = trace_prompts(trace, byte_level_tokenizer, 1)
    with pytest.raises(BenchmarkError, match="7 prompts for 8 requests"):
        asyncio.run(replay_trace("http://127.0.0.1:9/v1", "m", None, WORKLOAD, trace, prompts[:7]))


def test_a_threaded_session_carries_the_engines_real_answers(byte_level_tokenizer: Tokenizer) -> None:
    """With ``thread``, a later turn sends the conversation so far: the previous turn's messages, the
    answer the server really streamed as the assistant's, then the turn's new part; a request on its
    own and a first turn send their prompt alone."""
    trace = _trace()
    prompts = replay_prompts(trace, byte_level_tokenizer, 1, thread=True)
    with ScriptedOpenAI(Script(inter_token_s=0.002), model="m") as server:
        outcome, records, _ = asyncio.run(
            replay_trace(server.base_url, "m", None, WORKLOAD, trace, prompts, thread=True)
        )
        received = {b["max_tokens"]: b for b in (r.body for r in server.requests)}
        by_prompt = {r.body["messages"][-1]["content"]: r.body["messages"] for r in server.requests}
    assert all(r.error is None for r in records)
    assert not outcome.skipped
    # session a: turns 0, 3, 6; each later turn holds every earlier turn and its answer
    first, second, third = (by_prompt[prompts[i].text] for i in (0, 3, 6))
    assert first == [{"role": "user", "content": prompts[0].text}]
    assert [m["role"] for m in second] == ["user", "assistant", "user"]
    assert second[0] == first[0]
    assert [m["role"] for m in third] == ["user", "assistant", "user", "assistant", "user"]
    assert third[:3] == second
    # the assistant's words are what the server streamed for that turn, not the recorded text
    assert second[1]["content"]
    assert second[1]["content"] not in prompts[0].text
    assert len(received) >= 5  # distinct max_tokens: each request sent its own
    # a later turn's own prompt is the new part only (shorter than the whole rebuilt prompt)
    whole = trace_prompts(trace, byte_level_tokenizer, 1)
    assert prompts[3].tokens < whole[3].tokens
    assert prompts[1].text == whole[1].text  # a request on its own: the whole prompt


def test_a_mooncake_file_and_opentelemetry_spans_convert_and_replay(
    tmp_path: Path, byte_level_tokenizer: Tokenizer
) -> None:
    """Each format the issue names, converted by `k3pipe trace convert` and replayed over the wire: every
    request sent with its length and answer, the converted sharing rebuilt token for token, a session's
    turn after its previous answer."""
    from typer.testing import CliRunner

    from k3pipe.cli.main import app
    from k3pipe.schema.traces import read_trace

    mooncake = tmp_path / "mooncake.jsonl"
    mooncake.write_text(
        "".join(
            json.dumps(r) + "\n"
            for r in (
                {"timestamp": 0, "input_length": 40, "output_length": 5, "hash_ids": [7, 8, 9]},
                {"timestamp": 20, "input_length": 44, "output_length": 3, "hash_ids": [7, 8, 10]},
                {"timestamp": 50, "input_length": 30, "output_length": 4, "hash_ids": [11, 12]},
            )
        )
    )
    nanos = 1_700_000_000 * 10**9

    def span(start_ms: int, inp: int, out: int, conversation: str) -> dict[str, object]:
        return {"name": "chat", "startTimeUnixNano": str(nanos + start_ms * 10**6), "attributes": [
            {"key": "gen_ai.usage.input_tokens", "value": {"intValue": str(inp)}},
            {"key": "gen_ai.usage.output_tokens", "value": {"intValue": str(out)}},
            {"key": "gen_ai.conversation.id", "value": {"stringValue": conversation}},
        ]}  # fmt: skip

    otel = tmp_path / "spans.json"
    spans = [span(0, 40, 6, "c1"), span(30, 35, 4, "c2"), span(60, 70, 5, "c1")]
    otel.write_text(json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": spans}]}]}))

    runner = CliRunner()
    for source, path in (("mooncake", mooncake), ("otel", otel)):
        dest = tmp_path / f"{source}-k3.jsonl"
        argv = ["trace", "convert", str(path), str(dest), "--from", source, "--block-tokens", "16"]
        done = runner.invoke(app, argv)
        assert done.exit_code == 0, done.output
        trace = read_trace(dest)
        prompts = trace_prompts(trace, byte_level_tokenizer, 3)
        with ScriptedOpenAI(Script(inter_token_s=0.005), model="m") as server:
            outcome, records, _ = asyncio.run(
                replay_trace(server.base_url, "m", None, WORKLOAD, trace, prompts, speed=4)
            )
        assert all(r.error is None for r in records), (source, [r.error for r in records])
        assert [r.sent_s is not None for r in outcome.records] == [True] * len(trace.requests)
        assert [r.usage_output_tokens for r in records] == [r.output_tokens for r in trace.requests]
        for prompt, request in zip(prompts, trace.requests, strict=True):
            assert len(byte_level_tokenizer.encode(prompt.text, add_special_tokens=False).ids) == (
                request.input_tokens
            )
        # the blocks the converted ids share are the same tokens in the rebuilt prompts
        first, second = prompts[0], prompts[1 if source == "mooncake" else 2]
        ids = [byte_level_tokenizer.encode(p.text, add_special_tokens=False).ids for p in (first, second)]
        assert ids[0][:32] == ids[1][:32]
