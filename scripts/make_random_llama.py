"""Build a Llama-shaped model of realistic size with random weights (bf16), no hub needed.

Throughput and latency depend on a model's shapes, not on its weight values, so a random-weight model
of the right shape stands in for a real one on a node that cannot download anything. The tokenizer
is the tiny demo model's (scripts/make_tiny_model.py: byte-level BPE, vocab 2048, ChatML template);
the vocabulary stays 2048, so the model's vocab matches its tokenizer and every sampled id decodes.

    python3 scripts/make_random_llama.py OUT_DIR [--preset 1b] [--layers N ...] [--device auto]

Presets (override any dimension with its flag):
    1b    hidden 2048, 16 layers, 32 heads of 64, 8 KV heads, intermediate 8192, 8192 positions,
          tied embeddings: 0.977 B parameters, 1.95 GB of bf16 (the shape of a ~1B Llama 3.2,
          with a 2048-token vocabulary)
    mqa-7b  hidden 4096, 32 layers, 32 heads of 128, ONE KV head (MQA), intermediate 14336,
          262144 positions: 6.75 B parameters, 13.5 GB of bf16 (a Llama-3-8B body with multi-query
          attention and a 2048-token vocabulary). The decode-context-parallel model: vLLM runs DCP on a
          GQA/MQA model only when tp > KV heads, dcp <= tp // KV heads and the query heads per KV head
          divide by dcp (0.22.0 config/model.py:1216-1239), so DCP = TP = 8 needs exactly one KV head;
          under TP that one head is replicated on every GPU, as an MLA model's latent is (the study's
          Kimi-K3), and DCP is what splits it. 16 KiB of bf16 KV per token; 256K positions for the
          200K-token workloads of experiments/dcp-crossover-h200.yaml.
    tiny  hidden 256, 2 layers, 4 heads of 64, 2 KV heads, intermediate 512 (for tests)
    mla-moe  a DeepSeek-V3-style model (scripts/random_mla.py): multi-head latent attention
          (kv_lora_rank 512 + qk_rope_head_dim 64: 576 KV elements per token and layer), 4 layers of
          64 routed experts (8 per token, width 640) and 1 shared expert, hidden 1280, 16 heads,
          262144 positions: 693.1 M parameters, 1.39 GB of bf16, 2,304 B of fp8 KV per token. The
          study's architecture in miniature (docs/gpu.md, "The study in miniature on one GPU").
          Its flags: --hidden, --layers, --heads, --max-positions, --experts, --experts-per-token,
          --moe-intermediate.
    mla-tiny  the same structure at a CPU test's size

The weights are drawn on the GPU when there is one (``--device auto``), with ``torch.manual_seed(seed)``,
directly in bf16, then saved as safetensors; config.json says ``dtype``/``torch_dtype`` bfloat16.
OUT_DIR is written through a temporary directory renamed into place (complete or absent); a second
call with the same shape and seed finds it (``k3pipe-random-llama.json``) and does nothing.
Needs torch, transformers and tokenizers (the GPU node's python3 has them).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_tiny_model  # the sibling script: tokenizer and publishing
import random_mla  # the sibling module: the DeepSeek-V3-style (MLA + MoE) presets

MARKER = "k3pipe-random-llama.json"

PRESETS: dict[str, dict[str, int]] = {
    "1b": {
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "intermediate_size": 8192,
        "max_position_embeddings": 8192,
    },
    "mqa-7b": {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 1,
        "head_dim": 128,
        "intermediate_size": 14336,
        "max_position_embeddings": 262144,
    },
    "tiny": {
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "intermediate_size": 512,
        "max_position_embeddings": 8192,
    },
}
_FLAGS = {
    "hidden": "hidden_size",
    "layers": "num_hidden_layers",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "intermediate": "intermediate_size",
    "max_positions": "max_position_embeddings",
}
# The flags of the MLA presets (random_mla.MLA_PRESETS); the MLA head dims and ranks stay the preset's.
_MLA_FLAGS = {
    "hidden": "hidden_size",
    "layers": "num_hidden_layers",
    "heads": "num_attention_heads",
    "max_positions": "max_position_embeddings",
    "experts": "n_routed_experts",
    "experts_per_token": "num_experts_per_tok",
    "moe_intermediate": "moe_intermediate_size",
}
ALL_PRESETS = sorted(PRESETS) + sorted(random_mla.MLA_PRESETS)


def is_mla(preset: str) -> bool:
    """Whether ``preset`` is a DeepSeek-V3-style (MLA + MoE) one rather than a Llama."""
    return preset in random_mla.MLA_PRESETS


def parameter_count(shape: dict[str, int], vocab: int = make_tiny_model.VOCAB) -> int:
    """Parameters of a LlamaForCausalLM of ``shape`` with tied embeddings (no biases)."""
    h, d = shape["hidden_size"], shape["head_dim"]
    q = shape["num_attention_heads"] * d
    kv = shape["num_key_value_heads"] * d
    attention = h * q + 2 * h * kv + q * h
    mlp = 3 * h * shape["intermediate_size"]
    per_layer = attention + mlp + 2 * h  # two RMSNorm weights
    return vocab * h + shape["num_hidden_layers"] * per_layer + h  # embeddings (tied) + final norm


def resolve_shape(preset: str, overrides: dict[str, int | None]) -> dict[str, int]:
    """The preset's shape with the flags given; a flag the preset's kind has no use for is refused
    (naming the flags it takes) rather than ignored."""
    flags = _MLA_FLAGS if is_mla(preset) else _FLAGS
    foreign = sorted(f for f, v in overrides.items() if v is not None and f not in flags)
    if foreign:
        raise SystemExit(
            f"--preset {preset} takes no {', '.join('--' + f.replace('_', '-') for f in foreign)}; "
            f"its flags: {', '.join('--' + f.replace('_', '-') for f in flags)}"
        )
    if is_mla(preset):
        shape = dict(random_mla.MLA_PRESETS[preset])
        for flag, key in _MLA_FLAGS.items():
            value = overrides.get(flag)
            if value is not None:
                shape[key] = value
        random_mla.config_kwargs(shape, make_tiny_model.VOCAB)  # refuses an impossible shape
        return shape
    shape = dict(PRESETS[preset])
    for flag, key in _FLAGS.items():
        value = overrides.get(flag)
        if value is not None:
            shape[key] = value
    if shape["num_attention_heads"] % shape["num_key_value_heads"]:
        raise SystemExit(
            f"heads ({shape['num_attention_heads']}) must be a multiple of kv heads "
            f"({shape['num_key_value_heads']})"
        )
    return shape


def _pick_device(choice: str) -> str:
    import torch

    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no GPU")
    return choice


def build(out: Path, shape: dict[str, int], seed: int, device: str) -> dict[str, Any]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=".random-llama-", dir=out.parent))
    try:
        fast = make_tiny_model.build_tokenizer(tmp)
        t_tok = time.perf_counter()
        print(f"  tokenizer trained and saved in {t_tok - t0:.1f} s", flush=True)

        config = LlamaConfig(
            vocab_size=make_tiny_model.VOCAB,
            **shape,
            tie_word_embeddings=True,
            **make_tiny_model.special_token_ids(fast),
            dtype="bfloat16",
        )
        torch.manual_seed(seed)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device(device):
                model = LlamaForCausalLM(config)
        finally:
            torch.set_default_dtype(previous)
        if device == "cuda":
            torch.cuda.synchronize()
        t_init = time.perf_counter()
        params = sum(p.numel() for p in model.parameters())
        dtypes = sorted({str(p.dtype) for p in model.parameters()})
        print(
            f"  {params:,} parameters ({', '.join(dtypes)}) drawn on {device} in {t_init - t_tok:.1f} s",
            flush=True,
        )
        model = model.to("cpu")
        model.save_pretrained(tmp, safe_serialization=True)
        t_save = time.perf_counter()
        print(f"  safetensors written in {t_save - t_init:.1f} s", flush=True)

        cfg_path = tmp / "config.json"
        cfg = json.loads(cfg_path.read_text())
        # transformers 5 writes "dtype"; older readers look for "torch_dtype": say both
        cfg["dtype"] = cfg["torch_dtype"] = "bfloat16"
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        info = {
            "made_by": "scripts/make_random_llama.py",
            "vocab": make_tiny_model.VOCAB,
            "seed": seed,
            "shape": shape,
            "parameters": params,
            "dtype": "bfloat16",
            "device": device,
            "build_s": round(t_save - t0, 2),
            "weight_bytes": sum(f.stat().st_size for f in tmp.glob("*.safetensors")),
        }
        (tmp / MARKER).write_text(json.dumps(info, indent=2) + "\n")
        make_tiny_model.publish(tmp, out)
        return info
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build_mla(out: Path, preset: str, shape: dict[str, int], seed: int, device: str) -> dict[str, Any]:
    """A DeepSeek-V3-style model (random_mla.build) with the tiny model's tokenizer into ``out``,
    through a temporary directory renamed into place, its marker recording the config and the count."""
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=".random-llama-", dir=out.parent))
    try:
        fast = make_tiny_model.build_tokenizer(tmp)
        print(f"  tokenizer trained and saved in {time.perf_counter() - t0:.1f} s", flush=True)
        built = random_mla.build(
            tmp, shape, make_tiny_model.VOCAB, make_tiny_model.special_token_ids(fast), seed, device
        )
        info = {
            "made_by": "scripts/make_random_llama.py (scripts/random_mla.py)",
            "preset": preset,
            "vocab": make_tiny_model.VOCAB,
            "seed": seed,
            "shape": shape,
            "dtype": "bfloat16",
            "device": device,
            **built,
            "build_s": round(time.perf_counter() - t0, 2),
            "weight_bytes": sum(f.stat().st_size for f in tmp.glob("*.safetensors")),
        }
        (tmp / MARKER).write_text(json.dumps(info, indent=2) + "\n")
        make_tiny_model.publish(tmp, out)
        return info
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="model directory to write")
    p.add_argument("--preset", choices=ALL_PRESETS, default="1b")
    every_flag = dict.fromkeys([*_FLAGS, *_MLA_FLAGS])
    for flag in every_flag:
        p.add_argument(f"--{flag.replace('_', '-')}", dest=flag, type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--force", action="store_true", help="rebuild even when OUT already holds this shape")
    args = p.parse_args(argv)

    shape = resolve_shape(args.preset, {flag: getattr(args, flag) for flag in every_flag})
    out = args.out.resolve()
    marker = out / MARKER
    if marker.exists() and not args.force:
        found = json.loads(marker.read_text())
        if found.get("shape") == shape and found.get("seed") == args.seed:
            print(f"random model already at {out} ({found['parameters']:,} parameters)")
            return 0
    if is_mla(args.preset):
        print(
            f"building a random-weight DeepSeek-V3-style model (MLA + MoE) into {out}: {json.dumps(shape)}; "
            f"{random_mla.describe(shape, make_tiny_model.VOCAB)}",
            flush=True,
        )
        out.parent.mkdir(parents=True, exist_ok=True)
        info = build_mla(out, args.preset, shape, args.seed, _pick_device(args.device))
        if info["parameters"] != info["parameters_expected"]:
            print(
                f"warning: {info['parameters']:,} parameters, {info['parameters_expected']:,} expected",
                file=sys.stderr,
            )
        print(
            f"random MLA model written to {out}: {info['parameters']:,} parameters, "
            f"{info['weight_bytes'] / 1e9:.2f} GB bf16, {info['build_s']} s on {info['device']}"
        )
        return 0
    expected = parameter_count(shape)
    print(
        f"building a random-weight Llama into {out}: {json.dumps(shape)}, {expected:,} parameters expected",
        flush=True,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    info = build(out, shape, args.seed, _pick_device(args.device))
    if info["parameters"] != expected:
        print(f"warning: {info['parameters']:,} parameters, {expected:,} expected", file=sys.stderr)
    print(
        f"random llama written to {out}: {info['parameters']:,} parameters, "
        f"{info['weight_bytes'] / 1e9:.2f} GB bf16, {info['build_s']} s on {info['device']}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
