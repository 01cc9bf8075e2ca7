"""A launch cut short is judged by what it completed (issue 45, as the H100 study met it: the deadline's
SIGINT stopped the A/A copy's third launch in its second repeat, and the report merged the partial
repeat into the cells). The report says "3 + 3 + 1 cut" there; here "2 + 2 + 1 cut": two repeats a
launch keep the test short.

The study here: arms ``fast`` and ``slow`` served by the scripted OpenAI server
(k3pipe/testing/scripted_openai.py, real HTTP and SSE), the A/A copy ``fast-aa``, three launches
each, interleaved, one workload of two repeats; run by the study job (the code the study flow
runs), and stopped by a real SIGINT sent to this process while ``fast-aa``'s third launch is in
its second repeat, as ``timeout --signal=INT`` does at a deadline. Then:

- the cut launch keeps its record (MLflow: the repeat tagged ``k3pipe.aborted``, the arm run KILLED);
- the report's verdicts, A/A calibration and noise equal those of the complete launches alone (the same
  store with the cut launch's run set aside), and the report names the cut launch ("3 + 3 + 1 cut");
- the record checker (scripts/check_gpu_record.py) says INCOMPLETE, naming the cut launch and the
  launch that never ran.
"""

from __future__ import annotations

import importlib.util
import io
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from k3pipe.core.layout import SUPERSEDED_TAG
from k3pipe.core.settings import Settings
from k3pipe.experiment.params import RunRequest
from k3pipe.jobs.steps import Job
from k3pipe.jobs.study import study
from k3pipe.report import build_report
from k3pipe.report.analysis import analyse
from k3pipe.report.collect import collect
from k3pipe.testing.scripted_openai import Script, ScriptedOpenAI
from tests.conftest import REPO, TINY_MODEL


def _checker() -> Any:
    path = REPO / "scripts" / "check_gpu_record.py"
    spec = importlib.util.spec_from_file_location("check_gpu_record", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def servers() -> Iterator[tuple[ScriptedOpenAI, ScriptedOpenAI]]:
    if not (TINY_MODEL / "config.json").is_file():
        pytest.fail(f"no tiny model at {TINY_MODEL}: run the tests with `make test`, which makes it")
    with (
        ScriptedOpenAI(Script(inter_token_s=0.004), model="m") as fast,
        ScriptedOpenAI(Script(inter_token_s=0.008), model="m") as slow,
    ):
        yield fast, slow


def _experiment(fast: str, slow: str) -> dict[str, Any]:
    def arm(name: str, url: str) -> dict[str, Any]:
        return {
            "name": name,
            "engine": {"kind": "vllm"},
            "launcher": {"kind": "external"},
            "endpoint": {"base_url": url, "model": "m"},
            "launches": 3,
        }

    return {
        "name": "cut-study",
        "model": {"source": "local", "path": str(TINY_MODEL)},
        "arms": [arm("fast", fast), arm("slow", slow)],
        "workloads": [
            {"name": "w", "input_tokens": 32, "output_tokens": 16, "concurrency": 2, "num_requests": 4,
             "warmup_requests": 0, "repeats": 2, "seed": 3},
        ],
        "decision": {"calibration": True, "metrics": ["output_throughput_tps", "ttft_ms_p50"]},
    }  # fmt: skip


def _interrupt_once(server: ScriptedOpenAI, since: int) -> None:
    """SIGINT to this process once ``server`` has received two requests past ``since``: the repeat is
    then sending (in flight, not between repeats)."""
    deadline = time.monotonic() + 30
    while len(server.requests) < since + 2 and time.monotonic() < deadline:
        time.sleep(0.002)
    os.kill(os.getpid(), signal.SIGINT)


def test_a_launch_cut_mid_repeat_is_named_and_judges_nothing(
    servers: tuple[ScriptedOpenAI, ScriptedOpenAI], tmp_path: Path
) -> None:
    fast, slow = servers
    exp = tmp_path / "cut.yaml"
    exp.write_text(yaml.safe_dump(_experiment(fast.base_url, slow.base_url)))
    job = Job.library(Settings())  # the test's own K3PIPE_HOME (tests/conftest.py), its stores made
    bench = job.steps.arm.benchmark
    calls: dict[str, int] = {}

    def cut(plan, workload, model_dir, api_key, repeat=0, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls[plan.arm] = calls.get(plan.arm, 0) + 1
        if plan.arm == "fast-aa" and calls[plan.arm] == 6:  # its third launch, second repeat
            threading.Thread(target=_interrupt_once, args=(fast, len(fast.requests)), daemon=True).start()
        return bench(plan, workload, model_dir, api_key, repeat, *args, **kwargs)

    with pytest.raises(KeyboardInterrupt):
        study(RunRequest(experiment=str(exp)), job.with_steps(arm=replace(job.steps.arm, benchmark=cut)))

    tracker = job.tracker
    (study_run,) = tracker.client.search_runs(
        [tracker.require_experiment_id()], "tags.`k3pipe.kind` = 'study'"
    )
    run_id = study_run.info.run_id
    assert study_run.info.status == "KILLED"
    arms = sorted(tracker.children(run_id), key=lambda r: r.info.start_time)
    ran = [(r.data.tags["k3pipe.arm"], r.data.tags["k3pipe.launch"], r.info.status) for r in arms]
    assert ran[-1] == ("fast-aa", "3", "KILLED")
    assert ("slow", "3") not in {(a, k) for a, k, _ in ran}  # the deadline came before it
    # the cut repeat keeps its record, marked
    cut_run = arms[-1]
    (workload_run,) = tracker.children(cut_run.info.run_id)
    repeats = {r.data.tags["k3pipe.repeat"]: r for r in tracker.children(workload_run.info.run_id)}
    assert sorted(repeats) == ["1", "2"]
    assert "interrupted by SIGINT" in repeats["2"].data.tags["k3pipe.aborted"]
    assert repeats["2"].info.status == "KILLED"
    # the workload did not finish, and its figures across repeats leave the cut repeat out
    assert tracker.client.get_run(workload_run.info.run_id).info.status == "KILLED"
    assert tracker.client.get_run(workload_run.info.run_id).data.metrics["repeats_aborted"] == 1

    report = build_report(tracker, run_id)
    data = report.data
    cell = data.cell("fast-aa", "w")
    assert cell is not None
    assert cell.launches_text() == "2 + 2 + 1 cut"
    assert cell.launches == 2
    assert len(cell.values["output_throughput_tps"]) == 4  # the two whole launches' repeats alone
    md = report.markdown
    assert "**fast-aa, w: 2 + 2 + 1 cut repeats** (of 2 per launch)" in md
    assert "repeat 2 ended early (interrupted by SIGINT" in md
    assert "enters no figure, verdict, noise or calibration" in md

    # the same store with the cut launch's run set aside: the complete launches alone
    tracker.set_tags(cut_run.info.run_id, {SUPERSEDED_TAG: "set aside by the test"})
    whole = analyse(collect(tracker, run_id))
    cut_analysis = report.analysis

    def said(analysis: Any) -> list[tuple[str, str, str, str]]:
        return [
            (r.workload, r.metric.key, v.text(), r.calibration.text() if r.calibration else "")
            for r in analysis.rows
            if r.decision
            for v in r.verdicts
        ]

    assert said(cut_analysis) == said(whole)
    assert [n.components for n in cut_analysis.noise] == [n.components for n in whole.noise]
    assert cut_analysis.noise[0].components is not None
    assert cut_analysis.noise[0].launches == {"fast": 3, "fast-aa": 2, "slow": 2}
    tracker.set_tags(cut_run.info.run_id, {SUPERSEDED_TAG: ""})

    # the record checker: INCOMPLETE, the cut launch and the one never run named
    check = _checker()
    store = check.Store(Path(os.environ["K3PIPE_HOME"]), "k3pipe")
    reports = check.check_record(store, yaml.safe_load(exp.read_text()), None)
    assert [r.arm for r in reports] == [
        "fast#1", "fast#2", "fast#3", "fast-aa#1", "fast-aa#2", "fast-aa#3", "slow#1", "slow#2", "slow#3",
    ]  # fmt: skip
    out = io.StringIO()
    assert check.print_report(reports, [], {}, out) == 1
    text = out.getvalue()
    assert "record: INCOMPLETE" in text
    by_arm = {r.arm: [c for c in r.checks if c.required and not c.ok] for r in reports}
    assert any(c.what == "status FINISHED" and c.detail.startswith("KILLED") for c in by_arm["fast-aa#3"])
    assert ("w: status FINISHED", "KILLED") in [(c.what, c.detail) for c in by_arm["fast-aa#3"]]
    assert [c.detail for c in by_arm["slow#3"]] == ["no run of launch 3 of this arm"]
