"""Regression alerts for scheduled retests: each retest judged against the **series** of the earlier
retests of the same experiment with the same overrides, figure by figure (each arm, workload and
decision metric of its baseline study), by the rule of :mod:`k3pipe.verdicts.series`.

Why a series: a retest compared with one earlier retest carries two nights' restart noise and no
estimate of it (a second launch moved TTFT by 7-15% on the H200), so an alert from that comparison
fires on noise and is learned to be ignored. The series' own night-to-night spread is the noise: a
figure alerts when the last retests are detected worse than the history before them (at most 1% of
retests alert when nothing changed, over all their figures) and worse by more than the equivalence
margin (``decision.margin_pct``, 5%), and tonight's retest is still worse (module
:mod:`k3pipe.verdicts.series`).

A retest's value of a figure is the geometric mean of its launch means (every measured launch of the
arm; a launch that did not finish, one a resume superseded and a priming launch are left out). The
series starts at the newest retest accepted with ``k3pipe retest accept`` (:func:`accept`: a version
bump that is the new normal), or at the first retest; it keeps every retest whatever it found,
except those that raised an alert (they would make a regression the baseline), and those only until
an acceptance clears them. Fewer than :attr:`~k3pipe.verdicts.series.SeriesRule.min_history` earlier retests:
'insufficient history', said with how many there are and how many are needed.

The retest's run is tagged with the outcome (:data:`REGRESSION_TAG`), ``regression.json`` holds it
(each worse figure with its change, interval, the segment since which it moved, the history it was
judged against, and the versions of the arms), and tonight's values, which later retests read
instead of the study; a regression is then a Prefect event that prefect.yaml's ``notify``
deployment turns into a notification.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from k3pipe.core.errors import TrackingError
from k3pipe.core.figures import DEFAULT_DECISION, FIGURES
from k3pipe.core.layout import (
    ACCEPTED_TAG,
    ARM_TAG,
    ENGINE_TAG,
    KIND_TAG,
    PRIME_TAG,
    REGRESSION_FILE,
    REGRESSION_TAG,
    RERUN_TAG,
    RETEST_KIND,
    STUDY_KIND,
    SUPERSEDED_TAG,
    VARIANT_TAG,
    RunTags,
)
from k3pipe.records.compare import find_run, workload_values
from k3pipe.records.tracking import Tracker
from k3pipe.report.collect import collect
from k3pipe.report.gate import first_answers, floor_of
from k3pipe.report.retest_verdicts import BASELINE
from k3pipe.verdicts.answers import agreement
from k3pipe.verdicts.answers import judge as judge_answers
from k3pipe.verdicts.series import SeriesRule, judge

__all__ = [
    "Accepted",
    "RegressionCheck",
    "SeriesInfo",
    "Worse",
    "accept",
    "check_regression",
    "record_regression",
]

SERIES_VERSION = 1
"""How regression.json's ``values`` were computed (the geometric mean of the launch means); a later
retest reads an earlier one's values only when they were computed the same way."""
RULE = SeriesRule()

Key = tuple[str, str, str]
"""(arm, workload, metric): one figure of a retest."""


@dataclass(frozen=True)
class Worse:
    """One figure whose recent retests are worse than the series' history, by more than the margin."""

    arm: str
    workload: str
    metric: str
    change: str
    """The segment's geometric mean against the history's, in the figure's own direction, with its
    98% interval ('+412.3% [+380.1%, +446.0%]'; a throughput that fell is negative)."""
    tonight: str
    """Tonight's value against the history's geometric mean ('+398.0%')."""
    segment: int
    """Retests in the segment judged: the series' last ones, tonight's included."""
    since_run_id: str
    since: str
    """The segment's first retest and when it started (UTC): what moved is there since then."""
    history: int
    history_first_run_id: str
    history_first: str
    history_last_run_id: str
    history_last: str
    """The retests the segment was judged against: how many, the first and the last."""
    history_mean: float
    segment_mean: float
    """The figure's geometric mean over the history and over the segment, in its unit."""
    p_value: float
    level: float
    """Detected: ``p_value`` below ``level`` (alpha over the splits and the retest's figures)."""

    def text(self) -> str:
        ago = (
            "in tonight's retest"
            if self.segment == 1
            else f"over the last {self.segment} retests, since retest {self.since_run_id[:12]} ({self.since})"
        )
        return (
            f"{self.arm} {self.workload} {self.metric} {self.change} {ago}: {self.segment_mean:.4g} against "
            f"the geometric mean {self.history_mean:.4g} of {self.history} earlier retest(s) "
            f"({self.history_first_run_id[:12]} {self.history_first} .. {self.history_last_run_id[:12]} "
            f"{self.history_last})" + ("" if self.segment == 1 else f"; tonight {self.tonight}")
        )


@dataclass(frozen=True)
class AnswersMoved:
    """An arm whose answers tonight diverge beyond the floor from those of the retest the series starts
    at (the accepted one, else the first that recorded answers)."""

    arm: str
    against_run_id: str
    against: str
    """When that retest started (UTC)."""
    verdict: str
    """The verdict with its interval (k3pipe.verdicts.answers.AnswersVerdict.describe)."""
    floor: str
    """Which pair the floor is (tonight's arm launched twice, or that retest's)."""

    def text(self) -> str:
        return (
            f"{self.arm}'s answers moved since retest {self.against_run_id[:12]} ({self.against}): "
            f"{self.verdict} (floor: {self.floor})"
        )


ANSWERS_ALPHA = 0.01
"""The level an answers check is made at, shared by the arms (the series' own false-alarm budget)."""


@dataclass
class SeriesInfo:
    """The earlier retests tonight's was judged against."""

    start_run_id: str | None = None
    """The accepted retest the series starts at (None: it starts at the first retest)."""
    accepted_at: str | None = None
    retests: int = 0
    """Earlier retests in the series (of the newest :attr:`SeriesRule.max_series`)."""
    left_out: int = 0
    """Of them, those left out because they raised an alert (not cleared by an acceptance)."""
    first_run_id: str | None = None
    first: str | None = None
    last_run_id: str | None = None
    last: str | None = None

    def text(self) -> str:
        out = f"{self.retests} earlier retest(s) of this experiment with these overrides"
        if self.start_run_id:
            out += f" since retest {self.start_run_id[:12]} was accepted ({self.accepted_at})"
        if self.first_run_id and self.last_run_id and self.retests > 1:
            out += f" ({self.first_run_id[:12]} {self.first} .. {self.last_run_id[:12]} {self.last})"
        if self.left_out:
            out += f", {self.left_out} left out: they raised an alert"
        return out


@dataclass
class RegressionCheck:
    """A retest judged against its series."""

    retest_run_id: str
    experiment: str
    status: Literal["none", "worse", "insufficient history", "nothing measured"] = "insufficient history"
    series: SeriesInfo = field(default_factory=SeriesInfo)
    needed: int = RULE.min_history
    """Earlier retests a figure's series needs before it is judged."""
    worse: list[Worse] = field(default_factory=list)
    versions: dict[str, dict[str, str]] = field(default_factory=dict)
    """Arm -> {'good': its version in the last retest of the history, 'bad': in this retest}."""
    compared: int = 0
    """Figures judged."""
    insufficient: dict[str, int] = field(default_factory=dict)
    """Figures not judged yet ('arm / workload / metric') -> the earlier retests their series has."""
    margin_pct: float = 5.0
    rule: dict[str, Any] = field(default_factory=lambda: asdict(RULE))
    values: list[dict[str, Any]] = field(default_factory=list)
    """This retest's figures (arm, workload, metric, log_mean, launches): read by later retests."""
    arm_versions: dict[str, str] = field(default_factory=dict)
    metrics: list[str] = field(default_factory=list)
    series_version: int = SERIES_VERSION
    answers: list[AnswersMoved] = field(default_factory=list)
    """Arms whose answers moved (the output probe, an experiment with answers:): each a regression."""
    speed: Literal["none", "worse", "insufficient history", "nothing measured"] = "insufficient history"
    """The speed figures' own outcome (``status`` is 'worse' also when only the answers moved)."""
    answers_note: str | None = None
    """What the answers check did ('3 arm(s) compared with retest ...'), or why it did not run."""

    @property
    def regressed(self) -> bool:
        return bool(self.worse or self.answers)

    def summary(self) -> str:
        moved = "; ".join(a.text() for a in self.answers)
        if self.answers and not self.worse:
            return f"worse: answers moved: {moved}; speed: {self._speed()}"
        said = self._speed()
        return f"{said}; answers moved: {moved}" if self.answers else said

    def _speed(self) -> str:
        if self.speed == "nothing measured":
            return (
                f"nothing measured: the retest's baseline study has none of {', '.join(self.metrics)} in "
                "a launch that finished; nothing to judge"
            )
        if self.speed == "insufficient history":
            most = max(self.insufficient.values(), default=0)
            return (
                f"insufficient history: {self.series.text()}; a figure needs {self.needed} earlier "
                f"retest(s) in its series, the most any has is {most}: no figure judged"
            )
        short = (
            f"; {len(self.insufficient)} figure(s) not judged yet (too little history)"
            if self.insufficient
            else ""
        )
        if not self.worse:
            return (
                f"{'no figure worse' if self.answers else 'none'}: {self.compared} figure(s) judged against "
                f"{self.series.text()}; none worse by more than the {self.margin_pct:g}% margin{short}"
            )
        shown = "; ".join(w.text() for w in self.worse[:5])
        more = f" and {len(self.worse) - 5} more" if len(self.worse) > 5 else ""
        changed = "; ".join(
            f"{arm}: {v['good']} -> {v['bad']}" for arm, v in self.versions.items() if v["good"] != v["bad"]
        )
        return (
            f"worse than the series: {shown}{more} ({len(self.worse)} of {self.compared} figure(s); "
            f"series: {self.series.text()})" + (f" (versions {changed})" if changed else " (same versions)")
        )

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "regressed": self.regressed, "summary": self.summary()}


# --- reading the series --------------------------------------------------------------------------


def _retest_runs(tracker: Tracker, experiment: str) -> list[Any]:
    where = f"tags.`k3pipe.kind` = '{RETEST_KIND}' and tags.`k3pipe.experiment` = '{experiment}'"
    runs = tracker.client.search_runs(
        [tracker.require_experiment_id()], filter_string=where, max_results=5000
    )
    return [r for r in runs if r.info.status == "FINISHED"]


def _overrides(run: Any) -> dict[str, str]:
    return {k: v for k, v in run.data.params.items() if k.startswith("override.")}


def _when(ms: int | float | None) -> str:
    if ms is None:
        return "?"
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M")


def _accepted_ms(run: Any) -> float | None:
    value = RunTags.of(run).accepted
    if not value:
        return None
    try:
        return datetime.fromisoformat(value).timestamp() * 1000
    except ValueError:
        return float(run.info.start_time)  # unreadable: it still clears nothing after its own start


def _series(tracker: Tracker, run: Any, rule: SeriesRule) -> tuple[list[Any], list[bool], SeriesInfo]:
    """The earlier retests of tonight's series, oldest first, whether each is kept (False: it raised
    an alert no acceptance cleared), and what they are."""
    experiment = RunTags.of(run).experiment or ""
    overrides = _overrides(run)
    earlier = sorted(
        (
            r
            for r in _retest_runs(tracker, experiment)
            if r.info.start_time < run.info.start_time
            and r.info.run_id != run.info.run_id
            and not RunTags.of(r).rerun_of  # a rerun measures an old record again, not tonight
            and _overrides(r) == overrides  # like with like: the same repeats, requests, lengths
        ),
        key=lambda r: r.info.start_time,
    )
    start = next((r for r in reversed(earlier) if RunTags.of(r).accepted), None)
    info = SeriesInfo()
    cleared_until = -math.inf
    if start is not None:
        earlier = [r for r in earlier if r.info.start_time >= start.info.start_time]
        info.start_run_id = start.info.run_id
        info.accepted_at = start.data.tags[ACCEPTED_TAG]
        cleared_until = _accepted_ms(start) or -math.inf
    earlier = earlier[-(rule.max_series - 1) :]
    kept = [
        r is start
        or not (RunTags.of(r).regression or "").startswith("worse")
        or r.info.start_time < cleared_until  # an acceptance clears the alerts it was made after
        for r in earlier
    ]
    info.retests = len(earlier)
    info.left_out = kept.count(False)
    if earlier:
        info.first_run_id, info.first = earlier[0].info.run_id, _when(earlier[0].info.start_time)
        info.last_run_id, info.last = earlier[-1].info.run_id, _when(earlier[-1].info.start_time)
    return earlier, kept, info


def _baseline_study(tracker: Tracker, retest_run_id: str) -> Any | None:
    """The retest's baseline study (its study without a variant)."""
    for study in tracker.children(retest_run_id):
        tags = study.data.tags
        if tags.get(KIND_TAG) == STUDY_KIND and tags.get(VARIANT_TAG, BASELINE) == BASELINE:
            return study
    return None


def _version(run: Any) -> str:
    params = run.data.params
    version = params.get("engine_version") or params.get("engine_version_declared") or "?"
    digest = params.get("image.digest")
    return f"{run.data.tags.get(ENGINE_TAG, 'engine')} {version}" + (f" @ {digest[:19]}" if digest else "")


@dataclass
class _Values:
    """One retest's figures: per (arm, workload, metric) its launches' log means; per arm its version."""

    launches: dict[Key, list[float]] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)

    def log_mean(self, key: Key) -> float | None:
        means = self.launches.get(key)
        return sum(means) / len(means) if means else None


def _measured(tracker: Tracker, retest_run_id: str, metrics: list[str]) -> _Values:
    """The retest's figures from its baseline study: every measured launch of each arm."""
    out = _Values()
    study = _baseline_study(tracker, retest_run_id)
    if study is None:
        return out
    for arm_run in sorted(tracker.children(study.info.run_id), key=lambda r: r.info.start_time):
        tags = arm_run.data.tags
        arm = tags.get(ARM_TAG)
        # a launch that did not finish, one a resume ran again, a priming launch: not measured
        if not arm or arm_run.info.status != "FINISHED" or tags.get(SUPERSEDED_TAG) or tags.get(PRIME_TAG):
            continue
        out.versions.setdefault(arm, _version(arm_run))
        for wl in tracker.children(arm_run.info.run_id):
            workload = RunTags.of(wl).workload
            if not workload or wl.info.status != "FINISHED":
                continue
            values = workload_values(tracker, wl)
            for metric in metrics:
                positive = [v for v in values.get(metric, []) if v > 0 and math.isfinite(v)]
                if positive:  # the launch's mean on the log scale: its geometric mean
                    mean = sum(math.log(v) for v in positive) / len(positive)
                    out.launches.setdefault((arm, workload, metric), []).append(mean)
    return out


def _recorded(tracker: Tracker, retest_run_id: str, metrics: list[str]) -> _Values:
    """An earlier retest's figures: as its regression.json recorded them where it holds every metric
    asked for, computed the same way; else from its study."""
    raw = tracker.read_artifact(retest_run_id, REGRESSION_FILE)
    try:
        data = json.loads(raw) if raw else {}
    except ValueError:
        data = {}
    if data.get("series_version") == SERIES_VERSION and set(metrics) <= set(data.get("metrics", [])):
        out = _Values(versions=dict(data.get("arm_versions", {})))
        for v in data.get("values", []):
            out.launches[(v["arm"], v["workload"], v["metric"])] = [float(x) for x in v["launch_log_means"]]
        return out
    return _measured(tracker, retest_run_id, metrics)


def _higher_is_better(metric: str) -> bool:
    return next((f.higher_is_better for f in FIGURES if f.key == metric), False)


def _pct(x: float) -> str:
    return f"{x * 100:+.1f}%"


# --- judging ------------------------------------------------------------------------------------


def check_regression(
    tracker: Tracker,
    retest_run_id: str,
    metrics: tuple[str, ...] | None = None,
    margin_pct: float = 5.0,
    rule: SeriesRule = RULE,
) -> RegressionCheck:
    """This retest's baseline study against its series, on ``metrics`` (default the decision's), with
    the equivalence margin ``margin_pct`` (the experiment's ``decision.margin_pct``)."""
    run = tracker.client.get_run(retest_run_id)
    wanted = list(dict.fromkeys(metrics or DEFAULT_DECISION))
    check = RegressionCheck(
        retest_run_id,
        (RunTags.of(run).experiment or ""),
        needed=rule.min_history,
        margin_pct=margin_pct,
        rule=asdict(rule),
        metrics=wanted,
    )
    tonight = _measured(tracker, retest_run_id, wanted)
    check.arm_versions = dict(tonight.versions)
    check.values = [
        {"arm": k[0], "workload": k[1], "metric": k[2], "launch_log_means": v, "launches": len(v)}
        for k, v in sorted(tonight.launches.items())
    ]
    earlier, kept, check.series = _series(tracker, run, rule)
    check.answers, check.answers_note = _answers_moved(tracker, run, earlier, kept)
    if not tonight.launches:
        check.speed = "nothing measured"
        check.status = "worse" if check.answers else check.speed
        return check
    # the series of each figure: the kept earlier retests that measured it, then tonight
    past = [
        (r, _recorded(tracker, r.info.run_id, wanted)) for r, keep in zip(earlier, kept, strict=True) if keep
    ]
    by_id = {r.info.run_id: vals for r, vals in past}
    series: dict[Key, list[tuple[Any, float]]] = {}
    for key in sorted(tonight.launches):
        series[key] = [(r, m) for r, vals in past if (m := vals.log_mean(key)) is not None]
    judged = {k: s for k, s in series.items() if len(s) >= rule.min_history}
    for key, s in series.items():
        if key not in judged:
            check.insufficient[" / ".join(key)] = len(s)
    for arm, bad in tonight.versions.items():
        last = next((vals.versions[arm] for _, vals in reversed(past) if arm in vals.versions), None)
        check.versions[arm] = {"good": last or "?", "bad": bad}
    if not judged:
        check.speed = "insufficient history"
        check.status = "worse" if check.answers else check.speed
        return check
    figures = len(judged)
    for key, s in judged.items():
        arm, workload, metric = key
        sign = -1.0 if _higher_is_better(metric) else 1.0  # worse is larger on the scan's scale
        now = tonight.log_mean(key)
        if now is None:  # not one of tonight's figures (every key of the series is)
            continue
        logs = [sign * m for _, m in s] + [sign * now]
        j = judge(logs, [True] * len(logs), figures, margin_pct, rule)
        check.compared += 1
        if j.status != "worse":
            continue
        history = [r for r, _ in s[: len(s) - (j.segment - 1)]]
        segment = [r for r, _ in s[len(s) - (j.segment - 1) :]] + [run]
        hist_mean = sum(sign * m for _, m in s[: len(history)]) / len(history)
        seg_mean = (sum(sign * m for _, m in s[len(history) :]) + sign * now) / j.segment

        def own(rel: float, sign: float = sign) -> float:
            """A relative change on the scan's scale (worse positive) in the figure's own direction."""
            return math.expm1(sign * math.log1p(rel))

        low, high = sorted((own(j.low), own(j.high)))
        check.worse.append(
            Worse(
                arm=arm,
                workload=workload,
                metric=metric,
                change=f"{_pct(own(j.change))} [{_pct(low)}, {_pct(high)}]",
                tonight=_pct(own(j.tonight)),
                segment=j.segment,
                since_run_id=segment[0].info.run_id,
                since=_when(segment[0].info.start_time),
                history=len(history),
                history_first_run_id=history[0].info.run_id,
                history_first=_when(history[0].info.start_time),
                history_last_run_id=history[-1].info.run_id,
                history_last=_when(history[-1].info.start_time),
                history_mean=math.exp(sign * hist_mean),
                segment_mean=math.exp(sign * seg_mean),
                p_value=j.p_value,
                level=j.level,
            )
        )
        good = by_id.get(history[-1].info.run_id)
        if good is not None and arm in good.versions:
            check.versions[arm]["good"] = good.versions[arm]
    check.speed = "worse" if check.worse else "none"
    check.status = "worse" if check.worse or check.answers else "none"
    return check


def _answers_moved(
    tracker: Tracker, run: Any, earlier: list[Any], kept: list[bool]
) -> tuple[list[AnswersMoved], str | None]:
    """Tonight's answers (the output probe of its baseline study) against those of the retest the
    series starts at (its first kept retest that recorded answers), arm by arm, judged against the
    floor (the arm launched twice tonight, else in that retest) at :data:`ANSWERS_ALPHA` over the arms
    (k3pipe.verdicts.answers.judge, the experiment's answers.margin_nats). No
    min_history: the floor comes from
    the launches, not from the series. ([], why) when there is nothing to compare."""
    study = _baseline_study(tracker, run.info.run_id)
    if study is None:
        return [], None
    tonight = collect(tracker, study.info.run_id)
    if not any(a.answers for a in tonight.arms):
        return [], None
    reference = None
    for r, keep in zip(earlier, kept, strict=True):
        other = _baseline_study(tracker, r.info.run_id) if keep else None
        if other is not None:
            data = collect(tracker, other.info.run_id)
            if any(a.answers for a in data.arms):
                reference = (r, data)
                break
    if reference is None:
        return [], "no earlier retest of the series recorded answers: tonight's are the first"
    against, then = reference
    margin = float((tonight.answers or {}).get("margin_nats", 0.0))
    arms = [a for a in tonight.arm_names if first_answers(tonight, a) and first_answers(then, a)]
    alpha = ANSWERS_ALPHA / max(1, len(arms))
    moved: list[AnswersMoved] = []
    unjudged: list[str] = []
    for arm in arms:
        mine, theirs = first_answers(tonight, arm), first_answers(then, arm)
        assert mine is not None
        assert theirs is not None
        if mine[1].digest != theirs[1].digest:
            unjudged.append(f"{arm} (other probe prompts)")
            continue
        label, floor = floor_of(tonight, arm, mine)
        if floor is None:
            label, floor = floor_of(then, arm, theirs)
            label = f"retest {against.info.run_id[:12]}'s {label}" if label else None
        if floor is None:
            unjudged.append(f"{arm} (no floor: launched once in both)")
            continue
        verdict = judge_answers(
            agreement(mine[1].answers, theirs[1].answers), floor, margin=margin, alpha=alpha
        )
        if verdict.diverges:
            moved.append(
                AnswersMoved(
                    arm, against.info.run_id, _when(against.info.start_time), verdict.describe(), str(label)
                )
            )
    note = f"{len(arms) - len(unjudged)} arm(s) compared with retest {against.info.run_id[:12]}"
    if unjudged:
        note += "; not judged: " + ", ".join(unjudged)
    return moved, note


def record_regression(tracker: Tracker, check: RegressionCheck) -> None:
    """The check on the retest's run: :data:`REGRESSION_TAG` and :data:`REGRESSION_FILE`."""
    tag = "none" if check.status == "none" else check.summary()
    tracker.set_tags(check.retest_run_id, {REGRESSION_TAG: tag[:4000]})
    tracker.log_dict(check.retest_run_id, json.loads(json.dumps(check.as_dict())), REGRESSION_FILE)


# --- accepting a new baseline ------------------------------------------------------------------


@dataclass(frozen=True)
class Accepted:
    """A retest accepted as the new baseline (:func:`accept`)."""

    run_id: str
    experiment: str
    overrides: dict[str, str]
    at: str
    """When it was accepted (UTC, ISO 8601): its tag :data:`ACCEPTED_TAG`."""
    later: int
    """Retests of its series started after it: their alerts are cleared, their values its history."""
    newer_accepted: str | None
    """A later retest of the same series already accepted: the series starts there, not here."""


def accept(tracker: Tracker, run_ref: str, now: datetime | None = None) -> Accepted:
    """Accept the retest ``run_ref`` (its run id, or a unique prefix) as the new normal: the series of
    every later retest of its experiment with its overrides starts at it, and the alerts of the
    retests between it and now are cleared (they showed what is now accepted). A version bump that
    is meant to be slower, or a node that changed, is accepted this way; the next retests are judged
    against it once the series has :attr:`~k3pipe.verdicts.series.SeriesRule.min_history` retests again."""
    run = find_run(tracker, run_ref)
    run_id = run.info.run_id
    kind = RunTags.of(run).kind
    if kind != RETEST_KIND:
        raise TrackingError(
            f"run {run_id} is not a retest's run (its tag k3pipe.kind is {kind!r}): give the id "
            "`k3pipe retest` printed ('retest: MLflow run id ...'), or find it with `k3pipe runs`"
        )
    if RunTags.of(run).rerun_of:
        raise TrackingError(
            f"run {run_id} is a rerun of retest {run.data.tags[RERUN_TAG]}: a rerun measures an old "
            "record again and is in no series; accept a scheduled retest's run"
        )
    if run.info.status != "FINISHED":
        raise TrackingError(
            f"retest run {run_id} did not finish (status {run.info.status}): accept a retest that finished"
        )
    at = (now or datetime.now(UTC)).astimezone(UTC).isoformat(timespec="seconds")
    tracker.set_tags(run_id, {ACCEPTED_TAG: at})
    experiment = RunTags.of(run).experiment or ""
    overrides = _overrides(run)
    same = [
        r
        for r in _retest_runs(tracker, experiment)
        if _overrides(r) == overrides and not RunTags.of(r).rerun_of and r.info.run_id != run_id
    ]
    later = [r for r in same if r.info.start_time > run.info.start_time]
    newer = [r for r in later if RunTags.of(r).accepted]
    return Accepted(
        run_id=run_id,
        experiment=experiment,
        overrides=overrides,
        at=at,
        later=len(later),
        newer_accepted=max(newer, key=lambda r: r.info.start_time).info.run_id if newer else None,
    )
