"""A retest's answer: each variant of an experiment judged against its baseline, cell by cell.

A retest (:mod:`k3pipe.jobs.retest_run`) records the baseline and every variant as studies nested under one
parent run. Here each variant's cell (an arm on a workload) meets the baseline's cell of the same arm
and workload, figure by figure (the study report's table figures and the decision's), with the
statistics of :mod:`k3pipe.verdicts.stats` (docs/measurement.md, "Verdicts"):

- the change is the variant's geometric mean over the baseline's (``+12.3%``), on the log scale;
- on the decision metrics (the baseline experiment's ``decision.metrics``) every comparison of the
  retest shares the family-wise error rate (Bonferroni), and each verdict is read off its interval at
  that level: **better** or **worse** (in the figure's own direction), **equivalent** within the
  margin, or **inconclusive** (with the smallest difference the data could have shown); a cell of one
  launch with one repeat gets **no test**;
- every other figure is **descriptive**: its change with a 95% interval, no verdict;
- the client's TPOT and ITL of a cell whose stream came in bursts are not judged (as in the study
  report), and a cell the baseline does not have (another workload name) is listed as not comparable.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3pipe.core.errors import ArtifactMissingError, TrackingError
from k3pipe.core.figures import DEFAULT_DECISION, figure
from k3pipe.core.layout import (
    EXPERIMENT_TAG,
    FAILED_PREFIX,
    KIND_TAG,
    REPORT_DIR,
    RETEST_KIND,
    STUDY_KIND,
    VARIANTS_FILE,
    RunTags,
    verdict_metric,
)
from k3pipe.records.compare import find_run
from k3pipe.records.tracking import Tracker
from k3pipe.report.analysis import TABLE_METRICS, CellStat, Metric, design_of, is_bursty
from k3pipe.report.collect import StudyData, collect
from k3pipe.report.render import Document, Section, Table, build_document, cell_text, to_html, to_markdown
from k3pipe.verdicts import stats

__all__ = [
    "BASELINE",
    "RetestData",
    "RetestReport",
    "VariantVerdict",
    "build_retest_document",
    "build_retest_report",
    "collect_retest",
    "judge_variants",
    "publish_retest",
]

BASELINE = "baseline"
"""The ``k3pipe.variant`` tag of the baseline's study in a retest."""
"""On the retest's run: each variant's description and the changes it makes."""

BETTER, WORSE, EQUIVALENT, INCONCLUSIVE = "better", "worse", "equivalent", "inconclusive"
NO_TEST, DESCRIPTIVE = "no test (a single value)", "descriptive"
CANNOT_TELL = "cannot tell: restart noise unknown"
LABELS = (BETTER, WORSE, EQUIVALENT, INCONCLUSIVE, CANNOT_TELL, NO_TEST)


@dataclass
class RetestData:
    """A retest as MLflow holds it: its run, the baseline's study and each variant's study."""

    run_id: str
    name: str
    status: str
    baseline: StudyData
    variants: dict[str, StudyData]
    """variant name -> its study, in the order they ran."""
    changes: dict[str, list[str]] = field(default_factory=dict)
    """variant name -> what it changes, one line each."""
    descriptions: dict[str, str] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    """variant -> why its study has no cells to judge (or never ran)."""

    @property
    def names(self) -> list[str]:
        """Every variant the retest was asked for, in order, run or not."""
        return list(dict.fromkeys([*self.changes, *self.variants, *self.failed]))


@dataclass
class VariantVerdict:
    variant: str
    arm: str
    workload: str
    input_tokens: int
    metric: Metric
    baseline: CellStat
    value: CellStat
    decision: bool
    outcome: stats.Verdict | None = None
    """The decision's verdict (decision figures; set once the family's size is known)."""

    @property
    def ratio(self) -> float:
        """The variant over the baseline (geometric means)."""
        return math.exp(self.value.estimate.log_mean - self.baseline.estimate.log_mean)

    @property
    def comparison(self) -> stats.Comparison:
        return stats.compare(self.value.estimate, self.baseline.estimate)

    @property
    def ci(self) -> tuple[float, float] | None:
        """The interval of ``ratio``: at the decision's level for a decision figure, else 95%."""
        confidence = self.outcome.confidence if self.outcome is not None else 0.95
        ci = self.comparison.interval(confidence)
        return (stats.exp_or_inf(ci[0]), stats.exp_or_inf(ci[1])) if ci else None

    @property
    def verdict(self) -> str:
        if not self.decision:
            return DESCRIPTIVE
        v = self.outcome
        if v is None or v.outcome == "untested":
            return NO_TEST
        if v.outcome == "unknown":
            return CANNOT_TELL
        if v.outcome == "different":
            return BETTER if v.leader == self.variant else WORSE
        return EQUIVALENT if v.outcome == "equivalent" else INCONCLUSIVE

    def change_text(self) -> str:
        ci = f" [{stats.signed_pct(self.ci[0])}, {stats.signed_pct(self.ci[1])}]" if self.ci else ""
        return f"{stats.signed_pct(self.ratio)}{ci}"

    def text(self) -> str:
        v = self.outcome
        label = self.verdict
        if label == EQUIVALENT and v is not None:
            label = f"equivalent within +-{v.margin:.0%}"
        elif label == INCONCLUSIVE and v is not None and v.mde is not None:
            label = f"inconclusive: differences below {stats.detectable(v.mde)} cannot be seen with this data"
        notes = v.noise_note() if v is not None else ""
        if label == CANNOT_TELL:
            notes = "; a side was launched once and no earlier study measured its restart noise here"
        return f"{label} ({self.change_text()}{notes})"


def judge_variants(data: RetestData) -> list[VariantVerdict]:
    """Every (variant, arm, workload, figure) both sides measured; the decision figures judged under
    one design shared by all of them."""
    decision_keys = tuple(data.baseline.decision.get("metrics") or DEFAULT_DECISION)
    metrics = [*TABLE_METRICS, *(figure(k) for k in decision_keys if k not in {m.key for m in TABLE_METRICS})]
    verdicts: list[VariantVerdict] = []
    for name, study in data.variants.items():
        for cell in sorted(study.cells, key=lambda c: (c.arm, c.input_tokens, c.workload)):
            base = data.baseline.cell(cell.arm, cell.workload)
            if base is None:
                continue
            for metric in metrics:
                if is_bursty(base, metric) or is_bursty(cell, metric):
                    continue
                sa, sb = (
                    stats.estimate(base.by_launch(metric.key)),
                    stats.estimate(cell.by_launch(metric.key)),
                )
                if sa is not None and sb is not None:
                    sa = stats.with_prior(sa, base.priors.get(metric.key))
                    sb = stats.with_prior(sb, cell.priors.get(metric.key))
                if sa is None or sb is None:
                    continue  # a figure that could not be measured is judged against nothing
                verdicts.append(
                    VariantVerdict(
                        name, cell.arm, cell.workload, cell.input_tokens, metric, CellStat(sa), CellStat(sb),
                        metric.key in decision_keys,
                    )
                )  # fmt: skip
    judged = [v for v in verdicts if v.decision]
    # a single value on a side, or a side whose restart noise no launch or prior gives, cannot be
    # tested: not one of the family (that follows from the design)
    testable = sum(
        v.baseline.estimate.var is not None
        and v.value.estimate.var is not None
        and v.baseline.estimate.restart_known
        and v.value.estimate.restart_known
        for v in judged
    )
    design = design_of(data.baseline.decision, testable)
    for v in judged:
        v.outcome = stats.decide(v.comparison, design, v.metric.higher_is_better, (v.variant, BASELINE))
    return verdicts


def _not_comparable(data: RetestData) -> list[str]:
    out = []
    for name, study in data.variants.items():
        for cell in study.cells:
            if data.baseline.cell(cell.arm, cell.workload) is None:
                out.append(f"{name}: {cell.arm} on {cell.workload} (the baseline has no such cell)")
    return out


def _answer(data: RetestData, verdicts: Sequence[VariantVerdict]) -> list[str]:
    lines = []
    for name in data.names:
        mine = [v for v in verdicts if v.variant == name]
        said = data.descriptions.get(name)
        head = f"**{name}**" + (f" ({said})" if said else "")
        if name in data.failed:
            lines.append(f"{head}: not judged: {data.failed[name]}.")
            continue
        if not mine:
            lines.append(f"{head}: nothing to judge (no cell shared with the baseline).")
            continue
        parts = []
        for label in (BETTER, WORSE):
            hits = [v for v in mine if v.verdict == label]
            if hits:
                shown = ", ".join(
                    f"{v.metric.label} {v.change_text()} ({v.arm}, {v.workload})" for v in hits[:4]
                )
                more = f" and {len(hits) - 4} more" if len(hits) > 4 else ""
                parts.append(f"{label} on {shown}{more}")
        for label, said in ((EQUIVALENT, "equivalent within the margin"), (INCONCLUSIVE, "inconclusive"),
                            (CANNOT_TELL, "not judged: restart noise unknown (launched once; `launches: 2`)"),
                            (NO_TEST, "not tested (a single value)")):  # fmt: skip
            n = sum(v.verdict == label for v in mine)
            if n:
                parts.append(f"{n} decision figure(s) {said}")
        lines.append(f"{head}: " + "; ".join(parts) + ".")
    return lines


def verdict_rows(verdicts: Sequence[VariantVerdict]) -> Table:
    headers = ["variant", "arm", "workload", "metric", "baseline", "variant value", "change [interval]",
               "verdict"]  # fmt: skip
    rows, flagged = [], set()
    for i, v in enumerate(verdicts):
        rows.append(
            [
                v.variant,
                v.arm,
                v.workload,
                f"{v.metric.label} ({v.metric.unit}; {'decision' if v.decision else 'descriptive'})",
                cell_text(v.baseline),
                cell_text(v.value),
                v.change_text(),
                v.text(),
            ]
        )
        if v.verdict == WORSE:
            flagged.add(i)
    return Table(headers, rows, flagged)


def build_retest_document(
    data: RetestData, verdicts: Sequence[VariantVerdict], baseline_results: Table | None = None
) -> Document:
    """The retest's report: the answer per variant, what each changed, the verdict table, the
    baseline's own results table and where each study's full report is."""
    judged = [v for v in verdicts if v.outcome is not None and v.outcome.tested]
    design = design_of(data.baseline.decision, len(judged))
    method = (
        "Each variant's cell against the baseline's cell of the same arm and workload: the change is the "
        "variant's geometric mean over the baseline's. On the decision metrics ("
        + ", ".join(data.baseline.decision.get("metrics") or DEFAULT_DECISION)
        + f") the {design.tests} comparison(s) of this retest share a family-wise error rate of "
        f"{design.alpha:g} (Bonferroni: {design.confidence:.2%} intervals, shown beside each verdict): "
        "'better'/'worse' in each figure's own direction when the interval excludes no change, "
        f"'equivalent' when it lies within +-{design.margin:.0%}, else 'inconclusive' with the smallest "
        f"difference it could have found at {design.power:.0%} power. Other figures are descriptive "
        "(95% intervals, no verdict). docs/measurement.md, 'Verdicts', states the model."
    )
    sections = [
        Section("The answer", _answer(data, verdicts)),
        Section(
            "What each variant changes",
            [f"**{name}**: " + "; ".join(lines) for name, lines in data.changes.items()] or ["(none)"],
        ),
        Section("Verdicts against the baseline", [method, verdict_rows(verdicts)]),
    ]
    skipped = _not_comparable(data)
    if skipped:
        sections.append(Section("Not comparable", skipped))
    if baseline_results is not None:
        sections.append(Section("The baseline's results", [baseline_results]))
    runs = [f"baseline: study run `{data.baseline.run_id}`"] + [
        f"{name}: study run `{s.run_id}` ({s.status})" for name, s in data.variants.items()
    ]
    runs.append("Each study's own report (`k3pipe report RUN_ID`) is attached to its run under `report/`.")
    sections.append(Section("Studies", runs))
    return Document(title=f"Retest of {data.name}: each variant against the baseline", sections=sections)


def summary(verdicts: Sequence[VariantVerdict]) -> Mapping[str, dict[str, int]]:
    """variant -> how many decision figures were better, worse, equivalent, inconclusive, untested."""
    out: dict[str, dict[str, int]] = {}
    for v in verdicts:
        if not v.decision:
            continue
        counts = out.setdefault(v.variant, dict.fromkeys(LABELS, 0))
        counts[v.verdict] += 1
    return out


def collect_retest(tracker: Tracker, ref: str) -> RetestData:
    """The retest ``ref`` (its run id, or a unique prefix) as recorded in MLflow."""
    run = find_run(tracker, ref)
    tags = run.data.tags
    if tags.get(KIND_TAG) != RETEST_KIND:
        raise TrackingError(
            f"run {run.info.run_id} is not a retest's run (tag k3pipe.kind is {tags.get(KIND_TAG)!r}); "
            "give the id `k3pipe retest` printed, or find it with `k3pipe runs`"
        )
    studies: dict[str, StudyData] = {}
    for child in sorted(tracker.children(run.info.run_id), key=lambda r: r.info.start_time):
        label = RunTags.of(child).variant
        if RunTags.of(child).kind == STUDY_KIND and label:
            studies[label] = collect(tracker, child.info.run_id)
    # after the studies, whose errors name the workload; an artifact store that cannot be read raises
    # (ArtifactStoreError) rather than lose what each variant changes
    try:
        recorded = tracker.find_artifact(run.info.run_id, VARIANTS_FILE)
    except ArtifactMissingError as exc:
        raise exc.context(f"retest {run.info.run_id}'s variants") from exc
    meta: dict[str, Any] = json.loads(recorded) if recorded else {}
    failed = {
        label: (tags.get(f"{FAILED_PREFIX}{label}") or f"its study ended {s.status} with no cell recorded")
        for label, s in studies.items()
        if not s.cells
    }
    for label in meta:
        if label not in studies:
            failed[label] = tags.get(f"{FAILED_PREFIX}{label}") or "its study was never started"
    if BASELINE not in studies:
        raise TrackingError(
            f"retest {run.info.run_id} has no baseline study under it (it ended {run.info.status} "
            "before the baseline began); nothing can be judged"
        )
    order = [label for label in meta if label in studies] + [
        label for label in studies if label not in meta and label != BASELINE
    ]
    return RetestData(
        run_id=run.info.run_id,
        name=tags.get(EXPERIMENT_TAG, run.info.run_name),
        status=run.info.status,
        baseline=studies[BASELINE],
        variants={label: studies[label] for label in order},
        changes={label: list(m.get("changes", [])) for label, m in meta.items()},
        descriptions={label: m["description"] for label, m in meta.items() if m.get("description")},
        failed={k: v for k, v in failed.items() if k != BASELINE},
    )


@dataclass
class RetestReport:
    data: RetestData
    verdicts: list[VariantVerdict]
    document: Document

    @property
    def markdown(self) -> str:
        return to_markdown(self.document, {})

    @property
    def html(self) -> str:
        return to_html(self.document, {})

    def table_rows(self) -> list[dict[str, str]]:
        """The verdict table as records (a Prefect table artifact, a JSON file)."""
        t = verdict_rows(self.verdicts)
        return [dict(zip(t.headers, row, strict=True)) for row in t.rows]

    def text(self) -> str:
        """For a terminal: the answer per variant, then one line per judged figure."""
        answer = next(s for s in self.document.sections if s.title == "The answer")
        lines = [str(b).replace("**", "") for b in answer.blocks]
        lines.append("")
        for v in self.verdicts:
            lines.append(f"{v.variant:<24} {v.arm:<10} {v.workload:<16} {v.metric.label:<34} {v.text()}")
        return "\n".join(lines)

    def description(self) -> str:
        """The retest's run description in MLflow."""
        answer = next(s for s in self.document.sections if s.title == "The answer")
        return "\n".join(
            [
                f"Retest of **{self.data.name}**: {len(self.data.names)} variant(s) against the baseline.",
                "",
                *(f"- {b}" for b in answer.blocks),
                "",
                "The whole report: artifacts `report/retest.html` and `report/retest.md`.",
            ]
        )

    def write(self, out_dir: Path) -> dict[str, Path]:
        out_dir.mkdir(parents=True, exist_ok=True)
        paths = {
            "markdown": out_dir / "retest.md",
            "html": out_dir / "retest.html",
            "json": out_dir / "retest.json",
            "text": out_dir / "retest.txt",
        }
        paths["markdown"].write_text(self.markdown)
        paths["html"].write_text(self.html)
        paths["json"].write_text(json.dumps(self.table_rows(), indent=1))
        paths["text"].write_text(self.text() + "\n")
        return paths


def build_retest_report(tracker: Tracker, ref: str) -> RetestReport:
    """The retest ``ref``'s report from what MLflow holds."""
    from k3pipe.report.analysis import analyse

    data = collect_retest(tracker, ref)
    verdicts = judge_variants(data)
    base = build_document(data.baseline, analyse(data.baseline))
    results = next(
        (b for s in base.sections if s.title == "Results" for b in s.blocks if isinstance(b, Table)), None
    )
    return RetestReport(data, verdicts, build_retest_document(data, verdicts, results))


def publish_retest(tracker: Tracker, report: RetestReport, out_dir: Path) -> dict[str, Path]:
    """Write the retest's report under ``out_dir``, attach it to the retest's run (report/), set the
    run's description and one metric per variant and verdict (``verdict.<variant>.better`` ...)."""
    paths = report.write(out_dir)
    for path in paths.values():
        tracker.log_file(report.data.run_id, path, REPORT_DIR)
    tracker.describe(report.data.run_id, report.description())
    short = {BETTER: "better", WORSE: "worse", EQUIVALENT: "equivalent", INCONCLUSIVE: "inconclusive",
             CANNOT_TELL: "cannot_tell", NO_TEST: "untested"}  # fmt: skip
    counts = {
        verdict_metric(variant, short[label]): float(n)
        for variant, per in summary(report.verdicts).items()
        for label, n in per.items()
    }
    if counts:
        tracker.log_metrics(report.data.run_id, counts)
    return paths
