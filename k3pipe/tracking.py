"""The MLflow adapter: runs, params, metrics, tags, artifacts, and the recent-runs view.

Uses ``MlflowClient`` with explicit run ids (no fluent active-run state), so steps running in other
threads, as Prefect tasks do, log to the right run. Every string that reaches MLflow passes through
``scrub``: k3pipe's one scrubber (:mod:`k3pipe.secrets`), which replaces every registered secret (the
endpoint's key, an experiment's secrets, the values of its ``{env.NAME}`` references, those given to
the tracker) and masks credential-shaped text.

Every write goes to the spool first (``k3pipe.spool``: a journal per run under K3PIPE_HOME/spool),
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
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple, Protocol
from urllib.parse import unquote, urlparse

import httpx
import pandas as pd
import requests
from mlflow import MlflowClient
from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

from k3pipe import secrets as _secrets
from k3pipe.errors import ArtifactMissingError, ArtifactStoreError, TrackingError, TrackingUnreachableError
from k3pipe.procs import file_lock
from k3pipe.provenance import git_commit
from k3pipe.settings import Settings, apply_mlflow_client_defaults
from k3pipe.spool import IdMap, Journal, SessionDir, new_run_id, now_ms

__all__ = ["KEY_METRICS", "DatasetFields", "Pusher", "Tracker", "metric_name", "probe_tracking"]

log = logging.getLogger("k3pipe.tracking")

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


def is_remote(tracking_uri: str) -> bool:
    return tracking_uri.startswith(("http://", "https://"))


def probe_tracking(tracking_uri: str, timeout_s: float = 5.0) -> str | None:
    """None when the tracking server at ``tracking_uri`` answers (or the store is local: SQLite, a
    directory); else why not, in a few words ("connection refused")."""
    if not is_remote(tracking_uri):
        return None
    try:
        answer = httpx.get(f"{tracking_uri.rstrip('/')}/health", timeout=timeout_s)
    except httpx.TimeoutException:
        return f"no answer within {timeout_s:g} s"
    except httpx.HTTPError as exc:
        cause: BaseException | None = exc
        while cause is not None:
            if isinstance(cause, ConnectionRefusedError) or "refused" in str(cause).lower():
                return "connection refused"
            cause = cause.__cause__ or cause.__context__
        return f"{type(exc).__name__}: {exc}"
    if answer.status_code >= 500:
        return f"it answered HTTP {answer.status_code}"
    return None  # anything else is a server that answers (a /health behind a path prefix may 404)


def unreachable_message(tracking_uri: str, reason: str) -> str:
    """The one sentence a run that cannot start says."""
    return (
        f"MLflow at {tracking_uri} is not reachable ({reason}): start it, or set K3PIPE_ALLOW_SPOOL=1 "
        "(or pass --spool) to record locally and push later with `k3pipe sync`"
    )


def is_transient(exc: BaseException) -> bool:
    """Whether a failed write means MLflow is down (connection, timeout, 5xx), not that it refused
    the write (4xx: a param changed, a run that does not exist), which trying again cannot mend."""
    if isinstance(exc, MlflowException):
        return exc.get_http_status_code() >= 500
    return isinstance(exc, OSError | requests.exceptions.RequestException | httpx.HTTPError)


def ensure_experiment(client: MlflowClient, tracking_uri: str, name: str, artifact_root: Path | None) -> str:
    """The experiment's id, created (with :data:`EXPERIMENT_TAGS`) when missing."""
    found = client.get_experiment_by_name(name)
    if found is None:
        # a local store keeps artifacts under K3PIPE_HOME; a tracking server decides itself
        # (its proxied artifact store), so that no worker writes artifacts to its own disk
        local = not tracking_uri.startswith(("http://", "https://", "databricks"))
        location = artifact_root.resolve().as_uri() if artifact_root and local else None
        return str(client.create_experiment(name, artifact_location=location, tags=EXPERIMENT_TAGS))
    missing = {k: v for k, v in EXPERIMENT_TAGS.items() if k not in found.tags}
    for key, value in missing.items():
        client.set_experiment_tag(found.experiment_id, key, value)
    return str(found.experiment_id)


_Record = Mapping[str, Any]


class Pusher:
    """Pushes spooled records (k3pipe.spool) to one tracking URI, in order and idempotently: a record
    that was being pushed when a push failed or the process died is checked against MLflow first
    (a run is looked up by name and start time, metrics already logged are skipped)."""

    def __init__(
        self,
        client: MlflowClient,
        tracking_uri: str,
        ids: IdMap,
        experiment: str,
        artifact_root: Path | None = None,
        experiment_id: str | None = None,
    ) -> None:
        self.client = client
        self.tracking_uri = tracking_uri
        self.ids = ids
        self.experiment = experiment
        self.artifact_root = artifact_root
        self._experiment_id = experiment_id
        self.records = 0
        self.artifacts = 0
        self.created: list[tuple[str, str, str]] = []
        """(run name, local id, MLflow id) of runs this pusher created from the spool."""

    @property
    def experiment_id(self) -> str:
        if self._experiment_id is None:
            self._experiment_id = ensure_experiment(
                self.client, self.tracking_uri, self.experiment, self.artifact_root
            )
        return self._experiment_id

    def run_id(self, journal: Journal) -> str | None:
        """The MLflow id of the journal's run; None while its creation is not pushed."""
        if journal.created_here:
            return journal.progress.mlflow_id
        return self.ids.get(journal.run_id)

    def push(self, journal: Journal, record: Mapping[str, Any], handed_out: bool = True) -> None:
        """Push one record, the next of its journal. ``handed_out``: the run's local id was returned
        to the caller (the run was created while MLflow was down), so sync must map it."""
        seq = int(record["seq"])
        uncertain = journal.uncertain(seq)
        journal.mark_inflight(seq)
        op = record["op"]
        if op == "create":
            real = self._create(record, uncertain)
            journal.mark_mlflow_id(real)
            if handed_out:
                self.ids.add(journal.run_id, real)
                self.created.append((str(record["name"]), journal.run_id, real))
        else:
            run_id = self.run_id(journal)
            if run_id is None:
                raise TrackingError(f"spool journal {journal.dir} has records before its run's creation")
            getattr(self, f"_push_{op}")(run_id, journal, record, uncertain)
        journal.mark_pushed(seq)
        self.records += 1
        if "file" in record:
            journal.file(record).unlink(missing_ok=True)
            self.artifacts += 1

    def _create(self, record: Mapping[str, Any], uncertain: bool) -> str:
        tags = {k: self.ids.translate(str(v)) for k, v in record["tags"].items()}
        start = int(record["start_ms"])
        if uncertain:  # the create may have reached MLflow before the answer was lost
            for run in self.client.search_runs(
                [self.experiment_id], filter_string=f"attributes.start_time = {start}"
            ):
                same_parent = run.data.tags.get("mlflow.parentRunId") == tags.get("mlflow.parentRunId")
                if run.info.run_name == record["name"] and same_parent:
                    return str(run.info.run_id)
        run = self.client.create_run(self.experiment_id, start_time=start, tags=tags, run_name=record["name"])
        return str(run.info.run_id)

    def _push_params(self, run_id: str, journal: Journal, record: _Record, uncertain: bool) -> None:
        batch = [Param(k, self.ids.translate(str(v))) for k, v in record["params"].items()]
        for i in range(0, len(batch), 100):
            self.client.log_batch(run_id, params=batch[i : i + 100])

    def _push_metrics(self, run_id: str, journal: Journal, record: _Record, uncertain: bool) -> None:
        batch = [Metric(str(k), float(v), int(ts), int(step)) for k, v, ts, step in record["metrics"]]
        if uncertain:  # MLflow keeps every value logged: never log one twice
            logged = {
                (m.key, m.timestamp, m.step, m.value)
                for key in {m.key for m in batch}
                for m in self.client.get_metric_history(run_id, key)
            }
            batch = [m for m in batch if (m.key, m.timestamp, m.step, m.value) not in logged]
        for i in range(0, len(batch), 500):
            self.client.log_batch(run_id, metrics=batch[i : i + 500])

    def _push_tags(self, run_id: str, journal: Journal, record: _Record, uncertain: bool) -> None:
        batch = [RunTag(k, self.ids.translate(str(v))) for k, v in record["tags"].items()]
        if batch:
            self.client.log_batch(run_id, tags=batch)

    def _push_artifact(
        self, run_id: str, journal: Journal, record: Mapping[str, Any], uncertain: bool
    ) -> None:
        path = journal.file(record)
        if record.get("text"):
            text = path.read_text(encoding="utf-8")
            translated = self.ids.translate(text)
            if translated != text:  # a run id made while MLflow was down: the one MLflow gave it
                with tempfile.TemporaryDirectory() as tmp:
                    local = Path(tmp) / path.name
                    local.write_text(translated, encoding="utf-8")
                    self.client.log_artifact(run_id, str(local), record.get("dir"))
                return
        self.client.log_artifact(run_id, str(path), record.get("dir"))

    def _push_dataset(self, run_id: str, journal: Journal, record: _Record, uncertain: bool) -> None:
        fields = record["dataset"]
        entity = Dataset(
            name=fields["name"],
            digest=fields["digest"],
            source_type=fields["source_type"],
            source=fields["source"],
            schema=fields.get("schema"),
            profile=fields.get("profile"),
        )
        tags = [InputTag(key=MLFLOW_DATASET_CONTEXT, value=record["context"])]
        self.client.log_inputs(run_id, datasets=[DatasetInput(dataset=entity, tags=tags)])

    def _push_end(self, run_id: str, journal: Journal, record: _Record, uncertain: bool) -> None:
        self.client.set_terminated(run_id, status=record["status"], end_time=int(record["end_ms"]))


class _Writer:
    """The spool session of one tracker: appends each write to its run's journal, pushes what is
    pending while MLflow answers, goes offline (said once) when it stops answering, and ends the runs
    left open when it is closed. Holds no reference to the Tracker, so that the Tracker's
    finalizer can close it."""

    def __init__(
        self,
        spool_dir: Path,
        meta: dict[str, Any],
        pusher: Pusher,
        retry_s: float,
        probe: Callable[[], str | None],
    ) -> None:
        self.spool_dir = spool_dir
        self.meta = meta
        self.pusher = pusher
        self.retry_s = retry_s
        self.probe = probe
        self.session: SessionDir | None = None
        self._journals: dict[str, Journal] = {}
        self._pending: dict[str, Journal] = {}
        self._order = 0
        self.open_runs: dict[str, str] = {}
        self.online = True
        self.offline_since: float | None = None
        """time.time() when MLflow was last found down; None while it answers."""
        self.outages = 0
        self._retry_at = 0.0
        self._mutex = threading.RLock()
        self._pid = os.getpid()

    # -- the session -------------------------------------------------------------------------------

    def _session(self) -> SessionDir:
        if self.session is None:
            self.session = SessionDir.create(self.spool_dir, self.meta)
        return self.session

    def journal(self, run_id: str, new: bool = False) -> Journal:
        found = None if new else self._journals.get(run_id)
        if found is None:
            self._order += 1
            found = Journal.create(self._session().dir, self._order, run_id)
            self._journals[run_id] = found
        return found

    def pending(self) -> int:
        return sum(j.pending for j in self._pending.values())

    def spooled_only(self, run_id: str) -> bool:
        """Whether ``run_id`` is a run this writer created that MLflow does not have yet."""
        journal = self._journals.get(run_id)
        return journal is not None and journal.created_here and journal.progress.mlflow_id is None

    # -- writing -----------------------------------------------------------------------------------

    def create(self, name: str, tags: Mapping[str, str]) -> str:
        with self._mutex:
            local = new_run_id()
            journal = self.journal(local, new=True)
            seq = journal.append("create", {"name": name, "tags": dict(tags), "start_ms": now_ms()})
            self._pending[journal.dir.name] = journal
            self._push(journal, seq)
            run_id = journal.progress.mlflow_id or local
            self._journals[run_id] = journal
            self.open_runs[run_id] = name
            return run_id

    def write(
        self, run_id: str, op: str, data: Mapping[str, Any], file: Path | bytes | None = None, name: str = ""
    ) -> None:
        with self._mutex:
            journal = self.journal(run_id)
            seq = journal.append(op, data, file, name)
            self._pending[journal.dir.name] = journal
            self._push(journal, seq)
            if op == "end":
                self.open_runs.pop(run_id, None)

    def flush(self) -> bool:
        """Push what is pending now (MLflow down: try it now, whatever the retry interval); whether
        MLflow has everything."""
        with self._mutex:
            self._retry_at = 0.0
            self._push(None, 0)
            return self.online and self.pending() == 0

    def _push(self, live: Journal | None, live_seq: int) -> None:
        """Push every pending record in order (the one just written last), unless MLflow is down
        and it is not yet time to try it again. A record MLflow refuses (4xx) is set aside in the
        spool; the one just written raises, as a direct write would."""
        if not self.online:
            if time.monotonic() < self._retry_at:
                return
            reason = self.probe()
            if reason is not None:
                self._retry_at = time.monotonic() + self.retry_s
                return
        refused: BaseException | None = None
        try:
            for journal in sorted(self._pending.values(), key=lambda j: j.order):
                for record in journal.records():
                    is_live = journal is live and int(record["seq"]) == live_seq
                    try:
                        self.pusher.push(journal, record, handed_out=not is_live)
                    except Exception as exc:
                        if is_transient(exc):
                            raise
                        journal.mark_pushed(int(record["seq"]), refused=f"{type(exc).__name__}: {exc}"[:2000])
                        if is_live:
                            refused = exc
                        else:
                            log.warning("MLflow refused a spooled %s record of run %s: %s",
                                        record["op"], journal.run_id, exc)  # fmt: skip
                if not journal.pending:
                    self._pending.pop(journal.dir.name, None)
        except Exception as exc:
            if not is_transient(exc):
                raise
            self._go_offline(exc)
            return
        if not self.online:
            self.online, self.offline_since = True, None
            log.warning(
                "MLflow at %s answers again: the spooled records are pushed", self.pusher.tracking_uri
            )
        if refused is not None:
            raise refused

    def go_offline(self, reason: str) -> None:
        with self._mutex:
            self._go_offline(reason)

    def _go_offline(self, why: BaseException | str) -> None:
        self._retry_at = time.monotonic() + self.retry_s
        if not self.online:
            return
        self.online = False
        self.offline_since = time.time()
        self.outages += 1
        reason = why if isinstance(why, str) else f"{type(why).__name__}: {why}"
        where = self.session.dir if self.session is not None else self.spool_dir
        log.warning(
            "MLflow at %s is not answering (%s): the run goes on and k3pipe records into the spool "
            "(%s), trying MLflow again every %g s; `k3pipe sync` pushes what is left",
            self.pusher.tracking_uri, reason.splitlines()[0][:300], where, self.retry_s,
        )  # fmt: skip

    # -- the end -----------------------------------------------------------------------------------

    def close(self, status: str = "KILLED") -> None:
        """End the runs still open (``status``), release the session and remove it once nothing of
        it is pending."""
        with self._mutex:
            for run_id in list(self.open_runs):
                try:
                    self.write(run_id, "end", {"status": status, "end_ms": now_ms()})
                except Exception as exc:  # the end is in the spool; MLflow refused it
                    log.warning("could not end run %s in MLflow: %s", run_id, exc)
                    self.open_runs.pop(run_id, None)
            if self.session is None:
                return
            if self.pending() == 0:
                kept = self.session.retire()
                if kept is not None:
                    log.warning("records MLflow refused are kept in %s", kept)
            else:
                log.warning(
                    "%d record(s) of this run are only in the spool (%s): `k3pipe sync` pushes them to %s",
                    self.pending(), self.session.dir, self.pusher.tracking_uri,
                )  # fmt: skip
            self.session.release()
            self.session = None
            self._journals.clear()
            self._pending.clear()

    def close_at_exit(self) -> None:
        """The process is ending (or the tracker was dropped): the runs left open are cut short;
        FAILED when an uncaught exception is ending it. A forked child leaves its parent's runs be."""
        if os.getpid() != self._pid:
            return
        failed = isinstance(getattr(sys, "last_value", None), Exception)
        self.close("FAILED" if failed else "KILLED")


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
        :class:`TrackingUnreachableError` within seconds. ``read_artifacts_from``: read every run's
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
            raise TrackingUnreachableError(unreachable_message(tracking_uri, reason))
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
        self._writer = _Writer(
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
        """``text`` as MLflow may hold it: see :func:`k3pipe.secrets.scrub`."""
        return _secrets.scrub(text)

    def start_run(
        self, name: str, tags: Mapping[str, str] | None = None, parent_id: str | None = None
    ) -> str:
        all_tags = {**source_tags(), **{k: self.scrub(str(v)) for k, v in (tags or {}).items()}}
        if parent_id:
            all_tags["mlflow.parentRunId"] = parent_id
        try:
            return self._writer.create(name, all_tags)
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

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        """status: FINISHED, FAILED or KILLED (the end time is now, also when sync pushes it later)."""
        self._writer.write(run_id, "end", {"status": status, "end_ms": now_ms()})

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
            [self.require_experiment_id()],
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
        parent = f"tags.mlflow.parentRunId = '{self.mlflow_id(run_id)}'"
        return list(self.client.search_runs([self.require_experiment_id()], filter_string=parent))
