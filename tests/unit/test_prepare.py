"""An experiment's preparation (k3pipe.jobs.prepare), with steps that record their calls and a tracker
that records its runs: the order (spec checked before anything is fetched), what stops it before any
launch and what each stopped arm's run records, and what a job that already has its inputs skips."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from k3pipe.core.errors import BenchmarkError, PreflightError
from k3pipe.engines.base import Finding
from k3pipe.experiment.load import parse_experiment
from k3pipe.jobs.prepare import PrepareSteps, prepare
from k3pipe.schema.specs import ExperimentSpec
from k3pipe.sources import ModelRecord


class Runs:
    """The tracker's calls that a preflight stop makes: each run's name, tags, parent and status."""

    def __init__(self) -> None:
        self.runs: dict[str, dict[str, Any]] = {}

    def start_run(self, name: str, tags: dict[str, str], parent_id: str | None = None) -> str:
        run_id = f"r{len(self.runs)}"
        self.runs[run_id] = {"name": name, "tags": dict(tags), "parent": parent_id, "files": {}}
        return run_id

    def log_dict(self, run_id: str, data: Any, name: str) -> None:
        self.runs[run_id]["files"][name] = data

    def log_metrics(self, run_id: str, metrics: dict[str, float]) -> None:
        self.runs[run_id]["metrics"] = dict(metrics)

    def set_tags(self, run_id: str, tags: dict[str, str]) -> None:
        self.runs[run_id]["tags"].update(tags)

    def end_run(self, run_id: str, status: str) -> None:
        self.runs[run_id]["status"] = status


def _spec() -> ExperimentSpec:
    arm = {"engine": {"kind": "vllm", "executable": ["vllm"]}}
    return parse_experiment(
        {
            "name": "exp",
            "model": {"source": "local", "path": "/nonexistent/model"},
            "extra_models": {"draft": {"source": "local", "path": "/nonexistent/draft"}},
            "arms": [{"name": "a", **arm}, {"name": "b", **arm}],
            "workloads": [{"name": "w", "input_tokens": 32, "output_tokens": 8}],
        }
    )


def _model(name: str, path: str) -> ModelRecord:
    return ModelRecord(
        source="local", model_id=None, requested_revision=None, resolved_revision=None, path=path,
        files={}, total_bytes=0, downloaded=False, duration_s=0.0,
    )  # fmt: skip


def _steps(calls: list[str], spec_findings: list[Finding] = (), model_findings: list[Finding] = (),
           prompts_error: Exception | None = None) -> PrepareSteps:  # fmt: skip
    def preflight(spec: ExperimentSpec, stage: str, model_dir: str | None = None) -> list[Finding]:
        calls.append(f"preflight:{stage}")
        return list(spec_findings if stage == "spec" else model_findings)

    def fetch(name: str, model: Any, home: Path) -> ModelRecord:
        calls.append(f"fetch:{name}")
        return _model(name, f"/models/{name}")

    def prompts(spec: ExperimentSpec, model_dir: Path, home: Path) -> dict[str, list[Any]]:
        calls.append(f"prompts:{model_dir}")
        if prompts_error is not None:
            raise prompts_error
        return {"w": []}

    return PrepareSteps(preflight, lambda containers: calls.append(f"reap:{containers}"), fetch, prompts)


def _error(arm: str | None, message: str) -> Finding:
    return Finding(severity="error", rule="r", arm=arm, message=message)


def test_the_sequence_in_order() -> None:
    calls: list[str] = []
    done = prepare(_spec(), ["a", "b"], Runs(), Path("/h"), _steps(calls))  # type: ignore[arg-type]
    assert calls == [
        "preflight:spec", "reap:False", "fetch:model", "fetch:draft", "preflight:model",
        "prompts:/models/model",
    ]  # fmt: skip
    assert list(done.models) == ["model", "draft"]
    assert done.prompts == {"w": []}


def test_a_spec_error_stops_before_anything_is_fetched_and_each_arm_records_it() -> None:
    calls: list[str] = []
    runs = Runs()
    steps = _steps(calls, spec_findings=[_error("b", "too big")])
    with pytest.raises(PreflightError, match=r"1 error\(s\), nothing was launched: \[b\] too big"):
        prepare(_spec(), ["a", "b"], runs, Path("/h"), steps, tags={"t": "1"}, parent_id="p")  # type: ignore[arg-type]
    assert calls == ["preflight:spec"]
    assert [(r["name"], r["status"], r["parent"], r["tags"]["t"]) for r in runs.runs.values()] == [
        ("exp/a", "FAILED", "p", "1"), ("exp/b", "FAILED", "p", "1")
    ]  # fmt: skip
    b = next(r for r in runs.runs.values() if r["name"] == "exp/b")
    assert b["tags"]["k3pipe.error"] == "preflight: r"
    assert b["metrics"] == {"preflight_errors": 1}
    # arm a has no error of its own: its run says whose errors stopped it
    a = next(r for r in runs.runs.values() if r["name"] == "exp/a")
    assert a["tags"]["k3pipe.error"] == "preflight: not launched: preflight found errors in arm(s) b (r)"
    assert a["metrics"] == {"preflight_errors": 0}


def test_an_error_of_an_arm_not_run_does_not_stop_the_others() -> None:
    calls: list[str] = []
    done = prepare(_spec(), ["a"], Runs(), Path("/h"), _steps(calls, model_findings=[_error("b", "x")]))  # type: ignore[arg-type]
    assert done.findings[0].arm == "b"


def test_a_dataset_that_cannot_give_its_prompts_stops_as_a_preflight_error() -> None:
    runs = Runs()
    steps = _steps([], prompts_error=BenchmarkError("no such dataset file"))
    with pytest.raises(PreflightError, match="no such dataset file"):
        prepare(_spec(), ["a"], runs, Path("/h"), steps)  # type: ignore[arg-type]
    (run,) = runs.runs.values()
    assert run["files"]["preflight.json"][0]["rule"] == "dataset"


def test_given_models_and_prompts_are_used_as_they_are() -> None:
    calls: list[str] = []
    model = _model("model", "/given")
    done = prepare(
        _spec(), ["a"], Runs(), Path("/h"), _steps(calls),  # type: ignore[arg-type]
        models={"model": model}, prompts={"w": []}, spec_checked=True,
    )  # fmt: skip
    assert calls == ["reap:False", "preflight:model"]
    assert done.models == {"model": model}
