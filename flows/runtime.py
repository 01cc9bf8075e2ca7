"""What the flows share on Prefect's side: the flow run's job (:func:`flow_job`: the steps as Prefect
tasks, the flow's logger, artifacts; the sequences are the library's, k3pipe.jobs and k3pipe.jobs.arm_run),
the flow runs this process started (so the command that ran them can mark them Cancelled), and the
closer that ends the records of a run whose process was killed."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from pathlib import Path
from uuid import UUID

from prefect import get_client, get_run_logger
from prefect.artifacts import create_link_artifact, create_table_artifact
from prefect.context import get_run_context
from prefect.events import emit_event
from prefect.states import Crashed

from k3pipe.core.layout import FLOW_RUN_TAG, REGRESSION_EVENT, RETEST_RESOURCE_PREFIX
from k3pipe.core.settings import Settings
from k3pipe.flows.pools import prefect_fleet
from k3pipe.jobs.arm_run import ArmSteps
from k3pipe.jobs.prepare import ABANDONED, PrepareSteps, closer
from k3pipe.jobs.steps import Job, JobSteps
from k3pipe.records.tracking import Tracker
from k3pipe.tasks.steps import (
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
    report_task,
    rerun_verdict_task,
    restore_run_task,
    retest_report_task,
    start_engine_task,
    wait_ready_task,
)

__all__ = [
    "arm_steps",
    "flow_job",
    "flow_run_id",
    "prepare_steps",
]


def flow_run_id() -> str:
    try:
        return str(get_run_context().flow_run.id)  # type: ignore[union-attr]
    except Exception:
        return "none"


def _flow_run_is_running(run_id: str) -> bool:
    """Whether a flow run (from a container's label) may still be going: True unless this Prefect
    API shows it in a final state (a run it cannot read may be another server's, going on)."""
    if run_id == flow_run_id():
        return True
    try:
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(UUID(run_id)).state
    except Exception:
        return True
    return state is None or not state.is_final()


def _closer(tracker: Tracker) -> Callable[[Mapping[str, str]], None]:
    """What ends the records of a run whose process was killed (its engine's labels name them)."""
    close_records = closer(tracker)

    def close(labels: Mapping[str, str]) -> None:
        close_records(labels)
        flow_run = labels.get(FLOW_RUN_TAG, "none")
        if flow_run != "none":
            with contextlib.suppress(Exception), get_client(sync_client=True) as client:
                state = client.read_flow_run(UUID(flow_run)).state
                if state is None or not state.is_final():
                    client.set_flow_run_state(UUID(flow_run), Crashed(message=ABANDONED), force=True)

    return close


def arm_steps() -> ArmSteps:
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


def prepare_steps(home: Path, tracker: Tracker) -> PrepareSteps:
    """The preparation's steps as Prefect tasks (k3pipe.jobs.prepare runs the sequence)."""
    return PrepareSteps(
        preflight=preflight_task,
        reap_orphans=lambda containers: reap_orphans_task(
            _flow_run_is_running, home, containers, _closer(tracker)
        ),
        fetch_model=fetch_model_task,
        prompts=prepare_prompts_task,
    )


def flow_job() -> Job:
    """The job of the running flow: its settings and tracker, the steps as Prefect tasks, the flow's
    logger, links and tables published as Prefect artifacts, the flow run's id on every record."""
    logger = get_run_logger()
    settings = Settings()
    tracker = Tracker(settings.tracking_uri(), settings.mlflow_experiment, settings.artifact_root())
    steps = JobSteps(
        load_experiment=load_experiment_task,
        prepare=prepare_steps(settings.home_dir, tracker),
        arm=arm_steps(),
        judge_speculation=judge_speculation_task,
        restore_run=restore_run_task,
        rerun_verdict=rerun_verdict_task,
        report=report_task,
        retest_report=retest_report_task,
    )
    return Job(
        settings, tracker, steps, flow_run_id(), say=logger.info, note=logger.warning, warn=logger.error,
        link=lambda url, text, key: create_link_artifact(link=url, link_text=text, key=key),
        table=lambda rows, key, what: create_table_artifact(table=rows, key=key, description=what),
        fleet=lambda fleet, run_id: prefect_fleet(fleet, run_id, tracker, logger.info, logger.error),
        alert=_emit_regression,
    )  # fmt: skip


def _emit_regression(regression: dict[str, object]) -> None:
    """The Prefect event of a retest that found a regression: prefect.yaml's ``notify`` deployment
    is triggered by it (its resource names the retest's MLflow run)."""
    emit_event(
        event=REGRESSION_EVENT,
        resource={
            "prefect.resource.id": f"{RETEST_RESOURCE_PREFIX}{regression['retest_run_id']}",
            "prefect.resource.name": str(regression.get("experiment", "")),
        },
        payload={"summary": regression.get("summary"), "versions": regression.get("versions")},
    )
