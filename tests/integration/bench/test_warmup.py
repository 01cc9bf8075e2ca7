"""The warm-up's waves, its verdict and the opening wave's TTFT, on hand-built records with answers
worked out by hand (k3pipe/bench/warmup.py, k3pipe/bench/summary.py). The same rules against a
scripted server whose rate is known are in test_definitions.py."""

from __future__ import annotations

import pytest

from k3pipe.bench import RequestRecord, WorkloadResult, summarize
from k3pipe.bench.summary import summary_line, warmup_note
from k3pipe.bench.warmup import agree, change_pct, warmup_report, waves

pytestmark = pytest.mark.serial

T0 = 2000.0


def rec(
    index: int,
    send: float,
    end: float,
    out: int | None = 10,
    *,
    warmup: bool = True,
    ttft: float = 0.1,
    error: str | None = None,
) -> RequestRecord:
    return RequestRecord(
        index=index,
        warmup=warmup,
        prompt_tokens=5,
        max_tokens=10,
        usage_output_tokens=out,
        t_scheduled=T0 + send,
        t_send=T0 + send,
        t_first_delta=None if error else T0 + send + ttft,
        t_first_content=None if error else T0 + send + ttft,
        chunk_times=[] if error else [T0 + send + ttft],
        t_end=T0 + end,
        status_code=500 if error else 200,
        error=error,
    )


def test_waves_are_blocks_of_concurrency_in_send_order() -> None:
    """Concurrency 2, a pool's warm-up (a slot takes the next request as its last ends): sends at
    0, 0, 1, 1.5, 2, 3 (indices out of send order), each 10 tokens.

    wave  requests (send order)   span         rate            change
    1     idx 1 @0, idx 0 @0      0 -> 1.0     20 / 1.0 = 20   -
    2     idx 3 @1, idx 2 @1.5    1 -> 2.0     20 / 1.0 = 20   0%
    3     idx 4 @2, idx 5 @3      2 -> 3.6     20 / 1.6 = 12.5 -37.5%
    """
    records = [
        rec(0, 0.0, 1.0),
        rec(1, 0.0, 0.9),
        rec(2, 1.5, 2.0),
        rec(3, 1.0, 1.8),
        rec(4, 2.0, 3.6),
        rec(5, 3.0, 3.5),
        rec(6, 4.0, 5.0, warmup=False),  # a measured request is no wave's
    ]
    found = waves(records, 2)
    assert [w.requests for w in found] == [2, 2, 2]
    assert [w.output_tokens for w in found] == [20, 20, 20]
    assert [w.duration_s for w in found] == pytest.approx([1.0, 1.0, 1.6])
    assert [w.output_tps for w in found] == pytest.approx([20.0, 20.0, 12.5])
    assert found[0].change_pct is None
    assert found[1].change_pct == pytest.approx(0.0)
    assert found[2].change_pct == pytest.approx(-37.5)
    report = warmup_report(records, "fixed", 2, 5.0, 6)
    assert report.requests_sent == 6
    assert report.steady is False  # the last two full waves disagree
    assert report.last_change_pct == pytest.approx(-37.5)


def test_a_partial_last_wave_is_reported_but_not_compared() -> None:
    """Concurrency 2, five warm-up requests: the third wave holds one request; the verdict is on
    waves 1 and 2 (20 and 21 tok/s: +5%, within 5%)."""
    records = [
        rec(0, 0.0, 1.0),
        rec(1, 0.0, 1.0),
        rec(2, 1.0, 2.0, out=11),
        rec(3, 1.0, 2.0, out=10),
        rec(4, 2.0, 2.5),
    ]
    report = warmup_report(records, "fixed", 2, 5.0, 5)
    assert [w.requests for w in report.waves] == [2, 2, 1]
    assert report.waves[1].change_pct == pytest.approx(5.0)
    assert report.waves[2].output_tps == pytest.approx(20.0)
    assert report.waves[2].change_pct is None
    assert report.last_change_pct == pytest.approx(5.0)
    assert report.steady is True  # 5% is within a 5% tolerance: the bound agrees


def test_failed_requests_add_no_tokens_and_a_wave_of_failures_has_no_rate() -> None:
    records = [
        rec(0, 0.0, 1.0),
        rec(1, 0.0, 1.0, error="HTTP 500 from x: boom"),
        rec(2, 1.0, 2.0, error="HTTP 500 from x: boom"),
        rec(3, 1.0, 2.0, error="HTTP 500 from x: boom"),
        rec(4, 2.0, 3.0),
        rec(5, 2.0, 3.0),
    ]
    found = waves(records, 2)
    assert [(w.completed, w.output_tokens) for w in found] == [(1, 10), (0, 0), (2, 20)]
    assert [w.output_tps for w in found] == [pytest.approx(10.0), None, pytest.approx(20.0)]
    assert [w.change_pct for w in found] == [None, None, None]  # nothing to compare with
    report = warmup_report(records, "steady", 2, 5.0, 6)
    assert report.steady is False
    assert report.last_change_pct is None


def test_fewer_than_two_full_waves_have_no_verdict() -> None:
    assert warmup_report([rec(0, 0.0, 1.0), rec(1, 0.0, 1.0)], "fixed", 2, 5.0, 2).steady is None
    assert warmup_report([rec(0, 0.0, 1.0)] * 0, "fixed", 4, 5.0, 0).waves == []
    assert agree(5.0, 5.0)
    assert agree(-5.0, 5.0)
    assert not agree(5.01, 5.0)
    assert not agree(None, 5.0)
    assert change_pct(11.0, 10.0) == pytest.approx(10.0)
    assert change_pct(11.0, 0.0) is None
    with pytest.raises(ValueError, match="at least 1"):
        waves([], 0)


def test_the_warmup_figures_in_the_summary_and_the_log_line() -> None:
    warm = [rec(i, float(i // 2), float(i // 2) + 1.0) for i in range(6)]
    steady = warmup_report(warm, "steady", 2, 5.0, 8)
    measured = [rec(8 + i, 10.0 + i, 11.0 + i, warmup=False) for i in range(2)]
    result = WorkloadResult(
        workload="w",
        records=warm + measured,
        t_start=T0 + 10,
        t_end=T0 + 12,
        started_at_unix_s=0,
        warmup=steady,
    )
    s = summarize(result)
    assert s.warmup == steady  # the waves go to summary.json
    m = s.metrics()
    assert m["warmup_requests"] == 6  # sent, of the 8 it could have sent
    assert m["warmup_waves"] == 3
    assert m["warmup_steady"] == 1.0
    assert m["warmup_last_change_pct"] == pytest.approx(0.0)
    assert m["warmup_last_wave_tps"] == pytest.approx(20.0)
    line = summary_line("w", m, "per_token")
    assert "warm-up 6 requests (3 waves): steady, last wave +0.0%" in line
    assert warmup_note(m) is None
    # a warm-up whose rate was still changing: NOT steady, and a warning naming the setting
    slow_last = [*warm[:4], rec(4, 2.0, 4.0), rec(5, 2.0, 4.0)]
    unsteady = result.model_copy(update={"warmup": warmup_report(slow_last, "steady", 2, 5.0, 6)})
    m = summarize(unsteady).metrics()
    assert m["warmup_steady"] == 0.0
    assert m["warmup_last_change_pct"] == pytest.approx(-50.0)
    assert "NOT steady, last wave -50.0%" in summary_line("w", m, "per_token")
    note = warmup_note(m, "steady")
    assert note is not None
    assert "did not reach a steady rate" in note
    assert "-50.0%" in note
    assert "raise warmup_requests" in note
    fixed_note = warmup_note(m, "fixed")
    assert fixed_note is not None
    assert "set warmup: steady" in fixed_note
    # no warm-up at all: no warm-up figures
    bare = summarize(result.model_copy(update={"records": measured, "warmup": None})).metrics()
    assert not any(k.startswith("warmup_") and k != "warmup_requests" for k in bare)
    assert "warm-up" not in summary_line("w", bare, "per_token")


def test_the_opening_wave_ttft_against_the_rest() -> None:
    """Concurrency 3: the first three measured requests by send order (indices 4, 2, 3, sent at 0)
    have TTFTs 300, 320 and a failure; the rest (sent later) 100, 110, 120, 90.

    first wave p50: of 300 and 320 (the failure has none) = 310; after: of 90, 100, 110, 120 = 105;
    ratio 310 / 105. TTFT p50 itself stays over all six successful requests: of 90 .. 320 = 115.
    """
    measured = [
        rec(0, 0.5, 1.0, warmup=False, ttft=0.100),
        rec(1, 0.6, 1.0, warmup=False, ttft=0.110),
        rec(2, 0.0, 1.0, warmup=False, ttft=0.300),
        rec(3, 0.0, 1.0, warmup=False, error="HTTP 500 from x: boom"),
        rec(4, 0.0, 1.0, warmup=False, ttft=0.320),
        rec(5, 0.7, 1.0, warmup=False, ttft=0.120),
        rec(6, 0.8, 1.0, warmup=False, ttft=0.090),
    ]
    result = WorkloadResult(
        workload="w", records=measured, t_start=T0, t_end=T0 + 1, started_at_unix_s=0, opening_wave=3
    )
    s = summarize(result)
    assert s.ttft_ms_p50_first_wave == pytest.approx(310.0)
    assert s.ttft_ms_p50_after_first_wave == pytest.approx(105.0)
    assert s.first_wave_ttft_ratio == pytest.approx(310.0 / 105.0)
    assert s.ttft_ms is not None
    assert s.ttft_ms.p50 == pytest.approx(115.0)
    m = s.metrics()
    assert m["ttft_ms_p50_first_wave"] == pytest.approx(310.0)
    assert m["ttft_ms_p50_after_first_wave"] == pytest.approx(105.0)
    assert m["first_wave_ttft_ratio"] == pytest.approx(310.0 / 105.0)
    assert m["ttft_ms_p50"] == pytest.approx(115.0)
    assert "first wave ttft p50 x2.95 the rest's" in summary_line("w", m, "per_token")
    # under a schedule the measured phase has no opening wave: no such figures
    scheduled = summarize(result.model_copy(update={"opening_wave": None})).metrics()
    assert "ttft_ms_p50_first_wave" not in scheduled
    assert "first_wave_ttft_ratio" not in scheduled
    # no request after the first wave: no 'after', no ratio
    short = summarize(result.model_copy(update={"opening_wave": 10}))
    assert short.ttft_ms_p50_first_wave == pytest.approx(115.0)
    assert short.ttft_ms_p50_after_first_wave is None
    assert short.first_wave_ttft_ratio is None
