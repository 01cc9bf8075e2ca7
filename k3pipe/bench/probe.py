"""The output probe's requests: what an engine answers to a fixed prompt, greedily, and how it scores
a fixed continuation teacher-forced (issue 47; the statistics are :mod:`k3pipe.verdicts.answers`).

Each probe prompt is token ids (so every arm is sent exactly the same tokens, whatever its
tokenizer's round trip does to text) with a fixed continuation of token ids. Two requests per prompt,
neither streamed (no timing is taken from them), each waited for before the next, so every arm sees
the same order and batch (engines are not batch-invariant: the same prompt sent alone and among
others already differs, docs/measurement.md):

- **greedy**: the prompt, ``temperature`` 0, ``max_tokens`` the probe's length with the end of
  sequence ignored, so every arm answers the same number of tokens; the continuation's token ids;
- **teacher-forced**: prompt + continuation, one token asked for, and the log-probability the engine
  gives each token of the prompt; those of the continuation's positions are kept.

Dialects, each from the engine's own source (the request and response models are pinned by the
fixtures under tests/fixtures/engines/*/probe-*.json):

- ``vllm``: ``POST /v1/completions`` with ``prompt`` as a list of token ids, vLLM's ``ignore_eos``,
  ``return_token_ids`` (the choice's ``token_ids``) and ``prompt_logprobs`` (the choice's
  ``prompt_logprobs``: one entry per prompt token, the first null, each a map of token id to
  ``{"logprob", "rank", "decoded_token"}`` that holds the prompt's own token beside the top ones;
  vllm/entrypoints/openai/completion/protocol.py, ``CompletionRequest`` and
  ``CompletionResponseChoice``; 0.22 and 0.32 alike). The OpenAI-compatible path, so it goes through
  a gateway and the arm's key like the workloads. Greedy asks for ``repetition_penalty`` 1 and no
  presence or frequency penalty explicitly: vLLM takes the model's ``generation_config.json`` defaults
  otherwise, and a penalty applies under temperature 0 too.
- ``sglang``: SGLang's native ``POST /generate`` (its ``/v1/completions`` takes token-id prompts but
  returns no token ids and scores no prompt: ``prompt_logprobs`` and ``return_token_ids`` are dropped
  silently), on the server's root. ``input_ids`` and ``sampling_params`` (temperature 0 is top-k 1
  there; ``ignore_eos``), ``return_logprob``; the greedy continuation is ``output_ids``. Scoring:
  ``logprob_start_len`` one before the continuation, because SGLang leaves the position at
  ``logprob_start_len`` unscored (``meta_info.input_token_logprobs`` starts with a null entry), then
  entries ``[logprob, token_id, text]`` for the continuation's tokens (sglang 0.5.16,
  managers/io_struct.py ``GenerateReqInput``, tokenizer_manager.py ``add_logprob_to_meta_info``,
  scheduler_components/logprob_result_processor.py). Not through an OpenAI gateway.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit

import httpx
from tokenizers import Tokenizer

from k3pipe.core.errors import BenchmarkError
from k3pipe.core.http import tls
from k3pipe.verdicts.answers import ProbeAnswer

__all__ = [
    "DIALECTS",
    "ProbePrompt",
    "ProbeRecord",
    "ask",
    "dialect_of",
    "draw_prompts",
    "greedy_body",
    "parse_greedy",
    "parse_scored",
    "prompts_digest",
    "read_record",
    "run_probe",
    "scored_body",
]

Dialect = Literal["vllm", "sglang"]
DIALECTS: tuple[Dialect, ...] = ("vllm", "sglang")


@dataclass(frozen=True)
class ProbePrompt:
    """One probe prompt: its id, its token ids, and the fixed continuation scored teacher-forced."""

    prompt_id: str
    tokens: tuple[int, ...]
    continuation: tuple[int, ...]


def dialect_of(engine: str) -> Dialect:
    """The probe's dialect for an engine kind: SGLang's native API for ``sglang``, else vLLM's
    completions (an external or unknown engine is asked the vLLM way; one that does not take it is
    recorded as not answering the probe)."""
    return "sglang" if engine == "sglang" else "vllm"


def draw_prompts(
    tokenizer: Tokenizer, count: int, prompt_tokens: int, continuation_tokens: int, seed: int
) -> list[ProbePrompt]:
    """``count`` probe prompts of random token ids, each ``prompt_tokens`` long with a continuation of
    ``continuation_tokens``: ids of the tokenizer's own vocabulary, never an added or special token
    (an end of sequence inside a prompt would end nothing, but a chat marker would change what it
    asks). Deterministic for ``(seed, lengths, tokenizer)``: every arm and launch of a study gets the
    same prompts, and the digest (:func:`prompts_digest`) is recorded with each launch's answers."""
    added = set(tokenizer.get_added_tokens_decoder())
    vocab = [i for i in range(tokenizer.get_vocab_size(with_added_tokens=False)) if i not in added]
    if len(vocab) < 2:
        raise BenchmarkError(
            f"the model's tokenizer has {len(vocab)} ordinary token(s): the output probe needs a vocabulary"
        )
    rng = random.Random(f"k3pipe-answers:{seed}:{prompt_tokens}:{continuation_tokens}")
    return [
        ProbePrompt(
            f"p{i:03d}",
            tuple(rng.choice(vocab) for _ in range(prompt_tokens)),
            tuple(rng.choice(vocab) for _ in range(continuation_tokens)),
        )
        for i in range(count)
    ]


def prompts_digest(prompts: Sequence[ProbePrompt]) -> str:
    """A short digest of the probe's prompts (ids, tokens and continuations), to tell two launches'
    prompt sets apart."""
    data = json.dumps([[p.prompt_id, list(p.tokens), list(p.continuation)] for p in prompts])
    return hashlib.sha256(data.encode()).hexdigest()[:16]


@dataclass
class ProbeRecord:
    """One launch's probe: what was sent (digest, lengths, dialect), how long it took, and each
    prompt's answers; ``error`` when it could not finish (the answers it got before are kept)."""

    digest: str
    dialect: Dialect
    output_tokens: int
    scored: bool
    seconds: float = 0.0
    answers: dict[str, ProbeAnswer] = field(default_factory=dict)
    error: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "digest": self.digest,
            "dialect": self.dialect,
            "output_tokens": self.output_tokens,
            "scored": self.scored,
            "seconds": round(self.seconds, 3),
            "error": self.error,
            "answers": {
                pid: {"tokens": list(a.tokens), "logprobs": None if a.logprobs is None else list(a.logprobs)}
                for pid, a in self.answers.items()
            },
        }


def read_record(data: Mapping[str, Any]) -> ProbeRecord:
    """A :class:`ProbeRecord` from its JSON (:meth:`ProbeRecord.as_json`)."""
    answers = {
        pid: ProbeAnswer(
            pid,
            tuple(int(t) for t in a["tokens"]),
            None if a.get("logprobs") is None else tuple(float(x) for x in a["logprobs"]),
        )
        for pid, a in (data.get("answers") or {}).items()
    }
    return ProbeRecord(
        digest=str(data.get("digest", "")),
        dialect="sglang" if data.get("dialect") == "sglang" else "vllm",
        output_tokens=int(data.get("output_tokens", 0)),
        scored=bool(data.get("scored")),
        seconds=float(data.get("seconds", 0.0)),
        answers=answers,
        error=data.get("error"),
    )


def greedy_body(
    model: str, prompt: ProbePrompt, output_tokens: int, dialect: Dialect = "vllm"
) -> dict[str, Any]:
    """The greedy request: ``output_tokens`` tokens at temperature 0, no penalty, the end of sequence
    ignored."""
    if dialect == "sglang":
        sampling = {"temperature": 0.0, "max_new_tokens": output_tokens, "ignore_eos": True,
                    "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}  # fmt: skip
        return {"input_ids": list(prompt.tokens), "sampling_params": sampling, "return_logprob": False}
    return {
        "model": model,
        "prompt": list(prompt.tokens),
        "max_tokens": output_tokens,
        "temperature": 0.0,
        "repetition_penalty": 1.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": False,
    }


def scored_body(model: str, prompt: ProbePrompt, dialect: Dialect = "vllm") -> dict[str, Any]:
    """The teacher-forced request: prompt + continuation, one token asked for, the log-probability of
    every continuation position."""
    ids = [*prompt.tokens, *prompt.continuation]
    if dialect == "sglang":
        return {
            "input_ids": ids,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 1},
            "return_logprob": True,
            "logprob_start_len": len(prompt.tokens) - 1,  # that position itself comes back unscored
            "top_logprobs_num": 0,
        }
    return {
        "model": model,
        "prompt": ids,
        "max_tokens": 1,
        "temperature": 0.0,
        "prompt_logprobs": 1,
        "return_token_ids": True,
        "stream": False,
    }


def _choice(answer: Mapping[str, Any], what: str) -> Mapping[str, Any]:
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise BenchmarkError(f"the probe's {what} answer has no choices: {json.dumps(answer)[:300]}")
    return choices[0]


def parse_greedy(answer: Mapping[str, Any], dialect: Dialect = "vllm") -> tuple[int, ...]:
    """The greedy continuation's token ids (vLLM: the choice's ``token_ids``; SGLang: ``output_ids``)."""
    if dialect == "sglang":
        ids = answer.get("output_ids")
        where, why = "output_ids", "an SGLang /generate answer carries them"
    else:
        ids = _choice(answer, "greedy").get("token_ids")
        where, why = (
            "choices[0].token_ids",
            "the engine does not take return_token_ids (vLLM 0.10 or later does)",
        )
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise BenchmarkError(f"the probe's greedy answer carries no token ids ({where}): {why}")
    return tuple(ids)


def parse_scored(
    answer: Mapping[str, Any], prompt: ProbePrompt, dialect: Dialect = "vllm"
) -> tuple[float, ...]:
    """The log-probability of each continuation token (vLLM: the choice's ``prompt_logprobs`` at the
    continuation's positions, keyed by token id, a string in JSON; SGLang: ``meta_info``'s
    ``input_token_logprobs`` after its unscored first entry, each ``[logprob, token_id, text]``)."""
    if dialect == "sglang":
        return _sglang_scores(answer, prompt)
    entries = _choice(answer, "teacher-forced").get("prompt_logprobs")
    start, total = len(prompt.tokens), len(prompt.tokens) + len(prompt.continuation)
    if not isinstance(entries, list) or len(entries) != total:
        got = len(entries) if isinstance(entries, list) else "none"
        raise BenchmarkError(
            f"the probe's teacher-forced answer has {got} prompt log-probabilities for {total} prompt "
            "tokens (choices[0].prompt_logprobs): the engine does not score prompts"
        )
    scores = []
    for position in range(start, total):
        token = prompt.continuation[position - start]
        entry = entries[position]
        found = entry.get(str(token)) if isinstance(entry, dict) else None
        if not isinstance(found, dict) or not isinstance(found.get("logprob"), int | float):
            raise BenchmarkError(
                f"the probe's teacher-forced answer has no log-probability for token {token} at prompt "
                f"position {position} of prompt {prompt.prompt_id!r}"
            )
        scores.append(float(found["logprob"]))
    return tuple(scores)


def _sglang_scores(answer: Mapping[str, Any], prompt: ProbePrompt) -> tuple[float, ...]:
    meta = answer.get("meta_info")
    entries = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
    want = len(prompt.continuation) + 1
    if not isinstance(entries, list) or len(entries) != want:
        got = len(entries) if isinstance(entries, list) else "none"
        raise BenchmarkError(
            f"the probe's teacher-forced answer has {got} input log-probabilities where {want} were asked "
            "for (meta_info.input_token_logprobs from logprob_start_len one before the continuation)"
        )
    scores = []
    for k, (token, entry) in enumerate(zip(prompt.continuation, entries[1:], strict=True)):
        ok = isinstance(entry, list) and len(entry) >= 2 and isinstance(entry[0], int | float)
        if not ok or entry[1] != token:
            raise BenchmarkError(
                f"the probe's teacher-forced answer scores {entry!r} at continuation position {k} of "
                f"prompt {prompt.prompt_id!r}, where token {token} was sent"
            )
        scores.append(float(entry[0]))
    return tuple(scores)


async def ask(
    client: httpx.AsyncClient,
    base_url: str,
    model: str,
    prompts: Sequence[ProbePrompt],
    *,
    output_tokens: int,
    score: bool = True,
    dialect: Dialect = "vllm",
    headers: Mapping[str, str] | None = None,
) -> dict[str, ProbeAnswer]:
    """Every prompt's answers, one request at a time in the order given (see the module): the greedy
    continuation and, with ``score``, the continuation's teacher-forced log-probabilities."""
    if dialect not in DIALECTS:
        raise ValueError(f"probe dialect {dialect!r}: one of {', '.join(DIALECTS)}")
    if dialect == "sglang":
        parts = urlsplit(base_url)
        url = f"{parts.scheme}://{parts.netloc}/generate"  # the native API, on the server's root
    else:
        url = base_url.rstrip("/") + "/completions"
    answers = {}
    for prompt in prompts:
        greedy = await _post(client, url, greedy_body(model, prompt, output_tokens, dialect), headers)
        tokens = parse_greedy(greedy, dialect)
        logprobs = None
        if score:
            scored = await _post(client, url, scored_body(model, prompt, dialect), headers)
            logprobs = parse_scored(scored, prompt, dialect)
        answers[prompt.prompt_id] = ProbeAnswer(prompt.prompt_id, tokens, logprobs)
    return answers


def run_probe(
    base_url: str,
    model: str,
    prompts: Sequence[ProbePrompt],
    *,
    output_tokens: int,
    score: bool,
    dialect: Dialect,
    headers: Mapping[str, str] | None = None,
    timeout_s: float = 600.0,
) -> ProbeRecord:
    """The probe against one launch, timed (:func:`ask`): never raises for what the engine answers;
    a request refused, a field missing or the time running out ends it with ``error`` set and the
    answers got until then kept."""
    record = ProbeRecord(prompts_digest(prompts), dialect, output_tokens, score)
    t0 = time.perf_counter()

    async def go() -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), verify=tls()) as client:
            for prompt in prompts:  # one by one, so what was answered before an error is kept
                got = await ask(
                    client, base_url, model, [prompt], output_tokens=output_tokens, score=score,
                    dialect=dialect, headers=headers,
                )  # fmt: skip
                record.answers.update(got)

    try:
        asyncio.run(go())
    except (BenchmarkError, httpx.HTTPError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}" if not isinstance(exc, BenchmarkError) else str(exc)
    record.seconds = time.perf_counter() - t0
    return record


async def _post(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: Mapping[str, str] | None
) -> dict[str, Any]:
    answer = await client.post(url, json=body, headers=dict(headers or {}))
    if answer.status_code != 200:
        raise BenchmarkError(
            f"the probe's request to {url} was answered {answer.status_code}: {answer.text[:300]}"
        )
    data = answer.json()
    if not isinstance(data, dict):
        raise BenchmarkError(
            f"the probe's request to {url} was answered with {type(data).__name__}, not an object"
        )
    return data
