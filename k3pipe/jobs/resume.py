"""Resuming a study: the launches that finished are kept, the others run, under the same study run.

A study outlives the command that started it only in its records: each launch of an arm is an arm
run under the study's run, tagged with its arm and launch (``k3pipe.launch``; 0 is a priming launch),
and the study's run holds the experiment as it ran (``experiment.json``, overrides laid over) and
its overrides (``override.*`` params). :func:`resume_point` reads where a study stands from those
alone: which launches finished, which did not, and the prompts the finished ones sent.

Finished launches are not run again. A launch that did not finish (interrupted, killed with its
command, failed) runs again on a new engine start, from its first workload that did not finish
cleanly: the workloads it finished with every repeat and no failed request are kept (their runs move
under the new launch's run, tagged :data:`KEPT_TAG`), the rest run. A workload is the smallest unit
kept: the verdicts take each workload's mean over a launch's repeats as one draw of the restart noise,
so its repeats must share one engine start, and a workload cut short is run again whole (a ladder:
kept once it ended, every point's run moved; run again from its first point otherwise). The earlier
arm run stays in MLflow tagged :data:`SUPERSEDED_TAG` (what else it measured kept, left out of the
report). A launch whose every workload finished but whose run was never closed (the command ended in
teardown) is run again whole: there is nothing left to measure on it, and a launch without its
engine's log and record is not one to keep. The study's prompts are drawn again from their seeds and
checked against the digests the earlier runs recorded (:func:`check_prompts`), so every launch
sends the very prompts the first command drew.

:func:`study_lock` is held by the command running a study: a second command cannot resume it while
the first still runs (on this ``K3PIPE_HOME``).
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3pipe.core.errors import K3pipeError
from k3pipe.core.layout import (
    ARM_TAG,
    EXPERIMENT_FILE,
    EXPERIMENT_TAG,
    KIND_TAG,
    LADDER_POINT_TAG,
    LADDER_PREFIX,
    LAUNCH_TAG,
    PRIME_TAG,
    RECORD_FILE,
    RESUMED_TAG,
    STAGE_PREFIX,
    STUDY_KIND,
    SUPERSEDED_TAG,
    RunTags,
)
from k3pipe.core.secrets import REDACTED, redact_data
from k3pipe.experiment.load import parse_experiment
from k3pipe.prompts.corpora import PromptSet
from k3pipe.records.compare import find_run
from k3pipe.records.runrecord import KeptWorkloads, RunRecord, prompts_artifact, prompts_digest
from k3pipe.records.tracking import Tracker
from k3pipe.schema.specs import ExperimentSpec

__all__ = [
    "KeptWorkloads",
    "ResumeError",
    "ResumePoint",
    "check_experiment",
    "check_prompts",
    "read_study",
    "reopen",
    "resume_point",
    "study_lock",
]

ARMS_PARAM = "study_arms"
"""The study run's param naming the arms it runs, in order (the arms asked for, or all)."""


class ResumeError(K3pipeError):
    """A study cannot be resumed (not a study, still running, its experiment or prompts differ)."""


@dataclass
class ResumePoint:
    """Where a recorded study stands: its experiment and arms as it ran, what finished, what did not."""

    run_id: str
    name: str
    status: str
    spec: ExperimentSpec
    arms: list[str]
    params: dict[str, str]
    """The study's overrides (``override.*``), given to every arm run it starts."""
    experiment_file: str = ""
    """Where the study's experiment came from (its ``experiment_file`` param)."""
    done: dict[tuple[str, int], str] = field(default_factory=dict)
    """(arm, launch) -> the arm run of a launch that finished (launch 0: a priming launch)."""
    unfinished: list[Any] = field(default_factory=list)
    """The arm runs of launches that did not finish and were not superseded yet."""
    kept: dict[tuple[str, int], KeptWorkloads] = field(default_factory=dict)
    """(arm, launch) of an unfinished launch -> the workloads it finished cleanly, kept by the resume."""
    prompts: dict[tuple[str, int], str] = field(default_factory=dict)
    """(workload, repeat) -> the sha256 of the prompts the earlier launches sent."""
    stages: dict[str, float] = field(default_factory=dict)
    """The study run's ``stage.*`` metrics so far."""
    wall_s: float = 0.0
    """The study's wall time so far, as its run recorded it (0: never recorded, a killed command)."""
    resumes: int = 0

    def summary(self) -> str:
        done = sorted(k for k in self.done if k[1] > 0)
        again = sorted({_launch(r) for r in self.unfinished})
        text = f"study {self.name} (MLflow run {self.run_id}, {self.status}): {len(done)} launch(es) finished"
        whole = [f"{a}#{k}" for a, k in again if (a, k) not in self.kept]
        partly = [
            f"{a}#{k} (keeping {', '.join(self.kept[(a, k)].workloads)})"
            for a, k in again
            if (a, k) in self.kept
        ]
        if partly:
            text += "; run again from the first unfinished workload: " + ", ".join(partly)
        if whole:
            text += "; run again whole: " + ", ".join(whole)
        return text


def _launch(run: Any) -> tuple[str, int]:
    tags = run.data.tags
    launch = 0 if tags.get(PRIME_TAG) else int(tags.get(LAUNCH_TAG, "1"))
    return tags[ARM_TAG], launch


def _record(tracker: Tracker, run_id: str) -> RunRecord | None:
    data = tracker.read_artifact(run_id, RECORD_FILE)
    if data is None:
        return None
    try:
        return RunRecord.model_validate_json(data)
    except ValueError:
        return None


def _redacted(data: Any, where: str) -> list[str]:
    if isinstance(data, dict):
        return [f for k, v in data.items() for f in _redacted(v, f"{where}.{k}")]
    if isinstance(data, list):
        return [f for i, v in enumerate(data) for f in _redacted(v, f"{where}[{i}]")]
    return [where] if isinstance(data, str) and REDACTED in data else []


def read_study(tracker: Tracker, run_ref: str, what: str = "resumed") -> tuple[Any, ExperimentSpec]:
    """A study's run (its id, or a unique prefix) and the experiment it recorded, as it can be
    started again; a :class:`ResumeError` saying why it cannot be ``what`` (not a study's run, no
    experiment.json, a secret written in it and recorded as ``***``)."""
    run = find_run(tracker, run_ref)
    run_id = run.info.run_id
    tags = run.data.tags
    if tags.get(KIND_TAG) != STUDY_KIND:
        raise ResumeError(
            f"run {run_id} is not a study's run (tag k3pipe.kind is {tags.get(KIND_TAG)!r}): give the "
            "study run id `k3pipe study` printed (`k3pipe runs` lists them)"
        )
    name = tags.get(EXPERIMENT_TAG, run.info.run_name)
    raw = tracker.read_artifact(run_id, EXPERIMENT_FILE)
    if raw is None:
        raise ResumeError(f"study {name} (run {run_id}) has no experiment.json: it cannot be {what}")
    import json

    data = json.loads(raw)
    redacted = _redacted(data, "experiment")
    if redacted:
        raise ResumeError(
            f"study {name} (run {run_id}) was started with a secret written in its experiment "
            f"({', '.join(redacted[:3])}), recorded as '{REDACTED}', so it cannot be started again from "
            "its record; write such a value as '{env.NAME}' (read from the environment at launch)"
        )
    return run, parse_experiment(data, f"experiment.json of study run {run_id}")


def resume_point(tracker: Tracker, run_ref: str) -> ResumePoint:
    """Where the study ``run_ref`` (its run id, or a unique prefix) stands.

    Raises:
        ResumeError: it is not a study's run, its experiment cannot be read back or holds a secret
            written in it (recorded as ``***``), or it has nothing left to run.
    """
    run, spec = read_study(tracker, run_ref)
    run_id = run.info.run_id
    tags = run.data.tags
    name = tags.get(EXPERIMENT_TAG, run.info.run_name)
    params = dict(run.data.params)
    arms = str(params.get(ARMS_PARAM) or params.get("arms") or "").split(",")
    point = ResumePoint(
        run_id=run_id,
        name=name,
        status=run.info.status,
        spec=spec,
        arms=[a for a in arms if a],
        params={k: v for k, v in params.items() if k.startswith("override.")},
        experiment_file=params.get("experiment_file", ""),
        stages={k: v for k, v in run.data.metrics.items() if k.startswith(STAGE_PREFIX)},
        wall_s=float(run.data.metrics.get("study.wall_s", 0.0)),
        resumes=int(tags.get(RESUMED_TAG, "0")),
    )
    for arm_run in sorted(tracker.children(run_id), key=lambda r: r.info.start_time):
        if not RunTags.of(arm_run).arm or RunTags.of(arm_run).superseded:
            continue
        key = _launch(arm_run)
        if arm_run.info.status == "FINISHED":
            point.done[key] = arm_run.info.run_id
            if not point.prompts and key[1] > 0:
                record = _record(tracker, arm_run.info.run_id)
                if record is not None:
                    point.prompts = {(p.workload, p.repeat): p.sha256 for p in record.prompts}
        else:
            point.unfinished.append(arm_run)
            finished = _finished_workloads(tracker, arm_run, spec)
            if finished is not None:
                point.kept[key] = finished
    for kept in point.kept.values():
        _recorded_prompts(tracker, kept.arm_run_id, spec, point.prompts)
    return point


def _finished_workloads(tracker: Tracker, arm_run: Any, spec: ExperimentSpec) -> KeptWorkloads | None:
    """The leading workloads of an unfinished launch that finished with every repeat and without a
    failed request, in the experiment's order (a ladder: once it ended, every point clean); None when
    none did, or when all did (the launch then runs again whole: see the module's docstring)."""
    clean: dict[str, Any] = {}
    rungs: dict[str, list[Any]] = {}
    for run in tracker.children(arm_run.info.run_id):
        name = RunTags.of(run).workload
        ok = run.info.status == "FINISHED" and not run.data.metrics.get("failed")
        ladder = RunTags.of(run).ladder
        if ladder:
            rungs.setdefault(ladder, []).append(run if ok else None)
        elif name and ok:
            clean[name] = run
    kept: dict[str, str] = {}
    ladders: dict[str, str] = {}
    for workload in spec.workloads:
        if workload.ladder is not None:
            summary = arm_run.data.tags.get(f"{LADDER_PREFIX}{workload.name}")
            points = rungs.get(workload.name, [])
            if not summary or not points or any(r is None or not _all_repeats(r, workload) for r in points):
                break  # a ladder that did not end (its summary is logged last), or a point not clean
            points.sort(key=lambda r: float(r.data.tags[LADDER_POINT_TAG]))
            kept[workload.name] = ",".join(r.info.run_id for r in points)
            ladders[workload.name] = summary
            continue
        run = clean.get(workload.name)
        if run is None or not _all_repeats(run, workload):
            break  # the workloads run in order: the first one missing is where the launch goes on
        kept[workload.name] = run.info.run_id
    if not kept or len(kept) == len(spec.workloads):
        return None
    return KeptWorkloads(arm_run.info.run_id, kept, ladders)


def _all_repeats(run: Any, workload: Any) -> bool:
    return bool(workload.repeats == 1 or run.data.metrics.get("repeats", 0) >= workload.repeats)


def _recorded_prompts(
    tracker: Tracker, arm_run_id: str, spec: ExperimentSpec, into: dict[tuple[str, int], str]
) -> None:
    """The digests of the prompts an arm run logged at its launch (one artifact per workload repeat),
    for the repeats ``into`` lacks: a study whose command was killed before any launch finished has
    no record but these."""
    for workload in spec.workloads:
        for repeat in range(workload.repeats):
            if (workload.name, repeat) in into:
                continue
            raw = tracker.read_artifact(arm_run_id, prompts_artifact(workload.name, repeat))
            if raw is None:
                continue
            with contextlib.suppress(ValueError):
                into[(workload.name, repeat)] = prompts_digest(PromptSet.model_validate_json(raw))


def check_experiment(point: ResumePoint, spec: ExperimentSpec, source: str) -> None:
    """``spec`` (from ``source``, overrides laid over) is the experiment the study ran, or a
    :class:`ResumeError` naming the first fields that differ."""
    recorded = redact_data(point.spec.model_dump(mode="json"))
    given = redact_data(spec.model_dump(mode="json"))
    if recorded == given:
        return
    differ = _differences(recorded, given, "")
    raise ResumeError(
        f"{source} is not the experiment study {point.name} (run {point.run_id}) ran: "
        + "; ".join(differ[:5])
        + (f" and {len(differ) - 5} more" if len(differ) > 5 else "")
        + ". Resume without the file (the study's own experiment is used), or start a new study"
    )


def _differences(a: Any, b: Any, where: str) -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [
            f
            for k in sorted(set(a) | set(b))
            for f in _differences(a.get(k), b.get(k), f"{where}.{k}".lstrip("."))
        ]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [
            f for i, (x, y) in enumerate(zip(a, b, strict=True)) for f in _differences(x, y, f"{where}[{i}]")
        ]
    return [] if a == b else [f"{where or 'experiment'} was {a!r}, is {b!r}"]


def check_prompts(point: ResumePoint, prompts: Mapping[str, list[PromptSet]]) -> None:
    """The prompts drawn again are the ones the finished launches sent (their recorded digests), or a
    :class:`ResumeError` naming the first workload repeat that differs."""
    for (workload, repeat), recorded in sorted(point.prompts.items()):
        sets = prompts.get(workload, [])
        if repeat >= len(sets):
            continue
        drawn = prompts_digest(sets[repeat])
        if drawn != recorded:
            raise ResumeError(
                f"the prompts of workload {workload!r} repeat {repeat + 1} drawn again differ from those "
                f"study {point.name} sent (sha256 {drawn[:16]} against {recorded[:16]}): its dataset or "
                "the model's tokenizer changed since. Restore them, or start a new study"
            )


def reopen(tracker: Tracker, point: ResumePoint) -> None:
    """The study's run open again (RUNNING), counted as resumed; each unfinished launch's arm run
    tagged superseded (an arm run still RUNNING, whose command was killed, is closed as KILLED)."""
    for arm_run in point.unfinished:
        arm, launch = _launch(arm_run)
        if arm_run.info.status == "RUNNING":
            tracker.end_run(arm_run.info.run_id, "KILLED")
        kept = point.kept.get((arm, launch))
        how = (
            f"ran again by resume {point.resumes + 1} from its first unfinished workload; the workloads it "
            f"had finished ({', '.join(kept.workloads)}) moved under the new run"
            if kept
            else f"ran again whole by resume {point.resumes + 1}"
        )
        tracker.set_tags(arm_run.info.run_id, {SUPERSEDED_TAG: f"launch {launch} of arm {arm} {how}"})
    tracker.client.update_run(tracker.mlflow_id(point.run_id), status="RUNNING")
    tracker.set_tags(point.run_id, {RESUMED_TAG: str(point.resumes + 1)})


@contextlib.contextmanager
def study_lock(home: Path, run_id: str) -> Iterator[None]:
    """Held while a command runs the study ``run_id`` on ``home``; a :class:`ResumeError` at once
    when another process holds it (that study is still running). Released when the holder dies."""
    path = home / "run" / "studies" / f"{run_id}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ResumeError(
                f"study run {run_id} is still running in another k3pipe process on this K3PIPE_HOME "
                f"({home}): wait for it to end, or stop it (Ctrl-C), then resume"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
