"""`rerun` through the flow against the real vLLM (the session's engine, external launcher): the rerun
sends the recorded prompts, is tagged with its original and ends with a verdict per workload (one run
against one: "cannot tell" without restart noise kept for it); a model file changed on disk refuses it
before anything is sent."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from k3pipe.core.errors import RerunError
from k3pipe.core.layout import RERUN_TAG
from k3pipe.core.settings import Settings
from k3pipe.jobs.rerun import read_record
from k3pipe.records.tracking import Tracker
from tests.conftest import TINY_MODEL, RunningEngine, external_experiment

pytestmark = [pytest.mark.engine, pytest.mark.flow]


def test_rerun_repeats_the_run_and_judges_it(
    prefect_harness: None, vllm_engine: RunningEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from k3pipe.flows.benchmark import benchmark, rerun

    monkeypatch.setenv("ENGINE_KEY", vllm_engine.api_key)
    model_dir = tmp_path / "model"
    shutil.copytree(TINY_MODEL, model_dir)
    experiment = external_experiment(
        "rerun",
        vllm_engine,
        "ENGINE_KEY",
        [
            {"name": "w", "input_tokens": 48, "output_tokens": 8, "concurrency": 2, "num_requests": 4,
             "warmup_requests": 0, "seed": 11, "repeats": 2},
        ],
    )  # fmt: skip
    experiment["model"]["path"] = str(model_dir)
    exp = tmp_path / "rerun.yaml"
    exp.write_text(yaml.safe_dump(experiment))
    (first,) = benchmark(str(exp))
    assert first["status"] == "FINISHED", first
    exp.unlink()  # the rerun needs the record alone

    (again,) = rerun(first["mlflow_run_id"])
    assert again["status"] == "FINISHED", again
    assert again["rerun_of"] == first["mlflow_run_id"]
    (verdict,) = again["verdicts"]
    assert verdict["workload"] == "w"
    # two repeats each, one launch a side, and no earlier study kept this configuration's restart
    # noise on this machine: the headline figures are compared but not judged, and the verdict says
    # why. A figure that can be 0 on a busy CPU (TPOT or ITL p50 when a stream's chunks arrive
    # together) has no log: that repeat's value is left out and the figure may be untested (a
    # fresh-clone run, 2026-12-03)
    outcomes = {m["metric"]: m["outcome"] for m in verdict["metrics"]}
    for figure in ("ttft_ms_p50", "e2e_ms_p50", "output_throughput_tps"):
        assert outcomes[figure] == "unknown", outcomes
    assert verdict["verdict"].startswith("cannot tell: restart noise unknown"), verdict["verdict"]
    assert "within noise" not in verdict["verdict"]

    settings = Settings()
    tracker = Tracker(settings.tracking_uri(), settings.mlflow_experiment)
    new = tracker.client.get_run(again["mlflow_run_id"])
    assert new.data.tags[RERUN_TAG] == first["mlflow_run_id"]
    original, repeated = read_record(tracker, first["mlflow_run_id"]), read_record(tracker, new.info.run_id)
    assert repeated.rerun_of == first["mlflow_run_id"]
    assert repeated.drift == []
    assert [p.sha256 for p in repeated.prompts] == [p.sha256 for p in original.prompts]
    assert repeated.models["model"].digest() == original.models["model"].digest()

    # the same prompt sets went in as MLflow datasets, repeat by repeat
    def datasets(arm_run: str) -> list[str]:
        (workload,) = tracker.children(arm_run)
        repeats = sorted(tracker.children(workload.info.run_id), key=lambda r: r.data.tags["k3pipe.repeat"])
        return [r.inputs.dataset_inputs[0].dataset.digest for r in repeats]

    assert datasets(new.info.run_id) == datasets(first["mlflow_run_id"])

    # a model file changed on disk: the rerun refuses, naming the file and the way out
    with (model_dir / "tokenizer_config.json").open("a") as f:
        f.write(" ")
    with pytest.raises(RerunError, match=r"changed: tokenizer_config\.json.*--allow-drift"):
        rerun(first["mlflow_run_id"])
