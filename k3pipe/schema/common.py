"""What every spec shares: the limits and why (LIMIT_REASONS), the safe-name rule, the base model
(frozen, no unknown field) and the checks of engine arguments, secrets, URLs and paths.

Part of the experiment's schema; :mod:`k3pipe.schema.specs` re-exports every name."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from k3pipe.core import secrets
from k3pipe.schema.launcher_specs import check_http_url as _check_base_url

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
