"""The report's answers (k3pipe.report.gate and the render) on studies whose truth is set: the floor
from the reference launched twice (else the A/A copy, else none), each arm judged against it, an arm
detected faster whose answers diverge is "faster, answers differ" and not recommended unless
decision.accept_divergence says so, a speculative arm whose greedy tokens changed is a finding, the
probe's cost against the study's wall time, and a probe that stopped short said. The statistics of
k3pipe.verdicts.answers are held against simulated answers at their rates in tests/unit/test_answers.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from k3pipe.report.analysis import analyse
from k3pipe.report.collect import ArmData, CellData, StudyData
from k3pipe.report.render import build_document, to_markdown

PROMPTS = 16


def _answers(
    rng: np.random.Generator,
    base: np.ndarray,
    noise: float,
    shift: float = 0.0,
    changed: tuple[int, ...] = (),
) -> dict:
    """answers.json of one launch: every prompt's 8 greedy tokens (prompt i's tokens i..i+7, but token 3
    of each prompt in ``changed`` replaced) and its continuation's log-probabilities, ``base`` moved by
    noise (the engine started again) and by ``shift`` nats on each token (other arithmetic)."""
    out = {}
    for i in range(PROMPTS):
        tokens = list(range(i, i + 8))
        if i in changed:
            tokens[3] = 9999
        scores = base[i] + rng.normal(0, noise, base.shape[1]) + rng.choice([-1, 1], base.shape[1]) * shift
        out[f"p{i:03d}"] = {"tokens": tokens, "logprobs": [float(x) for x in scores]}
    return {"digest": "d1", "dialect": "vllm", "output_tokens": 8, "scored": True, "seconds": 2.5,
            "error": None, "answers": out}  # fmt: skip


def _cell(arm: str, launches: list[list[float]]) -> CellData:
    cell = CellData(
        arm=arm, engine="vllm", workload="w", input_tokens=128, output_tokens=32, concurrency=4,
        run_id=f"{arm}-w", status="FINISHED", values={"output_throughput_tps": launches[0]},
    )  # fmt: skip
    for later in launches[1:]:
        cell.add_launch(
            cell.model_copy(update={"values": {"output_throughput_tps": later}, "launch_values": []})
        )
    return cell


def _study(
    *,
    fast_shift: float,
    accept: bool = False,
    reference_launches: int = 2,
    calibration: bool = False,
    spec_changed: tuple[int, ...] = (),
    error: str | None = None,
) -> StudyData:
    """Arms ``ref`` (launched ``reference_launches`` times), ``fast`` (detected 2x faster, its answers
    moved by ``fast_shift`` nats a token) and ``spec`` (n-gram speculation, the same speed and
    arithmetic as ``ref``, greedy tokens changed on ``spec_changed``), each other arm launched twice."""
    rng = np.random.default_rng(47)
    base = rng.normal(-3.0, 1.0, (PROMPTS, 8))
    arms: list[ArmData] = []

    def launch(name: str, k: int, **kw: object) -> None:
        answers = _answers(rng, base, 0.002, **kw)  # type: ignore[arg-type]
        if error and name == "spec":
            answers["error"] = error
        arms.append(ArmData(name=name, engine="vllm", run_id=f"{name}{k}", status="FINISHED", launch=k,
                            answers=answers,
                            **({"lossless": 'speculative_config={"method":"ngram"}', "twin": "ref"}
                               if name == "spec" else {})))  # fmt: skip

    for k in range(1, reference_launches + 1):
        launch("ref", k)
    if calibration:
        launch("ref-aa", 1)
    for k in (1, 2):
        launch("fast", k, shift=fast_shift)
        launch("spec", k, changed=spec_changed)
    speeds = {
        "ref": [[100.0, 101.0, 99.0], [98.0, 100.0, 102.0]],
        "fast": [[200.0, 199.0, 202.0], [201.0, 198.0, 200.0]],
        "spec": [[100.5, 99.5, 100.0], [99.0, 101.0, 100.0]],
    }
    cells = [
        _cell(a, speeds[a][: (reference_launches if a == "ref" else 2)]) for a in ("ref", "fast", "spec")
    ]
    decision: dict = {"baseline": "ref", "metrics": ["output_throughput_tps"], "accept_divergence": accept}
    if calibration:
        decision["calibration"] = True
        cells.insert(1, _cell("ref-aa", [[100.0, 99.0, 101.0]]))
    return StudyData(
        run_id="s", name="t", status="FINISHED", arms=arms, cells=cells, decision=decision,
        metrics={"study.wall_s": 500.0}, answers={"prompts": PROMPTS, "margin_nats": 0.01},
    )  # fmt: skip


def _markdown(data: StudyData) -> str:
    return to_markdown(build_document(data, analyse(data)), {})


def test_a_faster_arm_whose_answers_diverge_is_not_the_recommendation() -> None:
    data = _study(fast_shift=0.05)
    analysis = analyse(data)
    answers = analysis.answers
    assert answers is not None
    assert answers.floor_label == "ref launch 2 against its launch 1"
    assert answers.diverging == ["fast"]  # 0.05 nats a token beyond a floor of ~0.002
    spec = answers.arm("spec")
    assert spec is not None
    assert spec.verdict is not None
    assert spec.verdict.outcome == "within the floor"
    assert answers.gated == ["fast"]
    text = _markdown(data)
    assert "(best; its answers differ: not recommended)" in text
    assert "**fast: faster, answers differ.** It is detected best on" in text
    assert "`decision.accept_divergence: true`" in text
    assert "## Answers" in text
    assert "The probe took 15.0 s over all launches: 3.0% of the study's wall time (500.0 s)." in text


def test_accepting_the_divergence_lets_the_faster_arm_lead() -> None:
    data = _study(fast_shift=0.05, accept=True)
    text = _markdown(data)
    assert "**fast: faster, answers differ** (accepted: `decision.accept_divergence`)" in text
    assert "not recommended" not in text


def test_arms_within_the_floor_gate_nothing() -> None:
    data = _study(fast_shift=0.0)
    answers = analyse(data).answers
    assert answers is not None
    assert answers.diverging == []
    text = _markdown(data)
    assert "answers differ" not in text
    assert "within the floor over 16 prompts" in text


def test_without_a_floor_no_arm_is_judged_and_none_is_gated() -> None:
    data = _study(fast_shift=0.05, reference_launches=1)
    answers = analyse(data).answers
    assert answers is not None
    assert answers.floor is None
    assert answers.diverging == []
    text = _markdown(data)
    assert "No floor: the reference answered the probe on one launch only" in text
    assert "cannot tell: no floor" in text


def test_the_a_a_copy_is_the_floor_when_the_reference_ran_once() -> None:
    data = _study(fast_shift=0.05, reference_launches=1, calibration=True)
    answers = analyse(data).answers
    assert answers is not None
    assert answers.floor_label == "ref-aa (the A/A copy) launch 1 against ref launch 1"
    assert "fast" in answers.diverging


def test_speculation_that_changes_greedy_tokens_is_a_finding() -> None:
    data = _study(fast_shift=0.0, spec_changed=(2, 5))
    answers = analyse(data).answers
    assert answers is not None
    spec = answers.arm("spec")
    assert spec is not None
    assert [(d.prompt_id, d.position) for d in spec.differences or []] == [("p002", 3), ("p005", 3)]
    text = _markdown(data)
    assert "**spec changed greedy tokens**" in text
    assert "2 prompt(s) differ where the floor pair agreed: p002 at token 3, p005 at token 3" in text
    assert "[answers] speculative_config" in text  # in the findings of the launch compared


def test_speculation_that_keeps_the_tokens_says_so() -> None:
    text = _markdown(_study(fast_shift=0.0))
    assert "identical where the floor agreed" in text
    assert "changed greedy tokens" not in text


def test_a_probe_that_stopped_short_is_said() -> None:
    text = _markdown(_study(fast_shift=0.0, error="the probe's request was answered 400: no prompt_logprobs"))
    assert "**The probe stopped short** on spec" in text
    assert "no prompt_logprobs" in text


def test_a_study_without_a_probe_has_no_answers_section() -> None:
    data = _study(fast_shift=0.05)
    for arm in data.arms:
        arm.answers = None
    assert analyse(data).answers is None
    assert "## Answers" not in _markdown(data)


def _with_scores(data: StudyData, fast_wrong: int) -> StudyData:
    """Each arm's first launch answered 200 questions: the reference 160 right, 'spec' the same ones,
    'fast' the same except ``fast_wrong`` of the reference's right ones."""
    ref = {f"q{i:05d}": i < 160 for i in range(200)}
    own = {
        "ref": ref,
        "spec": dict(ref),
        "fast": {q: ok and int(q[1:]) >= fast_wrong for q, ok in ref.items()},
    }
    for arm in data.arms:
        if arm.launch == 1:
            arm.accuracy = {"path": "set.jsonl", "digest": "s", "match": "number", "seconds": 9.0,
                            "error": None, "right": own[arm.name]}  # fmt: skip
    data.answers = {**(data.answers or {}), "accuracy": {"path": "set.jsonl", "margin_points": 2.0}}
    return data


def test_a_faster_arm_that_scores_worse_is_not_the_recommendation() -> None:
    data = _with_scores(_study(fast_shift=0.0), fast_wrong=20)  # 10 points worse, answers within the floor
    answers = analyse(data).answers
    assert answers is not None
    assert answers.diverging == []
    assert answers.worse == ["fast"]
    assert answers.gated == ["fast"]
    scores = {s.arm: s for s in answers.scores}
    assert scores["spec"].verdict is not None
    assert scores["spec"].verdict.outcome == "equivalent"
    text = _markdown(data)
    assert "**fast: faster, answers differ.** It is detected best on" in text
    assert "its task score is worse: 70.0% against 80.0% on 200 questions: -10.0 points" in text
    assert "| spec | 200 | 160 | 80.0% [73.8%, 85.3%] | equivalent within 2 points" in text
    assert "(best; its answers differ: not recommended)" in text


def test_an_arm_scoring_as_the_reference_is_not_gated() -> None:
    data = _with_scores(_study(fast_shift=0.0), fast_wrong=0)
    answers = analyse(data).answers
    assert answers is not None
    assert answers.gated == []
    assert "scores worse" not in _markdown(data)


REAL = Path(__file__).parents[1] / "fixtures" / "answers" / "h100-mla-2026-12-06"


def test_the_h100_sittings_real_answers_gate_as_the_report_said() -> None:
    """The five answers.json of the H100 sitting (docs/gpu.md, 'Answers on an H100'; vLLM 0.22 and
    SGLang 0.5.16 on the random MLA + MoE model, one launch an arm, decode throughput as measured): the
    floor is zero, bf16 and SGLang diverge by about 0.11 nats a token, n-gram speculation is lossless,
    and the fastest arm (bf16) is not recommended."""
    speeds = {"fp8": 583.28, "fp8-aa": 693.55, "bf16": 758.63, "sglang": 569.04, "fp8-ngram": 479.47}
    spec = {"lossless": 'speculative_config={"method":"ngram"}', "twin": "fp8"}
    arms = [
        ArmData(
            name=name,
            engine="sglang" if name == "sglang" else "vllm",
            run_id=name,
            status="FINISHED",
            launch=1,
            answers=json.loads((REAL / f"{name}.json").read_text()),
            **(spec if name == "fp8-ngram" else {}),
        )
        for name in speeds
    ]
    data = StudyData(
        run_id="s", name="answers-mla-h100", status="FINISHED", arms=arms,
        cells=[_cell(name, [[tps]]) for name, tps in speeds.items()],
        decision={"baseline": "fp8", "metrics": ["output_throughput_tps"], "calibration": True},
        metrics={"study.wall_s": 504.8}, answers={"prompts": 16},
    )  # fmt: skip
    answers = analyse(data).answers
    assert answers is not None
    assert "fp8-aa" in answers.floor_label
    assert sorted(answers.diverging) == ["bf16", "sglang"]
    for name, nats in (("bf16", 0.117), ("sglang", 0.113)):
        arm = answers.arm(name)
        assert arm is not None
        assert arm.verdict is not None
        assert arm.agreement is not None
        assert arm.agreement.identical == 0
        assert arm.verdict.estimate == pytest.approx(nats, abs=0.0005)
    ngram = answers.arm("fp8-ngram")
    assert ngram is not None
    assert ngram.verdict is not None
    assert ngram.agreement is not None
    assert ngram.verdict.outcome == "within the floor"
    assert ngram.agreement.identical == 16
    assert ngram.differences == []
    text = _markdown(data)
    assert "bf16 758.6 tok/s (best; its answers differ: not recommended)" in text
    assert "identical where the floor agreed" in text
