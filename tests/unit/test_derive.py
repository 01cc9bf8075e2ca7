"""What the recorder derives before it writes (k3pipe.records.derive), on inputs whose answer is set:
the kernels compiled inside a measured window, and the device names an engine chose kernels by
against the node's."""

from __future__ import annotations

from datetime import datetime

from k3pipe.engines import get_engine
from k3pipe.engines.observe import TimedLine
from k3pipe.records.derive import compiles_inside, device_mismatch
from k3pipe.schema.specs import HardwareSpec


def test_a_kernel_compiled_inside_a_measured_window_is_named_and_one_outside_is_not() -> None:
    fmt = get_engine("sglang").log_patterns.format
    start = datetime(2026, 12, 6, 16, 18, 0).timestamp()  # local time, as the engine's log
    windows = [("in1024-out256#1", start, start + 30.0)]
    lines = [
        TimedLine(time="2026-12-06 16:18:10", message="compiling a kernel"),  # inside
        TimedLine(time="2026-12-06 16:17:00", message="compiling another"),  # before: the warm-up
        TimedLine(time=None, message="no stamp"),
    ]
    inside, said = compiles_inside(lines, windows, fmt)
    assert inside == 1
    (warning,) = said
    assert (
        "inside the measured window of in1024-out256#1 (2026-12-06 16:18:10): compiling a kernel" in warning
    )
    assert compiles_inside(lines, [], fmt) == (0, [])


def test_device_names_are_held_against_nvidia_smi_else_the_experiment() -> None:
    # SGLang named a B300 "NVIDIA L20D" (the field notes' pitfall 4)
    assert device_mismatch(["NVIDIA_H100_80GB_HBM3"], ["NVIDIA H100 80GB HBM3"], None) == (
        [],
        "nvidia-smi names the GPU NVIDIA H100 80GB HBM3",
    )
    wrong, named = device_mismatch(["NVIDIA_L20D"], ["NVIDIA B300"], None) or ([], "")
    assert wrong == ["NVIDIA_L20D"]
    assert "nvidia-smi" in named
    hardware = HardwareSpec(gpu_name="NVIDIA B300", gpu_count=8, gpu_memory_gib=268)
    assert device_mismatch(["NVIDIA_B300_SXM6"], [], hardware) == (
        [],
        "the experiment's hardware.gpu_name is 'NVIDIA B300' (no nvidia-smi here)",
    )
    assert device_mismatch(["NVIDIA_L20D"], [], hardware)[0] == ["NVIDIA_L20D"]  # type: ignore[index]
    assert device_mismatch(["NVIDIA_L20D"], [], None) is None
