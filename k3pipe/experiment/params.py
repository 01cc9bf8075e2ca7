"""What a person asks a run for, as typed values: the experiment (a file on the worker, or its YAML
pasted inline), which arms and variants, and the workload fields changed most often, laid over every
workload of the experiment.

The flows take these as their parameters, so Prefect builds its run form from them (each field's
description under its input, its bounds checked by the server before any worker starts) and the
command line maps its options onto the same :class:`Overrides`. :func:`apply_overrides` lays the
overrides over an experiment and validates the result again as an experiment, so a combination the
file's own rules refuse (an ``input_tokens`` at or below a shared prefix, say) is refused with the
field named. :meth:`RunRequest.load` is the whole step: read, override, check.

Pure pydantic: no Prefect here (the flows import this module, never the other way round).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from k3pipe.experiment.load import load_experiment, load_experiment_text, parse_experiment
from k3pipe.experiment.variants import variant
from k3pipe.schema.specs import ExperimentSpec

__all__ = [
    "INLINE_SOURCE",
    "NO_OVERRIDES",
    "OVERRIDE_PARAM_PREFIX",
    "Overrides",
    "RunRequest",
    "apply_overrides",
]

INLINE_SOURCE = "<inline experiment_yaml>"
"""How an experiment given as text is named in errors and in MLflow's ``experiment_file``."""

OVERRIDE_PARAM_PREFIX = "override."
"""MLflow params of the overrides a run was started with: ``override.repeats`` and so on."""

# The descriptions of the request's fields, which the flows take as flat parameters. Prefect 3.9.1
# takes a flat parameter's description from the flow's docstring (its Google-style ``Args:``
# section): one given as ``Annotated[str, Field(description=...)]`` is dropped from the schema (its
# constraints are kept). The flows' docstrings repeat these words; tests/integration/test_schedules.py
# compares the deployed schema with them. A model's fields (Overrides) keep their Field descriptions.
EXPERIMENT_HELP = (
    "Experiment YAML file on the worker, relative to the checkout the deployment runs from "
    "(e.g. experiments/demo-study.yaml). Not read when experiment_yaml is set."
)
EXPERIMENT_YAML_HELP = (
    "The experiment itself: YAML text pasted here, the same fields as a file. When set, it is the "
    "experiment and the experiment file is not read. Checked like a file: an error names the field."
)
ARMS_HELP = "Only these arms, in this order (their names in the experiment). Empty: every arm."
VARIANTS_HELP = "Only these of the experiment's variants, in this order (their names). Empty: every variant."
OVERRIDES_HELP = (
    "Workload fields laid over every workload of the experiment; a field left empty keeps the "
    "experiment's value. Recorded on the MLflow runs as override.* params."
)


def _count(what: str) -> Any:
    # strict: true or "4" is not a count (the experiment's own fields are strict too); the upper
    # bounds are the experiment's, checked when the overrides are laid over it
    return Field(default=None, ge=1, strict=True, description=what)


class Overrides(BaseModel):
    """Workload fields laid over every workload of the experiment (empty: as in the experiment)."""

    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    repeats: int | None = _count(
        "Run every workload this many times (each repeat with prompts of its own); 1 for a smoke "
        "run, 3 or more for confidence intervals and verdicts."
    )
    num_requests: int | None = _count("Measured requests of every workload (warm-up requests not counted).")
    concurrency: int | None = _count(
        "Requests in flight at once in every workload (the cap on them under constant or poisson load)."
    )
    input_tokens: int | None = _count(
        "Prompt length in tokens of every workload (the upper bound for sharegpt datasets)."
    )
    output_tokens: int | None = _count("Tokens every request generates (max_tokens, with ignore_eos).")

    def changes(self) -> dict[str, int]:
        """The fields that are set, in field order: ``{"repeats": 1, "num_requests": 4}``."""
        return {k: v for k, v in self.model_dump().items() if v is not None}

    def params(self) -> dict[str, int]:
        """The MLflow params that record them: ``{"override.repeats": 1, ...}`` (none when unset)."""
        return {f"{OVERRIDE_PARAM_PREFIX}{k}": v for k, v in self.changes().items()}

    def describe(self) -> str:
        """``repeats=1, num_requests=4``, or ``none``."""
        return ", ".join(f"{k}={v}" for k, v in self.changes().items()) or "none"


NO_OVERRIDES = Overrides()
"""Every workload as in the experiment (the flows' default)."""


def apply_overrides(spec: ExperimentSpec, overrides: Overrides, source: str | None = None) -> ExperimentSpec:
    """``spec`` with ``overrides`` laid over every workload, validated again as an experiment (a new
    spec; ``spec`` itself is frozen and unchanged). Without overrides, ``spec`` itself.

    Errors are :class:`~k3pipe.core.errors.SpecError` naming ``source`` (default: the experiment's name),
    the overrides, the field path and the value, e.g. ``workloads[1]: dataset.prefix_tokens (384)
    must be below input_tokens (100)``. A variant's own workload fields are laid over the baseline
    when it is resolved (:func:`~k3pipe.experiment.variants.resolve`), so overriding the baseline
    first keeps the change a variant tests."""
    changes = overrides.changes()
    if not changes:
        return spec
    data = spec.model_dump(mode="json")
    for workload in data["workloads"]:
        workload.update(changes)
    where = f"{source or f'experiment {spec.name!r}'} with overrides {overrides.describe()}"
    return parse_experiment(data, where)


class RunRequest(BaseModel):
    """One run asked for (from the Prefect form, a schedule or the command line): which experiment,
    which of its arms and variants, and the overrides.

    The benchmark and study flows use ``experiment``, ``experiment_yaml``, ``arms`` and
    ``overrides``; ``variants`` is for a flow that runs an experiment's variants (the retest). A flow
    takes the fields as flat parameters of the same names (``--param experiment=PATH`` keeps working
    for ``prefect deployment run``) and builds the request from them."""

    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    experiment: str | None = Field(default=None, description=EXPERIMENT_HELP)
    experiment_yaml: str | None = Field(default=None, description=EXPERIMENT_YAML_HELP)
    arms: list[str] | None = Field(default=None, description=ARMS_HELP)
    variants: list[str] | None = Field(default=None, description=VARIANTS_HELP)
    overrides: Overrides = Field(default_factory=Overrides, description=OVERRIDES_HELP)

    @field_validator("experiment", "experiment_yaml")
    @classmethod
    def _blank_is_unset(cls, value: str | None) -> str | None:
        return value if value is None or value.strip() else None

    @field_validator("arms", "variants")
    @classmethod
    def _names_once(cls, value: list[str] | None) -> list[str] | None:
        if not value:
            return None
        repeated = sorted({n for n in value if value.count(n) > 1})
        if repeated:
            raise ValueError(f"names must be given once; repeated: {', '.join(repeated)}")
        return value

    @model_validator(mode="after")
    def _some_experiment(self) -> RunRequest:
        if self.experiment is None and self.experiment_yaml is None:
            raise ValueError(
                "no experiment: set experiment (a YAML file on the worker) or experiment_yaml "
                "(the experiment's YAML text)"
            )
        return self

    @property
    def source(self) -> str:
        """The experiment file, or :data:`INLINE_SOURCE` for an experiment given as text."""
        return INLINE_SOURCE if self.experiment_yaml is not None else str(self.experiment)

    def load(self) -> ExperimentSpec:
        """The experiment read (the inline text when given, else the file), the overrides laid over
        every workload, the whole validated; a :class:`~k3pipe.core.errors.SpecError` names the field."""
        if self.experiment_yaml is not None:
            spec = load_experiment_text(self.experiment_yaml, INLINE_SOURCE)
        else:
            spec = load_experiment(str(self.experiment))
        return apply_overrides(spec, self.overrides, self.source)

    def arm_names(self, spec: ExperimentSpec) -> list[str]:
        """The arms to run, in order: those asked for, each checked to exist (an unknown name is a
        :class:`~k3pipe.core.errors.SpecError` listing the experiment's arms), or every arm."""
        if not self.arms:
            if spec.tune is not None:  # a search: its candidates
                return [c.name for c in spec.tune_candidates()]
            return [a.name for a in spec.arms]
        for name in self.arms:
            spec.arm(name)
        return list(self.arms)

    def variant_names(self, spec: ExperimentSpec) -> list[str]:
        """The variants to run, in order: those asked for, each checked to exist, or every variant."""
        if not self.variants:
            return [v.name for v in spec.variants]
        for name in self.variants:
            variant(spec, name)
        return list(self.variants)

    def describe(self) -> str:
        """One line for a log: ``experiments/x.yaml, arms a, b, overrides repeats=1``."""
        parts = [self.source]
        if self.arms:
            parts.append(f"arms {', '.join(self.arms)}")
        if self.variants:
            parts.append(f"variants {', '.join(self.variants)}")
        parts.append(f"overrides {self.overrides.describe()}")
        return ", ".join(parts)
