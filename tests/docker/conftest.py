"""Docker fixtures: the isolated engine and registry that `make test` starts (scripts/docker-env.sh).

These tests need a real dockerd; they FAIL (never skip) when it is not there, because a skipped
docker test would hide a broken launcher. `make test` starts dockerd (no bridge, no iptables, host
networking only) and the registry on 127.0.0.1:5055, builds the images, exports DOCKER_HOST and
K3PIPE_REGISTRY, and stops everything after pytest.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import docker
import httpx
import pytest
from docker.types import Mount

REPO = Path(__file__).resolve().parents[2]
# Read at import: tests/conftest.py's autouse fixture clears K3PIPE_* from each test's environment.
DOCKER_HOST = os.environ.get("DOCKER_HOST")
REGISTRY = os.environ.get("K3PIPE_REGISTRY", "127.0.0.1:5055")
ASSETS_HOME = Path(os.environ.get("K3PIPE_HOME", REPO / ".k3pipe")).resolve()
FAKE_ENGINE_REPO = "k3pipe/fake-engine"
FAKE_ENGINE_TAG = "test"
MANAGED_LABEL = "k3pipe.managed"
HOW = "run the tests via `make test`, which starts dockerd and the registry (scripts/docker-env.sh up)"


@pytest.fixture(scope="session")
def docker_client() -> Iterator[docker.DockerClient]:
    """A client of the isolated dockerd named by DOCKER_HOST."""
    if not DOCKER_HOST:
        pytest.fail(f"DOCKER_HOST is not set: {HOW}")
    try:
        client = docker.DockerClient(base_url=DOCKER_HOST, timeout=60)
        client.ping()
    except docker.errors.DockerException as exc:
        pytest.fail(f"the docker daemon at {DOCKER_HOST} does not answer ({exc}): {HOW}")
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(scope="session")
def registry() -> str:
    """host:port of the local registry (distribution v2, plain HTTP on loopback)."""
    try:
        httpx.get(f"http://{REGISTRY}/v2/", timeout=5, trust_env=False).raise_for_status()
    except httpx.HTTPError as exc:
        pytest.fail(f"the registry at {REGISTRY} does not answer ({exc}): {HOW}")
    return REGISTRY


@pytest.fixture(scope="session")
def fake_engine_image(docker_client: docker.DockerClient, registry: str) -> str:
    """The fake engine's image, built and pushed to the registry; returns REGISTRY/NAME:TAG.

    scripts/build-test-image.sh runs once per session: it is cached (a rebuild after an edit of
    fake_engine.py or openai_wire.py takes a second, otherwise ~0.1 s) and pushes only when the registry
    lacks this image.
    """
    env = {**os.environ, "DOCKER_HOST": DOCKER_HOST or "", "K3PIPE_REGISTRY": registry}
    env["K3PIPE_HOME"] = str(ASSETS_HOME)
    proc = subprocess.run(
        [str(REPO / "scripts" / "build-test-image.sh")],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if proc.returncode != 0:
        pytest.fail(f"scripts/build-test-image.sh failed ({proc.returncode}):\n{proc.stderr}\n{proc.stdout}")
    return f"{registry}/{FAKE_ENGINE_REPO}:{FAKE_ENGINE_TAG}"


@contextmanager
def engine_container(
    client: docker.DockerClient,
    image: str,
    args: Sequence[str],
    *,
    model_dir: Path | None = None,
    environment: dict[str, str] | None = None,
    test_name: str = "",
) -> Iterator[Any]:
    """Run the fake engine detached on the host network; always removed afterwards (and checked)."""
    mounts = []
    if model_dir is not None:
        mounts.append(Mount(target="/models/tiny", source=str(model_dir), type="bind", read_only=True))
    container = client.containers.run(
        image,
        command=list(args),
        detach=True,
        network_mode="host",
        init=True,
        mounts=mounts,
        environment=environment or {},
        labels={MANAGED_LABEL: "true", "k3pipe.test": test_name or "tests/docker"},
    )
    try:
        yield container
    finally:
        container.remove(force=True)
        with pytest.raises(docker.errors.NotFound):
            client.containers.get(container.id)


def wait_healthy(container: Any, url: str, timeout_s: float = 30.0) -> float:
    """Poll url until 200; fail early if the container exits. Returns the seconds it took."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        container.reload()
        if container.status in ("exited", "dead"):
            logs = container.logs().decode(errors="replace")
            pytest.fail(f"the container exited before becoming healthy:\n{logs}")
        try:
            if httpx.get(url, timeout=2, trust_env=False).status_code == 200:
                return time.monotonic() - t0
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    pytest.fail(f"{url} was not healthy after {timeout_s} s:\n{container.logs().decode(errors='replace')}")
