"""The output probe in a study on the real engine here (issue 47): experiments/answers-cpu.yaml, the
real vLLM (CPU build) serving the tiny model in float32 twice (the floor), in bfloat16 (other
arithmetic) and with n-gram speculation (which must leave greedy tokens alone), through the study job.

What must hold: every launch records its answers (the same prompts, by digest) and the probe's time;
the floor is the reference launched twice (on a CPU, one request at a time, the same answers: a nil
floor); bfloat16 is judged to diverge beyond it (its teacher-forced log-probabilities move); the n-gram
arm's greedy tokens are reported identical to the plain arm's where the floor agreed, or each prompt
where they differ is named; the report's "Answers" section states the floor, each arm, the probe's
share of the study's time, and each arm's task score on 20 arithmetic questions (the paired verdict
against the reference; a random model scores about 0). The gate itself (a faster arm whose answers
diverge is not recommended) is held on studies of set truth in tests/unit/test_report_answers.py:
here bfloat16 is slower anyway."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from k3pipe.core.settings import Settings
from k3pipe.report import build_report
from tests.conftest import ASSETS_HOME, REPO, free_port, require_engine

pytestmark = pytest.mark.engine


def _experiment() -> dict:
    text = (REPO / "experiments" / "answers-cpu.yaml").read_text().replace("{home}", str(ASSETS_HOME))
    data = yaml.safe_load(text)
    data["answers"]["accuracy"]["path"] = str(REPO / data["answers"]["accuracy"]["path"])
    for arm in data["arms"]:
        arm["launcher"] = {**arm["launcher"], "port": free_port()}
    return data


def test_the_answers_of_three_arms_against_the_floor_on_the_real_engine(tmp_path: Path) -> None:
    require_engine()
    from k3pipe.experiment.params import RunRequest
    from k3pipe.jobs.steps import Job
    from k3pipe.jobs.study import study

    exp = tmp_path / "answers-cpu.yaml"
    exp.write_text(yaml.safe_dump(_experiment()))
    job = Job.library(Settings())
    study(RunRequest(experiment=str(exp)), job)
    tracker = job.tracker
    (study_run,) = tracker.client.search_runs(
        [tracker.require_experiment_id()], "tags.`k3pipe.kind` = 'study'"
    )
    report = build_report(tracker, study_run.info.run_id)

    launches = report.data.arms
    assert sorted((a.name, a.launch) for a in launches) == [
        ("bf16", 1),
        ("fp32", 1),
        ("fp32", 2),
        ("ngram", 1),
    ]
    for a in launches:
        assert a.answers is not None, a.name
        assert a.answers["error"] is None, a.answers["error"]
        assert len(a.answers["answers"]) == 8
        assert all(len(x["tokens"]) == 16 and len(x["logprobs"]) == 8 for x in a.answers["answers"].values())
    assert len({a.answers["digest"] for a in launches if a.answers}) == 1  # the same prompts every launch

    answers = report.analysis.answers
    assert answers is not None
    assert answers.reference == "fp32"
    assert answers.floor_label == "fp32 launch 2 against its launch 1"
    floor = answers.floor
    assert floor is not None
    assert floor.identical == 8
    assert floor.mean_logprob_mad is not None
    assert floor.mean_logprob_mad < 1e-4  # one request at a time on a CPU: the same arithmetic

    bf16 = answers.arm("bf16")
    assert bf16 is not None
    assert bf16.verdict is not None
    assert bf16.verdict.diverges, bf16.verdict.describe()
    assert bf16.agreement is not None
    assert bf16.agreement.mean_logprob_mad is not None
    assert bf16.agreement.mean_logprob_mad > 10 * floor.mean_logprob_mad

    ngram = answers.arm("ngram")
    assert ngram is not None
    assert ngram.lossless is not None
    assert "ngram" in ngram.lossless
    assert ngram.twin == "fp32"
    assert ngram.differences is not None
    text = report.markdown
    if ngram.differences:  # where speculation changed greedy tokens, each prompt is named
        assert "**ngram changed greedy tokens**" in text
        for d in ngram.differences:
            assert f"{d.prompt_id} at token {d.position}" in text
    else:
        assert "identical where the floor agreed" in text

    scores = {s.arm: s for s in answers.scores}
    assert sorted(scores) == ["bf16", "fp32", "ngram"]  # each arm's first launch, the reference first
    assert answers.scores[0].arm == "fp32"
    assert all(s.questions == 20 for s in scores.values())
    for arm in ("bf16", "ngram"):
        verdict = scores[arm].verdict
        assert verdict is not None
        assert verdict.outcome != "better" or scores["fp32"].right < scores[arm].right

    section = text.split("## Answers", 1)[1].split("\n## ", 1)[0]
    assert "Task score: the questions of" in section
    assert "The floor (fp32 launch 2 against its launch 1): 8 of 8 identical" in section
    assert "| bf16 | 1 |" in section
    assert "diverges beyond the floor over 8 prompts" in section
    assert "of the study's wall time" in section
    assert "bf16's answers differ" in text.split("## The answer", 1)[1].split("\n## ", 1)[0]
