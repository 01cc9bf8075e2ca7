"""A retest: an experiment's baseline and its variants (the study's checklist as code), each run as a
study nested under one parent MLflow run, every variant then judged against the baseline
(:mod:`k3pipe.report.retest_verdicts`).

    retest/<experiment>                  k3pipe.kind=retest
      study/<experiment>                 k3pipe.variant=baseline
        <experiment>/<arm> -> workloads -> repeats
      study/<experiment>@<variant>       k3pipe.variant=<variant>
        ...

The studies run one after another (they share the node's GPUs). A variant whose workloads are the
baseline's sends the baseline's very prompts; one that changes the workloads draws its own. A study
that fails is recorded on the retest's run (``k3pipe.failed.<label>``) and the others still run.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from k3pipe.core.errors import SpecError
from k3pipe.core.layout import EXPERIMENT_FILE, EXPERIMENT_TAG, KIND_TAG, RETEST_KIND, VARIANTS_FILE
from k3pipe.core.secrets import redact_data
from k3pipe.experiment.variants import changes, resolve
from k3pipe.records.tracking import Tracker
from k3pipe.report.retest_verdicts import BASELINE
from k3pipe.schema.specs import ExperimentSpec

__all__ = ["RetestTarget", "describe_retest", "retest_targets", "start_retest", "workloads_key"]


@dataclass(frozen=True)
class RetestTarget:
    """One study of a retest: the baseline, or a variant resolved to an experiment of its own."""

    label: str
    """'baseline' or the variant's name (the study run's ``k3pipe.variant`` tag)."""
    spec: ExperimentSpec
    description: str = ""
    changes: tuple[str, ...] = ()


def retest_targets(spec: ExperimentSpec, variants: Sequence[str] | None = None) -> list[RetestTarget]:
    """The baseline (``spec`` without its variants), then each named variant (all, in file order, when
    ``variants`` is None or empty). An unknown name is refused with the experiment's variants listed."""
    if not spec.variants:
        raise SpecError(
            f"experiment {spec.name!r} declares no variants: a retest judges variants against the "
            "baseline; add a `variants:` list (see experiments/kimi-k3-retest.yaml), or run it as a study"
        )
    names = list(variants or [v.name for v in spec.variants])
    known = [v.name for v in spec.variants]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SpecError(
            f"variants: {', '.join(map(repr, unknown))} not in experiment {spec.name!r}; "
            f"its variants: {', '.join(known)}"
        )
    baseline = spec.model_copy(update={"variants": []})
    targets = [RetestTarget(BASELINE, baseline, "the experiment as written")]
    for name in dict.fromkeys(names):
        v = next(x for x in spec.variants if x.name == name)
        targets.append(RetestTarget(name, resolve(spec, name), v.description, tuple(changes(spec, name))))
    return targets


def workloads_key(spec: ExperimentSpec) -> str:
    """Two targets with the same key send the same prompts (their workloads are identical)."""
    return json.dumps([w.model_dump(mode="json") for w in spec.workloads], sort_keys=True)


def describe_retest(spec: ExperimentSpec, variants: Sequence[str] | None = None) -> list[str]:
    """What a retest of ``spec`` runs, in order, and what each variant changes."""
    targets = retest_targets(spec, variants)
    lines = [f"retest {spec.name}: the baseline, then {len(targets) - 1} variant(s), each judged against it"]
    for i, t in enumerate(targets, 1):
        arms = ", ".join(a.name for a in t.spec.arms)
        same = "same prompts" if workloads_key(t.spec) == workloads_key(targets[0].spec) else "own prompts"
        what = f": {t.description}" if t.description else ""
        lines.append(f"  {i}. {t.label}: arms {arms}; {same}{what}")
        lines.extend(f"       {c}" for c in t.changes)
    return lines


def start_retest(
    tracker: Tracker,
    spec: ExperimentSpec,
    experiment_file: str,
    targets: Sequence[RetestTarget],
    tags: Mapping[str, str] | None = None,
    params: Mapping[str, Any] | None = None,
) -> str:
    """The retest's parent run: the experiment, the variants it runs and what each changes, and
    ``params`` besides (the overrides it was started with, ``override.*``)."""
    run_id = tracker.start_run(
        f"retest/{spec.name}",
        tags={KIND_TAG: RETEST_KIND, EXPERIMENT_TAG: spec.name, **(tags or {})},
    )
    variants = [t for t in targets if t.label != BASELINE]
    tracker.log_params(
        run_id,
        {
            "experiment_file": experiment_file,
            "variants": ",".join(t.label for t in variants),
            "arms": ",".join(a.name for a in spec.arms),
            "workloads": ",".join(w.name for w in spec.workloads),
            **(params or {}),
        },
    )
    tracker.log_dict(run_id, redact_data(spec.model_dump(mode="json")), EXPERIMENT_FILE)
    tracker.log_dict(
        run_id, {t.label: {"description": t.description, "changes": list(t.changes)} for t in variants},
        VARIANTS_FILE,
    )  # fmt: skip
    return run_id
