"""The run request a flow takes (k3pipe.experiment.params): overrides laid over every workload and validated
again as an experiment, an experiment given inline, arms and variants checked by name; the CLI's
override options; and prefect.yaml's deployments and schedule checked against the same models."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from typer.testing import CliRunner

from k3pipe.cli.main import app
from k3pipe.core.errors import SpecError
from k3pipe.experiment.load import load_experiment
from k3pipe.experiment.params import INLINE_SOURCE, NO_OVERRIDES, Overrides, RunRequest, apply_overrides

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "experiments" / "demo-study.yaml"


def _experiment(**workload: object) -> dict:
    return {
        "name": "p",
        "model": {"source": "local", "path": "/m"},
        "arms": [
            {"name": "a", "engine": {"kind": "vllm", "executable": ["x"]}},
            {"name": "b", "engine": {"kind": "vllm", "executable": ["x"]}},
        ],
        "workloads": [
            {"name": "w1", "input_tokens": 512, "output_tokens": 16, **workload},
            {"name": "w2", "input_tokens": 1024, "output_tokens": 32, "repeats": 3},
        ],
        "variants": [{"name": "v", "arms": {"a": {"args": {"max_num_seqs": 1}}}}],
    }


def test_overrides_are_laid_over_every_workload_in_a_new_spec() -> None:
    spec = load_experiment(DEMO)
    changed = apply_overrides(spec, Overrides(repeats=1, num_requests=4, concurrency=2))
    assert [(w.repeats, w.num_requests, w.concurrency) for w in changed.workloads] == [(1, 4, 2), (1, 4, 2)]
    # everything else as in the file; the file's spec is unchanged
    assert [w.input_tokens for w in changed.workloads] == [w.input_tokens for w in spec.workloads]
    assert changed.arms == spec.arms
    assert {w.repeats for w in spec.workloads} == {3}
    assert apply_overrides(spec, NO_OVERRIDES) is spec


def test_an_override_the_experiment_refuses_is_refused_with_the_field_named(tmp_path: Path) -> None:
    exp = tmp_path / "prefix.yaml"
    exp.write_text(yaml.safe_dump(_experiment(dataset={"kind": "shared_prefix", "prefix_tokens": 384})))
    request = RunRequest(experiment=str(exp), overrides=Overrides(input_tokens=256))
    with pytest.raises(SpecError) as err:
        request.load()
    message = str(err.value)
    assert message.startswith(f"{exp} with overrides input_tokens=256: invalid experiment")
    assert "workloads[0]: dataset.prefix_tokens (384) must be below input_tokens (256)" in message


def test_overrides_have_bounds_and_no_other_fields() -> None:
    with pytest.raises(ValidationError, match="repeats\n  Input should be greater than or equal to 1"):
        Overrides(repeats=0)
    with pytest.raises(ValidationError, match="concurrency\n  Input should be a valid integer"):
        Overrides.model_validate({"concurrency": "four"})
    with pytest.raises(ValidationError, match="repetas\n  Extra inputs are not permitted"):
        Overrides.model_validate({"repetas": 1})
    o = Overrides(num_requests=4, repeats=1)
    assert o.changes() == {"repeats": 1, "num_requests": 4}  # field order
    assert o.params() == {"override.repeats": 1, "override.num_requests": 4}
    assert o.describe() == "repeats=1, num_requests=4"
    assert NO_OVERRIDES.params() == {}
    assert NO_OVERRIDES.describe() == "none"
    for name, field in Overrides.model_fields.items():
        assert field.description, name


def test_an_experiment_given_inline_is_the_experiment_and_is_checked_like_a_file() -> None:
    text = yaml.safe_dump(_experiment())
    request = RunRequest(experiment="experiments/demo-study.yaml", experiment_yaml=text)
    assert request.source == INLINE_SOURCE
    assert request.load().name == "p"  # the file is not read
    assert RunRequest(experiment="", experiment_yaml=text).experiment is None  # a cleared form field
    bad = yaml.safe_dump(_experiment(concurrency=0))
    with pytest.raises(
        SpecError, match=r"<inline experiment_yaml>: invalid experiment(.|\n)*workloads\[0\]\.concurrency"
    ):
        RunRequest(experiment_yaml=bad).load()
    with pytest.raises(SpecError, match="<inline experiment_yaml>: not valid YAML"):
        RunRequest(experiment_yaml="name: [unclosed").load()
    with pytest.raises(ValidationError, match="no experiment: set experiment"):
        RunRequest(experiment_yaml="  ")


def test_arms_and_variants_are_checked_by_name() -> None:
    spec = RunRequest(experiment_yaml=yaml.safe_dump(_experiment())).load()
    assert RunRequest(experiment="x").arm_names(spec) == ["a", "b"]
    assert RunRequest(experiment="x", arms=["b", "a"]).arm_names(spec) == ["b", "a"]
    assert RunRequest(experiment="x", arms=[]).arm_names(spec) == ["a", "b"]
    with pytest.raises(SpecError, match="has no arm 'c'; arms: a, b"):
        RunRequest(experiment="x", arms=["c"]).arm_names(spec)
    with pytest.raises(ValidationError, match="names must be given once; repeated: a"):
        RunRequest(experiment="x", arms=["a", "a"])
    assert RunRequest(experiment="x").variant_names(spec) == ["v"]
    assert RunRequest(experiment="x", variants=["v"]).variant_names(spec) == ["v"]
    with pytest.raises(SpecError, match="has no variant 'w'; its variants: v"):
        RunRequest(experiment="x", variants=["w"]).variant_names(spec)
    assert (
        RunRequest(experiment="x", arms=["a"], overrides=Overrides(repeats=1)).describe()
        == "x, arms a, overrides repeats=1"
    )


def test_prefect_yaml_enforces_the_schema_and_its_smoke_schedule_is_a_valid_request() -> None:
    config = yaml.safe_load((REPO / "prefect.yaml").read_text())
    deployments = {d["name"]: d for d in config["deployments"]}
    assert all(d.get("enforce_parameter_schema") is True for d in deployments.values())
    retest = deployments["retest"]
    (smoke,) = retest["schedules"]
    assert smoke["timezone"] == "UTC"
    assert smoke["active"] is False
    assert smoke["slug"] == "nightly-cpu-smoke"
    request = RunRequest.model_validate({**retest["parameters"], **smoke["parameters"]})
    spec = request.load()
    assert request.overrides.repeats == 2
    assert {(w.repeats, w.num_requests) for w in spec.workloads} == {(2, 8)}
    assert [v.name for v in spec.variants] == ["batch1", "long-prefill-threshold"]
    (weekly,) = deployments["gpu"]["schedules"]
    assert (weekly["slug"], weekly["active"]) == ("weekly-gpu-retest", False)
    weekly_spec = RunRequest.model_validate(weekly["parameters"]).load()
    assert weekly_spec.variants
    assert {w.repeats for w in weekly_spec.workloads} == {3}  # verdicts need repeats


def test_the_cli_refuses_a_bad_override_before_prefect_starts(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["study", str(DEMO), "--repeats", "0"])
    assert result.exit_code == 2
    assert "Invalid value for '--repeats'" in result.output
    exp = tmp_path / "prefix.yaml"
    exp.write_text(yaml.safe_dump(_experiment(dataset={"kind": "shared_prefix", "prefix_tokens": 384})))
    result = runner.invoke(app, ["run", str(exp), "--input-tokens", "100"])
    assert result.exit_code == 2
    assert "with overrides input_tokens=100" in result.output
    assert "workloads[0]: dataset.prefix_tokens (384) must be below input_tokens (100)" in result.output
    result = runner.invoke(app, ["run", str(exp), "--arm", "nope"])
    assert result.exit_code == 2
    assert "has no arm 'nope'; arms: a, b" in result.output
