"""Repeats of a workload: mean, standard deviation and a confidence interval per metric.

A workload with ``repeats: N`` runs N times, repeat k with ``seed + k`` (new prompts, new arrivals).
Each repeat gives one value of every metric (its p50 TTFT, its throughput ...); across repeats this
module gives, per metric, the mean, the sample standard deviation (``ddof=1``) and a two-sided 95%
confidence interval of the mean from Student's t distribution with N - 1 degrees of freedom:
``mean +/- t(0.975, N-1) * std / sqrt(N)``. With one repeat std and the interval are undefined (None).

:func:`compare` says how two sets of repeats stand on a metric, with the statistics of the study
report (:mod:`k3pipe.verdicts.stats`, docs/measurement.md "Verdicts"): on the log of the ratio of their
geometric means, an interval at the level of the family of comparisons made together, and one of
three outcomes read off it: different, equivalent within the margin, or inconclusive (with the
smallest difference the data could have shown). Overlapping 95% intervals of the two means are not
that test.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from scipy import stats

from k3pipe.verdicts.stats import Design, Estimate, RestartPrior, decide, detectable, estimate, with_prior
from k3pipe.verdicts.stats import compare as stats_compare

__all__ = ["Comparison", "RepeatStats", "aggregate_repeats", "compare", "judged"]

CONFIDENCE = 0.95


class RepeatStats(BaseModel):
    """One metric across repeats."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    n: int = Field(description="Repeats that produced the metric.")
    mean: float
    std: float | None = Field(description="Sample standard deviation (ddof=1); None for one repeat.")
    ci_low: float | None = Field(description="Lower end of the 95% confidence interval of the mean.")
    ci_high: float | None = Field(description="Upper end of the 95% confidence interval of the mean.")
    values: list[float] = Field(description="The per-repeat values, in repeat order.")

    @classmethod
    def of(cls, values: Sequence[float]) -> RepeatStats:
        arr = np.asarray(values, dtype=float)
        if arr.size == 0:
            raise ValueError("no values to aggregate")
        mean = float(arr.mean())
        if arr.size < 2:
            return cls(n=1, mean=mean, std=None, ci_low=None, ci_high=None, values=arr.tolist())
        std = float(arr.std(ddof=1))
        half = float(stats.t.ppf(0.5 + CONFIDENCE / 2, arr.size - 1)) * std / math.sqrt(arr.size)
        return cls(
            n=int(arr.size), mean=mean, std=std, ci_low=mean - half, ci_high=mean + half, values=arr.tolist()
        )


class Comparison(BaseModel):
    """Two sets of repeats compared on one metric (B against A)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    metric: str
    mean_a: float = Field(description="A's geometric mean.")
    mean_b: float = Field(description="B's geometric mean.")
    relative_change: float = Field(description="B over A, minus 1 (geometric means).")
    interval: tuple[float, float] | None = Field(
        description="The interval of relative_change at `confidence` (None: a single value on a side)."
    )
    confidence: float = Field(description="The interval's coverage: 1 - alpha / (comparisons made together).")
    outcome: str = Field(
        description="different, equivalent, inconclusive, untested (a single value) or unknown (one launch "
        "a side and no restart noise known for it: no verdict)."
    )
    margin: float = Field(description="The equivalence margin (0.05: +-5%).")
    mde: float | None = Field(description="The smallest difference this comparison would have found (80%).")
    restart: str = Field(
        default="unknown",
        description="Where the restart noise in the interval comes from: 'measured' (two launches or more "
        "a side), 'prior' (earlier studies of the class on the node, k3pipe.records.priors) or "
        "'unknown' (then "
        "no verdict).",
    )
    prior: str | None = Field(default=None, description="The restart prior's source, when one was used.")

    @property
    def different(self) -> bool:
        return self.outcome == "different"

    def verdict(self) -> str:
        """'different', 'equivalent within +-5%', 'inconclusive (below 12% cannot be seen)', 'needs
        repeats' or 'cannot tell: restart noise unknown'."""
        if self.outcome == "untested":
            return "needs repeats"
        if self.outcome == "unknown":
            return "cannot tell: restart noise unknown"
        if self.outcome == "equivalent":
            return f"equivalent within +-{self.margin:.0%}"
        if self.outcome == "inconclusive":
            return f"inconclusive (below {detectable(self.mde)} cannot be seen)"
        return "different"

    def change_text(self) -> str:
        ci = ""
        if self.interval is not None:
            ci = f" [{self.interval[0]:+.1%}, {self.interval[1]:+.1%}]"
        return f"{self.relative_change:+.1%}{ci}"


def aggregate_repeats(per_repeat: Sequence[Mapping[str, float]]) -> dict[str, RepeatStats]:
    """Per metric, its statistics across the repeats that produced it (a metric missing from a
    repeat, e.g. TPOT when every request failed, is aggregated over the others)."""
    names = sorted({k for m in per_repeat for k in m})
    return {name: RepeatStats.of([m[name] for m in per_repeat if name in m]) for name in names}


def compare(
    metric: str,
    a: Sequence[float],
    b: Sequence[float],
    design: Design | None = None,
    prior_a: RestartPrior | None = None,
    prior_b: RestartPrior | None = None,
) -> Comparison:
    """How B's values of ``metric`` stand against A's (each one launch's repeats), under ``design``
    (default: one comparison at alpha 0.05, margin 5%). Values that are not positive are left out.
    Each side is one launch: its restart noise is known only from a prior (``prior_a``, ``prior_b``:
    what earlier studies of its class measured on the node, k3pipe.records.priors); without one the
    outcome is ``unknown`` (k3pipe.verdicts.stats)."""
    if not a or not b:
        raise ValueError(f"{metric}: both sides need at least one value (got {len(a)} and {len(b)})")
    ea, eb = estimate([list(a)]), estimate([list(b)])
    if ea is None or eb is None:
        raise ValueError(f"{metric}: no positive value on one side, nothing to compare")
    return judged(metric, with_prior(ea, prior_a), with_prior(eb, prior_b), design)


def judged(metric: str, ea: Estimate, eb: Estimate, design: Design | None = None) -> Comparison:
    """B's estimate of ``metric`` against A's (any basis: repeats of one launch, launches, a prior),
    under ``design``, as a :class:`Comparison`."""
    design = design or Design()
    comparison = stats_compare(eb, ea)
    verdict = decide(comparison, design, True, ("B", "A"))
    ci = comparison.interval(design.confidence) if verdict.outcome != "unknown" else None
    return Comparison(
        metric=metric,
        mean_a=ea.mean,
        mean_b=eb.mean,
        relative_change=math.expm1(comparison.diff),
        interval=(math.expm1(ci[0]), math.expm1(ci[1])) if ci else None,
        confidence=design.confidence,
        outcome=verdict.outcome,
        margin=design.margin,
        mde=verdict.mde,
        restart=comparison.restart,
        prior=comparison.prior.source if comparison.prior is not None else None,
    )
