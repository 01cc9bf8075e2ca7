"""Preflight rules: each with a minimal spec that triggers it and one that does not; the study preset."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest

from k3pipe.experiment.preflight import (
    Finding,
    estimate_kv_pool,
    kv_layout,
    preflight,
    safetensors_bytes,
)
from k3pipe.experiment.preflight import port_taken as REAL_PORT_TAKEN
from k3pipe.schema.specs import ExperimentSpec
from tests.unit.engines.helpers import one_arm

GiB = 2**30
DSPARK = {"model": "/d", "method": "dspark", "num_speculative_tokens": 7}
H100 = {"gpu_name": "test GPU", "gpu_count": 8, "gpu_memory_gib": 80}


def rules(findings: list[Finding], arm: str | None = "a") -> dict[str, Finding]:
    return {f.rule: f for f in findings if f.arm == arm}


# -- vLLM: DCP + speculation ------------------------------------------------------------------------


def test_vllm_dcp_with_speculation_is_an_error() -> None:
    spec = one_arm("vllm", {"decode_context_parallel_size": 8, "speculative_config": DSPARK})
    found = rules(preflight(spec))["vllm-dcp-speculation"]
    assert found.severity == "error"
    assert "decode_context_parallel_size=8" in found.message
    assert "speculative_config=" in found.message
    assert "drop DCP" in found.message
    assert "drop speculative_config" in found.message


def test_vllm_dcp_short_key_counts_too() -> None:
    findings = preflight(one_arm("vllm", {"dcp": 2, "speculative_config": DSPARK}))
    assert "dcp=2" in rules(findings)["vllm-dcp-speculation"].message
    # and --dcp is not a flag: vLLM's short form is -dcp (argparse finds --dcp ambiguous)
    assert "unknown-flag" in rules(findings)


@pytest.mark.parametrize(
    "args",
    [
        {"decode_context_parallel_size": 1, "speculative_config": DSPARK},
        {"decode_context_parallel_size": 8},
        {"decode_context_parallel_size": 8, "speculative_config": None},
    ],
)
def test_vllm_dcp_or_speculation_alone_is_fine(args: dict[str, Any]) -> None:
    assert "vllm-dcp-speculation" not in rules(preflight(one_arm("vllm", args)))


# -- vLLM: DCP's own limits (tp, attention backend, KV heads) ----------------------------------------

MQA = {"num_hidden_layers": 4, "num_attention_heads": 32, "num_key_value_heads": 1, "head_dim": 128}


def test_vllm_dcp_must_divide_tp() -> None:
    spec = one_arm("vllm", {"tensor_parallel_size": 8, "decode_context_parallel_size": 3})
    found = rules(preflight(spec))["vllm-dcp-tp"]
    assert found.severity == "error"
    assert "decode_context_parallel_size=3 with tensor_parallel_size=8" in found.message
    assert "must be divisible by dcp_size=3" in found.message
    assert "a divisor of 8 (2, 4, 8)" in found.message
    assert "raise tensor_parallel_size to a multiple of 3" in found.message


def test_vllm_dcp_without_tp_names_the_default() -> None:
    found = rules(preflight(one_arm("vllm", {"decode_context_parallel_size": 2})))["vllm-dcp-tp"]
    assert "tensor_parallel_size (default)=1" in found.message
    assert "tensor_parallel_size 1 allows no DCP" in found.message


@pytest.mark.parametrize("dcp", [1, 2, 4, 8])
def test_vllm_dcp_dividing_tp_is_fine(dcp: int) -> None:
    spec = one_arm("vllm", {"tensor_parallel_size": 8, "decode_context_parallel_size": dcp})
    assert "vllm-dcp-tp" not in rules(preflight(spec))


def test_vllm_dcp_on_a_backend_without_decode_lse_is_an_error() -> None:
    args = {"tensor_parallel_size": 8, "decode_context_parallel_size": 8, "attention_backend": "TRITON_ATTN"}
    found = rules(preflight(one_arm("vllm", args, version="0.22.0")))["vllm-dcp-backend"]
    assert found.severity == "error"
    assert "decode_context_parallel_size=8 with attention_backend=TRITON_ATTN" in found.message
    assert "vLLM 0.22.0's TRITON_ATTN backend" in found.message
    assert "softmax LSE" in found.message
    assert "FLASH_ATTN, FLASH_ATTN_DIFFKV, FLASH_ATTN_MLA" in found.message
    assert "FLASHINFER_MLA" not in found.message  # not on 0.22.0's list
    assert "decode_context_parallel_size: 1" in found.message


def test_vllm_dcp_backend_list_follows_the_declared_version() -> None:
    args = {"tensor_parallel_size": 8, "decode_context_parallel_size": 8}
    args["attention_backend"] = "FLASHINFER_MLA"
    old = rules(preflight(one_arm("vllm", args, version="0.22.0")))["vllm-dcp-backend"]
    assert "vLLM 0.32.0 supports it with DCP" in old.message
    assert "vllm-dcp-backend" not in rules(preflight(one_arm("vllm", args, version="0.32.0")))
    assert "vllm-dcp-backend" not in rules(preflight(one_arm("vllm", args)))  # stock 0.32.0


def test_vllm_dcp_backend_from_attention_config() -> None:
    args = {
        "tensor_parallel_size": 8,
        "decode_context_parallel_size": 8,
        "attention_config": '{"backend": "FLEX_ATTENTION"}',
    }
    found = rules(preflight(one_arm("vllm", args)))["vllm-dcp-backend"]
    assert "attention_config.backend=FLEX_ATTENTION" in found.message
    assert "stock vLLM 0.32.0's FLEX_ATTENTION backend" in found.message


@pytest.mark.parametrize(
    "args",
    [
        {"decode_context_parallel_size": 8, "attention_backend": "FLASH_ATTN"},
        {"decode_context_parallel_size": 8, "attention_backend": "flashmla"},
        {"decode_context_parallel_size": 8},  # vLLM picks the backend
        {"decode_context_parallel_size": 8, "attention_backend": "SOMETHING_NEW"},  # not ours to judge
        {"decode_context_parallel_size": 1, "attention_backend": "TRITON_ATTN"},
    ],
)
def test_vllm_dcp_backend_rule_stays_quiet(args: dict[str, Any]) -> None:
    spec = one_arm("vllm", {"tensor_parallel_size": 8, **args}, version="0.22.0")
    assert "vllm-dcp-backend" not in rules(preflight(spec))


@pytest.mark.parametrize(
    ("config", "dcp", "expected"),
    [
        ({**MQA, "num_key_value_heads": 8}, 8, "tensor_parallel_size 8 must be greater than the 8 KV heads"),
        ({**MQA, "num_key_value_heads": 2}, 8, "at most tensor_parallel_size // KV heads = 8 // 2 = 4"),
        ({**MQA, "num_attention_heads": 12}, 8, "the 12 query heads per KV head (12 / 1) must divide by 8"),
    ],
)
def test_vllm_dcp_needs_room_in_the_kv_heads(config: dict[str, Any], dcp: int, expected: str) -> None:
    spec = one_arm("vllm", {"tensor_parallel_size": 8, "decode_context_parallel_size": dcp})
    found = rules(preflight(spec, {"model": config}))["vllm-dcp-kv-heads"]
    assert found.severity == "error"
    assert expected in found.message
    assert "num_key_value_heads 1" in found.message


@pytest.mark.parametrize(
    "config",
    [
        MQA,  # 1 KV head, 32 query heads: DCP 8 on TP 8 fits
        {**MQA, "num_key_value_heads": 2, "num_attention_heads": 16},  # checked with DCP 4 below
        {"num_hidden_layers": 4, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "num_key_value_heads": 128},
    ],
)
def test_vllm_dcp_kv_heads_rule_stays_quiet(config: dict[str, Any]) -> None:
    dcp = 4 if config.get("num_key_value_heads") == 2 else 8
    spec = one_arm("vllm", {"tensor_parallel_size": 8, "decode_context_parallel_size": dcp})
    assert "vllm-dcp-kv-heads" not in rules(preflight(spec, {"model": config}))
    assert "vllm-dcp-kv-heads" not in rules(preflight(spec))  # no config: nothing to check


# -- SGLang: DCP + speculation ----------------------------------------------------------------------


def test_sglang_dcp_with_speculation_warns_static_verify() -> None:
    spec = one_arm(
        "sglang", {"dcp_size": 4, "speculative_algorithm": "DSPARK", "speculative_dspark_block_size": 7}
    )
    found = rules(preflight(spec))["sglang-dcp-speculation"]
    assert found.severity == "warning"
    assert "dcp_size=4" in found.message
    assert "speculative_algorithm=DSPARK" in found.message
    assert "static" in found.message
    assert "cost table, temperature calibration and confidence planner" in found.message
    assert "8 tokens" in found.message


def test_sglang_without_dcp_has_no_static_verify_warning() -> None:
    spec = one_arm("sglang", {"dcp_size": 1, "speculative_algorithm": "DSPARK"})
    assert "sglang-dcp-speculation" not in rules(preflight(spec))
    spec = one_arm("sglang", {"decode_context_parallel_size": 8})  # the alias, no speculation
    assert "sglang-dcp-speculation" not in rules(preflight(spec))


def test_sglang_metrics_info() -> None:
    assert rules(preflight(one_arm("sglang", {})))["sglang-metrics-disabled"].severity == "info"
    assert "sglang-metrics-disabled" not in rules(preflight(one_arm("sglang", {"enable_metrics": True})))


# -- vLLM: gpu_memory_utilization on FP8/MXFP4 ------------------------------------------------------


def test_high_utilization_with_fp8_kv_warns() -> None:
    spec = one_arm("vllm", {"gpu_memory_utilization": 0.95, "kv_cache_dtype": "fp8"})
    found = rules(preflight(spec))["vllm-gpu-memory-utilization"]
    assert found.severity == "warning"
    assert "gpu_memory_utilization=0.95" in found.message
    assert "kv_cache_dtype=fp8" in found.message
    assert "32 runtime OOM retries" in found.message
    assert "gpu_memory_utilization: 0.92" in found.message
    assert "--kv-cache-memory-bytes" in found.message
    assert "abbreviation" in found.message


def test_high_utilization_with_mxfp4_config_warns() -> None:
    spec = one_arm("vllm", {"gpu_memory_utilization": 0.97})
    config = {"quantization_config": {"quant_method": "mxfp4"}}
    found = rules(preflight(spec, {"model": config}))["vllm-gpu-memory-utilization"]
    assert "quant_method=mxfp4" in found.message


def test_high_utilization_with_fp8_model_name_warns() -> None:
    spec = one_arm(
        "vllm",
        {"gpu_memory_utilization": 0.95},
        model={"source": "modelscope", "id": "org/Some-Model-FP8"},
    )
    assert "model 'org/Some-Model-FP8'" in rules(preflight(spec))["vllm-gpu-memory-utilization"].message


@pytest.mark.parametrize(
    ("args", "config"),
    [
        ({"gpu_memory_utilization": 0.95}, None),  # nothing says FP8/MXFP4
        ({"gpu_memory_utilization": 0.95}, {"quantization_config": {"quant_method": "awq"}}),
        ({"gpu_memory_utilization": 0.92, "kv_cache_dtype": "fp8"}, None),
        ({"kv_cache_dtype": "fp8"}, None),  # default 0.92
        # a pinned KV size makes vLLM ignore the utilization
        ({"gpu_memory_utilization": 0.95, "kv_cache_dtype": "fp8", "kv_cache_memory_bytes": "38G"}, None),
    ],
)
def test_utilization_rule_stays_quiet(args: dict[str, Any], config: dict[str, Any] | None) -> None:
    findings = preflight(one_arm("vllm", args), {"model": config} if config else None)
    assert "vllm-gpu-memory-utilization" not in rules(findings)


# -- workload length ---------------------------------------------------------------------------------


def test_workload_longer_than_context_is_an_error() -> None:
    spec = one_arm(
        "vllm",
        {"max_model_len": 4096},
        workloads=[
            {"name": "long", "input_tokens": 4000, "output_tokens": 200},
            {"name": "fits", "input_tokens": 4000, "output_tokens": 96},
        ],
    )
    errors = [f for f in preflight(spec) if f.rule == "workload-length"]
    assert len(errors) == 1
    assert errors[0].severity == "error"
    assert "workload long" in errors[0].message
    assert "4,000" in errors[0].message
    assert "200" in errors[0].message
    assert "4,200" in errors[0].message
    assert "max_model_len=4,096" in errors[0].message


def test_workloads_that_would_share_prompts_warn() -> None:
    w = {"input_tokens": 256, "output_tokens": 8}
    spec = one_arm(
        "vllm",
        {},
        workloads=[
            {"name": "a", **w, "seed": 0, "repeats": 3},
            {"name": "b", **w, "seed": 2},  # seed 2 is a's third repeat
            {"name": "longer", "input_tokens": 512, "output_tokens": 8, "seed": 0},  # other length
            {"name": "far", **w, "seed": 103},
            {"name": "prefix", **w, "seed": 0, "dataset": {"kind": "shared_prefix", "prefix_tokens": 64}},
        ],
    )
    found = [f for f in preflight(spec) if f.rule == "shared-prompts"]
    assert len(found) == 1
    (f,) = found
    assert (f.severity, f.arm) == ("warning", None)
    assert "workloads a and b" in f.message
    assert "seed(s) 2" in f.message


def test_ladder_points_of_one_wave_warn() -> None:
    """64 requests at 64 streams all start at once: the point is a burst (the H100's c64, 2026-12-05);
    two waves or a duration_s bound is a steady point."""
    w = {"input_tokens": 256, "output_tokens": 8}
    spec = one_arm(
        "vllm",
        {},
        workloads=[
            {"name": "brief", **w, "num_requests": 64, "seed": 0, "ladder": {"points": [1, 8, 64]}},
            {"name": "steady", **w, "num_requests": 128, "seed": 100, "ladder": {"points": [1, 8, 64]}},
            {"name": "timed", **w, "num_requests": 64, "duration_s": 30, "seed": 200,
             "ladder": {"points": [64]}},
            {"name": "rates", **w, "num_requests": 16, "load": "poisson", "concurrency": 64, "seed": 300,
             "ladder": {"over": "rate", "points": [40, 80]}},
        ],
    )  # fmt: skip
    (f,) = [f for f in preflight(spec) if f.rule == "ladder-one-wave"]
    assert (f.severity, f.arm) == ("warning", None)
    assert "workload brief: at c64 its 64 requests" in f.message
    assert "c8" not in f.message
    assert "num_requests to at least 128" in f.message


def test_workloads_sampling_one_file_warn_whatever_their_seeds() -> None:
    data = {"kind": "sharegpt", "path": "/data/sharegpt.json"}
    spec = one_arm(
        "vllm",
        {},
        workloads=[
            {"name": "a", "input_tokens": 256, "output_tokens": 8, "seed": 0, "dataset": data},
            {"name": "b", "input_tokens": 256, "output_tokens": 8, "seed": 500, "dataset": data},
        ],
    )
    (f,) = [f for f in preflight(spec) if f.rule == "shared-prompts"]
    assert "/data/sharegpt.json" in f.message
    assert "repeats" in f.message


def test_context_length_spellings() -> None:
    w = [{"name": "w", "input_tokens": 999_000, "output_tokens": 2_000}]
    # vLLM: '1m' is 1,000,000 -> 1,001,000 does not fit
    assert "workload-length" in rules(preflight(one_arm("vllm", {"max_model_len": "1m"}, workloads=w)))
    # vLLM: '1M' is 2**20 = 1,048,576 -> it fits
    assert "workload-length" not in rules(preflight(one_arm("vllm", {"max_model_len": "1M"}, workloads=w)))
    # SGLang: '1M' is 1,000,000; '1m' is refused by SGLang's parser
    assert "workload-length" in rules(preflight(one_arm("sglang", {"context_length": "1M"}, workloads=w)))
    bad = rules(preflight(one_arm("sglang", {"context_length": "1m"}, workloads=w)))["bad-value"]
    assert bad.severity == "error"
    assert "context_length='1m'" in bad.message
    assert "case-sensitive" in bad.message


def test_vllm_refuses_gib_suffix() -> None:
    """config-errors.md: vLLM rejects --kv-cache-memory-bytes 38GiB; 38G is read as 38 x 2**30."""
    spec = one_arm("vllm", {"kv_cache_memory_bytes": "38GiB"}, hardware=H100)
    findings = preflight(spec, {"model": SYNTHETIC_GQA}, weight_bytes=GiB)
    bad = rules(findings)["bad-value"]
    assert bad.severity == "error"
    assert "kv_cache_memory_bytes='38GiB'" in bad.message
    assert "KV pool not estimated" in rules(findings)["kv-capacity-skipped"].message
    assert "bad-value" not in rules(preflight(one_arm("vllm", {"kv_cache_memory_bytes": "38G"})))


def test_context_from_config_when_undeclared() -> None:
    spec = one_arm("vllm", {}, workloads=[{"name": "w", "input_tokens": 8000, "output_tokens": 500}])
    found = rules(preflight(spec, {"model": {"max_position_embeddings": 8192}}))["workload-length"]
    assert "max_position_embeddings=8,192" in found.message
    assert "workload-length" not in rules(preflight(spec))  # nothing to compare with


# -- flags and environment ---------------------------------------------------------------------------


def test_unknown_flag_warns_with_the_full_name() -> None:
    spec = one_arm("vllm", {"kv_cache_memory": 41317885440, "tensor_parallel_size": 8})
    found = [f for f in preflight(spec) if f.rule == "unknown-flag"]
    assert len(found) == 1
    assert found[0].severity == "warning"
    assert "--kv-cache-memory," in found[0].message
    assert "not a flag of stock vLLM 0.32.0" in found[0].message
    assert "fine if your image adds it" in found[0].message
    assert "abbreviation of --kv-cache-memory-bytes" in found[0].message


def test_abbreviated_flag_still_pins_the_kv_pool() -> None:
    """The field notes' --kv-cache-memory: vLLM reads it as --kv-cache-memory-bytes, so the pinned
    pool overrides gpu_memory_utilization, and preflight still asks for the full name."""
    args = {"gpu_memory_utilization": 0.95, "kv_cache_dtype": "fp8", "kv_cache_memory": 41317885440}
    found = rules(preflight(one_arm("vllm", args)))
    assert "vllm-gpu-memory-utilization" not in found
    assert "abbreviation of --kv-cache-memory-bytes" in found["unknown-flag"].message


def test_unknown_flag_names_the_declared_version_and_near_misses() -> None:
    spec = one_arm("sglang", {"mem_fraction_statik": 0.8}, version="0.6.0")
    found = rules(preflight(spec))["unknown-flag"]
    assert "stock SGLang 0.5.23 (this arm declares version 0.6.0)" in found.message
    assert "--mem-fraction-static" in found.message


def test_what_argparse_does_is_said_of_the_tables_version_alone() -> None:
    """SGLang 0.5.16 takes --cuda-graph-max-bs (deprecated; it served the H100 capacity run with it);
    0.5.23's argparse refuses it as ambiguous. For an arm declaring 0.5.16 the warning says so of
    0.5.23 and that 0.5.16's flags are unchecked; for one on the stock version, of argparse."""
    old = rules(preflight(one_arm("sglang", {"cuda_graph_max_bs": 64}, version="0.5.16")))["unknown-flag"]
    assert "0.5.23's argparse refuses it as ambiguous (--cuda-graph-max-bs-decode" in old.message
    assert "k3pipe has no flag table of 0.5.16" in old.message
    stock = rules(preflight(one_arm("sglang", {"cuda_graph_max_bs": 64}, version="0.5.23")))["unknown-flag"]
    assert " argparse refuses it as ambiguous" in stock.message
    assert "no flag table" not in stock.message


def test_known_flags_are_quiet() -> None:
    args = {"tp_size": 8, "dcp_size": 8, "mem_fraction_static": 0.85, "enable_metrics": True}
    spec = one_arm("sglang", args)
    assert [f for f in preflight(spec) if f.arm == "a"] == []


def test_unknown_vllm_env_var_warns() -> None:
    spec = one_arm("vllm", {}, env={"VLLM_USE_V2_MODEL_RUNNER": "1", "VLLM_MADE_UP": "1", "OTHER": "x"})
    found = [f for f in preflight(spec) if f.rule == "vllm-unknown-env"]
    assert [f.message.split()[1] for f in found] == ["VLLM_MADE_UP"]
    assert "fine if your image (img) reads it" in found[0].message


def test_managed_flag_is_an_error() -> None:
    found = rules(preflight(one_arm("vllm", {"port": 9000})))["managed-flag"]
    assert found.severity == "error"
    assert "launcher.port" in found.message


# -- KV capacity --------------------------------------------------------------------------------------

# SYNTHETIC model configs, made up for these tests. None of them is a real model's config.json.
SYNTHETIC_GQA = {
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_size": 4096,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}


def test_kv_formula_gqa() -> None:
    budget = 10 * GiB
    est = estimate_kv_pool(SYNTHETIC_GQA, kv_cache_dtype="auto", tp=8, dcp=1, budget_bytes_per_gpu=budget)
    per_token = 32 * 2 * 1 * 128 * 2  # layers x K,V x 1 head per GPU x head_dim x bf16
    assert est.bytes_per_token_per_gpu == per_token
    assert est.tokens == budget // per_token
    # fewer KV heads than TP ranks: replicated, still one head per GPU
    est16 = estimate_kv_pool(SYNTHETIC_GQA, kv_cache_dtype="fp8", tp=16, dcp=1, budget_bytes_per_gpu=budget)
    assert est16.bytes_per_token_per_gpu == 32 * 2 * 1 * 128 * 1
    # DCP=8 over TP=8: every GPU holds all 8 heads for 1/8 of the tokens: same logical pool
    dcp8 = estimate_kv_pool(SYNTHETIC_GQA, kv_cache_dtype="auto", tp=8, dcp=8, budget_bytes_per_gpu=budget)
    assert dcp8.bytes_per_token_per_gpu == 8 * per_token
    assert dcp8.tokens == (budget // (8 * per_token)) * 8


def test_kv_formula_mla_is_not_split_by_tp_but_by_dcp() -> None:
    mla = {"num_hidden_layers": 10, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "num_attention_heads": 64}
    one = estimate_kv_pool(mla, kv_cache_dtype="fp8", tp=1, dcp=1, budget_bytes_per_gpu=GiB)
    eight = estimate_kv_pool(mla, kv_cache_dtype="fp8", tp=8, dcp=1, budget_bytes_per_gpu=GiB)
    assert one.bytes_per_token_per_gpu == eight.bytes_per_token_per_gpu == 10 * 576
    dcp = estimate_kv_pool(mla, kv_cache_dtype="fp8", tp=8, dcp=8, budget_bytes_per_gpu=GiB)
    assert dcp.tokens == (GiB // (10 * 576)) * 8


@pytest.mark.parametrize(
    ("config", "attention_layers"),
    [
        ({"layer_types": ["linear_attention"] * 3 + ["full_attention"]}, 1),
        ({"layer_types": ["sliding_attention", "attention", "full_attention", "linear_attention"]}, 2),
        ({"full_attention_interval": 4}, 12),  # Qwen3-Next style, 48 layers
        ({"linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [4, 8]}}, 2),  # Kimi Linear
        ({"hybrid_override_pattern": "M-M*-M*-"}, 2),  # Nemotron-H style
        ({}, 48),
    ],
)
def test_kv_counts_only_full_attention_layers(config: dict[str, Any], attention_layers: int) -> None:
    base = {"num_hidden_layers": 48, "num_attention_heads": 8, "head_dim": 64}
    assert kv_layout({**base, **config}).attention_layers == attention_layers


def test_kv_layout_reads_text_config() -> None:
    layout = kv_layout({"architectures": ["X"], "text_config": {**SYNTHETIC_GQA, "num_hidden_layers": 7}})
    assert (layout.kind, layout.attention_layers, layout.kv_heads, layout.head_dim) == ("gqa", 7, 8, 128)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        kv_layout({"hidden_size": 8})


def _kv_spec(context: int, concurrency: int = 1, fraction: float = 0.9) -> ExperimentSpec:
    return one_arm(
        "vllm",
        {"tensor_parallel_size": 8, "max_model_len": context, "gpu_memory_utilization": fraction},
        hardware=H100,
        workloads=[{"name": "w", "input_tokens": 30_000, "output_tokens": 2_000, "concurrency": concurrency}],
    )


def test_kv_shortfall_against_context_length() -> None:
    weights = 8 * 60 * GiB  # 60 GiB per GPU
    budget = 0.9 * 80 * GiB - 60 * GiB  # 12 GiB
    pool = int(budget // (32 * 2 * 1 * 128 * 2))  # 786,432 tokens
    findings = preflight(_kv_spec(1_000_000), {"model": SYNTHETIC_GQA}, weight_bytes=weights)
    kv = [f for f in findings if f.rule == "kv-capacity"]
    assert len(kv) == 1
    assert kv[0].severity == "warning"
    assert f"~{pool:,} tokens" in kv[0].message
    assert f"{1_000_000 - pool:,} tokens (21.4%) short" in kv[0].message
    assert "max_model_len=1,000,000" in kv[0].message
    assert "vLLM refuses to start" in kv[0].message
    assert "gpu_memory_utilization=0.9 x 80.00 GiB - 60.00 GiB weights per GPU = 12.00 GiB" in kv[0].message
    # the same arm with a context the pool holds
    fits = preflight(_kv_spec(500_000), {"model": SYNTHETIC_GQA}, weight_bytes=weights)
    assert "kv-capacity" not in rules(fits)


def test_kv_shortfall_against_workload_concurrency() -> None:
    weights = 8 * 60 * GiB
    findings = preflight(_kv_spec(100_000, concurrency=30), {"model": SYNTHETIC_GQA}, weight_bytes=weights)
    kv = [f for f in findings if f.rule == "kv-capacity"]
    assert len(kv) == 1
    assert "(input 30,000 + output 2,000) x concurrency 30 = 960,000" in kv[0].message
    assert "only 24 of its 30 requests fit" in kv[0].message  # 786,432 // 32,000
    fits = preflight(_kv_spec(100_000, concurrency=24), {"model": SYNTHETIC_GQA}, weight_bytes=weights)
    assert "kv-capacity" not in rules(fits)


def test_kv_pinned_vllm_pool_and_reserve() -> None:
    spec = one_arm(
        "vllm",
        {"tensor_parallel_size": 8, "max_model_len": 1_000_000, "kv_cache_memory_bytes": "24G"},
        hardware=H100,
    )
    findings = preflight(spec, {"model": SYNTHETIC_GQA}, weight_bytes=8 * 60 * GiB)
    assert not [f for f in findings if f.rule == "kv-capacity"]  # 24 GiB holds 1,572,864 tokens
    findings = preflight(spec, {"model": SYNTHETIC_GQA}, weight_bytes=8 * 60 * GiB, reserve_gib_per_gpu=12)
    kv = rules(findings)["kv-capacity"]
    assert "kv_cache_memory_bytes=25769803776 per GPU (24.00 GiB) - 12.00 GiB reserve" in kv.message


def test_kv_no_memory_left_is_an_error() -> None:
    findings = preflight(_kv_spec(100_000), {"model": SYNTHETIC_GQA}, weight_bytes=8 * 75 * GiB)
    found = rules(findings)["kv-capacity"]
    assert found.severity == "error"
    assert "no memory is left for the KV cache" in found.message
    assert "- 75.00 GiB weights per GPU = -3.00 GiB" in found.message
    # the engine's own words for it come from the engine module
    assert "(vLLM: 'No available memory for the cache blocks')" in found.message


def test_kv_skipped_without_config_weights_or_memory_fraction() -> None:
    spec = _kv_spec(1_000_000)
    skipped = rules(preflight(spec), arm=None)["kv-capacity-skipped"]
    assert skipped.severity == "info"
    assert "config.json" in skipped.message
    assert "--model-config" in skipped.message
    assert "weights" in skipped.message
    only_weights = rules(preflight(spec, {"model": SYNTHETIC_GQA}), arm=None)["kv-capacity-skipped"]
    assert "config.json" not in only_weights.message
    assert "size of the weights" in only_weights.message
    sglang = one_arm("sglang", {"tp_size": 8}, hardware=H100)
    info = rules(preflight(sglang, {"model": SYNTHETIC_GQA}, weight_bytes=GiB))["kv-capacity-skipped"]
    assert "mem_fraction_static is not set" in info.message


def test_model_dir_supplies_config_and_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(SYNTHETIC_GQA))
    for i in range(2):
        with (tmp_path / f"model-0000{i}.safetensors").open("wb") as f:
            f.truncate(240 * GiB)  # sparse: 2 x 240 GiB = 60 GiB per GPU over TP=8
    assert safetensors_bytes(tmp_path) == 480 * GiB
    findings = preflight(_kv_spec(1_000_000), model_dir=tmp_path)
    assert "kv-capacity" in rules(findings)
    assert "kv-capacity-skipped" not in rules(findings, arm=None)


# -- the study preset -----------------------------------------------------------------------------------


def test_study_preset_findings(study: ExperimentSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("K3PIPE_API_KEY", "k3pipe-test-key")  # the arms' key variable, set as for a run
    findings = preflight(study)
    vllm, sglang = rules(findings, "vllm"), rules(findings, "sglang")
    assert "sglang-metrics-disabled" not in sglang  # the preset turns SGLang's /metrics on
    assert vllm["vllm-gpu-memory-utilization"].severity == "warning"
    assert sglang["sglang-dcp-speculation"].severity == "warning"
    assert "vllm-dcp-speculation" not in vllm  # the study's vLLM arm ran without DCP
    assert [f for f in findings if f.severity == "error"] == []  # in particular no workload-length error
    assert "unknown-flag" not in vllm  # every flag of both launches is a stock flag
    assert "unknown-flag" not in sglang
    assert "VLLM_ENABLE_K3_LATENT_MOE_TAIL_FUSION" in vllm["vllm-unknown-env"].message
    assert rules(findings, arm=None)["kv-capacity-skipped"].severity == "info"
    # the study's vLLM draft was a hub id vLLM fetched itself; the preset fetches each arm's own
    # (extra_models.draft_vllm, extra_models.draft), so neither arm loads an unpinned model
    assert "unpinned-model" not in vllm
    assert "unpinned-model" not in sglang
    study_launch = study.model_dump(mode="json")
    study_launch["arms"][0]["engine"]["args"]["speculative_config"]["model"] = "Inferact/Kimi-K3-DSpark"
    unpinned = rules(preflight(ExperimentSpec.model_validate(study_launch)), "vllm")["unpinned-model"]
    assert unpinned.severity == "warning"
    assert "engine.args.speculative_config.model names 'Inferact/Kimi-K3-DSpark'" in unpinned.message


# SYNTHETIC config for the study test: a made-up GQA model, NOT Kimi-K3's config.json (which is not
# available here). Sized so that, with the synthetic weight size below, the SGLang arm's estimated
# pool lands under the declared 1,000,000-token context, as the study's SGLang pool did.
SYNTHETIC_STUDY_CONFIG = {
    "num_hidden_layers": 61,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 1_000_000,
    "torch_dtype": "bfloat16",
}
SYNTHETIC_WEIGHT_BYTES = 8 * 215 * GiB


def test_study_preset_kv_shortfall_with_synthetic_config(study: ExperimentSpec) -> None:
    findings = preflight(study, {"model": SYNTHETIC_STUDY_CONFIG}, weight_bytes=SYNTHETIC_WEIGHT_BYTES)
    assert "kv-capacity-skipped" not in rules(findings, arm=None)
    # SGLang: 0.85 x 267.69 GiB - 215 GiB; DCP=8 over TP=8 -> all 8 KV heads per GPU, fp8_e4m3
    budget = 0.85 * (267.69 * GiB) - SYNTHETIC_WEIGHT_BYTES / 8
    pool = int(budget // (61 * 2 * 8 * 128 * 1)) * 8
    sglang = [f for f in findings if f.arm == "sglang" and f.rule == "kv-capacity"]
    assert len(sglang) == 2
    context, workload = sglang
    assert f"~{pool:,} tokens is {1_000_000 - pool:,} tokens" in context.message
    assert "context_length=1,000,000" in context.message
    assert "KV pool holds N tokens, fewer than --context-length" in context.message
    assert "workload random-200k" in workload.message
    assert f"only {pool // 203_000} of its 10 requests fit" in workload.message
    # vLLM: 0.95 x 267.69 GiB - 215 GiB, TP=8 without DCP -> one KV head per GPU: the pool holds
    # 1M context and 10 x 203K at once
    assert not [f for f in findings if f.arm == "vllm" and f.rule == "kv-capacity"]


def test_sglang_key_variable_unset_is_an_error(
    study: ExperimentSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang takes its key only as --api-key, rendered from the variable endpoint.api_key_env names:
    unset, the launch could not give it (vLLM would serve without one: no finding for it)."""
    monkeypatch.delenv("K3PIPE_API_KEY", raising=False)
    findings = preflight(study)
    unset = rules(findings, "sglang")["env-unset"]
    assert unset.severity == "error"
    assert "endpoint.api_key_env names K3PIPE_API_KEY" in unset.message
    assert "--api-key" in unset.message
    assert "export K3PIPE_API_KEY=" in unset.message
    assert "env-unset" not in rules(findings, "vllm")


def test_a_taken_port_is_found_by_preflight(monkeypatch: pytest.MonkeyPatch) -> None:
    """The study's pitfall: an engine's port already taken on this machine was found at launch, after
    the downloads. A real socket listens on a free port; an arm that binds it gets an error naming
    the port when ports are asked for (not before a run has reaped its orphans); another port, an
    endpoint's arm, or a fleet's (its nodes bind) gets none."""
    monkeypatch.setattr("k3pipe.experiment.preflight.port_taken", REAL_PORT_TAKEN)
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        taken = listening.getsockname()[1]

        def spec(launcher: dict[str, Any], **extra: Any) -> ExperimentSpec:
            data = one_arm("vllm", {}).model_dump(mode="json")
            data["arms"][0]["launcher"] = launcher
            return ExperimentSpec.model_validate({**data, **extra})

        process = {"kind": "docker", "host": "127.0.0.1", "port": taken}
        assert not [f for f in preflight(spec(process)) if f.rule == "port"]  # not asked
        (finding,) = [f for f in preflight(spec(process), this_machine=True) if f.rule == "port"]
        assert finding.severity == "error"
        assert f"launcher.port {taken} on 127.0.0.1 is taken" in finding.message
        with socket.socket() as other:
            other.bind(("127.0.0.1", 0))
            free = other.getsockname()[1]
        assert not [
            f for f in preflight(spec({**process, "port": free}), this_machine=True) if f.rule == "port"
        ]
        external = {"kind": "external"}
        data = one_arm("vllm", {}).model_dump(mode="json")
        data["arms"][0]["launcher"] = external
        data["arms"][0]["endpoint"] = {"base_url": f"http://127.0.0.1:{taken}/v1"}
        endpoint = ExperimentSpec.model_validate(data)
        assert not [f for f in preflight(endpoint, this_machine=True) if f.rule == "port"]
        fleet = spec(process, fleet={"pools": ["gpu-node-1"]})
        assert not [f for f in preflight(fleet, this_machine=True) if f.rule == "port"]


@pytest.mark.parametrize(
    ("kind", "args"),
    [
        ("vllm", {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4}}),
        ("vllm", {"speculative_config": '{"method": "eagle", "model": "/d", "num_speculative_tokens": 3}'}),
        ("sglang", {"speculative_algorithm": "EAGLE", "speculative_draft_model_path": "/d"}),
    ],
    ids=["vllm-ngram", "vllm-json-string", "sglang-eagle"],
)
def test_speculation_on_random_prompts_is_warned_before_launch(kind: str, args: dict[str, Any]) -> None:
    """The study's 'pure cost' case: a speculative arm on random prompts measures the drafting's cost.
    Warned, naming the random workloads only; not for a sharegpt workload, nor without speculation."""
    workloads = [
        {"name": "rand", "input_tokens": 64, "output_tokens": 8},
        {
            "name": "chat",
            "input_tokens": 64,
            "output_tokens": 8,
            "dataset": {"kind": "sharegpt", "path": "/s.json"},
        },
    ]
    finding = rules(preflight(one_arm(kind, args, workloads=workloads)))["speculation-random-prompts"]
    assert finding.severity == "warning"
    assert "on random prompts (workload rand)" in finding.message
    assert "chat" not in finding.message
    assert "sharegpt or documents" in finding.message
    real_text = one_arm(kind, args, workloads=workloads[1:])
    assert "speculation-random-prompts" not in rules(preflight(real_text))
    plain = one_arm(kind, {}, workloads=workloads)
    assert "speculation-random-prompts" not in rules(preflight(plain))


def test_the_studys_speculative_arms_on_random_prompts_are_warned() -> None:
    """experiments/kimi-k3-8xb300.yaml: both arms speculate (DSpark) over random 64K/200K prompts."""
    from k3pipe.experiment.load import load_experiment
    from tests.conftest import REPO

    findings = preflight(load_experiment(REPO / "experiments" / "kimi-k3-8xb300.yaml"))
    warned = sorted(f.arm for f in findings if f.rule == "speculation-random-prompts")
    assert warned == ["sglang", "vllm"]


def test_a_draft_the_engine_would_fetch_itself_is_an_error_offline_and_a_warning_online(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The study's vLLM arm named a hub id in speculative_config (vLLM downloads it at start): on a
    node without network (HF_HUB_OFFLINE) that launch fails after its cold start, so preflight says
    so before; online it is a warning (unpinned, unhashed); a declared extra model is neither."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    hub = {"speculative_config": {"method": "eagle", "model": "org/draft", "num_speculative_tokens": 3}}
    online = rules(preflight(one_arm("vllm", hub)))["unpinned-model"]
    assert online.severity == "warning"
    offline = rules(preflight(one_arm("vllm", hub, env={"HF_HUB_OFFLINE": "1"})))["unpinned-model"]
    assert offline.severity == "error"
    assert "'org/draft', a hub id the engine would download at start" in offline.message
    assert "engine.env.HF_HUB_OFFLINE=1" in offline.message
    assert "extra_models" in offline.message
    sglang = one_arm(
        "sglang",
        {"speculative_algorithm": "EAGLE", "speculative_draft_model_path": "org/draft"},
        env={"TRANSFORMERS_OFFLINE": "true"},
    )
    assert rules(preflight(sglang))["unpinned-model"].severity == "error"
    # a path on the node is the engine's to read, not to download: a warning still
    path = {"speculative_config": {"method": "eagle", "model": "/drafts/d", "num_speculative_tokens": 3}}
    assert rules(preflight(one_arm("vllm", path, env={"HF_HUB_OFFLINE": "1"})))[
        "unpinned-model"
    ].severity == ("warning")
    # an engine started here inherits this machine's environment
    data = one_arm("vllm", hub).model_dump(mode="json")
    data["arms"][0]["engine"] = {"kind": "vllm", "executable": ["python"], "args": hub}
    data["arms"][0]["launcher"] = {"kind": "process"}
    process = ExperimentSpec.model_validate(data)
    assert rules(preflight(process))["unpinned-model"].severity == "warning"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    inherited = rules(preflight(process))["unpinned-model"]
    assert inherited.severity == "error"
    assert "HF_HUB_OFFLINE=1 in this environment" in inherited.message


def test_the_gpus_here_are_checked_against_the_experiments_hardware() -> None:
    """Asked to check this machine, preflight compares its GPUs as nvidia-smi lists them (here the
    H200 node's answer) with the experiment's hardware: a B300 preset on the H200 is a warning naming
    each difference; the right hardware, no GPUs listed, an endpoint's arm or a fleet, none."""
    from k3pipe.machine.node import GpuInfo

    h200 = [GpuInfo(index=0, name="NVIDIA H200", memory_total_mib=143771, driver_version="580.159.04")]
    b300 = {"gpu_name": "NVIDIA B300", "gpu_count": 8, "gpu_memory_gib": 267.69}
    spec = one_arm("vllm", {}, hardware=b300)
    assert not rules(preflight(spec), None).get("hardware-node")  # not asked
    found = [f for f in preflight(spec, this_machine=True, gpus=h200) if f.rule == "hardware-node"]
    assert [f.severity for f in found] == ["warning"] * 3
    assert found[0].message.startswith(
        "hardware.gpu_name is 'NVIDIA B300' but nvidia-smi names the GPU NVIDIA H200: this machine is not"
    )
    assert "hardware.gpu_count is 8 but nvidia-smi lists 1 GPU" in found[1].message
    assert "nvidia-smi reports 140.4 GiB per GPU" in found[2].message

    right = one_arm("vllm", {}, hardware={"gpu_name": "NVIDIA H200", "gpu_count": 1, "gpu_memory_gib": 139})
    assert not [f for f in preflight(right, this_machine=True, gpus=h200) if f.rule == "hardware-node"]
    data = spec.model_dump(mode="json")
    data["arms"][0]["launcher"] = {"kind": "external"}
    data["arms"][0]["endpoint"] = {"base_url": "http://127.0.0.1:9/v1"}
    endpoint = ExperimentSpec.model_validate(data)
    assert not [f for f in preflight(endpoint, this_machine=True, gpus=h200) if f.rule == "hardware-node"]
    fleet = ExperimentSpec.model_validate({**spec.model_dump(mode="json"), "fleet": {"pools": ["n1"]}})
    assert not [f for f in preflight(fleet, this_machine=True, gpus=h200) if f.rule == "hardware-node"]
    assert not [f for f in preflight(spec, this_machine=True, gpus=[]) if f.rule == "hardware-node"]
