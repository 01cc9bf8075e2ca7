"""The experiment as a whole: arms and workloads together, the decision (figures, margins, A/A,
sequential looks), the answers probe and accuracy set, published reference figures, variants
and a fleet.

Part of the experiment's schema; :mod:`k3pipe.schema.specs` re-exports every name."""

from __future__ import annotations

from collections import Counter
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from k3pipe.core.errors import SpecError
from k3pipe.core.figures import DEFAULT_DECISION, FIGURES
from k3pipe.schema.arms import (
    ArmSpec,
    HardwareSpec,
)
from k3pipe.schema.common import (
    _ENV_NAME,
    _MODEL_KEY,
    _MODEL_REF,
    _MODEL_TYPO,
    DEFAULT_LAUNCHES,
    MAX_ARMS,
    MAX_DURATION_S,
    MAX_EXTRA_MODELS,
    MAX_LAUNCHES,
    MAX_POOLS,
    MAX_PROMPT_TOKENS,
    MAX_REQUEST_TIMEOUT_S,
    MAX_VARIANTS,
    MAX_WORKLOADS,
    NAME_MAX_CHARS,
    _check_args,
    _count,
    _finite,
    _Spec,
    _strings,
    safe_name,
)
from k3pipe.schema.model_source import (
    ModelSpec,
)
from k3pipe.schema.tune import TuneCandidate, TuneSpec
from k3pipe.schema.workloads import (
    ClientSpec,
    WorkloadSpec,
)


class FleetSpec(_Spec):
    """Where a study's launches run when it is spread over GPU nodes: each node a Prefect work pool
    (one launch at a time), each launch a flow run of that pool's ``launch`` deployment, the study's
    flow waiting for them and joining them into one study (k3pipe.jobs.fleet)."""

    pools: list[str] = Field(
        min_length=1,
        max_length=MAX_POOLS,
        description=(
            "The GPU nodes' work pools the launches are spread over ('k3pipe stack add-node NAME' makes "
            "one with its launch deployment); each runs one launch at a time, the next in the study's "
            "order as soon as it is free."
        ),
    )
    arms: dict[str, list[str]] = Field(
        default_factory=dict,
        description=(
            "Arm -> the pools it may run on (default: any of pools); a calibration copy goes where its "
            "baseline may."
        ),
    )
    pickup_timeout_s: float = _finite(
        default=600.0,
        gt=0,
        le=MAX_REQUEST_TIMEOUT_S,
        description=(
            "A pool with no live worker (no heartbeat to its Prefect server) this long is lost, and a "
            "launch a live, idle worker has not started after this long fails: the pool is named and "
            "gets nothing more; its launches go to the other pools they may run on."
        ),
    )
    busy_timeout_s: float = _finite(
        default=7_200.0,
        gt=0,
        le=MAX_REQUEST_TIMEOUT_S,
        description=(
            "A pool whose worker is alive but runs another flow run (another study's launch) is busy, "
            "not lost: its launches go to the other pools they may run on as soon as one is free, and "
            "wait for it, a line every 30 s naming it and what it runs, up to this long; then it gets "
            "nothing more and a launch that may run only there fails, naming it busy."
        ),
    )

    heartbeat_s: float = _finite(
        default=15.0,
        gt=0,
        le=3_600,
        description="How often a node running a launch says it is alive (a tag on the study's run).",
    )
    lost_after_s: float = _finite(
        default=120.0,
        gt=0,
        le=MAX_REQUEST_TIMEOUT_S,
        description=(
            "A running launch whose node has not said it is alive for this long is lost (the node died, "
            "its worker was killed): recorded failed with what it measured, its flow run marked "
            "Crashed; the study goes on. Keep it several heartbeats long."
        ),
    )

    @field_validator("pools")
    @classmethod
    def _pool_names(cls, value: list[str]) -> list[str]:
        for name in value:
            safe_name(name, "work pool")
        dupes = _repeated(value)
        if dupes:
            raise ValueError(f"fleet.pools names each pool once; repeated: {', '.join(dupes)}")
        return value

    @model_validator(mode="after")
    def _known_pools(self) -> FleetSpec:
        if self.lost_after_s < 2 * self.heartbeat_s:
            raise ValueError(
                f"fleet.lost_after_s ({self.lost_after_s:g}) must be at least two heartbeats "
                f"(fleet.heartbeat_s {self.heartbeat_s:g}): one late heartbeat is not a lost node"
            )
        for arm, pools in self.arms.items():
            if not pools:
                raise ValueError(
                    f"fleet.arms.{arm} names no pool: name one of {', '.join(self.pools)}, or drop it"
                )
            unknown = [p for p in pools if p not in self.pools]
            if unknown:
                raise ValueError(
                    f"fleet.arms.{arm} names pool(s) {', '.join(unknown)} that fleet.pools does not list "
                    f"({', '.join(self.pools)}): add them to fleet.pools, or fix the name"
                )
        return self

    def pools_of(self, arm: str, baseline: str | None = None) -> list[str]:
        """The pools ``arm`` may run on (its calibration copy: its baseline's)."""
        if arm in self.arms:
            return list(self.arms[arm])
        if baseline is not None and arm == baseline + CALIBRATION_SUFFIX and baseline in self.arms:
            return list(self.arms[baseline])
        return list(self.pools)


class ArmOverride(_Spec):
    """What a variant changes in one arm: engine arguments and environment laid over the arm's
    (a null value removes the key), and optionally its image or declared version."""

    args: dict[str, Any] = Field(
        default_factory=dict, description="Engine arguments over the arm's (null removes one)."
    )
    env: dict[str, str | None] = Field(
        default_factory=dict, description="Engine environment over the arm's (null removes one)."
    )
    image: str | None = Field(default=None, description="Another image (docker launcher).")
    version: str | None = Field(default=None, description="Another declared engine version.")

    @field_validator("args")
    @classmethod
    def _args(cls, value: dict[str, Any]) -> dict[str, Any]:
        return _check_args(value)

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str | None]) -> dict[str, str | None]:
        for key in value:
            if not _ENV_NAME.match(key):
                raise ValueError(
                    f"environment variable name {key!r} is not valid: letters, digits and '_', "
                    "not starting with a digit"
                )
        return value


_VARIANT_WORKLOAD_FIELDS = sorted(set(WorkloadSpec.model_fields) - {"name"})


class VariantSpec(_Spec):
    """A named change against the experiment (its baseline): some arms' engine settings and/or every
    workload's fields. A variant is run as the experiment restricted to the arms it names, changed
    so, and compared workload by workload with the baseline's same arms."""

    name: str = Field(
        description="Variant name, unique among variants and arms: letters, digits, '-', '_' and '.' "
        "(it names MLflow runs and metrics); 'baseline' is the retest's name for the experiment itself.",
    )
    description: str = Field(default="", description="What the variant tests (the checklist item).")
    arms: dict[str, ArmOverride] = Field(
        min_length=1, description="The arms the variant runs, each with its changes ({} for none)."
    )
    workloads: dict[str, Any] = Field(
        default_factory=dict,
        description="Workload fields laid over every workload's (e.g. dataset, input_tokens).",
    )

    @field_validator("name")
    @classmethod
    def _safe_name(cls, value: str) -> str:
        safe_name(value, "variant")
        if value == "baseline":
            raise ValueError(
                "'baseline' is the retest's name for the experiment itself: name the variant "
                "after what it changes"
            )
        return value

    @field_validator("workloads")
    @classmethod
    def _workload_fields(cls, value: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(value) - set(_VARIANT_WORKLOAD_FIELDS))
        if unknown:
            raise ValueError(
                f"{', '.join(map(repr, unknown))} is not a workload field a variant can change; "
                f"allowed: {', '.join(_VARIANT_WORKLOAD_FIELDS)}"
            )
        return value


def _repeated(names: list[str]) -> list[str]:
    return sorted(n for n, k in Counter(names).items() if k > 1)


REFERENCE_METRICS = (
    "duration_s",
    "output_throughput_tps",
    "engine_generation_tps",
    "steady_decode_tps",
    "ttft_ms_p50",
    "content_ttft_ms_p50",
    "tpot_ms_p50",
    "itl_ms_p50",
)


"""The report's table metrics (k3pipe.report.analysis.TABLE_METRICS) a published figure can stand beside."""


class ReferenceFigure(_Spec):
    """One published figure: what ``arm`` of the reference study measured on ``workload``."""

    workload: str = Field(min_length=1, description="The workload of this experiment it corresponds to.")
    metric: str = Field(description="The report metric it stands beside: " + ", ".join(REFERENCE_METRICS))
    arm: str = Field(
        min_length=1, max_length=NAME_MAX_CHARS, description="The published arm, e.g. 'study vLLM (TP 8)'."
    )
    value: float = _finite(description="The published value, in the metric's unit.")

    @field_validator("metric")
    @classmethod
    def _known_metric(cls, value: str) -> str:
        if value not in REFERENCE_METRICS:
            known = ", ".join(REFERENCE_METRICS)
            raise ValueError(f"metric {value!r} is not a metric of the report; one of: {known}")
        return value


class ReferenceSpec(_Spec):
    """A published table to show beside this experiment's results (the report's 'Beside the
    reference' section): the figures are shown, never mixed into the analysis."""

    source: str = Field(min_length=1, description="Where the figures come from (document, hardware, model).")
    figures: list[ReferenceFigure] = Field(
        min_length=1, max_length=MAX_WORKLOADS, description="One per arm, workload and metric."
    )
    notes: list[str] = Field(
        default_factory=list, max_length=100, description="Published figures without a cell (slow-downs...)."
    )


class UntilSpec(_Spec):
    """Launches added until the decision is reached: after the planned launches, a round that
    launches every arm once more (continuing the interleaved order) is added while some decision
    comparison is neither decided (different, or equivalent) nor within +-``ci_pct``, until an arm
    would exceed ``max_launches`` or ``budget_s`` would be overrun. Each round is a look at the data;
    the family-wise error rate is spent over the looks (docs/measurement.md, "Adding launches")."""

    ci_pct: float = _finite(
        default=5.0,
        gt=0,
        le=100,
        description="Stop once every undecided comparison's interval is within +-ci_pct (percent).",
    )
    max_launches: int = _count(
        ge=2, le=MAX_LAUNCHES, description="The most launches an arm gets (the planned ones included)."
    )
    budget_s: float | None = _finite(
        default=None,
        gt=0,
        le=MAX_DURATION_S,
        description="Add no round that would end later than this many seconds after the study began "
        "(judged by the slowest round so far). None: no time limit.",
    )


DECISION_METRICS = tuple(f.key for f in FIGURES)


"""The figures a decision may rest on (k3pipe.core.figures.FIGURES)."""


class AccuracySpec(_Spec):
    """A task score per arm (k3pipe.bench.accuracy): a local JSONL set of questions with known answers,
    asked through the arm's endpoint on its first launch, each arm's score judged against the
    reference's on the same questions ("worse", or "equivalent within margin_points")."""

    path: str = Field(
        description=(
            "The JSONL file: one {'question', 'answer'} (or {'prompt', 'target'}) a line, on this machine "
            "('{home}' expands to K3PIPE_HOME); nothing is downloaded."
        )
    )
    match: Literal["number", "exact", "contains"] = Field(
        default="number",
        description="How an answer is marked right: its last number is the expected one (after '####' in "
        "GSM8K's answers), the text exactly, or the text contained.",
    )
    limit: int | None = Field(default=None, ge=1, strict=True, description="Ask the first N questions only.")
    max_tokens: int = Field(
        default=512, ge=1, le=32768, strict=True, description="Tokens an answer may run to."
    )
    concurrency: int = Field(default=16, ge=1, le=1024, strict=True, description="Questions asked at once.")
    prompt_suffix: str = Field(default="", description="Text put after each question (an instruction).")
    margin_points: float = _finite(
        default=2.0, gt=0, le=100, description="Equivalence margin, in accuracy points."
    )


class AnswersSpec(_Spec):
    """The output probe (issue 47; docs/measurement.md, "Answers"): after each launch's timed repeats,
    the same fixed prompts sent to every arm one at a time, answered greedily to a fixed length and, where
    the engine offers it, a fixed continuation scored teacher-forced. Each arm's answers are compared with
    the reference arm's (``decision.baseline``, else the first) and judged against the floor (the
    reference against itself launched again); an arm detected faster whose answers diverge beyond the
    floor is 'faster, answers differ' and never the recommendation without ``decision.accept_divergence``.
    The prompts are random token ids from the model's vocabulary, drawn from ``seed`` (the same for every
    arm and launch; their digest is recorded)."""

    prompts: int = Field(
        default=16, ge=2, le=256, strict=True, description="How many prompts the probe sends each launch."
    )
    prompt_tokens: int = Field(
        default=64, ge=2, le=8192, strict=True, description="Tokens in each probe prompt."
    )
    output_tokens: int = Field(
        default=32,
        ge=1,
        le=2048,
        strict=True,
        description=(
            "Tokens each greedy answer runs to (the end of sequence ignored: every arm answers as many)."
        ),
    )
    continuation_tokens: int = Field(
        default=16,
        ge=1,
        le=2048,
        strict=True,
        description="Tokens of the fixed continuation scored teacher-forced after each prompt.",
    )
    score: bool = Field(
        default=True,
        strict=True,
        description=(
            "Score the continuation teacher-forced (vLLM's prompt_logprobs, SGLang's input "
            "log-probabilities); off: greedy tokens alone (a weaker test: it can detect a divergence, "
            "never rule one out)."
        ),
    )
    margin_nats: float = _finite(
        default=0.0,
        ge=0,
        le=10,
        description=(
            "How far (mean absolute log-probability difference, nats per token) an arm may diverge beyond "
            "the floor and still be 'within the floor' (0.02: a token's probability moved by about 2% on "
            "average). 0: any divergence detected beyond the floor gates the arm, and an arm is called "
            "within only where its answers are exactly the floor's (a deterministic engine); on a GPU, "
            "whose floor is not nil, set a margin to be able to hear 'within'."
        ),
    )
    seed: int = Field(default=47, ge=0, strict=True, description="Seed the probe's prompts are drawn from.")
    accuracy: AccuracySpec | None = Field(
        default=None, description="A task score per arm on a local question set (None: none)."
    )
    tool_requests: int = Field(
        default=16,
        ge=0,
        le=1000,
        strict=True,
        description=(
            "Tool-calling chat requests sent to an arm with a tool-call or reasoning parser "
            "(tool_call_parser, reasoning_parser), every other one streamed, each answer checked "
            "(k3pipe.bench.structured); 0: none."
        ),
    )


class DecisionSpec(_Spec):
    """How the study's report turns repeats into verdicts (docs/measurement.md, "Verdicts").

    Every pair of arms is compared on each decision metric and workload, on the log of the ratio of
    their geometric means; the family-wise error rate ``alpha`` is shared by all those comparisons
    (Bonferroni), and each verdict is read off its interval at that level: one arm better by x%, the
    two equivalent within ``margin_pct``, or inconclusive (with the smallest difference the data could
    have shown, at ``power``). Every other figure is shown with its interval, as descriptive."""

    metrics: list[str] = Field(
        default_factory=lambda: list(DEFAULT_DECISION),
        min_length=1,
        max_length=len(DECISION_METRICS),
        description=(
            "The figures the verdicts rest on (default: output_throughput_tps, ttft_ms_p50, "
            "tpot_ms_p50); one of: " + ", ".join(DECISION_METRICS)
        ),
    )
    alpha: float = _finite(
        default=0.05, gt=0, lt=0.5, description="Family-wise error rate over every decision comparison."
    )
    margin_pct: float = _finite(
        default=5.0,
        gt=0,
        le=100,
        description="Equivalence margin in percent: two arms within +-margin_pct are 'equivalent'.",
    )
    power: float = _finite(
        default=0.8,
        gt=0,
        lt=1,
        description="The power the minimum detectable difference of an inconclusive verdict is stated at.",
    )
    baseline: str | None = Field(
        default=None,
        description="An arm every other arm is also judged against (beside the best); None: the best only.",
    )
    until: UntilSpec | None = Field(
        default=None,
        description="Add launches until the decision is reached (or a budget is spent); None: as planned.",
    )
    prime: bool = Field(
        default=False,
        strict=True,
        description=(
            "Launch every arm once before the measured launches, to fill the node's caches (the "
            "engine's compile cache, kernels built at first use, the model in the page cache): that "
            "launch runs each workload once, is recorded (tagged k3pipe.prime) and is left out of the "
            "verdicts and the noise. The A/A copy shares its baseline's priming."
        ),
    )
    calibration: bool = Field(
        default=False,
        strict=True,
        description=(
            "An A/A calibration: the baseline arm (or the first arm) is run twice as two arms, the "
            "second named '<arm>-aa' and launched like the first; the report states their comparison "
            "as the floor below which a difference cannot be told from restarting the engine."
        ),
    )
    prior_days: float = _finite(
        default=30.0,
        ge=0,
        le=3650,
        description=(
            "How old the restart noise an earlier study measured on this node (same engine kind, model, "
            "node and workload shape) may be to judge an arm launched once (k3pipe.records.priors); "
            "0: never, "
            "an arm launched once is then never judged."
        ),
    )
    accept_divergence: bool = Field(
        default=False,
        strict=True,
        description=(
            "Let an arm whose answers diverge beyond the floor (answers:) still be the recommendation when "
            "it is detected faster; off: it is reported 'faster, answers differ' and not recommended."
        ),
    )
    mixed_hardware: bool = Field(
        default=False,
        strict=True,
        description=(
            "Rank arms measured on different hardware (GPU model, count or driver, from the node facts "
            "each launch records: a fleet's nodes may differ). Off: the report names the difference and "
            "ranks nothing."
        ),
    )

    @field_validator("metrics")
    @classmethod
    def _known_metrics(cls, value: list[str]) -> list[str]:
        unknown = [m for m in value if m not in DECISION_METRICS]
        if unknown:
            raise ValueError(
                f"decision metric(s) {', '.join(map(repr, unknown))} unknown; one of: "
                + ", ".join(DECISION_METRICS)
            )
        dupes = _repeated(value)
        if dupes:
            raise ValueError(f"decision metrics repeat {', '.join(dupes)}")
        return value


CALIBRATION_SUFFIX = "-aa"


"""The A/A copy of the baseline arm is named ``<arm>-aa``."""


class ExperimentSpec(_Spec):
    """A whole study: model, engine arms and workloads.

    Its name, and its arms', workloads' and variants' names, name MLflow runs, metric keys and log
    files: each is a :func:`safe_name` (an experiment a variant resolves to is named
    ``EXPERIMENT@VARIANT``). Sizes are bounded (:data:`MAX_ARMS`, :data:`MAX_WORKLOADS`,
    :data:`MAX_VARIANTS`, :data:`MAX_PROMPT_TOKENS` of prompts over all workloads).
    """

    name: str = Field(
        description="Experiment name (the MLflow experiment's runs are tagged with it): letters, digits, "
        "'-', '_' and '.'."
    )
    description: str = Field(default="", description="What this experiment is for.")
    model: ModelSpec = Field(description="The model under test.")
    extra_models: dict[str, ModelSpec] = Field(
        default_factory=dict,
        max_length=MAX_EXTRA_MODELS,
        description="Further models (e.g. a speculative draft), referenced in args as '{models.NAME}'.",
    )
    hardware: HardwareSpec | None = Field(
        default=None, description="The node the experiment is planned for (for preflight estimates)."
    )
    arms: list[ArmSpec] = Field(
        min_length=1, max_length=MAX_ARMS, description="Engine configurations to run."
    )
    workloads: list[WorkloadSpec] = Field(
        min_length=1, max_length=MAX_WORKLOADS, description="Workloads each arm runs."
    )
    client: ClientSpec = Field(
        default_factory=ClientSpec, description="How the load generator runs (processes, CPUs, priority)."
    )
    variants: list[VariantSpec] = Field(
        default_factory=list,
        max_length=MAX_VARIANTS,
        description=(
            "Named changes against this baseline (k3pipe.experiment.variants resolves each to an experiment)."
        ),
    )
    reference: ReferenceSpec | None = Field(
        default=None, description="A published table the study's report shows beside its own results."
    )
    decision: DecisionSpec = Field(
        default_factory=DecisionSpec,
        description="How the report's verdicts are made (metrics, error rate, margin, baseline, A/A).",
    )
    answers: AnswersSpec | None = Field(
        default=None,
        description=(
            "The output probe: every launch's answers to fixed prompts compared with the reference arm's "
            "and judged against the floor, and the verdict gated on them (docs/measurement.md, 'Answers'); "
            "None: answers are not checked."
        ),
    )
    fleet: FleetSpec | None = Field(
        default=None,
        description=(
            "Spread the study's launches over GPU nodes' work pools (run through Prefect: the study "
            "flow); None: every launch on this machine, one after another."
        ),
    )
    tune: TuneSpec | None = Field(
        default=None,
        description=(
            "A search over one arm's engine settings under an objective, raced by the verdict rules "
            "(issue 50; k3pipe.schema.tune); None: the arms as written."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _default_launches(cls, data: Any) -> Any:
        """An arm that does not say how many launches gets :data:`DEFAULT_LAUNCHES` in an experiment
        that compares (two arms or more, variants, an A/A calibration): a verdict needs restart
        noise, and one launch per arm holds none (docs/measurement.md, "Restart noise")."""
        if not isinstance(data, dict) or not isinstance(data.get("arms"), list):
            return data
        decision = data.get("decision")
        calibration = isinstance(decision, dict) and decision.get("calibration") is True
        calibration = calibration or (isinstance(decision, DecisionSpec) and decision.calibration)
        compares = len(data["arms"]) >= 2 or bool(data.get("variants")) or calibration
        if not compares:
            return data
        arms = []
        for arm in data["arms"]:
            if isinstance(arm, dict) and arm.get("launches") is None:
                arm = {**arm, "launches": DEFAULT_LAUNCHES}
            elif isinstance(arm, ArmSpec) and "launches" not in arm.model_fields_set:
                arm = arm.model_copy(update={"launches": DEFAULT_LAUNCHES})
            arms.append(arm)
        return {**data, "arms": arms}

    @field_validator("name")
    @classmethod
    def _safe_name(cls, value: str) -> str:
        # 'EXPERIMENT@VARIANT' is the name k3pipe.experiment.variants gives a resolved variant
        base, at, variant = value.partition("@")
        try:
            safe_name(base, "experiment")
            if at:
                safe_name(variant, "variant")
        except ValueError:
            safe_name(value, "experiment")  # the rule, said of the whole name
        return value

    @field_validator("extra_models")
    @classmethod
    def _model_keys(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key in value:
            if not _MODEL_KEY.fullmatch(key) or len(key) > NAME_MAX_CHARS:
                raise ValueError(
                    f"extra model name {key!r} must start with a letter or digit and hold only letters, "
                    "digits, '-' and '_' (args refer to it as '{models.NAME}')"
                )
        return value

    @model_validator(mode="after")
    def _unique_names(self) -> ExperimentSpec:
        for label, names in (
            ("arms", [a.name for a in self.arms]),
            ("workloads", [w.name for w in self.workloads]),
            ("variants and arms", [v.name for v in self.variants] + [a.name for a in self.arms]),
        ):
            dupes = _repeated(names)
            if dupes:
                raise ValueError(f"{label} names must be unique; repeated: {', '.join(dupes)}")
        arms = {a.name for a in self.arms}
        for v in self.variants:
            unknown = sorted(set(v.arms) - arms)
            if unknown:
                raise ValueError(
                    f"variant {v.name!r} names arm(s) {', '.join(unknown)} that the experiment does not "
                    f"have; its arms: {', '.join(sorted(arms))}"
                )
        baseline = self.decision.baseline
        if baseline is not None and baseline not in arms:
            raise ValueError(
                f"decision.baseline {baseline!r} is not an arm of the experiment; its arms: "
                + ", ".join(a.name for a in self.arms)
            )
        until = self.decision.until
        if until is not None and until.max_launches < max(a.launches for a in self.arms):
            raise ValueError(
                f"decision.until.max_launches ({until.max_launches}) is below the launches an arm "
                f"already plans ({max(a.launches for a in self.arms)}): raise max_launches, or lower "
                "that arm's launches"
            )
        if self.decision.calibration:
            copy = self.calibration_arm_name
            if copy in arms:
                raise ValueError(
                    f"decision.calibration adds the A/A arm {copy!r}, but an arm already has that name: "
                    "rename it, or drop that arm and keep calibration"
                )
        if self.fleet is not None:
            unknown = sorted(set(self.fleet.arms) - arms)
            if unknown:
                raise ValueError(
                    f"fleet.arms names arm(s) {', '.join(unknown)} that the experiment does not have; its "
                    f"arms: {', '.join(sorted(arms))}"
                )
            if self.decision.prime:
                raise ValueError(
                    "decision.prime with fleet: a priming launch fills one node's caches, and the "
                    "measured launches may run on another; drop decision.prime, or fleet"
                )
        if self.tune is not None:
            tune = self.tune
            if tune.arm not in arms:
                raise ValueError(
                    f"tune.arm {tune.arm!r} is not an arm of the experiment; its arms: "
                    + ", ".join(a.name for a in self.arms)
                )
            workloads = [w.name for w in self.workloads]
            if tune.objective.workload not in workloads:
                raise ValueError(
                    f"tune.objective.workload {tune.objective.workload!r} is not a workload of the "
                    f"experiment; its workloads: {', '.join(workloads)}"
                )
            if tune.objective.metric not in DECISION_METRICS:
                raise ValueError(
                    f"tune.objective.metric {tune.objective.metric!r} is not a figure a decision rests on; "
                    f"one of: {', '.join(DECISION_METRICS)}"
                )
            arm = next(a for a in self.arms if a.name == tune.arm)
            tune.candidates(arm)  # too few or too many combinations: said now
            for field, set_ in (
                ("decision.calibration", self.decision.calibration),
                ("decision.until", self.decision.until is not None),
                ("variants", bool(self.variants)),
            ):
                if set_:
                    raise ValueError(
                        f"tune with {field}: a search races its candidates by its own rules on this "
                        f"node; remove {field} (a study of the winner can have it)"
                    )
        if self.reference is not None:
            workloads = [w.name for w in self.workloads]
            unknown = sorted({f.workload for f in self.reference.figures} - set(workloads))
            if unknown:
                raise ValueError(
                    f"reference.figures name workload(s) {', '.join(unknown)} that the experiment does not "
                    f"have; its workloads: {', '.join(workloads)}"
                )
        return self

    @model_validator(mode="after")
    def _declared_models(self) -> ExperimentSpec:
        declared = sorted(self.extra_models)
        shown = ", ".join("{models." + n + "}" for n in declared) or "none"
        sources = [
            (f"arms[{i}].engine.args", f"arm {a.name!r}", a.engine.args) for i, a in enumerate(self.arms)
        ]
        sources += [
            (f"variants[{i}].arms.{arm}.args", f"variant {v.name!r}", o.args)
            for i, v in enumerate(self.variants)
            for arm, o in v.arms.items()
        ]
        for where, who, args in sources:
            for key, value in args.items():
                for text in _strings(value):
                    typo = _MODEL_TYPO.search(text)
                    if typo:
                        raise ValueError(
                            f"{where}.{key}: {who} writes {typo.group(0)!r}; extra models are referred to "
                            f"as '{{models.{typo.group(1)}}}' (and the model under test as '{{model}}')"
                        )
                    for name in _MODEL_REF.findall(text):
                        if name not in self.extra_models:
                            raise ValueError(
                                f"{where}.{key}: {who} refers to '{{models.{name}}}', but extra_models "
                                f"declares {shown}: declare it under extra_models (source and id or path), "
                                "or fix the name"
                            )
        return self

    @model_validator(mode="after")
    def _prompt_memory(self) -> ExperimentSpec:
        total = sum(w.prompt_count * w.input_tokens for w in self.workloads)
        if total > MAX_PROMPT_TOKENS:
            raise ValueError(
                f"the workloads' prompts hold {total:,} tokens in all ((warmup_requests + num_requests) x "
                f"repeats x input_tokens, summed), more than {MAX_PROMPT_TOKENS:,}: every prompt is built "
                "in memory before the first launch; send fewer or shorter requests, or split the experiment"
            )
        return self

    @property
    def baseline_arm(self) -> str:
        """The decision's baseline arm, or the first arm."""
        return self.decision.baseline or self.arms[0].name

    @property
    def calibration_arm_name(self) -> str:
        return self.baseline_arm + CALIBRATION_SUFFIX

    def study_arms(self) -> list[ArmSpec]:
        """The arms a study runs: the experiment's, and with ``decision.calibration`` the A/A copy of
        the baseline arm (named ``<arm>-aa``) right after it."""
        if not self.decision.calibration:
            return list(self.arms)
        out: list[ArmSpec] = []
        for arm in self.arms:
            out.append(arm)
            if arm.name == self.baseline_arm:
                out.append(arm.model_copy(update={"name": self.calibration_arm_name}))
        return out

    def tune_candidates(self) -> list[TuneCandidate]:
        """With ``tune``: its candidates, each the searched arm with its settings (none without)."""
        if self.tune is None:
            return []
        return self.tune.candidates(next(a for a in self.arms if a.name == self.tune.arm))

    def searched(self, name: str) -> str:
        """The arm ``name`` stands for: a search's candidate (``ARM.tNN``) is its searched arm (its
        fleet pools, say); any other arm is itself."""
        tune = self.tune
        if tune is not None and any(c.name == name for c in self.tune_candidates()):
            return tune.arm
        return name

    def arm(self, name: str) -> ArmSpec:
        if self.decision.calibration and name == self.calibration_arm_name:
            return next(a for a in self.study_arms() if a.name == name)
        for arm in self.arms:
            if arm.name == name:
                return arm
        for candidate in self.tune_candidates():
            if candidate.name == name:
                return candidate.arm
        raise SpecError(
            f"experiment {self.name!r} has no arm {name!r}; arms: {', '.join(a.name for a in self.arms)}"
        )
