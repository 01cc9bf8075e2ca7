"""What a study's design will cost and what it can see, said before it runs.

A study's verdicts are only as good as its design: how many launches each arm gets (restart noise is
in a verdict only from two launches, or from a prior, k3pipe.records.priors), how many repeats, how many
comparisons share alpha. :func:`design_lines` says it in a few lines, from the experiment and what the
node's history holds (:class:`History`: the cold starts and launch times recorded on this node for the
arms' engines and models, and the restart and repeat noise earlier studies kept):

- the launches (cold starts, priming included) and the comparisons sharing alpha;
- the cost: cold starts and launch times as recorded here (median), or "unknown until the first";
- what it can see: per decision figure, the smallest difference a pair of arms would be found with
  the design's power at the noise recorded here for those engines and models (restart and repeat,
  pooled over workloads: a planning figure, not a verdict), and how many launches 10% would take;
- which arms are launched once, and whether a prior will judge them.

``k3pipe render`` prints them; a study says them at its start.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from k3pipe.core.figures import DEFAULT_DECISION, figure
from k3pipe.core.layout import NOISE_TAG, RunTags
from k3pipe.engines import get_engine
from k3pipe.records.priors import MIN_PRIOR_DF, NoiseEntry, entries_of, model_identity
from k3pipe.schema.schedule import launch_order, prime_order, study_arm_names
from k3pipe.schema.specs import ExperimentSpec, LocalModel
from k3pipe.sources import model_dir

if TYPE_CHECKING:
    from k3pipe.records.tracking import Tracker
    from k3pipe.verdicts.stats import Design

__all__ = ["History", "design_lines", "load_history"]

PLAN_EFFECT = 0.10


@dataclass
class History:
    """What the node's records hold for a study's arms (:func:`load_history`)."""

    node: str
    model: str
    """The experiment's model as the records name it."""
    cold_starts: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    """(engine, model id) -> cold starts recorded on this node (s)."""
    launch_s: list[float] = field(default_factory=list)
    """Wall times of earlier launches of this very experiment on this node (s)."""
    noise: list[NoiseEntry] = field(default_factory=list)
    """Noise kept by earlier studies on this node (k3pipe.records.priors), within the prior's age."""


def load_history(tracker: Tracker, spec: ExperimentSpec, node: str, home: Path) -> History:
    """The node's records for ``spec``'s arms: cold starts of their engines and models, earlier
    launches of this experiment, and kept noise (no older than ``decision.prior_days``)."""
    history = History(node, _model_id(spec, home))
    host = node.removeprefix("host ") if node.startswith("host ") else None
    runs = tracker.client.search_runs(
        [tracker.require_experiment_id()],
        filter_string="tags.`k3pipe.arm` != '' and attributes.status = 'FINISHED'",
        order_by=["attributes.start_time DESC"],
        max_results=500,
    )
    for run in runs:
        params, metrics = run.data.params, run.data.metrics
        here = params.get("node.host") == host if host else _gpus(params) == node
        if not here or RunTags.of(run).prime:
            continue
        engine, model = (RunTags.of(run).engine or ""), model_identity(params) or ""
        cold = metrics.get("cold_start_s")
        if cold is not None:
            history.cold_starts.setdefault((engine, model), []).append(float(cold))
        if params.get("experiment") == spec.name and run.info.end_time:
            history.launch_s.append((run.info.end_time - run.info.start_time) / 1000)
    days = spec.decision.prior_days
    if days > 0:
        since = int((time.time() - days * 86_400) * 1000)
        studies = tracker.client.search_runs(
            [tracker.require_experiment_id()],
            filter_string=f"tags.`{NOISE_TAG}` != '' and attributes.start_time >= {since}",
            max_results=200,
        )
        history.noise = [e for run in studies for e in entries_of(tracker, run) if e.node == node]
    return history


def _gpus(params: dict[str, str]) -> str | None:
    from k3pipe.machine.node import hardware_label

    return hardware_label(params)


def _model_id(spec: ExperimentSpec, home: Path) -> str:
    """The experiment's model as the records name it (:func:`k3pipe.records.priors.model_identity`)."""
    if isinstance(spec.model, LocalModel):
        return f"local {model_dir(spec.model, home)}"
    return spec.model.id


def _noise(entries: Sequence[NoiseEntry], metric: str) -> tuple[float, float, float, int] | None:
    """(restart variance, repeat variance, launch-mean variance, its df) pooled over ``entries`` of
    ``metric`` (log scale); None without a launch spread to go on."""
    mine = [e for e in entries if e.metric == metric and e.df > 0]
    df = sum(e.df for e in mine)
    if df <= 0:
        return None
    launch_var = math.fsum(e.ss for e in mine) / df
    dfw = sum(e.df_within for e in mine)
    within = math.fsum(e.ss_within for e in mine) / dfw if dfw > 0 else 0.0
    per_launch = statistics.mean(r for e in mine for r in e.repeats) if mine else 1.0
    between = max(0.0, launch_var - within / max(1.0, per_launch))
    return between, within, launch_var, df


def design_lines(
    spec: ExperimentSpec, history: History | None = None, arms: Sequence[str] | None = None
) -> list[str]:
    """The study's design in words: launches and cold starts, comparisons, cost and what it can see
    (see the module's docstring); ``history`` None: the design alone."""
    names = study_arm_names(spec, arms)
    order = launch_order(spec, names)
    primed = prime_order(spec, names)
    workloads = spec.workloads
    repeats = sorted({w.repeats for w in workloads})
    launches = {n: spec.arm(n).launches for n in names}
    per = sorted(set(launches.values()))
    decision = list(spec.decision.metrics or DEFAULT_DECISION)
    pairs = len(names) * (len(names) - 1) // 2 - (1 if spec.decision.calibration else 0)
    tests = max(1, pairs * len(decision) * len(workloads))
    lines = [
        f"design: {len(names)} arm(s), {'/'.join(map(str, per))} launch(es) each (interleaved): "
        f"{len(order)} cold start(s)"
        + (f" and {len(primed)} priming launch(es)" if primed else "")
        + f"; each launch runs {len(workloads)} workload(s) x {'/'.join(map(str, repeats))} repeat(s)",
        f"verdicts: {len(decision)} decision figure(s) x {max(pairs, 0)} pair(s) x {len(workloads)} "
        f"workload(s) = {tests if pairs > 0 else 0} comparison(s) sharing alpha {spec.decision.alpha:g}"
        + (" (and the A/A's own)" if spec.decision.calibration else ""),
    ]
    if spec.answers is not None:
        lines.append(_answers_line(spec, names, launches))
    once = [n for n in names if launches[n] < 2]
    if history is None:
        if once and pairs > 0:
            lines.append(
                f"launched once: {', '.join(once)}: judged only with restart noise an earlier study measured "
                "on the node (k3pipe.records.priors), else 'cannot tell: restart noise unknown'"
            )
        return lines
    lines.append(_cost(spec, names, history, len(order) + len(primed)))
    if pairs > 0:
        from k3pipe.verdicts import stats  # scipy: not for `k3pipe render`, which shows the design alone

        design = stats.Design(
            alpha=spec.decision.alpha,
            margin=spec.decision.margin_pct / 100,
            power=spec.decision.power,
            tests=tests,
        )
        lines.extend(_can_see(spec, names, history, decision, design, launches, min(repeats)))
    return lines


def _answers_line(spec: ExperimentSpec, names: Sequence[str], launches: dict[str, int]) -> str:
    """What the output probe will do, and whether the study gives it a floor."""
    answers = spec.answers
    assert answers is not None
    reference = spec.baseline_arm
    if launches.get(reference, 1) >= 2:
        floor = f"the floor: {reference} launched again"
    elif spec.decision.calibration:
        floor = f"the floor: {spec.calibration_arm_name}"
    else:
        floor = f"no floor ({reference} launched once, no A/A copy): no arm's answers will be judged"
    scored = f", {answers.continuation_tokens} scored" if answers.score else ""
    parts = [
        f"answers: after each launch's timed repeats, {answers.prompts} probe prompt(s) greedy to "
        f"{answers.output_tokens} tokens{scored}; against {reference}, {floor}"
    ]
    parsed = [
        n for n in names
        if any(get_engine(spec.arm(n).engine.kind).arg(spec.arm(n).engine.args, a) is not None
               for a in ("tool_call_parser", "reasoning_parser"))
    ]  # fmt: skip
    if parsed and answers.tool_requests:
        parts.append(f"{answers.tool_requests} tool-calling request(s) a launch for {', '.join(parsed)}")
    if answers.accuracy is not None:
        parts.append(f"the questions of {answers.accuracy.path} on each arm's first launch")
    return "; ".join(parts)


def _cost(spec: ExperimentSpec, names: Sequence[str], history: History, count: int) -> str:
    model = history.model
    colds = []
    for engine in dict.fromkeys(spec.arm(n).engine.kind for n in names):
        seen = history.cold_starts.get((engine, model))
        if seen:
            colds.append(f"{engine} {statistics.median(seen):.0f} s (median of {len(seen)})")
    cold = (
        f"cold start on {history.node}: " + ", ".join(colds)
        if colds
        else f"no cold start of {model} recorded on {history.node}: the cost is known after the first launch"
    )
    if history.launch_s:
        each = statistics.median(history.launch_s)
        return (
            f"cost: {cold}; a launch of {spec.name} took {each:.0f} s here (median of "
            f"{len(history.launch_s)}): about {count * each / 60:.0f} minute(s) for {count} launch(es)"
        )
    return f"cost: {cold}"


def _can_see(
    spec: ExperimentSpec,
    names: Sequence[str],
    history: History,
    decision: Sequence[str],
    design: Design,
    launches: dict[str, int],
    repeats: int,
) -> list[str]:
    from k3pipe.verdicts import stats

    model = history.model
    engines = {spec.arm(n).engine.kind for n in names}
    entries = [e for e in history.noise if e.engine in engines and e.model == model]
    if not entries:
        return [
            f"can see: unknown: no earlier study on {history.node} kept the noise of "
            f"{', '.join(sorted(engines))} serving {model}; this study measures it (the report's noise)"
        ]
    shown = []
    least = min(launches.values())
    for key in decision:
        noise = _noise(entries, key)
        if noise is None:
            continue
        between, within, launch_var, df = noise
        label = figure(key).label
        if least >= 2:
            se = math.sqrt(2 * (between + within / max(1, repeats)) / least)
            found = stats.mde(se, 2 * (least - 1), design.per_test_alpha, design.power)
        elif df >= MIN_PRIOR_DF:
            se = math.sqrt(2 * within / max(1, repeats) + 2 * launch_var)
            found = stats.mde(se, df, design.per_test_alpha, design.power)
        else:
            shown.append(f"{label}: nothing (launched once, and the history's restart noise has {df} df)")
            continue
        restart, repeat = math.sqrt(math.expm1(between)), math.sqrt(math.expm1(within))
        needed = stats.launches_needed(
            PLAN_EFFECT,
            math.sqrt(math.expm1(between)),
            math.sqrt(math.expm1(within)),
            max(1, repeats),
            design,
        )
        shown.append(
            f"{label}: {stats.detectable(stats.exp_or_inf(found, minus_one=True))} "
            f"(restart {restart:.1%}, repeat {repeat:.1%}; {PLAN_EFFECT:.0%} would take "
            f"{needed if needed is not None else 'more than 50'} launches per arm)"
        )
    studies = len({e.study_run_id for e in entries})
    return [
        f"can see (with {design.power:.0%} power, at the noise {studies} earlier "
        f"stud{'y' if studies == 1 else 'ies'} kept on {history.node} for {', '.join(sorted(engines))} "
        f"serving {model}): " + "; ".join(shown)
    ]
