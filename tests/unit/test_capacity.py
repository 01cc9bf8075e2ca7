"""The capacity search against simulated engines whose capacity is known (k3pipe.verdicts.capacity).

The engine here is a queue simulated event by event, not a server: ``servers`` requests in service
at once, each for ``service_s`` (decode of a fixed length), arrivals constant or Poisson. Its
capacity is known: with constant arrivals it serves ``servers / service_s`` requests a second and
queues without bound above that; with Poisson arrivals the rate at which 90% of requests meet the
SLO is found by one long simulation. The search, with probes of a few dozen to a few hundred
requests as a user would run them, must land within 10% of it at every scale from 0.1 to 100
requests a second (the simulation is scale-free: the same queue at a tenth of the rate is the same
queue with ten times the service time).

The capacity's interval and the verdicts between two arms are held against a second engine, faster to
simulate: a known curve of attainment against load, each probe a binomial draw of its requests, with
search-to-search and restart noise on the curve's position; and a probe's own binomial interval
against the exact binomial distribution.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import replace

import numpy as np
import pytest

from k3pipe.verdicts import stats
from k3pipe.verdicts.capacity import CapacityResult, CapacitySearch, capacity_estimate, summarize_searches

pytestmark = pytest.mark.unit


def simulate(
    rate: float, n: int, servers: int, service_s: float, *, poisson: bool, seed: int = 0, ttft_s: float = 0.0
) -> list[tuple[float, float]]:
    """(TTFT, E2E) in seconds from each request's arrival, for ``n`` requests at ``rate``."""
    if poisson:
        arrivals = np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, n))
    else:
        arrivals = np.arange(n) / rate
    free = [0.0] * servers
    out = []
    for a in arrivals:
        start = max(float(a), heapq.heappop(free))
        heapq.heappush(free, start + service_s)
        out.append((start - a + ttft_s, start + service_s - a))
    return out


def attainment(samples: list[tuple[float, float]], e2e_s: float, ttft_s: float | None = None):  # type: ignore[no-untyped-def]
    e2e_ok = sum(e <= e2e_s for _, e in samples)
    by = {"e2e_ms": 100.0 * e2e_ok / len(samples)}
    both = e2e_ok
    if ttft_s is not None:
        by["ttft_ms"] = 100.0 * sum(t <= ttft_s for t, _ in samples) / len(samples)
        both = sum(e <= e2e_s and t <= ttft_s for t, e in samples)
    return 100.0 * both / len(samples), by


def search(  # type: ignore[no-untyped-def]
    capacity_rps: float, servers: int, *, poisson: bool, n: int, seed: int = 0, **kw
):
    """The search over a simulated engine of capacity ``capacity_rps`` (an E2E SLO of twice the
    service time), from a hundredth to a hundred times it."""
    service_s = servers / capacity_rps
    s = CapacitySearch("rate", capacity_rps / 100, capacity_rps * 100, **kw)
    while (point := s.next_point()) is not None:
        samples = simulate(point, n, servers, service_s, poisson=poisson, seed=seed)
        pct, by = attainment(samples, 2 * service_s)
        s.add(point, pct, by)
    return s.result()


@pytest.mark.parametrize("capacity_rps", [0.1, 1.0, 10.0, 100.0])
@pytest.mark.parametrize("servers", [1, 8])
def test_constant_arrivals_find_the_service_rate_within_10_percent(capacity_rps: float, servers: int) -> None:
    """Constant arrivals: no queue below servers / service_s, one that grows without bound above."""
    result = search(capacity_rps, servers, poisson=False, n=40 * servers)
    assert result.censored is None
    assert result.converged
    assert result.capacity is not None
    assert result.failed_at is not None
    assert abs(result.capacity / capacity_rps - 1) <= 0.10, result.describe("req/s")
    assert result.failed_at <= result.capacity * 1.05 + 1e-12
    assert result.binding == "e2e_ms"
    # geometric bracketing then bisection: a handful of probes over four decades
    assert len(result.probes) <= 12


def _poisson_truth(servers: int, service_s: float) -> float:
    """The rate at which 90% of requests meet E2E <= 2 x service_s, from 200,000 simulated requests
    a point, bisected to 0.2%."""
    lo, hi = 0.05 * servers / service_s, servers / service_s
    while hi / lo > 1.002:
        mid = math.sqrt(lo * hi)
        pct, _ = attainment(simulate(mid, 200_000, servers, service_s, poisson=True, seed=99), 2 * service_s)
        lo, hi = (mid, hi) if pct >= 90 else (lo, mid)
    return lo


@pytest.mark.parametrize("servers", [1, 4])
def test_poisson_arrivals_find_the_slo_capacity_within_10_percent(servers: int) -> None:
    """Poisson arrivals queue below the service rate: the capacity under the SLO is where 90% of
    requests wait less than one service time. One search of 400-request probes lands within about
    10% of it (SD measured over 200 searches: 8-11%, no bias); the mean of five (the repeats) within
    10%, at 0.1 and at 100 requests a second's scale."""
    truth = _poisson_truth(servers, 1.0) / servers  # per unit of capacity servers / service_s
    for capacity_rps in (0.1, 100.0):
        results = [
            search(capacity_rps, servers, poisson=True, n=400, seed=seed, tolerance_pct=3)
            for seed in range(5)
        ]
        assert all(r.censored is None and r.converged for r in results)
        summary = summarize_searches(results)
        assert summary.estimate is not None
        assert abs(summary.estimate.mean / capacity_rps / truth - 1) <= 0.10, (truth, summary.values)
        assert summary.binding == "e2e_ms"


def test_the_capacity_interval_covers_the_truth_at_its_rate() -> None:
    """The 95% interval of five searches (repeats; bracket middles, the bracket's width counted:
    summarize_searches) covers the simulated queue's true capacity in about 95% of studies: 20
    studies here, at least 16 must cover it (P(15 or fewer) = 1.6% at 95%; measured over 40 studies:
    92.5-97.5%)."""
    servers = 4
    truth = _poisson_truth(servers, 1.0)
    covered = 0
    for study in range(20):
        results = [
            search(servers, servers, poisson=True, n=400, seed=1000 + 5 * study + k, tolerance_pct=3)
            for k in range(5)
        ]
        estimate = summarize_searches(results).estimate
        assert estimate is not None
        interval = estimate.interval()
        assert interval is not None
        covered += interval[0] <= truth <= interval[1]
    assert covered >= 16, covered


def test_concurrency_search_finds_the_last_concurrency_within_the_tpot_slo() -> None:
    """An engine whose time per output token grows with the streams it decodes at once,
    TPOT(c) = 10 ms x (1 + c / 16): an SLO of TPOT <= 40 ms holds up to c = 48 exactly."""
    s = CapacitySearch("concurrency", 1, 4096, tolerance_pct=0)
    while (point := s.next_point()) is not None:
        assert point == int(point)
        tpot = 10.0 * (1 + point / 16)
        s.add(point, 100.0 if tpot <= 40 else 0.0, {"tpot_ms": 100.0 if tpot <= 40 else 0.0})
    result = s.result()
    assert (result.capacity, result.failed_at) == (48, 49)
    assert result.binding == "tpot_ms"
    assert result.cliff  # every request at once: 100% at 48, 0% at 49
    # 48 passed and 49 failed: the capacity is 48 streams exactly, no bracket to add or move by
    assert result.width == 0
    est = capacity_estimate([[result, result, result]])
    assert est is not None
    assert est.mean == pytest.approx(48)
    assert est.interval() == pytest.approx((48, 48))
    assert result.metrics()["capacity_concurrency_resolution"] == 0
    # at 5% of 400 streams a bracket is 20 wide: the capacity is one of 400..419
    wide = replace(result, capacity=400.0, failed_at=420.0)
    assert wide.width == pytest.approx(math.log(419 / 400))
    assert capacity_estimate([[wide]]).mean == pytest.approx(math.sqrt(400 * 419))  # type: ignore[union-attr]


def test_a_gradual_slope_is_no_cliff_and_censored_searches_say_so() -> None:
    s = CapacitySearch("rate", 1, 100, start=10, tolerance_pct=5)
    while (point := s.next_point()) is not None:
        # attainment falls by 1 point per 1% of load above 20 req/s: no wall
        s.add(point, max(0.0, 100 - max(0.0, point / 20 - 1) * 100), {"ttft_ms": 50.0})
    result = s.result()
    assert result.capacity is not None
    assert 20 <= result.capacity <= 22
    assert not result.cliff

    high = CapacitySearch("rate", 0.1, 5)
    while (point := high.next_point()) is not None:
        high.add(point, 100.0)
    assert high.result().censored == "above_high"
    assert high.result().capacity == 5
    assert high.result().describe("req/s") == "at least 5 req/s: the highest load tried met the SLO"

    low = CapacitySearch("rate", 0.1, 5)
    while (point := low.next_point()) is not None:
        low.add(point, 10.0)
    assert low.result().censored == "below_low"
    assert low.result().capacity is None
    assert summarize_searches([low.result(), high.result()]).estimate is None  # nothing to average


def test_max_probes_ends_a_search_unconverged() -> None:
    s = CapacitySearch("rate", 0.001, 1000, tolerance_pct=0.1, max_probes=4)
    while (point := s.next_point()) is not None:
        s.add(point, 100.0 if point <= 3.3 else 0.0)
    result = s.result()
    assert len(result.probes) == 4
    assert not result.converged
    assert "not converged" in result.describe("req/s")


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="0 < low < high"):
        CapacitySearch("rate", 5, 1)
    with pytest.raises(ValueError, match="factor must be above 1"):
        CapacitySearch("rate", 1, 5, factor=1)


def test_the_search_resolution_stays_in_the_interval_and_in_the_verdict() -> None:
    """Repeats of a search on a deterministic engine agree exactly, yet each only places the capacity
    within its last bracket (5% here): the estimate is the bracket's middle and the interval holds the
    whole bracket however many repeats agree (they walk the same grid of loads, so averaging them
    removes none of its error); two arms one bracket apart are not called different, four brackets
    apart are (two launches of three searches each: 2 df)."""
    w = math.log(1.05)
    for repeats in (3, 10, 30):
        a = stats.with_resolution(stats.estimate([[20.0] * repeats]), [w] * repeats)  # type: ignore[arg-type]
        assert a.var is not None
        assert a.mean == pytest.approx(20.0 * math.sqrt(1.05))
        low, high = a.interval() or (0, 0)
        assert low < 20.0
        assert high > 21.0  # the truth may sit anywhere in [20, 21)
    design = stats.Design(alpha=0.05, margin=0.05, power=0.8, tests=1)
    # two launches of three searches each (the default design: restart noise in the interval)
    a2 = stats.with_resolution(stats.estimate([[20.0] * 3] * 2), [w] * 6)  # type: ignore[arg-type]
    near = stats.with_resolution(stats.estimate([[20.8] * 3] * 2), [w] * 6)  # type: ignore[arg-type]
    far = stats.with_resolution(stats.estimate([[24.4] * 3] * 2), [w] * 6)  # type: ignore[arg-type]
    assert stats.decide(stats.compare(near, a2), design, higher_is_better=True).outcome != "different"
    assert stats.decide(stats.compare(far, a2), design, higher_is_better=True).outcome == "different"
    # one launch of each: the restart noise is in no variance, so nothing is claimed
    a1 = stats.with_resolution(stats.estimate([[20.0] * 3]), [w] * 3)  # type: ignore[arg-type]
    once = stats.with_resolution(stats.estimate([[23.2] * 3]), [w] * 3)  # type: ignore[arg-type]
    assert stats.decide(stats.compare(once, a1), design, higher_is_better=True).outcome == "unknown"
    single = stats.estimate([[20.0]])
    assert single is not None
    moved = stats.with_resolution(single, [w])
    assert moved.var is None  # one value: still untested, at its bracket's middle
    assert moved.mean == pytest.approx(20.0 * math.sqrt(1.05))
    assert stats.with_resolution(single, []) is single


# --- the capacity's interval and verdicts, on an engine whose capacity is known --------------------

GRID = {"low": 0.1, "high": 1000.0}
"""Every simulated search's range (start 10, factor 2, tolerance 5%: final brackets of log 2 / 16,
4.4%): the grid of loads is the workload's, the same for every arm, repeat and launch."""


def _curve_search(rng: np.random.Generator, boundary: float, requests: int, slope: float) -> CapacityResult:
    """One search over an engine whose share of requests within the SLO at rate r is
    p(r) = 1 / (1 + (r / boundary)^slope / 9): 90% at ``boundary`` exactly, falling faster with a
    higher ``slope`` (at 10: 85% 5% above it, 95% 7% below). A probe is ``requests`` binomial draws."""
    s = CapacitySearch("rate", **GRID)
    while (point := s.next_point()) is not None:
        p = 1.0 / (1.0 + (point / boundary) ** slope / 9.0)
        s.add(point, 100.0 * int(rng.binomial(requests, p)) / requests)
    return s.result()


def _study(
    rng: np.random.Generator,
    boundary: float,
    launches: int,
    repeats: int,
    requests: int,
    slope: float,
    restart: float,
    repeat: float,
) -> list[list[CapacityResult]]:
    """An arm's searches, one list per launch: each launch moves the engine's boundary by lognormal
    restart noise (SD ``restart`` on the log scale), each search by repeat noise (``repeat``)."""
    out = []
    for _ in range(launches):
        launch = boundary * math.exp(restart * rng.standard_normal())
        out.append(
            [
                _curve_search(rng, launch * math.exp(repeat * rng.standard_normal()), requests, slope)
                for _ in range(repeats)
            ]
        )
    return out


def _old_rule(searches: list[list[CapacityResult]]) -> stats.Estimate:
    """The rule before 2026-12-06: the last passing loads, the bracket's variance divided by n."""
    est = stats.estimate([[r.capacity for r in launch if r.width is not None] for launch in searches])
    assert est is not None
    assert est.var is not None
    widths = [r.width for launch in searches for r in launch if r.width is not None]
    unit = sum(x * x for x in widths) / len(widths) / 4
    return replace(est, var=est.var + unit / est.n, pooled_ss=est.pooled_ss + unit * est.df)


COVERAGE_STUDIES = 500


@pytest.mark.parametrize(
    ("launches", "repeats", "requests", "slope", "restart", "repeat", "old_at_most"),
    [
        (1, 10, 100_000, 10.0, 0.0, 0.0, 0.50),
        (1, 5, 50, 5.0, 0.0, 0.0, None),
        (1, 5, 400, 10.0, 0.0, 0.06, None),
        (3, 2, 400, 10.0, 0.05, 0.03, None),
    ],
    ids=["steady-engine-10-repeats", "50-requests-a-probe", "6pct-search-noise", "restart-noise-3-launches"],
)
def test_the_capacity_interval_covers_the_engines_boundary_at_its_level(
    launches: int, repeats: int, requests: int, slope: float, restart: float, repeat: float,
    old_at_most: float | None,
) -> None:  # fmt: skip
    """The 95% interval of an arm's capacity (:func:`capacity_estimate`, the report's rule) covers
    the engine's true boundary in at least 95% of 500 simulated studies (less three Monte Carlo
    standard errors, 2.9 points), the boundary placed anywhere on the grid of loads: a steady engine
    (every repeat lands in the same bracket; measured 100%), 50 requests a probe (binomial noise of
    4 points in each probe's share; 98.4%), search-to-search noise of 6% (100%), and restart noise
    of 5% over three launches of two repeats (100%). The rule before (each search's last passing
    load, the bracket's error divided by the repeats) covered the steady engine's boundary in 37.8% of
    studies of 10 repeats (68% of 5). With one launch, restart noise is not in the interval (the
    report says so); that case is tests/unit/test_stats.py's."""
    rng = np.random.default_rng(20261207 + repeats * 100 + requests)
    covered = old_covered = 0
    for _ in range(COVERAGE_STUDIES):
        truth = 10.0 * 2.0 ** rng.uniform()  # anywhere in one octave of the grid: any bracket position
        searches = _study(rng, truth, launches, repeats, requests, slope, restart, repeat)
        est = capacity_estimate(searches)
        assert est is not None
        interval = est.interval(0.95)
        assert interval is not None
        covered += interval[0] <= truth <= interval[1]
        old = _old_rule(searches).interval(0.95)
        assert old is not None
        old_covered += old[0] <= truth <= old[1]
    rate = covered / COVERAGE_STUDIES
    assert rate >= 0.95 - 3 * math.sqrt(0.95 * 0.05 / COVERAGE_STUDIES), rate
    if old_at_most is not None:
        assert old_covered / COVERAGE_STUDIES <= old_at_most, old_covered


POWER_TRIALS = 500


@pytest.mark.parametrize(("ratio", "launches", "repeats"), [(1.0, 1, 5), (1.2, 1, 5), (1.0, 3, 2)])
def test_two_arms_20_percent_apart_are_told_apart_and_equal_ones_are_not(
    ratio: float, launches: int, repeats: int
) -> None:
    # one launch a side is judged only with a restart prior (k3pipe.records.priors): here the simulation's own
    # truth (no restart noise), as a history of 20 launches would give it; without one, no verdict
    """Two arms' capacities compared as any pair is (:func:`k3pipe.verdicts.stats.compare` and ``decide`` at
    alpha 0.05, one comparison), each searched 5 times in one launch (6% search-to-search noise, 400
    requests a probe) or over 3 launches of 2 (5% restart noise, 3% repeat): 20% apart, called
    different in at least the design's power (80%) of 500 seeded trials (measured 94.2% with 5
    searches; 3 gave 70.2%, and 3 launches of 2 73.8%: designs short of the power, not asserted);
    equal, in at most alpha (5%; measured 1.2% and 0.6%: the bracket's error counted whole is
    conservative), each with three Monte Carlo standard errors of room."""
    design = stats.Design(alpha=0.05, margin=0.05, power=0.8, tests=1)
    restart, repeat = (0.05, 0.03) if launches > 1 else (0.0, 0.06)
    rng = np.random.default_rng(7 + int(ratio * 10) + launches)
    different = 0
    for _ in range(POWER_TRIALS):
        truth = 10.0 * 2.0 ** rng.uniform()
        a = capacity_estimate(_study(rng, truth, launches, repeats, 400, 10.0, restart, repeat))
        b = capacity_estimate(_study(rng, truth * ratio, launches, repeats, 400, 10.0, restart, repeat))
        assert a is not None
        assert b is not None
        if launches == 1:
            unjudged = stats.decide(stats.compare(b, a), design, higher_is_better=True)
            assert unjudged.outcome == "unknown"
            quiet = stats.RestartPrior(1e-6, 20.0, "the simulation's truth")
            a, b = stats.with_prior(a, quiet), stats.with_prior(b, quiet)
        verdict = stats.decide(stats.compare(b, a), design, higher_is_better=True, names=("b", "a"))
        different += verdict.outcome == "different"
        if ratio > 1 and verdict.different:
            assert verdict.leader == "b"  # never the wrong way round
    rate = different / POWER_TRIALS
    if ratio == 1.0:
        assert rate <= design.alpha + 3 * math.sqrt(design.alpha * (1 - design.alpha) / POWER_TRIALS), rate
    else:
        assert rate >= design.power - 3 * math.sqrt(design.power * (1 - design.power) / POWER_TRIALS), rate


def test_the_capacity_summary_is_the_reports_estimate_of_the_same_searches() -> None:
    """summarize_searches and capacity_estimate give one figure: the bracket middles' geometric
    mean, a censored search left out; and the interval holds the brackets of every search."""
    rng = np.random.default_rng(3)
    results = [_curve_search(rng, 13.0, 400, 10.0) for _ in range(4)]
    censored = CapacitySearch("rate", 0.1, 5)
    while (point := censored.next_point()) is not None:
        censored.add(point, 100.0)
    summary = summarize_searches([*results, censored.result()])
    assert summary.estimate == capacity_estimate([results])
    middles = [math.sqrt(r.capacity * r.failed_at) for r in results]  # type: ignore[operator]
    assert summary.estimate is not None
    assert summary.estimate.mean == pytest.approx(math.exp(np.mean(np.log(middles))))
    low, high = summary.estimate.interval() or (0.0, 0.0)
    assert low <= min(r.capacity for r in results)  # type: ignore[type-var]
    assert high >= max(r.failed_at for r in results)  # type: ignore[type-var]
    assert len(summary.values) == 4


# --- a probe's attainment and its binomial interval -----------------------------------------------


def _exact_coverage(n: int, p: float, intervals: list[tuple[float, float]]) -> float:
    """The exact probability that the interval a probe of ``n`` requests gets (``intervals[k]`` for k
    of them met, percent) holds the true share ``p``: the binomial probabilities of the counts whose
    interval holds it, summed."""
    from scipy.stats import binom

    return float(sum(binom.pmf(k, n, p) for k, (lo, hi) in enumerate(intervals) if lo <= 100 * p <= hi))


def test_a_probes_attainment_interval_is_clopper_pearson_and_never_covers_less_than_95_percent() -> None:
    """The exact coverage (summed over every count a probe could see) at shares from 50% to 99.5% and
    probes of 20, 50 and 200 requests is at least 95% for Clopper-Pearson; Wilson's (scipy's other
    method) falls below it at some (90.5% at its lowest here: 20 requests, 99.5%), which is why a
    probe is not called decided on Wilson's."""
    from scipy.stats import binomtest

    from k3pipe.verdicts.capacity import attainment_interval

    # the ends by hand: 0 of n has upper end 1 - (alpha/2)^(1/n), n of n lower end (alpha/2)^(1/n)
    assert attainment_interval(0, 20) == pytest.approx((0.0, 100 * (1 - 0.025 ** (1 / 20))))
    assert attainment_interval(20, 20) == pytest.approx((100 * 0.025 ** (1 / 20), 100.0))
    for k, n in ((91, 100), (3, 7), (180, 200)):  # scipy's own exact interval, the slow way
        ci = binomtest(k, n).proportion_ci(0.95, method="exact")
        assert attainment_interval(k, n) == pytest.approx((100 * ci.low, 100 * ci.high))
    wilson_low = 1.0
    for n in (20, 50, 200):
        exact = [attainment_interval(k, n) for k in range(n + 1)]
        wilson = [
            (100 * ci.low, 100 * ci.high)
            for ci in (binomtest(k, n).proportion_ci(0.95, method="wilson") for k in range(n + 1))
        ]
        for p in (0.5, 0.8, 0.88, 0.9, 0.92, 0.95, 0.97, 0.99, 0.995):
            assert _exact_coverage(n, p, exact) >= 0.95 - 1e-9, (n, p)
            wilson_low = min(wilson_low, _exact_coverage(n, p, wilson))
    assert wilson_low < 0.92, wilson_low
    with pytest.raises(ValueError, match="met 5, requests 4"):
        attainment_interval(5, 4)


def test_a_probe_whose_interval_holds_the_target_is_undecided() -> None:
    s = CapacitySearch("rate", 1, 100, attainment_pct=90)
    near = s.judge(10.0, 91.0, requests=100)  # 91 of 100: [83.6, 95.8] holds 90
    assert near.passed
    assert near.undecided
    assert (near.requests, near.met) == (100, 91)
    assert near.ci_low_pct is not None
    assert near.ci_high_pct is not None
    assert near.ci_low_pct < 90 <= near.ci_high_pct
    assert s.judge(10.0, 100.0, requests=100).undecided is False  # [96.4, 100]: a pass
    assert s.judge(10.0, 80.0, requests=100).undecided is False  # [70.8, 87.3]: a fail
    few = s.judge(10.0, 100.0, requests=10)  # 10 of 10 is [69.2, 100]: too few to say
    assert few.passed
    assert few.undecided
    assert s.probes == []  # judged, not taken
    taken = s.add(10.0, 91.0, {"ttft_ms": 91.0}, run_id="r1", requests=100)
    assert taken == replace(near, by_objective_pct={"ttft_ms": 91.0}, run_id="r1")
    assert s.probes == [taken]
    unknown = s.add(20.0, 50.0)  # no count: no interval, nothing to say about deciding
    assert (unknown.requests, unknown.ci_low_pct, unknown.undecided) == (None, None, None)


def test_a_ladder_is_its_points_lowest_first_or_a_geometric_range() -> None:
    from k3pipe.schema.specs import LadderSpec

    assert LadderSpec(start=1, stop=32).values() == [1, 2, 4, 8, 16, 32]
    assert LadderSpec(start=3, stop=40, factor=3).values() == [3, 9, 27]
    assert LadderSpec(over="rate", start=0.05, stop=1).values() == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.8])
    assert LadderSpec(points=[8, 1, 4, 4]).values() == [1, 4, 8]
    assert LadderSpec(over="rate", points=[0.5]).label(0.5) == "0.5rps"
    assert LadderSpec(points=[16]).label(16) == "c16"
    with pytest.raises(ValueError, match="either points or both start and stop"):
        LadderSpec(start=1)
    with pytest.raises(ValueError, match="whole number of streams"):
        LadderSpec(points=[1.5])
    with pytest.raises(ValueError, match="more than 64"):
        LadderSpec(over="rate", start=0.001, stop=100_000, factor=1.1)


def test_saturation_is_latency_rising_without_throughput() -> None:
    from k3pipe.verdicts.capacity import check_saturation

    def one(tps: float, e2e: float) -> list[dict[str, float]]:
        return [{"output_throughput_tps": tps, "e2e_ms_mean": e2e}]

    before = one(100.0, 200.0)
    assert not check_saturation(before, one(180.0, 220.0), 5).flagged  # type: ignore[union-attr]
    flat = check_saturation(before, one(102.0, 210.0), 5)
    assert flat is not None
    assert flat.flagged
    assert not flat.confident
    assert flat.gain_upper_pct is None
    assert "output throughput +2.0% while mean E2E +5.0%" in flat.describe()
    # no more throughput but no more latency either (the engine was idle): not past saturation
    assert not check_saturation(before, one(101.0, 201.0), 5).flagged  # type: ignore[union-attr]
    assert check_saturation(before, [{"e2e_ms_mean": 400.0}], 5) is None  # nothing to judge by


def test_with_repeats_a_point_is_saturated_only_when_the_gains_bound_is_below_the_margin() -> None:
    """The same means (+2% throughput, +50% E2E), judged against the repeats' spread: tight repeats
    put the gain's upper bound below 5% (saturated, confidently); loose ones cannot tell."""
    from k3pipe.verdicts.capacity import check_saturation

    def reps(tps: list[float], e2e: float) -> list[dict[str, float]]:
        return [{"output_throughput_tps": x, "e2e_ms_mean": e2e} for x in tps]

    tight = check_saturation(reps([99.5, 100.0, 100.5], 200), reps([101.5, 102.0, 102.5], 300), 5)
    assert tight is not None
    assert tight.flagged
    assert tight.confident
    assert tight.gain_upper_pct is not None
    assert 2.0 < tight.gain_upper_pct < 5.0
    assert "(upper 95% bound +" in tight.describe()
    loose = check_saturation(reps([90.0, 100.0, 110.0], 200), reps([92.0, 102.0, 112.0], 300), 5)
    assert loose is not None
    assert not loose.flagged
    assert not loose.confident
    assert loose.gain_upper_pct is not None
    assert loose.gain_upper_pct > 5.0


def _simulated_repeats(rng, true_tps: float, e2e: float, sigma: float, n: int) -> list[dict[str, float]]:
    noise = rng.lognormal(0.0, sigma, size=(n, 2))
    return [{"output_throughput_tps": true_tps * a, "e2e_ms_mean": e2e * b} for a, b in noise]


@pytest.mark.parametrize(("repeats", "sigma"), [(2, 0.06), (3, 0.06), (5, 0.15)])
def test_a_point_that_gained_the_margin_is_called_saturated_in_at_most_alpha_of_ladders(
    repeats: int, sigma: float
) -> None:
    """Simulated repeats whose truth is known: the point after gains exactly the 5% margin (the
    hardest point that is not past saturation) while latency rises 50%, repeat noise lognormal at a
    GPU's 6% and a loaded CPU's 15%. Flagged in alpha (5%) of 4,000 trials within the simulation's own
    noise, at 2, 3 and 5 repeats (4.5%, 4.9%, 5.8%: the repeats' variances pooled, Student's t, exact
    under equal noise): not more, and not so much less that it would rarely flag."""
    from k3pipe.verdicts.capacity import SATURATION_ALPHA, check_saturation

    rng = np.random.default_rng(20261205 + repeats)
    trials = 4000
    flagged = 0
    for _ in range(trials):
        before = _simulated_repeats(rng, 100.0, 200.0, sigma, repeats)
        now = _simulated_repeats(rng, 105.0, 300.0, sigma, repeats)
        check = check_saturation(before, now, 5)
        assert check is not None
        flagged += check.flagged
    rate = flagged / trials
    slack = 3 * math.sqrt(SATURATION_ALPHA * (1 - SATURATION_ALPHA) / trials)
    assert SATURATION_ALPHA - slack <= rate <= SATURATION_ALPHA + slack, rate


def _simulated_ladder(rng, curve, sigma: float, repeats: int, min_gain_pct: float = 5.0):
    """A ladder 1..64 over a throughput curve, each point's repeats noisy: (where LadderStop ended
    it or None, where one comparison of single measurements would have ended it or None)."""
    from k3pipe.verdicts.capacity import LadderStop, check_saturation

    stop = LadderStop(min_gain_pct)
    ended = single = None
    before = None
    for c in (1, 2, 4, 8, 16, 32, 64):
        tps = curve(c)
        now = _simulated_repeats(rng, tps, 1000.0 * c / tps, sigma, repeats)
        if before is not None and single is None:
            check = check_saturation(before[:1], now[:1], min_gain_pct)
            single = c if check is not None and check.flagged else None
        before = now
        if stop.add(f"c{c}", now) and ended is None:
            ended = c
    return ended, single


def test_a_ladder_that_never_saturates_is_rarely_ended_where_one_noisy_comparison_would_end_it() -> None:
    """Throughput c/(c+8): every doubling still gains 11% or more, so any end is a false claim. One
    comparison of single measurements (the rule before, 2026-12-05) ended 30% of such ladders at 6%
    noise and 69% at 15%; two points in a row end 0.1% and 5% of them, the repeats' bound (3 repeats)
    2% at 15%. What is asserted is the simulation's figures with room for its own noise (2,000 each)."""
    rng = np.random.default_rng(7)
    for sigma, repeats, single_at_least, most in (
        (0.06, 1, 0.2, 0.01),
        (0.15, 1, 0.55, 0.07),
        (0.15, 3, 0.55, 0.04),
    ):
        ends = [_simulated_ladder(rng, lambda c: c / (c + 8), sigma, repeats) for _ in range(2000)]
        ended = sum(e is not None for e, _ in ends) / len(ends)
        single = sum(s is not None for _, s in ends) / len(ends)
        assert single >= single_at_least, (sigma, repeats, single)
        assert ended <= most, (sigma, repeats, ended)


def test_a_ladder_past_a_hard_knee_still_ends_and_never_before_the_knee() -> None:
    """Throughput flat past 8 streams (the engine's batch): at 6% noise, measured once a point, the
    ladder ends past the knee in most ladders (c16, c32 or c64: two flat comparisons in a row), never
    at or before it; where it cannot tell, it runs to the last point (time, not a wrong claim)."""
    rng = np.random.default_rng(11)
    ends = [_simulated_ladder(rng, lambda c: min(c, 8), 0.06, 1)[0] for _ in range(2000)]
    assert not any(e is not None and e <= 8 for e in ends)
    assert sum(e is not None for e in ends) / len(ends) >= 0.55
    # a wider margin for a noisy machine ends more of them
    wide = [_simulated_ladder(rng, lambda c: min(c, 8), 0.06, 1, min_gain_pct=10)[0] for _ in range(2000)]
    assert sum(e is not None for e in wide) / len(wide) >= 0.8


def test_the_pareto_front_keeps_what_nothing_beats_on_both() -> None:
    from k3pipe.verdicts.capacity import pareto_front

    pts = [(100.0, 30.0), (60.0, 90.0), (50.0, 80.0), (60.0, 90.0), (20.0, 95.0)]
    assert pareto_front(pts) == [True, True, False, True, True]
