"""``k3pipe sync``: push what the spool holds (k3pipe.records.spool) to MLflow.

Sessions are pushed oldest first, each run's journal in order, each record once: a journal's
progress is recorded as it goes, so that running sync again, or after a crash mid-sync, neither
loses nor duplicates a record. A session whose tracker is still running (its lock is held) is left
to it. A tracking server that does not answer is probed once, said once, and its sessions stay
pending.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from mlflow import MlflowClient

from k3pipe.core.layout import ERROR_TAG
from k3pipe.core.settings import apply_mlflow_client_defaults
from k3pipe.records.push import Pusher, is_remote, is_transient, probe_tracking
from k3pipe.records.spool import IdMap, Journal, list_sessions, try_lock, unlock

__all__ = ["ABANDONED", "AbandonedRun", "SyncReport", "sync_spool"]

log = logging.getLogger("k3pipe.records.sync")


@dataclass(frozen=True)
class AbandonedRun:
    """A run a process created and never ended, ended KILLED by a sync."""

    pid: int | None
    """The process that created it (its session's)."""
    name: str
    run_id: str
    """Its MLflow id (its local id while MLflow has not got it)."""


@dataclass
class SyncReport:
    """What a sync pushed, and what is still pending."""

    runs: dict[str, str] = field(default_factory=dict)
    """MLflow id -> what this sync did to the run (its name; the local id it replaces)."""
    records: int = 0
    artifacts: int = 0
    refused: list[str] = field(default_factory=list)
    """Records MLflow refused (4xx): set aside, not retried."""
    pending: int = 0
    """Records still only in the spool."""
    abandoned: int = 0
    """Runs whose process died without ending them (SIGKILL, a crash): ended KILLED here."""
    closed: list[AbandonedRun] = field(default_factory=list)
    """Those runs, each with the process that left it."""
    kept: list[str] = field(default_factory=list)
    """Sessions done but for refused records, moved to spool/refused/ (these paths)."""
    unreadable: list[str] = field(default_factory=list)
    """Sessions whose session.json could not be read (left in place)."""
    busy: list[str] = field(default_factory=list)
    """Sessions still being written by a running k3pipe (left to it)."""
    down: dict[str, str] = field(default_factory=dict)
    """Tracking URI -> why it could not be reached."""

    @property
    def done(self) -> bool:
        return self.pending == 0

    def lines(self) -> list[str]:
        """The report for people."""
        out = [f"pushed {len(self.runs)} run(s): {self.records} record(s), {self.artifacts} artifact(s)"]
        out += [f"  MLflow run {real}: {what}" for real, what in self.runs.items()]
        if self.abandoned:
            out.append(
                f"ended {self.abandoned} run(s) KILLED whose process died without ending them "
                "(at their last record's time):"
            )
            out += [
                f"  MLflow run {run.run_id} ({run.name}) of k3pipe process {run.pid or '?'}"
                for run in self.closed
            ]
        out += [f"  refused by MLflow (left out): {why}" for why in self.refused]
        out += [f"  the refused records are kept in {path}" for path in self.kept]
        if self.pending:
            out.append(f"still pending: {self.pending} record(s)")
            out += [
                f"  MLflow at {uri} is not reachable ({why}): start it and run `k3pipe sync` again"
                for uri, why in self.down.items()
            ]
            out += [f"  session {name} is still being written by a running k3pipe" for name in self.busy]
            out += [f"  session {name}: its session.json cannot be read" for name in self.unreadable]
        else:
            out.append("nothing pending")
        return out


def sync_spool(
    spool_dir: Path,
    *,
    probe_timeout_s: float = 5.0,
) -> SyncReport:
    """Push every pending journal under ``spool_dir`` to the tracking URI it was recorded for;
    remove each session once all of it is in MLflow."""
    report = SyncReport()
    ids = IdMap(spool_dir)
    pushers: dict[tuple[str, str], Pusher] = {}
    for session in list_sessions(spool_dir):
        fd = try_lock(session.lock_path)
        if fd is None:
            report.busy.append(session.name)
            report.pending += session.pending()
            continue
        try:
            closed = _end_abandoned(session.journals(), session.meta.get("pid"))
            report.abandoned += len(closed)
            report.closed += closed
            meta = session.meta
            uri = str(meta.get("tracking_uri") or "")
            if not uri or not meta.get("experiment"):  # never MLflow's default store in the cwd
                report.unreadable.append(session.name)
                report.pending += session.pending()
                continue
            if uri not in report.down:
                reason = probe_tracking(uri, probe_timeout_s)
                if reason is not None:
                    report.down[uri] = reason
            if uri in report.down:
                report.pending += session.pending()
                continue
            key = (uri, str(meta.get("experiment")))
            pusher = pushers.get(key)
            if pusher is None:
                if is_remote(uri):
                    apply_mlflow_client_defaults()
                root = meta.get("artifact_root")
                pusher = pushers[key] = Pusher(
                    MlflowClient(tracking_uri=uri), uri, ids, key[1], Path(root) if root else None
                )
            _push_session(session.journals(), pusher, report)
            if uri in report.down:
                report.pending += session.pending()
            elif session.pending() == 0:
                kept = session.retire()
                if kept is not None:
                    report.kept.append(str(kept))
        finally:
            unlock(fd)
    for pusher in pushers.values():
        report.records += pusher.records
        report.artifacts += pusher.artifacts
        for name, local, real in pusher.created:
            report.runs[real] = f"{name} (was local id {local})"
    return report


ABANDONED = (
    "its k3pipe process (pid {pid}) ended without ending this run (killed: SIGKILL, the OOM killer, "
    "a lost machine); a later k3pipe command ended it KILLED at its last record's time"
)
"""The ``k3pipe.error`` tag of a run a sync ended for its dead process (unless it had one)."""


def _end_abandoned(journals: list[Journal], pid: object) -> list[AbandonedRun]:
    """End, KILLED at the time of its last record, each run a session created and never ended: its
    session is unlocked, so its process is gone (killed, crashed) without closing its tracker. A run
    without an error of its own says why it ended so (``k3pipe.error``)."""
    closed = []
    for journal in journals:
        refused = journal.progress.mlflow_id is None and not journal.pending  # its creation was refused
        if journal.created_here and not journal.ended and not refused:
            last = journal.last_ms
            if journal.tag(ERROR_TAG) is None:
                journal.append("tags", {"tags": {ERROR_TAG: ABANDONED.format(pid=pid or "?")}})
            journal.append("end", {"status": "KILLED", "end_ms": last})
            first = journal.first() or {}
            run_id = journal.progress.mlflow_id or journal.run_id
            closed.append(
                AbandonedRun(pid if isinstance(pid, int) else None, str(first.get("name", "?")), run_id)
            )
    return closed


def _push_session(journals: list[Journal], pusher: Pusher, report: SyncReport) -> None:
    for journal in journals:
        if not journal.pending:
            continue
        name = "records of a run created before"
        for record in journal.records():
            if record["op"] == "create":
                name = str(record["name"])
            try:
                pusher.push(journal, record)
            except Exception as exc:
                if is_transient(exc):
                    report.down[pusher.tracking_uri] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                    return
                why = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
                journal.mark_pushed(int(record["seq"]), refused=why)
                report.refused.append(f"{record['op']} of run {journal.run_id}: {why}")
                log.warning("MLflow refused a spooled %s of run %s: %s", record["op"], journal.run_id, why)
            real = pusher.run_id(journal)
            if real is not None:
                report.runs.setdefault(real, name)
