"""How the study flow hands a launch to a GPU node's pool (an experiment's ``fleet``): a run of the
pool's ``launch`` deployment (flows/fleet.py), created as a subflow of the study's flow run, waited
for while its node's heartbeat is watched, its outcome read back from MLflow.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from uuid import UUID

from prefect import get_client
from prefect.client.schemas.objects import FlowRun
from prefect.exceptions import ObjectNotFound
from prefect.states import Cancelled, Crashed

from k3pipe.fleet import PoolUnavailable, RunOn, Ticket, last_heartbeat
from k3pipe.record import close_abandoned
from k3pipe.run import ArmOutcome
from k3pipe.specs import FleetSpec
from k3pipe.tracking import Tracker

__all__ = ["LAUNCH_FLOW", "prefect_fleet"]

LAUNCH_FLOW = "launch"
"""The launch flow's name: each pool's deployment of it is ``launch/<pool>``."""
POLL_S = 2.0


def prefect_fleet(
    fleet: FleetSpec,
    study_run_id: str,
    tracker: Tracker,
    say: Callable[[str], None],
    warn: Callable[[str], None],
) -> RunOn:
    """What runs a launch of the study ``study_run_id`` on a pool: a run of ``launch/<pool>``,
    created as a subflow of the running study flow, waited for; :class:`PoolUnavailable` when the
    pool has no such deployment, or no worker started the run within ``fleet.pickup_timeout_s``
    (the run is then cancelled)."""
    from prefect.deployments import run_deployment

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
        run = _started(created.id, pool, ticket, fleet.pickup_timeout_s)
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

    return run_on


def _read(run_id: UUID) -> FlowRun:
    with get_client(sync_client=True) as client:
        return client.read_flow_run(run_id)


def _started(run_id: UUID, pool: str, ticket: Ticket, timeout_s: float) -> FlowRun:
    """The flow run once a worker has started it (or it ended); cancelled, and
    :class:`PoolUnavailable`, when none has after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        run = _read(run_id)
        state = run.state
        if state is not None and (state.is_running() or state.is_final()):
            return run
        if time.monotonic() > deadline:
            why = (
                f"no worker of pool {pool} started launch {ticket.label} within {timeout_s:g} s "
                f"(is `prefect worker start --pool {pool}` running on its node?)"
            )
            with get_client(sync_client=True) as client:
                client.set_flow_run_state(run_id, Cancelled(message=why), force=True)
            raise PoolUnavailable(why)
        time.sleep(POLL_S)


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
        if r.data.tags.get("k3pipe.arm") == ticket.arm
        and r.data.tags.get("k3pipe.launch") == str(ticket.launch)
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
    error = None if status == "FINISHED" else why if lost else arm_run.data.tags.get("k3pipe.error") or why
    return ArmOutcome(
        arm=ticket.arm, mlflow_run_id=arm_run.info.run_id, status=status, error=error, launch=ticket.launch
    )
