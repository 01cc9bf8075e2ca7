"""A study: every arm of an experiment on every workload, arms one after another on the node (the
GPUs are exclusive), under one parent MLflow run (study -> arm -> workload -> repeat), every arm
sending the same prompts.

An arm with ``launches: N`` is launched N times, each launch an arm run of its own (tagged
``k3pipe.launch``) running every workload; the launches of all arms are interleaved (A B, B A, A B
...: :func:`k3pipe.schema.schedule.interleaved_order`), so that a drift over the study's time favours no arm.
With ``decision.calibration`` the baseline's A/A copy (``<arm>-aa``) runs right after it, launched
like it. With ``decision.prime`` every arm is first launched once more, each workload once, to fill
the node's caches: that launch is an arm run tagged ``k3pipe.prime`` (launch 0), left out of the
verdicts (:func:`k3pipe.report.collect.collect` keeps it apart).

While one arm runs, the next arms' inputs are already being fetched: the models only they need (a
draft) in one background lane, their images in another, in arm order. Each arm waits only for what
is still missing when its turn comes. The study's run records each stage's time (``stage.<arm>.*``),
the wall time, what the stages would take one after another, and the difference the overlap saved.

An arm that fails (its inputs, its launch, its workloads) is recorded as failed and the study goes on
with the others; an interrupt stops the background work, closes the study's run as KILLED and goes
on up. :func:`start_study` opens the parent run; :class:`Study` runs the arms.
"""

from __future__ import annotations

import contextvars
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from k3pipe.core.layout import (
    ARM_TAG,
    DECISION_ALPHA_TAG,
    DECISION_LOOK_TAG,
    DECISION_LOOKS_TAG,
    DECISION_STOPPED_TAG,
    EXPERIMENT_FILE,
    EXPERIMENT_TAG,
    FAILED_ARMS_TAG,
    KIND_TAG,
    LAUNCH_TAG,
    LAUNCHES_TAG,
    PRIME_TAG,
    STUDY_KIND,
    TUNE_FILE,
    TUNE_OUTCOME_TAG,
    TUNE_WINNER_FILE,
    TUNE_WINNER_TAG,
    stage_prefix,
)
from k3pipe.core.secrets import redact_data, scrub
from k3pipe.core.settings import Settings
from k3pipe.engines.base import Finding
from k3pipe.jobs.arm_run import ArmOutcome, ArmRun, ArmSteps
from k3pipe.jobs.fleet import Remote, Ticket, dispatch, log_study_prompts
from k3pipe.launchers.factory import pull_image
from k3pipe.planning.plan import ArmPlan, plan_arm
from k3pipe.prompts.corpora import PromptSet
from k3pipe.records.recorder import record_failed_arm
from k3pipe.records.runrecord import KeptWorkloads
from k3pipe.records.tracking import Tracker
from k3pipe.schema.schedule import interleaved_order, launch_order, models_of, prime_order, study_arm_names
from k3pipe.schema.specs import ArmSpec, ExperimentSpec, FleetSpec, LocalModel, ModelScopeModel
from k3pipe.sources import ModelRecord, fetch_model
from k3pipe.sources.images import ImageRecord
from k3pipe.verdicts import stats
from k3pipe.verdicts.racing import Race, RaceResult, RaceRules

if TYPE_CHECKING:
    from k3pipe.report.collect import StudyData

__all__ = [
    "Study",
    "StudyOutcome",
    "StudySteps",
    "primed_spec",
    "start_study",
]

log = logging.getLogger("k3pipe.jobs.study_run")


def decision_reached(tracker: Tracker, run_id: str, ci_pct: float, alpha: float) -> tuple[bool, str]:
    """Whether every decision comparison of the study so far is decided (different, or equivalent)
    or has an interval within +-``ci_pct`` at this look's ``alpha``; and why, in words."""
    from k3pipe.report.analysis import analyse
    from k3pipe.report.collect import collect

    data = collect(tracker, run_id)
    data.look = {"alpha": alpha}
    analysis = analyse(data)
    pairs = [v for r in analysis.rows if r.decision for v in r.verdicts]
    if not pairs:
        return False, "no decision comparison could be made yet"
    bound = math.log1p(ci_pct / 100)
    open_ = []
    for v in pairs:
        if v.outcome in ("different", "equivalent"):
            continue
        ci = v.ci  # its bounds 0 or inf where the interval is unbounded (a tiny alpha, few launches)
        if ci is not None and ci[0] > 0 and math.isfinite(ci[1]) and math.log(ci[1] / ci[0]) / 2 <= bound:
            continue
        open_.append(f"{v.metric} {v.a}/{v.b} in {v.workload}")
    if not open_:
        return True, f"every decision comparison decided or within +-{ci_pct:g}% ({len(pairs)} in all)"
    shown = ", ".join(open_[:3]) + (f" and {len(open_) - 3} more" if len(open_) > 3 else "")
    return False, f"{len(open_)} of {len(pairs)} comparisons open ({shown})"


def primed_spec(spec: ExperimentSpec) -> ExperimentSpec:
    """``spec`` as a priming launch runs it: each workload once."""
    once = [w.model_copy(update={"repeats": 1}) for w in spec.workloads]
    return spec.model_copy(update={"workloads": once})


@dataclass
class StudySteps:
    """The study's own steps (the arms' are an :class:`ArmSteps`); the flow passes its tasks."""

    fetch_model: Callable[[str, ModelScopeModel | LocalModel, Path], ModelRecord]
    pull_image: Callable[[ArmPlan], ImageRecord]
    arm: ArmSteps

    @classmethod
    def library(cls, say: Callable[[str], None] | None = None) -> StudySteps:
        out: Callable[[str], None] = say or log.info
        return cls(
            fetch_model=lambda name, spec, home: fetch_model(spec, home, progress=out),
            pull_image=lambda plan: pull_image(plan, progress=out),
            arm=ArmSteps.library(out),
        )


def start_study(
    tracker: Tracker,
    spec: ExperimentSpec,
    experiment_file: str,
    tags: Mapping[str, str] | None = None,
    params: Mapping[str, Any] | None = None,
    parent_id: str | None = None,
    arms: list[str] | None = None,
) -> str:
    """The study's parent run: its experiment, arms (``study_arms``: those it runs, default all) and
    workloads, and ``params`` besides (the overrides it was started with, ``override.*``); nested
    under ``parent_id`` (a retest's run) when given."""
    run_id = tracker.start_run(
        f"study/{spec.name}",
        tags={KIND_TAG: STUDY_KIND, EXPERIMENT_TAG: spec.name, **(tags or {})},
        parent_id=parent_id,
    )
    tracker.log_params(
        run_id,
        {
            "experiment_file": experiment_file,
            "arms": ",".join(a.name for a in spec.arms),
            "study_arms": ",".join(arms or [a.name for a in spec.arms]),
            "workloads": ",".join(w.name for w in spec.workloads),
            **(params or {}),
        },
    )
    tracker.log_dict(run_id, redact_data(spec.model_dump(mode="json")), EXPERIMENT_FILE)
    return run_id


class StudyOutcome:
    """How the study went: each arm's outcome, the stage times, and the study's run."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.arms: list[ArmOutcome] = []
        self.primes: list[ArmOutcome] = []
        """The priming launches (``decision.prime``): not among :attr:`arms`, nor in :attr:`failed`."""
        self.stages: dict[str, float] = {}

    @property
    def failed(self) -> list[ArmOutcome]:
        return [o for o in self.arms if o.status != "FINISHED"]


def _in_background(pool: ThreadPoolExecutor, fn: Callable[..., Any], *args: Any) -> Future[Any]:
    """``fn(*args)`` on ``pool`` in a copy of this context (a Prefect task then runs in this flow)."""
    ctx = contextvars.copy_context()
    return pool.submit(ctx.run, fn, *args)


@dataclass
class Study:
    """Every arm of ``spec`` in order, each an :class:`ArmRun` nested under the study's run."""

    spec: ExperimentSpec
    run_id: str
    tracker: Tracker
    settings: Settings
    models: Mapping[str, ModelRecord]
    """Models already fetched ('model' at least: the prompts were drawn with its tokenizer)."""
    prompts: Mapping[str, list[PromptSet]]
    findings: list[Finding] = field(default_factory=list)
    experiment_file: str = ""
    steps: StudySteps = field(default_factory=StudySteps.library)
    tags: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    """Params for every arm's run besides its plan's (the overrides the study was started with)."""
    arms: list[str] | None = None
    before_s: float = 0.0
    """Seconds spent before the study began (the first model's fetch), part of its wall time."""
    say: Callable[[str], None] = log.info
    warn: Callable[[str], None] = log.error
    done: Mapping[tuple[str, int], str] = field(default_factory=dict)
    """Launches (arm, launch; 0: priming) that finished before a resume -> their arm runs: not run again."""
    kept: Mapping[tuple[str, int], KeptWorkloads] = field(default_factory=dict)
    """Unfinished launches before a resume -> the workloads they finished cleanly: not run again."""
    prior_stages: Mapping[str, float] = field(default_factory=dict)
    """The study run's stage times recorded before a resume."""
    prior_wall_s: float = 0.0
    """The study's wall time recorded before a resume."""
    pruned: Mapping[str, str] = field(default_factory=dict)
    """A search's candidates preflight found cannot start, each with why: out of the race before it."""
    remote: Remote | None = None
    """With the experiment's ``fleet``: runs a launch on a pool (the study flow's deployment runs)
    and says what a pool is doing; the launches are then spread over the pools
    (:func:`k3pipe.jobs.fleet.dispatch`), not run here."""

    def _prefetch(
        self, arms: Iterable[ArmSpec], models: ThreadPoolExecutor, images: ThreadPoolExecutor
    ) -> tuple[dict[str, Future[ModelRecord]], dict[str, Future[ImageRecord]]]:
        home = self.settings.home_dir
        model_futures: dict[str, Future[ModelRecord]] = {}
        image_futures: dict[str, Future[ImageRecord]] = {}
        for arm in arms:
            for name in models_of(arm):
                if name in self.models or name in model_futures:
                    continue
                if name not in self.spec.extra_models:
                    continue  # an unknown name: the arm's plan says so when it renders
                model_futures[name] = _in_background(
                    models, self.steps.fetch_model, name, self.spec.extra_models[name], home
                )
            if arm.launcher.pins_image:
                plan = plan_arm(self.spec, arm, home)  # the image reference does not need the models
                image_futures[arm.name] = _in_background(images, self.steps.pull_image, plan)
        return model_futures, image_futures

    def execute(self) -> StudyOutcome:
        outcome = StudyOutcome(self.run_id)
        names = study_arm_names(self.spec, self.arms)
        arms = [self.spec.arm(n) for n in names]
        order = launch_order(self.spec, names)
        until = self.spec.decision.until
        tune = self.spec.tune
        most = {
            n: max(
                self.spec.arm(n).launches,
                until.max_launches if until else 0,
                tune.budget.max_launches if tune else 0,
            )
            for n in names
        }
        if len(order) > len(names):
            self.say("launch order: " + " ".join(f"{a}#{k}" for a, k in order))
            self.tracker.log_params(self.run_id, {"launch_order": " ".join(f"{a}#{k}" for a, k in order)})
        start = time.perf_counter()
        status = "KILLED"
        models_pool = ThreadPoolExecutor(1, thread_name_prefix="k3pipe-models")
        images_pool = ThreadPoolExecutor(1, thread_name_prefix="k3pipe-images")
        fleet = self.spec.fleet if self.remote is not None else None
        try:
            if fleet is not None:
                # each node fetches its own inputs; the prompts are drawn once, here, and sent to all
                model_futures: dict[str, Future[ModelRecord]] = {}
                image_futures: dict[str, Future[ImageRecord]] = {}
                log_study_prompts(self.tracker, self.run_id, self.prompts)
                self.say(f"fleet: {len(order)} launch(es) spread over pools {', '.join(fleet.pools)}")
            else:
                model_futures, image_futures = self._prefetch(arms, models_pool, images_pool)

            def launch_all(launches: list[tuple[str, int]]) -> None:
                if fleet is not None:
                    self._dispatch(launches, fleet, outcome, most)
                    return
                for name, launch in launches:
                    if (name, launch) in self.done:
                        outcome.arms.append(self._kept(name, launch))
                        continue
                    arm = self.spec.arm(name)
                    outcome.arms.append(
                        self._arm(arm, model_futures, image_futures, outcome.stages, launch, most[name])
                    )

            for name in prime_order(self.spec, names):
                if (name, 0) in self.done:
                    outcome.primes.append(self._kept(name, 0))
                    continue
                primed = self._arm(
                    self.spec.arm(name), model_futures, image_futures, outcome.stages, 0, most[name]
                )
                outcome.primes.append(primed)
                if primed.status != "FINISHED":
                    self.warn(f"arm {name}: its priming launch {primed.status}: {primed.error}; going on")
            launch_all(order)
            if until is not None:
                self._until(names, order, launch_all, start)
            if tune is not None:
                self._race(names, order, launch_all, outcome)
            status = "FINISHED"
        finally:
            models_pool.shutdown(wait=False, cancel_futures=True)
            images_pool.shutdown(wait=False, cancel_futures=True)
            self._close(outcome, time.perf_counter() - start, status)
            if status != "FINISHED":
                self._say_resume(outcome)
        return outcome

    def _say_resume(self, outcome: StudyOutcome) -> None:
        """A study stopped before its end (a deadline's SIGINT, Ctrl-C, a kill): which one, what is
        kept, and the command that runs the rest."""
        done = sum(o.status == "FINISHED" for o in outcome.arms)
        self.warn(
            f"study {self.spec.name} (MLflow run {self.run_id}) stopped before its end: {done} launch(es) "
            "finished and are kept; a launch cut short enters no figure of the report. Run the rest with "
            f"`k3pipe study --resume {self.run_id}`"
        )

    def _until(
        self,
        names: list[str],
        done: list[tuple[str, int]],
        launch_all: Callable[[list[tuple[str, int]]], None],
        start: float,
    ) -> None:
        """Rounds of one more launch per arm while the decision is not reached (``decision.until``),
        each round a look at the data with its share of alpha (:func:`k3pipe.verdicts.stats.spend_alpha`)."""
        until = self.spec.decision.until
        assert until is not None
        planned = {n: self.spec.arm(n).launches for n in names}
        rounds = until.max_launches - max(planned.values())
        shares = stats.spend_alpha(self.spec.decision.alpha, rounds + 1)
        ran = list(done)
        round_s = [time.perf_counter() - start]
        for look in range(rounds + 1):
            self._note_look(look + 1, rounds + 1, shares[look])
            reached, why = decision_reached(self.tracker, self.run_id, until.ci_pct, shares[look])
            if reached or look == rounds:
                stop = why if reached else f"the most launches ({until.max_launches} per arm) ran; {why}"
                self.say(f"decision: stopping at look {look + 1} of at most {rounds + 1}: {stop}")
                self.tracker.set_tags(self.run_id, {DECISION_STOPPED_TAG: stop})
                return
            elapsed = time.perf_counter() - start
            if until.budget_s is not None and elapsed + max(round_s) > until.budget_s:
                stop = (
                    f"budget: another round (about {max(round_s):.0f} s) would end after budget_s "
                    f"{until.budget_s:g} s ({elapsed:.0f} s spent); {why}"
                )
                self.say(f"decision: stopping at look {look + 1} of at most {rounds + 1}: {stop}")
                self.tracker.set_tags(self.run_id, {DECISION_STOPPED_TAG: stop})
                return
            self.say(f"decision: not reached at look {look + 1} ({why}): one more launch of every arm")
            counts = {n: planned[n] + look + 1 for n in names}
            full = interleaved_order(names, [counts[n] for n in names])
            extra = [pair for pair in full if pair not in ran]
            began = time.perf_counter()
            launch_all(extra)
            ran.extend(extra)
            round_s.append(time.perf_counter() - began)

    def _race(
        self,
        names: list[str],
        done: list[tuple[str, int]],
        launch_all: Callable[[list[tuple[str, int]]], None],
        outcome: StudyOutcome,
    ) -> RaceResult | None:
        """The search's race (``tune``; :mod:`k3pipe.verdicts.racing`): after the candidates' first
        launches, each look drops those the verdict rules find worse than the leader and launches the
        survivors once more, until a winner, an equivalence or the budget; the result and the winner
        as an arm are recorded on the study's run."""
        from k3pipe.core.figures import figure
        from k3pipe.report.analysis import hardware_refusal
        from k3pipe.report.collect import collect

        tune = self.spec.tune
        assert tune is not None
        metric, workload = tune.objective.metric, tune.objective.workload
        rules = RaceRules(
            alpha=tune.alpha, margin=tune.margin_pct / 100, first_launches=tune.budget.first_launches,
            max_launches=tune.budget.max_launches, higher_is_better=figure(metric).higher_is_better,
        )  # fmt: skip
        race = Race(names, rules)
        fed = dict.fromkeys(names, 0)
        seen: set[tuple[str, int]] = set()
        launched = {n: max((k for a, k in done if a == n), default=0) for n in names}
        while True:
            for arm in outcome.arms:  # a launch that failed is the candidate's result
                key = (arm.arm, arm.launch)
                if key in seen or arm.arm not in fed:
                    continue
                seen.add(key)
                if arm.status != "FINISHED" and arm.arm in race.alive:
                    race.fail(arm.arm, f"launch {arm.launch} {arm.status}: {arm.error or 'no reason given'}")
            data = collect(self.tracker, self.run_id)
            cells = {c.arm: c for c in data.cells if c.workload == workload}
            for name in race.alive:
                cell = cells.get(name)
                launches = (cell.launch_values or [cell.values]) if cell is not None else []
                # the round's launches only: a resumed search holds later ones, fed round by round as
                # the first run would have been (a kept launch is not launched again)
                while name in race.wanted() and fed[name] < len(launches):
                    race.record(name, launches[fed[name]].get(metric, []))
                    fed[name] += 1
            for name in race.wanted():  # its launches ran, but fewer were counted (cut, or a failed workload)
                race.fail(name, f"{metric} on {workload} was not measured in launch {fed[name] + 1}")
            if self.spec.answers is not None and race.round == 0 and not race.wanted():
                self._answers_gate(race, data, names)
            refusal = None if data.decision.get("mixed_hardware") else hardware_refusal(data, race.alive)
            if refusal is not None:  # a fleet's nodes differ: no candidate is ranked on another's GPUs
                self._record_unranked(refusal, rules, launched)
                return None
            if not race.alive:
                self.warn("tune: every candidate failed; the study's arm runs say why")
                self.tracker.set_tags(self.run_id, {TUNE_OUTCOME_TAG: "failed"})
                return None
            result = race.close_round()
            if result is not None:
                break
            over = self._over_device_budget(names, len(race.wanted()))
            if over is not None:
                self.say(f"tune: stopping after look {race.round}: {over}")
                result = race.stop(over)
                break
            extra = [(n, launched[n] + 1) for n in race.wanted()]
            self.say(
                f"tune: look {race.round} of at most {rules.looks}: {len(race.alive)} candidate(s) left "
                f"({', '.join(race.alive)}); one more launch each"
            )
            for n, k in extra:
                launched[n] = k
            launch_all(extra)
        self._record_race(result, rules)
        return result

    def _device_s(self, names: Sequence[str]) -> tuple[float, int]:
        """The device time the candidates' launches held (seconds, each launch's run from its start to
        its teardown: on several nodes they add), and how many launches ended."""
        ended = [
            (run.info.end_time - run.info.start_time) / 1000
            for run in self.tracker.children(self.run_id)
            if run.data.tags.get(ARM_TAG) in names and run.info.end_time
        ]
        return math.fsum(ended), len(ended)

    def _over_device_budget(self, names: Sequence[str], launches: int) -> str | None:
        """Why the next round (``launches`` launches) may not start under ``tune.budget.device_minutes``:
        it would pass the budget at the launches' mean so far. None when it may, or there is no budget."""
        tune = self.spec.tune
        assert tune is not None
        budget = tune.budget.device_minutes
        if budget is None:
            return None
        spent, ended = self._device_s(names)
        if not ended:
            return None
        cost = spent / ended * launches
        if spent + cost <= budget * 60:
            return None
        return (
            f"the device-time budget ({budget:g} min) would be passed by another round: {spent / 60:.1f} "
            f"min spent on {ended} launches, the next {launches} about {cost / 60:.1f} min more"
        )

    def _answers_gate(self, race: Race, data: StudyData, names: list[str]) -> None:
        """Before the first look: each candidate's answers (the output probe of its first launch)
        against the reference candidate's (the searched arm's own settings, else the first), judged
        against the floor (the reference launched again) by the study's rules
        (:mod:`k3pipe.report.gate`); a candidate whose answers diverge beyond the floor is not
        eligible and leaves the race, what it measured kept."""
        from k3pipe.report.gate import analyse_answers

        tune = self.spec.tune
        assert tune is not None
        reference = tune.reference(self.spec.arm(tune.arm), names)
        answers = analyse_answers(
            data.model_copy(update={"decision": {**data.decision, "baseline": reference}})
        )
        if answers is None:
            self.warn("tune: no launch answered the output probe; the answers gate judged nothing")
            return
        for row in answers.arms:
            if row.verdict is None:
                self.warn(f"tune: {row.arm}'s answers not judged against {reference}'s: {row.why_not}")
            elif row.verdict.diverges and row.arm in race.alive:
                why = (
                    f"its answers diverge beyond the floor ({reference} launched again): "
                    + row.verdict.describe()
                )
                self.warn(f"tune: {row.arm} is not eligible: {why}")
                race.exclude(row.arm, why)
        self.tracker.log_params(self.run_id, {"tune_answers_reference": reference})

    def _record_unranked(self, refusal: str, rules: RaceRules, launched: Mapping[str, int]) -> None:
        """A search whose candidates ran on different hardware (decision.mixed_hardware off): stopped
        unranked, said why; no winner written out."""
        tune = self.spec.tune
        assert tune is not None
        text = refusal.replace("the arms were measured", "the candidates were measured", 1)
        self.warn(f"tune: {text}")
        self.tracker.set_tags(self.run_id, {TUNE_OUTCOME_TAG: "not-ranked"})
        self.tracker.log_dict(
            self.run_id,
            {
                "outcome": "not-ranked", "text": text, "winner": None, "leader": None, "survivors": [],
                "dropped": [], "pruned": dict(self.pruned), "rounds": 0, "path": [],
                "launches": sum(launched.values()),
                "full_launches": len(launched) * rules.max_launches,
                "objective": {"metric": tune.objective.metric, "workload": tune.objective.workload},
                "rules": {"alpha": rules.alpha, "margin": rules.margin,
                          "first_launches": rules.first_launches, "max_launches": rules.max_launches,
                          "device_minutes": tune.budget.device_minutes},
                "candidates": {c.name: {"settings": c.settings} for c in self.spec.tune_candidates()},
            },
            TUNE_FILE,
        )  # fmt: skip

    def _record_race(self, result: RaceResult, rules: RaceRules) -> None:
        tune = self.spec.tune
        assert tune is not None
        settings = {c.name: c.settings for c in self.spec.tune_candidates()}
        text = result.text()
        if self.pruned:
            text += "; left out by preflight: " + "; ".join(f"{n} ({why})" for n, why in self.pruned.items())
        device_s, _ = self._device_s([c.name for c in self.spec.tune_candidates()])
        text += f"; device time {device_s / 60:.1f} min"
        self.say(f"tune: {text}")
        self.tracker.set_tags(
            self.run_id,
            {TUNE_OUTCOME_TAG: result.outcome, **({TUNE_WINNER_TAG: result.winner} if result.winner else {})},
        )
        self.tracker.log_dict(
            self.run_id,
            {
                "outcome": result.outcome,
                "text": text,
                "winner": result.winner,
                "leader": result.leader,
                "survivors": list(result.survivors),
                "dropped": [
                    {"name": d.name, "round": d.round, "reason": d.reason, "failed": d.failed,
                     "ineligible": d.ineligible}
                    for d in result.dropped
                ],
                "pruned": dict(self.pruned),
                "rounds": result.rounds,
                "path": [
                    {"round": look.round, "leader": look.leader, "means": look.means,
                     "launches": look.launches, "dropped": list(look.dropped)}
                    for look in result.path
                ],
                "launches": result.launches,
                "full_launches": result.full_launches,
                "device_s": round(device_s, 1),
                "stopped": result.stopped,
                "objective": {"metric": tune.objective.metric, "workload": tune.objective.workload},
                "rules": {"alpha": rules.alpha, "margin": rules.margin,
                          "first_launches": rules.first_launches, "max_launches": rules.max_launches,
                          "device_minutes": tune.budget.device_minutes},
                "candidates": {
                    name: {"settings": settings[name],
                           **({"mean": est.mean} if (est := result.estimates.get(name)) else {})}
                    for name in settings
                },
            },
            TUNE_FILE,
        )  # fmt: skip
        best = self.spec.arm(result.leader)
        original = tune.arm
        arm = best.model_copy(update={"name": original, "launches": 2}).model_dump(
            mode="json", exclude_defaults=True
        )
        note = (
            f"# the search's {'winner' if result.winner else 'leader (undecided)'}: {result.leader} "
            f"({' '.join(f'{k}={v}' for k, v in settings[result.leader].items())})\n# {text}\n"
        )
        self.tracker.log_text(self.run_id, note + yaml.safe_dump([arm], sort_keys=False), TUNE_WINNER_FILE)

    def _dispatch(
        self,
        launches: list[tuple[str, int]],
        fleet: FleetSpec,
        outcome: StudyOutcome,
        most: Mapping[str, int],
    ) -> None:
        """``launches`` over the fleet's pools; a launch that never made a run (its pool's worker never
        came, the node could not read the study) is recorded as a failed arm run, as a launch here is."""
        assert self.remote is not None
        todo = [Ticket(n, k, most[n]) for n, k in launches if (n, k) not in self.done]
        pools = lambda arm: fleet.pools_of(self.spec.searched(arm), self.spec.baseline_arm)  # noqa: E731
        remote = self.remote
        ran = iter(
            dispatch(todo, pools, remote.run_on, self.say, self.warn, probe=remote.probe, waits=remote.waits)
        )
        for name, launch in launches:
            if (name, launch) in self.done:
                outcome.arms.append(self._kept(name, launch))
                continue
            result = next(ran)
            if not result.mlflow_run_id:
                tags = {**self.tags, LAUNCH_TAG: str(launch), LAUNCHES_TAG: str(most[name])}
                result.mlflow_run_id = record_failed_arm(
                    self.tracker, self.spec.name, name, self.spec.arm(name).engine.kind,
                    result.error or "not run", tags, self.run_id,
                )  # fmt: skip
            outcome.arms.append(result)

    def _kept(self, name: str, launch: int) -> ArmOutcome:
        """A launch that finished before the study was resumed: kept, not run again."""
        self.say(
            f"arm {name} launch {launch}: finished before the resume (run {self.done[(name, launch)]}), kept"
        )
        return ArmOutcome(arm=name, mlflow_run_id=self.done[(name, launch)], status="FINISHED", launch=launch)

    def _note_look(self, look: int, looks: int, alpha: float) -> None:
        """Where the study stands among its looks: the report's verdicts use this look's alpha."""
        self.tracker.set_tags(
            self.run_id,
            {DECISION_LOOK_TAG: str(look), DECISION_LOOKS_TAG: str(looks),
             DECISION_ALPHA_TAG: repr(alpha)},
        )  # fmt: skip

    def _arm(
        self,
        arm: ArmSpec,
        model_futures: Mapping[str, Future[ModelRecord]],
        image_futures: Mapping[str, Future[ImageRecord]],
        stages: dict[str, float],
        launch: int = 1,
        launches: int = 1,
    ) -> ArmOutcome:
        prefix = stage_prefix(arm.name, launch)
        tags = {**self.tags, LAUNCH_TAG: str(launch), LAUNCHES_TAG: str(launches)}
        if launch == 0:
            tags[PRIME_TAG] = "1"
        waited = time.perf_counter()
        models: dict[str, ModelRecord] = {}
        try:
            for name in models_of(arm):
                if name in self.models:
                    models[name] = self.models[name]
                elif name in model_futures:
                    models[name] = model_futures[name].result()
                    stages[f"{prefix}models_s"] = (
                        stages.get(f"{prefix}models_s", 0.0) + models[name].duration_s
                    )
        except Exception as exc:
            error = scrub(f"{type(exc).__name__}: {exc}")
            self.warn(f"arm {arm.name}: its models could not be had: {error}")
            run_id = record_failed_arm(
                self.tracker, self.spec.name, arm.name, arm.engine.kind, error, tags, self.run_id
            )
            return ArmOutcome(arm=arm.name, mlflow_run_id=run_id, status="FAILED", error=error, launch=launch)
        waits = [time.perf_counter() - waited]

        def image(plan: ArmPlan) -> ImageRecord:
            t = time.perf_counter()
            record = (
                image_futures[arm.name].result() if arm.name in image_futures else self.steps.pull_image(plan)
            )
            waits.append(time.perf_counter() - t)
            stages[f"{prefix}image_pull_s"] = record.duration_s
            return record

        which = f" launch {launch} of {launches}" if launches > 1 else ""
        if launch == 0:
            which = " priming launch (each workload once, not in the verdicts)"
        kept = self.kept.get((arm.name, launch))
        if kept is not None:
            left = len(self.spec.workloads) - len(kept.workloads)
            self.say(
                f"arm {arm.name}{which}: starting again ({left} workload(s); kept from its earlier run "
                f"{kept.arm_run_id}: {', '.join(kept.workloads)})"
            )
        else:
            self.say(f"arm {arm.name}{which}: starting ({len(self.spec.workloads)} workload(s))")
        began = time.perf_counter()
        run = ArmRun(
            primed_spec(self.spec) if launch == 0 else self.spec, arm.name, models, self.prompts,
            self.tracker, self.settings, self.findings,
            self.experiment_file, self.steps.arm, tags=tags, labels=dict(self.labels),
            params=dict(self.params), parent_run_id=self.run_id, image_source=image, say=self.say,
            warn=self.warn, kept=kept,
        )  # fmt: skip
        try:
            result = run.execute()
        finally:
            stages[f"{prefix}input_wait_s"] = sum(waits)
            stages[f"{prefix}run_s"] = time.perf_counter() - began - (waits[1] if len(waits) > 1 else 0.0)
            # each launch's stages as it ends: a study whose command is killed keeps those of its
            # finished launches (a resume adds the rest)
            own = ("models_s", "image_pull_s", "input_wait_s", "run_s")
            self.tracker.log_metrics(
                self.run_id,
                {f"{prefix}{k}": stages[f"{prefix}{k}"] for k in own if f"{prefix}{k}" in stages},
            )
        result.launch = launch
        return result

    def _close(self, outcome: StudyOutcome, wall_s: float, status: str) -> None:
        stages = outcome.stages
        every = {**self.prior_stages, **stages}
        work = sum(v for k, v in every.items() if k.endswith(("models_s", "image_pull_s", "run_s")))
        wall = self.prior_wall_s + self.before_s + wall_s
        sequential = self.before_s + work
        metrics = {
            **stages,
            "study.wall_s": wall,
            "study.sequential_s": sequential,
            "study.overlap_saved_s": max(0.0, sequential - wall),
            "study.arms_failed": float(len(outcome.failed)),
        }
        try:
            self.tracker.log_metrics(self.run_id, metrics)
            if outcome.failed:
                self.tracker.set_tags(self.run_id, {FAILED_ARMS_TAG: ",".join(o.arm for o in outcome.failed)})
        finally:
            self.tracker.end_run(self.run_id, status)
