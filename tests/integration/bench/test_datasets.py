"""Random prompts at the lengths that take seconds to draw and check: 500 and 4,096 tokens for every
kind of tokenizer, 200K with the real tiny model's, 150K never repeating a stretch of words
(tests/unit/bench/test_datasets.py holds the rest)."""

from __future__ import annotations

import numpy as np
import pytest
from tokenizers import Tokenizer

from k3pipe.bench import load_tokenizer, random_prompts
from tests.conftest import TINY_MODEL
from tests.unit.bench.test_datasets import _count


@pytest.mark.parametrize("length", [500, 4096])
@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_prompts_have_the_exact_length(tokenizer: Tokenizer, length: int, seed: int) -> None:
    prompts = random_prompts(tokenizer, 4, length, seed)
    assert len(prompts) == 4
    for p in prompts:
        assert p.tokens == length
        assert _count(tokenizer, p.text) == length


def test_the_real_tiny_model_at_200k() -> None:
    # The study's length with a real model's tokenizer (built by `make`; skipped without it).
    if not (TINY_MODEL / "tokenizer.json").is_file():
        pytest.skip(f"no tokenizer.json in {TINY_MODEL} (built by make)")
    tok = load_tokenizer(TINY_MODEL)
    prompts = random_prompts(tok, 2, 200_000, 0)
    for p in prompts:
        assert len(tok.encode(p.text, add_special_tokens=False).ids) == 200_000
    assert prompts[0].text != prompts[1].text


@pytest.mark.parametrize(("n", "length"), [(3, 40_000), (2, 150_000)])
def test_a_prompt_never_repeats_a_stretch_of_words(
    byte_level_tokenizer: Tokenizer, n: int, length: int
) -> None:
    # Uniformly random tokens never repeat a 12-token stretch; neither may an assembled prompt (an
    # n-gram drafter, or a model that copies, must find nothing to copy). Each segment comes from
    # a pool block of its own, and a 150K prompt needs a larger pool than the 64 blocks' 65K words.
    for p in random_prompts(byte_level_tokenizer, n, length, 6):
        ids = np.asarray(byte_level_tokenizer.encode(p.text, add_special_tokens=False).ids, dtype=np.int64)
        grams = np.lib.stride_tricks.sliding_window_view(ids, 12)
        assert len(np.unique(grams, axis=0)) == len(grams)
