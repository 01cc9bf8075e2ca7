"""A study spread over GPU nodes: its launches handed out to the nodes' work pools, each pool running
one launch at a time, the next in the study's order as soon as it is free.

:func:`dispatch` is the scheduler, whatever runs a launch on a pool (``run_on``): the study flow's
Prefect deployment runs (``flows/fleet.py``), or a test's stand-in. It keeps the study's interleaved
order (A B, B A, ...) as the order launches are taken in, so a drift over time still favours no arm,
and keeps every pool busy: a pool takes the first launch not yet taken that may run on it
(``FleetSpec.arms``). A launch that fails is recorded failed and the others go on; a pool whose worker
never starts a launch (:class:`PoolUnavailable`) is named and given nothing more, its launches going
to the other pools they may run on, or failing when there are none.
"""

from __future__ import annotations

import contextvars
import json
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from k3pipe.bench.corpora import PromptSet
from k3pipe.errors import K3pipeError
from k3pipe.run import ArmOutcome
from k3pipe.runrecord import prompts_artifact, prompts_digest
from k3pipe.secrets import scrub
from k3pipe.specs import ExperimentSpec
from k3pipe.tracking import Tracker

__all__ = [
    "HEARTBEAT_PREFIX",
    "PROMPTS_INDEX",
    "Heartbeat",
    "PoolUnavailable",
    "PromptsMismatch",
    "Ticket",
    "dispatch",
    "heartbeat_key",
    "last_heartbeat",
    "log_study_prompts",
    "read_study_prompts",
]

PROMPTS_INDEX = "prompts/index.json"
"""On a fleet study's run: every workload repeat's prompts artifact and its sha256."""

log = logging.getLogger("k3pipe.fleet")


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
    """No worker of the pool started the launch in time: the pool gets nothing more."""


RunOn = Callable[[str, Ticket], ArmOutcome]
"""Run a launch on a pool and return how it ended (raise :class:`PoolUnavailable` if it never started)."""


def dispatch(
    tickets: Sequence[Ticket],
    pools_of: Callable[[str], Sequence[str]],
    run_on: RunOn,
    say: Callable[[str], None] = log.info,
    warn: Callable[[str], None] = log.error,
) -> list[ArmOutcome]:
    """Every ticket run on one of the pools its arm may use (``pools_of``), the pools in parallel,
    each one launch at a time; the outcomes in the tickets' order. An exception of ``run_on`` fails
    that launch (recorded in its outcome, ``mlflow_run_id`` empty when no run was made); an
    interrupt stops handing out launches and goes on up once the running ones have returned."""
    pools = list(dict.fromkeys(p for t in tickets for p in pools_of(t.arm)))
    pending = list(range(len(tickets)))
    outcomes: dict[int, ArmOutcome] = {}
    dead: dict[str, str] = {}
    lock = threading.Lock()
    stop = threading.Event()

    def fail(i: int, error: str) -> None:
        t = tickets[i]
        outcomes[i] = ArmOutcome(arm=t.arm, mlflow_run_id="", status="FAILED", error=error, launch=t.launch)

    def strand() -> None:
        """Fail the pending launches whose every pool is dead (called with the lock held)."""
        for i in list(pending):
            allowed = list(pools_of(tickets[i].arm))
            if all(p in dead for p in allowed):
                pending.remove(i)
                why = "; ".join(f"{p}: {dead[p]}" for p in allowed)
                fail(i, f"no pool could run it ({why})")
                warn(f"launch {tickets[i].label}: not run, no pool left that may run it ({why})")

    def take(pool: str) -> int | None:
        with lock:
            if stop.is_set() or pool in dead:
                return None
            for i in pending:
                if pool in pools_of(tickets[i].arm):
                    pending.remove(i)
                    return i
            return None

    def serve(pool: str) -> None:
        while (i := take(pool)) is not None:
            ticket = tickets[i]
            say(f"launch {ticket.label} -> pool {pool}")
            try:
                outcome = run_on(pool, ticket)
            except PoolUnavailable as exc:
                with lock:
                    dead[pool] = scrub(str(exc))
                    pending.insert(0, i)  # first in line for another pool
                    pending.sort()
                    warn(f"pool {pool}: {dead[pool]}; it gets no more launches")
                    strand()
                return
            except Exception as exc:
                error = scrub(f"{type(exc).__name__}: {exc}")
                warn(f"launch {ticket.label} on pool {pool} failed: {error}")
                with lock:
                    fail(i, f"on pool {pool}: {error}")
                continue
            except BaseException:
                stop.set()
                raise
            with lock:
                outcomes[i] = outcome
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
            raise
    with lock:
        for i in pending:  # only after an interrupt: never handed out
            fail(i, "not run: the study was stopped first")
    return [outcomes[i] for i in range(len(tickets))]


class PromptsMismatch(K3pipeError):
    """A node read prompts that are not the ones the study recorded (or found none)."""


def log_study_prompts(tracker: Tracker, study_run_id: str, prompts: Mapping[str, list[PromptSet]]) -> None:
    """Every workload repeat's prompts on the study's run, once, with their digests
    (:data:`PROMPTS_INDEX`): each node's launch sends these, verified (:func:`read_study_prompts`)."""
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
    tracker.log_dict(study_run_id, index, PROMPTS_INDEX)


def read_study_prompts(
    tracker: Tracker, study_run_id: str, spec: ExperimentSpec
) -> dict[str, list[PromptSet]]:
    """The prompts the study drew (:func:`log_study_prompts`), each verified against its recorded
    sha256; :class:`PromptsMismatch` names a repeat that is missing or differs."""
    raw = tracker.read_artifact(study_run_id, PROMPTS_INDEX)
    if raw is None:
        raise PromptsMismatch(
            f"study run {study_run_id} has no {PROMPTS_INDEX}: its prompts were not recorded for the "
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


HEARTBEAT_PREFIX = "k3pipe.heartbeat."
"""On a fleet study's run: ``k3pipe.heartbeat.<arm>.<launch>``, the time (Unix seconds) the node
running that launch last said it was alive."""


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
        import time

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
