"""The benchmark flow through the Docker launcher, for real: image pulled from the local registry by
digest, the scripted engine container (k3pipe/testing/fake_engine.py) launched, health-checked,
benchmarked and removed; orphans of earlier runs reaped; Ctrl-C removes the container."""

from __future__ import annotations

import re
import signal
import subprocess
import time
import uuid
from pathlib import Path

import docker
import pytest
import yaml

from k3pipe.core.layout import MANAGED_LABEL, OWNER_LABEL
from k3pipe.core.settings import Settings
from k3pipe.records.tracking import Tracker
from tests.conftest import TINY_MODEL, CliRun, free_port
from tests.docker.test_images import registry_digest

pytestmark = pytest.mark.flow


def _experiment(image: str, port: int, workloads: list[dict], name: str) -> dict:
    return {
        "name": name,
        "model": {"source": "local", "path": str(TINY_MODEL), "served_name": "tiny"},
        "arms": [
            {
                "name": "fake-vllm",
                "engine": {"kind": "vllm", "image": image, "args": {"flavor": "vllm", "token_delay_ms": 2}},
                "launcher": {"kind": "docker", "port": port, "startup_timeout_s": 120, "stop_timeout_s": 5},
                "endpoint": {"api_key_env": "K3PIPE_DOCKER_TEST_KEY"},
            }
        ],
        "workloads": workloads,
    }


def _ours(client: docker.DockerClient, experiment: str) -> list[str]:
    return [
        c.short_id
        for c in client.containers.list(all=True, filters={"label": [f"{MANAGED_LABEL}=true"]})
        if c.labels.get("k3pipe.experiment") == experiment
    ]


def test_flow_runs_the_engine_in_a_container(
    prefect_harness: None,
    docker_client: docker.DockerClient,
    registry: str,
    fake_engine_image: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from k3pipe.flows.benchmark import benchmark

    monkeypatch.setenv("K3PIPE_DOCKER_TEST_KEY", "sk-docker-" + uuid.uuid4().hex)
    name = f"docker-{uuid.uuid4().hex[:8]}"
    # an orphan of an earlier run whose k3pipe process is gone holds "the GPUs": the flow must remove
    # it first (its owner label names that process: this boot, a pid that has exited)
    gone = subprocess.Popen(["true"])
    gone.wait()
    owner = f"{Path('/proc/sys/kernel/random/boot_id').read_text().strip()}:{gone.pid}:1"
    orphan = docker_client.containers.run(
        fake_engine_image,
        ["--model", "/models/model", "--port", str(free_port()), "--startup-delay-s", "600"],
        detach=True,
        network_mode="host",
        mounts=[docker.types.Mount("/models/model", str(TINY_MODEL), type="bind", read_only=True)],
        labels={
            MANAGED_LABEL: "true",
            OWNER_LABEL: owner,
            "k3pipe.experiment": name,
            "k3pipe.flow_run_id": str(uuid.uuid4()),
        },
    )
    port = free_port()
    workloads = [{"name": "w", "input_tokens": 32, "output_tokens": 8, "concurrency": 2, "num_requests": 6}]
    exp = tmp_path / "exp.yaml"
    exp.write_text(yaml.safe_dump(_experiment(fake_engine_image, port, workloads, name)))

    orphan.reload()
    assert orphan.status == "running"

    outcomes = benchmark(str(exp))

    assert [o["status"] for o in outcomes] == ["FINISHED"]
    assert _ours(docker_client, name) == []  # the orphan and the run's own container are gone
    with pytest.raises(docker.errors.NotFound):
        docker_client.containers.get(orphan.id)
    settings = Settings()
    tracker = Tracker(settings.tracking_uri(), settings.mlflow_experiment)
    run = tracker.client.get_run(outcomes[0]["mlflow_run_id"])
    params = run.data.params
    digest = registry_digest(registry, "k3pipe/fake-engine", "test")
    assert params["image.digest"] == digest
    assert params["image.pinned"] == f"{registry}/k3pipe/fake-engine@{digest}"
    assert params["docker_run"].startswith("docker run --rm --network host --ipc host --init -v ")
    assert f"{TINY_MODEL}:/models/model:ro" in params["docker_run"]
    assert "--model /models/model" in params["command"]
    assert run.data.metrics["cold_start_s"] > 0
    child = tracker.children(run.info.run_id)[0]
    assert child.data.metrics["completed"] == 6
    assert child.data.metrics["output_tokens_total"] == 6 * 8
    logs = [a.path for a in tracker.client.list_artifacts(run.info.run_id, "logs")]
    assert len(logs) == 1


def test_flow_runs_an_sglang_container_with_its_key_and_metrics(
    prefect_harness: None,
    docker_client: docker.DockerClient,
    fake_engine_image: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An SGLang arm (the scripted engine's SGLang flavour: tests/integration/test_sglang.py says what it
    speaks) in a container: the key reaches it as --api-key from the variable, /metrics is on, and the
    key is in none of the records."""
    from k3pipe.flows.benchmark import benchmark

    key = "sgl-docker-" + uuid.uuid4().hex
    monkeypatch.setenv("K3PIPE_DOCKER_TEST_KEY", key)
    name = f"docker-sgl-{uuid.uuid4().hex[:8]}"
    workloads = [{"name": "w", "input_tokens": 32, "output_tokens": 8, "concurrency": 2, "num_requests": 4}]
    data = _experiment(fake_engine_image, free_port(), workloads, name)
    arm = data["arms"][0]
    arm["name"] = "fake-sglang"
    arm["engine"] = {
        "kind": "sglang",
        "image": fake_engine_image,
        "args": {"flavor": "sglang", "token_delay_ms": 2, "enable_metrics": True},
    }
    exp = tmp_path / "exp.yaml"
    exp.write_text(yaml.safe_dump(data))

    outcomes = benchmark(str(exp))

    assert [o["status"] for o in outcomes] == ["FINISHED"], outcomes
    assert _ours(docker_client, name) == []
    settings = Settings()
    tracker = Tracker(settings.tracking_uri(), settings.mlflow_experiment)
    run = tracker.client.get_run(outcomes[0]["mlflow_run_id"])
    assert "--api-key '{env.K3PIPE_DOCKER_TEST_KEY}'" in run.data.params["docker_run"]
    assert "--enable-metrics" in run.data.params["docker_run"]
    assert run.data.metrics["engine_log.ready"] == 1
    child = tracker.children(run.info.run_id)[0].data.metrics
    assert child["completed"] == 4
    assert child["itl_per_token"] == 1.0
    assert child["engine_generation_tokens"] == 4 * 8
    leaked = [p for p in settings.home_dir.rglob("*") if p.is_file() and key.encode() in p.read_bytes()]
    assert leaked == []


def test_ctrl_c_removes_the_container(
    docker_client: docker.DockerClient, fake_engine_image: str, tmp_path: Path
) -> None:
    name = f"docker-int-{uuid.uuid4().hex[:8]}"
    workloads = [
        {"name": "long", "input_tokens": 32, "output_tokens": 2000, "concurrency": 2, "num_requests": 200}
    ]
    exp = tmp_path / "exp.yaml"
    data = _experiment(fake_engine_image, free_port(), workloads, name)
    data["arms"][0]["engine"]["args"]["token_delay_ms"] = 5
    exp.write_text(yaml.safe_dump(data))
    try:
        with CliRun(exp, tmp_path) as run:
            text = run.wait_for("long: 200 requests", timeout_s=300)
            assert re.search(r"launcher docker, [0-9a-f]{64}", text), text[-2000:]
            assert len(_ours(docker_client, name)) == 1
            time.sleep(2)
            assert run.interrupt(signal.SIGINT) != 0
            assert _ours(docker_client, name) == []
    finally:
        for c in docker_client.containers.list(all=True, filters={"label": f"k3pipe.experiment={name}"}):
            c.remove(force=True)
