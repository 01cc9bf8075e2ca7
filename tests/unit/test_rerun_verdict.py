"""A rerun's verdict against its original (k3pipe.jobs.rerun.verdict) on single runs, whose requests are the
samples: a figure one side cannot be tested on is left out and said, never an error that fails the
rerun (a CI run of the rerun deployment failed so: a loaded vLLM sent each request's tokens in one
burst, every per-request TPOT was 0, and the test on logarithms raised)."""

from __future__ import annotations

import io
from types import SimpleNamespace
from typing import Any

import pandas as pd

from k3pipe.jobs.rerun import comparable_request_metrics, verdict


def _workload_run(run_id: str, requests: dict[str, list[float]]) -> Any:
    """A workload run without repeats, as MLflow gives it back, with its requests.parquet."""
    n = len(next(iter(requests.values())))
    frame = pd.DataFrame({**requests, "warmup": [False] * n, "ok": [True] * n})
    metrics = {m: sum(v) / n for m, v in requests.items()}
    return SimpleNamespace(
        info=SimpleNamespace(run_id=run_id, status="FINISHED"),
        data=SimpleNamespace(
            tags={"k3pipe.workload": "w"}, params={"workload.repeats": "1"}, metrics=metrics
        ),
        parquet=frame.to_parquet(),
    )


class _Tracker:
    """What verdict() reads of the tracker: an arm's workload runs and their artifacts."""

    def __init__(self, arms: dict[str, list[Any]]) -> None:
        self.arms = arms
        self.runs = {r.info.run_id: r for runs in arms.values() for r in runs}

    def children(self, run_id: str) -> list[Any]:
        return self.arms[run_id]

    def read_artifact(self, run_id: str, path: str, required: bool = False) -> bytes | None:
        return self.runs[run_id].parquet if path == "requests.parquet" else None

    def find_artifact(self, run_id: str, path: str) -> bytes | None:
        return self.read_artifact(run_id, path)


def test_a_tpot_of_zero_on_every_request_is_left_out_and_said() -> None:
    original = {
        "ttft_ms": [20.0, 22.0, 21.0, 23.0],
        "tpot_ms": [5.0, 5.5, 5.2, 5.1],
        "e2e_ms": [60.0, 61, 62, 63],
    }
    burst = {
        "ttft_ms": [40.0, 44.0, 42.0, 46.0],
        "tpot_ms": [0.0, 0.0, 0.0, 0.0],
        "e2e_ms": [41.0, 45, 43, 47],
    }
    tracker = _Tracker({"a": [_workload_run("wa", original)], "b": [_workload_run("wb", burst)]})

    (v,) = verdict(tracker, "a", "b")  # type: ignore[arg-type]

    assert v.basis == "requests"
    assert [c.metric for c in v.rows if c.outcome != "untested"] == [
        "ttft_ms (per request)",
        "e2e_ms (per request)",
    ]
    assert v.left_out == [
        "tpot_ms per request (positive values: 4 in the original, 0 in the rerun; "
        "a test needs 2 on each side)"
    ]
    # two single runs, and no earlier study kept their restart noise: a 2x TTFT is not claimed
    assert {c.outcome for c in v.rows} == {"unknown"}
    assert v.summary.startswith("cannot tell: restart noise unknown")
    assert v.summary.endswith("; not tested: " + v.left_out[0])


def test_metrics_with_two_positive_values_a_side_are_tested() -> None:
    a = {"ttft_ms": [1.0, 2.0], "tpot_ms": [0.0, 3.0, 4.0], "e2e_ms": [5.0]}
    b = {"ttft_ms": [1.0, 2.0, 0.0], "tpot_ms": [1.0, 0.0, 0.0], "e2e_ms": [5.0]}
    names, left_out = comparable_request_metrics(a, b)
    assert names == ["ttft_ms"]
    assert left_out == [
        "tpot_ms per request (positive values: 2 in the original, 1 in the rerun; "
        "a test needs 2 on each side)"
    ]
    # one request a side is no sample at all: nothing to say about it
    assert comparable_request_metrics({"e2e_ms": [1.0]}, {"e2e_ms": [2.0]}) == ([], [])


def test_parquet_round_trip_of_the_stand_in() -> None:
    """The stand-in's artifact reads back as k3pipe.records.compare.request_values reads a real one."""
    run = _workload_run("x", {"ttft_ms": [1.0, 2.0]})
    assert list(pd.read_parquet(io.BytesIO(run.parquet))["ttft_ms"]) == [1.0, 2.0]
