"""An endpoint that is already up (a gateway such as the study's unified API): nothing to start."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field

from k3pipe.launchers.base import Launcher, LauncherSpecBase

if TYPE_CHECKING:
    from k3pipe.plan import ArmPlan
    from k3pipe.specs import EndpointSpec, EngineSpec

__all__ = ["ExternalLauncher", "ExternalLauncherSpec"]


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


class ExternalLauncherSpec(LauncherSpecBase):
    """``launcher.kind: external``: an endpoint that is already up at ``endpoint.base_url``; k3pipe
    starts, stops and probes nothing of it (its node is not this one)."""

    kind: Literal["external"] = Field(description="external: an endpoint already running.")

    starts_engine: ClassVar[bool] = False
    runs_here: ClassVar[bool] = False

    def arm_problem(self, engine: EngineSpec, endpoint: EndpointSpec) -> str | None:
        if not endpoint.base_url:
            return "launcher.kind 'external' needs endpoint.base_url (the running endpoint)"
        return None

    def host_view(self, engine_path: str) -> str | None:
        return None

    def build(
        self,
        plan: ArmPlan,
        log_path: Path,
        env: Mapping[str, str],
        base_env: Mapping[str, str],
        image: str | None,
        labels: Mapping[str, str],
        home: Path | None = None,
    ) -> Launcher:
        return ExternalLauncher()
