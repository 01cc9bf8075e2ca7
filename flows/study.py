"""The study flow: every arm x every workload of an experiment in one flow run, one parent MLflow run
with the arms nested under it, and the study's report at the end, on the study's run and as Prefect
artifacts. The body is the library's (k3pipe.jobs.study); this is its Prefect shell.

prefect: python -m k3pipe.flows.study experiments/demo-study.yaml   (or `k3pipe study`, or the deployment)
"""

from __future__ import annotations

import sys
from typing import Any

from k3pipe.experiment.params import NO_OVERRIDES, Overrides, RunRequest
from k3pipe.flows.runtime import flow_job
from k3pipe.flows.secrecy import guard, scrubbed_flow
from k3pipe.jobs import study as job
from k3pipe.jobs.study import ArmsFailed

__all__ = ["ArmsFailed", "study"]  # the flow raises the job's ArmsFailed


@scrubbed_flow("study")
def study(
    experiment: str = "experiments/demo-study.yaml",
    experiment_yaml: str | None = None,
    arms: list[str] | None = None,
    overrides: Overrides = NO_OVERRIDES,
    resume: str | None = None,
    rerun: str | None = None,
    allow_drift: bool = False,
) -> dict[str, Any]:
    """Every arm (or the named arms) of the experiment on every workload, under one MLflow run; the
    report at the end. An arm that fails is recorded and the others still run; the flow then fails
    after the report, naming it.

    Args:
        experiment: Experiment YAML file on the worker, relative to the checkout the deployment runs
            from (e.g. experiments/demo-study.yaml). Not read when experiment_yaml is set.
        experiment_yaml: The experiment itself: YAML text pasted here, the same fields as a file.
            When set, it is the experiment and the experiment file is not read. Checked like a
            file: an error names the field.
        arms: Only these arms, in this order (their names in the experiment). Empty: every arm.
        overrides: Workload fields laid over every workload of the experiment; a field left empty
            keeps the experiment's value. Recorded on the MLflow runs as override.* params.
        resume: A study's MLflow run id (or a unique prefix of it) to resume instead: its launches
            that finished are kept, and the workloads an unfinished launch finished cleanly; the rest
            run, with its own recorded experiment, arms and overrides (the fields above are not
            read). Empty: a new study.
        rerun: A study's MLflow run id (or a unique prefix) to run again, as a new study, from its
            records alone (each arm's pinned image, verified models and the prompts it sent), then
            compared launch by launch with it (the fields above are not read). Empty: a new study.
        allow_drift: With rerun: go on although a model differs from the record (recorded as drift).
    """
    guard()
    if resume and resume.strip():
        return job.resume(resume.strip(), flow_job()).as_dict()
    if rerun and rerun.strip():
        return job.rerun(rerun.strip(), flow_job(), allow_drift=allow_drift).as_dict()
    request = RunRequest(
        experiment=experiment, experiment_yaml=experiment_yaml, arms=arms, overrides=overrides
    )
    return job.study(request, flow_job()).as_dict()


if __name__ == "__main__":
    study(sys.argv[1] if len(sys.argv) > 1 else "experiments/demo-study.yaml")
