"""``launcher.kind: gpustack``: its fields' errors (field, value, fix), the plan it gives (GPUStack's
placeholders in the command, the gateway's URL, model id and key), and what it asks GPUStack for."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from k3pipe.core import secrets
from k3pipe.core.errors import SpecError
from k3pipe.experiment.load import load_experiment, parse_experiment
from k3pipe.launchers.gpustack import Deployment
from k3pipe.planning.plan import plan_arm
from k3pipe.schema.launcher_specs import GpustackLauncherSpec

REPO = Path(__file__).resolve().parents[2]


def _launcher(**fields: Any) -> dict[str, Any]:
    return {
        "kind": "gpustack",
        "server_url": "http://gpustack.example:8080/",
        "api_key_env": "GPUSTACK_API_KEY",
        "backend": "vllm-k3-custom",
        "backend_version": "kimi-k3-custom",
        "worker": "node-1",
        "gpus": [0, 1, 2, 3, 4, 5, 6, 7],
        **fields,
    }


def _experiment(launcher: dict[str, Any] | None = None, **arm: Any) -> dict[str, Any]:
    return {
        "name": "study",
        "model": {"source": "local", "path": "/models/k3"},
        "arms": [
            {
                "name": "vllm",
                "engine": {
                    "kind": "vllm",
                    "image": "vllm/vllm-openai:kimi-k3",
                    "env": {"VLLM_USE_V2_MODEL_RUNNER": "1", "HF_TOKEN": "{env.MY_HF_TOKEN}"},
                    "args": {"tensor_parallel_size": 8, "max_model_len": 1000000},
                },
                "launcher": launcher or _launcher(),
                **arm,
            }
        ],
        "workloads": [{"name": "w", "input_tokens": 8, "output_tokens": 4}],
    }


def _error(data: dict[str, Any], tmp_path: Path) -> str:
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SpecError) as info:
        load_experiment(path)
    return str(info.value)


def test_the_plan_points_at_gpustacks_gateway_with_its_placeholders() -> None:
    spec = parse_experiment(_experiment())
    plan = plan_arm(spec, spec.arms[0], Path("/home/k3"), {"model": "/models/k3"})
    argv = plan.command.argv
    assert argv[:8] == [
        "--model", "{{model_path}}", "--served-model-name", "{{model_name}}",
        "--host", "0.0.0.0", "--port", "{{port}}",
    ]  # fmt: skip
    assert plan.base_url == "http://gpustack.example:8080/v1"
    assert plan.model == "k3pipe-study-vllm"
    assert plan.api_key_env == "GPUSTACK_API_KEY"
    # the engine is on a GPUStack worker: nothing of it is polled or cached from here
    assert plan.health_url is None
    assert plan.version_url is None
    assert plan.metrics_url is None
    assert plan.compile_cache is None
    assert plan.mounts == {"/models/k3": "{{model_path}}"}
    launch = plan.launch
    assert (launch.starts_engine, launch.runs_here, launch.leaves_orphans) == (True, False, False)
    assert not launch.engine_checks_key


def test_model_name_and_worker_path_are_the_users_to_set() -> None:
    launcher = _launcher(model_name="kimi-k3", model_path="/data/models/kimi-k3")
    spec = parse_experiment(_experiment(launcher))
    plan = plan_arm(spec, spec.arms[0], Path("/home/k3"), {"model": "/models/k3"})
    assert plan.model == "kimi-k3"
    assert plan.mounts == {"/data/models/kimi-k3": "{{model_path}}"}


def test_what_gpustack_is_asked_for() -> None:
    spec = parse_experiment(_experiment())
    plan = plan_arm(spec, spec.arms[0], Path("/home/k3"), {"model": "/models/k3"})
    hf_token = "hf-token-value-for-the-test-1234"
    secrets.register(hf_token)
    resolved = plan.command.model_copy(update={"argv": [*plan.command.argv, "--api-key", hf_token]})
    dep = Deployment.of(plan.model_copy(update={"command": resolved}), {"HF_TOKEN": hf_token})
    launcher = spec.arms[0].launcher
    assert isinstance(launcher, GpustackLauncherSpec)
    body = dep.model(launcher, "node-1", 3)
    assert body["cluster_id"] == 3  # GPUStack 2.3.0 cannot store a model without one
    assert body["restart_on_error"] is False
    assert body["replicas"] == 1
    assert body["enable_model_route"] is True
    assert body["worker_selector"] == {"worker-name": "node-1"}
    assert body["gpu_selector"] == {"gpu_ids": [f"node-1:cuda:{i}" for i in range(8)], "gpus_per_replica": 8}
    assert (body["backend"], body["backend_version"]) == ("vllm-k3-custom", "kimi-k3-custom")
    assert body["env"] == {"HF_TOKEN": hf_token}  # with the deployment, deleted at the end
    assert hf_token in body["run_command"]
    # the backend outlives the run: its copy of the command keeps no secret
    version = dep.backend_version()
    assert version["image_name"] == "vllm/vllm-openai:kimi-k3"
    assert hf_token not in version["run_command"]
    assert "--tensor-parallel-size 8" in version["run_command"]
    assert dep.health_path == "/health"


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"backend": "vllm-k3"}, "'vllm-k3' must end with '-custom'"),
        ({"backend_version": ""}, "backend_version"),
        ({"restart_on_error": True}, "restart_on_error"),
        ({"worker": None}, "name it in launcher.worker"),
        ({"api_key_env": "my key"}, "'my key' is not an environment variable name"),
        ({"server_url": "gpustack.example"}, "must start with http:// or https://"),
        ({"gpus": []}, "gpus"),
        ({"replicas": 2}, "launcher.replicas: unknown field"),
    ],
)
def test_bad_fields_name_field_value_and_fix(fields: dict[str, Any], expected: str, tmp_path: Path) -> None:
    msg = _error(_experiment(_launcher(**fields)), tmp_path)
    assert "arms[0].launcher" in msg
    assert expected in msg


def test_a_key_where_its_variables_name_belongs_is_refused_and_never_echoed(tmp_path: Path) -> None:
    key = "gpustack_" + "Ab3" * 12
    msg = _error(_experiment(_launcher(api_key_env=key)), tmp_path)
    assert "is not an environment variable name (it looks like a key)" in msg
    assert "api_key_env: GPUSTACK_API_KEY" in msg
    assert key not in msg


def test_credentials_in_the_server_url_are_refused_and_never_echoed(tmp_path: Path) -> None:
    msg = _error(_experiment(_launcher(server_url="http://admin:s3cr3t-pass-word@gpustack:80")), tmp_path)
    assert "carries credentials" in msg
    assert "s3cr3t-pass-word" not in msg


@pytest.mark.parametrize(
    ("arm", "expected"),
    [
        ({"endpoint": {"base_url": "http://elsewhere/v1"}}, "remove endpoint.base_url"),
        ({"endpoint": {"api_key_env": "OTHER_KEY"}}, "remove endpoint.api_key_env"),
    ],
)
def test_the_endpoint_is_gpustacks_gateway(arm: dict[str, Any], expected: str, tmp_path: Path) -> None:
    assert expected in _error(_experiment(**arm), tmp_path)


def test_an_engine_without_an_image_is_refused(tmp_path: Path) -> None:
    data = _experiment()
    del data["arms"][0]["engine"]["image"]
    data["arms"][0]["engine"]["executable"] = [sys.executable]
    assert "needs engine.image (the custom backend's image)" in _error(data, tmp_path)


def test_the_shipped_gpustack_experiment_loads() -> None:
    spec = load_experiment(REPO / "experiments" / "kimi-k3-gpustack.yaml")
    assert {arm.launcher.kind for arm in spec.arms} == {"gpustack"}


def _launcher_against(answers: dict[str, Any], **fields: Any) -> Any:
    """A GpustackLauncher whose management API answers ``answers`` (path -> list of items) through
    httpx's mock transport, in GPUStack's list shape; every request recorded in ``.requests``."""
    import httpx

    from k3pipe.launchers.gpustack import API, GpustackLauncher

    spec = GpustackLauncherSpec.model_validate(_launcher(**fields))
    plan_spec = parse_experiment(_experiment())
    plan = plan_arm(plan_spec, plan_spec.arms[0], Path("/home/k3"), {"model": "/models/k3"})
    launcher = GpustackLauncher(spec, Deployment.of(plan, {}), "key", Path("/nonexistent/log"))
    requests: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        requests.append(request.url.path)
        items = answers[request.url.path.removeprefix(API)]
        pagination = {"page": 1, "perPage": 1000, "total": len(items), "totalPage": 1}
        return httpx.Response(200, json={"items": items, "pagination": pagination})

    launcher.api.client = httpx.Client(base_url="http://gs" + API, transport=httpx.MockTransport(answer))
    launcher.requests = requests
    return launcher


def test_the_deployment_goes_to_the_named_then_the_workers_then_the_only_cluster() -> None:
    """GPUStack 2.3.0 cannot store a model without a cluster (the real server answered 500 "Failed
    to create model"): launcher.cluster_id, else the named worker's, else the server's only one."""
    workers = {"/workers": [{"id": 4, "name": "node-1", "cluster_id": 7}]}
    launcher = _launcher_against(workers, cluster_id=2)
    assert launcher._cluster(launcher._worker()) == 2
    launcher = _launcher_against(workers)
    assert launcher._cluster(launcher._worker()) == 7
    assert launcher.requests == ["/v2/workers"]
    launcher = _launcher_against({"/clusters": [{"id": 1, "name": "default"}]}, worker=None, gpus=None)
    assert launcher._cluster(launcher._worker()) == 1
    two = {"/clusters": [{"id": 1, "name": "default"}, {"id": 3, "name": "b300"}]}
    launcher = _launcher_against(two, worker=None, gpus=None)
    with pytest.raises(Exception, match=r"2 clusters \(default \(id 1\), b300 \(id 3\)\): name the") as info:
        launcher._cluster(None)
    assert "launcher.cluster_id" in str(info.value)


def test_a_waiting_instance_says_why_and_a_stuck_one_is_named() -> None:
    """The real server's PENDING instance carries the scheduler's reason (shown), and an instance
    SCHEDULED on a worker that cannot run containers never moves (said once, after the stall time)."""
    from k3pipe.launchers.gpustack import SCHEDULED_STALL_S

    launcher = _launcher_against({})
    said: list[str] = []
    pending = {
        "name": "m-1",
        "state": "pending",
        "state_message": "No suitable workers found. Required VRAM 2.0 GiB, RAM 2.0 GiB.",
    }
    launcher._report(pending, said.append)
    launcher._report(pending, said.append)
    assert said == [
        "gpustack: instance m-1 PENDING: No suitable workers found. Required VRAM 2.0 GiB, RAM 2.0 GiB."
    ]
    scheduled = {"name": "m-1", "state": "scheduled", "state_message": None, "worker_name": "vm"}
    launcher._report(scheduled, said.append)
    launcher._report(scheduled, said.append)
    assert said[1:] == ["gpustack: instance m-1 SCHEDULED"]
    launcher._since -= SCHEDULED_STALL_S + 1
    launcher._report(scheduled, said.append)
    launcher._report(scheduled, said.append)
    assert len(said) == 3
    assert said[2].startswith("gpustack: instance m-1 SCHEDULED on worker vm for 120 s and not starting")
    assert "No available deployer" in said[2]
