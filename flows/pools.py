"""How the study flow hands a launch to a GPU node's pool (an experiment's ``fleet``): a run of the
pool's ``launch`` deployment (flows/fleet.py), created as a subflow of the study's flow run, waited
for while its node's heartbeat is watched, its outcome read back from MLflow; and what a pool is
doing (:func:`pool_state`), from its Prefect server: free, busy with another flow run, or lost (no
worker alive), so that the scheduler (k3pipe.jobs.fleet.dispatch) passes a busy pool over, and waits for
it, instead of taking it for lost.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from uuid import UUID

from prefect import get_client
from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterState,
    FlowRunFilterStateType,
    WorkPoolFilter,
    WorkPoolFilterName,
)
from prefect.client.schemas.objects import FlowRun, StateType, WorkerStatus
from prefect.exceptions import ObjectNotFound
from prefect.states import Cancelled, Crashed

from k3pipe.core.layout import LAUNCH_TAG, RunTags
from k3pipe.jobs.arm_run import ArmOutcome
from k3pipe.jobs.fleet import PoolState, PoolUnavailable, PoolWatch, Remote, Ticket, Waits, last_heartbeat
from k3pipe.records.recorder import close_abandoned
from k3pipe.records.tracking import Tracker
from k3pipe.schema.specs import FleetSpec

__all__ = ["LAUNCH_FLOW", "pool_state", "prefect_fleet"]

LAUNCH_FLOW = "launch"
"""The launch flow's name: each pool's deployment of it is ``launch/<pool>``."""
POLL_S = 2.0
# the states that hold a pool's slot (its concurrency limit counts them)
_HOLDING = [StateType.PENDING, StateType.RUNNING, StateType.CANCELLING]


def prefect_fleet(
    fleet: FleetSpec,
    study_run_id: str,
    tracker: Tracker,
    say: Callable[[str], None],
    warn: Callable[[str], None],
) -> Remote:
    """How the study ``study_run_id`` reaches its pools: a launch runs as a run of ``launch/<pool>``,
    created as a subflow of the running study flow and waited for; a pool's state comes from its
    Prefect server (:func:`pool_state`). :class:`PoolUnavailable` when the pool has no such
    deployment, when its worker is gone (no heartbeat) for ``fleet.pickup_timeout_s``, when it stays
    busy with other flow runs past ``fleet.busy_timeout_s``, or when its live, idle worker does not
    start the run within ``fleet.pickup_timeout_s`` (the run is then cancelled)."""
    from prefect.deployments import run_deployment

    waits = Waits(busy_timeout_s=fleet.busy_timeout_s, pickup_timeout_s=fleet.pickup_timeout_s, poll_s=POLL_S)
    names: dict[UUID, str] = {}

    def probe(pool: str) -> PoolState:
        return pool_state(pool, names=names)

    def run_on(pool: str, ticket: Ticket) -> ArmOutcome:
        params = {
            "study_run_id": study_run_id,
            "arm": ticket.arm,
            "launch": ticket.launch,
            "launches": ticket.launches,
            "pool": pool,
        }
        try:
            created = run_deployment(
                f"{LAUNCH_FLOW}/{pool}", parameters=params, timeout=0,
                flow_run_name=f"{ticket.arm}-{ticket.launch}", tags=["k3pipe-fleet"],
            )  # fmt: skip
        except ObjectNotFound as exc:
            raise PoolUnavailable(
                f"pool {pool} has no {LAUNCH_FLOW} deployment ({LAUNCH_FLOW}/{pool}): "
                f"`k3pipe stack add-node {pool}` makes one"
            ) from exc
        assert isinstance(created, FlowRun)  # called from a sync flow: the run, not a coroutine
        run = _started(created.id, pool, ticket, waits, names, say)
        say(f"launch {ticket.label}: flow run {run.name} on pool {pool}")
        # the node's heartbeat, timed by this clock (the node's may be set otherwise): when it last moved
        seen, moved = None, time.monotonic()
        while not (run.state and run.state.is_final()):
            time.sleep(POLL_S)
            run = _read(run.id)
            beat = last_heartbeat(tracker, study_run_id, ticket.arm, ticket.launch)
            if beat != seen:
                seen, moved = beat, time.monotonic()
            elif time.monotonic() - moved > fleet.lost_after_s and not (run.state and run.state.is_final()):
                why = (
                    f"its node was lost: no heartbeat for {time.monotonic() - moved:.0f} s "
                    f"(fleet.lost_after_s {fleet.lost_after_s:g}) while flow run {run.name} on pool {pool} "
                    "was running (the node died, or its worker was killed)"
                )
                with get_client(sync_client=True) as client:
                    client.set_flow_run_state(run.id, Crashed(message=why), force=True)
                warn(f"launch {ticket.label}: {why}")
                return _outcome(tracker, study_run_id, ticket, pool, _read(run.id), lost=why)
        return _outcome(tracker, study_run_id, ticket, pool, run)

    return Remote(run_on, probe, waits)


def pool_state(pool: str, exclude: UUID | None = None, names: dict[UUID, str] | None = None) -> PoolState:
    """What ``pool`` is doing, by its Prefect server: ``lost`` when none of its workers is alive
    (Prefect counts a worker alive while its last heartbeat is within three of its heartbeat
    intervals: 90 s by default), else ``busy`` while a flow run other than ``exclude`` holds its
    slot (Pending, Running or Cancelling), naming it, else ``free``. ``names`` caches the names of
    deployments and flows between calls."""
    names = names if names is not None else {}
    with get_client(sync_client=True) as client:
        workers = client.read_workers_for_work_pool(pool)
        if not any(w.status == WorkerStatus.ONLINE for w in workers):
            heard = [w for w in workers if w.last_heartbeat_time is not None]
            if not heard:
                return PoolState(
                    "lost",
                    f"no worker has polled it (is `prefect worker start --pool {pool}` running on its node?)",
                )
            last = max(heard, key=lambda w: w.last_heartbeat_time)  # type: ignore[arg-type,return-value]
            assert last.last_heartbeat_time is not None
            return PoolState(
                "lost",
                f"no worker of it is alive (its last, {last.name!r}, was heard from at "
                f"{last.last_heartbeat_time:%Y-%m-%d %H:%M:%S} UTC)",
            )
        runs = client.read_flow_runs(
            work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[pool])),
            flow_run_filter=FlowRunFilter(
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=_HOLDING))
            ),
            limit=5,
        )
        others = [r for r in runs if r.id != exclude]
        if not others:
            return PoolState("free")
        return PoolState("busy", "; ".join(_describe(client, r, names) for r in others))


def _describe(client: SyncPrefectClient, run: FlowRun, names: dict[UUID, str]) -> str:
    """``flow run 'NAME' of FLOW/DEPLOYMENT, Running since HH:MM:SS UTC``."""
    key = run.deployment_id or run.flow_id
    if key not in names:
        try:
            flow = client.read_flow(run.flow_id).name
            deployment = client.read_deployment(run.deployment_id).name if run.deployment_id else None
            names[key] = f"{flow}/{deployment}" if deployment else f"flow {flow}"
        except ObjectNotFound:
            names[key] = "a deleted deployment"
    since = run.start_time or run.expected_start_time
    when = f" since {since:%H:%M:%S} UTC" if since is not None else ""
    state = run.state.name if run.state is not None else "?"
    return f"flow run {run.name!r} of {names[key]}, {state}{when}"


def _read(run_id: UUID) -> FlowRun:
    with get_client(sync_client=True) as client:
        return client.read_flow_run(run_id)


def _started(
    run_id: UUID, pool: str, ticket: Ticket, waits: Waits, names: dict[UUID, str], say: Callable[[str], None]
) -> FlowRun:
    """The flow run once a worker has started it (or it ended). While it waits, the pool is asked
    what it is doing: busy with another flow run (another study came first), the run waits up to
    ``waits.busy_timeout_s``, saying so; with no live worker, up to ``waits.pickup_timeout_s``; with a
    live, idle worker that does not start it, up to ``waits.pickup_timeout_s`` too. Past its limit the
    run is cancelled and :class:`PoolUnavailable` says why."""
    watch = PoolWatch(pool, waits)
    idle_since: float | None = None
    while True:
        run = _read(run_id)
        state = run.state
        if state is not None and (state.is_running() or state.is_final()):
            return run
        now = pool_state(pool, exclude=run_id, names=names)
        why = watch.see(
            now, lambda: f"launch {ticket.label} waits for it (its flow run is queued there)", say
        )
        if now.kind == "free":
            idle_since = idle_since or time.monotonic()
            if time.monotonic() - idle_since > waits.pickup_timeout_s:
                why = (
                    f"no worker of pool {pool} started launch {ticket.label} within "
                    f"{waits.pickup_timeout_s:g} s though one is alive and idle (fleet.pickup_timeout_s; is "
                    f"the pool or its {LAUNCH_FLOW}/{pool} deployment paused?)"
                )
        else:
            idle_since = None
        if why is not None:
            with get_client(sync_client=True) as client:
                client.set_flow_run_state(run_id, Cancelled(message=why), force=True)
            raise PoolUnavailable(why)
        time.sleep(waits.poll_s)


def _outcome(
    tracker: Tracker, study_run_id: str, ticket: Ticket, pool: str, run: FlowRun, lost: str | None = None
) -> ArmOutcome:
    """How the launch ended, from its arm run in MLflow (the one this flow run made); an arm run the
    node left RUNNING (its process died: ``lost`` says how it was told) is closed, with what it had
    recorded kept."""
    state = run.state
    assert state is not None
    mine = [
        r
        for r in tracker.children(study_run_id)
        if RunTags.of(r).arm == ticket.arm
        and r.data.tags.get(LAUNCH_TAG) == str(ticket.launch)
        and r.data.tags.get("prefect.flow_run_id") == str(run.id)
    ]
    why = lost or f"flow run {run.name} on pool {pool} ended {state.name}"
    if state.message and not lost:
        why += f": {state.message}"
    if not mine:
        return ArmOutcome(arm=ticket.arm, mlflow_run_id="", status="FAILED", error=why, launch=ticket.launch)
    arm_run = mine[0]
    status = arm_run.info.status
    if status == "RUNNING":  # the node was lost mid-launch: what it measured stays, marked so
        why = why if lost else f"its node was lost: {why}"
        close_abandoned(tracker, arm_run.info.run_id, why, upward=False)
        status = "FAILED"
    error = None if status == "FINISHED" else why if lost else RunTags.of(arm_run).error or why
    return ArmOutcome(
        arm=ticket.arm, mlflow_run_id=arm_run.info.run_id, status=status, error=error, launch=ticket.launch
    )
