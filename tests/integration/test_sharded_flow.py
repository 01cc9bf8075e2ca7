"""A workload sent by two client processes through the benchmark job (what the benchmark flow runs),
the scripted engine (k3pipe/testing/fake_engine.py) under the process launcher, pinned to CPU 0 with
launcher.cpus: its records equal those of the same workload sent by one process, and what the client
used is recorded."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import yaml

from k3pipe.core.settings import Settings
from k3pipe.testing import FAKE_ENGINE
from tests.conftest import TINY_MODEL, free_port, require_engine

pytestmark = pytest.mark.serial  # the engine pinned to CPU 0, the client off it: a quiet machine

COLUMNS = ["index", "warmup", "usage_output_tokens", "prompt_tokens", "max_tokens", "error"]


def _experiment(name: str, client: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": name,
        "model": {"source": "local", "path": str(TINY_MODEL), "served_name": "tiny"},
        "client": client,
        "arms": [
            {
                "name": "arm",
                "engine": {
                    "kind": "vllm",
                    "executable": [
                        sys.executable,
                        str(FAKE_ENGINE),
                        "--token-delay-ms=3",
                        "--startup-delay-s=0.5",
                    ],
                },
                "launcher": {"kind": "process", "port": free_port(), "cpus": "0", "stop_timeout_s": 5},
            }
        ],
        "workloads": [
            {
                "name": "w",
                "input_tokens": 16,
                "output_tokens": 10,
                "concurrency": 6,
                "num_requests": 24,
                "warmup_requests": 2,
            }
        ],
    }


def _run(name: str, client: dict[str, Any], tmp_path: Path) -> tuple[Any, Any, pd.DataFrame, list[dict]]:
    from k3pipe.experiment.params import RunRequest
    from k3pipe.jobs.benchmark import BenchmarkRequest, benchmark
    from k3pipe.jobs.steps import Job

    exp = tmp_path / f"{name}.yaml"
    exp.write_text(yaml.safe_dump(_experiment(name, client)))
    job = Job.library(Settings())
    (outcome,) = benchmark(BenchmarkRequest(RunRequest(experiment=str(exp))), job).arms
    assert outcome.status == "FINISHED", outcome
    tracker = job.tracker
    run = tracker.client.get_run(outcome.mlflow_run_id)
    child = tracker.children(run.info.run_id)[0]
    out = Path(tracker.client.download_artifacts(child.info.run_id, "", str(tmp_path / name)))
    requests = pd.read_parquet(out / "requests.parquet")
    load = yaml.safe_load((out / "client_load.json").read_text())
    return run, child, requests, load


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pins the engine to CPU 0 and the client off it")
def test_two_client_processes_record_what_one_does(tmp_path: Path) -> None:
    require_engine()  # the tiny model's tokenizer
    _, child1, requests1, load1 = _run("one-process", {"processes": 1}, tmp_path)
    run2, child2, requests2, load2 = _run("two-processes", {"processes": 2}, tmp_path)
    # the same requests, in the same order, with the same outcome
    pd.testing.assert_frame_equal(requests1[COLUMNS], requests2[COLUMNS])
    assert list(requests2["index"]) == list(range(26))
    assert child1.data.metrics["output_tokens_total"] == child2.data.metrics["output_tokens_total"] == 240
    # what the client used: processes, CPUs (off the engine's CPU 0), its load
    assert run2.data.params["client.processes"] == "2"
    assert run2.data.params["launcher.cpus"] == "0"
    assert child2.data.metrics["client_processes"] == 2
    assert [c["process"] for c in load2] == [0, 1]
    assert all(0 not in c["cpus"] for c in load1 + load2)
    assert all(c["events"] > 0 for c in load2)
    assert sum(c["events"] for c in load2) == sum(c["events"] for c in load1)
    assert "client_cpu_per_event_us" in child2.data.metrics
    assert "client_loop_lag_ms_p99" in child2.data.metrics
