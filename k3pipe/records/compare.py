"""Compare two recorded workloads: are their figures different, equivalent, or can the data not tell?

A workload recorded with ``repeats: N`` keeps its per-repeat values in ``repeats.json``; two such
workloads are compared metric by metric (``k3pipe.bench.repeats.compare``: the log ratio of their
geometric means, the metrics compared together sharing alpha, each verdict different, equivalent
within 5% or inconclusive). A workload with a single repeat has no spread, so its figures are shown
without a verdict: rerun it with ``repeats`` to tell a difference from noise.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from k3pipe.bench.repeats import Comparison, compare
from k3pipe.core.errors import ArtifactMissingError, TrackingError
from k3pipe.core.layout import ARM_TAG, REPEAT_TAG, REPEATS_FILE, REQUESTS_FILE, WORKLOAD_TAG, RunTags
from k3pipe.records.priors import find_priors, run_class
from k3pipe.records.tracking import Tracker
from k3pipe.verdicts.stats import Design, RestartPrior

__all__ = [
    "DEFAULT_METRICS",
    "REQUEST_METRICS",
    "compare_workloads",
    "find_run",
    "request_values",
    "resolve_workload_run",
    "workload_priors",
    "workload_values",
]

DEFAULT_METRICS = (
    "ttft_ms_p50",
    "ttft_ms_p99",
    "tpot_ms_p50",
    "itl_ms_p50",
    "e2e_ms_p50",
    "output_throughput_tps",
    "request_throughput_rps",
    "goodput_rps",
    "slo_attainment_pct",
)


def resolve_workload_run(tracker: Tracker, run_ref: str, workload: str | None = None) -> Any:
    """The MLflow run of a workload: ``run_ref`` is a workload run's id, or an arm run's id with the
    ``workload`` name. Ids may be shortened to a unique prefix (``k3pipe runs`` prints 12 characters).
    """
    run = find_run(tracker, run_ref)
    if run.data.tags.get(REPEAT_TAG):  # a single repeat: compare its workload instead
        run = tracker.client.get_run(run.data.tags["mlflow.parentRunId"])
    if RunTags.of(run).workload:
        if workload and run.data.tags[WORKLOAD_TAG] != workload:
            raise TrackingError(
                f"run {run_ref} is workload {run.data.tags[WORKLOAD_TAG]!r}, not {workload!r}"
            )
        return run
    children = {
        name: c for c in tracker.children(run.info.run_id) if (name := RunTags.of(c).workload) is not None
    }
    if not workload:
        if len(children) == 1:
            return next(iter(children.values()))
        raise TrackingError(
            f"run {run_ref} is an engine run with workloads {', '.join(sorted(children)) or '(none)'}: "
            "name one with --workload"
        )
    if workload not in children:
        raise TrackingError(
            f"run {run_ref} has no workload {workload!r}; it has {', '.join(sorted(children)) or '(none)'}"
        )
    return children[workload]


def workload_values(tracker: Tracker, run: Any) -> dict[str, list[float]]:
    """Per metric, its value in each repeat (one value for a workload run without repeats).

    A workload recorded with ``repeats`` above 1 (its param ``workload.repeats``) has them in
    repeats.json, never read as one repeat from its means: a FINISHED one lacking it raises
    ``ArtifactMissingError``; one that ended early without it (its process died before the statistics
    were logged, k3pipe.records.recorder) has no values. An artifact store that cannot be read (a store moved
    from another machine, read without ``--artifact-root``) raises ``ArtifactStoreError``.
    """
    repeats = _repeats(run)
    data = None
    if repeats != 1:  # one repeat: its metrics are its values, and it has no repeats.json to read
        try:
            data = tracker.find_artifact(run.info.run_id, REPEATS_FILE)
            if data is None and repeats > 1 and run.info.status == "FINISHED":
                data = tracker.read_artifact(run.info.run_id, REPEATS_FILE, required=True)  # raises
        except ArtifactMissingError as exc:
            tags = run.data.tags
            raise exc.context(
                f"workload {tags.get(WORKLOAD_TAG, '?')} of arm {tags.get(ARM_TAG, '?')} "
                f"({run.info.status}, "
                + (f"{repeats} repeats" if repeats > 1 else "repeats not recorded")
                + ")"
            ) from exc
    if data is None:
        return {} if repeats > 1 else {k: [float(v)] for k, v in run.data.metrics.items()}
    stats = json.loads(data)
    return {k: [float(x) for x in v["values"]] for k, v in stats.items()}


def _repeats(run: Any) -> int:
    """The workload's ``repeats`` as recorded (its param); 0 when not recorded."""
    try:
        return int(float(run.data.params.get("workload.repeats", "0")))
    except ValueError:
        return 0


# per-request figures (requests.parquet columns) a single run can be tested on: its requests are the
# samples (they share the engine, so they are not independent: a rough test, said so where shown)
REQUEST_METRICS = ("ttft_ms", "tpot_ms", "e2e_ms")


def request_values(
    tracker: Tracker, run: Any, columns: Sequence[str] = REQUEST_METRICS
) -> dict[str, list[float]]:
    """Per column, its value for each measured request (warm-up and failed ones left out) of a workload
    run without repeats; empty when it has no requests.parquet."""
    import io

    import pandas as pd

    data = tracker.read_artifact(run.info.run_id, REQUESTS_FILE)
    if data is None:
        return {}
    frame = pd.read_parquet(io.BytesIO(data))
    measured = frame[(~frame["warmup"]) & (frame["ok"])]
    return {c: [float(x) for x in measured[c].dropna()] for c in columns if c in measured.columns}


def compare_workloads(
    tracker: Tracker, run_a: Any, run_b: Any, metrics: Sequence[str] = DEFAULT_METRICS
) -> list[Comparison]:
    """Metric by metric, workload B against workload A (metrics either lacks are left out). Each is
    one launch: judged with the restart noise earlier studies of its class measured on its node
    (:func:`workload_priors`), or 'cannot tell' without it."""
    a, b = workload_values(tracker, run_a), workload_values(tracker, run_b)
    shared = [m for m in metrics if _positive(a.get(m)) and _positive(b.get(m))]
    design = Design(tests=max(1, len(shared)))
    pa, pb = workload_priors(tracker, [run_a, run_b], shared)
    return [compare(m, a[m], b[m], design, pa.get(m), pb.get(m)) for m in shared]


def workload_priors(
    tracker: Tracker, runs: Sequence[Any], metrics: Sequence[str]
) -> list[dict[str, RestartPrior]]:
    """Per workload run (in order), metric -> the restart noise that studies before the latest of
    them kept for its class (k3pipe.records.priors: its arm's engine, model and node, its workload's shape),
    within the default age. A run whose class is not known (no arm run above it, no model or node
    recorded) gets none."""
    classes = []
    for run in runs:
        parent_id = run.data.tags.get("mlflow.parentRunId")
        arm = tracker.client.get_run(parent_id) if parent_id else None
        classes.append(run_class(arm, run) if arm is not None and RunTags.of(arm).arm else None)
    wanted: dict[str, set[str]] = {}
    for klass in classes:
        if klass is not None:
            wanted.setdefault(klass.key, set()).update(metrics)
    if not wanted:
        return [{} for _ in runs]
    found = find_priors(tracker, wanted, max(r.info.start_time for r in runs) + 1)
    return [
        {m: p for (key, m), p in found.items() if klass is not None and key == klass.key} for klass in classes
    ]


def _positive(values: Sequence[float] | None) -> bool:
    return any(v > 0 for v in values or [])


def find_run(tracker: Tracker, run_ref: str) -> Any:
    """The MLflow run ``run_ref`` names: a whole id, or a unique prefix of at least 6 characters. A
    run's local id (made while MLflow was down) names the run `k3pipe sync` gave it."""
    ref = tracker.mlflow_id(run_ref.strip())
    if len(ref) == 32:
        try:
            return tracker.client.get_run(ref)
        except Exception as exc:
            raise TrackingError(f"no MLflow run {ref} in {tracker.tracking_uri}: {exc}") from exc
    if len(ref) < 6:
        raise TrackingError(f"run id {ref!r} is too short: give at least 6 characters")
    matches = [
        r
        for r in tracker.client.search_runs([tracker.require_experiment_id()], max_results=5000)
        if r.info.run_id.startswith(ref)
    ]
    if len(matches) != 1:
        found = "no run" if not matches else f"{len(matches)} runs"
        raise TrackingError(f"{found} in {tracker.tracking_uri} with an id starting {ref!r}: give more of it")
    return matches[0]
