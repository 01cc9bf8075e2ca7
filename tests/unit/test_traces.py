"""Traces (k3pipe/schema/traces.py): the format read back as written and refused with the line, the
field and what to do; the theoretical prefix-cache hit rate on traces whose sharing is set by hand;
the ready agentic trace's sessions, context bound and shared system prompts; Mooncake's format (its
published example lines) and OpenTelemetry GenAI spans converted with their timing and sessions."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest

from k3pipe.core.errors import SpecError
from k3pipe.schema.traces import (
    Trace,
    TraceRequest,
    agentic_trace,
    arrivals,
    cumulative_hit_rate,
    from_mooncake,
    from_otel,
    read_trace,
    theoretical_hit_rate,
    write_trace,
)


def _lines(path: Path, *rows: dict) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


HEADER = {"k3pipe_trace": 1, "block_tokens": 4, "source": "hand", "text": False}


def test_a_trace_reads_back_as_written_and_its_digest_is_its_content(tmp_path: Path) -> None:
    trace = agentic_trace(7, sessions=5)
    write_trace(trace, tmp_path / "t.jsonl")
    again = read_trace(tmp_path / "t.jsonl")
    assert again == trace
    assert again.digest == trace.digest
    assert agentic_trace(8, sessions=5).digest != trace.digest
    assert "text" in json.loads((tmp_path / "t.jsonl").read_text().splitlines()[0])


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"k3pipe_trace": 2, "block_tokens": 4}], "format version 2; this k3pipe reads version 1"),
        ([{"timestamp": 0, "input_length": 9, "output_length": 1, "hash_ids": [1]}], "a Mooncake trace"),
        ([{**HEADER, "block_tokens": 0}], "block_tokens=0: give a whole number >= 1"),
        ([HEADER], "no request after the header"),
        ([HEADER, {"t": -1, "input_tokens": 4, "output_tokens": 1}], "line 2: t=-1"),
        ([HEADER, {"t": 0, "input_tokens": 0, "output_tokens": 1}], "line 2: input_tokens=0"),
        (
            [HEADER, {"t": 0, "input_tokens": 9, "output_tokens": 1, "hash_ids": [1, 2]}],
            "2 hash_ids for input_tokens=9",
        ),
        (
            [
                HEADER,
                {"t": 1, "input_tokens": 4, "output_tokens": 1},
                {"t": 0.5, "input_tokens": 4, "output_tokens": 1},
            ],
            "line 3: t=0.5 is before the line above's (1)",
        ),
        (
            [HEADER, {"t": 0, "session": "a", "turn": 2, "input_tokens": 4, "output_tokens": 1}],
            "session 'a' turn 2, expected turn 1",
        ),
        ([HEADER, {"t": 0, "turn": 1, "input_tokens": 4, "output_tokens": 1}], "turn=1 without a session"),
        ([HEADER, {"t": 0, "input_tokens": 4, "output_tokens": 1, "kind": "image"}], "kind='image'"),
    ],
)  # fmt: skip
def test_a_bad_trace_is_refused_with_its_line_and_field(
    tmp_path: Path, rows: list[dict], message: str
) -> None:
    with pytest.raises(SpecError, match="trace") as caught:
        read_trace(_lines(tmp_path / "bad.jsonl", *rows))
    assert message in str(caught.value)


def test_a_trace_that_is_not_json_lines_names_its_line(tmp_path: Path) -> None:
    (tmp_path / "t.jsonl").write_text(json.dumps(HEADER) + "\n{oops\n")
    with pytest.raises(SpecError, match="line 2 is not JSON"):
        read_trace(tmp_path / "t.jsonl")


def test_the_theoretical_hit_rate_counts_the_blocks_seen_before_in_send_order() -> None:
    # blocks of 4 tokens: the second request shares its first two blocks (8 tokens) of 10; the third
    # shares its first block and its partial last block is new; the fourth is all new
    trace = Trace(
        (
            TraceRequest(0, 10, 1, (1, 2, 3)),
            TraceRequest(1, 10, 1, (1, 2, 4)),
            TraceRequest(2, 6, 1, (1, 5)),
            TraceRequest(3, 3, 1, (6,)),
        ),
        block_tokens=4,
    )
    assert theoretical_hit_rate(trace) == pytest.approx((8 + 4) / (10 + 10 + 6 + 3))
    # the same requests in the other order: the first one sent shares nothing
    reordered = Trace(tuple(reversed(trace.requests)), 4)
    assert theoretical_hit_rate(reordered) == pytest.approx((4 + 8) / 29)
    assert theoretical_hit_rate(Trace((TraceRequest(0, 10, 1),), 4)) == 0.0  # no ids: nothing shared


def test_with_answers_the_hit_rate_also_counts_what_the_previous_answer_covers() -> None:
    # blocks of 4: turn 1 is 6 tokens in, 5 out (11: two whole blocks of its prompt and answer);
    # turn 2 (16 tokens) continues it: its blocks 0-1 are held by turn 1's prompt and answer (block 0
    # also by the prompt alone); turn 3 of another conversation (its ids differ) holds nothing of it
    t1 = TraceRequest(0, 6, 5, (1, 2), "a", 1)
    t2 = TraceRequest(1, 16, 3, (1, 7, 8, 9), "a", 2)
    other = TraceRequest(2, 8, 3, (30, 31), "a", 3)
    trace = Trace((t1, t2, other), block_tokens=4)
    assert theoretical_hit_rate(trace) == pytest.approx(4 / 30)  # block 1 seen before, once
    # with answers: turn 2's first two blocks (8 tokens); turn 3 does not continue turn 2's prompt
    assert theoretical_hit_rate(trace, with_answers=True) == pytest.approx(8 / 30)
    # a turn whose previous answer was shorter than a block past its prompt gains nothing more
    short = Trace((TraceRequest(0, 8, 1, (1, 2), "b", 1), TraceRequest(1, 12, 1, (1, 2, 3), "b", 2)), 4)
    assert theoretical_hit_rate(short, with_answers=True) == pytest.approx(8 / 20)
    assert theoretical_hit_rate(short) == pytest.approx(8 / 20)


def test_the_hit_rate_curve_and_the_arrivals_of_a_trace_set_by_hand() -> None:
    trace = Trace(
        (
            TraceRequest(0.0, 10, 1, (1, 2, 3)),
            TraceRequest(4.0, 10, 1, (1, 2, 4)),
            TraceRequest(9.9, 6, 1, (1, 5)),
            TraceRequest(25.0, 3, 1, (6,)),
        ),
        block_tokens=4,
    )
    assert cumulative_hit_rate(trace) == pytest.approx([0, 8 / 20, 12 / 26, 12 / 29])
    assert cumulative_hit_rate(trace)[-1] == pytest.approx(theoretical_hit_rate(trace))
    assert arrivals(trace, 10.0) == [3, 0, 1]
    assert arrivals(trace, 5.0) == [2, 1, 0, 0, 0, 1]
    with pytest.raises(ValueError, match="bin_s must be > 0"):
        arrivals(trace, 0)


def test_the_agentic_trace_has_its_sessions_context_bound_and_shared_system_prompts() -> None:
    trace = agentic_trace(
        3, sessions=12, turns=(3, 8), context_tokens=8192, system_prompts=2, system_tokens=512
    )
    sessions = trace.sessions()
    assert len(sessions) == 12
    assert all(r.input_tokens < 8192 for r in trace.requests)
    assert all(math.ceil(r.input_tokens / 64) == len(r.hash_ids) for r in trace.requests)
    times = [r.t for r in trace.requests]
    assert times == sorted(times)
    for turns in sessions.values():
        assert [r.turn for r in turns] == list(range(1, len(turns) + 1))
        assert len(turns) <= 8
        assert turns[0].kind == "user"
        for a, b in itertools.pairwise(turns):
            # a turn carries the previous prompt and its answer: every full block of it, then more
            full = a.input_tokens // 64
            assert b.hash_ids[:full] == a.hash_ids[:full]
            assert b.input_tokens > a.input_tokens + a.output_tokens
            assert b.t > a.t
    # the system prompt (8 blocks) is shared by the sessions that drew the same one: two ids at most
    firsts = {turns[0].hash_ids[:8] for turns in sessions.values()}
    assert 1 <= len(firsts) <= 2
    assert len({turns[0].hash_ids[8] for turns in sessions.values()}) == 12  # the rest is each its own
    shape = trace.shape()
    assert shape.sessions == 12
    assert 0.5 < shape.theoretical_hit_rate < 1.0  # growing contexts: most of each prompt seen before
    assert "theoretical prefix-cache hit rate" in "\n".join(shape.lines())


def test_the_agentic_trace_is_its_seed() -> None:
    assert agentic_trace(5) == agentic_trace(5)
    assert agentic_trace(5) != agentic_trace(6)


def test_mooncakes_published_lines_convert_with_their_times_and_sharing(tmp_path: Path) -> None:
    # the first lines of Mooncake's example trace (block size 512) and AIPerf's session extension
    path = _lines(
        tmp_path / "mooncake.jsonl",
        {"timestamp": 0, "input_length": 6755, "output_length": 500, "hash_ids": list(range(14))},
        {"timestamp": 0, "input_length": 7319, "output_length": 490, "hash_ids": [0, *range(14, 28)]},
        {"timestamp": 3052, "input_length": 7234, "output_length": 794, "hash_ids": [0, *range(28, 42)]},
        {"timestamp": 3052, "input_length": 2287, "output_length": 316, "hash_ids": [0, 42, 43, 44, 45]},
    )
    trace = from_mooncake(path)
    assert trace.block_tokens == 512
    assert [r.t for r in trace.requests] == [0.0, 0.0, 3.052, 3.052]
    assert [r.input_tokens for r in trace.requests] == [6755, 7319, 7234, 2287]
    # block 0 (512 tokens) shared by the three later requests
    assert trace.shape().theoretical_hit_rate == pytest.approx(3 * 512 / (6755 + 7319 + 7234 + 2287))
    write_trace(trace, tmp_path / "k3.jsonl")
    assert read_trace(tmp_path / "k3.jsonl") == trace

    # AIPerf's multi-turn lines (session_id, no timestamp), here with blocks of 4096 tokens
    sessions = _lines(
        tmp_path / "sessions.jsonl",
        {"session_id": "conv_0", "input_length": 9176, "output_length": 142, "hash_ids": [1, 2, 3]},
        {"session_id": "conv_0", "input_length": 12300, "output_length": 98, "hash_ids": [1, 2, 3, 4]},
    )
    with pytest.raises(SpecError, match="3 hash_ids for input_length=9176: at 512 tokens a block that is 18"):
        from_mooncake(sessions)
    converted = from_mooncake(sessions, block_tokens=4096)
    assert [(r.session, r.turn) for r in converted.requests] == [("conv_0", 1), ("conv_0", 2)]
    assert converted.requests[1].hash_ids[:3] == converted.requests[0].hash_ids


def _span(start_s: float, inp: int, out: int, conversation: str | None) -> dict:
    attrs = [
        {"key": "gen_ai.operation.name", "value": {"stringValue": "chat"}},
        {"key": "gen_ai.request.model", "value": {"stringValue": "kimi"}},
        {"key": "gen_ai.usage.input_tokens", "value": {"intValue": str(inp)}},
        {"key": "gen_ai.usage.output_tokens", "value": {"intValue": str(out)}},
    ]
    if conversation:
        attrs.append({"key": "gen_ai.conversation.id", "value": {"stringValue": conversation}})
    nanos = int(1_700_000_000e9 + start_s * 1e9)
    return {
        "name": "chat kimi",
        "startTimeUnixNano": str(nanos),
        "endTimeUnixNano": str(nanos + 10**9),
        "attributes": attrs,
    }


def test_opentelemetry_genai_spans_convert_with_sessions_inferred(tmp_path: Path) -> None:
    spans = [
        _span(0.0, 100, 20, "c1"),
        _span(0.5, 300, 10, None),
        _span(2.0, 180, 30, "c1"),  # the first turn's 100 + its answer's 20 + 60 new
        {"name": "tool call", "startTimeUnixNano": "1", "attributes": []},  # not an inference: skipped
    ]
    doc = {"resourceSpans": [{"scopeSpans": [{"spans": spans[:2]}]}, {"scopeSpans": [{"spans": spans[2:]}]}]}
    (tmp_path / "spans.json").write_text(json.dumps(doc))
    trace = from_otel(tmp_path / "spans.json", block_tokens=16)
    assert [(r.t, r.session, r.turn) for r in trace.requests] == [
        (0.0, "c1", 1),
        (0.5, None, None),
        (2.0, "c1", 2),
    ]
    first, alone, second = trace.requests
    assert second.hash_ids[: 100 // 16] == first.hash_ids[: 100 // 16]  # the first prompt's full blocks
    assert not set(alone.hash_ids) & (set(first.hash_ids) | set(second.hash_ids))
    # one line per export batch reads the same
    (tmp_path / "spans.jsonl").write_text(json.dumps(doc) + "\n")
    assert from_otel(tmp_path / "spans.jsonl", block_tokens=16).requests == trace.requests
    (tmp_path / "empty.json").write_text(json.dumps({"resourceSpans": []}))
    with pytest.raises(SpecError, match="no GenAI inference span"):
        from_otel(tmp_path / "empty.json")


def test_the_trace_commands_make_convert_and_show_a_trace(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from k3pipe.cli.main import app

    runner = CliRunner()
    made = runner.invoke(app, ["trace", "make", str(tmp_path / "a.jsonl"), "--seed", "4", "--sessions", "6"])
    assert made.exit_code == 0, made.output
    assert read_trace(tmp_path / "a.jsonl") == agentic_trace(4, sessions=6)
    assert "6 sessions" in made.output
    assert "theoretical prefix-cache hit rate" in made.output
    shown = runner.invoke(
        app, ["trace", "show", str(tmp_path / "a.jsonl"), "--plot", str(tmp_path / "a.png")]
    )
    assert shown.exit_code == 0, shown.output
    assert agentic_trace(4, sessions=6).digest in shown.output
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    mooncake = _lines(
        tmp_path / "m.jsonl", {"timestamp": 0, "input_length": 655, "output_length": 52, "hash_ids": [46, 47]}
    )
    refused = runner.invoke(app, ["trace", "show", str(mooncake)])
    assert refused.exit_code != 0
    assert "k3pipe trace convert --from mooncake" in str(refused.exception)
    converted = runner.invoke(
        app, ["trace", "convert", str(mooncake), str(tmp_path / "k.jsonl"), "--from", "mooncake"]
    )
    assert converted.exit_code == 0, converted.output
    assert read_trace(tmp_path / "k.jsonl").requests[0].hash_ids == (0, 1)


def test_the_prompt_tree_makes_each_block_once_and_refuses_ids_that_are_not_chained() -> None:
    from k3pipe.prompts.trace_prompts import prompt_tree

    # blocks of 4: request 2 shares request 1's two full blocks; request 3 its first; request 4 ends
    # in a partial block of request 1's id 3 but longer: a leaf of its own
    trace = Trace(
        (
            TraceRequest(0, 10, 1, (1, 2, 3)),
            TraceRequest(1, 12, 1, (1, 2, 4)),
            TraceRequest(2, 6, 1, (1, 5)),
            TraceRequest(3, 11, 1, (1, 2, 3)),
            TraceRequest(4, 5, 1),
        ),
        block_tokens=4,
    )
    nodes, of_request = prompt_tree(trace)
    assert nodes == [
        (None, 4), (0, 8), (1, 10),  # 1, 2, 3 (partial: 10 tokens)
        (1, 12),  # 4 (full)
        (0, 6),  # 5 (partial)
        (1, 11),  # 3 again, 11 tokens: its own leaf
        (None, 5),  # no ids: a prompt of its own
    ]  # fmt: skip
    assert of_request == [2, 3, 4, 5, 6]
    broken = Trace((TraceRequest(0, 8, 1, (1, 2)), TraceRequest(1, 8, 1, (2, 1))), block_tokens=4)
    with pytest.raises(
        SpecError, match="block id 2 at block 1 after id None, but earlier at block 2 after id 1"
    ):
        prompt_tree(broken)
