"""The report as a document: sections of paragraphs and tables, written out as Markdown and as one
self-contained HTML page (styles inline, figures embedded as data URIs)."""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from k3pipe.bench.replay import FIDELITY_BOUNDS, fidelity_problems
from k3pipe.bench.structured import StructuredRecord, read_structured
from k3pipe.report.analysis import Analysis, NoiseRow, Row
from k3pipe.report.collect import CellData, StudyData
from k3pipe.report.gate import ArmAnswers
from k3pipe.schema.specs import AnswersSpec
from k3pipe.verdicts import stats
from k3pipe.verdicts.capacity import SEARCHES_FOR_INTERVAL

__all__ = ["Document", "Section", "Table", "build_document", "cell_text", "num", "to_html", "to_markdown"]


@dataclass
class Table:
    headers: list[str]
    rows: list[list[str]]
    flagged: set[int] = field(default_factory=set)
    """Row indexes to highlight (a figure above its physical ceiling, a claim that does not follow)."""


Block = str | Table


@dataclass
class Section:
    title: str
    blocks: Sequence[Block]


@dataclass
class Document:
    title: str
    sections: list[Section]
    figures: dict[str, str] = field(default_factory=dict)
    """File name -> caption."""


def num(v: float | None, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if math.isinf(v):
        return "inf"
    if 0 < abs(v) < 1 and digits == 1:
        # a figure below one (joules or dollars per token, a rate of 0.05 req/s): two significant digits
        return f"{v:.2g}" if abs(v) >= 1e-4 else f"{v:.1e}"
    return f"{v:,.{digits}f}"


PLAN_EFFECT = 0.10
"""The difference the noise section plans for: how many launches would find it."""


class _Interval(Protocol):
    @property
    def mean(self) -> float: ...
    @property
    def ci_low(self) -> float | None: ...
    @property
    def ci_high(self) -> float | None: ...


def _cell_of(row: Row, arm: str) -> str:
    """The arm's cell in a table row: 'bursty', '0' (every value exactly 0), or its mean [interval]."""
    if arm in row.bursty:
        return "bursty"
    if arm in row.zeros:
        return "0"
    return cell_text(row.cells.get(arm))


def cell_text(s: _Interval | None) -> str:
    if s is None:
        return "-"
    if s.ci_low is None or s.ci_high is None:
        return num(s.mean)
    return f"{num(s.mean)} [{num(s.ci_low)}, {num(s.ci_high)}]"


def _direction(higher: bool) -> str:
    return "higher is better" if higher else "lower is better"


def _ranking(row: Row, baseline: str | None, gated: Sequence[str] = ()) -> str:
    """Every ranked arm of a decision row, best first, each with its verdict against the best (and
    against the baseline, when there is one and it is not the best); a best arm whose answers diverge
    beyond the floor (``gated``) is said to be so."""
    if not row.ranking:
        return "-"
    best = row.ranking[0]
    unit = row.metric.unit
    mark = "best; its answers differ: not recommended" if best in gated else "best"
    parts = [f"{best} {num(row.cells[best].mean)} {unit} ({mark})"]
    for arm in row.ranking[1:]:
        pair = row.pair(best, arm)
        said = pair.against(best) if pair is not None else "not compared"
        if baseline and baseline not in (best, arm) and baseline in row.cells:
            base = row.pair(baseline, arm)
            if base is not None:
                said += f"; against the baseline {baseline}: {base.against(baseline)}"
        parts.append(f"{arm} {num(row.cells[arm].mean)} {unit}: {said}")
    if baseline and baseline in row.ranking[1:]:
        pass  # the baseline's own line already says how it stands against the best
    return "; ".join(parts)


def _answer(data: StudyData, analysis: Analysis) -> list[Block]:
    """Per workload and decision figure: every arm ranked with its verdict against the best."""
    lines: list[Block] = []
    if analysis.hardware_refusal:
        return [f"**{analysis.hardware_refusal}**"]
    decision = [r for r in analysis.rows if r.decision]
    if not decision:
        return lines
    shapes = {c.workload: c for c in data.cells}
    for workload in dict.fromkeys(r.workload for r in decision):
        cell = shapes[workload]
        head = f"**{workload}** ({cell.input_tokens:,} in / {cell.output_tokens:,} out, {cell.load_label})"
        for r in (r for r in decision if r.workload == workload):
            if len(r.ranking) < 2:
                why = "bursty client timing" if r.bursty else "fewer than two arms measured it"
                lines.append(f"{head}, {r.metric.label}: not ranked ({why}).")
                continue
            gated = analysis.answers.gated if analysis.answers else ()
            lines.append(f"{head}, {r.metric.label}: {_ranking(r, analysis.baseline, gated)}.")
    for f in analysis.flips:
        if f.metric.key not in analysis.decision_metrics:
            continue
        if f.claimed:
            lines.append(
                f"**{f.metric.label}** ({f.shape}): the lead flips from {f.before} to {f.after} at about "
                f"{f.at_tokens:,.0f} input tokens (interpolated)."
            )
        else:
            lines.append(
                f"**{f.metric.label}** ({f.shape}): no flip is claimed: {f.before} is ahead at "
                f"{f.between[0]:,} and {f.after} at {f.between[1]:,} input tokens, but at "
                + " and ".join(f"{n:,}" for n in f.unseen)
                + " the difference is not detected."
            )
    lines += _answers_gate(analysis)
    unknown = analysis.restart_unknown
    if unknown:
        lines.append(
            f"**Cannot tell for {', '.join(unknown)}**: launched once, and no earlier study on this node "
            "kept the restart noise of their configuration class, so their repeats' spread holds none of the "
            "noise of restarting the engine and no verdict is made on them ('cannot tell'). Launch each arm "
            "twice or more (`launches: 2`, the default where arms are compared); a study that does keeps its "
            f"restart noise for later ones launched once (for `decision.prior_days` days)."
        )
    priors = sorted({c.estimate.prior.source for r in analysis.rows if r.decision for c in r.cells.values()
                     if c.estimate.prior is not None})  # fmt: skip
    if priors:
        lines.append(
            "Arms launched once were judged with the restart noise earlier studies measured for their "
            "configuration class on this node (the spread of their launch means, a conservative stand-in): "
            + "; ".join(priors)
            + "."
        )
    lines.extend(_cut_launches(data))
    unreset = _unreset(data)
    if unreset:
        lines.append(
            "**The prefix cache was not emptied** before "
            + "; ".join(f"{arm}'s {', '.join(w)}" for arm, w in unreset.items())
            + ": a ladder point or probe served the prompts an earlier one had cached may show a "
            "TTFT, and a capacity, better than the load alone gives. The engine refused or offers no "
            'way (vLLM serves `/reset_prefix_cache` only with `VLLM_SERVER_DEV_MODE: "1"` in the arm\'s '
            "`engine.env`; an external endpoint or gateway may not pass it on); the MLflow runs' "
            "`k3pipe.prefix_cache_reset` tag says which."
        )
    return lines


def _leads(analysis: Analysis, arm: str) -> list[str]:
    """The decision figures ``arm`` is detected best on ('TTFT p50 on in256-out64')."""
    out = []
    for r in analysis.rows:
        if r.decision and len(r.ranking) >= 2 and r.ranking[0] == arm:
            pair = r.pair(arm, r.ranking[1])
            if pair is not None and pair.different:
                out.append(f"{r.metric.label} on {r.workload}")
    return out


def _answers_gate(analysis: Analysis) -> list[Block]:
    """The answer's lines on answers: an arm detected faster whose answers diverge beyond the floor
    ('faster, answers differ': not the recommendation unless decision.accept_divergence), any other
    diverging arm, and a lossless setting that changed tokens."""
    answers = analysis.answers
    if answers is None:
        return []
    lines: list[Block] = []
    for row in answers.arms:
        if row.diverges:
            assert row.verdict is not None
            leads = _leads(analysis, row.arm)
            said = f"its answers against {answers.reference}'s: {row.verdict.describe()}"
            if leads and not answers.accept_divergence:
                lines.append(
                    f"**{row.arm}: faster, answers differ.** It is detected best on {', '.join(leads)}, but "
                    f"{said}: it is not the recommendation. If that difference is acceptable, say so with "
                    "`decision.accept_divergence: true`."
                )
            elif leads:
                lines.append(
                    f"**{row.arm}: faster, answers differ** (accepted: `decision.accept_divergence`). It is "
                    f"detected best on {', '.join(leads)}; {said}."
                )
            else:
                lines.append(f"**{row.arm}'s answers differ**: {said}.")
        if row.differences:
            lines.append(
                f"**{row.arm} changed greedy tokens**: {row.lossless} must leave them as "
                f"{row.twin or answers.reference}'s, and {_differences(row)}."
            )
    for score in answers.scores:
        if score.verdict is not None and score.verdict.outcome == "worse":
            leads = _leads(analysis, score.arm)
            said = f"its task score is {score.verdict.describe()} (against {answers.reference})"
            if leads and not answers.accept_divergence:
                lines.append(
                    f"**{score.arm}: faster, answers differ.** It is detected best on {', '.join(leads)}, "
                    f"but {said}: it is not the recommendation (`decision.accept_divergence: true` accepts "
                    "it)."
                )
            else:
                lines.append(f"**{score.arm} scores worse**: {said}.")
    for arm, record in answers.structured.items():
        if record.failures:
            lines.append(f"**{arm}'s structured output failed**: {_structured_text(record)}.")
    return lines


def _structured_text(record: StructuredRecord) -> str:
    """'3 of 16 answers (188 per 1,000 [40, 456]): arguments not JSON 2, reasoning in content 1'."""
    rate = record.per_1000()
    if rate is None:
        return "no answer checked"
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(record.kinds().items(), key=lambda kv: -kv[1]))
    return (
        f"{record.failures} of {len(record.calls)} answers ({rate[0]:.0f} per 1,000 [{rate[1]:.0f}, "
        f"{rate[2]:.0f}])" + (f": {kinds}" if kinds else "")
    )


def _differences(row: ArmAnswers) -> str:
    """'2 prompt(s) differ where the floor pair agreed: p002 at token 3, p005 at token 3'."""
    diffs = row.differences or []
    shown = ", ".join(f"{d.prompt_id} at token {d.position}" for d in diffs[:8])
    more = f" and {len(diffs) - 8} more" if len(diffs) > 8 else ""
    return f"{len(diffs)} prompt(s) differ where the floor pair agreed: {shown}{more}"


PROBE_SHARE = 0.10
"""The share of a study's wall time the output probe is meant to stay under (said when it does not)."""


def _answers_section(data: StudyData, analysis: Analysis) -> Section | None:
    """What the output probe found: the floor, each arm against the reference, lossless settings,
    the probe's cost (docs/measurement.md, 'Answers')."""
    answers = analysis.answers
    if answers is None:
        return None
    spec = {**AnswersSpec().model_dump(), **(data.answers or {})}
    scored = "the continuation" if spec["score"] else "no continuation (score: false)"
    blocks: list[Block] = [
        f"The output probe: {spec['prompts']} prompts of {spec['prompt_tokens']} random tokens (seed "
        f"{spec['seed']}), answered greedily to {spec['output_tokens']} tokens, and {scored} of "
        f"{spec['continuation_tokens']} tokens scored teacher-forced; one request at a time after each "
        "launch's timed repeats, the same for every arm. Reference: "
        + (f"{answers.reference} launch {answers.reference_launch}." if answers.reference_launch
           else f"{answers.reference}, which answered no probe.")
    ]  # fmt: skip
    if answers.floor is not None:
        blocks.append(f"The floor ({answers.floor_label}): {answers.floor.describe()}.")
    else:
        blocks.append(
            "No floor: the reference answered the probe on one launch only and has no A/A copy, so no arm's "
            "answers are judged (launch the reference twice, the default where arms are compared, or set "
            "`decision.calibration`)."
        )
    table = Table(["arm", "launch", "against the reference", "against the floor", "lossless setting"], [])
    for row in answers.arms:
        lossless = "-"
        if row.lossless:
            twin = row.twin or "no plain twin (other settings differ)"
            lossless = f"{row.lossless} vs {twin}: " + (
                "identical where the floor agreed" if row.differences == [] else
                _differences(row) if row.differences else "not checked"
            )  # fmt: skip
        table.rows.append(
            [
                row.arm,
                str(row.launch) if row.launch is not None else "-",
                row.agreement.describe() if row.agreement is not None else "-",
                row.verdict.describe() if row.verdict is not None else f"cannot tell: {row.why_not}",
                lossless,
            ]
        )
    blocks.append(table)
    if answers.structured:
        parsed = Table(["arm", "parsers", "tool-calling requests", "tool calls", "failures"], [])
        for arm, record in answers.structured.items():
            which = " and ".join(n for n, on in (("tool-call", record.tool_parser),
                                                 ("reasoning", record.reasoning_parser)) if on)  # fmt: skip
            streamed = sum(c.stream for c in record.calls)
            parsed.rows.append(
                [arm, which, f"{len(record.calls)} ({streamed} streamed)",
                 str(sum(c.tool_calls for c in record.calls)), _structured_text(record)]
            )  # fmt: skip
        blocks.append(
            "Structured output, for the arms with a tool-call or reasoning parser: tool-calling chat "
            "requests (tool_choice auto, every other one streamed), each answer checked: every tool call "
            "names an offered tool and its arguments parse as JSON within the tool's schema, no "
            "tool-call markup is left in the content, and with a reasoning parser no reasoning markup "
            "(k3pipe.bench.structured). Failures per 1,000 answers with their 95% interval."
        )
        blocks.append(parsed)
    if answers.scores:
        scores = Table(["arm", "questions", "right", "accuracy (95% CI)", "against the reference"], [])
        for s in answers.scores:
            low, high = s.interval()
            against = "reference" if s.arm == answers.reference else (
                s.verdict.describe() if s.verdict is not None else f"cannot tell: {s.why_not}"
            )  # fmt: skip
            scores.rows.append(
                [s.arm, str(s.questions), str(s.right),
                 f"{s.right / s.questions:.1%} [{low:.1%}, {high:.1%}]", against]
            )  # fmt: skip
        path = ((data.answers or {}).get("accuracy") or {}).get("path", "?")
        blocks.append(
            f"Task score: the questions of `{path}` on each arm's first launch, greedy; each arm against "
            "the reference on the same questions (the paired difference in points with its interval): "
            f"worse, better, equivalent within {answers.accuracy_margin:g} points, or cannot tell."
        )
        blocks.append(scores)
    blocks.append(
        f"Each arm is judged at {answers.alpha:.3g} (the decision's alpha over the arms judged), margin "
        f"{answers.margin:g} nats/token: 'diverges beyond the floor' when its per-prompt log-probability "
        "difference from the reference exceeds the floor's by more than the margin (Student's t over the "
        "prompts; greedy tokens alone: McNemar's exact test, which can detect a divergence but never rule "
        "one out)."
    )
    wall = data.metrics.get("study.wall_s")
    share = f": {answers.probe_seconds / wall:.1%} of the study's wall time ({num(wall)} s)" if wall else ""
    blocks.append(f"The probe took {answers.probe_seconds:.1f} s over all launches{share}.")
    if wall and answers.probe_seconds > PROBE_SHARE * wall:
        blocks.append(
            f"That is more than {PROBE_SHARE:.0%}: the workloads are short beside it. Fewer or shorter probe "
            "prompts (`answers.prompts`, `answers.output_tokens`) cost less, and test less."
        )
    for error in answers.errors:
        blocks.append(f"**The probe stopped short** on {error}")
    return Section("Answers", blocks)


def _cut_launches(data: StudyData) -> list[Block]:
    """The launches whose repeats are not whole (a deadline, an interrupt, the engine lost): named with
    what they completed, and said to be in no figure (collect.LaunchPart)."""
    cut = [c for c in data.cells if c.cut]
    if not cut:
        return []
    lines: list[Block] = []
    for cell in cut:
        why = "; ".join(f"launch {p.launch} ({p.status}): {', '.join(p.cut) or 'not all repeats ran'}"
                        for p in cell.cut)  # fmt: skip
        lines.append(
            f"**{cell.arm}, {cell.workload}: {cell.launches_text()} repeats** (of {cell.parts[0].planned} "
            f"per launch): {why}. A launch whose repeats are not whole enters no figure, verdict, noise "
            "or calibration here; what it measured stays in its MLflow run."
        )
    missing = _unreached(data)
    if missing:
        lines.append("Not reached by a launch cut short: " + "; ".join(missing) + ".")
    return lines


def _unreached(data: StudyData) -> list[str]:
    """'a#3: w2, w3' for each launch that recorded fewer workloads than its arm's other launches did."""
    out = []
    for arm in data.arms:
        if arm.status == "FINISHED":
            continue
        mine = [c for c in data.cells if c.arm == arm.name]
        seen = {c.workload for c in mine for p in c.parts if p.launch == arm.launch}
        lacking = [c.workload for c in mine if c.workload not in seen]
        if lacking:
            out.append(f"{data.label(arm)}: {', '.join(lacking)}")
    return out


def _noise_findings(analysis: Analysis, arm: str) -> list[str]:
    return [
        f"[noise] {n.workload}, {n.metric.label}: its repeats varied {_cv(n.components.within_cv)} "
        f"({n.noisier:.1f}x the other arms' variance); " + "; ".join(n.causes)
        for n in analysis.arm_noise
        if n.arm == arm and n.noisier and n.components is not None
    ]


def _warmup_findings(analysis: Analysis, arm: str) -> list[str]:
    out = []
    for w in analysis.warmups:
        if w.arm != arm:
            continue
        said = (
            f"[warm-up] {w.unsettled} of {w.of} repeats began before the warm-up settled"
            + (f" ({', '.join(w.workloads)})" if w.workloads else "")
            + (f", and {w.priming} priming launch repeat(s)" if w.priming else "")
            + ": the engine's rate was still changing, so those repeats measure it on the way up"
        )
        if w.effects:
            said += " (" + "; ".join(w.effects) + ")"
        out.append(said + "; give the workload `warmup: steady` with more `warmup_requests`")
    return out


def _unreset(data: StudyData) -> dict[str, list[str]]:
    """Per arm, the ladder points and capacity searches measured without emptying the prefix cache
    that k3pipe was to empty (not those whose workload turned the reset off)."""
    out: dict[str, list[str]] = {}
    order = {w: i for i, w in enumerate(data.workloads())}
    for cell in sorted(data.cells, key=lambda c: order.get(c.workload, len(order))):
        if cell.prefix_cache_reset == "0":
            out.setdefault(cell.arm, []).append(cell.workload)
    return out


def _noise_section(data: StudyData, analysis: Analysis) -> Section | None:
    if not analysis.noise:
        return None
    table = Table(
        ["workload", "metric", "launches x repeats per arm", "restart noise (CV)", "repeat noise (CV)",
         "restart share", "df (launches, repeats)", "smallest difference it could see",
         f"launches per arm to see {PLAN_EFFECT:.0%}"],
        [],
    )  # fmt: skip
    for n in analysis.noise:
        table.rows.append(_noise_row(n, analysis))
    return Section(
        "Noise: restart and repeat",
        [
            "Each decision figure's variance split into the engine's restarts (between launches) and its "
            "repeats (within a launch), on the log scale, pooled over the arms (one-way ANOVA per arm); "
            "restart noise needs an arm launched twice or more. 'Smallest difference it could see': the "
            "smallest true "
            f"difference a comparison of this workload would have found with {analysis.design.power:.0%} "
            f"probability at the decision's level (alpha {analysis.design.alpha:g} over "
            f"{analysis.design.tests} comparison(s)); the range spans the workload's pairs of arms. The "
            "last column: how many launches per arm (at this many repeats a launch) a pair would need to "
            f"find a "
            f"{PLAN_EFFECT:.0%} difference with that probability at this noise and level; '-' where restart "
            "noise was not measured.",
            table,
            *_own_noise(analysis),
            *_opening_wave(data),
        ],
    )


def _cv(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _own_noise(analysis: Analysis) -> list[Block]:
    """Each arm's own noise (a pooled figure hides an arm much noisier than the rest), and each pair's:
    what it could see and the launches a 10% difference would need at the two arms' noise."""
    if not analysis.arm_noise:
        return []
    arms = Table(
        ["workload", "metric", "arm", "launches x repeats", "restart noise (CV)", "repeat noise (CV)",
         "much noisier than the rest"],
        [],
    )  # fmt: skip
    for n in analysis.arm_noise:
        c = n.components
        arms.rows.append(
            [n.workload, n.metric.label, n.arm, f"{n.launches} x {n.repeats // max(1, n.launches)}",
             _cv(c.between_cv) if c is not None and c.df_between > 0 else "not measured",
             _cv(c.within_cv) if c is not None else "-",
             f"yes: {n.noisier:.1f}x the others' variance; " + "; ".join(n.causes) if n.noisier else "no"]
        )  # fmt: skip
        if n.noisier:
            arms.flagged.add(len(arms.rows) - 1)
    pairs = Table(
        ["workload", "metric", "pair", "restart noise (CV)", "repeat noise (CV)",
         "smallest difference it could see", f"launches per arm to see {PLAN_EFFECT:.0%}"],
        [],
    )  # fmt: skip
    for p in analysis.pair_noise:
        c = p.components
        measured = c is not None and c.df_between > 0
        needed = str(p.launches_needed) if p.launches_needed is not None else "more than 50"
        pairs.rows.append(
            [p.workload, p.metric.label, f"{p.a} / {p.b}",
             _cv(c.between_cv) if measured and c is not None else "not measured",
             _cv(c.within_cv) if c is not None else "-",
             stats.detectable(p.mde) if p.mde is not None else "-",
             needed if measured else "-"]
        )  # fmt: skip
    blocks: list[Block] = [
        "Each arm's own noise: an arm whose repeats vary much more than the others' (an F test, p < 0.01, "
        "at least 4 times the others' variance) is flagged, with what k3pipe sees that would make it so.",
        arms,
    ]
    if pairs.rows:
        blocks += [
            "Each pair's own: the smallest difference its comparison could see, and the launches per arm a "
            f"{PLAN_EFFECT:.0%} difference would need at the two arms' noise.",
            pairs,
        ]
    return blocks


def _opening_wave(data: StudyData) -> list[Block]:
    """The measured phase of a fixed-concurrency workload opens with `concurrency` requests at once:
    how much their TTFT differs from the rest's, per workload (the range over arms and repeats)."""
    lines: list[Block] = []
    for workload in data.workloads():
        cells = [c for c in data.cells if c.workload == workload]
        first = data.cell_of(workload)
        sent = [r for c in cells for r in c.values.get("requests", [])]
        if first.load == "concurrency" and first.capacity is None and sent and max(sent) <= first.concurrency:
            lines.append(
                f"{workload}: all {max(sent):.0f} measured requests started at once ({first.concurrency} "
                "streams): one wave, so its figures are a burst's (the prefills together, then a batch that "
                "only drains), not the engine's steady at that load; two waves or more of num_requests "
                "measure that."
            )
            continue
        ratios = [r for c in cells for r in c.values.get("first_wave_ttft_ratio", [])]
        if ratios:
            lines.append(
                f"{workload}: the measured phase opens with {data.cell_of(workload).concurrency} requests at "
                f"once; that first wave's TTFT p50 was {min(ratios):.2f}x to {max(ratios):.2f}x the rest's "
                "(first_wave_ttft_ratio, over arms and repeats). TTFT p50 above covers both."
            )
    return lines


def _noise_row(n: NoiseRow, analysis: Analysis) -> list[str]:
    shape = ", ".join(f"{a} {n.launches[a]}x{n.repeats[a] // max(1, n.launches[a])}" for a in n.launches)
    c = n.components
    if c is None:
        cells = ["-", "-", "-", "-"]
    else:
        measured = c.df_between > 0
        cells = [
            f"{c.between_cv:.1%}" if measured else "not measured",
            f"{c.within_cv:.1%}",
            f"{c.between_share:.0%}" if measured and c.between_share is not None else "-",
            f"{c.df_between}, {c.df_within}",
        ]
    mde = "-"
    if n.mde is not None:
        lo, hi = (stats.detectable(x) for x in n.mde)
        mde = lo if lo == hi else f"{lo} to {hi}"
    plan = "-"
    if c is not None and c.df_between > 0:
        per_launch = round(sum(n.repeats.values()) / max(1, sum(n.launches.values())))
        needed = stats.launches_needed(
            PLAN_EFFECT, c.between_cv, c.within_cv, max(1, per_launch), analysis.design
        )
        plan = str(needed) if needed is not None else "more than 50"
    return [n.workload, n.metric.label, shape, *cells, mde, plan]


def _calibration_section(data: StudyData, analysis: Analysis) -> Section | None:
    if analysis.calibration is None:
        return None
    base, copy = analysis.calibration
    rows = [r for r in analysis.rows if r.calibration is not None]
    if not rows:
        return Section("Calibration: A/A", [f"{base} and its copy {copy} share no measured cell."])
    table = Table(["workload", "metric", base, copy, "verdict"], [])
    reach: float | None = None
    untested: list[float] = []
    alarms = []
    for r in rows:
        v = r.calibration
        assert v is not None
        table.rows.append(
            [r.workload, r.metric.label, cell_text(r.cells.get(base)), cell_text(r.cells.get(copy)), v.text()]
        )
        if v.ci is not None:
            reach = max(reach or 0.0, v.ci[1] - 1, 1 - 1 / v.ci[0] if v.ci[0] > 0 else 0.0)
        elif not v.tested:
            untested.append(v.ratio - 1)
        if v.different:
            alarms.append(f"{r.metric.label} in {r.workload}")
            table.flagged.add(len(table.rows) - 1)
    design = analysis.calibration_design
    counts = {
        arm: "; ".join(f"{c.workload} {c.launches_text()}" for c in data.cells if c.arm == arm)
        for arm in (base, copy)
    }
    times = max((c.launches for c in data.cells if c.arm == base), default=1)
    launched = f": {times} launches each, interleaved" if times > 1 else ""
    if any(c.cut for c in data.cells if c.arm in (base, copy)):
        launched = (
            f"; repeats per launch {base}: {counts[base]}, {copy}: {counts[copy]} (a launch cut short is "
            "in no figure)"
        )
    blocks: list[Block] = [
        f"The baseline {base} run as two arms, {base} and {copy} (identical configurations, each "
        f"launched like every arm{launched}), compared as any pair is, at alpha "
        f"{design.alpha if design else 0:g} over {design.tests if design else 0} comparison(s) of their "
        f"own. {_aa_reach_text(reach, untested)}",
        table,
    ]
    if alarms:
        blocks.append(
            "**The A/A found a difference** (" + "; ".join(alarms) + "): two launches of one configuration "
            "differ by more than the noise model allows (a drift over time, an engine or node state that "
            "persists over a launch). Treat the study's verdicts of that size as unproven."
        )
    return Section("Calibration: A/A", blocks)


def _aa_reach_text(reach: float | None, untested: list[float]) -> str:
    """What the A/A says of the noise between launches: its intervals' reach where it was tested; where
    every cell holds single values, no interval at all, only the one difference it happened to show."""
    if reach is not None:
        return (
            f"Their intervals reach +-{reach:.1%}: a difference between arms smaller than that is within "
            "what launching the same configuration again does."
        )
    seen = f" (here {max(untested):.1%})" if untested else ""
    return (
        "No A/A cell was tested (each arm launched once: a single value, or restart noise unknown): the "
        f"copy shows one draw of what launching the same configuration again does{seen}, not its bounds. "
        "Launch each arm more than once (`launches: 2`) for an interval."
    )


def _beside_reference(data: StudyData, analysis: Analysis) -> Section | None:
    """The experiment's published table (its 'reference') beside this study's cells: per workload and
    metric the arms' means with their intervals, then the published arms' figures, as they were given
    (nothing published is tested against these runs: other hardware, other model)."""
    reference = data.reference
    if not reference:
        return None
    figures = [f for f in reference.get("figures", []) if isinstance(f, dict)]
    published = list(dict.fromkeys(str(f.get("arm")) for f in figures))
    arms = data.arm_names  # each arm once, whatever its launches (data.arms holds every launch)
    table = Table(["workload", "input tokens", "metric", *arms, "leader", *published], [])
    for key in dict.fromkeys(str(f.get("metric")) for f in figures):
        rows = sorted((r for r in analysis.rows if r.metric.key == key), key=lambda r: r.input_tokens)
        for r in rows:
            given = {str(f.get("arm")): f.get("value") for f in figures
                     if f.get("metric") == key and f.get("workload") == r.workload}  # fmt: skip
            if not given:
                continue
            table.rows.append(
                [r.workload, f"{r.input_tokens:,}", f"{r.metric.label} ({r.metric.unit})",
                 *(_cell_of(r, a) for a in arms),
                 r.leader or "-", *(num(given[p]) if given.get(p) is not None else "-" for p in published)]
            )  # fmt: skip
    blocks: list[Block] = [
        f"Published figures from {reference.get('source', 'the reference')} (the last columns, as given), "
        "beside this study's means with their 95% intervals.",
        table,
    ]
    blocks.extend(str(n) for n in reference.get("notes", []))
    return Section("Beside the published table", blocks)


def build_document(data: StudyData, analysis: Analysis) -> Document:
    arms = data.arm_names
    failed = [a for a in data.arms if a.status != "FINISHED"]
    launched = ", ".join(
        f"{name} ({runs[0].engine}, "
        + (f"{len(runs)} launches: " + "/".join(r.status for r in runs) if len(runs) > 1 else runs[0].status)
        + ")"
        for name in arms
        if (runs := data.launches_of(name))
    )
    head = [f"Study run `{data.run_id}` of experiment **{data.name}** ({data.status}); arms: {launched}."]
    if data.resumed:
        kept = (
            f", keeping the {data.kept_workloads} workload(s) they had finished cleanly (a workload's "
            "repeats always share one engine start)"
            if data.kept_workloads
            else ""
        )
        head.append(
            f"Resumed {data.resumed} time(s) (`k3pipe study --resume`): launches that had finished were "
            f"kept; {data.superseded} launch(es) that had not ran again on a new engine start{kept} "
            "(their earlier runs are in MLflow, tagged k3pipe.superseded; what else they measured is in "
            "no figure here)."
        )
    for a in failed:
        head.append(
            f"**Arm {data.label(a)} did not finish ({a.status})**: {a.error or 'see its MLflow run'} "
            f"(run `{a.run_id}`); the workloads it completed with whole repeats count below, the rest "
            "of it is named in the answer and in no figure."
        )
    replay = _replay_section(data)
    if replay is not None:
        head.extend(_replay_warnings(data))
    sections = [Section("Study", head)]
    search = _search_section(data)
    if search is not None:
        sections.append(search)
    answer = _answer(data, analysis)
    if answer:
        sections.append(Section("The answer", answer))

    results = Table(["workload", "input tokens", "metric", *arms, "leader", "ratio", "verdict"], [])
    for r in analysis.rows:
        if r.decision:
            best = r.ranking[0] if r.ranking else None
            verdicts = (
                "; ".join(f"{a}: {p.against(best)}" for a in r.ranking[1:] if best and (p := r.pair(best, a)))
                or "-"
            )
        else:
            verdicts = "descriptive (not a decision metric): no verdict"
        kind = "decision" if r.decision else "descriptive"
        results.rows.append(
            [
                r.workload,
                f"{r.input_tokens:,}",
                f"{r.metric.label} ({r.metric.unit}, {_direction(r.metric.higher_is_better)}; {kind})",
                *(_cell_of(r, a) for a in arms),
                r.leader or "-",
                f"{r.ratio:.2f}x" if r.ratio is not None else "-",
                verdicts,
            ]
        )
    sections.append(
        Section(
            "Results",
            [
                "Each cell: the geometric mean of the arm's launch means (a launch's mean over its repeats), "
                "with its 95% interval in brackets (from the spread between launches when the arm was "
                "launched twice or more, else between the one launch's repeats plus the restart noise an "
                "earlier study kept for its class, where one did; without that, the interval holds no "
                "restart noise and understates the cell's). Ratio: the leader over the "
                "runner-up. Verdicts, on decision metrics only: each arm against the best, at the "
                f"decision's level ({analysis.design.confidence:.2%} intervals; see 'How the numbers are "
                "made'). 'bursty': the client's stream came in bursts, so its TPOT and ITL timed delivery, "
                "not decoding (the engine's own figures are in the arm's MLflow run); such a cell is not "
                "ranked.",
                results,
                *filter(None, [_gpu_basis(data), _rough_energy(data)]),
            ],
        )
    )
    for extra in (
        replay,
        _answers_section(data, analysis),
        _calibration_section(data, analysis),
        _noise_section(data, analysis),
        _capacity_section(data, analysis),
    ):
        if extra is not None:
            sections.append(extra)

    if analysis.degradations:
        deg = Table(["metric", "workloads share", "from -> to (input tokens)", *arms], [])
        keys = list(dict.fromkeys((d.metric.label, d.shape, d.short, d.long) for d in analysis.degradations))
        for label, shape, short, long in keys:
            found = {
                d.arm: d
                for d in analysis.degradations
                if (d.metric.label, d.shape, d.short, d.long) == (label, shape, short, long)
            }
            deg.rows.append(
                [label, shape, f"{short:,} -> {long:,}",
                 *(f"{found[a].factor:.2f}x" if a in found else "-" for a in arms)]
            )  # fmt: skip
        sections.append(
            Section(
                "Degradation with input length",
                ["How many times worse each arm is at the longest input than at the shortest "
                 "(throughput: the slow-down, short / long), between workloads that differ in input "
                 "length alone (the second column: what they share); geometric means.", deg],
            )
        )  # fmt: skip
    else:
        sections.append(
            Section(
                "Degradation with input length",
                ["No two workloads differ in input length alone (same output length, load and dataset), "
                 "so no degradation with input length is computed."],
            )
        )  # fmt: skip

    beside = _beside_reference(data, analysis)
    if beside is not None:
        sections.append(beside)

    flips = [
        (
            f"{f.metric.label} ({f.shape}): {f.before} leads up to about {f.at_tokens:,.0f} input tokens, "
            f"{f.after} beyond (interpolated between the measured {f.between[0]:,} and {f.between[1]:,})"
            + ("" if f.decision else " (descriptive: no verdict on this metric)")
        )
        if not f.unseen
        else (
            f"{f.metric.label} ({f.shape}): not a flip the data shows: {f.before} is ahead at "
            f"{f.between[0]:,} and {f.after} at {f.between[1]:,} input tokens (the means cross at about "
            f"{f.at_tokens:,.0f}, interpolated), but at "
            + " and ".join(f"{n:,}" for n in f.unseen)
            + " the verdict is not a detected difference"
        )
        for f in analysis.flips
    ]
    sections.append(
        Section(
            "Where the leader flips",
            flips or ["The leader does not change between the measured input lengths."],
        )
    )

    ladders = _ladder_runs(data)
    if analysis.pareto:
        arms = list(dict.fromkeys(pt.arm for pt in analysis.pareto))
        gpus = "over each arm's own GPUs: " + "; ".join(f"{a}: {data.per_gpu(a)[1]}" for a in arms)
        front = Table(
            ["ladder", "arm", "load", "tok/s per user", "output tok/s per GPU", "on the arm's front"], []
        )
        for pt in analysis.pareto:
            front.rows.append(
                [pt.ladder, pt.arm, pt.workload.rsplit("@", 1)[-1], num(pt.per_user_tps),
                 num(pt.per_gpu_tps), "yes" if pt.on_front else "no"]
            )  # fmt: skip
        sections.append(
            Section(
                "Pareto fronts",
                [f"Each ladder point: output tokens per second one stream receives (1000 / TPOT p50) "
                 f"against output tokens per second per GPU ({gpus}); a point is on its arm's front when "
                 "no other point of that arm's ladder gives more of both. Means over repeats and "
                 "launches, no intervals: the verdicts on each point are in the results above.", front,
                 *ladders],
            )
        )  # fmt: skip
    elif ladders:
        sections.append(Section("Ladders", ladders))

    bounds = Table(
        ["arm", "workload", "figure", "tok/s", "ceiling tok/s", "claimed / ceiling", "check", "ceiling from"],
        [],
    )
    for i, b in enumerate(analysis.bounds):
        status = "IMPOSSIBLE: above the ceiling" if b.exceeds else ("ok" if b.ceiling_tps else "-")
        bounds.rows.append(
            [b.arm, b.workload, b.figure, num(b.claimed_tps), num(b.ceiling_tps),
             f"{b.ratio:.2f}" if b.ratio is not None else "-", status, b.basis]
        )  # fmt: skip
        if b.exceeds:
            bounds.flagged.add(i)
    sections.append(
        Section(
            "Physical-bound check",
            ["Every throughput the report shows against the most tokens per second the run could have "
             "produced (tokens / wall time).", bounds],
        )
    )  # fmt: skip

    if analysis.claims:
        claims = Table(["published figure", "published", "the inputs give", "check", "how"], [])
        for i, c in enumerate(analysis.claims):
            claims.rows.append(
                [c.what, f"{c.published:g}", num(c.computed, 2),
                 "follows" if c.follows else "DOES NOT FOLLOW from the study's own inputs", c.basis]
            )  # fmt: skip
            if not c.follows:
                claims.flagged.add(i)
        sections.append(Section("Published figures checked", [claims]))

    cold = Table(["arm", "cold start (s)", "phases (s)"], [])
    for a in data.arms:
        phases = ", ".join(f"{p} {s:.1f}" for p, s in sorted(a.phases.items(), key=lambda kv: -kv[1])) or "-"
        cold.rows.append([data.label(a), num(a.cold_start_s), phases])
    sections.append(Section("Cold start", [cold]))
    if data.primed:
        sections.append(_priming(data))

    spec = Table(
        ["arm", "workload", "acceptance length (engine /metrics)", "acceptance rate", "engine log mean"], []
    )
    for a in (data.launches_of(name)[0] for name in arms):
        for cell in (c for c in data.cells if c.arm == a.name):
            length = cell.mean("engine_spec_mean_acceptance_length")
            rate = cell.mean("engine_spec_acceptance_rate")
            length = length if length is not None else cell.mean("engine_spec_accept_length_mean")
            # SGLang exports its speculation gauges at 0 when it does not speculate (0.5.16 on the
            # H200): an acceptance length of 0 is no speculation, never a figure
            if not length and not rate and a.log_spec_accept_length is None:
                continue
            spec.rows.append(
                [a.name, cell.workload, num(length, 2), num(rate, 3), num(a.log_spec_accept_length, 2)]
            )
    sections.append(
        Section(
            "Speculative decoding",
            [spec] if spec.rows else ["No arm speculated (no acceptance figures recorded)."],
        )
    )

    findings: list[Block] = []
    for a in data.arms:
        items = [
            f"[{f.get('severity')}] {f.get('rule')}: {f.get('message')}"
            for f in a.findings
            if f.get("severity") != "info"
        ]
        items += [f"[node] {w}" for w in a.node_mismatch]
        items += [f"[engine log] {w}" for w in a.warnings]
        gate = analysis.answers.arm(a.name) if analysis.answers else None
        if gate is not None and gate.differences and a.launch == gate.launch:
            items.append(f"[answers] {gate.lossless} changed greedy tokens: {_differences(gate)}")
        if a.structured:
            own = read_structured(a.structured)
            if own.failures or own.error:
                said = _structured_text(own) + (f"; stopped: {own.error}" if own.error else "")
                items.append(f"[answers] structured output: {said}")
        if a is data.launches_of(a.name)[0]:  # said once per arm, of all its launches
            items += _noise_findings(analysis, a.name) + _warmup_findings(analysis, a.name)
        findings.append(f"**{data.label(a)}**: " + (" / ".join(items) if items else "no findings"))
    sections.append(Section("Findings per arm", findings))

    if any(a.stages for a in data.arms) or data.metrics:
        stage_names = sorted({s for a in data.arms for s in a.stages})
        stages = Table(["arm", *(f"{s} (s)" for s in stage_names)], [])
        for a in data.arms:
            stages.rows.append([data.label(a), *(num(a.stages.get(s)) for s in stage_names)])
        m = data.metrics
        sections.append(
            Section(
                "Where the study's time went",
                [stages, f"Wall time {num(m.get('study.wall_s'))} s; the stages one after another would "
                 f"take {num(m.get('study.sequential_s'))} s; overlap (the next arm's inputs fetched "
                 f"while one arm ran) saved {num(m.get('study.overlap_saved_s'))} s."],
            )
        )  # fmt: skip

    sections.append(
        Section(
            "How the numbers are made",
            [
                _method(analysis),
                "Flips and degradation: between workloads that differ in input length alone; flips are "
                "a linear interpolation between measured input lengths, labelled as such.",
            ],
        )
    )
    return Document(
        title=f"Study report: {data.name}",
        sections=sections,
        figures={
            "by_input_length.png": "Latency and decode throughput by input length, per arm (95% CI bars)",
            "distributions.png": "TTFT and ITL distributions per arm and workload",
            "cold_start.png": "Cold start by phase, per arm",
            "pareto.png": "Pareto fronts: tok/s per user against per GPU, per ladder, arms together",
            "search_path.png": "The search's path: each candidate's objective at every look (x: found worse)",
        },
    )


MIN_POWER_SAMPLES = 5
"""Fewer GPU power samples than this inside a cell's window: its energy figures are marked rough."""


def _replayed(data: StudyData) -> list[CellData]:
    return [c for c in data.cells if c.trace is not None and "replay_sent" in c.values]


def _worst(cell: CellData, key: str) -> float | None:
    values = cell.values.get(key)
    return max(values) if values else None


def _search_section(data: StudyData) -> Section | None:
    """A search's answer (``tune``; docs/tuning.md): the outcome in words, then each candidate with its
    settings, its geometric mean on the objective and what became of it."""
    tune = data.tune
    if not tune:
        return None
    objective = tune.get("objective") or {}
    dropped = {d.get("name"): d for d in tune.get("dropped") or []}
    pruned = tune.get("pruned") or {}
    table = Table(
        ["candidate", "settings", f"{objective.get('metric', 'objective')} (geometric mean)", "result"], []
    )
    for name, cand in (tune.get("candidates") or {}).items():
        settings = " ".join(f"{k}={v}" for k, v in (cand.get("settings") or {}).items())
        mean = cand.get("mean")
        if name == tune.get("winner"):
            fate = "the winner"
        elif name in pruned:
            fate = f"left out by preflight: {pruned[name]}"
        elif name in dropped:
            d = dropped[name]
            how = "failed" if d.get("failed") else "not eligible" if d.get("ineligible") else "found worse"
            fate = f"{how} in round {d.get('round')}: {d.get('reason')}"
        elif name == tune.get("leader"):
            fate = "leads (not decided)"
        else:
            fate = "still in the race at the end"
        table.rows.append([name, settings or "-", num(mean) if isinstance(mean, int | float) else "-", fate])
    rules = tune.get("rules") or {}
    budget = rules.get("device_minutes")
    cap = f", no round started past {budget:g} min of device time" if isinstance(budget, int | float) else ""
    held = tune.get("device_s")
    spent = f", {held / 60:.1f} min of device time" if isinstance(held, int | float) else ""
    return Section(
        "The search",
        [
            f"**{tune.get('text', '')}**",
            f"A search over one arm's settings (docs/tuning.md), raced on {objective.get('metric')} in "
            f"{objective.get('workload')}: {rules.get('first_launches')} launches of every candidate "
            f"first, then at each look the verdict rules dropped those found worse than the leader "
            f"(alpha {rules.get('alpha')}, margin +-{float(rules.get('margin') or 0):.0%}) and launched "
            f"the rest once more, at most {rules.get('max_launches')} each{cap}; {tune.get('launches')} "
            f"launches of {tune.get('full_launches')} for measuring every candidate fully{spent}. The "
            "winner (or the leader) as an arm: tune-winner.yaml on the study's run; the search's path (each "
            "candidate's objective at every look): plots/search_path.png. The tables below judge every "
            "pair of candidates by the study's rules, as descriptive context.",
            table,
        ],
    )


def _replay_warnings(data: StudyData) -> list[str]:
    """A replay outside its fidelity bounds, said before any verdict."""
    lines: list[str] = []
    for cell in _replayed(data):
        broken = fidelity_problems({k: w for k in FIDELITY_BOUNDS if (w := _worst(cell, k)) is not None})
        if broken:
            lines.append(
                f"**The replay of {Path(cell.trace or '').name} on {cell.arm} ({cell.workload}) was not "
                f"faithful**: {'; '.join(broken)} (its worst repeat). Its figures are those of the load it "
                "did send, not of the trace's; see 'Replay fidelity'."
            )
    return lines


def _replay_section(data: StudyData) -> Section | None:
    """How faithful each trace replay was: the sender's lag, the offered rate against the trace's,
    the prompt lengths against the trace's, and the engine's prefix-cache hit rate against the
    trace's theoretical one."""
    cells = _replayed(data)
    if not cells:
        return None
    table = Table(
        ["workload", "arm", "sent", "skipped", "lag p50 / p99 ms", "rate gap %", "prompt tokens gap %",
         "hit rate %: trace (prompts / with answers) / engine", "within bounds"], [],
    )  # fmt: skip
    for c in cells:

        def mean(key: str, cell: CellData = c) -> float | None:
            values = cell.values.get(key)
            return sum(values) / len(values) if values else None

        broken = fidelity_problems({k: w for k in FIDELITY_BOUNDS if (w := _worst(c, k)) is not None})
        table.rows.append(
            [
                c.workload,
                c.arm,
                num(sum(c.values.get("replay_sent", [])), 0),
                num(sum(c.values.get("replay_skipped", [])), 0),
                f"{num(mean('replay_lag_ms_p50'), 2)} / {num(mean('replay_lag_ms_p99'), 2)}",
                num(_worst(c, "replay_rate_dev_pct_max")),
                num(mean("replay_prompt_tokens_dev_pct_p50")),
                f"{num(mean('trace_hit_rate_pct'))} / {num(mean('trace_hit_rate_answers_pct'))} / "
                f"{num(mean('engine_prefix_cache_hit_pct'))}",
                "yes" if not broken else "no: " + "; ".join(broken),
            ]
        )
    limits = "; ".join(f"{text} at most {bound:g}" for _, (bound, text) in FIDELITY_BOUNDS.items())
    return Section(
        "Replay fidelity",
        [
            "Each trace replay against the trace (docs/traces.md), across its repeats (sent and "
            "skipped: their sum over the repeats; lag, prompt tokens and hit rates: the mean; the "
            "rate gap and the bounds: the worst repeat). Lag: how late the client sent a request past "
            "the time it could go (its plan, or its previous answer's end). Rate gap: in each window, "
            "the requests sent against those the trace planned (a session waits for its previous "
            "answer, so an engine slower than the recorded one lowers the offered rate). Prompt tokens: "
            "the engine's count against the trace's. Hit rate: the trace's theoretical prefix-cache hit "
            "rate (a cache that never evicts), counting the blocks an earlier prompt held (Mooncake's "
            "definition) and also those a session's previous answer covers (engines cache what they "
            "generate), beside the engine's own counters over the window. Bounds: "
            f"{limits}.",
            table,
        ],
    )


def _gpu_basis(data: StudyData) -> str | None:
    """Which GPUs each arm's energy and dollars count, where the study has either (None otherwise):
    an arm's own GPUs, not every board of the node."""
    if not any(c.values.get(k) for c in data.cells for k in ("gpu_energy_j", "cell_usd")):
        return None
    listed = "; ".join(f"{a}: {data.per_gpu(a)[1]}" for a in data.arm_names)
    return (
        f"GPU energy and dollars count each arm's own GPUs ({listed}). The energy sums the power of "
        "the GPUs its launch names (CUDA_VISIBLE_DEVICES, the engine's device arguments, the "
        "launcher's GPUs); where only their count is known (the engine's parallel size) the dollars "
        "take the count and the energy is the node's, as said."
    )


def _rough_energy(data: StudyData) -> str | None:
    """A note on the cells whose energy per token rests on few power samples (a short window at
    the sampler's 1 s): the integral there leans on the samples around the window's edges."""
    few: dict[str, list[str]] = {}
    for c in data.cells:
        samples = c.values.get("gpu_power_samples")
        if c.values.get("energy_j_per_output_token") and samples and min(samples) < MIN_POWER_SAMPLES:
            few.setdefault(c.workload, []).append(f"{c.arm} {min(samples):.0f}")
    if not few:
        return None
    listed = "; ".join(f"{w} ({', '.join(arms)})" for w, arms in few.items())
    return (
        "GPU energy per token integrates each GPU's power, sampled every metrics_interval_s (1 s by "
        "default) and taken as linear between samples, over the cell's measured window. Fewer than "
        f"{MIN_POWER_SAMPLES} samples fell inside the window of these cells (the fewest of any repeat), "
        f"so their energy figures lean on the samples at its edges: read them as rough: {listed}. "
        "More requests, or duration_s, give a longer window."
    )


def _ladder_runs(data: StudyData) -> list[Block]:
    """How each arm's ladders ran: every point, or where it ended past saturation and why."""
    lines = [
        f"{data.label(a)}, {name}: {summary}"
        for a in data.arms
        for name, summary in sorted(a.ladders.items())
    ]
    return (
        ["How each ladder ran (lowest load first, on one engine start): " + "; ".join(lines) + "."]
        if lines
        else []
    )


def _load(value: float | None, over: str) -> str:
    if value is None:
        return "-"
    if over == "concurrency":
        return f"c{value:.0f}"
    return f"{value:.3g}" if value < 100 else f"{value:,.0f}"


def _capacity_section(data: StudyData, analysis: Analysis) -> Section | None:
    """Per capacity workload: what a probe had to meet; each arm's capacity with its interval (or why
    it has none) and the verdicts between arms, from the analysis' row of the capacity figure; then
    per arm and search the answer, the lowest failing load, the binding objective, a cliff, and every
    probe in the order it ran with its attainment's binomial interval."""
    cells = [c for c in data.cells if c.capacity is not None]
    if not cells:
        return None
    names = {"ttft_ms": "TTFT", "tpot_ms": "TPOT", "e2e_ms": "E2E"}
    blocks: list[Block] = []
    for workload in dict.fromkeys(c.workload for c in cells):
        group = [c for c in cells if c.workload == workload]
        first = group[0]
        slo = ", ".join(f"{names.get(k, k)} <= {v:g} ms" for k, v in first.slo.items()) or "its SLO"
        target = f"{first.attainment_pct:g}%" if first.attainment_pct is not None else "the target share"
        blocks.append(
            f"**{workload}** ({first.input_tokens:,} in / {first.output_tokens:,} out tokens, "
            f"{first.load_label}): a probe passes when at least {target} of its measured requests met "
            f"{slo} (TTFT and E2E counted from each request's scheduled arrival; a failed request "
            "missed)."
        )
        blocks += _capacity_answer(group, analysis)
        table = Table(
            ["arm", "search", "capacity", "fails at", "bound by", "cliff", "probes in the order run "
             "(load: share that met the SLO [its 95% interval])"],
            [],
        )  # fmt: skip
        for c in group:
            for i, s in enumerate(c.searches, 1):
                over = str(s.get("over", "rate"))
                capacity = _load(s.get("capacity"), over)
                if s.get("censored") == "above_high":
                    capacity = f"at least {capacity}"
                elif s.get("censored") == "below_low":
                    capacity = f"below {_load(s.get('failed_at'), over)}"
                if not s.get("converged", True):
                    capacity += " (not converged)"
                probes = ", ".join(_probe_text(p, over) for p in s.get("probes", []))
                binding = s.get("binding")
                table.rows.append(
                    [c.arm, str(i), capacity, _load(s.get("failed_at"), over),
                     names.get(binding, binding) if binding else "-", "yes" if s.get("cliff") else "no",
                     probes or "-"]
                )  # fmt: skip
        blocks.append(table)
    blocks.append(
        "A search's capacity is the highest load that passed; the boundary lies between it and the "
        "lowest load that failed (the bracket the search closed to its tolerance). 'Bound by': the "
        "objective met least often at that failing load. A cliff: the share fell from passing to under "
        "half the target across the final bracket (a wall, not a slope). A probe's interval is its "
        "share's 95% Clopper-Pearson interval (its requests taken as independent draws); 'undecided': "
        "the interval holds the target, so that pass or fail is the point estimate's alone. Each repeat "
        "is a search of its own: an arm's capacity above is the geometric mean of its searches' "
        "bracket middles, its interval from their spread (launch means with two launches or more) plus "
        "the bracket's own width, which repeats walking the same grid of loads do not average away."
    )
    return Section("Capacity under the SLO", blocks)


def _probe_text(probe: Mapping[str, object], over: str) -> str:
    """'61.7: 100% [98.2, 100] pass', '80: 89% [83.8, 93] fail, undecided'; a probe recorded
    without its count (before the interval was kept) as '61.7: 97.3% pass'."""
    share = _float(probe.get("attainment_pct"))
    text = f"{_load(_float(probe.get('point')), over)}: {'?' if share is None else f'{share:.3g}'}%"
    low, high = _float(probe.get("ci_low_pct")), _float(probe.get("ci_high_pct"))
    if low is not None and high is not None:
        text += f" [{low:.3g}, {high:.3g}]"
    text += " pass" if probe.get("passed") else " fail"
    return text + (", undecided" if probe.get("undecided") else "")


def _float(value: object) -> float | None:
    """A number read back from capacity.json (None: absent, or not a number)."""
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _capacity_answer(group: Sequence[CellData], analysis: Analysis) -> list[Block]:
    """Each arm's capacity on one workload with its 95% interval (the analysis' estimate: what the
    results table shows and the verdicts use), or why it has none, and the verdict on every pair."""
    over = "concurrency" if (group[0].capacity or "").startswith("concurrency") else "rate"
    key = "capacity_rps" if over == "rate" else "capacity_concurrency"
    row = next((r for r in analysis.rows if r.workload == group[0].workload and r.metric.key == key), None)
    unit = "req/s" if over == "rate" else "streams"
    table = Table(["arm", f"capacity ({unit})", "95% interval", "searches", "what the interval holds"], [])
    for c in group:
        # a value where a pass and a fail surround it (CapacityResult.width); the others are bounds
        bracketed = [
            s for s in c.searches
            if s.get("censored") is None and s.get("capacity") is not None and s.get("failed_at") is not None
        ]  # fmt: skip
        bounds = [s for s in c.searches if s not in bracketed]
        count = f"{len(c.searches)}, {len(bracketed)} bracketed" if bounds else str(len(c.searches))
        if c.launches > 1:
            count += f" over {c.launches} launches"
        stat = row.cells.get(c.arm) if row is not None else None
        if stat is None:
            table.rows.append([c.arm, "-", "-", count, "no search bracketed the capacity: no value"])
            continue
        est = stat.estimate
        if est.var is None:
            holds = (
                f"a single {'bracketed ' if bounds else ''}search: no interval; repeats: "
                f"{SEARCHES_FOR_INTERVAL} (or launches: 2) to get one"
            )
        elif est.basis == "launches":
            holds = f"{est.launches} launches: restart and repeat noise, and the bracket's width"
        elif est.basis == "prior" and est.prior is not None:
            holds = (
                f"{sum(est.repeats)} repeats of one launch: repeat noise and the bracket's width, and "
                f"restart noise {est.prior.cv:.1%} from the history"
            )
        else:
            holds = (
                f"{sum(est.repeats)} repeats of one launch: repeat noise and the bracket's width; restart "
                "noise unknown (no verdict on it: launches: 2)"
            )
        if bounds:
            holds += "; censored searches (a bound, not a value) left out"
        interval = (
            f"[{_estimate_load(stat.ci_low, over)}, {_estimate_load(stat.ci_high, over)}]"
            if stat.ci_low is not None
            else "-"
        )
        table.rows.append([c.arm, _estimate_load(stat.mean, over), interval, count, holds])
    blocks: list[Block] = [table]
    if row is None or len(row.cells) < 2:
        return blocks
    if analysis.hardware_refusal is not None:
        blocks.append("No verdict between the arms' capacities: " + analysis.hardware_refusal)
    elif not row.decision:
        blocks.append(
            f"No verdict between the arms' capacities: the experiment's decision.metrics does not name "
            f"{key} (name it to compare them as any decision figure is)."
        )
    else:
        blocks.append(
            f"Compared as any decision figure is, at the decision's level "
            f"({analysis.design.confidence:.2%} intervals): "
            + "; ".join(f"{v.a} against {v.b}: {v.text()}" for v in row.verdicts)
            + "."
        )
    return blocks


def _estimate_load(value: float | None, over: str) -> str:
    """A capacity estimate (a geometric mean of bracket middles: not a load any probe ran)."""
    if value is None:
        return "-"
    if math.isinf(value):
        return "inf"
    return f"{value:.3g}" if value < 100 else f"{value:,.0f}"


def _priming(data: StudyData) -> Section:
    """The priming launches (``decision.prime``): their cold start, and what their one repeat per
    workload measured beside the measured launches' mean (a first launch slower than the later ones
    is what priming keeps out of the verdicts)."""
    columns = ["output tok/s: priming / measured", "TTFT p50 ms: priming / measured"]
    table = Table(["arm", "cold start (s)", "workload", *columns], [])
    for a in data.primed:
        for p in (c for c in data.primed_cells if c.arm == a.name):
            measured = data.cell(a.name, p.workload)
            row = [a.name, num(a.cold_start_s), p.workload]
            for key in ("output_throughput_tps", "ttft_ms_p50"):
                mine, theirs = p.mean(key), measured.mean(key) if measured is not None else None
                ratio = f" ({mine / theirs:.2f}x)" if mine is not None and theirs else ""
                row.append(f"{num(mine)} / {num(theirs)}{ratio}")
            table.rows.append(row)
        if not any(c.arm == a.name for c in data.primed_cells):
            why = f"({a.status}: {a.error or 'no workload ran'})"
            table.rows.append([a.name, num(a.cold_start_s), why, "-", "-"])
    intro = (
        "Each arm was launched once before the measured launches (decision.prime), to fill the node's "
        "caches; those launches ran each workload once and are left out of the verdicts and the noise."
    )
    return Section("Priming launches", [intro, table])


def _method(analysis: Analysis) -> str:
    d = analysis.design
    metrics = ", ".join(analysis.decision_metrics)
    return (
        f"Verdicts rest on the decision metrics ({metrics}); every other figure is descriptive. Each is "
        "compared on the log of the ratio of two arms' geometric means (so a figure and its reciprocal, "
        "end-to-end time and throughput, cannot disagree). A cell's variance comes from the spread of its "
        "launch means when the arm was launched twice or more (restart and repeat noise both in it), "
        "else from its one launch's repeats (restart noise not in it, said beside each such verdict); "
        "balanced pairs pool their two variances (Student's t), others use Welch's. "
        f"Every pair of arms on every decision metric and workload is one comparison: {d.tests} in all, "
        f"sharing a family-wise error rate of {d.alpha:g} (Bonferroni: each interval is the two-sided "
        f"{d.confidence:.2%} interval). A verdict is read off the interval printed beside it: it excludes "
        f"no change, so one arm is better by the amount shown; or it lies within +-{d.margin:.0%} (the "
        "equivalence margin, two one-sided tests), so the arms are equivalent; or neither, inconclusive, "
        "with the smallest difference the comparison would have found with "
        f"{d.power:.0%} probability (noncentral t). docs/measurement.md, 'Verdicts', states the model."
        + _looks(analysis)
    )


def _looks(analysis: Analysis) -> str:
    look = analysis.look
    if not look:
        return ""
    return (
        f" This study added launches until its decision was reached (decision.until): it stopped at look "
        f"{look['look']} of at most {look['looks']} ({look.get('stopped') or 'reason not recorded'}). "
        f"Each look may use its share of the family-wise error rate (O'Brien-Fleming spending, whose shares "
        f"sum to the decision's alpha: adding data until a verdict comes keeps the error rate), and "
        f"this one's is {look['alpha']:.4g}: the alpha above."
    )


def _md_table(t: Table) -> str:
    def esc(s: str) -> str:
        return s.replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(esc(h) for h in t.headers) + " |", "|" + "---|" * len(t.headers)]
    for i, row in enumerate(t.rows):
        cells = [esc(c) for c in row]
        if i in t.flagged:
            cells = [f"**{c}**" for c in cells]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def to_markdown(doc: Document, figures: Mapping[str, bytes], figure_dir: str = "plots") -> str:
    out = [f"# {doc.title}", ""]
    for s in doc.sections:
        out += [f"## {s.title}", ""]
        for b in s.blocks:
            out += [_md_table(b) if isinstance(b, Table) else b, ""]
    if figures:
        out += ["## Figures", ""]
        for name in figures:
            out += [f"![{doc.figures.get(name, name)}]({figure_dir}/{name})", ""]
    return "\n".join(out)


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:2rem auto;max-width:1400px;
padding:0 1rem;color:#1b1b1b}
h1{font-size:1.6rem}h2{font-size:1.2rem;margin-top:2rem;border-bottom:1px solid #ddd;padding-bottom:.2rem}
table{border-collapse:collapse;margin:.6rem 0;font-size:.85rem}
th,td{border:1px solid #ccc;padding:.3rem .5rem;text-align:left;vertical-align:top}
th{background:#f2f4f7}tr.flag td{background:#fde2e1;font-weight:600}
figure{margin:1rem 0}figcaption{color:#555;font-size:.85rem}img{max-width:100%}
"""


def _inline(text: str) -> str:
    """The little Markdown the paragraphs use: **bold** and `code`."""
    out, bold, code = [], False, False
    i = 0
    escaped = html.escape(text)
    while i < len(escaped):
        if escaped.startswith("**", i):
            out.append("</strong>" if bold else "<strong>")
            bold = not bold
            i += 2
        elif escaped[i] == "`":
            out.append("</code>" if code else "<code>")
            code = not code
            i += 1
        else:
            out.append(escaped[i])
            i += 1
    return "".join(out)


def to_html(doc: Document, figures: Mapping[str, bytes]) -> str:
    out = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(doc.title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(doc.title)}</h1>",
    ]
    for s in doc.sections:
        out.append(f"<h2>{html.escape(s.title)}</h2>")
        for b in s.blocks:
            if isinstance(b, Table):
                out.append(
                    "<table><thead><tr>"
                    + "".join(f"<th>{html.escape(h)}</th>" for h in b.headers)
                    + "</tr></thead><tbody>"
                )
                for i, row in enumerate(b.rows):
                    cls = " class='flag'" if i in b.flagged else ""
                    out.append(f"<tr{cls}>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>")
                out.append("</tbody></table>")
            else:
                out.append(f"<p>{_inline(b)}</p>")
    if figures:
        out.append("<h2>Figures</h2>")
        for name, png in figures.items():
            data = base64.b64encode(png).decode()
            caption = html.escape(doc.figures.get(name, name))
            out.append(
                f"<figure><img alt='{caption}' src='data:image/png;base64,{data}'>"
                f"<figcaption>{caption}</figcaption></figure>"
            )
    out.append("</body></html>")
    return "\n".join(out)
