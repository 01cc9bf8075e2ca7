"""The launcher interface: start, logs, alive, stop. Stop always works and may be called twice."""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Protocol

__all__ = ["Launcher", "tail_file"]


class Launcher(Protocol):
    """Where an engine runs. Implementations: process, external (docker in a later release)."""

    kind: str
    log_path: Path | None

    def start(self) -> None:
        """Start the engine (returns at once; readiness is the health gate's job)."""

    def alive(self) -> bool:
        """Whether the engine is still running."""

    def exit_code(self) -> int | None:
        """The engine's exit code once it has ended, else None."""

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the engine's log."""

    def stop(self) -> None:
        """Stop what ``start`` started; bounded in time, safe to call on every path and repeatedly."""


def tail_file(path: Path | None, lines: int = 40) -> str:
    """Last ``lines`` lines of a text file ('' when absent)."""
    if path is None or not path.exists():
        return ""
    with path.open("r", errors="replace") as fh:
        return "".join(deque(fh, maxlen=lines))
