"""Repeats of a workload: mean, standard deviation and a confidence interval per metric.

A workload with ``repeats: N`` runs N times, repeat k with ``seed + k`` (new prompts, new arrivals).
Each repeat gives one value of every metric (its p50 TTFT, its throughput ...); across repeats this
module gives, per metric, the mean, the sample standard deviation (``ddof=1``) and a two-sided 95%
confidence interval of the mean from Student's t distribution with N - 1 degrees of freedom:
``mean +/- t(0.975, N-1) * std / sqrt(N)``. With one repeat std and the interval are undefined (None).

:func:`compare` says whether two sets of repeats differ in a metric: Welch's t-test (unequal
variances), different when its two-sided p-value is below ``alpha``. Overlapping intervals are not
the test (two 95% intervals can overlap while the means differ at 5%).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from scipy import stats

__all__ = ["Comparison", "RepeatStats", "aggregate_repeats", "compare"]

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
    """Two sets of repeats compared on one metric."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    metric: str
    mean_a: float
    mean_b: float
    relative_change: float | None = Field(description="(mean_b - mean_a) / mean_a; None when mean_a is 0.")
    p_value: float | None = Field(description="Welch's t-test, two-sided; None with fewer than 2 repeats.")
    different: bool = Field(description="p_value < alpha.")


def aggregate_repeats(per_repeat: Sequence[Mapping[str, float]]) -> dict[str, RepeatStats]:
    """Per metric, its statistics across the repeats that produced it (a metric missing from a
    repeat, e.g. TPOT when every request failed, is aggregated over the others)."""
    names = sorted({k for m in per_repeat for k in m})
    return {name: RepeatStats.of([m[name] for m in per_repeat if name in m]) for name in names}


def compare(metric: str, a: Sequence[float], b: Sequence[float], alpha: float = 1 - CONFIDENCE) -> Comparison:
    """Whether two sets of per-repeat values of ``metric`` differ (Welch's t-test at ``alpha``)."""
    if not a or not b:
        raise ValueError(f"{metric}: both sides need at least one value (got {len(a)} and {len(b)})")
    mean_a, mean_b = float(np.mean(a)), float(np.mean(b))
    p: float | None = None
    if len(a) >= 2 and len(b) >= 2:
        if np.std(a) == 0 and np.std(b) == 0:
            p = 1.0 if mean_a == mean_b else 0.0
        else:
            p = float(stats.ttest_ind(a, b, equal_var=False).pvalue)
    return Comparison(
        metric=metric,
        mean_a=mean_a,
        mean_b=mean_b,
        relative_change=(mean_b - mean_a) / mean_a if mean_a else None,
        p_value=p,
        different=p is not None and p < alpha,
    )
