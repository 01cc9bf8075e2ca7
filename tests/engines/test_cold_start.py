"""Cold-start phases and compile-cache lines of vLLM's log, in 0.22.0's wording (the GPU node's release;
fixtures constructed from its format strings until the real GPU log replaces them) and 0.32.0's."""

from __future__ import annotations

import pytest

from k3pipe.engines import get_engine
from k3pipe.observe import EngineLogFacts, phase_table
from tests.engines.helpers import fixture_lines

PREFIX = "(EngineCore pid=7) INFO 12-01 19:40:24 "


def parse(name: str) -> EngineLogFacts:
    return get_engine("vllm").parse_log(fixture_lines(name))


def test_vllm_022_cold_launch_phases() -> None:
    facts = parse("vllm/server-0.22.0-h200-cold.log")
    assert facts.version == "0.22.0"
    assert facts.phase_seconds() == {
        "api_ready": 72.0,  # 19:40:02 (first line) -> 19:41:14 (last stamp before uvicorn's line)
        "model_load": 4.613,
        "weight_load": 3.87,
        "init_engine": 44.17,
        "torch_compile": 27.41,
        "dynamo_transform": 6.38,
        "initial_profiling": 1.74,
        "cuda_graph_capture": 11.0,
    }
    within = {p.phase: p.within for p in facts.cold_start_phases}
    assert within == {
        "api_ready": None,
        "model_load": "api_ready",
        "weight_load": "model_load",
        "init_engine": "api_ready",
        "torch_compile": "init_engine",
        "dynamo_transform": "torch_compile",
        "initial_profiling": "init_engine",
        "cuda_graph_capture": "init_engine",
    }
    assert not facts.compile_cache_hit
    assert facts.compiled
    assert facts.compile_cache_dir == (
        "/k3home/cache/vllm/5d0c9e2b7a41/torch_compile_cache/8e1f0a6c2d/rank_0_0/backbone"
    )
    # the existing facts read the 0.22.0 lines too
    assert facts.weight_load_s == 3.87
    assert facts.cuda_graph_capture_s == 11.0
    assert facts.kv_pool_tokens == 879_984
    assert facts.max_concurrency == 107.42
    assert facts.context_length == 8192


def test_vllm_022_warm_launch_hits_the_compile_cache() -> None:
    facts = parse("vllm/server-0.22.0-h200-warm.log")
    assert facts.compile_cache_hit  # decorators.py:311 "Directly load AOT compilation from path %s"
    assert facts.compiled
    phases = facts.phase_seconds()
    assert phases["api_ready"] == 36.0
    assert phases["torch_compile"] == 2.86  # the AOT load, timed by the same monitor
    assert "dynamo_transform" not in phases
    assert phases["init_engine"] == 11.63


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
    assert "   72.00  first timestamped log line" in lines[1]
    assert any(ln.startswith("      dynamo_transform ") for ln in lines)  # three levels down
    assert "phases nest" in lines[-1]


def test_sglang_has_no_phases_but_api_ready() -> None:
    facts = get_engine("sglang").parse_log(fixture_lines("sglang/server.log"))
    assert [p.phase for p in facts.cold_start_phases] == ["api_ready"]
    assert not facts.compile_cache_hit
