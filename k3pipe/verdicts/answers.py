"""Whether an arm's answers hold: its outputs against the reference arm's, judged against the floor.

An engine's setting can change the numbers it computes (an fp8 KV cache, speculative decoding with
probabilistic acceptance, other kernels), and a faster arm whose answers changed is a wrong
decision. The output probe (issue 47) sends every arm the same fixed prompts, the same way (order,
batch), answered greedily to a fixed length, and, where the engine offers it, scores a fixed
continuation teacher-forced (the log-probability of each of its tokens). This module holds the
statistics of what comes back; nothing here sends a request or reads MLflow.

For one arm against the reference arm (``decision.baseline``, else the first), per prompt both
answered (:func:`agreement`):

- whether the greedy continuations are identical, token id for token id (text merges tokens that
  decode alike), and where the first differing token falls;
- the mean absolute difference of the teacher-forced log-probabilities over the continuation's
  tokens (nats per token).

Engines are not batch-invariant: the same configuration launched twice (the A/A pair, or a second
launch of the reference) already differs somewhat, more so on random weights, whose near-ties flip
greedy choices. That pair's agreement is the **floor**. :func:`judge` compares an arm's per-prompt
difference from the reference with the floor's, prompt by prompt (the same prompts, so the pairs
carry the prompts' own difficulty out): ``excess_i = mad(arm, ref)_i - mad(ref', ref)_i``, its mean
with a one-sided ``1 - alpha`` bound on either side (Student's t over the prompts):

- lower bound above ``margin``: **diverges beyond the floor** (by how much, with the interval);
- upper bound at or below ``margin``: **within the floor** (the arm's answers differ from the
  reference's no more than the reference's own do, within the margin);
- otherwise **cannot tell**, with the smallest excess the data could have shown.

Without log-probabilities, the same three outcomes are read from the greedy continuations: the
prompts identical in the floor pair but not for the arm, against the reverse (an exact binomial test
on the discordant prompts, McNemar's), detected only beyond chance, never "within" from a handful of
prompts it could not tell apart.

:func:`lossless_differences` is for settings that must not change the tokens (speculative decoding
under greedy decoding): the prompts where the arm's continuation differs from the reference's while
the floor pair agreed on that prompt, each with where it differs.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from scipy import stats

__all__ = [
    "AccuracyVerdict",
    "Agreement",
    "AnswersVerdict",
    "Difference",
    "ProbeAnswer",
    "agreement",
    "first_difference",
    "judge",
    "judge_accuracy",
    "lossless_differences",
    "question_fields",
]

Outcome = Literal["diverges beyond the floor", "within the floor", "cannot tell"]


@dataclass(frozen=True)
class ProbeAnswer:
    """What an engine answered to one probe prompt: the greedy continuation's token ids and, where
    the engine scored it, the log-probability of each token of the fixed continuation (teacher-forced;
    None where the engine offers no such scoring)."""

    prompt_id: str
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...] | None = None


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The position of the first token where two continuations differ (None: identical). One that
    ends earlier differs where it ended."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _mad(a: Sequence[float], b: Sequence[float]) -> float:
    if len(a) != len(b) or not a:
        raise ValueError(
            f"teacher-forced scores of different lengths ({len(a)} and {len(b)} tokens): the same "
            "continuation must be scored on both sides"
        )
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)


@dataclass(frozen=True)
class Agreement:
    """One side's answers against the reference's, per prompt both answered (ids in sorted order)."""

    prompt_ids: tuple[str, ...]
    first_diff: tuple[int | None, ...]
    """Per prompt: where the greedy continuations first differ (None: identical)."""
    logprob_mad: tuple[float, ...] | None
    """Per prompt: the mean absolute difference of the teacher-forced log-probabilities, nats per
    token (None where either side gave none)."""

    @property
    def prompts(self) -> int:
        return len(self.prompt_ids)

    @property
    def identical(self) -> int:
        return sum(1 for d in self.first_diff if d is None)

    def identical_interval(self, confidence: float = 0.95) -> tuple[float, float]:
        """The share of identical continuations, its Clopper-Pearson interval."""
        if not self.prompts:
            return (0.0, 1.0)
        ci = stats.binomtest(self.identical, self.prompts).proportion_ci(confidence, method="exact")
        return (float(ci.low), float(ci.high))

    def positions(self) -> list[int]:
        """Where the differing continuations first differ, in order."""
        return sorted(d for d in self.first_diff if d is not None)

    def median_position(self) -> float | None:
        where = self.positions()
        return statistics.median(where) if where else None

    @property
    def mean_logprob_mad(self) -> float | None:
        return statistics.fmean(self.logprob_mad) if self.logprob_mad else None

    def describe(self) -> str:
        """'5 of 8 identical (63%, 95% CI 24%-91%); the others first differ at token 0, 1, 41 (median
        1); log-prob difference 0.012 nats/token'."""
        if not self.prompts:
            return "no prompt answered by both"
        low, high = self.identical_interval()
        text = (
            f"{self.identical} of {self.prompts} identical ({self.identical / self.prompts:.0%}, 95% CI "
            f"{low:.0%}-{high:.0%})"
        )
        where = self.positions()
        if where:
            shown = ", ".join(str(p) for p in where[:8]) + (", ..." if len(where) > 8 else "")
            text += f"; the others first differ at token {shown} (median {self.median_position():g})"
        if self.mean_logprob_mad is not None:
            text += f"; log-prob difference {self.mean_logprob_mad:.3g} nats/token"
        return text


def agreement(answers: Mapping[str, ProbeAnswer], reference: Mapping[str, ProbeAnswer]) -> Agreement:
    """``answers`` against ``reference``, over the prompts both answered. Log-probability differences
    only where every such prompt was scored on both sides (a partial set would compare other prompts
    than the floor's)."""
    ids = tuple(sorted(set(answers) & set(reference)))
    diffs = tuple(first_difference(answers[i].tokens, reference[i].tokens) for i in ids)
    scored = ids and all(answers[i].logprobs is not None and reference[i].logprobs is not None for i in ids)
    mads = (
        tuple(_mad(answers[i].logprobs or (), reference[i].logprobs or ()) for i in ids) if scored else None
    )
    return Agreement(ids, diffs, mads)


@dataclass(frozen=True)
class AnswersVerdict:
    """An arm's answers judged against the floor (see the module)."""

    outcome: Outcome
    basis: Literal["log-probabilities", "greedy tokens"]
    prompts: int
    estimate: float
    """Log-probabilities: the mean excess over the floor, nats per token. Greedy tokens: the share of
    prompts identical in the floor but not for the arm, minus the reverse."""
    interval: tuple[float, float]
    """The one-sided ``1 - alpha`` bounds on either side of the estimate (each tested at alpha)."""
    margin: float
    alpha: float
    smallest_detectable: float | None = None
    """Cannot tell: the excess the data would have shown (log-probabilities: t bound's half-width)."""

    @property
    def diverges(self) -> bool:
        return self.outcome == "diverges beyond the floor"

    def describe(self) -> str:
        low, high = self.interval
        if self.basis == "log-probabilities":
            unit = " nats/token"
            shown = f"{self.estimate:+.3g}{unit} beyond the floor [{low:+.3g}, {high:+.3g}]"
        else:
            unit = " of the prompts"
            shown = f"{self.estimate:+.0%} more prompts differing than in the floor [{low:+.0%}, {high:+.0%}]"
        over = f" (margin {self.margin:g}{unit})" if self.margin and self.basis == "log-probabilities" else ""
        if self.outcome == "cannot tell" and self.smallest_detectable is not None:
            return (
                f"cannot tell from {self.prompts} prompts: {shown}{over}; it would have seen "
                f"{self.smallest_detectable:.3g}{unit} beyond the margin"
            )
        return f"{self.outcome} over {self.prompts} prompts: {shown}{over}"


def _paired(arm: Agreement, floor: Agreement) -> list[str]:
    ids = sorted(set(arm.prompt_ids) & set(floor.prompt_ids))
    if len(ids) < 2:
        raise ValueError(
            f"the arm and the floor pair share {len(ids)} answered prompt(s): at least 2 are needed to "
            "judge the answers (the probe's prompts must be the same for every launch)"
        )
    return ids


def judge(arm: Agreement, floor: Agreement, *, margin: float = 0.0, alpha: float = 0.05) -> AnswersVerdict:
    """``arm`` (its answers against the reference's) judged against ``floor`` (the reference's second
    launch, or the A/A copy, against the reference), prompt by prompt: on the teacher-forced
    log-probabilities where both have them, else on the greedy tokens. ``margin``: the excess (nats
    per token) that is still 'within the floor'; ``alpha``: each one-sided test's level."""
    ids = _paired(arm, floor)
    a_pos = dict(zip(arm.prompt_ids, range(arm.prompts), strict=True))
    f_pos = dict(zip(floor.prompt_ids, range(floor.prompts), strict=True))
    if arm.logprob_mad is not None and floor.logprob_mad is not None:
        excess = [arm.logprob_mad[a_pos[i]] - floor.logprob_mad[f_pos[i]] for i in ids]
        n = len(excess)
        mean = statistics.fmean(excess)
        sd = statistics.stdev(excess)
        se = sd / math.sqrt(n)
        t = float(stats.t.ppf(1 - alpha, n - 1))
        low, high = mean - t * se, mean + t * se
        if se == 0:
            low = high = mean
        if low > margin:
            outcome: Outcome = "diverges beyond the floor"
        elif high <= margin:
            outcome = "within the floor"
        else:
            outcome = "cannot tell"
        return AnswersVerdict(outcome, "log-probabilities", n, mean, (low, high), margin, alpha, 2 * t * se)
    # greedy tokens only: McNemar's exact test on the prompts where the arm and the floor disagree
    worse = sum(1 for i in ids if arm.first_diff[a_pos[i]] is not None and floor.first_diff[f_pos[i]] is None)
    better = sum(
        1 for i in ids if arm.first_diff[a_pos[i]] is None and floor.first_diff[f_pos[i]] is not None
    )
    n = len(ids)
    share = (worse - better) / n
    discordant = worse + better
    if discordant == 0:
        return AnswersVerdict("cannot tell", "greedy tokens", n, 0.0, (0.0, 0.0), 0.0, alpha)
    p = stats.binomtest(worse, discordant, 0.5, alternative="greater").pvalue
    ci = stats.binomtest(worse, discordant).proportion_ci(1 - 2 * alpha, method="exact")
    # the excess share's bounds from the discordant split's (the concordant prompts move neither)
    low, high = ((2 * float(ci.low) - 1) * discordant / n, (2 * float(ci.high) - 1) * discordant / n)
    outcome = "diverges beyond the floor" if p < alpha else "cannot tell"
    return AnswersVerdict(outcome, "greedy tokens", n, share, (low, high), 0.0, alpha)


@dataclass(frozen=True)
class Difference:
    """A prompt where a setting that must not change the tokens changed them."""

    prompt_id: str
    position: int


def lossless_differences(arm: Agreement, floor: Agreement) -> list[Difference]:
    """For a setting that must leave the tokens as they are (speculative decoding under greedy
    decoding): each prompt whose continuation differs from the reference's while the floor pair was
    identical on it (a prompt the floor already differs on says nothing of the setting)."""
    f_pos = dict(zip(floor.prompt_ids, floor.first_diff, strict=True))
    return [
        Difference(pid, where)
        for pid, where in zip(arm.prompt_ids, arm.first_diff, strict=True)
        if where is not None and pid in f_pos and f_pos[pid] is None
    ]


AccuracyOutcome = Literal["worse", "better", "equivalent", "cannot tell"]


@dataclass(frozen=True)
class AccuracyVerdict:
    """An arm's task score against the reference's, on the same questions (paired)."""

    outcome: AccuracyOutcome
    questions: int
    arm_accuracy: float
    reference_accuracy: float
    difference: float
    """The arm's accuracy minus the reference's, in points (percentage points)."""
    interval: tuple[float, float]
    """The difference's ``1 - 2 alpha`` interval, in points (each side tested at ``alpha``)."""
    margin: float
    alpha: float

    def describe(self) -> str:
        low, high = self.interval
        shown = (
            f"{self.arm_accuracy:.1%} against {self.reference_accuracy:.1%} on {self.questions} questions: "
            f"{self.difference:+.1f} points [{low:+.1f}, {high:+.1f}]"
        )
        said = {
            "worse": "worse",
            "better": "better",
            "equivalent": f"equivalent within {self.margin:g} points",
            "cannot tell": f"cannot tell within {self.margin:g} points",
        }[self.outcome]
        return f"{said}: {shown}"


def accuracy_interval(correct: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """A score's Clopper-Pearson interval."""
    if not n:
        return (0.0, 1.0)
    ci = stats.binomtest(correct, n).proportion_ci(confidence, method="exact")
    return (float(ci.low), float(ci.high))


def judge_accuracy(
    arm: Sequence[bool], reference: Sequence[bool], *, margin_points: float = 2.0, alpha: float = 0.05
) -> AccuracyVerdict:
    """``arm``'s correctness against ``reference``'s, question by question (the same questions, in the
    same order): the paired difference in accuracy (points), its ``1 - 2 alpha`` interval from the
    per-question differences (the discordant questions carry it, as McNemar's); **worse** or **better**
    when the interval lies on one side of 0 (each a one-sided test at ``alpha``), **equivalent within
    the margin** when it lies inside +-``margin_points`` (two one-sided tests), else **cannot tell**."""
    if len(arm) != len(reference) or not arm:
        raise ValueError(
            f"{len(arm)} and {len(reference)} answers: the arm and the reference must answer the same "
            "questions (at least one)"
        )
    n = len(arm)
    d = [100.0 * (int(a) - int(r)) for a, r in zip(arm, reference, strict=True)]
    mean = statistics.fmean(d)
    se = statistics.stdev(d) / math.sqrt(n) if n > 1 else math.inf
    z = float(stats.norm.ppf(1 - alpha)) if n >= 30 else float(stats.t.ppf(1 - alpha, max(1, n - 1)))
    low, high = (mean, mean) if se == 0 else (mean - z * se, mean + z * se)
    if high < 0:
        outcome: AccuracyOutcome = "worse"
    elif low > 0:
        outcome = "better"
    elif -margin_points < low and high < margin_points:
        outcome = "equivalent"
    else:
        outcome = "cannot tell"
    return AccuracyVerdict(
        outcome, n, sum(arm) / n, sum(reference) / n, mean, (low, high), margin_points, alpha
    )


def question_fields(item: object) -> tuple[str, str] | None:
    """One line of an accuracy set, read: ``(question, expected answer)`` from ``{"question", "answer"}``
    or ``{"prompt", "target"}``; None when it is neither (k3pipe.bench.accuracy, and preflight's check)."""
    if not isinstance(item, dict):
        return None
    q = item.get("question", item.get("prompt"))
    a = item.get("answer", item.get("target"))
    return (q, str(a)) if isinstance(q, str) and a is not None else None
