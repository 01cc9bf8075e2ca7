"""Engine log parsers against the fixture logs (tests/fixtures/engines/*/…, each citing its source)."""

from __future__ import annotations

import pytest

from k3pipe.engines import get_engine
from tests.unit.engines.helpers import fixture_lines


def test_vllm_study_log() -> None:
    """vllm/server.log: the study's 8-GPU Kimi-K3 + DSpark launch, reconstructed from vLLM 0.32.0."""
    facts = get_engine("vllm").parse_log(fixture_lines("vllm/server.log"))
    assert facts.engine == "vllm"
    assert facts.version == "0.32.0"
    assert facts.ready
    assert facts.ready_line == "INFO:     Application startup complete."
    assert facts.ready_time is None  # uvicorn's line has no timestamp
    assert facts.startup_s == 780.0  # 09:00:02 (first line) -> 09:13:02 (last stamp before readiness)
    assert facts.kv_pool_tokens == 2_692_400
    assert facts.kv_cache_memory_gib == 43.76
    assert facts.max_concurrency == 2.69
    assert facts.max_running_requests is None
    assert facts.context_length == 1_000_000
    assert facts.cuda_graph_capture_s == 41.0
    assert facts.weight_load_s == 178.40  # slowest of the 8 workers (Worker_TP3)
    # 4 "Engine 000" lines; the header comments quote the same format string and must not count
    assert facts.decode_throughput_tps == [12.6, 289.4, 501.3, 163.2]
    assert facts.decode_throughput_max_tps == 501.3
    assert facts.decode_throughput_mean_tps == pytest.approx((12.6 + 289.4 + 501.3 + 163.2) / 4)
    assert facts.spec_accept_lengths == [2.40, 2.27, 2.51, 1.15]
    assert facts.spec_accept_length_mean == pytest.approx(8.33 / 4)


def test_vllm_study_log_warnings() -> None:
    facts = get_engine("vllm").parse_log(fixture_lines("vllm/server.log"))
    joined = "\n".join(facts.warnings)
    for text in (
        "Unknown vLLM environment variable detected: VLLM_ENABLE_K3_LATENT_MOE_TAIL_FUSION",
        "Using a slow tokenizer",
        "Checkpoint does not provide a q scaling factor",
        "Using KV cache scaling factor 1.0 for fp8_e4m3",
        "Using uncalibrated q_scale 1.0",
    ):
        assert text in joined
    # each message once, though every one of the 8 workers logs it
    assert len(facts.warnings) == len(set(facts.warnings))
    assert sum("scaling factor 1.0" in w for w in facts.warnings) == 1
    # derived: fusions reported on while breakable CUDA graphs force compile mode NONE
    assert any("Enabled custom fusions: norm_quant, act_quant, allreduce_rms" in w for w in facts.warnings)
    # derived: the KV pool took more than vLLM's own figure for the budget (the study's OOM pitfall)
    over = [w for w in facts.warnings if "fit the gpu_memory_utilization budget" in w]
    assert over == [
        "k3pipe: the KV cache holds 43.76 GiB per GPU but only 38.48 GiB fit the gpu_memory_utilization "
        "budget (vLLM's own figure): expect OOM under load; pin --kv-cache-memory-bytes 41317885440 or "
        "lower gpu_memory_utilization"
    ]
    assert not any(w.startswith("#") for w in facts.warnings)


def test_vllm_real_cpu_log() -> None:
    """vllm/server-cpu-tiny-real.log: a verbatim vLLM 0.32.0 run on this machine."""
    facts = get_engine("vllm").parse_log(fixture_lines("vllm/server-cpu-tiny-real.log"))
    assert facts.version == "0.32.0"
    assert facts.ready
    assert facts.startup_s == 58.0  # 13:49:42 -> 13:50:40
    assert facts.kv_pool_tokens == 1_048_576  # "CPU KV cache size: 1,048,576 tokens"
    assert facts.max_concurrency == 256.0
    assert facts.context_length == 4096
    assert facts.weight_load_s == 0.01
    assert facts.cuda_graph_capture_s is None  # --enforce-eager: nothing captured
    assert facts.decode_throughput_tps == [13.3, 0.0]
    assert facts.spec_accept_lengths == []
    assert facts.spec_accept_length_mean is None
    # fusions are reported but nothing forces compile mode NONE; the other WARNING lines (ulimit,
    # dtype casts) do not change results
    assert facts.warnings == []


def test_vllm_torch_compile_log_without_readiness() -> None:
    facts = get_engine("vllm").parse_log(fixture_lines("vllm/server-torch-compile.log"))
    assert not facts.ready
    assert facts.ready_line is None
    assert facts.startup_s is None
    assert facts.kv_pool_tokens == 1_071_872
    assert facts.max_concurrency == 8.18
    assert facts.cuda_graph_capture_s == 37.0
    assert facts.decode_throughput_tps == []
    assert facts.decode_throughput_max_tps is None


def test_sglang_study_log() -> None:
    """sglang/server.log: the study's TP=8 DCP=8 DSpark launch, reconstructed from SGLang 0.5.23."""
    facts = get_engine("sglang").parse_log(fixture_lines("sglang/server.log"))
    assert facts.engine == "sglang"
    assert facts.ready
    assert facts.ready_line == "[2026-11-30 11:10:12] The server is fired up and ready to roll!"
    # not uvicorn's "Application startup complete." at 11:09:58: /health answers 503 until warm-up ends
    assert facts.ready_time == "2026-11-30 11:10:12"
    assert facts.startup_s == 608.0  # 11:00:04 -> 11:10:12, the field notes' ~10.2 min
    assert facts.kv_pool_tokens == 916_672  # logical pool (per-rank rows x dcp_size)
    assert facts.max_running_requests == 39  # squeezed from 48 by the Mamba state cache
    assert facts.context_length == 1_000_000
    # target verify 301.84 s + draft verify 27.93 s (the field notes' ~5.5 min)
    assert facts.cuda_graph_capture_s == pytest.approx(329.77)
    # slowest rank TP7: target 172.21 s + draft 10.84 s
    assert facts.weight_load_s == pytest.approx(183.05)
    assert facts.decode_throughput_tps == [318.74, 335.41, 352.06, 268.25]
    assert facts.decode_throughput_max_tps == 352.06
    assert facts.spec_accept_lengths == [1.21, 1.38, 1.55, 1.12]
    assert facts.max_concurrency is None


def test_sglang_study_log_warnings() -> None:
    facts = get_engine("sglang").parse_log(fixture_lines("sglang/server.log"))
    joined = "\n".join(facts.warnings)
    for text in (
        "Using FP8 KV cache but no scaling factors provided",
        "max_running_requests is capped to 39 by the mamba state cache",
        "KV pool holds 916672 tokens, fewer than --context-length 1000000",
        "KDA kernel dispatcher: decode=TritonKDAKernel, verify=TritonKDAKernel",
    ):
        assert text in joined
    assert sum("KV pool holds" in w for w in facts.warnings) == 1  # 8 ranks, one message
    # derived: no "DSpark ragged-verify scheduler enabled" line (only a header comment quotes it)
    static = [w for w in facts.warnings if "verifies statically" in w]
    assert len(static) == 1
    assert "full 8-token window" in static[0]
    assert "dcp_size=8" in static[0]


def test_ragged_verify_line_clears_static_warning() -> None:
    lines = [
        "[2026-11-30 11:03:52 TP0] Initialized DSpark draft runner. attention_backend=flashinfer, "
        "model=DSparkDraftModel, gamma=7, verify_num_draft_tokens=8, query_token_num=8",
        "[2026-11-30 11:03:52 TP0] DSpark ragged-verify scheduler enabled (mode=compact, lag=1, relay_lag=0, "
        "sps_table=/t, graph_tier=0).",
    ]
    assert get_engine("sglang").parse_log(lines).warnings == []
    assert get_engine("sglang").parse_log(lines[:1]).warnings != []


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_unrelated_lines_are_tolerated(kind: str) -> None:
    lines = [
        "Traceback (most recent call last):",
        '  File "x.py", line 1, in <module>',
        "# a comment: Avg generation throughput: 999.0 tokens/s, gen throughput (token/s): 999.00",
        "",
        "Loading safetensors checkpoint shards: 100% Completed | 1/1",
    ]
    facts = get_engine(kind).parse_log(lines)
    assert not facts.ready
    assert facts.decode_throughput_tps == []
    assert facts.warnings == []
    assert facts.kv_pool_tokens is None


def test_readiness_patterns() -> None:
    vllm = get_engine("vllm").readiness_pattern
    sglang = get_engine("sglang").readiness_pattern
    assert vllm.search("INFO:     Application startup complete.")
    assert not vllm.search("Starting vLLM server on http://0.0.0.0:8000")
    assert sglang.search("The server is fired up and ready to roll!")
    assert not sglang.search("INFO:     Application startup complete.")


def test_compile_mode_none_without_user_request_flags_fusions() -> None:
    """Fusions + compile mode NONE in the config dump, with no 'disabled by user settings' line."""
    fusions = "(APIServer pid=1) INFO 11-30 09:00:16 [compilation.py:317] Enabled custom fusions: norm_quant"
    dump = (
        "(EngineCore pid=2) INFO 11-30 09:00:31 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with "
        "config: model='m', compilation_config={'mode': <CompilationMode.NONE: 0>, 'backend': ''}"
    )
    user = (
        "(APIServer pid=1) WARNING 11-30 09:00:16 [vllm.py:1727] Inductor compilation was disabled by user "
        "settings, optimizations settings that are only active during inductor compilation will be ignored."
    )
    vllm = get_engine("vllm")
    assert any("may not take effect" in w for w in vllm.parse_log([fusions, dump]).warnings)
    assert vllm.parse_log([fusions, dump, user]).warnings == []
    assert vllm.parse_log([dump]).warnings == []


def _oom_burst(ranks: int, per_rank: int) -> list[str]:
    """The study's pitfall as vLLM 0.32.0's workers log it: torch's OutOfMemoryError text (each rank's
    own line), ``per_rank`` times on each of ``ranks`` workers, a second apart."""
    lines = []
    for i in range(per_rank):
        for tp in range(ranks):
            lines.append(
                f"(Worker_TP{tp} pid={598 + tp}) WARNING 11-30 09:14:{10 + i:02d} [gpu_model_runner.py:1] "
                "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. "
                f"GPU {tp} has a total capacity of 178.36 GiB of which 1.12 GiB is free."
            )
    return lines


def test_every_oom_line_is_counted_with_its_ranks_and_first_and_last_time() -> None:
    """The study's 32 OOM retries across 8 GPUs were one warning (each message kept once): now every
    line is counted, on which ranks, and when the first and the last came."""
    vllm = get_engine("vllm")
    clean = vllm.parse_log(fixture_lines("vllm/server.log"))
    assert clean.oom is None
    facts = vllm.parse_log([*fixture_lines("vllm/server.log"), *_oom_burst(ranks=8, per_rank=4)])
    assert facts.oom is not None
    assert facts.oom.lines == 32
    assert facts.oom.ranks == [f"Worker_TP{tp}" for tp in range(8)]
    assert (facts.oom.first_time, facts.oom.last_time) == ("11-30 09:14:10", "11-30 09:14:13")
    said = facts.oom.describe("GPU memory ran out")
    assert said.startswith(
        "GPU memory ran out on 32 log lines (8 ranks, first 11-30 09:14:10, last 11-30 09:14:13)"
    )
    assert sum("CUDA out of memory" in w for w in facts.warnings) == 8  # one per GPU's own message


@pytest.mark.parametrize(
    "log",
    ["vllm/server-0.22.0-h200-cold.log", "vllm/server-0.22.0-h200-warm.log", "vllm/server-cpu-tiny-real.log"],
)
def test_real_vllm_logs_without_trouble_count_no_oom(log: str) -> None:
    assert get_engine("vllm").parse_log(fixture_lines(log)).oom is None


def test_sglang_retractions_are_counted_and_its_real_logs_have_none() -> None:
    """SGLang retracts running requests when its KV pool is full mid-decode (managers/scheduler.py:
    "KV cache pool is full. Retract requests. #retracted_reqs: N, ..."): the same pressure, counted."""
    sglang = get_engine("sglang")
    real = fixture_lines("sglang/real-0.5.16-h200-cold.log")
    assert sglang.parse_log(real).oom is None
    assert sglang.parse_log(fixture_lines("sglang/real-0.5.16-h200-warm.log")).oom is None
    retract = [
        f"[2026-12-04 20:03:{s:02d}] KV cache pool is full. Retract requests. #retracted_reqs: 1, "
        f"#new_token_ratio: 0.{s:04d} -> 0.3487"
        for s in (5, 9, 30)
    ]
    facts = sglang.parse_log([*real, *retract])
    assert facts.oom is not None
    assert (facts.oom.lines, facts.oom.ranks) == (3, [])
    assert (facts.oom.first_time, facts.oom.last_time) == ("2026-12-04 20:03:05", "2026-12-04 20:03:30")
    assert facts.oom.describe("GPU memory ran out").startswith(
        "GPU memory ran out on 3 log lines (first 2026-12-04 20:03:05, last 2026-12-04 20:03:30): "
        "KV cache pool"
    )


# Tuned-kernel lookups as the engines log them (constructed: the real logs of tests/fixtures are of
# dense models, which look up no MoE config). The wording is vLLM's (fused_moe.py "Using configuration
# from %s for MoE layer." and "Using default MoE config. Performance might be sub-optimal! Config file
# not found at %s", as public vLLM logs print them) and SGLang's
# (layers/moe/fused_moe_triton/fused_moe_triton_config.py), in each engine's line prefix.
_VLLM_CONFIGS = "/opt/venv/lib/python3.12/site-packages/vllm/model_executor/layers/fused_moe/configs"
_SGLANG_CONFIGS = "/sgl/python/sglang/srt/layers/moe/fused_moe_triton/configs/triton_3_4_0"


def _vllm_moe_lines(device: str) -> list[str]:
    return [
        f"(Worker_TP{tp} pid={700 + tp}) INFO 12-05 07:10:0{tp} [fused_moe.py:1060] Using configuration "
        f"from {_VLLM_CONFIGS}/E=128,N=768,device_name={device},dtype=fp8_w8a8.json for MoE layer."
        for tp in range(2)
    ] + [
        f"(Worker_TP0 pid=700) WARNING 12-05 07:10:0{s} [fused_moe.py:1073] Using default MoE config. "
        f"Performance might be sub-optimal! Config file not found at "
        f"['{_VLLM_CONFIGS}/E=16,N=1536,device_name={device},dtype=fp8_w8a8,block_shape=[128,128].json']"
        for s in (3, 4)
    ]


def test_the_device_engines_chose_kernels_for_is_read_from_their_config_file_names() -> None:
    """The name inside a tuned-kernel config's file name is the device the engine chose kernels by
    (``torch.cuda.get_device_name()``, spaces as underscores); each distinct one kept, and every
    "Performance might be sub-optimal!" line (a kernel on its default config) counted."""
    from k3pipe.engines.observe import same_device

    vllm = get_engine("vllm").parse_log([*fixture_lines("vllm/server.log"), *_vllm_moe_lines("NVIDIA_H200")])
    assert vllm.device_names == ["NVIDIA_H200"]
    assert vllm.untuned_kernels is not None
    assert (vllm.untuned_kernels.lines, vllm.untuned_kernels.ranks) == (2, ["Worker_TP0"])
    assert "E=16,N=1536" in vllm.untuned_kernels.first_message

    sglang = get_engine("sglang").parse_log(
        [
            *fixture_lines("sglang/real-0.5.16-h200-cold.log"),
            f"[2026-12-05 07:11:02 TP0] Using MoE kernel config from {_SGLANG_CONFIGS}/E=384,N=256,"
            "device_name=NVIDIA_L20D,dtype=fp8_w8a8,block_shape=[128, 128].json.",
            "[2026-12-05 07:11:02 TP1] Using default MoE kernel config. Performance might be sub-optimal! "
            f"Config file not found at {_SGLANG_CONFIGS}/E=384,N=256,device_name=NVIDIA_L20D_down.json, "
            "you can create them with https://github.com/sgl-project/sglang/tree/main/benchmark/kernels/fused_moe_triton",
        ]
    )
    assert sglang.device_names == ["NVIDIA_L20D"]  # the down projection's file names the same device
    assert sglang.untuned_kernels is not None
    assert sglang.untuned_kernels.ranks == ["TP1"]

    assert same_device("NVIDIA_H200", ["NVIDIA H200"])
    assert same_device("NVIDIA_B300_SXM6_AC", ["NVIDIA B300 SXM6 AC"])
    assert not same_device("NVIDIA_L20D", ["NVIDIA B300 SXM6 AC"])
    assert not same_device("NVIDIA_H200", ["NVIDIA H200 NVL"])


@pytest.mark.parametrize(
    ("engine", "log"),
    [
        ("vllm", "vllm/server-0.22.0-h200-cold.log"),
        ("vllm", "vllm/server-cpu-tiny-real.log"),
        ("sglang", "sglang/real-0.5.16-h200-cold.log"),
        ("sglang", "sglang/real-0.5.16-h200-warm.log"),
    ],
)
def test_real_logs_of_dense_models_name_no_device_and_no_untuned_kernel(engine: str, log: str) -> None:
    facts = get_engine(engine).parse_log(fixture_lines(log))
    assert (facts.device_names, facts.untuned_kernels) == ([], None)


# The MLA study's fused-MoE lookups (issue 51: E=64 experts of width N=640, bf16), as vLLM 0.22.0 and
# SGLang 0.5.16 logged them on the H100 (2026-12-06, docs/gpu.md 'The study in miniature on one H100'):
# real lines, replacing the ones constructed from the sources before the sitting. vLLM found its tuned
# config (fused_moe.py:1060); SGLang, under the node's Triton 3.6.0, found none in configs/triton_3_6_0,
# fell back to triton_3_1_0's and reused the up projection's for the down projection, both lines ending
# "Performance might be sub-optimal", the first written mid-line after graph capture's progress bar.
_H100 = "NVIDIA_H100_80GB_HBM3"
_H100_SMI = "NVIDIA H100 80GB HBM3"  # nvidia-smi's name of the same GPU (the record's node facts)
_VLLM_H100 = "vllm/server-0.22.0-h100-mla.log"
_SGLANG_H100_OOM = "sglang/real-0.5.16-h100-mla-oom.log"
_SGLANG_H100 = "sglang/real-0.5.16-h100-mla-bounded.log"


def test_vllms_real_h100_mla_log() -> None:
    """The study's first vLLM launch: the tuned MoE config of an H100, the fp8 pool, the JIT warnings."""
    from k3pipe.engines.observe import same_device

    lines = fixture_lines(_VLLM_H100)
    facts = get_engine("vllm").parse_log(lines)
    assert facts.version == "0.22.0"
    assert facts.ready
    assert facts.startup_s == 115.0  # 09:15:32 -> 09:17:27, as the record's cold_start.api_ready_s
    assert facts.context_length == 204_800
    assert (facts.kv_pool_tokens, facts.kv_cache_memory_gib, facts.max_concurrency) == (
        32_159_424,
        69.01,
        157.03,
    )
    assert facts.cuda_graph_capture_s == 7.0
    assert facts.compiled
    assert not facts.compile_cache_hit
    assert facts.device_names == [_H100]
    assert same_device(facts.device_names[0], [_H100_SMI])
    assert facts.untuned_kernels is None  # a tuned config: nothing to flag
    moe = [ln for ln in lines if "for MoE layer." in ln]
    assert moe == [
        "(EngineCore pid=2543) INFO 12-06 09:16:57 [fused_moe.py:1060] Using configuration from "
        "/tmp/k3home/venvs/vllm-0.22.0/lib/python3.12/site-packages/vllm/model_executor/layers/fused_moe/"
        f"configs/E=64,N=640,device_name={_H100}.json for MoE layer."
    ]
    # the backends it chose, for the record's readers (no attention_backend was set)
    assert any(
        "Using FLASHMLA attention backend out of potential backends: ['FLASHMLA', 'TRITON_MLA']" in ln
        for ln in lines
    )
    assert any("Using TRITON Unquantized MoE backend" in ln for ln in lines)
    # kernels compiled while serving (jit_monitor.py:103), each with its time for the record to place
    # against the measured windows: here the endpoint probe's and the first warm-up's
    assert [(c.time, c.message.split(".")[0]) for c in facts.serving_compiles] == [
        ("12-06 09:17:29", "Triton kernel JIT compilation during inference: _compute_slot_mapping_kernel"),
        ("12-06 09:17:32", "Triton kernel JIT compilation during inference: fused_moe_kernel"),
    ]
    assert facts.warnings == []  # the ulimit warning changes no result
    assert facts.oom is None


def test_sglangs_real_h100_mla_launch_that_ran_out_of_memory_in_graph_capture() -> None:
    """The study's SGLang launches: the pool they allocated is read from the allocation line (the
    launch died before "max_total_num_tokens="), and the OOM lines take their record's time."""
    facts = get_engine("sglang").parse_log(fixture_lines(_SGLANG_H100_OOM))
    assert not facts.ready
    assert (facts.kv_pool_tokens, facts.kv_cache_memory_gib) == (30_430_899, 65.30)
    # 30,430,899 tokens x 4 layers x 576 B (fp8 latent) = 65.30 GiB; the bf16 copy of ONE layer's
    # buffer that fa3's decode makes (flashattention_backend.py:1939) is 30,430,899 x 576 x 2 B = 32.65 GiB
    assert round(30_430_899 * 4 * 576 / 2**30, 2) == 65.30
    assert round(30_430_899 * 576 * 2 / 2**30, 2) == 32.65
    assert facts.oom is not None
    assert (facts.oom.lines, facts.oom.first_time) == (2, "2026-12-06 09:20:40")
    assert "Tried to allocate 32.65 GiB" in facts.oom.first_message
    assert facts.device_names == []  # no MoE ran
    assert facts.untuned_kernels is None
    assert facts.weight_load_s == 0.60
    assert "Using FP8 KV cache but no scaling factors provided" in facts.warnings[0]


def test_sglangs_real_h100_mla_moe_config_lines_and_bounded_pool() -> None:
    """The SGLang retry with its pool bounded: both pool lines, the Triton-version fallback read from
    the middle of a progress-bar line, the down projection's line counted too."""
    from k3pipe.engines.observe import same_device

    lines = fixture_lines(_SGLANG_H100)
    facts = get_engine("sglang").parse_log(lines)
    assert facts.ready
    assert facts.startup_s == 100.0
    assert (facts.kv_pool_tokens, facts.kv_cache_memory_gib) == (2_100_000, 4.51)
    assert (facts.max_running_requests, facts.context_length) == (16, 204_800)
    assert facts.cuda_graph_capture_s == 68.06
    assert facts.device_names == [_H100]
    assert same_device(facts.device_names[0], [_H100_SMI])
    untuned = facts.untuned_kernels
    assert untuned is not None
    assert (untuned.lines, untuned.first_time, untuned.last_time) == (
        2,
        "2026-12-06 09:26:59",
        "2026-12-06 09:26:59",
    )
    configs = (
        "/tmp/sgl-venv/lib/python3.12/site-packages/sglang/srt/layers/moe/moe_runner/triton_utils/configs"
    )
    assert untuned.first_message == (
        f"Config file not found at {configs}/triton_3_6_0/E=64,N=640,device_name={_H100}.json. "
        "Fallback to triton version 3.1.0 and use MoE kernel config from "
        f"{configs}/triton_3_1_0/E=64,N=640,device_name={_H100}.json. Performance might be sub-optimal!"
    )
    # the raw line starts with graph capture's progress bar: the record inside it is read all the same
    raw = next(ln for ln in lines if "Fallback to triton version" in ln)
    assert raw.startswith("Capturing batches (bs=16 avail_mem=72.35 GB):")
    assert any(
        ln.startswith("[2026-12-06 09:27:16] max_total_num_tokens=2100000, chunked_prefill_size=32768")
        for ln in lines
    )
    assert any("Attention backend not specified. Use fa3 backend by default." in ln for ln in lines)


# The second sitting (2026-12-06, docs/gpu.md 'The study in miniature on one H100, second sitting'): the
# study's SGLang arm on FlashMLA (attention_backend: flashmla), its launch 1 from a cold compile cache,
# which served both workloads. The same MoE lookups as the bounded retry's, four minutes of graph capture
# later in a launch that went on to serve: real lines from a launch whose figures are in the study.
_SGLANG_H100_FLASHMLA = "sglang/real-0.5.16-h100-mla-flashmla.log"
_SGLANG_CONFIGS_H100 = (
    "/tmp/sgl-venv/lib/python3.12/site-packages/sglang/srt/layers/moe/moe_runner/triton_utils/configs"
)


def test_sglangs_real_h100_flashmla_launch_that_served_the_study() -> None:
    """FlashMLA's page size, the pool capped in whole pages, the MoE kernel-config lines of an H100 (the
    Triton-version fallback mid-line after the progress bar, the down projection's), the fp8 warning."""
    from k3pipe.engines.observe import same_device

    lines = fixture_lines(_SGLANG_H100_FLASHMLA)
    facts = get_engine("sglang").parse_log(lines)
    assert facts.ready
    assert facts.ready_time == "2026-12-06 13:09:20"
    assert facts.startup_s == 139.0  # 13:07:01 -> 13:09:20, as the record's cold_start.api_ready_s
    # --max-total-tokens 2100000 rounded down to whole 64-token pages: 32,812 x 64 = 2,099,968
    assert (facts.kv_pool_tokens, facts.kv_cache_memory_gib) == (2_099_968, 4.51)
    assert 2_100_000 // 64 * 64 == 2_099_968
    assert (facts.max_running_requests, facts.context_length) == (16, 204_800)
    assert facts.cuda_graph_capture_s == 58.35
    assert facts.device_names == [_H100]
    assert same_device(facts.device_names[0], [_H100_SMI])
    assert not same_device(facts.device_names[0], ["NVIDIA H200"])
    untuned = facts.untuned_kernels
    assert untuned is not None
    assert (untuned.lines, untuned.first_time, untuned.last_time, untuned.ranks) == (
        2,
        "2026-12-06 13:08:03",
        "2026-12-06 13:08:03",
        [],
    )
    assert untuned.first_message == (
        f"Config file not found at {_SGLANG_CONFIGS_H100}/triton_3_6_0/E=64,N=640,device_name={_H100}.json. "
        "Fallback to triton version 3.1.0 and use MoE kernel config from "
        f"{_SGLANG_CONFIGS_H100}/triton_3_1_0/E=64,N=640,device_name={_H100}.json. "
        "Performance might be sub-optimal!"
    )
    assert facts.warnings == [
        "Using FP8 KV cache but no scaling factors provided. Defaulting to scaling factors of 1.0. "
        "This may lead to less accurate results!"
    ]
    assert facts.oom is None
    # FlashMLA as asked: its page size set by SGLang, no fa3 default (the logged lines, not the header)
    logged = [ln for ln in lines if not ln.startswith("#")]
    page_size = "FlashMLA only supports a page_size of 64, change page_size to 64."
    assert any(ln.endswith(page_size) for ln in logged)
    assert not any("Use fa3 backend by default" in ln for ln in logged)
    assert any("attention_backend='flashmla'" in ln for ln in logged)
    assert any("api_key='***'" in ln for ln in logged)  # masked by SGLang


def _the_h100_moe_line(log: str, *words: str) -> str:
    """The one logged line holding every word (not the fixture's header, which quotes them)."""
    (line,) = [ln for ln in fixture_lines(log) if not ln.startswith("#") and all(w in ln for w in words)]
    return line


@pytest.mark.parametrize("log", [_SGLANG_H100, _SGLANG_H100_FLASHMLA])
def test_sglangs_two_real_moe_config_lines_each_name_the_device_and_count_as_untuned(log: str) -> None:
    """Each of SGLang 0.5.16's two lines on its own, as the readers mean them: the Triton-version fallback
    names the device twice (the triton_3_6_0 file it missed, the triton_3_1_0 one it used) and is one
    untuned line; the down projection's names ``..._down.json``, read as the same device, not a second
    one, and is untuned too though it ends with a full stop."""
    fallback = _the_h100_moe_line(log, "Fallback to triton version 3.1.0")
    down = _the_h100_moe_line(log, "Down MoE config file not found")
    assert f"device_name={_H100}_down.json; reusing the tuned up-projection config without TMA." in down
    assert down.endswith("Performance might be sub-optimal.")
    stamp = "2026-12-06 09:26:59" if log == _SGLANG_H100 else "2026-12-06 13:08:03"
    for line in (fallback, down):
        facts = get_engine("sglang").parse_log([line])
        assert facts.device_names == [_H100]
        assert facts.untuned_kernels is not None
        assert (facts.untuned_kernels.lines, facts.untuned_kernels.first_time) == (1, stamp)


@pytest.mark.parametrize(
    ("engine", "log"), [("vllm", _VLLM_H100), ("sglang", _SGLANG_H100), ("sglang", _SGLANG_H100_FLASHMLA)]
)
def test_the_real_h100_moe_lines_name_nvidia_smis_h100_and_not_another_gpu(engine: str, log: str) -> None:
    """The device-name check's comparison on both engines' real lines: the H100 nvidia-smi named on
    that node matches (however its spaces are written); an H200's or an H100 of another form does not."""
    from k3pipe.engines.observe import same_device

    (logged,) = get_engine(engine).parse_log(fixture_lines(log)).device_names
    assert logged == _H100
    assert same_device(logged, [_H100_SMI])
    assert same_device(logged, ["NVIDIA  H100 80GB   HBM3"])
    for other in ("NVIDIA H200", "NVIDIA H100 NVL", "NVIDIA H100 PCIe", "NVIDIA B300 SXM6 AC"):
        assert not same_device(logged, [other])


def test_a_record_that_a_progress_bar_ran_into_is_read_from_where_it_starts() -> None:
    from k3pipe.engines.observe import read_log_lines

    fmt = get_engine("sglang").log_patterns.format
    bar = "Capturing batches (bs=16 avail_mem=72.35 GB):   0%|          | 0/6 [00:00<?, ?it/s]"
    (line,) = read_log_lines([bar + "[2026-12-06 09:26:59] Config file not found at X."], fmt)
    assert (line.timestamp, line.message) == ("2026-12-06 09:26:59", "Config file not found at X.")
    assert line.text.startswith(bar)
    (plain,) = read_log_lines([bar], fmt)  # a bar alone stays a line without a prefix
    assert (plain.timestamp, plain.message) == (None, bar)
