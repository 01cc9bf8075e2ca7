"""Load profiles: how one workload is measured on a running engine, each a small state machine.

:meth:`k3pipe.jobs.arm_run.ArmRun.run_workloads` has one measuring loop for every profile: it asks the
profile for its next :class:`Point`, empties the engine's prefix cache first where the point asks,
sends the point through the arm's ``benchmark`` step, hands the measurement back
(:meth:`Profile.completed`, which records it), and asks again, until the profile has no next point.
An interrupt the measurement caught is delivered once it is recorded, and an engine lost during it
ends the arm there; so a profile decides what to measure next and what to record, never how a
measurement is made or what happens when one fails.

- :class:`Repeats`: the workload ``repeats`` times (the default).
- :class:`Ladder`: the workload at each point of its ladder, lowest first, each point a workload run
  of its own with the workload's repeats, ended past saturation when the ladder says so.
- :class:`CapacitySearch`: the workload's capacity under its SLO searched once per repeat, each probe
  one load point (:class:`k3pipe.verdicts.capacity.CapacitySearch` chooses them).

A new way to load an engine (a trace replay, a tuning round) is one more class here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from k3pipe.bench.session import WorkloadOutcome
from k3pipe.bench.summary import slo_attainment_from_arrival
from k3pipe.prompts.corpora import PromptSet
from k3pipe.records.recorder import ArmRecorder
from k3pipe.schema.specs import WorkloadSpec
from k3pipe.verdicts import capacity

__all__ = ["CapacitySearch", "Ladder", "Point", "Profile", "ProfileContext", "Repeats", "profile_for"]


@dataclass(frozen=True)
class Point:
    """One measurement a profile asks for."""

    workload: WorkloadSpec
    """What is sent: the workload itself, a ladder's rung (NAME@c8) or a search's probe."""
    repeat: int
    prompts: PromptSet
    reset_cache: bool = False
    """Empty the engine's prefix cache before it (where the engine offers a way)."""
    load: float | None = None
    """A search's load point (requests per second or streams)."""
    label: str = ""
    """The name an engine lost during it is reported under (default: the workload sent)."""


@dataclass
class ProfileContext:
    """What a profile records with and reports to."""

    recorder: ArmRecorder
    say: Callable[[str], None]
    finished: Callable[[str], None]
    """Called with a workload run's name once its figures are final (the arm's outcome lists them)."""


class Profile(ABC):
    """A workload's measuring plan, asked one point at a time."""

    def __init__(self, workload: WorkloadSpec, prompts: Sequence[PromptSet], ctx: ProfileContext) -> None:
        self.workload = workload
        self.prompts = prompts
        self.ctx = ctx

    @abstractmethod
    def next_point(self) -> Point | None:
        """The next measurement, or None when the profile is done (it then records its own summary)."""

    @abstractmethod
    def completed(self, point: Point, measured: WorkloadOutcome, reset: bool) -> None:
        """Record ``measured``, the measurement of ``point`` (``reset``: whether the prefix cache was
        emptied before it)."""


class Repeats(Profile):
    """The workload, ``repeats`` times, each repeat with its own prompts."""

    def __init__(self, workload: WorkloadSpec, prompts: Sequence[PromptSet], ctx: ProfileContext) -> None:
        super().__init__(workload, prompts, ctx)
        self._next = 0
        self._done = False

    def next_point(self) -> Point | None:
        if self._next < self.workload.repeats:
            self._next += 1
            return Point(self.workload, self._next - 1, self.prompts[self._next - 1])
        if not self._done:
            self._done = True
            self.ctx.finished(self.workload.name)
        return None

    def completed(self, point: Point, measured: WorkloadOutcome, reset: bool) -> None:
        self.ctx.recorder.log_workload(point.workload, measured)


class Ladder(Profile):
    """The workload at each point of its ladder, lowest first, on the running engine: each point a
    workload run of its own (NAME@c8) with the workload's repeats and prompts, the prefix cache
    emptied before it where the engine offers a way; ended past saturation when the ladder says so
    (:class:`k3pipe.verdicts.capacity.LadderStop`): at the first point whose repeats show it, or,
    measured once a point, at the second point in a row that looks it (one noisy measurement ends
    nothing)."""

    def __init__(self, workload: WorkloadSpec, prompts: Sequence[PromptSet], ctx: ProfileContext) -> None:
        super().__init__(workload, prompts, ctx)
        assert workload.ladder is not None
        self.ladder = workload.ladder
        self.points = self.ladder.values()
        self.stop = capacity.LadderStop(self.ladder.min_gain_pct)
        self.ran: list[str] = []
        self.why = ""
        self._index = -1  # the point being measured
        self._repeat = 0  # its next repeat
        self._reset = False
        self._done = False

    def next_point(self) -> Point | None:
        if self._done:
            return None
        if self._index >= 0 and self._repeat == self.workload.repeats:
            self._close_point()
        if self._index == -1 or self._repeat == self.workload.repeats:
            if self._done or self._index + 1 == len(self.points):
                self._summarize()
                return None
            self._index += 1
            self._repeat = 0
        rung = self.workload.rung(self.points[self._index])
        point = Point(rung, self._repeat, self.prompts[self._repeat], reset_cache=self._repeat == 0)
        self._repeat += 1
        return point

    def completed(self, point: Point, measured: WorkloadOutcome, reset: bool) -> None:
        if point.repeat == 0:
            self._reset = reset
        self.ctx.recorder.log_workload(point.workload, measured)

    def _close_point(self) -> None:
        value = self.points[self._index]
        rung = self.workload.rung(value)
        self.ctx.recorder.tag_rung(rung.name, self.workload.name, self.ladder.over, value, self._reset)
        self.ctx.finished(rung.name)
        label = self.ladder.label(value)
        self.ran.append(label)
        ended = self.stop.add(label, self.ctx.recorder.repeat_metrics(rung.name))
        self._repeat = self.workload.repeats
        if ended and self.ladder.stop_when_saturated:
            self.why = f"; ended at {label}, {ended}"
            self._summarize()

    def _summarize(self) -> None:
        if self._done:
            return
        self._done = True
        left = len(self.points) - len(self.ran)
        if self.stop.suspect and not self.why and self.ladder.stop_when_saturated:
            self.why = (
                f"; {self.stop.suspect}, not confirmed (one measurement a point, and no point after it)"
            )
        summary = f"points {', '.join(self.ran)}{self.why}" + (
            f" ({left} higher point(s) not run)" if left else ""
        )
        self.ctx.recorder.log_ladder(self.workload.name, summary)
        self.ctx.say(f"ladder {self.workload.name}: {summary}")


class CapacitySearch(Profile):
    """The workload's capacity search, once per repeat, on the running engine
    (:mod:`k3pipe.verdicts.capacity`): each probe the workload at one load point, its prompts the
    repeat's, the prefix cache emptied before it where the engine offers a way (recorded either
    way)."""

    def __init__(self, workload: WorkloadSpec, prompts: Sequence[PromptSet], ctx: ProfileContext) -> None:
        super().__init__(workload, prompts, ctx)
        assert workload.capacity is not None
        assert workload.slo is not None
        self.spec = workload.capacity
        self.slo = workload.slo
        self.unit = "req/s" if self.spec.over == "rate" else "streams"
        self.results: list[capacity.CapacityResult] = []
        self._repeat = 0
        self._search: capacity.CapacitySearch | None = None
        self._search_run = ""
        self._pending: tuple[float, tuple[float, dict[str, float]], str, int | None] | None = None
        self._done = False

    def next_point(self) -> Point | None:
        while not self._done:
            if self._search is None:
                if self._repeat == self.workload.repeats:
                    self._done = True
                    # across this launch's searches, by the verdicts' rule (the report adds the others)
                    summary = capacity.summarize_searches(self.results).describe(self.unit)
                    self.ctx.say(f"capacity {self.workload.name}: {summary}")
                    self.ctx.finished(self.workload.name)
                    return None
                self._search_run = self.ctx.recorder.start_search(
                    self.workload, self._repeat, self.workload.seed + self._repeat
                )
                s = self.spec
                self._search = capacity.CapacitySearch(
                    s.over, s.low, s.high, start=s.start, factor=s.factor, tolerance_pct=s.tolerance_pct,
                    attainment_pct=s.attainment_pct, max_probes=s.max_probes,
                )  # fmt: skip
            self._add_pending(self._search)
            load = self._search.next_point()
            if load is not None:
                return Point(
                    self.workload.probe(load), self._repeat, self.prompts[self._repeat],
                    reset_cache=self.spec.reset_prefix_cache, load=load, label=self.workload.name,
                )  # fmt: skip
            result = self._search.result()
            self.ctx.recorder.log_capacity(self._search_run, self.workload, result)
            self.ctx.say(f"capacity {self.workload.name}#{self._repeat + 1}: {result.describe(self.unit)}")
            self.results.append(result)
            self._search = None
            self._repeat += 1
        return None

    def completed(self, point: Point, measured: WorkloadOutcome, reset: bool) -> None:
        assert self._search is not None
        assert point.load is not None
        attained = slo_attainment_from_arrival(measured.result.records, self.slo)
        # the attainment's denominator: its binomial interval says whether the probe decides
        counted = sum(not r.warmup for r in measured.result.records) or None
        judged = self._search.judge(point.load, attained[0], attained[1], counted)
        run_id = self.ctx.recorder.log_probe(
            self._search_run, point.workload, point.load, self.spec.over, measured, attained, reset, judged
        )
        # added to the search when the next point is asked for: not after an engine lost during it
        self._pending = (point.load, attained, run_id, counted)

    def _add_pending(self, search: capacity.CapacitySearch) -> None:
        if self._pending is None:
            return
        load, attained, run_id, counted = self._pending
        self._pending = None
        made = search.add(load, attained[0], attained[1], run_id, counted)
        interval = (
            f" [{made.ci_low_pct:.1f}, {made.ci_high_pct:.1f}]"
            if made.ci_low_pct is not None and made.ci_high_pct is not None
            else ""
        )
        verdict = ("pass" if made.passed else "fail") + (", undecided" if made.undecided else "")
        self.ctx.say(
            f"capacity {self.workload.name}#{self._repeat + 1}: {load:.4g} {self.unit} -> "
            f"{attained[0]:.1f}%{interval} within the SLO ({verdict})"
        )


def profile_for(workload: WorkloadSpec, prompts: Sequence[PromptSet], ctx: ProfileContext) -> Profile:
    """The profile a workload asks for: a ladder, a capacity search, else its repeats."""
    if workload.ladder is not None:
        return Ladder(workload, prompts, ctx)
    if workload.capacity is not None:
        return CapacitySearch(workload, prompts, ctx)
    return Repeats(workload, prompts, ctx)
