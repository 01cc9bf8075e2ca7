"""Build the tiny demo model deterministically (no hub needed).

A byte-level BPE tokenizer (vocab 2048) trained on the Python standard library's own sources, a ChatML
chat template, and a 2-layer LlamaForCausalLM with random weights (seed 0). vLLM serves it; its output
is gibberish, which is fine for measuring a pipeline.

Runs in the engine's venv (it needs torch and transformers):
    ENGINE_PYTHON scripts/make_tiny_model.py OUT_DIR
It writes into a temporary directory and renames it into place, so OUT_DIR is complete or absent.
scripts/make_random_llama.py builds larger models with the same tokenizer (build_tokenizer).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

VOCAB = 2048
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def corpus() -> list[str]:
    """The stdlib's top-level .py files, in a fixed order: the same text on every CPython 3.11."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [str(p) for p in sorted(stdlib.glob("*.py"))]


def build_tokenizer(directory: Path) -> Any:
    """Train the byte-level BPE tokenizer, save it (with the chat template) into ``directory`` and
    return it as a ``PreTrainedTokenizerFast``. Shared with scripts/make_random_llama.py."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(corpus(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    return fast


def special_token_ids(fast: Any) -> dict[str, int]:
    """The bos/eos/pad ids a model config takes from the tokenizer."""
    return {
        "bos_token_id": fast.convert_tokens_to_ids("<|endoftext|>"),
        "eos_token_id": fast.convert_tokens_to_ids("<|im_end|>"),
        "pad_token_id": fast.convert_tokens_to_ids("<|endoftext|>"),
    }


def publish(tmp: Path, out: Path) -> None:
    """Make ``tmp`` world-readable and rename it to ``out`` (replacing an older ``out``)."""
    tmp.chmod(0o755)
    for f in tmp.iterdir():
        f.chmod(0o644)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)


def build(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=out.parent))
    try:
        fast = build_tokenizer(tmp)

        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=64,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
            **special_token_ids(fast),
            torch_dtype="float32",
        )
        model = LlamaForCausalLM(config)
        model.save_pretrained(tmp, safe_serialization=True)
        (tmp / "k3pipe-tiny.json").write_text(
            json.dumps({"made_by": "scripts/make_tiny_model.py", "vocab": VOCAB, "seed": 0}) + "\n"
        )
        publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(sys.argv[1]).resolve()
    if (out / "config.json").exists() and (out / "k3pipe-tiny.json").exists():
        print(f"tiny model already at {out}")
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    build(out)
    print(f"tiny model written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
