"""A study spread over two nodes, in the library (k3pipe.jobs.fleet, k3pipe.jobs.launch): each node a job
of its own (its own K3PIPE_HOME, its own tracker) running the launches the scheduler hands its pool,
reading the experiment and the prompts from the study's run (verified by digest), its arm runs nested
under the study's; the study joined into one report. The arms are `external` endpoints served by the
scripted OpenAI server (k3pipe/testing/scripted_openai.py); MLflow a real server (benchmarks/faults.py's).
Prefect's side (the deployment runs on two pools with two workers) is flows/fleet.py's."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from benchmarks.faults import MlflowServer
from k3pipe.core.errors import SpecError
from k3pipe.core.layout import (
    NODE_TAG,
    POOL_TAG,
    PROMPTS_INDEX_FILE,
    SUPERSEDED_TAG,
    TUNE_FILE,
    TUNE_OUTCOME_TAG,
    TUNE_WINNER_FILE,
    TUNE_WINNER_TAG,
)
from k3pipe.core.settings import Settings
from k3pipe.experiment.params import RunRequest
from k3pipe.jobs.arm_run import ArmOutcome
from k3pipe.jobs.fleet import (
    PoolUnavailable,
    PromptsMismatch,
    Remote,
    Ticket,
    last_heartbeat,
    read_study_prompts,
)
from k3pipe.jobs.launch import LaunchRequest, run_launch
from k3pipe.jobs.rerun import read_record
from k3pipe.jobs.steps import Job
from k3pipe.jobs.study import StudyResult, resume, study
from k3pipe.machine.node import GpuInfo, NodeInfo
from k3pipe.records.tracking import Tracker
from k3pipe.report import build_report
from k3pipe.testing import FAKE_ENGINE
from k3pipe.testing.scripted_openai import Script, ScriptedOpenAI
from tests.conftest import TINY_MODEL
from tests.stores import seed_mlflow_db

WORKLOADS = [
    {"name": "in32", "input_tokens": 32, "output_tokens": 8, "concurrency": 2, "num_requests": 4,
     "warmup_requests": 0, "repeats": 2, "seed": 1},
]  # fmt: skip


def _experiment(fast: str, slow: str, fleet: dict[str, Any]) -> dict[str, Any]:
    arms = [
        {"name": name, "launches": 2, "engine": {"kind": "vllm"}, "launcher": {"kind": "external"},
         "endpoint": {"base_url": url, "model": "m"}}
        for name, url in (("fast", fast), ("slow", slow))
    ]  # fmt: skip
    return {
        "name": "fleet-test",
        "model": {"source": "local", "path": str(TINY_MODEL)},
        "arms": arms,
        "workloads": WORKLOADS,
        "decision": {"metrics": ["output_throughput_tps"]},
        "fleet": fleet,
    }


_SERVER: dict[str, str] = {}


@pytest.fixture(scope="module", autouse=True)
def _mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One real MLflow server the study and its nodes record to, as on a team's stack (two nodes'
    trackers writing one SQLite file from one process collide: 'database is locked')."""
    directory = tmp_path_factory.mktemp("mlflow-server")
    seed_mlflow_db(directory / "mlflow.db")
    server = MlflowServer(directory)
    server.start()
    _SERVER["uri"] = server.uri
    try:
        yield
    finally:
        if server.proc is not None and server.proc.poll() is None:
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait(timeout=30)


def _job(home: Path, tracking: str, artifacts: Path) -> Job:
    settings = Settings(home=home)
    return Job.library(settings, Tracker(tracking, settings.mlflow_experiment, artifacts))


@pytest.fixture
def servers():  # type: ignore[no-untyped-def]
    if not (TINY_MODEL / "config.json").is_file():
        pytest.skip(f"no tiny model at {TINY_MODEL} (make model)")
    with (
        ScriptedOpenAI(Script(inter_token_s=0.002), model="m") as fast,
        ScriptedOpenAI(Script(inter_token_s=0.02), model="m") as slow,
    ):
        yield fast, slow


def _run(
    tmp_path: Path, experiment: dict[str, Any], nodes: dict[str, Job | None]
) -> tuple[Job, StudyResult | BaseException]:
    """The study started by a job whose fleet runs each launch with ``nodes[pool]`` (None: a pool
    whose worker never comes)."""
    tracking, artifacts = _SERVER["uri"], tmp_path / "artifacts"
    parent = _job(tmp_path / "parent", tracking, artifacts)

    def fleet(spec: Any, study_run_id: str) -> Any:
        def run_on(pool: str, ticket: Ticket) -> ArmOutcome:
            node = nodes[pool]
            if node is None:
                raise PoolUnavailable(f"no worker of pool {pool} started launch {ticket.label} within 1 s")
            return run_launch(
                LaunchRequest(study_run_id, ticket.arm, ticket.launch, ticket.launches, pool), node
            )

        return Remote(run_on)

    exp = tmp_path / "fleet.yaml"
    exp.write_text(yaml.safe_dump(experiment))
    job = Job(parent.settings, parent.tracker, parent.steps, fleet=fleet)
    try:
        return job, study(RunRequest(experiment=str(exp)), job)
    except Exception as exc:
        return job, exc


def test_a_study_over_two_nodes_is_one_study(servers, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    fast, slow = servers
    tracking, artifacts = _SERVER["uri"], tmp_path / "artifacts"
    nodes: dict[str, Job | None] = {
        "node-a": _job(tmp_path / "node-a", tracking, artifacts),
        "node-b": _job(tmp_path / "node-b", tracking, artifacts),
    }
    job, result = _run(
        tmp_path, _experiment(fast.base_url, slow.base_url, {"pools": ["node-a", "node-b"]}), nodes
    )
    assert isinstance(result, StudyResult), result
    assert [(o.arm, o.launch, o.status) for o in result.arms] == [
        ("fast", 1, "FINISHED"), ("slow", 1, "FINISHED"), ("slow", 2, "FINISHED"), ("fast", 2, "FINISHED")
    ]  # fmt: skip
    tracker = job.tracker
    arm_runs = tracker.children(result.study_run_id)
    assert len(arm_runs) == 4
    assert {r.data.tags[POOL_TAG] for r in arm_runs} == {"node-a", "node-b"}
    assert all(r.data.tags[NODE_TAG] for r in arm_runs)
    # each launch's node said it was alive, on the study's run, where the study flow watches it
    for arm, launch in (("fast", 1), ("fast", 2), ("slow", 1), ("slow", 2)):
        beat = last_heartbeat(tracker, result.study_run_id, arm, launch)
        assert beat is not None
        assert abs(beat - time.time()) < 600

    # the prompts: drawn once by the study, recorded on its run, sent by every launch
    index = json.loads(tracker.read_artifact(result.study_run_id, PROMPTS_INDEX_FILE) or b"[]")
    recorded = {(e["workload"], e["repeat"]): e["sha256"] for e in index}
    assert set(recorded) == {("in32", 0), ("in32", 1)}
    for run in arm_runs:
        record = read_record(tracker, run.info.run_id)
        assert {(p.workload, p.repeat): p.sha256 for p in record.prompts} == recorded

    # one study: the report merges each arm's two launches (from two nodes) into one cell
    report = build_report(tracker, result.study_run_id)
    cell = report.data.cell("fast", "in32")
    assert cell is not None
    assert cell.launches == 2
    row = next(
        r for r in report.analysis.rows if r.workload == "in32" and r.metric.key == "output_throughput_tps"
    )
    assert row.ranking == ["fast", "slow"]


def test_a_pool_without_a_worker_fails_only_its_launches(servers, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """slow may run only on node-b, whose worker never comes: its launches are recorded failed,
    naming the pool; fast's run on node-a, and the study still ends with a report."""
    fast, slow = servers
    tracking, artifacts = _SERVER["uri"], tmp_path / "artifacts"
    nodes: dict[str, Job | None] = {"node-a": _job(tmp_path / "node-a", tracking, artifacts), "node-b": None}
    fleet = {"pools": ["node-a", "node-b"], "arms": {"slow": ["node-b"], "fast": ["node-a"]}}
    job, result = _run(tmp_path, _experiment(fast.base_url, slow.base_url, fleet), nodes)
    assert not isinstance(result, StudyResult)
    study_result = result.study  # type: ignore[attr-defined]
    by = {(o.arm, o.launch): o for o in study_result.arms}
    assert by[("fast", 1)].status == by[("fast", 2)].status == "FINISHED"
    assert by[("slow", 1)].status == by[("slow", 2)].status == "FAILED"
    assert "no worker of pool node-b" in (by[("slow", 1)].error or "")
    failed = job.tracker.client.get_run(by[("slow", 1)].mlflow_run_id)
    assert failed.data.tags["k3pipe.arm"] == "slow"
    assert Path(study_result.report["markdown"]).is_file()

    # node-b's worker comes: the study resumed runs slow's launches there, keeps fast's
    nodes["node-b"] = _job(tmp_path / "node-b", tracking, artifacts)
    resumed = resume(study_result.study_run_id, job)
    assert [(o.arm, o.launch, o.status) for o in resumed.arms] == [
        ("fast", 1, "FINISHED"), ("slow", 1, "FINISHED"), ("slow", 2, "FINISHED"), ("fast", 2, "FINISHED")
    ]  # fmt: skip
    assert resumed.arms[0].mlflow_run_id == by[("fast", 1)].mlflow_run_id  # kept, not run again
    again = job.tracker.client.get_run(resumed.arms[1].mlflow_run_id)
    assert again.data.tags[POOL_TAG] == "node-b"
    assert job.tracker.client.get_run(by[("slow", 1)].mlflow_run_id).data.tags.get(SUPERSEDED_TAG)


def test_a_node_refuses_prompts_that_are_not_the_studys(servers, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    fast, slow = servers
    tracking, artifacts = _SERVER["uri"], tmp_path / "artifacts"
    nodes: dict[str, Job | None] = {"node-a": _job(tmp_path / "node-a", tracking, artifacts)}
    job, result = _run(tmp_path, _experiment(fast.base_url, slow.base_url, {"pools": ["node-a"]}), nodes)
    assert isinstance(result, StudyResult), result
    tracker, run_id = job.tracker, result.study_run_id
    from k3pipe.experiment.load import parse_experiment

    spec = parse_experiment(_experiment(fast.base_url, slow.base_url, {"pools": ["node-a"]}))
    assert len(read_study_prompts(tracker, run_id, spec)["in32"]) == 2
    # the artifact changed behind the record's back: named, never sent
    index = json.loads(tracker.read_artifact(run_id, PROMPTS_INDEX_FILE) or b"[]")
    first = next(e for e in index if e["repeat"] == 0)
    data = json.loads(tracker.read_artifact(run_id, first["artifact"]) or b"{}")
    data["prompts"] = list(reversed(data["prompts"]))
    tracker.log_dict(run_id, data, first["artifact"])
    with pytest.raises(PromptsMismatch, match="repeat 1 read from study run"):
        read_study_prompts(tracker, run_id, spec)


def test_a_fleet_study_needs_the_study_flow(tmp_path: Path) -> None:
    exp = tmp_path / "fleet.yaml"
    exp.write_text(
        yaml.safe_dump(_experiment("http://127.0.0.1:9/v1", "http://127.0.0.1:9/v1", {"pools": ["n1"]}))
    )
    job = _job(tmp_path / "home", _SERVER["uri"], tmp_path / "artifacts")
    with pytest.raises(SpecError, match="only the study flow on a Prefect server"):
        study(RunRequest(experiment=str(exp)), job)


def _search() -> dict[str, Any]:
    """A search over the fake vLLM's service rate (k3pipe/testing/fake_engine.py, launched by each node's
    process launcher): 2 or 16 ms between tokens, two launches each, spread over both nodes, which
    launch at once: both nodes are this machine, so each launch binds a port drawn free at its plan
    (launcher.port 'auto'). Its answers are 24 tokens long so the tokens' pace, not a request's fixed
    cost, sets the throughput: with 8 a CI run's busy cores left the two within 3x and a launch's noise
    kept the race undecided after three launches each (2026-12-07)."""
    engine = {
        "kind": "vllm",
        "executable": [sys.executable, str(FAKE_ENGINE)],
        "args": {"startup_delay_s": 0.2, "token_delay_ms": 6, "max_model_len": 4096},
    }
    launcher = {"kind": "process", "host": "127.0.0.1", "port": "auto", "startup_timeout_s": 60,
                "stop_timeout_s": 10}  # fmt: skip
    return {
        "name": "fleet-tune",
        "model": {"source": "local", "path": str(TINY_MODEL)},
        "arms": [{"name": "fake", "engine": engine, "launcher": launcher}],
        "workloads": [{**WORKLOADS[0], "output_tokens": 24}],
        "fleet": {"pools": ["node-a", "node-b"], "arms": {"fake": ["node-a", "node-b"]}},
        "tune": {"arm": "fake", "args": {"token_delay_ms": [16, 2]},
                 "objective": {"metric": "output_throughput_tps", "workload": "in32"},
                 "budget": {"first_launches": 2, "max_launches": 3}},
    }  # fmt: skip


def _on_gpu(node: Job, gpu: str) -> Job:
    """``node`` as if its GPU were ``gpu`` (the facts its launches record)."""
    facts = NodeInfo(
        gpus=[GpuInfo(index=0, name=gpu, memory_total_mib=81559, driver_version="580.159.04")],
        cuda_version="13.0", nvidia_smi="",
    )  # fmt: skip
    return node.with_steps(arm=replace(node.steps.arm, probe_node=lambda plan, settings: facts))


def test_a_search_spread_over_two_nodes_is_raced_as_one(tmp_path: Path) -> None:
    """The candidates' launches dispatched over the searched arm's pools (both nodes), each launch's
    pool and node recorded, the race judged on them all, the winner written out."""
    tracking, artifacts = _SERVER["uri"], tmp_path / "artifacts"
    nodes: dict[str, Job | None] = {n: _job(tmp_path / n, tracking, artifacts) for n in ("node-a", "node-b")}
    job, result = _run(tmp_path, _search(), nodes)
    assert isinstance(result, StudyResult), result
    tracker = job.tracker
    arm_runs = tracker.children(result.study_run_id)
    # two launches each, and a third each where the busy machine's noise hid the difference at the first
    # look (a fresh-clone run, 2026-12-07: six launches, the suite's three workers beside it)
    launched = sorted((r.data.tags["k3pipe.arm"], r.data.tags["k3pipe.launch"]) for r in arm_runs)
    assert launched in (
        [(f"fake.t0{c}", str(k)) for c in (1, 2) for k in (1, 2)],
        [(f"fake.t0{c}", str(k)) for c in (1, 2) for k in (1, 2, 3)],
    ), launched
    assert {r.data.tags[POOL_TAG] for r in arm_runs} == {"node-a", "node-b"}
    assert all(r.data.tags[NODE_TAG] for r in arm_runs)
    run = tracker.client.get_run(result.study_run_id)
    tune = json.loads(tracker.find_artifact(result.study_run_id, TUNE_FILE) or b"{}")
    assert run.data.tags[TUNE_OUTCOME_TAG] == "winner", tune.get("text")
    assert run.data.tags[TUNE_WINNER_TAG] == tune["winner"] == "fake.t02"  # 2 ms between tokens
    assert tune["launches"] == len(arm_runs)
    # the nodes launched at once, each launch on a port of its own
    ports = [urlsplit(r.data.params["base_url"]).port for r in arm_runs]
    assert len(set(ports)) == len(arm_runs), ports
    on = {pool: [(r.info.start_time, r.info.end_time) for r in arm_runs if r.data.tags[POOL_TAG] == pool]
          for pool in ("node-a", "node-b")}  # fmt: skip
    assert any(a0 < b1 and b0 < a1 for a0, a1 in on["node-a"] for b0, b1 in on["node-b"]), on


def test_a_search_over_nodes_of_different_gpus_is_not_ranked(tmp_path: Path) -> None:
    """node-a an H100, node-b an H200: the candidates' launches ran on both, so no candidate is ranked
    against another's GPUs (decision.mixed_hardware off): the search stops unranked, saying why, and
    writes no winner."""
    tracking, artifacts = _SERVER["uri"], tmp_path / "artifacts"
    nodes: dict[str, Job | None] = {
        "node-a": _on_gpu(_job(tmp_path / "node-a", tracking, artifacts), "NVIDIA H100 80GB HBM3"),
        "node-b": _on_gpu(_job(tmp_path / "node-b", tracking, artifacts), "NVIDIA H200"),
    }
    job, result = _run(tmp_path, _search(), nodes)
    assert isinstance(result, StudyResult), result
    tracker = job.tracker
    run = tracker.client.get_run(result.study_run_id)
    assert run.data.tags[TUNE_OUTCOME_TAG] == "not-ranked"
    assert TUNE_WINNER_TAG not in run.data.tags
    assert tracker.find_artifact(result.study_run_id, TUNE_WINNER_FILE) is None
    tune = json.loads(tracker.find_artifact(result.study_run_id, TUNE_FILE) or b"{}")
    assert tune["text"].startswith("Not ranked: the candidates were measured on different hardware")
    assert "NVIDIA H100 80GB HBM3" in tune["text"]
    assert "NVIDIA H200" in tune["text"]
    md = build_report(tracker, result.study_run_id).markdown
    assert "**Not ranked: the candidates were measured on different hardware" in md
