"""Exact reruns: rebuild an arm's run from its record alone, verify every input, compare the result.

:func:`restore` reads an arm's ``run_record.json`` (see :mod:`k3pipe.records.runrecord`) and gives back what
the flow needs to run that arm again: the experiment as recorded, the model files fetched again at the
recorded revision (or found on disk) and checked file by file against the recorded sha256, the image
pinned to the recorded digest, and the very prompts that were sent, checked against their digest. An
input that cannot be had exactly stops the rerun with a :class:`RerunError` that names it and says what
to do; with ``allow_drift`` the difference is recorded instead (``RunRecord.drift``).

:func:`verdict` compares each workload of the rerun with the original (``k3pipe compare``'s test).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3pipe.bench.repeats import Comparison, compare, judged
from k3pipe.core.errors import K3pipeError, RerunError
from k3pipe.core.layout import RECORD_FILE, RunTags
from k3pipe.core.secrets import REDACTED
from k3pipe.experiment.load import parse_experiment
from k3pipe.prompts.corpora import PromptSet
from k3pipe.records.compare import (
    DEFAULT_METRICS,
    compare_workloads,
    find_run,
    request_values,
    workload_priors,
)
from k3pipe.records.runrecord import RunRecord, prompts_digest
from k3pipe.records.tracking import Tracker
from k3pipe.report.collect import StudyData
from k3pipe.schema.specs import ExperimentSpec, LocalModel, ModelScopeModel
from k3pipe.sources import ModelRecord, changed_files, fetch_model, hub_files, recorded_dir, verify_dir
from k3pipe.verdicts.stats import Design, estimate, with_prior

__all__ = ["RerunInputs", "WorkloadVerdict", "read_record", "restore", "verdict", "verdict_rows"]

Progress = Callable[[str], None]


@dataclass
class RerunInputs:
    """What the flow runs again: one arm of the recorded experiment with its verified inputs."""

    run_id: str  # the original arm run
    record: RunRecord
    spec: ExperimentSpec  # the recorded experiment, its arm's image pinned to the recorded digest
    models: dict[str, ModelRecord]
    prompts: dict[str, list[PromptSet]]
    drift: list[str] = field(default_factory=list)


def arm_run(tracker: Tracker, run_ref: str) -> Any:
    """The arm's MLflow run for ``run_ref``: an arm run, or a workload or repeat run under one."""
    run = find_run(tracker, run_ref)
    for _ in range(2):  # repeat -> workload -> arm
        if not (RunTags.of(run).workload and run.data.tags.get("mlflow.parentRunId")):
            break
        run = tracker.client.get_run(run.data.tags["mlflow.parentRunId"])
    return run


def _download(tracker: Tracker, run_id: str, artifact: str) -> str | None:
    data = tracker.read_artifact(run_id, artifact)
    return None if data is None else data.decode()


def read_record(tracker: Tracker, run_id: str) -> RunRecord:
    text = _download(tracker, run_id, RECORD_FILE)
    if text is None:
        raise RerunError(
            f"run {run_id} has no {RECORD_FILE}: it is not an arm run, or it was made by a k3pipe that "
            "did not record runs as values yet; run its experiment again with `k3pipe run` instead"
        )
    try:
        return RunRecord.model_validate_json(text)
    except ValueError as exc:
        raise RerunError(f"run {run_id}: {RECORD_FILE} cannot be read ({exc}); it cannot be rerun") from exc


def _model_spec(spec: ExperimentSpec, name: str) -> ModelScopeModel | LocalModel:
    if name == "model":
        return spec.model
    if name not in spec.extra_models:
        raise RerunError(f"the record names model {name!r}, which its experiment does not declare")
    return spec.extra_models[name]


def _redacted_fields(data: Any, where: str) -> list[str]:
    """The fields under ``where`` whose recorded value is the scrubber's ``***`` (a secret that was
    written in the experiment)."""
    if isinstance(data, dict):
        return [f for k, v in data.items() for f in _redacted_fields(v, f"{where}.{k}")]
    if isinstance(data, list):
        return [f for i, v in enumerate(data) for f in _redacted_fields(v, f"{where}[{i}]")]
    return [where] if isinstance(data, str) and REDACTED in data else []


def _files_differ(recorded: ModelRecord, found: ModelRecord) -> list[str]:
    """What differs between two fingerprints of a model, file by file (at most 5 named)."""
    changed = sorted(f for f in recorded.files if f in found.files and found.files[f] != recorded.files[f])
    missing = sorted(f for f in recorded.files if f not in found.files)
    extra = sorted(f for f in found.files if f not in recorded.files)
    out = []
    for what, names in (("changed", changed), ("missing", missing), ("not in the record", extra)):
        if names:
            shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            out.append(f"{what}: {shown}")
    return out


def _restore_model(
    name: str,
    recorded: ModelRecord,
    model_spec: ModelScopeModel | LocalModel,
    home: Path,
    say: Progress,
    allow_drift: bool = False,
) -> tuple[ModelRecord, str | None]:
    """The model found again (its recorded content directory, verified) or fetched (at the recorded
    revision); a drift text when it differs. A ModelScope revision that moved since the record is
    found out from the hub's listing before anything is fetched: without ``allow_drift`` that is a
    :class:`RerunError` naming what moved, file by file."""
    if isinstance(model_spec, ModelScopeModel):
        kept = recorded_dir(recorded, home)
        if kept is not None and kept.is_dir():
            say(f"{name}: checking the recorded files in {kept}")
            bad = verify_dir(kept, recorded.files)
            if not bad:
                return recorded.model_copy(update={"path": str(kept.resolve()), "downloaded": False}), None
            say(f"{name}: {len(bad)} recorded file(s) differ in {kept} ({', '.join(bad[:5])})")
        if kept is not None:
            # a record of a content directory: the branch it was fetched from may have moved since
            requested = recorded.requested_revision or model_spec.revision
            model_spec = model_spec.model_copy(update={"revision": requested})
            try:
                now = hub_files(model_spec)
            except K3pipeError as exc:
                raise RerunError(
                    f"{name}: the recorded files are not on this machine ({kept}) and the hub cannot be "
                    f"asked for {model_spec.id}@{requested}: {exc}"
                ) from exc
            moved = changed_files(recorded.files, now)
            if moved and not allow_drift:
                raise RerunError(
                    f"{name}: {model_spec.id}@{requested} has moved since the recorded run ("
                    + "; ".join(moved)
                    + f"), and the recorded files are not on this machine ({kept}); nothing was "
                    f"fetched. Restore them there (digest {recorded.digest()[:16]}), or pass "
                    "--allow-drift to rerun on what the hub serves now (recorded as drift)"
                )
            say(f"{name}: fetching {model_spec.id}@{requested} and checking every file")
        else:
            revision = recorded.resolved_revision or recorded.requested_revision or model_spec.revision
            model_spec = model_spec.model_copy(update={"revision": revision})
            say(f"{name}: fetching {model_spec.id}@{revision} (the recorded revision), checking every file")
    else:
        say(f"{name}: checking every file of {model_spec.path} against the record")
    try:
        found = fetch_model(model_spec, home, say)
    except K3pipeError as exc:
        raise RerunError(
            f"{name}: the recorded model cannot be had again: {exc}. A rerun needs the same files "
            f"({len(recorded.files)} files, digest {recorded.digest()[:16]})"
        ) from exc
    differences = _files_differ(recorded, found)
    if not differences:
        return found, None
    where = found.path
    drift = f"{name} ({where}): " + "; ".join(differences)
    return found, drift


def restore(
    tracker: Tracker,
    run_ref: str,
    home: Path,
    allow_drift: bool = False,
    progress: Progress | None = None,
) -> RerunInputs:
    """Everything needed to run the arm of ``run_ref`` again, each input verified against its record.

    Raises:
        RerunError: the run has no record, or an input differs (unless ``allow_drift``) or cannot be
            had: the message names the input and says what to do.
    """
    say: Progress = progress or (lambda _msg: None)
    run = arm_run(tracker, run_ref)
    run_id = run.info.run_id
    record = read_record(tracker, run_id)
    spec = parse_experiment(record.experiment, f"{RECORD_FILE} of run {run_id}")
    arm = spec.arm(record.arm)
    engine = arm.engine
    redacted = _redacted_fields(engine.env, "engine.env") + _redacted_fields(engine.args, "engine.args")
    if redacted:
        raise RerunError(
            f"arm {record.arm!r} of run {run_id} was started with a secret written in its experiment "
            f"({', '.join(redacted)}), which its record holds as '{REDACTED}', so it cannot be started "
            "again from the record; write such a value as '{env.NAME}' (k3pipe reads NAME from its "
            "environment at launch) and run the experiment again with `k3pipe run`"
        )
    drift: list[str] = []

    models: dict[str, ModelRecord] = {}
    for name, recorded in record.models.items():
        found, differs = _restore_model(name, recorded, _model_spec(spec, name), home, say, allow_drift)
        if differs is not None:
            if not allow_drift:
                raise RerunError(
                    f"the model files differ from the recorded run's: {differs}. Restore the recorded "
                    "files (digest "
                    f"{recorded.digest()[:16]}; each file's sha256 is in provenance/{name}.json of run "
                    f"{run_id}), or pass --allow-drift to rerun on these files (recorded as drift)"
                )
            drift.append(differs)
        models[name] = found

    for unpinned in record.unpinned_models:
        differs = f"{unpinned} was loaded by the engine itself (not pinned, not hashed)"
        if not allow_drift:
            raise RerunError(
                f"arm {record.arm!r} cannot be rerun exactly: {differs}, so the recorded run cannot say "
                "which files it served. Declare that model under extra_models and reference it as "
                "'{models.NAME}' for runs that can be repeated, or pass --allow-drift to rerun with "
                "whatever the engine loads now (recorded as drift)"
            )
        drift.append(differs)

    if record.image is not None:
        arm = arm.model_copy(update={"engine": arm.engine.model_copy(update={"image": record.image.pinned})})
        say(f"image pinned to the recorded digest: {record.image.pinned}")
    spec = spec.model_copy(update={"arms": [arm]})

    prompts: dict[str, list[PromptSet]] = {}
    for workload in spec.workloads:
        sets = []
        for repeat in range(workload.repeats):
            ref = record.prompts_of(workload.name, repeat)
            where = f"workload {workload.name!r} repeat {repeat + 1}"
            if ref is None:
                raise RerunError(f"{where}: the record holds no prompts for it, so it cannot be sent again")
            text = _download(tracker, run_id, ref.artifact)
            if text is None:
                raise RerunError(f"{where}: the prompts artifact {ref.artifact} of run {run_id} is gone")
            prompt_set = PromptSet.model_validate(json.loads(text))
            if prompts_digest(prompt_set) != ref.sha256:
                raise RerunError(
                    f"{where}: the stored prompts ({ref.artifact}) do not match their recorded sha256 "
                    f"{ref.sha256[:16]}: the artifact was changed; it cannot be rerun exactly"
                )
            sets.append(prompt_set)
        prompts[workload.name] = sets
        say(f"{workload.name}: {sum(len(s.prompts) for s in sets)} recorded prompts, digests verified")
    return RerunInputs(run_id, record, spec, models, prompts, drift)


@dataclass
class WorkloadVerdict:
    workload: str
    original: str  # workload run ids
    rerun: str
    rows: list[Comparison]
    # "repeats" (one launch a side), "requests" (single runs, tested on their per-request figures),
    # or "launches" (a study's arm, every launch of it a side)
    basis: str = "repeats"
    # per-request figures that could not be tested, each with why (e.g. a TPOT of 0 on every request:
    # the tokens came in one burst, so the client saw no time between them)
    left_out: list[str] = field(default_factory=list)
    launches: str = ""
    """A study's arm: each side's whole repeats per launch ('3 + 3 against 3 + 3')."""
    arm: str = ""

    @property
    def summary(self) -> str:
        return self._verdict() + (f"; not tested: {'; '.join(self.left_out)}" if self.left_out else "")

    def _verdict(self) -> str:
        tested = [c for c in self.rows if c.outcome not in ("untested", "unknown")]
        where = "" if self.basis == "repeats" else " (single runs: over their requests, a rough test)"
        if not tested:
            if any(c.outcome == "unknown" for c in self.rows):
                return (
                    "cannot tell: restart noise unknown (each side is one launch, and no earlier study "
                    "kept the restart noise of this configuration on this node; a study with `launches: 2` "
                    "keeps it)"
                )
            return "no verdict: neither repeats nor per-request figures to test"
        different = [f"{c.metric} {c.change_text()}" for c in tested if c.different]
        if different:
            return "different: " + ", ".join(different) + where
        if all(c.outcome == "equivalent" for c in tested):
            return f"equivalent within +-{tested[0].margin:.0%} on every figure" + where
        parts = [f"{c.metric} {c.verdict()}" for c in tested]
        return "no difference shown: " + "; ".join(parts) + where


def verdict(tracker: Tracker, original_arm: str, rerun_arm: str) -> list[WorkloadVerdict]:
    """Each workload of the rerun against the original's: ``k3pipe compare``'s test, per metric."""
    a = {RunTags.of(c).workload: c for c in tracker.children(original_arm)}
    b = {RunTags.of(c).workload: c for c in tracker.children(rerun_arm)}
    out = []
    for name in sorted(k for k in a if k and k in b):
        rows = compare_workloads(tracker, a[name], b[name], DEFAULT_METRICS)
        basis, left_out = "repeats", list[str]()
        if not any(c.outcome != "untested" for c in rows):
            # single runs: their requests are the samples (per-request TTFT, TPOT, E2E), each run's
            # level moved by its launch: the restart noise of the figure's median stands for it
            ra, rb = request_values(tracker, a[name]), request_values(tracker, b[name])
            names, left_out = comparable_request_metrics(ra, rb)
            design = Design(tests=max(1, len(names)))
            pa, pb = workload_priors(tracker, [a[name], b[name]], [f"{m}_p50" for m in names])
            tested = [
                compare(f"{m} (per request)", ra[m], rb[m], design, pa.get(f"{m}_p50"), pb.get(f"{m}_p50"))
                for m in names
            ]
            if tested:
                rows, basis = tested + rows, "requests"
        out.append(WorkloadVerdict(name, a[name].info.run_id, b[name].info.run_id, rows, basis, left_out))
    return out


def comparable_request_metrics(
    a: dict[str, list[float]], b: dict[str, list[float]]
) -> tuple[list[str], list[str]]:
    """The per-request metrics both runs can be tested on (two or more positive values on each side:
    the test is on logarithms), and each one left out with why. A TPOT of 0 on every request is a
    real reading (the tokens came in one burst, as a loaded engine sends them), not a failure."""
    names, left_out = [], []
    for metric in a:
        if metric not in b:
            continue
        counts = [sum(1 for v in side[metric] if v > 0) for side in (a, b)]
        if min(counts) > 1:
            names.append(metric)
        elif max(len(a[metric]), len(b[metric])) > 1:
            left_out.append(
                f"{metric} per request (positive values: {counts[0]} in the original, {counts[1]} in the "
                "rerun; a test needs 2 on each side)"
            )
    return names, left_out


def study_verdicts(
    original: StudyData, again: StudyData, metrics: Sequence[str] = DEFAULT_METRICS
) -> list[WorkloadVerdict]:
    """A study's rerun against the original, arm by arm and workload by workload over all their
    launches (each side's cell as the report makes it: its launch means, restart noise in it from two
    launches or more, else a prior for a cell launched once), the ``metrics`` of a workload sharing
    alpha as ``k3pipe compare``'s do. Pairing launch with launch would judge one launch against one,
    which holds no restart noise."""
    out = []
    for cell in again.cells:
        before = original.cell(cell.arm, cell.workload)
        if before is None:
            continue
        pairs = []
        for m in metrics:
            ea, eb = estimate(before.by_launch(m)), estimate(cell.by_launch(m))
            if ea is not None and eb is not None:
                pairs.append((m, with_prior(ea, before.priors.get(m)), with_prior(eb, cell.priors.get(m))))
        design = Design(tests=max(1, len(pairs)))
        rows = [judged(m, ea, eb, design) for m, ea, eb in pairs]
        out.append(
            WorkloadVerdict(
                cell.workload, before.run_id, cell.run_id, rows, "launches",
                launches=f"{before.launches_text()} against {cell.launches_text()}", arm=cell.arm,
            )
        )  # fmt: skip
    return out


def verdict_rows(
    tracker: Tracker, original_arm: str, rerun_arm: str, say: Progress | None = None
) -> list[dict[str, Any]]:
    """:func:`verdict` as the rerun's outcome keeps it (one dict per workload), each said to ``say``."""
    out = []
    for v in verdict(tracker, original_arm, rerun_arm):
        if say is not None:
            say(f"rerun verdict, {v.workload}: {v.summary}")
        out.append(
            {
                "workload": v.workload,
                "verdict": v.summary,
                "original": v.original,
                "rerun": v.rerun,
                "metrics": [c.model_dump() for c in v.rows],
            }
        )
    return out
