"""Engine /metrics: parsing (real vLLM scrape), scraping a scripted server, summaries, reconciliation."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pandas as pd
import pytest

from k3pipe.engines.sglang import ENGINE as SGLANG
from k3pipe.engines.vllm import ENGINE as VLLM
from k3pipe.machine.metrics import (
    MetricsScraper,
    Scrape,
    bracketing_scrapes,
    engine_side_summary,
    histogram_quantile,
    parse_exposition,
    reconcile,
    series_frame,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "engines"
VLLM_TEXT = (FIXTURES / "vllm" / "metrics.txt").read_text()
SGLANG_TEXT = (FIXTURES / "sglang" / "metrics.txt").read_text()
TINY = frozenset({("engine", "0"), ("model_name", "tiny")})


def lbl(**labels: str) -> frozenset[tuple[str, str]]:
    return frozenset(labels.items())


# -- parsing -------------------------------------------------------------------------------------


def test_parse_real_vllm_scrape() -> None:
    samples = parse_exposition(VLLM_TEXT)
    assert samples[("vllm:generation_tokens_total", TINY)] == 144.0
    assert samples[("vllm:prompt_tokens_total", TINY)] == 93.0
    assert samples[("vllm:time_to_first_token_seconds_count", TINY)] == 3.0
    assert samples[("vllm:time_to_first_token_seconds_sum", TINY)] == 0.11075186729431152
    assert samples[("vllm:time_to_first_token_seconds_bucket", TINY | {("le", "0.01")})] == 2.0
    assert samples[("vllm:time_to_first_token_seconds_bucket", TINY | {("le", "+Inf")})] == 3.0
    assert samples[("vllm:inter_token_latency_seconds_count", TINY)] == 141.0
    assert samples[("vllm:request_success_total", TINY | {("finished_reason", "length")})] == 3.0
    assert samples[("process_virtual_memory_bytes", frozenset())] == 2.184699904e09
    assert samples[("http_request_duration_highr_seconds_count", frozenset())] == 4.0
    spec = lbl(engine="0", model_name="kimi-k3")
    assert samples[("vllm:spec_decode_num_draft_tokens_total", spec)] == 1_880_620.0
    assert samples[("vllm:spec_decode_num_accepted_tokens_per_pos_total", spec | {("position", "6")})] == 32.0
    # the cache config travels as labels of a constant gauge
    (info_labels,) = [labels for name, labels in samples if name == "vllm:cache_config_info"]
    assert dict(info_labels)["kv_cache_size_tokens"] == "1048576"
    assert dict(info_labels)["kv_cache_dtype_skip_layers"] == "[]"


def test_parse_keep_filters_by_sample_name() -> None:
    samples = parse_exposition(VLLM_TEXT, keep={"vllm:generation_tokens_total", "vllm:prompt_tokens_total"})
    assert set(samples) == {("vllm:generation_tokens_total", TINY), ("vllm:prompt_tokens_total", TINY)}


@pytest.mark.parametrize("text", [VLLM_TEXT, SGLANG_TEXT], ids=["vllm", "sglang"])
def test_parse_agrees_with_prometheus_client(text: str) -> None:
    parser = pytest.importorskip("prometheus_client.parser")
    expected = {
        (s.name, frozenset(s.labels.items())): s.value
        for family in parser.text_string_to_metric_families(text)
        for s in family.samples
    }
    assert parse_exposition(text) == expected
    assert len(expected) > 100


def test_parse_escapes_special_values_and_timestamps() -> None:
    text = (
        "# HELP x A metric\n"
        "# TYPE x gauge\n"
        'x{path="C:\\\\dir",quote="say \\"hi\\"",nl="a\\nb",brace="}{",} 1.5e3 1700000000000\n'
        "bare +Inf\n"
        "neg -Inf\n"
        "nan NaN\n"
        'om_counter_total{a="1"} 7 # {trace_id="abc"} 1.0\n'
        "# EOF\n"
    )
    samples = parse_exposition(text)
    key = lbl(path="C:\\dir", quote='say "hi"', nl="a\nb", brace="}{")
    assert samples[("x", key)] == 1500.0
    assert samples[("bare", frozenset())] == math.inf
    assert samples[("neg", frozenset())] == -math.inf
    assert math.isnan(samples[("nan", frozenset())])
    assert samples[("om_counter_total", lbl(a="1"))] == 7.0


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ('x{a="1" 2', "malformed labels"),
        ("x 1 2 3", "expected"),
        ("x abc", "not a number"),
        ("x", "expected"),
        ("-x 1", "no metric name"),
        ("x{a=1} 2", "malformed labels"),
    ],
)
def test_parse_rejects_malformed_lines(line: str, problem: str) -> None:
    with pytest.raises(ValueError, match=f"line 2: .*{problem}"):
        parse_exposition("ok 1\n" + line + "\n")


# -- summaries on the real formats -----------------------------------------------------------------


def zeroed(samples: dict) -> dict:
    return {key: 0.0 for key in samples}


def scrape(t: float, samples: dict, error: str | None = None) -> Scrape:
    return Scrape(t_perf=t, t_unix=1.7e9 + t, elapsed_s=0.01, samples=samples, error=error)


def test_engine_side_summary_on_vllm_fixture_against_zero_baseline() -> None:
    samples = parse_exposition(VLLM_TEXT)
    out = engine_side_summary([scrape(10.0, zeroed(samples)), scrape(14.0, samples)], VLLM)
    assert out["engine_window_s"] == 4.0
    assert out["engine_generation_tokens"] == 144.0
    assert out["engine_generation_tps"] == 36.0
    assert out["engine_prompt_tps"] == pytest.approx(93.0 / 4)
    assert out["engine_ttft_ms_mean"] == pytest.approx(0.11075186729431152 / 3 * 1000)
    # rank 1.5 of 3 falls in (0.005, 0.01], which holds 2: 5 + 5 x 1.5/2 ms
    assert out["engine_ttft_ms_p50"] == pytest.approx(8.75)
    # rank 2.97 falls in (0.08, 0.1], which holds the third: 80 + 20 x 0.97 ms
    assert out["engine_ttft_ms_p99"] == pytest.approx(99.4)
    assert out["engine_itl_ms_mean"] == pytest.approx(0.8835993509999298 / 141 * 1000)
    assert out["engine_requests_finished"] == 3.0
    assert out["engine_preemptions"] == 0.0
    assert out["engine_kv_usage_ratio_max"] == 0.0
    # vllm/v1/spec_decode/metrics.py:114: 1 + accepted / drafts; rate = accepted / drafted tokens
    assert out["engine_spec_mean_acceptance_length"] == pytest.approx(1 + 39900 / 268660)
    assert out["engine_spec_acceptance_rate"] == pytest.approx(39900 / 1_880_620)
    assert out["engine_spec_pos0_acceptance_rate"] == pytest.approx(27941 / 268660)
    assert out["engine_spec_pos6_acceptance_rate"] == pytest.approx(32 / 268660)
    assert "engine_counter_reset" not in out


def test_engine_side_summary_on_sglang_fixture() -> None:
    samples = parse_exposition(SGLANG_TEXT)
    out = engine_side_summary([scrape(0.0, zeroed(samples)), scrape(100.0, samples)], SGLANG)
    assert out["engine_generation_tps"] == 300.0
    assert out["engine_ttft_ms_mean"] == pytest.approx(13264.0)
    assert out["engine_itl_ms_mean"] == pytest.approx(1344.0 / 29990 * 1000)
    assert out["engine_kv_usage_ratio_max"] == 0.72
    assert out["engine_spec_verify_calls"] == 21739.0
    # mean of the gauge over the two scrapes (0 in the zeroed baseline, 1.38 after)
    assert out["engine_spec_accept_length_mean"] == pytest.approx(0.69)
    assert "engine_spec_mean_acceptance_length" not in out  # SGLang exports no draft counters


def test_counters_summed_over_label_sets_and_gauges_maxed() -> None:
    def text(stream: float, plain: float, usage0: float, usage1: float) -> str:
        return (
            f'sglang:generation_tokens_total{{is_streaming="true"}} {stream}\n'
            f'sglang:generation_tokens_total{{is_streaming="false"}} {plain}\n'
            f'sglang:token_usage{{dp_rank="0"}} {usage0}\n'
            f'sglang:token_usage{{dp_rank="1"}} {usage1}\n'
        )

    first = scrape(0.0, parse_exposition(text(100, 10, 0.2, 0.3)))
    middle = scrape(1.0, parse_exposition(text(150, 20, 0.9, 0.1)))
    last = scrape(2.0, parse_exposition(text(300, 30, 0.4, 0.5)))
    out = engine_side_summary([first, middle, last], SGLANG)
    assert out["engine_generation_tokens"] == 220.0
    assert out["engine_generation_tps"] == 110.0
    assert out["engine_kv_usage_ratio_max"] == 0.9


def test_counter_reset_is_flagged_not_subtracted() -> None:
    first = scrape(0.0, {("vllm:generation_tokens_total", TINY): 500.0})
    last = scrape(1.0, {("vllm:generation_tokens_total", TINY): 20.0})
    out = engine_side_summary([first, last], VLLM)
    assert "engine_generation_tokens" not in out
    assert out["engine_counter_reset"] == 1.0


def test_histogram_quantile_edges() -> None:
    assert histogram_quantile(0.5, {}) is None
    assert histogram_quantile(0.5, {1.0: 0.0, math.inf: 0.0}) is None
    # everything beyond the last finite bound: Prometheus answers that bound
    assert histogram_quantile(0.99, {1.0: 1.0, 2.0: 1.0, math.inf: 10.0}) == 2.0
    assert histogram_quantile(0.5, {1.0: 0.0, 2.0: 4.0, math.inf: 4.0}) == 1.5
    with pytest.raises(ValueError, match="q must be"):
        histogram_quantile(1.5, {1.0: 1.0})


def test_bracketing_scrapes() -> None:
    scrapes = [scrape(t, {}) for t in (0.0, 1.0, 2.0)] + [scrape(2.5, {}, error="HTTP 500")]
    scrapes += [scrape(t, {}) for t in (3.0, 4.0, 5.0)]
    window = bracketing_scrapes(scrapes, t_start=1.5, t_end=3.5)
    assert [s.t_perf for s in window] == [1.0, 2.0, 3.0, 4.0]
    assert [s.t_perf for s in bracketing_scrapes(scrapes, -1.0, 9.0)] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert bracketing_scrapes([scrape(0.0, {}, error="x")], 0.0, 1.0) == []


# -- a scripted /metrics server --------------------------------------------------------------------


def render(k: int) -> str:
    """The exposition at the k-th GET: every GET advances the counters by one step.

    Per step: 200 generated and 800 prompt tokens; TTFT observations 0.05 s and 0.15 s (mean 100 ms);
    199 ITL observations of 20 ms; 1 preemption; 10 drafts of 3 tokens with 15 accepted.
    The baselines are non-zero so deltas are tested, not absolute values.
    """
    labels = 'engine="0",model_name="m"'
    kv = [0.1, 0.5, 0.93, 0.3][k % 4]
    ttft = "vllm:time_to_first_token_seconds"
    itl = "vllm:inter_token_latency_seconds"
    return "\n".join(
        [
            "# HELP python_gc_objects_collected_total Objects collected during gc",
            "# TYPE python_gc_objects_collected_total counter",
            f'python_gc_objects_collected_total{{generation="0"}} {k}',
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{{{labels}}} {1000 + 200 * k}",
            f"vllm:generation_tokens_created{{{labels}}} 1.7e9",
            f"vllm:prompt_tokens_total{{{labels}}} {5000 + 800 * k}",
            f"vllm:num_preemptions_total{{{labels}}} {3 + k}",
            f"vllm:kv_cache_usage_perc{{{labels}}} {kv}",
            f"vllm:spec_decode_num_drafts_total{{{labels}}} {100 + 10 * k}",
            f"vllm:spec_decode_num_draft_tokens_total{{{labels}}} {300 + 30 * k}",
            f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} {50 + 15 * k}",
            "# TYPE vllm:time_to_first_token_seconds histogram",
            f'{ttft}_bucket{{engine="0",le="0.1",model_name="m"}} {5 + k}',
            f'{ttft}_bucket{{engine="0",le="0.25",model_name="m"}} {10 + 2 * k}',
            f'{ttft}_bucket{{engine="0",le="+Inf",model_name="m"}} {10 + 2 * k}',
            f"{ttft}_count{{{labels}}} {10 + 2 * k}",
            f"{ttft}_sum{{{labels}}} {1.0 + 0.2 * k}",
            f'{itl}_bucket{{engine="0",le="0.025",model_name="m"}} {50 + 199 * k}',
            f'{itl}_bucket{{engine="0",le="+Inf",model_name="m"}} {50 + 199 * k}',
            f"{itl}_count{{{labels}}} {50 + 199 * k}",
            f"{itl}_sum{{{labels}}} {1.0 + 199 * 0.02 * k}",
            "",
        ]
    )


class ScriptedMetrics:
    """GET /metrics on 127.0.0.1 answers ``render(k)`` for the k-th request, a 500 for k in
    ``fail``, garbage for k in ``garbage``; ``served`` lists the k of every good answer, in order."""

    def __init__(self, fail: frozenset[int] = frozenset(), garbage: frozenset[int] = frozenset()) -> None:
        self.fail, self.garbage = fail, garbage
        self.served: list[int] = []
        self.count = 0
        lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                with lock:
                    k = outer.count
                    outer.count += 1
                if self.path != "/metrics" or k in outer.fail:
                    status, body = (404 if self.path != "/metrics" else 500), b"boom"
                elif k in outer.garbage:
                    status, body = 200, b"<html>not prometheus</html>\n"
                else:
                    status, body = 200, render(k).encode()
                    with lock:
                        outer.served.append(k)
                self.send_response(status)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    def __enter__(self) -> ScriptedMetrics:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


@pytest.fixture
def server() -> Iterator[ScriptedMetrics]:
    with ScriptedMetrics() as s:
        yield s


def run_beside_workload(url: str, interval_s: float, workload_s: float) -> tuple[list[Scrape], float, float]:
    """The benchmark step's shape: the scraper as a task beside an asyncio 'workload'."""

    async def main() -> tuple[list[Scrape], float, float]:
        stop = asyncio.Event()
        scraper = MetricsScraper(VLLM)
        async with httpx.AsyncClient() as client:
            t0 = time.perf_counter()
            task = asyncio.create_task(scraper.run(client, url, interval_s, stop))
            try:
                await asyncio.sleep(workload_s)  # the workload
            finally:
                stop.set()
                t_stop = time.perf_counter()
                scrapes = await task
        return scrapes, t0, t_stop

    return asyncio.run(main())


def test_scraper_runs_beside_a_workload_at_its_interval(server: ScriptedMetrics) -> None:
    interval = 0.05
    scrapes, t0, t_stop = run_beside_workload(server.url, interval, 0.6)
    assert all(s.ok for s in scrapes)
    assert len(scrapes) == len(server.served)
    # ticks at t0 + k x interval (missed ones skipped, never bunched) plus one final scrape after stop
    assert 4 <= len(scrapes) <= (t_stop - t0) / interval + 2
    for k, s in enumerate(scrapes[:-1]):
        assert s.t_perf >= t0 + k * interval - 1e-3
    assert scrapes[-1].t_perf >= t_stop  # the final scrape comes after the workload ended
    assert all(s.t_perf < n.t_perf for s, n in itertools.pairwise(scrapes))
    assert all(abs(s.t_unix - time.time()) < 60 for s in scrapes)
    # only the engine's metric names are kept: no python_gc_*, no *_created
    names = {name for s in scrapes for name, _ in s.samples}
    assert "python_gc_objects_collected_total" not in names
    assert "vllm:generation_tokens_created" not in names
    assert {"vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket"} <= names


def test_engine_side_summary_from_scripted_scrapes(server: ScriptedMetrics) -> None:
    scrapes, _, _ = run_beside_workload(server.url, 0.05, 0.3)
    steps = server.served[-1] - server.served[0]
    assert steps >= 2
    window = scrapes[-1].t_perf - scrapes[0].t_perf
    out = engine_side_summary(scrapes, VLLM)
    assert out["engine_scrapes"] == len(scrapes)
    assert out["engine_window_s"] == window
    assert out["engine_generation_tokens"] == 200 * steps
    assert out["engine_generation_tps"] == pytest.approx(200 * steps / window, rel=1e-12)
    assert out["engine_prompt_tps"] == pytest.approx(800 * steps / window, rel=1e-12)
    assert out["engine_ttft_ms_mean"] == pytest.approx(100.0, rel=1e-9)
    assert out["engine_ttft_ms_p50"] == pytest.approx(100.0, rel=1e-9)  # top of the (0, 0.1] bucket
    assert out["engine_ttft_ms_p90"] == pytest.approx(220.0, rel=1e-9)  # 100 + 150 x 0.8
    assert out["engine_itl_ms_mean"] == pytest.approx(20.0, rel=1e-9)
    assert out["engine_preemptions"] == steps
    assert out["engine_kv_usage_ratio_max"] == max([0.1, 0.5, 0.93, 0.3][k % 4] for k in server.served)
    assert out["engine_spec_mean_acceptance_length"] == pytest.approx(2.5)
    assert out["engine_spec_acceptance_rate"] == pytest.approx(0.5)
    # a fixed window_s replaces the scrapes' own
    assert engine_side_summary(scrapes, VLLM, window_s=2.0)["engine_generation_tps"] == 100 * steps


def test_failed_scrapes_are_recorded_not_raised() -> None:
    with ScriptedMetrics(fail=frozenset({1}), garbage=frozenset({3})) as server:
        scrapes, _, _ = run_beside_workload(server.url, 0.05, 0.4)
    errors = [s.error for s in scrapes]
    assert str(errors[1]).startswith("HTTP 500")
    assert "unparseable exposition" in str(errors[3])
    assert scrapes[1].samples == {}
    assert scrapes[3].samples == {}
    assert sum(e is None for e in errors) == len(server.served)
    out = engine_side_summary(scrapes, VLLM)
    assert out["engine_scrapes_failed"] == 2.0
    # the deltas run between the first and last GOOD scrapes (k = 0 and the last served)
    assert out["engine_generation_tokens"] == 200 * (server.served[-1] - server.served[0])


def test_unreachable_engine_gives_failed_scrapes() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    scrapes, _, _ = run_beside_workload(f"http://127.0.0.1:{port}/metrics", 0.05, 0.15)
    assert len(scrapes) >= 2
    assert all(s.error is not None and "ConnectError" in s.error for s in scrapes)
    out = engine_side_summary(scrapes, VLLM)
    assert out == {"engine_scrapes": 0.0, "engine_scrapes_failed": float(len(scrapes))}


def test_series_frame_long_format(server: ScriptedMetrics) -> None:
    good = scrape(
        100.0, {("vllm:generation_tokens_total", TINY): 5.0, ("vllm:kv_cache_usage_perc", TINY): 0.25}
    )
    bad = scrape(101.5, {}, error="HTTP 500: boom")
    frame = series_frame([good, bad])
    assert list(frame.columns) == ["t_s", "t_unix_s", "metric", "labels", "value", "error"]
    assert len(frame) == 3
    row = frame[frame.metric == "vllm:kv_cache_usage_perc"].iloc[0]
    assert (row.value, row.t_s) == (0.25, 0.0)
    assert json.loads(row.labels) == {"engine": "0", "model_name": "tiny"}
    failed = frame[frame.error.notna()].iloc[0]
    assert failed.t_s == 1.5
    assert math.isnan(failed.value)
    assert pd.isna(failed.metric)
    # and a real scraped series
    scrapes, _, _ = run_beside_workload(server.url, 0.05, 0.1)
    real = series_frame(scrapes)
    assert len(real) == sum(len(s.samples) for s in scrapes)
    assert real.value.dtype == "float64"


# -- reconciliation ------------------------------------------------------------------------------


CLIENT = {"output_tokens_total": 3000.0, "ttft_ms_mean": 120.0, "output_throughput_tps": 100.0}


def test_reconcile_within_tolerance_flags_nothing() -> None:
    engine = {"engine_generation_tokens": 3000.0, "engine_ttft_ms_mean": 110.0, "engine_generation_tps": 91.0}
    assert reconcile(CLIENT, engine) == []


def test_reconcile_flags_beyond_tolerance_naming_both_figures() -> None:
    engine = {
        "engine_generation_tokens": 3400.0,
        "engine_ttft_ms_mean": 115.0,
        "engine_generation_tps": 1111.61,
    }
    found = {d.quantity: d for d in reconcile(CLIENT, engine, tolerance=0.10)}
    assert set(found) == {"output tokens", "output throughput"}
    tokens = found["output tokens"]
    assert tokens.relative_diff == pytest.approx(400 / 3000)
    for text in ("engine_generation_tokens=3400 tokens", "client output_tokens_total=3000", "13.3% above"):
        assert text in tokens.message
    throughput = found["output throughput"]
    for text in ("engine_generation_tps=1111.61 tok/s", "client output_throughput_tps=100 tok/s"):
        assert text in throughput.message
    # a tighter tolerance catches the TTFT gap too (115 vs 120 ms: 4.2% below)
    tight = {d.quantity: d for d in reconcile(CLIENT, engine, tolerance=0.04)}
    assert "below" in tight["mean TTFT"].message


def test_reconcile_skips_missing_and_handles_zero() -> None:
    assert reconcile({"output_tokens_total": 10.0}, {"engine_ttft_ms_mean": 5.0}) == []
    (zero,) = reconcile({"output_tokens_total": 0.0}, {"engine_generation_tokens": 5.0})
    assert zero.relative_diff == math.inf
    assert reconcile({"output_tokens_total": 0.0}, {"engine_generation_tokens": 0.0}) == []
    with pytest.raises(ValueError, match="tolerance"):
        reconcile(CLIENT, {}, tolerance=-1)


def test_prefix_cache_hit_rate_from_each_engines_counters() -> None:
    """vLLM: its hit and query counters (tokens); SGLang: cached over prompt tokens of the finished
    requests, its cached counter absent until something hit (the real 0.5.16 scrape: 24 of 48)."""
    vllm = parse_exposition(VLLM_TEXT)
    out = engine_side_summary([scrape(0.0, zeroed(vllm)), scrape(4.0, vllm)], VLLM)
    assert out["engine_prefix_cache_hit_pct"] == 0.0  # 93 prompt tokens looked up, none found
    later = {
        k: v
        + (
            200.0
            if k[0] == "vllm:prefix_cache_queries_total"
            else 100.0
            if k[0] == "vllm:prefix_cache_hits_total"
            else 0.0
        )
        for k, v in vllm.items()
    }
    assert engine_side_summary([scrape(0.0, vllm), scrape(4.0, later)], VLLM)[
        "engine_prefix_cache_hit_pct"
    ] == pytest.approx(50.0)

    real = parse_exposition((FIXTURES / "sglang" / "real-0.5.16-metrics.txt").read_text())
    before = {k: 0.0 for k in real if k[0] != "sglang:cached_tokens_total"}  # nothing cached yet
    out = engine_side_summary([scrape(0.0, before), scrape(10.0, real)], SGLANG)
    assert out["engine_prefix_cache_hit_pct"] == pytest.approx(50.0)
    # nothing looked up in the window: no rate (not 0%)
    assert "engine_prefix_cache_hit_pct" not in engine_side_summary(
        [scrape(0.0, real), scrape(1.0, real)], SGLANG
    )
