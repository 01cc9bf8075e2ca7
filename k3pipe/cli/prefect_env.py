"""The command line's Prefect glue: pointing Prefect at K3PIPE_HOME, this command's own temporary
Prefect server (:mod:`k3pipe.cli.local_prefect`), what killed commands left open, and the flow runs an
interrupt ended. The commands themselves (k3pipe/cli/main.py) only call these."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from k3pipe.cli.terminal import log_error
from k3pipe.core.errors import K3pipeError
from k3pipe.core.settings import Settings

__all__ = ["mark_cancelled", "prepare_prefect_env"]


def prepare_prefect_env(settings: Settings, *modules: str) -> None:
    """Point Prefect at K3PIPE_HOME unless the user configured it (call before importing prefect),
    end what commands killed before their teardown left running (engines, Prefect servers), and,
    without PREFECT_API_URL, start this command's own temporary Prefect server
    (:mod:`k3pipe.cli.local_prefect`: out of the terminal's signals, one start at a time per home).
    ``modules`` (the command's flows) are imported while that server boots."""
    import importlib

    from k3pipe.cli.closing import close_gone
    from k3pipe.cli.local_prefect import LocalPrefect
    from k3pipe.core.owners import set_local_prefect
    from k3pipe.core.procs import GroupRegistry

    home = settings.home_dir
    os.environ.setdefault("PREFECT_HOME", str(home / "prefect"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO")
    try:
        # the Prefect servers of killed commands; their engines are the flow's to end (it also
        # closes their MLflow runs and flow runs)
        GroupRegistry(home).reap_orphans(
            progress=lambda line: typer.secho(line, fg=typer.colors.YELLOW, err=True),
            kinds=("prefect-server",),
        )
        server = None
        if not os.environ.get("PREFECT_API_URL"):
            server = LocalPrefect(home, Path(os.environ["PREFECT_HOME"]))
            # set before prefect is imported: its settings are read at import
            os.environ["PREFECT_API_URL"] = server.launch()
            set_local_prefect(os.environ["PREFECT_API_URL"], Path(os.environ["PREFECT_HOME"]))
        for module in modules:
            importlib.import_module(module)
        if server is not None:
            server.wait()
        # what killed commands left open: their engines, MLflow runs, flow runs (k3pipe/cli/closing.py)
        close_gone(settings)
    except OSError as exc:
        raise K3pipeError(f"K3PIPE_HOME {home} cannot be used: {exc}") from exc


def mark_cancelled(home: Path, why: str) -> None:
    """The command's flow runs that an interrupt ended (Prefect marks them Crashed): Cancelled, why,
    each said on the terminal, so that its last word on a flow run is the state recorded."""
    from uuid import UUID

    from prefect import get_client
    from prefect.states import Cancelled

    from k3pipe.core.owners import Owners

    mine = Owners(home).mine()
    try:
        with get_client(sync_client=True) as client:
            for note in mine.flow_runs if mine else []:
                state = client.read_flow_run(UUID(note.id)).state
                if state is None or not state.is_final() or state.is_crashed():
                    was = state.name if state is not None else "no state"
                    client.set_flow_run_state(UUID(note.id), Cancelled(message=why), force=True)
                    typer.secho(
                        f"flow run '{note.name}': {was} -> Cancelled ({why})",
                        fg=typer.colors.YELLOW,
                        err=True,
                    )
    except Exception as exc:  # the exit code and the engine's stop matter more than the label
        log_error(exc)
