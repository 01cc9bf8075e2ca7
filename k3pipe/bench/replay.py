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

from k3pipe.schema.traces import Trace, theoretical_hit_rate

__all__ = [
    "FIDELITY_BOUNDS",
    "ReplayOutcome",
    "ReplayRecord",
    "fidelity",
    "fidelity_problems",
    "rate_window_s",
    "replay",
    "replay_plan",
]


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
    stopped: Callable[[], str | None] = lambda: None,
) -> ReplayOutcome:
    """Send every request of ``trace`` by ``plan`` and the session rule; ``send(i)`` sends request i
    and returns, when its answer has ended, whether it succeeded. Once ``stopped()`` gives a reason
    (the engine was lost, an interrupt), no request is sent: each left is recorded as skipped with
    it."""
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
        reason = stopped()
        if reason is not None:
            records[i] = ReplayRecord(i, planned, ready, skipped=f"not sent: {reason}")
            if i in done:
                done[i].set()
            return
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


# --- fidelity (issue 49, item 4) -------------------------------------------------------------------

FIDELITY_BOUNDS: dict[str, tuple[float, str]] = {
    "replay_lag_ms_p99": (10.0, "the sender's lag p99 (ms)"),
    "replay_rate_dev_pct_max": (10.0, "the offered rate's largest gap from the trace's in a window (%)"),
    "replay_prompt_tokens_dev_pct_p50": (5.0, "the engine's prompt tokens' median gap from the trace's (%)"),
    "replay_skipped": (0.0, "requests not sent (their session's earlier turn failed, or the replay stopped)"),
}
"""The bounds a faithful replay keeps (metric -> (the most it may be, what it is)); a replay outside
any of them says so at the top of the report."""

RATE_WINDOW_S = 60.0
MIN_WINDOW_REQUESTS = 20
"""A window is compared only when it plans this many sends: one request that slips into the next window
(its session waited for an answer) then moves the gap by at most 5%, half the bound."""


def rate_window_s(plan: Sequence[float]) -> float:
    """The window the offered rate is compared in: a minute, or a third of a replay shorter than three."""
    span = (plan[-1] - plan[0]) if plan else 0.0
    return RATE_WINDOW_S if span >= 3 * RATE_WINDOW_S else max(1.0, span / 3)


def fidelity(
    trace: Trace,
    plan: Sequence[float],
    outcome: ReplayOutcome,
    usage_prompt_tokens: Sequence[int | None],
) -> dict[str, float]:
    """How faithful a replay was, as metrics:

    - ``replay_lag_ms_p50``/``_p99``/``_max``: the sender's lag (what the client added);
    - ``replay_session_wait_s_p50``/``_max``: how long turns waited for their previous answer past
      their planned time (the engine's pace, not the client's);
    - ``replay_rate_dev_pct_max``: in each window of ``replay_rate_window_s`` (a minute; a third of a
      shorter replay) holding at least ``MIN_WINDOW_REQUESTS`` (20) planned sends, the sends made
      against those planned, the largest gap in percent: the offered load against the trace's;
    - ``replay_prompt_tokens_dev_pct_p50``/``_max``: the engine's prompt tokens (usage) against the
      trace's ``input_tokens``, per request (threaded turns carry real answers: their lengths move
      with them);
    - ``replay_sent``, ``replay_skipped``;
    - ``trace_hit_rate_pct``: the theoretical prefix-cache hit rate of the requests sent (blocks an
      earlier prompt held, Mooncake's definition), and ``trace_hit_rate_answers_pct`` with the blocks a
      session's previous answer covers too (engines cache what they generate); the engine's
      ``engine_prefix_cache_hit_pct`` is read against both.

    ``usage_prompt_tokens``: the engine's prompt tokens per request of the trace (None: not sent, or
    not reported).
    """
    out: dict[str, float] = {}
    lags = [r.lag_s for r in outcome.records if r.lag_s is not None]
    if lags:
        ms = np.asarray(lags) * 1000.0
        out |= {
            "replay_lag_ms_p50": float(np.quantile(ms, 0.5)),
            "replay_lag_ms_p99": float(np.quantile(ms, 0.99)),
            "replay_lag_ms_max": float(ms.max()),
        }
    waits = [w for r in outcome.records if r.sent_s is not None and (w := r.session_wait_s) is not None]
    if waits:
        out |= {"replay_session_wait_s_p50": float(np.median(waits)), "replay_session_wait_s_max": max(waits)}
    sent = [r for r in outcome.records if r.sent_s is not None]
    out["replay_sent"] = float(len(sent))
    out["replay_skipped"] = float(len(outcome.records) - len(sent))
    window = rate_window_s(plan)
    out["replay_rate_window_s"] = window
    planned = np.bincount((np.asarray(plan) // window).astype(int))
    if sent:
        made = np.bincount(
            (np.asarray([r.sent_s for r in sent]) // window).astype(int), minlength=len(planned)
        )
        gaps = [
            abs(float(made[k]) - float(planned[k])) / float(planned[k]) * 100.0
            for k in range(len(planned))
            if planned[k] >= MIN_WINDOW_REQUESTS
        ]
        if gaps:
            out["replay_rate_dev_pct_max"] = max(gaps)
    devs = [
        abs(u - r.input_tokens) / r.input_tokens * 100.0
        for r, u in zip(trace.requests, usage_prompt_tokens, strict=True)
        if u is not None
    ]
    if devs:
        out["replay_prompt_tokens_dev_pct_p50"] = float(np.median(devs))
        out["replay_prompt_tokens_dev_pct_max"] = max(devs)
    sent_ids = {r.index for r in sent}
    kept = Trace(tuple(r for i, r in enumerate(trace.requests) if i in sent_ids), trace.block_tokens)
    if kept.requests:
        out["trace_hit_rate_pct"] = 100.0 * theoretical_hit_rate(kept)
        out["trace_hit_rate_answers_pct"] = 100.0 * theoretical_hit_rate(kept, with_answers=True)
    return out


def fidelity_problems(metrics: dict[str, float]) -> list[str]:
    """Each bound of :data:`FIDELITY_BOUNDS` a replay's metrics break, in words."""
    problems = []
    for key, (bound, what) in FIDELITY_BOUNDS.items():
        value = metrics.get(key)
        if value is not None and value > bound:
            problems.append(f"{what} {value:.4g}, over its bound {bound:g}")
    return problems
