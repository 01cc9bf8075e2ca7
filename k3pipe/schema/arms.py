"""An arm: its engine (kind, version, arguments, environment), its endpoint and gateway, and the
hardware it is planned for.

Part of the experiment's schema; :mod:`k3pipe.schema.specs` re-exports every name."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from k3pipe.schema.common import (
    _ENV_NAME,
    MAX_GPU_COUNT,
    MAX_GPU_HOUR_USD,
    MAX_GPU_MEMORY_GIB,
    MAX_LAUNCHES,
    _check_args,
    _check_key_env,
    _check_references,
    _check_url_without_key,
    _count,
    _finite,
    _refuse_literal_secret,
    _Spec,
    _usage_stats_field,
    safe_name,
)
from k3pipe.schema.launcher_specs import AUTO_PORT, LauncherSpec, ProcessLauncherSpec


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
    metrics_url: str | None = Field(
        default=None,
        description=(
            "An engine k3pipe does not start (launcher.kind external): its Prometheus endpoint, e.g. "
            "'http://127.0.0.1:8000/metrics', read over each workload's window as a launched engine's "
            "(prefix-cache hits, tokens, KV use, queue). Unset: no engine counters for the arm."
        ),
    )

    @field_validator("api_key_env")
    @classmethod
    def _env_name(cls, value: str | None) -> str | None:
        return _check_key_env(value, "endpoint.api_key_env")

    @field_validator("base_url", "metrics_url")
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
    def _metrics_url_fits(self) -> ArmSpec:
        if self.endpoint.metrics_url is not None and self.launcher.runs_here:
            raise ValueError(
                f"endpoint.metrics_url {self.endpoint.metrics_url!r} is set with launcher.kind "
                f"{self.launcher.kind!r}: k3pipe reads the /metrics of an engine it starts itself; "
                "remove endpoint.metrics_url (it is for an external endpoint's engine)"
            )
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
        if self.launcher.port == AUTO_PORT:
            raise ValueError(
                "launcher.port is 'auto' beside gateway: the gateway routes to a port fixed in its own "
                "configuration, and a port drawn at launch would not be it; give launcher.port the "
                "number the gateway routes to"
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
