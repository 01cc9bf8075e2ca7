"""Loading an experiment: YAML into :class:`~k3pipe.schema.specs.ExperimentSpec`, with errors that name the
file, the field path, the value and the choices, and the checks that need the engine registry (an
engine kind must be one of :func:`k3pipe.engines.engine_kinds`). The spec models themselves import no
engine; this module sits above both.

Every bad input is one :class:`~k3pipe.core.errors.SpecError`, never a traceback: a file that cannot be
read (missing, a directory, over :data:`MAX_FILE_BYTES`, not UTF-8 text), YAML that does not parse
(with its line and column; a key given twice is an error, not "the last wins"), values nested deeper
than :data:`MAX_DEPTH` or more than :data:`MAX_VALUES` of them, and every field the spec models
refuse. Field paths are the file's (``arms[0].launcher.gpus``), without pydantic's union member tags.
"""

from __future__ import annotations

import datetime
import math
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from k3pipe.core import secrets
from k3pipe.core.errors import SpecError
from k3pipe.core.settings import env_value
from k3pipe.engines import engine_kinds
from k3pipe.schema.launcher_specs import LAUNCHER_SPECS
from k3pipe.schema.specs import (
    LIMIT_REASONS,
    DocumentsDataset,
    ExperimentSpec,
    LocalModel,
    ModelScopeModel,
    RandomDataset,
    SharedPrefixDataset,
    ShareGPTDataset,
)

__all__ = [
    "MAX_DEPTH",
    "MAX_FILE_BYTES",
    "MAX_VALUES",
    "load_experiment",
    "load_experiment_text",
    "parse_experiment",
    "register_experiment_secrets",
]

MAX_FILE_BYTES = 10 * 2**20
"""The largest experiment file read (10 MiB): the largest real one is a few KiB."""
MAX_DEPTH = 64
"""The deepest nesting of lists and mappings taken (an experiment needs fewer than 10 levels)."""
MAX_VALUES = 1_000_000
"""The most values (mappings, lists and scalars, aliases counted each time) a file may hold."""
MAX_PROBLEMS_SHOWN = 20

_EXAMPLE = "experiments/demo-cpu.yaml"

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


# -- reading ----------------------------------------------------------------------------------------


def _line_col(data: bytes, pos: int) -> tuple[int, int]:
    line = data.count(b"\n", 0, pos) + 1
    start = data.rfind(b"\n", 0, pos) + 1
    return line, len(data[start:pos].decode("utf-8", errors="replace")) + 1


_BOMS = (
    (b"\xff\xfe\x00\x00", "UTF-32"),
    (b"\x00\x00\xfe\xff", "UTF-32"),
    (b"\xff\xfe", "UTF-16"),
    (b"\xfe\xff", "UTF-16"),
)


def _decode(data: bytes, source: str) -> str:
    """The file's text: UTF-8 (a UTF-8 byte-order mark is dropped), else a SpecError saying what it is."""
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            raise SpecError(
                f"{source}: the file is {encoding}-encoded (it starts with a {encoding} byte-order mark); "
                "experiment files are UTF-8: save it as UTF-8"
            )
    data = data.removeprefix(b"\xef\xbb\xbf")
    nul = data.find(b"\x00")
    if nul >= 0:
        line, col = _line_col(data, nul)
        raise SpecError(
            f"{source}: a NUL byte at line {line}, column {col}: this is binary content (or UTF-16 "
            "without a byte-order mark), not a YAML text file; give the experiment's YAML file, saved "
            "as UTF-8"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line, col = _line_col(data, exc.start)
        raise SpecError(
            f"{source}: byte 0x{data[exc.start]:02x} at line {line}, column {col} is not UTF-8 (the file "
            "looks Latin-1 or Windows-1252 encoded); save it as UTF-8"
        ) from exc


def _read(p: Path) -> str:
    where = "" if p.is_absolute() else f" (relative to {Path.cwd()})"
    try:
        if p.is_dir():
            found = sorted(f.name for f in p.glob("*.yaml"))
            more = f" and {len(found) - 3} more" if len(found) > 3 else ""
            inside = f"; YAML files in it: {', '.join(found[:3])}{more}" if found else ""
            raise SpecError(f"{p}: is a directory, not an experiment file{where}: give a YAML file{inside}")
        with p.open("rb") as fh:
            data = fh.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError as exc:
        raise SpecError(f"{p}: experiment file not found{where}") from exc
    except PermissionError as exc:
        raise SpecError(f"{p}: the experiment file cannot be read (permission denied)") from exc
    except (OSError, ValueError) as exc:  # ValueError: a NUL character in the path
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise SpecError(f"{p}: the experiment file cannot be read: {reason}") from exc
    if len(data) > MAX_FILE_BYTES:
        raise SpecError(
            f"{p}: the file is larger than {MAX_FILE_BYTES // 2**20} MiB, the most an experiment file may "
            "be (real ones are a few KiB): is it the right file?"
        )
    return _decode(data, str(p))


# -- YAML -------------------------------------------------------------------------------------------


_Base: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's parser: 5x faster


class _Loader(_Base):  # type: ignore[misc]
    """PyYAML's safe loader, refusing a key given twice in one mapping (YAML forbids it; PyYAML keeps
    the last value, silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                    continue
                key = self.construct_object(key_node)
                try:
                    first = seen.get(key)
                except TypeError:
                    continue  # unhashable: the base constructor says so
                seen.setdefault(key, key_node.start_mark.line + 1)
                if first is not None:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"key {key!r} is given twice in one mapping (first at line {first}); YAML keeps only "
                        "one value, so remove or rename one",
                        key_node.start_mark,
                    )
        return dict(super().construct_mapping(node, deep=deep))


def _yaml_error(exc: yaml.YAMLError, text: str, source: str) -> str:
    if isinstance(exc, yaml.reader.ReaderError):  # a character YAML does not allow
        line = text.count("\n", 0, exc.position) + 1
        col = exc.position - (text.rfind("\n", 0, exc.position) + 1) + 1
        char = f"U+{exc.character:04X}" if isinstance(exc.character, int) else repr(exc.character)
        return (
            f"{source}: not valid YAML at line {line}, column {col}: character {char} is not allowed "
            "in YAML (a control character); remove it"
        )
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    if problem == "exceeded maximum nesting depth":
        problem += f" (an experiment nests fewer than 10 levels; at most {MAX_DEPTH} are taken)"
    context = getattr(exc, "context", None)
    if mark is None:
        return f"{source}: not valid YAML: {problem}"
    line, col = mark.line + 1, mark.column + 1
    context_mark = getattr(exc, "context_mark", None)
    also = ""
    if context and context_mark is not None and context_mark.line != mark.line:
        also = f" ({context} at line {context_mark.line + 1})"
    lines = text.splitlines()
    snippet = f"\n  {line} | {lines[line - 1][:100]}" if 0 < line <= len(lines) else ""
    return f"{source}: not valid YAML at line {line}, column {col}: {problem}{also}{snippet}"


def _parse_yaml(text: str, source: str) -> Any:
    try:
        data = yaml.load(text, Loader=_Loader)  # a safe loader (no Python objects)
    except yaml.YAMLError as exc:
        raise SpecError(_yaml_error(exc, text, source)) from exc
    except RecursionError as exc:
        raise SpecError(
            f"{source}: values nested too deeply for the YAML parser; an experiment nests fewer than 10 "
            f"levels (at most {MAX_DEPTH} are taken)"
        ) from exc
    return data


def _check_shape(data: Any, source: str) -> None:
    """Depth, count and NUL characters of the parsed values, walked without recursion (later steps,
    pydantic and json among them, recurse)."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(data, ())]
    count = 0
    while stack:
        value, path = stack.pop()
        count += 1
        if count > MAX_VALUES:
            raise SpecError(
                f"{source}: more than {MAX_VALUES:,} values (with YAML aliases counted each time they are "
                "used): an experiment holds a few hundred; is the file generated, or an alias repeated?"
            )
        if len(path) > MAX_DEPTH:
            raise SpecError(
                f"{source}: values nested more than {MAX_DEPTH} levels deep (at {_path(path[:6])}...); an "
                "experiment nests fewer than 10: is a bracket left open?"
            )
        if isinstance(value, dict):
            for k, v in value.items():
                if isinstance(k, str) and "\x00" in k:
                    raise SpecError(f"{source}: {_path(path)}: a key holds a NUL character; remove it")
                stack.append((v, (*path, k)))
        elif isinstance(value, list):
            stack.extend((v, (*path, i)) for i, v in enumerate(value))
        elif isinstance(value, str) and "\x00" in value:
            raise SpecError(f"{source}: {_path(path)}: the value holds a NUL character; remove it")


def _path(parts: tuple[Any, ...]) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


# -- field paths in the file's terms -------------------------------------------------------------------


def _unwrap(ann: Any) -> Any:
    while get_origin(ann) is Annotated:
        ann = get_args(ann)[0]
    return ann


def _members(ann: Any) -> list[Any] | None:
    """The members of a union annotation, None dropped (None when ``ann`` is not a union)."""
    if get_origin(ann) not in (Union, types.UnionType):
        return None
    return [_unwrap(m) for m in get_args(ann) if m is not type(None)]


def _is_model(ann: Any) -> bool:
    return isinstance(ann, type) and issubclass(ann, BaseModel)


def _member_for(members: list[Any], tag: str) -> Any:
    """The union member pydantic's location ``tag`` stands for (None if not known)."""
    if tag in _UNION_TAGS and _UNION_TAGS[tag] in members:
        return _UNION_TAGS[tag]
    for m in members:
        if isinstance(m, type) and m.__name__ == tag:
            return m
        origin = get_origin(m)
        if origin is not None and tag.startswith(f"{origin.__name__}["):
            return m
    return None


def _walk(loc: tuple[Any, ...]) -> tuple[str, Any, bool]:
    """The file's path of pydantic's ``loc`` (union member tags dropped: 'int', 'list[str]',
    'function-after[...]', 'local', ...), the annotation there (None if not known) and whether the
    error is about a mapping's key."""
    ann: Any = ExperimentSpec
    out = ""
    key_error = False
    parts = list(loc)
    i = 0
    while i < len(parts):
        part = parts[i]
        ann = _unwrap(ann)
        members = _members(ann)
        if members is not None:
            if len(members) == 1:  # X | None: pydantic puts no tag
                ann = members[0]
                continue
            ann = _member_for(members, str(part))  # the part is a member's tag
            i += 1
            continue
        if part == "[key]":
            key_error = True
        elif get_origin(ann) is dict:
            out += f".{part}" if out else str(part)
            ann = get_args(ann)[1]
        elif isinstance(part, int) and get_origin(ann) is list:
            out += f"[{part}]"
            ann = get_args(ann)[0]
        elif isinstance(part, int) and not _is_model(ann):
            out += f"[{part}]"
            ann = None
        else:  # a field of a model (or a key the file gave where fields go)
            out += f".{part}" if out else str(part)
            fields = ann.model_fields if _is_model(ann) else {}
            ann = fields[part].annotation if part in fields else None
        i += 1
    return out or "(top level)", _unwrap(ann), key_error


def _loc(loc: tuple[int | str, ...]) -> str:
    return _walk(loc)[0]


def _model_at(loc: tuple[Any, ...]) -> Any:
    """The model whose field ``loc`` names (None if not known)."""
    ann = _walk(loc[:-1])[1]
    members = _members(ann)
    if members is not None and len(members) == 1:
        ann = members[0]
    return ann if _is_model(ann) else None


def _other_kinds_with(loc: tuple[int | str, ...]) -> tuple[str, list[str]]:
    """For an unknown field under a union member (e.g. ``gpus`` of a process launcher): the union's
    discriminator and the tags of the sibling members that do have the field (('kind', ['docker']))."""
    tags = [p for p in loc[:-1] if isinstance(p, str) and p in _UNION_TAGS]
    if not tags:
        return "kind", []
    here = _UNION_TAGS[tags[-1]]
    field = "source" if "source" in here.model_fields else "kind"
    family = [t for t, m in _UNION_TAGS.items() if field in m.model_fields and m is not here]
    name = str(loc[-1])
    return field, [t for t in family if name in _UNION_TAGS[t].model_fields]


def _tags_of(members: list[Any]) -> tuple[str, list[str]] | None:
    """The discriminator field of a union of models and its values: ('kind', ['process', ...])."""
    models = [m for m in members if _is_model(m)]
    if not models or len(models) != len(members):
        return None
    for field in ("kind", "source"):
        values: list[str] = []
        for m in models:
            info = m.model_fields.get(field)
            if info is None or get_origin(info.annotation) is not Literal:
                break
            values += [str(v) for v in get_args(info.annotation)]
        else:
            return field, values
    return None


def _choices(values: list[str]) -> str:
    return ", ".join(values[:-1]) + f" or {values[-1]}" if len(values) > 1 else values[0]


def _mapping_hint(ann: Any, value: Any) -> str:
    """What a model-typed field must look like, in the file's terms."""
    members = _members(ann)
    if members is not None and len(members) == 1:
        ann, members = members[0], None
    if members is not None:
        tags = _tags_of(members)
        if tags is None:
            return "must be a mapping"
        field, values = tags
        if LocalModel in members:
            return (
                "must be a mapping with `source: modelscope` (and id: OWNER/NAME) or `source: local` (and "
                "path: a model directory), e.g. {source: local, path: '{home}/models/tiny-llama'}"
            )
        example = (
            f"{{{field}: {value}}}"
            if isinstance(value, str) and value in values
            else f"{{{field}: {values[0]}}}"
        )
        return f"must be a mapping with {field}: {_choices(values)} (and that kind's fields), e.g. {example}"
    if _is_model(ann):
        required = [n for n, f in ann.model_fields.items() if f.is_required()]
        optional = [n for n, f in ann.model_fields.items() if not f.is_required()]
        if required:
            shown = ", ".join(optional[:5]) + (", ..." if len(optional) > 5 else "")
            more = f" (and optionally {shown})" if optional else ""
            return f"must be a mapping with {', '.join(required)}{more}"
        return f"must be a mapping with {'/'.join(optional)}"
    return "must be a mapping (key: value lines)"


def _number(value: Any) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return f"{value:,}" if isinstance(value, int) else f"{value:g}"


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, float) and not math.isfinite(value):
        return ".nan" if math.isnan(value) else (".inf" if value > 0 else "-.inf")
    if isinstance(value, float) and abs(value) >= 1e6:
        return f"{value:g}"
    if isinstance(value, datetime.date):
        return value.isoformat()
    text = secrets.scrub(repr(value))
    return text if len(text) <= 80 else text[:77] + "..."


_TYPE_WORDS = {
    "int_type": "expected a whole number",
    "int_parsing": "expected a whole number",
    "int_from_float": "expected a whole number",
    "float_type": "expected a number",
    "float_parsing": "expected a number",
    "bool_type": "expected true or false",
    "bool_parsing": "expected true or false",
    "string_type": "expected a string",
    "list_type": "expected a list",
    "dict_type": "expected a mapping (key: value lines)",
    "finite_number": "expected a finite number (not .inf or .nan)",
}


def _looks_numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _problem(err: Any, field: str, ann: Any, key_error: bool) -> tuple[str, bool]:
    """The problem in words and whether to show the value."""
    kind = err["type"]
    ctx = err.get("ctx") or {}
    value = err.get("input")
    if key_error or kind == "invalid_key":
        return f"the key {_shown(value)} must be a string (quote it)", False
    if kind in _TYPE_WORDS:
        words = _TYPE_WORDS[kind]
        if kind == "string_type" and value is not None and not isinstance(value, dict | list):
            words += f" (quote it: '{_shown(value)}')"  # YAML read it as a number, boolean or date
        elif kind in ("int_type", "float_type", "bool_type") and isinstance(value, bool):
            words += " (true/false is not a number)" if kind != "bool_type" else ""
        elif kind in ("int_type", "float_type") and isinstance(value, str) and _looks_numeric(value):
            if "e" in value.lower() and kind == "float_type":
                # YAML 1.1 reads 1e9 and 1.0e9 as text: its exponent needs a dot and a sign
                words += (
                    f" (YAML reads {value} as text: write the exponent with a dot and a sign, e.g. 1.0e+9)"
                )
            else:
                words += " (a quoted number is text: remove the quotes)"
        elif kind == "int_type" and isinstance(value, float):
            words += " (no fraction)"
        if kind == "list_type" and isinstance(value, dict) and field in ("arms", "workloads", "variants"):
            words += f": write each of the {field} as an item starting with '- name: ...'"
        return words, True
    if kind in ("model_type", "model_attributes_type", "union_tag_not_found"):
        if isinstance(value, dict):  # a mapping without the discriminator
            field = str(ctx.get("discriminator", "'kind'")).strip("'")
            field = field if field.isidentifier() else "kind"
            return f"{field} is missing: it {_mapping_hint(ann, value)}", False
        return _mapping_hint(ann, value), True
    if kind == "literal_error":
        return f"expected {ctx.get('expected')}", True
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        bound_key = {
            "greater_than": "gt",
            "greater_than_equal": "ge",
            "less_than": "lt",
            "less_than_equal": "le",
        }
        bound = _number(ctx.get(bound_key[kind]))
        words = {
            "greater_than": f"must be greater than {bound}",
            "greater_than_equal": f"must be greater than or equal to {bound}",
            "less_than": f"must be less than {bound}",
            "less_than_equal": f"must be at most {bound}",
        }[kind]
        if kind.startswith("less") and field in LIMIT_REASONS:
            words += f" ({LIMIT_REASONS[field]})"
        return words, True
    if kind == "too_short":
        need = ctx.get("min_length", 1)
        return f"needs at least {need} item{'s' if need != 1 else ''}", False
    if kind == "too_long":
        words = f"holds {_number(ctx.get('actual_length'))} items; at most {_number(ctx.get('max_length'))}"
        if field in LIMIT_REASONS:
            words += f" ({LIMIT_REASONS[field]})"
        return words, False
    if kind == "string_too_short":
        return "must not be empty", False
    msg = str(err["msg"]).removeprefix("Value error, ").removeprefix("Assertion failed, ")
    return msg, not isinstance(value, dict | list) and repr(value) not in msg


def _lines(exc: ValidationError) -> Iterator[str]:
    merged: list[tuple[str, list[str], str | None]] = []  # path, problems, value shown
    for err in exc.errors():
        loc = tuple(err["loc"])
        path, ann, key_error = _walk(loc)
        if err["type"] == "extra_forbidden":
            model = _model_at(loc)
            allowed = sorted(model.model_fields) if model is not None else []
            hint = f"; allowed fields: {', '.join(allowed)}" if allowed else ""
            field, others = _other_kinds_with(loc)
            if others:
                kinds = " or ".join(repr(o) for o in others)
                hint += f" (it is a field of {field} {kinds}: set {field} to use it)"
            merged.append((path, [f"unknown field{hint}"], None))
            continue
        if err["type"] == "missing":
            model = _model_at(loc)
            info = model.model_fields.get(str(loc[-1])) if model is not None else None
            about = f" ({info.description})" if info is not None and info.description else ""
            merged.append((path, [f"required field is missing{about}"], None))
            continue
        if err["type"] == "union_tag_invalid":
            ctx = err.get("ctx") or {}
            field = str(ctx.get("discriminator", "")).strip("'")
            field = field if field.isidentifier() else "kind"  # a callable discriminator reads 'kind'
            tags = [t.strip() for t in str(ctx.get("expected_tags", "")).split(",")]
            merged.append(
                (f"{path}.{field}", [f"unknown {field} {ctx.get('tag')!r}; expected {_choices(tags)}"], None)
            )
            continue
        field = path.rsplit(".", 1)[-1].split("[", 1)[0]
        problem, show = _problem(err, field, ann, key_error)
        value = err.get("input")
        shown = (_masked(err["loc"], value) or _shown(value)) if show else None
        if merged and merged[-1][0] == path and merged[-1][2] == shown and problem not in merged[-1][1]:
            merged[-1][1].append(problem.removeprefix("expected "))  # members of one union: either
            continue
        merged.append((path, [problem], shown))
    for path, problems, shown in merged:
        got = f" (got {shown})" if shown is not None else ""
        # a check of the whole experiment names its own fields (e.g. 'arms[0].engine.args.x: ...')
        where = (
            "" if path == "(top level)" and problems[0][:1].islower() and ": " in problems[0] else f"{path}: "
        )
        yield f"  {where}{' or '.join(problems)}{got}"


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
    lines = list(_lines(exc)) if exc is not None else []
    lines += extra or []
    head = f"{source}: invalid experiment ({len(lines)} problem(s))"
    if len(lines) > MAX_PROBLEMS_SHOWN:
        lines = [*lines[:MAX_PROBLEMS_SHOWN], f"  ... and {len(lines) - MAX_PROBLEMS_SHOWN} more"]
    return "\n".join([head, *lines])


# -- loading ----------------------------------------------------------------------------------------


def _masked(loc: Any, value: Any) -> str | None:
    """A secret value (by its field's name or its shape) as an error shows it, masked; None when the
    value is not one."""
    names = [str(p) for p in loc if isinstance(p, str)]
    if isinstance(value, str) and (
        (names and secrets.is_secret_name(names[-1]) and not secrets.is_env_reference(value))
        or secrets.looks_like_key(value)
    ):
        return secrets.mask(value)
    return None


def register_experiment_secrets(data: Any) -> None:
    """Register with the scrubber every secret the experiment data holds (see
    :func:`k3pipe.core.secrets.collect_secrets`), the values of its ``{env.NAME}`` references included."""
    secrets.register_all(secrets.collect_secrets(data, env_value))


def parse_experiment(data: Any, source: str = "<experiment>") -> ExperimentSpec:
    """Validate already-parsed YAML/JSON data; errors name ``source``, field path, value and choices.
    Its secrets are registered with the scrubber first (:func:`register_experiment_secrets`), so
    that no error, log or record of it shows one."""
    if data is None:
        raise SpecError(
            f"{source}: the experiment is empty; it needs name, model, arms and workloads (see {_EXAMPLE})"
        )
    if not isinstance(data, dict):
        what = "a list" if isinstance(data, list) else f"a single value, {_shown(data)},"
        raise SpecError(
            f"{source}: an experiment must be a mapping of fields (name, model, arms, workloads), got "
            f"{what} at the top level (see {_EXAMPLE})"
        )
    _check_shape(data, source)  # bounds the nesting, before anything walks the data
    register_experiment_secrets(data)
    kinds = _engine_kind_problems(data)
    try:
        spec = ExperimentSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(_format_errors(source, exc, kinds)) from exc
    except RecursionError as exc:  # data built in Python (not through load_experiment) nested too deeply
        raise SpecError(f"{source}: values nested too deeply (at most {MAX_DEPTH} levels)") from exc
    if kinds:
        raise SpecError(_format_errors(source, None, kinds))
    return spec


def load_experiment_text(text: str, source: str = "<experiment>") -> ExperimentSpec:
    """Load an experiment from YAML text (pasted into a form, say); errors name ``source``."""
    if len(text) > MAX_FILE_BYTES:
        raise SpecError(
            f"{source}: the text is longer than {MAX_FILE_BYTES // 2**20} MiB, the most an experiment may be"
        )
    if "\x00" in text:
        raise SpecError(f"{source}: the text holds a NUL character: binary content is not a YAML experiment")
    return parse_experiment(_parse_yaml(text.removeprefix("\ufeff"), source), source)


def load_experiment(path: str | Path) -> ExperimentSpec:
    """Load an experiment YAML file (UTF-8, at most :data:`MAX_FILE_BYTES`)."""
    p = Path(path)
    text = _read(p)
    return parse_experiment(_parse_yaml(text, str(p)), str(p))
