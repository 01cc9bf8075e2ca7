"""Statistics across repeats, checked against values worked out by hand and against scipy's own."""

from __future__ import annotations

import math

import pytest

from k3pipe.bench.repeats import RepeatStats, aggregate_repeats, compare
from k3pipe.verdicts.stats import Design, RestartPrior

# restart noise of 0.5% an earlier study is taken to have measured (k3pipe.records.priors): each side below is
# one launch, which without it is never judged
QUIET = RestartPrior(math.log1p(0.005**2), 40.0, "a test's history")


def _compare(metric: str, a: list[float], b: list[float], design: Design | None = None):  # type: ignore[no-untyped-def]
    return compare(metric, a, b, design, QUIET, QUIET)


def test_mean_std_and_t_interval() -> None:
    # values 10, 12, 14: mean 12, std 2, t(0.975, 2) = 4.302653, half-width 4.302653 * 2 / sqrt(3)
    s = RepeatStats.of([10.0, 12.0, 14.0])
    assert (s.n, s.mean, s.std) == (3, 12.0, pytest.approx(2.0))
    half = 4.302653 * 2 / math.sqrt(3)
    assert s.ci_low == pytest.approx(12 - half, abs=1e-5)
    assert s.ci_high == pytest.approx(12 + half, abs=1e-5)
    assert s.values == [10.0, 12.0, 14.0]


def test_one_repeat_has_no_spread() -> None:
    s = RepeatStats.of([5.0])
    assert (s.n, s.mean, s.std, s.ci_low, s.ci_high) == (1, 5.0, None, None, None)
    with pytest.raises(ValueError, match="no values"):
        RepeatStats.of([])


def test_aggregate_skips_a_metric_a_repeat_lacks() -> None:
    stats = aggregate_repeats([{"ttft_ms_p50": 10.0, "tpot_ms_p50": 2.0}, {"ttft_ms_p50": 14.0}])
    assert stats["ttft_ms_p50"].n == 2
    assert stats["ttft_ms_p50"].mean == 12.0
    assert stats["tpot_ms_p50"].n == 1


def test_compare_tells_different_from_noise() -> None:
    a = [100.0, 101.0, 99.0, 100.5, 99.5]
    clearly_slower = [110.0, 111.0, 109.0, 110.5, 109.5]
    noise = [100.2, 99.1, 101.3, 99.8, 100.1]
    d = _compare("ttft_ms_p50", a, clearly_slower)
    assert d.different
    assert d.relative_change == pytest.approx(0.1, abs=0.001)  # geometric means
    assert d.interval is not None
    assert d.interval[0] > 0
    same = _compare("ttft_ms_p50", a, noise)
    assert not same.different
    assert same.outcome == "equivalent"  # +-1% noise, 5 repeats: inside the 5% margin
    assert same.verdict() == "equivalent within +-5%"
    wide = _compare("ttft_ms_p50", [100.0, 130.0, 80.0], [90.0, 140.0, 105.0])
    assert wide.outcome == "inconclusive"
    assert wide.verdict().startswith("inconclusive (below ")


def test_compare_shares_alpha_with_the_metrics_compared_together() -> None:
    a, b = [100.0, 101.0, 99.0], [103.0, 104.0, 102.0]
    alone = _compare("x", a, b)
    among_ten = _compare("x", a, b, Design(tests=10))
    assert among_ten.confidence == pytest.approx(0.995)
    assert alone.interval is not None
    assert among_ten.interval is not None
    assert among_ten.interval[1] - among_ten.interval[0] > alone.interval[1] - alone.interval[0]


def test_compare_needs_two_repeats_for_a_verdict() -> None:
    d = compare("x", [1.0], [2.0])
    assert d.outcome == "untested"
    assert d.verdict() == "needs repeats"
    assert not d.different
    with pytest.raises(ValueError, match="both sides"):
        compare("x", [], [1.0])


def test_compare_constant_values() -> None:
    assert _compare("x", [1.0, 1.0], [1.0, 1.0]).outcome == "equivalent"
    assert _compare("x", [1.0, 1.0], [2.0, 2.0]).different


def test_one_launch_a_side_without_a_prior_is_never_judged() -> None:
    """Each side one launch, no restart noise known: 'cannot tell', however far apart the repeats
    are, and no interval is shown (the one its repeats give holds no restart noise)."""
    d = compare("ttft_ms_p50", [100.0, 101.0, 99.0], [200.0, 201.0, 199.0])
    assert d.outcome == "unknown"
    assert d.interval is None
    assert not d.different
    assert d.verdict() == "cannot tell: restart noise unknown"
    judged = compare("ttft_ms_p50", [100.0, 101.0, 99.0], [200.0, 201.0, 199.0], None, QUIET, QUIET)
    assert judged.different
    assert (judged.restart, judged.prior) == ("prior", "a test's history")
