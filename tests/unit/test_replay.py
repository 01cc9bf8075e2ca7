"""A trace replayed in time (k3pipe/bench/replay.py), on a clock the test moves (no real waiting, so
the rules are checked exactly): the plan's speed factor and idle-gap cap, a session's turn sent at
its plan or after its previous answer, whichever is later, a failed turn ending its session, and
the sender's lag kept apart from the session's wait."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Awaitable, Callable

import pytest

from k3pipe.bench.replay import ReplayOutcome, replay, replay_plan
from k3pipe.schema.traces import Trace, TraceRequest


class FakeClock:
    """Virtual time: ``sleep`` parks a task until the driver moves the clock to its wake-up, which it
    does only when every task is parked (after letting the loop run)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._timers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._timers, (self.now + max(seconds, 0.0), next(self._order), future))
        await future

    async def run(self, main: Awaitable[ReplayOutcome]) -> ReplayOutcome:
        task = asyncio.ensure_future(main)
        while not task.done():
            for _ in range(20):  # let every runnable task reach its next sleep or event
                await asyncio.sleep(0)
            if task.done():
                break
            assert self._timers, "every task waits on something no timer will end"
            when, _, future = heapq.heappop(self._timers)
            self.now = max(self.now, when)
            future.set_result(None)
        return task.result()


def _trace(*rows: tuple[float, str | None]) -> Trace:
    turns: dict[str, int] = {}
    requests = []
    for t, session in rows:
        turn = None
        if session is not None:
            turn = turns[session] = turns.get(session, 0) + 1
        requests.append(TraceRequest(t, 8, 4, (), session, turn))
    return Trace(tuple(requests), block_tokens=4)


def _run(
    trace: Trace, plan: list[float], answer_s: dict[int, float], fails: frozenset[int] = frozenset()
) -> ReplayOutcome:
    fake = FakeClock()

    def sender() -> Callable[[int], Awaitable[bool]]:
        async def send(i: int) -> bool:
            await fake.sleep(answer_s.get(i, 0.5))
            return i not in fails

        return send

    return asyncio.run(fake.run(replay(trace, plan, sender(), clock=fake.clock, sleep=fake.sleep)))


def test_the_plan_is_the_traces_times_by_speed_with_long_gaps_cut() -> None:
    trace = _trace((10.0, None), (11.0, None), (31.0, None), (32.0, None))
    assert replay_plan(trace) == [0.0, 1.0, 21.0, 22.0]
    assert replay_plan(trace, speed=2.0) == [0.0, 0.5, 10.5, 11.0]
    assert replay_plan(trace, max_idle_s=5.0) == [0.0, 1.0, 6.0, 7.0]  # the 20 s gap cut to 5
    assert replay_plan(trace, speed=2.0, max_idle_s=5.0) == [0.0, 0.5, 5.5, 6.0]
    with pytest.raises(ValueError, match="speed=0"):
        replay_plan(trace, speed=0)
    with pytest.raises(ValueError, match="max_idle_s=-1"):
        replay_plan(trace, max_idle_s=-1)


def test_requests_on_their_own_go_at_their_plan_whatever_the_answers_take() -> None:
    trace = _trace((0.0, None), (1.0, None), (2.0, None))
    out = _run(trace, replay_plan(trace), {0: 10.0, 1: 10.0, 2: 10.0})
    assert [r.sent_s for r in out.records] == [0.0, 1.0, 2.0]  # open loop: slow answers slow no send
    assert [r.done_s for r in out.records] == [10.0, 11.0, 12.0]
    assert out.lag_ms(0.99) == 0.0


def test_a_turn_goes_at_its_plan_or_after_its_previous_answer_whichever_is_later() -> None:
    # session a: turn 2 planned at 1 s, its turn 1 answered at 3 s -> sent at 3 s (a wait of 2 s);
    # turn 3 planned at 10 s, turn 2 answered at 3.5 s -> sent at its plan
    trace = _trace((0.0, "a"), (1.0, "a"), (10.0, "a"), (0.5, None))
    trace = Trace(tuple(sorted(trace.requests, key=lambda r: r.t)), 4)  # (0, a1), (0.5), (1, a2), (10, a3)
    out = _run(trace, replay_plan(trace), {0: 3.0, 2: 0.5, 3: 0.5, 1: 0.5})
    by = {(r.index): r for r in out.records}
    assert [by[i].sent_s for i in range(4)] == [0.0, 0.5, 3.0, 10.0]
    assert by[2].session_wait_s == 2.0
    assert by[2].lag_s == 0.0  # the wait was the session's, not the sender's
    assert by[3].session_wait_s == 0.0


def test_a_failed_turn_ends_its_session_and_the_later_turns_say_why() -> None:
    trace = _trace((0.0, "a"), (1.0, "b"), (2.0, "a"), (3.0, "a"), (4.0, "b"))
    out = _run(trace, replay_plan(trace), {}, fails=frozenset({0}))
    by = {r.index: r for r in out.records}
    assert by[0].sent_s == 0.0
    assert not by[0].ok
    assert by[2].skipped == "turn 1 failed"
    assert by[3].skipped == "turn 1 failed"  # its previous turn was skipped for that
    assert by[2].sent_s is None
    assert by[3].sent_s is None
    assert [by[1].ok, by[4].ok] == [True, True]  # session b goes on
    assert [r.index for r in out.skipped] == [2, 3]


def test_a_request_whose_send_raises_is_a_failed_record() -> None:
    trace = _trace((0.0, "a"), (1.0, "a"))
    fake = FakeClock()

    async def send(i: int) -> bool:
        raise ConnectionError("refused")

    out = asyncio.run(fake.run(replay(trace, replay_plan(trace), send, clock=fake.clock, sleep=fake.sleep)))
    assert [(r.ok, r.skipped) for r in out.records] == [(False, None), (False, "turn 1 failed")]


def test_the_senders_lag_is_measured_from_when_it_could_have_sent() -> None:
    """A clock that runs late by 5 ms at every read after a sleep: the lag says so."""
    trace = _trace((0.0, None), (1.0, None), (2.0, None))
    fake = FakeClock()
    base_sleep = fake.sleep

    async def late_sleep(seconds: float) -> None:
        await base_sleep(seconds + 0.005)

    async def send(i: int) -> bool:
        await base_sleep(0.1)
        return True

    out = asyncio.run(fake.run(replay(trace, replay_plan(trace), send, clock=fake.clock, sleep=late_sleep)))
    assert out.lag_ms(0.5) == pytest.approx(5.0)
    assert out.lag_ms(0.99) == pytest.approx(5.0)
