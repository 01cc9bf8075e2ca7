"""One launch of a study on the node that runs it (a fleet's pool: ``flows/fleet.py`` is its Prefect
shell): the experiment and overrides the study recorded, the prompts it drew (read from its run and
verified by digest, never drawn again), the models fetched into this node's K3PIPE_HOME, and the
arm's lifetime nested under the study's run, tagged with the node that ran it.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

from k3pipe.core.layout import LAUNCH_TAG, LAUNCHES_TAG, NODE_TAG, POOL_TAG
from k3pipe.jobs.arm_run import ArmOutcome, ArmRun
from k3pipe.jobs.fleet import Heartbeat, read_study_prompts
from k3pipe.jobs.prepare import prepare
from k3pipe.jobs.resume import read_study
from k3pipe.jobs.steps import Job
from k3pipe.schema.schedule import models_of
from k3pipe.schema.specs import ExperimentSpec

__all__ = ["LaunchRequest", "run_launch"]


@dataclass(frozen=True)
class LaunchRequest:
    """Launch ``launch`` (of ``launches``) of arm ``arm`` of the study ``study_run_id``, on ``pool``."""

    study_run_id: str
    arm: str
    launch: int = 1
    launches: int = 1
    pool: str = ""


def run_launch(request: LaunchRequest, job: Job) -> ArmOutcome:
    """The launch, run here: its arm run nested under the study's, tagged with this node and pool.
    Raises what reading the study or its prompts raises (the arm then has no run: the caller records
    it failed); a failure of the arm itself is in the outcome, recorded, as in any study."""
    tracker = job.tracker
    run, spec = read_study(tracker, request.study_run_id, "run on a node")
    study_run_id = run.info.run_id
    beat = spec.fleet.heartbeat_s if spec.fleet is not None else 15.0
    with Heartbeat(tracker, study_run_id, request.arm, request.launch, beat):
        return _run_launch(request, job, run, spec)


def _run_launch(request: LaunchRequest, job: Job, run: Any, spec: ExperimentSpec) -> ArmOutcome:
    tracker, study_run_id = job.tracker, run.info.run_id
    arm = spec.arm(request.arm)  # a SpecError names the study's arms
    params = {k: v for k, v in run.data.params.items() if k.startswith("override.")}
    prompts = read_study_prompts(tracker, study_run_id, spec)
    node = socket.gethostname()
    tags = {
        **job.tags,
        LAUNCH_TAG: str(request.launch),
        LAUNCHES_TAG: str(request.launches),
        NODE_TAG: node,
        POOL_TAG: request.pool,
    }
    job.say(
        "study %s: arm %s launch %d on node %s (pool %s)",
        spec.name, request.arm, request.launch, node, request.pool or "-",
    )  # fmt: skip
    prepared = prepare(
        spec, [request.arm], tracker, job.home, job.steps.prepare, tags=tags, parent_id=study_run_id,
        prompts=prompts, extra_models=False,
    )  # fmt: skip
    models = dict(prepared.models)
    for name in models_of(arm):
        if name not in models and name in spec.extra_models:
            models[name] = job.steps.prepare.fetch_model(name, spec.extra_models[name], job.home)
    run_ = ArmRun(
        spec, request.arm, models, prompts, tracker, job.settings, prepared.findings,
        run.data.params.get("experiment_file", ""), job.steps.arm, tags=tags, labels=dict(job.labels),
        params=params, parent_run_id=study_run_id, say=job.say, warn=job.warn,
    )  # fmt: skip
    outcome = run_.execute()
    outcome.launch = request.launch
    return outcome
