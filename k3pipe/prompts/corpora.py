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
- ``sharegpt`` (``k3pipe/prompts/sharegpt.py``): real conversations; a prompt is a conversation's
  distinct first human turn of ``min_input_tokens`` to ``input_tokens`` tokens, one seeded
  permutation (keyed by ``seed``) of which repeat ``k`` sends entries ``k*n`` to ``(k+1)*n - 1``.
- ``documents`` (``k3pipe/prompts/documents.py``): text files cut to windows of exactly
  ``input_tokens`` tokens, one seeded sequence (keyed by ``seed`` and ``input_tokens``) of which
  repeat ``k`` sends windows ``k*n`` to ``(k+1)*n - 1``; no prompt, nor any prefix of one, is sent
  twice.

What they share (``PromptSet``, paths and error-message pieces, the per-process cache, batched
token counts) is in ``k3pipe/prompts/corpus_tools.py``.

Every sample is deterministic for its seed and prefix-stable: the first ``m`` prompts of a larger
request are the same prompts. Token counts are the tokenizer's, without special tokens added.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from k3pipe.core.errors import BenchmarkError
from k3pipe.prompts.corpus_tools import PromptSet, _digest, _profile
from k3pipe.prompts.datasets import Prompt, random_prompts, shared_prefix_prompts
from k3pipe.prompts.documents import _documents
from k3pipe.prompts.sharegpt import _sharegpt
from k3pipe.schema.specs import (
    DatasetSpec,
    DocumentsDataset,
    RandomDataset,
    SharedPrefixDataset,
    ShareGPTDataset,
)

__all__ = ["PromptSet", "build_prompts"]


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
