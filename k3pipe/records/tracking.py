"""The MLflow adapter: runs, params, metrics, tags, artifacts, and the recent-runs view.

Uses ``MlflowClient`` with explicit run ids (no fluent active-run state), so steps running in other
threads, as Prefect tasks do, log to the right run. Every string that reaches MLflow passes through
``scrub``: k3pipe's one scrubber (:mod:`k3pipe.core.secrets`), which replaces every registered secret (the
endpoint's key, an experiment's secrets, the values of its ``{env.NAME}`` references, those given to
the tracker) and masks credential-shaped text.

Every write goes to the spool first (``k3pipe.records.spool``: a journal per run under K3PIPE_HOME/spool),
then to MLflow. When MLflow stops answering (connection refused, a timeout, a 5xx after MLflow's
client's one retry), the tracker says so once and goes on recording into the spool only, trying
MLflow again at most every ``spool_retry_s``; ``k3pipe sync`` pushes what is left. A run created
while MLflow is down gets a local id (32 hex digits, as MLflow's) that sync maps to the id MLflow
gives it, translating references to it (a child's ``mlflow.parentRunId``, tags, params, text
artifacts). Runs the tracker opened and did not end are ended when it is closed or garbage
collected, and at the process's exit: ``KILLED`` (``FAILED`` after an uncaught exception).

Reading artifacts back tells "this run has no such artifact" (its artifacts are listed, the file is
not among them: :meth:`Tracker.find_artifact` gives None) from "the artifact store cannot be read"
(the root the run's record names does not exist here, or cannot be listed: ``ArtifactStoreError``).
A store brought from another machine (a GPU node's tarball) records that machine's paths; a tracker
made with ``read_artifacts_from=DIR`` reads each run's artifacts from ``DIR/<run_id>/artifacts``: DIR
takes the place of the part of the recorded artifact URI before ``<run_id>/artifacts`` (the
experiment's artifact location; in k3pipe's own stores K3PIPE_HOME/mlflow/artifacts).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import tempfile
import time
import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple, Protocol
from urllib.parse import unquote, urlparse

import pandas as pd
from mlflow import MlflowClient
from mlflow.entities import Dataset, Metric, Param, RunTag
from mlflow.exceptions import MlflowException

from k3pipe.core import secrets as _secrets
from k3pipe.core.errors import (
    ArtifactMissingError,
    ArtifactStoreError,
    TrackingError,
    TrackingUnreachableError,
)
from k3pipe.core.layout import LAYOUT_TAG, LAYOUT_VERSION
from k3pipe.core.procs import file_lock
from k3pipe.core.provenance import git_commit
from k3pipe.core.settings import Settings, apply_mlflow_client_defaults
from k3pipe.records.push import (
    Pusher,
    Writer,
    ensure_experiment,
    is_remote,
    is_transient,
    probe_tracking,
    unreachable_message,
)
from k3pipe.records.spool import IdMap, now_ms

__all__ = ["KEY_METRICS", "DatasetFields", "Tracker", "metric_name"]

log = logging.getLogger("k3pipe.records.tracking")

_PARAM_MAX = 6000
KEY_METRICS = (
    "ttft_ms_p50",
    "tpot_ms_p50",
    "e2e_ms_p50",
    "output_throughput_tps",
    "failed",
    "client_timing_bursty",
    "energy_j_per_output_token",
    "usd_per_m_output_tokens",
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


@functools.cache
def source_tags() -> dict[str, str]:
    """MLflow's source tags for every run: k3pipe as the source, its checkout's commit."""
    commit = git_commit()
    tags = {"mlflow.source.name": "k3pipe", "mlflow.source.type": "JOB"}
    if commit != "unknown":
        tags["mlflow.source.git.commit"] = commit.removesuffix("-dirty")
    return tags


def _local_path(uri: str) -> Path | None:
    """The local path a ``file:`` URI or a plain path names; None for a remote store (http, s3 ...)."""
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        return Path(unquote(parsed.path))
    return Path(uri) if parsed.scheme == "" else None


_MOVED_STORE_HINT = (
    "a store brought from another machine (a GPU node's record) is read with --artifact-root DIR "
    "(`k3pipe report`, `k3pipe compare`): DIR is the copy of its artifact root, the directory that holds "
    "<run_id>/artifacts/ (the record's mlflow/artifacts); otherwise check the store"
)


class _Place(NamedTuple):
    """Where a run's artifacts are read: ``root`` (shown) is the artifact root, ``location`` (shown)
    the run's own artifact directory or URI; ``root_dir`` and ``run_dir`` the local directories,
    None for a remote store."""

    root: str
    location: str
    root_dir: Path | None
    run_dir: Path | None


class Tracker:
    """Records runs in MLflow (SQLite in K3PIPE_HOME by default, any tracking URI otherwise)."""

    def __init__(
        self,
        tracking_uri: str,
        experiment: str,
        artifact_root: Path | None = None,
        secrets: Iterable[str] = (),
        *,
        spool_dir: Path | None = None,
        allow_spool: bool | None = None,
        settings: Settings | None = None,
        read_artifacts_from: Path | None = None,
    ) -> None:
        """``spool_dir`` (default K3PIPE_HOME/spool) keeps every write until MLflow has it;
        ``allow_spool`` (default the setting ``allow_spool``): a tracking server that does not
        answer now is no error, the run is recorded into the spool. Without it, such a server raises
        :class:`TrackingUnreachableError` within seconds (``False``: a command that reads, whose
        error does not offer the spool). ``read_artifacts_from``: read every run's
        artifacts from ``DIR/<run_id>/artifacts`` instead of where the store records them (a store
        moved from another machine); such a tracker writes no artifact."""
        settings = settings or Settings()
        self.tracking_uri = tracking_uri
        self.read_artifacts_from: Path | None = None
        if read_artifacts_from is not None:
            moved = read_artifacts_from.expanduser().resolve()
            if not moved.is_dir():
                raise TrackingError(
                    f"artifact root {moved} (--artifact-root) "
                    + ("is not a directory" if moved.exists() else "does not exist")
                    + ": give the directory that holds the moved store's <run_id>/artifacts/ "
                    "(the copy of the artifact root it records; in a GPU node's record, mlflow/artifacts)"
                )
            self.read_artifacts_from = moved
        self._artifact_uris: dict[str, str] = {}
        _secrets.register_all(secrets)
        _secrets.register_all(settings.client_credentials())  # the stack's password: never in a record
        # the first use of a new SQLite store creates its tables: several first runs at once on one
        # K3PIPE_HOME raced on that and broke the store for good; one process at a time does it
        lock: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        if tracking_uri.startswith("sqlite:///"):
            db = Path(tracking_uri.removeprefix("sqlite:///"))
            db.parent.mkdir(parents=True, exist_ok=True)
            lock = file_lock(db.with_name(db.name + ".lock"))
        if is_remote(tracking_uri):
            apply_mlflow_client_defaults()
        self.client = MlflowClient(tracking_uri=tracking_uri)
        self.experiment_name = experiment
        self.experiment_id: str | None = None
        timeout_s = settings.mlflow_probe_timeout_s
        reason = probe_tracking(tracking_uri, timeout_s)
        if reason is None:
            try:
                with lock:
                    self.experiment_id = ensure_experiment(
                        self.client, tracking_uri, experiment, artifact_root
                    )
            except MlflowException as exc:
                if not is_transient(exc):
                    raise TrackingError(
                        f"MLflow at {tracking_uri} refused experiment {experiment!r}: {exc}"
                    ) from exc
                reason = f"{exc}".splitlines()[0][:300]
        allowed = settings.allow_spool if allow_spool is None else allow_spool
        if reason is not None and not allowed:
            raise TrackingUnreachableError(
                unreachable_message(tracking_uri, reason, spool=allow_spool is not False)
            )
        self.spool_dir = spool_dir or settings.spool_dir()
        self.ids = IdMap(self.spool_dir)
        pusher = Pusher(
            self.client, tracking_uri, self.ids, experiment, artifact_root, experiment_id=self.experiment_id
        )
        meta = {
            "tracking_uri": tracking_uri,
            "experiment": experiment,
            "artifact_root": str(artifact_root.resolve()) if artifact_root else None,
        }
        # while MLflow is down a write tries it again at most every spool_retry_s, and waits at most
        # 2 s for it: the run is not held up
        retry_probe_s = min(timeout_s, 2.0)
        self._writer = Writer(
            self.spool_dir,
            meta,
            pusher,
            settings.spool_retry_s,
            lambda: probe_tracking(tracking_uri, retry_probe_s),
        )
        if reason is not None:
            self._writer.go_offline(reason)
        weakref.finalize(self, self._writer.close_at_exit)

    # -- the spool ---------------------------------------------------------------------------------

    @property
    def online(self) -> bool:
        """Whether MLflow answered the last write (False: writes go to the spool only)."""
        return self._writer.online

    @property
    def offline_since(self) -> float | None:
        """When (time.time()) MLflow was found down; None while it answers."""
        return self._writer.offline_since

    def pending(self) -> int:
        """How many of this tracker's writes are in the spool only."""
        return self._writer.pending()

    def open_runs(self) -> dict[str, str]:
        """The runs this tracker started and did not end (id -> name)."""
        return dict(self._writer.open_runs)

    def spooled_only(self, run_id: str) -> bool:
        """Whether ``run_id`` is a run of this tracker that MLflow does not have yet (created while
        it was down)."""
        return self._writer.spooled_only(run_id)

    def mlflow_id(self, run_id: str) -> str:
        """The MLflow id of a run this process knows by a local id (once sync gave it one)."""
        return self.ids.get(run_id)

    def flush(self) -> bool:
        """Push what the spool holds of this tracker now, also while MLflow was down (tried now,
        whatever the retry interval); whether MLflow has all of it."""
        return self._writer.flush()

    def close(self, status: str = "KILLED") -> None:
        """End the runs still open with ``status`` (in the spool, and in MLflow when it answers) and
        release the spool session. The tracker may be used again afterwards (a new session)."""
        self._writer.close(status)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        self.close("FAILED" if isinstance(exc, Exception) else "KILLED")

    def describe(self, run_id: str, text: str) -> None:
        """The run's description in the MLflow UI (Markdown), secrets scrubbed."""
        self.set_tags(run_id, {"mlflow.note.content": text})

    def add_secret(self, value: str | None) -> None:
        """Register a secret value that must never be written (anywhere: the scrubber is k3pipe's)."""
        _secrets.register(value)

    def scrub(self, text: str) -> str:
        """``text`` as MLflow may hold it: see :func:`k3pipe.core.secrets.scrub`."""
        return _secrets.scrub(text)

    def start_run(
        self,
        name: str,
        tags: Mapping[str, str] | None = None,
        parent_id: str | None = None,
        start_ms: int | None = None,
    ) -> str:
        """A new run; ``start_ms``: when what it records began (wall clock, ms; default: now), so that
        a run logged once its work is done still starts when that work did."""
        all_tags = {
            **source_tags(),
            LAYOUT_TAG: LAYOUT_VERSION,  # the names this run is written with (k3pipe.core.layout)
            **{k: self.scrub(str(v)) for k, v in (tags or {}).items()},
        }
        if parent_id:
            all_tags["mlflow.parentRunId"] = parent_id
        try:
            return self._writer.create(name, all_tags, start_ms)
        except MlflowException as exc:
            raise TrackingError(f"could not create MLflow run {name!r}: {exc}") from exc

    def log_params(self, run_id: str, params: Mapping[str, Any]) -> None:
        """Log params; a value too long for a param goes to params/NAME.txt and the param points there."""
        batch: list[Param] = []
        for key, value in params.items():
            text = self.scrub(value if isinstance(value, str) else json.dumps(value, default=str))
            if len(text) > _PARAM_MAX:
                self.log_text(run_id, text, f"params/{key}.txt")
                text = f"(long value: artifact params/{key}.txt)"
            batch.append(Param(metric_name(key), text))
        if batch:
            self._writer.write(run_id, "params", {"params": {p.key: p.value for p in batch}})

    def log_metrics(self, run_id: str, metrics: Mapping[str, float | int | None], step: int = 0) -> None:
        now = int(time.time() * 1000)
        batch = [
            Metric(metric_name(k), float(v), now, step)
            for k, v in metrics.items()
            if v is not None and v == v  # drop None and NaN
        ]
        if batch:
            rows = [[m.key, m.value, m.timestamp, m.step] for m in batch]
            self._writer.write(run_id, "metrics", {"metrics": rows})

    def set_tags(self, run_id: str, tags: Mapping[str, Any]) -> None:
        batch = [RunTag(k, self.scrub(str(v))) for k, v in tags.items() if v is not None]
        if batch:
            self._writer.write(run_id, "tags", {"tags": {t.key: t.value for t in batch}})

    def log_text(self, run_id: str, text: str, artifact_file: str) -> None:
        self._put_artifact(run_id, self.scrub(text).encode("utf-8"), artifact_file, text=True)

    def _put_artifact(self, run_id: str, content: Path | bytes, artifact_file: str, text: bool) -> None:
        """An artifact into the spool (a copy of the file, or the bytes), then to MLflow."""
        if self.read_artifacts_from is not None:
            # MLflow writes where the run's record says, which is not where this tracker reads
            raise TrackingError(
                f"cannot write artifact {artifact_file} of run {run_id}: this tracker reads the artifacts "
                f"of a moved store from {self.read_artifacts_from}, and MLflow would write it to the "
                "location the store records for the run, not there"
            )
        parent = str(Path(artifact_file).parent)
        data = {"dir": None if parent == "." else parent, "text": text}
        self._writer.write(run_id, "artifact", data, content, Path(artifact_file).name)

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
            self._put_artifact(run_id, path, name, text=False)
            return
        self.log_text(run_id, text, name)

    def read_artifact(self, run_id: str, artifact_file: str, *, required: bool = False) -> bytes | None:
        """The bytes of one of the run's artifacts; None when the run has no such artifact, or when
        its artifacts cannot be read at all. ``required``: raise instead, ``ArtifactMissingError``
        when the run has no such artifact (naming what it has), ``ArtifactStoreError`` when its
        artifact store cannot be read; see :meth:`find_artifact` for the two apart."""
        if not required:
            try:
                return self.find_artifact(run_id, artifact_file)
            except (TrackingError, MlflowException, OSError):
                return None
        data = self.find_artifact(run_id, artifact_file)
        if data is None:
            mlflow_id, place = self.mlflow_id(run_id), self._place(run_id)
            raise ArtifactMissingError(
                f"run {mlflow_id} has no artifact {artifact_file}: {self._holds(run_id, place)}; "
                f"{_MOVED_STORE_HINT}",
                run_id=mlflow_id, artifact=artifact_file, root=place.root, location=place.location,
            )  # fmt: skip
        return data

    def find_artifact(self, run_id: str, artifact_file: str) -> bytes | None:
        """The bytes of one of the run's artifacts; None when the run's artifacts can be read and
        this is not among them (a local run that logged no artifact has no directory of its own:
        none). ``ArtifactStoreError`` when they cannot be read: the artifact root does not exist
        here (a store moved from another machine, see ``read_artifacts_from``), or the run's
        artifacts cannot be listed or read."""
        mlflow_id = self.mlflow_id(run_id)
        place = self._place(run_id)

        def unreadable(why: str) -> ArtifactStoreError:
            return ArtifactStoreError(
                f"the artifacts of run {mlflow_id} cannot be read ({artifact_file} among them): {why}; "
                f"{_MOVED_STORE_HINT}",
                run_id=mlflow_id, artifact=artifact_file, root=place.root, location=place.location,
            )  # fmt: skip

        if place.root_dir is None or place.run_dir is None:  # a remote store: ask it
            parent = os.path.dirname(artifact_file) or None
            try:
                listed = {f.path for f in self.client.list_artifacts(mlflow_id, parent)}
            except Exception as exc:
                raise unreadable(f"listing {place.location} failed: {exc}") from exc
            if artifact_file not in listed:
                return None
            with tempfile.TemporaryDirectory() as tmp:
                try:
                    return Path(self.client.download_artifacts(mlflow_id, artifact_file, tmp)).read_bytes()
                except Exception as exc:
                    raise unreadable(f"downloading it from {place.location} failed: {exc}") from exc
        if not place.root_dir.is_dir():
            moved = self.read_artifacts_from is not None
            raise unreadable(
                f"the artifact root {place.root_dir} "
                + ("(--artifact-root) " if moved else f"that the MLflow store records ({place.location}) ")
                + ("is not a directory" if place.root_dir.exists() else "does not exist on this machine")
            )
        try:
            if not place.run_dir.is_dir():
                return None
            os.listdir(place.run_dir)  # a directory that cannot be listed is not an absent file
            target = place.run_dir / artifact_file
            return target.read_bytes() if target.is_file() else None
        except OSError as exc:
            raise unreadable(f"{place.run_dir}: {exc}") from exc

    def _place(self, run_id: str) -> _Place:
        """Where the run's artifacts are read (the recorded URI, or its place under
        ``read_artifacts_from``)."""
        mlflow_id = self.mlflow_id(run_id)
        uri = self._artifact_uris.get(mlflow_id)
        if uri is None:
            try:
                uri = str(self.client.get_run(mlflow_id).info.artifact_uri)
            except MlflowException as exc:
                raise TrackingError(f"no MLflow run {mlflow_id} in {self.tracking_uri}: {exc}") from exc
            self._artifact_uris[mlflow_id] = uri
        recorded = uri.rstrip("/")
        tail = f"/{mlflow_id}/artifacts"
        root = recorded.removesuffix(tail) if recorded.endswith(tail) else None
        if self.read_artifacts_from is not None:
            if root is None:
                moved = self.read_artifacts_from
                raise ArtifactStoreError(
                    f"run {mlflow_id}'s recorded artifact location {uri} does not end in "
                    f"<run_id>/artifacts, so it has no place under --artifact-root {moved}",
                    run_id=mlflow_id,
                    artifact="",
                    root=str(moved),
                    location=uri,
                )
            moved_dir = self.read_artifacts_from / mlflow_id / "artifacts"
            return _Place(str(self.read_artifacts_from), str(moved_dir), self.read_artifacts_from, moved_dir)
        run_dir = _local_path(recorded)
        if run_dir is None:
            return _Place(root or recorded, uri, None, None)
        root_dir = (_local_path(root) if root is not None else None) or run_dir
        return _Place(str(root_dir), str(run_dir), root_dir, run_dir)

    def _holds(self, run_id: str, place: _Place) -> str:
        """What the run's artifact directory holds, for a message."""
        try:
            if place.run_dir is not None:
                if not place.run_dir.is_dir():
                    return f"it has no artifact directory ({place.run_dir} does not exist)"
                names = sorted(p.name + ("/" if p.is_dir() else "") for p in place.run_dir.iterdir())
            else:
                names = sorted(f.path for f in self.client.list_artifacts(self.mlflow_id(run_id)))
        except Exception as exc:
            return f"its artifacts at {place.location} cannot be listed ({exc})"
        shown = ", ".join(names[:12]) + (f" and {len(names) - 12} more" if len(names) > 12 else "")
        return f"its artifacts at {place.location} are {shown or 'none'}"

    def check_artifact_root(self, run_id: str) -> None:
        """With ``read_artifacts_from``: ``ArtifactStoreError`` unless that directory holds the
        artifacts of the run or of a run nested under it (a study's arms, workloads and repeats; a
        retest's studies). Without it, nothing to check."""
        moved = self.read_artifacts_from
        if moved is None:
            return
        top = self.mlflow_id(run_id)
        todo, looked = [top], 0
        while todo:
            current = todo.pop(0)
            looked += 1
            if (moved / current / "artifacts").is_dir():
                return
            todo += [child.info.run_id for child in self.children(current)]
        run = self.client.get_run(top)
        hint = ""
        if (moved / str(run.info.experiment_id) / top).is_dir():  # MLflow's default layout
            hint = f" ({moved / str(run.info.experiment_id)} holds it: give that directory)"
        recorded = run.info.artifact_uri.rstrip("/").removesuffix(f"/{top}/artifacts")
        raise ArtifactStoreError(
            f"--artifact-root {moved} holds the artifacts of none of the {looked} run(s) of {top} "
            f"(looked for {moved}/<run_id>/artifacts){hint}: give the directory that holds them, the copy "
            f"of the artifact root the store records ({recorded}; in a GPU node's record, mlflow/artifacts)",
            run_id=top, artifact="", root=str(moved), location=str(moved / top / "artifacts"),
        )  # fmt: skip

    def log_frame(self, run_id: str, frame: pd.DataFrame, artifact_file: str) -> None:
        """Log a table as parquet; text columns are scrubbed of secrets first."""
        frame = frame.copy()
        for column in frame.columns:
            if frame[column].dtype == object or pd.api.types.is_string_dtype(frame[column]):
                frame[column] = frame[column].map(lambda v: self.scrub(v) if isinstance(v, str) else v)
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp) / Path(artifact_file).name
            frame.to_parquet(local, index=False)
            self._put_artifact(run_id, local, artifact_file, text=False)

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
        fields = {
            "name": entity.name,
            "digest": entity.digest,
            "source_type": entity.source_type,
            "source": entity.source,
            "schema": entity.schema,
            "profile": entity.profile,
        }
        try:
            self._writer.write(run_id, "dataset", {"dataset": fields, "context": context})
        except MlflowException as exc:
            raise TrackingError(f"could not log dataset {entity.name!r} to run {run_id}: {exc}") from exc

    def end_run(self, run_id: str, status: str = "FINISHED", end_ms: int | None = None) -> None:
        """status: FINISHED, FAILED or KILLED; ``end_ms``: when its work ended (wall clock, ms;
        default: now, also when sync pushes it later)."""
        end = now_ms() if end_ms is None else int(end_ms)
        self._writer.write(run_id, "end", {"status": status, "end_ms": end})

    def run_link(self, run_id: str) -> str:
        """A URL to the run when the tracking server is HTTP, else how to open it. The link asks for
        MLflow 3's model-training view: its UI otherwise opens every experiment in the GenAI view
        (a per-browser choice, whatever the experiment's kind tag says), where runs are
        "evaluation runs" and nesting is not shown."""
        run_id = self.mlflow_id(run_id)
        if self.spooled_only(run_id):
            return f"run {run_id} is in the spool only (MLflow was down): `k3pipe sync` pushes it"
        if self.tracking_uri.startswith(("http://", "https://")):
            return f"{self._runs_url()}/{run_id}{_ML_VIEW}"
        return f"mlflow ui --backend-store-uri {self.tracking_uri}  (then open run {run_id})"

    def experiment_link(self) -> str:
        """The experiment's runs in the MLflow UI (an HTTP tracking server; '' otherwise)."""
        if not self.tracking_uri.startswith(("http://", "https://")):
            return ""
        return f"{self._runs_url()}{_ML_VIEW}"

    def _runs_url(self) -> str:
        experiment = self.experiment_id or self.require_experiment_id()
        return f"{self.tracking_uri.rstrip('/')}/#/experiments/{experiment}/runs"

    def require_experiment_id(self) -> str:
        """The experiment's id; an error that says so when MLflow has been down since the start."""
        if self.experiment_id is None:
            try:
                self.experiment_id = self._writer.pusher.experiment_id
            except MlflowException as exc:
                raise TrackingError(
                    f"MLflow at {self.tracking_uri} is not reachable, so its runs cannot be read: {exc}"
                ) from exc
        return self.experiment_id

    def children(self, run_id: str) -> list[Any]:
        parent = f"tags.mlflow.parentRunId = '{self.mlflow_id(run_id)}'"
        return list(self.client.search_runs([self.require_experiment_id()], filter_string=parent))
