"""Commands that run on after the terminal that started them: `k3pipe study --detach`.

:func:`start_detached` starts ``python -m k3pipe.cli.detached run DIR -- ARGV`` in a session of its own
(no terminal: closing it, or the end of the command or device call that started it, sends nothing
there), its output in ``DIR/output.log``. That wrapper runs ``python -m k3pipe.cli.main ARGV`` in its
process group, waits for it and writes its exit status to ``DIR/exit_code``; SIGINT or SIGTERM to the
group (``kill -INT -- -PGID``) reaches the command, which stops its engine and records what it
measured, as Ctrl-C does in a terminal. ``DIR`` is ``K3PIPE_HOME/detached/<time>-<label>``, with
``command.json`` (the arguments, the group) beside the log; :func:`detached_jobs` reads them back
for `k3pipe detached`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import typer

__all__ = ["DetachedJob", "detached_jobs", "start_detached"]

REPO = Path(__file__).resolve().parents[2]
_STUDY_RUN = re.compile(
    r"study \S+: MLflow run ([0-9a-f]{32})|resuming study \S+ \(MLflow run ([0-9a-f]{32})"
)


def _dir(home: Path) -> Path:
    return home / "detached"


def start_detached(home: Path, argv: list[str], label: str) -> Path:
    """``k3pipe ARGV`` started detached; prints its id, log and how to follow and stop it."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", label)[:40].strip("-") or "job"
    job = _dir(home) / f"{time.strftime('%Y%m%d-%H%M%S')}-{safe}"
    job.mkdir(parents=True, exist_ok=False)
    with (job / "output.log").open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "k3pipe.cli.detached", "run", str(job), "--", *argv],
            cwd=os.getcwd(),
            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": _pythonpath()},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    (job / "command.json").write_text(
        json.dumps({"argv": argv, "pgid": proc.pid, "cwd": os.getcwd(), "started": time.time()})
    )
    typer.echo(f"started in the background: {job.name} (process group {proc.pid})")
    typer.echo(f"log: {job / 'output.log'}")
    typer.echo(f"follow: k3pipe detached {job.name}    stop: kill -INT -- -{proc.pid}")
    return job


def _pythonpath() -> str:
    """The checkout first (an editable install finds it anyway; a plain checkout needs it)."""
    rest = os.environ.get("PYTHONPATH")
    return str(REPO) + (os.pathsep + rest if rest else "")


@dataclass
class DetachedJob:
    """One detached command as its directory records it."""

    name: str
    path: Path
    argv: list[str]
    pgid: int
    started: float
    exit_code: int | None

    @property
    def running(self) -> bool:
        if self.exit_code is not None:
            return False
        try:
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def state(self) -> str:
        if self.exit_code is not None:
            return f"ended, exit {self.exit_code}"
        return (
            f"running (process group {self.pgid})" if self.running else "gone without an exit status (killed)"
        )

    def log_tail(self, lines: int) -> list[str]:
        try:
            text = (self.path / "output.log").read_text(errors="replace")
        except OSError:
            return []
        return text.splitlines()[-lines:]

    def study_run(self) -> str | None:
        """The study's MLflow run id, once the command has said it."""
        try:
            text = (self.path / "output.log").read_text(errors="replace")
        except OSError:
            return None
        match = _STUDY_RUN.search(text)
        return (match.group(1) or match.group(2)) if match else None


def detached_jobs(home: Path) -> list[DetachedJob]:
    """Every detached command of ``home``, oldest first."""
    jobs = []
    root = _dir(home)
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        try:
            meta = json.loads((path / "command.json").read_text())
        except (OSError, ValueError):
            continue
        code_file = path / "exit_code"
        code = int(code_file.read_text()) if code_file.is_file() else None
        jobs.append(
            DetachedJob(path.name, path, meta["argv"], int(meta["pgid"]), float(meta["started"]), code)
        )
    return jobs


def _default_signals() -> None:
    """In the command's process before it starts: the signals the wrapper ignores back to their
    defaults (an ignored signal stays ignored across exec; Python then sets its Ctrl-C handler)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def _run(job: Path, argv: list[str]) -> int:
    """The wrapper: the command in this process group, its exit status written when it ends. A
    signal to the group is the command's to handle; the wrapper waits it out."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-m", "k3pipe.cli.main", *argv], preexec_fn=_default_signals)
    code = child.wait()
    code = 128 - code if code < 0 else code  # killed by a signal: the shell's convention
    (job / "exit_code").write_text(f"{code}\n")
    return code


if __name__ == "__main__":
    if len(sys.argv) < 4 or sys.argv[1] != "run" or sys.argv[3] != "--":
        sys.exit("usage: python -m k3pipe.cli.detached run DIR -- ARGV...")
    sys.exit(_run(Path(sys.argv[2]), sys.argv[4:]))
