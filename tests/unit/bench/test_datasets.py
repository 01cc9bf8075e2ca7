"""Random prompts of an exact token length, checked with tokenizers trained in the test session."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

import k3pipe.prompts.datasets as datasets
from k3pipe.bench import Prompt, load_tokenizer, random_prompts, shared_prefix_prompts
from k3pipe.core.errors import BenchmarkError


def _count(tok: Tokenizer, text: str) -> int:
    return len(tok.encode(text, add_special_tokens=False).ids)


@pytest.mark.parametrize(
    "length",
    [
        1,
        2,
        3,
        7,
        64,
        65,
    ],
)
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


def test_prompts_of_other_lengths_share_no_prefix(byte_level_tokenizer: Tokenizer) -> None:
    # A 200K workload must not hit the prefix cache that a 64K workload of the same seed left behind.
    short = random_prompts(byte_level_tokenizer, 4, 64, 0)
    long = random_prompts(byte_level_tokenizer, 4, 256, 0)
    for a, b in zip(short, long, strict=True):
        assert byte_level_tokenizer.encode(a.text).ids[:8] != byte_level_tokenizer.encode(b.text).ids[:8]


@pytest.mark.parametrize("batch_tokens", [1, 100, 10**9])
def test_batched_verification_gives_the_one_by_one_prompts(
    batch_tokens: int, monkeypatch: pytest.MonkeyPatch, byte_level_tokenizer: Tokenizer
) -> None:
    # Prompts are verified many per encode call; the outcome, redraws of repeats included, must be
    # exactly that of making them one by one (batch_tokens 1: one prompt per call).
    expected_words = random_prompts(byte_level_tokenizer, 12, 40, 4)
    expected_repeats = random_prompts(_spelling_tokenizer(), 3, 1, 0)  # 3 one-token texts: redraws
    monkeypatch.setattr(datasets, "_BATCH_TOKENS", batch_tokens)
    assert random_prompts(byte_level_tokenizer, 12, 40, 4) == expected_words
    assert random_prompts(_spelling_tokenizer(), 3, 1, 0) == expected_repeats
    assert sorted(p.text for p in expected_repeats) == ["<", ">", "x"]


def test_text_is_the_tokenizers_decode(tokenizer: Tokenizer) -> None:
    # Word prompts are joined from the words' texts, not decoded: they must read the same.
    vocab = datasets._vocabulary(tokenizer)
    assert vocab.words is not None
    for p in random_prompts(tokenizer, 3, 300, 2):
        assert tokenizer.decode(tokenizer.encode(p.text, add_special_tokens=False).ids) == p.text


# Piecewise assembly: prompts cut from a pool of verified word blocks, checked where pieces meet.


def _whole_path_forbidden(*_: object, **__: object) -> None:
    raise AssertionError("prompts were made whole, not assembled")


@pytest.mark.parametrize("length", [1, 16, 17, 21, 150, 5000, 40_000])
def test_prompts_are_assembled_and_exact_for_every_kind_of_tokenizer(
    tokenizer: Tokenizer, length: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Byte-level, Metaspace, Llama-2's normalizer, a Llama-3 split regex and WordPiece all take the
    # fast path, and the whole-text encode (never done by the generator) gives exactly the length.
    monkeypatch.setattr(datasets, "_make_exact", _whole_path_forbidden)
    special_ids = set(tokenizer.get_added_tokens_decoder())
    prompts = random_prompts(tokenizer, 3, length, 11)
    for p in prompts:
        ids = tokenizer.encode(p.text, add_special_tokens=False).ids
        assert len(ids) == length
        assert not special_ids & set(ids)
    assert len({p.text for p in prompts}) == 3


def test_shared_prefix_prompts_are_assembled(tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(datasets, "_make_exact", _whole_path_forbidden)
    prompts = shared_prefix_prompts(tokenizer, 6, 3000, 1200, 2, 4)
    ids = [tokenizer.encode(p.text, add_special_tokens=False).ids for p in prompts]
    assert all(len(i) == 3000 for i in ids)
    for i, seq in enumerate(ids):
        assert seq[:1200] == ids[i % 2][:1200]
    assert ids[0][:1200] != ids[1][:1200]
    assert ids[0][1200:1210] != ids[2][1200:1210]


def test_one_token_prompts_redraw_repeats_and_stop_at_the_vocabulary(byte_level_tokenizer: Tokenizer) -> None:
    words = datasets._vocabulary(byte_level_tokenizer).pool.size
    # 300 draws of one word from a few hundred collide many times: each repeat is drawn again.
    prompts = random_prompts(byte_level_tokenizer, 300, 1, 0)
    assert len({p.text for p in prompts}) == 300
    assert all(_count(byte_level_tokenizer, p.text) == 1 for p in prompts)
    with pytest.raises(BenchmarkError, match=f"cannot make {words + 1} distinct prompts of 1 tokens"):
        random_prompts(byte_level_tokenizer, words + 1, 1, 0)


def _with_added(tok: Tokenizer, content: str) -> Tokenizer:
    copy = Tokenizer.from_str(tok.to_str())
    copy.add_tokens([content])
    return copy


def test_a_join_the_tokenizer_would_merge_is_caught_and_drawn_again(byte_level_tokenizer: Tokenizer) -> None:
    # Prompt 0's 16 fresh words meet its first pool segment between words 15 and 16. A tokenizer
    # with an added token spelling exactly that join encodes the join to one other id: its check
    # fails, prompt 0 is drawn again, and every prompt is still exact under that tokenizer.
    before = random_prompts(byte_level_tokenizer, 3, 600, 8)
    ids = byte_level_tokenizer.encode(before[0].text, add_special_tokens=False).ids
    join = byte_level_tokenizer.decode(ids[15:17]).strip()
    assert " " in join  # two words
    merging = _with_added(byte_level_tokenizer, join)
    assert datasets._pool(merging, datasets._vocabulary(merging), 8, 600) is not None
    after = random_prompts(merging, 3, 600, 8)
    assert join in before[0].text
    assert join not in after[0].text
    assert after[1:] == before[1:]
    added = set(merging.get_added_tokens_decoder())
    for p in after:
        got = merging.encode(p.text, add_special_tokens=False).ids
        assert len(got) == 600
        assert not added & set(got)


def test_blocks_that_do_not_encode_exactly_make_the_prompts_whole(byte_level_tokenizer: Tokenizer) -> None:
    # An added token 's t' spells the join of any word ending in s and any starting with t: no pool
    # block survives its check, and the prompts are made whole (encoded in full) instead.
    merging = _with_added(byte_level_tokenizer, "s t")
    assert datasets._pool(merging, datasets._vocabulary(merging), 0, 3000) is None
    added = set(merging.get_added_tokens_decoder())
    for p in random_prompts(merging, 4, 3000, 0):
        got = merging.encode(p.text, add_special_tokens=False).ids
        assert len(got) == 3000
        assert not added & set(got)


def test_prompts_that_keep_failing_their_checks_are_made_whole(
    byte_level_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    assemble = datasets._assemble

    def failing(tokenizer: Tokenizer, vocab: object, pool: object, d: object, target: int) -> None:
        assemble(tokenizer, vocab, pool, d, target)  # type: ignore[arg-type]
        if d.index == 2:  # type: ignore[attr-defined]
            d.checks.append(("x", [-1]))  # type: ignore[attr-defined]  # an encode never gives -1

    monkeypatch.setattr(datasets, "_pool", lambda *_: None)
    whole = random_prompts(byte_level_tokenizer, 4, 700, 3)
    monkeypatch.undo()
    monkeypatch.setattr(datasets, "_assemble", failing)
    assert random_prompts(byte_level_tokenizer, 4, 700, 3) == whole


def test_a_shared_prefix_prompt_never_repeats_its_prefix_blocks(byte_level_tokenizer: Tokenizer) -> None:
    prompts = shared_prefix_prompts(byte_level_tokenizer, 4, 60_000, 30_000, 2, 1)
    for p in prompts:
        ids = np.asarray(byte_level_tokenizer.encode(p.text, add_special_tokens=False).ids, dtype=np.int64)
        grams = np.lib.stride_tricks.sliding_window_view(ids, 12)
        assert len(ids) == 60_000
        assert len(np.unique(grams, axis=0)) == len(grams)


def _encoded(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def test_a_tree_of_prompts_shares_each_parents_tokens_exactly(tokenizer: Tokenizer) -> None:
    # two roots; chains and branches; lengths not multiples of anything
    nodes = [(None, 64), (0, 128), (1, 192), (0, 150), (None, 40), (4, 100), (2, 256), (6, 300), (2, 260)]
    prompts = datasets.tree_prompts(tokenizer, nodes, 3)
    ids = [_encoded(tokenizer, p.text) for p in prompts]
    assert [len(i) for i in ids] == [n for _, n in nodes]
    for i, (parent, _) in enumerate(nodes):
        if parent is not None:
            assert ids[i][: len(ids[parent])] == ids[parent]
            assert prompts[i].text.startswith(prompts[parent].text)
    assert ids[1][64:74] != ids[3][64:74]  # siblings part after their parent
    assert ids[0][:10] != ids[4][:10]  # two roots are two prompts
    assert datasets.tree_prompts(tokenizer, nodes, 3) == prompts
    assert datasets.tree_prompts(tokenizer, nodes, 4) != prompts


def test_a_tree_as_deep_as_a_long_session_is_assembled(
    byte_level_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks of 64 tokens chained to 16K tokens: 256 levels, each from pool blocks its ancestors
    did not use (the pool is as deep as the tree), never the slow whole path."""
    monkeypatch.setattr(datasets, "_make_exact", _whole_path_forbidden)
    nodes = [(None if k == 0 else k - 1, 64 * (k + 1)) for k in range(256)]
    prompts = datasets.tree_prompts(byte_level_tokenizer, nodes, 1)
    last = _encoded(byte_level_tokenizer, prompts[-1].text)
    assert len(last) == 16384
    assert last[:8192] == _encoded(byte_level_tokenizer, prompts[127].text)


@pytest.mark.parametrize(
    ("nodes", "message"),
    [
        ([(None, 0)], "node 0 has 0 tokens"),
        ([(None, 10), (0, 10)], "node 1 has 10 tokens, no more than its parent's 10"),
        ([(None, 10), (2, 20), (None, 5)], "node 1's parent 2 must come before it"),
    ],
)
def test_a_bad_tree_is_refused(byte_level_tokenizer: Tokenizer, nodes: list, message: str) -> None:
    with pytest.raises(BenchmarkError, match=message):
        datasets.tree_prompts(byte_level_tokenizer, nodes, 1)


def test_a_traces_prompts_have_its_lengths_and_share_its_blocks(tokenizer: Tokenizer) -> None:
    from k3pipe.prompts.trace_prompts import prompt_tree, trace_prompts
    from k3pipe.schema.traces import agentic_trace

    trace = agentic_trace(
        2, sessions=4, turns=(3, 5), context_tokens=2048, system_prompts=2, system_tokens=256,
        user_tokens=(16, 64), tool_tokens=(32, 128), output_tokens=(8, 64), block_tokens=16,
    )  # fmt: skip
    prompts = trace_prompts(trace, tokenizer, 1)
    ids = [_encoded(tokenizer, p.text) for p in prompts]
    assert [len(i) for i in ids] == [r.input_tokens for r in trace.requests]
    for a, ia in zip(trace.requests, ids, strict=True):
        for b, ib in zip(trace.requests, ids, strict=True):
            shared = 0
            while shared < min(len(a.hash_ids), len(b.hash_ids)) and a.hash_ids[shared] == b.hash_ids[shared]:
                shared += 1
            whole = min(shared, a.input_tokens // 16, b.input_tokens // 16) * 16
            assert ia[:whole] == ib[:whole]
            if shared < min(len(a.hash_ids), len(b.hash_ids)):  # where the ids part, the tokens do
                assert ia[shared * 16 : shared * 16 + 16] != ib[shared * 16 : shared * 16 + 16]
    nodes, _ = prompt_tree(trace)
    assert len(nodes) < sum(len(r.hash_ids) for r in trace.requests)  # shared blocks made once
