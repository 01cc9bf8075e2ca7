"""The ``sharegpt`` prompt set: real conversations' first human turns.

A prompt is a conversation's first turn from 'human' or 'user' (any case), kept when it is
``min_input_tokens`` to ``input_tokens`` tokens long (its real length, inclusive bounds), distinct
first turns only. One seeded permutation of those (keyed by ``seed``) serves every repeat: repeat
``k`` sends its entries ``k*n`` to ``(k+1)*n - 1``, so no repeat resends a prompt of another (which
the prefix cache would answer). Every first turn of the file is counted (encoded in batches), so the
profile says how many passed; the file's first turns and their counts are kept per process (a few
files, keyed by path, mtime, size and tokenizer), so the repeats of a workload read and encode the
file once. Random prompts cannot stand in for real traffic (speculative decoding accepts almost
nothing on them): that is why these exist.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from k3pipe.core.errors import BenchmarkError
from k3pipe.prompts.corpus_tools import (
    _CACHED,
    PromptSet,
    _Cache,
    _fewer,
    _local,
    _needs,
    _resolve,
    _token_counts,
    _where,
)
from k3pipe.prompts.datasets import Prompt
from k3pipe.schema.specs import ShareGPTDataset

__all__: list[str] = []

_HUMAN_ROLES = frozenset({"human", "user"})


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
