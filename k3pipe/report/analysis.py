"""The study's answer from its recorded cells: per workload and figure each arm's geometric mean
(with its 95% interval), the ranking of all arms, a verdict for every pair of arms on each decision
metric, the restart and repeat noise, each arm's degradation along the input length, where the
leader flips, every throughput against its physical ceiling, and the study's own published figures
checked against what its inputs give.

The statistics are :mod:`k3pipe.verdicts.stats`' (docs/measurement.md, "Verdicts"):

- A cell (an arm on a workload) is its launches' repeats; it is summarised on the log scale (the
  geometric mean of its launch means), and its 95% interval comes from the spread of its launch means
  (two launches or more) or of its one launch's repeats (then restart noise is not in it).
- The experiment's ``decision`` names the figures the verdicts rest on (default: output throughput,
  TTFT p50, TPOT p50). Every pair of arms is compared on each of them in each workload: that is the
  family, and the family-wise error rate ``alpha`` is shared by all its comparisons (Bonferroni).
  Each verdict is read off its own interval at that level: better by x%, equivalent within the
  margin, or inconclusive with the smallest difference the data could have shown.
- Every other figure is descriptive: its cells' intervals are shown, its leader and ratio, and no
  verdict.
- An A/A calibration (``decision.calibration``) is judged apart, as a family of its own: its result
  is the floor of what the study can tell from restarting the engine.
- Comparisons along the input length (degradation, flips) compare only workloads that differ in
  input length alone (same output length, load, concurrency or rate, dataset kind).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from scipy import stats as scipy_stats

from k3pipe.core.figures import CAPACITY_FIGURES, DEFAULT_DECISION, FIGURES, TABLE_FIGURES, Figure, tails_of
from k3pipe.core.figures import figure as figure_of
from k3pipe.report.collect import CellData, StudyData
from k3pipe.report.gate import AnswersAnalysis, analyse_answers
from k3pipe.verdicts import stats
from k3pipe.verdicts.capacity import pareto_front

__all__ = [
    "TABLE_METRICS",
    "Analysis",
    "ArmNoise",
    "BoundCheck",
    "CellStat",
    "ClaimCheck",
    "Degradation",
    "Flip",
    "Metric",
    "NoiseRow",
    "PairNoise",
    "PairVerdict",
    "ParetoPoint",
    "Row",
    "Tail",
    "WarmupFinding",
    "analyse",
    "design_of",
    "hardware_refusal",
    "is_bursty",
]

CLAIM_TOLERANCE = 0.02
"""A published derived figure 'follows' from the inputs when within 2% of what they give."""
BOUND_TOLERANCE = 0.001

Metric = Figure
TABLE_METRICS = TABLE_FIGURES
_BY_KEY = {m.key: m for m in FIGURES}
_CLIENT_TIMING = ("tpot_ms_p50", "itl_ms_p50", "tpot_ms_p90")
"""The client's per-token timing: not about decoding when the stream came in bursts (see
k3pipe.bench.summary.timing_note), so such a cell is shown as 'bursty' and not ranked."""


def is_bursty(cell: CellData, metric: Metric) -> bool:
    """Whether ``metric`` of ``cell`` is the client's per-token timing of a stream that came in
    bursts (shown as 'bursty', never ranked or judged)."""
    return metric.key in _CLIENT_TIMING and (cell.mean("client_timing_bursty") or 0) > 0


@dataclass(frozen=True)
class CellStat:
    """One arm's figure in a row: the estimate and its 95% interval (what the table shows)."""

    estimate: stats.Estimate

    @property
    def mean(self) -> float:
        """The geometric mean (of the launch means)."""
        return self.estimate.mean

    @property
    def ci_low(self) -> float | None:
        ci = self.estimate.interval(0.95)
        return ci[0] if ci else None

    @property
    def ci_high(self) -> float | None:
        ci = self.estimate.interval(0.95)
        return ci[1] if ci else None

    @property
    def n(self) -> int:
        return sum(self.estimate.repeats)

    @property
    def launches(self) -> int:
        return self.estimate.launches


@dataclass
class PairVerdict:
    """One decision comparison: arms ``a`` and ``b`` of a workload on a decision figure."""

    workload: str
    metric: str
    a: str
    b: str
    verdict: stats.Verdict
    tail: Tail | None = None
    """A percentile figure's tail (p99, else p90) for both arms, and whether it splits the verdict."""

    @property
    def split(self) -> bool:
        """The median is better for one arm and its tail worse beyond the margin."""
        return self.tail is not None and self.tail.split and self.verdict.different

    @property
    def leader(self) -> str:
        return self.verdict.leader

    @property
    def other(self) -> str:
        return self.verdict.other

    @property
    def outcome(self) -> str:
        return self.verdict.outcome

    @property
    def tested(self) -> bool:
        return self.verdict.tested

    @property
    def different(self) -> bool:
        return self.verdict.different

    @property
    def ratio(self) -> float:
        return self.verdict.advantage

    @property
    def ci(self) -> tuple[float, float] | None:
        return self.verdict.interval

    def involves(self, arm: str, other: str) -> bool:
        return {self.a, self.b} == {arm, other}

    def text(self) -> str:
        if self.split:
            return f"a split: {self.verdict.text()}{self.tail_text()}"
        return self.verdict.text() + self.tail_text()

    def tail_text(self) -> str:
        """'; tail (TTFT p99): a 2,600 ms, b 840 ms: a's 3.10x: the median better, the tail worse'."""
        t = self.tail
        if t is None:
            return ""
        lead, other = self.verdict.leader, self.verdict.other
        # the leader's tail over the other's, as values: higher by a factor, or lower by a share
        up = t.ratio if not t.metric.higher_is_better else 1 / t.ratio
        words = stats.change_words(up, True) if up >= 1 else stats.change_words(1 / up, False)
        said = (
            f"; tail ({t.metric.label}): {self.a} {_num(t.a)}, {self.b} {_num(t.b)} {t.metric.unit}, "
            f"{lead}'s {words} than {other}'s"
        )
        if self.split:
            said += f": the median better, the tail worse beyond the +-{self.verdict.margin:.0%} margin"
        return said

    def against(self, best: str) -> str:
        """The verdict said of the arm that is not ``best``: 'a 12.0% higher [..]', 'equivalent
        within +-5% (...)', 'inconclusive: ...', 'a split: ...'; with the tail where it has one."""
        v = self.verdict
        if v.outcome == "different" and not self.split:
            if v.leader == best:
                return f"{best} {v.change_text()} {v.interval_text()}{_suffix(v)}{self.tail_text()}"
            return f"better than {best}: {v.change_text()} {v.interval_text()}{_suffix(v)}{self.tail_text()}"
        return self.text()


def _num(v: float) -> str:
    return f"{v:,.1f}" if abs(v) < 1000 else f"{v:,.0f}"


def _suffix(v: stats.Verdict) -> str:
    small = f"; within the +-{v.margin:.0%} margin" if v.within_margin else ""
    return small + v.noise_note()


@dataclass
class Row:
    workload: str
    input_tokens: int
    metric: Metric
    cells: dict[str, CellStat]
    """arm -> its estimate (arms that lack the figure, or whose value was bursty, are absent)."""
    decision: bool = False
    """The figure is one the verdicts rest on (else descriptive)."""
    ranking: list[str] = field(default_factory=list)
    """The arms, best first (by geometric mean)."""
    leader: str | None = None
    ratio: float | None = None
    """The leader's advantage over the runner-up, >= 1."""
    verdicts: list[PairVerdict] = field(default_factory=list)
    """Every pair of ranked arms (decision figures only)."""
    calibration: PairVerdict | None = None
    """The A/A: the baseline against its copy (decision figures only)."""
    bursty: set[str] = field(default_factory=set)
    """Arms whose client timing was bursty in this workload (their TPOT/ITL are not ranked)."""
    zeros: set[str] = field(default_factory=set)
    """Arms whose every value of the figure was exactly 0 (a hit rate of none, no failures): shown
    as 0, not ranked (the verdicts compare logs of ratios)."""

    def pair(self, arm: str, other: str) -> PairVerdict | None:
        return next((v for v in self.verdicts if v.involves(arm, other)), None)


@dataclass(frozen=True)
class NoiseRow:
    """Restart and repeat noise of one decision figure in one workload, pooled over its arms."""

    workload: str
    metric: Metric
    components: stats.Components | None
    launches: dict[str, int]
    repeats: dict[str, int]
    mde: tuple[float, float] | None
    """The smallest and largest minimum detectable difference among the workload's comparisons."""


@dataclass(frozen=True)
class ArmNoise:
    """One arm's own noise on a decision figure in a workload (its cell alone), and whether it is much
    noisier than the rest of the workload's arms (a pooled figure hides such an arm)."""

    workload: str
    metric: Metric
    arm: str
    components: stats.Components | None
    launches: int
    repeats: int
    noisier: float | None = None
    """Its repeat noise's variance over the other arms' pooled, when the F test finds it larger (one-
    sided, p < :data:`NOISIER_P`) by at least :data:`NOISIER_RATIO`; None: not much noisier."""
    causes: tuple[str, ...] = ()
    """What k3pipe sees that makes repeats vary (warm-ups not settled, preemptions, queueing)."""


NOISIER_P = 0.01
NOISIER_RATIO = 4.0
"""An arm is much noisier than the rest when its repeats' variance (log scale) is at least 4 times
the others' pooled (twice the coefficient of variation) and an F test (one-sided) says p < 0.01."""


@dataclass(frozen=True)
class PairNoise:
    """One pair's own noise: the smallest difference its comparison could see, and the launches per
    arm a planned 10% difference would need at the two arms' noise."""

    workload: str
    metric: Metric
    a: str
    b: str
    mde: float | None
    components: stats.Components | None
    launches_needed: int | None


@dataclass(frozen=True)
class WarmupFinding:
    """An arm's repeats whose warm-up had not settled (``warmup_steady`` 0) when measuring began."""

    arm: str
    unsettled: int
    of: int
    workloads: tuple[str, ...]
    effects: tuple[str, ...] = ()
    """Per workload and decision figure: the unsettled repeats against the settled ones ('TTFT p50
    of unsettled repeats 12% higher')."""
    priming: int = 0
    """Priming launches whose warm-up had not settled either."""


@dataclass(frozen=True)
class Tail:
    """The tail of a percentile verdict: the same figure's p99 (else p90) for both arms."""

    metric: Metric
    a: float
    b: float
    ratio: float
    """The p50 leader's tail over the other's (a ratio in the figure's own direction: above 1 is
    the leader's tail worse)."""
    split: bool
    """The p50 leader's tail is worse beyond the margin: a split, never a plain win."""


@dataclass(frozen=True)
class Degradation:
    arm: str
    metric: Metric
    short: int
    long: int
    factor: float
    """How many times worse at ``long`` than at ``short`` (slow-down for throughput: short / long)."""
    shape: str = ""
    """What the two workloads share (output length, load, dataset): they differ in input length alone."""


@dataclass(frozen=True)
class Flip:
    metric: Metric
    before: str
    after: str
    between: tuple[int, int]
    at_tokens: float
    """Interpolated: the input length where the two arms' values cross."""
    shape: str = ""
    unseen: tuple[int, ...] = ()
    """On a decision metric: the measured input lengths (of the two) where the pair's verdict is not a
    detected difference. A flip is a claim only when this is empty: an order the data cannot tell
    apart at one end is no change of leader."""
    decision: bool = False

    @property
    def claimed(self) -> bool:
        """A decision metric's flip with a detected difference at both ends."""
        return self.decision and not self.unseen


@dataclass(frozen=True)
class BoundCheck:
    arm: str
    workload: str
    figure: str
    claimed_tps: float
    ceiling_tps: float | None
    basis: str

    @property
    def exceeds(self) -> bool:
        return self.ceiling_tps is not None and self.claimed_tps > self.ceiling_tps * (1 + BOUND_TOLERANCE)

    @property
    def ratio(self) -> float | None:
        return self.claimed_tps / self.ceiling_tps if self.ceiling_tps else None


@dataclass(frozen=True)
class ClaimCheck:
    what: str
    published: float
    computed: float | None
    basis: str

    @property
    def follows(self) -> bool:
        if self.computed is None:
            return False
        return abs(self.published - self.computed) <= CLAIM_TOLERANCE * abs(self.computed)


@dataclass(frozen=True)
class ParetoPoint:
    """One point of an arm's ladder: what each user gets against what each GPU gives."""

    ladder: str
    arm: str
    workload: str
    point: float
    per_user_tps: float
    """Output tokens per second one stream receives: 1000 / TPOT p50 (ms)."""
    per_gpu_tps: float
    """Output tokens per second of the whole load, over the arm's GPUs."""
    on_front: bool
    """No other point of the same arm's ladder gives more of both."""


@dataclass
class Analysis:
    rows: list[Row]
    degradations: list[Degradation]
    flips: list[Flip]
    bounds: list[BoundCheck]
    claims: list[ClaimCheck]
    design: stats.Design
    """The decision's design: alpha, margin, power, and ``tests``, the comparisons it is shared by."""
    noise: list[NoiseRow] = field(default_factory=list)
    calibration: tuple[str, str] | None = None
    calibration_design: stats.Design | None = None
    baseline: str | None = None
    decision_metrics: tuple[str, ...] = DEFAULT_DECISION
    look: dict[str, Any] = field(default_factory=dict)
    """Where a study that added launches stopped (StudyData.look)."""
    pareto: list[ParetoPoint] = field(default_factory=list)
    """Every ladder point of every arm, flagged where it is on that arm's Pareto front."""
    hardware_refusal: str | None = None
    """Why nothing is ranked: the arms were measured on different hardware (decision.mixed_hardware
    off); None: they were not, or the experiment allows it."""
    arm_noise: list[ArmNoise] = field(default_factory=list)
    """Each arm's own noise per workload and decision figure (beside the pooled :attr:`noise`)."""
    pair_noise: list[PairNoise] = field(default_factory=list)
    warmups: list[WarmupFinding] = field(default_factory=list)
    answers: AnswersAnalysis | None = None
    """The output probe's answers against the reference's, and the gate (None: no probe ran)."""

    @property
    def tests(self) -> int:
        """How many comparisons the family-wise error rate is shared by (0: none could be tested)."""
        return sum(v.tested for r in self.rows for v in r.verdicts)

    @property
    def restart_noise_measured(self) -> bool:
        return all(c.launches >= 2 for r in self.rows if r.decision for c in r.cells.values())

    @property
    def restart_unknown(self) -> list[str]:
        """Arms launched once whose restart noise no prior gave (their comparisons: 'cannot tell')."""
        return sorted(
            {a for r in self.rows if r.decision for a, c in r.cells.items() if c.estimate.basis == "repeats"}
        )


def design_of(decision: dict[str, Any], tests: int, look: dict[str, Any] | None = None) -> stats.Design:
    """The :class:`~k3pipe.verdicts.stats.Design` of an experiment's ``decision`` (defaults where it says
    nothing) shared by ``tests`` comparisons; at a ``look`` of a study that added launches, that
    look's share of alpha."""
    alpha = (look or {}).get("alpha") or decision.get("alpha", stats.DEFAULT_ALPHA)
    return stats.Design(
        alpha=float(alpha),
        margin=float(decision.get("margin_pct", stats.DEFAULT_MARGIN * 100)) / 100,
        power=float(decision.get("power", stats.DEFAULT_POWER)),
        tests=max(1, tests),
    )


def _estimates(cells: Iterable[CellData], metric: Metric) -> tuple[dict[str, CellStat], set[str], set[str]]:
    """Per arm: its estimate of ``metric``; the arms whose client timing was bursty; those whose
    every value was exactly 0 (measured, and none: no estimate on the log scale)."""
    bursty, zeros = set(), set()
    have: dict[str, CellStat] = {}
    for c in cells:
        if is_bursty(c, metric):
            bursty.add(c.arm)
            continue
        est = stats.estimate(c.by_launch(metric.key))
        if est is not None:
            if metric.resolution:
                est = stats.with_resolution(est, c.values.get(metric.resolution, []))
            est = stats.with_prior(est, c.priors.get(metric.key))
            have[c.arm] = CellStat(est)
        elif (values := c.values.get(metric.key)) and all(v == 0 for v in values):
            zeros.add(c.arm)
    return have, bursty, zeros


def _rows(data: StudyData, arms: list[str], decision: Sequence[str], copy: str | None) -> list[Row]:
    rows = []
    metrics = [*TABLE_METRICS, *(figure_of(k) for k in decision if k not in {m.key for m in TABLE_METRICS})]
    for workload in data.workloads():
        cells = [c for a in arms if (c := data.cell(a, workload)) is not None]
        if not cells:
            continue
        for metric in metrics:
            have, bursty, zeros = _estimates(cells, metric)
            if not have and not bursty:
                continue  # a row of zeros alone says nothing to compare
            row = Row(
                workload, cells[0].input_tokens, metric, have, metric.key in decision,
                bursty=bursty, zeros=zeros,
            )  # fmt: skip
            ranked = [a for a in have if a != copy]
            ranked.sort(key=lambda a: have[a].estimate.log_mean, reverse=metric.higher_is_better)
            row.ranking = ranked
            if len(ranked) >= 2:
                row.leader = ranked[0]
                row.ratio = math.exp(
                    abs(have[ranked[0]].estimate.log_mean - have[ranked[1]].estimate.log_mean)
                )
            rows.append(row)
    return rows


def _judge(
    rows: list[Row], decision: dict[str, Any], calibration: tuple[str, str] | None, look: dict[str, Any]
) -> tuple[stats.Design, stats.Design | None]:
    """Every pair of ranked arms on every decision row, under one design; the A/A apart. A pair with a
    single value on a side cannot be tested and does not count in the family (which pairs can be
    tested follows from how many launches and repeats ran, not from what they measured)."""
    pairs = [(row, a, b) for row in rows if row.decision for a, b in itertools.combinations(row.ranking, 2)]
    testable = sum(_testable(row, a, b) for row, a, b in pairs)
    design = design_of(decision, testable, look)
    for row, a, b in pairs:
        comparison = stats.compare(row.cells[a].estimate, row.cells[b].estimate)
        verdict = stats.decide(comparison, design, row.metric.higher_is_better, (a, b))
        row.verdicts.append(PairVerdict(row.workload, row.metric.key, a, b, verdict))
    if calibration is None:
        return design, None
    base, copy = calibration
    aa = [r for r in rows if r.decision and base in r.cells and copy in r.cells]
    aa_design = design_of(decision, sum(_testable(r, base, copy) for r in aa), look)
    for row in aa:
        comparison = stats.compare(row.cells[base].estimate, row.cells[copy].estimate)
        verdict = stats.decide(comparison, aa_design, row.metric.higher_is_better, (base, copy))
        row.calibration = PairVerdict(row.workload, row.metric.key, base, copy, verdict)
    return design, aa_design


def _testable(row: Row, a: str, b: str) -> bool:
    """Whether the pair can be tested: a variance on each side that holds restart noise (from
    launches, or a prior); a pair that cannot is not counted in the family."""
    ea, eb = row.cells[a].estimate, row.cells[b].estimate
    return ea.var is not None and eb.var is not None and ea.restart_known and eb.restart_known


def _noise(data: StudyData, rows: list[Row], arms: list[str]) -> list[NoiseRow]:
    out = []
    for row in rows:
        if not row.decision:
            continue
        cells = [c for a in arms if a in row.cells and (c := data.cell(a, row.workload)) is not None]
        series = [c.by_launch(row.metric.key) for c in cells]
        mdes = [v.verdict.mde for v in row.verdicts if v.verdict.mde is not None]
        out.append(
            NoiseRow(
                row.workload, row.metric, stats.components(series),
                {c.arm: len(s) for c, s in zip(cells, series, strict=True)},
                {c.arm: sum(len(x) for x in s) for c, s in zip(cells, series, strict=True)},
                (min(mdes), max(mdes)) if mdes else None,
            )
        )  # fmt: skip
    return out


def _tails(data: StudyData, rows: list[Row], design: stats.Design) -> None:
    """Every verdict on a median figure gets the same figure's tail (p99, else p90) for both arms;
    a detected median win whose tail is worse beyond the margin is a split (PairVerdict.split)."""
    for row in rows:
        if not row.decision:
            continue
        for key in tails_of(row.metric.key):
            tail_metric = figure_of(key)
            means = {}
            for arm in row.cells:
                cell = data.cell(arm, row.workload)
                est = stats.estimate(cell.by_launch(key)) if cell is not None else None
                if est is not None:
                    means[arm] = est.mean
            if not means:
                continue
            for v in row.verdicts:
                if v.a not in means or v.b not in means:
                    continue
                lead, other = v.verdict.leader, v.verdict.other
                bad = means[lead] / means[other]
                if tail_metric.higher_is_better:
                    bad = 1 / bad
                split = v.verdict.different and bad > 1 + design.margin
                v.tail = Tail(tail_metric, means[v.a], means[v.b], bad, split)
            break


def _arm_noise(data: StudyData, rows: list[Row]) -> list[ArmNoise]:
    """Each arm's own noise on each decision figure, flagged where it is much noisier than the rest
    (:data:`NOISIER_RATIO`, :data:`NOISIER_P`), with the causes k3pipe sees in its figures."""
    out = []
    for row in rows:
        if not row.decision:
            continue
        cells = {a: c for a in row.cells if (c := data.cell(a, row.workload)) is not None}
        own = {a: stats.components([c.by_launch(row.metric.key)]) for a, c in cells.items()}
        for arm, comp in own.items():
            flag = None
            others = [o for a, o in own.items() if a != arm and o is not None and o.df_within > 0]
            if comp is not None and comp.df_within > 0 and others:
                df_o = sum(o.df_within for o in others)
                var_o = sum(o.within * o.df_within for o in others) / df_o
                if var_o > 0:
                    ratio = comp.within / var_o
                    p = float(scipy_stats.f.sf(ratio, comp.df_within, df_o))
                    if ratio >= NOISIER_RATIO and p < NOISIER_P:
                        flag = ratio
            cell = cells[arm]
            series = cell.by_launch(row.metric.key)
            out.append(
                ArmNoise(
                    row.workload, row.metric, arm, comp, len(series), sum(len(x) for x in series), flag,
                    _causes(cell) if flag is not None else (),
                )
            )  # fmt: skip
    return out


def _causes(cell: CellData) -> tuple[str, ...]:
    """What in a cell's own figures makes its repeats vary."""
    causes = []
    steady = cell.values.get("warmup_steady", [])
    unsettled = sum(1 for v in steady if v == 0)
    if unsettled:
        causes.append(f"the warm-up had not settled in {unsettled} of {len(steady)} repeats")
    preempted = sum(cell.values.get("engine_preemptions", []))
    if preempted > 0:
        causes.append(f"the engine preempted {preempted:.0f} request(s)")
    waiting = max(cell.values.get("engine_requests_waiting_max", []) or [0.0])
    if waiting > 0 and cell.load == "concurrency":
        causes.append(
            f"up to {waiting:.0f} request(s) waited for a batch slot at {cell.concurrency} streams: the "
            "engine's batch limit is below the load, so each wave queues behind it"
        )
    return tuple(causes) or ("k3pipe sees no cause in its figures (warm-up, preemptions, queueing)",)


def _pair_noise(data: StudyData, rows: list[Row], design: stats.Design) -> list[PairNoise]:
    out = []
    for row in rows:
        for v in row.verdicts:
            cells = [c for a in (v.a, v.b) if (c := data.cell(a, row.workload)) is not None]
            comp = stats.components([c.by_launch(row.metric.key) for c in cells])
            needed = None
            if comp is not None and comp.df_between > 0:
                series = [x for c in cells for x in c.by_launch(row.metric.key)]
                per_launch = max(1, round(sum(len(x) for x in series) / max(1, len(series))))
                needed = stats.launches_needed(0.10, comp.between_cv, comp.within_cv, per_launch, design)
            out.append(PairNoise(row.workload, row.metric, v.a, v.b, v.verdict.mde, comp, needed))
    return out


def _warmups(data: StudyData, decision: Sequence[str]) -> list[WarmupFinding]:
    """Per arm, its repeats measured before the warm-up settled, and what that did to the figures:
    the unsettled repeats' mean against the settled ones' on each decision figure, where both exist."""
    out = []
    for arm in data.arm_names:
        cells = [c for c in data.cells if c.arm == arm]
        flags = [(c, v) for c in cells for v in c.values.get("warmup_steady", [])]
        unsettled = sum(1 for _, v in flags if v == 0)
        primed = sum(
            1 for c in data.primed_cells if c.arm == arm for v in c.values.get("warmup_steady", []) if v == 0
        )
        if not unsettled and not primed:
            continue
        effects = []
        for c in cells:
            steady = c.values.get("warmup_steady", [])
            for key in decision:
                values = c.values.get(key, [])
                if len(values) != len(steady) or not values:
                    continue
                bad = [x for x, f in zip(values, steady, strict=True) if f == 0 and x > 0]
                good = [x for x, f in zip(values, steady, strict=True) if f == 1 and x > 0]
                if bad and good:
                    ratio = math.exp(
                        sum(math.log(x) for x in bad) / len(bad) - sum(math.log(x) for x in good) / len(good)
                    )
                    up = ratio >= 1
                    moved = f"{abs(ratio - 1) * 100:.1f}% {'higher' if up else 'lower'}"
                    label = figure_of(key).label
                    effects.append(f"{c.workload}: {label} {moved} than in the settled repeats")
        workloads = tuple(dict.fromkeys(c.workload for c, v in flags if v == 0))
        out.append(WarmupFinding(arm, unsettled, len(flags), workloads, tuple(effects), primed))
    return out


def _shape_label(cell: CellData) -> str:
    load = (
        f"concurrency {cell.concurrency}"
        if cell.load == "concurrency"
        else f"{cell.load} {cell.rate_rps} req/s"
    )
    return f"{cell.output_tokens:,} out, {load}, {cell.dataset}"


def _by_shape(data: StudyData, arm: str) -> dict[tuple[Any, ...], list[CellData]]:
    """The arm's cells grouped by everything but the input length, each group shortest first."""
    groups: dict[tuple[Any, ...], list[CellData]] = {}
    for cell in data.cells:
        if cell.arm == arm:
            groups.setdefault(cell.shape, []).append(cell)
    return {k: sorted(v, key=lambda c: c.input_tokens) for k, v in groups.items()}


def _geo(cell: CellData, key: str) -> float | None:
    est = stats.estimate(cell.by_launch(key))
    return est.mean if est is not None else None


def _degradations(data: StudyData, arms: list[str]) -> list[Degradation]:
    out = []
    for arm in arms:
        for cells in _by_shape(data, arm).values():
            a, b = cells[0], cells[-1]
            if a.input_tokens == b.input_tokens:
                continue
            for metric in TABLE_METRICS:
                va, vb = _geo(a, metric.key), _geo(b, metric.key)
                if not va or not vb:
                    continue
                factor = va / vb if metric.higher_is_better else vb / va
                out.append(Degradation(arm, metric, a.input_tokens, b.input_tokens, factor, _shape_label(a)))
    return out


def _flips(data: StudyData, rows: list[Row], arms: list[str]) -> list[Flip]:
    out = []
    shapes = {(c.workload): (c.shape, _shape_label(c)) for c in data.cells}
    for metric in TABLE_METRICS:
        mine = sorted((r for r in rows if r.metric.key == metric.key), key=lambda r: r.input_tokens)
        for shape in dict.fromkeys(shapes[r.workload][0] for r in mine):
            along = [r for r in mine if shapes[r.workload][0] == shape]
            label = next(shapes[r.workload][1] for r in along)
            for i, x in enumerate(arms):
                for y in arms[i + 1 :]:
                    points = [
                        (r.input_tokens, r.cells[x].mean - r.cells[y].mean, r)
                        for r in along
                        if x in r.cells and y in r.cells
                    ]
                    for (l1, d1, r1), (l2, d2, r2) in itertools.pairwise(points):
                        if l1 == l2 or d1 == 0 or d2 == 0 or (d1 > 0) == (d2 > 0):
                            continue
                        at = l1 + (l2 - l1) * d1 / (d1 - d2)
                        x_leads_first = (d1 > 0) == metric.higher_is_better
                        before, after = (x, y) if x_leads_first else (y, x)
                        decision = r1.decision and r2.decision
                        unseen = tuple(
                            r.input_tokens
                            for r in (r1, r2)
                            if decision and not ((v := r.pair(x, y)) is not None and v.different)
                        )
                        out.append(Flip(metric, before, after, (l1, l2), at, label, unseen, decision))
    return out


def _ceiling(cell: CellData) -> tuple[float | None, str]:
    bound = cell.mean("output_throughput_bound_tps")
    if bound:
        return bound, "completed requests x max_tokens / measured window"
    duration, completed = cell.mean("duration_s"), cell.mean("completed")
    if duration and completed and cell.output_tokens:
        return (
            completed * cell.output_tokens / duration,
            "completed requests x output_tokens / end-to-end time",
        )
    return None, "no token count or window recorded"


def _bounds(data: StudyData, arms: list[str], claims: Iterable[dict[str, Any]]) -> list[BoundCheck]:
    out = []
    order = {a: i for i, a in enumerate(arms)}
    for cell in sorted(data.cells, key=lambda c: (order.get(c.arm, len(order)), c.input_tokens)):
        if cell.arm not in arms:
            continue
        ceiling, basis = _ceiling(cell)
        for key in ("output_throughput_tps", "engine_generation_tps"):
            value = cell.mean(key)
            if value is not None:
                out.append(BoundCheck(cell.arm, cell.workload, _BY_KEY[key].label, value, ceiling, basis))
        steady = cell.mean("steady_decode_tps")
        if steady is not None:
            # a rate over part of the window (no request in prefill): tokens / wall does not bound it
            out.append(
                BoundCheck(
                    cell.arm, cell.workload, "steady decode throughput", steady, None,
                    "no tokens / wall ceiling: a rate over the time the full batch decoded and no "
                    "request waited",
                )
            )  # fmt: skip
    for claim in claims:
        if claim.get("kind") != "throughput":
            continue
        claimed = data.cell(claim["arm"], claim["workload"])
        if claimed is None:
            continue
        ceiling, basis = _ceiling(claimed)
        out.append(
            BoundCheck(claimed.arm, claimed.workload, f"{claim.get('source', 'published')} figure",
                       float(claim["value"]), ceiling, basis)
        )  # fmt: skip
    for arm in data.arms:
        if arm.name not in arms or arm.log_decode_mean_tps is None:
            continue
        ceilings = [c for cell in data.cells if cell.arm == arm.name and (c := _ceiling(cell)[0])]
        out.append(
            BoundCheck(
                data.label(arm), "(all workloads)", "decode throughput, engine log (mean)",
                arm.log_decode_mean_tps, None,
                "not checkable: the engine log's figure spans every workload of the arm"
                + (f" (its workloads' ceilings: {', '.join(f'{c:,.1f}' for c in ceilings)} tok/s)"
                   if ceilings else ""),
            )
        )  # fmt: skip
    return out


def _claims(
    data: StudyData, rows: list[Row], degradations: list[Degradation], claims: Iterable[dict[str, Any]]
) -> list[ClaimCheck]:
    out = []
    for claim in claims:
        kind = claim.get("kind")
        metric = _BY_KEY.get(str(claim.get("metric")))
        if kind == "ratio" and metric is not None:
            row = next(
                (r for r in rows if r.workload == claim["workload"] and r.metric.key == metric.key), None
            )
            computed = row.ratio if row is not None else None
            leader = row.leader if row is not None else "?"
            out.append(
                ClaimCheck(
                    f"{claim['workload']} {metric.label}: "
                    f"{claim.get('leader', leader)} ahead {claim['value']}x",
                    float(claim["value"]), computed, f"{leader} vs the other arm, from the recorded values",
                )
            )  # fmt: skip
        elif kind == "degradation" and metric is not None:
            found = next(
                (d for d in degradations if d.arm == claim["arm"] and d.metric.key == metric.key), None
            )
            out.append(
                ClaimCheck(
                    f"{claim['arm']} {metric.label} slow-down {found.short if found else '?'} -> "
                    f"{found.long if found else '?'} tokens: {claim['value']}x",
                    float(claim["value"]), found.factor if found else None,
                    "the ratio of the arm's own recorded values at the two lengths",
                )
            )  # fmt: skip
    return out


def _pareto(data: StudyData) -> list[ParetoPoint]:
    """Per ladder and arm, each point's tokens per second per user (1000 / TPOT p50) and per GPU
    (output throughput / the arm's GPUs, :meth:`StudyData.per_gpu`), and the arm's front."""
    out: list[ParetoPoint] = []
    groups: dict[tuple[str, str], list[CellData]] = {}
    for c in data.cells:
        if c.ladder and c.ladder_point is not None:
            groups.setdefault((c.ladder, c.arm), []).append(c)
    for (ladder, arm), cells in groups.items():
        gpus, _ = data.per_gpu(arm)
        pts = []
        for c in sorted(cells, key=lambda c: c.ladder_point or 0.0):
            tpot, tps = c.mean("tpot_ms_p50"), c.mean("output_throughput_tps")
            if tpot and tps:
                pts.append((c, 1000.0 / tpot, tps / gpus))
        front = pareto_front([(x, y) for _, x, y in pts])
        out += [
            ParetoPoint(ladder, arm, c.workload, c.ladder_point or 0.0, x, y, f)
            for (c, x, y), f in zip(pts, front, strict=True)
        ]
    return out


def default_decision(data: StudyData) -> tuple[str, ...]:
    """The decision metrics of an experiment that names none (its recorded decision then holds
    :data:`DEFAULT_DECISION`): those, and the capacity figures its capacity searches recorded."""
    found = tuple(k for k in CAPACITY_FIGURES if any(c.values.get(k) for c in data.cells))
    return DEFAULT_DECISION + found


def analyse(data: StudyData, claims: Iterable[dict[str, Any]] = ()) -> Analysis:
    """The report's numbers. ``claims``: figures published for the study (e.g. field-notes.md's
    ratios), each checked against what the recorded values give (see the module docstring)."""
    claims = list(claims)
    arms = [a for a in data.arm_names if any(c.arm == a for c in data.cells)]
    decision = dict(data.decision)
    metrics = tuple(decision.get("metrics") or DEFAULT_DECISION)
    if metrics == DEFAULT_DECISION:
        metrics = default_decision(data)
    calibration = data.calibration
    copy = calibration[1] if calibration else None
    rows = _rows(data, arms, metrics, copy)
    design, aa_design = _judge(rows, decision, calibration, data.look)
    refusal = None if decision.get("mixed_hardware") else hardware_refusal(data, arms)
    if refusal is not None:  # shown, not ranked: no leader, ratio or verdict
        for r in rows:
            r.ranking, r.leader, r.ratio, r.verdicts, r.calibration = [], None, None, [], None
    main_arms = [a for a in arms if a != copy]
    _tails(data, rows, design)
    degradations = _degradations(data, main_arms)
    return Analysis(
        rows=rows,
        degradations=degradations,
        flips=_flips(data, rows, main_arms),
        bounds=_bounds(data, arms, claims),
        claims=_claims(data, rows, degradations, claims),
        design=design,
        noise=_noise(data, rows, arms),
        calibration=calibration,
        calibration_design=aa_design,
        baseline=decision.get("baseline"),
        decision_metrics=metrics,
        look=dict(data.look),
        pareto=_pareto(data),
        hardware_refusal=refusal,
        arm_noise=_arm_noise(data, rows),
        pair_noise=_pair_noise(data, rows, design),
        warmups=_warmups(data, metrics),
        answers=analyse_answers(data),
    )


def hardware_refusal(data: StudyData, arms: Sequence[str]) -> str | None:
    """Why ``arms`` cannot be ranked against each other: their launches ran on different hardware
    (GPU model, count, driver), named per arm; None when every launch ran on the same, or none
    recorded any (a CPU machine, external endpoints)."""
    seen: dict[str, list[str]] = {}
    for arm in data.arms:
        if arm.name in arms:
            label = arm.hardware or "no GPU facts recorded"
            if label not in seen.setdefault(arm.name, []):
                seen[arm.name].append(label)
    kinds = {label for labels in seen.values() for label in labels}
    if len(kinds) <= 1 or kinds == {"no GPU facts recorded"}:
        return None
    named = "; ".join(f"{arm}: {' and '.join(labels)}" for arm, labels in seen.items())
    return (
        f"Not ranked: the arms were measured on different hardware ({named}). A difference between "
        "them may be the hardware's, not the engines'. Run them on nodes of one kind (fleet.arms), or "
        "set decision.mixed_hardware: true to rank them anyway."
    )
