"""Random prompts of an exact token length, checked with tokenizers trained in the test session."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

import k3pipe.bench.datasets as datasets
from k3pipe.bench import Prompt, load_tokenizer, random_prompts
from k3pipe.errors import BenchmarkError


def _count(tok: Tokenizer, text: str) -> int:
    return len(tok.encode(text, add_special_tokens=False).ids)


@pytest.mark.parametrize("length", [1, 2, 3, 7, 64, 65, 500, 4096])
@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_prompts_have_the_exact_length(tokenizer: Tokenizer, length: int, seed: int) -> None:
    prompts = random_prompts(tokenizer, 4, length, seed)
    assert len(prompts) == 4
    for p in prompts:
        assert p.tokens == length
        assert _count(tokenizer, p.text) == length


@pytest.mark.parametrize("length", [1, 5, 64, 65, 3000])
def test_exact_length_when_drawing_from_the_whole_vocabulary(
    tokenizer: Tokenizer, length: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The fallback for vocabularies with few word tokens: any ordinary token, then trim/pad/refit.
    monkeypatch.setattr(datasets, "_MIN_WORD_TOKENS", 10**9)
    for p in random_prompts(tokenizer, 4, length, 9):
        assert _count(tokenizer, p.text) == length
    # drawn from the whole vocabulary: not only space-separated words
    assert any(not w.isalpha() for p in random_prompts(tokenizer, 4, 200, 9) for w in p.text.split())


def test_a_100k_token_prompt(byte_level_tokenizer: Tokenizer) -> None:
    (prompt,) = random_prompts(byte_level_tokenizer, 1, 100_000, 7)
    assert _count(byte_level_tokenizer, prompt.text) == 100_000


def test_same_seed_same_prompts_other_seed_other_prompts(byte_level_tokenizer: Tokenizer) -> None:
    a = random_prompts(byte_level_tokenizer, 5, 300, 42)
    b = random_prompts(byte_level_tokenizer, 5, 300, 42)
    c = random_prompts(byte_level_tokenizer, 5, 300, 43)
    assert [p.text for p in a] == [p.text for p in b]
    assert not {p.text for p in a} & {p.text for p in c}


def test_prompt_i_depends_only_on_seed_and_i(byte_level_tokenizer: Tokenizer) -> None:
    few = random_prompts(byte_level_tokenizer, 2, 50, 3)
    more = random_prompts(byte_level_tokenizer, 6, 50, 3)
    assert [p.text for p in more[:2]] == [p.text for p in few]


def test_prompts_are_distinct_and_share_no_long_prefix(byte_level_tokenizer: Tokenizer) -> None:
    prompts = random_prompts(byte_level_tokenizer, 50, 20, 0)
    assert len({p.text for p in prompts}) == 50
    # random prompts must not share a prefix a prefix cache could reuse
    assert len({p.text[:20] for p in prompts}) == 50


def test_no_special_tokens(tokenizer: Tokenizer) -> None:
    special_ids = set(tokenizer.get_added_tokens_decoder())
    for p in random_prompts(tokenizer, 10, 2000, 5):
        ids = tokenizer.encode(p.text, add_special_tokens=False).ids
        assert not special_ids & set(ids)
        for content in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"):
            assert content not in p.text


def _spelling_tokenizer() -> Tokenizer:
    """Ordinary tokens '<', 'x', '>' that concatenate into the special token '<x>'."""
    tok = Tokenizer(models.BPE(vocab={"<": 0, "x": 1, ">": 2}, merges=[]))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<x>"])
    return tok


def test_text_that_spells_a_special_token_is_redrawn() -> None:
    tok = _spelling_tokenizer()
    assert tok.encode("a<x>", add_special_tokens=False).ids == [3]  # the text alone would be special
    prompts = random_prompts(tok, 40, 30, 0)
    assert all("<x>" not in p.text for p in prompts)
    assert all(_count(tok, p.text) == 30 for p in prompts)


def test_too_few_distinct_prompts_is_an_error() -> None:
    with pytest.raises(BenchmarkError, match="distinct prompts of 1 tokens"):
        random_prompts(_spelling_tokenizer(), 5, 1, 0)  # only 3 one-token texts exist


def test_unreachable_length_is_an_error() -> None:
    tok = Tokenizer(models.BPE(vocab={" ": 0}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # every text encodes to no tokens
    with pytest.raises(BenchmarkError, match="exactly 5 tokens"):
        random_prompts(tok, 1, 5, 0)


def test_bad_arguments(byte_level_tokenizer: Tokenizer) -> None:
    assert random_prompts(byte_level_tokenizer, 0, 10, 0) == []
    with pytest.raises(BenchmarkError, match="input_tokens"):
        random_prompts(byte_level_tokenizer, 1, 0, 0)


def test_negative_seed_is_deterministic(byte_level_tokenizer: Tokenizer) -> None:
    a = random_prompts(byte_level_tokenizer, 2, 30, -1)
    assert a == random_prompts(byte_level_tokenizer, 2, 30, -1)
    assert a != random_prompts(byte_level_tokenizer, 2, 30, 1)


def test_prompt_is_frozen() -> None:
    p = Prompt(text="hi", tokens=1)
    with pytest.raises(ValidationError):
        p.tokens = 2  # type: ignore[misc]


def test_load_tokenizer(tmp_path: Path, byte_level_tokenizer: Tokenizer) -> None:
    byte_level_tokenizer.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path)
    assert loaded.get_vocab_size() == byte_level_tokenizer.get_vocab_size()
    assert loaded.encode("def f(x): return x").ids == byte_level_tokenizer.encode("def f(x): return x").ids


def test_load_tokenizer_names_the_directory_and_its_files(tmp_path: Path) -> None:
    (tmp_path / "tiktoken.model").write_text("")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(BenchmarkError) as info:
        load_tokenizer(tmp_path)
    message = str(info.value)
    assert str(tmp_path) in message
    assert "tokenizer.json" in message
    assert "tiktoken.model" in message
    assert "tokenizer_config.json" in message


def test_load_tokenizer_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(BenchmarkError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")


def test_load_tokenizer_unreadable_file(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(BenchmarkError, match="cannot load"):
        load_tokenizer(tmp_path)
