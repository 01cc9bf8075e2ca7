"""Variants as code: a variant resolves to an experiment of its own (overrides laid over, a null
removing a key, bad values refused with the field named), and the study's retest checklist
(experiments/kimi-k3-retest.yaml) renders every item as the launch it changes."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from k3pipe.cli.main import app
from k3pipe.core.errors import SpecError
from k3pipe.experiment.load import load_experiment, parse_experiment
from k3pipe.experiment.variants import changes, resolve
from k3pipe.planning.plan import plan_arm

REPO = Path(__file__).resolve().parents[2]
RETEST = REPO / "experiments" / "kimi-k3-retest.yaml"
STUDY = REPO / "experiments" / "kimi-k3-8xb300.yaml"


def test_the_retest_baseline_is_the_study_unchanged() -> None:
    retest, study = load_experiment(RETEST), load_experiment(STUDY)
    assert retest.model_dump(exclude={"name", "description", "variants"}) == study.model_dump(
        exclude={"name", "description", "variants"}
    )


def test_a_variant_resolves_to_an_experiment_of_its_own() -> None:
    spec = load_experiment(RETEST)
    varied = resolve(spec, "vllm-long-prefill-threshold")
    assert varied.name == "kimi-k3-retest@vllm-long-prefill-threshold"
    assert [a.name for a in varied.arms] == ["vllm"]
    assert varied.arms[0].engine.args["long_prefill_token_threshold"] == 4096
    # everything else is the baseline's
    base_args = spec.arm("vllm").engine.args
    assert {
        k: v for k, v in varied.arms[0].engine.args.items() if k != "long_prefill_token_threshold"
    } == base_args
    no_dcp = resolve(spec, "sglang-no-dcp")
    assert "dcp_size" not in no_dcp.arms[0].engine.args
    assert changes(spec, "sglang-no-dcp") == ["sglang: args.dcp_size removed"]
    docs = resolve(spec, "documents")
    assert [a.name for a in docs.arms] == ["vllm", "sglang"]
    assert {w.dataset.kind for w in docs.workloads} == {"documents"}
    assert [w.input_tokens for w in docs.workloads] == [64000, 200000]


def test_a_variant_keeps_the_placement_of_the_arms_it_runs() -> None:
    """A fleet's arms -> pools keeps only the arms the variant runs (the others' would name arms
    the variant's experiment lacks)."""
    spec = load_experiment(RETEST).model_dump(mode="json")
    spec["fleet"] = {"pools": ["n1", "n2"], "arms": {"vllm": ["n1"], "sglang": ["n2"]}}
    varied = resolve(parse_experiment(spec), "vllm-long-prefill-threshold")
    assert varied.fleet is not None
    assert varied.fleet.arms == {"vllm": ["n1"]}
    assert varied.fleet.pools == ["n1", "n2"]


def _minimal(**variant: object) -> dict:
    return {
        "name": "v",
        "model": {"source": "local", "path": "/m"},
        "arms": [
            {"name": "a", "engine": {"kind": "vllm", "executable": ["x"], "args": {"max_model_len": 4096}}}
        ],
        "workloads": [{"name": "w", "input_tokens": 32, "output_tokens": 4}],
        "variants": [{"name": "bigger", "arms": {"a": {}}, **variant}],
    }


def test_bad_variants_are_refused_with_what_to_fix() -> None:
    with pytest.raises(
        SpecError, match=r"variant 'bigger' names arm\(s\) b that the experiment does not have"
    ):
        parse_experiment({**_minimal(), "variants": [{"name": "bigger", "arms": {"b": {}}}]})
    with pytest.raises(SpecError, match="variants and arms names must be unique; repeated: a"):
        parse_experiment({**_minimal(), "variants": [{"name": "a", "arms": {"a": {}}}]})
    spec = parse_experiment(_minimal(workloads={"input_tokens": -5}))
    with pytest.raises(
        SpecError, match=r"(?s)variant 'bigger' of experiment 'v'.*workloads\[0\]\.input_tokens"
    ):
        resolve(spec, "bigger")
    with pytest.raises(SpecError, match="has no variant 'nope'; its variants: bigger"):
        resolve(spec, "nope")


def test_render_shows_every_checklist_item(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["render", str(RETEST)])
    assert result.exit_code == 0, result.output
    out = result.output
    items = yaml.safe_load(RETEST.read_text())["variants"]
    for v in items:
        assert f"# ===== variant {v['name']}: {v['description']}" in out
    sections = out.split("# ===== variant ")
    by_name = {s.split(":", 1)[0]: s for s in sections[1:]}
    assert "--long-prefill-token-threshold 4096" in by_name["vllm-long-prefill-threshold"]
    assert "--gpu-memory-utilization 0.92" in by_name["vllm-gpu-memory-0.92"]
    assert "--dcp-size" not in by_name["sglang-no-dcp"]
    assert "--dcp-size 8" in sections[0]  # the baseline keeps it
    assert "--max-model-len 262144" in by_name["serving-length"]
    assert "--context-length 262144" in by_name["serving-length"]
    assert "every workload: dataset {'kind': 'sharegpt'" in by_name["sharegpt"]
    assert "every workload: dataset {'kind': 'documents'" in by_name["documents"]


def test_preflight_judges_each_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("K3PIPE_API_KEY", "k3pipe-test-key")  # the arms' key variable, as for a run
    result = CliRunner().invoke(app, ["preflight", str(RETEST)])
    assert result.exit_code == 0, result.output
    out = result.output
    no_dcp = out.index("arm sglang of variant sglang-no-dcp (sglang)")
    assert "sglang-dcp-speculation" not in out[no_dcp : out.index("arm vllm of variant serving-length")]
    low = out.index("arm vllm of variant vllm-gpu-memory-0.92 (vllm)")
    assert "vllm-gpu-memory-utilization" not in out[low:no_dcp]
    # a variant's plan renders like any arm's
    spec = load_experiment(RETEST)
    plan = plan_arm(resolve(spec, "serving-length"), resolve(spec, "serving-length").arm("vllm"), Path("/h"))
    assert plan.experiment == "kimi-k3-retest@serving-length"
