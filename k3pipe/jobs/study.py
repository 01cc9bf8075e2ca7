"""The study job: every arm x every workload of an experiment under one parent MLflow run (the arms
nested under it, the next arm's inputs fetched while one arm runs), then the study's report, built
once, here. ``flows/study.py`` runs it with its Prefect tasks; :meth:`Job.library` runs it without.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from k3pipe.core.errors import PartlyFailedError, RerunError, SpecError, first_line
from k3pipe.core.layout import DRIFT_TAG, RERUN_TAG, RERUN_VERDICT_TAG, RERUN_VERDICTS_FILE, RESUME_TAG
from k3pipe.core.secrets import scrub
from k3pipe.experiment.params import INLINE_SOURCE, RunRequest
from k3pipe.experiment.speculation import speculation_setting
from k3pipe.jobs.arm_run import ArmOutcome
from k3pipe.jobs.prepare import Prepared, check_spec, prepare
from k3pipe.jobs.rerun import RerunInputs, study_verdicts
from k3pipe.jobs.resume import ResumeError, check_experiment, check_prompts, reopen, resume_point, study_lock
from k3pipe.jobs.steps import Job, judge_speculation, report_needs_mlflow
from k3pipe.jobs.study_run import Study, StudySteps, start_study
from k3pipe.machine.node import node_here
from k3pipe.prompts.corpora import PromptSet
from k3pipe.records.design import design_lines, load_history
from k3pipe.records.runrecord import prompts_digest
from k3pipe.report import report_dir
from k3pipe.report.collect import collect
from k3pipe.schema.specs import ExperimentSpec
from k3pipe.sources import ModelRecord

__all__ = ["ArmsFailed", "StudyRequest", "StudyResult", "rerun", "resume", "run_study", "study"]


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
    rerun_of: str | None = None
    """A rerun: the study it repeats."""
    verdicts: list[dict[str, Any]] = field(default_factory=list)
    """A rerun: per arm and launch, each workload against the original's (``rerun.verdict_rows``)."""

    def as_dict(self) -> dict[str, Any]:
        """What the flow returns (the arms as outcome dicts)."""
        out: dict[str, Any] = {
            "study_run_id": self.study_run_id,
            "arms": [o.as_dict() for o in self.arms],
            "report": self.report,
        }
        if self.rerun_of is not None:
            out |= {"rerun_of": self.rerun_of, "verdicts": self.verdicts}
        return out


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
    _say_design(spec, request.arms, job)
    with study_lock(job.home, run_id):
        try:
            # the first model now (the prompts are drawn with its tokenizer); the others in the background
            pruned: dict[str, str] = {}  # a search's candidates preflight found cannot start
            check_spec(spec, request.arms, tracker, job.steps.prepare, job.tags, run_id, pruned)
            began = time.perf_counter()
            prepared = prepare(
                spec, request.arms, tracker, job.home, job.steps.prepare, tags=job.tags, parent_id=run_id,
                models=request.models, prompts=request.prompts, extra_models=False, spec_checked=True,
                pruned=pruned,
            )  # fmt: skip
            for name, why in pruned.items():
                job.note("tune: candidate %s cannot start (preflight), left out: %s", name, why)
            before = time.perf_counter() - began
        except BaseException:
            tracker.end_run(run_id, "FAILED")
            raise
        study = _study(
            spec, run_id, request.experiment, request.arms, prepared, before, request.params, tags, job
        )
        study.pruned = pruned
        return _finish(study, job)


def _say_design(spec: ExperimentSpec, arms: list[str], job: Job) -> None:
    """The design's cost and what it can see, from this node's records (k3pipe.records.design); a fleet's
    launches run on other nodes, whose records this one cannot speak for."""
    try:
        history = None if spec.fleet is not None else load_history(job.tracker, spec, node_here(), job.home)
        for line in design_lines(spec, history, arms):
            job.say("%s", line)
    except Exception as exc:  # a preview: never a reason not to run
        job.note("the study's design could not be previewed: %s: %s", type(exc).__name__, exc)


def resume(run_ref: str, job: Job, experiment: tuple[ExperimentSpec, str] | None = None) -> StudyResult:
    """The recorded study ``run_ref`` (its run id, or a unique prefix) resumed: its launches that
    finished kept, the others run (one that did not finish, on a new engine start from its first
    workload that did not finish cleanly), under its own run, with its own experiment and overrides
    and the prompts it drew (checked against their digests); the report of the whole study at the end
    (k3pipe.jobs.resume says why a workload is the smallest unit kept). ``experiment``: a
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
            pruned: dict[str, str] = {}  # a search's candidates preflight left out, again
            prepared = prepare(
                spec, point.arms, tracker, job.home, job.steps.prepare, tags=job.tags, parent_id=run_id,
                extra_models=False, pruned=pruned,
            )  # fmt: skip
            check_prompts(point, prepared.prompts)
            before = time.perf_counter() - began
        except BaseException:
            tracker.end_run(run_id, "FAILED")
            raise
        tags = {**job.tags, RESUME_TAG: str(point.resumes + 1)}
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
        study.pruned = pruned
        return _finish(study, job)


def rerun(
    run_ref: str,
    job: Job,
    allow_drift: bool = False,
    parent_run_id: str | None = None,
    tags: dict[str, str] | None = None,
) -> StudyResult:
    """The recorded study ``run_ref`` run again from its records alone, as a new study: every arm
    from its first finished launch's record (its image pinned to the recorded digest, its models
    verified or fetched at their recorded content, the prompts it sent, checked against their
    digests), in the study's own order, launches and overrides; then each arm of the rerun against
    the original's over all their launches with the verdict rules (``rerun.study_verdicts``), on the
    new study's run
    (``rerun_verdicts.json``, tag ``k3pipe.rerun_verdict``) and in what it returns. Raises
    :class:`RerunError` before anything starts when an input cannot be had exactly (unless
    ``allow_drift``), :class:`ArmsFailed` after the verdicts when an arm of the rerun failed.
    ``parent_run_id`` and ``tags``: the new study nested under a retest's rerun."""
    tracker = job.tracker
    point = resume_point(tracker, run_ref)
    original = point.run_id
    names = [a.name for a in point.spec.arms if a.name in point.arms]
    restored: dict[str, RerunInputs] = {}
    for name in names:
        launches = sorted(k for (arm, k) in point.done if arm == name and k > 0)
        if not launches:
            raise RerunError(
                f"study {point.name} (run {original}): arm {name!r} has no finished launch to rerun from; "
                f"resume the study first (`k3pipe study --resume {original}`), or rerun its arms one by "
                "one (`k3pipe rerun ARM_RUN_ID`)"
            )
        job.say("rerun of study %s: restoring arm %s from its launch %d", point.name, name, launches[0])
        arm_run_id = point.done[(name, launches[0])]
        restored[name] = job.steps.restore_run(tracker, arm_run_id, job.home, allow_drift)
    first = restored[names[0]]
    digests = {k: [prompts_digest(s) for s in v] for k, v in first.prompts.items()}
    for name, inputs in restored.items():
        if {k: [prompts_digest(s) for s in v] for k, v in inputs.prompts.items()} != digests:
            raise RerunError(
                f"study {point.name}: arms {names[0]!r} and {name!r} recorded different prompts, so the "
                "study cannot be rerun as one; rerun its arms one by one (`k3pipe rerun ARM_RUN_ID`)"
            )
    arms = [restored[a.name].spec.arm(a.name) if a.name in restored else a for a in point.spec.arms]
    spec = point.spec.model_copy(update={"arms": arms})
    drift = sorted({d for inputs in restored.values() for d in inputs.drift})
    marks = {RERUN_TAG: original} | ({DRIFT_TAG: " | ".join(drift)[:4000]} if drift else {})
    request = StudyRequest(
        spec,
        point.experiment_file or INLINE_SOURCE,
        point.arms,
        params=dict(point.params),
        parent_run_id=parent_run_id,
        tags={**(tags or {}), **marks},
        models=dict(first.models),
        prompts=dict(first.prompts),
    )
    try:
        result = run_study(request, job)
    except ArmsFailed as failed:
        failed.study.rerun_of = original
        failed.study.verdicts = _rerun_verdicts(job, original, failed.study)
        failed.result = failed.study.as_dict()  # what the command prints: the verdicts included
        raise
    result.rerun_of = original
    result.verdicts = _rerun_verdicts(job, original, result)
    return result


def _rerun_verdicts(job: Job, original: str, result: StudyResult) -> list[dict[str, Any]]:
    """Each arm of the rerun against the same arm of ``original``, workload by workload, over all
    their launches with whole repeats (k3pipe.jobs.rerun.study_verdicts), recorded."""
    before, after = collect(job.tracker, original), collect(job.tracker, result.study_run_id)
    out = []
    for v in study_verdicts(before, after):
        row = {
            "arm": v.arm,
            "launches": v.launches,
            "workload": v.workload,
            "verdict": v.summary,
            "original": v.original,
            "rerun": v.rerun,
            "metrics": [c.model_dump() for c in v.rows],
        }
        out.append(row)
        job.say("rerun of study: %s / %s (launches %s): %s", v.arm, v.workload, v.launches, v.summary)
    job.tracker.log_dict(result.study_run_id, out, RERUN_VERDICTS_FILE)
    summary = "; ".join(f"{v['arm']}/{v['workload']}: {v['verdict']}" for v in out)
    job.tracker.set_tags(result.study_run_id, {RERUN_VERDICT_TAG: scrub(summary)[:4000] or "none"})
    return out


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
