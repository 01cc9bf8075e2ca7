"""A ladder and a capacity search on the real engine, through the study job (what the study flow runs;
the Prefect path with the real engine: tests/engine/test_flow.py) and its report: the real
vLLM (CPU build) serving the tiny model, the demo's two arms (max_num_seqs 4 against 1), one launch
each, with a GPU-hour price so every cell has its cost.

What the engine's own batch size decides, and so what must hold whatever the machine's load: batch1
decodes one request at a time, so its output throughput does not grow past one stream (its best
point stays far below batch4's); batch4's grows up to four streams. Where batch1's ladder ends is
the machine's noise: at 16 requests a point its throughput moved by 30% between probes of the same
load on 2 cores, so one comparison of single measurements ended it at c2 on an idle machine and only
at c16 in CI (2026-12-05); the ladder now ends only where two points in a row look flat, or runs all
four points (1, 2, 4, 8) where noise hides it. A request that waits for a slot
waits a whole request (64 tokens), so under a TTFT SLO batch1 sustains fewer streams than batch4,
which serves four without queueing. Only batch4 is served with VLLM_SERVER_DEV_MODE=1, the one way
vLLM empties its prefix cache on request: batch1's ladder points and probes run on a cache the
earlier points filled (the engine's own hit rate shows it), and the report must say so.

The exact capacities are the machine's (batch4 about 11 streams and batch1 about 3 on an idle 2-core
machine, 2026-12-05): what is asserted is the order the engine's settings impose, not a number."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from k3pipe.core.settings import Settings
from k3pipe.report import build_report
from tests.conftest import ASSETS_HOME, REPO, free_port, require_engine

# In the parallel phase since 2026-12-07: what is asserted is the order the engine's batch size
# imposes, with margins load does not close once vLLM's OpenMP threads sleep when idle
# (OMP_WAIT_POLICY=PASSIVE, experiments/demo-study.yaml): beside two pytest workers running the fault
# and study tests, batch1's best point was 204 tok/s against batch4's 1,275 (asserted: below 0.6x)
# and the capacities 1 against 9 streams. (With spinning threads, beside three workers, batch4's
# second point came out slower than its first, 2026-12-05, and its ladder ended there.)
pytestmark = [pytest.mark.engine]

PRICE = 0.12  # $ per "GPU" hour: the CPU machine's, for the arithmetic


def _experiment() -> dict:
    data = yaml.safe_load((REPO / "experiments" / "demo-study.yaml").read_text())
    data = yaml.safe_load(yaml.safe_dump(data).replace("{home}", str(ASSETS_HOME)))
    data["name"] = "capacity-cpu"
    data.pop("answers", None)  # the output probe has its own test (tests/engine/test_answers_cpu.py)
    data["hardware"] = {"gpu_name": "CPU", "gpu_count": 1, "gpu_memory_gib": 1, "gpu_hour_usd": PRICE}
    data["decision"] = {"metrics": ["capacity_concurrency", "output_throughput_tps"]}
    for arm in data["arms"]:
        arm["launches"] = 1  # the demo launches each arm twice (it compares): here what is tested is
        # the ladder and the search within a launch (the launch-level verdicts: test_verdicts_cpu.py)
        arm["launcher"]["port"] = free_port()
        arm["engine"]["env"]["VLLM_CACHE_ROOT"] = str(ASSETS_HOME / "cache" / "vllm")
        arm["endpoint"] = {}
    batch4 = data["arms"][0]
    batch4["engine"]["env"] = {**batch4["engine"]["env"], "VLLM_SERVER_DEV_MODE": "1"}
    data["workloads"] = [
        {"name": "lad", "input_tokens": 256, "output_tokens": 64, "num_requests": 16, "warmup_requests": 1,
         "seed": 1, "ladder": {"over": "concurrency", "points": [1, 2, 4, 8]}},
        # two searches (an interval needs two); batch4's capacity (about 10 streams) stays below the
        # requests a probe sends and below high: a search that passes at high finds no capacity
        {"name": "cap", "input_tokens": 256, "output_tokens": 64, "num_requests": 16, "warmup_requests": 1,
         "seed": 21, "repeats": 2, "slo": {"ttft_ms": 400},
         "capacity": {"over": "concurrency", "low": 1, "high": 32}},
    ]  # fmt: skip
    return data


def test_a_ladder_and_a_capacity_search_on_the_real_engine(tmp_path: Path) -> None:
    require_engine()
    from k3pipe.experiment.params import RunRequest
    from k3pipe.jobs.steps import Job
    from k3pipe.jobs.study import study

    exp = tmp_path / "capacity-cpu.yaml"
    exp.write_text(yaml.safe_dump(_experiment()))
    job = Job.library(Settings())
    result = study(RunRequest(experiment=str(exp)), job)
    arms = {o.arm: o for o in result.arms}
    assert {a: o.status for a, o in arms.items()} == {"batch4": "FINISHED", "batch1": "FINISHED"}

    tracker = job.tracker
    runs = {a: tracker.client.get_run(o.mlflow_run_id) for a, o in arms.items()}

    # the ladders: one engine start each, a run per point, ended past saturation
    ladders = {a: r.data.tags["k3pipe.ladder.lad"] for a, r in runs.items()}
    points = {
        a: [
            w.data.tags["k3pipe.workload"]
            for w in tracker.children(r.info.run_id)
            if w.data.tags.get("k3pipe.ladder")
        ]
        for a, r in runs.items()
    }
    # measured once a point, a ladder ends only where two points in a row look flat: batch1's does or
    # runs to c8, as the noise has it; batch4's never ends before its four streams
    if "ended at" in ladders["batch1"]:
        assert "past saturation at two points in a row" in ladders["batch1"], ladders
    else:
        assert len(points["batch1"]) == 4, ladders
    assert {"lad@c1", "lad@c2", "lad@c4"} <= set(points["batch4"]), ladders
    # one stream at a time: batch1's best point far below batch4's (about a quarter of it on 2 cores)
    best = {
        a: max(w.data.metrics["output_throughput_tps"] for w in tracker.children(r.info.run_id)
               if w.data.tags.get("k3pipe.ladder"))
        for a, r in runs.items()
    }  # fmt: skip
    assert best["batch1"] < 0.6 * best["batch4"], best

    # the prefix cache: emptied before batch4's points and probes, refused by batch1's engine
    by_arm = {
        a: {w.data.tags["k3pipe.workload"]: w for w in tracker.children(r.info.run_id)}
        for a, r in runs.items()
    }
    assert {
        by_arm["batch4"][p].data.tags["k3pipe.prefix_cache_reset"] for p in (*points["batch4"], "cap")
    } == {"1"}
    assert {
        by_arm["batch1"][p].data.tags["k3pipe.prefix_cache_reset"] for p in (*points["batch1"], "cap")
    } == {"0"}
    hits = {a: by_arm[a]["lad@c2"].data.metrics.get("engine_prefix_cache_hit_pct", 0.0) for a in by_arm}
    assert hits["batch1"] > 50 > hits["batch4"], hits  # the same prompts again, from the cache

    # the capacity: batch4 serves more streams within the SLO than batch1, whose waits are whole requests
    capacity = {a: r.data.metrics["cap.capacity_concurrency"] for a, r in runs.items()}
    assert capacity["batch4"] > capacity["batch1"] >= 1, capacity

    report = build_report(tracker, result.study_run_id)
    rows = {(r.workload, r.metric.key): r for r in report.analysis.rows}
    cap = rows[("cap", "capacity_concurrency")]
    assert cap.decision
    assert cap.ranking == ["batch4", "batch1"]
    (verdict,) = cap.verdicts
    assert verdict.outcome != "equivalent", verdict.text()
    assert not verdict.different or verdict.leader == "batch4", verdict.text()

    # the cost of a cell: the price over its throughput
    c4 = by_arm["batch4"]["lad@c4"].data.metrics
    assert c4["usd_per_m_output_tokens"] == pytest.approx(PRICE / 3600 / c4["output_throughput_tps"] * 1e6)
    assert ("lad@c4", "usd_per_m_output_tokens") in rows

    text = report.markdown
    assert "## Pareto fronts" in text
    assert "cost per million output tokens" in text
    warning = next(ln for ln in text.splitlines() if "The prefix cache was not emptied" in ln)
    assert "batch1's" in warning
    assert "batch4" not in warning
    artifacts = {a.path for a in tracker.client.list_artifacts(result.study_run_id, "report/plots")}
    assert "report/plots/pareto.png" in artifacts
