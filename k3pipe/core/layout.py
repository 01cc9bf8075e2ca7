"""The MLflow record's names, in one place (issue 48): every tag k3pipe writes on a run, the prefixes
of tag families, and the labels it puts on the containers it starts.

Every past study is read back through these names: a report, a rerun, a resume, a retest's series and
the fleet all find runs and their meaning by them, so a name here is a contract. Renaming one makes
every store written before it unreadable in that respect; a new name is added, an old one is kept
for the stores that hold it. tests/integration/test_store_layout.py holds a store written by an
earlier k3pipe and checks that it still gives the same report; tests/unit/test_layout.py checks that
no module spells one of these names itself.

Each run k3pipe starts carries :data:`LAYOUT_TAG` with :data:`LAYOUT_VERSION`; a store without it was
written before the layout was versioned (version 1, the same names).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "ABORTED_TAG",
    "ACCEPTED_TAG",
    "ACCURACY_FILE",
    "ANSWERS_ERROR_TAG",
    "ANSWERS_FILE",
    "ARG_PREFIX",
    "ARM_TAG",
    "BURSTY_WORKLOADS_TAG",
    "CAPACITY_BINDING_TAG",
    "CAPACITY_CENSORED_TAG",
    "CAPACITY_FILE",
    "CAPACITY_TAG",
    "CLAIMS_FILE",
    "CLIENT_LOAD_FILE",
    "CLIENT_TIMING_NOTE_TAG",
    "CLIENT_TIMING_TAG",
    "COLD_START_PHASES_FILE",
    "COLD_START_PREFIX",
    "COLD_START_TABLE_FILE",
    "COMMAND_FILE",
    "COMPILE_CACHE_FILE",
    "DECISION_ALPHA_TAG",
    "DECISION_LOOKS_TAG",
    "DECISION_LOOK_TAG",
    "DECISION_STOPPED_TAG",
    "DISCREPANCIES_FILE",
    "DRIFT_TAG",
    "ENDPOINT_CHECK_FILE",
    "ENERGY_GPUS_TAG",
    "ENGINE_DEVICE_NAMES_TAG",
    "ENGINE_FINDINGS_ERROR_TAG",
    "ENGINE_FINDINGS_FILE",
    "ENGINE_LOG_PREFIX",
    "ENGINE_METRICS_FILE",
    "ENGINE_TAG",
    "ENGINE_WARNINGS_TAG",
    "ENV_PREFIX",
    "ERROR_TAG",
    "EXPERIMENT_FILE",
    "EXPERIMENT_TAG",
    "FAILED_ARMS_TAG",
    "FAILED_PREFIX",
    "FAILED_VARIANTS_TAG",
    "FLOW_RUN_TAG",
    "GPUS_TAG",
    "GPU_MEMORY_FILE",
    "HEARTBEAT_PREFIX",
    "KEPT_TAG",
    "KEPT_WORKLOADS_TAG",
    "KIND_TAG",
    "LADDER_OVER_TAG",
    "LADDER_POINT_TAG",
    "LADDER_PREFIX",
    "LADDER_TAG",
    "LAUNCHER_TAG",
    "LAUNCHES_TAG",
    "LAUNCH_TAG",
    "LAYOUT_TAG",
    "LAYOUT_VERSION",
    "LOGS_DIR",
    "LOSSLESS_TAG",
    "MANAGED_LABEL",
    "MLFLOW_RUN_LABEL",
    "NODE_DIR",
    "NODE_ERROR_TAG",
    "NODE_MISMATCH_TAG",
    "NODE_TAG",
    "NOISE_FILE",
    "NOISE_TAG",
    "OWNER_LABEL",
    "POOL_TAG",
    "PREFIX_CACHE_RESET_NOTE_TAG",
    "PREFIX_CACHE_RESET_TAG",
    "PREFLIGHT_FILE",
    "PREFLIGHT_TAG",
    "PRIME_TAG",
    "PROBE_TAG",
    "PROMPTS_INDEX_FILE",
    "RECORD_FILE",
    "REGRESSION_EVENT",
    "REGRESSION_FILE",
    "REGRESSION_TAG",
    "REPEATS_ERROR_TAG",
    "REPEATS_FILE",
    "REPEATS_FRAME_FILE",
    "REPEAT_TAG",
    "REPLAY_FILE",
    "REPORT_DIR",
    "REQUESTS_FILE",
    "RERUN_DRIFT_TAG",
    "RERUN_TAG",
    "RERUN_VERDICTS_FILE",
    "RERUN_VERDICT_TAG",
    "RESUMED_TAG",
    "RESUME_TAG",
    "RETEST_KIND",
    "RETEST_RESOURCE_PREFIX",
    "RETEST_RUN_TAG",
    "SPECULATION_BASELINE_TAG",
    "SPECULATION_ERROR_TAG",
    "SPECULATION_FILE",
    "SPECULATION_VERDICT_TAG",
    "STAGE_PREFIX",
    "STRUCTURED_FILE",
    "STUDY_KIND",
    "SUMMARY_FILE",
    "SUPERSEDED_TAG",
    "TIME_PREFIX",
    "TRACE_FILE",
    "TUNE_FILE",
    "TUNE_OUTCOME_TAG",
    "TUNE_WINNER_FILE",
    "TUNE_WINNER_TAG",
    "TWIN_TAG",
    "VARIANTS_FILE",
    "VARIANT_TAG",
    "VERDICT_PREFIX",
    "WORKLOAD_PREFIX",
    "WORKLOAD_TAG",
    "RunTags",
    "cold_start_metric",
    "prompts_path",
    "provenance_path",
    "stage_prefix",
    "stage_times",
    "verdict_metric",
]

LAYOUT_VERSION = "1"
"""The version of these names a run was written with (:data:`LAYOUT_TAG`)."""
LAYOUT_TAG = "k3pipe.layout"

# --- what a run is, and where it belongs ---------------------------------------------------------
STUDY_KIND = "study"
"""The :data:`KIND_TAG` of a study's parent run."""
RETEST_KIND = "retest"
"""The :data:`KIND_TAG` of a retest's parent run (its studies, the baseline's and each variant's, under
it)."""
KIND_TAG = "k3pipe.kind"
"""The run's kind: 'study', 'retest', a search, a ladder point ... (a run without it is an arm's or a
workload's, told by :data:`ARM_TAG` / :data:`WORKLOAD_TAG`)."""
EXPERIMENT_TAG = "k3pipe.experiment"
"""The experiment's name ('NAME@VARIANT' for a variant); also a label on the containers k3pipe starts."""
VARIANT_TAG = "k3pipe.variant"
"""A retest's study: its variant ('baseline' for the baseline)."""
ARM_TAG = "k3pipe.arm"
ENGINE_TAG = "k3pipe.engine"
LAUNCHER_TAG = "k3pipe.launcher"
LAUNCH_TAG = "k3pipe.launch"
"""Which launch of the arm a run is (from 1; 0: a priming launch)."""
LAUNCHES_TAG = "k3pipe.launches"
WORKLOAD_TAG = "k3pipe.workload"
REPEAT_TAG = "k3pipe.repeat"
FLOW_RUN_TAG = "k3pipe.flow_run_id"
"""The Prefect flow run that recorded the run; also a label on the containers it started."""
RETEST_RUN_TAG = "k3pipe.retest_run_id"
ERROR_TAG = "k3pipe.error"
"""Why a run failed, scrubbed."""

# --- a study's launches: priming, resumes, cuts ----------------------------------------------------
PRIME_TAG = "k3pipe.prime"
"""Tags the arm run of a priming launch (``decision.prime``): launch 0, kept out of the verdicts."""
ABORTED_TAG = "k3pipe.aborted"
"""Tags a workload run (or a repeat's run) that ended before its planned requests (an interrupt, the
engine lost): its value says why. Such a repeat is out of every figure."""
SUPERSEDED_TAG = "k3pipe.superseded"
"""Tags the arm run of a launch that did not finish and that a resumed study ran again (its value says
how): kept in MLflow with what it measured, left out of the report (k3pipe.jobs.resume)."""
RESUME_TAG = "k3pipe.resume"
RESUMED_TAG = "k3pipe.resumed"
"""How many times a study was resumed."""
KEPT_TAG = "k3pipe.kept_by_resume"
KEPT_WORKLOADS_TAG = "k3pipe.kept_workloads"
FAILED_ARMS_TAG = "k3pipe.failed_arms"
FAILED_VARIANTS_TAG = "k3pipe.failed_variants"
DECISION_LOOK_TAG = "k3pipe.decision.look"
DECISION_LOOKS_TAG = "k3pipe.decision.looks"
DECISION_ALPHA_TAG = "k3pipe.decision.alpha"
DECISION_STOPPED_TAG = "k3pipe.decision.stopped"
TUNE_OUTCOME_TAG = "k3pipe.tune.outcome"
"""A search's end (k3pipe.verdicts.racing): winner, equivalent or undecided."""
TUNE_WINNER_TAG = "k3pipe.tune.winner"
"""The candidate a search declared the best (its leader when undecided is in tune.json)."""
NOISE_TAG = "k3pipe.noise"
"""A study that kept its restart noise for later ones (k3pipe.records.priors)."""

# --- what a workload's run measured, and how ---------------------------------------------------------
CLIENT_TIMING_TAG = "k3pipe.client_timing"
CLIENT_TIMING_NOTE_TAG = "k3pipe.client_timing_note"
BURSTY_WORKLOADS_TAG = "k3pipe.bursty_workloads"
REPEATS_ERROR_TAG = "k3pipe.repeats_error"
PREFIX_CACHE_RESET_TAG = "k3pipe.prefix_cache_reset"
PREFIX_CACHE_RESET_NOTE_TAG = "k3pipe.prefix_cache_reset_note"
LADDER_TAG = "k3pipe.ladder"
"""A ladder point's run: the ladder workload it belongs to."""
LADDER_PREFIX = "k3pipe.ladder."
"""On an arm's run, ``k3pipe.ladder.<workload>``: how that ladder ran on the launch."""
LADDER_OVER_TAG = "k3pipe.ladder_over"
LADDER_POINT_TAG = "k3pipe.ladder_point"
PROBE_TAG = "k3pipe.probe"
"""A capacity search's probe run: its load point."""
CAPACITY_TAG = "k3pipe.capacity"
CAPACITY_BINDING_TAG = "k3pipe.capacity_binding"
CAPACITY_CENSORED_TAG = "k3pipe.capacity_censored"
ENERGY_GPUS_TAG = "k3pipe.energy_gpus"

# --- what the arm's node and engine said ---------------------------------------------------------------
PREFLIGHT_TAG = "k3pipe.preflight"
GPUS_TAG = "k3pipe.gpus"
NODE_TAG = "k3pipe.node"
POOL_TAG = "k3pipe.pool"
NODE_ERROR_TAG = "k3pipe.node_error"
NODE_MISMATCH_TAG = "k3pipe.node_mismatch"
ENGINE_WARNINGS_TAG = "k3pipe.engine_warnings"
ENGINE_DEVICE_NAMES_TAG = "k3pipe.engine_device_names"
ENGINE_FINDINGS_ERROR_TAG = "k3pipe.engine_findings_error"
SPECULATION_BASELINE_TAG = "k3pipe.speculation_baseline"
SPECULATION_VERDICT_TAG = "k3pipe.speculation_verdict"
SPECULATION_ERROR_TAG = "k3pipe.speculation_error"

# --- answers (the output probe) ----------------------------------------------------------------------
ANSWERS_ERROR_TAG = "k3pipe.answers_error"
"""Why a launch's output probe stopped short (the answers it got are still in answers.json)."""
LOSSLESS_TAG = "k3pipe.answers_lossless"
"""A speculative arm's setting: under greedy decoding its tokens must be its plain twin's."""
TWIN_TAG = "k3pipe.answers_twin"
"""The plain arm (the same engine, model and other settings) a lossless setting is checked against."""

# --- reruns, retests, alerts -----------------------------------------------------------------------------
RERUN_TAG = "k3pipe.rerun_of"
RERUN_DRIFT_TAG = "k3pipe.rerun_drift"
RERUN_VERDICT_TAG = "k3pipe.rerun_verdict"
DRIFT_TAG = "k3pipe.drift"
REGRESSION_TAG = "k3pipe.regression"
"""A retest's regression check: 'none', or its summary ('worse ...' raises an alert)."""
ACCEPTED_TAG = "k3pipe.accepted"
"""On a retest accepted as the new baseline: when (UTC, ISO 8601)."""
REGRESSION_EVENT = "k3pipe.regression.detected"
"""The Prefect event a retest that found a regression emits."""
RETEST_RESOURCE_PREFIX = "k3pipe.retest."
"""The event's resource: ``k3pipe.retest.<retest run id>``."""
FAILED_PREFIX = "k3pipe.failed."
"""On a retest's run, ``k3pipe.failed.<variant>``: why that variant's study failed."""
HEARTBEAT_PREFIX = "k3pipe.heartbeat."
"""A fleet node's heartbeat tags."""

# --- labels on the containers k3pipe starts (docker launcher; reaping finds them by these) ------------------
MANAGED_LABEL = "k3pipe.managed"
OWNER_LABEL = "k3pipe.owner"
MLFLOW_RUN_LABEL = "k3pipe.mlflow_run_id"


# --- artifacts: the files on a run, and where readers find them ------------------------------------------
EXPERIMENT_FILE = "experiment.json"
"""The experiment as parsed (secrets redacted): on a study's, a retest's and each arm's run."""
RECORD_FILE = "run_record.json"
"""The run as a value (k3pipe.records.runrecord): what a rerun restores from."""
COMMAND_FILE = "command.txt"
"""The engine's command line and environment as rendered (secrets redacted)."""
PREFLIGHT_FILE = "preflight.json"
"""The preflight's findings for the run."""
ENDPOINT_CHECK_FILE = "endpoint_check.json"
"""The health gate's proof of the endpoint (base URL, key, model id)."""
ENGINE_FINDINGS_FILE = "engine_findings.json"
"""What the engine's log said (KV pool, warnings, OOM lines, kernels)."""
COLD_START_PHASES_FILE = "cold_start_phases.json"
"""The cold start's phases, read from the engine's log."""
COLD_START_TABLE_FILE = "cold_start_phases.txt"
"""The same phases as a table for people."""
COMPILE_CACHE_FILE = "compile_cache.json"
"""The compile cache the launch used (key, directory, evidence, factors)."""
GPU_MEMORY_FILE = "gpu_memory.parquet"
"""A workload's GPU memory series (nvidia-smi samples)."""
REQUESTS_FILE = "requests.parquet"
REPLAY_FILE = "replay.parquet"
TUNE_FILE = "tune.json"
"""A search's result on the study run: outcome, leader, survivors, each drop and why, rounds, launches."""
TUNE_WINNER_FILE = "tune-winner.yaml"
"""The winner (or the undecided search's leader) written out as an experiment arm."""
TRACE_FILE = "trace.jsonl"
"""The trace a workload replayed (k3pipe's format: no text unless it was captured with text), on its run."""
"""A trace replay's requests: planned, ready, sent and ended seconds from its start, lag, or why skipped."""
"""A workload's (or a repeat's) requests, one row each, as the client recorded them."""
ENGINE_METRICS_FILE = "engine_metrics.parquet"
"""The engine's /metrics scraped during a workload."""
DISCREPANCIES_FILE = "discrepancies.json"
"""Where the client and the engine's /metrics disagreed."""
SUMMARY_FILE = "summary.json"
"""A workload's summary (the figures of docs/measurement.md)."""
CLIENT_LOAD_FILE = "client_load.json"
"""The load client's own CPU while it sent a workload."""
REPEATS_FILE = "repeats.json"
"""A workload's figures over its repeats (mean, interval)."""
REPEATS_FRAME_FILE = "repeats.parquet"
"""A workload's per-repeat values, one row a repeat."""
CAPACITY_FILE = "capacity.json"
"""A capacity search's answer, on its search run."""
SPECULATION_FILE = "speculation.json"
"""A speculative arm judged against its plain baseline."""
ANSWERS_FILE = "answers.json"
"""The launch's output probe: each prompt's greedy tokens and scored continuation."""
STRUCTURED_FILE = "structured.json"
"""The launch's tool-call and reasoning checks."""
ACCURACY_FILE = "accuracy.json"
"""The launch's score on the experiment's accuracy set."""
CLAIMS_FILE = "claims.json"
"""A study's published figures, beside its own."""
NOISE_FILE = "noise.json"
"""The restart noise a study kept for later ones (k3pipe.records.priors)."""
RERUN_VERDICTS_FILE = "rerun_verdicts.json"
"""A rerun's verdicts against the original, per workload."""
VARIANTS_FILE = "variants.json"
"""A retest's variants and what each changes."""
REGRESSION_FILE = "regression.json"
"""A retest's regression check."""
PROMPTS_INDEX_FILE = "prompts/index.json"
"""A fleet study's prompt sets, drawn once for every node."""
LOGS_DIR = "logs"
"""The engine's log (and the launcher's), as files."""
NODE_DIR = "node"
"""The node's facts: nvidia-smi before and after, its topology, the communication environment."""
REPORT_DIR = "report"
"""A study's report (report.md, report.html, report.json, report.txt and plots/) on the study's run."""


def prompts_path(workload: str, repeat: int) -> str:
    """The prompts a workload's repeat sent, on the arm's run (``repeat`` counts from 0)."""
    return f"prompts/{workload}/r{repeat}.json"


def provenance_path(name: str) -> str:
    """One input's provenance (a model's files and sha256, the image's digest), on the arm's run."""
    return f"provenance/{name}.json"


# --- typed views: what readers ask of a run, instead of its tags by name ----------------------------
class RunTags:
    """A run's tags read through the layout (``RunTags.of(run)``, or of a tag mapping): each property
    is the tag's value as written, None where the run has none, so a reader never spells a tag and a
    renamed tag is one line above."""

    __slots__ = ("tags",)

    def __init__(self, tags: Mapping[str, str]) -> None:
        self.tags = tags

    @classmethod
    def of(cls, run: Any) -> RunTags:
        """The view of an MLflow ``Run`` (anything with ``.data.tags``)."""
        return cls(run.data.tags)

    def _get(self, tag: str) -> str | None:
        return self.tags.get(tag)

    @property
    def kind(self) -> str | None:
        """'study', 'retest', a search, ... (:data:`KIND_TAG`)."""
        return self._get(KIND_TAG)

    @property
    def experiment(self) -> str | None:
        """:data:`EXPERIMENT_TAG`."""
        return self._get(EXPERIMENT_TAG)

    @property
    def variant(self) -> str | None:
        """:data:`VARIANT_TAG`."""
        return self._get(VARIANT_TAG)

    @property
    def arm(self) -> str | None:
        """:data:`ARM_TAG`."""
        return self._get(ARM_TAG)

    @property
    def engine(self) -> str | None:
        """:data:`ENGINE_TAG`."""
        return self._get(ENGINE_TAG)

    @property
    def workload(self) -> str | None:
        """:data:`WORKLOAD_TAG`."""
        return self._get(WORKLOAD_TAG)

    @property
    def aborted(self) -> str | None:
        """Why a run ended early (:data:`ABORTED_TAG`)."""
        return self._get(ABORTED_TAG)

    @property
    def superseded(self) -> str | None:
        """:data:`SUPERSEDED_TAG`."""
        return self._get(SUPERSEDED_TAG)

    @property
    def prime(self) -> str | None:
        """A priming launch's arm run (:data:`PRIME_TAG`)."""
        return self._get(PRIME_TAG)

    @property
    def rerun_of(self) -> str | None:
        """The run a rerun measured again (:data:`RERUN_TAG`)."""
        return self._get(RERUN_TAG)

    @property
    def accepted(self) -> str | None:
        """When a retest was accepted (:data:`ACCEPTED_TAG`)."""
        return self._get(ACCEPTED_TAG)

    @property
    def regression(self) -> str | None:
        """:data:`REGRESSION_TAG`."""
        return self._get(REGRESSION_TAG)

    @property
    def ladder(self) -> str | None:
        """A ladder point's ladder (:data:`LADDER_TAG`)."""
        return self._get(LADDER_TAG)

    @property
    def pool(self) -> str | None:
        """A fleet launch's pool (:data:`POOL_TAG`)."""
        return self._get(POOL_TAG)

    @property
    def error(self) -> str | None:
        """Why the run failed (:data:`ERROR_TAG`)."""
        return self._get(ERROR_TAG)

    @property
    def repeat(self) -> int | None:
        """Which repeat a repeat's run is (from 0), None on any other run."""
        value = self._get(REPEAT_TAG)
        return None if value is None else int(value)

    @property
    def launch(self) -> int | None:
        """Which launch of its arm an arm run is (from 1; 0: a priming launch)."""
        value = self._get(LAUNCH_TAG)
        return None if value is None else int(value)

    @property
    def parent(self) -> str | None:
        """The run it is nested under (MLflow's own tag)."""
        return self._get("mlflow.parentRunId")


# --- metric and param names built from parts: each scheme written and read through these ---------------
STAGE_PREFIX = "stage."
"""A study run's stage times, per arm launch (:func:`stage_prefix`)."""
COLD_START_PREFIX = "cold_start."
"""An arm run's cold-start phases read from the engine's log (:func:`cold_start_metric`)."""
ENGINE_LOG_PREFIX = "engine_log."
"""An arm run's figures from the engine's log (KV pool, throughput samples, OOM lines ...)."""
VERDICT_PREFIX = "verdict."
"""A retest run's verdict counts, per variant and outcome (:func:`verdict_metric`)."""
TIME_PREFIX = "time."
"""A workload run's wall-clock times, as params."""
ARG_PREFIX = "arg."
"""An arm run's engine arguments as given (secrets redacted), as params."""
ENV_PREFIX = "env."
"""An arm run's engine environment (secrets redacted), as params."""
WORKLOAD_PREFIX = "workload."
"""A workload run's spec, as params."""


def stage_prefix(arm: str, launch: int = 1) -> str:
    """The study run's metric prefix of an arm launch's stages: ``stage.a.`` for launch 1,
    ``stage.a.launch2.`` for later ones (a priming launch is launch 0: ``stage.a.launch0.``)."""
    return f"{STAGE_PREFIX}{arm}." if launch == 1 else f"{STAGE_PREFIX}{arm}.launch{launch}."


def stage_times(metrics: Mapping[str, float], arm: str, launch: int = 1) -> dict[str, float]:
    """An arm launch's stage times (seconds by stage) among a study run's metrics: the reader of
    :func:`stage_prefix` (launch 1's prefix also starts the later launches' keys: those are not its)."""
    prefix = stage_prefix(arm, launch)
    later = f"{STAGE_PREFIX}{arm}.launch"
    return {
        k.removeprefix(prefix).removesuffix("_s"): v
        for k, v in metrics.items()
        if k.startswith(prefix) and (launch != 1 or not k.startswith(later))
    }


def cold_start_metric(phase: str) -> str:
    """The arm run's metric of one cold-start phase, in seconds."""
    return f"{COLD_START_PREFIX}{phase}_s"


def verdict_metric(variant: str, outcome: str) -> str:
    """The retest run's count of ``variant``'s cells judged ``outcome`` (better, worse, ...)."""
    return f"{VERDICT_PREFIX}{variant}.{outcome}"
