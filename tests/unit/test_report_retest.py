"""A retest's verdicts on values whose answer is known (no MLflow): a variant that is worse, one that
is better, noise called inconclusive (never 'no difference'), one repeat untested, figures outside
the decision descriptive, bursty client timing not judged, a cell the baseline lacks not comparable,
one family over the retest; and the retest's targets from an experiment."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from k3pipe.core.errors import SpecError
from k3pipe.experiment.load import parse_experiment
from k3pipe.jobs.retest_run import describe_retest, retest_targets, workloads_key
from k3pipe.report.collect import ArmData, CellData, StudyData
from k3pipe.report.render import to_markdown
from k3pipe.report.retest_verdicts import (
    BETTER,
    CANNOT_TELL,
    DESCRIPTIVE,
    EQUIVALENT,
    INCONCLUSIVE,
    NO_TEST,
    WORSE,
    RetestData,
    build_retest_document,
    judge_variants,
    summary,
)
from k3pipe.verdicts.stats import RestartPrior


def _cell(arm: str, workload: str, **values: list[float]) -> CellData:
    return CellData(
        arm=arm, engine="vllm", workload=workload, input_tokens=256, output_tokens=64, concurrency=4,
        run_id=f"{arm}-{workload}", status="FINISHED", values=values,
    )  # fmt: skip


DECISION = {"metrics": ["duration_s", "output_throughput_tps", "ttft_ms_p50"]}


def _study(run_id: str, *cells: CellData, prior: bool = True) -> StudyData:
    """``prior``: each cell (launched once) judged with 1% restart noise an earlier study is taken to
    have measured (k3pipe.records.priors); without, nothing launched once is judged."""
    arms = list(dict.fromkeys(c.arm for c in cells))
    noise = RestartPrior(math.log1p(0.01**2), 40.0, "a test's history")
    for c in cells:
        c.priors = dict.fromkeys(c.values, noise) if prior else {}
    return StudyData(
        run_id=run_id, name=run_id, status="FINISHED",
        arms=[ArmData(name=a, engine="vllm", run_id=a, status="FINISHED") for a in arms], cells=list(cells),
        decision=DECISION,
    )  # fmt: skip


def _noisy(mean: float, sd: float, n: int, seed: int) -> list[float]:
    return list(mean + np.random.default_rng(seed).normal(0, sd, n))


def test_worse_better_noise_and_untested() -> None:
    base = _study(
        "b",
        _cell("vllm", "w", duration_s=_noisy(10, 0.1, 4, 0), output_throughput_tps=_noisy(100, 1, 4, 1),
              ttft_ms_p50=_noisy(50, 5, 4, 2), tpot_ms_p50=_noisy(9, 0.1, 4, 6)),
        _cell("vllm", "one", duration_s=[10.0]),
    )  # fmt: skip
    slower = _study(
        "v1",
        _cell("vllm", "w", duration_s=_noisy(14, 0.1, 4, 3), output_throughput_tps=_noisy(130, 1, 4, 4),
              ttft_ms_p50=_noisy(51, 5, 4, 5), tpot_ms_p50=_noisy(12, 0.1, 4, 7)),
        _cell("vllm", "one", duration_s=[12.0]),
        _cell("vllm", "only-here", duration_s=[1.0, 1.1]),
    )  # fmt: skip
    data = RetestData("r", "demo", "FINISHED", base, {"slower": slower}, {"slower": ["vllm: args.x 1"]})
    verdicts = {(v.workload, v.metric.key): v for v in judge_variants(data)}
    e2e = verdicts[("w", "duration_s")]
    assert e2e.verdict == WORSE  # lower is better, and it went up by 40%
    assert e2e.ratio == pytest.approx(1.4, rel=0.02)
    assert e2e.ci is not None
    assert e2e.ci[0] < e2e.ratio < e2e.ci[1]
    assert verdicts[("w", "output_throughput_tps")].verdict == BETTER  # higher is better
    noise = verdicts[("w", "ttft_ms_p50")]
    assert noise.verdict == INCONCLUSIVE
    assert "cannot be seen with this data" in noise.text()
    assert verdicts[("one", "duration_s")].verdict == NO_TEST
    # the same launches with no restart noise known for them: nothing judged, and said so
    for cell in [*base.cells, *slower.cells]:
        cell.priors = {}
    unknown = {(v.workload, v.metric.key): v for v in judge_variants(data)}
    assert unknown[("w", "duration_s")].verdict == CANNOT_TELL
    assert "launched once" in unknown[("w", "duration_s")].text()
    assert ("only-here", "duration_s") not in verdicts
    # TPOT is outside this experiment's decision: a change with an interval, and no verdict
    tpot = verdicts[("w", "tpot_ms_p50")]
    assert tpot.verdict == DESCRIPTIVE
    assert tpot.outcome is None
    # one family over the retest: the three decision comparisons that can be tested share alpha (the
    # one-repeat cell's cannot, and is not counted)
    judged = [v for v in verdicts.values() if v.outcome is not None]
    assert len(judged) == 4
    assert all(v.outcome.confidence == pytest.approx(1 - 0.05 / 3) for v in judged)
    assert summary(list(verdicts.values()))["slower"] == {
        BETTER: 1, WORSE: 1, EQUIVALENT: 0, INCONCLUSIVE: 1, CANNOT_TELL: 0, NO_TEST: 1
    }  # fmt: skip

    doc = build_retest_document(data, list(verdicts.values()))
    md = to_markdown(doc, {})
    assert re.search(r"\*\*slower\*\*: better on decode throughput, client \+\d\d\.\d% \[", md)
    assert re.search(r"; worse on end-to-end time \+\d\d\.\d% \[\+\d+\.\d%, \+\d+\.\d%\] \(vllm, w\)", md)
    assert "| **slower** | **vllm** | **w** | **end-to-end time (s; decision)** |" in md  # worse: flagged
    assert "no difference" not in md
    assert "slower: vllm on only-here (the baseline has no such cell)" in md
    assert "vllm: args.x 1" in md


def test_bursty_client_timing_and_zeros_are_not_judged() -> None:
    base = _study("b", _cell("a", "w", tpot_ms_p50=[5.0, 5.1], client_timing_bursty=[1.0, 0.0],
                             engine_generation_tps=[0.0, 0.0], duration_s=[1.0, 1.1]))  # fmt: skip
    var = _study("v", _cell("a", "w", tpot_ms_p50=[9.0, 9.1], client_timing_bursty=[0.0, 0.0],
                            engine_generation_tps=[10.0, 11.0], duration_s=[1.0, 1.1]))  # fmt: skip
    verdicts = judge_variants(RetestData("r", "x", "FINISHED", base, {"v": var}))
    assert {v.metric.key for v in verdicts} == {"duration_s"}


def _experiment(**extra: object) -> dict:
    return {
        "name": "exp",
        "model": {"source": "local", "path": "/nonexistent"},
        "arms": [
            {
                "name": "a",
                "engine": {"kind": "vllm", "args": {"max_num_seqs": 4}},
                "launcher": {"kind": "external"},
                "endpoint": {"base_url": "http://127.0.0.1:9/v1"},
            },
            {
                "name": "b",
                "engine": {"kind": "sglang"},
                "launcher": {"kind": "external"},
                "endpoint": {"base_url": "http://127.0.0.1:9/v1"},
            },
        ],
        "workloads": [{"name": "w", "input_tokens": 32, "output_tokens": 8}],
        **extra,
    }


def test_targets_baseline_first_and_variants_resolved() -> None:
    spec = parse_experiment(
        _experiment(
            variants=[
                {"name": "one-seq", "description": "d1", "arms": {"a": {"args": {"max_num_seqs": 1}}}},
                {"name": "longer", "arms": {"a": {}, "b": {}}, "workloads": {"output_tokens": 64}},
            ]
        )
    )
    targets = retest_targets(spec)
    assert [t.label for t in targets] == ["baseline", "one-seq", "longer"]
    assert targets[0].spec.variants == []
    assert [a.name for a in targets[1].spec.arms] == ["a"]
    assert targets[1].spec.arms[0].engine.args["max_num_seqs"] == 1
    assert targets[1].spec.name == "exp@one-seq"
    assert targets[1].changes == ("a: args.max_num_seqs 1",)
    # the same workloads send the same prompts; changed ones draw their own
    assert workloads_key(targets[1].spec) == workloads_key(targets[0].spec)
    assert workloads_key(targets[2].spec) != workloads_key(targets[0].spec)
    assert [t.label for t in retest_targets(spec, ["longer"])] == ["baseline", "longer"]
    text = "\n".join(describe_retest(spec))
    assert "2. one-seq: arms a; same prompts: d1" in text
    assert "3. longer: arms a, b; own prompts" in text

    unknown = r"variants: 'nope' not in experiment 'exp'; its variants: one-seq, longer"
    with pytest.raises(SpecError, match=unknown):
        retest_targets(spec, ["nope"])
    with pytest.raises(SpecError, match="declares no variants"):
        retest_targets(parse_experiment(_experiment()))


@pytest.mark.parametrize("name", ["baseline", "../escape", "a b", ""])
def test_variant_names_are_safe_and_not_baseline(name: str) -> None:
    with pytest.raises(SpecError, match="variants"):
        parse_experiment(_experiment(variants=[{"name": name, "arms": {"a": {}}}]))
