"""Launchers: where an engine runs (start, logs, alive, stop)."""

from k3pipe.launchers.base import Launcher, tail_file
from k3pipe.launchers.docker import DockerLauncher, connect, reap_orphans
from k3pipe.launchers.external import ExternalLauncher
from k3pipe.launchers.gpustack import GpustackLauncher
from k3pipe.launchers.process import ProcessLauncher

__all__ = [
    "DockerLauncher",
    "ExternalLauncher",
    "GpustackLauncher",
    "Launcher",
    "ProcessLauncher",
    "connect",
    "reap_orphans",
    "tail_file",
]
