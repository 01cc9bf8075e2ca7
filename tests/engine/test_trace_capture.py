"""A team's traffic captured at the gateway and replayed on two arms (issue 49, item 1 and its "Done
when"): real components only.

A small agent (this test) talks to the real LiteLLM proxy (``make gateway``'s version) in front of the
session's real vLLM (CPU, the tiny model): three sessions of three turns, each turn carrying the
conversation so far with the engine's real answers, the session named by LiteLLM's own body field
``litellm_session_id``. A planted key rides in a header and in the text, beside the gateway's and the
engine's keys. k3pipe's LiteLLM callback (``k3pipe trace gateway``, loaded by the proxy from its
config's directory) writes the capture log; ``k3pipe trace convert --from capture`` makes it a trace.

What must hold: the capture has every call, its prompt tokens (the tiny model's tokenizer and chat
template at capture) equal to the engine's own count, a session's later turns sharing the earlier
turns' blocks; no key and no text anywhere (capture, trace, the MLflow store, the report); the trace
replayed on two arms (the engine directly, and through the gateway) by the study job, the report
carrying the send lag and, from the engine's /metrics (``endpoint.metrics_url``), its prefix-cache
hit rate beside the trace's theoretical ones. (Both arms are one engine here, so the second arm finds
the first arm's prompts cached: the test says so rather than reading it as the gateway's doing.)
"""

from __future__ import annotations

import itertools
import json
import secrets
import time
from pathlib import Path
from statistics import mean
from typing import Any

import httpx
import pytest
import yaml
from typer.testing import CliRunner

from k3pipe.cli.main import app
from k3pipe.core.settings import Settings
from k3pipe.experiment.params import RunRequest
from k3pipe.jobs.steps import Job
from k3pipe.jobs.study import study
from k3pipe.report import build_report
from k3pipe.schema.traces import from_capture, read_trace
from tests.conftest import TINY_MODEL, RunningEngine
from tests.engine.test_gateway import ENGINE_VAR, GATEWAY_MODEL, GATEWAY_VAR, running_litellm

pytestmark = [pytest.mark.engine, pytest.mark.flow]


def _agent(base_url: str, key: str, planted: str, canary: str) -> list[dict[str, Any]]:
    """Three sessions of three turns through the gateway, as an agent loop sends them: each later turn
    carries the conversation with the real answers. Returns what the gateway answered."""
    answered = []
    system = f"You are a build agent. Shared instructions follow. {canary} " + "Check the logs. " * 30
    with httpx.Client(timeout=60, trust_env=False) as client:
        for s in range(3):
            session = f"team-conversation-{s}-{secrets.token_hex(4)}"
            messages: list[dict[str, str]] = [{"role": "system", "content": system}]
            for turn in range(3):
                messages.append(
                    {"role": "user", "content": f"step {turn} of task {s}: my key is {planted}; go on"}
                )
                reply = client.post(
                    f"{base_url}/chat/completions",
                    headers={"Authorization": f"Bearer {key}", "x-team-secret": planted},
                    json={
                        "model": GATEWAY_MODEL,
                        "messages": messages,
                        "max_tokens": 12,
                        "temperature": 0,
                        "litellm_session_id": session,
                    },
                )
                assert reply.status_code == 200, reply.text[:500]
                body = reply.json()
                answered.append(body)
                messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
                time.sleep(0.15)
    return answered


def _keys_or_text_in(path: Path, needles: list[str]) -> list[str]:
    found = []
    for item in path.rglob("*"):
        if item.is_file():
            data = item.read_bytes()
            found += [f"{item}: needle {i}" for i, n in enumerate(needles) if n.encode() in data]
    return found


def test_traffic_captured_at_the_gateway_replays_on_two_arms(
    vllm_engine: RunningEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = vllm_engine.base_url.removesuffix("/v1")
    engine_port = int(root.rsplit(":", 1)[1])
    planted = "sk-planted-" + secrets.token_hex(12)
    canary = "zebra-canary-" + secrets.token_hex(6)  # a piece of the prompts' text
    keys = {ENGINE_VAR: vllm_engine.api_key, GATEWAY_VAR: "sk-gateway-" + secrets.token_hex(12)}
    config_dir = tmp_path / "gateway"
    config_dir.mkdir()
    capture = tmp_path / "capture.jsonl"
    runner = CliRunner()
    made = runner.invoke(
        app,
        ["trace", "gateway", str(config_dir), "--out", str(capture), "--model-dir", str(TINY_MODEL),
         "--block-tokens", "16"],
    )  # fmt: skip
    assert made.exit_code == 0, made.output
    assert "callbacks: [k3pipe_capture.trace_capture]" in made.output

    with running_litellm(
        config_dir, engine_port, keys, settings={"callbacks": ["k3pipe_capture.trace_capture"]}
    ) as gateway:
        answered = _agent(gateway.base_url, keys[GATEWAY_VAR], planted, canary)
        deadline = time.monotonic() + 30  # LiteLLM runs success callbacks after answering
        while time.monotonic() < deadline:
            if capture.exists() and len(capture.read_text().splitlines()) >= len(answered):
                break
            time.sleep(0.2)
        lines = [json.loads(x) for x in capture.read_text().splitlines()]
        assert len(lines) == len(answered) == 9, gateway.log_path.read_text(errors="replace")[-3000:]

        # the prompt's tokens at capture are the engine's own count, every call
        used = sorted(b["usage"]["prompt_tokens"] for b in answered)
        assert sorted(x["input_tokens"] for x in lines) == used
        assert all(x["engine_prompt_tokens"] == x["input_tokens"] for x in lines)

        trace_path = tmp_path / "captured.jsonl"
        argv = ["trace", "convert", str(capture), str(trace_path), "--from", "capture"]
        converted = runner.invoke(app, argv)
        assert converted.exit_code == 0, converted.output
        trace = read_trace(trace_path)
        sessions = trace.sessions()
        assert sorted(sessions) == ["s000", "s001", "s002"]  # the team's session ids stay out
        for turns in sessions.values():
            assert [r.turn for r in turns] == [1, 2, 3]
            for earlier, later in itertools.pairwise(turns):
                whole = earlier.input_tokens // trace.block_tokens
                assert later.hash_ids[:whole] == earlier.hash_ids[:whole]  # the conversation so far
        # the three sessions share the system prompt's blocks
        firsts = [turns[0].hash_ids[:4] for turns in sessions.values()]
        assert firsts[0] == firsts[1] == firsts[2]
        assert trace.shape().theoretical_hit_rate > 0.5

        # the trace replayed on two arms: the engine directly, and through the gateway
        monkeypatch.setenv(ENGINE_VAR, keys[ENGINE_VAR])
        monkeypatch.setenv(GATEWAY_VAR, keys[GATEWAY_VAR])
        metrics = f"{root}/metrics"

        def arm(name: str, url: str, var: str, model: str) -> dict[str, Any]:
            return {"name": name, "engine": {"kind": "vllm"}, "launcher": {"kind": "external"},
                    "endpoint": {"base_url": url, "api_key_env": var, "model": model, "metrics_url": metrics},
                    "launches": 1}  # fmt: skip

        exp = tmp_path / "captured-study.yaml"
        exp.write_text(yaml.safe_dump({
            "name": "captured-study",
            "model": {"source": "local", "path": str(TINY_MODEL)},
            "arms": [arm("direct", vllm_engine.base_url, ENGINE_VAR, vllm_engine.model),
                     arm("via-gateway", gateway.base_url, GATEWAY_VAR, GATEWAY_MODEL)],
            "workloads": [{"name": "team", "repeats": 2, "trace": {
                "path": str(trace_path), "speed": 2, "session_field": "litellm_session_id"}}],
        }))  # fmt: skip
        job = Job.library(Settings())
        study(RunRequest(experiment=str(exp)), job)

        # the gateway captured the replay too: each repeat's sessions (named by session_field, as
        # LiteLLM's session affinity reads them) with the trace's turns, lengths and sharing
        later = [json.loads(x) for x in capture.read_text().splitlines()][len(answered) :]
    replayed = [x for x in later if x["session"] is not None]  # not the health gate's probe
    assert len(later) - len(replayed) == 1
    n = len(trace.requests)
    assert len(replayed) == 2 * len(trace.requests)
    names = {x["session"] for x in replayed}
    assert len(names) == 6  # three sessions in each of two repeats
    assert {n.split(".r")[0] for n in names} == {"s000", "s001", "s002"}
    for tag in {n.split(".r")[1] for n in names}:
        again = from_capture([x for x in replayed if x["session"].endswith(f".r{tag}")], "replayed")
        # each session's turns in order (sessions interleave: two sends a few ms apart may swap)
        assert all(r.session is not None for r in again.requests)
        assert sorted([r.turn for r in turns] for turns in again.sessions().values()) == sorted(
            [r.turn for r in turns] for turns in sessions.values()
        )
        got = sorted(r.input_tokens for r in again.requests)
        assert (
            sum(abs(a - b) for a, b in zip(got, sorted(r.input_tokens for r in trace.requests), strict=True))
            <= n
        )
        assert again.shape().theoretical_hit_rate == pytest.approx(
            trace.shape().theoretical_hit_rate, abs=0.05
        )

    tracker = job.tracker
    (run,) = tracker.client.search_runs([tracker.require_experiment_id()], "tags.`k3pipe.kind` = 'study'")
    report = build_report(tracker, run.info.run_id)
    for cell in report.data.cells:
        assert cell.values["replay_sent"] == [n, n]
        # the sender kept its schedule: the median send on time; the p99 of nine sends is the latest
        # one, which two busy cores may hold back (CI read over 50 ms), so it gets a loose bound
        assert all(v < 50 for v in cell.values["replay_lag_ms_p50"]), cell.values
        assert all(v < 1000 for v in cell.values["replay_lag_ms_p99"]), cell.values
        assert cell.values["trace_hit_rate_pct"][0] == pytest.approx(
            100 * trace.shape().theoretical_hit_rate, abs=0.1
        )
        # the engine's counters, read through endpoint.metrics_url: much of each prompt was cached
        assert all(v > 30 for v in cell.values["engine_prefix_cache_hit_pct"]), cell.values
    direct, gated = (mean(c.values["engine_prefix_cache_hit_pct"]) for c in report.data.cells)
    ceiling = mean(report.data.cells[0].values["trace_hit_rate_answers_pct"])
    # the direct arm's fresh prompts reach at most the trace's ceiling (below it: vLLM on the CPU caches
    # whole blocks of 128 tokens, the trace counts blocks of 16); the gateway arm sent the same prompts
    # to the same engine after it, so they were cached already: a higher rate, read in its own window
    assert direct <= ceiling + 1.0
    assert gated > direct
    md = report.markdown
    section = md[md.index("## Replay fidelity") :]
    print(section[: section.index("\n## ", 5)])  # the measured figures, in the test's log
    assert "| team | direct |" in section
    assert "| team | via-gateway |" in section
    assert "the trace captured.jsonl replayed at 2x" in md

    # no key and no text anywhere k3pipe wrote
    needles = [planted, canary, keys[GATEWAY_VAR], keys[ENGINE_VAR], "step 0 of task"]
    assert _keys_or_text_in(capture, needles) == []
    assert _keys_or_text_in(trace_path, needles) == []
    assert _keys_or_text_in(Settings().home, needles) == []
    assert planted not in md
    assert canary not in md
