"""The verdicts on the real engine here: one study through the study job (what the study flow runs)
with the real vLLM (CPU build) serving the tiny model, the demo's two arms (max_num_seqs 1 against 4)
each launched three times, interleaved, and the A/A calibration (batch4's copy, launched three times
too), the study stopped by a real SIGINT in the last launch, batch4-aa's third, in its second repeat:
as `timeout --signal=INT` stops a study at a sitting's deadline (the H100's A/A copy was cut so).

What must hold: the A/A is never called better or worse (equivalent within the margin, or
inconclusive), the A/B is detected on TTFT p50 (batch1 queues three of the four streams: about 15x),
every verdict is one of the three outcomes with the interval it was made with, and restart noise is
measured (three launches of every arm); the cut launch is named ("3 + 3 + 1 cut"), its engine
stopped, and the verdicts, calibration and noise are those of the complete launches (the same store
with the cut launch set aside). The decision rests on TTFT p50 at alpha 0.01: by design this test
could fail on the A/A at most 1% of the time, if the engine's noise is as the model says.

Power sets the launches. Launch means are the unit, so two launches per arm leave 2 degrees of
freedom: at alpha 0.01 the A/B is then found only when log(ratio) exceeds 9.92 pooled launch-to-launch
standard deviations (log scale). On 2 busy cores (the parallel phase) that deviation reached 0.34 and
a CI run missed a 17x A/B (2026-12-03). Three launches leave 4 degrees of freedom (t 4.60, and the
mean of three): the A/B is found while that deviation stays below about 0.75. Not three against two
(two fewer cold starts): unequal launch counts are compared by Welch's rule, not pooled, and the
two-launch side's variance has one degree of freedom; a 12x A/B with every launch mean within 10% of
its arm's came out "inconclusive: differences below 327x cannot be seen" (2026-12-07).

It runs in the parallel phase, beside the other workers. It ran alone (the timing phase) while the
CPU build's OpenMP threads spun when idle: beside another worker the launches' TTFT p50 moved tenfold
with what that worker ran (25 to 560 ms for the same arm, 2026-12-04), the deviation reached 1.3, and
the study rightly answered "inconclusive: differences below 98x cannot be seen". With
`OMP_WAIT_POLICY=PASSIVE` (experiments/demo-cpu.yaml) it was run twice beside two workers running the
faults, study, spool and alerts tests (2026-12-07): batch4's launch means 15-128 ms, batch1's
496-1,691, the A/B found both times ("22.39x [-98.9%, -81.8%]", "28.39x [-99.1%, -86.4%]": even the
interval's near end 5.5x and 7.4x), the A/A inconclusive (below 22x and 19x), 290 and 305 s against
220 s alone."""

from __future__ import annotations

import os
import signal
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from k3pipe.core.layout import SUPERSEDED_TAG
from k3pipe.core.settings import Settings
from k3pipe.report import Report, build_report
from k3pipe.report.analysis import analyse
from k3pipe.report.collect import collect
from tests.conftest import ASSETS_HOME, REPO, free_port, require_engine

pytestmark = pytest.mark.engine


def _experiment() -> dict:
    data = yaml.safe_load((REPO / "experiments" / "demo-study.yaml").read_text())
    data = yaml.safe_load(yaml.safe_dump(data).replace("{home}", str(ASSETS_HOME)))
    data["name"] = "verdicts-cpu"
    data.pop("answers", None)  # the output probe has its own test (tests/engine/test_answers_cpu.py)
    data["arms"].reverse()  # batch1 first: batch4's A/A copy then launches last (b1 b4 b4-aa, ...)
    for arm in data["arms"]:
        arm["launches"] = 3
        arm["launcher"]["port"] = free_port()
        arm["engine"]["env"]["VLLM_CACHE_ROOT"] = str(ASSETS_HOME / "cache" / "vllm")
    data["decision"] = {"metrics": ["ttft_ms_p50"], "alpha": 0.01, "calibration": True, "baseline": "batch4"}
    data["workloads"] = [
        {"name": "in256-out64", "input_tokens": 256, "output_tokens": 64, "concurrency": 4,
         "num_requests": 8, "warmup_requests": 1, "repeats": 3, "seed": 1}
    ]  # fmt: skip
    return data


def _seen(report: Report) -> str:
    """Each arm's TTFT p50 per launch and repeat (ms), for the message of a failed assertion."""
    cells = [c for c in (report.data.cell(a, "in256-out64") for a in report.data.arm_names) if c]
    return "; ".join(
        f"{c.arm}: "
        + " | ".join(", ".join(f"{v:.0f}" for v in launch) for launch in c.by_launch("ttft_ms_p50"))
        for c in cells
    )


def test_an_a_a_and_an_a_b_on_the_real_engine_and_a_launch_cut_by_a_deadline(tmp_path: Path) -> None:
    require_engine()
    from k3pipe.experiment.params import RunRequest
    from k3pipe.jobs.arm_run import benchmark as arm_benchmark
    from k3pipe.jobs.steps import Job
    from k3pipe.jobs.study import study

    exp = tmp_path / "verdicts-cpu.yaml"
    exp.write_text(yaml.safe_dump(_experiment()))
    job = Job.library(Settings())
    bench = job.steps.arm.benchmark
    calls: dict[str, int] = {}

    def deadline(message: str) -> None:
        # the repeat's first progress line (2 of its 9 requests answered): the rest are in flight. Not
        # a timer: a batch4 repeat takes about 0.4 s, and one that began later than a timer thought
        # ran to its end before the signal (a fresh-clone run, 2026-12-07: "3 + 3 + 2 cut")
        if "requests done" in message and not fired:
            fired.append(message)
            os.kill(os.getpid(), signal.SIGINT)

    fired: list[str] = []

    def cut(plan, workload, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls[plan.arm] = calls.get(plan.arm, 0) + 1
        if plan.arm == "batch4-aa" and calls[plan.arm] == 8:  # its third launch, second repeat
            return arm_benchmark(plan, workload, *args, progress=deadline, **kwargs)
        return bench(plan, workload, *args, **kwargs)

    with pytest.raises(KeyboardInterrupt):
        study(RunRequest(experiment=str(exp)), job.with_steps(arm=replace(job.steps.arm, benchmark=cut)))
    assert fired, "the deadline's signal was never sent"
    tracker = job.tracker
    (study_run,) = tracker.client.search_runs(
        [tracker.require_experiment_id()], "tags.`k3pipe.kind` = 'study'"
    )
    run_id = study_run.info.run_id
    arms = sorted(tracker.children(run_id), key=lambda r: r.info.start_time)
    order = [(r.data.tags["k3pipe.arm"], int(r.data.tags["k3pipe.launch"]), r.info.status) for r in arms]
    assert order == [
        ("batch1", 1, "FINISHED"), ("batch4", 1, "FINISHED"), ("batch4-aa", 1, "FINISHED"),
        ("batch4-aa", 2, "FINISHED"), ("batch4", 2, "FINISHED"), ("batch1", 2, "FINISHED"),
        ("batch1", 3, "FINISHED"), ("batch4", 3, "FINISHED"), ("batch4-aa", 3, "KILLED"),
    ]  # fmt: skip

    report = build_report(tracker, run_id)
    (ttft,) = [r for r in report.analysis.rows if r.decision]
    assert ttft.metric.key == "ttft_ms_p50"
    assert all(c.estimate.basis == "launches" for c in ttft.cells.values())
    assert report.analysis.restart_noise_measured

    # the A/B: batch4 better on TTFT, detected with restart noise in the interval
    (ab,) = ttft.verdicts
    seen = _seen(report)
    assert ab.different, f"{ab.text()}; {seen}"
    assert ab.leader == "batch4"
    assert ab.verdict.restart_noise_measured
    assert ab.ci is not None
    assert ab.ci[0] > 1

    # the A/A: never better or worse
    aa = ttft.calibration
    assert aa is not None
    assert aa.outcome in ("equivalent", "inconclusive"), f"{aa.text()}; {seen}"

    # the cut launch: named, in no figure
    cell = report.data.cell("batch4-aa", "in256-out64")
    assert cell is not None
    assert cell.launches == 2
    assert cell.launches_text() in ("3 + 3 + 1 cut", "3 + 3 + 0 cut"), cell.launches_text()
    text = report.markdown
    assert f"**batch4-aa, in256-out64: {cell.launches_text()} repeats** (of 3 per launch)" in text
    assert "no difference" not in text
    assert "## Calibration: A/A" in text
    assert "## Noise: restart and repeat" in text
    noise = next(n for n in report.analysis.noise if n.metric.key == "ttft_ms_p50")
    assert noise.components is not None
    assert noise.components.df_between == 5  # three launches of batch1 and batch4, two of the copy

    # the complete launches alone (the cut one set aside) give the same verdicts, A/A and noise
    tracker.set_tags(arms[-1].info.run_id, {SUPERSEDED_TAG: "set aside by the test"})
    whole = analyse(collect(tracker, run_id))
    (whole_ttft,) = [r for r in whole.rows if r.decision]
    assert [v.text() for v in whole_ttft.verdicts] == [v.text() for v in ttft.verdicts]
    assert whole_ttft.calibration is not None
    assert whole_ttft.calibration.text() == aa.text()
    assert [n.components for n in whole.noise] == [n.components for n in report.analysis.noise]
