"""The Docker launcher on the real dockerd with the scripted engine image (k3pipe/testing/fake_engine.py:
a stand-in, since no GPU engine can run here)."""

from __future__ import annotations

import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest

from k3pipe.bench.health import check_endpoint, wait_until_healthy
from k3pipe.core.errors import LaunchError
from k3pipe.core.layout import MANAGED_LABEL, OWNER_LABEL
from k3pipe.launchers.docker import DockerLauncher, owner_label, reap_orphans
from k3pipe.sources.images import resolve_image
from tests.conftest import TINY_MODEL, free_port


@pytest.fixture
def pinned(docker_client: docker.DockerClient, fake_engine_image: str) -> str:
    return resolve_image(docker_client, fake_engine_image).pinned


@pytest.fixture
def launchers() -> Iterator[list[DockerLauncher]]:
    started: list[DockerLauncher] = []
    yield started
    for launcher in started:
        launcher.stop()


def _launcher(
    docker_client: docker.DockerClient, image: str, tmp_path: Path, port: int, *extra: str, test_id: str = ""
) -> DockerLauncher:
    return DockerLauncher(
        docker_client,
        image,
        [
            "--model",
            "/models/model",
            "--served-model-name",
            "tiny",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *extra,
        ],
        {},
        tmp_path / "engine.log",
        labels={"k3pipe.experiment": "t", "k3pipe.arm": "a", "k3pipe.test": test_id or uuid.uuid4().hex},
        mounts={str(TINY_MODEL): "/models/model"},
        stop_timeout_s=5,
    )


def test_container_lifecycle(
    docker_client: docker.DockerClient, pinned: str, tmp_path: Path, launchers: list[DockerLauncher]
) -> None:
    port = free_port()
    launcher = _launcher(docker_client, pinned, tmp_path, port)
    launchers.append(launcher)
    launcher.start()
    wait_until_healthy(f"http://127.0.0.1:{port}/health", launcher, timeout_s=60, poll_s=0.2)
    check = check_endpoint(f"http://127.0.0.1:{port}/v1", "tiny", None)
    assert check.reply_kinds == ["content"]

    container = docker_client.containers.get(launcher.container_id)
    attrs = container.attrs
    assert attrs["Config"]["Labels"][MANAGED_LABEL] == "true"
    assert attrs["Config"]["Image"] == pinned  # created from the digest, not the tag
    assert attrs["HostConfig"]["NetworkMode"] == "host"
    assert attrs["HostConfig"]["Init"] is True
    mount = next(m for m in attrs["Mounts"] if m["Destination"] == "/models/model")
    assert mount["RW"] is False
    cid = launcher.container_id
    launcher.stop()
    with pytest.raises(docker.errors.NotFound):
        docker_client.containers.get(cid)
    assert (tmp_path / "engine.log").read_text().strip() != ""
    launcher.stop()  # idempotent


def test_crash_during_start_fails_fast_with_log_tail(
    docker_client: docker.DockerClient, pinned: str, tmp_path: Path, launchers: list[DockerLauncher]
) -> None:
    port = free_port()
    launcher = _launcher(
        docker_client, pinned, tmp_path, port, "--startup-delay-s", "30", "--crash-after-s", "1"
    )
    launchers.append(launcher)
    launcher.start()
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as info:
        wait_until_healthy(f"http://127.0.0.1:{port}/health", launcher, timeout_s=120, poll_s=0.2)
    assert time.monotonic() - t0 < 30
    assert "exited with code 3" in str(info.value)
    assert launcher.log_tail().strip() in str(info.value)
    launcher.stop()
    assert docker_client.containers.list(all=True, filters={"id": launcher.container_id}) == []


def test_orphans_are_reaped_and_live_runs_kept(
    docker_client: docker.DockerClient, pinned: str, tmp_path: Path, launchers: list[DockerLauncher]
) -> None:
    """Only a container whose run provably ended goes: its owner process is gone, or (a container of
    no owner label) its flow run is over. A live owner or an unknown flow run keeps it."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    live_run, dead_run = str(uuid.uuid4()), str(uuid.uuid4())
    cases = {
        # name: (flow run label, owner label or None to drop it)
        "owner-gone": (live_run, f"{boot}:{dead.pid}:1"),
        "owner-alive": (dead_run, owner_label()),
        "no-owner-run-over": (dead_run, None),
        "no-owner-run-live": (live_run, None),
    }
    ids = {}
    for name, (run_id, owner) in cases.items():
        launcher = _launcher(docker_client, pinned, tmp_path / name, free_port(), "--startup-delay-s", "600")
        launcher.labels["k3pipe.flow_run_id"] = run_id
        if owner is None:
            launcher.labels.pop(OWNER_LABEL)
        else:
            launcher.labels[OWNER_LABEL] = owner
        launchers.append(launcher)
        launcher.start()
        ids[name] = launcher.container_id
    messages: list[str] = []
    removed = reap_orphans(docker_client, lambda run_id: run_id == live_run, progress=messages.append)
    assert sorted(n for n, cid in ids.items() if cid in removed) == ["no-owner-run-over", "owner-gone"]
    for name in ("owner-alive", "no-owner-run-live"):
        assert docker_client.containers.get(ids[name]).status == "running"
    for name in ("owner-gone", "no-owner-run-over"):
        with pytest.raises(docker.errors.NotFound):
            docker_client.containers.get(ids[name])
    assert any(dead_run in m for m in messages)


def test_missing_image_is_a_launch_error(
    docker_client: docker.DockerClient, registry: str, tmp_path: Path
) -> None:
    launcher = _launcher(docker_client, f"{registry}/k3pipe/none@sha256:{'0' * 64}", tmp_path, free_port())
    with pytest.raises(LaunchError, match="could not create a container"):
        launcher.start()
    launcher.stop()
