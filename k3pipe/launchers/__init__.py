"""Launchers: where an engine runs (start, logs, alive, stop)."""

from k3pipe.launchers.base import Launcher, tail_file
from k3pipe.launchers.external import ExternalLauncher
from k3pipe.launchers.process import ProcessLauncher

__all__ = ["ExternalLauncher", "Launcher", "ProcessLauncher", "tail_file"]
