"""What each engine module knows: endpoints, metric names, flags, integer spellings."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from k3pipe.engines import get_engine
from k3pipe.engines.base import load_flag_table
from k3pipe.engines.sglang import human_readable_int as sglang_int
from k3pipe.engines.vllm import human_readable_int as vllm_int
from k3pipe.planning.plan import plan_arm
from k3pipe.schema.specs import ExperimentSpec
from tests.unit.engines.helpers import FIXTURES, REPO, fixture_lines


def _exposed(path: Path) -> dict[str, dict[str, float]]:
    """family and sample names of a Prometheus text file -> {name: {label-string: value}}."""
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(path.read_text()):
        out.setdefault(family.name, {})
        for sample in family.samples:
            key = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out.setdefault(sample.name, {})[key] = sample.value
    return out


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_metric_names_exist_in_fixture_scrape(kind: str) -> None:
    exposed = _exposed(FIXTURES / kind / "metrics.txt")
    names = get_engine(kind).metric_names
    common = {
        "ttft_seconds",
        "itl_seconds",
        "e2e_seconds",
        "prompt_tokens_total",
        "generation_tokens_total",
        "kv_usage_ratio",
        "requests_running",
        "requests_waiting",
        "preemptions_total",
    }
    assert common - set(names) == set()
    missing = [name for name in names.values() if name not in exposed]
    if kind == "sglang":
        # a labelled counter has no series until something increments it: SGLang's cached-token
        # counter appears with the first prefix-cache hit (this scrape had none; the real 0.5.16 one did)
        assert missing == ["sglang:cached_tokens_total"]
        assert "sglang:cached_tokens_total" in _exposed(FIXTURES / "sglang" / "real-0.5.16-metrics.txt")
    else:
        assert missing == []


def test_vllm_spec_metrics_agree_with_the_log() -> None:
    """The 200K DSpark counters give the same mean acceptance length the log line states (1.15)."""
    exposed = _exposed(FIXTURES / "vllm" / "metrics.txt")
    names = get_engine("vllm").metric_names

    def total(key: str) -> float:
        return sum(exposed[names[key]].values())

    drafts, drafted, accepted = (
        total("spec_drafts_total"),
        total("spec_draft_tokens_total"),
        total("spec_accepted_tokens_total"),
    )
    assert 1 + accepted / drafts == pytest.approx(1.15, abs=0.005)
    assert accepted / drafted == pytest.approx(0.021, abs=0.001)
    log = get_engine("vllm").parse_log(fixture_lines("vllm/server.log"))
    assert log.spec_accept_lengths[-1] == 1.15


def test_sglang_kv_pool_metric_matches_log() -> None:
    exposed = _exposed(FIXTURES / "sglang" / "metrics.txt")
    pool = next(iter(exposed[get_engine("sglang").metric_names["kv_pool_tokens"]].values()))
    assert pool == get_engine("sglang").parse_log(fixture_lines("sglang/server.log")).kv_pool_tokens


def test_sglang_metric_names_against_its_real_0_5_16_scrape() -> None:
    """A real /metrics of SGLang 0.5.16 on the H200 (fixtures/engines/sglang/real-0.5.16-metrics.txt):
    what k3pipe reads is there, but three names (from 0.5.23's source) are not: 0.5.16 counts no
    per-output-token time, reports retractions as a gauge (num_retracted_reqs) and has no verify-call
    counter. The record then lacks those figures for this version, which this test keeps in view."""
    exposed = _exposed(FIXTURES / "sglang" / "real-0.5.16-metrics.txt")
    names = get_engine("sglang").metric_names
    absent = {key for key, name in names.items() if name not in exposed and f"{name}_count" not in exposed}
    assert absent == {"tpot_seconds", "preemptions_total", "spec_verify_calls_total"}
    assert "sglang:num_retracted_reqs" in exposed
    # reconciled with the log of a launch of the same configuration: the same KV pool
    pool = next(iter(exposed[names["kv_pool_tokens"]].values()))
    log = get_engine("sglang").parse_log(fixture_lines("sglang/real-0.5.16-h200-warm.log"))
    assert pool == log.kv_pool_tokens == 6_910_986
    # four completions of 64 tokens after the start-up's warm-up request: counters agree with that
    generated = next(iter(exposed[names["generation_tokens_total"]].values()))
    assert generated >= 4 * 64
    (requests,) = exposed["sglang:e2e_request_latency_seconds_count"].values()
    assert requests == 5


def test_endpoints_and_versions(study: ExperimentSpec) -> None:
    vllm, sglang = get_engine("vllm"), get_engine("sglang")
    assert vllm.health_paths == ("/health",)
    assert vllm.version_path == "/version"
    assert vllm.version_from({"version": "0.32.0"}) == "0.32.0"
    assert sglang.health_paths == ("/health", "/health_generate")
    # /get_server_info is the deprecated alias (logs a deprecation line in 0.5.23)
    assert sglang.version_path == sglang.server_info_path == "/server_info"
    info = {"tp_size": 8, "dcp_size": 8, "max_total_num_tokens": 916672, "version": "0.5.23"}
    assert sglang.version_from(info) == "0.5.23"
    assert sglang.version_from({"version": 5}) is None
    plan = plan_arm(study, study.arm("sglang"), Path("/h"), {"model": "/m", "models.draft": "/d"})
    assert plan.version_url == "http://127.0.0.1:30000/server_info"
    assert plan.health_url == "http://127.0.0.1:30000/health"


def test_flag_tables_know_the_study_flags() -> None:
    """Every flag of the study's two launches (tests/fixtures/field-notes-launches.md) is stock."""
    text = (REPO / "tests" / "fixtures" / "field-notes-launches.md").read_text()
    blocks = re.findall(r"```\n(.*?)```", text, re.S)
    vllm_flags = set(re.findall(r"(--[a-z0-9-]+)", blocks[1]))
    sglang_flags = set(re.findall(r"(--[a-z0-9-]+)", blocks[2]))
    assert "--speculative-config" in vllm_flags
    assert "--dcp-size" in sglang_flags
    assert vllm_flags - load_flag_table("vllm-0.32.0-flags.txt").flags == set()
    assert sglang_flags - load_flag_table("sglang-0.5.23-flags.txt").flags == set()


def test_flag_aliases_and_abbreviations() -> None:
    vllm, sglang = get_engine("vllm"), get_engine("sglang")
    assert vllm.canonical_flag("dcp") == "--decode-context-parallel-size"  # the -dcp short form
    assert vllm.canonical_flag("device_memory_utilization") == "--gpu-memory-utilization"
    assert vllm.canonical_flag("no_enable_prefix_caching") == "--enable-prefix-caching"
    # not a flag, but argparse takes an unambiguous prefix: the study's --kv-cache-memory works
    assert "--kv-cache-memory" not in load_flag_table("vllm-0.32.0-flags.txt").flags
    assert vllm.canonical_flag("kv_cache_memory") == "--kv-cache-memory-bytes"
    assert vllm.flag_suggestions("kv_cache_memory")[0] == "--kv-cache-memory-bytes"
    assert vllm.canonical_flag("dcp_") is None  # ambiguous: --dcp-comm-backend, --dcp-q-replicate, ...
    assert sglang.canonical_flag("decode_context_parallel_size") == "--dcp-size"
    assert sglang.canonical_flag("tensor-parallel-size") == "--tp-size"
    assert sglang.arg({"tensor_parallel_size": 4}, "tp_size") == ("tensor_parallel_size", 4)
    assert vllm.arg({"dcp": 2}, "decode_context_parallel_size") == ("dcp", 2)


def test_human_readable_ints_differ_between_engines() -> None:
    assert vllm_int("1m") == 1_000_000
    assert vllm_int("1M") == 2**20  # vLLM: uppercase is binary
    assert vllm_int("25.6k") == 25_600
    assert vllm_int(1000000) == 1_000_000
    with pytest.raises(ValueError, match="decimals"):
        vllm_int("1.5M")
    assert sglang_int("1M") == 1_000_000  # SGLang: uppercase M is SI
    assert sglang_int("1Mi") == 2**20
    assert sglang_int("25.6k") == 25_600
    with pytest.raises(ValueError, match="case-sensitive"):
        sglang_int("1m")
    vllm = get_engine("vllm")
    assert vllm.context_length({"max_model_len": "1m"}) == 1_000_000
    assert vllm.context_length({"max_model_len": "auto"}) is None
    assert vllm.context_length({"max_model_len": -1}) is None
    assert get_engine("sglang").context_length({"context_length": "1M"}) == 1_000_000


def test_the_models_an_engine_loads_besides_the_served_one() -> None:
    vllm, sglang = get_engine("vllm"), get_engine("sglang")
    draft = {"model": "org/draft", "method": "eagle", "num_speculative_tokens": 3}
    assert vllm.model_references({"speculative_config": draft}) == [("speculative_config.model", "org/draft")]
    # the JSON text form, and a method that needs no draft model
    assert vllm.model_references({"speculative-config": '{"model": "{models.d}"}'}) == [
        ("speculative-config.model", "{models.d}")
    ]
    assert vllm.unpinned_models({"speculative-config": '{"model": "{models.d}"}'}) == []
    assert vllm.model_references({"speculative_config": {"method": "ngram", "prompt_lookup_max": 4}}) == []
    assert sglang.model_references({"speculative_draft_model_path": "/models/draft"}) == [
        ("speculative_draft_model_path", "/models/draft")
    ]
    assert sglang.unpinned_models({"speculative_draft_model_path": "{models.draft}"}) == []
    assert sglang.model_references({}) == []
