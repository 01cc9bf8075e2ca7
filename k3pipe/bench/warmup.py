"""The warm-up's waves and whether they reached a steady rate: pure functions of the records.

The warm-up requests go out at the workload's ``concurrency``; wave k is the k-th block of
``concurrency`` warm-up requests in send order (a last block of fewer is a partial wave). A wave's
output rate is its successful requests' output tokens / (its last ``t_end`` - its first ``t_send``).
Two consecutive full waves *agree* when the later's rate is within ``tolerance_pct`` percent of the
earlier's: ``|r_k - r_(k-1)| / r_(k-1) x 100 <= tolerance_pct``.

Under ``warmup: steady`` the client sends one wave at a time (all ``concurrency`` at once, the next
only once every request of the last has ended) and stops at the first wave that agrees with the one
before it, or after ``warmup_requests // concurrency`` waves. Under ``warmup: fixed`` the
``warmup_requests`` go out as before (a slot takes the next request as soon as its last ends) and the
same waves are read from the records afterwards, to say whether that warm-up ended steady. Either
way :func:`warmup_report` is what the workload records (docs/measurement.md, "Warm-up").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from k3pipe.bench.request_records import RequestRecord

__all__ = ["WarmupReport", "WarmupWave", "agree", "change_pct", "warmup_report", "waves"]


class WarmupWave(BaseModel):
    """One wave of warm-up requests: the k-th block of ``concurrency`` in send order."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    wave: int = Field(description="Its number, from 1.")
    requests: int = Field(
        description="Warm-up requests in it (concurrency, or fewer in a last partial wave)."
    )
    completed: int = Field(description="Those that succeeded.")
    output_tokens: int = Field(description="Output tokens of those that succeeded.")
    duration_s: float = Field(description="Its first t_send to its last t_end.")
    output_tps: float | None = Field(
        description="output_tokens / duration_s; None when no request succeeded or the span is 0."
    )
    change_pct: float | None = Field(
        description=(
            "100 x (output_tps - the previous wave's) / the previous wave's; None for the first wave, "
            "a partial wave, or next to a wave without a rate."
        )
    )


class WarmupReport(BaseModel):
    """What one repeat's warm-up did, and whether the engine's rate was steady at its end."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Literal["fixed", "steady"] = Field(description="The workload's warmup setting.")
    concurrency: int = Field(description="Requests per wave (the workload's concurrency).")
    tolerance_pct: float = Field(description="How close two consecutive waves' rates must be to agree.")
    requests_planned: int = Field(description="warmup_requests: all of them (fixed), the most (steady).")
    requests_sent: int = Field(description="Warm-up requests sent.")
    waves: list[WarmupWave] = Field(description="Its waves, in send order.")
    steady: bool | None = Field(
        description=(
            "The last two full waves agreed (under 'steady': the warm-up stopped because they did); "
            "None with fewer than two full waves."
        )
    )
    last_change_pct: float | None = Field(
        description="change_pct of the last full wave against the one before it (None: no such pair)."
    )


def _output_tokens(r: RequestRecord) -> int:
    # the order of preference of k3pipe.bench.summary: usage, re-tokenized text, token-bearing chunks
    if r.usage_output_tokens is not None:
        return r.usage_output_tokens
    if r.retokenized_output_tokens is not None:
        return r.retokenized_output_tokens
    return len(r.chunk_times)


def change_pct(rate: float | None, before: float | None) -> float | None:
    """100 x (rate - before) / before; None when either is missing or ``before`` is not positive."""
    if rate is None or before is None or before <= 0:
        return None
    return 100.0 * (rate - before) / before


def agree(change: float | None, tolerance_pct: float) -> bool:
    """Whether a wave whose rate changed by ``change`` percent agrees with the one before it."""
    return change is not None and abs(change) <= tolerance_pct


def waves(records: Sequence[RequestRecord], concurrency: int) -> list[WarmupWave]:
    """The warm-up records (``warmup`` set; others are left out) as waves of ``concurrency`` in send order."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    warm = sorted((r for r in records if r.warmup), key=lambda r: (r.t_send, r.index))
    out: list[WarmupWave] = []
    for k in range(0, len(warm), concurrency):
        block = warm[k : k + concurrency]
        ok = [r for r in block if r.ok]
        tokens = sum(_output_tokens(r) for r in ok)
        span = max(r.t_end for r in block) - min(r.t_send for r in block)
        rate = tokens / span if ok and tokens > 0 and span > 0 else None
        full = len(block) == concurrency
        before = out[-1] if out else None
        comparable = full and before is not None and before.requests == concurrency
        out.append(
            WarmupWave(
                wave=len(out) + 1,
                requests=len(block),
                completed=len(ok),
                output_tokens=tokens,
                duration_s=span,
                output_tps=rate,
                change_pct=change_pct(rate, before.output_tps) if comparable and before else None,
            )
        )
    return out


def warmup_report(
    records: Sequence[RequestRecord],
    mode: Literal["fixed", "steady"],
    concurrency: int,
    tolerance_pct: float,
    requests_planned: int,
) -> WarmupReport:
    """The warm-up of ``records`` (its warm-up ones) as waves, and the verdict on its last two full waves."""
    found = waves(records, concurrency)
    full = [w for w in found if w.requests == concurrency]
    last = full[-1].change_pct if len(full) >= 2 else None
    return WarmupReport(
        mode=mode,
        concurrency=concurrency,
        tolerance_pct=tolerance_pct,
        requests_planned=requests_planned,
        requests_sent=sum(w.requests for w in found),
        waves=found,
        steady=None if len(full) < 2 else agree(last, tolerance_pct),
        last_change_pct=last,
    )
