"""A DeepSeek-V3-style model with random weights: MLA attention and routed experts with a shared expert.

The MLA + MoE layout of the study's model family (Kimi-K2's and DeepSeek-V3's; Kimi-K3 adds
linear-attention layers, which this model has not): multi-head latent attention (one latent of
``kv_lora_rank + qk_rope_head_dim`` elements per token and layer is all the KV cache holds) and MoE
layers of ``n_routed_experts`` experts, ``num_experts_per_tok`` of them per token, plus one shared
expert every token goes through. scripts/make_random_llama.py builds it for
``--preset mla-moe`` (and ``mla-tiny`` for tests); this module holds the shapes, the config, the
parameter count and the one step transformers does not do for us:

- **Per-expert weight names.** transformers 5 keeps a layer's experts fused in two tensors
  (``mlp.experts.gate_up_proj`` [E, 2I, H] and ``mlp.experts.down_proj`` [E, H, I]); whether
  ``save_pretrained`` splits them back depends on its version (5.17, the node's, saved them fused on
  the first try; 5.19 splits them). vLLM and SGLang load per-expert names
  (``mlp.experts.{e}.{gate,up,down}_proj.weight``: vLLM 0.22.0 model_executor/models/deepseek_v2.py:1362
  ``fused_moe_make_expert_params_mapping(ckpt_gate_proj_name="gate_proj", ...)``, SGLang 0.5.16
  srt/models/deepseek_common/deepseek_weight_loader.py:178), so :func:`split_experts` writes them so
  whatever transformers does, and the weights are saved by safetensors directly.
- **The routing keys.** transformers' ``DeepseekV3Config`` has no ``topk_method``, ``scoring_func``
  or ``moe_layer_freq`` of its own; both engines read them from config.json (:data:`ROUTING`).

The weights are drawn with ``torch.manual_seed(seed)`` on the GPU when there is one, normal(0, 0.02)
(RMSNorm weights 1, the routing bias 0) explicitly, whatever transformers' own init does, and checked
finite: a NaN would reach the engines' samplers. Latency and throughput depend on the shapes, not on
these values; the router's picks on random weights are spread over the experts about evenly.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "ARCHITECTURE",
    "MLA_PRESETS",
    "ROUTING",
    "build",
    "config_json",
    "config_kwargs",
    "describe",
    "kv_bytes_per_token",
    "parameter_count",
    "split_experts",
]

ARCHITECTURE = "DeepseekV3ForCausalLM"

# The shapes a preset sets (each can be overridden from make_random_llama.py's flags).
MLA_PRESETS: dict[str, dict[str, int]] = {
    # The study in miniature (docs/gpu.md, "The study in miniature on one GPU"): the per-layer MLA of the
    # family (kv_lora_rank 512 + rope 64: 576 KV elements per token and layer; q_lora_rank 1536; heads
    # of 128 + 64 for q/k and 128 for v), 16 heads (DeepSeek-V3's 128 at TP 8: the per-GPU attention the
    # engines' MLA kernels are most used at), 64 routed experts, 8 per token, 1 shared, 4 layers, all MoE.
    # Hidden 1280 and expert width 640: one decode step at 10 x 200K reads about 5x more KV than expert
    # weights, as each GPU of the study's vLLM (TP 8, no DCP) did; and E=64, N=640 is a shape both
    # engines ship tuned fused-MoE configs for on H100 and H200 (vLLM 0.22.0
    # fused_moe/configs/E=64,N=640,device_name=NVIDIA_H100_80GB_HBM3.json and NVIDIA_H200.json; SGLang
    # 0.5.16 moe_runner/triton_utils/configs/triton_3_1_0/, which it falls back to under Triton 3.6).
    # 693.1 M parameters (1.39 GB of bf16); 2,304 B of fp8 KV per token (4 x 576): 10 x 203K tokens
    # are 4.7 GB, and 262,144 positions cover the study's 204,800-token context.
    "mla-moe": {
        "hidden_size": 1280,
        "num_hidden_layers": 4,
        "num_attention_heads": 16,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 64,
        "num_experts_per_tok": 8,
        "n_shared_experts": 1,
        "moe_intermediate_size": 640,
        "max_position_embeddings": 262144,
    },
    # For tests: the same structure at a size a CPU builds in seconds, the family's MLA dims kept (the
    # MLA kernels take a latent of 512 + 64 only: vLLM's CPU backend refuses any other)
    "mla-tiny": {
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "q_lora_rank": 128,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "moe_intermediate_size": 64,
        "max_position_embeddings": 262144,
    },
}

# Keys config.json must hold for the engines' DeepSeek-V3 routing, with where each engine reads them:
# vLLM 0.22.0 model_executor/models/deepseek_v2.py and SGLang 0.5.16 srt/models/deepseek_v2.py.
ROUTING: dict[str, Any] = {
    # vLLM :278 loads gate.e_score_correction_bias only for "noaux_tc" (the checkpoint has it, so any
    # other value fails the load); SGLang :454 reads config.topk_method with no default
    "topk_method": "noaux_tc",
    # vLLM :340 getattr(config, "scoring_func", "softmax"): without the key vLLM routes by softmax
    # where SGLang :669 (config.scoring_func, no default) cannot start
    "scoring_func": "sigmoid",
    # vLLM :337-338 and SGLang :666-668: Kimi's grouping (one group; DeepSeek-V3 has 8 and 4)
    "n_group": 1,
    "topk_group": 1,
    # vLLM :334 renormalize, SGLang :664
    "norm_topk_prob": True,
    # vLLM :257 and SGLang :556 (Kimi-K2's value; DeepSeek-V3's is 2.5)
    "routed_scaling_factor": 2.827,
    # every layer MoE: vLLM :1131-1132 and SGLang :2194-2195 (moe_layer_freq read with no default there)
    "first_k_dense_replace": 0,
    "moe_layer_freq": 1,
    # no multi-token-prediction layer: vLLM :1739 and SGLang's loader would look for model.layers.4.*
    "num_nextn_predict_layers": 0,
    "hidden_act": "silu",  # vLLM :267 and SGLang :600 refuse anything else
    # untied: both engines build lm_head as a parameter of its own and load it by name
    "tie_word_embeddings": False,
    # plain RoPE, no YaRN (nothing of the latency depends on the scaling; vLLM :495 and SGLang :2061
    # read rope_parameters); Kimi-K2's theta
    "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0},
}

_INIT_STD = 0.02


def _check_shape(shape: Mapping[str, int]) -> None:
    if shape["num_experts_per_tok"] > shape["n_routed_experts"]:
        raise SystemExit(
            f"num_experts_per_tok ({shape['num_experts_per_tok']}) exceeds n_routed_experts "
            f"({shape['n_routed_experts']}): lower --experts-per-token or raise --experts"
        )
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "n_routed_experts"):
        if shape[key] <= 0:
            raise SystemExit(f"{key} must be positive, not {shape[key]}")


def config_kwargs(shape: Mapping[str, int], vocab: int) -> dict[str, Any]:
    """The ``DeepseekV3Config`` arguments of ``shape``: the shape, :data:`ROUTING`, bf16, MHA-style
    head count for the latent's up-projection (``num_key_value_heads`` = heads, as DeepSeek-V3's), and
    a dense ``intermediate_size`` that no layer uses (every layer is MoE) set to the routed width a
    token sees, so the number says something."""
    _check_shape(shape)
    return {
        "vocab_size": vocab,
        **shape,
        "num_key_value_heads": shape["num_attention_heads"],
        "intermediate_size": shape["moe_intermediate_size"]
        * (shape["num_experts_per_tok"] + shape["n_shared_experts"]),
        **ROUTING,
        "dtype": "bfloat16",
    }


def config_json(shape: Mapping[str, int], vocab: int) -> dict[str, Any]:
    """What config.json holds as far as k3pipe and the engines read it (no torch or transformers
    needed): the keys above plus the architecture, model type and dtype. The tests' stand-in for the
    file the node writes."""
    cfg = config_kwargs(shape, vocab)
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "deepseek_v3",
        **cfg,
        "torch_dtype": "bfloat16",
    }


def parameter_count(shape: Mapping[str, int], vocab: int) -> int:
    """Parameters of the model (biases off; the routing bias is a buffer, not counted here: it is
    ``n_routed_experts`` fp32 numbers per layer in the checkpoint beside these)."""
    h, heads = shape["hidden_size"], shape["num_attention_heads"]
    q_lora, kv_lora = shape["q_lora_rank"], shape["kv_lora_rank"]
    nope, rope, v = shape["qk_nope_head_dim"], shape["qk_rope_head_dim"], shape["v_head_dim"]
    attention = (
        h * q_lora  # q_a_proj
        + q_lora  # q_a_layernorm
        + q_lora * heads * (nope + rope)  # q_b_proj
        + h * (kv_lora + rope)  # kv_a_proj_with_mqa
        + kv_lora  # kv_a_layernorm
        + kv_lora * heads * (nope + v)  # kv_b_proj
        + heads * v * h  # o_proj
    )
    experts, width = shape["n_routed_experts"], shape["moe_intermediate_size"]
    moe = experts * h + experts * 3 * h * width + 3 * h * width * shape["n_shared_experts"]
    per_layer = attention + moe + 2 * h  # two RMSNorm weights
    return 2 * vocab * h + shape["num_hidden_layers"] * per_layer + h  # embeddings, lm_head, final norm


def kv_bytes_per_token(shape: Mapping[str, int], dtype_bytes: int) -> int:
    """Bytes of KV cache one token takes over all layers: one latent of kv_lora_rank + qk_rope_head_dim
    per layer (what k3pipe.engines.kvpool's MLA layout says, and what vLLM's MLA page holds per token)."""
    return shape["num_hidden_layers"] * (shape["kv_lora_rank"] + shape["qk_rope_head_dim"]) * dtype_bytes


def split_experts(state: Mapping[str, Any], experts: int) -> dict[str, Any]:
    """``state`` with every layer's fused expert tensors replaced by per-expert ones, as the engines load
    them: ``mlp.experts.gate_up_proj`` [E, 2I, H] -> ``mlp.experts.{e}.gate_proj.weight`` (rows ``:I``)
    and ``.up_proj.weight`` (rows ``I:``), transformers' ``chunk(2)`` order; ``mlp.experts.down_proj``
    [E, H, I] -> ``mlp.experts.{e}.down_proj.weight``. Per-expert names already there are kept; any
    other tensor is passed through. Each slice is cloned: safetensors refuses tensors sharing memory."""
    out: dict[str, Any] = {}
    for name, tensor in state.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name.removesuffix("gate_up_proj")
            if tensor.shape[0] != experts or tensor.shape[1] % 2:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} is not [{experts}, 2 x I, H]")
            width = tensor.shape[1] // 2
            for e in range(experts):
                out[f"{prefix}{e}.gate_proj.weight"] = tensor[e, :width].clone()
                out[f"{prefix}{e}.up_proj.weight"] = tensor[e, width:].clone()
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            if tensor.shape[0] != experts:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} is not [{experts}, H, I]")
            for e in range(experts):
                out[f"{prefix}{e}.down_proj.weight"] = tensor[e].clone()
        else:
            out[name] = tensor
    return out


def _init_weights(model: Any) -> None:
    """Every weight drawn here, not by transformers' init (which differs between its versions and
    leaves ``torch.empty`` tensors where it skips one)."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, _INIT_STD)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.zero_()


def build(tmp: Path, shape: Mapping[str, int], vocab: int, special_ids: Mapping[str, int], seed: int,
          device: str) -> dict[str, Any]:  # fmt: skip
    """Draw the model on ``device`` and write it into ``tmp`` (which already holds the tokenizer):
    model.safetensors with per-expert names (bf16, the routing bias fp32) and config.json. Returns what
    the marker records. Raises SystemExit naming the routing key transformers did not write, or the
    tensor that is not finite."""
    import torch
    from safetensors.torch import save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    t0 = time.perf_counter()
    config = DeepseekV3Config(**config_kwargs(shape, vocab), **special_ids)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = DeepseekV3ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    _init_weights(model)
    if device == "cuda":
        torch.cuda.synchronize()
    params = sum(p.numel() for p in model.parameters())
    t_init = time.perf_counter()
    print(f"  {params:,} parameters drawn on {device} in {t_init - t0:.1f} s", flush=True)

    fused = [n for n in model.state_dict() if n.endswith((".experts.gate_up_proj", ".experts.down_proj"))]
    tensors: dict[str, Any] = {}
    for name, tensor in split_experts(model.state_dict(), shape["n_routed_experts"]).items():
        if name.endswith("rotary_emb.inv_freq"):
            continue  # recomputed by the engines, never loaded
        wanted = torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16
        tensor = tensor.detach().to(device="cpu", dtype=wanted).contiguous()
        if not bool(torch.isfinite(tensor).all()):
            raise SystemExit(f"{name} holds non-finite values after the init: not saving this model")
        tensors[name] = tensor
    del model
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    t_save = time.perf_counter()
    print(
        f"  {len(tensors):,} tensors ({len(fused)} fused expert tensors split per expert) written in "
        f"{t_save - t_init:.1f} s",
        flush=True,
    )

    config.save_pretrained(tmp)
    cfg_path = tmp / "config.json"
    cfg = json.loads(cfg_path.read_text())
    dropped = [key for key in ROUTING if key not in cfg]
    if dropped:
        raise SystemExit(
            f"transformers {_transformers_version()} did not write {', '.join(dropped)} into config.json: "
            "the engines read them for the routing (scripts/random_mla.py ROUTING)"
        )
    cfg["architectures"] = [ARCHITECTURE]
    # transformers 5 writes "dtype"; older readers look for "torch_dtype": say both
    cfg["dtype"] = cfg["torch_dtype"] = "bfloat16"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return {
        "architecture": ARCHITECTURE,
        "parameters": params,
        "parameters_expected": parameter_count(shape, vocab),
        "tensors": len(tensors),
        "routing_bias_numbers": shape["num_hidden_layers"] * shape["n_routed_experts"],
        "fused_expert_tensors_split": len(fused),
        "kv_bytes_per_token": {
            "fp8": kv_bytes_per_token(shape, 1),
            "bf16": kv_bytes_per_token(shape, 2),
        },
        "config": {key: cfg[key] for key in sorted(set(ROUTING) | set(shape)) if key in cfg},
        "transformers": _transformers_version(),
        "build_s": round(t_save - t0, 2),
    }


def _transformers_version() -> str:
    import transformers

    return str(transformers.__version__)


def _gib(n_bytes: float) -> str:
    return f"{n_bytes / 2**30:.2f} GiB"


def describe(shape: Mapping[str, int], vocab: int) -> str:
    """One line for the build's log: parameters, weights and the KV a token takes."""
    params = parameter_count(shape, vocab)
    return (
        f"{params:,} parameters ({_gib(2 * params)} of bf16), "
        f"KV per token {kv_bytes_per_token(shape, 1):,} B fp8 / {kv_bytes_per_token(shape, 2):,} B bf16, "
        f"{shape['max_position_embeddings']:,} positions; "
        f"10 x 203K tokens of fp8 KV = {_gib(10 * 203_000 * kv_bytes_per_token(shape, 1))}"
    )
