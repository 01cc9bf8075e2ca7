"""Preflight: what an experiment will run into, found before a cold start of ten minutes is spent.

:func:`preflight` runs the generic rules of this module and each engine module's own rules
(:meth:`k3pipe.engines.base.Engine.preflight_rules`) over every arm, and returns
:class:`~k3pipe.engines.base.Finding` records: ``error`` (the run cannot work), ``warning`` (it
will run and mislead or fail under load) and ``info``.

Generic rules:

- ``env-unset`` (error): an ``{env.NAME}`` in an engine's env, arguments or executable whose
  variable is not set (it is read at launch).
- ``managed-flag`` (error): an argument k3pipe sets itself (model, served name, host, port).
- ``bad-value`` (error): an integer argument the engine's own parser would refuse.
- ``unknown-flag`` (warning): not a flag of the stock engine version the module was written for.
- ``workload-length`` (error): a workload's input + output exceeds the context length.
- ``kv-capacity`` (warning) / ``kv-capacity-skipped`` (info): the estimated KV pool
  (:func:`~k3pipe.engines.kvpool.estimate_kv_pool`) below the context length, or below what a workload
  holds at once (an error when the weights leave no memory for it at all); ``kv-estimate``
  (info): the estimate itself and what went into it, kept in the record's preflight.json beside the
  pool the engine then reports.
- ``executable`` (error): a process arm's program (``engine.executable[0]``, '{home}' expanded)
  is not on this machine, or not executable.

Experiment-wide rules: ``shared-prompts`` (warning: two workloads would send the same prompts),
``model-path`` (error: a local model's directory, or its config.json, is missing) and
``dataset`` (error: a sharegpt file or documents folder is missing, or no file matches its
glob): each local path the run needs is checked before the download, not after a cold start.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from k3pipe.core.errors import SpecError
from k3pipe.core.secrets import env_references
from k3pipe.core.settings import env_value
from k3pipe.engines import get_engine
from k3pipe.engines.base import ArmContext, Finding, Rule, Severity
from k3pipe.engines.kvpool import (
    GiB,
    KVEstimate,
    KVLayout,
    _text_config,
    estimate_kv_pool,
    kv_dtype_bytes,
    kv_layout,
)
from k3pipe.schema.specs import (
    ArmSpec,
    DocumentsDataset,
    ExperimentSpec,
    HardwareSpec,
    LocalModel,
    ModelScopeModel,
    ShareGPTDataset,
    WorkloadSpec,
    expand_home,
)
from k3pipe.verdicts.answers import question_fields

__all__ = [
    "Finding",
    "KVEstimate",
    "KVLayout",
    "NamedGpu",
    "Severity",
    "estimate_kv_pool",
    "hardware_mismatches",
    "kv_dtype_bytes",
    "kv_layout",
    "preflight",
    "read_model_config",
    "safetensors_bytes",
]


def read_model_config(path: str | Path) -> dict[str, Any] | None:
    """config.json of a model directory, or the file itself (None when absent)."""
    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text())
    except ValueError as exc:
        raise SpecError(f"{file}: not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise SpecError(f"{file}: a model config must be a JSON object")
    return data


def safetensors_bytes(model_dir: str | Path) -> int | None:
    """Total size of the ``*.safetensors`` files in a model directory (None when there are none)."""
    p = Path(model_dir)
    if not p.is_dir():
        return None
    sizes = [f.stat().st_size for f in p.rglob("*.safetensors") if f.is_file()]
    return sum(sizes) if sizes else None


# -- generic rules --------------------------------------------------------------------------------


def rule_managed_flags(ctx: ArmContext) -> Iterator[Finding]:
    try:
        ctx.engine.check_args(ctx.args)
    except SpecError as exc:
        yield ctx.finding("error", "managed-flag", str(exc))


def rule_bad_values(ctx: ArmContext) -> Iterator[Finding]:
    engine = ctx.engine
    for name in (engine.tp_arg, engine.pp_arg, engine.dcp_arg, engine.context_length_arg, *engine.int_args):
        found = engine.arg(ctx.args, name)
        if found is None:
            continue
        try:
            if name == engine.context_length_arg:
                engine.context_length(ctx.args)
            else:
                engine.int_arg(ctx.args, name)
        except ValueError as exc:
            yield ctx.finding("error", "bad-value", f"{found[0]}={found[1]!r}: {exc}")


def rule_unknown_flags(ctx: ArmContext) -> Iterator[Finding]:
    engine = ctx.engine
    table = engine.flag_table()
    if table is None:
        return
    declared = ctx.arm.engine.version
    other = bool(declared) and declared != engine.stock_version
    version_note = f" (this arm declares version {declared})" if other else ""
    # what argparse does is said of the version the table is of, never of another one
    parser = f"{engine.stock_version}'s argparse" if other else "argparse"
    unchecked = (
        f" k3pipe has no flag table of {declared}: its `--help` says whether it takes the flag."
        if other
        else ""
    )
    for key in ctx.args:
        flag = engine.flag_of(str(key))
        if flag in table.flags:
            continue
        short = "-" + str(key).lstrip("-")  # e.g. 'dcp': vLLM knows -dcp, not --dcp
        prefixed = [f for f in engine.flag_suggestions(str(key)) if f.startswith(flag)]
        if short in table.canonical:
            alias = table.canonical[short]
            hint = f" It means {alias} only as {short}; write {alias.lstrip('-').replace('-', '_')}."
        elif len(prefixed) == 1:
            hint = f" {parser} reads it as an abbreviation of {prefixed[0]}; spell the full name."
        elif prefixed:
            hint = f" {parser} refuses it as ambiguous ({', '.join(prefixed)} start with it)."
        else:
            close = engine.flag_suggestions(str(key))
            hint = f" Did you mean {' or '.join(close)}?" if close else ""
        yield ctx.finding(
            "warning",
            "unknown-flag",
            f"engine.args.{key} renders {flag}, which is not a flag of {engine.stock_label}{version_note} "
            f"({table.source}); fine if your image adds it.{hint}{unchecked}",
        )


def _context(ctx: ArmContext) -> tuple[int, str] | None:
    """The context length in force and where it comes from (declared, else config.json)."""
    engine = ctx.engine
    try:
        declared = engine.context_length(ctx.args)
    except ValueError:
        return None  # reported by rule_bad_values
    if declared is not None:
        found = engine.arg(ctx.args, engine.context_length_arg)
        key = found[0] if found else engine.context_length_arg
        return declared, f"{key}={declared:,}"
    if ctx.model_config is not None:
        cfg = _text_config(ctx.model_config)
        mpe = cfg.get("max_position_embeddings")
        if isinstance(mpe, int) and mpe > 0:
            return mpe, f"{engine.context_length_arg} unset, so config.json max_position_embeddings={mpe:,}"
    return None


def rule_workload_length(ctx: ArmContext) -> Iterator[Finding]:
    context = _context(ctx)
    if context is None:
        return
    length, source = context
    for w in ctx.experiment.workloads:
        need = w.input_tokens + w.output_tokens
        if need > length:
            yield ctx.finding(
                "error",
                "workload-length",
                f"workload {w.name}: input_tokens {w.input_tokens:,} + output_tokens {w.output_tokens:,} "
                f"= {need:,} exceeds the context length ({source}) by {need - length:,} tokens: every "
                f"request is refused. Raise the context length to at least {need:,} or shorten the workload.",
            )


def rule_speculation_random_prompts(ctx: ArmContext) -> Iterator[Finding]:
    """A speculative arm on random prompts measures the drafts' cost, not their benefit: no draft
    model or n-gram lookup predicts random tokens (the study's case: vLLM drafted about 990 tok/s and
    accepted about 21). Said before the launch, not read off the acceptance figures after it."""
    speculation = ctx.engine.speculation(ctx.args)
    if speculation is None:
        return
    random = [w.name for w in ctx.experiment.workloads if w.dataset.kind == "random" and w.trace is None]
    if not random:
        return
    yield ctx.finding(
        "warning",
        "speculation-random-prompts",
        f"speculative decoding ({speculation}) on random prompts (workload{'s' * (len(random) > 1)} "
        f"{', '.join(random)}): drafts of random tokens are almost never accepted, so this arm measures "
        "the drafting's cost, not its benefit; give these workloads a sharegpt or documents dataset to "
        "see what speculation gains on real text",
    )


def _kv_estimate(ctx: ArmContext, reserve_bytes_per_gpu: float) -> tuple[KVEstimate, str] | Finding | None:
    """The arm's KV estimate, or an INFO finding saying why there is none (None: skipped for the
    whole experiment, reported once by :func:`preflight`)."""
    engine = ctx.engine
    hardware = ctx.experiment.hardware
    if ctx.model_config is None or hardware is None or ctx.weight_bytes is None:
        return None
    args = ctx.args
    tp = engine.tensor_parallel_size(args)
    pp = engine.pipeline_parallel_size(args)
    dcp = engine.decode_context_parallel_size(args)
    weights_per_gpu = ctx.weight_bytes / (tp * pp)
    try:
        budget = engine.kv_budget_bytes_per_gpu(args, hardware.gpu_memory_gib * GiB, weights_per_gpu)
    except ValueError as exc:
        return ctx.finding("info", "kv-capacity-skipped", f"KV pool not estimated: {exc}.")
    if budget is None:
        return ctx.finding(
            "info",
            "kv-capacity-skipped",
            f"{engine.memory_fraction_arg} is not set, so {engine.display_name} sizes its memory at "
            f"start-up and the KV pool cannot be estimated; set {engine.memory_fraction_arg} to check it.",
        )
    bytes_, how = budget
    if reserve_bytes_per_gpu:
        bytes_ -= reserve_bytes_per_gpu
        how += f" - {reserve_bytes_per_gpu / GiB:.2f} GiB reserve = {bytes_ / GiB:.2f} GiB"
    try:
        estimate = estimate_kv_pool(
            ctx.model_config,
            kv_cache_dtype=engine.kv_cache_dtype(args),
            tp=tp,
            dcp=dcp,
            budget_bytes_per_gpu=bytes_,
        )
        cap = engine.kv_pool_cap(args)
    except ValueError as exc:
        return ctx.finding("info", "kv-capacity-skipped", f"KV pool not estimated: {exc}.")
    if cap is not None:
        estimate = estimate.capped(*cap)
    return estimate, how


def _kv_rule(reserve_bytes_per_gpu: float) -> Rule:
    def rule_kv_capacity(ctx: ArmContext) -> Iterator[Finding]:
        result = _kv_estimate(ctx, reserve_bytes_per_gpu)
        if result is None:
            return
        if isinstance(result, Finding):
            yield result
            return
        est, how = result
        engine = ctx.engine
        if est.budget_bytes_per_gpu <= 0:
            yield ctx.finding(
                "error",
                "kv-capacity",
                f"no memory is left for the KV cache: KV budget per GPU {how}. The engine cannot start"
                + (
                    f" ({engine.display_name}: '{engine.no_kv_memory_error}')"
                    if engine.no_kv_memory_error
                    else ""
                )
                + "; raise the memory fraction or spread the weights over more GPUs.",
            )
            return
        basis = f"Estimate (an upper bound): KV budget per GPU {how}; {est.explain()}."
        fixes = "; ".join(engine.kv_pool_fixes(ctx.args)) or "give the KV pool more memory"
        context = _context(ctx)
        if context is not None and est.tokens < context[0]:
            length, source = context
            short = length - est.tokens
            yield ctx.finding(
                "warning",
                "kv-capacity",
                f"estimated KV pool ~{est.tokens:,} tokens is {short:,} tokens ({short / length:.1%}) short "
                f"of the context length ({source}): one full-length request cannot fit; "
                f"{engine.kv_shortfall_consequence}. Fix: {fixes}. {basis}",
            )
        # the estimate itself, always: the record keeps it (preflight.json) beside the pool the engine
        # reports in its log (engine_log.kv_pool_tokens), so the two are compared from the record alone
        needs = [
            ((w.input_tokens + w.output_tokens) * w.concurrency, w.name) for w in ctx.experiment.workloads
        ]
        most = max(needs, default=None)
        yield ctx.finding(
            "info",
            "kv-estimate",
            f"estimated KV pool ~{est.tokens:,} tokens ({est.dtype_bytes:g} B per KV element, "
            f"{engine.kv_cache_dtype(ctx.args)})"
            + (f"; the most a workload holds at once: {most[0]:,} ({most[1]})" if most else "")
            + f". {basis}",
        )
        for w in ctx.experiment.workloads:
            per_request = w.input_tokens + w.output_tokens
            need = per_request * w.concurrency
            if est.tokens < need:
                fits = est.tokens // per_request
                yield ctx.finding(
                    "warning",
                    "kv-capacity",
                    f"workload {w.name} holds (input {w.input_tokens:,} + output {w.output_tokens:,}) x "
                    f"concurrency {w.concurrency} = {need:,} KV tokens at once, but the estimated pool "
                    f"holds ~{est.tokens:,}: only {fits} of its {w.concurrency} requests fit at a time, the "
                    "rest queue or get preempted, so latencies include waiting. Fix: lower the "
                    f"concurrency to {max(fits, 1)}, or {fixes}. {basis}",
                )

    return rule_kv_capacity


_OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def _offline(ctx: ArmContext) -> str | None:
    """The variable that keeps the engine from any hub ('engine.env.HF_HUB_OFFLINE=1', or this
    machine's environment for an engine started here), None when nothing does."""
    truthy = ("1", "true", "yes", "on")
    for name in _OFFLINE_VARS:
        if str(ctx.arm.engine.env.get(name, "")).strip().lower() in truthy:
            return f"engine.env.{name}={ctx.arm.engine.env[name]}"
    launcher = ctx.arm.launcher
    if launcher.starts_engine and launcher.runs_here and ctx.arm.launcher.kind == "process":
        for name in _OFFLINE_VARS:
            if os.environ.get(name, "").strip().lower() in truthy:
                return f"{name}={os.environ[name]} in this environment (the engine inherits it)"
    return None


def rule_unpinned_models(ctx: ArmContext) -> Iterator[Finding]:
    """A model the engine fetches itself at start (a hub id in its arguments): unpinned and unhashed
    (a warning), and on an offline node a launch that fails after the cold start (an error)."""
    offline = _offline(ctx)
    for path, value in ctx.engine.unpinned_models(ctx.args):
        if offline and not value.startswith(("/", "~", ".", "{")):
            yield ctx.finding(
                "error",
                "unpinned-model",
                f"engine.args.{path} names {value!r}, a hub id the engine would download at start, but it "
                f"runs offline ({offline}): the launch fails. Declare it under extra_models (source, id, "
                f"revision: k3pipe fetches, hashes and mounts it) and write '{{models.NAME}}' here.",
            )
            continue
        yield ctx.finding(
            "warning",
            "unpinned-model",
            f"engine.args.{path} names {value!r}, which the engine loads itself: k3pipe neither pins "
            "its revision nor hashes its files, so the run record cannot prove what was served and a "
            "rerun refuses it (unless --allow-drift). Declare it under extra_models (source, id, "
            f"revision) and write '{{models.NAME}}' here.",
        )


def _local(value: str, home: Path) -> Path:
    """A path of the spec on this machine: '{home}' and '~' expanded, relative to the working directory."""
    return Path(os.path.abspath(Path(expand_home(value, home)).expanduser()))


def _shown_path(value: str, path: Path) -> str:
    return repr(value) if value == str(path) else f"{value!r} ({path})"


def _executable_rule(home: Path) -> Rule:
    def rule_executable(ctx: ArmContext) -> Iterator[Finding]:
        if not ctx.arm.launcher.probes_interpreter or not ctx.arm.engine.executable:
            return  # the program runs in a container, or on another node
        value = ctx.arm.engine.executable[0]
        program = expand_home(value, home)
        fix = "build the engine's venv (`make engine` builds the demo's) or fix engine.executable"
        if "/" not in program:
            if shutil.which(program) is None:
                yield ctx.finding(
                    "error",
                    "executable",
                    f"engine.executable[0] {value!r} is not a program on PATH; {fix} (give its full path)",
                )
            return
        path = _local(value, home)
        if not path.exists():
            yield ctx.finding(
                "error",
                "executable",
                f"engine.executable[0] {_shown_path(value, path)} does not exist; {fix}",
            )
        elif path.is_dir() or not os.access(path, os.X_OK):
            yield ctx.finding(
                "error",
                "executable",
                f"engine.executable[0] {_shown_path(value, path)} is not an executable file; {fix}",
            )

    return rule_executable


def _volumes_rule(home: Path) -> Rule:
    def rule_volumes(ctx: ArmContext) -> Iterator[Finding]:
        """Each host path a container mounts is there (Docker refuses a bind mount of a missing one,
        after the image pull)."""
        for value, inside in ctx.arm.launcher.extra_mounts().items():
            path = _local(value, home)
            if not path.exists():
                yield ctx.finding(
                    "error",
                    "volume-path",
                    f"launcher.volumes {_shown_path(value, path)} (for {inside}) does not exist: make it "
                    f"or fix the path ('{{home}}' expands to K3PIPE_HOME, {home})",
                )

    return rule_volumes


def port_taken(host: str, port: int) -> bool:
    """Whether something on this machine already listens on ``host:port`` (binding it fails with
    EADDRINUSE); any other failure to bind is not this rule's to judge."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def rule_port(ctx: ArmContext) -> Iterator[Finding]:
    """The port an engine started here will bind is free (the study's pitfall: found at launch,
    after the model's download and the image's pull)."""
    launcher = ctx.arm.launcher
    if not (launcher.starts_engine and launcher.runs_here):
        return  # an endpoint, or an engine a cluster manager starts elsewhere
    port = launcher.port or ctx.engine.default_port
    if isinstance(port, str):
        return  # launcher.port 'auto': drawn free on the node when the launch is planned
    if port and port_taken(launcher.host, port):
        yield ctx.finding(
            "error",
            "port",
            f"launcher.port {port} on {launcher.host} is taken on this machine (another engine, or a "
            "run still going: `ss -ltnp` names the process); stop it, or give this arm another "
            "launcher.port",
        )


def rule_env_references(ctx: ArmContext) -> Iterator[Finding]:
    """Every ``{env.NAME}`` of an engine k3pipe starts names a variable that is set here (it is read
    at launch: unset, the launch would fail after the download and the image pull)."""
    if not ctx.arm.launcher.starts_engine:
        return  # an external endpoint's engine settings are recorded, never used

    def refs(where: str, value: Any) -> Iterator[tuple[str, str]]:
        if isinstance(value, Mapping):
            for k, v in value.items():
                yield from refs(f"{where}.{k}", v)
        elif isinstance(value, list):
            for i, v in enumerate(value):
                yield from refs(f"{where}[{i}]", v)
        elif isinstance(value, str):
            yield from ((where, name) for name in env_references(value))

    engine = ctx.arm.engine
    found = [*refs("engine.env", engine.env), *refs("engine.args", engine.args)]
    found += [
        (f"engine.executable[{i}]", name)
        for i, part in enumerate(engine.executable or [])
        for name in env_references(part)
    ]
    key_var = ctx.arm.endpoint.api_key_env if ctx.arm.launcher.engine_checks_key else None
    if key_var and ctx.engine.key_args(key_var, {}) and not env_value(key_var):
        flag = ctx.engine.api_key_flag
        yield ctx.finding(
            "error",
            "env-unset",
            f"endpoint.api_key_env names {key_var}, which {ctx.engine.display_name} is started with as "
            f"{flag} (it is read at launch, and never recorded), but {key_var} is not set in the "
            f"environment k3pipe runs in: export {key_var}=... before the run (on the worker, for a "
            "deployment), or remove endpoint.api_key_env to serve without a key",
        )
    for where, name in found:
        if not env_value(name):
            yield ctx.finding(
                "error",
                "env-unset",
                f"{where} refers to {{env.{name}}}, but {name} is not set in the environment k3pipe "
                f"runs in (it is read at launch, and never recorded): export {name}=... before the run "
                "(on the worker, for a deployment)",
            )


_GENERIC_RULES: tuple[Rule, ...] = (
    rule_env_references,
    rule_managed_flags,
    rule_bad_values,
    rule_unknown_flags,
    rule_workload_length,
    rule_unpinned_models,
    rule_speculation_random_prompts,
)

_ORDER = {"error": 0, "warning": 1, "info": 2}


_MAX_SHARED_PROMPT_PAIRS = 20


def _seed_overlaps(group: list[WorkloadSpec]) -> list[tuple[WorkloadSpec, WorkloadSpec]]:
    """Pairs of the group whose seed ranges (``seed`` .. ``seed + repeats - 1``) overlap, in file
    order, found by a sweep over the ranges sorted by start (no pass over all pairs); at most
    ``_MAX_SHARED_PROMPT_PAIRS + 1`` of them."""
    order = sorted(range(len(group)), key=lambda i: group[i].seed)
    active: list[int] = []
    pairs: list[tuple[int, int]] = []
    for i in order:
        start = group[i].seed
        active = [j for j in active if group[j].seed + group[j].repeats > start]
        pairs += [(min(i, j), max(i, j)) for j in active]
        active.append(i)
        if len(pairs) > _MAX_SHARED_PROMPT_PAIRS:
            break
    return [(group[i], group[j]) for i, j in sorted(pairs)]


def _shared_prompts(spec: ExperimentSpec) -> list[Finding]:
    """Workloads of one arm that would send the same prompts: the same dataset and length, and seed
    ranges (``seed`` .. ``seed + repeats - 1``) that overlap. The engine's prefix cache then serves
    the later one from the earlier one's KV, and its TTFT is not a cold prefill. Workloads are
    grouped by dataset and length first, so the check stays linear in their number (it once compared
    every pair: minutes for a large file); at most ``_MAX_SHARED_PROMPT_PAIRS`` pairs are listed."""
    groups: dict[tuple[Any, int], list[WorkloadSpec]] = defaultdict(list)
    for w in spec.workloads:
        groups[(w.dataset, w.input_tokens)].append(w)
    pairs: list[tuple[WorkloadSpec, WorkloadSpec]] = []
    for group in groups.values():
        if len(group) < 2:
            continue
        if group[0].dataset.kind in ("sharegpt", "documents"):
            # samples of one pool: any two draws overlap, whatever their seeds
            pairs += [(a, b) for i, a in enumerate(group[:8]) for b in group[i + 1 : 8]]
        else:
            pairs += _seed_overlaps(group)
        if len(pairs) > _MAX_SHARED_PROMPT_PAIRS:
            break
    findings = [
        Finding(severity="warning", rule="shared-prompts", arm=None, message=_shared(a, b))
        for a, b in pairs[:_MAX_SHARED_PROMPT_PAIRS]
    ]
    if len(pairs) > _MAX_SHARED_PROMPT_PAIRS:
        findings.append(
            Finding(
                severity="warning",
                rule="shared-prompts",
                arm=None,
                message=f"more workloads share prompts than the {_MAX_SHARED_PROMPT_PAIRS} pairs listed; "
                "give each workload seeds of its own (at least `repeats` apart) or data of its own",
            )
        )
    return findings


LADDER_MIN_WAVES = 2
"""A concurrency ladder point with fewer requests than this many times its streams is one burst."""


def _one_wave_points(spec: ExperimentSpec) -> Iterator[Finding]:
    """Concurrency ladder points whose requests are fewer than two waves of their streams: every
    request starts at once (64 prefills together at c64, then one decode batch that only drains), so
    the point measures a burst, never the engine steady at that load; its throughput, TTFT and the
    saturation test that compares it with the point before all read the burst (on the H100,
    2026-12-05: a 1-8-64 ladder of 64 requests, its c64 window 1.3 s)."""
    for w in spec.workloads:
        if w.ladder is None or w.ladder.over != "concurrency" or w.duration_s is not None:
            continue
        short = [v for v in w.ladder.values() if w.num_requests < LADDER_MIN_WAVES * v]
        if short:
            labels = ", ".join(w.ladder.label(v) for v in short)
            yield Finding(
                severity="warning",
                rule="ladder-one-wave",
                arm=None,
                message=(
                    f"workload {w.name}: at {labels} its {w.num_requests} requests are fewer than "
                    f"{LADDER_MIN_WAVES} waves of the streams, so every request starts at once and the "
                    "point measures a burst (prefills together, then a batch that only drains), not the "
                    "engine steady at that load; set num_requests to at least "
                    f"{LADDER_MIN_WAVES * int(max(short))} (or duration_s) for a steady figure"
                ),
            )


def _shared(a: WorkloadSpec, b: WorkloadSpec) -> str:
    if isinstance(a.dataset, ShareGPTDataset | DocumentsDataset):
        return (
            f"workloads {a.name} and {b.name} sample prompts from the same "
            f"{a.dataset.kind} data ({a.dataset.path}) with the same input_tokens: some "
            f"prompts will repeat, and the prefix cache would answer {b.name}'s repeats "
            f"from {a.name}'s. Merge them into one workload with repeats (repeats "
            "never resend a prompt), or give them different data."
        )
    seeds = range(max(a.seed, b.seed), min(a.seed + a.repeats, b.seed + b.repeats))
    return (
        f"workloads {a.name} and {b.name} draw the same {a.dataset.kind} prompts of "
        f"{a.input_tokens:,} tokens with seed(s) {', '.join(map(str, seeds))}: the "
        f"prefix cache would answer {b.name}'s prompts from {a.name}'s. Give them seeds "
        f"at least `repeats` apart (e.g. {b.name}.seed: {a.seed + a.repeats + 100})."
    )


def _model_paths(spec: ExperimentSpec, home: Path) -> Iterator[Finding]:
    """A local model's directory (and its config.json) must be there before anything starts; a
    ModelScope model is downloaded, so it is not checked here."""
    models: list[tuple[str, ModelScopeModel | LocalModel]] = [("model", spec.model)]
    models += [(f"extra_models.{name}", m) for name, m in spec.extra_models.items()]
    for field, model in models:
        if not isinstance(model, LocalModel):
            continue
        path = _local(model.path, home)
        where = f"{field}.path {_shown_path(model.path, path)}"
        if not path.is_dir():
            problem = "is a file, not a model directory" if path.exists() else "does not exist"
            yield Finding(
                severity="error",
                rule="model-path",
                arm=None,
                message=f"{where} {problem}: make the model there (`make model` makes the demo's tiny "
                f"model under K3PIPE_HOME) or set {field}.path to a model directory ('{{home}}' expands "
                f"to K3PIPE_HOME, {home})",
            )
        elif not (path / "config.json").is_file():
            yield Finding(
                severity="error",
                rule="model-path",
                arm=None,
                message=f"{where} has no config.json, so it is not a model directory (save_pretrained "
                f"writes one): point {field}.path at the directory that holds it",
            )


def _datasets(spec: ExperimentSpec) -> dict[Any, list[str]]:
    """Each file-backed dataset of the experiment -> the workloads that read it (a variant's are
    checked when the variant, resolved to an experiment, is preflighted)."""
    users: dict[Any, list[str]] = defaultdict(list)
    for w in spec.workloads:
        if isinstance(w.dataset, ShareGPTDataset | DocumentsDataset):
            users[w.dataset].append(f"workload {w.name!r}")
    return users


def _dataset_paths(spec: ExperimentSpec, home: Path) -> Iterator[Finding]:
    """A sharegpt file or documents folder must be there (with a file its glob matches) before the
    model is downloaded and the engine started."""
    for dataset, users in _datasets(spec).items():
        path = _local(dataset.path, home)
        who = ", ".join(users[:5]) + (f" and {len(users) - 5} more" if len(users) > 5 else "")
        relative = (
            f"('{{home}}' expands to K3PIPE_HOME, {home}; relative paths are taken from the working "
            f"directory, {Path.cwd()})"
        )
        problem = None
        if isinstance(dataset, ShareGPTDataset):
            if path.is_dir():
                problem = "is a folder: a sharegpt dataset is one JSON file (kind 'documents' reads a folder)"
            elif not path.is_file():
                problem = f"does not exist: give the path of a ShareGPT-format JSON file {relative}"
        elif not path.is_dir():
            if path.exists():
                problem = "is a file: a documents dataset is a folder of text files (sharegpt reads a file)"
            else:
                problem = f"does not exist: give a folder of text files {relative}"
        elif not any(p.is_file() for p in path.glob(dataset.glob)):
            problem = f"holds no file matching dataset.glob {dataset.glob!r}: set glob to match the documents"
        if problem:
            yield Finding(
                severity="error",
                rule="dataset",
                arm=None,
                message=f"{who}: dataset.path {_shown_path(dataset.path, path)} {problem}",
            )


def _accuracy_set(spec: ExperimentSpec, home: Path) -> Iterator[Finding]:
    """answers.accuracy's question set must be on this machine, and read as questions, before anything
    starts: nothing is downloaded."""
    accuracy = spec.answers.accuracy if spec.answers is not None else None
    if accuracy is None:
        return
    path = _local(accuracy.path, home)
    problem = None
    if not path.is_file():
        problem = "is a folder: give a JSONL file" if path.is_dir() else "does not exist"
    else:
        with path.open("rb") as f:
            first = next((line for line in f if line.strip()), b"")
        try:
            fields = question_fields(json.loads(first)) if first else None
        except ValueError:
            fields = None
        if fields is None:
            problem = (
                "holds no question on its first line: each line is one JSON object with 'question' and "
                "'answer' (or 'prompt' and 'target')"
            )
    if problem:
        yield Finding(
            severity="error",
            rule="accuracy-set",
            arm=None,
            message=(
                f"answers.accuracy.path {_shown_path(accuracy.path, path)} {problem} ('{{home}}' expands to "
                f"K3PIPE_HOME, {home}; nothing is downloaded: put the set on this machine, or drop "
                "answers.accuracy)"
            ),
        )


class NamedGpu(Protocol):
    """A GPU as nvidia-smi lists it (:class:`k3pipe.machine.node.GpuInfo`)."""

    @property
    def name(self) -> str: ...

    @property
    def memory_total_mib(self) -> int | None: ...


MEMORY_TOLERANCE = 0.10
"""How far the experiment's ``hardware.gpu_memory_gib`` may be from nvidia-smi's total before it is
called not this node's (139 GiB planned for an H200's 140.4 is within)."""


def hardware_mismatches(hardware: HardwareSpec | None, gpus: Sequence[NamedGpu]) -> list[str]:
    """Where the experiment's ``hardware:`` section is not the node nvidia-smi shows: the GPU's name
    (each word of ``gpu_name`` in nvidia-smi's name, so "NVIDIA B300" is "NVIDIA B300 SXM6 AC"), fewer
    GPUs than ``gpu_count``, or memory more than 10% from ``gpu_memory_gib`` (the preflight's KV
    capacity and each cell's cost were computed with the experiment's figures). Empty: it is."""
    if hardware is None or not gpus:
        return []
    out = []
    names = sorted({g.name for g in gpus})
    wanted = hardware.gpu_name.casefold().split()
    if not any(all(w in n.casefold().split() for w in wanted) for n in names):
        out.append(
            f"hardware.gpu_name is {hardware.gpu_name!r} but nvidia-smi names the GPU {', '.join(names)}"
        )
    if len(gpus) < hardware.gpu_count:
        out.append(
            f"hardware.gpu_count is {hardware.gpu_count} but nvidia-smi lists {len(gpus)} "
            f"GPU{'s' * (len(gpus) != 1)}"
        )
    totals = sorted({g.memory_total_mib for g in gpus if g.memory_total_mib})
    if totals and all(abs(t / 1024 / hardware.gpu_memory_gib - 1) > MEMORY_TOLERANCE for t in totals):
        shown = ", ".join(f"{t / 1024:.1f}" for t in totals)
        out.append(
            f"hardware.gpu_memory_gib is {hardware.gpu_memory_gib:g} but nvidia-smi reports {shown} GiB "
            "per GPU (the preflight's KV capacity used the experiment's figure)"
        )
    return out


def _checked_arms(spec: ExperimentSpec) -> list[ArmSpec]:
    """The arms preflight checks: the experiment's, with a search's arm replaced by its candidates (a
    candidate that cannot start is found here, before it costs a launch)."""
    if spec.tune is None:
        return list(spec.arms)
    searched = spec.tune.arm
    return [a for a in spec.arms if a.name != searched] + [c.arm for c in spec.tune_candidates()]


def _hardware_here(spec: ExperimentSpec, gpus: Sequence[NamedGpu]) -> Iterator[Finding]:
    """The experiment's ``hardware:`` against this machine's GPUs, where an arm starts its engine
    here (a warning: the KV capacity check and each cell's cost use the experiment's figures)."""
    if spec.hardware is None or not any(a.launcher.starts_engine and a.launcher.runs_here for a in spec.arms):
        return
    for message in hardware_mismatches(spec.hardware, gpus):
        yield Finding(
            severity="warning",
            rule="hardware-node",
            arm=None,
            message=f"{message}: this machine is not the one the experiment describes (fix its "
            "hardware: section, or run it where it belongs)",
        )


def _skipped_kv(
    spec: ExperimentSpec, config: Mapping[str, Any] | None, weight_bytes: int | None
) -> Finding | None:
    missing: list[str] = []
    if config is None:
        missing.append(
            "the model's config.json (download the model, or pass --model-config PATH / "
            "model_configs={'model': {...}})"
        )
    if weight_bytes is None:
        missing.append(
            "the size of the weights (the model directory's *.safetensors, or --weights-gib / weight_bytes=)"
        )
    if spec.hardware is None:
        missing.append("the experiment's hardware: section (gpu_name, gpu_count, gpu_memory_gib)")
    if not missing:
        return None
    return Finding(
        severity="info",
        rule="kv-capacity-skipped",
        arm=None,
        message="KV capacity check skipped: it needs " + "; ".join(missing) + ".",
    )


def preflight(
    spec: ExperimentSpec,
    model_configs: Mapping[str, Mapping[str, Any]] | None = None,
    *,
    model_dir: str | Path | None = None,
    weight_bytes: int | None = None,
    reserve_gib_per_gpu: float = 0.0,
    extra_rules: Iterable[Rule] = (),
    home: Path | None = None,
    this_machine: bool = False,
    gpus: Sequence[NamedGpu] | None = None,
) -> list[Finding]:
    """Check ``spec`` before anything is launched.

    ``model_configs["model"]`` is the model's config.json as a dict; without it, ``model_dir`` (if
    given) supplies config.json. ``weight_bytes`` is the total size of the weights; without it, the
    ``*.safetensors`` under ``model_dir``. ``reserve_gib_per_gpu`` is memory per GPU the KV estimate
    keeps back for activations and CUDA graphs (default 0: an upper bound). ``home`` is K3PIPE_HOME,
    which '{home}' in the spec's paths expands to (default: the settings'). ``this_machine``: also
    check this machine now, where it starts the engines (not for a fleet, whose nodes do): the port of
    each engine started here is free (a run asks it after reaping its own orphans, whose ports would
    otherwise be reported taken), and ``gpus`` (this machine's, as :func:`k3pipe.machine.node.gpus_here`
    lists them: the caller asks nvidia-smi) are the experiment's ``hardware:``. Findings come arm by
    arm
    (experiment-wide ones first), errors before warnings before infos.
    """
    if home is None:
        from k3pipe.core.settings import Settings

        home = Settings().home_dir
    config = dict((model_configs or {}).get("model") or {}) or None
    if config is None and model_dir is not None:
        config = read_model_config(model_dir)
    if weight_bytes is None and model_dir is not None:
        weight_bytes = safetensors_bytes(model_dir)

    findings: list[Finding] = [
        *_model_paths(spec, home),
        *_dataset_paths(spec, home),
        *_accuracy_set(spec, home),
    ]
    skipped = _skipped_kv(spec, config, weight_bytes)
    if skipped is not None:
        findings.append(skipped)
    findings.extend(_shared_prompts(spec))
    findings.extend(_one_wave_points(spec))
    if this_machine and spec.fleet is None and gpus:
        findings.extend(_hardware_here(spec, gpus))
    rules = (
        *_GENERIC_RULES,
        _executable_rule(home),
        _volumes_rule(home),
        _kv_rule(reserve_gib_per_gpu * GiB),
        *((rule_port,) if this_machine and spec.fleet is None else ()),
        *extra_rules,
    )
    for arm in _checked_arms(spec):
        engine = get_engine(arm.engine.kind)
        ctx = ArmContext(
            experiment=spec, arm=arm, engine=engine, model_config=config, weight_bytes=weight_bytes
        )
        found: list[Finding] = []
        for rule in (*rules, *engine.preflight_rules()):
            found.extend(rule(ctx))
        findings.extend(sorted(found, key=lambda f: _ORDER[f.severity]))
    return findings
