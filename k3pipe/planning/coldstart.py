"""An engine's cold start once it is ready: its phases from the log, and whether the compile cache
made it a warm start.

After a cold launch that filled the compile cache (the log shows a compile and no cache hit), a small
JSON is kept in the cache directory (``k3pipe-cold-start-<key>.json``: cold_start_s, the MLflow run
id, the date). A later launch that loads from the cache reads it back, so its run holds both cold
starts: its own ``cold_start_s`` and the first one's ``compile_cache.first_cold_start_s``.
"""

from __future__ import annotations

import contextlib
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from k3pipe.engines import get_engine
from k3pipe.engines.observe import ColdStartPhase, EngineLogFacts
from k3pipe.planning.plan import ArmPlan, CompileCache

__all__ = [
    "ColdStart",
    "CompileCacheOutcome",
    "ensure_compile_cache",
    "marker_path",
    "read_cold_start",
    "stamp_path",
]


class CompileCacheOutcome(BaseModel):
    """What the compile cache did for one launch."""

    model_config = ConfigDict(frozen=True)

    key: str
    dir: str = Field(description="The directory as the engine sees it.")
    host_dir: str | None = Field(description="The same on this machine (None: not reachable here).")
    source: str = Field(description="k3pipe (K3PIPE_HOME/cache/...) or spec (the spec's env set it).")
    hit: bool = Field(description="The engine loaded compiled artifacts from the cache.")
    compiled: bool = Field(description="The log shows a compile at all (False: e.g. --enforce-eager).")
    engine_dir: str | None = Field(default=None, description="The compile cache directory the log names.")
    first_cold_start_s: float | None = Field(
        default=None, description="On a hit: the cold start of the launch that filled the cache."
    )
    first_run_id: str | None = Field(default=None, description="On a hit: that launch's MLflow run.")
    first_date: str | None = Field(default=None, description="On a hit: when that launch was ready.")
    marker_written: bool = Field(default=False, description="This launch filled the cache and said so.")
    evidence: Literal["log", "files"] = Field(
        default="log",
        description="What told hit and compile apart: the engine's log (vLLM) or the files in the cache, "
        "older or newer than the launch (SGLang, whose log is silent on it).",
    )
    files_before: int | None = Field(
        default=None, description="Files the cache held before this launch (None: not counted here)."
    )
    files_written: int | None = Field(
        default=None, description="Files the engine wrote to it during this start-up (None: not counted)."
    )
    bytes_total: int | None = Field(default=None, description="The cache's size once the engine was ready.")


class ColdStart(BaseModel):
    """An engine's start-up as its log tells it, once the engine is ready."""

    model_config = ConfigDict(frozen=True)

    cold_start_s: float | None = Field(description="k3pipe's wall clock: launch to healthy.")
    phases: list[ColdStartPhase] = Field(default_factory=list)
    compile_cache: CompileCacheOutcome | None = None
    warm_over_cold: float | None = Field(
        default=None, description="cold_start_s over compile_cache.first_cold_start_s (on a hit)."
    )

    def log_lines(self) -> list[str]:
        """A line per phase and one for the compile cache, for the flow's log."""
        out = [
            f"cold start {p.phase}: {p.seconds:.2f} s" + (f" (part of {p.within})" if p.within else "")
            for p in self.phases
        ]
        c = self.compile_cache
        if c is None:
            return out
        counted = (
            f" ({c.files_before} files from earlier launches, {c.files_written} written by this one)"
            if c.evidence == "files"
            else ""
        )
        if c.hit:
            first = f"{c.first_cold_start_s:.1f} s" if c.first_cold_start_s is not None else "not recorded"
            ratio = f", {self.warm_over_cold:.2f}x of it" if self.warm_over_cold is not None else ""
            now = f"{self.cold_start_s:.1f} s" if self.cold_start_s is not None else "unknown"
            out.append(
                f"compile cache hit in {c.dir}{counted}: cold start {now}, "
                f"the first cold start {first}{ratio}"
            )
        elif c.compiled:
            out.append(
                f"compile cache miss in {c.dir}{counted}"
                + ("; filled by this launch" if c.marker_written else "")
            )
        else:
            out.append(f"compile cache in {c.dir} unused: the engine compiled nothing{counted}")
        return out


def marker_path(cache: CompileCache) -> Path | None:
    """The first-cold-start JSON of ``cache`` (None: the directory is not reachable from here)."""
    return Path(cache.host_dir) / f"k3pipe-cold-start-{cache.key}.json" if cache.host_dir else None


def stamp_path(cache: CompileCache) -> Path | None:
    """The file whose time marks this launch's start in the cache (None: not reachable from here)."""
    return Path(cache.host_dir) / "k3pipe-launch.stamp" if cache.host_dir else None


def ensure_compile_cache(plan: ArmPlan) -> None:
    """Create the arm's compile-cache directory on this machine (docker cannot bind a missing one)
    and stamp the launch's start in it: what the engine writes from now on is newer."""
    cache = plan.compile_cache
    if cache is None or not cache.host_dir:
        return
    Path(cache.host_dir).mkdir(parents=True, exist_ok=True)
    for sub in get_engine(plan.engine).compile_cache_subdirs.values():
        # the engine's libraries create theirs, but a container's root-owned one is harder to clean
        (Path(cache.host_dir) / sub).mkdir(exist_ok=True)
    stamp = stamp_path(cache)
    assert stamp is not None
    stamp.write_text(datetime.now(UTC).isoformat(timespec="seconds") + "\n")


def _inventory(cache: CompileCache) -> tuple[int, int, int] | None:
    """(files older than the launch stamp, files newer, bytes of all) in the cache, k3pipe's own
    files left out; None where the directory or its stamp cannot be read from here."""
    stamp = stamp_path(cache)
    if stamp is None or not stamp.is_file():
        return None
    since = stamp.stat().st_mtime_ns
    before = written = size = 0
    for path in Path(cache.host_dir or "").rglob("*"):
        if path.name.startswith("k3pipe-"):
            continue
        with contextlib.suppress(OSError):
            st = path.lstat()
            if not path.is_file() or path.is_symlink():
                continue
            size += st.st_size
            if st.st_mtime_ns >= since:
                written += 1
            else:
                before += 1
    return before, written, size


def _read_marker(path: Path | None) -> dict[str, object]:
    if path is None or not path.is_file():
        return {}
    with contextlib.suppress(OSError, ValueError):
        data = json.loads(path.read_text())
        if isinstance(data, dict):
            return data
    return {}


def _settle(
    cache: CompileCache,
    facts: EngineLogFacts,
    files: tuple[int, int, int] | None,
    cold_start_s: float | None,
    run_id: str | None,
    now: datetime,
) -> CompileCacheOutcome:
    path = marker_path(cache)
    base: dict[str, object] = {
        "key": cache.key,
        "dir": cache.dir,
        "host_dir": cache.host_dir,
        "source": cache.source,
        "hit": facts.compile_cache_hit,
        "compiled": facts.compiled,
        "engine_dir": facts.compile_cache_dir,
    }
    if files is not None:
        before, written, size = files
        base |= {"files_before": before, "files_written": written, "bytes_total": size}
    if base["hit"]:
        first = _read_marker(path)
        seconds = first.get("cold_start_s")
        return CompileCacheOutcome(
            **base,
            first_cold_start_s=float(seconds) if isinstance(seconds, int | float) else None,
            first_run_id=str(first["run_id"]) if first.get("run_id") else None,
            first_date=str(first["date"]) if first.get("date") else None,
        )
    written = False
    if facts.compiled and cold_start_s is not None and path is not None:
        # this launch compiled from scratch and came up: it is the one that filled the cache
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            record = {
                "key": cache.key,
                "cold_start_s": round(cold_start_s, 3),
                "run_id": run_id,
                "date": now.isoformat(timespec="seconds"),
            }
            path.write_text(json.dumps(record, indent=2) + "\n")
            written = True
    return CompileCacheOutcome(**base, marker_written=written)


def read_cold_start(
    plan: ArmPlan,
    log_path: Path | None,
    cold_start_s: float | None,
    run_id: str | None = None,
    now: datetime | None = None,
) -> ColdStart:
    """Read the ready engine's log: its cold-start phases, and what the compile cache did (on a
    cold launch that compiled, the first-cold-start JSON is written; on a hit it is read back)."""
    if log_path is None or not log_path.is_file():
        return ColdStart(cold_start_s=cold_start_s)
    with log_path.open(errors="replace") as fh:
        facts = get_engine(plan.engine).parse_log(fh)
    outcome = None
    ratio = None
    cache = plan.compile_cache
    files = _inventory(cache) if cache is not None else None
    if cache is not None and not get_engine(plan.engine).compile_cache_logged:
        if files is None:  # nothing to tell a hit by: the cache's directory is not reachable from here
            return ColdStart(cold_start_s=cold_start_s, phases=facts.cold_start_phases)
        # the log is silent: a hit is kernels left by an earlier launch, a compile is files written now
        facts = facts.model_copy(update={"compile_cache_hit": files[0] > 0, "compiled": files[1] > 0})
        evidence = "files"
    else:
        evidence = "log"
    if cache is not None:
        outcome = _settle(cache, facts, files, cold_start_s, run_id, now or datetime.now(UTC))
        outcome = outcome.model_copy(update={"evidence": evidence})
        first = outcome.first_cold_start_s
        if first and cold_start_s is not None:
            ratio = round(cold_start_s / first, 4)
    return ColdStart(
        cold_start_s=cold_start_s, phases=facts.cold_start_phases, compile_cache=outcome, warm_over_cold=ratio
    )
