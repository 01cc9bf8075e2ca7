"""The Prefect flow runs each k3pipe process runs, kept in ``K3PIPE_HOME`` so that the next command
can close those of a process that is gone (SIGKILL, the OOM killer, a lost node) without ending them.

A killed process cannot say how its runs ended; the next command that opens the store says it for
them (k3pipe/cli/closing.py): its MLflow runs are ended KILLED from the spool session the process leaves
(:mod:`k3pipe.records.sync`), its engines are ended from their process-group records
(:class:`k3pipe.core.procs.GroupRegistry`), and its Prefect flow runs, whatever it launched (an engine, a
container, nothing: an external endpoint), are set Crashed from the record this module keeps:

    K3PIPE_HOME/run/owners/<pid>-<start>.json    {"pid", "start", "argv", "flow_runs": [...]}

one file per process, each flow run with the API it was created on and, for a command's temporary
Prefect server (k3pipe/cli/local_prefect.py, gone with the command), the ``PREFECT_HOME`` whose database
holds it. A process that exits normally removes its file (its flow runs have ended, or its command
marked them Cancelled); a file left behind by a process that is gone is what the next command reads.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime as dt
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from k3pipe.core.procs import alive, file_lock, proc_stat
from k3pipe.core.secrets import scrub

__all__ = ["FlowRunNote", "OwnerRecord", "Owners", "local_prefect", "set_local_prefect"]

_local_prefect: dict[str, str] = {}
"""This process's temporary Prefect server: its API URL and PREFECT_HOME (k3pipe/cli/local_prefect.py)."""


def set_local_prefect(api_url: str, prefect_home: Path) -> None:
    """Say that ``api_url`` is this command's temporary Prefect server, on ``prefect_home``'s
    database: the flow runs created there can only be closed later through another server on it."""
    _local_prefect.update(api_url=api_url, prefect_home=str(prefect_home))


def local_prefect() -> tuple[str, str] | None:
    """(API URL, PREFECT_HOME) of this process's temporary Prefect server; None without one."""
    if not _local_prefect:
        return None
    return _local_prefect["api_url"], _local_prefect["prefect_home"]


@dataclass(frozen=True)
class FlowRunNote:
    """A flow run a process created or ran."""

    id: str
    name: str
    api_url: str
    """The Prefect API it lives on, as the process reached it."""
    prefect_home: str | None = None
    """Set when ``api_url`` was the process's temporary server: the PREFECT_HOME whose database holds
    the run (a server on it is needed to close the run later)."""


@dataclass(frozen=True)
class OwnerRecord:
    """A process's record: who it was, what it ran."""

    pid: int
    start: int | None
    argv: str
    started_at: str
    flow_runs: list[FlowRunNote] = field(default_factory=list)

    @property
    def gone(self) -> bool:
        return not alive(self.pid, self.start)

    def describe(self) -> str:
        return f"k3pipe process {self.pid} ({self.argv}, started {self.started_at})"


class Owners:
    """The owner records of one ``K3PIPE_HOME``."""

    def __init__(self, home: Path) -> None:
        self.dir = home / "run" / "owners"
        self.lock = home / "run" / "owners.lock"

    def _mine(self) -> Path:
        stat = proc_stat(os.getpid())
        return self.dir / f"{os.getpid()}-{stat[2] if stat else 0}.json"

    def note_flow_run(self, note: FlowRunNote) -> None:
        """Add a flow run to this process's record (made on the first; removed at a normal exit)."""
        path = self._mine()
        with file_lock(self.lock):
            record = _read(path)
            if record is None:
                stat = proc_stat(os.getpid())
                record = OwnerRecord(
                    pid=os.getpid(),
                    start=stat[2] if stat else None,
                    argv=_argv(),
                    started_at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                )
                atexit.register(self.forget_mine)
            if any(f.id == note.id for f in record.flow_runs):
                return
            record.flow_runs.append(note)
            self.dir.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(asdict(record), indent=1) + "\n")
            tmp.replace(path)

    def mine(self) -> OwnerRecord | None:
        return _read(self._mine())

    def forget_mine(self) -> None:
        """This process is ending normally: its flow runs have ended (or its command marks them)."""
        with contextlib.suppress(OSError):
            self._mine().unlink(missing_ok=True)

    def gone(self) -> list[OwnerRecord]:
        """The records of processes that are gone, oldest first (a torn file is removed)."""
        out = []
        for path in sorted(self.dir.glob("*.json")) if self.dir.is_dir() else []:
            record = _read(path)
            if record is None:
                path.unlink(missing_ok=True)
            elif record.gone:
                out.append(record)
        return sorted(out, key=lambda r: r.started_at)

    def forget(self, record: OwnerRecord) -> None:
        (self.dir / f"{record.pid}-{record.start or 0}.json").unlink(missing_ok=True)


def _read(path: Path) -> OwnerRecord | None:
    try:
        data = json.loads(path.read_text())
        notes = [FlowRunNote(**n) for n in data.pop("flow_runs", [])]
        return OwnerRecord(**data, flow_runs=notes)
    except (OSError, ValueError, TypeError):
        return None


def _argv() -> str:
    """The command, as a person would type it (``k3pipe run exp.yaml``; a worker's flow process)."""
    args = sys.argv[1:] if sys.argv and sys.argv[0].endswith(("main.py", "k3pipe")) else sys.argv
    text = scrub(" ".join(args))[:200]
    return f"k3pipe {text}" if args is not sys.argv else text
