"""Steady decode throughput from the client's own stamps: tokens per second while the load's batch
decoded and no request of the window waited for its first token.

A request waits (queued or in prefill: the client cannot tell them apart) from its send to its first
delta, and decodes from its first delta to its end. The steady set is the time when none waits and
the streams decoding at once number at least ``FULL_BATCH_SHARE`` of the window's usual batch (the
time-weighted median of that number while any decodes); the figure is the tokens that arrived then
(each request's first chunk left out: it closes the prefill) over the length of that set. It is what
an engine's "steady" decode figure means, measured from the requests the run sent, so a long prefill
does not dilute it as it dilutes tokens / wall time.

The batch floor keeps the drain out: when the engine admits fewer sequences than the load keeps in
flight (``max_num_seqs`` 56 at 64 streams), some request always waits while the batch is full, and
the only time without a waiting request is the end, where the batch empties; without the floor that
tail (2,665 tok/s against 12,417 at the full batch on the H200, docs/gpu.md) was reported as the
arm's steady decode. With it such an arm has no steady decode (under ``MIN_STEADY_FRACTION`` of the
window), which is what its requests show.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import pandas as pd

__all__ = ["FULL_BATCH_SHARE", "MIN_STEADY_FRACTION", "steady_decode_tps"]

MIN_STEADY_FRACTION = 0.05
"""Below this share of the window in steady decode, no figure (too little to mean anything)."""

FULL_BATCH_SHARE = 0.9
"""Steady decode needs at least this share of the usual batch (the time-weighted median of the
streams decoding at once) decoding: the drain at a window's end is not steady."""


def _union(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _minus(spans: list[tuple[float, float]], holes: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out = []
    for a, b in spans:
        start = a
        for h0, h1 in holes:
            if h1 <= start or h0 >= b:
                continue
            if h0 > start:
                out.append((start, h0))
            start = max(start, h1)
        if start < b:
            out.append((start, b))
    return out


def _full_batch(decoding: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The spans in which at least ``FULL_BATCH_SHARE`` of the usual batch decodes, from each
    request's decode span (first delta, end)."""
    events = sorted([(a, 1) for a, b in decoding if b > a] + [(b, -1) for a, b in decoding if b > a])
    segments: list[tuple[float, float, int]] = []  # (start, end, streams decoding)
    count, at = 0, None
    for t, step in events:
        if at is not None and t > at and count > 0:
            segments.append((at, t, count))
        count, at = count + step, t
    if not segments:
        return []
    total = sum(b - a for a, b, _ in segments)
    seen, usual = 0.0, 0
    for a, b, n in sorted(segments, key=lambda s: s[2]):
        seen += b - a
        if seen >= total / 2:
            usual = n
            break
    floor = FULL_BATCH_SHARE * usual
    return _union((a, b) for a, b, n in segments if n >= floor)


def steady_decode_tps(frame: pd.DataFrame) -> float | None:
    """The steady decode throughput of one repeat's measured requests (``requests.parquet``); None
    when the requests lack chunk stamps or the steady set is under 5% of the window."""
    needed = {"t_send_s", "t_first_delta_s", "t_end_s", "chunk_times_s"}
    if frame.empty or not needed <= set(frame.columns):
        return None
    frame = frame.dropna(subset=["t_first_delta_s"])
    if frame.empty:
        return None
    prefill = _union(zip(frame["t_send_s"], frame["t_first_delta_s"], strict=True))
    decode = _full_batch(list(zip(frame["t_first_delta_s"], frame["t_end_s"], strict=True)))
    steady = _minus(decode, prefill)
    length = sum(b - a for a, b in steady)
    window = float(frame["t_end_s"].max() - frame["t_send_s"].min())
    if window <= 0 or length < MIN_STEADY_FRACTION * window:
        return None
    tokens = 0
    tokens_column = frame["chunk_tokens"] if "chunk_tokens" in frame.columns else [None] * len(frame)
    for times_text, tokens_text in zip(frame["chunk_times_s"], tokens_column, strict=True):
        times = json.loads(times_text) if isinstance(times_text, str) else []
        counts = json.loads(tokens_text) if isinstance(tokens_text, str) else [1] * len(times)
        for t, k in list(zip(times, counts, strict=False))[1:]:
            if any(a <= t <= b for a, b in steady):
                tokens += int(k or 1)
    return tokens / length
