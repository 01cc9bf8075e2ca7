"""Fixtures for the benchmark tests: tokenizers trained here, and the scripted OpenAI server."""

from __future__ import annotations

import re
import sysconfig
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from tests.scripted_openai import ScriptedOpenAI

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]


def _corpus() -> list[str]:
    # Text that ships with CPython: no download, and real enough for a BPE to learn merges.
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [str(p) for p in sorted(stdlib.glob("*.py"))[:30]]


@pytest.fixture(scope="session")
def byte_level_tokenizer() -> Tokenizer:
    """A GPT-2-style byte-level BPE (vocab 2048) with ChatML-ish special tokens."""
    return _byte_level_bpe(pre_tokenizers.ByteLevel(add_prefix_space=False), 2048)


def _byte_level_bpe(pre_tokenizer: pre_tokenizers.PreTokenizer, vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(_corpus(), trainer)
    return tok


@pytest.fixture(scope="session")
def metaspace_tokenizer() -> Tokenizer:
    """A Llama/SentencePiece-style BPE: '▁' for spaces, byte fallback, a decoder that strips the start."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=3000, special_tokens=["<unk>", "<s>", "</s>", *SPECIAL_TOKENS], show_progress=False
    )
    tok.train(_corpus(), trainer)
    return tok


@pytest.fixture(scope="session")
def sentencepiece_tokenizer(metaspace_tokenizer: Tokenizer) -> Tokenizer:
    """Llama-2's tokenizer.json shape: no pre-tokenizer, a normalizer that prepends '▁' and turns
    spaces into '▁', so BPE runs over the whole text (the Metaspace one's vocabulary, trained on
    words, as SentencePiece is)."""
    tok = Tokenizer.from_str(metaspace_tokenizer.to_str())
    tok.pre_tokenizer = None
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    return tok


@pytest.fixture(scope="session")
def regex_tokenizer() -> Tokenizer:
    """Llama-3/Qwen/Kimi's shape: a split regex, then byte-level mapping without its own regex."""
    pattern = (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    split = pre_tokenizers.Split(Regex(pattern), "isolated")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return _byte_level_bpe(pre_tokenizers.Sequence([split, byte_level]), 3000)


@pytest.fixture(scope="session")
def wordpiece_tokenizer() -> Tokenizer:
    """BERT's shape: lower-casing normalizer, whitespace/punctuation pre-tokenizer, '##' pieces.

    The vocabulary is built here, not trained: the WordPiece trainer is not deterministic across
    processes. It holds every character of the corpus (alone and as '##' piece), the 2,000 commonest
    words and the 300 commonest 2-4 letter word endings as '##' pieces.
    """
    words: Counter[str] = Counter()
    chars: set[str] = set()
    for path in _corpus():
        text = Path(path).read_text(encoding="utf-8").lower()
        words.update(re.findall(r"[a-z]+", text))
        chars.update(c for c in text if not c.isspace())
    endings: Counter[str] = Counter()
    for word, count in words.items():
        for k in (2, 3, 4):
            if len(word) > k:
                endings[word[-k:]] += count
    special = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
    ordered = sorted(chars)
    common = [w for w, _ in sorted(words.items(), key=lambda kv: (-kv[1], kv[0])) if len(w) > 1][:2000]
    pieces = [f"##{e}" for e, _ in sorted(endings.items(), key=lambda kv: (-kv[1], kv[0]))[:300]]
    tokens = [*special, *ordered, *(f"##{c}" for c in ordered), *common, *pieces]
    vocab = {t: i for i, t in enumerate(dict.fromkeys(tokens))}
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(special)
    return tok


@pytest.fixture(params=["byte_level", "metaspace", "sentencepiece", "regex", "wordpiece"])
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    """Each trained tokenizer in turn."""
    tok: Tokenizer = request.getfixturevalue(f"{request.param}_tokenizer")
    return tok


@pytest.fixture
def server() -> Iterator[ScriptedOpenAI]:
    """A scripted vLLM-style server on 127.0.0.1, stopped after the test."""
    with ScriptedOpenAI() as scripted:
        yield scripted
