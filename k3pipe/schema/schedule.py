"""What a study of an experiment runs, and in which order, from its spec alone: the arms (with the
A/A copy of the baseline), their launches interleaved in rounds, the models each arm needs, and the
plan as lines a human reads (``k3pipe render``). Pure: it imports the specs and nothing that runs,
so that describing a study costs no more than loading its experiment."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from k3pipe.schema.specs import ArmSpec, ExperimentSpec, WorkloadSpec

__all__ = [
    "describe_study",
    "interleaved_order",
    "launch_order",
    "models_of",
    "prime_order",
    "study_arm_names",
]

_PLACEHOLDER = re.compile(r"\{models\.([A-Za-z0-9_-]+)\}")


def models_of(arm: ArmSpec) -> list[str]:
    """The models an arm needs: 'model' and every extra model its arguments name ('{models.NAME}')."""
    names: list[str] = []

    def walk(value: Any) -> None:
        if isinstance(value, str):
            names.extend(_PLACEHOLDER.findall(value))
        elif isinstance(value, Mapping):
            for v in value.values():
                walk(v)
        elif isinstance(value, list | tuple):
            for v in value:
                walk(v)

    walk(arm.engine.args)
    walk(arm.engine.env)
    return ["model", *dict.fromkeys(names)]


def study_arm_names(spec: ExperimentSpec, selected: Iterable[str] | None = None) -> list[str]:
    """The arms a study of ``spec`` runs, in order: ``selected`` (default every arm; with ``tune``, its
    candidates) and, with ``decision.calibration``, the baseline's A/A copy right after the baseline."""
    if selected:
        names = list(selected)
    elif spec.tune is not None:  # a search: its candidates
        names = [c.name for c in spec.tune_candidates()]
    else:
        names = [a.name for a in spec.arms]
    copy = spec.calibration_arm_name
    if spec.decision.calibration and spec.baseline_arm in names and copy not in names:
        names.insert(names.index(spec.baseline_arm) + 1, copy)
    return names


def launch_order(spec: ExperimentSpec, names: list[str]) -> list[tuple[str, int]]:
    """(arm, launch number) in the order a study launches them (interleaved rounds)."""
    return interleaved_order(names, [spec.arm(n).launches for n in names])


def prime_order(spec: ExperimentSpec, names: list[str]) -> list[str]:
    """The arms a study launches once before its measured launches (``decision.prime``), in order:
    every arm of ``names`` but the A/A copy, whose configuration is its baseline's."""
    if not spec.decision.prime:
        return []
    copy = spec.calibration_arm_name if spec.decision.calibration else None
    return [n for n in names if n != copy or spec.baseline_arm not in names]


def describe_study(spec: ExperimentSpec) -> list[str]:
    """What a study of ``spec`` runs, in order: the arms one after another, each on every workload,
    and which models each needs (those beyond the first are fetched while an earlier arm runs)."""
    names = study_arm_names(spec)
    order = launch_order(spec, names)
    lines = [
        f"study {spec.name}: {len(names)} arm(s) x {len(spec.workloads)} workload(s), arms one after "
        "another on the node, every arm sending the same prompts"
    ]
    labels = {c.name: c.label for c in spec.tune_candidates()}
    for i, name in enumerate(names, 1):
        arm = spec.arm(name)
        needs = models_of(arm)
        extra = f"; also needs {', '.join(needs[1:])}" if len(needs) > 1 else ""
        image = f", image {arm.engine.image}" if arm.launcher.pins_image else ""
        times = f", launched {arm.launches} times" if arm.launches > 1 else ""
        copy = spec.decision.calibration and name == spec.calibration_arm_name
        aa = " (A/A copy of the baseline)" if copy else ""
        label = labels.get(name)
        sets = f" ({label})" if label else ""
        where = f"{arm.engine.kind} on launcher {arm.launcher.kind}"
        lines.append(f"  {i}. {arm.name}{aa}{sets}: {where}{image}{times}{extra}")
    primed = prime_order(spec, names)
    if primed:
        lines.append(
            f"  first, each of {', '.join(primed)} launched once to fill the node's caches (each workload "
            "once; recorded, left out of the verdicts)"
        )
    if len(order) > len(names):
        lines.append("  launch order: " + " ".join(f"{a}#{k}" for a, k in order))
    tune = spec.tune
    if tune is not None:
        budget = tune.budget
        lines.append(
            f"  a search over arm {tune.arm}'s settings: {len(names)} candidates raced on "
            f"{tune.objective.metric} in {tune.objective.workload} (docs/tuning.md): {budget.first_launches} "
            f"launches each first, then one more per candidate still running at each look, the worse "
            f"dropped by the verdict rules (alpha {tune.alpha:g}, margin +-{tune.margin_pct:g}%), at most "
            f"{budget.max_launches} each ({len(names) * budget.max_launches} in all)"
            + (
                f", and no round past {budget.device_minutes:g} min of device time"
                if budget.device_minutes is not None
                else ""
            )
        )
    until = spec.decision.until
    if until is not None:
        budget_s = f" or budget_s {until.budget_s:g} s" if until.budget_s is not None else ""
        lines.append(
            f"  then one more launch of every arm per round while a decision comparison is open (neither "
            f"decided nor within +-{until.ci_pct:g}%), up to {until.max_launches} launches per arm{budget_s}"
        )
    for w in spec.workloads:
        warmup = (
            f"warm-up until steady, at most {w.warmup_requests}"
            if w.warmup == "steady"
            else f"{w.warmup_requests} warm-up"
        )
        bound = f" or {w.duration_s:g} s" if w.duration_s is not None else ""
        prompts = "trace" if w.trace else w.dataset.kind
        lines.append(
            f"  workload {w.name}: {w.input_tokens:,} in / {w.output_tokens:,} out tokens, {load_text(w)}, "
            f"{w.num_requests} requests{bound} (+{warmup}), {prompts} prompts, "
            f"{w.repeats} repeat(s)"
        )
    return lines


def load_text(w: WorkloadSpec) -> str:
    """The load a workload sends, in words: one point, a ladder's points or a capacity search's range
    (``k3pipe render`` and the study's plan)."""
    cap = f"at most {w.concurrency} in flight"
    if w.ladder is not None:
        lad = w.ladder
        points = ", ".join(f"{v:g}" for v in lad.values())
        end = f", ended past saturation (gain under {lad.min_gain_pct:g}%)" if lad.stop_when_saturated else ""
        if lad.over == "concurrency":
            return f"a concurrency ladder of {points} streams{end}"
        return f"a {w.load} rate ladder of {points} req/s ({cap}){end}"
    if w.capacity is not None:
        c = w.capacity
        slo = w.slo
        goals = []
        if slo is not None:
            goals += [
                f"{k} <= {v:g} ms"
                for k, v in (("TTFT", slo.ttft_ms), ("TPOT", slo.tpot_ms), ("E2E", slo.e2e_ms))
                if v is not None
            ]
        meets = f"{', '.join(goals)} for {c.attainment_pct:g}% of requests"
        if c.over == "concurrency":
            return f"the most streams in {c.low:g}-{c.high:g} meeting {meets} (at most {c.max_probes} probes)"
        return (
            f"the highest {w.load} rate in {c.low:g}-{c.high:g} req/s meeting {meets} "
            f"(at most {c.max_probes} probes, {cap})"
        )
    if w.load == "concurrency":
        return f"{w.concurrency} streams"
    return f"{w.load} at {w.rate_rps:g} req/s ({cap})"


def interleaved_order(arms: Sequence[str], launches: Sequence[int]) -> list[tuple[str, int]]:
    """The launch order of arms launched ``launches[i]`` times each: rounds, every other round
    reversed (A B, B A, A B ...), so that a drift over time favours no arm. Returns (arm, launch
    number from 1) pairs; an arm with fewer launches drops out of later rounds."""
    if len(arms) != len(launches):
        raise ValueError("one launch count per arm")
    order: list[tuple[str, int]] = []
    for r in range(max(launches, default=0)):
        round_ = [(a, r + 1) for a, n in zip(arms, launches, strict=True) if n > r]
        order.extend(round_ if r % 2 == 0 else reversed(round_))
    return order
