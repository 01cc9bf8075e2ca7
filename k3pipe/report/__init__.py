"""The study's report, built from MLflow alone: :func:`build_report` reads a study's parent run and
its nested arms (:mod:`~k3pipe.report.collect`), works out the answer (:mod:`~k3pipe.report.analysis`),
draws the figures (:mod:`~k3pipe.report.plots`) and writes Markdown and one self-contained HTML page
(:mod:`~k3pipe.report.render`); :func:`publish` attaches them to the study's run.

A study run may hold ``claims.json``: figures published for the study (a list of
``{"kind": "ratio" | "degradation" | "throughput", ...}``), which the report checks against what the
recorded values give instead of repeating them.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from k3pipe.core.layout import CLAIMS_FILE, REPORT_DIR, TRACE_FILE
from k3pipe.records.priors import NoiseEntry, launch_spread, record_noise, repeat_spread
from k3pipe.records.tracking import Tracker
from k3pipe.report.analysis import Analysis, analyse
from k3pipe.report.collect import CellData, StudyData, cell_class_of, collect, requests_frame
from k3pipe.report.render import Document, Table, build_document, to_html, to_markdown
from k3pipe.report.steady import steady_decode_tps

__all__ = ["Report", "build_report", "publish", "report_dir", "retest_dir"]


@dataclass
class Report:
    data: StudyData
    analysis: Analysis
    document: Document
    figures: dict[str, bytes]

    @property
    def markdown(self) -> str:
        return to_markdown(self.document, self.figures)

    @property
    def html(self) -> str:
        return to_html(self.document, self.figures)

    def description(self) -> str:
        """The study's run description in MLflow: its arms, the answer, where the report is."""
        answer = next((s for s in self.document.sections if s.title == "The answer"), None)
        lines = [
            f"Study of experiment **{self.data.name}**: arms "
            + ", ".join(f"{a.name} ({a.engine}, {a.status})" for a in self.data.arms)
            + f"; workloads {', '.join(self.data.workloads())}.",
            "",
            *(f"- {b}" for b in (answer.blocks if answer else []) if isinstance(b, str)),
            "",
            "The whole report: artifacts `report/report.html` (self-contained) and `report/report.md`.",
        ]
        return "\n".join(lines)

    def results_table(self) -> Table:
        return next(
            b
            for s in self.document.sections
            if s.title == "Results"
            for b in s.blocks
            if isinstance(b, Table)
        )

    def table_rows(self) -> list[dict[str, Any]]:
        """The results table as records (a Prefect table artifact, a JSON file)."""
        t = self.results_table()
        return [dict(zip(t.headers, row, strict=True)) for row in t.rows]

    def text(self) -> str:
        """For a terminal: the answer (every arm ranked, each verdict with its interval), the A/A's
        verdicts when the study ran one, then the results table without its verdict column (the
        answer says them)."""
        lines = ["The answer:"]
        for title in ("The answer", "Calibration: A/A"):
            section = next((s for s in self.document.sections if s.title == title), None)
            if section is None:
                continue
            if title != "The answer":
                lines.append(f"{title}:")
            for block in section.blocks:
                if isinstance(block, Table):
                    lines += [f"  {row[0]}, {row[1]}: {row[-1]}" for row in block.rows]
                else:
                    lines.append("  " + block.replace("**", ""))
        t = self.results_table()
        frame = pd.DataFrame(t.rows, columns=t.headers)
        frame["metric"] = frame["metric"].str.replace(r" \(.*\)$", "", regex=True)
        table = frame.drop(columns=["input tokens", "verdict"]).to_string(index=False)
        return "\n".join([*lines, "", table])

    def write(self, out_dir: Path) -> dict[str, Path]:
        """report.md (figures beside it under plots/), report.html (self-contained), report.json,
        report.txt (:meth:`text`, what a terminal is shown)."""
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "plots").mkdir(exist_ok=True)
        paths = {
            "markdown": out_dir / "report.md",
            "html": out_dir / "report.html",
            "json": out_dir / "report.json",
            "text": out_dir / "report.txt",
        }
        paths["markdown"].write_text(self.markdown)
        paths["html"].write_text(self.html)
        paths["json"].write_text(json.dumps(self.table_rows(), indent=1))
        paths["text"].write_text(self.text() + "\n")
        for name, png in self.figures.items():
            (out_dir / "plots" / name).write_bytes(png)
        return paths


def _with_steady(tracker: Tracker, cell: CellData) -> dict[tuple[str, str], pd.DataFrame]:
    """Add the client-side steady decode figure of each repeat (unless recorded); the cell's
    requests for the distribution plots."""
    frames = []
    steady: list[float | None] = []
    for run_id in cell.request_runs:
        frame = requests_frame(tracker, cell.model_copy(update={"request_runs": [run_id]}))
        if frame is None:
            steady.append(None)
            continue
        frames.append(frame)
        steady.append(steady_decode_tps(frame))
    add_per_repeat(cell, "steady_decode_tps", steady)
    return {(cell.arm, cell.workload): pd.concat(frames, ignore_index=True)} if frames else {}


def add_per_repeat(cell: CellData, metric: str, values: list[float | None]) -> None:
    """Add ``metric`` worked out here, one value per run of ``cell.request_runs`` (None: none for that
    repeat), unless the record holds it. A cell of several launches gets it per launch too (its runs
    are in launch order, as many per launch as that launch's repeats): without that the launch-based
    verdicts saw no value, and the H100 MLA study (2026-12-06, two launches, steady decode a
    decision metric) showed no steady decode row at all."""
    if metric in cell.values or not any(v is not None for v in values):
        return
    cell.values[metric] = [v for v in values if v is not None]
    if not cell.launch_values:
        return
    sizes = [max((len(v) for v in launch.values()), default=0) for launch in cell.launch_values]
    if sum(sizes) != len(values):
        return  # the runs cannot be told apart by launch: the pooled values alone
    start = 0
    for launch, size in zip(cell.launch_values, sizes, strict=True):
        part = [v for v in values[start : start + size] if v is not None]
        start += size
        if part:
            launch[metric] = part


def build_report(tracker: Tracker, study_ref: str, claims: list[dict[str, Any]] | None = None) -> Report:
    """The report of study ``study_ref`` from what MLflow holds (plus ``claims`` to check)."""
    from k3pipe.report.plots import plot_all

    data = collect(tracker, study_ref)
    frames: dict[tuple[str, str], pd.DataFrame] = {}
    order = {a.name: i for i, a in enumerate(data.arms)}
    for cell in sorted(data.cells, key=lambda c: (order.get(c.arm, len(order)), c.input_tokens)):
        frames.update(_with_steady(tracker, cell))
    # after the cells' own artifacts, whose errors name the workload; a store that cannot be read
    # raises here too rather than lose the claims
    recorded = tracker.find_artifact(data.run_id, CLAIMS_FILE)
    all_claims = [*(json.loads(recorded) if recorded else []), *(claims or [])]
    analysis = analyse(data, all_claims)
    document = build_document(data, analysis)
    figures = plot_all(analysis, data, frames)
    figures.update(_trace_shapes(tracker, data))
    return Report(data, analysis, document, figures)


def _trace_shapes(tracker: Tracker, data: StudyData) -> dict[str, bytes]:
    """The shape of each trace a workload replayed (arrivals, lengths, session depth, sharing), drawn
    from the copy its first run kept (k3pipe.core.layout.TRACE_FILE)."""
    from k3pipe.report.plots import trace_shape_png
    from k3pipe.schema.traces import read_trace

    out: dict[str, bytes] = {}
    for cell in data.cells:
        name = f"trace_{cell.workload}.png"
        if cell.trace is None or name in out:
            continue
        raw = tracker.find_artifact(cell.run_id, TRACE_FILE)
        if raw is None:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / TRACE_FILE
            path.write_bytes(raw)
            out[name] = trace_shape_png(read_trace(path))
    return out


def report_dir(home: Path, experiment: str, run_id: str) -> Path:
    """Where a study's report is written on this machine (``home``: K3PIPE_HOME)."""
    return home / "reports" / f"{experiment}-{run_id[:8]}"


def retest_dir(home: Path, experiment: str, run_id: str) -> Path:
    """Where a retest's report is written on this machine (``home``: K3PIPE_HOME)."""
    return home / "reports" / f"{experiment}-retest-{run_id[:8]}"


def noise_entries(data: StudyData) -> list[NoiseEntry]:
    """The restart noise this study measured (k3pipe.records.priors): per cell whose arm has two launches or
    more with whole repeats, per figure, the spread of its launch means, under the cell's class."""
    out = []
    for cell in data.cells:
        if cell.launches < 2:
            continue
        klass = cell_class_of(data.arms, cell)
        if klass is None:
            continue
        for metric in cell.values:
            launches = cell.by_launch(metric)
            spread = launch_spread(launches)
            if spread is None:
                continue
            within = repeat_spread(launches)
            out.append(
                NoiseEntry(
                    key=klass.key, label=klass.label(), engine=klass.engine, model=klass.model,
                    node=klass.node, metric=metric, arm=cell.arm, workload=cell.workload, ss=spread[0],
                    df=spread[1], repeats=[len(v) for v in launches], ss_within=within[0],
                    df_within=within[1],
                )
            )  # fmt: skip
    return out


def publish(tracker: Tracker, report: Report, out_dir: Path) -> dict[str, Path]:
    """Write the report under ``out_dir`` and attach it to the study's run (report/); keep the
    restart noise it measured for later studies (k3pipe.records.priors)."""
    paths = report.write(out_dir)
    for path in [*paths.values(), *sorted((out_dir / "plots").glob("*.png"))]:
        sub = f"{REPORT_DIR}/plots" if path.parent.name == "plots" else REPORT_DIR
        tracker.log_file(report.data.run_id, path, sub)
    tracker.describe(report.data.run_id, report.description())
    record_noise(tracker, report.data.run_id, noise_entries(report.data))
    return paths
