"""k3pipe: repeatable, tracked benchmarks of LLM inference engines (vLLM, SGLang).

The library never imports Prefect; ``tasks/`` and ``flows/`` wrap it. The public surface is small:
load and render experiments, the steps, and the error tree.

The names below are loaded when first used (PEP 562): importing one module of the library
(``k3pipe.core.errors``, ``k3pipe.verdicts.stats``) does not load the specs, the launchers and their SDKs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from k3pipe.core.errors import (
        BenchmarkError,
        EndpointAuthError,
        HealthError,
        K3pipeError,
        LaunchError,
        ModelNotServedError,
        ModelSourceError,
        PreflightError,
        SpecError,
        TrackingError,
    )
    from k3pipe.core.settings import Settings
    from k3pipe.experiment.load import load_experiment, parse_experiment
    from k3pipe.planning.plan import ArmPlan, plan_arm
    from k3pipe.schema.specs import ExperimentSpec, WorkloadSpec

__version__ = "0.1.0"

# public name -> the module that defines it
_HOMES = {
    **dict.fromkeys(
        (
            "BenchmarkError",
            "EndpointAuthError",
            "HealthError",
            "K3pipeError",
            "LaunchError",
            "ModelNotServedError",
            "ModelSourceError",
            "PreflightError",
            "SpecError",
            "TrackingError",
        ),
        "k3pipe.core.errors",
    ),
    "load_experiment": "k3pipe.experiment.load",
    "parse_experiment": "k3pipe.experiment.load",
    "ArmPlan": "k3pipe.planning.plan",
    "plan_arm": "k3pipe.planning.plan",
    "Settings": "k3pipe.core.settings",
    "ExperimentSpec": "k3pipe.schema.specs",
    "WorkloadSpec": "k3pipe.schema.specs",
}

__all__ = [
    "ArmPlan",
    "BenchmarkError",
    "EndpointAuthError",
    "ExperimentSpec",
    "HealthError",
    "K3pipeError",
    "LaunchError",
    "ModelNotServedError",
    "ModelSourceError",
    "PreflightError",
    "Settings",
    "SpecError",
    "TrackingError",
    "WorkloadSpec",
    "__version__",
    "load_experiment",
    "parse_experiment",
    "plan_arm",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'k3pipe' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
