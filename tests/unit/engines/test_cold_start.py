"""Cold-start phases and compile-cache lines of vLLM's log, in 0.22.0's wording (the GPU node's release:
real logs of one H200, 2026-12-01, held against the record's cold_start.* metrics) and 0.32.0's."""

from __future__ import annotations

import pytest

from k3pipe.engines import get_engine
from k3pipe.engines.observe import EngineLogFacts, phase_table
from tests.unit.engines.helpers import fixture_lines

PREFIX = "(EngineCore pid=7) INFO 12-01 19:40:24 "
WITHIN = {
    "api_ready": None,
    "model_load": "api_ready",
    "weight_load": "model_load",
    "init_engine": "api_ready",
    "torch_compile": "init_engine",
    "dynamo_transform": "torch_compile",
    "compile_cache_load": "torch_compile",
    "initial_profiling": "init_engine",
    "cuda_graph_capture": "init_engine",
}
CACHE_DIR = "/tmp/k3home/cache/vllm/29ae75c41b4a/torch_compile_cache/4e84ce8ca7/rank_0_0/backbone"


def parse(name: str) -> EngineLogFacts:
    return get_engine("vllm").parse_log(fixture_lines(name))


def test_vllm_022_real_cold_launch_phases() -> None:
    """Arm vllm of the H200 run: the MLflow run 9878eda3 holds exactly these as cold_start.*_s."""
    facts = parse("vllm/server-0.22.0-h200-cold.log")
    assert facts.version == "0.22.0"
    assert facts.phase_seconds() == {
        "api_ready": 92.0,  # 20:09:16 (first line) -> 20:10:48 (last stamp before uvicorn's line)
        "model_load": 0.821,  # gpu_model_runner.py:5132 "... took 1.82 GiB memory and 0.821204 seconds"
        "weight_load": 0.39,
        "init_engine": 32.61,  # core.py:302 "... took 32.61 s (compilation: 20.18 s)"
        "torch_compile": 20.18,  # monitor.py:53, the AOT compile
        "dynamo_transform": 5.91,
        "initial_profiling": 0.2,
        "cuda_graph_capture": 3.0,
    }
    assert {p.phase: p.within for p in facts.cold_start_phases} == {
        k: v for k, v in WITHIN.items() if k != "compile_cache_load"
    }
    assert not facts.compile_cache_hit
    assert facts.compiled
    assert facts.compile_cache_dir == CACHE_DIR
    # readiness: uvicorn's line, which carries no timestamp of its own
    assert facts.ready
    assert facts.ready_line == "(APIServer pid=1784) INFO:     Application startup complete."
    assert facts.ready_time is None
    assert facts.startup_s == 92.0
    # the KV pool: kv_cache_utils.py:1733 "GPU KV cache size: 4,028,512 tokens", :1734, gpu_worker.py:466
    assert facts.kv_pool_tokens == 4_028_512
    assert facts.max_concurrency == 983.52
    assert facts.kv_cache_memory_gib == 122.94
    assert facts.context_length == 4096
    assert facts.weight_load_s == 0.39
    assert facts.cuda_graph_capture_s == 3.0
    # loggers.py:271 "Engine 000: Avg prompt throughput: ..., Avg generation throughput: ..."
    assert facts.decode_throughput_tps == [4780.0, 10620.6, 10047.6, 4500.5, 5006.1]
    assert facts.spec_accept_lengths == []
    assert facts.warnings == []


def test_vllm_022_real_warm_launch_hits_the_compile_cache() -> None:
    """Arm vllm-warm: the same configuration again; the MLflow run a952440c holds these phases."""
    facts = parse("vllm/server-0.22.0-h200-warm.log")
    assert facts.compile_cache_hit
    aot = "[decorators.py:311] Directly load AOT compilation from path "
    graphs = (
        "[backends.py:292] Directly load the compiled graph(s) for compile range (1, 8192) from the cache"
    )
    hits = [
        line for line in fixture_lines("vllm/server-0.22.0-h200-warm.log") if aot in line or graphs in line
    ]
    assert len(hits) == 2  # both hit lines are there, and either alone counts as a hit
    for line in hits:
        assert get_engine("vllm").parse_log([line]).compile_cache_hit
    assert facts.compiled
    assert facts.compile_cache_dir == CACHE_DIR  # the cold launch's directory: the same key
    assert facts.phase_seconds() == {
        "api_ready": 43.0,  # 20:12:06 -> 20:12:49
        "model_load": 0.594,
        "weight_load": 0.31,
        "init_engine": 15.03,  # "... took 15.03 s (compilation: 2.71 s)"
        "torch_compile": 2.71,  # the AOT load, timed by the same monitor
        "dynamo_transform": 1.75,  # Dynamo still traces on a warm start
        "compile_cache_load": 0.802,
        "initial_profiling": 0.1,
        "cuda_graph_capture": 3.0,
    }
    assert {p.phase: p.within for p in facts.cold_start_phases} == WITHIN
    assert facts.ready
    assert facts.kv_pool_tokens == 4_030_432
    assert facts.max_concurrency == 983.99
    assert facts.kv_cache_memory_gib == 123.0


def test_vllm_022_real_ngram_launch_spec_decoding_lines() -> None:
    """Arm vllm-ngram: its own compile-cache key (cold again); metrics.py:101 'SpecDecoding metrics:'
    lines every 10 s of serving."""
    facts = parse("vllm/server-0.22.0-h200-ngram.log")
    assert facts.version == "0.22.0"
    assert facts.spec_accept_lengths == [1.22, 1.26, 1.29, 1.26, 1.3, 1.25]
    assert facts.spec_accept_length_mean == pytest.approx(1.2633, abs=1e-4)
    assert len(facts.decode_throughput_tps) == 6
    assert facts.decode_throughput_tps[2] == 8758.7
    assert not facts.compile_cache_hit
    assert facts.compiled
    assert facts.compile_cache_dir == (
        "/tmp/k3home/cache/vllm/5bdbe4420932/torch_compile_cache/b0d24114ac/rank_0_0/backbone"
    )
    assert facts.phase_seconds() == {
        "api_ready": 83.0,
        "model_load": 0.668,
        "weight_load": 0.4,
        "init_engine": 29.81,
        "torch_compile": 16.13,
        "dynamo_transform": 4.93,
        "initial_profiling": 0.2,
        "cuda_graph_capture": 3.0,
    }
    assert facts.kv_pool_tokens == 4_029_248
    assert facts.ready


@pytest.mark.parametrize("arm", ["cold", "warm", "ngram"])
def test_real_h200_logs_hold_no_key(arm: str) -> None:
    """The run's API key was made up ('made-up-' + hex, from the environment): no line has it, nor a
    --api-key flag."""
    text = "\n".join(fixture_lines(f"vllm/server-0.22.0-h200-{arm}.log"))
    assert text.startswith("# REAL engine log")
    assert "made-up-" not in text
    assert "--api-key" not in text


def test_vllm_032_real_cpu_log_phases() -> None:
    """The verbatim 0.32.0 CPU run: --enforce-eager, so no compile, and the CPU runner logs no
    'Model loading took' line (weight loading then hangs under the whole start-up)."""
    facts = parse("vllm/server-cpu-tiny-real.log")
    assert facts.phase_seconds() == {"api_ready": 58.0, "weight_load": 0.01, "init_engine": 2.74}
    assert {p.within for p in facts.cold_start_phases} == {None, "api_ready"}
    assert not facts.compiled
    assert not facts.compile_cache_hit


def test_vllm_032_compile_lines_with_model_tag() -> None:
    """0.32.0 tags compile lines with '[backbone] ' (server-torch-compile.log: a cold launch, then a
    warm restart in the same file)."""
    facts = parse("vllm/server-torch-compile.log")
    phases = facts.phase_seconds()
    assert phases["torch_compile"] == 81.95
    assert phases["dynamo_transform"] == 12.87
    assert phases["compile_cache_load"] == 2.113
    assert phases["initial_profiling"] == 5.12
    assert phases["init_engine"] == 57.8  # logged once per engine core: the latest launch's
    assert facts.compile_cache_hit
    assert facts.compile_cache_dir == "/root/.cache/vllm/torch_compile_cache/4f1c2a9e07/rank_0_0/backbone"


def test_vllm_study_log_phases_per_rank() -> None:
    """The 8-GPU study log: model loading is the slowest worker's."""
    facts = parse("vllm/server.log")
    phases = facts.phase_seconds()
    assert phases["weight_load"] == 178.40
    assert phases["init_engine"] == 409.6
    assert phases["api_ready"] == 780.0
    assert "torch_compile" not in phases  # breakable CUDA graphs: compile mode NONE


@pytest.mark.parametrize(
    ("message", "phase", "seconds"),
    [
        # 0.22.0 v1/worker/gpu/model_runner.py:295 (Model Runner V2, Qwen3's default in 0.22)
        ("[model_runner.py:295] Model loading took 15.26 GiB and 5.381204 seconds", "model_load", 5.381),
        # 0.22.0 compilation/decorators.py:672 (VLLM_USE_AOT_COMPILE=0)
        (
            "[decorators.py:672] torch.compile and initial profiling/warmup run together took 31.07 s "
            "in total",
            "torch_compile",
            31.07,
        ),
        # 0.22.0 v1/engine/core.py:309 (nothing compiled)
        (
            "[core.py:309] init engine (profile, create kv cache, warmup model) took 9.12 s",
            "init_engine",
            9.12,
        ),
        # 0.22.0 compilation/backends.py:292 (non-AOT warm start)
        (
            "[backends.py:292] Directly load the compiled graph(s) for compile range (1, 8192) from the "
            "cache, took 1.874 s",
            "compile_cache_load",
            1.874,
        ),
    ],
)
def test_vllm_022_other_wordings(message: str, phase: str, seconds: float) -> None:
    facts = get_engine("vllm").parse_log([PREFIX + message])
    assert facts.phase_seconds() == {phase: seconds}


def test_non_aot_cache_hit_line() -> None:
    line = (
        PREFIX + "[backends.py:292] Directly load the compiled graph(s) for compile range (1, 8192) from the "
        "cache, took 1.874 s"
    )
    assert get_engine("vllm").parse_log([line]).compile_cache_hit


def test_phases_sum_per_rank_and_take_the_slowest() -> None:
    """Target + draft weights add up per rank; ranks load in parallel."""
    lines = [
        "(Worker_TP0 pid=1) INFO 12-01 10:00:00 [default_loader.py:397] Loading weights took 10.00 seconds",
        "(Worker_TP1 pid=2) INFO 12-01 10:00:00 [default_loader.py:397] Loading weights took 12.00 seconds",
        "(Worker_TP0 pid=1) INFO 12-01 10:00:05 [default_loader.py:397] Loading weights took 3.00 seconds",
    ]
    assert get_engine("vllm").parse_log(lines).phase_seconds() == {"weight_load": 13.0}


def test_phase_table_text() -> None:
    facts = parse("vllm/server-0.22.0-h200-cold.log")
    text = phase_table(facts.cold_start_phases)
    lines = text.splitlines()
    assert lines[0].split() == ["phase", "seconds", "read", "from"]
    assert lines[1].startswith("api_ready ")
    assert "   92.00  first timestamped log line" in lines[1]
    assert lines[5].split()[:2] == ["torch_compile", "20.18"]
    assert any(ln.startswith("      dynamo_transform ") for ln in lines)  # three levels down
    assert "phases nest" in lines[-1]


def test_sglang_phases_from_its_real_log() -> None:
    """SGLang 0.5.16 on the H200 (study engines-h200): its start by phase, the prefill CUDA graphs
    (captured per token count up to 8,192) taking most of the first launch and a ninth of it on the
    second, right after (what the warm restart saved: docs/gpu.md)."""
    cold = get_engine("sglang").parse_log(fixture_lines("sglang/real-0.5.16-h200-cold.log"))
    warm = get_engine("sglang").parse_log(fixture_lines("sglang/real-0.5.16-h200-warm.log"))
    assert [(p.phase, p.within) for p in cold.cold_start_phases] == [
        ("api_ready", None),
        ("init_distributed", "api_ready"),
        ("weight_load", "api_ready"),
        ("cuda_graph_capture", "api_ready"),
        ("prefill_graph_capture", "cuda_graph_capture"),
        ("decode_graph_capture", "cuda_graph_capture"),
    ]
    assert cold.phase_seconds() == {
        "api_ready": 118.0, "init_distributed": 0.17, "weight_load": 2.91, "cuda_graph_capture": 81.2,
        "prefill_graph_capture": 78.54, "decode_graph_capture": 2.66,
    }  # fmt: skip
    assert warm.phase_seconds()["prefill_graph_capture"] == 10.71
    assert warm.phase_seconds()["api_ready"] == 47.0
    assert cold.kv_pool_tokens == warm.kv_pool_tokens == 6_910_986
    assert cold.max_running_requests == 16
    assert cold.context_length == 73728
    assert not cold.compile_cache_hit


def test_sglang_reconstructed_study_log_phases_nest_per_rank() -> None:
    """The study's 8-GPU launch (reconstructed from 0.5.23's format strings): the slowest rank's
    target + draft weights, and its graphs."""
    facts = get_engine("sglang").parse_log(fixture_lines("sglang/server.log"))
    assert [p.phase for p in facts.cold_start_phases] == [
        "api_ready", "weight_load", "cuda_graph_capture", "decode_graph_capture"
    ]  # fmt: skip
    assert facts.phase_seconds()["weight_load"] == facts.weight_load_s
    assert not facts.compile_cache_hit
