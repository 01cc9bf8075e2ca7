"""A study on a trace (issue 49, item 5): two arms served by the scripted OpenAI server
(k3pipe/testing/scripted_openai.py: real HTTP and SSE, a fast and a slow one), each launched twice,
replay the same small agent-like trace (k3pipe.schema.traces.agentic_trace) at 4x through the study
job (the code the study flow runs), two repeats a launch. What must hold:

- the verdict rules apply unchanged (the fast arm's TTFT is found lower, with its interval);
- every repeat keeps its replay's fidelity (lag, sent and skipped, prompt tokens, the trace's
  theoretical hit rate), its per-request timeline (replay.parquet) and the trace itself (trace.jsonl);
- a session's later turns carried the answers the server really gave;
- the report says how the load was made, carries a fidelity section and the trace's shape figure, and,
  since the scripted server counts prompt tokens by words (not the model's tokenizer), says at the top,
  before any verdict, that the replay's prompt lengths were not the trace's.
"""

from __future__ import annotations

import io
from pathlib import Path

import pandas as pd
import pytest
import yaml

from k3pipe.core.layout import REPLAY_FILE, TRACE_FILE
from k3pipe.core.settings import Settings
from k3pipe.experiment.params import RunRequest
from k3pipe.jobs.steps import Job
from k3pipe.jobs.study import study
from k3pipe.report import build_report
from k3pipe.schema.traces import agentic_trace, write_trace
from k3pipe.testing.scripted_openai import Script, ScriptedOpenAI
from tests.conftest import TINY_MODEL


def test_two_arms_replay_one_trace_and_the_report_judges_them_and_the_replay(tmp_path: Path) -> None:
    if not (TINY_MODEL / "config.json").is_file():
        pytest.fail(f"no tiny model at {TINY_MODEL}: run the tests with `make test`, which makes it")
    trace = agentic_trace(
        2, sessions=6, turns=(2, 5), context_tokens=1500, system_prompts=2, system_tokens=256,
        user_tokens=(16, 64), tool_tokens=(32, 128), output_tokens=(8, 32), think_s=0.2, burst_s=1.0,
        bursts=2, block_tokens=16,
    )  # fmt: skip
    path = tmp_path / "agent.jsonl"
    write_trace(trace, path)
    with (
        ScriptedOpenAI(Script(inter_token_s=0.002), model="m") as fast,
        ScriptedOpenAI(Script(first_token_delay_s=0.03, inter_token_s=0.004), model="m") as slow,
    ):

        def arm(name: str, url: str) -> dict[str, object]:
            return {"name": name, "engine": {"kind": "vllm"}, "launcher": {"kind": "external"},
                    "endpoint": {"base_url": url, "model": "m"}, "launches": 2}  # fmt: skip

        exp = tmp_path / "trace-study.yaml"
        exp.write_text(yaml.safe_dump({
            "name": "trace-study",
            "model": {"source": "local", "path": str(TINY_MODEL)},
            "arms": [arm("fast", fast.base_url), arm("slow", slow.base_url)],
            "workloads": [{"name": "agent", "trace": {"path": str(path), "speed": 4}, "repeats": 2}],
            "decision": {"metrics": ["ttft_ms_p50"]},
        }))  # fmt: skip
        job = Job.library(Settings())
        study(RunRequest(experiment=str(exp)), job)
        # the replay's requests (the health gate's probe, once a launch, sends no ignore_eos)
        bodies = [r.body for r in fast.requests if r.body.get("ignore_eos")]

    n = len(trace.requests)
    assert len(bodies) == 2 * 2 * n  # two launches of two repeats, every request sent
    # later turns carried the conversation so far, with the server's own answers in it
    threaded = [b["messages"] for b in bodies if len(b["messages"]) > 1]
    assert len(threaded) == 2 * 2 * (n - len(trace.sessions()))
    assert all(m[1]["role"] == "assistant" and m[1]["content"] for m in threaded)

    tracker = job.tracker
    (run,) = tracker.client.search_runs([tracker.require_experiment_id()], "tags.`k3pipe.kind` = 'study'")
    report = build_report(tracker, run.info.run_id)
    for cell in report.data.cells:
        assert cell.values["replay_sent"] == [n, n, n, n]
        assert cell.values["replay_skipped"] == [0, 0, 0, 0]
        assert all(v >= 0 for v in cell.values["replay_lag_ms_p50"])
        assert cell.values["trace_hit_rate_pct"][0] == pytest.approx(
            100 * trace.shape().theoretical_hit_rate, abs=0.1
        )
        # the trace and each repeat's timeline are kept
        assert tracker.find_artifact(cell.run_id, TRACE_FILE) == path.read_bytes()
        for repeat in cell.request_runs:
            timeline = pd.read_parquet(io.BytesIO(tracker.find_artifact(repeat, REPLAY_FILE) or b""))
            assert len(timeline) == n
            assert (timeline["sent_s"] >= timeline["ready_s"]).all()
    md = report.markdown
    assert "the trace agent.jsonl replayed at 4x" in md
    top = md[: md.index("## The answer")]
    assert "**The replay of agent.jsonl on fast (agent) was not faithful**" in top
    assert "the engine's prompt tokens' median gap from the trace's (%)" in top
    assert "## Replay fidelity" in md
    assert "TTFT p50, first delta: fast" in md
    assert "fast" in report.analysis.rows[0].ranking[0]
    assert "trace_agent.png" in report.figures
