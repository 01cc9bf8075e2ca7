"""The series rule of the regression alerts (k3pipe.verdicts.series) held against simulated series of nightly
retests whose truth is known.

A simulated retest's figure is ``log value ~ N(mu, s^2)`` with ``s`` the log-scale deviation of a
coefficient of variation (10%: the restart noise between retests, as measured on the H200), ``H``
earlier retests before the nights judged, then a step (or none) on the first night judged. Every
night is judged as the alerts do it (:func:`k3pipe.verdicts.series.scan` over all the retest's figures), and
a figure that alerted is left out of that figure's series afterwards. Seeded, so deterministic; the
rates are checked against what the rule states with a Monte Carlo tolerance of three standard
errors (of a binomial proportion, or of the mean per-series rate where a series' nights are not
independent of each other).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from k3pipe.verdicts.series import SeriesRule, judge, scan

RULE = SeriesRule()
MARGIN_PCT = 5.0


def _sd(cv: float) -> float:
    """The log-scale standard deviation of a coefficient of variation."""
    return math.sqrt(math.log1p(cv**2))


def simulate(
    series: int,
    figures: int,
    earlier: int,
    nights: int,
    step: float = 0.0,
    moved: int = 1,
    cv: float = 0.10,
    seed: int = 0,
    rule: SeriesRule = RULE,
    until: int | None = None,
) -> np.ndarray:
    """Alerts, ``(series, nights)``: each series has ``earlier`` retests, then ``nights`` judged one by
    one; from the first night judged (until night ``until``, if given) the first ``moved`` figures
    are worse by ``step`` (0.2: 20%). Signed so that larger is worse, as the alerts sign them."""
    rng = np.random.default_rng(seed)
    total = earlier + nights
    x = rng.normal(0.0, _sd(cv), (series, figures, total))
    x[:, :moved, earlier : earlier + (until if until is not None else nights)] += math.log1p(step)
    kept = np.ones((series, 1, total), bool)  # the same for every figure of a retest
    alerts = np.zeros((series, nights), bool)
    for night, t in enumerate(range(earlier, total)):
        judged = scan(x[:, :, : t + 1], kept[:, :, : t + 1], figures, MARGIN_PCT, rule)
        alerts[:, night] = judged.alert.any(-1)
        kept[:, 0, t] = ~alerts[:, night]  # a retest that raised an alert leaves the series
    return alerts


def _upper(rates_per_series: np.ndarray) -> float:
    """The mean per-series rate plus three of its standard errors (a series' nights are not
    independent: a false alarm from an unusually tight history can recur)."""
    return float(
        rates_per_series.mean() + 3 * rates_per_series.std(ddof=1) / math.sqrt(len(rates_per_series))
    )


def _lower_mean(rates_per_series: np.ndarray) -> float:
    return float(
        rates_per_series.mean() - 3 * rates_per_series.std(ddof=1) / math.sqrt(len(rates_per_series))
    )


def _lower(p: float, n: int) -> float:
    return p - 3 * math.sqrt(max(p * (1 - p), 1e-4) / n)


def _first(alerts: np.ndarray) -> np.ndarray:
    """The night (1-based) of each series' first alert; beyond the nights, a large number."""
    return np.where(alerts.any(1), alerts.argmax(1) + 1, 10**6)


@pytest.mark.parametrize(("figures", "earlier"), [(1, 4), (3, 4), (3, 10), (12, 10)])
def test_with_no_change_a_retest_alerts_at_most_at_the_stated_rate(figures: int, earlier: int) -> None:
    # 10% restart noise, nothing moves: 20 nights after the minimum history, and after 10 retests
    series = 3000 if figures < 12 else 1500
    alerts = simulate(series, figures, earlier, nights=20, seed=figures * 100 + earlier)
    per_series = alerts.mean(1)
    # the stated rate within the Monte Carlo tolerance: the measured rate less three of its
    # standard errors is at most alpha
    assert _lower_mean(per_series) <= RULE.alpha, per_series.mean()


def test_with_every_retest_kept_the_rate_is_within_the_union_bound() -> None:
    """The bound itself, before the alerted retests are left out: every night judged on the same
    complete series, no night can exceed alpha."""
    rng = np.random.default_rng(7)
    series, figures, n = 20000, 3, 14
    x = rng.normal(0.0, _sd(0.10), (series, figures, n))
    judged = scan(x, np.ones(x.shape, bool), figures, MARGIN_PCT)
    rate = judged.alert.any(-1).mean()
    assert rate <= RULE.alpha + 3 * math.sqrt(RULE.alpha / series), rate
    assert judged.level == pytest.approx(RULE.alpha / (len(RULE.splits) * figures))


@pytest.mark.parametrize(
    ("figures", "moved", "earlier", "within", "stated"),
    [
        (1, 1, 10, 8, 0.70),  # one figure, 10 earlier retests: within 8 retests in 70% of series
        (3, 1, 10, 8, 0.60),  # the step in one of three figures: 60%
        (3, 1, 20, 8, 0.80),  # ... with 20 earlier retests: 80%
        (3, 2, 20, 5, 0.80),  # in two of three (a slowdown: throughput and TPOT): within 5 in 80%
    ],
)
def test_a_20_percent_step_is_found_within_the_stated_retests(
    figures: int, moved: int, earlier: int, within: int, stated: float
) -> None:
    series = 3000
    alerts = simulate(
        series, figures, earlier, nights=within, step=0.20, moved=moved, seed=11 + figures + moved + earlier
    )
    found = float((_first(alerts) <= within).mean())
    assert found >= _lower(stated, series), found


def test_a_step_missed_on_its_first_night_is_not_absorbed_into_the_baseline() -> None:
    """The pitfall of a rolling baseline: a night that did not alert becomes the next night's
    baseline, and so does the step in it. In the series it stays in the recent segment, where the
    nights after it add up: most series that missed a 20% step on its first night find it later."""
    alerts = simulate(3000, 3, 10, nights=8, step=0.20, seed=5)
    missed = ~alerts[:, 0]
    later = alerts[missed, 1:].any(1).mean()
    assert alerts[:, 0].mean() < 0.3  # one night against 10% noise is rarely enough
    assert later >= 0.5, later


def test_a_3_percent_step_inside_the_margin_never_alerts_even_where_it_is_detected() -> None:
    # a quiet engine (1% restart noise): the 3% step is three standard deviations, detected nearly
    # always, and worse than the margin never
    series, nights = 3000, 12
    alerts = simulate(series, 3, 10, nights=nights, step=0.03, cv=0.01, seed=3)
    assert not alerts.any(), f"{alerts.sum()} alerts in {alerts.size} retests"
    rng = np.random.default_rng(3)
    x = rng.normal(0.0, _sd(0.01), (series, 18))
    x[:, 10:] += math.log1p(0.03)
    judged = scan(x, np.ones(x.shape, bool), 3, MARGIN_PCT)
    assert (judged.p_value < judged.level).mean() > 0.9  # detected: the margin is what stops it
    assert not judged.alert.any()
    # the point estimate alone (confidence 0.5) would alert on it: noise pushes it past 5%
    point = simulate(
        series, 3, 10, nights=nights, step=0.03, cv=0.01, seed=3, rule=SeriesRule(margin_confidence=0.5)
    )
    assert point.any()


def test_a_3_percent_step_in_10_percent_noise_alerts_about_as_often_as_no_change() -> None:
    """At 10% noise a 3% step is 0.3 standard deviations: the series cannot tell it from nothing, and
    it alerts at about the false-alarm rate (what docs/measurement.md says)."""
    alerts = simulate(3000, 3, 10, nights=12, step=0.03, seed=13)
    assert alerts.mean() <= 2 * RULE.alpha, alerts.mean()


def test_an_improvement_never_alerts() -> None:
    alerts = simulate(2000, 3, 10, nights=8, step=-0.5, moved=3, seed=17)
    per_series = alerts.mean(1)
    assert per_series.mean() <= RULE.alpha, per_series.mean()


def test_a_regression_that_is_gone_is_not_alerted_again() -> None:
    """Three nights 50% worse (alerted), then fixed and not accepted: the nights after the fix are
    judged against the history before the regression (the alerted nights left it), and tonight's
    own value must be worse; they alert at about the false-alarm rate."""
    alerts = simulate(3000, 3, 10, nights=11, step=0.5, moved=3, until=3, seed=19)
    assert alerts[:, :3].any(1).mean() > 0.9
    after = alerts[:, 3:].mean(1)
    assert _upper(after) <= 2 * RULE.alpha, after.mean()


def test_insufficient_history_until_the_minimum_of_earlier_retests() -> None:
    needed = RULE.min_history
    for earlier in range(needed):
        j = judge([0.0] * earlier + [5.0], [True] * (earlier + 1), 1, MARGIN_PCT)
        assert j.status == "insufficient history"
        assert (j.earlier, j.needed) == (earlier, needed)
    # a huge change with exactly the minimum: judged, and an alert
    j = judge([0.0, 0.01, -0.01, 0.02, math.log(6)], [True] * 5, 1, MARGIN_PCT)
    assert j.status == "worse"
    assert (j.earlier, j.segment, j.history) == (needed, 1, needed)
    assert j.low > MARGIN_PCT / 100
    assert j.change == pytest.approx(6 / math.exp(0.005) - 1)
    # a retest that alerted is not history: five earlier, two of them alerted, three count
    j = judge([0.0, 0.9, 0.01, 0.9, -0.01, 0.0], [True, False, True, False, True, True], 1, MARGIN_PCT)
    assert (j.status, j.earlier) == ("insufficient history", 3)


def test_an_alert_reads_off_its_interval_and_names_its_segment() -> None:
    rng = np.random.default_rng(23)
    x = list(rng.normal(0.0, _sd(0.05), 12)) + list(rng.normal(math.log(1.4), _sd(0.05), 3))
    j = judge(x, [True] * len(x), 3, MARGIN_PCT)
    assert j.status == "worse"
    assert j.segment in RULE.splits
    assert j.low > 0.05  # the interval's lower bound lies beyond the margin
    assert j.low < j.change < j.high
    assert j.p_value < j.level == pytest.approx(RULE.alpha / (len(RULE.splits) * 3))
    assert j.tonight > 0.05


@pytest.mark.parametrize(
    ("values", "kept", "figures", "what"),
    [
        ([0.0, math.nan], [True, True], 1, "finite"),
        ([0.0, 1.0], [True, True], 0, "figures"),
    ],
)
def test_bad_input_is_refused_naming_it(
    values: list[float], kept: list[bool], figures: int, what: str
) -> None:
    with pytest.raises(ValueError, match=what):
        judge(values, kept, figures, MARGIN_PCT)


def test_a_left_out_value_is_not_read() -> None:
    # a value not kept may be anything, even not a number: it is not part of the series
    j = judge([0.0, 0.01, math.nan, -0.01, 0.02, 0.0], [True, True, False, True, True, True], 1, MARGIN_PCT)
    assert (j.status, j.earlier) == ("no alert", 4)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"alpha": 0.0}, "alpha"),
        ({"min_history": 1}, "min_history"),
        ({"splits": ()}, "splits"),
        ({"margin_confidence": 1.0}, "margin_confidence"),
        ({"max_series": 8}, "max_series"),
    ],
)
def test_a_bad_rule_is_refused_naming_its_field(change: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=f"SeriesRule.{field}"):
        SeriesRule(**change)  # type: ignore[arg-type]


def figures() -> None:
    """The simulated figures of docs/measurement.md ("Regression alerts: a retest against its series")."""

    def within(alerts: np.ndarray, nights: tuple[int, ...]) -> str:
        first = _first(alerts)
        return " ".join(f"within {n}: {(first <= n).mean():.1%}" for n in nights)

    print("no change, 10% noise, 20 nights: alerts per retest")
    for k, h in ((1, 4), (1, 10), (3, 4), (3, 10), (12, 4), (12, 10)):
        a = simulate(8000 if k < 12 else 4000, k, h, 20, seed=k * 31 + h)
        per = a.mean(1)
        se = per.std(ddof=1) / math.sqrt(len(per))
        worst = a.mean(0).max()
        print(f"  {k} figure(s), {h} earlier: {per.mean():.2%} +- {se:.2%}, nights up to {worst:.2%}")
    print("a 20% step, 10% noise")
    for k, moved, h in ((1, 1, 4), (1, 1, 10), (1, 1, 20), (3, 1, 10), (3, 1, 20), (3, 2, 10), (3, 2, 20)):
        a = simulate(8000, k, h, 12, step=0.2, moved=moved, seed=k * 7 + moved + h)
        print(f"  {moved} of {k} figure(s), {h} earlier: {within(a, (1, 3, 5, 8, 12))}")
    print("a 50% step, 10% noise")
    for k, moved, h in ((3, 1, 4), (3, 1, 10), (3, 2, 10)):
        a = simulate(8000, k, h, 8, step=0.5, moved=moved, seed=k * 7 + moved + h + 1)
        print(f"  {moved} of {k} figure(s), {h} earlier: {within(a, (1, 2, 3, 5, 8))}")
    print("steps inside and at the margin: alerts per retest, one figure, 10 earlier, 12 nights")
    for step in (0.03, 0.05):
        rates = [
            f"{cv:.0%} noise: {simulate(8000, 1, 10, 12, step=step, cv=cv, seed=int(cv * 1000)).mean():.2%}"
            for cv in (0.01, 0.02, 0.03, 0.05, 0.10, 0.15)
        ]
        print(f"  {step:.0%}: " + ", ".join(rates))
    print("a 50% regression in all of 3 figures for 3 nights, then fixed (10 earlier): alerts per night")
    a = simulate(8000, 3, 10, 11, step=0.5, moved=3, until=3, seed=99)
    print("  " + " ".join(f"{r:.1%}" for r in a.mean(0)))


if __name__ == "__main__":
    figures()
