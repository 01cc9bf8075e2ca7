"""The specs load without the machines: each in a fresh interpreter (tests/unit/test_layers.py holds
the floors themselves)."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


# a fresh interpreter per module
@pytest.mark.parametrize(
    "module", ["k3pipe.schema.specs", "k3pipe.experiment.load", "k3pipe.schema.schedule"]
)
def test_the_specs_load_without_the_machines(module: str) -> None:
    """Loading and describing an experiment imports no launcher implementation, SDK or client."""
    import subprocess
    import sys

    heavy = ("docker", "httpx", "mlflow", "prefect", "pandas", "k3pipe.launchers.docker", "k3pipe.bench")
    code = f"import sys, {module}; print(' '.join(m for m in {heavy!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == ""
