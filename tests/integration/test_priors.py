"""Restart noise kept by one study and used by a later one (k3pipe.records.priors), through the study job and
a
real MLflow store, the arms served by the scripted OpenAI server (k3pipe/testing/scripted_openai.py).

- A study of two arms launched twice keeps its restart noise on its run (noise.json, tag k3pipe.noise),
  per cell and figure, under the cell's configuration class.
- A later study of the same class whose arms are launched once: with too little history (fewer than
  MIN_PRIOR_DF degrees of freedom) its verdicts say "cannot tell: restart noise unknown"; with enough
  (an earlier study's noise of the class, a day old) they are made with it, and say its source and
  age; noise older than decision.prior_days is not used.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from k3pipe.core.layout import NOISE_FILE, NOISE_TAG
from k3pipe.core.settings import Settings
from k3pipe.experiment.params import RunRequest
from k3pipe.jobs.steps import Job
from k3pipe.jobs.study import study
from k3pipe.records.priors import MIN_PRIOR_DF, NoiseEntry, record_noise
from k3pipe.report import build_report
from k3pipe.report.collect import cell_class_of
from k3pipe.testing.scripted_openai import Script, ScriptedOpenAI
from tests.conftest import TINY_MODEL


@pytest.fixture
def servers() -> Iterator[tuple[ScriptedOpenAI, ScriptedOpenAI]]:
    if not (TINY_MODEL / "config.json").is_file():
        pytest.fail(f"no tiny model at {TINY_MODEL}: run the tests with `make test`, which makes it")
    with (
        ScriptedOpenAI(Script(inter_token_s=0.002), model="m") as fast,
        ScriptedOpenAI(Script(inter_token_s=0.006), model="m") as slow,
    ):
        yield fast, slow


def _experiment(fast: str, slow: str, launches: int) -> dict[str, Any]:
    def arm(name: str, url: str) -> dict[str, Any]:
        return {
            "name": name,
            "engine": {"kind": "vllm"},
            "launcher": {"kind": "external"},
            "endpoint": {"base_url": url, "model": "m"},
            "launches": launches,
        }

    return {
        "name": "prior-study",
        "model": {"source": "local", "path": str(TINY_MODEL)},
        "arms": [arm("fast", fast), arm("slow", slow)],
        "workloads": [
            {"name": "w", "input_tokens": 32, "output_tokens": 16, "concurrency": 2, "num_requests": 4,
             "warmup_requests": 0, "repeats": 2, "seed": 3},
        ],
        "decision": {"metrics": ["output_throughput_tps"]},
    }  # fmt: skip


def test_restart_noise_kept_by_a_study_judges_a_later_one_launched_once(
    servers: tuple[ScriptedOpenAI, ScriptedOpenAI], tmp_path: Path
) -> None:
    fast, slow = servers
    job = Job.library(Settings())
    tracker = job.tracker

    twice = tmp_path / "twice.yaml"
    twice.write_text(yaml.safe_dump(_experiment(fast.base_url, slow.base_url, 2)))
    first = study(RunRequest(experiment=str(twice)), job)
    kept = tracker.client.get_run(first.study_run_id)
    raw = tracker.read_artifact(first.study_run_id, NOISE_FILE)
    assert raw is not None
    entries = [NoiseEntry.model_validate(e) for e in json.loads(raw)]
    assert kept.data.tags[NOISE_TAG] == str(len(entries))
    throughput = [e for e in entries if e.metric == "output_throughput_tps"]
    assert {e.arm for e in throughput} == {"fast", "slow"}
    assert all(e.df == 1 and e.repeats == [2, 2] for e in throughput)
    assert len({e.key for e in throughput}) == 1  # one class: same engine kind, model, node, workload
    assert "vllm, local " in throughput[0].label

    # launched once: the history holds 2 degrees of freedom, too few to stand for a launch not made
    once = tmp_path / "once.yaml"
    once.write_text(yaml.safe_dump(_experiment(fast.base_url, slow.base_url, 1)))
    second = study(RunRequest(experiment=str(once)), job)
    report = build_report(tracker, second.study_run_id)
    (row,) = [r for r in report.analysis.rows if r.decision]
    (pair,) = row.verdicts
    assert MIN_PRIOR_DF > 2
    assert pair.outcome == "unknown"
    assert "cannot tell: restart noise unknown" in report.markdown

    # an earlier study of the same class, a day old, that measured 2% restart noise over 6 launches
    cell = report.data.cell("fast", "w")
    assert cell is not None
    klass = cell_class_of(report.data.arms, cell)
    assert klass is not None
    started = tracker.client.get_run(second.study_run_id).info.start_time

    def earlier(days: float, launches: int) -> None:
        """An earlier study's run, started ``days`` before the later study, that kept this class's noise."""
        run_id = tracker.start_run(
            "study/then",
            tags={"k3pipe.kind": "study", "k3pipe.experiment": "prior-study"},
            start_ms=started - int(days * 86_400_000),
        )
        noise = NoiseEntry(
            key=klass.key, label=klass.label(), metric="output_throughput_tps", arm="fast", workload="w",
            ss=(launches - 1) * math.log1p(0.02**2), df=launches - 1, repeats=[2] * launches,
        )  # fmt: skip
        record_noise(tracker, run_id, [noise])
        tracker.end_run(run_id, "FINISHED")

    def verdict() -> Any:
        report = build_report(tracker, second.study_run_id)
        (row,) = [r for r in report.analysis.rows if r.decision]
        (pair,) = row.verdicts
        return pair, report

    earlier(40, 7)  # older than decision.prior_days (30): not used
    assert verdict()[0].outcome == "unknown"
    earlier(1, 6)
    pair, report = verdict()
    assert pair.verdict.restart == "prior"
    assert pair.outcome != "unknown"
    assert pair.verdict.prior is not None
    assert pair.verdict.prior.df == 7  # the day-old study's 5 and the first study's 2
    said = pair.text()
    assert "from the history (2 earlier studies, 10 launches" in said  # 2 x 2 before, then 6
    assert "the newest 0 day(s) old" in said or "the newest 1 day(s) old" in said
    assert "judged with the restart noise earlier studies measured" in report.markdown
