"""Experiment specs: YAML files loaded into frozen pydantic models.

An experiment is one model (plus optional extra models such as a speculative draft), one or more
engine arms (engine + launcher + endpoint, and optionally a gateway in front of the engine) and the
workloads each arm runs. Specs hold the NAME of
the environment variable that carries an API key, never the key itself. Loading a file, and the
checks that need the engine registry, are in :mod:`k3pipe.experiment.load` (so that specs import no
engine).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from k3pipe.core import secrets
from k3pipe.core.errors import SpecError
from k3pipe.core.figures import DEFAULT_DECISION, FIGURES
from k3pipe.core.procs import parse_cpu_list
from k3pipe.schema.launcher_specs import LauncherSpec, ProcessLauncherSpec
from k3pipe.schema.launcher_specs import check_http_url as _check_base_url

__all__ = [
    "AccuracySpec",
    "AnswersSpec",
    "ArmOverride",
    "ArmSpec",
    "DatasetSpec",
    "DocumentsDataset",
    "EndpointSpec",
    "EngineSpec",
    "ExperimentSpec",
    "GatewaySpec",
    "HardwareSpec",
    "LauncherSpec",
    "LocalModel",
    "ModelScopeModel",
    "ModelSpec",
    "RandomDataset",
    "ReferenceFigure",
    "ReferenceSpec",
    "SLOSpec",
    "ShareGPTDataset",
    "SharedPrefixDataset",
    "VariantSpec",
    "WorkloadSpec",
    "expand_home",
    "safe_name",
]

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_MODEL_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")  # what '{models.NAME}' matches (k3pipe.engines.base)
_MODEL_REF = re.compile(r"\{models\.([^{}]*)\}")
_MODEL_TYPO = re.compile(r"\{model\.([^{}]*)\}")

# -- limits -----------------------------------------------------------------------------------------
# Values past these are typing mistakes, and each would trip the run later (after a cold start) or
# exhaust the machine; the message of a value past one gives the limit and the reason (LIMIT_REASONS).
NAME_MAX_CHARS = 100
MAX_ARMS = 100
MAX_LAUNCHES = 50
DEFAULT_LAUNCHES = 2
"""Launches per arm of an experiment that compares, unless an arm says: the fewest that put restart
noise into a verdict's variance."""
MAX_WORKLOADS = 1_000
MAX_VARIANTS = 100
MAX_EXTRA_MODELS = 16
MAX_TOKENS = 10_000_000
MAX_GPU_HOUR_USD = 1_000.0
MAX_POOLS = 256
MAX_REQUESTS = 1_000_000
MAX_REPEATS = 1_000
MAX_WORKLOAD_PROMPTS = 1_000_000
MAX_PROMPT_TOKENS = 1_000_000_000
MAX_CONCURRENCY = 100_000
MAX_RATE_RPS = 100_000.0
MAX_WARMUP_TOLERANCE_PCT = 50.0
MAX_DURATION_S = 7 * 86_400.0
MAX_REQUEST_TIMEOUT_S = 86_400.0
MIN_METRICS_INTERVAL_S = 0.05
MAX_METRICS_INTERVAL_S = 3_600.0
MAX_SEED = 2**63 - 1
MAX_SLO_MS = 86_400_000.0
MAX_GPU_COUNT = 1_024
MAX_GPU_MEMORY_GIB = 100_000.0
MAX_GROUPS = 1_000_000

LIMIT_REASONS: dict[str, str] = {
    "arms": "each arm is a cold start of the engine; split the study into several experiments",
    "workloads": "every workload's prompts are built before the first launch; split the experiment",
    "variants": "each variant is an experiment of its own; split them over several files",
    "extra_models": "each extra model is downloaded and hashed before the run",
    "input_tokens": "no model has a longer context",
    "output_tokens": "no model has a longer context",
    "prefix_tokens": "no model has a longer context",
    "min_input_tokens": "no model has a longer context",
    "num_requests": (
        "all prompts of every workload are built in memory before the engine starts; run it as "
        "repeats or several workloads"
    ),
    "warmup_requests": "all prompts of every workload are built in memory before the engine starts",
    "repeats": "each repeat builds prompts of its own in memory before the engine starts",
    "warmup_tolerance_pct": "rates further apart than that do not agree: the engine is not steady",
    "concurrency": "each request in flight holds a connection of a client process",
    "rate_rps": "the client cannot send faster",
    "processes": "each client process is a Python interpreter with its own connections",
    "duration_s": "a bound of more than a week is no bound; leave duration_s out for none",
    "request_timeout_s": "a request that takes longer has hung; the timeout must end it",
    "startup_timeout_s": "an engine that is not healthy after a day has hung; the timeout must end it",
    "stop_timeout_s": "the engine is killed after this grace period; longer would hang the run",
    "metrics_interval_s": "scraping /metrics faster would load the engine it measures",
    "seed": "seeds are 64-bit: numpy's default_rng, MLflow params",
    "ttft_ms": "a threshold over a day is no threshold",
    "tpot_ms": "a threshold over a day is no threshold",
    "e2e_ms": "a threshold over a day is no threshold",
    "gpu_count": "no node has more",
    "gpu_memory_gib": "no accelerator has more",
    "gpu_hour_usd": "no accelerator rents for more than $1,000 an hour",
    "pools": "each pool is a GPU node with a worker of its own",
    "pickup_timeout_s": "a worker that has not started a launch after a day is not coming",
    "busy_timeout_s": "a node busy for more than a day is taken; place the arm on another pool",
    "groups": "each group is a random prefix built in memory",
}
"""Why a field has its limit, by field name: the error of a value past the limit says it."""


def safe_name(value: str, what: str) -> str:
    """``value`` if it is a safe name for ``what`` (an experiment, arm, workload or variant name), else
    a ValueError saying the rule: it names MLflow runs, metric keys and log files, so it holds only
    letters, digits, '-', '_' and '.', starts with a letter or digit, has no '..' and at most
    :data:`NAME_MAX_CHARS` characters (MLflow's metric key mapping is then the identity, so two names
    cannot collide on one key, and a name cannot leave the log directory)."""
    if not value:
        raise ValueError(f"{what} name is empty: give it a name of letters, digits, '-', '_' and '.'")
    if len(value) > NAME_MAX_CHARS:
        raise ValueError(
            f"{what} name is {len(value)} characters long; at most {NAME_MAX_CHARS} "
            "(it names MLflow runs, metrics and log files)"
        )
    if not _SAFE_NAME.fullmatch(value) or ".." in value:
        words = (w.strip(".-") for w in re.findall(r"[A-Za-z0-9_.-]+", value))
        suggestion = "-".join(w for w in words if w)[:NAME_MAX_CHARS]
        hint = f", e.g. {suggestion!r}" if suggestion and suggestion != value else ""
        raise ValueError(
            f"{what} name {value!r} must start with a letter or digit and hold only letters, digits, "
            f"'-', '_' and '.', without '..' (it names MLflow runs, metrics and log files){hint}"
        )
    return value


def _check_arg_value(key: str, value: Any) -> None:
    """An engine argument's value as :func:`k3pipe.engines.base.render_args` can render it: a scalar,
    a list of scalars (repeated values) or a mapping (passed as JSON); finite numbers."""
    scalar = (str, int, float)
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{key} is {value!r}; give a finite number")
    if isinstance(value, list):
        for item in value:
            if isinstance(item, bool) or not isinstance(item, scalar):
                raise ValueError(
                    f"{key}: a list renders as the flag followed by each item, so its items "
                    f"must be strings or numbers (got {type(item).__name__} {item!r}); give a mapping "
                    "for a JSON value"
                )
            if isinstance(item, float) and not math.isfinite(item):
                raise ValueError(f"{key} holds {item!r}; give finite numbers")
    elif value is not None and not isinstance(value, str | int | float | dict):
        raise ValueError(
            f"{key}: {value} is a {type(value).__name__}, which cannot be rendered as a flag; quote it to "
            "pass it as text"
        )


def _check_args(args: dict[str, Any]) -> dict[str, Any]:
    for key, value in args.items():
        if not key.strip("-_"):
            raise ValueError(f"{key!r} is an empty argument name; give the flag's name (e.g. max_model_len)")
        if any(c.isspace() for c in key):
            raise ValueError(f"{key!r}: an argument name cannot hold spaces; write one flag per key")
        _check_arg_value(key, value)
    return args


def _finite(**kw: Any) -> Any:
    """A float field: strictly a number (an int is taken; true/false or a string is not), finite."""
    return Field(strict=True, allow_inf_nan=False, **kw)


def _count(**kw: Any) -> Any:
    """An int field: strictly a whole number (true/false, 1.0 or '1' are not taken)."""
    return Field(strict=True, **kw)


class _Spec(BaseModel):
    # hide_input_in_errors: a ValidationError's text never holds the refused value (a key pasted
    # where a variable's name belongs); k3pipe's own messages show values, secrets masked
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)


def _served(value: str | None) -> str | None:
    if value is not None and (not value or any(c.isspace() for c in value)):
        raise ValueError(f"served_name {value!r} must be a non-empty name without spaces")
    return value


class ModelScopeModel(_Spec):
    """Weights downloaded from ModelScope with ``snapshot_download``."""

    source: Literal["modelscope"] = Field(description="Download from the ModelScope hub.")
    id: str = Field(description="ModelScope model id, 'owner/name', e.g. 'moonshotai/Kimi-K3'.")
    revision: str = Field(default="master", description="Branch, tag or commit to download.")
    allow_patterns: list[str] | None = Field(
        default=None, min_length=1, description="Only download files matching these glob patterns."
    )
    served_name: str | None = Field(
        default=None, description="Name the engine serves the model under (--served-model-name)."
    )

    @field_validator("id")
    @classmethod
    def _owner_name(cls, value: str) -> str:
        parts = value.split("/")
        # both parts name directories under K3PIPE_HOME/models: no '..', no spaces
        if len(parts) != 2 or not all(_SAFE_NAME.fullmatch(p) and ".." not in p for p in parts):
            raise ValueError(
                f"model id {value!r} must look like 'owner/name' (letters, digits, '-', '_', '.'), "
                "e.g. 'Qwen/Qwen2.5-0.5B-Instruct'"
            )
        return value

    @field_validator("revision")
    @classmethod
    def _revision(cls, value: str) -> str:
        # it names a directory under K3PIPE_HOME/models/OWNER/NAME: no '..' part, no absolute path
        parts = value.split("/")
        if (
            not value
            or value.startswith("/")
            or any(p in ("", ".", "..") for p in parts)
            or any(c.isspace() for c in value)
        ):
            raise ValueError(
                f"revision {value!r} must be a branch, tag or commit (e.g. 'master' or 'v1.0'), "
                "without spaces or '..'"
            )
        return value

    @field_validator("allow_patterns")
    @classmethod
    def _patterns(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(not p.strip() for p in value):
            raise ValueError("allow_patterns holds an empty pattern; give glob patterns such as '*.json'")
        return value

    @field_validator("served_name")
    @classmethod
    def _served_name(cls, value: str | None) -> str | None:
        return _served(value)


class LocalModel(_Spec):
    """Weights already on disk (or made locally, like the tiny demo model)."""

    source: Literal["local"] = Field(description="Use a directory on this machine.")
    path: str = Field(min_length=1, description="Model directory; '{home}' expands to K3PIPE_HOME.")
    served_name: str | None = Field(
        default=None, description="Name the engine serves the model under (--served-model-name)."
    )

    @field_validator("served_name")
    @classmethod
    def _served_name(cls, value: str | None) -> str | None:
        return _served(value)


ModelSpec = Annotated[ModelScopeModel | LocalModel, Field(discriminator="source")]


class EngineSpec(_Spec):
    """Which engine runs and how: its kind, binary or image, environment and arguments."""

    kind: str = Field(description="Engine kind, one of the registered engine modules (vllm, sglang).")
    version: str | None = Field(default=None, description="Engine version, recorded with the run.")
    image: str | None = Field(default=None, description="Container image (docker launcher).")
    executable: list[str] | None = Field(
        default=None,
        description="Command prefix that starts the engine (process launcher); '{home}' expands.",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "Environment for the engine. '{env.NAME}' in a value is NAME of k3pipe's own environment, "
            "read at launch and never recorded (records hold the reference): keep keys out of the file."
        ),
    )
    args: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "Engine arguments: keys with '_' or '-', booleans as bare flags (false omits), "
            "dicts as JSON, lists as repeated values; '{model}' and '{models.NAME}' expand to model dirs; "
            "'{env.NAME}' is NAME of k3pipe's environment at launch (recorded as the reference)."
        ),
    )

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for key, item in value.items():
            if not _ENV_NAME.match(key):
                raise ValueError(
                    f"environment variable name {key!r} is not valid: letters, digits and '_', "
                    "not starting with a digit"
                )
            _check_references(f"env.{key}", item)
            _refuse_literal_secret(f"env.{key}", key, item)
        return value

    @field_validator("image")
    @classmethod
    def _image(cls, value: str | None) -> str | None:
        if value is not None and (not value or any(c.isspace() for c in value)):
            raise ValueError(
                f"image {value!r} must be an image reference without spaces, e.g. 'vllm/vllm-openai:v0.9.0'"
            )
        return value

    @field_validator("executable")
    @classmethod
    def _program(cls, value: list[str] | None) -> list[str] | None:
        if value and not value[0].strip():
            raise ValueError("executable[0] is empty: it must name the program that starts the engine")
        return value

    @field_validator("args")
    @classmethod
    def _args(cls, value: dict[str, Any]) -> dict[str, Any]:
        def visit(where: str, name: str, item: Any) -> None:
            if isinstance(item, dict):
                for k, v in item.items():
                    visit(f"{where}.{k}", str(k), v)
            elif isinstance(item, list):
                for i, v in enumerate(item):
                    visit(f"{where}[{i}]", name, v)
            elif isinstance(item, str):
                _check_references(where, item)
                _refuse_literal_secret(where, name, item)

        for key, item in value.items():
            visit(f"args.{key}", key, item)
        return _check_args(value)


def _refuse_literal_secret(where: str, name: str, value: str) -> None:
    """A key written into the experiment (under a secret's name, or shaped like a well-known key)
    is refused: keys come from the environment, never from a file that gets committed and shared
    (field-notes.md). It is registered with the scrubber first, so the refusal's own records (a
    log file, a traceback) never hold it; the error shows it masked, with the way to pass it."""
    if not value or value == secrets.REDACTED or secrets.env_references(value):
        return
    if not (secrets.is_secret_name(name) or secrets.looks_like_key(value)):
        return
    secrets.register(value)
    variable = name.upper().replace("-", "_") if _ENV_NAME.match(name.replace("-", "_")) else "NAME"
    if not secrets.is_secret_name(variable):
        variable = "API_KEY"
    raise ValueError(
        f"{where}: a literal secret ({secrets.mask(value)}) in the experiment: keys come from the "
        f"environment, never from a file that gets committed and shared; write '{{env.{variable}}}' and "
        f"set {variable} where k3pipe runs (an engine's own key: name its variable in "
        "endpoint.api_key_env)"
    )


def _check_references(where: str, value: str) -> None:
    """Every '{env.X}' of ``value`` names a variable (the rule of ``_ENV_NAME``)."""
    bad = secrets.bad_env_references(value)
    if bad:
        raise ValueError(
            f"{where}: {{env.{bad[0]}}} does not name an environment variable; write '{{env.NAME}}' "
            "with NAME of letters, digits and '_', not starting with a digit (e.g. '{env.HF_TOKEN}')"
        )


class FleetSpec(_Spec):
    """Where a study's launches run when it is spread over GPU nodes: each node a Prefect work pool
    (one launch at a time), each launch a flow run of that pool's ``launch`` deployment, the study's
    flow waiting for them and joining them into one study (k3pipe.jobs.fleet)."""

    pools: list[str] = Field(
        min_length=1,
        max_length=MAX_POOLS,
        description=(
            "The GPU nodes' work pools the launches are spread over ('k3pipe stack add-node NAME' makes "
            "one with its launch deployment); each runs one launch at a time, the next in the study's "
            "order as soon as it is free."
        ),
    )
    arms: dict[str, list[str]] = Field(
        default_factory=dict,
        description=(
            "Arm -> the pools it may run on (default: any of pools); a calibration copy goes where its "
            "baseline may."
        ),
    )
    pickup_timeout_s: float = _finite(
        default=600.0,
        gt=0,
        le=MAX_REQUEST_TIMEOUT_S,
        description=(
            "A pool with no live worker (no heartbeat to its Prefect server) this long is lost, and a "
            "launch a live, idle worker has not started after this long fails: the pool is named and "
            "gets nothing more; its launches go to the other pools they may run on."
        ),
    )
    busy_timeout_s: float = _finite(
        default=7_200.0,
        gt=0,
        le=MAX_REQUEST_TIMEOUT_S,
        description=(
            "A pool whose worker is alive but runs another flow run (another study's launch) is busy, "
            "not lost: its launches go to the other pools they may run on as soon as one is free, and "
            "wait for it, a line every 30 s naming it and what it runs, up to this long; then it gets "
            "nothing more and a launch that may run only there fails, naming it busy."
        ),
    )

    heartbeat_s: float = _finite(
        default=15.0,
        gt=0,
        le=3_600,
        description="How often a node running a launch says it is alive (a tag on the study's run).",
    )
    lost_after_s: float = _finite(
        default=120.0,
        gt=0,
        le=MAX_REQUEST_TIMEOUT_S,
        description=(
            "A running launch whose node has not said it is alive for this long is lost (the node died, "
            "its worker was killed): recorded failed with what it measured, its flow run marked "
            "Crashed; the study goes on. Keep it several heartbeats long."
        ),
    )

    @field_validator("pools")
    @classmethod
    def _pool_names(cls, value: list[str]) -> list[str]:
        for name in value:
            safe_name(name, "work pool")
        dupes = _repeated(value)
        if dupes:
            raise ValueError(f"fleet.pools names each pool once; repeated: {', '.join(dupes)}")
        return value

    @model_validator(mode="after")
    def _known_pools(self) -> FleetSpec:
        if self.lost_after_s < 2 * self.heartbeat_s:
            raise ValueError(
                f"fleet.lost_after_s ({self.lost_after_s:g}) must be at least two heartbeats "
                f"(fleet.heartbeat_s {self.heartbeat_s:g}): one late heartbeat is not a lost node"
            )
        for arm, pools in self.arms.items():
            if not pools:
                raise ValueError(
                    f"fleet.arms.{arm} names no pool: name one of {', '.join(self.pools)}, or drop it"
                )
            unknown = [p for p in pools if p not in self.pools]
            if unknown:
                raise ValueError(
                    f"fleet.arms.{arm} names pool(s) {', '.join(unknown)} that fleet.pools does not list "
                    f"({', '.join(self.pools)}): add them to fleet.pools, or fix the name"
                )
        return self

    def pools_of(self, arm: str, baseline: str | None = None) -> list[str]:
        """The pools ``arm`` may run on (its calibration copy: its baseline's)."""
        if arm in self.arms:
            return list(self.arms[arm])
        if baseline is not None and arm == baseline + CALIBRATION_SUFFIX and baseline in self.arms:
            return list(self.arms[baseline])
        return list(self.pools)


class HardwareSpec(_Spec):
    """The accelerators the experiment is planned for (preflight's capacity estimates use them)."""

    gpu_name: str = Field(min_length=1, description="Accelerator model, e.g. 'NVIDIA B300'.")
    gpu_count: int = _count(ge=1, le=MAX_GPU_COUNT, description="Accelerators on the node.")
    gpu_memory_gib: float = _finite(
        gt=0, le=MAX_GPU_MEMORY_GIB, description="Memory visible per accelerator, in GiB."
    )
    gpu_hour_usd: float | None = _finite(
        default=None,
        gt=0,
        le=MAX_GPU_HOUR_USD,
        description=(
            "What one accelerator costs an hour, in US dollars: each cell's cost per million tokens "
            "is the arm's GPUs (gpu_count where they are not known) x this x its measured window "
            "(None: no cost figures)."
        ),
    )


def _check_key_env(value: str | None, field: str) -> str | None:
    """``value`` if it is an environment variable's name (or None), else the ValueError of
    :func:`k3pipe.core.secrets.check_key_variable` naming ``field`` (a key pasted where its variable's name
    belongs would be recorded as a param: refused, never echoed whole)."""
    if value is None:
        return value
    example = "MY_GATEWAY_KEY" if field.startswith("gateway") else "MY_ENGINE_KEY"
    return secrets.check_key_variable(value, field, example)


def _check_url_without_key(value: str | None, key_field: str) -> str | None:
    """``value`` checked as a base URL (:func:`_check_base_url`) that carries no credentials (they
    would be logged and recorded): those are refused, saying to put the key in the variable
    ``key_field`` names."""
    if value is None:
        return value
    credentials = secrets.url_credentials(value)
    if credentials:
        secrets.register_all(v for _, v in credentials)
        where = " and ".join(dict.fromkeys(w for w, _ in credentials))
        raise ValueError(
            f"base URL {secrets.scrub_url(value)!r} carries credentials ({where}); k3pipe refuses "
            "them there (a URL is logged and recorded): put the key in an environment variable and "
            f"name it in {key_field} (it is sent as the Authorization header)"
        )
    return _check_base_url(value)


def _usage_stats_field() -> Any:
    return Field(
        default=True,
        strict=True,
        description=(
            "Ask for stream_options.continuous_usage_stats (vLLM, SGLang: running token counts in "
            "every chunk, for per-token ITL and TPOT's k1). Turn off for an endpoint that refuses it; "
            "ITL is then per chunk, labelled so."
        ),
    )


class EndpointSpec(_Spec):
    """The three settings of an OpenAI-compatible endpoint: base URL, key and model id."""

    base_url: str | None = Field(
        default=None,
        description="Base URL including its path, e.g. 'http://127.0.0.1:8000/v1' (default from launcher).",
    )
    api_key_env: str | None = Field(
        default=None,
        description=(
            "NAME of the environment variable that holds the API key (the engine's: k3pipe hands it "
            "to an engine it starts, e.g. as VLLM_API_KEY)."
        ),
    )
    model: str | None = Field(
        default=None, min_length=1, description="Model id sent in requests (default: the served name)."
    )
    continuous_usage_stats: bool = _usage_stats_field()

    @field_validator("api_key_env")
    @classmethod
    def _env_name(cls, value: str | None) -> str | None:
        return _check_key_env(value, "endpoint.api_key_env")

    @field_validator("base_url")
    @classmethod
    def _http(cls, value: str | None) -> str | None:
        return _check_url_without_key(value, "endpoint.api_key_env")


class GatewaySpec(_Spec):
    """A unified OpenAI-compatible gateway in front of the engine k3pipe starts (the study's set-up:
    one base URL + one key + one model id). The benchmark and the health gate's proof go through it;
    the engine's own health, /metrics, version and log stay the engine's. The gateway itself is
    not started by k3pipe: it must route ``model`` to the engine at launcher.host:launcher.port."""

    base_url: str = Field(
        description="The gateway's base URL including its path, e.g. 'http://127.0.0.1:4000/api/v1'."
    )
    api_key_env: str | None = Field(
        default=None,
        description=(
            "NAME of the environment variable that holds the GATEWAY's key (sent as the bearer to "
            "the gateway; endpoint.api_key_env stays the engine's)."
        ),
    )
    model: str = Field(
        min_length=1,
        description="The model id as the gateway knows it (one of what the gateway's /models lists).",
    )
    continuous_usage_stats: bool = _usage_stats_field()

    @field_validator("api_key_env")
    @classmethod
    def _env_name(cls, value: str | None) -> str | None:
        return _check_key_env(value, "gateway.api_key_env")

    @field_validator("base_url")
    @classmethod
    def _http(cls, value: str) -> str:
        checked = _check_url_without_key(value, "gateway.api_key_env")
        assert checked is not None
        return checked

    @field_validator("model")
    @classmethod
    def _model_id(cls, value: str) -> str:
        if any(c.isspace() for c in value):
            raise ValueError(
                f"gateway.model {value!r} holds a space: give the model id exactly as the gateway's "
                "/models lists it"
            )
        return value


class ArmSpec(_Spec):
    """One engine configuration under test."""

    name: str = Field(description="Arm name, unique within the experiment (letters, digits, '-', '_', '.').")
    engine: EngineSpec = Field(description="The engine and its arguments.")
    launcher: LauncherSpec = Field(
        default_factory=ProcessLauncherSpec, description="Where the engine runs (launcher.kind)."
    )
    endpoint: EndpointSpec = Field(
        default_factory=EndpointSpec,
        description=(
            "How the engine is reached (with a gateway: the engine's key; the requests go to the gateway)."
        ),
    )
    gateway: GatewaySpec | None = Field(
        default=None,
        description=(
            "A gateway in front of the engine: the health gate's proof and the benchmark go through it "
            "(None: straight to the engine)."
        ),
    )
    launches: int = _count(
        default=1,
        ge=1,
        le=MAX_LAUNCHES,
        description=(
            "How many times a study launches this arm (each launch runs every workload); launches of "
            "all arms are interleaved (A B B A ...). Unset: 2 in an experiment that compares (two arms "
            "or more, variants, or an A/A calibration), else 1. With 2 or more the verdicts include "
            "restart noise (the spread between launches); with 1 an arm is judged only where an earlier "
            "study measured the restart noise of its configuration on the node (k3pipe.records.priors), else "
            "its verdicts say 'cannot tell: restart noise unknown'."
        ),
    )

    @field_validator("name")
    @classmethod
    def _safe_name(cls, value: str) -> str:
        return safe_name(value, "arm")

    @model_validator(mode="after")
    def _launcher_fits(self) -> ArmSpec:
        problem = self.launcher.arm_problem(self.engine, self.endpoint)
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _gateway_fits(self) -> ArmSpec:
        if self.gateway is None:
            return self
        if not self.launcher.starts_engine:
            raise ValueError(
                f"gateway is set with launcher.kind {self.launcher.kind!r}: a gateway sits in front of "
                "an engine k3pipe starts; for an endpoint that is already up (a gateway included) "
                "remove gateway and give its URL, key variable and model id as endpoint.base_url, "
                "endpoint.api_key_env and endpoint.model"
            )
        if self.endpoint.base_url is not None:
            raise ValueError(
                f"endpoint.base_url {self.endpoint.base_url!r} is set beside gateway: with a gateway the "
                "engine is reached at launcher.host:launcher.port and the benchmark goes to "
                "gateway.base_url; remove endpoint.base_url (the gateway's URL belongs in gateway.base_url)"
            )
        if "continuous_usage_stats" in self.endpoint.model_fields_set:
            raise ValueError(
                "endpoint.continuous_usage_stats is set beside gateway: the requests go to the gateway, "
                "so set gateway.continuous_usage_stats instead and remove endpoint.continuous_usage_stats"
            )
        return self


class RandomDataset(_Spec):
    """Random prompts of exactly ``input_tokens`` tokens under the served model's tokenizer.

    Repeat ``k`` of the workload draws its prompts with ``seed + k``.
    """

    kind: Literal["random"] = Field(default="random", description="Random word tokens, exact length.")


class ShareGPTDataset(_Spec):
    """Conversations in ShareGPT format (a JSON list of ``{"conversations": [{"from", "value"}...]}``).

    Each prompt is a conversation's first human turn; conversations whose first turn is shorter than
    ``min_input_tokens`` or longer than the workload's ``input_tokens`` are left out, and a first
    turn that repeats an earlier one counts once. The prompts are a seeded permutation (the
    workload's ``seed``) of the turns kept, taken in blocks of ``warmup_requests + num_requests``:
    repeat ``k`` sends the ``k``-th block, so no repeat resends a prompt of another, and the file must
    hold ``repeats`` such blocks.
    """

    kind: Literal["sharegpt"] = Field(description="ShareGPT-format JSON file on this machine.")
    path: str = Field(
        min_length=1,
        description=(
            "The JSON file; '{home}' expands to K3PIPE_HOME, relative paths to the working directory."
        ),
    )
    min_input_tokens: int = _count(
        default=4, ge=1, le=MAX_TOKENS, description="Leave out first turns shorter than this."
    )


class DocumentsDataset(_Spec):
    """Long documents: text files in a folder, each cut to exactly ``input_tokens`` tokens.

    Documents shorter than ``input_tokens`` are left out; the documents and token offsets are drawn
    with the workload's ``seed`` (a document is drawn again when there are fewer documents than
    prompts). A window moves forward from its offset to a cut between words, or to another offset
    when that start is already a window's: no two prompts of the workload, across all its repeats,
    start at the same token of the same document or have the same text (repeat ``k`` sends the
    ``k``-th block of ``warmup_requests + num_requests`` windows of one seeded sequence). A request
    for more windows than the documents have distinct starts is refused.
    """

    kind: Literal["documents"] = Field(description="A folder of text files cut to input_tokens.")
    path: str = Field(
        min_length=1,
        description="The folder; '{home}' expands to K3PIPE_HOME, relative paths to the working directory.",
    )
    glob: str = Field(default="*.txt", description="Which files of the folder are documents.")

    @field_validator("glob")
    @classmethod
    def _relative(cls, value: str) -> str:
        if not value.strip() or value.startswith("/") or ".." in value.split("/"):
            raise ValueError(
                f"glob {value!r} must be a pattern relative to the folder, without '..' (e.g. '*.txt')"
            )
        return value


class SharedPrefixDataset(_Spec):
    """Prompts that share a prefix, for prefix caching: ``groups`` random prefixes of ``prefix_tokens``
    tokens, each prompt one of them followed by its own random suffix; ``input_tokens`` in all.
    Repeat ``k`` of the workload draws prefixes and suffixes with ``seed + k``."""

    kind: Literal["shared_prefix"] = Field(description="N prompts sharing P prefix tokens.")
    prefix_tokens: int = _count(gt=0, le=MAX_TOKENS, description="Tokens every prompt of a group shares (P).")
    groups: int = _count(
        default=1, ge=1, le=MAX_GROUPS, description="Distinct prefixes; prompts are dealt round-robin."
    )


DatasetSpec = Annotated[
    RandomDataset | ShareGPTDataset | DocumentsDataset | SharedPrefixDataset, Field(discriminator="kind")
]


class SLOSpec(_Spec):
    """Service-level objectives: a request meets them when every threshold given holds (<=).

    Goodput is the rate of requests that met them; attainment the share of measured requests that did
    (failed requests count as missed).
    """

    ttft_ms: float | None = _finite(
        default=None, gt=0, le=MAX_SLO_MS, description="Most time to first token, ms."
    )
    tpot_ms: float | None = _finite(
        default=None, gt=0, le=MAX_SLO_MS, description="Most time per output token, ms."
    )
    e2e_ms: float | None = _finite(
        default=None, gt=0, le=MAX_SLO_MS, description="Most end-to-end latency, ms."
    )

    @model_validator(mode="after")
    def _some_threshold(self) -> SLOSpec:
        if self.ttft_ms is None and self.tpot_ms is None and self.e2e_ms is None:
            raise ValueError("an slo needs at least one of ttft_ms, tpot_ms, e2e_ms")
        return self


class CapacitySpec(_Spec):
    """Search the workload's load for the highest point that meets its ``slo``
    (k3pipe.verdicts.capacity): each
    probe sends the workload at one request rate (``over: rate``, under the workload's load
    'constant' or 'poisson') or concurrency (``over: concurrency``) on the same running engine, and
    passes when at least ``attainment_pct`` of its measured requests met every objective, TTFT and
    E2E counted from each request's scheduled arrival. From ``start``, the load is multiplied or
    divided by ``factor`` until a pass and a fail surround the boundary (or ``low`` / ``high`` is
    reached), then bisected until the failing point is within ``tolerance_pct`` of the passing one.
    Each repeat is a search of its own (its own prompts and arrivals): the repeats give the interval.
    Under 'rate' the workload's ``concurrency`` caps the requests in flight: set it at or above what
    the engine runs at once (its max_num_seqs), or the client's own queue is what is measured."""

    over: Literal["rate", "concurrency"] = Field(
        default="rate", description="What the search varies: request rate (req/s) or concurrency."
    )
    low: float = _finite(gt=0, le=MAX_RATE_RPS, description="The lowest load to try (req/s, or streams).")
    high: float = _finite(gt=0, le=MAX_RATE_RPS, description="The highest load to try.")
    start: float | None = _finite(
        default=None,
        gt=0,
        le=MAX_RATE_RPS,
        description="The first load probed (default: the geometric middle).",
    )
    factor: float = _finite(default=2.0, gt=1, le=16, description="Bracketing step: x or / this factor.")
    tolerance_pct: float = _finite(
        default=5.0, ge=0, le=100, description="The search ends once fail / pass <= 1 + this / 100."
    )
    attainment_pct: float = _finite(
        default=90.0, gt=0, le=100, description="A probe passes when this share of its requests met the SLO."
    )
    max_probes: int = _count(default=12, ge=2, le=64, description="The most probes a search may run.")
    reset_prefix_cache: bool = Field(
        default=True,
        strict=True,
        description="Empty the engine's prefix cache before each probe where it offers a way (vLLM's "
        "/reset_prefix_cache with VLLM_SERVER_DEV_MODE=1, SGLang's /flush_cache); recorded either way.",
    )

    @model_validator(mode="after")
    def _bounds(self) -> CapacitySpec:
        if self.low >= self.high:
            raise ValueError(f"capacity.low ({self.low:g}) must be below capacity.high ({self.high:g})")
        if self.start is not None and not self.low <= self.start <= self.high:
            raise ValueError(
                f"capacity.start ({self.start:g}) must lie within [low, high] = [{self.low:g}, {self.high:g}]"
            )
        if self.over == "concurrency":
            for name in ("low", "high", "start"):
                value = getattr(self, name)
                if value is not None and (value != int(value) or value > MAX_CONCURRENCY):
                    raise ValueError(
                        f"capacity.{name} ({value:g}) must be a whole number of streams up to "
                        f"{MAX_CONCURRENCY:,} under over: concurrency"
                    )
        return self


class LadderSpec(_Spec):
    """Measure the workload at several loads on the same running engine, lowest first: each point a
    workload run of its own (named ``NAME@c8`` or ``NAME@2.5rps``), with the workload's repeats and
    prompts, the prefix cache emptied before each point where the engine offers a way. Points are
    ``points``, or ``start`` times ``factor`` up to ``stop``. With ``stop_when_saturated`` the ladder
    ends past saturation: output throughput up by less than ``min_gain_pct`` over the point before
    while the mean end-to-end latency rose by more than that (the added load only queued), shown by
    the repeats' spread, or by two points in a row where each point is measured once
    (k3pipe.verdicts.capacity.LadderStop)."""

    over: Literal["concurrency", "rate"] = Field(
        default="concurrency", description="What the ladder varies: concurrency (streams) or request rate."
    )
    points: list[float] | None = Field(
        default=None, min_length=1, max_length=64, description="The loads, in any order (run lowest first)."
    )
    start: float | None = _finite(default=None, gt=0, le=MAX_RATE_RPS, description="Geometric range: first.")
    stop: float | None = _finite(default=None, gt=0, le=MAX_RATE_RPS, description="Geometric range: at most.")
    factor: float = _finite(default=2.0, gt=1, le=16, description="Geometric range: step.")
    stop_when_saturated: bool = Field(default=True, strict=True, description="End past saturation.")
    min_gain_pct: float = _finite(
        default=5.0,
        ge=0,
        le=100,
        description="Less output-throughput gain than this, latency rising: saturated.",
    )

    @model_validator(mode="after")
    def _some_points(self) -> LadderSpec:
        if (self.points is None) == (self.start is None or self.stop is None):
            raise ValueError("a ladder needs either points or both start and stop (a geometric range)")
        if self.points is not None and (self.start is not None or self.stop is not None):
            raise ValueError("a ladder takes points or start/stop, not both")
        values = self.values()
        if len(values) > 64:
            raise ValueError(f"the ladder has {len(values)} points, more than 64: raise factor or narrow it")
        for v in values:
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"ladder point {v!r} must be a positive number")
            if self.over == "concurrency" and (v != int(v) or v > MAX_CONCURRENCY):
                raise ValueError(
                    f"ladder point {v:g} must be a whole number of streams up to {MAX_CONCURRENCY:,}"
                )
            if self.over == "rate" and v > MAX_RATE_RPS:
                raise ValueError(f"ladder point {v:g} req/s is above {MAX_RATE_RPS:,.0f}")
        return self

    def values(self) -> list[float]:
        """The points, lowest first, without repeats."""
        if self.points is not None:
            return sorted(set(float(v) for v in self.points))
        assert self.start is not None
        assert self.stop is not None
        out: list[float] = []
        v = self.start
        while v <= self.stop * (1 + 1e-9) and len(out) <= 64:
            out.append(float(round(v)) if self.over == "concurrency" else v)
            v *= self.factor
        return sorted(set(out))

    def label(self, point: float) -> str:
        return f"c{int(point)}" if self.over == "concurrency" else f"{point:g}rps"


class WorkloadSpec(_Spec):
    """One load shape over a dataset of prompts (random ones of exact length by default).

    ``load`` picks how measured requests are sent: ``concurrency`` keeps exactly ``concurrency``
    requests in flight (each slot sends the next request as soon as its previous one ends);
    ``constant`` sends one request every ``1 / rate_rps`` seconds; ``poisson`` sends at Poisson
    arrivals of rate ``rate_rps`` (exponential gaps drawn from ``numpy.random.default_rng(seed)``).
    Under ``constant`` and ``poisson``, ``concurrency`` caps the requests in flight: a request due
    while the cap is reached waits for a slot, and that wait shows as send lag in the summary.

    Before its measured requests each repeat sends ``warmup_requests`` warm-up requests at
    ``concurrency`` (not measured, all ended before the measured phase opens); with ``warmup:
    steady`` in waves of ``concurrency`` until two consecutive waves' output rates agree within
    ``warmup_tolerance_pct``, ``warmup_requests`` being the most (docs/measurement.md, "Warm-up").

    Every workload's prompts are built in memory before the first launch, so a workload holds at
    most ``MAX_WORKLOAD_PROMPTS`` prompts (``(warmup_requests + num_requests) x repeats``).
    """

    name: str = Field(
        description="Workload name, unique within the experiment (letters, digits, '-', '_', '.')."
    )
    input_tokens: int = _count(
        gt=0,
        le=MAX_TOKENS,
        description=(
            "Prompt length in tokens (the model's tokenizer): exact for random, documents and "
            "shared_prefix datasets, the upper bound for sharegpt."
        ),
    )
    dataset: DatasetSpec = Field(
        default_factory=RandomDataset,
        description="Where prompts come from: random (default), sharegpt, documents or shared_prefix.",
    )
    output_tokens: int = _count(
        gt=0, le=MAX_TOKENS, description="Tokens to generate (max_tokens, with ignore_eos)."
    )
    concurrency: int = _count(
        default=1,
        ge=1,
        le=MAX_CONCURRENCY,
        description=(
            "Requests in flight at once (load 'concurrency'); the cap on requests in flight for "
            "'constant' and 'poisson'. Warm-up requests always run at this concurrency."
        ),
    )
    load: Literal["concurrency", "constant", "poisson"] = Field(
        default="concurrency",
        description=(
            "How measured requests are sent: 'concurrency' (fixed concurrency), 'constant' (one every "
            "1/rate_rps s) or 'poisson' (Poisson arrivals of rate rate_rps, seeded by seed)."
        ),
    )
    rate_rps: float | None = _finite(
        default=None,
        gt=0,
        le=MAX_RATE_RPS,
        description="Requests per second of load 'constant' or 'poisson' (required there, else refused).",
    )
    duration_s: float | None = _finite(
        default=None,
        gt=0,
        le=MAX_DURATION_S,
        description=(
            "Stop sending new measured requests this many seconds after the first measured send "
            "(requests in flight still finish); num_requests stays the upper bound. None: no bound."
        ),
    )
    num_requests: int = _count(
        default=16,
        ge=1,
        le=MAX_REQUESTS,
        description="Measured requests (the most sent when duration_s bounds the run).",
    )
    warmup_requests: int = _count(
        default=0,
        ge=0,
        le=MAX_REQUESTS,
        description=(
            "Requests sent first, at concurrency, and not measured (each repeat's first prompts): "
            "all of them under warmup 'fixed', the most under warmup 'steady'."
        ),
    )
    warmup: Literal["fixed", "steady"] = Field(
        default="fixed",
        description=(
            "'fixed': send warmup_requests warm-up requests. 'steady': send them in waves of "
            "concurrency (each wave ends before the next is sent) until two consecutive waves' "
            "output rates agree within warmup_tolerance_pct, at most warmup_requests // concurrency "
            "waves (docs/measurement.md, 'Warm-up')."
        ),
    )
    warmup_tolerance_pct: float = _finite(
        default=5.0,
        gt=0,
        le=MAX_WARMUP_TOLERANCE_PCT,
        description=(
            "Two consecutive warm-up waves agree when the later's output rate is within this many "
            "percent of the earlier's: warmup 'steady' stops there; under 'fixed' it only judges "
            "whether the warm-up ended steady (metric warmup_steady)."
        ),
    )
    seed: int = _count(
        default=0,
        ge=0,
        le=MAX_SEED,
        description=(
            "Seed of the prompts (generation or sampling) and of the Poisson arrivals; non-negative "
            "(numpy's default_rng refuses a negative seed)."
        ),
    )
    repeats: int = _count(
        default=1,
        ge=1,
        le=MAX_REPEATS,
        description=(
            "Run the workload this many times, each repeat with prompts of its own (random kinds drawn "
            "with seed + k; sharegpt and documents: disjoint slices of one draw) and arrivals seeded "
            "seed + k; the summary then gives mean, std and a 95% confidence interval across repeats."
        ),
    )
    slo: SLOSpec | None = Field(
        default=None, description="Latency objectives; with them the summary gives goodput and attainment."
    )
    ladder: LadderSpec | None = Field(
        default=None,
        description="Measure this workload at several loads on the same engine, lowest first, each "
        "point a workload run of its own (NAME@c8, NAME@2.5rps), ending past saturation.",
    )
    capacity: CapacitySpec | None = Field(
        default=None,
        description="Search for the highest load that meets slo instead of measuring one load point "
        "(k3pipe.verdicts.capacity): its probes run on the same engine, each a nested run.",
    )
    metrics_interval_s: float = _finite(
        default=1.0,
        ge=MIN_METRICS_INTERVAL_S,
        le=MAX_METRICS_INTERVAL_S,
        description="How often the engine's /metrics is scraped during the workload, in seconds.",
    )
    api: Literal["chat", "completions"] = Field(
        default="chat", description="chat: /chat/completions; completions: /completions."
    )
    ignore_eos: bool = Field(
        default=True,
        strict=True,
        description="Send ignore_eos so every request generates exactly output_tokens.",
    )
    request_timeout_s: float = _finite(
        default=600.0, gt=0, le=MAX_REQUEST_TIMEOUT_S, description="Per-request timeout."
    )

    @field_validator("name")
    @classmethod
    def _safe_name(cls, value: str) -> str:
        return safe_name(value, "workload")

    def _capacity_fits(self) -> None:
        capacity = self.capacity
        assert capacity is not None
        if self.slo is None:
            raise ValueError(
                "capacity searches for the highest load that meets the workload's slo: set slo "
                "(ttft_ms, tpot_ms and/or e2e_ms)"
            )
        if capacity.over == "rate":
            if self.load == "concurrency":
                raise ValueError(
                    "capacity over 'rate' sends at request rates: set load to 'poisson' or 'constant' "
                    "(or capacity.over to 'concurrency')"
                )
            if self.rate_rps is not None:
                raise ValueError(
                    f"rate_rps ({self.rate_rps:g}) is chosen by the capacity search, probe by probe: "
                    "remove it (capacity.start sets the first rate)"
                )
        elif self.load != "concurrency":
            raise ValueError(
                f"capacity over 'concurrency' sends at fixed concurrency: set load to 'concurrency' "
                f"(it is {self.load!r}), or capacity.over to 'rate'"
            )

    def _ladder_fits(self) -> None:
        ladder = self.ladder
        assert ladder is not None
        if ladder.over == "rate":
            if self.load == "concurrency":
                raise ValueError(
                    "a ladder over 'rate' sends at request rates: set load to 'poisson' or 'constant' "
                    "(or ladder.over to 'concurrency')"
                )
            if self.rate_rps is not None:
                raise ValueError(f"rate_rps ({self.rate_rps:g}) is set by each ladder point: remove it")
        elif self.load != "concurrency":
            raise ValueError(
                f"a ladder over 'concurrency' sends at fixed concurrency: set load to 'concurrency' "
                f"(it is {self.load!r}), or ladder.over to 'rate'"
            )

    def rung(self, point: float) -> WorkloadSpec:
        """This workload at one point of its ladder: a workload of its own, named NAME@c8 / NAME@2rps."""
        assert self.ladder is not None
        name = f"{self.name}@{self.ladder.label(point)}"
        if self.ladder.over == "rate":
            return self.model_copy(update={"name": name, "rate_rps": point, "ladder": None})
        return self.model_copy(update={"name": name, "concurrency": int(point), "ladder": None})

    def probe(self, point: float) -> WorkloadSpec:
        """This workload at one load point of its capacity search (a rate, or a concurrency)."""
        assert self.capacity is not None
        if self.capacity.over == "rate":
            return self.model_copy(update={"rate_rps": point, "capacity": None})
        return self.model_copy(update={"concurrency": int(point), "capacity": None})

    @property
    def prompt_count(self) -> int:
        """Prompts the workload builds before the first launch: ``(warmup + num_requests) x repeats``."""
        return (self.warmup_requests + self.num_requests) * self.repeats

    @model_validator(mode="after")
    def _rate_fits_load(self) -> WorkloadSpec:
        if self.ladder is not None and self.capacity is not None:
            raise ValueError("a workload has a ladder or a capacity search, not both: split it in two")
        if self.capacity is not None:
            self._capacity_fits()
        elif self.ladder is not None:
            self._ladder_fits()
        elif self.load in ("constant", "poisson") and self.rate_rps is None:
            raise ValueError(f"load {self.load!r} needs rate_rps (requests per second)")
        if self.load == "concurrency" and self.rate_rps is not None:
            raise ValueError(
                "rate_rps is only used by load 'constant' or 'poisson'; "
                "remove it or set load (the default, 'concurrency', sends at fixed concurrency)"
            )
        if self.warmup == "steady" and self.warmup_requests < 2 * self.concurrency:
            raise ValueError(
                f"warmup 'steady' compares consecutive waves of concurrency ({self.concurrency}) "
                f"warm-up requests, so warmup_requests (the most it sends, {self.warmup_requests}) must "
                f"allow two waves at least: set warmup_requests to {2 * self.concurrency} or more, or "
                "warmup to 'fixed'"
            )
        if isinstance(self.dataset, SharedPrefixDataset) and self.dataset.prefix_tokens >= self.input_tokens:
            raise ValueError(
                f"dataset.prefix_tokens ({self.dataset.prefix_tokens}) must be below input_tokens "
                f"({self.input_tokens}): each prompt is the shared prefix plus a suffix of its own"
            )
        if self.prompt_count > MAX_WORKLOAD_PROMPTS:
            raise ValueError(
                f"(warmup_requests {self.warmup_requests:,} + num_requests {self.num_requests:,}) x "
                f"repeats {self.repeats:,} = {self.prompt_count:,} prompts, more than the "
                f"{MAX_WORKLOAD_PROMPTS:,} a workload may build: all its prompts are built in memory "
                "before the engine starts; send fewer requests, or split it into workloads"
            )
        return self


class ArmOverride(_Spec):
    """What a variant changes in one arm: engine arguments and environment laid over the arm's
    (a null value removes the key), and optionally its image or declared version."""

    args: dict[str, Any] = Field(
        default_factory=dict, description="Engine arguments over the arm's (null removes one)."
    )
    env: dict[str, str | None] = Field(
        default_factory=dict, description="Engine environment over the arm's (null removes one)."
    )
    image: str | None = Field(default=None, description="Another image (docker launcher).")
    version: str | None = Field(default=None, description="Another declared engine version.")

    @field_validator("args")
    @classmethod
    def _args(cls, value: dict[str, Any]) -> dict[str, Any]:
        return _check_args(value)

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str | None]) -> dict[str, str | None]:
        for key in value:
            if not _ENV_NAME.match(key):
                raise ValueError(
                    f"environment variable name {key!r} is not valid: letters, digits and '_', "
                    "not starting with a digit"
                )
        return value


_VARIANT_WORKLOAD_FIELDS = sorted(set(WorkloadSpec.model_fields) - {"name"})


class VariantSpec(_Spec):
    """A named change against the experiment (its baseline): some arms' engine settings and/or every
    workload's fields. A variant is run as the experiment restricted to the arms it names, changed
    so, and compared workload by workload with the baseline's same arms."""

    name: str = Field(
        description="Variant name, unique among variants and arms: letters, digits, '-', '_' and '.' "
        "(it names MLflow runs and metrics); 'baseline' is the retest's name for the experiment itself.",
    )
    description: str = Field(default="", description="What the variant tests (the checklist item).")
    arms: dict[str, ArmOverride] = Field(
        min_length=1, description="The arms the variant runs, each with its changes ({} for none)."
    )
    workloads: dict[str, Any] = Field(
        default_factory=dict,
        description="Workload fields laid over every workload's (e.g. dataset, input_tokens).",
    )

    @field_validator("name")
    @classmethod
    def _safe_name(cls, value: str) -> str:
        safe_name(value, "variant")
        if value == "baseline":
            raise ValueError(
                "'baseline' is the retest's name for the experiment itself: name the variant "
                "after what it changes"
            )
        return value

    @field_validator("workloads")
    @classmethod
    def _workload_fields(cls, value: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(value) - set(_VARIANT_WORKLOAD_FIELDS))
        if unknown:
            raise ValueError(
                f"{', '.join(map(repr, unknown))} is not a workload field a variant can change; "
                f"allowed: {', '.join(_VARIANT_WORKLOAD_FIELDS)}"
            )
        return value


def _repeated(names: list[str]) -> list[str]:
    return sorted(n for n, k in Counter(names).items() if k > 1)


MAX_CLIENT_PROCESSES = 256


class ClientSpec(_Spec):
    """How k3pipe's load generator runs: its processes, their CPUs and priority (what was used is
    recorded with every workload: client_load.json, client_* metrics)."""

    processes: int | None = _count(
        default=None,
        ge=1,
        le=MAX_CLIENT_PROCESSES,
        description=(
            "Client processes a workload's streams are spread over, each with its own event loop and "
            "connections under one schedule (None: one per 128 streams of the workload's concurrency, "
            "at most one per CPU the client may use)."
        ),
    )
    cpus: str | None = Field(
        default=None,
        description=(
            "CPUs the client processes run on, taskset-style ('0-7,16'), split among them (None: every "
            "CPU k3pipe may use except a process-launched engine's launcher.cpus)."
        ),
    )
    realtime: bool = Field(
        default=False,
        strict=True,
        description=(
            "Run the client processes under SCHED_FIFO (needs CAP_SYS_NICE; where refused they run at "
            "normal priority, and the record says so)."
        ),
    )

    @field_validator("cpus")
    @classmethod
    def _cpus(cls, value: str | None) -> str | None:
        if value is not None:
            parse_cpu_list(value, "client.cpus")
        return value


REFERENCE_METRICS = (
    "duration_s",
    "output_throughput_tps",
    "engine_generation_tps",
    "steady_decode_tps",
    "ttft_ms_p50",
    "content_ttft_ms_p50",
    "tpot_ms_p50",
    "itl_ms_p50",
)
"""The report's table metrics (k3pipe.report.analysis.TABLE_METRICS) a published figure can stand beside."""


class ReferenceFigure(_Spec):
    """One published figure: what ``arm`` of the reference study measured on ``workload``."""

    workload: str = Field(min_length=1, description="The workload of this experiment it corresponds to.")
    metric: str = Field(description="The report metric it stands beside: " + ", ".join(REFERENCE_METRICS))
    arm: str = Field(
        min_length=1, max_length=NAME_MAX_CHARS, description="The published arm, e.g. 'study vLLM (TP 8)'."
    )
    value: float = _finite(description="The published value, in the metric's unit.")

    @field_validator("metric")
    @classmethod
    def _known_metric(cls, value: str) -> str:
        if value not in REFERENCE_METRICS:
            known = ", ".join(REFERENCE_METRICS)
            raise ValueError(f"metric {value!r} is not a metric of the report; one of: {known}")
        return value


class ReferenceSpec(_Spec):
    """A published table to show beside this experiment's results (the report's 'Beside the
    reference' section): the figures are shown, never mixed into the analysis."""

    source: str = Field(min_length=1, description="Where the figures come from (document, hardware, model).")
    figures: list[ReferenceFigure] = Field(
        min_length=1, max_length=MAX_WORKLOADS, description="One per arm, workload and metric."
    )
    notes: list[str] = Field(
        default_factory=list, max_length=100, description="Published figures without a cell (slow-downs...)."
    )


class UntilSpec(_Spec):
    """Launches added until the decision is reached: after the planned launches, a round that
    launches every arm once more (continuing the interleaved order) is added while some decision
    comparison is neither decided (different, or equivalent) nor within +-``ci_pct``, until an arm
    would exceed ``max_launches`` or ``budget_s`` would be overrun. Each round is a look at the data;
    the family-wise error rate is spent over the looks (docs/measurement.md, "Adding launches")."""

    ci_pct: float = _finite(
        default=5.0,
        gt=0,
        le=100,
        description="Stop once every undecided comparison's interval is within +-ci_pct (percent).",
    )
    max_launches: int = _count(
        ge=2, le=MAX_LAUNCHES, description="The most launches an arm gets (the planned ones included)."
    )
    budget_s: float | None = _finite(
        default=None,
        gt=0,
        le=MAX_DURATION_S,
        description="Add no round that would end later than this many seconds after the study began "
        "(judged by the slowest round so far). None: no time limit.",
    )


DECISION_METRICS = tuple(f.key for f in FIGURES)
"""The figures a decision may rest on (k3pipe.core.figures.FIGURES)."""


class AccuracySpec(_Spec):
    """A task score per arm (k3pipe.bench.accuracy): a local JSONL set of questions with known answers,
    asked through the arm's endpoint on its first launch, each arm's score judged against the
    reference's on the same questions ("worse", or "equivalent within margin_points")."""

    path: str = Field(
        description=(
            "The JSONL file: one {'question', 'answer'} (or {'prompt', 'target'}) a line, on this machine "
            "('{home}' expands to K3PIPE_HOME); nothing is downloaded."
        )
    )
    match: Literal["number", "exact", "contains"] = Field(
        default="number",
        description="How an answer is marked right: its last number is the expected one (after '####' in "
        "GSM8K's answers), the text exactly, or the text contained.",
    )
    limit: int | None = Field(default=None, ge=1, strict=True, description="Ask the first N questions only.")
    max_tokens: int = Field(
        default=512, ge=1, le=32768, strict=True, description="Tokens an answer may run to."
    )
    concurrency: int = Field(default=16, ge=1, le=1024, strict=True, description="Questions asked at once.")
    prompt_suffix: str = Field(default="", description="Text put after each question (an instruction).")
    margin_points: float = _finite(
        default=2.0, gt=0, le=100, description="Equivalence margin, in accuracy points."
    )


class AnswersSpec(_Spec):
    """The output probe (issue 47; docs/measurement.md, "Answers"): after each launch's timed repeats,
    the same fixed prompts sent to every arm one at a time, answered greedily to a fixed length and, where
    the engine offers it, a fixed continuation scored teacher-forced. Each arm's answers are compared with
    the reference arm's (``decision.baseline``, else the first) and judged against the floor (the
    reference against itself launched again); an arm detected faster whose answers diverge beyond the
    floor is 'faster, answers differ' and never the recommendation without ``decision.accept_divergence``.
    The prompts are random token ids from the model's vocabulary, drawn from ``seed`` (the same for every
    arm and launch; their digest is recorded)."""

    prompts: int = Field(
        default=16, ge=2, le=256, strict=True, description="How many prompts the probe sends each launch."
    )
    prompt_tokens: int = Field(
        default=64, ge=2, le=8192, strict=True, description="Tokens in each probe prompt."
    )
    output_tokens: int = Field(
        default=32,
        ge=1,
        le=2048,
        strict=True,
        description=(
            "Tokens each greedy answer runs to (the end of sequence ignored: every arm answers as many)."
        ),
    )
    continuation_tokens: int = Field(
        default=16,
        ge=1,
        le=2048,
        strict=True,
        description="Tokens of the fixed continuation scored teacher-forced after each prompt.",
    )
    score: bool = Field(
        default=True,
        strict=True,
        description=(
            "Score the continuation teacher-forced (vLLM's prompt_logprobs, SGLang's input "
            "log-probabilities); off: greedy tokens alone (a weaker test: it can detect a divergence, "
            "never rule one out)."
        ),
    )
    margin_nats: float = _finite(
        default=0.0,
        ge=0,
        le=10,
        description=(
            "How far (mean absolute log-probability difference, nats per token) an arm may diverge beyond "
            "the floor and still be 'within the floor' (0.02: a token's probability moved by about 2% on "
            "average). 0: any divergence detected beyond the floor gates the arm, and an arm is called "
            "within only where its answers are exactly the floor's (a deterministic engine); on a GPU, "
            "whose floor is not nil, set a margin to be able to hear 'within'."
        ),
    )
    seed: int = Field(default=47, ge=0, strict=True, description="Seed the probe's prompts are drawn from.")
    accuracy: AccuracySpec | None = Field(
        default=None, description="A task score per arm on a local question set (None: none)."
    )
    tool_requests: int = Field(
        default=16,
        ge=0,
        le=1000,
        strict=True,
        description=(
            "Tool-calling chat requests sent to an arm with a tool-call or reasoning parser "
            "(tool_call_parser, reasoning_parser), every other one streamed, each answer checked "
            "(k3pipe.bench.structured); 0: none."
        ),
    )


class DecisionSpec(_Spec):
    """How the study's report turns repeats into verdicts (docs/measurement.md, "Verdicts").

    Every pair of arms is compared on each decision metric and workload, on the log of the ratio of
    their geometric means; the family-wise error rate ``alpha`` is shared by all those comparisons
    (Bonferroni), and each verdict is read off its interval at that level: one arm better by x%, the
    two equivalent within ``margin_pct``, or inconclusive (with the smallest difference the data could
    have shown, at ``power``). Every other figure is shown with its interval, as descriptive."""

    metrics: list[str] = Field(
        default_factory=lambda: list(DEFAULT_DECISION),
        min_length=1,
        max_length=len(DECISION_METRICS),
        description=(
            "The figures the verdicts rest on (default: output_throughput_tps, ttft_ms_p50, "
            "tpot_ms_p50); one of: " + ", ".join(DECISION_METRICS)
        ),
    )
    alpha: float = _finite(
        default=0.05, gt=0, lt=0.5, description="Family-wise error rate over every decision comparison."
    )
    margin_pct: float = _finite(
        default=5.0,
        gt=0,
        le=100,
        description="Equivalence margin in percent: two arms within +-margin_pct are 'equivalent'.",
    )
    power: float = _finite(
        default=0.8,
        gt=0,
        lt=1,
        description="The power the minimum detectable difference of an inconclusive verdict is stated at.",
    )
    baseline: str | None = Field(
        default=None,
        description="An arm every other arm is also judged against (beside the best); None: the best only.",
    )
    until: UntilSpec | None = Field(
        default=None,
        description="Add launches until the decision is reached (or a budget is spent); None: as planned.",
    )
    prime: bool = Field(
        default=False,
        strict=True,
        description=(
            "Launch every arm once before the measured launches, to fill the node's caches (the "
            "engine's compile cache, kernels built at first use, the model in the page cache): that "
            "launch runs each workload once, is recorded (tagged k3pipe.prime) and is left out of the "
            "verdicts and the noise. The A/A copy shares its baseline's priming."
        ),
    )
    calibration: bool = Field(
        default=False,
        strict=True,
        description=(
            "An A/A calibration: the baseline arm (or the first arm) is run twice as two arms, the "
            "second named '<arm>-aa' and launched like the first; the report states their comparison "
            "as the floor below which a difference cannot be told from restarting the engine."
        ),
    )
    prior_days: float = _finite(
        default=30.0,
        ge=0,
        le=3650,
        description=(
            "How old the restart noise an earlier study measured on this node (same engine kind, model, "
            "node and workload shape) may be to judge an arm launched once (k3pipe.records.priors); "
            "0: never, "
            "an arm launched once is then never judged."
        ),
    )
    accept_divergence: bool = Field(
        default=False,
        strict=True,
        description=(
            "Let an arm whose answers diverge beyond the floor (answers:) still be the recommendation when "
            "it is detected faster; off: it is reported 'faster, answers differ' and not recommended."
        ),
    )
    mixed_hardware: bool = Field(
        default=False,
        strict=True,
        description=(
            "Rank arms measured on different hardware (GPU model, count or driver, from the node facts "
            "each launch records: a fleet's nodes may differ). Off: the report names the difference and "
            "ranks nothing."
        ),
    )

    @field_validator("metrics")
    @classmethod
    def _known_metrics(cls, value: list[str]) -> list[str]:
        unknown = [m for m in value if m not in DECISION_METRICS]
        if unknown:
            raise ValueError(
                f"decision metric(s) {', '.join(map(repr, unknown))} unknown; one of: "
                + ", ".join(DECISION_METRICS)
            )
        dupes = _repeated(value)
        if dupes:
            raise ValueError(f"decision metrics repeat {', '.join(dupes)}")
        return value


CALIBRATION_SUFFIX = "-aa"
"""The A/A copy of the baseline arm is named ``<arm>-aa``."""


class ExperimentSpec(_Spec):
    """A whole study: model, engine arms and workloads.

    Its name, and its arms', workloads' and variants' names, name MLflow runs, metric keys and log
    files: each is a :func:`safe_name` (an experiment a variant resolves to is named
    ``EXPERIMENT@VARIANT``). Sizes are bounded (:data:`MAX_ARMS`, :data:`MAX_WORKLOADS`,
    :data:`MAX_VARIANTS`, :data:`MAX_PROMPT_TOKENS` of prompts over all workloads).
    """

    name: str = Field(
        description="Experiment name (the MLflow experiment's runs are tagged with it): letters, digits, "
        "'-', '_' and '.'."
    )
    description: str = Field(default="", description="What this experiment is for.")
    model: ModelSpec = Field(description="The model under test.")
    extra_models: dict[str, ModelSpec] = Field(
        default_factory=dict,
        max_length=MAX_EXTRA_MODELS,
        description="Further models (e.g. a speculative draft), referenced in args as '{models.NAME}'.",
    )
    hardware: HardwareSpec | None = Field(
        default=None, description="The node the experiment is planned for (for preflight estimates)."
    )
    arms: list[ArmSpec] = Field(
        min_length=1, max_length=MAX_ARMS, description="Engine configurations to run."
    )
    workloads: list[WorkloadSpec] = Field(
        min_length=1, max_length=MAX_WORKLOADS, description="Workloads each arm runs."
    )
    client: ClientSpec = Field(
        default_factory=ClientSpec, description="How the load generator runs (processes, CPUs, priority)."
    )
    variants: list[VariantSpec] = Field(
        default_factory=list,
        max_length=MAX_VARIANTS,
        description=(
            "Named changes against this baseline (k3pipe.experiment.variants resolves each to an experiment)."
        ),
    )
    reference: ReferenceSpec | None = Field(
        default=None, description="A published table the study's report shows beside its own results."
    )
    decision: DecisionSpec = Field(
        default_factory=DecisionSpec,
        description="How the report's verdicts are made (metrics, error rate, margin, baseline, A/A).",
    )
    answers: AnswersSpec | None = Field(
        default=None,
        description=(
            "The output probe: every launch's answers to fixed prompts compared with the reference arm's "
            "and judged against the floor, and the verdict gated on them (docs/measurement.md, 'Answers'); "
            "None: answers are not checked."
        ),
    )
    fleet: FleetSpec | None = Field(
        default=None,
        description=(
            "Spread the study's launches over GPU nodes' work pools (run through Prefect: the study "
            "flow); None: every launch on this machine, one after another."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _default_launches(cls, data: Any) -> Any:
        """An arm that does not say how many launches gets :data:`DEFAULT_LAUNCHES` in an experiment
        that compares (two arms or more, variants, an A/A calibration): a verdict needs restart
        noise, and one launch per arm holds none (docs/measurement.md, "Restart noise")."""
        if not isinstance(data, dict) or not isinstance(data.get("arms"), list):
            return data
        decision = data.get("decision")
        calibration = isinstance(decision, dict) and decision.get("calibration") is True
        calibration = calibration or (isinstance(decision, DecisionSpec) and decision.calibration)
        compares = len(data["arms"]) >= 2 or bool(data.get("variants")) or calibration
        if not compares:
            return data
        arms = []
        for arm in data["arms"]:
            if isinstance(arm, dict) and arm.get("launches") is None:
                arm = {**arm, "launches": DEFAULT_LAUNCHES}
            elif isinstance(arm, ArmSpec) and "launches" not in arm.model_fields_set:
                arm = arm.model_copy(update={"launches": DEFAULT_LAUNCHES})
            arms.append(arm)
        return {**data, "arms": arms}

    @field_validator("name")
    @classmethod
    def _safe_name(cls, value: str) -> str:
        # 'EXPERIMENT@VARIANT' is the name k3pipe.experiment.variants gives a resolved variant
        base, at, variant = value.partition("@")
        try:
            safe_name(base, "experiment")
            if at:
                safe_name(variant, "variant")
        except ValueError:
            safe_name(value, "experiment")  # the rule, said of the whole name
        return value

    @field_validator("extra_models")
    @classmethod
    def _model_keys(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key in value:
            if not _MODEL_KEY.fullmatch(key) or len(key) > NAME_MAX_CHARS:
                raise ValueError(
                    f"extra model name {key!r} must start with a letter or digit and hold only letters, "
                    "digits, '-' and '_' (args refer to it as '{models.NAME}')"
                )
        return value

    @model_validator(mode="after")
    def _unique_names(self) -> ExperimentSpec:
        for label, names in (
            ("arms", [a.name for a in self.arms]),
            ("workloads", [w.name for w in self.workloads]),
            ("variants and arms", [v.name for v in self.variants] + [a.name for a in self.arms]),
        ):
            dupes = _repeated(names)
            if dupes:
                raise ValueError(f"{label} names must be unique; repeated: {', '.join(dupes)}")
        arms = {a.name for a in self.arms}
        for v in self.variants:
            unknown = sorted(set(v.arms) - arms)
            if unknown:
                raise ValueError(
                    f"variant {v.name!r} names arm(s) {', '.join(unknown)} that the experiment does not "
                    f"have; its arms: {', '.join(sorted(arms))}"
                )
        baseline = self.decision.baseline
        if baseline is not None and baseline not in arms:
            raise ValueError(
                f"decision.baseline {baseline!r} is not an arm of the experiment; its arms: "
                + ", ".join(a.name for a in self.arms)
            )
        until = self.decision.until
        if until is not None and until.max_launches < max(a.launches for a in self.arms):
            raise ValueError(
                f"decision.until.max_launches ({until.max_launches}) is below the launches an arm "
                f"already plans ({max(a.launches for a in self.arms)}): raise max_launches, or lower "
                "that arm's launches"
            )
        if self.decision.calibration:
            copy = self.calibration_arm_name
            if copy in arms:
                raise ValueError(
                    f"decision.calibration adds the A/A arm {copy!r}, but an arm already has that name: "
                    "rename it, or drop that arm and keep calibration"
                )
        if self.fleet is not None:
            unknown = sorted(set(self.fleet.arms) - arms)
            if unknown:
                raise ValueError(
                    f"fleet.arms names arm(s) {', '.join(unknown)} that the experiment does not have; its "
                    f"arms: {', '.join(sorted(arms))}"
                )
            if self.decision.prime:
                raise ValueError(
                    "decision.prime with fleet: a priming launch fills one node's caches, and the "
                    "measured launches may run on another; drop decision.prime, or fleet"
                )
        if self.reference is not None:
            workloads = [w.name for w in self.workloads]
            unknown = sorted({f.workload for f in self.reference.figures} - set(workloads))
            if unknown:
                raise ValueError(
                    f"reference.figures name workload(s) {', '.join(unknown)} that the experiment does not "
                    f"have; its workloads: {', '.join(workloads)}"
                )
        return self

    @model_validator(mode="after")
    def _declared_models(self) -> ExperimentSpec:
        declared = sorted(self.extra_models)
        shown = ", ".join("{models." + n + "}" for n in declared) or "none"
        sources = [
            (f"arms[{i}].engine.args", f"arm {a.name!r}", a.engine.args) for i, a in enumerate(self.arms)
        ]
        sources += [
            (f"variants[{i}].arms.{arm}.args", f"variant {v.name!r}", o.args)
            for i, v in enumerate(self.variants)
            for arm, o in v.arms.items()
        ]
        for where, who, args in sources:
            for key, value in args.items():
                for text in _strings(value):
                    typo = _MODEL_TYPO.search(text)
                    if typo:
                        raise ValueError(
                            f"{where}.{key}: {who} writes {typo.group(0)!r}; extra models are referred to "
                            f"as '{{models.{typo.group(1)}}}' (and the model under test as '{{model}}')"
                        )
                    for name in _MODEL_REF.findall(text):
                        if name not in self.extra_models:
                            raise ValueError(
                                f"{where}.{key}: {who} refers to '{{models.{name}}}', but extra_models "
                                f"declares {shown}: declare it under extra_models (source and id or path), "
                                "or fix the name"
                            )
        return self

    @model_validator(mode="after")
    def _prompt_memory(self) -> ExperimentSpec:
        total = sum(w.prompt_count * w.input_tokens for w in self.workloads)
        if total > MAX_PROMPT_TOKENS:
            raise ValueError(
                f"the workloads' prompts hold {total:,} tokens in all ((warmup_requests + num_requests) x "
                f"repeats x input_tokens, summed), more than {MAX_PROMPT_TOKENS:,}: every prompt is built "
                "in memory before the first launch; send fewer or shorter requests, or split the experiment"
            )
        return self

    @property
    def baseline_arm(self) -> str:
        """The decision's baseline arm, or the first arm."""
        return self.decision.baseline or self.arms[0].name

    @property
    def calibration_arm_name(self) -> str:
        return self.baseline_arm + CALIBRATION_SUFFIX

    def study_arms(self) -> list[ArmSpec]:
        """The arms a study runs: the experiment's, and with ``decision.calibration`` the A/A copy of
        the baseline arm (named ``<arm>-aa``) right after it."""
        if not self.decision.calibration:
            return list(self.arms)
        out: list[ArmSpec] = []
        for arm in self.arms:
            out.append(arm)
            if arm.name == self.baseline_arm:
                out.append(arm.model_copy(update={"name": self.calibration_arm_name}))
        return out

    def arm(self, name: str) -> ArmSpec:
        if self.decision.calibration and name == self.calibration_arm_name:
            return next(a for a in self.study_arms() if a.name == name)
        for arm in self.arms:
            if arm.name == name:
                return arm
        raise SpecError(
            f"experiment {self.name!r} has no arm {name!r}; arms: {', '.join(a.name for a in self.arms)}"
        )


def _strings(value: Any) -> list[str]:
    """Every string of an argument value (render_args expands placeholders in all of them)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def expand_home(value: str, home: Path) -> str:
    """Replace '{home}' with the state directory."""
    return value.replace("{home}", str(home))
