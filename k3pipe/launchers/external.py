"""An endpoint that is already up (a gateway such as the study's unified API): nothing to start."""

from __future__ import annotations

from pathlib import Path

__all__ = ["ExternalLauncher"]


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

    def log_tail(self, lines: int = 40) -> str:
        return ""

    def stop(self) -> None:
        return None
