"""Capacity under an SLO through the study and its report, against engines whose capacity is known:
the scripted OpenAI server (k3pipe/testing/scripted_openai.py, vLLM's wire format) serving at most ``slots``
requests at once, each for a fixed service time S, so it sustains ``slots / S`` requests a second and
queues beyond. An E2E SLO of 2 S: the search must land within 10% of ``slots / S``. The search's
arithmetic across 0.1-100 req/s is tested on simulated queues (tests/unit/test_capacity.py); here,
the real client, HTTP and MLflow at 5 and 80 req/s."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from k3pipe.core.settings import Settings
from k3pipe.report import build_report
from k3pipe.testing.scripted_openai import Script, ScriptedOpenAI
from tests.conftest import TINY_MODEL

# the capacity found is the scripted server's timing at up to 80 req/s: alone in `make test`'s first phase
pytestmark = pytest.mark.serial


def _workload(capacity_rps: float, service_s: float, requests: int) -> dict[str, Any]:
    return {
        "name": "cap",
        "input_tokens": 32,
        "output_tokens": 2,
        "load": "constant",
        "concurrency": 512,  # the client's cap on requests in flight: far above the engine's slots
        "num_requests": requests,
        "slo": {"e2e_ms": 2000 * service_s},
        "capacity": {"low": capacity_rps / 20, "high": capacity_rps * 20, "tolerance_pct": 5},
    }


# A probe sees an overload of e (5%: the tolerance) only once the queue it builds outgrows the SLO's
# slack (here S): after about slack x rate / e requests, 0.1 x 10 / 0.05 = 20 and 0.1 x 80 / 0.05 = 160
# (docs/measurement.md, "Capacity under an SLO": a probe must last about 1/e times the latency budget).
# One slot serves in 0.1 s (it was 0.2 s: the same 20 requests' worth of overload, probes half as long).
@pytest.mark.parametrize(("slots", "service_s", "requests"), [(1, 0.1, 30), (8, 0.1, 200)])
def test_a_capacity_search_finds_the_scripted_engines_capacity_within_10_percent(
    slots: int, service_s: float, requests: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from k3pipe.experiment.params import RunRequest
    from k3pipe.jobs.steps import Job
    from k3pipe.jobs.study import study

    if not (TINY_MODEL / "config.json").is_file():
        pytest.skip(f"no tiny model at {TINY_MODEL} (make model)")
    truth = slots / service_s
    with ScriptedOpenAI(Script(first_token_delay_s=service_s), model="m", slots=slots) as engine:
        exp = tmp_path / "capacity.yaml"
        arm = {
            "name": "scripted",
            "engine": {"kind": "vllm"},
            "launcher": {"kind": "external"},
            "endpoint": {"base_url": engine.base_url, "model": "m"},
        }
        experiment = {
            "name": "capacity-test",
            "model": {"source": "local", "path": str(TINY_MODEL)},
            "arms": [arm],
            "workloads": [_workload(truth, service_s, requests)],
        }
        exp.write_text(yaml.safe_dump(experiment))
        monkeypatch.setenv("K3PIPE_HOME", str(tmp_path / "home"))
        job = Job.library(Settings())
        result = study(RunRequest(experiment=str(exp)), job)
        resets = len(engine.prefix_cache_resets)

    (arm_outcome,) = result.arms
    assert arm_outcome.status == "FINISHED", arm_outcome.error
    tracker = job.tracker
    arm_run = tracker.client.get_run(arm_outcome.mlflow_run_id)
    found = arm_run.data.metrics["cap.capacity_rps"]
    assert abs(found / truth - 1) <= 0.10, (found, truth)
    (search,) = tracker.children(arm_run.info.run_id)
    assert search.data.tags["k3pipe.capacity_binding"] == "e2e_ms"
    assert search.data.metrics["capacity_rps"] == found
    probes = tracker.children(search.info.run_id)
    assert len(probes) == search.data.metrics["capacity_rps_probes"] == resets  # a reset before each
    assert {p.data.tags["k3pipe.probe"].endswith("rps") for p in probes} == {True}
    assert all(p.data.metrics["probe.prefix_cache_reset"] == 1 for p in probes)
    # each probe holds the workload's whole record at its rate, and its attainment's interval
    passed = [p for p in probes if p.data.metrics["probe.slo_attainment_from_arrival_pct"] >= 90]
    for p in probes:
        m = p.data.metrics
        assert m["probe.requests"] == requests
        assert m["probe.slo_met"] == round(m["probe.slo_attainment_from_arrival_pct"] * requests / 100)
        low, high = m["probe.slo_attainment_ci_low_pct"], m["probe.slo_attainment_ci_high_pct"]
        assert low <= m["probe.slo_attainment_from_arrival_pct"] <= high
        assert m["probe.undecided"] == float(low < 90 <= high)
    assert max(float(p.data.params["probe.point"]) for p in passed) == found
    assert search.data.tags["k3pipe.prefix_cache_reset"] == "1"
    report = build_report(tracker, result.study_run_id)
    assert "The prefix cache was not emptied" not in report.markdown
    # the report's capacity section: the arm's capacity (one search: no interval, and how to get
    # one), then the search's answer, its binding objective and every probe with its interval
    section = report.markdown.split("## Capacity under the SLO", 1)[1].split("\n## ", 1)[0]
    answer, row = [line for line in section.splitlines() if line.startswith("| scripted |")]
    assert "a single search: no interval; repeats: 3 (or launches: 2) to get one" in answer
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:3] == ["scripted", "1", f"{found:.3g}" if found < 100 else f"{found:,.0f}"]
    assert cells[4] == "E2E"
    assert cells[6].count("pass") + cells[6].count("fail") == len(probes)
    assert cells[6].count("[") == len(probes)


def test_a_ladder_stops_past_saturation_and_the_report_draws_its_pareto_front(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A concurrency ladder 1, 2, 4, ..., 32 against the scripted engine serving 4 requests at once:
    throughput grows fourfold up to 4 streams, then only latency grows: 8 looks past saturation, 16
    confirms it (measured once a point, one flat comparison ends nothing), so the ladder ends at 16 and
    never runs 32; each point is a workload run of its own on the one engine, and the report's
    Pareto section and figure place them (the scripted engine decodes every stream at one pace, so
    which points tie on the per-user axis is timing; the front's logic is tested in
    tests/unit/test_capacity.py)."""
    from k3pipe.experiment.params import RunRequest
    from k3pipe.jobs.steps import Job
    from k3pipe.jobs.study import study

    if not (TINY_MODEL / "config.json").is_file():
        pytest.skip(f"no tiny model at {TINY_MODEL} (make model)")
    script = Script(first_token_delay_s=0.05, inter_token_s=0.01)
    with ScriptedOpenAI(script, model="m", slots=4) as engine:
        exp = tmp_path / "ladder.yaml"
        experiment = {
            "name": "ladder-test",
            "model": {"source": "local", "path": str(TINY_MODEL)},
            "hardware": {"gpu_name": "NVIDIA H200", "gpu_count": 2, "gpu_memory_gib": 139},
            "arms": [
                {
                    "name": "scripted",
                    "engine": {"kind": "vllm"},
                    "launcher": {"kind": "external"},
                    "endpoint": {"base_url": engine.base_url, "model": "m"},
                }
            ],
            "workloads": [
                {"name": "lad", "input_tokens": 32, "output_tokens": 8, "num_requests": 32,
                 "ladder": {"over": "concurrency", "start": 1, "stop": 32}}
            ],
        }  # fmt: skip
        exp.write_text(yaml.safe_dump(experiment))
        monkeypatch.setenv("K3PIPE_HOME", str(tmp_path / "home"))
        job = Job.library(Settings())
        result = study(RunRequest(experiment=str(exp)), job)
        resets = len(engine.prefix_cache_resets)
        most = engine.max_in_flight

    (arm,) = result.arms
    assert arm.status == "FINISHED", arm.error
    assert [row["workload"] for row in arm.workloads] == ["lad@c1", "lad@c2", "lad@c4", "lad@c8", "lad@c16"]
    assert resets == 5
    assert most <= 4  # the engine's own limit held; the client sent 16 at once at most
    tps = {row["workload"]: row["output_throughput_tps"] for row in arm.workloads}
    assert tps["lad@c4"] > 3 * tps["lad@c1"]
    assert tps["lad@c8"] < 1.05 * tps["lad@c4"]
    assert tps["lad@c16"] < 1.05 * tps["lad@c8"]
    arm_run = job.tracker.client.get_run(arm.mlflow_run_id)
    summary = arm_run.data.tags["k3pipe.ladder.lad"]
    assert summary.startswith(
        "points c1, c2, c4, c8, c16; ended at c16, past saturation at two points in a row: "
        "c8: output throughput"
    )
    assert "; c16: output throughput" in summary
    assert summary.endswith("(1 higher point(s) not run)")
    runs = {r.data.tags["k3pipe.workload"]: r for r in job.tracker.children(arm_run.info.run_id)}
    assert runs["lad@c4"].data.tags["k3pipe.ladder"] == "lad"
    assert float(runs["lad@c4"].data.tags["k3pipe.ladder_point"]) == 4

    report = build_report(job.tracker, result.study_run_id)
    points = {p.workload: p for p in report.analysis.pareto}
    assert set(points) == {"lad@c1", "lad@c2", "lad@c4", "lad@c8", "lad@c16"}
    assert all(p.per_user_tps > 0 for p in points.values())
    best = max(points.values(), key=lambda p: p.per_gpu_tps)
    assert best.workload in {"lad@c4", "lad@c8", "lad@c16"}
    assert best.on_front  # the most tokens per GPU
    assert points["lad@c4"].per_gpu_tps == pytest.approx(tps["lad@c4"] / 2)  # two GPUs
    assert "## Pareto fronts" in report.markdown
    assert f"scripted, lad: {summary}" in report.markdown  # how the ladder ran, beside its front
    assert "pareto.png" in report.figures
