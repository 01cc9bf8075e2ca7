"""The benchmark flow: for each engine arm, launch -> health gate -> workloads -> teardown, all in MLflow.

prefect: python -m flows.benchmark experiments/demo-cpu.yaml   (or `k3pipe run`, or the deployment)
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from uuid import UUID

from prefect import get_client, get_run_logger
from prefect.artifacts import create_link_artifact, create_table_artifact
from prefect.context import get_run_context
from prefect.states import Crashed

from flows.secrecy import guard, scrubbed_flow
from k3pipe.bench.corpora import PromptSet
from k3pipe.engines.base import Finding
from k3pipe.errors import RunFailedError, SpecError, first_line
from k3pipe.jobs.prepare import PrepareSteps, prepare
from k3pipe.params import NO_OVERRIDES, Overrides, RunRequest
from k3pipe.record import close_abandoned, record_speculation, summary_table
from k3pipe.rerun import RerunInputs
from k3pipe.run import ArmRun, ArmSteps
from k3pipe.secrets import scrub
from k3pipe.settings import Settings
from k3pipe.sources import ModelRecord
from k3pipe.specs import ExperimentSpec
from k3pipe.speculation import speculation_setting
from k3pipe.tracking import Tracker
from tasks.steps import (
    benchmark_task,
    cold_start_task,
    engine_version_task,
    fetch_model_task,
    health_gate_task,
    judge_speculation_task,
    load_experiment_task,
    plan_arm_task,
    preflight_task,
    prepare_prompts_task,
    probe_node_task,
    pull_image_task,
    reap_orphans_task,
    rerun_verdict_task,
    restore_run_task,
    start_engine_task,
    wait_ready_task,
)

started_flow_runs: list[str] = []
"""The ids of the flow runs this process started (each flow notes its own first), so that the
command that ran them can mark them Cancelled when it is interrupted (cli.main)."""


def note_flow_run() -> None:
    """Add the current flow run to :data:`started_flow_runs`."""
    run_id = _flow_run_id()
    if run_id != "none" and run_id not in started_flow_runs:
        started_flow_runs.append(run_id)


def _flow_run_id() -> str:
    try:
        return str(get_run_context().flow_run.id)  # type: ignore[union-attr]
    except Exception:
        return "none"


def _flow_run_is_running(flow_run_id: str) -> bool:
    """Whether a flow run (from a container's label) may still be going: True unless this Prefect
    API shows it in a final state (a run it cannot read may be another server's, going on)."""
    if flow_run_id == _flow_run_id():
        return True
    try:
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(UUID(flow_run_id)).state
    except Exception:
        return True
    return state is None or not state.is_final()


def _closer(tracker: Tracker) -> Callable[[Mapping[str, str]], None]:
    """What ends the records of a run whose process was killed (its engine's labels name them)."""
    why = "its k3pipe process was killed before its teardown; a later run ended its engine"

    def close(labels: Mapping[str, str]) -> None:
        run_id = labels.get("k3pipe.mlflow_run_id")
        if run_id:
            close_abandoned(tracker, run_id, why)
        flow_run = labels.get("k3pipe.flow_run_id", "none")
        if flow_run != "none":
            with contextlib.suppress(Exception), get_client(sync_client=True) as client:
                state = client.read_flow_run(UUID(flow_run)).state
                if state is None or not state.is_final():
                    client.set_flow_run_state(UUID(flow_run), Crashed(message=why), force=True)

    return close


def _steps() -> ArmSteps:
    """The arm's steps as Prefect tasks: each is a task run in the UI; the lifetime is the library's."""
    return ArmSteps(
        plan=plan_arm_task,
        pull_image=pull_image_task,
        probe_node=probe_node_task,
        start_engine=start_engine_task,
        wait_ready=wait_ready_task,
        health_gate=health_gate_task,
        engine_version=engine_version_task,
        cold_start=cold_start_task,
        benchmark=benchmark_task,
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
        spec, arm, models, prompts, tracker, settings, findings, experiment, _steps(),
        tags={"prefect.flow_run_id": _flow_run_id()}, labels={"k3pipe.flow_run_id": _flow_run_id()},
        rerun=rerun, params=dict(params or {}), say=logger.info, warn=logger.error,
    )  # fmt: skip
    return run.execute().as_dict()


def _prepare_steps(home: Path, tracker: Tracker) -> PrepareSteps:
    """The preparation's steps as Prefect tasks (k3pipe.jobs.prepare runs the sequence)."""
    return PrepareSteps(
        preflight=preflight_task,
        reap_orphans=lambda containers: reap_orphans_task(
            _flow_run_is_running, home, containers, _closer(tracker)
        ),
        fetch_model=fetch_model_task,
        prompts=prepare_prompts_task,
    )


def _flow_tags() -> dict[str, str]:
    return {"prefect.flow_run_id": _flow_run_id()}


def _judge_speculation(
    spec: ExperimentSpec, outcomes: list[dict[str, Any]], rows: list[dict[str, Any]], tracker: Tracker
) -> None:
    """Speculative arms against their plain baselines, once every arm ran: findings in the log, the
    judgement on each speculative arm's MLflow run, and its summary in that arm's outcome."""
    log_lengths = {
        o["arm"]: o["engine_log_spec_accept_length_mean"]
        for o in outcomes
        if o.get("engine_log_spec_accept_length_mean") is not None
    }
    report = judge_speculation_task(spec, rows, log_lengths)
    record_speculation(tracker, {o["arm"]: o["mlflow_run_id"] for o in outcomes}, report)
    by_arm = {a.arm: a for a in report.arms}
    for o in outcomes:
        judged = by_arm.get(o["arm"])
        if judged is not None:
            o["speculation"] = f"{judged.summary} (baseline: {judged.baseline.baseline or 'none'})"


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
        spec, selected, tracker, home, _prepare_steps(home, tracker), tags=_flow_tags(),
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
            _judge_speculation(spec, outcomes, rows, tracker)
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
