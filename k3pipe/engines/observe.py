"""Engine logs: split each line into its prefix (time, rank, level) and message, and read the facts
k3pipe records from a start-up + serving log.

Each engine module describes its own log with a :class:`LogPatterns` (line prefix, readiness line,
the lines that carry KV pool size, graph capture time, throughput samples, the cold-start phases,
compile-cache hits ...); :func:`parse_engine_log` does the reading for every engine alike, and
:func:`phase_table` renders the cold-start phases as text. Lines that match no prefix (uvicorn's
own lines, tracebacks, progress bars) are kept as messages without time or rank; lines starting with
``#`` (comments of the fixture files under ``tests/fixtures/engines``) and blank lines are skipped.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from statistics import fmean
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, computed_field

__all__ = [
    "KERNEL_CONFIG_DEVICE",
    "UNTUNED_KERNEL",
    "ColdStartPhase",
    "EngineLogFacts",
    "LogFormat",
    "LogLine",
    "LogPatterns",
    "PhasePattern",
    "TimedLine",
    "log_wall_time",
    "parse_engine_log",
    "phase_table",
    "read_log_lines",
    "same_device",
]

API_READY = "api_ready"
"""The phase every engine has: first timestamped log line -> the readiness line."""

KERNEL_CONFIG_DEVICE = re.compile(r"\bdevice_name=(?P<v>[^,/\s'\"]+?)(?:_down)?(?:,|\.json)")
"""The device name inside a tuned-kernel config file's name, as both engines build it from
``torch.cuda.get_device_name()`` with spaces made underscores: vLLM's fused MoE and W8A8 block-FP8
lookups ("Using configuration from .../E=256,N=512,device_name=NVIDIA_H200.json for MoE layer.",
"Using default MoE config. Performance might be sub-optimal! Config file not found at ...") and
SGLang's (fused_moe_triton_config.py: "Using MoE kernel config from %s.", "Using default MoE kernel
config. Performance might be sub-optimal! Config file not found at %s, ..."; its down-projection
configs end ``_down.json``). The name the engine chose kernels for: field notes' pitfall 4, SGLang
logging "NVIDIA L20D" on a B300 node."""

UNTUNED_KERNEL = re.compile(r"Performance might be sub-optimal[!.]")
"""Both engines' words when a kernel runs on a default config for want of one tuned for the device
(or one tuned under another Triton version, SGLang's fallback; SGLang 0.5.16 ends its "Down MoE config
file not found at ...; reusing the tuned up-projection config without TMA." line with a full stop)."""


def _device_key(name: str) -> str:
    return "_".join(name.split()).casefold()


def same_device(logged: str, gpu_names: Sequence[str]) -> bool:
    """Whether a device name an engine logged (spaces as underscores) is one of nvidia-smi's names."""
    return _device_key(logged) in {_device_key(n) for n in gpu_names}


@dataclass(frozen=True)
class LogFormat:
    """An engine's line prefix.

    ``prefix`` has a ``msg`` group and optionally ``ts`` (timestamp), ``rank`` (process or rank label,
    e.g. ``Worker_TP3`` or ``TP3``) and ``level``. ``time_format`` is the ``strptime`` format of ``ts``;
    formats without a year (vLLM prints ``%m-%d %H:%M:%S``) are read in a fixed leap year, so durations
    within one log are right except across New Year.
    """

    prefix: re.Pattern[str]
    time_format: str

    def embedded(self) -> re.Pattern[str]:
        """The prefix unanchored: where a progress bar (tqdm's, with carriage returns but no newline)
        ran into the next log record, the record starts mid-line."""
        source = self.prefix.pattern
        return re.compile(source[1:] if source.startswith("^") else source, self.prefix.flags)


@dataclass(frozen=True)
class LogLine:
    """One log line: the whole text and its parts."""

    text: str
    message: str
    timestamp: str | None = None
    rank: str | None = None
    level: str | None = None


def read_log_lines(lines: Iterable[str], fmt: LogFormat) -> list[LogLine]:
    """Split lines into prefix and message; skip blank lines and ``#`` comment lines. A line that
    does not start with the prefix but has it further on (a progress bar that ran into the next log
    record: SGLang 0.5.16's "Capturing batches (bs=16 ...): 0%| | 0/6 [..][2026-12-06 09:26:59]
    Config file not found at ..." on the H100) is read from there; its whole text is kept."""
    out: list[LogLine] = []
    embedded = fmt.embedded()
    for raw in lines:
        text = raw.rstrip("\r\n")
        if not text.strip() or text.startswith("#"):
            continue
        match = fmt.prefix.match(text)
        if match is None:
            match = embedded.search(text, 1)
        if match is None:
            out.append(LogLine(text=text, message=text.strip()))
            continue
        groups = match.groupdict()
        out.append(
            LogLine(
                text=text,
                message=groups["msg"],
                timestamp=groups.get("ts"),
                rank=(groups.get("rank") or None),
                level=groups.get("level"),
            )
        )
    return out


def _when(stamp: str, fmt: LogFormat) -> datetime:
    if "%Y" in fmt.time_format or "%y" in fmt.time_format:
        return datetime.strptime(stamp, fmt.time_format)
    # 2000 is a leap year, so a '02-29' stamp parses
    return datetime.strptime(f"2000 {stamp}", f"%Y {fmt.time_format}")


def _number(text: str) -> float:
    return float(text.replace(",", ""))


@dataclass(frozen=True)
class PhasePattern:
    """One cold-start phase as an engine logs it.

    ``pattern`` has a group ``v`` (seconds). Per rank, ``combine="sum"`` adds the matches up (target +
    draft model, several compiled graphs) and ``"last"`` takes the last one (a phase logged once per
    engine); then the slowest rank is taken, since ranks work in parallel. ``within`` names the phase
    this one is part of (phases nest, so they do not add up); ``source`` says which format string(s)
    it reads.
    """

    name: str
    pattern: re.Pattern[str]
    source: str
    within: str | None = None
    combine: Literal["sum", "last"] = "sum"


@dataclass(frozen=True)
class LogPatterns:
    """What an engine's log says, as regexes over the message (prefix removed).

    Every value pattern has a group ``v``. Scalars take the LAST match (a restarted engine's latest
    start wins). ``graph_capture_s`` and ``weight_load_s`` are summed per rank (target + draft model,
    several graph kinds) and the slowest rank is taken, since ranks work in parallel.
    """

    format: LogFormat
    ready: re.Pattern[str]
    version: re.Pattern[str] | None = None
    kv_pool_tokens: re.Pattern[str] | None = None
    kv_cache_memory_gib: re.Pattern[str] | None = None
    max_concurrency: re.Pattern[str] | None = None
    max_running_requests: re.Pattern[str] | None = None
    context_length: re.Pattern[str] | None = None
    graph_capture_s: re.Pattern[str] | None = None
    weight_load_s: re.Pattern[str] | None = None
    decode_throughput_tps: re.Pattern[str] | None = None
    spec_accept_length: re.Pattern[str] | None = None
    warnings: tuple[re.Pattern[str], ...] = field(default_factory=tuple)
    phases: tuple[PhasePattern, ...] = ()
    """Cold-start phases in start-up order, a phase after the one it is part of (``api_ready``, the
    whole start-up, is added from the readiness line)."""
    compile_cache_hit: tuple[re.Pattern[str], ...] = ()
    """Lines that say compiled artifacts were loaded from the compile cache (a warm start)."""
    compile_cache_dir: re.Pattern[str] | None = None
    """The line naming the compile cache directory the engine uses (group ``v``)."""
    compile_ran: tuple[re.Pattern[str], ...] = ()
    """Lines that say a compile ran (compiled or loaded): without one, nothing went into the cache."""
    oom: tuple[re.Pattern[str], ...] = ()
    """Lines that say GPU memory ran out: every one counted, with its time and rank (the study's 32
    OOM retries across 8 GPUs were one warning when each message was kept once)."""
    device_name: re.Pattern[str] | None = None
    """Where the log names the device it chose kernels for (group ``v``, every distinct one kept)."""
    untuned_kernels: tuple[re.Pattern[str], ...] = ()
    """Lines saying a kernel runs on a default config, none tuned for this device: counted."""
    serving_compiles: tuple[re.Pattern[str], ...] = ()
    """Lines saying a kernel was compiled while the engine served (a latency spike where it falls in
    a measured window): each kept with its time, for the record to place against the windows."""


class ColdStartPhase(BaseModel):
    """One row of the cold-start phase table."""

    model_config = ConfigDict(frozen=True)

    phase: str = Field(description="Phase name; MLflow metric cold_start.<phase>_s.")
    seconds: float = Field(description="Seconds, slowest rank (see PhasePattern.combine).")
    within: str | None = Field(default=None, description="The phase this one is part of.")
    source: str = Field(description="What it is read from (the engine's format string).")
    line: str | None = Field(default=None, description="The last log line it was read from.")


class RepeatedLine(BaseModel):
    """Log lines of one kind, counted: how many, when the first and the last, and on which ranks."""

    model_config = ConfigDict(frozen=True)

    lines: int = Field(description="How many lines matched.")
    first_time: str | None = Field(
        default=None,
        description=(
            "Timestamp of the first, as printed (a line without one, a traceback's: that of the last "
            "timestamped line before it, the record it continues)."
        ),
    )
    last_time: str | None = Field(default=None, description="Timestamp of the last, likewise.")
    ranks: list[str] = Field(default_factory=list, description="The ranks (processes) that logged them.")
    first_message: str = Field(description="The first such line's message.")

    def describe(self, what: str) -> str:
        """``what`` on N log lines (R ranks, first .., last ..): the first message."""
        where = [f"{len(self.ranks)} rank{'s' * (len(self.ranks) != 1)}"] if self.ranks else []
        if self.first_time:
            where.append(f"first {self.first_time}")
        if self.last_time and self.lines > 1:
            where.append(f"last {self.last_time}")
        detail = f" ({', '.join(where)})" if where else ""
        return f"{what} on {self.lines} log line{'s' * (self.lines != 1)}{detail}: {self.first_message}"


def count_lines(lines: Sequence[LogLine], patterns: Sequence[re.Pattern[str]]) -> RepeatedLine | None:
    """Every line any of ``patterns`` matches, counted (None: none did)."""
    hits: list[LogLine] = []
    stamps: list[str] = []
    last_stamp: str | None = None
    for ln in lines:
        last_stamp = ln.timestamp or last_stamp
        if any(p.search(ln.message) for p in patterns):
            hits.append(ln)
            if last_stamp:
                stamps.append(last_stamp)
    if not hits:
        return None
    return RepeatedLine(
        lines=len(hits),
        first_time=stamps[0] if stamps else None,
        last_time=stamps[-1] if stamps else None,
        ranks=sorted({ln.rank for ln in hits if ln.rank}),
        first_message=hits[0].message,
    )


class TimedLine(BaseModel):
    """One log line's message and its timestamp as printed (None: the line has none)."""

    model_config = ConfigDict(frozen=True)

    time: str | None = Field(default=None, description="Timestamp as printed.")
    message: str


class EngineLogFacts(BaseModel):
    """What one engine log says about start-up and serving."""

    model_config = ConfigDict(frozen=True)

    engine: str = Field(description="Engine kind.")
    version: str | None = Field(default=None, description="Engine version the log reports.")
    ready: bool = Field(description="Whether the readiness line was seen.")
    ready_line: str | None = Field(default=None, description="The readiness line, as logged.")
    ready_time: str | None = Field(
        default=None, description="Timestamp on the readiness line as printed (None: the line has none)."
    )
    startup_s: float | None = Field(
        default=None,
        description=(
            "Seconds from the first timestamped line to readiness (to the last timestamp before the "
            "readiness line when that line has none). Time before the engine's first log line is not in it."
        ),
    )
    kv_pool_tokens: int | None = Field(
        default=None, description="KV pool size in tokens (SGLang: the logical pool, rows x dcp_size)."
    )
    kv_cache_memory_gib: float | None = Field(
        default=None, description="KV cache memory per GPU the engine reports, GiB."
    )
    max_concurrency: float | None = Field(
        default=None, description="vLLM: requests of max_model_len tokens the KV pool holds at once."
    )
    max_running_requests: int | None = Field(
        default=None, description="SGLang: the max_running_requests in force after start-up."
    )
    context_length: int | None = Field(default=None, description="Context length the engine serves.")
    cuda_graph_capture_s: float | None = Field(
        default=None, description="CUDA graph capture time, slowest rank, seconds."
    )
    weight_load_s: float | None = Field(
        default=None, description="Weight loading time (target + draft), slowest rank, seconds."
    )
    decode_throughput_tps: list[float] = Field(
        default_factory=list, description="Generation throughput samples as logged, tokens/s."
    )
    spec_accept_lengths: list[float] = Field(
        default_factory=list, description="Speculative mean acceptance length samples as logged."
    )
    warnings: list[str] = Field(
        default_factory=list,
        description="Result-changing warnings (field notes, measurement rule 4), each message once.",
    )
    cold_start_phases: list[ColdStartPhase] = Field(
        default_factory=list, description="Cold-start phases the log states, in start-up order."
    )
    compile_cache_hit: bool = Field(
        default=False, description="Whether compiled artifacts were loaded from the compile cache."
    )
    compile_cache_dir: str | None = Field(
        default=None, description="The compile cache directory the engine reports using."
    )
    compiled: bool = Field(
        default=False, description="Whether the log shows a compile (from scratch or from the cache)."
    )
    oom: RepeatedLine | None = Field(
        default=None, description="Every line saying GPU memory ran out, counted (None: no such line)."
    )
    device_names: list[str] = Field(
        default_factory=list,
        description="The device names the engine chose kernels by, as logged (spaces as underscores).",
    )
    untuned_kernels: RepeatedLine | None = Field(
        default=None, description="Lines saying a kernel runs untuned on this device, counted (None: none)."
    )
    serving_compiles: list[TimedLine] = Field(
        default_factory=list,
        description="Kernels compiled while serving, each line with its time (the record places them).",
    )

    def phase_seconds(self) -> dict[str, float]:
        """``{phase: seconds}`` in start-up order."""
        return {p.phase: p.seconds for p in self.cold_start_phases}

    @computed_field  # type: ignore[prop-decorator]
    @property
    def decode_throughput_max_tps(self) -> float | None:
        return max(self.decode_throughput_tps) if self.decode_throughput_tps else None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def decode_throughput_mean_tps(self) -> float | None:
        return fmean(self.decode_throughput_tps) if self.decode_throughput_tps else None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def spec_accept_length_mean(self) -> float | None:
        return fmean(self.spec_accept_lengths) if self.spec_accept_lengths else None


def _last(lines: Sequence[LogLine], pattern: re.Pattern[str] | None) -> str | None:
    if pattern is None:
        return None
    found = None
    for line in lines:
        match = pattern.search(line.message)
        if match:
            found = match.group("v")
    return found


def _distinct(lines: Sequence[LogLine], pattern: re.Pattern[str] | None) -> list[str]:
    found: list[str] = []
    for line in lines:
        for match in pattern.finditer(line.message) if pattern is not None else ():
            if match.group("v") not in found:
                found.append(match.group("v"))
    return found


def _all(lines: Sequence[LogLine], pattern: re.Pattern[str] | None) -> list[float]:
    if pattern is None:
        return []
    return [_number(m.group("v")) for line in lines if (m := pattern.search(line.message))]


def _slowest_rank(lines: Sequence[LogLine], pattern: re.Pattern[str] | None) -> float | None:
    if pattern is None:
        return None
    per_rank: dict[str, float] = {}
    for line in lines:
        match = pattern.search(line.message)
        if match:
            key = line.rank or ""
            per_rank[key] = per_rank.get(key, 0.0) + _number(match.group("v"))
    return round(max(per_rank.values()), 3) if per_rank else None


def _phase(lines: Sequence[LogLine], spec: PhasePattern) -> ColdStartPhase | None:
    per_rank: dict[str, float] = {}
    last_line: str | None = None
    for line in lines:
        match = spec.pattern.search(line.message)
        if match:
            value = _number(match.group("v"))
            key = line.rank or ""
            per_rank[key] = per_rank.get(key, 0.0) + value if spec.combine == "sum" else value
            last_line = line.text
    if not per_rank:
        return None
    seconds = max(per_rank.values())
    return ColdStartPhase(
        phase=spec.name, seconds=round(seconds, 3), within=spec.within, source=spec.source, line=last_line
    )


def _phases(
    lines: Sequence[LogLine], patterns: LogPatterns, startup_s: float | None, ready: LogLine | None
) -> list[ColdStartPhase]:
    """The engine's phases in start-up order, under ``api_ready`` (the whole start-up) when the
    readiness line was seen."""
    found = [p for spec in patterns.phases if (p := _phase(lines, spec)) is not None]
    root = API_READY if startup_s is not None else None
    names = {p.phase for p in found}
    # a phase whose enclosing phase the log does not state hangs under the whole start-up
    found = [p if p.within in names else p.model_copy(update={"within": root}) for p in found]
    if startup_s is None:
        return found
    total = ColdStartPhase(
        phase=API_READY,
        seconds=round(startup_s, 3),
        source=f"first timestamped log line -> the readiness line ({patterns.ready.pattern})",
        line=ready.text if ready else None,
    )
    return [total, *found]


def phase_table(phases: Sequence[ColdStartPhase]) -> str:
    """The phases as a fixed-width text table; a phase that is part of another is indented under it
    (phases nest, so they do not add up)."""
    depth: dict[str, int] = {}
    names: list[str] = []
    for p in phases:
        depth[p.phase] = depth.get(p.within, -1) + 1 if p.within else 0
        names.append("  " * depth[p.phase] + p.phase)
    width = max([len("phase"), *(len(n) for n in names)])
    rows = [f"{'phase':<{width}}  {'seconds':>9}  read from"]
    for name, p in zip(names, phases, strict=True):
        rows.append(f"{name:<{width}}  {p.seconds:>9.2f}  {p.source}")
    rows.append("(an indented phase is part of the one above it: phases nest and do not add up)")
    return "\n".join(rows) + "\n"


def _int(text: str | None) -> int | None:
    return None if text is None else int(_number(text))


def _float(text: str | None) -> float | None:
    return None if text is None else _number(text)


def parse_engine_log(
    lines: Iterable[str],
    engine: str,
    patterns: LogPatterns,
    derive_warnings: Callable[[Sequence[LogLine]], list[str]] | None = None,
) -> EngineLogFacts:
    """Read an engine log with ``patterns``; ``derive_warnings`` adds warnings that no single line
    states (e.g. two lines that together mean a setting did not take effect)."""
    parsed = read_log_lines(lines, patterns.format)
    ready_index = next((i for i, ln in enumerate(parsed) if patterns.ready.search(ln.message)), None)
    ready_line = parsed[ready_index] if ready_index is not None else None

    startup_s = None
    if ready_index is not None:
        stamps = [ln.timestamp for ln in parsed[: ready_index + 1] if ln.timestamp]
        if len(stamps) >= 2:
            fmt = patterns.format
            startup_s = (_when(stamps[-1], fmt) - _when(stamps[0], fmt)).total_seconds()

    warnings: list[str] = []
    for line in parsed:
        if any(p.search(line.message) for p in patterns.warnings) and line.message not in warnings:
            warnings.append(line.message)
    if derive_warnings is not None:
        warnings += [w for w in derive_warnings(parsed) if w not in warnings]

    return EngineLogFacts(
        engine=engine,
        version=_last(parsed, patterns.version),
        ready=ready_line is not None,
        ready_line=ready_line.text if ready_line else None,
        ready_time=ready_line.timestamp if ready_line else None,
        startup_s=startup_s,
        kv_pool_tokens=_int(_last(parsed, patterns.kv_pool_tokens)),
        kv_cache_memory_gib=_float(_last(parsed, patterns.kv_cache_memory_gib)),
        max_concurrency=_float(_last(parsed, patterns.max_concurrency)),
        max_running_requests=_int(_last(parsed, patterns.max_running_requests)),
        context_length=_int(_last(parsed, patterns.context_length)),
        cuda_graph_capture_s=_slowest_rank(parsed, patterns.graph_capture_s),
        weight_load_s=_slowest_rank(parsed, patterns.weight_load_s),
        decode_throughput_tps=_all(parsed, patterns.decode_throughput_tps),
        spec_accept_lengths=_all(parsed, patterns.spec_accept_length),
        warnings=warnings,
        cold_start_phases=_phases(parsed, patterns, startup_s, ready_line),
        compile_cache_hit=any(p.search(ln.message) for ln in parsed for p in patterns.compile_cache_hit),
        compile_cache_dir=_last(parsed, patterns.compile_cache_dir),
        compiled=any(p.search(ln.message) for ln in parsed for p in patterns.compile_ran),
        oom=count_lines(parsed, patterns.oom),
        device_names=_distinct(parsed, patterns.device_name),
        untuned_kernels=count_lines(parsed, patterns.untuned_kernels),
        serving_compiles=[
            TimedLine(time=ln.timestamp, message=ln.message)
            for ln in parsed
            if any(p.search(ln.message) for p in patterns.serving_compiles)
        ],
    )


def log_wall_time(stamp: str, fmt: LogFormat, year: int) -> float:
    """A log timestamp on the wall clock (Unix seconds), read as the local time of the machine that
    reads it (the engine's own, for an engine k3pipe launched on this host); ``year`` completes a
    format without one (vLLM's ``%m-%d %H:%M:%S``)."""
    when = _when(stamp, fmt)
    if "%Y" not in fmt.time_format and "%y" not in fmt.time_format:
        when = when.replace(year=year)
    return when.timestamp()
