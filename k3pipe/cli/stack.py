"""`k3pipe stack up|down|status|env|add-node`: the team stack (k3pipe.ops.stack) from the command line."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from k3pipe.core.errors import K3pipeError
from k3pipe.core.settings import SettingsError, load_settings

if TYPE_CHECKING:
    from k3pipe.ops.stack import StackConfig

stack_app = typer.Typer(
    help=(
        "The team stack: PostgreSQL, MLflow on it, Prefect, the k3pipe work pool, a worker "
        "(on 127.0.0.1; beyond it only with auth and TLS)."
    ),
    no_args_is_help=True,
)

# the checkout holding prefect.yaml (an editable install); else the directory the command runs in
_CHECKOUT = Path(__file__).resolve().parents[2]


def _config() -> StackConfig:
    from k3pipe.ops.stack import StackConfig

    project = _CHECKOUT if (_CHECKOUT / "prefect.yaml").is_file() else Path.cwd()
    try:
        settings = load_settings()
    except SettingsError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    return StackConfig.from_settings(settings, project)


def _fail(exc: Exception) -> None:
    typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def _say(line: str) -> None:
    print(line, flush=True)


@stack_app.command("up")
def up_cmd() -> None:
    """Start what is not running and wait until each service is ready (a running one is left as is)."""
    from k3pipe.ops.stack import up

    config = _config()
    start = time.monotonic()
    try:
        up(config, progress=_say)
    except K3pipeError as exc:
        _fail(exc)
    print(f"stack up in {time.monotonic() - start:.1f} s (state: {config.state_file})")


@stack_app.command("down")
def down_cmd() -> None:
    """Stop exactly what `stack up` started (its recorded process groups), worker first."""
    from k3pipe.ops.stack import down

    config = _config()
    try:
        down(config, progress=_say)
    except K3pipeError as exc:
        _fail(exc)


@stack_app.command("status")
def status_cmd() -> None:
    """Each service (running, pid, URL, log), who may call the servers and how (bind address, auth,
    TLS), then the lines that point a shell at the stack. Exit code 1 when a service that should run
    is not running."""
    from k3pipe.ops.stack import env_lines, security_lines, status

    config = _config()
    try:
        rows = status(config)
        lines = env_lines(config)
        security = security_lines(config)
    except K3pipeError as exc:
        _fail(exc)
        return
    down = False
    for row in rows:
        if row.running:
            state = "running" if row.answering is not False else "running, NOT answering"
            pid = f"pid {row.pid}"
        else:
            state = row.note or "not running"
            pid = "-"
            down = down or not (row.name == "worker" and not config.worker)
        print(f"{row.name:<9} {state:<24} {pid:<12} {row.url}")
        print(f"{'':<9} log {row.log}")
    for line in security:
        print(line)
    print('\n# to use it (or `eval "$(k3pipe stack env)"`):')
    for line in lines:
        print(line)
    if down:
        raise typer.Exit(1)


@stack_app.command("add-node")
def add_node_cmd(
    name: str = typer.Argument(..., help="The node's name: its work pool and launch deployment take it."),
) -> None:
    """A GPU node for studies spread over nodes (an experiment's fleet.pools): its work pool (one run
    at a time) and launch deployment; prints the commands that start its worker on the node."""
    from k3pipe.ops.stack import add_node

    config = _config()
    try:
        lines = add_node(config, name, progress=_say)
    except K3pipeError as exc:
        _fail(exc)
        return
    _say(f"node {name}: on the node, from its k3pipe checkout:")
    for line in lines:
        print("  " + line)


@stack_app.command("env")
def env_cmd() -> None:
    """The export lines for MLFLOW_TRACKING_URI and PREFECT_API_URL (and, with auth and TLS, the
    credentials read from their file and the stack's CA): eval "$(k3pipe stack env)"."""
    from k3pipe.ops.stack import env_lines

    config = _config()
    try:
        for line in env_lines(config):
            print(line)
    except K3pipeError as exc:
        _fail(exc)
