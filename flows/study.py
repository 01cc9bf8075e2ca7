"""The study flow: every arm x every workload of an experiment in one flow run, one parent MLflow run
with the arms nested under it, the next arm's inputs fetched while one arm runs, and the study's
report (Markdown, HTML, figures) at the end: on the study's run and as Prefect artifacts.

prefect: python -m flows.study experiments/demo-study.yaml   (or `k3pipe study`, or the deployment)
"""

from __future__ import annotations

import sys
import time
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import create_link_artifact

from flows.runtime import (
    arm_steps,
    flow_run_id,
    flow_tags,
    judge_speculation,
    note_flow_run,
    prepare_steps,
    report_needs_mlflow,
)
from flows.secrecy import guard, scrubbed_flow
from k3pipe.bench.corpora import PromptSet
from k3pipe.errors import PartlyFailedError, first_line
from k3pipe.jobs.prepare import check_spec, prepare
from k3pipe.params import NO_OVERRIDES, Overrides, RunRequest
from k3pipe.report import report_dir
from k3pipe.secrets import scrub
from k3pipe.settings import Settings
from k3pipe.sources import ModelRecord
from k3pipe.specs import ExperimentSpec
from k3pipe.speculation import speculation_setting
from k3pipe.study import Study, StudySteps, start_study
from k3pipe.tracking import Tracker
from tasks.steps import (
    fetch_model_task,
    load_experiment_task,
    pull_image_task,
    report_task,
)


class ArmsFailed(PartlyFailedError):
    """Some arm of the study did not finish; raised after the report (``result`` is the flow's)."""


def run_study(
    spec: ExperimentSpec,
    experiment: str,
    selected: list[str],
    tracker: Tracker,
    settings: Settings,
    *,
    parent_run_id: str | None = None,
    tags: dict[str, str] | None = None,
    models: dict[str, ModelRecord] | None = None,
    prompts: dict[str, list[PromptSet]] | None = None,
    params: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The study of ``spec``'s ``selected`` arms inside a flow: its run (nested under
    ``parent_run_id`` when given, ``params`` on it and its arms: the overrides), preflight, the
    first model and the prompts (unless given), the arms, the report. Raises :class:`ArmsFailed`
    after the report when an arm failed."""
    logger = get_run_logger()
    home = settings.home_dir
    params = dict(params or {})
    tags = {"prefect.flow_run_id": flow_run_id(), **(tags or {})}
    run_id = start_study(tracker, spec, experiment, tags, params, parent_id=parent_run_id)
    logger.info("study %s: MLflow run %s; arms %s", spec.name, run_id, ", ".join(selected))
    try:
        # the first model now (the prompts are drawn with its tokenizer); the others in the background
        steps_before = prepare_steps(home, tracker)
        check_spec(spec, selected, tracker, steps_before, flow_tags(), run_id)
        began = time.perf_counter()
        prepared = prepare(
            spec, selected, tracker, home, steps_before, tags=flow_tags(), parent_id=run_id,
            models=models, prompts=prompts, extra_models=False, spec_checked=True,
        )  # fmt: skip
        models, findings, prompts = prepared.models, prepared.findings, prepared.prompts
        before = time.perf_counter() - began
    except BaseException:
        tracker.end_run(run_id, "FAILED")
        raise
    steps = StudySteps(
        fetch_model=fetch_model_task,  # called from a background lane: still a task run of this flow
        pull_image=pull_image_task,
        arm=arm_steps(),
    )
    outcome = Study(
        spec, run_id, tracker, settings, models, prompts, findings, experiment, steps,
        tags=tags, labels={"k3pipe.flow_run_id": flow_run_id()}, params=params, arms=selected,
        before_s=before, say=logger.info, warn=logger.error,
    ).execute()  # fmt: skip
    outcomes = [o.as_dict() for o in outcome.arms]
    # speculation is judged on each arm's first launch (the judge pairs one run per arm)
    first = [o for o in outcomes if o.get("launch", 1) == 1]
    rows = [row for o in first for row in o.get("workloads", [])]
    if any(speculation_setting(spec.arm(name)) for name in selected):
        try:
            judge_speculation(spec, first, rows, tracker)
        except Exception as exc:  # an analysis after the fact: the report comes first
            logger.warning("speculation could not be judged: %s: %s", type(exc).__name__, exc)
    report_needs_mlflow(tracker, run_id)
    paths = report_task(tracker, run_id, report_dir(settings.home_dir, spec.name, run_id))
    link = tracker.run_link(run_id)
    if link.startswith("http"):
        create_link_artifact(link=link, link_text=f"MLflow run of study {spec.name}", key="mlflow-study")
    logger.info("MLflow run of the study: %s", link)
    result = {"study_run_id": run_id, "arms": outcomes, "report": paths}
    if outcome.failed:
        details = "; ".join(f"{o.arm}: {first_line(o.error or o.status)}" for o in outcome.failed)
        why = f"arm(s) did not finish cleanly ({details}); the report covers the others: {paths['html']}"
        raise ArmsFailed(scrub(why), result)
    return result


@scrubbed_flow("study")
def study(
    experiment: str = "experiments/demo-study.yaml",
    experiment_yaml: str | None = None,
    arms: list[str] | None = None,
    overrides: Overrides = NO_OVERRIDES,
) -> dict[str, Any]:
    """Every arm (or the named arms) of the experiment on every workload, under one MLflow run; the
    report at the end. An arm that fails is recorded and the others still run; the flow then fails
    after the report, naming it.

    Args:
        experiment: Experiment YAML file on the worker, relative to the checkout the deployment runs
            from (e.g. experiments/demo-study.yaml). Not read when experiment_yaml is set.
        experiment_yaml: The experiment itself: YAML text pasted here, the same fields as a file.
            When set, it is the experiment and the experiment file is not read. Checked like a
            file: an error names the field.
        arms: Only these arms, in this order (their names in the experiment). Empty: every arm.
        overrides: Workload fields laid over every workload of the experiment; a field left empty
            keeps the experiment's value. Recorded on the MLflow runs as override.* params.
    """
    note_flow_run()
    guard()
    settings = Settings()
    tracker = Tracker(settings.tracking_uri(), settings.mlflow_experiment, settings.artifact_root())
    request = RunRequest(
        experiment=experiment, experiment_yaml=experiment_yaml, arms=arms, overrides=overrides
    )
    spec, source = load_experiment_task(request), request.source
    selected = request.arm_names(spec)  # unknown arm names fail before anything starts
    return run_study(spec, source, selected, tracker, settings, params=overrides.params())


if __name__ == "__main__":
    study(sys.argv[1] if len(sys.argv) > 1 else "experiments/demo-study.yaml")
