"""The GPU run kit: scripts/make_random_llama.py (at a tiny size), scripts/gpu-node.sh (stash, model, run,
collect) and scripts/check_gpu_record.py.

One flow runs here (module fixture): ``gpu-node.sh run`` drives ``k3pipe run`` on an experiment of two
process arms serving k3pipe/testing/fake_engine.py (the scripted vLLM stand-in: /health, /version,
/metrics, vLLM log lines; no real engine, no docker) with a made-up key; ``gpu-node.sh collect`` packs
the store, and check_gpu_record.py must find it complete, and incomplete once a part is removed or
the key planted.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import sqlite3
import struct
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO, TINY_MODEL, VLLM_PYTHON, free_port

NODE = REPO / "scripts" / "gpu-node.sh"
CHECK = REPO / "scripts" / "check_gpu_record.py"
sys.path.insert(0, str(REPO / "scripts"))
import make_random_llama  # noqa: E402
import random_mla  # noqa: E402

from k3pipe.testing import FAKE_ENGINE  # noqa: E402


def _torch_python() -> Path:
    if not VLLM_PYTHON.exists():
        pytest.fail(f"no python with torch at {VLLM_PYTHON}; run the tests with `make test`, which builds it")
    return VLLM_PYTHON


def _safetensors_header(path: Path) -> dict[str, Any]:
    with path.open("rb") as fh:
        (size,) = struct.unpack("<Q", fh.read(8))
        header: dict[str, Any] = json.loads(fh.read(size))
    header.pop("__metadata__", None)
    return header


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_1b_preset_is_a_1b_llama() -> None:
    shape = make_random_llama.PRESETS["1b"]
    assert shape["hidden_size"] == 2048
    assert shape["num_hidden_layers"] == 16
    assert shape["num_attention_heads"] * shape["head_dim"] == 2048
    assert shape["num_key_value_heads"] == 8
    assert shape["intermediate_size"] == 8192
    assert shape["max_position_embeddings"] >= 4096 + 256
    assert make_random_llama.parameter_count(shape) == 977_340_416


def test_random_llama_at_a_tiny_size(tmp_path: Path) -> None:
    out = tmp_path / "models" / "rl"
    flags = ["--preset", "tiny", "--layers", "1", "--hidden", "128", "--heads", "2", "--kv-heads", "1",
             "--intermediate", "256", "--device", "cpu"]  # fmt: skip
    cmd = [str(_torch_python()), str(REPO / "scripts" / "make_random_llama.py"), str(out), *flags]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "random llama written to" in first.stdout

    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_key_value_heads"]) == (128, 1, 1)
    assert config["max_position_embeddings"] == 8192
    assert config["vocab_size"] == 2048
    header = _safetensors_header(out / "model.safetensors")
    assert {t["dtype"] for t in header.values()} == {"BF16"}
    count = sum(math.prod(t["shape"]) for t in header.values())
    shape = make_random_llama.resolve_shape(
        "tiny", {"layers": 1, "hidden": 128, "heads": 2, "kv_heads": 1, "intermediate": 256}
    )
    assert count == make_random_llama.parameter_count(shape)
    info = json.loads((out / make_random_llama.MARKER).read_text())
    assert info["parameters"] == count
    assert info["device"] == "cpu"
    # the tiny demo model's tokenizer, byte for byte
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert _sha(out / name) == _sha(TINY_MODEL / name), name
    assert not list(out.parent.glob(".random-llama-*"))  # no temporary directory left

    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "already at" in again.stdout


def test_the_mqa_preset_builds_at_a_tiny_size(tmp_path: Path) -> None:
    """--preset mqa-7b (the DCP model of experiments/dcp-crossover-h200.yaml) shrunk to one small layer:
    one KV head and 256K positions survive into config.json, the weights match the count."""
    out = tmp_path / "models" / "mqa"
    small = {"layers": 1, "hidden": 256, "heads": 8, "head_dim": 32, "intermediate": 256}
    flags = ["--preset", "mqa-7b", "--device", "cpu"]
    for key, value in small.items():
        flags += [f"--{key.replace('_', '-')}", str(value)]
    cmd = [str(_torch_python()), str(REPO / "scripts" / "make_random_llama.py"), str(out), *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (8, 1, 32)
    assert config["max_position_embeddings"] == 262144
    header = _safetensors_header(out / "model.safetensors")
    assert header["model.layers.0.self_attn.k_proj.weight"]["shape"] == [32, 256]  # one KV head of 32
    count = sum(math.prod(t["shape"]) for t in header.values())
    assert count == make_random_llama.parameter_count(make_random_llama.resolve_shape("mqa-7b", small))


def test_the_mla_preset_builds_at_a_tiny_size(tmp_path: Path) -> None:
    """--preset mla-tiny, the DeepSeek-V3-style structure of --preset mla-moe (issue 51): the safetensors
    header holds one gate/up/down per expert (vLLM and SGLang load no fused expert tensor), the routing
    bias in fp32, every tensor the count predicts; config.json the routing keys the engines read and the
    positions; the marker the config, the count and the KV a token takes."""
    out = tmp_path / "models" / "mla"
    cmd = [str(_torch_python()), str(REPO / "scripts" / "make_random_llama.py"), str(out),
           "--preset", "mla-tiny", "--device", "cpu"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "random MLA model written to" in done.stdout
    shape = random_mla.MLA_PRESETS["mla-tiny"]
    layers, experts = shape["num_hidden_layers"], shape["n_routed_experts"]

    header = _safetensors_header(out / "model.safetensors")
    assert not [n for n in header if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    for layer in range(layers):
        for e in range(experts):
            for proj, rows, cols in (("gate", 64, 256), ("up", 64, 256), ("down", 256, 64)):
                name = f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight"
                assert header[name]["shape"] == [rows, cols], name
        assert header[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"]["dtype"] == "F32"
        assert f"model.layers.{layer}.mlp.shared_experts.gate_proj.weight" in header
        assert header[f"model.layers.{layer}.self_attn.kv_a_proj_with_mqa.weight"]["shape"] == [512 + 64, 256]
    assert "lm_head.weight" in header  # untied: both engines load it by name
    assert {t["dtype"] for n, t in header.items() if not n.endswith("e_score_correction_bias")} == {"BF16"}
    bias = layers * experts
    count = sum(math.prod(t["shape"]) for t in header.values())
    assert count - bias == random_mla.parameter_count(shape, make_random_llama.make_tiny_model.VOCAB)

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["model_type"] == "deepseek_v3"
    for key, value in random_mla.ROUTING.items():
        assert config[key] == value, key
    assert config["max_position_embeddings"] == 262144
    assert (config["kv_lora_rank"], config["qk_rope_head_dim"]) == (512, 64)
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"

    info = json.loads((out / make_random_llama.MARKER).read_text())
    assert info["parameters"] == info["parameters_expected"] == count - bias
    assert info["kv_bytes_per_token"] == {"fp8": 2 * 576, "bf16": 2 * 2 * 576}
    assert info["config"]["topk_method"] == "noaux_tc"
    assert info["preset"] == "mla-tiny"
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "already at" in again.stdout


def test_split_experts_keeps_transformers_order() -> None:
    """transformers' fused gate_up_proj [E, 2I, H] is gate then up (``chunk(2)`` of its output): the
    split gives rows :I to gate_proj and I: to up_proj, down_proj [E, H, I] per expert, cloned."""
    script = (
        "import sys, torch; sys.path.insert(0, sys.argv[1]); import random_mla\n"
        "E, I, H = 3, 2, 4\n"
        "gu = torch.arange(E * 2 * I * H).reshape(E, 2 * I, H)\n"
        "d = torch.arange(E * H * I).reshape(E, H, I)\n"
        "out = random_mla.split_experts({'l.mlp.experts.gate_up_proj': gu, 'l.mlp.experts.down_proj': d,"
        " 'l.mlp.gate.weight': torch.zeros(E, H)}, E)\n"
        "assert len(out) == 3 * E + 1, sorted(out)\n"
        "assert torch.equal(out['l.mlp.experts.2.gate_proj.weight'], gu[2, :I])\n"
        "assert torch.equal(out['l.mlp.experts.2.up_proj.weight'], gu[2, I:])\n"
        "assert torch.equal(out['l.mlp.experts.1.down_proj.weight'], d[1])\n"
        "assert out['l.mlp.experts.0.up_proj.weight'].untyped_storage().data_ptr() != "
        "gu.untyped_storage().data_ptr()\n"
        "try:\n    random_mla.split_experts({'x.mlp.experts.gate_up_proj': gu[:2]}, E)\n"
        "except ValueError as exc:\n    print(exc)\n"
    )
    cmd = [str(_torch_python()), "-c", script, str(REPO / "scripts")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "gate_up_proj: shape (2, 4, 4) is not [3, 2 x I, H]" in done.stdout


def test_the_tiny_model_is_unchanged(tmp_path: Path) -> None:
    """make_tiny_model.py shares its tokenizer code with make_random_llama.py; its output stays the same."""
    out = tmp_path / "tiny"
    done = subprocess.run(
        [str(_torch_python()), str(REPO / "scripts" / "make_tiny_model.py"), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    built = sorted(p.name for p in out.iterdir())
    assert built == sorted(p.name for p in TINY_MODEL.iterdir())
    for name in built:
        assert _sha(out / name) == _sha(TINY_MODEL / name), name


def test_run_takes_run_or_study_and_refuses_any_other_command(tmp_path: Path) -> None:
    """K3PIPE_RUN_COMMAND picks `k3pipe run` or `k3pipe study` (the DCP study's report); anything
    else stops before a key is made or an engine is looked for."""
    env = {**os.environ, "K3PIPE_HOME": str(tmp_path / "home"), "K3PIPE_RUN_COMMAND": "report"}
    done = subprocess.run(["bash", str(NODE), "run"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "K3PIPE_RUN_COMMAND=report: use run or study" in done.stdout + done.stderr
    assert not (tmp_path / "home" / "node-logs" / "api-key").exists()


def test_stash_moves_carried_parts_to_the_stage(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(NODE, repo / "scripts" / "gpu-node.sh")
    bundle = repo / ".gpu" / "bundle"
    bundle.mkdir(parents=True)
    (bundle / "install.sh").write_text("echo hi\n")
    part0, part1 = b"a" * 1000, b"b" * 10
    (bundle / "k3pipe-bundle.part000").write_bytes(part0)
    manifest = {
        "parts": [
            {
                "name": f"k3pipe-bundle.part00{i}",
                "size": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
            for i, data in enumerate((part0, part1))
        ]
    }
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    stage = tmp_path / "stage"
    env = {**os.environ, "K3PIPE_HOME": str(tmp_path / "home"), "K3PIPE_STAGE": str(stage)}
    script = repo / "scripts" / "gpu-node.sh"

    def stash(*paths: str) -> subprocess.CompletedProcess[str]:
        argv = ["bash", str(script), "stash", *paths]
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)

    done = stash()
    assert done.returncode == 0, done.stdout + done.stderr
    assert (stage / "install.sh").read_text() == "echo hi\n"
    assert (stage / "k3pipe-bundle.part000").read_bytes() == part0
    assert not (bundle / "install.sh").exists()  # moved, not copied
    assert "manifest.json: 1 of 2 parts ok, 1 still to come (k3pipe-bundle.part001), 0 bad" in done.stdout
    assert "3 file(s)" in done.stdout

    # the next call carries the next part
    (bundle / "k3pipe-bundle.part001").write_bytes(part1)
    done = stash()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "manifest.json: 2 of 2 parts ok, 0 still to come, 0 bad" in done.stdout
    assert "4 file(s)" in done.stdout

    # a damaged part fails loudly
    (bundle / "k3pipe-bundle.part001").write_bytes(b"x" * 10)
    bad = stash()
    assert bad.returncode != 0
    assert "PART DOES NOT MATCH manifest.json: k3pipe-bundle.part001" in bad.stdout
    assert "!!!" in bad.stdout + bad.stderr
    # nothing carried: a loud failure, not a silent no-op
    none = stash("no/such/dir")
    assert none.returncode != 0
    assert "nothing carried at no/such/dir" in none.stdout + none.stderr


# ------------------------------------------------------------------------------- one flow, then checks


HF_TOKEN = "Tq4Wm8Zr2Xn6Lp0Vb3Kc7Jd"  # a secret k3pipe knows only through the experiment's reference


def _experiment(port: int) -> dict[str, Any]:
    engine = {
        "kind": "vllm",
        "version": "0.32.0",
        "executable": [sys.executable, str(FAKE_ENGINE)],
        "env": {"VLLM_NO_USAGE_STATS": "1", "VLLM_CACHE_ROOT": "{home}/cache/vllm"},
        # hf_token from the environment: the fake engine echoes the flags it ignores into its own log,
        # as a real engine prints its arguments; collect must blank it in the record's copy
        "args": {"startup_delay_s": 0.5, "token_delay_ms": 2, "stats_interval_s": 1, "max_model_len": 4096,
                 "hf_token": "{env.K3PIPE_TEST_HF_TOKEN}"},
    }  # fmt: skip
    launcher = {"kind": "process", "host": "127.0.0.1", "port": port, "startup_timeout_s": 60,
                "stop_timeout_s": 10}  # fmt: skip
    arms = [
        {
            "name": name,
            "engine": engine,
            "launcher": launcher,
            "endpoint": {"api_key_env": "K3PIPE_GPU_API_KEY"},
        }
        for name in ("cold", "warm")
    ]
    return {
        "name": "gpu-kit-test",
        "model": {"source": "local", "path": "{home}/models/llama-1b-random", "served_name": "llama-test"},
        "arms": arms,
        "workloads": [
            {"name": "c4", "input_tokens": 64, "output_tokens": 8, "concurrency": 4, "num_requests": 8,
             "repeats": 2, "warmup_requests": 2, "seed": 1},
            {"name": "prefix", "input_tokens": 96, "output_tokens": 8, "concurrency": 4, "num_requests": 8,
             "dataset": {"kind": "shared_prefix", "prefix_tokens": 64, "groups": 2}, "seed": 2},
            {"name": "poisson", "input_tokens": 64, "output_tokens": 8, "load": "poisson", "rate_rps": 20,
             "concurrency": 8, "num_requests": 10, "duration_s": 5, "warmup_requests": 1, "seed": 3,
             "slo": {"ttft_ms": 500}},
            {"name": "lad", "input_tokens": 64, "output_tokens": 8, "num_requests": 8, "seed": 4,
             "ladder": {"points": [1, 4]}},
            {"name": "cap", "input_tokens": 64, "output_tokens": 8, "load": "poisson", "concurrency": 16,
             "num_requests": 40, "duration_s": 2, "seed": 5, "slo": {"ttft_ms": 500},
             "capacity": {"low": 1, "high": 16, "max_probes": 2}},
        ],
    }  # fmt: skip


class Record:
    def __init__(self, root: Path, out: Path, experiment: Path, logs: str) -> None:
        self.root = root
        self.out = out
        self.experiment = experiment
        self.logs = logs
        self.summary = (out / "summary.txt").read_text()
        self.key = next(
            line.split(": ", 1)[1]
            for line in self.summary.splitlines()
            if line.startswith("made_up_api_key: ")
        )


def _node(sub: list[str], env: dict[str, str], timeout: float) -> str:
    done = subprocess.run(
        ["bash", str(NODE), *sub], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    text = done.stdout + done.stderr
    assert done.returncode == 0, f"gpu-node.sh {' '.join(sub)} failed:\n{text[-6000:]}"
    return text


@pytest.fixture(scope="module")
def record(tmp_path_factory: pytest.TempPathFactory) -> Record:
    """model (tiny) -> run (the one flow) -> collect, as on the node."""
    root = tmp_path_factory.mktemp("gpu-kit")
    experiment = root / "experiment.yaml"
    experiment.write_text(yaml.safe_dump(_experiment(free_port()), sort_keys=False))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("K3PIPE_", "MLFLOW_", "PREFECT_", "OUT"))}
    env.update(
        K3PIPE_HOME=str(root / "home"),
        K3PIPE_EXPERIMENT=str(experiment),
        K3PIPE_PIPELINE_PYTHON=sys.executable,
        K3PIPE_MODEL_PYTHON=str(_torch_python()),
        PREFECT_HOME=str(root / "prefect"),
        K3PIPE_TEST_HF_TOKEN=HF_TOKEN,
    )
    logs = _node(["model", "--preset", "tiny"], env, 300)
    logs += _node(["run", "--deadline", "300"], env, 420)
    out = root / "out"
    # a log k3pipe did not write (as the bench's engine writes its own: gpu-node.sh bench) holding the
    # secret k3pipe knows only through the experiment's reference: collect must blank it
    (root / "home" / "node-logs" / "bench-engine.log").write_text(f"args: --hf-token {HF_TOKEN}\n")
    # twice, as a sitting does after each run: the second packs the first's log (which must hold no key)
    logs += _node(["collect"], {**env, "OUT": str(out)}, 300)
    logs += _node(["collect"], {**env, "OUT": str(out)}, 300)
    return Record(root, out, experiment, logs)


def _check(parts: Path, experiment: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    argv = [str(parts), "--experiment", str(experiment), "--engine-version", "0.32.0", *extra]
    return subprocess.run([sys.executable, str(CHECK), *argv], capture_output=True, text=True, timeout=300)


def test_node_driver_steps_print_timings(record: Record) -> None:
    for step in ("random-weight model", "k3pipe render", "k3pipe preflight", "k3pipe run", "tar.gz"):
        assert f"<== {step}" in record.logs, step
    assert "<== k3pipe run: ok in" in record.logs
    files = sorted(p.name for p in record.out.iterdir())
    assert files == ["record.tar.gz.part-00", "summary.txt"]
    assert "run_rc: 0" in record.summary
    assert "key_occurrences_in_node_logs: 0" in record.summary
    assert record.key.startswith("made-up-")
    assert record.key not in record.logs  # printed nowhere: $OUT/summary.txt alone holds it
    # the key is only in $OUT's summary, not in the record
    with tarfile.open(record.out / "record.tar.gz.part-00") as tar:
        names = tar.getnames()
        inner = tar.extractfile("record/summary.txt")
        assert inner is not None
        assert record.key not in inner.read().decode()
    assert "record/mlflow/mlflow.db" in names
    assert any(n.startswith("record/mlflow/artifacts/") and n.endswith("requests.parquet") for n in names)
    assert any(n.startswith("record/node/nvidia-smi") for n in names)
    assert any(n.startswith("record/logs/run.log") for n in names)


def test_check_finds_the_whole_record(record: Record) -> None:
    done = _check(record.out, record.experiment)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "record: COMPLETE" in out
    assert "key: not found anywhere in the record" in out
    for arm in ("cold", "warm"):
        assert f"arm {arm}: FINISHED" in out
    assert out.count("required: ") == 2
    assert "MISSING" not in out
    for workload in ("c4", "prefix", "poisson", "lad@c1", "lad@c4", "cap@"):
        assert f"  {workload}" in out
    assert out.count("  cap@") == 4  # a capacity search's probes, two per arm, each checked as a workload
    # present or missing, never failing: what other parts of k3pipe add
    for optional in ("cold-start phases", "compile-cache params", "node facts", "nvidia-smi artifacts",
                     "GPU memory series"):  # fmt: skip
        assert optional in out
    # the key given explicitly is looked for too
    assert _check(record.out, record.experiment, "--key-value", record.key).returncode == 0
    # a secret the experiment names by reference: the engine's log as k3pipe wrote it holds none (its
    # output is scrubbed line by line), and a log k3pipe did not write is blanked in the record's copy
    # (collect copies every log through k3pipe's scrubber, k3pipe/ops/scrub.py)
    assert _check(record.out, record.experiment, "--key-value", HF_TOKEN).returncode == 0
    home = record.root / "home"
    assert not any(HF_TOKEN in p.read_text(errors="replace") for p in (home / "logs").glob("*.log"))
    assert HF_TOKEN in (home / "node-logs" / "bench-engine.log").read_text()
    assert "blanked 1 other secret(s) in the copy of bench-engine.log" in record.logs


def _repack(record: Record, dest: Path, change: Any) -> Path:
    """The record unpacked, changed by ``change(root)``, packed again into parts + summary.txt in dest."""
    work = dest / "work"
    with tarfile.open(record.out / "record.tar.gz.part-00") as tar:
        tar.extractall(work, filter="data")
    change(work / "record")
    parts = dest / "parts"
    parts.mkdir()
    whole = dest / "record.tar.gz"
    with tarfile.open(whole, "w:gz") as tar:
        tar.add(work / "record", arcname="record")
    data = whole.read_bytes()
    half = len(data) // 2
    (parts / "record.tar.gz.part-00").write_bytes(data[:half])
    (parts / "record.tar.gz.part-01").write_bytes(data[half:])
    summary = [line for line in record.summary.splitlines() if not line.startswith("record_tar_gz_sha256")]
    summary.append(f"record_tar_gz_sha256: {hashlib.sha256(data).hexdigest()}")
    (parts / "summary.txt").write_text("\n".join(summary) + "\n")
    return parts


def _run_dirs(root: Path, artifact: str) -> list[Path]:
    return sorted(p.parent for p in (root / "mlflow" / "artifacts").rglob(artifact))


def test_check_fails_on_a_missing_part(record: Record, tmp_path: Path) -> None:
    def drop(root: Path) -> None:
        (_run_dirs(root, "requests.parquet")[0] / "requests.parquet").unlink()
        for log in (root / "mlflow" / "artifacts").rglob("logs/*.log"):
            log.unlink()

    done = _check(_repack(record, tmp_path, drop), record.experiment)
    assert done.returncode == 1, done.stdout
    assert "artifact requests.parquet" in done.stdout
    assert "MISSING  artifact logs/<engine log>" in done.stdout
    assert "record: INCOMPLETE" in done.stdout


def test_check_looks_into_every_repeat(record: Record, tmp_path: Path) -> None:
    """c4 runs twice (repeats: 2): each repeat is a run nested under the workload's, holding its own
    requests; the second repeat's requests.parquet missing is named as such."""

    def drop(root: Path) -> None:
        with sqlite3.connect(root / "mlflow" / "mlflow.db") as db:
            (run_id,) = db.execute(
                "select run_uuid from tags where key = 'k3pipe.repeat' and value = '2'"
            ).fetchone()
        experiment_dir = _run_dirs(root, "requests.parquet")[0].parents[1]  # <experiment>/<run>/artifacts
        (experiment_dir / run_id / "artifacts" / "requests.parquet").unlink()

    done = _check(_repack(record, tmp_path, drop), record.experiment)
    assert done.returncode == 1, done.stdout
    assert "MISSING  c4#2: artifact requests.parquet" in done.stdout
    assert "c4#1: artifact requests.parquet" not in done.stdout
    assert "record: INCOMPLETE" in done.stdout


def test_check_looks_into_ladders_and_capacity_searches(record: Record, tmp_path: Path) -> None:
    """A ladder without its summary on the arm run, and a capacity search missing one probe's
    requests and its capacity.json, are named as such."""

    def drop(root: Path) -> None:
        with sqlite3.connect(root / "mlflow" / "mlflow.db") as db:
            db.execute("delete from tags where key = 'k3pipe.ladder.lad'")
            probe, search = db.execute(
                "select t.run_uuid, p.value from tags t join tags p on p.run_uuid = t.run_uuid "
                "and p.key = 'mlflow.parentRunId' where t.key = 'k3pipe.probe' limit 1"
            ).fetchone()
        experiment_dir = _run_dirs(root, "requests.parquet")[0].parents[1]
        (experiment_dir / probe / "artifacts" / "requests.parquet").unlink()
        (experiment_dir / search / "artifacts" / "capacity.json").unlink()

    done = _check(_repack(record, tmp_path, drop), record.experiment)
    assert done.returncode == 1, done.stdout
    assert done.stdout.count("MISSING  lad: engine run tag k3pipe.ladder.lad") == 2  # both arms
    assert "MISSING  cap: artifact capacity.json" in done.stdout
    assert re.search(r"MISSING  cap@[0-9.]+rps: artifact requests\.parquet", done.stdout)
    assert "record: INCOMPLETE" in done.stdout


def test_check_fails_when_the_key_is_in_the_store(record: Record, tmp_path: Path) -> None:
    def plant(root: Path) -> None:
        command = _run_dirs(root, "command.txt")[0] / "command.txt"
        command.write_text(command.read_text() + f"--api-key {record.key}\n")

    done = _check(_repack(record, tmp_path, plant), record.experiment)
    assert done.returncode == 1, done.stdout
    assert "KEY FOUND in 1 file(s)" in done.stdout
    assert "command.txt" in done.stdout


def test_check_refuses_parts_that_do_not_join(record: Record, tmp_path: Path) -> None:
    parts = _repack(record, tmp_path, lambda root: None)
    (parts / "record.tar.gz.part-01").unlink()
    done = _check(parts, record.experiment)
    assert done.returncode != 0
    assert "a part is missing or damaged" in done.stderr
