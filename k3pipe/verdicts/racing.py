"""A race among candidate settings (issue 50): launches spent where they decide.

Every candidate is launched and measured (``first_launches`` launches, so its restart noise is in its
variance from the first look); after each round the candidates that the verdict rules find worse than
the round's leader are dropped, and the survivors get one launch more each, until

- one candidate is left: the **winner**, better than every other by a detected difference;
- the survivors are all **equivalent** within the margin: choose any;
- the budget (``max_launches`` per candidate) is spent, or the caller stops the race between rounds
  (:meth:`Race.stop`: its device time would run out): **undecided** among the survivors, the leader
  named with what the data could and could not see.

The rules are the study's (:mod:`k3pipe.verdicts.stats`): a candidate's estimate is the mean of its
launch means on the log scale, two candidates are compared on the log of their ratio with Student's
or Welch's t, and a difference is claimed only when the interval excludes no change. The error rate
of the whole race is held at ``alpha``: the looks share it by a spending function (Kim and DeMets'
power family, ``alpha * t**2`` at the share ``t`` of the looks made: a little early, so the clearly
worse leave on few launches, most at the end), and within a look every pair of the candidates still
running is covered at once by Tukey's studentized range (not only the pairs against the leader: the
leader is chosen by the data), with the launch means' variance pooled over those candidates (they
share the node's noise on the log scale: one-way ANOVA's within mean square). So a race among equal
candidates declares a winner, or drops the true best, with probability at most ``alpha`` (a union
bound; tested on simulated races whose truth is known, ``tests/unit/test_racing.py``).

A candidate that fails (it does not start, it crashes, its answers diverge) is a result: it leaves the
race with why, and the rest go on. Nothing here launches anything or knows a metric's name: the
caller measures each launch (``record``) and reads what to launch next (``wanted``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Literal

from scipy import stats

from k3pipe.verdicts.stats import (
    DEFAULT_ALPHA,
    Comparison,
    Design,
    Estimate,
    Verdict,
    compare,
    decide,
    detectable,
    estimate,
    spend_alpha,
)

__all__ = ["Drop", "Look", "Race", "RaceResult", "RaceRules"]


@lru_cache(maxsize=1024)
def _tukey(k: int, df: float, alpha: float) -> float:
    """The half-width of Tukey's simultaneous intervals in standard errors of a difference: the
    studentized range's ``1 - alpha`` quantile for ``k`` means over the square root of two."""
    return float(stats.studentized_range.ppf(1 - alpha, k, df)) / math.sqrt(2)


@lru_cache(maxsize=1024)
def _student(df: float, alpha: float) -> float:
    """The two-sided ``alpha`` quantile of Student's t (the one ``decide`` reads its interval with)."""
    return float(stats.t.ppf(1 - alpha / 2, df))


Outcome = Literal["winner", "equivalent", "undecided"]


@dataclass(frozen=True)
class RaceRules:
    """How a race is run and judged."""

    alpha: float = DEFAULT_ALPHA
    """The error rate of the whole race: a winner declared, or a candidate dropped, wrongly."""
    margin: float = 0.03
    """Candidates whose objectives are within this fraction of each other are 'equivalent'."""
    first_launches: int = 2
    """Launches of every candidate before the first look (two: restart noise measured)."""
    max_launches: int = 8
    """Launches of a candidate at most: the budget (measuring every candidate fully is this many each)."""
    higher_is_better: bool = True
    pool: bool = True
    """Compare with the launch-mean variance pooled over the candidates still running (they share the
    node's noise); False: each pair's own (:func:`~k3pipe.verdicts.stats.compare`)."""
    spending: Literal["power", "obrien-fleming"] = "power"
    """How the looks share ``alpha``: ``power``, Kim and DeMets' power family ``alpha * t**2`` at the
    share ``t`` of looks made (some early, so the clearly worse leave on few launches; most late);
    ``obrien-fleming``, almost nothing early (more power at the end, more launches spent)."""

    def __post_init__(self) -> None:
        if self.first_launches < 2:
            raise ValueError(
                f"first_launches={self.first_launches}: give at least 2, so that a candidate's restart "
                "noise is in its variance from the first look"
            )
        if self.max_launches < self.first_launches:
            raise ValueError(
                f"max_launches={self.max_launches} is below first_launches={self.first_launches}: give "
                "at least as many"
            )
        Design(alpha=self.alpha, margin=self.margin)  # checks both, with their own words

    @property
    def looks(self) -> int:
        """Times the race is judged at most: after the first launches, then after each round."""
        return self.max_launches - self.first_launches + 1


@dataclass(frozen=True)
class Drop:
    """Why a candidate left the race."""

    name: str
    round: int
    reason: str
    """The verdict against the leader of that round, what failed, or why it is not eligible."""
    failed: bool = False
    ineligible: bool = False
    """Measured, but not eligible to win (its answers diverge beyond the floor)."""

    @property
    def beaten(self) -> bool:
        """Found worse by the verdict rules (not failed, not ineligible)."""
        return not (self.failed or self.ineligible)


@dataclass(frozen=True)
class Look:
    """One look of the race: where every candidate still running stood (the search's path)."""

    round: int
    means: dict[str, float]
    """Each candidate judged at this look: the geometric mean of its launch means on the objective."""
    launches: dict[str, int]
    """Each candidate's launches counted at this look."""
    dropped: tuple[str, ...]
    """The candidates found worse at this look."""
    leader: str


@dataclass(frozen=True)
class RaceResult:
    """Where a race ended."""

    outcome: Outcome
    leader: str
    """The best estimate among the survivors (the winner when there is one)."""
    survivors: tuple[str, ...]
    dropped: tuple[Drop, ...]
    rounds: int
    launches: int
    """Launches the race spent."""
    full_launches: int
    """What measuring every candidate fully (``max_launches`` each) would have spent."""
    estimates: dict[str, Estimate]
    """Every candidate that measured something: its estimate from all its launches."""
    verdicts: tuple[Verdict, ...]
    """The last look's verdicts: the leader against each other survivor (and the drops' verdicts are
    in ``dropped``)."""
    path: tuple[Look, ...] = ()
    """Every look, in order: the search's path (objective by candidate and round)."""
    stopped: str | None = None
    """Why the race was stopped before its launches were spent (:meth:`Race.stop`), if it was."""

    @property
    def winner(self) -> str | None:
        return self.leader if self.outcome == "winner" else None

    def text(self) -> str:
        """The answer in a sentence a person can act on."""
        spent = f"{self.launches} launches of {self.full_launches} for measuring every candidate fully"
        failed = [d for d in self.dropped if d.failed]
        failures = "; failed: " + "; ".join(f"{d.name} ({d.reason})" for d in failed) if failed else ""
        out = [d for d in self.dropped if d.ineligible]
        if out:
            failures += "; not eligible: " + "; ".join(f"{d.name} ({d.reason})" for d in out)
        beaten = [d for d in self.dropped if d.beaten]
        worse = f"; found worse: {', '.join(d.name for d in beaten)}" if beaten else ""
        if self.outcome == "winner":
            if not beaten:
                only = "eligible" if out else "measured"
                return f"{self.leader} is the only candidate {only}{failures} ({spent})"
            runner = beaten[-1]
            return (
                f"{self.leader} is the best: better than every other candidate; the runner-up, "
                f"{runner.name}, left in round {runner.round}: {runner.reason}{failures} ({spent})"
            )
        if self.outcome == "equivalent":
            return (
                f"{', '.join(self.survivors)}: equivalent within +-{self.verdicts_margin():.0%}: choose "
                f"any ({self.leader} leads){worse}{failures} ({spent})"
            )
        mdes = [v.mde for v in self.verdicts if v.mde is not None]
        below = detectable(max(mdes)) if mdes else "an unknown size"
        stopped = f"; stopped after round {self.rounds}: {self.stopped}" if self.stopped else ""
        return (
            f"undecided among {', '.join(self.survivors)}: {self.leader} leads, but differences below "
            f"{below} cannot be seen with the launches spent{stopped}{worse}{failures} ({spent})"
        )

    def verdicts_margin(self) -> float:
        return self.verdicts[0].margin if self.verdicts else 0.0


@dataclass
class _Entry:
    name: str
    launches: list[list[float]] = field(default_factory=list)
    drop: Drop | None = None


class Race:
    """A race among ``candidates`` under ``rules``: ask :meth:`wanted` what to launch, :meth:`record`
    each launch's values (one a repeat), :meth:`fail` a candidate that could not be measured, then
    :meth:`close_round`, until it returns the result."""

    def __init__(self, candidates: Sequence[str], rules: RaceRules | None = None) -> None:
        if len(candidates) < 2:
            raise ValueError(f"a race needs two candidates or more, got {len(candidates)}")
        if len(set(candidates)) != len(candidates):
            raise ValueError(f"candidates must have different names, got {list(candidates)}")
        self.rules = rules or RaceRules()
        self._entries = {name: _Entry(name) for name in candidates}
        looks = self.rules.looks
        if self.rules.spending == "obrien-fleming":
            self._alphas = spend_alpha(self.rules.alpha, looks)
        else:
            spent = [self.rules.alpha * ((k + 1) / looks) ** 2 for k in range(looks)]
            self._alphas = [spent[0], *(b - a for a, b in itertools.pairwise(spent))]
        self.round = 0  # looks made
        self.result: RaceResult | None = None
        self._path: list[Look] = []
        # the last look's leader, estimates and verdicts while no launch of the next round is in (stop)
        self._open: tuple[str, dict[str, Estimate], tuple[Verdict, ...]] | None = None

    @property
    def alive(self) -> list[str]:
        return [e.name for e in self._entries.values() if e.drop is None]

    def _target(self) -> int:
        return self.rules.first_launches + self.round

    def wanted(self) -> list[str]:
        """The candidates still to be launched this round (one launch each per call's answer: a
        candidate stays wanted until it has the round's launches)."""
        if self.result is not None:
            return []
        return [n for n in self.alive if len(self._entries[n].launches) < self._target()]

    def record(self, name: str, values: Sequence[float]) -> None:
        """One launch of ``name``: its repeats' values of the objective."""
        entry = self._entry(name)
        self._open = None
        if entry.drop is not None:
            raise ValueError(
                f"candidate {name!r} left the race in round {entry.drop.round}: {entry.drop.reason}"
            )
        kept = [float(v) for v in values if v is not None and math.isfinite(v) and v > 0]
        if not kept:
            self.fail(name, "its launch measured no value of the objective")
            return
        entry.launches.append(kept)

    def fail(self, name: str, why: str) -> None:
        """``name`` cannot be measured (did not start, crashed, answers diverged): it leaves the race."""
        entry = self._entry(name)
        self._open = None
        if entry.drop is None:
            entry.drop = Drop(name, self.round + 1, why, failed=True)

    def exclude(self, name: str, why: str) -> None:
        """``name`` was measured but may not win (its answers diverge beyond the floor): it leaves the
        race with why; what it measured stays in the record."""
        entry = self._entry(name)
        if entry.drop is None:
            entry.drop = Drop(name, self.round + 1, why, ineligible=True)

    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(f"no candidate {name!r} in this race: {', '.join(self._entries)}") from None

    def close_round(self) -> RaceResult | None:
        """Judge the race now that the round's launches are in; the result when it has ended."""
        if self.result is not None:
            return self.result
        if self.wanted():
            raise ValueError(f"the round is not complete: {', '.join(self.wanted())} still to be launched")
        alive = self.alive
        if not alive:
            raise ValueError("every candidate failed: there is no race to judge")
        self.round += 1
        estimates = {n: est for n in alive if (est := estimate(self._entries[n].launches)) is not None}
        sign = 1.0 if self.rules.higher_is_better else -1.0
        leader = max(alive, key=lambda n: sign * estimates[n].log_mean)
        if len(alive) == 1:
            self._look(alive, estimates, leader)
            return self._end("winner", leader, estimates, ())
        design = Design(alpha=self._alphas[self.round - 1], margin=self.rules.margin)
        pooled = self._pooled(alive)
        verdicts = {
            n: self._verdict(leader, n, estimates, design, pooled, len(alive)) for n in alive if n != leader
        }
        for name, verdict in verdicts.items():
            if verdict.outcome == "different" and verdict.leader == leader:
                self._entries[name].drop = Drop(name, self.round, verdict.text())
        self._look(alive, estimates, leader)
        survivors = self.alive
        if len(survivors) == 1:
            return self._end("winner", leader, estimates, tuple(verdicts.values()))
        last = tuple(verdicts[n] for n in survivors if n != leader)
        if all(v.outcome == "equivalent" for v in last):
            return self._end("equivalent", leader, estimates, last)
        if self.round >= self.rules.looks:
            return self._end("undecided", leader, estimates, last)
        self._open = (leader, estimates, last)
        return None

    def stop(self, why: str) -> RaceResult:
        """End the race between rounds (after :meth:`close_round` returned None), ``why`` given: undecided
        among the survivors, as the last look judged them (a budget other than launches ran out)."""
        if self.result is not None:
            return self.result
        if self._open is None:
            raise ValueError("a race is stopped between rounds: close a round first")
        leader, estimates, last = self._open
        self._end("undecided", leader, estimates, last)
        assert self.result is not None
        self.result = replace(self.result, stopped=why)
        return self.result

    def _look(self, judged: Sequence[str], estimates: dict[str, Estimate], leader: str) -> None:
        self._path.append(
            Look(
                round=self.round,
                means={n: estimates[n].mean for n in judged},
                launches={n: len(self._entries[n].launches) for n in judged},
                dropped=tuple(
                    n for n in judged if (d := self._entries[n].drop) is not None and d.round == self.round
                ),
                leader=leader,
            )
        )

    def _pooled(self, names: Sequence[str]) -> tuple[float, float] | None:
        """The launch means' variance pooled over ``names`` (log scale) and its degrees of freedom:
        the candidates share the node's noise, so each comparison's standard error uses them all
        (one-way ANOVA's within-candidate mean square). None when no candidate has two launches."""
        ss = df = 0.0
        for name in names:
            means = [
                math.fsum(math.log(v) for v in launch) / len(launch)
                for launch in self._entries[name].launches
            ]
            if len(means) >= 2:
                centre = math.fsum(means) / len(means)
                ss += math.fsum((m - centre) ** 2 for m in means)
                df += len(means) - 1
        return (ss / df, df) if df > 0 else None

    def _verdict(
        self,
        a: str,
        b: str,
        estimates: dict[str, Estimate],
        design: Design,
        pooled: tuple[float, float] | None,
        k: int,
    ) -> Verdict:
        """A against B at the look's level, the interval's half-width Tukey's for ``k`` candidates
        (Tukey-Kramer: exact for equal launch counts, conservative otherwise): every pair of the
        candidates still running is covered at once, so which one leads (chosen by the data) does not
        matter. ``decide`` reads a t quantile off ``design``; the standard error it is given is scaled so
        that its half-width is the studentized range's."""
        ea, eb = estimates[a], estimates[b]
        if self.rules.pool and pooled is not None and ea.basis == eb.basis == "launches":
            var, df = pooled
            se = math.sqrt(var * (1 / ea.launches + 1 / eb.launches))
            pooled_flag = True
        else:
            plain = compare(ea, eb)
            if plain.se is None or plain.restart == "unknown":
                return decide(plain, design, self.rules.higher_is_better, (a, b))
            se, df, pooled_flag = plain.se, plain.df, plain.pooled
        scale = _tukey(k, df, design.per_test_alpha) / _student(df, design.per_test_alpha) if k > 2 else 1.0
        comparison = Comparison(ea.log_mean - eb.log_mean, se * scale, df, pooled_flag)
        return decide(comparison, design, self.rules.higher_is_better, (a, b))

    def _end(
        self, outcome: Outcome, leader: str, estimates: dict[str, Estimate], verdicts: tuple[Verdict, ...]
    ) -> RaceResult:
        dropped = sorted(
            (e.drop for e in self._entries.values() if e.drop is not None), key=lambda d: (d.round, d.name)
        )
        measured = {  # every candidate that measured something, from all its launches
            e.name: est for e in self._entries.values() if e.launches and (est := estimate(e.launches))
        }
        self.result = RaceResult(
            outcome=outcome,
            leader=leader,
            survivors=tuple(self.alive),
            dropped=tuple(dropped),
            rounds=self.round,
            launches=sum(len(e.launches) for e in self._entries.values()),
            full_launches=len(self._entries) * self.rules.max_launches,
            estimates={**measured, **estimates},
            verdicts=verdicts,
            path=tuple(self._path),
        )
        return self.result
