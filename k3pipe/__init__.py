"""k3pipe: repeatable, tracked benchmarks of LLM inference engines (vLLM, SGLang).

The library never imports Prefect; ``tasks/`` and ``flows/`` wrap it. The public surface is small:
load and render experiments, the steps, and the error tree.
"""

from k3pipe.errors import (
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
from k3pipe.experiment import load_experiment, parse_experiment
from k3pipe.plan import ArmPlan, plan_arm
from k3pipe.settings import Settings
from k3pipe.specs import ExperimentSpec, WorkloadSpec

__version__ = "0.1.0"

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
