"""Engine modules: argument rendering, managed flags, secret redaction, the registry."""

from __future__ import annotations

from pathlib import Path

import pytest

from k3pipe.core.errors import SpecError
from k3pipe.engines import RenderedCommand, engine_kinds, get_engine, render_args
from k3pipe.experiment.load import parse_experiment
from k3pipe.planning.plan import plan_arm


def test_render_args_forms() -> None:
    argv = render_args(
        {
            "tensor_parallel_size": 8,
            "enable-prefix-caching": True,
            "disable_log_stats": False,
            "seed": None,
            "attention_config": {"a": "B", "c": True},
            "allowed_origins": ["x", "y"],
            "draft": "{models.draft}",
        },
        {"model": "/m", "models.draft": "/d"},
    )
    assert argv == [
        "--tensor-parallel-size",
        "8",
        "--enable-prefix-caching",
        "--attention-config",
        '{"a":"B","c":true}',
        "--allowed-origins",
        "x",
        "y",
        "--draft",
        "/d",
    ]


def test_unknown_model_placeholder() -> None:
    with pytest.raises(SpecError, match=r"\{models.draft\}.*extra_models"):
        render_args({"x": "{models.draft}"}, {"model": "/m"})


def test_registry() -> None:
    assert engine_kinds() == ["sglang", "vllm"]
    assert get_engine("sglang").default_port == 30000
    assert get_engine("vllm").default_port == 8000
    with pytest.raises(SpecError, match="available: sglang, vllm"):
        get_engine("tgi")


def test_managed_flag_in_args_is_refused() -> None:
    data = {
        "name": "x",
        "model": {"source": "local", "path": "/m"},
        "arms": [{"name": "a", "engine": {"kind": "vllm", "executable": ["p"], "args": {"port": 1}}}],
        "workloads": [{"name": "w", "input_tokens": 8, "output_tokens": 4}],
    }
    spec = parse_experiment(data)
    with pytest.raises(SpecError, match=r"engine.args.port: --port is set by k3pipe; set launcher.port"):
        plan_arm(spec, spec.arms[0], Path("/h"))


def _keyed(kind: str, args: dict[str, object]) -> dict[str, object]:
    return {
        "name": "x",
        "model": {"source": "local", "path": "/m"},
        "arms": [
            {
                "name": "a",
                "engine": {"kind": kind, "executable": ["p"], "args": args},
                "endpoint": {"api_key_env": "ARM_KEY"},
            }
        ],
        "workloads": [{"name": "w", "input_tokens": 8, "output_tokens": 4}],
    }


def test_the_key_reaches_sglang_as_a_flag_reference() -> None:
    """SGLang reads no key variable: the plan gives it --api-key {env.ARM_KEY} (the record shows the
    reference; the launch resolves it); vLLM gets VLLM_API_KEY at launch and no flag."""
    spec = parse_experiment(_keyed("sglang", {"enable_metrics": True}))
    plan = plan_arm(spec, spec.arms[0], Path("/h"))
    argv = plan.command.argv
    assert argv[argv.index("--api-key") + 1] == "{env.ARM_KEY}"
    assert "--api-key '{env.ARM_KEY}'" in plan.command.shell()
    assert ("--api-key", "ARM_KEY") in [
        (w.split("(")[-1].rstrip(")"), n) for w, n in plan.command.references()
    ]
    assert (
        plan.command.resolved(lambda name: "s3cret" if name == "ARM_KEY" else None).argv[
            argv.index("--api-key") + 1
        ]
        == "s3cret"
    )
    vllm = parse_experiment(_keyed("vllm", {}))
    assert "--api-key" not in plan_arm(vllm, vllm.arms[0], Path("/h")).command.argv
    no_key = parse_experiment(
        {**_keyed("sglang", {}), "arms": [{"name": "a", "engine": {"kind": "sglang", "executable": ["p"]}}]}
    )
    assert "--api-key" not in plan_arm(no_key, no_key.arms[0], Path("/h")).command.argv


@pytest.mark.parametrize("key", ["api_key", "--api-key"])
def test_sglang_key_in_args_and_from_the_variable_is_refused(key: str) -> None:
    # a literal is refused when the file is read; a reference when the arm is planned
    with pytest.raises(SpecError, match=rf"args.{key}: a literal secret"):
        parse_experiment(_keyed("sglang", {key: "literal"}))
    spec = parse_experiment(_keyed("sglang", {key: "{env.SGLANG_KEY}"}))
    with pytest.raises(
        SpecError, match=rf"engine.args.{key}: SGLang gets --api-key from endpoint.api_key_env"
    ):
        plan_arm(spec, spec.arms[0], Path("/h"))


def test_plan_defaults_and_home_expansion() -> None:
    data = {
        "name": "x",
        "model": {"source": "local", "path": "{home}/models/m", "served_name": "m"},
        "arms": [
            {
                "name": "a",
                "engine": {
                    "kind": "vllm",
                    "executable": ["{home}/py", "-m", "srv"],
                    "env": {"C": "{home}/c"},
                },
                "launcher": {"host": "0.0.0.0"},
            }
        ],
        "workloads": [{"name": "w", "input_tokens": 8, "output_tokens": 4}],
    }
    spec = parse_experiment(data)
    plan = plan_arm(spec, spec.arms[0], Path("/h"))
    assert plan.command.argv[:3] == ["/h/py", "-m", "srv"]
    assert plan.command.env == {"C": "/h/c"}
    assert plan.base_url == "http://127.0.0.1:8000/v1"  # bound to all interfaces, reached by loopback
    assert plan.health_url == "http://127.0.0.1:8000/health"
    assert plan.model == "m"
    assert "--served-model-name" in plan.command.argv


def test_redaction() -> None:
    cmd = RenderedCommand(
        argv=["srv", "--api-key", "s3cret", "--max-num-batched-tokens", "32768"],
        env={"HF_TOKEN": "hf_x", "VLLM_API_KEY": "k", "VLLM_ENGINE_READY_TIMEOUT_S": "3600"},
    )
    shell = cmd.shell()
    assert "s3cret" not in shell
    assert "hf_x" not in shell
    assert "=k " not in shell
    assert "--max-num-batched-tokens 32768" in shell
    assert "VLLM_ENGINE_READY_TIMEOUT_S=3600" in shell
    assert cmd.redacted_env()["HF_TOKEN"] == "***"


def test_which_names_carry_secrets() -> None:
    from k3pipe.engines.base import is_secret_name

    for name in (
        "VLLM_API_KEY",
        "--api-key",
        "HF_TOKEN",
        "hf-token",
        "MY_PASSWORD",
        "db_secret_path",
        "APIKEY",
    ):
        assert is_secret_name(name), name
    # 'token' or 'key' inside a setting's name is not a secret: the value must show in the launch
    for name in ("long_prefill_token_threshold", "--max-num-batched-tokens", "key_cache_dtype", "tp_size"):
        assert not is_secret_name(name), name
