"""The benchmark flow: for each engine arm, launch -> health gate -> workloads -> teardown, all in MLflow.

prefect: python -m flows.benchmark experiments/demo-cpu.yaml   (or `k3pipe run`, or the deployment)
"""

from __future__ import annotations

import sys
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import create_link_artifact, create_table_artifact

from flows.runtime import arm_steps, flow_run_id, flow_tags, judge_speculation, note_flow_run, prepare_steps
from flows.secrecy import guard, scrubbed_flow
from k3pipe.bench.corpora import PromptSet
from k3pipe.engines.base import Finding
from k3pipe.errors import RunFailedError, SpecError, first_line
from k3pipe.jobs.prepare import prepare
from k3pipe.params import NO_OVERRIDES, Overrides, RunRequest
from k3pipe.record import summary_table
from k3pipe.rerun import RerunInputs
from k3pipe.run import ArmRun
from k3pipe.secrets import scrub
from k3pipe.settings import Settings
from k3pipe.sources import ModelRecord
from k3pipe.specs import ExperimentSpec
from k3pipe.speculation import speculation_setting
from k3pipe.tracking import Tracker
from tasks.steps import (
    load_experiment_task,
    rerun_verdict_task,
    restore_run_task,
)


def _run_arm(
    spec: ExperimentSpec,
    experiment: str,
    arm: str,
    models: dict[str, ModelRecord],
    tracker: Tracker,
    settings: Settings,
    findings: list[Finding],
    prompts: dict[str, list[PromptSet]],
    rerun: RerunInputs | None = None,
    params: dict[str, Any] | None = None,
) -> dict[str, Any]:
    logger = get_run_logger()
    run = ArmRun(
        spec, arm, models, prompts, tracker, settings, findings, experiment, arm_steps(),
        tags={"prefect.flow_run_id": flow_run_id()}, labels={"k3pipe.flow_run_id": flow_run_id()},
        rerun=rerun, params=dict(params or {}), say=logger.info, warn=logger.error,
    )  # fmt: skip
    return run.execute().as_dict()


@scrubbed_flow("benchmark")
def benchmark(
    experiment: str = "experiments/demo-cpu.yaml",
    experiment_yaml: str | None = None,
    arms: list[str] | None = None,
    overrides: Overrides = NO_OVERRIDES,
    rerun_of: str | None = None,
    allow_drift: bool = False,
) -> list[dict[str, Any]]:
    """Run every arm (or the named arms) of the experiment and record it in MLflow; with rerun_of
    (an arm's MLflow run id), run that arm again from its record alone: the same verified model
    files, image digest, prompts and seeds.

    Args:
        experiment: Experiment YAML file on the worker, relative to the checkout the deployment runs
            from (e.g. experiments/demo-study.yaml). Not read when experiment_yaml is set.
        experiment_yaml: The experiment itself: YAML text pasted here, the same fields as a file.
            When set, it is the experiment and the experiment file is not read. Checked like a
            file: an error names the field.
        arms: Only these arms, in this order (their names in the experiment). Empty: every arm.
        overrides: Workload fields laid over every workload of the experiment; a field left empty
            keeps the experiment's value. Recorded on the MLflow runs as override.* params.
        rerun_of: An arm's MLflow run id: run that arm again from its record alone (the experiment,
            arms and overrides are then not used).
        allow_drift: With rerun_of: rerun even though a model file differs from the record (the
            difference is recorded).
    """
    note_flow_run()
    guard()
    logger = get_run_logger()
    settings = Settings()
    home = settings.home_dir
    tracker = Tracker(settings.tracking_uri(), settings.mlflow_experiment, settings.artifact_root())
    if rerun_of:
        if overrides.changes() or experiment_yaml or arms:
            raise SpecError(
                "rerun_of runs an arm again exactly as recorded: leave experiment_yaml, arms and "
                f"overrides empty (got overrides {overrides.describe()}, arms {arms or 'none'})"
            )
        rerun = restore_run_task(tracker, rerun_of, home, allow_drift)
        spec, experiment = rerun.spec, rerun.record.experiment_file
        selected = [a.name for a in spec.arms]
        params: dict[str, Any] = {}
    else:
        rerun = None
        request = RunRequest(
            experiment=experiment, experiment_yaml=experiment_yaml, arms=arms, overrides=overrides
        )
        spec, experiment = load_experiment_task(request), request.source
        selected = request.arm_names(spec)  # unknown arm names fail before anything starts
        params = overrides.params()
    # preflight before the (possibly hours-long) download, and again with the model's config.json;
    # every workload's prompts before any launch: a dataset that cannot give them fails the flow here
    prepared = prepare(
        spec, selected, tracker, home, prepare_steps(home, tracker), tags=flow_tags(),
        models=rerun.models if rerun is not None else None,
        prompts=rerun.prompts if rerun is not None else None,
    )  # fmt: skip
    models, findings, prompts = prepared.models, prepared.findings, prepared.prompts
    outcomes = []
    for name in selected:
        outcomes.append(
            _run_arm(spec, experiment, name, models, tracker, settings, findings, prompts, rerun, params)
        )
    rows = [row for o in outcomes for row in o.get("workloads", [])]
    if any(speculation_setting(spec.arm(name)) for name in selected):
        try:
            judge_speculation(spec, outcomes, rows, tracker)
        except Exception as exc:  # an analysis after the fact: the summary and the arms' status come first
            logger.warning("speculation could not be judged: %s: %s", type(exc).__name__, exc)
    table = summary_table(rows)
    if table:
        create_table_artifact(
            table=table, key="benchmark-summary", description=f"{spec.name}: workload summaries"
        )
    for o in outcomes:
        link = tracker.run_link(o["mlflow_run_id"])
        if link.startswith("http"):
            create_link_artifact(link=link, link_text=f"MLflow run of {o['arm']}", key=f"mlflow-{o['arm']}")
        logger.info("MLflow run of %s: %s", o["arm"], link)
    if rerun is not None:
        for o in outcomes:
            o["rerun_of"] = rerun.run_id
            o["verdicts"] = rerun_verdict_task(tracker, rerun.run_id, o["mlflow_run_id"])
    bad = [o["arm"] for o in outcomes if o["status"] != "FINISHED"]
    if bad:
        details = "; ".join(
            f"{o['arm']}: {first_line(o.get('error') or o['status'])}" for o in outcomes if o["arm"] in bad
        )
        raise RunFailedError(scrub(f"arm(s) did not finish cleanly ({details}); see their MLflow runs"))
    return outcomes


@scrubbed_flow("rerun")
def rerun(run_id: str, allow_drift: bool = False) -> list[dict[str, Any]]:
    """Run an arm's MLflow run again from its record alone, and compare the new run with it.

    Args:
        run_id: The MLflow run id of an arm (or of a workload or repeat under it; a unique prefix
            will do).
        allow_drift: Rerun even though a model file differs from the record (the difference is
            recorded).
    """
    note_flow_run()
    guard()
    return benchmark(rerun_of=run_id, allow_drift=allow_drift)


if __name__ == "__main__":
    benchmark(sys.argv[1] if len(sys.argv) > 1 else "experiments/demo-cpu.yaml")
