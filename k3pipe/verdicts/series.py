"""Judging a figure's series of nightly retests: has it got worse, by more than the margin, lately?

A retest's figure (one arm, one workload, one decision metric) is one value a night: the geometric
mean of its launch means. Its noise from night to night (restart noise, the node's day-to-day drift)
is in no single retest's variance, so a retest is judged against the **series** of earlier retests,
whose own spread is the noise. On ``x = log value``, signed so that a larger ``x`` is worse:

**The scan.** Tonight's retest is the last of the series. For each split ``w`` of
:attr:`SeriesRule.splits` (1, 2, 4, 8) the segment after the split, the last ``w`` retests of the
series (tonight's included), is compared with the **history** before it (at least
:attr:`SeriesRule.min_history` retests), mean against mean, by Student's t with the variance pooled
within the two parts (``k + w - 2`` degrees of freedom). A figure alerts when, for some split, all
three hold:

1. *detected*: one-sided in the worse direction, ``p < alpha / (S * K)``, ``S`` the number of splits
   (4, whether the series is long enough for each or not) and ``K`` the number of figures the retest
   judges: Bonferroni over both;
2. *worse by more than the margin*: the one-sided :attr:`SeriesRule.margin_confidence` (99%) lower
   bound of the change lies beyond ``log(1 + margin)``. Without it a quiet engine (1% noise) would
   alert on a real 3% step, which (1) detects, whenever noise pushed its estimate past 5%; at 95%
   a 3% step still alerted in 1.7% of retests at 5% noise, at 99% in 0.4%;
3. *still there tonight*: tonight's own value is worse than the history's mean by more than the
   margin, so that a regression that is gone (fixed, not accepted) is not alerted again while its
   retests are still in the segment.

**The series** is every retest since the newest accepted one (``k3pipe retest accept``; the series
starts there), whatever it found, except those that raised an alert: those are left out (``kept``
False) until an acceptance clears them. A small step that was not detected on its first night stays
in the series, in the segment of the nights after it, where it adds up; it does not become the
baseline until it has passed through the segment (8 retests). A regression that was alerted never
joins the history: the retests after it are judged against the nights before it until it is gone or
accepted, and one wild night (a 6x slower engine, fixed the next day) does not inflate the spread
and blind the series.

**Its rates.** With no change, a retest alerts in at most ``alpha`` (1%) of nights, over all its
figures, when every retest is kept (the union bound over the ``S * K`` tests; (2) and (3) only
remove alerts), whatever the noise. Leaving the alerted retests out costs a little: a false alarm
that came from a short history that happened to be tight can recur for a few nights. Simulated at
10% restart noise over the 20 nights after 4 or 10 earlier retests, the rate per retest averaged
0.5% with one figure, 0.8% with three and 1.0-1.1% with twelve independent ones (single nights up
to 1.4%). ``tests/unit/test_series.py`` holds these rates, the detection of a 20% step and the
silence on a 3% one on series whose truth is known; docs/measurement.md ("Regression alerts: a
retest against its series") gives the figures.

Everything here is numpy/scipy on arrays, vectorized over series so that the tests judge thousands of
simulated series a night; :func:`judge` is the one-series form the alerts use.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy import stats

__all__ = ["Judgement", "Scan", "SeriesRule", "judge", "scan"]

Status = Literal["insufficient history", "no alert", "worse"]


@dataclass(frozen=True)
class SeriesRule:
    """The constants of the rule (module docstring); the alerts use the defaults."""

    alpha: float = 0.01
    """False alarms per retest, over all its figures, when nothing changed."""
    min_history: int = 4
    """Earlier retests (that raised no alert) a split needs before it: fewer, 'insufficient history'."""
    splits: tuple[int, ...] = (1, 2, 4, 8)
    """The lengths of the recent segment scanned (doubling: few tests, segments up to 8 nights)."""
    margin_confidence: float = 0.99
    """The one-sided confidence with which an alert's change must lie beyond the margin."""
    max_series: int = 40
    """The newest retests of a series read (the history slides after 40 nights)."""

    def __post_init__(self) -> None:
        if not 0 < self.alpha < 1:
            raise ValueError(f"SeriesRule.alpha must lie in (0, 1), not {self.alpha}")
        if self.min_history < 2:
            raise ValueError(f"SeriesRule.min_history must be 2 or more (a spread), not {self.min_history}")
        if not self.splits or min(self.splits) < 1:
            raise ValueError(f"SeriesRule.splits must be lengths of 1 or more, not {self.splits}")
        if self.max_series <= self.min_history + max(self.splits, default=1) - 1:
            raise ValueError(
                f"SeriesRule.max_series must exceed min_history + the longest split - 1 "
                f"({self.min_history + max(self.splits) - 1}), not {self.max_series}"
            )
        if not 0.5 <= self.margin_confidence < 1:
            raise ValueError(
                f"SeriesRule.margin_confidence must lie in [0.5, 1), not {self.margin_confidence}"
            )


@dataclass
class Scan:
    """Per series (arrays over the values' leading axes): the verdict, and the split reported: the
    alerting split with the smallest p, or without an alert the allowed split with the smallest p."""

    alert: NDArray[np.bool_]
    sufficient: NDArray[np.bool_]
    """Some split has :attr:`SeriesRule.min_history` retests before it (else 'insufficient history')."""
    earlier: NDArray[np.int_]
    """Earlier retests kept in the series (what 'insufficient history' counts)."""
    segment: NDArray[np.int_]
    """The reported split's segment length ``w`` (0: none)."""
    history: NDArray[np.int_]
    """The reported split's history length ``k``."""
    change: NDArray[np.float64]
    """Log change of the segment's mean against the history's (worse positive)."""
    low: NDArray[np.float64]
    """Its one-sided ``margin_confidence`` lower bound (log)."""
    high: NDArray[np.float64]
    """The matching upper bound (log): ``[low, high]`` is the two-sided ``2 * confidence - 1`` interval."""
    tonight: NDArray[np.float64]
    """Tonight's log change against the reported split's history mean."""
    p_value: NDArray[np.float64]
    level: float
    """The detection level of every test: ``alpha / (S * K)``."""


def scan(
    values: ArrayLike,
    kept: ArrayLike,
    figures: int,
    margin_pct: float,
    rule: SeriesRule | None = None,
) -> Scan:
    """Judge the last value of each series against the ones before it (the module's rule).

    Args:
        values: ``(..., n)`` log values, signed so that larger is worse, oldest first, tonight last.
        kept: ``(..., n)`` whether each earlier value is in the series (False: its retest raised an
            alert on this figure; such a value is not read). Tonight's (the last) is always judged.
        figures: ``K``, the figures the retest judges (the level's share).
        margin_pct: The equivalence margin in percent (``decision.margin_pct``).
        rule: The constants (default :class:`SeriesRule`).
    """
    rule = rule or SeriesRule()
    if figures < 1:
        raise ValueError(f"figures must be 1 or more (the figures the retest judges), not {figures}")
    x = np.asarray(values, dtype=float)
    if x.ndim == 0 or x.shape[-1] < 1:
        raise ValueError(f"values must end in an axis of retests, tonight's last; got shape {x.shape}")
    ok = np.broadcast_to(np.asarray(kept, dtype=bool), x.shape)[..., :-1]
    earlier, last = x[..., :-1], x[..., -1]
    if not (np.all(np.isfinite(np.where(ok, earlier, 0.0))) and np.all(np.isfinite(last))):
        raise ValueError("values must be finite logs (a value of 0 or below has no log)")
    lead = x.shape[:-1]
    margin = math.log1p(margin_pct / 100)
    kept_count = ok.sum(-1)
    # for each earlier retest kept, how many kept retests lie after it (before tonight): the last
    # w - 1 of them join tonight in a segment of w, the ones before them are its history
    after_it = np.flip(np.cumsum(np.flip(ok, -1), -1), -1) - ok
    ws = sorted(set(rule.splits))
    level = rule.alpha / (len(ws) * figures)

    sufficient = np.zeros(lead, bool)
    alert = np.zeros(lead, bool)
    best_p = np.full(lead, np.inf)
    best_alert_p = np.full(lead, np.inf)
    out = {name: np.full(lead, np.nan) for name in ("change", "low", "high", "tonight", "p_value")}
    segment = np.zeros(lead, int)
    history = np.zeros(lead, int)
    for w in ws:
        valid = kept_count - (w - 1) >= rule.min_history
        in_hist = ok & (after_it >= w - 1)
        in_seg = ok & (after_it < w - 1)
        k = np.maximum(in_hist.sum(-1), 1)
        hist_mean = np.where(in_hist, earlier, 0.0).sum(-1) / k
        seg_mean = (np.where(in_seg, earlier, 0.0).sum(-1) + last) / w
        ss = np.where(in_hist, (earlier - hist_mean[..., None]) ** 2, 0.0).sum(-1)
        ss = ss + np.where(in_seg, (earlier - seg_mean[..., None]) ** 2, 0.0).sum(-1) + (last - seg_mean) ** 2
        df = np.maximum(k + w - 2, 1)
        se = np.sqrt(ss / df) * np.sqrt(1 / w + 1 / k)
        d = seg_mean - hist_mean
        with np.errstate(divide="ignore", invalid="ignore"):
            # no spread at all (identical values): any worsening is certain, none is not
            t = np.where(se > 0, d / np.where(se > 0, se, 1.0), np.where(d > 0, np.inf, -np.inf))
        p = stats.t.sf(t, df)
        q = stats.t.ppf(rule.margin_confidence, df)
        low, high = d - q * se, d + q * se
        tonight = last - hist_mean
        hit = valid & (p < level) & (low > margin) & (tonight > margin)
        take = (hit & (p < best_alert_p)) | (~alert & ~hit & valid & (p < best_p))
        for name, v in (("change", d), ("low", low), ("high", high), ("tonight", tonight), ("p_value", p)):
            out[name] = np.where(take, v, out[name])
        segment = np.where(take, w, segment)
        history = np.where(take, k, history)
        best_alert_p = np.where(hit, np.minimum(best_alert_p, p), best_alert_p)
        best_p = np.where(valid & ~hit, np.minimum(best_p, p), best_p)
        alert = alert | hit
        sufficient = sufficient | valid
    return Scan(
        alert=alert,
        sufficient=sufficient,
        earlier=kept_count,
        segment=segment,
        history=history,
        change=out["change"],
        low=out["low"],
        high=out["high"],
        tonight=out["tonight"],
        p_value=out["p_value"],
        level=level,
    )


@dataclass(frozen=True)
class Judgement:
    """One figure's series judged at tonight's retest (:func:`judge`). Changes are relative and signed
    so that positive is worse (+0.20: 20% worse); the alerts turn them into the figure's direction."""

    status: Status
    earlier: int
    """Earlier retests in the series (kept: none that alerted on this figure)."""
    needed: int
    """:attr:`SeriesRule.min_history`: the earlier retests a judgement needs."""
    segment: int = 0
    """Retests in the segment judged (the series' last ``segment``, tonight's included)."""
    history: int = 0
    """Retests of the history before the segment."""
    change: float = math.nan
    """The segment's geometric mean against the history's, relative."""
    low: float = math.nan
    high: float = math.nan
    """``[low, high]``: the change's two-sided interval at ``2 * margin_confidence - 1`` (98%); an
    alert's ``low`` lies beyond the margin."""
    tonight: float = math.nan
    """Tonight's value against the history's geometric mean, relative."""
    p_value: float = math.nan
    level: float = math.nan
    """The detection level, ``alpha / (S * K)``: detected when ``p_value`` is below it."""


def judge(
    log_values: Sequence[float],
    kept: Sequence[bool],
    figures: int,
    margin_pct: float,
    rule: SeriesRule | None = None,
) -> Judgement:
    """One series (oldest first, tonight last; ``kept`` as in :func:`scan`)."""
    rule = rule or SeriesRule()
    values = np.asarray(log_values, float)[None, :]
    s = scan(values, np.asarray(kept, bool)[None, :], figures, margin_pct, rule)
    earlier = int(s.earlier[0])
    if not s.sufficient[0]:
        return Judgement("insufficient history", earlier, rule.min_history)
    return Judgement(
        status="worse" if s.alert[0] else "no alert",
        earlier=earlier,
        needed=rule.min_history,
        segment=int(s.segment[0]),
        history=int(s.history[0]),
        change=float(np.expm1(s.change[0])),
        low=float(np.expm1(s.low[0])),
        high=float(np.expm1(s.high[0])),
        tonight=float(np.expm1(s.tonight[0])),
        p_value=float(s.p_value[0]),
        level=float(s.level),
    )
