"""Experiment specs: loading, validation errors that name file, field, value and choices."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from k3pipe.errors import SpecError
from k3pipe.experiment import load_experiment, parse_experiment

REPO = Path(__file__).resolve().parents[1]


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


@pytest.mark.parametrize("name", ["demo-cpu.yaml", "kimi-k3-8xb300.yaml"])
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

    import k3pipe.specs as specs

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
    """specs -> engines -> specs was a circle: the engine check lives in k3pipe.experiment."""
    import ast

    tree = ast.parse((REPO / "k3pipe" / "specs.py").read_text())
    imported = [
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in (node.names if isinstance(node, ast.Import) else [None])  # type: ignore[list-item]
    ]
    assert not [m for m in imported if m and m.startswith("k3pipe.engines")]
