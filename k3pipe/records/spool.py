"""The local spool: every write the tracker makes, kept on disk before it goes to MLflow.

A run's measurements must outlive the tracking server: the tracker appends each write here first
(fsync'd), then pushes it; what could not be pushed stays until ``k3pipe sync`` (or the next run)
pushes it. This module is the disk side only; ``k3pipe.records.tracking`` pushes.

    K3PIPE_HOME/spool/
      ids.json                         local run id -> MLflow run id, for runs created while MLflow
                                       was down (their local id is what the user was shown)
      <session>/                       one per tracker that wrote: its process's runs
        session.json                   tracking URI, experiment, artifact root, pid, start
        lock                           flock'd while its tracker lives: sync leaves the session alone
        <order>-<run id>/              one run's journal (order: the session's creation order)
          journal.jsonl                one record a line: {"seq", "op", "at_ms", ...}
          progress.jsonl               {"inflight": n} before a push, {"pushed": n} after
                                       ({"pushed": n, "refused": why}: MLflow refused it, 4xx),
                                       {"mlflow_id": id} once the run exists in MLflow
          files/<seq>/<name>           an artifact's bytes, removed once pushed
      refused/<session>/               a session done but for records MLflow refused, kept

A run's journal begins with its ``create`` record when this session created it; a journal without
one holds writes to a run created elsewhere (a study's arms written to a run another tracker
opened). Journals are pushed in session order, then creation order: a parent is in MLflow before
its children.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import time
import uuid
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "IdMap",
    "Journal",
    "Progress",
    "SessionDir",
    "list_sessions",
    "new_run_id",
    "now_ms",
    "try_lock",
    "unlock",
]

_RUN_ID = re.compile(r"\b[0-9a-f]{32}\b")


def new_run_id() -> str:
    """A run id made here (MLflow's are 32 hex digits too): the run's name until MLflow gives it one."""
    return uuid.uuid4().hex


def now_ms() -> int:
    """Wall-clock milliseconds since the epoch: MLflow's unit for start, end and metric times."""
    return int(time.time() * 1000)


def try_lock(path: Path) -> int | None:
    """An exclusive flock on ``path`` (created if missing), or None while another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def unlock(fd: int) -> None:
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_UN)
    with contextlib.suppress(OSError):
        os.close(fd)


def _append_line(path: Path, data: Mapping[str, Any], sync: bool) -> None:
    line = json.dumps(data, separators=(",", ":"), default=str) + "\n"
    with path.open("a", encoding="utf-8") as fh:
        fh.write(line)
        fh.flush()
        if sync:
            os.fsync(fh.fileno())


def _read_lines(path: Path) -> Iterator[dict[str, Any]]:
    """The JSON lines of ``path``; a torn last line (a crash mid-write) is skipped."""
    if not path.exists():
        return
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            if not line.endswith("\n"):
                break
            with contextlib.suppress(json.JSONDecodeError):
                yield json.loads(line)


class IdMap:
    """The MLflow ids that sync gave runs created while MLflow was down (``ids.json``)."""

    def __init__(self, root: Path) -> None:
        self.path = root / "ids.json"
        self._ids: dict[str, str] = {}
        self._mtime: float | None = None

    def load(self) -> dict[str, str]:
        try:
            mtime = self.path.stat().st_mtime
        except FileNotFoundError:
            return self._ids
        if mtime != self._mtime:
            self._ids = json.loads(self.path.read_text(encoding="utf-8") or "{}")
            self._mtime = mtime
        return self._ids

    def get(self, run_id: str) -> str:
        """``run_id``'s MLflow id (itself when it was never local)."""
        return self.load().get(run_id, run_id)

    def add(self, local: str, real: str) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._mtime = None
            ids = dict(self.load())
            ids[local] = real
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(ids, indent=1), encoding="utf-8")
            os.replace(tmp, self.path)
            self._ids, self._mtime = ids, None
        finally:
            unlock(fd)

    def translate(self, text: str) -> str:
        """``text`` with every local run id in it replaced by its MLflow id (a parent's id in a
        tag, a run id in a param or a record)."""
        ids = self.load()
        if not ids or not _RUN_ID.search(text):
            return text
        return _RUN_ID.sub(lambda m: ids.get(m.group(), m.group()), text)


@dataclass
class Progress:
    """How far a journal has been pushed."""

    pushed: int = 0
    inflight: int | None = None
    mlflow_id: str | None = None
    refused: int = 0
    """Records MLflow refused (4xx): set aside, kept in the journal."""


class Journal:
    """One run's records in order, and how far they have been pushed."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.order, _, self.run_id = directory.name.partition("-")
        self.journal_path = directory / "journal.jsonl"
        self.progress_path = directory / "progress.jsonl"
        self.seq = 0
        self.progress = Progress()
        self._created: bool | None = None
        self.ended = False
        """Whether the journal holds the run's end."""
        self.last_ms = 0
        """When its last record was written (ms since the epoch)."""
        # a journal this process writes keeps its unpushed records in memory too (no re-reading)
        self._memory: deque[dict[str, Any]] | None = None
        for record in _read_lines(self.journal_path):
            self._saw(record)
        for mark in _read_lines(self.progress_path):
            if "pushed" in mark:
                self.progress.pushed = max(self.progress.pushed, int(mark["pushed"]))
            if "inflight" in mark:
                self.progress.inflight = int(mark["inflight"])
            if "mlflow_id" in mark:
                self.progress.mlflow_id = str(mark["mlflow_id"])
            if "refused" in mark:
                self.progress.refused += 1

    def _saw(self, record: Mapping[str, Any]) -> None:
        self.seq = max(self.seq, int(record["seq"]))
        self.last_ms = max(self.last_ms, int(record.get("at_ms", 0)))
        if self._created is None:
            self._created = record["op"] == "create"
        if record["op"] == "end":
            self.ended = True

    @classmethod
    def create(cls, session_dir: Path, order: int, run_id: str) -> Journal:
        directory = session_dir / f"{order:05d}-{run_id}"
        (directory / "files").mkdir(parents=True, exist_ok=True)
        journal = cls(directory)
        journal._memory = deque()
        return journal

    @property
    def created_here(self) -> bool:
        """Whether this journal begins with the run's creation (else: writes to a run made elsewhere)."""
        return bool(self._created)

    @property
    def pending(self) -> int:
        return self.seq - self.progress.pushed

    def first(self) -> dict[str, Any] | None:
        """The journal's first record (its ``create`` when this session created the run)."""
        return next(iter(_read_lines(self.journal_path)), None)

    def tag(self, key: str) -> str | None:
        """The last value the journal set for tag ``key`` (at creation or later); None if never."""
        value = None
        for record in _read_lines(self.journal_path):
            if record["op"] in ("create", "tags") and key in record.get("tags", {}):
                value = str(record["tags"][key])
        return value

    def append(
        self, op: str, data: Mapping[str, Any], file: Path | bytes | None = None, name: str = ""
    ) -> int:
        """Append one record (and the artifact's bytes, ``file``: a path to copy or the bytes, kept as
        files/<seq>/<name>), durably; its sequence number."""
        seq = self.seq + 1
        record: dict[str, Any] = {"seq": seq, "op": op, "at_ms": now_ms(), **data}
        if file is not None:
            target = self.dir / "files" / str(seq) / (Path(name).name or "artifact")
            target.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(file, bytes):
                target.write_bytes(file)
            else:
                shutil.copyfile(file, target)
            with target.open("rb") as fh:
                os.fsync(fh.fileno())
            record["file"] = target.relative_to(self.dir / "files").as_posix()
        _append_line(self.journal_path, record, sync=True)
        self._saw(record)
        if self._memory is not None:
            self._memory.append(record)
        return seq

    def records(self) -> Iterator[dict[str, Any]]:
        """The records not pushed yet, in order."""
        if self._memory is not None:
            yield from list(self._memory)
            return
        for record in _read_lines(self.journal_path):
            if int(record["seq"]) > self.progress.pushed:
                yield record

    def file(self, record: Mapping[str, Any]) -> Path:
        return self.dir / "files" / str(record["file"])

    def mark_inflight(self, seq: int) -> None:
        """Before a push: a crash between the push and :meth:`mark_pushed` leaves it uncertain."""
        _append_line(self.progress_path, {"inflight": seq}, sync=False)
        self.progress.inflight = seq

    def mark_pushed(self, seq: int, **note: Any) -> None:
        """Record ``seq`` as done (``refused=why``: MLflow refused it; it is set aside)."""
        _append_line(self.progress_path, {"pushed": seq, **note}, sync=False)
        self.progress.pushed = seq
        if "refused" in note:
            self.progress.refused += 1
        while self._memory and int(self._memory[0]["seq"]) <= seq:
            self._memory.popleft()

    def mark_mlflow_id(self, run_id: str) -> None:
        _append_line(self.progress_path, {"mlflow_id": run_id}, sync=True)
        self.progress.mlflow_id = run_id

    def uncertain(self, seq: int) -> bool:
        """Whether record ``seq`` was being pushed when a push failed or the process died: MLflow
        may hold it already."""
        return self.progress.inflight == seq


class SessionDir:
    """One tracker's spool directory: its journals and its lock."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.name = directory.name
        self.lock_fd: int | None = None
        """The session's lock, held by the tracker that created it (see :meth:`create`)."""

    @classmethod
    def create(cls, root: Path, meta: Mapping[str, Any]) -> SessionDir:
        """A new session, locked (``lock_fd``) before its session.json makes it visible to sync."""
        now = time.time()
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now)) + f".{int(now * 1000) % 1000:03d}"
        directory = root / f"{stamp}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        directory.mkdir(parents=True)
        session = cls(directory)
        session.lock_fd = try_lock(session.lock_path)
        tmp = directory / "session.json.tmp"
        tmp.write_text(json.dumps({**meta, "pid": os.getpid(), "started_ms": now_ms()}, indent=1))
        os.replace(tmp, directory / "session.json")
        return session

    def release(self) -> None:
        if self.lock_fd is not None:
            unlock(self.lock_fd)
            self.lock_fd = None

    @property
    def meta(self) -> dict[str, Any]:
        try:
            return dict(json.loads((self.dir / "session.json").read_text(encoding="utf-8")))
        except (OSError, json.JSONDecodeError):
            return {}

    @property
    def lock_path(self) -> Path:
        return self.dir / "lock"

    def journals(self) -> list[Journal]:
        return [Journal(d) for d in sorted(self.dir.iterdir()) if d.is_dir() and "-" in d.name]

    def pending(self) -> int:
        return sum(j.pending for j in self.journals())

    def retire(self) -> Path | None:
        """The session is all in MLflow: remove it; one with records MLflow refused is moved to
        ``refused/`` beside the sessions instead (where sync no longer looks), and that path returned."""
        if any(j.progress.refused for j in self.journals()):
            target = self.dir.parent / "refused" / self.name
            target.parent.mkdir(exist_ok=True)
            self.dir.rename(target)
            return target
        shutil.rmtree(self.dir, ignore_errors=True)
        return None


def list_sessions(root: Path) -> list[SessionDir]:
    """The spool's sessions, oldest first."""
    if not root.is_dir():
        return []
    return [SessionDir(d) for d in sorted(root.iterdir()) if d.is_dir() and (d / "session.json").exists()]
