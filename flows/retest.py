"""The retest flow: an experiment's baseline and its variants (the study's checklist as code), each
run as a study nested under one parent MLflow run, then every variant judged against the baseline,
the report on the retest's run and as Prefect artifacts. The body is the library's
(k3pipe.jobs.retest); this is its Prefect shell.

prefect: python -m k3pipe.flows.retest experiments/demo-retest.yaml   (or `k3pipe retest`, or the deployment)
"""

from __future__ import annotations

import sys
from typing import Any

from k3pipe.experiment.params import NO_OVERRIDES, Overrides, RunRequest
from k3pipe.flows.runtime import flow_job
from k3pipe.flows.secrecy import guard, scrubbed_flow
from k3pipe.jobs import retest as job
from k3pipe.jobs.retest import VariantsFailed

__all__ = ["VariantsFailed", "retest"]  # the flow raises the job's VariantsFailed


@scrubbed_flow("retest")
def retest(
    experiment: str = "experiments/demo-retest.yaml",
    experiment_yaml: str | None = None,
    variants: list[str] | None = None,
    overrides: Overrides = NO_OVERRIDES,
    rerun: str | None = None,
    allow_drift: bool = False,
) -> dict[str, Any]:
    """The baseline, then each variant (all of the experiment's, or the named variants), each a study
    under the retest's MLflow run; then every variant judged against the baseline. A study that fails
    is recorded and the others still run; the flow then fails after the report, naming it.

    Args:
        experiment: Experiment YAML file on the worker, relative to the checkout the deployment runs
            from (e.g. experiments/demo-retest.yaml); it must declare variants. Not read when
            experiment_yaml is set.
        experiment_yaml: The experiment itself: YAML text pasted here, the same fields as a file.
            When set, it is the experiment and the experiment file is not read. Checked like a
            file: an error names the field.
        variants: Only these of the experiment's variants, in this order (their names). Empty:
            every variant.
        overrides: Workload fields laid over every workload of the experiment (the baseline and
            each variant; a variant's own workload changes still apply); a field left empty keeps
            the experiment's value. Recorded on the MLflow runs as override.* params.
        rerun: A retest's MLflow run id (or a unique prefix) to run again from its records: each of
            its studies rerun (every arm from its record) and judged against the original's, then
            the variants judged against the baseline again (the fields above are not read).
        allow_drift: With rerun: go on although a model differs from the record (recorded as drift).
    """
    guard()
    if rerun and rerun.strip():
        return job.rerun_retest(rerun.strip(), flow_job(), allow_drift=allow_drift).as_dict()
    request = RunRequest(
        experiment=experiment, experiment_yaml=experiment_yaml, variants=variants, overrides=overrides
    )
    return job.retest(request, flow_job()).as_dict()


if __name__ == "__main__":
    retest(
        sys.argv[1] if len(sys.argv) > 1 else "experiments/demo-retest.yaml", variants=sys.argv[2:] or None
    )
