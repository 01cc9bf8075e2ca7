"""What a job calls and where it runs: :class:`JobSteps`, the steps a flow may run as its own tasks
(the library's functions by default), and :class:`Job`, the context every job body takes (settings,
tracker, steps, how it logs and publishes, the flow run it belongs to).

A flow builds a ``Job`` with its Prefect tasks and logger (``flows/runtime.py``); a script or a test
uses ``Job.library()``. The bodies (:mod:`k3pipe.jobs.benchmark`, :mod:`k3pipe.jobs.study`,
:mod:`k3pipe.jobs.retest`) are the same either way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from k3pipe.core.errors import TrackingError
from k3pipe.core.layout import FLOW_RUN_TAG
from k3pipe.core.settings import Settings
from k3pipe.experiment.params import RunRequest
from k3pipe.experiment.speculation import SpeculationReport
from k3pipe.jobs.arm_run import ArmOutcome, ArmSteps
from k3pipe.jobs.fleet import Remote
from k3pipe.jobs.prepare import PrepareSteps
from k3pipe.jobs.rerun import RerunInputs
from k3pipe.records.recorder import record_speculation
from k3pipe.records.tracking import Tracker
from k3pipe.schema.specs import ExperimentSpec, FleetSpec

__all__ = ["Job", "JobSteps", "judge_speculation", "report_needs_mlflow"]

log = logging.getLogger("k3pipe.jobs")


def _no_artifact(*args: Any, **kwargs: Any) -> None:
    """Outside a flow there is nowhere to publish an artifact: the report files and MLflow hold it."""


@dataclass(frozen=True)
class JobSteps:
    """The steps of an experiment's lifetime that are not an arm's: the experiment loaded, the
    preparation (a :class:`PrepareSteps`), the arm's (an :class:`ArmSteps`), the speculation judge,
    a rerun's restore and verdict, and the two reports. Each takes and returns what the library
    function does; a flow passes its Prefect tasks."""

    load_experiment: Callable[[RunRequest], ExperimentSpec]
    prepare: PrepareSteps
    arm: ArmSteps
    judge_speculation: Callable[
        [ExperimentSpec, list[dict[str, Any]], Mapping[str, float] | None], SpeculationReport
    ]
    """``(spec, rows, log_accept_length)``: each speculative arm against its plain baseline."""
    restore_run: Callable[[Tracker, str, Path, bool], RerunInputs]
    rerun_verdict: Callable[[Tracker, str, str], list[dict[str, Any]]]
    report: Callable[[Tracker, str, Path], dict[str, str]]
    """``(tracker, study_run_id, out_dir)``: the study's report written, its paths as strings."""
    retest_report: Callable[[Tracker, str, Path], dict[str, str]]

    @classmethod
    def library(
        cls, home: Path, say: Callable[[str], None] | None = None, tracker: Tracker | None = None
    ) -> JobSteps:
        """The library's functions themselves (no Prefect), their progress to ``say``."""
        from k3pipe.experiment.speculation import judge_speculation as judge
        from k3pipe.jobs.rerun import restore, verdict_rows
        from k3pipe.report import build_report, publish
        from k3pipe.report.retest_verdicts import build_retest_report, publish_retest

        out: Callable[[str], None] = say or log.info

        def report(tracker: Tracker, run_id: str, out_dir: Path) -> dict[str, str]:
            paths = publish(tracker, build_report(tracker, run_id), out_dir)
            return {k: str(v) for k, v in paths.items()}

        def retest_report(tracker: Tracker, run_id: str, out_dir: Path) -> dict[str, str]:
            paths = publish_retest(tracker, build_retest_report(tracker, run_id), out_dir)
            return {k: str(v) for k, v in paths.items()}

        return cls(
            load_experiment=lambda request: request.load(),
            prepare=PrepareSteps.library(home, tracker, out),
            arm=ArmSteps.library(out),
            judge_speculation=lambda spec, rows, lengths: judge(spec, rows, log_accept_length=lengths),
            restore_run=lambda tracker, run_id, where, drift: restore(
                tracker, run_id, where, drift, progress=out
            ),
            rerun_verdict=verdict_rows,
            report=report,
            retest_report=retest_report,
        )


@dataclass(frozen=True)
class Job:
    """Where a job runs: its settings and tracker, its steps, how it logs (``say``: progress,
    ``note``: a warning, ``warn``: an error it goes on after), how it publishes a link or a table
    beside its records (a flow: Prefect artifacts), and the flow run it belongs to ("none" outside
    Prefect; its id tags every MLflow run and labels every engine)."""

    settings: Settings
    tracker: Tracker
    steps: JobSteps
    flow_run_id: str = "none"
    say: Callable[..., None] = log.info
    note: Callable[..., None] = log.warning
    warn: Callable[..., None] = log.error
    link: Callable[[str, str, str], object] = field(default=_no_artifact)
    """``(url, text, key)``: a link to an MLflow run."""
    table: Callable[[list[dict[str, Any]], str, str], object] = field(default=_no_artifact)
    """``(rows, key, description)``: a results table."""
    alert: Callable[[dict[str, Any]], object] = field(default=_no_artifact)
    """``(regression)``: a scheduled retest found a regression (k3pipe.jobs.alerts); a flow emits it as a
    Prefect event, which prefect.yaml's ``notify`` deployment turns into a notification."""
    fleet: Callable[[FleetSpec, str], Remote] | None = None
    """``(fleet, study_run_id)``: what runs a study's launch on a pool and says what a pool is doing
    (the study flow's: a run of the pool's ``launch`` deployment, its Prefect server's word); None: a
    job that cannot spread a study (outside Prefect)."""

    @classmethod
    def library(cls, settings: Settings | None = None, tracker: Tracker | None = None) -> Job:
        """A job outside Prefect: K3PIPE_HOME's settings and tracker, the library's steps."""
        settings = settings or Settings()
        tracker = tracker or Tracker(
            settings.tracking_uri(), settings.mlflow_experiment, settings.artifact_root()
        )
        return cls(settings, tracker, JobSteps.library(settings.home_dir, tracker=tracker))

    @property
    def home(self) -> Path:
        return self.settings.home_dir

    @property
    def tags(self) -> dict[str, str]:
        """The tags of every MLflow run the job starts."""
        return {"prefect.flow_run_id": self.flow_run_id}

    @property
    def labels(self) -> dict[str, str]:
        """The labels of every engine the job starts (a later run reads whose it was)."""
        return {FLOW_RUN_TAG: self.flow_run_id}

    def with_steps(self, **changes: Any) -> Job:
        """This job with some steps replaced (a test's broken step, say)."""
        return replace(self, steps=replace(self.steps, **changes))

    def publish_link(self, run_id: str, text: str, key: str) -> None:
        """An MLflow run's link: published under ``key`` (when it is a URL), and said."""
        link = self.tracker.run_link(run_id)
        if link.startswith("http"):
            self.link(link, text, key)
        self.say("%s: %s", text, link)


def judge_speculation(job: Job, spec: ExperimentSpec, outcomes: list[ArmOutcome]) -> None:
    """Speculative arms against their plain baselines, once every arm ran: findings in the log, the
    judgement on each speculative arm's MLflow run, and its summary in that arm's outcome. An
    analysis after the fact: when it cannot be made, say why and go on."""
    rows = [row for o in outcomes for row in o.workloads]
    log_lengths = {
        o.arm: o.engine_log_spec_accept_length_mean
        for o in outcomes
        if o.engine_log_spec_accept_length_mean is not None
    }
    try:
        report = job.steps.judge_speculation(spec, rows, log_lengths)
        record_speculation(job.tracker, {o.arm: o.mlflow_run_id for o in outcomes}, report)
    except Exception as exc:
        job.note("speculation could not be judged: %s: %s", type(exc).__name__, exc)
        return
    by_arm = {a.arm: a for a in report.arms}
    for o in outcomes:
        judged = by_arm.get(o.arm)
        if judged is not None:
            o.speculation = f"{judged.summary} (baseline: {judged.baseline.baseline or 'none'})"


def report_needs_mlflow(tracker: Tracker, run_id: str) -> None:
    """The report is built from MLflow: while it is down (the runs are in the spool) say what to do."""
    if not tracker.online and not tracker.flush():
        raise TrackingError(
            f"MLflow at {tracker.tracking_uri} stopped answering during the run: every record is in the "
            f"spool; `k3pipe sync` pushes it, then `k3pipe report {run_id}` builds the report"
        )
