"""The MLflow adapter: runs, params, metrics, tags, artifacts, and the recent-runs view.

Uses ``MlflowClient`` with explicit run ids (no fluent active-run state), so steps running in other
threads, as Prefect tasks do, log to the right run. Every string that reaches MLflow passes through
``scrub``: k3pipe's one scrubber (:mod:`k3pipe.secrets`), which replaces every registered secret (the
endpoint's key, an experiment's secrets, the values of its ``{env.NAME}`` references, those given to
the tracker) and masks credential-shaped text.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

import pandas as pd
from mlflow import MlflowClient
from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

from k3pipe import secrets as _secrets
from k3pipe.errors import TrackingError
from k3pipe.procs import file_lock
from k3pipe.provenance import git_commit

__all__ = ["KEY_METRICS", "DatasetFields", "Tracker", "metric_name"]

_PARAM_MAX = 6000
KEY_METRICS = (
    "ttft_ms_p50",
    "tpot_ms_p50",
    "e2e_ms_p50",
    "output_throughput_tps",
    "failed",
    "client_timing_bursty",
)
"""Per-workload metrics that the engine run repeats as WORKLOAD.METRIC, for overviews."""
_BAD_NAME = re.compile(r"[^A-Za-z0-9_\-. /]")


def metric_name(name: str) -> str:
    """MLflow names may not hold ':' (Prometheus names do): 'vllm:x' -> 'vllm_x'."""
    return _BAD_NAME.sub("_", name)


class DatasetFields(Protocol):
    """What a dataset input is logged from (``k3pipe.bench.PromptSet`` is one)."""

    @property
    def name(self) -> str: ...
    @property
    def digest(self) -> str: ...
    @property
    def source_type(self) -> str: ...
    @property
    def source(self) -> str: ...
    @property
    def profile(self) -> Mapping[str, Any]: ...


# MLflow 3 opens an experiment of no kind on its GenAI overview ("No data available"); k3pipe's runs
# are model-development runs, so the UI opens on them. The note is the experiment's description.
_ML_VIEW = "?workflowType=machine_learning"
"""The MLflow UI's model-training view (runs, nesting, parameters) instead of its GenAI default."""

EXPERIMENT_TAGS = {
    "mlflow.experimentKind": "custom_model_development",
    "mlflow.note.content": (
        "k3pipe: inference-engine runs. One run per engine arm (nested: its workloads and repeats); a "
        "study's parent run holds its arms and its report (report/report.html)."
    ),
}


@functools.cache
def source_tags() -> dict[str, str]:
    """MLflow's source tags for every run: k3pipe as the source, its checkout's commit."""
    commit = git_commit()
    tags = {"mlflow.source.name": "k3pipe", "mlflow.source.type": "JOB"}
    if commit != "unknown":
        tags["mlflow.source.git.commit"] = commit.removesuffix("-dirty")
    return tags


class Tracker:
    """Records runs in MLflow (SQLite in K3PIPE_HOME by default, any tracking URI otherwise)."""

    def __init__(
        self,
        tracking_uri: str,
        experiment: str,
        artifact_root: Path | None = None,
        secrets: Iterable[str] = (),
    ) -> None:
        self.tracking_uri = tracking_uri
        _secrets.register_all(secrets)
        # the first use of a new SQLite store creates its tables: several first runs at once on one
        # K3PIPE_HOME raced on that and broke the store for good; one process at a time does it
        lock: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        if tracking_uri.startswith("sqlite:///"):
            db = Path(tracking_uri.removeprefix("sqlite:///"))
            db.parent.mkdir(parents=True, exist_ok=True)
            lock = file_lock(db.with_name(db.name + ".lock"))
        with lock:
            self.client = MlflowClient(tracking_uri=tracking_uri)
            self._open_experiment(tracking_uri, experiment, artifact_root)

    def _open_experiment(self, tracking_uri: str, experiment: str, artifact_root: Path | None) -> None:
        try:
            found = self.client.get_experiment_by_name(experiment)
            if found is None:
                # a local store keeps artifacts under K3PIPE_HOME; a tracking server decides itself
                # (its proxied artifact store), so that no worker writes artifacts to its own disk
                local = not tracking_uri.startswith(("http://", "https://", "databricks"))
                location = artifact_root.resolve().as_uri() if artifact_root and local else None
                self.experiment_id = self.client.create_experiment(
                    experiment, artifact_location=location, tags=EXPERIMENT_TAGS
                )
            else:
                self.experiment_id = found.experiment_id
                missing = {k: v for k, v in EXPERIMENT_TAGS.items() if k not in found.tags}
                for key, value in missing.items():
                    self.client.set_experiment_tag(self.experiment_id, key, value)
        except MlflowException as exc:
            raise TrackingError(f"MLflow at {tracking_uri} refused experiment {experiment!r}: {exc}") from exc

    def describe(self, run_id: str, text: str) -> None:
        """The run's description in the MLflow UI (Markdown), secrets scrubbed."""
        self.set_tags(run_id, {"mlflow.note.content": text})

    def add_secret(self, value: str | None) -> None:
        """Register a secret value that must never be written (anywhere: the scrubber is k3pipe's)."""
        _secrets.register(value)

    def scrub(self, text: str) -> str:
        """``text`` as MLflow may hold it: see :func:`k3pipe.secrets.scrub`."""
        return _secrets.scrub(text)

    def start_run(
        self, name: str, tags: Mapping[str, str] | None = None, parent_id: str | None = None
    ) -> str:
        all_tags = {**source_tags(), **{k: self.scrub(str(v)) for k, v in (tags or {}).items()}}
        if parent_id:
            all_tags["mlflow.parentRunId"] = parent_id
        try:
            run = self.client.create_run(self.experiment_id, run_name=name, tags=all_tags)
        except MlflowException as exc:
            raise TrackingError(f"could not create MLflow run {name!r}: {exc}") from exc
        return str(run.info.run_id)

    def log_params(self, run_id: str, params: Mapping[str, Any]) -> None:
        """Log params; a value too long for a param goes to params/NAME.txt and the param points there."""
        batch: list[Param] = []
        for key, value in params.items():
            text = self.scrub(value if isinstance(value, str) else json.dumps(value, default=str))
            if len(text) > _PARAM_MAX:
                self.log_text(run_id, text, f"params/{key}.txt")
                text = f"(long value: artifact params/{key}.txt)"
            batch.append(Param(metric_name(key), text))
        for i in range(0, len(batch), 100):
            self.client.log_batch(run_id, params=batch[i : i + 100])

    def log_metrics(self, run_id: str, metrics: Mapping[str, float | int | None], step: int = 0) -> None:
        now = int(time.time() * 1000)
        batch = [
            Metric(metric_name(k), float(v), now, step)
            for k, v in metrics.items()
            if v is not None and v == v  # drop None and NaN
        ]
        for i in range(0, len(batch), 500):
            self.client.log_batch(run_id, metrics=batch[i : i + 500])

    def set_tags(self, run_id: str, tags: Mapping[str, Any]) -> None:
        batch = [RunTag(k, self.scrub(str(v))) for k, v in tags.items() if v is not None]
        if batch:
            self.client.log_batch(run_id, tags=batch)

    def log_text(self, run_id: str, text: str, artifact_file: str) -> None:
        self.client.log_text(run_id, self.scrub(text), artifact_file)

    def log_dict(self, run_id: str, data: Any, artifact_file: str) -> None:
        self.log_text(run_id, json.dumps(data, indent=2, default=str), artifact_file)

    def log_file(self, run_id: str, path: Path, artifact_path: str | None = None) -> None:
        """Log a file: text (an engine log, a report) scrubbed of secrets on the way; a file that is
        not UTF-8 text (a PNG figure) byte for byte."""
        if not path.exists():
            return
        name = f"{artifact_path}/{path.name}" if artifact_path else path.name
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            # binary: decoding it with replacement characters would corrupt it (the report's PNGs
            # were stored with their first byte replaced, and the MLflow UI showed broken images)
            self.client.log_artifact(run_id, str(path), artifact_path)
            return
        self.log_text(run_id, text, name)

    def read_artifact(self, run_id: str, artifact_file: str) -> bytes | None:
        """The bytes of one of the run's artifacts; None when the run has no such artifact."""
        with tempfile.TemporaryDirectory() as tmp:
            try:
                path = self.client.download_artifacts(run_id, artifact_file, tmp)
            except (MlflowException, OSError):
                return None
            return Path(path).read_bytes()

    def log_frame(self, run_id: str, frame: pd.DataFrame, artifact_file: str) -> None:
        """Log a table as parquet; text columns are scrubbed of secrets first."""
        frame = frame.copy()
        for column in frame.columns:
            if frame[column].dtype == object or pd.api.types.is_string_dtype(frame[column]):
                frame[column] = frame[column].map(lambda v: self.scrub(v) if isinstance(v, str) else v)
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp) / Path(artifact_file).name
            frame.to_parquet(local, index=False)
            parent = str(Path(artifact_file).parent)
            self.client.log_artifact(run_id, str(local), None if parent == "." else parent)

    def log_dataset(
        self,
        run_id: str,
        dataset: DatasetFields | Mapping[str, Any],
        context: str = "benchmark",
        schema: Mapping[str, Any] | None = None,
    ) -> None:
        """Log a dataset input of the run (MLflow's Datasets: name, digest, source, profile).

        ``dataset`` is any object with ``name``, ``digest``, ``source_type``, ``source`` and
        ``profile`` (a JSON-able mapping), or a mapping with those keys. The profile and the optional
        ``schema`` are stored as JSON; ``context`` is the input's ``mlflow.data.context`` tag.
        """
        keys = ("name", "digest", "source_type", "source", "profile")
        if isinstance(dataset, Mapping):
            fields = dict(dataset)
        else:
            fields = {key: getattr(dataset, key) for key in keys}
        missing = [k for k in keys[:4] if not fields.get(k)]
        if missing:
            raise TrackingError(f"a dataset input needs {', '.join(missing)}; got keys {sorted(fields)}")
        entity = Dataset(
            name=self.scrub(str(fields["name"])),
            digest=str(fields["digest"]),
            source_type=str(fields["source_type"]),
            source=self.scrub(str(fields["source"])),
            schema=self.scrub(json.dumps(schema, default=str)) if schema is not None else None,
            profile=self.scrub(json.dumps(fields.get("profile") or {}, default=str)),
        )
        tags = [InputTag(key=MLFLOW_DATASET_CONTEXT, value=context)]
        try:
            self.client.log_inputs(run_id, datasets=[DatasetInput(dataset=entity, tags=tags)])
        except MlflowException as exc:
            raise TrackingError(f"could not log dataset {entity.name!r} to run {run_id}: {exc}") from exc

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        """status: FINISHED, FAILED or KILLED."""
        self.client.set_terminated(run_id, status=status)

    def run_link(self, run_id: str) -> str:
        """A URL to the run when the tracking server is HTTP, else how to open it. The link asks for
        MLflow 3's model-training view: its UI otherwise opens every experiment in the GenAI view
        (a per-browser choice, whatever the experiment's kind tag says), where runs are
        "evaluation runs" and nesting is not shown."""
        if self.tracking_uri.startswith(("http://", "https://")):
            return f"{self._runs_url()}/{run_id}{_ML_VIEW}"
        return f"mlflow ui --backend-store-uri {self.tracking_uri}  (then open run {run_id})"

    def experiment_link(self) -> str:
        """The experiment's runs in the MLflow UI (an HTTP tracking server; '' otherwise)."""
        if not self.tracking_uri.startswith(("http://", "https://")):
            return ""
        return f"{self._runs_url()}{_ML_VIEW}"

    def _runs_url(self) -> str:
        return f"{self.tracking_uri.rstrip('/')}/#/experiments/{self.experiment_id}/runs"

    def recent_runs(
        self,
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
        runs = self.client.search_runs(
            [self.experiment_id],
            filter_string=" and ".join(filters),
            order_by=["attributes.start_time DESC"],
            max_results=max(limit * 10, 1000) if (engine or model or workload or variant) else limit * 10,
        )

        def wanted(run: Any) -> bool:
            if engine and run.data.tags.get("k3pipe.engine") != engine:
                return False
            return not (
                model and model not in (run.data.params.get("model_id"), run.data.params.get("model.id"))
            )

        def of_variant(run: Any) -> bool:
            tags = run.data.tags
            return not variant or (
                tags.get("k3pipe.variant") == variant
                or tags.get("k3pipe.experiment", "").endswith(f"@{variant}")
            )

        def study_rows(run: Any, indent: str = "") -> list[dict[str, Any]]:
            """A study's own row, then its arms (nested runs) each as the runs they are; none when
            the filters leave no arm row."""
            arms = sorted(self.children(run.info.run_id), key=lambda r: r.info.start_time)
            found = [row for arm in arms if wanted(arm) for row in self._run_rows(arm, indent=indent + "  ")]
            found = [r for r in found if not workload or r["workload"] == workload]
            if not found and (engine or model or workload):
                return []
            return [{**self._run_base(run, indent), "workload": "(study)"}, *found]

        rows: list[dict[str, Any]] = []
        seen = 0
        for run in runs:
            if run.data.tags.get("mlflow.parentRunId"):
                continue
            seen += 1
            if seen > limit:
                break
            kind = run.data.tags.get("k3pipe.kind")
            if kind == "retest":
                studies = sorted(self.children(run.info.run_id), key=lambda r: r.info.start_time)
                found = [row for st in studies if of_variant(st) for row in study_rows(st, indent="  ")]
                if not found and (engine or model or workload or variant):
                    seen -= 1
                    continue
                rows.append({**self._run_base(run), "workload": "(retest)"})
                rows.extend(found)
                continue
            found = (study_rows(run) if kind == "study" else self._run_rows(run)) if of_variant(run) else []
            if kind != "study":
                found = [r for r in found if wanted(run) and (not workload or r["workload"] == workload)]
            if not found:
                seen -= 1
                continue
            rows.extend(found)
        return pd.DataFrame(rows)

    @staticmethod
    def _run_base(run: Any, indent: str = "") -> dict[str, Any]:
        return {
            "run_id": run.info.run_id,
            "name": indent + str(run.info.run_name),
            "status": run.info.status,
            "start": pd.Timestamp(run.info.start_time, unit="ms").strftime("%Y-%m-%d %H:%M:%S"),
            "cold_start_s": run.data.metrics.get("cold_start_s"),
        }

    def _run_rows(self, run: Any, indent: str = "") -> list[dict[str, Any]]:
        base = self._run_base(run, indent)
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

    def children(self, run_id: str) -> list[Any]:
        return list(
            self.client.search_runs(
                [self.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{run_id}'"
            )
        )
