"""Regression alerts for scheduled retests: each retest's baseline study against the rolling baseline,
the last accepted retest of the same experiment (one that found no regression), arm by arm and
workload by workload, on the experiment's decision metrics with ``k3pipe compare``'s test
(:func:`k3pipe.rerun.verdict`). A figure detected different, and worse by more than the equivalence
margin (``decision.margin_pct``, 5%), is a regression: the retest's run is tagged
with it (``k3pipe.regression``), ``regression.json`` names each worse figure with its interval and
the versions of the good and the bad run (engine version, image digest); the flow then emits a
Prefect event that prefect.yaml's ``notify`` deployment trigger turns into a notification.

A retest with no regression is accepted (``k3pipe.regression: none``) and becomes the baseline of
the next; one with a regression is not, so every later retest is compared with the last good one
until the regression is gone.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from k3pipe.figures import DEFAULT_DECISION, figure
from k3pipe.report.retest import BASELINE
from k3pipe.rerun import verdict
from k3pipe.tracking import Tracker

__all__ = [
    "REGRESSION_EVENT",
    "REGRESSION_FILE",
    "REGRESSION_TAG",
    "RegressionCheck",
    "Worse",
    "check_regression",
    "last_accepted",
    "record_regression",
]

REGRESSION_TAG = "k3pipe.regression"
"""On a retest's run: 'none' (accepted: the next retest's baseline), 'worse: ...', or 'no baseline'."""
REGRESSION_FILE = "regression.json"
REGRESSION_EVENT = "k3pipe.regression.detected"
"""The Prefect event a retest that found a regression emits; its resource is
``k3pipe.retest.<retest run id>``."""


@dataclass(frozen=True)
class Worse:
    """One figure of one arm's workload detected worse than in the baseline."""

    arm: str
    workload: str
    metric: str
    change: str
    """The relative change with its interval ('+183.0% [+150.1%, +220.4%]')."""


@dataclass
class RegressionCheck:
    """A retest against its rolling baseline."""

    retest_run_id: str
    experiment: str
    baseline_run_id: str | None
    """The last accepted retest of the experiment (None: none before this one)."""
    worse: list[Worse] = field(default_factory=list)
    versions: dict[str, dict[str, str]] = field(default_factory=dict)
    """Arm -> {'good': its engine version and image digest in the baseline, 'bad': in this retest}."""
    compared: int = 0
    """Figures tested."""

    @property
    def regressed(self) -> bool:
        return bool(self.worse)

    def summary(self) -> str:
        if self.baseline_run_id is None:
            return "no baseline: no earlier accepted retest of this experiment to compare with"
        if not self.worse:
            return f"none: {self.compared} figure(s) against retest {self.baseline_run_id}, none worse"
        shown = "; ".join(f"{w.arm} {w.workload} {w.metric} {w.change}" for w in self.worse[:5])
        more = f" and {len(self.worse) - 5} more" if len(self.worse) > 5 else ""
        changed = "; ".join(
            f"{arm}: {v['good']} -> {v['bad']}" for arm, v in self.versions.items() if v["good"] != v["bad"]
        )
        return f"worse than retest {self.baseline_run_id}: {shown}{more}" + (
            f" (versions {changed})" if changed else " (same versions)"
        )

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "regressed": self.regressed, "summary": self.summary()}


def _retest_runs(tracker: Tracker, experiment: str) -> list[Any]:
    where = f"tags.`k3pipe.kind` = 'retest' and tags.`k3pipe.experiment` = '{experiment}'"
    runs = tracker.client.search_runs(
        [tracker.require_experiment_id()], filter_string=where, max_results=1000
    )
    return [r for r in runs if r.info.status == "FINISHED"]


def _overrides(run: Any) -> dict[str, str]:
    return {k: v for k, v in run.data.params.items() if k.startswith("override.")}


def last_accepted(tracker: Tracker, experiment: str, before: Any) -> Any | None:
    """The latest finished retest of ``experiment`` started before the run ``before``, with its
    overrides, that found no regression (tag :data:`REGRESSION_TAG` 'none'), or None."""
    overrides = _overrides(before)
    earlier = [
        r
        for r in _retest_runs(tracker, experiment)
        if r.info.start_time < before.info.start_time
        and r.data.tags.get(REGRESSION_TAG) == "none"
        and _overrides(r) == overrides  # like with like: the same repeats, requests, lengths
    ]
    return max(earlier, key=lambda r: r.info.start_time, default=None)


def _baseline_study(tracker: Tracker, retest_run_id: str) -> Any | None:
    """The retest's baseline study (its study without a variant)."""
    for study in tracker.children(retest_run_id):
        tags = study.data.tags
        if tags.get("k3pipe.kind") == "study" and tags.get("k3pipe.variant", BASELINE) == BASELINE:
            return study
    return None


def _arm_runs(tracker: Tracker, study_run_id: str) -> dict[str, Any]:
    """Arm -> its first measured launch's run (the comparison pairs one run per arm)."""
    out: dict[str, Any] = {}
    for run in sorted(tracker.children(study_run_id), key=lambda r: r.info.start_time):
        arm = run.data.tags.get("k3pipe.arm")
        if arm and run.data.tags.get("k3pipe.launch", "1") == "1" and run.info.status == "FINISHED":
            out.setdefault(arm, run)
    return out


def _version(run: Any) -> str:
    params = run.data.params
    version = params.get("engine_version") or params.get("engine_version_declared") or "?"
    digest = params.get("image.digest")
    return f"{run.data.tags.get('k3pipe.engine', 'engine')} {version}" + (
        f" @ {digest[:19]}" if digest else ""
    )


def check_regression(
    tracker: Tracker, retest_run_id: str, metrics: tuple[str, ...] | None = None
) -> RegressionCheck:
    """This retest's baseline study against the last accepted retest's, on ``metrics`` (default
    the decision's)."""
    run = tracker.client.get_run(retest_run_id)
    experiment = run.data.tags.get("k3pipe.experiment", "")
    good = last_accepted(tracker, experiment, run)
    check = RegressionCheck(retest_run_id, experiment, good.info.run_id if good else None)
    if good is None:
        return check
    new_study, old_study = _baseline_study(tracker, retest_run_id), _baseline_study(tracker, good.info.run_id)
    if new_study is None or old_study is None:
        return check
    wanted = set(metrics or DEFAULT_DECISION)
    new_arms, old_arms = _arm_runs(tracker, new_study.info.run_id), _arm_runs(tracker, old_study.info.run_id)
    for arm in sorted(set(new_arms) & set(old_arms)):
        check.versions[arm] = {"good": _version(old_arms[arm]), "bad": _version(new_arms[arm])}
        for wv in verdict(tracker, old_arms[arm].info.run_id, new_arms[arm].info.run_id):
            for c in wv.rows:
                name = c.metric.removesuffix(" (per request)")
                if name not in wanted or c.outcome == "untested":
                    continue
                check.compared += 1
                higher = name in _known() and figure(name).higher_is_better
                # detected, and worse by more than the equivalence margin: a 1% drift of a quiet
                # engine is detected with enough repeats, and is no regression anyone acts on
                worse = -c.relative_change if higher else c.relative_change
                if c.different and worse > c.margin:
                    check.worse.append(Worse(arm, wv.workload, c.metric, c.change_text()))
    return check


def _known() -> set[str]:
    from k3pipe.figures import FIGURES

    return {f.key for f in FIGURES}


def record_regression(tracker: Tracker, check: RegressionCheck) -> None:
    """The check on the retest's run: :data:`REGRESSION_TAG` and :data:`REGRESSION_FILE`."""
    # accepted, the next retest's baseline: one without a regression (the first is the first baseline)
    tag = check.summary() if check.regressed else "none"
    tracker.set_tags(check.retest_run_id, {REGRESSION_TAG: tag[:4000]})
    tracker.log_dict(check.retest_run_id, json.loads(json.dumps(check.as_dict())), REGRESSION_FILE)
