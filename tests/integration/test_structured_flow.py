"""The structured-output check through a study (issue 47, item 4): an arm served with a tool-call and a
reasoning parser, launched by the process launcher as k3pipe/testing/scripted_engine.py (the scripted server,
answering tool-calling requests with good and broken calls as vLLM 0.32.0 spells them:
k3pipe/testing/scripted_tools.py); an arm without parsers beside it gets no such requests. The scripted server
does not answer the output probe's requests as vLLM does (it streams every answer), so the probe
stops short: recorded and said, failing nothing."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from k3pipe.core.settings import Settings
from k3pipe.report import build_report
from k3pipe.testing import SCRIPTED_ENGINE as ENGINE_SCRIPT
from k3pipe.testing.scripted_tools import BEHAVIOURS, FAILING
from tests.conftest import TINY_MODEL, free_port

pytestmark = [pytest.mark.flow]


def _arm(name: str, args: dict[str, Any], tools: str) -> dict[str, Any]:
    return {
        "name": name,
        "launches": 1,
        "engine": {
            "kind": "vllm",
            "executable": [sys.executable, str(ENGINE_SCRIPT)],
            "env": {"SCRIPTED_ENGINE_TOOLS": tools},
            "args": args,
        },
        "launcher": {"kind": "process", "port": free_port(), "startup_timeout_s": 120},
        "endpoint": {"model": "scripted"},
    }


def test_tool_calls_and_reasoning_checked_through_a_study(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from k3pipe.experiment.params import RunRequest
    from k3pipe.jobs.steps import Job
    from k3pipe.jobs.study import study

    if not (TINY_MODEL / "config.json").is_file():
        pytest.skip(f"no tiny model at {TINY_MODEL} (make model)")
    parsers = {
        "tool_call_parser": "hermes",
        "enable_auto_tool_choice": True,
        "reasoning_parser": "deepseek_r1",
    }
    experiment = {
        "name": "structured-test",
        "model": {"source": "local", "path": str(TINY_MODEL)},
        "arms": [_arm("parsed", parsers, ",".join(BEHAVIOURS)), _arm("plain", {}, "good")],
        "workloads": [
            {"name": "w", "input_tokens": 16, "output_tokens": 4, "num_requests": 2, "concurrency": 1}
        ],
        "answers": {
            "prompts": 4,
            "prompt_tokens": 8,
            "output_tokens": 4,
            "tool_requests": 2 * len(BEHAVIOURS),
        },
    }
    exp = tmp_path / "structured.yaml"
    exp.write_text(yaml.safe_dump(experiment))
    monkeypatch.setenv("K3PIPE_HOME", str(tmp_path / "home"))
    job = Job.library(Settings())
    result = study(RunRequest(experiment=str(exp)), job)
    assert [a.status for a in result.arms] == ["FINISHED", "FINISHED"], [a.error for a in result.arms]

    tracker = job.tracker
    parsed = tracker.client.get_run(result.arms[0].mlflow_run_id)
    plain = tracker.client.get_run(result.arms[1].mlflow_run_id)
    failing = 2 * len(FAILING)  # each behaviour twice, streamed and not, reasoning parser on
    assert parsed.data.metrics["structured.requests"] == 2 * len(BEHAVIOURS)
    assert parsed.data.metrics["structured.failures"] == failing
    assert "structured.requests" not in plain.data.metrics  # no parser: no tool-calling requests
    assert "k3pipe.answers_error" in parsed.data.tags  # the scripted server streams the probe's answers

    report = build_report(tracker, result.study_run_id)
    answers = report.analysis.answers
    assert answers is not None
    assert list(answers.structured) == ["parsed"]
    assert answers.structured["parsed"].kinds() == {kind: 2 for kind in FAILING.values()}
    text = report.markdown
    section = text.split("## Answers", 1)[1].split("\n## ", 1)[0]
    row = next(
        line for line in section.splitlines() if line.startswith("| parsed | tool-call and reasoning |")
    )
    assert f"| {2 * len(BEHAVIOURS)} ({len(BEHAVIOURS)} streamed) |" in row
    assert f"{failing} of {2 * len(BEHAVIOURS)} answers" in row
    assert "**The probe stopped short** on parsed" in section
    assert "**parsed's structured output failed**" in text.split("## The answer", 1)[1]
    assert "[answers] structured output:" in text
