"""Steady decode throughput from the client's own stamps: tokens per second while no request of the
window was in prefill.

A request is in prefill from its send to its first delta, and decoding from its first delta to its
end. The steady set is the time when at least one request decodes and none is in prefill; the
figure is the tokens that arrived then (each request's first chunk left out: it closes the prefill)
over the length of that set. It is what an engine's "steady" decode figure means, measured from the
requests the run sent, so a long prefill does not dilute it as it dilutes tokens / wall time.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import pandas as pd

__all__ = ["MIN_STEADY_FRACTION", "steady_decode_tps"]

MIN_STEADY_FRACTION = 0.05
"""Below this share of the window in steady decode, no figure (too little to mean anything)."""


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
    decode = _union(zip(frame["t_first_delta_s"], frame["t_end_s"], strict=True))
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
