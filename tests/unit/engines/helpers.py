"""Helpers of the engine-module tests: the cited fixture files and small experiment specs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from k3pipe.experiment.load import parse_experiment
from k3pipe.schema.specs import ExperimentSpec

REPO = Path(__file__).resolve().parents[3]
FIXTURES = REPO / "tests" / "fixtures" / "engines"
STUDY = REPO / "experiments" / "kimi-k3-8xb300.yaml"


def fixture_lines(relative: str) -> list[str]:
    """A fixture file under tests/fixtures/engines (each cites the source of its formats)."""
    return (FIXTURES / relative).read_text().splitlines()


def one_arm(
    kind: str,
    args: dict[str, Any],
    *,
    env: dict[str, str] | None = None,
    workloads: list[dict[str, Any]] | None = None,
    hardware: dict[str, Any] | None = None,
    model: dict[str, Any] | None = None,
    version: str | None = None,
) -> ExperimentSpec:
    """A minimal experiment with one docker arm of ``kind`` and the given engine args."""
    data: dict[str, Any] = {
        "name": "t",
        "model": model or {"source": "local", "path": "/m"},
        "arms": [
            {
                "name": "a",
                "engine": {"kind": kind, "image": "img", "args": args, "env": env or {}, "version": version},
                "launcher": {"kind": "docker"},
            }
        ],
        "workloads": workloads or [{"name": "w", "input_tokens": 8, "output_tokens": 4}],
    }
    if hardware is not None:
        data["hardware"] = hardware
    return parse_experiment(data)
