"""The study's answer from its recorded cells: per workload and metric each arm's value (with its 95%
confidence interval across repeats), the leader and by how much, a verdict per pair of arms, each
arm's degradation between input lengths, where the leader flips, every throughput against its
physical ceiling, and the study's own published figures checked against what its inputs give.

Statistics, stated where they are shown:

- A cell's value is the mean over its repeats; its interval is Student's t 95% interval of the mean
  (``k3pipe.bench.repeats.RepeatStats``). One repeat: the value alone.
- "A ahead of B by x%": the ratio of the two means (B / A for a lower-is-better metric, A / B for a
  higher-is-better one) minus 1. Its 95% interval comes from the delta method on the log of the
  ratio, with Welch-Satterthwaite degrees of freedom.
- The verdict is Welch's t-test on the repeats of the two cells; the p-values of every test in the
  report are corrected together with Holm-Bonferroni, so the report's family-wise error rate is 5%.
  A difference is reported only when its corrected p-value is below 0.05; otherwise "no difference
  within noise". Cells with fewer than two repeats get no test ("one repeat: no test").
- The leader flips between two measured input lengths when the sign of the difference of the two
  arms' values changes; the crossing is the linear interpolation of that difference, labelled as
  interpolated (nothing was measured there).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy import stats

from k3pipe.bench.repeats import RepeatStats
from k3pipe.report.collect import CellData, StudyData

__all__ = [
    "ALPHA",
    "TABLE_METRICS",
    "Analysis",
    "BoundCheck",
    "ClaimCheck",
    "Degradation",
    "Flip",
    "Metric",
    "PairVerdict",
    "Row",
    "analyse",
    "holm",
    "is_bursty",
    "ratio_interval",
    "welch",
]

ALPHA = 0.05
CLAIM_TOLERANCE = 0.02
"""A published derived figure 'follows' from the inputs when within 2% of what they give."""
BOUND_TOLERANCE = 0.001


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    unit: str
    higher_is_better: bool
    throughput: bool = False

    def better(self, a: float, b: float) -> bool:
        return a > b if self.higher_is_better else a < b


TABLE_METRICS: tuple[Metric, ...] = (
    Metric("duration_s", "end-to-end time", "s", higher_is_better=False),
    Metric("output_throughput_tps", "decode throughput, client", "tok/s", True, throughput=True),
    Metric("engine_generation_tps", "decode throughput, engine /metrics", "tok/s", True, throughput=True),
    Metric("steady_decode_tps", "steady decode throughput", "tok/s", True, throughput=True),
    Metric("ttft_ms_p50", "TTFT p50, first delta", "ms", higher_is_better=False),
    Metric("content_ttft_ms_p50", "TTFT p50, first content", "ms", higher_is_better=False),
    Metric("tpot_ms_p50", "TPOT p50", "ms", higher_is_better=False),
    Metric("itl_ms_p50", "ITL p50", "ms", higher_is_better=False),
)
_BY_KEY = {m.key: m for m in TABLE_METRICS}
_CLIENT_TIMING = ("tpot_ms_p50", "itl_ms_p50")
"""The client's per-token timing: not about decoding when the stream came in bursts (see
k3pipe.bench.summary.timing_note), so such a cell is shown as 'bursty' and not ranked."""


def is_bursty(cell: CellData, metric: Metric) -> bool:
    """Whether ``metric`` of ``cell`` is the client's per-token timing of a stream that came in
    bursts (shown as 'bursty', never ranked or judged)."""
    return metric.key in _CLIENT_TIMING and (cell.mean("client_timing_bursty") or 0) > 0


@dataclass
class PairVerdict:
    workload: str
    metric: str
    leader: str
    other: str
    ratio: float
    """The leader's advantage as a ratio >= 1 (other / leader for lower-is-better)."""
    ci: tuple[float, float] | None
    p_value: float | None
    p_adjusted: float | None = None

    @property
    def tested(self) -> bool:
        return self.p_value is not None

    @property
    def different(self) -> bool:
        return self.p_adjusted is not None and self.p_adjusted < ALPHA

    def text(self) -> str:
        pct = (self.ratio - 1) * 100
        ci = f" [{(self.ci[0] - 1) * 100:+.1f}%, {(self.ci[1] - 1) * 100:+.1f}%]" if self.ci else ""
        if not self.tested:
            return f"{self.leader} ahead of {self.other} by {pct:.1f}% (one repeat: no test)"
        if not self.different:
            return f"no difference within noise ({self.leader} {pct:+.1f}%{ci}, p_adj={self.p_adjusted:.2g})"
        return f"{self.leader} ahead of {self.other} by {pct:.1f}%{ci} (p_adj={self.p_adjusted:.2g})"


@dataclass
class Row:
    workload: str
    input_tokens: int
    metric: Metric
    cells: dict[str, RepeatStats]
    """arm -> the metric's statistics across that arm's repeats (arms that lack it are absent)."""
    leader: str | None = None
    ratio: float | None = None
    """The leader's advantage over the runner-up, >= 1."""
    verdicts: list[PairVerdict] = field(default_factory=list)
    bursty: set[str] = field(default_factory=set)
    """Arms whose client timing was bursty in this workload (their TPOT/ITL are not ranked)."""


@dataclass(frozen=True)
class Degradation:
    arm: str
    metric: Metric
    short: int
    long: int
    factor: float
    """How many times worse at ``long`` than at ``short`` (slow-down for throughput: short / long)."""


@dataclass(frozen=True)
class Flip:
    metric: Metric
    before: str
    after: str
    between: tuple[int, int]
    at_tokens: float
    """Interpolated: the input length where the two arms' values cross."""


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


@dataclass
class Analysis:
    rows: list[Row]
    degradations: list[Degradation]
    flips: list[Flip]
    bounds: list[BoundCheck]
    claims: list[ClaimCheck]
    tests: int
    """How many tests the Holm-Bonferroni correction covered."""


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm-Bonferroni adjusted p-values (monotone, capped at 1), in the input's order."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def ratio_interval(a: RepeatStats, b: RepeatStats) -> tuple[float, float] | None:
    """95% interval of mean_b / mean_a by the delta method on log(mean_b / mean_a)."""
    if a.n < 2 or b.n < 2 or a.std is None or b.std is None or a.mean <= 0 or b.mean <= 0:
        return None
    va = (a.std / a.mean) ** 2 / a.n
    vb = (b.std / b.mean) ** 2 / b.n
    se = math.sqrt(va + vb)
    if se == 0:
        r = b.mean / a.mean
        return (r, r)
    df = (va + vb) ** 2 / ((va**2) / (a.n - 1) + (vb**2) / (b.n - 1))
    half = float(stats.t.ppf(0.975, df)) * se
    centre = math.log(b.mean / a.mean)
    return (math.exp(centre - half), math.exp(centre + half))


def welch(a: Sequence[float], b: Sequence[float]) -> float | None:
    if len(a) < 2 or len(b) < 2:
        return None
    if np.std(a) == 0 and np.std(b) == 0:
        return 1.0 if np.mean(a) == np.mean(b) else 0.0
    return float(stats.ttest_ind(a, b, equal_var=False).pvalue)


def _verdict(
    workload: str, metric: Metric, arm_x: str, x: RepeatStats, arm_y: str, y: RepeatStats
) -> PairVerdict:
    lead_x = metric.better(x.mean, y.mean) or x.mean == y.mean
    leader, lead, other, trail = (arm_x, x, arm_y, y) if lead_x else (arm_y, y, arm_x, x)
    if metric.higher_is_better:
        ratio = lead.mean / trail.mean if trail.mean else math.inf
        ci = ratio_interval(trail, lead)
    else:
        ratio = trail.mean / lead.mean if lead.mean else math.inf
        ci = ratio_interval(lead, trail)
    return PairVerdict(workload, metric.key, leader, other, ratio, ci, welch(lead.values, trail.values))


def _rows(data: StudyData, arms: list[str]) -> list[Row]:
    rows = []
    for workload in data.workloads():
        cells = [c for a in arms if (c := data.cell(a, workload)) is not None]
        if not cells:
            continue
        for metric in TABLE_METRICS:
            bursty = {c.arm for c in cells if is_bursty(c, metric)}
            have = {
                c.arm: RepeatStats.of(c.values[metric.key])
                for c in cells
                if c.values.get(metric.key) and c.arm not in bursty
            }
            if not have and not bursty:
                continue
            row = Row(workload, cells[0].input_tokens, metric, have, bursty=bursty)
            # a zero (a figure that could not be measured) has no ratio: nothing is ranked against it
            if len(have) >= 2 and all(s.mean > 0 for s in have.values()):
                ranked = sorted(have, key=lambda a: have[a].mean, reverse=metric.higher_is_better)
                row.leader = ranked[0]
                best, second = have[ranked[0]].mean, have[ranked[1]].mean
                if metric.higher_is_better:
                    row.ratio = best / second if second else math.inf
                else:
                    row.ratio = second / best if best else math.inf
                names = list(have)
                for i, x in enumerate(names):
                    for y in names[i + 1 :]:
                        row.verdicts.append(_verdict(workload, metric, x, have[x], y, have[y]))
            rows.append(row)
    return rows


def _lengths(data: StudyData, arm: str) -> list[tuple[int, CellData]]:
    return sorted(((c.input_tokens, c) for c in data.cells if c.arm == arm), key=lambda t: t[0])


def _degradations(data: StudyData, arms: list[str]) -> list[Degradation]:
    out = []
    for arm in arms:
        by_length = _lengths(data, arm)
        if len(by_length) < 2:
            continue
        (short, a), (long, b) = by_length[0], by_length[-1]
        if short == long:
            continue
        for metric in TABLE_METRICS:
            va, vb = a.mean(metric.key), b.mean(metric.key)
            if not va or not vb:
                continue
            factor = va / vb if metric.higher_is_better else vb / va
            out.append(Degradation(arm, metric, short, long, factor))
    return out


def _flips(rows: list[Row], arms: list[str]) -> list[Flip]:
    out = []
    for metric in TABLE_METRICS:
        mine = sorted((r for r in rows if r.metric.key == metric.key), key=lambda r: r.input_tokens)
        for i, x in enumerate(arms):
            for y in arms[i + 1 :]:
                points = [
                    (r.input_tokens, r.cells[x].mean - r.cells[y].mean)
                    for r in mine
                    if x in r.cells and y in r.cells
                ]
                for (l1, d1), (l2, d2) in itertools.pairwise(points):
                    if l1 == l2 or d1 == 0 or d2 == 0 or (d1 > 0) == (d2 > 0):
                        continue
                    at = l1 + (l2 - l1) * d1 / (d1 - d2)
                    x_leads_first = (d1 > 0) == metric.higher_is_better
                    before, after = (x, y) if x_leads_first else (y, x)
                    out.append(Flip(metric, before, after, (l1, l2), at))
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
                    "no tokens / wall ceiling: a rate over the time no request was in prefill",
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
                arm.name, "(all workloads)", "decode throughput, engine log (mean)",
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


def analyse(data: StudyData, claims: Iterable[dict[str, Any]] = ()) -> Analysis:
    """The report's numbers. ``claims``: figures published for the study (e.g. field-notes.md's
    ratios), each checked against what the recorded values give (see the module docstring)."""
    claims = list(claims)
    arms = [a.name for a in data.arms if any(c.arm == a.name for c in data.cells)]
    rows = _rows(data, arms)
    verdicts = [v for r in rows for v in r.verdicts if v.p_value is not None]
    for v, adjusted in zip(
        verdicts, holm([v.p_value for v in verdicts if v.p_value is not None]), strict=True
    ):
        v.p_adjusted = adjusted
    degradations = _degradations(data, arms)
    return Analysis(
        rows=rows,
        degradations=degradations,
        flips=_flips(rows, arms),
        bounds=_bounds(data, arms, claims),
        claims=_claims(data, rows, degradations, claims),
        tests=len(verdicts),
    )
