"""The structured-output check (k3pipe.bench.structured) against answers whose faults are known: the
scripted server answering tool-calling requests with good and broken calls as vLLM 0.32.0 spells
them (k3pipe/testing/scripted_tools.py), streamed and not; each broken answer found with its kind, no good one
called broken, reasoning leaks counted only where the arm has a reasoning parser, and the rate with
its interval."""

from __future__ import annotations

import json

import pytest

from k3pipe.bench.structured import (
    TOOLS,
    StructuredRecord,
    check_message,
    merge_stream,
    read_structured,
    run_structured,
)
from k3pipe.testing.scripted_openai import ScriptedOpenAI
from k3pipe.testing.scripted_tools import BEHAVIOURS, FAILING, ToolScript


@pytest.mark.parametrize("reasoning_parser", [True, False])
def test_every_broken_answer_is_found_streamed_and_not(reasoning_parser: bool) -> None:
    # each behaviour twice in a row: once not streamed (even requests), once streamed (odd ones)
    behaviours = [b for b in BEHAVIOURS for _ in (0, 1)]
    with ScriptedOpenAI(model="m", tools=ToolScript(behaviours)) as engine:
        record = run_structured(
            engine.base_url, "m", len(behaviours), tool_parser=True, reasoning_parser=reasoning_parser
        )
        sent = [r.body for r in engine.requests]
    assert record.error is None
    assert [c.stream for c in record.calls] == [False, True] * len(BEHAVIOURS)
    for behaviour, call in zip(behaviours, record.calls, strict=True):
        want = FAILING.get(behaviour)
        if behaviour == "reasoning-leak" and not reasoning_parser:
            want = None  # no reasoning parser: reasoning in content is what was asked for
        assert call.failure == want, (behaviour, call)
    assert all(b["tools"] == list(TOOLS) and b["tool_choice"] == "auto" for b in sent)
    calls = {c.request: c.tool_calls for c in record.calls}
    assert calls["t000"] == 1  # 'good', not streamed
    assert calls["t001"] == 1  # 'good', streamed: the call put together from its deltas
    failing = len([b for b in behaviours if b in FAILING]) - (0 if reasoning_parser else 2)
    assert record.failures == failing
    rate = record.per_1000()
    assert rate is not None
    assert rate[0] == pytest.approx(1000 * failing / len(behaviours))
    assert rate[1] < rate[0] < rate[2]
    assert read_structured(json.loads(json.dumps(record.as_json()))).kinds() == record.kinds()


def test_a_refused_request_is_a_failure_and_the_check_goes_on() -> None:
    from k3pipe.testing.scripted_openai import Script

    with ScriptedOpenAI(Script(status=500), model="m") as engine:  # no tools script: every answer 500
        record = run_structured(engine.base_url, "m", 3, tool_parser=True, reasoning_parser=False)
    assert [c.failure for c in record.calls] == ["request refused"] * 3
    assert "answered 500" in record.calls[0].detail


def test_a_stream_is_put_together_by_the_index_of_each_call() -> None:
    def delta(**d: object) -> dict:
        return {"choices": [{"index": 0, "delta": d}]}

    chunks = [
        delta(role="assistant", content=""),
        delta(reasoning="think "),
        delta(reasoning_content="more"),
        delta(tool_calls=[{"index": 0, "id": "a", "type": "function", "function": {"name": "get_weather"}}]),
        delta(tool_calls=[{"index": 1, "id": "b", "type": "function", "function": {"name": "run_python"}}]),
        delta(tool_calls=[{"index": 0, "function": {"arguments": '{"city": '}}]),
        delta(tool_calls=[{"index": 1, "function": {"arguments": '{"code": "x"}'}}]),
        delta(tool_calls=[{"index": 0, "function": {"arguments": '"Oslo"}'}}]),
    ]
    message = merge_stream(chunks)
    assert message["content"] is None
    assert message["reasoning"] == "think more"
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("a", "get_weather", '{"city": "Oslo"}'),
        ("b", "run_python", '{"code": "x"}'),
    ]
    assert check_message(message, reasoning_parser=True) == (None, "")


def test_what_makes_a_message_fail() -> None:
    def call(name: str, arguments: str) -> dict:
        return {"tool_calls": [{"function": {"name": name, "arguments": arguments}}]}

    assert check_message(call("get_weather", '{"city": "Oslo", "unit": "kelvin"}'), reasoning_parser=False)[
        0
    ] == ("arguments break the schema")
    assert check_message(call("run_python", ""), reasoning_parser=False)[0] == "tool call without arguments"
    assert check_message({"content": "fine <|open|>tools<|sep|>"}, reasoning_parser=False)[0] == (
        "tool-call markup in content"
    )
    assert (
        check_message({"content": "a<|open|>think<|sep|>b"}, reasoning_parser=True)[0]
        == "reasoning in content"
    )
    assert check_message({"content": "plain"}, reasoning_parser=True) == (None, "")
    assert StructuredRecord(True, False).per_1000() is None
