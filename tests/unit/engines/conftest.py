"""Fixtures of the engine-module tests."""

from __future__ import annotations

import pytest

from k3pipe.experiment.load import load_experiment
from k3pipe.schema.specs import ExperimentSpec
from tests.unit.engines.helpers import STUDY


@pytest.fixture
def study() -> ExperimentSpec:
    """experiments/kimi-k3-8xb300.yaml: the study's exact launches."""
    return load_experiment(STUDY)


@pytest.fixture(autouse=True)
def study_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """The study's arms name K3PIPE_API_KEY for their key; set, as for a run (SGLang's --api-key is
    rendered from it, and preflight stops an SGLang arm whose key variable is unset)."""
    monkeypatch.setenv("K3PIPE_API_KEY", "k3pipe-test-key")
