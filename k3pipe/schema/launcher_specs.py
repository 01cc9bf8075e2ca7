"""The launcher kinds an experiment may name, as data: each kind's spec (the experiment's
``launcher:`` block), the union :data:`LauncherSpec` discriminated by ``kind`` (``process`` when the
block leaves it out), and what the rest of k3pipe asks a launcher spec instead of testing its kind.

This module is the launchers' data floor: it imports pydantic and k3pipe's pure helpers only, so the
experiment's specs load without the Docker SDK, httpx or the engines. What a kind does (start an
engine, its ``docker run`` line, its mounts) is its implementation module's, found through
:mod:`k3pipe.launchers.factory`. A new kind is a spec here, one line in :data:`LAUNCHER_SPECS` and the
union, and its module (``launchers/<kind>.py``) with ``build`` (and, where it differs from the
default, ``equivalent_command`` and ``writable_mounts``).
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal, NamedTuple, Protocol, Self
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from k3pipe.core import secrets
from k3pipe.core.procs import free_port, parse_cpu_list

__all__ = [
    "AUTO_PORT",
    "LAUNCHER_SPECS",
    "Binding",
    "DockerLauncherSpec",
    "ExternalLauncherSpec",
    "Gateway",
    "GpustackLauncherSpec",
    "LauncherSpec",
    "LauncherSpecBase",
    "ProcessLauncherSpec",
    "check_http_url",
]

_HOST_NAME = re.compile(
    r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*"
)


_SIZE = re.compile(r"[0-9]+[bkmgBKMG]?")  # what docker's --shm-size takes


def _container_path(value: str) -> bool:
    """An absolute path inside a container that a bind mount can name (no ':', spaces or '..')."""
    return (
        value.startswith("/")
        and ".." not in value.split("/")
        and ":" not in value
        and not any(c.isspace() for c in value)
    )


MODEL_PATH = "{{model_path}}"
PORT = "{{port}}"
AUTO_PORT = "auto"
"""launcher.port's value for a port drawn free on the node at launch."""
MODEL_NAME = "{{model_name}}"


class Binding(NamedTuple):
    """What the engine's command line is told: the address and port it binds and the name it serves
    (a cluster manager's placeholders, e.g. ``{{port}}``, where the manager assigns them)."""

    host: str
    port: int | str
    served_name: str | None


class Gateway(NamedTuple):
    """Where requests go when the engine is served through a cluster manager's gateway: the
    OpenAI-compatible base URL, the model id there and the variable holding the gateway's key."""

    base_url: str
    model: str
    api_key_env: str


class EngineFacts(Protocol):
    """What a launcher spec reads of the arm's engine (:class:`k3pipe.schema.specs.EngineSpec`)."""

    @property
    def image(self) -> str | None: ...

    @property
    def executable(self) -> list[str] | None: ...


class EndpointFacts(Protocol):
    """What a launcher spec reads of the arm's endpoint (:class:`k3pipe.schema.specs.EndpointSpec`)."""

    @property
    def base_url(self) -> str | None: ...

    @property
    def api_key_env(self) -> str | None: ...

    @property
    def model(self) -> str | None: ...


def check_http_url(value: str) -> str:
    """``value`` without a trailing '/', if it is an http(s) URL with a host (and a valid port), else a
    ValueError that says what is wrong."""
    if any(c.isspace() for c in value):
        raise ValueError(f"base URL {value!r} holds a space; a URL has none (percent-encode it as %20)")
    if not value.startswith(("http://", "https://")):
        raise ValueError(f"base URL {value!r} must start with http:// or https://")
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError as exc:
        raise ValueError(
            f"base URL {value!r} has an invalid port ({exc}); a port is a number from 1 to 65535"
        ) from exc
    if parts.username is not None or parts.password is not None:
        raise ValueError(
            f"base URL {value!r} holds credentials: put the key in an environment variable and name it "
            "in endpoint.api_key_env"
        )
    if not parts.hostname:
        raise ValueError(
            f"base URL {value!r} has no host; write e.g. 'http://127.0.0.1:8000/v1' "
            "(scheme, host, port, path)"
        )
    if port == 0:
        raise ValueError(f"base URL {value!r} has port 0; a port is a number from 1 to 65535")
    if parts.query or parts.fragment:
        raise ValueError(
            f"base URL {value!r} has a query or fragment; give the base only (e.g. 'http://host:8000/v1')"
        )
    return value.rstrip("/")


class LauncherSpecBase(BaseModel):
    """What every launcher kind's spec has (where the engine binds, how long it may take), and the
    questions the rest of k3pipe asks a launcher instead of testing its kind."""

    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    kind: str
    host: str = Field(default="127.0.0.1", description="Address the engine binds to.")
    port: Annotated[int, Field(ge=1, le=65535)] | Literal["auto"] | None = Field(
        default=None,
        description="Port the engine listens on (default: the engine's). 'auto': a port free on the "
        "node, drawn where and when the launch is planned (engines of one arm launched at once on one "
        "host: two workers of a pool on one machine, half-node pools); the arm's recorded plan and "
        "command say the port drawn.",
    )
    startup_timeout_s: float = Field(
        default=900.0,
        strict=True,
        allow_inf_nan=False,
        gt=0,
        le=86_400.0,
        description="Longest wait for the engine to become healthy (at most a day).",
    )
    stop_timeout_s: float = Field(
        default=30.0,
        strict=True,
        allow_inf_nan=False,
        gt=0,
        le=3_600.0,
        description="Grace period after SIGTERM before SIGKILL of the group (at most an hour).",
    )

    @field_validator("port", mode="before")
    @classmethod
    def _port(cls, value: Any) -> Any:
        """One message for every wrong port (a number, or 'auto'; not a numeric string, not a bool)."""
        if value is None or value == AUTO_PORT:
            return value
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
            raise ValueError(
                f"port {value!r} must be a port number from 1 to 65535, or 'auto' (a free port drawn "
                "on the node at launch)"
            )
        return value

    @model_validator(mode="after")
    def _auto_port_here(self) -> Self:
        if self.port == AUTO_PORT and not (self.starts_engine and self.runs_here):
            raise ValueError(
                f"port 'auto' with kind {self.kind!r}: k3pipe draws a port only for an engine it starts "
                "on this machine (process, docker); remove launcher.port"
            )
        return self

    def drawn(self) -> Self:
        """This spec, an 'auto' port replaced by a port free on this machine now (its launch's plan).
        Two launches drawing at once get the kernel's ephemeral ports, which it hands out spread at
        random: they coincide about once in tens of thousands of pairs, and a port taken by the time
        the engine starts is refused before the start."""
        if self.port != AUTO_PORT:
            return self
        return self.model_copy(update={"port": free_port(self.host)})

    @field_validator("host")
    @classmethod
    def _address(cls, value: str) -> str:
        with contextlib.suppress(ValueError):
            ipaddress.ip_address(value)
            return value
        if not _HOST_NAME.fullmatch(value) or len(value) > 253:
            raise ValueError(
                f"host {value!r} must be an IP address or a host name (letters, digits, '-' and '.'), "
                "e.g. '127.0.0.1' or '0.0.0.0'"
            )
        return value

    starts_engine: ClassVar[bool] = True
    """k3pipe starts (and stops) the engine: it has a log, a cold start, a liveness to watch."""
    runs_here: ClassVar[bool] = True
    """The engine runs on this machine: its node is probed (GPUs, nvidia-smi), its GPUs sampled, its
    port checked free before the start, its own health, version and metrics URLs polled, and it gets
    a compile cache of this machine."""
    engine_checks_key: ClassVar[bool] = True
    """The engine is given the endpoint's key and checks it (False: a gateway in front checks it)."""
    pins_image: ClassVar[bool] = False
    """The engine runs from an image that is pulled and pinned to its digest before the start."""
    probes_interpreter: ClassVar[bool] = False
    """The engine's Python interpreter is on this machine (its torch and engine versions are read)."""
    leaves_orphans: ClassVar[bool] = False
    """A run that ended without its teardown (a killed worker) can leave this kind's engine behind:
    the flow reaps such leftovers before it launches."""
    command_heading: ClassVar[str] = "command"
    inherits_env: ClassVar[bool] = False
    """The engine inherits k3pipe's own environment under the spec's (a local process): a
    CUDA_VISIBLE_DEVICES exported where k3pipe runs is the engine's too."""

    def gpu_request(self) -> int | list[str] | None:
        """The GPUs the launcher itself gives the engine: their ids on the node, a count, or None
        (it does not choose them)."""
        return None

    def arm_problem(self, engine: EngineFacts, endpoint: EndpointFacts) -> str | None:
        """Why an arm with this engine and endpoint cannot run on this launcher (None: it can)."""
        return None

    def binding(self, default_port: int, served_name: str | None) -> Binding:
        """The host, port and served name the engine's command line gets."""
        if self.port == AUTO_PORT:
            raise ValueError("launcher.port 'auto' is drawn before the binding: plan with drawn()")
        return Binding(self.host, self.port or default_port, served_name)

    def gateway(self, experiment: str, arm: str) -> Gateway | None:
        """Where requests go when a gateway serves the engine (None: the engine's own address)."""
        return None

    def cache_factors(self, engine: EngineFacts) -> dict[str, Any]:
        """What of the engine's start goes into the compile cache's key (the executable or image)."""
        return {"executable": list(engine.executable or []), "image": None}

    def engine_cache_dir(self, host_dir: str, engine_mount: str) -> str:
        """Where the engine sees k3pipe's compile cache at ``host_dir`` (``engine_mount``: the
        engine's path for it inside a container)."""
        return host_dir

    def host_view(self, engine_path: str) -> str | None:
        """The path on this machine of a path the engine sees (None: not reachable from here)."""
        return engine_path

    def place_models(self, dirs: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
        """The model directories as the engine sees them, and host -> engine read-only mounts."""
        return dict(dirs), {}

    def extra_mounts(self) -> dict[str, str]:
        """Host path (as the spec writes it: '{home}' and '~' not expanded) -> engine path of the
        other read-only mounts (none but a container's)."""
        return {}

    def engine_cpus(self) -> list[int] | None:
        """The CPUs the engine is pinned to on this node (None: not pinned, or not on this node)."""
        return None


class ProcessLauncherSpec(LauncherSpecBase):
    """``launcher.kind: process``: the engine's command (``engine.executable`` + arguments) as a local
    process group, its output in the arm's log file."""

    kind: Literal["process"] = Field(
        default="process", description="process: a local process group (docker, external: see those)."
    )

    cpus: str | None = Field(
        default=None,
        description=(
            "CPUs the engine's process group runs on, taskset-style ('8-15'); the client keeps off them "
            "(None: any)."
        ),
    )

    probes_interpreter: ClassVar[bool] = True
    inherits_env: ClassVar[bool] = True

    @field_validator("cpus")
    @classmethod
    def _cpus(cls, value: str | None) -> str | None:
        if value is not None:
            parse_cpu_list(value, "launcher.cpus")
        return value

    def arm_problem(self, engine: EngineFacts, endpoint: EndpointFacts) -> str | None:
        if not engine.executable:
            return "launcher.kind 'process' needs engine.executable (the command that starts it)"
        return None

    def engine_cpus(self) -> list[int] | None:
        return parse_cpu_list(self.cpus) if self.cpus is not None else None

    def pinned(self, argv: list[str]) -> list[str]:
        """``argv`` run on ``cpus`` (util-linux taskset: the engine and every process it starts
        inherit the affinity from its first instruction)."""
        return ["taskset", "--cpu-list", self.cpus, *argv] if self.cpus is not None else list(argv)


class DockerLauncherSpec(LauncherSpecBase):
    """``launcher.kind: docker``: the engine in a container from ``engine.image`` (pulled and pinned
    to its digest first), models mounted read-only under ``model_mount``, the compile cache
    read-write; the arguments go to the image's entrypoint."""

    kind: Literal["docker"] = Field(description="docker: a container from engine.image.")
    gpus: int | list[str] | None = Field(
        default=None,
        description="GPUs to request, a count (e.g. 8) or device ids (['0','1']); none if unset.",
    )

    @field_validator("gpus", mode="before")
    @classmethod
    def _gpus(cls, value: Any) -> Any:
        """One message for every wrong shape (a count, or a list of ids; ids may be written as numbers)."""
        if value is None:
            return None
        shape = (
            "gpus must be a count of GPUs (a whole number, e.g. 8) or a list of device ids "
            "(e.g. ['0', '1']), or left out for none"
        )
        if isinstance(value, bool) or not isinstance(value, int | list):
            raise ValueError(shape)
        if isinstance(value, int):
            if not 1 <= value <= 1024:
                raise ValueError(f"{shape}; a count is from 1 to 1024")
            return value
        if not value or any(
            isinstance(g, bool) or not isinstance(g, int | str) or str(g).strip() == "" for g in value
        ):
            raise ValueError(f"{shape}; the list holds {len(value)} item(s), each must be an id such as '0'")
        return [str(g) for g in value]

    ipc: str | None = Field(default="host", description="IPC namespace ('host' for NCCL).")
    shm_size: str | None = Field(default=None, description="/dev/shm size, e.g. '32g'.")
    network: str = Field(
        default="host", description="Network mode; 'host' so the engine binds the host's port."
    )
    model_mount: str = Field(
        default="/models", description="Where model directories are mounted (read-only)."
    )

    volumes: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "More host paths mounted read-only: host path ('{home}' and '~' allowed) -> an absolute "
            "path in the container (an engine's packages kept on the host, a tokenizer cache)."
        ),
    )

    @field_validator("model_mount")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not _container_path(value):
            raise ValueError(
                f"model_mount {value!r} must be an absolute path in the container without ':', spaces "
                "or '..', e.g. '/models'"
            )
        return value

    @field_validator("volumes")
    @classmethod
    def _volumes(cls, value: dict[str, str]) -> dict[str, str]:
        for host, inside in value.items():
            if not host.strip() or ":" in host:
                raise ValueError(
                    f"volumes key {host!r} must be a path on this machine without ':' (the host side of "
                    "the mount), e.g. '{home}/venvs/engine/lib'"
                )
            if not _container_path(inside) or inside.rstrip("/") == "":
                raise ValueError(
                    f"volumes[{host!r}] {inside!r} must be an absolute path in the container other than "
                    "'/', without ':', spaces or '..', e.g. '/opt/engine/lib'"
                )
        if len(set(value.values())) < len(value):
            raise ValueError("volumes mount two host paths at the same container path: give each its own")
        return value

    @model_validator(mode="after")
    def _volumes_beside_models(self) -> DockerLauncherSpec:
        models = self.model_mount.rstrip("/")
        for inside in self.volumes.values():
            path = inside.rstrip("/")
            if path == models or path.startswith(models + "/") or models.startswith(path + "/"):
                raise ValueError(
                    f"volumes target {inside!r} overlaps model_mount {self.model_mount!r} (the models "
                    "are mounted there): choose another container path"
                )
        return self

    @field_validator("shm_size")
    @classmethod
    def _size(cls, value: str | None) -> str | None:
        if value is not None and not _SIZE.fullmatch(value):
            raise ValueError(f"shm_size {value!r} must be a size such as '32g', '512m' or '1073741824'")
        return value

    init: bool = Field(default=True, description="Run an init process as PID 1 (reaps zombies).")
    pull: Literal["if-missing", "always", "never"] = Field(
        default="if-missing",
        description="Pull the image always, only when its digest is not present, or never.",
    )

    pins_image: ClassVar[bool] = True
    leaves_orphans: ClassVar[bool] = True
    command_heading: ClassVar[str] = "command (arguments to the image's entrypoint)"

    def arm_problem(self, engine: EngineFacts, endpoint: EndpointFacts) -> str | None:
        if not engine.image:
            return "launcher.kind 'docker' needs engine.image"
        return None

    def cache_factors(self, engine: EngineFacts) -> dict[str, Any]:
        return {"executable": None, "image": engine.image}

    def gpu_request(self) -> int | list[str] | None:
        return self.gpus

    def engine_cache_dir(self, host_dir: str, engine_mount: str) -> str:
        return engine_mount

    def host_view(self, engine_path: str) -> str | None:
        return None  # a path inside the container

    def place_models(self, dirs: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
        inside, mounts = {}, {}
        for key, host_dir in dirs.items():
            target = f"{self.model_mount.rstrip('/')}/{key.removeprefix('models.')}"
            mounts[host_dir] = target
            inside[key] = target
        return inside, mounts

    def extra_mounts(self) -> dict[str, str]:
        return dict(self.volumes)


class ExternalLauncherSpec(LauncherSpecBase):
    """``launcher.kind: external``: an endpoint that is already up at ``endpoint.base_url``; k3pipe
    starts, stops and probes nothing of it (its node is not this one)."""

    kind: Literal["external"] = Field(description="external: an endpoint already running.")

    starts_engine: ClassVar[bool] = False
    runs_here: ClassVar[bool] = False

    def arm_problem(self, engine: EngineFacts, endpoint: EndpointFacts) -> str | None:
        if not endpoint.base_url:
            return "launcher.kind 'external' needs endpoint.base_url (the running endpoint)"
        return None

    def host_view(self, engine_path: str) -> str | None:
        return None


def _custom(value: str) -> str:
    # GPUStack refuses a custom backend whose name lacks the suffix (its versions may be named anything:
    # the suffix is asked of a version a user adds to a built-in backend)
    if not value.endswith("-custom"):
        raise ValueError(f"{value!r} must end with '-custom' (GPUStack's rule for custom backends)")
    return value


class GpustackLauncherSpec(LauncherSpecBase):
    """``launcher.kind: gpustack``: the engine's image and command registered as a GPUStack custom
    backend, deployed as one replica on the chosen worker and GPUs, benchmarked through GPUStack's
    OpenAI-compatible gateway with the GPUStack key, and deleted at the end of the arm."""

    kind: Literal["gpustack"] = Field(description="gpustack: a deployment on a GPUStack cluster.")
    host: str = Field(
        default="0.0.0.0",
        description="Address the engine binds to on the worker (GPUStack's proxy reaches it there).",
    )
    server_url: str = Field(description="The GPUStack server, e.g. 'http://gpustack.example:80'.")
    api_key_env: str = Field(
        description="NAME of the environment variable holding the GPUStack API key (never the key)."
    )
    backend: str = Field(description="The custom backend's name (GPUStack: ends in '-custom').")
    backend_version: str = Field(
        min_length=1, description="The backend version registered with this arm's image and command."
    )
    worker: str | int | None = Field(
        default=None, description="The worker (its name or id) to deploy on (default: GPUStack picks)."
    )
    gpus: list[int] | None = Field(
        default=None,
        min_length=1,
        description="GPU indexes on that worker (needs worker; default: GPUStack picks).",
    )
    device: str = Field(default="cuda", pattern=r"^[a-z]+$", description="The GPUs' device type.")
    cluster_id: int | None = Field(
        default=None,
        ge=1,
        description="GPUStack cluster (default: the worker's, else the server's only one).",
    )
    model_name: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        description="The deployment's name, the model id requests send (default: k3pipe-EXPERIMENT-ARM).",
    )
    model_path: str | None = Field(
        default=None,
        description="The model's directory on the worker (default: k3pipe's model directory, shared).",
    )
    restart_on_error: Literal[False] = Field(
        default=False,
        description="Always false: a crashed engine fails the run instead of restarting in a loop.",
    )
    poll_s: float = Field(
        default=2.0, strict=True, gt=0, le=60, description="How often the instance's state is read."
    )
    request_timeout_s: float = Field(
        default=30.0, strict=True, gt=0, le=600, description="Longest wait for one GPUStack API call."
    )

    starts_engine: ClassVar[bool] = True
    runs_here: ClassVar[bool] = False
    engine_checks_key: ClassVar[bool] = False
    # a deployment left by a killed run is deleted by the next start of the same arm (same name)
    leaves_orphans: ClassVar[bool] = False
    command_heading: ClassVar[str] = "run command (GPUStack custom backend)"

    @field_validator("server_url")
    @classmethod
    def _server(cls, value: str) -> str:
        credentials = secrets.url_credentials(value)
        if credentials:
            secrets.register_all(v for _, v in credentials)
            raise ValueError(
                f"server_url {secrets.scrub_url(value)!r} carries credentials: name the variable "
                "holding the key in launcher.api_key_env instead"
            )
        return check_http_url(value)

    @field_validator("api_key_env")
    @classmethod
    def _key_variable(cls, value: str) -> str:
        return secrets.check_key_variable(value, "launcher.api_key_env", "GPUSTACK_API_KEY")

    @field_validator("backend")
    @classmethod
    def _custom_suffix(cls, value: str) -> str:
        return _custom(value)

    @model_validator(mode="after")
    def _gpus_need_worker(self) -> GpustackLauncherSpec:
        if self.gpus is not None and self.worker is None:
            raise ValueError(
                f"gpus {self.gpus} are indexes on one worker: name it in launcher.worker (name or id)"
            )
        return self

    def arm_problem(self, engine: EngineFacts, endpoint: EndpointFacts) -> str | None:
        if not engine.image:
            return "launcher.kind 'gpustack' needs engine.image (the custom backend's image)"
        for name in ("base_url", "api_key_env", "model"):
            if getattr(endpoint, name) is not None:
                return (
                    f"launcher.kind 'gpustack' sets endpoint.{name} itself (GPUStack's gateway): "
                    f"remove endpoint.{name}; set launcher.server_url, launcher.api_key_env, "
                    "launcher.model_name"
                )
        return None

    def binding(self, default_port: int, served_name: str | None) -> Binding:
        # GPUStack assigns the port and serves the model under the deployment's name
        return Binding(self.host, PORT, MODEL_NAME)

    def gpu_request(self) -> int | list[str] | None:
        return [str(i) for i in self.gpus] if self.gpus is not None else None

    def deployment(self, experiment: str, arm: str) -> str:
        """The deployment's name: the model id of requests through the gateway."""
        return self.model_name or f"k3pipe-{experiment}-{arm}"

    def gateway(self, experiment: str, arm: str) -> Gateway | None:
        return Gateway(f"{self.server_url}/v1", self.deployment(experiment, arm), self.api_key_env)

    def place_models(self, dirs: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
        # GPUStack puts the deployment's local_path where {{model_path}} names it; other models
        # (a draft) must be at the same path on the worker
        return {**dirs, "model": MODEL_PATH}, {self.model_path or dirs["model"]: MODEL_PATH}

    def host_view(self, engine_path: str) -> str | None:
        return None if "{{" in engine_path else engine_path


LAUNCHER_SPECS: dict[str, type[LauncherSpecBase]] = {
    "process": ProcessLauncherSpec,
    "docker": DockerLauncherSpec,
    "external": ExternalLauncherSpec,
    "gpustack": GpustackLauncherSpec,
}


def _kind(value: Any) -> str | None:
    """The launcher's kind: ``kind`` of the mapping (process when absent) or of the model."""
    if isinstance(value, dict):
        return str(value.get("kind", "process"))
    return getattr(value, "kind", None)


LauncherSpec = Annotated[
    Annotated[ProcessLauncherSpec, Tag("process")]
    | Annotated[DockerLauncherSpec, Tag("docker")]
    | Annotated[ExternalLauncherSpec, Tag("external")]
    | Annotated[GpustackLauncherSpec, Tag("gpustack")],
    Discriminator(_kind),
]
"""One arm's ``launcher:`` block, whichever kind it names."""
