"""The retest job: an experiment's baseline and its variants (the study's checklist as code), each run
as a study nested under one parent MLflow run, then every variant judged against the baseline (better,
worse, equivalent within the margin or inconclusive, with the interval of the change) in the
retest's report. ``flows/retest.py`` runs it with its Prefect tasks; :meth:`Job.library` without.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3pipe.core.errors import PartlyFailedError
from k3pipe.core.layout import (
    EXPERIMENT_FILE,
    FAILED_PREFIX,
    FAILED_VARIANTS_TAG,
    RERUN_TAG,
    RETEST_RUN_TAG,
    VARIANT_TAG,
    RunTags,
)
from k3pipe.core.secrets import scrub
from k3pipe.experiment.params import RunRequest
from k3pipe.jobs.alerts import check_regression, record_regression
from k3pipe.jobs.prepare import check_spec
from k3pipe.jobs.retest_run import describe_retest, retest_targets, start_retest, workloads_key
from k3pipe.jobs.steps import Job, report_needs_mlflow
from k3pipe.jobs.study import ArmsFailed, StudyRequest, StudyResult, run_study
from k3pipe.prompts.corpora import PromptSet
from k3pipe.report import retest_dir

__all__ = ["RetestResult", "VariantsFailed", "rerun_retest", "retest"]


class VariantsFailed(PartlyFailedError):
    """Some study of the retest did not finish; raised after the report (``result`` is the retest's)."""


@dataclass
class RetestResult:
    """The retest's MLflow run, each study's result by label (baseline, variants), why each failed
    study failed, and the report's paths."""

    retest_run_id: str
    studies: dict[str, StudyResult]
    failed: dict[str, str]
    report: dict[str, str]
    rerun_of: str | None = None
    """A rerun: the retest it repeats (each study's verdicts against its original are its own)."""

    def as_dict(self) -> dict[str, Any]:
        """What the flow returns (each study as its flow's dict)."""
        out: dict[str, Any] = {
            "retest_run_id": self.retest_run_id,
            "studies": {label: s.as_dict() for label, s in self.studies.items()},
            "failed": self.failed,
            "report": self.report,
        }
        if self.rerun_of is not None:
            out["rerun_of"] = self.rerun_of
        return out


def _check_regression(job: Job, run_id: str, metrics: tuple[str, ...], margin_pct: float) -> None:
    """The retest's baseline against the series of earlier retests (k3pipe.jobs.alerts): recorded on its
    run; a regression said, and raised as an alert. An analysis after the fact: when it cannot be
    made, say why and go on."""
    try:
        check = check_regression(job.tracker, run_id, metrics, margin_pct)
        record_regression(job.tracker, check)
    except Exception as exc:
        why = f"{type(exc).__name__}: {exc}"
        job.note("the retest could not be judged against its series: %s", why)
        return
    if check.regressed:
        job.warn("regression: %s", check.summary())
        job.alert(check.as_dict())
    else:
        job.say("against the series of earlier retests: %s", check.summary())


def retest(request: RunRequest, job: Job) -> RetestResult:
    """The baseline, then each variant (the request's, or all of them), each a study under the
    retest's run; then the report. A study that fails is recorded and the others still run; then
    :class:`VariantsFailed` is raised after the report, naming it."""
    tracker = job.tracker
    spec = job.steps.load_experiment(request)
    names = request.variant_names(spec)
    targets = retest_targets(spec, names)
    params = request.overrides.params()
    run_id = start_retest(tracker, spec, request.source, targets, job.tags, params)
    job.say("%s\nMLflow run of the retest: %s", "\n".join(describe_retest(spec, names)), run_id)
    studies: dict[str, StudyResult] = {}
    failed: dict[str, str] = {}
    status = "KILLED"
    try:
        # every study's own checks before anything is fetched or launched: a variant that cannot run
        # must not be found out after the baseline's hours
        for t in targets:
            check_spec(t.spec, [a.name for a in t.spec.arms], tracker, job.steps.prepare, job.tags, run_id)
        model = job.steps.prepare.fetch_model("model", spec.model, job.home)
        prompts: dict[str, dict[str, list[PromptSet]]] = {}
        for t in targets:
            key = workloads_key(t.spec)
            try:
                if key not in prompts:
                    prompts[key] = job.steps.prepare.prompts(t.spec, Path(model.path), job.home)
                studies[t.label] = run_study(
                    StudyRequest(
                        t.spec, request.source, [a.name for a in t.spec.arms], params=params,
                        parent_run_id=run_id, models={"model": model}, prompts=prompts[key],
                        tags={VARIANT_TAG: t.label, RETEST_RUN_TAG: run_id},
                    ),
                    job,
                )  # fmt: skip
            except ArmsFailed as exc:
                studies[t.label] = exc.study
                failed[t.label] = str(exc)
            except Exception as exc:  # this study could not run: the others still can
                failed[t.label] = scrub(f"{type(exc).__name__}: {exc}")
                job.warn("retest %s: %s did not run: %s", spec.name, t.label, failed[t.label])
            if t.label in failed:
                tracker.set_tags(run_id, {f"{FAILED_PREFIX}{t.label}": failed[t.label][:4000]})
        status = "FINISHED"
    except Exception:
        status = "FAILED"
        raise
    finally:
        if failed:
            tracker.set_tags(run_id, {FAILED_VARIANTS_TAG: ",".join(failed)})
        tracker.end_run(run_id, status)
    report_needs_mlflow(tracker, run_id)
    paths = job.steps.retest_report(tracker, run_id, retest_dir(job.home, spec.name, run_id))
    job.say("MLflow run of the retest: %s", tracker.run_link(run_id))
    if "baseline" in studies and "baseline" not in failed:
        _check_regression(job, run_id, tuple(spec.decision.metrics), spec.decision.margin_pct)
    result = RetestResult(run_id, studies, failed, paths)
    if failed:
        details = "; ".join(f"{label}: {why}" for label, why in failed.items())
        raise VariantsFailed(
            scrub(
                f"{len(failed)} of {len(targets)} studies did not finish cleanly ({details}); "
                f"the report judges the others: {paths['html']}"
            ),
            result.as_dict(),
        )
    return result


def rerun_retest(run_ref: str, job: Job, allow_drift: bool = False) -> RetestResult:
    """The recorded retest ``run_ref`` run again from its records: a new retest run (tagged
    ``k3pipe.rerun_of``) with its experiment, variants and overrides, each of its studies rerun under
    it (:func:`k3pipe.jobs.study.rerun`: every arm from its record, then each arm judged against the
    original study's over all its launches), then the retest's report, which judges the variants
    against the baseline again. A study that cannot be rerun is recorded and the others still are; then
    :class:`VariantsFailed` after the report."""
    from k3pipe.core.errors import RerunError
    from k3pipe.core.layout import RETEST_KIND
    from k3pipe.experiment.load import parse_experiment
    from k3pipe.jobs.study import rerun as rerun_study
    from k3pipe.records.compare import find_run

    tracker = job.tracker
    original = find_run(tracker, run_ref)
    orig_id = original.info.run_id
    if RunTags.of(original).kind != RETEST_KIND:
        raise RerunError(f"run {orig_id} is not a retest's run (tag k3pipe.kind): give a retest's run id")
    recorded = tracker.read_artifact(orig_id, EXPERIMENT_FILE)
    if recorded is None:
        raise RerunError(f"retest run {orig_id} has no experiment.json: it cannot be rerun from its record")
    spec = parse_experiment(json.loads(recorded), f"experiment.json of retest run {orig_id}")
    params = dict(original.data.params)
    names = [n for n in params.get("variants", "").split(",") if n]
    targets = retest_targets(spec, names)
    overrides = {k: v for k, v in params.items() if k.startswith("override.")}
    children = {
        RunTags.of(c).variant: c.info.run_id for c in tracker.children(orig_id) if RunTags.of(c).variant
    }
    tags = {**job.tags, RERUN_TAG: orig_id}
    run_id = start_retest(tracker, spec, params.get("experiment_file", ""), targets, tags, overrides)
    job.say("rerun of retest %s (MLflow run %s): %s", spec.name, orig_id, run_id)
    studies: dict[str, StudyResult] = {}
    failed: dict[str, str] = {}
    status = "KILLED"
    try:
        for t in targets:
            study_of = children.get(t.label)
            try:
                if study_of is None:
                    raise RerunError(f"the original retest has no study of {t.label}")
                studies[t.label] = rerun_study(
                    study_of, job, allow_drift, parent_run_id=run_id,
                    tags={VARIANT_TAG: t.label, RETEST_RUN_TAG: run_id},
                )  # fmt: skip
            except ArmsFailed as exc:
                studies[t.label] = exc.study
                failed[t.label] = str(exc)
            except Exception as exc:  # this study could not be rerun: the others still can
                failed[t.label] = scrub(f"{type(exc).__name__}: {exc}")
                job.warn("rerun of retest %s: %s did not run: %s", spec.name, t.label, failed[t.label])
            if t.label in failed:
                tracker.set_tags(run_id, {f"{FAILED_PREFIX}{t.label}": failed[t.label][:4000]})
        status = "FINISHED"
    except Exception:
        status = "FAILED"
        raise
    finally:
        if failed:
            tracker.set_tags(run_id, {FAILED_VARIANTS_TAG: ",".join(failed)})
        tracker.end_run(run_id, status)
    report_needs_mlflow(tracker, run_id)
    paths = job.steps.retest_report(tracker, run_id, retest_dir(job.home, spec.name, run_id))
    result = RetestResult(run_id, studies, failed, paths, rerun_of=orig_id)
    if failed:
        details = "; ".join(f"{label}: {why}" for label, why in failed.items())
        raise VariantsFailed(
            scrub(f"{len(failed)} of {len(targets)} studies were not rerun cleanly ({details})"),
            result.as_dict(),
        )
    return result
