"""Summaries of a workload's records: pure functions, no I/O.

Latency statistics cover measured (non-warm-up) successful requests only. The definitions (also in
docs/measurement.md, and held by tests/unit/bench/test_definitions.py against scripted streams):

- ``ttft_ms``: send -> first token-bearing delta (content, reasoning or tool calls).
- ``content_ttft_ms``: send -> first non-empty ``content``; requests that never reached content
  (reasoning only) are left out, so its ``count`` can be smaller.
- ``e2e_ms``: send -> the last token-bearing chunk (not the usage chunk or ``[DONE]`` after it).
- ``tpot_ms``: ``(e2e - ttft) / (N - k1)`` per request, k1 the tokens of its first chunk and N the
  tokens its token-bearing chunks carried: known from continuous usage, or without it when there
  were as many token-bearing chunks as usage counted tokens (one token each). Undefined when
  ``N <= k1``.
- ``tpot_lower_bound_ms``: the same where k1 is not known (no per-chunk counts, fewer chunks than
  tokens: some chunk carried several), with N usage's count and k1 taken as 1. It can only come out
  low (a first chunk of more tokens leaves fewer after it), so it is not ``tpot_ms`` and is stored
  under its own name (``tpot_k1_assumed`` says some request had it). Undefined for a single chunk.
- ``itl_ms``: per token. Where the server reported each chunk's tokens, each gap between
  token-bearing chunks is divided by the tokens of the chunk that ends it, and counted once per
  token. A request without per-chunk counts contributes its plain per-chunk gaps instead, and
  ``itl_basis`` says so ("per_token", "per_chunk" or "mixed").
- ``chunk_itl_ms``: the plain gaps between token-bearing chunks, always (what most tools call ITL).
- ``ttft_from_scheduled_ms`` / ``e2e_from_scheduled_ms``: the same, measured from the time the
  schedule made the request due (``t_scheduled``) rather than from its send: what a user arriving
  at that time would see. Under the ``concurrency`` load the two are equal (due = sent).

Output tokens come from ``usage``; without it from re-tokenizing the generated text
(``output_tokens_retokenized``); failing that from the token-bearing chunk count, a floor
(``output_tokens_from_chunks``). A request whose stream ends with zero tokens is a failure.

With an SLO (``slo``), a measured request *meets* it when it succeeded and every given threshold
holds (``<=``; a TPOT threshold holds vacuously for a request whose TPOT is undefined): ``goodput_rps``
is the requests that met it per second of the window, ``slo_attainment_pct`` their share of the
measured requests (failed ones count as missed).

``send_lag_ms`` (``t_send - t_scheduled``) covers every measured request sent, failed ones included:
it measures the client, not the server. It grows when a rate-based load outruns its concurrency
cap or the client itself, and then the ``*_from_scheduled`` figures exceed the plain ones.

Bursty delivery (a finding, not a speed): the client stamps every chunk that one socket read
completes with that read's time, so tokens that the server sent apart but that reached the client
together carry no timing of their own. A token is *coalesced* when its chunk came in the same read as
the token-bearing chunk before it (equal stamps); tokens after the first chunk are what TPOT and ITL
time. A request is *bursty* when at least ``BURSTY_REQUEST_SHARE`` (half) of those tokens were
coalesced; a workload's client timing is *bursty* when at least ``BURSTY_WORKLOAD_PCT`` (10%) of its
requests are, or ``BURSTY_TOKENS_PCT`` (25%) of all such tokens were coalesced. Its client TPOT and
ITL then measure delivery, not decoding (on a starved machine vLLM's API server hands over whole
streams at once): they are kept, flagged (``client_timing_bursty``), and the engine's own ITL from
``/metrics`` is the figure to read (see ``timing_note``).

The warm-up (before the window, not measured) is described by its waves (``k3pipe.bench.warmup``):
``warmup`` holds each wave's output rate and whether the last two full waves agreed
(``warmup_steady``). Under load ``concurrency`` the measured phase opens with ``concurrency`` requests
sent at once and nothing in flight: ``ttft_ms_p50_first_wave`` is the TTFT p50 of those first
``concurrency`` measured requests (send order, successful ones), ``ttft_ms_p50_after_first_wave``
that of the rest, and ``first_wave_ttft_ratio`` the first over the second (the opening burst of
prefills, stated; the other figures still cover every measured request).

Throughput is cross-checked against its physical ceiling (field-notes rule 2): a server cannot emit
more than ``max_tokens`` per request, so ``sum(max_tokens) / window`` bounds any honest output
throughput; a figure above it means the token count or the window is wrong.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import pandas as pd
from pydantic import BaseModel, ConfigDict, Field

from k3pipe.bench.client import WorkloadResult
from k3pipe.bench.request_records import RequestRecord
from k3pipe.bench.warmup import WarmupReport
from k3pipe.schema.specs import SLOSpec

__all__ = [
    "BURSTY_REQUEST_SHARE",
    "BURSTY_TOKENS_PCT",
    "BURSTY_WORKLOAD_PCT",
    "LatencyStats",
    "ThroughputCheck",
    "WorkloadSummary",
    "check_throughput",
    "records_frame",
    "retokenize",
    "slo_attainment_from_arrival",
    "summarize",
    "summary_line",
    "timing_note",
    "warmup_note",
]

# Relative slack before a throughput counts as above its ceiling (float noise, rounding of claims).
_BOUND_TOLERANCE = 0.001
CLIENT_CPU_SATURATED = 0.9
"""A client process busier than this share of its wall time queues its own work (stamps run late)."""
CLIENT_LAG_SATURATED_MS = 5.0
"""A client event loop whose 10 ms timer fires later than this at p99 stamps late by as much."""

BURSTY_REQUEST_SHARE = 0.5
"""A request is bursty when at least this share of its tokens after the first chunk were coalesced."""
BURSTY_WORKLOAD_PCT = 10.0
"""A workload's client timing is bursty when at least this % of its timed requests are bursty ..."""
BURSTY_TOKENS_PCT = 25.0
"""... or at least this % of all its tokens after the first chunk were coalesced."""


class LatencyStats(BaseModel):
    """Mean and percentiles of one latency, in the unit its name carries.

    Percentiles are ``numpy.percentile`` with its default method, ``"linear"``: the value at rank
    ``p/100 * (n - 1)`` of the sorted sample, interpolated linearly between neighbours.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    count: int = Field(description="Values the statistics are computed from.")
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> LatencyStats | None:
        """Statistics of ``values``; None when there are none."""
        if not values:
            return None
        arr = np.asarray(values, dtype=float)
        p50, p90, p99 = np.percentile(arr, [50, 90, 99])
        return cls(count=arr.size, mean=float(arr.mean()), p50=float(p50), p90=float(p90), p99=float(p99))


class ThroughputCheck(BaseModel):
    """A throughput figure against the physical ceiling ``total_tokens / wall_s``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    claimed_tps: float = Field(description="The throughput figure being checked.")
    ceiling_tps: float = Field(description="Most tokens per second the run could have produced.")
    ratio: float = Field(description="claimed / ceiling (above 1 is impossible).")
    exceeds: bool = Field(description="The claim is above the ceiling (beyond 0.1% slack).")


class WorkloadSummary(BaseModel):
    """Counts, throughput and latency statistics of the measured requests of one workload."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    workload: str
    requests: int = Field(description="Measured requests sent.")
    completed: int = Field(description="Measured requests that succeeded.")
    failed: int = Field(description="Measured requests that failed.")
    warmup_requests: int = Field(description="Warm-up requests sent before the window (not measured).")
    warmup: WarmupReport | None = Field(
        default=None,
        description=(
            "The warm-up's waves, their output rates and whether it ended steady (k3pipe.bench.warmup)."
        ),
    )
    duration_s: float = Field(description="Measured window: first measured send to last measured end.")
    request_throughput_rps: float | None = Field(description="completed / duration_s.")
    input_tokens_total: int = Field(description="Client-side prompt tokens of completed requests.")
    server_input_tokens_total: int | None = Field(
        description=(
            "usage.prompt_tokens of completed requests (chat template included); None if any lacked it."
        )
    )
    output_tokens_total: int = Field(description="Output tokens of completed requests (usage).")
    output_tokens_from_chunks: bool = Field(
        description="Some request had no usage: its tokens were counted as token-bearing chunks (a floor)."
    )
    output_tokens_retokenized: bool = Field(
        default=False,
        description="Some request had no usage: its tokens were counted by re-tokenizing its text.",
    )
    output_throughput_tps: float | None = Field(description="output_tokens_total / duration_s.")
    output_throughput_bound_tps: float | None = Field(
        description="Physical ceiling: sum of max_tokens of completed requests / duration_s."
    )
    throughput_exceeds_bound: bool = Field(description="output_throughput_tps above its ceiling.")
    ttft_ms: LatencyStats | None = Field(description="Time to first token-bearing delta.")
    ttft_ms_p50_first_wave: float | None = Field(
        default=None,
        description=(
            "Load 'concurrency': TTFT p50 of the measured phase's opening wave (its first concurrency "
            "requests in send order, sent at once with nothing in flight), successful ones."
        ),
    )
    ttft_ms_p50_after_first_wave: float | None = Field(
        default=None, description="Load 'concurrency': TTFT p50 of the successful measured requests after it."
    )
    first_wave_ttft_ratio: float | None = Field(
        default=None, description="ttft_ms_p50_first_wave / ttft_ms_p50_after_first_wave."
    )
    content_ttft_ms: LatencyStats | None = Field(description="Time to first non-empty content.")
    tpot_ms: LatencyStats | None = Field(
        description="Time per output token after the first chunk, of the requests whose first chunk's "
        "tokens are known."
    )
    tpot_lower_bound_ms: LatencyStats | None = Field(
        default=None,
        description="The same of the requests whose first chunk's tokens are not known, taken as 1: "
        "a lower bound, never mixed into tpot_ms.",
    )
    tpot_k1_assumed: bool = Field(
        default=False,
        description="Some request's first-chunk token count was unknown: its TPOT is in "
        "tpot_lower_bound_ms, not tpot_ms.",
    )
    itl_ms: LatencyStats | None = Field(description="Inter-token latency, per token (see itl_basis).")
    itl_basis: str | None = Field(
        default=None,
        description="'per_token' (every request had per-chunk counts), 'per_chunk' (none) or 'mixed'.",
    )
    chunk_itl_ms: LatencyStats | None = Field(
        default=None, description="Gaps between token-bearing chunks, pooled (per chunk)."
    )
    e2e_ms: LatencyStats | None = Field(description="Send to the last token-bearing chunk.")
    coalesced_tokens_pct: float | None = Field(
        default=None,
        description=(
            "Of the tokens after each request's first chunk, the % that came in the same socket read "
            "as the token-bearing chunk before them (no timing of their own)."
        ),
    )
    bursty_requests: int = Field(
        default=0, description="Timed requests with at least half their tokens after the first coalesced."
    )
    bursty_requests_pct: float | None = Field(
        default=None, description="bursty_requests / requests with tokens after their first chunk, in %."
    )
    client_timing_bursty: bool = Field(
        default=False,
        description=(
            "Delivery was bursty (see the module's rule): the client's TPOT and ITL measure delivery, "
            "not decoding; read the engine's ITL instead."
        ),
    )
    send_lag_ms: LatencyStats | None = Field(
        description="Scheduled time to send, over all measured requests sent (the client falling behind)."
    )
    ttft_from_scheduled_ms: LatencyStats | None = Field(
        description="Scheduled time to first token-bearing delta (TTFT plus send lag)."
    )
    e2e_from_scheduled_ms: LatencyStats | None = Field(
        description="Scheduled time to end of stream (E2E plus send lag)."
    )
    stopped_by_duration: bool = Field(
        description="The workload's duration_s ran out before all its planned measured requests were sent."
    )
    slo: SLOSpec | None = Field(default=None, description="The objectives goodput is counted against.")
    slo_met: int | None = Field(default=None, description="Measured requests that met every objective.")
    goodput_rps: float | None = Field(default=None, description="slo_met / duration_s.")
    slo_attainment_pct: float | None = Field(
        default=None, description="slo_met / measured requests, in percent (failed ones count as missed)."
    )
    slo_attainment_by_objective_pct: dict[str, float] = Field(
        default_factory=dict,
        description="Per objective (ttft_ms, tpot_ms, e2e_ms): share of measured requests within it.",
    )
    errors: dict[str, int] = Field(description="Failed measured requests by error text.")
    client_processes: int = Field(default=1, description="Client processes that sent the workload.")
    client_cpu_max_pct: float | None = Field(
        default=None, description="The busiest client process's CPU time / its measured wall time, in %."
    )
    client_cpu_per_event_us: float | None = Field(
        default=None, description="Client CPU time per stamped stream line, microseconds, all processes."
    )
    client_loop_lag_ms_p99: float | None = Field(
        default=None, description="The worst process's p99 lateness of a 10 ms event-loop timer."
    )
    client_saturated: bool = Field(
        default=False,
        description=(
            f"A client process was saturated (CPU above {CLIENT_CPU_SATURATED:.0%} of its wall time, or "
            f"its loop's p99 lag above {CLIENT_LAG_SATURATED_MS:g} ms): its stamps hold its own "
            "queueing; give it more processes (client.processes) or CPUs (client.cpus)."
        ),
    )

    def metrics(self) -> dict[str, float]:
        """A flat dict of numbers with unit-suffixed names (e.g. ``ttft_ms_p99``), Nones left out."""
        out: dict[str, float] = {
            "requests": float(self.requests),
            "completed": float(self.completed),
            "failed": float(self.failed),
            "warmup_requests": float(self.warmup_requests),
            "duration_s": self.duration_s,
            "input_tokens_total": float(self.input_tokens_total),
            "output_tokens_total": float(self.output_tokens_total),
            "output_tokens_from_chunks": float(self.output_tokens_from_chunks),
            "output_tokens_retokenized": float(self.output_tokens_retokenized),
            "tpot_k1_assumed": float(self.tpot_k1_assumed),
            "throughput_exceeds_bound": float(self.throughput_exceeds_bound),
            "stopped_by_duration": float(self.stopped_by_duration),
            "bursty_requests": float(self.bursty_requests),
            "client_timing_bursty": float(self.client_timing_bursty),
            "client_processes": float(self.client_processes),
            "client_saturated": float(self.client_saturated),
        }
        optional = {
            "request_throughput_rps": self.request_throughput_rps,
            "output_throughput_tps": self.output_throughput_tps,
            "output_throughput_bound_tps": self.output_throughput_bound_tps,
            "server_input_tokens_total": self.server_input_tokens_total,
            "slo_met": self.slo_met,
            "goodput_rps": self.goodput_rps,
            "slo_attainment_pct": self.slo_attainment_pct,
            "coalesced_tokens_pct": self.coalesced_tokens_pct,
            "bursty_requests_pct": self.bursty_requests_pct,
            "itl_per_token": None if self.itl_basis is None else float(self.itl_basis == "per_token"),
            "client_cpu_max_pct": self.client_cpu_max_pct,
            "client_cpu_per_event_us": self.client_cpu_per_event_us,
            "client_loop_lag_ms_p99": self.client_loop_lag_ms_p99,
            "ttft_ms_p50_first_wave": self.ttft_ms_p50_first_wave,
            "ttft_ms_p50_after_first_wave": self.ttft_ms_p50_after_first_wave,
            "first_wave_ttft_ratio": self.first_wave_ttft_ratio,
            **_warmup_metrics(self.warmup),
        }
        optional.update(
            {f"slo_{k}_attainment_pct": v for k, v in self.slo_attainment_by_objective_pct.items()}
        )
        out.update({k: float(v) for k, v in optional.items() if v is not None})
        for name in _LATENCIES:
            stats: LatencyStats | None = getattr(self, name)
            if stats is not None:
                out.update(
                    {
                        f"{name}_mean": stats.mean,
                        f"{name}_p50": stats.p50,
                        f"{name}_p90": stats.p90,
                        f"{name}_p99": stats.p99,
                    }
                )
        return out


def _warmup_metrics(report: WarmupReport | None) -> dict[str, float | None]:
    """``warmup_waves``, ``warmup_steady`` (1/0), ``warmup_last_change_pct`` and
    ``warmup_last_wave_tps`` (the last full wave's output rate); none without a warm-up."""
    if report is None or not report.waves:
        return {}
    full = [w for w in report.waves if w.requests == report.concurrency]
    return {
        "warmup_waves": float(len(report.waves)),
        "warmup_steady": None if report.steady is None else float(report.steady),
        "warmup_last_change_pct": report.last_change_pct,
        "warmup_last_wave_tps": full[-1].output_tps if full else None,
    }


def _first_wave(measured: Sequence[RequestRecord], size: int | None) -> tuple[float | None, float | None]:
    """TTFT p50 (ms) of the successful requests among the first ``size`` measured ones in send
    order, and of the successful ones after them; None where there are none (or ``size`` is None)."""
    if size is None:
        return None, None
    order = sorted(measured, key=lambda r: (r.t_send, r.index))

    def p50(records: Sequence[RequestRecord]) -> float | None:
        values = _present(_ttft_ms(r) for r in records if r.ok)
        return float(np.percentile(values, 50)) if values else None

    return p50(order[:size]), p50(order[size:])


def summarize(result: WorkloadResult, slo: SLOSpec | None = None) -> WorkloadSummary:
    """Summarize the measured requests of ``result`` (warm-up and failed requests excluded), with
    goodput and attainment against ``slo`` when given."""
    measured = [r for r in result.records if not r.warmup]
    ok = [r for r in measured if r.ok]
    duration_s = result.t_end - result.t_start
    counted = [_output_tokens(r) for r in ok]
    output_total = sum(n for n, _ in counted)
    per_token = [r.chunk_tokens is not None for r in ok]
    met = _slo_met(ok, slo) if slo is not None else None
    bound_total = sum(r.max_tokens for r in ok)
    output_tps = output_total / duration_s if duration_s > 0 else None
    bound_tps = bound_total / duration_s if duration_s > 0 else None
    usage_inputs = [r.usage_prompt_tokens for r in ok]
    burst = _burstiness(ok)
    first_wave, after_first_wave = _first_wave(measured, result.opening_wave)
    return WorkloadSummary(
        workload=result.workload,
        requests=len(measured),
        completed=len(ok),
        failed=len(measured) - len(ok),
        warmup_requests=len(result.records) - len(measured),
        warmup=result.warmup,
        duration_s=duration_s,
        request_throughput_rps=len(ok) / duration_s if duration_s > 0 else None,
        input_tokens_total=sum(r.prompt_tokens for r in ok),
        server_input_tokens_total=(
            sum(n for n in usage_inputs if n is not None)
            if ok and all(n is not None for n in usage_inputs)
            else None
        ),
        output_tokens_total=output_total,
        output_tokens_from_chunks=any(how == "chunks" for _, how in counted),
        output_tokens_retokenized=any(how == "retokenized" for _, how in counted),
        output_throughput_tps=output_tps,
        output_throughput_bound_tps=bound_tps,
        throughput_exceeds_bound=(
            output_tps is not None
            and bound_tps is not None
            and output_tps > bound_tps * (1 + _BOUND_TOLERANCE)
        ),
        ttft_ms=LatencyStats.of(_present(_ttft_ms(r) for r in ok)),
        ttft_ms_p50_first_wave=first_wave,
        ttft_ms_p50_after_first_wave=after_first_wave,
        first_wave_ttft_ratio=(
            first_wave / after_first_wave if first_wave is not None and after_first_wave else None
        ),
        content_ttft_ms=LatencyStats.of(_present(_content_ttft_ms(r) for r in ok)),
        tpot_ms=LatencyStats.of(_present(_tpot_ms(r) for r in ok)),
        tpot_lower_bound_ms=LatencyStats.of(_present(_tpot_lower_bound_ms(r) for r in ok)),
        tpot_k1_assumed=any(_tpot_lower_bound_ms(r) is not None for r in ok),
        itl_ms=LatencyStats.of([gap for r in ok for gap in _itl_ms(r)]),
        itl_basis=(
            None
            if not ok
            else "per_token"
            if all(per_token)
            else "per_chunk"
            if not any(per_token)
            else "mixed"
        ),
        chunk_itl_ms=LatencyStats.of([gap for r in ok for gap in _chunk_itl_ms(r)]),
        e2e_ms=LatencyStats.of(_present(_e2e_ms(r) for r in ok)),
        coalesced_tokens_pct=burst.coalesced_tokens_pct,
        bursty_requests=burst.bursty_requests,
        bursty_requests_pct=burst.bursty_requests_pct,
        client_timing_bursty=burst.bursty,
        send_lag_ms=LatencyStats.of([_send_lag_ms(r) for r in measured]),
        ttft_from_scheduled_ms=LatencyStats.of(_present(_ttft_from_scheduled_ms(r) for r in ok)),
        e2e_from_scheduled_ms=LatencyStats.of(_present(_e2e_from_scheduled_ms(r) for r in ok)),
        stopped_by_duration=result.stopped_by_duration,
        slo=slo,
        slo_met=None if met is None else met[0],
        goodput_rps=None if met is None or duration_s <= 0 else met[0] / duration_s,
        slo_attainment_pct=None if met is None or not measured else 100.0 * met[0] / len(measured),
        slo_attainment_by_objective_pct=(
            {} if met is None or not measured else {k: 100.0 * n / len(measured) for k, n in met[1].items()}
        ),
        errors=dict(Counter(r.error for r in measured if r.error is not None)),
        **_client_load(result),
    )


def _client_load(result: WorkloadResult) -> dict[str, Any]:
    """The summary's client_* fields from the processes' ClientLoad."""
    load = result.client_load
    if not load:
        return {}
    util = max(c.cpu_util for c in load)
    lag = max(c.loop_lag_ms_p99 for c in load)
    events = sum(c.events for c in load)
    return {
        "client_processes": len(load),
        "client_cpu_max_pct": util * 100.0,
        "client_cpu_per_event_us": sum(c.cpu_s for c in load) / events * 1e6 if events else None,
        "client_loop_lag_ms_p99": lag,
        "client_saturated": util > CLIENT_CPU_SATURATED or lag > CLIENT_LAG_SATURATED_MS,
    }


def client_note(metrics: Mapping[str, float]) -> str | None:
    """What to say when a client process was saturated while it measured (None: it was not)."""
    if not metrics.get("client_saturated"):
        return None
    util, lag = metrics.get("client_cpu_max_pct"), metrics.get("client_loop_lag_ms_p99")
    n = int(metrics.get("client_processes") or 1)
    return (
        f"the client was saturated ({n} process{'es' if n > 1 else ''}; busiest at "
        f"{_pct(util)} CPU, event-loop lag p99 "
        f"{'?' if lag is None else f'{lag:.1f}'} ms): its TTFT/ITL include its own queueing; run it "
        "with more client processes (client.processes) or more CPUs (client.cpus)"
    )


def retokenize(result: WorkloadResult, count_tokens: Callable[[str], int]) -> WorkloadResult:
    """Count the output tokens of requests the server sent no usage for, from their kept text.

    ``count_tokens(text)`` is the model's tokenizer (no special tokens added). Records with usage,
    or without kept text, are unchanged; the summary flags the workload ``output_tokens_retokenized``.
    """
    if not any(r.usage_output_tokens is None and r.output_text for r in result.records):
        return result
    records = [
        r.model_copy(update={"retokenized_output_tokens": count_tokens(r.output_text)})
        if r.usage_output_tokens is None and r.output_text
        else r
        for r in result.records
    ]
    return result.model_copy(update={"records": records})


def check_throughput(claimed_tps: float, total_tokens: float, wall_s: float) -> ThroughputCheck:
    """Check a throughput figure (engine-reported, a tool's, a paper's) against tokens / wall time.

    ``total_tokens`` is the most tokens the run could have produced (e.g. requests x max_tokens) and
    ``wall_s`` its wall time. The study's case: 1111.61 tok/s claimed for 10 x 3000 tokens in 295.21 s,
    whose ceiling is 101.6 tok/s, so the claim exceeds it about 11x.
    """
    if wall_s <= 0:
        raise ValueError(f"wall_s must be > 0, got {wall_s}")
    ceiling = total_tokens / wall_s
    ratio = claimed_tps / ceiling if ceiling > 0 else float("inf")
    return ThroughputCheck(
        claimed_tps=claimed_tps,
        ceiling_tps=ceiling,
        ratio=ratio,
        exceeds=claimed_tps > ceiling * (1 + _BOUND_TOLERANCE),
    )


def timing_note(metrics: Mapping[str, float]) -> str | None:
    """What to say instead of the client's TPOT/ITL when its timing is not about decoding.

    ``metrics`` is a workload's flat metrics (``WorkloadSummary.metrics()`` plus the engine's
    ``engine_*`` figures, as the flow keeps them). None when the client's timing stands.
    """
    if not metrics.get("client_timing_bursty"):
        return None
    pct = metrics.get("bursty_requests_pct")
    coalesced = metrics.get("coalesced_tokens_pct")
    note = (
        f"bursty delivery: {_pct(pct)} of requests got most of their tokens in the same read as the token "
        f"before ({_pct(coalesced)} of tokens), so the client's TPOT and ITL time delivery, not decoding"
    )
    engine = metrics.get("engine_itl_ms_p50")
    if engine is None:
        engine = metrics.get("engine_itl_ms_mean")
        label = "mean"
    else:
        label = "p50"
    if engine is not None:
        return f"{note}; the engine's ITL {label} is {engine:.2f} ms (engine_itl_ms_{label})"
    return f"{note}; the engine reported no ITL (no /metrics): no decode speed was measured"


def summary_line(workload: str, metrics: Mapping[str, float], itl_basis: str | None) -> str:
    """One line for a log: a workload's key figures, with no number standing for one it did not see.

    A missing figure reads ``n/a``; with bursty delivery the client's TPOT and ITL read ``bursty``
    (with the engine's ITL beside them when it reported one) instead of the near-zero they would show.
    """
    bursty = bool(metrics.get("client_timing_bursty"))

    def ms(name: str, digits: int) -> str:
        value = metrics.get(name)
        return "n/a" if value is None else f"{value:.{digits}f} ms"

    engine_itl = metrics.get("engine_itl_ms_p50")
    if bursty:
        tpot = "bursty"
        itl = "bursty" + ("" if engine_itl is None else f" (engine {engine_itl:.2f} ms)")
    else:
        tpot = ms("tpot_ms_p50", 2)
        if metrics.get("tpot_ms_p50") is None and metrics.get("tpot_lower_bound_ms_p50") is not None:
            # no request's first chunk was known: only the lower bound exists, and says so
            tpot = f">= {metrics['tpot_lower_bound_ms_p50']:.2f} ms (k1 unknown: a lower bound)"
        itl = f"{ms('itl_ms_p50', 2)} ({itl_basis or 'no ITL'})"
    output = metrics.get("output_throughput_tps")
    parts = [
        f"ttft p50 {ms('ttft_ms_p50', 1)}",
        f"tpot p50 {tpot}",
        f"itl p50 {itl}",
        "output n/a" if output is None else f"output {output:.1f} tok/s",
        f"{int(metrics.get('failed') or 0)} failed",
    ]
    if metrics.get("slo_attainment_pct") is not None:
        parts.append(f"SLO attainment {metrics['slo_attainment_pct']:.1f}%")
    if metrics.get("first_wave_ttft_ratio") is not None:
        parts.append(f"first wave ttft p50 x{metrics['first_wave_ttft_ratio']:.2f} the rest's")
    warmup = _warmup_words(metrics)
    if warmup:
        parts.append(warmup)
    if metrics.get("client_saturated"):
        parts.append("CLIENT SATURATED")
    return f"{workload}: " + ", ".join(parts)


def warmup_note(metrics: Mapping[str, float], mode: str = "steady") -> str | None:
    """What to say when a workload's warm-up ended with its rate still changing (``warmup_steady``
    0), so that the first measured requests may still be warming the engine; None otherwise.
    ``mode`` is the workload's ``warmup`` setting (the advice differs)."""
    if metrics.get("warmup_steady") != 0.0:
        return None
    change = metrics.get("warmup_last_change_pct")
    sent = int(metrics.get("warmup_requests") or 0)
    what = "its last wave's output rate changed by " + ("?" if change is None else f"{change:+.1f}%")
    advice = (
        "raise warmup_requests (the most a steady warm-up sends)"
        if mode == "steady"
        else "set warmup: steady (warmup_requests then is the most it sends)"
    )
    return (
        f"the warm-up ({sent} requests) did not reach a steady rate: {what}, beyond "
        f"warmup_tolerance_pct; the first measured requests may still be warming the engine: {advice}"
    )


def _warmup_words(metrics: Mapping[str, float]) -> str | None:
    """``warm-up 48 requests (6 waves): steady, last wave +1.2%`` (or ``NOT steady``); None when the
    warm-up had fewer than two full waves to judge (a short fixed one, or none)."""
    steady = metrics.get("warmup_steady")
    if steady is None:
        return None
    sent, waves = int(metrics.get("warmup_requests") or 0), int(metrics.get("warmup_waves") or 0)
    change = metrics.get("warmup_last_change_pct")
    last = "" if change is None else f", last wave {change:+.1f}%"
    return f"warm-up {sent} requests ({waves} waves): {'steady' if steady else 'NOT steady'}{last}"


def _pct(value: float | None) -> str:
    return "?" if value is None else f"{value:.0f}%"


class _Burstiness(NamedTuple):
    coalesced_tokens_pct: float | None
    bursty_requests: int
    bursty_requests_pct: float | None
    bursty: bool


def _burstiness(ok: Sequence[RequestRecord]) -> _Burstiness:
    timed = coalesced_total = bursty = requests = 0
    for r in ok:
        coalesced, after_first = _coalesced_tokens(r)
        if after_first <= 0:
            continue
        requests += 1
        timed += after_first
        coalesced_total += coalesced
        bursty += coalesced >= BURSTY_REQUEST_SHARE * after_first
    if not requests:
        return _Burstiness(None, 0, None, False)
    tokens_pct = 100.0 * coalesced_total / timed
    requests_pct = 100.0 * bursty / requests
    flagged = requests_pct >= BURSTY_WORKLOAD_PCT or tokens_pct >= BURSTY_TOKENS_PCT
    return _Burstiness(tokens_pct, bursty, requests_pct, flagged)


def _coalesced_tokens(r: RequestRecord) -> tuple[int, int]:
    """(tokens that came in the same read as the token-bearing chunk before them, tokens after the
    first token-bearing chunk). Without per-chunk counts every token-bearing chunk counts as one."""
    counts = r.chunk_tokens if r.chunk_tokens is not None else [1] * len(r.chunk_times)
    coalesced = after_first = 0
    last: float | None = None
    for t, k in zip(r.chunk_times, counts, strict=True):
        if k <= 0:
            continue
        if last is not None:
            after_first += k
            coalesced += k if t == last else 0
        last = t
    return coalesced, after_first


def records_frame(result: WorkloadResult) -> pd.DataFrame:
    """One row per request (warm-up included, flagged), for saving as parquet.

    Stamps become seconds relative to ``result.t_start`` (``*_s`` columns; warm-up stamps are
    negative); derived per-request latencies are in ms; ``chunk_times_s`` is a JSON list of relative
    arrival times.
    """
    t0 = result.t_start
    rows = []
    for r in result.records:
        tokens, source = _output_tokens(r)
        rows.append(
            {
                "index": r.index,
                "warmup": r.warmup,
                "ok": r.ok,
                "error": r.error,
                "status_code": r.status_code,
                "finish_reason": r.finish_reason,
                "saw_done": r.saw_done,
                "prompt_tokens": r.prompt_tokens,
                "max_tokens": r.max_tokens,
                "usage_prompt_tokens": r.usage_prompt_tokens,
                "usage_output_tokens": r.usage_output_tokens,
                "output_tokens": tokens,
                "output_tokens_source": source,
                "chunks": len(r.chunk_times),
                "coalesced_tokens": _coalesced_tokens(r)[0],
                "first_chunk_tokens": r.chunk_tokens[0] if r.chunk_tokens else None,
                "t_scheduled_s": r.t_scheduled - t0,
                "t_send_s": r.t_send - t0,
                "t_first_delta_s": _minus(r.t_first_delta, t0),
                "t_first_content_s": _minus(r.t_first_content, t0),
                "t_end_s": r.t_end - t0,
                "ttft_ms": _ttft_ms(r),
                "content_ttft_ms": _content_ttft_ms(r),
                "tpot_ms": _tpot_ms(r),
                "tpot_lower_bound_ms": _tpot_lower_bound_ms(r),
                "e2e_ms": _e2e_ms(r),
                "send_lag_ms": _send_lag_ms(r),
                "ttft_from_scheduled_ms": _ttft_from_scheduled_ms(r),
                "e2e_from_scheduled_ms": _e2e_from_scheduled_ms(r),
                "chunk_times_s": json.dumps([t - t0 for t in r.chunk_times]),
                "chunk_tokens": None if r.chunk_tokens is None else json.dumps(r.chunk_tokens),
            }
        )
    frame = pd.DataFrame(rows, columns=_COLUMNS)
    for column in ("status_code", "usage_prompt_tokens", "usage_output_tokens", "first_chunk_tokens"):
        frame[column] = frame[column].astype("Int64")
    for column in (
        "t_first_delta_s",
        "t_first_content_s",
        "ttft_ms",
        "content_ttft_ms",
        "tpot_ms",
        "tpot_lower_bound_ms",
        "ttft_from_scheduled_ms",
        "e2e_ms",
        "e2e_from_scheduled_ms",
    ):
        frame[column] = frame[column].astype("float64")
    return frame


_COLUMNS = [
    "index",
    "warmup",
    "ok",
    "error",
    "status_code",
    "finish_reason",
    "saw_done",
    "prompt_tokens",
    "max_tokens",
    "usage_prompt_tokens",
    "usage_output_tokens",
    "output_tokens",
    "output_tokens_source",
    "chunks",
    "coalesced_tokens",
    "first_chunk_tokens",
    "t_scheduled_s",
    "t_send_s",
    "t_first_delta_s",
    "t_first_content_s",
    "t_end_s",
    "ttft_ms",
    "content_ttft_ms",
    "tpot_ms",
    "tpot_lower_bound_ms",
    "e2e_ms",
    "send_lag_ms",
    "ttft_from_scheduled_ms",
    "e2e_from_scheduled_ms",
    "chunk_times_s",
    "chunk_tokens",
]

_LATENCIES = (
    "ttft_ms",
    "content_ttft_ms",
    "tpot_ms",
    "tpot_lower_bound_ms",
    "itl_ms",
    "chunk_itl_ms",
    "e2e_ms",
    "send_lag_ms",
    "ttft_from_scheduled_ms",
    "e2e_from_scheduled_ms",
)


# Per-request derivations: None when the data is missing.


def _output_tokens(r: RequestRecord) -> tuple[int, str]:
    """Output tokens and where they came from: usage, else re-tokenized text, else the chunk count."""
    if r.usage_output_tokens is not None:
        return r.usage_output_tokens, "usage"
    if r.retokenized_output_tokens is not None:
        return r.retokenized_output_tokens, "retokenized"
    return len(r.chunk_times), "chunks"


def _since(t: float | None, t0: float) -> float | None:
    return None if t is None else (t - t0) * 1000.0


def _last_token(r: RequestRecord) -> float | None:
    return r.chunk_times[-1] if r.chunk_times else None


def _ttft_ms(r: RequestRecord) -> float | None:
    return _since(r.t_first_delta, r.t_send)


def _content_ttft_ms(r: RequestRecord) -> float | None:
    return _since(r.t_first_content, r.t_send)


def _e2e_ms(r: RequestRecord) -> float | None:
    return _since(_last_token(r), r.t_send)


def _send_lag_ms(r: RequestRecord) -> float:
    return (r.t_send - r.t_scheduled) * 1000.0


def _ttft_from_scheduled_ms(r: RequestRecord) -> float | None:
    return _since(r.t_first_delta, r.t_scheduled)


def _e2e_from_scheduled_ms(r: RequestRecord) -> float | None:
    return _since(_last_token(r), r.t_scheduled)


def _k1_known(r: RequestRecord) -> bool:
    """Whether the tokens of ``r``'s first chunk are known: from per-chunk counts, or because its
    token-bearing chunks were as many as its output tokens (one token each)."""
    return bool(r.chunk_tokens) or (len(r.chunk_times) > 0 and len(r.chunk_times) == _output_tokens(r)[0])


def _tpot_ms(r: RequestRecord) -> float | None:
    """(E2E - TTFT) / (N - k1): the time per token of everything after the first chunk, where k1 is
    known (:func:`_k1_known`; else None: see :func:`_tpot_lower_bound_ms`).

    With per-chunk counts, N is the tokens the token-bearing chunks carried: a token the server
    counted in usage but sent without text after the last of them (vLLM's EOS in an empty finish
    chunk) has no arrival time inside E2E, so it is not in N either.
    """
    return _tpot_assuming_k1(r) if _k1_known(r) else None


def _tpot_lower_bound_ms(r: RequestRecord) -> float | None:
    """TPOT with N usage's count and k1 taken as 1, for a request whose k1 is not known: a lower
    bound (a first chunk of k1 > 1 tokens leaves N - k1 < N - 1 after it). None where k1 is known."""
    return None if _k1_known(r) else _tpot_assuming_k1(r)


def _tpot_any_ms(r: RequestRecord) -> float | None:
    """The request's TPOT, or its lower bound where k1 is not known (the SLO's per-request check)."""
    return _tpot_assuming_k1(r)


def _tpot_assuming_k1(r: RequestRecord) -> float | None:
    """(E2E - TTFT) / (N - k1) with the per-chunk counts where there are some, else with N usage's
    count and k1 = 1 (exact when every chunk carried one token); a single token-bearing chunk without
    counts has no TPOT (no time after it)."""
    if r.t_first_delta is None or not r.chunk_times:
        return None
    if r.chunk_tokens:
        k1, tokens = r.chunk_tokens[0], sum(r.chunk_tokens)
    elif len(r.chunk_times) < 2:
        return None
    else:
        k1, tokens = 1, _output_tokens(r)[0]
    if tokens <= k1:
        return None
    return (r.chunk_times[-1] - r.t_first_delta) * 1000.0 / (tokens - k1)


def _chunk_itl_ms(r: RequestRecord) -> list[float]:
    itl: list[float] = (np.diff(np.asarray(r.chunk_times, dtype=float)) * 1000.0).tolist()
    return itl


def _itl_ms(r: RequestRecord) -> list[float]:
    """Per-token gaps when the chunks' token counts are known, else the per-chunk gaps.

    A gap ending at a chunk of k tokens gives k values of gap / k. A chunk that carried text but no
    new token (k = 0) adds its time to the next chunk that does carry tokens.
    """
    if r.chunk_tokens is None:
        return _chunk_itl_ms(r)
    out: list[float] = []
    last = None
    for t, k in zip(r.chunk_times, r.chunk_tokens, strict=True):
        if k <= 0:
            continue
        if last is not None:
            out.extend([(t - last) * 1000.0 / k] * k)
        last = t
    return out


def slo_attainment_from_arrival(
    records: Sequence[RequestRecord], slo: SLOSpec
) -> tuple[float, dict[str, float]]:
    """The share of measured requests (in %) that met every objective, and per objective, with TTFT
    and E2E counted from each request's scheduled arrival, not its send: a request the client held
    back (its in-flight cap reached) waited as its user would. Failed requests count as missed.
    (100, {}) when nothing was measured."""
    measured = [r for r in records if not r.warmup]
    if not measured:
        return 100.0, {}
    met, within = _slo_met([r for r in measured if r.ok], slo, from_arrival=True)
    n = len(measured)
    return 100.0 * met / n, {k: 100.0 * v / n for k, v in within.items()}


def _slo_met(ok: list[RequestRecord], slo: SLOSpec, from_arrival: bool = False) -> tuple[int, dict[str, int]]:
    """Successful requests meeting every objective, and per objective those within it."""
    limits = {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms, "e2e_ms": slo.e2e_ms}
    # a request whose k1 is unknown is judged on its TPOT's lower bound (the SLO, not a stored figure)
    measure = {"ttft_ms": _ttft_ms, "tpot_ms": _tpot_any_ms, "e2e_ms": _e2e_ms}
    if from_arrival:
        measure |= {"ttft_ms": _ttft_from_scheduled_ms, "e2e_ms": _e2e_from_scheduled_ms}
    within = {k: 0 for k, v in limits.items() if v is not None}
    all_met = 0
    for r in ok:
        verdicts = []
        for k in within:
            value, limit = measure[k](r), limits[k]
            # an undefined TPOT (every token in the first chunk) has nothing after it to be slow
            good = k == "tpot_ms" if value is None or limit is None else value <= limit
            within[k] += good
            verdicts.append(good)
        all_met += all(verdicts)
    return all_met, within


def _present(values: Iterable[float | None]) -> list[float]:
    return [v for v in values if v is not None]


def _minus(t: float | None, t0: float) -> float | None:
    return None if t is None else t - t0
