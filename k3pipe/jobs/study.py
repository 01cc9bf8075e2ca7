"""The study job: every arm x every workload of an experiment under one parent MLflow run (the arms
nested under it, the next arm's inputs fetched while one arm runs), then the study's report, built
once, here. ``flows/study.py`` runs it with its Prefect tasks; :meth:`Job.library` runs it without.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from k3pipe.bench.corpora import PromptSet
from k3pipe.errors import PartlyFailedError, SpecError, first_line
from k3pipe.jobs.prepare import Prepared, check_spec, prepare
from k3pipe.jobs.steps import Job, judge_speculation, report_needs_mlflow
from k3pipe.params import INLINE_SOURCE, RunRequest
from k3pipe.report import report_dir
from k3pipe.resume import ResumeError, check_experiment, check_prompts, reopen, resume_point, study_lock
from k3pipe.run import ArmOutcome
from k3pipe.secrets import scrub
from k3pipe.sources import ModelRecord
from k3pipe.specs import ExperimentSpec
from k3pipe.speculation import speculation_setting
from k3pipe.study import Study, StudySteps, start_study

__all__ = ["ArmsFailed", "StudyRequest", "StudyResult", "resume", "run_study", "study"]


class ArmsFailed(PartlyFailedError):
    """Some arm of the study did not finish; raised after the report (``study`` is the study's
    result, ``result`` the flow's dict of it)."""

    def __init__(self, message: str, study: StudyResult) -> None:
        super().__init__(message, study.as_dict())
        self.study = study


@dataclass
class StudyRequest:
    """A study of ``spec``'s ``arms``: ``experiment`` names where the spec came from (a file, or
    inline YAML); ``params`` go on its run and its arms' (the overrides); nested under
    ``parent_run_id`` with ``tags`` when it is part of a retest; ``models`` and ``prompts`` given
    when the caller already has them (a retest's variants share them)."""

    spec: ExperimentSpec
    experiment: str
    arms: list[str]
    params: dict[str, Any] = field(default_factory=dict)
    parent_run_id: str | None = None
    tags: dict[str, str] = field(default_factory=dict)
    models: dict[str, ModelRecord] | None = None
    prompts: dict[str, list[PromptSet]] | None = None


@dataclass
class StudyResult:
    """The study's MLflow run, each launch's outcome (arm, launch, status, run id, workload rows)
    and the report's paths (markdown, html, text, plots)."""

    study_run_id: str
    arms: list[ArmOutcome]
    report: dict[str, str]

    def as_dict(self) -> dict[str, Any]:
        """What the flow returns (the arms as outcome dicts)."""
        return {
            "study_run_id": self.study_run_id,
            "arms": [o.as_dict() for o in self.arms],
            "report": self.report,
        }


def study(request: RunRequest, job: Job) -> StudyResult:
    """The study of a run request: its experiment loaded (overrides laid over), its arms named."""
    spec = job.steps.load_experiment(request)
    selected = request.arm_names(spec)  # unknown arm names fail before anything starts
    return run_study(StudyRequest(spec, request.source, selected, params=request.overrides.params()), job)


def run_study(request: StudyRequest, job: Job) -> StudyResult:
    """The study's run, preflight, the first model and the prompts (unless given), the arms, the
    report. Raises :class:`ArmsFailed` after the report when an arm failed."""
    spec, tracker = request.spec, job.tracker
    if spec.fleet is not None and job.fleet is None:
        raise SpecError(
            f"experiment {spec.name} spreads its launches over work pools ({', '.join(spec.fleet.pools)}), "
            "which only the study flow on a Prefect server can do: start it as a run of the study "
            "deployment (`prefect deployment run study/study`, or from the UI), with a worker serving "
            "each pool (`k3pipe stack add-node NAME` prints its command); or drop fleet to run here"
        )
    tags = {**job.tags, **request.tags}
    run_id = start_study(
        tracker, spec, request.experiment, tags, request.params, parent_id=request.parent_run_id,
        arms=request.arms,
    )  # fmt: skip
    job.say("study %s: MLflow run %s; arms %s", spec.name, run_id, ", ".join(request.arms))
    with study_lock(job.home, run_id):
        try:
            # the first model now (the prompts are drawn with its tokenizer); the others in the background
            check_spec(spec, request.arms, tracker, job.steps.prepare, job.tags, run_id)
            began = time.perf_counter()
            prepared = prepare(
                spec, request.arms, tracker, job.home, job.steps.prepare, tags=job.tags, parent_id=run_id,
                models=request.models, prompts=request.prompts, extra_models=False, spec_checked=True,
            )  # fmt: skip
            before = time.perf_counter() - began
        except BaseException:
            tracker.end_run(run_id, "FAILED")
            raise
        study = _study(
            spec, run_id, request.experiment, request.arms, prepared, before, request.params, tags, job
        )
        return _finish(study, job)


def resume(run_ref: str, job: Job, experiment: tuple[ExperimentSpec, str] | None = None) -> StudyResult:
    """The recorded study ``run_ref`` (its run id, or a unique prefix) resumed: its launches that
    finished kept, the others run (one that did not finish, on a new engine start from its first
    workload that did not finish cleanly), under its own run, with its own experiment and overrides
    and the prompts it drew (checked against their digests); the report of the whole study at the end
    (k3pipe.resume says why a workload is the smallest unit kept). ``experiment``: a
    spec (and where it came from) that must be the study's own. Raises :class:`ResumeError` when it
    cannot be resumed, :class:`ArmsFailed` after the report when an arm failed again."""
    tracker = job.tracker
    point = resume_point(tracker, run_ref)
    if experiment is not None:
        check_experiment(point, *experiment)
    with study_lock(job.home, point.run_id):
        if point.status == "FINISHED" and not point.unfinished:
            raise ResumeError(
                f"study {point.name} (run {point.run_id}) finished with every launch: nothing is left to "
                f"run; its report: `k3pipe report {point.run_id}`"
            )
        spec, run_id = point.spec, point.run_id
        job.say("resuming %s", point.summary())
        reopen(tracker, point)
        try:
            began = time.perf_counter()
            prepared = prepare(
                spec, point.arms, tracker, job.home, job.steps.prepare, tags=job.tags, parent_id=run_id,
                extra_models=False,
            )  # fmt: skip
            check_prompts(point, prepared.prompts)
            before = time.perf_counter() - began
        except BaseException:
            tracker.end_run(run_id, "FAILED")
            raise
        tags = {**job.tags, "k3pipe.resume": str(point.resumes + 1)}
        study = _study(
            spec,
            run_id,
            point.experiment_file or INLINE_SOURCE,
            point.arms,
            prepared,
            before,
            point.params,
            tags,
            job,
        )
        study.done, study.prior_stages, study.prior_wall_s = point.done, point.stages, point.wall_s
        study.kept = point.kept
        return _finish(study, job)


def _study(
    spec: ExperimentSpec,
    run_id: str,
    experiment: str,
    arms: list[str],
    prepared: Prepared,
    before: float,
    params: dict[str, Any],
    tags: dict[str, str],
    job: Job,
) -> Study:
    steps = StudySteps(
        fetch_model=job.steps.prepare.fetch_model,  # from a background lane: still a task of this flow
        pull_image=job.steps.arm.pull_image,
        arm=job.steps.arm,
    )
    remote = job.fleet(spec.fleet, run_id) if spec.fleet is not None and job.fleet is not None else None
    return Study(
        spec, run_id, job.tracker, job.settings, prepared.models, prepared.prompts, prepared.findings,
        experiment, steps, tags=tags, labels=job.labels, params=dict(params),
        arms=arms, before_s=before, say=job.say, warn=job.warn, remote=remote,
    )  # fmt: skip


def _finish(study: Study, job: Job) -> StudyResult:
    """The study's launches run, speculation judged, the report built; :class:`ArmsFailed` after it
    when an arm did not finish."""
    spec, tracker, run_id = study.spec, job.tracker, study.run_id
    outcome = study.execute()
    outcomes = list(outcome.arms)
    if any(speculation_setting(spec.arm(name)) for name in study.arms or []):
        # judged on each arm's first launch (the judge pairs one run per arm)
        judge_speculation(job, spec, [o for o in outcomes if o.launch == 1])
    report_needs_mlflow(tracker, run_id)
    paths = job.steps.report(tracker, run_id, report_dir(job.home, spec.name, run_id))
    job.publish_link(run_id, f"MLflow run of study {spec.name}", "mlflow-study")
    result = StudyResult(run_id, outcomes, paths)
    if outcome.failed:
        details = "; ".join(f"{o.arm}: {first_line(o.error or o.status)}" for o in outcome.failed)
        why = f"arm(s) did not finish cleanly ({details}); the report covers the others: {paths['html']}"
        raise ArmsFailed(scrub(why), result)
    return result
