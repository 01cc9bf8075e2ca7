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


def test_a_trace_replayed_through_the_flow_sends_the_traces_prompt_lengths(
    prefect_harness: None, vllm_engine: RunningEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A small agent-like trace (k3pipe.schema.traces.agentic_trace) replayed on the real vLLM through
    the benchmark flow, on the chat API: the engine's own prompt tokens equal the trace's for every
    request, so the chat template's tokens were counted (the first turns) and a later turn carrying
    the engine's real answer, in the conversation the template renders, is as long as recorded."""
    from k3pipe.flows.benchmark import benchmark
    from k3pipe.schema.traces import agentic_trace, write_trace

    trace = agentic_trace(
        3, sessions=4, turns=(2, 4), context_tokens=1200, system_prompts=2, system_tokens=256,
        user_tokens=(16, 64), tool_tokens=(32, 128), output_tokens=(8, 24), think_s=0.3, burst_s=1.0,
        bursts=2, block_tokens=16,
    )  # fmt: skip
    write_trace(trace, tmp_path / "agent.jsonl")
    monkeypatch.setenv("ENGINE_KEY", vllm_engine.api_key)
    workload = {"name": "agent", "trace": {"path": str(tmp_path / "agent.jsonl"), "speed": 2}}
    exp = tmp_path / "trace.yaml"
    exp.write_text(yaml.safe_dump(external_experiment("trace", vllm_engine, "ENGINE_KEY", [workload])))

    (outcome,) = benchmark(str(exp))
    assert outcome["status"] == "FINISHED", outcome
    settings = Settings()
    tracker = Tracker(settings.tracking_uri(), settings.mlflow_experiment)
    (run,) = tracker.children(outcome["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    metrics = run.data.metrics
    assert metrics["replay_sent"] == len(trace.requests)
    assert metrics["replay_skipped"] == 0
    assert metrics["replay_prompt_tokens_dev_pct_max"] <= 1.0, metrics
    frame = pd.read_parquet(
        tracker.client.download_artifacts(run.info.run_id, "requests.parquet", str(tmp_path / "r"))
    )
    sent = frame.sort_values("index")["usage_prompt_tokens"].tolist()
    expected = [r.input_tokens for r in trace.requests]
    assert sum(abs(a - b) for a, b in zip(sent, expected, strict=True)) <= len(expected)  # a token at a seam
    assert frame["usage_output_tokens"].tolist() == frame["max_tokens"].tolist()
