"""The accuracy set (k3pipe.bench.accuracy): questions read from a local JSONL (GSM8K's shape and the
prompt/target one), answers marked by number, text or containment, asked through the scripted
server's non-streamed chat answers (vLLM's ChatCompletionResponse) with a known share right, and a
missing or malformed set refused by preflight before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from k3pipe.bench.accuracy import is_right, load_questions, read_accuracy, run_accuracy
from k3pipe.core.errors import BenchmarkError
from k3pipe.testing.scripted_openai import ScriptedOpenAI
from tests.conftest import REPO

ARITH = REPO / "tests" / "fixtures" / "datasets" / "arith.jsonl"


def test_answers_are_marked_as_the_match_says() -> None:
    assert is_right("So the answer is 1,234.", "...\n#### 1234", "number")
    assert is_right("It is 42.0", "#### 42", "number")
    assert not is_right("It is 41, not 42... wait 43", "#### 42", "number")  # the last number counts
    assert not is_right("no number", "#### 42", "number")
    assert is_right("  Paris ", "paris", "exact")
    assert not is_right("Paris, France", "paris", "exact")
    assert is_right("I think it is Paris, France.", "paris", "contains")


def test_questions_are_read_with_their_digest_and_limit(tmp_path: Path) -> None:
    questions, digest = load_questions(ARITH)
    assert len(questions) == 20
    assert questions[0].qid == "q00000"
    assert questions[0].answer.endswith("#### 11")
    assert len(load_questions(ARITH, limit=5)[0]) == 5
    assert load_questions(ARITH, limit=5)[1] == digest  # the digest is the file's
    other = tmp_path / "pt.jsonl"
    other.write_text(json.dumps({"prompt": "Capital of France?", "target": "Paris"}) + "\n\n")
    assert [(q.question, q.answer) for q in load_questions(other)[0]] == [("Capital of France?", "Paris")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "x", "answer": "1"}\n{"q": "y"}\n')
    with pytest.raises(BenchmarkError, match="line 2: needs 'question' and 'answer'"):
        load_questions(bad)
    with pytest.raises(BenchmarkError, match="does not exist"):
        load_questions(tmp_path / "none.jsonl")


def test_the_score_through_an_endpoint_that_gets_every_third_question_wrong() -> None:
    questions, digest = load_questions(ARITH)
    truth = {q.question: q.answer.split("####")[-1].strip() for q in questions}

    def answer(body: dict) -> str:
        asked = body["messages"][-1]["content"]
        k = list(truth).index(asked)
        return f"The total is {int(truth[asked]) + (1 if k % 3 == 0 else 0)}."

    with ScriptedOpenAI(model="m", answer=answer) as engine:
        record = run_accuracy(
            engine.base_url, "m", questions, digest=digest, path=str(ARITH), match="number", max_tokens=64,
            concurrency=4,
        )  # fmt: skip
        sent = [r.body for r in engine.requests]
    assert record.error is None
    assert list(record.right) == [q.qid for q in questions]  # the set's order, whatever finished first
    assert sum(record.right.values()) == 20 - 7  # questions 0, 3, ..., 18 answered one off
    assert record.score == pytest.approx(13 / 20)
    assert all(b["temperature"] == 0.0 and b["max_tokens"] == 64 and b["stream"] is False for b in sent)
    again = read_accuracy(json.loads(json.dumps(record.as_json())))
    assert again.right == record.right
    assert again.digest == digest


def test_a_missing_or_malformed_set_is_a_preflight_error(tmp_path: Path) -> None:
    import yaml

    from k3pipe.experiment.load import load_experiment_text
    from k3pipe.experiment.preflight import preflight

    data = yaml.safe_load((REPO / "experiments" / "answers-cpu.yaml").read_text())
    data["answers"]["accuracy"] = {"path": "{home}/sets/gsm8k.jsonl"}
    spec = load_experiment_text(yaml.safe_dump(data))
    (found,) = [f for f in preflight(spec, home=tmp_path) if f.rule == "accuracy-set"]
    assert found.severity == "error"
    assert "answers.accuracy.path" in found.message
    assert "does not exist" in found.message
    assert "nothing is downloaded" in found.message
    (tmp_path / "sets").mkdir()
    (tmp_path / "sets" / "gsm8k.jsonl").write_text('{"text": "no question here"}\n')
    (found,) = [f for f in preflight(spec, home=tmp_path) if f.rule == "accuracy-set"]
    assert "holds no question on its first line" in found.message
    (tmp_path / "sets" / "gsm8k.jsonl").write_text(ARITH.read_text())
    assert not [f for f in preflight(spec, home=tmp_path) if f.rule == "accuracy-set"]
