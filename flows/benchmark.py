"""The benchmark flow: for each engine arm, launch -> health gate -> workloads -> teardown, all in MLflow.

prefect: python -m flows.benchmark experiments/demo-cpu.yaml   (or `k3pipe run`, or the deployment)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any
from uuid import UUID

from prefect import flow, get_client, get_run_logger
from prefect.artifacts import create_link_artifact, create_table_artifact
from prefect.context import get_run_context

from k3pipe.bench.corpora import PromptSet
from k3pipe.engines.base import Finding
from k3pipe.errors import BenchmarkError, PreflightError
from k3pipe.launchers import Launcher
from k3pipe.node import nvidia_smi_report
from k3pipe.record import ArmRecorder, record_preflight_stop, record_speculation, summary_table
from k3pipe.rerun import RERUN_TAG, RerunInputs
from k3pipe.settings import Settings, read_secret
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


def _flow_run_id() -> str:
    try:
        return str(get_run_context().flow_run.id)  # type: ignore[union-attr]
    except Exception:
        return "none"


def _flow_run_is_running(flow_run_id: str) -> bool:
    """Whether a flow run (from a container's label) is still going; unknown ids are not."""
    if flow_run_id == _flow_run_id():
        return True
    try:
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(UUID(flow_run_id)).state
    except Exception:
        return False
    return state is not None and not state.is_final()


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
) -> dict[str, Any]:
    logger = get_run_logger()
    home = settings.home_dir
    dirs = {
        "model": models["model"].path,
        **{f"models.{k}": r.path for k, r in models.items() if k != "model"},
    }
    plan = plan_arm_task(spec, arm, home, dirs, {k: r.digest() for k, r in models.items()})
    key = read_secret(plan.api_key_env)
    if key is not None:
        tracker.add_secret(key.get_secret_value())
    tags = {"prefect.flow_run_id": _flow_run_id()}
    if rerun is not None:
        tags[RERUN_TAG] = rerun.run_id
        if rerun.drift:
            tags["k3pipe.rerun_drift"] = "; ".join(rerun.drift)
    recorder = ArmRecorder(tracker, plan, tags=tags)
    if rerun is not None:
        recorder.rerun_of, recorder.drift = rerun.run_id, list(rerun.drift)
    log_path = home / "logs" / f"{spec.name}-{arm}-{time.strftime('%Y%m%d-%H%M%S')}-{recorder.run_id[:8]}.log"
    outcome: dict[str, Any] = {"arm": arm, "mlflow_run_id": recorder.run_id, "status": "FAILED"}
    launcher: Launcher | None = None
    status = "FAILED"
    error: BaseException | None = None
    try:
        recorder.log_plan(spec, experiment, models)
        recorder.log_prompts(spec.workloads, prompts)
        recorder.log_preflight(findings)
        image = None
        if plan.launcher == "docker":
            image = pull_image_task(plan)
            recorder.log_image(image, plan)
        labels = {"k3pipe.flow_run_id": _flow_run_id(), "k3pipe.mlflow_run_id": recorder.run_id}
        recorder.log_node(probe_node_task(plan, settings))
        launcher = start_engine_task(plan, log_path, settings, image, labels)
        cold = wait_ready_task(plan, launcher)
        check = health_gate_task(plan)
        recorder.log_engine(cold if plan.health_url else None, engine_version_task(plan), check)
        if plan.launcher != "external":
            recorder.log_cold_start(cold_start_task(plan, log_path, cold, recorder.run_id))
        # rows are kept as each workload ends: a later failure must not drop them from the summary
        rows: list[dict[str, Any]] = outcome.setdefault("workloads", [])
        for workload in spec.workloads:
            for repeat in range(workload.repeats):
                measured = benchmark_task(
                    plan, workload, Path(models["model"].path), repeat, home, prompts[workload.name][repeat]
                )
                recorder.log_workload(workload, measured)
            rows.append({"arm": arm, "workload": workload.name, **recorder.workload_metrics(workload.name)})
        failed = sum(float(r.get("failed") or 0) for r in rows)
        status = "FINISHED" if failed == 0 else "FAILED"
        if failed:
            error = RuntimeError("some requests failed; see requests.parquet of each workload")
    except KeyboardInterrupt as exc:
        status, error = "KILLED", exc
        raise
    except Exception as exc:
        # recorded in MLflow and in the outcome; the flow fails after the other arms have run
        status, error = "FAILED", exc
        outcome["error"] = f"{type(exc).__name__}: {exc}"
        logger.error("arm %s failed: %s", arm, outcome["error"])
    except BaseException as exc:
        status, error = "KILLED", exc
        raise
    finally:
        # teardown runs on every path, Ctrl-C included, so it calls the library, not a task
        if launcher is not None:
            logger.info("stopping engine (%s)", plan.launcher)
            launcher.stop()
            if plan.launcher != "external":
                recorder.log_nvidia_smi_after(nvidia_smi_report())
        recorder.finish(
            status, error, log_path if launcher is not None and plan.launcher != "external" else None
        )
        outcome["status"] = status
        facts = recorder.engine_log_facts
        if facts is not None and facts.spec_accept_length_mean is not None:
            outcome["engine_log_spec_accept_length_mean"] = facts.spec_accept_length_mean
        logger.info("arm %s: %s; MLflow run %s", arm, status, recorder.run_id)
    return outcome


def _stop_on_errors(findings: list[Finding], spec: ExperimentSpec, arms: list[str], tracker: Tracker) -> None:
    """Preflight errors end the flow before any launch; each arm's run records why."""
    errors = [f for f in findings if f.severity == "error" and f.arm in (None, *arms)]
    if not errors:
        return
    for arm in arms:
        record_preflight_stop(tracker, spec.name, arm, findings, {"prefect.flow_run_id": _flow_run_id()})
    summary = "; ".join(f"[{f.arm or 'experiment'}] {f.message}" for f in errors)
    raise PreflightError(f"preflight found {len(errors)} error(s), nothing was launched: {summary}")


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


@flow(name="benchmark")
def benchmark(
    experiment: str = "experiments/demo-cpu.yaml",
    arms: list[str] | None = None,
    rerun_of: str | None = None,
    allow_drift: bool = False,
) -> list[dict[str, Any]]:
    """Run every arm (or the named ``arms``) of the experiment file and record it in MLflow; with
    ``rerun_of`` (an arm's MLflow run id), run that arm again from its record alone (``experiment``
    and ``arms`` are then not used): the same verified model files, image digest, prompts and seeds."""
    logger = get_run_logger()
    settings = Settings()
    home = settings.home_dir
    tracker = Tracker(settings.tracking_uri(), settings.mlflow_experiment, settings.artifact_root())
    rerun = restore_run_task(tracker, rerun_of, home, allow_drift) if rerun_of else None
    spec = rerun.spec if rerun is not None else load_experiment_task(experiment)
    if rerun is not None:
        experiment = rerun.record.experiment_file
    selected = arms if rerun is None and arms else [a.name for a in spec.arms]
    for name in selected:
        spec.arm(name)  # unknown arm names fail before anything starts
    # preflight before the (possibly hours-long) download, and again with the model's config.json
    _stop_on_errors(preflight_task(spec, "spec"), spec, selected, tracker)
    if any(spec.arm(name).launcher.kind == "docker" for name in selected):
        reap_orphans_task(_flow_run_is_running)
    if rerun is not None:
        models = rerun.models
    else:
        models = {"model": fetch_model_task("model", spec.model, home)}
        for name, extra in spec.extra_models.items():
            models[name] = fetch_model_task(name, extra, home)
    findings = preflight_task(spec, "model", models["model"].path)
    _stop_on_errors(findings, spec, selected, tracker)
    # every workload's prompts before any launch: a dataset that cannot give them fails the flow here
    if rerun is not None:
        prompts = rerun.prompts
    else:
        try:
            prompts = prepare_prompts_task(spec, Path(models["model"].path), home)
        except BenchmarkError as exc:
            dataset_error = Finding(severity="error", rule="dataset", arm=None, message=str(exc))
            _stop_on_errors([dataset_error], spec, selected, tracker)
            raise
    outcomes = []
    for name in selected:
        outcomes.append(
            _run_arm(spec, experiment, name, models, tracker, settings, findings, prompts, rerun)
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
        details = "; ".join(f"{o['arm']}: {o.get('error', o['status'])}" for o in outcomes if o["arm"] in bad)
        raise RuntimeError(f"arm(s) did not finish cleanly ({details}); see their MLflow runs")
    return outcomes


@flow(name="rerun")
def rerun(run_id: str, allow_drift: bool = False) -> list[dict[str, Any]]:
    """Run an arm's MLflow run again from its record alone, and compare the new run with it."""
    return benchmark(rerun_of=run_id, allow_drift=allow_drift)


if __name__ == "__main__":
    benchmark(sys.argv[1] if len(sys.argv) > 1 else "experiments/demo-cpu.yaml")
