"""The process groups k3pipe starts: told apart from a reused pid, stopped as a whole, and recorded
in ``K3PIPE_HOME`` so that a run killed before its teardown (SIGKILL, the OOM killer) leaves nothing
running once k3pipe starts again.

Each group k3pipe starts (an engine of the process launcher, the temporary Prefect server of a
``k3pipe`` command) is a new session whose leader's pid is the group id. A :class:`GroupRegistry`
file records the leader (pid and start time) and the owner (the k3pipe process that started it, pid
and start time). :meth:`GroupRegistry.reap_orphans` ends the groups whose owner is gone, and only
those: a pid that now belongs to another program is never signalled.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import os
import signal
import socket
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = [
    "GroupRecord",
    "GroupRegistry",
    "alive",
    "file_lock",
    "group_members",
    "listening",
    "parse_cpu_list",
    "proc_stat",
    "reap",
    "stop_group",
]

Signals = Sequence[tuple[signal.Signals, float]]


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, process group, start time in clock ticks since boot) of a process; None when gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = text[text.rindex(")") + 2 :].split()
    # fields[0] is field 3 (state), [2] field 5 (pgrp), [19] field 22 (starttime)
    return fields[0], int(fields[2]), int(fields[19])


def alive(pid: int, proc_start: int | None) -> bool:
    """Whether ``pid`` is still the process that was recorded (a zombie counts as gone)."""
    stat = proc_stat(pid)
    if stat is None or stat[0] in ("Z", "X"):
        return False
    return proc_start is None or stat[2] == proc_start


def group_members(pgid: int) -> list[int]:
    """The live (non-zombie) processes of a process group."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = proc_stat(int(entry.name))
            if stat is not None and stat[1] == pgid and stat[0] not in ("Z", "X"):
                members.append(int(entry.name))
    return members


def reap(pid: int) -> None:
    """Collect the exit status of a child of this process (a no-op for anyone else's)."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def stop_group(
    pgid: int, proc_start: int | None, signals: Signals = ((signal.SIGTERM, 15.0),), kill_wait_s: float = 10.0
) -> tuple[str, list[int]]:
    """End the group whose leader is ``pgid`` (started at ``proc_start``): each of ``signals`` with its
    grace period, then SIGKILL. Returns what happened and the processes still left (normally none).
    A leader pid that now belongs to another program is left alone."""
    leader = proc_stat(pgid)
    if leader is not None and leader[0] not in ("Z", "X") and proc_start not in (None, leader[2]):
        return f"was not running (pid {pgid} now belongs to another process, left alone)", []
    reap(pgid)
    if not group_members(pgid):
        return f"was not running (pid {pgid} gone)", []
    for sig, grace in (*signals, (signal.SIGKILL, kill_wait_s)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            reap(pgid)
            if not group_members(pgid):
                how = "killed" if sig == signal.SIGKILL else f"stopped ({sig.name})"
                return f"{how} (pid {pgid})", []
            time.sleep(0.1)
    return f"stopped (pid {pgid})", group_members(pgid)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the kernel's pick: bound to port 0, then released)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def listening(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """Whether something accepts TCP connections on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (created if needed), held for the block; other processes that
    ask for it wait. Released when the process dies, whatever killed it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@dataclass(frozen=True)
class GroupRecord:
    """A process group k3pipe started, and the k3pipe process that owns it."""

    kind: str
    """What it is: 'engine' (an arm's engine) or 'prefect-server'."""
    name: str
    pgid: int
    proc_start: int | None
    owner_pid: int
    owner_start: int | None
    started_at: str
    port: int | None = None
    log: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    """What it belongs to (an engine: its MLflow run and flow run ids), for whoever ends it."""

    def describe(self) -> str:
        port = f", port {self.port}" if self.port else ""
        return f"{self.kind} {self.name} (process group {self.pgid}{port}, started {self.started_at})"


class GroupRegistry:
    """The process groups of one ``K3PIPE_HOME``, a JSON file each under ``run/groups``."""

    def __init__(self, home: Path) -> None:
        self.dir = home / "run" / "groups"

    def add(
        self,
        kind: str,
        name: str,
        pgid: int,
        port: int | None = None,
        log: Path | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> GroupRecord:
        """Record a group this process just started (its leader ``pgid``)."""
        me = proc_stat(os.getpid())
        leader = proc_stat(pgid)
        record = GroupRecord(
            kind=kind,
            name=name,
            pgid=pgid,
            proc_start=leader[2] if leader else None,
            owner_pid=os.getpid(),
            owner_start=me[2] if me else None,
            started_at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            port=port,
            log=str(log) if log else None,
            labels=dict(labels or {}),
        )
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self._path(pgid)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(record), indent=2) + "\n")
        tmp.replace(path)
        return record

    def remove(self, pgid: int) -> None:
        self._path(pgid).unlink(missing_ok=True)

    def records(self) -> list[GroupRecord]:
        out = []
        for path in sorted(self.dir.glob("*.json")) if self.dir.is_dir() else []:
            try:
                out.append(GroupRecord(**json.loads(path.read_text())))
            except (OSError, ValueError, TypeError):
                path.unlink(missing_ok=True)  # a torn write of a process that died mid-write
        return out

    def mine(self) -> list[GroupRecord]:
        """The groups this process started and has not removed."""
        return [r for r in self.records() if r.owner_pid == os.getpid()]

    def reap_orphans(
        self, progress: Callable[[str], None] | None = None, kinds: Collection[str] | None = None
    ) -> list[GroupRecord]:
        """End every recorded group (of ``kinds``, default all) whose owner is gone, and forget the
        records of groups already gone; returns the records of owners that are gone (whether their
        group still ran or not: what they belonged to did not end cleanly). Groups of a live owner
        are left alone."""
        ended = []
        with file_lock(self.dir.parent / "groups.lock"):
            for record in self.records():
                if alive(record.owner_pid, record.owner_start) or (kinds and record.kind not in kinds):
                    continue
                # the group lives on while any member does, even with its leader gone (an engine's
                # workers); stop_group leaves alone a leader pid that now belongs to another program
                if group_members(record.pgid):
                    what, left = stop_group(record.pgid, record.proc_start, ((signal.SIGTERM, 10.0),))
                    if progress:
                        progress(
                            f"ended the {record.describe()} left by k3pipe process {record.owner_pid}, "
                            f"which is gone: {what}" + (f"; still running: {left}" if left else "")
                        )
                elif progress:
                    # ended by someone else too (an administrator, the OOM killer): nothing to stop;
                    # what it belonged to is for the caller to close, and to say
                    progress(
                        f"the {record.describe()} of k3pipe process {record.owner_pid} is gone, and so is "
                        "that process: nothing to stop"
                    )
                ended.append(record)
                self.remove(record.pgid)
        return ended

    def _path(self, pgid: int) -> Path:
        return self.dir / f"{pgid}.json"


MAX_CPU = 4095


def parse_cpu_list(text: str, field: str = "cpus") -> list[int]:
    """A taskset-style CPU list (``0-7,16,18-19``) as sorted CPU numbers; a ValueError naming
    ``field`` and the value when it is not one."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            lo, hi = int(first), int(last) if dash else int(first)
        except ValueError:
            raise ValueError(
                f"{field} {text!r} is not a CPU list: write numbers and ranges, e.g. '0-7' or '0-3,8,10-11'"
            ) from None
        if lo < 0 or hi > MAX_CPU or lo > hi:
            raise ValueError(f"{field} {text!r}: {part.strip()!r} is not a range of CPUs 0-{MAX_CPU}")
        cpus.update(range(lo, hi + 1))
    return sorted(cpus)
