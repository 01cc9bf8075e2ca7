"""A workload's prompts from its dataset spec, with what MLflow records of them.

``build_prompts(workload.dataset, tokenizer, n, workload.input_tokens, workload.seed, home)`` is
the one entry point. It returns a ``PromptSet``: the prompts, and a name, digest, source and small
profile to log as the run's dataset input, so two runs can be checked to have sent the same prompts
(same digest) and a run says where its prompts came from.

- ``random``: random word tokens of exactly ``input_tokens`` tokens (``random_prompts``).
- ``shared_prefix``: ``groups`` random prefixes of ``prefix_tokens`` tokens, each prompt one of them
  plus a random suffix, exactly ``input_tokens`` in all (``shared_prefix_prompts``).
- ``sharegpt``: real conversations; a prompt is a conversation's first turn from 'human' or 'user'
  (any case), kept when it is ``min_input_tokens`` to ``input_tokens`` tokens long (its real
  length, inclusive bounds), ``n`` distinct ones drawn with the seed. Every first turn of the file
  is counted (encoded in batches), so the profile says how many passed. Random prompts cannot stand
  in for real traffic (speculative decoding accepts almost nothing on them): that is why these exist.
- ``documents``: text files cut to windows of exactly ``input_tokens`` tokens at seeded documents
  and offsets; a window is decoded from the document's ids and re-encoded to verify its length.

Every sample is seeded by the workload's seed and prefix-stable: the first ``k`` prompts of a larger
request are the same prompts (for documents, unless a window had to move to another offset because
its edges did not re-encode exactly). Token counts are the tokenizer's, without special tokens added.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray
from pydantic import BaseModel, ConfigDict, Field
from tokenizers import Tokenizer

from k3pipe.bench.datasets import (
    Prompt,
    _encode_batch,
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
# Characters encoded per batch (an Encoding holds ~150 bytes a token until it is dropped).
_ENCODE_BATCH_CHARS = 4_000_000
# Exact-window rounds per cut, cuts per prompt, and a cap on file names listed in a profile.
_WINDOW_ROUNDS = 6
_WINDOW_CUTS = 8
_MAX_LISTED = 100
_BAD = "\ufffd"
# Kind of random stream of the documents sample (the random kinds have their own in datasets.py).
_DOCUMENTS = 3


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
            "JSON-able summary: kind, seed, count and prompt tokens (min, mean, max), plus the "
            "kind's own figures (conversations and how many passed the filter; documents used)."
        )
    )
    prompts: list[Prompt] = Field(description="The prompts, warm-up ones first.")


def build_prompts(
    dataset: DatasetSpec, tokenizer: Tokenizer, n: int, input_tokens: int, seed: int, home: Path
) -> PromptSet:
    """``n`` prompts of the workload's dataset, for ``input_tokens`` and ``seed``.

    ``input_tokens`` is exact for random, documents and shared_prefix, the upper bound for sharegpt.
    Paths expand '{home}' to ``home`` (K3PIPE_HOME); relative paths are taken from the working
    directory.

    Raises:
        BenchmarkError: the dataset cannot give ``n`` such prompts; the message names the field, its
            value and what to change.
    """
    if n < 0:
        raise BenchmarkError(f"number of prompts must be >= 0, got {n}")
    if input_tokens < 1:
        raise BenchmarkError(f"workloads[].input_tokens must be >= 1, got {input_tokens}")
    if isinstance(dataset, RandomDataset):
        prompts = random_prompts(tokenizer, n, input_tokens, seed)
        return _generated(f"random-in{input_tokens}-s{seed}", "random", prompts, seed, {})
    if isinstance(dataset, SharedPrefixDataset):
        prompts = shared_prefix_prompts(
            tokenizer, n, input_tokens, dataset.prefix_tokens, dataset.groups, seed
        )
        name = f"shared_prefix-p{dataset.prefix_tokens}x{dataset.groups}-in{input_tokens}-s{seed}"
        extra = {"prefix_tokens": dataset.prefix_tokens, "groups": dataset.groups}
        return _generated(name, "shared_prefix", prompts, seed, extra)
    if isinstance(dataset, ShareGPTDataset):
        return _sharegpt(dataset, tokenizer, n, input_tokens, seed, home)
    if isinstance(dataset, DocumentsDataset):
        return _documents(dataset, tokenizer, n, input_tokens, seed, home)
    raise BenchmarkError(f"workloads[].dataset.kind {getattr(dataset, 'kind', dataset)!r} is not supported")


def _digest(prompts: Sequence[Prompt]) -> str:
    digest = hashlib.sha256()
    for prompt in prompts:
        data = prompt.text.encode("utf-8")
        digest.update(len(data).to_bytes(8, "big"))  # lengths first: ["ab", "c"] != ["a", "bc"]
        digest.update(data)
    return digest.hexdigest()[:16]


def _profile(kind: str, prompts: Sequence[Prompt], seed: int, extra: dict[str, Any]) -> dict[str, Any]:
    tokens = [p.tokens for p in prompts]
    return {
        "kind": kind,
        "seed": seed,
        "count": len(prompts),
        "tokens_min": min(tokens) if tokens else None,
        "tokens_mean": round(sum(tokens) / len(tokens), 2) if tokens else None,
        "tokens_max": max(tokens) if tokens else None,
        **extra,
    }


def _generated(name: str, kind: str, prompts: list[Prompt], seed: int, extra: dict[str, Any]) -> PromptSet:
    return PromptSet(
        name=name,
        digest=_digest(prompts),
        source=f"generated:{kind}",
        source_type="generated",
        profile=_profile(kind, prompts, seed, extra),
        prompts=prompts,
    )


def _resolve(value: str, home: Path) -> Path:
    path = Path(expand_home(value, home)).expanduser()
    return Path(os.path.abspath(path))  # absolute and normalised, symlinks kept as given


def _where(value: str, path: Path) -> str:
    shown = f"{value!r}" if value == str(path) else f"{value!r} ({path})"
    return f"{_PATH_FIELD} {shown}"


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


def _sharegpt(
    spec: ShareGPTDataset, tokenizer: Tokenizer, n: int, input_tokens: int, seed: int, home: Path
) -> PromptSet:
    if spec.min_input_tokens > input_tokens:
        raise BenchmarkError(
            f"workloads[].dataset.min_input_tokens ({spec.min_input_tokens}) is above the workload's "
            f"input_tokens ({input_tokens}), the longest first turn kept: no conversation can pass; "
            "lower min_input_tokens or raise input_tokens"
        )
    path = _resolve(spec.path, home)
    conversations = _load_sharegpt(spec.path, path)
    with_human = 0
    distinct: dict[str, None] = {}
    for k, item in enumerate(conversations):
        text = _first_human_turn(path, k, item)
        if text is not None:
            with_human += 1
            distinct[text] = None
    # The same prompt twice would be a whole-prompt prefix-cache hit the second time.
    firsts = list(distinct)
    counts = _token_counts(tokenizer, firsts)
    low, high = spec.min_input_tokens, input_tokens
    passed = [k for k, count in enumerate(counts) if low <= count <= high]
    if len(passed) < n:
        seen = f"; their first human turns are {min(counts)} to {max(counts)} tokens" if counts else ""
        raise BenchmarkError(
            f"{_where(spec.path, path)}: only {len(passed)} of its {len(conversations)} conversations "
            f"have a distinct first human turn of {low} to {high} tokens (dataset.min_input_tokens to the "
            f"workload's input_tokens){seen}, and the workload needs {n} prompts: lower "
            "warmup_requests + num_requests, raise input_tokens, lower dataset.min_input_tokens, or "
            "use a larger file"
        )
    # A permutation's head, not choice(): the first k of a larger sample are the same k prompts.
    order = np.random.default_rng(seed % 2**64).permutation(len(passed))[:n]
    chosen = [passed[j] for j in order.tolist()]
    prompts = [Prompt(text=firsts[k], tokens=counts[k]) for k in chosen]
    extra = {
        "file": path.name,
        "conversations": len(conversations),
        "with_human_turn": with_human,
        "distinct_first_turns": len(firsts),
        "passed_filter": len(passed),
        "min_input_tokens": low,
        "max_input_tokens": high,
    }
    return PromptSet(
        name=f"sharegpt:{path.name}",
        digest=_digest(prompts),
        source=str(path),
        source_type="local",
        profile=_profile("sharegpt", prompts, seed, extra),
        prompts=prompts,
    )


def _load_sharegpt(value: str, path: Path) -> list[Any]:
    where = _where(value, path)
    if path.is_dir():
        raise BenchmarkError(
            f"{where} is a folder: a sharegpt dataset is one JSON file (for a folder of text files "
            "use kind 'documents')"
        )
    if not path.is_file():
        raise BenchmarkError(
            f"{where} does not exist: give the path of a ShareGPT-format JSON file ('{{home}}' "
            f"expands to K3PIPE_HOME, relative paths are taken from the working directory, {Path.cwd()})"
        )
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
    spec: DocumentsDataset, tokenizer: Tokenizer, n: int, input_tokens: int, seed: int, home: Path
) -> PromptSet:
    folder = _resolve(spec.path, home)
    files = _document_files(spec, folder)
    texts = [_read_document(spec, path) for path in files]
    ids = _token_ids(tokenizer, texts)
    lengths = [d.size for d in ids]
    candidates = [k for k, length in enumerate(lengths) if length >= input_tokens]
    if not candidates:
        longest = int(np.argmax(lengths))
        raise BenchmarkError(
            f"{_where(spec.path, folder)}: no document matching {spec.glob!r} has {input_tokens} "
            f"tokens (the workload's input_tokens); the longest, {files[longest].name}, has "
            f"{lengths[longest]}: lower input_tokens or add longer documents"
        )
    windows = sum(lengths[k] - input_tokens + 1 for k in candidates)
    if windows < n:
        raise BenchmarkError(
            f"{_where(spec.path, folder)}: the documents of {input_tokens}+ tokens give only {windows} "
            f"distinct windows of {input_tokens} tokens, and the workload needs {n} prompts: lower "
            "warmup_requests + num_requests or input_tokens, or add documents"
        )
    rng = np.random.default_rng(np.random.SeedSequence([seed % 2**64, _DOCUMENTS, input_tokens]))
    cuts, used_offsets = _place_windows(rng, candidates, lengths, input_tokens, n)
    names = [p.name for p in files]
    prompts = _cut_windows(tokenizer, ids, cuts, used_offsets, input_tokens, rng, names)
    used = sorted({files[doc].name for doc, _ in cuts})
    extra = {
        "folder": folder.name,
        "glob": spec.glob,
        "files": len(files),
        "files_long_enough": len(candidates),
        "files_used": used[:_MAX_LISTED],
        "files_used_count": len(used),
    }
    return PromptSet(
        name=f"documents:{folder.name}",
        digest=_digest(prompts),
        source=str(folder),
        source_type="local",
        profile=_profile("documents", prompts, seed, extra),
        prompts=prompts,
    )


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


def _place_windows(
    rng: np.random.Generator, candidates: list[int], lengths: list[int], size: int, n: int
) -> tuple[list[tuple[int, int]], dict[int, set[int]]]:
    """(document, offset) of each prompt, and the offsets taken per document: documents in
    successive seeded permutations (each used as evenly as possible), offsets seeded and never
    repeated within a document."""
    used: dict[int, set[int]] = {k: set() for k in candidates}
    order: list[int] = []
    cuts: list[tuple[int, int]] = []
    while len(cuts) < n:
        if not order:
            order = [candidates[j] for j in rng.permutation(len(candidates)).tolist()]
        doc = order.pop(0)
        windows = lengths[doc] - size + 1
        if len(used[doc]) >= windows:
            continue  # this document has no unused window left
        cuts.append((doc, _free_offset(rng, windows, used[doc])))
    return cuts, used


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


def _cut_windows(
    tokenizer: Tokenizer,
    ids: list[NDArray[np.int64]],
    cuts: list[tuple[int, int]],
    used: dict[int, set[int]],
    size: int,
    rng: np.random.Generator,
    names: list[str],
) -> list[Prompt]:
    """Each cut's text, exactly ``size`` tokens: decode the id window, re-encode (batched) to verify.

    A boundary can change the count: a token merged with what the cut removed, or a character that
    the tokenizer split into several tokens (byte-level BPE on accented or CJK text), which an edge
    must not split. So a window is a span of ids slid forward from its offset to the first place
    where neither edge splits a character; when the re-encoded count is off, the span changes by
    the difference and slides again (never to edges it tried); after a few rounds the cut moves to
    another offset of the same document.
    """
    windows = [_Window(doc, offset, size) for doc, offset in cuts]
    pending = list(windows)
    while pending:
        for w in pending:
            _place(tokenizer, ids[w.doc], w)
        counts = [len(e) for e in _encode_batch(tokenizer, [w.text for w in pending])]
        still: list[_Window] = []
        for w, count in zip(pending, counts, strict=True):
            if count == size:
                continue
            still.append(w)
            w.rounds += 1
            w.span += size - count
            length = ids[w.doc].size
            if w.rounds < _WINDOW_ROUNDS and w.span > 0 and w.start + w.span <= length:
                continue
            windows_in_doc = length - size + 1
            w.moves += 1
            if w.moves > _WINDOW_CUTS or len(used[w.doc]) >= windows_in_doc:
                raise BenchmarkError(
                    f"could not cut a window of exactly {size} tokens from document {names[w.doc]} "
                    f"at {w.moves} offsets (last count: {count}): its text does not re-encode stably "
                    "at these boundaries; try another seed or input_tokens"
                )
            w.start, w.span, w.rounds = _free_offset(rng, windows_in_doc, used[w.doc]), size, 0
            w.tried.clear()
        pending = still
    return [Prompt(text=w.text, tokens=size) for w in windows]


@dataclass
class _Window:
    """A span of a document's token ids being fitted to an exact length."""

    doc: int
    start: int
    span: int
    end: int = 0
    text: str = ""
    rounds: int = 0
    moves: int = 0
    tried: set[tuple[int, int]] = field(default_factory=set)


def _place(tokenizer: Tokenizer, doc: NDArray[np.int64], w: _Window) -> None:
    """Slide the window to untried edges, preferably between words, never inside a character.

    Edges between words also keep the count: a word cut in two may re-encode into other pieces.
    """
    grades: dict[int, int] = {}

    def grade(k: int) -> int:
        if k not in grades:
            grades[k] = _edge_grade(tokenizer, doc, k)
        return grades[k]

    start = w.start
    for want, shifts in ((2, 32), (1, 16)):
        found = next(
            (
                w.start + shift
                for shift in range(shifts)
                if w.start + shift + w.span <= doc.size
                and (w.start + shift, w.start + shift + w.span) not in w.tried
                and min(grade(w.start + shift), grade(w.start + shift + w.span)) >= want
            ),
            None,
        )
        if found is not None:
            start = found
            break
    w.start, w.end = start, min(doc.size, start + w.span)
    w.tried.add((w.start, w.end))
    w.text = tokenizer.decode(doc[w.start : w.end].tolist(), skip_special_tokens=False)


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
