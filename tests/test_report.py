"""The report's statistics on values whose answer is known (no MLflow): Holm's correction, the ratio
interval, a real difference found and noise called noise, bursty client timing and zeros not ranked,
steady decode from known stamps."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from k3pipe.report.analysis import analyse, holm
from k3pipe.report.collect import ArmData, CellData, StudyData
from k3pipe.report.steady import steady_decode_tps


def _cell(arm: str, workload: str, tokens: int, **values: list[float]) -> CellData:
    return CellData(
        arm=arm, engine="vllm", workload=workload, input_tokens=tokens, output_tokens=32, concurrency=4,
        run_id=f"{arm}-{workload}", status="FINISHED", values=values,
    )  # fmt: skip


def _study(*cells: CellData) -> StudyData:
    arms = list(dict.fromkeys(c.arm for c in cells))
    return StudyData(
        run_id="s",
        name="t",
        status="FINISHED",
        arms=[ArmData(name=a, engine="vllm", run_id=a, status="FINISHED") for a in arms],
        cells=list(cells),
    )


def test_holm() -> None:
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.5, 0.001]) == pytest.approx([0.5, 0.002])
    assert holm([]) == []


def test_a_real_difference_and_noise() -> None:
    rng = np.random.default_rng(0)
    fast = list(100 + rng.normal(0, 2, 5))
    slow = list(150 + rng.normal(0, 2, 5))
    noisy_a = list(100 + rng.normal(0, 10, 5))
    noisy_b = list(101 + rng.normal(0, 10, 5))
    analysis = analyse(
        _study(
            _cell("a", "w", 64, duration_s=fast, ttft_ms_p50=noisy_a),
            _cell("b", "w", 64, duration_s=slow, ttft_ms_p50=noisy_b),
        )
    )
    rows = {r.metric.key: r for r in analysis.rows}
    e2e = rows["duration_s"]
    (v,) = e2e.verdicts
    assert (v.leader, v.other) == ("a", "b")
    assert v.different
    assert v.ci is not None
    assert v.ci[0] < v.ratio < v.ci[1]
    assert v.ratio == pytest.approx(np.mean(slow) / np.mean(fast))
    assert v.text().startswith("a ahead of b by ")
    (n,) = rows["ttft_ms_p50"].verdicts
    assert not n.different
    assert n.text().startswith("no difference within noise")
    assert analysis.tests == 2


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
