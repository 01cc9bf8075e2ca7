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
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from mlflow import MlflowClient

from benchmarks.faults import MlflowServer
from k3pipe.fleet import heartbeat_key
from k3pipe.jobs.launch import POOL_TAG
from tests.conftest import ASSETS_HOME, REPO, TINY_MODEL, free_port, require_engine
from tests.fleet_harness import Fleet, kill_flow_runs_of
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


def _experiment(fast: str, slow: str, **fleet: Any) -> dict[str, Any]:
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
        "fleet": {"pools": list(POOLS), "pickup_timeout_s": 120, **fleet},
    }


@pytest.fixture
def fleet(prefect_server: dict[str, str], mlflow_server: MlflowServer, tmp_path: Path) -> Iterator[Fleet]:
    if not (TINY_MODEL / "config.json").is_file():
        pytest.skip(f"no tiny model at {TINY_MODEL} (make model)")
    env = {
        **{k: v for k, v in prefect_server.items() if not k.startswith(("K3PIPE_", "MLFLOW_"))},
        "MLFLOW_TRACKING_URI": mlflow_server.uri,
        "PREFECT_WORKER_QUERY_SECONDS": "2",
        "PYTHONUNBUFFERED": "1",
    }
    fleet = Fleet(env, tmp_path)
    try:
        fleet.start()
        yield fleet
    finally:
        fleet.stop()


def _runs(uri: str) -> tuple[Any, list[Any]]:
    """The study's run and its arm runs."""
    client = MlflowClient(uri)
    (experiment,) = [e for e in client.search_experiments() if e.name == "k3pipe"]
    runs = client.search_runs([experiment.experiment_id])
    (study,) = [r for r in runs if r.data.tags.get("k3pipe.kind") == "study"]
    return study, [r for r in runs if r.data.tags.get("mlflow.parentRunId") == study.info.run_id]


def test_a_study_over_two_workers_is_one_study(
    fleet: Fleet, mlflow_server: MlflowServer, tmp_path: Path
) -> None:
    with (
        ScriptedOpenAI(Script(inter_token_s=0.002), model="m") as fast,
        ScriptedOpenAI(Script(inter_token_s=0.02), model="m") as slow,
    ):
        study_proc = fleet.study(_experiment(fast.base_url, slow.base_url))
        out, _ = study_proc.communicate(timeout=600)
    assert study_proc.returncode == 0, f"{out[-6000:]}\n{fleet.logs()}"

    study, arm_runs = _runs(mlflow_server.uri)
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
    client = MlflowClient(mlflow_server.uri)
    artifacts = {a.path for a in client.list_artifacts(study.info.run_id, "report")}
    assert "report/report.md" in artifacts
    report = Path(client.download_artifacts(study.info.run_id, "report/report.md", str(tmp_path / "dl")))
    text = report.read_text()
    assert "fast" in text
    assert "slow" in text


def test_a_killed_worker_fails_its_launch_and_the_others_finish(
    fleet: Fleet, mlflow_server: MlflowServer
) -> None:
    """slow runs only on node-b, fast only on node-a. node-b's worker (and the launch it runs) is
    killed mid-launch: slow#1 is recorded failed, its node named lost, what it measured kept; slow#2
    finds no worker on node-b within the pickup timeout and fails naming the pool; fast's launches
    finish on node-a, and the study ends with its report, failing, naming slow."""
    placement = {"arms": {"fast": ["node-a"], "slow": ["node-b"]}, "heartbeat_s": 2, "lost_after_s": 20,
                 "pickup_timeout_s": 20}  # fmt: skip
    with (
        ScriptedOpenAI(Script(inter_token_s=0.002), model="m") as fast,
        ScriptedOpenAI(Script(inter_token_s=1.0), model="m") as slow,  # 8 s a request
    ):
        study_proc = fleet.study(_experiment(fast.base_url, slow.base_url, **placement))
        deadline = time.monotonic() + 300
        while not slow.requests:  # slow#1 is sending: its node is mid-launch
            assert study_proc.poll() is None, study_proc.communicate()[0][-6000:]
            assert time.monotonic() < deadline, fleet.logs()
            time.sleep(0.5)
        worker = fleet.workers["node-b"]
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(timeout=30)
        kill_flow_runs_of(fleet.env, "node-b")
        out, _ = study_proc.communicate(timeout=600)
    assert study_proc.returncode != 0, out[-6000:]
    assert "slow" in out

    _, arm_runs = _runs(mlflow_server.uri)
    by = {(r.data.tags["k3pipe.arm"], r.data.tags["k3pipe.launch"]): r for r in arm_runs}
    assert by[("fast", "1")].info.status == by[("fast", "2")].info.status == "FINISHED"
    lost = by[("slow", "1")]
    assert lost.info.status in ("KILLED", "FAILED")
    assert "its node was lost" in lost.data.tags.get("k3pipe.error", ""), lost.data.tags
    assert lost.data.tags[POOL_TAG] == "node-b"
    never = by[("slow", "2")]
    # slow#1's node said it was alive until it was killed; it was not declared lost for want of it
    study = MlflowClient(mlflow_server.uri).get_run(lost.data.tags["mlflow.parentRunId"])
    assert heartbeat_key("slow", 1) in study.data.tags
    assert "no heartbeat for" in lost.data.tags["k3pipe.error"] or "ended" in lost.data.tags["k3pipe.error"]
    assert never.info.status == "FAILED"
    assert "no worker of pool node-b" in never.data.tags.get("k3pipe.error", ""), never.data.tags




@pytest.mark.engine
def test_a_retest_over_two_workers_with_the_real_engine_on_one(
    fleet: Fleet, mlflow_server: MlflowServer
) -> None:
    """The retest flow over the two nodes: the baseline and a variant, each a study whose arms run on
    their nodes at once: the real vLLM (CPU build, launched by node-a's worker from its own process)
    and a scripted endpoint on node-b; the variant changes the engine's batch size. One retest in
    MLflow, its two studies each joined from both nodes, and its verdicts."""
    require_engine()
    data = yaml.safe_load((REPO / "experiments" / "demo-retest.yaml").read_text())
    data = yaml.safe_load(yaml.safe_dump(data).replace("{home}", str(ASSETS_HOME)))
    vllm = data["arms"][0]
    vllm["launcher"]["port"] = free_port()
    vllm["endpoint"] = {}
    with ScriptedOpenAI(Script(inter_token_s=0.002), model="m") as scripted:
        data.update(
            name="fleet-retest",
            arms=[
                vllm,
                {
                    "name": "scripted",
                    "engine": {"kind": "vllm"},
                    "launcher": {"kind": "external"},
                    "endpoint": {"base_url": scripted.base_url, "model": "m"},
                },
            ],
            workloads=[{**data["workloads"][0], "num_requests": 8, "repeats": 2}],
            # batch1 on the real engine; the scripted arm runs in the variant's study too
            variants=[{**data["variants"][0], "arms": {**data["variants"][0]["arms"], "scripted": {}}}],
            fleet={"pools": ["node-a", "node-b"], "arms": {"vllm": ["node-a"], "scripted": ["node-b"]}},
        )
        proc = fleet.study(data, flow="retest")
        out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, f"{out[-6000:]}\n{fleet.logs()}"

    client = MlflowClient(mlflow_server.uri)
    (experiment,) = [e for e in client.search_experiments() if e.name == "k3pipe"]
    runs = client.search_runs([experiment.experiment_id])
    (retest,) = [r for r in runs if r.data.tags.get("k3pipe.kind") == "retest"]
    studies = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == retest.info.run_id]
    assert sorted(r.info.run_name for r in studies) == ["study/fleet-retest", "study/fleet-retest@batch1"]
    for study in studies:
        arms = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == study.info.run_id]
        placed = {r.data.tags["k3pipe.arm"]: r.data.tags[POOL_TAG] for r in arms}
        assert placed == {"vllm": "node-a", "scripted": "node-b"}
        assert all(r.info.status == "FINISHED" for r in arms)
    assert "retest verdicts:" in out
