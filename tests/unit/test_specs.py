"""Experiment specs: loading, validation errors that name file, field, value and choices."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from k3pipe.core.errors import SpecError
from k3pipe.experiment.load import load_experiment, parse_experiment

REPO = Path(__file__).resolve().parents[2]


def _minimal() -> dict:
    return {
        "name": "x",
        "model": {"source": "local", "path": "/m"},
        "arms": [{"name": "a", "engine": {"kind": "vllm", "executable": ["python"]}}],
        "workloads": [{"name": "w", "input_tokens": 8, "output_tokens": 4}],
    }


def _error(data: dict, tmp_path: Path) -> str:
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SpecError) as info:
        load_experiment(path)
    assert str(path) in str(info.value)
    return str(info.value)


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "experiments").glob("*.yaml")))
def test_shipped_experiments_load(name: str) -> None:
    spec = load_experiment(REPO / "experiments" / name)
    assert spec.arms
    assert spec.workloads


def test_minimal_defaults() -> None:
    spec = parse_experiment(_minimal())
    arm = spec.arms[0]
    assert arm.launcher.kind == "process"
    assert arm.launcher.host == "127.0.0.1"
    assert spec.workloads[0].concurrency == 1
    assert spec.model.source == "local"


def test_unknown_engine_kind_lists_choices(tmp_path: Path) -> None:
    data = _minimal()
    data["arms"][0]["engine"]["kind"] = "tgi"
    msg = _error(data, tmp_path)
    assert "arms[0].engine.kind" in msg
    assert "'tgi'" in msg
    assert "sglang, vllm" in msg


def test_unknown_field_lists_allowed_fields(tmp_path: Path) -> None:
    data = _minimal()
    data["workloads"][0]["concurency"] = 4
    msg = _error(data, tmp_path)
    assert "workloads[0].concurency: unknown field" in msg
    assert "concurrency" in msg.split("allowed fields:")[1]


def test_unknown_field_in_model_variant(tmp_path: Path) -> None:
    data = _minimal()
    data["model"]["revison"] = "v1"
    msg = _error(data, tmp_path)
    assert "model.revison: unknown field" in msg
    assert "path" in msg


def test_bad_literal_names_allowed_values(tmp_path: Path) -> None:
    data = _minimal()
    data["arms"][0]["launcher"] = {"kind": "k8s"}
    msg = _error(data, tmp_path)
    assert "arms[0].launcher.kind" in msg
    assert "'process', 'docker', 'external' or 'gpustack'" in msg
    assert "'k8s'" in msg


def test_a_field_of_another_launcher_kind_says_which(tmp_path: Path) -> None:
    data = _minimal()
    data["arms"][0]["launcher"] = {"gpus": 8}  # kind defaults to process
    msg = _error(data, tmp_path)
    assert "arms[0].launcher.gpus: unknown field" in msg
    assert "it is a field of kind 'docker'" in msg


def test_bad_model_source(tmp_path: Path) -> None:
    data = _minimal()
    data["model"] = {"source": "hf", "id": "a/b"}
    msg = _error(data, tmp_path)
    assert "model" in msg
    assert "model.source: unknown source 'hf'; expected 'modelscope' or 'local'" in msg


def test_modelscope_id_shape() -> None:
    data = _minimal()
    data["model"] = {"source": "modelscope", "id": "Kimi-K3"}
    with pytest.raises(SpecError, match="owner/name"):
        parse_experiment(data)


def test_range_errors_show_value(tmp_path: Path) -> None:
    data = _minimal()
    data["workloads"][0]["concurrency"] = 0
    msg = _error(data, tmp_path)
    assert "workloads[0].concurrency" in msg
    assert "greater than or equal to 1" in msg
    assert "(got 0)" in msg


def test_key_must_be_an_env_var_name() -> None:
    data = _minimal()
    data["arms"][0]["endpoint"] = {"api_key_env": "sk-abc123 literal"}
    with pytest.raises(SpecError, match="environment variable"):
        parse_experiment(data)


def test_launcher_needs_matching_engine_fields() -> None:
    data = _minimal()
    data["arms"][0]["engine"].pop("executable")
    with pytest.raises(SpecError, match=r"engine\.executable"):
        parse_experiment(data)
    data["arms"][0]["launcher"] = {"kind": "external"}
    with pytest.raises(SpecError, match=r"endpoint\.base_url"):
        parse_experiment(data)


def test_duplicate_names() -> None:
    data = _minimal()
    data["workloads"].append(dict(data["workloads"][0]))
    with pytest.raises(SpecError, match="repeated: w"):
        parse_experiment(data)


def test_missing_file_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="not found"):
        load_experiment(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_experiment(bad)


def test_specs_are_frozen() -> None:
    spec = parse_experiment(_minimal())
    with pytest.raises(Exception, match="frozen"):
        spec.workloads[0].concurrency = 9  # type: ignore[misc]


def test_every_field_has_a_description() -> None:
    from pydantic import BaseModel

    import k3pipe.schema.specs as specs

    models = [getattr(specs, n) for n in specs.__all__]
    for model in models:
        if isinstance(model, type) and issubclass(model, BaseModel):
            for name, field in model.model_fields.items():
                assert field.description, f"{model.__name__}.{name} has no description"


def test_an_unknown_engine_kind_names_the_arm_and_the_choices(tmp_path: Path) -> None:
    data = _minimal()
    data["arms"][0]["engine"]["kind"] = "tgi"
    message = _error(data, tmp_path)
    assert "(1 problem(s))" in message
    assert (
        "arms[0].engine.kind: unknown engine kind 'tgi'; expected one of sglang, vllm (got 'tgi')" in message
    )
    # with another problem in the same file: both are reported, in one error
    data["workloads"][0]["input_tokens"] = 0
    message = _error(data, tmp_path)
    assert "(2 problem(s))" in message
    assert "workloads[0].input_tokens" in message
    assert "unknown engine kind 'tgi'" in message


def test_the_spec_models_import_no_engine() -> None:
    """specs -> engines -> specs was a circle: the engine check lives in k3pipe.experiment.load."""
    import ast

    tree = ast.parse((REPO / "k3pipe" / "schema" / "specs.py").read_text())
    imported = [
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in (node.names if isinstance(node, ast.Import) else [None])  # type: ignore[list-item]
    ]
    assert not [m for m in imported if m and m.startswith("k3pipe.engines")]


def _with_gateway(**arm: object) -> dict:
    data = _minimal()
    data["arms"][0].update(
        {
            "endpoint": {"api_key_env": "ENGINE_KEY"},
            "gateway": {"base_url": "http://127.0.0.1:4000/api/v1/", "api_key_env": "GW_KEY", "model": "gw"},
            **arm,
        }
    )
    return data


def test_a_gateway_is_the_client_target_and_the_engine_stays_the_engines(tmp_path: Path) -> None:
    from k3pipe.planning.plan import plan_arm
    from k3pipe.records.derive import gateway_params as _gateway_params

    spec = parse_experiment(_with_gateway())
    plan = plan_arm(spec, spec.arms[0], tmp_path)
    # requests (health gate proof, benchmark) go to the gateway, with its key variable and model id
    assert (plan.client_base_url, plan.client_model, plan.client_key_env) == (
        "http://127.0.0.1:4000/api/v1",
        "gw",
        "GW_KEY",
    )
    # the engine's own URLs and key stay the engine's
    assert plan.base_url == "http://127.0.0.1:8000/v1"
    assert plan.health_url == "http://127.0.0.1:8000/health"
    assert plan.metrics_url == "http://127.0.0.1:8000/metrics"
    assert plan.api_key_env == "ENGINE_KEY"
    assert _gateway_params(plan) == {
        "client_target": "gateway",
        "gateway.base_url": "http://127.0.0.1:4000/api/v1",
        "gateway.model": "gw",
        "gateway.api_key_env": "GW_KEY",
        "gateway.continuous_usage_stats": True,
    }
    plain = parse_experiment(_minimal())
    plain_plan = plan_arm(plain, plain.arms[0], tmp_path)
    assert (plain_plan.client_base_url, plain_plan.client_key_env) == (plain_plan.base_url, None)
    assert _gateway_params(plain_plan) == {}


@pytest.mark.parametrize(
    ("arm", "says"),
    [
        (
            {"launcher": {"kind": "external"}, "endpoint": {"base_url": "http://h:1/v1"}},
            ["arms[0]: gateway is set with launcher.kind 'external'", "remove gateway", "endpoint.base_url"],
        ),
        (
            {"endpoint": {"base_url": "http://h:1/v1"}},
            ["endpoint.base_url 'http://h:1/v1' is set beside gateway", "gateway.base_url"],
        ),
        (
            {"endpoint": {"continuous_usage_stats": False}},
            ["endpoint.continuous_usage_stats is set beside gateway", "gateway.continuous_usage_stats"],
        ),
        (
            {"gateway": {"base_url": "http://h:1/v1", "model": "gw", "api_key_env": "not a name"}},
            ["arms[0].gateway.api_key_env", "is not an environment variable name", "gateway.api_key_env"],
        ),
        (
            {"gateway": {"base_url": "http://h:1/v1?api_key=abc", "model": "gw"}},
            ["arms[0].gateway.base_url", "carries credentials", "name it in gateway.api_key_env"],
        ),
        ({"gateway": {"base_url": "http://h:1/v1"}}, ["arms[0].gateway.model: required field is missing"]),
    ],
)
def test_a_gateway_that_cannot_work_is_refused_naming_the_field(
    tmp_path: Path, arm: dict, says: list[str]
) -> None:
    message = _error(_with_gateway(**arm), tmp_path)
    missing = [s for s in says if s not in message]
    assert not missing, message


def test_a_key_pasted_as_the_gateways_variable_is_refused_masked() -> None:
    key = "sk-" + "Zq8" * 12  # key-shaped, built here so that no committed line looks like a key
    with pytest.raises(SpecError) as info:
        parse_experiment(
            _with_gateway(gateway={"base_url": "http://h:1/v1", "model": "gw", "api_key_env": key})
        )
    assert key not in str(info.value)
    assert "it looks like a key" in str(info.value)
    assert "gateway.api_key_env" in str(info.value)


def _generated(alphabet: str, n: int, seed: int) -> str:
    """A generated token of ``n`` characters from ``alphabet`` (made here, so that no committed line
    holds anything shaped like a key)."""
    import random

    rng = random.Random(seed)
    return "".join(rng.choice(alphabet) for _ in range(n))


HEX = "0123456789abcdef"
ALNUM = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


@pytest.mark.parametrize(
    "key",
    [
        _generated(HEX, 32, 1),  # secrets.token_hex(16): what most self-hosted engines are given
        _generated(HEX, 64, 2),
        "nvapi_" + _generated(ALNUM, 40, 3),  # a vendor prefix and a generated run
        _generated(ALNUM, 24, 4),
        _generated(ALNUM, 43, 5),  # secrets.token_urlsafe(32) without its - and _
    ],
    ids=["hex32", "hex64", "prefixed", "alnum24", "alnum43"],
)
def test_a_generated_key_pasted_as_the_engines_variable_is_refused_and_never_echoed(
    tmp_path: Path, key: str
) -> None:
    data = _minimal()
    data["arms"][0]["endpoint"] = {"api_key_env": key}
    message = _error(data, tmp_path)
    assert "endpoint.api_key_env" in message, message
    assert "it looks like a key" in message, message
    assert key not in message, message
    assert key[8:20] not in message, message


@pytest.mark.parametrize(
    "name", ["K3PIPE_GPU_API_KEY", "OPENAI_API_KEY_2", "K3PIPE_TEST_KEY_1234", "AZURE_OPENAI_API_KEY_EASTUS2"]
)
def test_names_people_give_key_variables_are_accepted(name: str) -> None:
    data = _minimal()
    data["arms"][0]["endpoint"] = {"api_key_env": name}
    assert parse_experiment(data).arms[0].endpoint.api_key_env == name


def test_warmup_defaults_keep_a_fixed_count() -> None:
    w = parse_experiment(_minimal()).workloads[0]
    assert (w.warmup, w.warmup_requests, w.warmup_tolerance_pct) == ("fixed", 0, 5.0)


def test_a_steady_warmup_takes_its_most_and_tolerance() -> None:
    data = _minimal()
    data["workloads"][0].update(
        {"concurrency": 8, "warmup": "steady", "warmup_requests": 64, "warmup_tolerance_pct": 3}
    )
    w = parse_experiment(data).workloads[0]
    assert (w.warmup, w.warmup_requests, w.warmup_tolerance_pct) == ("steady", 64, 3.0)
    assert w.prompt_count == 64 + 16  # the most warm-up prompts are drawn, used or not


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        (
            {"warmup": "steady", "concurrency": 8, "warmup_requests": 10},
            [
                "workloads[0]",
                "warmup 'steady' compares consecutive waves of concurrency (8)",
                "warmup_requests (the most it sends, 10)",
                "set warmup_requests to 16 or more",
            ],
        ),
        (
            {"warmup": "steady"},  # warmup_requests defaults to 0
            ["warmup_requests (the most it sends, 0)", "set warmup_requests to 2 or more"],
        ),
        (
            {"warmup": "until-steady"},
            ["workloads[0].warmup", "expected 'fixed' or 'steady'", "'until-steady'"],
        ),
        (
            {"warmup_tolerance_pct": 0},
            ["workloads[0].warmup_tolerance_pct", "must be greater than 0", "(got 0)"],
        ),
        (
            {"warmup_tolerance_pct": 80},
            ["workloads[0].warmup_tolerance_pct", "must be at most 50", "do not agree", "(got 80)"],
        ),
        ({"warmup_tolerance_pct": "5"}, ["workloads[0].warmup_tolerance_pct", "'5'"]),
        ({"warmup": {"until": "steady"}}, ["workloads[0].warmup"]),
    ],
)
def test_a_bad_warmup_is_refused_naming_field_and_value(
    tmp_path: Path, fields: dict, says: list[str]
) -> None:
    data = _minimal()
    data["workloads"][0].update(fields)
    message = _error(data, tmp_path)
    missing = [s for s in says if s not in message]
    assert not missing, message
