"""The figures a report ranks arms on: each one's key (the summary metric's name in MLflow), label,
unit and direction. The report's table shows :data:`TABLE_FIGURES`; an experiment's decision
(``decision.metrics``) may name any figure of :data:`FIGURES`; :data:`DEFAULT_DECISION` is what it
rests on when it names none."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CAPACITY_FIGURES", "DEFAULT_DECISION", "FIGURES", "TABLE_FIGURES", "Figure", "figure", "tails_of"]


@dataclass(frozen=True)
class Figure:
    key: str
    label: str
    unit: str
    higher_is_better: bool
    throughput: bool = False
    resolution: str | None = None
    """The metric holding each value's bracket (the log-width of the loads between its last passing
    and its first failing one: :attr:`k3pipe.verdicts.capacity.CapacityResult.width`), for a figure a search
    found: the value is the bracket's lower end, and its width error the repeats cannot show
    (:func:`k3pipe.verdicts.stats.with_resolution`)."""

    def better(self, a: float, b: float) -> bool:
        return a > b if self.higher_is_better else a < b


TABLE_FIGURES: tuple[Figure, ...] = (
    Figure("duration_s", "end-to-end time", "s", higher_is_better=False),
    Figure("output_throughput_tps", "decode throughput, client", "tok/s", True, throughput=True),
    Figure("engine_generation_tps", "decode throughput, engine /metrics", "tok/s", True, throughput=True),
    Figure("steady_decode_tps", "steady decode throughput", "tok/s", True, throughput=True),
    Figure("ttft_ms_p50", "TTFT p50, first delta", "ms", higher_is_better=False),
    Figure("content_ttft_ms_p50", "TTFT p50, first content", "ms", higher_is_better=False),
    Figure("tpot_ms_p50", "TPOT p50", "ms", higher_is_better=False),
    Figure("itl_ms_p50", "ITL p50", "ms", higher_is_better=False),
    Figure("engine_prefix_cache_hit_pct", "prefix-cache hit rate, engine /metrics", "%", True),
    # what a cell costs (k3pipe.machine.cost): the GPUs' energy, and with a GPU-hour price, dollars
    Figure("energy_j_per_output_token", "GPU energy per output token", "J/tok", higher_is_better=False),
    Figure("usd_per_m_output_tokens", "cost per million output tokens", "$/Mtok", higher_is_better=False),
    Figure("usd_per_m_tokens", "cost per million tokens, input and output", "$/Mtok", higher_is_better=False),
    # a capacity search's answer (k3pipe.verdicts.capacity): the highest load whose requests met the SLO
    Figure(
        "capacity_rps",
        "capacity within the SLO, request rate",
        "req/s",
        True,
        resolution="capacity_rps_resolution",
    ),
    Figure(
        "capacity_concurrency",
        "capacity within the SLO, concurrency",
        "streams",
        True,
        resolution="capacity_concurrency_resolution",
    ),
)

FIGURES: tuple[Figure, ...] = (
    *TABLE_FIGURES,
    Figure("ttft_ms_p90", "TTFT p90, first delta", "ms", higher_is_better=False),
    Figure("ttft_ms_p99", "TTFT p99, first delta", "ms", higher_is_better=False),
    Figure("tpot_ms_p90", "TPOT p90", "ms", higher_is_better=False),
    Figure("tpot_ms_p99", "TPOT p99", "ms", higher_is_better=False),
    Figure("itl_ms_p90", "ITL p90", "ms", higher_is_better=False),
    Figure("itl_ms_p99", "ITL p99", "ms", higher_is_better=False),
    Figure("content_ttft_ms_p90", "TTFT p90, first content", "ms", higher_is_better=False),
    Figure("content_ttft_ms_p99", "TTFT p99, first content", "ms", higher_is_better=False),
    Figure("e2e_ms_p50", "request latency p50", "ms", higher_is_better=False),
    Figure("e2e_ms_p90", "request latency p90", "ms", higher_is_better=False),
    Figure("e2e_ms_p99", "request latency p99", "ms", higher_is_better=False),
    Figure("request_throughput_rps", "request throughput", "req/s", True, throughput=True),
    Figure("goodput_rps", "goodput (requests within the SLO)", "req/s", True, throughput=True),
    Figure("engine_itl_ms_p50", "ITL p50, engine /metrics", "ms", higher_is_better=False),
    Figure("energy_j_per_token", "GPU energy per token, input and output", "J/tok", higher_is_better=False),
    Figure("gpu_power_w_mean", "GPU power, all GPUs, mean", "W", higher_is_better=False),
)

DEFAULT_DECISION: tuple[str, ...] = ("output_throughput_tps", "ttft_ms_p50", "tpot_ms_p50")
"""What the verdicts rest on unless the experiment says otherwise: throughput (end-to-end time is the
same window the other way round), the first token's wait, and the pace after it; and where a
workload searched for its capacity, that capacity (:data:`CAPACITY_FIGURES`)."""

CAPACITY_FIGURES: tuple[str, ...] = ("capacity_rps", "capacity_concurrency")
"""A capacity search's answers: decision metrics by default where a study has them."""

_BY_KEY = {f.key: f for f in FIGURES}


def tails_of(key: str) -> tuple[str, ...]:
    """The tail figures of a median figure, the farthest first ('ttft_ms_p50' -> 'ttft_ms_p99',
    'ttft_ms_p90'); none for a figure that is not a median."""
    if not key.endswith("_p50"):
        return ()
    stem = key.removesuffix("_p50")
    return tuple(k for k in (f"{stem}_p99", f"{stem}_p90") if k in _BY_KEY)


def figure(key: str) -> Figure:
    """The figure named ``key`` (KeyError names the known ones)."""
    try:
        return _BY_KEY[key]
    except KeyError:
        raise KeyError(f"{key!r} is not a figure the report knows; one of: {', '.join(_BY_KEY)}") from None
