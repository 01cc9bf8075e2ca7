"""The arm's lifetime as a library context manager, without Prefect: an `external` arm against the
scripted OpenAI server (k3pipe/testing/scripted_openai.py; real HTTP and SSE, no engine), a real SQLite MLflow
store. Teardown and status on every path: success, failed requests, a failing step, an interrupt."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from k3pipe.core.layout import RECORD_FILE
from k3pipe.core.settings import Settings
from k3pipe.experiment.load import parse_experiment
from k3pipe.jobs.arm_run import INTERRUPT_GRACE_S, ArmRun, ArmSteps
from k3pipe.prompts.draw import prepare_prompts
from k3pipe.records.tracking import Tracker
from k3pipe.sources import fetch_model
from k3pipe.testing.scripted_openai import Script, ScriptedOpenAI
from tests.conftest import TINY_MODEL


class Recorded:
    """A launcher that only remembers whether it was stopped."""

    kind = "external"

    def __init__(self) -> None:
        self.stopped = 0

    def start(self) -> None:
        pass

    def alive(self) -> bool:
        return True

    def stop(self, grace_s: float | None = None) -> None:
        self.stopped += 1
        self.grace_s = grace_s


@pytest.fixture
def arm_parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    if not (TINY_MODEL / "config.json").is_file():
        pytest.skip(f"no tiny model at {TINY_MODEL} (make model)")
    monkeypatch.setenv("K3PIPE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("ARM_KEY", "sk-arm-test")
    with ScriptedOpenAI(Script(inter_token_s=0.001), api_key="sk-arm-test", model="m") as server:

        def make(steps: ArmSteps | None = None, **workload: Any) -> ArmRun:
            spec = parse_experiment(
                {
                    "name": "lifetime",
                    "model": {"source": "local", "path": str(TINY_MODEL)},
                    "arms": [
                        {
                            "name": "gateway",
                            "engine": {"kind": "vllm"},
                            "launcher": {"kind": "external"},
                            "endpoint": {"base_url": server.base_url, "api_key_env": "ARM_KEY", "model": "m"},
                        }
                    ],
                    "workloads": [
                        {
                            "name": "w",
                            "input_tokens": 32,
                            "output_tokens": 4,
                            "concurrency": 2,
                            "num_requests": 4,
                            "warmup_requests": 0,
                            "seed": 1,
                            **workload,
                        },
                    ],
                }
            )
            settings = Settings()
            models = {"model": fetch_model(spec.model, settings.home_dir)}
            prompts = prepare_prompts(spec.workloads, TINY_MODEL, settings.home_dir)
            tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "test", tmp_path / "artifacts")
            return ArmRun(
                spec, "gateway", models, prompts, tracker, settings, steps=steps or ArmSteps.library()
            )

        yield make, server


def test_an_arm_runs_end_to_end_without_prefect(arm_parts) -> None:  # type: ignore[no-untyped-def]
    make, server = arm_parts
    run = make()
    outcome = run.execute()
    assert outcome.status == "FINISHED", outcome
    assert outcome.error is None
    (row,) = outcome.workloads
    assert row["workload"] == "w"
    assert row["completed"] == 4
    mlflow_run = run.tracker.client.get_run(outcome.mlflow_run_id)
    assert mlflow_run.info.status == "FINISHED"
    artifacts = {a.path for a in run.tracker.client.list_artifacts(outcome.mlflow_run_id)}
    assert RECORD_FILE in artifacts
    # the probe of the health gate plus the four measured requests, each with the key
    assert len(server.requests) == 5
    assert all(r.headers.get("authorization") == "Bearer sk-arm-test" for r in server.requests)


def test_the_key_is_read_once_and_handed_to_every_step(  # type: ignore[no-untyped-def]
    arm_parts, monkeypatch: pytest.MonkeyPatch
) -> None:
    make, _server = arm_parts
    import k3pipe.jobs.arm_run

    reads: list[str | None] = []
    real = k3pipe.jobs.arm_run.read_secret

    def counted(name: str | None) -> Any:
        reads.append(name)
        return real(name)

    monkeypatch.setattr(k3pipe.jobs.arm_run, "read_secret", counted)
    seen: list[Any] = []
    library = ArmSteps.library()

    def gate(plan: Any, key: Any) -> Any:
        seen.append(key)
        return library.health_gate(plan, key)

    def bench(plan: Any, workload: Any, model_dir: Any, key: Any, *rest: Any) -> Any:
        seen.append(key)
        return library.benchmark(plan, workload, model_dir, key, *rest)

    outcome = make(dataclasses.replace(library, health_gate=gate, benchmark=bench)).execute()
    assert outcome.status == "FINISHED", outcome
    assert reads == ["ARM_KEY"]
    assert len(seen) == 2
    assert all(k is not None and k.get_secret_value() == "sk-arm-test" for k in seen)
    assert "sk-arm-test" not in repr(seen)


def test_failed_requests_fail_the_arm_but_keep_its_rows(arm_parts) -> None:  # type: ignore[no-untyped-def]
    make, server = arm_parts
    run = make()
    probe_done = {"n": 0}

    def script(received: Any) -> Script:
        probe_done["n"] += 1
        return Script() if probe_done["n"] == 1 else Script(status=500)

    server.script = script
    outcome = run.execute()
    assert outcome.status == "FAILED"
    (row,) = outcome.workloads
    assert row["failed"] == 4
    assert run.tracker.client.get_run(outcome.mlflow_run_id).info.status == "FAILED"


def test_a_failing_step_is_recorded_and_the_engine_stopped(arm_parts) -> None:  # type: ignore[no-untyped-def]
    make, _server = arm_parts
    launcher = Recorded()

    def gate(plan: Any, key: Any) -> Any:
        raise RuntimeError("the gate said no")

    steps = dataclasses.replace(
        ArmSteps.library(),
        start_engine=lambda *a, **k: launcher,
        wait_ready=lambda plan, engine: 0.0,
        health_gate=gate,
    )
    run = make(steps)
    outcome = run.execute()  # an ordinary error does not escape: the study goes on with other arms
    assert outcome.status == "FAILED"
    assert outcome.error == "RuntimeError: the gate said no"
    assert launcher.stopped == 1
    tags = run.tracker.client.get_run(outcome.mlflow_run_id).data.tags
    assert tags["k3pipe.error"] == "RuntimeError: the gate said no"


def test_an_interrupt_stops_the_engine_and_goes_on_up(arm_parts) -> None:  # type: ignore[no-untyped-def]
    make, _server = arm_parts
    launcher = Recorded()

    def bench(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    steps = dataclasses.replace(ArmSteps.library(), start_engine=lambda *a, **k: launcher, benchmark=bench)
    run = make(steps)
    with pytest.raises(KeyboardInterrupt):
        run.execute()
    assert launcher.stopped == 1
    assert launcher.grace_s == INTERRUPT_GRACE_S  # an interrupted run ends within seconds
    assert run.outcome is not None
    assert run.outcome.status == "KILLED"
    assert run.tracker.client.get_run(run.outcome.mlflow_run_id).info.status == "KILLED"


def test_launch_outside_the_context_manager_says_how_to_use_it(arm_parts) -> None:  # type: ignore[no-untyped-def]
    make, _server = arm_parts
    with pytest.raises(RuntimeError, match="with ArmRun"):
        make().launch()
