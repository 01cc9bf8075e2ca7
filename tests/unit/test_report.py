"""The report's analysis on values whose answer is known (no MLflow): the H200 study's losses found,
decision metrics judged and the rest descriptive, every arm ranked against the best and the baseline,
launches as the unit of the interval, the A/A calibration, degradation only along input length,
bursty client timing and zeros not ranked, steady decode from known stamps. The statistics
themselves are held against simulated studies in tests/unit/test_stats.py."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pandas as pd
import pytest

from k3pipe.report.analysis import analyse
from k3pipe.report.collect import ArmData, ArmGpusData, CellData, StudyData
from k3pipe.report.steady import steady_decode_tps
from k3pipe.verdicts import stats
from k3pipe.verdicts.capacity import CapacityResult, CapacitySearch, capacity_estimate


def _cell(
    arm: str,
    workload: str,
    tokens: int,
    launches: list[dict[str, list[float]]] | None = None,
    concurrency: int = 4,
    output_tokens: int = 32,
    **values: list[float],
) -> CellData:
    cell = CellData(
        arm=arm, engine="vllm", workload=workload, input_tokens=tokens, output_tokens=output_tokens,
        concurrency=concurrency, run_id=f"{arm}-{workload}", status="FINISHED",
        values=values or (launches[0] if launches else {}),
    )  # fmt: skip
    for later in (launches or [])[1:]:
        cell.add_launch(cell.model_copy(update={"values": later, "launch_values": []}))
    return cell


def _study(*cells: CellData, decision: dict | None = None, prior: float | None = None) -> StudyData:
    """The cells as a study; ``prior``: the restart noise (a CV) an earlier study is taken to have
    measured for every cell's class (k3pipe.records.priors), so that cells launched once can be judged."""
    arms = list(dict.fromkeys(c.arm for c in cells))
    if prior is not None:
        for c in cells:
            noise = stats.RestartPrior(math.log1p(prior**2), 50.0, "a test's history")
            c.priors = dict.fromkeys(c.values, noise)
    return StudyData(
        run_id="s",
        name="t",
        status="FINISHED",
        arms=[ArmData(name=a, engine="vllm", run_id=a, status="FINISHED") for a in arms],
        cells=list(cells),
        decision=decision or {},
    )


def _markdown(data: StudyData) -> str:
    from k3pipe.report.render import build_document, to_markdown

    return to_markdown(build_document(data, analyse(data)), {})


def _again(values: list[float], drift: float) -> list[float]:
    """A second launch of a configuration: its repeats moved by ``drift`` (restart noise)."""
    return [v * (1 + drift) for v in values]


def test_the_h200_study_losses_are_found() -> None:
    """The H200 study of the issue (3 repeats, arms a, a-again, b-batch8 at concurrency 64), in the
    design a user gets by default (two launches per arm): the 2.8x end-to-end loss and the 7x TTFT
    loss, which the old report called 'no difference within noise', are detected on the decision
    metrics, and the identical arm is not called different. Launched once each, with no restart noise
    known, none of it is claimed."""
    tokens = 128 * 256
    e2e = {"a": [3.1, 3.3, 3.5], "a-again": [3.9, 3.6, 2.9], "b-batch8": [9.0, 9.4, 9.8]}
    ttft = {
        "a": [520.0, 541.0, 560.0],
        "a-again": [600.0, 480.0, 540.0],
        "b-batch8": [3900.0, 3958.0, 4100.0],
    }
    tpot = {"a": [9.0, 9.4, 9.1], "a-again": [9.5, 9.0, 9.2], "b-batch8": [4.1, 4.0, 4.2]}
    drift = {"a": 0.04, "a-again": -0.03, "b-batch8": 0.05}

    def launch(arm: str, again: float) -> dict[str, list[float]]:
        d = _again(e2e[arm], again)
        return {
            "duration_s": d,
            "output_throughput_tps": [tokens / t for t in d],
            "ttft_ms_p50": _again(ttft[arm], again),
            "tpot_ms_p50": _again(tpot[arm], -again),
        }

    cells = [
        _cell(arm, "in2048-c64", 2048, [launch(arm, 0.0), launch(arm, drift[arm])], concurrency=64,
              output_tokens=256)
        for arm in e2e
    ]  # fmt: skip
    analysis = analyse(_study(*cells))
    rows = {r.metric.key: r for r in analysis.rows}
    assert analysis.tests == 3 * 3  # three decision metrics x three pairs of arms
    tps, first = rows["output_throughput_tps"], rows["ttft_ms_p50"]
    assert tps.decision
    assert first.decision
    assert not rows["duration_s"].decision  # the same window the other way round: descriptive
    assert tps.ranking[-1] == "b-batch8"
    for row in (tps, first):
        for best in ("a", "a-again"):
            pair = row.pair(best, "b-batch8")
            assert pair is not None
            assert pair.different
            assert pair.leader == best
            assert pair.verdict.restart == "measured"
        aa = row.pair("a", "a-again")
        assert aa is not None
        assert not aa.different
    # TTFT: said as how much lower the better arm's is, never a ratio minus one
    said = first.pair("a", "b-batch8").text()
    assert "% lower" in said
    assert "better by" not in said
    # the batch8 arm decodes faster per token (fewer streams): detected the other way round
    assert rows["tpot_ms_p50"].pair("a", "b-batch8").leader == "b-batch8"
    text = _markdown(_study(*cells))
    assert "no difference" not in text
    answer = text.split("## The answer")[1].split("## Results")[0]
    for arm in e2e:
        assert arm in answer

    once = [
        _cell(arm, "in2048-c64", 2048, [launch(arm, 0.0)], concurrency=64, output_tokens=256) for arm in e2e
    ]
    alone = analyse(_study(*once))
    assert alone.tests == 0  # nothing the family shares alpha with: no pair can be tested
    for row in (r for r in alone.rows if r.decision):
        assert {v.outcome for v in row.verdicts} == {"unknown"}
    answer = _markdown(_study(*once)).split("## The answer")[1].split("## Results")[0]
    assert "cannot tell: restart noise unknown" in answer
    assert "launches: 2" in answer
    assert "better than" not in answer
    # the same single launches judged with restart noise an earlier study kept: found again
    judged = analyse(_study(*once, prior=0.03))
    pair = next(r for r in judged.rows if r.metric.key == "ttft_ms_p50").pair("a", "b-batch8")
    assert pair is not None
    assert pair.different
    assert pair.verdict.restart == "prior"
    assert "restart noise 3.0% from the history (a test's history)" in pair.text()


def test_a_metric_and_its_reciprocal_get_one_verdict() -> None:
    durations = {"a": [10.0, 10.4, 9.8], "b": [10.9, 11.6, 11.1]}
    cells = [
        _cell(arm, "w", 64, duration_s=d, output_throughput_tps=[640.0 / t for t in d])
        for arm, d in durations.items()
    ]
    analysis = analyse(_study(*cells, decision={"metrics": ["duration_s", "output_throughput_tps"]}))
    by_time, by_tps = (
        next(r for r in analysis.rows if r.metric.key == k).verdicts[0]
        for k in ("duration_s", "output_throughput_tps")
    )
    assert (by_time.outcome, by_time.leader) == (by_tps.outcome, by_tps.leader)
    assert by_time.ci == pytest.approx(by_tps.ci)


def test_cost_and_energy_are_in_the_table_and_judged_like_throughput() -> None:
    """Dollars per token is the GPU-hour price over throughput: named in the decision it gets the
    verdict throughput gets (the other way up); the energy per token stands in the table beside it."""
    tps = {"a": [1000.0, 1040.0, 980.0], "b": [700.0, 690.0, 720.0]}
    price = 3.5 * 8 / 3600  # $ a second for 8 GPUs at $3.50 an hour
    cells = [
        _cell(arm, "w", 64, output_throughput_tps=v,
              usd_per_m_output_tokens=[price / t * 1e6 for t in v],
              energy_j_per_output_token=[5600.0 / t for t in v])
        for arm, v in tps.items()
    ]  # fmt: skip
    decision = {"metrics": ["output_throughput_tps", "usd_per_m_output_tokens"]}
    data = _study(*cells, decision=decision, prior=0.01)
    rows = {r.metric.key: r for r in analyse(data).rows}
    by_tps = rows["output_throughput_tps"].verdicts[0]
    by_cost = rows["usd_per_m_output_tokens"].verdicts[0]
    assert (by_cost.outcome, by_cost.leader) == (by_tps.outcome, by_tps.leader) == ("different", "a")
    assert rows["usd_per_m_output_tokens"].ranking == ["a", "b"]
    assert rows["energy_j_per_output_token"].ranking == ["a", "b"]
    text = _markdown(data)
    assert "cost per million output tokens" in text
    assert "GPU energy per output token" in text


def test_a_measured_zero_is_shown_as_zero_not_as_missing() -> None:
    """An engine whose prefix cache was emptied hits it on 0% of tokens, the other on 96%: the table
    shows the 0 (a measurement), not '-' (none), and ranks neither (a ratio to zero is no ratio)."""
    cells = [
        _cell("reset", "w", 64, engine_prefix_cache_hit_pct=[0.0, 0.0, 0.0], output_throughput_tps=[10.0]),
        _cell("warm", "w", 64, engine_prefix_cache_hit_pct=[95.9, 96.1, 95.8], output_throughput_tps=[10.0]),
    ]
    data = _study(*cells)
    (row,) = [r for r in analyse(data).rows if r.metric.key == "engine_prefix_cache_hit_pct"]
    assert row.zeros == {"reset"}
    assert row.ranking == ["warm"]
    assert row.leader is None
    line = next(ln for ln in _markdown(data).splitlines() if "prefix-cache hit rate" in ln)
    assert "| 0 |" in line
    assert "95.9" in line
    # a figure no arm measured stays out of the table; zeros alone make no row either
    only_zeros = _study(_cell("a", "w", 64, engine_prefix_cache_hit_pct=[0.0], output_throughput_tps=[1.0]))
    assert not [r for r in analyse(only_zeros).rows if r.metric.key == "engine_prefix_cache_hit_pct"]


def test_arms_measured_on_different_hardware_are_not_ranked_unless_told() -> None:
    """A fleet's nodes may differ: the report names each arm's hardware and ranks nothing (a 2x
    difference may be the GPUs'); decision.mixed_hardware ranks them anyway; one kind, or none
    recorded (a CPU machine), ranks as ever."""
    tps = {"a": [1000.0, 1010.0, 990.0], "b": [500.0, 505.0, 495.0]}
    cells = [_cell(arm, "w", 64, output_throughput_tps=v) for arm, v in tps.items()]
    h200, b300 = "8 x NVIDIA H200, driver 580.159.04", "8 x NVIDIA B300, driver 580.159.04"

    def study(hardware: dict[str, str | None], **decision: object) -> StudyData:
        data = _study(*cells, decision={"metrics": ["output_throughput_tps"], **decision}, prior=0.01)
        data.arms = [a.model_copy(update={"hardware": hardware[a.name]}) for a in data.arms]
        return data

    mixed = study({"a": h200, "b": b300})
    analysis = analyse(mixed)
    assert analysis.hardware_refusal is not None
    assert f"a: {h200}" in analysis.hardware_refusal
    assert f"b: {b300}" in analysis.hardware_refusal
    (row,) = [r for r in analysis.rows if r.metric.key == "output_throughput_tps"]
    assert row.ranking == []
    assert row.verdicts == []
    assert row.leader is None
    assert set(row.cells) == {"a", "b"}  # the figures are still shown
    answer = _markdown(mixed).split("## The answer")[1].split("## Results")[0]
    assert "Not ranked: the arms were measured on different hardware" in answer
    assert "better by" not in answer
    # told so, ranked; the same hardware, or none recorded, ranked
    for data in (study({"a": h200, "b": b300}, mixed_hardware=True), study({"a": h200, "b": h200}),
                 study({"a": None, "b": None})):  # fmt: skip
        analysis = analyse(data)
        assert analysis.hardware_refusal is None
        (row,) = [r for r in analysis.rows if r.metric.key == "output_throughput_tps"]
        assert row.ranking == ["a", "b"]
        assert row.verdicts[0].different
    # a GPU arm against one without GPU facts (an external endpoint) is a difference too
    assert analyse(study({"a": h200, "b": None})).hardware_refusal is not None


def test_every_arm_is_ranked_against_the_best_and_the_baseline() -> None:
    tps = {"fast": [120.0, 121.0, 119.0], "mid": [100.0, 101.0, 99.5], "slow": [60.0, 61.0, 59.0]}
    cells = [_cell(a, "w", 64, output_throughput_tps=v) for a, v in tps.items()]
    data = _study(*cells, decision={"metrics": ["output_throughput_tps"], "baseline": "mid"})
    (row,) = [r for r in analyse(data).rows if r.decision]
    assert row.ranking == ["fast", "mid", "slow"]
    text = _markdown(data)
    line = next(ln for ln in text.split("## The answer")[1].splitlines() if "decode throughput, client" in ln)
    assert "fast" in line
    assert "mid" in line
    assert "slow" in line
    assert "against the baseline mid" in line  # slow is judged against mid as well as against fast


def test_launches_make_the_interval_and_the_noise_split() -> None:
    """Two arms launched three times each: the cell's interval comes from its launch means, the verdict
    says nothing of unmeasured restart noise, and the noise table splits restart from repeat noise."""
    a = [
        {"output_throughput_tps": v}
        for v in ([100.0, 101.0, 99.0], [108.0, 107.0, 109.0], [95.0, 96.0, 94.0])
    ]
    b = [{"output_throughput_tps": v} for v in ([80.0, 81.0, 79.0], [86.0, 85.0, 87.0], [77.0, 78.0, 76.0])]
    data = _study(_cell("a", "w", 64, launches=a), _cell("b", "w", 64, launches=b),
                  decision={"metrics": ["output_throughput_tps"]})  # fmt: skip
    analysis = analyse(data)
    (row,) = [r for r in analysis.rows if r.decision]
    assert row.cells["a"].launches == 3
    assert row.cells["a"].estimate.basis == "launches"
    (v,) = row.verdicts
    assert v.different
    assert v.verdict.restart_noise_measured
    assert v.verdict.pooled
    assert v.verdict.df == 4
    (noise,) = analysis.noise
    assert noise.components is not None
    assert noise.components.between_share > 0.8  # the launches differ far more than their repeats
    text = _markdown(data)
    assert "## Noise: restart and repeat" in text
    assert "a 3x3, b 3x3" in text


def test_the_a_a_calibration_is_judged_apart_and_states_the_floor() -> None:
    base = [{"ttft_ms_p50": v} for v in ([100.0, 102.0], [97.0, 99.0])]
    copy = [{"ttft_ms_p50": v} for v in ([101.0, 99.0], [103.0, 100.0])]
    other = [{"ttft_ms_p50": v} for v in ([150.0, 151.0], [149.0, 152.0])]
    data = _study(_cell("a", "w", 64, launches=base), _cell("a-aa", "w", 64, launches=copy),
                  _cell("b", "w", 64, launches=other),
                  decision={"metrics": ["ttft_ms_p50"], "calibration": True})  # fmt: skip
    analysis = analyse(data)
    assert analysis.calibration == ("a", "a-aa")
    (row,) = [r for r in analysis.rows if r.decision]
    assert row.ranking == ["a", "b"]  # the copy is not ranked
    assert analysis.tests == 1
    assert row.calibration is not None
    assert not row.calibration.different
    text = _markdown(data)
    assert "## Calibration: A/A" in text
    assert "a difference between arms smaller than that is within what launching" in text
    assert "each launched like every arm: 2 launches each, interleaved" in text


def test_an_a_a_launched_once_claims_no_reach() -> None:
    """One launch per arm (the H100 answers sitting): no A/A cell is tested, so the section states the one
    difference it saw and asks for launches, never an interval's reach of +-0.0%."""
    data = _study(
        _cell("a", "w", 64, output_throughput_tps=[583.3]),
        _cell("a-aa", "w", 64, output_throughput_tps=[693.5]),
        decision={"metrics": ["output_throughput_tps"], "calibration": True},
    )
    text = _markdown(data)
    section = text.split("## Calibration: A/A")[1].split("\n## ")[0]
    assert "intervals reach" not in section
    assert "No A/A cell was tested" in section
    assert "(here 18.9%)" in section
    assert "`launches: 2`" in section


def test_degradation_compares_only_workloads_that_differ_in_input_length() -> None:
    cells = [
        _cell("a", "short-c4", 1000, concurrency=4, duration_s=[10.0, 10.1]),
        _cell("a", "long-c4", 4000, concurrency=4, duration_s=[20.0, 20.2]),
        _cell("a", "long-c64", 8000, concurrency=64, duration_s=[90.0, 91.0]),
    ]
    (d,) = [d for d in analyse(_study(*cells)).degradations if d.metric.key == "duration_s"]
    assert (d.short, d.long) == (1000, 4000)
    assert d.factor == pytest.approx(2.0, rel=0.01)
    assert "concurrency 4" in d.shape


def test_bursty_client_timing_and_zeros_are_not_ranked() -> None:
    analysis = analyse(
        _study(
            _cell(
                "a", "w", 64, tpot_ms_p50=[4.0, 4.2], itl_ms_p50=[0.0, 0.0], client_timing_bursty=[0.0, 0.0]
            ),
            _cell(
                "b", "w", 64, tpot_ms_p50=[0.0, 0.0], itl_ms_p50=[3.0, 3.1], client_timing_bursty=[1.0, 0.0]
            ),
        )
    )
    rows = {r.metric.key: r for r in analysis.rows}
    assert rows["tpot_ms_p50"].bursty == {"b"}
    assert set(rows["tpot_ms_p50"].cells) == {"a"}
    assert rows["tpot_ms_p50"].leader is None
    # a's ITL of 0 ms (not measured) ranks nothing against it
    assert rows["itl_ms_p50"].leader is None


def test_the_leader_flip_is_interpolated() -> None:
    analysis = analyse(
        _study(
            _cell("a", "short", 1000, duration_s=[10.0]),
            _cell("b", "short", 1000, duration_s=[20.0]),
            _cell("a", "long", 3000, duration_s=[40.0]),
            _cell("b", "long", 3000, duration_s=[30.0]),
        )
    )
    (flip,) = analysis.flips
    assert (flip.before, flip.after) == ("a", "b")
    assert flip.at_tokens == pytest.approx(2000.0)  # -10 s at 1000, +10 s at 3000


def test_a_flip_is_claimed_only_where_both_ends_are_detected_differences() -> None:
    """The H200's engines study printed "the lead flips from sglang to vllm at about 16,711 input
    tokens" on a 0.6% lead at 16K whose interval was [-27%, +39%]. A flip is a claim only when the pair
    differs, detectably, at both ends; else the report says why it claims none."""
    decision = {"metrics": ["ttft_ms_p50"]}

    def study(short_b: list[float]) -> StudyData:
        return _study(
            _cell("a", "short", 1000, ttft_ms_p50=[100.0, 130.0, 80.0]),
            _cell("b", "short", 1000, ttft_ms_p50=short_b),
            _cell("a", "long", 4000, ttft_ms_p50=[400.0, 401.0, 399.0]),
            _cell("b", "long", 4000, ttft_ms_p50=[300.0, 301.0, 302.0]),
            decision=decision,
            prior=0.01,
        )

    noisy = analyse(study([101.0, 140.0, 75.0]))  # a barely ahead at 1000, within its noise
    (flip,) = [f for f in noisy.flips if f.metric.key == "ttft_ms_p50"]
    assert (flip.before, flip.after, flip.unseen) == ("a", "b", (1000,))
    assert not flip.claimed
    text = _markdown(study([101.0, 140.0, 75.0]))
    assert "no flip is claimed: a is ahead at 1,000 and b at 4,000 input tokens, but at 1,000" in text
    assert "the lead flips" not in text
    assert "not a flip the data shows: a is ahead at 1,000 and b at 4,000 input tokens" in text

    clear = analyse(study([300.0, 301.0, 299.0]))  # b three times as slow at 1000: a real lead there too
    (flip,) = [f for f in clear.flips if f.metric.key == "ttft_ms_p50"]
    assert flip.claimed
    assert "the lead flips from a to b at about" in _markdown(study([300.0, 301.0, 299.0]))


def test_steady_decode_counts_only_time_without_prefill() -> None:
    # two requests: r0 prefills 0-1 s then decodes to 3 s; r1 prefills 0-2 s then decodes to 4 s.
    # Steady (someone decodes, nobody prefills): 2-4 s. Tokens after each first chunk in it: r0's
    # chunks at 2.5 and 3.0 (2), r1's at 2.5, 3.0, 3.5, 4.0 (4): 6 tokens in 2 s.
    frame = pd.DataFrame(
        {
            "t_send_s": [0.0, 0.0],
            "t_first_delta_s": [1.0, 2.0],
            "t_end_s": [3.0, 4.0],
            "chunk_times_s": [json.dumps([1.0, 1.5, 2.0, 2.5, 3.0]), json.dumps([2.0, 2.5, 3.0, 3.5, 4.0])],
            "chunk_tokens": [json.dumps([1, 1, 1, 1, 1]), json.dumps([1, 1, 1, 1, 1])],
        }
    )
    # r0's chunk at 2.0 lies on the steady set's edge: counted (inclusive), so 7 tokens
    assert steady_decode_tps(frame) == pytest.approx(7 / 2.0)
    # r1 sent at 1.5 s instead, first token 2.5 s: prefill 0-1 and 1.5-2.5, steady 1-1.5 and 2.5-4 (2 s);
    # r0's chunks at 1.5, 2.5, 3.0 and r1's at 3.0, 3.5, 4.0 fall in it (2.0 is r1's prefill): 6 tokens
    late = pd.DataFrame(
        {
            "t_send_s": [0.0, 1.5],
            "t_first_delta_s": [1.0, 2.5],
            "t_end_s": [3.0, 4.0],
            "chunk_times_s": [json.dumps([1.0, 1.5, 2.0, 2.5, 3.0]), json.dumps([2.5, 3.0, 3.5, 4.0])],
            "chunk_tokens": [json.dumps([1, 1, 1, 1, 1]), json.dumps([1, 1, 1, 1])],
        }
    )
    assert steady_decode_tps(late) == pytest.approx(6 / 2.0)


def _engine_requests(
    slots: int, streams: int, requests: int, lengths: list[int], step_s: float = 0.005
) -> pd.DataFrame:
    """The client's stamps of a simulated engine that decodes ``slots`` sequences a step (one token
    each per ``step_s``), driven by ``streams`` closed-loop clients: a request sent at the end of a
    step is admitted at the next step with a free slot, its first token at that step's end."""
    sent: dict[int, float] = {i: 0.0 for i in range(min(streams, requests))}
    waiting = list(sent)
    running: dict[int, list[float]] = {}
    rows: dict[int, dict] = {}
    nxt, step = len(sent), 0
    while waiting or running:
        while waiting and len(running) < slots:
            running[waiting.pop(0)] = []
        end = (step + 1) * step_s
        for i in list(running):
            running[i].append(end)
            if len(running[i]) == lengths[i]:
                times = running.pop(i)
                rows[i] = {
                    "t_send_s": sent[i],
                    "t_first_delta_s": times[0],
                    "t_end_s": end,
                    "chunk_times_s": json.dumps(times),
                    "chunk_tokens": json.dumps([1] * len(times)),
                }
                if nxt < requests:
                    sent[nxt] = end
                    waiting.append(nxt)
                    nxt += 1
        step += 1
    return pd.DataFrame([rows[i] for i in sorted(rows)])


def test_steady_decode_is_the_full_batch_never_the_drain() -> None:
    """The s64/s56 pair of the H200 (docs/gpu.md): an engine taking all 64 streams decodes them in
    lockstep; one taking 56 always leaves requests waiting until the end, so its only time without
    a waiting request is the drain, which is not its steady decode."""
    full = 64 / 0.005
    lockstep = _engine_requests(64, 64, 192, [32] * 192)
    assert steady_decode_tps(lockstep) == pytest.approx(full)
    # 56 slots for 64 streams: the batch is full only while others wait, then it drains: no figure
    assert steady_decode_tps(_engine_requests(56, 64, 192, [32] * 192)) is None
    # the last wave ends one stream at a time (lengths 32..95): the drain's shrinking batch is left
    # out (without the floor the figure would fall to about half the full batch's rate)
    draining = _engine_requests(64, 64, 192, [32] * 128 + [32 + i for i in range(64)])
    assert 0.9 * full <= steady_decode_tps(draining) <= full


def test_the_published_table_stands_beside_the_cells() -> None:
    """An experiment's 'reference' (here: the field notes' steady decode) is shown beside the arms'
    means and intervals, the crossover of the DCP study as the two arms' leads at 64K and 200K."""
    from k3pipe.report.render import build_document, to_markdown

    data = _study(
        _cell("tp8", "random-64k", 64000, steady_decode_tps=[500.0, 510.0, 505.0]),
        _cell("dcp8", "random-64k", 64000, steady_decode_tps=[400.0, 405.0, 398.0]),
        _cell("tp8", "random-200k", 200000, steady_decode_tps=[160.0, 165.0, 162.0]),
        _cell("dcp8", "random-200k", 200000, steady_decode_tps=[300.0, 290.0, 295.0]),
    )
    # each arm launched twice, as a study records them (one ArmData a launch): one column an arm
    data.arms += [a.model_copy(update={"launch": 2, "run_id": a.run_id + "-2"}) for a in data.arms]
    data.reference = {
        "source": "field-notes.md (8 x B300, Kimi-K3)",
        "figures": [
            {"workload": "random-64k", "metric": "steady_decode_tps", "arm": "study vLLM", "value": 501.0},
            {"workload": "random-64k", "metric": "steady_decode_tps", "arm": "study SGLang", "value": 335.0},
            {"workload": "random-200k", "metric": "steady_decode_tps", "arm": "study vLLM", "value": 163.0},
            {"workload": "random-200k", "metric": "steady_decode_tps", "arm": "study SGLang", "value": 268.0},
        ],
        "notes": ["decode slow-down 64K -> 200K in the study: vLLM 3.29x, SGLang 1.25x"],
    }
    analysis = analyse(data)
    (flip,) = [f for f in analysis.flips if f.metric.key == "steady_decode_tps"]
    assert (flip.before, flip.after) == ("tp8", "dcp8")
    text = to_markdown(build_document(data, analysis), {})
    assert "## Beside the published table" in text
    assert "field-notes.md (8 x B300, Kimi-K3)" in text
    header = next(line for line in text.splitlines() if "study SGLang" in line and line.startswith("|"))
    assert header.split("|")[4:9] == [" tp8 ", " dcp8 ", " leader ", " study vLLM ", " study SGLang "]
    row = next(line for line in text.splitlines() if line.startswith("| random-200k") and "163" in line)
    assert "268" in row
    assert "dcp8" in row
    assert "vLLM 3.29x, SGLang 1.25x" in text
    data.reference = None
    assert "Beside the published table" not in to_markdown(build_document(data, analyse(data)), {})


def test_energy_from_few_power_samples_is_marked_rough() -> None:
    """A cell of 1.3 s at the sampler's 1 s holds one power sample: its joules per token lean on the
    samples around the window (the H100's c64 ladder point, 2026-12-05), and the report says so."""
    cells = [
        _cell("a", "short", 64, energy_j_per_output_token=[0.07], gpu_power_samples=[1.0]),
        _cell("b", "short", 64, energy_j_per_output_token=[0.09], gpu_power_samples=[3.0, 6.0]),
        _cell("a", "long", 128, energy_j_per_output_token=[0.6], gpu_power_samples=[19.0]),
        _cell("b", "long", 128, energy_j_per_output_token=[0.5], gpu_power_samples=[15.0]),
    ]
    text = _markdown(_study(*cells))
    assert "read them as rough: short (a 1, b 3)." in text
    assert "long (" not in text
    plenty = [_cell(a, "long", 128, energy_j_per_output_token=[0.5], gpu_power_samples=[9.0]) for a in "ab"]
    assert "read them as rough" not in _markdown(_study(*plenty))


def _search(capacity: float | None, failed_at: float | None, probes: list[tuple[float, float]], **kw: object):
    return {
        "over": "rate",
        "capacity": capacity,
        "failed_at": failed_at,
        "censored": kw.get("censored"),
        "converged": kw.get("converged", True),
        "binding": kw.get("binding", "ttft_ms"),
        "cliff": kw.get("cliff", False),
        "probes": [{"point": p, "attainment_pct": a, "passed": a >= 90} for p, a in probes],
    }


def test_the_capacity_section_shows_each_search_its_bracket_binding_objective_and_probes() -> None:
    """Beside the verdict on capacity_rps: what a probe had to meet, and per arm and search where the
    boundary lies (the highest pass, the lowest fail), the objective that bound, a cliff, a search
    that never bracketed, one that ran out of probes, and every probe in the order it ran."""
    common = {"capacity": "rate 1-400 req/s", "load": "poisson", "slo": {"ttft_ms": 500.0, "tpot_ms": 25.0},
              "attainment_pct": 90.0}  # fmt: skip
    vllm = _cell("vllm", "cap", 2048, capacity_rps=[61.7]).model_copy(
        update={**common, "searches": [_search(61.7, 67.3, [(20, 100), (40, 100), (80, 22.5), (61.7, 97.3)])]}
    )
    sglang = _cell("sglang", "cap", 2048, capacity_rps=[40.0, 44.0]).model_copy(
        update={
            **common,
            "searches": [
                _search(40, 43.6, [(20, 100), (40, 100), (43.6, 20.0)], cliff=True),
                _search(400, None, [(200, 100), (400, 99)], censored="above_high", binding=None),
                _search(30, 80, [(20, 100), (30, 95), (80, 10)], converged=False, binding="e2e_ms"),
            ],
        }
    )
    text = _markdown(_study(vllm, sglang))
    section = text.split("## Capacity under the SLO", 1)[1].split("\n## ", 1)[0]
    assert "at least 90% of its measured requests met TTFT <= 500 ms, TPOT <= 25 ms" in section
    assert (
        "| vllm | 1 | 61.7 | 67.3 | TTFT | no | 20: 100% pass, 40: 100% pass, 80: 22.5% fail, "
        "61.7: 97.3% pass |" in section
    )
    assert "| sglang | 1 | 40 | 43.6 | TTFT | yes |" in section
    assert "| sglang | 2 | at least 400 | - | - | no |" in section
    assert "| sglang | 3 | 30 (not converged) | 80 | E2E | no |" in section
    assert "## Capacity under the SLO" not in _markdown(
        _study(_cell("a", "w", 64, output_throughput_tps=[1.0]))
    )


def test_how_each_ladder_ran_is_said_beside_its_pareto_front() -> None:
    cells = [
        _cell(
            arm, f"lad@c{c}", 64, concurrency=c, output_throughput_tps=[tps], tpot_ms_p50=[tpot]
        ).model_copy(update={"ladder": "lad", "ladder_point": float(c)})
        for arm, points in {"a": [(1, 100.0, 5.0), (8, 700.0, 6.0)], "b": [(1, 90.0, 5.5)]}.items()
        for c, tps, tpot in points
    ]
    data = _study(*cells)
    data.arms[0].ladders = {"lad": "points c1, c8"}
    data.arms[1].ladders = {"lad": "points c1; ended at c1, past saturation ..."}
    text = _markdown(data)
    assert "## Pareto fronts" in text
    assert (
        "How each ladder ran (lowest load first, on one engine start): a, lad: points c1, c8; b, lad: "
        in text
    )


def test_tokens_per_gpu_divide_by_each_arms_own_gpus() -> None:
    """The experiment names 8 GPUs; arm 'one' held GPU 3 (CUDA_VISIBLE_DEVICES), 'two' held 2 GPUs by
    its parallel size, 'old' was recorded before arms said theirs: each point's tokens per GPU divide
    by the arm's own count, the experiment's where the arm's is unknown, and the report says which."""
    tps = {"one": 400.0, "two": 600.0, "old": 800.0}
    cells = [
        _cell(arm, f"lad@c{c}", 64, concurrency=c, output_throughput_tps=[rate * c], tpot_ms_p50=[5.0 * c])
        .model_copy(update={"ladder": "lad", "ladder_point": float(c)})
        for arm, rate in tps.items()
        for c in (1, 2)
    ]  # fmt: skip
    data = _study(*cells).model_copy(update={"gpus": 8})
    data.arms[0].gpus = ArmGpusData(count=1, counted=[3], basis="CUDA_VISIBLE_DEVICES", node=8)
    data.arms[1].gpus = ArmGpusData(count=2, basis="parallel size", node=8)
    points = {(p.arm, p.point): p.per_gpu_tps for p in analyse(data).pareto}
    gpus = {"one": 1, "two": 2, "old": 8}
    assert points == {(arm, float(c)): rate * c / gpus[arm] for arm, rate in tps.items() for c in (1, 2)}
    text = _markdown(data)
    assert (
        "output tokens per second per GPU (over each arm's own GPUs: one: GPU 3 of 8; two: 2 GPUs by "
        "parallel size (energy node-wide: 8 GPUs); old: node-wide: 8 GPUs)" in text
    )
    assert "GPU energy and dollars" not in text  # none of these cells has either
    priced = data.model_copy(
        update={"cells": [c.model_copy(update={"values": {**c.values, "cell_usd": [0.1]}}) for c in cells]}
    )
    assert (
        "GPU energy and dollars count each arm's own GPUs (one: GPU 3 of 8; two: 2 GPUs by parallel size "
        "(energy node-wide: 8 GPUs); old: node-wide: 8 GPUs)" in _markdown(priced)
    )


def test_a_workload_of_one_wave_is_called_a_burst() -> None:
    """64 requests at 64 streams all start at once (the H100's c64 ladder point): the report says its
    figures are a burst's; 128 at 64 streams is two waves and gets the first-wave ratio instead."""
    burst = [
        _cell(a, "w@c64", 64, concurrency=64, requests=[64.0], output_throughput_tps=[6000.0]) for a in "ab"
    ]
    text = _markdown(_study(*burst))
    assert "w@c64: all 64 measured requests started at once (64 streams): one wave" in text
    steady = [
        _cell(a, "w@c64", 64, concurrency=64, requests=[128.0], first_wave_ttft_ratio=[1.5],
              output_throughput_tps=[6000.0])
        for a in "ab"
    ]  # fmt: skip
    text = _markdown(_study(*steady))
    assert "one wave" not in text
    assert "w@c64: the measured phase opens with 64 requests at once" in text


def test_a_median_win_whose_tail_loses_is_a_split() -> None:
    """The H100's max_num_seqs 60 arm: TTFT p50 43.8% better by the old wording (30.5% lower) while its
    p99 was 3.1 times worse (four queued requests waited 1-2.6 s). The verdict shows both tails and
    calls it a split, never a plain win; a win whose tail holds is no split."""
    base = {"ttft_ms_p50": [100.0, 102.0, 98.0], "ttft_ms_p99": [840.0, 850.0, 830.0]}
    queued = {"ttft_ms_p50": [70.0, 71.0, 69.0], "ttft_ms_p99": [2600.0, 2650.0, 2550.0]}
    held = {"ttft_ms_p50": [70.0, 71.0, 69.0], "ttft_ms_p99": [800.0, 810.0, 790.0]}

    def row(other: dict[str, list[float]]) -> Any:
        data = _study(
            _cell("s64", "w", 64, **base), _cell("s60", "w", 64, **other),
            decision={"metrics": ["ttft_ms_p50"]}, prior=0.01,
        )  # fmt: skip
        return next(r for r in analyse(data).rows if r.metric.key == "ttft_ms_p50"), data

    split_row, data = row(queued)
    (v,) = split_row.verdicts
    assert v.verdict.different
    assert v.verdict.leader == "s60"
    assert v.tail is not None
    assert v.tail.metric.key == "ttft_ms_p99"
    assert v.tail.ratio == pytest.approx(2600 / 840, rel=0.02)
    assert v.split
    said = v.text()
    assert said.startswith("a split: s60 better than s64: 30.")
    assert "% lower" in said
    assert "tail (TTFT p99, first delta): s60 2,600, s64 840.0 ms, s60's 3.10x higher (+209.5%)" in said
    assert "the median better, the tail worse beyond the +-5% margin" in said
    answer = _markdown(data).split("## The answer")[1].split("## Results")[0]
    assert "a split: s60 better than s64" in answer

    (kept,) = row(held)[0].verdicts
    assert kept.tail is not None
    assert not kept.split
    assert kept.text().startswith("s60 better than s64: ")
    assert "tail (TTFT p99, first delta)" in kept.text()


def test_an_arm_much_noisier_than_the_rest_is_a_finding_with_its_cause() -> None:
    """The H100 study: one arm's repeats varied 11.6%, the others' 0.6-0.8%; pooled, that read as the
    node's noise. Each arm's own noise is shown, the noisy one flagged with what k3pipe sees (its
    warm-ups unsettled, requests queued behind a full batch); a quiet pair is not flagged."""
    rng = np.random.default_rng(3)

    def launches(cv: float) -> list[dict[str, list[float]]]:
        return [{"output_throughput_tps": list(1000 * np.exp(rng.normal(0, cv, 3)))} for _ in range(3)]

    quiet_a, quiet_b, noisy = launches(0.007), launches(0.007), launches(0.116)
    for launch in noisy:
        launch["warmup_steady"] = [0.0, 1.0, 0.0]
        launch["engine_requests_waiting_max"] = [4.0, 4.0, 4.0]
    cells = [
        _cell("s64", "w", 64, quiet_a, concurrency=64),
        _cell("s64-again", "w", 64, quiet_b, concurrency=64),
        _cell("s60", "w", 64, noisy, concurrency=64),
    ]
    analysis = analyse(_study(*cells, decision={"metrics": ["output_throughput_tps"]}))
    own = {n.arm: n for n in analysis.arm_noise}
    assert own["s60"].noisier is not None
    assert own["s60"].noisier > 4
    assert own["s64"].noisier is None
    assert own["s64-again"].noisier is None
    causes = " ".join(own["s60"].causes)
    assert "warm-up had not settled in 6 of 9 repeats" in causes
    assert "up to 4 request(s) waited for a batch slot at 64 streams" in causes
    pairs = {frozenset((p.a, p.b)) for p in analysis.pair_noise}
    assert pairs == {frozenset(x) for x in (("s64", "s64-again"), ("s64", "s60"), ("s64-again", "s60"))}
    md = _markdown(_study(*cells, decision={"metrics": ["output_throughput_tps"]}))
    assert "[noise] w, decode throughput, client: its repeats varied" in md
    assert "[warm-up] 6 of 9 repeats began before the warm-up settled (w)" in md


def test_noisier_arms_are_flagged_at_their_stated_rate_and_found() -> None:
    """The flag's false rate (every arm's noise the same): at most its 1% level, in simulation; an arm
    with twice the others' CV is flagged in most studies of 3 x 3."""
    from k3pipe.report.analysis import NOISIER_P

    rng = np.random.default_rng(12)

    def flagged(cvs: list[float]) -> list[bool]:
        cells = [
            _cell(f"a{i}", "w", 64, [{"output_throughput_tps": list(100 * np.exp(rng.normal(0, cv, 3)))}
                                     for _ in range(3)])
            for i, cv in enumerate(cvs)
        ]  # fmt: skip
        found = analyse(_study(*cells, decision={"metrics": ["output_throughput_tps"]})).arm_noise
        return [n.noisier is not None for n in found]

    trials = 300
    false = sum(any(flagged([0.05, 0.05, 0.05])) for _ in range(trials))
    assert false / trials <= 3 * NOISIER_P + 3 * (3 * NOISIER_P / trials) ** 0.5
    found = sum(flagged([0.05, 0.05, 0.25])[2] for _ in range(trials))
    assert found / trials > 0.8


def test_each_arms_own_noise_is_recovered() -> None:
    """Two arms whose noise differs (restart 2% and 8%, repeat 3% and 10%), 4 launches x 3 repeats,
    400 simulated studies: each arm's own variance components average to its own truth (the ANOVA
    estimates are unbiased), where the pooled figure would give both the same."""
    rng = np.random.default_rng(31)
    truth = {"quiet": (0.02, 0.03), "loud": (0.08, 0.10)}
    sums: dict[str, list[float]] = {a: [0.0, 0.0] for a in truth}
    studies = 400
    for _ in range(studies):
        cells = []
        for arm, (b, w) in truth.items():
            sb, sw = math.sqrt(math.log1p(b**2)), math.sqrt(math.log1p(w**2))
            launches = [
                {"output_throughput_tps": list(100 * np.exp(rng.normal(0, sb) + rng.normal(0, sw, 3)))}
                for _ in range(4)
            ]
            cells.append(_cell(arm, "w", 64, launches))
        for n in analyse(_study(*cells, decision={"metrics": ["output_throughput_tps"]})).arm_noise:
            assert n.components is not None
            sums[n.arm][0] += n.components.between / studies
            sums[n.arm][1] += n.components.within / studies
    for arm, (b, w) in truth.items():
        assert sums[arm][1] == pytest.approx(math.log1p(w**2), rel=0.05)
        # the launch level floored at 0 leans a little high where it is small beside the repeats
        assert sums[arm][0] == pytest.approx(math.log1p(b**2), rel=0.25, abs=1e-4)


def _searched(boundary: float, requests: int = 200) -> CapacityResult:
    """A search over 1-400 req/s of an engine that meets the SLO for every request well below
    ``boundary``, for 91% of them just below it (a pass whose interval holds the 90% target) and for
    half above it."""
    s = CapacitySearch("rate", 1, 400)
    while (point := s.next_point()) is not None:
        share = 100.0 if point < 0.97 * boundary else 91.0 if point <= boundary else 50.0
        s.add(point, share, {"ttft_ms": share}, requests=requests)
    return s.result()


def _capacity_cell(arm: str, launches: list[list[CapacityResult]]) -> CellData:
    """An arm's cell as the report reads it back from MLflow: each search's recorded metrics (what
    ArmRecorder.log_capacity logs) and capacity.json, launch after launch."""
    common = {"capacity": "rate 1-400 req/s", "load": "poisson", "slo": {"ttft_ms": 500.0},
              "attainment_pct": 90.0}  # fmt: skip

    def values(searches: list[CapacityResult]) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        for r in searches:
            for k, v in r.metrics().items():
                out.setdefault(k, []).append(v)
        return out

    cells = [
        _cell(arm, "cap", 2048, **values(searches)).model_copy(
            update={**common, "searches": [r.record() for r in searches]}
        )
        for searches in launches
    ]
    first = cells[0]
    for later in cells[1:]:
        first.add_launch(later)
    return first


def _capacity_text(data: StudyData) -> str:
    return _markdown(data).split("## Capacity under the SLO", 1)[1].split("\n## ", 1)[0]


def test_the_capacity_section_states_each_arms_capacity_with_its_interval_and_the_verdict() -> None:
    """Each arm's capacity is the report's estimate of its searches (capacity_estimate: bracket
    middles, the bracket counted), with its 95% interval and what the interval holds; two arms are
    compared as any decision figure is; every probe shows its binomial interval, and one whose
    interval holds the target is said to be undecided."""
    a = [_searched(b) for b in (20.0, 21.0, 19.5, 20.5)]
    b = [_searched(b) for b in (26.0, 27.0, 25.0, 26.5)]
    data = _study(_capacity_cell("a", [a]), _capacity_cell("b", [b]))
    analysis = analyse(data)
    row = next(r for r in analysis.rows if r.metric.key == "capacity_rps")
    assert row.decision  # capacity joins the default decision metrics
    for arm, searches in (("a", a), ("b", b)):
        est = capacity_estimate([searches])
        assert est is not None
        assert row.cells[arm].estimate == est  # the report's figure is the capacity module's rule
    text = _capacity_text(data)
    est_a = capacity_estimate([a])
    assert est_a is not None
    low, high = est_a.interval(0.95) or (0.0, 0.0)
    assert (
        f"| a | {est_a.mean:.3g} | [{low:.3g}, {high:.3g}] | 4 | 4 repeats of one launch: repeat noise "
        "and the bracket's width; restart noise unknown (no verdict on it: launches: 2) |" in text
    )
    (verdict,) = row.verdicts
    assert verdict.outcome == "unknown"  # one launch each, no restart noise known: no verdict
    assert f"{verdict.a} against {verdict.b}: {verdict.text()}" in text
    # the same searches judged with 2% restart noise an earlier study kept for the class
    judged = _study(_capacity_cell("a", [a]), _capacity_cell("b", [b]), prior=0.02)
    (verdict,) = next(r for r in analyse(judged).rows if r.metric.key == "capacity_rps").verdicts
    assert verdict.outcome == "different"
    assert verdict.leader == "b"
    text = _capacity_text(judged)
    assert f"{verdict.a} against {verdict.b}: {verdict.text()}" in text
    assert "b better than a: " in text
    assert "restart noise 2.0% from the history |" in text
    # the probes: each with its share's interval; 91% of 200 holds 90%: undecided
    assert f"20: 100% [{100 * 0.025 ** (1 / 200):.3g}, 100] pass" in text  # 200 of 200: [98.2, 100]
    assert any(p.undecided for p in a[0].probes)
    assert "91% [86.1, 94.6] pass, undecided" in text  # 182 of 200


def test_a_single_search_says_it_has_no_interval_and_how_to_get_one() -> None:
    one = _searched(20.0)
    data = _study(_capacity_cell("a", [[one]]), _capacity_cell("b", [[_searched(30.0)]]))
    text = _capacity_text(data)
    assert one.capacity is not None
    assert one.failed_at is not None
    middle = math.sqrt(one.capacity * one.failed_at)
    single = "a single search: no interval; repeats: 3 (or launches: 2) to get one"
    assert f"| a | {middle:.3g} | - | 1 | {single} |" in text
    assert "(a single value: no test)" in text  # the pair: b ahead, untested
    # named decision figures without capacity: shown, not judged
    data.decision = {"metrics": ["output_throughput_tps"]}
    assert "does not name capacity_rps" in _capacity_text(data)


def test_launches_give_the_capacity_interval_restart_noise_in_it() -> None:
    launches = [[_searched(20.0), _searched(21.0)], [_searched(22.0), _searched(21.5)], [_searched(19.0)]]
    censored = CapacitySearch("rate", 1, 5)
    while (point := censored.next_point()) is not None:
        censored.add(point, 100.0)
    launches[2].append(censored.result())
    cell = _capacity_cell("a", launches)
    data = _study(cell)
    row = next(r for r in analyse(data).rows if r.metric.key == "capacity_rps")
    est = capacity_estimate(launches)
    assert est is not None
    assert est.basis == "launches"
    assert row.cells["a"].estimate == est
    low, high = est.interval(0.95) or (0.0, 0.0)
    assert (
        f"| a | {est.mean:.3g} | [{low:.3g}, {high:.3g}] | 6, 5 bracketed over 3 launches | 3 launches: "
        "restart and repeat noise, and the bracket's width; censored searches (a bound, not a value) left "
        "out |" in _capacity_text(data)
    )


def test_steady_decode_worked_out_by_the_report_is_kept_per_launch() -> None:
    """The report works out steady decode from each repeat's requests (the record does not hold it).
    In a cell of two launches the values must land in their launches too: the H100 MLA study
    (2026-12-06: vLLM launched twice, steady_decode_tps a decision metric) had no steady decode row,
    since the launch-based estimate found none."""
    from k3pipe.report import add_per_repeat

    cell = _cell("vllm", "w", 64000, launches=[{"duration_s": [11.8, 11.6]}, {"duration_s": [11.2, 11.1]}])
    cell.request_runs = ["r1", "r2", "r3", "r4"]  # in launch order, a run per repeat
    assert cell.by_launch("steady_decode_tps") == []
    add_per_repeat(cell, "steady_decode_tps", [3930.5, 3737.2, None, 3681.3])
    assert cell.values["steady_decode_tps"] == [3930.5, 3737.2, 3681.3]
    assert cell.by_launch("steady_decode_tps") == [[3930.5, 3737.2], [3681.3]]
    rows = analyse(_study(cell, decision={"metrics": ["steady_decode_tps", "duration_s"]})).rows
    assert {r.metric.key for r in rows if r.decision} == {"steady_decode_tps", "duration_s"}
    # a value the record holds is not replaced
    add_per_repeat(cell, "steady_decode_tps", [1.0, 1.0, 1.0, 1.0])
    assert cell.values["steady_decode_tps"] == [3930.5, 3737.2, 3681.3]
    # runs that do not add up to the launches' repeats: the pooled values alone
    odd = _cell("vllm", "w", 64000, launches=[{"duration_s": [11.8]}, {"duration_s": [11.2]}])
    odd.request_runs = ["r1", "r2", "r3"]
    add_per_repeat(odd, "steady_decode_tps", [1.0, 2.0, 3.0])
    assert odd.values["steady_decode_tps"] == [1.0, 2.0, 3.0]
    assert odd.by_launch("steady_decode_tps") == []
