"""The scrubber and ``{env.NAME}`` references (k3pipe/core/secrets.py), and where they are wired in that
needs no server: specs, the rendered command, the launch's resolution, preflight, errors, logging,
the terminal's streams. tests/integration/test_secrets.py runs the real flow with planted secrets."""

from __future__ import annotations

import io
import logging
import secrets
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from k3pipe.bench.health import check_endpoint
from k3pipe.core import secrets as sec
from k3pipe.core.errors import HealthError, LaunchError, SpecError
from k3pipe.experiment.load import parse_experiment
from k3pipe.experiment.preflight import preflight
from k3pipe.planning.plan import plan_arm


def _planted(tag: str = "s") -> str:
    return f"{tag}{secrets.token_hex(12)}"


def _experiment(**engine: Any) -> dict[str, Any]:
    return {
        "name": "x",
        "model": {"source": "local", "path": "/m"},
        "arms": [{"name": "a", "engine": {"kind": "vllm", "executable": ["python"], **engine}}],
        "workloads": [{"name": "w", "input_tokens": 8, "output_tokens": 4}],
    }


# -- the scrubber ---------------------------------------------------------------------------------


def test_registered_values_are_replaced_longest_first_in_every_form() -> None:
    scrubber = sec.Scrubber()
    short, long = "abcdefgh12", "abcdefgh1234567"
    scrubber.add(short)
    scrubber.add(long)
    assert scrubber.scrub(f"x {long} y {short} z") == "x *** y *** z"
    quoted = 'p"q\\r' + "stuvwxyz"
    scrubber.add(quoted)
    import json

    assert quoted not in scrubber.scrub(json.dumps({"v": quoted}))
    assert "stuvwxyz" not in scrubber.scrub(json.dumps({"v": quoted}))


def test_values_too_short_to_tell_from_text_are_not_registered() -> None:
    scrubber = sec.Scrubber(["abc", None, ""])
    assert scrubber.scrub("abc abc") == "abc abc"
    assert not scrubber.add("1234567")
    assert scrubber.add("12345678")


# key-shaped values made at run time: no literal that looks like a key is committed
SK_SHAPED = "sk-" + "abcdefghijklmnopqrstuv"


def test_patterns_mask_credentials_whatever_was_registered() -> None:
    text = (
        '{"error": {"authorization": "Bearer hunter2hunter2"}} '
        "http://alice:pw123456@gw.example/v1?api_key=zz99&model=m&token=tt#frag "
        "non-default args: {'api_key': 'k3yk3yk3y', 'port': 8000} api_key=None "
        f"x-api-key: abcdef {SK_SHAPED} hf_ABCDEFGHIJKLMNOPQRST"
    )
    clean = sec.Scrubber().scrub(text)
    for leaked in ("hunter2", "alice", "pw123456", "zz99", "=tt", "k3yk3yk3y", "abcdef ", "sk-abc", "hf_ABC"):
        assert leaked not in clean, (leaked, clean)
    assert '"Bearer ***"' in clean
    assert "http://***@gw.example/v1?api_key=***&model=m&token=***#frag" in clean
    assert "api_key=None" in clean  # not a key
    assert "'port': 8000" in clean


def test_references_and_ordinary_text_are_left_alone() -> None:
    text = "HF_TOKEN={env.HF_TOKEN} api_key: {env.K} --max-num-batched-tokens 8192 key_cache_dtype=auto"
    assert sec.Scrubber().scrub(text) == text


def test_scrub_data_reaches_every_string() -> None:
    scrubber = sec.Scrubber(["topsecret-1"])
    data = {"a": ["x topsecret-1", ("topsecret-1",)], "topsecret-1": 3, "n": 1}
    assert scrubber.scrub_data(data) == {"a": ["x ***", ("***",)], "***": 3, "n": 1}


def test_mask_shows_a_prefix_and_the_length_only() -> None:
    key = "sk-" + "a1" * 20
    assert sec.mask(key) == "sk-… (43 chars)"
    assert sec.mask("short") == "*** (5 chars)"


# -- which values are secrets ---------------------------------------------------------------------


def test_collect_finds_literals_references_shapes_and_url_credentials() -> None:
    hf, arg, ref_value, nested = _planted("hf"), _planted("arg"), _planted("ref"), _planted("n")
    data = _experiment(
        env={"HF_TOKEN": hf, "MY_REF": "{env.SOME_VAR}", "PLAIN": "1234567890"},
        args={"api_key": arg, "extra": {"password": nested}, "x": "{env.UNSET_ONE}"},
    )
    data["arms"][0]["endpoint"] = {"base_url": "https://u:pw-9876543210@h/v1?token=tok-123456789"}
    data["description"] = f"talks to {SK_SHAPED}"
    found = sec.collect_secrets(data, {"SOME_VAR": ref_value}.get)
    # the user "u" is too short to register
    shapes = {"pw-9876543210", "tok-123456789", SK_SHAPED}
    assert found == {hf, arg, nested, ref_value, *shapes}


def test_redact_data_by_name_keeps_references() -> None:
    data = {"env": {"HF_TOKEN": "hf_x", "REF_TOKEN": "{env.T}", "N": "1"}, "args": {"api_key": 123, "tp": 2}}
    assert sec.redact_data(data) == {
        "env": {"HF_TOKEN": "***", "REF_TOKEN": "{env.T}", "N": "1"},
        "args": {"api_key": "***", "tp": 2},
    }


def test_env_references() -> None:
    assert sec.env_references("a{env.A}b{env.B_2}") == ["A", "B_2"]
    assert sec.bad_env_references("{env.1X} {env.OK} {env.a-b}") == ["1X", "a-b"]
    assert sec.is_env_reference("{env.A}{env.B}")
    assert not sec.is_env_reference("Bearer {env.A}")
    assert sec.resolve_env_references("Bearer {env.A}", {"A": "v"}.get) == "Bearer v"
    with pytest.raises(sec.UnsetVariable) as info:
        sec.resolve_env_references("{env.MISSING}", {}.get)
    assert info.value.name == "MISSING"


# -- the spec -------------------------------------------------------------------------------------


def test_a_bad_reference_is_refused_naming_the_field() -> None:
    with pytest.raises(SpecError, match=r"env\.HF_TOKEN: \{env\.1BAD\} does not name an environment"):
        parse_experiment(_experiment(env={"HF_TOKEN": "{env.1BAD}"}))
    with pytest.raises(SpecError, match=r"args\.cfg\.key: \{env\.a b\}"):
        parse_experiment(_experiment(args={"cfg": {"key": "{env.a b}"}}))


@pytest.mark.parametrize(
    "value",
    [
        "sk-" + secrets.token_hex(20),
        "hf_" + secrets.token_hex(12),
        "Ab3" + secrets.token_hex(12),
        "not a name!",
    ],
    ids=["sk-key", "hf-token", "name-like-key", "not-a-name"],  # the same on every xdist worker
)
def test_a_key_in_api_key_env_is_refused_and_never_echoed_whole(value: str) -> None:
    data = _experiment()
    data["arms"][0]["endpoint"] = {"api_key_env": value}
    with pytest.raises(SpecError, match="not an environment variable name") as info:
        parse_experiment(data)
    message = str(info.value)
    if len(value) >= 12:
        assert value not in message
        assert f"{value[:3]}… ({len(value)} chars)" in message
    assert "api_key_env: MY_ENGINE_KEY" in message


@pytest.mark.parametrize(
    ("url", "where"),
    [
        ("http://user:s3cr3t-pass@gw.example/v1", "userinfo"),
        ("https://tok-0123456789@gw.example/v1", "userinfo"),
        ("https://gw.example/v1?api_key=k-0123456789", "query parameter 'api_key'"),
        ("https://gw.example/v1?x=1&access_token=k-0123456789", "query parameter 'access_token'"),
    ],
)
def test_credentials_in_base_url_are_refused(url: str, where: str) -> None:
    data = _experiment()
    data["arms"][0]["endpoint"] = {"base_url": url}
    with pytest.raises(SpecError) as info:
        parse_experiment(data)
    message = str(info.value)
    assert where in message
    assert "endpoint.api_key_env" in message
    for secret in ("s3cr3t-pass", "tok-0123456789", "k-0123456789"):
        assert secret not in message
    # a plain base URL is fine (a query of any kind is refused on its own: the base only)
    data["arms"][0]["endpoint"] = {"base_url": "https://gw.example/v1"}
    parse_experiment(data)


def test_parsing_registers_the_experiment_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    ref = _planted("ref")
    monkeypatch.setenv("K3PIPE_T_REF", ref)
    parse_experiment(_experiment(env={"HF_TOKEN": "{env.K3PIPE_T_REF}", "X": "{env.K3PIPE_T_REF}"}))
    assert sec.scrub(ref) == "***"
    # and an error that quotes one (an engine log tail, an echoed body) never carries it
    assert str(LaunchError(f"engine said HF_TOKEN={ref}")) == "engine said HF_TOKEN=***"


@pytest.mark.parametrize(
    ("env", "args", "where"),
    [
        ({"HF_TOKEN": "hf_" + "a1B2" * 6}, {}, "env.HF_TOKEN"),
        ({"VLLM_API_KEY": "plain-words-but-secret"}, {}, "env.VLLM_API_KEY"),
        ({"SOMETHING": "sk-" + "q9" * 12}, {}, "env.SOMETHING"),
        ({}, {"api_key": "sk_live_" + "Z7" * 10}, "args.api_key"),
        ({}, {"speculative_config": {"hf_token": "x" * 20}}, "args.speculative_config.hf_token"),
    ],
    ids=["hf-token", "named-key", "key-shaped", "arg-key", "nested"],
)
def test_a_literal_secret_in_engine_env_or_args_is_refused_with_the_way_to_pass_it(
    env: dict[str, str], args: dict[str, object], where: str
) -> None:
    """Keys come from the environment, never from a file that gets committed and shared: a literal
    under a secret's name, or shaped like a key, is refused naming the field and the reference to
    write; the value is registered first, so nothing that records the refusal shows it, and the
    error shows it masked."""
    value = next(iter(env.values())) if env else str(next(iter(args.values())))
    if isinstance(args.get("speculative_config"), dict):
        value = "x" * 20
    with pytest.raises(SpecError) as info:
        parse_experiment(_experiment(env=env, args=args))
    message = str(info.value)
    assert f"{where}: a literal secret" in message
    assert "write '{env." in message
    assert value not in message
    assert sec.scrub(f"said {value}") == "said ***"
    # a reference to a variable is how it is given; harmless values under secret-ish names pass
    parse_experiment(
        _experiment(env={"HF_TOKEN": "{env.HF_TOKEN}"}, args={"long_prefill_token_threshold": 4096})
    )


def test_an_error_shows_a_secret_field_masked(tmp_path: Path) -> None:
    hf = _planted("hf")
    data = _experiment(env={"HF_TOKEN": hf})  # refused itself, beside two unrelated errors
    data["arms"][0]["endpoint"] = {"model": 3}  # an unrelated error beside it
    data["workloads"][0]["input_tokens"] = 0
    with pytest.raises(SpecError) as info:
        parse_experiment(data)
    assert hf not in str(info.value)


# -- the command: recorded with references, launched with values ----------------------------------


def test_the_rendered_command_shows_references(monkeypatch: pytest.MonkeyPatch) -> None:
    ref = _planted("ref")
    monkeypatch.setenv("K3PIPE_T_HF", ref)
    monkeypatch.setenv("K3PIPE_T_KEY", ref)
    spec = parse_experiment(
        _experiment(
            env={"HF_TOKEN": "{env.K3PIPE_T_HF}", "VLLM_X": "1"},
            args={"api_key": "{env.K3PIPE_T_KEY}", "hf_token": "{env.K3PIPE_T_HF}", "max_num_seqs": 4},
        )
    )
    plan = plan_arm(spec, spec.arms[0], Path("/h"))
    shell = plan.command.shell()
    assert ref not in shell
    assert "HF_TOKEN='{env.K3PIPE_T_HF}'" in shell
    assert "--api-key '{env.K3PIPE_T_KEY}'" in shell
    assert "--hf-token '{env.K3PIPE_T_HF}'" in shell
    assert "--max-num-seqs 4" in shell
    assert plan.command.references() == [
        ("engine.env.HF_TOKEN", "K3PIPE_T_HF"),
        ("engine.args (--api-key)", "K3PIPE_T_KEY"),
        ("engine.args (--hf-token)", "K3PIPE_T_HF"),
    ]
    launched = plan.command.resolved({"K3PIPE_T_HF": ref, "K3PIPE_T_KEY": ref}.get)
    assert launched.env["HF_TOKEN"] == ref
    assert launched.argv[launched.argv.index("--hf-token") + 1] == ref
    # a secret does not change what the engine compiles, and stays out of the cache's factors
    assert plan.compile_cache is not None
    assert "HF_TOKEN" not in plan.compile_cache.factors["env"]
    assert "api_key" not in plan.compile_cache.factors["args"]


def test_docker_run_takes_a_reference_from_the_callers_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", _planted("hf"))
    data = _experiment(env={"HF_TOKEN": "{env.HF_TOKEN}", "OTHER_TOKEN": "{env.HF_TOKEN}"})
    engine = data["arms"][0]["engine"]
    data["arms"][0]["engine"] = {"kind": "vllm", "image": "vllm/vllm-openai:v1", "env": engine["env"]}
    data["arms"][0]["launcher"] = {"kind": "docker"}
    spec = parse_experiment(data)
    plan = plan_arm(spec, spec.arms[0], Path("/h"))
    from k3pipe.launchers import equivalent_command

    line = equivalent_command(plan, "img@sha256:0")
    assert line is not None
    assert " -e HF_TOKEN " in line
    assert "-e 'OTHER_TOKEN={env.HF_TOKEN}'" in line


def test_an_unset_variable_stops_the_launch_naming_arm_field_and_variable(tmp_path: Path) -> None:
    from k3pipe.core.settings import Settings
    from k3pipe.launchers.factory import launch_engine

    spec = parse_experiment(
        _experiment(env={"HF_TOKEN": "{env.K3PIPE_T_UNSET}"}, args={"api_key": "{env.K3PIPE_T_UNSET2}"})
    )
    plan = plan_arm(spec, spec.arms[0], tmp_path)
    with pytest.raises(SpecError) as info:
        launch_engine(plan, tmp_path / "e.log", Settings(), None)
    message = str(info.value)
    assert "arm 'a'" in message
    assert "engine.env.HF_TOKEN refers to {env.K3PIPE_T_UNSET}" in message
    assert "engine.args (--api-key) refers to {env.K3PIPE_T_UNSET2}" in message
    assert not (tmp_path / "e.log").exists()  # nothing was started


def test_preflight_finds_an_unset_variable_before_anything_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = parse_experiment(_experiment(env={"HF_TOKEN": "{env.K3PIPE_T_PF}"}))
    found = [f for f in preflight(spec) if f.rule == "env-unset"]
    assert [(f.severity, f.arm) for f in found] == [("error", "a")]
    assert "engine.env.HF_TOKEN refers to {env.K3PIPE_T_PF}" in found[0].message
    assert "export K3PIPE_T_PF=" in found[0].message
    monkeypatch.setenv("K3PIPE_T_PF", _planted())
    assert [f for f in preflight(spec) if f.rule == "env-unset"] == []


# -- errors, logging, the terminal ----------------------------------------------------------------


def test_a_health_error_never_carries_the_key_an_endpoint_echoes() -> None:
    key = _planted("key")  # not registered: the gate scrubs the key it sent

    def echo(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        body = "x" * 290 + " " + request.headers["authorization"]  # across the 300-character cut
        return httpx.Response(500, text=body)

    with (
        httpx.Client(transport=httpx.MockTransport(echo)) as client,
        pytest.raises(HealthError, match="answered 500") as info,
    ):
        check_endpoint("http://gw.test/v1", "m", SecretStr(key), client=client)
    assert key[:8] not in str(info.value)


def test_the_log_filter_scrubs_messages_arguments_and_tracebacks() -> None:
    secret = _planted("log")
    sec.register(secret)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("k3pipe.test.scrubber")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        sec.install_log_filter()
        logger.warning("key %s in an argument", secret)
        try:
            raise RuntimeError(f"boom {secret}")
        except RuntimeError:
            logger.exception("failed with %r", {"k": secret})
    finally:
        logger.removeHandler(handler)
    text = stream.getvalue()
    assert secret not in text
    assert "key *** in an argument" in text
    assert "RuntimeError: boom ***" in text


def test_the_terminal_stream_scrubs_what_is_written() -> None:
    secret = _planted("tty")
    sec.register(secret)
    out = io.StringIO()
    stream = sec.ScrubbedStream(out)
    print(f"a {secret} b", file=stream)
    stream.writelines([secret, "\n"])
    assert out.getvalue() == "a *** b\n***\n"
    assert stream.getvalue() == out.getvalue()  # the rest is the wrapped stream's


def test_a_containers_log_is_written_scrubbed_even_when_a_chunk_cuts_a_key(tmp_path: Path) -> None:
    from k3pipe.launchers.docker import DockerLauncher

    secret = _planted("dock")
    sec.register(secret)
    text = f"starting\nargs: api-token {secret} ok\nno newline at the end {secret}"
    cut = text.index(secret) + 5  # a chunk ends inside the key

    class Container:
        def logs(self, **kwargs: Any) -> list[bytes]:
            return [text[:cut].encode(), text[cut:].encode()]

    launcher = DockerLauncher(None, "img", [], {}, tmp_path / "c.log", {}, {})  # type: ignore[arg-type]
    launcher.container = Container()
    launcher._stream_logs()
    assert (tmp_path / "c.log").read_text() == text.replace(secret, "***")


@pytest.mark.parametrize("name", ["MY_GATEWAY_KEY_2026", "my_service_api_key_2024_v2", "K3PIPE_DEMO_API_KEY"])
def test_a_long_variable_name_is_still_a_name(name: str) -> None:
    data = _experiment()
    data["arms"][0]["endpoint"] = {"api_key_env": name}
    assert parse_experiment(data).arms[0].endpoint.api_key_env == name
