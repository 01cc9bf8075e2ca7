"""What every engine module provides, and the argument rendering they share.

An engine module defines a subclass of :class:`Engine` with everything engine-specific as class
attributes and methods: managed flags, endpoints (health, version, server info), the Prometheus
metric names k3pipe reads, its log format (:class:`k3pipe.engines.observe.LogPatterns`), the flags of the
stock version it was written against, how it reads its own arguments (parallel sizes, context
length, KV dtype, memory fraction), and its preflight rules.
"""

from __future__ import annotations

import difflib
import json
import re
import shlex
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from k3pipe.core.errors import SpecError
from k3pipe.core.secrets import (
    REDACTED,
    env_references,
    is_env_reference,
    is_secret_name,
    looks_like_key,
    resolve_env_references,
    scrub,
)
from k3pipe.engines.observe import EngineLogFacts, LogLine, LogPatterns, parse_engine_log

if TYPE_CHECKING:
    from k3pipe.schema.specs import ArmSpec, ExperimentSpec

__all__ = [
    "ArmContext",
    "Engine",
    "Finding",
    "FlagTable",
    "MetricWindow",
    "RenderedCommand",
    "Rule",
    "Severity",
    "is_secret_name",
    "load_flag_table",
    "parallel_product",
    "plain_int",
    "render_args",
]

_PLACEHOLDER = re.compile(r"\{(model|models\.[A-Za-z0-9_-]+)\}")


def _flag(key: str) -> str:
    return "--" + key.lstrip("-").replace("_", "-")


def _expand(value: str, models: Mapping[str, str]) -> str:
    def sub(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in models:
            known = ", ".join("{" + k + "}" for k in sorted(models)) or "none"
            raise SpecError(
                f"engine argument refers to {{{name}}}, which is not a model of this experiment; "
                f"known: {known} (declare it under extra_models)"
            )
        return models[name]

    return _PLACEHOLDER.sub(sub, value)


def _expand_all(value: Any, models: Mapping[str, str]) -> Any:
    """``value`` (a JSON-able argument) with the placeholders of every string in it replaced (a
    draft's '{models.NAME}' sits inside speculative_config)."""
    if isinstance(value, str):
        return _expand(value, models)
    if isinstance(value, Mapping):
        return {k: _expand_all(v, models) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_expand_all(v, models) for v in value]
    return value


def render_args(args: Mapping[str, Any], models: Mapping[str, str] | None = None) -> list[str]:
    """Render an argument mapping to command-line flags.

    ``tensor_parallel_size: 8`` -> ``--tensor-parallel-size 8``; ``True`` -> bare flag; ``False`` and
    ``None`` -> omitted; dicts -> compact JSON; lists -> the flag followed by each item. Strings (also
    inside a dict) may hold ``{model}`` / ``{models.NAME}``, replaced from ``models``.
    """
    models = models or {}
    out: list[str] = []
    for key, value in args.items():
        flag = _flag(str(key))
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, Mapping):
            out += [flag, json.dumps(_expand_all(value, models), separators=(",", ":"))]
        elif isinstance(value, list | tuple):
            out += [flag, *(_expand(str(v), models) for v in value)]
        else:
            out += [flag, _expand(str(value), models)]
    return out


def _shown(name: str, value: str) -> str:
    """A value as records show it: a secret-named one redacted (an ``{env.NAME}`` reference is kept:
    it is no secret), anything else scrubbed of registered secrets and key shapes."""
    if is_env_reference(value):
        return value
    if is_secret_name(name) or looks_like_key(value):
        return REDACTED
    return scrub(value)


class RenderedCommand(BaseModel):
    """The exact command line and environment an arm runs with, as recorded: an ``{env.NAME}``
    reference stays a reference here (:meth:`resolved` is the launch's own copy)."""

    model_config = ConfigDict(frozen=True)

    argv: list[str] = Field(description="Program and arguments.")
    env: dict[str, str] = Field(description="Environment variables set for the engine (from the spec).")

    def redacted_env(self) -> dict[str, str]:
        return {k: _shown(k, v) for k, v in self.env.items()}

    def redacted_argv(self) -> list[str]:
        out: list[str] = []
        flag = ""
        for token in self.argv:
            if token.startswith("--") and "=" in token:  # --api-key=VALUE
                name, value = token.split("=", 1)
                out.append(f"{name}={_shown(name, value)}")
                flag = ""
                continue
            if token.startswith("--"):
                out.append(scrub(token))
                flag = token
            else:
                out.append(_shown(flag, token))
                flag = ""
        return out

    def references(self) -> list[tuple[str, str]]:
        """Every ``{env.NAME}`` of the command as ``(field, NAME)``: ``engine.env.KEY`` for the
        environment, ``engine.args (--flag)`` for an argument."""
        found = [(f"engine.env.{k}", name) for k, v in self.env.items() for name in env_references(v)]
        flag = ""
        for token in self.argv:
            where = f"engine.args ({flag})" if flag else "engine.executable"
            found += [(where, name) for name in env_references(token)]
            flag = token.split("=", 1)[0] if token.startswith("--") else ""
        return found

    def resolved(self, lookup: Callable[[str], str | None]) -> RenderedCommand:
        """The command the engine is started with: every ``{env.NAME}`` replaced by ``lookup(NAME)``
        (:class:`k3pipe.core.secrets.UnsetVariable` when one is unset). Never record this copy."""
        return RenderedCommand(
            argv=[resolve_env_references(t, lookup) for t in self.argv],
            env={k: resolve_env_references(v, lookup) for k, v in self.env.items()},
        )

    def shell(self) -> str:
        """A copy-pasteable shell line (secrets redacted)."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.redacted_env().items())
        cmd = shlex.join(self.redacted_argv())
        return f"{env} {cmd}" if env else cmd


Severity = Literal["error", "warning", "info"]


class Finding(BaseModel):
    """One preflight finding: how bad, which rule, which arm, and what to change."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    severity: Severity = Field(description="error: the run cannot work; warning: it will mislead; info.")
    rule: str = Field(description="Rule id, e.g. 'vllm-dcp-speculation'.")
    arm: str | None = Field(description="Arm the finding is about (None: the whole experiment).")
    message: str = Field(description="The settings involved, their values, and the choice or fix.")


@dataclass(frozen=True)
class ArmContext:
    """What a preflight rule sees of one arm."""

    experiment: ExperimentSpec
    arm: ArmSpec
    engine: Engine
    model_config: Mapping[str, Any] | None = None
    """The model's config.json, when known."""
    weight_bytes: int | None = None
    """Total size of the model's weights, when known."""

    @property
    def args(self) -> Mapping[str, Any]:
        return self.arm.engine.args

    def finding(self, severity: Severity, rule: str, message: str) -> Finding:
        return Finding(severity=severity, rule=rule, arm=self.arm.name, message=message)


Rule = Callable[[ArmContext], Iterable[Finding]]
"""A preflight rule: an arm in, findings out (none when the rule does not apply)."""


@dataclass(frozen=True)
class FlagTable:
    """The command-line options of one stock engine version (from ``engines/data/<file>``)."""

    source: str
    canonical: Mapping[str, str]
    """Every option string -> the first long name of its argparse action."""

    @property
    def flags(self) -> frozenset[str]:
        return frozenset(self.canonical)


@cache
def load_flag_table(filename: str) -> FlagTable:
    """Read ``k3pipe/engines/data/<filename>``: one argparse action per line, its option strings."""
    text = resources.files("k3pipe.engines").joinpath("data", filename).read_text()
    canonical: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        options = line.split()
        for option in options:
            canonical[option] = options[0]
    return FlagTable(source=f"k3pipe/engines/data/{filename}", canonical=canonical)


def plain_int(value: Any) -> int:
    """An integer argument without suffixes (ValueError otherwise; booleans are not integers)."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not an integer")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return int(str(value).strip())


def parallel_product(sizes: Mapping[str, int]) -> tuple[int, str]:
    """The product of an engine's parallel sizes and how it was made: the sizes above 1, named
    (``{'tensor_parallel_size': 2, 'pipeline_parallel_size': 1}`` -> ``(2, 'tensor_parallel_size
    2')``); the first size alone where every one is 1."""
    count = 1
    for size in sizes.values():
        count *= size
    named = [f"{name} {size}" for name, size in sizes.items() if size != 1]
    first = next(iter(sizes.items()), ("parallel size", 1))
    return count, " x ".join(named) or f"{first[0]} {first[1]}"


class MetricWindow(Protocol):
    """The engine's ``/metrics`` over one workload window, as :meth:`Engine.speculation_figures`
    reads it (built by :func:`k3pipe.machine.metrics.engine_side_summary`)."""

    def delta(self, key: str) -> float | None:
        """Counter ``metric_names[key]``: last minus first scrape (None: absent, or it reset)."""

    def gauge_mean(self, name: str) -> float | None:
        """Gauge ``name`` (a Prometheus name): its mean over the window's scrapes."""

    def delta_by_label(self, name: str, label: str) -> dict[str, float]:
        """Counter ``name`` split by the value of ``label``: last minus first scrape per value."""


class Engine:
    """Base of the engine modules: everything engine-specific lives in a subclass."""

    kind: ClassVar[str]
    default_port: ClassVar[int]
    model_flag: ClassVar[str]
    health_path: ClassVar[str] = "/health"
    """The path k3pipe polls until the engine is up."""
    health_paths: ClassVar[tuple[str, ...]] = ("/health",)
    """Every health path the engine serves."""
    watch_path: ClassVar[str | None] = None
    """The path the engine watch probes while a workload runs (k3pipe.bench.watch), where the health
    path does not answer at once from a busy engine: one its HTTP server answers without waiting for
    the model's scheduler, asked with the endpoint's key (None: the health path, asked without)."""
    version_path: ClassVar[str | None] = None
    server_info_path: ClassVar[str | None] = None
    """Path reporting the resolved server configuration, if the engine has one."""
    api_key_env_var: ClassVar[str | None] = None
    """Environment variable through which the engine itself takes its API key, if any."""
    api_key_flag: ClassVar[str | None] = None
    """The flag through which the engine takes its API key, for an engine with no such variable
    (SGLang's ``--api-key``): the plan renders ``FLAG {env.NAME}`` for the variable
    ``endpoint.api_key_env`` names, so the record holds the reference and only the launch the key."""
    prefix_cache_reset_path: ClassVar[str | None] = None
    """The path a POST to which empties the engine's prefix cache (None: it offers none)."""
    python_package: ClassVar[str | None] = None
    """The engine's import name, whose version the node record reads from the arm's interpreter."""
    compile_cache_env_var: ClassVar[str | None] = None
    """Environment variable pointing the engine at its compile cache (None: k3pipe keeps none)."""
    compile_cache_mount: ClassVar[str] = "/k3pipe/cache"
    """Where a docker arm's compile cache is mounted inside the container."""
    compile_cache_subdirs: ClassVar[Mapping[str, str]] = {}
    """Further variables for the caches the engine's libraries keep apart (JIT kernels, Triton):
    variable -> subdirectory of the compile cache, so that one directory per configuration holds all."""
    compile_cache_logged: ClassVar[bool] = True
    """The engine's log says whether it compiled and whether it loaded from the cache (vLLM). False:
    k3pipe tells from the files in the cache directory, older or newer than the launch."""

    display_name: ClassVar[str] = ""
    stock_version: ClassVar[str] = ""
    """The stock release the engine module (flags, log formats, metric names) was written against."""
    flags_file: ClassVar[str | None] = None
    """File under engines/data with the stock release's flags (None: no flag check)."""

    metric_names: ClassVar[Mapping[str, str]] = {}
    """k3pipe's metric names -> the engine's Prometheus names (histograms by family name; counters
    with their ``_total`` sample name). A name the engine does not export is absent."""

    readiness_pattern: ClassVar[re.Pattern[str]]
    """The log message (prefix removed) that marks the engine ready to serve."""
    log_patterns: ClassVar[LogPatterns]

    # Argument names (field spelling, aliases resolved through the flag table).
    tp_arg: ClassVar[str] = "tensor_parallel_size"
    pp_arg: ClassVar[str] = "pipeline_parallel_size"
    dcp_arg: ClassVar[str] = "decode_context_parallel_size"
    context_length_arg: ClassVar[str] = "max_model_len"
    kv_cache_dtype_arg: ClassVar[str] = "kv_cache_dtype"
    memory_fraction_arg: ClassVar[str] = "gpu_memory_utilization"
    memory_fraction_default: ClassVar[float | None] = None
    speculation_arg: ClassVar[str] = "speculative_config"
    int_args: ClassVar[tuple[str, ...]] = ()
    """Further integer arguments preflight checks the spelling of (with :meth:`parse_int`)."""

    kv_shortfall_consequence: ClassVar[str] = ""
    """What the engine does when its KV pool cannot hold one context-length request."""
    no_kv_memory_error: ClassVar[str] = ""
    """The error the engine stops with when no memory is left for its KV pool ('' unknown)."""

    @property
    def stock_label(self) -> str:
        return f"stock {self.display_name or self.kind} {self.stock_version}".rstrip()

    def managed_args(self, model_dir: str, served_name: str | None, host: str, port: int | str) -> list[str]:
        """Flags k3pipe owns: the model, the served name, host and port."""
        out = [self.model_flag, model_dir]
        if served_name:
            out += ["--served-model-name", served_name]
        return [*out, "--host", host, "--port", str(port)]

    def key_args(self, api_key_env: str | None, args: Mapping[str, Any]) -> list[str]:
        """The flag and ``{env.NAME}`` reference that give the engine the endpoint's key, for an engine
        that takes it only as an argument (:attr:`api_key_flag`); [] otherwise. ``args`` (the spec's)
        must not set that flag too."""
        if self.api_key_flag is None or self.api_key_env_var is not None or not api_key_env:
            return []
        for key in args:
            if _flag(str(key)) == self.api_key_flag:
                raise SpecError(
                    f"engine.args.{key}: {self.display_name} gets {self.api_key_flag} from "
                    f"endpoint.api_key_env ({api_key_env}); remove engine.args.{key} (a key written in "
                    "the file is recorded, one read from the variable is not)"
                )
        return [self.api_key_flag, "{env." + api_key_env + "}"]

    def check_args(self, args: Mapping[str, Any]) -> None:
        managed = {self.model_flag, "--served-model-name", "--host", "--port"}
        where = {
            self.model_flag: "model",
            "--served-model-name": "model.served_name",
            "--host": "launcher.host",
            "--port": "launcher.port",
        }
        for key in args:
            flag = _flag(str(key))
            if flag in managed:
                raise SpecError(f"engine.args.{key}: {flag} is set by k3pipe; set {where[flag]} instead")

    def compiles_with(self, args: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
        """The engine arguments and spec environment that can change what the engine compiles: they go
        into the compile-cache key. Default: all of them; engines leave out what cannot matter."""
        return {"args": dict(args), "env": dict(env)}

    def version_from(self, payload: Any) -> str | None:
        """The engine version out of the version endpoint's JSON."""
        if isinstance(payload, dict) and isinstance(payload.get("version"), str):
            return str(payload["version"])
        return None

    # -- flags ------------------------------------------------------------------------------------

    def flag_table(self) -> FlagTable | None:
        return load_flag_table(self.flags_file) if self.flags_file else None

    def flag_of(self, key: str) -> str:
        """The flag an ``engine.args`` key renders to (as :func:`render_args` does)."""
        return _flag(key)

    def canonical_flag(self, key: str) -> str | None:
        """The stock flag an args key means, None if none: aliases and short forms resolved, and an
        unambiguous prefix taken as argparse takes it (``allow_abbrev``, on in both engines)."""
        table = self.flag_table()
        if table is None:
            return _flag(key)
        for candidate in (_flag(key), "-" + key.lstrip("-")):
            if candidate in table.canonical:
                return table.canonical[candidate]
        flag = _flag(key)
        longer = {table.canonical[f] for f in table.flags if f.startswith(flag) and f.startswith("--")}
        return longer.pop() if len(longer) == 1 else None

    def flag_suggestions(self, key: str) -> list[str]:
        """Stock flags an unknown key may have meant: flags it abbreviates (argparse accepts an
        unambiguous prefix), then close spellings."""
        table = self.flag_table()
        if table is None:
            return []
        flag = _flag(key)
        longs = sorted(f for f in table.flags if f.startswith("--"))
        prefixed = [f for f in longs if f.startswith(flag)]
        close = difflib.get_close_matches(flag, longs, n=3, cutoff=0.75)
        return list(dict.fromkeys([*prefixed[:3], *close]))

    # -- reading the arm's own arguments ----------------------------------------------------------

    def arg(self, args: Mapping[str, Any], name: str) -> tuple[str, Any] | None:
        """``(key as written, value)`` of the argument ``name`` (field spelling) under any of its
        spellings or aliases, None when absent."""
        target = self.canonical_flag(name) or _flag(name)
        for key, value in args.items():
            if self.canonical_flag(str(key)) == target or _flag(str(key)) == _flag(name):
                return str(key), value
        return None

    def parse_int(self, value: Any) -> int:
        """An integer argument as the engine's argument parser reads it (ValueError if it refuses)."""
        return plain_int(value)

    def int_arg(self, args: Mapping[str, Any], name: str) -> int | None:
        found = self.arg(args, name)
        if found is None or found[1] is None:
            return None
        return self.parse_int(found[1])

    def _size(self, args: Mapping[str, Any], name: str) -> int:
        try:
            return self.int_arg(args, name) or 1
        except ValueError:
            return 1

    def tensor_parallel_size(self, args: Mapping[str, Any]) -> int:
        return self._size(args, self.tp_arg)

    def pipeline_parallel_size(self, args: Mapping[str, Any]) -> int:
        return self._size(args, self.pp_arg)

    def decode_context_parallel_size(self, args: Mapping[str, Any]) -> int:
        return self._size(args, self.dcp_arg)

    def parallel_gpus(self, args: Mapping[str, Any]) -> tuple[int, str]:
        """How many of the node's GPUs the engine's ranks take by its parallel sizes, and the product
        that gives it ('tensor_parallel_size 2 x pipeline_parallel_size 2'): the arm's GPU count where
        its launch names no devices. Default: tensor x pipeline parallel."""
        return parallel_product(
            {self.tp_arg: self.tensor_parallel_size(args), self.pp_arg: self.pipeline_parallel_size(args)}
        )

    def _per_node(self, args: Mapping[str, Any], count: int, text: str) -> tuple[int, str]:
        """``count`` ranks spread over ``nnodes`` nodes (both engines' flag): this node's share."""
        nodes = self._size(args, "nnodes")
        if nodes > 1 and count % nodes == 0:
            return count // nodes, f"({text}) / nnodes {nodes}"
        return count, text

    def _device_list(self, args: Mapping[str, Any], name: str) -> tuple[list[str], str] | None:
        """A comma-separated (or list) argument of device ids, and how it was written."""
        found = self.arg(args, name)
        if found is None or found[1] is None or found[1] is False:
            return None
        key, value = found
        items = value if isinstance(value, list | tuple) else str(value).split(",")
        ids = [str(v).strip() for v in items if str(v).strip()]
        return (ids, f"engine.args.{key}={','.join(ids)}") if ids else None

    def device_picks(self, args: Mapping[str, Any]) -> tuple[list[str], str] | None:
        """The devices the engine's own arguments choose among those it sees (an index into them, or
        a UUID), and those arguments as written; None where they choose none (the engine then takes
        the first of the devices it sees, as many as :meth:`parallel_gpus`)."""
        return None

    def context_length(self, args: Mapping[str, Any]) -> int | None:
        """The declared context length (None: taken from the model); ValueError if unparseable."""
        return self.int_arg(args, self.context_length_arg)

    def kv_cache_dtype(self, args: Mapping[str, Any]) -> str:
        found = self.arg(args, self.kv_cache_dtype_arg)
        return str(found[1]) if found and found[1] is not None else "auto"

    def memory_fraction(self, args: Mapping[str, Any]) -> float | None:
        """The fraction of each GPU's memory the engine takes for weights + KV (None: engine decides)."""
        found = self.arg(args, self.memory_fraction_arg)
        if found is None or found[1] is None:
            return self.memory_fraction_default
        return float(found[1])

    def kv_budget_bytes_per_gpu(
        self, args: Mapping[str, Any], gpu_memory_bytes: float, weight_bytes_per_gpu: float
    ) -> tuple[float, str] | None:
        """Bytes per GPU left for the KV pool, and how they were worked out (None: cannot tell).

        Default: ``memory_fraction x GPU memory - weights per GPU``.
        """
        fraction = self.memory_fraction(args)
        if fraction is None:
            return None
        budget = fraction * gpu_memory_bytes - weight_bytes_per_gpu
        how = (
            f"{self.memory_fraction_arg}={fraction:g} x {gpu_memory_bytes / 2**30:.2f} GiB "
            f"- {weight_bytes_per_gpu / 2**30:.2f} GiB weights per GPU = {budget / 2**30:.2f} GiB"
        )
        return budget, how

    def model_references(self, args: Mapping[str, Any]) -> list[tuple[str, str]]:
        """Further models the arguments make the engine load, as ``(argument path, value)``, e.g.
        ``('speculative_config.model', 'org/draft')``: a value that is not a '{models.NAME}'
        placeholder is fetched by the engine itself, unpinned and unhashed (engines override)."""
        return []

    def unpinned_models(self, args: Mapping[str, Any]) -> list[tuple[str, str]]:
        """The :meth:`model_references` that k3pipe does not fetch: not a '{model}' or
        '{models.NAME}' placeholder (a hub id or a path the engine resolves itself)."""
        return [(path, value) for path, value in self.model_references(args) if "{model" not in value]

    def speculation_figures(self, window: MetricWindow) -> dict[str, float]:
        """Speculative decoding over one workload window (``engine_spec_*``), from the engine's
        own metrics; {} when it exports none (engines override)."""
        return {}

    def kv_pool_cap(self, args: Mapping[str, Any]) -> tuple[int, str] | None:
        """A setting that caps the KV pool below what the memory budget gives: ``(tokens, how it
        reads)`` (None: none set; engines override)."""
        return None

    def kv_pool_fixes(self, args: Mapping[str, Any]) -> list[str]:
        """The settings to change for a bigger KV pool (engines override)."""
        return []

    def speculation(self, args: Mapping[str, Any]) -> str | None:
        """The speculative-decoding setting as written (None: no speculation)."""
        found = self.arg(args, self.speculation_arg)
        if found is None or found[1] in (None, False, "", {}):
            return None
        value = found[1]
        shown = json.dumps(value, separators=(",", ":")) if isinstance(value, Mapping) else str(value)
        return f"{found[0]}={shown}"

    # -- logs and preflight -----------------------------------------------------------------------

    def parse_log(self, lines: Iterable[str]) -> EngineLogFacts:
        """The facts of a start-up + serving log (see :class:`k3pipe.engines.observe.EngineLogFacts`)."""
        return parse_engine_log(lines, self.kind, self.log_patterns, self.derive_log_warnings)

    def derive_log_warnings(self, lines: Sequence[LogLine]) -> list[str]:
        """Warnings that no single line states; engines override."""
        return []

    def preflight_rules(self) -> tuple[Rule, ...]:
        """The engine-specific preflight rules (the generic ones live in k3pipe.experiment.preflight)."""
        return ()
