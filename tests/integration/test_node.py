"""The node in the record: nvidia-smi (a fake one first on PATH, printing the GPU node's real output),
the engine interpreter's versions, GPU memory during a workload, and what MLflow gets of it all."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from k3pipe.core.settings import Settings
from k3pipe.experiment.load import parse_experiment
from k3pipe.experiment.preflight import hardware_mismatches
from k3pipe.jobs.arm_run import node_facts
from k3pipe.machine.node import (
    GpuMemorySampler,
    NodeInfo,
    comm_env,
    engine_python,
    gpu_memory_frame,
    interpreter_versions,
    nvidia_smi_report,
    parse_cuda_version,
    parse_gpu_query,
    probe_node,
)
from k3pipe.planning.coldstart import read_cold_start
from k3pipe.planning.plan import plan_arm
from k3pipe.records.recorder import ArmRecorder
from k3pipe.records.tracking import Tracker
from k3pipe.schema.specs import HardwareSpec, WorkloadSpec
from tests.conftest import demo_experiment
from tests.integration.test_record import outcome
from tests.unit.engines.helpers import FIXTURES

REPO = Path(__file__).resolve().parents[2]
H200 = REPO / "tests" / "fixtures" / "node" / "nvidia-smi-h200.txt"
TOPO = REPO / "tests" / "fixtures" / "node" / "nvidia-smi-topo-8gpu.txt"
QUERY = "NVIDIA H200, 143771 MiB, 580.159.04"  # what the node's query answered


def fake_uuid(index: int) -> str:
    """The UUID the fake nvidia-smi gives GPU ``index``."""
    return f"GPU-{index:08x}-5eed-4a1b-9c0d-e1f2a3b4c5d6"


def fake_nvidia_smi(bin_dir: Path, gpus: int = 1, topo: bool = True) -> Path:
    """An ``nvidia-smi`` answering as the GPU node's did; memory.used grows by 1000 MiB a call, GPU i
    draws 300 + 100 i W and has the UUID :func:`fake_uuid` (i);
    ``topo -m`` prints an 8-GPU NVSwitch matrix (``topo``) or fails as an unknown command."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    counter = bin_dir / "calls"
    counter.write_text("0")
    script = bin_dir / "nvidia-smi"
    query = "\\n".join([QUERY] * gpus)
    script.write_text(
        f"""#!/bin/sh
case "$*" in
  *--query-gpu=name,memory.total,driver_version*) printf '{query}\\n' ;;
  *--query-gpu=memory.used*)
    n=$(cat {counter}); n=$((n + 1)); echo $n > {counter}
    i=0; while [ $i -lt {gpus} ]; do
      echo "$((n * 1000 + i)) MiB, $((300 + 100 * i)).00 W"; i=$((i + 1))
    done ;;
  *--query-gpu=index,uuid*)
    i=0; while [ $i -lt {gpus} ]; do
      printf '%d, GPU-%08x-5eed-4a1b-9c0d-e1f2a3b4c5d6\\n' $i $i; i=$((i + 1))
    done ;;
  "") grep -v '^#' {H200} ;;
  "topo -m") {"grep -v '^#' " + str(TOPO) if topo else "exit 6"} ;;
  *) exit 6 ;;
esac
"""
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


@pytest.fixture
def smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    script = fake_nvidia_smi(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{script.parent}:/usr/bin:/bin")
    return script


@pytest.fixture
def no_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))


@pytest.fixture
def tracker(tmp_path: Path) -> Tracker:
    return Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "test", tmp_path / "artifacts")


def test_parse_the_real_outputs() -> None:
    gpus = parse_gpu_query(QUERY + "\n")
    assert [(g.index, g.name, g.memory_total_mib, g.driver_version) for g in gpus] == [
        (0, "NVIDIA H200", 143771, "580.159.04")
    ]
    assert parse_cuda_version(H200.read_text()) == "13.0"
    assert parse_gpu_query("") == []


def test_report_and_probe_with_nvidia_smi(smi: Path) -> None:
    report = nvidia_smi_report()
    assert report is not None
    assert "Driver Version: 580.159.04     CUDA Version: 13.0" in report
    node = probe_node([sys.executable, "-m", "x"], "vllm", {"PATH": "/usr/bin:/bin"}, interpreter=True)
    assert node is not None
    params = node.params()
    assert params["node.gpu_name"] == "NVIDIA H200"
    assert params["node.gpu_count"] == 1
    assert params["node.gpu_memory_mib"] == "143771"
    assert params["node.driver_version"] == "580.159.04"
    assert params["node.cuda_version"] == "13.0"
    assert params["node.engine_python"] == sys.executable
    assert params["node.python_version"] == ".".join(map(str, sys.version_info[:3]))
    # torch and vLLM are not in k3pipe's own venv: no version, no param
    assert "node.torch_version" not in params
    assert "node.vllm_version" not in params
    assert set(node.packages) == {"python", "torch", "vllm"}
    assert "1 x NVIDIA H200 (143771 MiB), driver 580.159.04, CUDA 13.0" in node.describe()
    assert node.topology is not None
    assert node.topology.startswith("\tGPU0\tGPU1")
    assert "GPU7\tNV18\tNV18" in node.topology
    assert node.comm_env == {}  # no NCCL / symmetric-memory variable in that environment


def test_probe_keeps_the_engines_nccl_environment(smi: Path) -> None:
    env = {
        "PATH": "/usr/bin:/bin",
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "NCCL_DEBUG": "INFO",
        "K3PIPE_GPU_API_KEY": "not-a-comm-variable",
        "VLLM_USE_FLASHINFER_SAMPLER": "0",
    }
    node = probe_node(["python3"], "vllm", env)
    assert node is not None
    assert node.comm_env == {
        "NCCL_DEBUG": "INFO",
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    }
    assert list(node.comm_env) == sorted(node.comm_env)
    assert comm_env(None) == {}


def test_no_topology_when_topo_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = fake_nvidia_smi(tmp_path / "bin", topo=False)
    monkeypatch.setenv("PATH", f"{script.parent}:/usr/bin:/bin")
    node = probe_node(["python3"], "vllm")
    assert node is not None
    assert node.topology is None


def test_probe_skips_the_interpreter_of_docker_arms(smi: Path) -> None:
    node = probe_node(["python3", "-m", "vllm"], "vllm")
    assert node is not None
    assert node.python is None
    assert node.packages == {}


def test_no_node_for_external_endpoints(smi: Path, tmp_path: Path) -> None:
    data = demo_experiment(
        8000, launcher={"kind": "external"}, endpoint={"base_url": "http://127.0.0.1:9/v1"}
    )
    spec = parse_experiment(data)
    plan = plan_arm(spec, spec.arms[0], tmp_path)
    assert not plan.launch.starts_engine
    assert node_facts(plan, Settings(home=tmp_path)) is None


def test_nothing_without_nvidia_smi(no_smi: None) -> None:
    assert nvidia_smi_report() is None
    assert probe_node([sys.executable], "vllm", interpreter=True) is None
    with GpuMemorySampler(0.1) as sampler:
        pass
    assert sampler.samples == []
    assert sampler.max_used_mib() is None


def test_interpreter_versions_read_metadata() -> None:
    versions = interpreter_versions(sys.executable, ["pydantic", "not_a_package_k3"])
    import pydantic

    assert versions["pydantic"] == pydantic.VERSION
    assert versions["not_a_package_k3"] is None
    assert interpreter_versions("/nonexistent/python", ["x"]) == {}


def test_engine_python_behind_an_entry_point(tmp_path: Path) -> None:
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    python = bin_dir / "python3.12"
    python.write_text("")
    script = bin_dir / "vllm"
    script.write_text(f"#!{python}\nimport sys\n")
    script.chmod(0o755)
    assert engine_python(str(script)) == str(python)
    assert engine_python("vllm", path=str(bin_dir)) == str(python)
    assert engine_python(str(python)) == str(python)
    plain = bin_dir / "serve"
    plain.write_text("#!/bin/sh\n")
    (bin_dir / "python").write_text("")
    assert engine_python(str(plain)) == str(bin_dir / "python")
    assert engine_python("absent-k3") is None


def test_sampler_samples_every_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = fake_nvidia_smi(tmp_path / "bin2", gpus=2)
    monkeypatch.setenv("PATH", f"{script.parent}:/usr/bin:/bin")
    with GpuMemorySampler(0.1) as sampler:
        pass
    # one sample when it starts and one at the end, each of both GPUs
    assert len(sampler.samples) >= 4
    assert {s.gpu for s in sampler.samples} == {0, 1}
    assert sampler.max_used_mib() == max(s.memory_used_mib for s in sampler.samples)
    frame = gpu_memory_frame(sampler.samples, sampler.samples[0].t)
    assert list(frame.columns) == ["t_s", "gpu", "memory_used_mib", "power_w"]
    assert set(frame.groupby("gpu")["power_w"].unique().map(tuple)) == {(300.0,), (400.0,)}
    assert frame["t_s"].iloc[0] == 0.0
    with GpuMemorySampler(0.1, enabled=False) as off:
        pass
    assert off.samples == []


def recorder(tracker: Tracker, tmp_path: Path) -> ArmRecorder:
    spec = parse_experiment(demo_experiment(8999))
    return ArmRecorder(tracker, plan_arm(spec, spec.arms[0], tmp_path, {"model": "/m"}, {"model": "d" * 64}))


def test_node_in_mlflow(smi: Path, tracker: Tracker, tmp_path: Path) -> None:
    rec = recorder(tracker, tmp_path)
    env = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "PATH": "/usr/bin:/bin"}
    rec.log_node(probe_node([sys.executable], "vllm", env, interpreter=True))
    rec.log_nvidia_smi_after(nvidia_smi_report())
    run = tracker.client.get_run(rec.run_id)
    assert run.data.params["node.gpu_name"] == "NVIDIA H200"
    assert run.data.params["node.cuda_version"] == "13.0"
    assert run.data.params["node.driver_version"] == "580.159.04"
    paths = {a.path for a in tracker.client.list_artifacts(rec.run_id, "node")}
    assert paths == {
        "node/nvidia-smi-before.txt",
        "node/nvidia-smi-after.txt",
        "node/nvidia-smi-topo.txt",
        "node/comm-env.json",
    }
    topo = tracker.client.download_artifacts(rec.run_id, "node/nvidia-smi-topo.txt", str(tmp_path / "dl"))
    assert "NV18" in Path(topo).read_text()
    facts = tracker.client.download_artifacts(rec.run_id, "node/comm-env.json", str(tmp_path / "dl"))
    assert json.loads(Path(facts).read_text()) == {k: v for k, v in env.items() if k != "PATH"}


@pytest.mark.parametrize("logged", ["NVIDIA_H200", "NVIDIA_L20D"])
def test_the_device_the_engine_chose_kernels_for_is_checked_against_nvidia_smi(
    smi: Path, tracker: Tracker, tmp_path: Path, logged: str
) -> None:
    """The node is an H200 (nvidia-smi's fixture); the engine's log names the device its MoE kernel
    configs were chosen for. Field notes' pitfall 4 (SGLang logged "NVIDIA L20D" on a B300 node): a
    name that is not nvidia-smi's is a warning the report shows, and a metric; the right one is not."""
    from tests.unit.engines.test_engine_logs import _vllm_moe_lines

    rec = recorder(tracker, tmp_path)
    rec.log_node(probe_node([sys.executable], "vllm", {"PATH": "/usr/bin:/bin"}))
    log = tmp_path / "engine.log"
    log.write_text("\n".join(_vllm_moe_lines(logged)) + "\n")
    rec.finish("FINISHED", log_path=log)
    run = tracker.client.get_run(rec.run_id)
    assert run.data.tags["k3pipe.engine_device_names"] == logged
    assert run.data.metrics["engine_log.untuned_kernel_lines"] == 2
    warnings = run.data.tags["k3pipe.engine_warnings"].split(" | ")
    assert warnings[-1].startswith(
        "a kernel ran on a config its engine calls possibly sub-optimal (the default, none tuned for the "
        "device, or one tuned under another Triton version) on 2 log lines (1 rank, first "
        "12-05 07:10:03, last 12-05 07:10:04): Using default MoE config."
    ), warnings
    wrong = (
        "the engine chose kernels for device NVIDIA_L20D but nvidia-smi names the GPU NVIDIA H200: kernel "
        "configs and backends picked by device name may not be this GPU's"
    )
    if logged == "NVIDIA_H200":
        assert run.data.metrics["engine_log.device_name_mismatch"] == 0
        assert not any("nvidia-smi names" in w for w in warnings)
    else:
        assert run.data.metrics["engine_log.device_name_mismatch"] == 1
        assert warnings[0] == wrong


@pytest.mark.parametrize(
    ("engine", "log", "first"),
    [
        ("vllm", "vllm/server-0.22.0-h100-mla.log", None),
        ("sglang", "sglang/real-0.5.16-h100-mla-bounded.log", "2026-12-06 09:26:59"),
        ("sglang", "sglang/real-0.5.16-h100-mla-flashmla.log", "2026-12-06 13:08:03"),
    ],
)
@pytest.mark.parametrize(("gpu", "mismatch"), [("NVIDIA H100 80GB HBM3", 0), ("NVIDIA H200", 1)])
def test_the_device_check_on_the_engines_real_h100_moe_lines(
    tracker: Tracker, tmp_path: Path, engine: str, log: str, first: str | None, gpu: str, mismatch: int
) -> None:
    """The MoE kernel-config lines vLLM 0.22.0 and SGLang 0.5.16 logged on the H100 of 2026-12-06
    (the MLA study's two sittings: SGLang's bounded retry of the first, its FlashMLA launch of the
    second): the device they name is the GPU nvidia-smi named there, so the check passes; the same
    lines on an H200 node are flagged, the warning naming both. SGLang's lines also count as untuned
    kernels (its Triton-version fallback and the down projection's), vLLM's (a tuned config) does not."""
    rec = recorder(tracker, tmp_path)
    rec.plan = rec.plan.model_copy(update={"engine": engine})
    rec.gpu_names = [gpu]  # as log_node sets them from nvidia-smi
    rec.finish("FINISHED", log_path=FIXTURES / log)
    run = tracker.client.get_run(rec.run_id)
    assert run.data.tags["k3pipe.engine_device_names"] == "NVIDIA_H100_80GB_HBM3"
    assert run.data.metrics["engine_log.device_name_mismatch"] == mismatch
    assert run.data.metrics["engine_log.untuned_kernel_lines"] == (2 if engine == "sglang" else 0)
    warnings = run.data.tags.get("k3pipe.engine_warnings", "").split(" | ")
    wrong = (
        "the engine chose kernels for device NVIDIA_H100_80GB_HBM3 but nvidia-smi names the GPU "
        "NVIDIA H200: kernel configs and backends picked by device name may not be this GPU's"
    )
    assert (wrong in warnings) == bool(mismatch)
    assert not any("nvidia-smi names" in w for w in warnings if w != wrong)
    untuned = [w for w in warnings if w.startswith("a kernel ran on a config its engine calls")]
    if first is None:
        assert untuned == []
    else:
        (said,) = untuned
        assert f"on 2 log lines (first {first}, last {first}): Config file not found at " in said
        assert "Fallback to triton version 3.1.0" in said


@pytest.mark.parametrize(("logged", "mismatch"), [("NVIDIA_B300_SXM6_AC", 0), ("NVIDIA_L20D", 1)])
def test_without_nvidia_smi_the_engines_device_is_checked_against_the_experiments_hardware(
    no_smi: None, tracker: Tracker, tmp_path: Path, logged: str, mismatch: int
) -> None:
    """Where k3pipe has no nvidia-smi to ask (an endpoint, a cluster manager's node), the study's own
    case: SGLang's "NVIDIA L20D" on the B300 the experiment's hardware: names."""
    from tests.unit.engines.test_engine_logs import _vllm_moe_lines

    rec = recorder(tracker, tmp_path)
    rec.plan = rec.plan.model_copy(
        update={"hardware": HardwareSpec(gpu_name="NVIDIA B300", gpu_count=8, gpu_memory_gib=267.69)}
    )
    rec.log_node(probe_node([sys.executable], "vllm", {}))  # None: nothing recorded
    log = tmp_path / "engine.log"
    log.write_text("\n".join(_vllm_moe_lines(logged)) + "\n")
    rec.finish("FINISHED", log_path=log)
    run = tracker.client.get_run(rec.run_id)
    assert run.data.metrics["engine_log.device_name_mismatch"] == mismatch
    first = run.data.tags["k3pipe.engine_warnings"].split(" | ")[0]
    assert first.startswith("the engine chose kernels for device NVIDIA_L20D but the experiment's") == bool(
        mismatch
    ), first


def test_the_experiments_hardware_is_checked_against_the_node() -> None:
    """Each word of gpu_name in nvidia-smi's name, no fewer GPUs than gpu_count, memory within 10%."""
    node = NodeInfo(gpus=parse_gpu_query(QUERY + "\n"), cuda_version="13.0", nvidia_smi="")
    b300 = NodeInfo(
        gpus=parse_gpu_query("\n".join("NVIDIA B300 SXM6 AC, 274106 MiB, 590.1" for _ in range(8))),
        cuda_version="13.0",
        nvidia_smi="",
    )
    h200 = HardwareSpec(gpu_name="NVIDIA H200", gpu_count=1, gpu_memory_gib=139)
    assert hardware_mismatches(h200, node.gpus) == []
    assert hardware_mismatches(h200.model_copy(update={"gpu_name": "h200"}), node.gpus) == []
    assert hardware_mismatches(None, node.gpus) == []
    study = HardwareSpec(gpu_name="NVIDIA B300", gpu_count=8, gpu_memory_gib=267.69)
    assert hardware_mismatches(study, b300.gpus) == []  # the study's preset on its own node
    assert hardware_mismatches(study, node.gpus) == [
        "hardware.gpu_name is 'NVIDIA B300' but nvidia-smi names the GPU NVIDIA H200",
        "hardware.gpu_count is 8 but nvidia-smi lists 1 GPU",
        "hardware.gpu_memory_gib is 267.69 but nvidia-smi reports 140.4 GiB per GPU (the preflight's KV "
        "capacity used the experiment's figure)",
    ]
    assert hardware_mismatches(h200.model_copy(update={"gpu_name": "NVIDIA H20"}), node.gpus) == [
        "hardware.gpu_name is 'NVIDIA H20' but nvidia-smi names the GPU NVIDIA H200"
    ]


def test_a_node_unlike_the_experiments_hardware_is_a_finding_of_the_report(
    smi: Path, tracker: Tracker, tmp_path: Path
) -> None:
    from k3pipe.jobs.study_run import start_study
    from k3pipe.report import build_report

    spec = parse_experiment(demo_experiment(8999))
    hardware = HardwareSpec(gpu_name="NVIDIA B300", gpu_count=8, gpu_memory_gib=267.69)
    spec = spec.model_copy(update={"hardware": hardware})
    study = start_study(tracker, spec, "b300.yaml")
    rec = ArmRecorder(tracker, plan_arm(spec, spec.arms[0], tmp_path), parent_id=study)
    rec.log_node(probe_node([sys.executable], "vllm", {"PATH": "/usr/bin:/bin"}))
    w = WorkloadSpec(name="w", input_tokens=8, output_tokens=4, num_requests=4, concurrency=1)
    rec.log_workload(w, outcome(w, 0, 0.1))
    rec.finish("FINISHED")
    run = tracker.client.get_run(rec.run_id)
    assert run.data.metrics["node.hardware_mismatch"] == 1
    assert run.data.tags["k3pipe.node_mismatch"].startswith(
        "hardware.gpu_name is 'NVIDIA B300' but nvidia-smi names the GPU NVIDIA H200 | hardware.gpu_count"
    )
    tracker.client.set_terminated(study, "FINISHED")
    text = build_report(tracker, study).markdown
    assert "[node] hardware.gpu_name is 'NVIDIA B300' but nvidia-smi names the GPU NVIDIA H200" in text


def test_workload_gpu_memory_in_mlflow(smi: Path, tracker: Tracker, tmp_path: Path) -> None:
    """Memory, power and the energy per token (300 W for the workload's window), and with a price in
    hardware: the dollars, of the one GPU the arm's engine takes (its tensor_parallel_size, 1 by
    default), not the experiment's 8."""
    rec = recorder(tracker, tmp_path)
    rec.plan = rec.plan.model_copy(
        update={
            "hardware": HardwareSpec(
                gpu_name="NVIDIA H200", gpu_count=8, gpu_memory_gib=140, gpu_hour_usd=3.6
            )
        }
    )
    rec.log_gpus(rec.plan.gpus({}), probe_node([sys.executable], "vllm", {"PATH": "/usr/bin:/bin"}))
    params = tracker.client.get_run(rec.run_id).data.params
    assert (params["gpus.basis"], params["gpus.count"], params["gpus.counted"]) == (
        "parallel size",
        "1",
        "node-wide",
    )
    workload = WorkloadSpec(name="w", input_tokens=8, output_tokens=4, num_requests=2, warmup_requests=0)
    with GpuMemorySampler(0.1) as sampler:
        pass
    measured = outcome(workload, 0, 0.05)
    measured = type(measured)(**{**measured.__dict__, "gpu_memory": sampler.samples})
    run_id = rec.log_workload(workload, measured)
    run = tracker.client.get_run(run_id)
    metrics = run.data.metrics
    assert metrics["gpu_memory_used_mib_max"] == sampler.max_used_mib()
    local = tracker.client.download_artifacts(run_id, "gpu_memory.parquet", str(tmp_path))
    frame = pd.read_parquet(local)
    assert len(frame) == len(sampler.samples)
    assert (frame["power_w"] == 300.0).all()
    window = metrics["duration_s"]
    assert metrics["gpu_power_w_mean"] == pytest.approx(300.0)
    assert metrics["gpu_energy_j"] == pytest.approx(300.0 * window)
    tokens = metrics["output_tokens_total"]
    assert metrics["energy_j_per_output_token"] == pytest.approx(300.0 * window / tokens)
    # its energy is the node's (one GPU here): only a count is known, no device
    assert run.data.tags["k3pipe.energy_gpus"] == "1 GPU by parallel size (energy node-wide: 1 GPU)"
    # 1 GPU at $3.60 an hour: 0.1 cents a second
    assert metrics["cell_usd"] == pytest.approx(0.001 * window)
    assert metrics["usd_per_m_output_tokens"] == pytest.approx(0.001 * window / tokens * 1e6)
    # the arm's overview repeats the two figures a team compares
    arm = tracker.client.get_run(rec.run_id).data.metrics
    assert arm["w.energy_j_per_output_token"] == pytest.approx(metrics["energy_j_per_output_token"])
    assert arm["w.usd_per_m_output_tokens"] == pytest.approx(metrics["usd_per_m_output_tokens"])
    # without samples (no nvidia-smi) neither the metric nor the series
    other = WorkloadSpec(name="v", input_tokens=8, output_tokens=4, num_requests=2, warmup_requests=0)
    bare = rec.log_workload(other, outcome(other, 0, 0.05))
    bare_metrics = tracker.client.get_run(bare).data.metrics
    assert "gpu_memory_used_mib_max" not in bare_metrics
    assert "energy_j_per_output_token" not in bare_metrics
    assert "usd_per_m_output_tokens" in bare_metrics  # the price needs no GPU
    assert "gpu_memory.parquet" not in {a.path for a in tracker.client.list_artifacts(bare)}


def test_uuids_place_the_arms_gpus_on_the_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """nvidia-smi's index,uuid list, read with the node's facts, places a CUDA_VISIBLE_DEVICES of
    UUIDs (or unique prefixes of them) on their indexes; one the node lacks leaves the energy
    node-wide, and the run says why."""
    script = fake_nvidia_smi(tmp_path / "bin4", gpus=4)
    monkeypatch.setenv("PATH", f"{script.parent}:/usr/bin:/bin")
    node = probe_node(["python3"], "vllm")
    assert node is not None
    assert [g.uuid for g in node.gpus] == [fake_uuid(i) for i in range(4)]
    visible = f"{fake_uuid(3)},{fake_uuid(1)[:12]}"
    spec = parse_experiment(demo_experiment(8999))
    arm = spec.arms[0]
    arm = arm.model_copy(
        update={"engine": arm.engine.model_copy(update={"env": {"CUDA_VISIBLE_DEVICES": visible}})}
    )
    gpus = plan_arm(spec, arm, tmp_path).gpus()
    assert gpus.counted([g.uuid for g in node.gpus]) == ([1, 3], None)
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "test", tmp_path / "artifacts")
    rec = ArmRecorder(tracker, plan_arm(spec, arm, tmp_path))
    rec.log_gpus(gpus, node)
    run = tracker.client.get_run(rec.run_id)
    assert run.data.params["gpus.counted"] == "1,3"
    assert run.data.params["gpus.basis"] == "CUDA_VISIBLE_DEVICES"
    assert run.data.tags["k3pipe.gpus"] == "GPUs 1,3 of 4"
    elsewhere = ArmRecorder(tracker, plan_arm(spec, arm, tmp_path))
    elsewhere.log_gpus(gpus, node.model_copy(update={"gpus": node.gpus[:2]}))
    params = tracker.client.get_run(elsewhere.run_id).data.params
    assert (params["gpus.counted"], params["gpus.count"]) == ("node-wide", "2")
    assert params["gpus.counted_note"] == f"{fake_uuid(3)} matches 0 of the node's GPUs (2 GPUs listed)"


def test_two_arms_get_the_energy_and_per_gpu_figures_of_their_own_gpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A study of two arms on a node of four fake GPUs (GPU i draws 300 + 100 i W): 'one' holds GPU 3
    (CUDA_VISIBLE_DEVICES=3), 'two' GPUs 0 and 1 (by UUID, one written as a prefix). Each launches
    the scripted engine as a local process and runs a two-point ladder; each point's energy is its
    own GPUs' draw (600 W, 700 W, not the node's 1800 W) over its window, its dollars its own count
    of GPUs, and the report's tokens per GPU divide by that count and say which GPUs they are."""
    from k3pipe.experiment.params import RunRequest
    from k3pipe.jobs.steps import Job
    from k3pipe.jobs.study import study
    from k3pipe.report import build_report
    from tests.conftest import TINY_MODEL, free_port
    from tests.integration.test_secrets import ENGINE_SCRIPT

    if not (TINY_MODEL / "config.json").is_file():
        pytest.skip(f"no tiny model at {TINY_MODEL} (make model)")
    script = fake_nvidia_smi(tmp_path / "bin", gpus=4)
    monkeypatch.setenv("PATH", f"{script.parent}:/usr/bin:/bin")
    visible = {"one": "3", "two": f"{fake_uuid(0)},{fake_uuid(1)[:12]}"}
    experiment = {
        "name": "own-gpus",
        "model": {"source": "local", "path": str(TINY_MODEL)},
        "hardware": {"gpu_name": "NVIDIA H200", "gpu_count": 4, "gpu_memory_gib": 140, "gpu_hour_usd": 3.6},
        "arms": [
            {
                "name": name,
                "engine": {
                    "kind": "vllm",
                    "executable": [sys.executable, str(ENGINE_SCRIPT)],
                    "env": {"CUDA_VISIBLE_DEVICES": devices, "SCRIPTED_ENGINE_INTER_TOKEN_S": "0.05"},
                    "args": {"tensor_parallel_size": len(devices.split(","))},
                },
                "launcher": {"kind": "process", "port": free_port(), "startup_timeout_s": 120},
                "endpoint": {"model": "scripted"},
                "launches": 1,  # what is tested is each arm's GPUs, not a verdict
            }
            for name, devices in visible.items()
        ],
        "workloads": [
            # tokens 50 ms apart: a TPOT to place each point by (at a few ms, small writes on a kept-alive
            # connection wait for the 40-ms delayed ACK and arrive as one)
            {"name": "lad", "input_tokens": 16, "output_tokens": 4, "num_requests": 4, "warmup_requests": 0,
             "ladder": {"over": "concurrency", "points": [1, 2]}}
        ],
    }  # fmt: skip
    exp = tmp_path / "own-gpus.yaml"
    exp.write_text(yaml.safe_dump(experiment))
    job = Job.library(Settings())
    result = study(RunRequest(experiment=str(exp)), job)

    gpus = {"one": 1, "two": 2}
    watts = {"one": 600.0, "two": 300.0 + 400.0}
    labels = {"one": "GPU 3 of 4", "two": "GPUs 0,1 of 4"}
    tps: dict[tuple[str, float], float] = {}
    for arm in result.arms:
        assert arm.status == "FINISHED", arm.error
        run = job.tracker.client.get_run(arm.mlflow_run_id)
        counted = {"one": "3", "two": "0,1"}[arm.arm]
        assert (run.data.params["gpus.counted"], run.data.params["gpus.count"]) == (
            counted,
            str(gpus[arm.arm]),
        )
        assert run.data.params["gpus.basis"] == "CUDA_VISIBLE_DEVICES"
        assert run.data.tags["k3pipe.gpus"] == labels[arm.arm]
        points = job.tracker.children(arm.mlflow_run_id)
        assert len(points) == 2
        for point in points:
            m = point.data.metrics
            assert point.data.tags["k3pipe.energy_gpus"] == labels[arm.arm]
            assert m["gpu_power_w_mean"] == pytest.approx(watts[arm.arm])
            assert m["gpu_energy_j"] == pytest.approx(watts[arm.arm] * m["duration_s"])
            assert m["cell_usd"] == pytest.approx(3.6 * gpus[arm.arm] * m["duration_s"] / 3600)
            tps[(arm.arm, float(point.data.tags["k3pipe.ladder_point"]))] = m["output_throughput_tps"]
        # the node's every GPU is still in the series, for whoever reads it
        local = job.tracker.client.download_artifacts(
            points[0].info.run_id, "gpu_memory.parquet", str(tmp_path)
        )
        assert set(pd.read_parquet(local)["gpu"]) == {0, 1, 2, 3}

    report = build_report(job.tracker, result.study_run_id)
    per_gpu = {(p.arm, p.point): p.per_gpu_tps for p in report.analysis.pareto}
    assert per_gpu == pytest.approx({key: value / gpus[key[0]] for key, value in tps.items()})
    assert "over each arm's own GPUs: one: GPU 3 of 4; two: GPUs 0,1 of 4" in report.markdown
    assert "GPU energy and dollars count each arm's own GPUs (one: GPU 3 of 4; two: GPUs 0,1 of 4)" in (
        report.markdown
    )


def test_cold_start_in_mlflow(tracker: Tracker, tmp_path: Path) -> None:
    """The phase table at finish, compile-cache params at plan time, the hit and both cold starts
    when the engine is ready."""
    spec = parse_experiment(
        {
            "name": "t",
            "model": {"source": "local", "path": "/m"},
            "arms": [
                {
                    "name": "a",
                    "engine": {"kind": "vllm", "version": "0.22.0", "executable": ["python", "-m", "vllm"]},
                    "launcher": {"kind": "process"},
                }
            ],
            "workloads": [{"name": "w", "input_tokens": 8, "output_tokens": 4}],
        }
    )
    plan = plan_arm(spec, spec.arms[0], tmp_path, {"model": "/m"}, {"model": "d" * 64})
    assert plan.compile_cache is not None
    cold_log = tmp_path / "cold.log"
    cold_log.write_text((FIXTURES / "vllm" / "server-0.22.0-h200-cold.log").read_text())
    warm_log = tmp_path / "warm.log"
    warm_log.write_text((FIXTURES / "vllm" / "server-0.22.0-h200-warm.log").read_text())

    first = ArmRecorder(tracker, plan)
    first.log_plan(spec, "x.yaml", {})
    first.log_cold_start(read_cold_start(plan, cold_log, 80.0, first.run_id))
    first.finish("FINISHED", log_path=cold_log)
    second = ArmRecorder(tracker, plan)
    second.log_plan(spec, "x.yaml", {})
    second.log_cold_start(read_cold_start(plan, warm_log, 40.0, second.run_id))
    second.finish("FINISHED", log_path=warm_log)

    one = tracker.client.get_run(first.run_id)
    assert one.data.params["compile_cache.key"] == plan.compile_cache.key
    assert one.data.params["compile_cache.dir"] == plan.compile_cache.dir
    assert one.data.params["compile_cache.source"] == "k3pipe"
    assert one.data.metrics["compile_cache.hit"] == 0
    assert "compile_cache.first_cold_start_s" not in one.data.metrics
    assert one.data.metrics["cold_start.torch_compile_s"] == 20.18
    assert one.data.metrics["cold_start.api_ready_s"] == 92.0
    assert one.data.metrics["cold_start.cuda_graph_capture_s"] == 3.0
    paths = {a.path for a in tracker.client.list_artifacts(first.run_id)}
    assert {"cold_start_phases.json", "cold_start_phases.txt", "compile_cache.json"} <= paths
    local = tracker.client.download_artifacts(first.run_id, "cold_start_phases.json", str(tmp_path))
    table = json.loads(Path(local).read_text())
    assert table[0]["phase"] == "api_ready"

    two = tracker.client.get_run(second.run_id)
    assert two.data.metrics["compile_cache.hit"] == 1
    assert two.data.metrics["compile_cache.first_cold_start_s"] == 80.0
    assert two.data.metrics["compile_cache.warm_over_cold"] == 0.5
    assert two.data.params["compile_cache.first_run_id"] == first.run_id
    assert two.data.metrics["cold_start.torch_compile_s"] == 2.71
