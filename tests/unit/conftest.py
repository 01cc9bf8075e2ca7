"""The unit tier's own: preflight's port probe answers "free" (what a port of this machine is doing
is not a unit's to know; tests/unit/engines/test_preflight.py probes a real socket on purpose), and
no unit test starts a process: a subprocess, a fork, a spawn or a shell fails the test that tried,
naming what it ran (a test that needs a process belongs to tests/integration/)."""

from __future__ import annotations

import os
import platform
import subprocess
from typing import Any

import pytest

from k3pipe.core.provenance import git_commit


@pytest.fixture(autouse=True)
def _ports_free(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("k3pipe.experiment.preflight.port_taken", lambda host, port: False)


# Asked once, before processes are refused, and cached for the session: the processor Python asks of
# `uname -p` the first time anything wants it (MLflow, for every run), and k3pipe's commit (git)
platform.uname().processor  # noqa: B018
git_commit()


class ProcessStarted(AssertionError):
    """A unit test started a process."""


def _refuse(what: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        command = next((a for a in args if isinstance(a, str | bytes | list | tuple)), kwargs.get("args"))
        shown = " ".join(map(str, command)) if isinstance(command, list | tuple) else str(command)
        raise ProcessStarted(
            f"a unit test started a process ({what}: {shown}): move it to tests/integration/"
        )

    return refuse


class _RefusedPopen(subprocess.Popen):  # type: ignore[type-arg]
    """subprocess.Popen in the unit tier: refused before any object exists (no half-made Popen to
    be collected)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        _refuse("subprocess")(*args, **kwargs)


@pytest.fixture(autouse=True)
def _no_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(subprocess, "Popen", _RefusedPopen)
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "execv", "execve", "execvp"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, _refuse(f"os.{name}"))
