"""A trace's prompts rebuilt from its block ids (issue 49): shared blocks shared token for token, each
prompt of exactly its length. The format itself is :mod:`k3pipe.schema.traces`."""

from __future__ import annotations

from tokenizers import Tokenizer

from k3pipe.core.errors import SpecError
from k3pipe.prompts.datasets import Prompt, tree_prompts
from k3pipe.schema.traces import Trace

__all__ = ["prompt_tree", "trace_prompts"]


def prompt_tree(trace: Trace) -> tuple[list[tuple[int | None, int]], list[int]]:
    """The trace's prompts as a tree of nodes ``(parent, tokens)`` and each request's node: a node per
    full block id (its tokens: the blocks up to it), and a leaf per request whose last block is partial
    (keyed by that block's id and the request's length). Two requests that share their first k ids
    then share k blocks' text token for token; a partial last block is shared only with a request of
    the same id and length (an engine reuses whole blocks of its own anyway).

    Raises:
        SpecError: an id seen at two places in the chain (the ids are not chained block hashes).
    """
    b = trace.block_tokens
    nodes: list[tuple[int | None, int]] = []
    full: dict[int, int] = {}  # block id -> its node
    place: dict[int, tuple[int | None, int]] = {}  # block id -> (the id before it, its depth)
    leaves: dict[tuple[int, int], int] = {}
    of_request: list[int] = []
    for n, r in enumerate(trace.requests):
        if not r.hash_ids:
            nodes.append((None, r.input_tokens))
            of_request.append(len(nodes) - 1)
            continue
        parent: int | None = None
        before: int | None = None
        whole = r.input_tokens // b
        for k, block in enumerate(r.hash_ids):
            seen = place.setdefault(block, (before, k))
            if seen != (before, k):
                raise SpecError(
                    f"trace request {n + 1}: block id {block} at block {k + 1} after id {before}, but "
                    f"earlier at block {seen[1] + 1} after id {seen[0]}: hash_ids must be chained (an id "
                    "names its block and everything before it)"
                )
            if k < whole:
                if block not in full:
                    nodes.append((parent, (k + 1) * b))
                    full[block] = len(nodes) - 1
                parent = full[block]
            else:  # the partial last block
                key = (block, r.input_tokens)
                if key not in leaves:
                    nodes.append((parent, r.input_tokens))
                    leaves[key] = len(nodes) - 1
                parent = leaves[key]
            before = block
        assert parent is not None
        of_request.append(parent)
    return nodes, of_request


def trace_prompts(trace: Trace, tokenizer: Tokenizer, seed: int) -> list[Prompt]:
    """One prompt per request of ``trace``, of exactly its ``input_tokens`` (the tokenizer's count, no
    template), sharing with every other prompt the blocks their ids share, token for token."""
    nodes, of_request = prompt_tree(trace)
    texts = tree_prompts(tokenizer, nodes, seed)
    return [texts[i] for i in of_request]
