"""The load profiles (k3pipe.jobs.profiles) against simulated engines whose answers are set: the points
each asks for, in order, what each records, and where each ends. The measuring loop that drives them
on a real engine is ArmRun's (tests/integration/test_capacity.py, test_ladder_cpu and the studies)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from k3pipe.jobs import profiles
from k3pipe.jobs.profiles import CapacitySearch, Ladder, Point, ProfileContext, Repeats, profile_for
from k3pipe.schema.specs import WorkloadSpec


@dataclass
class Recorder:
    """What a profile asks of ArmRecorder, kept as calls; a workload's figures from ``figures``."""

    figures: Callable[[WorkloadSpec], dict[str, float]] = lambda w: {}
    calls: list[tuple[str, Any]] = field(default_factory=list)
    measured: dict[str, list[dict[str, float]]] = field(default_factory=dict)

    def log_workload(self, workload: WorkloadSpec, outcome: Any) -> str:
        self.calls.append(("workload", workload.name))
        self.measured.setdefault(workload.name, []).append(self.figures(workload))
        return f"run-{workload.name}"

    def repeat_metrics(self, name: str) -> list[dict[str, float]]:
        return self.measured[name]

    def tag_rung(self, name: str, ladder: str, over: str, point: float, reset: bool) -> None:
        self.calls.append(("rung", (name, point, reset)))

    def log_ladder(self, name: str, summary: str) -> None:
        self.calls.append(("ladder", summary))

    def start_search(self, workload: WorkloadSpec, repeat: int, seed: int) -> str:
        self.calls.append(("search", repeat))
        return f"search-{repeat}"

    def log_probe(self, search_run: str, probe: WorkloadSpec, point: float, *rest: Any) -> str:
        self.calls.append(("probe", point))
        return f"probe-{point:g}"

    def log_capacity(self, search_run: str, workload: WorkloadSpec, result: Any) -> None:
        self.calls.append(("capacity", result))


def _workload(**extra: Any) -> WorkloadSpec:
    return WorkloadSpec.model_validate({"name": "w", "input_tokens": 8, "output_tokens": 4, **extra})


def _drive(profile: profiles.Profile, measure: Callable[[Point], Any] = lambda p: None) -> list[Point]:
    """The measuring loop without an engine: every point the profile asks for, measured by ``measure``."""
    points = []
    while (point := profile.next_point()) is not None:
        points.append(point)
        profile.completed(point, measure(point), reset=point.reset_cache)
    assert profile.next_point() is None  # done stays done
    return points


def _context(recorder: Recorder) -> tuple[ProfileContext, list[str]]:
    finished: list[str] = []
    return ProfileContext(recorder, lambda _: None, finished.append), finished  # type: ignore[arg-type]


def test_repeats_measure_the_workload_each_repeat_with_its_prompts() -> None:
    workload = _workload(repeats=3)
    recorder = Recorder()
    ctx, finished = _context(recorder)
    profile = profile_for(workload, ["p0", "p1", "p2"], ctx)  # type: ignore[list-item]
    assert isinstance(profile, Repeats)
    points = _drive(profile)
    assert [(p.repeat, p.prompts, p.reset_cache) for p in points] == [
        (0, "p0", False), (1, "p1", False), (2, "p2", False),
    ]  # fmt: skip
    assert recorder.calls == [("workload", "w")] * 3
    assert finished == ["w"]


def _knee(capacity: float, rung: WorkloadSpec) -> dict[str, float]:
    """An engine whose throughput grows with its streams up to ``capacity``, then stays while latency
    grows (a hard knee, no noise)."""
    streams = rung.concurrency
    tps = 100.0 * min(streams, capacity)
    return {"output_throughput_tps": tps, "e2e_ms_mean": 1000.0 * max(1.0, streams / capacity)}


def test_a_ladder_measures_its_points_lowest_first_and_ends_past_the_knee() -> None:
    workload = _workload(repeats=2, ladder={"points": [1, 2, 4, 8, 16, 32]})
    # two repeats a point, a little apart, so that the gain is judged against its noise
    calls = iter(range(100))

    def measured(rung: WorkloadSpec) -> dict[str, float]:
        jitter = 1.01 if next(calls) % 2 else 1.0
        return {k: v * jitter for k, v in _knee(4, rung).items()}

    recorder = Recorder(measured)
    ctx, finished = _context(recorder)
    profile = profile_for(workload, ["p0", "p1"], ctx)  # type: ignore[list-item]
    assert isinstance(profile, Ladder)
    points = _drive(profile)
    # 1, 2, 4 gain; 8 does not (the knee at 4): ended there, 16 and 32 never sent
    assert [(p.workload.name, p.repeat, p.reset_cache) for p in points] == [
        ("w@c1", 0, True), ("w@c1", 1, False), ("w@c2", 0, True), ("w@c2", 1, False),
        ("w@c4", 0, True), ("w@c4", 1, False), ("w@c8", 0, True), ("w@c8", 1, False),
    ]  # fmt: skip
    assert [p.prompts for p in points] == ["p0", "p1"] * 4
    assert finished == ["w@c1", "w@c2", "w@c4", "w@c8"]
    rungs = [c[1] for c in recorder.calls if c[0] == "rung"]
    assert rungs == [("w@c1", 1, True), ("w@c2", 2, True), ("w@c4", 4, True), ("w@c8", 8, True)]
    (summary,) = [c[1] for c in recorder.calls if c[0] == "ladder"]
    assert summary.startswith("points c1, c2, c4, c8; ended at c8, past saturation")
    assert summary.endswith("(2 higher point(s) not run)")


def test_a_ladder_that_keeps_gaining_runs_every_point() -> None:
    workload = _workload(repeats=1, ladder={"points": [1, 2, 4]})
    recorder = Recorder(lambda rung: _knee(100, rung))
    ctx, finished = _context(recorder)
    points = _drive(profile_for(workload, ["p0"], ctx))  # type: ignore[list-item]
    assert [p.workload.name for p in points] == ["w@c1", "w@c2", "w@c4"]
    assert finished == ["w@c1", "w@c2", "w@c4"]
    assert [c[1] for c in recorder.calls if c[0] == "ladder"] == ["points c1, c2, c4"]


def test_a_capacity_search_finds_the_engine_s_capacity_once_per_repeat(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An engine that meets the SLO for every request up to 6 req/s and for none beyond: each repeat's
    search brackets 6 within its tolerance; each probe is recorded under that repeat's search."""
    capacity = 6.0

    def attainment(records: Any, slo: Any) -> tuple[float, dict[str, float]]:
        load = records[0].load
        met = 100.0 if load <= capacity else 0.0
        return met, {"e2e_ms": met}

    monkeypatch.setattr(profiles, "slo_attainment_from_arrival", attainment)
    workload = _workload(
        repeats=2, load="poisson", num_requests=40, slo={"e2e_ms": 1000},
        capacity={"over": "rate", "low": 0.5, "high": 64, "tolerance_pct": 10},
    )  # fmt: skip
    recorder = Recorder()
    ctx, finished = _context(recorder)
    profile = profile_for(workload, ["p0", "p1"], ctx)  # type: ignore[list-item]
    assert isinstance(profile, CapacitySearch)

    def measure(point: Point) -> Any:
        assert point.workload.rate_rps == point.load  # the probe is the workload at that load
        records = [SimpleNamespace(load=point.load, warmup=False) for _ in range(40)]
        return SimpleNamespace(result=SimpleNamespace(records=records))

    points = _drive(profile, measure)
    assert {p.repeat for p in points} == {0, 1}
    assert all(p.label == "w" for p in points)
    assert [c[1] for c in recorder.calls if c[0] == "search"] == [0, 1]
    results = [c[1] for c in recorder.calls if c[0] == "capacity"]
    assert len(results) == 2
    for result in results:
        assert result.capacity is not None
        assert result.capacity <= capacity < result.capacity * 1.1 + 1e-9
        assert not math.isnan(result.capacity)
    assert finished == ["w"]
