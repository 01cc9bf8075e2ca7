"""The launcher interface: start, logs, alive, stop. Stop always works and may be called twice.

Each launcher kind has two halves: its spec, data in :mod:`k3pipe.schema.launcher_specs` (the experiment's
``launcher:`` block), and its implementation, the module of this package named after the kind (the
launcher, and how the kind builds it from an arm's plan). Code outside ``launchers/`` asks the spec
what it needs (does it start an engine, pin an image, where does the engine see its models), asks
:mod:`k3pipe.launchers` to build, and never branches on the kind.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

__all__ = ["Launcher", "tail_file"]


class Launcher(Protocol):
    """Where an engine runs. Implementations: process, docker, external, gpustack."""

    kind: str
    log_path: Path | None

    def start(self) -> None:
        """Start the engine (returns at once; readiness is the health gate's job)."""

    def alive(self) -> bool:
        """Whether the engine is still running."""

    def ready(self, progress: Callable[[str], None] | None = None) -> bool:
        """Whether the engine is ready as far as the launcher can tell (a cluster manager's instance
        state), each change of its start reported to ``progress``; True where only the engine's
        health URL can tell. Raises :class:`k3pipe.core.errors.LaunchError` when the start failed."""

    def exit_code(self) -> int | None:
        """The engine's exit code once it has ended, else None."""

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the engine's log."""

    def stop(self, grace_s: float | None = None) -> None:
        """Stop what ``start`` started; bounded in time, safe to call on every path and repeatedly.
        ``grace_s``: the most time the engine gets to exit after the polite signal (an interrupted
        run gives less than ``launcher.stop_timeout_s``)."""


def tail_file(path: Path | None, lines: int = 40) -> str:
    """Last ``lines`` lines of a text file ('' when absent)."""
    if path is None or not path.exists():
        return ""
    with path.open("r", errors="replace") as fh:
        return "".join(deque(fh, maxlen=lines))
