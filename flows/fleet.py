"""The launch flow: one launch of a recorded study on the GPU node whose worker picked it up (each node
a work pool with one ``launch`` deployment named after it: ``k3pipe stack add-node NAME``); the study
flow starts it (flows/pools.py). The body is the library's (k3pipe.jobs.launch); this is its Prefect
shell.
"""

from __future__ import annotations

from typing import Any

from k3pipe.core.errors import RunFailedError
from k3pipe.flows.pools import LAUNCH_FLOW
from k3pipe.flows.runtime import flow_job
from k3pipe.flows.secrecy import guard, scrubbed_flow
from k3pipe.jobs.launch import LaunchRequest, run_launch

__all__ = ["launch"]


@scrubbed_flow(LAUNCH_FLOW)
def launch(study_run_id: str, arm: str, launch: int = 1, launches: int = 1, pool: str = "") -> dict[str, Any]:
    """One launch of a study's arm on this node: the study's recorded experiment, overrides and
    prompts (verified by digest), this node's models, the arm's run nested under the study's. The
    study flow starts it on a pool (an experiment's ``fleet``); it fails when the launch did not
    finish, after recording it.

    Args:
        study_run_id: The study's MLflow run id.
        arm: The arm to launch (its name in the experiment; '<arm>-aa' for the A/A copy).
        launch: Which launch of the arm this is (from 1).
        launches: How many launches of the arm the study plans.
        pool: The work pool this node serves (recorded on the arm's run).
    """
    guard()
    outcome = run_launch(LaunchRequest(study_run_id, arm, launch, launches, pool), flow_job())
    if outcome.status != "FINISHED":
        raise RunFailedError(f"arm {arm} launch {launch}: {outcome.status}: {outcome.error or 'see its run'}")
    return outcome.as_dict()
