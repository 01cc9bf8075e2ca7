"""Which retests make a retest's series, and what a retest's value is (k3pipe.jobs.alerts), on records
written with the tracker into a real SQLite MLflow store, in the shape a retest records them (its
run, its baseline study, each launch of the arm, each workload with its figures), each a day apart:
no engine runs. The series starts at the newest accepted retest, leaves out the retests that raised
an alert until an acceptance clears them, and takes no rerun and no retest with other overrides; a
retest's value is the geometric mean of its launch means, without the launches that did not finish,
that a resume superseded or that primed the engine."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pytest

from k3pipe.core.errors import TrackingError
from k3pipe.core.layout import ACCEPTED_TAG, PRIME_TAG, REGRESSION_TAG, RERUN_TAG, SUPERSEDED_TAG
from k3pipe.jobs.alerts import accept, check_regression, record_regression
from k3pipe.jobs.steps import Job
from k3pipe.records.tracking import Tracker

T0 = datetime(2026, 11, 1, tzinfo=UTC)
DAY_MS = 86_400_000
METRICS = ("e2e_ms_p50", "output_throughput_tps")


@pytest.fixture
def tracker() -> Tracker:
    return Job.library().tracker  # K3PIPE_HOME's SQLite store


def write_retest(
    tracker: Tracker,
    day: int,
    e2e_ms: list[float],
    *,
    tags: dict[str, str] | None = None,
    overrides: dict[str, str] | None = None,
    version: str = "1.0",
    other_launches: dict[str, float] | None = None,
    answers: list[dict[str, Any]] | None = None,
) -> str:
    """A retest started on ``day`` (after T0) whose baseline study launched arm 'engine' once per
    value of ``e2e_ms`` (the workload 'w', one repeat: its E2E and a throughput of 1000 / E2E);
    ``other_launches``: launches that must not count ('superseded', 'prime', 'failed') -> a value;
    ``answers``: each measured launch's output probe (answers.json), in order.
    A variant study beside it measures something else entirely."""
    start = int(T0.timestamp() * 1000) + day * DAY_MS
    retest = tracker.start_run(
        "retest/series-test",
        tags={"k3pipe.kind": "retest", "k3pipe.experiment": "series-test", **(tags or {})},
        start_ms=start,
    )
    tracker.log_params(retest, {"experiment_file": "series-test.yaml", **(overrides or {})})
    for variant, scale in (("baseline", 1.0), ("short", 50.0)):
        study = tracker.start_run(
            "study/series-test",
            tags={"k3pipe.kind": "study", "k3pipe.variant": variant, "k3pipe.experiment": "series-test"},
            parent_id=retest,
            start_ms=start + 1,
        )
        launches: list[tuple[str, float, dict[str, str], str]] = [
            (str(i), e2e, {}, "FINISHED") for i, e2e in enumerate(e2e_ms, 1)
        ]
        for kind, e2e in (other_launches or {}).items():
            launches.append(
                {
                    "superseded": ("1", e2e, {SUPERSEDED_TAG: "resumed"}, "FINISHED"),
                    "prime": ("0", e2e, {PRIME_TAG: "1"}, "FINISHED"),
                    "failed": (str(len(e2e_ms) + 1), e2e, {}, "FAILED"),
                }[kind]
            )
        for n, (launch, e2e, marks, status) in enumerate(launches):
            arm = tracker.start_run(
                f"engine#{launch}",
                tags={"k3pipe.arm": "engine", "k3pipe.launch": launch, "k3pipe.engine": "vllm", **marks},
                parent_id=study,
                start_ms=start + 2 + n,
            )
            tracker.log_params(arm, {"engine_version_declared": version})
            if answers and variant == "baseline" and n < len(answers):
                tracker.log_dict(arm, answers[n], "answers.json")
            workload = tracker.start_run(
                "w", tags={"k3pipe.workload": "w"}, parent_id=arm, start_ms=start + 2 + n
            )
            tracker.log_params(workload, {"workload.repeats": "1"})
            value = e2e * scale
            tracker.log_metrics(workload, {"e2e_ms_p50": value, "output_throughput_tps": 1000 / value})
            tracker.end_run(workload, status)
            tracker.end_run(arm, status)
        tracker.end_run(study, "FINISHED")
    tracker.end_run(retest, "FINISHED")
    return retest


def judged(tracker: Tracker, run_id: str) -> Any:
    check = check_regression(tracker, run_id, METRICS)
    record_regression(tracker, check)
    return check


def test_the_series_its_values_and_an_acceptance(tracker: Tracker) -> None:
    rng = np.random.default_rng(1)

    def noisy() -> float:
        return float(100 * math.exp(rng.normal(0.0, 0.03)))

    good = [write_retest(tracker, day, [noisy(), noisy()]) for day in range(5)]
    for run_id in good:
        judged(tracker, run_id)
    assert (
        tracker.client.get_run(good[3])
        .data.tags[REGRESSION_TAG]
        .startswith("insufficient history: 3 earlier")
    )
    assert tracker.client.get_run(good[4]).data.tags[REGRESSION_TAG] == "none"

    bad = write_retest(tracker, 5, [300.0, 310.0], version="1.1")
    assert judged(tracker, bad).status == "worse"
    after = write_retest(tracker, 6, [noisy(), noisy()])
    write_retest(tracker, 7, [1000.0], tags={RERUN_TAG: bad})  # a rerun: in no series
    write_retest(tracker, 8, [1000.0], overrides={"override.repeats": "2"})  # other overrides: another series
    tonight = write_retest(
        tracker, 9, [100.0, 102.0], other_launches={"superseded": 5000.0, "prime": 5000.0, "failed": 5000.0}
    )
    check = judged(tracker, tonight)
    assert check.status == "none", check.summary()
    assert (check.series.retests, check.series.left_out) == (7, 1)  # the bad one left out
    assert (check.series.first_run_id, check.series.last_run_id) == (good[0], after)
    assert check.compared == 2
    (e2e,) = [v for v in check.values if v["metric"] == "e2e_ms_p50"]
    assert e2e["launches"] == 2  # the superseded, priming and failed launches are not measured
    assert e2e["launch_log_means"] == pytest.approx([math.log(100.0), math.log(102.0)])
    assert check.arm_versions == {"engine": "vllm 1.0"}

    worse = write_retest(tracker, 10, [400.0, 410.0], version="1.2")
    check = judged(tracker, worse)
    assert check.status == "worse"
    by_metric = {w.metric: w for w in check.worse}
    assert set(by_metric) == set(METRICS)
    e2e_worse = by_metric["e2e_ms_p50"]
    assert (e2e_worse.segment, e2e_worse.since_run_id) == (1, worse)
    assert e2e_worse.history == 7  # the five good ones, the one after the bad one, and tonight's
    assert (e2e_worse.history_first_run_id, e2e_worse.history_last_run_id) == (good[0], tonight)
    assert e2e_worse.history_first == "2026-11-01 00:00"
    assert e2e_worse.segment_mean == pytest.approx(math.sqrt(400.0 * 410.0))
    assert e2e_worse.change.startswith("+")
    assert by_metric["output_throughput_tps"].change.startswith("-")
    assert check.versions == {"engine": {"good": "vllm 1.0", "bad": "vllm 1.2"}}
    assert "vllm 1.0 -> vllm 1.2" in check.summary()

    # the bad one was the new normal after all: accepted on the 20th, it starts the series, and the
    # alert raised since (on the 10th) is cleared; one raised after the acceptance is not
    done = accept(tracker, bad[:10], now=datetime(2026, 11, 20, tzinfo=UTC))
    assert (done.run_id, done.at, done.newer_accepted) == (bad, "2026-11-20T00:00:00+00:00", None)
    assert done.later == 3  # after, tonight, worse: not the rerun, not the other overrides
    assert tracker.client.get_run(bad).data.tags[ACCEPTED_TAG] == done.at
    late = write_retest(tracker, 25, [900.0], tags={REGRESSION_TAG: "worse than the series: ..."})
    check = check_regression(tracker, write_retest(tracker, 26, [400.0]), METRICS)
    assert check.series.start_run_id == bad
    assert check.series.accepted_at == done.at
    assert (check.series.retests, check.series.left_out) == (5, 1)  # bad, after, tonight, worse; late out
    assert check.series.last_run_id == late
    assert f"since retest {bad[:12]} was accepted" in check.summary()


def test_accepting_what_is_not_a_scheduled_retest_is_refused_naming_it(tracker: Tracker) -> None:
    retest = write_retest(tracker, 0, [100.0])
    study = tracker.children(retest)[0].info.run_id
    with pytest.raises(TrackingError, match=f"run {study} is not a retest's run"):
        accept(tracker, study)
    rerun = write_retest(tracker, 1, [100.0], tags={RERUN_TAG: retest})
    with pytest.raises(TrackingError, match=f"run {rerun} is a rerun of retest {retest}"):
        accept(tracker, rerun)
    with pytest.raises(TrackingError, match="'0000000000'"):
        accept(tracker, "0000000000")
    assert ACCEPTED_TAG not in tracker.client.get_run(retest).data.tags


def probe(rng: np.random.Generator, base: np.ndarray) -> dict[str, Any]:
    """One launch's answers.json: 16 prompts' greedy tokens and continuation log-probabilities,
    ``base`` moved by the engine's own noise (0.002 nats)."""
    answers = {
        f"p{i:03d}": {
            "tokens": list(range(i, i + 8)),
            "logprobs": [float(x) for x in base[i] + rng.normal(0, 0.002, 8)],
        }
        for i in range(len(base))
    }
    return {"digest": "d", "dialect": "vllm", "output_tokens": 8, "scored": True, "seconds": 1.0,
            "error": None, "answers": answers}  # fmt: skip


def test_answers_that_moved_are_a_regression_even_when_speed_did_not(tracker: Tracker) -> None:
    """The output probe in a retest's series: tonight's answers against those of the retest the
    series starts at, judged against the floor of tonight's two launches. The same answers again:
    no alert (with too little history for the speed figures to be judged). Answers moved by 0.05
    nats a token on the same speed: a regression, said as such, the same night."""
    rng = np.random.default_rng(5)
    base = rng.normal(-3.0, 1.0, (16, 8))
    same = [4000.0, 4040.0]
    first = write_retest(tracker, 200, same, answers=[probe(rng, base), probe(rng, base)])
    check = judged(tracker, first)
    assert check.answers == []
    assert check.answers_note == "no earlier retest of the series recorded answers: tonight's are the first"
    again = write_retest(tracker, 201, same, answers=[probe(rng, base), probe(rng, base)])
    check = judged(tracker, again)
    assert check.answers == []
    assert check.answers_note == f"1 arm(s) compared with retest {first[:12]}"
    assert check.status == "insufficient history"
    other = base + rng.choice([-0.05, 0.05], base.shape)  # other arithmetic, the same on every launch
    moved = write_retest(tracker, 202, same, answers=[probe(rng, other), probe(rng, other)])
    check = judged(tracker, moved)
    assert check.status == "worse"
    assert check.speed == "insufficient history"
    assert check.regressed
    (what,) = check.answers
    assert what.arm == "engine"
    assert what.against_run_id == first
    assert "diverges beyond the floor over 16 prompts" in what.verdict
    assert check.summary().startswith(
        f"worse: answers moved: engine's answers moved since retest {first[:12]}"
    )
    assert tracker.client.get_run(moved).data.tags[REGRESSION_TAG].startswith("worse: answers moved")
