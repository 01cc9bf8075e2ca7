"""The jobs without Prefect: a study and a benchmark run from the library alone
(``Job.library()``, the library's steps), typed request in, typed result out, the same records a flow
makes, the report built once. The arms are `external` endpoints served by the scripted OpenAI server
(k3pipe/testing/scripted_openai.py: real HTTP and SSE), the MLflow store a real SQLite one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from k3pipe.core.errors import SpecError
from k3pipe.core.settings import Settings
from k3pipe.experiment.params import Overrides, RunRequest
from k3pipe.jobs.benchmark import BenchmarkRequest, benchmark
from k3pipe.jobs.steps import Job
from k3pipe.jobs.study import ArmsFailed, study
from k3pipe.records.tracking import Tracker
from k3pipe.testing.scripted_openai import Script, ScriptedOpenAI
from tests.conftest import TINY_MODEL, free_port


def _experiment(arms: dict[str, str], launches: int | None = None) -> str:
    """``launches`` None: the default (2 an arm where arms are compared)."""
    return yaml.safe_dump(
        {
            "name": "jobs-test",
            "model": {"source": "local", "path": str(TINY_MODEL)},
            "arms": [
                {"name": name, "engine": {"kind": "vllm"}, "launcher": {"kind": "external"},
                 "endpoint": {"base_url": url, "model": "m"}, **({"launches": launches} if launches else {})}
                for name, url in arms.items()
            ],
            "workloads": [
                {"name": "in32", "input_tokens": 32, "output_tokens": 8, "concurrency": 2, "num_requests": 4,
                 "warmup_requests": 0, "repeats": 2, "seed": 1}
            ],
        }
    )  # fmt: skip


@pytest.fixture
def fast() -> Any:
    if not (TINY_MODEL / "config.json").is_file():
        pytest.skip(f"no tiny model at {TINY_MODEL} (make model)")
    with ScriptedOpenAI(Script(inter_token_s=0.002), model="m") as server:
        yield server


def _job(tmp_path: Path, published: dict[str, list[Any]]) -> Job:
    """The library's job on a SQLite store, its reports and tables noted in ``published``."""
    settings = Settings()
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "jobs", tmp_path / "artifacts")
    job = Job.library(settings, tracker)
    reports: list[str] = published.setdefault("reports", [])
    tables: list[Any] = published.setdefault("tables", [])
    report = job.steps.report

    def counted(tracker: Tracker, run_id: str, out: Path) -> dict[str, str]:
        reports.append(run_id)
        return report(tracker, run_id, out)

    job = job.with_steps(report=counted)
    return Job(
        job.settings, job.tracker, job.steps, table=lambda rows, key, what: tables.append((rows, key, what))
    )


def test_a_study_from_the_library_alone_records_reports_once_and_names_the_failed_arm(
    fast: ScriptedOpenAI, tmp_path: Path
) -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens: the arm's health gate fails
    published: dict[str, list[Any]] = {}
    job = _job(tmp_path, published)
    request = RunRequest(experiment_yaml=_experiment({"a": fast.base_url, "broken": dead}, launches=1))
    with pytest.raises(ArmsFailed, match="broken") as failed:
        study(request, job)
    typed, result = failed.value.study, failed.value.result
    assert [(o.arm, o.status) for o in typed.arms] == [("a", "FINISHED"), ("broken", "FAILED")]
    assert "Connect" in (typed.arms[1].error or ""), typed.arms[1].error
    assert result == typed.as_dict()  # the flow's dict of the same result
    assert [(o["arm"], o["status"]) for o in result["arms"]] == [("a", "FINISHED"), ("broken", "FAILED")]
    assert published["reports"] == [result["study_run_id"]]  # built once, by the job
    assert Path(result["report"]["html"]).is_file()
    assert Path(result["report"]["html"]).parent.name == f"jobs-test-{result['study_run_id'][:8]}"
    run = job.tracker.client.get_run(result["study_run_id"])
    assert run.data.tags["k3pipe.kind"] == "study"
    assert run.data.tags["prefect.flow_run_id"] == "none"  # no flow: said so, not left out
    arms = {r.data.tags["k3pipe.arm"]: r for r in job.tracker.children(result["study_run_id"])}
    assert arms["a"].info.status == "FINISHED"
    assert arms["broken"].info.status == "FAILED"


def test_a_benchmark_from_the_library_alone_publishes_its_table(fast: ScriptedOpenAI, tmp_path: Path) -> None:
    published: dict[str, list[Any]] = {}
    job = _job(tmp_path, published)
    run = RunRequest(
        experiment_yaml=_experiment({"a": fast.base_url, "b": fast.base_url}),
        arms=["b"],
        overrides=Overrides(repeats=1),
    )
    result = benchmark(BenchmarkRequest(run=run), job)
    assert [(o.arm, o.status, o.launch) for o in result.arms] == [("b", "FINISHED", 1)]
    outcomes = result.as_list()
    assert [(o["arm"], o["status"]) for o in outcomes] == [("b", "FINISHED")]
    assert set(outcomes[0]).isdisjoint({"rerun_of", "verdicts", "speculation"})  # unset: left out, as before
    assert published["reports"] == []  # a benchmark has no study report
    ((rows, key, what),) = published["tables"]
    assert key == "benchmark-summary"
    assert what == "jobs-test: workload summaries"
    assert [r["workload"] for r in rows] == ["in32"]
    arm_run = job.tracker.client.get_run(outcomes[0]["mlflow_run_id"])
    assert arm_run.data.params["override.repeats"] == "1"
    assert len(job.tracker.children(arm_run.info.run_id)) == 1  # one workload, one repeat


def test_a_benchmark_request_is_a_run_or_a_rerun_never_both() -> None:
    run = RunRequest(experiment="experiments/demo-cpu.yaml", arms=["vllm-cpu"])
    with pytest.raises(
        SpecError, match=r"rerun_of runs an arm again exactly as recorded.*arms \['vllm-cpu'\]"
    ):
        BenchmarkRequest(run=run, rerun_of="abc123")
    with pytest.raises(SpecError, match="needs an experiment"):
        BenchmarkRequest()
    plain = RunRequest(experiment="experiments/demo-cpu.yaml")
    assert BenchmarkRequest(run=plain, rerun_of="abc123").rerun_of == "abc123"


def test_a_study_rerun_from_its_records_is_compared_arm_by_arm(tmp_path: Path) -> None:
    """A two-arm study (two launches an arm, the default), then `rerun` of it: a new study tagged as the
    original's rerun, every arm from its record with the same prompts, each arm judged against the
    original's over both launches (restart noise in both sides). Between the
    two, arm b's server was made ten times slower: its verdict says different (slower). Arm a's
    server is unchanged, but the machine's load is not (three test workers on two cores doubled a
    2-ms token pacing once), so for a only its verdict is asserted to exist and its throughput to
    stay within a factor 2 (tokens paced at 20 ms, which load moves far less)."""
    from k3pipe.bench.repeats import Comparison
    from k3pipe.core.layout import RERUN_VERDICTS_FILE
    from k3pipe.jobs.rerun import read_record
    from k3pipe.jobs.study import rerun

    if not (TINY_MODEL / "config.json").is_file():
        pytest.skip(f"no tiny model at {TINY_MODEL} (make model)")
    with (
        ScriptedOpenAI(Script(inter_token_s=0.02), model="m") as a,
        ScriptedOpenAI(Script(inter_token_s=0.02), model="m") as b,
    ):
        job = _job(tmp_path, {})
        first = study(RunRequest(experiment_yaml=_experiment({"a": a.base_url, "b": b.base_url})), job)
        b.script = Script(inter_token_s=0.2)
        again = rerun(first.study_run_id, job)

    tracker = job.tracker
    assert again.rerun_of == first.study_run_id
    assert again.study_run_id != first.study_run_id
    assert [(o.arm, o.launch, o.status) for o in again.arms] == [
        ("a", 1, "FINISHED"), ("b", 1, "FINISHED"), ("b", 2, "FINISHED"), ("a", 2, "FINISHED")
    ]  # fmt: skip
    run = tracker.client.get_run(again.study_run_id)
    assert run.data.tags["k3pipe.rerun_of"] == first.study_run_id
    # the same prompts, from the original's records
    for before, after in zip(first.arms, again.arms, strict=True):
        assert (before.arm, before.launch) == (after.arm, after.launch)
        assert (
            read_record(tracker, after.mlflow_run_id).prompts
            == read_record(tracker, before.mlflow_run_id).prompts
        )
    verdicts = {(v["arm"], v["workload"]): v for v in again.verdicts}
    assert set(verdicts) == {("a", "in32"), ("b", "in32")}
    slower = verdicts[("b", "in32")]
    assert slower["verdict"].startswith("different"), slower["verdict"]
    throughput = next(
        Comparison.model_validate(m) for m in slower["metrics"] if m["metric"] == "output_throughput_tps"
    )
    assert throughput.different
    assert throughput.mean_b < throughput.mean_a / 3
    same = next(
        Comparison.model_validate(m)
        for m in verdicts[("a", "in32")]["metrics"]
        if m["metric"] == "output_throughput_tps"
    )
    assert same.mean_a / 2 < same.mean_b < same.mean_a * 2, verdicts[("a", "in32")]["verdict"]
    recorded = tracker.read_artifact(again.study_run_id, RERUN_VERDICTS_FILE)
    assert recorded is not None
    assert "b/in32: different" in run.data.tags["k3pipe.rerun_verdict"]
    assert slower["launches"] == "2 + 2 against 2 + 2"  # every launch a side, restart noise in both
    assert throughput.restart == "measured"


def test_a_retest_rerun_reruns_each_study_under_a_new_retest(tmp_path: Path) -> None:
    """A retest (baseline and one variant) from the library, then `rerun_retest` of it: a new retest
    run tagged as the original's rerun, each of its studies a rerun of the original's same study
    (same variant label), each launch judged against the original's, and the retest's report again."""
    from k3pipe.jobs.retest import rerun_retest, retest

    if not (TINY_MODEL / "config.json").is_file():
        pytest.skip(f"no tiny model at {TINY_MODEL} (make model)")
    data = yaml.safe_load(_experiment({"a": "http://127.0.0.1:9/v1"}))
    data["variants"] = [{"name": "longer", "arms": {"a": {}}, "workloads": {"output_tokens": 16}}]
    with ScriptedOpenAI(Script(inter_token_s=0.002), model="m") as server:
        data["arms"][0]["endpoint"]["base_url"] = server.base_url
        job = _job(tmp_path, {})
        first = retest(RunRequest(experiment_yaml=yaml.safe_dump(data)), job)
        again = rerun_retest(first.retest_run_id, job)

    tracker = job.tracker
    assert again.rerun_of == first.retest_run_id
    run = tracker.client.get_run(again.retest_run_id)
    assert run.data.tags["k3pipe.rerun_of"] == first.retest_run_id
    assert set(again.studies) == {"baseline", "longer"}
    for label, s in again.studies.items():
        assert s.rerun_of == first.studies[label].study_run_id
        study_run = tracker.client.get_run(s.study_run_id)
        assert study_run.data.tags["mlflow.parentRunId"] == again.retest_run_id
        assert study_run.data.tags["k3pipe.variant"] == label
        assert [(v["arm"], v["workload"]) for v in s.verdicts] == [("a", "in32")]
    assert Path(again.report["html"]).is_file()
