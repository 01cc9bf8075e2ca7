"""A large-vocabulary tokenizer for the prompt-generation benchmark, trained here from CPython's stdlib.

The tiny model's tokenizer has 2K tokens; the study's models have 128K-164K (Llama-3 128K, Qwen
151K, Kimi K2 164K), where a generator's cost per token can differ (vocabulary scans, BPE cache
misses). No such tokenizer can be downloaded here, so one is trained: a byte-level BPE asked for
160K tokens on the standard library's own ``.py`` files (not site-packages), which gives about 123K.
The same Python gives the same corpus, so the same tokenizer; it takes about 10 s and is kept.

Run as a script to build it: ``python benchmarks/large_vocab.py [DIR]``.
"""

from __future__ import annotations

import json
import shutil
import sys
import sysconfig
from pathlib import Path

VOCAB = 160_000
# The tiny model's special tokens (scripts/make_tiny_model.py), so both tokenizers forbid the same.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]


def stdlib_corpus() -> list[str]:
    """The standard library's own UTF-8 ``.py`` files, in a stable order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "dist-packages" in path.parts:
            continue
        try:
            path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        files.append(str(path))
    return files


def ensure(directory: Path, model_dir: Path) -> Path:
    """``directory`` holding ``tokenizer.json`` (trained if missing) and the tiny model's
    ``tokenizer_config.json`` and ``config.json``, so that vLLM's ``get_tokenizer`` loads it too."""
    if (directory / "tokenizer.json").is_file():
        return directory
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(stdlib_corpus(), trainer)
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer_config.json", "config.json"):
        shutil.copyfile(model_dir / name, directory / name)
    partial = directory / "tokenizer.json.partial"
    tok.save(str(partial))
    partial.replace(directory / "tokenizer.json")
    (directory / "k3pipe-large-vocab.json").write_text(
        json.dumps({"vocab_size": tok.get_vocab_size(), "python": sys.version.split()[0]}) + "\n",
        encoding="utf-8",
    )
    return directory


if __name__ == "__main__":
    home = Path(__file__).resolve().parents[1] / ".k3pipe"
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else home / "bench" / "tokenizer-stdlib"
    print(ensure(target, home / "models" / "tiny-llama"))
