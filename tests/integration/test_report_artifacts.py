"""A report whose artifacts cannot be read is not written; a moved store is read with --artifact-root.

A study's MLflow store made on one machine (a GPU node) and reported on another records the node's
artifact paths. The store here is made as a node makes it (a real SQLite store, the arms recorded by
k3pipe.records.recorder's ArmRecorder: repeats.json, requests.parquet per repeat), its reports built in place,
then its artifact directory is moved away as a tarball's copy would be: without --artifact-root the
report fails naming the run, the workload, the artifact and the root it looked in; with it, the
report is the one made before the move. A one-repeat study still reports its untested cells, and a
repeat that failed before its requests were logged is no error. The store is made once per module
(an MLflow store's first tables take seconds); the tests only read it, or a copy of its artifacts.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from k3pipe.bench import RequestRecord, WorkloadResult, summarize
from k3pipe.bench.session import WorkloadOutcome
from k3pipe.cli.main import app
from k3pipe.core.errors import ArtifactMissingError, ArtifactStoreError, TrackingError
from k3pipe.experiment.load import parse_experiment
from k3pipe.jobs.retest_run import retest_targets, start_retest
from k3pipe.jobs.study_run import start_study
from k3pipe.planning.plan import plan_arm
from k3pipe.records.recorder import ArmRecorder, close_abandoned
from k3pipe.records.tracking import Tracker
from k3pipe.report import build_report
from k3pipe.report.collect import collect, requests_frame
from k3pipe.report.retest_verdicts import build_retest_report
from k3pipe.schema.specs import ExperimentSpec, WorkloadSpec

EXPERIMENT = "moved-store"
RUN_ID = "[0-9a-f]{32}"
T0 = 100.0
# TTFT in seconds per arm: "slow" is 30% slower, each repeat a little different (a t-test has spread)
TTFT_S = {"fast": 0.100, "slow": 0.130}


def _arm(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "engine": {"kind": "vllm"},
        "launcher": {"kind": "external"},
        "endpoint": {"base_url": "http://127.0.0.1:9/v1", "model": "m"},
    }


def _spec(
    name: str,
    repeats: int,
    arms: tuple[str, ...] = ("fast", "slow"),
    launches: int | None = None,
    **extra: Any,
) -> ExperimentSpec:
    workloads = [
        {"name": "short", "input_tokens": 8, "output_tokens": 4, "num_requests": 2, "concurrency": 2,
         "warmup_requests": 0, "repeats": repeats, "seed": 1},
        {"name": "long", "input_tokens": 32, "output_tokens": 4, "num_requests": 2, "concurrency": 2,
         "warmup_requests": 0, "repeats": repeats, "seed": 5},
    ]  # fmt: skip
    return parse_experiment(
        {
            "name": name,
            "model": {"source": "local", "path": "/nonexistent"},
            "arms": [{**_arm(a), **({"launches": launches} if launches else {})} for a in arms],
            "workloads": workloads,
            **extra,
        }
    )


def _outcome(workload: WorkloadSpec, repeat: int, ttft_s: float) -> WorkloadOutcome:
    """One repeat of two requests, 4 tokens each 10 ms apart after a TTFT of ``ttft_s``."""
    records = [
        RequestRecord(
            index=i, warmup=False, prompt_tokens=workload.input_tokens, max_tokens=4, usage_output_tokens=4,
            t_scheduled=T0, t_send=T0, t_first_delta=T0 + ttft_s, t_first_content=T0 + ttft_s,
            chunk_times=[T0 + ttft_s + 0.01 * k for k in range(4)], chunk_tokens=[1, 1, 1, 1],
            t_end=T0 + ttft_s + 0.03, status_code=200,
        )
        for i in range(2)
    ]  # fmt: skip
    result = WorkloadResult(
        workload=workload.name, records=records, t_start=T0, t_end=T0 + ttft_s + 0.03, started_at_unix_s=0
    )
    return WorkloadOutcome(
        result, summarize(result, workload.slo), repeat=repeat, seed=workload.seed + repeat
    )


def _record_arms(tracker: Tracker, spec: ExperimentSpec, study: str, home: Path, scale: float = 1.0) -> None:
    """Every launch of every arm on every workload, each repeat recorded as a node's ArmRecorder
    records it (a launch moves every repeat a little: restart noise)."""
    for arm in spec.arms:
        for launch in range(1, arm.launches + 1):
            tags = {"k3pipe.launch": str(launch), "k3pipe.launches": str(arm.launches)}
            rec = ArmRecorder(tracker, plan_arm(spec, arm, home), tags=tags, parent_id=study)
            for w in spec.workloads:
                for k in range(w.repeats):
                    ttft = TTFT_S[arm.name] * scale * (1 + 0.01 * k) * (1 + w.input_tokens / 320)
                    rec.log_workload(w, _outcome(w, k, ttft * (1 + 0.015 * launch)))
            rec.finish("FINISHED")
    tracker.end_run(study)


def _record_partial(tracker: Tracker, home: Path) -> str:
    """A study whose arm "fast" lost its second repeat before its requests were logged (the write of
    requests.parquet failed: record.py ends that repeat FAILED and never tags it k3pipe.client_timing),
    and whose arm "slow" was killed after one repeat (its process died: close_abandoned ends its runs
    KILLED, and its workloads never got their repeats.json)."""
    spec = _spec("partial", 2)
    study = start_study(tracker, spec, "partial.yaml")
    w = spec.workloads[0]
    fast = ArmRecorder(tracker, plan_arm(spec, spec.arms[0], home), parent_id=study)
    fast.log_workload(w, _outcome(w, 0, 0.1))
    real = tracker.log_frame

    def failing(run_id: str, frame: Any, artifact_file: str) -> None:
        if artifact_file == "requests.parquet":
            raise RuntimeError("the artifact store refused the write")
        real(run_id, frame, artifact_file)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tracker, "log_frame", failing)
        with pytest.raises(RuntimeError, match="refused the write"):
            fast.log_workload(w, _outcome(w, 1, 0.1))
    fast.finish("FAILED", RuntimeError("the artifact store refused the write"))
    slow = ArmRecorder(tracker, plan_arm(spec, spec.arms[1], home), parent_id=study)
    slow.log_workload(w, _outcome(w, 0, 0.13))
    close_abandoned(tracker, slow.run_id, "killed (SIGKILL)")  # the study's run above it too
    return study


@dataclass
class Store:
    uri: str
    recorded_root: Path
    """Where the node kept the artifacts (what the store records): gone after the move."""
    moved_root: Path
    """Where the copy of them is now (a tarball unpacked)."""
    studies: dict[str, str]
    """"repeats" (2 repeats, two arms), "single" (1 repeat), "partial"; "retest": a retest's run."""
    before: dict[str, Any]
    """Each one's report built in place, before the move: its results (or verdict) table rows."""

    def tracker(self, moved: bool = False) -> Tracker:
        return Tracker(self.uri, EXPERIMENT, read_artifacts_from=self.moved_root if moved else None)

    def workload_run(self, tracker: Tracker, study: str, arm: str, workload: str) -> Any:
        """The workload's run under the arm's first launch."""
        arm_run = min(
            (r for r in tracker.children(study) if r.data.tags.get("k3pipe.arm") == arm),
            key=lambda r: r.info.start_time,
        )
        runs = tracker.children(arm_run.info.run_id)
        return next(w for w in runs if w.data.tags["k3pipe.workload"] == workload)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    base = tmp_path_factory.mktemp("moved-store")
    node = base / "node"
    with pytest.MonkeyPatch.context() as mp:  # as clean_environ does, while the module's store is made
        for key in [k for k in os.environ if k.startswith(("K3PIPE_", "MLFLOW_", "MODELSCOPE_"))]:
            mp.delenv(key)
        mp.setenv("K3PIPE_HOME", str(base / "home"))
        uri = f"sqlite:///{node / 'mlflow.db'}"
        tracker = Tracker(uri, EXPERIMENT, node / "artifacts")
        studies = {}
        # "repeats": two launches an arm (the default where arms compare); "single": one of one repeat
        for label, repeats in (("repeats", 2), ("single", 1)):
            spec = _spec(f"study-{label}", repeats, launches=2 if label == "repeats" else 1)
            studies[label] = start_study(tracker, spec, f"{label}.yaml")
            _record_arms(tracker, spec, studies[label], base)
        studies["partial"] = _record_partial(tracker, base)
        retest_spec = _spec(
            "retest", 2, arms=("fast",),
            variants=[{"name": "slower", "description": "30% slower", "arms": {"fast": {"args": {"x": 1}}}}],
        )  # fmt: skip
        targets = retest_targets(retest_spec)
        retest = start_retest(tracker, retest_spec, "retest.yaml", targets)
        for t in targets:
            study = start_study(
                tracker, t.spec, "retest.yaml", tags={"k3pipe.variant": t.label}, parent_id=retest
            )
            _record_arms(tracker, t.spec, study, base, scale=1.3 if t.label == "slower" else 1.0)
        tracker.end_run(retest)
        studies["retest"] = retest
        before: dict[str, Any] = {
            label: build_report(tracker, studies[label]) for label in ("repeats", "single", "partial")
        }
        before["retest"] = build_retest_report(tracker, retest)
        tracker.close()
    moved = base / "record" / "mlflow" / "artifacts"
    moved.parent.mkdir(parents=True)
    shutil.move(node / "artifacts", moved)
    return Store(uri, node / "artifacts", moved, studies, before)


def test_in_place_a_one_repeat_study_reports_untested_cells(store: Store) -> None:
    """Before the move: the reports were built, the one-repeat study's cells untested (said so),
    the study of repeats tested, the retest judged."""
    single = store.before["single"]
    assert single.analysis.tests == 0
    texts = [v.text() for r in single.analysis.rows for v in r.verdicts]
    assert texts
    assert all("(a single value: no test)" in t for t in texts)
    assert store.before["repeats"].analysis.tests > 0
    assert {c.workload: len(c.values["ttft_ms_p50"]) for c in store.before["repeats"].data.cells} == {
        "short": 4,
        "long": 4,
    }
    assert any(
        v.outcome is not None and v.outcome.outcome != "untested" for v in store.before["retest"].verdicts
    )


def test_a_moved_store_is_not_reported_as_single_repeats(store: Store) -> None:
    tracker = store.tracker()
    study = store.studies["repeats"]
    with pytest.raises(ArtifactStoreError) as raised:
        build_report(tracker, study)
    err = raised.value
    message = str(err)
    said = re.match(
        rf"workload (short|long) of arm fast \(FINISHED, 2 repeats\): the artifacts of run ({RUN_ID}) ",
        message,
    )
    assert said, message
    wl = store.workload_run(tracker, study, "fast", said[1])
    assert said[2] == err.run_id == wl.info.run_id
    assert err.artifact == "repeats.json"
    assert err.root == str(store.recorded_root)
    assert f"the artifact root {store.recorded_root} that the MLflow store records" in message
    assert "does not exist on this machine" in message
    assert "--artifact-root DIR" in message
    # collect alone too: never the workload's means as one repeat
    with pytest.raises(ArtifactStoreError):
        collect(tracker, study)


def test_with_artifact_root_the_report_is_the_one_made_before_the_move(store: Store) -> None:
    tracker = store.tracker(moved=True)
    for label in ("repeats", "single", "partial"):
        report = build_report(tracker, store.studies[label])
        assert report.table_rows() == store.before[label].table_rows(), label
        assert report.markdown == store.before[label].markdown, label
    single = build_report(tracker, store.studies["single"])
    assert all("(a single value: no test)" in v.text() for r in single.analysis.rows for v in r.verdicts)
    retest = build_retest_report(tracker, store.studies["retest"])
    assert retest.table_rows() == store.before["retest"].table_rows()
    assert retest.data.descriptions == {"slower": "30% slower"}  # variants.json, read from the copy


def test_a_one_repeat_study_or_a_retest_in_a_moved_store_fails_too(store: Store) -> None:
    tracker = store.tracker()
    # one repeat: no repeats.json to read, but its requests (steady decode, the distributions)
    with pytest.raises(ArtifactStoreError, match=r"^the requests of workload \w+ of arm fast: ") as e:
        build_report(tracker, store.studies["single"])
    assert e.value.artifact == "requests.parquet"
    with pytest.raises(ArtifactStoreError, match=r"^workload \w+ of arm fast \(FINISHED, 2 repeats\): "):
        build_retest_report(tracker, store.studies["retest"])


def test_a_repeat_that_failed_before_its_requests_were_logged_is_no_error(store: Store) -> None:
    """What record.py writes: a repeat whose requests.parquet could not be logged ends FAILED without
    the k3pipe.client_timing tag; the workload of an arm killed mid-way has no repeats.json and so no
    values (not its means as one repeat)."""
    tracker = store.tracker(moved=True)
    data = collect(tracker, store.studies["partial"])
    fast = data.cell("fast", "short")
    assert fast is not None
    assert fast.status == "FAILED"  # one of its two repeats ran
    assert len(fast.values["ttft_ms_p50"]) == 1
    repeats = [tracker.client.get_run(r) for r in fast.request_runs]
    assert [r.info.status for r in repeats] == ["FINISHED", "FAILED"]
    assert "k3pipe.client_timing" not in repeats[1].data.tags
    assert tracker.find_artifact(repeats[1].info.run_id, "requests.parquet") is None
    frame = requests_frame(tracker, fast)
    assert frame is not None
    assert len(frame) == 2  # the first repeat's two requests
    killed = data.cell("slow", "short")
    assert killed is not None
    assert killed.status == "KILLED"
    assert killed.values == {}
    assert tracker.find_artifact(killed.run_id, "repeats.json") is None


def test_a_missing_repeats_json_or_requests_is_named(store: Store, tmp_path: Path) -> None:
    """A store that can be read but lacks what a run must hold: ArtifactMissingError (not a store
    error), with what the run does hold."""
    copy = tmp_path / "artifacts"
    shutil.copytree(store.moved_root, copy)
    tracker = Tracker(store.uri, EXPERIMENT, read_artifacts_from=copy)
    study = store.studies["repeats"]
    wl = store.workload_run(tracker, study, "slow", "long")
    (copy / wl.info.run_id / "artifacts" / "repeats.json").unlink()
    with pytest.raises(ArtifactMissingError) as raised:
        build_report(tracker, study)
    assert not isinstance(raised.value, ArtifactStoreError)
    message = str(raised.value)
    assert message.startswith(f"workload long of arm slow (FINISHED, 2 repeats): run {wl.info.run_id} has ")
    where = copy / wl.info.run_id / "artifacts"
    assert f"has no artifact repeats.json: its artifacts at {where} are " in message
    assert "repeats.parquet" in message  # what it holds

    (copy / wl.info.run_id / "artifacts").mkdir(exist_ok=True)
    (copy / wl.info.run_id / "artifacts" / "repeats.json").write_bytes(
        (store.moved_root / wl.info.run_id / "artifacts" / "repeats.json").read_bytes()
    )
    second = next(r for r in tracker.children(wl.info.run_id) if r.data.tags["k3pipe.repeat"] == "2")
    (copy / second.info.run_id / "artifacts" / "requests.parquet").unlink()
    with pytest.raises(ArtifactMissingError, match=r"^the requests of workload long of arm slow: run ") as e:
        build_report(tracker, study)
    assert e.value.run_id == second.info.run_id
    assert e.value.artifact == "requests.parquet"


def test_the_tracker_tells_absent_from_unreadable(store: Store, tmp_path: Path) -> None:
    study = store.studies["repeats"]
    tracker = store.tracker()
    # the other callers' read_artifact is as it was: None, whatever the reason
    assert tracker.read_artifact(study, "experiment.json") is None
    with pytest.raises(ArtifactStoreError, match="does not exist on this machine"):
        tracker.find_artifact(study, "experiment.json")
    moved = store.tracker(moved=True)
    assert json.loads(moved.find_artifact(study, "experiment.json") or b"{}")["name"] == "study-repeats"
    assert moved.find_artifact(study, "no-such.json") is None
    absent = "has no artifact no-such.json: its artifacts at .* are experiment.json;"
    with pytest.raises(ArtifactMissingError, match=absent):
        moved.read_artifact(study, "no-such.json", required=True)
    # a tracker reading a moved store writes no artifact (MLflow would write it to the node's path)
    with pytest.raises(TrackingError, match=r"cannot write artifact notes\.txt"):
        moved.log_text(study, "x", "notes.txt")
    assert not store.recorded_root.exists()
    nope = tmp_path / "nope"
    with pytest.raises(TrackingError, match=re.escape(f"artifact root {nope} (--artifact-root) does not")):
        Tracker(store.uri, EXPERIMENT, read_artifacts_from=tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ArtifactStoreError, match=re.escape(f"--artifact-root {empty} holds the artifacts")):
        Tracker(store.uri, EXPERIMENT, read_artifacts_from=empty).check_artifact_root(study)
    moved.check_artifact_root(study)


@pytest.fixture
def cli_env(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.uri)
    monkeypatch.setenv("K3PIPE_MLFLOW_EXPERIMENT", EXPERIMENT)


def _errors(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error: ")]


def test_k3pipe_report_fails_then_reads_the_moved_store(cli_env: None, store: Store, tmp_path: Path) -> None:
    study = store.studies["repeats"]
    result = CliRunner().invoke(app, ["report", study[:12], "--out", str(tmp_path / "none")])
    assert result.exit_code == 2, result.output
    (line,) = _errors(result.output)
    said = rf"error: workload \w+ of arm fast \(FINISHED, 2 repeats\): the artifacts of run {RUN_ID} "
    assert re.match(said, line), line
    assert "repeats.json" in line
    assert str(store.recorded_root) in line
    assert "--artifact-root DIR" in line
    assert not (tmp_path / "none").exists()  # no report written

    out = tmp_path / "out"
    result = CliRunner().invoke(
        app, ["report", study[:12], "--out", str(out), "--artifact-root", str(store.moved_root)]
    )
    assert result.exit_code == 0, result.output
    assert json.loads((out / "report.json").read_text()) == store.before["repeats"].table_rows()
    assert (out / "report.md").read_text() == store.before["repeats"].markdown

    retest = store.studies["retest"]
    result = CliRunner().invoke(app, ["report", retest, "--out", str(tmp_path / "r")])
    assert result.exit_code == 2, result.output
    assert len(_errors(result.output)) == 1
    result = CliRunner().invoke(
        app, ["report", retest, "--out", str(tmp_path / "r"), "--artifact-root", str(store.moved_root)]
    )
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "r" / "retest.json").read_text()) == store.before["retest"].table_rows()


def test_k3pipe_report_refuses_a_wrong_artifact_root_and_attach(
    cli_env: None, store: Store, tmp_path: Path
) -> None:
    study = store.studies["repeats"]
    for bad, said in (
        (tmp_path / "nope", f"artifact root {tmp_path / 'nope'} (--artifact-root) does not exist"),
        (tmp_path, f"--artifact-root {tmp_path} holds the artifacts of none of the "),
    ):
        result = CliRunner().invoke(app, ["report", study, "--artifact-root", str(bad)])
        assert result.exit_code == 2, result.output
        (line,) = _errors(result.output)
        assert said in line
    result = CliRunner().invoke(app, ["report", study, "--attach", "--artifact-root", str(store.moved_root)])
    assert result.exit_code == 2, result.output
    (line,) = _errors(result.output)
    assert line.startswith(f"error: --attach cannot be used with --artifact-root {store.moved_root}")
    assert not store.recorded_root.exists()  # nothing written where the store records the artifacts
    attached = store.moved_root / study / "artifacts" / "report"
    assert not attached.exists()


def test_k3pipe_compare_reads_repeats_from_the_moved_store(cli_env: None, store: Store) -> None:
    tracker = store.tracker()
    study = store.studies["repeats"]
    a, b = (store.workload_run(tracker, study, arm, "short").info.run_id for arm in ("fast", "slow"))
    args = ["compare", a, b, "--metric", "ttft_ms_p50"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    (line,) = _errors(result.output)
    assert f"workload short of arm fast (FINISHED, 2 repeats): the artifacts of run {a} cannot" in line
    assert "repeats.json" in line
    result = CliRunner().invoke(app, [*args, "--artifact-root", str(store.moved_root)])
    assert result.exit_code == 0, result.output
    row = next(x for x in result.output.splitlines() if x.startswith("ttft_ms_p50"))
    assert "needs repeats" not in row
    assert "+30.0%" in row
