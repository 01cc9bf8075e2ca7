"""The output probe's wire (k3pipe.bench.probe): the requests as vLLM's completions take them and the
parsers on vLLM's real answers (tests/fixtures/engines/vllm/probe-*-cpu-*.json, kept from the real
CPU vLLM by tests/engine/test_engine_real.py::test_the_output_probe_on_the_real_engine with
KEEP_PROBE_FIXTURES set), and what a wrong answer is told."""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from k3pipe.bench.probe import ProbePrompt, ask, greedy_body, parse_greedy, parse_scored, scored_body
from k3pipe.core.errors import BenchmarkError
from tests.conftest import REPO

pytestmark = pytest.mark.unit

FIXTURES = REPO / "tests" / "fixtures" / "engines" / "vllm"


def _fixture(kind: str) -> dict[str, Any]:
    (path,) = sorted(FIXTURES.glob(f"probe-{kind}-cpu-*.json"))
    data: dict[str, Any] = json.loads(Path(path).read_text())
    return data


def test_the_requests_ask_for_what_the_parsers_read() -> None:
    prompt = ProbePrompt("p", (5, 6, 7), (8, 9))
    greedy = greedy_body("m", prompt, 12)
    assert greedy["prompt"] == [5, 6, 7]  # token ids: every arm gets exactly these tokens
    assert (greedy["max_tokens"], greedy["temperature"], greedy["ignore_eos"]) == (12, 0.0, True)
    assert greedy["return_token_ids"] is True
    scored = scored_body("m", prompt)
    assert scored["prompt"] == [5, 6, 7, 8, 9]
    assert (scored["max_tokens"], scored["prompt_logprobs"]) == (1, 1)


def test_the_greedy_continuation_from_vllms_answer() -> None:
    data = _fixture("greedy")
    tokens = parse_greedy(data["answer"])
    assert len(tokens) == data["output_tokens"]
    assert all(isinstance(t, int) for t in tokens)
    bare = copy.deepcopy(data["answer"])
    del bare["choices"][0]["token_ids"]
    with pytest.raises(BenchmarkError, match=r"no token ids \(choices\[0\]\.token_ids\)"):
        parse_greedy(bare)
    with pytest.raises(BenchmarkError, match="no choices"):
        parse_greedy({"error": "x"})


def test_the_continuations_scores_from_vllms_prompt_logprobs() -> None:
    data = _fixture("scored")
    prompt = ProbePrompt("own", tuple(data["prompt"]), tuple(data["continuation"]))
    entries = data["answer"]["choices"][0]["prompt_logprobs"]
    assert entries[0] is None  # the first prompt token has no log-probability
    assert len(entries) == len(prompt.tokens) + len(prompt.continuation)
    scores = parse_scored(data["answer"], prompt)
    assert len(scores) == len(prompt.continuation)
    for score, token, entry in zip(scores, prompt.continuation, entries[len(prompt.tokens) :], strict=True):
        assert score == entry[str(token)]["logprob"]  # keyed by the token id, a string in JSON
        assert score <= 0.0
    other = ProbePrompt("own", prompt.tokens, (prompt.continuation[0] + 1, *prompt.continuation[1:]))
    if str(other.continuation[0]) not in entries[len(prompt.tokens)]:
        with pytest.raises(BenchmarkError, match=r"no log-probability for token \d+ at prompt position"):
            parse_scored(data["answer"], other)
    short = ProbePrompt("own", prompt.tokens[:-1], prompt.continuation)
    with pytest.raises(BenchmarkError, match="prompt log-probabilities for"):
        parse_scored(data["answer"], short)


def test_ask_sends_each_prompt_in_order_and_names_a_refusal() -> None:
    """Against a transport that answers as the fixtures do: greedy then scored per prompt, in the
    order given, one at a time; an error status is named with the URL and what it said."""
    greedy, scored = _fixture("greedy"), _fixture("scored")
    prompt = ProbePrompt("own", tuple(scored["prompt"]), tuple(scored["continuation"]))
    sent: list[dict[str, Any]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        sent.append(body)
        assert request.headers["authorization"] == "Bearer k"
        return httpx.Response(200, json=scored["answer"] if "prompt_logprobs" in body else greedy["answer"])

    async def run(handler: Any) -> Any:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await ask(
                client, "http://e/v1", "m", [prompt, prompt], output_tokens=greedy["output_tokens"],
                headers={"Authorization": "Bearer k"},
            )  # fmt: skip

    got = asyncio.run(run(answer))
    assert [("prompt_logprobs" in b) for b in sent] == [False, True, False, True]
    assert got["own"].logprobs == parse_scored(scored["answer"], prompt)
    with pytest.raises(BenchmarkError, match=r"http://e/v1/completions was answered 400: bad"):
        asyncio.run(run(lambda _r: httpx.Response(400, text="bad")))


def _toy_logprob(token: int, position: int) -> float:
    return -0.1 - (token * 7 + position) % 13 / 10


def _sglang_generate(request: httpx.Request) -> httpx.Response:
    """SGLang 0.5.16's native /generate as its source defines it (managers/io_struct.py
    GenerateReqInput; tokenizer_manager.py add_logprob_to_meta_info; logprob_result_processor.py):
    ``output_ids``; with ``return_logprob``, ``meta_info.input_token_logprobs`` from
    ``logprob_start_len`` on, each ``[logprob, token_id, None]``, its first entry unscored (null), a
    toy model's log-probabilities otherwise; greedy: a toy continuation of the asked length."""
    assert request.url.path == "/generate"
    body = json.loads(request.content)
    ids, sampling = body["input_ids"], body["sampling_params"]
    assert sampling["temperature"] == 0.0
    out = [(sum(ids) + k) % 2000 for k in range(sampling["max_new_tokens"])]
    meta: dict[str, Any] = {"id": "x", "finish_reason": {"type": "length", "length": len(out)},
                            "prompt_tokens": len(ids), "completion_tokens": len(out)}  # fmt: skip
    if body.get("return_logprob"):
        start = body.get("logprob_start_len", -1)
        start = len(ids) if start == -1 else start
        scored = [[_toy_logprob(t, j), t, None] for j, t in enumerate(ids) if j >= start]
        if scored:
            scored[0][0] = None  # the position at logprob_start_len is left unscored
        meta["input_token_logprobs"] = scored
        meta["output_token_logprobs"] = [[-0.5, t, None] for t in out]
    return httpx.Response(200, json={"text": "...", "output_ids": out, "meta_info": meta})


def test_the_sglang_dialect_scores_every_continuation_token_past_its_unscored_first_entry() -> None:
    """SGLang's native API: greedy ids from ``output_ids``; the continuation's scores from
    ``logprob_start_len`` one before it, the unscored entry dropped, each checked to be the token
    sent. A start at the continuation itself (the naive reading) would lose its first token, and the
    parser says so rather than shift the scores."""
    prompt = ProbePrompt("p", (11, 12, 13, 14), (21, 22, 23))
    body = scored_body("m", prompt, "sglang")
    assert body["logprob_start_len"] == 3
    assert "model" not in body

    async def run() -> Any:
        async with httpx.AsyncClient(transport=httpx.MockTransport(_sglang_generate)) as client:
            return await ask(client, "http://e:30000/v1", "m", [prompt], output_tokens=5, dialect="sglang")

    got = asyncio.run(run())["p"]
    assert len(got.tokens) == 5
    assert got.logprobs == tuple(_toy_logprob(t, 4 + k) for k, t in enumerate(prompt.continuation))
    naive = _sglang_generate(
        httpx.Request("POST", "http://e/generate", json={**body, "logprob_start_len": 4})
    ).json()
    with pytest.raises(BenchmarkError, match="3 input log-probabilities where 4 were asked for"):
        parse_scored(naive, prompt, "sglang")
    with pytest.raises(BenchmarkError, match=r"no token ids \(output_ids\)"):
        parse_greedy({"text": "x", "meta_info": {}}, "sglang")

    async def unknown() -> Any:
        async with httpx.AsyncClient(transport=httpx.MockTransport(_sglang_generate)) as client:
            return await ask(client, "http://e/v1", "m", [prompt], output_tokens=1, dialect="tgi")  # type: ignore[arg-type]

    with pytest.raises(ValueError, match="one of vllm, sglang"):
        asyncio.run(unknown())
