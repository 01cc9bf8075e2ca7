"""The MLflow adapter against a real SQLite store under tmp_path."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pandas as pd
import pytest

from k3pipe.bench import Prompt, PromptSet
from k3pipe.core.errors import TrackingError
from k3pipe.core.settings import Settings
from k3pipe.records.history import recent_runs
from k3pipe.records.tracking import Tracker, metric_name


@pytest.fixture
def tracker(tmp_path: Path) -> Tracker:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    return Tracker(uri, "test", tmp_path / "artifacts", secrets=["sk-topsecret-value"])


def test_metric_names() -> None:
    assert metric_name("vllm:time_to_first_token_seconds") == "vllm_time_to_first_token_seconds"
    assert metric_name("in256.ttft_ms_p50") == "in256.ttft_ms_p50"


def test_runs_params_metrics_artifacts(tracker: Tracker, tmp_path: Path) -> None:
    parent = tracker.start_run("exp/arm", tags={"k3pipe.arm": "arm"})
    child = tracker.start_run("arm/w", parent_id=parent)
    tracker.log_params(parent, {"short": "v", "long": "x" * 7000, "nested": {"a": 1}})
    tracker.log_metrics(child, {"ttft_ms_p50": 12.5, "vllm:x": 1, "none": None, "nan": float("nan")})
    tracker.log_frame(child, pd.DataFrame({"a": [1, 2]}), "requests.parquet")
    tracker.log_text(parent, "key sk-topsecret-value here", "notes.txt")
    tracker.end_run(child)
    tracker.end_run(parent, "FAILED")

    run = tracker.client.get_run(parent)
    assert run.data.params["short"] == "v"
    assert run.data.params["nested"] == '{"a": 1}'
    assert "artifact params/long.txt" in run.data.params["long"]
    assert run.info.status == "FAILED"
    crun = tracker.client.get_run(child)
    assert crun.data.metrics == {"ttft_ms_p50": 12.5, "vllm_x": 1.0}
    assert crun.data.tags["mlflow.parentRunId"] == parent
    names = {f.path for f in tracker.client.list_artifacts(child)}
    assert names == {"requests.parquet"}
    local = tracker.client.download_artifacts(parent, "notes.txt", str(tmp_path))
    assert Path(local).read_text() == "key *** here"
    assert [c.info.run_id for c in tracker.children(parent)] == [child]


def test_recent_runs_one_row_per_workload(tracker: Tracker) -> None:
    first = tracker.start_run("a")
    tracker.log_metrics(
        first,
        {
            "cold_start_s": 40.0,
            "w1.ttft_ms_p50": 9.0,
            "w2.ttft_ms_p50": 7.0,
            "w1.other": 1.0,
            "w1.tpot_ms_p50": 3.5,
            "w1.client_timing_bursty": 0.0,
            "w2.tpot_ms_p50": 0.0,
            "w2.client_timing_bursty": 1.0,
        },
    )
    tracker.start_run("child", parent_id=first)
    second = tracker.start_run("b")
    frame = recent_runs(tracker, 10)
    assert list(frame["run_id"]) == [second, first, first]
    assert list(frame["workload"]) == ["", "w1", "w2"]
    rows = frame.set_index("workload")
    assert rows.loc["w1", "ttft_ms_p50"] == 9.0
    assert rows.loc["w2", "ttft_ms_p50"] == 7.0
    assert rows.loc["w2", "cold_start_s"] == 40.0
    assert "other" not in frame.columns
    # a bursty workload's client TPOT is not shown as a speed
    assert rows.loc["w1", "tpot_ms_p50"] == 3.5
    assert rows.loc["w2", "tpot_ms_p50"] == "bursty"
    assert "client_timing_bursty" not in frame.columns
    assert len(recent_runs(tracker, 1)) == 1


def test_tracking_uri_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    settings = Settings()
    assert settings.tracking_uri() == f"sqlite:///{tmp_path / 'k3home' / 'mlflow' / 'mlflow.db'}"
    monkeypatch.setenv("K3PIPE_MLFLOW_TRACKING_URI", "sqlite:////tmp/other.db")
    assert Settings().tracking_uri() == "sqlite:////tmp/other.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5999")
    assert Settings().tracking_uri() == "http://127.0.0.1:5999"
    fields = {
        "tracking_uri": "http://127.0.0.1:5999",
        "experiment_id": "3",
        "_runs_url": Tracker._runs_url,
        "mlflow_id": lambda self, run_id: run_id,
        "spooled_only": lambda self, run_id: False,
    }
    server = type("T", (), fields)()
    # MLflow 3's UI opens in its GenAI view unless the link asks for the model-training one
    assert Tracker.run_link(server, "abc") == (
        "http://127.0.0.1:5999/#/experiments/3/runs/abc?workflowType=machine_learning"
    )
    assert Tracker.experiment_link(server) == (
        "http://127.0.0.1:5999/#/experiments/3/runs?workflowType=machine_learning"
    )


def test_dataset_inputs(tracker: Tracker) -> None:
    run = tracker.start_run("arm/w")
    prompts = PromptSet(
        name="sharegpt:sg.json",
        digest="0123456789abcdef",
        source="/data/sk-topsecret-value/sg.json",
        source_type="local",
        profile={"count": 2, "tokens_max": 9, "passed_filter": 140},
        prompts=[Prompt(text="hello there", tokens=2), Prompt(text="a b c", tokens=3)],
    )
    tracker.log_dataset(run, prompts)
    tracker.log_dataset(
        run,
        {
            "name": "random-in8-s0",
            "digest": "fedcba9876543210",
            "source_type": "generated",
            "source": "generated:random",
            "profile": {"count": 1},
        },
        context="warmup",
        schema={"mlflow_colspec": [{"name": "text", "type": "string"}]},
    )
    inputs = tracker.client.get_run(run).inputs.dataset_inputs
    found = {i.dataset.name: i for i in inputs}
    assert set(found) == {"sharegpt:sg.json", "random-in8-s0"}
    sharegpt = found["sharegpt:sg.json"]
    assert sharegpt.dataset.digest == "0123456789abcdef"
    assert sharegpt.dataset.source == "/data/***/sg.json"  # scrubbed like everything else
    assert sharegpt.dataset.source_type == "local"
    assert json.loads(sharegpt.dataset.profile) == {"count": 2, "tokens_max": 9, "passed_filter": 140}
    assert [(t.key, t.value) for t in sharegpt.tags] == [("mlflow.data.context", "benchmark")]
    generated = found["random-in8-s0"]
    assert generated.dataset.source == "generated:random"
    assert json.loads(generated.dataset.schema) == {"mlflow_colspec": [{"name": "text", "type": "string"}]}
    assert [(t.key, t.value) for t in generated.tags] == [("mlflow.data.context", "warmup")]
    with pytest.raises(TrackingError, match="needs digest"):
        tracker.log_dataset(run, {"name": "x", "source_type": "local", "source": "/x"})


def test_frames_are_scrubbed_of_secrets(tracker: Tracker, tmp_path: Path) -> None:
    run = tracker.start_run("r")
    frame = pd.DataFrame({"error": ["HTTP 401: Bearer sk-topsecret-value", None], "n": [1, 2]})
    tracker.log_frame(run, frame, "requests.parquet")
    back = pd.read_parquet(tracker.client.download_artifacts(run, "requests.parquet", str(tmp_path)))
    assert back["error"][0] == "HTTP 401: Bearer ***"
    assert pd.isna(back["error"][1])
    assert back["n"].tolist() == [1, 2]
    assert frame["error"][0].endswith("sk-topsecret-value")  # the caller's frame is left alone


def test_the_experiment_opens_on_its_runs_and_runs_say_where_they_came_from(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    # an experiment made before k3pipe tagged its experiments gets the tags too
    from mlflow import MlflowClient

    MlflowClient(tracking_uri=uri).create_experiment("older", artifact_location=(tmp_path / "a").as_uri())
    for name in ("fresh", "older"):
        tracker = Tracker(uri, name, tmp_path / "artifacts", secrets=["sk-topsecret-value"])
        tags = tracker.client.get_experiment(tracker.experiment_id).tags
        assert tags["mlflow.experimentKind"] == "custom_model_development"
        assert tags["mlflow.note.content"].startswith("k3pipe: inference-engine runs")
    fresh = Tracker(uri, "fresh", tmp_path / "artifacts")
    assert (
        fresh.client.get_experiment(fresh.experiment_id).artifact_location
        == (tmp_path / "artifacts").resolve().as_uri()
    )
    run_id = fresh.start_run("exp/arm")
    fresh.add_secret("sk-topsecret-value")
    fresh.describe(run_id, "arm **a**: key sk-topsecret-value")
    tags = fresh.client.get_run(run_id).data.tags
    assert tags["mlflow.source.name"] == "k3pipe"
    assert len(tags["mlflow.source.git.commit"]) == 40
    assert tags["mlflow.note.content"] == "arm **a**: key ***"


def test_log_file_keeps_a_binary_file_byte_for_byte_and_scrubs_text(tmp_path: Path) -> None:
    tracker = Tracker(f"sqlite:///{tmp_path / 'm.db'}", "t", tmp_path / "art", secrets=["sk-planted-1"])
    run = tracker.start_run("r")
    png = bytes([0x89]) + b"PNG\r\n\x1a\n" + bytes(range(256))
    (tmp_path / "figure.png").write_bytes(png)
    (tmp_path / "engine.log").write_text("key sk-planted-1 in a log line\n")
    tracker.log_file(run, tmp_path / "figure.png", "report/plots")
    tracker.log_file(run, tmp_path / "engine.log", "logs")
    assert tracker.read_artifact(run, "report/plots/figure.png") == png
    assert tracker.read_artifact(run, "logs/engine.log") == b"key *** in a log line\n"


def test_a_dataset_another_run_created_at_the_same_moment_is_linked_not_a_failure(
    tracker: Tracker, tmp_path: Path
) -> None:
    """Two launches on two nodes log one dataset at once: MLflow's SQL store looks for it, finds
    nothing, inserts, and the second insert is refused ("(psycopg2.errors.UniqueViolation) duplicate
    key value violates unique constraint", a fleet study's arm failed so on the team stack's
    PostgreSQL, 2026-12-07). The race, made here at will: the other run's log lands first, then this
    one's call gets the refusal the server returned; the push must link the existing dataset."""
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import BAD_REQUEST, INVALID_PARAMETER_VALUE

    first, second = tracker.start_run("a/w"), tracker.start_run("b/w")
    dataset = {"name": "random-in32-s2", "digest": "00ff00ff00ff00ff", "source_type": "generated",
               "source": "generated:random", "profile": {"count": 4}}  # fmt: skip
    pusher = tracker._writer.pusher
    real = pusher.client
    raced: list[str] = []

    class Racing:
        def __getattr__(self, name: str) -> object:
            return getattr(real, name)

        def log_inputs(self, run_id: str, datasets: list) -> None:
            if not raced:
                raced.append(run_id)
                real.log_inputs(first, datasets=datasets)  # the other node's, first
                raise MlflowException(
                    "(psycopg2.errors.UniqueViolation) duplicate key value violates unique constraint "
                    '"dataset_pk"', error_code=BAD_REQUEST
                )  # fmt: skip
            real.log_inputs(run_id, datasets=datasets)

    pusher.client = Racing()
    tracker.log_dataset(second, dataset)
    assert raced == [second]
    for run in (first, second):
        (linked,) = real.get_run(run).inputs.dataset_inputs
        assert (linked.dataset.name, linked.dataset.digest) == ("random-in32-s2", "00ff00ff00ff00ff")
    with sqlite3.connect(tmp_path / "mlflow.db") as db:  # one dataset row, the two runs' inputs to it
        rows = db.execute("SELECT name, digest FROM datasets").fetchall()
    assert rows == [("random-in32-s2", "00ff00ff00ff00ff")]

    # any other refusal is still the tracker's error, said with the dataset and the run
    class Refusing(Racing):
        def log_inputs(self, run_id: str, datasets: list) -> None:
            raise MlflowException("a dataset input is refused", error_code=INVALID_PARAMETER_VALUE)

    pusher.client = Refusing()
    with pytest.raises(TrackingError, match=r"could not log dataset 'random-in32-s2'.*is refused"):
        tracker.log_dataset(second, dataset)


def test_an_experiment_another_process_created_since_the_look_is_used(tmp_path: Path) -> None:
    """Two nodes' first runs on a new experiment of a tracking server: both look, neither finds it,
    both create; the second create is refused (RESOURCE_ALREADY_EXISTS, MLflow's own answer here on a
    real SQLite store), and that node uses the experiment the other made, its tags set."""
    from mlflow import MlflowClient

    from k3pipe.records.push import EXPERIMENT_TAGS, ensure_experiment

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    real = MlflowClient(tracking_uri=uri)
    other = real.create_experiment("fleet")  # the other node's, after this one's look
    looks: list[str] = []

    class LookedFirst:
        def __getattr__(self, name: str) -> object:
            return getattr(real, name)

        def get_experiment_by_name(self, name: str) -> object:
            looks.append(name)
            return None if len(looks) == 1 else real.get_experiment_by_name(name)

    assert ensure_experiment(LookedFirst(), uri, "fleet", tmp_path / "artifacts") == other
    assert looks == ["fleet", "fleet"]
    assert EXPERIMENT_TAGS.items() <= real.get_experiment(other).tags.items()
