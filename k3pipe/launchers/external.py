"""An endpoint that is already up (a gateway such as the study's unified API): nothing to start."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from k3pipe.launchers.base import Launcher
from k3pipe.schema.launcher_specs import ExternalLauncherSpec

if TYPE_CHECKING:
    from k3pipe.planning.plan import ArmPlan

__all__ = ["ExternalLauncher", "build"]


class ExternalLauncher:
    """Starts and stops nothing; the health gate proves the endpoint."""

    kind = "external"
    log_path: Path | None = None

    def start(self) -> None:
        return None

    def alive(self) -> bool:
        return True

    def exit_code(self) -> int | None:
        return None

    def ready(self, progress: Callable[[str], None] | None = None) -> bool:
        return True  # the health URL tells

    def log_tail(self, lines: int = 40) -> str:
        return ""

    def stop(self, grace_s: float | None = None) -> None:
        return None


def build(
    spec: ExternalLauncherSpec,
    plan: ArmPlan,
    log_path: Path,
    env: Mapping[str, str],
    base_env: Mapping[str, str],
    image: str | None,
    labels: Mapping[str, str],
    home: Path | None = None,
) -> Launcher:
    """Nothing to start: the endpoint is up."""
    return ExternalLauncher()
