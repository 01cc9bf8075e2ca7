"""A real gateway in front of the engine k3pipe starts: LiteLLM's proxy (``litellm[proxy]``, the
version `make gateway` installs into ``K3PIPE_HOME/venvs/litellm-<version>``) routing a model id of
its own to the real vLLM (CPU) that k3pipe launches on a fixed port, with a key of its own.

One LiteLLM serves the module; it is started before the engine (it reaches the engine only when a
request comes). Two engine starts in all: the benchmark flow through the gateway, and one arm whose
health gate fails on the gateway (a wrong gateway key) and tries the other bad settings meanwhile.

What LiteLLM 1.108.7 really answers (measured here, and what the gate's messages are written for):
without a database, a key that is not its master key gets 400 ``No connected db.`` (not 401), no
key at all 500; it serves ``/models`` and ``/v1/models`` alike (also with ``SERVER_ROOT_PATH``), so
a base URL without its path still works there, and a path it does not serve (the study's ``/api/v1``)
gets 404; it forwards ``stream_options.continuous_usage_stats`` to vLLM but relays usage in the last
chunk only, so ITL through it is per chunk.
"""

from __future__ import annotations

import dataclasses
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from k3pipe.core.errors import EndpointAuthError, HealthError, ModelNotServedError
from k3pipe.testing import FAKE_ENGINE
from tests.conftest import ASSETS_HOME, demo_experiment, free_port, require_engine, stop_group

pytestmark = [pytest.mark.engine, pytest.mark.flow]

LITELLM_VERSION = "1.108.7"  # the Makefile's LITELLM_VERSION
LITELLM = ASSETS_HOME / "venvs" / f"litellm-{LITELLM_VERSION}" / "bin" / "litellm"
GATEWAY_MODEL = "gw-tiny"  # the gateway's own id for the route to the engine's 'tiny-llama'
ENGINE_VAR = "GW_TEST_ENGINE_KEY"  # endpoint.api_key_env: the engine's key (VLLM_API_KEY)
GATEWAY_VAR = "GW_TEST_GATEWAY_KEY"  # gateway.api_key_env: LiteLLM's master key
WRONG_VAR = "GW_TEST_WRONG_KEY"  # a variable holding a key the gateway does not know

WORKLOAD = {
    "name": "in32-out8",
    "input_tokens": 32,
    "output_tokens": 8,
    "concurrency": 2,
    "num_requests": 4,
    "warmup_requests": 1,
    "seed": 5,
}


@dataclass
class Gateway:
    base_url: str  # with its '/v1'
    log_path: Path
    engine_port: int
    keys: dict[str, str]  # variable -> value, for the test's environment

    def chat_posts(self) -> int:
        """Chat completions the gateway answered 200 (uvicorn's access lines in its log)."""
        text = self.log_path.read_text(errors="replace")
        return len(re.findall(r'"POST /v1/chat/completions HTTP/1\.1" 200', text))


def _config(engine_port: int, settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """LiteLLM's config: the gateway's model id routed to the engine's served name, the engine's key
    and the master key from the environment (no value in the file), no retries, no database;
    ``settings`` join its litellm_settings (a callback)."""
    return {
        "model_list": [
            {
                "model_name": GATEWAY_MODEL,
                "litellm_params": {
                    "model": "hosted_vllm/tiny-llama",
                    "api_base": f"http://127.0.0.1:{engine_port}/v1",
                    "api_key": f"os.environ/{ENGINE_VAR}",
                },
            }
        ],
        "router_settings": {"num_retries": 0},
        "litellm_settings": {"telemetry": False, "num_retries": 0, **(settings or {})},
        "general_settings": {"master_key": f"os.environ/{GATEWAY_VAR}"},
    }


@contextmanager
def running_litellm(
    directory: Path, engine_port: int, keys: dict[str, str], settings: dict[str, Any] | None = None
) -> Iterator[Gateway]:
    """LiteLLM's proxy on 127.0.0.1 in a process group of its own, ready; stopped on every way out.
    Its environment is only what it needs: no database, telemetry off, the model cost map read from
    the package (it fetches it from the network otherwise)."""
    if not LITELLM.exists():
        pytest.fail(f"LiteLLM's proxy is missing at {LITELLM}; run `make gateway` (make test does)")
    config = directory / "litellm.yaml"
    config.write_text(yaml.safe_dump(_config(engine_port, settings)))
    port = free_port()
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(directory),
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_TELEMETRY": "False",
        "NO_PROXY": "127.0.0.1,localhost",
        **keys,
    }
    log_path = directory / "litellm.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [str(LITELLM), "--config", str(config), "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 180
            while True:
                assert proc.poll() is None, log_path.read_text(errors="replace")[-3000:]
                try:
                    url = f"http://127.0.0.1:{port}/health/liveliness"
                    if httpx.get(url, timeout=2, trust_env=False).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "LiteLLM did not start"
                time.sleep(0.5)
            yield Gateway(f"http://127.0.0.1:{port}/v1", log_path, engine_port, keys)
        finally:
            stop_group(proc, signal.SIGTERM)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    require_engine()
    keys = {
        ENGINE_VAR: "sk-engine-" + secrets.token_hex(12),
        GATEWAY_VAR: "sk-gateway-" + secrets.token_hex(12),
        WRONG_VAR: "sk-wrong-" + secrets.token_hex(12),
    }
    with running_litellm(tmp_path_factory.mktemp("litellm"), free_port(), keys) as gw:
        yield gw


def _experiment(gw: Gateway, engine: dict[str, Any] | None = None, **gateway: Any) -> dict[str, Any]:
    overrides: dict[str, Any] = {"endpoint": {"api_key_env": ENGINE_VAR}}
    if engine is not None:
        overrides["engine"] = engine
    data = demo_experiment(gw.engine_port, [WORKLOAD], **overrides)
    data["name"] = "via-gateway"
    data["arms"][0]["gateway"] = {
        "base_url": gw.base_url,
        "api_key_env": GATEWAY_VAR,
        "model": GATEWAY_MODEL,
        **gateway,
    }
    return data


def _keys_in(path: Path, keys: list[str]) -> list[str]:
    """Files under ``path`` holding any of ``keys`` (as bytes)."""
    found = []
    for item in path.rglob("*"):
        if item.is_file():
            data = item.read_bytes()
            found += [f"{item}: key {i}" for i, k in enumerate(keys) if k.encode() in data]
    return found


def _engine_gone(pid: int, port: int) -> None:
    from tests.engine.test_flow import _processes_in_group

    assert _processes_in_group(pid) == []
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2, trust_env=False)


def test_the_flow_benchmarks_through_the_gateway(
    gateway: Gateway,
    prefect_harness: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from k3pipe.core.settings import Settings
    from k3pipe.flows.benchmark import benchmark
    from k3pipe.records.tracking import Tracker

    for var, value in gateway.keys.items():
        monkeypatch.setenv(var, value)
    exp = tmp_path / "exp.yaml"
    exp.write_text(yaml.safe_dump(_experiment(gateway)))
    before = gateway.chat_posts()

    (outcome,) = benchmark(str(exp))

    assert outcome["status"] == "FINISHED", outcome
    # the gateway carried the health gate's probe, the warm-up and every measured request
    assert gateway.chat_posts() - before == 1 + WORKLOAD["warmup_requests"] + WORKLOAD["num_requests"]
    settings = Settings()
    tracker = Tracker(settings.tracking_uri(), settings.mlflow_experiment)
    run = tracker.client.get_run(outcome["mlflow_run_id"])
    params, metrics = run.data.params, run.data.metrics
    assert params["client_target"] == "gateway"
    assert params["gateway.base_url"] == gateway.base_url
    assert params["gateway.model"] == GATEWAY_MODEL
    assert params["gateway.api_key_env"] == GATEWAY_VAR
    # the engine's own endpoint and key variable stay recorded as the engine's
    assert params["base_url"] == f"http://127.0.0.1:{gateway.engine_port}/v1"
    assert params["model_id"] == "tiny-llama"
    assert params["api_key_env"] == ENGINE_VAR
    # the engine itself was watched: its health, its log, its /metrics
    assert metrics["cold_start_s"] > 0
    assert metrics["engine_log.ready"] == 1
    artifacts = {a.path for a in tracker.client.list_artifacts(run.info.run_id)}
    assert {"logs", "endpoint_check.json", "engine_findings.json"} <= artifacts
    (child,) = tracker.children(run.info.run_id)
    m = child.data.metrics
    assert m["completed"] == WORKLOAD["num_requests"]
    assert m["failed"] == 0
    # the engine's /metrics over the measured window: every token the gateway relayed
    assert m["engine_generation_tokens"] == WORKLOAD["num_requests"] * WORKLOAD["output_tokens"]
    assert "engine_metrics.parquet" in {a.path for a in tracker.client.list_artifacts(child.info.run_id)}
    # LiteLLM relays usage in the last chunk only: ITL through it is per chunk, labelled so
    assert m["itl_per_token"] == 0.0
    # neither key's value in MLflow (database and artifacts), the engine log, the k3pipe log
    home = Path(os.environ["K3PIPE_HOME"])
    keys = [gateway.keys[ENGINE_VAR], gateway.keys[GATEWAY_VAR]]
    assert _keys_in(home / "mlflow", keys) == []
    assert _keys_in(home / "logs", keys) == []
    assert not [k for k in keys if k in caplog.text]


def test_the_gate_says_what_is_wrong_with_the_gateway_and_the_engine_is_stopped(
    gateway: Gateway, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from k3pipe.core.settings import Settings
    from k3pipe.experiment.load import parse_experiment
    from k3pipe.jobs.arm_run import ArmRun, ArmSteps, client_key
    from k3pipe.prompts.draw import prepare_prompts
    from k3pipe.records.tracking import Tracker
    from k3pipe.sources import fetch_model

    for var, value in gateway.keys.items():
        monkeypatch.setenv(var, value)
    # the arm's own setting: gateway.api_key_env names a variable holding a key LiteLLM does not know.
    # Every failure here is the gateway's (the requests never reach the engine): the engine behind it is
    # the scripted vLLM (k3pipe/testing/fake_engine.py, starts in a second); the real vLLM serves the
    # flow test above
    scripted = {"kind": "vllm", "executable": [sys.executable, str(FAKE_ENGINE), "--startup-delay-s=0.5"]}
    spec = parse_experiment(_experiment(gateway, scripted, api_key_env=WRONG_VAR))
    library = ArmSteps.library()
    errors: dict[str, HealthError] = {}

    def gate(plan: Any, key: Any) -> Any:
        """The real gate with the arm's (wrong) key; meanwhile, against the same engine and gateway,
        the other settings that fail: no key, the engine's served id, a path the gateway lacks."""
        assert plan.gateway is not None
        bad = {
            "no key": {"api_key_env": None},
            "engine's id": {"api_key_env": GATEWAY_VAR, "model": "tiny-llama"},
            "wrong path": {"api_key_env": GATEWAY_VAR, "base_url": gateway.base_url[:-3] + "/api/v1"},
        }
        for what, change in bad.items():
            variant = plan.model_copy(update={"gateway": plan.gateway.model_copy(update=change)})
            with pytest.raises(HealthError) as info:
                library.health_gate(variant, client_key(variant, None))
            errors[what] = info.value
        return library.health_gate(plan, key)

    settings = Settings()
    models = {"model": fetch_model(spec.model, settings.home_dir)}
    prompts = prepare_prompts(spec.workloads, Path(models["model"].path), settings.home_dir)
    tracker = Tracker(settings.tracking_uri(), settings.mlflow_experiment, settings.artifact_root())
    arm = ArmRun(
        spec,
        spec.arms[0].name,
        models,
        prompts,
        tracker,
        settings,
        steps=dataclasses.replace(library, health_gate=gate),
    )
    outcome = arm.execute()

    assert outcome.status == "FAILED"
    assert outcome.workloads == []
    assert arm.launcher is not None
    _engine_gone(arm.launcher.pid, gateway.engine_port)  # type: ignore[attr-defined]
    message = outcome.error or ""
    # LiteLLM without a database answers a key that is not its master key with 400
    assert message.startswith("EndpointAuthError: the gateway at ")
    assert "GET /models answered 400 (" in message
    assert "No connected db." in message
    assert f"gateway.api_key_env names {WRONG_VAR} (set)" in message
    assert "not the engine's key" in message
    no_key = errors["no key"]
    assert isinstance(no_key, EndpointAuthError)
    assert "gateway.api_key_env is not set, so no key was sent" in str(no_key)
    served = errors["engine's id"]
    assert isinstance(served, ModelNotServedError)
    assert f"does not list gateway.model 'tiny-llama'; its /models lists: '{GATEWAY_MODEL}'" in str(served)
    assert "gateway.model must be one of those" in str(served)
    path = str(errors["wrong path"])
    assert "GET /models answered 404: gateway.base_url's path is probably wrong" in path
    for error in (message, *map(str, errors.values())):
        assert "the gateway at" in error
        assert not [v for v in gateway.keys.values() if v in error]
    run = tracker.client.get_run(outcome.mlflow_run_id)
    assert run.info.status == "FAILED"
    assert "error.txt" in {a.path for a in tracker.client.list_artifacts(run.info.run_id)}
    home = Path(os.environ["K3PIPE_HOME"])
    assert str(settings.artifact_root()).startswith(str(home))  # MLflow's database and artifacts
    assert _keys_in(home, list(gateway.keys.values())) == []
