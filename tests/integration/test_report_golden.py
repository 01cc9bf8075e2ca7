"""The study's own numbers through the report: the figures field-notes.md publishes ("Results", and
the throughput claim of measurement rule 2) recorded as a study's runs in a real SQLite MLflow store,
then the report built from MLflow alone. It must reproduce the study's ratios and leaders, find the
flip, apply the physical bound (the 1111.61 tok/s claim is ~11x above 10 x 3000 / 295.21 s), and flag
the one derived figure that does not follow from the study's inputs (vLLM's decode slow-down: the
table's own 501 and 163 tok/s give 3.07x, not the published 3.29x)."""

from __future__ import annotations

from pathlib import Path

import pytest

from k3pipe.core.layout import CLAIMS_FILE, STUDY_KIND
from k3pipe.records.tracking import Tracker
from k3pipe.report import build_report

# field-notes.md, "Results (10 concurrent requests, 3K output)": end-to-end s, steady decode tok/s
RESULTS = {
    ("vllm", "random-64k"): (100.5, 501.0),
    ("sglang", "random-64k"): (150.8, 335.0),
    ("vllm", "random-200k"): (295.2, 163.0),
    ("sglang", "random-200k"): (225.3, 268.0),
}
INPUT = {"random-64k": 64000, "random-200k": 200000}
# what the study derived from those (the table's "result" column and its last row)
PUBLISHED = [
    {"kind": "ratio", "workload": "random-64k", "metric": "duration_s", "leader": "vllm", "value": 1.5},
    {"kind": "ratio", "workload": "random-200k", "metric": "duration_s", "leader": "sglang", "value": 1.31},
    {"kind": "ratio", "workload": "random-64k", "metric": "steady_decode_tps", "leader": "vllm",
     "value": 1.5},
    {"kind": "ratio", "workload": "random-200k", "metric": "steady_decode_tps", "leader": "sglang",
     "value": 1.64},
    {"kind": "degradation", "arm": "vllm", "metric": "steady_decode_tps", "value": 3.29},
    {"kind": "degradation", "arm": "sglang", "metric": "steady_decode_tps", "value": 1.25},
    # measurement rule 2: one tool's output throughput for the vLLM 200K run
    {"kind": "throughput", "arm": "vllm", "workload": "random-200k", "value": 1111.61, "source": "a tool's"},
]  # fmt: skip


def record_study(tracker: Tracker) -> str:
    """The study as k3pipe records one: a study run, an arm run per engine nested under it, a
    workload run per scenario nested under its arm, with the workload's params and its figures."""
    study = tracker.start_run(
        "study/kimi-k3-8xb300", tags={"k3pipe.kind": STUDY_KIND, "k3pipe.experiment": "kimi-k3-8xb300"}
    )
    tracker.log_dict(study, PUBLISHED, CLAIMS_FILE)
    # the study decided on what it published: end-to-end time and steady decode
    tracker.log_dict(study, {"decision": {"metrics": ["duration_s", "steady_decode_tps"]}}, "experiment.json")
    for arm in ("vllm", "sglang"):
        arm_run = tracker.start_run(
            f"kimi-k3-8xb300/{arm}",
            tags={"k3pipe.arm": arm, "k3pipe.engine": arm, "k3pipe.experiment": "kimi-k3-8xb300"},
            parent_id=study,
        )
        # field-notes.md, "Cold start": vLLM ~10.6 min, SGLang ~10.2 min
        tracker.log_metrics(arm_run, {"cold_start_s": 636.0 if arm == "vllm" else 612.0})
        for workload, tokens in INPUT.items():
            e2e, steady = RESULTS[(arm, workload)]
            run = tracker.start_run(
                f"{arm}/{workload}", tags={"k3pipe.arm": arm, "k3pipe.workload": workload}, parent_id=arm_run
            )
            tracker.log_params(
                run,
                {"workload.input_tokens": tokens, "workload.output_tokens": 3000, "workload.concurrency": 10},
            )
            tracker.log_metrics(
                run,
                {
                    "duration_s": e2e,
                    "steady_decode_tps": steady,
                    "completed": 10,
                    "output_tokens_total": 30000,
                },
            )
            tracker.end_run(run)
        tracker.end_run(arm_run)
    tracker.end_run(study)
    return study


@pytest.fixture
def report(tmp_path: Path):  # type: ignore[no-untyped-def]
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "golden", tmp_path / "artifacts")
    return build_report(tracker, record_study(tracker))


def _row(report, workload: str, metric: str):  # type: ignore[no-untyped-def]
    return next(r for r in report.analysis.rows if r.workload == workload and r.metric.key == metric)


def test_the_report_reproduces_the_studys_leaders_and_ratios(report) -> None:  # type: ignore[no-untyped-def]
    e64, e200 = _row(report, "random-64k", "duration_s"), _row(report, "random-200k", "duration_s")
    assert (e64.leader, round(e64.ratio, 2)) == ("vllm", 1.50)
    assert (e200.leader, round(e200.ratio, 2)) == ("sglang", 1.31)
    d64, d200 = (
        _row(report, "random-64k", "steady_decode_tps"),
        _row(report, "random-200k", "steady_decode_tps"),
    )
    assert (d64.leader, round(d64.ratio, 2)) == ("vllm", 1.50)
    assert (d200.leader, round(d200.ratio, 2)) == ("sglang", 1.64)
    # one figure per cell: no test, and the report says so rather than calling a winner
    assert all(not v.tested for r in report.analysis.rows for v in r.verdicts)
    t64 = _row(report, "random-64k", "duration_s")
    assert t64.decision
    assert "(a single value: no test)" in t64.verdicts[0].text()


def test_degradation_and_the_flip(report) -> None:  # type: ignore[no-untyped-def]
    slow = {(d.arm, d.metric.key): d.factor for d in report.analysis.degradations}
    assert round(slow[("sglang", "steady_decode_tps")], 2) == 1.25
    assert round(slow[("vllm", "steady_decode_tps")], 2) == 3.07  # 501 / 163
    assert round(slow[("vllm", "duration_s")], 2) == 2.94  # 295.2 / 100.5
    flips = {f.metric.key: f for f in report.analysis.flips}
    e2e = flips["duration_s"]
    assert (e2e.before, e2e.after, e2e.between) == ("vllm", "sglang", (64000, 200000))
    # vLLM - SGLang: -50.3 s at 64K, +69.9 s at 200K: they cross at 64000 + 136000 * 50.3 / 120.2
    assert e2e.at_tokens == pytest.approx(64000 + 136000 * 50.3 / 120.2, rel=1e-6)
    assert flips["steady_decode_tps"].before == "vllm"


def test_published_figures_are_checked_not_copied(report) -> None:  # type: ignore[no-untyped-def]
    checks = {c.what: c for c in report.analysis.claims}
    assert len(checks) == 6
    failing = [c for c in checks.values() if not c.follows]
    assert len(failing) == 1
    (wrong,) = failing
    assert wrong.published == 3.29
    assert wrong.computed == pytest.approx(501 / 163)
    assert "DOES NOT FOLLOW from the study's own inputs" in report.markdown


def test_the_physical_bound_catches_the_tools_throughput(report) -> None:  # type: ignore[no-untyped-def]
    (claim,) = [b for b in report.analysis.bounds if b.figure == "a tool's figure"]
    assert claim.ceiling_tps == pytest.approx(10 * 3000 / 295.2)
    assert claim.exceeds
    assert claim.ratio == pytest.approx(1111.61 / (30000 / 295.2))
    # the study's steady figures are above tokens / wall (prefill is excluded): not called impossible
    steady = [b for b in report.analysis.bounds if b.figure == "steady decode throughput"]
    assert steady
    assert not any(b.exceeds for b in steady)
    assert "IMPOSSIBLE: above the ceiling" in report.markdown


def test_the_report_renders_markdown_html_and_figures(report, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    paths = report.write(tmp_path / "out")
    html = paths["html"].read_text()
    assert html.startswith("<!doctype html>")
    assert "data:image/png;base64," in html  # self-contained
    assert "by_input_length.png" in report.figures
    assert (tmp_path / "out" / "plots" / "by_input_length.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = paths["markdown"].read_text()
    assert "| random-64k | 64,000 | end-to-end time" in md
    assert "Where the leader flips" in md


def test_k3pipe_report_regenerates_it_from_mlflow_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from k3pipe.cli.main import app

    monkeypatch.setenv("K3PIPE_HOME", str(tmp_path / "home"))
    tracker = Tracker(
        f"sqlite:///{tmp_path / 'home' / 'mlflow' / 'mlflow.db'}", "k3pipe", tmp_path / "artifacts"
    )
    study = record_study(tracker)
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["report", study[:8], "--out", str(out), "--attach"])
    assert result.exit_code == 0, result.output
    assert "random-200k" in result.output
    assert "2 figure(s) flagged: see the report's checks" in result.output  # 1111.61 tok/s, and 3.29x
    assert f"report: {out / 'report.html'}" in result.output
    assert (out / "report.html").read_text().startswith("<!doctype html>")
    attached = {a.path for a in tracker.client.list_artifacts(study, "report")}
    assert "report/report.html" in attached
    # not a study's run: the error names what to give instead
    arm = tracker.children(study)[0].info.run_id
    result = CliRunner().invoke(app, ["report", arm])
    assert result.exit_code != 0
    assert "is not a study's run" in result.output
