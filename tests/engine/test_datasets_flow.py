"""The flow with every file-backed dataset against the real vLLM (the session's engine, external launcher).

ShareGPT conversations and long documents from the repo's generated fixtures
(``scripts/make_dataset_fixtures.py``), sent on /completions so that vLLM's ``usage.prompt_tokens``
must equal the client's own count of every prompt; each workload's prompts are an MLflow dataset input.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import yaml

from k3pipe.core.settings import Settings
from k3pipe.records.tracking import Tracker
from tests.conftest import RunningEngine, external_experiment

pytestmark = [pytest.mark.engine, pytest.mark.flow]

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "datasets"


def test_sharegpt_and_documents_through_the_flow(
    prefect_harness: None, vllm_engine: RunningEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from k3pipe.flows.benchmark import benchmark

    monkeypatch.setenv("ENGINE_KEY", vllm_engine.api_key)
    common = {"output_tokens": 8, "api": "completions", "num_requests": 6, "concurrency": 3}
    experiment = external_experiment(
        "datasets",
        vllm_engine,
        "ENGINE_KEY",
        [
            {
                "name": "chat",
                "input_tokens": 400,
                "dataset": {
                    "kind": "sharegpt",
                    "path": str(FIXTURES / "sharegpt_small.json"),
                    "min_input_tokens": 16,
                },
                "load": "constant",
                "rate_rps": 20,
                "slo": {"ttft_ms": 60_000},
                **common,
            },
            {
                "name": "docs",
                "input_tokens": 700,
                "dataset": {"kind": "documents", "path": str(FIXTURES / "documents")},
                **common,
            },
        ],
    )
    exp = tmp_path / "datasets.yaml"
    exp.write_text(yaml.safe_dump(experiment))

    (outcome,) = benchmark(str(exp))
    assert outcome["status"] == "FINISHED", outcome

    settings = Settings()
    tracker = Tracker(settings.tracking_uri(), settings.mlflow_experiment)
    children = {c.data.tags["k3pipe.workload"]: c for c in tracker.children(outcome["mlflow_run_id"])}
    assert set(children) == {"chat", "docs"}
    for name, kind, source in (
        ("chat", "sharegpt", FIXTURES / "sharegpt_small.json"),
        ("docs", "documents", FIXTURES / "documents"),
    ):
        run = children[name]
        assert run.info.status == "FINISHED"
        (dataset,) = run.inputs.dataset_inputs
        assert dataset.dataset.source_type == "local"
        assert dataset.dataset.source == str(source.resolve())
        assert dataset.dataset.name.startswith(kind)
        profile = json.loads(dataset.dataset.profile)
        assert profile["count"] == 6
        frame = pd.read_parquet(
            tracker.client.download_artifacts(run.info.run_id, "requests.parquet", str(tmp_path / name))
        )
        # the engine counted exactly the tokens the client says each prompt has
        assert (frame["usage_prompt_tokens"] == frame["prompt_tokens"]).all()
        if kind == "documents":
            assert (frame["prompt_tokens"] == 700).all()
        else:
            assert frame["prompt_tokens"].between(16, 400).all()
            assert frame["prompt_tokens"].nunique() > 1  # real conversations vary in length
            assert run.data.metrics["slo_attainment_pct"] == 100.0
            assert run.data.metrics["goodput_rps"] > 0
