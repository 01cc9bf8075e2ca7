"""`k3pipe preflight`: findings grouped by arm, exit 1 on any error."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from typer.testing import CliRunner

from k3pipe.cli.main import app
from tests.unit.engines.helpers import STUDY
from tests.unit.engines.test_preflight import SYNTHETIC_STUDY_CONFIG

runner = CliRunner()


def test_study_preset_exits_zero_with_the_studys_warnings() -> None:
    result = runner.invoke(app, ["preflight", str(STUDY)])
    assert result.exit_code == 0, result.output
    out = result.output
    # 1 info: kv-capacity-skipped (the preset turns SGLang's /metrics on: no sglang-metrics-disabled)
    assert out.startswith("preflight kimi-k3-8xb300: 0 error(s), 5 warning(s), 1 info")
    assert "sglang-metrics-disabled" not in out
    vllm, sglang = out.index("arm vllm (vllm)"), out.index("arm sglang (sglang)")
    assert vllm < out.index("WARNING  vllm-gpu-memory-utilization") < sglang
    # the draft vLLM fetched itself at start in the study is fetched, hashed and mounted by k3pipe now
    assert "unpinned-model" not in out
    assert sglang < out.index("WARNING  sglang-dcp-speculation")
    # the study's "pure cost" case: both arms speculate on random prompts
    assert vllm < out.index("WARNING  speculation-random-prompts") < sglang
    assert sglang < out.index("WARNING  speculation-random-prompts", sglang)
    assert out.index("INFO     kv-capacity-skipped") < vllm  # the experiment-wide finding comes first


def test_error_exits_one(tmp_path: Path) -> None:
    data = yaml.safe_load(STUDY.read_text())
    data["arms"][0]["engine"]["args"]["decode_context_parallel_size"] = 8
    path = tmp_path / "dcp.yaml"
    path.write_text(yaml.safe_dump(data))
    result = runner.invoke(app, ["preflight", str(path)])
    assert result.exit_code == 1
    assert "ERROR    vllm-dcp-speculation" in result.output
    assert "1 error(s)" in result.output


def test_model_config_option_enables_the_kv_check(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(SYNTHETIC_STUDY_CONFIG))  # SYNTHETIC, not Kimi-K3's config
    result = runner.invoke(
        app, ["preflight", str(STUDY), "--model-config", str(config), "--weights-gib", str(8 * 215)]
    )
    assert result.exit_code == 0, result.output
    assert "kv-capacity-skipped" not in result.output
    assert result.output.count("WARNING  kv-capacity") == 2
    assert result.output.index("arm sglang (sglang)") < result.output.index("WARNING  kv-capacity")


def test_downloaded_model_is_read_without_the_option(clean_environ: Path) -> None:
    """The model dir under K3PIPE_HOME (k3pipe.sources.model_dir) supplies config.json and weights."""
    model = clean_environ / "models" / "moonshotai" / "Kimi-K3" / "master"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(SYNTHETIC_STUDY_CONFIG))
    with (model / "model.safetensors").open("wb") as f:
        f.truncate(8 * 215 * 2**30)  # sparse file
    result = runner.invoke(app, ["preflight", str(STUDY)])
    assert result.exit_code == 0, result.output
    assert "kv-capacity-skipped" not in result.output
    assert "WARNING  kv-capacity" in result.output


def test_missing_model_config_is_a_usage_error(tmp_path: Path) -> None:
    result = runner.invoke(app, ["preflight", str(STUDY), "--model-config", str(tmp_path / "nope.json")])
    assert result.exit_code == 2
    assert "--model-config" in result.output
    assert "no such file" in result.output


def test_bad_experiment_is_reported(tmp_path: Path) -> None:
    result = runner.invoke(app, ["preflight", str(tmp_path / "missing.yaml")])
    assert result.exit_code == 2
    assert "experiment file not found" in result.output
