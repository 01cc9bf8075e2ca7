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


def previous_turns(trace: Trace) -> list[int | None]:
    """Each request's previous turn in its session (its index), None for a first turn or a request on
    its own."""
    last: dict[str, int] = {}
    out: list[int | None] = []
    for i, r in enumerate(trace.requests):
        out.append(last.get(r.session) if r.session is not None else None)
        if r.session is not None:
            last[r.session] = i
    return out


def replay_prompts(
    trace: Trace, tokenizer: Tokenizer, seed: int, *, template_first: int = 0, template_turn: int = 0,
    thread: bool = False,
) -> list[Prompt]:  # fmt: skip
    """What a replay sends of its own for each request of ``trace``: the rebuilt prompt
    (:func:`trace_prompts`) less the chat template's ``template_first`` tokens (cut from its start, so
    that prompts still share what their blocks share), and, with ``thread``, for a session's later
    turn only its new part: the tokens past the previous prompt, its answer and ``template_turn`` (the
    replay sends the conversation so far, the real answer in it, before it). A later turn whose trace
    leaves no room for a new part (it grew by less than the answer and the template) gets one token.
    """
    full = trace_prompts(trace, tokenizer, seed)
    before = previous_turns(trace)
    out: list[Prompt] = []
    for i, prompt in enumerate(full):
        start = template_first
        prev = before[i]
        if thread and prev is not None:
            p = trace.requests[prev]
            start = p.input_tokens + p.output_tokens + template_turn
        out.append(_cut(tokenizer, prompt, start, i))
    return out


def _cut(tokenizer: Tokenizer, prompt: Prompt, start: int, index: int) -> Prompt:
    if start <= 0:
        return prompt
    ids = tokenizer.encode(prompt.text, add_special_tokens=False).ids
    start = min(start, len(ids) - 1)  # one token at least
    text = tokenizer.decode(ids[start:], skip_special_tokens=False)
    tokens = len(tokenizer.encode(text, add_special_tokens=False).ids)
    if tokens < 1:
        raise SpecError(f"trace request {index + 1}: its prompt's new part decodes to nothing")
    return Prompt(text=text, tokens=tokens)
