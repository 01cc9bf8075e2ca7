"""experiments/kimi-k3-8xb300.yaml renders the study's exact launches, flag for flag."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from k3pipe.experiment.load import load_experiment
from k3pipe.planning.plan import plan_arm

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "field-notes-launches.md"
FIELD_NOTES = REPO.parent / "shared" / "docs" / "field-notes.md"
STUDY = REPO / "experiments" / "kimi-k3-8xb300.yaml"
MODEL_DIRS = {"model": "<model dir>", "models.draft": "<draft dir>", "models.draft_vllm": "<vllm draft dir>"}


def _blocks(text: str) -> list[str]:
    return re.findall(r"```\n(.*?)```", text, re.S)


def _flags(text: str) -> dict[str, object]:
    """'--a 1 --b {"x":1,\n "y":2} --c' -> {'--a': '1', '--b': {'x': 1, 'y': 2}, '--c': True}."""
    out: dict[str, object] = {}
    for segment in re.split(r"\s+(?=--)", " ".join(text.split())):
        flag, _, value = segment.partition(" ")
        assert flag not in out, f"flag {flag} twice"
        value = value.strip()
        out[flag] = json.loads(value) if value.startswith("{") else (value or True)
    return out


def _argv_flags(argv: list[str]) -> dict[str, object]:
    """Flags of a rendered command; the models' mount points read as field-notes' placeholders."""
    out: dict[str, object] = {}
    flag = None
    placeholders = {"/models/model": "<model dir>", "/models/draft": "<draft dir>"}
    for token in argv[argv.index(next(t for t in argv if t.startswith("--"))) :]:
        token = placeholders.get(token, token)
        if token.startswith("--"):
            flag = token
            assert flag not in out, f"flag {flag} twice"
            out[flag] = True
        else:
            assert flag is not None, f"value {token!r} before any flag"
            out[flag] = json.loads(token) if token.startswith('{"') else token
    return out


def _expected() -> tuple[dict[str, str], dict[str, object], dict[str, object]]:
    env_block, vllm_block, sglang_block = _blocks(FIXTURE.read_text())
    env = dict(line.split("=", 1) for line in env_block.split())
    return env, _flags(vllm_block), _flags(sglang_block)


def test_fixture_matches_field_notes() -> None:
    if not FIELD_NOTES.exists():
        pytest.skip(f"{FIELD_NOTES} not present (CI and developers have it)")
    text = FIELD_NOTES.read_text()
    vllm = text[text.index("## vLLM launch") : text.index("## SGLang launch")]
    sglang = text[text.index("## SGLang launch") : text.index("## Cold start")]
    assert _blocks(vllm) + _blocks(sglang) == _blocks(FIXTURE.read_text())


def test_vllm_arm_matches_study() -> None:
    env, vllm_flags, _ = _expected()
    spec = load_experiment(STUDY)
    plan = plan_arm(spec, spec.arm("vllm"), Path("/state"), MODEL_DIRS)
    assert plan.command.env == env
    rendered = _argv_flags(plan.command.argv)
    # k3pipe adds only what it manages: the model directory, host and port
    assert rendered.pop("--model") == "<model dir>"
    assert rendered.pop("--host") == "0.0.0.0"
    assert rendered.pop("--port") == "8000"
    # the one deliberate difference: the draft. The study's launch named the hub id, which vLLM
    # fetched itself at start; k3pipe fetches the vLLM-flavour draft the field notes download
    # (extra_models.draft_vllm), hashes it and mounts it in this arm alone
    speculative = rendered["--speculative-config"]
    expected = vllm_flags["--speculative-config"]
    assert isinstance(speculative, dict)
    assert isinstance(expected, dict)
    assert speculative.pop("model") == "/models/draft_vllm"
    assert expected.pop("model") == "Inferact/Kimi-K3-DSpark"
    assert rendered == vllm_flags
    assert plan.image == "vllm/vllm-openai:kimi-k3"
    assert plan.mounts == {"<model dir>": "/models/model", "<vllm draft dir>": "/models/draft_vllm"}
    assert spec.extra_models["draft_vllm"].model_dump()["id"] == "skyai/Kimi-K3-DSpark"


def test_sglang_arm_matches_study() -> None:
    _, _, sglang_flags = _expected()
    spec = load_experiment(STUDY)
    plan = plan_arm(spec, spec.arm("sglang"), Path("/state"), MODEL_DIRS)
    assert plan.command.env == {}
    rendered = _argv_flags(plan.command.argv)
    # k3pipe adds the key, as a reference to the variable endpoint.api_key_env names (SGLang takes it
    # only as a flag; the value is resolved at launch and never recorded), and /metrics, which the
    # study's launch left off (SGLang serves it only with --enable-metrics)
    assert rendered.pop("--api-key") == "{env.K3PIPE_API_KEY}"
    assert rendered.pop("--enable-metrics") is True
    assert rendered == sglang_flags
    assert plan.image == "lmsysorg/sglang:kimi-k3"
    assert plan.command.argv[:3] == ["python3", "-m", "sglang.launch_server"]
    assert plan.mounts == {"<model dir>": "/models/model", "<draft dir>": "/models/draft"}


def test_study_workloads() -> None:
    spec = load_experiment(STUDY)
    shapes = {(w.input_tokens, w.output_tokens, w.concurrency) for w in spec.workloads}
    assert shapes == {(64000, 3000, 10), (200000, 3000, 10)}


def test_render_cli_prints_the_study(capsys: pytest.CaptureFixture[str]) -> None:
    from typer.testing import CliRunner

    from k3pipe.cli.main import app

    result = CliRunner().invoke(app, ["render", str(STUDY)])
    assert result.exit_code == 0, result.output
    # the whole study first: both arms in order, then the study's two workloads
    assert result.output.startswith("# study kimi-k3-8xb300: 2 arm(s) x 2 workload(s)")
    # two arms compare: two launches each unless an arm says (one holds no restart noise)
    second = (
        "#   2. sglang: sglang on launcher docker, image lmsysorg/sglang:kimi-k3, launched 2 times; also "
        "needs draft"
    )
    assert second in result.output
    assert "# design: 2 arm(s), 2 launch(es) each (interleaved): 4 cold start(s)" in result.output
    assert "= 6 comparison(s) sharing alpha 0.05" in result.output
    assert (
        "#   workload random-200k: 200,000 in / 3,000 out tokens, 10 streams, 10 requests (+0 warm-up), "
        "random prompts" in result.output
    )
    assert "# arm vllm: engine vllm, launcher docker, image vllm/vllm-openai:kimi-k3" in result.output
    assert "--speculative-algorithm DSPARK" in result.output
    assert "VLLM_USE_RUST_FRONTEND=1" in result.output
    assert "docker run --rm --network host --ipc host --init --gpus 8 -v" in result.output
    assert "-e VLLM_USE_RUST_FRONTEND=1 vllm/vllm-openai:kimi-k3 --model /models/model" in result.output
    assert (
        "lmsysorg/sglang:kimi-k3 python3 -m sglang.launch_server --model-path /models/model" in result.output
    )
    # what k3pipe sets besides the spec: each arm's compile cache, SGLang's JIT kernels beside it
    assert "# set by k3pipe: the compile cache of this configuration (key " in result.output
    assert "\nTVM_FFI_CACHE_DIR=/k3pipe/cache/sglang/tvm-ffi\n" in result.output
    assert "-e TRITON_CACHE_DIR=/k3pipe/cache/sglang/triton" in result.output
    assert (
        '\'{"mla_prefill_backend":"TRTLLM_RAGGED","use_prefill_query_quantization":true}\'' in result.output
    )
