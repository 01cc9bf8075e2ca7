"""What every engine module provides, and the argument rendering they share."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from k3pipe.errors import SpecError

__all__ = ["Engine", "RenderedCommand", "is_secret_name", "render_args"]

_SECRET_WORDS = {"key", "apikey", "token", "secret", "password", "passwd", "credential", "credentials"}
_PLACEHOLDER = re.compile(r"\{(model|models\.[A-Za-z0-9_-]+)\}")
REDACTED = "***"


def is_secret_name(name: str) -> bool:
    """Whether an environment variable or flag name looks like it carries a secret."""
    return any(word in _SECRET_WORDS for word in re.split(r"[-_.]+", name.lower()))


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


def render_args(args: Mapping[str, Any], models: Mapping[str, str] | None = None) -> list[str]:
    """Render an argument mapping to command-line flags.

    ``tensor_parallel_size: 8`` -> ``--tensor-parallel-size 8``; ``True`` -> bare flag; ``False`` and
    ``None`` -> omitted; dicts -> compact JSON; lists -> the flag followed by each item. String values
    may hold ``{model}`` / ``{models.NAME}``, replaced from ``models``.
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
            out += [flag, json.dumps(value, separators=(",", ":"))]
        elif isinstance(value, list | tuple):
            out += [flag, *(_expand(str(v), models) for v in value)]
        else:
            out += [flag, _expand(str(value), models)]
    return out


class RenderedCommand(BaseModel):
    """The exact command line and environment an arm runs with."""

    model_config = ConfigDict(frozen=True)

    argv: list[str] = Field(description="Program and arguments.")
    env: dict[str, str] = Field(description="Environment variables set for the engine (from the spec).")

    def redacted_env(self) -> dict[str, str]:
        return {k: (REDACTED if is_secret_name(k) else v) for k, v in self.env.items()}

    def redacted_argv(self) -> list[str]:
        out: list[str] = []
        hide = False
        for token in self.argv:
            out.append(REDACTED if hide else token)
            hide = token.startswith("--") and is_secret_name(token)
        return out

    def shell(self) -> str:
        """A copy-pasteable shell line (secrets redacted)."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.redacted_env().items())
        cmd = shlex.join(self.redacted_argv())
        return f"{env} {cmd}" if env else cmd


class Engine:
    """Base of the engine modules: everything engine-specific lives in a subclass."""

    kind: ClassVar[str]
    default_port: ClassVar[int]
    model_flag: ClassVar[str]
    health_path: ClassVar[str] = "/health"
    version_path: ClassVar[str | None] = None
    api_key_env_var: ClassVar[str | None] = None
    """Environment variable through which the engine itself takes its API key, if any."""

    def managed_args(self, model_dir: str, served_name: str | None, host: str, port: int) -> list[str]:
        """Flags k3pipe owns: the model, the served name, host and port."""
        out = [self.model_flag, model_dir]
        if served_name:
            out += ["--served-model-name", served_name]
        return [*out, "--host", host, "--port", str(port)]

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

    def version_from(self, payload: Any) -> str | None:
        """The engine version out of the version endpoint's JSON."""
        if isinstance(payload, dict) and isinstance(payload.get("version"), str):
            return str(payload["version"])
        return None
