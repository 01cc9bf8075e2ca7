"""The statistics behind every verdict: a cell's estimate from launches and repeats, the comparison
of two cells on the log of their ratio, the three outcomes, the smallest difference the data could
have shown, and how many comparisons the family-wise level is shared by.

The model (docs/measurement.md, "Verdicts", states it with references):

- A *cell* is one configuration (an arm) on one workload, measured in ``L`` launches of the engine
  with ``R_l`` repeats in launch ``l``. Each repeat gives one value ``y`` of a metric (its throughput,
  its TTFT p50 ...). Everything is computed on ``x = log y``: a ratio of two configurations is a
  difference of logs, so a metric and its reciprocal (end-to-end time and throughput, with the same
  tokens) give the same verdict by construction, and noise that scales with the value (a
  coefficient of variation) is one variance whatever the cell's level.
- ``x = mu + a_l + e_lr``: ``a_l`` the launch's own state (restart noise, variance ``s_b^2``),
  ``e_lr`` the repeat's (variance ``s_w^2``). The cell's estimate is the mean of its launch means
  (each launch weighs the same). Its variance:
  - with two launches or more, from the spread of the launch means (``var(launch means) / L``,
    ``L - 1`` degrees of freedom): it holds both levels of noise, whatever their split;
  - with one launch, from the spread of its repeats (``var(repeats) / R``, ``R - 1`` df): restart
    noise is then *not* in it, and every comparison made with it says so (``restart_noise_measured``);
  - with one launch of one repeat, there is no variance: no test.
- Two cells are compared on ``d = x_A - x_B``. When both cells have the same basis and the same
  counts (the planned, balanced case) the two variance estimates are pooled (Student's t with
  ``df_A + df_B`` degrees of freedom, exact under equal variances and robust to unequal ones when
  balanced); otherwise Welch's standard error with Welch-Satterthwaite degrees of freedom.
- A :class:`Design` shares the family-wise error rate ``alpha`` among ``tests`` comparisons
  (Bonferroni): every interval is the two-sided ``1 - alpha / tests`` interval of ``d``, and the
  verdict is read off that one interval, so the interval shown beside a verdict is the one it was made
  with:
  - it excludes 0: **different** (the better one, by how much, with the interval);
  - it lies inside ``+-log(1 + margin)``: **equivalent** within the margin (two one-sided tests at
    ``alpha / (2 tests)`` each, so a conservative TOST);
  - otherwise **inconclusive**, with the minimum detectable effect: the smallest true difference that
    this standard error and these degrees of freedom would have detected with probability ``power``
    at this level (noncentral t).
  A difference can be both detected and inside the margin (a real but small difference): it is
  reported as different, and said to be within the margin.

Nothing here reads MLflow or knows metric names; :mod:`k3pipe.report.analysis` applies it.
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property, lru_cache
from typing import Literal

import numpy as np
from scipy import optimize, stats

__all__ = [
    "DEFAULT_ALPHA",
    "DEFAULT_MARGIN",
    "DEFAULT_POWER",
    "Comparison",
    "Components",
    "Design",
    "Estimate",
    "Outcome",
    "Verdict",
    "compare",
    "components",
    "decide",
    "detectable",
    "estimate",
    "exp_or_inf",
    "launches_needed",
    "mde",
    "planned_power",
    "power",
    "spend_alpha",
    "with_resolution",
]

DEFAULT_ALPHA = 0.05
DEFAULT_MARGIN = 0.05
DEFAULT_POWER = 0.8

Basis = Literal["launches", "repeats", "none"]
Outcome = Literal["different", "equivalent", "inconclusive", "untested"]


@dataclass(frozen=True)
class Design:
    """How verdicts are made: the family-wise error rate shared by ``tests`` comparisons, the
    equivalence margin and the power the minimum detectable effect is stated at."""

    alpha: float = DEFAULT_ALPHA
    margin: float = DEFAULT_MARGIN
    """Equivalence margin as a fraction: 0.05 is +-5% (on the ratio: 1/1.05 to 1.05)."""
    power: float = DEFAULT_POWER
    tests: int = 1
    """Comparisons the family-wise error rate is shared by (Bonferroni)."""

    def __post_init__(self) -> None:
        if not 0 < self.alpha < 1:
            raise ValueError(f"alpha must be between 0 and 1, got {self.alpha}")
        if not 0 < self.margin < 10:
            raise ValueError(f"margin must be a positive fraction (0.05 = 5%), got {self.margin}")
        if not 0 < self.power < 1:
            raise ValueError(f"power must be between 0 and 1, got {self.power}")
        if self.tests < 1:
            raise ValueError(f"tests must be 1 or more, got {self.tests}")

    @property
    def per_test_alpha(self) -> float:
        """The two-sided level of each comparison: ``alpha / tests``."""
        return self.alpha / self.tests

    @property
    def confidence(self) -> float:
        """The coverage of each interval shown beside a verdict."""
        return 1 - self.per_test_alpha

    @property
    def log_margin(self) -> float:
        return math.log1p(self.margin)


@dataclass(frozen=True)
class Estimate:
    """One cell's estimate of a metric on the log scale."""

    log_mean: float
    """Mean of the launch means of log(value)."""
    var: float | None
    """Variance of ``log_mean`` (None: one launch of one repeat, no spread)."""
    df: float
    basis: Basis
    """``launches``: from the spread of launch means (both noise levels); ``repeats``: one launch,
    from its repeats (restart noise not in it); ``none``: a single value."""
    launches: int
    repeats: tuple[int, ...]
    """Repeats per launch."""
    pooled_ss: float = 0.0
    """Sum of squares behind ``var`` (about the launch means' mean, or the repeats' mean)."""

    @property
    def mean(self) -> float:
        """The geometric mean of the values (launch means averaged on the log scale)."""
        return math.exp(self.log_mean)

    @property
    def n(self) -> int:
        """Units the variance is made of: launches (two or more), or the one launch's repeats."""
        return self.launches if self.basis == "launches" else sum(self.repeats)

    def interval(self, confidence: float = 0.95) -> tuple[float, float] | None:
        """The two-sided interval of the geometric mean (None without a variance)."""
        if self.var is None:
            return None
        half = _t(confidence, self.df) * math.sqrt(self.var)
        return (exp_or_inf(self.log_mean - half), exp_or_inf(self.log_mean + half))

    @property
    def cv(self) -> float | None:
        """Coefficient of variation of the units (launch means, or repeats), from the log-scale SD."""
        if self.var is None:
            return None
        return math.sqrt(math.expm1(self.var * self.n))


_MAX_LOG = math.log(sys.float_info.max)


def exp_or_inf(x: float, minus_one: bool = False) -> float:
    """``exp(x)`` (``expm1`` with ``minus_one``), or inf where it would overflow: the interval of a
    ratio at a tiny alpha over few degrees of freedom is unbounded, not an error."""
    if x > _MAX_LOG:
        return math.inf
    return math.expm1(x) if minus_one else math.exp(x)


def _positive(values: Sequence[float]) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(v) and v > 0]


def _mean_ss(x: Sequence[float]) -> tuple[float, float]:
    """Mean and sum of squared deviations (plain Python: these lists hold a few values)."""
    m = math.fsum(x) / len(x)
    return m, math.fsum((v - m) ** 2 for v in x)


def estimate(launches: Sequence[Sequence[float]]) -> Estimate | None:
    """The estimate of a cell from its values, one list per launch (a value each repeat).

    Values that are not positive and finite (a figure that was not measured) are left out; a launch
    left with none is left out. None when nothing is left."""
    logs = [[math.log(v) for v in kept] for kept in (_positive(lv) for lv in launches) if kept]
    if not logs:
        return None
    counts = tuple(len(x) for x in logs)
    if len(logs) >= 2:
        means = [math.fsum(x) / len(x) for x in logs]
        grand, ss = _mean_ss(means)
        n = len(logs)
        return Estimate(grand, ss / (n - 1) / n, n - 1, "launches", n, counts, ss)
    (x,) = logs
    if len(x) < 2:
        return Estimate(x[0], None, 0, "none", 1, counts)
    mean, ss = _mean_ss(x)
    return Estimate(mean, ss / (len(x) - 1) / len(x), len(x) - 1, "repeats", 1, counts, ss)


def with_resolution(est: Estimate, widths: Sequence[float]) -> Estimate:
    """``est`` of values each known only as the lower end of a bracket: a search's last passing load
    ``v`` below its first failing one ``v e^w`` (``widths`` the log-widths ``w``). The boundary lies in
    ``[v, v e^w)``, so:

    - the estimate moves to the brackets' middles (``log_mean + mean(w) / 2``): the last passing load
      alone sits half a bracket low on average;
    - the error left, at most ``w / 2`` about the middle, is counted as an SD of ``w / 2`` (variance
      ``w^2 / 4``, its bound, so that the interval holds wherever in its bracket the truth lies and
      whatever noise comes beside it; a uniform's ``w^2 / 12`` covered 92-94% in simulated studies
      of 5 to 10 searches of 50-request probes at a 95% level);
    - and it is **not divided by the number of values**: every repeat of a search walks the same
      grid of loads (the same start, factor and bisection), so on a steady engine they all land in
      the same bracket and averaging them removes none of its error (dividing by ``n``, as this did
      before, covered a steady engine's boundary in 38% of simulated studies of 10 repeats at a 95%
      level: tests/unit/test_capacity.py).

    A width of 0 (a value known exactly: adjacent whole numbers of streams) counts as such in the
    means. A single value is moved to its bracket's middle and stays untested (no variance).
    Unchanged without widths."""
    w = [float(x) for x in widths if x is not None and math.isfinite(x) and x >= 0]
    if not any(w):
        return est
    shifted = est.log_mean + math.fsum(w) / len(w) / 2.0
    if est.var is None or est.df <= 0:
        return replace(est, log_mean=shifted)
    unit = math.fsum(x * x for x in w) / len(w) / 4.0
    # compare() pools per-unit variances (pooled_ss / df, times 1/n_A + 1/n_B): the bracket's error,
    # the same whatever n, enters as n x unit per unit
    return replace(
        est, log_mean=shifted, var=est.var + unit, pooled_ss=est.pooled_ss + unit * est.n * est.df
    )


@dataclass(frozen=True)
class Comparison:
    """``log(A) - log(B)`` of two cells, with its standard error and degrees of freedom."""

    diff: float
    se: float | None
    df: float
    pooled: bool
    """Student's pooled variance (balanced) rather than Welch's."""
    restart_noise_measured: bool
    """Both cells' variances came from two launches or more."""

    @property
    def ratio(self) -> float:
        """A over B (geometric means)."""
        return math.exp(self.diff)

    def interval(self, confidence: float) -> tuple[float, float] | None:
        """Two-sided interval of ``diff`` (log scale) at ``confidence``; None without a variance."""
        if self.se is None:
            return None
        half = _t(confidence, self.df) * self.se
        return (self.diff - half, self.diff + half)


def compare(a: Estimate, b: Estimate) -> Comparison:
    """Cell A against cell B (see the module's docstring for when the variances are pooled)."""
    measured = a.basis == "launches" and b.basis == "launches"
    if a.var is None or b.var is None:
        return Comparison(a.log_mean - b.log_mean, None, 0.0, False, measured)
    balanced = a.basis == b.basis and a.n == b.n and a.df > 0 and b.df > 0
    if balanced:
        df = a.df + b.df
        pooled_unit_var = (a.pooled_ss + b.pooled_ss) / df
        se = math.sqrt(pooled_unit_var * (1 / a.n + 1 / b.n))
        return Comparison(a.log_mean - b.log_mean, se, df, True, measured)
    var = a.var + b.var
    if var == 0:
        return Comparison(a.log_mean - b.log_mean, 0.0, math.inf, False, measured)
    df = var**2 / sum(v**2 / d for v, d in ((a.var, a.df), (b.var, b.df)) if v > 0)
    return Comparison(a.log_mean - b.log_mean, math.sqrt(var), df, False, measured)


@lru_cache(maxsize=4096)
def _t(confidence: float, df: float) -> float:
    """The two-sided critical value at ``confidence`` (normal for infinite df)."""
    q = 0.5 + confidence / 2
    return float(stats.norm.ppf(q)) if math.isinf(df) else float(stats.t.ppf(q, df))


def power(effect: float, se: float, df: float, alpha: float) -> float:
    """Probability that a two-sided t test at ``alpha`` rejects when the true log difference is
    ``effect`` and the estimate has standard error ``se`` with ``df`` degrees of freedom (the
    noncentral t distribution)."""
    if se <= 0:
        return 1.0 if effect != 0 else alpha
    crit = _t(1 - alpha, df)
    nc = abs(effect) / se
    if math.isinf(df) or df > 1e6:
        return float(stats.norm.sf(crit - nc) + stats.norm.cdf(-crit - nc))
    # the far tail, P(T < -crit), as the upper tail of -T; scipy's nct gives nan deep in a tail,
    # where the probability is nil
    tails = [float(stats.nct.sf(crit, df, nc)), float(stats.nct.sf(crit, df, -nc))]
    return min(1.0, sum(0.0 if math.isnan(p) else p for p in tails))


def mde(se: float, df: float, alpha: float, target: float = DEFAULT_POWER) -> float:
    """The minimum detectable effect: the smallest true log difference a two-sided test at ``alpha``
    with this ``se`` and ``df`` detects with probability ``target``."""
    if se <= 0:
        return 0.0
    crit = _t(1 - alpha, df)
    upper = se * (crit + 1)
    while power(upper, se, df, alpha) < target:
        if upper > _MAX_LOG:  # past any ratio a float holds (a tiny alpha over few df): unbounded
            return math.inf
        upper *= 2
    return float(optimize.brentq(lambda d: power(d, se, df, alpha) - target, 0.0, upper, xtol=1e-10))


@dataclass(frozen=True)
class Verdict:
    """The outcome of one comparison under a :class:`Design`, in a metric's own direction."""

    outcome: Outcome
    leader: str
    """The better of the two (or the first, when they are equal)."""
    other: str
    advantage: float
    """The leader's advantage as a ratio >= 1 (geometric means; other / leader when lower is better)."""
    interval: tuple[float, float] | None
    """The advantage's interval at ``confidence`` (ratios; the one the verdict was made with)."""
    confidence: float
    margin: float
    restart_noise_measured: bool
    pooled: bool
    df: float
    se: float | None = None
    power: float = DEFAULT_POWER

    @cached_property
    def mde(self) -> float | None:
        """The minimum detectable difference as a fraction (0.12: 12%): the smallest true difference
        this comparison would have detected with probability ``power`` at its level."""
        if self.se is None:
            return None
        return exp_or_inf(mde(self.se, self.df, 1 - self.confidence, self.power), minus_one=True)

    @property
    def different(self) -> bool:
        return self.outcome == "different"

    @property
    def within_margin(self) -> bool:
        """The whole interval lies inside the equivalence margin."""
        if self.interval is None:
            return False
        bound = 1 + self.margin
        return 1 / bound < self.interval[0] and self.interval[1] < bound

    def text(self) -> str:
        """'a better than b by 12.3% [+8.1%, +16.7%]', 'equivalent within +-5% (a ahead by 0.4%
        [-2.0%, +3.1%])' or 'inconclusive: differences below 14% cannot be seen with this data (b ahead
        by 1.5% [-6.0%, +9.0%])'; the interval is the leader's advantage at the design's level."""
        ci = self.interval_text()
        noise = "" if self.restart_noise_measured else "; restart noise not measured"
        if self.outcome == "untested":
            return f"{self.leader} ahead of {self.other} by {pct(self.advantage)} (a single value: no test)"
        if self.outcome == "different":
            small = f"; within the +-{self.margin:.0%} margin" if self.within_margin else ""
            return f"{self.leader} better than {self.other} by {pct(self.advantage)} {ci}{small}{noise}"
        lead = f"{self.leader} ahead by {pct(self.advantage)} {ci}"
        if self.outcome == "equivalent":
            return f"equivalent within +-{self.margin:.0%} ({lead}){noise}"
        if self.mde is not None and math.isinf(self.mde):
            return f"inconclusive: this data cannot tell a difference of any size ({lead}){noise}"
        below = detectable(self.mde)
        return f"inconclusive: differences below {below} cannot be seen with this data ({lead}){noise}"

    def interval_text(self) -> str:
        if self.interval is None:
            return ""
        lo, hi = self.interval
        return f"[{signed_pct(lo)}, {signed_pct(hi)}]"


def pct(ratio: float) -> str:
    """A ratio >= 1 as the percentage it is above 1 ('12.3%'); large ones as a factor too."""
    if math.isinf(ratio):
        return "inf"
    text = f"{(ratio - 1) * 100:.1f}%"
    return f"{text} ({ratio:.2f}x)" if ratio >= 2 else text


def detectable(mde: float | None) -> str:
    """A minimum detectable difference in words: '12%', or a factor when it is large ('5.3x')."""
    if mde is None or math.isnan(mde):
        return "an unknown size"
    if math.isinf(mde):
        return "any size"
    return f"{mde:.0%}" if mde < 1 else f"{mde + 1:,.1f}x"


def signed_pct(ratio: float) -> str:
    return "+inf%" if math.isinf(ratio) else f"{(ratio - 1) * 100:+.1f}%"


def decide(
    comparison: Comparison,
    design: Design,
    higher_is_better: bool,
    names: tuple[str, str] = ("A", "B"),
) -> Verdict:
    """The verdict on ``comparison`` (A = ``names[0]`` over B) under ``design``."""
    a, b = names
    d = comparison.diff
    goodness = d if higher_is_better else -d  # A's advantage over B on the log scale (negative: B's)
    leader, other = (a, b) if goodness >= 0 else (b, a)
    advantage = math.exp(abs(d))
    ci = comparison.interval(design.confidence)
    if ci is None or comparison.se is None:
        return Verdict(
            "untested", leader, other, advantage, None, design.confidence, design.margin,
            comparison.restart_noise_measured, comparison.pooled, comparison.df, None, design.power,
        )  # fmt: skip
    # d's interval turned into the interval of the leader's advantage: |d| +- the same half-width
    flip = (goodness >= 0) != higher_is_better
    lo, hi = (-ci[1], -ci[0]) if flip else ci
    interval = (exp_or_inf(lo), exp_or_inf(hi))
    margin = design.log_margin
    if lo > 0:
        outcome: Outcome = "different"
    elif -margin < lo and hi < margin:
        outcome = "equivalent"
    else:
        outcome = "inconclusive"
    return Verdict(
        outcome, leader, other, advantage, interval, design.confidence, design.margin,
        comparison.restart_noise_measured, comparison.pooled, comparison.df, comparison.se, design.power,
    )  # fmt: skip


def planned_power(
    effect: float, between_cv: float, within_cv: float, launches: int, repeats: int, design: Design
) -> float:
    """The power a planned balanced comparison of two arms promises: a true ratio of ``1 + effect``,
    restart noise ``between_cv`` and repeat noise ``within_cv`` (coefficients of variation),
    ``launches`` launches of ``repeats`` repeats per arm, at the design's per-test level. With one
    launch the restart noise is in the difference but not in its estimate: the figure is then the
    power against repeat noise alone (what such a design claims, not what it delivers)."""
    sb2, sw2 = math.log1p(between_cv**2), math.log1p(within_cv**2)
    if launches >= 2:
        unit_var, n, df = sb2 + sw2 / repeats, launches, 2 * (launches - 1)
    else:
        unit_var, n, df = sw2, repeats, 2 * (repeats - 1)
    if df <= 0:
        return float("nan")
    return power(math.log1p(effect), math.sqrt(unit_var * 2 / n), df, design.per_test_alpha)


def launches_needed(
    effect: float, between_cv: float, within_cv: float, repeats: int, design: Design, most: int = 50
) -> int | None:
    """The fewest launches per arm (2 or more, at most ``most``) with which a balanced comparison
    of two arms would detect a true difference of ``effect`` (0.1: 10%) with the design's power, at
    this restart and repeat noise and ``repeats`` repeats a launch; None when ``most`` do not."""
    for launches in range(2, most + 1):
        if planned_power(effect, between_cv, within_cv, launches, repeats, design) >= design.power:
            return launches
    return None


@dataclass(frozen=True)
class Components:
    """The variance of a metric split into its two levels (log scale), pooled over cells."""

    between: float
    """Restart noise: the launch effect's variance (method of moments, floored at 0)."""
    within: float
    """Repeat noise: the variance between repeats of one launch."""
    df_between: int
    df_within: int

    @property
    def total(self) -> float:
        return self.between + self.within

    @property
    def between_share(self) -> float | None:
        """The launch level's share of a single repeat's variance."""
        return self.between / self.total if self.total > 0 else None

    @property
    def between_cv(self) -> float:
        return math.sqrt(math.expm1(self.between))

    @property
    def within_cv(self) -> float:
        return math.sqrt(math.expm1(self.within))


def components(cells: Sequence[Sequence[Sequence[float]]]) -> Components | None:
    """Restart and repeat noise from several cells (each a list of launches of repeat values),
    pooled under the model's assumption that the noise on the log scale is the same in every cell:
    one-way ANOVA within each cell (launches as groups), the sums of squares pooled, the launch
    variance ``(MS_between - MS_within) / n0`` (``n0`` the repeats per launch, Searle's unbalanced
    form), floored at 0. None when no cell has a repeat-to-repeat spread."""
    ss_w = ss_b = 0.0
    df_w = df_b = 0
    n0_weighted = 0.0
    for cell in cells:
        logs = [np.log(v) for v in (_positive(lv) for lv in cell) if v]
        for x in logs:
            ss_w += float(((x - x.mean()) ** 2).sum())
            df_w += len(x) - 1
        if len(logs) >= 2:
            counts = np.array([len(x) for x in logs], dtype=float)
            means = np.array([x.mean() for x in logs])
            grand = float((counts * means).sum() / counts.sum())
            ss_b += float((counts * (means - grand) ** 2).sum())
            df_b += len(logs) - 1
            total = counts.sum()
            n0 = (total - (counts**2).sum() / total) / (len(logs) - 1)
            n0_weighted += n0 * (len(logs) - 1)
    if df_w == 0:
        return None
    within = ss_w / df_w
    between = 0.0
    if df_b > 0:
        n0 = n0_weighted / df_b
        between = max(0.0, (ss_b / df_b - within) / n0)
    return Components(between, within, df_b, df_w)


def spend_alpha(alpha: float, looks: int) -> list[float]:
    """The share of ``alpha`` each of ``looks`` analyses may use when data are added until a decision
    (or a budget) is reached: the increments of the Lan-DeMets O'Brien-Fleming spending function at
    equally spaced information fractions. They sum to ``alpha``, so testing each look at its own share
    keeps the error rate over all looks at or below ``alpha`` (a union bound: valid for any rule that
    decides when to stop; conservative, as it ignores the looks' correlation)."""
    if looks < 1:
        raise ValueError("looks must be 1 or more")
    z = float(stats.norm.ppf(1 - alpha / 2))
    spent = [2 * (1 - float(stats.norm.cdf(z / math.sqrt((k + 1) / looks)))) for k in range(looks)]
    spent[-1] = alpha  # exactly alpha at the last look (the spending function's value at t = 1)
    return [spent[0], *(b - a for a, b in itertools.pairwise(spent))]
