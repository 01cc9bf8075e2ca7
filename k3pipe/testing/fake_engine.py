"""A scripted stand-in for an OpenAI-compatible inference engine, run INSIDE a test container.

SGLang needs CUDA and real vLLM needs ~3 GB and ~40 s per start on this CPU machine, so the docker
launcher is tested against this small stdlib-only program instead. It is not an engine: it reads
the model directory's ``config.json`` (so the read-only model mount is exercised) and answers with
made-up tokens, but its command line, log lines, endpoints and wire format follow the real engines,
as recorded with citations in ``tests/fixtures/engines/`` (see its README.md):

- log lines, flavor ``vllm``: ``tests/fixtures/engines/vllm/server-cpu-tiny-real.log`` (a verbatim
  capture of vLLM 0.32.0 on this machine): prefix ``(APIServer pid=N) LEVEL MM-DD HH:MM:SS
  [file.py:line] msg`` from ``vllm/logger.py:28``; the banner ``api_utils.py:347``, ``non-default
  args`` ``api_utils.py:286``, ``model.py:733`` / ``model.py:2152``, ``core.py:133``,
  ``kv_cache_utils.py:2327`` ``CPU KV cache size: ...``, ``core.py:402`` ``init engine ... took``,
  ``entry.py:140`` ``Starting vLLM server on``, ``launcher.py:186/195`` routes, uvicorn's
  ``INFO:     Application startup complete.`` and access lines (no prefix), ``loggers.py:335``
  ``Engine 000: Avg prompt throughput ...`` and the ``[shutdown]`` lines of ``launcher.py``.
  The start-up failure (``--crash-after-s``) prints the load-failure text of
  ``vllm/v1/worker/gpu_model_runner.py:5138-5148`` (quoted in ``vllm/config-errors.md``) and the
  ``Engine core initialization failed`` RuntimeError that ``vllm/v1/engine/utils.py`` raises when an
  engine core process dies during start-up (wording from that source, not a captured run).
- log lines, flavor ``sglang``: ``tests/fixtures/engines/sglang/server.log`` (reconstructed from
  sglang 0.5.23's format strings): prefix ``[YYYY-MM-DD HH:MM:SS( TP0)] msg``
  (``python/sglang/srt/utils/common.py:2630``), ``Load weight begin/end`` (``model_runner.py:1273``,
  ``:1372``), ``KV Cache is allocated`` (``mem_cache/memory_pool.py:2087``), ``max_total_num_tokens=``
  (``managers/scheduler.py:1268``), uvicorn lines with the ``[asctime]`` prefix
  (``utils/common.py:3513``), ``The server is fired up and ready to roll!``
  (``entrypoints/http_server.py:2600``), ``Prefill batch`` / ``Decode batch`` lines
  (``managers/scheduler_components/metrics_reporter.py:753``, ``:963``). Its start-up failure prints
  ``Scheduler hit an exception`` (``managers/scheduler.py``) and ``Initialization failed. Please see the
  error messages above.`` (``entrypoints/engine.py``), wording from those files.
- endpoints: vLLM ``/health`` (empty 200), ``/version`` (``{"version": ...}``), ``/v1/models``,
  ``/metrics`` with ``vllm:`` names (``vllm/v1/metrics/loggers.py``, see ``vllm/metrics.txt``);
  SGLang ``/health`` (503 while starting, ``entrypoints/http_server.py:721-799``),
  ``/get_server_info`` + ``/server_info`` (``"version"`` at top level, ``http_server.py:863-893``),
  ``/model_info``, ``/metrics`` with ``sglang:`` names (``observability/metrics_collector.py``); see
  ``sglang/endpoints.md`` and ``sglang/metrics.txt``.
- auth: a key (``--api-key``; flavor vllm also the ``VLLM_API_KEY`` environment variable, which SGLang
  does not read) makes ``/v1/...`` answer 401
  ``{"error": "Unauthorized"}`` without ``Authorization: Bearer <key>``
  (``vllm/entrypoints/openai/server_utils.py`` ``AuthenticationMiddleware``; SGLang
  ``utils/auth.py:154-205``, which leaves ``/health`` and ``/metrics`` open).
- ``/metrics``: flavor sglang serves it only with ``--enable-metrics`` (404 otherwise), as SGLang does.
- streaming, flavor sglang's chat: SGLang 0.5.23's own format (see ``_sglang_chat_stream``: the finish
  in a chunk of its own, ``reasoning_content`` in every delta, running ``usage`` per chunk with
  ``continuous_usage_stats``). Otherwise vLLM's wire format, built by ``openai_wire.py`` beside this
  file (which says where it comes from): chat starts with the role chunk, then one chunk per token, the
  last with ``finish_reason``; with ``stream_options.include_usage`` the usage chunk; then
  ``data: [DONE]``. Completions have no role chunk and carry ``choices[0].text``. (This flavor sends
  no running usage: it ignores ``continuous_usage_stats``.)

- ``--max-num-seqs N`` (vLLM's flag): at most N requests are served at once, the others wait for a
  slot (their time to first token grows with the queue), so a capacity under an SLO depends on it.
- the output probe (k3pipe/bench/probe.py), flavor vllm: a completion whose prompt is token ids with
  ``return_token_ids`` carries ``prompt_token_ids`` and ``token_ids`` (a made-up greedy continuation, a
  function of the prompt), with ``prompt_logprobs`` one entry per prompt token, the first null, each
  ``{token id: {logprob, rank, decoded_token}}`` (vLLM's ``CompletionResponseChoice``,
  vllm/entrypoints/openai/completion/protocol.py); ``--answer-noise-nats X`` moves those
  log-probabilities by up to X (another arithmetic), so an answers gate has something to find.

Standard library only, and ``openai_wire.py`` must stay beside it: the test image has only python3 and
these two files (``tests/docker/Dockerfile``).

Start-up: the HTTP server listens at once; ``/health`` answers 503 until ``--startup-delay-s`` has
passed, then 200. ``--crash-after-s N`` makes it print the start-up error after N s and exit with
status 3 without ever becoming healthy. Unknown flags are accepted and ignored (real launch lines
carry many). SIGTERM/SIGINT end it within a fraction of a second (it may be PID 1 in a container).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

try:
    from k3pipe.testing import openai_wire as wire
except ImportError:  # alone in the test image, openai_wire.py beside it
    import openai_wire as wire  # type: ignore[no-redef]

VLLM_VERSION = "0.32.0"
SGLANG_VERSION = "0.5.23"
CRASH_EXIT_CODE = 3
_WORDS = [" the", " model", " answers", " with", " tokens", " from", " a", " scripted", " list", "."]
# sglang:inter_token_latency_seconds' buckets (tests/fixtures/engines/sglang/metrics.txt)
_ITL_BUCKETS = (
    *(0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06, 0.08, 0.1),
    *(0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0),
)
_STATUS_PHRASES = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    503: "Service Unavailable",
}


# ----------------------------------------------------------------------------------------------- log


class Log:
    """Engine-style log lines on stdout, flushed at once (the launcher streams them to a file)."""

    def __init__(self, flavor: str) -> None:
        self.flavor = flavor
        self.pid = os.getpid()
        self._lock = threading.RLock()  # re-entrant: the signal handler logs too

    def _write(self, line: str) -> None:
        with self._lock:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    def engine(
        self, msg: str, where: str = "", level: str = "INFO", proc: str = "APIServer", rank: str = ""
    ) -> None:
        """A line of the engine's own logger (vLLM: process prefix + [file:line]; SGLang: [time rank])."""
        if self.flavor == "vllm":
            stamp = time.strftime("%m-%d %H:%M:%S")
            self._write(f"({proc} pid={self.pid}) {level} {stamp} [{where or 'fake_engine.py:1'}] {msg}")
        else:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            self._write(f"[{stamp}{' ' + rank if rank else ''}] {msg}")

    def uvicorn(self, msg: str, level: str = "INFO") -> None:
        prefix = f"{level}:".ljust(10)
        if self.flavor == "vllm":
            self._write(f"{prefix}{msg}")
        else:
            self._write(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {prefix}{msg}")

    def raw(self, line: str) -> None:
        self._write(line)


# --------------------------------------------------------------------------------------------- state


class Engine:
    """What the handlers share: settings, readiness and the counters behind /metrics."""

    def __init__(self, args: argparse.Namespace, log: Log, model_config: dict[str, Any]) -> None:
        self.args = args
        self.log = log
        self.flavor: str = args.flavor
        self.model_path: str = args.model
        self.served: str = args.served_model_name or args.model
        # vLLM takes --api-key or VLLM_API_KEY; SGLang only --api-key (arg_groups/fields/serving.py:160)
        env_key = os.environ.get("VLLM_API_KEY") if self.flavor == "vllm" else None
        self.api_key: str | None = args.api_key or env_key or None
        self.token_delay_s = max(0.0, args.token_delay_ms / 1000.0)
        self.answer_noise = float(args.answer_noise_nats)
        # vLLM's --max-num-seqs: at most this many requests decode at once, the others wait
        self.slots: Any = (
            threading.BoundedSemaphore(args.max_num_seqs) if args.max_num_seqs else contextlib.nullcontext()
        )
        self.max_model_len = int(
            args.max_model_len or args.context_length or model_config.get("max_position_embeddings") or 4096
        )
        self.architecture = (model_config.get("architectures") or ["LlamaForCausalLM"])[0]
        self.ready = threading.Event()
        self.stopping = threading.Event()
        self.started_at = time.time()
        self._lock = threading.Lock()
        self.running = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: dict[str, int] = {"stop": 0, "length": 0, "abort": 0}
        self._interval_prompt = 0
        self._interval_gen = 0
        self.ttft = Histogram(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            (
                0.1,
                0.2,
                0.4,
                0.6,
                0.8,
                1.0,
                2.0,
                4.0,
                6.0,
                8.0,
                10.0,
                20.0,
                40.0,
                60.0,
                80.0,
                100.0,
                200.0,
                400.0,
            ),
        )
        self.itl = Histogram(
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            _ITL_BUCKETS,
        )

    def begin(self, prompt_tokens: int) -> None:
        with self._lock:
            self.running += 1
            self.prompt_tokens += prompt_tokens
            self._interval_prompt += prompt_tokens
            running = self.running
        if self.flavor == "sglang":
            self.log.engine(
                f"Prefill batch, #new-seq: 1, #new-token: {prompt_tokens}, #cached-token: 0, "
                f"token usage: {self.token_usage():.2f}, #running-req: {running - 1}, #queue-req: 0, "
                "#pending-token: 0, cuda graph: False, input throughput (token/s): 0.00",
                rank="TP0",
            )

    def token(self) -> None:
        with self._lock:
            self.generation_tokens += 1
            self._interval_gen += 1

    def end(self, reason: str) -> None:
        with self._lock:
            self.running -= 1
            self.finished[reason] = self.finished.get(reason, 0) + 1

    def token_usage(self) -> float:
        return min(1.0, self.running * 64 / max(1, self.max_model_len * 256))

    def take_interval(self) -> tuple[int, int, int]:
        with self._lock:
            out = (self._interval_prompt, self._interval_gen, self.running)
            self._interval_prompt = self._interval_gen = 0
            return out

    def metrics_text(self) -> str:
        with self._lock:
            running, prompt, gen = self.running, self.prompt_tokens, self.generation_tokens
            finished = dict(self.finished)
        usage = self.token_usage()
        lines: list[str] = []
        if self.flavor == "vllm":
            labels = f'engine="0",model_name="{self.served}"'
            lines += [
                "# HELP vllm:num_requests_running Number of requests in model execution batches.",
                "# TYPE vllm:num_requests_running gauge",
                f"vllm:num_requests_running{{{labels}}} {float(running)}",
                "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
                "# TYPE vllm:num_requests_waiting gauge",
                f"vllm:num_requests_waiting{{{labels}}} 0.0",
                "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
                "# TYPE vllm:kv_cache_usage_perc gauge",
                f"vllm:kv_cache_usage_perc{{{labels}}} {usage}",
                "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
                "# TYPE vllm:prompt_tokens_total counter",
                f"vllm:prompt_tokens_total{{{labels}}} {float(prompt)}",
                "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
                "# TYPE vllm:generation_tokens_total counter",
                f"vllm:generation_tokens_total{{{labels}}} {float(gen)}",
                "# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.",
                "# TYPE vllm:num_preemptions_total counter",
                f"vllm:num_preemptions_total{{{labels}}} 0.0",
                "# HELP vllm:request_success_total Count of successfully processed requests.",
                "# TYPE vllm:request_success_total counter",
            ]
            for reason in ("stop", "length", "abort"):
                lines.append(
                    f'vllm:request_success_total{{engine="0",finished_reason="{reason}",'
                    f'model_name="{self.served}"}} {float(finished.get(reason, 0))}'
                )
        else:
            tok = f'engine_type="unified",is_streaming="true",model_name="{self.served}"'
            sched = (
                f'engine_type="unified",model_name="{self.served}",moe_ep_rank="0",pp_rank="0",tp_rank="0"'
            )
            lines += [
                "# HELP sglang:prompt_tokens_total Number of prefill tokens processed.",
                "# TYPE sglang:prompt_tokens_total counter",
                f"sglang:prompt_tokens_total{{{tok}}} {float(prompt)}",
                "# HELP sglang:generation_tokens_total Number of generation tokens processed.",
                "# TYPE sglang:generation_tokens_total counter",
                f"sglang:generation_tokens_total{{{tok}}} {float(gen)}",
                "# HELP sglang:num_requests_total Number of requests processed.",
                "# TYPE sglang:num_requests_total counter",
                f"sglang:num_requests_total{{{tok}}} {float(sum(finished.values()))}",
                "# HELP sglang:num_running_reqs The number of running requests.",
                "# TYPE sglang:num_running_reqs gauge",
                f"sglang:num_running_reqs{{{sched}}} {float(running)}",
                "# HELP sglang:num_queue_reqs The number of requests in the waiting queue.",
                "# TYPE sglang:num_queue_reqs gauge",
                f"sglang:num_queue_reqs{{{sched}}} 0.0",
                "# HELP sglang:token_usage The token usage.",
                "# TYPE sglang:token_usage gauge",
                f"sglang:token_usage{{{sched}}} {usage}",
                *self.ttft.lines(tok),
                *self.itl.lines(f'engine_type="unified",model_name="{self.served}"'),
            ]
        return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------- serving


class Histogram:
    """A Prometheus histogram as SGLang exports it (observability/metrics_collector.py; buckets and
    labels as in tests/fixtures/engines/sglang/metrics.txt)."""

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]) -> None:
        self.name, self.help_text, self.buckets = name, help_text, buckets
        self.counts = [0] * len(buckets)
        self.count = 0
        self.total = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self.count += 1
            self.total += value
            for i, bound in enumerate(self.buckets):
                if value <= bound:
                    self.counts[i] += 1

    def lines(self, labels: str) -> list[str]:
        with self._lock:
            out = [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} histogram"]
            for bound, n in zip(self.buckets, self.counts, strict=True):
                out.append(f'{self.name}_bucket{{{labels},le="{bound}"}} {float(n)}')
            out.append(f'{self.name}_bucket{{{labels},le="+Inf"}} {float(self.count)}')
            out.append(f"{self.name}_count{{{labels}}} {float(self.count)}")
            out.append(f"{self.name}_sum{{{labels}}} {self.total}")
            return out


def _count_tokens(value: Any) -> int:
    if isinstance(value, str):
        return max(1, len(value.split()))
    if isinstance(value, list):
        if value and all(isinstance(v, int) for v in value):
            return len(value)  # token ids
        return sum(_count_tokens(v) for v in value) or 1
    return 1


def _ids(value: Any) -> list[int] | None:
    """A completion prompt given as token ids (the output probe sends them), else None."""
    if (
        isinstance(value, list)
        and value
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        return value
    return None


def greedy_ids(prompt: list[int], n: int) -> list[int]:
    """The made-up greedy continuation of a token-id prompt: a function of the prompt alone, so every
    launch and setting answers alike (a deterministic engine)."""
    seed = sum((k + 1) * t for k, t in enumerate(prompt)) % 9973
    return [(seed + 131 * k) % 1000 + 1 for k in range(n)]


def prompt_logprob(token: int, position: int, noise: float) -> float:
    """The made-up log-probability of a prompt token at a position; ``noise`` (nats) moves it by a
    deterministic amount in [-noise, +noise], as other arithmetic would."""
    base = -1.0 - ((token * 2654435761 + position * 40503) % 1000) / 500
    return base + noise * (((token * 7919 + position * 104729) % 2001) / 1000 - 1)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "uvicorn"
    sys_version = ""
    engine: Engine  # set on the subclass made in main()

    # quiet BaseHTTPRequestHandler's own stderr logging; we print uvicorn-style access lines
    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _access(self, status: int) -> None:
        host, port = self.client_address[:2]
        phrase = _STATUS_PHRASES.get(status, "")
        self.engine.log.uvicorn(f'{host}:{port} - "{self.command} {self.path} HTTP/1.1" {status} {phrase}')

    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self._access(status)

    def _json(self, status: int, payload: Any) -> None:
        self._send(status, json.dumps(payload).encode())

    def _authorized(self, path: str) -> bool:
        key = self.engine.api_key
        if not key:
            return True
        if self.engine.flavor == "vllm":
            protected = path.startswith("/v1")
        else:
            protected = not path.startswith(("/health", "/ready", "/metrics"))
        return not protected or self.headers.get("Authorization") == f"Bearer {key}"

    def _route(self) -> str | None:
        """Common checks; returns the path to serve, or None when an answer was already sent."""
        path = self.path.split("?", 1)[0]
        if not self._authorized(path):
            self._json(401, wire.UNAUTHORIZED)
            return None
        return path

    # GET

    def do_GET(self) -> None:
        path = self._route()
        if path is None:
            return
        eng = self.engine
        ready = eng.ready.is_set() and not eng.stopping.is_set()
        if path in ("/health", "/health_generate", "/ready"):
            self._send(200 if ready else 503, b"")
        elif path == "/metrics" and (eng.flavor == "vllm" or eng.args.enable_metrics):
            self._send(200, eng.metrics_text().encode(), "text/plain; version=0.0.4; charset=utf-8")
        elif path == "/metrics":  # SGLang mounts it only with --enable-metrics (http_server.py:314)
            self._json(404, {"detail": "Not Found"})
        elif eng.flavor == "vllm" and path == "/version":
            self._json(200, {"version": VLLM_VERSION})
        elif eng.flavor == "sglang" and path in ("/get_server_info", "/server_info"):
            if path == "/get_server_info":
                eng.log.engine(
                    "Endpoint '/get_server_info' is deprecated and will be removed in a future version. "
                    "Please use '/server_info' instead."
                )
            self._json(200, self._server_info(ready))
        elif eng.flavor == "sglang" and path in ("/model_info", "/get_model_info"):
            self._json(
                200,
                {
                    "model_path": eng.model_path,
                    "served_model_name": eng.served,
                    "tokenizer_path": eng.model_path,
                    "is_generation": True,
                    "model_type": "llama",
                    "architectures": [eng.architecture],
                },
            )
        elif path == "/v1/models":
            if not ready:
                self._json(503, wire.error_body("the engine is starting", "ServiceUnavailableError", 503))
                return
            card = {
                "id": eng.served,
                "object": "model",
                "created": int(eng.started_at),
                "owned_by": eng.flavor,
                "root": eng.model_path if eng.flavor == "vllm" else eng.served,
                "parent": None,
                "max_model_len": eng.max_model_len,
            }
            self._json(200, {"object": "list", "data": [card]})
        else:
            self._json(404, {"detail": "Not Found"})

    do_HEAD = do_GET

    def _server_info(self, ready: bool) -> dict[str, Any]:
        eng = self.engine
        args = eng.args
        return {
            "model_path": eng.model_path,
            "served_model_name": eng.served,
            "host": args.host,
            "port": args.port,
            "context_length": eng.max_model_len,
            "tp_size": 1,
            "status": "ready" if ready else "starting",
            "max_total_num_tokens": eng.max_model_len * 256,
            "max_req_input_len": eng.max_model_len - 1,
            "version": SGLANG_VERSION,
            "frontend": "python",
            "launch_command": " ".join(sys.argv),
            "internal_states": [{"effective_max_running_requests_per_dp": 256, "last_gen_throughput": 0.0}],
        }

    # POST

    def do_POST(self) -> None:
        # read the body first: the connection is kept alive, whatever the answer
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        path = self._route()
        if path is None:
            return
        if path not in ("/v1/chat/completions", "/v1/completions"):
            self._json(404, {"detail": "Not Found"})
            return
        eng = self.engine
        if not eng.ready.is_set() or eng.stopping.is_set():
            self._json(503, wire.error_body("the engine is not ready", "ServiceUnavailableError", 503))
            return
        try:
            body = json.loads(raw or b"{}")
            if not isinstance(body, dict):
                raise ValueError("the request body must be a JSON object")
        except ValueError as exc:
            self._json(400, wire.error_body(f"invalid JSON body: {exc}", "BadRequestError", 400))
            return
        chat = path == "/v1/chat/completions"
        if chat and not isinstance(body.get("messages"), list):
            self._json(400, wire.error_body("'messages' is required", "BadRequestError", 400, "messages"))
            return
        if not chat and "prompt" not in body:
            self._json(400, wire.error_body("'prompt' is required", "BadRequestError", 400, "prompt"))
            return
        model = body.get("model", eng.served)
        if eng.flavor == "vllm" and model != eng.served:
            # vLLM checks the served name (SGLang echoes whatever it is sent)
            msg = f"The model `{model}` does not exist."
            self._json(404, wire.error_body(msg, "NotFoundError", 404, "model"))
            return
        limit = body.get("max_completion_tokens") if chat else None
        limit = limit if limit is not None else body.get("max_tokens")
        try:
            n_tokens = int(limit) if limit is not None else 16
        except (TypeError, ValueError):
            self._json(
                400, wire.error_body("max_tokens must be an integer", "BadRequestError", 400, "max_tokens")
            )
            return
        if n_tokens < 1:
            self._json(
                400, wire.error_body("max_tokens must be at least 1", "BadRequestError", 400, "max_tokens")
            )
            return
        reason = "length" if limit is not None else "stop"
        if chat:
            prompt_tokens = sum(
                _count_tokens(m.get("content", "")) for m in body["messages"] if isinstance(m, dict)
            )
            prompt_tokens += 4 * len(body["messages"])  # a chat template's worth
        else:
            prompt_tokens = _count_tokens(body["prompt"])
        with eng.slots:  # --max-num-seqs: a request beyond the batch waits for a slot (its TTFT grows)
            self._serve(body, chat, model, n_tokens, reason, prompt_tokens)

    def _serve(
        self, body: dict[str, Any], chat: bool, model: str, n_tokens: int, reason: str, prompt_tokens: int
    ) -> None:
        eng = self.engine
        eng.begin(prompt_tokens)
        finish = "abort"
        try:
            if body.get("stream"):
                self._stream(body, chat, model, n_tokens, reason, prompt_tokens)
            else:
                self._whole(chat, model, n_tokens, reason, prompt_tokens, body)
            finish = reason
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        finally:
            eng.end(finish)

    def _texts(self, n: int) -> list[str]:
        return [_WORDS[k % len(_WORDS)] for k in range(n)]

    def _whole(
        self, chat: bool, model: str, n: int, reason: str, prompt_tokens: int, body: dict[str, Any]
    ) -> None:
        texts = []
        for text in self._texts(n):
            time.sleep(self.engine.token_delay_s)
            self.engine.token()
            texts.append(text)
        content = "".join(texts)
        head = {"created": int(time.time()), "model": model}
        if chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": content, "reasoning": None, "tool_calls": []},
                "logprobs": None,
                "finish_reason": reason,
                "stop_reason": None,
                "token_ids": None,
            }
            out = {"id": "chatcmpl-" + uuid.uuid4().hex, "object": "chat.completion", **head}
        else:
            choice = {
                "index": 0,
                "text": content,
                "logprobs": None,
                "finish_reason": reason,
                "stop_reason": None,
            }
            ids = _ids(body.get("prompt"))
            if ids is not None and body.get("return_token_ids"):
                # vLLM's CompletionResponseChoice: prompt_token_ids and token_ids (the output's)
                choice["prompt_token_ids"] = ids
                choice["token_ids"] = greedy_ids(ids, n)
            if ids is not None and body.get("prompt_logprobs") is not None:
                # one entry per prompt token, the first null, each a map of token id (a string in JSON)
                # to {logprob, rank, decoded_token} (vllm/entrypoints/openai/completion/protocol.py)
                noise = self.engine.answer_noise
                choice["prompt_logprobs"] = [None] + [
                    {str(t): {"logprob": prompt_logprob(t, k, noise), "rank": 1, "decoded_token": f"<{t}>"}}
                    for k, t in enumerate(ids[1:], 1)
                ]
            out = {"id": "cmpl-" + uuid.uuid4().hex, "object": "text_completion", **head}
        out["choices"] = [choice]
        out["usage"] = wire.usage(prompt_tokens, n, 0 if chat else None)
        self._json(200, out)

    def _chunk(self, payload: dict[str, Any]) -> None:
        self.wfile.write(wire.http_chunk(wire.event(payload).encode()))
        self.wfile.flush()

    def _start_stream(self) -> None:
        self.send_response(200)
        self.send_header("content-type", wire.SSE_CONTENT_TYPE)
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        self._access(200)  # uvicorn logs the access line when the response starts

    def _end_stream(self) -> None:
        self.wfile.write(wire.http_chunk(wire.DONE.encode()) + wire.HTTP_LAST_CHUNK)
        self.wfile.flush()

    def _sglang_usage(self, prompt_tokens: int, completion: int) -> dict[str, Any]:
        """UsageInfo.model_dump() (entrypoints/openai/protocol.py:221): every field, None included."""
        return {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": None,
            "reasoning_tokens": 0,
            "completion_tokens_details": None,
        }

    def _sglang_chat_stream(
        self, body: dict[str, Any], model: str, n: int, reason: str, prompt_tokens: int
    ) -> None:
        """SGLang 0.5.23's chat stream (entrypoints/openai/serving_chat.py:2480-2806, chunks built by
        sse_utils.py:52 with msgspec, omit_defaults): a role chunk; one chunk per token whose delta
        always carries ``reasoning_content`` (null here) and, with ``continuous_usage_stats``, the
        running ``usage`` (serving_chat.py:1035); the finish_reason in a chunk of its own with an
        empty delta and ``matched_stop``; with ``include_usage`` a ``choices: []`` usage chunk
        (pydantic model_dump_json, serving_chat.py:2790); then ``[DONE]``. The id is the request's
        hex id, no ``chatcmpl-`` prefix."""
        eng = self.engine
        options = body.get("stream_options") or {}
        continuous = bool(options.get("continuous_usage_stats"))
        head = wire.chunk_head(True, model, rid=uuid.uuid4().hex)

        def choice(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            return {
                "index": 0,
                "delta": delta,
                "logprobs": None,
                "finish_reason": finish,
                "matched_stop": None,
            }

        self._start_stream()
        self._chunk(
            {**head, "choices": [choice({"reasoning_content": None, "role": "assistant", "content": ""})]}
        )
        last = arrived = time.monotonic()
        for k, text in enumerate(self._texts(n)):
            time.sleep(eng.token_delay_s)
            if eng.stopping.is_set():
                raise BrokenPipeError("shutting down")
            eng.token()
            now = time.monotonic()
            if k == 0:
                eng.ttft.observe(now - arrived)
            else:
                eng.itl.observe(now - last)
            last = now
            chunk: dict[str, Any] = {
                **head,
                "choices": [choice({"reasoning_content": None, "content": text})],
            }
            if continuous:
                chunk["usage"] = self._sglang_usage(prompt_tokens, k + 1)
            self._chunk(chunk)
        self._chunk({**head, "choices": [choice({"reasoning_content": None}, reason)]})
        if options.get("include_usage"):
            self._chunk({**head, "choices": [], "usage": self._sglang_usage(prompt_tokens, n)})
        self._end_stream()

    def _stream(
        self, body: dict[str, Any], chat: bool, model: str, n: int, reason: str, prompt_tokens: int
    ) -> None:
        if chat and self.engine.flavor == "sglang":
            self._sglang_chat_stream(body, model, n, reason, prompt_tokens)
            return
        eng = self.engine
        self._start_stream()
        head = wire.chunk_head(chat, model)
        if chat:
            self._chunk(wire.role_chunk(head))
        for k, text in enumerate(self._texts(n)):
            time.sleep(eng.token_delay_s)
            if eng.stopping.is_set():
                raise BrokenPipeError("shutting down")
            eng.token()
            finish = reason if k == n - 1 else None
            choice = wire.delta_choice({"content": text}, finish) if chat else wire.text_choice(text, finish)
            chunk = wire.chunk(head, [choice])
            if eng.flavor == "sglang":  # SGLang's completions (serving_completions.py:373-403)
                del choice["stop_reason"]
                choice["matched_stop"] = None
                if (body.get("stream_options") or {}).get("continuous_usage_stats"):
                    chunk["usage"] = self._sglang_usage(prompt_tokens, k + 1)
            self._chunk(chunk)
        if (body.get("stream_options") or {}).get("include_usage"):
            final = wire.usage(prompt_tokens, n, 0 if chat else None)
            self._chunk(wire.usage_chunk(head, final, chat))
        self._end_stream()


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, (BrokenPipeError, ConnectionResetError, socket.timeout)):
            return
        super().handle_error(request, client_address)


# ------------------------------------------------------------------------------------------ start-up


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--model", "--model-path", dest="model", required=True, help="model directory")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--flavor", choices=["vllm", "sglang"], default="vllm")
    p.add_argument("--api-key", default=None)
    p.add_argument("--enable-metrics", action="store_true", help="SGLang: serve /metrics")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None, help="requests decoded at once (others wait)")
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--startup-delay-s", type=float, default=1.0)
    p.add_argument("--crash-after-s", type=float, default=None)
    p.add_argument("--token-delay-ms", type=float, default=5.0)
    p.add_argument("--stats-interval-s", type=float, default=10.0)
    p.add_argument(
        "--answer-noise-nats", type=float, default=0.0,
        help="how far its prompt log-probabilities move from the plain ones (another arithmetic)",
    )  # fmt: skip
    args, unknown = p.parse_known_args(argv)
    if args.port is None:
        args.port = 8000 if args.flavor == "vllm" else 30000
    return args, unknown


def read_model_config(model: str, log: Log) -> dict[str, Any] | None:
    path = os.path.join(model, "config.json")
    try:
        with open(path, encoding="utf-8") as fh:
            config = json.load(fh)
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
    except FileNotFoundError:
        reason = f"no config.json in the model directory {model!r} (is the model mounted there?)"
    except (OSError, ValueError) as exc:
        reason = f"cannot read {path}: {exc}"
    else:
        return config
    if log.flavor == "vllm":
        log.engine(
            f"Invalid repository ID or local directory specified: {model!r}: {reason}",
            "fake_engine.py:1",
            level="ERROR",
        )
    else:
        log.engine(f"Failed to load the model config: {reason}")
    log.raw(f"ValueError: {reason}")
    return None


def announce_start(eng: Engine, unknown: list[str]) -> None:
    log, args = eng.log, eng.args
    if eng.flavor == "vllm":
        where = "api_utils.py:347"
        log.engine("", where)
        log.engine("       █     █     █▄   ▄█", where)
        log.engine(f" ▄▄ ▄█ █     █     █ ▀▄▀ █  version {VLLM_VERSION}", where)
        log.engine(f"  █▄█▀ █     █     █     █  model   {eng.model_path}", where)
        log.engine("   ▀▀  ▀▀▀▀▀ ▀▀▀▀▀ ▀     ▀", where)
        log.engine("", where)
        non_default = {"host": args.host, "port": args.port, "model": eng.model_path}
        if args.served_model_name:
            non_default["served_model_name"] = [args.served_model_name]
        log.engine(f"non-default args: {non_default}", "api_utils.py:286")
        if unknown:
            log.engine(f"fake engine: ignoring engine flags {unknown}", "fake_engine.py:1", level="WARNING")
        log.engine(f"Resolved architecture: {eng.architecture}", "model.py:733")
        log.engine(f"Using max model len {eng.max_model_len}", "model.py:2152")
        log.engine(
            f"Initializing a V1 LLM engine (v{VLLM_VERSION}) with config: model='{eng.model_path}', "
            f"tokenizer='{eng.model_path}', max_seq_len={eng.max_model_len}, device_config=cpu, "
            f"served_model_name={eng.served}",
            "core.py:133",
            proc="EngineCore",
        )
    else:
        # entrypoints/engine.py:311 logs server_args.resolved_dict() with only watermark secrets
        # redacted (:173): the key is in it, as the real engine prints it
        resolved = {
            "model_path": eng.model_path,
            "served_model_name": eng.served,
            "host": args.host,
            "port": args.port,
            "api_key": args.api_key,
            "context_length": args.context_length,
            "tp_size": 1,
            "enable_metrics": args.enable_metrics,
        }
        log.engine(f"server_args={resolved}")
        if unknown:
            log.engine(f"fake engine: ignoring engine flags {unknown}")
        log.engine("Load weight begin. avail mem=21.40 GB", rank="TP0")


def announce_ready(eng: Engine, took_s: float) -> None:
    log, args = eng.log, eng.args
    url = f"http://{args.host}:{args.port}"
    if eng.flavor == "vllm":
        log.engine(
            f"CPU KV cache size: {eng.max_model_len * 256:,} tokens, Maximum concurrency for "
            f"{eng.max_model_len:,} tokens per request: 256.00x",
            "kv_cache_utils.py:2327",
            proc="EngineCore",
        )
        log.engine(
            f"init engine (profile, create kv cache, warmup model) took {took_s:.2f} s",
            "core.py:402",
            proc="EngineCore",
        )
        log.engine(f"Starting vLLM server on {url}", "entry.py:140")
        log.engine("Available routes are:", "launcher.py:186")
        for route, methods in (
            ("/health", "GET"),
            ("/metrics", "GET"),
            ("/version", "GET"),
            ("/v1/models", "GET"),
            ("/v1/chat/completions", "POST"),
            ("/v1/completions", "POST"),
        ):
            log.engine(f"Route: {route}, Methods: {methods}", "launcher.py:195")
        log.uvicorn(f"Started server process [{log.pid}]")
        log.uvicorn("Waiting for application startup.")
        log.uvicorn("Application startup complete.")
    else:
        log.engine(
            f"Load weight end. elapsed={took_s:.2f} s, type={eng.architecture}, "
            "avail mem=21.39 GB, mem usage=0.01 GB.",
            rank="TP0",
        )
        log.engine(
            f"KV Cache is allocated. dtype: torch.bfloat16, #tokens: {eng.max_model_len * 256}, "
            "K size: 0.50 GB, V size: 0.50 GB",
            rank="TP0",
        )
        log.engine(
            f"max_total_num_tokens={eng.max_model_len * 256}, chunked_prefill_size=8192, "
            "max_prefill_tokens=16384, "
            f"max_running_requests=256, context_len={eng.max_model_len}, available_gpu_mem=20.39 GB",
            rank="TP0",
        )
        log.uvicorn(f"Started server process [{log.pid}]")
        log.uvicorn("Waiting for application startup.")
        log.uvicorn("Application startup complete.")
        log.uvicorn(f"Uvicorn running on {url} (Press CTRL+C to quit)")
        log.engine("The server is fired up and ready to roll!")


def announce_crash(eng: Engine) -> None:
    log = eng.log
    if eng.flavor == "vllm":
        log.engine(
            "Failed to load model - not enough GPU memory. Try lowering --gpu-memory-utilization to "
            "free memory for weights, increasing --tensor-parallel-size, or using --quantization. See "
            "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more tips. "
            "(original error: scripted crash of the fake engine (--crash-after-s))",
            "gpu_model_runner.py:5138",
            level="ERROR",
            proc="EngineCore",
        )
        log.raw(
            "RuntimeError: Engine core initialization failed. See root cause above. "
            "Failed core proc(s): {'EngineCore': 1}"
        )
    else:
        log.engine(
            "Scheduler hit an exception: RuntimeError: scripted crash of the fake engine (--crash-after-s)",
            rank="TP0",
        )
        log.raw("RuntimeError: Initialization failed. Please see the error messages above.")


def announce_stop(eng: Engine) -> None:
    log = eng.log
    if eng.flavor == "vllm":
        log.engine("[shutdown] API server: shutdown triggered", "launcher.py:254")
        log.engine("[shutdown] API server: shutting down FastAPI HTTP server", "launcher.py:304")
    log.uvicorn("Shutting down")
    log.uvicorn("Waiting for application shutdown.")
    log.uvicorn("Application shutdown complete.")


def stats_loop(eng: Engine) -> None:
    """vLLM's periodic ``Engine 000:`` line / SGLang's ``Decode batch`` line, while there is work."""
    interval = eng.args.stats_interval_s
    idle_logged = True
    while not eng.stopping.wait(interval):
        prompt, gen, running = eng.take_interval()
        active = prompt or gen or running
        if not active and idle_logged:
            continue
        idle_logged = not active
        if eng.flavor == "vllm":
            eng.log.engine(
                f"Engine 000: Avg prompt throughput: {prompt / interval:.1f} tokens/s, "
                f"Avg generation throughput: {gen / interval:.1f} tokens/s, "
                f"Running: {running} reqs, Waiting: 0 reqs, "
                f"CPU KV cache usage: {eng.token_usage() * 100:.1f}%, Prefix cache hit rate: 0.0%",
                "loggers.py:335",
            )
        elif running:
            eng.log.engine(
                f"Decode batch, #running-req: {running}, #token: {running * 64}, "
                f"token usage: {eng.token_usage():.2f}, "
                f"cuda graph: False, gen throughput (token/s): {gen / interval:.2f}, #queue-req: 0",
                rank="TP0",
            )


def main(argv: list[str] | None = None) -> int:
    args, unknown = parse_args(sys.argv[1:] if argv is None else argv)
    log = Log(args.flavor)
    t0 = time.monotonic()

    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        if args.flavor == "vllm":
            log.engine(
                f"[shutdown] EngineCore: trigger received signal={signal.Signals(signum).name}",
                "core.py:1454",
                proc="EngineCore",
            )
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    config = read_model_config(args.model, log)
    if config is None:
        return 1
    eng = Engine(args, log, config)
    announce_start(eng, unknown)

    handler = type("BoundHandler", (Handler,), {"engine": eng})
    try:
        server = Server((args.host, args.port), handler)
    except OSError as exc:
        log.engine(f"could not bind {args.host}:{args.port}: {exc}", level="ERROR")
        log.raw(f"OSError: [Errno {exc.errno}] {exc.strerror}")
        return 1
    serving = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    serving.start()
    threading.Thread(target=stats_loop, args=(eng,), daemon=True).start()

    try:
        if args.crash_after_s is not None:
            if not stop.wait(args.crash_after_s):
                announce_crash(eng)
                eng.stopping.set()
                server.shutdown()
                server.server_close()
                return CRASH_EXIT_CODE
        elif not stop.wait(args.startup_delay_s):
            announce_ready(eng, time.monotonic() - t0)
            eng.ready.set()
        stop.wait()
    finally:
        eng.stopping.set()
    announce_stop(eng)
    server.shutdown()
    server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
