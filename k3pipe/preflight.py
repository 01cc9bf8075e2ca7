"""Preflight: what an experiment will run into, found before a cold start of ten minutes is spent.

:func:`preflight` runs the generic rules of this module and each engine module's own rules
(:meth:`k3pipe.engines.base.Engine.preflight_rules`) over every arm, and returns
:class:`~k3pipe.engines.base.Finding` records: ``error`` (the run cannot work), ``warning`` (it
will run and mislead or fail under load) and ``info``.

Generic rules:

- ``managed-flag`` (error): an argument k3pipe sets itself (model, served name, host, port).
- ``bad-value`` (error): an integer argument the engine's own parser would refuse.
- ``unknown-flag`` (warning): not a flag of the stock engine version the module was written for.
- ``workload-length`` (error): a workload's input + output exceeds the context length.
- ``kv-capacity`` (warning) / ``kv-capacity-skipped`` (info): the estimated KV pool
  (:func:`estimate_kv_pool`) below the context length, or below what a workload holds at once
  (an error when the weights leave no memory for it at all).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from k3pipe.engines import get_engine
from k3pipe.engines.base import ArmContext, Finding, Rule, Severity
from k3pipe.errors import SpecError
from k3pipe.specs import ExperimentSpec

__all__ = [
    "Finding",
    "KVEstimate",
    "KVLayout",
    "Severity",
    "estimate_kv_pool",
    "kv_dtype_bytes",
    "kv_layout",
    "preflight",
    "read_model_config",
    "safetensors_bytes",
]

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
            + f" = {self.tokens:,} tokens"
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


def read_model_config(path: str | Path) -> dict[str, Any] | None:
    """config.json of a model directory, or the file itself (None when absent)."""
    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text())
    except ValueError as exc:
        raise SpecError(f"{file}: not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise SpecError(f"{file}: a model config must be a JSON object")
    return data


def safetensors_bytes(model_dir: str | Path) -> int | None:
    """Total size of the ``*.safetensors`` files in a model directory (None when there are none)."""
    p = Path(model_dir)
    if not p.is_dir():
        return None
    sizes = [f.stat().st_size for f in p.rglob("*.safetensors") if f.is_file()]
    return sum(sizes) if sizes else None


# -- generic rules --------------------------------------------------------------------------------


def rule_managed_flags(ctx: ArmContext) -> Iterator[Finding]:
    try:
        ctx.engine.check_args(ctx.args)
    except SpecError as exc:
        yield ctx.finding("error", "managed-flag", str(exc))


def rule_bad_values(ctx: ArmContext) -> Iterator[Finding]:
    engine = ctx.engine
    for name in (engine.tp_arg, engine.pp_arg, engine.dcp_arg, engine.context_length_arg, *engine.int_args):
        found = engine.arg(ctx.args, name)
        if found is None:
            continue
        try:
            if name == engine.context_length_arg:
                engine.context_length(ctx.args)
            else:
                engine.int_arg(ctx.args, name)
        except ValueError as exc:
            yield ctx.finding("error", "bad-value", f"{found[0]}={found[1]!r}: {exc}")


def rule_unknown_flags(ctx: ArmContext) -> Iterator[Finding]:
    engine = ctx.engine
    table = engine.flag_table()
    if table is None:
        return
    declared = ctx.arm.engine.version
    version_note = (
        f" (this arm declares version {declared})" if declared and declared != engine.stock_version else ""
    )
    for key in ctx.args:
        flag = engine.flag_of(str(key))
        if flag in table.flags:
            continue
        short = "-" + str(key).lstrip("-")  # e.g. 'dcp': vLLM knows -dcp, not --dcp
        prefixed = [f for f in engine.flag_suggestions(str(key)) if f.startswith(flag)]
        if short in table.canonical:
            alias = table.canonical[short]
            hint = f" It means {alias} only as {short}; write {alias.lstrip('-').replace('-', '_')}."
        elif len(prefixed) == 1:
            hint = f" argparse reads it as an abbreviation of {prefixed[0]}; spell the full name."
        elif prefixed:
            hint = f" argparse refuses it as ambiguous ({', '.join(prefixed)} start with it)."
        else:
            close = engine.flag_suggestions(str(key))
            hint = f" Did you mean {' or '.join(close)}?" if close else ""
        yield ctx.finding(
            "warning",
            "unknown-flag",
            f"engine.args.{key} renders {flag}, which is not a flag of {engine.stock_label}{version_note} "
            f"({table.source}); fine if your image adds it.{hint}",
        )


def _context(ctx: ArmContext) -> tuple[int, str] | None:
    """The context length in force and where it comes from (declared, else config.json)."""
    engine = ctx.engine
    try:
        declared = engine.context_length(ctx.args)
    except ValueError:
        return None  # reported by rule_bad_values
    if declared is not None:
        found = engine.arg(ctx.args, engine.context_length_arg)
        key = found[0] if found else engine.context_length_arg
        return declared, f"{key}={declared:,}"
    if ctx.model_config is not None:
        cfg = _text_config(ctx.model_config)
        mpe = cfg.get("max_position_embeddings")
        if isinstance(mpe, int) and mpe > 0:
            return mpe, f"{engine.context_length_arg} unset, so config.json max_position_embeddings={mpe:,}"
    return None


def rule_workload_length(ctx: ArmContext) -> Iterator[Finding]:
    context = _context(ctx)
    if context is None:
        return
    length, source = context
    for w in ctx.experiment.workloads:
        need = w.input_tokens + w.output_tokens
        if need > length:
            yield ctx.finding(
                "error",
                "workload-length",
                f"workload {w.name}: input_tokens {w.input_tokens:,} + output_tokens {w.output_tokens:,} "
                f"= {need:,} exceeds the context length ({source}) by {need - length:,} tokens: every "
                f"request is refused. Raise the context length to at least {need:,} or shorten the workload.",
            )


def _kv_estimate(ctx: ArmContext, reserve_bytes_per_gpu: float) -> tuple[KVEstimate, str] | Finding | None:
    """The arm's KV estimate, or an INFO finding saying why there is none (None: skipped for the
    whole experiment, reported once by :func:`preflight`)."""
    engine = ctx.engine
    hardware = ctx.experiment.hardware
    if ctx.model_config is None or hardware is None or ctx.weight_bytes is None:
        return None
    args = ctx.args
    tp = engine.tensor_parallel_size(args)
    pp = engine.pipeline_parallel_size(args)
    dcp = engine.decode_context_parallel_size(args)
    weights_per_gpu = ctx.weight_bytes / (tp * pp)
    try:
        budget = engine.kv_budget_bytes_per_gpu(args, hardware.gpu_memory_gib * GiB, weights_per_gpu)
    except ValueError as exc:
        return ctx.finding("info", "kv-capacity-skipped", f"KV pool not estimated: {exc}.")
    if budget is None:
        return ctx.finding(
            "info",
            "kv-capacity-skipped",
            f"{engine.memory_fraction_arg} is not set, so {engine.display_name} sizes its memory at "
            f"start-up and the KV pool cannot be estimated; set {engine.memory_fraction_arg} to check it.",
        )
    bytes_, how = budget
    if reserve_bytes_per_gpu:
        bytes_ -= reserve_bytes_per_gpu
        how += f" - {reserve_bytes_per_gpu / GiB:.2f} GiB reserve = {bytes_ / GiB:.2f} GiB"
    try:
        estimate = estimate_kv_pool(
            ctx.model_config,
            kv_cache_dtype=engine.kv_cache_dtype(args),
            tp=tp,
            dcp=dcp,
            budget_bytes_per_gpu=bytes_,
        )
    except ValueError as exc:
        return ctx.finding("info", "kv-capacity-skipped", f"KV pool not estimated: {exc}.")
    return estimate, how


def _kv_rule(reserve_bytes_per_gpu: float) -> Rule:
    def rule_kv_capacity(ctx: ArmContext) -> Iterator[Finding]:
        result = _kv_estimate(ctx, reserve_bytes_per_gpu)
        if result is None:
            return
        if isinstance(result, Finding):
            yield result
            return
        est, how = result
        engine = ctx.engine
        if est.budget_bytes_per_gpu <= 0:
            yield ctx.finding(
                "error",
                "kv-capacity",
                f"no memory is left for the KV cache: KV budget per GPU {how}. The engine cannot start"
                + (
                    f" ({engine.display_name}: '{engine.no_kv_memory_error}')"
                    if engine.no_kv_memory_error
                    else ""
                )
                + "; raise the memory fraction or spread the weights over more GPUs.",
            )
            return
        basis = f"Estimate (an upper bound): KV budget per GPU {how}; {est.explain()}."
        fixes = "; ".join(engine.kv_pool_fixes(ctx.args)) or "give the KV pool more memory"
        context = _context(ctx)
        if context is not None and est.tokens < context[0]:
            length, source = context
            short = length - est.tokens
            yield ctx.finding(
                "warning",
                "kv-capacity",
                f"estimated KV pool ~{est.tokens:,} tokens is {short:,} tokens ({short / length:.1%}) short "
                f"of the context length ({source}): one full-length request cannot fit; "
                f"{engine.kv_shortfall_consequence}. Fix: {fixes}. {basis}",
            )
        for w in ctx.experiment.workloads:
            per_request = w.input_tokens + w.output_tokens
            need = per_request * w.concurrency
            if est.tokens < need:
                fits = est.tokens // per_request
                yield ctx.finding(
                    "warning",
                    "kv-capacity",
                    f"workload {w.name} holds (input {w.input_tokens:,} + output {w.output_tokens:,}) x "
                    f"concurrency {w.concurrency} = {need:,} KV tokens at once, but the estimated pool "
                    f"holds ~{est.tokens:,}: only {fits} of its {w.concurrency} requests fit at a time, the "
                    "rest queue or get preempted, so latencies include waiting. Fix: lower the "
                    f"concurrency to {max(fits, 1)}, or {fixes}. {basis}",
                )

    return rule_kv_capacity


def rule_unpinned_models(ctx: ArmContext) -> Iterator[Finding]:
    for path, value in ctx.engine.unpinned_models(ctx.args):
        yield ctx.finding(
            "warning",
            "unpinned-model",
            f"engine.args.{path} names {value!r}, which the engine loads itself: k3pipe neither pins "
            "its revision nor hashes its files, so the run record cannot prove what was served and a "
            "rerun refuses it (unless --allow-drift). Declare it under extra_models (source, id, "
            f"revision) and write '{{models.NAME}}' here.",
        )


_GENERIC_RULES: tuple[Rule, ...] = (
    rule_managed_flags,
    rule_bad_values,
    rule_unknown_flags,
    rule_workload_length,
    rule_unpinned_models,
)

_ORDER = {"error": 0, "warning": 1, "info": 2}


def _shared_prompts(spec: ExperimentSpec) -> list[Finding]:
    """Workloads of one arm that would send the same prompts: the same dataset and length, and seed
    ranges (``seed`` .. ``seed + repeats - 1``) that overlap. The engine's prefix cache then serves
    the later one from the earlier one's KV, and its TTFT is not a cold prefill."""
    findings: list[Finding] = []
    workloads = spec.workloads
    for i, a in enumerate(workloads):
        for b in workloads[i + 1 :]:
            if a.dataset != b.dataset or a.input_tokens != b.input_tokens:
                continue
            if a.dataset.kind in ("sharegpt", "documents"):
                # samples of one pool: any two draws overlap, whatever their seeds
                message = (
                    f"workloads {a.name} and {b.name} sample prompts from the same "
                    f"{a.dataset.kind} data ({a.dataset.path}) with the same input_tokens: some "
                    f"prompts will repeat, and the prefix cache would answer {b.name}'s repeats "
                    f"from {a.name}'s. Merge them into one workload with repeats (repeats "
                    "never resend a prompt), or give them different data."
                )
            else:
                seeds = set(range(a.seed, a.seed + a.repeats)) & set(range(b.seed, b.seed + b.repeats))
                if not seeds:
                    continue
                message = (
                    f"workloads {a.name} and {b.name} draw the same {a.dataset.kind} prompts of "
                    f"{a.input_tokens:,} tokens with seed(s) {', '.join(map(str, sorted(seeds)))}: the "
                    f"prefix cache would answer {b.name}'s prompts from {a.name}'s. Give them seeds "
                    f"at least `repeats` apart (e.g. {b.name}.seed: {a.seed + a.repeats + 100})."
                )
            findings.append(Finding(severity="warning", rule="shared-prompts", arm=None, message=message))
    return findings


def _skipped_kv(
    spec: ExperimentSpec, config: Mapping[str, Any] | None, weight_bytes: int | None
) -> Finding | None:
    missing: list[str] = []
    if config is None:
        missing.append(
            "the model's config.json (download the model, or pass --model-config PATH / "
            "model_configs={'model': {...}})"
        )
    if weight_bytes is None:
        missing.append(
            "the size of the weights (the model directory's *.safetensors, or --weights-gib / weight_bytes=)"
        )
    if spec.hardware is None:
        missing.append("the experiment's hardware: section (gpu_name, gpu_count, gpu_memory_gib)")
    if not missing:
        return None
    return Finding(
        severity="info",
        rule="kv-capacity-skipped",
        arm=None,
        message="KV capacity check skipped: it needs " + "; ".join(missing) + ".",
    )


def preflight(
    spec: ExperimentSpec,
    model_configs: Mapping[str, Mapping[str, Any]] | None = None,
    *,
    model_dir: str | Path | None = None,
    weight_bytes: int | None = None,
    reserve_gib_per_gpu: float = 0.0,
    extra_rules: Iterable[Rule] = (),
) -> list[Finding]:
    """Check ``spec`` before anything is launched.

    ``model_configs["model"]`` is the model's config.json as a dict; without it, ``model_dir`` (if
    given) supplies config.json. ``weight_bytes`` is the total size of the weights; without it, the
    ``*.safetensors`` under ``model_dir``. ``reserve_gib_per_gpu`` is memory per GPU the KV estimate
    keeps back for activations and CUDA graphs (default 0: an upper bound). Findings come arm by arm
    (experiment-wide ones first), errors before warnings before infos.
    """
    config = dict((model_configs or {}).get("model") or {}) or None
    if config is None and model_dir is not None:
        config = read_model_config(model_dir)
    if weight_bytes is None and model_dir is not None:
        weight_bytes = safetensors_bytes(model_dir)

    findings: list[Finding] = []
    skipped = _skipped_kv(spec, config, weight_bytes)
    if skipped is not None:
        findings.append(skipped)
    findings.extend(_shared_prompts(spec))
    rules = (*_GENERIC_RULES, _kv_rule(reserve_gib_per_gpu * GiB), *extra_rules)
    for arm in spec.arms:
        engine = get_engine(arm.engine.kind)
        ctx = ArmContext(
            experiment=spec, arm=arm, engine=engine, model_config=config, weight_bytes=weight_bytes
        )
        found: list[Finding] = []
        for rule in (*rules, *engine.preflight_rules()):
            found.extend(rule(ctx))
        findings.extend(sorted(found, key=lambda f: _ORDER[f.severity]))
    return findings
