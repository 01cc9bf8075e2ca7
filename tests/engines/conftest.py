"""Fixtures of the engine-module tests."""

from __future__ import annotations

import pytest

from k3pipe.experiment import load_experiment
from k3pipe.specs import ExperimentSpec
from tests.engines.helpers import STUDY


@pytest.fixture
def study() -> ExperimentSpec:
    """experiments/kimi-k3-8xb300.yaml: the study's exact launches."""
    return load_experiment(STUDY)
