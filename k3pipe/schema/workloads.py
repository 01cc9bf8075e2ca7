"""A workload: its dataset, load (concurrency, rate, duration), SLO, capacity search or ladder,
and the load client's processes.

Part of the experiment's schema; :mod:`k3pipe.schema.specs` re-exports every name."""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from k3pipe.core.errors import SpecError
from k3pipe.core.procs import parse_cpu_list
from k3pipe.schema.common import (
    MAX_CONCURRENCY,
    MAX_DURATION_S,
    MAX_GROUPS,
    MAX_METRICS_INTERVAL_S,
    MAX_RATE_RPS,
    MAX_REPEATS,
    MAX_REQUEST_TIMEOUT_S,
    MAX_REQUESTS,
    MAX_SEED,
    MAX_SLO_MS,
    MAX_TOKENS,
    MAX_WARMUP_TOLERANCE_PCT,
    MAX_WORKLOAD_PROMPTS,
    MIN_METRICS_INTERVAL_S,
    _count,
    _finite,
    _Spec,
    expand_home,
    safe_name,
)
from k3pipe.schema.traces import Trace, read_trace


class RandomDataset(_Spec):
    """Random prompts of exactly ``input_tokens`` tokens under the served model's tokenizer.

    Repeat ``k`` of the workload draws its prompts with ``seed + k``.
    """

    kind: Literal["random"] = Field(default="random", description="Random word tokens, exact length.")


class ShareGPTDataset(_Spec):
    """Conversations in ShareGPT format (a JSON list of ``{"conversations": [{"from", "value"}...]}``).

    Each prompt is a conversation's first human turn; conversations whose first turn is shorter than
    ``min_input_tokens`` or longer than the workload's ``input_tokens`` are left out, and a first
    turn that repeats an earlier one counts once. The prompts are a seeded permutation (the
    workload's ``seed``) of the turns kept, taken in blocks of ``warmup_requests + num_requests``:
    repeat ``k`` sends the ``k``-th block, so no repeat resends a prompt of another, and the file must
    hold ``repeats`` such blocks.
    """

    kind: Literal["sharegpt"] = Field(description="ShareGPT-format JSON file on this machine.")
    path: str = Field(
        min_length=1,
        description=(
            "The JSON file; '{home}' expands to K3PIPE_HOME, relative paths to the working directory."
        ),
    )
    min_input_tokens: int = _count(
        default=4, ge=1, le=MAX_TOKENS, description="Leave out first turns shorter than this."
    )


class DocumentsDataset(_Spec):
    """Long documents: text files in a folder, each cut to exactly ``input_tokens`` tokens.

    Documents shorter than ``input_tokens`` are left out; the documents and token offsets are drawn
    with the workload's ``seed`` (a document is drawn again when there are fewer documents than
    prompts). A window moves forward from its offset to a cut between words, or to another offset
    when that start is already a window's: no two prompts of the workload, across all its repeats,
    start at the same token of the same document or have the same text (repeat ``k`` sends the
    ``k``-th block of ``warmup_requests + num_requests`` windows of one seeded sequence). A request
    for more windows than the documents have distinct starts is refused.
    """

    kind: Literal["documents"] = Field(description="A folder of text files cut to input_tokens.")
    path: str = Field(
        min_length=1,
        description="The folder; '{home}' expands to K3PIPE_HOME, relative paths to the working directory.",
    )
    glob: str = Field(default="*.txt", description="Which files of the folder are documents.")

    @field_validator("glob")
    @classmethod
    def _relative(cls, value: str) -> str:
        if not value.strip() or value.startswith("/") or ".." in value.split("/"):
            raise ValueError(
                f"glob {value!r} must be a pattern relative to the folder, without '..' (e.g. '*.txt')"
            )
        return value


class SharedPrefixDataset(_Spec):
    """Prompts that share a prefix, for prefix caching: ``groups`` random prefixes of ``prefix_tokens``
    tokens, each prompt one of them followed by its own random suffix; ``input_tokens`` in all.
    Repeat ``k`` of the workload draws prefixes and suffixes with ``seed + k``."""

    kind: Literal["shared_prefix"] = Field(description="N prompts sharing P prefix tokens.")
    prefix_tokens: int = _count(gt=0, le=MAX_TOKENS, description="Tokens every prompt of a group shares (P).")
    groups: int = _count(
        default=1, ge=1, le=MAX_GROUPS, description="Distinct prefixes; prompts are dealt round-robin."
    )


DatasetSpec = Annotated[
    RandomDataset | ShareGPTDataset | DocumentsDataset | SharedPrefixDataset, Field(discriminator="kind")
]


MAX_TRACE_SPEED = 1000.0


class TraceSpec(_Spec):
    """A trace replayed as the workload (docs/traces.md): its requests sent at the trace's times (open
    loop), a session's turn after the previous turn's answer, carrying it. Given as a path alone
    (``trace: FILE``) or with these settings."""

    path: str = Field(
        description="The trace file (k3pipe's format; `k3pipe trace convert` reads Mooncake and OTel "
        "files). '{home}' expands to K3PIPE_HOME; a relative path is taken from the working directory."
    )
    speed: float = _finite(
        default=1.0, gt=0, le=MAX_TRACE_SPEED, description="Replay this many times faster than recorded."
    )
    max_idle_s: float | None = _finite(
        default=None,
        ge=0,
        le=MAX_DURATION_S,
        description="Cut a gap between two sends longer than this to this (seconds after speed); None: "
        "every gap as recorded.",
    )
    requests: int | None = _count(
        default=None, ge=1, le=MAX_REQUESTS, description="Replay the trace's first N requests only."
    )
    thread_answers: bool = Field(
        default=True,
        strict=True,
        description="A session's later turn carries the engine's real answer to the turn before (chat: "
        "as the assistant message); false: the rebuilt text of the recorded answer.",
    )
    session_field: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$",
        description="A body field every request of a session carries, set to the session's name and the "
        "repeat (e.g. litellm_session_id: a LiteLLM router with optional_pre_call_checks "
        "[session_affinity] keeps a session on one deployment, so its prefix cache is reused); None: none.",
    )

    def file(self) -> Path:
        """Where the trace is on this machine."""
        home = Path(os.environ.get("K3PIPE_HOME") or "~/.k3pipe").expanduser()
        return Path(os.path.abspath(Path(expand_home(self.path, home)).expanduser()))

    def load(self) -> Trace:
        """The trace, cut to ``requests``; read once per file state (path, size, mtime) in a process.

        Raises:
            SpecError: the file is missing or not a trace (the message names the line and field).
        """
        path = self.file()
        try:
            stat = path.stat()
        except OSError:
            raise ValueError(
                f"trace.path {self.path!r} ({path}) does not exist: give a k3pipe trace file (`k3pipe trace "
                "make` makes the ready agentic one; `k3pipe trace convert` converts Mooncake and "
                "OpenTelemetry files)"
            ) from None
        key = (str(path), stat.st_size, stat.st_mtime_ns)
        trace = _TRACES.get(key)
        if trace is None:
            try:
                trace = read_trace(path)
            except SpecError as exc:  # a field's problem to pydantic (the loader names the field)
                raise ValueError(str(exc)) from None
            _TRACES.clear()  # one file at a time is what a process replays
            _TRACES[key] = trace
        if self.requests is not None:
            if self.requests > len(trace.requests):
                raise ValueError(
                    f"trace.requests {self.requests} is more than the {len(trace.requests)} requests of "
                    f"{self.path}: give at most {len(trace.requests)}, or leave it out to replay them all"
                )
            trace = dataclasses.replace(trace, requests=trace.requests[: self.requests])
        return trace


_TRACES: dict[tuple[str, int, int], Trace] = {}

# what a trace sets (it is the load): given, a field must equal what the trace gives
_TRACE_DERIVED = ("input_tokens", "output_tokens", "num_requests", "concurrency")
_TRACE_REFUSED = {
    "load": "concurrency",
    "rate_rps": None,
    "duration_s": None,
    "warmup_requests": 0,
    "ladder": None,
    "capacity": None,
}


def trace_fields(trace: Trace) -> dict[str, int]:
    """What a trace sets of its workload: the longest prompt and answer, the requests, and the most
    sessions open at once (a session open from its first send to its last), which preflight's memory
    estimates read as the streams in flight."""
    spans: dict[str, list[float]] = {}
    for r in trace.requests:
        if r.session is not None:
            span = spans.setdefault(r.session, [r.t, r.t])
            span[1] = r.t
    events = sorted(
        [(a, 1) for a, _ in spans.values()] + [(b, -1) for _, b in spans.values()],
        key=lambda e: (e[0], -e[1]),
    )
    open_, peak = 0, 0
    for _, step in events:
        open_ += step
        peak = max(peak, open_)
    alone = sum(r.session is None for r in trace.requests)
    return {
        "input_tokens": max(r.input_tokens for r in trace.requests),
        "output_tokens": max(r.output_tokens for r in trace.requests),
        "num_requests": len(trace.requests),
        "concurrency": max(1, min(MAX_CONCURRENCY, peak + min(alone, 1))),
    }


class SLOSpec(_Spec):
    """Service-level objectives: a request meets them when every threshold given holds (<=).

    Goodput is the rate of requests that met them; attainment the share of measured requests that did
    (failed requests count as missed).
    """

    ttft_ms: float | None = _finite(
        default=None, gt=0, le=MAX_SLO_MS, description="Most time to first token, ms."
    )
    tpot_ms: float | None = _finite(
        default=None, gt=0, le=MAX_SLO_MS, description="Most time per output token, ms."
    )
    e2e_ms: float | None = _finite(
        default=None, gt=0, le=MAX_SLO_MS, description="Most end-to-end latency, ms."
    )

    @model_validator(mode="after")
    def _some_threshold(self) -> SLOSpec:
        if self.ttft_ms is None and self.tpot_ms is None and self.e2e_ms is None:
            raise ValueError("an slo needs at least one of ttft_ms, tpot_ms, e2e_ms")
        return self


class CapacitySpec(_Spec):
    """Search the workload's load for the highest point that meets its ``slo``
    (k3pipe.verdicts.capacity): each
    probe sends the workload at one request rate (``over: rate``, under the workload's load
    'constant' or 'poisson') or concurrency (``over: concurrency``) on the same running engine, and
    passes when at least ``attainment_pct`` of its measured requests met every objective, TTFT and
    E2E counted from each request's scheduled arrival. From ``start``, the load is multiplied or
    divided by ``factor`` until a pass and a fail surround the boundary (or ``low`` / ``high`` is
    reached), then bisected until the failing point is within ``tolerance_pct`` of the passing one.
    Each repeat is a search of its own (its own prompts and arrivals): the repeats give the interval.
    Under 'rate' the workload's ``concurrency`` caps the requests in flight: set it at or above what
    the engine runs at once (its max_num_seqs), or the client's own queue is what is measured."""

    over: Literal["rate", "concurrency"] = Field(
        default="rate", description="What the search varies: request rate (req/s) or concurrency."
    )
    low: float = _finite(gt=0, le=MAX_RATE_RPS, description="The lowest load to try (req/s, or streams).")
    high: float = _finite(gt=0, le=MAX_RATE_RPS, description="The highest load to try.")
    start: float | None = _finite(
        default=None,
        gt=0,
        le=MAX_RATE_RPS,
        description="The first load probed (default: the geometric middle).",
    )
    factor: float = _finite(default=2.0, gt=1, le=16, description="Bracketing step: x or / this factor.")
    tolerance_pct: float = _finite(
        default=5.0, ge=0, le=100, description="The search ends once fail / pass <= 1 + this / 100."
    )
    attainment_pct: float = _finite(
        default=90.0, gt=0, le=100, description="A probe passes when this share of its requests met the SLO."
    )
    max_probes: int = _count(default=12, ge=2, le=64, description="The most probes a search may run.")
    reset_prefix_cache: bool = Field(
        default=True,
        strict=True,
        description="Empty the engine's prefix cache before each probe where it offers a way (vLLM's "
        "/reset_prefix_cache with VLLM_SERVER_DEV_MODE=1, SGLang's /flush_cache); recorded either way.",
    )

    @model_validator(mode="after")
    def _bounds(self) -> CapacitySpec:
        if self.low >= self.high:
            raise ValueError(f"capacity.low ({self.low:g}) must be below capacity.high ({self.high:g})")
        if self.start is not None and not self.low <= self.start <= self.high:
            raise ValueError(
                f"capacity.start ({self.start:g}) must lie within [low, high] = [{self.low:g}, {self.high:g}]"
            )
        if self.over == "concurrency":
            for name in ("low", "high", "start"):
                value = getattr(self, name)
                if value is not None and (value != int(value) or value > MAX_CONCURRENCY):
                    raise ValueError(
                        f"capacity.{name} ({value:g}) must be a whole number of streams up to "
                        f"{MAX_CONCURRENCY:,} under over: concurrency"
                    )
        return self


class LadderSpec(_Spec):
    """Measure the workload at several loads on the same running engine, lowest first: each point a
    workload run of its own (named ``NAME@c8`` or ``NAME@2.5rps``), with the workload's repeats and
    prompts, the prefix cache emptied before each point where the engine offers a way. Points are
    ``points``, or ``start`` times ``factor`` up to ``stop``. With ``stop_when_saturated`` the ladder
    ends past saturation: output throughput up by less than ``min_gain_pct`` over the point before
    while the mean end-to-end latency rose by more than that (the added load only queued), shown by
    the repeats' spread, or by two points in a row where each point is measured once
    (k3pipe.verdicts.capacity.LadderStop)."""

    over: Literal["concurrency", "rate"] = Field(
        default="concurrency", description="What the ladder varies: concurrency (streams) or request rate."
    )
    points: list[float] | None = Field(
        default=None, min_length=1, max_length=64, description="The loads, in any order (run lowest first)."
    )
    start: float | None = _finite(default=None, gt=0, le=MAX_RATE_RPS, description="Geometric range: first.")
    stop: float | None = _finite(default=None, gt=0, le=MAX_RATE_RPS, description="Geometric range: at most.")
    factor: float = _finite(default=2.0, gt=1, le=16, description="Geometric range: step.")
    stop_when_saturated: bool = Field(default=True, strict=True, description="End past saturation.")
    min_gain_pct: float = _finite(
        default=5.0,
        ge=0,
        le=100,
        description="Less output-throughput gain than this, latency rising: saturated.",
    )

    @model_validator(mode="after")
    def _some_points(self) -> LadderSpec:
        if (self.points is None) == (self.start is None or self.stop is None):
            raise ValueError("a ladder needs either points or both start and stop (a geometric range)")
        if self.points is not None and (self.start is not None or self.stop is not None):
            raise ValueError("a ladder takes points or start/stop, not both")
        values = self.values()
        if len(values) > 64:
            raise ValueError(f"the ladder has {len(values)} points, more than 64: raise factor or narrow it")
        for v in values:
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"ladder point {v!r} must be a positive number")
            if self.over == "concurrency" and (v != int(v) or v > MAX_CONCURRENCY):
                raise ValueError(
                    f"ladder point {v:g} must be a whole number of streams up to {MAX_CONCURRENCY:,}"
                )
            if self.over == "rate" and v > MAX_RATE_RPS:
                raise ValueError(f"ladder point {v:g} req/s is above {MAX_RATE_RPS:,.0f}")
        return self

    def values(self) -> list[float]:
        """The points, lowest first, without repeats."""
        if self.points is not None:
            return sorted(set(float(v) for v in self.points))
        assert self.start is not None
        assert self.stop is not None
        out: list[float] = []
        v = self.start
        while v <= self.stop * (1 + 1e-9) and len(out) <= 64:
            out.append(float(round(v)) if self.over == "concurrency" else v)
            v *= self.factor
        return sorted(set(out))

    def label(self, point: float) -> str:
        return f"c{int(point)}" if self.over == "concurrency" else f"{point:g}rps"


class WorkloadSpec(_Spec):
    """One load shape over a dataset of prompts (random ones of exact length by default).

    ``load`` picks how measured requests are sent: ``concurrency`` keeps exactly ``concurrency``
    requests in flight (each slot sends the next request as soon as its previous one ends);
    ``constant`` sends one request every ``1 / rate_rps`` seconds; ``poisson`` sends at Poisson
    arrivals of rate ``rate_rps`` (exponential gaps drawn from ``numpy.random.default_rng(seed)``).
    Under ``constant`` and ``poisson``, ``concurrency`` caps the requests in flight: a request due
    while the cap is reached waits for a slot, and that wait shows as send lag in the summary.

    Before its measured requests each repeat sends ``warmup_requests`` warm-up requests at
    ``concurrency`` (not measured, all ended before the measured phase opens); with ``warmup:
    steady`` in waves of ``concurrency`` until two consecutive waves' output rates agree within
    ``warmup_tolerance_pct``, ``warmup_requests`` being the most (docs/measurement.md, "Warm-up").

    Every workload's prompts are built in memory before the first launch, so a workload holds at
    most ``MAX_WORKLOAD_PROMPTS`` prompts (``(warmup_requests + num_requests) x repeats``).
    """

    name: str = Field(
        description="Workload name, unique within the experiment (letters, digits, '-', '_', '.')."
    )
    input_tokens: int = _count(
        gt=0,
        le=MAX_TOKENS,
        description=(
            "Prompt length in tokens (the model's tokenizer): exact for random, documents and "
            "shared_prefix datasets, the upper bound for sharegpt."
        ),
    )
    dataset: DatasetSpec = Field(
        default_factory=RandomDataset,
        description="Where prompts come from: random (default), sharegpt, documents or shared_prefix.",
    )
    trace: TraceSpec | None = Field(
        default=None,
        description="Replay a trace (a file, or {path, speed, max_idle_s, requests}): its times, sessions, "
        "lengths make the load, and input_tokens, output_tokens, num_requests and concurrency come from it.",
    )
    output_tokens: int = _count(
        gt=0, le=MAX_TOKENS, description="Tokens to generate (max_tokens, with ignore_eos)."
    )
    concurrency: int = _count(
        default=1,
        ge=1,
        le=MAX_CONCURRENCY,
        description=(
            "Requests in flight at once (load 'concurrency'); the cap on requests in flight for "
            "'constant' and 'poisson'. Warm-up requests always run at this concurrency."
        ),
    )
    load: Literal["concurrency", "constant", "poisson"] = Field(
        default="concurrency",
        description=(
            "How measured requests are sent: 'concurrency' (fixed concurrency), 'constant' (one every "
            "1/rate_rps s) or 'poisson' (Poisson arrivals of rate rate_rps, seeded by seed)."
        ),
    )
    rate_rps: float | None = _finite(
        default=None,
        gt=0,
        le=MAX_RATE_RPS,
        description="Requests per second of load 'constant' or 'poisson' (required there, else refused).",
    )
    duration_s: float | None = _finite(
        default=None,
        gt=0,
        le=MAX_DURATION_S,
        description=(
            "Stop sending new measured requests this many seconds after the first measured send "
            "(requests in flight still finish); num_requests stays the upper bound. None: no bound."
        ),
    )
    num_requests: int = _count(
        default=16,
        ge=1,
        le=MAX_REQUESTS,
        description="Measured requests (the most sent when duration_s bounds the run).",
    )
    warmup_requests: int = _count(
        default=0,
        ge=0,
        le=MAX_REQUESTS,
        description=(
            "Requests sent first, at concurrency, and not measured (each repeat's first prompts): "
            "all of them under warmup 'fixed', the most under warmup 'steady'."
        ),
    )
    warmup: Literal["fixed", "steady"] = Field(
        default="fixed",
        description=(
            "'fixed': send warmup_requests warm-up requests. 'steady': send them in waves of "
            "concurrency (each wave ends before the next is sent) until two consecutive waves' "
            "output rates agree within warmup_tolerance_pct, at most warmup_requests // concurrency "
            "waves (docs/measurement.md, 'Warm-up')."
        ),
    )
    warmup_tolerance_pct: float = _finite(
        default=5.0,
        gt=0,
        le=MAX_WARMUP_TOLERANCE_PCT,
        description=(
            "Two consecutive warm-up waves agree when the later's output rate is within this many "
            "percent of the earlier's: warmup 'steady' stops there; under 'fixed' it only judges "
            "whether the warm-up ended steady (metric warmup_steady)."
        ),
    )
    seed: int = _count(
        default=0,
        ge=0,
        le=MAX_SEED,
        description=(
            "Seed of the prompts (generation or sampling) and of the Poisson arrivals; non-negative "
            "(numpy's default_rng refuses a negative seed)."
        ),
    )
    repeats: int = _count(
        default=1,
        ge=1,
        le=MAX_REPEATS,
        description=(
            "Run the workload this many times, each repeat with prompts of its own (random kinds drawn "
            "with seed + k; sharegpt and documents: disjoint slices of one draw) and arrivals seeded "
            "seed + k; the summary then gives mean, std and a 95% confidence interval across repeats."
        ),
    )
    slo: SLOSpec | None = Field(
        default=None, description="Latency objectives; with them the summary gives goodput and attainment."
    )
    ladder: LadderSpec | None = Field(
        default=None,
        description="Measure this workload at several loads on the same engine, lowest first, each "
        "point a workload run of its own (NAME@c8, NAME@2.5rps), ending past saturation.",
    )
    capacity: CapacitySpec | None = Field(
        default=None,
        description="Search for the highest load that meets slo instead of measuring one load point "
        "(k3pipe.verdicts.capacity): its probes run on the same engine, each a nested run.",
    )
    metrics_interval_s: float = _finite(
        default=1.0,
        ge=MIN_METRICS_INTERVAL_S,
        le=MAX_METRICS_INTERVAL_S,
        description="How often the engine's /metrics is scraped during the workload, in seconds.",
    )
    api: Literal["chat", "completions"] = Field(
        default="chat", description="chat: /chat/completions; completions: /completions."
    )
    ignore_eos: bool = Field(
        default=True,
        strict=True,
        description="Send ignore_eos so every request generates exactly output_tokens.",
    )
    request_timeout_s: float = _finite(
        default=600.0, gt=0, le=MAX_REQUEST_TIMEOUT_S, description="Per-request timeout."
    )

    @field_validator("name")
    @classmethod
    def _safe_name(cls, value: str) -> str:
        return safe_name(value, "workload")

    @model_validator(mode="before")
    @classmethod
    def _from_trace(cls, data: Any) -> Any:
        """A trace workload's lengths, requests and streams come from its trace, read here: a trace
        that is missing or malformed is refused where the experiment is parsed."""
        if not isinstance(data, dict) or data.get("trace") is None:
            return data
        raw = data["trace"]
        if isinstance(raw, str):
            raw = {"path": raw}
        try:
            spec = TraceSpec.model_validate(raw)
        except ValidationError:
            # the field's own validation names what is wrong (the lengths it would give are not asked for)
            return {"input_tokens": 1, "output_tokens": 1, **data, "trace": raw}
        derived = trace_fields(spec.load())
        out = {**data, "trace": spec}
        for key in _TRACE_DERIVED:
            given = data.get(key)
            if given is not None and given != derived[key]:
                raise ValueError(
                    f"{key}={given!r} but the trace {spec.path} gives {derived[key]!r}: a trace sets "
                    f"{key} itself; remove it (trace.requests replays the first N requests)"
                )
            out[key] = derived[key]
        for key, default in _TRACE_REFUSED.items():
            if key in data and data[key] != default:
                raise ValueError(
                    f"{key}={data[key]!r} does not apply to a trace, whose requests go at its own times "
                    f"(trace.speed and trace.max_idle_s shape them): remove {key}"
                )
        if "dataset" in data and data["dataset"] not in (None, {"kind": "random"}):
            raise ValueError(
                "dataset does not apply to a trace: its prompts are rebuilt from its blocks; remove dataset"
            )
        return out

    def _capacity_fits(self) -> None:
        capacity = self.capacity
        assert capacity is not None
        if self.slo is None:
            raise ValueError(
                "capacity searches for the highest load that meets the workload's slo: set slo "
                "(ttft_ms, tpot_ms and/or e2e_ms)"
            )
        if capacity.over == "rate":
            if self.load == "concurrency":
                raise ValueError(
                    "capacity over 'rate' sends at request rates: set load to 'poisson' or 'constant' "
                    "(or capacity.over to 'concurrency')"
                )
            if self.rate_rps is not None:
                raise ValueError(
                    f"rate_rps ({self.rate_rps:g}) is chosen by the capacity search, probe by probe: "
                    "remove it (capacity.start sets the first rate)"
                )
        elif self.load != "concurrency":
            raise ValueError(
                f"capacity over 'concurrency' sends at fixed concurrency: set load to 'concurrency' "
                f"(it is {self.load!r}), or capacity.over to 'rate'"
            )

    def _ladder_fits(self) -> None:
        ladder = self.ladder
        assert ladder is not None
        if ladder.over == "rate":
            if self.load == "concurrency":
                raise ValueError(
                    "a ladder over 'rate' sends at request rates: set load to 'poisson' or 'constant' "
                    "(or ladder.over to 'concurrency')"
                )
            if self.rate_rps is not None:
                raise ValueError(f"rate_rps ({self.rate_rps:g}) is set by each ladder point: remove it")
        elif self.load != "concurrency":
            raise ValueError(
                f"a ladder over 'concurrency' sends at fixed concurrency: set load to 'concurrency' "
                f"(it is {self.load!r}), or ladder.over to 'rate'"
            )

    def rung(self, point: float) -> WorkloadSpec:
        """This workload at one point of its ladder: a workload of its own, named NAME@c8 / NAME@2rps."""
        assert self.ladder is not None
        name = f"{self.name}@{self.ladder.label(point)}"
        if self.ladder.over == "rate":
            return self.model_copy(update={"name": name, "rate_rps": point, "ladder": None})
        return self.model_copy(update={"name": name, "concurrency": int(point), "ladder": None})

    def probe(self, point: float) -> WorkloadSpec:
        """This workload at one load point of its capacity search (a rate, or a concurrency)."""
        assert self.capacity is not None
        if self.capacity.over == "rate":
            return self.model_copy(update={"rate_rps": point, "capacity": None})
        return self.model_copy(update={"concurrency": int(point), "capacity": None})

    def loaded_trace(self) -> Trace:
        """The trace this workload replays."""
        assert self.trace is not None, f"workload {self.name} replays no trace"
        return self.trace.load()

    @property
    def prompt_count(self) -> int:
        """Prompts the workload builds before the first launch: ``(warmup + num_requests) x repeats``."""
        return (self.warmup_requests + self.num_requests) * self.repeats

    @model_validator(mode="after")
    def _rate_fits_load(self) -> WorkloadSpec:
        if self.ladder is not None and self.capacity is not None:
            raise ValueError("a workload has a ladder or a capacity search, not both: split it in two")
        if self.capacity is not None:
            self._capacity_fits()
        elif self.ladder is not None:
            self._ladder_fits()
        elif self.load in ("constant", "poisson") and self.rate_rps is None:
            raise ValueError(f"load {self.load!r} needs rate_rps (requests per second)")
        if self.load == "concurrency" and self.rate_rps is not None:
            raise ValueError(
                "rate_rps is only used by load 'constant' or 'poisson'; "
                "remove it or set load (the default, 'concurrency', sends at fixed concurrency)"
            )
        if self.warmup == "steady" and self.warmup_requests < 2 * self.concurrency:
            raise ValueError(
                f"warmup 'steady' compares consecutive waves of concurrency ({self.concurrency}) "
                f"warm-up requests, so warmup_requests (the most it sends, {self.warmup_requests}) must "
                f"allow two waves at least: set warmup_requests to {2 * self.concurrency} or more, or "
                "warmup to 'fixed'"
            )
        if isinstance(self.dataset, SharedPrefixDataset) and self.dataset.prefix_tokens >= self.input_tokens:
            raise ValueError(
                f"dataset.prefix_tokens ({self.dataset.prefix_tokens}) must be below input_tokens "
                f"({self.input_tokens}): each prompt is the shared prefix plus a suffix of its own"
            )
        if self.prompt_count > MAX_WORKLOAD_PROMPTS:
            raise ValueError(
                f"(warmup_requests {self.warmup_requests:,} + num_requests {self.num_requests:,}) x "
                f"repeats {self.repeats:,} = {self.prompt_count:,} prompts, more than the "
                f"{MAX_WORKLOAD_PROMPTS:,} a workload may build: all its prompts are built in memory "
                "before the engine starts; send fewer requests, or split it into workloads"
            )
        return self


MAX_CLIENT_PROCESSES = 256


class ClientSpec(_Spec):
    """How k3pipe's load generator runs: its processes, their CPUs and priority (what was used is
    recorded with every workload: client_load.json, client_* metrics)."""

    processes: int | None = _count(
        default=None,
        ge=1,
        le=MAX_CLIENT_PROCESSES,
        description=(
            "Client processes a workload's streams are spread over, each with its own event loop and "
            "connections under one schedule (None: one per 128 streams of the workload's concurrency, "
            "at most one per CPU the client may use)."
        ),
    )
    cpus: str | None = Field(
        default=None,
        description=(
            "CPUs the client processes run on, taskset-style ('0-7,16'), split among them (None: every "
            "CPU k3pipe may use except a process-launched engine's launcher.cpus)."
        ),
    )
    realtime: bool = Field(
        default=False,
        strict=True,
        description=(
            "Run the client processes under SCHED_FIFO (needs CAP_SYS_NICE; where refused they run at "
            "normal priority, and the record says so)."
        ),
    )

    @field_validator("cpus")
    @classmethod
    def _cpus(cls, value: str | None) -> str | None:
        if value is not None:
            parse_cpu_list(value, "client.cpus")
        return value
