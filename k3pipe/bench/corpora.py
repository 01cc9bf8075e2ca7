"""A workload's prompts from its dataset spec, with what MLflow records of them.

``build_prompts(workload.dataset, tokenizer, n, workload.input_tokens, workload.seed, home, k)`` is
the one entry point, called once per repeat ``k`` of the workload with the workload's own (base)
seed. It returns a ``PromptSet``: the prompts, and a name, digest, source and small profile to log
as the run's dataset input, so two runs can be checked to have sent the same prompts (same digest)
and a run says where its prompts came from.

- ``random``: random word tokens of exactly ``input_tokens`` tokens (``random_prompts``), drawn with
  seed ``seed + k``.
- ``shared_prefix``: ``groups`` random prefixes of ``prefix_tokens`` tokens, each prompt one of them
  plus a random suffix, exactly ``input_tokens`` in all (``shared_prefix_prompts``), seed ``seed + k``.
- ``sharegpt``: real conversations; a prompt is a conversation's first turn from 'human' or 'user'
  (any case), kept when it is ``min_input_tokens`` to ``input_tokens`` tokens long (its real
  length, inclusive bounds), distinct first turns only. One seeded permutation of those (keyed by
  ``seed``) serves every repeat: repeat ``k`` sends its entries ``k*n`` to ``(k+1)*n - 1``, so no
  repeat resends a prompt of another (which the prefix cache would answer). Every first turn of the
  file is counted (encoded in batches), so the profile says how many passed; the file's first turns
  and their counts are kept per process (a few files, keyed by path, mtime, size and tokenizer), so
  the repeats of a workload read and encode the file once. Random prompts cannot stand in for real
  traffic (speculative decoding accepts almost nothing on them): that is why these exist.
- ``documents``: text files cut to windows of exactly ``input_tokens`` tokens at seeded documents
  and offsets; a window is decoded from the document's ids and re-encoded to verify its length.
  Windows form one seeded sequence keyed by ``seed`` and ``input_tokens``; repeat ``k`` sends
  windows ``k*n`` to ``(k+1)*n - 1``. No two windows of the sequence start at the same (document,
  token) or have the same text, so neither a prompt nor any prefix of it is sent twice, within a
  repeat or across repeats (see ``_DocumentSample``).

Every sample is deterministic for its seed and prefix-stable: the first ``m`` prompts of a larger
request are the same prompts. Token counts are the tokenizer's, without special tokens added.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Collection, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

import numpy as np
from numpy.typing import NDArray
from pydantic import BaseModel, ConfigDict, Field
from tokenizers import Tokenizer

from k3pipe.bench.datasets import (
    _BATCH_TOKENS,
    Prompt,
    _encode_batch,
    _stream,
    random_prompts,
    shared_prefix_prompts,
)
from k3pipe.errors import BenchmarkError
from k3pipe.specs import (
    DatasetSpec,
    DocumentsDataset,
    RandomDataset,
    SharedPrefixDataset,
    ShareGPTDataset,
    expand_home,
)

__all__ = ["PromptSet", "build_prompts"]

_PATH_FIELD = "workloads[].dataset.path"
_HUMAN_ROLES = frozenset({"human", "user"})
# Characters encoded per batch when counting a file's texts (about 1M tokens).
_ENCODE_BATCH_CHARS = 4_000_000
# Exact-window rounds per cut, cuts per prompt that may fail to fit, a cap on file names in a profile.
_WINDOW_ROUNDS = 6
_WINDOW_CUTS = 8
_MAX_LISTED = 100
# Random offsets a window tries in its document before it goes through all of them in turn.
_WINDOW_DRAWS = 16
_BAD = "\ufffd"
# Kinds of random stream of the documents sample (the random kinds use 0-2 in datasets.py): the
# sequence of windows, and each window's own moves. (Not a trailing index on the first key:
# SeedSequence([..., 0]) is the same stream as SeedSequence([...]).)
_DOCUMENTS, _DOCUMENT_MOVES = 3, 4
# Files (and documents samples) kept per process.
_CACHED = 4
# Grades of a cut (_edge_grade), and what a window candidate prefers: cuts between words, or only
# between characters. A candidate is (document, offset, preferred grade).
_WORDS, _CHARACTERS = 2, 1
_Candidate = tuple[int, int, int]


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


def build_prompts(
    dataset: DatasetSpec,
    tokenizer: Tokenizer,
    n: int,
    input_tokens: int,
    seed: int,
    home: Path,
    repeat: int = 0,
) -> PromptSet:
    """``n`` prompts of the workload's dataset for repeat ``repeat``, ``input_tokens`` and ``seed``.

    ``seed`` is the workload's own seed, the same for all its repeats; ``repeat`` is the repeat's
    index (0 for a workload without repeats). Random and shared_prefix draw with ``seed + repeat``;
    sharegpt and documents take the ``repeat``-th block of ``n`` prompts of one sample keyed by
    ``seed``, so the prompts of different repeats are always different prompts. ``input_tokens`` is
    exact for random, documents and shared_prefix, the upper bound for sharegpt. Paths expand
    '{home}' to ``home`` (K3PIPE_HOME); relative paths are taken from the working directory.

    Raises:
        BenchmarkError: the dataset cannot give ``n`` such prompts for this repeat (for sharegpt and
            documents: ``(repeat + 1) * n`` distinct ones in all); the message names the field, its
            value and what to change.
    """
    if n < 0:
        raise BenchmarkError(f"number of prompts must be >= 0, got {n}")
    if input_tokens < 1:
        raise BenchmarkError(f"workloads[].input_tokens must be >= 1, got {input_tokens}")
    if repeat < 0:
        raise BenchmarkError(f"repeat must be >= 0 (the repeat's index), got {repeat}")
    if isinstance(dataset, RandomDataset):
        at = seed + repeat
        prompts = random_prompts(tokenizer, n, input_tokens, at)
        return _generated(f"random-in{input_tokens}-s{at}", "random", prompts, at, repeat, {})
    if isinstance(dataset, SharedPrefixDataset):
        at = seed + repeat
        prompts = shared_prefix_prompts(tokenizer, n, input_tokens, dataset.prefix_tokens, dataset.groups, at)
        name = f"shared_prefix-p{dataset.prefix_tokens}x{dataset.groups}-in{input_tokens}-s{at}"
        extra = {"prefix_tokens": dataset.prefix_tokens, "groups": dataset.groups}
        return _generated(name, "shared_prefix", prompts, at, repeat, extra)
    if isinstance(dataset, ShareGPTDataset):
        return _sharegpt(dataset, tokenizer, n, input_tokens, seed, home, repeat)
    if isinstance(dataset, DocumentsDataset):
        return _documents(dataset, tokenizer, n, input_tokens, seed, home, repeat)
    raise BenchmarkError(f"workloads[].dataset.kind {getattr(dataset, 'kind', dataset)!r} is not supported")


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


def _generated(
    name: str, kind: str, prompts: list[Prompt], seed: int, repeat: int, extra: dict[str, Any]
) -> PromptSet:
    return PromptSet(
        name=name,
        digest=_digest(prompts),
        source=f"generated:{kind}",
        source_type="generated",
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


# --- sharegpt -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _FirstTurns:
    """A ShareGPT file's distinct first human turns (in file order) and their token counts."""

    conversations: int
    with_human: int
    texts: list[str]
    counts: list[int]


# (path, st_mtime_ns, st_size, id(tokenizer)) -> the file's first turns under that tokenizer.
_FIRST_TURNS: _Cache[tuple[str, int, int, int], _FirstTurns] = _Cache(_CACHED)


def _sharegpt(
    spec: ShareGPTDataset,
    tokenizer: Tokenizer,
    n: int,
    input_tokens: int,
    seed: int,
    home: Path,
    repeat: int,
) -> PromptSet:
    if spec.min_input_tokens > input_tokens:
        raise BenchmarkError(
            f"workloads[].dataset.min_input_tokens ({spec.min_input_tokens}) is above the workload's "
            f"input_tokens ({input_tokens}), the longest first turn kept: no conversation can pass; "
            "lower min_input_tokens or raise input_tokens"
        )
    path = _resolve(spec.path, home)
    turns = _first_turns(spec.path, path, tokenizer)
    counts = turns.counts
    low, high = spec.min_input_tokens, input_tokens
    passed = [k for k, count in enumerate(counts) if low <= count <= high]
    first, last = repeat * n, (repeat + 1) * n
    if len(passed) < last:
        seen = f"; their first human turns are {min(counts)} to {max(counts)} tokens" if counts else ""
        raise BenchmarkError(
            f"{_where(spec.path, path)}: only {len(passed)} of its {turns.conversations} conversations "
            f"have a distinct first human turn of {low} to {high} tokens (workloads[].dataset."
            f"min_input_tokens to the workload's input_tokens){seen}, and {_needs(n, repeat)}: lower "
            f"{_fewer(repeat)}, raise input_tokens, lower dataset.min_input_tokens, or use a larger file"
        )
    # One permutation for all repeats, each taking its own block: a permutation's head, not
    # choice(), so the first m of a larger sample are the same m prompts.
    order = np.random.default_rng(seed % 2**64).permutation(len(passed))[first:last]
    chosen = [passed[j] for j in order.tolist()]
    prompts = [Prompt(text=turns.texts[k], tokens=counts[k]) for k in chosen]
    extra = {
        "file": path.name,
        "conversations": turns.conversations,
        "with_human_turn": turns.with_human,
        "distinct_first_turns": len(turns.texts),
        "passed_filter": len(passed),
        "min_input_tokens": low,
        "max_input_tokens": high,
        "slice": [first, last],
    }
    return _local(f"sharegpt:{path.name}", path, "sharegpt", prompts, seed, repeat, extra)


def _first_turns(value: str, path: Path, tokenizer: Tokenizer) -> _FirstTurns:
    """The file's distinct first human turns and their counts, read and encoded once per process
    while the file (path, mtime, size) and the tokenizer object stay the same."""
    stat = _sharegpt_file(value, path)
    key = (str(path), stat.st_mtime_ns, stat.st_size, id(tokenizer))
    cached = _FIRST_TURNS.get(key, tokenizer)
    if cached is not None:
        return cached
    conversations = _load_sharegpt(value, path)
    with_human = 0
    distinct: dict[str, None] = {}
    for k, item in enumerate(conversations):
        text = _first_human_turn(path, k, item)
        if text is not None:
            with_human += 1
            distinct[text] = None
    # The same prompt twice would be a whole-prompt prefix-cache hit the second time.
    texts = list(distinct)
    turns = _FirstTurns(len(conversations), with_human, texts, _token_counts(tokenizer, texts))
    _FIRST_TURNS.put(key, tokenizer, turns)
    return turns


def _sharegpt_file(value: str, path: Path) -> os.stat_result:
    where = _where(value, path)
    if path.is_dir():
        raise BenchmarkError(
            f"{where} is a folder: a sharegpt dataset is one JSON file (for a folder of text files "
            "use kind 'documents')"
        )
    try:
        stat = path.stat()
    except FileNotFoundError:
        stat = None
    except OSError as exc:
        raise BenchmarkError(f"cannot read {where}: {exc}") from exc
    if stat is None or not path.is_file():
        raise BenchmarkError(
            f"{where} does not exist: give the path of a ShareGPT-format JSON file ('{{home}}' "
            f"expands to K3PIPE_HOME, relative paths are taken from the working directory, {Path.cwd()})"
        )
    return stat


def _load_sharegpt(value: str, path: Path) -> list[Any]:
    where = _where(value, path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise BenchmarkError(
            f"{path} is not UTF-8 text (byte {exc.start}): a ShareGPT file is UTF-8 JSON"
        ) from exc
    except json.JSONDecodeError as exc:
        raise BenchmarkError(
            f"{path} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}; "
            "a ShareGPT file is one JSON list of conversations (not JSON Lines)"
        ) from exc
    except OSError as exc:
        raise BenchmarkError(f"cannot read {where}: {exc}") from exc
    if not isinstance(data, list):
        raise BenchmarkError(
            f"{path} holds a JSON {_json_type(data)}, "
            'not a list of conversations: ShareGPT is [{"conversations": [{"from": "human", '
            '"value": "..."}, {"from": "gpt", "value": "..."}]}, ...]'
        )
    return data


def _first_human_turn(path: Path, k: int, item: Any) -> str | None:
    """The value of the conversation's first turn from 'human' or 'user'; None when it has none."""
    turns = item.get("conversations") if isinstance(item, dict) else None
    if not isinstance(turns, list):
        raise BenchmarkError(
            f"{path}: conversation {k} has no 'conversations' list (it is {_short(item)}); each item "
            'of a ShareGPT file is {"conversations": [{"from": "human", "value": "..."}, ...]}'
        )
    for t, turn in enumerate(turns):
        if not (isinstance(turn, dict) and isinstance(turn.get("from"), str)):
            raise BenchmarkError(
                f"{path}: conversation {k}, turn {t} has no 'from' string (it is {_short(turn)}); "
                'a turn is {"from": "human" | "gpt" | ..., "value": "..."}'
            )
        if turn["from"].lower() in _HUMAN_ROLES:
            value = turn.get("value")
            if not isinstance(value, str):
                raise BenchmarkError(
                    f"{path}: conversation {k}, turn {t} (from {turn['from']!r}) has no 'value' "
                    f"string (it is {_short(turn)})"
                )
            return value
    return None


def _json_type(value: Any) -> str:
    if isinstance(value, dict):
        return "object"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    return "null"


def _short(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


# --- documents ----------------------------------------------------------------------------------


def _documents(
    spec: DocumentsDataset,
    tokenizer: Tokenizer,
    n: int,
    input_tokens: int,
    seed: int,
    home: Path,
    repeat: int,
) -> PromptSet:
    folder = _resolve(spec.path, home)
    where = _where(spec.path, folder)
    files = _document_files(spec, folder)
    stamps = tuple(_stamp(path) for path in files)
    texts = [_read_document(spec, path) for path in files]
    ids = _token_ids(tokenizer, texts)
    del texts
    lengths = [d.size for d in ids]
    candidates = [k for k, length in enumerate(lengths) if length >= input_tokens]
    if not candidates:
        longest = int(np.argmax(lengths))
        raise BenchmarkError(
            f"{where}: no document matching {spec.glob!r} has {input_tokens} "
            f"tokens (the workload's input_tokens); the longest, {files[longest].name}, has "
            f"{lengths[longest]}: lower input_tokens or add longer documents"
        )
    windows = sum(lengths[k] - input_tokens + 1 for k in candidates)
    first, last = repeat * n, (repeat + 1) * n
    if windows < last:
        raise BenchmarkError(
            f"{where}: the documents of {input_tokens}+ tokens give only {windows} distinct windows "
            f"of {input_tokens} tokens, and {_needs(n, repeat)}: lower {_fewer(repeat)} or "
            "input_tokens, or add documents"
        )
    # The windows of earlier repeats are this sample's first ones: kept per process, so repeat k
    # cuts only its own (a new process cuts those of repeats 0..k-1 again, to the same windows).
    key = (str(folder), spec.glob, stamps, id(tokenizer), seed, input_tokens)
    sample = _SAMPLES.pop(key, tokenizer)
    if sample is None or sample.lengths != lengths:
        sample = _DocumentSample(seed, input_tokens, lengths, candidates)
    names = [p.name for p in files]
    made = _Cutter(tokenizer, ids, names, where, n, repeat).extend(sample, last, keep_from=first)
    _SAMPLES.put(key, tokenizer, sample)
    cuts = sample.windows[first:last]
    texts = [
        made.get(first + k) or tokenizer.decode(ids[doc][start:end].tolist(), skip_special_tokens=False)
        for k, (doc, start, end) in enumerate(cuts)
    ]
    prompts = [Prompt(text=text, tokens=input_tokens) for text in texts]
    used = sorted({names[doc] for doc, _, _ in cuts})
    extra = {
        "folder": folder.name,
        "glob": spec.glob,
        "files": len(files),
        "files_long_enough": len(candidates),
        "files_used": used[:_MAX_LISTED],
        "files_used_count": len(used),
        "slice": [first, last],
    }
    return _local(f"documents:{folder.name}", folder, "documents", prompts, seed, repeat, extra)


def _document_files(spec: DocumentsDataset, folder: Path) -> list[Path]:
    where = _where(spec.path, folder)
    if folder.is_file():
        raise BenchmarkError(
            f"{where} is a file: a documents dataset is a folder of text files (for one ShareGPT "
            "JSON file use kind 'sharegpt')"
        )
    if not folder.is_dir():
        raise BenchmarkError(
            f"{where} does not exist: give a folder of text files ('{{home}}' expands to "
            f"K3PIPE_HOME, relative paths are taken from the working directory, {Path.cwd()})"
        )
    files = sorted(p for p in folder.glob(spec.glob) if p.is_file())
    if not files:
        held = sorted(p.name for p in folder.iterdir())
        listing = ", ".join(held[:10]) + (f" and {len(held) - 10} more" if len(held) > 10 else "")
        raise BenchmarkError(
            f"{where}: no file matches workloads[].dataset.glob {spec.glob!r}; the folder holds "
            f"{listing or 'nothing'}: set glob to match the documents"
        )
    return files


def _stamp(path: Path) -> tuple[str, int, int]:
    try:
        stat = path.stat()
    except OSError as exc:
        raise BenchmarkError(f"cannot read document {path}: {exc}") from exc
    return path.name, stat.st_mtime_ns, stat.st_size


def _read_document(spec: DocumentsDataset, path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise BenchmarkError(
            f"{path} is not UTF-8 text (byte {exc.start}): convert it, or narrow "
            f"workloads[].dataset.glob ({spec.glob!r}) to the text files"
        ) from exc
    except OSError as exc:
        raise BenchmarkError(f"cannot read document {path}: {exc}") from exc


class _DocumentSample:
    """The windows of one (documents, tokenizer, seed, size): one seeded sequence, extended on demand.

    Window ``i`` is the first of its candidates that fits and is free. Its first candidate is the
    ``i``-th draw of the sample's stream (documents in successive seeded permutations, each used as
    evenly as possible; an offset never drawn twice in a document); the others come from a stream
    of its own: more offsets of that document, then all of them in turn, then all those of the
    other documents, and at last all offsets again placed without the preference for word starts.
    A candidate offset is placed by sliding it forward to a cut between words (or only between
    characters) and fitted to exactly ``size`` tokens (``_Cutter``); it is free when neither that
    first placement nor the fitted window starts where an earlier window starts, and its text is no
    earlier window's text.

    So no two windows share a start (no prompt, nor any prefix of one, is sent twice) and window
    ``i`` depends only on the windows before it: the first ``m`` windows of a longer sequence are
    the same, however the fitting batched its encodes, and repeat ``k`` can take windows ``k*n``
    onwards knowing that repeats ``0..k-1`` sent the ones before.
    """

    def __init__(self, seed: int, size: int, lengths: list[int], candidates: list[int]) -> None:
        self.seed, self.size, self.lengths, self.candidates = seed, size, lengths, candidates
        self._rng = np.random.default_rng(np.random.SeedSequence([seed % 2**64, _DOCUMENTS, size]))
        self._order: list[int] = []
        self._drawn: dict[int, set[int]] = {k: set() for k in candidates}
        self.windows: list[tuple[int, int, int]] = []  # (document, start, end) of each window
        self.taken: set[tuple[int, int]] = set()  # (document, start) of each window
        self._texts: set[bytes] = set()  # a digest of each window's text

    def first_candidate(self) -> tuple[int, int]:
        """The next (document, offset) of the sample's stream."""
        while True:
            if not self._order:
                if all(len(self._drawn[k]) > self.lengths[k] - self.size for k in self.candidates):
                    raise AssertionError("every offset of the documents was drawn")  # checked before
                self._order = [self.candidates[j] for j in self._rng.permutation(len(self.candidates))]
            doc = self._order.pop(0)
            windows = self.lengths[doc] - self.size + 1
            if len(self._drawn[doc]) < windows:  # else this document has no undrawn offset left
                return doc, _free_offset(self._rng, windows, self._drawn[doc])

    def candidates_of(self, index: int, doc: int, offset: int) -> Iterator[_Candidate]:
        """Window ``index``'s candidates, from its first: (``doc``, ``offset``)."""
        yield doc, offset, _WORDS
        rng = _stream(self.seed, _DOCUMENT_MOVES, self.size, index)
        windows = self.lengths[doc] - self.size + 1
        given = {offset}
        for _ in range(_WINDOW_DRAWS):
            drawn = int(rng.integers(0, windows))
            if drawn not in given:
                given.add(drawn)
                yield doc, drawn, _WORDS
        others = [k for k in self.candidates if k != doc]
        docs = [doc] + [others[j] for j in rng.permutation(len(others)).tolist()]
        for want in (_WORDS, _CHARACTERS):
            for k in docs:
                for drawn in rng.permutation(self.lengths[k] - self.size + 1).tolist():
                    if not (k == doc and want == _WORDS and drawn in given):
                        yield k, drawn, want

    def clashes(self, w: _Window) -> bool:
        return (w.doc, w.first) in self.taken or (w.doc, w.start) in self.taken or w.digest in self._texts

    def accept(self, w: _Window) -> None:
        self.windows.append((w.doc, w.start, w.end))
        self.taken.add((w.doc, w.start))
        self._texts.add(w.digest)


_SAMPLES: _Cache[tuple[Any, ...], _DocumentSample] = _Cache(_CACHED)


def _free_offset(rng: np.random.Generator, windows: int, used: set[int]) -> int:
    for _ in range(16):
        offset = int(rng.integers(0, windows))
        if offset not in used:
            used.add(offset)
            return offset
    free = np.setdiff1d(np.arange(windows), np.fromiter(used, dtype=np.int64))
    offset = int(free[rng.integers(0, free.size)])
    used.add(offset)
    return offset


@dataclass
class _Window:
    """One window of a sample being fitted: its candidates, and the span of ids it now covers."""

    index: int
    candidates: Iterator[_Candidate]
    doc: int = 0
    want: int = _WORDS  # the current candidate's preferred cuts
    first: int = 0  # where the current candidate was placed first
    start: int = 0
    span: int = 0
    end: int = 0
    text: str = ""
    digest: bytes = b""
    rounds: int = 0
    count: int = 0  # the last count that was not exact
    fitted: bool = False
    stalled: bool = False  # too many candidates did not fit: wait to be the first window unsettled
    placed: set[_Candidate] = field(default_factory=set)  # (document, first, want) of its candidates
    failed: list[_Candidate] = field(default_factory=list)  # those that could not be fitted
    tried: set[tuple[int, int]] = field(default_factory=set)  # edges tried for the current one


class _Cutter:
    """Fits a sample's windows to exactly ``size`` tokens: decode a span of ids, re-encode to verify.

    A boundary can change the count: a token merged with what the cut removed, or a character that
    the tokenizer split into several tokens (byte-level BPE on accented or CJK text), which an edge
    must not split. So a window is a span of ids slid forward from its offset to the first place
    where neither edge splits a character, between words when it can (``_Edges.slide``); when the
    re-encoded count is off, the span changes by the difference and slides again (never to edges it
    tried); after a few rounds the window goes to its next candidate offset.

    The windows are fitted ``_BATCH_TOKENS // size`` at a time (each round one ``encode_batch`` of
    them: an Encoding holds ~150 bytes a token until it is dropped), and accepted in index order,
    so the outcome is that of fitting them one by one.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        ids: list[NDArray[np.int64]],
        names: list[str],
        where: str,
        n: int,
        repeat: int,
    ) -> None:
        self._tokenizer, self._ids, self._names = tokenizer, ids, names
        self._where, self._n, self._repeat = where, n, repeat
        self._edges = _Edges(tokenizer, ids)
        self._keep_from, self._kept = 0, dict[int, str]()

    def extend(self, sample: _DocumentSample, total: int, keep_from: int) -> dict[int, str]:
        """Fit windows until ``sample`` holds ``total``; the texts of those it fitted from window
        ``keep_from`` on, by index (the others are dropped as soon as they are verified)."""
        self._keep_from, self._kept = keep_from, {}
        per_batch = max(1, _BATCH_TOKENS // sample.size)
        while len(sample.windows) < total:
            lo = len(sample.windows)
            chunk = []
            for index in range(lo, min(total, lo + per_batch)):
                doc, offset = sample.first_candidate()
                w = _Window(index, sample.candidates_of(index, doc, offset))
                self._advance(sample, w)
                chunk.append(w)
            self._settle(sample, chunk)
        return self._kept

    def _settle(self, sample: _DocumentSample, chunk: list[_Window]) -> None:
        """Fit the chunk's windows and accept them in index order.

        A window whose fitted candidate clashes with an accepted window goes to its next candidate;
        the windows after it keep theirs (a candidate's fit depends on nothing else) but are
        accepted only once it is, and those that already clash with an accepted window move too.
        """
        pending = chunk
        accepted = 0
        while True:
            self._fit(sample, pending)
            pending = []
            while accepted < len(chunk):
                w = chunk[accepted]
                if w.stalled:
                    # Fitted one by one, it would have skipped the candidates whose placement an
                    # earlier window took: only the others count as failures.
                    w.failed = [c for c in w.failed if c[:2] not in sample.taken]
                    if len(w.failed) > _WINDOW_CUTS:
                        raise self._unstable(sample, w)
                    w.stalled = False
                elif not sample.clashes(w):
                    sample.accept(w)
                    if w.index >= self._keep_from:
                        self._kept[w.index] = w.text
                    w.text = ""
                    accepted += 1
                    continue
                self._advance(sample, w)
                pending.append(w)
                break
            else:
                return
            for w in chunk[accepted + 1 :]:
                if w.fitted and sample.clashes(w):
                    self._advance(sample, w)
                    pending.append(w)

    def _fit(self, sample: _DocumentSample, windows: list[_Window]) -> None:
        """Fit each window (placed, not fitted) to exactly ``size`` tokens, moving it to its next
        candidates when one cannot be, until it fits or too many candidates failed (stalled)."""
        size = sample.size
        per_batch = max(1, _BATCH_TOKENS // size)
        pending = [w for w in windows if not (w.fitted or w.stalled)]
        while pending:
            counts: list[int] = []
            for lo in range(0, len(pending), per_batch):
                batch = [w.text for w in pending[lo : lo + per_batch]]
                counts.extend(len(e) for e in _encode_batch(self._tokenizer, batch))
            still: list[_Window] = []
            for w, count in zip(pending, counts, strict=True):
                if count == size:
                    w.fitted = True
                    w.digest = hashlib.blake2b(w.text.encode("utf-8"), digest_size=16).digest()
                    if w.index < self._keep_from:
                        w.text = ""
                    continue
                w.rounds += 1
                w.span += size - count
                w.count = count
                if w.rounds < _WINDOW_ROUNDS and w.span > 0 and w.start + w.span <= self._ids[w.doc].size:
                    w.start = self._edges.slide(w.doc, w.start, w.span, w.want, w.tried)
                    self._cut(w)
                    still.append(w)
                    continue
                w.failed.append((w.doc, w.first, w.want))
                if len(w.failed) > _WINDOW_CUTS:
                    w.stalled, w.text = True, ""
                    continue
                self._advance(sample, w)
                still.append(w)
            pending = still

    def _advance(self, sample: _DocumentSample, w: _Window) -> None:
        """Place ``w`` at its next candidate whose first placement is new to it and not taken."""
        for doc, offset, want in w.candidates:
            first = self._edges.slide(doc, offset, sample.size, want)
            if (doc, first, want) in w.placed or (doc, first) in sample.taken:
                continue
            w.placed.add((doc, first, want))
            w.doc, w.want, w.first, w.start, w.span = doc, want, first, first, sample.size
            w.rounds, w.fitted = 0, False
            w.tried = set()
            self._cut(w)
            return
        raise BenchmarkError(
            f"{self._where}: no free window of {sample.size} tokens is left for prompt {w.index} of "
            f"the sample, and {_needs(self._n, self._repeat)}: every prompt starts at a (document, "
            "token) of its own, never inside a character, and all such starts of the documents of "
            f"{sample.size}+ tokens are taken or do not re-encode to exactly {sample.size} tokens; "
            f"lower {_fewer(self._repeat)} or input_tokens, or add documents"
        )

    def _cut(self, w: _Window) -> None:
        doc = self._ids[w.doc]
        w.end = min(doc.size, w.start + w.span)
        w.tried.add((w.start, w.end))
        w.text = self._tokenizer.decode(doc[w.start : w.end].tolist(), skip_special_tokens=False)

    def _unstable(self, sample: _DocumentSample, w: _Window) -> BenchmarkError:
        where = f"{self._where}: could not cut a window of exactly {sample.size} tokens for prompt {w.index}"
        if w.want == _CHARACTERS:  # the starts between words were all taken or failed already
            return BenchmarkError(
                f"{where} at a start of its own: the starts between words are all taken or do not "
                f"re-encode exactly, nor did the {len(w.failed)} other starts it tried; "
                f"{_needs(self._n, self._repeat)}: lower {_fewer(self._repeat)} or input_tokens, or "
                "add documents"
            )
        return BenchmarkError(
            f"{where} at {len(w.failed)} offsets (the last in document {self._names[w.doc]}, "
            f"last count: {w.count}): its text does not re-encode stably at these boundaries; try "
            "another seed or input_tokens"
        )


class _Edges:
    """Where a document's windows may be cut: each cut graded once (``_edge_grade``), then kept."""

    def __init__(self, tokenizer: Tokenizer, ids: list[NDArray[np.int64]]) -> None:
        self._tokenizer, self._ids = tokenizer, ids
        self._grades: dict[int, dict[int, int]] = {}

    def grade(self, doc: int, k: int) -> int:
        grades = self._grades.setdefault(doc, {})
        if k not in grades:
            grades[k] = _edge_grade(self._tokenizer, self._ids[doc], k)
        return grades[k]

    def slide(
        self, doc: int, start: int, span: int, want: int, tried: Collection[tuple[int, int]] = ()
    ) -> int:
        """Where a window of ``span`` ids at ``start`` moves: forward to untried edges, between words
        if ``want`` is _WORDS and there are such edges near, never inside a character; ``start``
        itself when there are none.

        Edges between words also keep the count: a word cut in two may re-encode into other pieces.
        """
        length = self._ids[doc].size
        tiers = ((_WORDS, 32), (_CHARACTERS, 16)) if want == _WORDS else ((_CHARACTERS, 16),)
        for grade, shifts in tiers:
            for shift in range(shifts):
                at = start + shift
                if at + span > length:
                    break
                if (at, at + span) not in tried and min(
                    self.grade(doc, at), self.grade(doc, at + span)
                ) >= grade:
                    return at
        return start


def _edge_grade(tokenizer: Tokenizer, doc: NDArray[np.int64], k: int) -> int:
    """A cut before token ``k``: 2 before a space (token ``k`` starts a word: text on either side
    re-encodes alone as it did in the document), 1 between characters, 0 inside a character (a
    byte-level tokenizer splits some characters)."""
    if k <= 0 or k >= doc.size:
        return 2
    left = tokenizer.decode(doc[max(0, k - 8) : k].tolist(), skip_special_tokens=False)
    both = tokenizer.decode(doc[max(0, k - 8) : k + 8].tolist(), skip_special_tokens=False)
    if not both.startswith(left) or left.endswith(_BAD):
        return 0
    right = both[len(left) :]
    if right.startswith(_BAD):
        return 0
    return 2 if right[:1] == " " else 1
