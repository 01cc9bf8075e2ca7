"""A metric's history: one workload's figure across every run that measured it (runs, reruns, the
arms of studies and of retests' studies), oldest first, with the interval across repeats where there
were repeats. A run of a variant (experiment ``NAME@variant``) says so in the ``variant`` column and
is drawn as a line of its own."""

from __future__ import annotations

import io
from typing import Any

import pandas as pd

from k3pipe.errors import TrackingError
from k3pipe.tracking import Tracker

__all__ = ["metric_history", "plot_history"]


def metric_history(
    tracker: Tracker,
    metric: str,
    workload: str,
    arm: str | None = None,
    engine: str | None = None,
    variant: str | None = None,
) -> pd.DataFrame:
    """Columns: start, arm, variant, engine, value, ci95_low, ci95_high, repeats, rerun_of, commit,
    run_id (the workload's run). ``variant``: only that variant's runs ('baseline': runs of no
    variant). Raises TrackingError when no run of ``workload`` recorded ``metric``."""
    safe = workload.replace("'", "\\'")
    runs = tracker.client.search_runs(
        [tracker.require_experiment_id()],
        filter_string=f"tags.`k3pipe.workload` = '{safe}'",
        order_by=["attributes.start_time ASC"],
        max_results=5000,
    )
    parents: dict[str, Any] = {}
    rows = []
    seen_metric = False
    for run in runs:
        tags = run.data.tags
        if tags.get("k3pipe.repeat"):
            continue  # a repeat: its workload's run holds the mean and the interval
        if arm and tags.get("k3pipe.arm") != arm:
            continue
        parent_id = tags.get("mlflow.parentRunId")
        if parent_id and parent_id not in parents:
            parents[parent_id] = tracker.client.get_run(parent_id)
        parent = parents.get(parent_id) if parent_id else None
        ptags = parent.data.tags if parent is not None else {}
        if engine and ptags.get("k3pipe.engine") != engine:
            continue
        experiment = ptags.get("k3pipe.experiment", "")
        of_variant = experiment.partition("@")[2]
        if variant and of_variant != ("" if variant == "baseline" else variant):
            continue
        value = run.data.metrics.get(metric)
        if value is None:
            continue
        seen_metric = True
        rows.append(
            {
                "start": pd.Timestamp(run.info.start_time, unit="ms").strftime("%Y-%m-%d %H:%M:%S"),
                "arm": tags.get("k3pipe.arm", ""),
                "variant": of_variant,
                "engine": ptags.get("k3pipe.engine", ""),
                "value": value,
                "ci95_low": run.data.metrics.get(f"{metric}.ci95_low"),
                "ci95_high": run.data.metrics.get(f"{metric}.ci95_high"),
                "repeats": int(float(run.data.params.get("workload.repeats", "1"))),
                "rerun_of": (ptags.get("k3pipe.rerun_of") or "")[:12],
                "commit": ptags.get("mlflow.source.git.commit", "")[:10],
                "run_id": run.info.run_id,
            }
        )
    if not seen_metric:
        what = (
            f"workload {workload!r}"
            + (f", arm {arm!r}" if arm else "")
            + (f", engine {engine!r}" if engine else "")
            + (f", variant {variant!r}" if variant else "")
        )
        raise TrackingError(
            f"no run of {what} in {tracker.tracking_uri} recorded {metric!r}: check the workload name "
            "(`k3pipe runs` lists them) and the metric (e.g. ttft_ms_p50, output_throughput_tps)"
        )
    return pd.DataFrame(rows)


def plot_history(frame: pd.DataFrame, metric: str, workload: str) -> bytes:
    """The history as a PNG: the metric per run in time order, one line per arm (and variant),
    interval bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.0, 4.0))
    lines = frame["arm"].where(frame["variant"] == "", frame["arm"] + "@" + frame["variant"])
    for arm, group in frame.groupby(lines, sort=False):
        x = pd.to_datetime(group["start"])
        low = (group["value"] - group["ci95_low"].fillna(group["value"])).clip(lower=0)
        high = (group["ci95_high"].fillna(group["value"]) - group["value"]).clip(lower=0)
        ax.errorbar(x, group["value"], yerr=[low, high], marker="o", capsize=3, label=str(arm))
    ax.set_title(f"{metric}, workload {workload}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.autofmt_xdate()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()
