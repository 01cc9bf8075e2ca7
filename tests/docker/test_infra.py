"""The docker test infrastructure itself: an isolated daemon, the registry, the fake engine's image.

Every container runs on the host network, binds a free 127.0.0.1 port and is removed in a finally.
"""

from __future__ import annotations

import json
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import docker
import httpx

from tests.conftest import free_port
from tests.docker.conftest import FAKE_ENGINE_REPO, FAKE_ENGINE_TAG, engine_container, wait_healthy


def _model_dir(tmp_path: Path) -> Path:
    model = tmp_path / "tiny-model"
    model.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096, "model_type": "llama"}
    (model / "config.json").write_text(json.dumps(config))
    return model


def _get(url: str, **kwargs: Any) -> httpx.Response:
    return httpx.get(url, timeout=10, trust_env=False, **kwargs)


def _events(response: httpx.Response) -> list[Any]:
    """The SSE data payloads of a streamed response: JSON objects, and the final "[DONE]" as a str."""
    out: list[Any] = []
    for line in response.iter_lines():
        if not line.startswith("data: "):
            assert line == "", f"unexpected SSE line {line!r}"
            continue
        data = line.removeprefix("data: ")
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_daemon_is_isolated(docker_client: docker.DockerClient) -> None:
    """No bridge network (dockerd --bridge=none): only host and none; no docker0 on the host."""
    networks = {n.name: n.attrs["Driver"] for n in docker_client.networks.list()}
    assert networks == {"host": "host", "none": "null"}
    assert not Path("/sys/class/net/docker0").exists()
    assert not [name for name in networks.values() if name == "bridge"]


def test_image_is_in_the_registry(
    docker_client: docker.DockerClient, registry: str, fake_engine_image: str
) -> None:
    tags = _get(f"http://{registry}/v2/{FAKE_ENGINE_REPO}/tags/list")
    assert tags.status_code == 200
    assert FAKE_ENGINE_TAG in tags.json()["tags"]
    head = httpx.head(
        f"http://{registry}/v2/{FAKE_ENGINE_REPO}/manifests/{FAKE_ENGINE_TAG}",
        headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json"},
        timeout=10,
        trust_env=False,
    )
    digest = head.headers["Docker-Content-Digest"]
    assert digest.startswith("sha256:")
    # the SDK pulls it back from the registry, and knows it by that digest
    image = docker_client.images.pull(f"{registry}/{FAKE_ENGINE_REPO}", tag=FAKE_ENGINE_TAG)
    assert f"{registry}/{FAKE_ENGINE_REPO}@{digest}" in image.attrs["RepoDigests"]


def test_container_serves_streaming_chat(
    docker_client: docker.DockerClient, fake_engine_image: str, tmp_path: Path
) -> None:
    port = free_port()
    key = "test-" + secrets.token_hex(8)
    base = f"http://127.0.0.1:{port}"
    args = [
        "--model", "/models/tiny", "--served-model-name", "tiny", "--host", "127.0.0.1",
        "--port", str(port), "--startup-delay-s", "0.5", "--token-delay-ms", "20",
        "--enforce-eager", "--max-num-seqs", "8",  # engine flags it does not know: accepted, ignored
    ]  # fmt: skip
    with engine_container(
        docker_client,
        fake_engine_image,
        args,
        model_dir=_model_dir(tmp_path),
        environment={"VLLM_API_KEY": key},
        test_name="test_container_serves_streaming_chat",
    ) as container:
        wait_healthy(container, f"{base}/health")
        auth = {"Authorization": f"Bearer {key}"}

        assert _get(f"{base}/v1/models").status_code == 401
        wrong = _get(f"{base}/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        assert wrong.json() == {"error": "Unauthorized"}
        models = _get(f"{base}/v1/models", headers=auth)
        assert [m["id"] for m in models.json()["data"]] == ["tiny"]
        assert _get(f"{base}/version").json() == {"version": "0.32.0"}

        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Say something."}],
            "max_tokens": 5,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with httpx.stream(
            "POST", f"{base}/v1/chat/completions", json=body, headers=auth, timeout=30, trust_env=False
        ) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            events = _events(resp)
        assert events[-1] == "[DONE]"
        role, *tokens, usage = events[:-1]
        assert role["object"] == "chat.completion.chunk"
        assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert len(tokens) == 5
        assert all(t["choices"][0]["delta"]["content"] for t in tokens)
        assert [t["choices"][0]["finish_reason"] for t in tokens] == [None] * 4 + ["length"]
        assert usage["choices"] == []
        assert usage["usage"]["completion_tokens"] == 5
        assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 5

        # concurrent streams overlap: 4 x 25 tokens x 20 ms, ~0.5 s in all (2 s one after the other)
        def one(_: int) -> int:
            req = {**body, "max_tokens": 25, "stream_options": None}
            with httpx.stream(
                "POST", f"{base}/v1/chat/completions", json=req, headers=auth, timeout=30, trust_env=False
            ) as resp:
                return sum(1 for e in _events(resp) if isinstance(e, dict) and e["choices"])

        t0 = time.monotonic()
        with ThreadPoolExecutor(4) as pool:
            counts = list(pool.map(one, range(4)))
        assert counts == [26] * 4  # role chunk + 25 tokens, no usage chunk without include_usage
        assert time.monotonic() - t0 < 1.5

        metrics = _get(f"{base}/metrics").text
        assert 'vllm:generation_tokens_total{engine="0",model_name="tiny"} 105.0' in metrics

        t0 = time.monotonic()
        container.stop(timeout=10)
        assert time.monotonic() - t0 < 5, "SIGTERM should end the engine promptly"
        assert container.wait(timeout=10)["StatusCode"] == 0
        logs = container.logs().decode()
        assert "Application startup complete." in logs
        assert "Application shutdown complete." in logs


def test_container_crash_exits_3(
    docker_client: docker.DockerClient, fake_engine_image: str, tmp_path: Path
) -> None:
    port = free_port()
    args = ["--model", "/models/tiny", "--host", "127.0.0.1", "--port", str(port), "--crash-after-s", "0.5"]
    with engine_container(
        docker_client, fake_engine_image, args, model_dir=_model_dir(tmp_path), test_name="crash"
    ) as container:
        assert container.wait(timeout=30)["StatusCode"] == 3
        logs = container.logs().decode()
        assert "Engine core initialization failed" in logs
        assert "Application startup complete." not in logs


def test_container_without_model_fails_fast(
    docker_client: docker.DockerClient, fake_engine_image: str
) -> None:
    port = free_port()
    args = ["--model", "/models/tiny", "--host", "127.0.0.1", "--port", str(port)]
    with engine_container(docker_client, fake_engine_image, args, test_name="no-model") as container:
        assert container.wait(timeout=30)["StatusCode"] == 1
        assert "no config.json in the model directory '/models/tiny'" in container.logs().decode()
