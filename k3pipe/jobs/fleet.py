"""A study spread over GPU nodes: its launches handed out to the nodes' work pools, each pool running
one launch at a time, the next in the study's order as soon as it is free.

:func:`dispatch` is the scheduler, whatever runs a launch on a pool (``run_on``): the study flow's
Prefect deployment runs (``flows/fleet.py``), or a test's stand-in. It keeps the study's interleaved
order (A B, B A, ...) as the order launches are taken in, so a drift over time still favours no arm,
and keeps every pool busy: a pool takes the first launch not yet taken that may run on it
(``FleetSpec.arms``). A launch that fails is recorded failed and the others go on.

A pool is handed a launch only when it is free (:class:`PoolState`, asked through ``Remote.probe``).
A busy pool (its worker alive, running another flow run: a node busy with another study) is not a
lost one: it is passed over, its launches going to the other pools they may run on as soon as one
is free, and waited for, with a line naming it and what it runs, up to ``fleet.busy_timeout_s``. A
pool with no live worker is lost after ``fleet.pickup_timeout_s``. A pool that stayed busy too long,
was lost, or whose worker never started a launch (:class:`PoolUnavailable`) is named and given
nothing more, its launches going to the other pools they may run on, or failing when there are none.
"""

from __future__ import annotations

import contextvars
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

from k3pipe.core.errors import K3pipeError
from k3pipe.core.layout import HEARTBEAT_PREFIX, PROMPTS_INDEX_FILE
from k3pipe.core.secrets import scrub
from k3pipe.jobs.arm_run import ArmOutcome
from k3pipe.prompts.corpora import PromptSet
from k3pipe.records.runrecord import prompts_artifact, prompts_digest
from k3pipe.records.tracking import Tracker
from k3pipe.schema.specs import ExperimentSpec

__all__ = [
    "Heartbeat",
    "PoolState",
    "PoolUnavailable",
    "PoolWatch",
    "Probe",
    "PromptsMismatch",
    "Remote",
    "RunOn",
    "Ticket",
    "Waits",
    "dispatch",
    "heartbeat_key",
    "last_heartbeat",
    "log_study_prompts",
    "read_study_prompts",
]


log = logging.getLogger("k3pipe.jobs.fleet")


@dataclass(frozen=True)
class Ticket:
    """One launch of a study to run on some node: arm ``arm``'s launch ``launch`` of ``launches``."""

    arm: str
    launch: int
    launches: int = 1

    @property
    def label(self) -> str:
        return f"{self.arm}#{self.launch}"


class PoolUnavailable(K3pipeError):
    """The pool gets nothing more in this study: its worker is gone (lost), it stayed busy with other
    flow runs past ``fleet.busy_timeout_s``, or no worker started a launch in time."""


RunOn = Callable[[str, Ticket], ArmOutcome]
"""Run a launch on a pool and return how it ended (raise :class:`PoolUnavailable` if it never started)."""


@dataclass(frozen=True)
class PoolState:
    """What a pool is doing now, as its Prefect server tells it.

    - ``free``: a worker of it is alive (its heartbeat is recent) and no flow run holds its one slot;
    - ``busy``: a worker is alive and the pool runs another flow run (``detail`` names it): a node
      busy with another study is not a lost one;
    - ``lost``: no worker of it is alive (``detail`` says when one was last heard from)."""

    kind: Literal["free", "busy", "lost"]
    detail: str = ""


Probe = Callable[[str], PoolState]
"""Ask the server what a pool is doing (:class:`PoolState`)."""


@dataclass(frozen=True)
class Waits:
    """How long a launch waits for a pool that is not free (an experiment's ``fleet``)."""

    busy_timeout_s: float = 7200.0
    """A pool busy with other flow runs this long, while launches wait for it, gets nothing more."""
    pickup_timeout_s: float = 600.0
    """A pool with no live worker this long is lost: it gets nothing more."""
    poll_s: float = 2.0
    """How often a pool that is not free is asked again."""
    say_every_s: float = 30.0
    """How often a line says that launches still wait for a pool (the first at once)."""


@dataclass(frozen=True)
class Remote:
    """How a study reaches its nodes: ``run_on`` runs a launch on a pool; ``probe`` (if any) says what
    a pool is doing before a launch is handed to it, so that a busy pool is passed over, and waited
    for, rather than taken for lost (:func:`dispatch`)."""

    run_on: RunOn
    probe: Probe | None = None
    waits: Waits = field(default_factory=Waits)


class PoolWatch:
    """One pool's waiting, by the rule of :func:`dispatch`: since when it has been busy or lost (one
    spell at a time: a free moment ends it), when that was last said, and when it has waited too long
    (busy: ``waits.busy_timeout_s``; lost: ``waits.pickup_timeout_s``)."""

    def __init__(self, pool: str, waits: Waits) -> None:
        self.pool, self.waits = pool, waits
        self.kind = "free"
        self.since = self.said = 0.0

    def see(self, state: PoolState, waiting: Callable[[], str], say: Callable[[str], None]) -> str | None:
        """Note ``state``, saying so (with ``waiting()``: what waits for the pool) at once and then every
        ``waits.say_every_s``; returns why the pool gets nothing more once its spell outlasted its limit."""
        now = time.monotonic()
        if state.kind != self.kind:
            self.kind, self.since, self.said = state.kind, now, -math.inf
        if state.kind == "free":
            return None
        spent = now - self.since
        if state.kind == "busy":
            limit, setting = self.waits.busy_timeout_s, "fleet.busy_timeout_s"
            what = f"pool {self.pool} is busy with another flow run ({state.detail})"
            if spent >= limit:
                return f"{what} for {spent:.0f} s ({setting} {limit:g})"
            line = f"{what}; {waiting()} ({spent:.0f} s of {setting} {limit:g})"
        else:
            limit, setting = self.waits.pickup_timeout_s, "fleet.pickup_timeout_s"
            if spent >= limit:
                return f"pool {self.pool} is lost: {state.detail}, for {spent:.0f} s ({setting} {limit:g})"
            line = (
                f"pool {self.pool}: {state.detail}; {waiting()}, for a worker to come ({spent:.0f} s of "
                f"{setting} {limit:g}; then the pool is lost)"
            )
        if now - self.said >= self.waits.say_every_s:
            self.said = now
            say(line)
        return None


def _labels(labels: list[str]) -> str:
    return ", ".join(labels[:6]) + (f" and {len(labels) - 6} more" if len(labels) > 6 else "")


def dispatch(
    tickets: Sequence[Ticket],
    pools_of: Callable[[str], Sequence[str]],
    run_on: RunOn,
    say: Callable[[str], None] = log.info,
    warn: Callable[[str], None] = log.error,
    *,
    probe: Probe | None = None,
    waits: Waits | None = None,
) -> list[ArmOutcome]:
    """Every ticket run on one of the pools its arm may use (``pools_of``), the pools in parallel,
    each one launch at a time; the outcomes in the tickets' order.

    With ``probe``, a launch is handed only to a pool that is free: a busy pool (its worker alive,
    running another flow run) is passed over, so the launches that may also run elsewhere go to the
    first of their pools that is free, and is asked again every ``waits.poll_s``, a line saying what
    it runs and what waits for it; busy past ``waits.busy_timeout_s`` it gets nothing more. A pool
    with no live worker is lost after ``waits.pickup_timeout_s`` and gets nothing more. A pool that
    gets nothing more is named in the error of each launch left with no pool that may run it.

    An exception of ``run_on`` fails that launch (recorded in its outcome, ``mlflow_run_id`` empty
    when no run was made), except :class:`PoolUnavailable`, which gives the launch back to the other
    pools; an interrupt stops handing out launches and goes on up once the running ones have
    returned."""
    waits = waits or Waits()
    pools = list(dict.fromkeys(p for t in tickets for p in pools_of(t.arm)))
    pending = list(range(len(tickets)))
    running: dict[int, str] = {}
    outcomes: dict[int, ArmOutcome] = {}
    dead: dict[str, str] = {}
    cond = threading.Condition()
    stop = threading.Event()

    def fail(i: int, error: str) -> None:
        t = tickets[i]
        outcomes[i] = ArmOutcome(arm=t.arm, mlflow_run_id="", status="FAILED", error=error, launch=t.launch)

    def mine(pool: str, among: Iterable[int]) -> list[int]:
        return [i for i in among if pool in pools_of(tickets[i].arm)]

    def give_up(pool: str, why: str) -> None:
        """The pool gets nothing more; fail the launches no pool is left for (the lock held)."""
        dead[pool] = scrub(why)
        warn(f"{dead[pool]}; pool {pool} gets no more launches")
        for i in list(pending):
            allowed = list(pools_of(tickets[i].arm))
            if all(p in dead for p in allowed):
                pending.remove(i)
                reasons = "; ".join(dead[p] for p in allowed)
                fail(i, f"no pool could run it ({reasons})")
                warn(f"launch {tickets[i].label}: not run, no pool left that may run it ({reasons})")
        cond.notify_all()

    def wanted(pool: str) -> bool:
        """Whether the pool has a launch to take, waiting until one comes or none can (lock held):
        a launch another pool is running may come back (its pool found unavailable)."""
        while not stop.is_set() and pool not in dead:
            if mine(pool, pending):
                return True
            if not mine(pool, running):
                return False
            cond.wait(1.0)
        return False

    def waiting(pool: str) -> str:
        """What waits for ``pool`` now: the launches that may run nowhere else (no other of their
        pools is still given launches), and those that go elsewhere as soon as a pool of theirs is free."""
        with cond:
            only: list[str] = []
            elsewhere: list[str] = []
            for i in mine(pool, pending):
                others = [p for p in pools_of(tickets[i].arm) if p != pool and p not in dead]
                (elsewhere if others else only).append(tickets[i].label)
        said = []
        if only:
            said.append(f"waiting for it, as they may run nowhere else: {_labels(only)}")
        if elsewhere:
            said.append(f"going to another of their pools as soon as one is free: {_labels(elsewhere)}")
        return "; ".join(said) or "no launch waits for it now"

    def serve(pool: str) -> None:
        watch = PoolWatch(pool, waits)
        while True:
            with cond:
                if not wanted(pool):
                    return
            if probe is not None:
                try:
                    state = probe(pool)
                except Exception as exc:  # the server did not answer: run_on's own waits judge the pool
                    warn(f"pool {pool}: could not ask what it is doing ({scrub(str(exc))}); trying it")
                    state = PoolState("free")
                why = watch.see(state, lambda: waiting(pool), say)
                if why is not None:
                    with cond:
                        give_up(pool, why)
                    return
                if state.kind != "free":
                    stop.wait(waits.poll_s)
                    continue
            with cond:
                candidates = mine(pool, pending)
                if stop.is_set() or pool in dead or not candidates:
                    continue
                i = candidates[0]
                pending.remove(i)
                running[i] = pool
            ticket = tickets[i]
            say(f"launch {ticket.label} -> pool {pool}")
            try:
                outcome = run_on(pool, ticket)
            except PoolUnavailable as exc:
                with cond:
                    del running[i]
                    pending.append(i)  # first in line for another pool
                    pending.sort()
                    give_up(pool, str(exc))
                return
            except Exception as exc:
                error = scrub(f"{type(exc).__name__}: {exc}")
                warn(f"launch {ticket.label} on pool {pool} failed: {error}")
                with cond:
                    del running[i]
                    fail(i, f"on pool {pool}: {error}")
                    cond.notify_all()
                continue
            except BaseException:
                stop.set()
                with cond:
                    running.pop(i, None)
                    cond.notify_all()
                raise
            with cond:
                del running[i]
                outcomes[i] = outcome
                cond.notify_all()
            say(f"launch {ticket.label} on pool {pool}: {outcome.status}")

    if not pools:
        return []
    with ThreadPoolExecutor(len(pools), thread_name_prefix="k3pipe-pool") as executor:
        # each pool's thread in a copy of this context (a Prefect flow run's: its runs are the flow's)
        futures = [executor.submit(contextvars.copy_context().run, serve, p) for p in pools]
        try:
            for future in futures:
                future.result()
        except BaseException:
            stop.set()
            with cond:
                cond.notify_all()
            raise
    with cond:
        for i in pending:  # only after an interrupt: never handed out
            fail(i, "not run: the study was stopped first")
    return [outcomes[i] for i in range(len(tickets))]


class PromptsMismatch(K3pipeError):
    """A node read prompts that are not the ones the study recorded (or found none)."""


def log_study_prompts(tracker: Tracker, study_run_id: str, prompts: Mapping[str, list[PromptSet]]) -> None:
    """Every workload repeat's prompts on the study's run, once, with their digests
    (:data:`PROMPTS_INDEX_FILE`): each node's launch sends these, verified (:func:`read_study_prompts`)."""
    index = []
    for workload, sets in prompts.items():
        for repeat, prompt_set in enumerate(sets):
            artifact = prompts_artifact(workload, repeat)
            tracker.log_dict(study_run_id, prompt_set.model_dump(mode="json"), artifact)
            index.append(
                {
                    "workload": workload,
                    "repeat": repeat,
                    "artifact": artifact,
                    "sha256": prompts_digest(prompt_set),
                }
            )
    tracker.log_dict(study_run_id, index, PROMPTS_INDEX_FILE)


def read_study_prompts(
    tracker: Tracker, study_run_id: str, spec: ExperimentSpec
) -> dict[str, list[PromptSet]]:
    """The prompts the study drew (:func:`log_study_prompts`), each verified against its recorded
    sha256; :class:`PromptsMismatch` names a repeat that is missing or differs."""
    raw = tracker.read_artifact(study_run_id, PROMPTS_INDEX_FILE)
    if raw is None:
        raise PromptsMismatch(
            f"study run {study_run_id} has no {PROMPTS_INDEX_FILE}: its prompts were not recorded for the "
            "nodes (a study started without fleet, or by an older k3pipe); start the study again"
        )
    recorded = {(e["workload"], int(e["repeat"])): e for e in json.loads(raw)}
    out: dict[str, list[PromptSet]] = {}
    for workload in spec.workloads:
        for repeat in range(workload.repeats):
            entry = recorded.get((workload.name, repeat))
            data = tracker.read_artifact(study_run_id, entry["artifact"]) if entry else None
            if entry is None or data is None:
                raise PromptsMismatch(
                    f"study run {study_run_id} holds no prompts for workload {workload.name!r} repeat "
                    f"{repeat + 1}: its record is incomplete; start the study again"
                )
            prompt_set = PromptSet.model_validate_json(data)
            digest = prompts_digest(prompt_set)
            if digest != entry["sha256"]:
                raise PromptsMismatch(
                    f"the prompts of workload {workload.name!r} repeat {repeat + 1} read from study run "
                    f"{study_run_id} are not the ones it recorded (sha256 {digest[:16]} against "
                    f"{entry['sha256'][:16]}): its artifact store changed them; start the study again"
                )
            out.setdefault(workload.name, []).append(prompt_set)
    return out


def heartbeat_key(arm: str, launch: int) -> str:
    """The study run's tag of launch ``launch`` of ``arm`` (MLflow takes no '#' in a key)."""
    return f"{HEARTBEAT_PREFIX}{arm}.{launch}"


class Heartbeat:
    """While in its ``with`` block, the node's word every ``interval_s`` that launch ``launch`` of
    ``arm`` is alive: a tag on the study's run (:func:`heartbeat_key`). A failed write is skipped
    (the next one tries again)."""

    def __init__(self, tracker: Tracker, study_run_id: str, arm: str, launch: int, interval_s: float) -> None:
        self.tracker, self.run_id, self.key = tracker, study_run_id, heartbeat_key(arm, launch)
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="k3pipe-heartbeat", daemon=True)

    def _beat(self) -> None:
        while True:
            try:
                self.tracker.set_tags(self.run_id, {self.key: f"{time.time():.3f}"})
            except Exception as exc:
                log.warning("heartbeat %s not written: %s", self.key, exc)
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def last_heartbeat(tracker: Tracker, study_run_id: str, arm: str, launch: int) -> float | None:
    """When the node running launch ``launch`` of ``arm`` last said it was alive (None: never yet)."""
    value = tracker.client.get_run(study_run_id).data.tags.get(heartbeat_key(arm, launch))
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None
