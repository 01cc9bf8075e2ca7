"""Resolve an experiment arm into what will run: the exact command, environment and endpoint."""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from k3pipe.engines import RenderedCommand, get_engine, render_args
from k3pipe.sources import model_dir
from k3pipe.specs import ArmSpec, ExperimentSpec, LauncherSpec, expand_home

__all__ = ["ArmPlan", "default_model_dirs", "plan_arm"]


class ArmPlan(BaseModel):
    """One arm, resolved: everything needed to launch it, reach it and record it."""

    model_config = ConfigDict(frozen=True)

    experiment: str
    arm: str
    engine: str = Field(description="Engine kind.")
    engine_version: str | None = Field(description="Engine version declared in the spec.")
    launcher: str = Field(description="Launcher kind.")
    image: str | None = Field(description="Container image, for the docker launcher.")
    command: RenderedCommand = Field(description="Exact command line and spec environment.")
    base_url: str = Field(description="OpenAI-compatible base URL, path included.")
    model: str = Field(description="Model id sent in requests.")
    api_key_env: str | None = Field(description="Name of the environment variable holding the key.")
    continuous_usage: bool = Field(
        default=True, description="Requests ask for stream_options.continuous_usage_stats."
    )
    health_url: str | None = Field(description="URL polled until the engine answers (None: external).")
    version_url: str | None = Field(description="URL that reports the engine version.")
    metrics_url: str | None = Field(
        default=None, description="The engine's Prometheus endpoint (None: external endpoints)."
    )
    startup_timeout_s: float
    stop_timeout_s: float
    launch: LauncherSpec = Field(description="The launcher settings (docker: GPUs, ipc, mounts ...).")
    mounts: dict[str, str] = Field(
        default_factory=dict, description="docker: host model directory -> path in the container."
    )

    def docker_run(self, image: str | None = None) -> str:
        """The equivalent ``docker run`` command line (secrets redacted), for humans and the record."""
        spec = self.launch
        parts = ["docker", "run", "--rm", "--network", spec.network]
        if spec.ipc:
            parts += ["--ipc", spec.ipc]
        if spec.shm_size:
            parts += ["--shm-size", spec.shm_size]
        if spec.init:
            parts.append("--init")
        if isinstance(spec.gpus, int):
            parts += ["--gpus", str(spec.gpus)]
        elif spec.gpus:
            parts += ["--gpus", f'"device={",".join(spec.gpus)}"']
        for host, container in self.mounts.items():
            parts += ["-v", f"{host}:{container}:ro"]
        for key, value in self.command.redacted_env().items():
            parts += ["-e", f"{key}={value}"]
        parts.append(image or self.image or "IMAGE")
        return shlex.join(parts) + " " + shlex.join(self.command.redacted_argv())


def default_model_dirs(exp: ExperimentSpec, home: Path) -> dict[str, str]:
    """Where each model of the experiment lives: {'model': dir, 'models.NAME': dir}."""
    dirs = {"model": str(model_dir(exp.model, home))}
    for name, spec in exp.extra_models.items():
        dirs[f"models.{name}"] = str(model_dir(spec, home))
    return dirs


def plan_arm(
    exp: ExperimentSpec, arm: ArmSpec, home: Path, model_dirs: Mapping[str, str] | None = None
) -> ArmPlan:
    """Render ``arm`` of ``exp``: managed flags (model, served name, host, port) then the spec's args."""
    engine = get_engine(arm.engine.kind)
    engine.check_args(arm.engine.args)
    dirs = dict(model_dirs) if model_dirs is not None else default_model_dirs(exp, home)
    mounts: dict[str, str] = {}
    if arm.launcher.kind == "docker":
        # the engine sees each model read-only under launcher.model_mount
        in_container = {}
        for key, host_dir in dirs.items():
            target = f"{arm.launcher.model_mount.rstrip('/')}/{key.removeprefix('models.')}"
            mounts[host_dir] = target
            in_container[key] = target
        dirs = in_container
    port = arm.launcher.port or engine.default_port
    served = exp.model.served_name
    argv = [
        *(expand_home(part, home) for part in (arm.engine.executable or [])),
        *engine.managed_args(dirs["model"], served, arm.launcher.host, port),
        *render_args(arm.engine.args, dirs),
    ]
    env = {k: expand_home(v, home) for k, v in arm.engine.env.items()}
    # an engine bound to all interfaces is still reached through loopback from here
    host = "127.0.0.1" if arm.launcher.host in ("0.0.0.0", "::") else arm.launcher.host
    root = f"http://{host}:{port}"
    external = arm.launcher.kind == "external"
    base_url = arm.endpoint.base_url or f"{root}/v1"
    return ArmPlan(
        experiment=exp.name,
        arm=arm.name,
        engine=engine.kind,
        engine_version=arm.engine.version,
        launcher=arm.launcher.kind,
        image=arm.engine.image,
        command=RenderedCommand(argv=argv, env=env),
        base_url=base_url,
        model=arm.endpoint.model or served or dirs["model"],
        api_key_env=arm.endpoint.api_key_env,
        continuous_usage=arm.endpoint.continuous_usage_stats,
        health_url=None if external else root + engine.health_path,
        version_url=None if external or not engine.version_path else root + engine.version_path,
        metrics_url=None if external else root + "/metrics",
        startup_timeout_s=arm.launcher.startup_timeout_s,
        stop_timeout_s=arm.launcher.stop_timeout_s,
        launch=arm.launcher,
        mounts=mounts,
    )
