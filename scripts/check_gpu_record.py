"""Check the record a GPU node brought back: is the whole run in the MLflow store?

    .venv/bin/python scripts/check_gpu_record.py PARTS_DIR [--experiment experiments/gpu-h200.yaml]
        [--key-value KEY] [--engine-version 0.22.0] [--keep DIR] [--json PATH]

PARTS_DIR holds what ``scripts/gpu-node.sh collect`` wrote: ``record.tar.gz.part-NN`` and
``summary.txt``. The parts are joined (and checked against the sha256 in summary.txt), unpacked into
a temporary directory and the MLflow store opened from there read-only (``sqlite:///file:...?mode=ro``,
the node's artifact paths mapped to the unpacked ones). Required, per arm a study of the experiment
file runs (its A/A copy ``<arm>-aa`` too, with ``decision.calibration``) and per launch of it
(``launches``, unset: 2 where arms are compared); a record of ``k3pipe run`` (no study run in it):
per arm of the file, once:

- the arm's engine run of that launch (the latest, when there are several; not a priming launch nor
  one a resume superseded), status FINISHED (a launch cut by a deadline is KILLED: INCOMPLETE);
- params: engine_version (the one the engine reported: --engine-version, else the arm's declared
  engine.version), engine_version_declared,
  the model's digest, files and bytes, the command (with no key in it), api_key_env, each arg.*;
- metrics: cold_start_s, probe_first_delta_s, and WORKLOAD.{ttft_ms_p50, tpot_ms_p50, e2e_ms_p50,
  output_throughput_tps} for every workload;
- artifacts: command.txt, experiment.json, provenance/model.json, endpoint_check.json,
  preflight.json, engine_findings.json and the engine log (logs/*.log);
- one nested run per workload, FINISHED, no failed request, every measured request completed
  (fewer only under duration_s), latency and throughput metrics, engine_* figures from /metrics,
  requests.parquet (a row per request) and engine_metrics.parquet, summary.json.

Then the key: no file of the record (the sqlite db, every artifact, text columns of every parquet
file, the node's logs) may contain it (``--key-value``, default: ``made_up_api_key`` of summary.txt).

Reported as present or missing, never failing: cold-start phase metrics (``cold_start.*``),
compile-cache params, node facts (GPU name, driver, CUDA, torch params; nvidia-smi artifacts; GPU
memory series). Prints a table per arm and exits 1 when a required part is missing.

``--json PATH`` also writes the record's compact summary (per arm: run id, status, cold_start_s, the
cold_start.* phases, compile_cache.*, node.* and arg.* params; per workload: SUMMARY_METRICS) as JSON,
the figures as MLflow holds them (docs/gpu-h200-2026-12-01.json was written so).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import shutil
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import pandas as pd
import yaml

REPO = Path(__file__).resolve().parents[1]
ENGINE_PARAMS = ("engine_version_declared", "model.digest", "model.files", "model.bytes", "command")
ENGINE_METRICS = ("cold_start_s", "probe_first_delta_s")
ENGINE_ARTIFACTS = (
    "command.txt",
    "experiment.json",
    "provenance/model.json",
    "endpoint_check.json",
    "preflight.json",
    "engine_findings.json",
)
ARM_WORKLOAD_METRICS = ("ttft_ms_p50", "tpot_ms_p50", "e2e_ms_p50", "output_throughput_tps")
WORKLOAD_METRICS = (
    "requests",
    "completed",
    "failed",
    "ttft_ms_p50",
    "ttft_ms_p99",
    "tpot_ms_p50",
    "itl_ms_p50",
    "e2e_ms_p50",
    "output_throughput_tps",
    "request_throughput_rps",
    "engine_generation_tps",
    "engine_scrapes",
)
WORKLOAD_ARTIFACTS = ("requests.parquet", "engine_metrics.parquet", "summary.json")
# what the table shows per workload: (header, metric, format)
COLUMNS = (
    ("done", "completed", "{:.0f}"),
    ("fail", "failed", "{:.0f}"),
    ("ttft p50", "ttft_ms_p50", "{:.1f}"),
    ("ttft p99", "ttft_ms_p99", "{:.1f}"),
    ("tpot p50", "tpot_ms_p50", "{:.2f}"),
    ("itl p50", "itl_ms_p50", "{:.2f}"),
    ("e2e p50", "e2e_ms_p50", "{:.0f}"),
    ("out tok/s", "output_throughput_tps", "{:.0f}"),
    ("eng tok/s", "engine_generation_tps", "{:.0f}"),
    ("kv max", "engine_kv_usage_ratio_max", "{:.2f}"),
    ("spec acc", "engine_spec_acceptance_rate", "{:.2f}"),
    ("slo %", "slo_attainment_pct", "{:.0f}"),
)
# what --json keeps per workload run (the figures of docs/gpu.md's tables)
SUMMARY_METRICS = (
    "requests",
    "warmup_requests",
    "completed",
    "failed",
    "duration_s",
    "ttft_ms_p50",
    "ttft_ms_p99",
    "tpot_ms_p50",
    "itl_ms_p50",
    "e2e_ms_p50",
    "output_throughput_tps",
    "request_throughput_rps",
    "output_tokens_total",
    "engine_generation_tps",
    "engine_generation_tokens",
    "engine_kv_usage_ratio_max",
    "gpu_memory_used_mib_max",
    "engine_spec_mean_acceptance_length",
    "engine_spec_acceptance_rate",
    "engine_spec_drafts",
    "engine_spec_draft_tokens",
    "engine_spec_accepted_tokens",
    "slo_attainment_pct",
)
NODE_PARAM = re.compile(r"(^|[._])(gpu|driver|cuda|torch|node|nvidia)([._]|$)", re.IGNORECASE)
COMPILE_PARAM = re.compile(r"compile", re.IGNORECASE)


@dataclass
class Check:
    what: str
    ok: bool
    detail: str = ""
    required: bool = True


@dataclass
class ArmReport:
    arm: str
    run: Any = None
    checks: list[Check] = field(default_factory=list)
    workloads: dict[str, dict[str, float]] = field(default_factory=dict)
    optional: list[Check] = field(default_factory=list)
    gpu_memory: list[str] = field(default_factory=list)  # GPU memory series found in workload runs

    def need(self, what: str, ok: bool, detail: str = "") -> bool:
        self.checks.append(Check(what, ok, detail))
        return ok

    def maybe(self, what: str, found: list[str]) -> None:
        shown = ", ".join(found[:8]) + (f" (+{len(found) - 8})" if len(found) > 8 else "")
        self.optional.append(Check(what, bool(found), shown, required=False))


# ------------------------------------------------------------------------------------ the record


def read_summary(parts_dir: Path) -> dict[str, str]:
    path = parts_dir / "summary.txt"
    out: dict[str, str] = {}
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            key, sep, value = line.partition(": ")
            if sep and re.fullmatch(r"[a-z0-9_]+", key):
                out.setdefault(key, value.strip())
    return out


def unpack(parts_dir: Path, summary: dict[str, str], dest: Path) -> Path:
    """Join the parts (checked against summary.txt's sha256) and unpack; returns the record's root."""
    parts = sorted(parts_dir.glob("record.tar.gz.part-*"))
    whole = parts_dir / "record.tar.gz"
    if not parts and whole.exists():
        parts = [whole]
    if not parts:
        raise SystemExit(f"no record.tar.gz.part-* (or record.tar.gz) in {parts_dir}")
    joined = dest / "record.tar.gz"
    digest = hashlib.sha256()
    with joined.open("wb") as out:
        for part in parts:
            data = part.read_bytes()
            digest.update(data)
            out.write(data)
    expected = summary.get("record_tar_gz_sha256")
    if expected and digest.hexdigest() != expected:
        raise SystemExit(
            f"the {len(parts)} part(s) join to sha256 {digest.hexdigest()}, summary.txt says {expected}: "
            "a part is missing or damaged"
        )
    with tarfile.open(joined, "r:gz") as tar:
        tar.extractall(dest / "unpacked", filter="data")
    joined.unlink()
    root = dest / "unpacked" / "record"
    if not (root / "mlflow" / "mlflow.db").exists():
        raise SystemExit(f"the record holds no mlflow/mlflow.db (unpacked into {dest / 'unpacked'})")
    return root


class Store:
    """The unpacked MLflow store, opened read-only; artifact URIs of the node mapped to local paths."""

    def __init__(self, root: Path, experiment_name: str) -> None:
        from mlflow import MlflowClient

        self.root = root
        self.artifacts = root / "mlflow" / "artifacts"
        db = root / "mlflow" / "mlflow.db"
        # MLflow makes the parent directory of a sqlite path, relative to the working directory: for
        # a 'file:' URI that is a stray 'file:/...' tree, made here inside the unpacked store instead
        here = os.getcwd()
        os.chdir(root)
        try:
            self.client = MlflowClient(tracking_uri=f"sqlite:///file:{db}?mode=ro&uri=true")
            self.experiment = self.client.get_experiment_by_name(experiment_name)
        finally:
            os.chdir(here)
        if self.experiment is None:
            names = [e.name for e in self.client.search_experiments()]
            raise SystemExit(f"no MLflow experiment {experiment_name!r} in the store; it has {names}")
        self._location = unquote(urlparse(self.experiment.artifact_location).path).rstrip("/")

    def runs(self, filter_string: str) -> list[Any]:
        return list(
            self.client.search_runs(
                [self.experiment.experiment_id],
                filter_string=filter_string,
                order_by=["attributes.start_time DESC"],
                max_results=5000,
            )
        )

    def artifact_dir(self, run: Any) -> Path:
        path = unquote(urlparse(run.info.artifact_uri).path)
        if path.startswith(self._location + "/"):
            return self.artifacts / path[len(self._location) + 1 :]
        found = [p for p in self.artifacts.rglob(run.info.run_id) if p.is_dir()]
        return (found[0] / "artifacts") if found else self.artifacts / run.info.run_id / "artifacts"

    def artifact_files(self, run: Any) -> list[str]:
        base = self.artifact_dir(run)
        if not base.is_dir():
            return []
        return sorted(str(p.relative_to(base)) for p in base.rglob("*") if p.is_file())


# ----------------------------------------------------------------------------------------- checks


def study_arms(spec: dict[str, Any]) -> list[tuple[dict[str, Any], int]]:
    """Every arm a study of ``spec`` runs (with ``decision.calibration``, the baseline's A/A copy
    ``<arm>-aa`` too; a search's candidates) and the launches it plans (unset: k3pipe's default, 2
    where arms are compared; a search: its first round's)."""
    from k3pipe.schema.specs import CALIBRATION_SUFFIX, DEFAULT_LAUNCHES

    if spec.get("tune"):
        # a search's study runs its candidates (ARM.tNN), each launched first_launches times at least
        from k3pipe.experiment.load import parse_experiment

        parsed = parse_experiment(spec)
        assert parsed.tune is not None
        first = parsed.tune.budget.first_launches
        return [(c.arm.model_dump(mode="json", exclude_unset=True), first) for c in parsed.tune_candidates()]
    arms = list(spec["arms"])
    decision = spec.get("decision") or {}
    compares = len(arms) >= 2 or bool(spec.get("variants")) or decision.get("calibration") is True
    out = [(a, int(a.get("launches") or (DEFAULT_LAUNCHES if compares else 1))) for a in arms]
    if decision.get("calibration") is True:
        base = decision.get("baseline") or arms[0]["name"]
        at = next(i for i, (a, _) in enumerate(out) if a["name"] == base)
        arm, launches = out[at]
        out.insert(at + 1, ({**arm, "name": base + CALIBRATION_SUFFIX}, launches))
    return out


def check_record(store: Store, spec: dict[str, Any], engine_version: str | None) -> list[ArmReport]:
    """A study's record: every arm it runs (the A/A copy too), every launch of each; a record of
    `k3pipe run` (no study run in the store): each arm of the experiment, once."""
    study = store.runs(f"tags.`k3pipe.kind` = 'study' and tags.`k3pipe.experiment` = '{spec['name']}'")
    arms = study_arms(spec) if study else [(a, 1) for a in spec["arms"]]
    return [
        check_arm(store, spec, arm, engine_version, None if launches == 1 else k)
        for arm, launches in arms
        for k in range(1, launches + 1)
    ]


def check_arm(
    store: Store,
    spec: dict[str, Any],
    arm_spec: dict[str, Any],
    engine_version: str | None,
    launch: int | None = None,
) -> ArmReport:
    """One arm's engine run (``launch``: that launch of it, by its ``k3pipe.launch`` tag; a priming
    launch and a superseded run are not it)."""
    arm = arm_spec["name"]
    report = ArmReport(arm if launch is None else f"{arm}#{launch}")
    runs = [
        r
        for r in store.runs(f"tags.`k3pipe.arm` = '{arm}' and tags.`k3pipe.experiment` = '{spec['name']}'")
        if "k3pipe.workload" not in r.data.tags  # the engine run (a study's nests under the study run)
        and not r.data.tags.get("k3pipe.prime")
        and not r.data.tags.get("k3pipe.superseded")
        and (launch is None or r.data.tags.get("k3pipe.launch", "1") == str(launch))
    ]
    what = "no run of this arm" if launch is None else f"no run of launch {launch} of this arm"
    if not report.need("engine run", bool(runs), f"{len(runs)} run(s)" if runs else what):
        return report
    run = report.run = runs[0]
    if len(runs) > 1:
        report.checks.append(Check("engine run", True, f"{len(runs)} runs: the latest is checked", False))
    params, metrics, tags = run.data.params, run.data.metrics, run.data.tags
    status_detail = run.info.status
    if "k3pipe.error" in tags:
        status_detail += f" ({tags['k3pipe.error'][:300]})"
    report.need("status FINISHED", run.info.status == "FINISHED", status_detail)

    found = params.get("engine_version")
    # the version the engine must report: --engine-version, else the arm's declared engine.version
    expected = engine_version or str((arm_spec.get("engine") or {}).get("version") or "")
    report.need(f"engine_version {expected}", found == expected, f"found {found!r}")
    for name in ENGINE_PARAMS:
        report.need(f"param {name}", bool(params.get(name)), (params.get(name) or "")[:80])
    key_env = (arm_spec.get("endpoint") or {}).get("api_key_env")
    if key_env:
        report.need(
            "param api_key_env", params.get("api_key_env") == key_env, f"{params.get('api_key_env')!r}"
        )
    command = params.get("command", "")
    # the key's value never; the redacted value or the reference k3pipe reads at launch is fine
    m = re.search(r"--api-key[ =](\S+)", command)
    given = m.group(1).strip("'\"") if m else None
    safe = given is None or given == "***" or given.startswith("{env.")
    report.need("command has no key", safe, command[:0])
    for arg in (arm_spec.get("engine") or {}).get("args") or {}:
        report.need(f"param arg.{arg}", f"arg.{arg}" in params, params.get(f"arg.{arg}", "")[:60])
    for name in ENGINE_METRICS:
        report.need(f"metric {name}", name in metrics, _fmt(metrics.get(name)))
    files = store.artifact_files(run)
    for name in ENGINE_ARTIFACTS:
        report.need(f"artifact {name}", name in files)
    logs = [f for f in files if f.startswith("logs/") and f.endswith(".log")]
    report.need("artifact logs/<engine log>", bool(logs), ", ".join(logs))

    children = {
        c.data.tags.get("k3pipe.workload"): c
        for c in reversed(store.runs(f"tags.mlflow.parentRunId = '{run.info.run_id}'"))
    }
    for workload in spec["workloads"]:
        if workload.get("ladder"):
            check_ladder(store, report, run, workload, children)
        elif workload.get("capacity"):
            check_capacity(store, report, run, workload, children.get(workload["name"]))
        else:
            check_workload(store, report, run, workload, children.get(workload["name"]))

    # what other parts of k3pipe add (reported, never failing)
    report.maybe(
        "cold-start phases (cold_start.*)", sorted(k for k in metrics if k.startswith("cold_start."))
    )
    compile_found = sorted(k for k in params if COMPILE_PARAM.search(k))
    compile_found += sorted(f"metric {k}" for k in metrics if COMPILE_PARAM.search(k))
    report.maybe("compile-cache params", compile_found)
    report.maybe(
        "node facts (GPU/driver/CUDA/torch params)", sorted(k for k in params if NODE_PARAM.search(k))
    )
    report.maybe("nvidia-smi artifacts", [f for f in files if "nvidia" in f.lower() or f.startswith("node/")])
    report.maybe("GPU memory series", _gpu_memory(store, run, "engine run") + report.gpu_memory)
    return report


def _gpu_memory(store: Store, run: Any, where: str) -> list[str]:
    """GPU memory metrics (with their number of points) and GPU series artifacts of a run."""
    found = [
        f"{where}: {k} ({len(store.client.get_metric_history(run.info.run_id, k))} point(s))"
        for k in run.data.metrics
        if re.search(r"gpu", k, re.I) and re.search(r"mem", k, re.I)
    ]
    found += [
        f"{where}: {f}"
        for f in store.artifact_files(run)
        if re.search(r"gpu", f, re.I) and f.endswith((".parquet", ".csv", ".json"))
    ]
    return found


def check_workload(
    store: Store,
    report: ArmReport,
    engine_run: Any,
    workload: dict[str, Any],
    run: Any | None,
    prefix: str | None = None,
) -> None:
    """``prefix``: how the engine run's metrics name the workload (a ladder point NAME@c8: NAME_c8)."""
    name = workload["name"]
    prefix = prefix or name
    if not report.need(f"{name}: nested run", run is not None, "" if run else "no workload run"):
        return
    m = run.data.metrics
    report.workloads[name] = dict(m)
    report.need(f"{name}: status FINISHED", run.info.status == "FINISHED", run.info.status)
    for metric in WORKLOAD_METRICS:
        report.need(f"{name}: metric {metric}", metric in m, _fmt(m.get(metric)))
    # the workload as it ran (a command-line override such as --requests is in its params)
    planned = int(run.data.params.get("workload.num_requests") or workload.get("num_requests", 16))
    completed, failed = m.get("completed", 0.0), m.get("failed", 0.0)
    report.need(f"{name}: no failed request", failed == 0, f"{failed:.0f} failed")
    if workload.get("duration_s"):
        report.need(
            f"{name}: requests completed", 0 < completed <= planned, f"{completed:.0f} of <= {planned}"
        )
    else:
        report.need(f"{name}: requests completed", completed == planned, f"{completed:.0f} of {planned}")
    report.need(
        f"{name}: engine /metrics scraped", m.get("engine_scrapes", 0) > 0, _fmt(m.get("engine_scrapes"))
    )
    # with repeats, each repeat is a run nested under the workload's and holds its own artifacts
    repeats = sorted(
        store.runs(f"tags.mlflow.parentRunId = '{run.info.run_id}'"),
        key=lambda r: int(r.data.tags.get("k3pipe.repeat", 0)),
    )
    planned_repeats = int(run.data.params.get("workload.repeats") or workload.get("repeats", 1))
    if planned_repeats > 1:
        report.need(
            f"{name}: repeat runs", len(repeats) == planned_repeats, f"{len(repeats)} of {planned_repeats}"
        )
    for holder in repeats or [run]:
        where = f"{name}#{holder.data.tags['k3pipe.repeat']}" if holder is not run else name
        files = store.artifact_files(holder)
        for artifact in WORKLOAD_ARTIFACTS:
            report.need(f"{where}: artifact {artifact}", artifact in files)
        if "requests.parquet" in files:
            hm = holder.data.metrics
            rows = len(pd.read_parquet(store.artifact_dir(holder) / "requests.parquet"))
            expected = int(hm.get("requests", 0) + hm.get("warmup_requests", 0))
            report.need(
                f"{where}: requests.parquet rows", rows >= expected > 0, f"{rows} rows, {expected} requests"
            )
        report.need(f"{where}: dataset input", bool(holder.inputs.dataset_inputs), "")
        report.gpu_memory += _gpu_memory(store, holder, where)
    em = engine_run.data.metrics
    for metric in ARM_WORKLOAD_METRICS:
        report.need(f"{name}: engine run has {prefix}.{metric}", f"{prefix}.{metric}" in em)


def check_ladder(
    store: Store, report: ArmReport, engine_run: Any, workload: dict[str, Any], children: dict[str, Any]
) -> None:
    """A ladder: its points that ran (NAME@c8, NAME@2.5rps: each a workload run of its own, checked
    as one), lowest first from the first point, and the arm run's summary of how it ran."""
    name = workload["name"]
    rungs = sorted(
        (run for key, run in children.items() if key and key.startswith(f"{name}@")),
        key=lambda r: float(r.data.tags.get("k3pipe.ladder_point", "0")),
    )
    summary = engine_run.data.tags.get(f"k3pipe.ladder.{name}", "")
    report.need(f"{name}: ladder points", bool(rungs), f"{len(rungs)} point(s) ran")
    report.need(f"{name}: engine run tag k3pipe.ladder.{name}", bool(summary), summary[:120])
    for rung in rungs:
        point = rung.data.tags["k3pipe.workload"]
        report.need(f"{point}: tagged k3pipe.ladder = {name}", rung.data.tags.get("k3pipe.ladder") == name)
        check_workload(store, report, engine_run, {**workload, "name": point}, rung, point.replace("@", "_"))


def check_capacity(
    store: Store, report: ArmReport, engine_run: Any, workload: dict[str, Any], run: Any | None
) -> None:
    """A capacity search: its run (one per repeat beneath the workload's with repeats) holds the
    answer (capacity_rps or capacity_concurrency, or the censored bound) and capacity.json; every
    probe is a run of its own holding the workload's whole record at its load."""
    name = workload["name"]
    if not report.need(f"{name}: search run", run is not None, "" if run else "no capacity search run"):
        return
    report.need(f"{name}: status FINISHED", run.info.status == "FINISHED", run.info.status)
    key = "capacity_rps" if workload["capacity"].get("over", "rate") == "rate" else "capacity_concurrency"
    repeats = [
        r
        for r in store.runs(f"tags.mlflow.parentRunId = '{run.info.run_id}'")
        if "k3pipe.repeat" in r.data.tags
    ]
    for search in sorted(repeats, key=lambda r: int(r.data.tags["k3pipe.repeat"])) or [run]:
        where = f"{name}#{search.data.tags['k3pipe.repeat']}" if search is not run else name
        m = search.data.metrics
        found = m.get(key, m.get(f"{key}_at_least"))
        report.need(f"{where}: metric {key}", found is not None, _fmt(found))
        report.need(f"{where}: tag k3pipe.capacity", bool(search.data.tags.get("k3pipe.capacity")),
                    search.data.tags.get("k3pipe.capacity", ""))  # fmt: skip
        report.need(f"{where}: artifact capacity.json", "capacity.json" in store.artifact_files(search))
        probes = store.runs(f"tags.mlflow.parentRunId = '{search.info.run_id}'")
        report.need(
            f"{where}: probe runs", len(probes) == int(m.get(f"{key}_probes", -1)),
            f"{len(probes)} of {m.get(f'{key}_probes', 0):.0f}",
        )  # fmt: skip
        for probe in sorted(probes, key=lambda r: r.info.start_time):
            label = f"{where}@{probe.data.tags.get('k3pipe.probe', '?')}"
            report.workloads[label] = dict(probe.data.metrics)
            pm = probe.data.metrics
            report.need(f"{label}: attainment", "probe.slo_attainment_from_arrival_pct" in pm)
            for metric in WORKLOAD_METRICS:
                report.need(f"{label}: metric {metric}", metric in pm, _fmt(pm.get(metric)))
            report.need(f"{label}: no failed request", pm.get("failed", 1) == 0, _fmt(pm.get("failed")))
            files = store.artifact_files(probe)
            for artifact in WORKLOAD_ARTIFACTS:
                report.need(f"{label}: artifact {artifact}", artifact in files)
    # a search that only bounded the capacity (every probe passed) records the bound, named so
    em = engine_run.data.metrics
    report.need(
        f"{name}: engine run has {name}.{key}", f"{name}.{key}" in em or f"{name}.{key}_at_least" in em
    )


def scan_for_key(root: Path, key: str) -> list[str]:
    """Every file of the record that holds ``key``: raw bytes, and the text columns of parquet files."""
    needle = key.encode()
    hits = []
    for path in sorted(root.rglob("*")):
        if not path.is_file():
            continue
        rel = str(path.relative_to(root))
        if needle in path.read_bytes():
            hits.append(rel)
        elif path.suffix == ".parquet" and any(key in text for text in _parquet_text(path)):
            hits.append(f"{rel} (decoded)")
    return hits


def _parquet_text(path: Path) -> Iterator[str]:
    try:
        frame = pd.read_parquet(path)
    except Exception:
        return
    yield from (str(c) for c in frame.columns)
    for column in frame.columns:
        if frame[column].dtype == object or pd.api.types.is_string_dtype(frame[column]):
            yield from (str(v) for v in frame[column].dropna())


# ----------------------------------------------------------------------------------------- report


def _fmt(value: float | None, spec: str = "{:.3g}") -> str:
    if value is None or value != value:
        return "-"
    return spec.format(value)


def arm_table(report: ArmReport) -> str:
    rows = [["workload", *(c[0] for c in COLUMNS)]]
    for name, metrics in report.workloads.items():
        rows.append([name, *(_fmt(metrics.get(metric), spec) for _, metric, spec in COLUMNS)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [
            row[0].ljust(widths[0]),
            *(cell.rjust(w) for cell, w in zip(row[1:], widths[1:], strict=True)),
        ]
        lines.append("  " + "  ".join(cells))
    return "\n".join(lines)


def print_report(
    reports: list[ArmReport], key_hits: list[str], summary: dict[str, str], out: io.TextIOBase
) -> int:
    missing = 0
    for rep in reports:
        run = rep.run
        head = f"arm {rep.arm}"
        if run is not None:
            m, p = run.data.metrics, run.data.params
            phases = {k.removeprefix("cold_start."): v for k, v in m.items() if k.startswith("cold_start.")}
            shown = ", ".join(f"{k} {v:.1f} s" for k, v in sorted(phases.items()))
            head += (
                f": {run.info.status}, run {run.info.run_id[:12]}, {p.get('engine', 'engine')} "
                f"{p.get('engine_version', '?')}, "
                f"cold start {_fmt(m.get('cold_start_s'), '{:.1f}')} s"
                + (f" ({shown})" if shown else "")
                + (f", compile cache hit {m['compile_cache.hit']:.0f}" if "compile_cache.hit" in m else "")
                + f", probe first delta {_fmt(m.get('probe_first_delta_s'), '{:.3f}')} s"
            )
        print(head, file=out)
        if rep.workloads:
            print(arm_table(rep), file=out)
        bad = [c for c in rep.checks if c.required and not c.ok]
        missing += len(bad)
        done = sum(c.ok for c in rep.checks if c.required)
        print(f"  required: {done} present, {len(bad)} missing", file=out)
        for c in bad:
            print(f"    MISSING  {c.what}" + (f": {c.detail}" if c.detail else ""), file=out)
        for c in rep.optional:
            print(
                f"  {'present' if c.ok else 'missing'}  {c.what}" + (f": {c.detail}" if c.detail else ""),
                file=out,
            )
        print(file=out)
    starts = {r.arm: r.run.data.metrics.get("cold_start_s") for r in reports if r.run is not None}
    if starts:
        print("cold starts: " + ", ".join(f"{a} {_fmt(s, '{:.1f}')} s" for a, s in starts.items()), file=out)
    leaks = int(summary.get("key_occurrences_in_node_logs", "0") or 0)
    if key_hits or leaks:
        missing += 1
        print(f"KEY FOUND in {len(key_hits)} file(s) of the record: {', '.join(key_hits)}", file=out)
        if leaks:
            print(
                f"KEY FOUND {leaks} time(s) in the node's logs (summary.txt; blanked in the copies)", file=out
            )
    else:
        print("key: not found anywhere in the record", file=out)
    verdict = "COMPLETE" if missing == 0 else f"INCOMPLETE ({missing} required part(s) missing)"
    print(f"record: {verdict}", file=out)
    return 0 if missing == 0 else 1


def record_summary(
    reports: list[ArmReport], key_hits: list[str], summary: dict[str, str], experiment: str
) -> dict[str, Any]:
    """The compact summary --json writes: per arm its engine run, per workload SUMMARY_METRICS."""
    arms: dict[str, Any] = {}
    for rep in reports:
        run = rep.run
        if run is None:
            arms[rep.arm] = {"run_id": None}
            continue
        m, p = run.data.metrics, run.data.params
        arms[rep.arm] = {
            "run_id": run.info.run_id,
            "run_name": run.data.tags.get("mlflow.runName"),
            "status": run.info.status,
            "engine_version": p.get("engine_version"),
            "cold_start_s": m.get("cold_start_s"),
            "probe_first_delta_s": m.get("probe_first_delta_s"),
            "cold_start": {
                k.removeprefix("cold_start.").removesuffix("_s"): v
                for k, v in sorted(m.items())
                if k.startswith("cold_start.")
            },
            "compile_cache": {
                **{
                    k.removeprefix("compile_cache."): v
                    for k, v in sorted(p.items())
                    if k.startswith("compile_cache.")
                },
                **{
                    k.removeprefix("compile_cache."): v
                    for k, v in sorted(m.items())
                    if k.startswith("compile_cache.")
                },
            },
            "node": {k.removeprefix("node."): v for k, v in sorted(p.items()) if k.startswith("node.")},
            "args": {k.removeprefix("arg."): v for k, v in sorted(p.items()) if k.startswith("arg.")},
            "workloads": {
                name: {k: metrics[k] for k in SUMMARY_METRICS if k in metrics}
                for name, metrics in rep.workloads.items()
            },
        }
    return {
        "experiment": experiment,
        "record": {
            k: summary.get(k) for k in ("boot_id", "run_rc", "run_seconds", "gpu", "record_tar_gz_sha256")
        },
        "key_found_in": key_hits,
        "required_missing": sum(1 for r in reports for c in r.checks if c.required and not c.ok),
        "arms": arms,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("parts_dir", type=Path, help="the folder the device call's files came back to")
    p.add_argument("--experiment", type=Path, default=REPO / "experiments" / "gpu-h200.yaml")
    p.add_argument("--key-value", default=None, help="the made-up key (default: from summary.txt)")
    p.add_argument(
        "--engine-version",
        default=None,
        help="the version every engine must report (default: each arm's declared engine.version)",
    )
    p.add_argument("--mlflow-experiment", default="k3pipe")
    p.add_argument("--keep", type=Path, default=None, help="unpack here (kept) instead of a temp dir")
    p.add_argument("--json", type=Path, default=None, help="also write the record's compact summary here")
    args = p.parse_args(argv)

    spec = yaml.safe_load(args.experiment.read_text())
    summary = read_summary(args.parts_dir)
    key = args.key_value or summary.get("made_up_api_key")
    if not key or key == "none":
        raise SystemExit("no key to look for: pass --key-value (summary.txt has no made_up_api_key)")
    tmp = Path(tempfile.mkdtemp(prefix="k3pipe-record-")) if args.keep is None else args.keep
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        root = unpack(args.parts_dir, summary, tmp)
        print(
            f"record unpacked into {root} (boot {summary.get('boot_id', '?')}, run exit "
            f"{summary.get('run_rc', '?')}, {summary.get('run_seconds', '?')} s)\n"
        )
        store = Store(root, args.mlflow_experiment)
        reports = check_record(store, spec, args.engine_version)
        hits = scan_for_key(root, key)
        if args.json is not None:
            data = record_summary(reports, hits, summary, spec["name"])
            args.json.write_text(json.dumps(data, indent=2) + "\n")
            print(f"summary written to {args.json}\n")
        return print_report(reports, hits, summary, sys.stdout)  # type: ignore[arg-type]
    finally:
        if args.keep is None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
