"""The report's figures as PNG bytes (matplotlib, no display): latency and decode throughput against
input length per arm, TTFT and ITL distributions per cell, and cold-start phases as stacked bars."""

from __future__ import annotations

import io
import json
from collections.abc import Mapping

import numpy as np
import pandas as pd

from k3pipe.report.analysis import Analysis
from k3pipe.report.collect import StudyData
from k3pipe.schema.traces import Trace, arrivals, cumulative_hit_rate

__all__ = ["plot_all", "trace_shape_png"]


def _png(fig: object) -> bytes:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")  # type: ignore[attr-defined]
    plt.close(fig)  # type: ignore[arg-type]
    return buf.getvalue()


def _by_length(analysis: Analysis, data: StudyData) -> bytes | None:
    import matplotlib.pyplot as plt

    panels = [
        ("duration_s", "end-to-end time (s)"),
        ("steady_decode_tps" if any(r.metric.key == "steady_decode_tps" for r in analysis.rows) else
         "output_throughput_tps", "decode throughput (tok/s)"),
        ("ttft_ms_p50", "TTFT p50, first delta (ms)"),
    ]  # fmt: skip
    panels = [(k, t) for k, t in panels if any(r.metric.key == k for r in analysis.rows)]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.0), squeeze=False)
    for ax, (key, title) in zip(axes[0], panels, strict=True):
        rows = sorted((r for r in analysis.rows if r.metric.key == key), key=lambda r: r.input_tokens)
        for arm in data.arm_names:
            pts = [(r.input_tokens, r.cells[arm]) for r in rows if arm in r.cells]
            if not pts:
                continue
            x = [p[0] for p in pts]
            y = [p[1].mean for p in pts]
            low = [p[1].mean - (p[1].ci_low if p[1].ci_low is not None else p[1].mean) for p in pts]
            high = [(p[1].ci_high if p[1].ci_high is not None else p[1].mean) - p[1].mean for p in pts]
            ax.errorbar(x, y, yerr=[low, high], marker="o", capsize=4, label=arm)
        ax.set_title(title)
        ax.set_xlabel("input tokens")
        ax.grid(alpha=0.3)
        ax.legend()
    return _png(fig)


def _itl_ms(frame: pd.DataFrame) -> np.ndarray:
    """Per-token inter-token latency from each request's chunk stamps (a chunk of k tokens after a
    gap g counts k tokens at g / k)."""
    out: list[float] = []
    for times_text, tokens_text in zip(frame["chunk_times_s"], frame["chunk_tokens"], strict=False):
        times = json.loads(times_text) if isinstance(times_text, str) else []
        tokens = json.loads(tokens_text) if isinstance(tokens_text, str) else [1] * len(times)
        for i in range(1, len(times)):
            k = max(1, int(tokens[i]) if i < len(tokens) and tokens[i] else 1)
            out.extend([(times[i] - times[i - 1]) * 1000 / k] * k)
    return np.asarray(out, dtype=float)


def _distributions(frames: Mapping[tuple[str, str], pd.DataFrame]) -> bytes | None:
    import matplotlib.pyplot as plt

    labels, ttft, itl = [], [], []
    for (arm, workload), frame in frames.items():  # in the study's order: arm by arm, shortest first
        if frame.empty:
            continue
        labels.append(f"{arm}\n{workload}")
        ttft.append(frame["ttft_ms"].dropna().to_numpy(dtype=float))
        itl.append(_itl_ms(frame))
    if not labels:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(max(8.0, 2.2 * len(labels)), 4.2))
    a.boxplot(ttft, tick_labels=labels, showfliers=True)
    a.set_title("TTFT, first delta (ms), per request")
    b.boxplot([v if v.size else np.asarray([np.nan]) for v in itl], tick_labels=labels, showfliers=False)
    b.set_title("ITL (ms), per token")
    for ax in (a, b):
        ax.grid(alpha=0.3, axis="y")
        ax.tick_params(axis="x", labelsize=8)
    return _png(fig)


def _cold_start(data: StudyData) -> bytes | None:
    import matplotlib.pyplot as plt

    arms = [a for a in data.arms if a.phases or a.cold_start_s]
    if not arms:
        return None
    phases = sorted({p for a in arms for p in a.phases})
    fig, ax = plt.subplots(figsize=(max(5.0, 1.8 * len(arms) + 3), 4.2))
    bottom = np.zeros(len(arms))
    for phase in phases:
        values = np.asarray([a.phases.get(phase, 0.0) for a in arms])
        ax.bar([data.label(a) for a in arms], values, bottom=bottom, label=phase)
        bottom += values
    rest = np.asarray([max(0.0, (a.cold_start_s or 0.0) - sum(a.phases.values())) for a in arms])
    if rest.any():
        ax.bar(
            [data.label(a) for a in arms],
            rest,
            bottom=bottom,
            label="other (not in the log's phases)",
            color="#cccccc",
        )
    ax.set_ylabel("seconds")
    ax.set_title("cold start by phase")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    return _png(fig)


def _pareto(analysis: Analysis) -> bytes | None:
    import matplotlib.pyplot as plt

    ladders = sorted({p.ladder for p in analysis.pareto})
    if not ladders:
        return None
    fig, axes = plt.subplots(1, len(ladders), figsize=(5.6 * len(ladders), 4.2), squeeze=False)
    for ax, ladder in zip(axes[0], ladders, strict=True):
        for arm in dict.fromkeys(p.arm for p in analysis.pareto if p.ladder == ladder):
            pts = [p for p in analysis.pareto if p.ladder == ladder and p.arm == arm]
            (line,) = ax.plot([p.per_user_tps for p in pts], [p.per_gpu_tps for p in pts], marker="o",
                              label=arm, alpha=0.8)  # fmt: skip
            front = [p for p in pts if p.on_front]
            ax.scatter([p.per_user_tps for p in front], [p.per_gpu_tps for p in front], s=70,
                       facecolors="none", edgecolors=line.get_color())  # fmt: skip
            for p in pts:
                ax.annotate(p.workload.rsplit("@", 1)[-1], (p.per_user_tps, p.per_gpu_tps), fontsize=7,
                            textcoords="offset points", xytext=(3, 3))  # fmt: skip
        ax.set_title(f"{ladder}: ringed points on each arm's front")
        ax.set_xlabel("output tok/s per user (1000 / TPOT p50)")
        ax.set_ylabel("output tok/s per GPU")
        ax.grid(alpha=0.3)
        ax.legend()
    return _png(fig)


def _search_path(data: StudyData) -> bytes | None:
    """A search's path (``tune``): each candidate's objective (the geometric mean of its launch means)
    at every look it was judged, the look it was found worse at crossed, the winner (or the leader)
    drawn thick."""
    import matplotlib.pyplot as plt

    tune = data.tune or {}
    path = tune.get("path") or []
    if not path:
        return None
    best = tune.get("winner") or tune.get("leader")
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name in tune.get("candidates") or {}:
        looks = [look for look in path if name in (look.get("means") or {})]
        if not looks:
            continue
        xs = [int(look["round"]) for look in looks]
        ys = [float(look["means"][name]) for look in looks]
        (line,) = ax.plot(xs, ys, marker="o", label=name, linewidth=2.6 if name == best else 1.0,
                          alpha=1.0 if name == best else 0.75)  # fmt: skip
        out = [
            (x, y) for x, y, look in zip(xs, ys, looks, strict=True) if name in (look.get("dropped") or [])
        ]
        if out:
            ax.scatter([x for x, _ in out], [y for _, y in out], marker="x", s=80, color=line.get_color(),
                       zorder=3)  # fmt: skip
    objective = tune.get("objective") or {}
    ax.set_title(f"the search: {tune.get('outcome', '')} ({tune.get('launches')} launches); x: found worse")
    ax.set_xlabel("look (round)")
    ax.set_ylabel(f"{objective.get('metric', 'objective')} on {objective.get('workload', '')}")
    ax.set_xticks(sorted({int(look["round"]) for look in path}))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return _png(fig)


def plot_all(
    analysis: Analysis, data: StudyData, frames: Mapping[tuple[str, str], pd.DataFrame]
) -> dict[str, bytes]:
    """File name -> PNG bytes, for the figures there is data for."""
    import matplotlib

    matplotlib.use("Agg")
    made = {
        "by_input_length.png": _by_length(analysis, data),
        "distributions.png": _distributions(frames),
        "cold_start.png": _cold_start(data),
        "pareto.png": _pareto(analysis),
        "search_path.png": _search_path(data),
    }
    return {name: png for name, png in made.items() if png is not None}


def trace_shape_png(trace: Trace, bin_s: float = 10.0) -> bytes:
    """A trace's shape (docs/traces.md): its arrivals per ``bin_s`` seconds, its prompt lengths, its
    sessions' depths, and the theoretical prefix-cache hit rate as the requests go on."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ((a, b), (c, d)) = plt.subplots(2, 2, figsize=(10, 6.5))
    counts = arrivals(trace, bin_s)
    a.bar([k * bin_s for k in range(len(counts))], counts, width=bin_s * 0.9, align="edge")
    a.set(title=f"arrivals per {bin_s:g} s", xlabel="s from the trace's start", ylabel="requests")
    b.hist([r.input_tokens for r in trace.requests], bins=30)
    b.set(title="prompt tokens", xlabel="tokens", ylabel="requests")
    depths = [len(turns) for turns in trace.sessions().values()]
    if depths:
        c.hist(depths, bins=range(1, max(depths) + 2), align="left")
    c.set(title=f"turns per session ({len(depths)} sessions)", xlabel="turns", ylabel="sessions")
    curve = cumulative_hit_rate(trace)
    d.plot(range(1, len(curve) + 1), [100 * v for v in curve])
    d.set(title="theoretical prefix-cache hit rate", xlabel="requests sent", ylabel="% of prompt tokens")
    d.set_ylim(0, 100)
    fig.suptitle(f"trace {trace.digest}: {trace.source}"[:110], fontsize=9)
    fig.tight_layout()
    return _png(fig)
