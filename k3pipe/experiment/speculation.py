"""Speculative decoding, judged: does an arm's speculation pay off against its plain twin?

Each arm that speculates (``Engine.speculation(args)`` is set) is paired with a *baseline*: an arm of
the same engine kind serving the same model without speculation, that ran in the same flow, and
whose other settings (engine arguments, environment, version, image) differ the least; ties go to
the arm listed first. Per workload the verdict is:

- ``pure cost``: mean acceptance length below ``accept_length_threshold`` (1.5: fewer than half a
  token accepted per draft) and the workload is worse than the baseline's by more than
  ``noise_margin`` (5%): output throughput lower, or for a rate-bound load (``constant``,
  ``poisson``, where throughput is set by the arrival rate) TPOT p50 higher;
- ``costs``: worse by more than the margin although the drafts are accepted (or acceptance was not
  measured): the drafting overhead outweighs what it saves;
- ``pays off``: better than the baseline's by more than the margin;
- ``no clear effect``: within the margin;
- without a baseline (none ran, or it lacks the workload): ``low acceptance`` when the acceptance
  length is below the threshold, ``unjudged`` otherwise.

``pure cost``, ``costs`` and ``low acceptance`` are also warning findings. The acceptance figures come
from the engine's ``/metrics`` over the workload's window (``engine_spec_mean_acceptance_length``, vLLM;
``engine_spec_accept_length_mean``, SGLang), or, when the window has none, from the engine log's mean
(per arm, not per workload). See docs/measurement.md, "Speculative decoding, judged".
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from k3pipe.engines import get_engine
from k3pipe.engines.base import Finding
from k3pipe.schema.specs import ArmSpec, ExperimentSpec

__all__ = [
    "ACCEPT_LENGTH_THRESHOLD",
    "NOISE_MARGIN",
    "RATE_BOUND_LOADS",
    "ArmSpeculation",
    "BaselineChoice",
    "SpeculationReport",
    "WorkloadVerdict",
    "choose_baseline",
    "judge_speculation",
    "speculation_setting",
]

ACCEPT_LENGTH_THRESHOLD = 1.5
"""Mean acceptance length (1 + accepted / drafts) below which speculation is called low: fewer than
half a drafted token is kept per draft, so most of the draft and verify compute is thrown away."""

NOISE_MARGIN = 0.05
"""Relative change (5%) a single run's throughput or TPOT must exceed to count as a difference."""

RATE_BOUND_LOADS = ("constant", "poisson")
"""Loads whose throughput is set by the arrival rate: for these TPOT p50 decides, not throughput."""

Verdict = Literal["pure cost", "costs", "pays off", "no clear effect", "low acceptance", "unjudged"]

_FIELD_NOTES = "(field notes, rule 3)"


class BaselineChoice(BaseModel):
    """Which plain arm a speculative arm is measured against, and why."""

    model_config = ConfigDict(frozen=True)

    arm: str = Field(description="The speculative arm.")
    baseline: str | None = Field(description="The plain arm chosen (None: no candidate ran).")
    differences: list[str] = Field(
        default_factory=list, description="Settings other than speculation that differ from the baseline."
    )
    reason: str = Field(description="Why this baseline (or why none).")


class WorkloadVerdict(BaseModel):
    """One speculative arm on one workload, against its baseline's run of the same workload."""

    model_config = ConfigDict(frozen=True)

    arm: str
    workload: str
    baseline: str | None = Field(description="Baseline arm measured against (None: acceptance alone).")
    verdict: Verdict
    rate_bound: bool = Field(description="Load is constant/poisson: TPOT p50 decides, not throughput.")
    accept_length: float | None = Field(description="Mean acceptance length (1 + accepted / drafts).")
    accept_length_source: str | None = Field(description="'/metrics' or 'engine log' (the arm's mean).")
    acceptance_rate: float | None = Field(description="Accepted / drafted tokens.")
    drafts: float | None = None
    draft_tokens: float | None = None
    accepted_tokens: float | None = None
    throughput_tps: float | None = Field(description="Client output throughput, tok/s.")
    baseline_throughput_tps: float | None = None
    throughput_ratio: float | None = Field(description="throughput_tps / baseline_throughput_tps.")
    tpot_ms_p50: float | None = None
    baseline_tpot_ms_p50: float | None = None
    tpot_ratio: float | None = Field(description="tpot_ms_p50 / baseline_tpot_ms_p50 (above 1: slower).")
    engine_generation_tps: float | None = None
    baseline_engine_generation_tps: float | None = None
    engine_throughput_ratio: float | None = Field(description="The engine's generation tok/s, ratio.")
    message: str


class ArmSpeculation(BaseModel):
    """Everything judged about one speculative arm."""

    model_config = ConfigDict(frozen=True)

    arm: str
    setting: str = Field(description="The speculation setting as written, e.g. speculative_config={...}.")
    baseline: BaselineChoice
    workloads: list[WorkloadVerdict]
    summary: str = Field(description="Verdict counts, e.g. 'pure cost on 4 of 4 workloads'.")


class SpeculationReport(BaseModel):
    """The judgement of every speculative arm of a flow, with the thresholds it used."""

    model_config = ConfigDict(frozen=True)

    accept_length_threshold: float
    noise_margin: float
    arms: list[ArmSpeculation]
    findings: list[Finding] = Field(description="Warnings: pure cost, costs, low acceptance.")

    def summary_lines(self) -> list[str]:
        """One line per speculative arm: its baseline and its verdict counts."""
        return [
            f"speculation {a.arm} ({a.setting}) vs {a.baseline.baseline or 'no baseline'}: {a.summary}"
            for a in self.arms
        ]


def speculation_setting(arm: ArmSpec) -> str | None:
    """The arm's speculative-decoding setting as its engine reads it (None: no speculation)."""
    return get_engine(arm.engine.kind).speculation(arm.engine.args)


def _settings(arm: ArmSpec) -> dict[str, Any]:
    """The arm's settings that can change its speed, speculation left out, keyed by what they mean."""
    engine = get_engine(arm.engine.kind)
    spec_key = engine.arg(arm.engine.args, engine.speculation_arg)
    out: dict[str, Any] = {}
    for key, value in arm.engine.args.items():
        if spec_key is not None and str(key) == spec_key[0]:
            continue
        flag = engine.canonical_flag(str(key)) or engine.flag_of(str(key))
        out[f"arg {flag.lstrip('-')}"] = value
    out.update({f"env {k}": v for k, v in arm.engine.env.items()})
    out["engine.version"] = arm.engine.version
    out["engine.image"] = arm.engine.image
    return out


def _differences(a: ArmSpec, b: ArmSpec) -> list[str]:
    sa, sb = _settings(a), _settings(b)
    return sorted(k for k in sa.keys() | sb.keys() if sa.get(k) != sb.get(k))


def choose_baseline(spec: ExperimentSpec, arm: str, ran: Iterable[str]) -> BaselineChoice:
    """The plain arm that ``arm`` is judged against: same engine kind and served model, no
    speculation, among the arms that ``ran``; the fewest other differences wins, then the first listed."""
    me = spec.arm(arm)
    ran = set(ran)
    plain = [
        a
        for a in spec.arms
        if a.name != arm
        and a.engine.kind == me.engine.kind
        and a.endpoint.model == me.endpoint.model
        and speculation_setting(a) is None
    ]
    candidates = [a for a in plain if a.name in ran]
    if not candidates:
        if plain:
            names = ", ".join(a.name for a in plain)
            why = f"the plain {me.engine.kind} arm(s) {names} did not run in this flow"
        else:
            why = f"no arm of engine kind {me.engine.kind} serving the same model runs without speculation"
        return BaselineChoice(
            arm=arm, baseline=None, reason=f"{why}: judged on acceptance alone (no throughput comparison)"
        )
    ranked = sorted(
        ((_differences(me, a), i, a) for i, a in enumerate(candidates)), key=lambda t: (len(t[0]), t[1])
    )
    diffs, _, best = ranked[0]
    reason = f"{best.name}: the same engine ({me.engine.kind}) and model without speculation"
    reason += f", otherwise differing in {', '.join(diffs)}" if diffs else ", otherwise identical"
    others = [f"{a.name} ({len(d)} difference(s))" for d, _, a in ranked[1:]]
    if others:
        reason += f"; chosen over {', '.join(others)}"
    return BaselineChoice(arm=arm, baseline=best.name, differences=diffs, reason=reason)


def _num(row: Mapping[str, Any] | None, key: str) -> float | None:
    if row is None:
        return None
    value = row.get(key)
    if value is None or isinstance(value, bool):
        return None
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return None if out != out else out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _pct(ratio: float) -> str:
    return f"{(ratio - 1) * 100:+.0f}%"


def _acceptance(
    row: Mapping[str, Any], log_length: float | None
) -> tuple[float | None, str | None, float | None]:
    length = _num(row, "engine_spec_mean_acceptance_length")
    if length is None:
        length = _num(row, "engine_spec_accept_length_mean")
    source = "/metrics" if length is not None else None
    if length is None and log_length is not None:
        length, source = log_length, "engine log"
    rate = _num(row, "engine_spec_acceptance_rate")
    if rate is None:
        rate = _ratio(_num(row, "engine_spec_accepted_tokens"), _num(row, "engine_spec_draft_tokens"))
    if rate is None:
        rate = _num(row, "engine_spec_accept_rate_mean")
    return length, source, rate


def _judge_workload(
    arm: str,
    workload: str,
    row: Mapping[str, Any],
    base: Mapping[str, Any] | None,
    baseline: str | None,
    rate_bound: bool,
    log_length: float | None,
    threshold: float,
    margin: float,
) -> WorkloadVerdict:
    length, source, rate = _acceptance(row, log_length)
    thr, base_thr = _num(row, "output_throughput_tps"), _num(base, "output_throughput_tps")
    tpot, base_tpot = _num(row, "tpot_ms_p50"), _num(base, "tpot_ms_p50")
    gen, base_gen = _num(row, "engine_generation_tps"), _num(base, "engine_generation_tps")
    thr_ratio, tpot_ratio = _ratio(thr, base_thr), _ratio(tpot, base_tpot)
    low = length is not None and length < threshold

    if length is None:
        accept = "acceptance not measured"
    else:
        accept = f"mean acceptance length {length:.2f}"
        if source == "engine log":
            accept += " (the engine log's mean over the arm)"
        if rate is not None:
            accept += f" ({rate:.0%} of drafted tokens accepted)"
    head = f"{arm} on {workload}: {accept}"

    # what decides: TPOT under a rate-bound load (throughput follows the arrival rate), else throughput
    by_tpot = rate_bound and tpot_ratio is not None
    if by_tpot:
        assert tpot is not None
        assert base_tpot is not None
        assert tpot_ratio is not None
        decides: float | None = 1 / tpot_ratio  # above 1: better, as for throughput
        compared = f"TPOT p50 {tpot:.2f} ms vs {base_tpot:.2f} ms without speculation ({_pct(tpot_ratio)})"
        if thr_ratio is not None:
            compared += (
                f"; output {thr:.0f} vs {base_thr:.0f} tok/s ({_pct(thr_ratio)}), the load being rate-bound"
            )
    elif thr_ratio is not None:
        decides = thr_ratio
        compared = f"output {thr:.0f} tok/s vs {base_thr:.0f} without speculation ({_pct(thr_ratio)})"
    else:
        decides, compared = None, ""

    verdict: Verdict
    if decides is None:
        # no baseline (or it lacks the figures): acceptance alone
        if low:
            verdict = "low acceptance"
            tail = (
                f"below {threshold:.2f}, fewer than {threshold - 1:.1f} tokens accepted per draft: "
                f"speculation is likely pure cost on this data {_FIELD_NOTES}; no plain arm of the same "
                "engine and model ran this workload to measure throughput against"
            )
        else:
            verdict = "unjudged"
            tail = "no plain arm of the same engine and model ran this workload to measure against"
        message = f"{head}: {tail}"
    else:
        if decides < 1 - margin:
            verdict = "pure cost" if low else "costs"
        elif decides > 1 + margin:
            verdict = "pays off"
        else:
            verdict = "no clear effect"
        tail = {
            "pure cost": f"speculation is pure cost on this data {_FIELD_NOTES}",
            "costs": (
                "speculation costs more than it saves here although drafts are accepted"
                if length is not None
                else "speculation costs more than it saves here"
            ),
            "pays off": "speculation pays off on this data",
            "no clear effect": f"within the {margin:.0%} noise margin: no clear effect",
        }[verdict]
        message = f"{head}, {compared}: {tail}"
    return WorkloadVerdict(
        arm=arm,
        workload=workload,
        baseline=baseline if base is not None else None,
        verdict=verdict,
        rate_bound=rate_bound,
        accept_length=length,
        accept_length_source=source,
        acceptance_rate=rate,
        drafts=_num(row, "engine_spec_drafts"),
        draft_tokens=_num(row, "engine_spec_draft_tokens"),
        accepted_tokens=_num(row, "engine_spec_accepted_tokens"),
        throughput_tps=thr,
        baseline_throughput_tps=base_thr,
        throughput_ratio=thr_ratio,
        tpot_ms_p50=tpot,
        baseline_tpot_ms_p50=base_tpot,
        tpot_ratio=tpot_ratio,
        engine_generation_tps=gen,
        baseline_engine_generation_tps=base_gen,
        engine_throughput_ratio=_ratio(gen, base_gen),
        message=message,
    )


def _summary(verdicts: list[WorkloadVerdict]) -> str:
    if not verdicts:
        return "no workload measured"
    counts = Counter(v.verdict for v in verdicts)
    order = sorted(counts, key=lambda k: (-counts[k], k))
    return "; ".join(f"{k} on {counts[k]} of {len(verdicts)} workloads" for k in order)


_RULES = {
    "pure cost": "speculation-pure-cost",
    "costs": "speculation-costs",
    "low acceptance": "speculation-low-acceptance",
}


def judge_speculation(
    spec: ExperimentSpec,
    rows: Iterable[Mapping[str, Any]],
    *,
    log_accept_length: Mapping[str, float] | None = None,
    accept_length_threshold: float = ACCEPT_LENGTH_THRESHOLD,
    noise_margin: float = NOISE_MARGIN,
) -> SpeculationReport:
    """Judge every speculative arm in ``rows`` (the flow's per-workload rows: ``arm``, ``workload``
    and that workload's metrics) against its baseline, workload by workload.

    ``log_accept_length`` is each arm's mean acceptance length from its engine log, used where a
    workload's ``/metrics`` window has none.
    """
    by_arm: dict[str, dict[str, Mapping[str, Any]]] = {}
    for row in rows:
        by_arm.setdefault(str(row["arm"]), {})[str(row["workload"])] = row
    loads = {w.name: w.load for w in spec.workloads}
    arms: list[ArmSpeculation] = []
    findings: list[Finding] = []
    for arm in spec.arms:
        setting = speculation_setting(arm)
        if setting is None or arm.name not in by_arm:
            continue
        choice = choose_baseline(spec, arm.name, by_arm)
        base_rows = by_arm.get(choice.baseline or "", {})
        verdicts = [
            _judge_workload(
                arm.name,
                name,
                row,
                base_rows.get(name),
                choice.baseline,
                loads.get(name) in RATE_BOUND_LOADS,
                (log_accept_length or {}).get(arm.name),
                accept_length_threshold,
                noise_margin,
            )
            for name, row in by_arm[arm.name].items()
        ]
        findings += [
            Finding(severity="warning", rule=_RULES[v.verdict], arm=arm.name, message=v.message)
            for v in verdicts
            if v.verdict in _RULES
        ]
        arms.append(
            ArmSpeculation(
                arm=arm.name, setting=setting, baseline=choice, workloads=verdicts, summary=_summary(verdicts)
            )
        )
    return SpeculationReport(
        accept_length_threshold=accept_length_threshold,
        noise_margin=noise_margin,
        arms=arms,
        findings=findings,
    )
