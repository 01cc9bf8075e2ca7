"""What a cell costs (k3pipe.machine.cost) and the energy beneath it (k3pipe.machine.node.gpu_energy):
nvidia-smi's
power lines parsed as the H200 printed them, the integral checked against power curves whose energy
is known, and the dollars against hand arithmetic."""

from __future__ import annotations

import math

import numpy as np
import pytest

from k3pipe.machine.cost import cell_cost, counted_label, energy_metrics
from k3pipe.machine.node import GpuMemorySample, gpu_energy, parse_memory_query
from k3pipe.schema.specs import HardwareSpec

pytestmark = pytest.mark.unit


def test_memory_and_power_lines() -> None:
    # `nvidia-smi --query-gpu=memory.used,power.draw --format=csv,noheader` on the H200 node, then a
    # board without power readings, then a line that is not a GPU's
    text = "0 MiB, 75.62 W\n131042 MiB, 612.3 W\n512 MiB, [N/A]\n64 MiB, [Not Supported]\nNo devices\n"
    assert parse_memory_query(text) == [(0, 75.62), (131042, 612.3), (512, None), (64, None)]


def samples(gpu: int, times: np.ndarray, watts: np.ndarray) -> list[GpuMemorySample]:
    return [GpuMemorySample(float(t), gpu, 1000, float(w)) for t, w in zip(times, watts, strict=True)]


def test_piecewise_linear_power_is_integrated_exactly() -> None:
    # 100 W at t=0 rising to 300 W at t=2, then flat; held flat before the first sample
    s = samples(0, np.array([0.0, 2.0, 4.0]), np.array([100.0, 300.0, 300.0]))
    energy = gpu_energy(s, -1.0, 5.0)
    assert energy is not None
    # before 0: 100 W x 1 s; 0..2: mean 200 W x 2 s; 2..5: 300 W x 3 s
    assert energy.joules == pytest.approx(100 + 400 + 900)
    assert energy.mean_power_w == pytest.approx(1400 / 6)
    assert energy.samples == 3
    assert energy.gpus == 1
    # a window inside the samples takes the line between them
    inside = gpu_energy(s, 1.0, 3.0)
    assert inside is not None
    assert inside.joules == pytest.approx((200 + 300) / 2 * 1 + 300 * 1)
    assert inside.samples == 1


def test_gpus_add_up_and_missing_power_is_left_out() -> None:
    t = np.arange(0.0, 11.0)
    two = samples(0, t, np.full(t.size, 200.0)) + samples(1, t, np.full(t.size, 500.0))
    no_power = [GpuMemorySample(float(x), 2, 1000, None) for x in t]
    energy = gpu_energy(two + no_power, 0.0, 10.0)
    assert energy is not None
    assert energy.joules == pytest.approx(7000.0)
    assert energy.gpus == 2
    assert gpu_energy(no_power, 0.0, 10.0) is None
    assert gpu_energy(two, 5.0, 5.0) is None  # a window of no length


def test_an_arms_energy_is_its_own_gpus_share() -> None:
    """Four GPUs sampled together, each at its own known draw (one ramping, one without readings):
    an arm's energy is exactly the integral of its GPUs' samples alone, the idle boards beside it
    left out, and the node's is the sum over every GPU."""
    rng = np.random.default_rng(3)
    t = np.sort(np.concatenate(([0.0, 20.0], rng.uniform(0.0, 20.0, 23))))  # uneven, around the window
    watts = {0: np.full(t.size, 90.0), 1: 200.0 + 10.0 * t, 2: np.full(t.size, 650.0)}
    node = [s for gpu, w in watts.items() for s in samples(gpu, t, w)]
    node += [GpuMemorySample(float(x), 3, 1000, None) for x in t]  # a board that reports no power
    mine = gpu_energy(node, 2.0, 18.0, gpus=[1, 2])
    alone = gpu_energy(samples(1, t, watts[1]) + samples(2, t, watts[2]), 2.0, 18.0)
    assert mine is not None
    assert alone is not None
    assert mine == alone
    # over 2..18 s GPU 1 ramps from 220 to 380 W (linear: exact between samples), GPU 2 holds 650 W
    assert mine.joules == pytest.approx(16.0 * (300.0 + 650.0))
    assert mine.gpus == 2
    assert mine.samples == 2 * int(np.sum((t >= 2.0) & (t <= 18.0)))
    whole = gpu_energy(node, 2.0, 18.0)
    assert whole is not None
    assert whole.joules == pytest.approx(mine.joules + 16.0 * 90.0)
    assert whole.gpus == 3
    # a GPU that reports no power leaves nothing to count; an arm of no GPU draws nothing here
    assert gpu_energy(node, 2.0, 18.0, gpus=[3]) is None
    assert gpu_energy(node, 2.0, 18.0, gpus=[]) is None


@pytest.mark.parametrize("interval_s", [0.25, 1.0, 2.0])
def test_sampled_energy_of_a_known_power_curve(interval_s: float) -> None:
    """A GPU whose draw swings between 250 and 650 W with the load (a known curve plus reading noise)
    sampled every interval_s, starting at a random phase: the energy over a 120-s window is within
    1% of the curve's own integral, on average and in 99% of 400 draws."""
    rng = np.random.default_rng(7)

    def power(t: np.ndarray) -> np.ndarray:
        return 450 + 150 * np.sin(2 * np.pi * t / 17.0) + 50 * np.sign(np.sin(2 * np.pi * t / 43.0))

    fine = np.linspace(0.0, 120.0, 1_200_001)
    truth = float(np.sum(np.diff(fine) * (power(fine)[1:] + power(fine)[:-1]) / 2))
    errors = []
    for _ in range(400):
        start = -rng.uniform(0, interval_s)
        t = np.arange(start, 120.0 + interval_s, interval_s)
        watts = power(t) + rng.normal(0, 5.0, t.size)
        energy = gpu_energy(samples(0, t, watts), 0.0, 120.0)
        assert energy is not None
        errors.append(energy.joules / truth - 1)
    errors_arr = np.array(errors)
    assert abs(errors_arr.mean()) < 0.002
    assert np.quantile(np.abs(errors_arr), 0.99) < 0.01


def test_energy_per_token() -> None:
    energy = gpu_energy(samples(0, np.array([0.0, 10.0]), np.array([400.0, 400.0])), 0.0, 10.0)
    got = energy_metrics(energy, {"output_tokens_total": 2000.0, "input_tokens_total": 6000.0})
    assert got["gpu_energy_j"] == pytest.approx(4000.0)
    assert got["gpu_power_w_mean"] == pytest.approx(400.0)
    assert got["energy_j_per_output_token"] == pytest.approx(2.0)
    assert got["energy_j_per_token"] == pytest.approx(0.5)
    # the engine's prompt count (chat template included) wins over the client's
    server = energy_metrics(
        energy,
        {"output_tokens_total": 2000.0, "input_tokens_total": 6000.0, "server_input_tokens_total": 8000.0},
    )
    assert server["energy_j_per_token"] == pytest.approx(0.4)
    # no tokens: the energy, no figure per token; no power: nothing
    assert set(energy_metrics(energy, {"output_tokens_total": 0.0})) == {
        "gpu_energy_j",
        "gpu_power_w_mean",
        "gpu_power_samples",
    }
    assert energy_metrics(None, {"output_tokens_total": 2000.0}) == {}


def hardware(price: float | None, gpus: int = 8) -> HardwareSpec:
    return HardwareSpec(gpu_name="NVIDIA H200", gpu_count=gpus, gpu_memory_gib=140, gpu_hour_usd=price)


def test_dollars_per_million_tokens() -> None:
    # 8 GPUs at $3.50 an hour for 360 s: $2.80; 1.4M output tokens and 5.6M input tokens
    metrics = {"duration_s": 360.0, "output_tokens_total": 1_400_000.0, "input_tokens_total": 5_600_000.0}
    got = cell_cost(metrics, hardware(3.5))
    assert got["cell_usd"] == pytest.approx(2.8)
    assert got["usd_per_m_output_tokens"] == pytest.approx(2.0)
    assert got["usd_per_m_tokens"] == pytest.approx(0.4)
    # twice the GPUs for the same tokens: twice the price per token
    assert cell_cost(metrics, hardware(3.5, gpus=16))["usd_per_m_output_tokens"] == pytest.approx(4.0)
    # no price, no hardware section, no window: no cost
    assert cell_cost(metrics, hardware(None)) == {}
    assert cell_cost(metrics, None) == {}
    assert cell_cost({**metrics, "duration_s": 0.0}, hardware(3.5)) == {}
    # a window with no output: its cost, no figure per token
    assert set(cell_cost({"duration_s": 10.0, "output_tokens_total": 0.0}, hardware(3.5))) == {"cell_usd"}


def test_the_cost_rents_the_arms_gpus_not_the_nodes() -> None:
    """A two-GPU arm on the experiment's eight-GPU node: a quarter of the node's price for the same
    window and tokens; the experiment's count where the arm's is not known; nothing for an arm that
    holds no GPU."""
    metrics = {"duration_s": 360.0, "output_tokens_total": 1_400_000.0, "input_tokens_total": 5_600_000.0}
    node = cell_cost(metrics, hardware(3.5, gpus=8))
    arm = cell_cost(metrics, hardware(3.5, gpus=8), gpus=2)
    assert arm["cell_usd"] == pytest.approx(3.5 * 2 * 0.1)
    assert arm["usd_per_m_output_tokens"] == pytest.approx(node["usd_per_m_output_tokens"] / 4)
    assert arm["usd_per_m_tokens"] == pytest.approx(node["usd_per_m_tokens"] / 4)
    assert cell_cost(metrics, hardware(3.5, gpus=8), gpus=None) == node
    assert cell_cost(metrics, hardware(3.5, gpus=8), gpus=0) == {}


def test_what_an_arms_figures_count_in_words() -> None:
    assert counted_label(2, [0, 1], "CUDA_VISIBLE_DEVICES", 8) == "GPUs 0,1 of 8"
    assert counted_label(1, [3], "device arguments", None) == "GPU 3"
    assert counted_label(2, None, "parallel size", 8) == "2 GPUs by parallel size (energy node-wide: 8 GPUs)"
    assert (
        counted_label(2, None, "parallel size", None, 4)
        == "2 GPUs by parallel size (energy node-wide: 4 GPUs)"
    )
    assert counted_label(None, None, "node-wide", 8, 4) == "node-wide: 8 GPUs"
    assert counted_label(None, None, None, None, 1) == "node-wide: 1 GPU"
    assert counted_label(None, None, "node-wide", None) == "node-wide (GPU count unknown)"
    assert counted_label(0, [], "CUDA_VISIBLE_DEVICES", 8) == "no GPU (by CUDA_VISIBLE_DEVICES)"


def test_cost_is_the_reciprocal_of_throughput() -> None:
    """Dollars per token is price over throughput: an engine twice as fast costs half per token."""
    slow = cell_cost({"duration_s": 100.0, "output_tokens_total": 50_000.0}, hardware(2.0, gpus=1))
    fast = cell_cost({"duration_s": 50.0, "output_tokens_total": 50_000.0}, hardware(2.0, gpus=1))
    assert fast["usd_per_m_output_tokens"] * 2 == pytest.approx(slow["usd_per_m_output_tokens"])
    tps = 50_000.0 / 100.0
    assert slow["usd_per_m_output_tokens"] == pytest.approx(2.0 / 3600 / tps * 1e6)
    assert math.isfinite(slow["cell_usd"])
