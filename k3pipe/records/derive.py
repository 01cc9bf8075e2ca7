"""What the recorder derives from a measurement before it writes it, as pure functions: the summary
table for people, a workload's wall-clock times and their params, a judged probe's interval as
metrics, the gateway's and the compile cache's params, the statistics over repeats as metrics, the
kernels an engine compiled inside a measured window, and the device names it chose kernels by
against the node's. :class:`k3pipe.records.recorder.ArmRecorder` calls these and writes."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from k3pipe.bench import WorkloadResult
from k3pipe.bench.repeats import RepeatStats
from k3pipe.core.layout import TIME_PREFIX
from k3pipe.engines.observe import LogFormat, TimedLine, log_wall_time, same_device
from k3pipe.planning.plan import ArmPlan
from k3pipe.schema.specs import HardwareSpec
from k3pipe.verdicts.capacity import Probe

__all__ = [
    "COUNTS",
    "SUMMARY_COLUMNS",
    "compile_cache_params",
    "compiles_inside",
    "device_mismatch",
    "flat",
    "gateway_params",
    "ms_of",
    "probe_interval_metrics",
    "repeat_metrics_of",
    "summary_table",
    "times_params",
    "workload_times",
]


SUMMARY_COLUMNS = (
    "arm",
    "workload",
    "completed",
    "failed",
    "ttft_ms_p50",
    "ttft_ms_p99",
    "tpot_ms_p50",
    "itl_ms_p50",
    "e2e_ms_p50",
    "output_throughput_tps",
    "request_throughput_rps",
    "slo_attainment_pct",
)
"""The columns of the summary table the flow publishes and `k3pipe run` prints."""


_CLIENT_TIMING = ("tpot_ms_p50", "itl_ms_p50")


def summary_table(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The summary table for people: ``SUMMARY_COLUMNS``, counts as integers, figures rounded to 2.

    A figure the run did not measure reads ``-``, never NaN. A workload whose delivery was bursty
    (``client_timing_bursty``, see k3pipe.bench.summary) shows ``bursty`` in place of the client's
    TPOT and ITL, which would read near zero, and a ``client_timing`` column says why and gives the
    engine's own ITL.
    """
    rows = list(rows)
    any_bursty = any(r.get("client_timing_bursty") for r in rows)
    table = []
    for r in rows:
        bursty = bool(r.get("client_timing_bursty"))
        out: dict[str, Any] = {}
        for column in SUMMARY_COLUMNS:
            value = r.get(column)
            if bursty and column in _CLIENT_TIMING:
                out[column] = "bursty"
            elif value is None or (isinstance(value, float) and value != value):
                out[column] = "-"
            elif column in COUNTS:
                out[column] = int(value)
            elif isinstance(value, float):
                out[column] = round(value, 2)
            else:
                out[column] = value
        if any_bursty:
            out["client_timing"] = _timing_cell(r) if bursty else "ok"
        table.append(out)
    return table


def _timing_cell(row: Mapping[str, Any]) -> str:
    pct = row.get("bursty_requests_pct")
    share = "?" if pct is None else f"{pct:.0f}%"
    engine = row.get("engine_itl_ms_p50")
    where = "no engine ITL" if engine is None else f"engine ITL p50 {engine:.2f} ms"
    return f"bursty ({share} of requests): {where}"


def probe_interval_metrics(probe: Probe | None) -> dict[str, float]:
    """A judged probe's counts and attainment interval as metrics (none where its count is unknown)."""
    if probe is None or probe.requests is None or probe.ci_low_pct is None or probe.ci_high_pct is None:
        return {}
    return {
        "probe.requests": float(probe.requests),
        "probe.slo_met": float(probe.met or 0),
        "probe.slo_attainment_ci_low_pct": probe.ci_low_pct,
        "probe.slo_attainment_ci_high_pct": probe.ci_high_pct,
        "probe.undecided": float(bool(probe.undecided)),
    }


def flat(prefix: str, data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` as params under ``prefix`` (a scheme of k3pipe.core.layout, its dot included)."""
    return {f"{prefix}{k}": v for k, v in data.items()}


def gateway_params(plan: ArmPlan) -> dict[str, Any]:
    """The gateway's three settings (its key by its variable's NAME only) and where the requests
    went; ``base_url``, ``model_id`` and ``api_key_env`` stay the engine's."""
    if plan.gateway is None:
        return {}  # the requests went to the engine's endpoint (base_url, model_id)
    return {
        "client_target": "gateway",
        "gateway.base_url": plan.gateway.base_url,
        "gateway.model": plan.gateway.model,
        "gateway.api_key_env": plan.gateway.api_key_env,
        "gateway.continuous_usage_stats": plan.gateway.continuous_usage_stats,
    }


def workload_times(result: WorkloadResult) -> dict[str, float] | None:
    """When a workload ran, on the wall clock (Unix seconds): its first send (warm-up included), the
    measured window's start (the zero of requests.parquet's, engine_metrics.parquet's and
    gpu_memory.parquet's times) and end, its last response's end, and the monotonic clock's reading
    at the window's start. None when the client recorded no wall-clock start."""
    if not result.started_at_unix_s or result.started_at_unix_s <= 0:
        return None
    offset = result.started_at_unix_s - result.t_start  # perf_counter -> Unix seconds
    sends = [r.t_send for r in result.records]
    ends = [r.t_end for r in result.records]
    return {
        "first_send_unix_s": offset + min(sends, default=result.t_start),
        "measured_start_unix_s": result.started_at_unix_s,
        "measured_end_unix_s": offset + result.t_end,
        "last_end_unix_s": offset + max([*ends, result.t_end]),
        "perf_counter_at_measured_start_s": result.t_start,
    }


def times_params(times: Mapping[str, float] | None) -> dict[str, str]:
    """``time.*`` params of :func:`workload_times` (and the window's start in UTC, for people)."""
    if times is None:
        return {}
    params = {f"{TIME_PREFIX}{k}": f"{v:.6f}" for k, v in times.items()}
    start = datetime.fromtimestamp(times["measured_start_unix_s"], tz=UTC)
    params[f"{TIME_PREFIX}measured_start_utc"] = start.isoformat(timespec="milliseconds")
    return params


def ms_of(times: Mapping[str, float] | None, key: str) -> int | None:
    return None if times is None else round(times[key] * 1000)


COUNTS = ("requests", "completed", "failed", "warmup_requests", "slo_met")


def compile_cache_params(plan: ArmPlan) -> dict[str, Any]:
    """``compile_cache.key``, ``.dir`` (as the engine sees it), ``.host_dir``, ``.source``, ``.var``."""
    cache = plan.compile_cache
    if cache is None:
        return {}
    return {
        "compile_cache.key": cache.key,
        "compile_cache.dir": cache.dir,
        "compile_cache.host_dir": cache.host_dir,
        "compile_cache.source": cache.source,
        "compile_cache.var": cache.var,
    }


def repeat_metrics_of(stats: Mapping[str, RepeatStats]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for name, st in stats.items():
        out[name] = st.mean
        out[f"{name}.std"] = st.std
        out[f"{name}.ci95_low"] = st.ci_low
        out[f"{name}.ci95_high"] = st.ci_high
    return out


def compiles_inside(
    lines: Sequence[TimedLine], windows: Sequence[tuple[str, float, float]], fmt: LogFormat
) -> tuple[int, list[str]]:
    """Of the kernels an engine compiled while serving (its log's ``lines``), how many fell inside a
    measured window (``windows``: label, start and end, Unix seconds; a line's second overlapping
    one), and a warning for each naming its window. The stamps are read as this machine's local
    time in the year of the first window; a line without one, or that cannot be read, is in none."""
    said: list[str] = []
    inside = 0
    for line in lines:
        if line.time is None or not windows:
            continue
        year = datetime.fromtimestamp(windows[0][1]).year
        try:
            t = log_wall_time(line.time, fmt, year)
        except ValueError:
            continue
        hit = [label for label, start, end in windows if t < end and t + 1 > start]
        if hit:
            inside += 1
            said.append(
                f"a kernel was compiled while serving, inside the measured window of {', '.join(hit)} "
                f"({line.time}): {line.message}"
            )
    return inside, said


def device_mismatch(
    device_names: Sequence[str], gpu_names: Sequence[str], hardware: HardwareSpec | None
) -> tuple[list[str], str] | None:
    """The device names an engine chose kernels by that are not this node's GPU: against
    nvidia-smi's names (``gpu_names``), else the experiment's ``hardware.gpu_name`` (each of its words
    in the logged name); with what they were compared to, in words. None: nothing to compare with."""
    if gpu_names:
        wrong = [d for d in device_names if not same_device(d, gpu_names)]
        return wrong, f"nvidia-smi names the GPU {', '.join(gpu_names)}"
    if hardware is not None:  # no nvidia-smi where k3pipe runs (an endpoint, a cluster manager)
        words = hardware.gpu_name.casefold().split()
        wrong = [d for d in device_names if not set(words) <= set(d.casefold().split("_"))]
        return wrong, f"the experiment's hardware.gpu_name is {hardware.gpu_name!r} (no nvidia-smi here)"
    return None
