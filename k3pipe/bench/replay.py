"""A trace replayed in time (issue 49, item 3): when each request is sent, which waits for which, and
how far the sends fell from the plan.

The rules, as the record states them:

- **Plan.** Request i is planned at its trace time divided by ``speed``; a gap between two
  consecutive sends longer than ``max_idle_s`` is cut to ``max_idle_s`` (every later time moves up
  by what was cut). The plan is fixed before the first send (open loop): a slow engine does not
  slow the arrivals of new sessions.
- **Sessions.** A session's turn is sent at its planned time, or when the previous turn's answer has
  ended if that is later (its prompt carries that answer, so it cannot go before it). The wait for
  the answer is the session's, not the sender's: it is recorded apart from the lag.
- **Failures.** A turn that fails ends its session: the later turns are not sent, and each is
  recorded as skipped, naming the turn that failed (an answer can't be carried that never came).
- **Lag.** The sender's lag is the actual send time minus the time it could have been sent (the
  later of its planned time and its previous answer's end): what the client itself added. Its p50
  and p99 are the replay's fidelity of timing (docs/traces.md).

The sending itself is a callable (``send(i) -> bool``, awaited until the answer ends); the clock is
injectable, so the rules are tested on a clock the test moves (tests/unit/test_replay.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import numpy as np

from k3pipe.schema.traces import Trace

__all__ = ["ReplayOutcome", "ReplayRecord", "replay", "replay_plan"]


def replay_plan(trace: Trace, speed: float = 1.0, max_idle_s: float | None = None) -> list[float]:
    """Each request's planned send time, in seconds from the replay's start."""
    if speed <= 0:
        raise ValueError(f"speed={speed}: give a factor > 0 (2: twice as fast as recorded)")
    if max_idle_s is not None and max_idle_s < 0:
        raise ValueError(f"max_idle_s={max_idle_s}: give seconds >= 0, or None for no cap")
    plan: list[float] = []
    cut = 0.0
    t0 = trace.requests[0].t
    previous = 0.0
    for r in trace.requests:
        t = (r.t - t0) / speed
        gap = t - previous
        if max_idle_s is not None and gap > max_idle_s:
            cut += gap - max_idle_s
        previous = t
        plan.append(t - cut)
    return plan


@dataclass(frozen=True)
class ReplayRecord:
    """One request of a replay: when it was planned, could go, went and ended (seconds from the
    replay's start); ``skipped`` says why it was not sent."""

    index: int
    planned_s: float
    ready_s: float | None = None  # the later of its plan and its previous answer's end
    sent_s: float | None = None
    done_s: float | None = None
    ok: bool = False
    skipped: str | None = None

    @property
    def lag_s(self) -> float | None:
        if self.sent_s is None or self.ready_s is None:
            return None
        return self.sent_s - self.ready_s

    @property
    def session_wait_s(self) -> float | None:
        return None if self.ready_s is None else self.ready_s - self.planned_s


@dataclass(frozen=True)
class ReplayOutcome:
    records: tuple[ReplayRecord, ...]

    def lag_ms(self, q: float) -> float | None:
        lags = [r.lag_s for r in self.records if r.lag_s is not None]
        return float(np.quantile(lags, q)) * 1000.0 if lags else None

    @property
    def skipped(self) -> list[ReplayRecord]:
        return [r for r in self.records if r.skipped]


Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]


async def replay(
    trace: Trace,
    plan: Sequence[float],
    send: Callable[[int], Awaitable[bool]],
    *,
    clock: Clock = time.monotonic,
    sleep: Sleep = asyncio.sleep,
) -> ReplayOutcome:
    """Send every request of ``trace`` by ``plan`` and the session rule; ``send(i)`` sends request i
    and returns, when its answer has ended, whether it succeeded."""
    if len(plan) != len(trace.requests):
        raise ValueError(f"a plan of {len(plan)} times for {len(trace.requests)} requests")
    start = clock()
    previous: dict[int, int] = {}
    last_of: dict[str, int] = {}
    for i, r in enumerate(trace.requests):
        if r.session is not None:
            if r.session in last_of:
                previous[i] = last_of[r.session]
            last_of[r.session] = i
    done = {i: asyncio.Event() for i in previous.values()}
    records: list[ReplayRecord | None] = [None] * len(plan)

    async def one(i: int) -> None:
        planned = plan[i]
        wait = planned - (clock() - start)
        if wait > 0:
            await sleep(wait)
        ready = planned
        before = previous.get(i)
        if before is not None:
            await done[before].wait()
            prior = records[before]
            assert prior is not None
            if not prior.ok:
                why = prior.skipped or f"turn {trace.requests[before].turn} failed"
                records[i] = ReplayRecord(i, planned, skipped=why)
                done.get(i, asyncio.Event()).set()
                return
            ready = max(planned, prior.done_s or planned)
        sent = clock() - start
        try:
            ok = await send(i)
        except Exception:  # a failed request is a record; the replay goes on
            ok = False
        records[i] = ReplayRecord(i, planned, ready, sent, clock() - start, ok)
        if i in done:
            done[i].set()

    await asyncio.gather(*(one(i) for i in range(len(plan))))
    return ReplayOutcome(tuple(r for r in records if r is not None))
