"""The retest flow for real (a temporary Prefect server, a real SQLite MLflow store): the baseline
and its variants each run as a study nested under one retest run, a variant with the baseline's
workloads sends the baseline's very prompts, a variant that cannot run is recorded while the others
go on, and the report judges each variant against the baseline. The arm is an `external` endpoint
served by the scripted OpenAI server (k3pipe/testing/scripted_openai.py: real HTTP and SSE, fixed timing)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from k3pipe.core.settings import Settings
from k3pipe.jobs.rerun import read_record
from k3pipe.records.history import recent_runs
from k3pipe.records.tracking import Tracker
from k3pipe.report.retest_verdicts import build_retest_report
from k3pipe.testing.scripted_openai import Script, ScriptedOpenAI
from tests.conftest import TINY_MODEL

# Not serial: the variant's requests take four times as long (32 tokens against 8, 30 ms apart): 0.7 s
# more a wave, far above what a loaded machine adds (beside the other workers, a variant twice as long
# at 10 ms a token, 80 ms more, once came out within noise: 2026-12-03)
pytestmark = pytest.mark.flow


def _experiment(base_url: str, docs: str = "/nonexistent/k3pipe-docs") -> dict:
    return {
        "name": "retest-test",
        "model": {"source": "local", "path": str(TINY_MODEL)},
        "arms": [
            {
                "name": "fast",
                "engine": {"kind": "vllm", "args": {"max_num_seqs": 4}},
                "launcher": {"kind": "external"},
                "endpoint": {"base_url": base_url, "model": "m"},
            }
        ],
        "workloads": [
            {
                "name": "in32",
                "input_tokens": 32,
                "output_tokens": 8,
                "concurrency": 2,
                "num_requests": 4,
                "warmup_requests": 0,
                "repeats": 3,
                "seed": 1,
            },
        ],
        # the variants change the output length: end-to-end time is what this retest decides on
        "decision": {"metrics": ["duration_s", "output_throughput_tps"]},
        "variants": [
            {
                "name": "longer",
                "description": "four times the output",
                "arms": {"fast": {}},
                "workloads": {"output_tokens": 32},
            },
            {
                "name": "no-docs",
                "arms": {"fast": {}},
                "workloads": {"dataset": {"kind": "documents", "path": docs}},
            },
            {"name": "seqs8", "arms": {"fast": {"args": {"max_num_seqs": 8}}}},
        ],
    }


def test_the_retest_flow_judges_each_variant_against_the_baseline(  # type: ignore[no-untyped-def]
    prefect_harness: None, tmp_path: Path
) -> None:
    from k3pipe.flows.retest import VariantsFailed, retest

    if not (TINY_MODEL / "config.json").is_file():
        pytest.skip(f"no tiny model at {TINY_MODEL} (make model)")
    exp = tmp_path / "retest.yaml"
    # a variant whose prompts cannot be built: its folder passes preflight (a document is there) but
    # holds none as long as input_tokens, found when the prompts are drawn
    docs = tmp_path / "short-docs"
    docs.mkdir()
    (docs / "one.txt").write_text("too short to cut 32 tokens from")
    with ScriptedOpenAI(Script(inter_token_s=0.03), model="m") as server:
        exp.write_text(yaml.safe_dump(_experiment(server.base_url, str(docs))))
        with pytest.raises(VariantsFailed, match="no-docs") as failed:
            retest(str(exp))
    result = failed.value.result
    assert set(result["studies"]) == {"baseline", "longer", "seqs8"}
    assert set(result["failed"]) == {"no-docs"}
    assert str(docs) in result["failed"]["no-docs"]

    settings = Settings()
    tracker = Tracker(settings.tracking_uri(), settings.mlflow_experiment, settings.artifact_root())
    run = tracker.client.get_run(result["retest_run_id"])
    assert run.data.tags["k3pipe.kind"] == "retest"
    assert run.data.tags["k3pipe.failed_variants"] == "no-docs"
    assert run.info.status == "FINISHED"
    studies = {s.data.tags["k3pipe.variant"]: s for s in tracker.children(run.info.run_id)}
    assert set(studies) == {"baseline", "longer", "seqs8"}
    assert studies["longer"].info.run_name == "study/retest-test@longer"
    assert all(s.data.tags["k3pipe.kind"] == "study" for s in studies.values())

    # the variant with the baseline's workloads sent the baseline's very prompts
    def prompts(label: str) -> list[str]:
        # an experiment with variants compares: two launches an arm, both sending the same prompts
        first, second = sorted(tracker.children(studies[label].info.run_id), key=lambda r: r.info.start_time)
        sent = [p.sha256 for p in read_record(tracker, first.info.run_id).prompts]
        assert sent == [p.sha256 for p in read_record(tracker, second.info.run_id).prompts]
        return sent

    assert prompts("seqs8") == prompts("baseline")

    report = build_retest_report(tracker, run.info.run_id[:10])
    e2e = next(v for v in report.verdicts if v.variant == "longer" and v.metric.key == "duration_s")
    assert e2e.verdict == "worse"  # 32 tokens at 30 ms apart against 8
    assert e2e.outcome is not None
    assert e2e.outcome.restart == "measured"  # two launches a side
    assert e2e.ratio > 2
    assert {v.variant for v in report.verdicts} == {"longer", "seqs8"}
    assert "**no-docs**: not judged: " in report.markdown
    assert "longer: args" not in report.markdown  # workload changes are said as such
    assert "**longer**: fast: as in the baseline; every workload: output_tokens 32" in report.markdown
    artifacts = {a.path for a in tracker.client.list_artifacts(run.info.run_id, "report")}
    assert {"report/retest.md", "report/retest.html", "report/retest.json"} <= artifacts
    assert Path(result["report"]["markdown"]).read_text() == report.markdown
    assert Path(result["report"]["text"]).read_text() == report.text() + "\n"  # what `k3pipe retest` prints
    metrics = tracker.client.get_run(run.info.run_id).data.metrics
    assert metrics["verdict.longer.worse"] >= 1
    note = tracker.client.get_run(run.info.run_id).data.tags["mlflow.note.content"]
    assert note.startswith("Retest of **retest-test**: 3 variant(s) against the baseline.")
    # each study has its own report too
    for s in studies.values():
        assert "report/report.md" in {a.path for a in tracker.client.list_artifacts(s.info.run_id, "report")}

    # browsing the history: the retest with its studies, filtered by variant
    rows = recent_runs(tracker, 5)
    assert list(rows["workload"][:2]) == ["(retest)", "(study)"]
    assert rows["name"][0] == "retest/retest-test"
    assert "    retest-test@longer/fast#1" in set(rows["name"])
    longer = recent_runs(tracker, 5, variant="longer")
    assert [n.strip() for n in longer["name"]] == [
        "retest/retest-test", "study/retest-test@longer", "retest-test@longer/fast#1",
        "retest-test@longer/fast#2",
    ]  # fmt: skip
    assert recent_runs(tracker, 5, variant="nothing-like-it").empty
    from k3pipe.records.history import metric_history

    trend = metric_history(tracker, "duration_s", "in32", variant="longer")
    assert list(trend["variant"]) == ["longer", "longer"]  # its two launches
    assert set(metric_history(tracker, "duration_s", "in32")["variant"]) == {"", "longer", "seqs8"}
    assert list(metric_history(tracker, "duration_s", "in32", variant="baseline")["variant"]) == ["", ""]
