"""An experiment's preparation, the one sequence every job runs before it launches anything: preflight
of the spec (before a possibly hours-long download), leftovers of killed runs reaped, the models
fetched, preflight again with the model's ``config.json``, and every workload's prompts drawn with its
tokenizer. Errors stop the job here, before any engine starts, and each arm's MLflow run records why
(:func:`stop_on_errors`).

The steps are a :class:`PrepareSteps`: :meth:`PrepareSteps.library` calls the library, a flow passes
its Prefect tasks (same signatures), as :class:`k3pipe.jobs.arm_run.ArmSteps` does for an arm's lifetime.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from k3pipe.core.errors import BenchmarkError, PreflightError
from k3pipe.core.layout import MLFLOW_RUN_LABEL
from k3pipe.engines.base import Finding
from k3pipe.prompts.corpora import PromptSet
from k3pipe.records.recorder import close_abandoned, record_preflight_stop
from k3pipe.records.tracking import Tracker
from k3pipe.schema.specs import ExperimentSpec, LocalModel, ModelScopeModel
from k3pipe.sources import ModelRecord

__all__ = ["PrepareSteps", "Prepared", "check_spec", "closer", "prepare", "reap_leftovers", "stop_on_errors"]

ABANDONED = "its k3pipe process was killed before its teardown; a later run ended its engine"


def closer(tracker: Tracker) -> Callable[[Mapping[str, str]], None]:
    """What ends the MLflow records of a run whose process was killed (its engine's labels name them)."""

    def close(labels: Mapping[str, str]) -> None:
        run_id = labels.get(MLFLOW_RUN_LABEL)
        if run_id:
            close_abandoned(tracker, run_id, ABANDONED)

    return close


def reap_leftovers(
    home: Path,
    containers: bool,
    *,
    is_running: Callable[[str], bool] = lambda flow_run: True,
    close: Callable[[Mapping[str, str]], None] | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[str]:
    """End what earlier runs killed before their teardown left behind, the same on every path (the
    library's and a flow's): the engine process groups recorded in ``home`` whose k3pipe process is
    gone (``close`` then gets each one's labels, to end its records), and (``containers``) k3pipe's
    containers whose run provably ended: their k3pipe process gone, or, with no such label,
    ``is_running`` saying their flow run is over (without Prefect nothing says so: such a container is
    left alone). Returns what it ended, in words."""
    from k3pipe.core.procs import GroupRegistry

    reaped = GroupRegistry(home).reap_orphans(progress=progress)
    for record in reaped:
        if close is not None and record.labels:
            close(record.labels)
    ended = [f"process group {r.pgid}" for r in reaped]
    if containers:
        from k3pipe.launchers.docker import connect, reap_orphans

        removed = reap_orphans(connect(), is_running, progress=progress)
        if removed and progress:
            progress(f"removed {len(removed)} orphan container(s) of earlier runs")
        ended += [f"container {c[:12]}" for c in removed]
    return ended


class PreflightStep(Protocol):
    """``preflight(spec, stage, model_dir)``: the findings at ``stage`` ('spec': the file alone;
    'model': with the model's config.json and this machine's ports and GPUs)."""

    def __call__(self, spec: ExperimentSpec, stage: str, model_dir: str | None = ..., /) -> list[Finding]: ...


@dataclass(frozen=True)
class PrepareSteps:
    """What preparing calls: ``preflight(spec, stage, model_dir=None)``, ``reap_orphans(containers)``
    (the caller binds how it tells a live run and closes a dead one's records), ``fetch_model(name,
    model_spec, home)`` and ``prompts(spec, model_dir, home)``."""

    preflight: PreflightStep
    reap_orphans: Callable[[bool], Any]
    fetch_model: Callable[[str, ModelScopeModel | LocalModel, Path], ModelRecord]
    prompts: Callable[[ExperimentSpec, Path, Path], dict[str, list[PromptSet]]]

    @classmethod
    def library(
        cls, home: Path, tracker: Tracker | None = None, say: Callable[[str], None] | None = None
    ) -> PrepareSteps:
        """The library's own steps (no Prefect): leftovers of killed runs reaped as a flow reaps them
        (:func:`reap_leftovers`; their records closed where a ``tracker`` is given)."""
        from k3pipe.experiment.preflight import preflight
        from k3pipe.machine.node import gpus_here
        from k3pipe.prompts.draw import prepare_prompts
        from k3pipe.sources import fetch_model

        return cls(
            # this machine (ports, GPUs) once this home's orphans are reaped (the model stage), not before
            preflight=lambda spec, stage, model_dir=None: preflight(
                spec,
                model_dir=model_dir,
                this_machine=stage == "model",
                gpus=gpus_here() if stage == "model" else None,
            ),
            reap_orphans=lambda containers: reap_leftovers(
                home, containers, close=closer(tracker) if tracker is not None else None, progress=say
            ),
            fetch_model=lambda name, model, where: fetch_model(model, where),
            prompts=lambda spec, model_dir, where: prepare_prompts(spec.workloads, model_dir, where),
        )


@dataclass
class Prepared:
    """What a job launches with: every model it fetched (``model`` first), the preflight findings
    with the model's config, and each workload's prompts per repeat."""

    models: dict[str, ModelRecord]
    findings: list[Finding] = field(default_factory=list)
    prompts: dict[str, list[PromptSet]] = field(default_factory=dict)


def stop_on_errors(
    findings: list[Finding],
    spec: ExperimentSpec,
    arms: list[str],
    tracker: Tracker,
    tags: Mapping[str, str] | None = None,
    parent_id: str | None = None,
    pruned: dict[str, str] | None = None,
) -> None:
    """Preflight errors (of the experiment, or of one of ``arms``) end the job before any launch:
    each arm's run records the findings and why (tagged ``tags``, nested under ``parent_id``), then
    :class:`~k3pipe.core.errors.PreflightError` names every error. With ``pruned`` (a search's), a
    candidate's errors take it out of ``arms`` instead, why into ``pruned``."""
    errors = [f for f in findings if f.severity == "error" and f.arm in (None, *arms)]
    if spec.tune is not None and errors and pruned is not None:
        errors = _prune(errors, spec, arms, pruned)
    if not errors:
        return
    for arm in arms:
        record_preflight_stop(tracker, spec.name, arm, findings, dict(tags or {}), parent_id)
    summary = "; ".join(f"[{f.arm or 'experiment'}] {f.message}" for f in errors)
    raise PreflightError(f"preflight found {len(errors)} error(s), nothing was launched: {summary}")


def _prune(
    errors: list[Finding], spec: ExperimentSpec, arms: list[str], gone: dict[str, str]
) -> list[Finding]:
    """A search's candidates that preflight finds cannot start leave ``arms`` (in place) before any
    launch, each with why (into ``gone``); the errors left stop the job as any other. Fewer than two
    candidates left: a search cannot be made, and that is an error naming why each went."""
    candidates = {c.name for c in spec.tune_candidates()}
    left = []
    for f in errors:
        if f.arm in candidates and f.arm in arms:
            gone[f.arm] = f.message
            arms.remove(f.arm)
        elif f.arm not in gone:
            left.append(f)
    if not left and len([a for a in arms if a in candidates]) < 2:
        why = "; ".join(f"[{name}] {message}" for name, message in gone.items())
        left.append(
            Finding(
                severity="error",
                rule="tune-candidates",
                arm=None,
                message=f"tune: {len(gone)} of {len(candidates)} candidates cannot start, fewer than two "
                f"are left to race: {why}",
            )
        )
    return left


def check_spec(
    spec: ExperimentSpec,
    arms: list[str],
    tracker: Tracker,
    steps: PrepareSteps,
    tags: Mapping[str, str] | None = None,
    parent_id: str | None = None,
    pruned: dict[str, str] | None = None,
) -> None:
    """Preflight of the spec alone (nothing fetched yet); stops on its errors."""
    stop_on_errors(steps.preflight(spec, "spec"), spec, arms, tracker, tags, parent_id, pruned)


def prepare(
    spec: ExperimentSpec,
    arms: list[str],
    tracker: Tracker,
    home: Path,
    steps: PrepareSteps,
    *,
    tags: Mapping[str, str] | None = None,
    parent_id: str | None = None,
    models: Mapping[str, ModelRecord] | None = None,
    prompts: dict[str, list[PromptSet]] | None = None,
    extra_models: bool = True,
    spec_checked: bool = False,
    pruned: dict[str, str] | None = None,
) -> Prepared:
    """The sequence for ``arms`` of ``spec``: preflight of the spec (unless ``spec_checked``), the
    orphans reaped, the models (``models`` given are used as they are; else ``model`` and, with
    ``extra_models``, every extra model), preflight with the model's config, the prompts (unless
    given). A preflight error, or a dataset that cannot give its prompts, stops it as
    :func:`stop_on_errors` says."""
    if not spec_checked:
        check_spec(spec, arms, tracker, steps, tags, parent_id, pruned)
    steps.reap_orphans(any(spec.arm(name).launcher.leaves_orphans for name in arms))
    if models:
        have = dict(models)
    else:
        have = {"model": steps.fetch_model("model", spec.model, home)}
        if extra_models:
            for name, extra in spec.extra_models.items():
                have[name] = steps.fetch_model(name, extra, home)
    findings = steps.preflight(spec, "model", have["model"].path)
    stop_on_errors(findings, spec, arms, tracker, tags, parent_id, pruned)
    if prompts is None:
        try:
            prompts = steps.prompts(spec, Path(have["model"].path), home)
        except BenchmarkError as exc:
            dataset_error = Finding(severity="error", rule="dataset", arm=None, message=str(exc))
            stop_on_errors([dataset_error], spec, arms, tracker, tags, parent_id)
            raise
    return Prepared(have, findings, prompts)
