"""The launcher kinds an experiment may name: the union of their specs, discriminated by ``kind``
(``process`` when the ``launcher:`` block leaves it out). A new kind is a module of this package
(its spec and its launcher) plus one line here."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Discriminator, Tag

from k3pipe.launchers.docker import DockerLauncherSpec
from k3pipe.launchers.external import ExternalLauncherSpec
from k3pipe.launchers.gpustack import GpustackLauncherSpec
from k3pipe.launchers.process import ProcessLauncherSpec

__all__ = ["LAUNCHER_SPECS", "LauncherSpec", "ProcessLauncherSpec"]

LAUNCHER_SPECS: dict[str, type[BaseModel]] = {
    "process": ProcessLauncherSpec,
    "docker": DockerLauncherSpec,
    "external": ExternalLauncherSpec,
    "gpustack": GpustackLauncherSpec,
}


def _kind(value: Any) -> str | None:
    """The launcher's kind: ``kind`` of the mapping (process when absent) or of the model."""
    if isinstance(value, dict):
        return str(value.get("kind", "process"))
    return getattr(value, "kind", None)


LauncherSpec = Annotated[
    Annotated[ProcessLauncherSpec, Tag("process")]
    | Annotated[DockerLauncherSpec, Tag("docker")]
    | Annotated[ExternalLauncherSpec, Tag("external")]
    | Annotated[GpustackLauncherSpec, Tag("gpustack")],
    Discriminator(_kind),
]
