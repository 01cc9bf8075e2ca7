"""The health gate's probe against the scripted vLLM-style server (a strict gateway is scripted)."""

from __future__ import annotations

import pytest
from pydantic import SecretStr

from k3pipe.bench.health import GateTarget, check_endpoint
from k3pipe.core.errors import EndpointAuthError, HealthError, ModelNotServedError
from k3pipe.testing.scripted_openai import Script, ScriptedOpenAI


def test_the_probe_asks_for_stream_options_as_the_benchmark_will() -> None:
    with ScriptedOpenAI(Script(output_tokens=3)) as server:
        check = check_endpoint(server.base_url, "scripted", None)
        assert check.reply_kinds == ["content"]
        assert server.requests[-1].body["stream_options"] == {
            "include_usage": True,
            "continuous_usage_stats": True,
        }


def test_an_endpoint_that_refuses_continuous_usage_is_told_what_to_set() -> None:
    with ScriptedOpenAI(Script(output_tokens=3, refuse_continuous_usage=True)) as server:
        with pytest.raises(HealthError, match=r"set endpoint\.continuous_usage_stats: false") as info:
            check_endpoint(server.base_url, "scripted", None)
        assert "Unrecognized request argument" in str(info.value)
        # with the setting off, the same endpoint passes the gate
        check = check_endpoint(server.base_url, "scripted", None, continuous_usage=False)
        assert check.first_delta_s >= 0
        assert server.requests[-1].body["stream_options"] == {"include_usage": True}


def test_other_refusals_are_not_blamed_on_continuous_usage() -> None:
    with ScriptedOpenAI(Script(status=400)) as server:
        with pytest.raises(HealthError, match="answered 400") as info:
            check_endpoint(server.base_url, "scripted", None)
        assert "continuous_usage_stats" not in str(info.value)
        assert info.value.status == 400


def _gateway_target(key_var: str | None = "GW_KEY") -> GateTarget:
    return GateTarget(
        who="the gateway",
        base_field="gateway.base_url",
        key_field="gateway.api_key_env",
        key_var=key_var,
        model_field="gateway.model",
        usage_field="gateway.continuous_usage_stats",
        gateway=True,
    )


def test_a_gateway_that_refuses_the_key_is_named_with_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GW_KEY", "wrong-key-value-123")
    wrong = SecretStr("wrong-key-value-123")
    server = ScriptedOpenAI(Script(), api_key="right-key-value-456")
    with server, pytest.raises(EndpointAuthError) as info:
        check_endpoint(server.base_url, "scripted", wrong, target=_gateway_target())
    message = str(info.value)
    # the scripted server asks for the key on /chat/completions only
    assert message.startswith(f"the gateway at {server.base_url}: POST /chat/completions answered 401")
    assert "gateway.api_key_env names GW_KEY (set)" in message
    assert "wrong-key-value-123" not in message
    unset = r"gateway\.api_key_env is not set, so no key was sent"
    with (
        ScriptedOpenAI(Script(), api_key="right-key-value-456") as other,
        pytest.raises(EndpointAuthError, match=unset),
    ):
        check_endpoint(other.base_url, "scripted", None, target=_gateway_target(None))


def test_a_gateway_that_does_not_list_the_model_says_what_it_lists() -> None:
    with ScriptedOpenAI(Script(), model="gw-tiny") as server, pytest.raises(ModelNotServedError) as info:
        check_endpoint(server.base_url, "tiny-llama", None, target=_gateway_target())
    message = str(info.value)
    assert "the gateway at" in message
    assert "does not list gateway.model 'tiny-llama'; its /models lists: 'gw-tiny'" in message
    assert "gateway.model must be one of those" in message


def test_a_gateway_path_that_is_wrong_names_gateway_base_url() -> None:
    server = ScriptedOpenAI(Script())
    with server, pytest.raises(HealthError) as info:
        check_endpoint(
            server.base_url.removesuffix("/v1") + "/api/v1", "scripted", None, target=_gateway_target()
        )
    assert "the gateway at" in str(info.value)
    assert "answered 404: gateway.base_url's path is probably wrong" in str(info.value)
