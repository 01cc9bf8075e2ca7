"""ArmRecorder against a real SQLite MLflow store: workloads, repeats and their statistics."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest

from k3pipe.bench import RequestRecord, WorkloadResult, summarize
from k3pipe.bench.session import WorkloadOutcome
from k3pipe.experiment.load import parse_experiment
from k3pipe.planning.plan import plan_arm
from k3pipe.records.derive import SUMMARY_COLUMNS, summary_table
from k3pipe.records.recorder import ArmRecorder
from k3pipe.records.tracking import Tracker
from k3pipe.schema.specs import WorkloadSpec
from tests.conftest import demo_experiment

T0 = 100.0


@pytest.fixture
def tracker(tmp_path: Path) -> Tracker:
    return Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "test", tmp_path / "artifacts")


def recorder(tracker: Tracker, tmp_path: Path) -> ArmRecorder:
    spec = parse_experiment(demo_experiment(8999))
    return ArmRecorder(tracker, plan_arm(spec, spec.arms[0], tmp_path))


def outcome(
    workload: WorkloadSpec,
    repeat: int,
    ttft_s: float,
    gap_s: float = 0.1,
    engine_metrics: dict[str, float] | None = None,
) -> WorkloadOutcome:
    """One repeat of two requests whose TTFT is ``ttft_s``, 4 tokens each ``gap_s`` apart (0: all
    four in one read, as a bursty delivery stamps them)."""
    records = [
        RequestRecord(
            index=i,
            warmup=False,
            prompt_tokens=8,
            max_tokens=4,
            usage_output_tokens=4,
            t_scheduled=T0,
            t_send=T0,
            t_first_delta=T0 + ttft_s,
            t_first_content=T0 + ttft_s,
            chunk_times=[T0 + ttft_s + gap_s * k for k in range(4)],
            chunk_tokens=[1, 1, 1, 1],
            t_end=T0 + ttft_s + 3 * gap_s,
            status_code=200,
        )
        for i in range(2)
    ]
    result = WorkloadResult(
        workload=workload.name,
        records=records,
        t_start=T0,
        t_end=T0 + ttft_s + 3 * gap_s,
        started_at_unix_s=0,
    )
    return WorkloadOutcome(
        result,
        summarize(result, workload.slo),
        engine_metrics=engine_metrics or {},
        repeat=repeat,
        seed=workload.seed + repeat,
    )


def workload(repeats: int) -> WorkloadSpec:
    return WorkloadSpec(
        name="w",
        input_tokens=8,
        output_tokens=4,
        num_requests=2,
        repeats=repeats,
        seed=10,
        slo={"ttft_ms": 150},
    )


def test_repeats_nest_under_the_workload_run_with_their_statistics(tracker: Tracker, tmp_path: Path) -> None:
    rec = recorder(tracker, tmp_path)
    w = workload(3)
    for k, ttft in enumerate([0.1, 0.12, 0.14]):
        rec.log_workload(w, outcome(w, k, ttft))
    rec.finish("FINISHED")

    workload_run = tracker.client.get_run(rec.workload_runs["w"])
    assert workload_run.info.status == "FINISHED"
    assert workload_run.data.tags["mlflow.parentRunId"] == rec.run_id
    m = workload_run.data.metrics
    assert m["repeats"] == 3
    # TTFT p50 of the repeats: 100, 120, 140 ms: mean 120, std 20, t(0.975, 2) = 4.3027
    assert m["ttft_ms_p50"] == pytest.approx(120.0)
    assert m["ttft_ms_p50.std"] == pytest.approx(20.0)
    assert m["ttft_ms_p50.ci95_low"] == pytest.approx(120 - 4.302653 * 20 / 3**0.5, abs=1e-3)
    assert m["ttft_ms_p50.ci95_high"] == pytest.approx(120 + 4.302653 * 20 / 3**0.5, abs=1e-3)
    # 150 ms TTFT objective: every repeat meets it
    assert m["slo_attainment_pct"] == pytest.approx(100.0)
    repeats = sorted(tracker.children(workload_run.info.run_id), key=lambda r: r.data.tags["k3pipe.repeat"])
    assert [r.data.tags["k3pipe.repeat"] for r in repeats] == ["1", "2", "3"]
    assert [r.data.params["workload.seed"] for r in repeats] == ["10", "11", "12"]
    assert [r.data.metrics["ttft_ms_p50"] for r in repeats] == pytest.approx([100.0, 120.0, 140.0])
    for r in repeats:
        assert {a.path for a in tracker.client.list_artifacts(r.info.run_id)} >= {
            "requests.parquet",
            "summary.json",
        }
    stats = json.loads(
        Path(
            tracker.client.download_artifacts(workload_run.info.run_id, "repeats.json", str(tmp_path))
        ).read_text()
    )
    assert stats["ttft_ms_p50"]["values"] == pytest.approx([100.0, 120.0, 140.0])
    arm = tracker.client.get_run(rec.run_id)
    assert arm.data.metrics["w.ttft_ms_p50"] == pytest.approx(120.0)
    assert rec.workload_metrics("w")["ttft_ms_p50"] == pytest.approx(120.0)
    assert rec.workload_metrics("w")["completed"] == 6  # counts add up across repeats


def test_an_arm_that_ends_early_closes_its_workload_with_what_it_measured(
    tracker: Tracker, tmp_path: Path
) -> None:
    rec = recorder(tracker, tmp_path)
    w = workload(3)
    rec.log_workload(w, outcome(w, 0, 0.1))
    rec.finish("KILLED", KeyboardInterrupt())
    workload_run = tracker.client.get_run(rec.workload_runs["w"])
    assert workload_run.info.status == "KILLED"
    m = workload_run.data.metrics
    assert (m["repeats"], m["repeats_planned"]) == (1, 3)
    assert m["ttft_ms_p50"] == pytest.approx(100.0)
    assert "ttft_ms_p50.std" not in m  # one repeat has no spread


def test_one_repeat_is_a_single_workload_run(tracker: Tracker, tmp_path: Path) -> None:
    rec = recorder(tracker, tmp_path)
    w = workload(1)
    run_id = rec.log_workload(w, outcome(w, 0, 0.2))
    rec.finish("FINISHED")
    run = tracker.client.get_run(run_id)
    assert run.data.tags["mlflow.parentRunId"] == rec.run_id
    assert tracker.children(run_id) == []
    assert run.data.metrics["ttft_ms_p50"] == pytest.approx(200.0)
    assert run.data.metrics["slo_attainment_pct"] == 0.0  # 200 ms > 150 ms
    assert rec.workload_metrics("w")["ttft_ms_p50"] == pytest.approx(200.0)


def test_compare_two_recorded_workloads(
    tracker: Tracker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from k3pipe.cli.main import app
    from k3pipe.core.errors import TrackingError
    from k3pipe.records.compare import compare_workloads, resolve_workload_run
    from k3pipe.records.priors import NoiseEntry, record_noise, run_class

    w = workload(3)
    arms = []
    before = tracker.start_run("study/earlier", tags={"k3pipe.kind": "study"})  # noise kept, below
    for ttfts in ([0.100, 0.101, 0.099], [0.130, 0.131, 0.129], [0.1005, 0.0995, 0.1002]):
        rec = recorder(tracker, tmp_path)
        # what log_plan records of the model and the node: the class restart noise is kept under
        tracker.log_params(rec.run_id, {"model.id": "org/model", "node.host": "here"})
        for k, ttft in enumerate(ttfts):
            rec.log_workload(w, outcome(w, k, ttft))
        rec.finish("FINISHED")
        arms.append(rec.run_id)
    base, slower, same = (resolve_workload_run(tracker, arm[:12], "w") for arm in arms)
    # two runs of one launch each, and no restart noise known for them: no verdict either way
    unknown = {c.metric: c for c in compare_workloads(tracker, base, slower)}
    assert unknown["ttft_ms_p50"].outcome == "unknown"
    assert unknown["ttft_ms_p50"].verdict() == "cannot tell: restart noise unknown"
    # an earlier study kept 1% restart noise of their class (8 launches): they are judged with it
    klass = run_class(tracker.client.get_run(arms[0]), base)
    assert klass is not None
    record_noise(
        tracker, before,
        [NoiseEntry(key=klass.key, label=klass.label(), metric="ttft_ms_p50", arm="a", workload="w",
                    ss=7 * 1e-4, df=7, repeats=[3] * 8)],
    )  # fmt: skip
    tracker.end_run(before, "FINISHED")
    verdicts = {c.metric: c for c in compare_workloads(tracker, base, slower)}
    assert verdicts["ttft_ms_p50"].restart == "prior"
    assert verdicts["ttft_ms_p50"].different
    assert verdicts["ttft_ms_p50"].relative_change == pytest.approx(0.3, abs=0.01)
    assert not {c.metric: c for c in compare_workloads(tracker, base, same)}["ttft_ms_p50"].different
    with pytest.raises(TrackingError, match="no workload 'nope'"):
        resolve_workload_run(tracker, arms[0], "nope")

    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracker.tracking_uri)
    monkeypatch.setenv("K3PIPE_MLFLOW_EXPERIMENT", "test")
    out = CliRunner().invoke(app, ["compare", arms[0], arms[1], "--workload", "w", "--metric", "ttft_ms_p50"])
    assert out.exit_code == 0, out.output
    line = next(x for x in out.output.splitlines() if x.startswith("ttft_ms_p50"))
    assert "different" in line
    assert "+30.0%" in line


def test_a_workload_run_is_closed_even_when_its_params_fail(
    tracker: Tracker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rec = recorder(tracker, tmp_path)
    w = workload(2)
    real = tracker.log_params

    def failing(run_id: str, params: object) -> None:
        if run_id != rec.run_id:
            raise RuntimeError("store hiccup")
        real(run_id, params)  # type: ignore[arg-type]

    monkeypatch.setattr(tracker, "log_params", failing)
    with pytest.raises(RuntimeError, match="store hiccup"):
        rec.log_workload(w, outcome(w, 0, 0.1))
    rec.finish("FAILED", RuntimeError("store hiccup"))
    statuses = {r.info.run_name: r.info.status for r in tracker.client.search_runs([tracker.experiment_id])}
    assert "RUNNING" not in statuses.values(), statuses


def test_bursty_delivery_is_a_tag_a_metric_and_a_marked_table_cell(tracker: Tracker, tmp_path: Path) -> None:
    rec = recorder(tracker, tmp_path)
    bursty, clean = workload(1), workload(1).model_copy(update={"name": "clean"})
    bursty_run = rec.log_workload(
        bursty, outcome(bursty, 0, 0.1, gap_s=0.0, engine_metrics={"engine_itl_ms_p50": 4.25})
    )
    clean_run = rec.log_workload(clean, outcome(clean, 0, 0.1))
    rec.finish("FINISHED")

    run = tracker.client.get_run(bursty_run)
    assert run.data.metrics["client_timing_bursty"] == 1.0
    assert run.data.metrics["bursty_requests_pct"] == 100.0
    assert run.data.metrics["itl_ms_p50"] == 0.0  # kept as measured, and flagged
    assert run.data.tags["k3pipe.client_timing"] == "bursty"
    assert "the engine's ITL p50 is 4.25 ms" in run.data.tags["k3pipe.client_timing_note"]
    assert tracker.client.get_run(clean_run).data.tags["k3pipe.client_timing"] == "ok"
    assert tracker.client.get_run(rec.run_id).data.tags["k3pipe.bursty_workloads"] == "w"

    rows = [{"arm": "a", "workload": name, **rec.workload_metrics(name)} for name in ("w", "clean")]
    table = summary_table(rows)
    assert table[0]["tpot_ms_p50"] == table[0]["itl_ms_p50"] == "bursty"
    assert table[0]["client_timing"] == "bursty (100% of requests): engine ITL p50 4.25 ms"
    assert table[1]["client_timing"] == "ok"
    assert table[1]["tpot_ms_p50"] == pytest.approx(100.0)
    assert table[1]["completed"] == 2
    assert isinstance(table[1]["completed"], int)
    assert table[0]["slo_attainment_pct"] == 100.0  # TTFT 100 ms within its 150 ms objective
    assert list(table[1])[: len(SUMMARY_COLUMNS)] == list(SUMMARY_COLUMNS)


def test_a_table_without_bursty_workloads_has_no_timing_column() -> None:
    table = summary_table([{"arm": "a", "workload": "w", "tpot_ms_p50": 1.234567, "completed": 3.0}])
    assert "client_timing" not in table[0]
    assert table[0]["tpot_ms_p50"] == 1.23
    assert table[0]["itl_ms_p50"] == "-"


def test_oom_lines_are_counted_in_mlflow_and_lead_the_reports_findings(
    tracker: Tracker, tmp_path: Path
) -> None:
    """The engine log of an arm whose 8 workers ran out of memory 4 times each: the record counts 32
    lines on 8 ranks (metrics), and the findings the report shows start with that count."""
    from k3pipe.jobs.study_run import start_study
    from k3pipe.report import build_report
    from tests.unit.engines.test_engine_logs import _oom_burst

    spec = parse_experiment(demo_experiment(8999))
    study = start_study(tracker, spec, "oom.yaml")
    rec = ArmRecorder(tracker, plan_arm(spec, spec.arms[0], tmp_path), parent_id=study)
    log = tmp_path / "engine.log"
    log.write_text("\n".join(_oom_burst(ranks=8, per_rank=4)) + "\n")
    facts = rec.log_engine_findings(log)
    assert facts is not None
    w = workload(1)
    rec.log_workload(w, outcome(w, 0, 0.1))
    rec.finish("FINISHED")
    run = tracker.client.get_run(rec.run_id)
    assert run.data.metrics["engine_log.oom_lines"] == 32
    assert run.data.metrics["engine_log.oom_ranks"] == 8
    first = run.data.tags["k3pipe.engine_warnings"].split(" | ")[0]
    assert first.startswith("GPU memory ran out on 32 log lines (8 ranks, first 11-30 09:14:10, last"), first
    tracker.client.set_terminated(study, "FINISHED")
    text = build_report(tracker, study).markdown
    assert "[engine log] GPU memory ran out on 32 log lines" in text


def test_workload_runs_start_and_end_when_their_requests_did(tracker: Tracker, tmp_path: Path) -> None:
    """A workload's runs are logged once it ends; their MLflow start and end are still the first
    send (warm-up included) and the last response, on the wall clock, and time.* params say where the
    measured window starts (the zero of requests.parquet's times), so a record lines up with the
    engine's log and /metrics."""
    import dataclasses
    from datetime import UTC, datetime

    rec = recorder(tracker, tmp_path)
    w = workload(2)
    s0 = 1_764_900_000.0  # 2025-12-05 02:00:00 UTC
    for k, start in enumerate([s0, s0 + 60.0]):
        o = outcome(w, k, 0.1)
        warm = o.result.records[0].model_copy(update={"warmup": True, "t_send": T0 - 2.0, "t_end": T0 - 1.5})
        result = o.result.model_copy(
            update={"started_at_unix_s": start, "records": [warm, *o.result.records]}
        )
        rec.log_workload(w, dataclasses.replace(o, result=result))
    rec.finish("FINISHED")

    workload_run = tracker.client.get_run(rec.workload_runs["w"])
    repeats = sorted(tracker.children(workload_run.info.run_id), key=lambda r: r.data.tags["k3pipe.repeat"])
    last_end = 0.1 + 3 * 0.1  # TTFT, then 3 gaps of 0.1 s
    for r, start in zip(repeats, [s0, s0 + 60.0], strict=True):
        assert r.info.start_time == round((start - 2.0) * 1000)  # the warm-up's send
        assert r.info.end_time == round((start + last_end) * 1000)
        p = r.data.params
        assert float(p["time.measured_start_unix_s"]) == pytest.approx(start)
        assert float(p["time.first_send_unix_s"]) == pytest.approx(start - 2.0)
        assert float(p["time.last_end_unix_s"]) == pytest.approx(start + last_end)
        assert float(p["time.perf_counter_at_measured_start_s"]) == pytest.approx(T0)
        assert p["time.measured_start_utc"] == datetime.fromtimestamp(start, tz=UTC).isoformat(
            timespec="milliseconds"
        )
    # the workload's run spans its repeats
    assert workload_run.info.start_time == round((s0 - 2.0) * 1000)
    assert workload_run.info.end_time == round((s0 + 60.0 + last_end) * 1000)


def test_a_capacity_search_records_each_probes_interval_and_the_capacitys(
    tracker: Tracker, tmp_path: Path
) -> None:
    """Three searches (repeats) of a rate: each probe's run holds its count, the requests within the
    SLO, their 95% Clopper-Pearson interval and whether it was undecided; capacity.json keeps them;
    the workload's run gets the capacity across its searches by the verdicts' rule
    (summarize_searches: bracket middles, the bracket counted), in numbers and in words. The
    probes' request records are stand-ins (two requests); their attainment is the search's."""
    from k3pipe.verdicts.capacity import CapacitySearch, summarize_searches

    rec = recorder(tracker, tmp_path)
    w = WorkloadSpec(
        name="cap", input_tokens=8, output_tokens=4, num_requests=200, repeats=3, load="poisson",
        concurrency=64, slo={"e2e_ms": 500}, capacity={"low": 1, "high": 64},
    )  # fmt: skip
    results = []
    for k, boundary in enumerate((20.0, 21.0, 19.0)):
        run = rec.start_search(w, k, w.seed + k)
        search = CapacitySearch("rate", 1, 64)
        while (point := search.next_point()) is not None:
            share = 100.0 if point < 0.97 * boundary else 91.0 if point <= boundary else 40.0
            judged = search.judge(point, share, {"e2e_ms": share}, requests=200)
            probe_run = rec.log_probe(
                run, w.probe(point), point, "rate", outcome(w.probe(point), k, 0.1), (share, {}), True, judged
            )
            search.add(point, share, {"e2e_ms": share}, probe_run, requests=200)
        rec.log_capacity(run, w, search.result())
        results.append(search.result())
    rec.finish("FINISHED")

    workload_run = tracker.client.get_run(rec.workload_runs["cap"])
    searches = tracker.children(workload_run.info.run_id)
    assert len(searches) == 3
    probes = [p for s in searches for p in tracker.children(s.info.run_id)]
    assert len(probes) == sum(len(r.probes) for r in results)
    for p in probes:
        m = p.data.metrics
        assert m["probe.requests"] == 200
        share = m["probe.slo_attainment_from_arrival_pct"]
        assert m["probe.slo_met"] == 2 * share
        low, high = m["probe.slo_attainment_ci_low_pct"], m["probe.slo_attainment_ci_high_pct"]
        assert low <= share <= high
        assert m["probe.undecided"] == (1.0 if share == 91.0 else 0.0)  # [86.1, 94.6] holds 90
    kept = json.loads(tracker.read_artifact(searches[0].info.run_id, "capacity.json") or b"{}")
    assert {"requests", "met", "ci_low_pct", "ci_high_pct", "undecided"} <= set(kept["probes"][0])
    est = summarize_searches(results).estimate
    assert est is not None
    low, high = est.interval(0.95) or (0.0, 0.0)
    m = workload_run.data.metrics
    assert m["capacity_rps_estimate"] == pytest.approx(est.mean)
    assert (m["capacity_rps_estimate_low"], m["capacity_rps_estimate_high"]) == pytest.approx((low, high))
    assert low < min(r.capacity for r in results)  # type: ignore[type-var]
    assert high > max(r.failed_at for r in results)  # type: ignore[type-var]
    assert workload_run.data.tags["k3pipe.capacity"].endswith(
        "(95%; 3 searches, one launch: restart noise not in it)"
    )


def _window_outcome(w: WorkloadSpec, start: datetime, seconds: float) -> WorkloadOutcome:
    """One repeat whose measured window starts at ``start`` (local time) and lasts ``seconds``."""
    base = outcome(w, 0, 0.1)
    result = base.result.model_copy(
        update={"t_start": T0, "t_end": T0 + seconds, "started_at_unix_s": start.timestamp()}
    )
    return WorkloadOutcome(result, base.summary, repeat=0, seed=w.seed)


# vLLM 0.22.0's two "Triton kernel JIT compilation during inference" lines of the H100 MLA study's first
# launch (tests/fixtures/engines/vllm/server-0.22.0-h100-mla.log): 09:17:29 (the endpoint probe) and
# 09:17:32 (the first 64K warm-up); that launch's first measured window opened at 09:17:39.725.
@pytest.mark.parametrize(
    ("start", "seconds", "inside"),
    [
        (datetime(2026, 12, 6, 9, 17, 39, 725000), 11.8, []),
        (datetime(2026, 12, 6, 9, 17, 31), 10.0, ["fused_moe_kernel"]),
    ],
)
def test_kernels_compiled_while_serving_are_placed_against_the_measured_windows(
    tracker: Tracker, tmp_path: Path, start: datetime, seconds: float, inside: list[str]
) -> None:
    from tests.unit.engines.helpers import FIXTURES

    rec = recorder(tracker, tmp_path)
    w = workload(1)
    rec.log_workload(w, _window_outcome(w, start, seconds))
    rec.finish("FINISHED", log_path=FIXTURES / "vllm" / "server-0.22.0-h100-mla.log")
    run = tracker.client.get_run(rec.run_id)
    assert run.data.metrics["engine_log.serving_compiles"] == 2
    assert run.data.metrics["engine_log.serving_compiles_measured"] == len(inside)
    warnings = run.data.tags.get("k3pipe.engine_warnings", "")
    compiled = [s for s in warnings.split(" | ") if s.startswith("a kernel was compiled while serving")]
    assert compiled == [
        "a kernel was compiled while serving, inside the measured window of w (12-06 09:17:32): "
        f"Triton kernel JIT compilation during inference: {name}. This causes a latency spike; "
        "consider extending warmup to cover this shape/config."
        for name in inside
    ]
