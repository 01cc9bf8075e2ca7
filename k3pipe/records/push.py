"""The spool's way to MLflow: the :class:`Pusher` replays a run's journal (k3pipe.records.spool) into MLflow,
each record once, with the run ids MLflow gave; the :class:`Writer` puts every write of a tracker
into the journal first, then pushes it, and goes offline (spool only, trying MLflow again at most
every ``retry_s``) when MLflow stops answering. ``k3pipe sync`` pushes what is left with the same
:class:`Pusher`. The probes here tell a tracking server that answers from one that does not, and a
write MLflow refused (4xx: trying again cannot mend it) from one it could not take (down).

:mod:`k3pipe.records.tracking` is the MLflow adapter built on this; this module knows nothing of reports,
studies or runs views.
"""

from __future__ import annotations

import logging
import os
import ssl
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import httpx
import requests
from mlflow import MlflowClient
from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param, RunTag
from mlflow.environment_variables import MLFLOW_TRACKING_INSECURE_TLS, MLFLOW_TRACKING_SERVER_CERT_PATH
from mlflow.exceptions import MlflowException
from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

from k3pipe.core.errors import TrackingError
from k3pipe.records.spool import IdMap, Journal, SessionDir, new_run_id, now_ms

__all__ = [
    "EXPERIMENT_TAGS",
    "Pusher",
    "Writer",
    "ensure_experiment",
    "is_remote",
    "is_transient",
    "probe_tracking",
    "unreachable_message",
]

log = logging.getLogger("k3pipe.records.tracking")  # the tracker's voice: its spool and pushes are its own

EXPERIMENT_TAGS = {
    "mlflow.experimentKind": "custom_model_development",
    "mlflow.note.content": (
        "k3pipe: inference-engine runs. One run per engine arm (nested: its workloads and repeats); a "
        "study's parent run holds its arms and its report (report/report.html)."
    ),
}


def is_remote(tracking_uri: str) -> bool:
    return tracking_uri.startswith(("http://", "https://"))


def probe_tracking(tracking_uri: str, timeout_s: float = 5.0) -> str | None:
    """None when the tracking server at ``tracking_uri`` answers (or the store is local: SQLite, a
    directory); else why not, in a few words ("connection refused")."""
    if not is_remote(tracking_uri):
        return None
    try:
        verify = _tls_verify()
    except (OSError, ssl.SSLError) as exc:
        return (
            f"MLFLOW_TRACKING_SERVER_CERT_PATH={_setting(MLFLOW_TRACKING_SERVER_CERT_PATH)} is no CA file "
            f"it can read ({exc}); copy the stack's ca.pem there"
        )
    try:
        answer = httpx.get(f"{tracking_uri.rstrip('/')}/health", timeout=timeout_s, verify=verify)
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


def _setting(variable: Any) -> Any:
    """An MLflow environment setting's value, parsed as MLflow parses it (its ``get`` is untyped)."""
    return variable.get()


def _tls_verify() -> ssl.SSLContext | bool:
    """What MLflow's own client trusts for an https tracking server, so that the probe agrees with it:
    the CA in MLFLOW_TRACKING_SERVER_CERT_PATH (a team stack's own: ``k3pipe stack env``), nothing
    with MLFLOW_TRACKING_INSECURE_TLS, else the default (MLflow reads both settings itself)."""
    if _setting(MLFLOW_TRACKING_INSECURE_TLS):
        return False
    cafile = _setting(MLFLOW_TRACKING_SERVER_CERT_PATH)
    return ssl.create_default_context(cafile=cafile) if cafile else True


def unreachable_message(tracking_uri: str, reason: str, *, spool: bool = True) -> str:
    """The one sentence a command that cannot reach MLflow says: one that records (``spool``) may
    record locally instead; one that reads (runs, report, history, compare) has nothing to read."""
    if not spool:
        return (
            f"MLflow at {tracking_uri} is not reachable ({reason}): start it, or point "
            "MLFLOW_TRACKING_URI (or K3PIPE_MLFLOW_TRACKING_URI) at the tracking server that holds the runs"
        )
    return (
        f"MLflow at {tracking_uri} is not reachable ({reason}): start it, or set K3PIPE_ALLOW_SPOOL=1 "
        "(or pass --spool) to record locally and push later with `k3pipe sync`"
    )


def is_transient(exc: BaseException) -> bool:
    """Whether a failed write means MLflow is down (connection, timeout, 5xx), not that it refused
    the write (4xx: a param changed, a run that does not exist), which trying again cannot mend."""
    if isinstance(exc, MlflowException):
        status: int = exc.get_http_status_code()  # type: ignore[no-untyped-call]
        return status >= 500
    return isinstance(exc, OSError | requests.exceptions.RequestException | httpx.HTTPError)


# What MLflow's SQL store answers when two writers insert the same row at once (its look for an
# existing row and its insert are not atomic): PostgreSQL (psycopg2), SQLite, MySQL
_UNIQUE_VIOLATION = ("UniqueViolation", "duplicate key value violates unique constraint",
                     "UNIQUE constraint failed", "Duplicate entry")  # fmt: skip


def _lost_a_create_race(exc: MlflowException) -> bool:
    """Whether ``exc`` is MLflow's SQL store refusing a row that another writer inserted first (a
    fleet study's two nodes logging one dataset: "(psycopg2.errors.UniqueViolation) duplicate key
    value violates unique constraint", seen 2026-12-07 on the team stack's PostgreSQL)."""
    return any(mark in str(exc) for mark in _UNIQUE_VIOLATION)


def ensure_experiment(client: MlflowClient, tracking_uri: str, name: str, artifact_root: Path | None) -> str:
    """The experiment's id, created (with :data:`EXPERIMENT_TAGS`) when missing."""
    found = client.get_experiment_by_name(name)
    if found is None:
        # a local store keeps artifacts under K3PIPE_HOME; a tracking server decides itself
        # (its proxied artifact store), so that no worker writes artifacts to its own disk
        local = not tracking_uri.startswith(("http://", "https://", "databricks"))
        location = artifact_root.resolve().as_uri() if artifact_root and local else None
        try:
            return str(client.create_experiment(name, artifact_location=location, tags=EXPERIMENT_TAGS))
        except MlflowException as exc:
            # another process (a node's launch, on a tracking server) created it since the look
            if exc.error_code != "RESOURCE_ALREADY_EXISTS" and not _lost_a_create_race(exc):
                raise
            found = client.get_experiment_by_name(name)
            if found is None:
                raise
    missing = {k: v for k, v in EXPERIMENT_TAGS.items() if k not in found.tags}
    for key, value in missing.items():
        client.set_experiment_tag(found.experiment_id, key, value)
    return str(found.experiment_id)


_Record = Mapping[str, Any]


class Pusher:
    """Pushes spooled records (k3pipe.records.spool) to one tracking URI, in order and idempotently: a record
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
        inputs = [DatasetInput(dataset=entity, tags=tags)]
        try:
            self.client.log_inputs(run_id, datasets=inputs)
        except MlflowException as exc:
            if not _lost_a_create_race(exc):
                raise
            # Another run (a launch on another node, at the same moment) created the same dataset between
            # this call's look for it and its insert: MLflow rolled this call back whole, and the
            # dataset is there now, so the same call links it (MLflow reuses a dataset of the same
            # name and digest, and an input already linked)
            self.client.log_inputs(run_id, datasets=inputs)

    def _push_end(self, run_id: str, journal: Journal, record: _Record, uncertain: bool) -> None:
        self.client.set_terminated(run_id, status=record["status"], end_time=int(record["end_ms"]))


class Writer:
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

    def create(self, name: str, tags: Mapping[str, str], start_ms: int | None = None) -> str:
        """A new run, started ``start_ms`` (wall clock, ms; default: now)."""
        with self._mutex:
            local = new_run_id()
            journal = self.journal(local, new=True)
            start = now_ms() if start_ms is None else int(start_ms)
            seq = journal.append("create", {"name": name, "tags": dict(tags), "start_ms": start})
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
