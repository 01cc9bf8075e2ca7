"""experiments/dcp-crossover-h200.yaml: its shape (two vLLM arms that differ only in DCP, the study's
workloads) and a clean preflight with the model that scripts/make_random_llama.py's mqa-7b preset
builds on the node (its config.json made here from the preset, no torch needed)."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path
from typing import Any

import pytest

from k3pipe.engines import get_engine
from k3pipe.experiment.load import load_experiment
from k3pipe.experiment.preflight import preflight
from k3pipe.schema.specs import ExperimentSpec
from tests.conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
import make_random_llama

EXPERIMENT = REPO / "experiments" / "dcp-crossover-h200.yaml"
PRESET = make_random_llama.PRESETS["mqa-7b"]


@pytest.fixture(scope="module")
def spec() -> ExperimentSpec:
    return load_experiment(EXPERIMENT)


def _preset_config() -> dict[str, Any]:
    """What LlamaConfig(**preset) writes to config.json, as far as preflight reads it."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": make_random_llama.make_tiny_model.VOCAB,
        "dtype": "bfloat16",
        "torch_dtype": "bfloat16",
        **PRESET,
    }


def _node_home(home: Path) -> int:
    """The node's K3PIPE_HOME as preflight sees it: the preset model's config.json and the vLLM venv's
    python (a stub) at the experiment's {home} paths; returns the weights' bytes (bf16)."""
    model = home / "models" / "llama-mqa-7b-random"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(_preset_config()))
    python = home / "venvs" / "vllm-0.22.0" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return 2 * make_random_llama.parameter_count(PRESET)


def test_two_vllm_arms_that_differ_only_in_dcp(spec: ExperimentSpec) -> None:
    assert [a.name for a in spec.arms] == ["vllm-tp8", "vllm-tp8-dcp8"]
    vllm = get_engine("vllm")
    plain, dcp = spec.arms
    for arm in spec.arms:
        assert arm.engine.kind == "vllm"
        assert arm.engine.version == "0.22.0"
        assert vllm.speculation(arm.engine.args) is None
        assert arm.engine.args["attention_backend"] == "FLASH_ATTN"
        assert arm.engine.env["NCCL_NVLS_ENABLE"] == "0"
        assert arm.engine.env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert spec.hardware is not None
    tp = spec.hardware.gpu_count
    assert vllm.tensor_parallel_size(plain.engine.args) == vllm.tensor_parallel_size(dcp.engine.args) == tp
    assert vllm.decode_context_parallel_size(plain.engine.args) == 1
    assert vllm.decode_context_parallel_size(dcp.engine.args) == tp
    others = {k: v for k, v in dcp.engine.args.items() if k != "decode_context_parallel_size"}
    assert others == dict(plain.engine.args)
    assert dcp.engine.env == plain.engine.env


def test_the_study_workloads_with_repeats(spec: ExperimentSpec) -> None:
    assert [w.input_tokens for w in spec.workloads] == [64000, 200000]
    for w in spec.workloads:
        assert w.concurrency == 10
        assert w.num_requests == 10
        assert w.output_tokens == 3000
        assert w.repeats >= 3
        assert w.dataset.kind == "random"
    context = get_engine("vllm").context_length(spec.arms[0].engine.args)
    assert context is not None
    assert max(w.input_tokens + w.output_tokens for w in spec.workloads) <= context
    assert context <= PRESET["max_position_embeddings"]


def test_the_preset_fits_vllms_dcp_limits() -> None:
    """vLLM 0.22.0 config/model.py:1216-1239 for a non-MLA model at TP 8, DCP 8."""
    tp = dcp = 8
    kv, heads = PRESET["num_key_value_heads"], PRESET["num_attention_heads"]
    assert tp > kv
    assert dcp <= tp // kv
    assert (heads // kv) % dcp == 0
    assert heads % tp == 0
    assert make_random_llama.parameter_count(PRESET) == 6_753_095_680


def test_preflight_is_clean_with_the_preset_model(spec: ExperimentSpec, tmp_path: Path) -> None:
    weights = _node_home(tmp_path)
    findings = preflight(spec, {"model": _preset_config()}, weight_bytes=weights, home=tmp_path)
    assert [f for f in findings if f.severity in ("error", "warning")] == []


def test_preflight_catches_the_usual_dcp_mistakes(spec: ExperimentSpec, tmp_path: Path) -> None:
    """The same experiment with a GQA model (8 KV heads), a backend without the decode LSE, or DSpark."""
    data = spec.model_dump(mode="json", exclude_none=True)
    arm = data["arms"][1]
    arm["engine"]["args"]["attention_backend"] = "TRITON_ATTN"
    dspark = {"method": "dspark", "model": "/d", "num_speculative_tokens": 7}
    arm["engine"]["args"]["speculative_config"] = dspark
    broken = ExperimentSpec.model_validate(data)
    gqa = {**_preset_config(), "num_key_value_heads": 8}
    rules = {f.rule for f in preflight(broken, {"model": gqa}, home=tmp_path) if f.arm == "vllm-tp8-dcp8"}
    assert {"vllm-dcp-backend", "vllm-dcp-kv-heads", "vllm-dcp-speculation"} <= rules


def test_the_study_table_rides_along_as_reference(spec: ExperimentSpec) -> None:
    assert spec.reference is not None
    steady = {(f.workload, f.arm): f.value for f in spec.reference.figures if f.metric == "steady_decode_tps"}
    assert steady == {
        ("random-64k", "study vLLM (TP 8)"): 501,
        ("random-64k", "study SGLang (DCP 8)"): 335,
        ("random-200k", "study vLLM (TP 8)"): 163,
        ("random-200k", "study SGLang (DCP 8)"): 268,
    }


@pytest.mark.parametrize(
    ("figure", "expected"),
    [
        ({"workload": "random-1m", "metric": "duration_s"}, "reference.figures name workload(s) random-1m"),
        ({"workload": "random-64k", "metric": "decode_tps"}, "metric 'decode_tps' is not a metric of"),
    ],
)
def test_a_reference_figure_must_match_a_cell(
    spec: ExperimentSpec, figure: dict[str, Any], expected: str
) -> None:
    data = spec.model_dump(mode="json", exclude_none=True)
    data["reference"]["figures"].append({**figure, "arm": "x", "value": 1.0})
    with pytest.raises(ValueError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        ExperimentSpec.model_validate(data)


def test_the_report_reads_the_reference_from_the_study_run(spec: ExperimentSpec, tmp_path: Path) -> None:
    """start_study logs experiment.json; collect() gives its 'reference' to the report."""
    from k3pipe.jobs.study_run import start_study
    from k3pipe.records.tracking import Tracker
    from k3pipe.report.collect import collect

    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "test", tmp_path / "artifacts")
    run_id = start_study(tracker, spec, str(EXPERIMENT))
    data = collect(tracker, run_id)
    assert data.reference is not None
    assert data.reference["source"].startswith("shared/docs/field-notes.md")
    assert len(data.reference["figures"]) == 8


REHEARSAL = REPO / "experiments" / "dcp-rehearsal-h200-1gpu.yaml"


def test_the_one_gpu_rehearsal_is_the_study_arm_without_tensor_parallelism(
    spec: ExperimentSpec, tmp_path: Path
) -> None:
    """experiments/dcp-rehearsal-h200-1gpu.yaml: the study's model, engine and lengths at TP 1, and a
    clean preflight with the preset's config (KV for 204,800 tokens fits one H200 beside the weights)."""
    rehearsal = load_experiment(REHEARSAL)
    vllm = get_engine("vllm")
    (arm,) = rehearsal.arms
    study_arm = spec.arms[0]
    assert rehearsal.model.path == spec.model.path
    assert arm.engine.version == study_arm.engine.version
    assert arm.engine.executable == study_arm.engine.executable
    assert vllm.tensor_parallel_size(arm.engine.args) == 1
    assert vllm.decode_context_parallel_size(arm.engine.args) == 1
    for key in ("attention_backend", "max_model_len", "dtype", "no_enable_prefix_caching"):
        assert arm.engine.args[key] == study_arm.engine.args[key], key
    assert [w.input_tokens for w in rehearsal.workloads] == [w.input_tokens for w in spec.workloads]
    assert all(w.repeats >= 2 for w in rehearsal.workloads)
    weights = _node_home(tmp_path)
    findings = preflight(rehearsal, {"model": _preset_config()}, weight_bytes=weights, home=tmp_path)
    assert [f for f in findings if f.severity in ("error", "warning")] == []
    assert not any(f.rule == "kv-capacity-skipped" for f in findings), findings  # it was estimated
    # the same on a 24 GiB GPU: the weights (13.5 GB) leave too little KV for the 200K workload
    data = rehearsal.model_dump(mode="json", exclude_none=True)
    data["hardware"]["gpu_memory_gib"] = 24
    small = ExperimentSpec.model_validate(data)
    findings = preflight(small, {"model": _preset_config()}, weight_bytes=weights, home=tmp_path)
    assert any(f.rule == "kv-capacity" and f.severity in ("error", "warning") for f in findings), findings
