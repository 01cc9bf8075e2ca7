"""Prefect tasks over k3pipe's library functions, one call each (retries only for the model download)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from pydantic import SecretStr

from k3pipe.bench.health import EndpointCheck, engine_version, wait_ready
from k3pipe.bench.session import WorkloadOutcome
from k3pipe.bench.summary import client_note, summary_line, timing_note, warmup_note
from k3pipe.core.errors import ModelSourceError
from k3pipe.core.settings import Settings
from k3pipe.engines.base import Finding
from k3pipe.experiment.load import load_experiment
from k3pipe.experiment.params import RunRequest
from k3pipe.experiment.preflight import preflight
from k3pipe.experiment.speculation import SpeculationReport, judge_speculation
from k3pipe.jobs import arm_run as run
from k3pipe.jobs.prepare import reap_leftovers
from k3pipe.jobs.rerun import RerunInputs, restore, verdict_rows
from k3pipe.launchers.base import Launcher
from k3pipe.launchers.factory import pull_image
from k3pipe.machine.node import NodeInfo, gpus_here
from k3pipe.planning.coldstart import ColdStart, read_cold_start
from k3pipe.planning.plan import ArmPlan
from k3pipe.prompts.corpora import PromptSet
from k3pipe.prompts.draw import prepare_prompts
from k3pipe.records.tracking import Tracker
from k3pipe.report import build_report, publish
from k3pipe.report.retest_verdicts import build_retest_report, publish_retest
from k3pipe.schema.specs import ExperimentSpec, LocalModel, ModelScopeModel, WorkloadSpec
from k3pipe.sources import ModelRecord, fetch_model
from k3pipe.sources.images import ImageRecord


@task(name="load-experiment", cache_policy=NO_CACHE)
def load_experiment_task(source: str | RunRequest) -> ExperimentSpec:
    """The experiment of a file, or of a run request (its file or inline YAML, its overrides laid
    over every workload); a bad file or override fails here, naming the field."""
    spec = source.load() if isinstance(source, RunRequest) else load_experiment(source)
    get_run_logger().info(
        "experiment %s: %d arm(s), %d workload(s)%s",
        spec.name,
        len(spec.arms),
        len(spec.workloads),
        f"; overrides {source.overrides.describe()}" if isinstance(source, RunRequest) else "",
    )
    return spec


@task(name="preflight", cache_policy=NO_CACHE, task_run_name="preflight-{stage}")
def preflight_task(spec: ExperimentSpec, stage: str, model_dir: str | None = None) -> list[Finding]:
    """Check the experiment; errors stop the flow before anything is launched (or downloaded)."""
    logger = get_run_logger()
    # this machine (ports, GPUs) at the model stage: after this home's orphans were reaped (they would
    # hold their ports)
    here = stage == "model"
    findings = preflight(spec, model_dir=model_dir, this_machine=here, gpus=gpus_here() if here else None)
    for f in findings:
        log = {"error": logger.error, "warning": logger.warning}.get(f.severity, logger.info)
        log("preflight %s [%s] %s: %s", f.severity.upper(), f.arm or "experiment", f.rule, f.message)
    return findings


def _worth_retrying(task: Any, task_run: Any, state: Any) -> bool:
    """Retry a download, not a model that cannot be had by waiting (a missing local directory)."""
    exc = state.data
    return not (isinstance(exc, ModelSourceError) and not exc.retryable)


@task(
    name="fetch-model",
    cache_policy=NO_CACHE,
    retries=2,
    retry_delay_seconds=10,
    retry_condition_fn=_worth_retrying,
)
def fetch_model_task(name: str, spec: ModelScopeModel | LocalModel, home: Path) -> ModelRecord:
    logger = get_run_logger()
    record = fetch_model(spec, home, progress=lambda msg: logger.info("%s: %s", name, msg))
    logger.info(
        "%s: %d files, %.1f MB at %s (digest %s)",
        name,
        len(record.files),
        record.total_bytes / 1e6,
        record.path,
        record.digest()[:12],
    )
    return record


@task(name="plan-arm", cache_policy=NO_CACHE)
def plan_arm_task(
    spec: ExperimentSpec,
    arm: str,
    home: Path,
    model_dirs: dict[str, str],
    model_digests: dict[str, str] | None = None,
) -> ArmPlan:
    plan = run.plan_for(spec, arm, home, model_dirs, model_digests)
    get_run_logger().info("arm %s command: %s", arm, plan.command.shell())
    if plan.compile_cache is not None:
        get_run_logger().info("arm %s %s", arm, plan.compile_cache.describe())
    return plan


@task(name="probe-node", cache_policy=NO_CACHE)
def probe_node_task(plan: ArmPlan, settings: Settings) -> NodeInfo | None:
    node = run.node_facts(plan, settings)
    if node is not None:
        get_run_logger().info("node: %s", node.describe())
    elif plan.launch.runs_here:
        get_run_logger().info("node: no nvidia-smi on PATH, so no GPU facts are recorded")
    return node


@task(name="cold-start", cache_policy=NO_CACHE)
def cold_start_task(
    plan: ArmPlan, log_path: Path | None, cold_start_s: float | None, run_id: str
) -> ColdStart:
    cold = read_cold_start(plan, log_path, cold_start_s, run_id)
    for line in cold.log_lines():
        get_run_logger().info("%s", line)
    return cold


@task(name="reap-orphans", cache_policy=NO_CACHE)
def reap_orphans_task(
    is_running: Callable[[str], bool],
    home: Path,
    containers: bool,
    close: Callable[[Mapping[str, str]], None] | None = None,
) -> list[str]:
    """End what earlier runs killed before their teardown left behind: the engine process groups
    recorded in ``home`` whose k3pipe process is gone (``close`` then gets each one's labels, to end
    its MLflow run and flow run), and (``containers``) k3pipe's containers whose run provably ended."""
    return reap_leftovers(
        home, containers, is_running=is_running, close=close, progress=get_run_logger().warning
    )


@task(name="pull-image", cache_policy=NO_CACHE)
def pull_image_task(plan: ArmPlan) -> ImageRecord:
    logger = get_run_logger()
    record = pull_image(plan, progress=logger.info)
    logger.info(
        "image %s -> %s (%s)", plan.image, record.pinned, "pulled" if record.pulled else "already present"
    )
    return record


@task(name="start-engine", cache_policy=NO_CACHE)
def start_engine_task(
    plan: ArmPlan,
    log_path: Path,
    settings: Settings,
    api_key: SecretStr | None,
    image: ImageRecord | None = None,
    labels: dict[str, str] | None = None,
) -> Launcher:
    launcher = run.start_engine(plan, log_path, settings, api_key, image, labels)
    where = getattr(launcher, "container_id", None) or f"pid {getattr(launcher, 'pid', None)}"
    get_run_logger().info(
        "engine %s started (launcher %s, %s, log %s)", plan.engine, plan.launcher, where, log_path
    )
    return launcher


@task(name="wait-ready", cache_policy=NO_CACHE)
def wait_ready_task(plan: ArmPlan, launcher: Launcher) -> float:
    logger = get_run_logger()
    seconds = wait_ready(plan, launcher, progress=logger.info)
    if plan.health_url is None and not plan.launch.starts_engine:
        # nothing was waited for: an endpoint k3pipe did not start; the health gate is its first word
        logger.info(
            "endpoint %s: not started by k3pipe (no cold start); the health gate checks it", plan.base_url
        )
    else:
        what = "engine" if plan.launch.starts_engine else "endpoint"
        logger.info("%s answers its health URL after %.1f s (cold start)", what, seconds)
    return seconds


@task(name="health-gate", cache_policy=NO_CACHE)
def health_gate_task(plan: ArmPlan, api_key: SecretStr | None) -> EndpointCheck:
    check = run.health_gate(plan, api_key)
    get_run_logger().info(
        "%s %s serves %s; probe first delta %.3f s (%s)",
        "gateway" if plan.gateway else "endpoint",
        plan.client_base_url,
        plan.client_model,
        check.first_delta_s,
        ", ".join(check.reply_kinds),
    )
    return check


@task(name="engine-version", cache_policy=NO_CACHE)
def engine_version_task(plan: ArmPlan) -> str | None:
    return engine_version(plan)


@task(name="prepare-prompts", cache_policy=NO_CACHE)
def prepare_prompts_task(spec: ExperimentSpec, model_dir: Path, home: Path) -> dict[str, list[PromptSet]]:
    return prepare_prompts(spec.workloads, model_dir, home, progress=get_run_logger().info)


@task(name="benchmark", cache_policy=NO_CACHE, task_run_name="benchmark-{workload.name}-{repeat}")
def benchmark_task(
    plan: ArmPlan,
    workload: WorkloadSpec,
    model_dir: Path,
    api_key: SecretStr | None,
    repeat: int = 0,
    home: Path | None = None,
    prompts: PromptSet | None = None,
    launcher: Launcher | None = None,
) -> WorkloadOutcome:
    logger = get_run_logger()
    warmup = (
        f"+{workload.warmup_requests} warm-up"
        if workload.warmup == "fixed"
        else f"+ warm-up until steady within {workload.warmup_tolerance_pct:g}%, "
        f"at most {workload.warmup_requests}"
    )
    logger.info(
        "%s%s: %d requests (%s), %s dataset, %d in / %d out tokens, %s load, concurrency %d, seed %d",
        workload.name,
        f" (repeat {repeat + 1}/{workload.repeats})" if workload.repeats > 1 else "",
        workload.num_requests,
        warmup,
        workload.dataset.kind,
        workload.input_tokens,
        workload.output_tokens,
        workload.load,
        workload.concurrency,
        workload.seed + repeat,
    )
    outcome = run.benchmark(
        plan, workload, model_dir, api_key, repeat, home, prompts, progress=logger.info, launcher=launcher
    )
    if outcome.engine_lost:
        logger.error("%s: ended early: %s", workload.name, outcome.engine_lost)
    m = outcome.metrics()
    logger.info(summary_line(workload.name, m, outcome.summary.itl_basis))
    for note in (timing_note(m), client_note(m), warmup_note(m, workload.warmup)):
        if note:
            logger.warning("%s: %s", workload.name, note)
    for d in outcome.discrepancies:
        logger.warning("%s: client and engine disagree: %s", workload.name, d.message)
    return outcome


@task(name="judge-speculation", cache_policy=NO_CACHE)
def judge_speculation_task(
    spec: ExperimentSpec, rows: list[dict[str, Any]], log_accept_length: Mapping[str, float] | None = None
) -> SpeculationReport:
    """Each speculative arm against its plain baseline, workload by workload
    (k3pipe.experiment.speculation)."""
    logger = get_run_logger()
    report = judge_speculation(spec, rows, log_accept_length=log_accept_length)
    for arm in report.arms:
        logger.info("speculation %s: baseline %s", arm.arm, arm.baseline.reason)
    for f in report.findings:
        logger.warning("speculation [%s] %s: %s", f.arm, f.rule, f.message)
    for line in report.summary_lines():
        logger.info("%s", line)
    return report


@task(name="restore-run", cache_policy=NO_CACHE)
def restore_run_task(tracker: Tracker, run_id: str, home: Path, allow_drift: bool) -> RerunInputs:
    """The recorded run's inputs, each verified (model files, image digest, prompts)."""
    logger = get_run_logger()
    inputs = restore(tracker, run_id, home, allow_drift, progress=logger.info)
    for drift in inputs.drift:
        logger.warning("rerun with drift (--allow-drift): %s", drift)
    logger.info("rerun of %s (arm %s of %s)", inputs.run_id, inputs.record.arm, inputs.record.experiment_name)
    return inputs


@task(name="rerun-verdict", cache_policy=NO_CACHE)
def rerun_verdict_task(tracker: Tracker, original: str, rerun: str) -> list[dict[str, Any]]:
    """Each workload of the rerun against the original (per metric: different, equivalent or
    inconclusive), in the log too."""
    return verdict_rows(tracker, original, rerun, say=get_run_logger().info)


@task(name="report", cache_policy=NO_CACHE)
def report_task(tracker: Tracker, study_run_id: str, out_dir: Path) -> dict[str, str]:
    """The study's report from MLflow, written under ``out_dir``, attached to the study's run, and
    published as Prefect artifacts (the Markdown and the results table)."""
    logger = get_run_logger()
    report = build_report(tracker, study_run_id)
    paths = publish(tracker, report, out_dir)
    create_markdown_artifact(
        markdown=report.markdown, key="study-report", description=f"{report.data.name}: the study's report"
    )
    create_table_artifact(
        table=report.table_rows(), key="study-results", description=f"{report.data.name}: the results table"
    )
    logger.info("study results:\n%s", report.text())
    for flag in [b for b in report.analysis.bounds if b.exceeds]:
        logger.warning(
            "%s %s: %s %.1f tok/s is above its physical ceiling %.1f tok/s",
            flag.arm, flag.workload, flag.figure, flag.claimed_tps, flag.ceiling_tps,
        )  # fmt: skip
    logger.info("report: %s (HTML: %s)", paths["markdown"], paths["html"])
    return {k: str(v) for k, v in paths.items()}


@task(name="retest-report", cache_policy=NO_CACHE)
def retest_report_task(tracker: Tracker, retest_run_id: str, out_dir: Path) -> dict[str, str]:
    """The retest's report (each variant against the baseline) from MLflow, written under
    ``out_dir``, attached to the retest's run, and published as Prefect artifacts."""
    logger = get_run_logger()
    report = build_retest_report(tracker, retest_run_id)
    paths = publish_retest(tracker, report, out_dir)
    create_markdown_artifact(
        markdown=report.markdown, key="retest-report", description=f"{report.data.name}: the retest's report"
    )
    rows = report.table_rows()
    if rows:
        create_table_artifact(
            table=rows, key="retest-verdicts", description=f"{report.data.name}: each variant's verdicts"
        )
    logger.info("retest verdicts:\n%s", report.text())
    logger.info("report: %s (HTML: %s)", paths["markdown"], paths["html"])
    return {k: str(v) for k, v in paths.items()}
