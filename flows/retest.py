"""The retest flow: an experiment's baseline and its variants (the study's checklist as code), each
run as a study nested under one parent MLflow run, then every variant judged against the baseline
(better, worse, equivalent within the margin or inconclusive, with the interval of the change), the report on
the retest's run and as Prefect artifacts.

prefect: python -m flows.retest experiments/demo-retest.yaml   (or `k3pipe retest`, or the deployment)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from prefect import get_run_logger

from flows.runtime import flow_run_id, flow_tags, note_flow_run, prepare_steps, report_needs_mlflow
from flows.secrecy import guard, scrubbed_flow
from flows.study import ArmsFailed, run_study
from k3pipe.bench.corpora import PromptSet
from k3pipe.errors import PartlyFailedError
from k3pipe.jobs.prepare import check_spec
from k3pipe.params import NO_OVERRIDES, Overrides, RunRequest
from k3pipe.report import retest_dir
from k3pipe.retest import describe_retest, retest_targets, start_retest, workloads_key
from k3pipe.secrets import scrub
from k3pipe.settings import Settings
from k3pipe.tracking import Tracker
from tasks.steps import (
    fetch_model_task,
    load_experiment_task,
    prepare_prompts_task,
    retest_report_task,
)


class VariantsFailed(PartlyFailedError):
    """Some study of the retest did not finish; raised after the report (``result`` is the flow's)."""


@scrubbed_flow("retest")
def retest(
    experiment: str = "experiments/demo-retest.yaml",
    experiment_yaml: str | None = None,
    variants: list[str] | None = None,
    overrides: Overrides = NO_OVERRIDES,
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
    """
    note_flow_run()
    guard()
    logger = get_run_logger()
    settings = Settings()
    home = settings.home_dir
    tracker = Tracker(settings.tracking_uri(), settings.mlflow_experiment, settings.artifact_root())
    request = RunRequest(
        experiment=experiment, experiment_yaml=experiment_yaml, variants=variants, overrides=overrides
    )
    spec, experiment = load_experiment_task(request), request.source
    names = request.variant_names(spec)
    targets = retest_targets(spec, names)
    params = overrides.params()
    run_id = start_retest(tracker, spec, experiment, targets, {"prefect.flow_run_id": flow_run_id()}, params)
    logger.info("%s\nMLflow run of the retest: %s", "\n".join(describe_retest(spec, names)), run_id)
    studies: dict[str, dict[str, Any]] = {}
    failed: dict[str, str] = {}
    status = "KILLED"
    try:
        # every study's own checks before anything is fetched or launched: a variant that cannot run
        # must not be found out after the baseline's hours
        steps = prepare_steps(home, tracker)
        for t in targets:
            check_spec(t.spec, [a.name for a in t.spec.arms], tracker, steps, flow_tags(), run_id)
        model = fetch_model_task("model", spec.model, home)
        prompts: dict[str, dict[str, list[PromptSet]]] = {}
        for t in targets:
            key = workloads_key(t.spec)
            try:
                if key not in prompts:
                    prompts[key] = prepare_prompts_task(t.spec, Path(model.path), home)
                studies[t.label] = run_study(
                    t.spec, experiment, [a.name for a in t.spec.arms], tracker, settings,
                    parent_run_id=run_id, tags={"k3pipe.variant": t.label, "k3pipe.retest_run_id": run_id},
                    models={"model": model}, prompts=prompts[key], params=params,
                )  # fmt: skip
            except ArmsFailed as exc:
                studies[t.label] = exc.result
                failed[t.label] = str(exc)
            except Exception as exc:  # this study could not run: the others still can
                failed[t.label] = scrub(f"{type(exc).__name__}: {exc}")
                logger.error("retest %s: %s did not run: %s", spec.name, t.label, failed[t.label])
            if t.label in failed:
                tracker.set_tags(run_id, {f"k3pipe.failed.{t.label}": failed[t.label][:4000]})
        status = "FINISHED"
    except Exception:
        status = "FAILED"
        raise
    finally:
        if failed:
            tracker.set_tags(run_id, {"k3pipe.failed_variants": ",".join(failed)})
        tracker.end_run(run_id, status)
    report_needs_mlflow(tracker, run_id)
    paths = retest_report_task(tracker, run_id, retest_dir(settings.home_dir, spec.name, run_id))
    logger.info("MLflow run of the retest: %s", tracker.run_link(run_id))
    result = {"retest_run_id": run_id, "studies": studies, "failed": failed, "report": paths}
    if failed:
        details = "; ".join(f"{label}: {why}" for label, why in failed.items())
        raise VariantsFailed(
            scrub(
                f"{len(failed)} of {len(targets)} studies did not finish cleanly ({details}); "
                f"the report judges the others: {paths['html']}"
            ),
            result,
        )
    return result


if __name__ == "__main__":
    retest(
        sys.argv[1] if len(sys.argv) > 1 else "experiments/demo-retest.yaml", variants=sys.argv[2:] or None
    )
