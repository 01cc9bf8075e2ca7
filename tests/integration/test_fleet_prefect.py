"""A study spread over two nodes through Prefect, for real, through the team stack as a team runs it
beyond loopback: k3pipe.ops.stack's PostgreSQL, MLflow on it and Prefect, with auth and TLS on (bound to
127.0.0.1 here), two process work pools (node-a, node-b, one run at a time each) set up as `k3pipe
stack add-node` does, each with a worker of its own whose K3PIPE_HOME is its own (two nodes on one
machine). The workers, their launches and the study flow (started as a user starts it, `python -m
k3pipe.flows.study`) reach both servers with the stack's credentials and trust its CA through their
environment (``k3pipe.ops.stack.client_env``: what `k3pipe stack env` exports). The arms are `external`
endpoints served by the scripted OpenAI server (k3pipe/testing/scripted_openai.py), so no engine start hides
what is tested: the launches run as flow runs of the two pools, nested into one MLflow study with one
report; a node busy with another flow run is waited for, a node whose worker is gone is lost.

The module's tests share one stack (started once); each has its own workers and MLflow experiment."""

from __future__ import annotations

import os
import signal
import ssl
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yaml
from mlflow import MlflowClient

from k3pipe.core.layout import POOL_TAG, TUNE_OUTCOME_TAG, TUNE_WINNER_FILE, TUNE_WINNER_TAG
from k3pipe.jobs.fleet import heartbeat_key
from k3pipe.ops.stack import StackConfig, client_env
from k3pipe.testing import FAKE_ENGINE
from k3pipe.testing.scripted_openai import Script, ScriptedOpenAI
from tests.conftest import ASSETS_HOME, REPO, TINY_MODEL, free_port
from tests.fleet_harness import Fleet, base_env, kill_flow_runs_of, prefect_cli, team_stack

pytestmark = pytest.mark.flow

POOLS = ("node-a", "node-b")


def _env(stack: StackConfig, home: Path, experiment: str) -> dict[str, str]:
    """A node's (and the study's) environment: the stack's URLs, credentials and CA, by MLflow's and
    Prefect's own names, as `eval "$(k3pipe stack env)"` gives a shell; nothing on a command line."""
    return {
        **base_env(),
        **client_env(stack),
        "PREFECT_HOME": str(home / "prefect"),
        "K3PIPE_MLFLOW_EXPERIMENT": experiment,
        "PREFECT_WORKER_QUERY_SECONDS": "2",
        # Prefect counts a worker alive while its last heartbeat is within three intervals: a stopped
        # one is offline after 9 s here (90 s with the default 30 s)
        "PREFECT_WORKER_HEARTBEAT_SECONDS": "3",
        "PYTHONUNBUFFERED": "1",
    }


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackConfig]:
    """The team stack with auth and TLS, the two nodes' pools and launch deployments on it, and
    hold/node-b: a flow run that keeps node-b busy until it is let go (tests/fleet_hold.py)."""
    if not (TINY_MODEL / "config.json").is_file():
        pytest.skip(f"no tiny model at {TINY_MODEL} (make model)")
    began = time.monotonic()
    with team_stack(POOLS) as config:
        env = _env(config, tmp_path_factory.mktemp("deploy"), "k3pipe")
        prefect_cli(
            env, "--no-prompt", "deploy", "tests/fleet_hold.py:hold", "--name", "node-b", "--pool", "node-b"
        )
        print(f"team stack with auth and TLS, two nodes' pools: {time.monotonic() - began:.1f} s")
        yield config


@pytest.fixture
def fleet(
    stack: StackConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> Iterator[Fleet]:
    env = _env(stack, tmp_path, request.node.name)
    for key, value in client_env(stack).items():  # this process's MLflow client reads the stack too
        monkeypatch.setenv(key, value)
    fleet = Fleet(env, tmp_path, POOLS)
    try:
        fleet.start(deploy=False)
        yield fleet
    finally:
        fleet.stop()


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


def _runs(fleet: Fleet) -> tuple[Any, list[Any]]:
    """The study's run and its arm runs, in this test's experiment."""
    client = MlflowClient()
    experiment = client.get_experiment_by_name(fleet.env["K3PIPE_MLFLOW_EXPERIMENT"])
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    (study,) = [r for r in runs if r.data.tags.get("k3pipe.kind") == "study"]
    return study, [r for r in runs if r.data.tags.get("mlflow.parentRunId") == study.info.run_id]


def _no_password(stack: StackConfig, *texts: str) -> None:
    creds = stack.credentials()
    assert creds is not None
    for text in texts:
        assert creds[1] not in text


def test_the_stack_refuses_plain_http_an_untrusted_certificate_and_no_password(stack: StackConfig) -> None:
    """Both servers serve only TLS with the stack's certificate, and only to the stack's user: plain
    HTTP gets no answer, a client that does not trust the stack's CA refuses the certificate, one
    without the password (or with a wrong one) gets 401; one with both is served."""
    creds = stack.credentials()
    assert creds is not None
    user, password = creds
    ca = ssl.create_default_context(cafile=str(stack.tls_files.ca))
    urls = {
        "prefect": stack.url("prefect") + "/api/work_pools/node-a",
        "mlflow": stack.url("mlflow") + "/api/2.0/mlflow/experiments/search?max_results=5",
    }
    for name, url in urls.items():
        assert url.startswith("https://127.0.0.1:"), url
        with pytest.raises(httpx.TransportError):
            httpx.get("http://" + url.removeprefix("https://"), auth=creds, trust_env=False, timeout=10)
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(url, auth=creds, trust_env=False, timeout=10)
        assert httpx.get(url, verify=ca, trust_env=False, timeout=10).status_code == 401, name
        wrong = httpx.get(url, verify=ca, auth=(user, password + "x"), trust_env=False, timeout=10)
        assert wrong.status_code == 401, name
        assert httpx.get(url, verify=ca, auth=creds, trust_env=False, timeout=10).status_code == 200, name


def _wait_running(stack: StackConfig, pool: str, deployment: str, timeout_s: float = 180) -> str:
    """The name of ``deployment``'s flow run once it is Running on ``pool``."""
    ca = ssl.create_default_context(cafile=str(stack.tls_files.ca))
    query = {
        "flow_runs": {"state": {"type": {"any_": ["RUNNING"]}}},
        "work_pools": {"name": {"any_": [pool]}},
        "deployments": {"name": {"any_": [deployment]}},
    }
    deadline = time.monotonic() + timeout_s
    with httpx.Client(verify=ca, auth=stack.credentials(), trust_env=False, timeout=10) as http:
        while time.monotonic() < deadline:
            runs = http.post(stack.url("prefect") + "/api/flow_runs/filter", json=query).json()
            if runs:
                return str(runs[0]["name"])
            time.sleep(1)
    raise AssertionError(f"no flow run of {deployment} ran on {pool} within {timeout_s:g} s")


def test_a_study_over_two_workers_is_one_study_and_waits_for_a_busy_node(
    stack: StackConfig, fleet: Fleet, tmp_path: Path
) -> None:
    """node-b's worker is alive but runs another flow run (hold/node-b) when the study starts: the
    study says node-b is busy, naming that run, and does not take it for lost; fast (either pool) goes
    on on node-a meanwhile; slow (node-b only) waits, and runs there once node-b is free. One study,
    its launches from both nodes' flow runs, one report; the stack's password in no output."""
    release = tmp_path / "release-node-b"
    prefect_cli(fleet.env, "deployment", "run", "hold/node-b", "--param", f"release={release}")
    other = _wait_running(stack, "node-b", "node-b")
    with (
        ScriptedOpenAI(Script(inter_token_s=0.002), model="m") as fast,
        ScriptedOpenAI(Script(inter_token_s=0.02), model="m") as slow,
    ):
        study_proc = fleet.study(_experiment(fast.base_url, slow.base_url, arms={"slow": ["node-b"]}))
        try:
            said = study_proc.wait_for("pool node-b is busy", timeout_s=300)
        finally:
            release.touch()
        out, _ = study_proc.communicate(timeout=600)
    assert study_proc.returncode == 0, f"{out[-6000:]}\n{fleet.logs()}"
    busy = next(line for line in said.splitlines() if "pool node-b is busy" in line)
    assert f"flow run {other!r} of hold/node-b" in busy, busy
    assert "slow#1" in busy, busy
    assert "fleet.busy_timeout_s" in busy, busy
    assert "is lost" not in out

    study, arm_runs = _runs(fleet)
    placed = {
        (r.data.tags["k3pipe.arm"], r.data.tags["k3pipe.launch"]): r.data.tags[POOL_TAG] for r in arm_runs
    }
    assert sorted(placed) == [("fast", "1"), ("fast", "2"), ("slow", "1"), ("slow", "2")]
    assert all(r.info.status == "FINISHED" for r in arm_runs)
    # fast#1 was handed out while node-b was busy; slow ran only where it may
    assert placed[("fast", "1")] == "node-a"
    assert placed[("slow", "1")] == placed[("slow", "2")] == "node-b"
    flow_runs = {r.data.tags["prefect.flow_run_id"] for r in arm_runs}
    assert len(flow_runs) == 4
    assert study.data.tags["prefect.flow_run_id"] not in flow_runs
    # one report, on the study's run, ranking the arms across both nodes' launches
    client = MlflowClient()
    artifacts = {a.path for a in client.list_artifacts(study.info.run_id, "report")}
    assert "report/report.md" in artifacts
    report = Path(client.download_artifacts(study.info.run_id, "report/report.md", str(tmp_path / "dl")))
    text = report.read_text()
    assert "fast" in text
    assert "slow" in text
    _no_password(stack, out, fleet.logs())


def test_a_killed_worker_fails_its_launch_and_the_others_finish(stack: StackConfig, fleet: Fleet) -> None:
    """slow runs only on node-b, fast only on node-a. node-b's worker (and the launch it runs) is
    killed mid-launch: slow#1 is recorded failed, its node named lost, what it measured kept; node-b,
    its worker gone (no heartbeat), is lost, not busy: slow#2 fails naming it; fast's launches finish
    on node-a, and the study ends with its report, failing, naming slow."""
    placement = {"arms": {"fast": ["node-a"], "slow": ["node-b"]}, "heartbeat_s": 2, "lost_after_s": 20,
                 "pickup_timeout_s": 20}  # fmt: skip
    with (
        ScriptedOpenAI(Script(inter_token_s=0.002), model="m") as fast,
        ScriptedOpenAI(Script(inter_token_s=1.0), model="m") as slow,  # 8 s a request
    ):
        study_proc = fleet.study(_experiment(fast.base_url, slow.base_url, **placement))
        deadline = time.monotonic() + 300
        while not slow.requests:  # slow#1 is sending: its node is mid-launch
            assert study_proc.poll() is None, study_proc.communicate(timeout=30)[0][-6000:]
            assert time.monotonic() < deadline, fleet.logs()
            time.sleep(0.5)
        worker = fleet.workers["node-b"]
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(timeout=30)
        kill_flow_runs_of(fleet.env, "node-b")
        out, _ = study_proc.communicate(timeout=600)
    assert study_proc.returncode != 0, out[-6000:]
    assert "slow" in out
    assert "pool node-b is busy" not in out

    _, arm_runs = _runs(fleet)
    by = {(r.data.tags["k3pipe.arm"], r.data.tags["k3pipe.launch"]): r for r in arm_runs}
    assert by[("fast", "1")].info.status == by[("fast", "2")].info.status == "FINISHED"
    lost = by[("slow", "1")]
    assert lost.info.status in ("KILLED", "FAILED")
    assert "its node was lost" in lost.data.tags.get("k3pipe.error", ""), lost.data.tags
    assert lost.data.tags[POOL_TAG] == "node-b"
    never = by[("slow", "2")]
    # slow#1's node said it was alive until it was killed; it was not declared lost for want of it
    study = MlflowClient().get_run(lost.data.tags["mlflow.parentRunId"])
    assert heartbeat_key("slow", 1) in study.data.tags
    assert "no heartbeat for" in lost.data.tags["k3pipe.error"] or "ended" in lost.data.tags["k3pipe.error"]
    assert never.info.status == "FAILED"
    error = never.data.tags.get("k3pipe.error", "")
    assert "pool node-b is lost: no worker of it is alive" in error, never.data.tags
    assert "fleet.pickup_timeout_s 20" in error
    _no_password(stack, out, fleet.logs())


@pytest.mark.engine
def test_a_retest_over_two_workers_with_a_launched_engine_on_one(fleet: Fleet) -> None:
    """The retest flow over the two nodes: the baseline and a variant, each a study whose arms run on
    their nodes at once: an engine launched by node-a's worker from its own process (the scripted
    vLLM, k3pipe/testing/fake_engine.py, a process launcher's arm as any other: its command line,
    health gate, stop) and a scripted endpoint on node-b; the variant changes the engine's batch
    size. One retest in MLflow, its two studies each joined from both nodes, and its verdicts.
    The real vLLM launched by a worker is tests/engine/test_deployment.py's (here it took 330 s of
    the parallel phase, two cold starts on busy cores, for what the scripted one shows in seconds)."""
    data = yaml.safe_load((REPO / "experiments" / "demo-retest.yaml").read_text())
    data = yaml.safe_load(yaml.safe_dump(data).replace("{home}", str(ASSETS_HOME)))
    vllm = data["arms"][0]
    vllm["engine"]["executable"] = [sys.executable, str(FAKE_ENGINE), "--startup-delay-s=0.5"]
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
            # batch1 on the launched engine; the scripted arm runs in the variant's study too
            variants=[{**data["variants"][0], "arms": {**data["variants"][0]["arms"], "scripted": {}}}],
            fleet={"pools": ["node-a", "node-b"], "arms": {"vllm": ["node-a"], "scripted": ["node-b"]}},
        )
        proc = fleet.study(data, flow="retest")
        out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, f"{out[-6000:]}\n{fleet.logs()}"

    client = MlflowClient()
    experiment = client.get_experiment_by_name(fleet.env["K3PIPE_MLFLOW_EXPERIMENT"])
    assert experiment is not None
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


def test_a_search_over_two_workers_draws_a_port_for_each_launch(fleet: Fleet) -> None:
    """A settings search (issue 50) over the two nodes' workers: the fake vLLM (k3pipe/testing/fake_engine.py)
    with 2 or 40 ms between tokens, two launches of each candidate, dispatched over both pools. The two
    workers run on this one machine and may launch at once, so each launch's engine binds a port drawn
    free where its launch is planned (launcher.port 'auto'): four launches, four ports, both nodes used;
    the race is judged on both nodes' launches and the winner written out."""
    engine = {
        "kind": "vllm",
        "executable": [sys.executable, str(FAKE_ENGINE)],
        "args": {"startup_delay_s": 0.2, "token_delay_ms": 6, "max_model_len": 4096},
    }
    launcher = {"kind": "process", "port": "auto", "startup_timeout_s": 60, "stop_timeout_s": 10}
    data = {
        **_experiment("http://127.0.0.1:9/v1", "http://127.0.0.1:9/v1"),
        "name": "fleet-tune",
        "arms": [{"name": "fake", "engine": engine, "launcher": launcher}],
        "decision": {"metrics": ["output_throughput_tps"]},
        # 40 ms, not 12: at 8 tokens a request the client's and HTTP's own time on busy cores hid most of
        # a 12 ms gap, and two launches each declared no winner in two suite runs (2026-12-08)
        "tune": {"arm": "fake", "args": {"token_delay_ms": [40, 2]},
                 "objective": {"metric": "output_throughput_tps", "workload": "in32"},
                 "budget": {"first_launches": 2, "max_launches": 2}},
    }  # fmt: skip
    proc = fleet.study(data)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, f"{out[-6000:]}\n{fleet.logs()}"

    study, arm_runs = _runs(fleet)
    assert sorted((r.data.tags["k3pipe.arm"], r.data.tags["k3pipe.launch"]) for r in arm_runs) == [
        ("fake.t01", "1"), ("fake.t01", "2"), ("fake.t02", "1"), ("fake.t02", "2")
    ]  # fmt: skip
    assert all(r.info.status == "FINISHED" for r in arm_runs)
    # each launch on a port of its own, drawn where it was planned; both nodes took launches. Whether two
    # arm runs overlap is the workers' start-up skew's (a flow run's process starts in 5-10 s on busy
    # cores, its launch then lasts 4 s: a fresh-clone run saw none overlap); the library nodes'
    # search in tests/integration/test_fleet.py asserts the overlap
    ports = [urlsplit(r.data.params["base_url"]).port for r in arm_runs]
    assert len(set(ports)) == 4, ports
    assert {r.data.tags[POOL_TAG] for r in arm_runs} == set(POOLS)
    assert study.data.tags[TUNE_WINNER_TAG] == "fake.t02", study.data.tags.get(TUNE_OUTCOME_TAG)
    written = MlflowClient().download_artifacts(study.info.run_id, TUNE_WINNER_FILE, str(fleet.tmp / "dl"))
    (arm,) = yaml.safe_load(Path(written).read_text())
    assert arm["name"] == "fake"
    assert arm["engine"]["args"]["token_delay_ms"] == 2
    assert arm["launcher"]["port"] == "auto"  # the written arm draws its own port too
