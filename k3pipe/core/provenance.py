"""Where the code that ran came from."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

__all__ = ["git_commit"]


def git_commit(path: Path | None = None) -> str:
    """The k3pipe checkout's commit, with '-dirty' when it has uncommitted changes; 'unknown' outside git.
    Asked of git once per process and directory: what a process runs is the code it started with."""
    return _commit(path or Path(__file__).resolve().parents[2])


@functools.cache
def _commit(where: Path) -> str:
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=where,
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{sha}-dirty" if dirty else sha
