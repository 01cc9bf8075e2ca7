"""Resolve an experiment arm into what will run: the exact command, environment and endpoint."""

from __future__ import annotations

import hashlib
import json
import posixpath
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from k3pipe.engines import RenderedCommand, get_engine, render_args
from k3pipe.engines.base import Engine
from k3pipe.schedule import models_of
from k3pipe.secrets import is_secret_name
from k3pipe.sources import model_dir
from k3pipe.specs import (
    ArmSpec,
    ClientSpec,
    ExperimentSpec,
    GatewaySpec,
    HardwareSpec,
    LauncherSpec,
    expand_home,
)

__all__ = ["ArmPlan", "CompileCache", "compile_cache_key", "default_model_dirs", "plan_arm"]


class CompileCache(BaseModel):
    """Where an arm's engine keeps its compile cache, so that a relaunch of the same configuration
    loads its compiled graphs instead of compiling again (a warm start)."""

    model_config = ConfigDict(frozen=True)

    var: str = Field(description="The engine's environment variable for it, e.g. VLLM_CACHE_ROOT.")
    key: str = Field(description="Short hash of what the compiled artifacts depend on (see factors).")
    dir: str = Field(description="The directory as the engine sees it (the variable's value).")
    host_dir: str | None = Field(
        description="The same directory on this machine (None: a container path the spec set)."
    )
    source: Literal["k3pipe", "spec"] = Field(
        description="k3pipe: K3PIPE_HOME/cache/<engine>/<key>; spec: the spec's env sets the variable."
    )
    factors: dict[str, Any] = Field(
        description="What went into the key: engine, declared version, executable or image, model "
        "digests, and the arguments and environment that can change compilation."
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Every variable k3pipe sets for it, as the engine sees it: the main one and those of "
        "the caches the engine's libraries keep apart (subdirectories of dir); none when the spec set "
        "the main one.",
    )

    def describe(self) -> str:
        more = "".join(f", {k}={v}" for k, v in self.env.items() if k != self.var)
        return f"compile cache: {self.var}={self.dir}{more} (key {self.key}, set by {self.source})"

    def settings(self, spec_env: Mapping[str, str]) -> dict[str, str]:
        """The variables k3pipe sets for the launch: :attr:`env` less any the spec sets itself."""
        return {k: v for k, v in self.env.items() if k not in spec_env}


def compile_cache_key(factors: Mapping[str, Any]) -> str:
    """12 hex digits of sha256 over the factors as sorted JSON."""
    text = json.dumps(factors, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _compile_cache(
    engine: Engine,
    arm: ArmSpec,
    home: Path,
    host_dirs: Mapping[str, str],
    model_digests: Mapping[str, str] | None,
    env: Mapping[str, str],
) -> CompileCache | None:
    var = engine.compile_cache_env_var
    launcher = arm.launcher
    if var is None or not launcher.runs_here:
        return None
    cache_vars = {var, *engine.compile_cache_subdirs}
    digests = dict(model_digests or {})
    models = {}
    for key, host_dir in host_dirs.items():
        name = key.removeprefix("models.")
        # without the digest (k3pipe render, before any download) the directory stands in for it
        models[name] = digests.get(name) or f"dir:{host_dir}"
    factors = {
        "engine": engine.kind,
        "version": arm.engine.version,
        **launcher.cache_factors(arm.engine),
        "models": models,
        # a secret changes nothing the engine compiles (and must not go into compile_cache.json)
        **engine.compiles_with(
            {k: v for k, v in arm.engine.args.items() if not is_secret_name(str(k))},
            {k: v for k, v in env.items() if k not in cache_vars and not is_secret_name(k)},
        ),
    }
    key = compile_cache_key(factors)
    if var in env:
        where = env[var]
        host = launcher.host_view(where)
        return CompileCache(var=var, key=key, dir=where, host_dir=host, source="spec", factors=factors)
    host_dir = str(home / "cache" / engine.kind / key)
    inside = launcher.engine_cache_dir(host_dir, engine.compile_cache_mount)
    sets = {var: inside} | {
        name: posixpath.join(inside, sub) for name, sub in engine.compile_cache_subdirs.items()
    }
    return CompileCache(
        var=var, key=key, dir=inside, host_dir=host_dir, source="k3pipe", factors=factors, env=sets
    )


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
    base_url: str = Field(description="The engine's OpenAI-compatible base URL, path included.")
    model: str = Field(description="The engine's model id (sent in requests when there is no gateway).")
    api_key_env: str | None = Field(description="Name of the environment variable holding the engine's key.")
    continuous_usage: bool = Field(
        default=True, description="Requests ask for stream_options.continuous_usage_stats."
    )
    gateway: GatewaySpec | None = Field(
        default=None,
        description="The gateway in front of the engine: the client target (None: the engine itself).",
    )
    health_url: str | None = Field(description="URL polled until the engine answers (None: external).")
    version_url: str | None = Field(description="URL that reports the engine version.")
    metrics_url: str | None = Field(
        default=None, description="The engine's Prometheus endpoint (None: external endpoints)."
    )
    startup_timeout_s: float
    stop_timeout_s: float
    launch: LauncherSpec = Field(description="The launcher's spec (its kind's settings and behaviour).")
    mounts: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "Host path -> the engine's path for it, mounted read-only (containers): the model "
            "directories, then launcher.volumes."
        ),
    )
    compile_cache: CompileCache | None = Field(
        default=None, description="The engine's compile cache (None: the engine or launcher has none)."
    )
    client: ClientSpec = Field(
        default_factory=ClientSpec, description="How the load generator runs (the experiment's client)."
    )
    hardware: HardwareSpec | None = Field(
        default=None,
        description="The experiment's hardware: section (its GPU count and hour price: each cell's cost).",
    )

    # The client target: what the health gate's proof and the benchmark send to (the gateway's three
    # settings when there is one); the engine's own URLs (health, metrics, version) stay the engine's.

    @property
    def client_base_url(self) -> str:
        """The base URL requests go to: the gateway's, else the engine's."""
        return self.gateway.base_url if self.gateway else self.base_url

    @property
    def client_model(self) -> str:
        """The model id requests carry: the gateway's, else the engine's."""
        return self.gateway.model if self.gateway else self.model

    @property
    def client_key_env(self) -> str | None:
        """The variable holding the key requests carry: the gateway's, else the engine's."""
        return self.gateway.api_key_env if self.gateway else self.api_key_env

    @property
    def client_continuous_usage(self) -> bool:
        """Whether requests ask for stream_options.continuous_usage_stats (the gateway's setting)."""
        return self.gateway.continuous_usage_stats if self.gateway else self.continuous_usage

    def engine_env(self) -> dict[str, str]:
        """The spec's environment plus the compile-cache variables k3pipe sets (a spec's own wins)."""
        env = dict(self.command.env)
        if self.compile_cache is not None:
            env |= self.compile_cache.settings(self.command.env)
        return env


def default_model_dirs(exp: ExperimentSpec, home: Path) -> dict[str, str]:
    """Where each model of the experiment lives: {'model': dir, 'models.NAME': dir}."""
    dirs = {"model": str(model_dir(exp.model, home))}
    for name, spec in exp.extra_models.items():
        dirs[f"models.{name}"] = str(model_dir(spec, home))
    return dirs


def plan_arm(
    exp: ExperimentSpec,
    arm: ArmSpec,
    home: Path,
    model_dirs: Mapping[str, str] | None = None,
    model_digests: Mapping[str, str] | None = None,
) -> ArmPlan:
    """Render ``arm`` of ``exp``: managed flags (model, served name, host, port) then the spec's args.

    ``model_digests`` ({'model': digest, 'NAME': digest}, from the ModelRecords) go into the compile
    cache's key; without them each model's directory stands in.
    """
    engine = get_engine(arm.engine.kind)
    engine.check_args(arm.engine.args)
    # the engine checks the endpoint's key itself (not a gateway in front of it)
    key_env = arm.endpoint.api_key_env if arm.launcher.engine_checks_key else None
    key_args = engine.key_args(key_env, arm.engine.args)
    dirs = dict(model_dirs) if model_dirs is not None else default_model_dirs(exp, home)
    # each arm sees the model and the extra models it names, not another arm's (a vLLM container
    # got the SGLang draft mounted, which it never used)
    needed = {"model", *(f"models.{name}" for name in models_of(arm)[1:])}
    dirs = {key: value for key, value in dirs.items() if key in needed}
    host_dirs = dict(dirs)
    dirs, mounts = arm.launcher.place_models(dirs)
    for host_path, inside in arm.launcher.extra_mounts().items():
        mounts[str(Path(expand_home(host_path, home)).expanduser().absolute())] = inside
    port = arm.launcher.port or engine.default_port
    served = exp.model.served_name
    binding = arm.launcher.binding(engine.default_port, served)
    argv = [
        *(expand_home(part, home) for part in (arm.engine.executable or [])),
        *engine.managed_args(dirs["model"], binding.served_name, binding.host, binding.port),
        *key_args,
        *render_args(arm.engine.args, dirs),
    ]
    env = {k: expand_home(v, home) for k, v in arm.engine.env.items()}
    # an engine bound to all interfaces is still reached through loopback from here
    host = "127.0.0.1" if arm.launcher.host in ("0.0.0.0", "::") else arm.launcher.host
    root = f"http://{host}:{port}"
    # an engine elsewhere (an endpoint, a cluster manager's worker) is reached through its base URL only
    external = not arm.launcher.runs_here
    # a cluster manager's own OpenAI route (GPUStack's /v1) is where the engine is reached
    route = arm.launcher.gateway(exp.name, arm.name)
    base_url = arm.endpoint.base_url or (route.base_url if route else f"{root}/v1")
    return ArmPlan(
        experiment=exp.name,
        arm=arm.name,
        engine=engine.kind,
        engine_version=arm.engine.version,
        launcher=arm.launcher.kind,
        image=arm.engine.image,
        command=RenderedCommand(argv=argv, env=env),
        base_url=base_url,
        model=arm.endpoint.model or (route.model if route else served or dirs["model"]),
        api_key_env=arm.endpoint.api_key_env or (route.api_key_env if route else None),
        continuous_usage=arm.endpoint.continuous_usage_stats,
        gateway=arm.gateway,
        health_url=None if external else root + engine.health_path,
        version_url=None if external or not engine.version_path else root + engine.version_path,
        metrics_url=None if external else root + "/metrics",
        startup_timeout_s=arm.launcher.startup_timeout_s,
        stop_timeout_s=arm.launcher.stop_timeout_s,
        launch=arm.launcher,
        mounts=mounts,
        compile_cache=_compile_cache(engine, arm, home, host_dirs, model_digests, env),
        client=exp.client,
        hardware=exp.hardware,
    )
