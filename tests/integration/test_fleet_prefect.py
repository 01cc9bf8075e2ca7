"""A study spread over two nodes through Prefect, for real: a Prefect server, two process work pools
(node-a, node-b, one run at a time each), each with its `launch` deployment (flows/fleet.py, deployed
as `k3pipe stack add-node` does) and a worker of its own whose K3PIPE_HOME is its own (two nodes on
one machine), a real MLflow server they all record to, and the study flow started as a user starts it
(`python -m flows.study`, against that server). The arms are `external` endpoints served by the
scripted OpenAI server (tests/scripted_openai.py), so no engine start hides what is tested: the
launches run as flow runs of the two pools, nested into one MLflow study with one report."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from mlflow import MlflowClient

from benchmarks.faults import MlflowServer
from k3pipe.jobs.launch import POOL_TAG
from tests.conftest import PREFECT, REPO, TINY_MODEL, stop_group
from tests.scripted_openai import Script, ScriptedOpenAI
from tests.stores import seed_mlflow_db

pytestmark = pytest.mark.flow

POOLS = ("node-a", "node-b")


@pytest.fixture
def mlflow_server(tmp_path: Path) -> Iterator[MlflowServer]:
    directory = tmp_path / "mlflow-server"
    directory.mkdir()
    seed_mlflow_db(directory / "mlflow.db")
    server = MlflowServer(directory)
    server.start()
    try:
        yield server
    finally:
        if server.proc is not None and server.proc.poll() is None:
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait(timeout=30)


def _prefect(env: dict[str, str], *args: str, timeout: float = 300) -> str:
    out = subprocess.run(
        [PREFECT, *args],
        cwd=REPO,
        env={**env, "PWD": str(REPO)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, f"prefect {' '.join(args)}: {out.stdout[-3000:]}{out.stderr[-3000:]}"
    return out.stdout


def _experiment(fast: str, slow: str) -> dict[str, Any]:
    arms = [
        {"name": name, "launches": 2, "engine": {"kind": "vllm"}, "launcher": {"kind": "external"},
         "endpoint": {"base_url": url, "model": "m"}}
        for name, url in (("fast", fast), ("slow", slow))
    ]  # fmt: skip
    return {
        "name": "fleet-prefect",
        "model": {"source": "local", "path": str(TINY_MODEL)},
        "arms": arms,
        "workloads": [
            {
                "name": "in32",
                "input_tokens": 32,
                "output_tokens": 8,
                "concurrency": 2,
                "num_requests": 4,
                "warmup_requests": 0,
                "repeats": 2,
                "seed": 1,
            },
        ],
        "decision": {"metrics": ["output_throughput_tps"]},
        "fleet": {"pools": list(POOLS), "pickup_timeout_s": 120},
    }


def test_a_study_over_two_workers_is_one_study(
    prefect_server: dict[str, str], mlflow_server: MlflowServer, tmp_path: Path
) -> None:
    if not (TINY_MODEL / "config.json").is_file():
        pytest.skip(f"no tiny model at {TINY_MODEL} (make model)")
    env = {
        **{k: v for k, v in prefect_server.items() if not k.startswith(("K3PIPE_", "MLFLOW_"))},
        "MLFLOW_TRACKING_URI": mlflow_server.uri,
        "PREFECT_WORKER_QUERY_SECONDS": "2",
        "PYTHONUNBUFFERED": "1",
    }
    for pool in POOLS:
        _prefect(env, "work-pool", "create", pool, "--type", "process")
        _prefect(env, "work-pool", "set-concurrency-limit", pool, "1")
        _prefect(env, "--no-prompt", "deploy", "flows/fleet.py:launch", "--name", pool, "--pool", pool)
    workers: list[tuple[subprocess.Popen[bytes], Any]] = []
    try:
        for pool in POOLS:
            log = (tmp_path / f"worker-{pool}.log").open("wb")
            proc = subprocess.Popen(
                [PREFECT, "worker", "start", "--pool", pool],
                cwd=tmp_path,
                env={**env, "K3PIPE_HOME": str(tmp_path / pool)},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            workers.append((proc, log))
        with (
            ScriptedOpenAI(Script(inter_token_s=0.002), model="m") as fast,
            ScriptedOpenAI(Script(inter_token_s=0.02), model="m") as slow,
        ):
            exp = tmp_path / "fleet.yaml"
            exp.write_text(yaml.safe_dump(_experiment(fast.base_url, slow.base_url)))
            done = subprocess.run(
                [sys.executable, "-m", "flows.study", str(exp)],
                cwd=REPO,
                env={**env, "K3PIPE_HOME": str(tmp_path / "parent")},
                capture_output=True,
                text=True,
                timeout=600,
            )
    finally:
        for proc, log in workers:
            stop_group(proc, signal.SIGINT)
            log.close()
    logs = {p: (tmp_path / f"worker-{p}.log").read_text(errors="replace") for p in POOLS}
    assert done.returncode == 0, f"{done.stdout[-4000:]}{done.stderr[-4000:]}\n{logs}"

    client = MlflowClient(mlflow_server.uri)
    (experiment,) = [e for e in client.search_experiments() if e.name == "k3pipe"]
    runs = client.search_runs([experiment.experiment_id])
    (study,) = [r for r in runs if r.data.tags.get("k3pipe.kind") == "study"]
    arm_runs = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == study.info.run_id]
    assert sorted((r.data.tags["k3pipe.arm"], r.data.tags["k3pipe.launch"]) for r in arm_runs) == [
        ("fast", "1"), ("fast", "2"), ("slow", "1"), ("slow", "2")
    ]  # fmt: skip
    assert all(r.info.status == "FINISHED" for r in arm_runs)
    # both nodes ran launches, each from its own worker's flow runs
    assert {r.data.tags[POOL_TAG] for r in arm_runs} == set(POOLS)
    flow_runs = {r.data.tags["prefect.flow_run_id"] for r in arm_runs}
    assert len(flow_runs) == 4
    assert study.data.tags["prefect.flow_run_id"] not in flow_runs
    # one report, on the study's run, ranking the arms across both nodes' launches
    artifacts = {a.path for a in client.list_artifacts(study.info.run_id, "report")}
    assert "report/report.md" in artifacts
    report = Path(client.download_artifacts(study.info.run_id, "report/report.md", str(tmp_path / "dl")))
    text = report.read_text()
    assert "fast" in text
    assert "slow" in text
