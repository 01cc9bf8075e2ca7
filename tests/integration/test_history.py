"""Browsing history (a real SQLite MLflow store): `k3pipe runs` filtered by engine, model, workload
and date, a study listed with its arms beneath it, and `k3pipe history` following one workload's
metric across runs, reruns and studies (table and plot)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from k3pipe.cli.main import app
from k3pipe.core.errors import TrackingError
from k3pipe.records.history import metric_history, plot_history, recent_runs
from k3pipe.records.tracking import Tracker


def _arm(tracker: Tracker, arm: str, engine: str, ttft: float, parent: str | None = None, **tags: str) -> str:
    run = tracker.start_run(
        f"exp/{arm}", tags={"k3pipe.arm": arm, "k3pipe.engine": engine, **tags}, parent_id=parent
    )
    tracker.log_params(run, {"model_id": f"{engine}-model"})
    tracker.log_metrics(run, {"w.ttft_ms_p50": ttft})
    wl = tracker.start_run(f"{arm}/w", tags={"k3pipe.arm": arm, "k3pipe.workload": "w"}, parent_id=run)
    tracker.log_params(wl, {"workload.repeats": 2})
    tracker.log_metrics(
        wl, {"ttft_ms_p50": ttft, "ttft_ms_p50.ci95_low": ttft - 1, "ttft_ms_p50.ci95_high": ttft + 1}
    )
    for k in (1, 2):
        rep = tracker.start_run(
            f"{arm}/w#{k}", tags={"k3pipe.workload": "w", "k3pipe.repeat": str(k)}, parent_id=wl
        )
        tracker.log_metrics(rep, {"ttft_ms_p50": ttft + k})
        tracker.end_run(rep)
    tracker.end_run(wl)
    tracker.end_run(run)
    time.sleep(0.01)  # distinct start times, in this order
    return run


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Tracker:
    monkeypatch.setenv("K3PIPE_HOME", str(tmp_path / "home"))
    tracker = Tracker(
        f"sqlite:///{tmp_path / 'home' / 'mlflow' / 'mlflow.db'}", "k3pipe", tmp_path / "artifacts"
    )
    first = _arm(tracker, "a", "vllm", 50.0)
    _arm(tracker, "a", "vllm", 48.0, **{"k3pipe.rerun_of": first})
    study = tracker.start_run("study/exp", tags={"k3pipe.kind": "study", "k3pipe.experiment": "exp"})
    _arm(tracker, "a", "vllm", 47.0, parent=study)
    _arm(tracker, "b", "sglang", 60.0, parent=study)
    tracker.end_run(study)
    return tracker


def test_runs_filters_and_a_study_with_its_arms(store: Tracker) -> None:
    every = recent_runs(store, 10)
    assert list(every["name"]) == ["study/exp", "  exp/a", "  exp/b", "exp/a", "exp/a"]
    sglang = recent_runs(store, 10, engine="sglang")
    assert list(sglang["name"]) == ["study/exp", "  exp/b"]
    assert list(recent_runs(store, 10, model="vllm-model")["name"]) == [
        "study/exp",
        "  exp/a",
        "exp/a",
        "exp/a",
    ]
    assert recent_runs(store, 10, workload="nope").empty
    assert recent_runs(store, 10, since="2999-01-01").empty
    with pytest.raises(TrackingError, match="--since 'yesterday-ish' is not a date"):
        recent_runs(store, 10, since="yesterday-ish")


def test_a_metric_across_runs_reruns_and_studies(store: Tracker) -> None:
    frame = metric_history(store, "ttft_ms_p50", "w")
    assert list(frame["value"]) == [50.0, 48.0, 47.0, 60.0]  # oldest first; repeats left to their mean
    assert list(frame["arm"]) == ["a", "a", "a", "b"]
    assert list(frame["engine"]) == ["vllm", "vllm", "vllm", "sglang"]
    assert frame["rerun_of"][0] == ""
    assert frame["rerun_of"][1] != ""
    assert list(frame["ci95_low"]) == [49.0, 47.0, 46.0, 59.0]
    assert list(metric_history(store, "ttft_ms_p50", "w", engine="sglang")["value"]) == [60.0]
    assert plot_history(frame, "ttft_ms_p50", "w")[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(TrackingError, match=r"no run of workload 'w' .* recorded 'tpot_ms_p50'"):
        metric_history(store, "tpot_ms_p50", "w")


def test_the_commands(store: Tracker, tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(
        app, ["history", "ttft_ms_p50", "--workload", "w", "--arm", "a", "--plot", str(tmp_path / "h.png")]
    )
    assert result.exit_code == 0, result.output
    assert "50.0" in result.output
    assert "60.0" not in result.output
    assert (tmp_path / "h.png").read_bytes()[:4] == b"\x89PNG"
    result = runner.invoke(app, ["runs", "--engine", "sglang"])
    assert result.exit_code == 0, result.output
    assert "exp/b" in result.output
    assert "  exp/a" not in result.output


def test_a_study_newer_than_its_runs_is_listed_whatever_it_nests(tmp_path: Path) -> None:
    """A study's nested runs (launches x workloads x repeats) start after it and outnumber any page
    of the newest runs: two launches of three arms on two workloads of three repeats are 54 runs, and
    `k3pipe runs --limit 3` once read 30 and listed no run at all. The newest top-level runs are
    found through as many pages as it takes."""
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "history", tmp_path / "artifacts")
    lone = _arm(tracker, "lone", "vllm", 10.0)
    study = tracker.start_run("study/s", tags={"k3pipe.kind": "study"})
    arm = tracker.start_run("s/a", tags={"k3pipe.arm": "a", "k3pipe.engine": "vllm"}, parent_id=study)
    for k in range(230):  # more than a page (200) of nested runs, all newer than the study
        tracker.end_run(tracker.start_run(f"s/a/w#{k}", tags={"k3pipe.repeat": str(k)}, parent_id=arm))
    tracker.end_run(arm)
    tracker.end_run(study)
    rows = recent_runs(tracker, 2)
    assert [n.strip() for n in rows["name"] if not n.startswith(" ")][:2] == ["study/s", "exp/lone"]
    assert lone in set(rows["run_id"])
