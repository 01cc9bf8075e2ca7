"""What MLflow holds, looked back on. :func:`recent_runs`: the recent runs, one row per run and
workload with the key figures, studies and retests with their arms nested (``k3pipe runs``).
:func:`metric_history`: one workload's figure across every run that measured it (runs, reruns, the
arms of studies and of retests' studies), oldest first, with the interval across repeats where there
were repeats. A run of a variant (experiment ``NAME@variant``) says so in the ``variant`` column and
is drawn as a line of its own."""

from __future__ import annotations

import io
from typing import Any

import pandas as pd

from k3pipe.core.errors import TrackingError
from k3pipe.core.layout import (
    ARM_TAG,
    ENGINE_TAG,
    EXPERIMENT_TAG,
    REPEAT_TAG,
    RERUN_TAG,
    RETEST_KIND,
    STUDY_KIND,
    VARIANT_TAG,
    RunTags,
)
from k3pipe.records.tracking import KEY_METRICS, Tracker

__all__ = ["metric_history", "plot_history", "recent_runs"]


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
        if tags.get(REPEAT_TAG):
            continue  # a repeat: its workload's run holds the mean and the interval
        if arm and tags.get(ARM_TAG) != arm:
            continue
        parent_id = tags.get("mlflow.parentRunId")
        if parent_id and parent_id not in parents:
            parents[parent_id] = tracker.client.get_run(parent_id)
        parent = parents.get(parent_id) if parent_id else None
        ptags = parent.data.tags if parent is not None else {}
        if engine and ptags.get(ENGINE_TAG) != engine:
            continue
        experiment = ptags.get(EXPERIMENT_TAG, "")
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
                "arm": tags.get(ARM_TAG, ""),
                "variant": of_variant,
                "engine": ptags.get(ENGINE_TAG, ""),
                "value": value,
                "ci95_low": run.data.metrics.get(f"{metric}.ci95_low"),
                "ci95_high": run.data.metrics.get(f"{metric}.ci95_high"),
                "repeats": int(float(run.data.params.get("workload.repeats", "1"))),
                "rerun_of": (ptags.get(RERUN_TAG) or "")[:12],
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


def recent_runs(
    tracker: Tracker,
    limit: int = 20,
    *,
    engine: str | None = None,
    model: str | None = None,
    workload: str | None = None,
    since: str | None = None,
    variant: str | None = None,
) -> pd.DataFrame:
    """Recent engine runs, newest first: one row per (run, workload) with the key metrics.

    Columns: run_id, name, status, start, cold_start_s, workload, then the workload's key
    metrics (ttft_ms_p50, tpot_ms_p50, e2e_ms_p50, output_throughput_tps, failed). A run that
    recorded no workload has one row with an empty workload. A study's run has one row
    (workload ``(study)``), followed by its arms' rows (their names indented); a retest's run
    one row (``(retest)``), followed by its studies, each with its arms.

    Filters (all optional, combined): ``engine`` (an arm's engine kind), ``model`` (the model id
    it served), ``workload`` (rows of that workload only), ``since`` (runs started on or after
    this date or time, e.g. ``2026-12-01``), ``variant`` (a retest's studies of that variant, or
    ``baseline``; runs of an experiment ``NAME@variant``); with a filter, ``limit`` counts
    matching runs.
    """
    filters = []
    if since:
        try:
            start_ms = int(pd.Timestamp(since).timestamp() * 1000)
        except ValueError as exc:
            raise TrackingError(f"--since {since!r} is not a date or time (e.g. 2026-12-01)") from exc
        filters.append(f"attributes.start_time >= {start_ms}")
    runs = _top_level(
        tracker,
        " and ".join(filters),
        max(limit * 10, 1000) if (engine or model or workload or variant) else limit,
    )

    def wanted(run: Any) -> bool:
        if engine and RunTags.of(run).engine != engine:
            return False
        return not (model and model not in (run.data.params.get("model_id"), run.data.params.get("model.id")))

    def of_variant(run: Any) -> bool:
        tags = run.data.tags
        return not variant or (
            tags.get(VARIANT_TAG) == variant or tags.get(EXPERIMENT_TAG, "").endswith(f"@{variant}")
        )

    def study_rows(run: Any, indent: str = "") -> list[dict[str, Any]]:
        """A study's own row, then its arms (nested runs) each as the runs they are; none when
        the filters leave no arm row."""
        arms = sorted(tracker.children(run.info.run_id), key=lambda r: r.info.start_time)
        found = [row for arm in arms if wanted(arm) for row in _run_rows(arm, indent=indent + "  ")]
        found = [r for r in found if not workload or r["workload"] == workload]
        if not found and (engine or model or workload):
            return []
        return [{**_run_base(run, indent), "workload": "(study)"}, *found]

    rows: list[dict[str, Any]] = []
    seen = 0
    for run in runs:
        if run.data.tags.get("mlflow.parentRunId"):
            continue
        seen += 1
        if seen > limit:
            break
        kind = RunTags.of(run).kind
        if kind == RETEST_KIND:
            studies = sorted(tracker.children(run.info.run_id), key=lambda r: r.info.start_time)
            found = [row for st in studies if of_variant(st) for row in study_rows(st, indent="  ")]
            if not found and (engine or model or workload or variant):
                seen -= 1
                continue
            rows.append({**_run_base(run), "workload": "(retest)"})
            rows.extend(found)
            continue
        found = (study_rows(run) if kind == STUDY_KIND else _run_rows(run)) if of_variant(run) else []
        if kind != STUDY_KIND:
            found = [r for r in found if wanted(run) and (not workload or r["workload"] == workload)]
        if not found:
            seen -= 1
            continue
        rows.extend(found)
    return pd.DataFrame(rows)


def _top_level(tracker: Tracker, where: str, wanted: int) -> list[Any]:
    """The newest runs that are nested under none (a study's, a retest's, a lone run's), at least
    ``wanted`` of them where there are so many: pages of the newest runs of every kind are read until
    they hold enough, since a study's nested runs (launches x workloads x repeats) outnumber and
    postdate the run they are nested under."""
    found: list[Any] = []
    token = None
    page = max(200, wanted * 20)
    for _ in range(_MAX_PAGES):
        batch = tracker.client.search_runs(
            [tracker.require_experiment_id()],
            filter_string=where,
            order_by=["attributes.start_time DESC"],
            max_results=page,
            page_token=token,
        )
        found += [r for r in batch if not r.data.tags.get("mlflow.parentRunId")]
        token = batch.token
        if len(found) >= wanted or not token:
            break
    return found


_MAX_PAGES = 25
"""At most this many pages of runs read for one listing (a page is 200 runs or more)."""


def _run_base(run: Any, indent: str = "") -> dict[str, Any]:
    return {
        "run_id": run.info.run_id,
        "name": indent + str(run.info.run_name),
        "status": run.info.status,
        "start": pd.Timestamp(run.info.start_time, unit="ms").strftime("%Y-%m-%d %H:%M:%S"),
        "cold_start_s": run.data.metrics.get("cold_start_s"),
    }


def _run_rows(run: Any, indent: str = "") -> list[dict[str, Any]]:
    base = _run_base(run, indent)
    per_workload: dict[str, dict[str, float]] = {}
    for key, value in run.data.metrics.items():
        workload, dot, metric = key.rpartition(".")
        if dot and metric in KEY_METRICS:
            per_workload.setdefault(workload, {})[metric] = value
    if not per_workload:
        return [{**base, "workload": ""}]
    rows = []
    for workload, metrics in per_workload.items():
        # bursty delivery (k3pipe.bench.summary): the client's TPOT timed delivery, not decoding
        if metrics.pop("client_timing_bursty", 0.0) and "tpot_ms_p50" in metrics:
            metrics["tpot_ms_p50"] = "bursty"  # type: ignore[assignment]
        rows.append({**base, "workload": workload, **metrics})
    return rows
