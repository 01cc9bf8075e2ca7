"""Variants as code: an experiment is a baseline, and each of its ``variants:`` a named change of it.

:func:`resolve` turns a variant into an experiment of its own: the baseline restricted to the arms
the variant names, each arm's engine arguments and environment laid over (a null removes a key),
every workload's fields laid over, the whole validated again as an experiment (so a bad override is
refused with the field named). Its name is ``<experiment>@<variant>``, so its runs stand apart from
the baseline's in MLflow while keeping the arm and workload names the comparison pairs them by.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from k3pipe.core.errors import SpecError
from k3pipe.experiment.load import parse_experiment
from k3pipe.schema.specs import ExperimentSpec, VariantSpec

__all__ = ["changes", "resolve", "variant"]


def variant(spec: ExperimentSpec, name: str) -> VariantSpec:
    for v in spec.variants:
        if v.name == name:
            return v
    known = ", ".join(v.name for v in spec.variants) or "(none)"
    raise SpecError(f"experiment {spec.name!r} has no variant {name!r}; its variants: {known}")


def _over(base: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in changes.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def resolve(spec: ExperimentSpec, name: str) -> ExperimentSpec:
    """The experiment variant ``name`` of ``spec`` runs (see the module's docstring)."""
    v = variant(spec, name)
    data = spec.model_dump(mode="json", exclude={"variants"})
    data["name"] = f"{spec.name}@{v.name}"
    data["description"] = v.description or f"variant {v.name} of {spec.name}"
    arms = []
    for arm in data["arms"]:
        override = v.arms.get(arm["name"])
        if override is None:
            continue
        engine = arm["engine"]
        engine["args"] = _over(engine.get("args") or {}, override.args)
        engine["env"] = _over(engine.get("env") or {}, override.env)
        if override.image is not None:
            engine["image"] = override.image
        if override.version is not None:
            engine["version"] = override.version
        arms.append(arm)
    data["arms"] = arms
    if data.get("fleet"):  # the placement of the arms the variant runs
        kept = {a["name"] for a in arms}
        data["fleet"]["arms"] = {a: p for a, p in data["fleet"]["arms"].items() if a in kept}
    data["workloads"] = [_over(w, v.workloads) for w in data["workloads"]]
    return parse_experiment(data, f"variant {v.name!r} of experiment {spec.name!r}")


def changes(spec: ExperimentSpec, name: str) -> list[str]:
    """What the variant changes, one line each: 'vllm: args.long_prefill_token_threshold 4096'."""
    v = variant(spec, name)
    lines = []

    def shown(value: Any) -> str:
        return "removed" if value is None else repr(value)

    for arm, o in v.arms.items():
        parts = [f"args.{k} {shown(val)}" for k, val in o.args.items()]
        parts += [f"env.{k} {shown(val)}" for k, val in o.env.items()]
        parts += [f"image {o.image}"] if o.image else []
        parts += [f"version {o.version}"] if o.version else []
        lines.append(f"{arm}: {', '.join(parts) if parts else 'as in the baseline'}")
    if v.workloads:
        lines.append("every workload: " + ", ".join(f"{k} {val!r}" for k, val in v.workloads.items()))
    return lines
