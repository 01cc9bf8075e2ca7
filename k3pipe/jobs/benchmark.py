"""The benchmark job: each arm of an experiment in turn (launch, health gate, workloads, teardown,
all in MLflow), or one arm run again from its record alone (a rerun: the same verified model files,
image digest, prompts and seeds) and judged against the original. ``flows/benchmark.py`` runs it
with its Prefect tasks; :meth:`Job.library` runs it without.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from k3pipe.core.errors import RunFailedError, SpecError, first_line
from k3pipe.core.secrets import scrub
from k3pipe.experiment.params import RunRequest
from k3pipe.experiment.speculation import speculation_setting
from k3pipe.jobs.arm_run import ArmOutcome, ArmRun
from k3pipe.jobs.prepare import prepare
from k3pipe.jobs.rerun import RerunInputs
from k3pipe.jobs.steps import Job, judge_speculation
from k3pipe.records.derive import summary_table

__all__ = ["BenchmarkRequest", "BenchmarkResult", "benchmark"]


@dataclass(frozen=True)
class BenchmarkRequest:
    """Either a run request (the experiment, its arms, its overrides), or ``rerun_of``: an arm's
    MLflow run id, run again exactly as recorded (``allow_drift``: even though a model file differs
    from the record; the difference is recorded)."""

    run: RunRequest | None = None
    rerun_of: str | None = None
    allow_drift: bool = False

    def __post_init__(self) -> None:
        if self.rerun_of and self.run is not None:
            run = self.run
            if run.overrides.changes() or run.experiment_yaml or run.arms:
                raise SpecError(
                    "rerun_of runs an arm again exactly as recorded: leave experiment_yaml, arms and "
                    f"overrides empty (got overrides {run.overrides.describe()}, arms {run.arms or 'none'})"
                )
        if not self.rerun_of and self.run is None:
            raise SpecError("a benchmark needs an experiment (a run request) or rerun_of (an arm's run id)")


@dataclass
class BenchmarkResult:
    """Each arm's outcome in the order the arms ran (status, MLflow run id, workload rows; a rerun's
    original and its verdicts against it)."""

    arms: list[ArmOutcome]

    def as_list(self) -> list[dict[str, Any]]:
        """What the flow returns: an outcome dict per arm."""
        return [o.as_dict() for o in self.arms]


def benchmark(request: BenchmarkRequest, job: Job) -> BenchmarkResult:
    """Every selected arm, one after another. Raises :class:`RunFailedError` naming the arms that did
    not finish, after every arm ran."""
    tracker = job.tracker
    rerun: RerunInputs | None = None
    if request.rerun_of:
        rerun = job.steps.restore_run(tracker, request.rerun_of, job.home, request.allow_drift)
        spec, experiment = rerun.spec, rerun.record.experiment_file
        selected = [a.name for a in spec.arms]
        params: dict[str, Any] = {}
    else:
        run = request.run
        assert run is not None  # __post_init__ holds it
        spec, experiment = job.steps.load_experiment(run), run.source
        selected = run.arm_names(spec)  # unknown arm names fail before anything starts
        params = run.overrides.params()
    # preflight before the (possibly hours-long) download, and again with the model's config.json;
    # every workload's prompts before any launch: a dataset that cannot give them fails here
    prepared = prepare(
        spec, selected, tracker, job.home, job.steps.prepare, tags=job.tags,
        models=rerun.models if rerun is not None else None,
        prompts=rerun.prompts if rerun is not None else None,
    )  # fmt: skip
    outcomes = []
    for name in selected:
        arm = ArmRun(
            spec, name, prepared.models, prepared.prompts, tracker, job.settings, prepared.findings,
            experiment, job.steps.arm, tags=job.tags, labels=job.labels, rerun=rerun, params=dict(params),
            say=job.say, warn=job.warn,
        )  # fmt: skip
        outcomes.append(arm.execute())
    if any(speculation_setting(spec.arm(name)) for name in selected):
        judge_speculation(job, spec, outcomes)
    table = summary_table([row for o in outcomes for row in o.workloads])
    if table:
        job.table(table, "benchmark-summary", f"{spec.name}: workload summaries")
    for o in outcomes:
        job.publish_link(o.mlflow_run_id, f"MLflow run of {o.arm}", f"mlflow-{o.arm}")
    if rerun is not None:
        for o in outcomes:
            o.rerun_of = rerun.run_id
            o.verdicts = job.steps.rerun_verdict(tracker, rerun.run_id, o.mlflow_run_id)
    bad = [o for o in outcomes if o.status != "FINISHED"]
    if bad:
        details = "; ".join(f"{o.arm}: {first_line(o.error or o.status)}" for o in bad)
        raise RunFailedError(scrub(f"arm(s) did not finish cleanly ({details}); see their MLflow runs"))
    return BenchmarkResult(outcomes)
