"""Run the engine as a local process in its own process group, its output streamed to a log file.

The output goes through a pipe and a thread that writes it to the log file line by line, scrubbed of
secrets (:func:`k3pipe.core.secrets.scrub`): an engine that prints its own arguments (vLLM's "non-default
args", with ``api_key``) or environment never puts a key on disk.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shlex
import signal
import subprocess
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING

from k3pipe.core.errors import LaunchError
from k3pipe.core.procs import GroupRegistry
from k3pipe.core.secrets import scrub
from k3pipe.launchers.base import Launcher, tail_file
from k3pipe.schema.launcher_specs import ProcessLauncherSpec

if TYPE_CHECKING:
    from k3pipe.planning.plan import ArmPlan

__all__ = ["ProcessLauncher", "build", "equivalent_command"]

# Launchers still running at interpreter exit are stopped, so an interrupted run leaves no engine
# behind even when the caller's own cleanup never ran.
_LIVE: weakref.WeakSet[ProcessLauncher] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for launcher in list(_LIVE):
        launcher.stop()


class ProcessLauncher:
    """An engine process started with ``start_new_session`` so that its whole group can be ended."""

    kind = "process"

    def __init__(
        self,
        argv: list[str],
        env: Mapping[str, str],
        log_path: Path,
        stop_timeout_s: float = 30.0,
        cwd: Path | None = None,
        registry: GroupRegistry | None = None,
        name: str = "engine",
        port: int | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> None:
        self.argv = list(argv)
        self.env = dict(env)
        self.log_path: Path | None = log_path
        self.stop_timeout_s = stop_timeout_s
        self.cwd = cwd
        self._proc: subprocess.Popen[bytes] | None = None
        self._pump: threading.Thread | None = None
        self.started_at: float | None = None
        # where the group is recorded while it runs, so that the next start ends it if this process
        # is killed before its teardown (k3pipe.core.procs)
        self.registry = registry
        self.name = name
        self.port = port
        self.labels = dict(labels or {})

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self) -> None:
        if self._proc is not None:
            raise LaunchError(f"engine already started (pid {self._proc.pid})")
        assert self.log_path is not None
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        try:
            self._proc = subprocess.Popen(
                self.argv,
                env=self.env,
                cwd=self.cwd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as exc:
            log.close()
            raise LaunchError(
                f"could not start the engine {self.argv[0]!r}: {exc}; check engine.executable "
                "(run 'make engine' to build the engine's venv)"
            ) from exc
        self.started_at = time.perf_counter()
        _LIVE.add(self)
        assert self._proc.stdout is not None
        self._pump = threading.Thread(
            target=_pump, args=(self._proc.stdout, log), name="k3pipe-engine-log", daemon=True
        )
        self._pump.start()
        if self.registry is not None:
            self.registry.add("engine", self.name, self._proc.pid, self.port, self.log_path, self.labels)

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def exit_code(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    def ready(self, progress: Callable[[str], None] | None = None) -> bool:
        return True  # the health URL tells

    def log_tail(self, lines: int = 40) -> str:
        if self._pump is not None and not self.alive():
            self._pump.join(timeout=2)  # let the last lines of an engine that ended land
        return tail_file(self.log_path, lines)

    def _group_alive(self, pgid: int) -> bool:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def stop(self, grace_s: float | None = None) -> None:
        proc = self._proc
        if proc is None:
            return
        pgid = proc.pid  # the leader of a new session: its pid is the group id
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
            os.killpg(pgid, signal.SIGCONT)  # a stopped (frozen) engine handles its SIGTERM too
        grace = self.stop_timeout_s if grace_s is None else min(grace_s, self.stop_timeout_s)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            proc.poll()  # reap the leader, else its zombie keeps the group "alive"
            if not self._group_alive(pgid):
                break
            time.sleep(0.1)
        if self._group_alive(pgid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        if self._pump is not None:
            self._pump.join(timeout=5)  # the group is gone: the pipe is at its end
        _LIVE.discard(self)
        if self.registry is not None and not self._group_alive(pgid):
            self.registry.remove(pgid)


def _pump(source: IO[bytes], log: IO[bytes]) -> None:
    """The engine's output into its log file, line by line as it comes, each line scrubbed."""
    with contextlib.suppress(OSError, ValueError), log, source:
        for line in iter(source.readline, b""):
            text = line.decode("utf-8", "surrogateescape")
            log.write(scrub(text).encode("utf-8", "surrogateescape"))
            log.flush()


def equivalent_command(spec: ProcessLauncherSpec, plan: ArmPlan, image: str | None = None) -> str | None:
    """The command pinned to ``launcher.cpus`` (taskset), secrets redacted; None when not pinned."""
    if spec.cpus is None:
        return None
    return shlex.join(spec.pinned(plan.command.redacted_argv()))


def build(
    spec: ProcessLauncherSpec,
    plan: ArmPlan,
    log_path: Path,
    env: Mapping[str, str],
    base_env: Mapping[str, str],
    image: str | None,
    labels: Mapping[str, str],
    home: Path | None = None,
) -> Launcher:
    """A process-group launcher for ``plan``, registered in ``home`` when given."""
    return ProcessLauncher(
        spec.pinned(plan.command.argv),
        {**base_env, **env},
        log_path,
        stop_timeout_s=spec.stop_timeout_s,
        registry=GroupRegistry(home) if home is not None else None,
        name=f"{plan.experiment}/{plan.arm}",
        port=_port_of(plan.base_url),
        labels=labels,
    )


def _port_of(url: str) -> int | None:
    from urllib.parse import urlsplit

    try:
        return urlsplit(url).port
    except ValueError:
        return None
