"""The health gate's probe against the scripted vLLM-style server (a strict gateway is scripted)."""

from __future__ import annotations

import pytest

from k3pipe.errors import HealthError
from k3pipe.health import check_endpoint
from tests.scripted_openai import Script, ScriptedOpenAI


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
