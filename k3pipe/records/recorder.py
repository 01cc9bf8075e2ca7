"""What a benchmark run records in MLflow: one run per engine launch, one nested run per workload.

A workload with ``repeats: N > 1`` gets, under its workload run, one nested run per repeat holding
that repeat's details (requests, engine series, dataset); the workload run itself holds each metric's
mean across repeats under its plain name, and ``<name>.std``, ``<name>.ci95_low``, ``<name>.ci95_high``
beside it (see k3pipe.bench.repeats), plus ``repeats.json`` and ``repeats.parquet``.
"""

from __future__ import annotations

import contextlib
import socket
import traceback
from collections.abc import Iterable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pandas as pd
from mlflow.exceptions import MlflowException

from k3pipe.bench import records_frame
from k3pipe.bench.accuracy import AccuracyRecord
from k3pipe.bench.health import EndpointCheck
from k3pipe.bench.probe import ProbeRecord
from k3pipe.bench.repeats import aggregate_repeats
from k3pipe.bench.replay import ReplayRecord
from k3pipe.bench.session import WorkloadOutcome
from k3pipe.bench.structured import StructuredRecord
from k3pipe.bench.summary import timing_note
from k3pipe.core.layout import (
    ABORTED_TAG,
    ACCURACY_FILE,
    ANSWERS_ERROR_TAG,
    ANSWERS_FILE,
    ARG_PREFIX,
    ARM_TAG,
    BURSTY_WORKLOADS_TAG,
    CAPACITY_BINDING_TAG,
    CAPACITY_CENSORED_TAG,
    CAPACITY_FILE,
    CAPACITY_TAG,
    CLIENT_LOAD_FILE,
    CLIENT_TIMING_NOTE_TAG,
    CLIENT_TIMING_TAG,
    COLD_START_PHASES_FILE,
    COLD_START_TABLE_FILE,
    COMMAND_FILE,
    COMPILE_CACHE_FILE,
    DISCREPANCIES_FILE,
    ENDPOINT_CHECK_FILE,
    ENERGY_GPUS_TAG,
    ENGINE_DEVICE_NAMES_TAG,
    ENGINE_FINDINGS_ERROR_TAG,
    ENGINE_FINDINGS_FILE,
    ENGINE_LOG_PREFIX,
    ENGINE_METRICS_FILE,
    ENGINE_TAG,
    ENGINE_WARNINGS_TAG,
    ENV_PREFIX,
    ERROR_TAG,
    EXPERIMENT_FILE,
    EXPERIMENT_TAG,
    GPU_MEMORY_FILE,
    GPUS_TAG,
    KEPT_TAG,
    KEPT_WORKLOADS_TAG,
    LADDER_OVER_TAG,
    LADDER_POINT_TAG,
    LADDER_PREFIX,
    LADDER_TAG,
    LAUNCH_TAG,
    LAUNCHER_TAG,
    LAUNCHES_TAG,
    LOGS_DIR,
    LOSSLESS_TAG,
    NODE_DIR,
    NODE_ERROR_TAG,
    NODE_MISMATCH_TAG,
    PREFIX_CACHE_RESET_NOTE_TAG,
    PREFIX_CACHE_RESET_TAG,
    PREFLIGHT_FILE,
    PREFLIGHT_TAG,
    PROBE_TAG,
    RECORD_FILE,
    REPEAT_TAG,
    REPEATS_ERROR_TAG,
    REPEATS_FILE,
    REPEATS_FRAME_FILE,
    REPLAY_FILE,
    REQUESTS_FILE,
    SPECULATION_BASELINE_TAG,
    SPECULATION_ERROR_TAG,
    SPECULATION_FILE,
    SPECULATION_VERDICT_TAG,
    STRUCTURED_FILE,
    SUMMARY_FILE,
    TRACE_FILE,
    TWIN_TAG,
    WORKLOAD_PREFIX,
    WORKLOAD_TAG,
    RunTags,
    cold_start_metric,
    provenance_path,
)
from k3pipe.core.provenance import git_commit
from k3pipe.core.secrets import redact_data, scrub
from k3pipe.engines import get_engine
from k3pipe.engines.base import Finding
from k3pipe.engines.observe import EngineLogFacts, phase_table
from k3pipe.experiment.preflight import hardware_mismatches
from k3pipe.experiment.speculation import SpeculationReport
from k3pipe.launchers import equivalent_command
from k3pipe.machine.cost import cell_cost, counted_label, energy_metrics
from k3pipe.machine.metrics import series_frame
from k3pipe.machine.node import NodeInfo, gpu_energy, gpu_memory_frame
from k3pipe.planning.coldstart import ColdStart
from k3pipe.planning.plan import ArmGpus, ArmPlan
from k3pipe.prompts.corpora import PromptSet
from k3pipe.records.derive import (
    COUNTS,
    compile_cache_params,
    compiles_inside,
    device_mismatch,
    flat,
    gateway_params,
    ms_of,
    probe_interval_metrics,
    repeat_metrics_of,
    summary_table,
    times_params,
    workload_times,
)
from k3pipe.records.runrecord import PromptsRef, RunRecord, prompts_artifact, prompts_digest
from k3pipe.records.tracking import KEY_METRICS, Tracker
from k3pipe.schema.specs import ExperimentSpec, WorkloadSpec
from k3pipe.sources import ModelRecord
from k3pipe.sources.images import ImageRecord
from k3pipe.verdicts.capacity import CapacityResult, Probe, summarize_searches

__all__ = [
    "ArmRecorder",
    "close_abandoned",
    "record_failed_arm",
    "record_preflight_stop",
    "record_speculation",
    "replay_frame",
]


class ArmRecorder:
    """Writes one arm's run; every method is safe to call after a failure."""

    def __init__(
        self,
        tracker: Tracker,
        plan: ArmPlan,
        tags: Mapping[str, str] | None = None,
        parent_id: str | None = None,
    ) -> None:
        self.tracker = tracker
        self.plan = plan
        launches = int((tags or {}).get(LAUNCHES_TAG, "1"))
        launch = (tags or {}).get(LAUNCH_TAG, "1")
        self.run_id = tracker.start_run(
            f"{plan.experiment}/{plan.arm}"
            + ("#prime" if launch == "0" else f"#{launch}" if launches > 1 else ""),
            tags={
                EXPERIMENT_TAG: plan.experiment,
                ARM_TAG: plan.arm,
                ENGINE_TAG: plan.engine,
                LAUNCHER_TAG: plan.launcher,
                **(tags or {}),
            },
            parent_id=parent_id,
        )
        self.workload_runs: dict[str, str] = {}
        # workloads with repeats: the metrics of each repeat logged so far, and which are still open
        self.repeat_metrics_of: dict[str, list[dict[str, float]]] = {}
        self._aborted: dict[str, set[int]] = {}  # per workload: its repeats cut short (numbers from 1)
        self._open: dict[str, WorkloadSpec] = {}
        self._single: dict[str, dict[str, float]] = {}
        self._bursty: set[str] = set()  # workloads whose client timing was bursty
        self._kept: list[str] = []  # workloads a resume kept from an earlier run of this launch
        self._last_end_ms: dict[str, int] = {}  # per workload: its latest response's end, wall clock
        # the measured windows so far, on the wall clock: (workload, or "workload repeat k"), start, end
        self.windows: list[tuple[str, float, float]] = []
        # probes per capacity search (by its run) and per workload: [prefix cache emptied, not emptied]
        self._resets: dict[str, list[int]] = {}
        self._searches: dict[str, list[CapacityResult]] = {}  # a capacity workload's searches so far
        self.engine_log_facts: EngineLogFacts | None = None
        """What the engine log said (set by :meth:`log_engine_findings`, so after :meth:`finish`)."""
        self.gpu_names: list[str] = []
        """nvidia-smi's names of the node's GPUs (set by :meth:`log_node`; empty without nvidia-smi)."""
        self.record: RunRecord | None = None
        """The run as a value (from :meth:`log_plan` on), written as run_record.json by :meth:`finish`."""
        self.rerun_of: str | None = None
        self.drift: list[str] = []
        self.gpus: ArmGpus = plan.gpus()
        """The GPUs the arm's engine holds (set by :meth:`log_gpus`; till then the spec's alone)."""
        self.gpus_counted: list[int] | None = self.gpus.counted(None)[0]
        """The nvidia-smi indexes the energy sums (None: every GPU sampled, the node's)."""
        self.node_gpus: int | None = None
        self._gpus_logged = False

    def log_plan(
        self,
        exp: ExperimentSpec,
        experiment_file: str,
        models: Mapping[str, ModelRecord],
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        """The plan, models and experiment as params and artifacts; ``extra`` params besides (the
        overrides the run was started with, ``override.*``)."""
        plan = self.plan
        cmd = plan.command
        params: dict[str, Any] = {
            "experiment": plan.experiment,
            "experiment_file": experiment_file,
            "arm": plan.arm,
            "engine": plan.engine,
            "engine_version_declared": plan.engine_version,
            "launcher": plan.launcher,
            "image": plan.image,
            "command": cmd.shell(),
            "base_url": plan.base_url,
            "model_id": plan.model,
            "api_key_env": plan.api_key_env,
            **gateway_params(plan),
            "k3pipe_commit": git_commit(),
            # the node restart noise is kept for where no GPU names it (k3pipe.records.priors)
            "node.host": socket.gethostname(),
            "client.processes": plan.client.processes or "auto",
            "client.cpus": plan.client.cpus,
            "client.realtime": plan.client.realtime,
            "launcher.cpus": ",".join(map(str, plan.launch.engine_cpus() or [])) or None,
            **flat(ENV_PREFIX, cmd.redacted_env()),
            **flat(ARG_PREFIX, redact_data(exp.arm(plan.arm).engine.args)),
            **compile_cache_params(plan),
            **(extra or {}),
        }
        for name, rec in models.items():
            params.update(
                {
                    f"{name}.source": rec.source,
                    f"{name}.id": rec.model_id,
                    f"{name}.revision": rec.requested_revision,
                    f"{name}.resolved_revision": rec.resolved_revision,
                    f"{name}.digest": rec.digest(),
                    f"{name}.path": rec.path,
                    f"{name}.files": len(rec.files),
                    f"{name}.bytes": rec.total_bytes,
                }
            )
            self.tracker.log_dict(self.run_id, rec.model_dump(), provenance_path(name))
        self.tracker.log_params(self.run_id, {k: v for k, v in params.items() if v is not None})
        # a secret written in the experiment is '***' in its records ({env.NAME} references stay)
        recorded = redact_data(exp.model_dump(mode="json"))
        self.tracker.log_dict(self.run_id, recorded, EXPERIMENT_FILE)
        self.record = RunRecord(
            experiment_name=exp.name,
            experiment_file=experiment_file,
            experiment=recorded,
            arm=plan.arm,
            models=dict(models),
            command=self.tracker.scrub(cmd.shell()),
            env={k: self.tracker.scrub(str(v)) for k, v in cmd.redacted_env().items()},
            unpinned_models=[
                f"engine.args.{path}={value}"
                for path, value in get_engine(plan.engine).unpinned_models(exp.arm(plan.arm).engine.args)
            ],
            k3pipe_commit=params["k3pipe_commit"],
            rerun_of=self.rerun_of,
            drift=list(self.drift),
        )
        self.tracker.log_text(
            self.run_id,
            "\n".join(
                [
                    "# environment set for the engine (secrets redacted)",
                    *(f"{k}={v}" for k, v in cmd.redacted_env().items()),
                    "# command",
                    cmd.shell(),
                    "",
                ]
            ),
            COMMAND_FILE,
        )

    def log_preflight(self, findings: list[Finding]) -> None:
        """The findings that concern this arm (and the experiment-wide ones)."""
        mine = [f for f in findings if f.arm in (None, self.plan.arm)]
        self.tracker.log_dict(self.run_id, [f.model_dump() for f in mine], PREFLIGHT_FILE)
        counts = {s: sum(f.severity == s for f in mine) for s in ("error", "warning", "info")}
        self.tracker.log_metrics(self.run_id, {f"preflight_{s}s": n for s, n in counts.items()})
        rules = sorted({f.rule for f in mine if f.severity != "info"})
        self.tracker.set_tags(self.run_id, {PREFLIGHT_TAG: ", ".join(rules) or "clean"})

    def log_prompts(self, workloads: Iterable[WorkloadSpec], prompts: Mapping[str, list[PromptSet]]) -> None:
        """Every prompt the arm will send, one artifact per workload repeat, and their digests in the
        record: a rerun sends these very prompts (verified) instead of drawing them again."""
        refs: list[PromptsRef] = []
        for workload in workloads:
            for repeat, prompt_set in enumerate(prompts.get(workload.name, [])):
                artifact = prompts_artifact(workload.name, repeat)
                self.tracker.log_dict(self.run_id, prompt_set.model_dump(mode="json"), artifact)
                seed = prompt_set.profile.get("seed")
                refs.append(
                    PromptsRef(
                        workload=workload.name,
                        repeat=repeat,
                        seed=int(seed) if isinstance(seed, int) else None,
                        dataset=prompt_set.name,
                        dataset_digest=prompt_set.digest,
                        sha256=prompts_digest(prompt_set),
                        count=len(prompt_set.prompts),
                        artifact=artifact,
                    )
                )
        if self.record is not None:
            self.record = self.record.model_copy(update={"prompts": refs})

    def log_image(self, image: ImageRecord, plan: ArmPlan) -> None:
        """The image as pinned: the digest a rerun must use, and the equivalent docker run."""
        if self.record is not None:
            self.record = self.record.model_copy(update={"image": image})
        self.tracker.log_params(
            self.run_id,
            {
                "image.registry": image.registry,
                "image.digest": image.digest,
                "image.pinned": image.pinned,
                "image.pulled": image.pulled,
                "docker_run": equivalent_command(plan, image.pinned),
            },
        )
        self.tracker.log_metrics(self.run_id, {"image_pull_s": image.duration_s})

    def log_engine(
        self, cold_start_s: float | None, version: str | None, check: EndpointCheck | None
    ) -> None:
        if cold_start_s is not None:
            self.tracker.log_metrics(self.run_id, {"cold_start_s": cold_start_s})
        if version:
            self.tracker.log_params(self.run_id, {"engine_version": version})
            if self.record is not None:
                self.record = self.record.model_copy(update={"engine_version": version})
        if check is not None:
            self.tracker.log_dict(self.run_id, check.model_dump(), ENDPOINT_CHECK_FILE)
            self.tracker.log_metrics(self.run_id, {"probe_first_delta_s": check.first_delta_s})

    def log_answers(self, record: ProbeRecord, lossless: str | None = None, twin: str | None = None) -> None:
        """The output probe's answers (answers.json), its time and count as metrics, and why it
        stopped, if it did (tag k3pipe.answers_error); the report compares the arms' answers.
        ``lossless``: the arm's setting that must not change greedy tokens (speculation), checked
        against the plain arm ``twin`` (tags k3pipe.answers_lossless and k3pipe.answers_twin)."""
        if lossless:
            self.tracker.set_tags(
                self.run_id, {LOSSLESS_TAG: lossless[:500], **({TWIN_TAG: twin} if twin else {})}
            )
        data = record.as_json()
        if record.error:
            data["error"] = scrub(record.error)
            self.tracker.set_tags(self.run_id, {ANSWERS_ERROR_TAG: scrub(record.error)[:500]})
        self.tracker.log_dict(self.run_id, data, ANSWERS_FILE)
        self.tracker.log_metrics(
            self.run_id,
            {
                "answers.seconds": record.seconds,
                "answers.prompts": len(record.answers),
                "answers.scored": int(
                    record.scored and all(a.logprobs is not None for a in record.answers.values())
                ),
            },
        )

    def log_accuracy(self, record: AccuracyRecord) -> None:
        """The accuracy set's verdicts (accuracy.json) and the score as metrics."""
        data = record.as_json()
        if record.error:
            data["error"] = scrub(record.error)
        self.tracker.log_dict(self.run_id, data, ACCURACY_FILE)
        self.tracker.log_metrics(
            self.run_id,
            {
                "accuracy.score": record.score,
                "accuracy.questions": len(record.right),
                "accuracy.seconds": record.seconds,
            },
        )

    def log_structured(self, record: StructuredRecord) -> None:
        """The tool-calling check (structured.json) and its counts as metrics."""
        data = record.as_json()
        if record.error:
            data["error"] = scrub(record.error)
        self.tracker.log_dict(self.run_id, redact_data(data), STRUCTURED_FILE)
        rate = record.per_1000()
        self.tracker.log_metrics(
            self.run_id,
            {
                "structured.requests": len(record.calls),
                "structured.failures": record.failures,
                "structured.failures_per_1000": rate[0] if rate else None,
                "structured.seconds": record.seconds,
            },
        )

    def log_workload(self, workload: WorkloadSpec, outcome: WorkloadOutcome) -> str:
        """One run of a workload, as soon as it ends: workload params, client summary, engine-side
        figures, per-request records, the /metrics series, the dataset and any client/engine
        disagreement. With repeats it is a nested run under the workload's run, which gets the
        statistics across repeats once the last repeat is in (or when the arm ends early)."""
        tags = self._workload_tags(workload)
        params = flat(WORKLOAD_PREFIX, workload.model_dump(mode="json"))
        tags["mlflow.note.content"] = (
            f"Workload **{workload.name}** of arm {self.plan.arm}: {workload.input_tokens:,} in / "
            f"{workload.output_tokens:,} out tokens, "
            + (
                f"the trace {workload.trace.path} replayed at {workload.trace.speed:g}x"
                if workload.trace is not None
                else f"{workload.dataset.kind} prompts, {workload.load} load "
                f"(concurrency {workload.concurrency})"
            )
            + f", {workload.num_requests} requests"
            + (f", {workload.repeats} repeats (nested runs)" if workload.repeats > 1 else "")
            + "."
        )
        times = workload_times(outcome.result)
        if times is not None:
            label = workload.name if workload.repeats == 1 else f"{workload.name} repeat {outcome.repeat + 1}"
            self.windows.append((label, times["measured_start_unix_s"], times["measured_end_unix_s"]))
        if workload.repeats == 1:
            run_id = self.tracker.start_run(
                f"{self.plan.arm}/{workload.name}",
                tags=tags,
                parent_id=self.run_id,
                start_ms=ms_of(times, "first_send_unix_s"),
            )
            self.workload_runs[workload.name] = run_id
            self._log_trace(run_id, workload)
            metrics = self._log_outcome(run_id, params, outcome)
            self.tracker.log_metrics(
                self.run_id, {f"{workload.name}.{k}": metrics.get(k) for k in KEY_METRICS}
            )
            return run_id
        parent = self._repeats_parent(workload, tags, params, ms_of(times, "first_send_unix_s"))
        k = outcome.repeat
        run_id = self.tracker.start_run(
            f"{self.plan.arm}/{workload.name}#{k + 1}",
            tags={
                **tags,
                REPEAT_TAG: str(k + 1),
                "mlflow.note.content": (
                    f"Repeat {k + 1} of {workload.repeats} of workload **{workload.name}** "
                    f"(seed {outcome.seed})."
                ),
            },
            parent_id=parent,
            start_ms=ms_of(times, "first_send_unix_s"),
        )
        repeat_params = {**params, "workload.seed": outcome.seed, "repeat": k + 1}
        metrics = self._log_outcome(run_id, repeat_params, outcome)
        self.repeat_metrics_of[workload.name].append({"repeat": float(k + 1), **metrics})
        if outcome.result.aborted or outcome.engine_lost:
            # cut short (an interrupt, a deadline, the engine lost): in no figure across repeats, and
            # the workload did not finish; the arm's end closes its run with the arm's status
            self._aborted.setdefault(workload.name, set()).add(k + 1)
        elif len(self.repeat_metrics_of[workload.name]) >= workload.repeats:
            self._close_repeats(workload.name, "FINISHED")
        return run_id

    def _workload_tags(self, workload: WorkloadSpec) -> dict[str, str]:
        return {
            EXPERIMENT_TAG: self.plan.experiment,
            ARM_TAG: self.plan.arm,
            WORKLOAD_TAG: workload.name,
        }

    def _repeats_parent(
        self,
        workload: WorkloadSpec,
        tags: Mapping[str, str],
        params: Mapping[str, Any],
        start_ms: int | None = None,
    ) -> str:
        """The run a workload's repeats nest under, started with its first repeat (at ``start_ms``,
        that repeat's first send, where known)."""
        parent = self.workload_runs.get(workload.name)
        if parent is None:
            parent = self.tracker.start_run(
                f"{self.plan.arm}/{workload.name}", tags=tags, parent_id=self.run_id, start_ms=start_ms
            )
            # registered before anything else can fail, so that finish() always closes it
            self.workload_runs[workload.name] = parent
            self.repeat_metrics_of[workload.name] = []
            self._open[workload.name] = workload
            self.tracker.log_params(parent, params)
            self._log_trace(parent, workload)
        return parent

    def _log_trace(self, run_id: str, workload: WorkloadSpec) -> None:
        """The trace a workload replays, on its run (the report draws its shape from it)."""
        if workload.trace is not None:
            trace = workload.loaded_trace()
            self.tracker.log_text(run_id, "\n".join(trace.lines()) + "\n", TRACE_FILE)

    # -- capacity searches (k3pipe.verdicts.capacity) ------------------------------------------------------

    def start_search(self, workload: WorkloadSpec, repeat: int, seed: int) -> str:
        """The run one capacity search's probes nest under: the workload's run (one repeat), or its
        repeat's run under it (the workload's run then gets the statistics across repeats)."""
        assert workload.capacity is not None
        tags = self._workload_tags(workload)
        params = flat(WORKLOAD_PREFIX, workload.model_dump(mode="json"))
        unit = "req/s" if workload.capacity.over == "rate" else "streams"
        tags["mlflow.note.content"] = (
            f"Capacity search of workload **{workload.name}** of arm {self.plan.arm}: the highest "
            f"{workload.capacity.over} ({unit}) whose requests meet the SLO "
            f"({workload.capacity.attainment_pct:g}% of them), each probe a nested run."
        )
        if workload.repeats == 1:
            run_id = self.tracker.start_run(
                f"{self.plan.arm}/{workload.name}", tags=tags, parent_id=self.run_id
            )
            self.workload_runs[workload.name] = run_id
            self.tracker.log_params(run_id, params)
            return run_id
        parent = self._repeats_parent(workload, tags, params)
        run_id = self.tracker.start_run(
            f"{self.plan.arm}/{workload.name}#{repeat + 1}",
            tags={**tags, REPEAT_TAG: str(repeat + 1)},
            parent_id=parent,
        )
        self.tracker.log_params(run_id, {**params, "workload.seed": seed, "repeat": repeat + 1})
        return run_id

    def log_probe(
        self,
        search_run: str,
        probe: WorkloadSpec,
        point: float,
        over: str,
        outcome: WorkloadOutcome,
        attainment: tuple[float, Mapping[str, float]],
        reset: bool,
        judged: Probe | None = None,
    ) -> str:
        """One probe of a capacity search: the workload's whole record at that load, and its SLO
        attainment from arrival (what the search judged it by); with ``judged`` (the search's
        :class:`~k3pipe.verdicts.capacity.Probe` of it), the requests it counted, those that met the SLO, the
        attainment's binomial interval and whether it was undecided (``probe.undecided`` 1: the
        interval holds the target)."""
        label = f"{point:.4g}rps" if over == "rate" else f"c{int(point)}"
        run_id = self.tracker.start_run(
            f"{self.plan.arm}/{probe.name}@{label}",
            tags={**self._workload_tags(probe), PROBE_TAG: label},
            parent_id=search_run,
            start_ms=ms_of(workload_times(outcome.result), "first_send_unix_s"),
        )
        pct, by = attainment
        self._resets.setdefault(search_run, [0, 0])[0 if reset else 1] += 1
        self.tracker.log_metrics(
            run_id,
            {
                "probe.slo_attainment_from_arrival_pct": pct,
                **{f"probe.slo_attainment_from_arrival.{k}_pct": v for k, v in by.items()},
                "probe.prefix_cache_reset": int(reset),
                **probe_interval_metrics(judged),
            },
        )
        params = {
            **flat(WORKLOAD_PREFIX, probe.model_dump(mode="json")),
            "probe.over": over,
            "probe.point": point,
            "workload.seed": outcome.seed,
        }
        self._log_outcome(run_id, params, outcome)
        return run_id

    def log_capacity(self, search_run: str, workload: WorkloadSpec, result: CapacityResult) -> None:
        """A search's answer on its run (:meth:`~k3pipe.verdicts.capacity.CapacityResult.metrics`):
        ``capacity_rps`` (or ``capacity_concurrency``) where a pass and a fail surround it, the lowest
        failing point, probes, cliff; the bound otherwise (``_at_least``); ``capacity.json`` with every
        probe and its attainment's interval. One repeat: the workload's run, closed; else the repeat's
        run, closed, and the workload's once every repeat is in, with the capacity's interval across
        them."""
        assert workload.capacity is not None
        key = result.key
        unit = "req/s" if result.over == "rate" else "streams"
        metrics = result.metrics()
        self.tracker.log_metrics(search_run, metrics)
        self.tracker.set_tags(
            search_run,
            {
                CAPACITY_TAG: result.describe(unit),
                CAPACITY_BINDING_TAG: result.binding,
                CAPACITY_CENSORED_TAG: result.censored,
            },
        )
        self._tag_probe_resets(search_run, workload)
        self.tracker.log_dict(search_run, result.record(), CAPACITY_FILE)
        if workload.repeats == 1:
            self._single[workload.name] = metrics
            # a search that only bounded it (every probe passed, or none): its bound, named so
            bound = f"{key}_at_least"
            self.tracker.log_metrics(
                self.run_id,
                {f"{workload.name}.{key}": metrics.get(key), f"{workload.name}.{bound}": metrics.get(bound)},
            )
            found = result.capacity is not None or result.censored is not None
            self.tracker.end_run(search_run, "FINISHED" if found else "FAILED")
            return
        self.tracker.end_run(search_run, "FINISHED")
        self.repeat_metrics_of[workload.name].append(metrics)
        searches = self._searches.setdefault(workload.name, [])
        searches.append(result)
        if len(self.repeat_metrics_of[workload.name]) >= workload.repeats:
            self._log_capacity_interval(workload.name, searches, unit)
            self._close_repeats(workload.name, "FINISHED")
            means = self.workload_metrics(workload.name)
            self.tracker.log_metrics(self.run_id, {f"{workload.name}.{key}": means.get(key)})

    def _log_capacity_interval(self, name: str, searches: list[CapacityResult], unit: str) -> None:
        """The capacity across a workload's searches (its repeats, one launch) by the verdicts' rule
        (:func:`k3pipe.verdicts.capacity.summarize_searches`: bracket middles, the bracket's width counted) on
        its run: ``capacity_rps_estimate`` with ``_estimate_low`` / ``_estimate_high`` (95%), and
        the tag ``k3pipe.capacity`` saying it in words. The repeats' generic ``capacity_rps.ci95_*``
        beside them is the mean of the last passing loads, the bracket not counted."""
        run_id = self.workload_runs.get(name)
        if run_id is None or not searches:
            return
        summary = summarize_searches(searches)
        key = searches[0].key
        est = summary.estimate
        metrics: dict[str, float] = {}
        if est is not None:
            metrics[f"{key}_estimate"] = est.mean
            interval = est.interval(0.95)
            if interval is not None:
                metrics[f"{key}_estimate_low"], metrics[f"{key}_estimate_high"] = interval
        self.tracker.log_metrics(run_id, metrics)
        self.tracker.set_tags(run_id, {CAPACITY_TAG: summary.describe(unit)})

    def _tag_probe_resets(self, search_run: str, workload: WorkloadSpec) -> None:
        """``k3pipe.prefix_cache_reset`` on the search's run and the workload's (all its searches so
        far): '1' the prefix cache was emptied before every probe, '0' not before some (their TTFT
        may be a cache's: ``k3pipe.prefix_cache_reset_note`` says how many), 'off' the workload said
        not to empty it."""
        assert workload.capacity is not None
        done, missed = self._resets.get(search_run, [0, 0])
        total = self._resets.setdefault(f"workload:{workload.name}", [0, 0])
        total[0] += done
        total[1] += missed
        runs = ((search_run, (done, missed)), (self.workload_runs.get(workload.name), total))
        for run_id, (ok, not_ok) in runs:
            if run_id is None:
                continue
            tags: dict[str, str | None]
            if not workload.capacity.reset_prefix_cache:
                tags = {PREFIX_CACHE_RESET_TAG: "off"}
            else:
                tags = {
                    PREFIX_CACHE_RESET_TAG: "0" if not_ok else "1",
                    PREFIX_CACHE_RESET_NOTE_TAG: (
                        f"the prefix cache could not be emptied before {not_ok} of {ok + not_ok} probes"
                        if not_ok
                        else None
                    ),
                }
            self.tracker.set_tags(run_id, tags)

    def tag_rung(self, name: str, ladder: str, over: str, point: float, reset: bool) -> None:
        """Mark a ladder point's workload run: which ladder, which load, whether the prefix cache was
        emptied before it."""
        run_id = self.workload_runs.get(name)
        if run_id is None:
            return
        self.tracker.set_tags(
            run_id,
            {
                LADDER_TAG: ladder,
                LADDER_OVER_TAG: over,
                LADDER_POINT_TAG: repr(point),
                PREFIX_CACHE_RESET_TAG: str(int(reset)),
            },
        )

    def log_ladder(self, name: str, summary: str) -> None:
        """How a ladder went (its points, where it ended and why), on the arm's run."""
        self.tracker.set_tags(self.run_id, {f"{LADDER_PREFIX}{name}": summary})

    def adopt_workload(self, workload: WorkloadSpec, run_id: str, measured_by: str) -> None:
        """A workload that finished under an earlier run of this launch, kept by a resume: its run
        moved under this one (tagged :data:`k3pipe.jobs.resume.KEPT_TAG`, measured on that run's engine
        start), its figures read back for the arm's summary and key metrics."""
        self.tracker.set_tags(
            run_id,
            {
                "mlflow.parentRunId": self.run_id,
                KEPT_TAG: (
                    f"measured under arm run {measured_by} (an earlier engine start of this launch), "
                    "which did not finish; kept by a resume, not run again"
                ),
            },
        )
        self.workload_runs[workload.name] = run_id
        if workload.repeats == 1:
            run = self.tracker.client.get_run(run_id)
            metrics = dict(run.data.metrics)
            self._single[workload.name] = metrics
            if run.data.tags.get(CLIENT_TIMING_TAG) == "bursty":
                self._bursty.add(workload.name)
        else:
            repeats = [r for r in self.tracker.children(run_id) if r.data.tags.get(REPEAT_TAG)]
            repeats.sort(key=lambda r: int(r.data.tags[REPEAT_TAG]))
            self.repeat_metrics_of[workload.name] = [
                {**r.data.metrics, "repeat": float(r.data.tags[REPEAT_TAG])} for r in repeats
            ]
            if any(r.data.tags.get(CLIENT_TIMING_TAG) == "bursty" for r in repeats):
                self._bursty.add(workload.name)
            stats = aggregate_repeats(self.repeat_metrics_of[workload.name])
            metrics = {k: v.mean for k, v in stats.items()}
        self.tracker.log_metrics(self.run_id, {f"{workload.name}.{k}": metrics.get(k) for k in KEY_METRICS})
        if self._bursty:
            self.tracker.set_tags(self.run_id, {BURSTY_WORKLOADS_TAG: ",".join(sorted(self._bursty))})
        kept = sorted(set(self._kept) | {workload.name})
        self._kept = kept
        self.tracker.set_tags(self.run_id, {KEPT_WORKLOADS_TAG: ",".join(kept)})

    def repeat_metrics(self, name: str) -> list[dict[str, float]]:
        """A workload's metrics, one mapping per repeat measured (one for a single-repeat workload)."""
        per_repeat = self.repeat_metrics_of.get(name)
        if per_repeat is None:
            return [dict(self._single[name])] if name in self._single else []
        return [dict(m) for m in per_repeat]

    def workload_metrics(self, name: str) -> dict[str, float]:
        """What the arm's summary table shows for a workload: its metrics, or across repeats the means
        of its figures and the sums of its request counts."""
        per_repeat = self.repeat_metrics_of.get(name)
        if per_repeat is None:
            return dict(self._single.get(name, {}))
        means = {k: v.mean for k, v in aggregate_repeats(per_repeat).items() if k != "repeat"}
        # counts add up across repeats (a mean of 15.67 completed requests reads as a bug)
        for count in COUNTS:
            if count in means:
                means[count] = sum(m.get(count, 0.0) for m in per_repeat)
        return means

    def _log_outcome(
        self, run_id: str, params: Mapping[str, Any], outcome: WorkloadOutcome
    ) -> dict[str, float]:
        result, summary = outcome.result, outcome.summary
        costs: dict[str, float] = {}
        times = workload_times(result)
        end_ms = ms_of(times, "last_end_unix_s")
        if end_ms is not None:
            self._last_end_ms[result.workload] = end_ms
        try:
            self.tracker.log_params(run_id, {**params, **times_params(times)})
            if outcome.prompts is not None:
                self.tracker.log_dataset(run_id, outcome.prompts)
            metrics = summary.metrics()
            self.tracker.log_metrics(run_id, metrics)
            self.tracker.log_frame(run_id, records_frame(result), REQUESTS_FILE)
            if outcome.scrapes:
                self.tracker.log_frame(
                    run_id, series_frame(outcome.scrapes, result.t_start), ENGINE_METRICS_FILE
                )
            if not self._gpus_logged:
                self.log_gpus(self.gpus, None)
            costs = self._log_gpu_memory(run_id, outcome, metrics) | cell_cost(
                metrics, self.plan.hardware, self.gpus.count
            )
            self.tracker.log_metrics(run_id, costs)
            self.tracker.log_metrics(run_id, outcome.engine_metrics)
            if outcome.replay_records:
                self.tracker.log_metrics(run_id, outcome.replay)
                self.tracker.log_frame(run_id, replay_frame(outcome.replay_records), REPLAY_FILE)
            self.tracker.log_metrics(run_id, {"client_engine_discrepancies": len(outcome.discrepancies)})
            if outcome.discrepancies:
                self.tracker.log_dict(run_id, [asdict(d) for d in outcome.discrepancies], DISCREPANCIES_FILE)
            self.tracker.log_dict(run_id, summary.model_dump(mode="json"), SUMMARY_FILE)
            if result.client_load:
                self.tracker.log_dict(
                    run_id, [c.model_dump(mode="json") for c in result.client_load], CLIENT_LOAD_FILE
                )
            note = timing_note({**metrics, **outcome.engine_metrics})
            self.tracker.set_tags(
                run_id,
                {CLIENT_TIMING_TAG: "bursty" if note else "ok", CLIENT_TIMING_NOTE_TAG: note},
            )
            if note:
                self._bursty.add(result.workload)
                self.tracker.set_tags(self.run_id, {BURSTY_WORKLOADS_TAG: ",".join(sorted(self._bursty))})
            aborted = result.aborted or outcome.engine_lost
            if aborted:
                # ended early (the engine lost, an interrupt): what it measured is here, marked so
                self.tracker.set_tags(run_id, {ABORTED_TAG: aborted})
                self.tracker.end_run(run_id, "KILLED" if outcome.interrupted else "FAILED", end_ms)
            else:
                failed = bool(metrics.get("failed"))
                self.tracker.end_run(
                    run_id, "FAILED" if failed and not metrics.get("completed") else "FINISHED", end_ms
                )
        except BaseException:
            self.tracker.end_run(run_id, "FAILED")
            raise
        every = {**metrics, **outcome.engine_metrics, **outcome.replay, **costs}
        self._single[result.workload] = every
        return every

    def _close_repeats(self, name: str, status: str) -> None:
        """Log the statistics across the repeats in so far on the workload's run, and close it."""
        workload = self._open.pop(name, None)
        run_id = self.workload_runs.get(name)
        if workload is None or run_id is None:
            return
        every = self.repeat_metrics_of.get(name, [])
        aborted = self._aborted.get(name, set())
        # a repeat cut short is in no figure across repeats (docs/measurement.md, "A launch cut
        # short"); repeats.parquet keeps its row, marked
        per_repeat = [m for m in every if int(m.get("repeat", 0)) not in aborted]
        try:
            stats = aggregate_repeats(per_repeat) if per_repeat else {}
            stats.pop("repeat", None)
            self.tracker.log_metrics(run_id, repeat_metrics_of(stats))
            self.tracker.log_metrics(
                run_id,
                {
                    "repeats": len(per_repeat),
                    "repeats_planned": workload.repeats,
                    "repeats_aborted": len(aborted),
                },
            )
            self.tracker.log_dict(run_id, {k: v.model_dump() for k, v in stats.items()}, REPEATS_FILE)
            if every:
                frame = pd.DataFrame(every)
                frame["aborted"] = [int(int(m.get("repeat", 0)) in aborted) for m in every]
                self.tracker.log_frame(run_id, frame, REPEATS_FRAME_FILE)
            means = {k: v.mean for k, v in stats.items()}
            self.tracker.log_metrics(self.run_id, {f"{name}.{k}": means.get(k) for k in KEY_METRICS})
        finally:
            done = len(per_repeat) >= workload.repeats and not aborted
            # a workload whose repeats did not all run did not finish, whatever the arm's status;
            # it ended with its last repeat's last response where that is known
            self.tracker.end_run(
                run_id, status if done or status != "FINISHED" else "FAILED", self._last_end_ms.get(name)
            )

    def log_engine_findings(self, log_path: Path) -> EngineLogFacts | None:
        """What the engine's own log says: start-up phases, KV pool, throughput, warnings."""
        if not log_path.exists():
            return None
        with log_path.open(errors="replace") as fh:
            facts = get_engine(self.plan.engine).parse_log(fh)
        self.engine_log_facts = facts
        untuned = facts.untuned_kernels
        self.tracker.log_dict(self.run_id, facts.model_dump(mode="json"), ENGINE_FINDINGS_FILE)
        self.tracker.log_metrics(
            self.run_id,
            {
                f"{ENGINE_LOG_PREFIX}{name}": getattr(facts, name)
                for name in (
                    "startup_s",
                    "kv_pool_tokens",
                    "kv_cache_memory_gib",
                    "max_concurrency",
                    "max_running_requests",
                    "cuda_graph_capture_s",
                    "weight_load_s",
                    "decode_throughput_max_tps",
                    "decode_throughput_mean_tps",
                    "spec_accept_length_mean",
                )
            }
            | {"engine_log.warnings": len(facts.warnings), "engine_log.ready": int(facts.ready)}
            # every line saying memory ran out, counted (0 is a finding too), and on how many ranks
            | {
                "engine_log.oom_lines": facts.oom.lines if facts.oom else 0,
                "engine_log.oom_ranks": len(facts.oom.ranks) if facts.oom else 0,
                "engine_log.untuned_kernel_lines": untuned.lines if untuned else 0,
            },
        )
        wrong_device = self._check_device_names(facts)
        # the count first: 32 OOM retries are not one warning among others
        said = [facts.oom.describe("GPU memory ran out")] if facts.oom else []
        said += ([wrong_device] if wrong_device else []) + facts.warnings + self._place_compiles(facts)
        if untuned:
            # "Performance might be sub-optimal!": both engines' default config (none tuned for the device),
            # and SGLang 0.5.16's fallback to a config tuned under another Triton version
            # (fused_moe_triton_config.py:135-138); the first message says which
            said.append(
                untuned.describe(
                    "a kernel ran on a config its engine calls possibly sub-optimal (the default, none "
                    "tuned for the device, or one tuned under another Triton version)"
                )
            )
        if said:
            warnings = scrub(" | ".join(s.replace(" | ", " / ") for s in said))[:4000]
            self.tracker.set_tags(self.run_id, {ENGINE_WARNINGS_TAG: warnings})
        self._log_phases(facts)
        return facts

    def _place_compiles(self, facts: EngineLogFacts) -> list[str]:
        """Kernels the engine compiled while serving, against the measured windows of this arm's
        workloads: metrics ``engine_log.serving_compiles`` (every such line) and
        ``engine_log.serving_compiles_measured`` (those whose second overlaps a measured window), and a
        warning per line inside a window naming the window (a latency spike in its figures). Those
        outside (the endpoint probe, the warm-ups) are in engine_findings.json alone. The log's stamps
        are read as this machine's local time (the engine's, when k3pipe launched it here)."""
        if not facts.serving_compiles:
            return []
        fmt = get_engine(self.plan.engine).log_patterns.format
        inside, said = compiles_inside(facts.serving_compiles, self.windows, fmt)
        self.tracker.log_metrics(
            self.run_id,
            {
                "engine_log.serving_compiles": len(facts.serving_compiles),
                "engine_log.serving_compiles_measured": inside,
            },
        )
        return said

    def _check_device_names(self, facts: EngineLogFacts) -> str | None:
        """The device names the engine chose kernels by, against nvidia-smi's, else the experiment's
        ``hardware.gpu_name`` (each of its words in the logged name) (field notes' pitfall 4: SGLang
        named a B300 "NVIDIA L20D"): tag ``k3pipe.engine_device_names``, metric
        ``engine_log.device_name_mismatch`` (where there is a name to compare with) and the warning,
        or None."""
        if not facts.device_names:
            return None
        self.tracker.set_tags(self.run_id, {ENGINE_DEVICE_NAMES_TAG: ", ".join(facts.device_names)})
        compared = device_mismatch(facts.device_names, self.gpu_names, self.plan.hardware)
        if compared is None:
            return None
        wrong, named = compared
        self.tracker.log_metrics(self.run_id, {"engine_log.device_name_mismatch": int(bool(wrong))})
        if not wrong:
            return None
        return (
            f"the engine chose kernels for device {', '.join(wrong)} but {named}: kernel configs and "
            "backends picked by device name may not be this GPU's"
        )

    def _log_phases(self, facts: EngineLogFacts) -> None:
        """The cold-start phase table: metrics ``cold_start.<phase>_s``, cold_start_phases.json/.txt."""
        if not facts.cold_start_phases:
            return
        self.tracker.log_metrics(
            self.run_id, {cold_start_metric(p.phase): p.seconds for p in facts.cold_start_phases}
        )
        self.tracker.log_dict(
            self.run_id, [p.model_dump() for p in facts.cold_start_phases], COLD_START_PHASES_FILE
        )
        self.tracker.log_text(self.run_id, phase_table(facts.cold_start_phases), COLD_START_TABLE_FILE)

    def log_cold_start(self, cold: ColdStart) -> None:
        """What the compile cache did for this launch: ``compile_cache.hit``, and on a hit the cold
        start of the launch that filled it (``compile_cache.first_cold_start_s``, its run and date)
        and ``compile_cache.warm_over_cold`` (this cold start over that one)."""
        cache = cold.compile_cache
        if cache is None:
            return
        self.tracker.log_metrics(
            self.run_id,
            {
                "compile_cache.hit": int(cache.hit),
                "compile_cache.files_before": cache.files_before,
                "compile_cache.files_written": cache.files_written,
                "compile_cache.bytes": cache.bytes_total,
                "compile_cache.first_cold_start_s": cache.first_cold_start_s,
                "compile_cache.warm_over_cold": cold.warm_over_cold,
            },
        )
        self.tracker.log_params(
            self.run_id,
            {
                k: v
                for k, v in {
                    "compile_cache.engine_dir": cache.engine_dir,
                    "compile_cache.evidence": cache.evidence,
                    "compile_cache.first_run_id": cache.first_run_id,
                    "compile_cache.first_date": cache.first_date,
                }.items()
                if v is not None
            },
        )
        planned = self.plan.compile_cache
        factors = planned.factors if planned is not None else None
        env = planned.env if planned is not None else None
        self.tracker.log_dict(
            self.run_id, {**cache.model_dump(), "env": env, "factors": factors}, COMPILE_CACHE_FILE
        )

    def log_node(self, node: NodeInfo | None) -> None:
        """The node: params ``node.*``, nvidia-smi's output before launch, ``nvidia-smi topo -m`` (when
        it answered) and the engine's NCCL / symmetric-memory environment (nothing without nvidia-smi)."""
        if node is None:
            return
        self.gpu_names = sorted({g.name for g in node.gpus})
        self.tracker.log_params(self.run_id, node.params())
        if self.plan.hardware is not None:
            wrong = hardware_mismatches(self.plan.hardware, node.gpus)
            self.tracker.log_metrics(self.run_id, {"node.hardware_mismatch": int(bool(wrong))})
            if wrong:
                self.tracker.set_tags(self.run_id, {NODE_MISMATCH_TAG: " | ".join(wrong)[:4000]})
        self.tracker.log_text(self.run_id, node.nvidia_smi, f"{NODE_DIR}/nvidia-smi-before.txt")
        if node.topology is not None:
            self.tracker.log_text(self.run_id, node.topology, f"{NODE_DIR}/nvidia-smi-topo.txt")
        self.tracker.log_dict(self.run_id, node.comm_env, f"{NODE_DIR}/comm-env.json")

    def log_gpus(self, gpus: ArmGpus, node: NodeInfo | None) -> None:
        """The GPUs the arm's engine holds (``gpus``, placed on the node nvidia-smi listed, None
        without it): params ``gpus.*`` and the tag ``k3pipe.gpus`` ('GPUs 0,1 of 8'). From here on
        each workload's energy sums those GPUs' power where their indexes are known, and its cost
        rents ``gpus.count`` GPUs. Call it before the workloads (a workload logs the spec's alone)."""
        listed = [g.uuid for g in node.gpus] if node is not None else None
        self.gpus = gpus
        self.gpus_counted = gpus.counted(listed)[0]
        self.node_gpus = len(listed) if listed is not None else None
        self._gpus_logged = True
        self.tracker.log_params(self.run_id, gpus.params(listed))
        self.tracker.set_tags(self.run_id, {GPUS_TAG: self.gpus_label()})

    def gpus_label(self) -> str:
        """What this arm's energy and per-GPU figures count ('GPUs 0,1 of 8', 'node-wide: 8 GPUs')."""
        fallback = self.plan.hardware.gpu_count if self.plan.hardware is not None else None
        return counted_label(self.gpus.count, self.gpus_counted, self.gpus.basis, self.node_gpus, fallback)

    def log_nvidia_smi_after(self, report: str | None) -> None:
        """nvidia-smi's output after teardown (what the engine left behind); never raises."""
        if report is None:
            return
        try:
            self.tracker.log_text(self.run_id, report, f"{NODE_DIR}/nvidia-smi-after.txt")
        except Exception as exc:  # a bonus: never lose the run over it
            self.tracker.set_tags(self.run_id, {NODE_ERROR_TAG: repr(exc)[:500]})

    def _log_gpu_memory(
        self, run_id: str, outcome: WorkloadOutcome, metrics: Mapping[str, float]
    ) -> dict[str, float]:
        """The GPU samples as gpu_memory.parquet (every GPU of the node), the peak memory, and the
        energy figures of :func:`k3pipe.machine.cost.energy_metrics` over the arm's GPUs (returned, not
        logged; the run's tag ``k3pipe.energy_gpus`` says which GPUs they sum)."""
        if not outcome.gpu_memory:
            return {}
        result = outcome.result
        frame = gpu_memory_frame(outcome.gpu_memory, result.t_start)
        self.tracker.log_frame(run_id, frame, GPU_MEMORY_FILE)
        peak = max(s.memory_used_mib for s in outcome.gpu_memory)
        self.tracker.log_metrics(run_id, {"gpu_memory_used_mib_max": peak})
        energy = gpu_energy(outcome.gpu_memory, result.t_start, result.t_end, self.gpus_counted)
        if energy is not None:
            self.tracker.set_tags(run_id, {ENERGY_GPUS_TAG: self.gpus_label()})
        return energy_metrics(energy, metrics)

    def finish(self, status: str, error: BaseException | None = None, log_path: Path | None = None) -> None:
        """Close workload runs whose repeats did not all run, attach the engine log, its findings and
        the error (if any), then close the arm's run with ``status``."""
        try:
            for name in list(self._open):
                try:
                    self._close_repeats(name, "FAILED" if status == "FINISHED" else status)
                except Exception as exc:  # never lose the arm's own run over a workload's
                    self.tracker.set_tags(self.run_id, {REPEATS_ERROR_TAG: repr(exc)[:500]})
            if log_path is not None:
                self.tracker.log_file(self.run_id, log_path, LOGS_DIR)
                try:
                    self.log_engine_findings(log_path)
                except Exception as exc:  # findings are a bonus: never lose the run over them
                    self.tracker.set_tags(self.run_id, {ENGINE_FINDINGS_ERROR_TAG: repr(exc)[:500]})
            if error is not None:
                self.tracker.set_tags(
                    self.run_id, {ERROR_TAG: scrub(f"{type(error).__name__}: {error}")[:4000]}
                )
                self.tracker.log_text(
                    self.run_id,
                    "".join(traceback.format_exception(type(error), error, error.__traceback__)),
                    "error.txt",
                )
        finally:
            try:
                if self.record is not None:
                    self.tracker.log_dict(self.run_id, self.record.model_dump(mode="json"), RECORD_FILE)
                with contextlib.suppress(
                    Exception
                ):  # a description is for people: never lose the run over it
                    self.tracker.describe(self.run_id, self.description(status, error))
            finally:
                self.tracker.end_run(self.run_id, status)

    def description(self, status: str, error: BaseException | None = None) -> str:
        """What the run was, for a person browsing MLflow: the arm, its launch, how it ended, and its
        workloads' summary table (Markdown)."""
        plan = self.plan
        lines = [
            f"Arm **{plan.arm}** of experiment **{plan.experiment}**: {plan.engine}"
            + (f" {plan.engine_version}" if plan.engine_version else "")
            + f" on launcher {plan.launcher}, endpoint {plan.base_url} (model `{plan.model}`)"
            + (
                f", benchmarked through the gateway {plan.gateway.base_url} (model `{plan.gateway.model}`)"
                if plan.gateway
                else ""
            )
            + f". {status}"
            + (f": {type(error).__name__}: {error}" if error is not None else "."),
        ]
        if self.rerun_of:
            lines.append(
                f"Rerun of `{self.rerun_of}`"
                + (f" with drift: {'; '.join(self.drift)}" if self.drift else ".")
            )
        rows = [{"workload": name, **self.workload_metrics(name)} for name in self.workload_runs]
        table = summary_table(rows)
        if table:
            headers = ["workload", *[c for c in table[0] if c not in ("arm", "workload")]]
            lines += ["", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
            for row, raw in zip(table, rows, strict=True):
                cells = [str(raw["workload"]), *(str(row.get(h, "-")) for h in headers[1:])]
                lines.append("| " + " | ".join(cells) + " |")
        return self.tracker.scrub("\n".join(lines))


def record_failed_arm(
    tracker: Tracker,
    experiment: str,
    arm: str,
    engine: str,
    error: str,
    tags: Mapping[str, str] | None = None,
    parent_id: str | None = None,
) -> str:
    """A FAILED run for an arm that could not start at all (its inputs could not be had)."""
    run_id = tracker.start_run(
        f"{experiment}/{arm}",
        tags={
            EXPERIMENT_TAG: experiment,
            ARM_TAG: arm,
            ENGINE_TAG: engine,
            ERROR_TAG: scrub(error)[:4000],
            **(tags or {}),
        },
        parent_id=parent_id,
    )
    tracker.end_run(run_id, "FAILED")
    return run_id


def close_abandoned(tracker: Tracker, run_id: str, why: str, upward: bool = True) -> list[str]:
    """End as KILLED a run whose process died without ending it (SIGKILL, the OOM killer), with its
    nested runs and (``upward``) the runs above it that are still RUNNING, ``why`` on each; returns
    their ids. A run that has ended already is left as it is. A fleet launch's arm run (tagged
    ``k3pipe.pool``) is the top of what its process ran: the study above it is another process's."""
    closed = []
    todo = [run_id]
    seen = set()
    while todo:  # the run, then its descendants
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        try:
            run = tracker.client.get_run(current)
        except MlflowException:
            continue
        todo += [child.info.run_id for child in tracker.children(current)]
        if run.info.status == "RUNNING":
            tracker.set_tags(current, {ERROR_TAG: why})
            tracker.end_run(current, "KILLED")
            closed.append(current)
        mine_above = upward and current == run_id and not RunTags.of(run).pool
        parent = run.data.tags.get("mlflow.parentRunId") if mine_above else None
        while parent:  # a study or retest the same process ran
            try:
                above = tracker.client.get_run(parent)
            except MlflowException:
                break
            if above.info.status == "RUNNING":
                tracker.set_tags(parent, {ERROR_TAG: why})
                tracker.end_run(parent, "KILLED")
                closed.append(parent)
            parent = above.data.tags.get("mlflow.parentRunId")
    return closed


def record_preflight_stop(
    tracker: Tracker,
    experiment: str,
    arm: str,
    findings: list[Finding],
    tags: Mapping[str, str] | None = None,
    parent_id: str | None = None,
) -> str:
    """A FAILED run for an arm that preflight stopped before launch: its findings and why."""
    run_id = tracker.start_run(
        f"{experiment}/{arm}",
        tags={EXPERIMENT_TAG: experiment, ARM_TAG: arm, **(tags or {})},
        parent_id=parent_id,
    )
    mine = [f for f in findings if f.arm in (None, arm)]
    errors = [f for f in mine if f.severity == "error"]
    tracker.log_dict(run_id, [f.model_dump() for f in mine], PREFLIGHT_FILE)
    tracker.log_metrics(run_id, {"preflight_errors": len(errors)})
    if errors:
        why = "preflight: " + "; ".join(f.rule for f in errors)
    else:  # stopped by the errors of other arms: the job launches nothing when any arm has one
        others = sorted({f.arm for f in findings if f.severity == "error" and f.arm})
        rules = "; ".join(sorted({f.rule for f in findings if f.severity == "error"}))
        why = f"preflight: not launched: preflight found errors in arm(s) {', '.join(others)} ({rules})"
    tracker.set_tags(run_id, {ERROR_TAG: why})
    tracker.end_run(run_id, "FAILED")
    return run_id


def record_speculation(tracker: Tracker, run_ids: Mapping[str, str], report: SpeculationReport) -> None:
    """On each speculative arm's run (``run_ids``: arm -> MLflow run id, closed runs are fine): the
    arm's judgement as ``speculation.json``, metrics ``speculation.<workload>.throughput_ratio``,
    ``.tpot_ratio`` and ``.accept_length``, and the tags ``k3pipe.speculation_verdict`` (the verdict
    counts) and ``k3pipe.speculation_baseline``. A store error is tagged on that run, never raised."""
    for arm in report.arms:
        run_id = run_ids.get(arm.arm)
        if run_id is None:
            continue
        try:
            tracker.log_dict(
                run_id,
                {
                    "accept_length_threshold": report.accept_length_threshold,
                    "noise_margin": report.noise_margin,
                    **arm.model_dump(mode="json"),
                },
                SPECULATION_FILE,
            )
            metrics: dict[str, float | None] = {}
            for v in arm.workloads:
                metrics[f"speculation.{v.workload}.throughput_ratio"] = v.throughput_ratio
                metrics[f"speculation.{v.workload}.tpot_ratio"] = v.tpot_ratio
                metrics[f"speculation.{v.workload}.accept_length"] = v.accept_length
            tracker.log_metrics(run_id, metrics)
            tracker.set_tags(
                run_id,
                {
                    SPECULATION_VERDICT_TAG: arm.summary,
                    SPECULATION_BASELINE_TAG: arm.baseline.baseline or "none",
                },
            )
        except Exception as exc:  # a judgement after the fact: never lose the flow over it
            tracker.set_tags(run_id, {SPECULATION_ERROR_TAG: repr(exc)[:500]})


def replay_frame(records: Iterable[ReplayRecord]) -> pd.DataFrame:
    """A replay's requests, one row each (k3pipe.core.layout.REPLAY_FILE)."""
    return pd.DataFrame(
        [
            {
                "index": r.index,
                "planned_s": r.planned_s,
                "ready_s": r.ready_s,
                "sent_s": r.sent_s,
                "done_s": r.done_s,
                "lag_ms": None if r.lag_s is None else r.lag_s * 1000.0,
                "ok": r.ok,
                "skipped": r.skipped,
            }
            for r in records
        ],
        columns=["index", "planned_s", "ready_s", "sent_s", "done_s", "lag_ms", "ok", "skipped"],
    )
