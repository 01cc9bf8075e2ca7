"""One arm's lifetime, owned by the library: launch, wait, gate, workloads, findings, teardown.

:class:`ArmRun` is a context manager. Entering it renders the arm's plan and opens its MLflow run.
:meth:`ArmRun.launch` records the plan, the prompts and the preflight findings, pulls the image,
starts the engine, waits for it and proves the endpoint. :meth:`ArmRun.run_workloads` runs every
workload repeat by repeat, each recorded as soon as it ends. Leaving it, on every path (an error,
Ctrl-C, a kill signal turned into an exception), stops the engine it started and closes the run
with a status: ``FINISHED`` when every request of every workload completed, ``FAILED`` otherwise,
``KILLED`` when interrupted. An ordinary error is recorded and kept in the :class:`ArmOutcome` (so
that a study goes on with its other arms); an interrupt goes on up. :meth:`ArmRun.execute` is the
three together.

The steps themselves are an :class:`ArmSteps`: :meth:`ArmSteps.library` calls the library
functions directly; the Prefect flow passes its tasks instead (the same signatures), so that each
step is a task run in the UI while the lifetime stays here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

from pydantic import BaseModel, Field, SecretStr

from k3pipe.bench.accuracy import AccuracyRecord, load_questions, run_accuracy
from k3pipe.bench.health import (
    EndpointCheck,
    check_endpoint,
    engine_version,
    gate_target,
    reset_prefix_cache,
    wait_ready,
)
from k3pipe.bench.probe import ProbeRecord, dialect_of, draw_prompts, run_probe
from k3pipe.bench.session import WorkloadOutcome, benchmark_workload, deliver
from k3pipe.bench.structured import StructuredRecord, run_structured
from k3pipe.core.errors import EngineLostError, SpecError
from k3pipe.core.layout import LADDER_POINT_TAG, LAUNCH_TAG, MLFLOW_RUN_LABEL, RERUN_DRIFT_TAG, RERUN_TAG
from k3pipe.core.secrets import register, scrub
from k3pipe.core.settings import Settings, read_secret
from k3pipe.engines import get_engine
from k3pipe.engines.base import Finding
from k3pipe.experiment.speculation import choose_baseline, speculation_setting
from k3pipe.jobs.profiles import Profile, ProfileContext, profile_for
from k3pipe.jobs.rerun import RerunInputs
from k3pipe.launchers.base import Launcher
from k3pipe.launchers.factory import launch_engine, pull_image
from k3pipe.machine.node import NodeInfo, nvidia_smi_report, probe_node
from k3pipe.planning.coldstart import ColdStart, read_cold_start
from k3pipe.planning.plan import ArmPlan, plan_arm
from k3pipe.prompts.corpora import PromptSet
from k3pipe.prompts.datasets import load_tokenizer
from k3pipe.records.recorder import ArmRecorder
from k3pipe.records.runrecord import KeptWorkloads
from k3pipe.records.tracking import Tracker
from k3pipe.schema.specs import AccuracySpec, AnswersSpec, ExperimentSpec, WorkloadSpec, expand_home
from k3pipe.sources import ModelRecord
from k3pipe.sources.images import ImageRecord

__all__ = [
    "ArmOutcome",
    "ArmRun",
    "ArmSteps",
    "answer_probe",
    "arm_key",
    "benchmark",
    "client_key",
    "health_gate",
    "node_facts",
    "plan_for",
    "start_engine",
]

log = logging.getLogger("k3pipe.jobs.arm_run")

INTERRUPT_GRACE_S = 4.0
"""How long the engine of an interrupted run (or a lost engine) gets to exit after SIGTERM before
its group is killed."""


def _log_file(home: Path, name: str) -> Path:
    """``home/logs/name``, refused when ``name`` would leave the log directory (names are checked
    when the spec is loaded; this guards a spec built some other way)."""
    logs = home / "logs"
    path = logs / name
    if "/" in name or "\\" in name or name.startswith(".") or path.resolve().parent != logs.resolve():
        raise SpecError(
            f"log file name {name!r} would leave {logs}: experiment and arm names must be safe names"
        )
    return path


class PlanStep(Protocol):
    """``plan(spec, arm, home, model_dirs, model_digests)``: the arm's plan (:func:`plan_for`)."""

    def __call__(
        self,
        spec: ExperimentSpec,
        arm: str,
        home: Path,
        model_dirs: dict[str, str],
        model_digests: dict[str, str] | None = ...,
        /,
    ) -> ArmPlan: ...


class StartStep(Protocol):
    """``start_engine(plan, log_path, settings, api_key, image, labels)`` (:func:`start_engine`)."""

    def __call__(
        self,
        plan: ArmPlan,
        log_path: Path,
        settings: Settings,
        api_key: SecretStr | None,
        image: ImageRecord | None = ...,
        labels: dict[str, str] | None = ...,
        /,
    ) -> Launcher: ...


class BenchmarkStep(Protocol):
    """One measurement on the running engine (:func:`benchmark`; the measuring loop's only call)."""

    def __call__(
        self,
        plan: ArmPlan,
        workload: WorkloadSpec,
        model_dir: Path,
        api_key: SecretStr | None,
        repeat: int = ...,
        home: Path | None = ...,
        prompts: PromptSet | None = ...,
        /,
        *,
        launcher: Launcher | None = ...,
    ) -> WorkloadOutcome: ...


@dataclass
class ArmSteps:
    """The steps of an arm's lifetime, typed: each takes and returns what the library function does,
    so the library's form (:meth:`library`) and a flow's (its Prefect tasks, flows/runtime.py) differ
    only in how they log and retry."""

    plan: PlanStep
    pull_image: Callable[[ArmPlan], ImageRecord]
    probe_node: Callable[[ArmPlan, Settings], NodeInfo | None]
    start_engine: StartStep
    wait_ready: Callable[[ArmPlan, Launcher], float]
    health_gate: Callable[[ArmPlan, SecretStr | None], EndpointCheck]
    engine_version: Callable[[ArmPlan], str | None]
    cold_start: Callable[[ArmPlan, Path | None, float | None, str], ColdStart]
    benchmark: BenchmarkStep
    answers: Callable[[ArmPlan, AnswersSpec, Path, SecretStr | None, SecretStr | None], ProbeRecord] = field(
        default=lambda *a: answer_probe(*a)
    )
    structured: Callable[[ArmPlan, int, bool, bool, SecretStr | None], StructuredRecord] = field(
        default=lambda *a: structured_probe(*a)
    )
    accuracy: Callable[[ArmPlan, AccuracySpec, Path, SecretStr | None], AccuracyRecord] = field(
        default=lambda *a: accuracy_run(*a)
    )

    @classmethod
    def library(cls, say: Callable[[str], None] | None = None) -> ArmSteps:
        """The library functions themselves, their progress to ``say`` (default: this module's logger)."""
        out: Callable[[str], None] = say or log.info

        def bench(
            plan: ArmPlan,
            workload: WorkloadSpec,
            model_dir: Path,
            api_key: SecretStr | None,
            repeat: int = 0,
            home: Path | None = None,
            prompts: PromptSet | None = None,
            launcher: Launcher | None = None,
        ) -> WorkloadOutcome:
            return benchmark(
                plan, workload, model_dir, api_key, repeat, home, prompts, progress=out, launcher=launcher
            )

        return cls(
            plan=plan_for,
            pull_image=lambda plan: pull_image(plan, progress=out),
            probe_node=node_facts,
            start_engine=start_engine,
            wait_ready=lambda plan, launcher: wait_ready(plan, launcher, progress=out),
            health_gate=health_gate,
            engine_version=engine_version,
            cold_start=read_cold_start,
            benchmark=bench,
        )


# -- the steps that need more than one library call (the flow's tasks call these too) --------------


def plan_for(
    spec: ExperimentSpec, arm: str, home: Path, dirs: dict[str, str], digests: dict[str, str] | None = None
) -> ArmPlan:
    """The rendered plan of arm ``arm`` (by name) with its models' directories and digests."""
    return plan_arm(spec, spec.arm(arm), home, dirs, digests)


def node_facts(plan: ArmPlan, settings: Settings) -> NodeInfo | None:
    """The node's GPUs, driver and CUDA, and (an engine whose interpreter is here) its torch and
    engine versions; None for an engine that does not run on this machine."""
    if not plan.launch.runs_here:
        return None
    return probe_node(
        plan.command.argv,
        plan.engine,
        {**settings.process_env(), **plan.engine_env()},
        interpreter=plan.launch.probes_interpreter,
    )


def start_engine(
    plan: ArmPlan,
    log_path: Path,
    settings: Settings,
    api_key: SecretStr | None,
    image: ImageRecord | None = None,
    labels: dict[str, str] | None = None,
) -> Launcher:
    """The arm's engine started (docker: from the image's pinned digest) with the arm's key
    (:func:`arm_key`; None: the engine requires none)."""
    pinned = image.pinned if image else None
    return launch_engine(plan, log_path, settings, api_key, pinned, labels)


def health_gate(plan: ArmPlan, api_key: SecretStr | None) -> EndpointCheck:
    """The client target proven with its three settings (base URL, key, model id) and one streamed
    request: the gateway's (``api_key`` its key, :func:`client_key`) when the arm has one, else the
    engine's endpoint. The engine's own health was waited for before
    (:func:`~k3pipe.bench.health.wait_ready`)."""
    return check_endpoint(
        plan.client_base_url,
        plan.client_model,
        api_key,
        continuous_usage=plan.client_continuous_usage,
        target=gate_target(plan),
    )


def benchmark(
    plan: ArmPlan,
    workload: WorkloadSpec,
    model_dir: Path,
    api_key: SecretStr | None,
    repeat: int = 0,
    home: Path | None = None,
    prompts: PromptSet | None = None,
    progress: Callable[[str], None] | None = None,
    launcher: Launcher | None = None,
) -> WorkloadOutcome:
    """One repeat of a workload against the arm's client target (the gateway's, when it has one;
    ``api_key`` its key), its engine watched through ``launcher``."""
    return benchmark_workload(plan, workload, model_dir, api_key, progress, repeat, home, prompts, launcher)


def answer_probe(
    plan: ArmPlan,
    answers: AnswersSpec,
    model_dir: Path,
    engine_key: SecretStr | None,
    client_key: SecretStr | None,
) -> ProbeRecord:
    """The output probe against the running arm (k3pipe.bench.probe): its prompts drawn from the
    model's tokenizer and ``answers.seed`` (the same for every arm and launch), sent one at a time.
    vLLM's dialect goes where the workloads go (the gateway, with its key); SGLang's native API is on
    the engine's own root, with the engine's key."""
    tokenizer = load_tokenizer(model_dir)
    prompts = draw_prompts(
        tokenizer, answers.prompts, answers.prompt_tokens, answers.continuation_tokens, answers.seed
    )
    dialect = dialect_of(plan.engine)
    if dialect == "sglang":
        base, model, key = plan.base_url, plan.model, engine_key
    else:
        base, model, key = plan.client_base_url, plan.client_model, client_key
    headers = {"Authorization": f"Bearer {key.get_secret_value()}"} if key is not None else None
    return run_probe(
        base, model, prompts, output_tokens=answers.output_tokens, score=answers.score, dialect=dialect,
        headers=headers,
    )  # fmt: skip


def parsers_of(spec: ExperimentSpec, arm: str) -> tuple[bool, bool]:
    """Whether the arm serves with a tool-call parser and with a reasoning parser (its engine args,
    any spelling)."""
    arm_spec = spec.arm(arm)
    engine = get_engine(arm_spec.engine.kind)
    on = [
        found is not None and found[1] not in (None, False)
        for found in (engine.arg(arm_spec.engine.args, n) for n in ("tool_call_parser", "reasoning_parser"))
    ]
    return on[0], on[1]


def structured_probe(
    plan: ArmPlan, requests: int, tool_parser: bool, reasoning_parser: bool, client_key: SecretStr | None
) -> StructuredRecord:
    """The tool-calling requests (k3pipe.bench.structured) where the workloads go (the gateway, with
    its key), one at a time."""
    headers = {"Authorization": f"Bearer {client_key.get_secret_value()}"} if client_key is not None else None
    return run_structured(
        plan.client_base_url, plan.client_model, requests, tool_parser=tool_parser,
        reasoning_parser=reasoning_parser, headers=headers,
    )  # fmt: skip


def accuracy_run(
    plan: ArmPlan, accuracy: AccuracySpec, home: Path, client_key: SecretStr | None
) -> AccuracyRecord:
    """The accuracy set asked where the workloads go (k3pipe.bench.accuracy)."""
    path = Path(expand_home(accuracy.path, home)).expanduser()
    questions, digest = load_questions(path, accuracy.limit)
    headers = {"Authorization": f"Bearer {client_key.get_secret_value()}"} if client_key is not None else None
    return run_accuracy(
        plan.client_base_url, plan.client_model, questions, digest=digest, path=str(path),
        match=accuracy.match, max_tokens=accuracy.max_tokens, concurrency=accuracy.concurrency,
        prompt_suffix=accuracy.prompt_suffix, headers=headers,
    )  # fmt: skip


def arm_key(plan: ArmPlan) -> SecretStr | None:
    """The arm's (engine's) API key, read once from the variable ``endpoint.api_key_env`` names (None:
    unset, or the arm names none). The one place an arm's key is read; it travels as a SecretStr, and
    is registered with the scrubber (:mod:`k3pipe.core.secrets`) so that no record, log or error shows it."""
    return _read_key(plan.api_key_env)


def client_key(plan: ArmPlan, engine_key: SecretStr | None) -> SecretStr | None:
    """The key the arm's requests carry: the gateway's, read once from the variable
    ``gateway.api_key_env`` names and registered with the scrubber like :func:`arm_key`'s, when the
    arm has a gateway; else ``engine_key`` (the engine's, already read)."""
    if plan.gateway is None:
        return engine_key
    return _read_key(plan.gateway.api_key_env)


def _read_key(var: str | None) -> SecretStr | None:
    key = read_secret(var)
    if key is not None:
        register(key.get_secret_value())
    return key


class ArmOutcome(BaseModel):
    """How an arm's run ended, and its workloads' summary rows (kept as each workload ends)."""

    arm: str
    mlflow_run_id: str
    status: str = Field(description="FINISHED, FAILED or KILLED (MLflow's run status).")
    error: str | None = None
    workloads: list[dict[str, Any]] = Field(default_factory=list)
    engine_log_spec_accept_length_mean: float | None = None
    launch: int = Field(default=1, description="Which launch of the arm this was (a study's launches: N).")
    speculation: str | None = Field(
        default=None, description="A speculative arm's judgement against its plain baseline (once all ran)."
    )
    rerun_of: str | None = Field(default=None, description="A rerun's original arm run id.")
    verdicts: list[dict[str, Any]] | None = Field(
        default=None, description="A rerun's verdict per workload against the original (k3pipe.jobs.rerun)."
    )

    def as_dict(self) -> dict[str, Any]:
        """The flow's outcome dict (keys of None values left out, as before)."""
        return {k: v for k, v in self.model_dump().items() if v is not None}


@dataclass
class ArmRun:
    """One arm of an experiment, from launch to teardown (see the module's docstring):
    ``outcome = ArmRun(spec, arm, models, prompts, tracker, settings).execute()``."""

    spec: ExperimentSpec
    arm: str
    models: Mapping[str, ModelRecord]
    prompts: Mapping[str, list[PromptSet]]
    tracker: Tracker
    settings: Settings
    findings: list[Finding] = field(default_factory=list)
    experiment_file: str = ""
    steps: ArmSteps = field(default_factory=ArmSteps.library)
    tags: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)  # container labels (docker launcher)
    rerun: RerunInputs | None = None
    parent_run_id: str | None = None
    """The MLflow run the arm's run is nested under (a study's), if any."""
    params: dict[str, Any] = field(default_factory=dict)
    """Params for the arm's run besides the plan's (the overrides it was started with)."""
    image_source: Callable[[ArmPlan], ImageRecord] | None = None
    """Where the pinned image comes from (a study's prefetch); default ``steps.pull_image``."""
    say: Callable[[str], None] = log.info
    warn: Callable[[str], None] = log.error  # an arm's failure
    kept: KeptWorkloads | None = None
    """A resumed launch's workloads that finished under its earlier run: moved under this run, not
    run again (k3pipe.jobs.resume)."""

    def __post_init__(self) -> None:
        self.launcher: Launcher | None = None
        self.plan: ArmPlan | None = None
        self.recorder: ArmRecorder | None = None
        self.log_path: Path | None = None
        self.outcome: ArmOutcome | None = None
        self.api_key: SecretStr | None = None  # the engine's
        self.client_key: SecretStr | None = None  # what requests carry (the gateway's, if any)
        self._error: BaseException | None = None

    # -- lifetime ---------------------------------------------------------------------------------

    def __enter__(self) -> ArmRun:
        home = self.settings.home_dir
        dirs = {
            "model": self.models["model"].path,
            **{f"models.{k}": r.path for k, r in self.models.items() if k != "model"},
        }
        plan = self.plan = self.steps.plan(
            self.spec, self.arm, home, dirs, {k: r.digest() for k, r in self.models.items()}
        )
        self.api_key = arm_key(plan)
        self.client_key = client_key(plan, self.api_key)
        for key in (self.api_key, self.client_key):
            if key is not None:
                self.tracker.add_secret(key.get_secret_value())
        tags = dict(self.tags)
        if self.rerun is not None:
            tags[RERUN_TAG] = self.rerun.run_id
            if self.rerun.drift:
                tags[RERUN_DRIFT_TAG] = "; ".join(self.rerun.drift)
        recorder = self.recorder = ArmRecorder(self.tracker, plan, tags=tags, parent_id=self.parent_run_id)
        if self.rerun is not None:
            recorder.rerun_of, recorder.drift = self.rerun.run_id, list(self.rerun.drift)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.log_path = _log_file(home, f"{self.spec.name}-{self.arm}-{stamp}-{recorder.run_id[:8]}.log")
        self.outcome = ArmOutcome(arm=self.arm, mlflow_run_id=recorder.run_id, status="FAILED")
        return self

    def execute(self) -> ArmOutcome:
        """The whole lifetime: ``with self: launch(); run_workloads()``; the outcome, whatever happened
        short of an interrupt."""
        with self:
            self.launch()
            self.run_workloads()
        assert self.outcome is not None
        return self.outcome

    def launch(self) -> None:
        """The inputs into the record (plan, prompts, preflight), then the image (docker), the node's
        facts, the engine's start, its health, the endpoint's proof and the cold-start phases."""
        plan, recorder = self._ready()
        recorder.log_plan(self.spec, self.experiment_file, self.models, self.params)
        recorder.log_prompts(self.spec.workloads, self.prompts)
        recorder.log_preflight(self.findings)
        image = None
        if plan.launch.pins_image:
            image = (self.image_source or self.steps.pull_image)(plan)
            recorder.log_image(image, plan)
        labels = {**self.labels, MLFLOW_RUN_LABEL: recorder.run_id}
        node = self.steps.probe_node(plan, self.settings)
        recorder.log_node(node)
        # a local engine inherits k3pipe's environment (its CUDA_VISIBLE_DEVICES among it)
        recorder.log_gpus(plan.gpus(self.settings.process_env()), node)
        assert self.log_path is not None
        self.launcher = self.steps.start_engine(
            plan, self.log_path, self.settings, self.api_key, image, labels
        )
        cold = self.steps.wait_ready(plan, self.launcher)
        # the engine's own health is waited for above; the proof goes where the requests will go
        check = self.steps.health_gate(plan, self.client_key)
        waited = cold if plan.launch.starts_engine else None
        recorder.log_engine(waited, self.steps.engine_version(plan), check)
        if plan.launch.starts_engine:
            recorder.log_cold_start(self.steps.cold_start(plan, self.log_path, cold, recorder.run_id))

    def run_workloads(self) -> None:
        """Every workload, repeat by repeat; the status from what completed."""
        plan, recorder = self._ready()
        assert self.outcome is not None
        model_dir = Path(self.models["model"].path)
        kept = self.kept.workloads if self.kept is not None else {}
        ctx = ProfileContext(recorder, self.say, self._finished)
        for workload in self.spec.workloads:
            if workload.name in kept:
                assert self.kept is not None
                earlier = self.kept.arm_run_id
                self.say(f"workload {workload.name}: kept, measured by the earlier run {earlier}")
                if workload.ladder is not None:
                    self._adopt_ladder(workload, kept[workload.name], recorder)
                    continue
                recorder.adopt_workload(workload, kept[workload.name], earlier)
                self._finished(workload.name)
                continue
            self._measure(profile_for(workload, self.prompts[workload.name], ctx), plan, model_dir)
        if self.spec.answers is not None:
            self._probe_answers(self.spec.answers, plan, recorder, model_dir)
            self._probe_structured(self.spec.answers, plan, recorder)
            if self.spec.answers.accuracy is not None and self.tags.get(LAUNCH_TAG, "1") == "1":
                self._score(self.spec.answers.accuracy, plan, recorder)
        failed = {r["workload"]: int(r.get("failed") or 0) for r in self.outcome.workloads if r.get("failed")}
        if failed:
            where = ", ".join(f"{n} in {w}" for w, n in failed.items())
            self._error = RuntimeError(f"requests failed ({where}); see requests.parquet of each workload")
            self.outcome.error = str(self._error)
        else:
            self.outcome.status = "FINISHED"

    def _probe_answers(
        self, answers: AnswersSpec, plan: ArmPlan, recorder: ArmRecorder, model_dir: Path
    ) -> None:
        """The output probe, after every timed repeat (it never shares the engine with one): recorded
        whatever came of it; a probe the engine could not answer is said, and fails nothing."""
        self.say(f"answers: {answers.prompts} probe prompts, one at a time")
        try:
            record = self.steps.answers(plan, answers, model_dir, self.api_key, self.client_key)
        except Exception as exc:
            record = ProbeRecord("", dialect_of(plan.engine), answers.output_tokens, answers.score)
            record.error = f"{type(exc).__name__}: {exc}"
        recorder.log_answers(record, *self._lossless())
        got = f"{len(record.answers)} of {answers.prompts} prompts answered in {record.seconds:.1f} s"
        if record.error:
            self.warn(f"answers: {got}; the probe stopped: {scrub(record.error)}")
        else:
            self.say(f"answers: {got} (prompts' digest {record.digest})")

    def _probe_structured(self, answers: AnswersSpec, plan: ArmPlan, recorder: ArmRecorder) -> None:
        """The tool-calling requests, for an arm with a tool-call or reasoning parser: recorded whatever
        came of them; failures are counted, never fail the arm."""
        tool_parser, reasoning_parser = parsers_of(self.spec, self.arm)
        if not (tool_parser or reasoning_parser) or not answers.tool_requests:
            return
        which = " and ".join(
            n for n, on in (("tool-call", tool_parser), ("reasoning", reasoning_parser)) if on
        )
        self.say(f"structured output: {answers.tool_requests} tool-calling requests ({which} parser)")
        try:
            record = self.steps.structured(
                plan, answers.tool_requests, tool_parser, reasoning_parser, self.client_key
            )
        except Exception as exc:  # the check never fails the arm: what went wrong is recorded
            record = StructuredRecord(tool_parser, reasoning_parser, error=f"{type(exc).__name__}: {exc}")
        recorder.log_structured(record)
        rate = record.per_1000()
        said = (
            f"{record.failures} of {len(record.calls)} answers failed ({rate[0]:.0f} per 1,000), "
            f"in {record.seconds:.1f} s"
            if rate
            else "no answer checked"
        )
        if record.error:
            self.warn(f"structured output: {said}; stopped: {scrub(record.error)}")
        else:
            self.say(f"structured output: {said}" + (f": {record.kinds()}" if record.failures else ""))

    def _score(self, accuracy: AccuracySpec, plan: ArmPlan, recorder: ArmRecorder) -> None:
        """The accuracy set, on the arm's first launch: recorded whatever came of it."""
        self.say(f"accuracy: the questions of {accuracy.path}, {accuracy.concurrency} at a time")
        try:
            record = self.steps.accuracy(plan, accuracy, self.settings.home_dir, self.client_key)
        except Exception as exc:  # the score never fails the arm: what went wrong is recorded
            record = AccuracyRecord(accuracy.path, "", accuracy.match, error=f"{type(exc).__name__}: {exc}")
        recorder.log_accuracy(record)
        score = record.score
        said = f"{sum(record.right.values())} of {len(record.right)} right" + (
            f" ({score:.1%}) in {record.seconds:.1f} s" if score is not None else ""
        )
        if record.error:
            self.warn(f"accuracy: {said}; stopped: {scrub(record.error)}")
        else:
            self.say(f"accuracy: {said}")

    def _lossless(self) -> tuple[str | None, str | None]:
        """A speculative arm's setting and its plain twin (the same engine and model, no other setting
        different): under the probe's greedy decoding its tokens must be the twin's. (None, None):
        the arm does not speculate, or no such twin is in the study."""
        arm = self.spec.arm(self.arm)
        setting = speculation_setting(arm)
        if setting is None:
            return None, None
        choice = choose_baseline(self.spec, self.arm, [a.name for a in self.spec.study_arms()])
        if choice.baseline is None or choice.differences:
            return setting, None
        return setting, choice.baseline

    def _adopt_ladder(self, workload: WorkloadSpec, run_ids: str, recorder: ArmRecorder) -> None:
        """A ladder the earlier run of this launch ended, kept by a resume: each point's run moved
        under this one (as :meth:`ArmRecorder.adopt_workload`), and how it went said again here."""
        assert self.kept is not None
        for run_id in run_ids.split(","):
            tags = self.tracker.client.get_run(run_id).data.tags
            rung = workload.rung(float(tags[LADDER_POINT_TAG]))
            recorder.adopt_workload(rung, run_id, self.kept.arm_run_id)
            self._finished(rung.name)
        recorder.log_ladder(workload.name, self.kept.ladders[workload.name])

    def _measure(self, profile: Profile, plan: ArmPlan, model_dir: Path) -> None:
        """The measuring loop, one for every load profile (k3pipe.jobs.profiles): each point the profile
        asks for is sent through the ``benchmark`` step on the running engine (the engine k3pipe
        started is watched; an external endpoint: its /models), recorded by the profile, then any
        interrupt it caught delivered; an engine lost during it ends the arm."""
        while (point := profile.next_point()) is not None:
            reset = reset_prefix_cache(plan, self.api_key) if point.reset_cache else False
            measured = self.steps.benchmark(
                plan, point.workload, model_dir, self.client_key, point.repeat, self.settings.home_dir,
                point.prompts, **({"launcher": self.launcher} if plan.launch.starts_engine else {}),
            )  # fmt: skip
            try:
                profile.completed(point, measured, reset)
            finally:
                if measured.interrupted is not None:
                    deliver(measured.interrupted)  # recorded: now the interrupt goes on
            if measured.engine_lost:
                raise EngineLostError(self._lost(point.label or point.workload.name, measured.engine_lost))

    def _finished(self, name: str) -> None:
        """A workload run's figures are final: the arm's outcome lists them."""
        assert self.outcome is not None
        assert self.recorder is not None
        self.outcome.workloads.append(
            {"arm": self.arm, "workload": name, **self.recorder.workload_metrics(name)}
        )

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        assert self.outcome is not None
        assert self.recorder is not None
        assert self.plan is not None
        plan, recorder, outcome = self.plan, self.recorder, self.outcome
        interrupted = exc is not None and not isinstance(exc, Exception)
        if exc is not None:
            outcome.status = "KILLED" if interrupted else "FAILED"
            self._error = exc
            if not interrupted:
                outcome.error = scrub(f"{type(exc).__name__}: {exc}")
                self.warn(f"arm {self.arm} failed: {outcome.error}")
        try:
            if self.launcher is not None:
                self.say(f"stopping engine ({plan.launcher})")
                # an interrupted run must end within seconds (the CLI's deadline): a short grace
                # a lost engine (dead or frozen) will not exit gracefully either
                short = interrupted or isinstance(exc, EngineLostError)
                self.launcher.stop(grace_s=INTERRUPT_GRACE_S if short else None)
                if plan.launch.runs_here:
                    recorder.log_nvidia_smi_after(nvidia_smi_report())
        finally:
            own_log = self.launcher is not None and plan.launch.starts_engine
            recorder.finish(outcome.status, self._error, self.log_path if own_log else None)
            facts = recorder.engine_log_facts
            if facts is not None and facts.spec_accept_length_mean is not None:
                outcome.engine_log_spec_accept_length_mean = facts.spec_accept_length_mean
            self.say(f"arm {self.arm}: {outcome.status}; MLflow run {recorder.run_id}")
        # an ordinary error is recorded and kept in the outcome; an interrupt goes on up
        return exc is not None and not interrupted

    def _lost(self, workload: str, why: str) -> str:
        """The error of a workload the engine's loss ended: why, what was kept, the log's end."""
        tail = self.launcher.log_tail(20).rstrip() if self.launcher is not None else ""
        log = f"; last log lines ({self.log_path}):\n{tail}" if tail else ""
        return (
            f"workload {workload!r} ended early: {why}; the requests measured until then are recorded "
            f"(requests.parquet), the later workloads did not run{log}"
        )

    def _ready(self) -> tuple[ArmPlan, ArmRecorder]:
        if self.plan is None or self.recorder is None:
            raise RuntimeError("ArmRun is used as a context manager: `with ArmRun(...) as arm:`")
        return self.plan, self.recorder
