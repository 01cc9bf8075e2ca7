"""Benchmark prompts: random token sequences of an exact length under the model's own tokenizer.

The study's "Random" dataset: each prompt is text that the served model's tokenizer encodes to
exactly ``input_tokens`` tokens (no special tokens added, none contained), so a 64K or 200K workload
really sends 64K or 200K prompt tokens (plus whatever the chat template adds on the server).

How a prompt is made (no per-token Python loops): token ids are drawn with numpy, decoded to text and
re-encoded to verify the exact length. Ids are drawn from the vocabulary's *word* tokens (a space then
letters) when it has enough of them, because their concatenation re-encodes to the same ids, so one
encode usually settles it; otherwise from all ordinary tokens (added/special tokens are never drawn).
When the re-encoded count is off (tokens merged or split across their boundaries), the ids are
trimmed or padded; tokenization is local, so only the last few dozen tokens are refitted against a
short encoded context before the whole text is verified again. A few rounds at most; if the length
cannot be reached, ``BenchmarkError``. The cost is dominated by encoding the whole text once or
twice (a 200K-token prompt: about 0.3 s with a 2K vocabulary, 0.6 s with a 64K one, on 2 cores).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from numpy.typing import NDArray
from pydantic import BaseModel, ConfigDict, Field
from tokenizers import Tokenizer

from k3pipe.errors import BenchmarkError

__all__ = ["Prompt", "load_tokenizer", "random_prompts"]

# Full-text encode/verify rounds, tail refits per round, tokens refitted at the tail, context tokens.
_MAX_ROUNDS = 6
_MAX_TAIL_ROUNDS = 12
_TAIL_TOKENS = 64
_CONTEXT_TOKENS = 32
# Redraws of one prompt when it repeats an earlier one.
_MAX_REDRAWS = 32
# Fewer word tokens than this and prompts are drawn from the whole ordinary vocabulary.
_MIN_WORD_TOKENS = 256

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

    Deterministic for a seed, and prompt ``i`` depends only on ``(seed, i)``: the first ``k`` prompts
    of a larger request are the same prompts. Prompts never contain added or special tokens (the
    ids of the final encoding are checked), and the count is for ``encode(text,
    add_special_tokens=False)``.

    Raises:
        BenchmarkError: the exact length or ``n`` distinct prompts cannot be reached with this
            tokenizer, or its vocabulary has no ordinary tokens.
    """
    if n < 0:
        raise BenchmarkError(f"number of prompts must be >= 0, got {n}")
    if input_tokens < 1:
        raise BenchmarkError(f"input_tokens must be >= 1, got {input_tokens}")
    pool, forbidden = _vocabulary(tokenizer)
    prompts: list[Prompt] = []
    seen: set[str] = set()
    for i in range(n):
        rng = np.random.default_rng(np.random.SeedSequence([seed % 2**64, i]))
        for _ in range(_MAX_REDRAWS):
            text = _exact_text(tokenizer, pool, forbidden, input_tokens, rng)
            if text not in seen:
                break
        else:
            raise BenchmarkError(
                f"cannot make {n} distinct prompts of {input_tokens} tokens with this tokenizer "
                f"(prompt {i} kept repeating an earlier one): ask for fewer prompts or longer ones"
            )
        seen.add(text)
        prompts.append(Prompt(text=text, tokens=input_tokens))
    return prompts


def _vocabulary(tokenizer: Tokenizer) -> tuple[_IdArray, _IdArray]:
    """Token ids to draw prompts from, and the added/special ids a prompt must never contain.

    Preferred are *word* tokens: a space then letters, which encode back to themselves. Their
    concatenation (" alpha beta gamma") is split by every common pre-tokenizer (byte-level regex,
    Metaspace, BERT whitespace) into exactly those words, so it usually re-encodes to exactly the
    drawn ids and a single verifying encode suffices. If a vocabulary has too few of them, any
    ordinary token is drawn, except those that decode on their own to nothing or to a replacement
    character (byte pieces of a multi-byte character), which cut at a prompt's end would decode to
    U+FFFD and never converge.
    """
    added = np.array(sorted(tokenizer.get_added_tokens_decoder()), dtype=np.int64)
    ids = np.array(sorted(set(tokenizer.get_vocab(with_added_tokens=True).values())), dtype=np.int64)
    ids = np.setdiff1d(ids, added)
    if ids.size == 0:
        raise BenchmarkError("the tokenizer has no ordinary (non-special) tokens to draw prompts from")
    words = _word_tokens(tokenizer, ids)
    if words.size >= _MIN_WORD_TOKENS:
        return words, added
    alone = tokenizer.decode_batch([[i] for i in ids.tolist()], skip_special_tokens=False)
    usable = np.fromiter((bool(t) and _BAD not in t for t in alone), dtype=bool, count=len(alone))
    if not usable.any():
        raise BenchmarkError("the tokenizer's ordinary tokens all decode to nothing or to U+FFFD")
    return ids[usable], added


def _word_tokens(tokenizer: Tokenizer, pool: _IdArray) -> _IdArray:
    """Tokens that read ' <letters>' after another token and encode back to themselves alone."""
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
        return picked
    chosen = [texts[k] for k in np.flatnonzero(candidate).tolist()]
    encodings = tokenizer.encode_batch_fast(chosen, add_special_tokens=False)
    same = np.fromiter(
        (e.ids == [i] for e, i in zip(encodings, picked.tolist(), strict=True)),
        dtype=bool,
        count=picked.size,
    )
    return picked[same]


def _encode(tokenizer: Tokenizer, text: str) -> _IdArray:
    # encode_batch_fast skips offset tracking: about twice as fast as encode, same ids.
    fast = getattr(tokenizer, "encode_batch_fast", None)
    enc = (
        fast([text], add_special_tokens=False)[0]
        if fast
        else tokenizer.encode(text, add_special_tokens=False)
    )
    return np.asarray(enc.ids, dtype=np.int64)


def _decode(tokenizer: Tokenizer, ids: _IdArray) -> str:
    return tokenizer.decode(ids.tolist(), skip_special_tokens=False)


def _draw(pool: _IdArray, k: int, rng: np.random.Generator) -> _IdArray:
    return pool[rng.integers(0, pool.size, size=k)]


def _clean(ids: _IdArray, forbidden: _IdArray, pool: _IdArray, rng: np.random.Generator) -> _IdArray:
    """Replace added/special ids (text that happened to spell one) by fresh ordinary ids."""
    bad = np.isin(ids, forbidden)
    if not bad.any():
        return ids
    out = ids.copy()
    out[bad] = _draw(pool, int(bad.sum()), rng)
    return out


def _exact_text(
    tokenizer: Tokenizer, pool: _IdArray, forbidden: _IdArray, target: int, rng: np.random.Generator
) -> str:
    text = _decode(tokenizer, _draw(pool, target, rng))
    got = np.empty(0, dtype=np.int64)
    for _ in range(_MAX_ROUNDS):
        got = _encode(tokenizer, text)
        if got.size == target and not np.isin(got, forbidden).any():
            return text
        text = _refit_tail(tokenizer, pool, forbidden, _clean(got, forbidden, pool, rng), target, rng)
    raise BenchmarkError(
        f"could not reach exactly {target} tokens with this tokenizer after {_MAX_ROUNDS} rounds "
        f"(last attempt: {got.size}); its decode/encode do not round-trip closely enough"
    )


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
    pool: _IdArray,
    forbidden: _IdArray,
    got: _IdArray,
    target: int,
    rng: np.random.Generator,
) -> str:
    """Keep the head of ``got`` and refit its last tokens so the whole should encode to ``target``.

    Only the tail is re-encoded here (after a short context, to keep the boundary realistic); the
    caller verifies the whole text. Cuts never split a multi-byte character.
    """
    head_n = max(0, min(got.size, target) - _TAIL_TOKENS)
    if head_n:
        head_n = _whole(tokenizer, got, head_n)
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
            tail = np.concatenate([tail, _draw(pool, need - tail.size, rng)])
        tail_text = _decode_after(tokenizer, context, tail)
        encoded = _clean(_encode(tokenizer, context_text + tail_text)[context_n:], forbidden, pool, rng)
        if encoded.size == need:
            tail = encoded
            break
        tail = encoded
    return _decode(tokenizer, head) + _decode_after(tokenizer, context, tail)
