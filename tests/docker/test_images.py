"""The image step against the real dockerd and registry started by `make test`."""

from __future__ import annotations

import io
import tarfile

import docker
import httpx
import pytest

from k3pipe.core.errors import ImageError
from k3pipe.sources.images import resolve_image, split_reference
from tests.conftest import free_port

MANIFEST_TYPES = ", ".join(
    [
        "application/vnd.docker.distribution.manifest.v2+json",
        "application/vnd.oci.image.manifest.v1+json",
        "application/vnd.docker.distribution.manifest.list.v2+json",
        "application/vnd.oci.image.index.v1+json",
    ]
)


def registry_digest(registry: str, repo_path: str, tag: str) -> str:
    resp = httpx.head(
        f"http://{registry}/v2/{repo_path}/manifests/{tag}",
        headers={"Accept": MANIFEST_TYPES},
        trust_env=False,
    )
    assert resp.status_code == 200, resp.text
    return resp.headers["Docker-Content-Digest"]


def _push_tiny_image(client: docker.DockerClient, base: str, ref: str, marker: str) -> None:
    """Build a one-file image on top of ``base`` and push it as ``ref``."""
    dockerfile = f"FROM {base}\nLABEL k3pipe.test.marker={marker}\n".encode()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(dockerfile)
        tar.addfile(info, io.BytesIO(dockerfile))
    buf.seek(0)
    client.images.build(fileobj=buf, custom_context=True, tag=ref, rm=True)
    repo, tag = ref.rsplit(":", 1)
    for event in client.api.push(repo, tag=tag, stream=True, decode=True):
        assert "error" not in event, event


def test_split_reference() -> None:
    assert split_reference("127.0.0.1:5055/k3pipe/x:test") == (
        "127.0.0.1:5055",
        "127.0.0.1:5055/k3pipe/x",
        "test",
        None,
    )
    assert split_reference("vllm/vllm-openai:kimi-k3") == ("docker.io", "vllm/vllm-openai", "kimi-k3", None)
    assert split_reference("lmsysorg/sglang") == ("docker.io", "lmsysorg/sglang", "latest", None)
    assert split_reference("r:1/a@sha256:" + "a" * 64)[3] == "sha256:" + "a" * 64


def test_pull_pins_the_registry_digest_and_skips_when_present(
    docker_client: docker.DockerClient, registry: str, fake_engine_image: str
) -> None:
    ref = f"{registry}/k3pipe/pin-test:v1"
    _push_tiny_image(docker_client, fake_engine_image, ref, "one")
    docker_client.images.remove(ref, force=True)  # so the step must pull it
    messages: list[str] = []

    first = resolve_image(docker_client, ref, progress=messages.append)

    assert first.pulled
    assert first.registry == registry
    assert first.digest == registry_digest(registry, "k3pipe/pin-test", "v1")
    assert first.pinned == f"{registry}/k3pipe/pin-test@{first.digest}"
    assert any("Digest:" in m or "pulling" in m for m in messages)
    second = resolve_image(docker_client, ref)
    assert not second.pulled
    assert second.digest == first.digest


def test_moved_tag_changes_the_digest_but_not_a_pinned_rerun(
    docker_client: docker.DockerClient, registry: str, fake_engine_image: str
) -> None:
    ref = f"{registry}/k3pipe/moving:latest"
    _push_tiny_image(docker_client, fake_engine_image, ref, "before")
    before = resolve_image(docker_client, ref)
    _push_tiny_image(docker_client, fake_engine_image, ref, "after")  # the tag moves
    after = resolve_image(docker_client, ref, pull="always")
    assert after.digest != before.digest
    again = resolve_image(docker_client, before.pinned)  # a rerun uses the recorded digest
    assert again.digest == before.digest
    labels = docker_client.images.get(before.pinned).labels
    assert labels["k3pipe.test.marker"] == "before"


def test_missing_image_names_image_and_registry(docker_client: docker.DockerClient, registry: str) -> None:
    ref = f"{registry}/k3pipe/does-not-exist:nope"
    with pytest.raises(ImageError) as info:
        resolve_image(docker_client, ref, attempts=2, backoff_s=0.1)
    msg = str(info.value)
    assert ref in msg
    assert f"registry {registry}" in msg
    assert "2 attempts" in msg


def test_unreachable_registry(docker_client: docker.DockerClient) -> None:
    ref = f"127.0.0.1:{free_port()}/k3pipe/x:y"
    with pytest.raises(ImageError, match="could not pull"):
        resolve_image(docker_client, ref, attempts=2, backoff_s=0.1)


def test_pull_never(docker_client: docker.DockerClient, registry: str) -> None:
    with pytest.raises(ImageError, match=r"launcher\.pull is 'never'"):
        resolve_image(docker_client, f"{registry}/k3pipe/absent:x", pull="never")
