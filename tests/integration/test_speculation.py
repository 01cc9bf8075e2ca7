"""Speculative decoding judged against the plain arm: the numbers of our H200 run (vLLM 0.22.0, a
random 1B Llama, 2048 in / 256 out; plain arm `vllm` vs `vllm-ngram`, n-gram drafter, 4 tokens)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from k3pipe.experiment.load import parse_experiment
from k3pipe.experiment.speculation import choose_baseline, judge_speculation, speculation_setting
from k3pipe.records.recorder import ArmRecorder, record_speculation
from k3pipe.records.tracking import Tracker
from k3pipe.schema.specs import ExperimentSpec

pytestmark = pytest.mark.serial

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}


def arm(name: str, spec_config: dict[str, Any] | None = None, kind: str = "vllm", **args: Any) -> dict:
    engine_args: dict[str, Any] = {"max_num_seqs": 128, **args}
    if spec_config is not None:
        engine_args["speculative_config" if kind == "vllm" else "speculative_algorithm"] = spec_config
    return {
        "name": name,
        "engine": {"kind": kind, "args": engine_args},
        "launcher": {"kind": "external"},
        "endpoint": {"base_url": "http://127.0.0.1:8000/v1", "model": "llama-1b"},
    }


WORKLOADS = [
    {"name": "in2048-out256-c16", "input_tokens": 2048, "output_tokens": 256, "concurrency": 16},
    {"name": "in2048-out256-c128", "input_tokens": 2048, "output_tokens": 256, "concurrency": 128},
    {
        "name": "shared-prefix-c64",
        "input_tokens": 2048,
        "output_tokens": 256,
        "concurrency": 64,
        "dataset": {"kind": "shared_prefix", "prefix_tokens": 1024, "groups": 4},
    },
    {
        "name": "poisson",
        "input_tokens": 2048,
        "output_tokens": 256,
        "load": "poisson",
        "rate_rps": 20.0,
        "concurrency": 64,
    },
]


def experiment(*arms: dict) -> ExperimentSpec:
    return parse_experiment(
        {
            "name": "spec-h200",
            "model": {"source": "local", "path": "/models/llama-1b"},
            "arms": list(arms),
            "workloads": WORKLOADS,
        }
    )


# As measured on the H200 (2026-12-01, docs/gpu.md): client output tok/s and TPOT p50 of the plain
# `vllm` arm and the `vllm-ngram` arm, and the n-gram arm's mean acceptance length and acceptance
# rate from its /metrics window (engine_spec_mean_acceptance_length, engine_spec_acceptance_rate)
PLAIN = {
    "in2048-out256-c16": (4335.11, 3.13),
    "in2048-out256-c128": (11688.41, 7.47),
    "shared-prefix-c64": (10341.14, 4.27),
    "poisson": (4856.83, 3.76),
}
NGRAM_RUN = {  # tok/s, TPOT p50 ms, mean acceptance length, acceptance rate
    "in2048-out256-c16": (3018.56, 4.50, 1.2069, 0.0576),
    "in2048-out256-c128": (8710.92, 11.71, 1.2745, 0.0778),
    "shared-prefix-c64": (6795.41, 7.59, 1.2548, 0.0737),
    "poisson": (4767.04, 7.48, 1.3003, 0.0851),
}


def plain_rows(name: str = "vllm", scale: float = 1.0) -> list[dict[str, Any]]:
    return [
        {
            "arm": name,
            "workload": w,
            "output_throughput_tps": tps * scale,
            "tpot_ms_p50": tpot,
            "engine_generation_tps": tps * scale * 1.01,
        }
        for w, (tps, tpot) in PLAIN.items()
    ]


def ngram_rows(name: str = "vllm-ngram") -> list[dict[str, Any]]:
    rows = []
    for w, (tps, tpot, length, rate) in NGRAM_RUN.items():
        drafts = 10_000.0
        accepted = (length - 1) * drafts
        rows.append(
            {
                "arm": name,
                "workload": w,
                "output_throughput_tps": tps,
                "tpot_ms_p50": tpot,
                "engine_generation_tps": tps * 1.01,
                "engine_spec_drafts": drafts,
                "engine_spec_draft_tokens": accepted / rate,
                "engine_spec_accepted_tokens": accepted,
                "engine_spec_acceptance_rate": rate,
                "engine_spec_mean_acceptance_length": length,
            }
        )
    return rows


def test_ngram_on_random_is_pure_cost_on_every_workload_of_the_h200_run() -> None:
    spec = experiment(arm("vllm"), arm("vllm-ngram", NGRAM))
    report = judge_speculation(spec, plain_rows() + ngram_rows())

    (judged,) = report.arms
    assert judged.arm == "vllm-ngram"
    assert judged.setting.startswith("speculative_config=")
    assert judged.baseline.baseline == "vllm"
    assert "otherwise identical" in judged.baseline.reason
    verdicts = {v.workload: v for v in judged.workloads}
    assert {w: v.verdict for w, v in verdicts.items()} == dict.fromkeys(PLAIN, "pure cost")
    assert judged.summary == "pure cost on 4 of 4 workloads"

    c16 = verdicts["in2048-out256-c16"]
    assert c16.message == (
        "vllm-ngram on in2048-out256-c16: mean acceptance length 1.21 (6% of drafted tokens accepted), "
        "output 3019 tok/s vs 4335 without speculation (-30%): speculation is pure cost on this data "
        "(field notes, rule 3)"
    )
    assert c16.throughput_ratio == pytest.approx(3018.56 / 4335.11)
    assert c16.accept_length_source == "/metrics"
    assert c16.engine_throughput_ratio == pytest.approx(3018.56 / 4335.11)
    assert verdicts["shared-prefix-c64"].throughput_ratio == pytest.approx(6795.41 / 10341.14)

    # Poisson is rate-bound: throughput barely moves (-2%, within noise) but TPOT p50 doubles
    poisson = verdicts["poisson"]
    assert poisson.rate_bound
    assert poisson.throughput_ratio == pytest.approx(4767.04 / 4856.83)
    assert abs(poisson.throughput_ratio - 1) < 0.05
    assert poisson.tpot_ratio == pytest.approx(7.48 / 3.76)
    assert "TPOT p50 7.48 ms vs 3.76 ms without speculation (+99%)" in poisson.message
    assert "output 4767 vs 4857 tok/s (-2%), the load being rate-bound" in poisson.message

    assert [(f.severity, f.rule, f.arm) for f in report.findings] == [
        ("warning", "speculation-pure-cost", "vllm-ngram")
    ] * 4
    assert report.summary_lines() == [
        f"speculation vllm-ngram ({judged.setting}) vs vllm: pure cost on 4 of 4 workloads"
    ]


def test_without_a_plain_arm_low_acceptance_alone_is_a_warning() -> None:
    spec = experiment(arm("vllm"), arm("vllm-ngram", NGRAM))
    # the plain arm is in the experiment but did not run in this flow (--arm vllm-ngram)
    report = judge_speculation(spec, ngram_rows())
    (judged,) = report.arms
    assert judged.baseline.baseline is None
    assert "plain vllm arm(s) vllm did not run" in judged.baseline.reason
    assert {v.verdict for v in judged.workloads} == {"low acceptance"}
    assert judged.summary == "low acceptance on 4 of 4 workloads"
    assert all(v.throughput_ratio is None for v in judged.workloads)
    assert report.findings[0].rule == "speculation-low-acceptance"
    assert report.findings[0].message.startswith(
        "vllm-ngram on in2048-out256-c16: mean acceptance length 1.21 (6% of drafted tokens accepted): "
        "below 1.50, fewer than 0.5 tokens accepted per draft"
    )

    # no plain arm at all; an acceptance above the threshold is not judged
    alone = experiment(arm("vllm-ngram", NGRAM))
    assert "no arm of engine kind vllm" in choose_baseline(alone, "vllm-ngram", ["vllm-ngram"]).reason
    good = [{**r, "engine_spec_mean_acceptance_length": 2.4} for r in ngram_rows()]
    report = judge_speculation(alone, good)
    assert {v.verdict for v in report.arms[0].workloads} == {"unjudged"}
    assert report.findings == []


def test_speculation_that_pays_off_and_one_within_noise() -> None:
    spec = experiment(arm("vllm"), arm("vllm-eagle", {"method": "eagle", "num_speculative_tokens": 3}))
    fast = [
        {
            "arm": "vllm-eagle",
            "workload": "in2048-out256-c16",
            "output_throughput_tps": 6200.0,
            "tpot_ms_p50": 2.4,
            "engine_spec_mean_acceptance_length": 2.6,
            "engine_spec_draft_tokens": 3000.0,
            "engine_spec_accepted_tokens": 1600.0,
        },
        {
            "arm": "vllm-eagle",
            "workload": "in2048-out256-c128",
            "output_throughput_tps": 11800.0,  # +1%: within the 5% margin
            "tpot_ms_p50": 9.0,
            "engine_spec_mean_acceptance_length": 1.9,
        },
        {  # rate-bound: throughput equal, TPOT better
            "arm": "vllm-eagle",
            "workload": "poisson",
            "output_throughput_tps": 4850.0,
            "tpot_ms_p50": 2.1,
            "engine_spec_mean_acceptance_length": 2.4,
        },
    ]
    report = judge_speculation(spec, plain_rows() + fast)
    verdicts = {v.workload: v for v in report.arms[0].workloads}
    assert verdicts["in2048-out256-c16"].verdict == "pays off"
    assert verdicts["in2048-out256-c16"].acceptance_rate == pytest.approx(1600 / 3000)
    assert verdicts["in2048-out256-c16"].message == (
        "vllm-eagle on in2048-out256-c16: mean acceptance length 2.60 (53% of drafted tokens accepted), "
        "output 6200 tok/s vs 4335 without speculation (+43%): speculation pays off on this data"
    )
    assert verdicts["in2048-out256-c128"].verdict == "no clear effect"
    assert "within the 5% noise margin" in verdicts["in2048-out256-c128"].message
    assert verdicts["poisson"].verdict == "pays off"
    assert report.arms[0].summary == "pays off on 2 of 3 workloads; no clear effect on 1 of 3 workloads"
    assert report.findings == []


def test_rate_bound_load_is_judged_on_tpot_and_good_acceptance_that_still_loses_costs() -> None:
    spec = experiment(arm("vllm"), arm("vllm-ngram", NGRAM))
    rows = [
        # throughput within noise (the arrival rate sets it) but TPOT +60%: worse, and acceptance low
        {
            "arm": "vllm-ngram",
            "workload": "poisson",
            "output_throughput_tps": 4840.0,
            "tpot_ms_p50": 6.0,
            "engine_spec_mean_acceptance_length": 1.1,
        },
        # acceptance is fine, yet throughput drops 20%: it costs, not "pure cost"
        {
            "arm": "vllm-ngram",
            "workload": "in2048-out256-c128",
            "output_throughput_tps": 9350.0,
            "engine_spec_mean_acceptance_length": 2.2,
        },
    ]
    verdicts = {v.workload: v for v in judge_speculation(spec, plain_rows() + rows).arms[0].workloads}
    assert verdicts["poisson"].verdict == "pure cost"
    assert verdicts["poisson"].rate_bound
    assert verdicts["in2048-out256-c128"].verdict == "costs"
    assert not verdicts["in2048-out256-c128"].rate_bound
    # the same TPOT change on a concurrency load would be judged on throughput (within noise here)
    same = [{**rows[0], "workload": "in2048-out256-c16", "output_throughput_tps": 4300.0}]
    (v,) = judge_speculation(spec, plain_rows() + same).arms[0].workloads
    assert (v.rate_bound, v.verdict) == (False, "no clear effect")


def test_the_baseline_is_the_closest_plain_arm_of_the_same_engine_and_model() -> None:
    spec = experiment(
        arm("vllm-big-batch", max_num_seqs=256, enable_chunked_prefill=True),
        arm("vllm", enable_chunked_prefill=True),
        arm("vllm-ngram", NGRAM, enable_chunked_prefill=True),
        arm("sglang", kind="sglang"),
        {**arm("vllm-other-model"), "endpoint": {"base_url": "http://127.0.0.1:8000/v1", "model": "x"}},
    )
    ran = ["vllm-big-batch", "vllm", "vllm-ngram", "sglang", "vllm-other-model"]
    choice = choose_baseline(spec, "vllm-ngram", ran)
    assert choice.baseline == "vllm"
    assert choice.differences == []
    assert "chosen over vllm-big-batch (1 difference(s))" in choice.reason
    # without it, the next closest, with what differs
    choice = choose_baseline(spec, "vllm-ngram", ["vllm-big-batch", "vllm-ngram", "sglang"])
    assert choice.baseline == "vllm-big-batch"
    assert choice.differences == ["arg max-num-seqs"]
    assert "otherwise differing in arg max-num-seqs" in choice.reason
    assert speculation_setting(spec.arm("vllm")) is None
    # a speculative SGLang arm pairs with the SGLang arm, and its gauge counts as acceptance
    spec = experiment(arm("vllm"), arm("sglang", kind="sglang"), arm("sglang-eagle", "EAGLE", kind="sglang"))
    rows = [
        {"arm": "vllm", "workload": "in2048-out256-c16", "output_throughput_tps": 4335.0},
        {"arm": "sglang", "workload": "in2048-out256-c16", "output_throughput_tps": 4000.0},
        {
            "arm": "sglang-eagle",
            "workload": "in2048-out256-c16",
            "output_throughput_tps": 3000.0,
            "engine_spec_accept_length_mean": 1.2,
        },
    ]
    (judged,) = judge_speculation(spec, rows).arms
    assert judged.baseline.baseline == "sglang"
    assert judged.workloads[0].verdict == "pure cost"
    assert judged.workloads[0].throughput_ratio == pytest.approx(0.75)


def test_the_engine_log_stands_in_when_the_window_has_no_acceptance() -> None:
    spec = experiment(arm("vllm"), arm("vllm-ngram", NGRAM))
    rows = [{k: v for k, v in r.items() if not k.startswith("engine_spec")} for r in ngram_rows()]
    report = judge_speculation(spec, plain_rows() + rows, log_accept_length={"vllm-ngram": 1.17})
    v = report.arms[0].workloads[0]
    assert (v.accept_length, v.accept_length_source, v.verdict) == (1.17, "engine log", "pure cost")
    assert "the engine log's mean over the arm" in v.message
    # neither: judged on throughput alone
    v = judge_speculation(spec, plain_rows() + rows).arms[0].workloads[0]
    assert (v.accept_length, v.verdict) == (None, "costs")
    assert v.message.startswith("vllm-ngram on in2048-out256-c16: acceptance not measured, output 3019")


@pytest.fixture
def tracker(tmp_path: Path) -> Tracker:
    return Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "test", tmp_path / "artifacts")


def test_the_judgement_is_recorded_on_the_speculative_arm_run(tracker: Tracker, tmp_path: Path) -> None:
    spec = experiment(arm("vllm"), arm("vllm-ngram", NGRAM))
    run_ids = {}
    for a in spec.arms:
        run_ids[a.name] = tracker.start_run(f"spec-h200/{a.name}", tags={"k3pipe.arm": a.name})
        tracker.end_run(run_ids[a.name], "FINISHED")  # the flow judges after every arm has ended
    report = judge_speculation(spec, plain_rows() + ngram_rows())
    record_speculation(tracker, run_ids, report)

    run = tracker.client.get_run(run_ids["vllm-ngram"])
    assert run.info.status == "FINISHED"
    assert run.data.tags["k3pipe.speculation_verdict"] == "pure cost on 4 of 4 workloads"
    assert run.data.tags["k3pipe.speculation_baseline"] == "vllm"
    m = run.data.metrics
    assert m["speculation.in2048-out256-c16.throughput_ratio"] == pytest.approx(3018.56 / 4335.11)
    assert m["speculation.in2048-out256-c16.accept_length"] == pytest.approx(1.2069)
    assert m["speculation.poisson.tpot_ratio"] == pytest.approx(7.48 / 3.76)
    saved = json.loads(
        Path(
            tracker.client.download_artifacts(run_ids["vllm-ngram"], "speculation.json", str(tmp_path))
        ).read_text()
    )
    assert saved["accept_length_threshold"] == 1.5
    assert saved["noise_margin"] == 0.05
    assert saved["baseline"]["baseline"] == "vllm"
    assert [w["verdict"] for w in saved["workloads"]] == ["pure cost"] * 4
    # the plain arm's run gets nothing
    plain = tracker.client.get_run(run_ids["vllm"])
    assert "k3pipe.speculation_verdict" not in plain.data.tags
    assert not any(k.startswith("speculation.") for k in plain.data.metrics)


def test_the_recorder_keeps_the_engine_logs_acceptance_for_the_judgement(
    tracker: Tracker, tmp_path: Path
) -> None:
    from k3pipe.planning.plan import plan_arm

    spec = experiment(arm("vllm-ngram", NGRAM))
    rec = ArmRecorder(tracker, plan_arm(spec, spec.arms[0], tmp_path))
    log = tmp_path / "engine.log"
    log.write_text(
        "(APIServer pid=1) INFO 11-30 09:15:12 [metrics.py:120] SpecDecoding metrics: Mean acceptance "
        "length: 1.20, Accepted throughput: 7.40 tokens/s, Drafted throughput: 37.10 tokens/s\n"
        "(APIServer pid=1) INFO 11-30 09:15:22 [metrics.py:120] SpecDecoding metrics: Mean acceptance "
        "length: 1.30, Accepted throughput: 7.40 tokens/s, Drafted throughput: 37.10 tokens/s\n"
    )
    assert rec.engine_log_facts is None
    rec.finish("FINISHED", log_path=log)
    assert rec.engine_log_facts is not None
    assert rec.engine_log_facts.spec_accept_length_mean == pytest.approx(1.25)
    assert tracker.client.get_run(rec.run_id).data.metrics["engine_log.spec_accept_length_mean"] == 1.25
