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
    noise is then *not* in it. Such a cell is compared only with a :class:`RestartPrior` (the restart
    noise earlier studies measured for its configuration class on its node, :mod:`k3pipe.records.priors`)
    added to its variance (:func:`with_prior`); without one, a comparison with it is ``unknown``
    ("cannot tell: restart noise unknown"): neither a difference nor an equivalence is claimed from
    repeat noise alone, which would call an A/A different far above alpha at a GPU's restart noise;
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
    at this level (noncentral t);
  - **unknown** when a side was launched once and no restart prior is known: the restart noise is in
    the difference but in no variance, so the data cannot say either way.
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
    "Restart",
    "RestartPrior",
    "Verdict",
    "change_words",
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
    "satterthwaite",
    "spend_alpha",
    "with_prior",
    "with_resolution",
]

DEFAULT_ALPHA = 0.05
DEFAULT_MARGIN = 0.05
DEFAULT_POWER = 0.8

Basis = Literal["launches", "repeats", "prior", "none"]
Outcome = Literal["different", "equivalent", "inconclusive", "untested", "unknown"]
Restart = Literal["measured", "prior", "unknown"]
"""Where a comparison's restart noise comes from: both cells' launches, a :class:`RestartPrior` (for
the cells launched once), or nowhere (a cell launched once, no prior): then no verdict."""


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
class RestartPrior:
    """Restart noise known before a study: the launch effect's variance of one metric (log scale)
    for a configuration class on a node, pooled from earlier studies that launched it twice or more
    (:mod:`k3pipe.records.priors`), with its degrees of freedom and where it came from. Added to the variance
    of a cell launched once, it lets that cell be judged (:func:`with_prior`)."""

    var: float
    df: float
    source: str
    """In words: which studies, how many launches, how old ('2 studies, 6 launches, 2026-12-01 ..
    2026-12-04, the newest 2 days old')."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.var) and self.var >= 0):
            raise ValueError(f"a restart prior's variance must be finite and >= 0, got {self.var}")
        if not self.df > 0:
            raise ValueError(f"a restart prior needs degrees of freedom > 0, got {self.df}")

    @property
    def cv(self) -> float:
        """The restart noise as a coefficient of variation."""
        return math.sqrt(math.expm1(self.var))


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
    from its repeats (restart noise not in it); ``prior``: one launch, its repeats' variance plus a
    :class:`RestartPrior`; ``none``: a single value."""
    launches: int
    repeats: tuple[int, ...]
    """Repeats per launch."""
    pooled_ss: float = 0.0
    """Sum of squares behind ``var`` (about the launch means' mean, or the repeats' mean)."""
    prior: RestartPrior | None = None
    """Basis ``prior``: the restart noise added to ``var``."""
    repeat_var: float | None = None
    """Basis ``prior``: the variance from the repeats alone (``var`` less the prior's), and its df."""
    repeat_df: float = 0.0

    @property
    def mean(self) -> float:
        """The geometric mean of the values (launch means averaged on the log scale)."""
        return math.exp(self.log_mean)

    @property
    def n(self) -> int:
        """Units the variance is made of: launches (two or more), or the one launch's repeats."""
        return self.launches if self.basis == "launches" else sum(self.repeats)

    @property
    def restart_known(self) -> bool:
        """Restart noise is in ``var``: from launches, or a prior."""
        return self.basis in ("launches", "prior")

    def interval(self, confidence: float = 0.95) -> tuple[float, float] | None:
        """The two-sided interval of the geometric mean (None without a variance)."""
        if self.var is None:
            return None
        half = _t(confidence, self.df) * math.sqrt(self.var)
        return (exp_or_inf(self.log_mean - half), exp_or_inf(self.log_mean + half))

    @property
    def cv(self) -> float | None:
        """Coefficient of variation of the units (launch means, or repeats), from the log-scale SD."""
        var = self.repeat_var if self.basis == "prior" else self.var
        if var is None:
            return None
        return math.sqrt(math.expm1(var * self.n))


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
    return replace(est, log_mean=shifted, var=est.var + unit, pooled_ss=est.pooled_ss + unit * est.n * est.df)


def satterthwaite(parts: Sequence[tuple[float, float]]) -> float:
    """The Welch-Satterthwaite degrees of freedom of a sum of independent variance estimates, each
    ``(variance, df)``; infinite when every part is exact (or zero)."""
    total = math.fsum(v for v, _ in parts)
    denominator = math.fsum(v * v / d for v, d in parts if v > 0 and d > 0 and math.isfinite(d))
    if total <= 0 or denominator <= 0:
        return math.inf
    return total * total / denominator


def with_prior(est: Estimate, prior: RestartPrior | None) -> Estimate:
    """A cell launched once, its restart noise taken from ``prior``: the prior's variance added to
    the repeats' (``var(repeats) / R + s_b^2``, Satterthwaite's df), basis ``prior``. Unchanged when
    there is no prior, or the cell was launched twice or more (its own launches hold restart noise)
    or measured once (no repeat variance to add to)."""
    if prior is None or est.basis != "repeats" or est.var is None:
        return est
    return replace(
        est,
        var=est.var + prior.var,
        df=satterthwaite([(est.var, est.df), (prior.var, prior.df)]),
        basis="prior",
        prior=prior,
        repeat_var=est.var,
        repeat_df=est.df,
    )


@dataclass(frozen=True)
class Comparison:
    """``log(A) - log(B)`` of two cells, with its standard error and degrees of freedom."""

    diff: float
    se: float | None
    df: float
    pooled: bool
    """Student's pooled variance (balanced) rather than Welch's."""
    restart: Restart = "measured"
    """Where the restart noise in ``se`` comes from (``unknown``: nowhere: no verdict)."""
    prior: RestartPrior | None = None
    """The restart prior a side was judged with (basis ``prior``), if any."""

    @property
    def restart_noise_measured(self) -> bool:
        """Both cells' variances came from two launches or more."""
        return self.restart == "measured"

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


def _restart(a: Estimate, b: Estimate) -> Restart:
    if a.basis == "launches" and b.basis == "launches":
        return "measured"
    if a.restart_known and b.restart_known:
        return "prior"
    return "unknown"


def compare(a: Estimate, b: Estimate) -> Comparison:
    """Cell A against cell B (see the module's docstring for when the variances are pooled). A side
    judged with a :class:`RestartPrior` is compared by Welch's rule, the prior counted once when both
    sides share it (one estimate of one variance, in both)."""
    diff = a.log_mean - b.log_mean
    restart = _restart(a, b)
    prior = a.prior or b.prior
    if a.var is None or b.var is None:
        return Comparison(diff, None, 0.0, False, restart, prior)
    if restart == "prior":
        parts: list[tuple[float, float]] = [
            (e.repeat_var, e.repeat_df) if e.basis == "prior" and e.repeat_var is not None else (e.var, e.df)
            for e in (a, b)
            if e.var is not None
        ]
        priors = [e.prior for e in (a, b) if e.basis == "prior" and e.prior is not None]
        if len(priors) == 2 and priors[0] == priors[1]:
            parts.append((2 * priors[0].var, priors[0].df))
        else:
            parts.extend((p.var, p.df) for p in priors)
        var = math.fsum(v for v, _ in parts)
        return Comparison(diff, math.sqrt(var), satterthwaite(parts), False, restart, prior)
    balanced = a.basis == b.basis and a.n == b.n and a.df > 0 and b.df > 0
    if balanced:
        df = a.df + b.df
        pooled_unit_var = (a.pooled_ss + b.pooled_ss) / df
        se = math.sqrt(pooled_unit_var * (1 / a.n + 1 / b.n))
        return Comparison(diff, se, df, True, restart)
    var = a.var + b.var
    if var == 0:
        return Comparison(diff, 0.0, math.inf, False, restart)
    df = var**2 / sum(v**2 / d for v, d in ((a.var, a.df), (b.var, b.df)) if v > 0)
    return Comparison(diff, math.sqrt(var), df, False, restart)


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


UNKNOWN_RESTART = (
    "cannot tell: restart noise unknown (a side was launched once, and no earlier study measured the "
    "restart noise of its configuration on this node): launch each arm twice or more (`launches: 2`)"
)
"""What a verdict says when a side's restart noise is in no variance."""


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
    restart: Restart
    pooled: bool
    df: float
    se: float | None = None
    power: float = DEFAULT_POWER
    higher_is_better: bool = True
    prior: RestartPrior | None = None
    """The restart prior a one-launch side was judged with (``restart`` 'prior')."""

    @property
    def restart_noise_measured(self) -> bool:
        return self.restart == "measured"

    @cached_property
    def mde(self) -> float | None:
        """The minimum detectable difference as a fraction (0.12: 12%): the smallest true difference
        this comparison would have detected with probability ``power`` at its level (None: no test)."""
        if self.se is None or self.outcome == "unknown":
            return None
        return exp_or_inf(mde(self.se, self.df, 1 - self.confidence, self.power), minus_one=True)

    @property
    def different(self) -> bool:
        return self.outcome == "different"

    @property
    def tested(self) -> bool:
        """A test was made (not a single value, not an unknown restart noise)."""
        return self.outcome not in ("untested", "unknown")

    @property
    def within_margin(self) -> bool:
        """The whole interval lies inside the equivalence margin."""
        if self.interval is None:
            return False
        bound = 1 + self.margin
        return 1 / bound < self.interval[0] and self.interval[1] < bound

    def change_text(self) -> str:
        """The leader against the other in words a reader cannot misread: '24.0% higher', '30.5%
        lower', '2.80x higher (+180.0%)', '85.7% lower (the other 7.00x)'."""
        return change_words(self.advantage, self.higher_is_better)

    def text(self) -> str:
        """'a better than b: 12.3% higher [+8.1%, +16.7%]', 'equivalent within +-5% (a 0.4% higher
        [-2.0%, +3.1%])', 'inconclusive: differences below 14% cannot be seen with this data (b 1.5%
        lower [-8.3%, +6.3%])', or 'cannot tell: restart noise unknown ...'; the interval is the
        leader's change against the other at the design's level."""
        ci = self.interval_text()
        said = f"{self.leader} {self.change_text()}" + (f" {ci}" if ci else "")
        if self.outcome == "unknown":
            return f"{UNKNOWN_RESTART} ({self.leader} {self.change_text()} than {self.other} in one launch)"
        if self.outcome == "untested":
            return f"{self.leader} {self.change_text()} than {self.other} (a single value: no test)"
        noise = self.noise_note()
        if self.outcome == "different":
            small = f"; within the +-{self.margin:.0%} margin" if self.within_margin else ""
            return f"{self.leader} better than {self.other}: {self.change_text()} {ci}{small}{noise}"
        if self.outcome == "equivalent":
            return f"equivalent within +-{self.margin:.0%} ({said}){noise}"
        if self.mde is not None and math.isinf(self.mde):
            return f"inconclusive: this data cannot tell a difference of any size ({said}){noise}"
        below = detectable(self.mde)
        return f"inconclusive: differences below {below} cannot be seen with this data ({said}){noise}"

    def noise_note(self) -> str:
        """Where the restart noise came from, when not from this study's launches."""
        if self.restart == "prior" and self.prior is not None:
            return f"; restart noise {self.prior.cv:.1%} from the history ({self.prior.source})"
        return ""

    def interval_text(self) -> str:
        """The leader's change against the other, signed: '[+8.1%, +16.7%]' (higher is better),
        '[-41.2%, -16.7%]' (lower is better: the leader's value below the other's)."""
        if self.interval is None:
            return ""
        lo, hi = self.interval
        if self.higher_is_better:
            return f"[{signed_pct(lo)}, {signed_pct(hi)}]"
        return f"[{signed_pct(1 / hi if hi else math.inf)}, {signed_pct(1 / lo if lo else math.inf)}]"


def change_words(ratio: float, higher_is_better: bool) -> str:
    """A leader's advantage ``ratio`` (>= 1) as the change a reader means: higher is better: '24.0%
    higher', '2.80x higher (+180.0%)'; lower is better: the leader's value below the other's, '30.5%
    lower', '85.7% lower (the other 7.00x)'."""
    if math.isinf(ratio):
        return "infinitely higher" if higher_is_better else "100% lower (the other infinitely higher)"
    if higher_is_better:
        if ratio >= 2:
            return f"{ratio:.2f}x higher (+{(ratio - 1) * 100:.1f}%)"
        return f"{(ratio - 1) * 100:.1f}% higher"
    lower = f"{(1 - 1 / ratio) * 100:.1f}% lower"
    return f"{lower} (the other {ratio:.2f}x)" if ratio >= 2 else lower


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
    """The verdict on ``comparison`` (A = ``names[0]`` over B) under ``design``: ``unknown`` when a
    side's restart noise is in no variance (launched once, no prior), whatever the repeats say."""
    a, b = names
    d = comparison.diff
    goodness = d if higher_is_better else -d  # A's advantage over B on the log scale (negative: B's)
    leader, other = (a, b) if goodness >= 0 else (b, a)
    advantage = math.exp(abs(d))
    ci = comparison.interval(design.confidence)
    if ci is None or comparison.se is None or comparison.restart == "unknown":
        outcome: Outcome = "untested" if ci is None or comparison.se is None else "unknown"
        return Verdict(
            outcome, leader, other, advantage, None, design.confidence, design.margin,
            comparison.restart, comparison.pooled, comparison.df, None, design.power, higher_is_better,
            comparison.prior,
        )  # fmt: skip
    # d's interval turned into the interval of the leader's advantage: |d| +- the same half-width
    flip = (goodness >= 0) != higher_is_better
    lo, hi = (-ci[1], -ci[0]) if flip else ci
    interval = (exp_or_inf(lo), exp_or_inf(hi))
    margin = design.log_margin
    if lo > 0:
        outcome = "different"
    elif -margin < lo and hi < margin:
        outcome = "equivalent"
    else:
        outcome = "inconclusive"
    return Verdict(
        outcome, leader, other, advantage, interval, design.confidence, design.margin,
        comparison.restart, comparison.pooled, comparison.df, comparison.se, design.power, higher_is_better,
        comparison.prior,
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
