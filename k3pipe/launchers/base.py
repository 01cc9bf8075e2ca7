"""The launcher interface: start, logs, alive, stop. Stop always works and may be called twice.

Each launcher kind is one module of this package holding both halves: its spec (the experiment's
``launcher:`` block, a member of the union :data:`k3pipe.specs.LauncherSpec`) and the launcher the
spec builds. Code outside ``launchers/`` asks the spec what it needs (does it start an engine, pin an
image, where does the engine see its models) and never branches on the kind.
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Protocol
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

if TYPE_CHECKING:
    from k3pipe.plan import ArmPlan
    from k3pipe.specs import EndpointSpec, EngineSpec

__all__ = ["Binding", "Gateway", "Launcher", "LauncherSpecBase", "check_http_url", "tail_file"]

_HOST_NAME = re.compile(
    r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*"
)


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


class Launcher(Protocol):
    """Where an engine runs. Implementations: process, docker, external, gpustack."""

    kind: str
    log_path: Path | None

    def start(self) -> None:
        """Start the engine (returns at once; readiness is the health gate's job)."""

    def alive(self) -> bool:
        """Whether the engine is still running."""

    def ready(self, progress: Callable[[str], None] | None = None) -> bool:
        """Whether the engine is ready as far as the launcher can tell (a cluster manager's instance
        state), each change of its start reported to ``progress``; True where only the engine's
        health URL can tell. Raises :class:`k3pipe.errors.LaunchError` when the start failed."""

    def exit_code(self) -> int | None:
        """The engine's exit code once it has ended, else None."""

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the engine's log."""

    def stop(self, grace_s: float | None = None) -> None:
        """Stop what ``start`` started; bounded in time, safe to call on every path and repeatedly.
        ``grace_s``: the most time the engine gets to exit after the polite signal (an interrupted
        run gives less than ``launcher.stop_timeout_s``)."""


def tail_file(path: Path | None, lines: int = 40) -> str:
    """Last ``lines`` lines of a text file ('' when absent)."""
    if path is None or not path.exists():
        return ""
    with path.open("r", errors="replace") as fh:
        return "".join(deque(fh, maxlen=lines))


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

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: str
    host: str = Field(default="127.0.0.1", description="Address the engine binds to.")
    port: int | None = Field(
        default=None,
        strict=True,
        ge=1,
        le=65535,
        description="Port the engine listens on (default: the engine's).",
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

    def arm_problem(self, engine: EngineSpec, endpoint: EndpointSpec) -> str | None:
        """Why an arm with this engine and endpoint cannot run on this launcher (None: it can)."""
        return None

    def binding(self, default_port: int, served_name: str | None) -> Binding:
        """The host, port and served name the engine's command line gets."""
        return Binding(self.host, self.port or default_port, served_name)

    def gateway(self, experiment: str, arm: str) -> Gateway | None:
        """Where requests go when a gateway serves the engine (None: the engine's own address)."""
        return None

    def cache_factors(self, engine: EngineSpec) -> dict[str, Any]:
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

    def writable_mounts(self, plan: ArmPlan) -> dict[str, str]:
        """Host directory -> engine path, mounted read-write (the compile cache of a container)."""
        return {}

    def engine_cpus(self) -> list[int] | None:
        """The CPUs the engine is pinned to on this node (None: not pinned, or not on this node)."""
        return None

    def equivalent_command(self, plan: ArmPlan, image: str | None = None) -> str | None:
        """The start as one command line a human could paste (secrets redacted), where it differs
        from the plan's argv (a container's ``docker run``); None otherwise."""
        return None

    def build(
        self,
        plan: ArmPlan,
        log_path: Path,
        env: Mapping[str, str],
        base_env: Mapping[str, str],
        image: str | None,
        labels: Mapping[str, str],
        home: Path | None = None,
    ) -> Launcher:
        """The launcher for ``plan`` (not started). ``env``: the engine's own variables; ``base_env``:
        this machine's environment for a local process; ``image``: the pinned image (pins_image)."""
        raise NotImplementedError
