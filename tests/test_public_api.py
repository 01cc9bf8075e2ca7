"""The public surface is deliberate, and the library never imports Prefect."""

from __future__ import annotations

import subprocess
import sys

import k3pipe


def test_exported_names() -> None:
    assert sorted(k3pipe.__all__) == sorted(
        [
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
    )
    for name in k3pipe.__all__:
        assert hasattr(k3pipe, name)


def test_error_tree() -> None:
    assert issubclass(k3pipe.EndpointAuthError, k3pipe.HealthError)
    assert issubclass(k3pipe.ModelNotServedError, k3pipe.HealthError)
    assert issubclass(k3pipe.PreflightError, k3pipe.SpecError)
    for name in (
        "SpecError",
        "ModelSourceError",
        "LaunchError",
        "HealthError",
        "BenchmarkError",
        "TrackingError",
    ):
        assert issubclass(getattr(k3pipe, name), k3pipe.K3pipeError)


def test_library_does_not_import_prefect() -> None:
    code = (
        "import sys, k3pipe, k3pipe.steps, k3pipe.record, k3pipe.cli, k3pipe.tracking; "
        "print('prefect' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
