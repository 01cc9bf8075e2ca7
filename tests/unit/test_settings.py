"""K3PIPE_ settings: a bad value is refused naming the variable, the value (masked where it may be a
key) and what the setting is for; never pydantic's text, which would carry the value."""

from __future__ import annotations

import pytest

from k3pipe.core import secrets
from k3pipe.core.settings import SettingsError, load_settings


def test_a_bad_number_names_the_variable_and_the_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("K3PIPE_MLFLOW_PROBE_TIMEOUT_S", "ten")
    with pytest.raises(SettingsError) as caught:
        load_settings()
    text = str(caught.value)
    assert text.startswith("K3PIPE_MLFLOW_PROBE_TIMEOUT_S='ten': input should be a valid number")
    assert "(how long the start-of-run check waits for the tracking server)" in text
    assert "unset it for the default" in text
    assert caught.value.__cause__ is None
    assert caught.value.__suppress_context__


def test_a_key_in_a_setting_is_masked_and_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    key = "Tq4Wm8Zr2Xn6Lp0Vb3Kc7Jd9"
    monkeypatch.setenv("K3PIPE_STACK_AUTH", key)
    monkeypatch.setenv("K3PIPE_SPOOL_RETRY_S", "x")
    with pytest.raises(SettingsError) as caught:
        load_settings()
    text = str(caught.value)
    assert key not in text
    assert "K3PIPE_STACK_AUTH=Tq4… (24 chars): input should be a valid boolean" in text
    assert "K3PIPE_SPOOL_RETRY_S='x'" in text  # every bad variable, in one message
    assert secrets.scrub(f"later: {key}") == "later: ***"


def test_good_settings_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("K3PIPE_MLFLOW_PROBE_TIMEOUT_S", "2.5")
    assert load_settings().mlflow_probe_timeout_s == 2.5
