"""The benchmark flow: for each engine arm, launch -> health gate -> workloads -> teardown, all in
MLflow; or one arm run again from its record (the rerun flow). The body is the library's
(k3pipe.jobs.benchmark); this is its Prefect shell.

prefect: python -m k3pipe.flows.benchmark experiments/demo-cpu.yaml   (or `k3pipe run`, or the deployment)
"""

from __future__ import annotations

import sys
from typing import Any

from k3pipe.experiment.params import NO_OVERRIDES, Overrides, RunRequest
from k3pipe.flows.runtime import flow_job
from k3pipe.flows.secrecy import guard, scrubbed_flow
from k3pipe.jobs.benchmark import BenchmarkRequest
from k3pipe.jobs.benchmark import benchmark as benchmark_job


@scrubbed_flow("benchmark")
def benchmark(
    experiment: str = "experiments/demo-cpu.yaml",
    experiment_yaml: str | None = None,
    arms: list[str] | None = None,
    overrides: Overrides = NO_OVERRIDES,
    rerun_of: str | None = None,
    allow_drift: bool = False,
) -> list[dict[str, Any]]:
    """Run every arm (or the named arms) of the experiment and record it in MLflow; with rerun_of
    (an arm's MLflow run id), run that arm again from its record alone: the same verified model
    files, image digest, prompts and seeds.

    Args:
        experiment: Experiment YAML file on the worker, relative to the checkout the deployment runs
            from (e.g. experiments/demo-study.yaml). Not read when experiment_yaml is set.
        experiment_yaml: The experiment itself: YAML text pasted here, the same fields as a file.
            When set, it is the experiment and the experiment file is not read. Checked like a
            file: an error names the field.
        arms: Only these arms, in this order (their names in the experiment). Empty: every arm.
        overrides: Workload fields laid over every workload of the experiment; a field left empty
            keeps the experiment's value. Recorded on the MLflow runs as override.* params.
        rerun_of: An arm's MLflow run id: run that arm again from its record alone (the experiment,
            arms and overrides are then not used).
        allow_drift: With rerun_of: rerun even though a model file differs from the record (the
            difference is recorded).
    """
    guard()
    run = RunRequest(experiment=experiment, experiment_yaml=experiment_yaml, arms=arms, overrides=overrides)
    request = BenchmarkRequest(run=run, rerun_of=rerun_of, allow_drift=allow_drift)
    return benchmark_job(request, flow_job()).as_list()


@scrubbed_flow("rerun")
def rerun(run_id: str, allow_drift: bool = False) -> list[dict[str, Any]]:
    """Run an arm's MLflow run again from its record alone, and compare the new run with it.

    Args:
        run_id: The MLflow run id of an arm (or of a workload or repeat under it; a unique prefix
            will do).
        allow_drift: Rerun even though a model file differs from the record (the difference is
            recorded).
    """
    guard()
    return benchmark(rerun_of=run_id, allow_drift=allow_drift)


if __name__ == "__main__":
    benchmark(sys.argv[1] if len(sys.argv) > 1 else "experiments/demo-cpu.yaml")
