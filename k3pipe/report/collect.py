"""A study as MLflow holds it, read back: the study's run, each arm nested under it, each arm's
workloads with their per-repeat values, and what the arm's own run says (cold start, engine log,
speculation, findings). Nothing here needs the experiment file or the machine the study ran on."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pandas as pd
from pydantic import BaseModel, Field

from k3pipe.core.errors import ArtifactMissingError, TrackingError
from k3pipe.core.layout import (
    ABORTED_TAG,
    ACCURACY_FILE,
    ANSWERS_FILE,
    ARM_TAG,
    CAPACITY_FILE,
    CLIENT_TIMING_TAG,
    DECISION_ALPHA_TAG,
    DECISION_LOOK_TAG,
    DECISION_LOOKS_TAG,
    DECISION_STOPPED_TAG,
    ENGINE_TAG,
    ENGINE_WARNINGS_TAG,
    ERROR_TAG,
    EXPERIMENT_FILE,
    EXPERIMENT_TAG,
    KEPT_WORKLOADS_TAG,
    LADDER_POINT_TAG,
    LADDER_PREFIX,
    LAUNCH_TAG,
    LOSSLESS_TAG,
    NODE_MISMATCH_TAG,
    PREFIX_CACHE_RESET_TAG,
    PREFLIGHT_FILE,
    REPEAT_TAG,
    REPEATS_FRAME_FILE,
    REQUESTS_FILE,
    RESUMED_TAG,
    STRUCTURED_FILE,
    STUDY_KIND,
    TUNE_FILE,
    TUNE_OUTCOME_TAG,
    TWIN_TAG,
    RunTags,
    stage_times,
)
from k3pipe.machine.cost import counted_label
from k3pipe.machine.node import hardware_label
from k3pipe.records.compare import find_run, workload_values
from k3pipe.records.priors import (
    DEFAULT_PRIOR_DAYS,
    CellClass,
    cell_class,
    find_priors,
    model_identity,
    node_of,
    workload_shape,
)
from k3pipe.records.tracking import Tracker
from k3pipe.schema.specs import CALIBRATION_SUFFIX
from k3pipe.verdicts.stats import RestartPrior

__all__ = [
    "ArmData",
    "ArmGpusData",
    "CellData",
    "LaunchPart",
    "StudyData",
    "cell_class_of",
    "collect",
    "requests_frame",
]


class LaunchPart(BaseModel):
    """What one launch of an arm completed of one workload. A launch enters a cell's figures (its
    verdicts, noise and calibration) only when its repeats are whole: every planned repeat ran to its
    end. A launch cut short (a deadline, an interrupt, the engine lost) keeps its record in MLflow and
    is named in the report; a repeat that ended early (tagged ``k3pipe.aborted``) is never a value."""

    launch: int
    status: str = Field(description="The arm run's status (FINISHED, FAILED, KILLED).")
    whole: int = Field(description="Repeats that ran to their end (none of their requests aborted).")
    planned: int = Field(description="Repeats the workload planned.")
    cut: list[str] = Field(
        default_factory=list, description="What was left out: each aborted repeat, and why it ended."
    )

    @property
    def counted(self) -> bool:
        """Its repeats are whole: it enters the cell's figures."""
        return self.whole >= self.planned > 0

    def text(self) -> str:
        """'3', or '1 cut' (a launch whose repeats are not whole: what it completed, marked)."""
        return str(self.whole) if self.counted else f"{self.whole} cut"


class CellData(BaseModel):
    """One arm on one workload: the per-repeat value of every metric it recorded."""

    arm: str
    engine: str
    workload: str
    input_tokens: int
    output_tokens: int
    concurrency: int
    run_id: str
    status: str
    values: dict[str, list[float]] = Field(
        description="metric -> its value in each repeat, every launch's repeats one after another."
    )
    request_runs: list[str] = Field(
        default_factory=list, description="The runs holding this cell's requests.parquet (one per repeat)."
    )
    launch_values: list[dict[str, list[float]]] = Field(
        default_factory=list,
        description="Per counted launch of the arm (in launch order): metric -> its value in each repeat.",
    )
    parts: list[LaunchPart] = Field(
        default_factory=list,
        description="Every launch of the arm that recorded this workload, counted or not (LaunchPart).",
    )
    shape_key: str = Field(
        default="",
        description="The workload's shape as restart-noise classes hold it (k3pipe.records.priors).",
    )
    priors: dict[str, RestartPrior] = Field(
        default_factory=dict,
        description="Metric -> the restart noise earlier studies measured for this cell's configuration "
        "class on its node (k3pipe.records.priors); looked up for an arm launched once.",
    )
    load: str = "concurrency"
    rate_rps: float | None = None
    trace: str | None = Field(default=None, description="The trace file the workload replayed (its path).")
    trace_speed: float | None = None
    dataset: str = "random"
    ladder: str | None = Field(default=None, description="The ladder this cell is a point of (its workload).")
    ladder_point: float | None = Field(default=None, description="Its load on the ladder.")
    capacity: str | None = Field(
        default=None,
        description="A capacity search's range ('rate 0.1-100 req/s', 'concurrency 1-256 streams'); "
        "None: one load point.",
    )
    prefix_cache_reset: str | None = Field(
        default=None,
        description="A ladder point or capacity search: '1' the prefix cache was emptied before it (every "
        "probe), '0' not (before some), 'off' the workload said not to; None: neither.",
    )
    searches: list[dict[str, Any]] = Field(
        default_factory=list,
        description="A capacity search's answer per repeat (every launch's in turn), as its "
        "capacity.json holds it: capacity, failed_at, censored, converged, binding, cliff, probes.",
    )
    slo: dict[str, float] = Field(
        default_factory=dict, description="The workload's objectives (ttft_ms, tpot_ms, e2e_ms) it set."
    )
    attainment_pct: float | None = Field(
        default=None, description="A capacity search: the share of requests a passing probe met the SLO with."
    )

    def mean(self, metric: str) -> float | None:
        v = self.values.get(metric)
        return sum(v) / len(v) if v else None

    def by_launch(self, metric: str) -> list[list[float]]:
        """The metric's repeat values per launch (one list when the arm was launched once)."""
        launches = self.launch_values or [self.values]
        return [list(v[metric]) for v in launches if v.get(metric)]

    @property
    def launches(self) -> int:
        return max(1, len(self.launch_values))

    @property
    def cut(self) -> list[LaunchPart]:
        """The launches of this cell whose repeats are not whole (left out of its figures)."""
        return [p for p in self.parts if not p.counted]

    def launches_text(self) -> str:
        """Whole repeats per launch, in launch order: '3 + 3 + 1 cut'."""
        return " + ".join(p.text() for p in self.parts) or "-"

    def add_launch(self, other: CellData) -> None:
        """Merge the same arm's cell of a further launch into this one (a launch that is not counted
        adds its part, never its values)."""
        self.parts.extend(other.parts)
        if other.parts and not all(p.counted for p in other.parts):
            if other.status != "FINISHED":
                self.status = other.status
            return
        if not self.values:  # every earlier launch was cut: this one is the first counted
            self.values = {k: list(v) for k, v in other.values.items()}
            self.request_runs = list(other.request_runs)
            self.searches = list(other.searches)
            self.status = other.status
            return
        if not self.launch_values:
            self.launch_values = [{k: list(v) for k, v in self.values.items()}]
        self.launch_values.append({k: list(v) for k, v in other.values.items()})
        for key, values in other.values.items():
            self.values.setdefault(key, []).extend(values)
        self.request_runs.extend(other.request_runs)
        self.searches.extend(other.searches)
        if other.status != "FINISHED":
            self.status = other.status
        if other.prefix_cache_reset == "0":
            self.prefix_cache_reset = "0"

    @property
    def shape(self) -> tuple[int, str, str, float | None, str]:
        """Everything that defines the workload but its input length: cells of one shape differ in
        input length alone, so they can be compared along it."""
        return (
            self.output_tokens,
            self.load if self.capacity is None else f"{self.load} ({self.capacity})",
            self.dataset,
            self.rate_rps,
            f"c{self.concurrency}",
        )

    @property
    def load_label(self) -> str:
        """How the cell's requests were sent, in words."""
        if self.trace is not None:
            return f"the trace {Path(self.trace).name} replayed at {self.trace_speed or 1:g}x"
        if self.capacity is not None:
            return f"{self.load}, capacity search over {self.capacity}"
        if self.load == "concurrency":
            return f"concurrency {self.concurrency}"
        return f"{self.load} at {self.rate_rps:g} req/s" if self.rate_rps else self.load


class ArmGpusData(BaseModel):
    """The GPUs an arm's energy and per-GPU figures count, as its run recorded them (``gpus.*``)."""

    count: int | None = Field(default=None, description="The arm's GPUs (per GPU, cost); None: unknown.")
    counted: list[int] | None = Field(
        default=None, description="The nvidia-smi indexes its energy sums; None: the node's every GPU."
    )
    basis: str = Field(default="node-wide", description="How they were decided (gpus.basis).")
    node: int | None = Field(default=None, description="The GPUs nvidia-smi listed (node.gpu_count).")


class ArmData(BaseModel):
    """An arm's own run: how it ended, its cold start and what its engine said."""

    name: str
    engine: str
    run_id: str
    status: str
    launch: int = Field(default=1, description="Which launch of the arm this run is (from 1).")
    error: str | None = None
    cold_start_s: float | None = None
    phases: dict[str, float] = Field(default_factory=dict, description="cold-start phase -> seconds.")
    log_decode_mean_tps: float | None = Field(default=None, description="Engine log: mean decode tok/s.")
    log_decode_max_tps: float | None = None
    log_spec_accept_length: float | None = None
    warnings: list[str] = Field(default_factory=list, description="Warnings the engine log holds.")
    node_mismatch: list[str] = Field(
        default_factory=list,
        description="Where the experiment's hardware: is not the node nvidia-smi showed.",
    )
    findings: list[dict[str, Any]] = Field(default_factory=list, description="Preflight findings.")
    ladders: dict[str, str] = Field(
        default_factory=dict,
        description="Ladder workload -> how it ran on this launch ('points c1, c8, c64', 'ended at c16, "
        "past saturation ...'), from the arm run's k3pipe.ladder.<name> tags.",
    )
    stages: dict[str, float] = Field(default_factory=dict, description="Study stage -> seconds.")
    hardware: str | None = Field(
        default=None,
        description="The node's GPUs as the launch recorded them ('8 x NVIDIA H200, driver 580.159.04'); "
        "None: no GPU facts (no nvidia-smi, an external endpoint).",
    )
    model: str | None = Field(
        default=None, description="The served model: its ModelScope id, or 'local <directory>'."
    )
    node: str | None = Field(
        default=None,
        description=(
            "The node as restart noise is kept for it (k3pipe.records.priors): its GPUs, else its host name."
        ),
    )
    gpus: ArmGpusData | None = Field(
        default=None, description="The GPUs the arm held (None: a run recorded before gpus.* params)."
    )
    accuracy: dict[str, Any] | None = Field(
        default=None,
        description="The launch's accuracy set (accuracy.json, k3pipe.bench.accuracy), if asked.",
    )
    structured: dict[str, Any] | None = Field(
        default=None,
        description="The launch's tool-calling check (structured.json, k3pipe.bench.structured); None: "
        "the arm has no tool-call or reasoning parser, or no answers: section.",
    )
    lossless: str | None = Field(
        default=None, description="A setting that must not change greedy tokens (speculation), if any."
    )
    twin: str | None = Field(default=None, description="The plain arm that setting is checked against.")
    answers: dict[str, Any] | None = Field(
        default=None,
        description="The launch's output probe (answers.json, k3pipe.bench.probe.ProbeRecord's JSON); None: "
        "the experiment had no answers: section, or the launch ended before its probe.",
    )


class StudyData(BaseModel):
    """Everything the report is made of."""

    run_id: str
    name: str
    status: str
    arms: list[ArmData]
    cells: list[CellData]
    metrics: dict[str, float] = Field(default_factory=dict, description="The study run's own metrics.")
    primed: list[ArmData] = Field(
        default_factory=list,
        description="The priming launches (decision.prime): each arm's launch 0, kept out of arms and cells.",
    )
    primed_cells: list[CellData] = Field(
        default_factory=list, description="What each priming launch measured (one repeat per workload)."
    )
    reference: dict[str, Any] | None = Field(
        default=None, description="The experiment's 'reference' (a published table to show beside), if any."
    )
    decision: dict[str, Any] = Field(
        default_factory=dict, description="The experiment's 'decision' (metrics, alpha, margin ...), if any."
    )
    look: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "Where a study that added launches (decision.until) stopped: look, looks, alpha (this look's "
            "share of the family-wise error rate) and why it stopped."
        ),
    )
    resumed: int = Field(
        default=0, description="How many times the study was resumed (k3pipe study --resume)."
    )
    superseded: int = Field(
        default=0, description="Arm runs of unfinished launches a resume ran again (not in the report)."
    )
    gpus: int | None = Field(
        default=None,
        description="The experiment's hardware.gpu_count: per-GPU figures of an arm whose own is unknown.",
    )
    answers: dict[str, Any] | None = Field(
        default=None, description="The experiment's answers: (the output probe's settings), if any."
    )
    tune: dict[str, Any] | None = Field(
        default=None,
        description="A search's result (tune.json: outcome, leader, each candidate's settings and fate).",
    )
    kept_workloads: int = Field(
        default=0,
        description="Workloads such a launch had finished cleanly, kept by the resume (measured on the "
        "earlier engine start, their runs moved under the launch's new run).",
    )

    def per_gpu(self, arm: str) -> tuple[int, str]:
        """What ``arm``'s per-GPU figures divide by, and what its energy and per-GPU figures count in
        words ('GPUs 0,1 of 8', 'node-wide: 8 GPUs'): its own GPU count where its run recorded one,
        else the experiment's hardware.gpu_count, else the node's, else 1 (said so)."""
        first = next((a for a in self.arms + self.primed if a.name == arm), None)
        own = first.gpus if first is not None else None
        if own is not None and own.count is not None and own.basis != "node-wide":
            label = counted_label(own.count, own.counted, own.basis, own.node, self.gpus)
            # an engine that holds no GPU (CUDA_VISIBLE_DEVICES=''): its figures are the engine's
            return (own.count, label) if own.count else (1, f"{label}: per engine, not per GPU")
        n = self.gpus or (own.node if own is not None else None)
        if not n:
            return 1, "1 GPU assumed (no hardware given)"
        return n, counted_label(None, None, None, None, n)

    def cell(self, arm: str, workload: str) -> CellData | None:
        return next((c for c in self.cells if c.arm == arm and c.workload == workload), None)

    @property
    def arm_names(self) -> list[str]:
        """Each arm once, in the order its first launch ran."""
        return list(dict.fromkeys(a.name for a in self.arms))

    def launches_of(self, arm: str) -> list[ArmData]:
        return [a for a in self.arms if a.name == arm]

    def label(self, arm: ArmData) -> str:
        """The arm's name, with its launch ('a #2') when the arm was launched more than once."""
        return arm.name if len(self.launches_of(arm.name)) < 2 else f"{arm.name} #{arm.launch}"

    @property
    def calibration(self) -> tuple[str, str] | None:
        """(baseline arm, its A/A copy) when the study ran an A/A calibration."""
        if not self.decision.get("calibration"):
            return None
        names = set(self.arm_names)
        for name in self.arm_names:
            if name.endswith(CALIBRATION_SUFFIX) and name.removesuffix(CALIBRATION_SUFFIX) in names:
                return (name.removesuffix(CALIBRATION_SUFFIX), name)
        return None

    def cell_of(self, workload: str) -> CellData:
        """Any arm's cell of ``workload`` (what the workload is: its lengths, load, concurrency)."""
        return next(c for c in self.cells if c.workload == workload)

    def workloads(self) -> list[str]:
        """Workload names, shortest input first (the order of the study's table)."""
        seen: dict[str, int] = {}
        for c in self.cells:
            seen.setdefault(c.workload, c.input_tokens)
        return sorted(seen, key=lambda w: (seen[w], w))


def _int(params: dict[str, str], key: str) -> int:
    try:
        return int(float(params.get(key, "0")))
    except ValueError:
        return 0


def _float(params: dict[str, str], key: str) -> float | None:
    try:
        return float(params[key])
    except (KeyError, ValueError):
        return None


def _gpus(params: dict[str, str]) -> ArmGpusData | None:
    """The arm's ``gpus.*`` params (None: none recorded)."""
    if "gpus.basis" not in params:
        return None
    counted = params.get("gpus.counted", "node-wide")
    count = _float(params, "gpus.count")
    node = _float(params, "node.gpu_count")
    return ArmGpusData(
        count=int(count) if count is not None else None,
        counted=[int(i) for i in counted.split(",") if i] if counted != "node-wide" else None,
        basis=params["gpus.basis"],
        node=int(node) if node is not None else None,
    )


def _values(tracker: Tracker, run: Any) -> dict[str, list[float]]:
    # a workload of repeats must have its repeats.json read, never its means taken for one repeat
    return workload_values(tracker, run)


def _arm(tracker: Tracker, run: Any) -> ArmData:
    tags, metrics, params = run.data.tags, run.data.metrics, run.data.params
    hardware = hardware_label(params)
    findings_text = tracker.read_artifact(run.info.run_id, PREFLIGHT_FILE)
    warnings = [w.strip() for w in tags.get(ENGINE_WARNINGS_TAG, "").split(" | ") if w.strip()]
    return ArmData(
        hardware=hardware,
        model=model_identity(params),
        node=node_of(params),
        gpus=_gpus(run.data.params),
        name=tags.get(ARM_TAG, run.info.run_name),
        engine=tags.get(ENGINE_TAG, "?"),
        run_id=run.info.run_id,
        status=run.info.status,
        launch=int(tags.get(LAUNCH_TAG, "1")),
        error=tags.get(ERROR_TAG),
        cold_start_s=metrics.get("cold_start_s"),
        phases={
            k.removeprefix("cold_start.").removesuffix("_s"): v
            for k, v in metrics.items()
            if k.startswith("cold_start.") and k.endswith("_s")
        },
        log_decode_mean_tps=metrics.get("engine_log.decode_throughput_mean_tps"),
        log_decode_max_tps=metrics.get("engine_log.decode_throughput_max_tps"),
        log_spec_accept_length=metrics.get("engine_log.spec_accept_length_mean"),
        warnings=warnings,
        node_mismatch=[w for w in tags.get(NODE_MISMATCH_TAG, "").split(" | ") if w],
        findings=json.loads(findings_text) if findings_text else [],
        ladders={k.removeprefix(LADDER_PREFIX): v for k, v in tags.items() if k.startswith(LADDER_PREFIX)},
        accuracy=_json((tracker.read_artifact(run.info.run_id, ACCURACY_FILE) or b"").decode() or None)
        or None,
        structured=_json((tracker.read_artifact(run.info.run_id, STRUCTURED_FILE) or b"").decode() or None)
        or None,
        lossless=tags.get(LOSSLESS_TAG),
        twin=tags.get(TWIN_TAG),
        answers=_json((tracker.read_artifact(run.info.run_id, ANSWERS_FILE) or b"").decode() or None) or None,
    )


def _cells(tracker: Tracker, arm_run: Any, arm: ArmData) -> list[CellData]:
    """The cells of one arm run: each workload nested under it, its repeats' values."""
    cells = []
    for wl in tracker.children(arm_run.info.run_id):
        name = RunTags.of(wl).workload
        if not name:
            continue
        repeats = [r for r in tracker.children(wl.info.run_id) if r.data.tags.get(REPEAT_TAG)]
        repeats.sort(key=lambda r: int(r.data.tags[REPEAT_TAG]))
        params = wl.data.params
        capacity = _capacity_label(params)
        spec = _json(params.get("workload.capacity")) if capacity is not None else {}
        values = _values(tracker, wl)
        part, values, kept = _part(tracker, arm, wl, repeats, values)
        cells.append(
            CellData(
                arm=arm.name,
                engine=arm.engine,
                workload=name,
                input_tokens=_int(params, "workload.input_tokens"),
                output_tokens=_int(params, "workload.output_tokens"),
                concurrency=_int(params, "workload.concurrency"),
                run_id=wl.info.run_id,
                status=wl.info.status,
                values=values,
                parts=[part],
                shape_key=workload_shape(params),
                request_runs=[r.info.run_id for r in kept] or ([] if repeats else [wl.info.run_id]),
                load=params.get("workload.load", "concurrency"),
                rate_rps=_float(params, "workload.rate_rps"),
                trace=_json(params.get("workload.trace")).get("path"),
                trace_speed=_json(params.get("workload.trace")).get("speed"),
                dataset="trace"
                if params.get("workload.trace") not in (None, "null")
                else _json(params.get("workload.dataset")).get("kind", "random"),
                capacity=capacity,
                searches=_searches(tracker, kept or [wl]) if capacity is not None else [],
                slo={k: float(v) for k, v in _json(params.get("workload.slo")).items() if v is not None},
                attainment_pct=spec.get("attainment_pct"),
                ladder=RunTags.of(wl).ladder,
                ladder_point=_float(wl.data.tags, LADDER_POINT_TAG),
                prefix_cache_reset=wl.data.tags.get(PREFIX_CACHE_RESET_TAG),
            )
        )
    return cells


def _part(
    tracker: Tracker, arm: ArmData, wl: Any, repeats: list[Any], values: dict[str, list[float]]
) -> tuple[LaunchPart, dict[str, list[float]], list[Any]]:
    """What this launch completed of the workload, its values without the repeats that ended early,
    and the repeat runs kept. The rule (docs/measurement.md, "A launch cut short"): a repeat whose run
    is tagged ``k3pipe.aborted`` (its requests were cut: an interrupt, a deadline, the engine lost) is
    out of every figure; a launch counts in a cell only when every planned repeat ran to its end."""
    planned = max(1, int(float(wl.data.params.get("workload.repeats", "1") or 1)))
    if not repeats:  # one repeat: the workload's run is the repeat
        aborted = RunTags.of(wl).aborted
        cut = [f"its one repeat ended early ({aborted}){_sent(wl)}"] if aborted else []
        whole = 0 if aborted or not values else 1
        part = LaunchPart(launch=arm.launch, status=arm.status, whole=whole, planned=planned, cut=cut)
        return part, ({} if aborted else values), []
    kept = [r for r in repeats if not RunTags.of(r).aborted]
    cut = [
        f"repeat {r.data.tags[REPEAT_TAG]} ended early ({r.data.tags[ABORTED_TAG]}){_sent(r)}"
        for r in repeats
        if RunTags.of(r).aborted
    ]
    if len(kept) < len(repeats):
        values = _repeat_values(tracker, wl, kept)
    if len(repeats) < planned:
        cut.append(f"{planned - len(repeats)} planned repeat(s) never ran")
    part = LaunchPart(launch=arm.launch, status=arm.status, whole=len(kept), planned=planned, cut=cut)
    return part, values, kept


def _sent(run: Any) -> str:
    """' after 128 of 384 requests' from a run's metrics (empty when they are not recorded)."""
    m = run.data.metrics
    done, planned = m.get("completed"), run.data.params.get("workload.num_requests")
    if done is None or not planned:
        return ""
    return f" after {done:.0f} of {planned} requests completed"


def _repeat_values(tracker: Tracker, wl: Any, kept: list[Any]) -> dict[str, list[float]]:
    """Per metric, its value in each kept repeat (repeat order): from the workload's
    repeats.parquet (one row per repeat, its number in ``repeat``) where it exists, else from the
    kept repeats' own runs."""
    numbers = [int(r.data.tags[REPEAT_TAG]) for r in kept]
    raw = tracker.find_artifact(wl.info.run_id, REPEATS_FRAME_FILE)
    if raw is not None:
        frame = pd.read_parquet(io.BytesIO(raw))
        if "repeat" in frame.columns:
            frame = frame[frame["repeat"].astype(int).isin(numbers)].sort_values("repeat")
            return {
                str(c): [float(v) for v in frame[c].dropna()]
                for c in frame.columns
                if c != "repeat" and frame[c].notna().any()
            }
    out: dict[str, list[float]] = {}
    for run in kept:
        for key, value in run.data.metrics.items():
            out.setdefault(key, []).append(float(value))
    return out


def _json(text: str | None) -> dict[str, Any]:
    """A JSON object param ({} for null, absent or not an object)."""
    try:
        value = json.loads(text or "null")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _searches(tracker: Tracker, runs: list[Any]) -> list[dict[str, Any]]:
    """Each capacity search's capacity.json (k3pipe.records.recorder.log_capacity), in repeat order; a search
    that ended before writing it is left out."""
    out = []
    for run in runs:
        raw = tracker.read_artifact(run.info.run_id, CAPACITY_FILE)
        found = _json(raw.decode() if raw else None)
        if found:
            out.append(found)
    return out


def _capacity_label(params: dict[str, str]) -> str | None:
    """'rate 1.25-500 req/s' from the workload's ``capacity`` param (its spec as JSON, or null)."""
    try:
        spec = json.loads(params.get("workload.capacity") or "null")
    except ValueError:
        return None
    if not isinstance(spec, dict) or "over" not in spec:
        return None
    unit = "req/s" if spec["over"] == "rate" else "streams"
    return f"{spec['over']} {spec.get('low', '?'):g}-{spec.get('high', '?'):g} {unit}"


def collect(tracker: Tracker, study_ref: str) -> StudyData:
    """The study ``study_ref`` (its run id, or a unique prefix) as recorded in MLflow."""
    run = find_run(tracker, study_ref)
    if RunTags.of(run).kind != STUDY_KIND:
        raise TrackingError(
            f"run {run.info.run_id} is not a study's run (tag k3pipe.kind is "
            f"{RunTags.of(run).kind!r}); give the id `k3pipe study` printed, or find it with "
            "`k3pipe runs`"
        )
    arms: list[ArmData] = []
    cells: list[CellData] = []
    primed: list[ArmData] = []
    primed_cells: list[CellData] = []
    superseded = kept = 0
    for arm_run in sorted(tracker.children(run.info.run_id), key=lambda r: r.info.start_time):
        if not RunTags.of(arm_run).arm:
            continue
        if RunTags.of(arm_run).superseded:
            superseded += 1
            continue
        arm = _arm(tracker, arm_run)
        kept += len([w for w in arm_run.data.tags.get(KEPT_WORKLOADS_TAG, "").split(",") if w])
        if RunTags.of(arm_run).prime:
            primed.append(arm)
            primed_cells.extend(_cells(tracker, arm_run, arm))
            continue
        arm.stages = stage_times(run.data.metrics, arm.name, arm.launch)
        arms.append(arm)
        for cell in _cells(tracker, arm_run, arm):
            earlier = next((c for c in cells if c.arm == cell.arm and c.workload == cell.workload), None)
            if earlier is None:
                if cell.cut:  # named, never a value (LaunchPart)
                    cell.values, cell.request_runs, cell.searches = {}, [], []
                cells.append(cell)
            else:
                earlier.add_launch(cell)  # a further launch of the same arm
    experiment = _experiment(tracker, run.info.run_id)
    decision = experiment.get("decision") or {}
    _attach_priors(tracker, arms, cells, run.info.start_time, decision.get("prior_days"))
    return StudyData(
        run_id=run.info.run_id,
        name=run.data.tags.get(EXPERIMENT_TAG, run.info.run_name),
        status=run.info.status,
        arms=arms,
        cells=cells,
        metrics=dict(run.data.metrics),
        primed=primed,
        primed_cells=primed_cells,
        reference=_reference(experiment),
        decision=decision,
        look=_look(run.data.tags),
        resumed=int(run.data.tags.get(RESUMED_TAG, "0")),
        superseded=superseded,
        kept_workloads=kept,
        answers=experiment.get("answers") or None,
        gpus=(experiment.get("hardware") or {}).get("gpu_count"),
        tune=(
            _json((tracker.read_artifact(run.info.run_id, TUNE_FILE) or b"").decode() or None) or None
            if TUNE_OUTCOME_TAG in run.data.tags
            else None
        ),
    )


def cell_class_of(arms: list[ArmData], cell: CellData) -> CellClass | None:
    """The configuration class of ``cell`` (k3pipe.records.priors): its arm's engine, model and node, its
    workload's shape."""
    arm = next((a for a in arms if a.name == cell.arm), None)
    if arm is None:
        return None
    return cell_class(arm.engine, arm.model, arm.node, cell.shape_key)


def _attach_priors(
    tracker: Tracker, arms: list[ArmData], cells: list[CellData], start_ms: int, days: Any
) -> None:
    """Each cell launched once gets the restart noise earlier studies kept for its class (per
    metric), when there is some; ``days``: the experiment's ``decision.prior_days``."""
    alone = [(c, k) for c in cells if c.values and c.launches == 1 and (k := cell_class_of(arms, c))]
    if not alone:
        return
    wanted: dict[str, set[str]] = {}
    for cell, klass in alone:
        wanted.setdefault(klass.key, set()).update(cell.values)
    age = DEFAULT_PRIOR_DAYS if days is None else float(days)
    found = find_priors(tracker, wanted, start_ms, age)
    for cell, klass in alone:
        cell.priors = {m: p for (key, m), p in found.items() if key == klass.key and m in cell.values}


def _look(tags: dict[str, str]) -> dict[str, Any]:
    if DECISION_ALPHA_TAG not in tags:
        return {}
    return {
        "look": int(tags.get(DECISION_LOOK_TAG, "1")),
        "looks": int(tags.get(DECISION_LOOKS_TAG, "1")),
        "alpha": float(tags[DECISION_ALPHA_TAG]),
        "stopped": tags.get(DECISION_STOPPED_TAG, ""),
    }


def _experiment(tracker: Tracker, run_id: str) -> dict[str, Any]:
    """The experiment.json the study run holds (k3pipe.jobs.study_run logs it); {} when there is none."""
    raw = tracker.read_artifact(run_id, EXPERIMENT_FILE)
    try:
        data = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _reference(experiment: dict[str, Any]) -> dict[str, Any] | None:
    """The experiment's 'reference', when it has figures."""
    reference = experiment.get("reference")
    return reference if isinstance(reference, dict) and reference.get("figures") else None


def requests_frame(tracker: Tracker, cell: CellData) -> pd.DataFrame | None:
    """The cell's measured, successful requests over all its repeats (None: none recorded).

    k3pipe.records.recorder tags a run ``k3pipe.client_timing`` right after it logged its requests.parquet
    (FINISHED or not), so a run with that tag lacking the file raises ``ArtifactMissingError``; one
    without it ended before its requests were logged (FAILED or KILLED) and has none. An artifact
    store that cannot be read raises ``ArtifactStoreError``."""
    frames = []
    for run_id in cell.request_runs:
        try:
            data = tracker.find_artifact(run_id, REQUESTS_FILE)
            if data is None and CLIENT_TIMING_TAG in tracker.client.get_run(run_id).data.tags:
                data = tracker.read_artifact(run_id, REQUESTS_FILE, required=True)  # raises
        except ArtifactMissingError as exc:
            raise exc.context(f"the requests of workload {cell.workload} of arm {cell.arm}") from exc
        if data is not None:
            frame = pd.read_parquet(io.BytesIO(data))
            if len(frame):  # a run that sent no request wrote a table without columns
                frames.append(frame)
    if not frames:
        return None
    frame = pd.concat(frames, ignore_index=True)
    return frame[(~frame["warmup"]) & (frame["ok"])]
