"""What the sharegpt and documents prompt sets share: the ``PromptSet`` they return, paths and
error-message pieces, a per-process cache, and token counts encoded in batches.

``PromptSet`` lives here so that ``corpora`` (which re-exports it), ``sharegpt`` and ``documents``
can all build one without importing each other. Token counts are the tokenizer's, without special
tokens added; a file's texts are encoded ``_ENCODE_BATCH_CHARS`` characters at a time.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

import numpy as np
from numpy.typing import NDArray
from pydantic import BaseModel, ConfigDict, Field
from tokenizers import Tokenizer

from k3pipe.prompts.datasets import Prompt, _encode_batch
from k3pipe.schema.specs import expand_home

__all__ = ["PromptSet"]

_PATH_FIELD = "workloads[].dataset.path"
# Characters encoded per batch when counting a file's texts (about 1M tokens).
_ENCODE_BATCH_CHARS = 4_000_000
# Files (and documents samples) kept per process.
_CACHED = 4


class PromptSet(BaseModel):
    """A workload's prompts and what identifies them as an MLflow dataset input."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(
        description="Dataset name, e.g. 'random-in256-s1', 'sharegpt:<file name>', 'documents:<folder>'."
    )
    digest: str = Field(
        description="sha256 of the prompt texts in order, 16 hex digits: same spec and seed, same digest."
    )
    source: str = Field(description="Absolute path of the file or folder, or 'generated:<kind>'.")
    source_type: Literal["local", "generated"] = Field(
        description="'local' for files on this machine, 'generated' for prompts made here."
    )
    profile: dict[str, Any] = Field(
        description=(
            "JSON-able summary: kind, seed (the one the prompts were drawn with: seed + repeat for "
            "random and shared_prefix, the workload's seed for sharegpt and documents), repeat, count "
            "and prompt tokens (min, mean, max), plus the kind's own figures (conversations and how "
            "many passed the filter; documents used; for sharegpt and documents 'slice', the "
            "[start, end) of the seeded sample that this repeat sent)."
        )
    )
    prompts: list[Prompt] = Field(description="The prompts, warm-up ones first.")


def _digest(prompts: Sequence[Prompt]) -> str:
    digest = hashlib.sha256()
    for prompt in prompts:
        data = prompt.text.encode("utf-8")
        digest.update(len(data).to_bytes(8, "big"))  # lengths first: ["ab", "c"] != ["a", "bc"]
        digest.update(data)
    return digest.hexdigest()[:16]


def _profile(
    kind: str, prompts: Sequence[Prompt], seed: int, repeat: int, extra: dict[str, Any]
) -> dict[str, Any]:
    tokens = [p.tokens for p in prompts]
    return {
        "kind": kind,
        "seed": seed,
        "repeat": repeat,
        "count": len(prompts),
        "tokens_min": min(tokens) if tokens else None,
        "tokens_mean": round(sum(tokens) / len(tokens), 2) if tokens else None,
        "tokens_max": max(tokens) if tokens else None,
        **extra,
    }


def _local(
    name: str, path: Path, kind: str, prompts: list[Prompt], seed: int, repeat: int, extra: dict[str, Any]
) -> PromptSet:
    return PromptSet(
        name=name,
        digest=_digest(prompts),
        source=str(path),
        source_type="local",
        profile=_profile(kind, prompts, seed, repeat, extra),
        prompts=prompts,
    )


def _resolve(value: str, home: Path) -> Path:
    path = Path(expand_home(value, home)).expanduser()
    return Path(os.path.abspath(path))  # absolute and normalised, symlinks kept as given


def _where(value: str, path: Path) -> str:
    shown = f"{value!r}" if value == str(path) else f"{value!r} ({path})"
    return f"{_PATH_FIELD} {shown}"


def _needs(n: int, repeat: int) -> str:
    """What the request needs, for error messages: the workload's prompts, and those of the repeats."""
    if repeat == 0:
        return f"the workload needs {n} prompts (warmup_requests + num_requests)"
    return (
        f"repeat {repeat} needs {(repeat + 1) * n} in all (each of repeats 0..{repeat} sends "
        f"warmup_requests + num_requests = {n} prompts of its own, never one of another repeat)"
    )


def _fewer(repeat: int) -> str:
    """The counts to lower, for error messages."""
    return (
        "workloads[].repeats or warmup_requests + num_requests"
        if repeat
        else "warmup_requests + num_requests"
    )


_K = TypeVar("_K", bound=Hashable)
_V = TypeVar("_V")


class _Cache(Generic[_K, _V]):
    """A small least-recently-used map, safe across threads, whose values hold the tokenizer they
    were made with: keys carry ``id(tokenizer)``, and a value is only returned for that very object
    (the strong reference kept beside it stops the id from being reused meanwhile)."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._items: OrderedDict[_K, tuple[Tokenizer, _V]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: _K, tokenizer: Tokenizer) -> _V | None:
        with self._lock:
            item = self._items.get(key)
            if item is None or item[0] is not tokenizer:
                return None
            self._items.move_to_end(key)
            return item[1]

    def pop(self, key: _K, tokenizer: Tokenizer) -> _V | None:
        with self._lock:
            item = self._items.pop(key, None)
            return item[1] if item is not None and item[0] is tokenizer else None

    def put(self, key: _K, tokenizer: Tokenizer, value: _V) -> None:
        with self._lock:
            self._items[key] = (tokenizer, value)
            self._items.move_to_end(key)
            while len(self._items) > self._size:
                self._items.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


def _batches(texts: Sequence[str]) -> Iterator[tuple[int, int]]:
    """(start, end) of consecutive batches of at most _ENCODE_BATCH_CHARS characters (or one text)."""
    start = 0
    while start < len(texts):
        end, chars = start, 0
        while end < len(texts) and (end == start or chars + len(texts[end]) <= _ENCODE_BATCH_CHARS):
            chars += len(texts[end])
            end += 1
        yield start, end
        start = end


def _token_counts(tokenizer: Tokenizer, texts: Sequence[str]) -> list[int]:
    counts: list[int] = []
    for start, end in _batches(texts):
        counts.extend(len(e) for e in _encode_batch(tokenizer, texts[start:end]))
    return counts


def _token_ids(tokenizer: Tokenizer, texts: Sequence[str]) -> list[NDArray[np.int64]]:
    ids: list[NDArray[np.int64]] = []
    for start, end in _batches(texts):
        ids.extend(np.asarray(e.ids, dtype=np.int64) for e in _encode_batch(tokenizer, texts[start:end]))
    return ids
