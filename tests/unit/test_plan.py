"""The GPUs an arm's engine holds (k3pipe.planning.plan: ArmGpus, GpuRequest): read from its launch the way
CUDA and the engines read it. CUDA_VISIBLE_DEVICES in its forms, the docker launcher's devices,
vLLM's device_ids and SGLang's base_gpu_id choosing among what is visible, and where no device is
named the engine's parallel sizes as a count; node-wide for an endpoint k3pipe does not start."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from k3pipe.experiment.load import parse_experiment
from k3pipe.planning.plan import ArmGpus, gpu_indexes, parse_visible_devices, plan_arm

pytestmark = pytest.mark.unit

UUIDS = [f"GPU-{i}a{i}b0c1d-0000-4000-8000-00000000000{i}" for i in range(4)]


def gpus_of(
    tmp_path: Path,
    engine: dict[str, Any] | None = None,
    launcher: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
) -> ArmGpus:
    """The GPUs of a one-arm experiment's arm (``environ``: k3pipe's own environment)."""
    arm: dict[str, Any] = {
        "name": "a",
        "engine": {"kind": "vllm", "executable": ["vllm", "serve"], **(engine or {})},
        "launcher": launcher or {"kind": "process"},
    }
    if arm["launcher"].get("kind") == "external":
        arm["endpoint"] = {"base_url": "http://127.0.0.1:9/v1"}
    spec = parse_experiment(
        {
            "name": "t",
            "model": {"source": "local", "path": "/m"},
            "arms": [arm],
            "workloads": [{"name": "w", "input_tokens": 8, "output_tokens": 4}],
        }
    )
    return plan_arm(spec, spec.arms[0], tmp_path, {"model": "/m"}).gpus(environ)


@pytest.mark.parametrize(
    ("value", "devices"),
    [
        ("0,1", ["0", "1"]),
        (" 2, 3 ", ["2", "3"]),
        ("07", ["7"]),
        (f"{UUIDS[1]},{UUIDS[3]}", [UUIDS[1], UUIDS[3]]),
        ("GPU-1a1b", ["GPU-1a1b"]),  # a prefix: CUDA takes a unique one
        ("", []),  # nothing visible
        ("0,1,-1,2", ["0", "1"]),  # CUDA stops at the first invalid entry
        ("-1", []),
        ("all", []),  # NVIDIA_VISIBLE_DEVICES takes 'all'; CUDA does not
        ("1,1", ["1"]),
    ],
)
def test_cuda_visible_devices_read_as_cuda_reads_them(value: str, devices: list[str]) -> None:
    assert parse_visible_devices(value) == devices


def test_devices_in_the_engines_environment(tmp_path: Path) -> None:
    gpus = gpus_of(tmp_path, {"env": {"CUDA_VISIBLE_DEVICES": "0,1"}, "args": {"tensor_parallel_size": 2}})
    assert (gpus.devices, gpus.count, gpus.basis) == (["0", "1"], 2, "CUDA_VISIBLE_DEVICES")
    assert gpus.source == "engine.env CUDA_VISIBLE_DEVICES='0,1'"
    uuids = gpus_of(tmp_path, {"env": {"CUDA_VISIBLE_DEVICES": f"{UUIDS[2]},{UUIDS[0]}"}})
    assert (uuids.devices, uuids.count) == ([UUIDS[2], UUIDS[0]], 2)
    # more visible than the engine's ranks take: all counted, and the mismatch said
    assert gpus_of(tmp_path, {"env": {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}}).source == (
        "engine.env CUDA_VISIBLE_DEVICES='0,1,2,3'; the engine's parallel size is 1 (tensor_parallel_size 1)"
    )


def test_an_empty_list_holds_no_gpu(tmp_path: Path) -> None:
    gpus = gpus_of(tmp_path, {"env": {"CUDA_VISIBLE_DEVICES": ""}})
    assert (gpus.devices, gpus.count, gpus.basis) == ([], 0, "CUDA_VISIBLE_DEVICES")
    assert gpus.counted(UUIDS) == ([], None)


def test_unset_the_parallel_size_is_a_count(tmp_path: Path) -> None:
    """No device named: the engine's ranks, as a count (the energy is then the node's)."""
    one = gpus_of(tmp_path)
    assert (one.devices, one.count, one.basis, one.source) == (
        None,
        1,
        "parallel size",
        "tensor_parallel_size 1",
    )
    assert one.counted(UUIDS) == (None, None)
    vllm = gpus_of(tmp_path, {"args": {"tp": 2, "pipeline_parallel_size": 2, "data_parallel_size": 2}})
    assert (vllm.count, vllm.source) == (
        8,
        "tensor_parallel_size 2 x pipeline_parallel_size 2 x data_parallel_size 2",
    )
    # decode context and expert parallelism reuse the TP ranks; this node's data-parallel ranks win
    assert (
        gpus_of(tmp_path, {"args": {"tensor_parallel_size": 4, "decode_context_parallel_size": 4}}).count == 4
    )
    local = gpus_of(tmp_path, {"args": {"tensor_parallel_size": 2, "dp": 4, "data_parallel_size_local": 2}})
    assert local.count == 4
    # two nodes share the ranks
    nodes = gpus_of(tmp_path, {"args": {"tensor_parallel_size": 16, "nnodes": 2}})
    assert (nodes.count, nodes.source) == (8, "(tensor_parallel_size 16) / nnodes 2")


def test_sglang_parallel_sizes(tmp_path: Path) -> None:
    sglang = {"kind": "sglang", "executable": ["python", "-m", "sglang.launch_server"]}
    replicas = gpus_of(tmp_path, {**sglang, "args": {"tp_size": 4, "dp_size": 2}})
    assert (replicas.count, replicas.source) == (8, "tp_size 4 x dp_size 2")
    # DP attention: the data-parallel ranks are the tensor-parallel ones
    attention = gpus_of(tmp_path, {**sglang, "args": {"tp": 4, "dp": 2, "enable_dp_attention": True}})
    assert (attention.count, attention.source) == (4, "tp_size 4 (dp_size 2 inside it: enable_dp_attention)")
    picked = gpus_of(tmp_path, {**sglang, "args": {"tp_size": 2, "base_gpu_id": 4}})
    assert (picked.devices, picked.count, picked.basis) == (["4", "5"], 2, "device arguments")
    stepped = gpus_of(tmp_path, {**sglang, "args": {"tp_size": 2, "base_gpu_id": 1, "gpu_id_step": 2}})
    assert stepped.devices == ["1", "3"]
    # base_gpu_id picks among the visible devices
    among = gpus_of(
        tmp_path,
        {**sglang, "env": {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, "args": {"tp_size": 2, "base_gpu_id": 2}},
    )
    assert (among.devices, among.source) == (
        ["6", "7"],
        "engine.env CUDA_VISIBLE_DEVICES='4,5,6,7', then engine.args.base_gpu_id=2",
    )


def test_vllm_device_ids_index_into_the_visible_devices(tmp_path: Path) -> None:
    alone = gpus_of(tmp_path, {"args": {"device_ids": "2,3", "tensor_parallel_size": 2}})
    assert (alone.devices, alone.basis, alone.source) == (
        ["2", "3"],
        "device arguments",
        "engine.args.device_ids=2,3",
    )
    among = gpus_of(
        tmp_path,
        {
            "env": {"CUDA_VISIBLE_DEVICES": "4,5,6,7"},
            "args": {"device_ids": "1,3", "tensor_parallel_size": 2},
        },
    )
    assert among.devices == ["5", "7"]
    assert gpus_of(tmp_path, {"args": {"device_ids": UUIDS[1]}}).devices == [UUIDS[1]]


def test_the_docker_launchers_devices(tmp_path: Path) -> None:
    docker = {"kind": "docker"}
    image = {"image": "vllm/vllm-openai:v0.32.0", "executable": None}
    listed = gpus_of(tmp_path, image, {**docker, "gpus": ["2", "3"]})
    assert (listed.devices, listed.count, listed.basis) == (["2", "3"], 2, "launcher.gpus")
    # inside the container CUDA_VISIBLE_DEVICES picks among the container's devices
    inside = gpus_of(
        tmp_path, {**image, "env": {"CUDA_VISIBLE_DEVICES": "1"}}, {**docker, "gpus": ["2", "3"]}
    )
    assert (inside.devices, inside.count, inside.basis) == (["3"], 1, "CUDA_VISIBLE_DEVICES")
    assert inside.source.startswith("launcher.gpus 2,3, then engine.env CUDA_VISIBLE_DEVICES='1'")
    # a count: how many, not which
    counted = gpus_of(tmp_path, image, {**docker, "gpus": 2})
    assert (counted.devices, counted.count, counted.basis) == (None, 2, "launcher.gpus")
    # a container does not inherit k3pipe's environment
    assert gpus_of(tmp_path, image, docker, {"CUDA_VISIBLE_DEVICES": "5"}).basis == "parallel size"


def test_a_local_engine_inherits_k3pipes_environment(tmp_path: Path) -> None:
    inherited = gpus_of(tmp_path, environ={"CUDA_VISIBLE_DEVICES": "6"})
    assert (inherited.devices, inherited.source) == (["6"], "k3pipe's environment CUDA_VISIBLE_DEVICES='6'")
    # the spec's own wins
    own = gpus_of(tmp_path, {"env": {"CUDA_VISIBLE_DEVICES": "1"}}, environ={"CUDA_VISIBLE_DEVICES": "6"})
    assert own.devices == ["1"]
    # a reference to k3pipe's environment, resolved from it; unset: not known
    ref = {"env": {"CUDA_VISIBLE_DEVICES": "{env.MY_GPUS}"}}
    resolved = gpus_of(tmp_path, ref, environ={"MY_GPUS": "2,3"})
    assert resolved.devices == ["2", "3"]
    assert resolved.source.startswith("engine.env CUDA_VISIBLE_DEVICES='{env.MY_GPUS}';")  # as written
    unset = gpus_of(tmp_path, ref)
    assert (unset.basis, unset.count) == ("parallel size", 1)
    assert "CUDA_VISIBLE_DEVICES={env.MY_GPUS} refers to MY_GPUS, unset here" in unset.source


def test_an_external_endpoint_is_node_wide(tmp_path: Path) -> None:
    gpus = gpus_of(tmp_path, launcher={"kind": "external"})
    assert (gpus.devices, gpus.count, gpus.basis) == (None, None, "node-wide")
    assert gpus.params(None) == {
        "gpus.basis": "node-wide",
        "gpus.source": "an endpoint k3pipe does not start",
        "gpus.counted": "node-wide",
    }


def test_devices_placed_on_the_node() -> None:
    """Indexes as written; a UUID (or a unique prefix of one) by nvidia-smi's index,uuid list; what
    cannot be placed leaves the energy node-wide, saying why."""
    assert gpu_indexes(["3", "1"], UUIDS) == [1, 3]
    assert gpu_indexes([UUIDS[2], "GPU-0a0b"], UUIDS) == [0, 2]
    assert gpu_indexes(["5"], None) == [5]  # not probed: as written
    with pytest.raises(ValueError, match=r"GPU 4 is not on this node \(nvidia-smi lists 4\)"):
        gpu_indexes(["4"], UUIDS)
    with pytest.raises(ValueError, match="matches 4 of the node's GPUs"):
        gpu_indexes(["GPU-"], UUIDS)
    with pytest.raises(ValueError, match="MIG instance"):
        gpu_indexes(["MIG-1a2b"], UUIDS)
    gpus = ArmGpus(devices=[UUIDS[1]], count=1, basis="CUDA_VISIBLE_DEVICES", source="x")
    assert gpus.counted(UUIDS) == ([1], None)
    assert gpus.params(UUIDS)["gpus.counted"] == "1"
    unplaced = gpus.params(None)
    assert unplaced["gpus.counted"] == "node-wide"
    assert (
        unplaced["gpus.counted_note"] == f"{UUIDS[1]} matches 0 of the node's GPUs (its GPUs' UUIDs unknown)"
    )
    assert unplaced["gpus.count"] == 1  # the dollars still take the arm's count
