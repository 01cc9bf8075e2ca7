"""Nothing measured is lost when tracking fails: the spool (k3pipe.records.spool), its push
(k3pipe.records.tracking's
Pusher) and `k3pipe sync`, against a real SQLite MLflow store and a real `mlflow server` (its own
process group, killed by pgid, restarted on the same store and port); the arm runs against the
scripted OpenAI server (an `external` arm: real HTTP, no engine)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pandas as pd
import pytest
import yaml
from mlflow import MlflowClient

from benchmarks.faults import MlflowServer
from k3pipe.core.errors import ArtifactMissingError, ArtifactStoreError, TrackingUnreachableError
from k3pipe.core.settings import Settings
from k3pipe.experiment.load import parse_experiment
from k3pipe.jobs.arm_run import ArmRun, ArmSteps
from k3pipe.prompts.draw import prepare_prompts
from k3pipe.records.spool import IdMap, Journal, SessionDir, list_sessions, new_run_id, try_lock, unlock
from k3pipe.records.sync import sync_spool
from k3pipe.records.tracking import Tracker
from k3pipe.sources import fetch_model
from k3pipe.testing.scripted_openai import Script, ScriptedOpenAI
from tests.conftest import REPO, TINY_MODEL, demo_experiment, free_port
from tests.stores import seed_mlflow_db

KEY = "sk-spool-secret-0123456789"


# -- a real MLflow tracking server (benchmarks/faults.py's) -----------------------------------------


@pytest.fixture
def mlflow_server(tmp_path: Path) -> Iterator[MlflowServer]:
    """A real MLflow server of the test's own (not started: the test starts it), always killed."""
    directory = tmp_path / "mlflow-server"
    directory.mkdir()
    seed_mlflow_db(directory / "mlflow.db")
    server = MlflowServer(directory)
    try:
        yield server
    finally:
        if server.proc is not None and server.proc.poll() is None:
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait(timeout=30)


def k3pipe_cli(*args: str, uri: str, timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
    """The k3pipe command line in its own process, pointed at ``uri`` and this test's K3PIPE_HOME
    (Prefect: a temporary server of its own under it)."""
    prefect_home = Settings().home_dir / "prefect"
    prefect_home.mkdir(parents=True, exist_ok=True)  # Prefect's temporary server makes no parent dirs
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": uri,
        "PYTHONUNBUFFERED": "1",
        "PREFECT_HOME": str(prefect_home),
    }
    env.pop("PREFECT_API_URL", None)
    return subprocess.run(
        [sys.executable, "-m", "k3pipe.cli.main", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


# -- the arm: an external endpoint (the scripted OpenAI server), two workloads -------------------------


def arm_experiment(base_url: str, requests: int = 12) -> dict[str, Any]:
    workload = {
        "input_tokens": 32,
        "output_tokens": 4,
        "concurrency": 2,
        "num_requests": requests,
        "warmup_requests": 0,
    }
    return {
        "name": "spooled",
        "model": {"source": "local", "path": str(TINY_MODEL)},
        "arms": [
            {
                "name": "gateway",
                "engine": {"kind": "vllm"},
                "launcher": {"kind": "external"},
                "endpoint": {"base_url": base_url, "api_key_env": "SPOOL_KEY", "model": "m"},
            }
        ],
        "workloads": [{"name": "w1", "seed": 1, **workload}, {"name": "w2", "seed": 2, **workload}],
    }


@pytest.fixture
def endpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[ScriptedOpenAI]:
    if not (TINY_MODEL / "config.json").is_file():
        pytest.fail(f"no tiny model at {TINY_MODEL}: run the tests with `make test`, which builds it")
    monkeypatch.setenv("SPOOL_KEY", KEY)
    with ScriptedOpenAI(Script(inter_token_s=0.001), api_key=KEY, model="m") as server:
        yield server


def arm_run(base_url: str, tracker: Tracker, steps: ArmSteps | None = None) -> ArmRun:
    spec = parse_experiment(arm_experiment(base_url))
    settings = Settings()
    models = {"model": fetch_model(spec.model, settings.home_dir)}
    prompts = prepare_prompts(spec.workloads, TINY_MODEL, settings.home_dir)
    return ArmRun(spec, "gateway", models, prompts, tracker, settings, steps=steps or ArmSteps.library())


def spool_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "k3pipe.records.tracking" and "not answering" in r.getMessage()
    ]


def children(client: MlflowClient, run_id: str) -> dict[str, Any]:
    """The workload runs under ``run_id``, by workload name."""
    experiment = client.get_run(run_id).info.experiment_id
    found = client.search_runs([experiment], filter_string=f"tags.mlflow.parentRunId = '{run_id}'")
    return {r.data.tags["k3pipe.workload"]: r for r in found}


def metric_histories(client: MlflowClient, run_ids: list[str]) -> dict[tuple[str, str], int]:
    out = {}
    for run_id in run_ids:
        for key in client.get_run(run_id).data.metrics:
            out[(run_id, key)] = len(client.get_metric_history(run_id, key))
    return out


# -- (b) the tracking server killed mid-run ----------------------------------------------------------


def test_mlflow_killed_mid_run_loses_nothing(
    mlflow_server: MlflowServer, endpoint: ScriptedOpenAI, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="k3pipe.records.tracking")
    mlflow_server.start()
    settings = Settings()
    tracker = Tracker(mlflow_server.uri, "spool-test", settings.artifact_root())
    library = ArmSteps.library()
    killed_at: list[float] = []

    def bench(plan: Any, workload: Any, *rest: Any) -> Any:
        if workload.name == "w2":  # w1 is recorded in MLflow by now: the server dies
            client = MlflowClient(mlflow_server.uri)
            (w1,) = client.search_runs([tracker.experiment_id], "tags.`k3pipe.workload` = 'w1'")
            assert w1.data.metrics["completed"] == 12
            mlflow_server.kill()
            killed_at.append(time.time())
        return library.benchmark(plan, workload, *rest)

    run = arm_run(endpoint.base_url, tracker, dataclasses.replace(library, benchmark=bench))
    outcome = run.execute()
    ended_at = time.time()
    # the run went on: the second workload ran and the arm finished, in bounded time
    assert outcome.status == "FINISHED", outcome
    assert [(w["workload"], w["completed"]) for w in outcome.workloads] == [("w1", 12), ("w2", 12)]
    assert tracker.offline_since is not None
    noticed_s = tracker.offline_since - killed_at[0]
    after_kill_s = ended_at - killed_at[0]
    print(f"\nMLflow killed -> k3pipe noticed: {noticed_s:.2f} s; kill -> arm ended: {after_kill_s:.2f} s")
    assert noticed_s < 10
    assert after_kill_s < 30
    # said once, naming the tracking URI and `k3pipe sync`
    (warning,) = spool_warnings(caplog)
    assert mlflow_server.uri in warning
    assert "k3pipe sync" in warning
    pending = tracker.pending()
    assert pending > 0
    tracker.close()
    # the spool holds everything after the kill: w2's run, its requests, the arm's end
    (session,) = list_sessions(settings.spool_dir())
    records = [r for j in session.journals() for r in _journal_lines(j)]
    assert any(r["op"] == "create" and r["name"] == "gateway/w2" for r in records)
    assert any(r["op"] == "artifact" and r["file"].endswith("requests.parquet") for r in records)
    assert any(r["op"] == "end" and r["status"] == "FINISHED" for r in records)
    assert KEY not in "".join(p.read_text(errors="replace") for p in session.dir.rglob("*") if p.is_file())

    # the server comes back on the same store and port: `k3pipe sync` pushes the rest
    mlflow_server.start()
    first = k3pipe_cli("sync", uri=mlflow_server.uri)
    print(first.stdout)
    assert first.returncode == 0, first.stdout + first.stderr
    assert f"{pending} record(s)" in first.stdout
    assert "nothing pending" in first.stdout
    client = MlflowClient(mlflow_server.uri)
    arm = client.get_run(outcome.mlflow_run_id)
    assert arm.info.status == "FINISHED"
    assert arm.info.end_time is not None
    assert arm.info.end_time <= int(ended_at * 1000) + 1000  # its end as measured, not the sync's
    for name in ("w1", "w2"):
        assert arm.data.metrics[f"{name}.ttft_ms_p50"] > 0
    workloads = children(client, outcome.mlflow_run_id)
    assert sorted(workloads) == ["w1", "w2"]
    for name, wl in workloads.items():
        assert wl.info.status == "FINISHED", name
        assert wl.data.metrics["completed"] == 12
        assert wl.data.params["workload.name"] == name
        assert {a.path for a in client.list_artifacts(wl.info.run_id)} >= {"requests.parquet", "summary.json"}
        local = client.download_artifacts(wl.info.run_id, "requests.parquet", str(mlflow_server.dir))
        assert len(pd.read_parquet(local)) == 12
    assert workloads["w2"].info.start_time < int(mlflow_server.started_at * 1000)  # as measured
    assert "logs" not in {a.path for a in client.list_artifacts(arm.info.run_id)}  # no engine log here
    assert "run_record.json" in {a.path for a in client.list_artifacts(arm.info.run_id)}
    # a second sync pushes nothing and duplicates nothing
    ids = [arm.info.run_id, *(w.info.run_id for w in workloads.values())]
    before = metric_histories(client, ids)
    assert all(n == 1 for n in before.values()), {k: n for k, n in before.items() if n != 1}
    second = k3pipe_cli("sync", uri=mlflow_server.uri)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "pushed 0 run(s): 0 record(s)" in second.stdout
    assert metric_histories(client, ids) == before
    assert list_sessions(settings.spool_dir()) == []


def _journal_lines(journal: Journal) -> list[dict[str, Any]]:
    return [json.loads(line) for line in journal.journal_path.read_text().splitlines()]


# -- (c) the tracking server never started -----------------------------------------------------------


def test_a_tracking_server_that_never_started_fails_the_start_in_seconds(tmp_path: Path) -> None:
    uri = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(TrackingUnreachableError) as caught:
        Tracker(uri, "spool-test")
    took_s = time.monotonic() - t0
    print(f"\nlibrary: MLflow never started -> TrackingUnreachableError in {took_s:.2f} s")
    assert took_s < 10
    assert str(caught.value) == (
        f"MLflow at {uri} is not reachable (connection refused): start it, or set K3PIPE_ALLOW_SPOOL=1 "
        "(or pass --spool) to record locally and push later with `k3pipe sync`"
    )


@pytest.mark.parametrize(
    "command", [("runs",), ("report", "some-run"), ("history", "ttft_ms_p50", "--workload", "w")], ids=str
)
def test_a_command_that_reads_does_not_offer_the_spool(command: tuple[str, ...]) -> None:
    """`k3pipe runs`, `report` and `history` with MLflow down: exit 2 with the sentence that helps a
    reader (start it, or point at the server that holds the runs), not a run's advice to record
    locally, which would leave them nothing to read."""
    uri = f"http://127.0.0.1:{free_port()}"
    done = k3pipe_cli(*command, uri=uri)
    assert done.returncode == 2, done.stdout + done.stderr
    said = " ".join(done.stderr.split())  # the terminal may wrap it
    expected = f"MLflow at {uri} is not reachable (connection refused): start it, or point MLFLOW_TRACKING"
    assert expected in said
    assert "--spool" not in said
    assert "K3PIPE_ALLOW_SPOOL" not in said
    assert "Traceback" not in done.stdout + done.stderr


def test_k3pipe_run_fails_in_seconds_and_starts_no_engine(tmp_path: Path) -> None:
    """`k3pipe run` of the demo experiment (a vLLM process arm) against a tracking server that never
    started: the one sentence, exit 2, before Prefect or the engine start."""
    engine_port, uri = free_port(), f"http://127.0.0.1:{free_port()}"
    exp = tmp_path / "exp.yaml"
    exp.write_text(yaml.safe_dump(demo_experiment(engine_port)))
    t0 = time.monotonic()
    done = k3pipe_cli("run", str(exp), uri=uri)
    took_s = time.monotonic() - t0
    print(f"\n`k3pipe run`: MLflow never started -> exit {done.returncode} in {took_s:.2f} s")
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"MLflow at {uri} is not reachable (connection refused)" in done.stderr
    assert "--spool" in done.stderr
    assert took_s < 30  # the interpreter's start and imports included; the probe itself is instant
    assert "prefect" not in (done.stdout + done.stderr).lower()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{engine_port}/health", timeout=2)


def test_with_the_spool_allowed_the_run_goes_on_and_sync_completes_it(
    mlflow_server: MlflowServer, endpoint: ScriptedOpenAI, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="k3pipe.records.tracking")
    settings = Settings()
    tracker = Tracker(mlflow_server.uri, "spool-test", settings.artifact_root(), allow_spool=True)
    assert not tracker.online
    t0 = time.monotonic()
    outcome = arm_run(endpoint.base_url, tracker).execute()
    took_s = time.monotonic() - t0
    assert outcome.status == "FINISHED", outcome
    assert took_s < 60
    assert len(spool_warnings(caplog)) == 1
    local_id = outcome.mlflow_run_id
    assert tracker.spooled_only(local_id)
    assert "k3pipe sync" in tracker.run_link(local_id)
    tracker.close()
    assert len(endpoint.requests) == 1 + 2 * 12  # the health gate's probe, then every request

    # another process dies mid-run while MLflow is down: its runs' ends are in the spool
    script = Path(mlflow_server.dir) / "dying.py"
    script.write_text(DYING)
    died = subprocess.run(
        [sys.executable, str(script), mlflow_server.uri, "raise"], cwd=REPO, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    assert died.returncode == 1, died.stderr
    died_ms = int(time.time() * 1000)
    dead_runs = died.stdout.split()

    # while MLflow is still down, sync says so in one sentence and exits 1
    down = k3pipe_cli("sync", uri=mlflow_server.uri)
    assert down.returncode == 1, down.stdout + down.stderr
    assert f"MLflow at {mlflow_server.uri} is not reachable (connection refused)" in down.stdout

    mlflow_server.start()
    up = k3pipe_cli("sync", uri=mlflow_server.uri)
    assert up.returncode == 0, up.stdout + up.stderr
    real = IdMap(settings.spool_dir()).get(local_id)
    assert real != local_id
    assert f"was local id {local_id}" in up.stdout
    client = MlflowClient(mlflow_server.uri)
    arm = client.get_run(real)
    assert arm.info.status == "FINISHED"
    assert arm.info.start_time < int(mlflow_server.started_at * 1000)  # as measured, not at sync
    workloads = children(client, real)  # their parent tag now holds the arm's MLflow id
    assert sorted(workloads) == ["w1", "w2"]
    assert all(w.info.status == "FINISHED" for w in workloads.values())
    assert all(
        "requests.parquet" in {a.path for a in client.list_artifacts(w.info.run_id)}
        for w in workloads.values()
    )
    # a text artifact that named the local id names the MLflow id
    record = client.download_artifacts(real, "run_record.json", str(mlflow_server.dir))
    assert local_id not in Path(record).read_text()
    # the dead process's runs: ended FAILED, at the time it died
    for run_id in dead_runs:
        info = client.get_run(IdMap(settings.spool_dir()).get(run_id)).info
        assert info.status == "FAILED"
        assert info.end_time <= died_ms
    # reads of the local id resolve to the MLflow run once synced
    reader = Tracker(mlflow_server.uri, "spool-test")
    assert reader.mlflow_id(local_id) == real
    from k3pipe.records.compare import find_run

    assert find_run(reader, local_id).info.run_id == real


def test_k3pipe_run_with_spool_then_the_next_run_pushes_it_first(
    mlflow_server: MlflowServer, endpoint: ScriptedOpenAI, tmp_path: Path
) -> None:
    """`k3pipe run --spool` with MLflow down runs the arm through the Prefect flow and says so once;
    the next `k3pipe run`, MLflow up, pushes that run before its flow starts (a notice on stderr, as
    every command that opens the store does: k3pipe/cli/closing.py), then records its own."""
    exp = tmp_path / "exp.yaml"
    data = arm_experiment(endpoint.base_url, requests=4)
    exp.write_text(yaml.safe_dump(data))
    spooled = k3pipe_cli("run", str(exp), "--spool", uri=mlflow_server.uri, timeout_s=400)
    out = spooled.stdout + spooled.stderr
    assert spooled.returncode == 0, out[-4000:]
    assert out.count("is not answering") == 1, out[-4000:]
    assert "k3pipe sync" in out
    arm_lines = [line for line in spooled.stdout.splitlines() if line.startswith("arm gateway:")]
    (local_id,) = [line.split()[-1] for line in arm_lines]
    assert "arm gateway: FINISHED" in spooled.stdout

    mlflow_server.start()
    second = k3pipe_cli("run", str(exp), uri=mlflow_server.uri, timeout_s=400)
    assert second.returncode == 0, (second.stdout + second.stderr)[-4000:]
    pushed = [line for line in second.stderr.splitlines() if line.startswith("spool: ")]
    assert any(f"was local id {local_id}" in line for line in pushed), second.stderr[-4000:]
    assert "spool: pushed" not in second.stdout  # said once, before the flow, not by the flow again
    real = IdMap(Settings().spool_dir()).get(local_id)
    client = MlflowClient(mlflow_server.uri)
    runs = client.search_runs([client.get_run(real).info.experiment_id], "tags.`k3pipe.arm` = 'gateway'")
    arms = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(arms) == 2
    assert {r.info.status for r in arms} == {"FINISHED"}
    assert list_sessions(Settings().spool_dir()) == []


def test_a_run_resumes_pushing_when_mlflow_comes_back(
    mlflow_server: MlflowServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Down at the start (spool allowed), up later: the next write after the retry interval pushes
    the backlog in order, runs made with local ids get their MLflow ids, and writing goes on live."""
    caplog.set_level(logging.WARNING, logger="k3pipe.records.tracking")
    monkeypatch.setenv("K3PIPE_SPOOL_RETRY_S", "0.5")
    tracker = Tracker(mlflow_server.uri, "spool-test", allow_spool=True)
    parent = tracker.start_run("study")
    child = tracker.start_run("arm", parent_id=parent, tags={"k3pipe.parent_was": parent})
    tracker.log_metrics(child, {"ttft_ms_p50": 1.5})
    t0 = time.monotonic()
    for i in range(50):  # offline: no write waits for MLflow
        tracker.log_metrics(child, {"tick": i}, step=i)
    assert time.monotonic() - t0 < 5
    mlflow_server.start()
    time.sleep(0.6)
    tracker.log_params(child, {"after": "up"})
    assert tracker.online
    assert tracker.pending() == 0
    tracker.end_run(child)
    tracker.end_run(parent)
    ids = IdMap(Settings().spool_dir())
    client = MlflowClient(mlflow_server.uri)
    run = client.get_run(ids.get(child))
    assert run.data.tags["mlflow.parentRunId"] == ids.get(parent) != parent
    assert run.data.tags["k3pipe.parent_was"] == ids.get(parent)
    assert run.data.params["after"] == "up"
    assert [m.value for m in client.get_metric_history(run.info.run_id, "tick")] == [
        float(i) for i in range(50)
    ]
    assert run.info.status == "FINISHED"
    messages = [r.getMessage() for r in caplog.records if r.name == "k3pipe.records.tracking"]
    assert len(spool_warnings(caplog)) == 1
    assert any("answers again" in m for m in messages)
    tracker.close()
    assert list_sessions(Settings().spool_dir()) == []  # all of it pushed: the session is gone


def test_a_hung_server_costs_one_timeout_then_writes_go_to_the_spool(
    mlflow_server: MlflowServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The server stops (SIGSTOP: it accepts connections and never answers): one write waits out
    k3pipe's short budget (10 s, one retry), the next ones do not wait; the server wakes, the
    tracker pushes the rest, and the record it may have taken late is not logged twice."""
    caplog.set_level(logging.WARNING, logger="k3pipe.records.tracking")
    mlflow_server.start()
    tracker = Tracker(mlflow_server.uri, "spool-test")
    run = tracker.start_run("arm")
    tracker.log_metrics(run, {"before": 1.0})
    assert mlflow_server.proc is not None
    os.killpg(mlflow_server.proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        tracker.log_metrics(run, {"during": 2.0})
        noticed_s = time.monotonic() - t0
        t1 = time.monotonic()
        for i in range(20):
            tracker.log_metrics(run, {"tick": float(i)}, step=i)
        rest_s = time.monotonic() - t1
    finally:
        os.killpg(mlflow_server.proc.pid, signal.SIGCONT)
    print(f"\nhung MLflow: the first write noticed it after {noticed_s:.1f} s; 20 more writes {rest_s:.2f} s")
    assert not tracker.online
    assert noticed_s < 30  # MLflow's own defaults: 7 retries of up to 120 s each
    assert rest_s < 2
    assert len(spool_warnings(caplog)) == 1
    assert tracker.flush()
    tracker.end_run(run)
    client = MlflowClient(mlflow_server.uri)
    assert len(client.get_metric_history(run, "during")) == 1
    assert len(client.get_metric_history(run, "tick")) == 20
    assert client.get_run(run).info.status == "FINISHED"
    tracker.close()


def test_a_servers_artifacts_absent_or_unreadable(mlflow_server: MlflowServer) -> None:
    """Through the server's proxied artifact store (mlflow-artifacts:/...), as `k3pipe report` reads
    a team stack's runs: an artifact the run has, one it lacks (None; required: the error names what
    it has), and, the server gone, artifacts that cannot be listed: an error, not an absent file."""
    mlflow_server.start()
    tracker = Tracker(mlflow_server.uri, "spool-test")
    run = tracker.start_run("reader")
    tracker.log_text(run, "hello", "notes/hello.txt")
    tracker.end_run(run)
    assert tracker.find_artifact(run, "notes/hello.txt") == b"hello"
    assert tracker.find_artifact(run, "notes/other.txt") is None
    assert tracker.find_artifact(run, "repeats.json") is None
    absent = r"has no artifact repeats\.json: its artifacts at mlflow-artifacts:\S+ are notes"
    with pytest.raises(ArtifactMissingError, match=absent):
        tracker.read_artifact(run, "repeats.json", required=True)
    mlflow_server.kill()
    t0 = time.monotonic()
    with pytest.raises(ArtifactStoreError, match=r"cannot be read \(repeats\.json among them\): listing "):
        tracker.find_artifact(run, "repeats.json")
    assert tracker.read_artifact(run, "notes/hello.txt") is None  # the other callers' read: as it was
    assert time.monotonic() - t0 < 60  # k3pipe's short retry budget, twice
    tracker.close()


# -- (d) no run is left RUNNING ----------------------------------------------------------------------


def test_an_exception_mid_run_leaves_no_run_running(tmp_path: Path, endpoint: ScriptedOpenAI) -> None:
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "test", tmp_path / "artifacts")
    library = ArmSteps.library()

    def bench(plan: Any, workload: Any, *rest: Any) -> Any:
        if workload.name == "w2":
            raise RuntimeError("the client broke")
        return library.benchmark(plan, workload, *rest)

    outcome = arm_run(endpoint.base_url, tracker, dataclasses.replace(library, benchmark=bench)).execute()
    assert outcome.status == "FAILED"
    assert tracker.open_runs() == {}
    runs = tracker.client.search_runs([tracker.experiment_id])
    assert len(runs) == 2
    assert {r.info.status for r in runs} == {"FINISHED", "FAILED"}  # w1 finished, the arm failed


DYING = textwrap.dedent(
    """
    import os, signal, sys, time
    from k3pipe.records.tracking import Tracker

    def term(signum, frame):  # as the CLI does: SIGTERM raises, so that exits run
        raise SystemExit(143)

    signal.signal(signal.SIGTERM, term)
    tracker = Tracker(sys.argv[1], "test", allow_spool=True)
    parent = tracker.start_run("study")
    child = tracker.start_run("arm", parent_id=parent)
    tracker.log_metrics(child, {"measured": 1.0})
    print(parent, child, flush=True)
    if sys.argv[2] == "raise":
        raise RuntimeError("mid-run")
    if sys.argv[2] == "sigkill":  # nothing of the process runs after this: sync ends its runs
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)
    """
)


@pytest.mark.parametrize(
    ("how", "status"), [("raise", "FAILED"), ("sigterm", "KILLED"), ("sigkill", "KILLED")]
)
def test_a_process_that_dies_ends_its_open_runs(tmp_path: Path, how: str, status: str) -> None:
    """An uncaught exception, or SIGTERM turned into an exit: the runs are ended as the process
    ends. SIGKILL: nothing runs in the process; the next sync ends its runs."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    script = tmp_path / "dying.py"
    script.write_text(DYING)
    proc = subprocess.Popen(
        [sys.executable, str(script), uri, how], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        parent, child = proc.stdout.readline().split()
        if how == "sigterm":
            proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    client = MlflowClient(uri)
    if how == "sigkill":
        assert client.get_run(child).info.status == "RUNNING"
        synced = k3pipe_cli("sync", uri=uri)
        assert synced.returncode == 0, synced.stdout + synced.stderr
        assert "ended 2 run(s) KILLED" in synced.stdout
    assert client.get_run(parent).info.status == status
    assert client.get_run(child).info.status == status
    assert client.get_run(child).data.metrics == {"measured": 1.0}
    assert client.get_run(child).info.end_time is not None


# -- (a) the journal, its replay and sync, against a real SQLite store -------------------------------


def sqlite_session(tmp_path: Path, spool: Path) -> tuple[SessionDir, str]:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    meta = {"tracking_uri": uri, "experiment": "journal", "artifact_root": str(tmp_path / "artifacts")}
    session = SessionDir.create(spool, meta)
    session.release()  # as a tracker that is gone leaves it
    return session, uri


def test_a_journal_replays_what_was_appended(tmp_path: Path) -> None:
    session, _ = sqlite_session(tmp_path, tmp_path / "spool")
    run_id = new_run_id()
    journal = Journal.create(session.dir, 1, run_id)
    journal.append("create", {"name": "r", "tags": {}, "start_ms": 5})
    journal.append("metrics", {"metrics": [["m", 1.0, 7, 0]]})
    journal.append("artifact", {"dir": "a", "text": False}, b"\x89PNG\x00bytes", "fig.png")
    with journal.journal_path.open("a") as fh:
        fh.write('{"seq": 4, "op": "tags", "tags"')  # a crash mid-write: a torn last line
    again = Journal(journal.dir)
    assert again.run_id == run_id
    assert again.created_here
    records = list(again.records())
    assert [r["op"] for r in records] == ["create", "metrics", "artifact"]
    assert again.file(records[2]).read_bytes() == b"\x89PNG\x00bytes"
    again.mark_inflight(1)
    again.mark_pushed(1)
    again.mark_mlflow_id("f" * 32)
    third = Journal(journal.dir)
    assert (third.progress.pushed, third.progress.mlflow_id, third.pending) == (1, "f" * 32, 2)
    assert [r["seq"] for r in third.records()] == [2, 3]


def test_sync_pushes_journals_in_order_maps_ids_and_is_idempotent(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    session, uri = sqlite_session(tmp_path, spool)
    parent_local, child_local = new_run_id(), new_run_id()
    parent = Journal.create(session.dir, 1, parent_local)
    parent.append("create", {"name": "study", "tags": {"k3pipe.kind": "study"}, "start_ms": 1_000})
    parent.append("params", {"params": {"experiment": "e"}})
    child = Journal.create(session.dir, 2, child_local)
    child.append(
        "create",
        {
            "name": "arm",
            "tags": {"mlflow.parentRunId": parent_local, "k3pipe.study": parent_local},
            "start_ms": 2_000,
        },
    )
    child.append("metrics", {"metrics": [["ttft_ms_p50", 12.5, 2_500, 0], ["tick", 1.0, 2_600, 3]]})
    child.append("artifact", {"dir": "notes", "text": True}, f"parent {parent_local}\n".encode(), "n.txt")
    child.append("end", {"status": "FAILED", "end_ms": 3_000})
    parent.append("end", {"status": "FINISHED", "end_ms": 4_000})

    report = sync_spool(spool)
    assert report.done
    assert (report.records, report.artifacts, len(report.runs)) == (7, 1, 2)
    ids = IdMap(spool)
    client = MlflowClient(uri)
    p, c = client.get_run(ids.get(parent_local)), client.get_run(ids.get(child_local))
    assert (p.info.start_time, p.info.end_time, p.info.status) == (1_000, 4_000, "FINISHED")
    assert (c.info.start_time, c.info.end_time, c.info.status) == (2_000, 3_000, "FAILED")
    assert c.data.tags["mlflow.parentRunId"] == c.data.tags["k3pipe.study"] == p.info.run_id
    assert [(m.timestamp, m.step) for m in client.get_metric_history(c.info.run_id, "tick")] == [(2_600, 3)]
    text = Path(client.download_artifacts(c.info.run_id, "notes/n.txt", str(tmp_path))).read_text()
    assert text == f"parent {p.info.run_id}\n"
    assert list_sessions(spool) == []  # all in MLflow: the session is removed
    again = sync_spool(spool)
    assert (again.records, again.done) == (0, True)
    assert len(client.search_runs([p.info.experiment_id])) == 2


def test_a_push_cut_short_is_neither_lost_nor_duplicated(tmp_path: Path) -> None:
    """The process died after MLflow took a record and before its progress was written: sync finds
    the run by name and start time instead of creating it again, and skips the metrics MLflow has
    (a SQL store ignores an exact repeat itself; a file store would keep both)."""
    spool = tmp_path / "spool"
    session, uri = sqlite_session(tmp_path, spool)
    meta = session.meta
    local = new_run_id()
    journal = Journal.create(session.dir, 1, local)
    journal.append("create", {"name": "arm", "tags": {}, "start_ms": 1_000})
    journal.append("metrics", {"metrics": [["a", 1.0, 1_100, 0], ["b", 2.0, 1_100, 0]]})
    client = MlflowClient(uri)
    experiment = client.create_experiment("journal", artifact_location=(tmp_path / "artifacts").as_uri())
    # what MLflow got before the crash: the run
    made = client.create_run(experiment, start_time=1_000, run_name="arm")
    journal.mark_inflight(1)
    report = sync_spool(spool)
    assert report.done
    assert IdMap(spool).get(local) == made.info.run_id
    assert len(client.search_runs([experiment])) == 1
    assert [m.value for m in client.get_metric_history(made.info.run_id, "b")] == [2.0]
    # a metrics record in flight when cut short, one of its metrics in MLflow: nothing is logged twice
    session2 = SessionDir.create(spool, meta)
    session2.release()
    journal2 = Journal.create(session2.dir, 1, made.info.run_id)
    journal2.append("metrics", {"metrics": [["c", 3.0, 1_200, 0], ["d", 4.0, 1_200, 0]]})
    client.log_metric(made.info.run_id, "c", 3.0, timestamp=1_200, step=0)
    journal2.mark_inflight(1)
    assert sync_spool(spool).done
    assert len(client.get_metric_history(made.info.run_id, "c")) == 1
    assert len(client.get_metric_history(made.info.run_id, "d")) == 1


def test_sync_leaves_a_session_that_is_still_being_written_and_sets_refused_records_aside(
    tmp_path: Path,
) -> None:
    spool = tmp_path / "spool"
    session, uri = sqlite_session(tmp_path, spool)
    journal = Journal.create(session.dir, 1, new_run_id())
    journal.append("create", {"name": "r", "tags": {}, "start_ms": 1_000})
    journal.append("params", {"params": {"p": "1"}})
    journal.append("params", {"params": {"p": "2"}})  # MLflow refuses to change a param
    journal.append("tags", {"tags": {"t": "kept"}})
    fd = try_lock(session.lock_path)
    assert fd is not None
    try:
        busy = sync_spool(spool)
        assert (busy.done, busy.pending, busy.busy) == (False, 4, [session.name])
    finally:
        unlock(fd)
    report = sync_spool(spool)
    assert report.done
    assert len(report.refused) == 1
    assert "params of run" in report.refused[0]
    run = MlflowClient(uri).get_run(IdMap(spool).get(journal.run_id))
    assert (run.data.params, run.data.tags["t"]) == ({"p": "1"}, "kept")
    # the refused record is not thrown away: its session is kept aside, where sync no longer looks
    assert report.kept == [str(spool / "refused" / session.name)]
    assert '"p":"2"' in next((spool / "refused" / session.name).rglob("journal.jsonl")).read_text()
    assert list_sessions(spool) == []
    assert sync_spool(spool).done


def test_secrets_are_scrubbed_before_the_spool(tmp_path: Path) -> None:
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens: every write stays in the spool
    with Tracker(uri, "t", secrets=[KEY], allow_spool=True) as tracker:
        run = tracker.start_run("r", tags={"k": f"key {KEY}"})
        tracker.log_params(run, {"cmd": f"--api-key {KEY}", "long": KEY * 400})
        tracker.log_text(run, f"Authorization: Bearer {KEY}", "t.txt")
        tracker.log_frame(run, pd.DataFrame({"error": [f"401 for {KEY}"]}), "requests.parquet")
        spooled = b"".join(p.read_bytes() for p in tracker.spool_dir.rglob("*") if p.is_file())
        assert KEY.encode() not in spooled
        assert b"***" in spooled
    # leaving the tracker ended the run it left open: KILLED, in the spool
    (session,) = list_sessions(tracker.spool_dir)
    (journal,) = session.journals()
    assert _journal_lines(journal)[-1]["op"] == "end"
    assert _journal_lines(journal)[-1]["status"] == "KILLED"
    assert tracker.open_runs() == {}
