"""The temporary Prefect server of a ``k3pipe`` command that has no Prefect server to talk to.

Prefect's own temporary server (what a flow call starts when ``PREFECT_API_URL`` is unset) is a
child in the command's process group: Ctrl-C at the terminal reaches it too, it dies before the
flow can record how it ended, and k3pipe then waited minutes on a dead API. A SIGKILL of the command
left it running. And several first runs on one new ``K3PIPE_HOME`` raced to create its database.

So k3pipe starts the same server (the same uvicorn command Prefect runs) itself:
- in a session of its own, so that a terminal's signals do not reach it;
- recorded in ``K3PIPE_HOME`` (:class:`k3pipe.core.procs.GroupRegistry`), so that the next command ends
  one whose command was killed;
- one start at a time per home (a file lock held until it answers), so that the first start
  creates the database and the others find it made;
- stopped when the command ends.

It boots (about 10 s on two cores, 20 s on a new database) while the command imports its flows
(another 10 s): :meth:`LocalPrefect.launch`, the imports, then :meth:`LocalPrefect.wait`.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from k3pipe.core.errors import K3pipeError
from k3pipe.core.procs import GroupRegistry, file_lock, free_port, stop_group
from k3pipe.launchers.base import tail_file

__all__ = ["LocalPrefect", "PrefectServerError"]


class PrefectServerError(K3pipeError):
    """The command's temporary Prefect server did not start."""


class LocalPrefect:
    """A Prefect API server on 127.0.0.1 for this process: :meth:`start`, then :meth:`stop`."""

    def __init__(self, home: Path, prefect_home: Path, timeout_s: float = 180.0) -> None:
        self.home = home
        self.prefect_home = prefect_home
        self.timeout_s = timeout_s
        self.registry = GroupRegistry(home)
        self.log = home / "logs" / "prefect-server.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.port: int | None = None
        self._lock = contextlib.ExitStack()
        self._offset = 0

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def start(self) -> str:
        """Start the server and wait until it answers; returns its API URL."""
        self.launch()
        self.wait()
        return self.api_url

    def launch(self) -> str:
        """Start the server without waiting for it (:meth:`wait` does); returns its API URL. The
        home's start lock is held from here until :meth:`wait` returns."""
        spec = importlib.util.find_spec("prefect")
        if spec is None or spec.origin is None:
            raise PrefectServerError("prefect is not installed in this environment: run `make venv`")
        app_dir = str(Path(spec.origin).parent.parent)
        self.prefect_home.mkdir(parents=True, exist_ok=True)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            "PREFECT_HOME": str(self.prefect_home),
            "PREFECT_UI_ENABLED": "0",
            "PREFECT__SERVER_EPHEMERAL": "1",
            "PREFECT__SERVER_FINAL": "1",
        }
        env.pop("PREFECT_API_URL", None)
        self._lock.enter_context(file_lock(self.home / "run" / "prefect-start.lock"))
        try:
            self.port = free_port()
            argv = [
                sys.executable, "-m", "uvicorn", "--app-dir", app_dir, "--factory",
                "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(self.port),
                "--log-level", "error", "--lifespan", "on",
            ]  # fmt: skip
            with self.log.open("ab") as fh:
                fh.write(f"\n=== k3pipe (pid {os.getpid()}): Prefect server on port {self.port}\n".encode())
                fh.flush()
                self._offset = fh.tell()
                self.proc = subprocess.Popen(
                    argv, env=env, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                    start_new_session=True,
                )  # fmt: skip
            self.registry.add("prefect-server", "temporary Prefect server", self.proc.pid, self.port,
                              self.log)  # fmt: skip
            atexit.register(self.stop)
        except BaseException:
            self._lock.close()
            raise
        return self.api_url

    def wait(self) -> None:
        """Wait until the launched server answers (then release the start lock)."""
        try:
            self._wait(self._offset)
        finally:
            self._lock.close()

    def _wait(self, offset: int) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.timeout_s
        url = f"{self.api_url}/health"
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while True:
                code = self.proc.poll()
                if code is not None:
                    self.stop()
                    raise PrefectServerError(
                        f"the temporary Prefect server exited with code {code} before it answered; "
                        f"its log {self.log} ends with:\n{_since(self.log, offset)}"
                    )
                try:
                    if client.get(url).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise PrefectServerError(
                        f"the temporary Prefect server did not answer within {self.timeout_s:.0f} s; "
                        f"its log {self.log} ends with:\n{_since(self.log, offset)}\n"
                        "set PREFECT_API_URL to use a running Prefect server instead"
                    )
                time.sleep(0.2)

    def stop(self) -> None:
        """Stop the server's group (SIGTERM, then SIGKILL after 5 s); idempotent."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        stop_group(proc.pid, None, ((signal.SIGTERM, 5.0),))
        proc.poll()
        self.registry.remove(proc.pid)


def _since(path: Path, offset: int, lines: int = 20) -> str:
    try:
        with path.open("rb") as fh:
            fh.seek(offset)
            text = fh.read().decode(errors="replace")
    except OSError:
        return tail_file(path, lines)
    return "\n".join(text.rstrip().splitlines()[-lines:]) or "(nothing)"
