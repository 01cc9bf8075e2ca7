"""The ``gpustack`` launcher through the benchmark flow, against k3pipe/testing/gpustack_standin.py.

The stand-in, not the real GPUStack: a GPUStack worker runs a custom backend as a container on the
host network and needs GPUs it detects (see the stand-in's docstring); neither is here. The stand-in
speaks GPUStack 2.3.0's /v2 API and OpenAI gateway as its source defines them and runs the rendered
run command as a process: the engine is k3pipe/testing/fake_engine.py (vLLM flavour, 5 ms a token).

Each test runs the flow in process (the session's Prefect harness) and then asks the stand-in what
it was asked: the backend registered, the deployment created with restart_on_error false, requests
under the deployment's name through the gateway, the deployment deleted and then looked up until it
answered 404; and asks MLflow and K3PIPE_HOME what they hold (the instance's log, never the key).
"""

from __future__ import annotations

import secrets
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from k3pipe.bench.health import wait_ready
from k3pipe.core.settings import Settings
from k3pipe.experiment.load import load_experiment
from k3pipe.jobs.arm_run import INTERRUPT_GRACE_S
from k3pipe.launchers.factory import launch_engine
from k3pipe.launchers.gpustack import GpustackLauncher
from k3pipe.planning.plan import plan_arm
from k3pipe.records.tracking import Tracker
from k3pipe.testing import FAKE_ENGINE
from k3pipe.testing.gpustack_standin import GpustackStandin
from tests.conftest import TINY_MODEL, require_engine

pytestmark = [pytest.mark.flow]

KEY_ENV = "K3PIPE_TEST_GPUSTACK_KEY"
NAME = "k3pipe-gs-vllm"
WORKLOAD = {"name": "w", "input_tokens": 16, "output_tokens": 4, "num_requests": 6, "concurrency": 2}


def _experiment(url: str, tmp_path: Path, launcher: dict[str, Any] | None = None, **engine_args: Any) -> Path:
    data = {
        "name": "gs",
        "model": {"source": "local", "path": str(TINY_MODEL)},
        "arms": [
            {
                "name": "vllm",
                "engine": {
                    "kind": "vllm",
                    "image": "vllm/vllm-openai:kimi-k3",
                    "executable": [sys.executable, str(FAKE_ENGINE)],
                    "args": {"startup_delay_s": 1.0, **engine_args},
                },
                "launcher": {
                    "kind": "gpustack",
                    "server_url": url,
                    "api_key_env": KEY_ENV,
                    "backend": "vllm-k3-custom",
                    "backend_version": "kimi-k3-custom",
                    "worker": "standin-worker",
                    "gpus": [0, 1],
                    "host": "127.0.0.1",  # tests bind loopback only (GPUStack's default is 0.0.0.0)
                    "poll_s": 0.2,
                    "startup_timeout_s": 60,
                    "stop_timeout_s": 20,
                    **(launcher or {}),
                },
            }
        ],
        "workloads": [WORKLOAD],
    }
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def key(monkeypatch: pytest.MonkeyPatch) -> str:
    require_engine()  # the tiny model's tokenizer
    value = f"gpustack{secrets.token_hex(16)}"  # no well-known key shape: scrubbed because it was found
    monkeypatch.setenv(KEY_ENV, value)
    return value


def _only_run() -> tuple[Tracker, Any]:
    settings = Settings()
    tracker = Tracker(settings.tracking_uri(), settings.mlflow_experiment)
    runs = tracker.client.search_runs([tracker.experiment_id])
    runs = [r for r in runs if "k3pipe.workload" not in r.data.tags]
    assert len(runs) == 1, [r.data.tags for r in runs]
    return tracker, runs[0]


def _engine_log(tracker: Tracker, run: Any, tmp_path: Path) -> str:
    local = Path(tracker.client.download_artifacts(run.info.run_id, "logs", str(tmp_path / "dl")))
    return "\n".join(p.read_text(errors="replace") for p in local.rglob("*") if p.is_file())


def _deleted_and_confirmed(gs: GpustackStandin) -> None:
    assert gs.models == {}, "the deployment is still on GPUStack"
    assert gs.instances == {}, "its instance is still on GPUStack"
    deletes = [i for i, c in enumerate(gs.calls) if c[0] == "DELETE" and c[1].startswith("/v2/models/")]
    assert len(deletes) == 1, gs.calls
    model_path = gs.calls[deletes[0]][1]
    assert ("GET", model_path) in gs.calls[deletes[0] :], "stop did not look the deployment up again"


def _no_key_anywhere(key: str, home: Path, output: str) -> None:
    """Not in the terminal, nor any file of K3PIPE_HOME (MLflow's store and artifacts, the engine
    log), nor the Prefect harness's database (flow and task logs, parameters, results)."""
    import prefect.settings

    assert key not in output
    needle = key.encode()
    url = str(prefect.settings.PREFECT_SERVER_DATABASE_CONNECTION_URL.value())
    prefect_db = Path(url.split(":///", 1)[1])
    files = [p for p in home.rglob("*") if p.is_file()]
    files += [p for p in prefect_db.parent.glob(prefect_db.name + "*") if p.is_file()]
    assert any(p.name == prefect_db.name for p in files), url
    for path in files:
        assert needle not in path.read_bytes(), f"the GPUStack key is in {path}"


def test_a_gpustack_arm_deploys_benchmarks_through_the_gateway_and_is_deleted(
    prefect_harness: None,
    tmp_path: Path,
    key: str,
    capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    from k3pipe.flows.benchmark import benchmark

    with GpustackStandin(key, pace_s=0.6) as gs:
        benchmark(str(_experiment(gs.url, tmp_path)))
        backend = next(iter(gs.backends.values()))
        _deleted_and_confirmed(gs)
        proxied = set(gs.proxied_models)
    out = capfd.readouterr()
    output = out.out + out.err

    # the backend: the arm's image, its command with GPUStack's placeholders, the engine's health path
    version = backend["version_configs"]["kimi-k3-custom"]
    assert version["image_name"] == "vllm/vllm-openai:kimi-k3"
    command = version["run_command"].replace("'", "")
    assert "--model {{model_path}} --served-model-name {{model_name}}" in command
    assert "--port {{port}}" in command
    assert backend["health_check_path"] == "/health"
    # the deployment: one replica on the worker's GPUs 0 and 1, never restarted on error
    (model,) = gs.created
    assert (model["name"], model["replicas"], model["restart_on_error"]) == (NAME, 1, False)
    assert (model["source"], model["local_path"]) == ("local_path", str(TINY_MODEL))
    assert model["worker_selector"] == {"worker-name": "standin-worker"}
    assert model["gpu_selector"]["gpu_ids"] == ["standin-worker:cuda:0", "standin-worker:cuda:1"]
    # every request went through GPUStack's gateway under the deployment's name
    assert proxied == {NAME}
    # the instance's states as progress in the flow's log
    # (as often as the health wait polls: a state shorter than a poll may pass unseen)
    # (the flow's log reaches the terminal, or only the log capture when an earlier test of the
    # session configured logging first: both are read)
    lines = [line for line in [*output.splitlines(), *caplog.messages] if "gpustack: instance" in line]
    states = ["DOWNLOADING", "STARTING", "RUNNING on worker standin-worker GPUs [0, 1]"]
    for state in states:
        assert any(state in line for line in lines), (state, lines)
    tracker, run = _only_run()
    assert run.info.status == "FINISHED", run.data.tags.get("k3pipe.error")
    log = _engine_log(tracker, run, tmp_path)
    assert "Application startup complete" in log  # the instance's log, streamed into the record
    _no_key_anywhere(key, Path(Settings().home_dir), output)


def _failed_run(
    gs: GpustackStandin,
    experiment: Path,
    key: str,
    capfd: pytest.CaptureFixture[str],
    match: str | None = None,
) -> str:
    """The flow on ``experiment`` fails (``RuntimeError`` matching ``match``), the deployment is deleted
    and confirmed gone, the arm's MLflow run is FAILED and the key is nowhere: the run's error."""
    from k3pipe.flows.benchmark import benchmark

    with pytest.raises(RuntimeError, match=match):
        benchmark(str(experiment))
    _deleted_and_confirmed(gs)
    out = capfd.readouterr()
    _, run = _only_run()
    assert run.info.status == "FAILED"
    _no_key_anywhere(key, Path(Settings().home_dir), out.out + out.err)
    return str(run.data.tags["k3pipe.error"])


def test_an_engine_crash_mid_workload_fails_the_run_and_the_deployment_is_deleted(
    prefect_harness: None, tmp_path: Path, key: str, capfd: pytest.CaptureFixture[str]
) -> None:
    # the 1st request is the health gate's probe; the engine is killed after the 3rd
    with GpustackStandin(key, kill_after_requests=3) as gs:
        error = _failed_run(gs, _experiment(gs.url, tmp_path), key, capfd)
    # the gateway answers 404 at once for a model with no running instance: the requests fail, or
    # the engine watch (the instance's state) ends the workload first
    assert "requests failed" in error or "ended early" in error, error


def test_an_instance_error_at_start_fails_with_its_message_and_log(
    prefect_harness: None, tmp_path: Path, key: str, capfd: pytest.CaptureFixture[str]
) -> None:
    with GpustackStandin(key) as gs:
        experiment = _experiment(gs.url, tmp_path, crash_after_s=0.5)
        error = _failed_run(gs, experiment, key, capfd, match="LaunchError")
    assert "went to ERROR: the inference server exited with code 3" in error, error
    assert "Engine core initialization failed" in error  # the instance's last log lines


def test_a_failed_health_gate_fails_the_run_and_the_deployment_is_deleted(
    prefect_harness: None, tmp_path: Path, key: str, capfd: pytest.CaptureFixture[str]
) -> None:
    with GpustackStandin(key, gateway_status=502) as gs:
        error = _failed_run(gs, _experiment(gs.url, tmp_path), key, capfd)
    assert "502" in error, error


# -- the launcher alone (no flow): the interrupt's short stop, a leftover, a stuck deletion ----------


def _started(url: str, tmp_path: Path, **launcher: Any) -> GpustackLauncher:
    spec = load_experiment(_experiment(url, tmp_path, launcher))
    plan = plan_arm(spec, spec.arms[0], tmp_path / "home", {"model": str(TINY_MODEL)})
    launcher = launch_engine(plan, tmp_path / "engine.log", Settings(), None)
    assert isinstance(launcher, GpustackLauncher)
    wait_ready(plan, launcher)
    return launcher


def test_an_interrupts_short_stop_deletes_and_confirms_within_its_grace(tmp_path: Path, key: str) -> None:
    with GpustackStandin(key, pace_s=0.05) as gs:
        launcher = _started(gs.url, tmp_path, worker=1)  # the worker by its id
        t0 = time.monotonic()
        launcher.stop(grace_s=INTERRUPT_GRACE_S)
        took = time.monotonic() - t0
        _deleted_and_confirmed(gs)
        assert launcher.left_behind is None
        launcher.stop()  # twice: nothing more
        assert sum(c[0] == "DELETE" for c in gs.calls) == 1
    assert took < INTERRUPT_GRACE_S + 1.0, took


def test_a_deployment_left_by_a_killed_run_is_deleted_before_the_next_start(tmp_path: Path, key: str) -> None:
    with GpustackStandin(key, pace_s=0.05) as gs:
        killed = _started(gs.url, tmp_path)  # its run killed: no stop
        leftover = killed.model_id
        again = _started(gs.url, tmp_path / "again")
        assert leftover not in gs.models
        assert ("DELETE", f"/v2/models/{leftover}") in gs.calls
        again.stop()
        killed.stop()  # its teardown after all: already gone (404), confirmed
        assert killed.left_behind is None
        assert gs.models == {}
        assert gs.instances == {}


def test_a_deletion_that_never_shows_is_reported_within_the_bound_not_raised(
    tmp_path: Path, key: str, caplog: pytest.LogCaptureFixture
) -> None:
    with GpustackStandin(key, pace_s=0.05, keep_deleted=True) as gs:
        launcher = _started(gs.url, tmp_path)
        t0 = time.monotonic()
        launcher.stop(grace_s=1.0)
        took = time.monotonic() - t0
        assert gs.models, "the stand-in keeps it"
        assert launcher.left_behind is not None
        assert "still listed after 1 s; check GPUStack and delete it there" in launcher.left_behind
        assert "still listed" in caplog.text
        gs.keep_deleted = False
        launcher.stop()  # stop again: it deletes and confirms this time
        assert launcher.left_behind is None
        assert gs.models == {}
    assert took < 2.5, took
