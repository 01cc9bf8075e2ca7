"""An arm's plan into a started launcher (the spec of its kind builds it), and (a launcher that runs
an image) the image pulled and pinned to its digest."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import SecretStr

from k3pipe.core.errors import LaunchError, SpecError
from k3pipe.core.procs import listening
from k3pipe.core.secrets import UnsetVariable, register
from k3pipe.core.settings import Settings, env_value
from k3pipe.engines import get_engine
from k3pipe.engines.base import RenderedCommand
from k3pipe.launchers import build_launcher
from k3pipe.launchers.base import Launcher
from k3pipe.planning.coldstart import ensure_compile_cache
from k3pipe.planning.plan import ArmPlan
from k3pipe.schema.launcher_specs import DockerLauncherSpec
from k3pipe.sources.images import ImageRecord, resolve_image

__all__ = ["launch_engine", "pull_image", "unset_references"]


def unset_references(plan: ArmPlan) -> list[tuple[str, str]]:
    """The ``{env.NAME}`` references of the arm's command whose variable is unset, as ``(field, NAME)``."""
    return [(where, name) for where, name in plan.command.references() if not env_value(name)]


def _resolved(plan: ArmPlan, env: dict[str, str]) -> tuple[RenderedCommand, dict[str, str]]:
    """The arm's command and environment with every ``{env.NAME}`` replaced by NAME's value (each
    value registered as a secret); a clear error, before anything starts, when a variable is unset."""
    missing = unset_references(plan)
    if missing:
        listed = "; ".join(f"{where} refers to {{env.{name}}}" for where, name in missing)
        names = ", ".join(dict.fromkeys(name for _, name in missing))
        raise SpecError(
            f"arm {plan.arm!r}: {listed}, but {names} is not set in k3pipe's environment; set it "
            "(export NAME=..., on the worker for a deployment) and start the run again"
        )

    def lookup(name: str) -> str | None:
        value = env_value(name)
        register(value)
        return value

    try:
        command = plan.command.resolved(lookup)
        return command, {k: command.env.get(k, v) for k, v in env.items()}
    except UnsetVariable as exc:  # set while we looked: the same error as above
        raise SpecError(f"arm {plan.arm!r}: {{env.{exc.name}}} is not set in k3pipe's environment") from exc


Progress = Callable[[str], None]


def launch_engine(
    plan: ArmPlan,
    log_path: Path,
    settings: Settings,
    api_key: SecretStr | None,
    image: str | None = None,
    labels: Mapping[str, str] | None = None,
) -> Launcher:
    """Start the engine of ``plan`` (returns once started; see :func:`wait_ready`).

    docker: the container is created from ``image`` (the pinned ``repository@digest`` that
    :func:`pull_image` resolved), labelled with ``labels``.
    """
    # the spec's env + the compile cache's variable, each {env.NAME} resolved for the launch alone:
    # the plan (what is recorded) keeps the references
    command, env = _resolved(plan, plan.engine_env())
    ensure_compile_cache(plan)
    key_var = get_engine(plan.engine).api_key_env_var
    if api_key is not None and key_var and plan.launch.engine_checks_key:
        env[key_var] = api_key.get_secret_value()
    launch_plan = plan.model_copy(update={"command": command})
    base_env = settings.process_env()
    launcher = build_launcher(
        launch_plan, log_path, env, base_env, image, dict(labels or {}), home=settings.home_dir
    )
    _port_is_free(plan)
    launcher.start()
    return launcher


def _port_is_free(plan: ArmPlan) -> None:
    """An engine about to start must not find its port answering already: the health gate would
    take the answer of whatever is there (a stale engine of an earlier run) for the new engine's."""
    if not plan.launch.runs_here:
        return
    url = urlsplit(plan.health_url or plan.base_url)
    host, port = url.hostname or plan.launch.host, url.port
    if port is not None and listening(host, port):
        raise LaunchError(
            f"arm {plan.arm!r}: port {port} on {host} already answers before the engine was started "
            "(an engine left over from an earlier run, or another program); stop it, or set "
            "launcher.port to a free port"
        )


def pull_image(plan: ArmPlan, progress: Progress | None = None) -> ImageRecord:
    """Pull the arm's image (per launcher.pull) and pin it to its registry digest."""
    spec = plan.launch
    if not plan.image or not isinstance(spec, DockerLauncherSpec):
        raise SpecError(f"arm {plan.arm!r}: only the docker launcher pulls an image (engine.image)")
    from k3pipe.launchers.docker import connect

    return resolve_image(connect(), plan.image, spec.pull, progress=progress)
