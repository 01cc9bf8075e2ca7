"""Capacity under an SLO: the highest request rate (or concurrency) an engine sustains within its
latency objectives, found by search on one running engine.

A **probe** sends the workload at one load point and is judged by its SLO attainment: the share of
its measured requests that met every objective, TTFT and E2E counted from each request's scheduled
arrival (a request the client held back waited as its user would), failed requests counted as
missed. A point **passes** when the attainment is at least ``attainment_pct``.

One **search** per repeat: from ``start``, bracket geometrically (times or divided by ``factor``)
until a passing and a failing point surround the boundary, or ``low`` / ``high`` is reached; then
bisect (the geometric mean of a rate bracket, the midpoint of a concurrency one) until the failing
point is within ``tolerance_pct`` of the passing one (a concurrency bracket: adjacent integers at
least). The **capacity** is the highest passing point; the **binding constraint** the objective met
least often at the lowest failing point; a **cliff** an attainment that falls from passing to below
half of ``attainment_pct`` across the final bracket (the load is near a wall, not on a slope). A
search that passes at ``high`` says the capacity is at least ``high``; one that fails at ``low``,
below ``low``: neither is a figure to rank on.

A probe's attainment is a share of its requests: :func:`attainment_interval` gives its binomial
(Clopper-Pearson) interval, and a probe whose interval holds the target is **undecided**: its pass or
fail is the point estimate's, and another probe of as many requests at the same load could have gone
the other way.

The bisection assumes attainment falls as load rises; a noisy probe near the boundary moves the
result by a bracket or more, and the repeats (each a search of its own, with its own arrivals) and
launches give the interval: :func:`capacity_estimate`, the rule the report's verdicts use
(:func:`k3pipe.verdicts.stats.with_resolution`: each search's bracket middle, the bracket's own error added
whole, since every search walks the same grid of loads).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from scipy.stats import beta

from k3pipe.verdicts.stats import Estimate, compare, estimate, with_resolution

__all__ = [
    "ATTAINMENT_CONFIDENCE",
    "SATURATION_ALPHA",
    "SEARCHES_FOR_INTERVAL",
    "CapacityResult",
    "CapacitySearch",
    "CapacitySummary",
    "LadderStop",
    "Probe",
    "Saturation",
    "attainment_interval",
    "capacity_estimate",
    "check_saturation",
    "pareto_front",
    "summarize_searches",
]

Over = Literal["rate", "concurrency"]

ATTAINMENT_CONFIDENCE = 0.95
"""The level of a probe's attainment interval (:func:`attainment_interval`)."""

SEARCHES_FOR_INTERVAL = 3
"""Searches (repeats, or launches) to ask for where a capacity rests on one: two give an interval,
but on one degree of freedom (Student's t of 12.7 against 4.3 with two) it is 3 to 4 times wider."""


def attainment_interval(
    met: int, requests: int, confidence: float = ATTAINMENT_CONFIDENCE
) -> tuple[float, float]:
    """The two-sided ``confidence`` interval of a probe's attainment, in percent: ``met`` of its
    ``requests`` measured requests met the SLO. Clopper-Pearson, from the beta distribution's
    quantiles (scipy's ``beta.ppf``; the same as ``binomtest(...).proportion_ci(method="exact")``,
    which also computes a p-value and costs 25 times as long): its coverage is at least
    ``confidence`` at every true share, where Wilson's dips below it at some, and a probe called
    decided must not be a coin toss. It treats the requests as independent draws; requests that
    queue behind one another are not, so near an overload it is narrower than the probe's real
    uncertainty (the repeats' spread is what shows that)."""
    if requests < 1 or not 0 <= met <= requests:
        raise ValueError(
            f"a probe's attainment needs 0 <= met <= requests and requests >= 1 (got met {met}, "
            f"requests {requests})"
        )
    tail = (1.0 - confidence) / 2.0
    low = 0.0 if met == 0 else float(beta.ppf(tail, met, requests - met + 1))
    high = 1.0 if met == requests else float(beta.ppf(1.0 - tail, met + 1, requests - met))
    return 100.0 * low, 100.0 * high


@dataclass(frozen=True)
class Probe:
    """One load point as measured: its attainment, per objective too, and (when the count of its
    measured requests is known) the attainment's binomial interval and whether it decides."""

    point: float
    attainment_pct: float
    by_objective_pct: Mapping[str, float] = field(default_factory=dict)
    passed: bool = False
    run_id: str | None = None
    requests: int | None = None
    """Measured requests (the attainment's denominator); None: not known (older records)."""
    met: int | None = None
    """Of them, those that met every objective."""
    ci_low_pct: float | None = None
    ci_high_pct: float | None = None
    """The attainment's :data:`ATTAINMENT_CONFIDENCE` interval (:func:`attainment_interval`)."""
    undecided: bool | None = None
    """The interval holds the target (its low end below it, its high end at or above it): the pass
    or fail is the point estimate's alone. None: no interval."""


@dataclass(frozen=True)
class CapacityResult:
    """One search's answer."""

    over: Over
    capacity: float | None
    """The highest passing point (None: even ``low`` failed)."""
    failed_at: float | None
    """The lowest failing point (None: even ``high`` passed)."""
    censored: Literal["above_high", "below_low"] | None
    """'above_high': the capacity is at least ``high``; 'below_low': below ``low``; None: bracketed."""
    converged: bool
    """The bracket closed within the tolerance (False: ``max_probes`` ran out first)."""
    binding: str | None
    """The objective met least often at ``failed_at`` (ttft_ms, tpot_ms, e2e_ms), if any failed."""
    cliff: bool
    """Attainment fell from passing to below half the target across the final bracket."""
    probes: list[Probe]

    @property
    def width(self) -> float | None:
        """The log-width of the capacities the final bracket leaves possible: ``log(failed_at /
        capacity)`` for a rate (any rate in between may be the boundary); for a whole number of
        streams ``log((failed_at - 1) / capacity)``, 0 where the two are adjacent (``c`` passed and
        ``c + 1`` failed: the capacity is ``c``, exactly). None unless bracketed."""
        if self.censored is not None or self.capacity is None or self.failed_at is None:
            return None
        if self.over == "concurrency":
            return math.log(max(self.failed_at - 1, self.capacity) / self.capacity)
        return math.log(self.failed_at / self.capacity)

    @property
    def key(self) -> str:
        """The metric its capacity is recorded as: ``capacity_rps`` or ``capacity_concurrency``."""
        return "capacity_rps" if self.over == "rate" else "capacity_concurrency"

    def metrics(self) -> dict[str, float]:
        """What its search's run records (:meth:`k3pipe.records.recorder.ArmRecorder.log_capacity`), and what
        the report reads back: ``capacity_rps`` (or ``capacity_concurrency``) only where a pass and a
        fail surround it, with ``_resolution`` (the bracket's log-width); ``_at_least`` where every
        probe passed (at ``high``, or when ``max_probes`` ran out first); ``_failed_at``, ``_probes``,
        ``_cliff``, ``_converged``."""
        key = self.key
        out = {
            f"{key}_probes": float(len(self.probes)),
            f"{key}_cliff": float(self.cliff),
            f"{key}_converged": float(self.converged),
        }
        if self.width is not None and self.capacity is not None:
            out[key] = self.capacity
            # the boundary lies in the bracket: error the repeats cannot show
            # (k3pipe.verdicts.stats.with_resolution)
            out[f"{key}_resolution"] = self.width
        if self.failed_at is not None:
            out[f"{key}_failed_at"] = self.failed_at
        elif self.capacity is not None:
            out[f"{key}_at_least"] = self.capacity
        return out

    def record(self) -> dict[str, Any]:
        """Its ``capacity.json``: the answer and every probe (with its attainment's interval)."""
        return {
            "over": self.over,
            "capacity": self.capacity,
            "failed_at": self.failed_at,
            "censored": self.censored,
            "converged": self.converged,
            "binding": self.binding,
            "cliff": self.cliff,
            "probes": [asdict(p) for p in self.probes],
        }

    def describe(self, unit: str) -> str:
        if self.censored == "below_low":
            return f"below {_fmt(self.failed_at)} {unit}: the lowest load tried missed the SLO"
        if self.censored == "above_high":
            return f"at least {_fmt(self.capacity)} {unit}: the highest load tried met the SLO"
        text = f"{_fmt(self.capacity)} {unit} (fails at {_fmt(self.failed_at)}"
        text += f", bound by {self.binding})" if self.binding else ")"
        if self.cliff:
            text += ", a cliff"
        if not self.converged:
            text += ", not converged (max_probes ran out)"
        return text


def _fmt(value: float | None) -> str:
    if value is None:
        return "?"
    return f"{value:.3g}" if value < 100 else f"{value:,.0f}"


class CapacitySearch:
    """The search as a state machine: ``while (p := s.next_point()) is not None: s.add(measure(p))``."""

    def __init__(
        self,
        over: Over,
        low: float,
        high: float,
        *,
        start: float | None = None,
        factor: float = 2.0,
        tolerance_pct: float = 5.0,
        attainment_pct: float = 90.0,
        max_probes: int = 12,
    ) -> None:
        if not 0 < low < high:
            raise ValueError(f"capacity needs 0 < low < high (got low {low}, high {high})")
        if factor <= 1:
            raise ValueError(f"capacity.factor must be above 1 (got {factor})")
        self.over = over
        self.low, self.high = low, high
        self.factor = factor
        self.tolerance = tolerance_pct / 100.0
        self.target = attainment_pct
        self.max_probes = max_probes
        first = start if start is not None else math.sqrt(low * high)
        self.start = self._snap(min(max(first, low), high))
        self.probes: list[Probe] = []

    # -- the points ---------------------------------------------------------------------------

    def _snap(self, point: float) -> float:
        return float(max(1, round(point))) if self.over == "concurrency" else point

    @property
    def passed(self) -> Probe | None:
        """The highest passing probe."""
        ok = [p for p in self.probes if p.passed]
        return max(ok, key=lambda p: p.point) if ok else None

    @property
    def failed(self) -> Probe | None:
        """The lowest failing probe."""
        bad = [p for p in self.probes if not p.passed]
        return min(bad, key=lambda p: p.point) if bad else None

    def _closed(self, lo: float, hi: float) -> bool:
        if self.over == "concurrency":
            return hi - lo <= max(1.0, math.floor(lo * self.tolerance))
        return hi <= lo * (1 + self.tolerance)

    def next_point(self) -> float | None:
        """The next load point to probe, or None when the search is over."""
        if not self.probes:
            return self.start
        if len(self.probes) >= self.max_probes:
            return None
        ok, bad = self.passed, self.failed
        tried = {p.point for p in self.probes}
        if bad is None:
            assert ok is not None
            nxt = self._snap(min(ok.point * self.factor, self.high))
        elif ok is None:
            nxt = self._snap(max(bad.point / self.factor, self.low))
        else:
            if self._closed(ok.point, bad.point):
                return None
            if self.over == "concurrency":
                nxt = float((int(ok.point) + int(bad.point)) // 2)
            else:
                nxt = math.sqrt(ok.point * bad.point)
        return None if nxt in tried else nxt

    def judge(
        self,
        point: float,
        attainment_pct: float,
        by_objective_pct: Mapping[str, float] | None = None,
        requests: int | None = None,
    ) -> Probe:
        """The probe at ``point`` as the search judges it, not yet taken (:meth:`add` takes it): it
        passes when its attainment reaches the target. With ``requests`` (its measured requests) it
        carries its attainment's binomial interval and whether that interval decides the pass or
        fail."""
        passed = attainment_pct >= self.target
        met = low = high = undecided = None
        if requests is not None and requests > 0:
            met = round(attainment_pct * requests / 100.0)  # attainment is 100 x met / requests
            low, high = attainment_interval(met, requests)
            undecided = low < self.target <= high
        return Probe(
            point, attainment_pct, dict(by_objective_pct or {}), passed, None, requests, met, low, high,
            undecided,
        )  # fmt: skip

    def add(
        self,
        point: float,
        attainment_pct: float,
        by_objective_pct: Mapping[str, float] | None = None,
        run_id: str | None = None,
        requests: int | None = None,
    ) -> Probe:
        """Take the probe at ``point`` (:meth:`judge`), recorded as the run ``run_id``."""
        probe = replace(self.judge(point, attainment_pct, by_objective_pct, requests), run_id=run_id)
        self.probes.append(probe)
        return probe

    def result(self) -> CapacityResult:
        ok, bad = self.passed, self.failed
        censored: Literal["above_high", "below_low"] | None = None
        if bad is None:
            censored = "above_high" if ok is not None and ok.point >= self.high else None
        elif ok is None:
            censored = "below_low" if bad.point <= self.low else None
        converged = censored is not None or (
            ok is not None and bad is not None and self._closed(ok.point, bad.point)
        )
        binding = None
        if bad is not None and bad.by_objective_pct:
            binding = min(bad.by_objective_pct.items(), key=lambda kv: kv[1])[0]
        cliff = (
            ok is not None
            and bad is not None
            and self._closed(ok.point, bad.point)
            and bad.attainment_pct < self.target / 2
        )
        return CapacityResult(
            over=self.over,
            capacity=ok.point if ok is not None else None,
            failed_at=bad.point if bad is not None else None,
            censored=censored,
            converged=converged,
            binding=binding,
            cliff=cliff,
            probes=list(self.probes),
        )


@dataclass(frozen=True)
class CapacitySummary:
    """The searches of one workload (one per repeat) together."""

    over: Over
    results: list[CapacityResult]
    estimate: Estimate | None
    """The capacity over the bracketed searches (:func:`capacity_estimate`): the geometric mean of
    their brackets' middles, with a variance (an interval) from two searches on; None: none
    bracketed."""
    binding: str | None
    """The constraint that bound most searches."""
    cliff: bool
    """Any search found a cliff."""

    @property
    def values(self) -> list[float]:
        """The bracketed searches' capacities (their last passing loads)."""
        return [r.capacity for r in self.results if r.capacity is not None and r.width is not None]

    def describe(self, unit: str) -> str:
        """'19.9 req/s [18.6, 21.3] (95%; 5 searches, one launch: restart noise not in it)', '20.5
        req/s (a single search: no interval; repeats: 3 to get one)', or why there is no value."""
        est = self.estimate
        n = len(self.values)
        if est is None:
            return f"no value: none of the {len(self.results)} search(es) bracketed the capacity"
        left = len(self.results) - n
        aside = f"; {left} censored search(es) left out" if left else ""
        if est.var is None:
            return (
                f"{_fmt(est.mean)} {unit} (a single search: no interval; repeats: "
                f"{SEARCHES_FOR_INTERVAL} to get one{aside})"
            )
        low, high = est.interval(0.95) or (math.nan, math.nan)
        return (
            f"{_fmt(est.mean)} {unit} [{_fmt(low)}, {_fmt(high)}] (95%; {n} searches, one launch: "
            f"restart noise not in it{aside})"
        )


def capacity_estimate(launches: Sequence[Sequence[CapacityResult]]) -> Estimate | None:
    """The capacity of one arm on one workload from its searches, one list per launch (a search per
    repeat), by the verdicts' rules: each bracketed search's capacity is one value
    (:func:`k3pipe.verdicts.stats.estimate`: launch means on the log scale, the variance from two launches or
    more, else from the one launch's repeats), moved to its bracket's middle with the bracket's error
    added (:func:`k3pipe.verdicts.stats.with_resolution`). This is what the report's table and verdicts
    compute from the recorded ``capacity_*`` and ``capacity_*_resolution`` metrics. A censored search
    (above ``high``, below ``low``) is a bound, not a value: left out. None: nothing bracketed."""
    values = [[r.capacity for r in launch if r.width is not None and r.capacity] for launch in launches]
    est = estimate(values)
    if est is None:
        return None
    widths = [w for launch in launches for r in launch if (w := r.width) is not None and r.capacity]
    return with_resolution(est, widths)


def summarize_searches(results: Sequence[CapacityResult]) -> CapacitySummary:
    """The capacity across the repeats of one launch (:func:`capacity_estimate`); a censored search
    is reported, not averaged."""
    if not results:
        raise ValueError("no capacity search to summarize")
    # the searches of one launch are its repeats: their spread is the repeat noise, not a restart's
    est = capacity_estimate([results])
    return CapacitySummary(
        over=results[0].over,
        results=list(results),
        estimate=est,
        binding=_most(r.binding for r in results),
        cliff=any(r.cliff for r in results),
    )


def _most(values: Iterable[str | None]) -> str | None:
    counts: dict[str, int] = {}
    for v in values:
        if v is not None:
            counts[v] = counts.get(v, 0) + 1
    return max(counts, key=lambda k: counts[k]) if counts else None


SATURATION_ALPHA = 0.05
"""A ladder point measured with repeats is called past saturation only when the throughput gain's
one-sided upper bound at this level is below ``min_gain_pct``."""


@dataclass(frozen=True)
class Saturation:
    """A ladder point against the point before it. ``flagged``: output throughput up by less than
    ``min_gain_pct`` while the mean end-to-end latency rose by more (the added load only queued).
    ``confident``: the flag rests on the repeats' spread (the gain's upper bound is below the margin);
    a flag from single measurements is a point estimate whose noise is unknown."""

    flagged: bool
    confident: bool
    gain_pct: float
    rise_pct: float
    gain_upper_pct: float | None  # the one-sided (1 - alpha) upper bound; None: one repeat
    min_gain_pct: float
    alpha: float = SATURATION_ALPHA

    def describe(self) -> str:
        bound = (
            f" (upper {1 - self.alpha:.0%} bound {self.gain_upper_pct:+.1f}%)"
            if self.gain_upper_pct is not None
            else ""
        )
        return (
            f"output throughput {self.gain_pct:+.1f}%{bound} while mean E2E {self.rise_pct:+.1f}% "
            f"(less than {self.min_gain_pct:g}% gain)"
        )


def _cell(repeats: Sequence[Mapping[str, float]], key: str) -> Estimate | None:
    """One point's repeats of ``key`` as one launch's cell; None where a repeat lacks the figure."""
    values = [r.get(key) for r in repeats]
    if not values or any(v is None or not math.isfinite(v) or v <= 0 for v in values):
        return None
    return estimate([[float(v) for v in values if v is not None]])


def check_saturation(
    before: Sequence[Mapping[str, float]],
    now: Sequence[Mapping[str, float]],
    min_gain_pct: float,
    alpha: float = SATURATION_ALPHA,
) -> Saturation | None:
    """Whether the ladder point ``now`` is past saturation against the point ``before`` (each the
    summary metrics of its repeats), or None where either lacks a figure.

    The gain and the rise are ratios of geometric means over the repeats. With two or more repeats at
    both points the gain is judged against its noise (:func:`k3pipe.verdicts.stats.compare`: the repeats'
    variances pooled where the counts match, else Welch's): flagged only when the one-sided
    ``1 - alpha`` upper bound of the log-throughput difference is below ``log(1 + min_gain_pct/100)``,
    so a point whose true gain is ``min_gain_pct`` or more is flagged in at most ``alpha`` of ladders
    (log throughput normal across repeats). With one repeat at either point the flag is the point
    estimate's and not ``confident``: :class:`LadderStop` confirms it with the next point."""
    tps0, tps1 = _cell(before, "output_throughput_tps"), _cell(now, "output_throughput_tps")
    e2e0, e2e1 = _cell(before, "e2e_ms_mean"), _cell(now, "e2e_ms_mean")
    if tps0 is None or tps1 is None or e2e0 is None or e2e1 is None:
        return None
    gain = compare(tps1, tps0)
    rise = e2e1.log_mean - e2e0.log_mean
    margin = math.log1p(min_gain_pct / 100)
    gain_pct, rise_pct = math.expm1(gain.diff) * 100, math.expm1(rise) * 100
    bounds = gain.interval(1 - 2 * alpha) if gain.se is not None else None
    if bounds is None:
        flagged = gain.diff < margin and rise > margin
        return Saturation(flagged, False, gain_pct, rise_pct, None, min_gain_pct, alpha)
    flagged = bounds[1] < margin and rise > margin
    upper_pct = math.expm1(bounds[1]) * 100
    return Saturation(flagged, flagged, gain_pct, rise_pct, upper_pct, min_gain_pct, alpha)


class LadderStop:
    """Where a ladder ends past saturation, fed its points lowest first (:meth:`add`): at the first
    point whose repeats show it (:func:`check_saturation`, ``confident``), or, where a point was
    measured once, at the second point in a row that looks it: one noisy measurement (a GPU's repeat
    noise is 5-8%, a loaded CPU's 30%) ends nothing, two in a row need two flukes."""

    def __init__(self, min_gain_pct: float, alpha: float = SATURATION_ALPHA) -> None:
        self.min_gain_pct = min_gain_pct
        self.alpha = alpha
        self._before: Sequence[Mapping[str, float]] | None = None
        self.suspect = ""  # the last point, where it looked past saturation on one measurement

    def add(self, label: str, repeats: Sequence[Mapping[str, float]]) -> str | None:
        """Take the point ``label`` (its repeats' metrics): why the ladder ends here, or None."""
        before, self._before = self._before, repeats
        check = check_saturation(before, repeats, self.min_gain_pct, self.alpha) if before else None
        if check is None or not check.flagged:
            self.suspect = ""
            return None
        if check.confident:
            return f"past saturation: {check.describe()}"
        if self.suspect:
            return f"past saturation at two points in a row: {self.suspect}; {label}: {check.describe()}"
        self.suspect = f"{label}: {check.describe()}"
        return None


def pareto_front(points: Sequence[tuple[float, float]]) -> list[bool]:
    """Which of ``points`` (x, y), both higher-is-better, no other point beats on both (ties kept)."""
    out = []
    for i, (x, y) in enumerate(points):
        beaten = any(
            (x2 >= x and y2 >= y) and (x2 > x or y2 > y) for j, (x2, y2) in enumerate(points) if j != i
        )
        out.append(not beaten)
    return out
