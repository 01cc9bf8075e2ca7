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

__all__ = [
    "ABORTED_TAG",
    "ACCEPTED_TAG",
    "ANSWERS_ERROR_TAG",
    "ARM_TAG",
    "BURSTY_WORKLOADS_TAG",
    "CAPACITY_BINDING_TAG",
    "CAPACITY_CENSORED_TAG",
    "CAPACITY_TAG",
    "CLIENT_TIMING_NOTE_TAG",
    "CLIENT_TIMING_TAG",
    "DECISION_ALPHA_TAG",
    "DECISION_LOOKS_TAG",
    "DECISION_LOOK_TAG",
    "DECISION_STOPPED_TAG",
    "DRIFT_TAG",
    "ENERGY_GPUS_TAG",
    "ENGINE_DEVICE_NAMES_TAG",
    "ENGINE_FINDINGS_ERROR_TAG",
    "ENGINE_TAG",
    "ENGINE_WARNINGS_TAG",
    "ERROR_TAG",
    "EXPERIMENT_TAG",
    "FAILED_ARMS_TAG",
    "FAILED_PREFIX",
    "FAILED_VARIANTS_TAG",
    "FLOW_RUN_TAG",
    "GPUS_TAG",
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
    "LOSSLESS_TAG",
    "MANAGED_LABEL",
    "MLFLOW_RUN_LABEL",
    "NODE_ERROR_TAG",
    "NODE_MISMATCH_TAG",
    "NODE_TAG",
    "NOISE_TAG",
    "OWNER_LABEL",
    "POOL_TAG",
    "PREFIX_CACHE_RESET_NOTE_TAG",
    "PREFIX_CACHE_RESET_TAG",
    "PREFLIGHT_TAG",
    "PRIME_TAG",
    "PROBE_TAG",
    "REGRESSION_EVENT",
    "REGRESSION_TAG",
    "REPEATS_ERROR_TAG",
    "REPEAT_TAG",
    "RERUN_DRIFT_TAG",
    "RERUN_TAG",
    "RERUN_VERDICT_TAG",
    "RESUMED_TAG",
    "RESUME_TAG",
    "RETEST_KIND",
    "RETEST_RESOURCE_PREFIX",
    "RETEST_RUN_TAG",
    "SPECULATION_BASELINE_TAG",
    "SPECULATION_ERROR_TAG",
    "SPECULATION_VERDICT_TAG",
    "STUDY_KIND",
    "SUPERSEDED_TAG",
    "TWIN_TAG",
    "VARIANT_TAG",
    "WORKLOAD_TAG",
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
