"""SGLang: command line, endpoints, metrics, log format and preflight rules.

Written against stock SGLang 0.5.23 (PyPI wheel, sha256 00b3cd5b...9937; wheel path sglang/srt/X is
repo path python/sglang/srt/X). Every log pattern below comes from a format string cited in
tests/fixtures/engines/sglang/server.log; endpoints and argument names from
tests/fixtures/engines/sglang/endpoints.md.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from decimal import Decimal, InvalidOperation
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
from k3pipe.engines.observe import (
    KERNEL_CONFIG_DEVICE,
    UNTUNED_KERNEL,
    LogFormat,
    LogLine,
    LogPatterns,
    PhasePattern,
)

__all__ = ["ENGINE", "SGLangEngine", "human_readable_int"]

_SI = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_IEC = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)")


def human_readable_int(value: Any) -> int:
    """SGLang's reading of an integer flag (sglang/srt/utils/common.py:3394): CASE-SENSITIVE SI
    suffixes k, M, G, T (decimals allowed) and IEC Ki, Mi, Gi, Ti. Unlike vLLM, ``1m`` is refused and
    ``1M`` is 1,000,000 (vLLM reads ``1M`` as 1,048,576)."""
    if not isinstance(value, str):
        return plain_int(value)
    text = value.strip()
    match = _HUMAN_INT.fullmatch(text)
    if match:
        number, suffix = match.groups()
        if suffix in _IEC:
            if "." in number:
                raise ValueError(f"SGLang refuses {value!r}: decimals are not allowed with IEC suffixes")
            return int(number) * _IEC[suffix]
        try:
            return int(Decimal(number) * _SI[suffix])
        except InvalidOperation:  # pragma: no cover - the regex admits only digits
            raise ValueError(f"SGLang cannot read {value!r}") from None
    try:
        return int(text)
    except ValueError:
        raise ValueError(
            f"SGLang refuses {value!r}: use a plain integer, SI suffixes (1k, 1M) or IEC suffixes "
            "(1Ki, 1Mi); suffixes are case-sensitive"
        ) from None


_P = re.compile


# Cold-start phases, in start-up order, as SGLang 0.5.16 logged them on the H200
# (tests/fixtures/engines/sglang/real-0.5.16-h200-{cold,warm}.log) and 0.5.23's format strings say.
_GRAPH_CAPTURE = _P(r"^Capture .*CUDA graph end\..*\belapsed=(?P<v>[\d.]+) s")
_PHASES = (
    PhasePattern(
        "init_distributed",
        _P(r"^Init torch distributed ends\. elapsed=(?P<v>[\d.]+) s"),
        "Init torch distributed ends. elapsed=%.2f s, mem usage=%.2f GB (model_runner.py)",
        combine="last",
    ),
    PhasePattern(
        "weight_load",
        _P(r"^Load weight end\. elapsed=(?P<v>[\d.]+) s"),
        "Load weight end. elapsed=%.2f s, type=..., avail mem=... (model_runner.py: target + draft add up)",
    ),
    PhasePattern(
        "cuda_graph_capture",
        _GRAPH_CAPTURE,
        "Capture {role} {prefill|decode|verify} CUDA graph end. ... elapsed=%.2f s (cuda_graph_setup.py)",
    ),
    PhasePattern(
        "prefill_graph_capture",
        _P(r"^Capture \w+ prefill CUDA graph end\..*\belapsed=(?P<v>[\d.]+) s"),
        "Capture {role} prefill CUDA graph end. elapsed=%.2f s (prefill graphs, one per token count)",
        within="cuda_graph_capture",
    ),
    PhasePattern(
        "decode_graph_capture",
        _P(r"^Capture \w+ (?:decode|verify) CUDA graph end\..*\belapsed=(?P<v>[\d.]+) s"),
        "Capture {role} {decode|verify} CUDA graph end. ... elapsed=%.2f s",
        within="cuda_graph_capture",
    ),
)


class SGLangEngine(Engine):
    kind: ClassVar[str] = "sglang"
    display_name: ClassVar[str] = "SGLang"
    stock_version: ClassVar[str] = "0.5.23"
    flags_file: ClassVar[str | None] = "sglang-0.5.23-flags.txt"

    default_port: ClassVar[int] = 30000
    model_flag: ClassVar[str] = "--model-path"
    # /health behaves like /health_generate by default (SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION): a
    # 1-token generation, 503 until the warm-up request finished (http_server.py:721-799)
    health_path: ClassVar[str] = "/health"
    health_paths: ClassVar[tuple[str, ...]] = ("/health", "/health_generate")
    # ... so /health is no liveness probe during a workload: it answers 200 only once the scheduler
    # has sent something back after the probe (0.5.16 entrypoints/http_server.py:616-690: a 1-token
    # generation queued behind whatever the scheduler runs, checked every 1 s, 503 after
    # SGLANG_HEALTH_CHECK_TIMEOUT = 20 s). The H100 MLA study's SGLang went unanswered for 8 s while its
    # first 32K-token prefill chunk ran (docs/gpu.md), and the watch stopped a live engine.
    # /v1/models is served by the HTTP process alone (http_server.py:1780-1809); the scheduler's own
    # death ends the whole server (the launcher then sees the exit).
    watch_path: ClassVar[str | None] = "/v1/models"
    # GET /server_info -> {..., "version": "0.5.23", ...} (the old /get_server_info still answers but
    # logs a deprecation line); it also carries every resolved server arg, the logical KV pool
    # (max_total_num_tokens) and, per DP rank, effective_max_running_requests_per_dp
    version_path: ClassVar[str | None] = "/server_info"
    server_info_path: ClassVar[str | None] = "/server_info"
    model_info_path: ClassVar[str] = "/model_info"
    # SGLang takes its key as --api-key only (arg_groups/fields/serving.py:160-167; no variable): the
    # plan renders '--api-key {env.NAME}' for endpoint.api_key_env, resolved at launch alone. SGLang
    # logs it back in its start-up 'server_args={...}' line (entrypoints/engine.py:311; only watermark
    # secrets are redacted there), which the engine-log scrubber masks.
    api_key_env_var: ClassVar[str | None] = None
    api_key_flag: ClassVar[str | None] = "--api-key"
    # entrypoints/http_server.py:905 (0.5.16): GET or POST /flush_cache empties the radix cache
    prefix_cache_reset_path: ClassVar[str | None] = "/flush_cache"
    # What a warm restart reuses (measured on the H200, docs/gpu.md: prefill CUDA graphs 78.5 s on the
    # first launch, 10.7 s on the second) is the kernels compiled just in time during graph capture.
    # They go to four places, each moved by its own variable (read in the 0.5.16 wheels):
    # SGLANG_CACHE_DIR (srt/environ.py:1135, default ~/.cache/sglang: torch.compile with its Inductor
    # and Triton caches (srt/compilation/backend.py:405, compiler_interface.py:197-201), FlashInfer's
    # autotune results); TVM_FFI_CACHE_DIR (jit_kernel/utils/compile.py:244 and tvm_ffi 0.1.11
    # cpp/extension.py:682, default ~/.cache/tvm-ffi: sgl-kernel's JIT kernels);
    # FLASHINFER_WORKSPACE_BASE (flashinfer 0.6.14 jit/env.py:51-55, default $HOME: its JIT and cubins
    # under .cache/flashinfer); TRITON_CACHE_DIR (triton 3.6 knobs.py:347, default ~/.triton/cache).
    # SGLang's log says nothing of hits, so k3pipe tells them from the files (compile_cache_logged).
    compile_cache_env_var: ClassVar[str | None] = "SGLANG_CACHE_DIR"
    compile_cache_mount: ClassVar[str] = "/k3pipe/cache/sglang"
    compile_cache_subdirs: ClassVar[Mapping[str, str]] = {
        "TVM_FFI_CACHE_DIR": "tvm-ffi",
        "FLASHINFER_WORKSPACE_BASE": "flashinfer",
        "TRITON_CACHE_DIR": "triton",
    }
    compile_cache_logged: ClassVar[bool] = False

    # python/sglang/srt/observability/metrics_collector.py; /metrics only with --enable-metrics.
    # No drafted/accepted token counters: speculation is reported as gauges plus verify calls.
    metric_names: ClassVar[Mapping[str, str]] = {
        "ttft_seconds": "sglang:time_to_first_token_seconds",
        "itl_seconds": "sglang:inter_token_latency_seconds",
        "tpot_seconds": "sglang:request_time_per_output_token_seconds",
        "e2e_seconds": "sglang:e2e_request_latency_seconds",
        "queue_seconds": "sglang:queue_time_seconds",
        "prompt_tokens_total": "sglang:prompt_tokens_total",
        "generation_tokens_total": "sglang:generation_tokens_total",
        # observability/metrics_collector.py (0.5.16 :1662-1690): each finished request adds its prompt
        # tokens and, by cache source, those its radix cache held
        "prefix_cache_queries_total": "sglang:prompt_tokens_total",
        "prefix_cache_hits_total": "sglang:cached_tokens_total",
        "kv_usage_ratio": "sglang:token_usage",
        "requests_running": "sglang:num_running_reqs",
        "requests_waiting": "sglang:num_queue_reqs",
        "preemptions_total": "sglang:num_retracted_requests_total",
        "spec_verify_calls_total": "sglang:spec_verify_calls_total",
        "spec_accept_length": "sglang:spec_accept_length",
        "spec_accept_rate": "sglang:spec_accept_rate",
        "kv_pool_tokens": "sglang:max_total_num_tokens",
        "gen_throughput_tps": "sglang:gen_throughput",
    }

    # entrypoints/http_server.py:2600, after the warm-up request; uvicorn's "Application startup
    # complete." comes earlier, while /health still answers 503
    readiness_pattern: ClassVar[re.Pattern[str]] = _P(r"The server is fired up and ready to roll!")
    log_patterns: ClassVar[LogPatterns] = LogPatterns(
        # utils/common.py:2630 "[%(asctime)s{ms}{prefix}] %(message)s", date "%Y-%m-%d %H:%M:%S";
        # prefix " DP<d>" " PP<p>" " TP<t>" ... (managers/scheduler.py:6279-6291), no level name
        format=LogFormat(
            prefix=_P(
                r"^\[(?P<ts>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)(?:\.\d+)?(?: (?P<rank>[^\]]+))?\] (?P<msg>.*)$"
            ),
            time_format="%Y-%m-%d %H:%M:%S",
        ),
        ready=readiness_pattern,
        # managers/scheduler.py:1268: the LOGICAL pool (rows x dcp_size) and the granted running cap;
        # before it (and in a launch that fails in CUDA graph capture, the only pool line: the MLA
        # study's OOM on the H100) mem_cache/memory_pool.py:1622 (0.5.16) "KV Cache is allocated.
        # dtype: torch.float8_e4m3fn, #tokens: 30430899, KV size: 65.30 GB", the rows of one rank
        # (the same number without DCP); the last of the two logged wins
        kv_pool_tokens=_P(r"(?:\bmax_total_num_tokens=|^KV Cache is allocated\..*?#tokens: )(?P<v>\d+)"),
        # the same line's size: "GB" there is GiB (memory_pool.py:96, GB = 1024**3); MLA pools log
        # one "KV size", MHA pools "K size" and "V size" (not read: two numbers)
        kv_cache_memory_gib=_P(r"^KV Cache is allocated\..*\bKV size: (?P<v>[\d.]+) GB"),
        max_running_requests=_P(r"\bmax_total_num_tokens=\d+.*\bmax_running_requests=(?P<v>\d+)"),
        context_length=_P(r"\bmax_total_num_tokens=\d+.*\bcontext_len=(?P<v>\d+)"),
        # cuda_graph_setup.py:787 (and :695 for prefill graphs): target + draft graphs add up
        graph_capture_s=_GRAPH_CAPTURE,
        # model_executor/model_runner.py:1372: target + draft model add up
        weight_load_s=_P(r"^Load weight end\. elapsed=(?P<v>[\d.]+) s"),
        # managers/scheduler_components/metrics_reporter.py:963/1039
        decode_throughput_tps=_P(r"^Decode batch\b.*\bgen throughput \(token/s\): (?P<v>[\d.]+)"),
        phases=_PHASES,
        spec_accept_length=_P(r"^Decode batch\b.*\baccept len: (?P<v>[\d.]+)"),
        warnings=(
            _P(r"Using FP8 KV cache but no scaling factors provided"),  # load_model_utils.py:138
            _P(r"Using a slow tokenizer"),  # utils/hf_transformers/tokenizer.py:433 (a UserWarning)
            _P(r"KV pool holds \d+ tokens, fewer than --context-length"),  # managers/tp_worker.py:559
            # mem_cache/kv_cache_configurator.py:3140
            _P(r"max_running_requests is capped to \d+ by the mamba state cache"),
            _P(r"max_running_requests was reduced from"),  # kv_cache_configurator.py:3166
            _P(r"falling back to Triton"),  # layers/attention/linear/kda_backend.py:230-261
            _P(r"KDA kernel dispatcher: .*\bverify=Triton"),  # kda_backend.py:277: the kernel really used
            _P(r"DSpark SPS table is uninitialized"),  # dspark_planner.py:200
            _P(r"it will be a no-op"),  # speculative_hook.py:873/879
            _P(r"Health check failed"),  # http_server.py
            _P(r"(?i)out of memory"),
        ),
        # torch's OOM texts, and the scheduler's retraction when the KV pool runs out mid-decode
        # (managers/scheduler.py: "KV cache pool is full. Retract requests."): each line counted
        oom=(_P(r"(?i)out of memory|OutOfMemoryError"), _P(r"KV cache pool is full\. Retract requests")),
        # the tuned-kernel config files' names carry the device the engine chose kernels for, and
        # "Performance might be sub-optimal!" marks a kernel left on its default config
        device_name=KERNEL_CONFIG_DEVICE,
        untuned_kernels=(UNTUNED_KERNEL,),
    )

    tp_arg: ClassVar[str] = "tp_size"
    pp_arg: ClassVar[str] = "pp_size"
    dcp_arg: ClassVar[str] = "dcp_size"
    context_length_arg: ClassVar[str] = "context_length"
    memory_fraction_arg: ClassVar[str] = "mem_fraction_static"
    memory_fraction_default: ClassVar[float | None] = None  # SGLang sizes it at start-up
    speculation_arg: ClassVar[str] = "speculative_algorithm"
    int_args: ClassVar[tuple[str, ...]] = (
        "max_running_requests",
        "chunked_prefill_size",
        "max_prefill_tokens",
    )
    kv_shortfall_consequence: ClassVar[str] = (
        "SGLang starts anyway and logs 'KV pool holds N tokens, fewer than --context-length' "
        "(managers/tp_worker.py:559); full-length requests are then refused or truncated at serving time"
    )
    # model_executor/model_runner.py (init_memory_pool), when the profiled pool has no room
    no_kv_memory_error: ClassVar[str] = "Not enough memory. Please try to increase --mem-fraction-static."

    def parse_int(self, value: Any) -> int:
        return human_readable_int(value)

    def _dp_attention(self, args: Mapping[str, Any]) -> bool:
        found = self.arg(args, "enable_dp_attention")
        return found is not None and (found[1] is True or str(found[1]).lower() in ("true", "1"))

    def parallel_gpus(self, args: Mapping[str, Any]) -> tuple[int, str]:
        """tensor x pipeline parallel x data parallel replicas (``dp_size``; with
        ``enable_dp_attention`` the DP ranks are the TP ranks and add none), over ``nnodes``."""
        sizes = {self.tp_arg: self.tensor_parallel_size(args), self.pp_arg: self.pipeline_parallel_size(args)}
        dp = self._size(args, "dp_size")
        if not self._dp_attention(args):
            sizes["dp_size"] = dp
        count, text = parallel_product(sizes)
        if dp > 1 and self._dp_attention(args):
            text += f" (dp_size {dp} inside it: enable_dp_attention)"
        return self._per_node(args, count, text)

    def device_picks(self, args: Mapping[str, Any]) -> tuple[list[str], str] | None:
        """``base_gpu_id`` and ``gpu_id_step``: rank k on device base + k x step of those visible.
        Only where a step other than 1 meets tensor parallelism alone: with pipeline or data
        parallel ranks SGLang lays them out otherwise (None then: the count stands)."""
        base_arg, step_arg = self.arg(args, "base_gpu_id"), self.arg(args, "gpu_id_step")
        if base_arg is None and step_arg is None:
            return None
        try:
            base = self.int_arg(args, "base_gpu_id") or 0
            step = self.int_arg(args, "gpu_id_step") or 1
        except ValueError:
            return None
        count, _ = self.parallel_gpus(args)
        if step != 1 and count != self.tensor_parallel_size(args):
            return None
        written = ", ".join(f"engine.args.{f[0]}={f[1]}" for f in (base_arg, step_arg) if f is not None)
        return [str(base + k * step) for k in range(count)], written

    def model_references(self, args: Mapping[str, Any]) -> list[tuple[str, str]]:
        """``--speculative-draft-model-path`` (server_args.py), a directory or a hub id."""
        found = self.arg(args, "speculative_draft_model_path")
        if found is None or not isinstance(found[1], str) or not found[1]:
            return []
        return [(found[0], found[1])]

    def speculation_figures(self, window: MetricWindow) -> dict[str, float]:
        """SGLang exports no drafted/accepted token counters: ``engine_spec_verify_calls`` (counter
        delta) and the means over the window's scrapes of its gauges ``engine_spec_accept_length_mean``
        and ``engine_spec_accept_rate_mean`` (gauges of recent batches, so a sampled estimate)."""
        out: dict[str, float] = {}
        verify = window.delta("spec_verify_calls_total")
        if verify is not None:
            out["engine_spec_verify_calls"] = verify
        for key, metric in (
            ("spec_accept_length", "engine_spec_accept_length_mean"),
            ("spec_accept_rate", "engine_spec_accept_rate_mean"),
        ):
            mean = window.gauge_mean(self.metric_names[key])
            if mean is not None:
                out[metric] = mean
        return out

    def kv_pool_cap(self, args: Mapping[str, Any]) -> tuple[int, str] | None:
        """``max_total_tokens``: the pool is the smaller of it and what the memory gives
        (mem_cache/kv_cache_configurator.py:1599-1608, 0.5.16)."""
        found = self.arg(args, "max_total_tokens")
        if found is None or found[1] is None:
            return None
        tokens = self.parse_int(found[1])
        return tokens, f"max_total_tokens={tokens:,}"

    def kv_pool_fixes(self, args: Mapping[str, Any]) -> list[str]:
        fixes = ["raise mem_fraction_static", "lower context_length to the real business length"]
        if not self.kv_cache_dtype(args).startswith("fp8"):
            fixes.append("use kv_cache_dtype: fp8_e4m3")
        if self.decode_context_parallel_size(args) <= 1:
            fixes.append("split the KV over GPUs with dcp_size")
        fixes.append(
            "on hybrid (SSM) models give the SSM state less memory (mamba_full_memory_ratio, "
            "mamba_ssm_dtype: bfloat16)"
        )
        return fixes

    def version_from(self, payload: Any) -> str | None:
        if isinstance(payload, dict):
            version = payload.get("version")
            if isinstance(version, str):
                return version
        return None

    def derive_log_warnings(self, lines: Sequence[LogLine]) -> list[str]:
        messages = [ln.message for ln in lines]
        runner = next((m for m in messages if m.startswith("Initialized DSpark draft runner.")), None)
        ragged = any(m.startswith("DSpark ragged-verify scheduler enabled") for m in messages)
        if runner is None or ragged:
            return []
        # dspark_planner.py:182 logs that line only when SGLANG_RAGGED_VERIFY_MODE is not static
        window = re.search(r"\bverify_num_draft_tokens=(\d+)", runner)
        dcp = next((m for m in messages if m.startswith("DCP (dcp_size=")), None)
        return [
            "k3pipe: DSpark verifies statically (no 'DSpark ragged-verify scheduler enabled' line): no cost "
            "table, temperature calibration or confidence planner; every request verifies the full "
            f"{window.group(1) if window else 'draft'}-token window"
            + (f" ({dcp.split(' selects')[0]})" if dcp else "")
        ]

    def preflight_rules(self) -> tuple[Rule, ...]:
        return (rule_dcp_with_speculation, rule_metrics_disabled)


def rule_dcp_with_speculation(ctx: ArmContext) -> Iterator[Finding]:
    """dcp_size > 1 with a speculative algorithm: WARNING, verification becomes static.

    The field notes: with dcp_size > 1 SGLang forces static ragged verify. In stock 0.5.23
    (tests/fixtures/engines/sglang/endpoints.md) static is the default of SGLANG_RAGGED_VERIFY_MODE for
    every launch, and no code path switches to it because of DCP; the study's image did. Either way
    the arm runs with static verify, which is what this warning is about.
    """
    engine = ctx.engine
    dcp = engine.decode_context_parallel_size(ctx.args)
    spec = engine.speculation(ctx.args)
    if dcp <= 1 or spec is None:
        return
    found = engine.arg(ctx.args, engine.dcp_arg)
    dcp_key = found[0] if found else engine.dcp_arg
    window = "the full draft window"
    try:
        tokens = engine.int_arg(ctx.args, "speculative_num_draft_tokens")
        block = engine.int_arg(ctx.args, "speculative_dspark_block_size")
    except ValueError:
        tokens = block = None
    if tokens:
        window = f"the full window of speculative_num_draft_tokens={tokens} tokens"
    elif block:
        window = f"the full window of {block + 1} tokens (speculative_dspark_block_size={block} + 1)"
    yield ctx.finding(
        "warning",
        "sglang-dcp-speculation",
        f"{dcp_key}={dcp} with {spec}: SGLang runs both, but verification becomes static: DSPARK's cost "
        "table, temperature calibration and confidence planner switch off and every request verifies "
        f"{window}, however few drafts it accepts. Choose: keep DCP (it is what won long-context decode "
        f"in the study) and accept static verify, drop speculation, or add an arm with {dcp_key}: 1 to "
        "measure the difference. Record SGLANG_RAGGED_VERIFY_MODE (stock 0.5.23 defaults it to static "
        "for every launch) and look for the 'DSpark ragged-verify scheduler enabled' log line.",
    )


def rule_metrics_disabled(ctx: ArmContext) -> Iterator[Finding]:
    """Without --enable-metrics SGLang serves no /metrics: INFO."""
    found = ctx.engine.arg(ctx.args, "enable_metrics")
    if found is not None and found[1]:
        return
    yield ctx.finding(
        "info",
        "sglang-metrics-disabled",
        "enable_metrics is not set: SGLang serves /metrics only with --enable-metrics, so the engine's "
        "TTFT/ITL histograms and token counters cannot be scraped and throughput comes from its log "
        "alone. Add enable_metrics: true to cross-check client throughput against the engine.",
    )


ENGINE = SGLangEngine()
