"""The KV-cache pool estimate: how many tokens an engine's KV pool holds, from the model's config.json.

:func:`kv_layout` reads the KV shape (MLA or GQA, and how many layers' KV grows with the context:
``layer_types``, Kimi Linear, Qwen3-Next and Nemotron-H layer lists), :func:`kv_dtype_bytes` the
bytes of one KV element, and :func:`estimate_kv_pool` the pool for a per-GPU budget (the formula is
in its docstring). The preflight's ``kv-capacity`` rule (:mod:`k3pipe.experiment.preflight`) checks the
context length and the workloads against it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["KVEstimate", "KVLayout", "estimate_kv_pool", "kv_dtype_bytes", "kv_layout"]

GiB = 2**30

# Entries of config.json "layer_types" whose KV grows with the context: transformers'
# ALLOWED_ATTN_LAYER_TYPES name full attention "full_attention" (legacy "attention",
# configuration_utils.py _LEGACY_LAYER_TYPE_REMAP). Sliding-window layers hold at most their window,
# linear-attention / SSM layers a fixed-size state: neither grows with the context.
_FULL_ATTENTION_TYPES = ("full_attention", "attention")

_KV_DTYPE_BYTES: dict[str, float] = {
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
    "mxfp8": 1,
    "bf16": 2,
    "bfloat16": 2,
    "fp16": 2,
    "float16": 2,
    "half": 2,
    "float32": 4,
    "float": 4,
    "nvfp4": 0.5,
    "fp4_mx_block16": 0.5,
}


class KVLayout(BaseModel):
    """How a model's KV cache is shaped, read from its config.json."""

    model_config = ConfigDict(frozen=True)

    kind: Literal["mla", "gqa"] = Field(description="mla: one latent per token; gqa: K and V per KV head.")
    total_layers: int
    attention_layers: int = Field(description="Layers whose KV grows with the context.")
    layers_from: str = Field(description="Which config field told the attention layers.")
    kv_heads: int | None = Field(default=None, description="GQA: KV heads (before TP).")
    head_dim: int | None = Field(default=None, description="GQA: size of one head.")
    latent_dim: int | None = Field(
        default=None, description="MLA: kv_lora_rank + qk_rope_head_dim elements per token and layer."
    )
    model_dtype_bytes: float = Field(default=2, description="Bytes of the model dtype ('auto' KV dtype).")


class KVEstimate(BaseModel):
    """An estimated KV pool, with the numbers that went into it."""

    model_config = ConfigDict(frozen=True)

    tokens: int = Field(description="Tokens the pool holds (logical: across DCP ranks).")
    budget_bytes_per_gpu: float
    bytes_per_token_per_gpu: float
    dtype_bytes: float
    tp: int
    dcp: int
    layout: KVLayout
    uncapped_tokens: int | None = Field(
        default=None, description="What the budget alone gives, where a setting caps the pool below it."
    )
    capped_by: str | None = Field(
        default=None, description="The setting that caps the pool (SGLang max_total_tokens), if one does."
    )

    def capped(self, tokens: int, setting: str) -> KVEstimate:
        """The estimate with the pool capped at ``tokens`` by ``setting`` (unchanged if not below)."""
        if tokens >= self.tokens:
            return self
        return self.model_copy(
            update={"tokens": tokens, "uncapped_tokens": self.tokens, "capped_by": setting}
        )

    def explain(self) -> str:
        lay = self.layout
        if lay.kind == "mla":
            per_layer = f"MLA latent {lay.latent_dim} x {self.dtype_bytes:g} B"
        else:
            groups = max(1, self.tp // self.dcp)
            heads = math.ceil((lay.kv_heads or 1) / groups)
            per_layer = f"2 x {heads} KV head(s) per GPU x {lay.head_dim} x {self.dtype_bytes:g} B"
        return (
            f"{lay.attention_layers} attention layers ({lay.layers_from}) x {per_layer} = "
            f"{self.bytes_per_token_per_gpu:,.0f} B per token per GPU; "
            f"{self.budget_bytes_per_gpu / GiB:.2f} GiB / that"
            + (f" x dcp {self.dcp}" if self.dcp > 1 else "")
            + (
                f" = {self.uncapped_tokens:,} tokens, capped at {self.tokens:,} by {self.capped_by}"
                if self.capped_by is not None and self.uncapped_tokens is not None
                else f" = {self.tokens:,} tokens"
            )
        )


def _text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """Multimodal configs keep the language model's fields under ``text_config``."""
    merged = dict(config)
    text = config.get("text_config")
    if isinstance(text, Mapping):
        merged.update(text)
    return merged


def _attention_layers(cfg: Mapping[str, Any], layers: int) -> tuple[int, str]:
    types = cfg.get("layer_types")
    if isinstance(types, list) and types:
        count = sum(1 for t in types if t in _FULL_ATTENTION_TYPES)
        return count, f"layer_types: {count} of {len(types)} full_attention"
    linear = cfg.get("linear_attn_config")
    if isinstance(linear, Mapping) and isinstance(linear.get("full_attn_layers"), list):
        # Kimi Linear style (vllm transformers_utils/configs/kimi_linear.py): 1-based layer lists
        count = len(linear["full_attn_layers"])
        return count, f"linear_attn_config.full_attn_layers: {count} of {layers}"
    interval = cfg.get("full_attention_interval")
    if isinstance(interval, int) and interval > 0:
        # Qwen3-Next: layer i is full attention when (i + 1) % interval == 0
        count = layers // interval
        return count, f"full_attention_interval={interval}: {count} of {layers}"
    pattern = cfg.get("hybrid_override_pattern")
    if isinstance(pattern, str) and pattern:
        # Nemotron-H: '*' attention, 'M' Mamba, '-' MLP, 'E' MoE
        count = pattern.count("*")
        return count, f"hybrid_override_pattern: {count} '*' of {len(pattern)}"
    return layers, f"all {layers} layers"


def _model_dtype_bytes(cfg: Mapping[str, Any]) -> float:
    name = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").removeprefix("torch.")
    return _KV_DTYPE_BYTES.get(name, 2)


def kv_layout(config: Mapping[str, Any]) -> KVLayout:
    """The KV shape of a model from its config.json (ValueError naming the missing field)."""
    cfg = _text_config(config)
    layers = cfg.get("num_hidden_layers") or cfg.get("num_layers")
    if not isinstance(layers, int) or layers <= 0:
        raise ValueError("config.json has no num_hidden_layers")
    attention, layers_from = _attention_layers(cfg, layers)
    dtype = _model_dtype_bytes(cfg)
    if cfg.get("kv_lora_rank"):
        rope = cfg.get("qk_rope_head_dim")
        if not isinstance(rope, int):
            raise ValueError("config.json has kv_lora_rank (MLA) but no qk_rope_head_dim")
        return KVLayout(
            kind="mla",
            total_layers=layers,
            attention_layers=attention,
            layers_from=layers_from,
            latent_dim=int(cfg["kv_lora_rank"]) + rope,
            model_dtype_bytes=dtype,
        )
    heads = cfg.get("num_attention_heads")
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim")
    if not head_dim and heads and cfg.get("hidden_size"):
        head_dim = int(cfg["hidden_size"]) // int(heads)
    if not kv_heads or not head_dim:
        raise ValueError(
            "config.json has neither MLA fields (kv_lora_rank, qk_rope_head_dim) nor GQA fields "
            "(num_key_value_heads or num_attention_heads, and head_dim or hidden_size)"
        )
    return KVLayout(
        kind="gqa",
        total_layers=layers,
        attention_layers=attention,
        layers_from=layers_from,
        kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        model_dtype_bytes=dtype,
    )


def kv_dtype_bytes(kv_cache_dtype: str, layout: KVLayout) -> float:
    """Bytes per KV element: fp8 variants 1, bf16/fp16 2, 'auto' the model dtype (block scales of
    mxfp8/nvfp4 ignored). ValueError for a dtype this table does not know."""
    name = kv_cache_dtype.lower()
    if name == "auto":
        return layout.model_dtype_bytes
    if name in _KV_DTYPE_BYTES:
        return _KV_DTYPE_BYTES[name]
    if name.startswith("fp8"):
        return 1
    raise ValueError(f"unknown KV cache dtype {kv_cache_dtype!r}")


def estimate_kv_pool(
    config: Mapping[str, Any],
    *,
    kv_cache_dtype: str,
    tp: int,
    dcp: int,
    budget_bytes_per_gpu: float,
) -> KVEstimate:
    """Estimate how many tokens an engine's KV pool holds.

    Formula (per GPU, ``d`` = bytes per KV element, ``L`` = full-attention layers)::

        B = f x M - W / (tp x pp) - R                 per-GPU budget: f the memory fraction
                                                      (vLLM gpu_memory_utilization, default 0.92;
                                                      SGLang mem_fraction_static), M the GPU memory,
                                                      W the weights, R a reserve (default 0).
                                                      vLLM kv_cache_memory_bytes, when set, is B.
        MLA:  b = L x (kv_lora_rank + qk_rope_head_dim) x d
                                                      one latent per token and layer, held whole by
                                                      every TP rank (not split across TP)
        GQA:  b = L x 2 x ceil(H_kv / (tp / dcp)) x head_dim x d
                                                      K and V; KV heads shared out over the tp / dcp
                                                      head groups, replicated when fewer than that
        N = floor(B / b) x dcp                        DCP splits each request's tokens over dcp ranks

    ``budget_bytes_per_gpu`` is ``B`` (the caller works it out per engine). The estimate is an upper
    bound: activations, CUDA graphs, non-torch memory (unless given as ``R``), the draft model's
    weights and KV, sliding-window layers and linear-attention / SSM state are not counted.
    """
    layout = kv_layout(config)
    dtype = kv_dtype_bytes(kv_cache_dtype, layout)
    tp = max(1, tp)
    dcp = max(1, dcp)
    if layout.kind == "mla":
        per_layer = (layout.latent_dim or 0) * dtype
    else:
        groups = max(1, tp // dcp)
        per_layer = 2 * math.ceil((layout.kv_heads or 1) / groups) * (layout.head_dim or 0) * dtype
    per_token = layout.attention_layers * per_layer
    tokens = int(max(0.0, budget_bytes_per_gpu) // per_token) * dcp if per_token > 0 else 0
    return KVEstimate(
        tokens=tokens,
        budget_bytes_per_gpu=budget_bytes_per_gpu,
        bytes_per_token_per_gpu=per_token,
        dtype_bytes=dtype,
        tp=tp,
        dcp=dcp,
        layout=layout,
    )
