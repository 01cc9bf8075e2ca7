"""Restart noise known before a study: what earlier studies measured on this node, kept and looked up.

A cell launched once holds no restart noise (the spread between engine launches), so a verdict on it
would call an A/A different far above alpha on a GPU (docs/measurement.md, "Restart noise"). Two
ways give it one: its arm launched twice or more, or a *prior*: the restart noise earlier studies
measured for its **configuration class** on its node. The class of a cell is the engine kind, the
model (its id), the node (its GPUs as nvidia-smi listed them, else its host name) and the workload's
shape (input and output tokens, load, concurrency or rate, dataset kind): not the engine's arguments,
so the noise of every arm of a class is pooled (the model's assumption: one noise per class).

- **Kept**: when a study's report is published (:func:`k3pipe.report.publish`), every cell whose arm
  has two launches or more whose repeats are whole gives, per figure, the sum of squares of its launch
  means about their mean (log scale) with ``launches - 1`` degrees of freedom, and its repeats' sum of
  squares within launches (for planning): ``noise.json`` on the study's run, tag ``k3pipe.noise``.
- **Looked up** (:func:`find_priors`) for the cells launched once of a study being reported: the
  studies that kept noise for the same class and figure, started before it and within
  ``decision.prior_days`` (30 days; 0 turns priors off), pooled: ``s^2 = sum(SS) / sum(df)`` with
  ``sum(df)`` degrees of freedom (at least :data:`MIN_PRIOR_DF`), stated with its source and age.

The variance of launch means is ``s_b^2 + s_w^2 / R``: restart noise plus the repeat noise of a
launch's mean. Taking it as the restart noise overstates it by the second term (conservative: a
verdict made with it claims a difference less often than its level says, never more), and it is a
plain chi-square estimate (no difference of mean squares, whose degrees of freedom are unknown).
``tests/unit/test_priors.py`` holds the A/A rate of one-launch verdicts made with such priors at alpha.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from k3pipe.core.layout import ENGINE_TAG, NOISE_FILE, NOISE_TAG

if TYPE_CHECKING:
    from k3pipe.records.tracking import Tracker
    from k3pipe.verdicts.stats import RestartPrior

__all__ = [
    "DEFAULT_PRIOR_DAYS",
    "MIN_PRIOR_DF",
    "NoiseEntry",
    "cell_class",
    "entries_of",
    "find_priors",
    "launch_spread",
    "model_identity",
    "node_of",
    "pool",
    "repeat_spread",
    "run_class",
    "workload_shape",
]

DEFAULT_PRIOR_DAYS = 30.0
"""How old an earlier study's noise may be to stand in for a launch not made."""
MIN_PRIOR_DF = 5
"""The fewest degrees of freedom (launches beyond the first, summed over the earlier cells) a prior
needs: below that the Welch-Satterthwaite interval of a one-launch comparison is too narrow in its
tails (simulated A/As, 20,000 each at alpha/12: called different 2.3x the nominal rate at 1 df, 1.2x at
4, at or below it from 5 on; tests/unit/test_stats.py holds 5 and more)."""
_MAX_STUDIES = 200
"""The most recent studies with noise read for one lookup."""


@dataclass(frozen=True)
class CellClass:
    """A cell's configuration class: what its restart noise is taken to depend on."""

    engine: str
    model: str
    node: str
    shape: str

    @property
    def key(self) -> str:
        text = "\n".join((self.engine, self.model, self.node, self.shape))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def label(self) -> str:
        return f"{self.engine}, {self.model}, {self.node}, {self.shape}"


def model_identity(params: Mapping[str, Any]) -> str | None:
    """The model an arm run served, as classes name it: its ModelScope id, or 'local <directory>'."""
    if params.get("model.id"):
        return str(params["model.id"])
    return f"local {params['model.path']}" if params.get("model.path") else None


_SHAPE_PARAMS = (
    "input_tokens",
    "output_tokens",
    "load",
    "concurrency",
    "rate_rps",
    "dataset.kind",
    "capacity",
    "num_requests",
)


def workload_shape(params: Mapping[str, Any]) -> str:
    """A workload run's shape, as classes hold it, from its ``workload.*`` params: its lengths, load,
    concurrency or rate, dataset kind, capacity search and request count (not its name, seed or
    repeats)."""
    return ", ".join(f"{k} {params.get(f'workload.{k}', '-')}" for k in _SHAPE_PARAMS)


def node_of(params: Mapping[str, Any]) -> str | None:
    """An arm run's node as classes hold it: its GPUs' label, else its host (None: neither)."""
    from k3pipe.machine.node import hardware_label

    label = hardware_label(params)
    if label:
        return label
    return f"host {params['node.host']}" if params.get("node.host") else None


def cell_class(engine: str, model: str | None, node: str | None, shape: str) -> CellClass | None:
    """The class of a cell: ``model`` its id, ``node`` its GPUs or host, ``shape`` its workload's
    (:func:`workload_shape`); None when the model, the node or the shape is not known (no prior can be
    said to be of the same class then)."""
    if not model or not node or not shape:
        return None
    return CellClass(engine, model, node, shape)


def run_class(arm_run: Any, workload_run: Any) -> CellClass | None:
    """The class of a workload run under its arm run (MLflow runs)."""
    params = arm_run.data.params
    return cell_class(
        arm_run.data.tags.get(ENGINE_TAG, "?"),
        model_identity(params),
        node_of(params),
        workload_shape(workload_run.data.params),
    )


class NoiseEntry(BaseModel):
    """One cell's restart noise on one figure, as a study keeps it."""

    key: str = Field(description="The configuration class's key (CellClass.key).")
    label: str = Field(description="The class in words.")
    engine: str = ""
    model: str = ""
    node: str = ""
    metric: str
    arm: str
    workload: str
    ss: float = Field(description="Sum of squares of the launch means about their mean (log scale).")
    df: int = Field(description="Launches minus one.")
    repeats: list[int] = Field(description="Repeats per launch.")
    ss_within: float = Field(
        default=0.0, description="Sum of squares of the repeats about their launch's mean."
    )
    df_within: int = Field(default=0, description="Repeats minus launches.")
    study_run_id: str = ""
    start_ms: int = 0


def launch_spread(launches: Sequence[Sequence[float]]) -> tuple[float, int] | None:
    """The sum of squares of the launch means of ``log(value)`` and its degrees of freedom (launches
    minus one); None with fewer than two launches holding a positive value."""
    means = [math.fsum(x) / len(x) for x in _logs(launches)]
    if len(means) < 2:
        return None
    grand = math.fsum(means) / len(means)
    return math.fsum((m - grand) ** 2 for m in means), len(means) - 1


def repeat_spread(launches: Sequence[Sequence[float]]) -> tuple[float, int]:
    """The sum of squares of ``log(value)`` about each launch's mean, and its degrees of freedom."""
    ss, df = 0.0, 0
    for x in _logs(launches):
        m = math.fsum(x) / len(x)
        ss += math.fsum((v - m) ** 2 for v in x)
        df += len(x) - 1
    return ss, df


def _logs(launches: Sequence[Sequence[float]]) -> list[list[float]]:
    out = []
    for values in launches:
        logs = [math.log(v) for v in values if v is not None and math.isfinite(v) and v > 0]
        if logs:
            out.append(logs)
    return out


def pool(entries: Iterable[NoiseEntry], now_ms: int | None = None) -> RestartPrior | None:
    """The entries' restart noise pooled (``sum(ss) / sum(df)``, ``sum(df)`` degrees of freedom),
    with its source in words; None below :data:`MIN_PRIOR_DF` degrees of freedom."""
    from k3pipe.verdicts.stats import RestartPrior  # scipy: not at import (k3pipe render reads this module)

    kept = [e for e in entries if e.df > 0]
    df = sum(e.df for e in kept)
    if df < MIN_PRIOR_DF:
        return None
    studies = sorted({(e.start_ms, e.study_run_id) for e in kept})
    first, last = studies[0][0], studies[-1][0]
    now = now_ms if now_ms is not None else int(time.time() * 1000)
    age = max(0.0, (now - last) / 86_400_000)
    launches = sum(e.df + 1 for e in kept)
    when = _day(first) if _day(first) == _day(last) else f"{_day(first)} .. {_day(last)}"
    source = (
        f"{len(studies)} earlier stud{'y' if len(studies) == 1 else 'ies'}, {launches} launches, {when}, "
        f"the newest {age:.0f} day(s) old: the spread of launch means, conservative"
    )
    return RestartPrior(math.fsum(e.ss for e in kept) / df, float(df), source)


def _day(ms: int) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(ms / 1000)) if ms else "?"


def find_priors(
    tracker: Tracker,
    wanted: Mapping[str, set[str]],
    before_ms: int,
    max_age_days: float = DEFAULT_PRIOR_DAYS,
) -> dict[tuple[str, str], RestartPrior]:
    """Per (class key, metric) of ``wanted`` (class key -> metrics), the pooled restart noise of the
    studies that kept noise for it, started before ``before_ms`` and at most ``max_age_days`` before
    it. Empty when priors are off (``max_age_days`` 0) or none is found; a study whose noise.json
    cannot be read is passed over (a prior is help, never a requirement)."""
    if not wanted or max_age_days <= 0:
        return {}
    since = before_ms - int(max_age_days * 86_400_000)
    where = (
        f"tags.`{NOISE_TAG}` != '' and attributes.start_time < {before_ms} "
        f"and attributes.start_time >= {since}"
    )
    runs = tracker.client.search_runs(
        [tracker.require_experiment_id()],
        filter_string=where,
        order_by=["attributes.start_time DESC"],
        max_results=_MAX_STUDIES,
    )
    found: dict[tuple[str, str], list[NoiseEntry]] = {}
    for run in runs:
        for entry in entries_of(tracker, run):
            if entry.metric in wanted.get(entry.key, set()):
                found.setdefault((entry.key, entry.metric), []).append(entry)
    out = {}
    for key, entries in found.items():
        prior = pool(entries, now_ms=before_ms)
        if prior is not None:
            out[key] = prior
    return out


def entries_of(tracker: Tracker, run: Any) -> list[NoiseEntry]:
    """The noise a study's run kept (empty when it kept none, or it cannot be read)."""
    try:
        raw = tracker.find_artifact(run.info.run_id, NOISE_FILE)
        data = json.loads(raw) if raw else []
        return [
            NoiseEntry.model_validate({**e, "study_run_id": run.info.run_id, "start_ms": run.info.start_time})
            for e in data
        ]
    except Exception:  # a record of another version, or one that cannot be read: no help from it
        return []


def record_noise(tracker: Tracker, run_id: str, entries: Sequence[NoiseEntry]) -> None:
    """Keep a study's restart noise on its run (``noise.json``, tag ``k3pipe.noise``)."""
    if not entries:
        return
    tracker.log_dict(
        run_id, [e.model_dump(exclude={"study_run_id", "start_ms"}) for e in entries], NOISE_FILE
    )
    tracker.set_tags(run_id, {NOISE_TAG: str(len(entries))})
