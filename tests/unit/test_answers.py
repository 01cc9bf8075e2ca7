"""The answers' statistics (k3pipe.verdicts.answers): agreement with the reference, the floor, the verdict,
held against simulated answers whose truth is known, at the rates the module states."""

from __future__ import annotations

import numpy as np
import pytest

from k3pipe.verdicts.answers import (
    Agreement,
    ProbeAnswer,
    agreement,
    first_difference,
    judge,
    lossless_differences,
)

pytestmark = pytest.mark.unit

TRIALS = 400
PROMPTS = 32
TOKENS = 48


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert first_difference([5], [6]) == 0
    assert first_difference([1, 2], [1, 2, 3]) == 2  # one ended earlier: it differs there
    assert first_difference([], []) is None


def test_agreement_counts_identical_continuations_by_token_id_and_where_the_others_differ() -> None:
    ref = {f"p{i}": ProbeAnswer(f"p{i}", (1, 2, 3, 4), (-0.5, -1.0, -0.2, -0.1)) for i in range(4)}
    arm = {
        "p0": ProbeAnswer("p0", (1, 2, 3, 4), (-0.5, -1.0, -0.2, -0.1)),
        "p1": ProbeAnswer("p1", (1, 2, 9, 9), (-0.6, -1.0, -0.2, -0.1)),
        "p2": ProbeAnswer("p2", (7, 2, 3, 4), (-0.5, -1.4, -0.2, -0.1)),
        "p3": ProbeAnswer("p3", (1, 2, 3, 4), (-0.5, -1.0, -0.2, -0.1)),
        "extra": ProbeAnswer("extra", (1,), (-1.0,)),  # not asked of the reference: not compared
    }
    got = agreement(arm, ref)
    assert got.prompt_ids == ("p0", "p1", "p2", "p3")
    assert got.identical == 2
    assert got.positions() == [0, 2]
    assert got.median_position() == 1
    assert got.logprob_mad is not None
    assert got.logprob_mad[1] == pytest.approx(0.1 / 4)
    assert got.logprob_mad[2] == pytest.approx(0.4 / 4)
    low, high = got.identical_interval()
    assert low < 0.5 < high
    text = got.describe()
    assert text.startswith(
        "2 of 4 identical (50%, 95% CI 7%-93%); the others first differ at token 0, 2 (median 1)"
    )
    assert "nats/token" in text


def test_no_log_probabilities_unless_every_shared_prompt_was_scored_on_both_sides() -> None:
    ref = {"a": ProbeAnswer("a", (1,), (-1.0,)), "b": ProbeAnswer("b", (2,), None)}
    arm = {"a": ProbeAnswer("a", (1,), (-1.0,)), "b": ProbeAnswer("b", (2,), (-2.0,))}
    assert agreement(arm, ref).logprob_mad is None
    with pytest.raises(ValueError, match="different lengths"):
        agreement({"a": ProbeAnswer("a", (1,), (-1.0, -2.0))}, {"a": ProbeAnswer("a", (1,), (-1.0,))})


def _launch(
    base: np.ndarray, noise: np.ndarray, shift: float, rng: np.random.Generator
) -> dict[str, ProbeAnswer]:
    """One launch's answers: the teacher-forced scores are the model's (``base``) with the launch's
    own arithmetic noise (batch non-invariance) and, for a setting that changes the arithmetic, a
    systematic error of ``shift`` nats/token on average; greedy tokens flip where the score moved
    past a near-tie."""
    out = {}
    for i, row in enumerate(base):
        # the systematic error's mean absolute value is ``shift`` (a normal's is sd * sqrt(2 / pi))
        err = rng.normal(0.0, noise[i], row.shape) + rng.normal(0.0, shift * np.sqrt(np.pi / 2), row.shape)
        scores = row + err
        flips = np.flatnonzero(np.abs(err) > 0.05)  # a near-tie crossed
        tokens = list(range(TOKENS))
        if flips.size:
            tokens[int(flips[0])] = -1
        out[f"p{i}"] = ProbeAnswer(f"p{i}", tuple(tokens), tuple(float(s) for s in scores))
    return out


def _study(rng: np.random.Generator, shift: float, noise: float = 0.01) -> tuple[Agreement, Agreement]:
    """The reference launched twice (the floor pair) and an arm, on the same prompts; each prompt's
    own noise scale differs (hard prompts move more), which the pairing by prompt carries out."""
    scale = rng.gamma(2.0, 0.5, size=PROMPTS)
    base = -rng.gamma(1.0, 1.0, size=(PROMPTS, TOKENS))
    ref = _launch(base, noise * scale, 0.0, rng)
    again = _launch(base, noise * scale, 0.0, rng)
    arm = _launch(base, noise * scale, shift, rng)
    return agreement(arm, ref), agreement(again, ref)


def test_an_arm_like_the_reference_is_called_diverging_at_most_at_alpha() -> None:
    """The arm is the reference's configuration again: 'diverges beyond the floor' at most alpha of
    the time (400 simulated studies of 32 prompts; the bound allows the binomial's 2.5 sd)."""
    rng = np.random.default_rng(47)
    verdicts = [judge(*_study(rng, shift=0.0)) for _ in range(TRIALS)]
    rate = sum(v.diverges for v in verdicts) / TRIALS
    assert rate <= 0.05 + 2.5 * np.sqrt(0.05 * 0.95 / TRIALS), rate
    # and with a margin of 0.005 nats/token it is found within the floor nearly always
    within = [judge(*_study(rng, shift=0.0), margin=0.005).outcome for _ in range(100)]
    assert within.count("within the floor") >= 95, within.count("within the floor")


def test_an_arm_whose_arithmetic_changed_is_found_diverging() -> None:
    """A setting that adds 0.01 nats/token of systematic error (the floor's own is about 0.01): found
    beyond the floor in at least 95% of the simulated studies; its estimate near the truth."""
    rng = np.random.default_rng(7)
    verdicts = [judge(*_study(rng, shift=0.01)) for _ in range(200)]
    assert sum(v.diverges for v in verdicts) >= 190
    assert all(v.basis == "log-probabilities" for v in verdicts)
    text = verdicts[0].describe()
    assert text.startswith("diverges beyond the floor over 32 prompts: +")
    assert "nats/token beyond the floor [" in text


def test_the_interval_covers_the_true_excess_at_its_stated_rate() -> None:
    """The one-sided bounds each hold at 1 - alpha: the true excess (worked out from a large
    simulation of the same model) lies below the lower bound at most alpha of the time."""
    rng = np.random.default_rng(11)
    truth = np.mean([judge(*_study(rng, shift=0.02)).estimate for _ in range(400)])
    misses_low = sum(judge(*_study(rng, shift=0.02)).interval[0] > truth for _ in range(TRIALS))
    misses_high = sum(judge(*_study(rng, shift=0.02)).interval[1] < truth for _ in range(TRIALS))
    limit = 0.05 + 2.5 * np.sqrt(0.05 * 0.95 / TRIALS)
    assert misses_low / TRIALS <= limit
    assert misses_high / TRIALS <= limit


def _greedy(identical: float, rng: np.random.Generator) -> Agreement:
    ids = tuple(f"p{i}" for i in range(PROMPTS))
    diffs = tuple(None if rng.random() < identical else int(rng.integers(0, TOKENS)) for _ in ids)
    return Agreement(ids, diffs, None)


def test_without_log_probabilities_the_greedy_tokens_decide_at_alpha() -> None:
    """No scores: prompts identical in the floor but not for the arm against the reverse (McNemar's
    exact test). Same rate of identical continuations: 'diverges' at most alpha of the time, never
    'within'; an arm identical on 10% of the prompts against the floor's 60% is found."""
    rng = np.random.default_rng(3)
    null = [judge(_greedy(0.6, rng), _greedy(0.6, rng)) for _ in range(TRIALS)]
    assert sum(v.diverges for v in null) / TRIALS <= 0.05 + 2.5 * np.sqrt(0.05 * 0.95 / TRIALS)
    assert all(v.outcome != "within the floor" for v in null)
    assert {v.basis for v in null} == {"greedy tokens"}
    found = [judge(_greedy(0.1, rng), _greedy(0.6, rng)) for _ in range(200)]
    assert sum(v.diverges for v in found) >= 190
    assert "more prompts differing than in the floor" in found[0].describe()


def test_lossless_differences_name_prompts_the_floor_agreed_on() -> None:
    ids = ("a", "b", "c")
    floor = Agreement(ids, (None, 4, None), None)
    spec = Agreement(ids, (None, 2, 17), None)  # b differs in the floor too: it says nothing
    assert [(d.prompt_id, d.position) for d in lossless_differences(spec, floor)] == [("c", 17)]
    assert lossless_differences(Agreement(ids, (None, None, None), None), floor) == []


def test_too_few_shared_prompts_is_a_clear_error() -> None:
    one = Agreement(("a",), (None,), (0.1,))
    with pytest.raises(ValueError, match="share 1 answered prompt"):
        judge(one, one)


# --- the task score: paired accuracy, simulated at known rates ---------------------------------------


def _scores(
    rng: np.random.Generator, n: int, p_ref: float, drop: float, flip: float = 0.05
) -> tuple[list, list]:
    """Per question, the reference right with probability ``p_ref`` (each question its own difficulty);
    the arm answers as the reference except on a share ``flip`` of the questions, which it answers
    afresh, and on a share ``drop`` of those the reference got right, which it gets wrong: its
    accuracy is lower by about ``drop x p_ref``."""
    ref = rng.random(n) < p_ref
    arm = ref.copy()
    fresh = rng.random(n) < flip
    arm[fresh] = rng.random(int(fresh.sum())) < p_ref
    lost = ref & (rng.random(n) < drop)
    arm[lost] = False
    return arm.tolist(), ref.tolist()


def test_an_arm_that_scores_as_the_reference_is_called_worse_at_most_at_alpha() -> None:
    from k3pipe.verdicts.answers import judge_accuracy

    rng = np.random.default_rng(3)
    worse = sum(
        judge_accuracy(*_scores(rng, 500, 0.8, 0.0), margin_points=2.0, alpha=0.05).outcome == "worse"
        for _ in range(TRIALS)
    )
    assert worse <= 0.05 * TRIALS * 1.5  # its one-sided level, with room for 400 draws


def test_an_arm_ten_points_worse_is_found_worse() -> None:
    from k3pipe.verdicts.answers import judge_accuracy

    rng = np.random.default_rng(4)
    outcomes = [
        judge_accuracy(*_scores(rng, 500, 0.8, 0.125), margin_points=2.0, alpha=0.05).outcome
        for _ in range(200)
    ]
    assert outcomes.count("worse") >= 0.95 * 200


def test_an_arm_that_scores_as_the_reference_is_found_equivalent_with_enough_questions() -> None:
    from k3pipe.verdicts.answers import judge_accuracy

    rng = np.random.default_rng(5)
    outcomes = [
        judge_accuracy(*_scores(rng, 1319, 0.8, 0.0), margin_points=2.0, alpha=0.05).outcome
        for _ in range(200)
    ]
    assert outcomes.count("equivalent") >= 0.8 * 200  # GSM8K's 1,319 questions, 5% answered afresh
    assert outcomes.count("worse") + outcomes.count("better") <= 0.1 * 200


def test_the_interval_covers_the_true_difference_at_its_rate() -> None:
    from k3pipe.verdicts.answers import judge_accuracy

    rng = np.random.default_rng(6)
    misses = 0
    for _ in range(TRIALS):
        n, p, drop = 400, 0.7, 0.05
        arm, ref = _scores(rng, n, p, drop)
        truth = -100 * drop * p  # the flips are unbiased; the drops cost drop x p_ref on average
        low, high = judge_accuracy(arm, ref, alpha=0.05).interval
        misses += not (low <= truth <= high)
    assert misses <= 0.10 * TRIALS * 1.5  # a 90% interval (each side at alpha 0.05)


def test_a_task_score_says_what_it_found() -> None:
    from k3pipe.verdicts.answers import judge_accuracy, question_fields

    same = judge_accuracy([True, False, True, True], [True, False, True, True], margin_points=2.0)
    assert same.outcome == "equivalent"
    assert (
        same.describe()
        == "equivalent within 2 points: 75.0% against 75.0% on 4 questions: +0.0 points [+0.0, +0.0]"
    )
    assert judge_accuracy([False] * 40, [True] * 40).outcome == "worse"
    with pytest.raises(ValueError, match="the same questions"):
        judge_accuracy([True], [True, False])
    assert question_fields({"question": "2+2?", "answer": "#### 4"}) == ("2+2?", "#### 4")
    assert question_fields({"prompt": "x", "target": 3}) == ("x", "3")
    assert question_fields({"q": "x"}) is None
