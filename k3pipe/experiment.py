"""Loading an experiment: YAML into :class:`~k3pipe.specs.ExperimentSpec`, with errors that name the
file, the field path, the value and the choices, and the checks that need the engine registry (an
engine kind must be one of :func:`k3pipe.engines.engine_kinds`). The spec models themselves import no
engine; this module sits above both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from k3pipe import secrets
from k3pipe.engines import engine_kinds
from k3pipe.errors import SpecError
from k3pipe.launchers.kinds import LAUNCHER_SPECS
from k3pipe.settings import env_value
from k3pipe.specs import (
    DocumentsDataset,
    ExperimentSpec,
    LocalModel,
    ModelScopeModel,
    RandomDataset,
    SharedPrefixDataset,
    ShareGPTDataset,
)

__all__ = ["load_experiment", "load_experiment_text", "parse_experiment", "register_experiment_secrets"]


# The tag of each discriminated-union member, as pydantic puts it in an error's location.
_UNION_TAGS: dict[str, type[BaseModel]] = {
    "modelscope": ModelScopeModel,
    "local": LocalModel,
    "random": RandomDataset,
    "sharegpt": ShareGPTDataset,
    "documents": DocumentsDataset,
    "shared_prefix": SharedPrefixDataset,
    **LAUNCHER_SPECS,
}


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _UNION_TAGS and out.endswith(("model", "]", "dataset", "launcher")):
            # discriminated-union tag pydantic puts in the location: not a field of the file
            continue
        else:
            out += f".{part}" if out else str(part)
    return out or "(top level)"


def _fields_at(loc: tuple[int | str, ...]) -> list[str] | None:
    """Field names allowed at the parent of ``loc`` (for 'extra field' errors)."""
    model: Any = ExperimentSpec
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        if part in _UNION_TAGS:
            model = _UNION_TAGS[part]
            continue
        fields = getattr(model, "model_fields", None)
        if not fields or part not in fields:
            return None
        ann = fields[part].annotation
        inner = _model_in(ann)
        if inner is None:
            return None
        model = inner
    fields = getattr(model, "model_fields", None)
    return sorted(fields) if fields else None


def _other_kinds_with(loc: tuple[int | str, ...]) -> list[str]:
    """For an unknown field under a union member (e.g. ``gpus`` of a process launcher): the tags of
    the sibling members that do have it (['docker'])."""
    tags = [p for p in loc[:-1] if isinstance(p, str) and p in _UNION_TAGS]
    if not tags:
        return []
    here = _UNION_TAGS[tags[-1]]
    family = [
        t for t, m in _UNION_TAGS.items() if m.model_fields.keys() & here.model_fields.keys() >= {"kind"}
    ]
    name = str(loc[-1])
    return [t for t in family if t != tags[-1] and name in _UNION_TAGS[t].model_fields]


def _model_in(ann: Any) -> Any:
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann
    for arg in getattr(ann, "__args__", ()) or ():
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _engine_kind_problems(data: dict[str, Any]) -> list[str]:
    """'arms[i].engine.kind: ...' for each arm whose engine kind is not a registered engine."""
    kinds = engine_kinds()
    out = []
    arms = data.get("arms")
    for i, arm in enumerate(arms if isinstance(arms, list) else []):
        engine = arm.get("engine") if isinstance(arm, dict) else None
        kind = engine.get("kind") if isinstance(engine, dict) else None
        if isinstance(kind, str) and kind not in kinds:
            out.append(
                f"  {_loc(('arms', i, 'engine', 'kind'))}: unknown engine kind {kind!r}; expected one of "
                f"{', '.join(kinds)} (got {kind!r})"
            )
    return out


def _format_errors(source: str, exc: ValidationError | None, extra: list[str] | None = None) -> str:
    extra = extra or []
    count = (exc.error_count() if exc is not None else 0) + len(extra)
    lines = [f"{source}: invalid experiment ({count} problem(s))"]
    for err in exc.errors() if exc is not None else []:
        loc = _loc(tuple(err["loc"]))
        value = err.get("input")
        if err["type"] == "extra_forbidden":
            allowed = _fields_at(tuple(err["loc"]))
            hint = f"; allowed fields: {', '.join(allowed)}" if allowed else ""
            others = _other_kinds_with(tuple(err["loc"]))
            if others:
                hint += f" (it is a field of kind {' or '.join(repr(o) for o in others)}: set kind to use it)"
            lines.append(f"  {loc}: unknown field{hint}")
            continue
        if err["type"] == "missing":
            lines.append(f"  {loc}: required field is missing")
            continue
        if err["type"] == "union_tag_invalid":
            ctx = err.get("ctx") or {}
            field = str(ctx.get("discriminator", "")).strip("'")
            field = field if field.isidentifier() else "kind"  # a callable discriminator reads 'kind'
            tags = [t.strip() for t in str(ctx.get("expected_tags", "")).split(",")]
            choices = ", ".join(tags[:-1]) + f" or {tags[-1]}" if len(tags) > 1 else tags[0]
            lines.append(f"  {loc}.{field}: unknown {field} {ctx.get('tag')!r}; expected {choices}")
            continue
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"  {loc}: {msg} (got {_shown(err['loc'], value)})")
    lines += extra
    return "\n".join(lines)


def _shown(loc: Any, value: Any) -> str:
    """A value as an error shows it: a secret (by its field's name or its shape) masked, a URL
    without its credentials."""
    if isinstance(value, dict | list):
        return type(value).__name__
    names = [str(p) for p in loc if isinstance(p, str)]
    if isinstance(value, str) and (
        (names and secrets.is_secret_name(names[-1]) and not secrets.is_env_reference(value))
        or secrets.looks_like_key(value)
    ):
        return secrets.mask(value)
    return secrets.scrub(repr(value))


def register_experiment_secrets(data: Any) -> None:
    """Register with the scrubber every secret the experiment data holds (see
    :func:`k3pipe.secrets.collect_secrets`), the values of its ``{env.NAME}`` references included."""
    secrets.register_all(secrets.collect_secrets(data, env_value))


def parse_experiment(data: Any, source: str = "<experiment>") -> ExperimentSpec:
    """Validate already-parsed YAML/JSON data; errors name ``source``, field path, value and choices.
    Its secrets are registered with the scrubber first (:func:`register_experiment_secrets`), so
    that no error, log or record of it shows one."""
    if not isinstance(data, dict):
        raise SpecError(f"{source}: an experiment must be a mapping, got {type(data).__name__}")
    register_experiment_secrets(data)
    kinds = _engine_kind_problems(data)
    try:
        spec = ExperimentSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(_format_errors(source, exc, kinds)) from exc
    if kinds:
        raise SpecError(_format_errors(source, None, kinds))
    return spec


def load_experiment_text(text: str, source: str = "<experiment>") -> ExperimentSpec:
    """Load an experiment from YAML text (pasted into a form, say); errors name ``source``."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SpecError(f"{source}: not valid YAML: {exc}") from exc
    return parse_experiment(data, source)


def load_experiment(path: str | Path) -> ExperimentSpec:
    """Load an experiment YAML file."""
    p = Path(path)
    try:
        text = p.read_text()
    except (FileNotFoundError, IsADirectoryError) as exc:
        where = "" if p.is_absolute() else f" (relative to {Path.cwd()})"
        raise SpecError(f"{p}: experiment file not found{where}") from exc
    return load_experiment_text(text, str(p))
