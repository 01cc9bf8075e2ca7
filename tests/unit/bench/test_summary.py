"""Summary math on hand-built records with known answers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest

import k3pipe.bench
from k3pipe.bench import (
    LatencyStats,
    RequestRecord,
    WorkloadResult,
    check_throughput,
    records_frame,
    summarize,
)
from k3pipe.bench.client import ClientLoad
from k3pipe.bench.summary import client_note, summary_line

# Raw perf_counter stamps are arbitrary: start the clock far from zero so "relative" is tested.
T0 = 1000.0


def rec(
    index: int,
    send: float,
    first: float | None,
    content: float | None,
    chunks: list[float],
    end: float,
    out: int | None,
    *,
    max_tokens: int = 20,
    warmup: bool = False,
    error: str | None = None,
    scheduled: float | None = None,
) -> RequestRecord:
    return RequestRecord(
        index=index,
        warmup=warmup,
        prompt_tokens=100,
        max_tokens=max_tokens,
        usage_prompt_tokens=None if out is None else 110,
        usage_output_tokens=out,
        t_scheduled=T0 + (send if scheduled is None else scheduled),
        t_send=T0 + send,
        t_first_delta=None if first is None else T0 + first,
        t_first_content=None if content is None else T0 + content,
        chunk_times=[T0 + c for c in chunks],
        t_end=T0 + end,
        status_code=200 if error is None else 500,
        error=error,
    )


def known_result(max_tokens: int = 20) -> WorkloadResult:
    """Four good measured requests, one failed, one warm-up; the window is 4 s.

    E2E ends at the last token-bearing chunk, not at the stream's end (the usage chunk and [DONE]
    may come later: request 0's stream ends 50 ms after its last token, request 2's 200 ms after).
    No per-chunk token counts, so ITL is per chunk, and TPOT is known only for request 3 (4 chunks
    for 4 tokens: one each); for 0 and 1 (fewer chunks than tokens) k1 = 1 gives a lower bound.

    per request       ttft  content  e2e   out  tpot                           ITL gaps
    0                 100   150      1100  11   lower bound (1100-100)/10=100  100, 100, 800
    1 (reasoning)     200   -        1200  6    lower bound (1200-200)/5=200   300, 700
    2                 300   350      300   1    -                              -
    3                 400   400      1000  4    (1000-400)/3=200               50, 50, 500
    """
    records = [
        rec(0, -5.0, -4.0, -4.0, [-4.0], -1.0, 50, warmup=True),
        rec(1, 0.0, 0.1, 0.15, [0.1, 0.2, 0.3, 1.1], 1.15, 11, max_tokens=max_tokens),
        rec(2, 1.0, 1.2, None, [1.2, 1.5, 2.2], 2.2, 6, max_tokens=max_tokens),
        rec(3, 2.0, 2.3, 2.35, [2.3], 2.5, 1, max_tokens=max_tokens),
        rec(4, 3.0, 3.4, 3.4, [3.4, 3.45, 3.5, 4.0], 4.0, 4, max_tokens=max_tokens),
        rec(5, 0.5, None, None, [], 0.6, None, max_tokens=max_tokens, error="HTTP 500 from x: boom"),
    ]
    return WorkloadResult(
        workload="known", records=records, t_start=T0, t_end=T0 + 4.0, started_at_unix_s=1.7e9
    )


def test_latency_statistics() -> None:
    s = summarize(known_result())
    assert s.ttft_ms is not None
    assert s.ttft_ms.count == 4
    assert s.ttft_ms.model_dump(exclude={"count"}) == pytest.approx(
        {"mean": 250.0, "p50": 250.0, "p90": 370.0, "p99": 397.0}  # linear: p90 at rank 2.7
    )
    assert s.content_ttft_ms is not None
    assert s.content_ttft_ms.count == 3  # the reasoning-only request never reached content
    assert s.content_ttft_ms.mean == pytest.approx(300.0)
    assert s.content_ttft_ms.p50 == pytest.approx(350.0)
    assert s.tpot_ms is not None
    assert s.tpot_ms.count == 1  # only request 3's first chunk is known to hold one token
    assert s.tpot_ms.mean == pytest.approx(200.0)
    # the other two under their own name, never mixed in (a 1-token request has no TPOT at all)
    assert s.tpot_lower_bound_ms is not None
    assert s.tpot_lower_bound_ms.count == 2
    assert s.tpot_lower_bound_ms.mean == pytest.approx(150.0)
    assert s.tpot_k1_assumed  # no per-chunk counts: k1 taken as 1 for those
    assert s.metrics()["tpot_lower_bound_ms_p50"] == pytest.approx(150.0)
    # ITL pooled over requests, per chunk (no counts): 50, 50, 100, 100, 300, 500, 700, 800
    assert s.itl_basis == "per_chunk"
    assert s.itl_ms is not None
    assert s.itl_ms == s.chunk_itl_ms
    assert s.itl_ms.count == 8
    assert s.itl_ms.mean == pytest.approx(2600.0 / 8)
    assert s.itl_ms.p50 == pytest.approx(200.0)  # rank 3.5 between 100 and 300
    assert s.itl_ms.p90 == pytest.approx(730.0)  # rank 6.3 between 700 and 800
    assert s.itl_ms.p99 == pytest.approx(793.0)
    # E2E to the last token: 1100, 1200, 300, 1000
    assert s.e2e_ms is not None
    assert s.e2e_ms.mean == pytest.approx(900.0)
    assert s.e2e_ms.p50 == pytest.approx(1050.0)


def test_percentiles_use_linear_interpolation() -> None:
    stats = LatencyStats.of([1.0, 2.0, 3.0, 4.0, 100.0])
    assert stats is not None
    assert (stats.p50, stats.p90, stats.p99) == pytest.approx((3.0, 61.6, 96.16))
    assert LatencyStats.of([]) is None


def test_counts_and_throughput() -> None:
    s = summarize(known_result())
    assert (s.requests, s.completed, s.failed, s.warmup_requests) == (5, 4, 1, 1)
    assert s.duration_s == pytest.approx(4.0)
    assert s.request_throughput_rps == pytest.approx(1.0)
    assert s.input_tokens_total == 400
    assert s.server_input_tokens_total == 440
    assert s.output_tokens_total == 22  # the warm-up's 50 tokens are not counted
    assert s.output_throughput_tps == pytest.approx(5.5)
    assert s.output_throughput_bound_tps == pytest.approx(80 / 4.0)
    assert not s.throughput_exceeds_bound
    assert not s.output_tokens_from_chunks
    assert s.errors == {"HTTP 500 from x: boom": 1}


def test_throughput_above_its_ceiling_is_flagged() -> None:
    # max_tokens 5 but usage says 11, 6, 1, 4: 22 tokens where at most 4 x 5 = 20 were possible
    s = summarize(known_result(max_tokens=5))
    assert s.output_throughput_bound_tps == pytest.approx(5.0)
    assert s.output_throughput_tps == pytest.approx(5.5)
    assert s.throughput_exceeds_bound
    assert s.metrics()["throughput_exceeds_bound"] == 1.0


def test_throughput_at_its_ceiling_is_not_flagged() -> None:
    records = [rec(i, 0.0, 0.1, 0.1, [0.1, 0.5], 1.0, 10, max_tokens=10) for i in range(3)]
    result = WorkloadResult(workload="w", records=records, t_start=T0, t_end=T0 + 1.0, started_at_unix_s=0)
    s = summarize(result)
    assert s.output_throughput_tps == pytest.approx(30.0) == s.output_throughput_bound_tps
    assert not s.throughput_exceeds_bound


def test_usage_absent_falls_back_to_chunks() -> None:
    records = [
        rec(0, 0.0, 0.1, 0.1, [0.1, 0.2, 0.3], 1.0, None),
        rec(1, 0.0, 0.1, 0.1, [0.1, 0.2], 1.0, 5),
    ]
    result = WorkloadResult(workload="w", records=records, t_start=T0, t_end=T0 + 1.0, started_at_unix_s=0)
    s = summarize(result)
    assert s.output_tokens_total == 3 + 5
    assert s.output_tokens_from_chunks
    assert s.server_input_tokens_total is None  # one request had no usage at all
    assert s.metrics()["output_tokens_from_chunks"] == 1.0


def test_nothing_succeeded() -> None:
    records = [rec(0, 0.0, None, None, [], 0.5, None, error="HTTP 401 from x: Unauthorized")]
    result = WorkloadResult(workload="w", records=records, t_start=T0, t_end=T0 + 0.5, started_at_unix_s=0)
    s = summarize(result)
    assert (s.completed, s.failed) == (0, 1)
    assert s.ttft_ms is None
    assert s.e2e_ms is None
    assert s.itl_ms is None
    assert s.output_throughput_tps == 0.0
    metrics = s.metrics()
    stats = ("_mean", "_p50", "_p90", "_p99")
    assert not any(
        k.startswith(("ttft", "e2e", "tpot", "itl", "chunk_itl")) and k.endswith(stats) for k in metrics
    )
    assert metrics["failed"] == 1.0


def test_metrics_are_flat_floats_with_units_in_names() -> None:
    metrics = summarize(known_result()).metrics()
    assert metrics["ttft_ms_p99"] == pytest.approx(397.0)
    assert metrics["content_ttft_ms_p50"] == pytest.approx(350.0)
    assert metrics["output_throughput_tps"] == pytest.approx(5.5)
    assert metrics["duration_s"] == pytest.approx(4.0)
    counts = {
        "requests",
        "completed",
        "failed",
        "warmup_requests",
        "output_tokens_from_chunks",
        "output_tokens_retokenized",
        "tpot_k1_assumed",
        "itl_per_token",
        "throughput_exceeds_bound",
        "stopped_by_duration",
        "bursty_requests",
        "client_timing_bursty",
        "client_processes",
        "client_saturated",
    }
    unit = re.compile(r"(_ms_(mean|p50|p90|p99)|_s|_rps|_tps|_total|_pct|_us)$")
    for name, value in metrics.items():
        assert type(value) is float, name
        assert name in counts or unit.search(name), name
        assert ":" not in name  # MLflow refuses ':' in metric names
    for latency in (
        "ttft_ms",
        "content_ttft_ms",
        "tpot_ms",
        "itl_ms",
        "chunk_itl_ms",
        "e2e_ms",
        "send_lag_ms",
        "ttft_from_scheduled_ms",
        "e2e_from_scheduled_ms",
    ):
        for stat in ("mean", "p50", "p90", "p99"):
            assert f"{latency}_{stat}" in metrics


def test_no_lag_when_sent_on_schedule() -> None:
    s = summarize(known_result())
    assert s.send_lag_ms is not None
    assert s.send_lag_ms.count == 5  # every measured request sent, the failed one included
    assert s.send_lag_ms.model_dump(exclude={"count"}) == pytest.approx(
        {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    )
    assert s.ttft_from_scheduled_ms == s.ttft_ms
    assert s.e2e_from_scheduled_ms == s.e2e_ms
    assert not s.stopped_by_duration


def test_send_lag_and_latency_from_the_schedule() -> None:
    """Three requests due at 0, 0.1, 0.2 s but sent at 0, 0.5, 1.2 s (the client fell behind).

    per request  lag   ttft  ttft from scheduled  e2e   e2e from scheduled
    0            0     100   100                  500   500
    1            400   100   500                  500   900
    2            1000  200   1200                 400   1400
    """
    records = [
        rec(0, 0.0, 0.1, 0.1, [0.1, 0.5], 0.5, 2, scheduled=0.0),
        rec(1, 0.5, 0.6, 0.6, [0.6, 1.0], 1.0, 2, scheduled=0.1),
        rec(2, 1.2, 1.4, 1.4, [1.4, 1.6], 1.6, 2, scheduled=0.2),
        rec(3, -1.0, -0.9, -0.9, [-0.9], -0.5, 1, warmup=True, scheduled=-3.0),  # not measured
    ]
    result = WorkloadResult(workload="w", records=records, t_start=T0, t_end=T0 + 1.6, started_at_unix_s=0)
    s = summarize(result)
    assert s.send_lag_ms is not None
    assert s.ttft_from_scheduled_ms is not None
    assert s.e2e_from_scheduled_ms is not None
    assert s.ttft_ms is not None
    assert s.e2e_ms is not None
    assert s.send_lag_ms.count == 3
    assert s.send_lag_ms.mean == pytest.approx(1400.0 / 3)
    assert s.send_lag_ms.p50 == pytest.approx(400.0)
    assert s.send_lag_ms.p90 == pytest.approx(880.0)  # rank 1.8 between 400 and 1000
    assert s.ttft_from_scheduled_ms.mean == pytest.approx(1800.0 / 3)
    assert s.ttft_from_scheduled_ms.p50 == pytest.approx(500.0)
    assert s.ttft_ms.mean == pytest.approx(400.0 / 3)
    assert s.e2e_from_scheduled_ms.mean == pytest.approx(2800.0 / 3)
    assert s.e2e_ms.mean == pytest.approx(1400.0 / 3)
    # the window and throughput stay defined by sends and ends, not by the schedule
    assert s.duration_s == pytest.approx(1.6)
    assert s.request_throughput_rps == pytest.approx(3 / 1.6)
    metrics = s.metrics()
    assert metrics["send_lag_ms_p50"] == pytest.approx(400.0)
    assert metrics["e2e_from_scheduled_ms_mean"] == pytest.approx(2800.0 / 3)
    frame = records_frame(result)
    assert frame.iloc[1]["t_scheduled_s"] == pytest.approx(0.1)
    assert frame.iloc[1]["t_send_s"] == pytest.approx(0.5)
    assert frame.iloc[2]["send_lag_ms"] == pytest.approx(1000.0)
    assert frame.iloc[2]["ttft_from_scheduled_ms"] == pytest.approx(1200.0)
    assert frame.iloc[2]["e2e_from_scheduled_ms"] == pytest.approx(1400.0)
    assert frame.iloc[3]["t_scheduled_s"] == pytest.approx(-3.0)


def test_stopped_by_duration_is_carried() -> None:
    result = known_result().model_copy(update={"stopped_by_duration": True, "requests_planned": 9})
    s = summarize(result)
    assert s.stopped_by_duration
    assert s.requests == 5  # the measured requests actually sent
    assert s.metrics()["stopped_by_duration"] == 1.0


def test_check_throughput_the_studys_case() -> None:
    check = check_throughput(1111.61, 10 * 3000, 295.21)
    assert check.ceiling_tps == pytest.approx(101.62, abs=0.01)
    assert check.ratio == pytest.approx(10.94, abs=0.01)
    assert check.exceeds
    assert not check_throughput(101.6, 10 * 3000, 295.21).exceeds
    with pytest.raises(ValueError, match="wall_s"):
        check_throughput(1.0, 10, 0.0)


def test_records_frame(tmp_path: Path) -> None:
    result = known_result()
    frame = records_frame(result)
    assert list(frame["index"]) == [0, 1, 2, 3, 4, 5]
    assert list(frame["warmup"]) == [True, False, False, False, False, False]
    assert list(frame["ok"]) == [True, True, True, True, True, False]
    row = frame.iloc[1]
    assert row["t_send_s"] == pytest.approx(0.0)
    assert row["t_scheduled_s"] == pytest.approx(0.0)
    assert row["send_lag_ms"] == pytest.approx(0.0)
    assert row["t_first_delta_s"] == pytest.approx(0.1)
    assert row["t_end_s"] == pytest.approx(1.15)
    assert row["ttft_ms"] == pytest.approx(100.0)
    assert row["content_ttft_ms"] == pytest.approx(150.0)
    assert pd.isna(row["tpot_ms"])  # 4 chunks for 11 tokens: its first chunk's tokens unknown
    assert row["tpot_lower_bound_ms"] == pytest.approx(100.0)
    assert row["e2e_ms"] == pytest.approx(1100.0)
    assert row["chunks"] == 4
    assert json.loads(row["chunk_times_s"]) == pytest.approx([0.1, 0.2, 0.3, 1.1])
    assert row["output_tokens_source"] == "usage"
    assert frame.iloc[0]["t_send_s"] == pytest.approx(-5.0)  # warm-up before the window
    failed = frame.iloc[5]
    assert pd.isna(failed["ttft_ms"])
    assert pd.isna(failed["usage_output_tokens"])
    assert failed["error"] == "HTTP 500 from x: boom"
    assert pd.isna(frame.iloc[2]["content_ttft_ms"])
    path = tmp_path / "records.parquet"
    frame.to_parquet(path)
    back = pd.read_parquet(path)
    assert back.shape == frame.shape
    assert back["usage_output_tokens"].tolist()[:5] == [50, 11, 6, 1, 4]


def test_public_names() -> None:
    assert sorted(k3pipe.bench.__all__) == [
        "LatencyStats",
        "Prompt",
        "PromptSet",
        "RequestRecord",
        "ThroughputCheck",
        "WorkloadResult",
        "WorkloadSummary",
        "build_prompts",
        "check_throughput",
        "load_tokenizer",
        "random_prompts",
        "records_frame",
        "run_workload",
        "shared_prefix_prompts",
        "summarize",
    ]
    for name in k3pipe.bench.__all__:
        assert getattr(k3pipe.bench, name) is not None


def test_client_load_gives_the_client_metrics_and_flags_a_saturated_process() -> None:
    def load(process: int, cpu_s: float, lag_p99: float) -> ClientLoad:
        return ClientLoad(
            process=process, cpus=[process], wall_s=10.0, cpu_s=cpu_s, events=1000,
            loop_lag_ms_p99=lag_p99, loop_lag_ms_max=lag_p99 * 2,
        )  # fmt: skip

    calm = known_result().model_copy(update={"client_load": [load(0, 2.0, 0.5), load(1, 3.0, 1.0)]})
    m = summarize(calm).metrics()
    assert m["client_processes"] == 2
    assert m["client_cpu_max_pct"] == pytest.approx(30.0)
    assert m["client_cpu_per_event_us"] == pytest.approx(5.0 / 2000 * 1e6)
    assert m["client_loop_lag_ms_p99"] == 1.0
    assert m["client_saturated"] == 0.0
    assert client_note(m) is None
    assert "CLIENT SATURATED" not in summary_line("w", m, "per_token")
    for busy in ([load(0, 9.5, 0.5)], [load(0, 2.0, 0.5), load(1, 2.0, 7.0)]):
        hot = summarize(known_result().model_copy(update={"client_load": busy})).metrics()
        assert hot["client_saturated"] == 1.0
        note = client_note(hot)
        assert note is not None
        assert "client.processes" in note
        assert "client.cpus" in note
        assert "CLIENT SATURATED" in summary_line("w", hot, "per_token")
    # a result without client load (an older record): one process, nothing claimed
    plain = summarize(known_result()).metrics()
    assert plain["client_processes"] == 1
    assert "client_cpu_max_pct" not in plain
