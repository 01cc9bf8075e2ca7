"""An arm's plan into a started launcher (the spec of its kind builds it), and (a launcher that runs
an image) the image pulled and pinned to its digest."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import SecretStr

from k3pipe.coldstart import ensure_compile_cache
from k3pipe.engines import get_engine
from k3pipe.errors import LaunchError, SpecError
from k3pipe.launchers.base import Launcher
from k3pipe.launchers.docker import DockerLauncherSpec, connect
from k3pipe.plan import ArmPlan
from k3pipe.procs import listening
from k3pipe.settings import Settings
from k3pipe.sources.images import ImageRecord, resolve_image

__all__ = ["launch_engine", "pull_image"]

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
    env = plan.engine_env()  # the spec's env + the compile cache's variable
    ensure_compile_cache(plan)
    key_var = get_engine(plan.engine).api_key_env_var
    if api_key is not None and key_var:
        env[key_var] = api_key.get_secret_value()
    launcher = plan.launch.build(
        plan, log_path, env, settings.process_env(), image, dict(labels or {}), home=settings.home_dir
    )
    _port_is_free(plan)
    launcher.start()
    return launcher


def _port_is_free(plan: ArmPlan) -> None:
    """An engine about to start must not find its port answering already: the health gate would
    take the answer of whatever is there (a stale engine of an earlier run) for the new engine's."""
    if not plan.launch.starts_engine:
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
    return resolve_image(connect(), plan.image, spec.pull, progress=progress)
