"""Benchmark prompts: random token sequences of an exact length under the model's own tokenizer.

The study's "Random" dataset: each prompt is text that the served model's tokenizer encodes to
exactly ``input_tokens`` tokens (no special tokens added, none contained), so a 64K or 200K workload
really sends 64K or 200K prompt tokens (plus whatever the chat template adds on the server). The
shared-prefix dataset is built the same way: a random prefix per group, then a random suffix per
prompt, the whole exact and the prefix's tokens an exact token prefix of every prompt of its group.

How a prompt is made (no per-token Python loops, no encode of the whole prompt). Prompts are
drawn from the vocabulary's *word* tokens (a space then letters, each encoding alone to itself),
because every common pre-tokenizer (byte-level regex, Metaspace, BERT whitespace) splits a run of
them into exactly those words: tokenization is local, and a join of words re-encodes to exactly the
drawn ids. Making a long prompt is then string slicing, and verifying it needs the tokenizer only
where pieces meet:

- a *pool* of word blocks of 1024 words, keyed by the seed, is drawn and each block is encoded
  whole once per call, after a lead word (so nothing is checked at a text's start). It holds 64
  blocks, or 1.25x the prompt length in words and 8 blocks more, whichever is larger;
- a prompt is 16 fresh words drawn from its own stream, then segments of 128-1024 words (longer
  for long prompts) cut at random offsets from blocks in a random order, each block at most once,
  so no prompt repeats a stretch of words (uniformly random tokens would not either: an n-gram
  drafter or a model that copies finds nothing to copy). Its text is the words' texts joined
  (checked once per call to read exactly as the tokenizer's decode would);
- every place that no block encode covered is checked by encoding a window of words either side:
  the start (the fresh words and the first join), each join between segments and the end. A
  window has 4 words a side, or as many as the vocabulary's widest token spans (a token or added
  token like ' of the same' spans 3), so a token straddling a join lies inside its window. Each
  window must encode to exactly its words' ids (no added or special token, nothing merged or
  split). A prompt whose window fails is drawn again from its stream.

So every prompt's length is verified piecewise: each of its words sits inside an encode that gave
exactly the expected ids, with at least a window of real context on each side. From a large
vocabulary, at most 8192 word tokens are used (a seeded sample), which fit the tokenizer's BPE
cache. On one core, ten 200K-token prompts take about 0.4 s with the tiny model's 2K vocabulary and
0.75 s with a 123K one (vLLM's RandomDataset: 6.6 s and 19 s), most of it the pool's 259K words;
encoding every prompt whole took 3 s with the 2K vocabulary. ``tests/unit/bench/test_datasets.py``
encodes every prompt whole and compares, for byte-level, Metaspace, Llama-2-normalizer, split-regex
and WordPiece tokenizers.

When the vocabulary has too few word tokens, or a pool block or a prompt keeps failing its check,
the prompts are made whole instead: ids drawn from all ordinary tokens (added/special tokens are
never drawn), decoded, and the whole text encoded to verify it (many prompts per
``encode_batch_fast`` call, about 2M tokens at a time). When the count is off (tokens merged or
split across their boundaries), the ids are trimmed or padded; only the last few dozen tokens are
refitted against a short encoded context before the whole text is verified again. A few rounds at
most; if the length cannot be reached, ``BenchmarkError``.

Each prompt has its own random stream, keyed by (seed, dataset kind, length, index): prompt ``i``
depends only on those, and prompts of different lengths never share a token prefix, so a 200K
workload cannot hit the prefix cache that a 64K workload with the same seed left behind.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from numpy.typing import NDArray
from pydantic import BaseModel, ConfigDict, Field
from tokenizers import Encoding, Tokenizer

from k3pipe.core.errors import BenchmarkError

__all__ = ["Prompt", "load_tokenizer", "random_prompts", "shared_prefix_prompts", "tree_prompts"]

# Full-text encode/verify rounds, tail refits per round, tokens refitted at the tail, context tokens.
_MAX_ROUNDS = 6
_MAX_TAIL_ROUNDS = 12
_TAIL_TOKENS = 64
_CONTEXT_TOKENS = 32
# Redraws of one prompt when it repeats an earlier one.
_MAX_REDRAWS = 32
# Fewer word tokens than this and prompts are drawn from the whole ordinary vocabulary.
_MIN_WORD_TOKENS = 256
# At most this many word tokens are drawn from (fits the tokenizers' BPE cache of 10,000 words).
_MAX_WORDS = 8192
# Tokens verified per encode_batch_fast call: an Encoding holds ~150 bytes a token until dropped.
_BATCH_TOKENS = 2_000_000
# Kinds of random stream (part of each prompt's key, so datasets never share prompts or prefixes).
_RANDOM, _PREFIX, _SUFFIX, _POOL, _TREE = 0, 1, 2, 3, 4
# Piecewise assembly: pool blocks x words, words per segment (min, max <= block), fresh words that
# start each prompt (and each shared-prefix suffix), words checked either side of a join.
_POOL_BLOCKS = 64  # at least; more for long prompts, so a prompt never uses a block twice
_BLOCK_WORDS = 1024
_SEGMENT_WORDS = (128, 1024)
_FRESH_WORDS = 16
_WINDOW_WORDS = 4
# Draws of one pool block, and failed checks of one prompt, before assembly is given up.
_MAX_POOL_DRAWS = 4
_MAX_ASSEMBLIES = 4
# Join windows encoded per call (an Encoding holds ~150 bytes a token until dropped).
_BATCH_WINDOWS = 20_000

_IdArray = NDArray[np.int64]
# What a decoder yields for bytes that are not (yet) a whole UTF-8 character.
_BAD = "\ufffd"


class Prompt(BaseModel):
    """One prompt: its text and its verified token count (the tokenizer's, no special tokens added)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    text: str = Field(description="Prompt text, sent as the user message (chat) or prompt (completions).")
    tokens: int = Field(ge=1, description="Tokens the text encodes to, verified by re-encoding.")


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """Load ``tokenizer.json`` (a Hugging Face fast tokenizer) from a model directory.

    Raises:
        BenchmarkError: the directory or its ``tokenizer.json`` is missing or unreadable; the message
            names the directory and what tokenizer files it does hold.
    """
    directory = Path(model_dir).expanduser()
    if not directory.is_dir():
        raise BenchmarkError(
            f"model directory {directory} does not exist: download the model first, or point the "
            "workload at the directory that holds its tokenizer.json"
        )
    path = directory / "tokenizer.json"
    if not path.is_file():
        others = sorted(
            p.name
            for p in directory.iterdir()
            if p.name.startswith("tokenizer") or p.suffix in {".model", ".tiktoken"}
        )
        held = f"; it holds {', '.join(others)}" if others else ""
        raise BenchmarkError(
            f"no tokenizer.json in {directory}{held}: random prompts of an exact length need the "
            "model's fast tokenizer file (tokenizer.json); convert the tokenizer or add that file"
        )
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises a plain Exception
        raise BenchmarkError(f"cannot load {path}: {exc}") from exc


def random_prompts(tokenizer: Tokenizer, n: int, input_tokens: int, seed: int) -> list[Prompt]:
    """``n`` distinct random prompts that each encode to exactly ``input_tokens`` tokens.

    Deterministic for a seed, and prompt ``i`` depends only on ``(seed, input_tokens, i)``: the
    first ``k`` prompts of a larger request are the same prompts. Prompts never contain added or
    special tokens (the ids of the final encoding are checked), and the count is for
    ``encode(text, add_special_tokens=False)``.

    Raises:
        BenchmarkError: the exact length or ``n`` distinct prompts cannot be reached with this
            tokenizer, or its vocabulary has no ordinary tokens.
    """
    if n < 0:
        raise BenchmarkError(f"number of prompts must be >= 0, got {n}")
    if input_tokens < 1:
        raise BenchmarkError(f"input_tokens must be >= 1, got {input_tokens}")
    vocab = _vocabulary(tokenizer)

    def make(kind: _Maker) -> list[Prompt]:
        drafts = [_Draft(index=i, rng=_stream(seed, _RANDOM, input_tokens, i)) for i in range(n)]
        kind(input_tokens, drafts)
        return [Prompt(text=d.text, tokens=input_tokens) for d in drafts]

    return _assembled_or_whole(tokenizer, vocab, seed, n, input_tokens, make)


def shared_prefix_prompts(
    tokenizer: Tokenizer, n: int, input_tokens: int, prefix_tokens: int, groups: int, seed: int
) -> list[Prompt]:
    """``n`` distinct prompts of exactly ``input_tokens`` tokens in ``groups`` groups sharing a prefix.

    Prompt ``i`` is random prefix ``i % groups`` (``prefix_tokens`` tokens) followed by a random
    suffix of its own. Every prompt's encoding starts with exactly its prefix's encoding (checked),
    so an engine's prefix cache can reuse those ``prefix_tokens`` tokens. Prefix ``g`` depends only
    on ``(seed, prefix_tokens, input_tokens, g)``, prompt ``i``'s suffix on ``(seed, input_tokens,
    prefix_tokens, i)``, each drawn from a random stream of its own (apart from random prompts of
    the same seed); ``input_tokens`` counts through the pool, which grows with long prompts.

    Raises:
        BenchmarkError: bad sizes, or the exact lengths cannot be reached with this tokenizer.
    """
    if n < 0:
        raise BenchmarkError(f"number of prompts must be >= 0, got {n}")
    if groups < 1:
        raise BenchmarkError(f"groups must be >= 1, got {groups}")
    if not 1 <= prefix_tokens < input_tokens:
        raise BenchmarkError(
            f"prefix_tokens ({prefix_tokens}) must be at least 1 and below input_tokens "
            f"({input_tokens}): each prompt is the shared prefix plus a suffix of its own"
        )
    vocab = _vocabulary(tokenizer)

    def make(kind: _Maker) -> list[Prompt]:
        prefixes = [
            _Draft(index=g, rng=_stream(seed, _PREFIX, prefix_tokens, g), keep_ids=True)
            for g in range(min(groups, n))
        ]
        kind(prefix_tokens, prefixes)
        drafts = []
        for i in range(n):
            prefix = prefixes[i % groups]
            drafts.append(
                _Draft(
                    index=i,
                    rng=_stream(seed, _SUFFIX, input_tokens, prefix_tokens, i),
                    head_text=prefix.text,
                    head_ids=_kept(prefix.ids),
                    head_positions=_kept(prefix.positions),
                    head_blocks=prefix.blocks,
                )
            )
        kind(input_tokens, drafts)
        return [Prompt(text=d.text, tokens=input_tokens) for d in drafts]

    return _assembled_or_whole(tokenizer, vocab, seed, n, input_tokens, make)


def tree_prompts(tokenizer: Tokenizer, nodes: Sequence[tuple[int | None, int]], seed: int) -> list[Prompt]:
    """Prompts that form a tree: node ``i`` is ``(parent, tokens)``, its parent's index (None: a root)
    and its own length, more than its parent's. Every node encodes to exactly ``tokens`` tokens and
    its encoding starts with exactly its parent's (checked), so a prompt shares with each of its
    ancestors, token for token, what a prefix cache can reuse: a trace's chained blocks
    (k3pipe.prompts.trace_prompts) rebuilt as text. Parents come before their children; node ``i``
    depends only on ``(seed, i)`` and its ancestors.

    Raises:
        BenchmarkError: a node no longer than its parent, a parent after its child, or lengths this
            tokenizer cannot reach.
    """
    depth: list[int] = []
    for i, (parent, tokens) in enumerate(nodes):
        if parent is None:
            depth.append(0)
            if tokens < 1:
                raise BenchmarkError(f"prompt tree: node {i} has {tokens} tokens; give at least 1")
            continue
        if not 0 <= parent < i:
            raise BenchmarkError(f"prompt tree: node {i}'s parent {parent} must come before it")
        if tokens <= nodes[parent][1]:
            raise BenchmarkError(
                f"prompt tree: node {i} has {tokens} tokens, no more than its parent's {nodes[parent][1]}"
            )
        depth.append(depth[parent] + 1)
    if not nodes:
        return []
    vocab = _vocabulary(tokenizer)
    longest = max(t for _, t in nodes)
    # a node's words come from pool blocks none of its ancestors used: a pool as deep as the tree
    levels = max(depth) + 1
    pool_tokens = max(longest, (levels + 8) * 4 * _BLOCK_WORDS // 5)

    def make(kind: _Maker) -> list[Prompt]:
        drafts = [_Draft(index=i, rng=_stream(seed, _TREE, i), keep_ids=True) for i in range(len(nodes))]
        order = sorted(range(len(nodes)), key=lambda i: (depth[i], nodes[i][1], i))
        at = 0
        while at < len(order):
            level, target = depth[order[at]], nodes[order[at]][1]
            group = []
            while at < len(order) and depth[order[at]] == level and nodes[order[at]][1] == target:
                group.append(order[at])
                at += 1
            for i in group:
                parent = nodes[i][0]
                if parent is not None:
                    head = drafts[parent]
                    d = drafts[i]
                    d.head_text, d.head_ids = head.text, _kept(head.ids)
                    d.head_positions, d.head_blocks = _kept(head.positions), head.blocks
            kind(target, [drafts[i] for i in group])
            for i in group:  # the ids a child's head must start with
                d = drafts[i]
                if d.ids is None and d.positions is not None:
                    d.ids = vocab.pool[d.positions]
        return [Prompt(text=d.text, tokens=nodes[d.index][1]) for d in drafts]

    pool = _pool(tokenizer, vocab, seed, pool_tokens)
    if pool is not None:
        try:
            return make(lambda target, drafts: _assemble_all(tokenizer, vocab, pool, target, drafts))
        except _Unassemblable:
            pass
    return make(lambda target, drafts: _make_exact(tokenizer, vocab, target, drafts))


# Makes drafts exact: (target tokens, drafts) -> None.
_Maker = Callable[[int, list["_Draft"]], None]


def _assembled_or_whole(
    tokenizer: Tokenizer,
    vocab: _Vocab,
    seed: int,
    n: int,
    tokens: int,
    make: Callable[[_Maker], list[Prompt]],
) -> list[Prompt]:
    """``make``'s prompts assembled from the seed's pool; made whole when there is no pool or a
    prompt keeps failing its checks (from fresh streams, so the outcome depends only on the inputs)."""
    pool = _pool(tokenizer, vocab, seed, tokens) if n else None
    if pool is not None:
        try:
            return make(lambda target, drafts: _assemble_all(tokenizer, vocab, pool, target, drafts))
        except _Unassemblable:
            pass
    return make(lambda target, drafts: _make_exact(tokenizer, vocab, target, drafts))


def _kept(ids: _IdArray | None) -> _IdArray:
    return ids if ids is not None else np.empty(0, dtype=np.int64)


def _stream(seed: int, *key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed % 2**64, *key]))


@dataclass(frozen=True)
class _Vocab:
    """What prompts are drawn from: the pool of ids, the ids never allowed, the words' texts."""

    pool: _IdArray
    forbidden: frozenset[int]
    # Each pool token's text as it reads after another token (word pools only): a prompt's text is
    # then a join of these, several times faster than the tokenizer's decode.
    words: NDArray[np.object_] | None = None
    # Their lengths in characters.
    lens: _IdArray | None = None
    # Words checked either side of a join: at least as many as the widest token spans, so a token
    # that straddles a join lies inside its window.
    window: int = _WINDOW_WORDS


@dataclass
class _Draft:
    """One prompt being made: its own random stream, an optional fixed head, its current text."""

    index: int
    rng: np.random.Generator
    # A text every attempt starts with (a shared prefix) and its ids, which must start the encoding.
    head_text: str = ""
    head_ids: _IdArray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    keep_ids: bool = False
    # Piecewise assembly: the head's and the prompt's words as positions in the vocabulary's pool,
    # and the (text, expected ids) windows that must encode exactly.
    head_positions: _IdArray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    positions: _IdArray | None = None
    # Pool blocks the head's and the prompt's segments were cut from (none is used twice).
    head_blocks: tuple[int, ...] = ()
    blocks: tuple[int, ...] = ()
    checks: list[tuple[str, list[int]]] = field(default_factory=list)
    text: str = ""
    ids: _IdArray | None = None
    verified: bool = False
    rounds: int = 0
    draws: int = 0


class _Unassemblable(Exception):
    """Piecewise assembly does not hold for this tokenizer: the prompts are made whole instead."""


@dataclass(frozen=True)
class _Pool:
    """Blocks of words, each verified by one encode, that prompts are cut from."""

    positions: _IdArray  # (blocks, words): positions in the vocabulary's pool
    shortest: int  # words in a segment at least (but a piece's last): no prompt runs out of blocks
    texts: tuple[str, ...]  # each block's words joined as they read after another word
    offsets: _IdArray  # (blocks, words + 1): where each word starts in its block's text
    lead_id: int  # a word that every check after a text's start is prefixed with
    lead_text: str  # ... as it reads at the start of a text


def _pool(tokenizer: Tokenizer, vocab: _Vocab, seed: int, tokens: int) -> _Pool | None:
    """The pool of verified word blocks for prompts of ``tokens`` tokens, keyed by the seed, or None
    when the vocabulary has no word texts or a block keeps encoding to other ids than its words
    (prompts are then made whole).

    A prompt cuts each of its segments from a block of its own, so it never repeats a stretch of
    words (as uniformly random tokens would not: an n-gram drafter, or a model that copies, must
    find nothing to copy). Hence at least 1.25x ``tokens`` words in blocks, and segments long enough
    that a prompt needs at most 8 blocks fewer than there are.
    """
    if vocab.words is None or vocab.lens is None:
        return None
    blocks = max(_POOL_BLOCKS, -(-tokens * 5 // (4 * _BLOCK_WORDS)) + 8)
    shortest = min(_SEGMENT_WORDS[1], max(_SEGMENT_WORDS[0], -(-tokens // (blocks - 8))))
    rng = _stream(seed, _POOL)
    lead_id, lead_text = int(vocab.pool[0]), _decode(tokenizer, vocab.pool[:1])
    positions = rng.integers(0, vocab.pool.size, size=(blocks, _BLOCK_WORDS))
    texts = ["".join(vocab.words[row].tolist()) for row in positions]
    pending = list(range(blocks))
    for draw in range(_MAX_POOL_DRAWS):
        encodings = _encode_batch(tokenizer, [lead_text + texts[b] for b in pending])
        pending = [
            b
            for b, e in zip(pending, encodings, strict=True)
            if e.ids != [lead_id, *vocab.pool[positions[b]].tolist()]
        ]
        if not pending:
            break
        if draw + 1 == _MAX_POOL_DRAWS:
            return None
        for b in pending:  # in block order, from the pool's own stream: deterministic
            positions[b] = rng.integers(0, vocab.pool.size, size=_BLOCK_WORDS)
            texts[b] = "".join(vocab.words[positions[b]].tolist())
    offsets = np.zeros((blocks, _BLOCK_WORDS + 1), dtype=np.int64)
    np.cumsum(vocab.lens[positions], axis=1, out=offsets[:, 1:])
    return _Pool(positions, shortest, tuple(texts), offsets, lead_id, lead_text)


def _assemble_all(
    tokenizer: Tokenizer, vocab: _Vocab, pool: _Pool, target: int, drafts: list[_Draft]
) -> None:
    """Give every draft a distinct text of exactly ``target`` tokens, cut from the pool, in index order.

    The checks of many prompts go to the tokenizer in one call; a prompt that fails its check or
    repeats an earlier prompt is drawn again from its own stream, so the outcome is exactly that of
    making the prompts one by one.

    Raises:
        _Unassemblable: a prompt failed its check ``_MAX_ASSEMBLIES`` times.
        BenchmarkError: ``len(drafts)`` distinct prompts of this length cannot be had.
    """
    seen: set[str] = set()
    per_batch = max(1, _BATCH_WINDOWS // (3 + target // _SEGMENT_WORDS[0]))
    for start in range(0, len(drafts), per_batch):
        batch = drafts[start : start + per_batch]
        for d in batch:
            _assemble(tokenizer, vocab, pool, d, target)
        encodings = _encode_batch(tokenizer, [text for d in batch for text, _ in d.checks])
        at = 0
        for d in batch:
            got = encodings[at : at + len(d.checks)]
            at += len(d.checks)
            d.verified = _passes(got, d.checks)
        for d in batch:
            while not d.verified or d.text in seen:
                if not d.verified:
                    d.rounds += 1
                    if d.rounds >= _MAX_ASSEMBLIES:
                        raise _Unassemblable
                else:
                    d.draws += 1
                    if d.draws >= _MAX_REDRAWS:
                        raise BenchmarkError(
                            f"cannot make {len(drafts)} distinct prompts of {target} tokens with this "
                            f"tokenizer (prompt {d.index} kept repeating an earlier one): ask for "
                            "fewer prompts or longer ones"
                        )
                _assemble(tokenizer, vocab, pool, d, target)
                d.verified = _passes(_encode_batch(tokenizer, [text for text, _ in d.checks]), d.checks)
            seen.add(d.text)
            d.checks = []
            if not d.keep_ids:
                d.positions = None


def _passes(encodings: Sequence[Encoding], checks: list[tuple[str, list[int]]]) -> bool:
    return all(e.ids == ids for e, (_, ids) in zip(encodings, checks, strict=True))


def _assemble(tokenizer: Tokenizer, vocab: _Vocab, pool: _Pool, d: _Draft, target: int) -> None:
    """Draw the draft's words after its head (fresh words, then pool segments), its text and checks."""
    assert vocab.words is not None
    assert vocab.lens is not None
    head = d.head_positions.size
    fresh = min(target - head, _FRESH_WORDS)
    runs = [d.rng.integers(0, vocab.pool.size, size=fresh)]
    texts = ["".join(vocab.words[runs[0]].tolist())]
    spans = [(head, head + fresh)]  # word ranges whose insides no block encode covered
    at = head + fresh
    high = _SEGMENT_WORDS[1]
    free = pool.positions.shape[0]
    if d.head_blocks:
        order = d.rng.permutation(np.setdiff1d(np.arange(free), d.head_blocks)).tolist()
    else:
        order = d.rng.permutation(free).tolist()
    used = []
    while at < target:
        left = target - at
        if not order:
            raise _Unassemblable  # the pool is sized so that this cannot happen
        # at least an even share of the blocks left: the last block is never short of words
        low = min(high, max(pool.shortest, -(-left // len(order))))
        size = left if left <= high else int(d.rng.integers(low, high + 1))
        block = order.pop()
        used.append(block)
        offset = int(d.rng.integers(0, _BLOCK_WORDS - size + 1))
        runs.append(pool.positions[block, offset : offset + size])
        first, last = pool.offsets[block, offset], pool.offsets[block, offset + size]
        texts.append(pool.texts[block][first:last])
        spans.append((at, at))
        at += size
    spans.append((target, target))  # the end
    positions = np.concatenate([d.head_positions, *runs])
    after = "".join(texts)
    if head:
        text = d.head_text + after
    else:  # decoders treat a text's start specially (a Metaspace decoder strips the first space)
        text = _decode(tokenizer, vocab.pool[positions[:1]]) + after[len(vocab.words[positions[0]]) :]
    lens = vocab.lens[positions]
    lens[0] += len(text) - int(lens.sum())
    chars = np.zeros(target + 1, dtype=np.int64)
    np.cumsum(lens, out=chars[1:])
    ids = vocab.pool[positions]
    k = vocab.window
    checks = []
    covered = (0, 0)
    for a, b in sorted({(max(0, a - k), min(target, b + k)) for a, b in spans}):
        if covered[0] <= a and b <= covered[1]:
            continue  # inside the window before
        covered = (a, b)
        window = text[chars[a] : chars[b]]
        if a == 0:
            checks.append((window, ids[:b].tolist()))
        else:
            checks.append((pool.lead_text + window, [pool.lead_id, *ids[a:b].tolist()]))
    d.text, d.positions, d.checks, d.blocks = text, positions, checks, (*d.head_blocks, *used)


def _make_exact(tokenizer: Tokenizer, vocab: _Vocab, target: int, drafts: list[_Draft]) -> None:
    """Give every draft a distinct text that encodes to exactly ``target`` tokens, in index order."""
    seen: set[str] = set()
    per_batch = max(1, _BATCH_TOKENS // target)
    for start in range(0, len(drafts), per_batch):
        _settle(tokenizer, vocab, target, drafts[start : start + per_batch], seen, len(drafts))


def _settle(
    tokenizer: Tokenizer, vocab: _Vocab, target: int, batch: list[_Draft], seen: set[str], total: int
) -> None:
    """Draw, verify (all pending prompts in one batched encode per round) and accept in index order.

    A prompt that repeats an earlier one is drawn again from its own stream; the prompts after it
    keep their verified texts but are accepted only once it is settled, so the outcome is exactly
    that of making the prompts one by one.
    """
    fresh = batch
    accepted = 0
    while True:
        for d in fresh:
            d.draws += 1
            if d.draws > _MAX_REDRAWS:
                raise BenchmarkError(
                    f"cannot make {total} distinct prompts of {target} tokens with this tokenizer "
                    f"(prompt {d.index} kept repeating an earlier one): ask for fewer prompts or longer ones"
                )
            d.text, d.verified, d.rounds = _fresh_text(tokenizer, vocab, d, target), False, 0
        pending = [d for d in batch[accepted:] if not d.verified]
        while pending:
            encodings = _encode_batch(tokenizer, [d.text for d in pending])
            for d, encoding in zip(pending, encodings, strict=True):
                _check(tokenizer, vocab, d, encoding, target)
            pending = [d for d in pending if not d.verified]
        fresh = []
        for d in batch[accepted:]:
            if d.text in seen:
                fresh = [d]
                break
            seen.add(d.text)
            accepted += 1
        if not fresh:
            return


def _check(tokenizer: Tokenizer, vocab: _Vocab, d: _Draft, encoding: Encoding, target: int) -> None:
    """Accept the draft's text if its encoding is exact, else refit it for the next round."""
    ids = encoding.ids
    head_n = d.head_ids.size
    head_ok = not head_n or ids[:head_n] == d.head_ids.tolist()
    if len(ids) == target and head_ok and vocab.forbidden.isdisjoint(ids):
        d.verified = True
        d.ids = np.asarray(ids, dtype=np.int64) if d.keep_ids else None
        return
    d.rounds += 1
    if d.rounds >= _MAX_ROUNDS:
        raise BenchmarkError(
            f"could not reach exactly {target} tokens with this tokenizer after {_MAX_ROUNDS} rounds "
            f"(last attempt: {len(ids)}); its decode/encode do not round-trip closely enough"
        )
    if not head_ok:
        # The suffix merged into the shared prefix: draw it afresh rather than refit.
        d.text = _fresh_text(tokenizer, vocab, d, target)
        return
    got = _clean(np.asarray(ids, dtype=np.int64), vocab, d.rng)
    d.text = _refit_tail(tokenizer, vocab, got, target, d.rng, d.head_text, head_n)


def _fresh_text(tokenizer: Tokenizer, vocab: _Vocab, d: _Draft, target: int) -> str:
    positions = d.rng.integers(0, vocab.pool.size, size=max(1, target - d.head_ids.size))
    return d.head_text + _render(tokenizer, vocab, positions, d.head_ids)


def _render(tokenizer: Tokenizer, vocab: _Vocab, positions: _IdArray, context: _IdArray) -> str:
    """Text of the pool's tokens at ``positions`` as it reads after ``context`` (may be empty)."""
    if vocab.words is None:
        return _decode_after(tokenizer, context[-_CONTEXT_TOKENS:], vocab.pool[positions])
    if context.size:
        return "".join(vocab.words[positions].tolist())
    # decoders treat a sequence's start specially (a Metaspace decoder strips the first space)
    return _decode(tokenizer, vocab.pool[positions[:1]]) + "".join(vocab.words[positions[1:]].tolist())


def _vocabulary(tokenizer: Tokenizer) -> _Vocab:
    """Token ids to draw prompts from, and the added/special ids a prompt must never contain.

    Preferred are *word* tokens: a space then letters, which encode back to themselves after
    another word. Their concatenation (" alpha beta gamma") is split by every common pre-tokenizer
    (byte-level regex, Metaspace, BERT whitespace) into exactly those words, so it re-encodes to
    exactly the drawn ids. From a large vocabulary, at most ``_MAX_WORDS`` of them are taken (a
    seeded sample): that is variety enough, and they then fit the tokenizer's BPE cache, so the
    checks encode several times faster than with 50K distinct words. If a vocabulary has too few
    word tokens, any ordinary token is drawn, except those that decode on their own to nothing or
    to a replacement character (byte pieces of a multi-byte character), which cut at a prompt's
    end would decode to U+FFFD and never converge.
    """
    added_tokens = tokenizer.get_added_tokens_decoder()
    added = sorted(added_tokens)
    forbidden = frozenset(added)
    by_text = tokenizer.get_vocab(with_added_tokens=True)
    every = np.fromiter(by_text.values(), dtype=np.int64, count=len(by_text))
    ids = np.sort(np.setdiff1d(every, np.array(added, dtype=np.int64), assume_unique=True))
    if ids.size == 0:
        raise BenchmarkError("the tokenizer has no ordinary (non-special) tokens to draw prompts from")
    widest = _widest([*by_text, *(t.content for t in added_tokens.values())])
    sample = ids
    if ids.size > 2 * _MAX_WORDS:
        sample = np.sort(np.random.default_rng(0).choice(ids, size=2 * _MAX_WORDS, replace=False))
    words, texts = _word_tokens(tokenizer, sample)
    if words.size < _MIN_WORD_TOKENS and sample.size < ids.size:
        words, texts = _word_tokens(tokenizer, ids)
    if words.size > _MAX_WORDS:
        keep = np.sort(np.random.default_rng(0).choice(words.size, size=_MAX_WORDS, replace=False))
        words, texts = words[keep], texts[keep]
    if words.size >= _MIN_WORD_TOKENS:
        if _joins_like_decode(tokenizer, words, texts):
            lens = np.fromiter((len(t) for t in texts.tolist()), dtype=np.int64, count=texts.size)
            return _Vocab(words, forbidden, texts, lens, max(_WINDOW_WORDS, widest))
        return _Vocab(words, forbidden)
    alone = tokenizer.decode_batch([[i] for i in ids.tolist()], skip_special_tokens=False)
    usable = np.fromiter((bool(t) and _BAD not in t for t in alone), dtype=bool, count=len(alone))
    if not usable.any():
        raise BenchmarkError("the tokenizer's ordinary tokens all decode to nothing or to U+FFFD")
    return _Vocab(ids[usable], forbidden)


# A space as tokens spell it (plain, byte-level 'Ġ', Metaspace '▁') between a character and a letter:
# where a token that spans words crosses from one word into the next.
_WORD_BREAK = re.compile(r"(?<=[^\sĠ▁])[ Ġ▁](?=[^\W\d_])")


def _widest(token_texts: list[str]) -> int:
    """The most words any token (as the vocabulary spells it, or an added token's content) spans.

    Tokens holding a newline are split at it and undercounted; they cannot occur in word prompts.
    """
    joined = "\n".join(token_texts)
    breaks: dict[int, int] = {}
    for match in _WORD_BREAK.finditer(joined):
        line = joined.rfind("\n", 0, match.start())
        breaks[line] = breaks.get(line, 0) + 1
    return 1 + max(breaks.values(), default=0)


def _word_tokens(tokenizer: Tokenizer, pool: _IdArray) -> tuple[_IdArray, NDArray[np.object_]]:
    """Tokens of ``pool`` that read ' <letters>' after another word and encode back to themselves
    there, and those texts.

    The check is after a word, not alone: a SentencePiece-style normalizer that prepends '▁' to the
    text would turn a lone ' alpha' into '▁▁alpha'.
    """
    # Any plain word will do as the token before; "a" is in every vocabulary worth benchmarking.
    a_ids = _encode(tokenizer, "a")
    anchor = int(a_ids[-1]) if a_ids.size else int(pool[0])
    prefix = tokenizer.decode([anchor], skip_special_tokens=False)
    pairs = tokenizer.decode_batch([[anchor, i] for i in pool.tolist()], skip_special_tokens=False)
    texts = [p[len(prefix) :] if p.startswith(prefix) else "" for p in pairs]
    candidate = np.fromiter(
        (len(t) > 1 and t[0] == " " and t[1:].isalpha() for t in texts), dtype=bool, count=len(texts)
    )
    picked = pool[candidate]
    if picked.size == 0:
        return picked, np.empty(0, dtype=object)
    chosen = np.array([texts[k] for k in np.flatnonzero(candidate).tolist()], dtype=object)
    encodings = _encode_batch(tokenizer, [prefix + t for t in chosen.tolist()])
    same = np.fromiter(
        (e.ids == [anchor, i] for e, i in zip(encodings, picked.tolist(), strict=True)),
        dtype=bool,
        count=picked.size,
    )
    return picked[same], chosen[same]


def _joins_like_decode(tokenizer: Tokenizer, words: _IdArray, texts: NDArray[np.object_]) -> bool:
    """Whether a join of the word texts reads exactly like the tokenizer's decode of their ids."""
    positions = np.random.default_rng(0).integers(0, words.size, size=64)
    joined = _decode(tokenizer, words[positions[:1]]) + "".join(texts[positions[1:]].tolist())
    return joined == _decode(tokenizer, words[positions])


def _encode_batch(tokenizer: Tokenizer, texts: Sequence[str]) -> list[Encoding]:
    # encode_batch_fast skips offset tracking (about twice as fast as encode, same ids) and runs the
    # batch on the tokenizer's Rust threads.
    fast = getattr(tokenizer, "encode_batch_fast", None)
    if fast is not None:
        return list(fast(list(texts), add_special_tokens=False))
    return list(tokenizer.encode_batch(list(texts), add_special_tokens=False))


def _encode(tokenizer: Tokenizer, text: str) -> _IdArray:
    return np.asarray(_encode_batch(tokenizer, [text])[0].ids, dtype=np.int64)


def _decode(tokenizer: Tokenizer, ids: _IdArray) -> str:
    return tokenizer.decode(ids.tolist(), skip_special_tokens=False)


def _draw(pool: _IdArray, k: int, rng: np.random.Generator) -> _IdArray:
    return pool[rng.integers(0, pool.size, size=k)]


def _clean(ids: _IdArray, vocab: _Vocab, rng: np.random.Generator) -> _IdArray:
    """Replace added/special ids (text that happened to spell one) by fresh ordinary ids."""
    if not vocab.forbidden:
        return ids
    bad = np.isin(ids, np.fromiter(vocab.forbidden, dtype=np.int64))
    if not bad.any():
        return ids
    out = ids.copy()
    out[bad] = _draw(vocab.pool, int(bad.sum()), rng)
    return out


def _decode_after(tokenizer: Tokenizer, context: _IdArray, ids: _IdArray) -> str:
    """Text of ``ids`` as it reads after ``context`` (decoders treat a sequence's start specially)."""
    if context.size == 0:
        return _decode(tokenizer, ids)
    before = _decode(tokenizer, context)
    both = _decode(tokenizer, np.concatenate([context, ids]))
    return both[len(before) :] if both.startswith(before) else _decode(tokenizer, ids)


def _whole(tokenizer: Tokenizer, ids: _IdArray, k: int) -> int:
    """The largest ``k' <= k`` (at most 3 less) whose cut does not split a multi-byte character."""
    for cut in range(k, max(k - 4, 0), -1):
        if not _decode(tokenizer, ids[max(0, cut - 8) : cut]).endswith(_BAD):
            return cut
    return k


def _refit_tail(
    tokenizer: Tokenizer,
    vocab: _Vocab,
    got: _IdArray,
    target: int,
    rng: np.random.Generator,
    head_text: str = "",
    keep: int = 0,
) -> str:
    """Keep the head of ``got`` and refit its last tokens so the whole should encode to ``target``.

    The first ``keep`` tokens (a shared prefix, whose text is ``head_text``) are never touched.
    Only the tail is re-encoded here (after a short context, to keep the boundary realistic); the
    caller verifies the whole text. Cuts never split a multi-byte character.
    """
    head_n = max(keep, min(got.size, target) - _TAIL_TOKENS)
    if head_n - keep < _CONTEXT_TOKENS:
        # A head this short is refitted too: decoders and normalizers treat a text's start
        # specially (a lone '▁' token decodes to nothing at the start), so it may not re-encode alone.
        head_n = keep
    if head_n > keep:
        head_n = max(keep, _whole(tokenizer, got, head_n))
    head = got[:head_n]
    context = head[-_CONTEXT_TOKENS:]
    context_text = _decode(tokenizer, context) if context.size else ""
    context_n = _encode(tokenizer, context_text).size if context_text else 0
    need = target - head_n
    tail = got[head_n : min(got.size, head_n + need)]
    for _ in range(_MAX_TAIL_ROUNDS):
        if tail.size > need:
            tail = tail[: _whole(tokenizer, tail, need)]
        if tail.size < need:
            tail = np.concatenate([tail, _draw(vocab.pool, need - tail.size, rng)])
        tail_text = _decode_after(tokenizer, context, tail)
        encoded = _clean(_encode(tokenizer, context_text + tail_text)[context_n:], vocab, rng)
        if encoded.size == need:
            tail = encoded
            break
        tail = encoded
    if keep:
        head_part = head_text + _decode_after(tokenizer, got[:keep][-_CONTEXT_TOKENS:], got[keep:head_n])
    else:
        head_part = _decode(tokenizer, head)
    return head_part + _decode_after(tokenizer, context, tail)
