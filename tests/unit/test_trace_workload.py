"""A trace as a workload (issue 49, items 2-4): `workload.trace` read and checked where the experiment is
parsed, what the chat template adds counted, each replayed prompt cut to what the replay sends of its
own, and the replay's fidelity figures and bounds worked out from a replay whose answers are known."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from k3pipe.bench.replay import FIDELITY_BOUNDS, ReplayOutcome, ReplayRecord, fidelity, fidelity_problems
from k3pipe.core.errors import SpecError
from k3pipe.experiment.load import parse_experiment
from k3pipe.prompts.chat_template import template_cost
from k3pipe.prompts.trace_prompts import previous_turns, replay_prompts, trace_prompts
from k3pipe.schema.specs import WorkloadSpec
from k3pipe.schema.traces import Trace, TraceRequest, agentic_trace, write_trace

BASE = {
    "name": "e",
    "model": {"source": "local", "path": "/m"},
    "arms": [
        {"name": "a", "engine": {"kind": "vllm"}, "launcher": {"kind": "external"},
         "endpoint": {"base_url": "http://127.0.0.1:1/v1", "model": "m"}}
    ],
}  # fmt: skip


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    path = tmp_path / "agentic.jsonl"
    write_trace(agentic_trace(1, sessions=5, turns=(3, 6), context_tokens=3000, system_tokens=256), path)
    return path


def test_a_trace_sets_its_workloads_lengths_requests_and_streams(trace_file: Path) -> None:
    w = WorkloadSpec.model_validate({"name": "w", "trace": str(trace_file)})
    trace = w.loaded_trace()
    assert w.input_tokens == max(r.input_tokens for r in trace.requests)
    assert w.output_tokens == max(r.output_tokens for r in trace.requests)
    assert w.num_requests == len(trace.requests)
    assert 1 <= w.concurrency <= 5  # at most every session open at once
    assert w.trace is not None
    assert w.trace.speed == 1.0
    assert w.trace.thread_answers
    cut = WorkloadSpec.model_validate({"name": "w", "trace": {"path": str(trace_file), "requests": 4}})
    assert cut.num_requests == 4
    assert cut.loaded_trace().requests == trace.requests[:4]
    # a given field equal to the trace's is accepted (a recorded spec parses again)
    again = WorkloadSpec.model_validate(w.model_dump(mode="json"))
    assert again.input_tokens == w.input_tokens


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"input_tokens": 7}, "input_tokens=7 but the trace"),
        ({"load": "poisson", "rate_rps": 2}, "load='poisson' does not apply to a trace"),
        ({"warmup_requests": 2}, "warmup_requests=2 does not apply"),
        ({"dataset": {"kind": "sharegpt", "path": "x.json"}}, "dataset does not apply to a trace"),
        ({"trace": "/nowhere/t.jsonl"}, "trace.path '/nowhere/t.jsonl' (/nowhere/t.jsonl) does not exist"),
        ({"trace": {"path": "T", "speed": 0}}, "workloads[0].trace.speed: must be greater than 0"),
        ({"trace": {"path": "T", "requests": 10_000}}, "trace.requests 10000 is more than the"),
    ],
)
def test_a_bad_trace_workload_is_refused_naming_the_field(
    trace_file: Path, change: dict[str, object], expected: str
) -> None:
    workload: dict[str, object] = {"name": "w", "trace": str(trace_file), **change}
    if isinstance(workload["trace"], dict):
        workload["trace"] = {**workload["trace"], "path": str(trace_file)}
    with pytest.raises(SpecError) as err:
        parse_experiment({**BASE, "workloads": [workload]}, "e.yaml")
    assert expected in str(err.value)
    assert "required field is missing" not in str(err.value)  # only what is wrong is named


def test_a_malformed_trace_is_refused_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"k3pipe_trace": 1, "block_tokens": 16}\n{"t": 0, "input_tokens": -3, "output_tokens": 4}\n'
    )
    with pytest.raises(SpecError, match=r"workloads\[0\]: trace .*line 2.*input_tokens"):
        parse_experiment({**BASE, "workloads": [{"name": "w", "trace": str(path)}]}, "e.yaml")


def _model_dir(tmp_path: Path, tokenizer: Tokenizer, template: object, name: str = "m") -> Path:
    model = tmp_path / name
    model.mkdir()
    tokenizer.save(str(model / "tokenizer.json"))
    config: dict[str, object] = {"bos_token": "<|endoftext|>", "eos_token": {"content": "<|im_end|>"}}
    if template is not None:
        config["chat_template"] = template
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    return model


CHATML = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_the_chat_templates_tokens_are_counted_as_the_engine_renders_them(
    tmp_path: Path, byte_level_tokenizer: Tokenizer
) -> None:
    from k3pipe.prompts.chat_template import load_chat_template, render_chat

    named = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": CHATML}]
    model = _model_dir(tmp_path, byte_level_tokenizer, named)
    cost = template_cost(model, byte_level_tokenizer)
    loaded = load_chat_template(model)
    assert loaded is not None
    assert loaded[0] == CHATML  # the default of named templates
    assert loaded[1] == {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}

    def count(text: str) -> int:
        return len(byte_level_tokenizer.encode(text, add_special_tokens=False).ids)

    user, answer, nxt = "def main(): return None", "the answer is four", "and then what follows"
    one = [{"role": "user", "content": user}]
    three = [*one, {"role": "assistant", "content": answer}, {"role": "user", "content": nxt}]
    assert count(render_chat(CHATML, loaded[1], one)) == pytest.approx(count(user) + cost.first, abs=1)
    rendered = count(render_chat(CHATML, loaded[1], three))
    assert rendered == pytest.approx(count(user) + count(answer) + count(nxt) + cost.first + cost.turn, abs=2)
    assert cost.first > 5
    assert cost.turn > cost.first  # markup around one message, then around two
    # a model without a template: its prompts go as they are
    bare = template_cost(_model_dir(tmp_path, byte_level_tokenizer, None, "bare"), byte_level_tokenizer)
    assert (bare.first, bare.turn, bare.template) == (0, 0, "none")


def test_a_replays_prompts_are_cut_to_what_it_sends_of_its_own(byte_level_tokenizer: Tokenizer) -> None:
    trace = agentic_trace(
        2, sessions=3, turns=(3, 4), context_tokens=2500, system_tokens=128, block_tokens=16
    )
    whole = trace_prompts(trace, byte_level_tokenizer, 5)
    plain = replay_prompts(trace, byte_level_tokenizer, 5, template_first=9)
    threaded = replay_prompts(trace, byte_level_tokenizer, 5, template_first=9, template_turn=12, thread=True)
    before = previous_turns(trace)
    for i, r in enumerate(trace.requests):
        # the template's tokens come off the front (the shared blocks stay shared)
        assert plain[i].tokens == pytest.approx(r.input_tokens - 9, abs=1)
        assert whole[i].text.endswith(plain[i].text)
        prev = before[i]
        if prev is None:
            assert threaded[i] == plain[i]
            continue
        p = trace.requests[prev]
        new = r.input_tokens - p.input_tokens - p.output_tokens - 12
        assert threaded[i].tokens == pytest.approx(max(new, 1), abs=1)
        assert whole[i].text.endswith(threaded[i].text)
    assert sum(b is not None for b in before) == len(trace.requests) - 3  # one first turn a session


def _outcome() -> tuple[Trace, list[float], ReplayOutcome]:
    """Twelve requests planned 1 s apart; lags 0.5 ms, one of 30 ms; the last two not sent; the
    sends of the second window bunched late into the third."""
    requests = tuple(TraceRequest(float(i), 100, 10, (i,)) for i in range(12))
    trace = Trace(requests, block_tokens=100)
    plan = [float(i) for i in range(12)]
    records = []
    for i in range(10):
        lag = 0.030 if i == 3 else 0.0005
        sent = plan[i] + lag + (1.6 if i in (6, 7) else 0.0)  # two of the second window slip into the third
        records.append(ReplayRecord(i, plan[i], sent - lag, sent, sent + 0.5, True))
    records += [
        ReplayRecord(10, 10.0, skipped="turn 1 failed"),
        ReplayRecord(11, 11.0, skipped="turn 1 failed"),
    ]
    return trace, plan, ReplayOutcome(tuple(records))


def test_the_replays_fidelity_is_worked_out_from_its_records() -> None:
    trace, plan, outcome = _outcome()
    usage: list[int | None] = [100, 100, 104, 100, 100, 100, 100, 100, 90, 100, None, None]
    got = fidelity(trace, plan, outcome, usage)
    assert got["replay_sent"] == 10
    assert got["replay_skipped"] == 2
    assert got["replay_lag_ms_p50"] == pytest.approx(0.5)
    assert got["replay_lag_ms_max"] == pytest.approx(30.0)
    assert 0.5 < got["replay_lag_ms_p99"] <= 30.0
    # windows of a third of the 11 s: planned 4, 4, 4 (at least 20 to count: none); with 1 s windows none
    assert got["replay_rate_window_s"] == pytest.approx(11 / 3)
    assert "replay_rate_dev_pct_max" not in got
    assert got["replay_prompt_tokens_dev_pct_p50"] == 0.0
    assert got["replay_prompt_tokens_dev_pct_max"] == pytest.approx(10.0)
    assert got["trace_hit_rate_pct"] == 0.0  # no block shared
    problems = fidelity_problems(got)
    assert len(problems) == 2
    assert problems[0].startswith("the sender's lag p99 (ms)")
    assert "requests not sent" in problems[1]
    assert fidelity_problems({k: 0.0 for k in FIDELITY_BOUNDS}) == []


def test_the_offered_rate_is_compared_window_by_window() -> None:
    """Sixty-one requests planned over 3 minutes: windows of a minute, twenty planned in each of the
    first three; ten of the second window's sends slip into the third. A window of fewer than 20
    planned sends is not compared (one slipped request would be a gap over 5%)."""
    requests = tuple(TraceRequest(3.0 * i, 10, 1, ()) for i in range(61))
    trace = Trace(requests, block_tokens=16)
    plan = [r.t for r in requests]
    shifted = [t + (30.0 if 30 <= i < 40 else 0.0) for i, t in enumerate(plan)]
    outcome = ReplayOutcome(tuple(ReplayRecord(i, plan[i], s, s, s + 1, True) for i, s in enumerate(shifted)))
    got = fidelity(trace, plan, outcome, [None] * 61)
    assert got["replay_rate_window_s"] == 60.0
    assert got["replay_rate_dev_pct_max"] == pytest.approx(50.0)  # 10 of 20 sent, and 30 of 20
    assert got["replay_lag_ms_max"] == 0.0  # the slips were waits for answers, not the sender's
    assert got["replay_session_wait_s_max"] == pytest.approx(30.0)
