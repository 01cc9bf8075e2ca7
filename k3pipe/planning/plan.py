"""Resolve an experiment arm into what will run: the exact command, environment and endpoint."""

from __future__ import annotations

import hashlib
import json
import posixpath
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from k3pipe.core.secrets import UnsetVariable, env_references, is_secret_name, resolve_env_references
from k3pipe.engines import RenderedCommand, get_engine, render_args
from k3pipe.engines.base import Engine
from k3pipe.schema.schedule import models_of
from k3pipe.schema.specs import (
    ArmSpec,
    ClientSpec,
    ExperimentSpec,
    GatewaySpec,
    HardwareSpec,
    LauncherSpec,
    expand_home,
)
from k3pipe.sources import model_dir

__all__ = [
    "VISIBLE_DEVICES",
    "ArmGpus",
    "ArmPlan",
    "CompileCache",
    "GpuBasis",
    "GpuRequest",
    "compile_cache_key",
    "default_model_dirs",
    "gpu_indexes",
    "parse_visible_devices",
    "plan_arm",
]


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


VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"

GpuBasis = Literal["CUDA_VISIBLE_DEVICES", "device arguments", "launcher.gpus", "parallel size", "node-wide"]
"""How an arm's GPUs were decided: the devices its environment, its engine's own arguments or its
launcher name; a count from the engine's parallel sizes; or nothing known (the node's, all of them)."""


def parse_visible_devices(value: str) -> list[str]:
    """The devices a ``CUDA_VISIBLE_DEVICES`` value makes visible, read as CUDA reads it: indexes
    (``'0,1'``) or UUIDs (``'GPU-...'``, ``'MIG-...'``; a unique prefix is enough), comma-separated,
    up to the first entry that is neither (CUDA ignores it and all after it: ``'0,1,-1,2'`` is 0 and
    1); ``''`` makes none visible. A device named twice counts once."""
    out: list[str] = []
    for part in value.split(","):
        item = part.strip()
        if item.isdigit():
            out.append(str(int(item)))
        elif item.startswith(("GPU-", "MIG-")) and len(item) > 4:
            out.append(item)
        else:
            break
    return list(dict.fromkeys(out))


def gpu_indexes(devices: Sequence[str], uuids: Sequence[str | None] | None) -> list[int]:
    """The nvidia-smi indexes of ``devices`` (indexes, or UUIDs as CUDA_VISIBLE_DEVICES writes them,
    a unique prefix enough) on a node whose GPUs have ``uuids`` in index order (None: not probed, so
    indexes are taken as written and a UUID cannot be placed). ValueError, saying which and why, for
    a device that is not one of the node's GPUs or is a MIG instance (its board's power is not its
    own)."""
    out: list[int] = []
    for device in devices:
        if device.isdigit():
            index = int(device)
            if uuids is not None and index >= len(uuids):
                raise ValueError(f"GPU {index} is not on this node (nvidia-smi lists {len(uuids)})")
            out.append(index)
        elif device.startswith("MIG-"):
            raise ValueError(f"{device} is a MIG instance: nvidia-smi reports its whole board's power")
        else:
            found = [i for i, uuid in enumerate(uuids or []) if uuid and uuid.startswith(device)]
            if len(found) != 1:
                listed = "its GPUs' UUIDs unknown" if uuids is None else f"{len(uuids)} GPUs listed"
                raise ValueError(f"{device} matches {len(found)} of the node's GPUs ({listed})")
            out.append(found[0])
    return sorted(set(out))


def _among(seen: list[str] | None, seen_count: int | None, ids: list[str]) -> tuple[list[str] | None, int]:
    """``ids`` chosen among the devices an engine sees (``seen``: their ids on the node, None where
    unknown; ``seen_count``: how many, None where any): an index picks from them, a UUID names a
    device itself. Read as CUDA does, up to the first index out of range. The devices as node ids
    (None: some are only an index into devices not named) and how many."""
    out: list[str] = []
    named = True
    for item in ids:
        if not item.isdigit():
            out.append(item)
            continue
        index = int(item)
        if seen is not None:
            if index >= len(seen):
                break
            out.append(seen[index])
        elif seen_count is not None:
            if index >= seen_count:
                break
            named = False
            out.append(item)
        else:
            out.append(item)  # nothing narrowed the node's devices: an index is the node's
    out = list(dict.fromkeys(out))
    return (out if named else None), len(out)


class ArmGpus(BaseModel):
    """The GPUs an arm's engine holds, as its launch says, and how that was decided: what its energy
    sums (the devices, where named), its cost rents and its per-GPU figures divide by (the count)."""

    model_config = ConfigDict(frozen=True)

    devices: list[str] | None = Field(
        description="The GPUs as the node names them: nvidia-smi indexes ('0') or UUIDs ('GPU-...'); "
        "None: the launch names no devices."
    )
    count: int | None = Field(
        description="How many GPUs the arm holds: its devices, or the engine's parallel size; None: not "
        "known (the experiment's hardware.gpu_count stands in)."
    )
    basis: GpuBasis
    source: str = Field(description="What was read, e.g. \"engine.env CUDA_VISIBLE_DEVICES='0,1'\".")

    def counted(self, uuids: Sequence[str | None] | None) -> tuple[list[int] | None, str | None]:
        """The nvidia-smi indexes of the arm's GPUs on a node whose GPUs have ``uuids`` in index
        order (None: not probed; indexes are then taken as written), or None (its energy is then
        node-wide) and why."""
        if self.devices is None:
            return None, None
        try:
            return gpu_indexes(self.devices, uuids), None
        except ValueError as exc:
            return None, str(exc)

    def params(self, uuids: Sequence[str | None] | None) -> dict[str, Any]:
        """MLflow params ``gpus.*``: ``basis``, ``source``, ``count`` (where known), ``counted`` (the
        indexes energy sums, or 'node-wide') and ``counted_note`` (why node-wide despite devices)."""
        indexes, why = self.counted(uuids)
        out: dict[str, Any] = {
            "gpus.basis": self.basis,
            "gpus.source": self.source,
            "gpus.count": self.count,
            "gpus.counted": ",".join(map(str, indexes)) if indexes is not None else "node-wide",
            "gpus.counted_note": why,
        }
        return {k: v for k, v in out.items() if v is not None}


class GpuRequest(BaseModel):
    """What an arm's spec says of the GPUs its engine will hold, read at plan time;
    :meth:`resolve` decides them, with k3pipe's environment where the engine inherits it."""

    model_config = ConfigDict(frozen=True)

    starts_engine: bool = Field(description="k3pipe starts the engine (else: an endpoint's GPUs are unseen).")
    launcher: int | list[str] | None = Field(description="The launcher's GPUs: node ids, a count, or None.")
    visible: str | None = Field(description="CUDA_VISIBLE_DEVICES as the spec's engine.env sets it.")
    inherits_env: bool = Field(description="The engine inherits k3pipe's environment (a local process).")
    picks: list[str] | None = Field(description="Devices the engine's own arguments choose (index or UUID).")
    picks_source: str | None = Field(description="Those arguments as written.")
    parallel: int = Field(description="The engine's parallel size: the GPUs its ranks take on this node.")
    parallel_source: str = Field(description="The sizes that give it, e.g. 'tensor_parallel_size 2'.")

    def resolve(self, environ: Mapping[str, str] | None = None) -> ArmGpus:
        """The arm's GPUs: the devices its launcher, ``CUDA_VISIBLE_DEVICES`` (the spec's, else
        ``environ``'s where the engine inherits it) and its engine's device arguments name, each
        choosing among those before; else the engine's parallel size as a count; node-wide for an
        engine k3pipe does not start. ``environ`` (k3pipe's) also resolves ``{env.NAME}``."""
        if not self.starts_engine:
            return ArmGpus(
                devices=None, count=None, basis="node-wide", source="an endpoint k3pipe does not start"
            )
        env = environ or {}
        text, where = self.visible, "engine.env"
        if text is None and self.inherits_env and VISIBLE_DEVICES in env:
            text, where = env[VISIBLE_DEVICES], "k3pipe's environment"
        notes: list[str] = []
        written = text  # as the spec writes it: a reference's value is k3pipe's to resolve, not to record
        if text is not None and env_references(text):
            try:
                text = resolve_env_references(text, env.get)
            except UnsetVariable as exc:
                notes.append(f"{where} {VISIBLE_DEVICES}={text} refers to {exc.name}, unset here")
                text = None
        seen: list[str] | None = None
        seen_count: int | None = None
        basis: GpuBasis | None = None
        read: list[str] = []
        if isinstance(self.launcher, list):
            seen, seen_count, basis = list(self.launcher), len(self.launcher), "launcher.gpus"
            read.append(f"launcher.gpus {','.join(self.launcher)}")
        elif isinstance(self.launcher, int):
            seen_count, basis = self.launcher, "launcher.gpus"
            read.append(f"launcher.gpus {self.launcher} (a count)")
        if text is not None:
            seen, seen_count = _among(seen, seen_count, parse_visible_devices(text))
            basis = "CUDA_VISIBLE_DEVICES"
            read.append(f"{where} {VISIBLE_DEVICES}={written!r}")
        if self.picks is not None:
            seen, seen_count = _among(seen, seen_count, self.picks)
            basis = "device arguments"
            read.append(self.picks_source or "the engine's device arguments")
        if basis is None:
            return ArmGpus(
                devices=None,
                count=self.parallel,
                basis="parallel size",
                source="; ".join([self.parallel_source, *notes]),
            )
        if seen_count != self.parallel:
            notes.append(f"the engine's parallel size is {self.parallel} ({self.parallel_source})")
        return ArmGpus(
            devices=seen, count=seen_count, basis=basis, source="; ".join([", then ".join(read), *notes])
        )


def gpu_request(engine: Engine, arm: ArmSpec, env: Mapping[str, str]) -> GpuRequest:
    """What ``arm`` says of its GPUs (``env``: the engine's environment as the spec sets it)."""
    parallel, parallel_source = engine.parallel_gpus(arm.engine.args)
    picks = engine.device_picks(arm.engine.args)
    return GpuRequest(
        starts_engine=arm.launcher.starts_engine,
        launcher=arm.launcher.gpu_request(),
        visible=env.get(VISIBLE_DEVICES),
        inherits_env=arm.launcher.inherits_env,
        picks=picks[0] if picks else None,
        picks_source=picks[1] if picks else None,
        parallel=parallel,
        parallel_source=parallel_source,
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
    watch_url: str | None = Field(
        default=None,
        description=(
            "URL the engine watch probes while a workload runs, where it is not health_url (the "
            "engine's watch_path: one a busy engine still answers; asked with the key)."
        ),
    )
    version_url: str | None = Field(description="URL that reports the engine version.")
    metrics_url: str | None = Field(
        default=None,
        description="The engine's Prometheus endpoint (an external endpoint's: its endpoint.metrics_url).",
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
        description="The experiment's hardware: section (its hour price, and its GPU count where the "
        "arm's is not known: each cell's cost).",
    )
    gpu_request: GpuRequest | None = Field(
        default=None, description="What the spec says of the GPUs the engine holds (see gpus())."
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

    def gpus(self, environ: Mapping[str, str] | None = None) -> ArmGpus:
        """The GPUs the arm's engine holds (:meth:`GpuRequest.resolve`; ``environ``: k3pipe's own
        environment, which a local engine inherits); node-wide for a plan made without a request."""
        if self.gpu_request is None:
            return ArmGpus(devices=None, count=None, basis="node-wide", source="not planned")
        return self.gpu_request.resolve(environ)

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
    launcher = arm.launcher.drawn()  # a port 'auto' drawn free here, where the launch is planned
    # the engine checks the endpoint's key itself (not a gateway in front of it)
    key_env = arm.endpoint.api_key_env if launcher.engine_checks_key else None
    key_args = engine.key_args(key_env, arm.engine.args)
    dirs = dict(model_dirs) if model_dirs is not None else default_model_dirs(exp, home)
    # each arm sees the model and the extra models it names, not another arm's (a vLLM container
    # got the SGLang draft mounted, which it never used)
    needed = {"model", *(f"models.{name}" for name in models_of(arm)[1:])}
    dirs = {key: value for key, value in dirs.items() if key in needed}
    host_dirs = dict(dirs)
    dirs, mounts = launcher.place_models(dirs)
    for host_path, inside in launcher.extra_mounts().items():
        mounts[str(Path(expand_home(host_path, home)).expanduser().absolute())] = inside
    port = launcher.port or engine.default_port
    served = exp.model.served_name
    binding = launcher.binding(engine.default_port, served)
    argv = [
        *(expand_home(part, home) for part in (arm.engine.executable or [])),
        *engine.managed_args(dirs["model"], binding.served_name, binding.host, binding.port),
        *key_args,
        *render_args(arm.engine.args, dirs),
    ]
    env = {k: expand_home(v, home) for k, v in arm.engine.env.items()}
    # an engine bound to all interfaces is still reached through loopback from here
    host = "127.0.0.1" if launcher.host in ("0.0.0.0", "::") else launcher.host
    root = f"http://{host}:{port}"
    # an engine elsewhere (an endpoint, a cluster manager's worker) is reached through its base URL only
    external = not launcher.runs_here
    # a cluster manager's own OpenAI route (GPUStack's /v1) is where the engine is reached
    route = launcher.gateway(exp.name, arm.name)
    base_url = arm.endpoint.base_url or (route.base_url if route else f"{root}/v1")
    return ArmPlan(
        experiment=exp.name,
        arm=arm.name,
        engine=engine.kind,
        engine_version=arm.engine.version,
        launcher=launcher.kind,
        image=arm.engine.image,
        command=RenderedCommand(argv=argv, env=env),
        base_url=base_url,
        model=arm.endpoint.model or (route.model if route else served or dirs["model"]),
        api_key_env=arm.endpoint.api_key_env or (route.api_key_env if route else None),
        continuous_usage=arm.endpoint.continuous_usage_stats,
        gateway=arm.gateway,
        health_url=None if external else root + engine.health_path,
        watch_url=None if external or engine.watch_path is None else root + engine.watch_path,
        version_url=None if external or not engine.version_path else root + engine.version_path,
        metrics_url=arm.endpoint.metrics_url if external else root + "/metrics",
        startup_timeout_s=launcher.startup_timeout_s,
        stop_timeout_s=launcher.stop_timeout_s,
        launch=launcher,
        mounts=mounts,
        compile_cache=_compile_cache(engine, arm, home, host_dirs, model_digests, env),
        client=exp.client,
        hardware=exp.hardware,
        gpu_request=gpu_request(engine, arm, env),
    )
