"""The study in miniature (issue 51): the DeepSeek-V3-style scale model of scripts/random_mla.py (its
shape, count and config.json as far as k3pipe and the engines read it, no torch needed), k3pipe's KV-pool
estimate for it (MLA: one latent per token and layer, fp8 against bf16), and experiments/mla-study-h100.yaml
and mla-overcommit-h100.yaml with a clean preflight on the node's layout, and the cells that cannot fit
warned or refused before any engine starts."""

from __future__ import annotations

import json
import re
import stat
import sys
from pathlib import Path
from typing import Any

import pytest

from k3pipe.engines import get_engine
from k3pipe.engines.base import Finding
from k3pipe.engines.kvpool import GiB, estimate_kv_pool, kv_layout
from k3pipe.experiment.load import load_experiment
from k3pipe.experiment.preflight import preflight
from k3pipe.schema.specs import ExperimentSpec
from tests.conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
import make_random_llama
import random_mla

STUDY = REPO / "experiments" / "mla-study-h100.yaml"
OVERCOMMIT = REPO / "experiments" / "mla-overcommit-h100.yaml"
NEXT = REPO / "experiments" / "mla-study-flashmla-h100.yaml"  # the second sitting's study
PRESET = random_mla.MLA_PRESETS["mla-moe"]
VOCAB = make_random_llama.make_tiny_model.VOCAB
CONFIG = random_mla.config_json(PRESET, VOCAB)
WEIGHTS = 2 * random_mla.parameter_count(PRESET, VOCAB)  # bf16
H100 = 79.65 * GiB  # an H100 80GB HBM3: nvidia-smi's 81,559 MiB, as the experiments say


@pytest.fixture(scope="module")
def study() -> ExperimentSpec:
    return load_experiment(STUDY)


def _node_home(home: Path, spec: ExperimentSpec) -> ExperimentSpec:
    """The node's K3PIPE_HOME as preflight sees it: the preset's config.json at the model's path, the
    vLLM venv's python and SGLang's (stubs); ``spec`` with SGLang's /tmp/sgl-venv pointed at its stub."""
    model = home / "models" / "mla-moe-random"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(CONFIG))
    for venv in ("vllm-0.22.0", "sgl"):
        python = home / "venvs" / venv / "bin" / "python"
        python.parent.mkdir(parents=True, exist_ok=True)
        python.write_text("#!/bin/sh\n")
        python.chmod(python.stat().st_mode | stat.S_IXUSR)
    data = spec.model_dump(mode="json", exclude_none=True)
    for arm in data["arms"]:
        if arm["engine"]["kind"] == "sglang":
            arm["engine"]["executable"][0] = str(home / "venvs" / "sgl" / "bin" / "python")
    return ExperimentSpec.model_validate(data)


def _with_args(spec: ExperimentSpec, arm: str, **args: Any) -> ExperimentSpec:
    data = spec.model_dump(mode="json", exclude_none=True)
    for a in data["arms"]:
        if a["name"] == arm:
            a["engine"]["args"].update(args)
    return ExperimentSpec.model_validate(data)


def _findings(spec: ExperimentSpec, home: Path, monkeypatch: pytest.MonkeyPatch) -> list[Finding]:
    monkeypatch.setenv("K3PIPE_GPU_API_KEY", "made-up")  # SGLang's --api-key is read at launch
    return preflight(_node_home(home, spec), {"model": CONFIG}, weight_bytes=WEIGHTS, home=home)


# -- the scale model --------------------------------------------------------------------------------


def test_the_preset_is_the_familys_mla_and_moe_at_693m() -> None:
    """MLA with the family's latent (512 + 64) and head dims, 64 routed experts, 8 a token, 1 shared, 4
    layers: 693,128,448 parameters (the first try's was 0.73 B); 262,144 positions cover 204,800."""
    assert (PRESET["kv_lora_rank"], PRESET["qk_rope_head_dim"]) == (512, 64)
    assert (PRESET["qk_nope_head_dim"], PRESET["v_head_dim"], PRESET["q_lora_rank"]) == (128, 128, 1536)
    experts = (PRESET["n_routed_experts"], PRESET["num_experts_per_tok"], PRESET["n_shared_experts"])
    assert experts == (64, 8, 1)
    assert PRESET["num_hidden_layers"] == 4
    assert PRESET["max_position_embeddings"] >= 204_800
    assert random_mla.parameter_count(PRESET, VOCAB) == 693_128_448
    # weights and an fp8 KV for 10 x 203K tokens on one H100, with most of it to spare
    kv = 10 * 203_000 * random_mla.kv_bytes_per_token(PRESET, 1)
    assert kv == 4_677_120_000
    assert WEIGHTS + kv < 0.1 * H100


def test_config_json_holds_what_the_engines_route_by() -> None:
    """vLLM 0.22.0 falls back to softmax routing without scoring_func and loads the routing bias only
    for topk_method noaux_tc; SGLang 0.5.16 reads topk_method, scoring_func and moe_layer_freq with no
    default (scripts/random_mla.py ROUTING pins where)."""
    assert CONFIG["architectures"] == ["DeepseekV3ForCausalLM"]
    assert CONFIG["model_type"] == "deepseek_v3"
    assert (CONFIG["topk_method"], CONFIG["scoring_func"]) == ("noaux_tc", "sigmoid")
    assert (CONFIG["moe_layer_freq"], CONFIG["first_k_dense_replace"]) == (1, 0)
    assert CONFIG["num_nextn_predict_layers"] == 0
    assert CONFIG["tie_word_embeddings"] is False
    assert CONFIG["dtype"] == CONFIG["torch_dtype"] == "bfloat16"
    assert CONFIG["num_key_value_heads"] == CONFIG["num_attention_heads"]


def test_a_shape_with_more_experts_a_token_than_experts_is_refused() -> None:
    with pytest.raises(SystemExit, match=r"num_experts_per_tok \(9\) exceeds n_routed_experts \(8\)"):
        make_random_llama.resolve_shape("mla-moe", {"experts": 8, "experts_per_token": 9})


def test_a_llama_flag_on_the_mla_preset_is_refused_not_ignored() -> None:
    with pytest.raises(SystemExit, match="--preset mla-moe takes no --kv-heads; its flags: --hidden"):
        make_random_llama.resolve_shape("mla-moe", {"kv_heads": 1})
    with pytest.raises(SystemExit, match="--preset 1b takes no --experts"):
        make_random_llama.resolve_shape("1b", {"experts": 8})
    shape = make_random_llama.resolve_shape("mla-moe", {"layers": 2, "experts": 16, "hidden": None})
    assert (shape["num_hidden_layers"], shape["n_routed_experts"], shape["hidden_size"]) == (2, 16, 1280)


# -- the KV pool ------------------------------------------------------------------------------------


def test_kvpool_reads_the_latent_of_the_model() -> None:
    layout = kv_layout(CONFIG)
    assert (layout.kind, layout.latent_dim, layout.attention_layers) == ("mla", 576, 4)
    for dtype, per_layer in (("fp8", 576), ("fp8_e4m3", 576), ("bfloat16", 1152), ("auto", 1152)):
        est = estimate_kv_pool(CONFIG, kv_cache_dtype=dtype, tp=1, dcp=1, budget_bytes_per_gpu=GiB)
        assert est.bytes_per_token_per_gpu == 4 * per_layer, dtype
        assert est.bytes_per_token_per_gpu == random_mla.kv_bytes_per_token(PRESET, per_layer // 576)


def test_fp8_holds_twice_the_tokens_of_bf16_as_the_first_try_measured() -> None:
    """vLLM's pool on an H100 on the first try: 31.8 M tokens with fp8, 15.8 M with bf16 (2.01x); the
    same budget holds exactly twice the tokens at 1 byte a KV element as at 2."""
    budget = 0.92 * H100 - WEIGHTS
    fp8 = estimate_kv_pool(CONFIG, kv_cache_dtype="fp8", tp=1, dcp=1, budget_bytes_per_gpu=budget)
    bf16 = estimate_kv_pool(CONFIG, kv_cache_dtype="bfloat16", tp=1, dcp=1, budget_bytes_per_gpu=budget)
    assert fp8.tokens == 33_548_349
    assert fp8.tokens // 2 == bf16.tokens
    assert abs(fp8.tokens / bf16.tokens - 31.8 / 15.8) < 0.01 * 2
    # the estimate is an upper bound; the first try's fp8 pool (another 0.7 B model of this layout, the
    # engine's activations, CUDA graphs and non-torch memory taken out) lies 5.2% below it
    assert 0.94 < 31.8e6 / fp8.tokens < 1.0


def test_preflight_is_clean_and_says_each_engines_estimate(
    study: ExperimentSpec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the node's layout (model, venvs, key) nothing is wrong, and each arm's 'kv-estimate' says the
    pool it expects: the figure to hold the engine's logged pool against (within 5%)."""
    findings = _findings(study, tmp_path, monkeypatch)
    assert [f for f in findings if f.severity in ("error", "warning")] == []
    estimates = {f.arm: f.message for f in findings if f.rule == "kv-estimate"}
    assert estimates["vllm"].startswith("estimated KV pool ~33,548,349 tokens (1 B per KV element, fp8)")
    assert "gpu_memory_utilization=0.92 x 79.65 GiB - 1.29 GiB weights per GPU" in estimates["vllm"]
    sglang = estimates["sglang"]
    assert sglang.startswith("estimated KV pool ~30,949,977 tokens (1 B per KV element, fp8_e4m3)")
    assert "mem_fraction_static=0.85 x 79.65 GiB" in estimates["sglang"]
    for message in estimates.values():
        assert "the most a workload holds at once: 2,030,000 (random-200k)" in message
        assert "MLA latent 576 x 1 B = 2,304 B per token per GPU" in message


@pytest.mark.parametrize(
    ("arm", "args", "expected"),
    [
        # a pool short of one 204,800-token request: vLLM refuses to start, SGLang starts and logs it
        ("vllm", {"kv_cache_memory_bytes": 400 * 2**20}, ["of the context length (max_model_len=204,800)"]),
        ("sglang", {"mem_fraction_static": 0.02}, ["of the context length (context_length=204,800)"]),
        # room for one 200K request but not for 10 x 203K at once: 2 GiB holds 932,067 tokens
        ("vllm", {"kv_cache_memory_bytes": 2 * 2**30}, ["only 4 of its 10 requests fit"]),
        # bf16 halves the pool: 5 GiB of fp8 hold the 200K wave (4.36 GiB), of bf16 they do not
        ("vllm", {"kv_cache_memory_bytes": 5 * 2**30, "kv_cache_dtype": "bfloat16"},
         ["only 5 of its 10 requests fit", "use kv_cache_dtype: fp8"]),
    ],
)  # fmt: skip
def test_a_cell_that_cannot_fit_is_warned_before_launch(
    study: ExperimentSpec,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    arm: str,
    args: dict[str, Any],
    expected: list[str],
) -> None:
    findings = _findings(_with_args(study, arm, **args), tmp_path, monkeypatch)
    kv = [f for f in findings if f.arm == arm and f.rule == "kv-capacity"]
    assert kv, findings
    assert all(f.severity == "warning" for f in kv)
    text = " / ".join(f.message for f in kv)
    for words in expected:
        assert words in text
    other = "sglang" if arm == "vllm" else "vllm"
    assert not [f for f in findings if f.arm == other and f.severity != "info"]


def test_5_gib_of_fp8_hold_the_200k_wave(
    study: ExperimentSpec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    findings = _findings(_with_args(study, "vllm", kv_cache_memory_bytes=5 * 2**30), tmp_path, monkeypatch)
    assert not [f for f in findings if f.rule == "kv-capacity"]


def test_weights_that_leave_no_memory_are_an_error(
    study: ExperimentSpec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang at mem_fraction_static 0.01: 0.80 GiB of the GPU for 1.29 GiB of weights."""
    findings = _findings(_with_args(study, "sglang", mem_fraction_static=0.01), tmp_path, monkeypatch)
    (error,) = [f for f in findings if f.severity == "error"]
    assert (error.arm, error.rule) == ("sglang", "kv-capacity")
    assert error.message.startswith("no memory is left for the KV cache")


def test_a_bounded_sglang_pool_is_estimated_at_its_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """experiments/mla-sglang-h100.yaml (the sitting's SGLang retry): max_total_tokens 2,100,000 caps the
    pool (kv_cache_configurator.py:1599-1608), so the estimate says so, not the 30.9 M the memory gives
    (the node's preflight of 2026-12-06 said 30,949,933: the pool logged was 2,100,000)."""
    retry = load_experiment(REPO / "experiments" / "mla-sglang-h100.yaml")
    findings = _findings(retry, tmp_path, monkeypatch)
    assert [f for f in findings if f.severity != "info"] == []
    (estimate,) = [f.message for f in findings if f.rule == "kv-estimate"]
    assert estimate.startswith("estimated KV pool ~2,100,000 tokens (1 B per KV element, fp8_e4m3)")
    assert "= 30,949,977 tokens, capped at 2,100,000 by max_total_tokens=2,100,000" in estimate


# -- the experiments --------------------------------------------------------------------------------


def test_the_arms_carry_the_studys_settings(study: ExperimentSpec) -> None:
    vllm, sglang = (a.engine for a in study.arms)
    assert [a.name for a in study.arms] == ["vllm", "sglang"]
    assert (vllm.version, sglang.version) == ("0.22.0", "0.5.16")
    assert all(a.launches == 2 for a in study.arms)
    assert "attention_backend" not in vllm.args  # MLA picks FLASHMLA; FLASH_ATTN is not an MLA backend
    assert "attention_backend" not in sglang.args  # fa3 on Hopper
    assert vllm.env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    assert (vllm.args["kv_cache_dtype"], sglang.args["kv_cache_dtype"]) == ("fp8", "fp8_e4m3")
    assert vllm.args["max_num_batched_tokens"] == sglang.args["chunked_prefill_size"] == 32768
    assert sglang.args["max_prefill_tokens"] == 32768
    assert get_engine("vllm").context_length(vllm.args) == 204_800
    assert get_engine("sglang").context_length(sglang.args) == 204_800
    assert vllm.args["no_enable_prefix_caching"] is True
    assert sglang.args["disable_radix_cache"] is True
    assert get_engine("vllm").kv_cache_dtype(vllm.args) == "fp8"


def test_the_workloads_are_the_studys(study: ExperimentSpec) -> None:
    assert [w.input_tokens for w in study.workloads] == [64000, 200000]
    for w in study.workloads:
        assert (w.output_tokens, w.concurrency, w.num_requests) == (3000, 10, 10)
        assert w.dataset.kind == "random"
        assert w.warmup_requests >= 1
    assert max(w.input_tokens + w.output_tokens for w in study.workloads) <= 204_800
    assert study.decision.metrics == ["steady_decode_tps", "duration_s"]


def test_every_flag_is_one_the_engines_know(study: ExperimentSpec) -> None:
    """No unknown-flag finding: each argument is in k3pipe's flag tables (k3pipe/engines/data)."""
    findings = preflight(study, home=Path("/nonexistent"))
    assert not [f for f in findings if f.rule in ("unknown-flag", "bad-value", "managed-flag")]


def test_the_overcommit_run_is_the_study_arm_at_098(
    study: ExperimentSpec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One vLLM launch at gpu_memory_utilization 0.98, else the study's vLLM arm; preflight warns
    before it starts (the study's 32 OOM retries at 0.95), and its estimate grows with the fraction."""
    over = load_experiment(OVERCOMMIT)
    (arm,) = over.arms
    study_args = dict(study.arms[0].engine.args)
    assert arm.engine.args["gpu_memory_utilization"] == 0.98
    assert {k: v for k, v in arm.engine.args.items() if k != "gpu_memory_utilization"} == {
        k: v for k, v in study_args.items() if k != "gpu_memory_utilization"
    }
    assert arm.engine.env["VLLM_LOGGING_LEVEL"] == "DEBUG"  # 0.22's --kv-cache-memory advice
    assert arm.launches == 1
    findings = _findings(over, tmp_path, monkeypatch)
    assert {f.rule for f in findings if f.severity != "info"} == {"vllm-gpu-memory-utilization"}
    (estimate,) = [f.message for f in findings if f.rule == "kv-estimate"]
    assert estimate.startswith("estimated KV pool ~35,775,524 tokens")


def test_the_second_sittings_study_names_sglangs_flashmla_and_bounds_its_pool(
    study: ExperimentSpec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """experiments/mla-study-flashmla-h100.yaml: the first sitting's study but SGLang's attention_backend
    (fa3 converted the whole fp8 pool to bf16 in decode: OOM) and max_total_tokens as a safety net;
    preflight clean on the node's layout, SGLang's estimate the cap."""
    nxt = load_experiment(NEXT)
    assert [w.model_dump() for w in nxt.workloads] == [w.model_dump() for w in study.workloads]
    assert nxt.arms[0].model_dump() == study.arms[0].model_dump()  # vLLM as it ran
    sglang, first = nxt.arm("sglang").engine.args, study.arm("sglang").engine.args
    assert {k: v for k, v in sglang.items() if k not in first} == {
        "attention_backend": "flashmla",
        "max_total_tokens": 2_100_000,
    }
    assert {k: v for k, v in sglang.items() if k in first} == dict(first)
    flags = preflight(nxt, home=Path("/nonexistent"))
    assert [f for f in flags if f.rule in ("unknown-flag", "bad-value")] == []
    findings = _findings(nxt, tmp_path, monkeypatch)
    assert [f for f in findings if f.severity in ("error", "warning")] == []
    estimates = {f.arm: f.message for f in findings if f.rule == "kv-estimate"}
    assert estimates["sglang"].startswith("estimated KV pool ~2,100,000 tokens")
    assert estimates["vllm"].startswith("estimated KV pool ~33,548,349 tokens")


# -- the sitting ------------------------------------------------------------------------------------


def test_the_sittings_calls_fit_the_device_rules() -> None:
    """docs/gpu-mla-sitting.json, the calls in order: each within a call's limits (2,000 characters, 8
    carried paths, 600 s), at most one bundle part a call, every part of both bundles carried once, the
    study's deadline in the file it runs and its waits long enough for it (and the SIGKILL after it)."""
    plan = json.loads((REPO / "docs" / "gpu-mla-sitting.json").read_text())
    calls = plan["calls"]
    assert [c["n"] for c in calls] == list(range(1, len(calls) + 1))
    parts: list[str] = []
    for call in calls:
        assert len(call["command"]) <= 2000, call["n"]
        assert len(call["carry"]) <= 8
        assert call["timeout_s"] <= 600
        assert call["expect_s"] < call["timeout_s"]
        mine = [p for p in call["carry"] if ".part" in p]
        assert len(mine) <= 1, call["n"]
        parts += mine
    assert parts == [f".gpu/bundle/k3pipe-bundle.part{i:03d}" for i in range(8)] + [
        f".gpu/sgl/k3pipe-bundle.part{i:03d}" for i in range(10)
    ]
    detach = "mla-study-flashmla-h100.yaml scripts/gpu-node.sh detach run"
    study = next(c["command"] for c in calls if detach in c["command"])
    found = re.search(r"--deadline (\d+)", study)
    assert found is not None
    deadline = int(found[1])
    assert f"--deadline {deadline}" in NEXT.read_text()  # the file's header says the same
    waits = [int(m) for c in calls for m in re.findall(r"wait --max (\d+)", c["command"])]
    assert sum(waits) >= deadline + 60
    assert "--preset mla-moe" in " ".join(c["command"] for c in calls)
    assert sum(c["expect_s"] for c in calls) < 26 * 60
