"""The verdict statistics (k3pipe.verdicts.stats) held against simulated studies whose truth is known.

Each simulated study has two arms measured in L launches of R repeats; a repeat's value is
``true * exp(a_l + e_lr)`` with launch effects ``a_l ~ N(0, s_b^2)`` and repeat effects
``e_lr ~ N(0, s_w^2)`` (noise at both levels, as measured on the H200: shared/docs/statistics.md).
A few thousand studies per case; the rates are checked against what the design promises, with a
Monte Carlo tolerance of three standard errors of a binomial proportion (seeded, so deterministic).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from k3pipe.verdicts import stats
from k3pipe.verdicts.stats import Design, compare, decide, estimate

STUDIES = 3000


def _cv(cv: float) -> float:
    """The log-scale standard deviation of a coefficient of variation."""
    return math.sqrt(math.log1p(cv**2))


def _arm(rng: np.random.Generator, true: float, sb: float, sw: float, launches: int, repeats: int):
    a = rng.normal(0.0, sb, size=(launches, 1))
    e = rng.normal(0.0, sw, size=(launches, repeats))
    return (true * np.exp(a + e)).tolist()


def _simulate(
    effect: float,
    between_cv: float,
    within_cv: float,
    launches: int,
    repeats: int,
    design: Design,
    seed: int = 0,
    studies: int = STUDIES,
    prior: stats.RestartPrior | None = None,
) -> dict[str, float]:
    """Rates of each outcome when arm A's true value is ``1 + effect`` times B's (higher is better);
    a one-launch arm is judged with ``prior`` when given."""
    rng = np.random.default_rng(seed)
    sb, sw = _cv(between_cv), _cv(within_cv)
    counts = {"A better": 0, "B better": 0, "equivalent": 0, "inconclusive": 0, "unknown": 0}
    for _ in range(studies):
        a = estimate(_arm(rng, 100.0 * (1 + effect), sb, sw, launches, repeats))
        b = estimate(_arm(rng, 100.0, sb, sw, launches, repeats))
        assert a is not None
        assert b is not None
        a, b = stats.with_prior(a, prior), stats.with_prior(b, prior)
        v = decide(compare(a, b), design, higher_is_better=True, names=("A", "B"))
        key = f"{v.leader} better" if v.different else v.outcome
        counts[key] += 1
    return {k: n / studies for k, n in counts.items()}


def _tolerance(p: float, n: int = STUDIES) -> float:
    return 3 * math.sqrt(max(p * (1 - p), 1e-4) / n)


@pytest.mark.parametrize(
    ("launches", "repeats", "between_cv", "tests"),
    [(3, 3, 0.05, 1), (3, 3, 0.05, 3), (2, 5, 0.08, 1), (4, 2, 0.03, 6)],
    ids=["3x3", "3x3-family-of-3", "2x5-large-restart-noise", "4x2-family-of-6"],
)
def test_an_a_a_is_called_different_at_most_at_the_nominal_rate(
    launches: int, repeats: int, between_cv: float, tests: int
) -> None:
    design = Design(alpha=0.05, tests=tests)
    rates = _simulate(0.0, between_cv, 0.06, launches, repeats, design)
    false_claims = rates["A better"] + rates["B better"]
    assert false_claims <= design.per_test_alpha + _tolerance(design.per_test_alpha)


def test_one_launch_without_a_prior_claims_nothing() -> None:
    """One launch per arm and no restart prior: the restart noise is in the difference but in no
    variance, so no verdict is made either way ('cannot tell'), whatever the repeats say."""
    rates = _simulate(0.0, 0.08, 0.04, 1, 5, Design(), studies=500)
    assert rates == {"A better": 0.0, "B better": 0.0, "equivalent": 0.0, "inconclusive": 0.0, "unknown": 1.0}
    rates = _simulate(1.0, 0.08, 0.04, 1, 5, Design(), studies=200)  # even a twofold one
    assert rates["unknown"] == 1.0


def test_repeat_noise_alone_would_call_an_a_a_different_far_above_alpha() -> None:
    """Why a one-launch cell needs restart noise from somewhere: judged on its repeats' spread alone
    (what the verdicts did before), an A/A at 8% restart noise is 'different' far above alpha."""
    rng = np.random.default_rng(1)
    sb, sw = _cv(0.08), _cv(0.04)
    claims = 0
    for _ in range(1000):
        a = estimate(_arm(rng, 100.0, sb, sw, 1, 5))
        b = estimate(_arm(rng, 100.0, sb, sw, 1, 5))
        assert a is not None
        assert b is not None
        c = compare(a, b)
        assert c.restart == "unknown"
        ci = c.interval(0.95)
        assert ci is not None
        claims += ci[0] > 0 or ci[1] < 0
        v = decide(c, Design(), True)
        assert v.outcome == "unknown"
        assert v.text().startswith("cannot tell: restart noise unknown")
        assert "launches: 2" in v.text()
    assert claims / 1000 > 0.2


def _history_prior(rng: np.random.Generator, sb: float, sw: float, studies: int, launches: int, repeats: int):
    """The restart prior k3pipe.records.priors pools from ``studies`` earlier studies of one cell each."""
    from k3pipe.records.priors import NoiseEntry, launch_spread, pool

    entries = []
    for i in range(studies):
        spread = launch_spread(_arm(rng, 100.0, sb, sw, launches, repeats))
        assert spread is not None
        entries.append(
            NoiseEntry(key="k", label="", metric="m", arm="a", workload="w", ss=spread[0], df=spread[1],
                       repeats=[repeats] * launches, study_run_id=str(i), start_ms=i + 1)
        )  # fmt: skip
    prior = pool(entries, now_ms=studies + 1)
    assert prior is not None
    return prior


@pytest.mark.parametrize(
    ("between_cv", "within_cv", "history"),
    [(0.08, 0.04, (3, 3, 3)), (0.15, 0.12, (2, 4, 3)), (0.005, 0.005, (3, 3, 3)), (0.08, 0.04, (1, 6, 3))],
    ids=["h200-1b", "eager", "quiet-7b", "thinnest-history"],
)
def test_one_launch_with_a_prior_from_the_history_keeps_the_rate(
    between_cv: float, within_cv: float, history: tuple[int, int, int]
) -> None:
    """An A/A launched once per arm, judged with the restart noise earlier studies of its class
    measured (k3pipe.records.priors: each simulated history is drawn afresh from the same noise): called
    different at most at the nominal rate, from the thinnest history a prior is made of (5 degrees of
    freedom: one study of 6 launches) on."""
    rng = np.random.default_rng(21)
    sb, sw = _cv(between_cv), _cv(within_cv)
    design = Design(alpha=0.05, tests=3)
    claims = 0
    for seed in range(STUDIES):
        prior = _history_prior(rng, sb, sw, *history)
        a = stats.with_prior(estimate(_arm(rng, 100.0, sb, sw, 1, 3)), prior)  # type: ignore[arg-type]
        b = stats.with_prior(estimate(_arm(rng, 100.0, sb, sw, 1, 3)), prior)  # type: ignore[arg-type]
        v = decide(compare(a, b), design, True)
        assert v.restart == "prior"
        claims += v.different
        if seed == 0:
            assert "from the history" in v.text()
    assert claims / STUDIES <= design.per_test_alpha + _tolerance(design.per_test_alpha)


def test_a_prior_finds_a_real_difference() -> None:
    """The prior is not a wall: a 50% difference at the H200's 1B noise, one launch per arm of 5
    repeats, a history of three studies of 3 launches, is found most of the time (more often than
    two launches per arm without a prior would find it: 71%)."""
    rng = np.random.default_rng(22)
    sb, sw = _cv(0.08), _cv(0.04)
    found = 0
    for _ in range(500):
        prior = _history_prior(rng, sb, sw, 3, 3, 3)
        a = stats.with_prior(estimate(_arm(rng, 150.0, sb, sw, 1, 5)), prior)  # type: ignore[arg-type]
        b = stats.with_prior(estimate(_arm(rng, 100.0, sb, sw, 1, 5)), prior)  # type: ignore[arg-type]
        v = decide(compare(a, b), Design(), True)
        found += v.different and v.leader == "A"
    assert found / 500 > stats.planned_power(0.5, 0.08, 0.04, 2, 5, Design())


def test_the_default_design_keeps_the_rate() -> None:
    """What a user gets who sets nothing: two launches per arm (k3pipe.schema.specs.DEFAULT_LAUNCHES) of one
    repeat (a workload's default), the three default decision figures: an A/A at the H200's 1B noise
    (restart 7.3%, repeat 7.2%) is called different at most at alpha / 3 per figure."""
    from k3pipe.schema.specs import DEFAULT_LAUNCHES, WorkloadSpec

    repeats = WorkloadSpec.model_fields["repeats"].default
    design = Design(tests=3)
    rates = _simulate(0.0, 0.073, 0.072, DEFAULT_LAUNCHES, repeats, design, seed=5)
    assert rates["unknown"] == 0.0
    assert rates["A better"] + rates["B better"] <= design.per_test_alpha + _tolerance(design.per_test_alpha)


@pytest.mark.parametrize(
    ("effect", "launches", "repeats", "tests"),
    [(0.10, 3, 3, 1), (0.10, 4, 4, 1), (0.10, 6, 4, 3), (0.03, 3, 3, 1), (0.10, 2, 4, 1)],
    ids=["10%-3x3", "10%-4x4", "10%-6x4-family-of-3", "3%-3x3", "10%-2x4"],
)
def test_a_real_effect_is_found_at_the_power_the_design_promises(
    effect: float, launches: int, repeats: int, tests: int
) -> None:
    design = Design(tests=tests)
    promised = stats.planned_power(effect, 0.03, 0.05, launches, repeats, design)
    rates = _simulate(effect, 0.03, 0.05, launches, repeats, design, seed=7)
    assert rates["A better"] == pytest.approx(promised, abs=_tolerance(promised))
    assert rates["B better"] <= design.per_test_alpha / 2 + _tolerance(design.per_test_alpha / 2)


def test_a_twofold_effect_is_found_even_with_few_launches() -> None:
    design = Design(tests=6)
    assert stats.planned_power(1.0, 0.05, 0.06, 3, 3, design) > 0.999
    rates = _simulate(1.0, 0.05, 0.06, 3, 3, design, studies=500)
    assert rates["A better"] > 0.99


def test_few_launches_under_a_large_family_see_little() -> None:
    """Two launches per arm give the restart noise 2 degrees of freedom: under 48 tests even a 2x
    difference is usually missed, and the design says so before it is run."""
    design = Design(tests=48)
    promised = stats.planned_power(1.0, 0.05, 0.06, 2, 3, design)
    assert promised < 0.2
    rates = _simulate(1.0, 0.05, 0.06, 2, 3, design, studies=1000)
    assert rates["A better"] == pytest.approx(promised, abs=_tolerance(promised, 1000))


def test_equivalence_is_claimed_rarely_when_the_truth_is_at_the_margin() -> None:
    """A true difference of exactly the margin: 'equivalent' is then a false claim, at most
    alpha / (2 tests) of the time (the two one-sided tests each at that level)."""
    design = Design(margin=0.05)
    rates = _simulate(0.05, 0.01, 0.02, 4, 4, design, seed=3)
    assert rates["equivalent"] <= design.per_test_alpha / 2 + _tolerance(design.per_test_alpha / 2)


def test_a_precise_a_a_is_called_equivalent() -> None:
    """Precise data: nearly every A/A is equivalent within the margin; the rest are the alpha share of
    detected (tiny) differences, which the verdict says lie within the margin."""
    rates = _simulate(0.0, 0.005, 0.01, 4, 5, Design(margin=0.05), studies=1000)
    assert rates["equivalent"] > 0.9
    assert rates["equivalent"] + rates["A better"] + rates["B better"] == 1.0


def test_the_minimum_detectable_effect_is_detected_at_the_stated_power() -> None:
    """The MDE a verdict states is the effect it would have found 80% of the time: simulate that
    effect with the same noise and design, and count."""
    design = Design(tests=2)
    sb, sw, launches, repeats = 0.03, 0.05, 3, 3
    unit_var = math.log1p(sb**2) + math.log1p(sw**2) / repeats
    se = math.sqrt(2 * unit_var / launches)
    detectable = math.expm1(stats.mde(se, 2 * (launches - 1), design.per_test_alpha, 0.8))
    assert stats.power(math.log1p(detectable), se, 4, design.per_test_alpha) == pytest.approx(0.8)
    rates = _simulate(detectable, sb, sw, launches, repeats, design, seed=11)
    assert rates["A better"] == pytest.approx(0.8, abs=_tolerance(0.8))


def test_a_metric_and_its_reciprocal_cannot_disagree() -> None:
    """End-to-end time and throughput of the same tokens: one verdict, one interval, one leader."""
    rng = np.random.default_rng(5)
    for _ in range(200):
        time_a = _arm(rng, 3.3, 0.05, 0.08, 2, 3)
        time_b = _arm(rng, 3.6, 0.05, 0.08, 2, 3)
        tokens = 128 * 256
        tps_a = [[tokens / t for t in launch] for launch in time_a]
        tps_b = [[tokens / t for t in launch] for launch in time_b]
        design = Design(tests=4)
        by_time = decide(compare(estimate(time_a), estimate(time_b)), design, False, ("a", "b"))
        by_tps = decide(compare(estimate(tps_a), estimate(tps_b)), design, True, ("a", "b"))
        assert (by_time.outcome, by_time.leader) == (by_tps.outcome, by_tps.leader)
        assert by_time.advantage == pytest.approx(by_tps.advantage)
        assert by_time.interval == pytest.approx(by_tps.interval)


def test_the_interval_shown_is_the_one_the_verdict_was_made_with() -> None:
    rng = np.random.default_rng(9)
    for _ in range(300):
        a = estimate(_arm(rng, 100.0, 0.04, 0.06, 2, 3))
        b = estimate(_arm(rng, 104.0, 0.04, 0.06, 2, 3))
        v = decide(compare(a, b), Design(tests=5), True, ("a", "b"))
        assert v.interval is not None
        lo, hi = v.interval
        assert lo <= v.advantage <= hi
        assert v.different == (lo > 1)
        assert (v.outcome == "equivalent") == (not v.different and lo > 1 / 1.05 and hi < 1.05)
        if v.outcome == "inconclusive":
            assert "cannot be seen" in v.text()
        assert "no difference" not in v.text()


def test_estimates_by_basis() -> None:
    one = estimate([[5.0]])
    assert one is not None
    assert (one.basis, one.var) == ("none", None)
    repeats = estimate([[1.0, 2.0, 4.0]])
    assert repeats is not None
    assert repeats.basis == "repeats"
    assert repeats.mean == pytest.approx(2.0)  # the geometric mean
    assert repeats.var == pytest.approx(np.var(np.log([1, 2, 4]), ddof=1) / 3)
    launches = estimate([[1.0, 1.0], [4.0]])
    assert launches is not None
    assert launches.basis == "launches"
    assert launches.mean == pytest.approx(2.0)  # each launch weighs the same
    # values that were not measured (zero, nan) are left out, not logged
    assert estimate([[0.0, math.nan]]) is None
    partial = estimate([[0.0, 2.0, 2.0]])
    assert partial is not None
    assert partial.repeats == (2,)


def test_a_single_value_gets_no_test() -> None:
    v = decide(compare(estimate([[10.0]]), estimate([[20.0]])), Design(), False, ("a", "b"))
    assert v.outcome == "untested"
    assert v.leader == "a"
    assert "no test" in v.text()


def test_welch_when_unbalanced() -> None:
    a = estimate([[100.0, 101.0], [98.0, 99.0], [103.0, 104.0]])
    b = estimate([[90.0, 95.0, 92.0]])
    assert a is not None
    assert b is not None
    c = compare(a, b)
    assert not c.pooled
    assert not c.restart_noise_measured
    assert c.restart == "unknown"
    assert 1 < c.df < a.df + b.df


def test_variance_components_recover_both_levels() -> None:
    rng = np.random.default_rng(2)
    sb, sw = 0.05, 0.08
    cells = [_arm(rng, 100.0 + 10 * i, sb, sw, 40, 6) for i in range(3)]
    comp = stats.components(cells)
    assert comp is not None
    assert comp.between == pytest.approx(sb**2, rel=0.25)
    assert comp.within == pytest.approx(sw**2, rel=0.08)
    assert comp.between_share == pytest.approx(sb**2 / (sb**2 + sw**2), abs=0.08)
    assert (comp.df_between, comp.df_within) == (3 * 39, 3 * 40 * 5)


def test_variance_components_match_a_mixed_model() -> None:
    """For a balanced design the ANOVA estimates equal REML's (statsmodels' MixedLM) when positive."""
    import pandas as pd
    import statsmodels.formula.api as smf

    rng = np.random.default_rng(4)
    values = _arm(rng, 100.0, 0.06, 0.05, 8, 4)
    comp = stats.components([values])
    assert comp is not None
    frame = pd.DataFrame(
        [(launch, math.log(v)) for launch, row in enumerate(values) for v in row], columns=["launch", "y"]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # statsmodels' boundary notes: the estimates are what is tested
        fit = smf.mixedlm("y ~ 1", frame, groups=frame["launch"]).fit(reml=True)
    assert comp.within == pytest.approx(fit.scale, rel=1e-3)
    assert comp.between == pytest.approx(float(fit.cov_re.iloc[0, 0]), rel=1e-3)


def test_alpha_spending_sums_to_alpha_and_keeps_the_rate_under_optional_stopping() -> None:
    shares = stats.spend_alpha(0.05, 4)
    assert sum(shares) == pytest.approx(0.05)
    assert shares == sorted(shares)  # O'Brien-Fleming: little early, most at the end
    assert stats.spend_alpha(0.05, 1) == [0.05]
    # optional stopping on an A/A: add a launch per arm until a look claims a difference (the worst
    # rule for error rates), at most 4 looks after 2 launches; each look at its own share
    rng = np.random.default_rng(8)
    sb, sw = _cv(0.04), _cv(0.06)
    claims = 0
    studies = 2000
    for _ in range(studies):
        a = _arm(rng, 100.0, sb, sw, 5, 3)
        b = _arm(rng, 100.0, sb, sw, 5, 3)
        for look, share in enumerate(shares):
            n = 2 + look
            v = decide(compare(estimate(a[:n]), estimate(b[:n])), Design(alpha=share), True)
            if v.different:
                claims += 1
                break
    assert claims / studies <= 0.05 + _tolerance(0.05, studies)


def test_design_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="alpha"):
        Design(alpha=0)
    with pytest.raises(ValueError, match="margin"):
        Design(margin=-0.1)
    with pytest.raises(ValueError, match="tests"):
        Design(tests=0)


def test_launches_needed_is_the_fewest_that_keep_the_promise() -> None:
    design = Design(tests=3)
    needed = stats.launches_needed(0.10, 0.03, 0.05, 3, design)
    assert needed is not None
    assert stats.planned_power(0.10, 0.03, 0.05, needed, 3, design) >= 0.8
    assert stats.planned_power(0.10, 0.03, 0.05, needed - 1, 3, design) < 0.8
    # the noise of the eager H200 study (restart 15.5%, repeats 12.2%): 50 launches do not suffice
    assert stats.launches_needed(0.10, 0.155, 0.122, 3, Design(tests=6)) is None


def test_detectable_in_words() -> None:
    assert stats.detectable(0.123) == "12%"
    assert stats.detectable(4.3) == "5.3x"
    assert stats.detectable(None) == "an unknown size"


def test_a_tiny_alpha_over_few_launches_gives_an_unbounded_interval_not_an_error() -> None:
    """The first look of a sequential design at alpha 1e-6 may test at 1e-17: over two launches per
    arm the ratio's interval runs past what a float holds. It is (0, inf) or the like, the verdict
    inconclusive and its text printable; exp() overflowed here before (a study with `until`)."""
    a = estimate([[100.0, 101.0], [104.0, 103.0]])
    b = estimate([[90.0, 91.0], [99.0, 97.0]])
    assert a is not None
    assert b is not None
    tiny = stats.spend_alpha(1e-6, 3)[0]
    assert 0 <= tiny < 1e-12
    v = decide(compare(a, b), Design(alpha=max(tiny, 1e-300)), higher_is_better=True, names=("A", "B"))
    assert v.outcome == "inconclusive"
    assert v.interval is not None
    assert v.interval[1] == math.inf
    assert v.mde == math.inf
    assert v.text().startswith("inconclusive: this data cannot tell a difference of any size (A ")
    assert "+inf%]" in v.text()
