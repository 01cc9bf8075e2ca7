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


class _Clock:
    """A virtual clock for the health gate's polls: ``sleep`` moves it, nothing waits."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class _ReadyAt:
    """A launcher whose engine is ready from ``at_s`` on the virtual clock (only the launcher tells)."""

    kind = "process"
    log_path = None

    def __init__(self, clock: _Clock, at_s: float) -> None:
        self.clock, self.at_s, self.asked = clock, at_s, 0

    def ready(self, progress: object = None) -> bool:
        self.asked += 1
        return self.clock.now >= self.at_s

    def alive(self) -> bool:
        return True


@pytest.mark.parametrize("ready_at_s", [0.3, 4.0, 600.0])
def test_the_gate_sees_a_start_within_a_twentieth_of_its_time_or_poll_s(
    ready_at_s: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The seconds waited are the launch's cold start: a fixed 1 s poll made a 0.3 s start read (and
    take) 1 s. Polls start 50 ms apart and grow with the wait, up to poll_s."""
    from k3pipe.bench import health

    clock = _Clock()
    monkeypatch.setattr(health, "time", clock)
    launcher = _ReadyAt(clock, ready_at_s)
    waited = health.wait_until_healthy(None, launcher, timeout_s=3600, poll_s=1.0)  # type: ignore[arg-type]
    assert ready_at_s <= waited <= ready_at_s + max(health.POLL_FIRST_S, min(1.0, ready_at_s / 20)) + 1e-9
    assert max(clock.sleeps) <= 1.0
    # not a busy loop: about 20 polls per e-fold of the wait, then one a second
    assert launcher.asked <= 20 + 20 * 3 + ready_at_s / 1.0, launcher.asked


def test_poll_gap_bounds() -> None:
    from k3pipe.bench.health import POLL_FIRST_S, poll_gap

    assert poll_gap(0.0, 1.0) == POLL_FIRST_S
    assert poll_gap(4.0, 1.0) == pytest.approx(0.2)
    assert poll_gap(600.0, 1.0) == 1.0
    assert poll_gap(600.0, 0.2) == 0.2  # a caller's poll_s is the most
