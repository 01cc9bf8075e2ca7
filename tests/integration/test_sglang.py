"""An SGLang arm through the whole benchmark flow, under the process launcher.

The engine is the SCRIPTED stand-in k3pipe/testing/fake_engine.py with ``--flavor sglang``: no SGLang
build runs on this machine (its PyPI wheels need CUDA torch and sglang-kernel; its CPU build is
compiled from source for Xeon AMX) and none was carried to the GPU node. The stand-in speaks SGLang
0.5.23 as its source defines it: ``/health`` 503 until warm-up, the key only through ``--api-key``
(SGLang reads no variable), ``/metrics`` only with ``--enable-metrics`` (sglang: names, histograms
included), its chat stream (finish in a chunk of its own, ``reasoning_content`` in every delta, running
``usage`` per chunk with ``continuous_usage_stats``) and its log lines, among them the start-up
``server_args={...}`` line that prints the key. The Docker launcher's SGLang arm:
tests/docker/test_docker_flow.py.
"""

from __future__ import annotations

import secrets
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import yaml

from k3pipe.core.settings import Settings
from k3pipe.records.tracking import Tracker
from k3pipe.testing import FAKE_ENGINE
from tests.conftest import TINY_MODEL, free_port, require_engine

pytestmark = pytest.mark.flow

KEY_VAR = "K3PIPE_SGLANG_TEST_KEY"


def _experiment(name: str, port: int, metrics: bool = True) -> dict[str, Any]:
    return {
        "name": name,
        "model": {"source": "local", "path": str(TINY_MODEL), "served_name": "tiny"},
        "arms": [
            {
                "name": "sglang",
                "engine": {
                    "kind": "sglang",
                    "version": "0.5.23",
                    "executable": [
                        sys.executable,
                        str(FAKE_ENGINE),
                        "--flavor=sglang",
                        "--startup-delay-s=1.5",
                        "--token-delay-ms=4",
                    ],
                    "args": {"enable_metrics": metrics, "context_length": 4096},
                },
                "launcher": {"kind": "process", "port": port, "startup_timeout_s": 120, "stop_timeout_s": 5},
                "endpoint": {"api_key_env": KEY_VAR},
            }
        ],
        "workloads": [
            {
                "name": "w",
                "input_tokens": 32,
                "output_tokens": 12,
                "concurrency": 2,
                "num_requests": 6,
                "metrics_interval_s": 0.5,
            },
            {"name": "wc", "api": "completions", "input_tokens": 16, "output_tokens": 6, "num_requests": 3},
        ],
    }


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def test_sglang_arm_runs_through_the_flow_with_its_key_and_metrics(
    prefect_harness: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from k3pipe.flows.benchmark import benchmark

    require_engine()  # the tiny model's tokenizer
    key = "sgl-" + secrets.token_hex(16)
    monkeypatch.setenv(KEY_VAR, key)
    exp = tmp_path / "exp.yaml"
    exp.write_text(yaml.safe_dump(_experiment("sglang-flow", free_port())))

    outcomes = benchmark(str(exp))

    assert [o["status"] for o in outcomes] == ["FINISHED"], outcomes
    settings = Settings()
    tracker = Tracker(settings.tracking_uri(), settings.mlflow_experiment)
    run = tracker.client.get_run(outcomes[0]["mlflow_run_id"])
    params, metrics = run.data.params, run.data.metrics
    # the recorded command holds the reference, the launch had the key
    assert "--api-key '{env.K3PIPE_SGLANG_TEST_KEY}'" in params["command"]
    assert "--enable-metrics" in params["command"]
    assert params["api_key_env"] == KEY_VAR
    # the engine log is SGLang's: parsed into findings (readiness, the KV pool line)
    assert metrics["engine_log.ready"] == 1
    assert metrics["engine_log.kv_pool_tokens"] > 0
    local = Path(tracker.client.download_artifacts(run.info.run_id, "logs", str(tmp_path / "art")))
    log = next(local.glob("*.log")).read_text()
    # /health answered 503 until warm-up ended, and the gate waited for its 200
    first_ok = log.index('"GET /health HTTP/1.1" 200')
    assert '"GET /health HTTP/1.1" 503' in log[:first_ok]
    # SGLang printed its key in server_args: the key reached it, and the record has it masked
    server_args = next(line for line in log.splitlines() if "server_args=" in line)
    assert "'api_key': '***'" in server_args, server_args
    # the workload: per-token ITL from SGLang's running usage, engine-side figures from its /metrics
    children = {c.data.tags["k3pipe.workload"]: c for c in tracker.children(run.info.run_id)}
    child = children["w"]
    m = child.data.metrics
    assert m["completed"] == 6
    assert m["output_tokens_total"] == 6 * 12
    assert m["itl_per_token"] == 1.0
    assert m["engine_generation_tokens"] == 6 * 12
    assert m["engine_ttft_ms_mean"] > 0
    assert 0 < m["engine_itl_ms_mean"] < 1_000
    frames = Path(tracker.client.download_artifacts(child.info.run_id, "", str(tmp_path / "child")))
    requests = pd.read_parquet(next(frames.rglob("requests.parquet")))
    assert len(requests) == 6
    # /v1/completions: SGLang's completion stream, running usage per chunk too
    assert children["wc"].data.metrics["completed"] == 3
    assert children["wc"].data.metrics["itl_per_token"] == 1.0
    # the key: in no file of the home (MLflow's database and artifacts, engine logs, k3pipe's log)
    leaked = [p for p in _files(settings.home_dir) if key.encode() in p.read_bytes()]
    assert leaked == []
    assert key not in log


def test_sglang_arm_with_its_key_variable_unset_is_stopped_by_preflight(
    prefect_harness: None, tmp_path: Path
) -> None:
    from k3pipe.core.errors import PreflightError
    from k3pipe.flows.benchmark import benchmark

    exp = tmp_path / "exp.yaml"
    exp.write_text(yaml.safe_dump(_experiment("sglang-nokey", free_port())))
    with pytest.raises(PreflightError, match=rf"endpoint.api_key_env names {KEY_VAR}.*--api-key"):
        benchmark(str(exp))
