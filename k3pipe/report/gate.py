"""The report's answers: each arm's output probe against the reference arm's, judged against the floor,
and the gate it puts on the verdict (issue 47; docs/measurement.md, "Answers").

What is compared (all from the launches' answers.json, :mod:`k3pipe.bench.probe`):

- **the reference**: ``decision.baseline``, else the first arm; its first launch whose probe answered;
- **the floor**: the reference against itself started again: its next launch, else the A/A copy
  (``decision.calibration``); without either there is no floor and no arm is judged ("cannot tell:
  no floor");
- **each other arm**: its first launch whose probe answered, against the reference's, judged with
  :func:`k3pipe.verdicts.answers.judge` at the decision's alpha shared by the arms judged (Bonferroni), with
  the experiment's ``answers.margin_nats``;
- **lossless settings** (speculative decoding: greedy tokens must be the plain arm's): each prompt
  where the arm's tokens differ from its plain twin's while the floor pair agreed is a finding.

The gate: an arm whose answers diverge beyond the floor is "faster, answers differ" wherever it leads
a decision figure, and is not the recommendation unless ``decision.accept_divergence`` says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from k3pipe.bench.accuracy import AccuracyRecord, read_accuracy
from k3pipe.bench.probe import ProbeRecord, read_record
from k3pipe.bench.structured import StructuredRecord, read_structured
from k3pipe.report.collect import ArmData, StudyData
from k3pipe.schema.specs import AnswersSpec
from k3pipe.verdicts.answers import (
    AccuracyVerdict,
    Agreement,
    AnswersVerdict,
    Difference,
    accuracy_interval,
    agreement,
    judge,
    judge_accuracy,
    lossless_differences,
)

__all__ = ["AnswersAnalysis", "ArmAnswers", "analyse_answers", "first_answers", "floor_of"]


@dataclass
class ArmAnswers:
    """One arm's answers against the reference's."""

    arm: str
    launch: int | None
    """The arm's launch compared (None: no launch of it answered the probe)."""
    agreement: Agreement | None = None
    verdict: AnswersVerdict | None = None
    why_not: str | None = None
    """Why there is no verdict (no answers, no floor, the prompts differ)."""
    lossless: str | None = None
    """The setting that must not change the tokens (speculation), if the arm has one."""
    twin: str | None = None
    """The plain arm the lossless setting is checked against."""
    differences: list[Difference] | None = None
    """Lossless settings: the prompts whose tokens changed while the floor's agreed (empty: none)."""

    @property
    def diverges(self) -> bool:
        return self.verdict is not None and self.verdict.diverges


@dataclass
class ArmScore:
    """An arm's task score (its first launch that asked the accuracy set) and its verdict against the
    reference's."""

    arm: str
    record: AccuracyRecord
    verdict: AccuracyVerdict | None = None
    why_not: str | None = None

    @property
    def right(self) -> int:
        return sum(self.record.right.values())

    @property
    def questions(self) -> int:
        return len(self.record.right)

    def interval(self) -> tuple[float, float]:
        return accuracy_interval(self.right, self.questions)


@dataclass
class AnswersAnalysis:
    reference: str
    reference_launch: int | None
    floor_label: str | None
    """Which pair the floor is ('batch4 launch 2 against launch 1'); None: no floor."""
    floor: Agreement | None
    arms: list[ArmAnswers]
    margin: float
    alpha: float
    """Each arm's test level (the decision's alpha over the arms judged)."""
    accept_divergence: bool
    probe_seconds: float
    """Every launch's probe, summed."""
    errors: list[str] = field(default_factory=list)
    """Launches whose probe stopped short, each with why."""
    structured: dict[str, StructuredRecord] = field(default_factory=dict)
    """Arm -> its launches' tool-calling checks added together (arms with a parser)."""
    scores: list[ArmScore] = field(default_factory=list)
    """Each arm's task score (answers.accuracy), the reference's first."""
    accuracy_margin: float = 2.0

    def arm(self, name: str) -> ArmAnswers | None:
        return next((a for a in self.arms if a.arm == name), None)

    @property
    def diverging(self) -> list[str]:
        """Arms whose answers diverge beyond the floor."""
        return [a.arm for a in self.arms if a.diverges]

    @property
    def worse(self) -> list[str]:
        """Arms whose task score is detected worse than the reference's."""
        return [s.arm for s in self.scores if s.verdict is not None and s.verdict.outcome == "worse"]

    @property
    def gated(self) -> list[str]:
        """Arms that may not be the recommendation: diverging or scoring worse, and ``accept_divergence``
        off."""
        return [] if self.accept_divergence else list(dict.fromkeys([*self.diverging, *self.worse]))


def _answered(arm: ArmData) -> ProbeRecord | None:
    if not arm.answers:
        return None
    record = read_record(arm.answers)
    return record if len(record.answers) >= 2 else None


def first_answers(data: StudyData, name: str, skip: int | None = None) -> tuple[int, ProbeRecord] | None:
    """The first launch of arm ``name`` (other than launch ``skip``) whose probe answered two prompts or
    more: its launch number and its answers; None: no such launch."""
    for launch in sorted(data.launches_of(name), key=lambda a: a.launch):
        if launch.launch == skip:
            continue
        record = _answered(launch)
        if record is not None:
            return launch.launch, record
    return None


def floor_of(
    data: StudyData, arm: str, first: tuple[int, ProbeRecord] | None
) -> tuple[str | None, Agreement | None]:
    """The floor of ``arm`` (whose first answered launch is ``first``): its next answered launch against
    that one, else its A/A copy's (the study's calibration); (None, None): neither."""
    if first is None:
        return None, None
    again = first_answers(data, arm, skip=first[0])
    if again is not None:
        label = f"{arm} launch {again[0]} against its launch {first[0]}"
        return label, agreement(again[1].answers, first[1].answers)
    copy = data.calibration[1] if data.calibration and data.calibration[0] == arm else None
    if copy is not None and (aa := first_answers(data, copy)) is not None:
        label = f"{copy} (the A/A copy) launch {aa[0]} against {arm} launch {first[0]}"
        return label, agreement(aa[1].answers, first[1].answers)
    return None, None


def analyse_answers(data: StudyData) -> AnswersAnalysis | None:
    """The study's answers (see the module); None when no launch recorded a probe."""
    launches = [a for a in data.arms if a.answers]
    if not launches and not any(a.structured or a.accuracy for a in data.arms):
        return None
    decision = data.decision
    margin = float((data.answers or {}).get("margin_nats", AnswersSpec().margin_nats))
    reference = str(decision.get("baseline") or (data.arm_names[0] if data.arm_names else ""))
    errors = [
        f"{data.label(a)}: {a.answers.get('error')}" for a in launches if a.answers and a.answers.get("error")
    ]
    seconds = sum(float(a.answers.get("seconds") or 0.0) for a in launches if a.answers)
    ref = first_answers(data, reference)
    floor_label, floor = floor_of(data, reference, ref)
    others = [n for n in data.arm_names if n != reference]
    judged = max(1, len(others))
    alpha = float(decision.get("alpha") or 0.05) / judged
    arms: list[ArmAnswers] = []
    lossless = {a.name: (a.lossless, a.twin) for a in data.arms if a.lossless}
    for name in others:
        mine = first_answers(data, name)
        setting, twin = lossless.get(name, (None, None))
        row = ArmAnswers(name, mine[0] if mine else None, lossless=setting, twin=twin)
        arms.append(row)
        if mine is None:
            row.why_not = "no launch of it answered the probe"
            continue
        if ref is None:
            row.why_not = f"no launch of the reference {reference} answered the probe"
            continue
        if mine[1].digest != ref[1].digest:
            row.why_not = (
                f"its probe prompts (digest {mine[1].digest}) are not the reference's ({ref[1].digest})"
            )
            continue
        row.agreement = agreement(mine[1].answers, ref[1].answers)
        if floor is None:
            row.why_not = (
                f"no floor: {reference} answered the probe on one launch only and has no A/A copy (launch it "
                "twice, or set decision.calibration)"
            )
        else:
            try:
                row.verdict = judge(row.agreement, floor, margin=margin, alpha=alpha)
            except ValueError as exc:
                row.why_not = str(exc)
        if setting and floor is not None:
            against = first_answers(data, twin) if twin and twin != reference else ref
            if against is not None:
                row.differences = lossless_differences(agreement(mine[1].answers, against[1].answers), floor)
    structured: dict[str, StructuredRecord] = {}
    for launch in data.arms:
        if launch.structured:
            one = read_structured(launch.structured)
            total = structured.setdefault(
                launch.name, StructuredRecord(one.tool_parser, one.reasoning_parser)
            )
            total.calls += one.calls
            total.seconds += one.seconds
            if one.error:
                total.error = one.error
                errors.append(f"{data.label(launch)} (tool-calling requests): {one.error}")
    accuracy_spec = (data.answers or {}).get("accuracy") or {}
    accuracy_margin = float(accuracy_spec.get("margin_points", 2.0))
    scores = _scores(data, reference, accuracy_margin, float(decision.get("alpha") or 0.05), errors)
    return AnswersAnalysis(
        scores=scores,
        accuracy_margin=accuracy_margin,
        structured=structured,
        reference=reference,
        reference_launch=ref[0] if ref else None,
        floor_label=floor_label,
        floor=floor,
        arms=arms,
        margin=margin,
        alpha=alpha,
        accept_divergence=bool(decision.get("accept_divergence")),
        probe_seconds=seconds + sum(s.seconds for s in structured.values()),
        errors=errors,
    )


def _scores(
    data: StudyData, reference: str, margin: float, alpha: float, errors: list[str]
) -> list[ArmScore]:
    """Each arm's task score (its first launch that asked the set), judged against the reference's on
    the same questions at ``alpha`` over the arms judged; the reference's first."""
    first: dict[str, ArmScore] = {}
    for launch in sorted(data.arms, key=lambda a: a.launch):
        if launch.accuracy and launch.name not in first:
            record = read_accuracy(launch.accuracy)
            if record.error:
                errors.append(f"{data.label(launch)} (the accuracy set): {record.error}")
            if record.right:
                first[launch.name] = ArmScore(launch.name, record)
    ref = first.get(reference)
    others = [s for name, s in first.items() if name != reference]
    for score in others:
        if ref is None:
            score.why_not = f"the reference {reference} has no score"
        elif score.record.digest != ref.record.digest:
            score.why_not = "another question set than the reference's (digest)"
        else:
            shared = [q for q in ref.record.right if q in score.record.right]
            if not shared:
                score.why_not = "no question answered by both"
                continue
            score.verdict = judge_accuracy(
                [score.record.right[q] for q in shared],
                [ref.record.right[q] for q in shared],
                margin_points=margin,
                alpha=alpha / max(1, len(others)),
            )
    return ([ref] if ref else []) + others
