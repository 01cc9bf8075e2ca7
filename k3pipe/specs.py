"""Experiment specs: YAML files loaded into frozen pydantic models.

An experiment is one model (plus optional extra models such as a speculative draft), one or more
engine arms (engine + launcher + endpoint) and the workloads each arm runs. Specs hold the NAME of
the environment variable that carries an API key, never the key itself. Loading a file, and the
checks that need the engine registry, are in :mod:`k3pipe.experiment` (so that specs import no
engine).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from k3pipe import secrets
from k3pipe.errors import SpecError
from k3pipe.launchers.kinds import LauncherSpec, ProcessLauncherSpec

__all__ = [
    "ArmOverride",
    "ArmSpec",
    "DatasetSpec",
    "DocumentsDataset",
    "EndpointSpec",
    "EngineSpec",
    "ExperimentSpec",
    "HardwareSpec",
    "LauncherSpec",
    "LocalModel",
    "ModelScopeModel",
    "ModelSpec",
    "RandomDataset",
    "SLOSpec",
    "ShareGPTDataset",
    "SharedPrefixDataset",
    "VariantSpec",
    "WorkloadSpec",
    "expand_home",
]

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_VARIANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelScopeModel(_Spec):
    """Weights downloaded from ModelScope with ``snapshot_download``."""

    source: Literal["modelscope"] = Field(description="Download from the ModelScope hub.")
    id: str = Field(description="ModelScope model id, 'owner/name', e.g. 'moonshotai/Kimi-K3'.")
    revision: str = Field(default="master", description="Branch, tag or commit to download.")
    allow_patterns: list[str] | None = Field(
        default=None, description="Only download files matching these glob patterns."
    )
    served_name: str | None = Field(
        default=None, description="Name the engine serves the model under (--served-model-name)."
    )

    @field_validator("id")
    @classmethod
    def _owner_name(cls, value: str) -> str:
        if value.count("/") != 1 or value.startswith("/") or value.endswith("/"):
            raise ValueError(f"model id {value!r} must look like 'owner/name'")
        return value


class LocalModel(_Spec):
    """Weights already on disk (or made locally, like the tiny demo model)."""

    source: Literal["local"] = Field(description="Use a directory on this machine.")
    path: str = Field(description="Model directory; '{home}' expands to K3PIPE_HOME.")
    served_name: str | None = Field(
        default=None, description="Name the engine serves the model under (--served-model-name)."
    )


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
                raise ValueError(f"environment variable name {key!r} is not valid")
            _check_references(f"env.{key}", item)
        return value

    @field_validator("args")
    @classmethod
    def _arg_references(cls, value: dict[str, Any]) -> dict[str, Any]:
        def visit(where: str, item: Any) -> None:
            if isinstance(item, dict):
                for k, v in item.items():
                    visit(f"{where}.{k}", v)
            elif isinstance(item, list):
                for i, v in enumerate(item):
                    visit(f"{where}[{i}]", v)
            elif isinstance(item, str):
                _check_references(where, item)

        for key, item in value.items():
            visit(f"args.{key}", item)
        return value


def _check_references(where: str, value: str) -> None:
    """Every '{env.X}' of ``value`` names a variable (the rule of ``_ENV_NAME``)."""
    bad = secrets.bad_env_references(value)
    if bad:
        raise ValueError(
            f"{where}: {{env.{bad[0]}}} does not name an environment variable; write '{{env.NAME}}' "
            "with NAME of letters, digits and '_', not starting with a digit (e.g. '{env.HF_TOKEN}')"
        )


class HardwareSpec(_Spec):
    """The accelerators the experiment is planned for (preflight's capacity estimates use them)."""

    gpu_name: str = Field(description="Accelerator model, e.g. 'NVIDIA B300'.")
    gpu_count: int = Field(ge=1, description="Accelerators on the node.")
    gpu_memory_gib: float = Field(gt=0, description="Memory visible per accelerator, in GiB.")


class EndpointSpec(_Spec):
    """The three settings of an OpenAI-compatible endpoint: base URL, key and model id."""

    base_url: str | None = Field(
        default=None,
        description="Base URL including its path, e.g. 'http://127.0.0.1:8000/v1' (default from launcher).",
    )
    api_key_env: str | None = Field(
        default=None, description="NAME of the environment variable that holds the API key."
    )
    model: str | None = Field(
        default=None, description="Model id sent in requests (default: the served name)."
    )
    continuous_usage_stats: bool = Field(
        default=True,
        description=(
            "Ask for stream_options.continuous_usage_stats (vLLM, SGLang: running token counts in "
            "every chunk, for per-token ITL and TPOT's k1). Turn off for an endpoint that refuses it; "
            "ITL is then per chunk, labelled so."
        ),
    )

    @field_validator("api_key_env")
    @classmethod
    def _env_name(cls, value: str | None) -> str | None:
        if value is None:
            return value
        # a key pasted here would be recorded as a param: refuse it, and never echo it whole
        # (a long run of mixed-case letters and digits, hardly a word among them: a key, not a name)
        keyish = secrets.looks_like_key(value) or (
            len(value) >= 20
            and value.count("_") <= 1
            and all(any(test(c) for c in value) for test in (str.islower, str.isupper, str.isdigit))
        )
        if keyish or not _ENV_NAME.match(value):
            secrets.register(value)
            shown = secrets.mask(value) if keyish or len(value) >= 12 else repr(value)
            raise ValueError(
                f"{shown} is not an environment variable name{' (it looks like a key)' if keyish else ''}: "
                "put the key in an environment variable and name that variable here, e.g. "
                "api_key_env: MY_GATEWAY_KEY"
            )
        return value

    @field_validator("base_url")
    @classmethod
    def _http(cls, value: str | None) -> str | None:
        if value is None:
            return value
        credentials = secrets.url_credentials(value)
        if credentials:
            secrets.register_all(v for _, v in credentials)
            where = " and ".join(dict.fromkeys(w for w, _ in credentials))
            raise ValueError(
                f"base URL {secrets.scrub_url(value)!r} carries credentials ({where}); k3pipe refuses "
                "them there (a URL is logged and recorded): put the key in an environment variable and "
                "name it in endpoint.api_key_env (it is sent as the Authorization header)"
            )
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"base URL {secrets.scrub_url(value)!r} must start with http:// or https://")
        return value.rstrip("/") if value else value


class ArmSpec(_Spec):
    """One engine configuration under test."""

    name: str = Field(description="Arm name, unique within the experiment.")
    engine: EngineSpec = Field(description="The engine and its arguments.")
    launcher: LauncherSpec = Field(
        default_factory=ProcessLauncherSpec, description="Where the engine runs (launcher.kind)."
    )
    endpoint: EndpointSpec = Field(default_factory=EndpointSpec, description="How clients reach it.")

    @model_validator(mode="after")
    def _launcher_fits(self) -> ArmSpec:
        problem = self.launcher.arm_problem(self.engine, self.endpoint)
        if problem:
            raise ValueError(problem)
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
        description="The JSON file; '{home}' expands to K3PIPE_HOME, relative paths to the working directory."
    )
    min_input_tokens: int = Field(default=4, ge=1, description="Leave out first turns shorter than this.")


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
        description="The folder; '{home}' expands to K3PIPE_HOME, relative paths to the working directory."
    )
    glob: str = Field(default="*.txt", description="Which files of the folder are documents.")


class SharedPrefixDataset(_Spec):
    """Prompts that share a prefix, for prefix caching: ``groups`` random prefixes of ``prefix_tokens``
    tokens, each prompt one of them followed by its own random suffix; ``input_tokens`` in all.
    Repeat ``k`` of the workload draws prefixes and suffixes with ``seed + k``."""

    kind: Literal["shared_prefix"] = Field(description="N prompts sharing P prefix tokens.")
    prefix_tokens: int = Field(gt=0, description="Tokens every prompt of a group shares (P).")
    groups: int = Field(default=1, ge=1, description="Distinct prefixes; prompts are dealt round-robin.")


DatasetSpec = Annotated[
    RandomDataset | ShareGPTDataset | DocumentsDataset | SharedPrefixDataset, Field(discriminator="kind")
]


class SLOSpec(_Spec):
    """Service-level objectives: a request meets them when every threshold given holds (<=).

    Goodput is the rate of requests that met them; attainment the share of measured requests that did
    (failed requests count as missed).
    """

    ttft_ms: float | None = Field(default=None, gt=0, description="Most time to first token, ms.")
    tpot_ms: float | None = Field(default=None, gt=0, description="Most time per output token, ms.")
    e2e_ms: float | None = Field(default=None, gt=0, description="Most end-to-end latency, ms.")

    @model_validator(mode="after")
    def _some_threshold(self) -> SLOSpec:
        if self.ttft_ms is None and self.tpot_ms is None and self.e2e_ms is None:
            raise ValueError("an slo needs at least one of ttft_ms, tpot_ms, e2e_ms")
        return self


class WorkloadSpec(_Spec):
    """One load shape over a dataset of prompts (random ones of exact length by default).

    ``load`` picks how measured requests are sent: ``concurrency`` keeps exactly ``concurrency``
    requests in flight (each slot sends the next request as soon as its previous one ends);
    ``constant`` sends one request every ``1 / rate_rps`` seconds; ``poisson`` sends at Poisson
    arrivals of rate ``rate_rps`` (exponential gaps drawn from ``numpy.random.default_rng(seed)``).
    Under ``constant`` and ``poisson``, ``concurrency`` caps the requests in flight: a request due
    while the cap is reached waits for a slot, and that wait shows as send lag in the summary.
    """

    name: str = Field(description="Workload name, unique within the experiment.")
    input_tokens: int = Field(
        gt=0,
        description=(
            "Prompt length in tokens (the model's tokenizer): exact for random, documents and "
            "shared_prefix datasets, the upper bound for sharegpt."
        ),
    )
    dataset: DatasetSpec = Field(
        default_factory=RandomDataset,
        description="Where prompts come from: random (default), sharegpt, documents or shared_prefix.",
    )
    output_tokens: int = Field(gt=0, description="Tokens to generate (max_tokens, with ignore_eos).")
    concurrency: int = Field(
        default=1,
        ge=1,
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
    rate_rps: float | None = Field(
        default=None,
        gt=0,
        description="Requests per second of load 'constant' or 'poisson' (required there, else refused).",
    )
    duration_s: float | None = Field(
        default=None,
        gt=0,
        description=(
            "Stop sending new measured requests this many seconds after the first measured send "
            "(requests in flight still finish); num_requests stays the upper bound. None: no bound."
        ),
    )
    num_requests: int = Field(
        default=16, ge=1, description="Measured requests (the most sent when duration_s bounds the run)."
    )
    warmup_requests: int = Field(default=0, ge=0, description="Requests sent first and not measured.")
    seed: int = Field(
        default=0, description="Seed of the prompts (generation or sampling) and of the Poisson arrivals."
    )
    repeats: int = Field(
        default=1,
        ge=1,
        description=(
            "Run the workload this many times, each repeat with prompts of its own (random kinds drawn "
            "with seed + k; sharegpt and documents: disjoint slices of one draw) and arrivals seeded "
            "seed + k; the summary then gives mean, std and a 95% confidence interval across repeats."
        ),
    )
    slo: SLOSpec | None = Field(
        default=None, description="Latency objectives; with them the summary gives goodput and attainment."
    )
    metrics_interval_s: float = Field(
        default=1.0,
        gt=0,
        description="How often the engine's /metrics is scraped during the workload, in seconds.",
    )
    api: Literal["chat", "completions"] = Field(
        default="chat", description="chat: /chat/completions; completions: /completions."
    )
    ignore_eos: bool = Field(
        default=True, description="Send ignore_eos so every request generates exactly output_tokens."
    )
    request_timeout_s: float = Field(default=600.0, gt=0, description="Per-request timeout.")

    @model_validator(mode="after")
    def _rate_fits_load(self) -> WorkloadSpec:
        if self.load in ("constant", "poisson") and self.rate_rps is None:
            raise ValueError(f"load {self.load!r} needs rate_rps (requests per second)")
        if self.load == "concurrency" and self.rate_rps is not None:
            raise ValueError(
                "rate_rps is only used by load 'constant' or 'poisson'; "
                "remove it or set load (the default, 'concurrency', sends at fixed concurrency)"
            )
        if isinstance(self.dataset, SharedPrefixDataset) and self.dataset.prefix_tokens >= self.input_tokens:
            raise ValueError(
                f"dataset.prefix_tokens ({self.dataset.prefix_tokens}) must be below input_tokens "
                f"({self.input_tokens}): each prompt is the shared prefix plus a suffix of its own"
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
        if not _VARIANT_NAME.match(value):
            raise ValueError(
                f"variant name {value!r} must start with a letter or digit and hold only letters, digits, "
                "'-', '_' and '.' (it names MLflow runs and metrics)"
            )
        if value == "baseline":
            raise ValueError("'baseline' is the retest's name for the experiment itself: name the variant "
                             "after what it changes")
        return value


class ExperimentSpec(_Spec):
    """A whole study: model, engine arms and workloads."""

    name: str = Field(description="Experiment name (the MLflow experiment's runs are tagged with it).")
    description: str = Field(default="", description="What this experiment is for.")
    model: ModelSpec = Field(description="The model under test.")
    extra_models: dict[str, ModelSpec] = Field(
        default_factory=dict,
        description="Further models (e.g. a speculative draft), referenced in args as '{models.NAME}'.",
    )
    hardware: HardwareSpec | None = Field(
        default=None, description="The node the experiment is planned for (for preflight estimates)."
    )
    arms: list[ArmSpec] = Field(min_length=1, description="Engine configurations to run.")
    workloads: list[WorkloadSpec] = Field(min_length=1, description="Workloads each arm runs.")
    variants: list[VariantSpec] = Field(
        default_factory=list,
        description="Named changes against this baseline (k3pipe.variants resolves each to an experiment).",
    )

    @model_validator(mode="after")
    def _unique_names(self) -> ExperimentSpec:
        for label, names in (
            ("arms", [a.name for a in self.arms]),
            ("workloads", [w.name for w in self.workloads]),
            ("variants and arms", [v.name for v in self.variants] + [a.name for a in self.arms]),
        ):
            dupes = sorted({n for n in names if names.count(n) > 1})
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
        return self

    def arm(self, name: str) -> ArmSpec:
        for arm in self.arms:
            if arm.name == name:
                return arm
        raise SpecError(
            f"experiment {self.name!r} has no arm {name!r}; arms: {', '.join(a.name for a in self.arms)}"
        )


def expand_home(value: str, home: Path) -> str:
    """Replace '{home}' with the state directory."""
    return value.replace("{home}", str(home))
