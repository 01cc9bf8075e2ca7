"""What a launcher needs from an arm's plan: the launcher of its kind, started, and (docker) its image
pinned to a digest. The one place that turns ``launcher.kind`` into a launcher."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from pydantic import SecretStr

from k3pipe.coldstart import ensure_compile_cache
from k3pipe.engines import get_engine
from k3pipe.errors import SpecError
from k3pipe.launchers.base import Launcher
from k3pipe.launchers.docker import DockerLauncher, connect
from k3pipe.launchers.external import ExternalLauncher
from k3pipe.launchers.process import ProcessLauncher
from k3pipe.plan import ArmPlan
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
    launcher: Launcher
    env = plan.engine_env()  # the spec's env + the compile cache's variable
    ensure_compile_cache(plan)
    key_var = get_engine(plan.engine).api_key_env_var
    if api_key is not None and key_var:
        env[key_var] = api_key.get_secret_value()
    if plan.launcher == "external":
        launcher = ExternalLauncher()
    elif plan.launcher == "process":
        launcher = ProcessLauncher(
            plan.command.argv, {**settings.process_env(), **env}, log_path, stop_timeout_s=plan.stop_timeout_s
        )
    elif plan.launcher == "docker":
        if image is None:
            raise SpecError(f"arm {plan.arm!r}: the docker launcher needs the resolved image (pull step)")
        spec = plan.launch
        launcher = DockerLauncher(
            connect(),
            image,
            plan.command.argv,
            env,
            log_path,
            labels={
                "k3pipe.experiment": plan.experiment,
                "k3pipe.arm": plan.arm,
                "k3pipe.engine": plan.engine,
                **(labels or {}),
            },
            mounts=plan.mounts,
            writable_mounts=plan.writable_mounts,
            gpus=spec.gpus,
            ipc=spec.ipc,
            shm_size=spec.shm_size,
            network=spec.network,
            init=spec.init,
            stop_timeout_s=plan.stop_timeout_s,
        )
    else:
        raise SpecError(f"arm {plan.arm!r}: unknown launcher.kind {plan.launcher!r}")
    launcher.start()
    return launcher


def pull_image(plan: ArmPlan, progress: Progress | None = None) -> ImageRecord:
    """Pull the arm's image (per launcher.pull) and pin it to its registry digest."""
    if not plan.image:
        raise SpecError(f"arm {plan.arm!r}: the docker launcher needs engine.image")
    return resolve_image(connect(), plan.image, plan.launch.pull, progress=progress)
