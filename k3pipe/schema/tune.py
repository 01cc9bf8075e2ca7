"""A search over an engine's settings (issue 50, item 1): ``tune:`` in the experiment names an arm, the
arguments and environment variables to vary with their values, constraints between them, the
objective (a decision figure on a workload) and the budget; :meth:`TuneSpec.candidates` gives the
candidates, each a copy of the arm with its settings, named ``ARM.tNN``. How they are raced:
:mod:`k3pipe.verdicts.racing`.

Part of the experiment's schema; :mod:`k3pipe.schema.specs` re-exports every name.
"""

from __future__ import annotations

import itertools
import operator
import re
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import Field, field_validator, model_validator

from k3pipe.schema.arms import ArmSpec
from k3pipe.schema.common import MAX_LAUNCHES, _check_arg_value, _finite, _Spec

__all__ = ["MAX_CANDIDATES", "TuneBudget", "TuneCandidate", "TuneObjective", "TuneSpec"]

MAX_CANDIDATES = 64
"""Candidates a search may hold: past this, a grid is a typing mistake or a week of launches."""

_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")
_RULE = re.compile(
    r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(<=|>=|==|!=|<|>)\s*([A-Za-z_][A-Za-z0-9_]*|-?\d+(?:\.\d+)?)\s*$"
)
_OPS: dict[str, Callable[[Any, Any], bool]] = {
    "<=": operator.le,
    ">=": operator.ge,
    "<": operator.lt,
    ">": operator.gt,
    "==": operator.eq,
    "!=": operator.ne,
}


class TuneObjective(_Spec):
    """What the search maximises (or minimises, by the figure's own direction)."""

    metric: str = Field(
        description="A decision figure (decision.metrics' choices): output_throughput_tps, ttft_ms_p50..."
    )
    workload: str = Field(description="The workload the figure is measured on (one of the experiment's).")


class TuneBudget(_Spec):
    """What the search may spend: launches, and device time."""

    first_launches: int = Field(
        default=2, ge=2, le=MAX_LAUNCHES, description="Launches of every candidate before the first look."
    )
    max_launches: int = Field(
        default=8, ge=2, le=MAX_LAUNCHES, description="Launches of a candidate at most."
    )
    device_minutes: float | None = _finite(
        default=None,
        gt=0,
        description="Device time the search may hold, in minutes: the candidates' launches added up, "
        "each from its engine's start to its teardown (a node's time, so launches on several nodes "
        "add). The first round always runs (nothing is known before it); no further round starts "
        "that would pass the budget at the launches' mean so far, and the search ends 'undecided', "
        "saying so. None: launches bound it alone.",
    )

    @model_validator(mode="after")
    def _order(self) -> TuneBudget:
        if self.max_launches < self.first_launches:
            raise ValueError(
                f"budget.max_launches={self.max_launches} is below budget.first_launches="
                f"{self.first_launches}: give at least as many"
            )
        return self


class TuneCandidate(_Spec):
    """One candidate: the arm with these settings."""

    name: str = Field(description="The candidate's arm name: ARM.tNN.")
    settings: dict[str, Any] = Field(description="What this candidate sets: args by name, env as 'env.NAME'.")
    arm: ArmSpec = Field(description="The searched arm with these settings.")

    @property
    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.settings.items())


class TuneSpec(_Spec):
    """A search over one arm's settings under an objective, raced by the verdict rules."""

    arm: str = Field(description="The arm whose settings are searched (its engine, launcher and endpoint).")
    args: dict[str, list[Any]] = Field(
        default_factory=dict,
        description="Engine arguments to vary, each with its values (as the arm's args: snake_case names).",
    )
    env: dict[str, list[str]] = Field(
        default_factory=dict, description="Environment variables to vary, each with its values."
    )
    where: list[str] = Field(
        default_factory=list,
        description="Constraints a candidate must meet, each 'NAME OP NAME' or 'NAME OP NUMBER' with OP one "
        "of <, <=, >, >=, ==, != (e.g. 'max_num_batched_tokens >= max_num_seqs').",
    )
    objective: TuneObjective = Field(description="The figure the search is judged on, and its workload.")
    budget: TuneBudget = Field(default_factory=TuneBudget, description="The launches it may spend.")
    alpha: float = _finite(default=0.05, gt=0, lt=0.5, description="The race's error rate.")
    margin_pct: float = _finite(
        default=3.0, gt=0, le=100, description="Candidates within +-margin_pct are 'equivalent'."
    )

    @field_validator("args", "env")
    @classmethod
    def _values(cls, value: dict[str, list[Any]]) -> dict[str, list[Any]]:
        for key, values in value.items():
            if not _KEY.fullmatch(key):
                raise ValueError(f"{key!r} is not a setting's name: letters, digits and '_'")
            if not values:
                raise ValueError(f"{key}: give at least one value")
            if len({repr(v) for v in values}) != len(values):
                raise ValueError(f"{key}: a value is listed twice: {values}")
            for v in values:
                _check_arg_value(key, v)
        return value

    @field_validator("where")
    @classmethod
    def _rules(cls, value: list[str]) -> list[str]:
        for rule in value:
            if not _RULE.match(rule):
                raise ValueError(
                    f"where: {rule!r} is not a constraint k3pipe reads: give 'NAME OP NAME' or 'NAME OP "
                    "NUMBER' with OP one of <, <=, >, >=, ==, != (e.g. 'max_num_batched_tokens >= "
                    "max_num_seqs')"
                )
        return value

    @model_validator(mode="after")
    def _settings(self) -> TuneSpec:
        if not self.args and not self.env:
            raise ValueError("tune: give the settings to search in args or env (each with its values)")
        names = set(self.args) | {f"env.{k}" for k in self.env}
        for rule in self.where:
            match = _RULE.match(rule)
            assert match is not None
            for side in (match.group(1), match.group(3)):
                if (side[0].isalpha() or side[0] == "_") and side not in self.args:
                    raise ValueError(
                        f"where: {rule!r} names {side!r}, which tune.args does not vary; it varies: "
                        + ", ".join(sorted(names))
                    )
        return self

    def grid(self) -> list[dict[str, Any]]:
        """Every combination of the values, in order, that meets every constraint."""
        keys = [*self.args, *(f"env.{k}" for k in self.env)]
        values = [*self.args.values(), *self.env.values()]
        out = []
        for combo in itertools.product(*values):
            settings = dict(zip(keys, combo, strict=True))
            if all(_holds(rule, settings) for rule in self.where):
                out.append(settings)
        return out

    def candidates(self, arm: ArmSpec) -> list[TuneCandidate]:
        """The candidates: ``arm`` with each combination's settings, named ``ARM.t01``, ``ARM.t02``...

        Raises:
            ValueError: fewer than two combinations meet the constraints, or more than
                :data:`MAX_CANDIDATES`.
        """
        grid = self.grid()
        if len(grid) < 2:
            raise ValueError(
                f"tune: {len(grid)} candidate(s) meet the constraints: a search needs two or more; "
                "widen tune.args or loosen tune.where"
            )
        if len(grid) > MAX_CANDIDATES:
            raise ValueError(
                f"tune: {len(grid)} candidates, more than {MAX_CANDIDATES}: at {self.budget.first_launches} "
                "launches each before the first look that is too many to race; search fewer values"
            )
        width = max(2, len(str(len(grid))))
        out = []
        for i, settings in enumerate(grid, 1):
            args = {**arm.engine.args, **{k: v for k, v in settings.items() if not k.startswith("env.")}}
            env = {**arm.engine.env, **{k[4:]: str(v) for k, v in settings.items() if k.startswith("env.")}}
            engine = arm.engine.model_copy(update={"args": args, "env": env})
            name = f"{arm.name}.t{i:0{width}d}"
            copy = arm.model_copy(
                update={"name": name, "engine": engine, "launches": self.budget.first_launches}
            )
            out.append(TuneCandidate(name=name, settings=settings, arm=copy))
        return out

    def reference(self, arm: ArmSpec, among: Sequence[str]) -> str:
        """The candidate whose answers the others' are compared with (the answers gate): the one with
        the searched arm's own settings (what is run today), else the first of ``among``."""
        own = {**arm.engine.args, **{f"env.{k}": v for k, v in arm.engine.env.items()}}
        for candidate in self.candidates(arm):
            if candidate.name in among and all(
                k in own and str(own[k]) == str(v) for k, v in candidate.settings.items()
            ):
                return candidate.name
        return among[0]


def _holds(rule: str, settings: dict[str, Any]) -> bool:
    match = _RULE.match(rule)
    assert match is not None
    left, op, right = match.groups()

    def value(side: str) -> Any:
        return settings[side] if side in settings else float(side)

    try:
        return bool(_OPS[op](value(left), value(right)))
    except TypeError as exc:
        raise ValueError(f"where: {rule!r} compares values that do not compare ({exc})") from None
